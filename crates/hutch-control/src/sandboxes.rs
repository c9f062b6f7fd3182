//! Sandboxes and their lifetimes: create (idempotent, admitted against the
//! owner's quotas and the host's capacity), read, list, extend, suspend,
//! resume and delete. Every change of state is a [`Transition`]. Runtime
//! calls block for a few milliseconds, so they run on tokio's blocking pool.

use crate::control::{check_map, now_ms, parse_rfc3339, request_hash, resolve_limits, view, Control, Need, Set};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, SandboxId};
use crate::lifecycle::{Live, Reason, Transition};
use crate::network::NetRecord;
use hutch_api::{CreateSandbox, Extend, LimitsRequest, Sandbox, SandboxList, SandboxState, StorageKind};
use hutch_runtime::cgroup::Limits as CgLimits;
use hutch_runtime::image::{ImageError, ImageStore};
use hutch_runtime::net::{Attached, Network};
use hutch_runtime::{RootSource, Runtime, SandboxSpec};
use hutch_store::{Admission, Admitted, Exceeded, Quotas, Resource, SandboxRecord, Scope, StoreError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a create waits for its sandbox to run before answering.
const WAIT_MAX: u64 = 60;

/// How long a sandbox paused at its expiry is kept when nothing says:
/// 7 days. At most 30 days.
pub const PAUSED_TTL_DEFAULT: u64 = 7 * 86_400;
pub const PAUSED_TTL_MAX: u64 = 30 * 86_400;

/// Checks a `paused_ttl_seconds`.
pub(crate) fn check_paused_ttl(secs: u64) -> Result<u64> {
    if !(1..=PAUSED_TTL_MAX).contains(&secs) {
        return Err(ControlError::Invalid(format!("paused_ttl_seconds must be 1 to {PAUSED_TTL_MAX}")));
    }
    Ok(secs)
}

/// What a sandbox does at its expiry (as its record keeps it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lifecycle {
    pub on_expire: hutch_api::OnExpire,
    /// The lifetime it is given: what a resume after a pause at its
    /// expiry gives it again.
    pub ttl: Duration,
    pub paused_ttl_s: Option<u64>,
}

impl Lifecycle {
    /// The lifetime as the record keeps it.
    pub fn ttl_s(&self) -> Option<u64> {
        Some(self.ttl.as_secs())
    }
}

/// What a create adds to its request beyond the native API's fields (the
/// E2B API's settings).
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// Keep a network interface under `deny_all`, so that the policy can
    /// open while the sandbox runs.
    pub interface: bool,
    /// E2B settings kept with the sandbox.
    pub e2b: Option<crate::network::E2bNetwork>,
}

fn encode_cursor(r: &SandboxRecord) -> String {
    format!("{}.{}", r.created_at, r.id)
}

fn decode_cursor(c: &str) -> Result<(i64, String)> {
    let bad = || ControlError::Invalid("invalid cursor".into());
    let (ts, id) = c.split_once('.').ok_or_else(bad)?;
    let ts: i64 = ts.parse().map_err(|_| bad())?;
    SandboxId::parse(id).map_err(|_| bad())?;
    Ok((ts, id.to_owned()))
}

/// A refusal of one sandbox's size by the host, whatever else runs.
fn too_big(resource: Resource, limit: u64, asked: u64) -> ControlError {
    ControlError::Exceeded(Exceeded { scope: Scope::Host, resource, limit, used: 0, asked })
}

impl Control {
    /// The caller's quotas: as its authentication read them, else from
    /// the store ([`Control::quotas_of`]).
    pub(crate) async fn caller_quotas(&self, caller: &Caller) -> Result<Quotas> {
        match caller.quotas {
            Some(q) => Ok(q),
            None => self.quotas_of(&caller.owner).await,
        }
    }

    /// The quotas of a live key; a revoked or unknown one is refused.
    pub(crate) async fn quotas_of(&self, owner: &OwnerId) -> Result<Quotas> {
        let id = owner.as_str().to_owned();
        match self.db(move |s| s.get_key(&id)).await? {
            Some(k) if k.revoked_at.is_none() => Ok(k.quotas),
            _ => Err(ControlError::Unauthorized("the API key was revoked")),
        }
    }

    /// Checks a lifetime against the key's quota.
    fn check_ttl(quotas: &Quotas, ttl: Duration) -> Result<()> {
        match quotas.ttl_seconds {
            Some(max) if ttl.as_secs() > max => Err(ControlError::Exceeded(Exceeded {
                scope: Scope::Owner,
                resource: Resource::TtlSeconds,
                limit: max,
                used: 0,
                asked: ttl.as_secs(),
            })),
            _ => Ok(()),
        }
    }

    /// What a new sandbox must fit under.
    pub(crate) fn admission(&self, quotas: Quotas, memory_mb: u64, disk_mib: u64) -> Result<Admission> {
        if memory_mb > self.capacity.sandbox_memory_mb {
            return Err(too_big(Resource::MemoryMb, self.capacity.sandbox_memory_mb, memory_mb));
        }
        if disk_mib > self.capacity.sandbox_disk_mib {
            return Err(too_big(Resource::DiskMib, self.capacity.sandbox_disk_mib, disk_mib));
        }
        Ok(Admission { owner: quotas, host: self.capacity.as_quotas() })
    }

    /// Creates a sandbox and waits for it to run (up to `wait_seconds`).
    /// Returns the sandbox and whether it was created now (false: replayed
    /// for its Idempotency-Key).
    pub async fn create(
        self: &Arc<Self>,
        caller: &Caller,
        req: &CreateSandbox,
        key: Option<&str>,
    ) -> Result<(Sandbox, bool)> {
        self.create_with(caller, req, key, CreateOptions::default()).await
    }

    /// [`Control::create`] with what the E2B API adds to a request.
    pub async fn create_with(
        self: &Arc<Self>,
        caller: &Caller,
        req: &CreateSandbox,
        key: Option<&str>,
        opts: CreateOptions,
    ) -> Result<(Sandbox, bool)> {
        if self.is_shutting_down() {
            return Err(ControlError::ShuttingDown);
        }
        if let Some(node) = &req.node {
            if !caller.admin {
                return Err(ControlError::Forbidden("only an admin key may name the node of a sandbox".into()));
            }
            if *node != self.node.name {
                return Err(ControlError::Invalid(format!(
                    "node {node:?} does not take this create: it is not an active node of the fleet (GET /v1/nodes)"
                )));
            }
        }
        let owner = &caller.owner;
        // Everything is checked before anything is reserved.
        // A template, or a snapshot with the settings of its sandbox.
        let (tpl, origin) = match &req.snapshot {
            Some(_) if req.template.is_some() => {
                return Err(ControlError::Invalid("give a template or a snapshot, not both".into()))
            }
            Some(_) if req.storage == Some(StorageKind::Memory) => {
                return Err(ControlError::Invalid("a sandbox started from a snapshot keeps its files on disk".into()))
            }
            Some(reference) => {
                // A template's create is refused in its insert's transaction.
                self.refuse_if_draining().await?;
                let (snap, recipe) = self.snapshot_recipe(owner, reference).await?;
                // Its files pulled if they are on another node (see `moves`).
                self.snapshot_here(&snap).await?;
                (recipe, Some(snap))
            }
            None => {
                let t0 = Instant::now();
                let recipe = self.recipe(owner, req.template.as_deref()).await?;
                crate::timing::mark("template", t0);
                (recipe, None)
            }
        };
        // The request's, else the template's (a snapshot's recipe has none).
        let idle = crate::idle::IdlePolicy::from_request(
            req.idle_timeout_seconds.or(tpl.idle_timeout_s),
            req.on_idle.or(tpl.on_idle),
        )?;
        let (sb, fresh) = self.create_from(caller, req, key, tpl, origin, &opts).await?;
        let sb = match idle {
            Some(p) if fresh => {
                self.set_idle(&SandboxId::from_record(&sb.id), p).await?;
                self.with_idle(sb)
            }
            _ => self.with_idle(sb),
        };
        if req.volumes.is_empty() {
            return Ok((sb, fresh));
        }
        Ok((self.with_volumes(sb).await?, fresh))
    }

    /// A create whose template (or snapshot) is resolved: `origin` names
    /// the snapshot layer its files start from.
    pub(crate) async fn create_from(
        self: &Arc<Self>,
        caller: &Caller,
        req: &CreateSandbox,
        key: Option<&str>,
        tpl: crate::templates::Recipe,
        origin: Option<String>,
        opts: &CreateOptions,
    ) -> Result<(Sandbox, bool)> {
        let t0 = Instant::now();
        let owner = &caller.owner;
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
        let wait = match req.wait_seconds {
            None => Duration::from_secs(10),
            Some(w) if w <= WAIT_MAX => Duration::from_secs(w),
            Some(_) => return Err(ControlError::Invalid(format!("wait_seconds must be 0 to {WAIT_MAX}"))),
        };
        // The template's policy unless the request sets one.
        let mut net = self.network_record(Some(req.network.as_ref().unwrap_or(&tpl.network)))?;
        net.interface = opts.interface && net.egress == hutch_api::Egress::DenyAll;
        net.e2b = opts.e2b.clone();
        // A copy of a memory image continues without a network, as the
        // sandbox it was taken of (see snapshots::memory_capable).
        if origin.as_deref().is_some_and(|o| self.runtime.has_memory(o))
            && (net.egress != hutch_api::Egress::DenyAll || net.interface)
        {
            return Err(ControlError::ClassUnsupported(
                "a sandbox started from a memory snapshot keeps its `deny_all` egress (gVisor cannot restore onto \
                 the host's network stack)"
                    .into(),
            ));
        }
        // Secrets: the template's and the request's, each the owner's.
        let secret_names = {
            let mut all = tpl.secrets.clone();
            all.extend(req.secrets.iter().cloned());
            self.secret_names(owner, &all).await?
        };
        if !secret_names.is_empty() {
            if self.egress_bundle.is_none() || self.network.is_err() {
                return Err(ControlError::FeatureUnavailable(
                    "secrets need the host's egress proxy, which needs sandbox networking".into(),
                ));
            }
            if net.egress != hutch_api::Egress::Default {
                return Err(ControlError::Invalid("secrets need `default` egress (with or without lists)".into()));
            }
        }
        net.secrets = secret_names.clone();
        let storage = self.sandbox_storage(tpl.class, req.storage.or(tpl.storage))?;
        let on_expire = req.on_expire.or(tpl.on_expire);
        self.check_on_expire(on_expire, Some(storage))?;
        let lifecycle = Lifecycle {
            on_expire: on_expire.unwrap_or_default(),
            ttl,
            paused_ttl_s: req.paused_ttl_seconds.or(tpl.paused_ttl_s).map(check_paused_ttl).transpose()?,
        };
        // Volumes: paths checked and each one the owner's, before anything
        // is reserved (claimed with the record, below).
        let mut claims = self.volume_claims_for(owner, "", &req.volumes).await?;
        let quotas = self.caller_quotas(caller).await?;
        Self::check_ttl(&quotas, ttl).map_err(|e| self.quota_refusal(owner.as_str(), e))?;
        let admission = self.admission(quotas, memory, disk)?;
        let hash = request_hash(req);
        if let Some(key) = key {
            let (o, k) = (owner.as_str().to_owned(), key.to_owned());
            if let Some(existing) = self.db(move |s| s.sandbox_by_key(&o, &k)).await? {
                if existing.request_hash.as_deref() != Some(hash.as_str()) {
                    return Err(ControlError::IdempotencyConflict);
                }
                return Ok((view(&existing), false));
            }
        }
        if tpl.class == hutch_runtime::Class::Process {
            let net_as_template = req.network.as_ref().is_none_or(|n| *n == tpl.network);
            let refusal = if !net_as_template {
                Some("a process sandbox shares its template's network policy: it has no network settings of its own")
            } else if !claims.is_empty() {
                Some("a process sandbox mounts no volumes")
            } else if storage == StorageKind::Disk || origin.is_some() {
                Some("a process sandbox keeps its home in memory: no disk layer, snapshot or fork")
            } else if !secret_names.is_empty() {
                Some("a process sandbox names no secrets (the egress proxy is per sandbox)")
            } else {
                None
            };
            if let Some(why) = refusal {
                return Err(ControlError::ClassUnsupported(why.into()));
            }
        }
        let metadata = serde_json::to_string(&req.metadata).unwrap_or_else(|_| "{}".into());
        // A warm sandbox runs exactly the template: claim one only when the
        // request changes nothing that would need a restart (metadata and
        // lifetime are record fields).
        let net_as_template = req.network.as_ref().is_none_or(|n| *n == tpl.network);
        let storage_as_template = storage == self.sandbox_storage(tpl.class, tpl.storage)?;
        // A template that keeps no warm pool has none to claim from (what
        // a pool it kept before leaves is being drained): no trip to the
        // store for it.
        if origin.is_none()
            && tpl.warm_min > 0
            && claims.is_empty()
            && secret_names.is_empty()
            && req.env.is_empty()
            && (memory, vcpus, disk, pids) == tpl.limits()
            && net_as_template
            && storage_as_template
        {
            let t1 = crate::timing::mark("checks", t0);
            let claimed = self.claim_warm(owner, &tpl, &lifecycle, &metadata, key, &hash).await;
            crate::timing::mark("claim", t1);
            match claimed {
                Ok(Some(r)) if opts.e2b.is_some() => {
                    // The E2B settings join the claimed sandbox's record.
                    let mut claimed = NetRecord::parse(&r.network);
                    claimed.e2b = opts.e2b.clone();
                    let (sid, json) = (r.id.clone(), claimed.to_json());
                    self.db(move |s| s.set_network(&sid, &json)).await?;
                    let r = self.sandbox_record(&SandboxId::from_record(&r.id)).await?.unwrap_or(r);
                    return Ok((view(&r), true));
                }
                Ok(Some(r)) => return Ok((view(&r), true)),
                Ok(None) => {}
                Err(ControlError::Store(StoreError::Conflict)) => return self.replayed(owner, key).await,
                Err(e) => return Err(e),
            }
        }
        let id = SandboxId::random()?;
        let now = now_ms();
        // Each secret's placeholder (never its value), made for this sandbox.
        env.extend(self.secret_env(id.as_str(), &secret_names)?);
        let record = SandboxRecord {
            id: id.to_string(),
            owner: owner.to_string(),
            template: tpl.name.clone(),
            state: SandboxState::Starting,
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
            storage,
            origin,
            on_expire: lifecycle.on_expire,
            ttl_s: lifecycle.ttl_s(),
            paused_ttl_s: lifecycle.paused_ttl_s,
            class: tpl.class,
            node: self.node.name.clone(),
            reason: None,
        };
        let rec = record.clone();
        for c in &mut claims {
            c.sandbox_id = record.id.clone();
        }
        // Its usage interval opens in the same transaction.
        let inserted = self.db(move |s| s.insert_sandbox_claiming(&rec, &admission, &claims, Some(now_ms())));
        match inserted.await {
            Ok(Admitted::Inserted) => {
                self.emit_created(&record);
            }
            Ok(Admitted::Refused(e)) => return Err(self.refused(owner.as_str(), e)),
            Ok(Admitted::VolumeInUse(v)) => return Err(self.volume_busy(&v).await),
            Ok(Admitted::VolumeGone(v)) => return Err(ControlError::NoVolume(v)),
            Ok(Admitted::NodeClosed(state)) => return Err(self.node_closed(state)),
            // A concurrent create with the same key won the race.
            Err(ControlError::Store(StoreError::Conflict)) => return self.replayed(owner, key).await,
            Err(e) => return Err(e),
        }
        crate::timing::mark("admit", t0);
        let this = self.clone();
        let phases = crate::timing::Phases::current();
        let started = tokio::spawn(crate::timing::within(phases, async move { this.boot(record, &tpl).await }));
        match tokio::time::timeout(wait, started).await {
            Ok(Ok(Ok(r))) => Ok((view(&r), true)),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(join)) => Err(join.into()),
            // Still starting: the caller polls.
            Err(_) => {
                let r = self.sandbox_record(&id).await?.ok_or_else(|| ControlError::NoSandbox(id.to_string()))?;
                Ok((view(&r), true))
            }
        }
    }

    /// The sandbox a concurrent create made with the same key.
    async fn replayed(&self, owner: &OwnerId, key: Option<&str>) -> Result<(Sandbox, bool)> {
        let (o, k) = (owner.as_str().to_owned(), key.unwrap_or_default().to_owned());
        let existing = self.db(move |s| s.sandbox_by_key(&o, &k)).await?.ok_or(ControlError::OutcomeUnknown)?;
        Ok((view(&existing), false))
    }

    /// The host's image store.
    pub(crate) fn images(&self) -> Result<ImageStore> {
        ImageStore::open(&self.runtime.config().state_dir).map_err(|e| ControlError::Runtime(e.to_string()))
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
        let this = self.clone();
        let id = live.id.clone();
        let wanted = move || !this.is_cancelled(&id);
        let Err(failed) = crate::ready::until_ready(&live.socket, &check, |_| {}, wanted).await else {
            return Ok(());
        };
        tracing::warn!("sandbox {} did not become ready: {}", record.id, failed.message());
        // Gone: deleted or drained meanwhile; that reason stands.
        let reason = match failed {
            crate::ready::NotReady::Gone(_) => None,
            _ => Some(failed.reason()),
        };
        self.insert_live(live.clone());
        let _ = self.destroy(&live.id, reason).await;
        Err(match failed {
            crate::ready::NotReady::StartupFailed(m) => ControlError::StartupFailed(m),
            crate::ready::NotReady::Timeout(m) => ControlError::ReadinessTimeout(m),
            crate::ready::NotReady::Gone(_) => ControlError::StartFailed(Reason::DeletedWhileStarting),
        })
    }

    /// Starts a process-class sandbox: a tenant of the host container of
    /// its owner, template and root (started on first use, with the
    /// sandbox's network policy, which every tenant of it shares).
    async fn start_tenant(
        &self,
        record: &SandboxRecord,
        spec: SandboxSpec,
        network: std::result::Result<Arc<Network>, String>,
        policy: hutch_runtime::net::Policy,
        interface: bool,
    ) -> Result<std::result::Result<Booted, BootError>> {
        let t0 = Instant::now();
        let key = format!(
            "{}|{}|{:?}|{:?}|{:?}",
            record.owner,
            record.template_id.as_deref().unwrap_or(&record.template),
            spec.root,
            spec.extra_lowers,
            spec.ca_bundle
        );
        let host_id = crate::process::host_id()?;
        let host_spec = crate::process::host_spec(&spec, host_id.clone());
        let (rt, policy2) = (self.runtime.clone(), policy.clone());
        let host = self
            .hosts
            .acquire(key, &record.id, move || {
                match start_with_network(&rt, host_spec, network, &host_id, &policy2, interface, Launch::Host) {
                    Ok((sb, _, _)) => Ok(sb),
                    Err(BootError::Runtime(e)) => Err(ControlError::StartFailed(Reason::of_start(&e))),
                    Err(BootError::Network(reason, why)) => {
                        tracing::warn!("host container {host_id}: network policy not enforceable: {why}");
                        Err(ControlError::StartFailed(reason))
                    }
                }
            })
            .await;
        let t0 = crate::timing::mark("host", t0);
        let host = match host {
            Ok(h) => h,
            Err(e) => {
                let id = SandboxId::from_record(&record.id);
                if let ControlError::StartFailed(reason) = &e {
                    self.fail_start(&id, *reason).await?;
                }
                return Err(e);
            }
        };
        let applied = crate::network::applied(Some(policy.egress));
        let tenant = hutch_runtime::ProcessSpec { id: spec.id.clone(), limits: spec.limits, env: spec.env.clone() };
        let rt = self.runtime.clone();
        let started = tokio::task::spawn_blocking(move || rt.start_tenant(&host, &tenant)).await?;
        crate::timing::mark("tenant", t0);
        if started.is_err() {
            self.hosts.release(&record.id, self.network.as_ref().ok()).await;
        }
        Ok(started.map(|sb| (sb, None, applied)).map_err(BootError::Runtime))
    }

    /// Ends a `starting` record that never ran, with `reason`.
    async fn fail_start(&self, id: &SandboxId, reason: Reason) -> Result<()> {
        self.transition(id, Transition::FailStart, Set::reason(Some(reason))).await?;
        self.uncancel(id);
        Ok(())
    }

    /// Starts the runtime sandbox of a `starting` record, then its
    /// template's startup command, and waits until it is ready.
    pub(crate) async fn boot(
        self: Arc<Self>,
        record: SandboxRecord,
        recipe: &crate::templates::Recipe,
    ) -> Result<SandboxRecord> {
        let t0 = Instant::now();
        let id = SandboxId::from_record(&record.id);
        let owner = OwnerId::from_record(&record.owner);
        // A build's image made on another node is pulled first (`moves`);
        // a preset is built on its first use: on the blocking pool.
        let pulled = self.image_here(recipe).await;
        let (state, name, o) = (self.runtime.config().state_dir.clone(), recipe.image.clone(), record.owner.clone());
        let resolved = match (pulled, crate::build::root_without_disk(&name)) {
            (Ok(()), Some(root)) => Ok(root),
            (Ok(()), None) => {
                tokio::task::spawn_blocking(move || crate::build::image_root(&state, &name, Some(&o))).await?
            }
            (Err(e), _) => {
                Err(ControlError::ImageUnavailable(format!("{}: from the fleet's registry: {e}", recipe.image)))
            }
        };
        let t1 = crate::timing::mark("image", t0);
        let crate::build::ImageRoot { root, layers: extra_lowers, env: image_env, workdir } = match resolved {
            Ok(r) => r,
            Err(e) => {
                let reason = if matches!(e, ControlError::NoImage(_)) {
                    Reason::ImageNotFound
                } else {
                    Reason::ImageUnavailable
                };
                tracing::warn!("sandbox {id} failed to start: {e}");
                self.fail_start(&id, reason).await?;
                return Err(e);
            }
        };
        // The image's environment, under the template's and the request's.
        let mut env: BTreeMap<String, String> = image_env.into_iter().collect();
        env.extend(serde_json::from_str::<BTreeMap<String, String>>(&record.env).unwrap_or_default());
        let spec = SandboxSpec {
            class: record.class,
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
            ca_bundle: None,
            extra_lowers,
            writable: hutch_runtime::Writable::Memory,
            volumes: Vec::new(),
        };
        // The volumes it mounts (its claims, kept across a pause to disk);
        // a process sandbox has none (its create refuses them).
        let mounts = match record.class {
            hutch_runtime::Class::Process => Ok(Vec::new()),
            _ => self.volume_mounts_of(&record.id).await,
        };
        let spec = match mounts {
            Ok(volumes) => SandboxSpec { volumes, ..spec },
            Err(e) => {
                tracing::warn!("sandbox {id} failed to start: {e}");
                self.fail_start(&id, Reason::StartRejected).await?;
                return Err(ControlError::StartFailed(Reason::StartRejected));
            }
        };
        let rt = self.runtime.clone();
        let mut net = NetRecord::parse(&record.network);
        // It names secrets: its tools trust the egress proxy's CA.
        let spec = match (&self.egress_bundle, net.secrets.is_empty()) {
            (Some(bundle), false) => SandboxSpec { ca_bundle: Some(bundle.clone()), ..spec },
            _ => spec,
        };
        let policy = net.policy(&record.owner, record.template_id.as_deref().unwrap_or(&record.template));
        let network = self.network.clone();
        let sid = record.id.clone();
        let interface = net.interface;
        let (storage, origin) = (record.storage, record.origin.clone());
        let refill = origin.clone().filter(|o| storage == StorageKind::Disk && o.starts_with("snap-"));
        // Set when its processes continue from a memory image.
        let restored = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let restored2 = restored.clone();
        let gvisor = record.class == hutch_runtime::Class::Gvisor;
        let started = if record.class == hutch_runtime::Class::Process {
            self.start_tenant(&record, spec, network, policy, interface).await?
        } else {
            tokio::task::spawn_blocking(move || {
                let mut spec = spec;
                // A disk layer of its own, named after it (empty, or a copy of
                // the snapshot it starts from); nothing of it is left if the
                // start fails.
                // A paused sandbox's layer is its own already: kept whatever
                // happens.
                let mut kept = false;
                if storage == StorageKind::Disk {
                    let layer = match rt.layer_of(&sid).map_err(BootError::Runtime)? {
                        Some(layer) => {
                            kept = true;
                            Ok(layer)
                        }
                        None => match &origin {
                            Some(snap) => rt.layer_from_snapshot(&sid, snap),
                            None => rt.new_layer(&sid),
                        },
                    };
                    spec.writable = hutch_runtime::Writable::Layer(layer.map_err(BootError::Runtime)?);
                }
                // A gvisor sandbox continues from a memory image: its own
                // (paused to disk), else the one its layer was copied from.
                let own = gvisor && rt.has_memory(&sid);
                let image = match &origin {
                    _ if own => Some(rt.memory_image(&sid)),
                    Some(o) if gvisor && !kept && rt.has_memory(o) => Some(rt.memory_image(o)),
                    _ => None,
                };
                let how = image.as_deref().map_or(Launch::Start, Launch::Restore);
                let mut started = start_with_network(&rt, spec.clone(), network.clone(), &sid, &policy, interface, how);
                if own {
                    // Used once: a paused sandbox that fails to restore
                    // starts afresh on its files.
                    rt.delete_memory(&sid);
                    if let Err(BootError::Runtime(e)) = &started {
                        tracing::warn!(
                            "sandbox {sid}: its memory did not restore ({e}); it starts afresh on its files"
                        );
                        started = start_with_network(&rt, spec, network, &sid, &policy, interface, Launch::Start);
                    }
                }
                if started.is_ok() && image.is_some() {
                    restored2.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                if started.is_err() && storage == StorageKind::Disk && !kept {
                    if let Err(e) = rt.delete_layer(&sid) {
                        tracing::warn!("sandbox {sid}: its layer stays until the next sweep: {e}");
                    }
                }
                started
            })
            .await?
        };
        // The next create from the same snapshot finds a spare ready.
        if let Some(snap) = refill {
            self.keep_spares(snap);
        }
        let sb = match started {
            Ok((sb, attached, applied)) => {
                if let Some(a) = &attached {
                    net.attached(a);
                }
                net.applied = applied;
                sb
            }
            Err(BootError::Runtime(e)) => {
                let reason = Reason::of_start(&e);
                tracing::warn!("sandbox {id} failed to start: {e}");
                self.fail_start(&id, reason).await?;
                return Err(match &e {
                    hutch_runtime::RuntimeError::Uids(_) => ControlError::NoCapacity(e.to_string()),
                    _ => ControlError::StartFailed(reason),
                });
            }
            Err(BootError::Network(reason, why)) => {
                tracing::warn!("sandbox {id}: network policy not enforceable, not started: {why}");
                self.fail_start(&id, reason).await?;
                return Err(ControlError::StartFailed(reason));
            }
        };
        let t2 = crate::timing::mark("start", t1);
        tracing::debug!("sandbox {id} started: {:?}", sb.timings);
        let host_pid = i64::from(sb.pid);
        let live = Live::new(sb, owner, record.pooled);
        // A restored sandbox's startup command runs already (or ran).
        let restored = restored.load(std::sync::atomic::Ordering::SeqCst);
        if !restored && (recipe.startup.is_some() || recipe.readiness.is_some()) {
            self.until_ready(&record, &live, recipe, workdir).await?;
        }
        let ready = Set {
            host_pid: Some(host_pid),
            limits_applied: Some("enforced"),
            network: Some(net.to_json()),
            ..Set::default()
        };
        // A warm sandbox is claimable the moment the store says it runs,
        // and a claim takes its Live out of the pool (a pooled Live serves
        // nobody): the Live must be in the map before that moment, or a
        // claim in between would leave it pooled for good. A pooled Live is
        // nobody's, so it is no door into a sandbox still starting.
        if record.pooled {
            self.insert_live(live.clone());
        }
        let became = match self.transition(&id, Transition::Ready, ready).await {
            Ok(became) => became,
            Err(e) => {
                if record.pooled {
                    self.remove_live(&id);
                }
                return Err(e);
            }
        };
        if !record.pooled {
            self.insert_live(live);
        }
        self.uncancel(&id);
        crate::timing::mark("ready", t2);
        match became {
            Some(r) => {
                self.metrics.create_to_ready.observe(t0.elapsed().as_secs_f64());
                let took = format!("{}", t0.elapsed().as_millis());
                self.log(
                    &id,
                    crate::history::LogLevel::Info,
                    format!("sandbox started from template {} in {took} ms", r.template),
                    &[("template", r.template.clone()), ("network", net.applied.clone()), ("start_ms", took.clone())],
                );
                if recipe.startup.is_some() {
                    self.log(&id, crate::history::LogLevel::Info, "startup command running", &[]);
                }
                // Its first metrics sample, off the create's path.
                let (this, first) = (self.clone(), r.clone());
                tokio::spawn(async move { this.sample_one(&first).await });
                Ok(r)
            }
            None => {
                // A delete came while we started: it marked the record
                // terminating; what we started is ours to end.
                self.destroy(&id, None).await?;
                Err(ControlError::StartFailed(Reason::DeletedWhileStarting))
            }
        }
    }

    pub async fn get(&self, caller: &Caller, id: &SandboxId) -> Result<Sandbox> {
        let sb = self.with_idle(view(&self.record(caller, id, Need::Manage).await?));
        self.with_volumes(sb).await
    }

    /// A page of sandboxes, newest first: the caller's own, or for an admin
    /// another owner's (`owner`) or everyone's (`*`); with `live`, only
    /// those not yet terminated.
    pub async fn list(
        &self,
        caller: &Caller,
        owner: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
        live: bool,
    ) -> Result<SandboxList> {
        let owners = caller.listing(owner)?;
        let limit = limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(ControlError::Invalid("limit must be 1 to 1000".into()));
        }
        let after = cursor.map(decode_cursor).transpose()?;
        let filter = owners.filter().map(str::to_owned);
        let rows = self
            .db(move |s| {
                s.list_sandboxes(filter.as_deref(), after.as_ref().map(|(t, i)| (*t, i.as_str())), limit + 1, live)
            })
            .await?;
        let more = rows.len() > limit as usize;
        let rows = &rows[..rows.len().min(limit as usize)];
        Ok(SandboxList {
            sandboxes: rows.iter().map(|r| self.with_idle(view(r))).collect(),
            next_cursor: if more { rows.last().map(encode_cursor) } else { None },
        })
    }

    /// Deletes a sandbox; idempotent: a terminated one answers as it is.
    pub async fn delete(self: &Arc<Self>, caller: &Caller, id: &SandboxId) -> Result<Sandbox> {
        // A lost one has ended already, whichever node is asked (its node,
        // back, ends what is left of it on its host).
        let r = self.record(caller, id, Need::Manage).await?;
        if r.state == SandboxState::Lost {
            return Ok(view(&r));
        }
        self.on_this_node(&r)?;
        if r.state == SandboxState::Terminated {
            return Ok(view(&r));
        }
        // The record as the teardown left it; read again when someone else
        // moved it meanwhile.
        match self.destroy_record(r, None).await? {
            Some(ended) => Ok(view(&ended)),
            None => Ok(view(&self.record(caller, id, Need::Manage).await?)),
        }
    }

    /// Marks a sandbox terminating, destroys it, marks it terminated. A
    /// sandbox still starting (not yet live here) is marked terminating
    /// and its boot tears down what it made.
    pub(crate) async fn destroy(self: &Arc<Self>, id: &SandboxId, reason: Option<Reason>) -> Result<()> {
        let Some(r) = self.sandbox_record(id).await? else { return Ok(()) };
        self.destroy_record(r, reason).await.map(|_| ())
    }

    /// [`Control::destroy`] of the record just read; the record its last
    /// transition wrote, None where this call did not write it (another
    /// teardown runs, or the sandbox was still starting).
    async fn destroy_record(
        self: &Arc<Self>,
        r: SandboxRecord,
        reason: Option<Reason>,
    ) -> Result<Option<SandboxRecord>> {
        let id = &SandboxId::from_record(&r.id);
        if r.state == SandboxState::Terminated {
            return Ok(None);
        }
        if r.state == SandboxState::Starting && self.live(id).is_none() {
            self.cancel(id);
            self.transition(id, Transition::Terminate, Set::reason(reason)).await?;
            return Ok(None);
        }
        // One teardown at a time: a second call while one runs (the
        // reconciler's retry of the `terminating` row a delete just wrote)
        // leaves it to the first, which marks it terminated.
        let Some(_ending) = self.ending.claim(id) else { return Ok(None) };
        // Already terminating (a retry, or a drain): go on with the teardown.
        let t0 = Instant::now();
        self.transition(id, Transition::Terminate, Set::reason(reason)).await?;
        crate::timing::mark("terminate", t0);
        if let Err(e) = self.teardown_host(id).await {
            // Stays `terminating`: the reconciler tries again.
            tracing::warn!("sandbox {id}: teardown failed, will retry: {e}");
            return Err(e);
        }
        let t0 = Instant::now();
        let ended = self.transition(id, Transition::Finish, Set::default()).await?;
        crate::timing::mark("finish", t0);
        self.release_origin(r.origin.clone()).await;
        Ok(ended)
    }

    /// The host's part of a sandbox's end, the one teardown of a delete and
    /// of a node's release of what it no longer owns: its grants, history
    /// and idle clock forgotten; its processes, cgroups, disk layer and
    /// saved memory gone; its tenant slot and network lease released. An
    /// error leaves the rest for a retry.
    pub(crate) async fn teardown_host(self: &Arc<Self>, id: &SandboxId) -> Result<()> {
        self.access.revoke_sandbox(id.as_str());
        self.history.forget(id);
        self.idle.forget(id.as_str());
        let handle = self.take_handle(id);
        let rt = self.runtime.clone();
        let sid = id.to_string();
        let tenant = handle.is_tenant();
        let sweep = handle.leaves_ids_to_sweep();
        let net = self.network.as_ref().ok().cloned();
        // One trip to the blocking pool for all of it.
        let (result, [processes, layer, network]) = tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let result = handle.destroy();
            if sweep {
                rt.sweep_own();
            }
            let t1 = Instant::now();
            // Its files go once its processes have: the disk layer, if any,
            // and the memory of a pause to disk.
            rt.delete_memory(&sid);
            let result = result.and_then(|()| rt.delete_layer(&sid).map(drop));
            let t2 = Instant::now();
            // Then its network lease (a tenant has none: its host's goes
            // with its host's last tenant, below).
            if let (Ok(()), Some(net)) = (&result, net) {
                net.release(&sid);
            }
            (result, [t1 - t0, t2 - t1, t2.elapsed()])
        })
        .await?;
        crate::timing::record("processes", processes);
        crate::timing::record("layer", layer);
        result.map_err(|e| ControlError::Runtime(format!("sandbox {id}: {e}")))?;
        let t0 = Instant::now();
        if tenant {
            self.hosts.release(id.as_str(), self.network.as_ref().ok()).await;
        }
        crate::timing::record("network", network + t0.elapsed());
        Ok(())
    }

    /// Deletes the records of sandboxes that ended more than `retention`
    /// ago (`hutch serve --sandbox-retention`), a batch per store call so
    /// that no call holds the store long; how many.
    pub async fn prune_sandboxes(&self, retention: Duration) -> Result<u64> {
        const BATCH: u32 = 1_000;
        let before = crate::control::cutoff(retention);
        let mut pruned = 0;
        loop {
            let n = self.db(move |s| s.prune_sandboxes(before, BATCH)).await?;
            pruned += n;
            if n < u64::from(BATCH) {
                return Ok(pruned);
            }
            tokio::task::yield_now().await;
        }
    }

    /// Moves the expiry. `by` adds to the current expiry, `until` sets it.
    /// Past the template's maximum lifetime or the key's quota it is
    /// refused, as a create is, unless `clamp` (E2B's timeout, which
    /// clamps).
    pub async fn extend(&self, caller: &Caller, id: &SandboxId, req: &Extend, clamp: bool) -> Result<Sandbox> {
        let r = self.record_here(caller, id, Need::Manage).await?;
        let live = [SandboxState::Starting, SandboxState::Running, SandboxState::Suspended, SandboxState::Paused];
        if !live.contains(&r.state) {
            return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
        }
        let target = match (req.by, req.until.as_deref()) {
            (Some(by), None) => r.expires_at.saturating_add((by.min(10 * 365 * 86_400) * 1000) as i64),
            (None, Some(until)) => {
                parse_rfc3339(until).ok_or_else(|| ControlError::Invalid("until must be RFC 3339".into()))?
            }
            _ => return Err(ControlError::Invalid("give exactly one of by and until".into())),
        };
        if target <= now_ms() {
            return Err(ControlError::Invalid("the new expiry is in the past".into()));
        }
        let mut cap = r.max_expires_at;
        let quotas = self.quotas_of(&OwnerId::from_record(&r.owner)).await?;
        if let Some(max) = quotas.ttl_seconds {
            cap = cap.min(r.created_at.saturating_add((max * 1000) as i64));
        }
        let target = if target > cap {
            if !clamp {
                return Err(ControlError::Invalid(format!(
                    "the new expiry is past the latest this sandbox may live to, {}; nothing was changed",
                    crate::control::rfc3339(cap)
                )));
            }
            cap
        } else {
            target
        };
        let sid = id.to_string();
        let updated = self.db(move |s| s.set_expiry(&sid, target, false, &live)).await?;
        match updated {
            Some(r) => {
                let mut d = serde_json::Map::new();
                d.insert("expires_at".into(), crate::control::rfc3339(r.expires_at).into());
                self.emit(&r.owner, crate::events::Kind::SandboxExtended, Some(&r.id), d);
                Ok(view(&r))
            }
            None => {
                let r = self.record_here(caller, id, Need::Manage).await?;
                Err(ControlError::NotRunning { id: id.to_string(), state: r.state })
            }
        }
    }

    /// Suspends a sandbox: in memory (frozen), or to disk (paused).
    pub async fn suspend(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        mode: hutch_api::SuspendMode,
    ) -> Result<Sandbox> {
        match mode {
            hutch_api::SuspendMode::Memory => {
                let r = self.record_here(caller, id, Need::Manage).await?;
                if r.state == SandboxState::Paused {
                    return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
                }
                self.freeze(caller, id, true).await
            }
            hutch_api::SuspendMode::Disk => self.pause(caller, id).await,
        }
    }

    /// `on_expire: "pause"`: an expired sandbox with it that runs (or is
    /// suspended) on a disk layer is paused to disk instead of ended, and
    /// kept `paused_ttl_seconds` from now (past the latest it could have
    /// run to, if need be: a paused sandbox holds only its disk, which its
    /// key's quota counts). True when it was paused.
    pub(crate) async fn pause_at_expiry(self: &Arc<Self>, r: &SandboxRecord) -> bool {
        let can = matches!(r.state, SandboxState::Running | SandboxState::Suspended)
            && r.storage == StorageKind::Disk
            && !r.pooled;
        if r.on_expire != hutch_api::OnExpire::Pause || !can {
            return false;
        }
        let id = SandboxId::from_record(&r.id);
        let keep = r.paused_ttl_s.unwrap_or(PAUSED_TTL_DEFAULT).min(PAUSED_TTL_MAX);
        let until = now_ms().saturating_add((keep * 1000) as i64);
        // Kept first (a sandbox that cannot be kept is ended as any other).
        let sid = id.to_string();
        let live = [SandboxState::Running, SandboxState::Suspended];
        if !matches!(self.db(move |s| s.set_expiry(&sid, until, true, &live)).await, Ok(Some(_))) {
            return false;
        }
        let owner = Caller::key(OwnerId::from_record(&r.owner), false);
        match self.suspend(&owner, &id, hutch_api::SuspendMode::Disk).await {
            Ok(_) => {
                self.log(&id, crate::history::LogLevel::Info, "paused at its expiry (on_expire: pause)", &[]);
                true
            }
            Err(e) => {
                tracing::warn!("sandbox {id}: cannot pause it at its expiry ({e}); it ends");
                false
            }
        }
    }

    /// After a sandbox with `on_expire: "pause"` resumes from disk: it
    /// lives the lifetime it was given again (E2B's 300 s when unknown).
    async fn live_again(&self, id: &SandboxId, ttl_s: Option<u64>) {
        let secs = ttl_s.unwrap_or(300).clamp(1, 10 * 365 * 86_400);
        let until = now_ms().saturating_add((secs * 1000) as i64);
        let (sid, live) = (id.to_string(), [SandboxState::Starting, SandboxState::Running]);
        if let Err(e) = self.db(move |s| s.set_expiry(&sid, until, true, &live)).await {
            tracing::warn!("sandbox {id}: its lifetime after a resume: {e}");
        }
    }

    /// Resumes a frozen sandbox, or starts a paused one again on its files
    /// (a fresh agent, its template's startup command run again).
    pub async fn resume(self: &Arc<Self>, caller: &Caller, id: &SandboxId) -> Result<Sandbox> {
        // Paused on a node that is gone: taken here first (see `moves`).
        self.adopt_paused(caller, id).await?;
        let r = self.record_here(caller, id, Need::Manage).await?;
        if r.state == SandboxState::Paused {
            let on_expire = r.on_expire;
            let ttl_s = r.ttl_s;
            let sb = self.wake(r).await?;
            if on_expire == hutch_api::OnExpire::Pause {
                self.live_again(id, ttl_s).await;
            }
            return self.get(caller, id).await.or(Ok(sb));
        }
        self.freeze(caller, id, false).await
    }

    /// Pauses a sandbox to disk: the record says `paused` first (so a
    /// daemon stopped part way finds it paused, and ends what is left of its
    /// processes at start), then its processes end, its network lease is
    /// released, and its layer is written to disk. Its admission stays.
    async fn pause(self: &Arc<Self>, caller: &Caller, id: &SandboxId) -> Result<Sandbox> {
        let r = self.record_here(caller, id, Need::Manage).await?;
        if r.state == SandboxState::Paused {
            return Ok(view(&r));
        }
        if !Transition::Pause.from().contains(&r.state) {
            return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
        }
        if r.storage != StorageKind::Disk {
            return Err(ControlError::SnapshotUnsupported(id.to_string()));
        }
        // Known before the record says `paused`: a resume that sees that
        // waits for the teardown below (its network lease, its layer).
        let (done, waiting) = tokio::sync::watch::channel(false);
        self.pausing.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string(), waiting);
        let ended = async {
            self.forget_push(id).await?;
            let Some(paused) = self.transition(id, Transition::Pause, Set::default()).await? else {
                let r = self.record_here(caller, id, Need::Manage).await?;
                return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
            };
            self.access.revoke_sandbox(id.as_str());
            // A gvisor sandbox keeps its memory on disk too.
            if crate::snapshots::memory_capable(&r).is_ok() {
                self.checkpoint_to_disk(id).await;
            }
            self.end_processes(id).await?;
            // Its files, for another node (with a fleet's registry).
            self.push_paused(id).await;
            Ok(view(&paused))
        }
        .await;
        self.pausing.lock().unwrap_or_else(|p| p.into_inner()).remove(id.as_str());
        done.send_replace(true);
        ended
    }

    /// Checkpoints a gvisor sandbox being paused into its own memory image
    /// (`<state>/memory/<id>`), which its wake restores. Its processes end
    /// with the checkpoint. A failure keeps its files only.
    async fn checkpoint_to_disk(&self, id: &SandboxId) {
        let Some(live) = self.live(id) else { return };
        let (rt, sid) = (self.runtime.clone(), id.to_string());
        let saved = tokio::task::spawn_blocking(move || {
            let mut guard = live.handle.lock().map_err(|_| "lock poisoned".to_owned())?;
            let sb = guard.as_mut().ok_or_else(|| "sandbox is being deleted".to_owned())?;
            if live.is_suspended() {
                sb.thaw().map_err(|e| e.to_string())?;
                live.set_suspended(false);
            }
            rt.checkpoint_gvisor(sb, &sid, false, || Ok(())).map_err(|e| e.to_string())
        })
        .await;
        match saved {
            Ok(Ok(())) => self.log(id, crate::history::LogLevel::Info, "memory saved to disk", &[]),
            Ok(Err(e)) => tracing::warn!("sandbox {id}: its memory was not saved, only its files: {e}"),
            Err(e) => tracing::warn!("sandbox {id}: its memory was not saved, only its files: {e}"),
        }
    }

    /// Waits (a minute at most) for a pause of `id` under way to finish.
    async fn pause_finished(&self, id: &SandboxId) {
        let waiting = self.pausing.lock().unwrap_or_else(|p| p.into_inner()).get(id.as_str()).cloned();
        if let Some(mut w) = waiting {
            // A dropped sender (the pause's task ended) is as good as done.
            let _ = tokio::time::timeout(Duration::from_secs(60), w.wait_for(|d| *d)).await;
        }
    }

    /// A sandbox's runtime handle, taken from its live entry, or adopted
    /// when this daemon holds none (it was started by an earlier run).
    fn take_handle(&self, id: &SandboxId) -> hutch_runtime::Sandbox {
        let live = self.remove_live(id);
        match live.as_ref().and_then(|l| l.handle.lock().ok().and_then(|mut h| h.take())) {
            Some(h) => h,
            None => self.runtime.adopt(id.as_str()),
        }
    }

    /// Ends a paused sandbox's processes (if any are left) and what they
    /// held on the host, keeping its layer, written to disk.
    pub(crate) async fn end_processes(&self, id: &SandboxId) -> Result<()> {
        let handle = self.take_handle(id);
        let rt = self.runtime.clone();
        let sweep = handle.leaves_ids_to_sweep();
        tokio::task::spawn_blocking(move || {
            let ended = handle.destroy();
            if sweep {
                rt.sweep_own();
            }
            if let Some(storage) = rt.storage() {
                if let Err(e) = storage.sync() {
                    tracing::warn!("storage: {e}");
                }
            }
            ended
        })
        .await?
        .map_err(|e| ControlError::Runtime(e.to_string()))?;
        if let Ok(net) = &self.network {
            let (net, sid) = (net.clone(), id.to_string());
            tokio::task::spawn_blocking(move || net.release(&sid)).await?;
        }
        Ok(())
    }

    /// Starts a paused sandbox again on its layer.
    async fn wake(self: &Arc<Self>, r: SandboxRecord) -> Result<Sandbox> {
        let id = SandboxId::from_record(&r.id);
        self.pause_finished(&id).await;
        let owner = OwnerId::from_record(&r.owner);
        let recipe = match r.origin.as_deref().filter(|o| o.starts_with("snap-")) {
            Some(snap) => match self.snapshot_recipe(&owner, snap).await {
                Ok((_, recipe)) => recipe,
                Err(_) => self.recipe(&owner, Some(&r.template)).await?,
            },
            None => self.recipe(&owner, Some(&r.template)).await?,
        };
        // Only while it is this node's: a draining node may have given it
        // to another meanwhile (`moves`), whose files are then its.
        let here = Set { on_node: Some(self.node.name.clone()), ..Set::default() };
        let Some(record) = self.transition(&id, Transition::Wake, here).await? else {
            return match self.sandbox_record(&id).await? {
                Some(now) if now.node != self.node.name => Err(ControlError::OtherNode { id: now.id, node: now.node }),
                _ => Err(ControlError::NotRunning { id: id.to_string(), state: r.state }),
            };
        };
        let this = self.clone();
        let booted = tokio::spawn(async move { this.boot(record, &recipe).await }).await??;
        Ok(view(&booted))
    }

    async fn freeze(&self, caller: &Caller, id: &SandboxId, frozen: bool) -> Result<Sandbox> {
        let r = self.record_here(caller, id, Need::Manage).await?;
        let (t, to) = if frozen {
            (Transition::Suspend, SandboxState::Suspended)
        } else {
            (Transition::Resume, SandboxState::Running)
        };
        if r.state == to {
            return Ok(view(&r));
        }
        if !t.from().contains(&r.state) {
            return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
        }
        let live = self.live(id).ok_or_else(|| ControlError::NoSandbox(id.to_string()))?;
        let l2 = live.clone();
        tokio::task::spawn_blocking(move || {
            let guard = l2.handle.lock().map_err(|_| "lock poisoned".to_owned())?;
            let sb = guard.as_ref().ok_or_else(|| "sandbox is being deleted".to_owned())?;
            if frozen { sb.freeze() } else { sb.thaw() }.map_err(|e| e.to_string())?;
            // Under the handle's lock, which a snapshot holds while it
            // freezes and thaws: it sees the state it must leave.
            l2.set_suspended(frozen);
            Ok::<(), String>(())
        })
        .await?
        .map_err(ControlError::Runtime)?;
        if frozen {
            // Open proxied connections end with the grants.
            self.access.revoke_sandbox(id.as_str());
        } else {
            // Uploads a stopped daemon left while this sandbox was frozen.
            crate::files::journal::recover(&self.upload_journal(id), &live.socket).await;
        }
        // Not observed since the change: a resume looks again.
        let mut net = NetRecord::parse(&r.network);
        net.applied = match (&self.network, frozen, r.host_pid) {
            (Ok(n), false, Some(pid)) => crate::network::applied(n.observe(id.as_str(), pid as libc::pid_t)),
            _ => "unknown".into(),
        };
        match self.transition(id, t, Set { network: Some(net.to_json()), ..Set::default() }).await? {
            Some(r) => {
                let what = if frozen { "sandbox paused" } else { "sandbox resumed" };
                self.log(id, crate::history::LogLevel::Info, what, &[]);
                Ok(view(&r))
            }
            None => {
                let r = self.record_here(caller, id, Need::Manage).await?;
                // A concurrent call made the same change (two requests
                // resuming a sandbox by its port at once): done.
                if r.state == to {
                    return Ok(view(&r));
                }
                // Something else moved it meanwhile (a delete): undo ours.
                live.set_suspended(!frozen);
                Err(ControlError::NotRunning { id: id.to_string(), state: r.state })
            }
        }
    }

    /// A running sandbox's resource use now, with its record.
    pub async fn sandbox_usage(
        &self,
        caller: &Caller,
        id: &SandboxId,
    ) -> Result<(hutch_runtime::container::Usage, Sandbox)> {
        let r = self.record(caller, id, Need::Manage).await?;
        let live = self.live(id).ok_or(ControlError::NotRunning { id: id.to_string(), state: r.state })?;
        let usage = tokio::task::spawn_blocking(move || {
            let guard = live.handle.lock().map_err(|_| ControlError::Runtime("sandbox lock poisoned".into()))?;
            let sb = guard
                .as_ref()
                .ok_or(ControlError::NotRunning { id: live.id.to_string(), state: SandboxState::Terminating })?;
            Ok::<_, ControlError>(sb.usage())
        })
        .await??;
        Ok((usage, view(&r)))
    }

    /// Commands running in every running sandbox, as their agents count them
    /// (background ones included), with each sandbox's owner. Suspended
    /// sandboxes are skipped: a frozen agent cannot answer.
    pub(crate) async fn commands_running(&self) -> Vec<(OwnerId, u64)> {
        let mut out = Vec::new();
        for live in self.lives() {
            if live.is_suspended() {
                continue;
            }
            let n = live.processes(Duration::from_millis(200)).await.map_or(0, |p| p.len() as u64);
            out.push((live.owner.clone(), n));
        }
        out
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
        e => ControlError::ImageUnavailable(format!("{name}: {e}")),
    })?;
    let dirs = store.layer_dirs(&img).map_err(|e| ControlError::ImageUnavailable(format!("{name}: {e}")))?;
    Ok((RootSource::Layers(dirs), img.env_pairs()))
}

enum BootError {
    Runtime(hutch_runtime::RuntimeError),
    /// A policy that cannot be enforced: the reason and why.
    Network(Reason, String),
}

/// How [`start_with_network`] starts the sandbox.
#[derive(Clone, Copy)]
enum Launch<'a> {
    Start,
    /// A host container of the process class.
    Host,
    /// A gvisor sandbox continued from this memory image.
    Restore(&'a std::path::Path),
}

type Booted = (hutch_runtime::Sandbox, Option<Attached>, String);

/// Attaches the sandbox's network, starts it inside, and reads back what
/// the host enforces. Anything short of the asked policy ends the sandbox.
/// With `interface`, a `deny_all` sandbox gets an interface in no set, so
/// its policy can open later (without networking on the host it gets only
/// `lo`, and stays closed).
fn start_with_network(
    rt: &Runtime,
    mut spec: SandboxSpec,
    network: std::result::Result<Arc<Network>, String>,
    id: &str,
    policy: &hutch_runtime::net::Policy,
    interface: bool,
    how: Launch<'_>,
) -> std::result::Result<Booted, BootError> {
    let start = |spec: &SandboxSpec| match how {
        Launch::Start => rt.start(spec),
        Launch::Host => rt.start_host(spec),
        Launch::Restore(image) => rt.restore_gvisor(spec, image),
    };
    use hutch_runtime::net::Egress;
    let net = match network {
        Ok(n) => n,
        Err(why) if policy.egress != Egress::DenyAll => {
            return Err(BootError::Network(Reason::NetworkUnavailable, why))
        }
        Err(_) => {
            // No networking on this host: the sandbox's own namespace with
            // only `lo` is exactly deny_all.
            let sb = start(&spec).map_err(BootError::Runtime)?;
            return Ok((sb, None, "deny_all".into()));
        }
    };
    let attached = if interface { net.attach_with_interface(id, policy) } else { net.attach(id, policy) }
        .map_err(|e| BootError::Network(Reason::NetworkUnavailable, e.to_string()))?;
    spec.netns = attached.netns.clone();
    if spec.netns.is_some() {
        spec.resolv_conf = Some(net.resolv_conf().to_path_buf());
    }
    let sb = match start(&spec) {
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
        let reason =
            if policy.egress == Egress::DenyAll { Reason::NetworkUntrusted } else { Reason::NetworkUnavailable };
        return Err(BootError::Network(reason, format!("asked {:?}, observed {seen:?}", policy.egress)));
    }
    Ok((sb, Some(attached), crate::network::applied(seen)))
}
