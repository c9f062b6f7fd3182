//! API keys: generation and hashing. A key's secret is shown once, at
//! creation; the store keeps only its SHA-256.

use hutch_store::{KeyRecord, Store, StoreError};
use sha2::{Digest, Sha256};

/// A new key and its secret.
pub struct NewKey {
    pub record: KeyRecord,
    pub secret: String,
}

/// Makes a key. Secrets are `hutch_` and 48 hex digits, or `e2b_` and 40
/// hex digits (the shape the E2B SDK insists on).
pub fn generate(name: &str, admin: bool, e2b: bool, now_ms: i64) -> std::io::Result<NewKey> {
    let mut raw = [0u8; 24];
    hutch_runtime::sys::random_bytes(&mut raw)?;
    let secret = if e2b { format!("e2b_{}", hex::encode(&raw[..20])) } else { format!("hutch_{}", hex::encode(raw)) };
    let mut id = [0u8; 6];
    hutch_runtime::sys::random_bytes(&mut id)?;
    let record = KeyRecord {
        id: format!("key-{}", hex::encode(id)),
        name: name.to_owned(),
        hash: hash(&secret),
        admin,
        created_at: now_ms,
        revoked_at: None,
    };
    Ok(NewKey { record, secret })
}

/// The stored form of a secret.
pub fn hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// The live key a secret belongs to, if any.
pub fn authenticate(store: &dyn Store, secret: &str) -> Result<Option<KeyRecord>, StoreError> {
    if secret.is_empty() || secret.len() > 256 {
        return Ok(None);
    }
    Ok(store.key_by_hash(&hash(secret))?.filter(|k| k.revoked_at.is_none()))
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_store::SqliteStore;

    #[test]
    fn keys_authenticate_until_revoked() {
        let store = SqliteStore::open_in_memory().expect("store");
        let k = generate("ci", false, false, 1).expect("generate");
        assert!(k.secret.starts_with("hutch_") && k.secret.len() == 54);
        assert_ne!(k.record.hash, k.secret);
        store.insert_key(&k.record).expect("insert");
        assert_eq!(authenticate(&store, &k.secret).expect("auth").map(|r| r.id), Some(k.record.id.clone()));
        assert!(authenticate(&store, "hutch_wrong").expect("auth").is_none());
        store.revoke_key(&k.record.id, 2).expect("revoke");
        assert!(authenticate(&store, &k.secret).expect("auth").is_none());
        let e = generate("sdk", false, true, 1).expect("generate");
        assert!(e.secret.starts_with("e2b_") && e.secret.len() == 44);
    }
}
