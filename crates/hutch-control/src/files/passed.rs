//! Raw transfers through a descriptor the agent passes: the agent opens the
//! file inside the sandbox's root as the sandbox's user, with its usual
//! path rules ([`Request::OpenFile`](hutch_agent::proto::Request::OpenFile)),
//! and sends the descriptor with its reply (SCM_RIGHTS); the daemon then
//! reads or writes the bytes itself, in large pieces, instead of sending
//! them through the agent in frames (two copies and the agent's event loop
//! less per byte).
//!
//! The daemon never resolves a sandbox path: it only uses what it was
//! given, and only once [`check`] accepted it. A hostile agent may send
//! anything (a pipe, a socket, a device, a directory, a file of /proc, no
//! descriptor or several): exactly one descriptor, a regular file on a file
//! system of [`proto::PASSABLE_FS`], opened with the access asked and
//! nothing else (no `O_APPEND`, no `O_PATH`), or the transfer is refused as
//! the agent answering nonsense is (`internal`), and every descriptor
//! received is closed. The bytes move on a thread of their own per transfer
//! (a slow disk or client never holds an async worker or the blocking pool).

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};

use hutch_agent::proto;
use hutch_api::ErrorCode;
use hutch_runtime::agent::AgentError;
use tokio::sync::{mpsc, oneshot};

use super::{Access, Chunks, FilesError, FILE_CAP};

/// Bytes a passed read hands on at a time.
pub const READ_CHUNK: usize = super::STREAM_CHUNK as usize;
/// Most bytes a passed write gathers from the body's chunks into one
/// `pwritev`.
const WRITE_BATCH: usize = 4 << 20;

fn refused(what: impl std::fmt::Display) -> FilesError {
    FilesError::new(ErrorCode::Internal, format!("sandbox agent passed {what}"))
}

/// Accepts what the agent passed for one file opened for reading (or, with
/// `write`, for writing), or refuses it; everything refused is closed.
pub fn check(mut fds: Vec<OwnedFd>, write: bool) -> Result<File, FilesError> {
    if fds.len() != 1 {
        // More than MAX_FDS were closed as they came: "4" may mean more.
        return Err(refused(format_args!("{} descriptors for one file", fds.len())));
    }
    let fd = fds.pop().expect("one descriptor");
    // SAFETY: fstat, fcntl and fstatfs only fill the buffers given, of
    // their types, and fd is open.
    let (st, flags, fs) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        let mut fs: libc::statfs = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 || libc::fstatfs(fd.as_raw_fd(), &mut fs) != 0 {
            return Err(refused(format_args!(
                "a descriptor that cannot be described: {}",
                std::io::Error::last_os_error()
            )));
        }
        (st, libc::fcntl(fd.as_raw_fd(), libc::F_GETFL), fs)
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(refused(format_args!("a descriptor of mode {:o}, not a regular file", st.st_mode & libc::S_IFMT)));
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between architectures.
    let magic = fs.f_type as i64;
    if !proto::passable(magic, write) {
        return Err(refused(format_args!("a file on a file system of type {magic:#x}")));
    }
    let want = if write { libc::O_WRONLY } else { libc::O_RDONLY };
    if flags < 0 || flags & libc::O_ACCMODE != want || flags & (libc::O_APPEND | libc::O_PATH) != 0 {
        return Err(refused(format_args!("a descriptor opened with flags {flags:#o}")));
    }
    Ok(File::from(fd))
}

/// An error of the kernel on a passed file, as the agent would have
/// answered it (a full layer is `sandbox_disk_full`).
fn os_error(op: &str, path: &str, e: std::io::Error, access: Access) -> FilesError {
    let code = proto::ErrorCode::from_errno(e.raw_os_error().unwrap_or(libc::EIO));
    FilesError::from_agent(AgentError::Refused { code, message: format!("{op} {path}: {e}") }, access)
}

/// Streams `file` from its start up to `end` bytes (or its end, if sooner)
/// in chunks of [`READ_CHUNK`], read on a thread of their own.
pub fn read(file: File, path: String, end: u64) -> Result<Chunks, FilesError> {
    let (tx, rx) = mpsc::channel(2);
    std::thread::Builder::new()
        .name("hutch-file-read".into())
        .spawn(move || {
            let mut offset = 0u64;
            while offset < end {
                let want = (end - offset).min(READ_CHUNK as u64) as usize;
                let mut buf = Vec::with_capacity(want);
                // Reads into the spare capacity, never zeroed first.
                let r = std::io::Read::read_to_end(&mut std::io::Read::take(&file, want as u64), &mut buf);
                match r {
                    Ok(0) => return,
                    Ok(n) => offset += n as u64,
                    Err(e) => {
                        let _ = tx.blocking_send(Err(os_error("read", &path, e, Access::Read)));
                        return;
                    }
                }
                if tx.blocking_send(Ok(buf)).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| FilesError::new(ErrorCode::Internal, format!("file transfer thread: {e}")))?;
    Ok(rx)
}

/// Writes the chunks of `rx` into `file` from its start, at most
/// [`FILE_CAP`] bytes, on a thread of its own; answers the bytes written.
/// A broken stream, a file over the cap or a refused write ends it with
/// that error (the caller removes the file).
pub async fn write(file: File, path: String, rx: Chunks) -> Result<u64, FilesError> {
    let (done, result) = oneshot::channel();
    std::thread::Builder::new()
        .name("hutch-file-write".into())
        .spawn(move || {
            let written = write_all(&file, &path, rx);
            // Closed before the answer: the caller then renames the file
            // into place, and a close after that would reach a directory
            // watch as a write of the file's new name.
            drop(file);
            let _ = done.send(written);
        })
        .map_err(|e| FilesError::new(ErrorCode::Internal, format!("file transfer thread: {e}")))?;
    result.await.map_err(|_| FilesError::new(ErrorCode::Internal, "file transfer thread ended early"))?
}

fn write_all(file: &File, path: &str, mut rx: Chunks) -> Result<u64, FilesError> {
    let mut total = 0u64;
    let mut batch: Vec<Vec<u8>> = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        batch.clear();
        batch.push(first?);
        let mut len = batch[0].len();
        // Whatever else already waits goes in the same system call.
        while len < WRITE_BATCH {
            match rx.try_recv() {
                Ok(chunk) => {
                    let chunk = chunk?;
                    len += chunk.len();
                    batch.push(chunk);
                }
                Err(_) => break,
            }
        }
        if total + len as u64 > FILE_CAP {
            return Err(FilesError::new(ErrorCode::PayloadTooLarge, format!("the file exceeds {FILE_CAP} bytes")));
        }
        write_batch(file, &batch, total).map_err(|e| os_error("write", path, e, Access::Write))?;
        total += len as u64;
    }
    Ok(total)
}

/// `pwritev` of every chunk of `batch` at `offset`, to the end. Empty
/// chunks (a multipart parser hands some on) are left out: a `pwritev` of
/// nothing answers 0, which would read as a file that takes no more.
fn write_batch(file: &File, batch: &[Vec<u8>], mut offset: u64) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> =
        batch.iter().filter(|c| !c.is_empty()).map(|c| std::io::IoSlice::new(c)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        // SAFETY: the IoSlices are iovecs (same layout) of live buffers.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len().min(1024) as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        offset += n as u64;
        std::io::IoSlice::advance_slices(&mut rest, n as usize);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_write_takes_empty_chunks_anywhere_in_its_stream() {
        let path = std::env::temp_dir().join(format!("hutch-passed-empty-{}", std::process::id()));
        let file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path).expect("open");
        let (tx, rx) = mpsc::channel(8);
        for chunk in [&b""[..], b"ab", b"", b"", b"c", b""] {
            tx.try_send(Ok(chunk.to_vec())).expect("room");
        }
        drop(tx);
        assert_eq!(write_all(&file, "f", rx).map_err(|e| e.message), Ok(3));
        assert_eq!(std::fs::read(&path).expect("read"), b"abc");
        // A stream of nothing but empty chunks writes an empty file.
        let (tx, rx) = mpsc::channel(2);
        tx.try_send(Ok(Vec::new())).expect("room");
        drop(tx);
        let empty = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path).expect("open");
        assert_eq!(write_all(&empty, "f", rx).map_err(|e| e.message), Ok(0));
        std::fs::remove_file(&path).expect("cleanup");
    }

    fn fd_of(f: impl Into<OwnedFd>) -> Vec<OwnedFd> {
        vec![f.into()]
    }

    #[test]
    fn only_one_regular_file_opened_as_asked_is_accepted() {
        let dir = std::env::temp_dir().join(format!("hutch-passed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("f");
        std::fs::write(&path, b"x").expect("write");
        let on_passable = std::fs::File::open(&path)
            .ok()
            .filter(|f| {
                // SAFETY: statfs is plain data, and fstatfs fills the buffer given.
                let (r, fs) = unsafe {
                    let mut fs: libc::statfs = std::mem::zeroed();
                    (libc::fstatfs(f.as_raw_fd(), &mut fs), fs)
                };
                #[allow(clippy::unnecessary_cast)] // f_type's width differs between architectures.
                let magic = fs.f_type as i64;
                r == 0 && proto::passable_fs(magic)
            })
            .is_some();
        let code = |r: Result<File, FilesError>| r.map(|_| ()).map_err(|e| e.code);
        if on_passable {
            assert_eq!(code(check(fd_of(File::open(&path).expect("open")), false)), Ok(()));
            let w = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
            assert_eq!(code(check(fd_of(w), true)), Ok(()));
            // The wrong access, read-write, append.
            assert_eq!(code(check(fd_of(File::open(&path).expect("open")), true)), Err(ErrorCode::Internal));
            let rw = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open");
            assert_eq!(code(check(fd_of(rw), false)), Err(ErrorCode::Internal));
            let app = std::fs::OpenOptions::new().append(true).open(&path).expect("open");
            assert_eq!(code(check(fd_of(app), true)), Err(ErrorCode::Internal));
            // None, or two.
            assert_eq!(code(check(Vec::new(), false)), Err(ErrorCode::Internal));
            let two = vec![File::open(&path).expect("open").into(), File::open(&path).expect("open").into()];
            assert_eq!(code(check(two, false)), Err(ErrorCode::Internal));
        }
        // A directory, a pipe, a socket, a device, a file of /proc.
        assert_eq!(code(check(fd_of(File::open(&dir).expect("open dir")), false)), Err(ErrorCode::Internal));
        let (a, _b) = UnixStream::pair().expect("pair");
        assert_eq!(code(check(fd_of(a), false)), Err(ErrorCode::Internal));
        let mut p = [0; 2];
        // SAFETY: pipe fills two descriptors we then own.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both are new descriptors of ours.
        let (r, _w) = unsafe {
            (
                <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(p[0]),
                <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(p[1]),
            )
        };
        assert_eq!(code(check(vec![r], false)), Err(ErrorCode::Internal));
        assert_eq!(code(check(fd_of(File::open("/dev/null").expect("null")), false)), Err(ErrorCode::Internal));
        assert_eq!(code(check(fd_of(File::open("/proc/self/status").expect("proc")), false)), Err(ErrorCode::Internal));
        // A file on tmpfs, for reading only (its pages written by the host
        // would be charged to the host).
        let shm = std::path::Path::new("/dev/shm").join(format!("hutch-passed-{}", std::process::id()));
        std::fs::write(&shm, b"x").expect("a file on /dev/shm");
        assert_eq!(code(check(fd_of(File::open(&shm).expect("open")), false)), Ok(()));
        let w = std::fs::OpenOptions::new().write(true).open(&shm).expect("open");
        assert_eq!(code(check(fd_of(w), true)), Err(ErrorCode::Internal));
        std::fs::remove_file(&shm).expect("cleanup");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
