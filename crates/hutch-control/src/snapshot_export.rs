//! Export of a snapshot as an image archive (`GET /v1/snapshots/{id}/export`):
//! the layers of the image the snapshot's sandbox ran on, then the
//! snapshot's own files as the top layer, with the sandbox's environment,
//! working directory and startup command as the image's configuration.
//! One archive holds an OCI image layout and a `docker save` manifest over
//! the same blobs, so `hutch image import`, `docker load` and `podman load`
//! all read it (see hutch-runtime's `image/export.rs`).
//!
//! A snapshot of a sandbox on `base` (or on a template built over `base`)
//! is refused with `snapshot_not_exportable`: its lower files are the
//! host's own, not image layers, and an archive of the snapshot's files
//! alone would not run anywhere.
//!
//! The layers are measured first (on the blocking pool), so every refusal
//! is an ordinary error response and the response carries its length;
//! then a thread of its own writes the archive as the client reads it.

use crate::control::Control;
use crate::error::{ControlError, Result};
use crate::files::pipe::{spawn_thread, ChunkWriter, Chunks};
use crate::ids::{Caller, SnapshotId};
use hutch_runtime::image::export::{Export, ExportError, ExportLayer};
use hutch_runtime::image::ImageStore;
use hutch_runtime::storage::{Kind, LayerName};
use hutch_runtime::RootSource;
use hutch_store::SnapshotRecord;
use std::collections::BTreeMap;

/// A snapshot's archive on its way out.
pub struct SnapshotArchive {
    /// What to name the file (`<snapshot id>.tar`).
    pub file_name: String,
    /// Bytes of the whole archive.
    pub size: u64,
    pub chunks: Chunks,
}

/// The working directory of a sandbox whose image names none.
const DEFAULT_WORKDIR: &str = crate::files::WORKSPACE;
/// The user commands run as in a sandbox (`user`, of every image's top layer).
const SANDBOX_USER: &str = "1000:1000";

fn not_exportable(id: &str, why: impl std::fmt::Display) -> ControlError {
    ControlError::SnapshotNotExportable(format!("snapshot {id} cannot be exported: {why}"))
}

fn export_error(id: &str, e: ExportError) -> ControlError {
    match e {
        ExportError::Refused(why) => not_exportable(id, why),
        e @ (ExportError::Changed(_) | ExportError::Io { .. }) => {
            ControlError::Runtime(format!("export of snapshot {id}: {e}"))
        }
    }
}

impl Control {
    /// A snapshot the caller may export, by id or (its own) name: its
    /// owner's, or any for an admin key; others' are unknown.
    async fn exportable_record(&self, caller: &Caller, reference: &str) -> Result<SnapshotRecord> {
        let found = match SnapshotId::parse(reference) {
            Ok(id) => {
                let id = id.to_string();
                self.db(move |s| s.get_snapshot(&id)).await?
            }
            Err(_) => {
                let (o, name) = (caller.owner.to_string(), reference.to_owned());
                self.db(move |s| s.snapshot_by_name(&o, &name)).await?
            }
        };
        match found {
            Some(r) if caller.may_manage(&r.owner) => Ok(r),
            _ => Err(ControlError::NoSnapshot(reference.chars().take(80).collect())),
        }
    }

    /// Exports snapshot `reference` (an id, or a name of the caller's) as
    /// an image archive. Refusals (an image on `base`, an image no longer
    /// in the store, files an image layer cannot carry) come before the
    /// first byte; an error after it breaks the stream.
    pub async fn export_snapshot(&self, caller: &Caller, reference: &str) -> Result<SnapshotArchive> {
        let r = self.exportable_record(caller, reference).await?;
        let id = r.id.clone();
        let recipe: serde_json::Value = serde_json::from_str(&r.recipe)
            .map_err(|e| ControlError::Runtime(format!("snapshot {id}: its stored recipe: {e}")))?;
        let image = recipe["image"].as_str().unwrap_or_default().to_owned();
        if image.is_empty() || image == hutch_runtime::image::BASE {
            return Err(not_exportable(
                &id,
                "its sandbox ran on `base`, whose files are the host's own, not image layers; \
                 snapshot a sandbox whose template names a store image (hutch image list) to export it, \
                 or download the changed files with GET /v1/sandboxes/{id}/diff?format=tar",
            ));
        }
        let state = self.runtime.config().state_dir.clone();
        let (st, img, owner) = (state.clone(), image.clone(), r.owner.clone());
        let root = tokio::task::spawn_blocking(move || crate::build::image_root(&st, &img, Some(&owner)))
            .await?
            .map_err(|e| match e {
                ControlError::NoImage(_) | ControlError::ImageUnavailable(_) => {
                    not_exportable(&id, format!("its image {image:?} is no longer whole in the image store ({e})"))
                }
                e => e,
            })?;
        let mut dirs = match root.root {
            RootSource::Layers(dirs) => dirs,
            RootSource::Base => {
                return Err(not_exportable(
                    &id,
                    format!(
                        "its image {image:?} was built over `base`, whose files are the host's own, not image layers"
                    ),
                ))
            }
        };
        dirs.extend(root.layers);
        let storage = self.runtime.storage().cloned();
        let layer_name = LayerName::new(Kind::Snapshot, &id).map_err(|e| ControlError::Runtime(e.to_string()))?;
        let snapshot = tokio::task::spawn_blocking(move || storage.map(|s| s.open_layer(&layer_name)))
            .await?
            .transpose()
            .map_err(|e| ControlError::Runtime(e.to_string()))?
            .flatten()
            .ok_or_else(|| ControlError::Runtime(format!("snapshot {id}: its files are missing")))?;

        // The configuration: the image's, then what the sandbox ran with.
        let (store_img, st) = (image.clone(), state.clone());
        let stored = tokio::task::spawn_blocking(move || ImageStore::open(&st).ok()?.get(&store_img).ok()).await?;
        let mut env: Vec<(String, String)> = root.env;
        let sandbox_env: BTreeMap<String, String> = serde_json::from_value(recipe["env"].clone()).unwrap_or_default();
        for (k, v) in sandbox_env {
            env.retain(|(key, _)| *key != k);
            env.push((k, v));
        }
        let cmd = match recipe["startup"]["command"].as_str() {
            Some(c) => vec!["/bin/bash".to_owned(), "-c".to_owned(), c.to_owned()],
            None => stored.as_ref().map(|i| i.cmd.clone()).unwrap_or_default(),
        };
        let workdir = root.workdir.or_else(|| stored.as_ref().and_then(|i| i.workdir.clone()));
        let mut layers: Vec<ExportLayer> = dirs
            .into_iter()
            .map(|dir| {
                let hex = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                ExportLayer { created_by: format!("hutch image {image}: layer {hex}"), dir }
            })
            .collect();
        layers.push(ExportLayer {
            dir: snapshot.upper(),
            created_by: format!("hutch snapshot {id} of sandbox {}", r.sandbox_id),
        });
        let mut labels = BTreeMap::new();
        labels.insert("dev.hutch.snapshot".to_owned(), id.clone());
        labels.insert("dev.hutch.sandbox".to_owned(), r.sandbox_id.clone());
        labels.insert("dev.hutch.image".to_owned(), image.clone());
        if let Some(t) = recipe["template"].as_str() {
            labels.insert("dev.hutch.template".to_owned(), t.to_owned());
        }
        let export = Export {
            layers,
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            cmd,
            workdir: Some(workdir.unwrap_or_else(|| DEFAULT_WORKDIR.to_owned())),
            user: Some(SANDBOX_USER.to_owned()),
            labels,
            created: hutch_api::time::rfc3339_seconds(r.created_at),
            mtime: (r.created_at.max(0) / 1000) as u64,
            tag: format!("{id}:latest"),
        };
        let plan = tokio::task::spawn_blocking(move || export.plan()).await?.map_err(|e| export_error(&id, e))?;
        let size = plan.size();
        let (mut w, rx) = ChunkWriter::new();
        let sid = id.clone();
        let done = spawn_thread("hutch-snap-export", move || {
            if let Err(e) = plan.write(&mut w) {
                tracing::warn!("the export of snapshot {sid} ended early: {e}");
                w.fail(crate::files::FilesError::new(hutch_api::ErrorCode::Internal, "the archive ended early"));
            }
        })?;
        drop(done);
        Ok(SnapshotArchive { file_name: format!("{id}.tar"), size, chunks: rx })
    }
}
