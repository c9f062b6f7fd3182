//! The agent binary's parts: start-up ([`main`]), the event loop
//! (`server`), process supervision (`child`), files, watches, and the
//! syscall wrappers (`sys`, the one module where `unsafe` gathers).

mod child;
mod config;
mod conn;
mod env;
mod files;
mod output;
mod server;
mod sys;
mod tenants;
mod users;
mod watch;

use std::os::fd::{FromRawFd, OwnedFd};

use hutch_agent::proto;

/// The listening socket the host passes.
const LISTEN_FD: i32 = 3;
/// The pipe holding the configuration frame.
const CONFIG_FD: i32 = 4;
/// The lock file held open for the agent's lifetime.
const LOCK_FD: i32 = 5;

/// Starts the agent; returns only when the listening socket failed.
pub fn main() -> i32 {
    // Before anything else: nobody in the sandbox may ptrace the agent or
    // read its /proc files.
    let _ = sys::set_dumpable(false);
    let _ = sys::set_child_subreaper();
    if sys::set_cloexec(LISTEN_FD).is_err() {
        return 1;
    }
    let _ = sys::set_cloexec(LOCK_FD);
    // SIGCHLD arrives through a signalfd; every other signal keeps its
    // default disposition, which PID 1 of a pid namespace ignores when it
    // comes from inside (main.rs skips Rust's runtime, which would install
    // handlers).
    // Dispositions ignored by whoever started the agent would survive into
    // every workload's exec: reset them all once, here.
    sys::reset_signal_dispositions();
    if sys::set_sigmask(&[libc::SIGCHLD]).is_err() {
        return 1;
    }
    sys::ignore_signal(libc::SIGPIPE);

    // SAFETY: descriptor 4 is the configuration pipe the host passed; the
    // agent takes sole ownership and closes it after reading.
    let config_fd = unsafe { OwnedFd::from_raw_fd(CONFIG_FD) };
    let cfg = match read_config(config_fd) {
        Ok(c) => c,
        Err(_) => return 2,
    };
    let cgroups = match work_cgroup(&cfg) {
        Some(c) => c,
        None => return 2,
    };
    // The agent and its supervisors never exec, so the bounding set only
    // matters for workloads: cut it once here instead of in every child.
    let bounding_reduced = sys::drop_bounding(!cfg.root_caps).is_ok();
    // Files the agent creates get exactly the mode asked for; children get 022.
    sys::umask(0);
    let nofile = sys::raise_nofile();
    // SAFETY: descriptor 3 is the listening socket the host passed; from
    // here on the agent owns it.
    let listener = unsafe { OwnedFd::from_raw_fd(LISTEN_FD) };
    let mut agent = match server::Agent::new(cfg, cgroups, listener, nofile, bounding_reduced) {
        Ok(a) => a,
        Err(_) => return 1,
    };
    let _fatal = agent.run();
    1
}

/// Takes the workload cgroup's descriptors the configuration announces
/// (close-on-exec, so that no workload inherits them); `None` when one of
/// them is not open.
fn work_cgroup(cfg: &config::Config) -> Option<server::WorkCgroup> {
    let take = |fd: i32| -> Option<OwnedFd> {
        sys::set_cloexec(fd).ok()?;
        // SAFETY: the host passed this descriptor (checked open just above)
        // for the agent alone, which now owns it.
        Some(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    let mut out = server::WorkCgroup::default();
    let n = cfg.work_cgroups as i32;
    for i in 0..n {
        out.procs.push(take(proto::WORK_CGROUP_FD + i)?);
    }
    if cfg.oom_events {
        out.oom_events = Some(take(proto::WORK_CGROUP_FD + n)?);
    }
    Some(out)
}

/// Reads the configuration frame up to EOF (bounded by the largest frame).
fn read_config(fd: OwnedFd) -> Result<config::Config, String> {
    let limit = 4 + proto::MAX_FRAME + 1;
    let mut buf = Vec::with_capacity(4096);
    loop {
        match sys::read_append(std::os::fd::AsFd::as_fd(&fd), &mut buf, 64 * 1024) {
            Ok(0) => break,
            Ok(_) if buf.len() >= limit => return Err("config frame too large".into()),
            Ok(_) => {}
            Err(sys::Errno(libc::EINTR)) => {}
            Err(e) => return Err(format!("reading the config: {e}")),
        }
    }
    drop(fd);
    config::parse(&buf)
}
