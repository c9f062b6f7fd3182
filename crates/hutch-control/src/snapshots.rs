//! Snapshots: a sandbox's files at one instant, kept in the daemon's disk
//! storage as a read-only btrfs subvolume (`storage/fs/snapshots/<id>`),
//! owned by the key that took it and counted toward its `snapshots` quota.
//! A sandbox created with `"snapshot"` starts with a writable copy of those
//! files and the template settings of the sandbox they were taken of.
//!
//! Crash safety: the subvolume is made (one ioctl, whole or absent) before
//! its row is written, and the row is deleted before the subvolume; a
//! subvolume without a row (a daemon killed in between) is deleted at the
//! next start. So a listed snapshot is always whole.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, SandboxId, SnapshotId};
use crate::network::NetRecord;
use crate::templates::Recipe;
use hutch_api::{
    Change, CreateSandbox, CreateSnapshot, Diff, Fork, ForkResult, NetworkRequest, Readiness, Sandbox, SandboxState,
    Snapshot, SnapshotList, Startup, StorageKind,
};

/// Most sandboxes one fork starts.
pub const FORK_MAX: u32 = 20;
use hutch_store::{Exceeded, Resource, Scope, SnapshotRecord, StoreError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Writable copies of a snapshot kept made ahead for creates from it.
const SPARES: usize = 2;

/// What a sandbox started from a snapshot runs: the settings of the
/// sandbox it was taken of, as they were (stored as JSON with the row).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapRecipe {
    template: String,
    template_id: Option<String>,
    template_version: Option<i64>,
    image: String,
    memory_mb: u64,
    vcpus: f64,
    disk_mib: u64,
    pids: u32,
    env: BTreeMap<String, String>,
    default_ttl_s: u64,
    max_ttl_s: u64,
    startup: Option<Startup>,
    readiness: Option<Readiness>,
    network: NetworkRequest,
    /// What the source did at its expiry (recipes written before these
    /// were kept read as `delete`).
    #[serde(default)]
    on_expire: hutch_api::OnExpire,
    #[serde(default)]
    paused_ttl_s: Option<u64>,
    /// Recipes kept before classes were chosen are containers.
    #[serde(default)]
    class: hutch_api::Class,
    /// It holds a memory image too (`<state>/memory/<id>`, gvisor class).
    #[serde(default)]
    memory: bool,
}

impl SnapRecipe {
    fn recipe(&self) -> Recipe {
        Recipe {
            name: self.template.clone(),
            id: self.template_id.clone(),
            version: self.template_version,
            memory_mb: self.memory_mb,
            vcpus: self.vcpus,
            disk_mib: self.disk_mib,
            pids: self.pids,
            env: self.env.clone(),
            default_ttl: Duration::from_secs(self.default_ttl_s),
            max_ttl: Duration::from_secs(self.max_ttl_s),
            warm_min: 0,
            image: self.image.clone(),
            startup: self.startup.clone(),
            readiness: self.readiness.clone(),
            network: self.network.clone(),
            storage: Some(StorageKind::Disk),
            on_expire: Some(self.on_expire),
            paused_ttl_s: self.paused_ttl_s,
            // A sandbox's idle policy is its own, not its snapshot's.
            idle_timeout_s: None,
            on_idle: None,
            // Placeholders are the sandbox's own: its snapshot's sandboxes
            // name secrets anew.
            secrets: Vec::new(),
            class: self.class,
        }
    }
}

/// A snapshot's name: 1 to 64 of `a-z 0-9 - _ .`, not starting with `.`,
/// `-` or `snap-` (ids and names are looked up in one field).
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && !name.starts_with("snap-")
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ControlError::Invalid(
            "a snapshot's name is 1 to 64 of a-z, 0-9, '-', '_' and '.', not starting with '.', '-' or 'snap-'".into(),
        ))
    }
}

fn view(r: &SnapshotRecord) -> Snapshot {
    Snapshot {
        id: r.id.clone(),
        name: r.name.clone(),
        sandbox_id: r.sandbox_id.clone(),
        size_bytes: r.size_bytes,
        created_at: rfc3339(r.created_at),
        memory: serde_json::from_str::<SnapRecipe>(&r.recipe).is_ok_and(|x| x.memory),
        owner: r.owner.clone(),
    }
}

pub(crate) fn storage_error(e: hutch_runtime::RuntimeError) -> ControlError {
    match &e {
        hutch_runtime::RuntimeError::Storage(s) if s.is_full() => ControlError::StorageFull(e.to_string()),
        _ => ControlError::Runtime(e.to_string()),
    }
}

impl Control {
    /// Takes a snapshot of a running (or suspended) sandbox's files: the
    /// sandbox is frozen only while its layer is captured (a suspended one
    /// stays frozen).
    pub async fn snapshot(self: &Arc<Self>, caller: &Caller, id: &SandboxId, req: &CreateSnapshot) -> Result<Snapshot> {
        if let Some(name) = &req.name {
            check_name(name)?;
        }
        let r = self.capturable(caller, id).await?;
        let memory = req.memory == Some(true);
        if memory {
            memory_capable(&r)?;
        }
        let owner = OwnerId::from_record(&r.owner);
        let mut recipe = self.recipe_of(&r).await?;
        recipe.memory = memory;
        // Refusals that need no capture come first.
        let max = self.quotas_of(&owner).await?.snapshots;
        let o = owner.to_string();
        let held = self.db(move |s| s.list_snapshots(Some(&o))).await?.len() as u64;
        if let Some(max) = max.filter(|m| held >= *m) {
            return Err(self.quota_refusal(owner.as_str(), exceeded(max, held)));
        }
        if let Some(name) = req.name.clone() {
            let o = owner.to_string();
            if self.db(move |s| s.snapshot_by_name(&o, &name)).await?.is_some() {
                return Err(ControlError::SnapshotNameTaken(req.name.clone().unwrap_or_default()));
            }
        }
        let snap_id = SnapshotId::random()?;
        let mut captured = if memory {
            self.capture_memory(id, snap_id.as_str()).await?
        } else {
            self.capture(id, r.state, snap_id.as_str()).await?
        };
        // With simple quotas the capture counts what the sandbox wrote; what
        // it started from is its origin snapshot's (a fork point has no row).
        if self.runtime.storage().is_some_and(|st| st.quotas() == hutch_runtime::storage::Quotas::Simple) {
            if let Some(origin) = r.origin.clone().filter(|o| !o.starts_with("fork-")) {
                let inherited = self.db(move |s| s.get_snapshot(&origin)).await?.map_or(0, |o| o.size_bytes);
                captured = captured.saturating_add(inherited);
            }
        }
        let record = SnapshotRecord {
            id: snap_id.to_string(),
            owner: owner.to_string(),
            name: req.name.clone(),
            sandbox_id: id.to_string(),
            created_at: now_ms(),
            size_bytes: captured,
            recipe: serde_json::to_string(&recipe).map_err(|e| ControlError::Runtime(e.to_string()))?,
        };
        let rec = record.clone();
        let inserted = self.db(move |s| s.insert_snapshot(&rec, max)).await;
        let refusal = match inserted {
            Ok(true) => {
                let template = self.sandbox_record(id).await.ok().flatten().map(|r| r.template);
                let interval = crate::usage::snapshot_interval(&record, template);
                self.usage_mark_object(&record.id, Some(interval)).await;
                // Pushed for the fleet's other nodes, before spares are made.
                self.push_snapshot(&record).await;
                self.keep_spares(record.id.clone());
                let mut d = serde_json::Map::new();
                d.insert("snapshot_id".into(), record.id.clone().into());
                if let Some(name) = &record.name {
                    d.insert("name".into(), name.clone().into());
                }
                self.emit(&record.owner, crate::events::Kind::SandboxSnapshotCreated, Some(&record.sandbox_id), d);
                return Ok(view(&record));
            }
            Ok(false) => self.quota_refusal(owner.as_str(), exceeded(max.unwrap_or(0), max.unwrap_or(0))),
            Err(ControlError::Store(StoreError::Conflict)) => {
                ControlError::SnapshotNameTaken(req.name.clone().unwrap_or_default())
            }
            Err(e) => e,
        };
        // Nothing of a refused snapshot stays.
        let (rt, snap) = (self.runtime.clone(), snap_id.to_string());
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || rt.delete_snapshot(&snap)).await {
            tracing::warn!("snapshot {snap_id}: left for the next start's sweep: {e}");
        }
        Err(refusal)
    }

    /// Keeps [`SPARES`] writable copies of snapshot `snap` made ahead, in
    /// the background, so that a create from it takes its layer by a
    /// rename.
    pub(crate) fn keep_spares(&self, snap: String) {
        let rt = self.runtime.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = rt.keep_spares(&snap, SPARES) {
                tracing::debug!("snapshot {snap}: no spare made: {e}");
            }
        });
    }

    /// What a sandbox started from `r`'s files runs: its template's
    /// settings (as the template is now) with its own limits, environment
    /// and network policy.
    /// The record of a sandbox whose files can be captured (snapshot, fork,
    /// diff): the caller's, running or suspended, on a disk layer.
    async fn capturable(&self, caller: &Caller, id: &SandboxId) -> Result<hutch_store::SandboxRecord> {
        let r = self.record_here(caller, id, crate::control::Need::Use).await?;
        if !matches!(r.state, SandboxState::Running | SandboxState::Suspended) {
            return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
        }
        if r.storage != StorageKind::Disk {
            return Err(ControlError::SnapshotUnsupported(id.to_string()));
        }
        Ok(r)
    }

    async fn recipe_of(&self, r: &hutch_store::SandboxRecord) -> Result<SnapRecipe> {
        let tpl = self.recipe(&OwnerId::from_record(&r.owner), Some(&r.template)).await?;
        let net = NetRecord::parse(&r.network);
        Ok(SnapRecipe {
            template: tpl.name.clone(),
            template_id: r.template_id.clone(),
            template_version: r.template_version,
            image: tpl.image.clone(),
            memory_mb: r.memory_mb,
            vcpus: r.vcpus,
            disk_mib: r.disk_mib,
            pids: r.pids,
            env: serde_json::from_str(&r.env).unwrap_or_default(),
            default_ttl_s: tpl.default_ttl.as_secs(),
            max_ttl_s: tpl.max_ttl.as_secs(),
            startup: tpl.startup.clone(),
            readiness: tpl.readiness.clone(),
            network: NetworkRequest { egress: net.egress, allow: net.allow, deny: net.deny },
            on_expire: r.on_expire,
            paused_ttl_s: r.paused_ttl_s,
            class: r.class,
            memory: false,
        })
    }

    /// Captures a gvisor sandbox's layer and memory as snapshot `name`:
    /// its agent quiesces, runsc checkpoints it into the memory image
    /// `name`, the layer is captured while it is stopped, and it is
    /// restored in place (its agent connections end: the idle ones are
    /// dropped). Returns the bytes the layer references.
    async fn capture_memory(&self, id: &SandboxId, name: &str) -> Result<u64> {
        let live = self
            .live(id)
            .ok_or_else(|| ControlError::NotRunning { id: id.to_string(), state: SandboxState::Starting })?;
        let (rt, sid, snap) = (self.runtime.clone(), id.to_string(), name.to_owned());
        let l2 = live.clone();
        let taken = tokio::task::spawn_blocking(move || {
            let mut guard = l2.handle.lock().map_err(|_| ControlError::Runtime("lock poisoned".into()))?;
            if l2.is_suspended() {
                return Err(ControlError::NotRunning { id: sid, state: SandboxState::Suspended });
            }
            let Some(sb) = guard.as_mut() else {
                return Err(ControlError::NotRunning { id: sid, state: SandboxState::Terminating });
            };
            let rt2 = rt.clone();
            let size = rt
                .checkpoint_gvisor(sb, &snap, true, || rt2.snapshot_layer(&sid, &snap).map(|(_, size)| size))
                .map_err(storage_error)?;
            Ok((size, sb.pid))
        })
        .await;
        live.drop_conns();
        let (size, pid) = taken??;
        // The restored sentry is a new host process.
        let (sid, set) = (id.to_string(), crate::control::Set { host_pid: Some(i64::from(pid)), ..Default::default() });
        let running = [SandboxState::Running];
        self.db(move |s| s.transition(&sid, &running, SandboxState::Running, &set.changes())).await?;
        Ok(size)
    }

    /// Captures sandbox `id`'s layer as snapshot layer `name`, the sandbox
    /// frozen only meanwhile (a suspended one stays frozen). Returns the
    /// bytes it references.
    async fn capture(&self, id: &SandboxId, state: SandboxState, name: &str) -> Result<u64> {
        let live = self.live(id).ok_or_else(|| ControlError::NotRunning { id: id.to_string(), state })?;
        let (rt, sid, snap) = (self.runtime.clone(), id.to_string(), name.to_owned());
        tokio::task::spawn_blocking(move || {
            let guard = live.handle.lock().map_err(|_| ControlError::Runtime("lock poisoned".into()))?;
            let Some(sb) = guard.as_ref() else {
                return Err(ControlError::NotRunning { id: sid, state: SandboxState::Terminating });
            };
            let frozen_already = live.is_suspended();
            if !frozen_already {
                sb.freeze().map_err(|e| ControlError::Runtime(format!("freeze {sid}: {e}")))?;
            }
            let taken = rt.snapshot_layer(&sid, &snap);
            if !frozen_already {
                if let Err(e) = sb.thaw() {
                    tracing::error!("sandbox {sid}: cannot thaw after its snapshot: {e}");
                }
            }
            taken.map(|(_, size)| size).map_err(storage_error)
        })
        .await?
    }

    /// Starts `count` sandboxes holding sandbox `id`'s files at one
    /// instant (one freeze), each with an identity of its own (id, host
    /// name, network lease) and the parent's settings. Any refusal (a
    /// quota, the host's capacity) ends those already started: all or
    /// nothing.
    pub async fn fork(self: &Arc<Self>, caller: &Caller, id: &SandboxId, req: &Fork) -> Result<ForkResult> {
        self.fork_with(caller, id, req, crate::sandboxes::CreateOptions::default()).await
    }

    /// A fork whose children are made with `opts` (the E2B API's
    /// settings of the parent).
    pub(crate) async fn fork_with(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        req: &Fork,
        opts: crate::sandboxes::CreateOptions,
    ) -> Result<ForkResult> {
        // Children are new sandboxes of this node.
        self.refuse_if_draining().await?;
        let count = req.count.unwrap_or(1);
        if !(1..=FORK_MAX).contains(&count) {
            return Err(ControlError::Invalid(format!("count must be 1 to {FORK_MAX}")));
        }
        let r = self.capturable(caller, id).await?;
        let recipe = self.recipe_of(&r).await?.recipe();
        // The fork point: a snapshot layer with no row, deleted once every
        // child has its copy (or swept at the next start if the daemon
        // stops first).
        let point = format!("fork-{}", crate::ids::random_hex(8)?);
        // A gvisor sandbox that can be checkpointed forks with its memory:
        // each child continues its processes.
        if r.state == SandboxState::Running && memory_capable(&r).is_ok() {
            self.capture_memory(id, &point).await?;
        } else {
            self.capture(id, r.state, &point).await?;
        }
        // The children start side by side; each is admitted on its own.
        let mut starts = tokio::task::JoinSet::new();
        for i in 0..count {
            let (this, caller, recipe, point, opts) =
                (self.clone(), caller.clone(), recipe.clone(), point.clone(), opts.clone());
            starts.spawn(async move {
                let create = CreateSandbox { wait_seconds: Some(60), ..CreateSandbox::default() };
                (i, this.create_from(&caller, &create, None, recipe, Some(point), &opts).await)
            });
        }
        let mut made: Vec<(u32, Sandbox)> = Vec::new();
        let mut failed = None;
        while let Some(joined) = starts.join_next().await {
            match joined {
                Ok((i, Ok((sb, _)))) => {
                    if sb.state != SandboxState::Running && failed.is_none() {
                        failed = Some(ControlError::StartFailed(crate::lifecycle::Reason::StartRejected));
                    }
                    made.push((i, sb));
                }
                Ok((_, Err(e))) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(ControlError::Runtime(format!("fork: {e}")));
                }
            }
        }
        made.sort_by_key(|(i, _)| *i);
        let made: Vec<Sandbox> = made.into_iter().map(|(_, sb)| sb).collect();
        if failed.is_some() {
            for sb in &made {
                if let Ok(sid) = SandboxId::parse(&sb.id) {
                    let _ = self.destroy(&sid, None).await;
                }
            }
        }
        match failed {
            Some(e) => {
                let (rt, p) = (self.runtime.clone(), point.clone());
                if let Ok(Err(e)) = tokio::task::spawn_blocking(move || rt.delete_snapshot(&p)).await {
                    tracing::warn!("fork point {point}: left for the next start's sweep: {e}");
                }
                Err(e)
            }
            // The point stays while a child lives: what their diffs compare
            // against (`release_origin`).
            None => {
                let mut d = serde_json::Map::new();
                let children: Vec<serde_json::Value> = made.iter().map(|sb| sb.id.clone().into()).collect();
                d.insert("children".into(), children.into());
                self.emit(caller.owner.as_str(), crate::events::Kind::SandboxForked, Some(id.as_str()), d);
                Ok(ForkResult { sandboxes: made })
            }
        }
    }

    /// The caller's snapshots (or, for an admin key, another owner's or
    /// everyone's), newest first.
    pub async fn list_snapshots(&self, caller: &Caller, owner: Option<&str>) -> Result<SnapshotList> {
        let owners = caller.listing(owner)?;
        let filter = owners.filter().map(str::to_owned);
        let rows = self.db(move |s| s.list_snapshots(filter.as_deref())).await?;
        Ok(SnapshotList { snapshots: rows.iter().map(view).collect() })
    }

    async fn snapshot_record(&self, caller: &Caller, id: &SnapshotId) -> Result<SnapshotRecord> {
        let sid = id.to_string();
        match self.db(move |s| s.get_snapshot(&sid)).await? {
            Some(r) if caller.may_manage(&r.owner) => Ok(r),
            _ => Err(ControlError::NoSnapshot(id.to_string())),
        }
    }

    pub async fn get_snapshot(&self, caller: &Caller, id: &SnapshotId) -> Result<Snapshot> {
        Ok(view(&self.snapshot_record(caller, id).await?))
    }

    /// Deletes a snapshot: its row first, then its files (a daemon stopped
    /// in between leaves files that the next start deletes). Sandboxes
    /// started from it keep theirs.
    pub async fn delete_snapshot(&self, caller: &Caller, id: &SnapshotId) -> Result<()> {
        let r = self.snapshot_record(caller, id).await?;
        let rid = r.id.clone();
        if !self.db(move |s| s.delete_snapshot(&rid)).await? {
            return Err(ControlError::NoSnapshot(id.to_string()));
        }
        self.usage_mark_object(&r.id, None).await;
        let (rt, snap) = (self.runtime.clone(), r.id.clone());
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || rt.delete_snapshot(&snap)).await {
            tracing::warn!("snapshot {}: its files stay until the next start: {e}", r.id);
        }
        Ok(())
    }

    /// The snapshot a create names (its id or name), its owner's only, and
    /// what its sandbox runs.
    pub(crate) async fn snapshot_recipe(&self, owner: &OwnerId, reference: &str) -> Result<(String, Recipe)> {
        let o = owner.to_string();
        let found = match SnapshotId::parse(reference) {
            Ok(id) => {
                let id = id.to_string();
                self.db(move |s| s.get_snapshot(&id)).await?
            }
            Err(_) => {
                let name = reference.to_owned();
                self.db(move |s| s.snapshot_by_name(&o, &name)).await?
            }
        };
        let r = match found {
            Some(r) if r.owner == owner.as_str() => r,
            _ => return Err(ControlError::NoSnapshot(reference.chars().take(80).collect())),
        };
        let recipe: SnapRecipe = serde_json::from_str(&r.recipe)
            .map_err(|e| ControlError::Runtime(format!("snapshot {}: its stored recipe: {e}", r.id)))?;
        Ok((r.id, recipe.recipe()))
    }

    /// A fork point goes with the last of its children (called once a
    /// sandbox's layer is deleted).
    pub(crate) async fn release_origin(&self, origin: Option<String>) {
        let Some(point) = origin.filter(|o| o.starts_with("fork-")) else { return };
        let p = point.clone();
        let in_use = self.db(move |s| s.sandboxes_in(&crate::lifecycle::KEEPING_FILES)).await.map(|rows| {
            rows.iter().any(|r| r.state != SandboxState::Terminating && r.origin.as_deref() == Some(p.as_str()))
        });
        if in_use.unwrap_or(true) {
            return;
        }
        let rt = self.runtime.clone();
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || rt.delete_snapshot(&point)).await {
            tracing::warn!("a fork point stays until the next start: {e}");
        }
    }

    /// What sandbox `id` changed since it started (its snapshot's or fork
    /// point's files, else its image), or since `against`, a snapshot of
    /// its lineage (taken of it, or the one it started from).
    pub async fn diff(&self, caller: &Caller, id: &SandboxId, against: Option<&str>) -> Result<Diff> {
        let changes = self.changes(caller, id, against).await?;
        Ok(Diff {
            changes: changes
                .into_iter()
                .map(|c| Change { path: c.path, kind: c.kind.as_str().into(), size: c.size, sha256: c.sha256 })
                .collect(),
        })
    }

    /// The same changes as a tar archive: the added and modified files as
    /// they are now, and the deleted paths (NUL-terminated) in
    /// `.hutch-diff/deleted`. Streamed from a thread of its own as the
    /// client reads: the daemon holds a chunk or two whatever the sizes. An
    /// error after the first bytes breaks the stream.
    pub async fn diff_archive(
        &self,
        caller: &Caller,
        id: &SandboxId,
        against: Option<&str>,
    ) -> Result<crate::files::Chunks> {
        let changes = self.changes(caller, id, against).await?;
        let (rt, sid) = (self.runtime.clone(), id.to_string());
        let (mut w, rx) = crate::files::pipe::ChunkWriter::new();
        let done = crate::files::pipe::spawn_thread("hutch-diff-tar", move || {
            if let Err(e) = rt.diff_archive(&sid, &changes, &mut w) {
                tracing::warn!("the diff archive of {sid} ended early: {e}");
                w.fail(crate::files::FilesError::new(hutch_api::ErrorCode::Internal, "the archive ended early"));
            }
        })?;
        drop(done);
        Ok(rx)
    }

    async fn changes(
        &self,
        caller: &Caller,
        id: &SandboxId,
        against: Option<&str>,
    ) -> Result<Vec<hutch_runtime::storage::diff::Change>> {
        let r = self.capturable(caller, id).await?;
        let owner = OwnerId::from_record(&r.owner);
        let origin = match against {
            Some(reference) => {
                let (snap, _) = self.snapshot_recipe(&owner, reference).await?;
                let sid = snap.clone();
                let taken_of = self.db(move |s| s.get_snapshot(&sid)).await?.map(|s| s.sandbox_id);
                if taken_of.as_deref() != Some(id.as_str()) && r.origin.as_deref() != Some(snap.as_str()) {
                    return Err(ControlError::Invalid(format!(
                        "snapshot {snap} is neither of sandbox {id} nor the one it started from"
                    )));
                }
                Some(snap)
            }
            None => r.origin.clone(),
        };
        let tpl = self.recipe(&owner, Some(&r.template)).await?;
        let (state, image, o) = (self.runtime.config().state_dir.clone(), tpl.image.clone(), r.owner.clone());
        let root = tokio::task::spawn_blocking(move || crate::build::image_root(&state, &image, Some(&o))).await??;
        let (rt, sid) = (self.runtime.clone(), id.to_string());
        let changes = tokio::task::spawn_blocking(move || {
            // A snapshot it started from that was deleted since: against the image.
            let origin = origin.filter(|o| {
                hutch_runtime::storage::LayerName::new(hutch_runtime::storage::Kind::Snapshot, o)
                    .ok()
                    .and_then(|n| rt.storage()?.open_layer(&n).ok().flatten())
                    .is_some()
            });
            rt.diff(&sid, origin.as_deref(), &root.root, &root.layers)
        })
        .await?
        .map_err(|e| ControlError::Runtime(e.to_string()))?;
        Ok(changes)
    }

    /// Snapshot files with no row (a daemon stopped between a capture and
    /// its row, or between a row's deletion and its files') are deleted,
    /// and fork points no live sandbox started from.
    pub(crate) async fn sweep_snapshots(&self) -> Result<()> {
        let Some(storage) = self.runtime.storage().cloned() else { return Ok(()) };
        let mut keep: std::collections::HashSet<String> =
            self.db(|s| s.list_snapshots(None)).await?.into_iter().map(|r| r.id).collect();
        keep.extend(
            self.db(|s| s.sandboxes_in(&crate::lifecycle::KEEPING_FILES)).await?.into_iter().filter_map(|r| r.origin),
        );
        // Memory images: a snapshot's, a fork point's, or a paused sandbox's.
        keep.extend(self.db(|s| s.sandboxes_in(&crate::lifecycle::KEEPING_FILES)).await?.into_iter().map(|r| r.id));
        let rt = self.runtime.clone();
        let swept = tokio::task::spawn_blocking(move || {
            rt.sweep_memory(|name| keep.contains(name));
            storage.sweep(hutch_runtime::storage::Kind::Snapshot, |name| keep.contains(name))
        })
        .await?;
        if !swept.is_empty() {
            tracing::info!("deleted {} snapshots' files that had no record: {swept:?}", swept.len());
        }
        Ok(())
    }
}

/// Whether sandbox `r`'s memory can be saved: a gvisor sandbox without a
/// network namespace (runsc cannot save gVisor's hostinet, the host
/// sockets a networked gvisor sandbox uses).
pub(crate) fn memory_capable(r: &hutch_store::SandboxRecord) -> Result<()> {
    if r.class != hutch_api::Class::Gvisor {
        return Err(ControlError::ClassUnsupported(format!(
            "sandbox {} is of the {} class: only gvisor sandboxes keep their memory in a snapshot, a fork or a pause \
             to disk (the container class's keep files only)",
            r.id,
            r.class.as_str()
        )));
    }
    let net = NetRecord::parse(&r.network);
    if net.egress != hutch_api::Egress::DenyAll || net.interface {
        return Err(ControlError::ClassUnsupported(format!(
            "sandbox {} has a network: gVisor (runsc 2022-12) cannot save a sandbox on the host's network stack; \
             memory snapshots are of gvisor sandboxes with `deny_all` egress",
            r.id
        )));
    }
    Ok(())
}

fn exceeded(limit: u64, used: u64) -> ControlError {
    ControlError::Exceeded(Exceeded { scope: Scope::Owner, resource: Resource::Snapshots, limit, used, asked: 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_plain_and_never_look_like_ids() {
        for good in ["a", "best-of-3", "v1.2_x", &"a".repeat(64)] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", ".a", "A", "a b", "a/b", "snap-0123456789abcdef", &"a".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
