//! File operations on the sandbox's tree. Every path is normalised with
//! [`proto::normalize_path`] and resolved with `openat2(RESOLVE_IN_ROOT |
//! RESOLVE_NO_MAGICLINKS)` from a descriptor of "/", then the final step is
//! done relative to a directory descriptor, never through a path string.
//! Operations run with the file system ids of the requesting user.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use hutch_agent::proto::{self, Entry, EntryKind, ErrorCode, PageEntry, Reply, Resolved, WriteFile};

use super::sys::{self, Errno};

/// How every path is resolved: inside the root, no /proc magic links.
pub const RESOLVE: u64 = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
/// Most entries a listing returns.
pub const MAX_ENTRIES: usize = 10_000;
/// Bounds of extended attributes.
const MAX_XATTR_KEY: usize = 255;
const MAX_XATTR_TOTAL: usize = 64 * 1024;

/// A failed file operation: the protocol code and a message with the path.
#[derive(Debug)]
pub struct FsError {
    pub code: ErrorCode,
    pub message: String,
}

impl FsError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> FsError {
        FsError { code, message: message.into() }
    }

    pub fn os(op: &str, path: &str, e: Errno) -> FsError {
        FsError { code: ErrorCode::from_errno(e.0), message: format!("{op} {path}: {e}") }
    }
}

pub type FsResult<T> = Result<T, FsError>;

/// File system ids switched to a user for the guard's lifetime (a no-op
/// for root, whose ids the agent already has).
pub struct FsCreds(bool);

impl FsCreds {
    pub fn switch(uid: u32, gid: u32) -> FsCreds {
        let switched = uid != 0 || gid != 0;
        if switched {
            sys::set_fs_ids(uid, gid);
        }
        FsCreds(switched)
    }
}

impl Drop for FsCreds {
    fn drop(&mut self) {
        if self.0 {
            sys::set_fs_ids(0, 0);
        }
    }
}

fn cpath(path: &str) -> FsResult<CString> {
    CString::new(path).map_err(|_| FsError::new(ErrorCode::InvalidPath, format!("path {path:?} holds NUL")))
}

/// Normalises a request path against `base` (the user's home).
pub fn normalize(path: &str, base: &str) -> FsResult<String> {
    proto::normalize_path(path, base)
        .map_err(|code| FsError::new(code, format!("invalid path {path:?}: empty, too long, or holds NUL or '..'")))
}

fn kind_of(mode: u32) -> EntryKind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryKind::File,
        libc::S_IFDIR => EntryKind::Dir,
        libc::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// The error of a failed rename of `from` to `to`.
fn renamed<'a>(from: &'a str, to: &'a str) -> impl FnOnce(Errno) -> FsError + 'a {
    move |e| FsError::os("rename", &format!("{from} -> {to}"), e)
}

fn is_file(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
}

fn entry(path: String, name: String, st: &libc::stat, target: Option<String>) -> Entry {
    Entry {
        path,
        name,
        kind: kind_of(st.st_mode),
        size: st.st_size as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime_ns: st.st_mtime as i128 * 1_000_000_000 + st.st_mtime_nsec as i128,
        target,
        resolved: None,
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The sandbox's tree, reached through a descriptor of its root.
pub struct Fs {
    root: OwnedFd,
    /// Set while a [`proto::Request::NoFollow`] runs: no symlink anywhere.
    no_follow: Cell<bool>,
}

/// Turns [`Fs`]'s no-follow mode off again when dropped.
pub struct NoFollowGuard<'a>(&'a Fs);

impl Drop for NoFollowGuard<'_> {
    fn drop(&mut self) {
        self.0.no_follow.set(false);
    }
}

impl Fs {
    pub fn new(root: OwnedFd) -> Fs {
        Fs { root, no_follow: Cell::new(false) }
    }

    pub fn root(&self) -> BorrowedFd<'_> {
        self.root.as_fd()
    }

    /// Refuses every symlink on every path until the guard is dropped.
    pub fn no_follow(&self) -> NoFollowGuard<'_> {
        self.no_follow.set(true);
        NoFollowGuard(self)
    }

    fn resolve(&self) -> u64 {
        if self.no_follow.get() {
            RESOLVE | libc::RESOLVE_NO_SYMLINKS
        } else {
            RESOLVE
        }
    }

    /// Opens a normalised absolute path inside the root.
    pub fn open(&self, path: &str, flags: libc::c_int, mode: u32) -> Result<OwnedFd, Errno> {
        let c = CString::new(path).map_err(|_| Errno(libc::EINVAL))?;
        sys::openat2(self.root.as_fd(), &c, flags, mode, self.resolve())
    }

    /// Opens the directory holding `path`'s final component, and that name.
    fn parent(&self, path: &str, op: &str) -> FsResult<(OwnedFd, CString)> {
        let Some((dir, name)) = path.rsplit_once('/').filter(|(_, n)| !n.is_empty()) else {
            return Err(FsError::new(ErrorCode::InvalidRequest, format!("{op} {path}: not allowed on /")));
        };
        let dir = if dir.is_empty() { "/" } else { dir };
        let fd = self.open(dir, libc::O_PATH | libc::O_DIRECTORY, 0).map_err(|e| FsError::os(op, path, e))?;
        Ok((fd, cpath(name)?))
    }

    /// An O_PATH descriptor of a directory, for a working directory or a watch.
    pub fn open_dir(&self, path: &str) -> FsResult<OwnedFd> {
        self.open(path, libc::O_PATH | libc::O_DIRECTORY, 0).map_err(|e| FsError::os("open", path, e))
    }

    /// Opens a regular file without blocking on FIFOs or devices.
    fn open_regular(&self, path: &str, flags: libc::c_int, mode: u32, op: &str) -> FsResult<OwnedFd> {
        let fd =
            self.open(path, flags | libc::O_NONBLOCK | libc::O_NOCTTY, mode).map_err(|e| FsError::os(op, path, e))?;
        let st = sys::fstat(fd.as_fd()).map_err(|e| FsError::os(op, path, e))?;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => Ok(fd),
            libc::S_IFDIR => Err(FsError::new(ErrorCode::IsADirectory, format!("{op} {path}: is a directory"))),
            _ => Err(FsError::new(ErrorCode::InvalidRequest, format!("{op} {path}: not a regular file"))),
        }
    }

    pub fn read_file(&self, path: &str, offset: u64, len: u32) -> FsResult<(Reply, Vec<u8>)> {
        let fd = self.open_regular(path, libc::O_RDONLY, 0, "read")?;
        let size = sys::fstat(fd.as_fd()).map_err(|e| FsError::os("read", path, e))?.st_size as u64;
        let mut want = (len as usize).min(proto::MAX_DATA);
        if size > 0 {
            // Allocate what the file holds, not what was asked for (files
            // in /proc report size 0 and are read as asked).
            want = want.min(size.saturating_sub(offset) as usize);
        }
        let mut buf = vec![0u8; want];
        let mut got = 0;
        while got < want {
            match sys::pread(fd.as_fd(), &mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(Errno(libc::EINTR)) => {}
                Err(e) => return Err(FsError::os("read", path, e)),
            }
        }
        buf.truncate(got);
        let eof = got < want || (size > 0 && offset + got as u64 >= size) || (want == 0 && offset >= size);
        Ok((Reply::Data { eof, size }, buf))
    }

    /// Opens a regular file to pass to the host ([`proto::Request::OpenFile`]):
    /// read-only, or write-only (it must exist). Answers its size and the
    /// descriptor, or no descriptor when its file system is not one whose
    /// descriptors are passed for that access ([`proto::passable`]).
    pub fn open_passed(&self, path: &str, write: bool) -> FsResult<(u64, Option<OwnedFd>)> {
        let (flags, op) = if write { (libc::O_WRONLY, "write") } else { (libc::O_RDONLY, "read") };
        let fd = self.open_regular(path, flags, 0, op)?;
        let size = sys::fstat(fd.as_fd()).map_err(|e| FsError::os(op, path, e))?.st_size as u64;
        let passable = sys::fstatfs_type(fd.as_fd()).is_ok_and(|m| proto::passable(m, write));
        Ok((size, passable.then_some(fd)))
    }

    pub fn write_file(&self, path: &str, w: &WriteFile, data: &[u8]) -> FsResult<Reply> {
        if w.parents {
            if let Some((dir, _)) = path.rsplit_once('/').filter(|(d, _)| !d.is_empty()) {
                self.mkdir_parents(dir)?;
            }
        }
        let mut flags = libc::O_WRONLY | libc::O_CREAT;
        if w.append {
            flags |= libc::O_APPEND;
        }
        let mode = w.mode.unwrap_or(0o644) & 0o7777;
        let fd = self.open_regular(path, flags, mode, "write")?;
        if w.truncate {
            sys::ftruncate(fd.as_fd(), w.offset).map_err(|e| FsError::os("truncate", path, e))?;
        }
        let mut done = 0;
        while done < data.len() {
            let r = if w.append {
                sys::write(std::os::fd::AsRawFd::as_raw_fd(&fd), &data[done..])
            } else {
                sys::pwrite(fd.as_fd(), &data[done..], w.offset + done as u64)
            };
            match r {
                Ok(0) => return Err(FsError::new(ErrorCode::Io, format!("write {path}: no progress"))),
                Ok(n) => done += n,
                Err(Errno(libc::EINTR)) => {}
                Err(e) => return Err(FsError::os("write", path, e)),
            }
        }
        Ok(Reply::Written { len: data.len() as u64 })
    }

    pub fn stat(&self, path: &str) -> FsResult<Entry> {
        if path == "/" {
            let st = sys::fstat(self.root.as_fd()).map_err(|e| FsError::os("stat", path, e))?;
            return Ok(entry("/".into(), "/".into(), &st, None));
        }
        let (dir, name) = self.parent(path, "stat")?;
        let st =
            sys::fstatat(dir.as_fd(), &name, libc::AT_SYMLINK_NOFOLLOW).map_err(|e| FsError::os("stat", path, e))?;
        let target = link_target(dir.as_fd(), &name, &st);
        let name = path.rsplit('/').next().unwrap_or(path).to_string();
        let mut e = entry(path.to_string(), name, &st, target);
        if e.kind == EntryKind::Symlink {
            e.resolved = self.resolve_link(path);
        }
        Ok(e)
    }

    /// Where the symlink at `path` leads, followed to the end inside the
    /// root: the path the kernel reports for the descriptor it opens (the
    /// agent's root is the sandbox's), and what is there.
    fn resolve_link(&self, path: &str) -> Option<Box<Resolved>> {
        let fd = self.open(path, libc::O_PATH, 0).ok()?;
        let st = sys::fstat(fd.as_fd()).ok()?;
        let link = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        let at = std::fs::read_link(link).ok()?;
        let at = at.to_str()?;
        if !at.starts_with('/') || at.ends_with(" (deleted)") {
            return None;
        }
        Some(Box::new(Resolved { path: at.to_owned(), kind: kind_of(st.st_mode), mode: st.st_mode & 0o7777 }))
    }

    /// Whether a directory is on a network file system (NFS, CIFS/SMB,
    /// FUSE), where inotify may report nothing.
    pub fn on_network_mount(dir: BorrowedFd<'_>) -> bool {
        const NETWORK: [i64; 5] = [0x6969, 0xFF53_4D42, 0x517B, 0xFE53_4D42, 0x6573_5546];
        sys::fstatfs_type(dir).is_ok_and(|t| NETWORK.contains(&t))
    }

    /// Lists `path` down to `depth` levels, never descending into symlinks;
    /// at most [`MAX_ENTRIES`], sorted by path, and cut further so that the
    /// reply fits in one frame header.
    pub fn list_dir(&self, path: &str, depth: u32) -> FsResult<Reply> {
        if depth == 0 {
            return Err(FsError::new(ErrorCode::InvalidRequest, "depth must be at least 1"));
        }
        let fd = self.open(path, libc::O_RDONLY | libc::O_DIRECTORY, 0).map_err(|e| FsError::os("list", path, e))?;
        let mut entries = Vec::new();
        let mut truncated = false;
        walk(fd, path, 1, depth, &mut entries, &mut truncated).map_err(|e| FsError::os("list", path, e))?;
        for e in entries.iter_mut().filter(|e| e.kind == EntryKind::Symlink) {
            e.resolved = self.resolve_link(&e.path);
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        if fit_entries(&mut entries) {
            truncated = true;
        }
        Ok(Reply::Entries { entries, truncated })
    }

    /// One page of a listing, see [`proto::Request::ListPage`]. The root
    /// is opened with no symlink followed; entries below it are reached
    /// through directory descriptors opened with `O_NOFOLLOW`.
    pub fn list_page(
        &self,
        path: &str,
        recursive: bool,
        after: Option<&str>,
        limit: u32,
    ) -> FsResult<(Reply, Vec<u8>)> {
        if limit == 0 || limit > proto::MAX_PAGE_ENTRIES {
            return Err(FsError::new(
                ErrorCode::InvalidRequest,
                format!("limit {limit} out of range 1..={}", proto::MAX_PAGE_ENTRIES),
            ));
        }
        let after: Option<Vec<&[u8]>> = match after {
            None => None,
            Some(a) => {
                let parts: Vec<&[u8]> = a.split('/').map(str::as_bytes).collect();
                if a.len() > proto::MAX_PATH || parts.iter().any(|p| p.is_empty() || *p == b"." || *p == b"..") {
                    return Err(FsError::new(ErrorCode::InvalidRequest, format!("invalid resume path {a:?}")));
                }
                Some(parts)
            }
        };
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        let c = cpath(path)?;
        let fd = sys::openat2(self.root.as_fd(), &c, flags, 0, RESOLVE | libc::RESOLVE_NO_SYMLINKS)
            .map_err(|e| FsError::os("list", path, e))?;
        // Listing needs search permission too: look up "." through it.
        sys::openat(fd.as_fd(), c".", libc::O_PATH | libc::O_DIRECTORY, 0).map_err(|e| FsError::os("list", path, e))?;
        let mut page = Page { data: vec![b'['], count: 0, limit: limit as usize, more: false, skipped: 0 };
        walk_page(&fd, "", after.as_deref(), recursive, &mut page).map_err(|e| FsError::os("list", path, e))?;
        page.data.push(b']');
        Ok((Reply::Page { more: page.more, skipped: page.skipped }, page.data))
    }

    /// Sets permission bits, refusing a symlink as the final component.
    pub fn chmod(&self, path: &str, mode: u32) -> FsResult<Reply> {
        let (dir, name) = self.parent(path, "chmod")?;
        let st =
            sys::fstatat(dir.as_fd(), &name, libc::AT_SYMLINK_NOFOLLOW).map_err(|e| FsError::os("chmod", path, e))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(FsError::new(ErrorCode::SymlinkRefused, format!("chmod {path}: is a symlink")));
        }
        sys::fchmodat(dir.as_fd(), &name, mode & 0o7777).map_err(|e| FsError::os("chmod", path, e))?;
        Ok(Reply::Ok)
    }

    pub fn mkdir(&self, path: &str, parents: bool) -> FsResult<Reply> {
        if parents {
            return Ok(Reply::Created { created: self.mkdir_parents(path)? });
        }
        let (dir, name) = self.parent(path, "mkdir")?;
        sys::mkdirat(dir.as_fd(), &name, 0o755).map_err(|e| FsError::os("mkdir", path, e))?;
        Ok(Reply::Created { created: true })
    }

    /// `mkdir -p`: whether the last component was created.
    fn mkdir_parents(&self, path: &str) -> FsResult<bool> {
        let mut created = false;
        let mut prefix = String::with_capacity(path.len());
        for part in path.split('/').filter(|p| !p.is_empty()) {
            prefix.push('/');
            prefix.push_str(part);
            let (dir, name) = self.parent(&prefix, "mkdir")?;
            created = match sys::mkdirat(dir.as_fd(), &name, 0o755) {
                Ok(()) => true,
                Err(Errno(libc::EEXIST)) => {
                    let flags = if self.no_follow.get() { libc::AT_SYMLINK_NOFOLLOW } else { 0 };
                    let st = sys::fstatat(dir.as_fd(), &name, flags).map_err(|e| FsError::os("mkdir", &prefix, e))?;
                    if !is_dir(&st) {
                        return Err(FsError::new(
                            ErrorCode::AlreadyExists,
                            format!("mkdir {prefix}: exists and is not a directory"),
                        ));
                    }
                    false
                }
                Err(e) => return Err(FsError::os("mkdir", &prefix, e)),
            };
        }
        Ok(created)
    }

    pub fn rename(&self, from: &str, to: &str) -> FsResult<Reply> {
        let (from_dir, from_name) = self.parent(from, "rename")?;
        let (to_dir, to_name) = self.parent(to, "rename")?;
        sys::renameat(from_dir.as_fd(), &from_name, to_dir.as_fd(), &to_name).map_err(renamed(from, to))?;
        Ok(Reply::Ok)
    }

    /// Puts the upload temporary `from` in place of `to`, as [`Fs::rename`]
    /// does, except that a regular file at `to` on the same file system
    /// (an overlay's upper layer, not a file of the image below) is
    /// swapped out (`RENAME_EXCHANGE`) and then removed. The result is the
    /// same, and readers see the old file or the new one either way; but
    /// btrfs, when a rename replaces a file, starts writing back all of
    /// the new file's data before it returns (1.6 to 2.3 s for 1 GiB on
    /// the daemon's storage here), and a swap does not. A file of the
    /// image is left to the rename: a swap would first copy it up.
    pub fn commit(&self, from: &str, to: &str) -> FsResult<Reply> {
        let (from_dir, from_name) = self.parent(from, "rename")?;
        let (to_dir, to_name) = self.parent(to, "rename")?;
        let (fd, td) = (from_dir.as_fd(), to_dir.as_fd());
        let stat = |dir, name| sys::fstatat(dir, name, libc::AT_SYMLINK_NOFOLLOW).ok();
        let swap = match (stat(fd, &from_name), stat(td, &to_name)) {
            (Some(new), Some(old)) => is_file(&new) && is_file(&old) && new.st_dev == old.st_dev,
            _ => false,
        };
        if swap && sys::renameat2(fd, &from_name, td, &to_name, libc::RENAME_EXCHANGE).is_ok() {
            // `from` now names the old file. Should it not be one any more
            // (the sandbox raced a directory in) or stay, swap back and let
            // the rename answer as it would have.
            if sys::unlinkat(fd, &from_name, 0).is_ok() {
                return Ok(Reply::Ok);
            }
            sys::renameat2(fd, &from_name, td, &to_name, libc::RENAME_EXCHANGE).map_err(renamed(from, to))?;
        }
        sys::renameat(fd, &from_name, td, &to_name).map_err(renamed(from, to))?;
        Ok(Reply::Ok)
    }

    /// Removes a file, or a directory and everything below it, without
    /// following any symlink.
    pub fn remove(&self, path: &str) -> FsResult<Reply> {
        let (dir, name) = self.parent(path, "remove")?;
        let st =
            sys::fstatat(dir.as_fd(), &name, libc::AT_SYMLINK_NOFOLLOW).map_err(|e| FsError::os("remove", path, e))?;
        let r = if is_dir(&st) { remove_tree(dir.as_fd(), &name) } else { sys::unlinkat(dir.as_fd(), &name, 0) };
        r.map_err(|e| FsError::os("remove", path, e))?;
        Ok(Reply::Ok)
    }

    /// Opens a file or directory whose extended attributes are wanted.
    fn open_for_xattrs(&self, path: &str) -> FsResult<OwnedFd> {
        self.open(path, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY, 0)
            .map_err(|e| FsError::os("xattr", path, e))
    }

    pub fn set_xattrs(&self, path: &str, attrs: &BTreeMap<String, String>) -> FsResult<Reply> {
        let mut total = 0;
        let mut checked = Vec::with_capacity(attrs.len());
        for (k, v) in attrs {
            if !k.starts_with("user.") || k.len() <= 5 || k.len() > MAX_XATTR_KEY {
                return Err(FsError::new(
                    ErrorCode::InvalidRequest,
                    format!("xattr key {k:?}: must be user.<name>, at most {MAX_XATTR_KEY} bytes"),
                ));
            }
            total += k.len() + v.len();
            let key = CString::new(k.as_str())
                .map_err(|_| FsError::new(ErrorCode::InvalidRequest, format!("xattr key {k:?} holds NUL")))?;
            checked.push((key, v.as_bytes()));
        }
        if total > MAX_XATTR_TOTAL {
            return Err(FsError::new(
                ErrorCode::InvalidRequest,
                format!("xattrs of {total} bytes exceed {MAX_XATTR_TOTAL}"),
            ));
        }
        let fd = self.open_for_xattrs(path)?;
        for (key, value) in checked {
            sys::fsetxattr(fd.as_fd(), &key, value).map_err(|e| FsError::os("setxattr", path, e))?;
        }
        Ok(Reply::Ok)
    }

    pub fn get_xattrs(&self, path: &str) -> FsResult<Reply> {
        let fd = self.open_for_xattrs(path)?;
        let mut names = vec![0u8; MAX_XATTR_TOTAL];
        let n = sys::flistxattr(fd.as_fd(), &mut names).map_err(|e| FsError::os("listxattr", path, e))?;
        let mut attrs = BTreeMap::new();
        let mut total = 0;
        let mut value = vec![0u8; MAX_XATTR_TOTAL];
        for raw in names[..n].split(|&b| b == 0) {
            if !raw.starts_with(b"user.") {
                continue;
            }
            let Ok(key) = CString::new(raw) else { continue };
            let len = match sys::fgetxattr(fd.as_fd(), &key, &mut value) {
                Ok(len) => len,
                Err(Errno(libc::ENODATA)) => continue,
                Err(e) => return Err(FsError::os("getxattr", path, e)),
            };
            total += raw.len() + len;
            if total > MAX_XATTR_TOTAL {
                return Err(FsError::new(ErrorCode::Io, format!("xattrs of {path} exceed {MAX_XATTR_TOTAL} bytes")));
            }
            attrs
                .insert(String::from_utf8_lossy(raw).into_owned(), String::from_utf8_lossy(&value[..len]).into_owned());
        }
        Ok(Reply::Xattrs { attrs })
    }
}

fn link_target(dir: BorrowedFd<'_>, name: &CString, st: &libc::stat) -> Option<String> {
    if st.st_mode & libc::S_IFMT != libc::S_IFLNK {
        return None;
    }
    sys::readlinkat(dir, name).ok().map(|t| String::from_utf8_lossy(&t).into_owned())
}

/// Depth-first listing below an open directory.
fn walk(
    dir: OwnedFd,
    path: &str,
    level: u32,
    depth: u32,
    out: &mut Vec<Entry>,
    truncated: &mut bool,
) -> Result<(), Errno> {
    for d in sys::read_dir(dir.as_fd())? {
        if out.len() >= MAX_ENTRIES {
            *truncated = true;
            return Ok(());
        }
        let Ok(st) = sys::fstatat(dir.as_fd(), &d.name, libc::AT_SYMLINK_NOFOLLOW) else { continue };
        let name = String::from_utf8_lossy(d.name.as_bytes()).into_owned();
        let child = join(path, &name);
        let target = link_target(dir.as_fd(), &d.name, &st);
        out.push(entry(child.clone(), name, &st, target));
        if is_dir(&st) && level < depth {
            let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
            if let Ok(sub) = sys::openat(dir.as_fd(), &d.name, flags, 0) {
                walk(sub, &child, level + 1, depth, out, truncated)?;
                if *truncated {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// A page being filled: the JSON array so far and its bounds.
struct Page {
    data: Vec<u8>,
    count: usize,
    limit: usize,
    more: bool,
    skipped: u64,
}

impl Page {
    /// Adds an entry; false when the page is full (and `more` is set).
    fn push(&mut self, e: &PageEntry) -> bool {
        let Ok(bytes) = serde_json::to_vec(e) else { return true };
        if self.count >= self.limit || self.data.len() + bytes.len() + 2 > proto::MAX_DATA {
            self.more = true;
            return false;
        }
        if self.count > 0 {
            self.data.push(b',');
        }
        self.data.extend_from_slice(&bytes);
        self.count += 1;
        true
    }
}

/// Whether the user can list a directory: read it and search it.
fn open_listable(dir: BorrowedFd<'_>, name: &CString) -> Result<Option<OwnedFd>, Errno> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    let sub = match sys::openat(dir, name, flags, 0) {
        Ok(sub) => sub,
        Err(Errno(libc::EACCES)) | Err(Errno(libc::EPERM)) => return Ok(None),
        Err(e) => return Err(e),
    };
    match sys::openat(sub.as_fd(), c".", libc::O_PATH | libc::O_DIRECTORY, 0) {
        Ok(_) => Ok(Some(sub)),
        Err(Errno(libc::EACCES)) | Err(Errno(libc::EPERM)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Depth-first listing in [`proto::cmp_paths`] order: each directory's
/// names sorted by bytes, a directory before its contents. `after` holds the
/// remaining elements of the resume path below this directory. Returns
/// false once the page is full.
fn walk_page(
    dir: &OwnedFd,
    rel: &str,
    after: Option<&[&[u8]]>,
    recursive: bool,
    page: &mut Page,
) -> Result<bool, Errno> {
    let mut names: Vec<CString> = sys::read_dir(dir.as_fd())?.into_iter().map(|d| d.name).collect();
    names.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    for name in names {
        let (emit, below) = match after {
            Some([first, rest @ ..]) => match name.as_bytes().cmp(first) {
                std::cmp::Ordering::Less => continue,
                std::cmp::Ordering::Equal => (false, if rest.is_empty() { None } else { Some(rest) }),
                std::cmp::Ordering::Greater => (true, None),
            },
            _ => (true, None),
        };
        let Ok(utf8) = std::str::from_utf8(name.as_bytes()) else {
            if emit {
                page.skipped += 1;
            }
            continue;
        };
        let child = if rel.is_empty() { utf8.to_string() } else { format!("{rel}/{utf8}") };
        if child.len() > proto::MAX_PATH {
            if emit {
                page.skipped += 1;
            }
            continue;
        }
        let st = match sys::fstatat(dir.as_fd(), &name, libc::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno(libc::ENOENT)) => continue,
            Err(e) => return Err(e),
        };
        let (sub, unreadable) = if is_dir(&st) {
            match open_listable(dir.as_fd(), &name) {
                Ok(Some(sub)) => (Some(sub), false),
                Ok(None) => (None, true),
                Err(Errno(libc::ENOENT)) | Err(Errno(libc::ENOTDIR)) | Err(Errno(libc::ELOOP)) => continue,
                Err(e) => return Err(e),
            }
        } else {
            (None, false)
        };
        if emit {
            let kind = kind_of(st.st_mode);
            let e = PageEntry {
                path: child.clone(),
                kind,
                size: if kind == EntryKind::File { st.st_size as u64 } else { 0 },
                mode: st.st_mode & 0o7777,
                uid: st.st_uid,
                gid: st.st_gid,
                mtime_ns: (st.st_mtime as i128 * 1_000_000_000 + st.st_mtime_nsec as i128)
                    .clamp(i64::MIN as i128, i64::MAX as i128) as i64,
                target: link_target(dir.as_fd(), &name, &st),
                unreadable,
            };
            if !page.push(&e) {
                return Ok(false);
            }
        }
        if recursive {
            if let Some(sub) = sub {
                if !walk_page(&sub, &child, below, recursive, page)? {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// Cuts `entries` so that a reply holding them fits in one frame header;
/// returns whether anything was cut.
fn fit_entries(entries: &mut Vec<Entry>) -> bool {
    // Room for `{"kind":"reply","id":..,"reply":{"type":"entries",...,"truncated":true}}`.
    let budget = proto::MAX_HEADER - 256;
    let mut used = 0;
    for (i, e) in entries.iter().enumerate() {
        used += serde_json::to_vec(e).map(|v| v.len() + 1).unwrap_or(budget);
        if used > budget {
            entries.truncate(i);
            return true;
        }
    }
    false
}

/// Removes the directory `name` in `parent` and everything below it.
fn remove_tree(parent: BorrowedFd<'_>, name: &CString) -> Result<(), Errno> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    match sys::openat(parent, name, flags, 0) {
        Ok(dir) => {
            for d in sys::read_dir(dir.as_fd())? {
                let st = match sys::fstatat(dir.as_fd(), &d.name, libc::AT_SYMLINK_NOFOLLOW) {
                    Ok(st) => st,
                    Err(Errno(libc::ENOENT)) => continue,
                    Err(e) => return Err(e),
                };
                let r = if is_dir(&st) {
                    remove_tree(dir.as_fd(), &d.name)
                } else {
                    sys::unlinkat(dir.as_fd(), &d.name, 0)
                };
                match r {
                    Ok(()) | Err(Errno(libc::ENOENT)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Err(Errno(libc::ENOENT)) => return Ok(()),
        Err(e) => return Err(e),
    }
    sys::unlinkat(parent, name, libc::AT_REMOVEDIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_does_not_double_the_root_slash() {
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/a", "b"), "/a/b");
    }

    #[test]
    fn entries_are_cut_to_fit_one_header() {
        let st: libc::stat = {
            // SAFETY: stat is plain data; all-zero is a valid value.
            unsafe { std::mem::zeroed() }
        };
        let mut entries: Vec<Entry> =
            (0..5000).map(|i| entry(format!("/some/longish/path/{i:06}"), format!("{i:06}"), &st, None)).collect();
        assert!(fit_entries(&mut entries));
        assert!(!entries.is_empty());
        let reply = proto::FromAgent::Reply { id: u64::MAX, reply: Reply::Entries { entries, truncated: true } };
        let mut out = Vec::new();
        proto::encode(&reply, &[], &mut out).expect("fits in a header");
    }

    /// The names of the rename events queued on inotify descriptor `fd`
    /// (`IN_MOVED_FROM` or `IN_MOVED_TO` and the name).
    fn moves(fd: &OwnedFd) -> Vec<(bool, String)> {
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf is valid for writes of its length.
        let n = unsafe { libc::read(std::os::fd::AsRawFd::as_raw_fd(fd), buf.as_mut_ptr().cast(), buf.len()) };
        let mut out = Vec::new();
        let mut at = 0usize;
        let head = std::mem::size_of::<libc::inotify_event>();
        while n > 0 && at + head <= n as usize {
            // SAFETY: the kernel wrote whole events; read_unaligned copes
            // with the buffer's alignment.
            let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            let name = &buf[at + head..at + head + ev.len as usize];
            let name = String::from_utf8_lossy(name.split(|b| *b == 0).next().unwrap_or_default()).into_owned();
            if ev.mask & (libc::IN_MOVED_FROM | libc::IN_MOVED_TO) != 0 {
                out.push((ev.mask & libc::IN_MOVED_FROM != 0, name));
            }
            at += head + ev.len as usize;
        }
        out
    }

    #[test]
    fn a_commit_swaps_out_the_file_it_replaces_and_removes_it() {
        let dir = std::env::temp_dir().join(format!("hutch-commit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("d/sub")).expect("mkdir");
        let fs = Fs::new(
            sys::open(&cpath(dir.to_str().expect("utf-8")).expect("path"), libc::O_PATH | libc::O_DIRECTORY)
                .expect("root"),
        );
        let ino = |p: &str| std::fs::metadata(dir.join(p)).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).ok();
        std::fs::write(dir.join("d/f"), b"old").expect("old");
        std::fs::hard_link(dir.join("d/f"), dir.join("keep")).expect("link");
        std::fs::write(dir.join("d/.tmp1"), b"new").expect("new");
        let new_ino = ino("d/.tmp1");
        // SAFETY: inotify_init1 makes a descriptor we then own.
        let watch = unsafe {
            <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC))
        };
        let d = CString::new(dir.join("d").to_str().expect("utf-8")).expect("path");
        // SAFETY: d is NUL-terminated; watch is an inotify descriptor.
        let added =
            unsafe { libc::inotify_add_watch(std::os::fd::AsRawFd::as_raw_fd(&watch), d.as_ptr(), libc::IN_MOVE) };
        assert!(added >= 0, "inotify_add_watch");

        assert!(matches!(fs.commit("/d/.tmp1", "/d/f"), Ok(Reply::Ok)));
        assert_eq!(std::fs::read(dir.join("d/f")).expect("read"), b"new");
        assert_eq!(ino("d/f"), new_ino, "the temporary itself is in place");
        assert!(!dir.join("d/.tmp1").exists(), "the old file is gone from the temporary's name");
        assert_eq!(std::fs::read(dir.join("keep")).expect("keep"), b"old", "the old file was not written over");
        // A swap: the old file moved to the temporary's name first.
        let names = |v: &[(bool, &str)]| v.iter().map(|(f, n)| (*f, n.to_string())).collect::<Vec<_>>();
        assert_eq!(moves(&watch), names(&[(true, ".tmp1"), (false, "f"), (true, "f"), (false, ".tmp1")]));

        // Nothing to replace, or a directory: a rename, as it answers.
        std::fs::write(dir.join("d/.tmp2"), b"2").expect("tmp2");
        assert!(matches!(fs.commit("/d/.tmp2", "/d/g"), Ok(Reply::Ok)));
        assert_eq!(std::fs::read(dir.join("d/g")).expect("g"), b"2");
        assert_eq!(moves(&watch), names(&[(true, ".tmp2"), (false, "g")]));
        std::fs::write(dir.join("d/.tmp3"), b"3").expect("tmp3");
        assert_eq!(fs.commit("/d/.tmp3", "/d/sub").map(|_| ()).map_err(|e| e.code), Err(ErrorCode::IsADirectory));
        assert_eq!(std::fs::read(dir.join("d/.tmp3")).expect("tmp3 stays"), b"3");
        assert!(dir.join("d/sub").is_dir());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_file_on_tmpfs_is_passed_for_reading_only() {
        let shm = std::path::Path::new("/dev/shm");
        let magic = sys::fstatfs_type(sys::open(c"/dev/shm", libc::O_PATH).expect("/dev/shm").as_fd()).expect("statfs");
        assert_eq!(magic, proto::TMPFS_MAGIC, "/dev/shm is a tmpfs on these hosts");
        let name = format!("hutch-passed-{}", std::process::id());
        std::fs::write(shm.join(&name), b"x").expect("write");
        let fs = Fs::new(sys::open(c"/dev/shm", libc::O_PATH | libc::O_DIRECTORY).expect("root"));
        let path = format!("/{name}");
        let passed = |write| fs.open_passed(&path, write).map(|(size, fd)| (size, fd.is_some())).map_err(|e| e.code);
        assert_eq!(passed(false), Ok((1, true)));
        assert_eq!(passed(true), Ok((1, false)));
        std::fs::remove_file(shm.join(&name)).expect("cleanup");
    }

    #[test]
    fn normalize_reports_invalid_path() {
        assert_eq!(normalize("../x", "/home/u").map_err(|e| e.code).err(), Some(ErrorCode::InvalidPath));
        assert_eq!(normalize("x", "/home/u").ok().as_deref(), Some("/home/u/x"));
    }
}
