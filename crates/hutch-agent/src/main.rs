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

/// Entry point called by the C runtime; the (empty) environment is not
/// used, argv only by the gvisor class (see `agent::main`).
#[cfg(not(test))]
#[no_mangle]
// Only the C runtime calls it, with its own argc and argv.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub extern "C" fn main(argc: std::ffi::c_int, argv: *const *const std::ffi::c_char) -> std::ffi::c_int {
    let args: Vec<&std::ffi::CStr> = (0..argc.max(0) as usize)
        // SAFETY: the C runtime passes argc valid, NUL-terminated strings.
        .map(|i| unsafe { std::ffi::CStr::from_ptr(*argv.add(i)) })
        .collect();
    agent::main(&args)
}

/// Unit-test builds keep the harness's own entry point; this keeps the
/// agent's code live for the dead-code lint there.
#[cfg(test)]
#[allow(dead_code)]
fn main() {
    std::process::exit(agent::main(&[]));
}
