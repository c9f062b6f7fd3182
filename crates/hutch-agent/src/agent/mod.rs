//! The agent binary's parts: start-up ([`main`]), the event loop
//! (`server`), process supervision (`child`), files, watches, and the
//! syscall wrappers (`sys`, the one module where `unsafe` gathers).

mod child;
mod config;
mod conn;
mod env;
mod files;
mod output;
mod reaper;
mod server;
mod sys;
mod tenants;
mod tree;
mod users;
mod watch;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use hutch_agent::proto;

/// The listening socket the host passes.
const LISTEN_FD: i32 = 3;
/// The pipe holding the configuration frame.
const CONFIG_FD: i32 = 4;
/// The lock file held open for the agent's lifetime.
const LOCK_FD: i32 = 5;

/// Starts the agent; returns only when the listening socket failed.
///
/// `--dir DIR` (the gvisor class, whose runtime passes no descriptor into
/// the sandbox): the agent makes descriptors 3 and 4 itself, listening on
/// `DIR/agent.sock` (a host socket, made through gVisor's gofer) and
/// reading `DIR/config` (which it then removes).
pub fn main(args: &[&std::ffi::CStr]) -> i32 {
    // On the host, for the daemon: see `reaper`.
    if let [_, flag, program, rest @ ..] = args {
        if flag.to_bytes() == proto::REAP_FLAG.as_bytes() {
            return reaper::run(program, rest);
        }
    }
    // Before anything else: nobody in the sandbox may ptrace the agent or
    // read its /proc files.
    let _ = sys::set_dumpable(false);
    if let [_, flag, dir] = args {
        if flag.to_bytes() == b"--dir"
            && own_descriptors(std::path::Path::new(std::ffi::OsStr::from_bytes(dir.to_bytes()))).is_err()
        {
            return 1;
        }
    }
    let _ = sys::set_child_subreaper();
    let _ = sys::request_short_slice();
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
    if let [_, flag, dir] = args {
        if flag.to_bytes() == b"--dir" {
            agent.set_dir(std::path::PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes())));
        }
    }
    let _fatal = agent.run();
    1
}

/// Makes the listening socket (descriptor 3) and the configuration
/// (descriptor 4) of an agent started with `--dir`.
fn own_descriptors(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::fd::IntoRawFd;
    let listener = bind_socket(dir)?;
    let config = std::fs::File::open(dir.join("config"))?;
    let _ = std::fs::remove_file(dir.join("config"));
    // The sandbox's seccomp filters, which the container class installs
    // before the agent's exec: here the agent installs them on itself, and
    // every process it starts inherits them.
    let filters = std::fs::read(dir.join("seccomp"))?;
    let _ = std::fs::remove_file(dir.join("seccomp"));
    for filter in parse_filters(&filters).ok_or_else(|| std::io::Error::other("malformed seccomp file"))? {
        sys::install_seccomp(&filter).map_err(|e| std::io::Error::from_raw_os_error(e.0))?;
    }
    // Descriptors 0 to 2 are open (runsc's /dev/null or pipes), so these
    // two are 3 and 4 already unless something else was; either way each
    // ends at its number and nothing else stays open.
    let (listener, config) = (listener.into_raw_fd(), config.into_raw_fd());
    for (fd, to) in [(listener, LISTEN_FD), (config, CONFIG_FD)] {
        if fd != to {
            sys::dup_to(fd, to).map_err(|e| std::io::Error::from_raw_os_error(e.0))?;
            if fd != LISTEN_FD && fd != CONFIG_FD {
                // SAFETY: fd is the descriptor just taken from a std type,
                // now duplicated; nothing else names it.
                drop(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Ok(())
}

/// Binds and listens on `DIR/agent.sock` (an agent started with `--dir`),
/// at its start and after a [`proto::Request::Quiesce`].
pub(crate) fn bind_socket(dir: &std::path::Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    let sock = dir.join("agent.sock");
    // A restored sandbox finds the socket of the one it was checkpointed from.
    let _ = std::fs::remove_file(&sock);
    // (Bound and listening at once; the host retries a connection refused
    // between the two: gVisor's gofer refuses to rename a socket.)
    std::os::unix::net::UnixListener::bind(&sock)
}

/// Classic-BPF programs, each a little-endian u32 count of instructions and
/// that many 8-byte `sock_filter`s (native order); `None` if malformed.
fn parse_filters(mut bytes: &[u8]) -> Option<Vec<Vec<libc::sock_filter>>> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let n = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
        if n == 0 || n > 4096 {
            return None;
        }
        let body = bytes.get(4..4 + n * 8)?;
        out.push(
            body.chunks_exact(8)
                .map(|c| libc::sock_filter {
                    code: u16::from_ne_bytes([c[0], c[1]]),
                    jt: c[2],
                    jf: c[3],
                    k: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
                })
                .collect(),
        );
        bytes = &bytes[4 + n * 8..];
    }
    Some(out)
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
    let mut next = proto::WORK_CGROUP_FD + n;
    if cfg.oom_events {
        out.oom_events = Some(take(next)?);
        next += 1;
    }
    if cfg.tree_cgroup {
        out.trees = Some(take(next)?);
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
