//! Build layers: a size-capped scratch directory that serves as a build
//! sandbox's writable layer ([`Scratch`]), and the capture of that layer
//! into an image layer once the sandbox is gone ([`capture`]). The image
//! store names and commits the result
//! ([`crate::image::ImageStore::commit_layer`]).
//!
//! What a build step left in its upper layer is the sandbox's work, so it
//! is hostile: the walk never follows a symlink (every open is relative to
//! an open directory with `O_NOFOLLOW`, every stat and chown uses
//! `AT_SYMLINK_NOFOLLOW`), is bounded in entries, bytes, depth and xattrs,
//! and refuses an owner outside the sandbox's uid range or a device other
//! than overlay's whiteout. The capture writes a fresh tree rather than
//! fixing the upper layer in place: every file of the layer is one we made.

use crate::image::tree::{names, open_dir, open_dir_at, open_file_at, read_link_at, stat_at, xattrs};
use crate::launch::cstr;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Ids of one sandbox's range (see [`crate::uids`]).
const RANGE: u32 = crate::uids::RANGE;
/// overlayfs marks an upper directory that hides its lower ones with this.
pub const OPAQUE: &str = "trusted.overlay.opaque";

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("the layer holds more than {0} entries")]
    TooManyEntries(u64),
    #[error("the layer holds more than {0} bytes")]
    TooLarge(u64),
    #[error("{0}: nested deeper than {1} directories")]
    TooDeep(String, usize),
    #[error("{path}: owner {uid}:{gid} lies outside the sandbox's ids")]
    ForeignOwner { path: String, uid: u32, gid: u32 },
    #[error("{0}: device files are not allowed in a layer")]
    Device(String),
}

fn io_at(path: &str) -> impl FnOnce(io::Error) -> CaptureError + '_ {
    move |source| CaptureError::Io { path: path.to_owned(), source }
}

/// Bounds of one captured layer.
#[derive(Debug, Clone, Copy)]
pub struct CaptureLimits {
    pub max_entries: u64,
    pub max_bytes: u64,
    pub max_depth: usize,
}

impl Default for CaptureLimits {
    fn default() -> Self {
        CaptureLimits { max_entries: 200_000, max_bytes: 64 << 30, max_depth: 128 }
    }
}

/// What a capture wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured {
    pub entries: u64,
    pub bytes: u64,
}

/// A tmpfs of a fixed size mounted on a directory of the host, holding
/// `upper/` and `work/` for a build sandbox's overlay: the step's writes
/// stay under the template's disk cap. Unmounted and removed on drop.
#[derive(Debug)]
pub struct Scratch {
    dir: PathBuf,
    mounted: bool,
}

impl Scratch {
    /// Mounts a `bytes`-sized tmpfs (mode 0700: no host user can reach into
    /// it) on `dir`, made if missing.
    pub fn create(dir: &Path, bytes: u64) -> io::Result<Scratch> {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        let target = cstr(dir)?;
        let data = cstr(format!("size={},mode=0700", bytes.max(1 << 20)))?;
        let fstype = cstr("tmpfs")?;
        // SAFETY: every pointer is a valid C string for the call's duration.
        let ret = unsafe {
            libc::mount(
                fstype.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                data.as_ptr().cast(),
            )
        };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        let scratch = Scratch { dir: dir.to_path_buf(), mounted: true };
        for sub in ["upper", "work"] {
            fs::DirBuilder::new().mode(0o755).create(dir.join(sub))?;
        }
        Ok(scratch)
    }

    /// The directory to give as [`crate::Writable::HostDir`].
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The overlay's upper directory, to [`capture`] after the sandbox ended.
    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }

    fn unmount(&mut self) {
        if self.mounted {
            unmount_detach(&self.dir);
            self.mounted = false;
        }
        let _ = fs::remove_dir(&self.dir);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.unmount();
    }
}

fn unmount_detach(dir: &Path) {
    if let Ok(c) = cstr(dir) {
        // SAFETY: c is a valid C string; a failure (not mounted) is harmless.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Unmounts and removes scratch directories under `parent` that an earlier
/// daemon left (it died during a build).
pub fn sweep_scratch(parent: &Path) {
    let Ok(entries) = fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        let path = e.path();
        unmount_detach(&path);
        let _ = fs::remove_dir_all(&path);
    }
}

fn set_xattr(fd: RawFd, name: &str, value: &[u8]) -> io::Result<()> {
    let c = cstr(name)?;
    // SAFETY: c is a valid C string; value is readable for its length.
    if unsafe { libc::fsetxattr(fd, c.as_ptr(), value.as_ptr().cast(), value.len(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Which attributes a layer keeps: overlay's opaque mark and `user.*`.
/// Overlay's other bookkeeping (origin, impure, redirect) describes the
/// build host's file handles; `security.capability` carries the sandbox's
/// host root id and would need rewriting, so it is dropped.
fn kept_xattr(name: &str, value: &[u8]) -> bool {
    (name == OPAQUE && value == b"y") || name.starts_with("user.")
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn chown_at(dir: RawFd, name: &CStr, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: name is a valid C string; AT_SYMLINK_NOFOLLOW changes a symlink itself.
    check(unsafe { libc::fchownat(dir, name.as_ptr(), uid, gid, libc::AT_SYMLINK_NOFOLLOW) })
}

fn times_at(dir: RawFd, name: &CStr, st: &libc::stat) -> io::Result<()> {
    let times = [
        libc::timespec { tv_sec: st.st_atime, tv_nsec: st.st_atime_nsec },
        libc::timespec { tv_sec: st.st_mtime, tv_nsec: st.st_mtime_nsec },
    ];
    // SAFETY: times holds two valid timespecs; name a valid C string.
    check(unsafe { libc::utimensat(dir, name.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) })
}

struct Walk<'a> {
    id_base: u32,
    limits: CaptureLimits,
    done: Captured,
    /// First destination path of each multiply linked source inode.
    links: HashMap<(u64, u64), CString>,
    dest_root: &'a OwnedFd,
}

impl Walk<'_> {
    fn shift(&self, rel: &str, st: &libc::stat) -> Result<(u32, u32), CaptureError> {
        let (uid, gid) = (st.st_uid.wrapping_sub(self.id_base), st.st_gid.wrapping_sub(self.id_base));
        if uid >= RANGE || gid >= RANGE {
            return Err(CaptureError::ForeignOwner { path: rel.to_owned(), uid: st.st_uid, gid: st.st_gid });
        }
        Ok((uid, gid))
    }

    fn count(&mut self, bytes: u64) -> Result<(), CaptureError> {
        self.done.entries += 1;
        self.done.bytes = self.done.bytes.saturating_add(bytes);
        if self.done.entries > self.limits.max_entries {
            return Err(CaptureError::TooManyEntries(self.limits.max_entries));
        }
        if self.done.bytes > self.limits.max_bytes {
            return Err(CaptureError::TooLarge(self.limits.max_bytes));
        }
        Ok(())
    }

    /// Copies the contents of `src` into `dst`; `rel` names `src` in errors.
    fn dir(&mut self, src: &OwnedFd, dst: &OwnedFd, rel: &str, depth: usize) -> Result<(), CaptureError> {
        if depth > self.limits.max_depth {
            return Err(CaptureError::TooDeep(rel.to_owned(), self.limits.max_depth));
        }
        for name in names(src).map_err(io_at(rel))? {
            let path = format!("{rel}/{}", String::from_utf8_lossy(name.as_bytes()));
            let st = stat_at(src.as_raw_fd(), &name).map_err(io_at(&path))?;
            self.entry(src, dst, &name, &path, &st, depth)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        src: &OwnedFd,
        dst: &OwnedFd,
        name: &CStr,
        path: &str,
        st: &libc::stat,
        depth: usize,
    ) -> Result<(), CaptureError> {
        let (s, d) = (src.as_raw_fd(), dst.as_raw_fd());
        let perm = st.st_mode & 0o7777;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFCHR if st.st_rdev == 0 => {
                // A whiteout: overlay makes it with the mounter's ids, so its
                // owner says nothing; it is written as 0:0.
                self.count(0)?;
                // SAFETY: name is a valid C string.
                check(unsafe { libc::mknodat(d, name.as_ptr(), libc::S_IFCHR, 0) }).map_err(io_at(path))?;
            }
            libc::S_IFDIR => {
                self.count(0)?;
                let (uid, gid) = self.shift(path, st)?;
                // SAFETY: name is a valid C string.
                check(unsafe { libc::mkdirat(d, name.as_ptr(), 0o700) }).map_err(io_at(path))?;
                let sub_src = open_dir_at(s, name).map_err(io_at(path))?;
                let sub_dst = open_dir_at(d, name).map_err(io_at(path))?;
                self.dir(&sub_src, &sub_dst, path, depth + 1)?;
                for (k, v) in xattrs(sub_src.as_raw_fd()).map_err(io_at(path))? {
                    if kept_xattr(&k, &v) {
                        set_xattr(sub_dst.as_raw_fd(), &k, &v).map_err(io_at(path))?;
                    }
                }
                chown_at(d, name, uid, gid).map_err(io_at(path))?;
                // SAFETY: fchmod on a descriptor we own.
                check(unsafe { libc::fchmod(sub_dst.as_raw_fd(), perm) }).map_err(io_at(path))?;
                times_at(d, name, st).map_err(io_at(path))?;
            }
            libc::S_IFREG => {
                let (uid, gid) = self.shift(path, st)?;
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1 {
                    if let Some(first) = self.links.get(&key).cloned() {
                        self.count(0)?;
                        let root = self.dest_root.as_raw_fd();
                        // SAFETY: both names are valid C strings; `first` is a
                        // path of directories this walk made, then the file.
                        check(unsafe { libc::linkat(root, first.as_ptr(), d, name.as_ptr(), 0) })
                            .map_err(io_at(path))?;
                        return Ok(());
                    }
                }
                self.count(st.st_size as u64)?;
                let mut from = open_file_at(s, name, libc::O_RDONLY | libc::O_NONBLOCK, 0).map_err(io_at(path))?;
                let mut to =
                    open_file_at(d, name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600).map_err(io_at(path))?;
                // At most the size it had (the sandbox is gone; nothing grows it).
                let copied = io::copy(&mut (&mut from).take(st.st_size as u64), &mut to).map_err(io_at(path))?;
                if copied != st.st_size as u64 {
                    return Err(CaptureError::Io {
                        path: path.to_owned(),
                        source: io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank during the capture"),
                    });
                }
                for (k, v) in xattrs(from.as_raw_fd()).map_err(io_at(path))? {
                    if kept_xattr(&k, &v) && k != OPAQUE {
                        set_xattr(to.as_raw_fd(), &k, &v).map_err(io_at(path))?;
                    }
                }
                // SAFETY: fchown and fchmod on a descriptor we own; chown
                // first, since it clears setuid and setgid.
                check(unsafe { libc::fchown(to.as_raw_fd(), uid, gid) }).map_err(io_at(path))?;
                // SAFETY: as above.
                check(unsafe { libc::fchmod(to.as_raw_fd(), perm) }).map_err(io_at(path))?;
                to.flush().map_err(io_at(path))?;
                drop(to);
                times_at(d, name, st).map_err(io_at(path))?;
                if st.st_nlink > 1 {
                    let rel = path.trim_start_matches('/');
                    self.links.insert(key, CString::new(rel).map_err(|e| io_at(path)(io::Error::other(e)))?);
                }
            }
            libc::S_IFLNK => {
                let (uid, gid) = self.shift(path, st)?;
                let target = read_link_at(s, name).map_err(io_at(path))?;
                self.count(target.len() as u64)?;
                let target = CString::new(target).map_err(|e| io_at(path)(io::Error::other(e)))?;
                // SAFETY: both are valid C strings; the link is made, never followed.
                check(unsafe { libc::symlinkat(target.as_ptr(), d, name.as_ptr()) }).map_err(io_at(path))?;
                chown_at(d, name, uid, gid).map_err(io_at(path))?;
                times_at(d, name, st).map_err(io_at(path))?;
            }
            libc::S_IFIFO => {
                let (uid, gid) = self.shift(path, st)?;
                self.count(0)?;
                // SAFETY: name is a valid C string.
                check(unsafe { libc::mknodat(d, name.as_ptr(), libc::S_IFIFO | 0o600, 0) }).map_err(io_at(path))?;
                chown_at(d, name, uid, gid).map_err(io_at(path))?;
                // SAFETY: name is a valid C string; a fifo is not a symlink.
                check(unsafe { libc::fchmodat(d, name.as_ptr(), perm, 0) }).map_err(io_at(path))?;
            }
            // A socket has no meaning once its process is gone.
            libc::S_IFSOCK => {}
            _ => return Err(CaptureError::Device(path.to_owned())),
        }
        Ok(())
    }
}

/// Copies the upper layer `upper` of an ended sandbox whose ids started at
/// `id_base` into `dest` (made here; it must not exist), as an image layer:
/// owners shifted back to image ids, overlay's whiteouts and opaque marks
/// kept, its other bookkeeping dropped. On error `dest` may hold part of
/// the layer; the caller removes it.
pub fn capture(upper: &Path, dest: &Path, id_base: u32, limits: CaptureLimits) -> Result<Captured, CaptureError> {
    let shown = upper.display().to_string();
    let src = open_dir(upper).map_err(io_at(&shown))?;
    let st = stat_at(src.as_raw_fd(), c".").map_err(io_at(&shown))?;
    fs::DirBuilder::new().mode(0o755).create(dest).map_err(io_at(&dest.display().to_string()))?;
    let dst = open_dir(dest).map_err(io_at(&dest.display().to_string()))?;
    let mut walk = Walk { id_base, limits, done: Captured::default(), links: HashMap::new(), dest_root: &dst };
    walk.dir(&src, &dst, "", 0)?;
    // The layer's root takes the upper root's mode, owned by image root.
    let _ = walk.shift("/", &st)?;
    // SAFETY: fchmod on a descriptor we own.
    check(unsafe { libc::fchmod(dst.as_raw_fd(), 0o755) }).map_err(io_at("/"))?;
    Ok(walk.done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hutch-capture-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("mkdir");
        d
    }

    fn lchown(p: &Path, uid: u32, gid: u32) {
        std::os::unix::fs::lchown(p, Some(uid), Some(gid)).expect("lchown");
    }

    const BASE: u32 = 1 << 31;

    #[test]
    fn capture_shifts_owners_keeps_whiteouts_and_never_follows_symlinks() {
        let t = tmp("shift");
        let up = t.join("upper");
        fs::create_dir_all(up.join("etc/app")).expect("mkdir");
        fs::create_dir_all(up.join("home/user")).expect("mkdir");
        fs::write(up.join("etc/app/conf"), "x=1\n").expect("write");
        fs::write(up.join("home/user/notes"), "mine").expect("write");
        fs::set_permissions(up.join("home/user/notes"), fs::Permissions::from_mode(0o640)).expect("chmod");
        // A link out of the tree: kept as a link, never read through.
        symlink("/etc/shadow", up.join("etc/evil")).expect("symlink");
        fs::hard_link(up.join("etc/app/conf"), up.join("etc/app/conf2")).expect("link");
        // A whiteout, as overlay makes it.
        let wh = cstr(up.join("etc/gone")).expect("cstr");
        // SAFETY: wh is a valid C string.
        assert_eq!(unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR, 0) }, 0);
        set_xattr(open_dir(&up.join("etc/app")).expect("open").as_raw_fd(), OPAQUE, b"y").expect("opaque");
        set_xattr(open_dir(&up.join("etc/app")).expect("open").as_raw_fd(), "trusted.overlay.origin", b"zz")
            .expect("origin");
        for p in ["", "etc", "etc/app", "etc/app/conf", "etc/evil", "home"] {
            lchown(&up.join(p), BASE, BASE);
        }
        for p in ["home/user", "home/user/notes"] {
            lchown(&up.join(p), BASE + 1000, BASE + 1000);
        }
        let dest = t.join("layer");
        let got = capture(&up, &dest, BASE, CaptureLimits::default()).expect("capture");
        assert_eq!(got.entries, 9, "{got:?}");
        let meta = |p: &str| fs::symlink_metadata(dest.join(p)).expect(p);
        assert_eq!((meta("etc/app/conf").uid(), meta("etc/app/conf").gid()), (0, 0));
        assert_eq!(meta("home/user/notes").uid(), 1000);
        assert_eq!(meta("home/user/notes").mode() & 0o7777, 0o640);
        assert_eq!(fs::read_link(dest.join("etc/evil")).expect("link"), Path::new("/etc/shadow"));
        assert_eq!(meta("etc/evil").uid(), 0);
        assert_eq!(meta("etc/app/conf").ino(), meta("etc/app/conf2").ino(), "hard links stay linked");
        assert_eq!(meta("etc/gone").mode() & libc::S_IFMT, libc::S_IFCHR);
        assert_eq!(meta("etc/gone").rdev(), 0);
        let attrs = xattrs(open_dir(&dest.join("etc/app")).expect("open").as_raw_fd()).expect("xattrs");
        assert_eq!(attrs, vec![(OPAQUE.to_owned(), b"y".to_vec())], "only the opaque mark is kept");
        // The digest is a function of content, not of the copy.
        let digest = |p: &Path| crate::image::tree_digest(p).expect("digest");
        let a = digest(&dest);
        let dest2 = t.join("layer2");
        capture(&up, &dest2, BASE, CaptureLimits::default()).expect("capture again");
        assert_eq!(a, digest(&dest2));
        fs::write(dest2.join("home/user/notes"), "changed").expect("write");
        assert_ne!(a, digest(&dest2));
        fs::remove_dir_all(&t).expect("cleanup");
    }

    #[test]
    fn capture_refuses_foreign_owners_devices_and_excess() {
        let t = tmp("refuse");
        let up = t.join("upper");
        fs::create_dir_all(&up).expect("mkdir");
        lchown(&up, BASE, BASE);
        fs::write(up.join("f"), "x").expect("write");
        // Owned by host root: not one of the sandbox's ids.
        lchown(&up.join("f"), 0, 0);
        let err = capture(&up, &t.join("l1"), BASE, CaptureLimits::default()).expect_err("foreign owner");
        assert!(matches!(err, CaptureError::ForeignOwner { .. }), "{err}");
        lchown(&up.join("f"), BASE + 65_536, BASE);
        assert!(capture(&up, &t.join("l2"), BASE, CaptureLimits::default()).is_err(), "one past the range");
        lchown(&up.join("f"), BASE, BASE);
        let null = cstr(up.join("null")).expect("cstr");
        // SAFETY: null is a valid C string.
        assert_eq!(unsafe { libc::mknod(null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) }, 0);
        let err = capture(&up, &t.join("l3"), BASE, CaptureLimits::default()).expect_err("device");
        assert!(matches!(err, CaptureError::Device(_)), "{err}");
        fs::remove_file(up.join("null")).expect("rm");
        let few = CaptureLimits { max_entries: 1, max_bytes: 1 << 20, max_depth: 8 };
        fs::write(up.join("g"), "y").expect("write");
        lchown(&up.join("g"), BASE, BASE);
        assert!(matches!(capture(&up, &t.join("l4"), BASE, few), Err(CaptureError::TooManyEntries(1))));
        let small = CaptureLimits { max_entries: 10, max_bytes: 1, max_depth: 8 };
        assert!(matches!(capture(&up, &t.join("l5"), BASE, small), Err(CaptureError::TooLarge(1))));
        fs::remove_dir_all(&t).expect("cleanup");
    }

    #[test]
    fn scratch_is_a_capped_tmpfs_and_goes_away() {
        let t = tmp("scratch");
        let dir = t.join("s1");
        {
            let s = Scratch::create(&dir, 1 << 20).expect("scratch");
            assert!(s.upper().is_dir());
            let err = fs::write(s.upper().join("big"), vec![0u8; 2 << 20]).expect_err("past the cap");
            assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        }
        assert!(!dir.exists(), "unmounted and removed on drop");
        fs::remove_dir_all(&t).expect("cleanup");
    }
}
