//! The audit layer: one middleware around the whole router that records
//! every mutating call (any method but GET, HEAD and OPTIONS) of the
//! native API, the E2B API and the MCP server.
//!
//! The layer runs before routing, so it cannot see who called or which
//! route matched: it puts an empty [`Slot`] in the request's extensions,
//! and each authentication point fills it ([`identified`]) with the key
//! and the route's template once it accepted a credential. When the
//! response starts (a stream's too), the layer reads its status and the
//! error code the error renderers tag it with, and hands the call to the
//! control plane's audit queue, which never waits. Calls no key made (a
//! refused credential, the port proxy, health checks) are not recorded:
//! there is no "who".
//!
//! MCP carries many operations over `POST /mcp`: the MCP server records
//! its mutating tool calls itself ([`record`]), and this layer leaves
//! `/mcp` to it.

use crate::extract::ApiQuery;
use crate::{ApiResult, App};
use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use axum::{Extension, Json};
use hutch_api::AuditList;
use hutch_api::ErrorCode;
use hutch_control::audit::Call;
use hutch_control::audit::Filter;
use hutch_control::Caller;
use hutch_control::OwnerId;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// Who made a call and what it named, filled in by the authentication.
#[derive(Clone, Default)]
pub(crate) struct Slot(Arc<Mutex<Option<Seen>>>);

struct Seen {
    key: OwnerId,
    route: String,
    targets: BTreeMap<String, String>,
}

/// The id of what a call made, which its path cannot name: recorded as the
/// `created` target.
#[derive(Clone)]
struct Created(String);

/// Tags a response with the id of what its call made.
pub(crate) fn created(mut resp: Response, id: String) -> Response {
    resp.extensions_mut().insert(Created(id));
    resp
}

/// Whether calls of this method are recorded.
fn mutating(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The client's address as recorded (an IPv4-mapped IPv6 address as IPv4).
pub(crate) fn client<B>(req: &axum::http::Request<B>) -> String {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or_else(|| "unknown".to_owned(), |ConnectInfo(a)| a.ip().to_canonical().to_string())
}

/// Longest target value kept (a path's bytes are ASCII).
const TARGET_MAX: usize = 256;

fn capped(s: &str) -> String {
    s.get(..TARGET_MAX).unwrap_or(s).to_owned()
}

/// The path parameters of `template` (`/v1/sandboxes/{id}`) in `path`: each
/// `{name}` segment's value, and a `{*name}` the rest of the path. Pure.
pub(crate) fn targets(template: &str, path: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut segs = path.split('/');
    for t in template.split('/') {
        let Some(seg) = segs.next() else { break };
        if let Some(name) = t.strip_prefix("{*").and_then(|r| r.strip_suffix('}')) {
            let rest: Vec<&str> = std::iter::once(seg).chain(segs.by_ref()).collect();
            out.insert(name.to_owned(), capped(&rest.join("/")));
            break;
        }
        if let Some(name) = t.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
            out.insert(name.to_owned(), capped(seg));
        }
    }
    out
}

/// Called by every authentication point once it accepted a credential:
/// the call is `key`'s, on the route that matched (plus `extra` targets the
/// path does not carry, e.g. the sandbox an E2B envd call names by header).
pub(crate) fn identified(req: &Request, key: &OwnerId, extra: &[(&str, &str)]) {
    let Some(slot) = req.extensions().get::<Slot>() else { return };
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| req.uri().path(), |m| m.as_str()).to_owned();
    let mut t = targets(&route, req.uri().path());
    t.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    if let Ok(mut s) = slot.0.lock() {
        *s = Some(Seen { key: key.clone(), route, targets: t });
    }
}

/// Status recorded for a call whose client went away before its response
/// started (nginx's convention): the call may have done its work.
const CLIENT_CLOSED: u16 = 499;

/// A call being answered: recorded once, when its response starts or, if
/// the client goes away first (the handler is dropped), then.
struct Pending {
    app: Arc<App>,
    slot: Slot,
    method: String,
    client: String,
}

impl Pending {
    fn record(&self, status: u16, code: Option<ErrorCode>, created: Option<String>) {
        let Some(mut seen) = self.slot.0.lock().ok().and_then(|mut s| s.take()) else { return };
        if let Some(id) = created {
            seen.targets.insert("created".to_owned(), id);
        }
        self.app.control.audit(Call {
            key: seen.key,
            method: self.method.clone(),
            route: seen.route,
            targets: seen.targets,
            client: self.client.clone(),
            status,
            error_code: code,
        });
    }
}

impl Drop for Pending {
    /// Still pending: the client went away before the response (a no-op
    /// once recorded: the slot is empty).
    fn drop(&mut self) {
        self.record(CLIENT_CLOSED, None, None);
    }
}

/// The middleware: records mutating calls at the start of their response.
pub(crate) async fn layer(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    if !mutating(req.method()) || req.uri().path() == "/mcp" {
        return next.run(req).await;
    }
    let slot = Slot::default();
    req.extensions_mut().insert(slot.clone());
    let pending = Pending { app, slot, method: req.method().to_string(), client: client(&req) };
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    // An error response no renderer tagged still says it failed.
    let code = resp.extensions().get::<ErrorCode>().copied().or_else(|| (status >= 400).then(|| untagged(status)));
    let created = resp.extensions().get::<Created>().map(|c| c.0.clone());
    pending.record(status, code, created);
    resp
}

/// The code of an error response that carries none of hutch's (an E2B
/// refusal in E2B's own words): the closest by status.
fn untagged(status: u16) -> ErrorCode {
    match status {
        400 | 422 => ErrorCode::InvalidRequest,
        401 => ErrorCode::Unauthorized,
        403 => ErrorCode::Forbidden,
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        409 => ErrorCode::Conflict,
        413 => ErrorCode::PayloadTooLarge,
        429 => ErrorCode::QuotaExceeded,
        503 => ErrorCode::Unavailable,
        _ => ErrorCode::Internal,
    }
}

/// Records one MCP tool call (the MCP server's own audit point).
pub(crate) fn record(
    control: &hutch_control::Control,
    key: &OwnerId,
    tool: &str,
    targets: BTreeMap<String, String>,
    client: String,
    error: Option<ErrorCode>,
) {
    control.audit(Call {
        key: key.clone(),
        method: "POST".into(),
        route: format!("mcp:{tool}"),
        targets,
        client,
        status: error.map_or(200, ErrorCode::status),
        error_code: error,
    });
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuditQuery {
    /// Only this key's calls.
    key: Option<String>,
    /// RFC 3339 bounds of `at`, inclusive.
    from: Option<String>,
    to: Option<String>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
    /// 1 to 1000 (default 100).
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/v1/audit", params(AuditQuery),
    responses((status = 200, body = AuditList), (status = 400, body = hutch_api::ErrorBody),
              (status = 403, body = hutch_api::ErrorBody, description = "not the admin key")))]
pub(crate) async fn list(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> ApiResult<Json<AuditList>> {
    let f = Filter {
        key: q.key.as_deref(),
        from: q.from.as_deref(),
        to: q.to.as_deref(),
        cursor: q.cursor.as_deref(),
        limit: q.limit,
    };
    Ok(Json(app.control.audit_log(&caller, &f).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_read_from_the_template() {
        let t = targets("/v1/sandboxes/{id}/processes/{pid}/signal", "/v1/sandboxes/sb-1/processes/42/signal");
        assert_eq!(t.get("id").map(String::as_str), Some("sb-1"));
        assert_eq!(t.get("pid").map(String::as_str), Some("42"));
        assert_eq!(t.len(), 2);
        let t = targets("/v1/sandboxes/{id}/ports/{port}/{*rest}", "/v1/sandboxes/sb-1/ports/80/a/b");
        assert_eq!(t.get("rest").map(String::as_str), Some("a/b"));
        assert!(targets("/v1/keys", "/v1/keys").is_empty());
        let long = format!("/v1/sandboxes/{}", "a".repeat(1000));
        assert_eq!(targets("/v1/sandboxes/{id}", &long)["id"].len(), TARGET_MAX);
    }

    #[test]
    fn reads_are_not_mutations() {
        for m in [Method::GET, Method::HEAD, Method::OPTIONS] {
            assert!(!mutating(&m));
        }
        for m in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
            assert!(mutating(&m));
        }
    }
}
