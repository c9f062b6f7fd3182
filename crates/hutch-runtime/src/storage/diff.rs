//! What a sandbox changed: its layer's upper directory compared with where
//! it started (a snapshot's upper directory, or nothing over its image).
//!
//! Both trees were written by sandboxes, so they are hostile: every walk
//! goes through directory descriptors opened `O_NOFOLLOW` (a symlink is an
//! entry, never followed), bounded in entries, depth and bytes hashed. The
//! image's lower layers are only asked whether a path exists, one component
//! at a time, never through a symlink.

use crate::sys::{cstr, lstatat, openat_nofollow};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Most entries a diff walks (both trees together).
pub const MAX_ENTRIES: usize = 200_000;
/// Deepest directory nesting walked.
pub const MAX_DEPTH: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Added => "added",
            ChangeKind::Modified => "modified",
            ChangeKind::Deleted => "deleted",
        }
    }
}

/// One changed path (absolute in the sandbox), with the new file's size
/// and SHA-256 (none for deletions and directories; a symlink's is of its
/// target text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub path: String,
    pub kind: ChangeKind,
    pub size: Option<u64>,
    pub sha256: Option<String>,
}

/// The image under a layer: directories stacked top first, each mounted at
/// a path of the sandbox's root (`""` for the root; `"usr"` for the host's
/// /usr of `base`).
#[derive(Debug, Clone, Default)]
pub struct Lowers(pub Vec<(String, PathBuf)>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    File,
    Dir,
    Link,
    Whiteout,
    Other,
}

#[derive(Debug, Clone)]
struct Entry {
    ty: Type,
    size: u64,
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    crate::sys::open(path, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
}

/// The entries of a directory (by descriptor), with their types.
fn list(dir: &OwnedFd, budget: &mut usize) -> io::Result<BTreeMap<Vec<u8>, Entry>> {
    let dup = openat_nofollow(dir, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY)?;
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/self/fd/{}", dup.as_raw_fd()))? {
        let e = e?;
        let name = e.file_name();
        *budget = budget.checked_sub(1).ok_or_else(|| io::Error::other("too many entries to compare"))?;
        let st = lstatat(dir, &name)?;
        let ty = match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => Type::File,
            libc::S_IFDIR => Type::Dir,
            libc::S_IFLNK => Type::Link,
            libc::S_IFCHR if st.st_rdev == 0 => Type::Whiteout,
            _ => Type::Other,
        };
        out.insert(name.as_bytes().to_vec(), Entry { ty, size: st.st_size as u64 });
    }
    Ok(out)
}

/// SHA-256 of a regular file's bytes, or of a symlink's target.
fn digest(dir: &OwnedFd, name: &OsStr, ty: Type) -> io::Result<String> {
    let mut h = Sha256::new();
    match ty {
        Type::Link => {
            let c = cstr(name)?;
            let mut buf = vec![0u8; 4096];
            // SAFETY: c is a valid C string, buf a valid buffer of its length.
            let n = unsafe { libc::readlinkat(dir.as_raw_fd(), c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            h.update(&buf[..n as usize]);
        }
        _ => {
            let fd = openat_nofollow(dir, name, libc::O_RDONLY)?;
            let mut f = std::fs::File::from(fd);
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
        }
    }
    Ok(hex::encode(h.finalize()))
}

impl Lowers {
    /// Whether `rel` (components under the root) exists in the image: the
    /// topmost layer that has it or whites it out decides.
    fn has(&self, rel: &[Vec<u8>]) -> bool {
        for (at, dir) in &self.0 {
            let prefix: Vec<&[u8]> = at.split('/').filter(|s| !s.is_empty()).map(str::as_bytes).collect();
            if rel.len() < prefix.len() || rel.iter().zip(&prefix).any(|(a, b)| a.as_slice() != *b) {
                continue;
            }
            let rest = &rel[prefix.len()..];
            match Self::lookup(dir, rest) {
                Some(Type::Whiteout) => return false,
                Some(_) => return true,
                None => continue,
            }
        }
        false
    }

    fn lookup(dir: &Path, rest: &[Vec<u8>]) -> Option<Type> {
        let mut fd = open_dir(dir).ok()?;
        for (i, comp) in rest.iter().enumerate() {
            let name = OsStr::from_bytes(comp);
            let st = lstatat(&fd, name).ok()?;
            let ty = st.st_mode & libc::S_IFMT;
            if i + 1 == rest.len() {
                return Some(if ty == libc::S_IFCHR && st.st_rdev == 0 { Type::Whiteout } else { Type::File });
            }
            if ty != libc::S_IFDIR {
                return None;
            }
            fd = openat_nofollow(&fd, name, libc::O_RDONLY | libc::O_DIRECTORY).ok()?;
        }
        Some(Type::Dir)
    }
}

struct Walk<'a> {
    lowers: &'a Lowers,
    budget: usize,
    out: Vec<Change>,
}

fn show(rel: &[Vec<u8>]) -> String {
    let mut s = String::new();
    for c in rel {
        s.push('/');
        s.push_str(&String::from_utf8_lossy(c));
    }
    if s.is_empty() {
        s.push('/');
    }
    s
}

impl Walk<'_> {
    /// Compares directory `now` (the sandbox's upper) with `then` (where
    /// it started; None: nothing over the image).
    fn dir(&mut self, now: &OwnedFd, then: Option<&OwnedFd>, rel: &mut Vec<Vec<u8>>) -> io::Result<()> {
        if rel.len() > MAX_DEPTH {
            return Err(io::Error::other("directories nested too deep to compare"));
        }
        let a = list(now, &mut self.budget)?;
        let b = match then {
            Some(t) => list(t, &mut self.budget)?,
            None => BTreeMap::new(),
        };
        for (name, e) in &a {
            rel.push(name.clone());
            let os = OsStr::from_bytes(name);
            let old = b.get(name);
            match e.ty {
                Type::Whiteout => {
                    if old.map(|o| o.ty) != Some(Type::Whiteout) && (old.is_some() || self.lowers.has(rel)) {
                        self.push(rel, ChangeKind::Deleted, None);
                    }
                }
                Type::Dir => {
                    let sub = openat_nofollow(now, os, libc::O_RDONLY | libc::O_DIRECTORY)?;
                    let old_sub = match (old.map(|o| o.ty), then) {
                        (Some(Type::Dir), Some(t)) => Some(openat_nofollow(t, os, libc::O_RDONLY | libc::O_DIRECTORY)?),
                        _ => None,
                    };
                    let existed = old.is_some_and(|o| o.ty == Type::Dir) || self.lowers.has(rel);
                    if !existed {
                        self.push(rel, ChangeKind::Added, None);
                    }
                    self.dir(&sub, old_sub.as_ref(), rel)?;
                }
                Type::File | Type::Link | Type::Other => {
                    let hash = if e.ty == Type::Other { None } else { Some(digest(now, os, e.ty)?) };
                    let same = match (old, then) {
                        (Some(o), Some(t)) if o.ty == e.ty && o.size == e.size && e.ty != Type::Other => {
                            hash.is_some() && digest(t, os, o.ty).ok() == hash
                        }
                        _ => false,
                    };
                    if !same {
                        let existed = old.is_some_and(|o| o.ty != Type::Whiteout) || self.lowers.has(rel);
                        let kind = if existed { ChangeKind::Modified } else { ChangeKind::Added };
                        self.out.push(Change { path: show(rel), kind, size: Some(e.size), sha256: hash });
                    }
                }
            }
            rel.pop();
        }
        // What it started with and no longer has: the image's again, or gone.
        for (name, o) in &b {
            if a.contains_key(name) || o.ty == Type::Whiteout {
                continue;
            }
            rel.push(name.clone());
            if self.lowers.has(rel) {
                self.push(rel, ChangeKind::Modified, None);
            } else {
                self.push(rel, ChangeKind::Deleted, None);
            }
            rel.pop();
        }
        Ok(())
    }

    fn push(&mut self, rel: &[Vec<u8>], kind: ChangeKind, size: Option<u64>) {
        self.out.push(Change { path: show(rel), kind, size, sha256: None });
    }
}

/// The changes of `upper` (a layer's upper directory) since `origin` (the
/// upper directory it started as; None: empty, over `lowers` only).
pub fn diff(upper: &Path, origin: Option<&Path>, lowers: &Lowers) -> io::Result<Vec<Change>> {
    let now = open_dir(upper)?;
    let then = origin.map(open_dir).transpose()?;
    let mut w = Walk { lowers, budget: MAX_ENTRIES, out: Vec::new() };
    w.dir(&now, then.as_ref(), &mut Vec::new())?;
    w.out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(w.out)
}

/// Where a diff archive lists the deleted paths: NUL-terminated, one after
/// another.
pub const DELETED_ENTRY: &str = ".hutch-diff/deleted";

/// Opens `path` (absolute in the sandbox) under `upper` one component at
/// a time, never through a symlink: the parent directory and the last name.
fn open_parent(upper: &OwnedFd, path: &str) -> io::Result<(OwnedFd, Vec<u8>)> {
    let comps: Vec<&[u8]> = path.as_bytes().split(|b| *b == b'/').filter(|c| !c.is_empty()).collect();
    let Some((last, dirs)) = comps.split_last() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "the root is not an entry"));
    };
    let mut fd = openat_nofollow(upper, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY)?;
    for d in dirs {
        fd = openat_nofollow(&fd, OsStr::from_bytes(d), libc::O_RDONLY | libc::O_DIRECTORY)?;
    }
    Ok((fd, last.to_vec()))
}

/// Writes to `out` a tar archive of `changes` as they are now in `upper`
/// (added and modified files, symlinks and directories, with their modes,
/// image owners and times), and the deleted paths as [`DELETED_ENTRY`].
/// Streams: it holds one file's read buffer at a time, whatever the sizes.
pub fn archive<W: io::Write>(upper: &Path, changes: &[Change], out: &mut W) -> io::Result<()> {
    let root = open_dir(upper)?;
    let mut b = tar::Builder::new(out);
    let mut deleted = Vec::new();
    for c in changes {
        if c.kind == ChangeKind::Deleted {
            deleted.extend_from_slice(c.path.as_bytes());
            deleted.push(0);
            continue;
        }
        let (dir, name) = open_parent(&root, &c.path)?;
        let name = OsStr::from_bytes(&name);
        let st = lstatat(&dir, name)?;
        let rel = c.path.trim_start_matches('/');
        let mut h = tar::Header::new_gnu();
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(u64::from(st.st_uid));
        h.set_gid(u64::from(st.st_gid));
        h.set_mtime(st.st_mtime.max(0) as u64);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => {
                let fd = openat_nofollow(&dir, name, libc::O_RDONLY)?;
                let f = std::fs::File::from(fd);
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(st.st_size as u64);
                b.append_data(&mut h, rel, f.take(st.st_size as u64))?;
            }
            libc::S_IFDIR => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                b.append_data(&mut h, rel, io::empty())?;
            }
            libc::S_IFLNK => {
                let c = cstr(name)?;
                let mut buf = vec![0u8; 4096];
                // SAFETY: c is a valid C string, buf a valid buffer of its length.
                let n = unsafe { libc::readlinkat(dir.as_raw_fd(), c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                b.append_link(&mut h, rel, OsStr::from_bytes(&buf[..n as usize]))?;
            }
            // Devices, fifos, sockets: not carried.
            _ => {}
        }
    }
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(deleted.len() as u64);
    b.append_data(&mut h, DELETED_ENTRY, deleted.as_slice())?;
    b.into_inner()?.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hutch-diff-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn changes_against_a_start_and_the_image() {
        let root = tmp("t");
        let (lower, then, now) = (root.join("lower"), root.join("then"), root.join("now"));
        for d in [&lower, &then, &now] {
            std::fs::create_dir_all(d.join("w")).expect("mkdir");
        }
        std::fs::write(lower.join("etc-like"), "image").expect("write");
        std::fs::write(lower.join("kept"), "image").expect("write");
        std::fs::write(then.join("w/same"), "x").expect("write");
        std::fs::write(then.join("w/edited"), "old").expect("write");
        std::fs::write(then.join("w/removed"), "r").expect("write");
        std::fs::write(now.join("w/same"), "x").expect("write");
        std::fs::write(now.join("w/edited"), "new").expect("write");
        std::fs::write(now.join("w/new"), "n").expect("write");
        std::fs::write(now.join("etc-like"), "changed").expect("write");
        symlink("/etc/passwd", now.join("w/link")).expect("symlink");
        // A symlink in the image is never followed when asked about.
        symlink("/", lower.join("escape")).expect("symlink");
        let lowers = Lowers(vec![(String::new(), lower.clone())]);
        let got = diff(&now, Some(&then), &lowers).expect("diff");
        let kinds: Vec<(&str, &str)> = got.iter().map(|c| (c.path.as_str(), c.kind.as_str())).collect();
        assert_eq!(
            kinds,
            vec![
                ("/etc-like", "modified"),
                ("/w/edited", "modified"),
                ("/w/link", "added"),
                ("/w/new", "added"),
                ("/w/removed", "deleted"),
            ]
        );
        let edited = got.iter().find(|c| c.path == "/w/edited").expect("edited");
        assert_eq!(edited.size, Some(3));
        assert_eq!(edited.sha256.as_deref(), Some(hex::encode(Sha256::digest(b"new")).as_str()));
        assert!(!lowers.has(&[b"escape".to_vec(), b"etc".to_vec()]));
        // Against the image alone, everything in the upper is a change.
        let all = diff(&now, None, &lowers).expect("diff");
        // (The image has /w: a directory is listed only when it is new.)
        assert!(!all.iter().any(|c| c.path == "/w"));
        assert!(all.iter().any(|c| c.path == "/w/same" && c.kind == ChangeKind::Added));
        let _ = std::fs::remove_dir_all(&root);
    }
}
