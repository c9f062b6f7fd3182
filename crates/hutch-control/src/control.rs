//! The control plane's one type, [`Control`]: what it holds and the small
//! things every operation shares (the store on the blocking pool, the live
//! sandboxes, the host's capacity, views of records). The operations live
//! beside it, one module per concern: `sandboxes` (lifecycle), `recover`
//! (restart and reconciler), `exec` (commands), `session` (E2B processes
//! and watches), `fileops` and `files` (files), `templates`, `pool`,
//! `build`, `access` (ports), `keys` (keys, quotas, usage), `e2b`
//! (envd credentials).

use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, SandboxId};
use crate::lifecycle::{Live, Transition};
use crate::metrics::Metrics;
use crate::network::NetRecord;
use hutch_api::{Limits, LimitsRequest, Sandbox};
use hutch_runtime::net::Network;
use hutch_runtime::Runtime;
use hutch_store::{Changes, QuickReads, SandboxRecord, Store};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use hutch_api::time::{now_ms, parse_rfc3339, rfc3339};

/// The instant `retention` ago, in Unix ms: what a retention prune deletes
/// is older than this.
pub(crate) fn cutoff(retention: Duration) -> i64 {
    now_ms().saturating_sub(retention.as_millis().min(i64::MAX as u128) as i64)
}

/// The builtin template: the host's /usr, nothing to build.
#[derive(Debug, Clone)]
pub struct Template {
    pub name: &'static str,
    pub default_ttl: Duration,
    pub max_ttl: Duration,
}

pub const BASE: Template =
    Template { name: "base", default_ttl: Duration::from_secs(600), max_ttl: Duration::from_secs(24 * 3600) };

/// Bounds on what a create may ask for (the host's capacity may refuse less).
pub(crate) const MEMORY_MB: (u64, u64) = (64, 262_144);
pub(crate) const DISK_MIB: (u64, u64) = (16, 65_536);
pub(crate) const PIDS: (u32, u32) = (16, 65_536);
pub(crate) const VCPUS: (f64, f64) = (0.05, 64.0);

/// What the host may hold, the operator's choice: the sum over every
/// sandbox that is not terminated (warm ones included), and the most one
/// sandbox may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub sandboxes: u64,
    /// Sum of memory limits (the host's memory times the overcommit).
    pub memory_mb: u64,
    /// Sum of writable layer sizes.
    pub disk_mib: u64,
    /// The most one sandbox may ask for: the host's memory.
    pub sandbox_memory_mb: u64,
    pub sandbox_disk_mib: u64,
}

/// Default overcommit of memory and disk limits.
pub const DEFAULT_OVERCOMMIT: f64 = 8.0;
/// Default most sandboxes at once.
pub const DEFAULT_MAX_SANDBOXES: u64 = 4096;

impl Capacity {
    /// The host's capacity: its memory (`/proc/meminfo`) and the size of the
    /// state directory's file system, times `overcommit` for the sums.
    pub fn of_host(
        proc_root: &std::path::Path,
        state_dir: &std::path::Path,
        overcommit: f64,
        sandboxes: u64,
    ) -> Capacity {
        let mem_mb = std::fs::read_to_string(proc_root.join("meminfo"))
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    let kb = l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim();
                    kb.parse::<u64>().ok()
                })
            })
            .map_or(MEMORY_MB.1, |kb| kb / 1024);
        let disk_mib = hutch_runtime::sys::fs_size(state_dir).map_or(DISK_MIB.1, |b| b >> 20);
        let scale = |v: u64| (v as f64 * overcommit.max(0.0)).min(u64::MAX as f64) as u64;
        Capacity {
            sandboxes,
            memory_mb: scale(mem_mb),
            disk_mib: scale(disk_mib),
            sandbox_memory_mb: mem_mb,
            sandbox_disk_mib: disk_mib.max(DISK_MIB.0),
        }
    }

    /// No limits beyond the per-request bounds (tests of the control plane).
    pub fn unlimited() -> Capacity {
        Capacity {
            sandboxes: u64::MAX,
            memory_mb: u64::MAX,
            disk_mib: u64::MAX,
            sandbox_memory_mb: MEMORY_MB.1,
            sandbox_disk_mib: DISK_MIB.1,
        }
    }

    pub(crate) fn as_quotas(&self) -> hutch_store::Quotas {
        hutch_store::Quotas {
            sandboxes: Some(self.sandboxes),
            memory_mb: Some(self.memory_mb),
            disk_mib: Some(self.disk_mib),
            ttl_seconds: None,
            builds: None,
            snapshots: None,
        }
    }
}

/// How the daemon set the control plane up.
pub struct Config {
    /// Sandbox networks; `Err` says why the host has none (then only
    /// `deny_all` sandboxes start).
    pub network: std::result::Result<Arc<Network>, String>,
    pub capacity: Capacity,
    /// The key of the E2B API's envd access tokens.
    pub e2b_secret: Vec<u8>,
    /// The domain under which the E2B API's sandbox host names
    /// (`<port>-<sandbox>.<domain>`) reach this daemon; without one, the
    /// E2B API names no domain and serves no port by host name.
    pub e2b_domain: Option<String>,
    /// Registries (`host[:port]`, `docker.io` for Docker Hub) that the E2B
    /// API's `from_image` may pull from; none by default.
    pub e2b_registries: Vec<String>,
    /// A credential that reads `/metrics` (the operator's view) and nothing
    /// else, for a scraper that holds no API key.
    pub metrics_token: Option<String>,
    /// Events and webhooks.
    pub events: crate::events::Settings,
    /// The CA bundle that trusts the egress proxy, bound into sandboxes
    /// that name secrets; None: no egress proxy runs, and a sandbox that
    /// names a secret is refused.
    pub egress_bundle: Option<std::path::PathBuf>,
    /// This daemon's node: its name, address and heartbeat.
    pub node: crate::nodes::NodeConfig,
    /// The fleet's OCI registry, through which snapshots and sandboxes
    /// paused to disk start on another node (see `moves`).
    pub registry: Option<hutch_runtime::image::push::Target>,
    /// The class of the builtin templates (`base`, and the code
    /// interpreter's) and of a template that names none; `container`
    /// unless the operator says (`hutch serve --default-class`).
    pub default_class: hutch_api::Class,
}

impl Config {
    /// No network, no capacity limits, a fixed E2B key: for tests.
    pub fn for_tests() -> Config {
        Config {
            network: Err("networking is not set up".into()),
            capacity: Capacity::unlimited(),
            e2b_secret: vec![7; 32],
            e2b_domain: None,
            e2b_registries: Vec::new(),
            metrics_token: None,
            events: crate::events::Settings::default(),
            egress_bundle: None,
            node: crate::nodes::NodeConfig::local(),
            registry: None,
            default_class: hutch_api::Class::Container,
        }
    }
}

/// The control plane.
pub struct Control {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) runtime: Arc<Runtime>,
    pub(crate) metrics: Metrics,
    live: Mutex<HashMap<SandboxId, Arc<Live>>>,
    /// Sandboxes deleted while they start: their boot stops waiting.
    cancelled: Mutex<HashSet<SandboxId>>,
    /// Ids of revoked keys, as of the last reconciler tick (and every
    /// revocation through the API since).
    revoked: Mutex<HashSet<String>>,
    shutting_down: AtomicBool,
    pub(crate) pool: crate::pool::PoolState,
    pub(crate) network: std::result::Result<Arc<Network>, String>,
    pub(crate) capacity: Capacity,
    pub(crate) e2b_secret: Vec<u8>,
    pub(crate) e2b_domain: Option<String>,
    pub(crate) e2b_registries: Vec<String>,
    pub(crate) metrics_token: Option<String>,
    pub(crate) access: crate::access::Grants,
    pub(crate) builds: crate::build::Builds,
    /// Held across a policy change's kernel update and its record, so two
    /// changes cannot leave the record saying another than the kernel.
    pub(crate) net_updates: Arc<Mutex<()>>,
    /// Each live sandbox's recent metric samples and log.
    pub(crate) history: Arc<crate::history::History>,
    /// The audit log's queue and writer.
    pub(crate) audit: crate::audit::Auditor,
    /// The event sequence, its writer's queue and the live broadcast.
    pub(crate) events: crate::events::Events,
    /// Each key's grant secret, once read.
    pub(crate) grant_secrets: crate::grants::Secrets,
    /// Sandboxes' idle policies.
    pub(crate) idle: crate::idle::Idle,
    /// Pauses whose teardown is under way (the record already says
    /// `paused`): a wake waits for the signal (sent, or dropped, at its end).
    pub(crate) pausing: Mutex<HashMap<String, tokio::sync::watch::Receiver<bool>>>,
    /// Set while an idle sweep runs (one at a time).
    pub(crate) idle_sweeping: Arc<AtomicBool>,
    /// Sandboxes whose destruction is under way here.
    pub(crate) ending: Endings,
    /// Usage counted and not yet written.
    pub(crate) meter: crate::usage::Meter,
    /// The key that seals secrets, loaded at first use.
    pub(crate) secret_keys: crate::secrets::SecretKeys,
    /// The CA bundle (the host's roots and the egress proxy's CA) bound
    /// into sandboxes that name secrets; None: no egress proxy runs.
    pub(crate) egress_bundle: Option<std::path::PathBuf>,
    /// Host containers of the process class.
    pub(crate) hosts: crate::process::Hosts,
    /// This daemon's node: it acts only on sandboxes of this node.
    pub(crate) node: crate::nodes::NodeConfig,
    /// What this daemon last read of the fleet, for routing and placement.
    pub(crate) fleet: crate::nodes::FleetView,
    /// The fleet's registry (see `moves`).
    pub(crate) registry: Option<hutch_runtime::image::push::Target>,
    /// See `Config::default_class`.
    pub(crate) default_class: hutch_api::Class,
}

/// The stable digest of a request body, for idempotency checks.
pub fn request_hash<T: serde::Serialize>(body: &T) -> String {
    let json = serde_json::to_vec(body).unwrap_or_default();
    hex::encode(Sha256::digest(&json))
}

pub(crate) fn check_map(what: &str, map: &BTreeMap<String, String>, max: usize) -> Result<()> {
    if map.len() > max {
        return Err(ControlError::Invalid(format!("{what}: at most {max} entries")));
    }
    for (k, v) in map {
        if k.is_empty() || k.len() > 256 || k.contains(['=', '\0']) || v.len() > 32 * 1024 || v.contains('\0') {
            return Err(ControlError::Invalid(format!("{what}: invalid entry {k:?}")));
        }
    }
    Ok(())
}

/// Validated limits: (memory MiB, vcpus, disk MiB, pids).
pub fn resolve_limits(memory_mb: Option<u64>, limits: Option<&LimitsRequest>) -> Result<(u64, f64, u64, u32)> {
    let memory = memory_mb.unwrap_or(1024);
    let l = limits.cloned().unwrap_or_default();
    let vcpus = l.vcpus.unwrap_or(1.0);
    let disk = l.disk_mib.unwrap_or(1024);
    let pids = l.pids.unwrap_or(512);
    if !(MEMORY_MB.0..=MEMORY_MB.1).contains(&memory) {
        return Err(ControlError::Invalid(format!("memory_mb must be {} to {}", MEMORY_MB.0, MEMORY_MB.1)));
    }
    if !(vcpus.is_finite() && (VCPUS.0..=VCPUS.1).contains(&vcpus)) {
        return Err(ControlError::Invalid(format!("limits.vcpus must be {} to {}", VCPUS.0, VCPUS.1)));
    }
    if !(DISK_MIB.0..=DISK_MIB.1).contains(&disk) {
        return Err(ControlError::Invalid(format!("limits.disk_mib must be {} to {}", DISK_MIB.0, DISK_MIB.1)));
    }
    if !(PIDS.0..=PIDS.1).contains(&pids) {
        return Err(ControlError::Invalid(format!("limits.pids must be {} to {}", PIDS.0, PIDS.1)));
    }
    Ok((memory, vcpus, disk, pids))
}

/// The API view of a stored sandbox.
pub(crate) fn view(r: &SandboxRecord) -> Sandbox {
    Sandbox {
        id: r.id.clone(),
        template: r.template.clone(),
        state: r.state,
        created_at: rfc3339(r.created_at),
        expires_at: rfc3339(r.expires_at),
        memory_mb: r.memory_mb,
        limits: Limits { vcpus: r.vcpus, disk_mib: r.disk_mib, pids: r.pids, applied: r.limits_applied.clone() },
        metadata: serde_json::from_str(&r.metadata).unwrap_or_default(),
        last_error_code: r.last_error_code.clone(),
        warm: r.warm,
        template_id: r.template_id.clone(),
        template_version: r.template_version.map(|v| v as u64),
        network: NetRecord::parse(&r.network).view(),
        owner: r.owner.clone(),
        class: r.class,
        storage: r.storage,
        // A fork's origin is a layer of its own, not a snapshot to name.
        snapshot: r.origin.clone().filter(|o| o.starts_with("snap-")),
        on_expire: r.on_expire,
        paused_ttl_seconds: r.paused_ttl_s.unwrap_or(crate::sandboxes::PAUSED_TTL_DEFAULT),
        idle_timeout_seconds: None,
        on_idle: None,
        idle_since: None,
        volumes: Vec::new(),
        node: r.node.clone(),
        reason: r.reason.clone(),
    }
}

/// What a transition sets besides the state (the store's [`Changes`],
/// owned, so it can travel to the blocking pool).
#[derive(Debug, Clone, Default)]
pub(crate) struct Set {
    pub reason: Option<crate::lifecycle::Reason>,
    pub host_pid: Option<i64>,
    pub limits_applied: Option<&'static str>,
    /// JSON, as the record's `network`.
    pub network: Option<String>,
    /// Only while the row names this node ([`Changes::on_node`]).
    pub on_node: Option<String>,
}

impl Set {
    pub(crate) fn reason(reason: Option<crate::lifecycle::Reason>) -> Set {
        Set { reason, ..Set::default() }
    }

    pub(crate) fn changes(&self) -> Changes<'_> {
        Changes {
            last_error_code: self.reason.map(crate::lifecycle::Reason::as_str),
            host_pid: self.host_pid,
            limits_applied: self.limits_applied,
            network: self.network.as_deref(),
            on_node: self.on_node.as_deref(),
            usage_at: None,
        }
    }
}

/// What a caller needs to do with a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// Read or end it: its owner, or an admin.
    Manage,
    /// Run commands, move files, open ports: its owner only.
    Use,
}

impl Control {
    pub fn new(store: Arc<dyn Store>, runtime: Arc<Runtime>, config: Config) -> Arc<Control> {
        Arc::new(Control {
            store,
            runtime,
            metrics: Metrics::default(),
            live: Mutex::new(HashMap::new()),
            cancelled: Mutex::new(HashSet::new()),
            revoked: Mutex::new(HashSet::new()),
            shutting_down: AtomicBool::new(false),
            pool: crate::pool::PoolState::default(),
            network: config.network,
            capacity: config.capacity,
            e2b_secret: config.e2b_secret,
            e2b_domain: config.e2b_domain,
            e2b_registries: config.e2b_registries,
            metrics_token: config.metrics_token,
            access: crate::access::Grants::default(),
            builds: crate::build::Builds::default(),
            net_updates: Arc::new(Mutex::new(())),
            secret_keys: crate::secrets::SecretKeys::default(),
            egress_bundle: config.egress_bundle,
            hosts: crate::process::Hosts::default(),
            node: config.node,
            fleet: Default::default(),
            registry: config.registry,
            default_class: config.default_class,
            history: Arc::new(crate::history::History::default()),
            audit: crate::audit::Auditor::default(),
            events: crate::events::Events::new(config.events),
            grant_secrets: crate::grants::Secrets::default(),
            idle: crate::idle::Idle::default(),
            pausing: Mutex::new(HashMap::new()),
            idle_sweeping: Arc::new(AtomicBool::new(false)),
            ending: Endings::default(),
            meter: crate::usage::Meter::default(),
        })
    }

    /// Runs a store call on the blocking pool: SQLite blocks, and an async
    /// worker must never wait on a disk or a lock.
    pub(crate) async fn db<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store) -> hutch_store::Result<T> + Send + 'static,
    {
        let store = self.store.clone();
        Ok(tokio::task::spawn_blocking(move || f(store.as_ref())).await??)
    }

    /// A point read ([`QuickReads`]): made on this thread where the store
    /// has a connection for them (a local file's: tens of microseconds,
    /// never behind a write), on the blocking pool elsewhere. Handing a
    /// read that short to another thread and back cost more CPU than the
    /// read, several times per request.
    pub(crate) async fn db_read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&dyn QuickReads) -> hutch_store::Result<T> + Send + 'static,
    {
        if let Some(reads) = self.store.quick_reads() {
            return Ok(f(reads)?);
        }
        let store = self.store.clone();
        Ok(tokio::task::spawn_blocking(move || f(store.as_ref())).await??)
    }

    /// One transition of a sandbox's state (see `lifecycle`), setting
    /// `set`; None when the sandbox was in none of the states it leaves.
    pub(crate) async fn transition(&self, id: &SandboxId, t: Transition, set: Set) -> Result<Option<SandboxRecord>> {
        let sid = id.as_str().to_owned();
        // The one place a sandbox's transitions become events and usage
        // intervals: after the store's conditional update said it happened
        // (its usage mark in the same transaction).
        let change = move |s: &dyn Store| {
            s.transition(&sid, t.from(), t.to(), &Changes { usage_at: Some(now_ms()), ..set.changes() })
        };
        let moved = match t.to() {
            // Its counts so far are written with it.
            hutch_api::SandboxState::Paused | hutch_api::SandboxState::Terminated => {
                self.transition_counted(id, change).await?
            }
            _ => self.db(change).await?,
        };
        if let Some(r) = &moved {
            self.emit_transition(t, r);
        }
        Ok(moved)
    }

    pub(crate) async fn sandbox_record(&self, id: &SandboxId) -> Result<Option<SandboxRecord>> {
        let id = id.as_str().to_owned();
        self.db_read(move |s| s.get_sandbox(&id)).await
    }

    /// Where a sandbox's files live: what was asked, or the host's default
    /// (disk where the runtime has storage, memory where it has none). Disk
    /// asked of a host without storage is refused, never downgraded.
    pub(crate) fn storage_kind(&self, asked: Option<hutch_api::StorageKind>) -> Result<hutch_api::StorageKind> {
        use hutch_api::StorageKind;
        let has_disk = self.runtime.storage().is_some();
        match asked {
            Some(StorageKind::Disk) if !has_disk => Err(ControlError::FeatureUnavailable(
                "disk storage is not available on this host (see `hutch doctor` and the daemon's log); \
                 ask for \"storage\": \"memory\""
                    .into(),
            )),
            Some(kind) => Ok(kind),
            None if has_disk => Ok(StorageKind::Disk),
            None => Ok(StorageKind::Memory),
        }
    }

    /// Where the files of a sandbox of `class` live: [`Control::storage_kind`],
    /// except that a process sandbox keeps its home in its host
    /// container's memory layer unless it asks (and is then refused disk).
    /// A create and a warm pool's refill both ask here, so a claim finds
    /// the storage its template's pool was made with.
    pub(crate) fn sandbox_storage(
        &self,
        class: hutch_runtime::Class,
        asked: Option<hutch_api::StorageKind>,
    ) -> Result<hutch_api::StorageKind> {
        match (class, asked) {
            (hutch_runtime::Class::Process, None) => Ok(hutch_api::StorageKind::Memory),
            (_, asked) => self.storage_kind(asked),
        }
    }

    /// Checks that what a sandbox does at its expiry fits where its files
    /// live (`storage` None: the host's default): pausing keeps files on
    /// disk.
    pub(crate) fn check_on_expire(
        &self,
        on_expire: Option<hutch_api::OnExpire>,
        storage: Option<hutch_api::StorageKind>,
    ) -> Result<()> {
        if on_expire == Some(hutch_api::OnExpire::Pause) && self.storage_kind(storage)? != hutch_api::StorageKind::Disk
        {
            return Err(ControlError::Invalid(
                "on_expire \"pause\" keeps the sandbox's files on disk: it needs \"storage\": \"disk\"".into(),
            ));
        }
        Ok(())
    }

    /// Checks a network request against what the host can do.
    pub(crate) fn network_record(&self, req: Option<&hutch_api::NetworkRequest>) -> Result<NetRecord> {
        let rec = NetRecord::from_request(req)?;
        if rec.egress != hutch_api::Egress::DenyAll {
            if let Err(why) = &self.network {
                return Err(ControlError::FeatureUnavailable(format!(
                    "egress {:?} needs sandbox networking, which this host lacks: {why}",
                    rec.egress
                )));
            }
        }
        Ok(rec)
    }

    pub fn shut_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    fn live_map(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Arc<Live>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn live(&self, id: &SandboxId) -> Option<Arc<Live>> {
        self.live_map().get(id).cloned()
    }

    pub(crate) fn insert_live(&self, live: Arc<Live>) {
        self.live_map().insert(live.id.clone(), live);
    }

    pub(crate) fn remove_live(&self, id: &SandboxId) -> Option<Arc<Live>> {
        self.live_map().remove(id)
    }

    fn cancelled_set(&self) -> std::sync::MutexGuard<'_, HashSet<SandboxId>> {
        self.cancelled.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks a starting sandbox deleted: its boot stops waiting for it.
    pub(crate) fn cancel(&self, id: &SandboxId) {
        self.cancelled_set().insert(id.clone());
    }

    pub(crate) fn uncancel(&self, id: &SandboxId) {
        self.cancelled_set().remove(id);
    }

    pub(crate) fn is_cancelled(&self, id: &SandboxId) -> bool {
        self.cancelled_set().contains(id)
    }

    /// Where archive uploads into sandbox `id` keep their undo journal.
    pub(crate) fn upload_journal(&self, id: &SandboxId) -> crate::files::JournalDir {
        crate::files::JournalDir { dir: self.runtime.config().state_dir.join("uploads"), sandbox: id.to_string() }
    }

    pub(crate) fn is_revoked(&self, owner: &OwnerId) -> bool {
        self.revoked.lock().unwrap_or_else(|p| p.into_inner()).contains(owner.as_str())
    }

    pub(crate) fn set_revoked(&self, ids: HashSet<String>) {
        *self.revoked.lock().unwrap_or_else(|p| p.into_inner()) = ids;
    }

    pub(crate) fn add_revoked(&self, id: &OwnerId) {
        self.revoked.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string());
    }

    pub(crate) fn lives(&self) -> Vec<Arc<Live>> {
        self.live_map().values().cloned().collect()
    }

    /// The stored record of a sandbox the caller may see: an unclaimed
    /// warm sandbox is nobody's yet; another owner's is not found (for an
    /// admin, it is found when `need` is `Manage`).
    pub(crate) async fn record(&self, caller: &Caller, id: &SandboxId, need: Need) -> Result<SandboxRecord> {
        caller.admit_sandbox(id)?;
        match self.sandbox_record(id).await? {
            Some(r) if !r.pooled && allowed(caller, &r.owner, need) => Ok(r),
            _ => Err(ControlError::NoSandbox(id.to_string())),
        }
    }

    /// The live sandbox for a command of `caller`, or why not. A running
    /// sandbox is found in memory (its owner and state are known there);
    /// only the others cost a store read, to say why.
    pub(crate) async fn running(&self, caller: &Caller, id: &SandboxId) -> Result<Arc<Live>> {
        caller.admit_sandbox(id)?;
        if let Some(live) = self.live(id) {
            if !live.is_pooled() && caller.may_use(live.owner.as_str()) {
                live.touch();
                if live.is_suspended() {
                    return Err(ControlError::NotRunning {
                        id: id.to_string(),
                        state: hutch_api::SandboxState::Suspended,
                    });
                }
                return Ok(live);
            }
        }
        let r = self.record(caller, id, Need::Use).await?;
        // A lost sandbox runs nowhere, whichever node is asked.
        if r.state == hutch_api::SandboxState::Lost {
            return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
        }
        self.on_this_node(&r)?;
        match r.state {
            // Running in the store but not (yet) in memory: its boot is
            // finishing.
            hutch_api::SandboxState::Running => {
                Err(ControlError::NotRunning { id: id.to_string(), state: hutch_api::SandboxState::Starting })
            }
            state => Err(ControlError::NotRunning { id: id.to_string(), state }),
        }
    }

    /// The live sandbox of `owner` (an E2B session proved its owner through
    /// the sandbox's token).
    pub(crate) async fn running_of(&self, owner: &OwnerId, id: &SandboxId) -> Result<Arc<Live>> {
        self.running(&Caller::key(owner.clone(), false), id).await
    }
}

pub(crate) fn allowed(caller: &Caller, owner: &str, need: Need) -> bool {
    match need {
        Need::Manage => caller.may_manage(owner),
        Need::Use => caller.may_use(owner),
    }
}

/// Sandboxes whose destruction is under way: one teardown of each at a
/// time. A delete marks its sandbox `terminating` before its teardown, and
/// the reconciler retries the teardown of every `terminating` one: without
/// a claim it would tear down, again and at once, every sandbox a delete
/// is ending (adopting each as a stranger's, sweeping the run directory's
/// slots).
#[derive(Default)]
pub(crate) struct Endings(Mutex<HashSet<SandboxId>>);

impl Endings {
    /// Claims the destruction of `id` until the guard drops; None while
    /// another claim holds it.
    pub(crate) fn claim(&self, id: &SandboxId) -> Option<Ending<'_>> {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        held.insert(id.clone()).then(|| Ending { endings: self, id: id.clone() })
    }
}

/// A claim on a sandbox's destruction ([`Endings::claim`]).
pub(crate) struct Ending<'a> {
    endings: &'a Endings,
    id: SandboxId,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.endings.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandboxs_destruction_is_claimed_once_until_its_claim_ends() {
        let endings = Endings::default();
        let (a, b) = (
            SandboxId::parse("sb-0123456789abcdef").expect("id"),
            SandboxId::parse("sb-fedcba9876543210").expect("id"),
        );
        let first = endings.claim(&a).expect("the first claim");
        assert!(endings.claim(&a).is_none(), "a second teardown was let in beside the first");
        let other = endings.claim(&b).expect("another sandbox's claim");
        drop(first);
        assert!(endings.claim(&a).is_some(), "the claim outlived its guard");
        drop(other);
    }

    #[test]
    fn limits_are_bounded() {
        assert!(resolve_limits(Some(32), None).is_err());
        assert!(resolve_limits(None, Some(&LimitsRequest { vcpus: Some(f64::NAN), ..Default::default() })).is_err());
        assert!(resolve_limits(None, Some(&LimitsRequest { pids: Some(1), ..Default::default() })).is_err());
        assert_eq!(resolve_limits(None, None).expect("defaults"), (1024, 1.0, 1024, 512));
    }

    #[test]
    fn capacity_scales_the_hosts_memory_and_disk() {
        let dir = std::env::temp_dir().join(format!("hutch-cap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("meminfo"), "MemTotal:       2097152 kB\nMemFree: 1 kB\n").expect("write");
        let c = Capacity::of_host(&dir, &dir, 2.0, 10);
        assert_eq!((c.sandboxes, c.memory_mb, c.sandbox_memory_mb), (10, 4096, 2048));
        assert!(c.disk_mib >= c.sandbox_disk_mib);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
