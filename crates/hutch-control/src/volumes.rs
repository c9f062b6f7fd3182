//! Volumes: files that outlive sandboxes, kept in the daemon's disk
//! storage as a btrfs subvolume (`storage/fs/volumes/<id>`) whose quota
//! group limit is the volume's size, owned by the key that made it and
//! counted toward its `disk_mib` quota. A sandbox mounts volumes at its
//! creation (`"volumes"` of `POST /v1/sandboxes`), id-mapped like its own
//! layer, at paths under `/workspace`, `/home/user`, `/mnt` or `/data`.
//!
//! Claims: a sandbox's mounts are rows of the store (`volume_mounts`),
//! written in the transaction that inserts the sandbox; a claim holds while
//! its sandbox has not ended (paused ones included, which mount again on
//! resume), so an end recorded by anyone (a delete, an expiry, the
//! recovery after a restart) releases it with no write of its own. A
//! read-write claim excludes every other; read-only claims share.
//!
//! Crash safety: as for snapshots, the subvolume is whole before its row
//! is written and the row goes before the subvolume; a subvolume with no
//! row is deleted at the next start.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, VolumeId};
use hutch_api::{CreateVolume, UpdateVolume, Volume, VolumeHolder, VolumeList, VolumeMount};
use hutch_store::{StoreError, VolumeAdmitted, VolumeClaim, VolumeDeleted, VolumeRecord};

/// Size of a volume made with none given (the E2B API gives none).
pub const DEFAULT_MIB: u64 = 1024;
/// The largest volume: 1 TiB.
pub const MAX_MIB: u64 = 1 << 20;
/// Most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 16;
/// Where volumes may be mounted: these directories or under them. None is
/// a directory an image's system lives in.
pub const MOUNT_ROOTS: &[&str] = &["/workspace", "/home/user", "/mnt", "/data"];

/// A volume's name: 1 to 64 of `a-z 0-9 - _ .`, not starting with `.`,
/// `-` or `vol-` (ids and names are looked up in one field).
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && !name.starts_with("vol-")
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ControlError::Invalid(
            "a volume's name is 1 to 64 of a-z, 0-9, '-', '_' and '.', not starting with '.', '-' or 'vol-'".into(),
        ))
    }
}

fn check_size(size_mib: u64) -> Result<()> {
    if (1..=MAX_MIB).contains(&size_mib) {
        Ok(())
    } else {
        Err(ControlError::Invalid(format!("size_mib must be 1 to {MAX_MIB}")))
    }
}

/// A mount path, normalized (repeated and trailing slashes and `.`
/// dropped): absolute, with no `..`, at or under one of [`MOUNT_ROOTS`].
pub fn check_path(path: &str) -> Result<String> {
    let bad = |why: &str| {
        // The path as quoted, cut to 160 bytes: a hostile one cannot fill a log.
        let mut shown = String::new();
        for c in format!("{path:?}").chars() {
            if shown.len() + c.len_utf8() > 160 {
                shown.push('…');
                break;
            }
            shown.push(c);
        }
        ControlError::VolumePathInvalid(format!(
            "volume path {shown}: {why}; mount volumes at or under {}",
            MOUNT_ROOTS.join(", ")
        ))
    };
    if !path.starts_with('/') {
        return Err(bad("not absolute"));
    }
    if path.len() > 1024 || path.chars().any(|c| c.is_control()) {
        return Err(bad("too long, or holds control characters"));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(bad("'..' is not allowed")),
            p if p.len() > 255 => return Err(bad("a component is longer than 255 bytes")),
            p => parts.push(p),
        }
    }
    let normal = format!("/{}", parts.join("/"));
    let allowed = MOUNT_ROOTS.iter().any(|root| normal == *root || normal.starts_with(&format!("{root}/")));
    if !allowed {
        return Err(bad("outside the places volumes go"));
    }
    Ok(normal)
}

/// Whether one path is the other or under it.
fn nested(a: &str, b: &str) -> bool {
    a == b || a.starts_with(&format!("{b}/")) || b.starts_with(&format!("{a}/"))
}

/// A create's mounts, checked: each path valid, none at or under another,
/// no volume twice. Returns (reference, normalized path, read-only).
pub fn check_mounts(mounts: &[VolumeMount]) -> Result<Vec<(String, String, bool)>> {
    if mounts.len() > MAX_MOUNTS {
        return Err(ControlError::Invalid(format!("a sandbox mounts at most {MAX_MOUNTS} volumes")));
    }
    let mut out: Vec<(String, String, bool)> = Vec::with_capacity(mounts.len());
    for m in mounts {
        let path = check_path(&m.path)?;
        if let Some((_, other, _)) = out.iter().find(|(_, p, _)| nested(p, &path)) {
            return Err(ControlError::VolumePathInvalid(format!(
                "volume paths {other} and {path} overlap: mount each volume at a place of its own"
            )));
        }
        if out.iter().any(|(r, _, _)| *r == m.name) {
            return Err(ControlError::Invalid(format!("volume {:?} is named twice", m.name)));
        }
        out.push((m.name.clone(), path, m.read_only));
    }
    Ok(out)
}

impl Control {
    fn volume_storage(&self) -> Result<()> {
        match self.runtime.storage() {
            Some(_) => Ok(()),
            None => Err(ControlError::FeatureUnavailable(
                "volumes need disk storage, which is not available on this host (see `hutch doctor`)".into(),
            )),
        }
    }

    /// A volume as the API shows it. Its usage is read from its files,
    /// which only its node has: 0 for a volume of another node (a route of
    /// one volume is answered by its node, see `fleet`; a listing is not).
    async fn view_volume(&self, r: &VolumeRecord) -> Result<Volume> {
        let (rt, id) = (self.runtime.clone(), r.id.clone());
        let used = if r.node == self.node.name {
            tokio::task::spawn_blocking(move || rt.volume_used(&id)).await?.unwrap_or_else(|e| {
                tracing::warn!("volume {}: its usage: {e}", r.id);
                0
            })
        } else {
            0
        };
        let id = r.id.clone();
        let holders = self.db(move |s| s.volume_holders(&id)).await?;
        Ok(Volume {
            id: r.id.clone(),
            name: r.name.clone(),
            size_mib: r.size_mib,
            used_bytes: used,
            mounted_by: holders
                .into_iter()
                .map(|c| VolumeHolder { sandbox_id: c.sandbox_id, path: c.path, read_only: c.read_only })
                .collect(),
            created_at: rfc3339(r.created_at),
            owner: r.owner.clone(),
        })
    }

    /// Makes a volume: its subvolume first (limited to its size), then its
    /// row; a refused row (a quota, a name taken meanwhile) deletes the
    /// subvolume again.
    pub async fn create_volume(&self, caller: &Caller, req: &CreateVolume) -> Result<Volume> {
        check_name(&req.name)?;
        let size_mib = req.size_mib.unwrap_or(DEFAULT_MIB);
        check_size(size_mib)?;
        self.volume_storage()?;
        let owner = caller.owner.clone();
        let admission = self.admission(self.quotas_of(&owner).await?, 0, size_mib)?;
        let (o, name) = (owner.to_string(), req.name.clone());
        if self.db(move |s| s.volume_by_name(&o, &name)).await?.is_some() {
            return Err(ControlError::VolumeNameTaken(req.name.clone()));
        }
        let id = VolumeId::random()?;
        let (rt, vid) = (self.runtime.clone(), id.to_string());
        tokio::task::spawn_blocking(move || rt.create_volume(&vid, size_mib << 20))
            .await?
            .map_err(crate::snapshots::storage_error)?;
        let record = VolumeRecord {
            id: id.to_string(),
            owner: owner.to_string(),
            name: req.name.clone(),
            size_mib,
            created_at: now_ms(),
            node: self.node.name.clone(),
        };
        let rec = record.clone();
        let refusal = match self.db(move |s| s.insert_volume(&rec, &admission)).await {
            Ok(VolumeAdmitted::Written) => {
                self.usage_mark_object(&record.id, Some(crate::usage::volume_interval(&record))).await;
                return self.view_volume(&record).await;
            }
            Ok(VolumeAdmitted::Refused(e)) => self.refused(owner.as_str(), e),
            Err(ControlError::Store(StoreError::Conflict)) => ControlError::VolumeNameTaken(req.name.clone()),
            Err(e) => e,
        };
        // Nothing of a refused volume stays.
        let (rt, vid) = (self.runtime.clone(), id.to_string());
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || rt.delete_volume(&vid)).await {
            tracing::warn!("volume {id}: left for the next start's sweep: {e}");
        }
        Err(refusal)
    }

    /// The caller's volumes (or, for an admin key, another owner's or
    /// everyone's), oldest first.
    pub async fn list_volumes(&self, caller: &Caller, owner: Option<&str>) -> Result<VolumeList> {
        let owners = caller.listing(owner)?;
        let filter = owners.filter().map(str::to_owned);
        let rows = self.db(move |s| s.list_volumes(filter.as_deref())).await?;
        let mut volumes = Vec::with_capacity(rows.len());
        for r in &rows {
            volumes.push(self.view_volume(r).await?);
        }
        Ok(VolumeList { volumes })
    }

    /// A volume by id (the caller's, or any for an admin) or by name (the
    /// caller's own); anything else is `volume_not_found`.
    async fn volume_record(&self, caller: &Caller, reference: &str) -> Result<VolumeRecord> {
        let found = match VolumeId::parse(reference) {
            Ok(id) => {
                let id = id.to_string();
                self.db(move |s| s.get_volume(&id)).await?.filter(|r| caller.may_manage(&r.owner))
            }
            Err(_) => {
                let (o, name) = (caller.owner.to_string(), reference.to_owned());
                self.db(move |s| s.volume_by_name(&o, &name)).await?
            }
        };
        found.ok_or_else(|| ControlError::NoVolume(reference.chars().take(80).collect()))
    }

    /// Where the calls for volume `reference` (by id, or `caller`'s by
    /// name) are answered: at the node whose disk holds its files, when
    /// that node answers; else here (unknown volumes, a node lost or
    /// silent: this node says what it can).
    pub async fn locate_volume(&self, caller: &Caller, reference: &str) -> crate::nodes::Route {
        match self.volume_record(caller, reference).await {
            Ok(r) if r.node != self.node.name => self.route_to(&r.node).await,
            _ => crate::nodes::Route::Here,
        }
    }

    pub async fn get_volume(&self, caller: &Caller, reference: &str) -> Result<Volume> {
        let r = self.volume_record(caller, reference).await?;
        self.view_volume(&r).await
    }

    /// Grows a volume (its row, checked against the quotas, then its
    /// limit); a smaller size is refused, the same size changes nothing.
    pub async fn resize_volume(&self, caller: &Caller, reference: &str, req: &UpdateVolume) -> Result<Volume> {
        let r = self.volume_record(caller, reference).await?;
        let Some(size_mib) = req.size_mib else {
            return Err(ControlError::Invalid("give size_mib".into()));
        };
        check_size(size_mib)?;
        if size_mib < r.size_mib {
            return Err(ControlError::VolumeShrink { name: r.name.clone(), size_mib: r.size_mib });
        }
        if size_mib == r.size_mib {
            return self.view_volume(&r).await;
        }
        let admission = self.admission(self.quotas_of(&OwnerId::from_record(&r.owner)).await?, 0, size_mib)?;
        let id = r.id.clone();
        match self.db(move |s| s.resize_volume(&id, size_mib, &admission)).await? {
            Some(VolumeAdmitted::Written) => {}
            Some(VolumeAdmitted::Refused(e)) => return Err(self.refused(&r.owner, e)),
            None => return Err(ControlError::NoVolume(reference.chars().take(80).collect())),
        }
        let (rt, id) = (self.runtime.clone(), r.id.clone());
        if let Err(e) = tokio::task::spawn_blocking(move || rt.resize_volume(&id, size_mib << 20)).await? {
            // The row goes back to the size the files are held to.
            let (id, old) = (r.id.clone(), r.size_mib);
            let _ = self.db(move |s| s.resize_volume(&id, old, &hutch_store::Admission::default())).await;
            return Err(crate::snapshots::storage_error(e));
        }
        let r = VolumeRecord { size_mib, ..r };
        self.usage_mark_object(&r.id, Some(crate::usage::volume_interval(&r))).await;
        self.view_volume(&r).await
    }

    /// Deletes a volume that no sandbox holds (409 `volume_in_use`
    /// otherwise, paused sandboxes included): its row, then its files.
    pub async fn delete_volume(&self, caller: &Caller, reference: &str) -> Result<()> {
        let r = self.volume_record(caller, reference).await?;
        let id = r.id.clone();
        match self.db(move |s| s.delete_volume(&id)).await? {
            VolumeDeleted::Deleted => self.usage_mark_object(&r.id, None).await,
            VolumeDeleted::NotFound => return Err(ControlError::NoVolume(reference.chars().take(80).collect())),
            VolumeDeleted::InUse(sb) => {
                return Err(ControlError::VolumeInUse(format!(
                    "volume {} is mounted by sandbox {sb}; delete that sandbox first",
                    r.name
                )))
            }
        }
        let (rt, id) = (self.runtime.clone(), r.id.clone());
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || rt.delete_volume(&id)).await {
            tracing::warn!("volume {}: its files stay until the next start: {e}", r.id);
        }
        Ok(())
    }

    /// The claims a create asks for, for sandbox `sandbox_id` of `owner`:
    /// paths checked, each volume the owner's own (by id or name; another
    /// owner's is `volume_not_found`, admin or not).
    pub(crate) async fn volume_claims_for(
        &self,
        owner: &OwnerId,
        sandbox_id: &str,
        mounts: &[VolumeMount],
    ) -> Result<Vec<VolumeClaim>> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let checked = check_mounts(mounts)?;
        self.volume_storage()?;
        let mut claims: Vec<VolumeClaim> = Vec::with_capacity(checked.len());
        for (reference, path, read_only) in checked {
            let o = owner.to_string();
            let r = reference.clone();
            let found = match VolumeId::parse(&reference) {
                Ok(id) => {
                    let id = id.to_string();
                    self.db(move |s| s.get_volume(&id)).await?.filter(|v| v.owner == o)
                }
                Err(_) => self.db(move |s| s.volume_by_name(&o, &r)).await?,
            };
            let v = found.ok_or_else(|| ControlError::NoVolume(reference.chars().take(80).collect()))?;
            if claims.iter().any(|c| c.volume_id == v.id) {
                return Err(ControlError::Invalid(format!("volume {:?} is named twice", v.name)));
            }
            claims.push(VolumeClaim { volume_id: v.id, sandbox_id: sandbox_id.to_owned(), path, read_only });
        }
        Ok(claims)
    }

    /// What a sandbox mounts, from its claims: for its (re)start.
    pub(crate) async fn volume_mounts_of(&self, sandbox_id: &str) -> Result<Vec<hutch_runtime::rootfs::VolumeMount>> {
        let sid = sandbox_id.to_owned();
        let claims = self.db(move |s| s.volume_claims(&sid)).await?;
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let rt = self.runtime.clone();
        tokio::task::spawn_blocking(move || {
            claims
                .into_iter()
                .map(|c| {
                    let source = rt
                        .volume_mount_source(&c.volume_id)
                        .map_err(|e| ControlError::Runtime(format!("volume {}: {e}", c.volume_id)))?;
                    Ok(hutch_runtime::rootfs::VolumeMount { source, target: c.path, read_only: c.read_only })
                })
                .collect()
        })
        .await?
    }

    /// A sandbox's view with the volumes it mounts (by name).
    pub(crate) async fn with_volumes(&self, mut sb: hutch_api::Sandbox) -> Result<hutch_api::Sandbox> {
        let sid = sb.id.clone();
        let claims = self.db(move |s| s.volume_claims(&sid)).await?;
        for c in claims {
            let vid = c.volume_id.clone();
            let name = self.db(move |s| s.get_volume(&vid)).await?.map_or(c.volume_id, |v| v.name);
            sb.volumes.push(VolumeMount { name, path: c.path, read_only: c.read_only });
        }
        Ok(sb)
    }

    /// The refusal of a create whose read-write claim met another claim.
    pub(crate) async fn volume_busy(&self, volume_id: &str) -> ControlError {
        let id = volume_id.to_owned();
        let holders = self.db(move |s| s.volume_holders(&id)).await.unwrap_or_default();
        let who: Vec<String> = holders
            .iter()
            .map(|h| format!("{} ({})", h.sandbox_id, if h.read_only { "read-only" } else { "read-write" }))
            .collect();
        ControlError::VolumeInUse(format!(
            "volume {volume_id} is mounted by {}: read-write by one sandbox at a time, read-only by many but \
             not beside a writer; nothing was created",
            if who.is_empty() { "another sandbox".to_owned() } else { who.join(", ") }
        ))
    }

    /// Volume files with no row (a daemon stopped between a subvolume and
    /// its row, or between a row's deletion and its files') are deleted.
    pub(crate) async fn sweep_volumes(&self) -> Result<()> {
        let Some(storage) = self.runtime.storage().cloned() else { return Ok(()) };
        let keep: std::collections::HashSet<String> =
            self.db(|s| s.list_volumes(None)).await?.into_iter().map(|r| r.id).collect();
        let swept = tokio::task::spawn_blocking(move || {
            storage.sweep(hutch_runtime::storage::Kind::Volume, |name| keep.contains(name))
        })
        .await?;
        if !swept.is_empty() {
            tracing::info!("deleted {} volumes' files that had no record: {swept:?}", swept.len());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_normalized_and_kept_to_their_places() {
        for (given, normal) in [
            ("/workspace", "/workspace"),
            ("/workspace/", "/workspace"),
            ("/data/x", "/data/x"),
            ("//data//x/./y/", "/data/x/y"),
            ("/home/user/cache", "/home/user/cache"),
            ("/mnt/a b", "/mnt/a b"),
        ] {
            assert_eq!(check_path(given).expect(given), normal);
        }
        for bad in [
            "",
            "data",
            "/",
            "/etc",
            "/usr/lib",
            "/home",
            "/home/other",
            "/home/username",
            "/database",
            "/mnt/../etc",
            "/data/x/..",
            "/workspace/\n",
            "/proc/self",
            "/dev/shm",
            "/tmp",
        ] {
            let e = check_path(bad).expect_err(bad);
            assert!(matches!(e, ControlError::VolumePathInvalid(_)), "{bad}: {e:?}");
            assert_eq!(e.code(), hutch_api::ErrorCode::VolumePathInvalid);
        }
        assert!(check_path(&format!("/data/{}", "a".repeat(256))).is_err());
        // A refusal quotes a hostile path cut short.
        for hostile in [format!("/x{}", "\u{13}".repeat(5000)), format!("/x{}", "é".repeat(5000))] {
            let message = check_path(&hostile).expect_err("refused").to_string();
            assert!(message.len() <= 320, "{} bytes", message.len());
        }
    }

    #[test]
    fn a_sandboxs_mounts_do_not_overlap() {
        let m = |name: &str, path: &str| VolumeMount { name: name.into(), path: path.into(), read_only: false };
        assert!(check_mounts(&[m("a", "/data"), m("b", "/mnt/b")]).is_ok());
        assert!(check_mounts(&[m("a", "/data/x"), m("b", "/data/xy")]).is_ok());
        for pair in [[m("a", "/data"), m("b", "/data/x")], [m("a", "/data/x/"), m("b", "/data/x")]] {
            let e = check_mounts(&pair).expect_err("overlap");
            assert_eq!(e.code(), hutch_api::ErrorCode::VolumePathInvalid);
        }
        assert!(check_mounts(&[m("a", "/data"), m("a", "/mnt")]).is_err());
        let many: Vec<VolumeMount> = (0..=MAX_MOUNTS).map(|i| m(&format!("v{i}"), &format!("/mnt/{i}"))).collect();
        assert!(check_mounts(&many).is_err());
    }

    #[test]
    fn volume_names_are_plain_and_never_look_like_ids() {
        for good in ["a", "cache-1", "v1.2_x", &"a".repeat(64)] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", ".a", "A", "a b", "a/b", "vol-0123456789abcdef", &"a".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
