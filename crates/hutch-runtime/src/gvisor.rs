//! The `gvisor` isolation class: the sandbox runs under `runsc` (gVisor),
//! a user-space kernel between the workload and the host's, on the ptrace
//! platform, with the agent as its first process.
//!
//! What the host prepares is the container class's: the same image layers
//! and writable layer, stacked by an overlay mounted on the host (the
//! bundle's `rootfs`), which gVisor's gofer serves to the sandbox; the same
//! network namespace (named by path in the OCI spec; runsc's netstack takes
//! its addresses and routes, so the host's nftables policy still applies on
//! the veth); a cgroup of the same name (made by runsc from the spec's
//! `linux.resources`), holding the sentry, gofer and everything they run.
//!
//! The agent link: runsc passes no descriptor but stdio into a sandbox, so
//! the agent, started with `--dir /run/hutch`, makes its own listening
//! socket there. That directory is a bind of the host's
//! `<run>/gv/<id>/`, and `--host-uds=create` makes a socket bound in it a
//! real host socket. The host moves it, once bound, to the container class's
//! place (`<run>/sockets/<id>.sock`), where the sandbox cannot reach it: the
//! daemon never connects through a path the sandbox could replace with a
//! symlink. See ARCHITECTURE.md.
//!
//! Host processes: `runsc run --detach` (or `restore --detach`) leaves the
//! sentry and the gofer behind when it returns. It runs under a reaper of
//! its own (the agent binary's `--reap` mode, see
//! [`Runtime::sandbox_runsc`]), which inherits them, reaps them and the
//! sentry's helper processes as they end, and exits after the last; it is
//! outside the sandbox's cgroup.
//!
//! Host layout of sandbox `id`, every part of it removed by
//! [`Runtime::destroy_gvisor`] or [`Runtime::sweep`]:
//! - `<run>/gv/<id>/`: the agent's directory (config, then its socket);
//! - `<run>/gvb/<id>/`: the OCI bundle: `config.json`, `rootfs` (the overlay),
//!   `mem` (the tmpfs of a memory writable layer);
//! - `<run>/runsc/<id>`: runsc's state, under the runtime's own `--root`;
//! - the cgroups `hutch/<id>`.

use crate::cgroup::{Cgroup, Limits};
use crate::container::{io_err, Marks, RootSource, Runtime, RuntimeError, Sandbox, SandboxSpec, Writable};
use crate::rootfs;
use crate::storage::StorageError;
use hutch_agent::proto::{self, AgentConfig};
use serde_json::{json, Value};
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The runsc binary: `HUTCH_RUNSC`, else `runsc` on the PATH.
pub fn runsc_path() -> PathBuf {
    std::env::var_os("HUTCH_RUNSC").map(PathBuf::from).unwrap_or_else(|| "runsc".into())
}

/// Where the agent's directory is mounted in the sandbox.
const AGENT_DIR: &str = "/run/hutch";
/// Where the agent binary is mounted in the sandbox.
const AGENT_BIN: &str = "/run/hutch-agent";
/// How long the agent has to bind its socket after runsc started it.
const AGENT_WAIT: Duration = Duration::from_secs(20);

/// Every capability: the agent is the sandbox's root, as in the container
/// class (whose agent holds them all in its user namespace); it cuts the
/// bounding set to [`crate::container::ROOT_CAPS`] for workloads.
const ALL_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_ADMIN",
    "CAP_SYS_RESOURCE",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
];

/// The host paths of one gvisor sandbox.
#[derive(Debug, Clone)]
pub struct Paths {
    pub id: String,
    /// runsc's `--root`, shared by the runtime's gvisor sandboxes.
    pub state_root: PathBuf,
    /// The agent's directory, bound at [`AGENT_DIR`].
    pub agent_dir: PathBuf,
    pub bundle: PathBuf,
}

impl Paths {
    pub fn new(run_dir: &Path, id: &str) -> Paths {
        Paths {
            id: id.to_owned(),
            state_root: run_dir.join("runsc"),
            agent_dir: run_dir.join("gv").join(id),
            bundle: run_dir.join("gvb").join(id),
        }
    }

    fn rootfs(&self) -> PathBuf {
        self.bundle.join("rootfs")
    }

    fn mem(&self) -> PathBuf {
        self.bundle.join("mem")
    }

    /// The overlay's statfs: the writable layer's file system.
    pub fn root_statfs_path(&self) -> String {
        format!("{}/", self.rootfs().display())
    }

    /// Whether sandbox `id` of this run directory is (or was) a gvisor one.
    pub fn exists(&self) -> bool {
        self.bundle.exists()
    }

    /// Where runsc writes the sentry's host pid.
    fn pid_file(&self) -> PathBuf {
        self.bundle.join("sandbox.pid")
    }

    /// runsc with the runtime's global flags, in the daemon's network
    /// namespace: where `runsc run` of a sandbox without a namespace of
    /// its own (`deny_all`, `--network=none`) bound its control socket.
    pub fn runsc_here(&self) -> Command {
        self.runsc_from(Command::new(runsc_path()))
    }

    /// `launcher`, a command that runs runsc, with the global flags added.
    fn runsc_from(&self, mut launcher: Command) -> Command {
        launcher.arg("--root").arg(&self.state_root);
        launcher.stdin(Stdio::null());
        launcher
    }

    /// The sentry's host pid, while it lives.
    pub fn sentry_pid(&self) -> Option<libc::pid_t> {
        let pid: libc::pid_t = fs::read_to_string(self.pid_file()).ok()?.trim().parse().ok()?;
        // SAFETY: kill with signal 0 only checks for existence.
        (pid > 0 && unsafe { libc::kill(pid, 0) } == 0).then_some(pid)
    }

    /// runsc with the runtime's global flags, run in the sentry's network
    /// namespace while it lives: runsc reaches a sandbox through an
    /// abstract unix socket, which belongs to the namespace the sandbox
    /// was started in (the sandbox's own, for a networked one).
    pub fn runsc(&self) -> Command {
        let mut c = self.runsc_here();
        if let Some(ns) = self.sentry_pid().and_then(|p| fs::File::open(format!("/proc/{p}/ns/net")).ok()) {
            enter_netns(&mut c, ns.into());
        }
        c
    }
}

fn mount(source: &str, target: &Path, fstype: &str, flags: libc::c_ulong, data: &str) -> io::Result<()> {
    let (s, t, f, d) =
        (crate::sys::cstr(source)?, crate::sys::cstr(target)?, crate::sys::cstr(fstype)?, crate::sys::cstr(data)?);
    // SAFETY: all four are valid C strings that outlive the call.
    let r = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr() as *const libc::c_void) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn umount(target: &Path) {
    if let Ok(t) = crate::sys::cstr(target) {
        // SAFETY: t is a valid C string.
        unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Runs runsc to its end. Its stderr goes to a file, not a pipe: a
/// detached sandbox inherits runsc's descriptors and would hold a pipe open
/// for its whole life. On failure the error carries the file's last line.
fn run(mut cmd: Command, what: &str, log: &Path) -> Result<(), RuntimeError> {
    let file = fs::File::create(log).map_err(io_err(format!("create {}", log.display())))?;
    // runsc logs its errors to stdout unless told otherwise.
    let out = file.try_clone().map_err(io_err(format!("dup {}", log.display())))?;
    let status = cmd.stdout(out).stderr(file).status().map_err(io_err(format!("{what}: run runsc")))?;
    if !status.success() {
        let err = fs::read_to_string(log).unwrap_or_default();
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_owned();
        return Err(RuntimeError::Io {
            what: what.to_owned(),
            source: io::Error::other(format!("runsc failed ({status}): {last}")),
        });
    }
    Ok(())
}

impl Runtime {
    /// Starts a gvisor sandbox (see the module comment); on failure nothing
    /// of it is left but a disk layer the caller made.
    pub(crate) fn start_gvisor(&self, spec: &SandboxSpec, id: String) -> Result<Sandbox, RuntimeError> {
        self.start_gvisor_from(spec, id, None)
    }

    /// Starts gvisor sandbox `spec.id` by restoring the memory image
    /// `image` (see [`Runtime::checkpoint_gvisor`]) over the writable
    /// layer of the spec (a copy of the disk layer the image was taken
    /// with): every process continues where it was. The agent takes the
    /// spec's environment (and `HUTCH_SANDBOX_ID`) and fresh entropy.
    pub fn restore_gvisor(&self, spec: &SandboxSpec, image: &Path) -> Result<Sandbox, RuntimeError> {
        self.runs(crate::Class::Gvisor).map_err(|why| RuntimeError::ClassUnavailable(crate::Class::Gvisor, why))?;
        if spec.class != crate::Class::Gvisor || !matches!(spec.writable, Writable::Layer(_)) {
            return Err(RuntimeError::Io {
                what: "restore a sandbox".into(),
                source: io::Error::new(io::ErrorKind::Unsupported, "only gvisor sandboxes on disk layers restore"),
            });
        }
        let id = crate::container::valid_id(spec.id.as_deref().unwrap_or(""))?;
        self.start_gvisor_from(spec, id, Some(image))
    }

    fn start_gvisor_from(&self, spec: &SandboxSpec, id: String, image: Option<&Path>) -> Result<Sandbox, RuntimeError> {
        let mut marks = Marks::new();
        let paths = Paths::new(&self.config().run_dir, &id);
        let layer = match &spec.writable {
            Writable::Layer(layer) => {
                if layer.read_only() {
                    return Err(StorageError::ReadOnly(layer.name().clone()).into());
                }
                let storage = self.storage().cloned().ok_or(RuntimeError::NoStorage)?;
                storage.prepare_mount(layer)?;
                storage.set_limit(layer, Some(spec.disk_bytes))?;
                Some((layer.clone(), storage))
            }
            Writable::Memory => None,
            Writable::HostDir(_) => {
                return Err(RuntimeError::Io {
                    what: "start a gvisor sandbox".into(),
                    source: io::Error::new(io::ErrorKind::Unsupported, "build sandboxes run in the container class"),
                })
            }
        };
        let mut sandbox = Sandbox {
            id: id.clone(),
            pid: 0,
            socket: self.socket_path(&id),
            cgroup: Cgroup::existing(self.layout(), &id),
            slot: None,
            layer,
            timings: Vec::new(),
            gvisor: Some(paths.clone()),
            host: None,
        };
        // Runtime::sweep leaves a sandbox alone while it starts (before
        // runsc has made its cgroup, nothing else says it lives).
        crate::container::lock(&self.gvisor_starting).insert(id.clone());
        let launched = self.launch_gvisor(&paths, spec, image, &mut sandbox, &mut marks);
        crate::container::lock(&self.gvisor_starting).remove(&id);
        match launched {
            Ok(()) => {
                sandbox.timings = marks.done;
                Ok(sandbox)
            }
            Err(e) => {
                // The cgroups runsc made, if it got that far.
                sandbox.cgroup = Cgroup::existing(self.layout(), &id);
                let _ = sandbox.destroy();
                Err(e)
            }
        }
    }

    fn launch_gvisor(
        &self,
        paths: &Paths,
        spec: &SandboxSpec,
        image: Option<&Path>,
        sb: &mut Sandbox,
        marks: &mut Marks,
    ) -> Result<(), RuntimeError> {
        for dir in [&paths.state_root, &paths.agent_dir, &paths.bundle, &paths.rootfs()] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io_err(format!("mkdir {}", dir.display())))?;
        }
        // The bundle's root must be searchable by the gofer.
        let _ = fs::set_permissions(&paths.bundle, std::os::unix::fs::PermissionsExt::from_mode(0o711));
        let _ = fs::set_permissions(paths.rootfs(), std::os::unix::fs::PermissionsExt::from_mode(0o755));
        // The writable layer.
        let (upper, work) = match &sb.layer {
            Some((layer, _)) => (layer.upper(), layer.path().join("work")),
            None => {
                let mem = paths.mem();
                fs::DirBuilder::new().mode(0o700).create(&mem).map_err(io_err(format!("mkdir {}", mem.display())))?;
                mount(
                    "hutch",
                    &mem,
                    "tmpfs",
                    libc::MS_NOSUID | libc::MS_NODEV,
                    &format!("size={},mode=0700", spec.disk_bytes.max(1 << 20)),
                )
                .map_err(io_err(format!("mount the writable layer at {}", mem.display())))?;
                let (upper, work) = (mem.join("upper"), mem.join("work"));
                for d in [&upper, &work] {
                    fs::DirBuilder::new().mode(0o755).create(d).map_err(io_err(format!("mkdir {}", d.display())))?;
                }
                for (rel, mode, owner) in rootfs::UPPER_DIRS {
                    let p = upper.join(rel);
                    fs::DirBuilder::new()
                        .recursive(true)
                        .mode(*mode)
                        .create(&p)
                        .map_err(io_err(format!("mkdir {}", p.display())))?;
                    fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(*mode))
                        .map_err(io_err("chmod"))?;
                    std::os::unix::fs::chown(&p, Some(*owner), Some(*owner)).map_err(io_err("chown"))?;
                }
                (upper, work)
            }
        };
        let (mut lowers, usr) = match &spec.root {
            RootSource::Base => (vec![self.base_dir().to_path_buf()], true),
            RootSource::Layers(layers) => (layers.clone(), false),
        };
        lowers.extend(spec.extra_lowers.iter().cloned());
        let lowerdirs: Vec<String> = lowers.iter().rev().map(|p| p.display().to_string()).collect();
        let mut data = format!(
            "lowerdir={},upperdir={},workdir={},volatile",
            lowerdirs.join(":"),
            upper.display(),
            work.display()
        );
        if sb.layer.is_some() {
            data.push_str(",redirect_dir=off,metacopy=off");
        }
        mount("overlay", &paths.rootfs(), "overlay", libc::MS_NOSUID, &data)
            .map_err(io_err(format!("mount the root at {}", paths.rootfs().display())))?;
        marks.mark("root");

        // Its identity: the sandbox's id in every command's environment.
        let mut env = spec.env.clone();
        env.retain(|(k, _)| k != SANDBOX_ID_VAR);
        env.push((SANDBOX_ID_VAR.to_owned(), paths.id.clone()));
        if let Some(image) = image {
            // A restored agent is configured already: it waits (quiesced)
            // for the resume file and takes the new identity from it.
            write_resume(paths, Some(env))?;
            self.write_bundle(paths, spec, usr)?;
            marks.mark("bundle");
            let mut cmd = self.runsc_global(paths, spec)?;
            cmd.arg("restore").arg("--detach").arg("--image-path").arg(image);
            cmd.arg("--pid-file").arg(paths.pid_file());
            self.restore_unthrottled(paths, cmd)?;
            crate::cgroup::join_v2(self.layout(), &paths.id)?;
            sb.cgroup = Cgroup::existing(self.layout(), &paths.id);
            marks.mark("runsc restore");
            return self.agent_up(paths, sb, marks);
        }
        // The agent's configuration, read once at its start.
        let config = AgentConfig {
            version: proto::PROTOCOL_VERSION,
            env,
            root_caps: crate::container::ROOT_CAPS.iter().fold(0u64, |m, c| m | 1 << c),
            replay_bytes: 64 * 1024,
            max_commands: proto::MAX_COMMANDS,
            // The workload shares the sentry's cgroup; the host's cgroup
            // files do not reach into the sandbox.
            work_cgroups: 0,
            oom_events: false,
            tree_cgroup: false,
        };
        let mut frame = Vec::with_capacity(512);
        proto::encode(&config, &[], &mut frame).map_err(|e| RuntimeError::Io {
            what: "encode agent config".into(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        let cfg_path = paths.agent_dir.join("config");
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&cfg_path)
            .and_then(|mut f| io::Write::write_all(&mut f, &frame))
            .map_err(io_err(format!("write {}", cfg_path.display())))?;

        // The container class's seccomp program, installed by the agent on
        // itself (see hutch-agent's `--dir`; the file holds a list of them).
        let program = &self.seccomp_filter().program;
        let mut filters = Vec::new();
        filters.extend_from_slice(&(program.len() as u32).to_le_bytes());
        for i in program {
            filters.extend_from_slice(&i.code.to_ne_bytes());
            filters.extend_from_slice(&[i.jt, i.jf]);
            filters.extend_from_slice(&i.k.to_ne_bytes());
        }
        let sec_path = paths.agent_dir.join("seccomp");
        fs::write(&sec_path, &filters).map_err(io_err(format!("write {}", sec_path.display())))?;

        self.write_bundle(paths, spec, usr)?;
        marks.mark("bundle");

        let mut cmd = self.runsc_global(paths, spec)?;
        cmd.arg("run").arg("--detach").arg("--pid-file").arg(paths.pid_file());
        cmd.arg("--bundle").arg(&paths.bundle).arg(&paths.id);
        run(cmd, "start the gvisor sandbox", &paths.bundle.join("runsc.log"))?;
        // runsc made the cgroups: only now are there directories to name
        // (and the v2 one to join, for the freezer).
        crate::cgroup::join_v2(self.layout(), &paths.id)?;
        sb.cgroup = Cgroup::existing(self.layout(), &paths.id);
        marks.mark("runsc run");
        self.agent_up(paths, sb, marks)
    }

    /// The OCI bundle's `config.json` runsc runs or restores the sandbox by.
    fn write_bundle(&self, paths: &Paths, spec: &SandboxSpec, usr: bool) -> Result<(), RuntimeError> {
        let bundle = oci_spec(paths, spec, &self.agent_of(spec), usr, &self.rootfs_has(&paths.rootfs()));
        let cfg_json = paths.bundle.join("config.json");
        fs::write(&cfg_json, serde_json::to_vec_pretty(&bundle).unwrap_or_default())
            .map_err(io_err(format!("write {}", cfg_json.display())))
    }

    /// Runs `cmd`, a `runsc restore` of the sandbox of `paths` (its
    /// bundle and id still to add), on a copy of the bundle's spec without
    /// the CPU limit, then puts the limit on the restored sandbox's cgroup.
    /// The restore is the sentry reading the whole image into memory
    /// before any process of the sandbox runs again, on about 1.2 CPUs for
    /// 200 MiB: held to the one CPU of a default sandbox it took 436 ms
    /// instead of 305 (medians, runsc 2022-12, 2 cores,
    /// bench/gvisor_restore.py). The sandbox's processes run unlimited from
    /// runsc's return to the write here, well under a millisecond. The
    /// bundle's own `config.json` keeps the limit: should the daemon die in
    /// between, the next one puts it back as it adopts the sandbox
    /// ([`Runtime::adopt`]).
    fn restore_unthrottled(&self, paths: &Paths, mut cmd: Command) -> Result<(), RuntimeError> {
        let path = paths.bundle.join("config.json");
        let full = fs::read(&path).map_err(io_err(format!("read {}", path.display())))?;
        let lifted = serde_json::from_slice::<Value>(&full).ok().and_then(|mut v| {
            let cpu = take_cpu_limit(&mut v)?;
            Some((serde_json::to_vec_pretty(&v).ok()?, cpu))
        });
        // The spec names everything by absolute path: a bundle of its own
        // holds the copy.
        let side = paths.bundle.join("unthrottled");
        let bundle = match &lifted {
            Some((config, _)) => {
                fs::create_dir_all(&side).map_err(io_err(format!("mkdir {}", side.display())))?;
                let at = side.join("config.json");
                fs::write(&at, config).map_err(io_err(format!("write {}", at.display())))?;
                &side
            }
            None => &paths.bundle,
        };
        cmd.arg("--bundle").arg(bundle).arg(&paths.id);
        let restored = run(cmd, "restore the gvisor sandbox", &paths.bundle.join("runsc.log"));
        let _ = fs::remove_dir_all(&side);
        restored?;
        if let Some((_, cpu)) = lifted {
            Cgroup::existing(self.layout(), &paths.id).set_cpu(Some(cpu))?;
        }
        Ok(())
    }

    /// Puts the CPU limit of the bundle's spec on an adopted gvisor
    /// sandbox's cgroup (see [`Runtime::restore_unthrottled`]).
    pub(crate) fn reapply_cpu_limit(&self, paths: &Paths, cgroup: &Cgroup) {
        if let Some(cpu) = bundle_cpu_limit(paths) {
            let _ = cgroup.set_cpu(Some(cpu));
        }
    }

    /// The agent binary a sandbox of `spec` runs.
    fn agent_of(&self, spec: &SandboxSpec) -> PathBuf {
        match &spec.agent_override {
            Some((p, _)) => p.clone(),
            None => self.config().agent.clone(),
        }
    }

    /// Waits for the agent's socket and the sentry's pid.
    fn agent_up(&self, paths: &Paths, sb: &mut Sandbox, marks: &mut Marks) -> Result<(), RuntimeError> {
        self.take_agent_socket(paths, &sb.socket)?;
        sb.pid = paths.sentry_pid().ok_or_else(|| RuntimeError::Io {
            what: format!("the sandbox process of {}", paths.id),
            source: io::Error::other("runsc's sandbox process is gone"),
        })?;
        marks.mark("agent");
        Ok(())
    }

    /// runsc with the flags every sandbox of this runtime runs with, for the
    /// `run --detach` or `restore --detach` that starts one. runsc returns
    /// leaving the sandbox's processes behind: it runs through the runtime's
    /// agent binary in its host-side mode ([`proto::REAP_FLAG`]), which stays
    /// to reap them as they end. Left to init, whose reaping is slow on some
    /// hosts, they kept runsc's `delete` waiting (about 1.2 s per memory
    /// snapshot, fork or pause on this host's init).
    ///
    /// `--cgroupfs` mounts gVisor's own emulated cgroupfs in the sandbox: the
    /// agent's supervisors, which gVisor does not let be subreapers, track each
    /// command's process tree by a cgroup there (see the agent's `child.rs`).
    /// Those cgroups live in the sentry alone and touch no host cgroup.
    fn sandbox_runsc(&self, paths: &Paths) -> Command {
        let mut launcher = Command::new(&self.config().agent);
        launcher.arg(proto::REAP_FLAG).arg(runsc_path());
        let mut cmd = paths.runsc_from(launcher);
        cmd.args(["--platform=ptrace", "--host-uds=create", "--cgroupfs"]);
        // HUTCH_RUNSC_DEBUG=DIR: runsc's debug logs of every sandbox there.
        if let Some(dir) = std::env::var_os("HUTCH_RUNSC_DEBUG") {
            cmd.arg("--debug").arg(format!("--debug-log={}/", Path::new(&dir).join(&paths.id).display()));
        }
        cmd
    }

    /// runsc with the flags of a sandbox of `spec` (a `run` or a
    /// `restore` follows).
    fn runsc_global(&self, paths: &Paths, spec: &SandboxSpec) -> Result<Command, RuntimeError> {
        let mut cmd = self.sandbox_runsc(paths);
        // runsc of 2022-12 cannot take a namespace's interfaces into its
        // netstack on kernels that show net.core sysctls in every namespace
        // (it then takes any namespace for the host's): the sandbox uses
        // the host kernel's stack instead (`--network=host`, gVisor's
        // hostinet), inside the sandbox's own namespace, which runsc joins
        // by being started in it. See ARCHITECTURE.md.
        if let Some(fd) = &spec.netns {
            let dup = fd.try_clone().map_err(io_err("duplicate the network namespace"))?;
            enter_netns(&mut cmd, dup);
            cmd.arg("--network=host");
        } else {
            cmd.arg("--network=none");
        }
        Ok(cmd)
    }

    /// Waits until the agent accepts a connection on its socket in its
    /// directory, then moves the socket where only the host reaches it.
    ///
    /// The socket appears when the agent binds it, a moment before it
    /// listens, and the gofer makes the host's socket and its listen from
    /// the path: a socket moved in between never listens. So the host
    /// connects first, at the agent's own path (nothing but the agent runs
    /// in the sandbox yet: no workload can have swapped it), retrying a
    /// refused connection, and moves it only once one was accepted.
    pub(crate) fn take_agent_socket(&self, paths: &Paths, to: &Path) -> Result<(), RuntimeError> {
        let from = paths.agent_dir.join("agent.sock");
        let deadline = Instant::now() + AGENT_WAIT;
        let waited = |e: io::Error| RuntimeError::Io {
            what: format!("wait for the agent socket {}", from.display()),
            source: e,
        };
        loop {
            let retry = match fs::symlink_metadata(&from) {
                Ok(m) if m.file_type().is_socket() => match std::os::unix::net::UnixStream::connect(&from) {
                    Ok(_) => break,
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => e,
                    Err(e) => return Err(waited(e)),
                },
                Ok(_) => return Err(waited(io::Error::new(io::ErrorKind::InvalidData, "not a socket"))),
                Err(e) => e,
            };
            if Instant::now() >= deadline || paths.sentry_pid().is_none() {
                return Err(waited(retry));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = fs::remove_file(to);
        fs::rename(&from, to).map_err(io_err(format!("move {} to {}", from.display(), to.display())))
    }

    fn seccomp_filter(&self) -> &crate::seccomp::Filter {
        &self.seccomp
    }

    fn base_dir(&self) -> &Path {
        &self.base
    }

    /// Which of the optional bind targets the root holds.
    fn rootfs_has(&self, root: &Path) -> [bool; 2] {
        ["etc/resolv.conf", "etc/ssl/certs/ca-certificates.crt"]
            .map(|p| fs::symlink_metadata(root.join(p)).map(|m| m.is_file()).unwrap_or(false))
    }

    /// Ids of gvisor sandboxes this runtime's run directory holds.
    pub fn gvisor_ids(&self) -> Vec<String> {
        let dir = self.config().run_dir.join("gvb");
        fs::read_dir(dir)
            .map(|rd| rd.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default()
    }
}

/// The variable every command of a gvisor sandbox finds its id in (set
/// anew in a restored copy).
pub const SANDBOX_ID_VAR: &str = "HUTCH_SANDBOX_ID";

/// Bytes of the host's entropy handed to a restored sandbox's kernel.
const RESUME_ENTROPY: usize = 64;

/// The name of the file runsc writes a checkpoint to, in its image directory.
const IMAGE_FILE: &str = "checkpoint.img";

/// Writes the file that ends a quiesced agent's wait ([`proto::Resume`]):
/// its environment (`None` keeps its own) and fresh entropy from the host.
fn write_resume(paths: &Paths, env: Option<Vec<(String, String)>>) -> Result<(), RuntimeError> {
    let mut entropy = [0u8; RESUME_ENTROPY];
    crate::sys::random_bytes(&mut entropy).map_err(io_err("entropy for a restored sandbox"))?;
    let mut frame = Vec::with_capacity(1024);
    proto::encode(&proto::Resume { env, hostname: None }, &entropy, &mut frame).map_err(|e| RuntimeError::Io {
        what: "encode the agent's resume file".into(),
        source: io::Error::new(io::ErrorKind::InvalidData, e),
    })?;
    // Written aside and renamed: the agent never reads half of it.
    let (tmp, path) = (paths.agent_dir.join(".resume"), paths.agent_dir.join(proto::RESUME_FILE));
    let _ = fs::remove_file(&tmp);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| io::Write::write_all(&mut f, &frame))
        .and_then(|()| fs::rename(&tmp, &path))
        .map_err(io_err(format!("write {}", path.display())))
}

impl Runtime {
    /// Where memory image `name` (a snapshot's, a fork point's, or a
    /// sandbox's paused to disk) is kept: `<state>/memory/<name>/`.
    pub fn memory_image(&self, name: &str) -> PathBuf {
        self.config().state_dir.join("memory").join(name)
    }

    /// Whether memory image `name` is whole (one being written is not).
    pub fn has_memory(&self, name: &str) -> bool {
        crate::container::valid_id(name).is_ok() && self.memory_image(name).join(IMAGE_FILE).is_file()
    }

    /// Deletes memory image `name`, if there is one.
    pub fn delete_memory(&self, name: &str) {
        if crate::container::valid_id(name).is_ok() {
            let _ = fs::remove_dir_all(self.memory_image(name));
        }
    }

    /// Deletes the memory images `keep` does not name, and every image
    /// left half written (call it at start, before any checkpoint).
    pub fn sweep_memory(&self, keep: impl Fn(&str) -> bool) {
        let Ok(rd) = fs::read_dir(self.config().state_dir.join("memory")) else { return };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !keep(&name) {
                tracing::info!("memory image {name}: deleted (no snapshot, fork point or paused sandbox holds it)");
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }

    /// Checkpoints gvisor sandbox `sb` into memory image `name`: its agent
    /// closes its host sockets ([`proto::Request::Quiesce`]), `runsc
    /// checkpoint` saves the sentry (every process's memory, its own tmpfs
    /// files) and stops it, `between` runs on the stopped sandbox (a
    /// capture of its disk layer: consistent with the memory), and with
    /// `keep_running` the sandbox is restored in place, same id and bundle,
    /// its agent listening again (`sb.pid` is the new sentry's). runsc's
    /// `--leave-running` does the same restore but waits for the sandbox
    /// to end, so it is not used. Without `keep_running` the sandbox's
    /// processes are gone; destroy it.
    ///
    /// runsc cannot save host sockets: a sandbox on gVisor's hostinet (any
    /// with a network namespace) is refused by runsc, and its agent listens
    /// again. On any failure the image is not kept.
    pub fn checkpoint_gvisor<T>(
        &self,
        sb: &mut Sandbox,
        name: &str,
        keep_running: bool,
        between: impl FnOnce() -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        crate::container::valid_id(name)?;
        let paths = sb.gvisor.clone().ok_or_else(|| RuntimeError::Io {
            what: format!("checkpoint {}", sb.id),
            source: io::Error::new(io::ErrorKind::Unsupported, "only gvisor sandboxes are checkpointed"),
        })?;
        let t0 = Instant::now();
        match quiesce(&sb.socket) {
            Ok(()) => tracing::debug!("sandbox {}: agent quiesced in {} ms", paths.id, t0.elapsed().as_millis()),
            Err((acknowledged, e)) => {
                // It may be closing: have it listen again.
                if acknowledged {
                    let _ = write_resume(&paths, None).and_then(|()| self.take_agent_socket(&paths, &sb.socket));
                }
                return Err(e);
            }
        }
        let image = self.memory_image(name);
        let partial = image.with_file_name(format!(".{name}.partial"));
        let _ = fs::remove_dir_all(&partial);
        let made = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&partial)
            .map_err(io_err(format!("mkdir {}", partial.display())));
        // Only a sandbox without a network namespace is saved (runsc refuses
        // hostinet): its control socket is in the daemon's namespace.
        let mut cmd = paths.runsc_here();
        cmd.arg("checkpoint").arg("--image-path").arg(&partial).arg(&paths.id);
        // The sentry compresses every page on as many CPUs as it is given:
        // 200 MiB took 1.1 s held to one CPU, 0.78 s unthrottled (2 cores).
        // The limit is back with the restore in place (see
        // restore_unthrottled), or below if the sandbox still runs.
        let cpu = bundle_cpu_limit(&paths);
        if cpu.is_some() {
            let _ = sb.cgroup.set_cpu(None);
        }
        let saved = made.and_then(|()| run(cmd, "checkpoint the gvisor sandbox", &paths.bundle.join("checkpoint.log")));
        if let Err(e) = saved {
            let _ = fs::remove_dir_all(&partial);
            // Still running (runsc refused before it stopped anything):
            // its CPU limit back, the agent listens again.
            if paths.sentry_pid().is_some() {
                if cpu.is_some() {
                    sb.cgroup.set_cpu(cpu)?;
                }
                write_resume(&paths, None)?;
                self.take_agent_socket(&paths, &sb.socket)?;
            }
            return Err(e);
        }
        let t1 = Instant::now();
        let result = between();
        let t2 = Instant::now();
        // Restored from the image where it was written (runsc has read it
        // all once the agent listens again), then the image is kept or not.
        let restored = if keep_running { self.restore_in_place(&paths, sb, &partial) } else { Ok(()) };
        match &result {
            Ok(_) => {
                let _ = fs::remove_dir_all(&image);
                fs::rename(&partial, &image).map_err(io_err(format!("move {} into place", partial.display())))?;
            }
            Err(_) => {
                let _ = fs::remove_dir_all(&partial);
            }
        }
        restored?;
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_millis();
        tracing::info!(
            "sandbox {}: memory image {name} in {} ms (quiesce and checkpoint {} ms, capture {} ms, restore {} ms)",
            paths.id,
            ms(t0, Instant::now()),
            ms(t0, t1),
            ms(t1, t2),
            ms(t2, Instant::now())
        );
        result
    }

    /// Restores a sandbox just checkpointed into `image` under its own id
    /// and bundle.
    fn restore_in_place(&self, paths: &Paths, sb: &mut Sandbox, image: &Path) -> Result<(), RuntimeError> {
        let mut marks = Marks::new();
        // runsc's delete waits (2 s at most) until the stopped sentry and
        // gofer are reaped: by the reaper they were started under (see
        // Runtime::sandbox_runsc), or by init should that reaper be gone.
        let mut delete = paths.runsc_here();
        delete.arg("delete").arg(&paths.id);
        run(delete, "delete the checkpointed sandbox", &paths.bundle.join("checkpoint.log"))?;
        marks.mark("delete");
        let _ = fs::remove_file(paths.pid_file());
        write_resume(paths, None)?;
        let mut cmd = self.sandbox_runsc(paths);
        // Only a sandbox without a network namespace was saved.
        cmd.arg("--network=none");
        cmd.arg("restore").arg("--detach").arg("--image-path").arg(image);
        cmd.arg("--pid-file").arg(paths.pid_file());
        self.restore_unthrottled(paths, cmd)?;
        marks.mark("runsc restore");
        self.take_agent_socket(paths, &sb.socket)?;
        marks.mark("agent");
        tracing::debug!("sandbox {}: restored in place: {:?}", paths.id, marks.done);
        sb.pid = paths.sentry_pid().ok_or_else(|| RuntimeError::Io {
            what: format!("the sandbox process of {}", paths.id),
            source: io::Error::other("runsc's sandbox process is gone"),
        })?;
        Ok(())
    }
}

/// Asks the agent at `socket` to close its sockets, and waits until it
/// has. On failure, whether the agent took the request.
fn quiesce(socket: &Path) -> Result<(), (bool, RuntimeError)> {
    let failed = |e: crate::agent::AgentError| RuntimeError::Io {
        what: "quiesce the agent".into(),
        source: io::Error::other(e.to_string()),
    };
    let mut conn = crate::agent::AgentConn::connect(socket).map_err(|e| (false, failed(e)))?;
    conn.set_reply_timeout(Duration::from_secs(10));
    match conn.call(proto::Request::Quiesce, &[]) {
        Ok((proto::Reply::Ok, _)) => {}
        Ok((other, _)) => return Err((false, failed(crate::agent::AgentError::Unexpected(Box::new(other))))),
        // No answer: it may have taken the request all the same.
        Err(e) => return Err((true, failed(e))),
    }
    // It closes its listener, then every connection: ours ending says
    // both are closed. (A connect to the socket's path says nothing: the
    // gofer's host socket may still take connections into its backlog.)
    let deadline = Instant::now() + AGENT_WAIT;
    loop {
        match conn.recv(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))) {
            Ok(_) => continue,
            Err(crate::agent::AgentError::Timeout(t)) => {
                return Err((true, failed(crate::agent::AgentError::Timeout(t))))
            }
            Err(_) => return Ok(()),
        }
    }
}

/// Makes `cmd` start in the network namespace `ns`.
fn enter_netns(cmd: &mut Command, ns: std::os::fd::OwnedFd) {
    let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
    // SAFETY: setns is async-signal-safe and touches no memory of the
    // parent; the closure owns `ns`, so fd stays open until the exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            let _keep = &ns;
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// runsc's word on the sandbox: "running", "stopped", ...; `None` when it
/// knows no such sandbox.
pub fn state(paths: &Paths) -> Option<String> {
    let out = paths.runsc().arg("state").arg(&paths.id).stderr(Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v.get("status")?.as_str().map(str::to_owned)
}

/// Kills the sandbox and removes everything it held on the host but the
/// cgroup (the caller's, see [`Sandbox::destroy`]) and a disk layer.
pub fn teardown(paths: &Paths) {
    let quiet = |mut c: Command| {
        let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
    };
    let mut kill = paths.runsc();
    kill.args(["kill", "--all"]).arg(&paths.id).arg("KILL");
    quiet(kill);
    // The sentry is killed with its cgroup by the caller too; delete then
    // removes runsc's state whether or not it still reaches the sandbox.
    let mut delete = paths.runsc();
    delete.args(["delete", "--force"]).arg(&paths.id);
    quiet(delete);
    if let Some(pid) = paths.sentry_pid() {
        crate::sys::kill(pid, libc::SIGKILL);
        let mut delete = paths.runsc();
        delete.args(["delete", "--force"]).arg(&paths.id);
        quiet(delete);
    }
    umount(&paths.rootfs());
    umount(&paths.mem());
    let _ = fs::remove_dir_all(&paths.bundle);
    let _ = fs::remove_dir_all(&paths.agent_dir);
    // runsc's own leftovers, should delete have failed half way.
    let _ = fs::remove_dir_all(paths.state_root.join(&paths.id));
    if let Ok(rd) = fs::read_dir(&paths.state_root) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("{}_sandbox:", paths.id)) || name.starts_with(&format!("{}.", paths.id)) {
                let p = e.path();
                let _ = if p.is_dir() { fs::remove_dir_all(&p) } else { fs::remove_file(&p) };
            }
        }
    }
}

/// The OCI runtime spec runsc starts the sandbox from.
fn oci_spec(paths: &Paths, spec: &SandboxSpec, agent: &Path, host_usr: bool, has: &[bool; 2]) -> Value {
    let Limits { memory_bytes, pids, cpu_millis } = spec.limits;
    let caps: Vec<&str> = ALL_CAPS.to_vec();
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "nodev", "mode=1777", format!("size={}", (memory_bytes / 2).min(64 << 20))]}),
        json!({"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=755"]}),
        json!({"destination": AGENT_DIR, "type": "bind", "source": paths.agent_dir, "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]}),
        json!({"destination": AGENT_BIN, "type": "bind", "source": agent, "options": ["rbind", "ro", "nosuid", "nodev"]}),
    ];
    if host_usr {
        mounts.push(json!({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro", "nosuid", "nodev"]}));
    }
    let binds = [(&spec.resolv_conf, "/etc/resolv.conf"), (&spec.ca_bundle, "/etc/ssl/certs/ca-certificates.crt")];
    for ((src, dst), present) in binds.iter().zip(has) {
        if let (Some(src), true) = (src, present) {
            mounts.push(json!({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]}));
        }
    }
    for v in &spec.volumes {
        let mode = if v.read_only { "ro" } else { "rw" };
        mounts.push(json!({"destination": v.target, "type": "bind", "source": v.source, "options": ["rbind", mode, "nosuid", "nodev"]}));
    }
    let mut namespaces =
        vec![json!({"type": "pid"}), json!({"type": "ipc"}), json!({"type": "uts"}), json!({"type": "mount"})];
    // The network: runsc's own flag decides (see launch_gvisor).
    if spec.netns.is_none() {
        namespaces.push(json!({"type": "network"}));
    }
    let rlimits: Vec<Value> = crate::container::KERNEL_CAPS
        .rlimits()
        .iter()
        .map(|(r, l)| {
            let name = match *r as u32 {
                libc::RLIMIT_MSGQUEUE => "RLIMIT_MSGQUEUE",
                libc::RLIMIT_SIGPENDING => "RLIMIT_SIGPENDING",
                _ => "RLIMIT_MEMLOCK",
            };
            json!({"type": name, "hard": l, "soft": l})
        })
        .chain(crate::sys::workload_nofile().map(|(s, h)| json!({"type": "RLIMIT_NOFILE", "hard": h, "soft": s})))
        .collect();
    let period = 100_000u64;
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": [AGENT_BIN, "--dir", AGENT_DIR],
            "env": [],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps, "inheritable": []},
            "rlimits": rlimits,
        },
        "root": {"path": paths.rootfs(), "readonly": false},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": format!("/{}/{}", crate::cgroup::PARENT, paths.id),
            "resources": {
                "memory": {"limit": memory_bytes},
                // Host tasks: the sentry's threads and the ptrace stubs, besides
                // what the sandbox runs.
                "pids": {"limit": pids.saturating_add(crate::cgroup::AGENT_PIDS).saturating_add(SENTRY_TASKS)},
                "cpu": {"quota": (cpu_millis as u64) * period / 1000, "period": period},
            },
        },
    })
}

/// Takes the CPU limit out of an OCI spec of [`oci_spec`]'s: the limit in
/// thousandths of a CPU, `None` (the spec unchanged) if it has none.
fn take_cpu_limit(spec: &mut Value) -> Option<u32> {
    let resources = spec.get_mut("linux")?.get_mut("resources")?.as_object_mut()?;
    let cpu = resources.get("cpu")?;
    let (quota, period) = (cpu.get("quota")?.as_u64()?, cpu.get("period")?.as_u64()?);
    let millis = u32::try_from(quota.checked_mul(1000)? / period.max(1)).ok()?;
    resources.remove("cpu");
    Some(millis)
}

/// The CPU limit in the bundle of `paths` (see [`take_cpu_limit`]).
fn bundle_cpu_limit(paths: &Paths) -> Option<u32> {
    let config = fs::read(paths.bundle.join("config.json")).ok()?;
    take_cpu_limit(&mut serde_json::from_slice(&config).ok()?)
}

/// Host tasks the sentry itself takes (its Go threads, one ptrace stub
/// per address space and thread group of the sandbox), added to the
/// sandbox's pids limit in its host cgroup; and those of the agent's
/// supervisors, which here live as long as their command's tree (the
/// agent's `child.rs`): about 6 host tasks each, measured with 48
/// commands holding a background child (19 host tasks a command, 13 when
/// supervisors did not outlive the main process).
const SENTRY_TASKS: u32 = 512 + 8 * proto::MAX_COMMANDS;

/// Whether this host runs gvisor sandboxes: runsc answers `--version`
/// (asked once per process).
pub fn available() -> Result<(), String> {
    static ANSWER: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ANSWER
        .get_or_init(|| match runsc_version() {
            Some(_) => Ok(()),
            None => Err(format!("runsc ({}) is not installed: apt-get install runsc", runsc_path().display())),
        })
        .clone()
}

/// runsc's version line, if runsc is installed.
pub fn runsc_version() -> Option<String> {
    let out = Command::new(runsc_path()).arg("--version").stderr(Stdio::null()).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    out.status.success().then(|| text.lines().next().unwrap_or("").trim().to_owned())
}

/// Whether runsc starts a sandbox on `platform` here: runs `true` in a
/// throw-away sandbox (`runsc do`, the host's root read-only, no network),
/// with its state in a directory of its own, removed after.
pub fn probe_platform(platform: &str) -> Result<(), String> {
    let root = std::env::temp_dir().join(format!("hutch-runsc-probe-{}", std::process::id()));
    let out = Command::new(runsc_path())
        .arg("--root")
        .arg(&root)
        .arg(format!("--platform={platform}"))
        .args(["--network=none", "do", "true"])
        .stdin(Stdio::null())
        .output();
    let _ = fs::remove_dir_all(&root);
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            Err(err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("failed").trim().to_owned())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restore_takes_the_cpu_limit_out_of_the_spec() {
        let mut spec = json!({"linux": {"resources": {
            "memory": {"limit": 512u64 << 20},
            "cpu": {"quota": 150_000, "period": 100_000},
        }}});
        assert_eq!(take_cpu_limit(&mut spec), Some(1500));
        assert_eq!(spec, json!({"linux": {"resources": {"memory": {"limit": 512u64 << 20}}}}));
        // Nothing left to take, and nothing taken from a spec without one.
        assert_eq!(take_cpu_limit(&mut spec), None);
        let mut bare = json!({"linux": {}});
        assert_eq!(take_cpu_limit(&mut bare), None);
        assert_eq!(bare, json!({"linux": {}}));
    }
}
