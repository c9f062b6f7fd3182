//! The `process` isolation class: a sandbox is a tenant of a shared, long
//! lived *host container* (a container-class sandbox started with
//! [`Runtime::start_host`]): a uid of its own inside the host's user
//! namespace, a private home and /tmp directory, a cgroup of its own, the
//! host's seccomp profile, resource limits, and a Landlock domain (the
//! agent's half: hutch-agent's `tenants.rs`).
//!
//! Creating one does no namespace, mount or network work: a cgroup, a
//! listening socket, and one request to the host's agent, which passes the
//! tenant's descriptors ([`hutch_agent::proto::Request::AddTenant`]).
//! The tenant's cgroup is named after the sandbox like any sandbox's (so
//! usage, freeze and kill work unchanged); its commands join it. Where
//! commands can have a cgroup of their own (`Cgroup::tree_dir`), the
//! runtime also makes [`proto::TENANT_TREE_CGROUPS`] of them below the
//! tenant's v2 cgroup and passes their files: a command in one needs no
//! supervisor to track its tree.
//!
//! The class refuses to run without Landlock: the tenants share a root
//! file system and uids alone do not keep one out of every world-writable
//! place of it.

use crate::agent::{AgentConn, AgentError};
use crate::cgroup::Limits;
use crate::container::{io_err, listen_at, random_id, valid_id, Liveness, Runtime, RuntimeError, Sandbox, KERNEL_CAPS};
use hutch_agent::proto::{self, Reply, Request, TenantSpec};
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

/// Command slots of a host container's agent: all its tenants' together
/// (each tenant has [`proto::MAX_COMMANDS`] of its own).
pub const HOST_COMMANDS: u32 = 1024;

/// Landlock's ABI version on this kernel (0: unavailable).
pub fn landlock_abi() -> i64 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute, size 0 and the VERSION flag, the call
    // only returns the ABI version.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    ret.max(0)
}

/// Refuses the process class where Landlock is missing (the one probe
/// [`Runtime::runs`] and capabilities answer with).
pub fn require_landlock(abi: i64) -> Result<i64, String> {
    if abi >= 1 {
        Ok(abi)
    } else {
        Err("it needs Landlock, which this kernel does not offer (boot with lsm=landlock,...)".into())
    }
}

/// What one process-class sandbox gets.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    /// Chosen by the caller, or random when `None`.
    pub id: Option<String>,
    pub limits: Limits,
    /// Environment of its processes, on top of the host container's.
    pub env: Vec<(String, String)>,
}

impl Runtime {
    /// Makes a process-class sandbox inside `host` (from
    /// [`Runtime::start_host`]). On error nothing of it is left.
    pub fn start_tenant(&self, host: &Sandbox, spec: &ProcessSpec) -> Result<Sandbox, RuntimeError> {
        require_landlock(landlock_abi())
            .map_err(|why| RuntimeError::ClassUnavailable(hutch_api::Class::Process, why))?;
        let started = Instant::now();
        let id = match &spec.id {
            Some(id) => valid_id(id)?,
            None => random_id()?,
        };
        let cgroup = self.new_cgroup(&id, &spec.limits, 0)?;
        let cg_done = started.elapsed();
        let socket = self.socket_path(&id);
        let mut sandbox = Sandbox {
            id,
            pid: host.pid,
            socket,
            cgroup,
            slot: None,
            layer: None,
            timings: Vec::new(),
            host: Some(host.socket.clone()),
            gvisor: None,
        };
        match self.add_tenant(&sandbox, host, spec) {
            Ok(()) => {
                sandbox.timings = vec![("cgroup", cg_done), ("tenant", started.elapsed() - cg_done)];
                Ok(sandbox)
            }
            Err(e) => {
                let _ = sandbox.destroy();
                Err(e)
            }
        }
    }

    fn add_tenant(&self, sb: &Sandbox, host: &Sandbox, spec: &ProcessSpec) -> Result<(), RuntimeError> {
        let listener = listen_at(&sb.socket)?;
        let mut files: Vec<File> = Vec::new();
        for path in sb.cgroup.command_procs_files() {
            let f = fs::OpenOptions::new().write(true).custom_flags(libc::O_CLOEXEC).open(&path);
            files.push(f.map_err(io_err(format!("open {}", path.display())))?);
        }
        let cgroups = files.len() as u32;
        let oom_events = match sb.cgroup.oom_events_file() {
            Some(path) => {
                let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(&path);
                files.push(f.map_err(io_err(format!("open {}", path.display())))?);
                true
            }
            None => false,
        };
        // Command cgroups below the tenant's v2 cgroup, where commands can
        // have one (`Cgroup::tree_dir`): made and opened here, as the host,
        // since nothing of the host's cgroups is delegated to the host
        // container. Removed with the tenant's cgroup.
        let mut tree_cgroups = 0;
        if let Some(dir) = sb.cgroup.tree_dir() {
            for n in 0..proto::TENANT_TREE_CGROUPS {
                let c = dir.join(format!("c{n}"));
                fs::create_dir(&c).map_err(io_err(format!("make {}", c.display())))?;
                for (file, read, write) in
                    [("cgroup.procs", true, true), ("cgroup.events", true, false), ("cgroup.kill", false, true)]
                {
                    let path = c.join(file);
                    let f = fs::OpenOptions::new().read(read).write(write).custom_flags(libc::O_CLOEXEC).open(&path);
                    files.push(f.map_err(io_err(format!("open {}", path.display())))?);
                }
                tree_cgroups += 1;
            }
        }
        let mut rlimits: Vec<(i32, u64)> = KERNEL_CAPS.rlimits().iter().map(|&(r, v)| (r, v)).collect();
        rlimits.push((libc::RLIMIT_NPROC as i32, spec.limits.pids as u64));
        let req = Request::AddTenant(TenantSpec {
            name: sb.id.clone(),
            cgroups,
            oom_events,
            tree_cgroups,
            env: spec.env.clone(),
            max_commands: proto::MAX_COMMANDS,
            rlimits,
        });
        let mut fds = vec![listener.as_raw_fd()];
        fds.extend(files.iter().map(|f| f.as_raw_fd()));
        let mut conn = AgentConn::connect(&host.socket)?;
        match conn.call_with_fds(req, &fds)?.0 {
            Reply::TenantAdded { .. } => Ok(()),
            other => Err(AgentError::Protocol(proto::FrameError::BadHeader(format!(
                "unexpected reply to AddTenant: {other:?}"
            )))
            .into()),
        }
    }
}

impl Sandbox {
    /// Whether this is a process-class sandbox (a tenant of a host).
    pub fn is_tenant(&self) -> bool {
        self.host.is_some()
    }

    /// Kills the tenant's processes, removes its cgroup, then has the host's
    /// agent forget it (its socket, connections and directories).
    pub(crate) fn destroy_tenant(self) -> Result<(), RuntimeError> {
        let Sandbox { id, socket, cgroup, host, .. } = self;
        let _ = cgroup.kill_all();
        let removed = cgroup.destroy(Duration::from_secs(5));
        let _ = fs::remove_file(&socket);
        if let Some(host) = host {
            // The host gone is the tenant gone.
            if let Ok(mut conn) = AgentConn::connect(&host) {
                match conn.call(Request::RemoveTenant { name: id }, &[]) {
                    Ok(_) | Err(AgentError::Io(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(removed?)
    }

    /// A tenant lives while its host's agent and its socket do.
    pub(crate) fn tenant_liveness(&self) -> Liveness {
        if self.pid <= 0 {
            return Liveness::Unknown(std::io::Error::other("host container unknown"));
        }
        match fs::metadata(format!("/proc/{}", self.pid)) {
            Ok(_) if self.socket.exists() => Liveness::Alive,
            Ok(_) => Liveness::Dead,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Liveness::Dead,
            Err(e) => Liveness::Unknown(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_landlock_no_process_class() {
        assert!(require_landlock(0).expect_err("refused").contains("Landlock"));
        assert!(require_landlock(-1).is_err());
        assert_eq!(require_landlock(7).expect("ABI 7"), 7);
    }
}
