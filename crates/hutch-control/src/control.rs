//! Sandboxes and their lifetimes: create (idempotent), read, list, extend,
//! suspend, resume, delete, and the reconciler that expires sandboxes and
//! finishes interrupted deletions. Runtime calls block for a few
//! milliseconds, so they run on tokio's blocking pool.

use crate::error::{ControlError, Result};
use crate::metrics::Metrics;
use crate::network::NetRecord;
use hutch_api::{CreateSandbox, Extend, Limits, LimitsRequest, Sandbox, SandboxList, SandboxState};
use hutch_runtime::cgroup::Limits as CgLimits;
use hutch_runtime::container::Liveness;
use hutch_runtime::image::{ImageError, ImageStore};
use hutch_runtime::net::{Attached, Network};
use hutch_runtime::{RootSource, Runtime, SandboxSpec};
use hutch_store::{SandboxRecord, Store, StoreError};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A template: what a sandbox runs and its lifetime bounds. Only the
/// host-based `base` exists until templates land.
#[derive(Debug, Clone)]
pub struct Template {
    pub name: &'static str,
    pub default_ttl: Duration,
    pub max_ttl: Duration,
}

pub const BASE: Template =
    Template { name: "base", default_ttl: Duration::from_secs(600), max_ttl: Duration::from_secs(24 * 3600) };

/// Bounds on what a create may ask for.
const MEMORY_MB: (u64, u64) = (64, 262_144);
const DISK_MIB: (u64, u64) = (16, 65_536);
const PIDS: (u32, u32) = (16, 65_536);
const VCPUS: (f64, f64) = (0.05, 64.0);

/// A sandbox the daemon runs now.
pub struct Live {
    pub id: String,
    pub socket: PathBuf,
    /// The runtime's handle; taken by the deletion.
    pub(crate) handle: Mutex<Option<hutch_runtime::Sandbox>>,
    /// Set while frozen: no new commands.
    pub suspended: AtomicBool,
    /// Idle agent connections, reused by commands (a connect and an accept
    /// saved per command).
    idle: Mutex<Vec<hutch_runtime::agent_async::AsyncConn>>,
    /// When background commands started, by pid, for reattached streams.
    pub started: Mutex<HashMap<u32, Instant>>,
}

/// Idle connections kept per sandbox.
const IDLE_CONNS: usize = 4;

impl Live {
    /// An agent connection: an idle one, or a new one.
    pub async fn conn(
        &self,
    ) -> std::result::Result<hutch_runtime::agent_async::AsyncConn, hutch_runtime::agent::AgentError> {
        if let Some(c) = self.idle.lock().ok().and_then(|mut v| v.pop()) {
            return Ok(c);
        }
        hutch_runtime::agent_async::AsyncConn::connect(&self.socket).await
    }

    /// Gives a connection back when nothing unread is left on it.
    pub fn reuse(&self, conn: hutch_runtime::agent_async::AsyncConn) {
        if conn.is_clean() {
            if let Ok(mut v) = self.idle.lock() {
                if v.len() < IDLE_CONNS {
                    v.push(conn);
                }
            }
        }
    }
}

impl Live {
    fn new(sb: hutch_runtime::Sandbox) -> Arc<Live> {
        Arc::new(Live {
            id: sb.id.clone(),
            socket: sb.socket.clone(),
            handle: Mutex::new(Some(sb)),
            suspended: AtomicBool::new(false),
            idle: Mutex::new(Vec::new()),
            started: Mutex::new(HashMap::new()),
        })
    }
}

/// The control plane.
pub struct Control {
    pub store: Arc<dyn Store>,
    pub runtime: Arc<Runtime>,
    pub metrics: Arc<Metrics>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    shutting_down: AtomicBool,
    pub(crate) pool: crate::pool::PoolState,
    /// Sandbox networks; `Err` says why the host has none (then only
    /// `deny_all` sandboxes start).
    pub network: std::result::Result<Arc<Network>, String>,
    /// Port access grants (see access.rs).
    pub(crate) access: crate::access::Grants,
    pub(crate) builds: crate::build::Builds,
}

pub fn now_ms() -> i64 {
    crate::keys::now_ms()
}

/// RFC 3339 in UTC with milliseconds, from Unix milliseconds.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fff]Z` (or `+00:00`) into Unix milliseconds.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let s = s.strip_suffix('Z').or_else(|| s.strip_suffix("+00:00"))?;
    let (date, time) = s.split_once('T')?;
    let mut dp = date.split('-');
    let y: i64 = dp.next()?.parse().ok()?;
    let m: i64 = dp.next()?.parse().ok()?;
    let d: i64 = dp.next()?.parse().ok()?;
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut tp = hms.split(':');
    let (hh, mm, ss): (i64, i64, i64) = (tp.next()?.parse().ok()?, tp.next()?.parse().ok()?, tp.next()?.parse().ok()?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let frac_ms: i64 = format!("{:0<3}", &frac[..frac.len().min(3)]).parse().ok()?;
    let (y2, m2) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * m2 + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400) + hh * 3600 + mm * 60 + ss) * 1000 + frac_ms)
}

/// The stable digest of a request body, for idempotency checks.
pub fn request_hash<T: serde::Serialize>(body: &T) -> String {
    let json = serde_json::to_vec(body).unwrap_or_default();
    hex::encode(Sha256::digest(&json))
}

pub fn template(name: Option<&str>) -> Result<Template> {
    match name.unwrap_or("base") {
        "base" => Ok(BASE),
        other => Err(ControlError::UnknownTemplate(other.to_owned())),
    }
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
pub fn view(r: &SandboxRecord) -> Sandbox {
    Sandbox {
        id: r.id.clone(),
        template: r.template.clone(),
        state: SandboxState::parse(&r.state).unwrap_or(SandboxState::Terminated),
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
    }
}

fn encode_cursor(r: &SandboxRecord) -> String {
    format!("{}.{}", r.created_at, r.id)
}

fn decode_cursor(c: &str) -> Result<(i64, String)> {
    let bad = || ControlError::Invalid("invalid cursor".into());
    let (ts, id) = c.split_once('.').ok_or_else(bad)?;
    let ts: i64 = ts.parse().map_err(|_| bad())?;
    hutch_runtime::container::valid_id(id).map_err(|_| bad())?;
    Ok((ts, id.to_owned()))
}

impl Control {
    pub fn new(store: Arc<dyn Store>, runtime: Arc<Runtime>) -> Arc<Control> {
        Control::with_network(store, runtime, Err("networking is not set up".into()))
    }

    pub fn with_network(
        store: Arc<dyn Store>,
        runtime: Arc<Runtime>,
        network: std::result::Result<Arc<Network>, String>,
    ) -> Arc<Control> {
        Arc::new(Control {
            store,
            runtime,
            metrics: Arc::new(Metrics::default()),
            live: Mutex::new(HashMap::new()),
            shutting_down: AtomicBool::new(false),
            pool: crate::pool::PoolState::default(),
            network,
            access: crate::access::Grants::default(),
            builds: crate::build::Builds::default(),
        })
    }

    /// Checks a network request against what the host can do.
    pub fn network_record(&self, req: Option<&hutch_api::NetworkRequest>) -> Result<NetRecord> {
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

    fn live_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Live>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.live_map().get(id).cloned()
    }

    /// The stored record of a sandbox the caller may see (an unclaimed warm
    /// sandbox is nobody's yet).
    pub fn record(&self, owner: &str, id: &str) -> Result<SandboxRecord> {
        match self.store.get_sandbox(id)? {
            Some(r) if r.owner == owner && !r.pooled => Ok(r),
            _ => Err(ControlError::NoSandbox(id.to_owned())),
        }
    }

    /// Runs a template's startup command in a booting sandbox and waits for
    /// its readiness check; on failure the sandbox is destroyed with the
    /// reason as its `last_error_code`.
    async fn until_ready(
        self: &Arc<Self>,
        record: &SandboxRecord,
        live: &Arc<Live>,
        recipe: &crate::templates::Recipe,
        workdir: Option<String>,
    ) -> Result<()> {
        let timeout = recipe
            .readiness
            .as_ref()
            .and_then(|r| r.timeout_seconds)
            .unwrap_or(crate::templates::READINESS_TIMEOUT)
            .min(crate::templates::READINESS_TIMEOUT_MAX);
        let check = crate::ready::ReadyCheck {
            startup: recipe.startup.as_ref(),
            readiness: recipe.readiness.as_ref(),
            cwd: workdir,
            timeout: Duration::from_secs(u64::from(timeout)),
            grace: Duration::ZERO,
        };
        let store = self.store.clone();
        let id = record.id.clone();
        let wanted = move || store.get_sandbox(&id).ok().flatten().is_some_and(|r| r.state == "starting");
        let Err(failed) = crate::ready::until_ready(&live.socket, &check, |_| {}, wanted).await else {
            return Ok(());
        };
        tracing::warn!("sandbox {} did not become ready: {}", record.id, failed.message());
        self.live_map().insert(record.id.clone(), live.clone());
        // Gone: deleted or drained meanwhile; that reason stands.
        let reason = match failed {
            crate::ready::NotReady::Gone(_) => None,
            _ => Some(failed.code()),
        };
        let _ = self.destroy_now(&record.id, reason).await;
        // A drain may have finished the record meanwhile through the
        // reconciler, which could not reach our handle: what we started
        // (PID 1, its uid range) is ours to end.
        self.live_map().remove(&record.id);
        if let Some(sb) = live.handle.lock().ok().and_then(|mut h| h.take()) {
            let rt = self.runtime.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let destroyed = sb.destroy();
                rt.sweep();
                destroyed
            })
            .await;
        }
        Err(match failed {
            crate::ready::NotReady::StartupFailed(m) => ControlError::StartupFailed(m),
            crate::ready::NotReady::Timeout(m) => ControlError::ReadinessTimeout(m),
            crate::ready::NotReady::Gone(m) => ControlError::StartFailed(m),
        })
    }

    /// Creates a sandbox and waits for it to run (up to `wait_seconds`).
    /// Returns the sandbox and whether it was created now (false: replayed
    /// for its Idempotency-Key).
    pub async fn create(
        self: &Arc<Self>,
        owner: &str,
        req: &CreateSandbox,
        key: Option<&str>,
    ) -> Result<(Sandbox, bool)> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ControlError::ShuttingDown);
        }
        // Everything is checked before anything is reserved.
        let tpl = self.recipe(owner, req.template.as_deref())?;
        // The template's limits, field by field unless the request overrides.
        let asked = req.limits.clone().unwrap_or_default();
        let limits = LimitsRequest {
            vcpus: asked.vcpus.or(Some(tpl.vcpus)),
            disk_mib: asked.disk_mib.or(Some(tpl.disk_mib)),
            pids: asked.pids.or(Some(tpl.pids)),
        };
        let (memory, vcpus, disk, pids) = resolve_limits(req.memory_mb.or(Some(tpl.memory_mb)), Some(&limits))?;
        check_map("env", &req.env, 256)?;
        check_map("metadata", &req.metadata, 64)?;
        let mut env = tpl.env.clone();
        env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        check_map("env", &env, 256)?;
        let ttl = match req.ttl_seconds {
            Some(0) => return Err(ControlError::Invalid("ttl_seconds must be at least 1".into())),
            Some(s) => Duration::from_secs(s),
            None => tpl.default_ttl,
        };
        if ttl > tpl.max_ttl {
            return Err(ControlError::Invalid(format!(
                "ttl_seconds above the template's maximum of {}",
                tpl.max_ttl.as_secs()
            )));
        }
        let wait = Duration::from_secs(req.wait_seconds.unwrap_or(10).min(60));
        // The template's policy unless the request sets one.
        let net = self.network_record(Some(req.network.as_ref().unwrap_or(&tpl.network)))?;
        let hash = request_hash(req);
        if let Some(key) = key {
            if let Some(existing) = self.store.sandbox_by_key(owner, key)? {
                if existing.request_hash.as_deref() != Some(hash.as_str()) {
                    return Err(ControlError::IdempotencyConflict);
                }
                return Ok((view(&existing), false));
            }
        }
        let metadata = serde_json::to_string(&req.metadata).unwrap_or_else(|_| "{}".into());
        // A warm sandbox runs exactly the template: claim one only when the
        // request changes nothing that would need a restart (metadata and
        // lifetime are record fields).
        let net_as_template = req.network.as_ref().is_none_or(|n| *n == tpl.network);
        if req.env.is_empty() && (memory, vcpus, disk, pids) == tpl.limits() && net_as_template {
            match self.claim_warm(owner, &tpl, ttl, &metadata, key, &hash) {
                Ok(Some(r)) => return Ok((view(&r), true)),
                Ok(None) => {}
                Err(StoreError::Conflict) => {
                    let existing = self
                        .store
                        .sandbox_by_key(owner, key.unwrap_or_default())?
                        .ok_or(ControlError::OutcomeUnknown)?;
                    return Ok((view(&existing), false));
                }
                Err(e) => return Err(e.into()),
            }
        }
        let id = hutch_runtime::container::random_id().map_err(|e| ControlError::Runtime(e.to_string()))?;
        let now = now_ms();
        let record = SandboxRecord {
            id: id.clone(),
            owner: owner.to_owned(),
            template: tpl.name.clone(),
            state: "starting".into(),
            created_at: now,
            expires_at: now + ttl.as_millis() as i64,
            max_expires_at: now + tpl.max_ttl.as_millis() as i64,
            memory_mb: memory,
            vcpus,
            disk_mib: disk,
            pids,
            env: serde_json::to_string(&env).unwrap_or_else(|_| "{}".into()),
            metadata,
            limits_applied: "unknown".into(),
            last_error_code: None,
            host_pid: None,
            idempotency_key: key.map(str::to_owned),
            request_hash: Some(hash),
            template_id: tpl.id.clone(),
            template_version: tpl.version,
            warm: false,
            pooled: false,
            network: net.to_json(),
        };
        match self.store.insert_sandbox(&record) {
            Ok(()) => {}
            Err(StoreError::Conflict) => {
                // A concurrent create with the same key won the race.
                let existing =
                    self.store.sandbox_by_key(owner, key.unwrap_or_default())?.ok_or(ControlError::OutcomeUnknown)?;
                return Ok((view(&existing), false));
            }
            Err(e) => return Err(e.into()),
        }
        let this = self.clone();
        let started = tokio::spawn(async move { this.boot(record, &tpl).await });
        match tokio::time::timeout(wait, started).await {
            Ok(Ok(Ok(r))) => Ok((view(&r), true)),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(ControlError::Runtime("sandbox start task failed".into())),
            // Still starting: the caller polls.
            Err(_) => {
                Ok((view(&self.store.get_sandbox(&id)?.ok_or_else(|| ControlError::NoSandbox(id.clone()))?), true))
            }
        }
    }

    /// The host's image store.
    pub fn images(&self) -> Result<ImageStore> {
        ImageStore::open(&self.runtime.config().state_dir).map_err(|e| ControlError::Runtime(e.to_string()))
    }

    /// Starts the runtime sandbox of a `starting` record, then its
    /// template's startup command, and waits until it is ready.
    pub(crate) async fn boot(
        self: Arc<Self>,
        mut record: SandboxRecord,
        recipe: &crate::templates::Recipe,
    ) -> Result<SandboxRecord> {
        let t0 = Instant::now();
        // A preset is built on its first use: on the blocking pool.
        let (state, name) = (self.runtime.config().state_dir.clone(), recipe.image.clone());
        let resolved = match tokio::task::spawn_blocking(move || crate::build::image_root(&state, &name)).await {
            Ok(r) => r,
            Err(join) => Err(ControlError::Runtime(format!("image task: {join}"))),
        };
        let crate::build::ImageRoot { root, layers: extra_lowers, env: image_env, workdir } = match resolved {
            Ok(r) => r,
            Err(e) => {
                record.state = "terminated".into();
                record.last_error_code = Some(e.code().as_str().into());
                self.store.update_sandbox(&record)?;
                tracing::warn!("sandbox {} failed to start: {e}", record.id);
                return Err(e);
            }
        };
        // The image's environment, under the template's and the request's.
        let mut env: BTreeMap<String, String> = image_env.into_iter().collect();
        env.extend(serde_json::from_str::<BTreeMap<String, String>>(&record.env).unwrap_or_default());
        let spec = SandboxSpec {
            root,
            id: Some(record.id.clone()),
            limits: CgLimits {
                memory_bytes: record.memory_mb << 20,
                pids: record.pids,
                cpu_millis: (record.vcpus * 1000.0).round() as u32,
            },
            disk_bytes: record.disk_mib << 20,
            env: env.into_iter().collect(),
            die_with_parent: false,
            agent_override: None,
            netns: None,
            resolv_conf: None,
            extra_lowers,
            upper_dir: None,
        };
        let rt = self.runtime.clone();
        let mut net = NetRecord::parse(&record.network);
        let policy = net.policy(&record.owner, record.template_id.as_deref().unwrap_or(&record.template));
        let network = self.network.clone();
        let id = record.id.clone();
        let result = tokio::task::spawn_blocking(move || start_with_network(&rt, spec, network, &id, &policy)).await;
        let result = result.map(|r| {
            r.map(|(sb, attached, applied)| {
                if let Some(a) = &attached {
                    net.attached(a);
                }
                net.applied = applied;
                record.network = net.to_json();
                sb
            })
        });
        match result {
            Ok(Ok(sb)) => {
                record.host_pid = Some(sb.pid as i64);
                record.limits_applied = "enforced".into();
                let live = Live::new(sb);
                if recipe.startup.is_some() || recipe.readiness.is_some() {
                    self.until_ready(&record, &live, recipe, workdir).await?;
                }
                // A delete may have come while we started: honour it.
                let current = self.store.get_sandbox(&record.id)?;
                if current.as_ref().map(|r| r.state.as_str()) != Some("starting") {
                    self.live_map().insert(record.id.clone(), live);
                    let r = current.ok_or_else(|| ControlError::NoSandbox(record.id.clone()))?;
                    self.destroy_now(&r.id, None).await?;
                    return Err(ControlError::StartFailed("deleted while starting".into()));
                }
                record.state = "running".into();
                self.store.update_sandbox(&record)?;
                self.live_map().insert(record.id.clone(), live);
                self.metrics.create_to_ready.observe(t0.elapsed().as_secs_f64());
                Ok(record)
            }
            Ok(Err(BootError::Runtime(e))) => {
                let reason = e.to_string();
                record.state = "terminated".into();
                record.last_error_code = Some(start_failure_code(&e).into());
                self.store.update_sandbox(&record)?;
                tracing::warn!("sandbox {} failed to start: {reason}", record.id);
                match &e {
                    hutch_runtime::RuntimeError::Uids(_) => Err(ControlError::NoCapacity(reason)),
                    _ => Err(ControlError::StartFailed(start_failure_code(&e).into())),
                }
            }
            Ok(Err(BootError::Network(code, reason))) => {
                record.state = "terminated".into();
                record.last_error_code = Some(code.into());
                self.store.update_sandbox(&record)?;
                tracing::warn!("sandbox {}: network policy not enforceable, not started: {reason}", record.id);
                Err(ControlError::StartFailed(code.into()))
            }
            Err(join) => Err(ControlError::Runtime(format!("start task: {join}"))),
        }
    }

    pub fn get(&self, owner: &str, id: &str) -> Result<Sandbox> {
        Ok(view(&self.record(owner, id)?))
    }

    pub fn list(&self, owner: &str, limit: Option<u32>, cursor: Option<&str>) -> Result<SandboxList> {
        let limit = limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(ControlError::Invalid("limit must be 1 to 1000".into()));
        }
        let after = cursor.map(decode_cursor).transpose()?;
        let rows = self.store.list_sandboxes(Some(owner), after.as_ref().map(|(t, i)| (*t, i.as_str())), limit + 1)?;
        let more = rows.len() > limit as usize;
        let rows = &rows[..rows.len().min(limit as usize)];
        Ok(SandboxList {
            sandboxes: rows.iter().map(view).collect(),
            next_cursor: if more { rows.last().map(encode_cursor) } else { None },
        })
    }

    /// Deletes a sandbox; idempotent: a terminated one answers as it is.
    pub async fn delete(self: &Arc<Self>, owner: &str, id: &str) -> Result<Sandbox> {
        let r = self.record(owner, id)?;
        if r.state == "terminated" {
            return Ok(view(&r));
        }
        self.destroy_now(id, None).await?;
        Ok(view(&self.record(owner, id)?))
    }

    /// Marks a sandbox terminating, destroys it, marks it terminated.
    pub async fn destroy_now(self: &Arc<Self>, id: &str, reason: Option<&str>) -> Result<()> {
        let Some(mut r) = self.store.get_sandbox(id)? else { return Ok(()) };
        if r.state == "terminated" {
            return Ok(());
        }
        if r.state == "starting" && self.live(id).is_none() {
            // The boot will see this and tear down what it made.
            r.state = "terminating".into();
            self.store.update_sandbox(&r)?;
            return Ok(());
        }
        r.state = "terminating".into();
        if let Some(reason) = reason {
            r.last_error_code = Some(reason.to_owned());
        }
        self.store.update_sandbox(&r)?;
        self.access.revoke_sandbox(id);
        let live = self.live_map().remove(id);
        let handle = match live.as_ref().and_then(|l| l.handle.lock().ok().and_then(|mut h| h.take())) {
            Some(h) => h,
            None => self.runtime.adopt(id),
        };
        let rt = self.runtime.clone();
        let destroyed = tokio::task::spawn_blocking(move || {
            let result = handle.destroy();
            rt.sweep();
            result
        })
        .await
        .map_err(|e| ControlError::Runtime(format!("destroy task: {e}")))?;
        if let Err(e) = destroyed {
            // Stays `terminating`: the reconciler tries again.
            tracing::warn!("sandbox {id}: teardown failed, will retry: {e}");
            return Err(ControlError::Runtime(e.to_string()));
        }
        if let Ok(net) = &self.network {
            let (net, id) = (net.clone(), id.to_owned());
            let _ = tokio::task::spawn_blocking(move || net.release(&id)).await;
        }
        r.state = "terminated".into();
        self.store.update_sandbox(&r)?;
        Ok(())
    }

    pub fn extend(&self, owner: &str, id: &str, req: &Extend) -> Result<Sandbox> {
        let mut r = self.record(owner, id)?;
        if !matches!(r.state.as_str(), "running" | "suspended" | "starting") {
            return Err(ControlError::NotRunning { id: id.to_owned(), state: static_state(&r.state) });
        }
        let target = match (req.by, req.until.as_deref()) {
            (Some(by), None) => r.expires_at.saturating_add((by.min(10 * 365 * 86_400) * 1000) as i64),
            (None, Some(until)) => {
                parse_rfc3339(until).ok_or_else(|| ControlError::Invalid("until must be RFC 3339 in UTC".into()))?
            }
            _ => return Err(ControlError::Invalid("give exactly one of by and until".into())),
        };
        if target <= now_ms() {
            return Err(ControlError::Invalid("the new expiry is in the past".into()));
        }
        // Capped by the template's maximum lifetime.
        r.expires_at = target.min(r.max_expires_at);
        self.store.update_sandbox(&r)?;
        Ok(view(&r))
    }

    pub async fn suspend(&self, owner: &str, id: &str) -> Result<Sandbox> {
        self.freeze(owner, id, true).await
    }

    pub async fn resume(&self, owner: &str, id: &str) -> Result<Sandbox> {
        self.freeze(owner, id, false).await
    }

    async fn freeze(&self, owner: &str, id: &str, frozen: bool) -> Result<Sandbox> {
        let mut r = self.record(owner, id)?;
        let (from, to) = if frozen { ("running", "suspended") } else { ("suspended", "running") };
        if r.state == to {
            return Ok(view(&r));
        }
        if r.state != from {
            return Err(ControlError::NotRunning { id: id.to_owned(), state: static_state(&r.state) });
        }
        let live = self.live(id).ok_or_else(|| ControlError::NoSandbox(id.to_owned()))?;
        let l2 = live.clone();
        let res = tokio::task::spawn_blocking(move || {
            let guard = l2.handle.lock().map_err(|_| "lock poisoned".to_owned())?;
            let sb = guard.as_ref().ok_or_else(|| "sandbox is being deleted".to_owned())?;
            if frozen { sb.freeze() } else { sb.thaw() }.map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| ControlError::Runtime(e.to_string()))?;
        res.map_err(ControlError::Runtime)?;
        live.suspended.store(frozen, Ordering::SeqCst);
        if frozen {
            // Open proxied connections end with the grants.
            self.access.revoke_sandbox(id);
        }
        r.state = to.into();
        // Not observed since the change: a resume looks again.
        let mut net = NetRecord::parse(&r.network);
        net.applied = match (&self.network, frozen, r.host_pid) {
            (Ok(n), false, Some(pid)) => crate::network::applied(n.observe(id, pid as libc::pid_t)),
            _ => "unknown".into(),
        };
        r.network = net.to_json();
        self.store.update_sandbox(&r)?;
        Ok(view(&r))
    }

    /// The live sandbox for a command, or why not.
    pub fn running(&self, owner: &str, id: &str) -> Result<Arc<Live>> {
        self.running_record(&self.record(owner, id)?)
    }

    /// The live sandbox of a record the caller already read.
    pub fn running_record(&self, r: &SandboxRecord) -> Result<Arc<Live>> {
        let id = r.id.as_str();
        if r.state != "running" {
            return Err(ControlError::NotRunning { id: id.to_owned(), state: static_state(&r.state) });
        }
        let live = self.live(id).ok_or_else(|| ControlError::NotRunning { id: id.to_owned(), state: "starting" })?;
        if live.suspended.load(Ordering::SeqCst) {
            return Err(ControlError::NotRunning { id: id.to_owned(), state: "suspended" });
        }
        Ok(live)
    }

    /// File access to a running sandbox, as its user. A terminated sandbox is
    /// not found; one that is starting or suspended is not running.
    pub fn fs(&self, owner: &str, id: &str) -> Result<crate::files::SandboxFs> {
        let r = self.record(owner, id)?;
        if r.state == "terminated" {
            return Err(ControlError::NoSandbox(id.to_owned()));
        }
        let live = self.running_record(&r)?;
        Ok(crate::files::SandboxFs::new(live.socket.clone(), None))
    }

    /// A running sandbox's resource use now, with when it started.
    pub fn usage(&self, owner: &str, id: &str) -> Result<(hutch_runtime::container::Usage, SandboxRecord)> {
        let r = self.record(owner, id)?;
        let live = self
            .live(id)
            .ok_or_else(|| ControlError::NotRunning { id: id.to_owned(), state: static_state(&r.state) })?;
        let guard = live.handle.lock().map_err(|_| ControlError::Runtime("sandbox lock poisoned".into()))?;
        let sb = guard.as_ref().ok_or_else(|| ControlError::NotRunning { id: id.to_owned(), state: "terminating" })?;
        Ok((sb.usage(), r))
    }

    /// Commands running in every running sandbox, as their agents count them
    /// (background ones included). Suspended sandboxes are skipped: a frozen
    /// agent cannot answer.
    pub async fn commands_running(&self) -> u64 {
        let lives: Vec<Arc<Live>> = self.live_map().values().cloned().collect();
        let mut total = 0u64;
        for live in lives {
            if live.suspended.load(Ordering::SeqCst) {
                continue;
            }
            let count = async {
                let mut conn = live.conn().await.ok()?;
                let n = match conn.call(hutch_agent::proto::Request::List, &[]).await.ok()? {
                    (hutch_agent::proto::Reply::Processes { processes }, _) => processes.len() as u64,
                    _ => 0,
                };
                live.reuse(conn);
                Some(n)
            };
            total += tokio::time::timeout(Duration::from_millis(200), count).await.ok().flatten().unwrap_or(0);
        }
        total
    }

    /// After a restart: takes charge of sandboxes that outlived the last
    /// daemon, finishes interrupted deletions, cleans up interrupted creates.
    pub async fn recover(self: &Arc<Self>) -> Result<()> {
        self.recover_builds()?;
        let lost = self.store.mark_running_execs_lost()?;
        if lost > 0 {
            tracing::info!("{lost} commands were running when the daemon stopped; their outcome is unknown");
        }
        for r in self.store.sandboxes_in(&["starting", "running", "suspended", "terminating"])? {
            let handle = self.runtime.adopt(&r.id);
            let alive = adoptable(&r.id, &handle);
            match (r.state.as_str(), alive) {
                ("running" | "suspended", true) => {
                    let pid = r.host_pid.map(|p| p as libc::pid_t).unwrap_or(handle.pid);
                    if let Err(e) = self.adopt_network(&r, pid) {
                        tracing::warn!("sandbox {}: its network cannot be taken back ({e}); ending it", r.id);
                        self.live_map().insert(r.id.clone(), Live::new(handle));
                        let _ = self.destroy_now(&r.id, Some("sandbox_network_unavailable")).await;
                        continue;
                    }
                    let live = Live::new(handle);
                    live.suspended.store(r.state == "suspended", Ordering::SeqCst);
                    self.live_map().insert(r.id.clone(), live);
                    tracing::info!("adopted sandbox {}", r.id);
                }
                (state, _) => {
                    let reason = if state == "terminating" { None } else { Some("sandbox_lost_on_restart") };
                    self.live_map().insert(r.id.clone(), Live::new(handle));
                    let mut rr = r.clone();
                    if state == "starting" {
                        rr.state = "running".into();
                        self.store.update_sandbox(&rr)?;
                    }
                    let _ = self.destroy_now(&r.id, reason).await;
                }
            }
        }
        // Anything on the host with no record (a create interrupted before
        // its row was written cannot happen; rows come first) is swept.
        let rt = self.runtime.clone();
        let _ = tokio::task::spawn_blocking(move || rt.sweep()).await;
        Ok(())
    }

    fn adopt_network(&self, r: &SandboxRecord, pid: libc::pid_t) -> std::result::Result<(), String> {
        let net = NetRecord::parse(&r.network);
        let policy = net.policy(&r.owner, r.template_id.as_deref().unwrap_or(&r.template));
        match (&self.network, net.host_if.as_deref()) {
            (Ok(n), Some(host_if)) => {
                let learned: Vec<std::net::IpAddr> =
                    serde_json::from_str(&self.store.net_learned(&r.id).map_err(|e| e.to_string())?)
                        .unwrap_or_default();
                n.adopt(&r.id, pid, net.index, host_if, &policy, &learned).map_err(|e| e.to_string())
            }
            // No host link: its namespace holds only `lo` (deny_all, or a
            // sandbox started before networking), whatever it asked.
            (Ok(n), None) => {
                let lo_only = hutch_runtime::net::Policy { egress: hutch_runtime::net::Egress::DenyAll, ..policy };
                n.attach(&r.id, &lo_only).map(|_| ()).map_err(|e| e.to_string())
            }
            // Without networking only namespaces with `lo` exist.
            (Err(_), _) => Ok(()),
        }
    }

    /// One pass of the reconciler: expire sandboxes, retry deletions, notice
    /// sandboxes whose PID 1 died.
    pub async fn reconcile(self: &Arc<Self>) -> Result<()> {
        let now = now_ms();
        let mut lag = 0.0f64;
        let (mut unknown, mut first_unknown) = (0usize, None);
        for r in self.store.sandboxes_in(&["running", "suspended", "terminating"])? {
            if r.state == "terminating" {
                let _ = self.destroy_now(&r.id, None).await;
                continue;
            }
            if r.expires_at <= now {
                // A warm sandbox is taken from its pool first, so that no
                // claim gets it while it is destroyed.
                if r.pooled && !self.store.drain_pooled(&r.id)? {
                    continue;
                }
                lag = lag.max((now - r.expires_at) as f64 / 1000.0);
                let _ = self.destroy_now(&r.id, Some("sandbox_expired")).await;
                continue;
            }
            if let Some(live) = self.live(&r.id) {
                // Only a positive observation of death ends a sandbox; a
                // check that failed (out of descriptors) is no verdict.
                let seen = live.handle.lock().ok().and_then(|h| h.as_ref().map(|sb| sb.liveness()));
                match seen {
                    Some(Liveness::Dead) => {
                        if !r.pooled || self.store.drain_pooled(&r.id)? {
                            let _ = self.destroy_now(&r.id, Some("sandbox_agent_exited")).await;
                        }
                    }
                    Some(Liveness::Unknown(e)) => {
                        unknown += 1;
                        first_unknown.get_or_insert_with(|| format!("sandbox {}: {e}", r.id));
                    }
                    Some(Liveness::Alive) | None => {}
                }
            }
        }
        if let Some(first) = first_unknown {
            tracing::warn!("cannot tell whether {unknown} sandboxes are alive ({first}); they are left running");
        }
        self.metrics.set_reconciler_lag(lag);
        if !self.is_shutting_down() {
            if let Err(e) = self.tend_pools().await {
                tracing::warn!("warm pools: {e}; retrying next tick");
            }
        }
        Ok(())
    }
}

/// Whether a sandbox found at start-up can be adopted: its processes are not
/// known to be gone and its agent's socket is not known to be dead. A check
/// that fails (EMFILE, ENOMEM) is no verdict: the sandbox is adopted and the
/// reconciler looks again.
fn adoptable(id: &str, handle: &hutch_runtime::container::Sandbox) -> bool {
    if let Liveness::Dead = handle.liveness() {
        return false;
    }
    match hutch_runtime::agent::AgentConn::connect(&handle.socket) {
        Ok(_) => true,
        Err(hutch_runtime::agent::AgentError::Io(e))
            if !matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT | libc::ENOTSOCK)) =>
        {
            tracing::warn!("sandbox {id}: cannot reach its agent ({e}); adopting it and checking again later");
            true
        }
        Err(_) => false,
    }
}

/// The layers and environment of store image or preset `name`; a preset is
/// built on its first use, which takes a while: call it on the blocking pool.
pub(crate) fn store_image_root(state_dir: &std::path::Path, name: &str) -> Result<(RootSource, Vec<(String, String)>)> {
    let store = ImageStore::open(state_dir).map_err(|e| ControlError::Runtime(e.to_string()))?;
    let found = if hutch_runtime::image::debian::is_preset(name) {
        hutch_runtime::image::ensure_preset(&store, name, &|line| tracing::info!("image {name}: {line}"))
    } else {
        store.get(name)
    };
    let img = found.map_err(|e| match e {
        ImageError::NotFound(n) => ControlError::NoImage(n),
        e => ControlError::StartFailed(format!("{}: {e}", e.code())),
    })?;
    let dirs = store.layer_dirs(&img).map_err(|e| ControlError::StartFailed(format!("{}: {e}", e.code())))?;
    Ok((RootSource::Layers(dirs), img.env_pairs()))
}

enum BootError {
    Runtime(hutch_runtime::RuntimeError),
    /// A policy that cannot be enforced: the code and why.
    Network(&'static str, String),
}

type Booted = (hutch_runtime::Sandbox, Option<Attached>, String);

/// Attaches the sandbox's network, starts it inside, and reads back what
/// the host enforces. Anything short of the asked policy ends the sandbox.
fn start_with_network(
    rt: &Runtime,
    mut spec: SandboxSpec,
    network: std::result::Result<Arc<Network>, String>,
    id: &str,
    policy: &hutch_runtime::net::Policy,
) -> std::result::Result<Booted, BootError> {
    use hutch_runtime::net::Egress;
    let net = match network {
        Ok(n) => n,
        Err(why) if policy.egress != Egress::DenyAll => {
            return Err(BootError::Network("sandbox_network_unavailable", why))
        }
        Err(_) => {
            // No networking on this host: the sandbox's own namespace with
            // only `lo` is exactly deny_all; observe it all the same.
            let sb = rt.start(&spec).map_err(BootError::Runtime)?;
            return Ok((sb, None, "deny_all".into()));
        }
    };
    let attached =
        net.attach(id, policy).map_err(|e| BootError::Network("sandbox_network_unavailable", e.to_string()))?;
    spec.netns = attached.netns.clone();
    if spec.netns.is_some() {
        spec.resolv_conf = Some(net.resolv_conf().to_path_buf());
    }
    let sb = match rt.start(&spec) {
        Ok(sb) => sb,
        Err(e) => {
            net.release(id);
            return Err(BootError::Runtime(e));
        }
    };
    let seen = net.observe(id, sb.pid);
    if seen != Some(policy.egress) {
        let _ = sb.destroy();
        net.release(id);
        let code =
            if policy.egress == Egress::DenyAll { "sandbox_network_untrusted" } else { "sandbox_network_unavailable" };
        return Err(BootError::Network(code, format!("asked {:?}, observed {seen:?}", policy.egress)));
    }
    Ok((sb, Some(attached), crate::network::applied(seen)))
}

fn start_failure_code(e: &hutch_runtime::RuntimeError) -> &'static str {
    match e {
        hutch_runtime::RuntimeError::Uids(_) => "sandbox_capacity_unavailable",
        hutch_runtime::RuntimeError::Cgroup(_) => "sandbox_cgroup_failed",
        hutch_runtime::RuntimeError::Setup(_) => "sandbox_setup_failed",
        hutch_runtime::RuntimeError::Agent(_) => "sandbox_agent_failed",
        _ => "sandbox_start_rejected",
    }
}

fn static_state(s: &str) -> &'static str {
    SandboxState::parse(s).map(SandboxState::as_str).unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        for ms in [0i64, 1_700_000_000_123, 951_782_400_000, 4_102_444_799_999] {
            assert_eq!(parse_rfc3339(&rfc3339(ms)), Some(ms), "{}", rfc3339(ms));
        }
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(parse_rfc3339("2026-11-30T12:00:00Z"), parse_rfc3339("2026-11-30T12:00:00.000+00:00"));
        assert_eq!(parse_rfc3339("yesterday"), None);
        assert_eq!(parse_rfc3339("2026-13-01T00:00:00Z"), None);
    }

    #[test]
    fn limits_are_bounded() {
        assert!(resolve_limits(Some(32), None).is_err());
        assert!(resolve_limits(None, Some(&LimitsRequest { vcpus: Some(f64::NAN), ..Default::default() })).is_err());
        assert!(resolve_limits(None, Some(&LimitsRequest { pids: Some(1), ..Default::default() })).is_err());
        assert_eq!(resolve_limits(None, None).expect("defaults"), (1024, 1.0, 1024, 512));
    }

    #[test]
    fn unknown_templates_are_refused() {
        assert!(matches!(template(Some("nope")), Err(ControlError::UnknownTemplate(_))));
        assert_eq!(template(None).expect("base").name, "base");
    }
}
