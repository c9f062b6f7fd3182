//! The template routes: `/v1/templates`, `/v1/templates/{id}` and its
//! builds, and the read-only list of the images the caller may name
//! (`/v1/images`). Parsing and rendering only; the control plane owns
//! templates, warm pools and builds.

use crate::extract::{ApiPath, ApiQuery};
use crate::routes::Caller;
use crate::{ApiError, ApiResult, App, ChannelBody, JsonBody};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hutch_api::{Build, BuildList, CreateTemplate, ErrorCode, ImageList, Template, TemplateList, UpdateTemplate};
use hutch_control::templates::TemplateId;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// The template routes, behind the same authentication as the rest of the API.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/templates", post(create_template).get(list_templates))
        .route("/v1/templates/{id}", get(get_template).patch(update_template).delete(delete_template))
        .route("/v1/images", get(list_images))
        .route("/v1/templates/{id}/builds", post(start_build).get(list_builds))
        .route("/v1/templates/{id}/builds/{build}", get(get_build))
        .route("/v1/templates/{id}/builds/{build}/logs", get(build_logs))
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
    let t = app.control.create_template(&caller, &req).await?;
    let id = t.id.clone();
    Ok(crate::audit::created((StatusCode::CREATED, Json(t)).into_response(), id))
}

#[utoipa::path(get, path = "/v1/images", responses((status = 200, body = ImageList)))]
pub(crate) async fn list_images(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<ImageList>> {
    Ok(Json(app.control.list_images(&caller).await?))
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct OwnerQuery {
    /// Another owner's (a key id), or `*` for every owner's: admin keys only.
    owner: Option<String>,
}

#[utoipa::path(get, path = "/v1/templates", params(OwnerQuery), responses((status = 200, body = TemplateList)))]
pub(crate) async fn list_templates(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<OwnerQuery>,
) -> ApiResult<Json<TemplateList>> {
    Ok(Json(app.control.list_templates(&caller, q.owner.as_deref()).await?))
}

#[utoipa::path(get, path = "/v1/templates/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Template), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Template>> {
    Ok(Json(app.control.get_template(&caller, &TemplateId::parse(&id)?).await?))
}

#[utoipa::path(patch, path = "/v1/templates/{id}", params(("id" = String, Path)), request_body = UpdateTemplate,
    responses((status = 200, body = Template), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn update_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<UpdateTemplate>,
) -> ApiResult<Json<Template>> {
    Ok(Json(app.control.update_template(&caller, &TemplateId::parse(&id)?, &req).await?))
}

#[utoipa::path(delete, path = "/v1/templates/{id}", params(("id" = String, Path)),
    responses((status = 204, description = "hidden; its warm pool drained"), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.delete_template(&caller, &TemplateId::parse(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Largest build context accepted (the archive limit of uploads).
const CONTEXT_CAP: usize = hutch_control::files::ARCHIVE_CAP;

#[utoipa::path(post, path = "/v1/templates/{id}/builds", params(("id" = String, Path)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream",
        description = "a tar.gz of a directory holding `Dockerfile` and the files it copies (sent as application/gzip or application/octet-stream)"),
    responses((status = 202, body = Build), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn start_build(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Response> {
    let kind = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let kind = kind.split(';').next().unwrap_or("").trim();
    if !matches!(kind, "application/gzip" | "application/x-gzip" | "application/x-tar" | "application/octet-stream") {
        return Err(ApiError::invalid(format!(
            "Content-Type {kind:?}: send the build context as application/gzip (a tar.gz)"
        )));
    }
    let id = TemplateId::parse(&id)?;
    let bytes = axum::body::to_bytes(body, CONTEXT_CAP).await.map_err(|_| {
        ApiError::new(ErrorCode::SandboxArchiveTooLarge, format!("build context above {} MiB", CONTEXT_CAP >> 20))
    })?;
    let build = app.control.start_build(&caller, &id, bytes.to_vec()).await?;
    Ok((StatusCode::ACCEPTED, Json(build)).into_response())
}

#[utoipa::path(get, path = "/v1/templates/{id}/builds", params(("id" = String, Path)),
    responses((status = 200, body = BuildList), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn list_builds(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<BuildList>> {
    Ok(Json(app.control.list_builds(&caller, &TemplateId::parse(&id)?).await?))
}

#[utoipa::path(get, path = "/v1/templates/{id}/builds/{build}", params(("id" = String, Path), ("build" = String, Path)),
    responses((status = 200, body = Build), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_build(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, build)): ApiPath<(String, String)>,
) -> ApiResult<Json<Build>> {
    Ok(Json(app.control.get_build(&caller, &TemplateId::parse(&id)?, &build).await?))
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
pub(crate) struct LogQuery {
    /// Stream the log until the build ends.
    #[serde(default)]
    follow: Option<bool>,
}

#[utoipa::path(get, path = "/v1/templates/{id}/builds/{build}/logs",
    params(("id" = String, Path), ("build" = String, Path), LogQuery),
    responses((status = 200, description = "the build's log", content_type = "text/plain"),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn build_logs(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, build)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<LogQuery>,
) -> ApiResult<Response> {
    let mut rx = app.control.build_log(&caller, &TemplateId::parse(&id)?, &build, q.follow.unwrap_or(false)).await?;
    let (tx, body_rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        while let Some(chunk) = rx.recv().await {
            if tx.send(chunk.map(bytes::Bytes::from)).await.is_err() {
                return;
            }
        }
    });
    let mut resp = ChannelBody(body_rx).into_body().into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    Ok(resp)
}
