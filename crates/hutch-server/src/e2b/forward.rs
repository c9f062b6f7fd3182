//! Calls to the other ports of a sandbox through E2B's sandbox headers.
//! With `E2B_SANDBOX_URL` the SDK sends every call to a sandbox's port to
//! that one URL, naming the sandbox and the port in `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port`. envd's port (49983) is answered by the daemon
//! itself (`envd.rs`); a call naming another port is forwarded here, over
//! HTTP/1.1, to that port inside the sandbox, on a connection from
//! `Control::connect_port` (the sandbox's network namespace, 127.0.0.1).
//! The code interpreter SDK reaches its server on 49999 this way.
//!
//! Credentials go through the control plane's envd checks: a call with
//! `X-Access-Token` is an envd call (`Control::envd_by_token`); a call
//! without one is let through only to the code interpreter's context
//! routes on its port of a sandbox of that template
//! (`Control::envd_interpreter_open`), because the SDK sends those with
//! no credential (E2B's sandbox ports take none unless
//! `allow_public_traffic=False`). Executing code always takes the token.
//! The credential never reaches the sandbox.

use super::{E2bError, ENVD_PORT};
use crate::App;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode, Uri, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hutch_control::{ControlError, SandboxId};
use hyper_util::rt::TokioIo;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Bounds on what the sandbox answers: header count and bytes.
const MAX_HEADERS: usize = 100;
const MAX_HEADER_BYTES: usize = 64 << 10;

/// The port a request's `E2b-Sandbox-Port` names, when it is not envd's:
/// `Ok(None)` for no header or envd's port, an error for a value that is
/// no port. A pure function of the header's bytes.
pub fn sandbox_port(value: Option<&[u8]>) -> Result<Option<u16>, &'static str> {
    let Some(v) = value else { return Ok(None) };
    let text = std::str::from_utf8(v).map_err(|_| "E2b-Sandbox-Port must be a port number")?.trim();
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err("E2b-Sandbox-Port must be a port number");
    }
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err("E2b-Sandbox-Port must be 1 to 65535"),
        Ok(ENVD_PORT) => Ok(None),
        Ok(p) => Ok(Some(p)),
    }
}

/// Whether a call is one of the code interpreter's context routes, which
/// its SDK sends without a credential: `GET|POST /contexts`,
/// `POST /contexts/{id}/restart`, `DELETE /contexts/{id}`, `GET /health`.
pub fn interpreter_open_route(method: &Method, path: &str) -> bool {
    let segment = |s: &str| !s.is_empty() && s.len() <= 128 && !s.contains('/');
    match (method, path) {
        (&Method::GET, "/health") | (&Method::GET, "/contexts") | (&Method::POST, "/contexts") => true,
        (&Method::POST, p) => {
            p.strip_prefix("/contexts/").and_then(|r| r.strip_suffix("/restart")).is_some_and(segment)
        }
        (&Method::DELETE, p) => p.strip_prefix("/contexts/").is_some_and(segment),
        _ => false,
    }
}

/// Headers that are hutch's or E2B's word to the daemon, never the
/// sandbox's business: the credentials and the routing headers.
const CONSUMED: &[&str] = &["x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port"];

/// The headers sent into the sandbox: what the port proxy sends (no
/// hop-by-hop headers, no `Expect`, nothing that could pass for hutch's or a
/// proxy's word, no hutch credential cookie), without E2B's credentials and
/// routing headers (also spelled with `_` or `.`); Host names the port.
pub fn request_headers(headers: &HeaderMap, port: u16) -> HeaderMap {
    let mut out = crate::proxy::request_headers(headers, false);
    let consumed: Vec<_> =
        out.keys().filter(|n| CONSUMED.contains(&n.as_str().replace(['_', '.'], "-").as_str())).cloned().collect();
    for name in consumed {
        out.remove(name);
    }
    out.remove(header::HOST);
    if let Ok(host) = HeaderValue::from_str(&format!("localhost:{port}")) {
        out.insert(header::HOST, host);
    }
    out
}

/// The headers sent back: the sandbox's, as the port proxy passes them to
/// E2B's host names (hop-by-hop headers, `Clear-Site-Data` and the reserved
/// cookie dropped; no hutch policy headers added).
pub fn response_headers(headers: &HeaderMap) -> HeaderMap {
    crate::proxy::response_headers_for(headers, false, false)
}

/// Middleware in front of every route: a call that names a sandbox port
/// other than envd's is forwarded; the rest go on.
pub(crate) async fn by_sandbox_port(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    match sandbox_port(req.headers().get("e2b-sandbox-port").map(HeaderValue::as_bytes)) {
        Ok(None) => next.run(req).await,
        Ok(Some(port)) => forward(app, port, req).await,
        Err(why) => E2bError::new(StatusCode::BAD_REQUEST, why).into_response(),
    }
}

/// E2B's answer for a port nothing listens on.
fn port_closed(id: &SandboxId, port: u16) -> Response {
    let body = serde_json::json!({
        "code": 502,
        "message": "The sandbox is running but port is not open",
        "sandboxId": id.as_str(),
        "port": port,
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

async fn forward(app: Arc<App>, port: u16, req: Request) -> Response {
    let Some(id) = super::envd::named_sandbox(req.headers()) else {
        return E2bError::new(StatusCode::BAD_REQUEST, "the E2b-Sandbox-Id header is required").into_response();
    };
    let token = super::header(req.headers(), "x-access-token").map(str::to_owned);
    let session = match token {
        Some(t) => app.control.envd_by_token(&id, &t, "user").await,
        None if interpreter_open_route(req.method(), req.uri().path()) => {
            let traffic = super::header(req.headers(), super::ports::TRAFFIC_TOKEN_HEADER);
            app.control.envd_interpreter_open(&id, port, traffic).await
        }
        None => Err(ControlError::Unauthorized("a valid X-Access-Token is required")),
    };
    if let Err(e) = session {
        return super::envd::refused(e, Some(&id));
    }
    let stream = match app.control.connect_port(id.as_str(), port).await {
        Ok(s) => s,
        Err(ControlError::PortUnreachable(_)) => return port_closed(&id, port),
        Err(ControlError::NotRunning { .. }) => {
            return super::envd::refused(ControlError::NoSandbox(id.to_string()), Some(&id))
        }
        Err(e) => return super::envd::refused(e, Some(&id)),
    };
    let handshake = hyper::client::conn::http1::Builder::new()
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEADER_BYTES.max(8192) * 2)
        .handshake::<_, Body>(TokioIo::new(stream))
        .await;
    let (mut sender, connection) = match handshake {
        Ok(pair) => pair,
        Err(_) => return port_closed(&id, port),
    };
    // The connection lives as long as the answer's body: dropping the body
    // (the client went away) aborts it, which closes the connection into
    // the sandbox, and the server there sees its client leave.
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    })
    .abort_handle();
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut out = axum::http::Request::new(body);
    *out.method_mut() = parts.method.clone();
    *out.version_mut() = Version::HTTP_11;
    *out.uri_mut() = match Uri::try_from(path) {
        Ok(u) => u,
        Err(_) => {
            driver.abort();
            return E2bError::new(StatusCode::BAD_REQUEST, "malformed path").into_response();
        }
    };
    *out.headers_mut() = request_headers(&parts.headers, port);
    let resp = match sender.send_request(out).await {
        Ok(r) => r,
        Err(e) => {
            driver.abort();
            tracing::debug!("port {port} of sandbox {id} failed the request: {e}");
            return port_closed(&id, port);
        }
    };
    let (parts, body) = resp.into_parts();
    let mut answer = Response::new(Body::new(Upstream { body, driver }));
    *answer.status_mut() = parts.status;
    *answer.headers_mut() = response_headers(&parts.headers);
    answer
}

/// An answer's body from the sandbox, with the task of its connection.
struct Upstream {
    body: hyper::body::Incoming,
    driver: tokio::task::AbortHandle,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl hyper::body::Body for Upstream {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_header_names_a_port_other_than_envds() {
        assert_eq!(sandbox_port(None), Ok(None));
        assert_eq!(sandbox_port(Some(b"49983")), Ok(None));
        assert_eq!(sandbox_port(Some(b"49999")), Ok(Some(49999)));
        assert_eq!(sandbox_port(Some(b" 8080 ")), Ok(Some(8080)));
        for bad in [&b""[..], b"0", b"65536", b"-1", b"80a", b"+80", b"999999", b"\xff"] {
            assert!(sandbox_port(Some(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_the_context_routes_are_open() {
        let open = |m: Method, p: &str| interpreter_open_route(&m, p);
        assert!(open(Method::GET, "/contexts") && open(Method::POST, "/contexts") && open(Method::GET, "/health"));
        assert!(open(Method::POST, "/contexts/abc/restart") && open(Method::DELETE, "/contexts/abc"));
        assert!(!open(Method::POST, "/execute") && !open(Method::GET, "/execute"));
        assert!(!open(Method::DELETE, "/contexts") && !open(Method::DELETE, "/contexts/a/b"));
        assert!(!open(Method::POST, "/contexts//restart") && !open(Method::POST, "/contexts/a/b/restart"));
        assert!(!open(Method::PUT, "/contexts") && !open(Method::GET, "/files"));
    }

    #[test]
    fn credentials_and_routing_headers_never_reach_the_sandbox() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("x-access-token", "secret"),
            ("e2b-traffic-access-token", "t"),
            ("e2b-sandbox-id", "sb-0123456789abcdef"),
            ("e2b-sandbox-port", "49999"),
            ("x_access_token", "secret"),
            ("cookie", "a=1; hutch_sandbox_token=grant"),
            ("x-hutch-user", "root"),
            ("x_forwarded_for", "1.2.3.4"),
            ("connection", "keep-alive, x-drop"),
            ("x-drop", "1"),
            ("host", "127.0.0.1:7700"),
            ("content-type", "application/json"),
            ("authorization", "Basic dXNlcjo="),
        ] {
            h.append(axum::http::HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = request_headers(&h, 49999);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(out.get("host").and_then(|v| v.to_str().ok()), Some("localhost:49999"));
        assert!(names.contains(&"content-type") && names.contains(&"authorization"));
        for gone in ["x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port"] {
            assert!(!names.contains(&gone), "{gone} was forwarded");
        }
        assert_eq!(out.get("cookie").and_then(|v| v.to_str().ok()), Some("a=1"));
        for gone in ["x_access_token", "x-hutch-user", "x_forwarded_for", "connection", "x-drop"] {
            assert!(!names.contains(&gone), "{gone} was forwarded");
        }
        let mut r = HeaderMap::new();
        r.append(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        r.append(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
        let back = response_headers(&r);
        assert!(back.get(header::TRANSFER_ENCODING).is_none() && back.get(header::CONTENT_TYPE).is_some());
    }
}
