//! The E2B-compatible API: E2B's control REST API and the in-sandbox envd
//! API (HTTP routes and Connect RPCs), served on hutch's port and mapped onto
//! the same `Control` as the native API. No second implementation of
//! sandboxes lives here: only the translation of E2B's wire formats.
//!
//! Routing: control calls carry `X-API-KEY` (a hutch key); envd calls carry
//! `E2b-Sandbox-Id` and the per-sandbox `X-Access-Token`. Their paths do not
//! overlap the native `/v1/...` ones, so both merge into one router; the
//! envd routes require the sandbox headers.
//!
//! Credentials (access tokens, signed URLs) are checked by the control
//! plane (`hutch_control::e2b`), which also checks that the sandbox's owner
//! key is live on every call.

pub(crate) mod connect;
mod control;
pub(crate) mod envd;
pub(crate) mod forward;
pub(crate) mod ports;
mod secrets;
mod templates;
mod volumes;
mod watch;
mod webhooks;

use crate::App;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hutch_api::ErrorCode;
use hutch_control::ControlError;
use std::sync::Arc;

/// The envd version announced, the newest the SDK (`e2b` 2.x) checks for:
/// octet-stream uploads, default users, file metadata (0.6.2), entries in
/// watch events (`include_entry`, 0.6.3) and watches of network mounts
/// (`allow_network_mounts`, 0.6.4), all implemented.
pub const ENVD_VERSION: &str = "0.6.4";

/// envd's port inside an E2B sandbox: calls naming it are answered by the
/// daemon; calls naming another port are forwarded (`forward.rs`).
pub const ENVD_PORT: u16 = 49983;

pub(crate) use forward::by_sandbox_port;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    control::router(app.clone())
        .merge(templates::unkeyed())
        .merge(volumes::router(app.clone()))
        .merge(secrets::router(app.clone()))
        .merge(webhooks::router(app.clone()))
        .merge(envd::router(app))
}

/// The paths of E2B's control API (each also with `/...` below it).
const REST_PREFIXES: &[&str] = &[
    "/sandboxes",
    "/v2/sandboxes",
    "/v3/sandboxes",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/snapshots",
    "/volumes",
    "/secrets",
    "/events/webhooks",
    "/teams",
    "/api-keys",
    "/access-tokens",
    "/nodes",
    "/admin",
    // envd's HTTP routes.
    "/health",
    "/files",
    "/envs",
    "/init",
];

/// How an E2B path answers what it cannot route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `{"code": status, "message"}`.
    Rest,
    /// A Connect error (`{"code": "unimplemented", "message"}`).
    Connect,
}

/// Whether a path is E2B's (so that what hutch does not route there is
/// refused in E2B's words, which the SDK reads), and how. Pure.
pub fn owns_path(path: &str) -> Option<Flavor> {
    if path.starts_with("/process.") || path.starts_with("/filesystem.") {
        return Some(Flavor::Connect);
    }
    let under = |p: &&str| path == *p || path.strip_prefix(*p).is_some_and(|rest| rest.starts_with('/'));
    REST_PREFIXES.iter().any(under).then_some(Flavor::Rest)
}

/// The answer to an E2B path that matched no route (or not with this
/// method), in E2B's words; None for paths that are not E2B's.
pub fn unrouted(path: &str, wrong_method: bool) -> Option<Response> {
    let flavor = owns_path(path)?;
    let shown: String = path.chars().take(128).collect();
    Some(match (flavor, wrong_method) {
        (Flavor::Rest, false) => {
            E2bError::new(StatusCode::NOT_FOUND, format!("{shown} is not served here")).into_response()
        }
        (Flavor::Rest, true) => {
            E2bError::new(StatusCode::METHOD_NOT_ALLOWED, format!("{shown} does not take this method")).into_response()
        }
        (Flavor::Connect, _) => connect::unary_error(EnvdError {
            code: ErrorCode::MethodNotAllowed,
            message: format!("{shown} is not implemented"),
            deadline: false,
        }),
    })
}

/// Path parameters of an E2B route; a malformed one is E2B's 404.
pub struct E2bPath<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for E2bPath<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, E2bError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(E2bPath(v)),
            Err(e) => Err(E2bError::new(StatusCode::NOT_FOUND, format!("nothing is at this path: {}", e.body_text()))),
        }
    }
}

/// The query string of an E2B route; a malformed one is E2B's 400.
pub struct E2bQuery<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for E2bQuery<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, E2bError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(E2bQuery(v)),
            Err(e) => Err(E2bError::new(StatusCode::BAD_REQUEST, e.body_text())),
        }
    }
}

/// A header as text, if present and ASCII.
pub(crate) fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// An error as E2B's control API answers it: `{"code": status, "message"}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// hutch's code for it, when it has one (the audit log records it).
    pub code: Option<ErrorCode>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError { status, message: message.into(), code: None }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some(code) = self.code {
            resp.extensions_mut().insert(code);
        }
        resp
    }
}

/// A Connect error code's name and HTTP status, for each of hutch's codes:
/// the one place that maps them, exhaustive, no wildcard.
pub(crate) fn connect_code(code: ErrorCode) -> (&'static str, StatusCode) {
    match code {
        ErrorCode::Unauthorized => ("unauthenticated", StatusCode::UNAUTHORIZED),
        ErrorCode::InvalidRequest | ErrorCode::InvalidPath | ErrorCode::SandboxPathNotDirectory => {
            ("invalid_argument", StatusCode::BAD_REQUEST)
        }
        ErrorCode::UnknownTemplate
        | ErrorCode::ImageNotFound
        | ErrorCode::SandboxArchiveInvalid
        | ErrorCode::SandboxFilePartOutOfOrder
        | ErrorCode::SandboxFilePartMismatch
        | ErrorCode::BuildInstructionRefused
        | ErrorCode::VolumePathInvalid
        | ErrorCode::VolumeShrinkRefused
        | ErrorCode::ImageInvalid
        | ErrorCode::ImageLayerRefused
        | ErrorCode::WebhookUrlRefused
        | ErrorCode::UsageRangeInvalid => ("invalid_argument", StatusCode::BAD_REQUEST),
        ErrorCode::NotFound | ErrorCode::VolumeNotFound | ErrorCode::SecretNotFound | ErrorCode::NodeNotFound => {
            ("not_found", StatusCode::NOT_FOUND)
        }
        ErrorCode::IdempotencyConflict
        | ErrorCode::SandboxPathConflict
        | ErrorCode::TemplateNameTaken
        | ErrorCode::VolumeNameTaken
        | ErrorCode::SecretNameTaken => ("already_exists", StatusCode::CONFLICT),
        ErrorCode::SandboxPathUnreadable => ("permission_denied", StatusCode::FORBIDDEN),
        ErrorCode::FeatureUnavailable | ErrorCode::SandboxNetworkIsolated | ErrorCode::SandboxOnOtherNode => {
            ("failed_precondition", StatusCode::BAD_REQUEST)
        }
        ErrorCode::ExecutionOutcomeUnknown | ErrorCode::Internal => ("internal", StatusCode::INTERNAL_SERVER_ERROR),
        ErrorCode::SandboxSessionNotRunning
        | ErrorCode::SandboxStartFailed
        | ErrorCode::SandboxStartupFailed
        | ErrorCode::SandboxReadinessTimeout
        | ErrorCode::SandboxCapacityUnavailable
        | ErrorCode::NodeDraining
        | ErrorCode::Unavailable => ("unavailable", StatusCode::SERVICE_UNAVAILABLE),
        ErrorCode::SandboxCommandCapacity
        | ErrorCode::SandboxDiskFull
        | ErrorCode::PayloadTooLarge
        | ErrorCode::SandboxArchiveTooLarge => ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS),
        ErrorCode::AccessTokenRequired
        | ErrorCode::AccessTokenInvalid
        | ErrorCode::AccessTokenExpired
        | ErrorCode::GrantExpired => ("unauthenticated", StatusCode::UNAUTHORIZED),
        ErrorCode::AccessTokenWrongTarget => ("permission_denied", StatusCode::FORBIDDEN),
        ErrorCode::AccessGrantCapacity => ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS),
        ErrorCode::SandboxPortUnreachable
        | ErrorCode::RegistryError
        | ErrorCode::ImageBuildFailed
        | ErrorCode::NodeUnreachable => ("unavailable", StatusCode::BAD_GATEWAY),
        ErrorCode::Forbidden | ErrorCode::GrantScope => ("permission_denied", StatusCode::FORBIDDEN),
        ErrorCode::QuotaExceeded | ErrorCode::WebhookLimitReached => {
            ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS)
        }
        ErrorCode::MethodNotAllowed => ("unimplemented", StatusCode::METHOD_NOT_ALLOWED),
        ErrorCode::Conflict => ("aborted", StatusCode::CONFLICT),
        ErrorCode::SnapshotNameTaken
        | ErrorCode::SnapshotUnsupported
        | ErrorCode::ClassUnsupported
        | ErrorCode::SnapshotNotExportable
        | ErrorCode::NotMovable
        | ErrorCode::VolumeInUse => ("failed_precondition", StatusCode::CONFLICT),
        ErrorCode::StorageFull => ("resource_exhausted", StatusCode::INSUFFICIENT_STORAGE),
    }
}

/// An error of the envd API, rendered per protocol by the caller.
#[derive(Debug)]
pub struct EnvdError {
    pub code: ErrorCode,
    pub message: String,
    /// The call's own deadline passed (Connect's `deadline_exceeded`, which
    /// no hutch code names).
    pub deadline: bool,
}

impl EnvdError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> EnvdError {
        EnvdError { code, message: hutch_control::error::public_message(code, &message.into()), deadline: false }
    }

    /// The command ran past `Connect-Timeout-Ms` and was killed.
    pub fn deadline() -> EnvdError {
        EnvdError {
            code: ErrorCode::Unavailable,
            message: "the command ran past its timeout and was killed".into(),
            deadline: true,
        }
    }

    /// A stream (`what`) ran past `Connect-Timeout-Ms` and was ended.
    pub fn deadline_of(what: &str) -> EnvdError {
        EnvdError { code: ErrorCode::Unavailable, message: format!("{what} ran past its timeout"), deadline: true }
    }

    /// The Connect code name and HTTP status.
    pub fn connect(&self) -> (&'static str, StatusCode) {
        if self.deadline {
            return ("deadline_exceeded", StatusCode::GATEWAY_TIMEOUT);
        }
        connect_code(self.code)
    }
}

impl From<ControlError> for EnvdError {
    fn from(e: ControlError) -> EnvdError {
        match e {
            // The sandbox ended under the call (killed, expired): as E2B's
            // proxy says it, which the SDK reads as "not running".
            ControlError::NoSandbox(id) => EnvdError {
                code: ErrorCode::Unavailable,
                message: format!("The sandbox {id} was not found"),
                deadline: false,
            },
            e => EnvdError { code: e.code(), message: e.public_message(), deadline: false },
        }
    }
}

impl From<hutch_control::files::FilesError> for EnvdError {
    fn from(e: hutch_control::files::FilesError) -> EnvdError {
        EnvdError::new(e.code, e.message)
    }
}

impl From<ControlError> for E2bError {
    fn from(e: ControlError) -> E2bError {
        let (_, status) = connect_code(e.code());
        E2bError { status, message: e.public_message(), code: Some(e.code()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_paths_are_known_by_their_prefixes() {
        assert_eq!(owns_path("/sandboxes"), Some(Flavor::Rest));
        assert_eq!(owns_path("/sandboxes/sb-1/nope"), Some(Flavor::Rest));
        assert_eq!(owns_path("/v2/sandboxes/x/logs"), Some(Flavor::Rest));
        assert_eq!(owns_path("/templates/aliases/x"), Some(Flavor::Rest));
        assert_eq!(owns_path("/process.Process/Nope"), Some(Flavor::Connect));
        assert_eq!(owns_path("/filesystem.Filesystem/Nope"), Some(Flavor::Connect));
        for native in ["/v1/sandboxes", "/sandboxesx", "/healthz", "/metrics", "/", "/v1/templates/x"] {
            assert_eq!(owns_path(native), None, "{native}");
        }
    }

    #[test]
    fn internal_errors_carry_no_internals() {
        let e = EnvdError::from(ControlError::Runtime("secret host path /var/lib/x".into()));
        assert_eq!(e.code, ErrorCode::Internal);
        assert!(!e.message.contains("/var/lib"), "{}", e.message);
        let e = E2bError::from(ControlError::Runtime("JoinError: panicked at src/x.rs".into()));
        assert!(!e.message.contains("panicked"), "{}", e.message);
    }
}
