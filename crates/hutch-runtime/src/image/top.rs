//! The small layer of ours on top of every image, so that what the agent and
//! the API assume holds in any image: a `user` (uid/gid 1000, home
//! /home/user) next to the image's own accounts, /home/user, /workspace,
//! a sticky /tmp, /etc/hosts, a placeholder /etc/resolv.conf, and the mount
//! points /proc, /sys and /dev.
//!
//! The image's /etc/passwd and /etc/group are read from its layers without
//! following any symlink (a hostile image could point them anywhere on the
//! host); one that is a symlink, a device or too large counts as absent.

use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{chown, DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Largest /etc/passwd or /etc/group read from an image.
const MAX_ACCOUNTS_FILE: u64 = 1 << 20;

const HOSTS: &str = "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n";

/// Builds the top layer for an image whose layers are `lowers` (bottom
/// first) in the empty directory `dir`.
pub fn build(dir: &Path, lowers: &[PathBuf]) -> io::Result<()> {
    let mkdir = |rel: &str, mode: u32, owner: u32| -> io::Result<()> {
        let p = dir.join(rel);
        fs::DirBuilder::new().mode(mode).create(&p)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))?;
        chown(&p, Some(owner), Some(owner))
    };
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    chown(dir, Some(0), Some(0))?;
    for d in ["etc", "home", "proc", "sys", "dev"] {
        mkdir(d, 0o755, 0)?;
    }
    mkdir("tmp", 0o1777, 0)?;
    mkdir("home/user", 0o750, 1000)?;
    mkdir("workspace", 0o755, 1000)?;
    let passwd = read_layered(lowers, b"passwd").unwrap_or_default();
    let group = read_layered(lowers, b"group").unwrap_or_default();
    write(dir, "etc/passwd", &accounts(&passwd, PASSWD_NEEDED), 0o644)?;
    write(dir, "etc/group", &accounts(&group, GROUP_NEEDED), 0o644)?;
    write(dir, "etc/hosts", HOSTS, 0o644)?;
    write(dir, "etc/hostname", "sandbox\n", 0o644)?;
    write(dir, "etc/resolv.conf", "# This sandbox has no network, so no resolver.\n", 0o644)
}

const PASSWD_NEEDED: &[(&str, &str)] =
    &[("root", "root:x:0:0:root:/root:/bin/sh"), ("user", "user:x:1000:1000:user:/home/user:/bin/sh")];
const GROUP_NEEDED: &[(&str, &str)] = &[("root", "root:x:0:"), ("user", "user:x:1000:")];

/// The image's entries (well-formed lines only), then ours that it lacks.
fn accounts(existing: &str, needed: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut names = Vec::new();
    for line in existing.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 3 && !fields[0].is_empty() && line.len() < 1024 {
            names.push(fields[0].to_owned());
            out.push_str(line);
            out.push('\n');
        }
    }
    for (name, line) in needed {
        if !names.iter().any(|n| n == name) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn write(dir: &Path, rel: &str, content: &str, mode: u32) -> io::Result<()> {
    let p = dir.join(rel);
    fs::write(&p, content)?;
    fs::set_permissions(&p, fs::Permissions::from_mode(mode))?;
    chown(&p, Some(0), Some(0))
}

fn open_nofollow(dir: RawFd, name: &[u8], flags: libc::c_int) -> Option<OwnedFd> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: c is a valid C string; the result is checked and owned below.
    let fd = unsafe { libc::openat(dir, c.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    // SAFETY: fd was just opened and belongs to nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// What `etc/<name>` holds in the stack of `lowers` (topmost wins), read
/// without following symlinks; whiteouts and opaque /etc directories are
/// honoured. None when absent or not a plain, small file.
fn read_layered(lowers: &[PathBuf], name: &[u8]) -> Option<String> {
    for layer in lowers.iter().rev() {
        let root = open_nofollow(libc::AT_FDCWD, layer.as_os_str().as_encoded_bytes(), libc::O_DIRECTORY)?;
        let Some(etc) = open_nofollow(root.as_raw_fd(), b"etc", libc::O_DIRECTORY | libc::O_RDONLY) else {
            if exists(root.as_raw_fd(), b"etc") {
                // A whiteout, a symlink or a file hides every lower /etc.
                return None;
            }
            continue;
        };
        if let Some(fd) = open_nofollow(etc.as_raw_fd(), name, libc::O_RDONLY | libc::O_NONBLOCK) {
            let mut f = fs::File::from(fd);
            let meta = f.metadata().ok()?;
            if !meta.is_file() || meta.len() > MAX_ACCOUNTS_FILE {
                return None;
            }
            let mut s = String::new();
            f.by_ref().take(MAX_ACCOUNTS_FILE).read_to_string(&mut s).ok()?;
            return Some(s);
        }
        if exists(etc.as_raw_fd(), name) {
            return None;
        }
        if super::extract::get_opaque(&layer.join("etc")).unwrap_or(false) {
            return None;
        }
    }
    None
}

fn exists(dir: RawFd, name: &[u8]) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else { return false };
    // SAFETY: zeroed stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string and st a valid out-pointer.
    unsafe { libc::fstatat(dir, c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_keep_the_image_and_add_ours() {
        let got = accounts("root:x:0:0::/root:/bin/ash\nnode:x:1000:1000::/home/node:/bin/sh\njunk\n", PASSWD_NEEDED);
        assert!(got.starts_with("root:x:0:0::/root:/bin/ash\nnode:"));
        assert!(got.ends_with("user:x:1000:1000:user:/home/user:/bin/sh\n"));
        assert!(!got.contains("junk"));
        assert_eq!(accounts("user:x:1000:\n", GROUP_NEEDED), "user:x:1000:\nroot:x:0:\n");
    }

    #[test]
    fn passwd_through_a_symlink_is_not_read() {
        let base = std::env::temp_dir().join(format!("hutch-top-{}", super::super::random_suffix()));
        let (l0, l1, top) = (base.join("l0"), base.join("l1"), base.join("top"));
        for d in [&l0.join("etc"), &l1.join("etc"), &top] {
            fs::create_dir_all(d).expect("mkdir");
        }
        fs::write(l0.join("etc/passwd"), "lower:x:5:5::/:/bin/sh\n").expect("write");
        std::os::unix::fs::symlink("/etc/shadow", l1.join("etc/passwd")).expect("symlink");
        assert_eq!(read_layered(std::slice::from_ref(&l0), b"passwd").as_deref(), Some("lower:x:5:5::/:/bin/sh\n"));
        assert_eq!(read_layered(&[l0.clone(), l1.clone()], b"passwd"), None, "the symlink hides, is not followed");
        build(&top, &[l0, l1]).expect("build");
        let passwd = fs::read_to_string(top.join("etc/passwd")).expect("read");
        assert!(!passwd.contains("root:*") && !passwd.contains("root:$"), "no host shadow: {passwd}");
        assert!(passwd.contains("user:x:1000:1000"));
        fs::remove_dir_all(&base).expect("cleanup");
    }
}
