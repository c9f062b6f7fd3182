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
