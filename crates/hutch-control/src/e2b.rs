//! Credentials of the E2B API's in-sandbox (envd) calls, checked here so
//! that every entry point meets the same owner check: a sandbox's access
//! token, and signed `/files` URLs.
//!
//! Access tokens are stateless: HMAC-SHA256 of the sandbox id under a
//! daemon secret kept in the state directory (`e2b.secret`), so they
//! survive restarts like the sandboxes do, and are revoked for every
//! sandbox at once by replacing the secret. A token alone is not enough:
//! the sandbox must run (or start) and its owner's key must be live, on
//! every call, so revoking a key cuts its sandboxes' tokens off at once.
//!
//! A signed URL (the SDK's `download_url`/`upload_url`) is
//! `v1_` + base64 (unpadded) of SHA-256 over
//! `path:operation:username:token[:expiration]`: it binds the path, the
//! operation and the sandbox user, so the call runs as that user and as
//! no other.

use crate::control::{now_ms, Control};
use crate::error::{ControlError, Result};
use crate::ids::{OwnerId, SandboxId};
use crate::network::{E2bNetwork, MAX_RULES};
use crate::session::EnvdSession;
use base64::Engine;
use hmac::{Hmac, Mac};
use hutch_api::SandboxState;
use hutch_api::{Egress, NetworkRequest};
use hutch_runtime::net::Rule;
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use subtle::ConstantTimeEq;

/// What a `/files` URL was signed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// The signature parameters of a `/files` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedUrl {
    pub path: String,
    pub operation: Operation,
    /// The `username` parameter, as signed (empty: the default user).
    pub username: String,
    pub signature: String,
    /// Unix seconds.
    pub expiration: Option<i64>,
}

/// The envd access token of a sandbox under `secret`.
pub fn access_token(secret: &[u8], sandbox: &str) -> String {
    // HMAC takes keys of any length; the error arm cannot happen.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return String::new() };
    mac.update(sandbox.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// Compares in constant time (lengths are not secret).
pub(crate) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

impl SignedUrl {
    /// The signature a URL for this path, operation and user gets under the
    /// sandbox's `token`.
    pub(crate) fn expected(&self, token: &str) -> String {
        let raw = match self.expiration {
            None => format!("{}:{}:{}:{token}", self.path, self.operation.as_str(), self.username),
            Some(e) => format!("{}:{}:{}:{token}:{e}", self.path, self.operation.as_str(), self.username),
        };
        format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes())))
    }

    /// The sandbox user the URL was signed for.
    pub fn user(&self) -> &str {
        if self.username.is_empty() {
            "user"
        } else {
            &self.username
        }
    }
}

/// E2B's egress rules as a hutch policy, or `None` when they ask nothing
/// (the template's policy stands). E2B's rules: `denyOut` holds addresses
/// and CIDRs, `allowOut` addresses, CIDRs and names, an allowed entry wins
/// over a denied one, names need everything else denied (`0.0.0.0/0` in
/// `denyOut`, or `allow_internet_access: false`), which blocks all
/// traffic but what is allowed. So: everything blocked is `deny_all` when
/// nothing is allowed, else an allow list; otherwise the denied ranges
/// minus the allowed ones are a deny list. Addresses are checked as E2B
/// checks them (an unspecified address only as `0.0.0.0/0`).
pub fn egress_policy(net: &E2bNetwork) -> Result<Option<NetworkRequest>> {
    let bad = |m: String| ControlError::Invalid(m);
    let mut deny = Vec::new();
    let mut block_all = net.allow_internet_access == Some(false);
    for d in &net.deny_out {
        let d = d.trim();
        if d == ALL_TRAFFIC {
            block_all = true;
            continue;
        }
        deny.push(specified_cidr(d).ok_or_else(|| bad(format!("invalid denied CIDR {d}")))?);
    }
    let mut allow_cidrs = Vec::new();
    let mut names = Vec::new();
    for a in &net.allow_out {
        let a = a.trim();
        if let Some(c) = specified_cidr(a) {
            allow_cidrs.push(c);
            continue;
        }
        if a.parse::<IpAddr>().is_ok() || a.contains('/') {
            return Err(bad(format!("invalid allowed address {a}")));
        }
        if a == "*" {
            return Err(bad("allowing every name (`*`) is not supported: deny less instead".into()));
        }
        match Rule::parse(a) {
            Ok(Rule::Domain(_)) => names.push(a.to_owned()),
            _ => return Err(bad(format!("invalid allowed address {a}"))),
        }
    }
    if !names.is_empty() && !block_all {
        return Err(bad(
            "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out to block all \
             other traffic."
                .into(),
        ));
    }
    if block_all {
        let allow: Vec<String> = allow_cidrs.iter().map(|(a, l)| format!("{a}/{l}")).chain(names).collect();
        if allow.is_empty() {
            return Ok(Some(NetworkRequest { egress: Egress::DenyAll, ..NetworkRequest::default() }));
        }
        if allow.len() > MAX_RULES {
            return Err(bad(format!("at most {MAX_RULES} allowed entries")));
        }
        return Ok(Some(NetworkRequest { egress: Egress::Default, allow, deny: vec![] }));
    }
    if deny.is_empty() {
        // Allowed entries without denied ones change nothing, as on E2B.
        return Ok((net.allow_internet_access.is_some() || !net.allow_out.is_empty()).then(NetworkRequest::default));
    }
    let left = subtract(&deny, &allow_cidrs, MAX_RULES)
        .ok_or_else(|| bad(format!("the denied ranges minus the allowed ones need more than {MAX_RULES} CIDRs")))?;
    Ok(Some(NetworkRequest {
        egress: Egress::Default,
        allow: vec![],
        deny: left.iter().map(|(a, l)| format!("{a}/{l}")).collect(),
    }))
}

/// E2B's name for every IPv4 address.
const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// An address or CIDR that is not unspecified, normalized to its network.
fn specified_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => {
            let a: IpAddr = a.parse().ok()?;
            let max = if a.is_ipv4() { 32 } else { 128 };
            let l: u8 = l.parse::<u8>().ok().filter(|l| *l <= max)?;
            (a, l)
        }
        None => {
            let a: IpAddr = s.parse().ok()?;
            (a, if a.is_ipv4() { 32 } else { 128 })
        }
    };
    if addr.is_unspecified() {
        return None;
    }
    Some(network_of(addr, len))
}

/// The first address of `addr/len` (the host bits cleared).
fn network_of(addr: IpAddr, len: u8) -> (IpAddr, u8) {
    match addr {
        IpAddr::V4(a) => {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len)) };
            (IpAddr::V4((u32::from(a) & mask).into()), len)
        }
        IpAddr::V6(a) => {
            let mask = if len == 0 { 0 } else { u128::MAX << (128 - u32::from(len)) };
            (IpAddr::V6((u128::from(a) & mask).into()), len)
        }
    }
}

/// Whether `inner` lies within `outer` (same family).
fn within(inner: (IpAddr, u8), outer: (IpAddr, u8)) -> bool {
    inner.0.is_ipv4() == outer.0.is_ipv4() && inner.1 >= outer.1 && network_of(inner.0, outer.1) == outer
}

/// The two halves of a CIDR one bit longer.
fn halves((addr, len): (IpAddr, u8)) -> [(IpAddr, u8); 2] {
    match addr {
        IpAddr::V4(a) => {
            let bit = 1u32 << (31 - u32::from(len));
            [(addr, len + 1), (IpAddr::V4((u32::from(a) | bit).into()), len + 1)]
        }
        IpAddr::V6(a) => {
            let bit = 1u128 << (127 - u32::from(len));
            [(addr, len + 1), (IpAddr::V6((u128::from(a) | bit).into()), len + 1)]
        }
    }
}

/// The CIDRs that cover `from` minus `minus`, at most `max` of them (else
/// `None`). Pure: a fuzz target's input is any two lists.
pub fn subtract(from: &[(IpAddr, u8)], minus: &[(IpAddr, u8)], max: usize) -> Option<Vec<(IpAddr, u8)>> {
    let mut out = Vec::new();
    let mut todo: Vec<(IpAddr, u8)> = from.iter().rev().map(|&(a, l)| network_of(a, l)).collect();
    while let Some(c) = todo.pop() {
        if minus.iter().any(|&m| within(c, network_of(m.0, m.1))) {
            continue;
        }
        if !minus.iter().any(|&m| within(network_of(m.0, m.1), c)) {
            if !out.contains(&c) {
                out.push(c);
            }
            if out.len() > max {
                return None;
            }
            continue;
        }
        let [lo, hi] = halves(c);
        todo.push(hi);
        todo.push(lo);
        if todo.len() > 4 * max + 256 {
            return None;
        }
    }
    Some(out)
}

/// The operator's E2B domain, checked and normalized (lower case, no
/// trailing dot): DNS labels, with an optional `:port`. Pure.
pub fn domain(s: &str) -> Option<String> {
    let s = s.trim().trim_end_matches('.').to_ascii_lowercase();
    let (name, port) = match s.rsplit_once(':') {
        Some((n, p)) => (n, Some(p)),
        None => (s.as_str(), None),
    };
    if port.is_some_and(|p| p.is_empty() || p.len() > 5 || p.parse::<u16>().map_or(true, |p| p == 0)) {
        return None;
    }
    let labels_ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    labels_ok.then_some(s)
}

/// The sandbox and port an E2B host name `<port>-<sandbox>.<domain>`
/// names, when it is under `domain` (ports on either side are ignored:
/// the request reached this daemon). Pure: a fuzz target's input is the
/// Host header.
pub fn parse_host(host: &str, domain: &str) -> Option<(u16, SandboxId)> {
    let strip = |h: &str| -> String {
        let h = h.trim().trim_end_matches('.').to_ascii_lowercase();
        match h.rsplit_once(':') {
            Some((n, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                n.trim_end_matches('.').to_owned()
            }
            _ => h,
        }
    };
    let (host, domain) = (strip(host), strip(domain));
    let label = host.strip_suffix(&domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((port.parse().ok()?, SandboxId::parse(id).ok()?))
}

/// The Host a masked request carries: `mask` with `${PORT}` replaced.
pub fn masked_host(mask: &str, port: u16) -> String {
    mask.replace("${PORT}", &port.to_string())
}

/// Whether a `mask_request_host` is a host (with an optional port, which
/// may be `${PORT}`) that can stand in a Host header. Pure.
pub fn valid_mask(mask: &str) -> bool {
    let probe = masked_host(mask, 1);
    let (name, port) = match probe.rsplit_once(':') {
        Some((n, p)) if !n.contains(':') => (n, Some(p)),
        _ => (probe.as_str(), None),
    };
    !name.is_empty()
        && probe.len() <= 255
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
        && port.is_none_or(|p| p.parse::<u16>().is_ok())
}

impl Control {
    /// The envd access token of a sandbox.
    pub fn e2b_token(&self, id: &SandboxId) -> String {
        access_token(&self.e2b_secret, id.as_str())
    }

    /// The traffic access token of a sandbox (E2B's
    /// `e2b-traffic-access-token` header for its ports): another HMAC of
    /// its id under the same key, so neither token gives the other.
    pub fn e2b_traffic_token(&self, id: &SandboxId) -> String {
        access_token(&self.e2b_secret, &format!("traffic:{}", id.as_str()))
    }

    /// The operator's E2B domain, if one is set.
    pub fn e2b_domain(&self) -> Option<&str> {
        self.e2b_domain.as_deref()
    }

    /// Whether an E2B traffic token is this sandbox's (constant time).
    pub(crate) fn is_traffic_token(&self, id: &SandboxId, token: &str) -> bool {
        same(token, &self.e2b_traffic_token(id))
    }

    /// The E2B settings of a sandbox of the caller (`None` for one the E2B
    /// API did not make).
    pub async fn e2b_settings(&self, caller: &crate::ids::Caller, id: &SandboxId) -> Result<Option<E2bNetwork>> {
        let r = self.record(caller, id, crate::control::Need::Manage).await?;
        Ok(crate::network::NetRecord::parse(&r.network).e2b)
    }

    /// Creates a sandbox for the E2B API: `settings` are kept with it, and
    /// its egress rules (when it gives any) replace the template's policy;
    /// a sandbox they close keeps an interface, so that
    /// [`Control::update_e2b_network`] can open it later.
    pub async fn create_e2b(
        self: &std::sync::Arc<Self>,
        caller: &crate::ids::Caller,
        req: &hutch_api::CreateSandbox,
        settings: E2bNetwork,
    ) -> Result<(hutch_api::Sandbox, bool)> {
        if settings.mask_request_host.as_deref().is_some_and(|m| !valid_mask(m)) {
            return Err(ControlError::Invalid("mask request host is not valid".into()));
        }
        let mut req = req.clone();
        let asked = egress_policy(&settings)?;
        let interface = asked.as_ref().is_some_and(|p| p.egress == Egress::DenyAll);
        if let Some(policy) = asked {
            req.network = Some(policy);
        }
        let opts = crate::sandboxes::CreateOptions { interface, e2b: Some(settings) };
        self.create_with(caller, &req, None, opts).await
    }

    /// Forks an E2B sandbox (E2B's `POST /sandboxes/{id}/fork`): the
    /// native fork, its children made with the parent's E2B settings (who
    /// reaches their ports, auto-resume, egress rules).
    pub async fn fork_e2b(
        self: &std::sync::Arc<Self>,
        caller: &crate::ids::Caller,
        id: &SandboxId,
        req: &hutch_api::Fork,
    ) -> Result<hutch_api::ForkResult> {
        let settings = self.e2b_settings(caller, id).await?;
        let interface = match &settings {
            Some(s) => egress_policy(s)?.is_some_and(|p| p.egress == Egress::DenyAll),
            None => false,
        };
        let opts = crate::sandboxes::CreateOptions { interface, e2b: settings };
        self.fork_with(caller, id, req, opts).await
    }

    /// Replaces the egress rules of a running E2B sandbox (E2B's `PUT
    /// /sandboxes/{id}/network`): what the request leaves out is cleared;
    /// the settings of its ports stay.
    pub async fn update_e2b_network(
        &self,
        caller: &crate::ids::Caller,
        id: &SandboxId,
        allow_out: Vec<String>,
        deny_out: Vec<String>,
        allow_internet_access: Option<bool>,
    ) -> Result<()> {
        let kept = self.e2b_settings(caller, id).await?.unwrap_or_default();
        let settings = E2bNetwork { allow_out, deny_out, allow_internet_access, ..kept };
        let policy = egress_policy(&settings)?.unwrap_or_default();
        self.update_network(caller, id, &policy, Some(settings)).await?;
        Ok(())
    }

    /// A session for a sandbox's live owner, if the sandbox runs (or starts).
    async fn envd_session(&self, id: &SandboxId, user: &str) -> Result<EnvdSession> {
        let gone = || ControlError::NoSandbox(id.to_string());
        let r = self.sandbox_record(id).await?.ok_or_else(gone)?;
        if r.pooled || !matches!(r.state, SandboxState::Running | SandboxState::Starting) {
            // Terminated, terminating or paused: envd is not reachable.
            return Err(gone());
        }
        let owner = OwnerId::from_record(&r.owner);
        self.quotas_of(&owner)
            .await
            .map_err(|_| ControlError::Unauthorized("the API key that owns this sandbox was revoked"))?;
        EnvdSession::new(id.clone(), owner, user)
    }

    /// An envd call with `X-Access-Token`, as `user`.
    pub async fn envd_by_token(&self, id: &SandboxId, token: &str, user: &str) -> Result<EnvdSession> {
        if !same(token, &self.e2b_token(id)) {
            return Err(ControlError::Unauthorized("a valid X-Access-Token is required"));
        }
        self.envd_session(id, user).await
    }

    /// A call without a credential to a sandbox's port: granted only for
    /// the code interpreter's server port of a sandbox of the interpreter's
    /// template (the caller checked that the call is one of its context
    /// routes), because E2B's SDK sends those with none. Executing code
    /// takes the access token.
    pub async fn envd_interpreter_open(
        &self,
        id: &SandboxId,
        port: u16,
        traffic_token: Option<&str>,
    ) -> Result<EnvdSession> {
        let refused = ControlError::Unauthorized("a valid X-Access-Token is required");
        if port != hutch_runtime::image::interp::PORT {
            return Err(refused);
        }
        // A sandbox that does not exist is refused like one of another
        // template: the answer says nothing about other sandboxes. Its
        // ports are open only as its E2B settings say: public, or to the
        // holder of its traffic token (`allow_public_traffic=False`).
        match self.sandbox_record(id).await? {
            Some(r) if r.template == crate::templates::INTERPRETER => {
                let public = crate::network::NetRecord::parse(&r.network).e2b.is_some_and(|s| s.public);
                if !public && !traffic_token.is_some_and(|t| self.is_traffic_token(id, t.trim())) {
                    return Err(refused);
                }
                self.envd_session(id, "user").await
            }
            _ => Err(refused),
        }
    }

    /// A `/files` call authorized by a signed URL. `named` is the sandbox
    /// the request names (its header or host); without one, the running
    /// sandboxes are tried in turn (one hash each). `basic_user` is a user
    /// named by `Authorization: Basic`, which must be the signed one.
    pub async fn envd_by_signature(
        &self,
        named: Option<&SandboxId>,
        signed: &SignedUrl,
        basic_user: Option<&str>,
    ) -> Result<EnvdSession> {
        let invalid = ControlError::Unauthorized("invalid signature");
        let id = match named {
            Some(id) => Some(id.clone()).filter(|id| same(&signed.signature, &signed.expected(&self.e2b_token(id)))),
            None => self
                .lives()
                .into_iter()
                .map(|l| l.id.clone())
                .find(|id| same(&signed.signature, &signed.expected(&self.e2b_token(id)))),
        };
        let id = id.ok_or(invalid)?;
        if signed.expiration.is_some_and(|e| e < now_ms() / 1000) {
            return Err(ControlError::Unauthorized("signature is already expired"));
        }
        if basic_user.is_some_and(|u| !u.is_empty() && u != signed.user()) {
            return Err(ControlError::Unauthorized("the URL was signed for another user"));
        }
        self.envd_session(&id, signed.user()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_hmac_sha256_of_the_sandbox_id() {
        // RFC 4231, test case 2.
        assert_eq!(
            access_token(b"Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_ne!(access_token(b"s", "a"), access_token(b"s", "b"));
        assert_ne!(access_token(b"s", "a"), access_token(b"t", "a"));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("ab", "abc"));
    }

    fn e2b(allow: &[&str], deny: &[&str], internet: Option<bool>) -> E2bNetwork {
        E2bNetwork {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            allow_internet_access: internet,
            ..E2bNetwork::default()
        }
    }

    #[test]
    fn e2b_egress_rules_become_hutch_policies() {
        let p = |allow: &[&str], deny: &[&str], internet| egress_policy(&e2b(allow, deny, internet));
        assert_eq!(p(&[], &[], None).expect("nothing"), None);
        let closed = NetworkRequest { egress: Egress::DenyAll, ..NetworkRequest::default() };
        assert_eq!(p(&[], &[], Some(false)).expect("no internet"), Some(closed.clone()));
        assert_eq!(p(&[], &["0.0.0.0/0"], None).expect("all denied"), Some(closed));
        assert_eq!(p(&[], &[], Some(true)).expect("internet"), Some(NetworkRequest::default()));
        let listed = p(&["pypi.org", "8.8.8.8"], &["0.0.0.0/0"], None).expect("a list").expect("some");
        assert_eq!((listed.egress, listed.allow), (Egress::Default, vec!["8.8.8.8/32".into(), "pypi.org".into()]));
        let denied = p(&[], &["198.51.100.7", "203.0.113.0/24"], None).expect("a deny list").expect("some");
        assert_eq!(denied.deny, vec!["198.51.100.7/32", "203.0.113.0/24"]);
        // An allowed entry wins over a denied one: it is cut out of the range.
        let cut = p(&["203.0.113.0/26"], &["203.0.113.0/24"], None).expect("cut").expect("some");
        assert_eq!(cut.deny, vec!["203.0.113.64/26", "203.0.113.128/25"]);
        // Allowed entries alone change nothing.
        assert_eq!(p(&["1.1.1.1"], &[], None).expect("allow alone"), Some(NetworkRequest::default()));
        // Refusals, with E2B's words.
        for (allow, deny) in [
            (&["pypi.org"][..], &[][..]),
            (&[], &["pypi.org"]),
            (&[], &["0.0.0.0"]),
            (&["not a name"], &["0.0.0.0/0"]),
            (&["10.0.0.0/33"], &["0.0.0.0/0"]),
            (&["*"], &["0.0.0.0/0"]),
        ] {
            assert!(matches!(p(allow, deny, None), Err(ControlError::Invalid(_))), "{allow:?} {deny:?}");
        }
        let m = p(&[], &["bad"], None).err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(m, "invalid denied CIDR bad");
    }

    #[test]
    fn subtraction_splits_ranges_and_is_bounded() {
        let c = |s: &str| specified_cidr(s).expect("cidr");
        assert_eq!(subtract(&[c("10.0.0.0/8")], &[c("10.0.0.0/8")], 64), Some(vec![]));
        assert_eq!(subtract(&[c("10.0.0.0/8")], &[c("192.0.2.0/24")], 64), Some(vec![c("10.0.0.0/8")]));
        let got = subtract(&[c("10.0.0.0/8")], &[c("10.0.0.1")], 64).expect("fits");
        assert_eq!(got.len(), 24);
        assert!(!got.iter().any(|&g| within(c("10.0.0.1"), g)));
        assert!(got.iter().all(|&g| within(g, c("10.0.0.0/8"))));
        assert_eq!(subtract(&[c("10.0.0.0/8")], &[c("10.0.0.1")], 10), None);
        assert_eq!(subtract(&[c("2001::/16")], &[c("2001::1")], 64), None);
        assert_eq!(subtract(&[c("2001:db8::/32")], &[c("10.0.0.0/8")], 64), Some(vec![c("2001:db8::/32")]));
        assert_eq!(specified_cidr("10.1.2.3/8"), Some(c("10.0.0.0/8")));
    }

    #[test]
    fn subtraction_covers_exactly_what_is_denied_and_not_allowed() {
        // Deterministic pseudo-random lists of CIDRs inside 10.0.0.0/24,
        // checked address by address.
        fn next(seed: &mut u32) -> u32 {
            *seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            *seed >> 8
        }
        fn cidr(seed: &mut u32) -> (IpAddr, u8) {
            let len = 24 + (next(seed) % 9) as u8;
            network_of(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, (next(seed) % 256) as u8)), len)
        }
        let mut seed: u32 = 0x2545_f491;
        for _ in 0..300 {
            let from: Vec<_> = (0..1 + next(&mut seed) % 3).map(|_| cidr(&mut seed)).collect();
            let minus: Vec<_> = (0..next(&mut seed) % 4).map(|_| cidr(&mut seed)).collect();
            let Some(got) = subtract(&from, &minus, 256) else { panic!("{from:?} - {minus:?} does not fit") };
            for last in 0..=255u8 {
                let a = (IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, last)), 32);
                let want = from.iter().any(|&f| within(a, f)) && !minus.iter().any(|&m| within(a, m));
                assert_eq!(got.iter().any(|&g| within(a, g)), want, "{a:?} in {from:?} - {minus:?} = {got:?}");
            }
        }
    }

    #[test]
    fn e2b_host_names_name_a_port_and_a_sandbox() {
        let sb = "sb-0123456789abcdef";
        let id = SandboxId::parse(sb).expect("id");
        assert_eq!(parse_host(&format!("8000-{sb}.e2b.test"), "e2b.test"), Some((8000, id.clone())));
        assert_eq!(parse_host(&format!("8000-{sb}.E2B.test:7700"), "e2b.test:7700"), Some((8000, id.clone())));
        assert_eq!(parse_host(&format!("49983-{sb}.e2b.test."), "e2b.test"), Some((49983, id)));
        for bad in [
            format!("8000-{sb}.other.test"),
            format!("8000-{sb}.x.e2b.test"),
            format!("x-{sb}.e2b.test"),
            format!("99999-{sb}.e2b.test"),
            format!("-{sb}.e2b.test"),
            "8000-nosuch.e2b.test".to_owned(),
            "e2b.test".to_owned(),
            format!("8000-{sb}e2b.test"),
        ] {
            assert_eq!(parse_host(&bad, "e2b.test"), None, "{bad}");
        }
        assert_eq!(domain("Sbx.Example.COM."), Some("sbx.example.com".into()));
        assert_eq!(domain("e2b.localhost:7700"), Some("e2b.localhost:7700".into()));
        for bad in ["", "a..b", "-a.b", "a.b:0", "a.b:x", "a b", "*.a.b", "a.b:99999"] {
            assert_eq!(domain(bad), None, "{bad}");
        }
        assert_eq!(masked_host("localhost:${PORT}", 3000), "localhost:3000");
        assert!(valid_mask("localhost:${PORT}") && valid_mask("app.internal") && valid_mask("10.0.0.1:8080"));
        assert!(!valid_mask("a b") && !valid_mask("") && !valid_mask("x:99999") && !valid_mask("a\r\nb"));
    }

    #[test]
    fn a_signature_binds_path_operation_and_user() {
        let url = |path: &str, op, user: &str| SignedUrl {
            path: path.into(),
            operation: op,
            username: user.into(),
            signature: String::new(),
            expiration: Some(1),
        };
        let sig = url("/a", Operation::Read, "user").expected("tok");
        assert_ne!(sig, url("/a", Operation::Read, "root").expected("tok"));
        assert_ne!(sig, url("/a", Operation::Write, "user").expected("tok"));
        assert_ne!(sig, url("/b", Operation::Read, "user").expected("tok"));
        assert_ne!(sig, url("/a", Operation::Read, "user").expected("other"));
        assert_eq!(url("/a", Operation::Read, "").user(), "user");
    }
}
