//! Port access: short-lived credentials (grants) for one port of one
//! sandbox, the check the proxy makes on every request, and the connection
//! to the port itself.
//!
//! Grants live in memory only: they last at most five minutes, and a daemon
//! restart revokes them all (it also drops every proxied connection). A
//! token is 32 random bytes, base64url; only its SHA-256 is kept. Each grant
//! carries a signal that fires when it is revoked, so the proxy can close
//! the connections that used it at once; expiry is a deadline the proxy
//! waits for beside it. Revoked and expired grants stay known for a while
//! (as tombstones) so that their tokens are refused with a precise reason.

use crate::control::{now_ms, Control, Need};
use crate::error::{ControlError, Result};
use crate::ids::{random_hex, Caller, SandboxId};
use hutch_api::{CreateAccess, SandboxState, MAX_ACCESS_PORT, MAX_ACCESS_SECONDS};
use hutch_runtime::portconnect::{NetNs, PortError};
use hutch_store::SandboxRecord;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Live grants one sandbox may hold at once.
pub const GRANTS_PER_SANDBOX: usize = 64;
/// How long a revoked or expired grant stays known after its expiry.
const TOMBSTONE_MS: i64 = 10 * 60 * 1000;

struct Grant {
    id: String,
    sandbox: String,
    port: u16,
    expires_at: i64,
    /// Set to true once, at revocation.
    revoked: tokio::sync::watch::Sender<bool>,
}

impl Grant {
    fn is_revoked(&self) -> bool {
        *self.revoked.borrow()
    }

    fn is_live(&self, now: i64) -> bool {
        !self.is_revoked() && now < self.expires_at
    }
}

/// The grants of every sandbox, and the network namespace handles the
/// proxy connects through.
#[derive(Default)]
pub struct Grants {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_hash: HashMap<[u8; 32], Arc<Grant>>,
    netns: HashMap<String, Arc<NetNs>>,
    /// Per sandbox: the pass of requests by E2B's host names.
    ingress: HashMap<String, Arc<Grant>>,
    /// Older passes of the same, until they expire.
    ingress_old: Vec<Arc<Grant>>,
}

impl Grants {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Revokes every grant of a sandbox and forgets its namespace handle:
    /// the sandbox is being destroyed or suspended.
    pub(crate) fn revoke_sandbox(&self, sandbox: &str) -> usize {
        let mut inner = self.lock();
        inner.netns.remove(sandbox);
        if let Some(g) = inner.ingress.remove(sandbox) {
            g.revoked.send_replace(true);
        }
        inner.ingress_old.retain(|g| {
            let mine = g.sandbox == sandbox;
            if mine {
                g.revoked.send_replace(true);
            }
            !mine
        });
        revoke_where(&inner, |g| g.sandbox == sandbox)
    }

    /// The pass of requests that reach a sandbox by E2B's host names: one
    /// per sandbox, revoked (and replaced by a new one) when the sandbox is
    /// paused or ends.
    fn ingress_pass(&self, sandbox: &str, port: u16) -> AccessPass {
        let mut inner = self.lock();
        let now = now_ms();
        let fresh = inner.ingress.get(sandbox).filter(|g| g.expires_at - now > INGRESS_MS / 2).cloned();
        let g = match fresh {
            Some(g) => g,
            None => {
                // Connections that use the older pass keep it to its end.
                let g = Arc::new(Grant {
                    id: format!("e2b-{sandbox}-{now}"),
                    sandbox: sandbox.to_owned(),
                    port: 0,
                    expires_at: now + INGRESS_MS,
                    revoked: tokio::sync::watch::channel(false).0,
                });
                if let Some(old) = inner.ingress.insert(sandbox.to_owned(), g.clone()) {
                    // Its connections still wait for its end: revoked
                    // with the sandbox like the new one.
                    inner.ingress_old.retain(|g| g.expires_at > now);
                    inner.ingress_old.push(old);
                }
                g
            }
        };
        AccessPass {
            grant_id: g.id.clone(),
            sandbox: g.sandbox.clone(),
            port,
            expires_at: g.expires_at,
            revoked: g.revoked.subscribe(),
        }
    }
}

/// How long one E2B ingress pass lasts at most (a connection that used it
/// ends then; a new request gets a new pass).
const INGRESS_MS: i64 = 24 * 3600 * 1000;

/// Revokes the live grants that `pick` selects; returns how many.
fn revoke_where(inner: &Inner, pick: impl Fn(&Grant) -> bool) -> usize {
    let mut n = 0;
    for g in inner.by_hash.values().filter(|g| pick(g) && !g.is_revoked()) {
        g.revoked.send_replace(true);
        n += 1;
    }
    n
}

/// A grant just made, with its token (shown once).
#[derive(Debug, Clone)]
pub struct NewGrant {
    pub id: String,
    pub port: u16,
    pub token: String,
    /// Unix milliseconds.
    pub expires_at: i64,
}

/// A live grant as listed.
#[derive(Debug, Clone)]
pub struct GrantInfo {
    pub id: String,
    pub port: u16,
    pub expires_at: i64,
}

/// Why a pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassEnd {
    Revoked,
    Expired,
}

/// A checked credential for one request: which grant it is, and a way to
/// wait for the grant's end.
#[derive(Debug, Clone)]
pub struct AccessPass {
    pub grant_id: String,
    pub sandbox: String,
    pub port: u16,
    /// Unix milliseconds.
    pub expires_at: i64,
    revoked: tokio::sync::watch::Receiver<bool>,
}

impl AccessPass {
    pub(crate) fn new(
        grant_id: String,
        sandbox: String,
        port: u16,
        expires_at: i64,
        revoked: tokio::sync::watch::Receiver<bool>,
    ) -> AccessPass {
        AccessPass { grant_id, sandbox, port, expires_at, revoked }
    }

    /// Completes when the grant is revoked or expires.
    pub async fn ended(&self) -> PassEnd {
        let mut revoked = self.revoked.clone();
        let left = Duration::from_millis((self.expires_at - now_ms()).max(0) as u64);
        tokio::select! {
            // A closed channel means the grant was forgotten: as good as revoked.
            _ = revoked.wait_for(|r| *r) => PassEnd::Revoked,
            _ = tokio::time::sleep(left) => PassEnd::Expired,
        }
    }
}

fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A port the proxy may serve: 1 to 65532.
pub fn valid_port(port: u32) -> Result<u16> {
    match u16::try_from(port) {
        Ok(p) if (1..=MAX_ACCESS_PORT).contains(&p) => Ok(p),
        _ => Err(ControlError::Invalid(format!(
            "port must be 1 to {MAX_ACCESS_PORT} (65533 and above are reserved), not {port}"
        ))),
    }
}

impl Control {
    /// Whether the sandbox's policy lets the proxy reach `port` at all: the
    /// one place for policy checks on port access. Nothing connects into a
    /// `deny_all` sandbox, the proxy included: `sandbox_network_isolated`.
    /// It runs when a grant is made; no grant means no proxied request. A
    /// sandbox's policy is fixed for its life, so no grant outlives a
    /// change of it.
    pub(crate) fn check_port_access(&self, sandbox: &SandboxRecord, _port: u16) -> Result<()> {
        let net = crate::network::NetRecord::parse(&sandbox.network);
        // E2B's egress rules say nothing of what comes in: an E2B sandbox
        // without internet still serves its ports, as on E2B.
        if net.egress == hutch_api::Egress::DenyAll && net.e2b.is_none() {
            return Err(ControlError::NetworkIsolated(sandbox.id.clone()));
        }
        Ok(())
    }

    /// Checks a request for `port` of sandbox `id` by E2B's host name: the
    /// sandbox exists and may be reached (its policy, through
    /// [`Control::check_port_access`]), the traffic token is its own unless
    /// it is public (a sandbox the E2B API did not make is not), and it
    /// runs; a suspended or paused one with `auto_resume` is resumed first. The pass
    /// ends when the sandbox is paused or ends (connections that used it
    /// close); with it comes the Host to send, when the sandbox masks it.
    pub async fn authorize_e2b_port(
        self: &Arc<Self>,
        id: &SandboxId,
        port: u16,
        token: Option<&str>,
    ) -> Result<(AccessPass, Option<String>)> {
        let gone = || ControlError::NoSandbox(id.to_string());
        if self.live(id).is_some_and(|l| l.is_pooled() || self.is_revoked(&l.owner)) {
            return Err(gone());
        }
        let r = self.sandbox_record(id).await?.ok_or_else(gone)?;
        if r.pooled || !matches!(r.state, SandboxState::Running | SandboxState::Suspended | SandboxState::Paused) {
            return Err(gone());
        }
        self.check_port_access(&r, port)?;
        let settings = crate::network::NetRecord::parse(&r.network).e2b;
        let public = settings.as_ref().is_some_and(|s| s.public);
        if !public {
            match token.map(str::trim).filter(|t| !t.is_empty()) {
                None => return Err(ControlError::AccessTokenRequired),
                Some(t) if !self.is_traffic_token(id, t) => {
                    return Err(ControlError::AccessTokenInvalid("the traffic access token is not valid"))
                }
                Some(_) => {}
            }
        }
        // Suspended in memory, or paused to disk (resumed on its files).
        let suspended = self.live(id).is_some_and(|l| l.is_suspended())
            || matches!(r.state, SandboxState::Suspended | SandboxState::Paused);
        if suspended {
            if !settings.as_ref().is_some_and(|s| s.auto_resume) {
                return Err(ControlError::NotRunning { id: id.to_string(), state: r.state });
            }
            let owner = Caller::key(crate::ids::OwnerId::from_record(&r.owner), false);
            self.resume(&owner, id).await?;
            self.log(id, crate::history::LogLevel::Info, format!("resumed by a request to port {port}"), &[]);
        }
        let mask = settings.and_then(|s| s.mask_request_host).map(|m| crate::e2b::masked_host(&m, port));
        Ok((self.access.ingress_pass(id.as_str(), port), mask))
    }

    /// Makes a grant for one port of a running sandbox of `owner`.
    pub async fn create_access(&self, caller: &Caller, sid: &SandboxId, req: &CreateAccess) -> Result<NewGrant> {
        let r = self.record_here(caller, sid, Need::Use).await?;
        self.running(caller, sid).await?;
        let id = sid.as_str();
        let port = valid_port(u32::from(req.port))?;
        let secs = req.expires_in_seconds.unwrap_or(MAX_ACCESS_SECONDS);
        if !(1..=MAX_ACCESS_SECONDS).contains(&secs) {
            return Err(ControlError::Invalid(format!("expires_in_seconds must be 1 to {MAX_ACCESS_SECONDS}")));
        }
        self.check_port_access(&r, port)?;
        let now = now_ms();
        let expires_at = (now + secs as i64 * 1000).min(r.expires_at);
        if expires_at <= now {
            return Err(ControlError::NotRunning { id: id.to_owned(), state: SandboxState::Terminating });
        }
        let mut raw = [0u8; 32];
        hutch_runtime::sys::random_bytes(&mut raw).map_err(|e| ControlError::Runtime(format!("random bytes: {e}")))?;
        use base64::Engine;
        let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        let grant_id = format!("ag-{}", random_hex(8)?);
        let mut inner = self.access.lock();
        inner.by_hash.retain(|_, g| g.expires_at + TOMBSTONE_MS > now);
        let live = inner.by_hash.values().filter(|g| g.sandbox == id && g.is_live(now)).count();
        if live >= GRANTS_PER_SANDBOX {
            return Err(ControlError::AccessGrantCapacity { id: id.to_owned(), max: GRANTS_PER_SANDBOX });
        }
        let (revoked, _) = tokio::sync::watch::channel(false);
        let grant = Grant { id: grant_id.clone(), sandbox: id.to_owned(), port, expires_at, revoked };
        inner.by_hash.insert(token_hash(&token), Arc::new(grant));
        Ok(NewGrant { id: grant_id, port, token, expires_at })
    }

    /// The live grants of a sandbox of `owner`, soonest to expire first.
    pub async fn list_access(&self, caller: &Caller, sid: &SandboxId) -> Result<Vec<GrantInfo>> {
        self.record(caller, sid, Need::Manage).await?;
        let id = sid.as_str();
        let now = now_ms();
        let inner = self.access.lock();
        let mut out: Vec<GrantInfo> = inner
            .by_hash
            .values()
            .filter(|g| g.sandbox == id && g.is_live(now))
            .map(|g| GrantInfo { id: g.id.clone(), port: g.port, expires_at: g.expires_at })
            .collect();
        out.sort_by(|a, b| (a.expires_at, &a.id).cmp(&(b.expires_at, &b.id)));
        Ok(out)
    }

    /// Revokes one grant; revoking it again (or after it expired) is a no-op.
    pub async fn revoke_access(&self, caller: &Caller, sid: &SandboxId, grant_id: &str) -> Result<()> {
        self.record_here(caller, sid, Need::Manage).await?;
        let id = sid.as_str();
        let inner = self.access.lock();
        if !inner.by_hash.values().any(|g| g.sandbox == id && g.id == grant_id) {
            return Err(ControlError::NoGrant(grant_id.to_owned()));
        }
        revoke_where(&inner, |g| g.sandbox == id && g.id == grant_id);
        Ok(())
    }

    /// Revokes every grant of a sandbox; returns how many were live.
    pub async fn revoke_all_access(&self, caller: &Caller, sid: &SandboxId) -> Result<usize> {
        self.record_here(caller, sid, Need::Manage).await?;
        Ok(revoke_where(&self.access.lock(), |g| g.sandbox == sid.as_str()))
    }

    /// Checks a request of the proxy for `port` of sandbox `id`: the sandbox
    /// exists (else not found), the token is a live grant for exactly this
    /// sandbox and port, and the sandbox runs. A running sandbox is found in
    /// memory; only the others cost a store read.
    pub async fn authorize_access(&self, id: &str, port: u16, token: Option<&str>) -> Result<AccessPass> {
        let sid = SandboxId::parse(id)?;
        let not_running = match self.live(&sid) {
            // The owner's key was revoked: its sandboxes are on their way out.
            Some(live) if self.is_revoked(&live.owner) => return Err(ControlError::NoSandbox(id.to_owned())),
            Some(live) if live.is_pooled() => return Err(ControlError::NoSandbox(id.to_owned())),
            Some(live) if live.is_suspended() => Some(SandboxState::Suspended),
            Some(_) => None,
            None => match self.sandbox_record(&sid).await? {
                Some(r) if !r.pooled && r.state != SandboxState::Terminated => Some(r.state),
                _ => return Err(ControlError::NoSandbox(id.to_owned())),
            },
        };
        let token = token.map(str::trim).filter(|t| !t.is_empty()).ok_or(ControlError::AccessTokenRequired)?;
        if token.starts_with(crate::grants::TOKEN_PREFIX) {
            let pass = self.grant_pass(id, port, token).await?;
            if let Some(state) = not_running {
                return Err(ControlError::NotRunning { id: id.to_owned(), state });
            }
            return Ok(pass);
        }
        if token.len() > 256 {
            return Err(ControlError::AccessTokenInvalid("the access token is malformed"));
        }
        let grant = self
            .access
            .lock()
            .by_hash
            .get(&token_hash(token))
            .cloned()
            .ok_or(ControlError::AccessTokenInvalid("the access token is not valid"))?;
        if grant.is_revoked() {
            return Err(ControlError::AccessTokenInvalid("the access token was revoked"));
        }
        if now_ms() >= grant.expires_at {
            return Err(ControlError::AccessTokenExpired(crate::control::rfc3339(grant.expires_at)));
        }
        if grant.sandbox != id || grant.port != port {
            return Err(ControlError::AccessTokenWrongTarget);
        }
        if let Some(state) = not_running {
            return Err(ControlError::NotRunning { id: id.to_owned(), state });
        }
        Ok(AccessPass {
            grant_id: grant.id.clone(),
            sandbox: grant.sandbox.clone(),
            port,
            expires_at: grant.expires_at,
            revoked: grant.revoked.subscribe(),
        })
    }

    /// A TCP connection to `port` on the loopback of running sandbox `id`,
    /// made from inside its network namespace. The caller has checked the
    /// credential ([`Control::authorize_access`]).
    pub async fn connect_port(&self, id: &str, port: u16) -> Result<tokio::net::TcpStream> {
        let not_running = |state| ControlError::NotRunning { id: id.to_owned(), state };
        let sid = SandboxId::parse(id)?;
        let live = self.live(&sid).ok_or_else(|| not_running(SandboxState::Terminated))?;
        if live.is_suspended() {
            return Err(not_running(SandboxState::Suspended));
        }
        let cached = self.access.lock().netns.get(id).cloned();
        let ns = match cached {
            Some(ns) => ns,
            None => {
                let guard = live.handle.lock().map_err(|_| ControlError::Runtime("sandbox lock poisoned".into()))?;
                let sb = guard.as_ref().ok_or_else(|| not_running(SandboxState::Terminating))?;
                let ns = Arc::new(sb.net_ns().map_err(|_| not_running(SandboxState::Terminated))?);
                drop(guard);
                self.access.lock().netns.insert(id.to_owned(), ns.clone());
                ns
            }
        };
        match ns.connect(port).await {
            Ok(stream) => Ok(stream),
            Err(e @ (PortError::Refused { .. } | PortError::Timeout { .. })) => {
                Err(ControlError::PortUnreachable(e.to_string()))
            }
            Err(PortError::Gone(_)) => {
                self.access.lock().netns.remove(id);
                Err(not_running(SandboxState::Terminated))
            }
            Err(e @ PortError::Io { .. }) => Err(ControlError::Runtime(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_bounded_and_the_top_is_reserved() {
        assert!(valid_port(0).is_err());
        assert_eq!(valid_port(1).expect("1"), 1);
        assert_eq!(valid_port(65532).expect("65532"), 65532);
        for p in [65533, 65535, 65536, 100_000] {
            assert!(matches!(valid_port(p), Err(ControlError::Invalid(_))), "{p}");
        }
    }

    #[tokio::test]
    async fn a_pass_ends_at_revocation_or_expiry() {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let pass = AccessPass {
            grant_id: "ag-1".into(),
            sandbox: "sb-1".into(),
            port: 80,
            expires_at: now_ms() + 60_000,
            revoked: rx,
        };
        {
            let ended = pass.ended();
            tokio::pin!(ended);
            // Polled once: waiting, not ended, before the revocation.
            assert!(tokio::time::timeout(Duration::ZERO, &mut ended).await.is_err(), "ended before its revocation");
            tx.send_replace(true);
            assert_eq!(ended.await, PassEnd::Revoked);
        }
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let soon = AccessPass { expires_at: now_ms() + 50, revoked: rx, ..pass };
        assert_eq!(tokio::time::timeout(Duration::from_secs(2), soon.ended()).await.expect("ends"), PassEnd::Expired);
    }
}
