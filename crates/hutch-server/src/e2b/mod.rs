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

mod connect;
mod control;
mod envd;
mod watch;

use crate::App;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hutch_api::ErrorCode;
use hutch_control::ControlError;
use std::sync::Arc;

/// The envd version announced: new enough that the SDK uses octet-stream
/// uploads, default users and file metadata.
pub const ENVD_VERSION: &str = "0.6.2";

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    control::router(app.clone()).merge(envd::router(app))
}

/// A header as text, if present and ASCII.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// An error as E2B's control API answers it: `{"code": status, "message"}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError { status, message: message.into() }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, axum::Json(body)).into_response()
    }
}

/// A Connect error code's name and HTTP status, for each of hutch's codes:
/// the one place that maps them, exhaustive, no wildcard.
fn connect_code(code: ErrorCode) -> (&'static str, StatusCode) {
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
        | ErrorCode::BuildInstructionRefused => ("invalid_argument", StatusCode::BAD_REQUEST),
        ErrorCode::NotFound => ("not_found", StatusCode::NOT_FOUND),
        ErrorCode::IdempotencyConflict | ErrorCode::SandboxPathConflict | ErrorCode::TemplateNameTaken => {
            ("already_exists", StatusCode::CONFLICT)
        }
        ErrorCode::SandboxPathUnreadable => ("permission_denied", StatusCode::FORBIDDEN),
        ErrorCode::FeatureUnavailable | ErrorCode::SandboxNetworkIsolated => {
            ("failed_precondition", StatusCode::BAD_REQUEST)
        }
        ErrorCode::ExecutionOutcomeUnknown | ErrorCode::Internal => ("internal", StatusCode::INTERNAL_SERVER_ERROR),
        ErrorCode::SandboxSessionNotRunning
        | ErrorCode::SandboxStartFailed
        | ErrorCode::SandboxStartupFailed
        | ErrorCode::SandboxReadinessTimeout
        | ErrorCode::SandboxCapacityUnavailable
        | ErrorCode::Unavailable => ("unavailable", StatusCode::SERVICE_UNAVAILABLE),
        ErrorCode::SandboxCommandCapacity
        | ErrorCode::SandboxDiskFull
        | ErrorCode::PayloadTooLarge
        | ErrorCode::SandboxArchiveTooLarge => ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS),
        ErrorCode::AccessTokenRequired | ErrorCode::AccessTokenInvalid | ErrorCode::AccessTokenExpired => {
            ("unauthenticated", StatusCode::UNAUTHORIZED)
        }
        ErrorCode::AccessTokenWrongTarget => ("permission_denied", StatusCode::FORBIDDEN),
        ErrorCode::AccessGrantCapacity => ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS),
        ErrorCode::SandboxPortUnreachable => ("unavailable", StatusCode::BAD_GATEWAY),
        ErrorCode::Forbidden => ("permission_denied", StatusCode::FORBIDDEN),
        ErrorCode::QuotaExceeded => ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS),
        ErrorCode::MethodNotAllowed => ("unimplemented", StatusCode::METHOD_NOT_ALLOWED),
        ErrorCode::Conflict => ("aborted", StatusCode::CONFLICT),
        ErrorCode::SnapshotNameTaken | ErrorCode::SnapshotUnsupported => ("failed_precondition", StatusCode::CONFLICT),
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
        EnvdError { code: e.code(), message: e.public_message(), deadline: false }
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
        E2bError { status, message: e.public_message() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_errors_carry_no_internals() {
        let e = EnvdError::from(ControlError::Runtime("secret host path /var/lib/x".into()));
        assert_eq!(e.code, ErrorCode::Internal);
        assert!(!e.message.contains("/var/lib"), "{}", e.message);
        let e = E2bError::from(ControlError::Runtime("JoinError: panicked at src/x.rs".into()));
        assert!(!e.message.contains("panicked"), "{}", e.message);
    }
}
