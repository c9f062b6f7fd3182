//! The `container` isolation class: a sandbox is a set of fresh namespaces
//! around an overlay root, a cgroup, a uid range of its own, and the agent
//! as PID 1.
//!
//! [`Runtime::start`] does the host's half (uid range, cgroup, user
//! namespace, agent socket, configuration), builds the child's plan, and
//! clones; [`Sandbox::destroy`] undoes all of it. [`Runtime::sweep`] removes
//! what sandboxes that died without a teardown left behind.

use crate::agent::{AgentConn, AgentError};
use crate::cgroup::{self, Cgroup, CgroupError, Layout, Limits};
use crate::launch::{self, cstr, Plan, Step, StepError};
use crate::rootfs::{self, FsSpec, RootfsError};
use crate::seccomp::{self, SeccompError};
use crate::storage::{Layer, LayerName, Storage, StorageError};
use crate::uids::{self, Slot, UidError};
use hutch_agent::proto::{self, AgentConfig};
use hutch_api::Class;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Capabilities kept by processes run as root inside a sandbox: what a
/// package manager needs to install files for other users. They act only
/// inside the sandbox's user namespace, which owns no other namespace.
pub const ROOT_CAPS: &[u32] = &[
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    10, // CAP_NET_BIND_SERVICE
    31, // CAP_SETFCAP
];

/// What one sandbox may hold of the kernel's per-user counters that are
/// kept as resource limits. The kernel charges them to the owner of the
/// sandbox's user namespace (the sandbox's own host root id, see
/// [`launch::NsHelper`]) and caps that charge at the limits its creator
/// had, so these are per sandbox, all of its users together. Every process
/// of the sandbox also starts with them as its own limits (soft and hard;
/// raising a hard limit takes CAP_SYS_RESOURCE of the host, which no
/// sandbox has).
///
/// Counters kept as sysctls (inotify instances and watches, fanotify
/// groups and marks) are capped per sandbox by the host's own per-user
/// limits (`/proc/sys/user/max_*` of the host); pseudo-terminals by
/// `ptys` (devpts `max=`). See docs/threat-model.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelCaps {
    /// Bytes of POSIX message queues (RLIMIT_MSGQUEUE).
    pub mqueue_bytes: u64,
    /// Signals queued and not yet delivered, POSIX timers included
    /// (RLIMIT_SIGPENDING).
    pub pending_signals: u64,
    /// Bytes of SysV shared memory locked with SHM_LOCK (RLIMIT_MEMLOCK,
    /// which also bounds each process's mlock).
    pub locked_bytes: u64,
    /// Pseudo-terminals open at once.
    pub ptys: u32,
}

/// The caps every sandbox gets: the Linux defaults for one user (800 KiB of
/// message queues, 8 MiB locked), 16384 pending signals, 128 terminals.
pub const KERNEL_CAPS: KernelCaps =
    KernelCaps { mqueue_bytes: 819_200, pending_signals: 16_384, locked_bytes: 8 << 20, ptys: 128 };

impl KernelCaps {
    /// The resource limits these caps are kept as.
    pub fn rlimits(&self) -> [(libc::c_int, u64); 3] {
        [
            (libc::RLIMIT_MSGQUEUE as libc::c_int, self.mqueue_bytes),
            (libc::RLIMIT_SIGPENDING as libc::c_int, self.pending_signals),
            (libc::RLIMIT_MEMLOCK as libc::c_int, self.locked_bytes),
        ]
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid sandbox id {0:?}: use 1 to 64 of a-z, 0-9 and -")]
    InvalidId(String),
    #[error(transparent)]
    Uids(#[from] UidError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error(transparent)]
    Setup(#[from] StepError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("agent binary {path} not found; build it (cargo build) or set HUTCH_AGENT")]
    NoAgent { path: PathBuf },
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("a disk layer was asked for, but this runtime has no storage")]
    NoStorage,
    #[error("this host does not run {0} sandboxes: {1}")]
    ClassUnavailable(Class, String),
}

/// A listener at `path`, for a sandbox's agent. A file left there (a
/// sandbox of the same id that ended without its teardown) is replaced;
/// a fresh path is walked once, not twice (an unlink first cost a twentieth
/// of a process-class create's CPU on this VM's ext4 run directory).
pub(crate) fn listen_at(path: &Path) -> Result<UnixListener, RuntimeError> {
    let bound = match UnixListener::bind(path) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let _ = fs::remove_file(path);
            UnixListener::bind(path)
        }
        r => r,
    };
    bound.map_err(io_err(format!("bind {}", path.display())))
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RuntimeError {
    let what = what.into();
    move |source| RuntimeError::Io { what, source }
}

/// The run directory's empty directory, bound read-only over the /proc
/// directories a sandbox must not see.
const EMPTY_DIR: &str = "empty";

/// Makes `dir` (mode 0555) if it is missing, and refuses one that holds
/// anything: every sandbox would see it.
fn ensure_empty(dir: &Path) -> Result<(), RuntimeError> {
    let what = || format!("empty directory {}", dir.display());
    match fs::DirBuilder::new().mode(0o555).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(io_err(what())(e)),
        _ => {}
    }
    match fs::read_dir(dir).map_err(io_err(what()))?.next() {
        None => Ok(()),
        Some(_) => Err(io_err(what())(io::Error::new(io::ErrorKind::DirectoryNotEmpty, "holds files"))),
    }
}

/// Where the runtime keeps things on the host.
#[derive(Debug, Clone)]
pub struct Config {
    /// Persistent state: root filesystems.
    pub state_dir: PathBuf,
    /// Runtime state (tmpfs): agent sockets, the staging dir.
    pub run_dir: PathBuf,
    /// The host-wide uid slots ([`uids::HOST_DIR`]): one directory for
    /// every runtime on the host, whatever its run directory, so that no
    /// two hand out the same host ids. Change it only in tests of the
    /// slots themselves.
    pub uid_dir: PathBuf,
    /// The cgroup mount root, normally /sys/fs/cgroup.
    pub cgroup_root: PathBuf,
    /// The agent binary run as each sandbox's PID 1.
    pub agent: PathBuf,
}

impl Config {
    /// The defaults: /var/lib/hutch, /run/hutch, /sys/fs/cgroup, and the
    /// agent next to the running executable, each overridable by
    /// HUTCH_STATE_DIR, HUTCH_RUN_DIR and HUTCH_AGENT.
    pub fn from_env() -> Config {
        let agent = std::env::var_os("HUTCH_AGENT").map(PathBuf::from).unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("hutch-agent")))
                .unwrap_or_else(|| PathBuf::from("/usr/local/bin/hutch-agent"))
        });
        Config {
            state_dir: std::env::var_os("HUTCH_STATE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/var/lib/hutch".into()),
            run_dir: std::env::var_os("HUTCH_RUN_DIR").map(PathBuf::from).unwrap_or_else(|| "/run/hutch".into()),
            uid_dir: uids::HOST_DIR.into(),
            cgroup_root: "/sys/fs/cgroup".into(),
            agent,
        }
    }
}

/// What a sandbox's root file system is made of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RootSource {
    /// The host-based `base` tree with the host's /usr.
    #[default]
    Base,
    /// An image's layers (see [`crate::image::ImageStore::layer_dirs`]),
    /// bottom first, stacked as overlay lower layers; no host /usr.
    Layers(Vec<PathBuf>),
}

/// What one sandbox gets.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// How it is isolated.
    pub class: Class,
    /// The root file system.
    pub root: RootSource,
    /// Chosen by the caller, or random when `None`.
    pub id: Option<String>,
    pub limits: Limits,
    /// Size cap of the writable layer, in bytes.
    pub disk_bytes: u64,
    /// Environment of every process in the sandbox.
    pub env: Vec<(String, String)>,
    /// Kill the sandbox when the process that started it dies (one-shot
    /// runs); a daemon's sandboxes outlive it and leave this off.
    pub die_with_parent: bool,
    /// Replaces the agent (program and arguments); tests use this to put a
    /// hostile agent in the sandbox.
    pub agent_override: Option<(PathBuf, Vec<String>)>,
    /// A network namespace from `net::Network` (veth, addresses, routes);
    /// `None`: a namespace of the sandbox's own with only `lo`.
    pub netns: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// Bound read-only over the sandbox's /etc/resolv.conf.
    pub resolv_conf: Option<PathBuf>,
    /// Bound read-only over the sandbox's CA bundle
    /// (/etc/ssl/certs/ca-certificates.crt, where the image has one): the
    /// host's roots and the egress proxy's CA, for sandboxes that name
    /// secrets.
    pub ca_bundle: Option<PathBuf>,
    /// Read-only layers stacked over `base`, bottom first (a built image).
    pub extra_lowers: Vec<PathBuf>,
    /// Where the sandbox's writes go.
    pub writable: Writable,
    /// Volumes mounted into its root (see [`rootfs::plan_volumes`]).
    pub volumes: Vec<rootfs::VolumeMount>,
}

/// A sandbox's writable layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Writable {
    /// A tmpfs of `disk_bytes` inside the sandbox's mount namespace: the
    /// fastest, but its pages count toward the sandbox's memory, and it is
    /// gone with the sandbox's processes (no snapshot, no pause to disk).
    #[default]
    Memory,
    /// A layer of the runtime's [`Storage`] (a btrfs subvolume), made or
    /// chosen by the caller, mounted id-mapped; `disk_bytes` becomes its
    /// quota (writes past it fail with EDQUOT). It outlives the sandbox:
    /// [`Sandbox::destroy`] leaves it, [`Storage::delete`] removes it.
    Layer(Layer),
    /// A host directory holding `upper/` and `work/`, owned by the
    /// sandbox's host ids: build sandboxes only, whose layer is captured
    /// after they end (see [`crate::capture`]).
    HostDir(PathBuf),
}

impl Default for SandboxSpec {
    fn default() -> Self {
        SandboxSpec {
            class: Class::Container,
            root: RootSource::Base,
            id: None,
            limits: Limits { memory_bytes: 512 << 20, pids: 256, cpu_millis: 1000 },
            disk_bytes: 1 << 30,
            env: Vec::new(),
            die_with_parent: false,
            agent_override: None,
            netns: None,
            resolv_conf: None,
            ca_bundle: None,
            extra_lowers: Vec::new(),
            writable: Writable::Memory,
            volumes: Vec::new(),
        }
    }
}

/// The container runtime of one host.
#[derive(Debug)]
pub struct Runtime {
    cfg: Config,
    layout: Layout,
    pub(crate) seccomp: seccomp::Filter,
    pub(crate) base: PathBuf,
    /// Ids of gvisor sandboxes being started, which [`Runtime::sweep`]
    /// must not take for dead.
    pub(crate) gvisor_starting: std::sync::Mutex<std::collections::BTreeSet<String>>,
    storage: Option<std::sync::Arc<Storage>>,
    /// Emptied sandbox cgroups kept for the next sandbox (a daemon's; see
    /// [`Runtime::keep_cgroups`]).
    spares: Option<std::sync::Arc<cgroup::Spares>>,
}

/// A running sandbox.
#[derive(Debug)]
pub struct Sandbox {
    pub id: String,
    /// PID 1 of the sandbox, as the host sees it.
    pub pid: libc::pid_t,
    pub socket: PathBuf,
    pub cgroup: Cgroup,
    pub(crate) slot: Option<Slot>,
    /// Its disk layer, if it has one (and the storage that holds it).
    pub(crate) layer: Option<(Layer, std::sync::Arc<Storage>)>,
    /// How long each phase of the start took, for `hutch run --timings`.
    pub timings: Vec<(&'static str, Duration)>,
    /// A sandbox of the gvisor class: where its bundle and runsc state are.
    pub(crate) gvisor: Option<crate::gvisor::Paths>,
    /// For a `process` class sandbox (a tenant): its host container's
    /// agent socket; `pid` is then the host container's PID 1.
    pub host: Option<PathBuf>,
}

/// Phase durations of a start.
pub(crate) struct Marks {
    last: std::time::Instant,
    pub(crate) done: Vec<(&'static str, Duration)>,
}

impl Marks {
    pub(crate) fn new() -> Marks {
        Marks { last: std::time::Instant::now(), done: Vec::new() }
    }

    pub(crate) fn mark(&mut self, phase: &'static str) {
        let now = std::time::Instant::now();
        self.done.push((phase, now - self.last));
        self.last = now;
    }
}

impl Runtime {
    /// Detects the cgroup layout, compiles the seccomp profile and makes
    /// sure the `base` root filesystem exists.
    pub fn new(cfg: Config) -> Result<Runtime, RuntimeError> {
        // Early, while the process holds few descriptors.
        launch::reserve_launch_slots();
        let layout = Layout::detect(&cfg.cgroup_root)?;
        // Best effort: without it every start on a v1 host waits ~10 ms for
        // RCU (see cgroup::migrations_fast); `hutch doctor` reports it.
        let _ = cgroup::enable_fast_migrations(&layout);
        let seccomp = seccomp::compile(seccomp::PROFILE)?;
        for dir in [cfg.run_dir.clone(), cfg.run_dir.join("sockets"), cfg.run_dir.join("stage"), cfg.uid_dir.clone()] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(io_err(format!("mkdir {}", dir.display())))?;
        }
        ensure_empty(&cfg.run_dir.join(EMPTY_DIR))?;
        // A unix socket path holds at most 107 bytes: refuse a run directory
        // too long for an agent socket now, not at every create.
        let probe = cfg.run_dir.join("sockets").join(format!("{}.sock", "x".repeat(RANDOM_ID_LEN)));
        if probe.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(RuntimeError::Io {
                what: format!("run directory {}", cfg.run_dir.display()),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "too long for agent socket paths; use a shorter one",
                ),
            });
        }
        let base = rootfs::ensure_base(&cfg.state_dir)?;
        if !cfg.agent.is_file() {
            return Err(RuntimeError::NoAgent { path: cfg.agent.clone() });
        }
        Ok(Runtime { cfg, layout, seccomp, base, gvisor_starting: Default::default(), storage: None, spares: None })
    }

    /// Keeps up to `max` emptied sandbox cgroups for the next sandboxes,
    /// where the host's cgroups allow it ([`cgroup::Spares`]); for a
    /// daemon, whose sandboxes come and go ([`Runtime::spares`] says
    /// whether they are). Spares this run directory's last daemon left are
    /// removed.
    pub fn keep_cgroups(mut self, max: usize) -> Runtime {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(self.cfg.run_dir.as_os_str().as_encoded_bytes());
        let tag = hex::encode(&digest[..4]);
        self.spares = cgroup::Spares::new(&self.layout, &tag, max);
        self
    }

    /// A sandbox's cgroup: a kept one where there is one.
    pub(crate) fn new_cgroup(&self, id: &str, limits: &Limits, headroom: u64) -> Result<Cgroup, CgroupError> {
        match &self.spares {
            Some(spares) => Cgroup::create_from(spares, id, limits, headroom),
            None => Cgroup::create(&self.layout, id, limits, headroom),
        }
    }

    /// The kept cgroups, where there are any.
    pub fn spares(&self) -> Option<&std::sync::Arc<cgroup::Spares>> {
        self.spares.as_ref()
    }

    /// Gives the runtime disk storage for writable layers
    /// ([`Writable::Layer`]); without it only memory layers start.
    pub fn with_storage(mut self, storage: Option<std::sync::Arc<Storage>>) -> Runtime {
        self.storage = storage;
        self
    }

    /// The disk storage of writable layers, if this runtime has one.
    pub fn storage(&self) -> Option<&std::sync::Arc<Storage>> {
        self.storage.as_ref()
    }

    /// Makes the empty writable layer of sandbox `id` (named after it:
    /// [`LayerName::sandbox`]), with the directories every sandbox's upper
    /// layer holds ([`rootfs::UPPER_DIRS`]). Start the sandbox with it as
    /// [`Writable::Layer`]; it is the caller's to delete.
    pub fn new_layer(&self, id: &str) -> Result<Layer, RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        Ok(storage.create(&LayerName::sandbox(id)?, rootfs::UPPER_DIRS)?)
    }

    /// Takes a read-only snapshot of sandbox `id`'s layer as snapshot
    /// `snap` ([`crate::storage::Kind::Snapshot`]): every write made before
    /// the call. Freeze the sandbox around it for a consistent copy.
    /// Returns the snapshot and its size: the bytes it references with
    /// full quota groups; with simple quotas (which charge a snapshot
    /// nothing) the bytes the sandbox's layer wrote, to which the caller
    /// adds what the layer started from.
    pub fn snapshot_layer(&self, id: &str, snap: &str) -> Result<(Layer, u64), RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        let name = LayerName::sandbox(id)?;
        let source = storage.open_layer(&name)?.ok_or(StorageError::NotFound(name))?;
        let taken = storage.snapshot(&source, &LayerName::new(crate::storage::Kind::Snapshot, snap)?, true)?;
        // The snapshot committed a transaction: the figures are current.
        let counted = match storage.quotas() {
            crate::storage::Quotas::Full => &taken,
            crate::storage::Quotas::Simple => &source,
        };
        let size = storage.usage(counted).map(|u| u.referenced_bytes).unwrap_or(0);
        Ok((taken, size))
    }

    /// Makes sandbox `id`'s writable layer from snapshot `snap` (a writable
    /// snapshot of it, sharing its blocks until either changes). Start the
    /// sandbox with it as [`Writable::Layer`]; it is the caller's to delete.
    pub fn layer_from_snapshot(&self, id: &str, snap: &str) -> Result<Layer, RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        let name = LayerName::new(crate::storage::Kind::Snapshot, snap)?;
        let layer = LayerName::sandbox(id)?;
        // A spare made ahead is taken by a rename; else a snapshot now.
        if let Some(spare) = storage.take_spare(&name, &layer)? {
            return Ok(spare);
        }
        let source = storage.open_layer(&name)?.ok_or(StorageError::NotFound(name))?;
        Ok(storage.snapshot(&source, &layer, false)?)
    }

    /// Keeps `want` writable copies of snapshot `snap` made ahead, for
    /// [`Runtime::layer_from_snapshot`] to take (see
    /// [`Storage::make_spare`]). Call it off the create path.
    pub fn keep_spares(&self, snap: &str, want: usize) -> Result<(), RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        Ok(storage.keep_spares(&LayerName::new(crate::storage::Kind::Snapshot, snap)?, want)?)
    }

    /// What sandbox `id` changed since it started: its layer's upper
    /// directory against snapshot layer `origin`'s (None: against its image,
    /// `root` and `extra_lowers` as it was started with).
    pub fn diff(
        &self,
        id: &str,
        origin: Option<&str>,
        root: &RootSource,
        extra_lowers: &[PathBuf],
    ) -> Result<Vec<crate::storage::diff::Change>, RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        let name = LayerName::sandbox(id)?;
        let layer = storage.open_layer(&name)?.ok_or(StorageError::NotFound(name))?;
        let start = match origin {
            Some(o) => {
                let name = LayerName::new(crate::storage::Kind::Snapshot, o)?;
                Some(storage.open_layer(&name)?.ok_or(StorageError::NotFound(name))?)
            }
            None => None,
        };
        // The image, top first.
        let mut lowers: Vec<(String, PathBuf)> =
            extra_lowers.iter().rev().map(|p| (String::new(), p.clone())).collect();
        match root {
            RootSource::Base => {
                lowers.push(("usr".into(), PathBuf::from("/usr")));
                lowers.push((String::new(), self.base.clone()));
            }
            RootSource::Layers(layers) => lowers.extend(layers.iter().rev().map(|p| (String::new(), p.clone()))),
        }
        crate::storage::diff::diff(
            &layer.upper(),
            start.as_ref().map(|s| s.upper()).as_deref(),
            &crate::storage::diff::Lowers(lowers),
        )
        .map_err(io_err(format!("compare the files of {id}")))
    }

    /// A tar archive of `changes` (from [`Runtime::diff`]) as sandbox
    /// `id`'s layer holds them now (see [`crate::storage::diff::archive`]).
    pub fn diff_archive<W: std::io::Write>(
        &self,
        id: &str,
        changes: &[crate::storage::diff::Change],
        out: &mut W,
    ) -> Result<(), RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        let name = LayerName::sandbox(id)?;
        let layer = storage.open_layer(&name)?.ok_or(StorageError::NotFound(name))?;
        crate::storage::diff::archive(&layer.upper(), changes, out)
            .map_err(io_err(format!("archive the changes of {id}")))
    }

    /// Deletes snapshot `snap` (and its memory image, if it has one);
    /// false if there was none.
    pub fn delete_snapshot(&self, snap: &str) -> Result<bool, RuntimeError> {
        self.delete_memory(snap);
        match &self.storage {
            Some(storage) => Ok(storage.delete(&LayerName::new(crate::storage::Kind::Snapshot, snap)?)?),
            None => Ok(false),
        }
    }

    /// The writable layer of sandbox `id`, if it has one on disk.
    pub fn layer_of(&self, id: &str) -> Result<Option<Layer>, RuntimeError> {
        match &self.storage {
            Some(storage) => Ok(storage.open_layer(&LayerName::sandbox(id)?)?),
            None => Ok(None),
        }
    }

    /// Deletes the writable layer of sandbox `id`; false if it had none (or
    /// this runtime has no storage). Call it once the sandbox's processes
    /// are gone ([`Sandbox::destroy`]).
    pub fn delete_layer(&self, id: &str) -> Result<bool, RuntimeError> {
        match &self.storage {
            Some(storage) => Ok(storage.delete(&LayerName::sandbox(id)?)?),
            None => Ok(false),
        }
    }

    /// Makes volume `id`: an empty layer ([`crate::storage::Kind::Volume`])
    /// whose `upper/data` (owned by the sandbox user, image id 1000) is what
    /// sandboxes mount, limited to `bytes`. Nothing is left if it fails.
    pub fn create_volume(&self, id: &str, bytes: u64) -> Result<Layer, RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        let name = LayerName::new(crate::storage::Kind::Volume, id)?;
        let layer = storage.create(&name, &[("data", 0o755, 1000)])?;
        if let Err(e) = storage.set_limit(&layer, Some(bytes)) {
            let _ = storage.delete(&name);
            return Err(e.into());
        }
        Ok(layer)
    }

    /// Volume `id`'s layer, if it exists.
    pub fn volume(&self, id: &str) -> Result<Option<Layer>, RuntimeError> {
        match &self.storage {
            Some(storage) => Ok(storage.open_layer(&LayerName::new(crate::storage::Kind::Volume, id)?)?),
            None => Ok(None),
        }
    }

    /// The directory a sandbox mounts of volume `id`.
    pub fn volume_mount_source(&self, id: &str) -> Result<PathBuf, RuntimeError> {
        let name = LayerName::new(crate::storage::Kind::Volume, id)?;
        let layer = self.volume(id)?.ok_or(StorageError::NotFound(name))?;
        Ok(layer.upper().join("data"))
    }

    /// Sets volume `id`'s limit to `bytes`.
    pub fn resize_volume(&self, id: &str, bytes: u64) -> Result<(), RuntimeError> {
        let storage = self.storage.as_ref().ok_or(RuntimeError::NoStorage)?;
        let name = LayerName::new(crate::storage::Kind::Volume, id)?;
        let layer = storage.open_layer(&name)?.ok_or(StorageError::NotFound(name))?;
        Ok(storage.set_limit(&layer, Some(bytes))?)
    }

    /// Bytes volume `id`'s files take now (0 when it has none).
    pub fn volume_used(&self, id: &str) -> Result<u64, RuntimeError> {
        let (Some(storage), Some(layer)) = (&self.storage, self.volume(id)?) else { return Ok(0) };
        Ok(storage.usage(&layer)?.used_bytes)
    }

    /// Deletes volume `id` and its files; false if there was none.
    pub fn delete_volume(&self, id: &str) -> Result<bool, RuntimeError> {
        match &self.storage {
            Some(storage) => Ok(storage.delete(&LayerName::new(crate::storage::Kind::Volume, id)?)?),
            None => Ok(false),
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether this runtime starts sandboxes of `class` (Err: why not).
    pub fn runs(&self, class: Class) -> Result<(), String> {
        match class {
            Class::Container => Ok(()),
            Class::Gvisor => crate::gvisor::available(),
            Class::Process => crate::process::require_landlock(crate::process::landlock_abi()).map(drop),
            Class::Microvm => Err("hutch does not run micro-VM sandboxes yet".into()),
        }
    }

    /// Starts a sandbox and returns once its agent is running.
    pub fn start(&self, spec: &SandboxSpec) -> Result<Sandbox, RuntimeError> {
        self.runs(spec.class).map_err(|why| RuntimeError::ClassUnavailable(spec.class, why))?;
        if spec.class == Class::Process {
            return Err(RuntimeError::ClassUnavailable(
                Class::Process,
                "a process sandbox is a tenant of a host container: start it with Runtime::start_tenant".into(),
            ));
        }
        self.start_as(spec, false)
    }

    /// Starts a host container of the `process` class: a container whose
    /// agent serves tenants ([`Runtime::start_tenant`]), with /proc mounted
    /// `hidepid=invisible` and command slots for all its tenants.
    pub fn start_host(&self, spec: &SandboxSpec) -> Result<Sandbox, RuntimeError> {
        self.runs(Class::Process).map_err(|why| RuntimeError::ClassUnavailable(Class::Process, why))?;
        self.start_as(spec, true)
    }

    fn start_as(&self, spec: &SandboxSpec, host: bool) -> Result<Sandbox, RuntimeError> {
        let id = match &spec.id {
            Some(id) => valid_id(id)?,
            None => random_id()?,
        };
        if self.socket_path(&id).as_os_str().len() > MAX_SOCKET_PATH {
            return Err(RuntimeError::InvalidId(format!("{id} (its socket path would pass {MAX_SOCKET_PATH} bytes)")));
        }
        if spec.class == Class::Gvisor {
            return self.start_gvisor(spec, id);
        }
        let mut marks = Marks::new();
        // A disk layer is readied (its quota, overlay's mark of its last
        // volatile mount) before anything else is taken.
        let layer = match &spec.writable {
            Writable::Layer(layer) => {
                if layer.read_only() {
                    return Err(StorageError::ReadOnly(layer.name().clone()).into());
                }
                let storage = self.storage.clone().ok_or(RuntimeError::NoStorage)?;
                storage.prepare_mount(layer)?;
                storage.set_limit(layer, Some(spec.disk_bytes))?;
                marks.mark("layer");
                Some((layer.clone(), storage))
            }
            Writable::Memory | Writable::HostDir(_) => None,
        };
        let slot = uids::allocate(&self.cfg.uid_dir, &id, &self.cfg.run_dir)?;
        marks.mark("uid range");
        // The namespaces are made on the other CPU while we make the cgroup.
        let helper =
            match launch::NsHelper::start(slot.base(), uids::RANGE, spec.netns.is_none(), &KERNEL_CAPS.rlimits()) {
                Ok(h) => h,
                Err(e) => {
                    slot.release();
                    return Err(RuntimeError::Io { what: "start the namespace helper".into(), source: e });
                }
            };
        // Headroom for the agent: its own memory, and, for a layer in RAM
        // (the tmpfs, or a build's scratch), files it writes into it for the
        // API (charged to it, the writer), which the layer's size bounds. A
        // disk layer's pages are page cache, reclaimed under the limit.
        let headroom = match spec.writable {
            Writable::Layer(_) => cgroup::AGENT_RESERVE_BYTES,
            Writable::Memory | Writable::HostDir(_) => spec.disk_bytes.saturating_add(cgroup::AGENT_RESERVE_BYTES),
        };
        let cgroup = match self.new_cgroup(&id, &spec.limits, headroom) {
            Ok(c) => c,
            Err(e) => {
                drop(helper);
                slot.release();
                return Err(e.into());
            }
        };
        let socket = self.socket_path(&id);
        marks.mark("cgroup");
        let mut sandbox = Sandbox {
            id,
            pid: 0,
            socket,
            cgroup,
            slot: Some(slot),
            layer,
            timings: Vec::new(),
            gvisor: None,
            host: None,
        };
        let launched = helper.finish().map_err(io_err("create the sandbox's namespaces")).and_then(|ns| {
            marks.mark("namespaces");
            self.launch(&mut sandbox, spec, ns, &mut marks, host)
        });
        match launched {
            Ok(()) => {
                sandbox.timings = marks.done;
                Ok(sandbox)
            }
            Err(e) => {
                let _ = sandbox.destroy();
                Err(e)
            }
        }
    }

    fn launch(
        &self,
        sb: &mut Sandbox,
        spec: &SandboxSpec,
        ns: launch::Namespaces,
        marks: &mut Marks,
        host: bool,
    ) -> Result<(), RuntimeError> {
        let slot = sb.slot.as_ref().expect("a starting sandbox holds its uid slot");
        let userns = ns.user;
        let netns = ns.net;
        let listener = listen_at(&sb.socket)?;

        // The workload's cgroup, which every command joins, and its OOM
        // counter, for the agent (see AgentConfig::work_cgroups).
        let mut extra = Vec::new();
        for path in sb.cgroup.work_procs_files() {
            let f = fs::OpenOptions::new().write(true).custom_flags(libc::O_CLOEXEC).open(&path);
            extra.push(f.map_err(io_err(format!("open {}", path.display())))?);
        }
        let work_cgroups = extra.len() as u32;
        let oom_events = match sb.cgroup.oom_events_file() {
            Some(path) => {
                let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(&path);
                extra.push(f.map_err(io_err(format!("open {}", path.display())))?);
                true
            }
            None => false,
        };
        // Where the agent makes a cgroup per command, so that it needs no
        // supervisor process per command (AgentConfig::tree_cgroup). Not
        // in the process class's shared container, whose tenants' commands
        // keep theirs.
        let max_commands = if host { crate::process::HOST_COMMANDS } else { hutch_agent::proto::MAX_COMMANDS };
        let tree = match host {
            true => None,
            false => sb.cgroup.delegate_tree(slot.base(), slot.base(), max_commands)?,
        };
        let tree_cgroup = match tree {
            Some(dir) => {
                let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC).open(dir);
                extra.push(f.map_err(io_err(format!("open {}", dir.display())))?);
                true
            }
            None => false,
        };

        let (cfg_rd, cfg_wr) = crate::sys::pipe().map_err(io_err("config pipe"))?;
        let config = AgentConfig {
            version: proto::PROTOCOL_VERSION,
            env: spec.env.clone(),
            root_caps: ROOT_CAPS.iter().fold(0u64, |m, c| m | 1 << c),
            replay_bytes: 64 * 1024,
            max_commands,
            work_cgroups,
            oom_events,
            tree_cgroup,
        };
        let mut frame = Vec::with_capacity(512);
        // The filter is installed by the plan, before the agent's exec (see
        // Step::Seccomp); the agent adds none of its own.
        proto::encode(&config, &[], &mut frame).map_err(|e| RuntimeError::Io {
            what: "encode agent config".into(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        File::from(cfg_wr).write_all(&frame).map_err(io_err("write agent config"))?;

        let (agent_path, agent_args) = match &spec.agent_override {
            Some((p, args)) => (p.clone(), args.clone()),
            None => (self.cfg.agent.clone(), vec!["hutch-agent".to_owned()]),
        };
        let agent = open_path(&agent_path).map_err(io_err(format!("open agent {}", agent_path.display())))?;

        let mut procs = Vec::new();
        for path in sb.cgroup.procs_files() {
            let f = fs::OpenOptions::new().write(true).custom_flags(libc::O_CLOEXEC).open(&path);
            procs.push((f.map_err(io_err(format!("open {}", path.display())))?, path));
        }

        let parent =
            if spec.die_with_parent { Some(launch::pidfd_self().map_err(io_err("pidfd_open"))?) } else { None };
        let mut plan = (|| -> io::Result<Plan> {
            let mut plan = Plan::default();
            if let Some(fd) = &parent {
                plan.push(Step::DieWithParent { parent: fd.as_raw_fd() });
            }
            for (f, path) in &procs {
                plan.push(Step::JoinCgroup { fd: f.as_raw_fd(), what: path.display().to_string() });
            }
            // The agent's own limits, inherited by every process after it
            // (the sandbox's total is capped in its user namespace).
            for (resource, limit) in KERNEL_CAPS.rlimits() {
                plan.push(Step::SetRlimit { resource, limit });
            }
            plan.push(Step::Unshare { flags: libc::CLONE_NEWCGROUP });
            // Before /sys is mounted, which shows the mounter's network.
            if let Some(net) = spec.netns.as_deref().or(netns.as_ref()) {
                plan.push(Step::SetNs { fd: net.as_raw_fd(), nstype: libc::CLONE_NEWNET });
            }
            let stage = self.cfg.run_dir.join("stage");
            // Bottom first: the root's layers, then a build's layers on top.
            let (mut lowers, usr) = match &spec.root {
                RootSource::Base => (vec![self.base.clone()], Some(Path::new("/usr"))),
                RootSource::Layers(layers) => (layers.clone(), None),
            };
            lowers.extend(spec.extra_lowers.iter().cloned());
            rootfs::plan_root(
                &mut plan,
                &FsSpec {
                    stage: &stage,
                    lowers: &lowers,
                    usr,
                    upper: match &spec.writable {
                        Writable::Memory => rootfs::Upper::Memory(spec.disk_bytes),
                        Writable::Layer(layer) => rootfs::Upper::Layer(layer.path()),
                        Writable::HostDir(dir) => rootfs::Upper::HostDir(dir),
                    },
                    id_base: slot.base(),
                    userns_fd: userns.as_raw_fd(),
                    empty: &self.cfg.run_dir.join(EMPTY_DIR),
                    shm_bytes: (spec.limits.memory_bytes / 2).min(64 << 20),
                    max_ptys: KERNEL_CAPS.ptys,
                    hidepid: host,
                },
            )?;
            rootfs::plan_volumes(&mut plan, &stage, slot.base(), userns.as_raw_fd(), &spec.volumes)?;
            let binds = [
                (&spec.resolv_conf, "root/etc/resolv.conf"),
                (&spec.ca_bundle, "root/etc/ssl/certs/ca-certificates.crt"),
            ];
            for (resolv, target) in binds.iter().filter_map(|(src, t)| src.as_ref().map(|s| (s, *t))) {
                let target = stage.join(target);
                let mut bind = Plan::default();
                bind.bind(resolv, &target, false, crate::sys::MS_RO_NOSUID_NODEV_NOEXEC)?;
                for step in bind.steps {
                    plan.push(Step::IfExists(Box::new(step)));
                }
            }
            plan.push(Step::SetHostname { name: cstr("sandbox")? });
            plan.push(Step::PivotRoot { new_root: cstr(stage.join("root"))? });
            plan.push(Step::EnterUserns { fd: userns.as_raw_fd() });
            // Entering the user namespace changed our ids, which clears the
            // parent-death signal: set it again.
            if let Some(fd) = &parent {
                plan.push(Step::DieWithParent { parent: fd.as_raw_fd() });
            }
            // Root of the sandbox's user namespace may install a filter
            // without no_new_privs; every process after this one inherits it.
            plan.push(Step::Seccomp { name: self.seccomp.name.clone(), program: self.seccomp.program.clone() });
            let args: Vec<&str> = agent_args.iter().map(String::as_str).collect();
            let lock = slot.file().ok_or_else(|| io::Error::other("the uid slot was handed over"))?;
            let mut fds = vec![(listener.as_raw_fd(), 3), (cfg_rd.as_raw_fd(), 4), (lock.as_raw_fd(), 5)];
            fds.extend(extra.iter().zip(proto::WORK_CGROUP_FD..).map(|(f, n)| (f.as_raw_fd(), n)));
            // The daemon raised its own open-file limit; the sandbox gets
            // the one it started with.
            plan.exec(agent.as_raw_fd(), &args, fds, crate::sys::workload_nofile())?;
            Ok(plan)
        })()
        .map_err(io_err("prepare the sandbox plan"))?;

        marks.mark("prepare");
        let child = launch::spawn(&mut plan).map_err(io_err("clone the sandbox"))?;
        marks.mark("clone");
        sb.pid = child.pid;
        // The OOM killer should pick a workload, never the agent; workloads
        // raise their own score back to 0 before they exec. Best effort: it
        // needs CAP_SYS_RESOURCE, which some hosts (containers) withhold, and
        // the agent's small size already makes it the OOM killer's last pick.
        let _ = fs::write(format!("/proc/{}/oom_score_adj", child.pid), "-1000");
        drop((listener, cfg_rd, userns, netns, agent, procs, parent, extra));
        child.wait_started(&plan)?;
        // PID 1 holds the uid range's lock now, for as long as it lives.
        if let Some(slot) = sb.slot.as_mut() {
            slot.hand_over();
        }
        marks.mark("setup and exec");
        Ok(())
    }

    /// Removes what dead sandboxes of this runtime (its run directory) left
    /// behind: cgroups, sockets and uid slots whose sandbox no longer runs.
    /// Returns the ids cleaned. Slots of other runtimes are theirs to sweep,
    /// unless their run directory is gone, in which case only the slot is
    /// freed (their cgroups and sockets are not ours to judge). Reads every
    /// slot of the host: for a daemon's start; [`Runtime::sweep_own`] is
    /// the routine one.
    pub fn sweep(&self) -> Vec<String> {
        // Slots written before run directories were recorded belong to the
        // runtime whose run directory held the slots.
        let legacy_ours = self.cfg.uid_dir == self.cfg.run_dir.join("uids");
        let mut cleaned = Vec::new();
        for stale in uids::stale(&self.cfg.uid_dir) {
            let ours = match stale.home.as_deref() {
                Some(home) => home == self.cfg.run_dir,
                None => legacy_ours,
            };
            if !ours {
                if stale.home.as_deref().is_some_and(|h| !h.exists()) {
                    stale.release();
                }
                continue;
            }
            cleaned.extend(self.clean_stale(stale));
        }
        cleaned.extend(self.sweep_gvisor());
        cleaned
    }

    /// [`Runtime::sweep`] of the slots this runtime marked as it took them
    /// (a cost of the sandboxes of this run directory, not of the host).
    pub fn sweep_own(&self) -> Vec<String> {
        let mut cleaned: Vec<String> = uids::stale_marked(&self.cfg.uid_dir, &self.cfg.run_dir)
            .into_iter()
            .filter_map(|s| self.clean_stale(s))
            .collect();
        cleaned.extend(self.sweep_gvisor());
        cleaned
    }

    /// Ends what a dead sandbox of ours held (its cgroup, its socket), then
    /// frees its slot. None if its cgroup does not go (the slot stays).
    fn clean_stale(&self, stale: uids::Stale) -> Option<String> {
        let id = stale.owner().to_owned();
        if valid_id(&id).is_ok() {
            let cg = Cgroup::existing(&self.layout, &id);
            if cg.exists() && cg.destroy(Duration::from_secs(1)).is_err() {
                return None;
            }
            let _ = fs::remove_file(self.socket_path(&id));
        }
        stale.release();
        Some(id)
    }

    /// gvisor sandboxes hold no uid slot: their bundles say what exists.
    fn sweep_gvisor(&self) -> Vec<String> {
        let mut cleaned = Vec::new();
        let starting = lock(&self.gvisor_starting).clone();
        for id in self.gvisor_ids().into_iter().filter(|id| !starting.contains(id)) {
            let paths = crate::gvisor::Paths::new(&self.cfg.run_dir, &id);
            let cg = Cgroup::existing(&self.layout, &id);
            if paths.sentry_pid().is_some() || cg.populated().unwrap_or(true) {
                continue;
            }
            crate::gvisor::teardown(&paths);
            if cg.exists() && cg.destroy(Duration::from_secs(1)).is_err() {
                continue;
            }
            let _ = fs::remove_file(self.socket_path(&id));
            cleaned.push(id);
        }
        cleaned
    }

    /// Where the agent socket of sandbox `id` lives.
    pub fn socket_path(&self, id: &str) -> PathBuf {
        self.cfg.run_dir.join("sockets").join(format!("{id}.sock"))
    }

    /// Takes charge of a sandbox started by an earlier run of the daemon: its
    /// PID 1 is no longer our child, and its uid range is held by its PID 1
    /// alone ([`Runtime::sweep`] frees it once the sandbox is destroyed).
    ///
    /// Its disk layer, if it has one, is found by its name (a sandbox's
    /// layer is always [`crate::storage::LayerName::sandbox`] of its id).
    pub fn adopt(&self, id: &str) -> Sandbox {
        let layer = self.storage.as_ref().and_then(|s| {
            let name = crate::storage::LayerName::sandbox(id).ok()?;
            Some((s.open_layer(&name).ok()??, s.clone()))
        });
        let gvisor = Some(crate::gvisor::Paths::new(&self.cfg.run_dir, id)).filter(crate::gvisor::Paths::exists);
        let cgroup = Cgroup::existing(&self.layout, id);
        if let Some(paths) = &gvisor {
            // A restore the last daemon did not finish may have left it
            // without its CPU limit.
            self.reapply_cpu_limit(paths, &cgroup);
        }
        Sandbox {
            id: id.to_owned(),
            pid: 0,
            socket: self.socket_path(id),
            cgroup,
            slot: None,
            layer,
            timings: Vec::new(),
            gvisor,
            host: None,
        }
    }

    /// Ids of sandbox cgroups that exist on the host.
    pub fn cgroups(&self) -> std::collections::BTreeSet<String> {
        cgroup::list_sandboxes(&self.layout)
    }
}

impl Drop for Runtime {
    /// Kept cgroups are no sandbox's: they go with the runtime.
    fn drop(&mut self) {
        if let Some(spares) = &self.spares {
            spares.clear();
        }
    }
}

impl Sandbox {
    /// Whether its writable layer is a disk layer (else memory, or a build's
    /// host directory).
    pub fn on_disk(&self) -> bool {
        self.layer.is_some()
    }

    /// Opens a new connection to the sandbox's agent.
    pub fn connect(&self) -> Result<AgentConn, AgentError> {
        AgentConn::connect(&self.socket)
    }

    /// Host id of the sandbox's root (the start of its uid range), while it
    /// holds the range; an adopted sandbox does not know it.
    pub fn id_base(&self) -> Option<u32> {
        self.slot.as_ref().map(Slot::base)
    }

    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.cgroup.freeze()
    }

    /// Its disk layer, if it has one.
    pub fn layer(&self) -> Option<&Layer> {
        self.layer.as_ref().map(|(l, _)| l)
    }

    /// What the sandbox uses now. Disk figures come from its writable layer:
    /// a disk layer's quota group (bytes used, its limit), or a memory
    /// layer seen through PID 1's root (statfs of an overlay reports its
    /// upper layer's file system, the tmpfs).
    pub fn usage(&self) -> Usage {
        let (memory_cache_bytes, disk_used_bytes, disk_total_bytes) = self.slow_usage();
        Usage { memory_cache_bytes, disk_used_bytes, disk_total_bytes, ..self.quick_usage() }
    }

    /// [`Sandbox::usage`] without the figures [`Sandbox::slow_usage`] reads
    /// (0): memory and CPU time, a number each.
    pub fn quick_usage(&self) -> Usage {
        Usage {
            memory_bytes: self.cgroup.memory_current(),
            memory_cache_bytes: 0,
            cpu_ns: self.cgroup.cpu_usage_ns(),
            disk_used_bytes: 0,
            disk_total_bytes: 0,
        }
    }

    /// The costly part of [`Sandbox::usage`]: its page cache (out of the
    /// memory cgroup's whole statistics file) and the used and total bytes
    /// of its writable layer (its btrfs quota group's files) or root file
    /// system.
    pub fn slow_usage(&self) -> (u64, u64, u64) {
        let (used, total) = self.disk_usage();
        (self.cgroup.memory_cache(), used, total)
    }

    fn disk_usage(&self) -> (u64, u64) {
        match &self.layer {
            Some((layer, storage)) => {
                storage.usage(layer).map(|u| (u.used_bytes, u.limit_bytes.unwrap_or(0))).unwrap_or((0, 0))
            }
            None => match &self.gvisor {
                Some(paths) => statfs_used(&paths.root_statfs_path()).unwrap_or((0, 0)),
                None => statfs_used(&format!("/proc/{}/root/", self.pid)).unwrap_or((0, 0)),
            },
        }
    }

    /// Whether the sandbox still runs: [`Liveness::Dead`] only on a positive
    /// observation (our child PID 1 was reaped, or the cgroup was read and
    /// holds no process); a check that failed is [`Liveness::Unknown`].
    pub fn liveness(&self) -> Liveness {
        if self.host.is_some() {
            return self.tenant_liveness();
        }
        if self.pid > 0 && self.slot.is_some() {
            // Our own child: reap it if it died, so it leaves no zombie.
            let mut status = 0;
            // SAFETY: waitpid with WNOHANG on our child; status is a valid out-pointer.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            return match r {
                0 => Liveness::Alive,
                r if r == self.pid => Liveness::Dead,
                // ECHILD: reaped already (by an earlier check), so dead.
                _ => match io::Error::last_os_error() {
                    e if e.raw_os_error() == Some(libc::ECHILD) => Liveness::Dead,
                    e => Liveness::Unknown(e),
                },
            };
        }
        match self.cgroup.populated() {
            Ok(true) => Liveness::Alive,
            Ok(false) => Liveness::Dead,
            Err(e) => Liveness::Unknown(e),
        }
    }

    /// Whether the sandbox may still run: false only when it is known dead.
    pub fn is_alive(&self) -> bool {
        !matches!(self.liveness(), Liveness::Dead)
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.cgroup.thaw()
    }

    /// Whether destroying it leaves a uid range that only a
    /// [`Runtime::sweep`] frees: a container sandbox adopted from an
    /// earlier run, whose PID 1 held its range, not a slot of ours (a
    /// destroy that needs no sweep skips it).
    pub fn leaves_ids_to_sweep(&self) -> bool {
        self.slot.is_none() && self.gvisor.is_none() && self.host.is_none()
    }

    /// Kills every process of the sandbox and removes everything it held:
    /// cgroup, socket, uid range. Mounts and namespaces die with PID 1. A
    /// disk layer stays: it is the caller's to keep or delete
    /// ([`Storage::delete`]).
    pub fn destroy(self) -> Result<(), RuntimeError> {
        if self.host.is_some() {
            return self.destroy_tenant();
        }
        let Sandbox { pid, socket, cgroup, slot, gvisor, .. } = self;
        // The cgroup first: a frozen (paused) gvisor sandbox's sentry
        // answers no runsc command, and `runsc kill` would wait for it for
        // ever; once it is dead runsc only removes its state.
        let _ = cgroup.kill_all();
        if let Some(paths) = &gvisor {
            crate::gvisor::teardown(paths);
        }
        // Only a sandbox we started is our child; an adopted one's PID 1 was
        // reparented, and its pid may have been reused since.
        if pid > 0 && slot.is_some() {
            crate::sys::kill(pid, libc::SIGKILL);
            crate::sys::reap(pid);
        }
        let _ = fs::remove_file(&socket);
        cgroup.destroy(Duration::from_secs(5))?;
        // Last: the range is free only once no process of the sandbox lives.
        if let Some(slot) = slot {
            slot.release();
        }
        Ok(())
    }
}

/// What a liveness check saw.
#[derive(Debug)]
pub enum Liveness {
    Alive,
    /// Positively observed: PID 1 was reaped, or the cgroup is empty.
    Dead,
    /// The check failed (out of descriptors, out of memory, ...): no verdict.
    Unknown(io::Error),
}

/// A sandbox's resource use at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub memory_bytes: u64,
    pub memory_cache_bytes: u64,
    /// CPU time used since the sandbox started.
    pub cpu_ns: u64,
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
}

/// (used, total) bytes of the file system holding `path`.
fn statfs_used(path: &str) -> Option<(u64, u64)> {
    let c = cstr(path).ok()?;
    // SAFETY: st is a valid out-pointer; c a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let bsize = st.f_bsize as u64;
    Some(((st.f_blocks - st.f_bfree) as u64 * bsize, st.f_blocks as u64 * bsize))
}

fn open_path(path: &Path) -> io::Result<OwnedFd> {
    crate::sys::open(path, libc::O_PATH)
}

/// Sandbox ids name cgroups, sockets and slot files: keep them plain.
pub fn valid_id(id: &str) -> Result<String, RuntimeError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-');
    if ok {
        Ok(id.to_owned())
    } else {
        Err(RuntimeError::InvalidId(id.to_owned()))
    }
}

/// Length of a random id.
const RANDOM_ID_LEN: usize = 19;
/// Longest path a unix socket address holds.
const MAX_SOCKET_PATH: usize = 107;

/// A random id: "sb-" and 16 hex digits.
pub fn random_id() -> Result<String, RuntimeError> {
    let mut b = [0u8; 8];
    crate::sys::random_bytes(&mut b).map_err(io_err("random id"))?;
    Ok(format!("sb-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>()))
}

/// A mutex's guard, poisoned or not (what it guards stays consistent: sets
/// of ids).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_plain() {
        assert!(valid_id("sb-0123abcd").is_ok());
        for bad in ["", "-x", "A", "a/b", "a.b", "..", &"a".repeat(65)] {
            assert!(valid_id(bad).is_err(), "{bad:?}");
        }
        let id = random_id().expect("random");
        assert!(valid_id(&id).is_ok());
        assert_eq!(id.len(), 19);
    }

    #[test]
    fn a_listener_replaces_a_stale_socket_file_and_refuses_a_bad_path() {
        let dir = std::env::temp_dir().join(format!("hutch-listen-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("sb.sock");
        drop(listen_at(&path).expect("fresh"));
        // The first listener is gone, its file is not.
        assert!(path.exists());
        let l = listen_at(&path).expect("over a stale file");
        std::os::unix::net::UnixStream::connect(&path).expect("connect");
        l.set_nonblocking(true).expect("nonblocking");
        assert!(l.accept().is_ok(), "the new listener took the connection");
        let err = listen_at(&dir.join("missing").join("sb.sock")).expect_err("no such directory");
        assert!(matches!(err, RuntimeError::Io { .. }), "{err:?}");
        fs::remove_dir_all(&dir).expect("clean up");
    }
}
