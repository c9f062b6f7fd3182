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
//! successful `execveat` closes that pipe.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
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
    /// Opens an existing file and writes `data` (sysctls, oom_score_adj).
    WriteFile {
        path: CString,
        data: CString,
    },
    /// Bind mounts `source` on `target` through an id-mapped, detached mount
    /// (open_tree + mount_setattr + move_mount), with `attrs` set too.
    IdmapBind {
        source: CString,
        target: CString,
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
    /// Installs a seccomp filter (classic BPF, `struct sock_filter` bytes).
    /// Inherited by the agent and everything it starts, so the kernel
    /// compiles it once per sandbox instead of once per command.
    Seccomp {
        filter: Vec<u8>,
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
            Step::WriteFile { path, .. } => write!(f, "write {}", s(path)),
            Step::IdmapBind { source, target, .. } => {
                write!(f, "id-mapped bind of {} on {}", s(source), s(target))
            }
            Step::LoopbackUp => write!(f, "bring up the loopback interface"),
            Step::SetHostname { .. } => write!(f, "set the hostname"),
            Step::PivotRoot { new_root } => write!(f, "pivot_root into {}", s(new_root)),
            Step::EnterUserns { .. } => write!(f, "enter the sandbox's user namespace"),
            Step::SetNs { nstype, .. } => write!(f, "setns({nstype:#x})"),
            Step::Notify { .. } => write!(f, "notify the parent"),
            Step::Seccomp { .. } => write!(f, "install the seccomp filter"),
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

/// Turns a path or string into a C string; interior NULs are a caller bug
/// caught by validation upstream, reported as InvalidInput here.
pub fn cstr(s: impl AsRef<std::ffi::OsStr>) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(s.as_ref().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}

impl Plan {
    pub fn push(&mut self, step: Step) {
        self.steps.push(step);
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

/// A stack for a child that shares our memory (`CLONE_VM`), with a guard
/// page below it. Such a child copies no page tables and, more to the point
/// on virtual machines where page faults are costly, makes neither side take
/// copy-on-write faults afterwards.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

impl Stack {
    fn new(len: usize) -> io::Result<Stack> {
        // SAFETY: an anonymous private mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the first page of our own mapping becomes the guard page.
        if unsafe { libc::mprotect(base, 4096, libc::PROT_NONE) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: unmapping the mapping made above.
            unsafe { libc::munmap(base, len) };
            return Err(e);
        }
        Ok(Stack { base, len })
    }

    fn top(&self) -> *mut libc::c_void {
        // Stacks grow down; keep the top 16-byte aligned.
        (self.base as usize + self.len - 64) as *mut libc::c_void
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; callers drop a Stack only when
        // no child runs on it any more.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// What the sandbox child gets: the plan and where to report a failure.
struct ChildArgs<'a> {
    plan: &'a Plan,
    report: RawFd,
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: arg points at the ChildArgs on the parent's stack, which lives
    // until clone returns, and with CLONE_VFORK clone returns only once this
    // child has exec'd or exited.
    let args = unsafe { &*(arg as *const ChildArgs) };
    // SAFETY: we are the freshly cloned child; run_plan only makes system
    // calls on the plan's memory and its own stack.
    unsafe { run_plan(args.plan, args.report) }
}

/// Clones a child into the sandbox namespaces and runs `plan` in it. The
/// child shares our memory and we are suspended until it execs the agent or
/// exits (`CLONE_VM | CLONE_VFORK`, as posix_spawn does), so it must not
/// write anything but its own stack: `run_plan` only makes system calls.
pub fn spawn(plan: &Plan) -> io::Result<Child> {
    let (rd, wr) = crate::sys::pipe()?;
    let stack = Stack::new(64 * 1024)?;
    let args = ChildArgs { plan, report: wr.as_raw_fd() };
    let flags = libc::CLONE_VM | libc::CLONE_VFORK | NAMESPACES | libc::SIGCHLD;
    // SAFETY: child_main runs on `stack`, which outlives the child's use of
    // it (CLONE_VFORK), with a pointer to `args`, which does too.
    let pid = unsafe { libc::clone(child_main, stack.top(), flags, &args as *const ChildArgs as *mut libc::c_void) };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
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
                Err(StepError {
                    index,
                    step: plan.steps.get(index).map(|s| s.to_string()).unwrap_or_else(|| "unknown".into()),
                    source: io::Error::from_raw_os_error(errno),
                })
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
    for (index, step) in plan.steps.iter().enumerate() {
        // SAFETY: every pointer a step passes comes from data the plan owns.
        if let Err(errno) = unsafe { run_step(step) } {
            let mut msg = [0u8; 8];
            msg[..4].copy_from_slice(&(index as u32).to_ne_bytes());
            msg[4..].copy_from_slice(&errno.to_ne_bytes());
            // SAFETY: write and _exit are async-signal-safe; msg is on our stack.
            unsafe {
                libc::write(report, msg.as_ptr().cast(), msg.len());
                libc::_exit(125);
            }
        }
    }
    // SAFETY: a plan always ends with Exec; reaching here is a bug, and
    // _exit is the only safe way out of a cloned child.
    unsafe { libc::_exit(124) }
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn check(ret: libc::c_long) -> Result<(), i32> {
    if ret < 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

fn ptr_or_null(c: &Option<CString>) -> *const libc::c_char {
    c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
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

/// # Safety
/// Async-signal-safe: raw system calls on the step's own data only.
unsafe fn run_step(step: &Step) -> Result<(), i32> {
    // SAFETY: (whole function) each call gets pointers to NUL-terminated
    // strings or structs owned by `step`, valid for the call's duration.
    unsafe {
        match step {
            Step::IfExists(inner) => match run_step(inner) {
                Err(libc::ENOENT) => Ok(()),
                other => other,
            },
            Step::JoinCgroup { fd, .. } => {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(errno());
                }
                Ok(())
            }
            Step::DieWithParent { parent } => {
                check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) as libc::c_long)?;
                // A pidfd polls readable once its process has exited.
                let mut pfd = libc::pollfd { fd: *parent, events: libc::POLLIN, revents: 0 };
                check(libc::poll(&mut pfd, 1, 0) as libc::c_long)?;
                if pfd.revents != 0 {
                    return Err(libc::ESRCH);
                }
                Ok(())
            }
            Step::Unshare { flags } => check(libc::unshare(*flags) as libc::c_long),
            Step::Mount { source, target, fstype, flags, data } => check(libc::mount(
                ptr_or_null(source),
                target.as_ptr(),
                ptr_or_null(fstype),
                *flags,
                data.as_ref().map_or(std::ptr::null(), |d| d.as_ptr().cast()),
            ) as libc::c_long),
            Step::Mkdir { path, mode } => check(libc::mkdir(path.as_ptr(), *mode) as libc::c_long),
            Step::Mknod { path, mode, dev } => check(libc::mknod(path.as_ptr(), *mode, *dev) as libc::c_long),
            Step::Symlink { target, path } => check(libc::symlink(target.as_ptr(), path.as_ptr()) as libc::c_long),
            Step::Chown { path, uid, gid } => check(libc::lchown(path.as_ptr(), *uid, *gid) as libc::c_long),
            Step::Chmod { path, mode } => check(libc::chmod(path.as_ptr(), *mode) as libc::c_long),
            Step::WriteFile { path, data } => {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(errno());
                }
                let bytes = data.as_bytes();
                let n = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
                let e = errno();
                libc::close(fd);
                if n != bytes.len() as isize {
                    return Err(e);
                }
                Ok(())
            }
            Step::IdmapBind { source, target, attrs, userns } => {
                let tree = libc::syscall(
                    libc::SYS_open_tree,
                    libc::AT_FDCWD,
                    source.as_ptr(),
                    OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
                );
                if tree < 0 {
                    return Err(errno());
                }
                let tree = tree as libc::c_int;
                let attr = MountAttr {
                    attr_set: MOUNT_ATTR_IDMAP | attrs,
                    attr_clr: 0,
                    propagation: 0,
                    userns_fd: *userns as u64,
                };
                let ret = libc::syscall(
                    libc::SYS_mount_setattr,
                    tree,
                    c"".as_ptr(),
                    libc::AT_EMPTY_PATH,
                    &attr as *const MountAttr,
                    std::mem::size_of::<MountAttr>(),
                );
                if ret < 0 {
                    let e = errno();
                    libc::close(tree);
                    return Err(e);
                }
                let ret = libc::syscall(
                    libc::SYS_move_mount,
                    tree,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                );
                let e = errno();
                libc::close(tree);
                if ret < 0 {
                    return Err(e);
                }
                Ok(())
            }
            Step::LoopbackUp => {
                let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
                if sock < 0 {
                    return Err(errno());
                }
                let mut req: libc::ifreq = std::mem::zeroed();
                req.ifr_name[0] = b'l' as libc::c_char;
                req.ifr_name[1] = b'o' as libc::c_char;
                req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
                let ret = libc::ioctl(sock, libc::SIOCSIFFLAGS, &req as *const libc::ifreq);
                let e = errno();
                libc::close(sock);
                if ret < 0 {
                    return Err(e);
                }
                Ok(())
            }
            Step::SetHostname { name } => {
                check(libc::sethostname(name.as_ptr(), name.as_bytes().len()) as libc::c_long)
            }
            Step::PivotRoot { new_root } => {
                check(libc::chdir(new_root.as_ptr()) as libc::c_long)?;
                check(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()))?;
                // The old root now sits on top of the new one at "/"; detach it.
                check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH) as libc::c_long)?;
                check(libc::chdir(c"/".as_ptr()) as libc::c_long)
            }
            Step::SetNs { fd, nstype } => check(libc::setns(*fd, *nstype) as libc::c_long),
            Step::Seccomp { filter } => {
                let prog =
                    libc::sock_fprog { len: (filter.len() / 8) as u16, filter: filter.as_ptr().cast_mut().cast() };
                check(libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER as libc::c_ulong, &prog)
                    as libc::c_long)
            }
            Step::Notify { fd } => {
                let msg = READY;
                if libc::write(*fd, msg.as_ptr().cast(), msg.len()) != msg.len() as isize {
                    return Err(errno());
                }
                Ok(())
            }
            Step::Pause => loop {
                libc::pause();
            },
            Step::CloseFds { keep } => {
                if *keep > 3 {
                    check(libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, (*keep - 1) as libc::c_uint, 0))?;
                }
                check(libc::syscall(libc::SYS_close_range, (*keep + 1) as libc::c_uint, libc::c_uint::MAX, 0))
            }
            Step::DieWithParentPid { parent } => {
                check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) as libc::c_long)?;
                if libc::getppid() != *parent {
                    return Err(libc::ESRCH);
                }
                Ok(())
            }
            Step::EnterUserns { fd } => {
                check(libc::setns(*fd, libc::CLONE_NEWUSER) as libc::c_long)?;
                check(libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()))?;
                check(libc::syscall(libc::SYS_setresgid, 0, 0, 0))?;
                check(libc::syscall(libc::SYS_setresuid, 0, 0, 0))
            }
            Step::Exec { exe_fd, argv: _, argv_ptrs, fds, devnull, nofile } => {
                // Move every source above the targets first, so that no dup2
                // overwrites a source still to be moved.
                let mut moved = [0 as RawFd; 8];
                if fds.len() > moved.len() {
                    return Err(libc::E2BIG);
                }
                for (i, (src, _)) in fds.iter().enumerate() {
                    let fd = libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, 64);
                    if fd < 0 {
                        return Err(errno());
                    }
                    moved[i] = fd;
                }
                let exe = libc::fcntl(*exe_fd, libc::F_DUPFD_CLOEXEC, 64);
                if exe < 0 {
                    return Err(errno());
                }
                for (i, (_, dst)) in fds.iter().enumerate() {
                    // dup2 clears close-on-exec on the target.
                    if libc::dup2(moved[i], *dst) < 0 {
                        return Err(errno());
                    }
                }
                let null = libc::open(devnull.as_ptr(), libc::O_RDWR);
                if null < 0 {
                    return Err(errno());
                }
                for std_fd in 0..3 {
                    if libc::dup2(null, std_fd) < 0 {
                        return Err(errno());
                    }
                }
                let first_free = fds.iter().map(|(_, d)| *d).max().unwrap_or(2).max(2) + 1;
                // Close all but the targets and the exe; the exe fd is
                // close-on-exec so execveat drops it.
                check(libc::syscall(libc::SYS_close_range, first_free as libc::c_uint, (exe - 1) as libc::c_uint, 0))?;
                check(libc::syscall(libc::SYS_close_range, (exe + 1) as libc::c_uint, libc::c_uint::MAX, 0))?;
                if let Some((soft, hard)) = nofile {
                    let lim = libc::rlimit { rlim_cur: *soft, rlim_max: *hard };
                    check(libc::setrlimit(libc::RLIMIT_NOFILE, &lim) as libc::c_long)?;
                }
                let envp: [*const libc::c_char; 1] = [std::ptr::null()];
                libc::syscall(
                    libc::SYS_execveat,
                    exe,
                    c"".as_ptr(),
                    argv_ptrs.as_ptr(),
                    envp.as_ptr(),
                    libc::AT_EMPTY_PATH,
                );
                Err(errno())
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

/// Makes a sandbox's user namespace (ids `0..count` inside mapped to
/// `base..base+count` on the host) and, optionally, its network namespace
/// (owned by the host, with `lo` up and the per-namespace sysctls set), in a
/// helper that shares our memory and runs on the other CPU while the caller
/// does other work. Descriptors keep the namespaces alive after the helper
/// is gone.
pub struct NsHelper {
    pid: libc::pid_t,
    report: OwnedFd,
    base: u32,
    count: u32,
    with_net: bool,
    // Referenced by the running helper: dropped only after it is reaped.
    plan: Box<Plan>,
    args: Box<ChildArgs<'static>>,
    stack: Stack,
    done: bool,
}

/// Namespaces made by an [`NsHelper`].
#[derive(Debug)]
pub struct Namespaces {
    pub user: OwnedFd,
    pub net: Option<OwnedFd>,
}

impl NsHelper {
    pub fn start(base: u32, count: u32, with_net: bool) -> io::Result<NsHelper> {
        let (rd, wr) = crate::sys::pipe()?;
        let mut plan = Plan::default();
        // The helper must neither outlive us (if the daemon is killed
        // mid-create) nor hold our descriptors (the listening socket, the
        // database, uid slot locks) while it lives.
        plan.push(Step::CloseFds { keep: wr.as_raw_fd() });
        // SAFETY: getpid has no preconditions.
        plan.push(Step::DieWithParentPid { parent: unsafe { libc::getpid() } });
        if with_net {
            plan.push(Step::Unshare { flags: libc::CLONE_NEWNET });
            plan.push(Step::LoopbackUp);
            // Per network namespace: any user of the sandbox may bind low
            // ports and ping, as the namespace is the sandbox's alone.
            plan.push(Step::WriteFile {
                path: cstr("/proc/sys/net/ipv4/ip_unprivileged_port_start")?,
                data: cstr("0")?,
            });
            plan.push(Step::WriteFile {
                path: cstr("/proc/sys/net/ipv4/ping_group_range")?,
                data: cstr(format!("{base} {}", base + count - 1))?,
            });
        }
        plan.push(Step::Unshare { flags: libc::CLONE_NEWUSER });
        plan.push(Step::Notify { fd: wr.as_raw_fd() });
        plan.push(Step::Pause);
        let plan = Box::new(plan);
        // SAFETY: the reference is only used by the helper, which is killed
        // and reaped before `plan` is dropped (see Drop and finish).
        let plan_ref: &'static Plan = unsafe { &*(plan.as_ref() as *const Plan) };
        let args = Box::new(ChildArgs { plan: plan_ref, report: wr.as_raw_fd() });
        let stack = Stack::new(16 * 1024)?;
        // SAFETY: the helper runs `run_plan` (system calls only) on its own
        // stack; `args`, `plan` and `stack` outlive it (kept in the result).
        let pid = unsafe {
            libc::clone(
                child_main,
                stack.top(),
                libc::CLONE_VM | libc::SIGCHLD,
                args.as_ref() as *const ChildArgs as *mut libc::c_void,
            )
        };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        drop(wr);
        Ok(NsHelper { pid, report: rd, base, count, with_net, plan, args, stack, done: false })
    }

    /// Waits for the helper to reach its user namespace, maps the ids, and
    /// takes descriptors of the namespaces.
    pub fn finish(mut self) -> io::Result<Namespaces> {
        let result = self.collect();
        self.end();
        result
    }

    fn collect(&mut self) -> io::Result<Namespaces> {
        let mut buf = [0u8; 8];
        let n = crate::sys::read_full(self.report.as_raw_fd(), &mut buf)?;
        if n != 8 || buf != READY {
            let index = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
            let step = self.plan.steps.get(index).map(|s| s.to_string()).unwrap_or_else(|| "start".into());
            let source = if n == 8 { io::Error::from_raw_os_error(errno) } else { io::ErrorKind::UnexpectedEof.into() };
            return Err(io::Error::new(source.kind(), format!("namespace helper: {step}: {source}")));
        }
        let pid = self.pid;
        let map = format!("0 {} {}\n", self.base, self.count);
        std::fs::write(format!("/proc/{pid}/uid_map"), &map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map)?;
        let user = open_ns(pid, "user")?;
        let net = if self.with_net { Some(open_ns(pid, "net")?) } else { None };
        Ok(Namespaces { user, net })
    }

    fn end(&mut self) {
        if !self.done {
            crate::sys::kill(self.pid, libc::SIGKILL);
            crate::sys::reap(self.pid);
            self.done = true;
        }
    }
}

impl Drop for NsHelper {
    fn drop(&mut self) {
        // Before plan, args and stack go: the helper must be gone first.
        self.end();
        let _ = (&self.args, &self.stack);
    }
}

fn open_ns(pid: libc::pid_t, kind: &str) -> io::Result<OwnedFd> {
    crate::sys::open(format!("/proc/{pid}/ns/{kind}"), libc::O_RDONLY)
}
