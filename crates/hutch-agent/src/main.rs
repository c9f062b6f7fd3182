//! hutch-agent: PID 1 of a hutch sandbox. Runs and streams commands and
//! serves files for the host over the protocol in `hutch_agent::proto`.
//! Single threaded, one epoll loop, statically linked; see `agent/`.
//!
//! `no_main`: the C runtime calls [`main`] directly, skipping Rust's start-up
//! (its stack-guard probe of /proc/self/maps and the SIGSEGV/SIGBUS handlers
//! it installs, which PID 1 must not have: a handled signal reaches PID 1
//! even from inside its pid namespace).
#![cfg_attr(not(test), no_main)]

mod agent;

/// Entry point called by the C runtime; argv and the (empty) environment
/// are not used.
#[cfg(not(test))]
#[no_mangle]
pub extern "C" fn main(_argc: std::ffi::c_int, _argv: *const *const std::ffi::c_char) -> std::ffi::c_int {
    agent::main()
}

/// Unit-test builds keep the harness's own entry point; this keeps the
/// agent's code live for the dead-code lint there.
#[cfg(test)]
#[allow(dead_code)]
fn main() {
    std::process::exit(agent::main());
}
