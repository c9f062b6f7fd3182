//! Tenants: the sandboxes of the `process` class, many inside one shared
//! host container whose agent this is.
//!
//! A tenant is an identity, not a set of namespaces: a uid of its own
//! (never given out twice by this agent, so nothing a former tenant left
//! behind, a SysV IPC object say, reaches a later one), a home
//! (`/home/<name>`, 0700) and a temporary directory (`/tmp/<name>`, 0700)
//! owned by it, the cgroup the host made for it (its descriptors come with
//! [`proto::Request::AddTenant`]), resource limits, and a Landlock ruleset
//! made once here and applied by each of its commands before exec: read
//! and run beneath `/`, write only beneath its home and its /tmp (and to
//! existing files of /dev and /proc, which DAC guards). From Landlock ABI 6
//! the ruleset also scopes signals and abstract unix sockets to the
//! tenant's own processes. Without Landlock a tenant is refused
//! ([`ErrorCode::Unsupported`]): uids alone would let one tenant write
//! into every world-writable place of the shared root.
//!
//! The tenant's identity is bound to its listening socket: every connection
//! accepted there is the tenant's, whatever it asks (see `server.rs`).

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};

use hutch_agent::proto::{ErrorCode, TenantSpec, MAX_WORK_CGROUPS, TENANT_TREE_CGROUPS};

use super::sys::{self, ll};
use super::tree::{TreeCgroup, TreeCgroups};
use super::users::User;

/// The first uid a tenant gets; those below are the image's own users.
pub const FIRST_UID: u32 = 10_000;
/// One past the last uid a tenant gets (the host container's user
/// namespace maps 65536 ids; 65534 is `nobody`).
pub const END_UID: u32 = 65_000;

pub type TenantError = (ErrorCode, String);

/// One tenant.
pub struct Tenant {
    pub name: String,
    pub uid: u32,
    pub home: String,
    pub listener: OwnedFd,
    pub listen_events: u32,
    /// `cgroup.procs` files every command joins, in order.
    pub cgroups: Vec<OwnedFd>,
    pub oom_events: Option<OwnedFd>,
    /// The command cgroups the host made for it, while no command holds
    /// them (none: every command gets a supervisor).
    pub trees: Option<TreeCgroups>,
    pub ruleset: OwnedFd,
    pub env: Vec<(String, String)>,
    pub rlimits: Vec<(i32, u64)>,
    pub max_commands: usize,
}

impl Tenant {
    /// The user its commands and file operations run as.
    pub fn user(&self) -> User {
        User { name: "user".into(), uid: self.uid, gid: self.uid, home: self.home.clone(), shell: "/bin/sh".into() }
    }

    /// Its temporary directory.
    pub fn tmp(&self) -> String {
        format!("/tmp/{}", self.name)
    }
}

/// Every tenant of this agent.
#[derive(Default)]
pub struct Tenants {
    pub by_id: HashMap<u64, Tenant>,
    by_name: HashMap<String, u64>,
    next_id: u64,
    /// The next uid to give out; uids are never reused.
    next_uid: u32,
    /// The shared directories were closed to tenants.
    prepared: bool,
}

/// Refuses to make tenants where Landlock is missing: the process class
/// depends on it (see the module's documentation).
pub fn require_landlock(abi: Result<i64, sys::Errno>) -> Result<i64, TenantError> {
    match abi {
        Ok(v) if v >= 1 => Ok(v),
        Ok(_) | Err(_) => Err((
            ErrorCode::Unsupported,
            "the process class needs Landlock, which this kernel does not offer (boot with lsm=landlock,...)".into(),
        )),
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn io(what: &str, e: sys::Errno) -> TenantError {
    (ErrorCode::Io, format!("{what}: {e}"))
}

fn cpath(p: &str) -> CString {
    CString::new(p).expect("tenant paths are checked names")
}

/// Makes `path` a directory of `uid`'s with mode 0700; refuses one that
/// exists (a tenant never inherits files).
fn private_dir(path: &str, uid: u32) -> Result<(), TenantError> {
    let c = cpath(path);
    sys::mkdir_path(&c, 0o700).map_err(|e| io(&format!("mkdir {path}"), e))?;
    sys::chown_path(&c, uid, uid).map_err(|e| io(&format!("chown {path}"), e))
}

impl Tenants {
    pub fn get(&self, id: u64) -> Option<&Tenant> {
        self.by_id.get(&id)
    }

    /// Closes the world-writable directories of the shared root to tenants
    /// (each writes only in its own directories), once.
    fn prepare(&mut self) -> Result<(), TenantError> {
        if self.prepared {
            return Ok(());
        }
        for (dir, mode) in [("/tmp", 0o711), ("/var/tmp", 0o711), ("/dev/shm", 0o711), ("/home", 0o711)] {
            let c = cpath(dir);
            match sys::chmod_path(&c, mode) {
                Ok(()) | Err(sys::Errno(libc::ENOENT)) => {}
                Err(e) => return Err(io(&format!("chmod {dir}"), e)),
            }
        }
        self.prepared = true;
        Ok(())
    }

    /// Makes a tenant from the request and its descriptors (listening
    /// socket, cgroup files, OOM counter); returns its id.
    pub fn add(
        &mut self,
        spec: TenantSpec,
        fds: Vec<OwnedFd>,
        abi: Result<i64, sys::Errno>,
    ) -> Result<u64, TenantError> {
        let abi = require_landlock(abi)?;
        let bad = |m: String| (ErrorCode::InvalidRequest, m);
        if !valid_name(&spec.name) {
            return Err(bad(format!("invalid tenant name {:?}", spec.name)));
        }
        if self.by_name.contains_key(&spec.name) {
            return Err((ErrorCode::AlreadyExists, format!("tenant {} exists", spec.name)));
        }
        if spec.cgroups == 0 || spec.cgroups > 2 * MAX_WORK_CGROUPS {
            return Err(bad(format!("{} cgroup files", spec.cgroups)));
        }
        if spec.tree_cgroups > TENANT_TREE_CGROUPS {
            return Err(bad(format!("{} command cgroups", spec.tree_cgroups)));
        }
        let want = 1 + spec.cgroups as usize + usize::from(spec.oom_events) + 3 * spec.tree_cgroups as usize;
        if fds.len() != want {
            return Err(bad(format!("{} descriptors came with the request, {want} were announced", fds.len())));
        }
        if self.next_uid == 0 {
            self.next_uid = FIRST_UID;
        }
        if self.next_uid >= END_UID {
            return Err((ErrorCode::Capacity, "this host container gave out all its tenant uids".into()));
        }
        self.prepare()?;
        let uid = self.next_uid;
        let home = format!("/home/{}", spec.name);
        let tmp = format!("/tmp/{}", spec.name);
        private_dir(&home, uid)?;
        // From here on a failure leaves a directory: the uid is spent
        // anyway, and removing them again is the cleanup.
        self.next_uid += 1;
        let made = (|| {
            private_dir(&tmp, uid)?;
            let open = |p: &str| {
                sys::open(&cpath(p), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
                    .map_err(|e| io(&format!("open {p}"), e))
            };
            let (root, dev, procfs, home_fd, tmp_fd) =
                (open("/")?, open("/dev")?, open("/proc")?, open(&home)?, open(&tmp)?);
            let all = ll::handled(abi);
            sys::landlock_ruleset(
                abi,
                &[
                    (root.as_fd(), ll::READ),
                    (dev.as_fd(), ll::READ | ll::WRITE_FILE | ll::TRUNCATE | ll::IOCTL_DEV),
                    (procfs.as_fd(), ll::READ | ll::WRITE_FILE),
                    (home_fd.as_fd(), all),
                    (tmp_fd.as_fd(), all),
                ],
            )
            .map_err(|e| io("landlock ruleset", e))
        })();
        let ruleset = match made {
            Ok(r) => r,
            Err(e) => {
                remove_dirs(&home, &tmp);
                return Err(e);
            }
        };
        let mut fds = fds.into_iter();
        let listener = fds.next().expect("counted above");
        if let Err(e) = sys::set_nonblocking(listener.as_fd()) {
            remove_dirs(&home, &tmp);
            return Err(io("listening socket", e));
        }
        let cgroups: Vec<OwnedFd> = fds.by_ref().take(spec.cgroups as usize).collect();
        let oom_events = if spec.oom_events { fds.next() } else { None };
        // Counted above: three descriptors each.
        let made: Vec<TreeCgroup> = (0..u64::from(spec.tree_cgroups))
            .map_while(|n| Some(TreeCgroup::from_files(n, fds.next()?, fds.next()?, fds.next()?)))
            .collect();
        let trees = (!made.is_empty()).then(|| TreeCgroups::fixed(made));
        self.next_id += 1;
        let id = self.next_id;
        self.by_name.insert(spec.name.clone(), id);
        self.by_id.insert(
            id,
            Tenant {
                name: spec.name,
                uid,
                home,
                listener,
                listen_events: 0,
                cgroups,
                oom_events,
                trees,
                ruleset,
                env: spec.env,
                rlimits: spec.rlimits,
                max_commands: spec.max_commands.max(1) as usize,
            },
        );
        Ok(id)
    }

    /// Forgets a tenant and removes its directories; the caller closes its
    /// connections and ends its processes.
    pub fn remove(&mut self, name: &str) -> Option<(u64, Tenant)> {
        let id = self.by_name.remove(name)?;
        let t = self.by_id.remove(&id)?;
        remove_dirs(&t.home, &t.tmp());
        Some((id, t))
    }
}

/// Removes a tenant's directories, without following anything it planted.
fn remove_dirs(home: &str, tmp: &str) {
    let Ok(root) = sys::open(c"/", libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) else { return };
    let fs = super::files::Fs::new(root);
    let _guard = fs.no_follow();
    for dir in [home, tmp] {
        let _ = fs.remove(dir);
    }
}

/// A tenant's workspace is its home: the API's default directory
/// (`/workspace`, where relative paths and commands start) is the tenant's
/// `/home/<name>`, under its own name too.
pub fn workspace_is_home(path: String, home: &str) -> String {
    match path.strip_prefix("/workspace") {
        Some("") => home.to_owned(),
        Some(rest) if rest.starts_with('/') => format!("{home}{rest}"),
        _ => path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_is_the_home() {
        let w = |p: &str| workspace_is_home(p.into(), "/home/a");
        assert_eq!(w("/workspace"), "/home/a");
        assert_eq!(w("/workspace/x/y"), "/home/a/x/y");
        assert_eq!(w("/workspaces"), "/workspaces");
        assert_eq!(w("/etc/passwd"), "/etc/passwd");
    }

    #[test]
    fn no_landlock_no_tenant() {
        assert_eq!(require_landlock(Ok(0)).expect_err("refused").0, ErrorCode::Unsupported);
        assert_eq!(require_landlock(Err(sys::Errno(libc::ENOSYS))).expect_err("refused").0, ErrorCode::Unsupported);
        assert_eq!(require_landlock(Err(sys::Errno(libc::EOPNOTSUPP))).expect_err("refused").0, ErrorCode::Unsupported);
        assert_eq!(require_landlock(Ok(7)), Ok(7));
    }

    #[test]
    fn a_tenant_is_refused_before_anything_is_made_without_landlock() {
        let mut t = Tenants::default();
        let spec = TenantSpec {
            name: "a".into(),
            cgroups: 1,
            oom_events: false,
            tree_cgroups: 0,
            env: vec![],
            max_commands: 4,
            rlimits: vec![],
        };
        let err = t.add(spec, Vec::new(), Ok(0)).expect_err("refused");
        assert_eq!(err.0, ErrorCode::Unsupported);
        assert!(t.by_id.is_empty() && !t.prepared && t.next_uid == 0);
    }

    #[test]
    fn names_are_checked() {
        assert!(valid_name("sb-1a"));
        for bad in ["", "../x", "A", "a/b", &"a".repeat(65)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
