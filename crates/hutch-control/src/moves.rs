//! Moves between the nodes of a fleet, through an OCI registry
//! (`hutch serve --registry URL`): a snapshot, and a sandbox paused to
//! disk, start on a node that does not hold their files.
//!
//! - **Pushes.** A node with a registry pushes a snapshot when it is made,
//!   and a sandbox as it pauses to disk (once its processes ended): the
//!   layers of the image it ran on, then its files as the top layer, the
//!   way a snapshot export builds them ([`hutch_runtime::image::moved`]).
//!   Pushed when made rather than when another node asks: the node that
//!   holds the files may be gone by then (a lost node is the case moves
//!   are for), and the pause or snapshot call is the one moment the files
//!   are known still. The reference (by manifest digest) goes in the
//!   store's `pushed_ref` column of the row; a pause clears the old one
//!   first, so a stale copy is never taken for the files. Files over
//!   `base` (the host's own lower files) are not pushed: they cannot move
//!   (`not_movable` where it matters).
//! - **Repositories** are named by ids only (`<prefix>/sandbox-<id>`,
//!   `<prefix>/snapshot-<id>`), random and never an owner's or a
//!   sandbox's name; nodes pull only references their store gives them,
//!   within the configured registry and prefix.
//! - **Resume elsewhere.** A resume of a sandbox paused on a node that is
//!   gone (marked `lost` or `draining`, or silent for
//!   `--node-lost-after`) takes it with one conditional
//!   update (node C → this node only if still paused, still on C and
//!   pushed: of two nodes, one wins), pulls the image (unless this node
//!   has it) and the files into its layer, and resumes it here, same id.
//! - **Creates from a snapshot** whose files this node lacks pull them
//!   first.
//! - **Drain.** A draining node gives its disk-paused sandboxes away
//!   ([`Control::move_out_paused`], each heartbeat): it pushes one not
//!   pushed yet, then hands it to an active node that runs its class and
//!   has room, with the same conditional update (here → there only if
//!   still paused, still here and pushed), and deletes its files here.
//!   The node it went to pulls them when it is resumed (as for a resume
//!   elsewhere, above). A wake is conditional on the row naming the node
//!   that wakes, so a resume here that raced the hand-over fails rather
//!   than start a sandbox whose row is another node's.
//! - **Template builds.** A successful build is pushed before it says so
//!   ([`Control::push_build`]: its image, parent layers included, under an
//!   empty top layer; `build-<id>`, the reference in the build's row). A
//!   boot on a build's image this node lacks pulls it first
//!   ([`Control::image_here`]), so placement sends creates of a pushed
//!   build anywhere.

use crate::control::{now_ms, Control, Need};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, SandboxId};
use hutch_api::SandboxState;
use hutch_runtime::image::export::Blob;
use hutch_runtime::image::export::{Export, ExportLayer};
use hutch_runtime::image::moved;
use hutch_runtime::image::push::{push, Mounts, Target};
use hutch_runtime::image::registry::PullOptions;
use hutch_runtime::image::ImageStore;
use hutch_runtime::storage::{Kind, LayerName, StorageError};
use hutch_store::{NodeState, Pushed, SandboxRecord, SnapshotRecord};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// One pull at a time per node: two creates from one snapshot pull once.
static PULLS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One pass of a drain's moves at a time per node (heartbeats come faster
/// than a push may take).
static MOVING_OUT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Where this daemon pushed blobs, to mount them into the next repository.
static MOUNTS: std::sync::LazyLock<Mounts> = std::sync::LazyLock::new(Mounts::default);

/// Most image layers whose measure is kept.
const MEASURED_KEPT: usize = 4096;

/// The blobs of image store layers measured for a push (they never
/// change), so the next push of the image reads none of them.
static MEASURED: std::sync::LazyLock<Mutex<HashMap<PathBuf, Blob>>> = std::sync::LazyLock::new(Default::default);

fn not_movable(what: &str, why: impl std::fmt::Display) -> ControlError {
    ControlError::NotMovable(format!("{what} cannot start on another node: {why}"))
}

impl Control {
    /// The image of `owner`'s files at `upper` over image `image`, ready to
    /// push; None when they cannot move (an image over `base`).
    async fn moving_plan(
        &self,
        owner: &str,
        image: &str,
        upper: PathBuf,
        created_by: String,
        created_at: i64,
    ) -> Result<Option<hutch_runtime::image::export::Plan>> {
        let (state, img, o) = (self.runtime.config().state_dir.clone(), image.to_owned(), owner.to_owned());
        tokio::task::spawn_blocking(move || {
            let store = ImageStore::open(&state).map_err(ControlError::Image)?;
            let Some(leaving) = moved::leaving(&store, &img, &o).map_err(ControlError::Image)? else { return Ok(None) };
            let image_dirs = leaving.dirs.clone();
            let mut layers: Vec<ExportLayer> = leaving
                .dirs
                .into_iter()
                .map(|dir| ExportLayer { created_by: format!("hutch image {img}"), dir })
                .collect();
            layers.push(ExportLayer { dir: upper, created_by });
            let export = Export {
                layers,
                env: leaving.config.env,
                cmd: leaving.config.cmd,
                workdir: leaving.config.workdir,
                user: None,
                labels: leaving.labels,
                created: hutch_api::time::rfc3339_seconds(created_at),
                mtime: (created_at.max(0) / 1000) as u64,
                tag: "moved:latest".into(),
            };
            let known = |dir: &std::path::Path| {
                let kept = MEASURED.lock().ok()?;
                image_dirs.iter().any(|d| d == dir).then(|| kept.get(dir).cloned()).flatten()
            };
            let plan =
                export.plan_with(&known).map_err(|e| ControlError::Runtime(format!("the files to push: {e}")))?;
            if let Ok(mut kept) = MEASURED.lock() {
                if kept.len() + image_dirs.len() > MEASURED_KEPT {
                    kept.clear();
                }
                for (dir, blob) in plan.layers().iter().filter(|(d, _)| image_dirs.contains(d)) {
                    kept.insert(dir.clone(), blob.clone());
                }
            }
            Ok(Some(plan))
        })
        .await?
    }

    /// Pushes `object` `id`'s files at `upper` (over image `image`, of
    /// `owner`) to `target` as repository `<object>-<id>`, and records the
    /// reference; None when they cannot move (an image over `base`).
    #[allow(clippy::too_many_arguments)]
    async fn push_files(
        &self,
        target: &Target,
        object: Pushed,
        id: &str,
        owner: &str,
        image: &str,
        upper: PathBuf,
        created_by: String,
        created_at: i64,
    ) -> Result<Option<String>> {
        let Some(plan) = self.moving_plan(owner, image, upper, created_by, created_at).await? else {
            return Ok(None);
        };
        let repository = match object {
            Pushed::Sandbox => format!("sandbox-{id}"),
            Pushed::Snapshot => format!("snapshot-{id}"),
            Pushed::Build => format!("build-{id}"),
        };
        let reference = self.push_plan(target, repository, plan).await?;
        let (id, rf) = (id.to_owned(), reference.clone());
        self.db(move |s| s.set_pushed(object, &id, Some(&rf))).await?;
        Ok(Some(reference))
    }

    /// Pushes `plan` as repository `name`; its reference.
    async fn push_plan(
        &self,
        target: &Target,
        name: String,
        plan: hutch_runtime::image::export::Plan,
    ) -> Result<String> {
        let target = target.clone();
        let pushed = tokio::task::spawn_blocking(move || push(&target, &name, &plan, &MOUNTS))
            .await?
            .map_err(ControlError::Image)?;
        tracing::debug!(
            "pushed {}: {} blobs there, {} mounted, {} uploaded",
            pushed.reference,
            pushed.had,
            pushed.mounted,
            pushed.uploaded
        );
        Ok(pushed.reference)
    }

    /// The image a sandbox's template runs on.
    async fn image_of(&self, r: &SandboxRecord) -> Result<String> {
        let owner = crate::ids::OwnerId::from_record(&r.owner);
        let recipe = match r.origin.as_deref().filter(|o| o.starts_with("snap-")) {
            Some(snap) => match self.snapshot_recipe(&owner, snap).await {
                Ok((_, recipe)) => recipe,
                Err(_) => self.recipe(&owner, Some(&r.template)).await?,
            },
            None => self.recipe(&owner, Some(&r.template)).await?,
        };
        Ok(recipe.image)
    }

    /// Before a pause to disk: forgets the sandbox's last push (its files
    /// changed since it ran again), so that no node takes it for them,
    /// even if this daemon stops before the new push.
    pub(crate) async fn forget_push(&self, id: &SandboxId) -> Result<()> {
        if self.registry.is_none() {
            return Ok(());
        }
        let sid = id.to_string();
        self.db(move |s| s.set_pushed(Pushed::Sandbox, &sid, None)).await?;
        Ok(())
    }

    /// After a pause to disk: pushes the sandbox's files. A failure is
    /// logged: the sandbox stays paused here, and cannot start elsewhere.
    pub(crate) async fn push_paused(&self, id: &SandboxId) {
        let Some(target) = self.registry.clone() else { return };
        let pushed = async {
            let Some(r) = self.sandbox_record(id).await? else { return Ok(None) };
            let image = self.image_of(&r).await?;
            let Some(layer) = self.runtime.layer_of(id.as_str()).map_err(|e| ControlError::Runtime(e.to_string()))?
            else {
                return Ok(None);
            };
            let by = format!("hutch sandbox {id} paused");
            self.push_files(&target, Pushed::Sandbox, id.as_str(), &r.owner, &image, layer.upper(), by, now_ms()).await
        }
        .await;
        match pushed {
            Ok(Some(reference)) => tracing::info!("sandbox {id}: paused and pushed as {reference}"),
            Ok(None) => tracing::debug!("sandbox {id}: paused on `base` (or without its layer): not pushed"),
            Err(e) => tracing::warn!("sandbox {id}: paused, but its push failed (it cannot start elsewhere): {e}"),
        }
    }

    /// After a snapshot is made: pushes it. A failure is logged: the
    /// snapshot stays usable on this node.
    pub(crate) async fn push_snapshot(&self, record: &SnapshotRecord) {
        let Some(target) = self.registry.clone() else { return };
        let id = record.id.clone();
        let pushed = async {
            let recipe: serde_json::Value = serde_json::from_str(&record.recipe)
                .map_err(|e| ControlError::Runtime(format!("its stored recipe: {e}")))?;
            let image = recipe["image"].as_str().unwrap_or_default().to_owned();
            let name = LayerName::new(Kind::Snapshot, &id).map_err(|e| ControlError::Runtime(e.to_string()))?;
            let Some(layer) = self.runtime.storage().and_then(|s| s.open_layer(&name).ok().flatten()) else {
                return Ok(None);
            };
            let by = format!("hutch snapshot {id} of sandbox {}", record.sandbox_id);
            let (owner, at) = (&record.owner, record.created_at);
            self.push_files(&target, Pushed::Snapshot, &id, owner, &image, layer.upper(), by, at).await
        }
        .await;
        match pushed {
            Ok(Some(reference)) => tracing::info!("snapshot {id}: pushed as {reference}"),
            Ok(None) => tracing::debug!("snapshot {id}: of a sandbox on `base`: not pushed"),
            Err(e) => tracing::warn!("snapshot {id}: its push failed (it starts on this node only): {e}"),
        }
    }

    /// After a template build succeeds, before it says so: pushes its image
    /// (as a moved image with an empty top layer), so that any node starts
    /// its sandboxes. The reference, None without a registry or for a
    /// build over `base` (the host's own files: its sandboxes start on
    /// this node only). A failure is the caller's to report; the build
    /// stands.
    pub(crate) async fn push_build(&self, build_id: &str, owner: &str, image: &str) -> Result<Option<String>> {
        let Some(target) = self.registry.clone() else { return Ok(None) };
        let store = self.images()?;
        let empty = tokio::task::spawn_blocking(move || store.temp_dir()).await?.map_err(ControlError::Image)?;
        let by = format!("hutch build {build_id}");
        let pushed = self.push_files(&target, Pushed::Build, build_id, owner, image, empty.clone(), by, now_ms()).await;
        // Empty, and nothing else writes there: a quick remove.
        if let Err(e) = std::fs::remove_dir(&empty) {
            tracing::debug!("{}: {e}", empty.display());
        }
        pushed
    }

    /// Where the build of template `template` that made `image` was pushed,
    /// and the build's owner (None: no registry here, not a build's image,
    /// or not pushed).
    pub(crate) async fn build_pushed(&self, template: Option<&str>, image: &str) -> Result<Option<(String, String)>> {
        let Some(template) = template.filter(|_| self.registry.is_some()) else { return Ok(None) };
        let (t, img) = (template.to_owned(), image.to_owned());
        self.db(move |s| {
            let builds = s.list_builds(&t)?;
            let Some(b) = builds.into_iter().find(|b| b.image.as_deref() == Some(img.as_str())) else {
                return Ok(None);
            };
            Ok(s.pushed(Pushed::Build, &b.id)?.map(|reference| (reference, b.owner)))
        })
        .await
    }

    /// Before a boot on `recipe` for `owner`: a template build's image that
    /// this node lacks is pulled from the fleet's registry when its build
    /// was pushed. Anything else is left to the boot, which says what is
    /// missing in its own words.
    pub(crate) async fn image_here(&self, recipe: &crate::templates::Recipe) -> Result<()> {
        let image = recipe.image.as_str();
        if self.registry.is_none() || image == "base" || hutch_runtime::image::debian::is_preset(image) {
            return Ok(());
        }
        let store = self.images()?;
        let img = image.to_owned();
        let have = tokio::task::spawn_blocking(move || match store.get(&img) {
            Ok(_) => Ok(true),
            Err(hutch_runtime::image::ImageError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        })
        .await?
        .map_err(ControlError::Image)?;
        if have {
            return Ok(());
        }
        // The build's image is its owner's, as where it was built.
        let Some((reference, owner)) = self.build_pushed(recipe.id.as_deref(), image).await? else {
            return Ok(());
        };
        let Some(target) = self.registry.clone() else { return Ok(()) };
        if !target.holds(&reference) {
            return Err(ControlError::Runtime(format!(
                "image {image}: the store names {reference}, not in this node's registry"
            )));
        }
        let store = self.images()?;
        let _one = PULLS.lock().await;
        tokio::task::spawn_blocking(move || {
            let opts = PullOptions { insecure: target.insecure, ..PullOptions::default() };
            // Its top layer is empty: pulled into a directory thrown away.
            let top = store.temp_dir()?;
            let pulled = moved::pull_moved(&store, &reference, &opts, &owner, &top);
            let _ = std::fs::remove_dir_all(&top);
            pulled
        })
        .await?
        .map_err(ControlError::Image)?;
        tracing::info!("image {image}: pulled from the fleet's registry");
        Ok(())
    }

    /// Whether node `name` is gone: marked lost or draining, unknown, or
    /// silent for `--node-lost-after` (it is about to be declared lost).
    async fn node_gone(&self, name: &str) -> Result<bool> {
        let nodes = self.db(|s| s.list_nodes()).await?;
        let silent_ms = self.node.lost_after.as_millis() as i64;
        Ok(match nodes.iter().find(|n| n.name == name) {
            None => true,
            Some(n) => n.state != NodeState::Active || now_ms() - n.heartbeat_at > silent_ms,
        })
    }

    /// Pulls `reference` (owner `owner`'s files) into storage layer
    /// `name`, made here; on an error nothing of it stays.
    async fn pull_layer(&self, reference: String, owner: String, name: LayerName) -> Result<()> {
        let Some(target) = self.registry.clone() else {
            return Err(not_movable(name.id(), "this node has no registry (hutch serve --registry)"));
        };
        if !target.holds(&reference) {
            return Err(ControlError::Runtime(format!(
                "{}: the store names {reference}, not in this node's registry",
                name.id()
            )));
        }
        let storage = self
            .runtime
            .storage()
            .cloned()
            .ok_or_else(|| not_movable(name.id(), "this node has no disk storage for sandboxes' files"))?;
        let state = self.runtime.config().state_dir.clone();
        let _one = PULLS.lock().await;
        tokio::task::spawn_blocking(move || {
            if storage.open_layer(&name).map_err(|e| ControlError::Runtime(e.to_string()))?.is_some() {
                return Ok(());
            }
            let store = ImageStore::open(&state).map_err(ControlError::Image)?;
            let opts = PullOptions { insecure: target.insecure, ..PullOptions::default() };
            // Made under a name of its own, then given its name: a layer
            // under its name is whole.
            let tmp = LayerName::new(Kind::Sandbox, &format!("pull-{}", crate::ids::random_hex(8)?))
                .map_err(|e| ControlError::Runtime(e.to_string()))?;
            let layer = storage.create(&tmp, &[]).map_err(|e| ControlError::Runtime(e.to_string()))?;
            let pulled = moved::pull_moved(&store, &reference, &opts, &owner, &layer.upper());
            let placed = match pulled {
                Ok(_) => match storage.snapshot(&layer, &name, name.kind() == Kind::Snapshot) {
                    Ok(_) | Err(StorageError::Exists(_)) => Ok(()),
                    Err(e) => Err(ControlError::Runtime(e.to_string())),
                },
                Err(e) => Err(ControlError::Image(e)),
            };
            if let Err(e) = storage.delete(&tmp) {
                tracing::warn!("{tmp}: left for the next start's sweep: {e}");
            }
            placed
        })
        .await?
    }

    /// Before a create from snapshot `snap` (a reference its caller may
    /// use, resolved): pulls its files if this node lacks them.
    pub(crate) async fn snapshot_here(&self, snap: &str) -> Result<()> {
        let name = LayerName::new(Kind::Snapshot, snap).map_err(|e| ControlError::Runtime(e.to_string()))?;
        let Some(storage) = self.runtime.storage() else { return Ok(()) };
        if storage.open_layer(&name).map_err(|e| ControlError::Runtime(e.to_string()))?.is_some() {
            return Ok(());
        }
        let sid = snap.to_owned();
        let Some(r) = self.db(move |s| s.get_snapshot(&sid)).await? else { return Ok(()) };
        let sid = snap.to_owned();
        let Some(reference) = self.db(move |s| s.pushed(Pushed::Snapshot, &sid)).await? else {
            return Err(not_movable(
                &format!("snapshot {snap}"),
                "its files are on the node it was taken on and were not pushed to the fleet's registry \
                 (its sandbox ran on `base`, whose files are the host's own; or that node has no registry, \
                 or its push failed: see that node's log)",
            ));
        };
        self.pull_layer(reference, r.owner, name).await
    }

    /// While this node drains (each heartbeat, see `fleet`): its sandboxes
    /// paused to disk go to other nodes. One not pushed yet is pushed
    /// first (paused before this node had a registry, or its push failed);
    /// one pushed is given to an active node that runs its class and has
    /// room, and its files here are deleted. What cannot move (on `base`,
    /// with volumes, no registry, no node to take it) stays here and keeps
    /// the node from being drained. How many moved.
    pub(crate) async fn move_out_paused(self: &Arc<Self>) -> Result<usize> {
        let Ok(_one) = MOVING_OUT.try_lock() else { return Ok(0) };
        if self.registry.is_none() {
            return Ok(0);
        }
        let me = self.node.name.clone();
        let paused = self.db(move |s| s.sandboxes_on(Some(&me), &[SandboxState::Paused])).await?;
        let mut moved = 0;
        for r in paused {
            let id = SandboxId::from_record(&r.id);
            // A pause under way pushes it itself; a sandbox with volumes
            // keeps them here.
            if self.pausing.lock().unwrap_or_else(|p| p.into_inner()).contains_key(id.as_str())
                || !self.volume_mounts_of(&r.id).await?.is_empty()
            {
                continue;
            }
            let sid = r.id.clone();
            if self.db(move |s| s.pushed(Pushed::Sandbox, &sid)).await?.is_none() {
                self.push_paused(&id).await;
            }
            let Some(to) = self.place_moved(r.class.as_str()).await else {
                tracing::debug!("sandbox {id}: no active node takes it now; it stays paused here");
                continue;
            };
            let (sid, from, there) = (r.id.clone(), r.node.clone(), to.clone());
            // Not pushed (on `base`, or its push failed), or it changed meanwhile.
            if !self.db(move |s| s.move_paused(&sid, &from, &there)).await? {
                continue;
            }
            tracing::info!("sandbox {id}: given to node {to} as node {} drains", self.node.name);
            self.log(
                &id,
                crate::history::LogLevel::Info,
                format!("moved from node {} (draining) to node {to}", self.node.name),
                &[("from", self.node.name.clone()), ("to", to.clone())],
            );
            // Its files here are no longer its: node `to` pulls them.
            if let Err(e) = self.teardown_host(&id).await {
                tracing::warn!("sandbox {id}: moved, but its files here stay until the next start's sweep: {e}");
            }
            moved += 1;
        }
        Ok(moved)
    }

    /// Before a resume: a sandbox paused to disk on a node that is gone is
    /// taken by this node and its files pulled (then the resume goes on as
    /// for any paused sandbox of this node); so is one taken earlier whose
    /// pull did not finish. Anything else is left to the resume.
    pub(crate) async fn adopt_paused(self: &Arc<Self>, caller: &Caller, id: &SandboxId) -> Result<()> {
        let r = self.record(caller, id, Need::Manage).await?;
        if r.state != SandboxState::Paused {
            return Ok(());
        }
        let here = r.node == self.node.name;
        if here && self.runtime.layer_of(id.as_str()).map_err(|e| ControlError::Runtime(e.to_string()))?.is_some() {
            return Ok(());
        }
        if !here && !self.node_gone(&r.node).await? {
            return Ok(());
        }
        let what = format!("sandbox {id}");
        let sid = id.to_string();
        let Some(reference) = self.db(move |s| s.pushed(Pushed::Sandbox, &sid)).await? else {
            if here {
                return Ok(());
            }
            return Err(not_movable(
                &what,
                format!(
                    "it was paused on node {:?}, which is gone, and its files were not pushed to the fleet's \
                     registry (it runs on `base`, whose files are the host's own; or that node has no \
                     registry, or its push failed: see that node's log)",
                    r.node
                ),
            ));
        };
        if self.registry.is_none() {
            return Err(not_movable(&what, "this node has no registry (hutch serve --registry)"));
        }
        if !self.volume_mounts_of(&r.id).await?.is_empty() {
            return Err(not_movable(&what, "it mounts volumes, whose files stay on their node"));
        }
        if !here {
            let (sid, from, to) = (id.to_string(), r.node.clone(), self.node.name.clone());
            if !self.db(move |s| s.move_paused(&sid, &from, &to)).await? {
                // Another node took it, or it changed: the resume says where it is.
                return Ok(());
            }
            tracing::info!("sandbox {id}: taken from node {:?}, which is gone", r.node);
            self.log(
                id,
                crate::history::LogLevel::Info,
                format!("moved from node {} (gone) to node {}", r.node, self.node.name),
                &[("from", r.node.clone()), ("to", self.node.name.clone())],
            );
        }
        let name = LayerName::sandbox(id.as_str()).map_err(|e| ControlError::Runtime(e.to_string()))?;
        self.pull_layer(reference, r.owner.clone(), name).await
    }
}
