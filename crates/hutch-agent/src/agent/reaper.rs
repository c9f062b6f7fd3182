//! `hutch-agent --reap PROGRAM ARGS...`, on the host: runs PROGRAM (a path,
//! or a name looked up on the PATH) with a reaper of its own for the
//! processes it leaves behind, as `runsc run --detach` and `runsc restore
//! --detach` leave a gVisor sandbox and its gofer when they return.
//!
//! The process the caller starts forks the reaper, which makes itself a
//! child subreaper and runs PROGRAM as its child. When PROGRAM exits, what
//! it left running becomes the reaper's; the reaper sends PROGRAM's wait
//! status to the first process, which exits with it, so the caller reads
//! PROGRAM's status as its own child's. The reaper then waits for every
//! process it inherited as each exits, and ends after the last.
//!
//! Why: runsc's `delete` waits until the sandbox's processes are gone,
//! reaped included. Left to init, which on some hosts reaps about once a
//! second, that added about 1.2 s to every memory snapshot, fork and pause
//! of a gvisor sandbox here. The daemon cannot be the subreaper itself:
//! with many threads, a wait for "any child" in it would also take the
//! statuses of children its other threads wait for.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::sys::{self, CStrArray, Errno};

/// Exit status of the first process when the reaper could not run
/// PROGRAM or report on it.
const FAILED: i32 = 125;

/// Runs `program` with `args` (its argv after argv[0]) under a reaper;
/// returns PROGRAM's exit status (128 + the signal that ended it).
pub fn run(program: &CStr, args: &[&CStr]) -> i32 {
    let Ok((status_rx, status_tx)) = sys::pipe() else {
        return FAILED;
    };
    // SAFETY: the agent's reaper mode is single threaded.
    match unsafe { sys::fork() } {
        Err(_) => return FAILED,
        Ok(0) => {
            drop(status_rx);
            reap(program, args, status_tx)
        }
        Ok(_) => {}
    }
    drop(status_tx);
    let mut buf = [0u8; 4];
    let mut got = 0;
    while got < buf.len() {
        match sys::read(status_rx.as_fd(), &mut buf[got..]) {
            Ok(0) => return FAILED,
            Ok(n) => got += n,
            Err(Errno(libc::EINTR)) => {}
            Err(_) => return FAILED,
        }
    }
    let status = i32::from_ne_bytes(buf);
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        FAILED
    }
}

/// The reaper: runs PROGRAM, reports its status on `status_tx`, then
/// reaps until it has no child left.
fn reap(program: &CStr, args: &[&CStr], status_tx: OwnedFd) -> ! {
    // Out of the caller's session and process group: a signal to the
    // caller's group must not end the reaper of processes that outlive it.
    let _ = sys::setsid();
    if sys::set_child_subreaper().is_err() {
        sys::exit_now(FAILED);
    }
    let argv = CStrArray::new(std::iter::once(program).chain(args.iter().copied()).map(CString::from).collect());
    // SAFETY: as above.
    let child = match unsafe { sys::fork() } {
        Err(_) => sys::exit_now(FAILED),
        Ok(0) => {
            // status_tx is close-on-exec.
            let _ = sys::execvp(program, &argv);
            sys::exit_now(127)
        }
        Ok(pid) => pid,
    };
    let status = loop {
        match sys::waitpid(child, 0) {
            Ok(Some((_, status))) => break status,
            Err(Errno(libc::EINTR)) | Ok(None) => {}
            Err(_) => sys::exit_now(FAILED),
        }
    };
    let _ = sys::write_all(status_tx.as_raw_fd(), &status.to_ne_bytes());
    drop(status_tx);
    // Let go of the caller's files (PROGRAM's log, say).
    if let Ok(null) = sys::open(c"/dev/null", libc::O_RDWR | libc::O_CLOEXEC) {
        for fd in 0..3 {
            let _ = sys::dup_to(null.as_raw_fd(), fd);
        }
    }
    loop {
        match sys::waitpid(-1, 0) {
            Ok(_) | Err(Errno(libc::EINTR)) => {}
            // ECHILD: the last one is gone.
            Err(_) => sys::exit_now(0),
        }
    }
}
