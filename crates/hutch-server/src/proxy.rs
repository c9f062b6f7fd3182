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
//! Every downstream connection is wrapped ([`ProxyIo`]) so that the proxy can
//! end it: when a grant that a connection used is revoked or expires, the
//! connection is closed (idle keep-alive, streaming response or WebSocket
//! alike), together with its connection to the sandbox.

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
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

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
// Downstream connections the proxy can end

/// A listener whose connections the proxy can close.
pub struct ProxyListener(pub tokio::net::TcpListener);

impl axum::serve::Listener for ProxyListener {
    type Io = ProxyIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (ProxyIo, SocketAddr) {
        loop {
            match self.0.accept().await {
                Ok((tcp, addr)) => {
                    // Event streams and Connect messages are small writes:
                    // without TCP_NODELAY, Nagle's algorithm and the peer's
                    // delayed ACK hold some of them for 40 ms.
                    let _ = tcp.set_nodelay(true);
                    return (ProxyIo::new(tcp), addr);
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset) => {}
                Err(e) => {
                    // Out of descriptors or memory: wait rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// A downstream TCP connection that ends (reads see EOF, writes fail) once
/// its [`Conn`] is killed.
pub struct ProxyIo {
    inner: tokio::net::TcpStream,
    conn: Conn,
}

impl ProxyIo {
    fn new(inner: tokio::net::TcpStream) -> ProxyIo {
        ProxyIo { inner, conn: Conn::new() }
    }
}

impl Drop for ProxyIo {
    fn drop(&mut self) {
        self.conn.0.closed.send_replace(true);
    }
}

const READ: usize = 0;
const WRITE: usize = 1;

fn killed_error() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "closed by the port proxy: its access grant ended")
}

impl AsyncRead for ProxyIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.is_killed() {
            return Poll::Ready(Ok(()));
        }
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => {
                this.conn.park(READ, cx.waker());
                // A kill between the check and the park took no waker of ours.
                if this.conn.is_killed() {
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }
}

impl AsyncWrite for ProxyIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.is_killed() {
            return Poll::Ready(Err(killed_error()));
        }
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Pending => {
                this.conn.park(WRITE, cx.waker());
                if this.conn.is_killed() {
                    return Poll::Ready(Err(killed_error()));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.is_killed() {
            return Poll::Ready(Err(killed_error()));
        }
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Pending => {
                this.conn.park(WRITE, cx.waker());
                if this.conn.is_killed() {
                    return Poll::Ready(Err(killed_error()));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// One downstream connection as the handlers see it (through
/// `ConnectInfo<Conn>`): a kill switch, the connection to the sandbox it
/// reuses, and the grants it used.
#[derive(Clone)]
pub struct Conn(Arc<ConnShared>);

struct ConnShared {
    killed: watch::Sender<bool>,
    /// Set when the downstream connection is gone.
    closed: watch::Sender<bool>,
    wakers: Mutex<[Option<Waker>; 2]>,
    /// The idle connection to a sandbox port, kept for the next request.
    upstream: Mutex<Option<Upstream>>,
    /// Grants whose end this connection waits for.
    watched: Mutex<Vec<String>>,
}

/// A client connection to a port in a sandbox.
struct Upstream {
    sandbox: String,
    port: u16,
    sender: SendRequest<Body>,
    /// The task driving the connection; aborting it closes the connection.
    driver: tokio::task::AbortHandle,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, ProxyListener>> for Conn {
    fn connect_info(stream: axum::serve::IncomingStream<'_, ProxyListener>) -> Conn {
        stream.io().conn.clone()
    }
}

impl Conn {
    fn new() -> Conn {
        Conn(Arc::new(ConnShared {
            killed: watch::channel(false).0,
            closed: watch::channel(false).0,
            wakers: Mutex::new([None, None]),
            upstream: Mutex::new(None),
            watched: Mutex::new(Vec::new()),
        }))
    }

    fn is_killed(&self) -> bool {
        *self.0.killed.borrow()
    }

    fn park(&self, slot: usize, waker: &Waker) {
        let mut wakers = self.0.wakers.lock().unwrap_or_else(|p| p.into_inner());
        match &wakers[slot] {
            Some(w) if w.will_wake(waker) => {}
            _ => wakers[slot] = Some(waker.clone()),
        }
    }

    /// Ends the connection and its connection to the sandbox.
    fn kill(&self) {
        self.0.killed.send_replace(true);
        let wakers = std::mem::take(&mut *self.0.wakers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in wakers.into_iter().flatten() {
            w.wake();
        }
        if let Some(up) = self.0.upstream.lock().unwrap_or_else(|p| p.into_inner()).take() {
            up.driver.abort();
        }
    }

    /// Completes once the connection is killed.
    async fn killed(&self) {
        let _ = self.0.killed.subscribe().wait_for(|k| *k).await;
    }

    /// Kills this connection when the grant of `pass` ends (once per grant).
    fn watch(&self, pass: &AccessPass) {
        {
            let mut watched = self.0.watched.lock().unwrap_or_else(|p| p.into_inner());
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
        let mut up = self.0.upstream.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        if up.sandbox == sandbox && up.port == port && up.sender.ready().await.is_ok() {
            return Some(up);
        }
        up.driver.abort();
        None
    }

    /// Keeps a connection to a sandbox for the next request, unless this
    /// connection was killed meanwhile.
    fn keep_upstream(&self, up: Upstream) {
        let mut slot = self.0.upstream.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_killed() {
            up.driver.abort();
            return;
        }
        if let Some(old) = slot.replace(up) {
            old.driver.abort();
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
    let parsed = (|| {
        let rest = uri.path().strip_prefix("/v1/sandboxes/")?;
        let (id, rest) = rest.split_once('/')?;
        let rest = rest.strip_prefix("ports/")?;
        let (port, rest) = match rest.split_once('/') {
            Some((port, rest)) => (port, Some(rest)),
            None => (rest, None),
        };
        Some((id.to_owned(), port.to_owned(), rest.map(str::to_owned)))
    })();
    let Some((id, port, rest)) = parsed else {
        return ApiError::new(ErrorCode::NotFound, "no such route").into_response();
    };
    let (sandbox, port) = match target_of(&id, &port) {
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

fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// `<id>--<port>` of a proxy host name, lowercased; None for other hosts.
fn proxy_label(host: &str) -> Option<String> {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let label = host.strip_suffix(HOST_SUFFIX)?;
    Some(label.to_owned())
}

fn parse_label(label: &str) -> Result<(String, u16), ApiError> {
    let (id, port) = label
        .rsplit_once("--")
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("{label}{HOST_SUFFIX} names no sandbox port")))?;
    target_of(id, port)
}

fn target_of(id: &str, port: &str) -> Result<(String, u16), ApiError> {
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
        None => Conn::new(),
    };
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
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let headers = response_headers_for(resp.headers(), true, passing.policy);
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
    let body = axum::body::to_bytes(req.into_body(), FORM_LIMIT)
        .await
        .map_err(|_| ApiError::new(ErrorCode::PayloadTooLarge, format!("form above {FORM_LIMIT} bytes")))?;
    let token = form_urlencoded::parse(&body).find(|(k, _)| k == "token").map(|(_, v)| v.into_owned());
    let pass = app
        .control
        .authorize_access(&target.sandbox, target.port, token.as_deref())
        .await
        .map_err(|e| proxy_error(e, &target.sandbox))?;
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
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| name.trim() == COOKIE)
        .map(|(_, value)| value.trim().trim_matches('"').to_owned())
}

fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && connection_tokens(headers).iter().any(|t| t == "upgrade")
}

/// The names a `Connection` header lists, lowercased.
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
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
fn request_headers(headers: &HeaderMap, upgrade: bool) -> HeaderMap {
    let listed = connection_tokens(headers);
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        if is_spoofable(n) || n == "expect" {
            continue;
        }
        if (HOP_BY_HOP.contains(&n) || listed.iter().any(|l| l == n)) && !(upgrade && n == "upgrade") {
            continue;
        }
        if name == header::COOKIE {
            if let Some(v) = without_reserved_cookie(value) {
                out.append(header::COOKIE, v);
            }
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if upgrade {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    out
}

/// A Cookie header without the reserved cookie; None when nothing is left.
fn without_reserved_cookie(value: &HeaderValue) -> Option<HeaderValue> {
    let Ok(text) = value.to_str() else { return Some(value.clone()) };
    let kept: Vec<&str> = text
        .split(';')
        .map(str::trim)
        .filter(|p| !p.is_empty() && p.split('=').next().map(str::trim) != Some(COOKIE))
        .collect();
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_str(&kept.join("; ")).ok()
}

/// The headers sent to the client: the application's, minus hop-by-hop
/// headers, `Clear-Site-Data` and any cookie of the reserved name; plus our
/// CSP beside the application's and `Cache-Control: private, no-store`.
#[cfg(test)]
fn response_headers(headers: &HeaderMap, upgrade: bool) -> HeaderMap {
    response_headers_for(headers, upgrade, true)
}

/// [`response_headers`], with hutch's policy (CSP, no caching) only when
/// `policy`.
fn response_headers_for(headers: &HeaderMap, upgrade: bool, policy: bool) -> HeaderMap {
    let listed = connection_tokens(headers);
    let mut out = HeaderMap::with_capacity(headers.len() + 2);
    for (name, value) in headers {
        let n = name.as_str();
        if (HOP_BY_HOP.contains(&n) || listed.iter().any(|l| l == n)) && !(upgrade && n == "upgrade") {
            continue;
        }
        if n == "clear-site-data" || (policy && name == header::CACHE_CONTROL) {
            continue;
        }
        if name == header::SET_COOKIE && sets_reserved_cookie(value) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if upgrade {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    if policy {
        out.append(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
        out.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, no-store"));
    }
    out
}

fn sets_reserved_cookie(value: &HeaderValue) -> bool {
    let text = String::from_utf8_lossy(value.as_bytes());
    let name = text.split(';').next().and_then(|p| p.split('=').next()).unwrap_or("").trim();
    // Browsers compare cookie names exactly; a case variant is refused too,
    // and so is a quoted or prefixed spelling.
    let name = name.trim_matches('"').to_ascii_lowercase();
    name == COOKIE || name.trim_start_matches("__host-").trim_start_matches("__secure-") == COOKIE
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
    fn the_token_comes_from_the_header_first_then_the_cookie() {
        assert_eq!(
            request_token(&headers(&[("x-hutch-sandbox-token", "h"), ("cookie", "hutch_sandbox_token=c")])).as_deref(),
            Some("h")
        );
        assert_eq!(request_token(&headers(&[("cookie", "a=1; hutch_sandbox_token=c")])).as_deref(), Some("c"));
        assert_eq!(request_token(&headers(&[("cookie", "a=1")])), None);
    }
}
