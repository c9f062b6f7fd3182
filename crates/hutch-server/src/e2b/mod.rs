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
//! Access tokens are stateless: HMAC-SHA256 of the sandbox id under a
//! daemon secret kept in the state directory (`e2b.secret`), so they survive
//! restarts like the sandboxes do, need no schema change, and are revoked for
//! every sandbox at once by deleting the secret.

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
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// The envd version announced: new enough that the SDK uses octet-stream
/// uploads, default users and file metadata.
pub const ENVD_VERSION: &str = "0.6.2";

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    control::router(app.clone()).merge(envd::router(app))
}

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
    for i in 0..64 {
        ipad[i] ^= k[i];
        opad[i] ^= k[i];
    }
    let inner = Sha256::new().chain_update(ipad).chain_update(msg).finalize();
    Sha256::new().chain_update(opad).chain_update(inner).finalize().into()
}

/// The envd access token of a sandbox.
pub fn access_token(secret: &[u8], sandbox: &str) -> String {
    hex::encode(hmac_sha256(secret, sandbox.as_bytes()))
}

/// Compares without an early exit.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
    }
}

/// A public message for a code: internals of a 5xx are logged, never sent.
fn public(code: ErrorCode, message: String) -> String {
    if code == ErrorCode::Internal {
        tracing::error!("{message}");
        return "internal error; see the server log".into();
    }
    message
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
        EnvdError { code, message: message.into(), deadline: false }
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
        let code = e.code();
        let message = if code == ErrorCode::Internal { e.to_string() } else { e.public_message() };
        EnvdError { code, message: public(code, message), deadline: false }
    }
}

impl From<hutch_control::files::FilesError> for EnvdError {
    fn from(e: hutch_control::files::FilesError) -> EnvdError {
        EnvdError { code: e.code, message: public(e.code, e.message), deadline: false }
    }
}

impl From<ControlError> for E2bError {
    fn from(e: ControlError) -> E2bError {
        let code = e.code();
        let message = public(code, if code == ErrorCode::Internal { e.to_string() } else { e.public_message() });
        let (_, status) = connect_code(code);
        E2bError { status, message }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(hex::encode(mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn tokens_differ_per_sandbox_and_secret() {
        assert_ne!(access_token(b"s", "a"), access_token(b"s", "b"));
        assert_ne!(access_token(b"s", "a"), access_token(b"t", "a"));
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"ab", b"abc"));
    }
}
