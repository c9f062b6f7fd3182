//! The native API's routes and their handlers.

use crate::{idempotency_key, ApiError, ApiResult, App, ChannelBody, JsonBody};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hutch_api::{
    CreateSandbox, ErrorCode, ExecEvent, ExecRequest, ExecutionRequest, ExecutionResult, Extend, ProcessList, Sandbox,
    SandboxList, SignalRequest, StdinRequest,
};
use hutch_control::exec::ExecReply;
use serde::Deserialize;
use std::sync::Arc;

/// Who is calling: the id of their API key.
#[derive(Clone, Debug)]
pub struct Caller {
    pub key_id: String,
}

type AppState = State<Arc<App>>;

pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route("/v1/sandboxes/{id}", get(get_sandbox).delete(delete_sandbox))
        .route("/v1/sandboxes/{id}/extend", post(extend_sandbox))
        .route("/v1/sandboxes/{id}/suspend", post(suspend_sandbox))
        .route("/v1/sandboxes/{id}/resume", post(resume_sandbox))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/processes", get(processes))
        .route("/v1/sandboxes/{id}/processes/{pid}/signal", post(signal))
        .route("/v1/sandboxes/{id}/processes/{pid}/stdin", post(stdin))
        .route("/v1/sandboxes/{id}/processes/{pid}/stream", get(stream))
        .route("/v1/executions", post(execution))
        .route("/v1/sandboxes/{id}/files", get(files_get).put(files_put))
        .route("/v1/sandboxes/{id}/files/read", post(files_read))
        .route("/v1/sandboxes/{id}/files/write", post(files_write))
        .route("/v1/sandboxes/{id}/files/list", get(files_list))
        .route(
            "/v1/sandboxes/{id}/archives",
            post(archive_upload)
                .get(archive_download)
                .layer(axum::extract::DefaultBodyLimit::max(hutch_control::files::ARCHIVE_CAP + (1 << 20))),
        )
        .route("/v1/sandboxes/{id}/file-parts", post(file_part))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), authenticate));
    Router::new()
        .merge(api)
        .merge(crate::e2b::router(app.clone()))
        .merge(crate::templates::router(app.clone()))
        .merge(crate::access::router(app.clone()))
        .route("/healthz", get(healthz))
        .route("/v1/openapi.json", get(openapi))
        // The port proxy's path form authenticates with access tokens, not API keys.
        .route("/v1/sandboxes/{id}/ports/{port}", axum::routing::any(crate::proxy::by_path))
        .route("/v1/sandboxes/{id}/ports/{port}/", axum::routing::any(crate::proxy::by_path))
        .route("/v1/sandboxes/{id}/ports/{port}/{*rest}", axum::routing::any(crate::proxy::by_path))
        .fallback(not_found)
        // Proxy host names are served by the proxy whatever the path.
        .layer(middleware::from_fn_with_state(app.clone(), crate::proxy::by_host))
        .with_state(app)
}

pub(crate) async fn authenticate(State(app): AppState, mut req: Request, next: Next) -> Response {
    let secret = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or("");
    match hutch_control::keys::authenticate(app.control.store.as_ref(), secret) {
        Ok(Some(key)) => {
            crate::listener::authenticated(&req);
            req.extensions_mut().insert(Caller { key_id: key.id });
            next.run(req).await
        }
        Ok(None) => ApiError::new(ErrorCode::Unauthorized, "a valid API key is required: Authorization: Bearer <key>")
            .into_response(),
        Err(e) => ApiError::from(hutch_control::ControlError::Store(e)).into_response(),
    }
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such route")
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn openapi() -> Response {
    let mut resp = crate::openapi::document().into_response();
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

async fn metrics(State(app): AppState) -> ApiResult<Response> {
    let states =
        app.control.store.count_by_state().map_err(|e| ApiError::from(hutch_control::ControlError::Store(e)))?;
    let running = app.control.commands_running().await;
    let text = app.control.metrics.render(&states, running);
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// Sandbox ids in paths: malformed ones can name nothing.
pub(crate) fn sandbox_id(id: &str) -> ApiResult<&str> {
    hutch_runtime::container::valid_id(id)
        .map_err(|_| ApiError::new(ErrorCode::NotFound, format!("no sandbox {id}")))?;
    Ok(id)
}

#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox,
    params(("Idempotency-Key" = Option<String>, Header, description = "Replays the create for the same key and body")),
    responses((status = 201, body = Sandbox), (status = 200, body = Sandbox, description = "replayed"),
              (status = 400, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody),
              (status = 429, body = hutch_api::ErrorBody), (status = 503, body = hutch_api::ErrorBody)))]
pub(crate) async fn create_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<CreateSandbox>,
) -> ApiResult<Response> {
    let key = idempotency_key(&headers)?;
    let (sb, created) = app.control.create(&caller.key_id, &req, key.as_deref()).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sb)).into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    limit: Option<u32>,
    cursor: Option<String>,
}

#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), (status = 400, body = hutch_api::ErrorBody)))]
pub(crate) async fn list_sandboxes(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<SandboxList>> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    Ok(Json(app.control.list(&caller.key_id, q.limit, q.cursor.as_deref())?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.get(&caller.key_id, sandbox_id(&id)?)?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.delete(&caller.key_id, sandbox_id(&id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/extend", params(("id" = String, Path)), request_body = Extend,
    responses((status = 200, body = Sandbox), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn extend_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<Extend>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.extend(&caller.key_id, sandbox_id(&id)?, &req)?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/suspend", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn suspend_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.suspend(&caller.key_id, sandbox_id(&id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn resume_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.resume(&caller.key_id, sandbox_id(&id)?).await?))
}

fn wants_ndjson(headers: &HeaderMap) -> bool {
    headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains("application/x-ndjson"))
}

/// Streams events as NDJSON, one flushed line each.
fn ndjson(mut rx: tokio::sync::mpsc::Receiver<ExecEvent>) -> Response {
    let (tx, body_rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            let mut line = serde_json::to_vec(&ev).unwrap_or_default();
            line.push(b'\n');
            if tx.send(Ok(bytes::Bytes::from(line))).await.is_err() {
                return;
            }
        }
    });
    let mut resp = ChannelBody(body_rx).into_body().into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", params(("id" = String, Path),
    ("Idempotency-Key" = Option<String>, Header, description = "Replays the command's stored result for the same key and body")),
    request_body = ExecRequest,
    responses((status = 200, body = hutch_api::ExecResult, description = "JSON result, an NDJSON stream of ExecEvent with Accept: application/x-ndjson, or {pid} for background"),
              (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody), (status = 429, body = hutch_api::ErrorBody)))]
pub(crate) async fn exec(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<ExecRequest>,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?.to_owned();
    let key = idempotency_key(&headers)?;
    if wants_ndjson(&headers) && !req.background.unwrap_or(false) {
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let control = app.control.clone();
        let mut task =
            tokio::spawn(async move { control.exec(&caller.key_id, &id, &req, key.as_deref(), Some(tx)).await });
        // Until the first event, a failure is still a plain JSON error with
        // its status; after it, the stream carries everything. Events are
        // looked at first: a command that ran and ended before we looked has
        // them all buffered.
        let first = tokio::select! {
            biased;
            first = rx.recv() => first,
            _ = &mut task => None,
        };
        if let Some(first) = first {
            let (out_tx, out_rx) = tokio::sync::mpsc::channel(64);
            tokio::spawn(async move {
                let mut next = Some(first);
                while let Some(ev) = next {
                    if out_tx.send(ev).await.is_err() {
                        break;
                    }
                    next = rx.recv().await;
                }
                // A client that left does not stop the command.
                let _ = task.await;
            });
            return Ok(ndjson(out_rx));
        }
        // No event: the task ended, having refused or replayed. Events it
        // sent before ending are still in the channel.
        let done = task.await.map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        if let Ok(first) = rx.try_recv() {
            let (out_tx, out_rx) = tokio::sync::mpsc::channel(64);
            let _ = out_tx.try_send(first);
            while let Ok(ev) = rx.try_recv() {
                let _ = out_tx.try_send(ev);
            }
            return Ok(ndjson(out_rx));
        }
        let (out_tx, out_rx) = tokio::sync::mpsc::channel(4);
        if let ExecReply::Result(r) = done? {
            // A replayed result: sent as the events it was.
            for ev in [
                ExecEvent::Stdout { data: r.stdout },
                ExecEvent::Stderr { data: r.stderr },
                ExecEvent::Exit { exit_code: r.exit_code, timed_out: r.timed_out, duration_ms: r.duration_ms },
            ] {
                let _ = out_tx.try_send(ev);
            }
        }
        return Ok(ndjson(out_rx));
    }
    match app.control.exec(&caller.key_id, &id, &req, key.as_deref(), None).await? {
        ExecReply::Result(r) => Ok(Json(r).into_response()),
        ExecReply::Background(s) => Ok(Json(s).into_response()),
        ExecReply::Execution(e) => Ok(Json(e).into_response()),
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", params(("id" = String, Path)),
    responses((status = 200, body = ProcessList), (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn processes(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<ProcessList>> {
    Ok(Json(app.control.processes(&caller.key_id, sandbox_id(&id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/signal", params(("id" = String, Path), ("pid" = u32, Path)),
    request_body = SignalRequest,
    responses((status = 204), (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn signal(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path((id, pid)): Path<(String, u32)>,
    JsonBody(req): JsonBody<SignalRequest>,
) -> ApiResult<StatusCode> {
    app.control.signal(&caller.key_id, sandbox_id(&id)?, pid, &req.signal).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/stdin", params(("id" = String, Path), ("pid" = u32, Path)),
    request_body = StdinRequest,
    responses((status = 204), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn stdin(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path((id, pid)): Path<(String, u32)>,
    JsonBody(req): JsonBody<StdinRequest>,
) -> ApiResult<StatusCode> {
    app.control.stdin(&caller.key_id, sandbox_id(&id)?, pid, req.data.as_bytes(), req.eof).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{pid}/stream", params(("id" = String, Path), ("pid" = u32, Path)),
    responses((status = 200, description = "NDJSON stream of ExecEvent"), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn stream(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path((id, pid)): Path<(String, u32)>,
) -> ApiResult<Response> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    app.control.attach(&caller.key_id, sandbox_id(&id)?, pid, tx).await?;
    Ok(ndjson(rx))
}

#[utoipa::path(post, path = "/v1/executions", request_body = ExecutionRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "Replays the stored result for the same key and body")),
    responses((status = 200, body = ExecutionResult), (status = 400, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody), (status = 429, body = hutch_api::ErrorBody), (status = 503, body = hutch_api::ErrorBody)))]
pub(crate) async fn execution(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<ExecutionRequest>,
) -> ApiResult<Json<ExecutionResult>> {
    let key = idempotency_key(&headers)?;
    Ok(Json(app.control.execution(&caller.key_id, &req, key.as_deref()).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct PathQuery {
    /// Absolute, or relative to /workspace.
    path: String,
}

fn query<T>(q: Result<Query<T>, axum::extract::rejection::QueryRejection>) -> ApiResult<T> {
    q.map(|Query(v)| v).map_err(|e| ApiError::invalid(e.body_text()))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "the file's bytes", content_type = "application/octet-stream"),
              (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_get(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let q = query(q)?;
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    let mut chunks = fs.read_stream(&q.path).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Some(chunk) = chunks.recv().await {
            let item = chunk.map(bytes::Bytes::from).map_err(|e| std::io::Error::other(e.message));
            if tx.send(item).await.is_err() {
                return;
            }
        }
    });
    let mut resp = ChannelBody(rx).into_body().into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    Ok(resp)
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_put(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
    body: axum::body::Body,
) -> ApiResult<StatusCode> {
    let q = query(q)?;
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    // The body streams into the sandbox; it is never held whole.
    let feed = tokio::spawn(async move {
        let mut stream = body.into_data_stream();
        while let Some(chunk) =
            std::future::poll_fn(|cx| futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)).await
        {
            match chunk {
                Ok(bytes) => {
                    if tx.send(bytes.to_vec()).await.is_err() {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    });
    let written = fs.write_stream(&q.path, rx).await;
    let fed = feed.await.map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    fed.map_err(|e| ApiError::invalid(format!("request body: {e}")))?;
    written?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/read", params(("id" = String, Path)), request_body = hutch_api::FileRef,
    responses((status = 200, body = hutch_api::FileData), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_read(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<hutch_api::FileRef>,
) -> ApiResult<Json<hutch_api::FileData>> {
    use base64::Engine;
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    let data = fs.read(&req.path).await?;
    Ok(Json(hutch_api::FileData { path: None, data: base64::engine::general_purpose::STANDARD.encode(data) }))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/write", params(("id" = String, Path)), request_body = hutch_api::FileData,
    responses((status = 204), (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_write(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<hutch_api::FileData>,
) -> ApiResult<StatusCode> {
    use base64::Engine;
    let path = req.path.ok_or_else(|| ApiError::invalid("path is required"))?;
    if req.data.len() > hutch_api::FILE_DATA_CAP / 3 * 4 + 4 {
        return Err(ApiError::new(ErrorCode::PayloadTooLarge, "data above 8 MiB"));
    }
    let data = base64::engine::general_purpose::STANDARD
        .decode(req.data.as_bytes())
        .map_err(|_| ApiError::invalid("data is not base64"))?;
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    fs.write(&path, &data).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListFilesQuery {
    /// Directory to list; /workspace when absent.
    path: Option<String>,
    /// Everything below (default true), or only direct entries.
    recursive: Option<bool>,
    include_sha256: Option<bool>,
    /// 1 to 10000 (default 10000).
    limit: Option<u32>,
    cursor: Option<String>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(("id" = String, Path), ListFilesQuery),
    responses((status = 200, body = hutch_api::Listing), (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_list(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    q: Result<Query<ListFilesQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<hutch_api::Listing>> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(10_000);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::invalid("limit must be 1 to 10000"));
    }
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    let opts = hutch_control::files::ListOptions {
        recursive: q.recursive.unwrap_or(true),
        include_sha256: q.include_sha256.unwrap_or(false),
        limit,
        cursor: q.cursor,
    };
    Ok(Json(fs.list(q.path.as_deref().unwrap_or("/workspace"), opts).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/archives", params(("id" = String, Path)),
    request_body(content_type = "multipart/form-data", description = "a `path` field and an `archive` part (tar, gzip detected)"),
    responses((status = 200, body = hutch_api::ArchiveResult), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn archive_upload(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    multipart: Result<axum::extract::Multipart, axum::extract::multipart::MultipartRejection>,
) -> ApiResult<Json<hutch_api::ArchiveResult>> {
    let invalid = |m: String| ApiError::new(ErrorCode::SandboxArchiveInvalid, m);
    let mut multipart = multipart.map_err(|e| invalid(e.body_text()))?;
    let id = sandbox_id(&id)?.to_owned();
    let (mut path, mut archive) = (None, None);
    loop {
        let field = match multipart.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(ApiError::new(ErrorCode::SandboxArchiveTooLarge, "archive above 32 MiB"));
            }
            Err(e) => return Err(invalid(format!("malformed form: {}", e.body_text()))),
        };
        match field.name() {
            Some("path") => path = Some(field.text().await.map_err(|e| invalid(e.body_text()))?),
            Some("archive") => {
                let bytes = field.bytes().await.map_err(|e| {
                    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                        ApiError::new(ErrorCode::SandboxArchiveTooLarge, "archive above 32 MiB")
                    } else {
                        invalid(format!("malformed form: {}", e.body_text()))
                    }
                })?;
                archive = Some(bytes.to_vec());
            }
            _ => {}
        }
    }
    let path = path.ok_or_else(|| invalid("the form has no path field".into()))?;
    let archive = archive.ok_or_else(|| invalid("the form has no archive part".into()))?;
    if archive.len() > hutch_control::files::ARCHIVE_CAP {
        return Err(ApiError::new(ErrorCode::SandboxArchiveTooLarge, "archive above 32 MiB"));
    }
    let fs = app.control.fs(&caller.key_id, &id)?;
    Ok(Json(fs.upload_archive(&path, archive).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/archives", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "a tar of the directory", content_type = "application/x-tar"),
              (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn archive_download(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let q = query(q)?;
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    let tar = fs.download_archive(&q.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], tar).into_response())
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/file-parts", params(("id" = String, Path)), request_body = hutch_api::FilePart,
    responses((status = 200, body = hutch_api::FilePartResult), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn file_part(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    JsonBody(part): JsonBody<hutch_api::FilePart>,
) -> ApiResult<Json<hutch_api::FilePartResult>> {
    let fs = app.control.fs(&caller.key_id, sandbox_id(&id)?)?;
    Ok(Json(fs.put_part(part).await?))
}
