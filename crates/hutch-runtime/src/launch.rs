//! Starting a sandbox's PID 1: a plan of steps prepared in the parent, one
//! `clone` into fresh namespaces, the plan executed in the child with
//! nothing but system calls, and an `execveat` of the agent.
//!
//! The child shares the parent's memory until it execs (`CLONE_VM |
//! CLONE_VFORK`, on a stack of its own) and may run in a multithreaded
//! program (the daemon), so it may only make system calls: no allocation,
//! no locks, no writes outside its stack. Everything it needs (C strings,
//! pointer arrays, file descriptors) is made before the clone and held by
//! the [`Plan`]; the child walks the steps and, on the first failure, writes
//! the step's index and errno to a close-on-exec pipe and exits. A
//! successful `execveat` closes that pipe; a failed one reports like any
//! other step (the Exec step keeps the pipe open, above the descriptors it
//! arranges).
//!
//! The child also shares the cloning thread's TLS, where libc keeps
//! `errno`: every system call it makes goes through [`crate::sys::raw`],
//! which returns the kernel's answer and never touches `errno`. That matters
//! most for the [`NsHelper`], which runs while the thread that cloned it
//! goes on working.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::path::Path;

/// One thing the child does, with all its arguments prepared.
#[derive(Debug)]
pub enum Step {
    /// Writes "0" into an open `cgroup.procs` file: the child joins it.
    JoinCgroup {
        fd: RawFd,
        what: String,
    },
    /// The inner step, where a missing path (ENOENT) is not an error: /proc
    /// entries to mask differ between kernels.
    IfExists(Box<Step>),
    /// `prctl(PR_SET_PDEATHSIG)`, then fail if the parent (a pidfd of it:
    /// its pid means nothing in the child's new pid namespace) is gone.
    DieWithParent {
        parent: RawFd,
    },
    Unshare {
        flags: libc::c_int,
    },
    Mount {
        source: Option<CString>,
        target: CString,
        fstype: Option<CString>,
        flags: libc::c_ulong,
        data: Option<CString>,
    },
    Mkdir {
        path: CString,
        mode: libc::mode_t,
    },
    Mknod {
        path: CString,
        mode: libc::mode_t,
        dev: libc::dev_t,
    },
    Symlink {
        target: CString,
        path: CString,
    },
    Chown {
        path: CString,
        uid: libc::uid_t,
        gid: libc::gid_t,
    },
    Chmod {
        path: CString,
        mode: libc::mode_t,
    },
    /// Opens the directory `dir` once, then writes each `(name, data)` to
    /// the existing file `name` in it (sysctls).
    WriteFiles {
        dir: CString,
        files: Vec<(CString, CString)>,
    },
    /// Bind mounts `source` on `target` through an id-mapped, detached mount
    /// (open_tree + mount_setattr + move_mount), with `attrs` set too.
    IdmapBind {
        source: CString,
        target: CString,
        attrs: u64,
        userns: RawFd,
    },
    /// Makes each of `components` that is missing, in turn, as a
    /// directory (0755) under `root`, never following a symlink: a
    /// component that is one (or a file) fails the step (ENOTDIR/ELOOP).
    /// The mount point of a volume, made with the file system ids of the
    /// moment.
    MkdirsAt {
        root: CString,
        components: Vec<CString>,
    },
    /// [`Step::IdmapBind`] onto `root` + `components`, resolved as
    /// [`Step::MkdirsAt`] does (no symlink followed): a volume's mount.
    IdmapBindAt {
        source: CString,
        root: CString,
        components: Vec<CString>,
        attrs: u64,
        userns: RawFd,
    },
    /// Brings `lo` up in the current network namespace.
    LoopbackUp,
    SetHostname {
        name: CString,
    },
    /// chdir(new_root); pivot_root(".", "."); umount the old root; chdir("/").
    PivotRoot {
        new_root: CString,
    },
    /// setns into the sandbox's user namespace and become its root.
    EnterUserns {
        fd: RawFd,
    },
    /// setns into an existing namespace of another type.
    SetNs {
        fd: RawFd,
        nstype: libc::c_int,
    },
    /// Installs a seccomp filter ([`crate::seccomp::compile`]'s program).
    /// Inherited by the agent and everything it starts, so the kernel
    /// compiles it once per sandbox instead of once per command.
    Seccomp {
        name: String,
        program: seccompiler::BpfProgram,
    },
    /// Sets a resource limit, soft and hard, of the calling process.
    SetRlimit {
        resource: libc::c_int,
        limit: u64,
    },
    /// Takes `uid` and `gid` as effective ids while keeping every
    /// capability (`SECBIT_NO_SETUID_FIXUP`): a user namespace made next is
    /// owned by them, so the kernel charges its per-user counters to them.
    EffectiveIds {
        uid: libc::uid_t,
        gid: libc::gid_t,
    },
    /// Takes `uid` and `gid` as the file system ids while keeping every
    /// capability (`SECBIT_NO_SETUID_FIXUP`), so that a mount made next
    /// records them as its creator's (an overlay over an id-mapped upper
    /// layer makes its work directory and copies files up with them);
    /// `FsIds { uid: 0, gid: 0 }` goes back to root's and clears the bit,
    /// which must not reach the agent (it would keep capabilities across
    /// a change to another user).
    FsIds {
        uid: libc::uid_t,
        gid: libc::gid_t,
    },
    /// Tells the parent the plan got this far (see [`NsHelper`]).
    Notify {
        fd: RawFd,
    },
    /// Waits, forever, to be killed.
    Pause,
    /// Closes every descriptor from 3 up but `keep`.
    CloseFds {
        keep: RawFd,
    },
    /// Dies with the thread that cloned us (`PR_SET_PDEATHSIG`), and fails
    /// at once if `parent` is already gone (we were reparented).
    DieWithParentPid {
        parent: libc::pid_t,
    },
    /// Puts `fds[i].0` at descriptor `fds[i].1`, makes 0, 1 and 2 /dev/null,
    /// closes everything else, sets the open-file limit to `nofile` (soft,
    /// hard) if given, and execs `exe_fd` with `argv`, empty environment.
    /// The limit comes last: the daemon raised its own, and a lower one set
    /// while its descriptors were still open here would leave no free one.
    Exec {
        exe_fd: RawFd,
        argv: Vec<CString>,
        argv_ptrs: Vec<*const libc::c_char>,
        fds: Vec<(RawFd, RawFd)>,
        devnull: CString,
        nofile: Option<(u64, u64)>,
    },
}

// SAFETY: the raw pointers in `Exec::argv_ptrs` point into the CStrings of
// the same step, which the Plan owns and never mutates; sending the plan to
// another thread moves both together.
unsafe impl Send for Step {}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |c: &CString| c.to_string_lossy().into_owned();
        match self {
            Step::JoinCgroup { what, .. } => write!(f, "join cgroup {what}"),
            Step::IfExists(inner) => inner.fmt(f),
            Step::DieWithParent { .. } => write!(f, "set the parent-death signal"),
            Step::Unshare { flags } => write!(f, "unshare({flags:#x})"),
            Step::Mount { target, fstype, .. } => {
                write!(f, "mount {} on {}", fstype.as_ref().map(s).unwrap_or_else(|| "bind".into()), s(target))
            }
            Step::Mkdir { path, .. } => write!(f, "mkdir {}", s(path)),
            Step::Mknod { path, .. } => write!(f, "mknod {}", s(path)),
            Step::Symlink { path, .. } => write!(f, "symlink {}", s(path)),
            Step::Chown { path, .. } => write!(f, "chown {}", s(path)),
            Step::Chmod { path, .. } => write!(f, "chmod {}", s(path)),
            Step::WriteFiles { dir, files } => {
                write!(f, "write {}/", s(dir))?;
                let names: Vec<String> = files.iter().map(|(name, _)| s(name)).collect();
                write!(f, "{}", names.join(","))
            }
            Step::IdmapBind { source, target, .. } => {
                write!(f, "id-mapped bind of {} on {}", s(source), s(target))
            }
            Step::MkdirsAt { root, components } => {
                write!(f, "mkdir -p {}", s(root))?;
                components.iter().try_for_each(|c| write!(f, "/{}", s(c)))
            }
            Step::IdmapBindAt { source, root, components, .. } => {
                write!(f, "id-mapped bind of {} on {}", s(source), s(root))?;
                components.iter().try_for_each(|c| write!(f, "/{}", s(c)))
            }
            Step::LoopbackUp => write!(f, "bring up the loopback interface"),
            Step::SetHostname { .. } => write!(f, "set the hostname"),
            Step::PivotRoot { new_root } => write!(f, "pivot_root into {}", s(new_root)),
            Step::EnterUserns { .. } => write!(f, "enter the sandbox's user namespace"),
            Step::SetNs { nstype, .. } => write!(f, "setns({nstype:#x})"),
            Step::Notify { .. } => write!(f, "notify the parent"),
            Step::Seccomp { name, .. } => write!(f, "install the seccomp filter ({name})"),
            Step::SetRlimit { resource, limit } => write!(f, "set resource limit {resource} to {limit}"),
            Step::EffectiveIds { uid, gid } => write!(f, "take effective ids {uid}:{gid}"),
            Step::FsIds { uid, gid } => write!(f, "take file system ids {uid}:{gid}"),
            Step::Pause => write!(f, "pause"),
            Step::CloseFds { .. } => write!(f, "close inherited descriptors"),
            Step::DieWithParentPid { .. } => write!(f, "set the parent-death signal"),
            Step::Exec { .. } => write!(f, "exec the agent"),
        }
    }
}

/// The steps a child runs, in order.
#[derive(Debug, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
}

pub use crate::sys::cstr;

impl Plan {
    pub fn push(&mut self, step: Step) {
        self.steps.push(step);
    }

    /// Every descriptor of ours the steps name (Exec's targets are numbers
    /// in the child, not ours).
    fn fds_mut(&mut self) -> Vec<&mut RawFd> {
        fn of<'a>(step: &'a mut Step, out: &mut Vec<&'a mut RawFd>) {
            match step {
                Step::IfExists(inner) => of(inner, out),
                Step::JoinCgroup { fd, .. }
                | Step::EnterUserns { fd }
                | Step::SetNs { fd, .. }
                | Step::Notify { fd }
                | Step::DieWithParent { parent: fd }
                | Step::CloseFds { keep: fd }
                | Step::IdmapBind { userns: fd, .. }
                | Step::IdmapBindAt { userns: fd, .. } => out.push(fd),
                Step::Exec { exe_fd, fds, .. } => {
                    out.push(exe_fd);
                    out.extend(fds.iter_mut().map(|(src, _)| src));
                }
                Step::Unshare { .. }
                | Step::Mount { .. }
                | Step::Mkdir { .. }
                | Step::Mknod { .. }
                | Step::Symlink { .. }
                | Step::Chown { .. }
                | Step::Chmod { .. }
                | Step::WriteFiles { .. }
                | Step::MkdirsAt { .. }
                | Step::LoopbackUp
                | Step::SetHostname { .. }
                | Step::PivotRoot { .. }
                | Step::Seccomp { .. }
                | Step::SetRlimit { .. }
                | Step::EffectiveIds { .. }
                | Step::FsIds { .. }
                | Step::Pause
                | Step::DieWithParentPid { .. } => {}
            }
        }
        let mut out = Vec::new();
        for step in &mut self.steps {
            of(step, &mut out);
        }
        out
    }

    pub fn mkdir(&mut self, path: &Path, mode: libc::mode_t) -> io::Result<()> {
        self.push(Step::Mkdir { path: cstr(path)?, mode });
        Ok(())
    }

    pub fn mount(
        &mut self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: libc::c_ulong,
        data: Option<&str>,
    ) -> io::Result<()> {
        self.push(Step::Mount {
            source: source.map(cstr).transpose()?,
            target: cstr(target)?,
            fstype: fstype.map(cstr).transpose()?,
            flags,
            data: data.map(cstr).transpose()?,
        });
        Ok(())
    }

    /// Binds `source` on `target` (with its submounts if `recursive`),
    /// then remounts the bind with `flags` (a bind takes no flags of its
    /// own when made).
    pub fn bind(&mut self, source: &Path, target: &Path, recursive: bool, flags: libc::c_ulong) -> io::Result<()> {
        let rec = if recursive { libc::MS_REC } else { 0 };
        self.mount(Some(&source.to_string_lossy()), target, None, libc::MS_BIND | rec, None)?;
        self.mount(None, target, None, libc::MS_BIND | libc::MS_REMOUNT | flags, None)
    }

    pub fn exec(
        &mut self,
        exe_fd: RawFd,
        argv: &[&str],
        fds: Vec<(RawFd, RawFd)>,
        nofile: Option<(u64, u64)>,
    ) -> io::Result<()> {
        let argv: Vec<CString> = argv.iter().map(cstr).collect::<io::Result<_>>()?;
        let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        self.push(Step::Exec { exe_fd, argv, argv_ptrs, fds, devnull: cstr("/dev/null")?, nofile });
        Ok(())
    }
}

/// Why a child failed before it could exec the agent.
#[derive(Debug, thiserror::Error)]
#[error("sandbox setup failed at step {index} ({step}): {source}")]
pub struct StepError {
    pub index: usize,
    pub step: String,
    pub source: io::Error,
}

/// A child started from a plan.
#[derive(Debug)]
pub struct Child {
    pub pid: libc::pid_t,
    /// Read end of the report pipe; EOF without data means the exec happened.
    report: OwnedFd,
}

/// Namespaces every sandbox gets at clone time. The network namespace is
/// made beforehand by an [`NsHelper`] and joined, and the user namespace is
/// entered last, by [`Step::EnterUserns`], so that all the others are owned
/// by the host's initial user namespace: root in the sandbox then holds no
/// capability over its own mounts, network or pid namespace.
pub const NAMESPACES: libc::c_int = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;

/// What a [`Step::Notify`] writes: an index no plan reaches, errno 0.
const READY: [u8; 8] = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];

use hutch_agent::vm::VmStack;

/// What the sandbox child gets: the plan and where to report a failure.
struct ChildArgs<'a> {
    plan: &'a Plan,
    report: RawFd,
    /// Cloned sharing our descriptor table (`CLONE_FILES`, see
    /// [`Lease`]): the child first takes a table of its own holding only
    /// the descriptors below this number, and, for a helper (which runs
    /// beside us), says so on `report`, so that we can take the lent
    /// descriptors back.
    unshare_below: Option<u32>,
    notify_unshared: bool,
}

/// The step index a failure to take a descriptor table of its own reports.
const UNSHARE_STEP: u32 = u32::MAX - 1;

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: arg points at the ChildArgs on the parent's stack, which lives
    // until clone returns, and with CLONE_VFORK clone returns only once this
    // child has exec'd or exited.
    let args = unsafe { &*(arg as *const ChildArgs) };
    if let Some(below) = args.unshare_below {
        // Everything from `below` up is left in the shared table: the new
        // one is a copy of the few descriptors beneath, made without
        // touching (taking a reference to, then closing) each of the
        // daemon's thousands.
        let flags = libc::CLOSE_RANGE_UNSHARE as usize;
        // SAFETY: close_range takes no pointer; write reads READY only.
        let ok = unsafe {
            raw::check(raw::syscall(libc::SYS_close_range, [below as usize, u32::MAX as usize, flags, 0, 0, 0])).is_ok()
                && (!args.notify_unshared
                    || raw::syscall(
                        libc::SYS_write,
                        [args.report as usize, READY.as_ptr() as usize, READY.len(), 0, 0, 0],
                    ) == READY.len() as isize)
        };
        if !ok {
            report_failure(args.report, UNSHARE_STEP, libc::EBADF);
        }
    }
    // SAFETY: we are the freshly cloned child; run_plan only makes system
    // calls on the plan's memory and its own stack.
    unsafe { run_plan(args.plan, args.report) }
}

/// Writes a failed step's index and errno to `report`, and exits.
fn report_failure(report: RawFd, index: u32, errno: i32) -> ! {
    let mut msg = [0u8; 8];
    msg[..4].copy_from_slice(&index.to_ne_bytes());
    msg[4..].copy_from_slice(&errno.to_ne_bytes());
    // SAFETY: msg is on our stack; a failed write leaves nothing to do.
    unsafe { raw::syscall(libc::SYS_write, [report as usize, msg.as_ptr() as usize, msg.len(), 0, 0, 0]) };
    raw::exit(125)
}

/// The name of step `index` of `plan` in an error.
fn step_name(plan: &Plan, index: usize) -> String {
    match plan.steps.get(index) {
        Some(step) => step.to_string(),
        None if index == UNSHARE_STEP as usize => "take a descriptor table of its own".into(),
        None => "unknown".into(),
    }
}

/// Descriptor numbers set aside, low in our table, to lend to children:
/// see [`Lease`].
struct Slots {
    /// Blocks of numbers, each holding /dev/null while not lent.
    blocks: std::sync::Mutex<Vec<Vec<RawFd>>>,
    /// /dev/null, put back into a slot when its loan ends.
    null: RawFd,
    /// One above the highest slot: what a child keeps of the table.
    below: RawFd,
}

static SLOTS: std::sync::OnceLock<Option<Slots>> = std::sync::OnceLock::new();
/// Launches that may be in flight with lent descriptors at once.
const SLOT_BLOCKS: usize = 4;
/// Descriptors one launch may borrow (a sandbox's plan names about 15).
const SLOTS_PER_BLOCK: usize = 24;
/// Set aside only while our table is this small: above, the copy a child
/// keeps would cost what it saves.
const SLOTS_BELOW: RawFd = 512;

/// Sets descriptor numbers aside, once per process, for children to
/// borrow (see [`Lease`]); call it early, while few descriptors are open.
/// Without them (or when they are all lent) a child is cloned with a copy
/// of our whole table and closes what it does not need, which costs each
/// of our descriptors a reference taken and a close: with thousands of
/// sandboxes alive (the daemon keeps a network namespace and an OOM
/// counter of each open) perf put about 15% of the host's CPU there while
/// creates ran at 4,000 alive.
pub fn reserve_launch_slots() {
    SLOTS.get_or_init(|| {
        let null = crate::sys::open("/dev/null", libc::O_RDWR).ok()?;
        let mut blocks = Vec::with_capacity(SLOT_BLOCKS);
        let mut taken: Vec<OwnedFd> = Vec::new();
        for _ in 0..SLOT_BLOCKS {
            let mut block = Vec::with_capacity(SLOTS_PER_BLOCK);
            for _ in 0..SLOTS_PER_BLOCK {
                // The lowest free number (F_DUPFD from 0), close-on-exec.
                // SAFETY: fcntl on a descriptor we own; the result is owned below.
                let fd = unsafe { libc::fcntl(null.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
                if fd < 0 {
                    return None;
                }
                // SAFETY: fd was just made and is owned by nobody else.
                taken.push(unsafe { OwnedFd::from_raw_fd(fd) });
                block.push(fd);
            }
            blocks.push(block);
        }
        let below = taken.iter().map(|f| f.as_raw_fd()).max().unwrap_or(0) + 1;
        if below > SLOTS_BELOW {
            return None;
        }
        // Kept for the life of the process.
        for f in taken {
            let _ = f.into_raw_fd();
        }
        Some(Slots { blocks: std::sync::Mutex::new(blocks), null: null.into_raw_fd(), below })
    });
}

/// Descriptors of ours lent to a child at numbers of a [`Slots`] block, so
/// that a child cloned sharing our table (`CLONE_FILES`) can take a table
/// of its own holding only the numbers below the slots
/// (`close_range(..., CLOSE_RANGE_UNSHARE)`), whatever the size of ours.
/// The plan's descriptors are renumbered to the slots. While the loan
/// lasts, which is until the child has its own table, our other threads
/// never get those numbers: they are never free. Dropping the lease puts
/// /dev/null back into each slot.
struct Lease {
    slots: &'static Slots,
    block: Vec<RawFd>,
    used: usize,
}

impl Lease {
    /// Lends `plan`'s descriptors and `extra` ones, renumbering them; None
    /// (nothing changed) if no slots were set aside, all are lent, or the
    /// plan names more descriptors than a block holds.
    fn take(plan: &mut Plan, extra: &mut [&mut RawFd]) -> Option<Lease> {
        let slots = SLOTS.get()?.as_ref()?;
        let mut fds = plan.fds_mut();
        fds.extend(extra.iter_mut().map(|f| &mut **f));
        let mut distinct: Vec<RawFd> = fds.iter().map(|f| **f).collect();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > SLOTS_PER_BLOCK {
            return None;
        }
        let block = slots.blocks.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        let mut lease = Lease { slots, block, used: 0 };
        for (i, &fd) in distinct.iter().enumerate() {
            let slot = lease.block[i];
            // SAFETY: fcntl and dup3 on descriptors we hold; dup3 replaces
            // the slot's /dev/null, a number nobody else uses.
            let ok = unsafe {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                let cloexec = if flags >= 0 && flags & libc::FD_CLOEXEC != 0 { libc::O_CLOEXEC } else { 0 };
                flags >= 0 && libc::dup3(fd, slot, cloexec) == slot
            };
            if !ok {
                return None; // The lease's drop restores what was lent.
            }
            lease.used = i + 1;
        }
        for f in fds {
            let i = distinct.binary_search(f).expect("every descriptor was lent");
            *f = lease.block[i];
        }
        Some(lease)
    }

    fn below(&self) -> u32 {
        self.slots.below as u32
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        for &slot in &self.block[..self.used] {
            // SAFETY: dup3 of our /dev/null over a slot of ours.
            unsafe { libc::dup3(self.slots.null, slot, libc::O_CLOEXEC) };
        }
        let block = std::mem::take(&mut self.block);
        self.slots.blocks.lock().unwrap_or_else(|p| p.into_inner()).push(block);
    }
}

/// Clones a child into the sandbox namespaces and runs `plan` in it. The
/// child shares our memory and we are suspended until it execs the agent or
/// exits (`CLONE_VM | CLONE_VFORK`, as posix_spawn does), so it must not
/// write anything but its own stack: `run_plan` only makes system calls.
///
/// The plan's descriptors are lent to the child at low numbers where that
/// is possible (see [`Lease`]): the plan is renumbered.
pub fn spawn(plan: &mut Plan) -> io::Result<Child> {
    let (rd, wr) = crate::sys::pipe()?;
    let stack = VmStack::new(64 * 1024)?;
    let mut report = wr.as_raw_fd();
    let lease = Lease::take(plan, &mut [&mut report]);
    let unshare_below = lease.as_ref().map(Lease::below);
    let args = ChildArgs { plan, report, unshare_below, notify_unshared: false };
    let shared = if lease.is_some() { libc::CLONE_FILES } else { 0 };
    let flags = libc::CLONE_VFORK | NAMESPACES | libc::SIGCHLD | shared;
    // SAFETY: child_main runs `run_plan` (raw system calls only) on `stack`,
    // which outlives the child's use of it (CLONE_VFORK), with a pointer to
    // `args`, which does too.
    let pid = unsafe {
        hutch_agent::vm::clone_vm(child_main, &stack, flags, &args as *const ChildArgs as *mut libc::c_void)?
    };
    // The child has exec'd or exited (CLONE_VFORK): it no longer shares
    // our table, and the loan ends.
    drop(lease);
    drop(wr);
    Ok(Child { pid, report: rd })
}

impl Child {
    /// Blocks until the child has exec'd the agent or failed; on failure
    /// reaps it and says which step failed.
    pub fn wait_started(self, plan: &Plan) -> Result<libc::pid_t, StepError> {
        let mut buf = [0u8; 8];
        let n = crate::sys::read_full(self.report.as_raw_fd(), &mut buf);
        match n {
            Ok(0) => Ok(self.pid),
            Ok(8) => {
                let index = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
                let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
                crate::sys::reap(self.pid);
                Err(StepError { index, step: step_name(plan, index), source: io::Error::from_raw_os_error(errno) })
            }
            Ok(_) | Err(_) => {
                crate::sys::kill(self.pid, libc::SIGKILL);
                crate::sys::reap(self.pid);
                Err(StepError {
                    index: usize::MAX,
                    step: "report".into(),
                    source: io::Error::new(io::ErrorKind::UnexpectedEof, "child report pipe broke"),
                })
            }
        }
    }
}

/// Executes the plan; never returns.
///
/// # Safety
/// Must only be called in a freshly cloned child; see the module comment.
unsafe fn run_plan(plan: &Plan, report: RawFd) -> ! {
    let mut report = report;
    for (index, step) in plan.steps.iter().enumerate() {
        // SAFETY: every pointer a step passes comes from data the plan owns.
        if let Err(errno) = unsafe { run_step(step, &mut report) } {
            report_failure(report, index as u32, errno);
        }
    }
    // A plan ends with Exec or Pause; reaching here is a bug.
    raw::exit(124)
}

use crate::sys::raw;

/// A raw system call with up to six arguments, each cast to a register
/// (`as usize`: pointers keep their address, negative ints sign-extend as
/// the kernel expects); `Ok(answer)` or `Err(errno)`.
macro_rules! sc {
    ($nr:expr $(, $a:expr)* $(,)?) => {{
        let given: &[usize] = &[$($a as usize),*];
        let mut args = [0usize; 6];
        args[..given.len()].copy_from_slice(given);
        raw::check(raw::syscall($nr, args))
    }};
}

fn ptr_or_null(c: &Option<CString>) -> *const libc::c_char {
    c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
}

/// Closes every descriptor from `first` up except those in `keep`.
///
/// # Safety
/// Raw system calls only; closes descriptors the caller may still name.
unsafe fn close_from_except(first: RawFd, keep: &mut [RawFd]) -> Result<(), i32> {
    keep.sort_unstable();
    let mut from = first as u32;
    for &k in keep.iter() {
        let k = k as u32;
        if k < from {
            continue;
        }
        if k > from {
            // SAFETY: close_range takes no pointer.
            unsafe { sc!(libc::SYS_close_range, from, k - 1, 0) }?;
        }
        from = k + 1;
    }
    // SAFETY: as above.
    unsafe { sc!(libc::SYS_close_range, from, libc::c_uint::MAX, 0) }.map(drop)
}

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;

/// Opens `root` and then each of `components` under it (`O_PATH`, never
/// through a symlink), making those missing first when `make`; returns the
/// last one's descriptor.
///
/// # Safety
/// Raw system calls only, on C strings the caller owns.
unsafe fn walk_dirs(root: &CString, components: &[CString], make: bool) -> Result<usize, i32> {
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: root is a valid C string.
    let mut dir = unsafe { sc!(libc::SYS_openat, libc::AT_FDCWD, root.as_ptr(), flags) }?;
    for c in components {
        if make {
            // SAFETY: c is a valid C string; dir is ours.
            match unsafe { sc!(libc::SYS_mkdirat, dir, c.as_ptr(), 0o755) } {
                Ok(_) | Err(libc::EEXIST) => {}
                Err(e) => {
                    // SAFETY: dir is ours.
                    let _ = unsafe { sc!(libc::SYS_close, dir) };
                    return Err(e);
                }
            }
        }
        // SAFETY: as above.
        let next = unsafe { sc!(libc::SYS_openat, dir, c.as_ptr(), flags) };
        // SAFETY: dir is ours.
        let _ = unsafe { sc!(libc::SYS_close, dir) };
        dir = next?;
    }
    Ok(dir)
}

/// Binds a copy of the tree at `source`, id-mapped through user namespace
/// `userns` with `attrs` set, at `to_path` relative to `to_dir`
/// (`move_mount` with `flags`: `MOVE_MOUNT_T_EMPTY_PATH` binds onto
/// `to_dir` itself).
///
/// # Safety
/// Raw system calls only, on C strings and descriptors the caller owns.
unsafe fn idmap_bind(
    source: &CString,
    attrs: u64,
    userns: RawFd,
    to_dir: i32,
    to_path: *const libc::c_char,
    flags: libc::c_uint,
) -> Result<(), i32> {
    // SAFETY: source is a valid C string.
    let tree = unsafe {
        sc!(libc::SYS_open_tree, libc::AT_FDCWD, source.as_ptr(), OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint)
    }?;
    let attr = MountAttr { attr_set: MOUNT_ATTR_IDMAP | attrs, attr_clr: 0, propagation: 0, userns_fd: userns as u64 };
    // SAFETY: tree is ours; attr outlives the call; to_path is the caller's.
    let moved = unsafe {
        sc!(
            libc::SYS_mount_setattr,
            tree,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
        .and_then(|_| sc!(libc::SYS_move_mount, tree, c"".as_ptr(), to_dir, to_path, flags))
    };
    // SAFETY: tree is ours.
    let _ = unsafe { sc!(libc::SYS_close, tree) };
    moved.map(drop)
}

/// `SECBIT_NO_SETUID_FIXUP` (linux/securebits.h): changing uids keeps
/// the capability sets as they are.
const SECBIT_NO_SETUID_FIXUP: usize = 1 << 2;

/// Runs one step; `report` is the report pipe, which Exec moves.
///
/// # Safety
/// Raw system calls on the step's own data only (see the module comment).
unsafe fn run_step(step: &Step, report: &mut RawFd) -> Result<(), i32> {
    // SAFETY: (whole function) each call gets pointers to NUL-terminated
    // strings or structs owned by `step` or on our stack, valid for the
    // call's duration; no call touches errno or any memory but those.
    unsafe {
        match step {
            Step::IfExists(inner) => match run_step(inner, report) {
                Err(libc::ENOENT) => Ok(()),
                other => other,
            },
            Step::JoinCgroup { fd, .. } => match sc!(libc::SYS_write, *fd, b"0".as_ptr(), 1)? {
                1 => Ok(()),
                _ => Err(libc::EIO),
            },
            Step::DieWithParent { parent } => {
                sc!(libc::SYS_prctl, libc::PR_SET_PDEATHSIG, libc::SIGKILL)?;
                // A pidfd polls readable once its process has exited.
                let mut pfd = libc::pollfd { fd: *parent, events: libc::POLLIN, revents: 0 };
                let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                sc!(libc::SYS_ppoll, &mut pfd as *mut libc::pollfd, 1, &zero as *const libc::timespec, 0, 0)?;
                if pfd.revents != 0 {
                    return Err(libc::ESRCH);
                }
                Ok(())
            }
            Step::Unshare { flags } => sc!(libc::SYS_unshare, *flags).map(drop),
            Step::Mount { source, target, fstype, flags, data } => sc!(
                libc::SYS_mount,
                ptr_or_null(source),
                target.as_ptr(),
                ptr_or_null(fstype),
                *flags,
                ptr_or_null(data),
            )
            .map(drop),
            Step::Mkdir { path, mode } => sc!(libc::SYS_mkdirat, libc::AT_FDCWD, path.as_ptr(), *mode).map(drop),
            Step::Mknod { path, mode, dev } => {
                sc!(libc::SYS_mknodat, libc::AT_FDCWD, path.as_ptr(), *mode, *dev).map(drop)
            }
            Step::Symlink { target, path } => {
                sc!(libc::SYS_symlinkat, target.as_ptr(), libc::AT_FDCWD, path.as_ptr()).map(drop)
            }
            Step::Chown { path, uid, gid } => {
                sc!(libc::SYS_fchownat, libc::AT_FDCWD, path.as_ptr(), *uid, *gid, libc::AT_SYMLINK_NOFOLLOW).map(drop)
            }
            Step::Chmod { path, mode } => sc!(libc::SYS_fchmodat, libc::AT_FDCWD, path.as_ptr(), *mode, 0).map(drop),
            Step::WriteFiles { dir, files } => {
                let dirfd = sc!(
                    libc::SYS_openat,
                    libc::AT_FDCWD,
                    dir.as_ptr(),
                    libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC
                )?;
                let written = files.iter().try_for_each(|(name, data)| {
                    let fd = sc!(libc::SYS_openat, dirfd, name.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC)?;
                    let bytes = data.as_bytes();
                    let n = sc!(libc::SYS_write, fd, bytes.as_ptr(), bytes.len());
                    let _ = sc!(libc::SYS_close, fd);
                    if n? != bytes.len() {
                        return Err(libc::EIO);
                    }
                    Ok(())
                });
                let _ = sc!(libc::SYS_close, dirfd);
                written
            }
            Step::IdmapBind { source, target, attrs, userns } => {
                idmap_bind(source, *attrs, *userns, libc::AT_FDCWD, target.as_ptr(), MOVE_MOUNT_F_EMPTY_PATH)
            }
            Step::MkdirsAt { root, components } => {
                let dir = walk_dirs(root, components, true)?;
                let _ = sc!(libc::SYS_close, dir);
                Ok(())
            }
            Step::IdmapBindAt { source, root, components, attrs, userns } => {
                let target = walk_dirs(root, components, false)?;
                let flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH;
                let moved = idmap_bind(source, *attrs, *userns, target as i32, c"".as_ptr(), flags);
                let _ = sc!(libc::SYS_close, target);
                moved
            }
            Step::LoopbackUp => {
                let sock = sc!(libc::SYS_socket, libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)?;
                let mut req: libc::ifreq = std::mem::zeroed();
                req.ifr_name[0] = b'l' as libc::c_char;
                req.ifr_name[1] = b'o' as libc::c_char;
                req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
                let ret = sc!(libc::SYS_ioctl, sock, libc::SIOCSIFFLAGS, &req as *const libc::ifreq);
                let _ = sc!(libc::SYS_close, sock);
                ret.map(drop)
            }
            Step::SetHostname { name } => sc!(libc::SYS_sethostname, name.as_ptr(), name.as_bytes().len()).map(drop),
            Step::PivotRoot { new_root } => {
                sc!(libc::SYS_chdir, new_root.as_ptr())?;
                sc!(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr())?;
                // The old root now sits on top of the new one at "/"; detach it.
                sc!(libc::SYS_umount2, c".".as_ptr(), libc::MNT_DETACH)?;
                sc!(libc::SYS_chdir, c"/".as_ptr()).map(drop)
            }
            Step::SetNs { fd, nstype } => sc!(libc::SYS_setns, *fd, *nstype).map(drop),
            Step::Seccomp { program, .. } => {
                let prog = libc::sock_fprog { len: program.len() as u16, filter: program.as_ptr() as *mut _ };
                sc!(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &prog as *const libc::sock_fprog).map(drop)
            }
            Step::SetRlimit { resource, limit } => {
                let lim = libc::rlimit64 { rlim_cur: *limit, rlim_max: *limit };
                sc!(libc::SYS_prlimit64, 0, *resource, &lim as *const libc::rlimit64, 0).map(drop)
            }
            Step::EffectiveIds { uid, gid } => {
                sc!(libc::SYS_prctl, libc::PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP)?;
                // -1: leave the real and saved ids (root) as they are.
                sc!(libc::SYS_setresgid, -1i32, *gid, -1i32)?;
                sc!(libc::SYS_setresuid, -1i32, *uid, -1i32).map(drop)
            }
            Step::FsIds { uid, gid } => {
                if *uid != 0 {
                    sc!(libc::SYS_prctl, libc::PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP)?;
                }
                // setfsuid and setfsgid answer the previous id and never
                // fail; asking with an invalid id (-1) reads the current.
                sc!(libc::SYS_setfsgid, *gid)?;
                sc!(libc::SYS_setfsuid, *uid)?;
                if sc!(libc::SYS_setfsuid, -1i32)? != *uid as usize || sc!(libc::SYS_setfsgid, -1i32)? != *gid as usize
                {
                    return Err(libc::EPERM);
                }
                if *uid == 0 {
                    sc!(libc::SYS_prctl, libc::PR_SET_SECUREBITS, 0).map(drop)
                } else {
                    Ok(())
                }
            }
            Step::Notify { fd } => match sc!(libc::SYS_write, *fd, READY.as_ptr(), READY.len())? {
                8 => Ok(()),
                _ => Err(libc::EIO),
            },
            Step::Pause => loop {
                // ppoll of nothing, no timeout: sleeps until a signal kills us.
                let _ = sc!(libc::SYS_ppoll, 0, 0, 0, 0, 0);
            },
            Step::CloseFds { keep } => close_from_except(3, &mut [*keep]),
            Step::DieWithParentPid { parent } => {
                sc!(libc::SYS_prctl, libc::PR_SET_PDEATHSIG, libc::SIGKILL)?;
                if sc!(libc::SYS_getppid)? != *parent as usize {
                    return Err(libc::ESRCH);
                }
                Ok(())
            }
            Step::EnterUserns { fd } => {
                sc!(libc::SYS_setns, *fd, libc::CLONE_NEWUSER)?;
                sc!(libc::SYS_setgroups, 0, 0)?;
                sc!(libc::SYS_setresgid, 0, 0, 0)?;
                sc!(libc::SYS_setresuid, 0, 0, 0).map(drop)
            }
            Step::Exec { exe_fd, argv: _, argv_ptrs, fds, devnull, nofile } => {
                // The report pipe goes above every target first, so that no
                // dup3 below overwrites it and a failed exec can still say so;
                // it is close-on-exec, so a successful one closes it.
                *report = sc!(libc::SYS_fcntl, *report, libc::F_DUPFD_CLOEXEC, 64)? as RawFd;
                // Move every source above the targets too, so that no dup3
                // overwrites a source still to be moved.
                let mut moved = [0 as RawFd; 8];
                if fds.len() > moved.len() {
                    return Err(libc::E2BIG);
                }
                for (i, (src, _)) in fds.iter().enumerate() {
                    moved[i] = sc!(libc::SYS_fcntl, *src, libc::F_DUPFD_CLOEXEC, 64)? as RawFd;
                }
                let exe = sc!(libc::SYS_fcntl, *exe_fd, libc::F_DUPFD_CLOEXEC, 64)? as RawFd;
                for (i, (_, dst)) in fds.iter().enumerate() {
                    // dup3 without O_CLOEXEC: the target is inherited.
                    sc!(libc::SYS_dup3, moved[i], *dst, 0)?;
                }
                let null = sc!(libc::SYS_openat, libc::AT_FDCWD, devnull.as_ptr(), libc::O_RDWR)? as RawFd;
                for std_fd in 0..3 {
                    if null != std_fd {
                        sc!(libc::SYS_dup3, null, std_fd, 0)?;
                    }
                }
                let first_free = fds.iter().map(|(_, d)| *d).max().unwrap_or(2).max(2) + 1;
                // Close all but the targets, the exe and the report pipe;
                // the last two are close-on-exec, so execveat drops them.
                close_from_except(first_free, &mut [exe, *report])?;
                // Last, once the daemon's descriptors are closed: a lower
                // limit set before would leave none free for the steps above.
                if let Some((soft, hard)) = nofile {
                    let lim = libc::rlimit { rlim_cur: *soft, rlim_max: *hard };
                    sc!(libc::SYS_prlimit64, 0, libc::RLIMIT_NOFILE, &lim as *const libc::rlimit, 0)?;
                }
                let envp: [*const libc::c_char; 1] = [std::ptr::null()];
                sc!(libc::SYS_execveat, exe, c"".as_ptr(), argv_ptrs.as_ptr(), envp.as_ptr(), libc::AT_EMPTY_PATH)
                    .map(drop)
            }
        }
    }
}

/// A pidfd of the calling process.
pub fn pidfd_self() -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open on our own pid has no memory effects.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A plan run by a child that shares our memory and runs at the same time
/// as the caller (`CLONE_VM` without `CLONE_VFORK`), until it is killed.
/// The plan reports "ready" with [`Step::Notify`] or a failed step, as the
/// sandbox child does; the caller waits for either with [`Helper::ready`].
struct Helper {
    pid: libc::pid_t,
    report: OwnedFd,
    // Referenced by the running helper: dropped only after it is reaped.
    plan: Box<Plan>,
    args: Box<ChildArgs<'static>>,
    stack: VmStack,
    done: bool,
}

impl Helper {
    /// Starts `plan`, which must end in [`Step::Pause`]; `report` is the
    /// write end of the pipe whose read end is `report_rd` (its steps may
    /// name it, to keep it open and to notify).
    fn start(mut plan: Plan, report: OwnedFd, report_rd: OwnedFd) -> io::Result<Helper> {
        let mut report_fd = report.as_raw_fd();
        let lease = Lease::take(&mut plan, &mut [&mut report_fd]);
        let plan = Box::new(plan);
        // SAFETY: the reference is only used by the helper, which is killed
        // and reaped before `plan` is dropped (see Drop and end).
        let plan_ref: &'static Plan = unsafe { &*(plan.as_ref() as *const Plan) };
        let unshare_below = lease.as_ref().map(Lease::below);
        let args =
            Box::new(ChildArgs { plan: plan_ref, report: report_fd, unshare_below, notify_unshared: lease.is_some() });
        let stack = VmStack::new(16 * 1024)?;
        let shared = if lease.is_some() { libc::CLONE_FILES } else { 0 };
        // SAFETY: the helper runs `run_plan` (raw system calls only, none
        // touching errno in the TLS it shares with us) on its own stack;
        // `args`, `plan` and `stack` outlive it (kept in the result).
        let pid = unsafe {
            hutch_agent::vm::clone_vm(
                child_main,
                &stack,
                libc::SIGCHLD | shared,
                args.as_ref() as *const ChildArgs as *mut libc::c_void,
            )?
        };
        drop(report);
        let helper = Helper { pid, report: report_rd, plan, args, stack, done: false };
        if lease.is_some() {
            // The loan ends once the helper has a table of its own. Until
            // then a slot of ours holds the pipe's write end too, so the
            // helper's death would not end the read: we watch for it.
            helper.wait_unshared()?;
            drop(lease);
        }
        Ok(helper)
    }

    /// Waits for the notice a helper sharing our table gives once it has
    /// a table of its own, or for its death.
    fn wait_unshared(&self) -> io::Result<()> {
        let mut pfd = libc::pollfd { fd: self.report.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        loop {
            // SAFETY: pfd is one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, 50) };
            if n > 0 {
                return self.ready("helper");
            }
            if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: siginfo_t is plain data, valid zeroed.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid on our child into `info`; WNOWAIT leaves it
            // waitable for end() to reap.
            let r = unsafe {
                libc::waitid(
                    libc::P_PID,
                    self.pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                )
            };
            // SAFETY: waitid filled `info` (si_pid stays 0 if nothing exited).
            if r == 0 && unsafe { info.si_pid() } != 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "helper: died before it started"));
            }
        }
    }

    /// Waits until the helper notified or failed; a failure names its step.
    fn ready(&self, what: &str) -> io::Result<()> {
        let mut buf = [0u8; 8];
        let n = crate::sys::read_full(self.report.as_raw_fd(), &mut buf)?;
        if n == 8 && buf == READY {
            return Ok(());
        }
        let index = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let step = step_name(&self.plan, index);
        let source = if n == 8 { io::Error::from_raw_os_error(errno) } else { io::ErrorKind::UnexpectedEof.into() };
        Err(io::Error::new(source.kind(), format!("{what}: {step}: {source}")))
    }

    fn end(&mut self) {
        if !self.done {
            crate::sys::kill(self.pid, libc::SIGKILL);
            crate::sys::reap(self.pid);
            self.done = true;
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // Before plan, args and stack go: the helper must be gone first.
        self.end();
        let _ = (&self.args, &self.stack);
    }
}

/// `/proc/sys/user` limits set to 0 in every sandbox's user namespace: no
/// namespace may be made from inside (seccomp refuses it too; this is the
/// kernel's own second lock). The host makes all of a sandbox's namespaces
/// from outside, so none of them is charged here.
const NO_NAMESPACES: &[&str] = &[
    "max_user_namespaces",
    "max_pid_namespaces",
    "max_uts_namespaces",
    "max_ipc_namespaces",
    "max_net_namespaces",
    "max_mnt_namespaces",
    "max_cgroup_namespaces",
    "max_time_namespaces",
];

/// Makes a sandbox's user namespace (ids `0..count` inside mapped to
/// `base..base+count` on the host) and, optionally, its network namespace
/// (owned by the host, with `lo` up and the per-namespace sysctls set), in a
/// helper that shares our memory and runs on the other CPU while the caller
/// does other work. Descriptors keep the namespaces alive after the helper
/// is gone.
///
/// The user namespace is owned by host id `base` (the sandbox's own root),
/// not by host root: the kernel charges the per-user counters of everything
/// inside the namespace (inotify, fanotify, message queue bytes, queued
/// signals, locked shared memory, user namespaces) to its owner as well, so
/// each sandbox draws on a share of its own and never on host root's, which
/// the host and every other sandbox would otherwise share with it. Those
/// charges are capped by the host's own per-user limits
/// (`/proc/sys/user/max_*` of the host) and, for the counters kept as
/// resource limits, by `rlimits`, which the helper takes before it makes the
/// namespace (the kernel records the creator's limits in it).
pub struct NsHelper {
    helper: Helper,
    base: u32,
    count: u32,
    with_net: bool,
}

/// Namespaces made by an [`NsHelper`].
#[derive(Debug)]
pub struct Namespaces {
    pub user: OwnedFd,
    pub net: Option<OwnedFd>,
}

impl NsHelper {
    pub fn start(base: u32, count: u32, with_net: bool, rlimits: &[(libc::c_int, u64)]) -> io::Result<NsHelper> {
        let (rd, wr) = crate::sys::pipe()?;
        let mut plan = Plan::default();
        // The helper must neither outlive us (if the daemon is killed
        // mid-create) nor hold our descriptors (the listening socket, the
        // database, uid slot locks) while it lives.
        plan.push(Step::CloseFds { keep: wr.as_raw_fd() });
        // A procfs of its own for the sysctls below, in a mount namespace of
        // its own. Through the host's procfs, each path under /proc/sys
        // would cost as much as the sandboxes alive: every live namespace
        // leaves its dentries of `net` and `user` files in that procfs,
        // all in one hash chain per name (same parent, same name), which a
        // lookup compares one by one under a lock. A fresh procfs holds
        // this namespace's only.
        plan.push(Step::Unshare { flags: libc::CLONE_NEWNS });
        plan.mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_SLAVE, None)?;
        plan.mount(
            Some("proc"),
            Path::new("/proc"),
            Some("proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        )?;
        if with_net {
            plan.push(Step::Unshare { flags: libc::CLONE_NEWNET });
            plan.push(Step::LoopbackUp);
            // Per network namespace: any user of the sandbox may bind low
            // ports and ping, as the namespace is the sandbox's alone.
            plan.push(Step::WriteFiles {
                dir: cstr("/proc/sys/net/ipv4")?,
                files: vec![
                    (cstr("ip_unprivileged_port_start")?, cstr("0")?),
                    (cstr("ping_group_range")?, cstr(format!("{base} {}", base + count - 1))?),
                ],
            });
        }
        for &(resource, limit) in rlimits {
            plan.push(Step::SetRlimit { resource, limit });
        }
        plan.push(Step::EffectiveIds { uid: base, gid: base });
        // After the id change, which clears the parent-death signal.
        // SAFETY: getpid has no preconditions.
        plan.push(Step::DieWithParentPid { parent: unsafe { libc::getpid() } });
        plan.push(Step::Unshare { flags: libc::CLONE_NEWUSER });
        plan.push(Step::WriteFiles {
            dir: cstr("/proc/sys/user")?,
            files: NO_NAMESPACES.iter().map(|name| Ok((cstr(*name)?, cstr("0")?))).collect::<io::Result<_>>()?,
        });
        plan.push(Step::Notify { fd: wr.as_raw_fd() });
        plan.push(Step::Pause);
        let helper = Helper::start(plan, wr, rd)?;
        Ok(NsHelper { helper, base, count, with_net })
    }

    /// Waits for the helper to reach its user namespace, maps the ids, and
    /// takes descriptors of the namespaces.
    pub fn finish(mut self) -> io::Result<Namespaces> {
        let result = self.collect();
        self.helper.end();
        result
    }

    fn collect(&mut self) -> io::Result<Namespaces> {
        self.helper.ready("namespace helper")?;
        let pid = self.helper.pid;
        let map = format!("0 {} {}\n", self.base, self.count);
        std::fs::write(format!("/proc/{pid}/uid_map"), &map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map)?;
        let user = open_ns(pid, "user")?;
        let net = if self.with_net { Some(open_ns(pid, "net")?) } else { None };
        Ok(Namespaces { user, net })
    }
}

fn open_ns(pid: libc::pid_t, kind: &str) -> io::Result<OwnedFd> {
    crate::sys::open(format!("/proc/{pid}/ns/{kind}"), libc::O_RDONLY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn errno_location() -> *mut libc::c_int {
        // SAFETY: __errno_location always returns this thread's errno.
        unsafe { libc::__errno_location() }
    }

    #[test]
    fn a_failed_exec_reports_its_step_and_errno_instead_of_a_start() {
        // An "agent" the kernel cannot exec: no ELF header, no #! line.
        let dir = std::env::temp_dir().join(format!("hutch-launch-exec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let bad = dir.join("not-an-agent");
        std::fs::write(&bad, b"\0\0\0\0 not a program").expect("write");
        std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let exe = crate::sys::open(&bad, libc::O_PATH).expect("open");
        let keep = crate::sys::open("/dev/null", libc::O_RDONLY).expect("open");
        let mut plan = Plan::default();
        // A descriptor placed at 3, where the report pipe may well sit.
        plan.exec(exe.as_raw_fd(), &["not-an-agent"], vec![(keep.as_raw_fd(), 3)], None).expect("plan");
        let child = spawn(&mut plan).expect("clone");
        let err = child.wait_started(&plan).expect_err("the exec failed; the child must not read as started");
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert_eq!(err.index, 0);
        assert_eq!(err.step, "exec the agent");
        assert_eq!(err.source.raw_os_error(), Some(libc::ENOEXEC), "{err}");
    }

    #[test]
    fn a_helper_reports_its_own_errno_and_leaves_the_callers_alone() {
        let (rd, wr) = crate::sys::pipe().expect("pipe");
        let mut plan = Plan::default();
        plan.push(Step::CloseFds { keep: wr.as_raw_fd() });
        plan.push(Step::WriteFiles {
            dir: cstr("/nonexistent/hutch").expect("c"),
            files: vec![(cstr("helper").expect("c"), cstr("x").expect("c"))],
        });
        plan.push(Step::Notify { fd: wr.as_raw_fd() });
        plan.push(Step::Pause);
        // SAFETY: writing this thread's own errno.
        unsafe { *errno_location() = 0 };
        let helper = Helper::start(plan, wr, rd).expect("start");
        let err = helper.ready("helper").expect_err("the write must fail");
        // The helper's failure, with the helper's errno.
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        assert!(err.to_string().contains("write /nonexistent/hutch/helper"), "{err}");
        // And nothing of it in the errno of the thread that cloned it, whose
        // TLS the helper shares.
        // SAFETY: reading this thread's own errno.
        assert_eq!(unsafe { *errno_location() }, 0, "the helper wrote the caller's errno");
    }

    #[test]
    fn a_child_gets_lent_descriptors_and_none_of_the_rest_of_a_large_table() {
        reserve_launch_slots();
        let slots = SLOTS.get().and_then(Option::as_ref).expect("slots set aside in a small table");
        // A table of a few hundred descriptors, as a daemon's with many
        // sandboxes alive.
        let many: Vec<OwnedFd> =
            (0..400).map(|_| crate::sys::open("/dev/null", libc::O_RDONLY).expect("open")).collect();
        let (rd, wr) = crate::sys::pipe().expect("pipe");
        let sh = crate::sys::open("/bin/sh", libc::O_PATH).expect("open sh");
        let mut plan = Plan::default();
        // The shell lists its descriptors into the pipe, at 3.
        plan.exec(sh.as_raw_fd(), &["sh", "-c", "ls /proc/self/fd >&3"], vec![(wr.as_raw_fd(), 3)], None)
            .expect("plan");
        let child = spawn(&mut plan).expect("clone");
        let Step::Exec { exe_fd, fds, .. } = &plan.steps[0] else { unreachable!() };
        assert!(*exe_fd < slots.below && fds[0].0 < slots.below, "the plan names lent numbers");
        let pid = child.wait_started(&plan).expect("started");
        drop(wr);
        let mut out = vec![0u8; 4096];
        let n = crate::sys::read_full(rd.as_raw_fd(), &mut out).expect("read");
        crate::sys::reap(pid);
        let listed: Vec<String> = String::from_utf8_lossy(&out[..n]).lines().map(str::to_owned).collect();
        // 0-2, the pipe, and the directory ls reads: nothing of ours.
        assert!(listed.len() <= 5 && listed.iter().all(|fd| fd.parse::<u32>().is_ok_and(|n| n < 8)), "{listed:?}");
        // The slots hold /dev/null again, and every block is back.
        for block in slots.blocks.lock().expect("lock").iter() {
            for slot in block {
                let target = std::fs::read_link(format!("/proc/self/fd/{slot}")).expect("slot open");
                assert_eq!(target, Path::new("/dev/null"));
            }
        }
        drop(many);
    }

    #[test]
    fn close_from_except_keeps_exactly_what_it_is_told() {
        // In a forked child (closing descriptors of the test harness would
        // break it): open a few, close from the lowest but two, report.
        let (rd, wr) = crate::sys::pipe().expect("pipe");
        let (w, r) = (wr.as_raw_fd(), rd.as_raw_fd());
        // SAFETY: the child makes raw system calls only and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: raw system calls in the forked child.
            unsafe {
                let a = sc!(libc::SYS_fcntl, w, libc::F_DUPFD, 100).unwrap_or(0) as RawFd;
                let b = sc!(libc::SYS_fcntl, w, libc::F_DUPFD, 110).unwrap_or(0) as RawFd;
                let c = sc!(libc::SYS_fcntl, w, libc::F_DUPFD, 120).unwrap_or(0) as RawFd;
                let _ = close_from_except(a, &mut [c, w]);
                let open = |fd: RawFd| sc!(libc::SYS_fcntl, fd, libc::F_GETFD).is_ok() as u8;
                let msg = [open(a), open(b), open(c), open(w)];
                let _ = sc!(libc::SYS_write, w, msg.as_ptr(), 4);
                raw::exit(0);
            }
        }
        drop(wr);
        let mut buf = [0u8; 4];
        let n = crate::sys::read_full(r, &mut buf).expect("read");
        crate::sys::reap(pid);
        assert_eq!((n, buf), (4, [0, 0, 1, 1]));
    }
}
