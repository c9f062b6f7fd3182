//! What runs after `fork`: the per-command supervisor (a subreaper that owns
//! the command's whole process tree and can kill all of it) and the set-up
//! of the real child between its fork and `execve`.
//!
//! Under gVisor, which lets no process but PID 1 be a subreaper (EINVAL),
//! the orphans of a tree go to the agent (PID 1) instead: there the
//! supervisor makes the command a cgroup of its own in the sandbox's
//! cgroupfs ([`TreeCgroup`]; gVisor's emulated one, which touches no host
//! cgroup), every process the command starts is born in it, and its
//! `cgroup.procs` lists the tree.
//!
//! Everything the child needs is prepared by the agent before the first fork
//! ([`ChildPlan`]); the child path allocates nothing.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

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

/// Everything the supervisor and the child need, built before forking.
pub struct ChildPlan<'a> {
    /// Whether the agent's OOM score differs from the default, so that
    /// children must set theirs back to 0.
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
    /// Write end of the status pipe.
    pub status: RawFd,
    /// The open-file limit the agent started with.
    pub nofile: Option<libc::rlimit>,
    pub filter: &'a [libc::sock_filter],
    /// `cgroup.procs` files of the workload cgroup (close-on-exec), which
    /// the child writes itself into before it execs.
    pub work_cgroups: &'a [RawFd],
    /// A tenant's restrictions (process class), applied after the ids.
    pub tenant: Option<TenantLimits<'a>>,
}

/// What a tenant's command takes on before exec (see `tenants.rs`).
pub struct TenantLimits<'a> {
    /// The tenant's Landlock ruleset (close-on-exec).
    pub landlock: RawFd,
    /// Resource limits, soft and hard.
    pub rlimits: &'a [(i32, u64)],
}

fn supervisor_signals() -> [libc::c_int; 4] {
    [libc::SIGCHLD, libc::SIGUSR1, libc::SIGTERM, tree_signal()]
}

/// Body of the supervisor process, right after the agent forked it.
pub fn supervise(plan: &ChildPlan<'_>) -> ! {
    let mut keep = vec![plan.stdin, plan.stdout, plan.stderr, plan.cwd, plan.status];
    keep.extend_from_slice(plan.work_cgroups);
    if let Some(t) = &plan.tenant {
        keep.push(t.landlock);
    }
    sys::close_all_except(&mut keep);
    // The agent reset every other disposition at start; SIGPIPE it ignores.
    sys::default_signal(libc::SIGPIPE);
    // gVisor refuses this (EINVAL): a cgroup of its own names the tree
    // there, if the sandbox has a cgroupfs (`runsc --cgroupfs`); without
    // one, orphans are not seen.
    let (cgroup, join) = match sys::set_child_subreaper() {
        Ok(()) => (None, None),
        Err(_) => TreeCgroup::make(Path::new(TREE_CGROUP_ROOT), sys::getpid()).unzip(),
    };
    let signals = supervisor_signals();
    if sys::set_sigmask(&signals).is_err() {
        sys::exit_now(1);
    }
    extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: arg is the supervisor's `start`, alive until spawn_vm returns.
        let start = unsafe { &*(arg as *const Start<'_, '_>) };
        exec_child(start.plan, start.tree)
    }
    let start = Start { plan, tree: join.as_ref().map_or(-1, |fd| fd.as_raw_fd()) };
    // SAFETY: exec_child allocates nothing and writes only its own stack
    // and descriptors before execve or _exit; `start` outlives the call.
    let child = match unsafe { sys::spawn_vm(child_entry, &start as *const Start<'_, '_> as *mut libc::c_void) } {
        Ok(pid) => pid,
        Err(e) => {
            let _ = sys::write_all(plan.status, &encode_msg(MSG_FORK_FAILED, e.0));
            drop(cgroup);
            sys::exit_now(1);
        }
    };
    drop(join);
    let mut spare = [plan.status];
    sys::close_all_except(&mut spare);
    let mut tree = Tree {
        main: child,
        state: Main::Running,
        status: plan.status,
        main_status: None,
        reported: false,
        killing: false,
        cgroup,
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

/// Spawns the command as the agent's own child, with no supervisor: the
/// command's tree is tracked by the cgroup whose `cgroup.procs` is `tree`,
/// which the child joins before it execs (see tree.rs). Returns its pid.
pub fn spawn_direct(plan: &ChildPlan<'_>, tree: RawFd) -> Result<i32, Errno> {
    extern "C" fn direct_entry(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: arg is spawn_direct's `start`, alive until spawn_vm returns.
        let start = unsafe { &*(arg as *const Start<'_, '_>) };
        // What a supervisor does for its child: no descriptor of the
        // agent's reaches the command (each closes at execve, after the
        // child used those of the plan), and SIGPIPE, which the agent
        // ignores, is the default again.
        if let Err(e) = sys::cloexec_from(3) {
            fail(b"close-on-exec", e, 126);
        }
        sys::default_signal(libc::SIGPIPE);
        exec_child(start.plan, start.tree)
    }
    let start = Start { plan, tree };
    // SAFETY: as in `supervise`: exec_child allocates nothing and writes
    // only its own stack and descriptors before execve or _exit, and the
    // agent, single threaded, waits (CLONE_VFORK) until then.
    unsafe { sys::spawn_vm(direct_entry, &start as *const Start<'_, '_> as *mut libc::c_void) }
}

/// What the real child gets: the plan, and the tree cgroup's `cgroup.procs`
/// to join (-1 when there is none).
struct Start<'p, 'a> {
    plan: &'p ChildPlan<'a>,
    tree: RawFd,
}

/// How long a supervisor without a subreaper waits between rounds of
/// SIGKILLs: those it kills are not its children, no SIGCHLD says they
/// died.
const KILL_POLL_MS: u32 = 5;

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
/// orphan of the tree becomes its child; or, without one, the members of
/// the command's tree cgroup) sees it.
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
    /// The tree cgroup, when the supervisor is no subreaper: the tree is
    /// its members, and orphans are the agent's, which sends this
    /// supervisor a SIGCHLD when, having reaped one, it finds the cgroup
    /// empty ([`tree_emptied`]).
    cgroup: Option<TreeCgroup>,
}

impl Tree {
    /// Reaps what has exited, reports the main process's end once (with
    /// whether the rest of the tree lives on), and ends the supervisor when
    /// nothing of the tree is left.
    fn collect(&mut self) {
        if self.state == Main::Running {
            self.reap_before_main();
        }
        if self.state == Main::Exited && !self.others_alive() {
            // Nothing else was seen. /proc can miss a child that is being
            // reparented, so reap the main process and ask waitpid, which
            // sees every child: MSG_STATUS always means the tree is gone.
            // (A tree cgroup lists every process born in it, from its
            // fork on, and none once it exited.)
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
            // Empty: its cgroup can go.
            self.cgroup = None;
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

    /// Once the main process exited: whether another process of the tree
    /// is alive (reaping those that exited, when they are our children).
    fn others_alive(&self) -> bool {
        match self.cgroup {
            Some(_) => !self.members().is_empty(),
            None => self.reap_others(),
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
        let all = match &self.cgroup {
            Some(c) => cgroup_members(&c.procs),
            None => descendants(),
        };
        all.into_iter().filter(|&p| Some(p) != zombie).collect()
    }

    /// Kills every process of the tree, again and again, until none is
    /// left: the tree walk finds processes that left the session or
    /// double-forked, because the supervisor inherits all of them (or
    /// because they were born in the tree cgroup).
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
            if self.cgroup.is_some() {
                // The main process may be the only child of ours there is.
                let _ = sys::sigwait_for(&[libc::SIGCHLD], KILL_POLL_MS);
            } else {
                // One of them was a child of ours: wait until it is reapable.
                let _ = sys::sigwait(&[libc::SIGCHLD]);
            }
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

/// The pids in a cgroup's `cgroup.procs`; none when it cannot be read.
fn cgroup_members(procs: &Path) -> Vec<i32> {
    std::fs::read_to_string(procs).map(|s| parse_pids(&s)).unwrap_or_default()
}

pub fn parse_pids(s: &str) -> Vec<i32> {
    s.split_ascii_whitespace().filter_map(|p| p.parse::<i32>().ok()).collect()
}

/// Where a command's tree gets a cgroup when its supervisor cannot be a
/// subreaper: a hierarchy of gVisor's cgroupfs (`runsc --cgroupfs`).
pub const TREE_CGROUP_ROOT: &str = "/sys/fs/cgroup/cpu";

/// A command's tree cgroup, `<root>/hutch/<supervisor pid>`, removed when
/// dropped (when the supervisor is done: the tree is gone, or never ran).
struct TreeCgroup {
    dir: CString,
    procs: PathBuf,
}

impl TreeCgroup {
    /// Makes supervisor `pid`'s tree cgroup under `root` and opens its
    /// `cgroup.procs` for writing (close-on-exec), for the child to join;
    /// `None` when `root` is no cgroup hierarchy we can make cgroups in.
    fn make(root: &Path, pid: i32) -> Option<(TreeCgroup, OwnedFd)> {
        let dir = tree_cgroup_dir(root, pid);
        let (parent, procs) = (root.join("hutch"), dir.join("cgroup.procs"));
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).ok();
        let (parent_c, dir_c, procs_c) = (c(&parent)?, c(&dir)?, c(&procs)?);
        match sys::mkdir_path(&parent_c, 0o755) {
            Ok(()) | Err(Errno(libc::EEXIST)) => {}
            Err(_) => return None,
        }
        match sys::mkdir_path(&dir_c, 0o755) {
            Ok(()) => {}
            Err(Errno(libc::EEXIST)) => {
                // A supervisor of that pid was killed before its tree
                // ended: its cgroup can go if the tree did since, else
                // this command has none.
                sys::rmdir_path(&dir_c).ok()?;
                sys::mkdir_path(&dir_c, 0o755).ok()?;
            }
            Err(_) => return None,
        }
        let tree = TreeCgroup { dir: dir_c, procs };
        let fd = sys::open(&procs_c, libc::O_WRONLY).ok()?;
        Some((tree, fd))
    }
}

impl Drop for TreeCgroup {
    fn drop(&mut self) {
        let _ = sys::rmdir_path(&self.dir);
    }
}

fn tree_cgroup_dir(root: &Path, supervisor: i32) -> PathBuf {
    root.join("hutch").join(supervisor.to_string())
}

/// For the agent, after it reaped orphans: whether `supervisor` has a
/// tree cgroup under `root` and it is empty, so that the supervisor,
/// which learns of no orphan's end, must look (a SIGCHLD tells it). Only
/// the supervisors whose tree ended are woken: under gVisor's ptrace
/// platform each process woken on another of the sentry's threads costs
/// the sandbox a host thread (a ptrace stub), for good.
pub fn tree_emptied(root: &Path, supervisor: i32) -> bool {
    let procs = tree_cgroup_dir(root, supervisor).join("cgroup.procs");
    std::fs::read_to_string(procs).is_ok_and(|s| parse_pids(&s).is_empty())
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
/// `tree`: the `cgroup.procs` of its tree cgroup, or -1.
fn exec_child(plan: &ChildPlan<'_>, tree: RawFd) -> ! {
    // First, so that everything after runs under the workload's limits and
    // an OOM kill there can only pick workload processes.
    for &fd in plan.work_cgroups {
        if let Err(e) = sys::write_all(fd, b"0") {
            fail(b"joining the workload cgroup", e, 126);
        }
    }
    // Before anything it starts, so that all of it is born in there.
    if tree >= 0 {
        if let Err(e) = sys::write_all(tree, b"0") {
            fail(b"joining the command's cgroup", e, 126);
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
    if let Some(t) = &plan.tenant {
        apply_tenant(t);
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

/// A tenant's rlimits and Landlock domain; exits 126 on failure (a
/// command never runs without its tenant's rules).
fn apply_tenant(t: &TenantLimits<'_>) {
    for &(resource, value) in t.rlimits {
        if let Err(e) = sys::set_rlimit(resource, value) {
            fail(b"resource limit", e, 126);
        }
    }
    if let Err(e) = sys::landlock_restrict_self(t.landlock) {
        fail(b"landlock", e, 126);
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
    fn cgroup_procs_lists_pids_one_a_line() {
        assert_eq!(parse_pids("1\n7\n12\n"), vec![1, 7, 12]);
        assert_eq!(parse_pids(""), Vec::<i32>::new());
    }

    #[test]
    fn a_tree_cgroup_needs_a_cgroup_hierarchy_and_leaves_nothing_half_made() {
        let root = std::env::temp_dir().join(format!("hutch-tree-cgroup-{}", std::process::id()));
        std::fs::create_dir(&root).expect("a fresh temp dir");
        // A plain directory: mkdir makes no cgroup.procs there, so there
        // is no cgroup, and the directory made goes again.
        assert!(TreeCgroup::make(&root, 42).is_none());
        assert!(root.join("hutch").is_dir());
        assert!(!root.join("hutch/42").exists());
        // A leftover of a killed supervisor, empty: removed, made again
        // (and gone again here, for want of a cgroup.procs).
        std::fs::create_dir(root.join("hutch/43")).expect("mkdir");
        assert!(TreeCgroup::make(&root, 43).is_none());
        assert!(!root.join("hutch/43").exists());
        // One still holding something: left alone, and no cgroup.
        std::fs::create_dir(root.join("hutch/44")).expect("mkdir");
        std::fs::write(root.join("hutch/44/cgroup.procs"), "7\n").expect("a fake cgroup.procs");
        assert!(TreeCgroup::make(&root, 44).is_none());
        assert_eq!(std::fs::read_to_string(root.join("hutch/44/cgroup.procs")).expect("kept"), "7\n");
        std::fs::remove_dir_all(&root).expect("remove the temp dir");
    }

    #[test]
    fn parent_pid_is_read_past_a_command_name_with_parens() {
        assert_eq!(parent_in_stat("42 (sh) S 7 42 42 0 -1"), Some(7));
        assert_eq!(parent_in_stat("43 (a) b) (c) R 1 43"), Some(1));
        assert_eq!(parent_in_stat("44 (x"), None);
        assert_eq!(parent_in_stat(""), None);
    }
}
