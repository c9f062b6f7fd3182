//! Secrets that never enter a sandbox. A secret's value is sealed with the
//! daemon's key (ChaCha20-Poly1305, `secrets.key` in the state directory,
//! mode 0600, made at first use) before it reaches the store, and no API
//! answer holds it. A sandbox that names a secret gets a placeholder in
//! its environment (`NAME=hutch-secret-…`, derived from the key, the
//! sandbox and the name, so it is the sandbox's own and unguessable); the
//! host's egress proxy (hutch-server `egress`) swaps the placeholder for
//! the value in the headers of HTTPS requests to the secret's hosts, and
//! nowhere else.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{random_hex, Caller, OwnerId};
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use hmac::{Hmac, Mac};
use hutch_api::{CreateSecret, Secret, SecretList, UpdateSecret};
use hutch_store::{SecretRecord, StoreError};
use sha2::Sha256;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The key file's name in the state directory.
pub const KEY_FILE: &str = "secrets.key";
/// What every placeholder starts with.
pub const PLACEHOLDER_PREFIX: &str = "hutch-secret-";
/// Hex digits after the prefix (160 bits).
const PLACEHOLDER_HEX: usize = 40;
pub const MAX_VALUE: usize = 8192;
pub const MAX_HOSTS: usize = 16;
/// Secrets one sandbox may name.
pub const MAX_PER_SANDBOX: usize = 32;

/// The daemon's secrets key, loaded (or made) at first use.
#[derive(Default)]
pub struct SecretKeys {
    key: Mutex<Option<Arc<[u8; 32]>>>,
}

impl SecretKeys {
    /// The key in `dir`, made (0600, never replaced) when there is none.
    pub(crate) fn get(&self, dir: &Path) -> Result<Arc<[u8; 32]>> {
        let mut held = self.key.lock().map_err(|_| ControlError::Runtime("secrets key lock poisoned".into()))?;
        if let Some(k) = held.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(load_or_create(&dir.join(KEY_FILE))?);
        *held = Some(k.clone());
        Ok(k)
    }
}

fn key_err(path: &Path, e: std::io::Error) -> ControlError {
    ControlError::Runtime(format!("secrets key {}: {e}", path.display()))
}

/// Reads the 32-byte key at `path`, or makes it: written to a temporary
/// file of mode 0600 and linked into place, so no reader ever sees a
/// partial key and a concurrent maker's key is never overwritten.
pub fn load_or_create(path: &Path) -> Result<[u8; 32]> {
    match std::fs::read(path) {
        Ok(b) => {
            return b
                .try_into()
                .map_err(|_| ControlError::Runtime(format!("secrets key {} is not 32 bytes", path.display())))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(key_err(path, e)),
    }
    let mut key = [0u8; 32];
    hutch_runtime::sys::random_bytes(&mut key).map_err(|e| key_err(path, e))?;
    let tmp = PathBuf::from(format!("{}.{}.tmp", path.display(), std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| key_err(&tmp, e))?;
    f.write_all(&key).and_then(|()| f.sync_all()).map_err(|e| key_err(&tmp, e))?;
    drop(f);
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(key),
        // Another maker won: its key is the key.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load_or_create(path),
        Err(e) => Err(key_err(path, e)),
    }
}

/// What a sealed value is bound to: a row's value cannot be moved to
/// another owner's or another name's row.
fn aad(owner: &str, name: &str) -> Vec<u8> {
    format!("hutch-secret\0{owner}\0{name}").into_bytes()
}

/// The value sealed: a random 12-byte nonce, then ciphertext and tag.
pub fn seal(key: &[u8; 32], owner: &str, name: &str, value: &[u8]) -> Result<Vec<u8>> {
    let cipher = ChaCha20Poly1305::new(Key::from_slice(key));
    let mut nonce = [0u8; 12];
    hutch_runtime::sys::random_bytes(&mut nonce).map_err(|e| ControlError::Runtime(format!("random bytes: {e}")))?;
    let aad = aad(owner, name);
    let ct = cipher
        .encrypt(Nonce::from_slice(&nonce), Payload { msg: value, aad: &aad })
        .map_err(|_| ControlError::Runtime("sealing a secret failed".into()))?;
    Ok([nonce.to_vec(), ct].concat())
}

/// The value of a sealed secret; None when it does not open (another
/// key, or a changed row).
pub fn open(key: &[u8; 32], owner: &str, name: &str, sealed: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < 12 {
        return None;
    }
    let (nonce, ct) = sealed.split_at(12);
    let aad = aad(owner, name);
    ChaCha20Poly1305::new(Key::from_slice(key)).decrypt(Nonce::from_slice(nonce), Payload { msg: ct, aad: &aad }).ok()
}

/// The placeholder of secret `name` in sandbox `sandbox`.
pub fn placeholder(key: &[u8; 32], sandbox: &str, name: &str) -> String {
    let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(b"hutch-placeholder\0");
    mac.update(sandbox.as_bytes());
    mac.update(b"\0");
    mac.update(name.as_bytes());
    let tag = hex::encode(mac.finalize().into_bytes());
    format!("{PLACEHOLDER_PREFIX}{}", &tag[..PLACEHOLDER_HEX])
}

/// A secret's name: an environment variable's (1 to 64 of `A-Z a-z 0-9
/// _`, not starting with a digit).
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !ok {
        return Err(ControlError::Invalid(format!(
            "secret name {name:?}: 1 to 64 of A-Z a-z 0-9 _, not starting with a digit"
        )));
    }
    Ok(())
}

fn check_value(value: &str) -> Result<()> {
    if value.is_empty() || value.len() > MAX_VALUE || value.contains(['\r', '\n', '\0']) {
        return Err(ControlError::Invalid(format!("value: 1 to {MAX_VALUE} bytes, no CR, LF or NUL")));
    }
    Ok(())
}

/// A host pattern: a DNS name (lowercased), or `*.` and one.
pub fn check_host(host: &str) -> Result<String> {
    let h = host.trim_end_matches('.').to_ascii_lowercase();
    let name = h.strip_prefix("*.").unwrap_or(&h);
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.contains('.')
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !ok {
        return Err(ControlError::Invalid(format!("hosts: {host:?} is not a host name or *.name")));
    }
    Ok(h)
}

fn check_hosts(hosts: &[String]) -> Result<Vec<String>> {
    if hosts.len() > MAX_HOSTS {
        return Err(ControlError::Invalid(format!("hosts: at most {MAX_HOSTS}")));
    }
    let mut out: Vec<String> = hosts.iter().map(|h| check_host(h)).collect::<Result<_>>()?;
    out.sort();
    out.dedup();
    Ok(out)
}

/// Whether `host` (an SNI name) is one of `patterns`.
pub fn host_matches(patterns: &[String], host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    patterns.iter().any(|p| match p.strip_prefix("*.") {
        Some(suffix) => {
            host.len() > suffix.len() + 1 && host.ends_with(suffix) && {
                let cut = host.len() - suffix.len();
                host.as_bytes()[cut - 1] == b'.'
            }
        }
        None => *p == host,
    })
}

fn check_header(header: Option<&str>, format: Option<&str>) -> Result<()> {
    if let Some(h) = header {
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if h.is_empty() || h.len() > 128 || !h.bytes().all(token) {
            return Err(ControlError::Invalid(format!("header {h:?} is not a header name")));
        }
        if h.eq_ignore_ascii_case("host") || h.eq_ignore_ascii_case("content-length") {
            return Err(ControlError::Invalid(format!("header {h:?} cannot be set")));
        }
    }
    if let Some(f) = format {
        if header.is_none() {
            return Err(ControlError::Invalid("format needs a header".into()));
        }
        if !f.contains("{value}") || f.len() > 512 || f.bytes().any(|b| b < 0x20 && b != b'\t' || b == 0x7f) {
            return Err(ControlError::Invalid("format: up to 512 printable bytes holding {value}".into()));
        }
    }
    Ok(())
}

fn hosts_of(r: &SecretRecord) -> Vec<String> {
    serde_json::from_str(&r.hosts).unwrap_or_default()
}

fn view(r: &SecretRecord) -> Secret {
    Secret {
        name: r.name.clone(),
        hosts: hosts_of(r),
        header: r.header.clone(),
        format: r.format.clone(),
        created_at: rfc3339(r.created_at),
        updated_at: rfc3339(r.updated_at),
    }
}

/// One secret of a sandbox, opened, as the egress proxy uses it.
#[derive(Clone)]
pub struct Injection {
    pub name: String,
    pub placeholder: String,
    pub value: String,
    pub hosts: Vec<String>,
    /// The header to set and its full value.
    pub header: Option<(String, String)>,
}

impl std::fmt::Debug for Injection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Injection").field("name", &self.name).field("hosts", &self.hosts).finish_non_exhaustive()
    }
}

impl Control {
    fn secrets_key(&self) -> Result<Arc<[u8; 32]>> {
        self.secret_keys.get(&self.runtime.config().state_dir)
    }

    pub async fn create_secret(&self, caller: &Caller, req: &CreateSecret) -> Result<Secret> {
        check_name(&req.name)?;
        check_value(&req.value)?;
        let hosts = check_hosts(&req.hosts)?;
        check_header(req.header.as_deref(), req.format.as_deref())?;
        self.insert_secret(&caller.owner, &req.name, &req.value, hosts, req.header.clone(), req.format.clone(), "{}")
            .await
            .map(|r| view(&r))
    }

    /// Seals and stores a new secret.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn insert_secret(
        &self,
        owner: &OwnerId,
        name: &str,
        value: &str,
        hosts: Vec<String>,
        header: Option<String>,
        format: Option<String>,
        metadata: &str,
    ) -> Result<SecretRecord> {
        let key = self.secrets_key()?;
        let now = now_ms();
        let r = SecretRecord {
            id: format!("sec-{}", random_hex(8)?),
            owner: owner.to_string(),
            name: name.to_owned(),
            hosts: serde_json::to_string(&hosts).unwrap_or_else(|_| "[]".into()),
            header,
            format,
            metadata: metadata.to_owned(),
            version: 1,
            sealed: seal(&key, owner.as_str(), name, value.as_bytes())?,
            created_at: now,
            updated_at: now,
        };
        let rec = r.clone();
        match self.db(move |s| s.insert_secret(&rec)).await {
            Ok(()) => Ok(r),
            Err(ControlError::Store(StoreError::Conflict)) => Err(ControlError::SecretNameTaken(name.to_owned())),
            Err(e) => Err(e),
        }
    }

    pub(crate) async fn secret_record(&self, owner: &OwnerId, name: &str) -> Result<SecretRecord> {
        let (o, n) = (owner.to_string(), name.to_owned());
        self.db(move |s| s.secret_by_name(&o, &n)).await?.ok_or_else(|| ControlError::NoSecret(name.to_owned()))
    }

    pub(crate) async fn secret_records(&self, owner: &OwnerId) -> Result<Vec<SecretRecord>> {
        let o = owner.to_string();
        self.db(move |s| s.list_secrets(Some(&o))).await
    }

    /// The caller's own secrets (an admin's too: secrets are never shown
    /// across owners).
    pub async fn list_secrets(&self, caller: &Caller) -> Result<SecretList> {
        Ok(SecretList { secrets: self.secret_records(&caller.owner).await?.iter().map(view).collect() })
    }

    pub async fn get_secret(&self, caller: &Caller, name: &str) -> Result<Secret> {
        Ok(view(&self.secret_record(&caller.owner, name).await?))
    }

    pub async fn update_secret(&self, caller: &Caller, name: &str, req: &UpdateSecret) -> Result<Secret> {
        let old = self.secret_record(&caller.owner, name).await?;
        let mut r = old.clone();
        if let Some(hosts) = &req.hosts {
            r.hosts = serde_json::to_string(&check_hosts(hosts)?).unwrap_or_else(|_| "[]".into());
        }
        if let Some(h) = &req.header {
            r.header = h.clone();
            if h.is_none() {
                r.format = None;
            }
        }
        if let Some(f) = &req.format {
            r.format = f.clone();
        }
        check_header(r.header.as_deref(), r.format.as_deref())?;
        if let Some(v) = &req.value {
            r.sealed = self.reseal(&r, v)?;
        }
        self.write_secret(r, &old).await.map(|r| view(&r))
    }

    pub(crate) fn reseal(&self, r: &SecretRecord, value: &str) -> Result<Vec<u8>> {
        check_value(value)?;
        seal(&*self.secrets_key()?, &r.owner, &r.name, value.as_bytes())
    }

    /// Stores a changed secret (a new value raises its version).
    pub(crate) async fn write_secret(&self, mut r: SecretRecord, old: &SecretRecord) -> Result<SecretRecord> {
        if r.sealed != old.sealed {
            r.version = old.version + 1;
        }
        r.updated_at = now_ms().max(old.updated_at + 1);
        let rec = r.clone();
        if !self.db(move |s| s.update_secret(&rec)).await? {
            return Err(ControlError::NoSecret(r.name));
        }
        Ok(r)
    }

    pub async fn delete_secret(&self, caller: &Caller, name: &str) -> Result<()> {
        let (o, n) = (caller.owner.to_string(), name.to_owned());
        if !self.db(move |s| s.delete_secret(&o, &n)).await? {
            return Err(ControlError::NoSecret(name.to_owned()));
        }
        Ok(())
    }

    /// Checks that each name is one of `owner`'s secrets; the names,
    /// sorted and deduplicated, as a template or sandbox keeps them.
    pub(crate) async fn secret_names(&self, owner: &OwnerId, names: &[String]) -> Result<Vec<String>> {
        if names.len() > MAX_PER_SANDBOX {
            return Err(ControlError::Invalid(format!("secrets: at most {MAX_PER_SANDBOX}")));
        }
        let mut out = Vec::new();
        for n in names {
            check_name(n)?;
            self.secret_record(owner, n).await?;
            out.push(n.clone());
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// The environment a sandbox gets for the secrets it names: each
    /// placeholder, and where its tools find the egress proxy's CA.
    pub(crate) fn secret_env(&self, sandbox: &str, names: &[String]) -> Result<Vec<(String, String)>> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.secrets_key()?;
        let mut env: Vec<(String, String)> = names.iter().map(|n| (n.clone(), placeholder(&key, sandbox, n))).collect();
        for var in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"] {
            env.push((var.to_owned(), CA_BUNDLE_PATH.to_owned()));
        }
        Ok(env)
    }

    /// What the egress proxy injects for the sandbox at `addr`: its owner's
    /// secrets that it names, opened. None: no sandbox there, or it names
    /// none.
    pub async fn egress_secrets(&self, addr: std::net::IpAddr) -> Option<(String, Vec<Injection>)> {
        let net = self.network.as_ref().ok()?;
        let (id, _) = net.policy_of(addr)?;
        let sid = id.clone();
        let record = self.db_read(move |s| s.get_sandbox(&sid)).await.ok()??;
        let names = crate::network::NetRecord::parse(&record.network).secrets;
        if names.is_empty() {
            return None;
        }
        let key = self.secrets_key().ok()?;
        let owner = OwnerId::from_record(&record.owner);
        let mut out = Vec::new();
        for name in names {
            // A secret deleted since the sandbox started is injected no more.
            let Ok(r) = self.secret_record(&owner, &name).await else { continue };
            let Some(value) = open(&key, &r.owner, &r.name, &r.sealed).and_then(|v| String::from_utf8(v).ok()) else {
                tracing::warn!("secret {name:?} of sandbox {id} does not open with this daemon's key");
                continue;
            };
            let header =
                r.header.clone().map(|h| (h, r.format.as_deref().unwrap_or("{value}").replace("{value}", &value)));
            out.push(Injection {
                placeholder: placeholder(&key, &id, &name),
                hosts: hosts_of(&r),
                value,
                header,
                name,
            });
        }
        Some((id, out))
    }
}

/// A secret as E2B's API shows it (`Secret`): never its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretInfo {
    pub id: String,
    pub name: String,
    pub version: i64,
    pub metadata: std::collections::BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
}

fn info(r: &SecretRecord) -> SecretInfo {
    SecretInfo {
        id: r.id.clone(),
        name: r.name.clone(),
        version: r.version,
        metadata: serde_json::from_str(&r.metadata).unwrap_or_default(),
        created_at: rfc3339(r.created_at),
        updated_at: rfc3339(r.updated_at),
    }
}

/// The E2B API's secrets (`/secrets`): the same secrets as `/v1/secrets`,
/// named by id (`sec-…`) or name, with E2B's metadata and versions. They
/// list no hosts until `PATCH /v1/secrets/{name}` gives some.
impl Control {
    async fn e2b_record(&self, caller: &Caller, reference: &str) -> Result<SecretRecord> {
        if reference.starts_with("sec-") {
            let all = self.secret_records(&caller.owner).await?;
            return all.into_iter().find(|r| r.id == reference).ok_or_else(|| ControlError::NoSecret(reference.into()));
        }
        self.secret_record(&caller.owner, reference).await
    }

    pub async fn e2b_create_secret(
        &self,
        caller: &Caller,
        name: &str,
        value: &str,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> Result<SecretInfo> {
        check_name(name)?;
        check_value(value)?;
        crate::control::check_map("metadata", metadata, 64)?;
        let meta = serde_json::to_string(metadata).unwrap_or_else(|_| "{}".into());
        let r = self.insert_secret(&caller.owner, name, value, Vec::new(), None, None, &meta).await?;
        Ok(info(&r))
    }

    pub async fn e2b_secrets(&self, caller: &Caller) -> Result<Vec<SecretInfo>> {
        Ok(self.secret_records(&caller.owner).await?.iter().map(info).collect())
    }

    pub async fn e2b_secret(&self, caller: &Caller, reference: &str) -> Result<SecretInfo> {
        Ok(info(&self.e2b_record(caller, reference).await?))
    }

    /// A new value (a new version) and, when given, new metadata.
    pub async fn e2b_update_secret(
        &self,
        caller: &Caller,
        reference: &str,
        value: &str,
        metadata: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Result<SecretInfo> {
        let old = self.e2b_record(caller, reference).await?;
        let mut r = old.clone();
        r.sealed = self.reseal(&r, value)?;
        if let Some(m) = metadata {
            crate::control::check_map("metadata", m, 64)?;
            r.metadata = serde_json::to_string(m).unwrap_or_else(|_| "{}".into());
        }
        Ok(info(&self.write_secret(r, &old).await?))
    }

    pub async fn e2b_delete_secret(&self, caller: &Caller, reference: &str) -> Result<()> {
        let r = self.e2b_record(caller, reference).await?;
        self.delete_secret(caller, &r.name).await
    }
}

/// The destination a redirected connection was sent to before the host's
/// nftables redirect gave it to the egress proxy (`SO_ORIGINAL_DST`).
pub fn original_dst(sock: &impl std::os::fd::AsRawFd) -> std::io::Result<std::net::SocketAddrV4> {
    // SAFETY: sockaddr_in is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: the fd is a socket the caller holds open; addr and len point
    // to writable memory of the size len says.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

/// Replaces, in one header value, each placeholder of `pairs`
/// (placeholder, value) with its value. Bytes that are no placeholder of
/// `pairs` are left as they are: another secret's placeholder stays one.
pub fn replace_placeholders(input: &[u8], pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    'scan: while i < input.len() {
        if input[i..].starts_with(PLACEHOLDER_PREFIX.as_bytes()) {
            for (ph, value) in pairs {
                if !ph.is_empty() && input[i..].starts_with(ph) {
                    out.extend_from_slice(value);
                    i += ph.len();
                    continue 'scan;
                }
            }
        }
        out.push(input[i]);
        i += 1;
    }
    out
}

/// Where a sandbox that names secrets finds the CA bundle that trusts the
/// egress proxy (bound read-only over the image's).
pub const CA_BUNDLE_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_only_with_its_key_owner_and_name() {
        let key = [3u8; 32];
        let sealed = seal(&key, "k1", "TOKEN", b"s3cr3t").expect("seal");
        assert!(!sealed.windows(6).any(|w| w == b"s3cr3t"));
        assert_eq!(open(&key, "k1", "TOKEN", &sealed).as_deref(), Some(&b"s3cr3t"[..]));
        assert_eq!(open(&[4u8; 32], "k1", "TOKEN", &sealed), None);
        assert_eq!(open(&key, "k2", "TOKEN", &sealed), None);
        assert_eq!(open(&key, "k1", "OTHER", &sealed), None);
        assert_eq!(open(&key, "k1", "TOKEN", &sealed[..5]), None);
    }

    #[test]
    fn placeholders_are_per_sandbox_and_name() {
        let key = [3u8; 32];
        let a = placeholder(&key, "sb-1", "TOKEN");
        assert!(a.starts_with(PLACEHOLDER_PREFIX) && a.len() == PLACEHOLDER_PREFIX.len() + PLACEHOLDER_HEX);
        assert_eq!(a, placeholder(&key, "sb-1", "TOKEN"));
        assert_ne!(a, placeholder(&key, "sb-2", "TOKEN"));
        assert_ne!(a, placeholder(&key, "sb-1", "OTHER"));
        assert_ne!(a, placeholder(&[4u8; 32], "sb-1", "TOKEN"));
    }

    #[test]
    fn only_the_given_placeholders_are_replaced() {
        let pairs: [(&[u8], &[u8]); 1] = [(b"hutch-secret-aaaa", b"VALUE")];
        assert_eq!(replace_placeholders(b"Bearer hutch-secret-aaaa", &pairs), b"Bearer VALUE");
        assert_eq!(replace_placeholders(b"hutch-secret-aaaahutch-secret-aaaa", &pairs), b"VALUEVALUE");
        assert_eq!(replace_placeholders(b"x hutch-secret-bbbb", &pairs), b"x hutch-secret-bbbb");
        assert_eq!(replace_placeholders(b"hutch-secret-aaa", &pairs), b"hutch-secret-aaa");
        assert_eq!(replace_placeholders(b"", &pairs), b"");
    }

    #[test]
    fn hosts_match_exactly_or_under_a_wildcard() {
        let p = vec!["api.example.com".to_owned(), "*.example.org".to_owned()];
        assert!(host_matches(&p, "api.example.com"));
        assert!(host_matches(&p, "API.Example.com."));
        assert!(host_matches(&p, "a.example.org"));
        assert!(host_matches(&p, "a.b.example.org"));
        assert!(!host_matches(&p, "example.org"));
        assert!(!host_matches(&p, "badexample.org"));
        assert!(!host_matches(&p, "api.example.com.evil.net"));
        assert!(!host_matches(&p, "xapi.example.com"));
    }

    #[test]
    fn bad_names_hosts_and_headers_are_refused() {
        for bad in ["", "1A", "A-B", "A B", &"A".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        check_name("OPENAI_API_KEY").expect("good name");
        for bad in ["", "*", "*.com", "localhost", "a..b", "-a.b", "a.b/c", "a.b:443"] {
            assert!(check_host(bad).is_err(), "{bad:?}");
        }
        assert_eq!(check_host("API.example.com.").expect("host"), "api.example.com");
        assert!(check_header(Some("Bad Header"), None).is_err());
        assert!(check_header(Some("Host"), None).is_err());
        assert!(check_header(None, Some("Bearer {value}")).is_err());
        assert!(check_header(Some("Authorization"), Some("Bearer")).is_err());
        assert!(check_header(Some("Authorization"), Some("Bearer {value}\r\nX: y")).is_err());
        check_header(Some("Authorization"), Some("Bearer {value}")).expect("good header");
        assert!(check_value("a\nb").is_err());
    }

    #[test]
    fn the_key_file_is_made_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("hutch-secrets-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(KEY_FILE);
        let k1 = load_or_create(&path).expect("make");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_or_create(&path).expect("load"), k1);
        std::fs::write(&path, b"short").expect("write");
        assert!(load_or_create(&path).is_err());
        std::fs::remove_dir_all(&dir).expect("clean");
    }
}
