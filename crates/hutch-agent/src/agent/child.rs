//! What runs after `fork`: the per-command supervisor (a subreaper that owns
//! the command's whole process tree and can kill all of it) and the set-up
//! of the real child between its fork and `execve`.
//!
//! The agent forks a supervisor before it is needed (a *spare*, see
//! [`spare`]) and hands it a command as an [`Order`] over a socket pair, with
//! the command's descriptors attached: a spawn then costs no fork of the
//! agent (page tables copied, copy-on-write faults on both sides after),
//! only a message. What every command shares (limits, capabilities, the
//! seccomp filter, the workload cgroup) the spare inherits ([`Fixed`]).
//! The child path allocates nothing.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, IntoRawFd, OwnedFd, RawFd};

use super::sys::{self, CStrArray, Errno};

/// Status-pipe message: the real child's pid.
pub const MSG_PID: u32 = 1;
/// Status-pipe message: the main process ended (value: its wait status)
/// and no other process of its tree was left.
pub const MSG_STATUS: u32 = 2;
/// Status-pipe message: the supervisor could not fork (value is the errno).
pub const MSG_FORK_FAILED: u32 = 3;
/// Status-pipe message: the main process ended (value: its wait status)
/// while processes it started live on. The supervisor exits once they are
/// all gone; the agent learns that by reaping it.
pub const MSG_STATUS_LIVE: u32 = 4;

pub fn encode_msg(kind: u32, value: i32) -> [u8; 8] {
    let mut m = [0u8; 8];
    m[..4].copy_from_slice(&kind.to_le_bytes());
    m[4..].copy_from_slice(&value.to_le_bytes());
    m
}

pub fn decode_msg(m: [u8; 8]) -> (u32, i32) {
    (u32::from_le_bytes([m[0], m[1], m[2], m[3]]), i32::from_le_bytes([m[4], m[5], m[6], m[7]]))
}

/// The signal the agent queues to a supervisor (with `sigqueue`, the value
/// being a signal number) to have that signal sent to every process of the
/// command's tree. A real-time signal, so that several queue up.
pub fn tree_signal() -> libc::c_int {
    libc::SIGRTMIN() + 1
}

/// What every command's child gets from the agent unchanged; a spare
/// supervisor inherits it when the agent forks it.
pub struct Fixed<'a> {
    /// Whether the agent's OOM score differs from the default, so that
    /// children must set theirs back to 0.
    pub reset_oom: bool,
    /// Capabilities kept when the command runs as uid 0.
    pub root_caps: u64,
    /// The agent already cut its bounding set down to `root_caps`.
    pub bounding_reduced: bool,
    /// The open-file limit the agent started with.
    pub nofile: Option<libc::rlimit>,
    pub filter: &'a [libc::sock_filter],
    /// `cgroup.procs` files of the workload cgroup (close-on-exec), which
    /// the child writes itself into before it execs.
    pub work_cgroups: &'a [RawFd],
}

/// One command, as the agent sends it to a spare supervisor: what differs
/// from command to command. Its descriptors travel beside it
/// ([`ORDER_FDS`]: stdin, stdout, stderr, working directory).
#[derive(Debug, PartialEq, Eq)]
pub struct Order {
    /// The resolved executable; `None` when the PATH search found nothing.
    pub exe: Option<CString>,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    pub uid: u32,
    pub gid: u32,
    /// stdin/stdout/stderr are a terminal's slave side, to become the
    /// controlling terminal.
    pub tty: bool,
}

/// Descriptors an order carries: stdin, stdout, stderr and an O_PATH
/// descriptor of the working directory.
pub const ORDER_FDS: usize = 4;
/// Largest encoded order (a spawn request fits in a frame header, the
/// agent's environment in its configuration frame).
const MAX_ORDER: usize = 8 * 1024 * 1024;

impl Order {
    /// Length-prefixed: u32 length, uid, gid, flags (1: tty, 2: exe), argc,
    /// envc, then the NUL-terminated strings (exe, argv, envp).
    pub fn encode(&self) -> Vec<u8> {
        let strings = self.exe.iter().chain(&self.argv).chain(&self.envp);
        let size: usize = 17 + strings.clone().map(|s| s.as_bytes_with_nul().len()).sum::<usize>();
        let mut out = Vec::with_capacity(4 + size);
        out.extend_from_slice(&(size as u32).to_le_bytes());
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.gid.to_le_bytes());
        out.push(u8::from(self.tty) | if self.exe.is_some() { 2 } else { 0 });
        out.extend_from_slice(&(self.argv.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.envp.len() as u32).to_le_bytes());
        for s in strings {
            out.extend_from_slice(s.as_bytes_with_nul());
        }
        out
    }

    /// The order in `body` (what follows the length); `None` when malformed.
    pub fn decode(body: &[u8]) -> Option<Order> {
        let word = |at: usize| Some(u32::from_le_bytes(body.get(at..at + 4)?.try_into().ok()?));
        let (uid, gid, flags, argc, envc) = (word(0)?, word(4)?, *body.get(8)?, word(9)?, word(13)?);
        let mut rest = body.get(17..)?;
        let mut next = || -> Option<CString> {
            let s = CStr::from_bytes_until_nul(rest).ok()?;
            rest = &rest[s.to_bytes_with_nul().len()..];
            Some(s.to_owned())
        };
        let exe = if flags & 2 != 0 { Some(next()?) } else { None };
        let argv = (0..argc).map(|_| next()).collect::<Option<Vec<_>>>()?;
        let envp = (0..envc).map(|_| next()).collect::<Option<Vec<_>>>()?;
        (rest.is_empty() && !argv.is_empty()).then_some(Order { exe, argv, envp, uid, gid, tty: flags & 1 != 0 })
    }
}

/// Everything the supervisor and the child need for one command.
pub struct ChildPlan<'a> {
    pub reset_oom: bool,
    /// The resolved executable; `None` when the PATH search found nothing.
    pub exe: Option<CString>,
    /// argv[0], for error messages.
    pub argv0: CString,
    pub argv: CStrArray,
    pub envp: CStrArray,
    pub uid: u32,
    pub gid: u32,
    /// Capabilities kept when `uid` is 0.
    pub root_caps: u64,
    /// The agent already cut its bounding set down to `root_caps`.
    pub bounding_reduced: bool,
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
    /// stdin/stdout/stderr are a terminal's slave side, to become the
    /// controlling terminal.
    pub tty: bool,
    /// An O_PATH descriptor of the working directory.
    pub cwd: RawFd,
    /// The supervisor's end of its socket to the agent.
    pub status: RawFd,
    /// The open-file limit the agent started with.
    pub nofile: Option<libc::rlimit>,
    pub filter: &'a [libc::sock_filter],
    /// `cgroup.procs` files of the workload cgroup (close-on-exec), which
    /// the child writes itself into before it execs.
    pub work_cgroups: &'a [RawFd],
}

fn supervisor_signals() -> [libc::c_int; 4] {
    [libc::SIGCHLD, libc::SIGUSR1, libc::SIGTERM, tree_signal()]
}

/// Body of a spare supervisor, right after the agent forked it: keeps only
/// its socket (`sock`) and the workload cgroup, waits for its one order and
/// supervises that command. Exits when the agent closes the socket first.
pub fn spare(fixed: &Fixed<'_>, sock: RawFd) -> ! {
    let mut keep = vec![sock];
    keep.extend_from_slice(fixed.work_cgroups);
    sys::close_all_except(&mut keep);
    // The agent reset every other disposition at start; SIGPIPE it ignores.
    sys::default_signal(libc::SIGPIPE);
    let _ = sys::set_child_subreaper();
    if sys::set_sigmask(&supervisor_signals()).is_err() {
        sys::exit_now(1);
    }
    // SAFETY: the agent made `sock` for this process alone and kept it open across the fork.
    let sock_fd = unsafe { BorrowedFd::borrow_raw(sock) };
    let Some((order, fds)) = receive_order(sock_fd) else { sys::exit_now(0) };
    // The descriptors are closed by number below (supervise), never dropped.
    let fds: Vec<RawFd> = fds.into_iter().map(IntoRawFd::into_raw_fd).collect();
    let plan = ChildPlan {
        reset_oom: fixed.reset_oom,
        exe: order.exe,
        argv0: order.argv[0].clone(),
        argv: CStrArray::new(order.argv),
        envp: CStrArray::new(order.envp),
        uid: order.uid,
        gid: order.gid,
        root_caps: fixed.root_caps,
        bounding_reduced: fixed.bounding_reduced,
        stdin: fds[0],
        stdout: fds[1],
        stderr: fds[2],
        tty: order.tty,
        cwd: fds[3],
        status: sock,
        nofile: fixed.nofile,
        filter: fixed.filter,
        work_cgroups: fixed.work_cgroups,
    };
    supervise(&plan)
}

/// Reads one order and its descriptors; `None` when the agent closed the
/// socket or sent something else.
fn receive_order(sock: BorrowedFd<'_>) -> Option<(Order, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let mut len = [0u8; 4];
    read_exact(sock, &mut len, &mut fds)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_ORDER {
        return None;
    }
    let mut body = vec![0u8; len];
    read_exact(sock, &mut body, &mut fds)?;
    let order = Order::decode(&body)?;
    (fds.len() == ORDER_FDS).then_some((order, fds))
}

fn read_exact(sock: BorrowedFd<'_>, mut buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Option<()> {
    while !buf.is_empty() {
        match sys::recv_with_fds(sock, buf, fds) {
            Ok(0) => return None,
            Ok(n) => buf = &mut buf[n..],
            Err(Errno(libc::EINTR)) => {}
            Err(_) => return None,
        }
    }
    Some(())
}

/// Sends an order and its descriptors to a spare supervisor, waiting at
/// most `timeout_ms` for room in the socket.
pub fn send_order(sock: BorrowedFd<'_>, order: &Order, fds: &[RawFd; ORDER_FDS], timeout_ms: i32) -> Result<(), Errno> {
    let bytes = order.encode();
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms as u64);
    let mut sent = 0;
    while sent < bytes.len() {
        let attach: &[RawFd] = if sent == 0 { fds } else { &[] };
        match sys::send_with_fds(sock.as_fd(), &bytes[sent..], attach) {
            Ok(n) => sent += n,
            Err(Errno(libc::EINTR)) => {}
            Err(Errno(libc::EAGAIN)) => {
                let left = deadline.saturating_duration_since(std::time::Instant::now()).as_millis() as i32;
                if left == 0 || !sys::poll_out(sock, left)? {
                    return Err(Errno(libc::ETIMEDOUT));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The supervisor's work for one command: starts the child and supervises
/// its tree until nothing of it is left.
fn supervise(plan: &ChildPlan<'_>) -> ! {
    extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: arg is the supervisor's `plan`, alive until spawn_vm returns.
        exec_child(unsafe { &*(arg as *const ChildPlan<'_>) })
    }
    let signals = supervisor_signals();
    // SAFETY: exec_child allocates nothing and writes only its own stack
    // and descriptors before execve or _exit; `plan` outlives the call.
    let child = match unsafe { sys::spawn_vm(child_entry, plan as *const ChildPlan<'_> as *mut libc::c_void) } {
        Ok(pid) => pid,
        Err(e) => {
            let _ = sys::write_all(plan.status, &encode_msg(MSG_FORK_FAILED, e.0));
            sys::exit_now(1);
        }
    };
    let mut keep = [plan.status];
    sys::close_all_except(&mut keep);
    let mut tree = Tree {
        main: child,
        state: Main::Running,
        status: plan.status,
        main_status: None,
        reported: false,
        killing: false,
    };
    if sys::write_all(plan.status, &encode_msg(MSG_PID, child)).is_err() {
        // The agent is gone; nobody wants this command any more.
        tree.kill_all();
        sys::exit_now(1);
    }
    loop {
        tree.collect();
        match sys::sigwait_value(&signals) {
            Ok((libc::SIGUSR1 | libc::SIGTERM, _)) => tree.kill_all(),
            Ok((sig, value)) if sig == tree_signal() => tree.signal_all(value),
            _ => {}
        }
    }
}

/// Where the command's main process is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Main {
    Running,
    /// Exited and reported, but not reaped: a zombie holds its pid, which
    /// names the command, and its process group, so that neither is reused
    /// while the rest of the tree lives.
    Exited,
    /// Reaped; only when the tree turned out not to be empty after all.
    Reaped,
}

/// The command's process tree, as its supervisor (a subreaper, so every
/// orphan of the tree becomes its child) sees it.
struct Tree {
    main: i32,
    state: Main,
    /// Write end of the status pipe to the agent.
    status: RawFd,
    /// The main process's wait status, once it exited.
    main_status: Option<i32>,
    /// The agent was told the main process's end.
    reported: bool,
    /// The tree is being killed (timeout, SIGKILL): the main process's end
    /// is reported once nothing is left, so that a killed command's exit
    /// means its whole tree is gone.
    killing: bool,
}

impl Tree {
    /// Reaps what has exited, reports the main process's end once (with
    /// whether the rest of the tree lives on), and ends the supervisor when
    /// nothing of the tree is left.
    fn collect(&mut self) {
        if self.state == Main::Running {
            self.reap_before_main();
        }
        if self.state == Main::Exited && !self.reap_others() {
            // Nothing else was seen. /proc can miss a child that is being
            // reparented, so reap the main process and ask waitpid, which
            // sees every child: MSG_STATUS always means the tree is gone.
            let _ = sys::waitpid(self.main, 0);
            self.state = Main::Reaped;
        }
        let empty = self.state == Main::Reaped && !reap_any();
        if let (Some(status), false) = (self.main_status, self.reported) {
            if empty || !self.killing {
                self.reported = true;
                let kind = if empty { MSG_STATUS } else { MSG_STATUS_LIVE };
                let _ = sys::write_all(self.status, &encode_msg(kind, status));
            }
        }
        if empty {
            sys::exit_now(0);
        }
    }

    /// While the main process runs: reaps exited children one by one,
    /// looking at each before reaping it, so that the main process, once
    /// it exits, is left a zombie.
    fn reap_before_main(&mut self) {
        loop {
            match sys::peek_exited(None) {
                Ok(Some((pid, status))) if pid == self.main => {
                    self.state = Main::Exited;
                    self.main_status = Some(status);
                    return;
                }
                Ok(Some((pid, _))) => {
                    let _ = sys::waitpid(pid, libc::WNOHANG);
                }
                Err(Errno(libc::EINTR)) => {}
                Ok(None) | Err(_) => return,
            }
        }
    }

    /// Reaps every exited child but the main process; whether another child
    /// is still alive.
    fn reap_others(&self) -> bool {
        let mut alive = false;
        for pid in direct_children() {
            if pid == self.main {
                continue;
            }
            if let Ok(None) = sys::waitpid(pid, libc::WNOHANG) {
                alive = true;
            }
        }
        alive
    }

    /// The live processes of the tree: every descendant, less the main
    /// process's zombie.
    fn members(&self) -> Vec<i32> {
        let zombie = (self.state == Main::Exited).then_some(self.main);
        descendants().into_iter().filter(|&p| Some(p) != zombie).collect()
    }

    /// Kills every process of the tree, again and again, until none is
    /// left: the tree walk finds processes that left the session or
    /// double-forked, because the supervisor inherits all of them.
    fn kill_all(&mut self) {
        self.killing = true;
        loop {
            let pids = self.members();
            if pids.is_empty() {
                self.killing = false;
                return;
            }
            for pid in pids {
                let _ = sys::kill(pid, libc::SIGKILL);
            }
            // One of them was a child of ours: wait until it is reapable.
            let _ = sys::sigwait(&[libc::SIGCHLD]);
            self.collect();
        }
    }

    /// Sends `sig` to every process of the tree once.
    fn signal_all(&mut self, sig: i32) {
        if sig == libc::SIGKILL {
            return self.kill_all();
        }
        if !(1..=64).contains(&sig) {
            return;
        }
        for pid in self.members() {
            let _ = sys::kill(pid, sig);
        }
    }
}

/// Reaps every exited child; whether any child is left.
fn reap_any() -> bool {
    loop {
        match sys::waitpid(-1, libc::WNOHANG) {
            Ok(Some(_)) => {}
            Ok(None) => return true,
            Err(Errno(libc::EINTR)) => {}
            Err(_) => return false,
        }
    }
}

/// This process's children (zombies included).
fn direct_children() -> Vec<i32> {
    let me = sys::getpid();
    children_of(me)
        .unwrap_or_else(|| parents_by_stat().into_iter().filter(|&(_, pp)| pp == me).map(|(p, _)| p).collect())
}

/// Every descendant of this process, from /proc.
fn descendants() -> Vec<i32> {
    let me = sys::getpid();
    let Some(first) = children_of(me) else { return descendants_by_stat(me) };
    let mut out = Vec::new();
    let mut stack = first;
    while let Some(pid) = stack.pop() {
        out.push(pid);
        stack.extend(children_of(pid).unwrap_or_default());
    }
    out
}

/// Children of `pid` from /proc/<pid>/task/*/children; `None` when the
/// kernel lacks that file (CONFIG_PROC_CHILDREN).
fn children_of(pid: i32) -> Option<Vec<i32>> {
    let me = sys::getpid();
    if pid == me {
        // The supervisor has one thread: one file, no directory walk.
        return match std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")) {
            Ok(s) => Some(s.split_ascii_whitespace().filter_map(|p| p.parse::<i32>().ok()).collect()),
            Err(_) => None,
        };
    }
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(t) => t,
        Err(_) => return Some(Vec::new()),
    };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(s.split_ascii_whitespace().filter_map(|p| p.parse::<i32>().ok()));
        }
    }
    Some(out)
}

/// Fallback without /proc/*/task/*/children: descendants by every
/// process's parent.
fn descendants_by_stat(me: i32) -> Vec<i32> {
    let parents = parents_by_stat();
    let mut out = Vec::new();
    let mut stack = vec![me];
    while let Some(p) = stack.pop() {
        for &(pid, ppid) in &parents {
            if ppid == p && !out.contains(&pid) {
                out.push(pid);
                stack.push(pid);
            }
        }
    }
    out
}

/// Every process's (pid, parent pid), from /proc/<pid>/stat.
fn parents_by_stat() -> Vec<(i32, i32)> {
    let mut parents = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            if let Some(ppid) = parent_in_stat(&stat) {
                parents.push((pid, ppid));
            }
        }
    }
    parents
}

/// The parent pid in a /proc/<pid>/stat line: "pid (comm) state ppid ...",
/// where comm may hold spaces and parentheses.
fn parent_in_stat(stat: &str) -> Option<i32> {
    let rest = stat.rsplit_once(')')?.1;
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// Writes "hutch: <what>: <strerror>\n" to stderr and exits; allocates nothing.
fn fail(what: &[u8], err: Errno, code: i32) -> ! {
    let mut msg = [0u8; 512];
    let mut n = 0;
    let mut push = |part: &[u8]| {
        let take = part.len().min(msg.len() - n);
        msg[n..n + take].copy_from_slice(&part[..take]);
        n += take;
    };
    let mut text = [0u8; 128];
    let len = err.describe(&mut text);
    push(b"hutch: ");
    push(&what[..what.len().min(256)]);
    push(b": ");
    push(&text[..len]);
    push(b"\n");
    let _ = sys::write(2, &msg[..n]);
    sys::exit_now(code)
}

/// The real child: becomes the command, or exits 126/127 with a message.
fn exec_child(plan: &ChildPlan<'_>) -> ! {
    // First, so that everything after runs under the workload's limits and
    // an OOM kill there can only pick workload processes.
    for &fd in plan.work_cgroups {
        if let Err(e) = sys::write_all(fd, b"0") {
            fail(b"joining the workload cgroup", e, 126);
        }
    }
    if let Err(e) = sys::setsid() {
        fail(b"setsid", e, 126);
    }
    if plan.tty {
        if let Err(e) = sys::set_controlling_tty(plan.stdin) {
            fail(b"controlling terminal", e, 126);
        }
    }
    for (from, to) in [(plan.stdin, 0), (plan.stdout, 1), (plan.stderr, 2)] {
        if let Err(e) = sys::dup_to(from, to) {
            fail(b"dup2", e, 126);
        }
    }
    if let Err(e) = sys::set_sigmask(&[]) {
        fail(b"sigprocmask", e, 126);
    }
    sys::umask(0o022);
    if let Some(lim) = &plan.nofile {
        let _ = sys::set_nofile(lim);
    }
    // The agent runs at -1000 so the OOM killer spares it; workloads must not.
    if let Err(e) = if plan.reset_oom { reset_oom_score() } else { Ok(()) } {
        fail(b"/proc/self/oom_score_adj", e, 126);
    }
    if let Err(e) = sys::fchdir(plan.cwd) {
        fail(b"chdir", e, 126);
    }
    if let Err(e) = drop_privileges(plan) {
        fail(b"dropping privileges", e, 126);
    }
    if let Err(e) = sys::set_no_new_privs() {
        fail(b"no_new_privs", e, 126);
    }
    if !plan.filter.is_empty() {
        if let Err(e) = sys::install_seccomp(plan.filter) {
            fail(b"seccomp", e, 126);
        }
    }
    let argv0 = plan.argv0.as_bytes();
    match &plan.exe {
        None => fail(argv0, Errno(libc::ENOENT), 127),
        Some(exe) => {
            let e = sys::execve(exe, &plan.argv, &plan.envp);
            fail(argv0, e, if e.0 == libc::ENOENT { 127 } else { 126 })
        }
    }
}

fn reset_oom_score() -> Result<(), Errno> {
    let fd = sys::open(c"/proc/self/oom_score_adj", libc::O_WRONLY)?;
    sys::write_all(std::os::fd::AsRawFd::as_raw_fd(&fd), b"0")
}

/// Groups, ids and capabilities of the target user. Root keeps
/// `root_caps` (in every set and the bounding set); anyone else keeps none.
fn drop_privileges(plan: &ChildPlan<'_>) -> Result<(), Errno> {
    if let Err(e) = sys::setgroups(&[plan.gid]) {
        // setgroups is denied in a user namespace whose setgroups file says
        // "deny"; that is only acceptable when there are no groups to drop.
        if sys::group_count()? != 0 {
            return Err(e);
        }
    }
    sys::setresgid(plan.gid)?;
    let keep = if plan.uid == 0 { plan.root_caps } else { 0 };
    let held = if plan.bounding_reduced { plan.root_caps } else { u64::MAX };
    sys::drop_bounding(held & !keep)?;
    sys::clear_ambient_caps()?;
    sys::setresuid(plan.uid)?;
    // For a non-root uid setresuid already emptied effective and permitted;
    // this also empties inheritable.
    let caps = keep & sys::cap_permitted()?;
    sys::capset_all(caps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_messages_round_trip() {
        for (k, v) in [(MSG_PID, 4242), (MSG_STATUS, 0x7f00), (MSG_FORK_FAILED, -11), (MSG_STATUS_LIVE, 9)] {
            assert_eq!(decode_msg(encode_msg(k, v)), (k, v));
        }
    }

    #[test]
    fn orders_round_trip_and_malformed_ones_are_refused() {
        let c = |s: &str| CString::new(s).expect("no NUL");
        let order = Order {
            exe: Some(c("/bin/true")),
            argv: vec![c("true"), c(""), c("a b")],
            envp: vec![c("PATH=/bin"), c("HOME=/root")],
            uid: 1000,
            gid: 1001,
            tty: true,
        };
        let bytes = order.encode();
        assert_eq!(u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize, bytes.len() - 4);
        assert_eq!(Order::decode(&bytes[4..]), Some(order));
        let bare = Order { exe: None, argv: vec![c("x")], envp: Vec::new(), uid: 0, gid: 0, tty: false };
        let bytes = bare.encode();
        assert_eq!(Order::decode(&bytes[4..]), Some(bare));
        // Cut anywhere, or with bytes left over, or without an argv: refused.
        for cut in 0..bytes.len() - 4 {
            assert_eq!(Order::decode(&bytes[4..4 + cut]), None, "cut at {cut}");
        }
        let mut long = bytes[4..].to_vec();
        long.push(b'x');
        assert_eq!(Order::decode(&long), None);
        let empty = Order { exe: None, argv: Vec::new(), envp: Vec::new(), uid: 0, gid: 0, tty: false };
        assert_eq!(Order::decode(&empty.encode()[4..]), None);
    }

    #[test]
    fn parent_pid_is_read_past_a_command_name_with_parens() {
        assert_eq!(parent_in_stat("42 (sh) S 7 42 42 0 -1"), Some(7));
        assert_eq!(parent_in_stat("43 (a) b) (c) R 1 43"), Some(1));
        assert_eq!(parent_in_stat("44 (x"), None);
        assert_eq!(parent_in_stat(""), None);
    }
}
