//! The access routes: `/v1/sandboxes/{id}/access` (make, list and revoke
//! short-lived credentials for one port). Parsing and rendering only; the
//! control plane owns the grants, and `proxy.rs` serves the ports.

use crate::extract::ApiPath;
use crate::routes::Caller;
use crate::{ApiResult, App, JsonBody};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Extension, Json, Router};
use hutch_api::{AccessGrant, AccessGrantList, CreateAccess};
use hutch_control::control::rfc3339;
use hutch_control::SandboxId;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// The access routes, behind the same authentication as the rest of the API.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/sandboxes/{id}/access", post(create).get(list).delete(revoke_all))
        .route("/v1/sandboxes/{id}/access/{grant}", delete(revoke))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

/// The host and port the client reached us at, from its Host header (only
/// plain host characters; `localhost` otherwise).
fn api_host(headers: &HeaderMap) -> String {
    headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .filter(|h| {
            !h.is_empty() && h.len() <= 255 && h.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .unwrap_or("localhost")
        .to_owned()
}

/// A grant as the API shows it, with its two urls.
pub(crate) fn view(
    headers: &HeaderMap,
    sandbox: &str,
    id: String,
    port: u16,
    expires_at: i64,
    token: Option<String>,
) -> AccessGrant {
    let host = api_host(headers);
    let port_part = if host.starts_with('[') { host.split_once("]:") } else { host.rsplit_once(':') };
    let api_port = match port_part {
        Some((_, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => format!(":{p}"),
        _ => String::new(),
    };
    AccessGrant {
        id,
        port,
        url: format!("http://{sandbox}--{port}{}{api_port}/", crate::proxy::HOST_SUFFIX),
        path_url: format!("http://{host}/v1/sandboxes/{sandbox}/ports/{port}/"),
        token,
        expires_at: rfc3339(expires_at),
    }
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/access", params(("id" = String, Path)), request_body = CreateAccess,
    responses((status = 201, body = AccessGrant), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody),
              (status = 429, body = hutch_api::ErrorBody)))]
pub(crate) async fn create(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<CreateAccess>,
) -> ApiResult<Response> {
    let id = SandboxId::parse(&id)?;
    let g = app.control.create_access(&caller, &id, &req).await?;
    let body = view(&headers, id.as_str(), g.id, g.port, g.expires_at, Some(g.token));
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/access", params(("id" = String, Path)),
    responses((status = 200, body = AccessGrantList), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn list(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
) -> ApiResult<Json<AccessGrantList>> {
    let id = SandboxId::parse(&id)?;
    let grants = app.control.list_access(&caller, &id).await?;
    Ok(Json(AccessGrantList {
        grants: grants.into_iter().map(|g| view(&headers, id.as_str(), g.id, g.port, g.expires_at, None)).collect(),
    }))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/access/{grant}", params(("id" = String, Path), ("grant" = String, Path)),
    responses((status = 204, description = "revoked; its open connections are closed"),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn revoke(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, grant)): ApiPath<(String, String)>,
) -> ApiResult<StatusCode> {
    app.control.revoke_access(&caller, &SandboxId::parse(&id)?, &grant).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/access", params(("id" = String, Path)),
    responses((status = 204, description = "every grant revoked; their open connections are closed"),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn revoke_all(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.revoke_all_access(&caller, &SandboxId::parse(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_port_the_client_reached() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:7700".parse().expect("host"));
        let g = view(&h, "sb-1", "ag-1".into(), 8080, 0, None);
        assert_eq!(g.url, "http://sb-1--8080.sandboxes.localhost:7700/");
        assert_eq!(g.path_url, "http://127.0.0.1:7700/v1/sandboxes/sb-1/ports/8080/");
        h.insert(header::HOST, "hutch.example".parse().expect("host"));
        assert_eq!(view(&h, "sb-1", "ag-1".into(), 80, 0, None).url, "http://sb-1--80.sandboxes.localhost/");
        h.insert(header::HOST, "evil/path".parse().expect("host"));
        assert_eq!(
            view(&h, "sb-1", "ag-1".into(), 80, 0, None).path_url,
            "http://localhost/v1/sandboxes/sb-1/ports/80/"
        );
    }
}
