//! Webhooks: an owner's endpoints that receive its events, signed.
//!
//! A delivery is a row made in the transaction that appends its event
//! (`Store::append_events`), so a delivery is never lost once its event is
//! stored, and a pending one survives a restart (or a kill). One worker
//! sends what is due, a few at a time, and records each attempt: a 2xx
//! answer delivers; anything else (an error status, a refused connection,
//! a timeout) is tried again after an exponential backoff (base
//! `--webhook-retry-base`, doubling, at most an hour apart) until a day
//! after the event, when it is given up on (`failed`). Daemons sharing
//! the database each run a worker: a worker claims what it sends (for
//! [`CLAIM`], `Store::claim_deliveries`), so one node sends each attempt,
//! and a claim its node did not record by then (the node died) is taken
//! by another; a node's start frees its own claims at once (its sends
//! were cut short). A delivery may still be sent more than once (a crash
//! between its send and its record): the receiver deduplicates by
//! `Hutch-Delivery-Id`.
//!
//! Each request carries `Hutch-Signature: t=<unix seconds>,v1=<hex>` where
//! the hex is HMAC-SHA256 under the webhook's secret of `"<t>.<body>"`.
//!
//! An E2B webhook (`format` `e2b`, made by E2B's `/events/webhooks`) gets
//! E2B's lifecycle payload instead ([`e2b_payload`]) and E2B's signature
//! (`e2b-signature`: unpadded base64 of SHA-256 over the secret followed by
//! the body), through the same deliveries, worker and rules.
//!
//! Where a webhook may point (the SSRF rules, docs/threat-model.md): only
//! `https://`, or `http://` to an address in the operator's
//! `--webhook-allow-http` ranges. The name is resolved at each delivery
//! and every address it has is checked; the connection goes to a checked
//! address (no second resolution to rebind). Never: link-local addresses
//! (cloud metadata among them), the sandboxes' networks, unspecified,
//! multicast or broadcast addresses; loopback, the host's own addresses
//! and private ranges only when the operator allows them by range.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{random_hex, Caller};
use hmac::{Hmac, Mac};
use hutch_api::{CreateWebhook, Delivery, DeliveryList, Webhook, WebhookList};
use hutch_store::{Attempt, DeliveryRecord, DeliveryStatus, WebhookRecord};
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Longest URL.
const URL_MAX: usize = 2048;
/// Most event types one webhook names.
const TYPES_MAX: usize = 32;
/// Deliveries sent at once.
const CONCURRENCY: u32 = 8;
/// How long a node holds the deliveries it claimed (daemons sharing the
/// database send each once): far longer than one attempt takes (its
/// connect and I/O timeouts). A node that dies mid-send leaves its claims
/// to run out, and another node tries them again.
const CLAIM: Duration = Duration::from_secs(300);
/// A delivery is given up on this long after its event.
const GIVE_UP_AFTER: i64 = 86_400_000;
/// Longest wait between two attempts.
const BACKOFF_MAX: i64 = 3_600_000;
/// Connecting, and each read or write.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes of an answer read (its status line is all that counts).
const ANSWER_MAX: usize = 8192;
/// Longest error text kept.
const ERROR_MAX: usize = 512;

/// What the operator allows.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Ranges `http://` may reach (and loopback, the host's own and
    /// private addresses `https://` may).
    pub allow_http: Vec<Cidr>,
    /// Most webhooks one key may have.
    pub max_per_key: u64,
    /// The first retry's wait; each next one doubles it.
    pub retry_base: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy { allow_http: Vec::new(), max_per_key: 16, retry_base: Duration::from_secs(10) }
    }
}

/// An address range, `a.b.c.d/n` or `x::y/n` (a bare address is one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    /// Parses `addr[/prefix]`. Pure: fuzzed.
    pub fn parse(s: &str) -> std::result::Result<Cidr, String> {
        let s = s.trim();
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().map_err(|_| format!("{s:?} is not an address range (a.b.c.d/n or x::y/n)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix must be 0 to {max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }

    /// Parses a comma-separated list.
    pub fn parse_list(s: &str) -> std::result::Result<Vec<Cidr>, String> {
        s.split(',').map(str::trim).filter(|p| !p.is_empty()).map(Cidr::parse).collect()
    }

    /// Whether `ip` is in the range, as written or (an IPv4-mapped IPv6
    /// address) as the IPv4 address it carries.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let within = |ip: IpAddr| match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => prefix_eq(&net.octets(), &ip.octets(), self.prefix),
            (IpAddr::V6(net), IpAddr::V6(ip)) => prefix_eq(&net.octets(), &ip.octets(), self.prefix),
            _ => false,
        };
        within(ip) || within(canonical(ip))
    }
}

fn prefix_eq(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let (full, rest) = ((prefix / 8) as usize, prefix % 8);
    if a[..full] != b[..full] {
        return false;
    }
    rest == 0 || (a[full] ^ b[full]) >> (8 - rest) == 0
}

/// An IPv4-mapped IPv6 address as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// A webhook's URL, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub https: bool,
    /// A name, or an address (an IPv6 one without brackets).
    pub host: String,
    pub port: u16,
    /// `/...`, with the query.
    pub path: String,
}

impl Target {
    /// The `Host` header's value.
    fn authority(&self) -> String {
        let host = if self.host.contains(':') { format!("[{}]", self.host) } else { self.host.clone() };
        let default = if self.https { 443 } else { 80 };
        if self.port == default {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

/// Parses a webhook URL: `https://` or `http://`, a host name or address,
/// an optional port, a path; no user info, no fragment, nothing that is
/// not visible ASCII. Pure: fuzzed.
pub fn parse_url(url: &str) -> std::result::Result<Target, String> {
    if url.len() > URL_MAX {
        return Err(format!("the URL is longer than {URL_MAX} bytes"));
    }
    if !url.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the URL may hold only visible ASCII (no spaces)".into());
    }
    let lower = url.to_ascii_lowercase();
    let (https, rest) = if lower.starts_with("https://") {
        (true, &url[8..])
    } else if lower.starts_with("http://") {
        (false, &url[7..])
    } else {
        return Err("the URL must be https:// (or http:// to an address the operator allows)".into());
    };
    if rest.contains('#') {
        return Err("the URL may not have a fragment".into());
    }
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.contains('@') {
        return Err("the URL may not hold a user name or password".into());
    }
    let path = match path {
        "" => "/".to_owned(),
        p if p.starts_with('?') => format!("/{p}"),
        p => p.to_owned(),
    };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (addr, after) = v6.split_once(']').ok_or("an IPv6 address must be closed by ]")?;
        addr.parse::<Ipv6Addr>().map_err(|_| format!("{addr:?} is not an IPv6 address"))?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or("junk after the IPv6 address")?),
        };
        (addr.to_ascii_lowercase(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_ascii_lowercase(), Some(p)),
            None => (authority.to_ascii_lowercase(), None),
        }
    };
    let port = match port {
        None => {
            if https {
                443
            } else {
                80
            }
        }
        Some(p) => p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("{p:?} is not a port"))?,
    };
    let name_ok = !host.is_empty()
        && host.len() <= 253
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b':')
        && (host.parse::<IpAddr>().is_ok() || !host.contains(':'))
        && host.split('.').all(|l| !l.starts_with('-') && l.len() <= 63);
    if !name_ok {
        return Err(format!("{host:?} is not a host name"));
    }
    Ok(Target { https, host, port, path })
}

/// Parses a webhook's event types: each one of the event types, or `*`.
pub fn parse_types(types: &[String]) -> std::result::Result<Vec<String>, String> {
    if types.is_empty() {
        return Err("events: name at least one event type, or \"*\" for all".into());
    }
    if types.len() > TYPES_MAX {
        return Err(format!("events: at most {TYPES_MAX} types"));
    }
    let mut out: Vec<String> = Vec::new();
    for t in types {
        let t = t.trim();
        if t != "*" && crate::events::Kind::parse(t).is_none() {
            return Err(format!("events: unknown event type {:?}", t.chars().take(64).collect::<String>()));
        }
        if !out.iter().any(|o| o == t) {
            out.push(t.to_owned());
        }
    }
    if out.iter().any(|t| t == "*") {
        out = vec!["*".to_owned()];
    }
    Ok(out)
}

/// Why an address is never a webhook's, whatever the operator allows.
fn never(ip: IpAddr, sandbox_nets: &[Cidr]) -> Option<&'static str> {
    let ip = canonical(ip);
    let metadata =
        [IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)), IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254))];
    if metadata.contains(&ip) {
        return Some("a cloud metadata address");
    }
    if sandbox_nets.iter().any(|n| n.contains(ip)) {
        return Some("a sandbox network's address");
    }
    match ip {
        IpAddr::V4(v4) => {
            if v4.is_link_local() {
                return Some("a link-local address");
            }
            if v4.is_unspecified() || v4.is_broadcast() || v4.is_multicast() {
                return Some("not a unicast address");
            }
        }
        IpAddr::V6(v6) => {
            if (v6.segments()[0] & 0xffc0) == 0xfe80 {
                return Some("a link-local address");
            }
            if v6.is_unspecified() || v6.is_multicast() {
                return Some("not a unicast address");
            }
        }
    }
    None
}

/// Why an address is not a webhook's unless the operator allows its range.
fn unless_allowed(ip: IpAddr, host: &[IpAddr]) -> Option<&'static str> {
    let ip = canonical(ip);
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    if host.contains(&ip) {
        return Some("one of this host's addresses");
    }
    let private = match ip {
        IpAddr::V4(v4) => {
            v4.is_private()
                || Cidr { addr: IpAddr::V4(Ipv4Addr::new(100, 64, 0, 0)), prefix: 10 }.contains(ip)
                || v4.octets()[0] == 0
        }
        IpAddr::V6(v6) => (v6.segments()[0] & 0xfe00) == 0xfc00,
    };
    private.then_some("a private address")
}

/// Whether a delivery may go to `ip` over `https` (or not): why not.
pub fn check_addr(
    ip: IpAddr,
    https: bool,
    policy: &Policy,
    host: &[IpAddr],
    sandbox_nets: &[Cidr],
) -> std::result::Result<(), String> {
    if let Some(why) = never(ip, sandbox_nets) {
        return Err(format!("{ip} is {why}; webhooks never go there"));
    }
    let allowed = policy.allow_http.iter().any(|c| c.contains(ip));
    if allowed {
        return Ok(());
    }
    if !https {
        return Err(format!(
            "{ip} is not in a range the operator allows http:// to (--webhook-allow-http); use https://"
        ));
    }
    if let Some(why) = unless_allowed(ip, host) {
        return Err(format!("{ip} is {why}; webhooks go there only when the operator allows its range"));
    }
    Ok(())
}

/// This host's addresses (every interface's).
fn host_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `ifap`, freed below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs made, not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says its type.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            } else if family == libc::AF_INET6 {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `ifap` is the list getifaddrs made; nothing refers to it now.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

/// `t=<unix>,v1=<hex hmac-sha256(secret, "<t>.<body>")>`.
pub fn signature(secret: &str, t: i64, body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        return String::new();
    };
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// The status of an HTTP answer's first line (`HTTP/1.x NNN ...`). Pure:
/// fuzzed.
pub fn parse_status_line(answer: &[u8]) -> Option<u16> {
    let end = answer.windows(2).position(|w| w == b"\r\n").unwrap_or(answer.len());
    let line = std::str::from_utf8(&answer[..end]).ok()?;
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return None;
    }
    let code = parts.next()?;
    if code.len() != 3 {
        return None;
    }
    code.parse::<u16>().ok().filter(|c| (100..=599).contains(c))
}

/// One request's outcome: the answer's status, or why there was none.
type Sent = std::result::Result<u16, String>;

/// Resolves `target` (blocking) and checks every address it has: the
/// addresses a connection may go to, or why none may.
fn resolve_checked(
    target: &Target,
    policy: &Policy,
    sandbox_nets: &[Cidr],
) -> std::result::Result<Vec<SocketAddr>, String> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<SocketAddr> = (target.host.as_str(), target.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {}: {e}", target.host))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("{} has no address", target.host));
    }
    let host = host_addrs();
    for a in &addrs {
        check_addr(a.ip(), target.https, policy, &host, sandbox_nets)?;
    }
    Ok(addrs)
}

/// Sends one delivery (blocking): resolves, checks, connects to a checked
/// address, writes, reads the status line.
fn send(target: &Target, policy: &Policy, sandbox_nets: &[Cidr], head: &str, body: &[u8]) -> Sent {
    let addrs = resolve_checked(target, policy, sandbox_nets)?;
    let mut last = String::new();
    let mut tcp = None;
    for a in &addrs {
        match std::net::TcpStream::connect_timeout(a, CONNECT_TIMEOUT) {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = format!("connect {a}: {e}"),
        }
    }
    let tcp = tcp.ok_or(last)?;
    let _ = tcp.set_read_timeout(Some(IO_TIMEOUT));
    let _ = tcp.set_write_timeout(Some(IO_TIMEOUT));
    let mut answer = Vec::with_capacity(256);
    let io = |s: &mut dyn ReadWrite, answer: &mut Vec<u8>| -> std::io::Result<()> {
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        s.flush()?;
        let mut buf = [0u8; 1024];
        while answer.len() < ANSWER_MAX && !answer.windows(2).any(|w| w == b"\r\n") {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
        }
        Ok(())
    };
    if target.https {
        let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        let config = rustls::ClientConfig::builder_with_provider(rustls::crypto::ring::default_provider().into())
            .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
            .map_err(|e| format!("tls: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name =
            rustls::pki_types::ServerName::try_from(target.host.clone()).map_err(|e| format!("tls name: {e}"))?;
        let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| format!("tls: {e}"))?;
        let mut s = rustls::StreamOwned::new(conn, tcp);
        io(&mut s, &mut answer).map_err(|e| format!("https: {e}"))?;
    } else {
        let mut s = tcp;
        io(&mut s, &mut answer).map_err(|e| format!("http: {e}"))?;
    }
    parse_status_line(&answer).ok_or_else(|| "the answer is not HTTP".to_owned())
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn cut(mut s: String) -> String {
    if s.len() > ERROR_MAX {
        let mut end = ERROR_MAX;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// When attempt `attempts` (1 for the first) failed at `now`: the next
/// attempt's time, or None to give up.
fn next_attempt(base: Duration, attempts: u32, created_at: i64, now: i64) -> Option<i64> {
    let base = (base.as_millis() as i64).max(1);
    let wait = base.saturating_mul(1i64 << attempts.saturating_sub(1).min(30)).min(BACKOFF_MAX);
    let at = now.saturating_add(wait);
    (at <= created_at.saturating_add(GIVE_UP_AFTER)).then_some(at)
}

const FORMAT_NATIVE: &str = "native";
const FORMAT_E2B: &str = "e2b";

/// E2B's lifecycle event types and the native types each one stands for:
/// the one place the two map.
const E2B_TYPES: &[(&str, &[&str])] = &[
    ("sandbox.lifecycle.created", &["sandbox.created"]),
    ("sandbox.lifecycle.killed", &["sandbox.deleted", "sandbox.expired"]),
    ("sandbox.lifecycle.updated", &["sandbox.extended"]),
    ("sandbox.lifecycle.paused", &["sandbox.paused", "sandbox.suspended"]),
    ("sandbox.lifecycle.resumed", &["sandbox.resumed"]),
];

/// The E2B type a native event type is delivered as, if any.
pub fn e2b_type(native: &str) -> Option<&'static str> {
    E2B_TYPES.iter().find(|(_, n)| n.contains(&native)).map(|(e, _)| *e)
}

/// E2B types to the native types stored (none named: all of them). Pure.
pub fn e2b_to_native(types: &[String]) -> std::result::Result<Vec<String>, String> {
    if types.len() > TYPES_MAX {
        return Err(format!("events: at most {TYPES_MAX} types"));
    }
    let mut out: Vec<String> = Vec::new();
    for t in types {
        let (_, natives) = E2B_TYPES
            .iter()
            .find(|(e, _)| *e == t.trim())
            .ok_or_else(|| format!("events: unknown E2B event type {:?}", t.chars().take(64).collect::<String>()))?;
        for n in *natives {
            if !out.iter().any(|o| o == n) {
                out.push((*n).to_owned());
            }
        }
    }
    if types.is_empty() {
        out = E2B_TYPES.iter().flat_map(|(_, n)| n.iter().map(|n| (*n).to_owned())).collect();
    }
    Ok(out)
}

/// The E2B types a stored (native) list stands for, in E2B's order.
fn native_to_e2b(events: &[String]) -> Vec<String> {
    E2B_TYPES
        .iter()
        .filter(|(_, n)| events.iter().any(|e| e == "*" || n.contains(&e.as_str())))
        .map(|(e, _)| (*e).to_owned())
        .collect()
}

fn check_secret(s: &str, field: &str) -> Result<String> {
    if (16..=256).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(s.to_owned())
    } else {
        Err(ControlError::Invalid(format!("{field}: 16 to 256 visible ASCII characters")))
    }
}

fn check_name(s: &str) -> Result<String> {
    if s.len() <= 256 && !s.chars().any(char::is_control) {
        Ok(s.to_owned())
    } else {
        Err(ControlError::Invalid("name: at most 256 bytes, no control characters".into()))
    }
}

/// E2B's `e2b-signature`: unpadded base64 of SHA-256(secret ++ body).
pub fn e2b_signature(secret: &str, body: &[u8]) -> String {
    use base64::Engine;
    use sha2::Digest;
    let mut h = Sha256::new();
    h.update(secret.as_bytes());
    h.update(body);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(h.finalize())
}

/// E2B's lifecycle payload for a stored native event body. What hutch does
/// not have (a build id, an execution id) is an empty string; `eventData`
/// holds the native event's own fields, or null when it has none. Pure.
pub fn e2b_payload(native: &str) -> String {
    let ev: serde_json::Value = serde_json::from_str(native).unwrap_or_default();
    let text = |k: &str| ev.get(k).and_then(|v| v.as_str()).unwrap_or("").to_owned();
    let kind = text("type");
    let mut data = serde_json::Map::new();
    if let Some(o) = ev.as_object() {
        for (k, v) in o {
            if !matches!(k.as_str(), "id" | "type" | "sandbox_id" | "at" | "owner") {
                data.insert(k.clone(), v.clone());
            }
        }
    }
    let id = ev.get("id").map(|v| v.to_string()).unwrap_or_default();
    serde_json::json!({
        "version": "v2",
        "id": id,
        "type": e2b_type(&kind).unwrap_or(kind.as_str()),
        "eventData": if data.is_empty() { serde_json::Value::Null } else { serde_json::Value::Object(data) },
        "sandboxBuildId": "",
        "sandboxExecutionId": "",
        "sandboxId": text("sandbox_id"),
        "sandboxTeamId": text("owner"),
        "sandboxTemplateId": if text("template").is_empty() { text("template_id") } else { text("template") },
        "timestamp": text("at"),
    })
    .to_string()
}

/// An E2B webhook's create or update (`PATCH` takes any subset).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct E2bWebhookRequest {
    pub name: Option<String>,
    pub url: Option<String>,
    pub enabled: Option<bool>,
    pub events: Option<Vec<String>>,
    pub signature_secret: Option<String>,
}

/// An E2B webhook as E2B shows it (never its secret).
#[derive(Debug, Clone, serde::Serialize)]
pub struct E2bWebhook {
    pub id: String,
    #[serde(rename = "teamID")]
    pub team_id_upper: String,
    #[serde(rename = "teamId")]
    pub team_id: String,
    pub name: String,
    #[serde(rename = "createdAt")]
    pub created_at: String,
    pub enabled: bool,
    pub url: String,
    pub events: Vec<String>,
}

fn e2b_view(w: &WebhookRecord) -> E2bWebhook {
    E2bWebhook {
        id: w.id.clone(),
        team_id_upper: w.owner.clone(),
        team_id: w.owner.clone(),
        name: w.name.clone(),
        created_at: rfc3339(w.created_at),
        enabled: w.enabled,
        url: w.url.clone(),
        events: native_to_e2b(&w.events),
    }
}

fn view(w: &WebhookRecord, secret: bool) -> Webhook {
    Webhook {
        id: w.id.clone(),
        url: w.url.clone(),
        events: w.events.clone(),
        created_at: rfc3339(w.created_at),
        owner: w.owner.clone(),
        secret: secret.then(|| w.secret.clone()),
    }
}

fn delivery_view(d: &DeliveryRecord) -> Delivery {
    Delivery {
        id: d.id as u64,
        event_id: d.event_id as u64,
        event_type: d.event_type.clone(),
        status: d.status.as_str().to_owned(),
        attempts: d.attempts,
        created_at: rfc3339(d.created_at),
        next_attempt_at: d.next_at.filter(|_| d.status == DeliveryStatus::Pending).map(rfc3339),
        last_attempt_at: d.last_at.map(rfc3339),
        last_http_status: d.last_status,
        last_error: d.last_error.clone(),
    }
}

/// `wh-` and 16 hex digits.
fn check_id(id: &str) -> Result<()> {
    match id.strip_prefix("wh-") {
        Some(h) if h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(()),
        _ => Err(ControlError::NoWebhook(id.chars().take(64).collect())),
    }
}

impl Control {
    /// The sandbox networks' ranges, which webhooks never reach.
    fn sandbox_nets(&self) -> Vec<Cidr> {
        match &self.network {
            Ok(n) => vec![
                Cidr { addr: IpAddr::V4(n.config().subnet4), prefix: 16 },
                Cidr { addr: IpAddr::V6(n.config().subnet6), prefix: 64 },
            ],
            Err(_) => Vec::new(),
        }
    }

    /// `POST /v1/webhooks`: checks the URL (resolving it, as a delivery
    /// will) and the types; the answer carries the secret, once.
    pub async fn create_webhook(&self, caller: &Caller, req: &CreateWebhook) -> Result<Webhook> {
        let events = parse_types(&req.events).map_err(ControlError::Invalid)?;
        let secret = match &req.secret {
            Some(s) => check_secret(s, "secret")?,
            None => format!("whsec_{}", random_hex(24)?),
        };
        let rec = self.insert_webhook(caller, &req.url, events, secret, FORMAT_NATIVE, String::new(), true).await?;
        Ok(view(&rec, true))
    }

    /// Checks a webhook's URL now, so a mistake shows at once (each
    /// delivery checks it again: a name's addresses change).
    async fn check_url(&self, url: &str) -> Result<()> {
        let target = parse_url(url).map_err(ControlError::WebhookUrl)?;
        let policy = self.events.settings.webhooks.clone();
        let nets = self.sandbox_nets();
        tokio::task::spawn_blocking(move || resolve_checked(&target, &policy, &nets).map(drop))
            .await?
            .map_err(ControlError::WebhookUrl)
    }

    #[allow(clippy::too_many_arguments)]
    async fn insert_webhook(
        &self,
        caller: &Caller,
        url: &str,
        events: Vec<String>,
        secret: String,
        format: &str,
        name: String,
        enabled: bool,
    ) -> Result<WebhookRecord> {
        self.check_url(url).await?;
        let rec = WebhookRecord {
            id: format!("wh-{}", random_hex(8)?),
            owner: caller.owner.to_string(),
            url: url.to_owned(),
            events,
            secret,
            created_at: now_ms(),
            format: format.to_owned(),
            name,
            enabled,
        };
        let max = self.events.settings.webhooks.max_per_key;
        let r = rec.clone();
        if !self.db(move |s| s.insert_webhook(&r, max)).await? {
            return Err(ControlError::WebhookLimit(max));
        }
        Ok(rec)
    }

    /// E2B's `POST /events/webhooks`.
    pub async fn e2b_create_webhook(&self, caller: &Caller, req: E2bWebhookRequest) -> Result<E2bWebhook> {
        let events = e2b_to_native(req.events.as_deref().unwrap_or(&[])).map_err(ControlError::Invalid)?;
        let secret = match &req.signature_secret {
            Some(s) => check_secret(s, "signatureSecret")?,
            None => return Err(ControlError::Invalid("signatureSecret is required".into())),
        };
        let url = req.url.as_deref().ok_or_else(|| ControlError::Invalid("url is required".into()))?;
        let name = check_name(req.name.as_deref().unwrap_or(""))?;
        let rec =
            self.insert_webhook(caller, url, events, secret, FORMAT_E2B, name, req.enabled.unwrap_or(true)).await?;
        Ok(e2b_view(&rec))
    }

    /// E2B's `GET /events/webhooks`: the caller's E2B webhooks.
    pub async fn e2b_webhooks(&self, caller: &Caller) -> Result<Vec<E2bWebhook>> {
        let owner = caller.owner.to_string();
        let rows = self.db(move |s| s.list_webhooks(Some(&owner))).await?;
        Ok(rows.iter().filter(|w| w.format == FORMAT_E2B).map(e2b_view).collect())
    }

    async fn e2b_webhook_record(&self, caller: &Caller, id: &str) -> Result<WebhookRecord> {
        match self.webhook_record(caller, id).await? {
            w if w.format == FORMAT_E2B && w.owner == caller.owner.to_string() => Ok(w),
            _ => Err(ControlError::NoWebhook(id.chars().take(64).collect())),
        }
    }

    pub async fn e2b_webhook(&self, caller: &Caller, id: &str) -> Result<E2bWebhook> {
        Ok(e2b_view(&self.e2b_webhook_record(caller, id).await?))
    }

    /// E2B's `PATCH /events/webhooks/{id}`: `enabled`, `url`, `events`
    /// (and `name`); what is absent stays.
    pub async fn e2b_update_webhook(&self, caller: &Caller, id: &str, req: E2bWebhookRequest) -> Result<E2bWebhook> {
        let mut w = self.e2b_webhook_record(caller, id).await?;
        if req.signature_secret.is_some() {
            return Err(ControlError::Invalid("signatureSecret cannot be changed; make a new webhook".into()));
        }
        if let Some(events) = &req.events {
            w.events = e2b_to_native(events).map_err(ControlError::Invalid)?;
        }
        if let Some(url) = req.url {
            self.check_url(&url).await?;
            w.url = url;
        }
        if let Some(name) = &req.name {
            w.name = check_name(name)?;
        }
        if let Some(enabled) = req.enabled {
            w.enabled = enabled;
        }
        let r = w.clone();
        if !self.db(move |s| s.update_webhook(&r)).await? {
            return Err(ControlError::NoWebhook(id.to_owned()));
        }
        Ok(e2b_view(&w))
    }

    pub async fn e2b_delete_webhook(&self, caller: &Caller, id: &str) -> Result<()> {
        let w = self.e2b_webhook_record(caller, id).await?;
        self.db(move |s| s.delete_webhook(&w.id)).await?;
        Ok(())
    }

    async fn webhook_record(&self, caller: &Caller, id: &str) -> Result<WebhookRecord> {
        check_id(id)?;
        let wid = id.to_owned();
        match self.db(move |s| s.get_webhook(&wid)).await? {
            Some(w) if caller.may_manage(&w.owner) => Ok(w),
            _ => Err(ControlError::NoWebhook(id.to_owned())),
        }
    }

    /// `GET /v1/webhooks`: the caller's (an admin's: everyone's).
    pub async fn list_webhooks(&self, caller: &Caller) -> Result<WebhookList> {
        let owner = (!caller.admin).then(|| caller.owner.to_string());
        let rows = self.db(move |s| s.list_webhooks(owner.as_deref())).await?;
        Ok(WebhookList { webhooks: rows.iter().map(|w| view(w, false)).collect() })
    }

    pub async fn get_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        Ok(view(&self.webhook_record(caller, id).await?, false))
    }

    /// Deletes a webhook; its pending deliveries are not sent.
    pub async fn delete_webhook(&self, caller: &Caller, id: &str) -> Result<()> {
        let w = self.webhook_record(caller, id).await?;
        self.db(move |s| s.delete_webhook(&w.id)).await?;
        Ok(())
    }

    /// `GET /v1/webhooks/{id}/deliveries`: newest first.
    pub async fn webhook_deliveries(
        &self,
        caller: &Caller,
        id: &str,
        cursor: Option<&str>,
        limit: Option<u32>,
    ) -> Result<DeliveryList> {
        let w = self.webhook_record(caller, id).await?;
        let limit = limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(ControlError::Invalid("limit must be 1 to 1000".into()));
        }
        let before = cursor
            .map(|c| {
                c.parse::<i64>().ok().filter(|v| *v > 0).ok_or_else(|| ControlError::Invalid("invalid cursor".into()))
            })
            .transpose()?;
        let mut rows = self.db(move |s| s.list_deliveries(&w.id, before, limit + 1)).await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let next_cursor = if more { rows.last().map(|d| d.id.to_string()) } else { None };
        Ok(DeliveryList { deliveries: rows.iter().map(delivery_view).collect(), next_cursor })
    }

    /// The webhook worker: sends what is due, records each attempt, waits
    /// for the next due one (or new deliveries).
    pub(crate) async fn deliver_loop(self: Arc<Self>) {
        loop {
            let now = now_ms();
            let (node, until) = (self.node.name.clone(), now + CLAIM.as_millis() as i64);
            let due = match self.db(move |s| s.claim_deliveries(&node, now, until, CONCURRENCY)).await {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!("webhooks: {e}");
                    Vec::new()
                }
            };
            if due.is_empty() {
                let next = self.db(|s| s.next_delivery_at()).await.ok().flatten();
                let wait = next.map_or(1000, |n| (n - now_ms()).clamp(0, 1000)) as u64;
                tokio::select! {
                    () = self.events.deliveries.notified() => {}
                    () = tokio::time::sleep(Duration::from_millis(wait)) => {}
                }
                continue;
            }
            let mut set = tokio::task::JoinSet::new();
            for (d, w) in due {
                let this = self.clone();
                set.spawn(async move { this.attempt(d, w).await });
            }
            while set.join_next().await.is_some() {}
        }
    }

    async fn attempt(&self, d: DeliveryRecord, w: WebhookRecord) {
        let policy = self.events.settings.webhooks.clone();
        let nets = self.sandbox_nets();
        let t = now_ms() / 1000;
        // The stored body has no id of its own: the event's is put in.
        let payload = crate::events::with_id(&d.payload, d.event_id);
        let (body, sig) = if w.format == FORMAT_E2B {
            let body = e2b_payload(&payload).into_bytes();
            let sig = format!("e2b-signature: {}", e2b_signature(&w.secret, &body));
            (body, sig)
        } else {
            let body = payload.into_bytes();
            let sig = format!("Hutch-Signature: {}", signature(&w.secret, t, &body));
            (body, sig)
        };
        let sent: Sent = match parse_url(&w.url) {
            Err(e) => Err(e),
            Ok(target) => {
                let head = format!(
                    "POST {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: hutch-webhooks/1\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\nHutch-Event-Id: {}\r\nHutch-Event-Type: {}\r\nHutch-Delivery-Id: {}\r\n\
                     {sig}\r\nConnection: close\r\n\r\n",
                    target.path,
                    target.authority(),
                    body.len(),
                    d.event_id,
                    d.event_type,
                    d.id,
                );
                tokio::task::spawn_blocking(move || send(&target, &policy, &nets, &head, &body))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            }
        };
        let now = now_ms();
        let attempts = d.attempts + 1;
        let base = self.events.settings.webhooks.retry_base;
        let a = match sent {
            Ok(code) if (200..300).contains(&code) => Attempt {
                at: now,
                status: DeliveryStatus::Delivered,
                next_at: None,
                http_status: Some(code),
                error: None,
            },
            other => {
                let (code, error) = match other {
                    Ok(code) => (Some(code), format!("the receiver answered HTTP {code}")),
                    Err(e) => (None, e),
                };
                let next = next_attempt(base, attempts, d.created_at, now);
                let status = if next.is_some() { DeliveryStatus::Pending } else { DeliveryStatus::Failed };
                Attempt { at: now, status, next_at: next, http_status: code, error: Some(cut(error)) }
            }
        };
        let node = self.node.name.clone();
        match self.db(move |s| s.record_attempt(d.id, &node, &a)).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "webhooks: delivery {}: its claim ran out before its attempt was recorded; another node has it",
                d.id
            ),
            Err(e) => tracing::warn!("webhooks: delivery {}: cannot record its attempt: {e}", d.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_strictly() {
        let t = parse_url("https://Example.com/hook?x=1").expect("ok");
        assert_eq!((t.https, t.host.as_str(), t.port, t.path.as_str()), (true, "example.com", 443, "/hook?x=1"));
        let t = parse_url("http://127.0.0.1:8080").expect("ok");
        assert_eq!((t.https, t.port, t.path.as_str(), t.authority()), (false, 8080, "/", "127.0.0.1:8080".to_owned()));
        let t = parse_url("http://[::1]:9/x").expect("ok");
        assert_eq!((t.host.as_str(), t.authority()), ("::1", "[::1]:9".to_owned()));
        for bad in [
            "ftp://x",
            "https://",
            "https://user@host/",
            "https://host:0/",
            "https://host:99999/",
            "https://ho st/",
            "https://host/#frag",
            "https://[::1/",
            "https://-bad.com/",
            "https://a:b:c/",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranges_contain_what_they_should() {
        let c = Cidr::parse("127.0.0.1/32").expect("ok");
        assert!(c.contains("127.0.0.1".parse().expect("ip")));
        assert!(c.contains("::ffff:127.0.0.1".parse().expect("ip")), "mapped");
        assert!(!c.contains("127.0.0.2".parse().expect("ip")));
        let c = Cidr::parse("10.0.0.0/9").expect("ok");
        assert!(c.contains("10.127.1.1".parse().expect("ip")));
        assert!(!c.contains("10.128.0.0".parse().expect("ip")));
        assert!(Cidr::parse("fd00::/8").expect("ok").contains("fdff::1".parse().expect("ip")));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nope").is_err());
        assert_eq!(Cidr::parse_list("127.0.0.1/32, ::1").expect("ok").len(), 2);
    }

    #[test]
    fn addresses_are_refused_by_default_and_allowed_by_range() {
        let none = Policy::default();
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        for bad in
            ["127.0.0.1", "::1", "169.254.169.254", "fd00:ec2::254", "10.1.2.3", "192.168.1.1", "0.0.0.0", "fe80::1"]
        {
            assert!(check_addr(ip(bad), true, &none, &[], &[]).is_err(), "{bad}");
        }
        assert!(check_addr(ip("93.184.216.34"), true, &none, &[], &[]).is_ok());
        assert!(check_addr(ip("93.184.216.34"), false, &none, &[], &[]).is_err(), "http needs an allowed range");
        assert!(check_addr(ip("93.184.216.34"), true, &none, &[ip("93.184.216.34")], &[]).is_err(), "the host's own");
        let lo = Policy { allow_http: vec![Cidr::parse("127.0.0.1/32").expect("ok")], ..Policy::default() };
        assert!(check_addr(ip("127.0.0.1"), false, &lo, &[], &[]).is_ok());
        // Metadata, link-local and sandbox networks: never, whatever is allowed.
        let all = Policy {
            allow_http: vec![Cidr::parse("0.0.0.0/0").expect("ok"), Cidr::parse("::/0").expect("ok")],
            ..Policy::default()
        };
        let nets = [Cidr::parse("10.88.0.0/16").expect("ok")];
        for bad in ["169.254.169.254", "fd00:ec2::254", "169.254.1.1", "fe80::1", "10.88.0.5"] {
            assert!(check_addr(ip(bad), false, &all, &[], &nets).is_err(), "{bad}");
        }
    }

    #[test]
    fn signatures_are_stripes_scheme() {
        // HMAC-SHA256("secret", "1700000000.{}").
        let s = signature("secret", 1_700_000_000, b"{}");
        assert!(s.starts_with("t=1700000000,v1="), "{s}");
        assert_eq!(s.len(), "t=1700000000,v1=".len() + 64);
        assert_ne!(s, signature("other", 1_700_000_000, b"{}"));
    }

    #[test]
    fn status_lines_parse() {
        assert_eq!(parse_status_line(b"HTTP/1.1 204 No Content\r\n\r\n"), Some(204));
        assert_eq!(parse_status_line(b"HTTP/1.0 500 x"), Some(500));
        for bad in [&b""[..], b"HTTP/2 200\r\n", b"HTTP/1.1 2000\r\n", b"HTTP/1.1 abc\r\n", b"\xff\xfe"] {
            assert_eq!(parse_status_line(bad), None);
        }
    }

    #[test]
    fn backoff_doubles_and_gives_up_after_a_day() {
        let base = Duration::from_secs(10);
        assert_eq!(next_attempt(base, 1, 0, 0), Some(10_000));
        assert_eq!(next_attempt(base, 2, 0, 0), Some(20_000));
        assert_eq!(next_attempt(base, 30, 0, 0), Some(BACKOFF_MAX));
        assert_eq!(next_attempt(base, 5, 0, GIVE_UP_AFTER), None);
    }

    #[test]
    fn e2b_types_map_both_ways_and_payloads_are_e2bs() {
        let n = e2b_to_native(&["sandbox.lifecycle.killed".into()]).expect("ok");
        assert_eq!(n, ["sandbox.deleted", "sandbox.expired"]);
        assert_eq!(native_to_e2b(&n), ["sandbox.lifecycle.killed"]);
        assert_eq!(native_to_e2b(&e2b_to_native(&[]).expect("all")).len(), E2B_TYPES.len());
        assert_eq!(native_to_e2b(&["*".into()]).len(), E2B_TYPES.len());
        assert!(e2b_to_native(&["sandbox.created".into()]).is_err(), "native names are not E2B's");
        assert_eq!(e2b_type("sandbox.suspended"), Some("sandbox.lifecycle.paused"));
        assert_eq!(e2b_type("sandbox.ready"), None);
        let p: serde_json::Value = serde_json::from_str(&e2b_payload(
            r#"{"id":7,"type":"sandbox.created","sandbox_id":"sb-1","at":"2026-01-01T00:00:00Z","owner":"k1","template":"t"}"#,
        ))
        .expect("json");
        assert_eq!(p["type"], "sandbox.lifecycle.created");
        assert_eq!(
            (p["id"].as_str(), p["sandboxId"].as_str(), p["sandboxTeamId"].as_str()),
            (Some("7"), Some("sb-1"), Some("k1"))
        );
        assert_eq!(p["sandboxTemplateId"], "t");
        assert_eq!(p["eventData"]["template"], "t");
        assert_eq!(p["version"], "v2");
        // sha256("s" ++ "{}"), base64 without padding.
        let sig = e2b_signature("s", b"{}");
        assert_eq!(sig.len(), 43);
        assert!(!sig.ends_with('='));
    }

    #[test]
    fn types_are_known_or_all() {
        assert_eq!(parse_types(&["*".into(), "sandbox.ready".into()]).expect("ok"), ["*"]);
        assert!(parse_types(&[]).is_err());
        assert!(parse_types(&["sandbox.bogus".into()]).is_err());
    }
}
