//! Thin safe wrappers over the few system calls the rest of the crate needs
//! and std does not offer. Each keeps its `unsafe` to one line with a SAFETY
//! note, so callers stay safe code.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads until `buf` is full or EOF; returns the bytes read.
pub fn read_full(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of buf.
        let n = unsafe { libc::read(fd, buf[done..].as_mut_ptr().cast(), buf.len() - done) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

/// Sends a signal; errors (the process is gone) are ignored on purpose.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) {
    if pid > 0 {
        // SAFETY: kill has no memory effects; pid > 0 targets one process.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Waits for a child and returns its raw wait status.
pub fn reap(pid: libc::pid_t) -> Option<i32> {
    let mut status = 0;
    loop {
        // SAFETY: status is a valid out-pointer.
        let ret = unsafe { libc::waitpid(pid, &mut status, 0) };
        if ret == pid {
            return Some(status);
        }
        if ret < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
}

/// The size in bytes of the file system holding `path`.
pub fn fs_size(path: &std::path::Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: zeroed is a valid statvfs (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path, st a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_blocks.saturating_mul(st.f_frsize))
}

/// Fills `buf` from the kernel's random source.
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of buf.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// `open(path, flags | O_CLOEXEC)`: namespace files (`O_RDONLY`), binaries
/// to exec by descriptor (`O_PATH`).
pub fn open(path: impl AsRef<std::ffi::OsStr>, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = crate::launch::cstr(path)?;
    // SAFETY: c is a valid C string; the returned fd is owned below.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `bytes` random bytes as hex, for names of temporary things; should the
/// kernel's source fail, the time and pid stand in (names, not secrets).
pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    if random_bytes(&mut b).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let seed = (t as u64 ^ u64::from(std::process::id())).to_le_bytes();
        for (i, x) in b.iter_mut().enumerate() {
            *x = seed[i % 8];
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Takes an exclusive lock without blocking; false when someone holds it.
pub fn try_lock(fd: RawFd) -> io::Result<bool> {
    // SAFETY: flock has no memory effects.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// The kernel release, as `uname -r` prints it.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// Clears close-on-exec on a descriptor that a child must inherit.
pub fn set_cloexec(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl with F_GETFD/F_SETFD has no memory effects.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if on { flags | libc::FD_CLOEXEC } else { flags & !libc::FD_CLOEXEC };
        if libc::fcntl(fd, libc::F_SETFD, flags) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Remounts a mount point with new file-system options.
pub fn remount(target: &std::path::Path, options: &str) -> io::Result<()> {
    let target = crate::launch::cstr(target)?;
    let options = crate::launch::cstr(options)?;
    // SAFETY: both are valid C strings for the duration of the call.
    let ret = unsafe {
        libc::mount(std::ptr::null(), target.as_ptr(), std::ptr::null(), libc::MS_REMOUNT, options.as_ptr().cast())
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Mount flags of the sandbox's own mounts.
pub const MS_RO_NOSUID_NODEV_NOEXEC: libc::c_ulong =
    libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

/// Signals blocked in the calling thread (and in the threads it starts
/// afterwards), to be taken one at a time with [`BlockedSignals::wait`].
#[derive(Clone, Copy)]
pub struct BlockedSignals(libc::sigset_t);

impl BlockedSignals {
    pub fn block(signals: &[libc::c_int]) -> io::Result<BlockedSignals> {
        // SAFETY: an all-zero sigset_t is a valid value, emptied right after.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: set is a valid sigset_t for these calls to fill and read.
        unsafe {
            libc::sigemptyset(&mut set);
            for &s in signals {
                if libc::sigaddset(&mut set, s) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            let e = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if e != 0 {
                return Err(io::Error::from_raw_os_error(e));
            }
        }
        Ok(BlockedSignals(set))
    }

    /// Waits for one of the signals and returns its number.
    pub fn wait(&self) -> io::Result<libc::c_int> {
        let mut sig = 0;
        // SAFETY: self.0 is an initialised sigset_t; sig a valid out-pointer.
        let e = unsafe { libc::sigwait(&self.0, &mut sig) };
        if e != 0 {
            return Err(io::Error::from_raw_os_error(e));
        }
        Ok(sig)
    }
}

/// System calls that never touch `errno`, for code that runs in a child
/// sharing our memory (`CLONE_VM`): such a child also shares the cloning
/// thread's TLS, so libc's wrappers would write that thread's `errno`
/// (and read back whatever that thread wrote since). These return the
/// kernel's own answer instead: a value >= 0, or `-errno`.
pub mod raw {
    /// System call `nr` with six arguments (unused ones 0); the kernel's
    /// answer as is.
    ///
    /// # Safety
    /// As the system call itself: pointers among `args` must be valid for
    /// what the call does with them.
    #[inline(always)]
    pub unsafe fn syscall(nr: libc::c_long, args: [usize; 6]) -> isize {
        let ret: isize;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the x86_64 Linux system call convention: number in rax,
        // arguments in rdi, rsi, rdx, r10, r8, r9; the kernel clobbers rcx
        // and r11 and restores the flags. The caller vouches for the call.
        unsafe {
            core::arch::asm!(
                "syscall",
                inlateout("rax") nr as isize => ret,
                in("rdi") args[0],
                in("rsi") args[1],
                in("rdx") args[2],
                in("r10") args[3],
                in("r8") args[4],
                in("r9") args[5],
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack, preserves_flags),
            );
        }
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the aarch64 Linux system call convention: number in x8,
        // arguments in x0 to x5, the answer in x0. The caller vouches for
        // the call.
        unsafe {
            core::arch::asm!(
                "svc 0",
                in("x8") nr,
                inlateout("x0") args[0] as isize => ret,
                in("x1") args[1],
                in("x2") args[2],
                in("x3") args[3],
                in("x4") args[4],
                in("x5") args[5],
                options(nostack, preserves_flags),
            );
        }
        ret
    }

    /// `Ok(value)` or `Err(errno)` from a raw answer.
    pub fn check(ret: isize) -> Result<usize, i32> {
        if (-4095..0).contains(&ret) {
            Err(-ret as i32)
        } else {
            Ok(ret as usize)
        }
    }

    /// Ends the calling process (`exit_group`) without running anything of
    /// the parent's: no atexit handlers, no flushing of shared buffers.
    pub fn exit(code: i32) -> ! {
        loop {
            // SAFETY: exit_group takes no pointer and does not return.
            unsafe { syscall(libc::SYS_exit_group, [code as usize, 0, 0, 0, 0, 0]) };
        }
    }
}

/// The open-file limit the process started with, kept by [`raise_nofile`]
/// for the sandboxes it starts.
static STARTING_NOFILE: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();

/// The open-file limit now: (soft, hard).
pub fn nofile() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: lim is a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// Raises the soft open-file limit to the hard limit (the daemon holds a
/// descriptor for every client connection, agent link and port connection)
/// and remembers the original, which the sandboxes started after this get
/// back ([`workload_nofile`]): programs that loop over every possible
/// descriptor or use `select` expect the usual soft limit. Returns the
/// limit now in force.
pub fn raise_nofile() -> io::Result<(u64, u64)> {
    let (soft, hard) = nofile()?;
    let _ = STARTING_NOFILE.set((soft, hard));
    if soft < hard {
        let raised = libc::rlimit { rlim_cur: hard, rlim_max: hard };
        // SAFETY: raised is a valid rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    nofile()
}

/// The open-file limit sandboxes start with, when [`raise_nofile`] changed
/// the process's own.
pub fn workload_nofile() -> Option<(u64, u64)> {
    STARTING_NOFILE.get().copied()
}

/// A path or name as a C string; an interior NUL (a caller bug caught by
/// validation upstream, or a name read from a hostile tree) is
/// InvalidInput.
pub fn cstr(s: impl AsRef<std::ffi::OsStr>) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(s.as_ref().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}

/// Opens `name` in directory `dir`, never through a symlink (`O_NOFOLLOW`,
/// close-on-exec): how the walkers of layers (diffs, exports) step down.
pub fn openat_nofollow(dir: &OwnedFd, name: &std::ffi::OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = cstr(name)?;
    // SAFETY: c is a valid C string; the descriptor is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `lstat` of `name` in directory `dir` (a symlink is itself).
pub fn lstatat(dir: &OwnedFd, name: &std::ffi::OsStr) -> io::Result<libc::stat> {
    use std::os::fd::AsRawFd;
    let c = cstr(name)?;
    // SAFETY: zeroed is a valid stat (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string, st a valid out-pointer.
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}
