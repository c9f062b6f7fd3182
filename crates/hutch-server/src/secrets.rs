//! The secret routes: `/v1/secrets`. Parsing and rendering only; the
//! control plane seals and keeps secrets (hutch-control `secrets.rs`). No
//! answer holds a value.

use crate::extract::ApiPath;
use crate::routes::Caller;
use crate::{ApiResult, App, JsonBody};
use axum::extract::State;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::get;
use axum::{Extension, Json, Router};
use hutch_api::{CreateSecret, Secret, SecretList, UpdateSecret};
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// The secret routes, behind the same authentication as the rest of the API.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/secrets", get(list).post(create))
        .route("/v1/secrets/{name}", get(get_one).patch(update).delete(delete_one))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

#[utoipa::path(post, path = "/v1/secrets", request_body = CreateSecret,
    responses((status = 201, body = Secret), (status = 400, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn create(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<CreateSecret>,
) -> ApiResult<(StatusCode, Json<Secret>)> {
    Ok((StatusCode::CREATED, Json(app.control.create_secret(&caller, &req).await?)))
}

#[utoipa::path(get, path = "/v1/secrets", responses((status = 200, body = SecretList)))]
pub(crate) async fn list(State(app): AppState, Extension(caller): Extension<Caller>) -> ApiResult<Json<SecretList>> {
    Ok(Json(app.control.list_secrets(&caller).await?))
}

#[utoipa::path(get, path = "/v1/secrets/{name}", params(("name" = String, Path, description = "its name")),
    responses((status = 200, body = Secret), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Secret>> {
    Ok(Json(app.control.get_secret(&caller, &name).await?))
}

#[utoipa::path(patch, path = "/v1/secrets/{name}", params(("name" = String, Path, description = "its name")),
    request_body = UpdateSecret,
    responses((status = 200, body = Secret), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn update(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
    JsonBody(req): JsonBody<UpdateSecret>,
) -> ApiResult<Json<Secret>> {
    Ok(Json(app.control.update_secret(&caller, &name, &req).await?))
}

#[utoipa::path(delete, path = "/v1/secrets/{name}", params(("name" = String, Path, description = "its name")),
    responses((status = 204, description = "deleted"), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_one(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.delete_secret(&caller, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
