//! The volume routes: `/v1/volumes`. Parsing and rendering only; the
//! control plane owns volumes (see hutch-control's `volumes.rs`).

use crate::extract::{ApiPath, ApiQuery};
use crate::routes::Caller;
use crate::{ApiResult, App, JsonBody};
use axum::extract::State;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::get;
use axum::{Extension, Json, Router};
use hutch_api::{CreateVolume, UpdateVolume, Volume, VolumeList};
use serde::Deserialize;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// The volume routes, behind the same authentication as the rest of the API.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/{id}", get(get_one).patch(update).delete(delete_one))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

#[utoipa::path(post, path = "/v1/volumes", request_body = CreateVolume,
    responses((status = 201, body = Volume), (status = 400, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody), (status = 429, body = hutch_api::ErrorBody),
              (status = 507, body = hutch_api::ErrorBody)))]
pub(crate) async fn create(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<CreateVolume>,
) -> ApiResult<(StatusCode, Json<Volume>)> {
    Ok((StatusCode::CREATED, Json(app.control.create_volume(&caller, &req).await?)))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Another owner's (a key id), or `*` for every owner's: admin keys only.
    owner: Option<String>,
}

#[utoipa::path(get, path = "/v1/volumes", params(ListQuery),
    responses((status = 200, body = VolumeList), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn list(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<VolumeList>> {
    Ok(Json(app.control.list_volumes(&caller, q.owner.as_deref()).await?))
}

#[utoipa::path(get, path = "/v1/volumes/{id}", params(("id" = String, Path, description = "its id or name")),
    responses((status = 200, body = Volume), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Volume>> {
    Ok(Json(app.control.get_volume(&caller, &id).await?))
}

#[utoipa::path(patch, path = "/v1/volumes/{id}", params(("id" = String, Path, description = "its id or name")),
    request_body = UpdateVolume,
    responses((status = 200, body = Volume), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 429, body = hutch_api::ErrorBody)))]
pub(crate) async fn update(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<UpdateVolume>,
) -> ApiResult<Json<Volume>> {
    Ok(Json(app.control.resize_volume(&caller, &id, &req).await?))
}

#[utoipa::path(delete, path = "/v1/volumes/{id}", params(("id" = String, Path, description = "its id or name")),
    responses((status = 204, description = "deleted"), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.delete_volume(&caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
