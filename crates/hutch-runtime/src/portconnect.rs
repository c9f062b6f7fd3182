//! Reaching a TCP port inside a sandbox from the host, for the port proxy.
//!
//! The daemon does not route to the sandbox over a host network: a
//! short-lived thread joins the sandbox's network namespace (`setns` on a
//! pidfd of the sandbox's PID 1; a thread may change its own network
//! namespace), makes the sockets there, and exits; the connect to
//! 127.0.0.1:PORT (then [::1]:PORT) happens on the caller's tokio runtime. A
//! socket stays in the namespace it was made in, so services bound to
//! loopback or to any address both answer, and no host firewall rule is
//! involved.
//!
//! Pid reuse: [`Sandbox::net_ns`] opens a pidfd first and only then checks
//! that the pid is the sandbox's init (in its cgroup, pid 1 of a namespace
//! one level below ours; for the gvisor class, the sentry runsc names, in
//! the sandbox's cgroup: its sockets are the workload's), and that the pidfd's process is still alive after
//! the check. A pidfd names one process for good: once checked, `setns`
//! through it can only join that sandbox's namespace, or fail with ESRCH
//! when the sandbox is gone.

use crate::container::Sandbox;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// How long a connect to a port in a sandbox may take. Loopback answers at
/// once; only a frozen or overloaded sandbox gets near this.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// The sandbox's init process is gone (or was never found).
    #[error("sandbox {0} has no running init process")]
    Gone(String),
    #[error("nothing listens on port {port} in sandbox {sandbox}")]
    Refused { sandbox: String, port: u16 },
    #[error("port {port} in sandbox {sandbox} did not accept a connection within {}s", CONNECT_TIMEOUT.as_secs())]
    Timeout { sandbox: String, port: u16 },
    #[error("sandbox {sandbox}: {what}: {source}")]
    Io { sandbox: String, what: &'static str, source: io::Error },
}

/// A handle on one sandbox's network namespace: a pidfd of its PID 1,
/// checked to belong to the sandbox.
#[derive(Debug)]
pub struct NetNs {
    sandbox: String,
    pidfd: OwnedFd,
}

impl Sandbox {
    /// A handle on the sandbox's network namespace. Reads a few files in
    /// /proc (and the cgroup's process list for an adopted sandbox, whose
    /// PID 1 is not our child): call it once and keep the handle.
    pub fn net_ns(&self) -> Result<NetNs, PortError> {
        // The gvisor class: the sentry, whose network namespace the
        // workload's sockets are in (hostinet), is no pid namespace's init.
        if let Some(sentry) = self.gvisor.as_ref().and_then(|g| g.sentry_pid()) {
            if let Ok(pidfd) = pidfd_open(sentry) {
                if in_cgroup_of(sentry, &self.id) && pidfd_alive(&pidfd) {
                    return Ok(NetNs { sandbox: self.id.clone(), pidfd });
                }
            }
            return Err(PortError::Gone(self.id.clone()));
        }
        let candidates = if self.pid > 0 {
            vec![self.pid]
        } else {
            // An adopted sandbox: its init is one of the cgroup's processes.
            self.cgroup
                .procs_files()
                .first()
                .and_then(|f| std::fs::read_to_string(f).ok())
                .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
                .unwrap_or_default()
        };
        for pid in candidates {
            let Ok(pidfd) = pidfd_open(pid) else { continue };
            if is_init_of(pid, &self.id) && pidfd_alive(&pidfd) {
                return Ok(NetNs { sandbox: self.id.clone(), pidfd });
            }
        }
        Err(PortError::Gone(self.id.clone()))
    }
}

/// Whether `pid` is the init process of sandbox `id` now: pid 1 of a pid
/// namespace directly below the one /proc shows, and in the sandbox's cgroup.
fn is_init_of(pid: libc::pid_t, id: &str) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    let nspid: Vec<&str> = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|v| v.split_whitespace().collect())
        .unwrap_or_default();
    nspid.len() == 2 && nspid[1] == "1" && in_cgroup_of(pid, id)
}

/// Whether `pid` is in sandbox `id`'s cgroup.
fn in_cgroup_of(pid: libc::pid_t, id: &str) -> bool {
    let Ok(cgroups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { return false };
    let suffix = format!("/hutch/{id}");
    cgroups.lines().any(|l| l.splitn(3, ':').nth(2).is_some_and(|path| path.ends_with(&suffix)))
}

fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open has no memory effects; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the process of a pidfd still runs (signal 0 checks, sends nothing).
fn pidfd_alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal with signal 0 and no siginfo has no memory effects.
    unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), 0, std::ptr::null::<libc::siginfo_t>(), 0) == 0
    }
}

/// A TCP socket, close-on-exec and non-blocking, in the calling thread's
/// network namespace.
fn tcp_socket(domain: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket has no memory effects; the result is checked.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An IPv4 socket and, where the namespace has IPv6, an IPv6 one.
type Sockets = (OwnedFd, Option<OwnedFd>);

impl NetNs {
    pub fn sandbox(&self) -> &str {
        &self.sandbox
    }

    fn io_err(&self, what: &'static str) -> impl FnOnce(io::Error) -> PortError + '_ {
        move |source| PortError::Io { sandbox: self.sandbox.clone(), what, source }
    }

    /// Makes the sockets in the sandbox's namespace, on a thread of its own
    /// that ends right after: the caller's threads never change namespace.
    async fn sockets(&self) -> Result<Sockets, PortError> {
        let pidfd = self.pidfd.try_clone().map_err(self.io_err("dup the pidfd"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("hutch-netns".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                let made = (|| -> Result<Sockets, (&'static str, io::Error)> {
                    // SAFETY: setns on a pidfd we own, for this thread only (CLONE_NEWNET).
                    if unsafe { libc::setns(pidfd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(("setns", io::Error::last_os_error()));
                    }
                    let v4 = tcp_socket(libc::AF_INET).map_err(|e| ("socket", e))?;
                    Ok((v4, tcp_socket(libc::AF_INET6).ok()))
                })();
                let _ = tx.send(made);
            })
            .map_err(self.io_err("spawn the namespace thread"))?;
        match rx.await {
            Ok(Ok(sockets)) => Ok(sockets),
            Ok(Err((_, e))) if e.raw_os_error() == Some(libc::ESRCH) => Err(PortError::Gone(self.sandbox.clone())),
            Ok(Err((what, e))) => Err(self.io_err(what)(e)),
            Err(_) => Err(self.io_err("namespace thread")(io::Error::other("ended without an answer"))),
        }
    }

    /// Connects to `port` on the sandbox's loopback: 127.0.0.1 first, then
    /// [::1] when nothing listens on IPv4.
    pub async fn connect(&self, port: u16) -> Result<tokio::net::TcpStream, PortError> {
        let (v4, v6) = self.sockets().await?;
        let refused = || PortError::Refused { sandbox: self.sandbox.clone(), port };
        let mut attempts = vec![(v4, SocketAddr::from((Ipv4Addr::LOCALHOST, port)))];
        if let Some(v6) = v6 {
            attempts.push((v6, SocketAddr::from((Ipv6Addr::LOCALHOST, port))));
        }
        for (fd, addr) in attempts {
            let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
            match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(addr)).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(stream);
                }
                Ok(Err(e))
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ECONNREFUSED | libc::EADDRNOTAVAIL | libc::ENETUNREACH | libc::EAFNOSUPPORT)
                    ) => {}
                Ok(Err(e)) => return Err(self.io_err("connect")(e)),
                Err(_) => return Err(PortError::Timeout { sandbox: self.sandbox.clone(), port }),
            }
        }
        Err(refused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_process_is_no_sandbox_init() {
        // The test runs in the host's pid namespace: NSpid has one entry.
        assert!(!is_init_of(std::process::id() as libc::pid_t, "sb-0000000000000000"));
    }

    #[test]
    fn pidfds_tell_the_living_from_the_dead() {
        let me = pidfd_open(std::process::id() as libc::pid_t).expect("pidfd of self");
        assert!(pidfd_alive(&me));
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let fd = pidfd_open(child.id() as libc::pid_t).expect("pidfd of child");
        child.wait().expect("wait");
        assert!(!pidfd_alive(&fd), "a reaped child's pidfd must not look alive");
    }
}
