//! Checked wrappers over the Linux system calls the agent makes: the agent's
//! one module of `unsafe`, so that everything else is ordinary safe Rust.
//!
//! Every wrapper returns `Result<_, Errno>`; nothing here panics or retries
//! except on `EINTR` where noted. The wrappers that run between `fork` and
//! `execve` (see `child.rs`) allocate nothing.

use std::ffi::{c_char, CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// An `errno` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The calling thread's current `errno`.
    pub fn last() -> Errno {
        // SAFETY: __errno_location always returns a valid pointer to this
        // thread's errno.
        Errno(unsafe { *libc::__errno_location() })
    }

    /// Writes the message for this errno into `buf`, returning its length.
    /// Allocates nothing, so it may run between fork and exec.
    pub fn describe(self, buf: &mut [u8; 128]) -> usize {
        // SAFETY: the buffer is valid for writes of its length; the XSI
        // strerror_r (which libc binds on glibc) NUL-terminates within it.
        let r = unsafe { libc::strerror_r(self.0, buf.as_mut_ptr().cast(), buf.len()) };
        if r != 0 {
            buf[..13].copy_from_slice(b"unknown error");
            return 13;
        }
        buf.iter().position(|&b| b == 0).unwrap_or(buf.len())
    }
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut buf = [0u8; 128];
        let n = self.describe(&mut buf);
        f.write_str(&String::from_utf8_lossy(&buf[..n]))
    }
}

pub type SysResult<T> = Result<T, Errno>;

fn cvt(r: libc::c_int) -> SysResult<libc::c_int> {
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

fn cvt_size(r: isize) -> SysResult<usize> {
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r as usize)
    }
}

fn cvt_long(r: libc::c_long) -> SysResult<libc::c_long> {
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

fn owned(fd: libc::c_int) -> SysResult<OwnedFd> {
    let fd = cvt(fd)?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else
    // owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Owned C strings together with the NULL-terminated pointer array `execve`
/// wants. Moving the struct does not move the strings' heap buffers, so the
/// pointers stay valid for as long as the struct lives.
pub struct CStrArray {
    _owned: Vec<CString>,
    ptrs: Vec<*const c_char>,
}

impl CStrArray {
    pub fn new(items: Vec<CString>) -> CStrArray {
        let mut ptrs: Vec<*const c_char> = items.iter().map(|s| s.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        CStrArray { _owned: items, ptrs }
    }
}

// ---------------------------------------------------------------------------
// Descriptors, pipes, plain IO

pub fn set_cloexec(fd: RawFd) -> SysResult<()> {
    // SAFETY: F_GETFD/F_SETFD take no pointers; a bad fd yields EBADF.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) })?;
    Ok(())
}

/// Makes a descriptor that has no other status flags (a fresh pipe end)
/// non-blocking, in one call.
pub fn set_nonblocking_fresh(fd: BorrowedFd<'_>) -> SysResult<()> {
    // SAFETY: F_SETFL takes an integer argument.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) }).map(|_| ())
}

pub fn set_nonblocking(fd: BorrowedFd<'_>) -> SysResult<()> {
    // SAFETY: F_GETFL/F_SETFL take no pointers.
    let flags = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> SysResult<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid array of two ints for the kernel to fill.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both descriptors are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub fn read(fd: BorrowedFd<'_>, buf: &mut [u8]) -> SysResult<usize> {
    // SAFETY: buf is valid for writes of buf.len() bytes.
    cvt_size(unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) })
}

/// Reads up to `max` bytes, appending them to `buf` without zero-filling.
pub fn read_append(fd: BorrowedFd<'_>, buf: &mut Vec<u8>, max: usize) -> SysResult<usize> {
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    // SAFETY: the spare capacity is valid for writes of `max` bytes (reserved
    // above); the kernel initialises the bytes it reports as read.
    let n = cvt_size(unsafe { libc::read(fd.as_raw_fd(), spare.as_mut_ptr().cast(), max) })?;
    // SAFETY: the first n bytes of the spare capacity were just written.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

pub fn write(fd: RawFd, buf: &[u8]) -> SysResult<usize> {
    // SAFETY: buf is valid for reads of buf.len() bytes.
    cvt_size(unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) })
}

/// Writes all of `buf`, retrying on EINTR and short writes (blocking fds).
pub fn write_all(fd: RawFd, mut buf: &[u8]) -> SysResult<()> {
    while !buf.is_empty() {
        match write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno(libc::EINTR)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub fn pread(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> SysResult<usize> {
    // SAFETY: buf is valid for writes of buf.len() bytes.
    cvt_size(unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), offset as libc::off_t) })
}

pub fn pwrite(fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> SysResult<usize> {
    // SAFETY: buf is valid for reads of buf.len() bytes.
    cvt_size(unsafe { libc::pwrite(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), offset as libc::off_t) })
}

/// Sends on a socket without blocking and without raising SIGPIPE.
pub fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> SysResult<usize> {
    // SAFETY: buf is valid for reads of buf.len() bytes.
    cvt_size(unsafe {
        libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
    })
}

/// [`send`] with one descriptor attached (SCM_RIGHTS) to the first byte:
/// the peer receives it with the read that takes that byte.
pub fn send_with_fd(fd: BorrowedFd<'_>, buf: &[u8], pass: BorrowedFd<'_>) -> SysResult<usize> {
    const SPACE: usize = 64;
    #[repr(C, align(8))]
    struct Control([u8; SPACE]);
    let mut control = Control([0; SPACE]);
    let mut iov = libc::iovec { iov_base: buf.as_ptr() as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    // SAFETY: msg_control points at SPACE bytes, more than CMSG_SPACE of one
    // descriptor, so the first header and its data are in bounds.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), pass.as_raw_fd());
    }
    // SAFETY: msg and what it points at are valid for the call.
    cvt_size(unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) })
}

/// Accepts one connection as a non-blocking, close-on-exec socket.
pub fn accept(fd: BorrowedFd<'_>) -> SysResult<OwnedFd> {
    // SAFETY: null address pointers are allowed when the peer address is not wanted.
    owned(unsafe {
        libc::accept4(
            fd.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
        )
    })
}

/// Waits up to `timeout_ms` for `fd` to become readable.
pub fn poll_in(fd: BorrowedFd<'_>, timeout_ms: i32) -> SysResult<bool> {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: p is one valid pollfd.
    let n = cvt(unsafe { libc::poll(&mut p, 1, timeout_ms) })?;
    Ok(n > 0)
}

/// Closes every descriptor from 3 up except those in `keep` (sorted or not).
pub fn close_all_except(keep: &mut [RawFd]) {
    keep.sort_unstable();
    let mut next: u32 = 3;
    for &k in keep.iter() {
        if k < 0 || (k as u32) < next {
            continue;
        }
        if k as u32 > next {
            close_range(next, k as u32 - 1);
        }
        next = k as u32 + 1;
    }
    close_range(next, LAST_FD);
}

/// The highest descriptor number there can be: a descriptor is an `int`.
/// Linux takes any `last` up to `~0U` and stops at the table's end; gVisor
/// refuses one above `INT_MAX` with EINVAL (its sys_file.go, runsc
/// 2022-12), which sent every command's supervisor through the loop below
/// twice: some 8,000 `close` calls, each one trapped by the ptrace
/// platform, 150 to 400 ms of every exec in the gvisor class.
const LAST_FD: u32 = i32::MAX as u32;

/// Marks every descriptor from `first` up close-on-exec
/// (`CLOSE_RANGE_CLOEXEC`, Linux 5.11); allocates nothing. For a child of
/// the agent's, whose descriptors the agent opened without caring who
/// inherits them: they close at its `execve`, after it used those it needs.
pub fn cloexec_from(first: u32) -> SysResult<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_ulong = 1 << 2;
    // SAFETY: close_range takes no pointers and, with this flag, closes
    // nothing; it only sets a flag on the caller's descriptors.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            libc::c_ulong::from(first),
            libc::c_ulong::from(LAST_FD),
            CLOSE_RANGE_CLOEXEC,
        )
    };
    cvt(r as libc::c_int).map(|_| ())
}

fn close_range(first: u32, last: u32) {
    // Widened, so that no stale upper half of a register reaches the kernel.
    let (first, last) = (libc::c_ulong::from(first), libc::c_ulong::from(last.min(LAST_FD)));
    // SAFETY: close_range takes no pointers; it only closes descriptors,
    // which the caller (a freshly forked supervisor) no longer needs.
    let r = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_ulong) };
    if r < 0 {
        // Kernels before 5.9.
        close_each(first as u32, last as u32);
    }
}

/// Closes `first..=last` one by one, up to the highest descriptor number
/// this process can hold: below its open-files limit (a descriptor at or
/// above it can only be one opened before a lower limit was set, which the
/// agent never does). Bounded by 2^20, the kernel's default `nr_open`.
fn close_each(first: u32, last: u32) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: lim is valid for the kernel to fill.
    let below = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.clamp(4096, 1 << 20) as u32
    } else {
        1 << 20
    };
    for fd in first..=last.min(below - 1) {
        // SAFETY: closing a descriptor number we do not use; EBADF is fine.
        unsafe { libc::close(fd as RawFd) };
    }
}

// ---------------------------------------------------------------------------
// epoll, signals

pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub fn new() -> SysResult<Epoll> {
        // SAFETY: epoll_create1 takes no pointers.
        Ok(Epoll { fd: owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })? })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> SysResult<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: ev is a valid epoll_event for the duration of the call.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) })?;
        Ok(())
    }

    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> SysResult<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    /// Moves `fd`'s registration from `*cur` to `want` events; a descriptor
    /// that wants nothing is removed, because epoll reports EPOLLHUP even
    /// for an empty event mask and a level-triggered HUP would spin.
    pub fn update(&self, fd: RawFd, token: u64, cur: &mut u32, want: u32) {
        if *cur == want {
            return;
        }
        let r = if want == 0 {
            self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
        } else if *cur == 0 {
            self.ctl(libc::EPOLL_CTL_ADD, fd, want, token)
        } else {
            self.ctl(libc::EPOLL_CTL_MOD, fd, want, token)
        };
        if r.is_ok() || want == 0 {
            *cur = want;
        }
    }

    pub fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: i32) -> SysResult<usize> {
        // SAFETY: events is valid for writes of events.len() entries.
        cvt(unsafe {
            libc::epoll_wait(self.fd.as_raw_fd(), events.as_mut_ptr(), events.len() as libc::c_int, timeout_ms)
        })
        .map(|n| n as usize)
    }
}

fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in signals {
        // SAFETY: set is a valid sigset_t; invalid numbers yield EINVAL.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    set
}

/// Sets the signal mask to exactly `signals`.
pub fn set_sigmask(signals: &[libc::c_int]) -> SysResult<()> {
    let set = sigset(signals);
    // SAFETY: set is a valid sigset_t; the old mask is not wanted.
    let r = unsafe { libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) };
    cvt(r).map(|_| ())
}

/// A non-blocking signalfd for `signals` (which the caller has blocked).
pub fn signalfd(signals: &[libc::c_int]) -> SysResult<OwnedFd> {
    let set = sigset(signals);
    // SAFETY: set is a valid sigset_t.
    owned(unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) })
}

/// Reads and discards everything queued on a signalfd.
pub fn drain_signalfd(fd: BorrowedFd<'_>) {
    let mut buf = [0u8; 128 * 8];
    while let Ok(n) = read(fd, &mut buf) {
        if n == 0 {
            break;
        }
    }
}

/// Waits for one of `signals` (blocked by the caller) and returns it.
pub fn sigwait(signals: &[libc::c_int]) -> SysResult<libc::c_int> {
    let set = sigset(signals);
    // SAFETY: set is valid; a null siginfo pointer is allowed.
    cvt(unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) })
}

/// [`sigwait`] for at most `timeout_ms`; `None` when it passed first.
pub fn sigwait_for(signals: &[libc::c_int], timeout_ms: u32) -> SysResult<Option<libc::c_int>> {
    let set = sigset(signals);
    let timeout = libc::timespec {
        tv_sec: (timeout_ms / 1000) as libc::time_t,
        tv_nsec: (timeout_ms % 1000) as libc::c_long * 1_000_000,
    };
    // SAFETY: set and timeout are valid; a null siginfo pointer is allowed.
    match cvt(unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) }) {
        Ok(sig) => Ok(Some(sig)),
        Err(Errno(libc::EAGAIN)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Waits for one of `signals` (blocked by the caller); returns it and the
/// integer a [`sigqueue`] sender attached (0 for a plain `kill`).
pub fn sigwait_value(signals: &[libc::c_int]) -> SysResult<(libc::c_int, i32)> {
    let set = sigset(signals);
    // SAFETY: siginfo_t is plain data the kernel fills.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: set and info are valid for the call.
    let sig = cvt(unsafe { libc::sigwaitinfo(&set, &mut info) })?;
    let value = if info.si_code == libc::SI_QUEUE {
        // SAFETY: a queued signal carries a sigval; `sigqueue` below puts
        // the integer in the pointer's value, read back the same way.
        unsafe { info.si_value().sival_ptr as usize as i32 }
    } else {
        0
    };
    Ok((sig, value))
}

/// Queues `sig` with the integer `value` to `pid` (`sigqueue(3)`).
pub fn sigqueue(pid: libc::pid_t, sig: libc::c_int, value: i32) -> SysResult<()> {
    let v = libc::sigval { sival_ptr: value as u32 as usize as *mut libc::c_void };
    // SAFETY: sigqueue takes its sigval by value; the pointer is never followed.
    cvt(unsafe { libc::sigqueue(pid, sig, v) }).map(|_| ())
}

pub fn ignore_signal(sig: libc::c_int) {
    // SAFETY: SIG_IGN is a valid disposition; no handler code is involved.
    unsafe { libc::signal(sig, libc::SIG_IGN) };
}

pub fn default_signal(sig: libc::c_int) {
    // SAFETY: SIG_DFL is a valid disposition; no handler code is involved.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// Resets every signal's disposition to the default.
pub fn reset_signal_dispositions() {
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: SIG_DFL is a valid disposition; invalid or reserved
        // numbers yield EINVAL, which is ignored.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
}

// ---------------------------------------------------------------------------
// Processes

/// `fork(2)`.
///
/// # Safety
/// The caller must be single threaded (the agent and its supervisors are),
/// so that the child may keep using the allocator and any lock.
pub unsafe fn fork() -> SysResult<libc::pid_t> {
    // SAFETY: guaranteed by the caller, see above.
    cvt(unsafe { libc::fork() })
}

/// Starts `f(arg)` in a child that shares our memory until it execs, while
/// we wait (`CLONE_VM | CLONE_VFORK`, what posix_spawn does): no page tables
/// are copied and neither side takes copy-on-write faults, which are costly
/// on virtual machines. Returns the child's pid once it has exec'd or exited.
///
/// The child starts on the caller's CPU, which the caller leaves for it
/// (it waits): the caller holds only that CPU while it clones, and the
/// child gives both of them their CPUs back first thing ([`PinnedHere`]).
///
/// # Safety
/// `f` must only make system calls, write nothing but its own stack, and
/// end in `execve` or `_exit`; `arg` must stay valid until this returns.
pub unsafe fn spawn_vm(
    f: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *mut libc::c_void,
) -> SysResult<libc::pid_t> {
    extern "C" fn start(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: arg is spawn_vm's `first`, alive until clone_vm returns.
        let first = unsafe { &*(arg as *const First) };
        if let Some(pin) = &first.pin {
            pin.release(first.caller);
            pin.release(0);
        }
        (first.f)(first.arg)
    }
    let errno = |e: std::io::Error| Errno(e.raw_os_error().unwrap_or(libc::EIO));
    let stack = match SPARE_STACK.take() {
        Some(stack) => stack,
        None => hutch_agent::vm::VmStack::new(64 * 1024).map_err(errno)?,
    };
    // SAFETY: gettid has no memory effects.
    let caller = unsafe { libc::gettid() };
    let first = First { f, arg, caller, pin: PinnedHere::take() };
    // SAFETY: guaranteed by the caller; `start` only makes system calls
    // before it calls `f`; the stack and `first` outlive the child's use of
    // them because CLONE_VFORK suspends us until the child execs or exits.
    let child = unsafe {
        hutch_agent::vm::clone_vm(
            start,
            &stack,
            libc::CLONE_VFORK | libc::SIGCHLD,
            &first as *const First as *mut libc::c_void,
        )
    };
    // The child gave our CPUs back, unless the clone failed.
    if let Some(pin) = &first.pin {
        pin.release(0);
    }
    // The child has exec'd or exited: the stack is free for the next one.
    SPARE_STACK.set(Some(stack));
    child.map_err(errno)
}

thread_local! {
    /// The stack of this thread's last [`spawn_vm`] child, for its next:
    /// a mapping, a guard page and an unmapping less per command.
    static SPARE_STACK: std::cell::Cell<Option<hutch_agent::vm::VmStack>> = const { std::cell::Cell::new(None) };
}

/// Asks the scheduler for short turns: EEVDF's slice (`sched_attr`'s
/// `sched_runtime`, Linux 6.12 and later), which sets how soon a waking
/// task is due, not its share of the CPU. A task with a shorter slice than
/// the one running may preempt it on waking instead of waiting for the
/// tick. Children start with the default slice (`SCHED_FLAG_RESET_ON_FORK`),
/// so commands run as any process does.
pub fn request_short_slice() -> SysResult<()> {
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }
    const SCHED_FLAG_RESET_ON_FORK: u64 = 1;
    // The kernel's shortest slice.
    const SLICE_NS: u64 = 100_000;
    // SAFETY: errno is this thread's; getpriority may return -1 as a value.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: no pointers.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    if nice == -1 && Errno::last().0 != 0 {
        return Err(Errno::last());
    }
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: SCHED_FLAG_RESET_ON_FORK,
        nice,
        priority: 0,
        runtime: SLICE_NS,
        deadline: 0,
        period: 0,
    };
    // SAFETY: attr is a valid sched_attr of the size it states.
    cvt_long(unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) }).map(|_| ())
}

/// The calling thread's CPU mask.
fn cpu_mask() -> SysResult<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: mask is valid for its size.
    cvt(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut mask) })?;
    Ok(mask)
}

/// What a [`spawn_vm`] child runs first.
struct First {
    f: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *mut libc::c_void,
    /// The thread that cloned it.
    caller: libc::pid_t,
    pin: Option<PinnedHere>,
}

/// A thread held to the CPU it runs on, and the CPU mask it had before.
///
/// A new process goes to the CPU the kernel's fork balancing finds least
/// loaded. When every CPU is busy, that is often one where a task of
/// another sandbox is running, and the child then waits for the scheduler
/// tick (up to 4 ms at 250 Hz) before it first runs, while the CPU its
/// parent leaves for it, to wait, runs someone else. Held to the parent's
/// CPU, the child runs as soon as its parent waits. The child releases the
/// pin before anything of the command runs, so a command gets the CPU mask
/// the agent had (ARCHITECTURE.md, "Command slots").
struct PinnedHere {
    mask: libc::cpu_set_t,
}

impl PinnedHere {
    /// Holds the calling thread to its CPU; `None` (nothing changed) when
    /// that cannot be done.
    fn take() -> Option<PinnedHere> {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let mask = cpu_mask().ok()?;
        // SAFETY: sched_getcpu has no memory effects.
        let cpu = unsafe { libc::sched_getcpu() };
        if cpu < 0 || cpu as usize >= libc::CPU_SETSIZE as usize {
            return None;
        }
        // SAFETY: as above.
        let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: CPU_SET checks no bound; cpu is below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu as usize, &mut one) };
        // SAFETY: one is valid for `size` bytes.
        if unsafe { libc::sched_setaffinity(0, size, &one) } != 0 {
            return None;
        }
        Some(PinnedHere { mask })
    }

    /// Gives thread `tid` (0: the calling one) the mask from before the
    /// pin. A system call only: safe in a [`spawn_vm`] child. Best effort:
    /// a thread that keeps the pin only runs on one CPU.
    fn release(&self, tid: libc::pid_t) {
        // SAFETY: mask is valid for its size; the call writes nothing of ours.
        unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &self.mask) };
    }
}

/// `waitpid`; `Ok(None)` when WNOHANG found nothing to reap.
pub fn waitpid(pid: libc::pid_t, flags: libc::c_int) -> SysResult<Option<(libc::pid_t, i32)>> {
    let mut status = 0;
    // SAFETY: status is a valid int for the kernel to fill.
    let r = cvt(unsafe { libc::waitpid(pid, &mut status, flags) })?;
    Ok(if r == 0 { None } else { Some((r, status)) })
}

/// Looks for an exited child without reaping it (`waitid` with `WNOWAIT`):
/// any child for `pid == None`, else that one. Returns its pid and its wait
/// status in `waitpid`'s encoding; `Ok(None)` when none has exited.
pub fn peek_exited(pid: Option<libc::pid_t>) -> SysResult<Option<(libc::pid_t, i32)>> {
    // SAFETY: siginfo_t is plain data the kernel fills.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let (idtype, id) = match pid {
        Some(p) => (libc::P_PID, p as libc::id_t),
        None => (libc::P_ALL, 0),
    };
    // SAFETY: info is valid for writes.
    cvt(unsafe { libc::waitid(idtype, id, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) })?;
    // SAFETY: after waitid the child fields are set, or si_pid is 0.
    let (child, status) = unsafe { (info.si_pid(), info.si_status()) };
    if child == 0 {
        return Ok(None);
    }
    let ws = match info.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => status & 0x7f,
    };
    Ok(Some((child, ws)))
}

pub fn kill(pid: libc::pid_t, sig: libc::c_int) -> SysResult<()> {
    // SAFETY: kill takes no pointers.
    cvt(unsafe { libc::kill(pid, sig) }).map(|_| ())
}

pub fn getpid() -> libc::pid_t {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}

/// `_exit(2)`: ends the process without running destructors or atexit hooks
/// (what a forked child must do).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no Rust state.
    unsafe { libc::_exit(code) }
}

/// `execvp(3)`: `execve` with the process's own environment, looking a
/// bare name up on its PATH.
pub fn execvp(file: &CStr, argv: &CStrArray) -> Errno {
    // SAFETY: as for execve; the C runtime keeps `environ` valid.
    unsafe { libc::execvp(file.as_ptr(), argv.ptrs.as_ptr()) };
    Errno::last()
}

pub fn execve(path: &CStr, argv: &CStrArray, envp: &CStrArray) -> Errno {
    // SAFETY: path is NUL-terminated; argv and envp are NULL-terminated
    // arrays of pointers to NUL-terminated strings that CStrArray keeps alive.
    unsafe { libc::execve(path.as_ptr(), argv.ptrs.as_ptr(), envp.ptrs.as_ptr()) };
    Errno::last()
}

fn prctl(option: libc::c_int, a: libc::c_ulong, b: libc::c_ulong) -> SysResult<()> {
    // SAFETY: every option used here takes integer arguments only.
    cvt(unsafe { libc::prctl(option, a, b, 0 as libc::c_ulong, 0 as libc::c_ulong) }).map(|_| ())
}

pub fn set_dumpable(on: bool) -> SysResult<()> {
    prctl(libc::PR_SET_DUMPABLE, on as libc::c_ulong, 0)
}

pub fn set_child_subreaper() -> SysResult<()> {
    prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0)
}

/// Sets the host name of the agent's UTS namespace.
pub fn sethostname(name: &[u8]) -> SysResult<()> {
    // SAFETY: name is a valid buffer of name.len() bytes for the call.
    cvt(unsafe { libc::sethostname(name.as_ptr() as *const libc::c_char, name.len()) }).map(|_| ())
}

pub fn set_no_new_privs() -> SysResult<()> {
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0)
}

/// Drops capability `cap` from the bounding set; EINVAL means `cap` is past
/// the last capability the kernel knows.
pub fn capbset_drop(cap: u32) -> SysResult<()> {
    prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0)
}

/// Drops every capability in `mask` from the bounding set, stopping at the
/// first number past the kernel's last capability.
pub fn drop_bounding(mask: u64) -> SysResult<()> {
    for cap in 0..64u32 {
        if mask & (1u64 << cap) == 0 {
            continue;
        }
        match capbset_drop(cap) {
            Ok(()) => {}
            Err(Errno(libc::EINVAL)) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Empties the ambient set. EINVAL is a kernel without ambient
/// capabilities (gVisor's), where there is nothing to clear.
pub fn clear_ambient_caps() -> SysResult<()> {
    match prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0) {
        Err(Errno(libc::EINVAL)) => Ok(()),
        r => r,
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_V3: u32 = 0x2008_0522;

/// The calling thread's permitted capability set.
pub fn cap_permitted() -> SysResult<u64> {
    let mut hdr = CapHeader { version: CAP_V3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: hdr and data are the v3 layout capget expects (two data words).
    cvt_long(unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) })?;
    Ok(data[0].permitted as u64 | (data[1].permitted as u64) << 32)
}

/// Sets the effective, permitted and inheritable sets all to `caps`.
pub fn capset_all(caps: u64) -> SysResult<()> {
    let mut hdr = CapHeader { version: CAP_V3, pid: 0 };
    let lo = caps as u32;
    let hi = (caps >> 32) as u32;
    let data = [
        CapData { effective: lo, permitted: lo, inheritable: lo },
        CapData { effective: hi, permitted: hi, inheritable: hi },
    ];
    // SAFETY: hdr and data are the v3 layout capset expects (two data words).
    cvt_long(unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) }).map(|_| ())
}

/// Installs a classic-BPF seccomp filter (no_new_privs must be set).
pub fn install_seccomp(filter: &[libc::sock_filter]) -> SysResult<()> {
    let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: prog points at `filter`, which outlives the call; the kernel
    // copies the program.
    cvt(unsafe { libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER as libc::c_ulong, &prog) }).map(|_| ())
}

pub fn setsid() -> SysResult<()> {
    // SAFETY: setsid takes no arguments.
    cvt(unsafe { libc::setsid() }).map(|_| ())
}

pub fn set_controlling_tty(fd: RawFd) -> SysResult<()> {
    // SAFETY: TIOCSCTTY takes an integer argument.
    cvt(unsafe { libc::ioctl(fd, libc::TIOCSCTTY, 0) }).map(|_| ())
}

/// `dup2`; when `from == to` it clears close-on-exec instead, which dup2
/// would not.
pub fn dup_to(from: RawFd, to: RawFd) -> SysResult<()> {
    if from == to {
        // SAFETY: F_SETFD takes an integer argument.
        return cvt(unsafe { libc::fcntl(from, libc::F_SETFD, 0) }).map(|_| ());
    }
    // SAFETY: dup2 takes no pointers.
    cvt(unsafe { libc::dup2(from, to) }).map(|_| ())
}

pub fn fchdir(fd: RawFd) -> SysResult<()> {
    // SAFETY: fchdir takes no pointers.
    cvt(unsafe { libc::fchdir(fd) }).map(|_| ())
}

pub fn setgroups(groups: &[libc::gid_t]) -> SysResult<()> {
    // SAFETY: groups is valid for reads of groups.len() entries.
    cvt(unsafe { libc::setgroups(groups.len(), groups.as_ptr()) }).map(|_| ())
}

/// Number of supplementary groups of the calling process.
pub fn group_count() -> SysResult<usize> {
    // SAFETY: a zero size with a null list only queries the count.
    cvt(unsafe { libc::getgroups(0, std::ptr::null_mut()) }).map(|n| n as usize)
}

pub fn setresgid(gid: libc::gid_t) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::setresgid(gid, gid, gid) }).map(|_| ())
}

pub fn setresuid(uid: libc::uid_t) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::setresuid(uid, uid, uid) }).map(|_| ())
}

/// Switches the file system uid and gid used for permission checks; the
/// previous values are not reported because the agent always restores 0.
pub fn set_fs_ids(uid: libc::uid_t, gid: libc::gid_t) {
    // SAFETY: no pointers; setfsgid/setfsuid cannot fail in a way that
    // reports an error; setresuid/setresgid take integers only.
    unsafe {
        // Back to root from effective ids taken below: uid first (root's
        // again, which restores the effective capabilities), then gid.
        if uid == 0 && gid == 0 && libc::geteuid() != 0 {
            libc::setresuid(u32::MAX, 0, u32::MAX);
            libc::setresgid(u32::MAX, 0, u32::MAX);
        }
        libc::setfsgid(gid);
        libc::setfsuid(uid);
        // gVisor (2022-12) ignores setfsuid: the file system ids follow
        // the effective ones there, so take those (the saved ids stay
        // root's, to come back).
        if libc::setfsuid(u32::MAX) as libc::uid_t != uid {
            libc::setresgid(u32::MAX, gid, u32::MAX);
            libc::setresuid(u32::MAX, uid, u32::MAX);
        }
    }
}

pub fn umask(mode: libc::mode_t) {
    // SAFETY: no pointers; umask cannot fail.
    unsafe { libc::umask(mode) };
}

/// Raises the soft open-file limit to the hard limit and returns the
/// original, which children get back.
pub fn raise_nofile() -> Option<libc::rlimit> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: lim is a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
    // SAFETY: raised is a valid rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return None;
    }
    Some(lim)
}

pub fn set_nofile(lim: &libc::rlimit) -> SysResult<()> {
    // SAFETY: lim is a valid rlimit.
    cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, lim) }).map(|_| ())
}

// ---------------------------------------------------------------------------
// Terminals

/// Opens a new pseudo-terminal: (master, slave), both close-on-exec, the
/// master non-blocking.
pub fn open_pty(cols: u16, rows: u16) -> SysResult<(OwnedFd, OwnedFd)> {
    let master = owned(
        // SAFETY: the path is a valid C string.
        unsafe {
            libc::open(c"/dev/ptmx".as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK)
        },
    )?;
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int.
    cvt(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) })?;
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: TIOCGPTPEER takes open flags and returns a new descriptor.
    let slave = match owned(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) }) {
        // gVisor's kernel (the gvisor class) has no TIOCGPTPEER: open the
        // peer by its number, and check that what opened is that terminal.
        Err(Errno(libc::ENOTTY | libc::EINVAL)) => open_pty_peer(master.as_fd(), flags)?,
        other => other?,
    };
    set_winsize(master.as_fd(), cols, rows)?;
    Ok((master, slave))
}

/// The peer of pseudo-terminal `master` by its path, `/dev/pts/<n>`, not
/// through a symlink, refused unless it is the Unix 98 terminal numbered n.
fn open_pty_peer(master: BorrowedFd<'_>, flags: libc::c_int) -> SysResult<OwnedFd> {
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes one unsigned int.
    cvt(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTN, &mut n) })?;
    let path = std::ffi::CString::new(format!("/dev/pts/{n}")).map_err(|_| Errno(libc::EINVAL))?;
    // SAFETY: the path is a valid C string.
    let peer = owned(unsafe { libc::open(path.as_ptr(), flags | libc::O_NOFOLLOW) })?;
    // SAFETY: an all-zero stat is a valid value for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a writable stat buffer.
    cvt(unsafe { libc::fstat(peer.as_raw_fd(), &mut st) })?;
    // Unix 98 terminals' peers: majors 136 to 143, 256 numbers each.
    let (major, minor) = (libc::major(st.st_rdev), libc::minor(st.st_rdev));
    let is_peer =
        st.st_mode & libc::S_IFMT == libc::S_IFCHR && (136..144).contains(&major) && (major - 136) * 256 + minor == n;
    if !is_peer {
        return Err(Errno(libc::ENXIO));
    }
    Ok(peer)
}

pub fn set_winsize(fd: BorrowedFd<'_>, cols: u16, rows: u16) -> SysResult<()> {
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one winsize.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) }).map(|_| ())
}

// ---------------------------------------------------------------------------
// Files

#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `openat2(2)`; retries the EAGAIN that RESOLVE_IN_ROOT reports when a
/// concurrent rename raced the lookup.
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
    resolve: u64,
) -> SysResult<OwnedFd> {
    let flags = flags | libc::O_CLOEXEC;
    let creates = flags & (libc::O_CREAT | libc::O_TMPFILE) != 0;
    let how = OpenHow { flags: flags as u32 as u64, mode: if creates { mode as u64 } else { 0 }, resolve };
    let mut tries = 0;
    loop {
        // SAFETY: path is NUL-terminated; how is a valid open_how of the
        // size passed.
        let r = unsafe {
            libc::syscall(libc::SYS_openat2, dir.as_raw_fd(), path.as_ptr(), &how, std::mem::size_of::<OpenHow>())
        };
        match cvt_long(r) {
            Ok(fd) => {
                // SAFETY: openat2 returned a new descriptor that we now own.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
            }
            Err(Errno(libc::EAGAIN)) | Err(Errno(libc::EINTR)) if tries < 16 => tries += 1,
            // gVisor before 2023 has no openat2: resolve by hand.
            Err(Errno(libc::ENOSYS)) => return resolve_in_root(dir, path.to_bytes(), flags, mode, resolve),
            Err(e) => return Err(e),
        }
    }
}

/// What `openat2` does with `RESOLVE_IN_ROOT` (and `RESOLVE_NO_SYMLINKS`
/// when asked), one component at a time from `root`: `..` stops at `root`,
/// an absolute symlink restarts from it, every link is read as text (so a
/// /proc "magic" link is never followed as the kernel would: its text is
/// resolved in the root like any other), at most 40 links.
fn resolve_in_root(
    root: BorrowedFd<'_>,
    path: &[u8],
    flags: libc::c_int,
    mode: libc::mode_t,
    resolve: u64,
) -> SysResult<OwnedFd> {
    let no_symlinks = resolve & libc::RESOLVE_NO_SYMLINKS != 0;
    let dir_flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // Components still to walk, the next one last.
    let mut todo: Vec<Vec<u8>> =
        path.split(|&b| b == b'/').filter(|c| !c.is_empty()).rev().map(<[u8]>::to_vec).collect();
    let mut stack: Vec<OwnedFd> = Vec::new();
    let mut links = 0;
    fn cur<'a>(stack: &'a [OwnedFd], root: BorrowedFd<'a>) -> BorrowedFd<'a> {
        stack.last().map(|f| f.as_fd()).unwrap_or(root)
    }
    if todo.is_empty() {
        return openat(root, c".", flags & !libc::O_CREAT, mode);
    }
    while let Some(comp) = todo.pop() {
        let last = todo.is_empty();
        if comp == b"." {
            if last {
                return openat(cur(&stack, root), c".", flags & !libc::O_CREAT, mode);
            }
            continue;
        }
        if comp == b".." {
            stack.pop();
            if last {
                return openat(cur(&stack, root), c".", flags & !libc::O_CREAT, mode);
            }
            continue;
        }
        let name = CString::new(comp).map_err(|_| Errno(libc::EINVAL))?;
        // Each component is asked first whether it is a symlink: gVisor's
        // open follows one under O_NOFOLLOW when O_DIRECTORY is set (and
        // its procfs jumps through a magic link), so an open cannot say.
        let link = readlinkat(cur(&stack, root), &name).ok();
        // A /proc "magic" link (a process's cwd, root, exe, fds: those that
        // read as absolute paths) is refused, as openat2 refuses it under
        // RESOLVE_IN_ROOT.
        if link.as_ref().is_some_and(|t| t.first() == Some(&b'/'))
            && fstatfs_type(cur(&stack, root)).is_ok_and(|t| t == libc::PROC_SUPER_MAGIC)
        {
            return Err(Errno(libc::EXDEV));
        }
        let opened = match (&link, last) {
            // The caller's own O_NOFOLLOW: O_PATH opens the link itself.
            (Some(_), true) if flags & (libc::O_PATH | libc::O_NOFOLLOW) == libc::O_PATH | libc::O_NOFOLLOW => {
                openat(cur(&stack, root), &name, flags, mode)
            }
            // Followed (or refused) below.
            (Some(_), _) => Err(Errno(libc::ELOOP)),
            (None, true) => openat(cur(&stack, root), &name, flags | libc::O_NOFOLLOW, mode),
            (None, false) => openat(cur(&stack, root), &name, dir_flags, 0),
        };
        match opened {
            Ok(fd) if last => return Ok(fd),
            Ok(fd) => {
                stack.push(fd);
                continue;
            }
            // ELOOP: a symlink under O_NOFOLLOW; ENOTDIR: perhaps one too.
            // The caller's own O_NOFOLLOW on the last component stands.
            Err(e) if last && flags & libc::O_NOFOLLOW != 0 => return Err(e),
            Err(e @ (Errno(libc::ELOOP) | Errno(libc::ENOTDIR))) => {
                let target = match readlinkat(cur(&stack, root), &name) {
                    Ok(t) => t,
                    Err(_) => return Err(e),
                };
                if no_symlinks {
                    return Err(Errno(libc::ELOOP));
                }
                links += 1;
                if links > 40 {
                    return Err(Errno(libc::ELOOP));
                }
                if target.first() == Some(&b'/') {
                    stack.clear();
                }
                todo.extend(target.split(|&b| b == b'/').filter(|c| !c.is_empty()).rev().map(<[u8]>::to_vec));
                if todo.is_empty() {
                    return openat(cur(&stack, root), c".", flags & !libc::O_CREAT, mode);
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(Errno(libc::ENOENT))
}

/// `open(2)` of an absolute path, close-on-exec.
pub fn open(path: &CStr, flags: libc::c_int) -> SysResult<OwnedFd> {
    // SAFETY: path is NUL-terminated.
    owned(unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) })
}

pub fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> SysResult<OwnedFd> {
    // SAFETY: name is NUL-terminated.
    owned(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) })
}

pub fn fstat(fd: BorrowedFd<'_>) -> SysResult<libc::stat> {
    // SAFETY: stat is plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid for writes.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// The file system type (`f_type`) of the file system holding `fd`.
pub fn fstatfs_type(fd: BorrowedFd<'_>) -> SysResult<i64> {
    // SAFETY: statfs is plain data, filled by the kernel.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: st is valid for writes.
    cvt(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) })?;
    Ok(st.f_type as i64)
}

pub fn fstatat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> SysResult<libc::stat> {
    // SAFETY: stat is plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: name is NUL-terminated; st is valid for writes.
    cvt(unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, flags) })?;
    Ok(st)
}

pub fn stat(path: &CStr) -> SysResult<libc::stat> {
    // SAFETY: stat is plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: path is NUL-terminated; st is valid for writes.
    cvt(unsafe { libc::stat(path.as_ptr(), &mut st) })?;
    Ok(st)
}

pub fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: libc::mode_t) -> SysResult<()> {
    // SAFETY: name is NUL-terminated.
    cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) }).map(|_| ())
}

pub fn fchmodat(dir: BorrowedFd<'_>, name: &CStr, mode: libc::mode_t) -> SysResult<()> {
    // SAFETY: name is NUL-terminated.
    cvt(unsafe { libc::fchmodat(dir.as_raw_fd(), name.as_ptr(), mode, 0) }).map(|_| ())
}

pub fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> SysResult<()> {
    // SAFETY: name is NUL-terminated.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(|_| ())
}

pub fn renameat(from_dir: BorrowedFd<'_>, from: &CStr, to_dir: BorrowedFd<'_>, to: &CStr) -> SysResult<()> {
    // SAFETY: both names are NUL-terminated.
    cvt(unsafe { libc::renameat(from_dir.as_raw_fd(), from.as_ptr(), to_dir.as_raw_fd(), to.as_ptr()) }).map(|_| ())
}

/// `renameat2` with `flags` (`RENAME_EXCHANGE`, `RENAME_NOREPLACE`).
pub fn renameat2(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
    flags: libc::c_uint,
) -> SysResult<()> {
    // SAFETY: both names are NUL-terminated.
    cvt(unsafe { libc::renameat2(from_dir.as_raw_fd(), from.as_ptr(), to_dir.as_raw_fd(), to.as_ptr(), flags) })
        .map(|_| ())
}

pub fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> SysResult<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: name is NUL-terminated; buf is valid for writes of its length.
    let n = cvt_size(unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
    buf.truncate(n);
    Ok(buf)
}

pub fn ftruncate(fd: BorrowedFd<'_>, len: u64) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }).map(|_| ())
}

pub fn fchown(fd: BorrowedFd<'_>, uid: libc::uid_t, gid: libc::gid_t) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) }).map(|_| ())
}

/// One directory entry from `getdents64`: its name and `d_type`.
pub struct DirEntry {
    pub name: CString,
    pub d_type: u8,
}

/// Reads all entries of an open directory except `.` and `..`.
pub fn read_dir(fd: BorrowedFd<'_>) -> SysResult<Vec<DirEntry>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        // SAFETY: buf is valid for writes of its length.
        let n = cvt_long(unsafe { libc::syscall(libc::SYS_getdents64, fd.as_raw_fd(), buf.as_mut_ptr(), buf.len()) })?
            as usize;
        if n == 0 {
            return Ok(out);
        }
        let mut pos = 0;
        // struct linux_dirent64 { u64 ino; i64 off; u16 reclen; u8 type; char name[]; }
        while pos + 19 <= n {
            let reclen = u16::from_ne_bytes([buf[pos + 16], buf[pos + 17]]) as usize;
            if reclen < 19 || pos + reclen > n {
                break;
            }
            let d_type = buf[pos + 18];
            let raw = &buf[pos + 19..pos + reclen];
            let len = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
            let name = &raw[..len];
            if name != b"." && name != b".." {
                if let Ok(name) = CString::new(name) {
                    out.push(DirEntry { name, d_type });
                }
            }
            pos += reclen;
        }
    }
}

pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> SysResult<()> {
    // SAFETY: name is NUL-terminated; value is valid for reads of its length.
    cvt(unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) }).map(|_| ())
}

pub fn fgetxattr(fd: BorrowedFd<'_>, name: &CStr, buf: &mut [u8]) -> SysResult<usize> {
    // SAFETY: name is NUL-terminated; buf is valid for writes of its length.
    cvt_size(unsafe { libc::fgetxattr(fd.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })
}

pub fn flistxattr(fd: BorrowedFd<'_>, buf: &mut [u8]) -> SysResult<usize> {
    // SAFETY: buf is valid for writes of its length.
    cvt_size(unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) })
}

pub fn inotify_init() -> SysResult<OwnedFd> {
    // SAFETY: no pointers.
    owned(unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) })
}

pub fn inotify_add_watch(fd: BorrowedFd<'_>, path: &CStr, mask: u32) -> SysResult<i32> {
    // SAFETY: path is NUL-terminated.
    cvt(unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) })
}

pub fn inotify_rm_watch(fd: BorrowedFd<'_>, wd: i32) {
    // SAFETY: no pointers; an unknown wd yields EINVAL, which is ignored.
    unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
}

// ---------------------------------------------------------------------------
// Descriptor passing, resource limits, Landlock (the process class)

/// Reads like [`read_append`], and takes the descriptors (`SCM_RIGHTS`)
/// that came with the bytes into `fds`, close-on-exec.
pub fn recv_append(fd: BorrowedFd<'_>, buf: &mut Vec<u8>, max: usize, fds: &mut Vec<OwnedFd>) -> SysResult<usize> {
    // The most any request carries (an AddTenant's); more are cut off
    // by the kernel, and the request then counts too few.
    const MAX_FDS: usize = hutch_agent::proto::MAX_TENANT_FDS;
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    let mut iov = libc::iovec { iov_base: spare.as_mut_ptr().cast(), iov_len: max };
    // u64s keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; (MAX_FDS * 4 + 64) / 8];
    // SAFETY: a zeroed msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at valid buffers of the lengths it states.
    let n = cvt_size(unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) })?;
    // SAFETY: the first n bytes of the spare capacity were just written.
    unsafe { buf.set_len(buf.len() + n) };
    // SAFETY: walking the control messages the kernel wrote into `control`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(n)
}

/// Sets a resource limit, soft and hard; allocates nothing.
pub fn set_rlimit(resource: i32, value: u64) -> SysResult<()> {
    let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: lim is a valid rlimit.
    cvt(unsafe { libc::setrlimit(resource as _, &lim) }).map(|_| ())
}

pub fn chown_path(path: &CStr, uid: libc::uid_t, gid: libc::gid_t) -> SysResult<()> {
    // SAFETY: path is a valid C string.
    cvt(unsafe { libc::lchown(path.as_ptr(), uid, gid) }).map(|_| ())
}

pub fn chmod_path(path: &CStr, mode: libc::mode_t) -> SysResult<()> {
    // SAFETY: path is a valid C string.
    cvt(unsafe { libc::chmod(path.as_ptr(), mode) }).map(|_| ())
}

pub fn mkdir_path(path: &CStr, mode: libc::mode_t) -> SysResult<()> {
    // SAFETY: path is a valid C string.
    cvt(unsafe { libc::mkdir(path.as_ptr(), mode) }).map(|_| ())
}

pub fn rmdir_path(path: &CStr) -> SysResult<()> {
    // SAFETY: path is a valid C string.
    cvt(unsafe { libc::rmdir(path.as_ptr()) }).map(|_| ())
}

/// Landlock's ABI version on this kernel; 0 (or an error) when disabled.
pub fn landlock_abi() -> SysResult<i64> {
    const VERSION: libc::c_uint = 1;
    // SAFETY: the version query takes no ruleset attributes.
    cvt_long(unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, VERSION) })
}

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// Landlock file system rights (`LANDLOCK_ACCESS_FS_*`).
pub mod ll {
    pub const EXECUTE: u64 = 1;
    pub const WRITE_FILE: u64 = 1 << 1;
    pub const READ_FILE: u64 = 1 << 2;
    pub const READ_DIR: u64 = 1 << 3;
    pub const TRUNCATE: u64 = 1 << 14;
    pub const IOCTL_DEV: u64 = 1 << 15;
    /// What reading and running programs take.
    pub const READ: u64 = EXECUTE | READ_FILE | READ_DIR;

    /// Every file system right Landlock ABI `abi` knows: bits 0-12 (ABI 1),
    /// REFER (2), TRUNCATE (3), IOCTL_DEV (5).
    pub fn handled(abi: i64) -> u64 {
        let mut all: u64 = (1 << 13) - 1;
        if abi >= 2 {
            all |= 1 << 13;
        }
        if abi >= 3 {
            all |= TRUNCATE;
        }
        if abi >= 5 {
            all |= IOCTL_DEV;
        }
        all
    }
}

/// Makes a Landlock ruleset that handles every file system right of `abi`
/// (and, from ABI 6, scopes signals and abstract unix sockets to the
/// domain: a process cannot signal, or connect to an abstract socket of,
/// a process outside its domain) and allows each `(dir, rights)` beneath
/// `dir` (rights outside what `abi` handles are dropped).
pub fn landlock_ruleset(abi: i64, rules: &[(BorrowedFd<'_>, u64)]) -> SysResult<OwnedFd> {
    const RULE_PATH_BENEATH: libc::c_int = 1;
    let all = ll::handled(abi);
    let attr = RulesetAttr { handled_access_fs: all, handled_access_net: 0, scoped: if abi >= 6 { 0b11 } else { 0 } };
    let size = if abi >= 6 { std::mem::size_of::<RulesetAttr>() } else { 8 };
    // SAFETY: attr is a valid ruleset attribute of `size` bytes.
    let fd =
        cvt_long(unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, &attr as *const RulesetAttr, size, 0) })?;
    // SAFETY: the kernel just returned this descriptor, owned by nobody else.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    for (dir, access) in rules {
        let rule = PathBeneathAttr { allowed_access: access & all, parent_fd: dir.as_raw_fd() };
        // SAFETY: rule is a valid path-beneath attribute.
        cvt_long(unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0,
            )
        })?;
    }
    Ok(ruleset)
}

/// Restricts the calling thread by a ruleset (needs no_new_privs);
/// allocates nothing.
pub fn landlock_restrict_self(ruleset: RawFd) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt_long(unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0) }).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affinity() -> libc::cpu_set_t {
        cpu_mask().expect("sched_getaffinity")
    }

    fn cpus(mask: &libc::cpu_set_t) -> Vec<usize> {
        // SAFETY: CPU_ISSET reads the mask within CPU_SETSIZE.
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, mask) }).collect()
    }

    /// A spawn_vm child starts held to its parent's CPU, and gives both
    /// their CPU masks back before the function it runs (a command) starts.
    #[test]
    fn a_spawned_child_and_its_parent_get_their_cpus_back() {
        let before = affinity();
        let pin = PinnedHere::take().expect("pin");
        // SAFETY: sched_getcpu has no memory effects.
        let here = unsafe { libc::sched_getcpu() } as usize;
        assert_eq!(cpus(&affinity()), vec![here], "held to the CPU it runs on");
        pin.release(0);
        assert_eq!(cpus(&affinity()), cpus(&before));

        struct Seen {
            mask: libc::cpu_set_t,
            ok: bool,
        }
        extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
            // SAFETY: arg points at the test's `seen`; the test thread is
            // suspended (CLONE_VFORK) while the child writes it.
            let seen = unsafe { &mut *(arg as *mut Seen) };
            // SAFETY: seen.mask is valid for its size.
            seen.ok =
                unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut seen.mask) } == 0;
            // SAFETY: ends the child without running anything of the parent's.
            unsafe { libc::_exit(0) }
        }
        // SAFETY: as above.
        let mut seen = Seen { mask: unsafe { std::mem::zeroed() }, ok: false };
        // SAFETY: the child writes only `seen`, then exits.
        let pid = unsafe { spawn_vm(child, &mut seen as *mut Seen as *mut libc::c_void) }.expect("spawn");
        assert_eq!(waitpid(pid, 0), Ok(Some((pid, 0))));
        assert!(seen.ok, "the child read its mask");
        assert_eq!(cpus(&seen.mask), cpus(&before), "the child runs with its parent's mask");
        assert_eq!(cpus(&affinity()), cpus(&before), "the parent has its mask back");

        // The next child runs on the same stack.
        let kept = SPARE_STACK.take().expect("the stack is kept for the next child");
        let top = kept.top();
        SPARE_STACK.set(Some(kept));
        seen.ok = false;
        // SAFETY: as above.
        let pid = unsafe { spawn_vm(child, &mut seen as *mut Seen as *mut libc::c_void) }.expect("spawn again");
        assert_eq!(waitpid(pid, 0), Ok(Some((pid, 0))));
        assert!(seen.ok, "the second child ran");
        assert_eq!(SPARE_STACK.take().map(|s| s.top()), Some(top), "on the kept stack");
    }

    /// The slice `sched_getattr` reports for the calling thread.
    fn slice_ns() -> u64 {
        let mut attr = [0u64; 7];
        // SAFETY: attr is 56 writable bytes, the size passed.
        let r = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, attr.as_mut_ptr(), 56, 0) };
        assert_eq!(r, 0, "sched_getattr");
        // size, policy | flags | nice, priority | runtime
        attr[3]
    }

    /// The agent's turns are short; its children's are the default again.
    #[test]
    fn a_short_slice_is_the_agents_and_not_its_childrens() {
        let before = slice_ns();
        request_short_slice().expect("sched_setattr");
        assert_eq!(slice_ns(), 100_000);
        // SAFETY: the child makes system calls only, then _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            let code = if slice_ns() == before { 0 } else { 1 };
            // SAFETY: ends the child.
            unsafe { libc::_exit(code) }
        }
        assert_eq!(waitpid(pid, 0), Ok(Some((pid, 0))), "a child starts with the default slice");
        assert_ne!(before, 100_000);
    }

    /// gVisor's path (no openat2): a final symlink is followed inside the
    /// root unless the caller refuses it, also for an O_PATH open.
    #[test]
    fn resolve_in_root_follows_a_final_symlink_unless_refused() {
        let dir = std::env::temp_dir().join(format!("hutch-resolve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join("f"), b"x").expect("write");
        std::os::unix::fs::symlink("f", dir.join("rel")).expect("symlink");
        std::os::unix::fs::symlink("/f", dir.join("abs")).expect("symlink");
        let root = std::fs::File::open(&dir).expect("open root");
        let root = root.as_fd();
        let kind = |fd: SysResult<OwnedFd>| fd.map(|fd| fstat(fd.as_fd()).expect("fstat").st_mode & libc::S_IFMT);
        for link in [&b"rel"[..], b"abs"] {
            assert_eq!(kind(resolve_in_root(root, link, libc::O_PATH, 0, 0)), Ok(libc::S_IFREG));
            assert_eq!(kind(resolve_in_root(root, link, libc::O_RDONLY, 0, 0)), Ok(libc::S_IFREG));
            assert_eq!(kind(resolve_in_root(root, link, libc::O_PATH | libc::O_NOFOLLOW, 0, 0)), Ok(libc::S_IFLNK));
            let refused = resolve_in_root(root, link, libc::O_PATH, 0, libc::RESOLVE_NO_SYMLINKS);
            assert_eq!(refused.err(), Some(Errno(libc::ELOOP)));
        }
        std::fs::create_dir(dir.join("d")).expect("mkdir");
        std::os::unix::fs::symlink("d", dir.join("dl")).expect("symlink");
        let dir_flags = libc::O_RDONLY | libc::O_DIRECTORY;
        assert_eq!(kind(resolve_in_root(root, b"dl", dir_flags, 0, 0)), Ok(libc::S_IFDIR));
        let refused = resolve_in_root(root, b"dl", dir_flags, 0, libc::RESOLVE_NO_SYMLINKS);
        assert_eq!(refused.err(), Some(Errno(libc::ELOOP)));
        let refused = resolve_in_root(root, b"dl/x", libc::O_RDONLY, 0, libc::RESOLVE_NO_SYMLINKS);
        assert_eq!(refused.err(), Some(Errno(libc::ELOOP)));
        // /proc's magic links are refused as openat2 refuses them; its
        // plain ones (self) are followed.
        let slash = std::fs::File::open("/").expect("open /");
        for magic in [&b"proc/self/cwd"[..], b"proc/self/exe"] {
            let refused = resolve_in_root(slash.as_fd(), magic, libc::O_PATH, 0, 0);
            assert_eq!(refused.err(), Some(Errno(libc::EXDEV)), "{}", String::from_utf8_lossy(magic));
        }
        assert_eq!(kind(resolve_in_root(slash.as_fd(), b"proc/self/status", libc::O_RDONLY, 0, 0)), Ok(libc::S_IFREG));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// Every descriptor but those kept is closed, past 4096 too: close_range
    /// itself took the range (gVisor refuses a last descriptor above
    /// INT_MAX, and every exec there paid for the fallback), and the
    /// fallback of kernels before 5.9 reaches as far.
    #[test]
    fn close_all_except_closes_the_whole_range_in_one_call() {
        // In a child of its own: the test harness's descriptors stay open.
        // SAFETY: the child only makes system calls, then _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            let code = (|| {
                let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                // SAFETY: lim is valid for the kernel to fill, then read.
                if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
                    return 2;
                }
                // Room above the fallback's bound (raising the hard limit
                // takes root, as the agent's tests run).
                lim.rlim_cur = 8192;
                lim.rlim_max = lim.rlim_max.max(8192);
                // SAFETY: lim is a valid rlimit.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
                    return 2;
                }
                let high: RawFd = 8191;
                // SAFETY: dup2 of stderr onto numbers this child owns.
                if unsafe { libc::dup2(2, 40) } != 40 || unsafe { libc::dup2(2, high) } != high {
                    return 3;
                }
                close_all_except(&mut [40]);
                // SAFETY: F_GETFD only reads the descriptor's flags.
                let open = |fd: RawFd| unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0;
                if (open(40), open(high)) != (true, false) {
                    return 1;
                }
                // The one-by-one fallback (kernels before 5.9) reaches as
                // far: up to the open-files limit, not a fixed 4096.
                // SAFETY: as above.
                if unsafe { libc::dup2(2, high) } != high {
                    return 3;
                }
                close_each(3, LAST_FD);
                match (open(40), open(high)) {
                    (false, false) => 0,
                    _ => 4,
                }
            })();
            exit_now(code);
        }
        let status = waitpid(pid, 0).expect("waitpid").expect("the child").1;
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "1: not closed or not kept, 4: the fallback left one open, 2, 3: set-up failed"
        );
    }
}
