//! The snapshot routes: `POST /v1/sandboxes/{id}/snapshots` and
//! `/v1/snapshots`. Parsing and rendering only; the control plane owns
//! snapshots (see hutch-control's `snapshots.rs`).

use crate::extract::{ApiPath, ApiQuery};
use crate::routes::Caller;
use crate::{ApiResult, App, JsonBody};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hutch_api::{CreateSnapshot, Diff, Fork, ForkResult, Snapshot, SnapshotList};
use hutch_control::ids::SnapshotId;
use hutch_control::SandboxId;
use serde::Deserialize;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// The snapshot routes, behind the same authentication as the rest of the API.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/sandboxes/{id}/snapshots", post(create))
        .route("/v1/sandboxes/{id}/fork", post(fork))
        .route("/v1/sandboxes/{id}/diff", get(diff))
        .route("/v1/snapshots", get(list))
        .route("/v1/snapshots/{id}", get(get_one).delete(delete_one))
        .route("/v1/snapshots/{id}/export", get(export))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", params(("id" = String, Path)), request_body = CreateSnapshot,
    responses((status = 201, body = Snapshot), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody),
              (status = 429, body = hutch_api::ErrorBody), (status = 507, body = hutch_api::ErrorBody)))]
pub(crate) async fn create(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<CreateSnapshot>,
) -> ApiResult<axum::response::Response> {
    let snap = app.control.snapshot(&caller, &SandboxId::parse(&id)?, &req).await?;
    let made = snap.id.clone();
    Ok(crate::audit::created(axum::response::IntoResponse::into_response((StatusCode::CREATED, Json(snap))), made))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", params(("id" = String, Path)), request_body = Fork,
    responses((status = 201, body = ForkResult), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody),
              (status = 429, body = hutch_api::ErrorBody)))]
pub(crate) async fn fork(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<Fork>,
) -> ApiResult<(StatusCode, Json<ForkResult>)> {
    let forked = app.control.fork(&caller, &SandboxId::parse(&id)?, &req).await?;
    Ok((StatusCode::CREATED, Json(forked)))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct DiffQuery {
    /// A snapshot (id or name) of the sandbox's lineage to compare with,
    /// instead of what it started from.
    against: Option<String>,
    /// `json` (the default) or `tar`: the changed files as an archive, the
    /// deleted paths in `.hutch-diff/deleted` (NUL-terminated).
    format: Option<String>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/diff", params(("id" = String, Path), DiffQuery),
    responses((status = 200, body = Diff), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn diff(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<DiffQuery>,
) -> ApiResult<Response> {
    let id = SandboxId::parse(&id)?;
    match q.format.as_deref() {
        None | Some("json") => Ok(Json(app.control.diff(&caller, &id, q.against.as_deref()).await?).into_response()),
        Some("tar") => {
            let tar = app.control.diff_archive(&caller, &id, q.against.as_deref()).await?;
            Ok(([(header::CONTENT_TYPE, "application/x-tar")], crate::transfer::body_of(tar)).into_response())
        }
        Some(_) => Err(crate::ApiError::invalid("format must be json or tar")),
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Another owner's (a key id), or `*` for every owner's: admin keys only.
    owner: Option<String>,
}

#[utoipa::path(get, path = "/v1/snapshots", params(ListQuery),
    responses((status = 200, body = SnapshotList), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn list(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SnapshotList>> {
    Ok(Json(app.control.list_snapshots(&caller, q.owner.as_deref()).await?))
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Snapshot), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Snapshot>> {
    Ok(Json(app.control.get_snapshot(&caller, &SnapshotId::parse(&id)?).await?))
}

#[utoipa::path(delete, path = "/v1/snapshots/{id}", params(("id" = String, Path)),
    responses((status = 204, description = "deleted"), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.delete_snapshot(&caller, &SnapshotId::parse(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/snapshots/{id}/export", params(("id" = String, Path, description = "A snapshot's id, or a name of the caller's")),
    responses((status = 200, description = "An image archive (OCI layout and docker-save manifest in one tar)", content_type = "application/x-tar"),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn export(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Response> {
    let ar = app.control.export_snapshot(&caller, &id).await?;
    let headers = [
        (header::CONTENT_TYPE, "application/x-tar".to_owned()),
        (header::CONTENT_LENGTH, ar.size.to_string()),
        (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{}\"", ar.file_name)),
    ];
    Ok((headers, crate::transfer::body_of(ar.chunks)).into_response())
}
