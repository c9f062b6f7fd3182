//! hutch's HTTP layer: the native API, authentication, metrics and the
//! OpenAPI document, over the control plane.
//!
//! Architecture invariant: this is the only crate that knows HTTP, and it
//! reaches sandboxes only through the control plane: it depends on
//! hutch-control and hutch-api, never on the store, the runtime or the
//! agent. Handlers parse a request into typed values (hutch-api types and
//! hutch-control's ids), call the control plane, and render its typed
//! answer; every error is the JSON error body with a stable code, and the
//! internals of a 5xx are logged, never sent.

mod access;
mod audit;
mod console;
mod e2b;
pub mod egress;
mod events;
mod extract;
pub mod fleet;
#[doc(hidden)]
pub mod fuzz_api;
mod images;
pub mod listener;
mod mcp;
mod nodes;
mod openapi;
pub mod proxy;
mod pty;
mod routes;
mod secrets;
mod snapshots;
mod templates;
mod transfer;
mod volumes;
pub mod wake;

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use hutch_api::{ErrorBody, ErrorCode};
use hutch_control::{Control, ControlError};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

pub use routes::router;

/// Shared state of every handler.
pub struct App {
    pub control: Arc<Control>,
    /// Connections to the fleet's other nodes.
    pub forwarder: fleet::Forwarder,
    /// Idle CPUs kept polling while calls run (`--wake-hold`).
    pub wake: Option<Arc<wake::WakeHold>>,
}

impl App {
    pub fn new(control: Arc<Control>) -> App {
        App { control, forwarder: Default::default(), wake: None }
    }
}

/// An error as the API answers it.
#[derive(Debug)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    /// An error with its message; an internal one's message is logged and
    /// replaced (see `hutch_control::error::public_message`).
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        let message = message.into();
        ApiError { code, message: hutch_control::error::public_message(code, &message) }
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, message)
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> ApiError {
        ApiError { code: e.code(), message: e.public_message() }
    }
}

impl From<hutch_control::files::FilesError> for ApiError {
    fn from(e: hutch_control::files::FilesError) -> ApiError {
        ApiError::new(e.code, e.message)
    }
}

/// A task that panicked or was cancelled: internal, its text logged.
impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> ApiError {
        ApiError::new(ErrorCode::Internal, format!("task: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody { error: self.message, code: self.code };
        let mut resp = (status, axum::Json(body)).into_response();
        // The audit layer records the code.
        resp.extensions_mut().insert(self.code);
        if self.code == ErrorCode::Unauthorized {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// A JSON object body: malformed or unknown fields, another JSON value (an
/// array, a string) or another content type are a 400 with our error body,
/// and the size is bounded. An empty body is `{}`.
pub struct JsonBody<T>(pub T);

/// Largest JSON body (a base64 file of 8 MiB plus envelope).
pub const JSON_LIMIT: usize = 12 << 20;

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let bytes = json_object_bytes(req).await?;
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| ApiError::invalid(format!("body: {e}")))
    }
}

/// A JSON object body's bytes: bounded, sent as `application/json` (or
/// with no type), an object; an empty body is `{}`.
pub(crate) async fn json_object_bytes(req: Request) -> ApiResult<bytes::Bytes> {
    let json_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
    let bytes = axum::body::to_bytes(req.into_body(), JSON_LIMIT)
        .await
        .map_err(|_| ApiError::new(ErrorCode::PayloadTooLarge, format!("body above {JSON_LIMIT} bytes")))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(bytes::Bytes::from_static(b"{}"));
    }
    if !matches!(json_type.as_deref(), Some("application/json") | None) {
        return Err(ApiError::invalid("the body must be JSON: send Content-Type: application/json"));
    }
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    Ok(bytes)
}

/// The `Idempotency-Key` header, if any.
pub fn idempotency_key(headers: &HeaderMap) -> ApiResult<Option<String>> {
    match headers.get("idempotency-key") {
        None => Ok(None),
        Some(v) => {
            let s = v.to_str().map_err(|_| ApiError::invalid("Idempotency-Key must be ASCII"))?;
            if s.is_empty() || s.len() > 256 {
                return Err(ApiError::invalid("Idempotency-Key must be 1 to 256 characters"));
            }
            Ok(Some(s.to_owned()))
        }
    }
}

/// A stream of body chunks fed by a channel.
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<Result<bytes::Bytes, std::io::Error>>);

impl futures_core::Stream for ChannelBody {
    type Item = Result<bytes::Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

impl ChannelBody {
    pub fn into_body(self) -> Body {
        Body::from_stream(self)
    }
}

/// Serves the API on `listener` under `limits` until `shutdown` completes,
/// then lets in-flight requests finish (see [`listener`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    limits: listener::Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // MCP sessions hold streams open: they end as the daemon stops.
    let stop = tokio_util::sync::CancellationToken::new();
    let router = routes::router_until(app, stop.clone());
    let shutdown = async move {
        shutdown.await;
        stop.cancel();
    };
    listener::serve_router(listener, router, listener::Gate::new(limits), shutdown).await
}

#[cfg(test)]
mod tests {
    /// Architecture invariant: the HTTP layer reaches sandboxes only
    /// through the control plane; it does not depend on the store, the
    /// runtime or the agent.
    #[test]
    fn the_server_depends_on_the_control_plane_and_the_api_alone() {
        let manifest = include_str!("../Cargo.toml");
        for forbidden in ["hutch-store", "hutch-runtime", "hutch-agent"] {
            assert!(!manifest.contains(forbidden), "hutch-server's Cargo.toml names {forbidden}");
        }
        for needed in ["hutch-control", "hutch-api"] {
            assert!(manifest.contains(needed), "hutch-server's Cargo.toml lacks {needed}");
        }
    }
}
