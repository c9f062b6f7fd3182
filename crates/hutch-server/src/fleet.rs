//! Any node of a fleet answers any call: a request that names another
//! node's sandbox (by its path, an E2B header, or a proxy host name) or
//! volume (`/v1/volumes/{id or name}`: its files are on its node) is
//! passed to that node, and a create goes to the node placement picks
//! (the node of the volumes it mounts, if it names any).
//! The control plane decides where ([`Control::locate`],
//! [`Control::place`]); this layer only moves the bytes, over HTTP/1.1
//! with the request's own credentials, streams and WebSocket upgrades
//! included. The owner node authenticates and authorizes the request as
//! if the client had asked it directly.
//!
//! A forwarded request carries `hutch-node` (the forwarding node's name)
//! and the client's address; with a fleet secret also the time and an
//! HMAC over both, the method and the path (`hutch-node-signature`). A
//! request that carries `hutch-node` is answered where it arrives, never
//! passed on again, so a stale placement cannot loop; only a signed one
//! makes the owner record the address it vouches for as the client's.
//! These headers are dropped before any handler sees the request.
//!
//! [`Control::locate`]: hutch_control::Control::locate
//! [`Control::place`]: hutch_control::Control::place

use crate::{ApiError, App};
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{Method, StatusCode, Uri, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hutch_api::ErrorCode;
use hutch_control::nodes::Route;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The forwarding node's name.
pub const NODE_HEADER: &str = "hutch-node";
/// The client's address, as the forwarding node saw it.
pub const CLIENT_HEADER: &str = "hutch-node-client";
/// Seconds since the epoch when the forward was signed.
pub const TIME_HEADER: &str = "hutch-node-time";
/// The fleet secret's HMAC-SHA256 (hex) of the forward.
pub const SIGNATURE_HEADER: &str = "hutch-node-signature";
const FLEET_HEADERS: [&str; 4] = [NODE_HEADER, CLIENT_HEADER, TIME_HEADER, SIGNATURE_HEADER];

/// A create's body is read whole to find its template: at most this.
const CREATE_BODY_LIMIT: usize = 1 << 20;
/// How long a node has to accept the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bounds on the owner node's answer head.
const MAX_HEADERS: usize = 100;
const MAX_HEADER_BYTES: usize = 64 << 10;
/// Idle connections kept per node, and for how long one is reused.
const POOL_PER_NODE: usize = 32;
const IDLE_REUSE: Duration = Duration::from_secs(15);

/// Which API a request speaks, for its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Native,
    E2b,
}

/// What a request asks of the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Aim {
    /// Something about this sandbox (an id as written; the control plane
    /// parses it).
    Sandbox(String),
    /// A new sandbox: placement decides where.
    Create(Flavor),
    /// Something about this volume (an id or a name, as written).
    Volume(String),
    /// Nothing of one sandbox: answered here.
    Local,
}

/// What a request aims at, from its method, path, host and E2B's
/// `E2b-Sandbox-Id` header. Pure, for the fuzz target and the tests.
pub fn aim(method: &Method, path: &str, host: Option<&str>, e2b_domain: Option<&str>, sandbox: Option<&str>) -> Aim {
    if let Some(host) = host {
        if let Some((_, id)) = e2b_domain.and_then(|d| hutch_control::e2b::parse_host(host, d)) {
            return Aim::Sandbox(id.to_string());
        }
        if let Some(Ok((id, _))) = crate::proxy::proxy_label(host).map(|l| crate::proxy::parse_label(&l)) {
            return Aim::Sandbox(id);
        }
    }
    if let Some(id) = sandbox {
        return Aim::Sandbox(id.to_owned());
    }
    let mut parts = path.strip_prefix('/').unwrap_or(path).split('/');
    let (a, b, c, d) = (parts.next(), parts.next(), parts.next(), parts.next());
    match (a, b, c, d) {
        // The sandbox's record is the same in every node's database.
        (Some("v1"), Some("sandboxes"), Some(id), None) if !id.is_empty() && method == Method::GET => Aim::Local,
        (Some("v1"), Some("sandboxes"), Some(id), _) if !id.is_empty() => Aim::Sandbox(id.to_owned()),
        (Some("v1"), Some("sandboxes") | Some("executions"), None, None) if method == Method::POST => {
            Aim::Create(Flavor::Native)
        }
        (Some("sandboxes"), None, ..) | (Some("v2" | "v3"), Some("sandboxes"), None, _) if method == Method::POST => {
            Aim::Create(Flavor::E2b)
        }
        (Some("v1"), Some("volumes"), Some(v), None) if !v.is_empty() => Aim::Volume(v.to_owned()),
        (Some("sandboxes"), Some(id), ..) if !id.is_empty() => Aim::Sandbox(id.to_owned()),
        (Some("v2" | "v3"), Some("sandboxes"), Some(id), _) if !id.is_empty() => Aim::Sandbox(id.to_owned()),
        _ => Aim::Local,
    }
}

/// Idle HTTP/1.1 connections to other nodes, by their address, with when
/// each was kept.
#[derive(Default)]
pub struct Forwarder {
    idle: Mutex<HashMap<String, Vec<Kept>>>,
}

/// A connection kept idle, and since when.
type Kept = (Instant, SendRequest<Body>);

impl Forwarder {
    /// A kept connection that is ready and young enough that its node has
    /// not closed it for idleness (60 s by default, far above `IDLE_REUSE`).
    fn take(&self, authority: &str) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.get_mut(authority)?;
        while let Some((kept, s)) = list.pop() {
            if s.is_ready() && kept.elapsed() < IDLE_REUSE {
                return Some(s);
            }
        }
        None
    }

    fn keep(&self, authority: &str, sender: SendRequest<Body>) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.entry(authority.to_owned()).or_default();
        list.retain(|(kept, s)| !s.is_closed() && kept.elapsed() < IDLE_REUSE);
        if list.len() < POOL_PER_NODE {
            list.push((Instant::now(), sender));
        }
    }
}

/// The outermost layer: answers here, or passes the request to the node
/// that should answer it.
pub(crate) async fn route(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    if arrived_forwarded(&app, &mut req) {
        return next.run(req).await;
    }
    let host =
        req.uri().host().map(str::to_owned).or_else(|| crate::e2b::header(req.headers(), "host").map(str::to_owned));
    let aimed = aim(
        req.method(),
        req.uri().path(),
        host.as_deref(),
        app.control.e2b_domain(),
        crate::e2b::header(req.headers(), "e2b-sandbox-id"),
    );
    let flavor = if crate::e2b::owns_path(req.uri().path()).is_some() { Flavor::E2b } else { Flavor::Native };
    let (route, req) = match aimed {
        Aim::Local => return next.run(req).await,
        Aim::Sandbox(id) => (app.control.locate(&id).await, req),
        Aim::Volume(_) if app.control.alone().await => return next.run(req).await,
        Aim::Volume(v) => match caller_of(&app, Flavor::Native, req.headers()).await {
            Some(caller) => (app.control.locate_volume(&caller, &v).await, req),
            None => return next.run(req).await,
        },
        Aim::Create(flavor) => match placed(&app, flavor, req).await {
            Ok(pair) => pair,
            Err(resp) => return resp,
        },
    };
    match route {
        Route::Here => next.run(req).await,
        Route::Node { name, url } => forward(&app, &name, &url, req, flavor).await,
    }
}

/// Whether the request was forwarded by a node (it is answered here,
/// whatever it names). A signed forward's client address becomes the
/// request's. The fleet headers are removed either way.
fn arrived_forwarded(app: &App, req: &mut Request) -> bool {
    let Some(node) = crate::e2b::header(req.headers(), NODE_HEADER).map(str::to_owned) else {
        strip_fleet_headers(req.headers_mut());
        return false;
    };
    let client = crate::e2b::header(req.headers(), CLIENT_HEADER).unwrap_or("").to_owned();
    let at = crate::e2b::header(req.headers(), TIME_HEADER).and_then(|t| t.parse::<i64>().ok()).unwrap_or(0);
    let signature = crate::e2b::header(req.headers(), SIGNATURE_HEADER).unwrap_or("").to_owned();
    let path = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/").to_owned();
    let now = unix_seconds();
    if app.control.verify_forward(&node, at, now, req.method().as_str(), &path, &client, &signature) {
        if let Ok(ip) = client.parse::<std::net::IpAddr>() {
            req.extensions_mut().insert(ConnectInfo(SocketAddr::new(ip, 0)));
        }
    }
    strip_fleet_headers(req.headers_mut());
    true
}

fn strip_fleet_headers(headers: &mut HeaderMap) {
    for name in FLEET_HEADERS {
        headers.remove(name);
    }
}

fn unix_seconds() -> i64 {
    hutch_api::time::now_ms() / 1000
}

/// A create's node: the caller is authenticated here (placement reads its
/// templates) and the body read to find the template. A request this node
/// cannot place (no credential, no template field, a lone node) is
/// answered here, which says what is wrong.
async fn placed(app: &App, flavor: Flavor, req: Request) -> Result<(Route, Request), Response> {
    if app.control.alone().await {
        return Ok((Route::Here, req));
    }
    let Some(caller) = caller_of(app, flavor, req.headers()).await else { return Ok((Route::Here, req)) };
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, CREATE_BODY_LIMIT).await {
        Ok(b) => b,
        Err(_) => {
            let e = ApiError::new(ErrorCode::PayloadTooLarge, "a create's body is at most 1 MiB");
            return Err(error(flavor, e));
        }
    };
    let field = if flavor == Flavor::E2b { "templateID" } else { "template" };
    let body = serde_json::from_slice::<serde_json::Value>(&bytes).ok();
    let text = |name: &str| body.as_ref().and_then(|v| v.get(name)).and_then(|t| t.as_str()).map(str::to_owned);
    let named = text(field).filter(|t| !t.is_empty() && t != "base");
    let pinned = if flavor == Flavor::Native { text("node") } else { None };
    // Volumes are files on the node that made them: a create mounting
    // some goes to the first one's node (which has them all, or says which
    // it lacks).
    let first_volume = body.as_ref().and_then(|v| v["volumes"][0]["name"].as_str()).map(str::to_owned);
    if let (Flavor::Native, None, Some(volume)) = (flavor, &pinned, first_volume) {
        let route = app.control.locate_volume(&caller, &volume).await;
        return Ok((route, Request::from_parts(parts, Body::from(bytes))));
    }
    // So are snapshots (whose files a node pulls where it can) and E2B's
    // volume mounts: a create naming one stays on the node asked, which
    // has them or says so.
    let listed = |name: &str| {
        body.as_ref().and_then(|v| v.get(name)).is_some_and(|x| !x.is_null() && x != &serde_json::json!([]))
    };
    let named_snapshot = named.as_deref().is_some_and(|t| hutch_control::SnapshotId::parse(t).is_ok());
    if pinned.is_none() && (listed("snapshot") || listed("volumes") || listed("volumeMounts") || named_snapshot) {
        return Ok((Route::Here, Request::from_parts(parts, Body::from(bytes))));
    }
    let template = match (flavor, named) {
        (Flavor::E2b, Some(t)) => Some(app.control.e2b_template_name(&caller, &t).await.unwrap_or(t)),
        (_, t) => t,
    };
    let route = app.control.place(&caller, template.as_deref(), pinned.as_deref()).await;
    Ok((route, Request::from_parts(parts, Body::from(bytes))))
}

/// The caller a request's credential names (None: none, or not a valid
/// one; the node that answers says so).
async fn caller_of(app: &App, flavor: Flavor, headers: &HeaderMap) -> Option<hutch_control::Caller> {
    let caller = match flavor {
        Flavor::Native => {
            let key =
                crate::e2b::header(headers, "authorization").and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
            app.control.authenticate_native(key.trim()).await
        }
        Flavor::E2b => app.control.authenticate(crate::e2b::header(headers, "x-api-key").unwrap_or("").trim()).await,
    };
    caller.ok().flatten()
}

fn error(flavor: Flavor, e: ApiError) -> Response {
    match flavor {
        Flavor::Native => e.into_response(),
        Flavor::E2b => {
            let (_, status) = crate::e2b::connect_code(e.code);
            let body = serde_json::json!({"code": status.as_u16(), "message": e.message});
            (status, axum::Json(body)).into_response()
        }
    }
}

fn unreachable(flavor: Flavor, node: &str, why: impl std::fmt::Display) -> Response {
    error(flavor, ApiError::new(ErrorCode::NodeUnreachable, format!("node {node} did not answer: {why}")))
}

/// `host:port` of an `http://` URL without a path (what a node advertises).
pub fn http_authority(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("http://")?.trim_end_matches('/');
    (!rest.is_empty() && !rest.contains(['/', '?', '#', '@'])).then_some(rest)
}

/// Passes `req` to node `node` at `url` and its answer back.
async fn forward(app: &App, node: &str, url: &str, mut req: Request, flavor: Flavor) -> Response {
    let Some(authority) = http_authority(url) else {
        return unreachable(flavor, node, format!("it advertises {url:?}, not http://host:port"));
    };
    let conn = req.extensions().get::<ConnectInfo<crate::listener::Conn>>().map(|c| c.0.clone());
    let client = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(a)| a.ip().to_canonical().to_string())
        .unwrap_or_default();
    let upgrade = crate::proxy::wants_upgrade(req.headers());
    let downstream = upgrade.then(|| hyper::upgrade::on(&mut req));

    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").to_owned();
    let mut out = axum::http::Request::new(body);
    *out.method_mut() = parts.method.clone();
    *out.version_mut() = Version::HTTP_11;
    *out.uri_mut() = match Uri::try_from(path.as_str()) {
        Ok(u) => u,
        Err(_) => return error(flavor, ApiError::invalid("malformed path")),
    };
    let headers = out.headers_mut();
    *headers = end_to_end(&parts.headers);
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        for v in parts.headers.get_all(header::UPGRADE) {
            headers.append(header::UPGRADE, v.clone());
        }
    }
    let mut add = |name: &'static str, value: &str| {
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.insert(HeaderName::from_static(name), v);
        }
    };
    add(NODE_HEADER, app.control.node_name());
    add(CLIENT_HEADER, &client);
    let at = unix_seconds();
    if let Some(sig) = app.control.sign_forward(at, parts.method.as_str(), &path, &client) {
        add(TIME_HEADER, &at.to_string());
        add(SIGNATURE_HEADER, &sig);
    }

    let pooled = if upgrade { None } else { app.forwarder.take(authority) };
    let mut sender = match pooled {
        Some(s) => s,
        None => match connect(authority).await {
            Ok(s) => s,
            Err(why) => return unreachable(flavor, node, why),
        },
    };
    let mut resp = match sender.send_request(out).await {
        Ok(r) => r,
        Err(e) => return unreachable(flavor, node, e),
    };
    // The owner node accepted a credential: this connection carries an
    // authenticated client, as if it had been answered here.
    if resp.status() != StatusCode::UNAUTHORIZED {
        if let Some(c) = &conn {
            c.mark_authenticated();
        }
    }
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(downstream) = downstream else {
            return unreachable(flavor, node, "it switched protocols unasked");
        };
        let upstream = hyper::upgrade::on(&mut resp);
        if let Some(c) = &conn {
            c.mark_upgraded();
        }
        tokio::spawn(async move {
            if let (Ok(down), Ok(up)) = tokio::join!(downstream, upstream) {
                let (mut down, mut up) = (TokioIo::new(down), TokioIo::new(up));
                let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
            }
        });
        let (parts, _) = resp.into_parts();
        let mut answer = Response::new(Body::empty());
        *answer.status_mut() = parts.status;
        *answer.headers_mut() = parts.headers;
        return answer;
    }
    if !upgrade {
        // Usable again once this answer's body is read; taken only then.
        app.forwarder.keep(authority, sender);
    }
    let (parts, body) = resp.into_parts();
    let mut answer = Response::new(Body::new(body));
    *answer.status_mut() = parts.status;
    *answer.headers_mut() = end_to_end(&parts.headers);
    answer
}

/// A new HTTP/1.1 connection to a node.
async fn connect(authority: &str) -> Result<SendRequest<Body>, String> {
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(authority)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(format!("connect to {authority}: {e}")),
        Err(_) => return Err(format!("connect to {authority}: no answer in {}s", CONNECT_TIMEOUT.as_secs())),
    };
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEADER_BYTES.max(8192) * 2)
        .handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| format!("{authority}: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    });
    Ok(sender)
}

/// Headers without the hop-by-hop ones (those `Connection` names
/// included) and `Expect` (this node already answered it).
pub fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    const HOP: [&str; 8] =
        ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"];
    let named: Vec<String> =
        headers.get_all(header::CONNECTION).iter().flat_map(|v| crate::proxy::connection_list(v.as_bytes())).collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        if HOP.contains(&n) || named.iter().any(|c| c == n) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "sb-0123456789abcdef";

    fn aim_of(method: Method, path: &str) -> Aim {
        aim(&method, path, None, None, None)
    }

    #[test]
    fn sandbox_calls_aim_at_their_sandbox_and_reads_of_the_record_stay_here() {
        for path in [
            format!("/v1/sandboxes/{ID}/exec"),
            format!("/v1/sandboxes/{ID}/files/read"),
            format!("/v1/sandboxes/{ID}/ports/8080/x"),
            format!("/sandboxes/{ID}"),
            format!("/sandboxes/{ID}/pause"),
            format!("/v2/sandboxes/{ID}/logs"),
        ] {
            assert_eq!(aim_of(Method::POST, &path), Aim::Sandbox(ID.into()), "{path}");
        }
        assert_eq!(aim_of(Method::DELETE, &format!("/v1/sandboxes/{ID}")), Aim::Sandbox(ID.into()));
        assert_eq!(aim_of(Method::GET, &format!("/v1/sandboxes/{ID}")), Aim::Local);
        assert_eq!(aim_of(Method::GET, "/v1/sandboxes"), Aim::Local);
        assert_eq!(aim_of(Method::GET, "/sandboxes"), Aim::Local);
        assert_eq!(aim_of(Method::GET, "/v1/keys"), Aim::Local);
        assert_eq!(aim_of(Method::POST, "/v1/templates"), Aim::Local);
    }

    #[test]
    fn calls_for_one_volume_aim_at_it_and_its_list_stays_here() {
        for m in [Method::GET, Method::PATCH, Method::DELETE] {
            assert_eq!(aim_of(m, "/v1/volumes/data"), Aim::Volume("data".into()));
        }
        assert_eq!(aim_of(Method::GET, "/v1/volumes"), Aim::Local);
        assert_eq!(aim_of(Method::POST, "/v1/volumes"), Aim::Local);
    }

    #[test]
    fn creates_are_placed() {
        assert_eq!(aim_of(Method::POST, "/v1/sandboxes"), Aim::Create(Flavor::Native));
        assert_eq!(aim_of(Method::POST, "/v1/executions"), Aim::Create(Flavor::Native));
        assert_eq!(aim_of(Method::POST, "/sandboxes"), Aim::Create(Flavor::E2b));
        assert_eq!(aim_of(Method::POST, "/v2/sandboxes"), Aim::Create(Flavor::E2b));
        assert_eq!(aim_of(Method::GET, "/v2/sandboxes"), Aim::Local);
    }

    #[test]
    fn host_names_and_the_e2b_header_name_the_sandbox_whatever_the_path() {
        let e2b = format!("49983-{ID}.e2b.example.com");
        assert_eq!(aim(&Method::POST, "/files", Some(&e2b), Some("e2b.example.com"), None), Aim::Sandbox(ID.into()));
        // Without an E2B domain that host is nobody's.
        assert_eq!(aim(&Method::POST, "/files", Some(&e2b), None, None), Aim::Local);
        let proxy = format!("{ID}--8080.sandboxes.localhost");
        assert_eq!(aim(&Method::GET, "/", Some(&proxy), None, None), Aim::Sandbox(ID.into()));
        assert_eq!(aim(&Method::POST, "/process.Process/Start", None, None, Some(ID)), Aim::Sandbox(ID.into()));
    }

    #[test]
    fn advertised_urls_give_an_authority_or_nothing() {
        assert_eq!(http_authority("http://10.0.0.1:7000"), Some("10.0.0.1:7000"));
        assert_eq!(http_authority("http://node-a:7000/"), Some("node-a:7000"));
        for bad in ["https://a:1", "http://", "http://a:1/x", "http://u@a:1", "a:1", ""] {
            assert_eq!(http_authority(bad), None, "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-private"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("expect", HeaderValue::from_static("100-continue"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        h.insert("host", HeaderValue::from_static("x.sandboxes.localhost"));
        let out = end_to_end(&h);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["authorization", "host"]);
    }
}
