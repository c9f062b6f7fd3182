//! The template routes: `/v1/templates` and `/v1/templates/{id}`, and the
//! read-only list of images templates may name (`/v1/images`). Parsing and
//! rendering only; the control plane owns templates and warm pools.

use crate::routes::Caller;
use crate::{ApiResult, App, JsonBody};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hutch_api::{CreateTemplate, ImageInfo, ImageList, Template, TemplateList, UpdateTemplate};
use hutch_control::templates::TemplateId;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// The template routes, behind the same authentication as the rest of the API.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/templates", post(create_template).get(list_templates))
        .route("/v1/templates/{id}", get(get_template).patch(update_template).delete(delete_template))
        .route("/v1/images", get(list_images))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

#[utoipa::path(post, path = "/v1/templates", request_body = CreateTemplate,
    responses((status = 201, body = Template), (status = 400, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn create_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<CreateTemplate>,
) -> ApiResult<Response> {
    let t = app.control.create_template(&caller.key_id, &req)?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

#[utoipa::path(get, path = "/v1/images", responses((status = 200, body = ImageList)))]
pub(crate) async fn list_images(State(app): AppState) -> ApiResult<Json<ImageList>> {
    let control = app.control.clone();
    let images = tokio::task::spawn_blocking(move || control.images().map(|s| s.summaries()))
        .await
        .map_err(|e| hutch_control::ControlError::Runtime(format!("image list: {e}")))??;
    let images = images
        .into_iter()
        .map(|i| ImageInfo {
            name: i.name,
            layers: i.layers as u64,
            size_bytes: i.size_bytes,
            source: i.source,
            created_at: hutch_control::control::rfc3339(i.created_at.saturating_mul(1000).min(i64::MAX as u64) as i64),
        })
        .collect();
    Ok(Json(ImageList { images }))
}

#[utoipa::path(get, path = "/v1/templates", responses((status = 200, body = TemplateList)))]
pub(crate) async fn list_templates(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<TemplateList>> {
    Ok(Json(app.control.list_templates(&caller.key_id)?))
}

#[utoipa::path(get, path = "/v1/templates/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Template), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Template>> {
    Ok(Json(app.control.get_template(&caller.key_id, &TemplateId::parse(&id)?)?))
}

#[utoipa::path(patch, path = "/v1/templates/{id}", params(("id" = String, Path)), request_body = UpdateTemplate,
    responses((status = 200, body = Template), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn update_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<UpdateTemplate>,
) -> ApiResult<Json<Template>> {
    Ok(Json(app.control.update_template(&caller.key_id, &TemplateId::parse(&id)?, &req)?))
}

#[utoipa::path(delete, path = "/v1/templates/{id}", params(("id" = String, Path)),
    responses((status = 204, description = "hidden; its warm pool drained"), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    app.control.delete_template(&caller.key_id, &TemplateId::parse(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}
