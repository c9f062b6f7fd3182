//! The port proxy: serves a TCP port inside a sandbox over HTTP/1.1 (with
//! WebSocket upgrades and streamed bodies both ways) at
//! `http://<id>--<port>.sandboxes.localhost:<api port>/` (chosen by the Host
//! header, before any API route) and at `/v1/sandboxes/<id>/ports/<port>/`
//! for clients without wildcard DNS.
//!
//! Every request carries a live access token for exactly that sandbox and
//! port, in `X-Hutch-Sandbox-Token` or in the cookie set by a form POST to
//! `<url>_hutch/access`. What the client sends that could pass for hutch's
//! or a proxy's word (`X-Hutch-*`, `Forwarded`, `X-Forwarded-*`, their `_`
//! and `.` spellings), the credential itself, and hop-by-hop headers never
//! reach the application. Responses get a script-less CSP and
//! `Cache-Control: private, no-store`, and cannot set or clear the
//! credential cookie.
//!
//! Every client connection is wrapped ([`crate::listener::ConnIo`]) so that the proxy can
//! end it: when a grant that a connection used is revoked or expires, the
//! connection is closed (idle keep-alive, streaming response or WebSocket
//! alike), together with its connection to the sandbox.

use crate::listener::Conn;
use crate::{ApiError, App};
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode, Uri, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hutch_api::ErrorCode;
use hutch_control::access::AccessPass;
use hutch_control::ControlError;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::sync::{Arc, Mutex};

/// The request header that carries an access token.
pub const TOKEN_HEADER: &str = "x-hutch-sandbox-token";
/// The cookie that carries an access token (set by `<url>_hutch/access`).
pub const COOKIE: &str = "hutch_sandbox_token";
/// Host names `<id>--<port>` + this suffix are served by the proxy.
pub const HOST_SUFFIX: &str = ".sandboxes.localhost";
/// Added to every proxied response, beside the application's own policy.
pub const CSP: &str = "script-src 'none'; object-src 'none'; frame-src 'self'";
/// Paths under this prefix (after a grant's url) belong to hutch.
const RESERVED: &str = "/_hutch/";
/// Bounds on what the application answers: header count and bytes, and the
/// read buffer.
const MAX_HEADERS: usize = 100;
const MAX_HEADER_BYTES: usize = 64 << 10;
/// The form POST to `_hutch/access` holds a token and little else.
const FORM_LIMIT: usize = 4096;

// ---------------------------------------------------------------------------
// What the proxy keeps on a client connection

/// A client connection to a port in a sandbox.
pub(crate) struct Upstream {
    sandbox: String,
    port: u16,
    sender: SendRequest<Body>,
    /// The task driving the connection; aborting it closes the connection.
    driver: tokio::task::AbortHandle,
}

impl Upstream {
    /// Closes the connection to the sandbox.
    pub(crate) fn close(self) {
        self.driver.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Conn {
    /// Kills this connection when the grant of `pass` ends (once per grant).
    fn watch(&self, pass: &AccessPass) {
        {
            let mut watched = lock(&self.0.watched);
            if watched.contains(&pass.grant_id) {
                return;
            }
            watched.push(pass.grant_id.clone());
        }
        let (conn, pass) = (self.clone(), pass.clone());
        let mut closed = self.0.closed.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                _ = pass.ended() => conn.kill(),
                _ = closed.wait_for(|c| *c) => {}
            }
        });
    }

    /// The kept connection to `port` of `sandbox`, if it is still usable.
    async fn take_upstream(&self, sandbox: &str, port: u16) -> Option<Upstream> {
        let mut up = lock(&self.0.upstream).take()?;
        if up.sandbox == sandbox && up.port == port && up.sender.ready().await.is_ok() {
            return Some(up);
        }
        up.close();
        None
    }

    /// Keeps a connection to a sandbox for the next request, unless this
    /// connection was killed meanwhile.
    fn keep_upstream(&self, up: Upstream) {
        let mut slot = lock(&self.0.upstream);
        if self.is_killed() {
            up.close();
            return;
        }
        if let Some(old) = slot.replace(up) {
            old.close();
        }
    }
}

// ---------------------------------------------------------------------------
// Routing

/// Where a proxied request goes: a sandbox, a port, the path and query to
/// send there, and the grant url's path (for the cookie and redirects).
pub(crate) struct Target {
    pub(crate) sandbox: String,
    pub(crate) port: u16,
    pub(crate) path_and_query: String,
    pub(crate) base: String,
}

/// How a checked request is passed on.
pub(crate) struct Passing {
    /// The Host to send instead of the client's (with the client's in
    /// `X-Forwarded-Host`).
    pub(crate) host: Option<String>,
    /// Add hutch's response policy (script-less CSP, no caching): for
    /// hutch's own proxy hosts and path form, which share a site (or the
    /// origin) with the daemon. E2B's host names are origins of the
    /// operator's E2B domain and serve applications as they are, as E2B's
    /// proxy does.
    pub(crate) policy: bool,
}

/// Middleware in front of every route: requests for a proxy host name go to
/// the proxy, the rest to the API.
pub(crate) async fn by_host(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    // E2B's host names of the operator's domain (`<port>-<id>.<domain>`).
    let req = match crate::e2b::ports::by_host(&app, req).await {
        Ok(resp) => return resp,
        Err(req) => req,
    };
    let host =
        req.uri().host().map(str::to_owned).or_else(|| {
            req.headers().get(header::HOST).and_then(|h| h.to_str().ok()).map(|h| strip_port(h).to_owned())
        });
    let Some(label) = host.as_deref().and_then(proxy_label) else { return next.run(req).await };
    let target = parse_label(&label).map(|(sandbox, port)| {
        let path_and_query = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let path_and_query = if path_and_query.starts_with('/') { path_and_query.to_owned() } else { "/".to_owned() };
        Target { sandbox, port, path_and_query, base: "/".to_owned() }
    });
    match target {
        Ok(t) => serve(app, t, req).await,
        Err(e) => e.into_response(),
    }
}

/// `/v1/sandboxes/{id}/ports/{port}[/...]`: the path form. The rest of the
/// path is passed on as the client wrote it (not decoded).
pub(crate) async fn by_path(State(app): State<Arc<App>>, req: Request) -> Response {
    let uri = req.uri().clone();
    let Some((id, port, rest)) = parse_port_path(uri.path()) else {
        return ApiError::new(ErrorCode::NotFound, "no such route").into_response();
    };
    let (sandbox, port) = match target_of(id, port) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let base = format!("/v1/sandboxes/{sandbox}/ports/{port}/");
    let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    let Some(rest) = rest else {
        // The grant's url ends with a slash; relative links need it.
        return redirect(StatusCode::PERMANENT_REDIRECT, &format!("{base}{query}"), None);
    };
    serve(app, Target { sandbox, port, path_and_query: format!("/{rest}{query}"), base }, req).await
}

// ---------------------------------------------------------------------------
// Parsers of untrusted bytes
//
// Everything the proxy reads from a client or an application goes through
// these pure functions (no IO, no state), so fuzz targets can call them:
// host names (`strip_port`, `proxy_label`, `parse_label`, `target_of`), the
// path form (`parse_port_path`), cookies (`cookie_pairs`, `cookie_token`,
// `without_reserved_cookie`, `set_cookie_sent_name`,
// `sets_reserved_cookie`), `Upgrade` and `Connection` lists
// (`upgrade_offers_websocket`, `connection_list`), and the header filters
// over whole header maps (`request_headers`, `response_headers`).

/// A Host header without its `:port`.
pub fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// `<id>--<port>` of a proxy host name, lowercased; None for other hosts.
pub fn proxy_label(host: &str) -> Option<String> {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let label = host.strip_suffix(HOST_SUFFIX)?;
    Some(label.to_owned())
}

/// The sandbox and port a `<id>--<port>` label names.
pub fn parse_label(label: &str) -> Result<(String, u16), ApiError> {
    let (id, port) = label
        .rsplit_once("--")
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("{label}{HOST_SUFFIX} names no sandbox port")))?;
    target_of(id, port)
}

/// `/v1/sandboxes/<id>/ports/<port>[/<rest>]`: the id, the port and the
/// rest (None when the path stops after the port, without a slash).
pub fn parse_port_path(path: &str) -> Option<(&str, &str, Option<&str>)> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let (id, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("ports/")?;
    Some(match rest.split_once('/') {
        Some((port, rest)) => (id, port, Some(rest)),
        None => (id, rest, None),
    })
}

/// A sandbox id and a port number, checked.
pub fn target_of(id: &str, port: &str) -> Result<(String, u16), ApiError> {
    let id = hutch_control::SandboxId::parse(id)?.to_string();
    let port: u32 = port
        .parse()
        .ok()
        .filter(|_| port.len() <= 6 && port.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| ApiError::invalid(format!("{port:?} is not a port number")))?;
    let port = hutch_control::access::valid_port(port)?;
    Ok((id, port))
}

// ---------------------------------------------------------------------------
// Serving one request

async fn serve(app: Arc<App>, target: Target, req: Request) -> Response {
    match proxy(app, target, req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

/// Errors of the proxy: a sandbox that is not running is said plainly (the
/// control plane's message speaks of commands).
fn proxy_error(e: ControlError, sandbox: &str) -> ApiError {
    match e {
        ControlError::NotRunning { state, .. } => ApiError::new(
            ErrorCode::SandboxSessionNotRunning,
            format!("sandbox {sandbox} is {}, not running", state.as_str()),
        ),
        e => ApiError::from(e),
    }
}

async fn proxy(app: Arc<App>, target: Target, req: Request) -> Result<Response, ApiError> {
    let path = target.path_and_query.split('?').next().unwrap_or("/");
    if let Some(what) = path.strip_prefix(RESERVED) {
        return reserved(app, &target, what, req).await;
    }
    let token = request_token(req.headers());
    let pass = app
        .control
        .authorize_access(&target.sandbox, target.port, token.as_deref())
        .await
        .map_err(|e| proxy_error(e, &target.sandbox))?;
    forward(&app, &target, pass, req, Passing { host: None, policy: true }).await
}

/// Passes a request whose credential was checked (`pass`) to the sandbox's
/// port, and its answer back.
pub(crate) async fn forward(
    app: &App,
    target: &Target,
    pass: AccessPass,
    mut req: Request,
    passing: Passing,
) -> Result<Response, ApiError> {
    let conn = match req.extensions().get::<ConnectInfo<Conn>>() {
        Some(ConnectInfo(conn)) => conn.clone(),
        // Served without our listener (tests): the kill reaches the
        // connection to the sandbox only.
        None => Conn::detached(),
    };
    conn.mark_authenticated();
    conn.watch(&pass);

    let upgrade = wants_upgrade(req.headers());
    let downstream_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut out = axum::http::Request::new(body);
    *out.method_mut() = parts.method.clone();
    *out.version_mut() = Version::HTTP_11;
    *out.uri_mut() = Uri::try_from(target.path_and_query.as_str())
        .map_err(|_| ApiError::invalid(format!("malformed path {:?}", target.path_and_query)))?;
    *out.headers_mut() = request_headers(&parts.headers, upgrade);
    if let Some(host) = &passing.host {
        let masked = HeaderValue::from_str(host).map_err(|_| ApiError::invalid("the masked host is not a header"))?;
        if let Some(original) = parts.headers.get(header::HOST) {
            out.headers_mut().insert("x-forwarded-host", original.clone());
        }
        out.headers_mut().insert(header::HOST, masked);
    }
    if !out.headers().contains_key(header::HOST) {
        let host = HeaderValue::from_str(&format!("localhost:{}", target.port))
            .map_err(|_| ApiError::new(ErrorCode::Internal, "host header"))?;
        out.headers_mut().insert(header::HOST, host);
    }

    let mut up = match conn.take_upstream(&target.sandbox, target.port).await {
        Some(up) => up,
        None => connect(app, target).await?,
    };
    let unreachable = |e: hyper::Error| {
        ApiError::new(
            ErrorCode::SandboxPortUnreachable,
            format!("port {} in sandbox {} failed the request: {e}", target.port, target.sandbox),
        )
    };
    let sent = tokio::select! {
        sent = up.sender.send_request(out) => sent,
        _ = pass.ended() => {
            up.driver.abort();
            return Err(ApiError::new(ErrorCode::AccessTokenInvalid, "the access grant ended"));
        }
    };
    let mut resp = match sent {
        Ok(resp) => resp,
        Err(e) => {
            up.driver.abort();
            return Err(unreachable(e));
        }
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(downstream_upgrade) = downstream_upgrade else {
            up.driver.abort();
            return Err(ApiError::new(
                ErrorCode::SandboxPortUnreachable,
                format!("port {} in sandbox {} switched protocols unasked", target.port, target.sandbox),
            ));
        };
        if !resp.headers().get_all(header::UPGRADE).iter().any(|v| upgrade_offers_websocket(v.as_bytes())) {
            up.driver.abort();
            return Err(ApiError::new(
                ErrorCode::SandboxPortUnreachable,
                format!(
                    "port {} in sandbox {} switched to a protocol other than WebSocket",
                    target.port, target.sandbox
                ),
            ));
        }
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let headers = response_headers_for(resp.headers(), true, passing.policy);
        // A tunnel lives as long as its grant: no idle timeout applies.
        conn.mark_upgraded();
        tokio::spawn(tunnel(downstream_upgrade, upstream_upgrade, pass, conn.clone(), up));
        let mut out = Response::new(Body::empty());
        *out.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        *out.headers_mut() = headers;
        return Ok(out);
    }

    conn.keep_upstream(up);
    let (parts, body) = resp.into_parts();
    let mut out = Response::new(Body::new(body));
    *out.status_mut() = parts.status;
    *out.headers_mut() = response_headers_for(&parts.headers, false, passing.policy);
    Ok(out)
}

/// Opens a connection to the target port and starts its HTTP/1.1 client.
async fn connect(app: &App, target: &Target) -> Result<Upstream, ApiError> {
    let stream =
        app.control.connect_port(&target.sandbox, target.port).await.map_err(|e| proxy_error(e, &target.sandbox))?;
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEADER_BYTES)
        .max_buf_size(MAX_HEADER_BYTES.max(8192) * 2)
        .handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| {
            ApiError::new(
                ErrorCode::SandboxPortUnreachable,
                format!("port {} in sandbox {}: {e}", target.port, target.sandbox),
            )
        })?;
    let driver = tokio::spawn(async move {
        let _ = connection.with_upgrades().await;
    })
    .abort_handle();
    Ok(Upstream { sandbox: target.sandbox.clone(), port: target.port, sender, driver })
}

/// Copies bytes both ways between an upgraded client connection and the
/// sandbox until either side closes, the grant ends or the client
/// connection is killed.
async fn tunnel(
    downstream: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    pass: AccessPass,
    conn: Conn,
    up: Upstream,
) {
    let (Ok(down), Ok(upgraded)) = tokio::join!(downstream, upstream) else {
        up.driver.abort();
        return;
    };
    let (mut down, mut upgraded) = (TokioIo::new(down), TokioIo::new(upgraded));
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut down, &mut upgraded) => {}
        _ = pass.ended() => conn.kill(),
        _ = conn.killed() => {}
    }
    up.driver.abort();
}

/// `POST <url>_hutch/access`: checks the form's token and answers with the
/// cookie and a redirect to the grant's url.
async fn reserved(app: Arc<App>, target: &Target, what: &str, req: Request) -> Result<Response, ApiError> {
    if what != "access" {
        return Err(ApiError::new(ErrorCode::NotFound, format!("{RESERVED}{what} is reserved by hutch")));
    }
    if req.method() != Method::POST {
        return Err(ApiError::invalid("POST the token as a form (field `token`) to _hutch/access"));
    }
    let form = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim() == "application/x-www-form-urlencoded"));
    if !form {
        return Err(ApiError::invalid("_hutch/access takes application/x-www-form-urlencoded"));
    }
    let secure = is_https(req.headers(), req.uri());
    let conn = req.extensions().get::<ConnectInfo<Conn>>().map(|c| c.0.clone());
    let body = axum::body::to_bytes(req.into_body(), FORM_LIMIT)
        .await
        .map_err(|_| ApiError::new(ErrorCode::PayloadTooLarge, format!("form above {FORM_LIMIT} bytes")))?;
    let token = form_urlencoded::parse(&body).find(|(k, _)| k == "token").map(|(_, v)| v.into_owned());
    let pass = app
        .control
        .authorize_access(&target.sandbox, target.port, token.as_deref())
        .await
        .map_err(|e| proxy_error(e, &target.sandbox))?;
    if let Some(conn) = conn {
        conn.mark_authenticated();
    }
    let token = token.unwrap_or_default();
    if !token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(ApiError::new(ErrorCode::AccessTokenInvalid, "the access token is malformed"));
    }
    let max_age = ((pass.expires_at - hutch_control::control::now_ms()) / 1000).max(1);
    let cookie = format!(
        "{COOKIE}={token}; Path={}; Max-Age={max_age}; HttpOnly; SameSite=Strict{}",
        target.base,
        if secure { "; Secure" } else { "" }
    );
    Ok(redirect(StatusCode::SEE_OTHER, &target.base, Some(cookie)))
}

fn redirect(status: StatusCode, location: &str, cookie: Option<String>) -> Response {
    let mut resp = status.into_response();
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(location) {
        h.insert(header::LOCATION, v);
    }
    if let Some(v) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        h.insert(header::SET_COOKIE, v);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, no-store"));
    resp
}

/// Whether the client reached us over TLS (as a terminating proxy in front
/// says). A forged claim only makes the cookie stricter.
fn is_https(headers: &HeaderMap, uri: &Uri) -> bool {
    uri.scheme_str() == Some("https")
        || headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim() == "https")
        || headers
            .get("forwarded")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().contains("proto=https"))
}

// ---------------------------------------------------------------------------
// Headers

/// The token of a request: the header if present, else the reserved cookie
/// (the first of them, should the client send several).
fn request_token(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers.get(TOKEN_HEADER) {
        // Bytes that are not text match no token (and are refused as invalid).
        return Some(String::from_utf8_lossy(v.as_bytes()).into_owned());
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .find_map(|v| cookie_token(v.as_bytes()))
        .map(|t| String::from_utf8_lossy(t).into_owned())
}

/// Whether the request asks for a WebSocket upgrade, the only protocol
/// the proxy switches to.
pub(crate) fn wants_upgrade(headers: &HeaderMap) -> bool {
    connection_tokens(headers).iter().any(|t| t == "upgrade")
        && headers.get_all(header::UPGRADE).iter().any(|v| upgrade_offers_websocket(v.as_bytes()))
}

/// The names every `Connection` header lists, lowercased.
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers.get_all(header::CONNECTION).iter().flat_map(|v| connection_list(v.as_bytes())).collect()
}

/// Spaces and tabs around list items and cookie parts.
fn trim_ows(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !c.is_ascii_whitespace()).map_or(start, |i| i + 1);
    &b[start..end]
}

/// The names a `Connection` header value lists, lowercased (bytes outside
/// ASCII kept as replacement characters: such a name matches no header).
pub fn connection_list(value: &[u8]) -> Vec<String> {
    value
        .split(|b| *b == b',')
        .map(trim_ows)
        .filter(|t| !t.is_empty())
        .map(|t| String::from_utf8_lossy(t).to_ascii_lowercase())
        .collect()
}

/// Whether an `Upgrade` header value offers WebSocket.
pub fn upgrade_offers_websocket(value: &[u8]) -> bool {
    value.split(|b| *b == b',').map(trim_ows).any(|p| p.eq_ignore_ascii_case(b"websocket"))
}

/// The pairs of a `Cookie` header as a server reads them: parts split at
/// `;`, each `name=value` split at its first `=`, spaces trimmed; a part
/// without `=` is a value with an empty name. Bytes outside ASCII are kept.
pub fn cookie_pairs(header: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    header.split(|b| *b == b';').map(trim_ows).filter(|p| !p.is_empty()).map(|p| {
        match p.iter().position(|b| *b == b'=') {
            Some(i) => (trim_ows(&p[..i]), trim_ows(&p[i + 1..])),
            None => (&p[..0], p),
        }
    })
}

/// The reserved cookie's value in a `Cookie` header (the first, unquoted).
pub fn cookie_token(header: &[u8]) -> Option<&[u8]> {
    cookie_pairs(header).find(|(name, _)| *name == COOKIE.as_bytes()).map(|(_, value)| {
        let value = value.strip_prefix(b"\"").unwrap_or(value);
        value.strip_suffix(b"\"").unwrap_or(value)
    })
}

/// Whether a cookie name is the reserved one, or could pass for it: in any
/// case, quoted, or with `__Host-` or `__Secure-` prefixes.
pub fn is_reserved_cookie_name(name: &[u8]) -> bool {
    let mut name = name.to_ascii_lowercase();
    name.retain(|b| *b != b'"');
    let mut rest = name.as_slice();
    while let Some(r) = rest.strip_prefix(b"__host-").or_else(|| rest.strip_prefix(b"__secure-")) {
        rest = r;
    }
    rest == COOKIE.as_bytes()
}

/// A `Cookie` header without the reserved cookie (in any spelling of
/// [`is_reserved_cookie_name`]); None when nothing is left.
pub fn without_reserved_cookie(header: &[u8]) -> Option<Vec<u8>> {
    let kept: Vec<&[u8]> = header
        .split(|b| *b == b';')
        .map(trim_ows)
        .filter(|p| !p.is_empty())
        // A bare token (`a=1; hutch_sandbox_token`) is a value to browsers
        // but a name to some servers (Go's net/http): gone either way.
        .filter(|p| {
            let reserved = |(name, value): (&[u8], &[u8])| {
                is_reserved_cookie_name(name) || (name.is_empty() && is_reserved_cookie_name(value))
            };
            !cookie_pairs(p).next().is_some_and(reserved)
        })
        .collect();
    (!kept.is_empty()).then(|| kept.join(&b"; "[..]))
}

/// The name a browser sends back for a cookie a `Set-Cookie` value sets
/// (RFC 6265bis 5.6): the name before the first `=` of its first part; or,
/// for a nameless cookie (`=a=b`, or no `=` at all), which browsers send as
/// its value alone, the name a server reads from that value.
pub fn set_cookie_sent_name(value: &[u8]) -> &[u8] {
    let pair = value.split(|b| *b == b';').next().unwrap_or_default();
    let (name, rest) = match pair.iter().position(|b| *b == b'=') {
        Some(i) => (trim_ows(&pair[..i]), &pair[i + 1..]),
        None => (&pair[..0], pair),
    };
    if !name.is_empty() {
        return name;
    }
    let sent = trim_ows(rest);
    match sent.iter().position(|b| *b == b'=') {
        Some(i) => trim_ows(&sent[..i]),
        None => sent,
    }
}

/// Whether a `Set-Cookie` value would set (or clear) the reserved cookie.
pub fn sets_reserved_cookie(value: &[u8]) -> bool {
    is_reserved_cookie_name(set_cookie_sent_name(value))
}

/// Hop-by-hop headers (RFC 9110 7.6.1, and the older ones still seen).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
];

/// A header name with `_` and `.` read as `-`: how many servers and
/// frameworks (CGI, WSGI, some proxies) fold names.
fn folded(name: &str) -> String {
    name.to_ascii_lowercase().replace(['_', '.'], "-")
}

/// Whether a client-sent header could pass for hutch's or a proxy's word.
fn is_spoofable(name: &str) -> bool {
    let f = folded(name);
    f.starts_with("x-hutch-") || f == "forwarded" || f.starts_with("x-forwarded-") || f == "x-real-ip"
}

/// The headers sent to the sandbox: the client's, minus the credential,
/// spoofable and hop-by-hop headers; `Expect` was answered by us already.
/// With `upgrade` (a WebSocket upgrade, see `wants_upgrade`), the upgrade
/// is asked for WebSocket alone.
pub fn request_headers(headers: &HeaderMap, upgrade: bool) -> HeaderMap {
    let listed = connection_tokens(headers);
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        if is_spoofable(n) || n == "expect" || HOP_BY_HOP.contains(&n) || listed.iter().any(|l| l == n) {
            continue;
        }
        if name == header::COOKIE {
            if let Some(v) = without_reserved_cookie(value.as_bytes()).and_then(|v| HeaderValue::from_bytes(&v).ok()) {
                out.append(header::COOKIE, v);
            }
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if upgrade {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        out.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    }
    out
}

/// The headers sent to the client: the application's, minus hop-by-hop
/// headers, `Clear-Site-Data` and any cookie of the reserved name; plus our
/// CSP beside the application's and `Cache-Control: private, no-store`.
/// With `upgrade` (a `101` to a WebSocket upgrade) they say so.
pub fn response_headers(headers: &HeaderMap, upgrade: bool) -> HeaderMap {
    response_headers_for(headers, upgrade, true)
}

/// [`response_headers`], with hutch's policy (CSP, no caching) only when
/// `policy` (E2B's port hosts pass the application's own headers).
pub(crate) fn response_headers_for(headers: &HeaderMap, upgrade: bool, policy: bool) -> HeaderMap {
    let listed = connection_tokens(headers);
    let mut out = HeaderMap::with_capacity(headers.len() + 2);
    for (name, value) in headers {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n) || listed.iter().any(|l| l == n) {
            continue;
        }
        if n == "clear-site-data" || (policy && name == header::CACHE_CONTROL) {
            continue;
        }
        if name == header::SET_COOKIE && sets_reserved_cookie(value.as_bytes()) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if upgrade {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        out.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    }
    if policy {
        out.append(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
        out.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, no-store"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderName;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_bytes(k.as_bytes()).expect("name"), HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn host_names_of_the_proxy() {
        assert_eq!(proxy_label("sb-0123--8080.sandboxes.localhost").as_deref(), Some("sb-0123--8080"));
        assert_eq!(proxy_label("SB-0123--8080.Sandboxes.LOCALHOST.").as_deref(), Some("sb-0123--8080"));
        assert_eq!(proxy_label("127.0.0.1"), None);
        assert_eq!(proxy_label("sandboxes.localhost"), None);
        assert_eq!(strip_port("sb-1--80.sandboxes.localhost:7700"), "sb-1--80.sandboxes.localhost");
        let (id, port) = parse_label("sb-0123456789abcdef--3000").expect("label");
        assert_eq!((id.as_str(), port), ("sb-0123456789abcdef", 3000));
        let sb = "sb-0123456789abcdef";
        assert_eq!(parse_label(&format!("{sb}--65533")).map_err(|e| e.code).err(), Some(ErrorCode::InvalidRequest));
        assert_eq!(parse_label(&format!("{sb}--0")).map_err(|e| e.code).err(), Some(ErrorCode::InvalidRequest));
        assert_eq!(parse_label(&format!("{sb}--+80")).map_err(|e| e.code).err(), Some(ErrorCode::InvalidRequest));
        assert_eq!(parse_label("sb-1--80").map_err(|e| e.code).err(), Some(ErrorCode::NotFound));
        assert_eq!(parse_label("nodash").map_err(|e| e.code).err(), Some(ErrorCode::NotFound));
        assert_eq!(parse_label("SB/x--80").map_err(|e| e.code).err(), Some(ErrorCode::NotFound));
    }

    #[test]
    fn spoofable_headers_are_dropped_in_every_spelling() {
        let h = headers(&[
            ("x-hutch-sandbox-token", "t"),
            ("x-hutch-owner", "me"),
            ("x_hutch_owner", "me"),
            ("x.hutch.foo", "me"),
            ("forwarded", "for=1.2.3.4"),
            ("x-forwarded-for", "1.2.3.4"),
            ("x_forwarded_for", "1.2.3.4"),
            ("x.forwarded.host", "evil"),
            ("x-real-ip", "1.2.3.4"),
            ("connection", "keep-alive, x-drop-me"),
            ("x-drop-me", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic x"),
            ("upgrade", "websocket"),
            ("authorization", "Bearer app"),
            ("x_api_key", "k"),
            ("cookie", "a=1; hutch_sandbox_token=secret; b=2"),
        ]);
        let out = request_headers(&h, false);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["authorization", "x_api_key", "cookie"], "{out:?}");
        assert_eq!(out["cookie"], "a=1; b=2");
        let ws = request_headers(&headers(&[("connection", "Upgrade"), ("upgrade", "websocket")]), true);
        assert_eq!(ws["upgrade"], "websocket");
        assert_eq!(ws["connection"], "upgrade");
        assert!(request_headers(&headers(&[("cookie", "hutch_sandbox_token=x")]), false).get("cookie").is_none());
    }

    #[test]
    fn responses_get_our_policy_and_lose_what_could_touch_the_credential() {
        let h = headers(&[
            ("content-security-policy", "default-src 'self'"),
            ("cache-control", "public, max-age=3600"),
            ("clear-site-data", "\"cookies\""),
            ("set-cookie", "hutch_sandbox_token=evil; Path=/"),
            ("set-cookie", "Hutch_Sandbox_Token=evil"),
            ("set-cookie", "__Host-hutch_sandbox_token=evil"),
            ("set-cookie", "session=app; HttpOnly"),
            ("x-app", "kept"),
            ("connection", "close"),
        ]);
        let out = response_headers(&h, false);
        let csp: Vec<&str> = out.get_all("content-security-policy").iter().filter_map(|v| v.to_str().ok()).collect();
        assert_eq!(csp, ["default-src 'self'", CSP]);
        assert_eq!(out["cache-control"], "private, no-store");
        assert!(out.get("clear-site-data").is_none());
        assert!(out.get("connection").is_none());
        let cookies: Vec<&str> = out.get_all("set-cookie").iter().filter_map(|v| v.to_str().ok()).collect();
        assert_eq!(cookies, ["session=app; HttpOnly"]);
        assert_eq!(out["x-app"], "kept");
    }

    #[test]
    fn the_parsers_of_untrusted_bytes_read_what_a_browser_or_server_would() {
        assert_eq!(parse_port_path("/v1/sandboxes/sb-1/ports/80/a/b?q"), Some(("sb-1", "80", Some("a/b?q"))));
        assert_eq!(parse_port_path("/v1/sandboxes/sb-1/ports/80"), Some(("sb-1", "80", None)));
        assert_eq!(parse_port_path("/v1/sandboxes/sb-1/files"), None);
        let pairs: Vec<(&[u8], &[u8])> = cookie_pairs(b" a = 1 ;;b;=c=d; \xff=\xfe ").collect();
        assert_eq!(pairs, [(&b"a"[..], &b"1"[..]), (b"", b"b"), (b"", b"c=d"), (b"\xff", b"\xfe")]);
        assert_eq!(cookie_token(b"x=1; hutch_sandbox_token=\"t\"; hutch_sandbox_token=u"), Some(&b"t"[..]));
        assert_eq!(cookie_token(b"=hutch_sandbox_token=t"), None, "a nameless value is no credential");
        assert_eq!(set_cookie_sent_name(b"a=1; Path=/"), b"a");
        assert_eq!(set_cookie_sent_name(b"=a=1"), b"a");
        assert_eq!(set_cookie_sent_name(b"  =  a b =1"), b"a b");
        assert_eq!(set_cookie_sent_name(b"lonely"), b"lonely");
        assert_eq!(set_cookie_sent_name(b""), b"");
        assert!(is_reserved_cookie_name(b"__Secure-__Host-\"HUTCH_sandbox_token\""));
        assert!(!is_reserved_cookie_name(b"hutch_sandbox_tokens"));
        assert_eq!(connection_list(b" Upgrade ,, keep-alive,\xff"), ["upgrade", "keep-alive", "\u{fffd}"]);
        assert!(upgrade_offers_websocket(b"h2c, WebSocket"));
        assert!(!upgrade_offers_websocket(b"websocket/13x, h2c"));
    }

    /// Arbitrary bytes make no parser panic (a fuzz target does this at
    /// length; this is the quick version).
    #[test]
    fn the_parsers_take_any_bytes() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let alphabet = b"=;,:-\"_ .\t\xffhutch_sandbox_token--80sandboxes.localhost/v1/sandboxes/ports/";
        for _ in 0..20_000 {
            let len = (x % 48) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x.is_multiple_of(3) {
                        (x >> 8) as u8
                    } else {
                        alphabet[(x >> 16) as usize % alphabet.len()]
                    }
                })
                .collect();
            let text = String::from_utf8_lossy(&bytes);
            let _ = cookie_pairs(&bytes).count();
            let _ = cookie_token(&bytes);
            let _ = without_reserved_cookie(&bytes);
            let _ = sets_reserved_cookie(&bytes);
            let _ = connection_list(&bytes);
            let _ = upgrade_offers_websocket(&bytes);
            let _ = proxy_label(strip_port(&text)).map(|l| parse_label(&l).is_ok());
            let _ = parse_port_path(&text).map(|(id, port, _)| target_of(id, port).is_ok());
            if let Some(kept) = without_reserved_cookie(&bytes) {
                assert!(cookie_token(&kept).is_none(), "{bytes:?}");
            }
        }
    }

    /// Finding 22 of issue 10: browsers send a nameless cookie as its value
    /// alone, so `=hutch_sandbox_token=x` arrives as the reserved cookie.
    #[test]
    fn a_nameless_set_cookie_cannot_plant_the_credential() {
        let h = headers(&[
            ("set-cookie", "=hutch_sandbox_token=evil"),
            ("set-cookie", " = hutch_sandbox_token=evil; Path=/"),
            ("set-cookie", "hutch_sandbox_token"),
            ("set-cookie", "=__Secure-hutch_sandbox_token=evil"),
            ("set-cookie", "=\"hutch_sandbox_token\"=evil"),
            ("set-cookie", "=other=1"),
            ("set-cookie", "session=app; HttpOnly"),
        ]);
        let out = response_headers(&h, false);
        let cookies: Vec<&str> = out.get_all("set-cookie").iter().filter_map(|v| v.to_str().ok()).collect();
        assert_eq!(cookies, ["=other=1", "session=app; HttpOnly"]);
    }

    /// Found by fuzz/fuzz_targets/proxy_headers.rs: a bare
    /// `hutch_sandbox_token` in a Cookie header reached the application,
    /// which a server that reads a bare token as a name (Go's) takes for
    /// the reserved cookie.
    #[test]
    fn a_bare_reserved_cookie_name_does_not_reach_the_application() {
        for header in [&b"a=1; hutch_sandbox_token"[..], b"hutch_sandbox_token; a=1", b"a=1;=HUTCH_sandbox_token"] {
            assert_eq!(without_reserved_cookie(header).as_deref(), Some(&b"a=1"[..]), "{header:?}");
        }
        assert_eq!(without_reserved_cookie(b"a=1; other"), Some(b"a=1; other".to_vec()));
    }

    /// Finding 22 of issue 10: a Cookie header with bytes outside ASCII was
    /// forwarded whole, the credential included.
    #[test]
    fn a_cookie_header_with_non_ascii_bytes_loses_the_credential_too() {
        let mut h = HeaderMap::new();
        let v = HeaderValue::from_bytes(b"a=\xc3\xa9t\xc3\xa9; hutch_sandbox_token=secret; b=\xff").expect("value");
        h.append(header::COOKIE, v);
        let out = request_headers(&h, false);
        assert_eq!(out["cookie"].as_bytes(), b"a=\xc3\xa9t\xc3\xa9; b=\xff");
        assert_eq!(request_token(&h).as_deref(), Some("secret"), "the credential is found in such a header too");
        let only = HeaderValue::from_bytes(b"hutch_sandbox_token=secret; \xff").expect("value");
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, only);
        assert_eq!(request_headers(&h, false)["cookie"].as_bytes(), b"\xff");
    }

    /// Finding 22 of issue 10: the docs promise WebSocket upgrades only.
    #[test]
    fn only_websocket_upgrades_pass() {
        let ws = headers(&[("connection", "keep-alive, Upgrade"), ("upgrade", "WebSocket")]);
        assert!(wants_upgrade(&ws));
        for other in ["h2c", "TLS/1.0", "foo", "websocketx", ""] {
            let h = headers(&[("connection", "upgrade"), ("upgrade", other)]);
            assert!(!wants_upgrade(&h), "{other:?}");
            let out = request_headers(&h, wants_upgrade(&h));
            assert!(out.get("upgrade").is_none() && out.get("connection").is_none(), "{other:?}: {out:?}");
        }
        let both = headers(&[("connection", "upgrade"), ("upgrade", "h2c, websocket")]);
        assert!(wants_upgrade(&both));
        assert_eq!(request_headers(&both, true)["upgrade"], "websocket", "only the WebSocket offer is passed on");
    }

    #[test]
    fn the_token_comes_from_the_header_first_then_the_cookie() {
        assert_eq!(
            request_token(&headers(&[("x-hutch-sandbox-token", "h"), ("cookie", "hutch_sandbox_token=c")])).as_deref(),
            Some("h")
        );
        assert_eq!(request_token(&headers(&[("cookie", "a=1; hutch_sandbox_token=c")])).as_deref(), Some("c"));
        assert_eq!(request_token(&headers(&[("cookie", "a=1")])), None);
    }
}
