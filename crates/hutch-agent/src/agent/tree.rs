//! Command trees tracked by cgroups, without a supervisor process.
//!
//! Where the host delegates a directory of the sandbox's cgroup v2 tree to
//! the sandbox's root (`AgentConfig::tree_cgroup`), every command gets a
//! cgroup of its own there, `c<n>`, which its main process joins before it
//! execs; everything it starts is born there. So the agent spawns the
//! command itself and still knows its whole tree: `populated` in
//! `cgroup.events` says whether any process of it lives (a zombie does not
//! count), a change of it wakes the agent's epoll (`EPOLLPRI`),
//! `cgroup.kill` ends all of it at once, and `cgroup.procs` lists it for
//! other signals. A per-command supervisor (child.rs) costs two more
//! process hand-offs per command; it stays where no such directory is
//! passed (gVisor, pure cgroup v2 hosts).
//!
//! An emptied cgroup is kept for the next command: making and removing one
//! per command would cost a cgroup's life each time. The host bounds how
//! many there can be (`cgroup.max.descendants`, `cgroup.max.depth` of the
//! delegated directory, which it keeps for itself) and removes them with
//! the sandbox.
//!
//! A process-class tenant's cgroups are the host's, not its container's:
//! nothing is delegated. The host makes a few command cgroups below the
//! tenant's v2 cgroup and passes their files ([`TreeCgroups::fixed`]); a
//! tenant's command takes one of them while one is free, and a supervisor
//! otherwise.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use super::sys::{self, Errno};

/// Emptied command cgroups kept for the next commands; more are removed.
/// Each costs the host about 8 KiB of kernel memory (an empty v2 cgroup,
/// measured), which an idle sandbox keeps.
const KEEP_FREE: usize = 4;

/// The command cgroups no command holds, and the delegated directory to
/// make more in (none: a fixed set, the host's).
pub struct TreeCgroups {
    dir: Option<OwnedFd>,
    free: Vec<TreeCgroup>,
    next: u64,
}

/// One command's cgroup, with its files open (close-on-exec).
pub struct TreeCgroup {
    name: CString,
    /// `cgroup.procs`, read-write: the command's main process joins here,
    /// and it lists the tree's processes.
    procs: OwnedFd,
    /// `cgroup.events`, for reading and for epoll.
    events: OwnedFd,
    /// `cgroup.kill`, for writing.
    kill: OwnedFd,
}

impl TreeCgroups {
    pub fn new(dir: OwnedFd) -> TreeCgroups {
        TreeCgroups { dir: Some(dir), free: Vec::new(), next: 0 }
    }

    /// The cgroups the host made for a tenant's commands; no more can be.
    pub fn fixed(made: Vec<TreeCgroup>) -> TreeCgroups {
        TreeCgroups { dir: None, free: made, next: 0 }
    }

    /// Whether [`TreeCgroups::take`] has one without making it.
    pub fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// An empty command cgroup: a kept one, or a new one (EAGAIN for a
    /// fixed set with none free).
    pub fn take(&mut self) -> Result<TreeCgroup, Errno> {
        if let Some(c) = self.free.pop() {
            return Ok(c);
        }
        let Some(dir) = &self.dir else { return Err(Errno(libc::EAGAIN)) };
        let name = name(self.next);
        self.next += 1;
        // Names are never reused: an EEXIST is nothing of ours.
        sys::mkdirat(dir.as_fd(), &name, 0o755)?;
        let open = |file: &str, flags| {
            let path = CString::new(format!("{}/{file}", name.to_string_lossy())).map_err(|_| Errno(libc::EINVAL))?;
            sys::openat(dir.as_fd(), &path, flags, 0)
        };
        let files = || -> Result<_, Errno> {
            Ok((
                open("cgroup.procs", libc::O_RDWR)?,
                open("cgroup.events", libc::O_RDONLY)?,
                open("cgroup.kill", libc::O_WRONLY)?,
            ))
        };
        match files() {
            Ok((procs, events, kill)) => Ok(TreeCgroup { name, procs, events, kill }),
            Err(e) => {
                let _ = sys::unlinkat(dir.as_fd(), &name, libc::AT_REMOVEDIR);
                Err(e)
            }
        }
    }

    /// Takes back a command's cgroup once nothing of its tree lives. A
    /// fixed set keeps all of its own.
    pub fn put(&mut self, c: TreeCgroup) {
        match &self.dir {
            Some(dir) if self.free.len() >= KEEP_FREE => {
                let name = c.name.clone();
                drop(c);
                let _ = sys::unlinkat(dir.as_fd(), &name, libc::AT_REMOVEDIR);
            }
            _ => self.free.push(c),
        }
    }
}

impl TreeCgroup {
    /// The `n`-th cgroup the host made, from its files: `cgroup.procs`
    /// (read-write), `cgroup.events`, `cgroup.kill`.
    pub fn from_files(n: u64, procs: OwnedFd, events: OwnedFd, kill: OwnedFd) -> TreeCgroup {
        TreeCgroup { name: name(n), procs, events, kill }
    }

    /// The live processes of its tree, from its `cgroup.procs`.
    pub fn members(&self) -> Vec<i32> {
        let mut text = Vec::new();
        let mut buf = [0u8; 4096];
        // From the start each time; a tree is bounded by the pids limit,
        // and so is this.
        loop {
            match sys::pread(self.procs.as_fd(), &mut buf, text.len() as u64) {
                Ok(0) | Err(_) => break,
                Ok(n) => text.extend_from_slice(&buf[..n]),
            }
        }
        super::child::parse_pids(&String::from_utf8_lossy(&text))
    }

    /// Its `cgroup.procs`, for the child to write itself into.
    pub fn procs(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    /// Its `cgroup.events`, which epoll reports (`EPOLLPRI`) when it changes.
    pub fn events(&self) -> BorrowedFd<'_> {
        self.events.as_fd()
    }

    /// Whether a process of the tree lives. Reading also acknowledges the
    /// change that woke epoll.
    pub fn populated(&self) -> Result<bool, Errno> {
        let mut buf = [0u8; 128];
        let n = sys::pread(self.events.as_fd(), &mut buf, 0)?;
        parse_populated(&buf[..n]).ok_or(Errno(libc::EIO))
    }

    /// SIGKILLs every process of the tree, at once.
    pub fn kill(&self) -> Result<(), Errno> {
        sys::pwrite(self.kill.as_fd(), b"1", 0).map(|_| ())
    }
}

/// `c<n>`, the name of the `n`-th command cgroup.
fn name(n: u64) -> CString {
    CString::new(format!("c{n}")).expect("a number holds no NUL")
}

/// `populated` of a `cgroup.events` file.
pub fn parse_populated(text: &[u8]) -> Option<bool> {
    match cgroup_key(text, "populated")? {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

/// The value of `key` in a cgroup file of "key value" lines
/// (`cgroup.events`, `memory.events`, v1's `memory.oom_control`).
pub fn cgroup_key<'a>(text: &'a [u8], key: &str) -> Option<&'a str> {
    let text = std::str::from_utf8(text).ok()?;
    text.lines().find_map(|l| l.split_once(' ').filter(|(k, _)| *k == key).map(|(_, v)| v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// Where the host's cgroup v2 tree is mounted.
    fn v2_root() -> std::path::PathBuf {
        let mounts = std::fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
        let line = mounts.lines().find(|l| l.split(' ').nth(2) == Some("cgroup2")).expect("a cgroup2 mount");
        line.split(' ').nth(1).expect("a mount point").into()
    }

    /// A cgroup of the host's v2 tree for one test, removed with what is
    /// below it when dropped.
    struct Scratch(std::path::PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            if let Ok(entries) = std::fs::read_dir(&self.0) {
                for e in entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
                    let _ = std::fs::write(e.path().join("cgroup.kill"), "1");
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    #[test]
    fn a_command_cgroup_tracks_its_tree_is_killed_whole_and_serves_the_next() {
        let scratch = Scratch(v2_root().join(format!("hutch-tree-test-{}", std::process::id())));
        std::fs::create_dir(&scratch.0).expect("a test cgroup (run as root)");
        let path = CString::new(scratch.0.as_os_str().as_encoded_bytes()).expect("path");
        let dir = sys::open(&path, libc::O_RDONLY | libc::O_DIRECTORY).expect("open the test cgroup");
        let mut trees = TreeCgroups::new(dir);
        let c = trees.take().expect("a command cgroup");
        assert!(scratch.0.join("c0").is_dir());
        assert_eq!(c.populated(), Ok(false));
        // A shell that leaves a setsid'd grandchild and exits: the tree
        // lives on in the cgroup after the main process is gone.
        let procs = c.procs();
        // SAFETY: the closure only writes to a descriptor before exec.
        let mut main = unsafe {
            std::process::Command::new("sh")
                .args(["-c", "setsid sleep 600 >/dev/null & echo started"])
                .stdout(std::process::Stdio::piped())
                .pre_exec(move || sys::write_all(procs, b"0").map_err(|e| std::io::Error::from_raw_os_error(e.0)))
                .spawn()
                .expect("spawn")
        };
        let mut out = String::new();
        std::io::Read::read_to_string(main.stdout.as_mut().expect("stdout"), &mut out).expect("read");
        assert_eq!(out, "started\n");
        assert!(main.wait().expect("wait").success());
        assert_eq!(c.populated(), Ok(true), "the grandchild lives");
        let members = c.members();
        assert_eq!(members.len(), 1, "{members:?}");
        c.kill().expect("cgroup.kill");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while c.populated() != Ok(false) {
            assert!(std::time::Instant::now() < deadline, "the tree outlived cgroup.kill");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(c.members().is_empty());
        // An emptied cgroup serves the next command; no new one is made.
        trees.put(c);
        let again = trees.take().expect("the kept cgroup");
        assert_eq!(again.name.as_bytes(), b"c0");
        assert!(!scratch.0.join("c1").exists());
    }

    #[test]
    fn populated_is_read_from_cgroup_events() {
        assert_eq!(parse_populated(b"populated 1\nfrozen 0\n"), Some(true));
        assert_eq!(parse_populated(b"populated 0\nfrozen 1\n"), Some(false));
        assert_eq!(parse_populated(b"frozen 0\n"), None);
        assert_eq!(parse_populated(b"populated 2\n"), None);
        assert_eq!(parse_populated(&[0xff]), None);
    }
}
