//! Layer trees on the host: the walking primitives that never follow a
//! symlink (every open is relative to an open directory with `O_NOFOLLOW`,
//! every stat uses `AT_SYMLINK_NOFOLLOW`), and [`tree_digest`], the one
//! content digest that names a layer made on the host (`layers/<hex>`),
//! whether a build captured it, copied it from a build context, or the
//! store generated it (an image's top layer). Imported layers are named by
//! their diff_id instead (the digest of their tar, checked as they stream).
//!
//! The digest covers what a sandbox sees of the tree: every entry's path,
//! type, permission bits, owner, content (file bytes, link target), and
//! extended attributes (overlay's opaque mark, `user.*`); not times. It is
//! also the last check before a tree becomes a layer: ids outside the
//! image's 65536, device nodes other than overlay's whiteouts, and sockets
//! refuse the tree.

use super::extract::{MAX_DEPTH, MAX_ID};
use super::ImageError;
use crate::launch::cstr;
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Longest symlink target kept.
pub(crate) const MAX_LINK: usize = 4096;
/// Most extended attributes of one entry, and bytes of one value.
const MAX_XATTRS: usize = 64;
const MAX_XATTR_VALUE: usize = 64 * 1024;
/// Most entries a digested tree may hold (an imported layer's bound).
const MAX_ENTRIES: u64 = 1_000_000;
/// Bumped when what the digest covers changes: a new version never names
/// the directory an older one named.
const DIGEST_VERSION: &[u8] = b"hutch-layer-tree-v2";

/// An open directory, the anchor of every `*at` call.
pub(crate) fn open_dir_at(dir: RawFd, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: name is a valid C string; the fd returned is owned below.
    let fd = unsafe {
        libc::openat(dir, name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    open_dir_at(libc::AT_FDCWD, &cstr(path)?)
}

pub(crate) fn stat_at(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: st is a valid out-pointer; name a valid C string.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; AT_SYMLINK_NOFOLLOW: a symlink is described, never followed.
    if unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Names in a directory, sorted by their bytes (the canonical order).
pub(crate) fn names(dir: &OwnedFd) -> io::Result<Vec<CString>> {
    // The magic link names the open directory itself: nothing on the way is
    // resolved by name.
    let mut out = Vec::new();
    for e in fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))? {
        out.push(CString::new(e?.file_name().as_bytes()).map_err(io::Error::other)?);
    }
    out.sort();
    Ok(out)
}

pub(crate) fn read_link_at(dir: RawFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; MAX_LINK + 1];
    // SAFETY: buf is writable for its length; name a valid C string.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    if n > MAX_LINK {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "symlink target too long"));
    }
    buf.truncate(n);
    Ok(buf)
}

pub(crate) fn open_file_at(dir: RawFd, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<File> {
    // SAFETY: name is a valid C string; the fd returned is owned below.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The extended attributes of an open file or directory, sorted by name.
pub(crate) fn xattrs(fd: RawFd) -> io::Result<Vec<(String, Vec<u8>)>> {
    let mut list = vec![0u8; 64 * 1024];
    // SAFETY: list is writable for its length.
    let n = unsafe { libc::flistxattr(fd, list.as_mut_ptr().cast(), list.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOTSUP) => Ok(Vec::new()),
            _ => Err(e),
        };
    }
    list.truncate(n as usize);
    let mut out = Vec::new();
    for name in list.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if out.len() >= MAX_XATTRS {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "too many extended attributes"));
        }
        let c = CString::new(name).map_err(io::Error::other)?;
        let mut value = vec![0u8; MAX_XATTR_VALUE];
        // SAFETY: value is writable for its length; c a valid C string.
        let len = unsafe { libc::fgetxattr(fd, c.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if len < 0 {
            return Err(io::Error::last_os_error());
        }
        value.truncate(len as usize);
        out.push((String::from_utf8_lossy(name).into_owned(), value));
    }
    out.sort();
    Ok(out)
}

/// The content digest of a layer tree (64 hex digits): SHA-256 over a
/// canonical walk, each entry with its path, type, permission bits,
/// owner, content and extended attributes, every field length-prefixed.
/// Symlinks are never followed; times are left out. Refuses (as
/// [`ImageError::LayerRefused`]) what no layer may hold: an owner outside
/// the image's ids (0 to 65535), a device node other than a whiteout, a
/// socket, more than 1,000,000 entries or 128 levels.
pub fn tree_digest(dir: &Path) -> Result<String, ImageError> {
    let shown = dir.display().to_string();
    let root = open_dir(dir).map_err(super::io_err(format!("open {shown}")))?;
    let mut walk = Walk { h: Sha256::new(), entries: 0 };
    walk.h.update(DIGEST_VERSION);
    let st = stat_at(root.as_raw_fd(), c".").map_err(super::io_err(format!("stat {shown}")))?;
    walk.header(b'd', "", &st)?;
    walk.xattrs(root.as_raw_fd(), "/")?;
    walk.dir(&root, "", 0)?;
    Ok(hex::encode(walk.h.finalize()))
}

struct Walk {
    h: Sha256,
    entries: u64,
}

impl Walk {
    fn field(&mut self, bytes: &[u8]) {
        self.h.update((bytes.len() as u64).to_le_bytes());
        self.h.update(bytes);
    }

    fn header(&mut self, kind: u8, path: &str, st: &libc::stat) -> Result<(), ImageError> {
        if st.st_uid >= MAX_ID || st.st_gid >= MAX_ID {
            return Err(ImageError::LayerRefused(format!(
                "{}: owner {}:{} is outside the image's ids (0 to 65535)",
                shown(path),
                st.st_uid,
                st.st_gid
            )));
        }
        self.h.update([kind]);
        self.field(path.as_bytes());
        self.h.update((st.st_mode & 0o7777).to_le_bytes());
        self.h.update(st.st_uid.to_le_bytes());
        self.h.update(st.st_gid.to_le_bytes());
        Ok(())
    }

    fn xattrs(&mut self, fd: RawFd, path: &str) -> Result<(), ImageError> {
        let list = xattrs(fd).map_err(super::io_err(format!("xattrs of {}", shown(path))))?;
        self.h.update((list.len() as u64).to_le_bytes());
        for (k, v) in list {
            self.field(k.as_bytes());
            self.field(&v);
        }
        Ok(())
    }

    fn dir(&mut self, dir: &OwnedFd, rel: &str, depth: usize) -> Result<(), ImageError> {
        if depth >= MAX_DEPTH {
            return Err(ImageError::LayerRefused(format!("{}: deeper than {MAX_DEPTH} levels", shown(rel))));
        }
        let list = names(dir).map_err(super::io_err(format!("list {}", shown(rel))))?;
        self.h.update((list.len() as u64).to_le_bytes());
        for name in list {
            self.entries += 1;
            if self.entries > MAX_ENTRIES {
                return Err(ImageError::LayerRefused(format!("more than {MAX_ENTRIES} entries")));
            }
            let path = format!("{rel}/{}", String::from_utf8_lossy(name.as_bytes()));
            let io = |what: &str| super::io_err(format!("{what} {path}"));
            let st = stat_at(dir.as_raw_fd(), &name).map_err(io("stat"))?;
            match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => {
                    self.header(b'd', &path, &st)?;
                    let sub = open_dir_at(dir.as_raw_fd(), &name).map_err(io("open"))?;
                    self.xattrs(sub.as_raw_fd(), &path)?;
                    self.dir(&sub, &path, depth + 1)?;
                }
                libc::S_IFREG => {
                    self.header(b'f', &path, &st)?;
                    let mut f = open_file_at(dir.as_raw_fd(), &name, libc::O_RDONLY | libc::O_NONBLOCK, 0)
                        .map_err(io("open"))?;
                    let mut content = Sha256::new();
                    let mut size = 0u64;
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = f.read(&mut buf).map_err(io("read"))?;
                        if n == 0 {
                            break;
                        }
                        size += n as u64;
                        content.update(&buf[..n]);
                    }
                    self.h.update(size.to_le_bytes());
                    self.h.update(content.finalize());
                    self.xattrs(f.as_raw_fd(), &path)?;
                }
                libc::S_IFLNK => {
                    self.header(b'l', &path, &st)?;
                    let target = read_link_at(dir.as_raw_fd(), &name).map_err(io("readlink"))?;
                    self.field(&target);
                }
                // overlayfs's whiteout: a 0/0 character device.
                libc::S_IFCHR if st.st_rdev == 0 => self.header(b'w', &path, &st)?,
                libc::S_IFIFO => self.header(b'p', &path, &st)?,
                _ => {
                    return Err(ImageError::LayerRefused(format!(
                        "{}: device nodes and sockets are not allowed in a layer",
                        shown(&path)
                    )))
                }
            }
        }
        Ok(())
    }
}

fn shown(rel: &str) -> &str {
    if rel.is_empty() {
        "/"
    } else {
        rel
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn tree(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("hutch-tree-{tag}-{}", crate::sys::random_hex(6)));
        fs::create_dir_all(d.join("etc/app")).expect("mkdir");
        fs::write(d.join("etc/app/conf"), "x=1\n").expect("write");
        symlink("/etc/shadow", d.join("etc/evil")).expect("symlink");
        d
    }

    fn set_xattr(path: &Path, name: &str, value: &[u8]) {
        let (p, n) = (cstr(path).expect("c"), cstr(name).expect("c"));
        // SAFETY: both are valid C strings; value is readable for its length.
        let r = unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        assert_eq!(r, 0, "setxattr {name}: {}", io::Error::last_os_error());
    }

    #[test]
    fn the_digest_covers_content_modes_owners_links_and_xattrs_but_not_times() {
        let a = tree("a");
        let d = |p: &Path| tree_digest(p).expect("digest");
        let first = d(&a);
        assert_eq!(first.len(), 64);
        let b = tree("b");
        // Times differ (made later): the digest does not.
        fs::File::open(b.join("etc/app/conf"))
            .and_then(|f| f.set_modified(std::time::SystemTime::UNIX_EPOCH))
            .expect("touch");
        assert_eq!(d(&b), first, "same tree, same digest");
        fs::write(b.join("etc/app/conf"), "x=2\n").expect("write");
        assert_ne!(d(&b), first, "content");
        fs::write(b.join("etc/app/conf"), "x=1\n").expect("write");
        assert_eq!(d(&b), first);
        fs::set_permissions(b.join("etc/app/conf"), fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_ne!(d(&b), first, "mode");
        fs::set_permissions(b.join("etc/app/conf"), fs::Permissions::from_mode(0o644)).expect("chmod");
        std::os::unix::fs::lchown(b.join("etc/app/conf"), Some(1000), Some(1000)).expect("chown");
        assert_ne!(d(&b), first, "owner");
        std::os::unix::fs::lchown(b.join("etc/app/conf"), Some(0), Some(0)).expect("chown");
        assert_eq!(d(&b), first);
        set_xattr(&b.join("etc/app/conf"), "user.note", b"1");
        assert_ne!(d(&b), first, "a user xattr");
        let with_user = d(&b);
        set_xattr(&b.join("etc/app/conf"), "user.note", b"2");
        assert_ne!(d(&b), with_user, "the xattr's value");
        let c = tree("c");
        set_xattr(&c.join("etc/app"), "trusted.overlay.opaque", b"y");
        assert_ne!(d(&c), first, "the opaque mark");
        let e = tree("e");
        fs::remove_file(e.join("etc/evil")).expect("rm");
        symlink("/etc/passwd", e.join("etc/evil")).expect("symlink");
        assert_ne!(d(&e), first, "a link's target");
        for p in [a, b, c, e] {
            fs::remove_dir_all(p).expect("cleanup");
        }
    }

    #[test]
    fn the_digest_refuses_foreign_ids_devices_and_sockets() {
        let t = tree("bad");
        std::os::unix::fs::lchown(t.join("etc/evil"), Some(70_000), None).expect("chown");
        let err = tree_digest(&t).expect_err("an id outside the image");
        assert_eq!(err.code(), "image_layer_refused", "{err}");
        std::os::unix::fs::lchown(t.join("etc/evil"), Some(0), None).expect("chown");
        let null = cstr(t.join("etc/null")).expect("c");
        // SAFETY: null is a valid C string.
        assert_eq!(unsafe { libc::mknod(null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) }, 0);
        assert!(tree_digest(&t).expect_err("a device").to_string().contains("device"));
        fs::remove_file(t.join("etc/null")).expect("rm");
        let wh = cstr(t.join("etc/gone")).expect("c");
        // SAFETY: wh is a valid C string.
        assert_eq!(unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR, 0) }, 0);
        tree_digest(&t).expect("a whiteout is fine");
        let _l = std::os::unix::net::UnixListener::bind(t.join("sock")).expect("bind");
        assert_eq!(tree_digest(&t).expect_err("a socket").code(), "image_layer_refused");
        fs::remove_dir_all(&t).expect("cleanup");
    }
}
