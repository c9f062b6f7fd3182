//! The parsers of untrusted bytes inside the private E2B modules, reachable
//! for the fuzz targets under fuzz/ (cargo-fuzz). Each function is a thin
//! call of the real parser over what a client sends; nothing else calls
//! them. (The port proxy's parsers are public in [`crate::proxy`].)

use crate::e2b::{connect, envd, forward};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request};
use hutch_control::e2b::SignedUrl;
use serde_json::Value;

/// The one message of a Connect server-stream request body.
pub fn connect_stream_request(body: &[u8]) -> Result<Value, String> {
    connect::stream_request(&Bytes::copy_from_slice(body)).map_err(|e| e.message)
}

/// Splits the complete enveloped messages off the front of a Connect
/// client stream's buffer (`StreamInput`), leaving an incomplete one.
pub fn connect_take_messages(buf: &mut Vec<u8>) -> Result<Vec<Value>, String> {
    connect::take_messages(buf).map_err(|e| e.message)
}

/// The user of an envd call's `Authorization: Basic` header.
pub fn e2b_basic_user(headers: &HeaderMap) -> Result<Option<String>, String> {
    envd::basic_user(headers).map_err(|e| e.message)
}

/// The sandbox an envd call names (`E2b-Sandbox-Id`, or the `Host` form).
pub fn e2b_named_sandbox(headers: &HeaderMap) -> Option<String> {
    envd::named_sandbox(headers).map(|id| id.to_string())
}

/// The signed-URL parameters of a request to `uri` (a GET reads, anything
/// else writes); `None` when `uri` is not one a request can carry.
pub fn e2b_signed_url(uri: &str, get: bool) -> Option<Result<Option<SignedUrl>, String>> {
    let method = if get { Method::GET } else { Method::POST };
    let req = Request::builder().method(method).uri(uri).body(Body::empty()).ok()?;
    Some(envd::signed_url(&req).map_err(|e| e.message))
}

/// The port an envd call's `E2b-Sandbox-Port` header names (None: envd's
/// own, or no header).
pub fn e2b_sandbox_port(value: Option<&[u8]>) -> Result<Option<u16>, &'static str> {
    forward::sandbox_port(value)
}

/// Whether an unauthenticated call may reach the code interpreter's
/// context routes.
pub fn e2b_interpreter_open_route(method: &Method, path: &str) -> bool {
    forward::interpreter_open_route(method, path)
}

/// envd's own port, which [`e2b_sandbox_port`] never answers.
pub const E2B_ENVD_PORT: u16 = crate::e2b::ENVD_PORT;
