//! The image routes that change the host's shared images (admin keys
//! only): `POST /v1/images/import` (an archive streamed as the body),
//! `POST /v1/images/pull`, `POST /v1/images/build`, `DELETE /v1/images/{name}` and
//! `POST /v1/images/gc`. `GET /v1/images` is with the templates. Parsing
//! and rendering only; the control plane owns the store.

use crate::extract::ApiPath;
use crate::routes::Caller;
use crate::{ApiError, App, JsonBody};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Extension, Json, Router};
use hutch_api::{BuildImage, ErrorCode, ImageBuildEvent, ImageInfo, PullImage};
use hutch_control::images::{ImportImage, IMPORT_CAP};
use std::sync::Arc;

type AppState = State<Arc<App>>;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/images/import", post(import_image))
        .route("/v1/images/pull", post(pull_image))
        .route("/v1/images/build", post(build_image))
        .route("/v1/images/gc", post(collect_images))
        .route("/v1/images/{name}", delete(delete_image))
        .route_layer(middleware::from_fn_with_state(app, crate::routes::authenticate))
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ImportQuery {
    /// The image's name (default: the archive's tag, else `filename`).
    name: Option<String>,
    /// The archive's file name: the image's `source` (`import:FILENAME`)
    /// and its default name.
    filename: Option<String>,
    /// Only check that an import with these parameters (and this
    /// Content-Length) would be taken: `204`, or the refusal it would get.
    /// A client that cannot read an answer before it has sent its whole
    /// body (no `Expect: 100-continue`) asks this first.
    #[serde(default)]
    check: bool,
    /// With `check`: the archive's size in bytes, checked against the cap.
    size: Option<u64>,
}

#[utoipa::path(post, path = "/v1/images/import", params(ImportQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream",
        description = "a `docker save` archive or an OCI image layout, plain or gzip-compressed (any Content-Type)"),
    responses((status = 201, body = ImageInfo), (status = 204, description = "`check`: it would be taken"),
              (status = 400, body = hutch_api::ErrorBody), (status = 403, body = hutch_api::ErrorBody),
              (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn import_image(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    q: Result<axum::extract::Query<ImportQuery>, axum::extract::rejection::QueryRejection>,
    req: Request,
) -> Response {
    // Refused before the body is read: answered once a small one is read.
    let declared =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let checked = match q {
        Err(e) => Err(ApiError::invalid(e.body_text())),
        Ok(axum::extract::Query(q)) => app
            .control
            .may_manage_images(&caller)
            .and_then(|()| q.name.as_deref().map_or(Ok(()), hutch_control::images::check_name))
            .map_err(ApiError::from)
            .and_then(|()| match q.size.filter(|_| q.check).or(declared) {
                Some(n) if n > IMPORT_CAP => Err(ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("image archive of {n} bytes, above {} GiB; nothing was imported", IMPORT_CAP >> 30),
                )),
                _ => Ok(q),
            }),
    };
    let q = match checked {
        Ok(q) if q.check => return crate::transfer::refuse(req, StatusCode::NO_CONTENT.into_response()).await,
        Ok(q) => q,
        Err(e) => return crate::transfer::refuse(req, e.into_response()).await,
    };
    let (chunks, feed) = crate::transfer::chunks_of(req.into_body());
    let import = ImportImage { name: q.name, filename: q.filename };
    let (done, whole) = crate::transfer::with_feed(feed, app.control.import_image(&caller, import, chunks)).await;
    let resp = match done {
        Ok(info) => (StatusCode::CREATED, Json(info)).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    };
    crate::transfer::close_unless(whole, resp)
}

#[utoipa::path(post, path = "/v1/images/pull", request_body = PullImage,
    responses((status = 201, body = ImageInfo), (status = 400, body = hutch_api::ErrorBody),
              (status = 403, body = hutch_api::ErrorBody), (status = 502, body = hutch_api::ErrorBody)))]
pub(crate) async fn pull_image(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<PullImage>,
) -> Result<Response, ApiError> {
    let info = app.control.pull_image(&caller, req).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

/// Progress lines a build may have waiting for a slow reader; more are
/// counted and dropped, never queued.
const BUILD_LOG_BACKLOG: usize = 256;

#[utoipa::path(post, path = "/v1/images/build", request_body = BuildImage,
    responses((status = 200, body = ImageBuildEvent, content_type = "application/x-ndjson",
               description = "progress lines as they come, then `done` with the image or `error` with its code"),
              (status = 400, body = hutch_api::ErrorBody), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn build_image(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<BuildImage>,
) -> Result<Response, ApiError> {
    // Refused before anything runs: a plain error answer.
    let build = app.control.check_image_build(&caller, req)?;
    let (lines_tx, mut lines) = tokio::sync::mpsc::channel::<String>(BUILD_LOG_BACKLOG);
    let skipped = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let dropped = skipped.clone();
    let progress = move |line: &str| {
        let line: String = line.chars().take(4096).collect();
        if lines_tx.try_send(line).is_err() {
            dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    };
    // The build goes on if the client leaves: what it makes is recorded.
    let control = app.control.clone();
    let mut done = tokio::spawn(async move { control.build_image(build, progress).await });
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let skipped_event = || match skipped.swap(0, std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            n => Some(ImageBuildEvent::Skipped { lines: n }),
        };
        let outcome = loop {
            tokio::select! {
                biased;
                line = lines.recv() => match line {
                    Some(line) => {
                        for ev in skipped_event().into_iter().chain([ImageBuildEvent::Log { line }]) {
                            let _ = tx.send(ev).await;
                        }
                    }
                    None => break (&mut done).await,
                },
                out = &mut done => break out,
            }
        };
        // Lines sent before the end are still in the channel.
        while let Ok(line) = lines.try_recv() {
            let _ = tx.send(ImageBuildEvent::Log { line }).await;
        }
        if let Some(ev) = skipped_event() {
            let _ = tx.send(ev).await;
        }
        let last = match outcome {
            Ok(Ok(image)) => ImageBuildEvent::Done { image },
            Ok(Err(e)) => {
                let e = ApiError::from(e);
                ImageBuildEvent::Error { code: e.code, error: e.message }
            }
            Err(e) => {
                ImageBuildEvent::Error { code: ErrorCode::Internal, error: format!("the build task failed: {e}") }
            }
        };
        let _ = tx.send(last).await;
    });
    Ok(crate::routes::ndjson(rx))
}

#[utoipa::path(delete, path = "/v1/images/{name}", params(("name" = String, Path)),
    responses((status = 204, description = "removed; its layers go at the next collection"),
              (status = 400, body = hutch_api::ErrorBody), (status = 403, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_image(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    app.control.remove_image(&caller, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/images/gc`'s answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct Collected {
    /// Layers removed.
    layers_removed: u64,
}

#[utoipa::path(post, path = "/v1/images/gc",
    responses((status = 200, body = Collected), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn collect_images(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Collected>, ApiError> {
    let n = app.control.collect_images(&caller).await?;
    Ok(Json(Collected { layers_removed: n as u64 }))
}
