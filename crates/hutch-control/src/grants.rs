//! Grants to end users: `hg_` tokens a key's holder mints for one of its
//! sandboxes, naming the operations they allow (`exec`, `files:read`,
//! `files:write`, `pty`, `ports:N`) until they expire.
//!
//! A grant is stateless: the token carries its claims (key, sandbox,
//! scopes, expiry, a nonce) and an HMAC-SHA256 of them under the key's
//! grant secret. Checking one reads the secret from memory (cached after
//! its first read, replaced at rotation), so a grant costs no store read;
//! rotating the secret revokes every grant of the key at once, and closes
//! the proxied connections that used one.
//!
//! The restriction travels in the [`Caller`] the credential makes
//! ([`GrantScope`]); [`Caller::admit`] is the one check of what a grant
//! may do. The HTTP layer names the operation of each request
//! ([`Operation`]); anything it does not name is refused to a grant.

use crate::control::Control;
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, SandboxId};
use base64::Engine;
use hmac::{Hmac, Mac};
use hutch_api::time::{now_ms, rfc3339};
use hutch_api::{CreateGrant, Grant, GrantSecretRotated, SandboxState, MAX_GRANT_SECONDS};
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What every grant token starts with (never an API key's prefix).
pub const TOKEN_PREFIX: &str = "hg_";
/// Most ports one grant names.
pub const MAX_GRANT_PORTS: usize = 16;
/// The token format's version byte.
const VERSION: u8 = 1;
/// What the MAC covers before the claims: the purpose and the version.
const MAC_CONTEXT: &[u8] = b"hutch grant v1\0";
const MAC_LEN: usize = 32;
const NONCE_LEN: usize = 8;
/// Longest token text: the prefix and base64 of the largest claims and MAC.
const MAX_TOKEN_LEN: usize = 3 + (1 + 6 + 8 + 8 + 1 + 1 + 2 * MAX_GRANT_PORTS + NONCE_LEN + MAC_LEN).div_ceil(3) * 4;

/// The operations a grant can name, as a set (bits) and ports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scopes {
    bits: u8,
    /// Sorted, distinct.
    ports: Vec<u16>,
}

const EXEC: u8 = 1;
const FILES_READ: u8 = 2;
const FILES_WRITE: u8 = 4;
const PTY: u8 = 8;
const ALL_BITS: u8 = EXEC | FILES_READ | FILES_WRITE | PTY;
const NAMES: [(u8, &str); 4] = [(EXEC, "exec"), (FILES_READ, "files:read"), (FILES_WRITE, "files:write"), (PTY, "pty")];

impl Scopes {
    /// Parses the scopes of a request: known names only, each once, at
    /// least one.
    pub fn parse(names: &[String]) -> Result<Scopes> {
        let mut s = Scopes::default();
        if names.is_empty() {
            return Err(ControlError::Invalid(
                "a grant needs at least one scope: exec, files:read, files:write, pty, ports:N".into(),
            ));
        }
        for name in names {
            let shown: String = name.chars().take(32).collect();
            let dup = || ControlError::Invalid(format!("scope {shown:?} is named twice"));
            if let Some(port) = name.strip_prefix("ports:") {
                let port = port
                    .parse::<u32>()
                    .ok()
                    .filter(|_| port.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| ControlError::Invalid(format!("scope {shown:?}: ports:N takes a port number")))
                    .and_then(crate::access::valid_port)?;
                match s.ports.binary_search(&port) {
                    Ok(_) => return Err(dup()),
                    Err(at) => s.ports.insert(at, port),
                }
                if s.ports.len() > MAX_GRANT_PORTS {
                    return Err(ControlError::Invalid(format!("a grant names at most {MAX_GRANT_PORTS} ports")));
                }
                continue;
            }
            let Some((bit, _)) = NAMES.iter().find(|(_, n)| n == name) else {
                return Err(ControlError::Invalid(format!(
                    "unknown scope {shown:?}: use exec, files:read, files:write, pty, ports:N"
                )));
            };
            if s.bits & bit != 0 {
                return Err(dup());
            }
            s.bits |= bit;
        }
        Ok(s)
    }

    /// The scopes' names, in their canonical order.
    pub fn names(&self) -> Vec<String> {
        let mut out: Vec<String> =
            NAMES.iter().filter(|(b, _)| self.bits & b != 0).map(|(_, n)| (*n).to_owned()).collect();
        out.extend(self.ports.iter().map(|p| format!("ports:{p}")));
        out
    }

    fn has(&self, bit: u8) -> bool {
        self.bits & bit != 0
    }

    pub fn port(&self, port: u16) -> bool {
        self.ports.binary_search(&port).is_ok()
    }
}

/// What a token claims; its MAC is checked apart ([`Claims::verify`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub key: OwnerId,
    pub sandbox: SandboxId,
    /// Unix milliseconds.
    pub expires_at: i64,
    pub scopes: Scopes,
    nonce: [u8; NONCE_LEN],
    mac: [u8; MAC_LEN],
}

/// Why a token did not parse. Every case is answered as an unknown key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a grant token")]
    NotAGrant,
    #[error("the grant token is malformed")]
    Malformed,
}

impl Claims {
    /// The claimed bytes, which the MAC covers (after [`MAC_CONTEXT`]).
    fn payload(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32 + 2 * self.scopes.ports.len());
        b.push(VERSION);
        // The ids' hex, as bytes: their one form is checked at parse.
        b.extend(hex::decode(&self.key.as_str()[4..]).unwrap_or_default());
        b.extend(hex::decode(&self.sandbox.as_str()[3..]).unwrap_or_default());
        b.extend(self.expires_at.to_be_bytes());
        b.push(self.scopes.bits);
        b.push(self.scopes.ports.len() as u8);
        for p in &self.scopes.ports {
            b.extend(p.to_be_bytes());
        }
        b.extend(self.nonce);
        b
    }

    fn mac_of(&self, secret: &[u8]) -> [u8; MAC_LEN] {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return [0; MAC_LEN] };
        mac.update(MAC_CONTEXT);
        mac.update(&self.payload());
        mac.finalize().into_bytes().into()
    }

    /// Whether the token's MAC is the one `secret` makes (compared in
    /// constant time).
    pub fn verify(&self, secret: &[u8]) -> bool {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return false };
        mac.update(MAC_CONTEXT);
        mac.update(&self.payload());
        mac.verify_slice(&self.mac).is_ok()
    }

    /// The token text.
    pub fn token(&self) -> String {
        let mut b = self.payload();
        b.extend(self.mac);
        format!("{TOKEN_PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b))
    }

    fn sign(key: OwnerId, sandbox: SandboxId, expires_at: i64, scopes: Scopes, secret: &[u8]) -> Result<Claims> {
        let mut nonce = [0u8; NONCE_LEN];
        hutch_runtime::sys::random_bytes(&mut nonce)
            .map_err(|e| ControlError::Runtime(format!("random bytes: {e}")))?;
        let mut c = Claims { key, sandbox, expires_at, scopes, nonce, mac: [0; MAC_LEN] };
        c.mac = c.mac_of(secret);
        Ok(c)
    }
}

/// Parses a token's text into its claims, without checking its MAC.
/// Untrusted bytes: every field is bounded and in its one form (fuzzed in
/// fuzz/fuzz_targets/grant_token.rs).
pub fn parse_token(token: &str) -> std::result::Result<Claims, TokenError> {
    let body = token.strip_prefix(TOKEN_PREFIX).ok_or(TokenError::NotAGrant)?;
    if token.len() > MAX_TOKEN_LEN {
        return Err(TokenError::Malformed);
    }
    let b = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(body).map_err(|_| TokenError::Malformed)?;
    let mut r = Reader(&b);
    if r.take(1)? != [VERSION] {
        return Err(TokenError::Malformed);
    }
    let key = OwnerId::from_record(&format!("key-{}", hex::encode(r.take(6)?)));
    let sandbox = SandboxId::from_record(&format!("sb-{}", hex::encode(r.take(8)?)));
    let expires_at = i64::from_be_bytes(r.array()?);
    let bits = r.take(1)?[0];
    if bits & !ALL_BITS != 0 {
        return Err(TokenError::Malformed);
    }
    let n = usize::from(r.take(1)?[0]);
    if n > MAX_GRANT_PORTS || (bits == 0 && n == 0) {
        return Err(TokenError::Malformed);
    }
    let mut ports = Vec::with_capacity(n);
    for _ in 0..n {
        let p = u16::from_be_bytes(r.array()?);
        // Sorted and distinct, each a port a grant can name: one form.
        if crate::access::valid_port(u32::from(p)).is_err() || ports.last().is_some_and(|&last| last >= p) {
            return Err(TokenError::Malformed);
        }
        ports.push(p);
    }
    let nonce = r.array()?;
    let mac = r.array()?;
    if !r.0.is_empty() {
        return Err(TokenError::Malformed);
    }
    Ok(Claims { key, sandbox, expires_at, scopes: Scopes { bits, ports }, nonce, mac })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], TokenError> {
        if self.0.len() < n {
            return Err(TokenError::Malformed);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], TokenError> {
        self.take(N)?.try_into().map_err(|_| TokenError::Malformed)
    }
}

/// The restriction a grant puts on its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantScope {
    pub sandbox: SandboxId,
    pub scopes: Scopes,
    /// Unix milliseconds.
    pub expires_at: i64,
}

/// What a request does, as the HTTP layer names it for [`Caller::admit`].
/// Everything that is not one of the sandbox operations a grant can name
/// is `Other`, and refused to a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation<'a> {
    /// `GET` of the sandbox itself.
    Read(&'a str),
    /// Commands: start, list, signal, stdin, stream.
    Exec(&'a str),
    FilesRead(&'a str),
    FilesWrite(&'a str),
    Pty(&'a str),
    Port(&'a str, u16),
    Other,
}

impl Caller {
    /// The one check of a grant's restriction: whether this caller may do
    /// `op`. A key's caller may (its other checks follow); a grant's only
    /// what it names, on its own sandbox, before its expiry.
    pub fn admit(&self, op: Operation<'_>) -> Result<()> {
        let Some(g) = &self.grant else { return Ok(()) };
        if now_ms() >= g.expires_at {
            return Err(ControlError::GrantExpired(rfc3339(g.expires_at)));
        }
        let (sandbox, allowed, what) = match op {
            Operation::Read(s) => (s, true, "read the sandbox"),
            Operation::Exec(s) => (s, g.scopes.has(EXEC), "exec"),
            Operation::FilesRead(s) => (s, g.scopes.has(FILES_READ), "files:read"),
            Operation::FilesWrite(s) => (s, g.scopes.has(FILES_WRITE), "files:write"),
            Operation::Pty(s) => (s, g.scopes.has(PTY), "pty"),
            Operation::Port(s, p) => (s, g.scopes.port(p), "this port"),
            Operation::Other => {
                return Err(ControlError::GrantScope(
                    "a grant reaches only its sandbox's exec, files, pty and ports routes".into(),
                ))
            }
        };
        if sandbox != g.sandbox.as_str() {
            return Err(ControlError::GrantScope(format!("this grant is for sandbox {}", g.sandbox)));
        }
        if !allowed {
            return Err(ControlError::GrantScope(format!(
                "this grant does not allow {what}; it allows {}",
                g.scopes.names().join(", ")
            )));
        }
        Ok(())
    }

    /// The control plane's own guard where a sandbox is looked up: a grant
    /// reaches no other sandbox, whatever the HTTP layer named.
    pub(crate) fn admit_sandbox(&self, id: &SandboxId) -> Result<()> {
        match &self.grant {
            Some(g) if g.sandbox != *id => {
                Err(ControlError::GrantScope(format!("this grant is for sandbox {}", g.sandbox)))
            }
            _ => Ok(()),
        }
    }

    /// Refuses a grant's caller: for what a grant never does.
    pub(crate) fn no_grant(&self, what: &str) -> Result<()> {
        match self.grant {
            Some(_) => Err(ControlError::GrantScope(format!("a grant cannot {what}"))),
            None => Ok(()),
        }
    }
}

/// A key's grant secret as cached, with the signal its rotation sends.
struct KeySecret {
    secret: Vec<u8>,
    rotated: tokio::sync::watch::Sender<bool>,
}

/// The grant secrets read so far, per key id.
#[derive(Default)]
pub struct Secrets {
    by_key: Mutex<HashMap<String, Arc<KeySecret>>>,
}

impl Secrets {
    fn get(&self, key: &str) -> Option<Arc<KeySecret>> {
        self.by_key.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    fn put(&self, key: &str, secret: Vec<u8>) -> Arc<KeySecret> {
        let fresh = Arc::new(KeySecret { secret, rotated: tokio::sync::watch::channel(false).0 });
        let old = self.by_key.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned(), fresh.clone());
        if let Some(old) = old.filter(|o| o.secret != fresh.secret) {
            old.rotated.send_replace(true);
        }
        fresh
    }

    /// Forgets a key's secret (its key was revoked): its passes end.
    pub(crate) fn forget(&self, key: &str) {
        if let Some(old) = self.by_key.lock().unwrap_or_else(|p| p.into_inner()).remove(key) {
            old.rotated.send_replace(true);
        }
    }
}

fn new_secret() -> Result<String> {
    crate::ids::random_hex(32)
}

impl Control {
    /// A key's grant secret, from memory or else the store; with `make`, one
    /// is made for a key that has none yet. None: no live key, or (without
    /// `make`) no secret.
    async fn key_secret(&self, key: &OwnerId, make: bool) -> Result<Option<Arc<KeySecret>>> {
        if let Some(s) = self.grant_secrets.get(key.as_str()) {
            return Ok(Some(s));
        }
        let kid = key.to_string();
        let stored = self
            .db(move |s| {
                let mut cur = s.grant_secret(&kid)?;
                if make && cur == Some(None) {
                    // Two first mints race: the one set first wins, both read it.
                    s.set_grant_secret(&kid, &new_secret().unwrap_or_default(), true)?;
                    cur = s.grant_secret(&kid)?;
                }
                Ok(cur)
            })
            .await?;
        let Some(Some(hex_secret)) = stored else { return Ok(None) };
        let secret = hex::decode(&hex_secret).ok().filter(|s| s.len() == 32).ok_or_else(|| {
            ControlError::Runtime(format!("key {key}: its stored grant secret is malformed; rotate it"))
        })?;
        // A rotation may have cached a newer one meanwhile: keep that one.
        if let Some(s) = self.grant_secrets.get(key.as_str()) {
            return Ok(Some(s));
        }
        Ok(Some(self.grant_secrets.put(key.as_str(), secret)))
    }

    /// Mints a grant for a sandbox the caller may use (its owner's key).
    pub async fn create_grant(&self, caller: &Caller, sid: &SandboxId, req: &CreateGrant) -> Result<Grant> {
        caller.no_grant("mint grants")?;
        let scopes = Scopes::parse(&req.scopes)?;
        if !(1..=MAX_GRANT_SECONDS).contains(&req.ttl_seconds) {
            return Err(ControlError::Invalid(format!("ttl_seconds must be 1 to {MAX_GRANT_SECONDS}")));
        }
        let r = self.record_here(caller, sid, crate::control::Need::Use).await?;
        if matches!(r.state, SandboxState::Terminating | SandboxState::Terminated) {
            return Err(ControlError::NotRunning { id: sid.to_string(), state: r.state });
        }
        let secret =
            self.key_secret(&caller.owner, true).await?.ok_or(ControlError::Unauthorized("the key was revoked"))?;
        let expires_at = now_ms() + req.ttl_seconds as i64 * 1000;
        let claims = Claims::sign(caller.owner.clone(), sid.clone(), expires_at, scopes, &secret.secret)?;
        Ok(Grant {
            token: claims.token(),
            scopes: claims.scopes.names(),
            expires_at: rfc3339(expires_at),
            sandbox_id: sid.to_string(),
        })
    }

    /// Replaces a key's grant secret: every grant it minted is refused from
    /// now on. The key's own holder or an admin.
    pub async fn rotate_grant_secret(&self, caller: &Caller, key: &OwnerId) -> Result<GrantSecretRotated> {
        caller.no_grant("rotate a grant secret")?;
        if !caller.may_manage(key.as_str()) {
            return Err(ControlError::NoKey(key.to_string()));
        }
        let secret = new_secret()?;
        let (kid, s2) = (key.to_string(), secret.clone());
        if !self.db(move |s| s.set_grant_secret(&kid, &s2, false)).await? {
            return Err(ControlError::NoKey(key.to_string()));
        }
        let raw = hex::decode(&secret).map_err(|e| ControlError::Runtime(format!("grant secret: {e}")))?;
        self.grant_secrets.put(key.as_str(), raw);
        Ok(GrantSecretRotated { key_id: key.to_string(), rotated_at: rfc3339(now_ms()) })
    }

    /// The caller a bearer credential of the native API makes: an API key,
    /// or a grant (`hg_`), whose restriction the caller carries. None for
    /// an unknown key, a malformed grant or one whose MAC does not check
    /// (a rotated secret); an expired grant is `grant_expired`.
    pub async fn authenticate_native(&self, secret: &str) -> Result<Option<Caller>> {
        if !secret.starts_with(TOKEN_PREFIX) {
            return self.authenticate(secret).await;
        }
        let Some(claims) = self.check_grant(secret).await? else { return Ok(None) };
        let scope = GrantScope { sandbox: claims.sandbox, scopes: claims.scopes, expires_at: claims.expires_at };
        Ok(Some(Caller { grant: Some(Arc::new(scope)), ..Caller::key(claims.key, false) }))
    }

    /// A grant token's claims if its MAC checks under its key's current
    /// secret and it has not expired.
    async fn check_grant(&self, token: &str) -> Result<Option<Claims>> {
        let Ok(claims) = parse_token(token) else { return Ok(None) };
        if self.is_revoked(&claims.key) {
            return Ok(None);
        }
        let Some(secret) = self.key_secret(&claims.key, false).await? else { return Ok(None) };
        if !claims.verify(&secret.secret) {
            return Ok(None);
        }
        if now_ms() >= claims.expires_at {
            return Err(ControlError::GrantExpired(rfc3339(claims.expires_at)));
        }
        Ok(Some(claims))
    }

    /// The port proxy's check of a grant token for `port` of sandbox `id`:
    /// the grant names that port of that sandbox. The pass ends at the
    /// grant's expiry or its key's next rotation.
    pub(crate) async fn grant_pass(&self, id: &str, port: u16, token: &str) -> Result<crate::access::AccessPass> {
        let claims = self
            .check_grant(token)
            .await
            .map_err(|e| match e {
                ControlError::GrantExpired(at) => ControlError::AccessTokenExpired(at),
                e => e,
            })?
            .ok_or(ControlError::AccessTokenInvalid("the access token is not valid"))?;
        if claims.sandbox.as_str() != id || !claims.scopes.port(port) {
            return Err(ControlError::AccessTokenWrongTarget);
        }
        let secret = self
            .grant_secrets
            .get(claims.key.as_str())
            .ok_or(ControlError::AccessTokenInvalid("the access token was revoked"))?;
        Ok(crate::access::AccessPass::new(
            format!("grant-{}", hex::encode(claims.nonce)),
            id.to_owned(),
            port,
            claims.expires_at,
            secret.rotated.subscribe(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scopes(names: &[&str]) -> Result<Scopes> {
        Scopes::parse(&names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
    }

    fn claims(secret: &[u8]) -> Claims {
        Claims::sign(
            OwnerId::from_record("key-0123456789ab"),
            SandboxId::from_record("sb-0123456789abcdef"),
            now_ms() + 60_000,
            scopes(&["ports:8000", "exec", "files:read"]).expect("scopes"),
            secret,
        )
        .expect("sign")
    }

    #[test]
    fn scopes_are_known_names_each_once() {
        let s = scopes(&["pty", "ports:8000", "exec", "ports:80"]).expect("ok");
        assert_eq!(s.names(), ["exec", "pty", "ports:80", "ports:8000"]);
        for bad in [
            &[][..],
            &["admin"],
            &["exec", "exec"],
            &["ports:0"],
            &["ports:65535"],
            &["ports:+80"],
            &["ports:"],
            &["ports:80", "ports:80"],
            &["files"],
        ] {
            assert!(matches!(scopes(bad), Err(ControlError::Invalid(_))), "{bad:?}");
        }
        let many: Vec<String> = (1..=17).map(|p| format!("ports:{p}")).collect();
        assert!(Scopes::parse(&many).is_err());
    }

    #[test]
    fn a_token_round_trips_and_checks_only_under_its_secret() {
        let c = claims(&[7; 32]);
        let token = c.token();
        assert!(token.starts_with("hg_") && token.len() <= MAX_TOKEN_LEN, "{token}");
        let back = parse_token(&token).expect("parse");
        assert_eq!(back, c);
        assert!(back.verify(&[7; 32]));
        assert!(!back.verify(&[8; 32]), "a rotated secret refuses it");
        // Any changed claim breaks the MAC.
        let mut other = back.clone();
        other.sandbox = SandboxId::from_record("sb-0123456789abcdee");
        assert!(!other.verify(&[7; 32]));
        let mut wider = back.clone();
        wider.scopes.bits |= PTY;
        assert!(!wider.verify(&[7; 32]));
    }

    #[test]
    fn malformed_tokens_are_refused() {
        let token = claims(&[1; 32]).token();
        assert_eq!(parse_token("hutch_abc"), Err(TokenError::NotAGrant));
        assert_eq!(parse_token("hg_"), Err(TokenError::Malformed));
        assert_eq!(parse_token(&token[..token.len() - 1]), Err(TokenError::Malformed));
        assert_eq!(parse_token(&format!("{token}A")), Err(TokenError::Malformed));
        assert_eq!(parse_token(&format!("hg_{}", "A".repeat(400))), Err(TokenError::Malformed));
    }

    #[test]
    fn a_grant_admits_only_what_it_names_on_its_sandbox() {
        let g = GrantScope {
            sandbox: SandboxId::from_record("sb-0123456789abcdef"),
            scopes: scopes(&["exec", "ports:8000"]).expect("scopes"),
            expires_at: now_ms() + 60_000,
        };
        let c = Caller { grant: Some(Arc::new(g)), ..Caller::key(OwnerId::from_record("key-0123456789ab"), false) };
        let me = "sb-0123456789abcdef";
        assert!(c.admit(Operation::Read(me)).is_ok());
        assert!(c.admit(Operation::Exec(me)).is_ok());
        assert!(c.admit(Operation::Port(me, 8000)).is_ok());
        for op in [
            Operation::FilesRead(me),
            Operation::FilesWrite(me),
            Operation::Pty(me),
            Operation::Port(me, 8001),
            Operation::Exec("sb-0123456789abcdee"),
            Operation::Read("sb-0123456789abcdee"),
            Operation::Other,
        ] {
            assert!(matches!(c.admit(op), Err(ControlError::GrantScope(_))), "{op:?}");
        }
        let expired = GrantScope { expires_at: now_ms() - 1, ..(**c.grant.as_ref().expect("grant")).clone() };
        let c = Caller { grant: Some(Arc::new(expired)), ..c };
        assert!(matches!(c.admit(Operation::Exec(me)), Err(ControlError::GrantExpired(_))));
        let key = Caller::key(OwnerId::from_record("key-0123456789ab"), false);
        assert!(key.admit(Operation::Other).is_ok());
    }
}
