//! API keys: who may call, as which owner, with which quotas. A key's
//! secret is shown once, at creation; the store keeps only its SHA-256.
//! The key operations are functions over the store, so that the daemon's
//! admin API and `hutch key` on the daemon's host share one
//! implementation; revoking a key ends its sandboxes (the reconciler ends
//! what a revocation made while the daemon was down, or by `hutch key
//! revoke`, at its next tick).

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, SandboxId};
use crate::lifecycle::Reason;
use hutch_api::{ApiKey, ApiKeyList, CreateKey, KeyQuotas, Usage};
use hutch_store::{KeyRecord, QuickReads, Quotas, Store, StoreError};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// A new key and its secret.
pub struct NewKey {
    pub record: KeyRecord,
    pub secret: String,
}

/// Makes a key. Secrets are `hutch_` and 48 hex digits, or `e2b_` and 40
/// hex digits (the shape the E2B SDK insists on).
pub fn generate(name: &str, admin: bool, e2b: bool, quotas: Quotas) -> Result<NewKey> {
    check_name(name)?;
    check_quotas(&quotas)?;
    let mut raw = [0u8; 24];
    hutch_runtime::sys::random_bytes(&mut raw).map_err(|e| ControlError::Runtime(format!("random bytes: {e}")))?;
    let secret = if e2b { format!("e2b_{}", hex::encode(&raw[..20])) } else { format!("hutch_{}", hex::encode(raw)) };
    let record = KeyRecord {
        id: OwnerId::random()?.to_string(),
        name: name.to_owned(),
        hash: hash(&secret),
        admin,
        created_at: now_ms(),
        revoked_at: None,
        quotas,
    };
    Ok(NewKey { record, secret })
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
        return Err(ControlError::Invalid("a key's name is 1 to 64 printable characters".into()));
    }
    Ok(())
}

fn check_quotas(q: &Quotas) -> Result<()> {
    if q.sandboxes == Some(0) || q.memory_mb == Some(0) || q.disk_mib == Some(0) || q.ttl_seconds == Some(0) {
        return Err(ControlError::Invalid(
            "a quota of 0 would refuse everything: revoke the key instead, or leave the quota out".into(),
        ));
    }
    Ok(())
}

/// The stored form of a secret.
pub fn hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// The live key a secret belongs to, if any.
pub fn authenticate(store: &dyn QuickReads, secret: &str) -> std::result::Result<Option<KeyRecord>, StoreError> {
    if secret.is_empty() || secret.len() > 256 {
        return Ok(None);
    }
    Ok(store.key_by_hash(&hash(secret))?.filter(|k| k.revoked_at.is_none()))
}

/// Makes and stores a key; its secret is in the answer, once.
pub fn create(store: &dyn Store, name: &str, admin: bool, e2b: bool, quotas: Quotas) -> Result<ApiKey> {
    let k = generate(name, admin, e2b, quotas)?;
    store.insert_key(&k.record)?;
    Ok(ApiKey { secret: Some(k.secret), ..api_key(&k.record) })
}

/// Every key, oldest first.
pub fn list(store: &dyn Store) -> Result<Vec<ApiKey>> {
    Ok(store.list_keys()?.iter().map(api_key).collect())
}

/// Revokes a live key; its sandboxes end at the daemon's next tick.
pub fn revoke(store: &dyn Store, id: &str) -> Result<()> {
    if store.revoke_key(id, now_ms())? {
        Ok(())
    } else {
        Err(ControlError::NoKey(id.to_owned()))
    }
}

/// Replaces a live key's quotas.
pub fn set_quotas(store: &dyn Store, id: &str, quotas: Quotas) -> Result<ApiKey> {
    check_quotas(&quotas)?;
    if !store.set_quotas(id, &quotas)? {
        return Err(ControlError::NoKey(id.to_owned()));
    }
    let k = store.get_key(id)?.ok_or_else(|| ControlError::NoKey(id.to_owned()))?;
    Ok(api_key(&k))
}

/// A stored key as the API shows it.
pub fn api_key(k: &KeyRecord) -> ApiKey {
    ApiKey {
        id: k.id.clone(),
        name: k.name.clone(),
        admin: k.admin,
        created_at: rfc3339(k.created_at),
        revoked_at: k.revoked_at.map(rfc3339),
        quotas: to_api(&k.quotas),
        secret: None,
    }
}

pub fn to_api(q: &Quotas) -> KeyQuotas {
    KeyQuotas {
        max_sandboxes: q.sandboxes,
        max_memory_mb: q.memory_mb,
        max_disk_mib: q.disk_mib,
        max_ttl_seconds: q.ttl_seconds,
        max_builds: q.builds,
        max_snapshots: q.snapshots,
    }
}

pub fn from_api(q: &KeyQuotas) -> Quotas {
    Quotas {
        sandboxes: q.max_sandboxes,
        memory_mb: q.max_memory_mb,
        disk_mib: q.max_disk_mib,
        ttl_seconds: q.max_ttl_seconds,
        builds: q.max_builds,
        snapshots: q.max_snapshots,
    }
}

fn admin_only(caller: &Caller) -> Result<()> {
    if caller.admin {
        Ok(())
    } else {
        Err(ControlError::Forbidden("only an admin key may manage keys".into()))
    }
}

impl Control {
    /// The caller a secret makes (a live key), or None.
    pub async fn authenticate(&self, secret: &str) -> Result<Option<Caller>> {
        let secret = secret.to_owned();
        let key = self.db_read(move |s| authenticate(s, &secret)).await?;
        Ok(key.map(|k| Caller { quotas: Some(k.quotas), ..Caller::key(OwnerId::from_record(&k.id), k.admin) }))
    }

    pub async fn create_key(&self, caller: &Caller, req: &CreateKey) -> Result<ApiKey> {
        admin_only(caller)?;
        let req = req.clone();
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || create(store.as_ref(), &req.name, false, req.e2b, from_api(&req.quotas)))
            .await?
    }

    pub async fn list_keys(&self, caller: &Caller) -> Result<ApiKeyList> {
        admin_only(caller)?;
        let store = self.store.clone();
        Ok(ApiKeyList { keys: tokio::task::spawn_blocking(move || list(store.as_ref())).await?? })
    }

    /// Revokes a key and ends its sandboxes now; its templates keep no
    /// warm pool from now on. An admin may not revoke its own key here.
    pub async fn revoke_key(self: &Arc<Self>, caller: &Caller, id: &OwnerId) -> Result<()> {
        admin_only(caller)?;
        if *id == caller.owner {
            return Err(ControlError::Invalid("a key cannot revoke itself".into()));
        }
        let (store, kid) = (self.store.clone(), id.to_string());
        tokio::task::spawn_blocking(move || revoke(store.as_ref(), &kid)).await??;
        self.add_revoked(id);
        let mut d = serde_json::Map::new();
        d.insert("key_id".into(), id.to_string().into());
        self.emit(id.as_str(), crate::events::Kind::KeyRevoked, None, d);
        self.grant_secrets.forget(id.as_str());
        self.end_sandboxes_of(id).await;
        self.forget_build_cache_of(id).await;
        Ok(())
    }

    /// Drops a revoked key's build cache entries: no build of it can use
    /// them again, and their layers become garbage for the image GC.
    async fn forget_build_cache_of(&self, owner: &OwnerId) {
        let Ok(images) = self.images() else { return };
        let o = owner.to_string();
        match tokio::task::spawn_blocking(move || images.forget_owner_cache(&o)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("build cache of revoked key {owner}: {e}"),
            Err(e) => tracing::warn!("build cache of revoked key {owner}: {e}"),
        }
    }

    /// Ends every sandbox of a revoked key (warm ones included).
    pub(crate) async fn end_sandboxes_of(self: &Arc<Self>, owner: &OwnerId) {
        // This node's: other nodes end theirs at their next tick.
        let node = self.node.name.clone();
        let rows = match self.db(move |s| s.sandboxes_on(Some(&node), crate::lifecycle::HOLDING)).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("key {owner} revoked; its sandboxes end at the next tick: {e}");
                return;
            }
        };
        for r in rows.iter().filter(|r| r.owner == owner.as_str()) {
            let id = SandboxId::from_record(&r.id);
            if r.pooled && !self.drain_pooled(&id).await.unwrap_or(false) {
                continue;
            }
            if let Err(e) = self.destroy(&id, Some(Reason::KeyRevoked)).await {
                tracing::warn!("sandbox {id} of revoked key {owner}: {e}; the reconciler retries");
            }
        }
    }

    pub async fn set_key_quotas(&self, caller: &Caller, id: &OwnerId, quotas: &KeyQuotas) -> Result<ApiKey> {
        admin_only(caller)?;
        let (store, kid, q) = (self.store.clone(), id.to_string(), from_api(quotas));
        tokio::task::spawn_blocking(move || set_quotas(store.as_ref(), &kid, q)).await?
    }

    /// What a key holds against its quotas: the caller's own, or for an
    /// admin any key's.
    pub async fn usage(&self, caller: &Caller, key: Option<&str>) -> Result<Usage> {
        let owner = match key {
            None => Some(caller.owner.clone()),
            Some("*") if caller.admin => None,
            Some(k) if caller.admin => Some(OwnerId::parse(k)?),
            Some(_) => return Err(ControlError::Forbidden("only an admin key may read another key's usage".into())),
        };
        let o = owner.as_ref().map(|o| o.to_string());
        let (record, held, builds, snapshots, (volumes, volume_mib)) = self
            .db(move |s| {
                let o = o.as_deref();
                Ok((
                    o.map(|o| s.get_key(o)).transpose()?,
                    s.usage(o)?,
                    s.count_running_builds(o)?,
                    s.list_snapshots(o)?.len() as u64,
                    s.volume_usage(o)?,
                ))
            })
            .await?;
        // Every key's (`*`): what all hold, under no key's quotas.
        let quotas = match (&owner, record) {
            (None, _) => KeyQuotas::default(),
            (Some(_), Some(Some(r))) => to_api(&r.quotas),
            (Some(o), _) => return Err(ControlError::NoKey(o.to_string())),
        };
        Ok(Usage {
            key_id: owner.map_or_else(|| "*".to_owned(), |o| o.to_string()),
            sandboxes: held.sandboxes,
            memory_mb: held.memory_mb,
            disk_mib: held.disk_mib,
            builds,
            snapshots,
            volumes,
            volume_mib,
            quotas,
            from: None,
            to: None,
            group_by: None,
            rows: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_store::SqliteStore;

    #[test]
    fn keys_authenticate_until_revoked() {
        let store = SqliteStore::open_in_memory().expect("store");
        let k = generate("ci", false, false, Quotas::default()).expect("generate");
        assert!(k.secret.starts_with("hutch_") && k.secret.len() == 54);
        assert_ne!(k.record.hash, k.secret);
        OwnerId::parse(&k.record.id).expect("ids are owner ids");
        store.insert_key(&k.record).expect("insert");
        assert_eq!(authenticate(&store, &k.secret).expect("auth").map(|r| r.id), Some(k.record.id.clone()));
        assert!(authenticate(&store, "hutch_wrong").expect("auth").is_none());
        revoke(&store, &k.record.id).expect("revoke");
        assert!(authenticate(&store, &k.secret).expect("auth").is_none());
        assert!(matches!(revoke(&store, &k.record.id), Err(ControlError::NoKey(_))));
        let e = generate("sdk", false, true, Quotas::default()).expect("generate");
        assert!(e.secret.starts_with("e2b_") && e.secret.len() == 44);
    }

    #[test]
    fn quotas_are_checked_and_kept() {
        let store = SqliteStore::open_in_memory().expect("store");
        assert!(generate("x", false, false, Quotas { sandboxes: Some(0), ..Quotas::default() }).is_err());
        assert!(generate("", false, false, Quotas::default()).is_err());
        let made =
            create(&store, "tenant", false, false, Quotas { sandboxes: Some(3), ..Quotas::default() }).expect("create");
        assert!(made.secret.is_some() && !made.admin);
        assert_eq!(made.quotas.max_sandboxes, Some(3));
        let changed = set_quotas(&store, &made.id, Quotas { memory_mb: Some(4096), ..Quotas::default() }).expect("set");
        assert_eq!((changed.quotas.max_sandboxes, changed.quotas.max_memory_mb), (None, Some(4096)));
        assert!(list(&store).expect("list").iter().all(|k| k.secret.is_none()));
    }
}
