//! Extraction of untrusted layer tars into a layer directory, in overlayfs
//! form, without any path ever leaving the layer root.
//!
//! Every entry is placed relative to the layer root by walking its parent
//! directories one component at a time with `openat(O_DIRECTORY |
//! O_NOFOLLOW)` from the root's descriptor, so no symlink (one from this
//! layer or any other) is ever followed, and files are created with
//! `O_CREAT | O_EXCL | O_NOFOLLOW`. Names that are absolute or hold `..`
//! are refused, and so is a parent that is a symlink or a file. Hard links
//! must name an entry already extracted into the same root. Whiteouts
//! (`.wh.NAME`) become 0:0 character devices named NAME in the same
//! directory, and `.wh..wh..opq` marks its directory opaque
//! (`trusted.overlay.opaque=y`). Device nodes other than whiteouts are left
//! out (they would be usable: the overlay is not mounted nodev) and xattrs
//! are not applied (no file capabilities, no overlay metadata from outside).
//! Setuid and setgid bits are kept: sandboxes mount their root nosuid, and
//! the store is 0700 so no host user can reach the files.
//!
//! Anything malformed, hostile or beyond the [`Limits`] refuses the whole
//! layer: the caller removes the directory and commits nothing.

use super::{ImageError, ImageStore};
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::ffi::CString;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::rc::Rc;

/// Deepest path a layer may hold, in components.
pub const MAX_DEPTH: usize = 128;
/// Ids of an image: 0 to 65535, the range each sandbox maps.
pub const MAX_ID: u32 = 65536;
/// Longest name of one component, and of a whole path or link target.
const MAX_COMPONENT: usize = 255;
const MAX_PATH: usize = 4096;

/// Bounds on one layer.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Entries in the tar.
    pub max_entries: u64,
    /// Bytes of the uncompressed tar (so a gzip bomb stops here).
    pub max_bytes: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_entries: 1_000_000, max_bytes: 16 << 30 }
    }
}

/// What an extraction did besides writing the files.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub entries: u64,
    /// Device nodes left out.
    pub devices_skipped: u64,
}

fn refuse(msg: impl Into<String>) -> ImageError {
    ImageError::LayerRefused(msg.into())
}

fn show(path: &[u8]) -> String {
    String::from_utf8_lossy(&path[..path.len().min(200)]).into_owned()
}

/// Splits a tar entry name into its components: `./` prefixes, empty and
/// `.` components are dropped; absolute names, `..`, and names beyond the
/// bounds are refused. An empty result names the layer root.
pub fn components(name: &[u8]) -> Result<Vec<&[u8]>, String> {
    if name.len() > MAX_PATH {
        return Err(format!("{}...: name longer than {MAX_PATH} bytes", show(name)));
    }
    if name.first() == Some(&b'/') {
        return Err(format!("{}: absolute names are not allowed", show(name)));
    }
    if name.contains(&0) {
        return Err(format!("{}: NUL in name", show(name)));
    }
    let mut out = Vec::new();
    for c in name.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(format!("{}: `..` is not allowed in names", show(name))),
            c if c.len() > MAX_COMPONENT => {
                return Err(format!("{}: a component is longer than {MAX_COMPONENT} bytes", show(name)))
            }
            c => out.push(c),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(format!("{}: deeper than {MAX_DEPTH} components", show(name)));
    }
    Ok(out)
}

// ---- thin system-call wrappers on directory descriptors ----

fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn openat(dir: RawFd, name: &[u8], flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let c = cstring(name)?;
    // SAFETY: c is a valid C string; the result is checked and owned below.
    let fd = unsafe { libc::openat(dir, c.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and belongs to nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_dir(dir: RawFd, name: &[u8]) -> io::Result<OwnedFd> {
    openat(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
}

fn mkdirat(dir: RawFd, name: &[u8], mode: libc::mode_t) -> io::Result<()> {
    let c = cstring(name)?;
    // SAFETY: c is a valid C string.
    check(unsafe { libc::mkdirat(dir, c.as_ptr(), mode) })
}

fn mknodat(dir: RawFd, name: &[u8], mode: libc::mode_t, dev: libc::dev_t) -> io::Result<()> {
    let c = cstring(name)?;
    // SAFETY: c is a valid C string.
    check(unsafe { libc::mknodat(dir, c.as_ptr(), mode, dev) })
}

fn symlinkat(target: &[u8], dir: RawFd, name: &[u8]) -> io::Result<()> {
    let (t, c) = (cstring(target)?, cstring(name)?);
    // SAFETY: both are valid C strings.
    check(unsafe { libc::symlinkat(t.as_ptr(), dir, c.as_ptr()) })
}

fn linkat(from_dir: RawFd, from: &[u8], to_dir: RawFd, to: &[u8]) -> io::Result<()> {
    let (f, t) = (cstring(from)?, cstring(to)?);
    // SAFETY: both are valid C strings; flags 0: a symlink is linked itself, never followed.
    check(unsafe { libc::linkat(from_dir, f.as_ptr(), to_dir, t.as_ptr(), 0) })
}

fn unlinkat(dir: RawFd, name: &[u8], flags: libc::c_int) -> io::Result<()> {
    let c = cstring(name)?;
    // SAFETY: c is a valid C string.
    check(unsafe { libc::unlinkat(dir, c.as_ptr(), flags) })
}

fn fchownat_nofollow(dir: RawFd, name: &[u8], uid: u32, gid: u32) -> io::Result<()> {
    let c = cstring(name)?;
    // SAFETY: c is a valid C string; AT_SYMLINK_NOFOLLOW changes the entry itself.
    check(unsafe { libc::fchownat(dir, c.as_ptr(), uid, gid, libc::AT_SYMLINK_NOFOLLOW) })
}

fn fchown(fd: RawFd, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: no memory is involved.
    check(unsafe { libc::fchown(fd, uid, gid) })
}

fn fchmod(fd: RawFd, mode: u32) -> io::Result<()> {
    // SAFETY: no memory is involved.
    check(unsafe { libc::fchmod(fd, mode) })
}

fn futimens_mtime(fd: RawFd, mtime: u64) -> io::Result<()> {
    let t = libc::timespec { tv_sec: mtime.min(i64::MAX as u64) as libc::time_t, tv_nsec: 0 };
    let times = [t, t];
    // SAFETY: times points to two valid timespecs.
    check(unsafe { libc::futimens(fd, times.as_ptr()) })
}

/// The type of `name` in `dir` (without following it), or None.
fn lstat_at(dir: RawFd, name: &[u8]) -> io::Result<Option<libc::stat>> {
    let c = cstring(name)?;
    // SAFETY: zeroed stat is a valid out-buffer for fstatat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string and st a valid out-pointer.
    let r = unsafe { libc::fstatat(dir, c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOENT) { Ok(None) } else { Err(e) };
    }
    Ok(Some(st))
}

const OPAQUE: &[u8] = b"trusted.overlay.opaque\0";

fn set_opaque(fd: RawFd) -> io::Result<()> {
    // SAFETY: the name is NUL-terminated and the value one valid byte.
    check(unsafe { libc::fsetxattr(fd, OPAQUE.as_ptr().cast(), b"y".as_ptr().cast(), 1, 0) })
}

/// Whether the directory at `path` is marked opaque.
pub fn get_opaque(path: &Path) -> io::Result<bool> {
    let c = crate::launch::cstr(path)?;
    let mut v = [0u8; 4];
    // SAFETY: c and the name are valid C strings; v is a valid buffer of its length.
    let n = unsafe { libc::lgetxattr(c.as_ptr(), OPAQUE.as_ptr().cast(), v.as_mut_ptr().cast(), v.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::EOPNOTSUPP) => Ok(false),
            _ => Err(e),
        };
    }
    Ok(n == 1 && v[0] == b'y')
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// A layer root being filled, and the last parent directory used (entries
/// come mostly grouped by directory).
struct Root {
    fd: OwnedFd,
    cached: Option<(Vec<Vec<u8>>, OwnedFd)>,
}

impl Root {
    /// The directory `comps` inside the root, walked without following
    /// anything; missing directories are made (root-owned, 0755) when
    /// `create`. A symlink or file on the way refuses the entry.
    fn dir(&mut self, comps: &[&[u8]], create: bool, entry: &[u8]) -> Result<RawFd, ImageError> {
        if comps.is_empty() {
            return Ok(self.fd.as_raw_fd());
        }
        if let Some((path, fd)) = &self.cached {
            if path.len() == comps.len() && path.iter().zip(comps).all(|(a, b)| a.as_slice() == *b) {
                return Ok(fd.as_raw_fd());
            }
        }
        let mut cur: Option<OwnedFd> = None;
        for c in comps {
            let at = cur.as_ref().map_or(self.fd.as_raw_fd(), |f| f.as_raw_fd());
            let next = match open_dir(at, c) {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) && create => {
                    mkdirat(at, c, 0o755).map_err(|e| refuse(format!("{}: mkdir: {e}", show(entry))))?;
                    open_dir(at, c).map_err(|e| refuse(format!("{}: {e}", show(entry))))?
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    return Err(refuse(format!(
                        "{}: {:?} is not in this layer",
                        show(entry),
                        String::from_utf8_lossy(c)
                    )))
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOTDIR)) => {
                    return Err(refuse(format!(
                        "{}: its parent {:?} is a symlink or not a directory; nothing is written through it",
                        show(entry),
                        String::from_utf8_lossy(c)
                    )))
                }
                Err(e) => return Err(refuse(format!("{}: {e}", show(entry)))),
            };
            cur = Some(next);
        }
        let fd = cur.expect("comps is not empty");
        self.cached = Some((comps.iter().map(|c| c.to_vec()).collect(), fd));
        Ok(self.cached.as_ref().map(|(_, f)| f.as_raw_fd()).expect("just cached"))
    }
}

/// Makes room for a non-directory `name` in `dir`: an existing file, link
/// or node is replaced (a later tar entry wins); a directory is not.
fn clear_for_file(dir: RawFd, name: &[u8], entry: &[u8]) -> Result<(), ImageError> {
    match lstat_at(dir, name) {
        Ok(None) => Ok(()),
        Ok(Some(st)) if is_dir(&st) => {
            Err(refuse(format!("{}: would replace a directory with a non-directory", show(entry))))
        }
        Ok(Some(_)) => unlinkat(dir, name, 0).map_err(|e| refuse(format!("{}: {e}", show(entry)))),
        Err(e) => Err(refuse(format!("{}: {e}", show(entry)))),
    }
}

/// Extracts the uncompressed tar `tar` into `root` (an existing, empty,
/// trusted directory).
pub fn extract_tar<R: Read>(tar: R, root: &Path, limits: &Limits) -> Result<Stats, ImageError> {
    let rootfd = open_dir(libc::AT_FDCWD, root.as_os_str().as_encoded_bytes())
        .map_err(super::io_err(format!("open {}", root.display())))?;
    let mut root = Root { fd: rootfd, cached: None };
    let mut stats = Stats::default();
    let mut archive = tar::Archive::new(tar);
    let entries = archive.entries().map_err(|e| refuse(format!("malformed tar: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| refuse(format!("malformed tar: {e}")))?;
        stats.entries += 1;
        if stats.entries > limits.max_entries {
            return Err(refuse(format!("more than {} entries", limits.max_entries)));
        }
        let name = entry.path_bytes().into_owned();
        let size = entry.header().size().map_err(|e| refuse(format!("{}: bad size: {e}", show(&name))))?;
        if size > limits.max_bytes {
            return Err(refuse(format!("{}: {size} bytes, more than the layer may hold", show(&name))));
        }
        extract_entry(&mut root, &mut entry, &name, &mut stats)?;
    }
    Ok(stats)
}

fn extract_entry<R: Read>(
    root: &mut Root,
    entry: &mut tar::Entry<R>,
    name: &[u8],
    stats: &mut Stats,
) -> Result<(), ImageError> {
    use tar::EntryType as T;
    let header = entry.header();
    let kind = header.entry_type();
    if matches!(kind, T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink) {
        return Ok(());
    }
    let comps = components(name).map_err(refuse)?;
    let bad = |what: &'static str| move |e: io::Error| refuse(format!("{}: {what}: {e}", show(name)));
    let mode = header.mode().map_err(bad("mode"))? & 0o7777;
    let uid = header.uid().map_err(bad("uid"))?;
    let gid = header.gid().map_err(bad("gid"))?;
    if uid >= u64::from(MAX_ID) || gid >= u64::from(MAX_ID) {
        return Err(refuse(format!("{}: owner {uid}:{gid} is outside the image's ids (0 to 65535)", show(name))));
    }
    let (uid, gid) = (uid as u32, gid as u32);
    let Some((&last, parents)) = comps.split_last() else {
        // The layer root itself: its metadata is ours.
        return if kind == T::Directory { Ok(()) } else { Err(refuse(format!("{}: names the root", show(name)))) };
    };

    // Whiteouts first: they are named by their file name, whatever their type.
    if let Some(hidden) = last.strip_prefix(b".wh.") {
        let dir = root.dir(parents, true, name)?;
        if hidden == b".wh..opq" {
            return set_opaque(dir).map_err(bad("mark opaque"));
        }
        if hidden.starts_with(b".wh.") {
            // Other AUFS metadata (.wh..wh.plnk and the like): not content.
            return Ok(());
        }
        if hidden.is_empty() || hidden == b"." || hidden == b".." {
            return Err(refuse(format!("{}: a whiteout must name an entry of its directory", show(name))));
        }
        clear_for_file(dir, hidden, name)?;
        return mknodat(dir, hidden, libc::S_IFCHR, 0).map_err(bad("whiteout"));
    }

    let dir = root.dir(parents, true, name)?;
    match kind {
        T::Directory => {
            match lstat_at(dir, last).map_err(bad("stat"))? {
                Some(st) if is_dir(&st) => {}
                Some(_) => {
                    unlinkat(dir, last, 0).map_err(bad("replace"))?;
                    mkdirat(dir, last, 0o700).map_err(bad("mkdir"))?;
                }
                None => mkdirat(dir, last, 0o700).map_err(bad("mkdir"))?,
            }
            let fd = open_dir(dir, last).map_err(bad("open"))?;
            fchown(fd.as_raw_fd(), uid, gid).map_err(bad("chown"))?;
            fchmod(fd.as_raw_fd(), mode).map_err(bad("chmod"))?;
        }
        T::Regular | T::Continuous => {
            clear_for_file(dir, last, name)?;
            let fd = openat(dir, last, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600).map_err(bad("create"))?;
            let mut file = fs::File::from(fd);
            io::copy(entry, &mut file).map_err(|e| match e.get_ref().and_then(|i| i.downcast_ref::<Bounded>()) {
                Some(b) => refuse(format!("{}: {b}", show(name))),
                None => refuse(format!("{}: write: {e}", show(name))),
            })?;
            fchown(file.as_raw_fd(), uid, gid).map_err(bad("chown"))?;
            // After the chown, which clears setuid bits.
            fchmod(file.as_raw_fd(), mode).map_err(bad("chmod"))?;
            let mtime = entry.header().mtime().unwrap_or(0);
            futimens_mtime(file.as_raw_fd(), mtime).map_err(bad("utimes"))?;
        }
        T::Symlink => {
            let target =
                entry.link_name_bytes().ok_or_else(|| refuse(format!("{}: symlink without target", show(name))))?;
            if target.is_empty() || target.len() >= MAX_PATH || target.contains(&0) {
                return Err(refuse(format!("{}: bad symlink target", show(name))));
            }
            clear_for_file(dir, last, name)?;
            symlinkat(&target, dir, last).map_err(bad("symlink"))?;
            fchownat_nofollow(dir, last, uid, gid).map_err(bad("chown"))?;
        }
        T::Link => {
            let target =
                entry.link_name_bytes().ok_or_else(|| refuse(format!("{}: hard link without target", show(name))))?;
            let tcomps = components(&target).map_err(|e| refuse(format!("{}: hard link to {e}", show(name))))?;
            let Some((&tlast, tparents)) = tcomps.split_last() else {
                return Err(refuse(format!("{}: hard link to the root", show(name))));
            };
            // Resolve the target first (it must already be in this layer),
            // then the link's own parent, which may replace the cache.
            let tdir = root.dir(tparents, false, name)?;
            let tdir = fcntl_dup(tdir).map_err(bad("dup"))?;
            match lstat_at(tdir.as_raw_fd(), tlast).map_err(bad("stat link target"))? {
                Some(st) if !is_dir(&st) => {}
                Some(_) => return Err(refuse(format!("{}: hard link to a directory", show(name)))),
                None => {
                    return Err(refuse(format!(
                        "{}: hard link to {}, which is not in this layer",
                        show(name),
                        show(&target)
                    )))
                }
            }
            let dir = root.dir(parents, true, name)?;
            clear_for_file(dir, last, name)?;
            linkat(tdir.as_raw_fd(), tlast, dir, last).map_err(bad("link"))?;
        }
        T::Char
            if header.device_major().ok().flatten() == Some(0) && header.device_minor().ok().flatten() == Some(0) =>
        {
            // An overlay-style whiteout.
            clear_for_file(dir, last, name)?;
            mknodat(dir, last, libc::S_IFCHR, 0).map_err(bad("whiteout"))?;
        }
        T::Char | T::Block => stats.devices_skipped += 1,
        T::Fifo => {
            clear_for_file(dir, last, name)?;
            mknodat(dir, last, libc::S_IFIFO | 0o600, 0).map_err(bad("mkfifo"))?;
            fchownat_nofollow(dir, last, uid, gid).map_err(bad("chown"))?;
            let fd = openat(dir, last, libc::O_PATH, 0).map_err(bad("open"))?;
            chmod_path_fd(&fd, mode).map_err(bad("chmod"))?;
        }
        other => return Err(refuse(format!("{}: entry type {other:?} is not allowed in a layer", show(name)))),
    }
    Ok(())
}

fn fcntl_dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a valid descriptor; the result is owned below.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: n was just created and belongs to nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// chmod through an O_PATH descriptor (fifos cannot be opened for fchmod
/// without blocking).
fn chmod_path_fd(fd: &OwnedFd, mode: u32) -> io::Result<()> {
    let p = format!("/proc/self/fd/{}", fd.as_raw_fd());
    fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode))
}

/// The error a [`Counted`] reader returns past its bound.
#[derive(Debug)]
struct Bounded(u64);

impl std::fmt::Display for Bounded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the layer is larger than {} bytes uncompressed", self.0)
    }
}

impl std::error::Error for Bounded {}

/// Digest and byte count of what went through a reader.
#[derive(Default)]
struct Tally {
    h: Sha256,
    n: u64,
}

/// A reader that counts (and, if `hash`, hashes) what it reads, and fails
/// past `limit`.
struct Counted<R> {
    inner: R,
    tally: Rc<RefCell<Tally>>,
    limit: u64,
    hash: bool,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut t = self.tally.borrow_mut();
        t.n += n as u64;
        if t.n > self.limit {
            return Err(io::Error::other(Bounded(self.limit)));
        }
        if self.hash {
            t.h.update(&buf[..n]);
        }
        Ok(n)
    }
}

/// Checks a digest given as `sha256:<hex>` against one computed.
fn expect_digest(what: &str, expected: Option<&str>, got: &str) -> Result<(), ImageError> {
    match expected {
        None => Ok(()),
        Some(e) if e.strip_prefix("sha256:") == Some(got) => Ok(()),
        Some(e) => Err(refuse(format!("{what}: digest mismatch: expected {e}, content is sha256:{got}"))),
    }
}

/// The hex of a `sha256:<hex>` digest, or an error naming it.
pub fn digest_hex(d: &str) -> Result<&str, ImageError> {
    match d.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) => Ok(h),
        _ => Err(refuse(format!("{:?}: not a sha256 digest", d.chars().take(80).collect::<String>()))),
    }
}

/// Extracts one layer blob (a tar, plain or gzip-compressed) into `dir`
/// (an existing, empty, trusted directory), checking `blob_digest` against
/// the bytes as given and `diff_id` against the uncompressed tar; returns
/// the diff_id (hex). On an error `dir` holds part of the layer: the
/// caller removes it.
pub fn extract_checked<R: Read>(
    blob: R,
    blob_digest: Option<&str>,
    diff_id: Option<&str>,
    dir: &Path,
    limits: &Limits,
) -> Result<String, ImageError> {
    let outer = Rc::new(RefCell::new(Tally::default()));
    let inner = Rc::new(RefCell::new(Tally::default()));
    // Compressed bytes are bounded too: a stream of empty gzip members
    // would otherwise never end.
    let outer_limit = limits.max_bytes.saturating_add(limits.max_bytes / 64 + (1 << 20));
    let counted = Counted { inner: blob, tally: outer.clone(), limit: outer_limit, hash: blob_digest.is_some() };
    let mut buffered = BufReader::with_capacity(256 * 1024, counted);
    let magic = buffered.fill_buf().map_err(super::io_err("read layer"))?.to_vec();
    let decoded: Box<dyn Read> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(buffered))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Err(refuse("zstd-compressed layers are not supported; use gzip or plain tar"));
    } else {
        Box::new(buffered)
    };
    let mut tar = Counted { inner: decoded, tally: inner.clone(), limit: limits.max_bytes, hash: true };
    extract_tar(&mut tar, dir, limits).map_err(|e| match e {
        ImageError::LayerRefused(m) if m.contains("malformed tar") && inner.borrow().n > limits.max_bytes => {
            refuse(Bounded(limits.max_bytes).to_string())
        }
        e => e,
    })?;
    // The digests cover everything, including the tar's end blocks.
    io::copy(&mut tar, &mut io::sink()).map_err(|e| match e.get_ref().and_then(|i| i.downcast_ref::<Bounded>()) {
        Some(b) => refuse(b.to_string()),
        None => refuse(format!("reading the layer: {e}")),
    })?;
    drop(tar);
    let got_diff = hex::encode(std::mem::take(&mut inner.borrow_mut().h).finalize());
    let got_blob = hex::encode(std::mem::take(&mut outer.borrow_mut().h).finalize());
    expect_digest("layer blob", blob_digest, &got_blob)?;
    expect_digest("layer diff_id", diff_id, &got_diff)?;
    Ok(got_diff)
}

/// Imports one layer blob (a tar, plain or gzip-compressed) into the store
/// and returns its diff_id (hex). `blob_digest` is checked against the
/// bytes as given, `diff_id` against the uncompressed tar; a layer the
/// store has already is neither read nor extracted again when its diff_id
/// is known.
pub fn import_layer<R: Read>(
    store: &ImageStore,
    blob: R,
    blob_digest: Option<&str>,
    diff_id: Option<&str>,
    limits: &Limits,
) -> Result<String, ImageError> {
    if let Some(d) = diff_id {
        // The store's copy was verified when it was made; this blob is not
        // needed, so it is not read (nor trusted).
        let hex = digest_hex(d)?;
        if store.has_layer(hex) {
            return Ok(hex.to_owned());
        }
    }
    let tmp = store.temp_dir()?;
    let result = extract_checked(blob, blob_digest, diff_id, &tmp, limits);
    match result {
        Ok(hex) => {
            store.commit_as(&tmp, &hex)?;
            Ok(hex)
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    /// A tar written entry by entry with raw names, so that hostile names
    /// (absolute, `..`) reach the archive as they would from an attacker.
    struct RawTar(tar::Builder<Vec<u8>>);

    impl RawTar {
        fn new() -> RawTar {
            RawTar(tar::Builder::new(Vec::new()))
        }

        fn entry(mut self, name: &str, kind: tar::EntryType, link: &str, data: &[u8]) -> RawTar {
            let mut h = tar::Header::new_gnu();
            {
                let gnu = h.as_gnu_mut().expect("gnu header");
                gnu.name[..name.len()].copy_from_slice(name.as_bytes());
                gnu.linkname[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(if kind == tar::EntryType::Directory { 0o755 } else { 0o644 });
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_700_000_000);
            h.set_cksum();
            self.0.append(&h, data).expect("append");
            self
        }

        fn file(self, name: &str, data: &[u8]) -> RawTar {
            self.entry(name, tar::EntryType::Regular, "", data)
        }

        fn dir(self, name: &str) -> RawTar {
            self.entry(name, tar::EntryType::Directory, "", b"")
        }

        fn symlink(self, name: &str, target: &str) -> RawTar {
            self.entry(name, tar::EntryType::Symlink, target, b"")
        }

        fn hardlink(self, name: &str, target: &str) -> RawTar {
            self.entry(name, tar::EntryType::Link, target, b"")
        }

        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().expect("finish")
        }
    }

    struct TestStore {
        state: std::path::PathBuf,
        store: ImageStore,
    }

    impl TestStore {
        fn new() -> TestStore {
            let state = std::env::temp_dir().join(format!("hutch-extract-{}", super::super::random_suffix()));
            let store = ImageStore::open(&state).expect("open");
            TestStore { state, store }
        }

        fn import(&self, tar: &[u8], limits: &Limits) -> Result<String, ImageError> {
            import_layer(&self.store, tar, None, None, limits)
        }

        /// Imports what must be refused, and checks nothing stayed behind.
        fn refused(&self, tar: &[u8], says: &str) {
            let err = self.import(tar, &Limits::default()).expect_err("a hostile layer must be refused");
            assert_eq!(err.code(), "image_layer_refused", "{err}");
            assert!(err.to_string().contains(says), "{err} should say {says:?}");
            let left: Vec<_> = fs::read_dir(self.state.join("images/tmp")).expect("tmp").flatten().collect();
            assert!(left.is_empty(), "a refused layer leaves nothing: {left:?}");
            let layers: Vec<_> = fs::read_dir(self.state.join("images/layers")).expect("layers").flatten().collect();
            assert!(layers.is_empty(), "a refused layer commits nothing: {layers:?}");
        }
    }

    impl Drop for TestStore {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.state);
        }
    }

    fn host_probe(name: &str) -> std::path::PathBuf {
        let p = Path::new("/etc").join(name);
        let _ = fs::remove_file(&p);
        p
    }

    #[test]
    fn a_file_written_through_a_symlink_to_etc_is_refused() {
        let t = TestStore::new();
        let probe = host_probe(&format!("hutch-evil-{}", std::process::id()));
        let name = probe.file_name().and_then(|n| n.to_str()).expect("name");
        let tar = RawTar::new().symlink("x", "/etc").file(&format!("x/{name}"), b"owned").bytes();
        t.refused(&tar, "symlink");
        let tar = RawTar::new().symlink("x", "../../../../../../etc").file(&format!("x/{name}"), b"owned").bytes();
        t.refused(&tar, "symlink");
        // A symlink to a directory inside the layer is not followed either.
        let tar = RawTar::new().dir("d").symlink("x", "d").file("x/f", b"owned").bytes();
        t.refused(&tar, "symlink");
        assert!(!probe.exists(), "a layer wrote {} on the host", probe.display());
    }

    #[test]
    fn parent_and_absolute_names_are_refused() {
        let t = TestStore::new();
        let probe = host_probe(&format!("hutch-abs-{}", std::process::id()));
        t.refused(&RawTar::new().file("../escape", b"x").bytes(), "`..`");
        t.refused(&RawTar::new().file("a/../../escape", b"x").bytes(), "`..`");
        t.refused(&RawTar::new().file(probe.to_str().expect("utf8"), b"x").bytes(), "absolute");
        assert!(!probe.exists());
    }

    #[test]
    fn whiteouts_outside_the_layer_are_refused() {
        let t = TestStore::new();
        t.refused(&RawTar::new().file("../.wh.x", b"").bytes(), "`..`");
        t.refused(&RawTar::new().file(".wh...", b"").bytes(), "whiteout");
        t.refused(&RawTar::new().file("a/.wh..", b"").bytes(), "whiteout");
        t.refused(&RawTar::new().symlink("l", "/etc").file("l/.wh.passwd", b"").bytes(), "symlink");
        t.refused(&RawTar::new().symlink("l", "/etc").file("l/.wh..wh..opq", b"").bytes(), "symlink");
    }

    #[test]
    fn hard_links_only_reach_entries_of_the_same_layer() {
        let t = TestStore::new();
        t.refused(&RawTar::new().hardlink("h", "/etc/passwd").bytes(), "absolute");
        t.refused(&RawTar::new().hardlink("h", "../../../../etc/passwd").bytes(), "`..`");
        t.refused(&RawTar::new().hardlink("h", "etc/passwd").bytes(), "not in this layer");
        t.refused(&RawTar::new().symlink("s", "/etc").hardlink("h", "s/passwd").bytes(), "symlink");
        // A link to a symlink links the symlink itself; a later entry of the
        // same name replaces the link, it never writes the host file.
        let before = fs::read("/etc/passwd").expect("host passwd");
        let tar = RawTar::new().symlink("s", "/etc/passwd").hardlink("h", "s").file("h", b"x").bytes();
        let hex = t.import(&tar, &Limits::default()).expect("a harmless layer");
        assert_eq!(fs::read("/etc/passwd").expect("host passwd"), before);
        assert_eq!(fs::read(t.store.layer_dir(&hex).join("h")).expect("h"), b"x");
        assert!(fs::symlink_metadata(t.store.layer_dir(&hex).join("s")).expect("s").file_type().is_symlink());
        let hex =
            t.import(&RawTar::new().file("a", b"data").hardlink("b", "a").bytes(), &Limits::default()).expect("ok");
        let dir = t.store.layer_dir(&hex);
        let (a, b) = (fs::metadata(dir.join("a")).expect("a"), fs::metadata(dir.join("b")).expect("b"));
        assert_eq!(a.ino(), b.ino(), "a real hard link inside the layer");
    }

    #[test]
    fn bombs_and_oversized_entries_stop_at_the_bounds() {
        let t = TestStore::new();
        // 64 MiB of zeros in one entry, gzipped to ~64 KiB; the layer may hold 1 MiB.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut h = tar::Header::new_gnu();
        h.set_path("bomb").expect("path");
        h.set_size(64 << 20);
        h.set_mode(0o644);
        h.set_cksum();
        gz.write_all(h.as_bytes()).expect("header");
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..64 {
            gz.write_all(&zeros).expect("zeros");
        }
        gz.write_all(&[0u8; 1024]).expect("end");
        let bomb = gz.finish().expect("gzip");
        assert!(bomb.len() < 1 << 20, "the bomb is small: {}", bomb.len());
        let small = Limits { max_entries: 100, max_bytes: 1 << 20 };
        let err = t.import(&bomb, &small).expect_err("refused");
        assert!(err.to_string().contains("more than the layer may hold"), "{err}");
        // The same bound on the stream, when the header lies low.
        let mut tar = RawTar::new();
        for i in 0..3 {
            tar = tar.file(&format!("f{i}"), &vec![7u8; 600 << 10]);
        }
        let err = t.import(&tar.bytes(), &small).expect_err("refused");
        assert!(err.to_string().contains("larger than 1048576 bytes"), "{err}");
        let mut tar = RawTar::new();
        for i in 0..101 {
            tar = tar.file(&format!("f{i}"), b"");
        }
        let err = t.import(&tar.bytes(), &small).expect_err("refused");
        assert!(err.to_string().contains("more than 100 entries"), "{err}");
        let deep = vec!["d"; MAX_DEPTH + 1].join("/");
        let mut tar = RawTar::new();
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_mode(0o644);
        tar.0.append_data(&mut h, &deep, &b""[..]).expect("long name");
        let err = t.import(&tar.bytes(), &Limits::default()).expect_err("refused");
        assert!(err.to_string().contains("deeper than"), "{err}");
        assert!(fs::read_dir(t.state.join("images/tmp")).expect("tmp").next().is_none());
    }

    #[test]
    fn whiteouts_opaque_dirs_and_devices_take_overlay_form() {
        let t = TestStore::new();
        let mut h = tar::Header::new_gnu();
        h.set_path("dev/sda").expect("path");
        h.set_entry_type(tar::EntryType::Block);
        h.set_mode(0o600);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_device_major(8).expect("major");
        h.set_device_minor(0).expect("minor");
        h.set_size(0);
        h.set_cksum();
        let mut b =
            RawTar::new().dir("data").file("data/.wh.gone", b"").file("opq/.wh..wh..opq", b"").file("opq/new", b"n");
        b.0.append(&h, &b""[..]).expect("append");
        let b = b.file("bin/su", b"#!/bin/sh\n").entry(".wh..wh.plnk", tar::EntryType::Directory, "", b"");
        let tar = b.bytes();
        let hex = t.import(&tar, &Limits::default()).expect("import");
        assert_eq!(hex, hex::encode(Sha256::digest(&tar)), "the layer is named by its diff_id");
        let dir = t.store.layer_dir(&hex);
        let gone = fs::symlink_metadata(dir.join("data/gone")).expect("whiteout");
        assert!(gone.file_type().is_char_device() && gone.rdev() == 0, "a 0:0 character device");
        assert!(get_opaque(&dir.join("opq")).expect("xattr"), "opaque");
        assert!(!get_opaque(&dir.join("data")).expect("xattr"));
        assert!(!dir.join("dev/sda").exists(), "device nodes are left out");
        assert!(!dir.join(".wh..wh.plnk").exists());
        // Digest checks: a wrong diff_id refuses the layer.
        let wrong = format!("sha256:{}", "0".repeat(64));
        let err = import_layer(&t.store, &tar[..], None, Some(&wrong), &Limits::default()).expect_err("mismatch");
        assert!(err.to_string().contains("digest mismatch"), "{err}");
    }

    /// Random layers from a hostile alphabet (symlinks into a canary
    /// directory outside the store, `..`, whiteouts, hard links, repeated
    /// names): whatever is accepted or refused, nothing appears in the
    /// canary and no temporary directory is left.
    #[test]
    fn random_hostile_layers_never_write_outside() {
        let t = TestStore::new();
        let canary = std::env::temp_dir().join(format!("hutch-canary-{}", super::super::random_suffix()));
        fs::create_dir(&canary).expect("canary");
        let canary_s = canary.to_str().expect("utf8").to_owned();
        let back = "../".repeat(12) + canary_s.trim_start_matches('/');
        let names = ["a", "b", "a/b", "a/b/c", "l", "l/x", "a/l", "a/l/y", ".wh.a", "a/.wh.b", "l/.wh.z", ".", "a/.."];
        let targets = [canary_s.as_str(), back.as_str(), "a", "..", "/", "a/b", "l"];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let (mut accepted, mut refused) = (0, 0);
        for _ in 0..300 {
            let mut tar = RawTar::new();
            for _ in 0..1 + next(6) {
                let name = names[next(names.len())];
                let target = targets[next(targets.len())];
                tar = match next(4) {
                    0 => tar.dir(name),
                    1 => tar.file(name, b"payload"),
                    2 => tar.symlink(name, target),
                    _ => tar.hardlink(name, target),
                };
            }
            match t.import(&tar.bytes(), &Limits::default()) {
                Ok(_) => accepted += 1,
                Err(e) => {
                    assert_eq!(e.code(), "image_layer_refused", "{e}");
                    refused += 1;
                }
            }
            assert!(fs::read_dir(&canary).expect("canary").next().is_none(), "a layer wrote into the canary");
        }
        assert!(fs::read_dir(t.state.join("images/tmp")).expect("tmp").next().is_none());
        assert!(accepted > 20 && refused > 20, "both kinds exercised: {accepted} accepted, {refused} refused");
        fs::remove_dir(&canary).expect("the canary is still empty");
    }

    #[test]
    fn a_lower_layers_symlink_does_not_redirect_a_later_layer() {
        let t = TestStore::new();
        let probe = host_probe(&format!("hutch-redir-{}", std::process::id()));
        let name = probe.file_name().and_then(|n| n.to_str()).expect("name");
        let lower = t.import(&RawTar::new().symlink("redir", "/etc").bytes(), &Limits::default()).expect("lower");
        let upper =
            t.import(&RawTar::new().file(&format!("redir/{name}"), b"x").bytes(), &Limits::default()).expect("upper");
        assert!(!probe.exists(), "written on the host through the lower layer's symlink");
        assert!(fs::symlink_metadata(t.store.layer_dir(&lower).join("redir")).expect("link").file_type().is_symlink());
        assert!(t.store.layer_dir(&upper).join("redir").join(name).is_file(), "extracted in its own layer");
    }
}
