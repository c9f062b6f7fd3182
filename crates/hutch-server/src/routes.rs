//! The native API's routes and their handlers.

use crate::extract::{ApiPath, ApiQuery};
use crate::{idempotency_key, ApiError, ApiResult, App, ChannelBody, JsonBody};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hutch_api::{
    ApiKey, ApiKeyList, CreateGrant, CreateKey, CreateSandbox, ErrorCode, ExecEvent, ExecRequest, ExecutionRequest,
    ExecutionResult, Extend, Grant, GrantSecretRotated, KeyQuotas, ProcessList, Sandbox, SandboxList, SignalRequest,
    StdinRequest, Usage,
};
use hutch_control::exec::ExecReply;
use hutch_control::grants::Operation;
use hutch_control::{OwnerId, SandboxId};
use serde::Deserialize;
use std::sync::Arc;

/// Who is calling: the owner their key makes them.
pub use hutch_control::Caller;

type AppState = State<Arc<App>>;

pub fn router(app: Arc<App>) -> Router {
    router_until(app, tokio_util::sync::CancellationToken::new())
}

/// The router, whose MCP sessions end (keeping their sandboxes) when
/// `stop` is cancelled: the daemon is stopping.
pub(crate) fn router_until(app: Arc<App>, stop: tokio_util::sync::CancellationToken) -> Router {
    let api = Router::new()
        .route("/v1/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route("/v1/sandboxes/{id}", get(get_sandbox).delete(delete_sandbox))
        .route("/v1/sandboxes/{id}/extend", post(extend_sandbox))
        .route("/v1/sandboxes/{id}/suspend", post(suspend_sandbox))
        .route("/v1/sandboxes/{id}/resume", post(resume_sandbox))
        .route("/v1/sandboxes/{id}/metrics", get(sandbox_metrics))
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
        // Uploads stream under their own caps (`UPLOAD_PACKED_CAP`).
        .route(
            "/v1/sandboxes/{id}/archives",
            post(archive_upload).get(archive_download).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/file-parts", post(file_part))
        .route("/v1/keys", get(list_keys).post(create_key))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/nodes/{name}/drain", post(crate::nodes::drain_node))
        .route("/v1/nodes/{name}/undrain", post(crate::nodes::undrain_node))
        .route("/v1/keys/{id}", axum::routing::delete(revoke_key).patch(set_quotas))
        .route("/v1/keys/{id}/grant-secret/rotate", post(rotate_grant_secret))
        .route("/v1/sandboxes/{id}/grants", post(create_grant))
        .route("/v1/usage", get(usage))
        .route("/v1/capabilities", get(capabilities))
        .route("/v1/audit", get(crate::audit::list))
        // The MCP server (streamable HTTP), under the same keys.
        .route_service("/mcp", crate::mcp::service(app.clone(), stop))
        .route_layer(middleware::from_fn_with_state(app.clone(), authenticate));
    // Answers that name a key's things are never stored by a browser or a
    // cache (the web console reads them with the key).
    let native = Router::new()
        .merge(api)
        .merge(crate::templates::router(app.clone()))
        .merge(crate::images::router(app.clone()))
        .merge(crate::access::router(app.clone()))
        .merge(crate::snapshots::router(app.clone()))
        .merge(crate::volumes::router(app.clone()))
        .merge(crate::events::router(app.clone()))
        .merge(crate::secrets::router(app.clone()))
        .layer(middleware::map_response(no_store))
        .layer(middleware::from_fn(server_timing));
    let router = Router::new()
        .merge(native)
        .merge(crate::e2b::router(app.clone()).layer(middleware::from_fn(server_timing)))
        .merge(crate::pty::router(app.clone()))
        .merge(crate::console::router())
        .route("/healthz", get(healthz))
        // An API key or the operator's scrape token (`--metrics-token-file`).
        .route("/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi))
        // The port proxy's path form authenticates with access tokens, not API keys.
        .route("/v1/sandboxes/{id}/ports/{port}", axum::routing::any(crate::proxy::by_path))
        .route("/v1/sandboxes/{id}/ports/{port}/", axum::routing::any(crate::proxy::by_path))
        .route("/v1/sandboxes/{id}/ports/{port}/{*rest}", axum::routing::any(crate::proxy::by_path))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // E2B calls naming a sandbox port other than envd's go into the sandbox.
        .layer(middleware::from_fn_with_state(app.clone(), crate::e2b::by_sandbox_port))
        // Proxy host names are served by the proxy whatever the path.
        .layer(middleware::from_fn_with_state(app.clone(), crate::proxy::by_host))
        // Mutating calls of every API, recorded at their response's start.
        .layer(middleware::from_fn_with_state(app.clone(), crate::audit::layer))
        // Calls for another node's sandboxes, and creates placed elsewhere,
        // are passed to that node before anything here reads them.
        .layer(middleware::from_fn_with_state(app.clone(), crate::fleet::route));
    let router = match app.wake.clone() {
        Some(wake) => router.layer(middleware::from_fn_with_state(wake, crate::wake::layer)),
        None => router,
    };
    router.with_state(app)
}

/// `Cache-Control: no-store` unless the handler said otherwise.
async fn no_store(mut resp: Response) -> Response {
    if !resp.headers().contains_key(header::CACHE_CONTROL) {
        resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    resp
}

/// `Server-Timing` on the native and E2B APIs' answers: the phases the
/// control plane named (hutch_control::timing), then `total`, the time
/// from the request's arrival at the router to its response's headers
/// (for a stream, its start), in milliseconds. Sandbox ports' answers
/// (the proxy) carry none of it.
async fn server_timing(req: Request, next: Next) -> Response {
    let t0 = std::time::Instant::now();
    let phases = hutch_control::timing::Phases::default();
    let mut resp = phases.clone().scope(next.run(req)).await;
    let value = timing_header(&phases.taken(), t0.elapsed());
    if let Ok(v) = HeaderValue::from_str(&value) {
        resp.headers_mut().append(header::HeaderName::from_static("server-timing"), v);
    }
    resp
}

/// `name;dur=ms, ...` (three decimals: microseconds), `total` last.
fn timing_header(phases: &[(&'static str, std::time::Duration)], total: std::time::Duration) -> String {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let mut out = String::new();
    for (name, took) in phases.iter().chain([&("total", total)]) {
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(&format!("{name};dur={:.3}", ms(*took)));
    }
    out
}

/// The credential of `Authorization: Bearer ...` ("" without one).
fn bearer(req: &Request) -> &str {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or("")
}

/// What a request of the native API does, for a grant's check
/// ([`Caller::admit`]): the sandbox routes a grant can name, by their
/// route and method; everything else is `Other`, refused to a grant. A
/// new route is refused to grants until it is named here.
pub(crate) fn operation<'a>(method: &axum::http::Method, route: &str, path: &'a str) -> Operation<'a> {
    use axum::http::Method;
    let Some(rest) = route.strip_prefix("/v1/sandboxes/{id}") else { return Operation::Other };
    let id = path.strip_prefix("/v1/sandboxes/").and_then(|p| p.split('/').next()).unwrap_or("");
    match (method, rest) {
        (&Method::GET, "") => Operation::Read(id),
        (&Method::POST, "/exec")
        | (&Method::GET, "/processes")
        | (&Method::POST, "/processes/{pid}/signal")
        | (&Method::POST, "/processes/{pid}/stdin")
        | (&Method::GET, "/processes/{pid}/stream") => Operation::Exec(id),
        (&Method::GET, "/files")
        | (&Method::POST, "/files/read")
        | (&Method::GET, "/files/list")
        | (&Method::GET, "/archives") => Operation::FilesRead(id),
        (&Method::PUT, "/files")
        | (&Method::POST, "/files/write")
        | (&Method::POST, "/archives")
        | (&Method::POST, "/file-parts") => Operation::FilesWrite(id),
        (&Method::GET, "/pty") => Operation::Pty(id),
        _ => Operation::Other,
    }
}

/// Checks a caller against what its request does (a grant's restriction).
pub(crate) fn admit(caller: &Caller, req: &Request) -> Result<(), ApiError> {
    let route = req.extensions().get::<axum::extract::MatchedPath>().map(|m| m.as_str()).unwrap_or("");
    Ok(caller.admit(operation(req.method(), route, req.uri().path()))?)
}

/// The bearer credential's caller (an API key, or a grant whose scope
/// admits the request), or 401/403.
pub(crate) async fn authenticate(State(app): AppState, mut req: Request, next: Next) -> Response {
    let t0 = std::time::Instant::now();
    let secret = bearer(&req).to_owned();
    let secret = secret.as_str();
    let known = app.control.authenticate_native(secret).await;
    hutch_control::timing::mark("auth", t0);
    match known {
        Ok(Some(caller)) => {
            if let Err(e) = admit(&caller, &req) {
                return crate::transfer::refuse(req, e.into_response()).await;
            }
            crate::listener::authenticated(&req);
            // A grant's calls are its key's, marked as made through a grant.
            let via: &[(&str, &str)] = if caller.grant.is_some() { &[("via", "grant")] } else { &[] };
            crate::audit::identified(&req, &caller.owner, via);
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Ok(None) => {
            // Answered once a small body is read (`transfer::refuse`).
            let e = ApiError::new(ErrorCode::Unauthorized, "a valid API key is required: Authorization: Bearer <key>");
            crate::transfer::refuse(req, e.into_response()).await
        }
        Err(e) => crate::transfer::refuse(req, ApiError::from(e).into_response()).await,
    }
}

async fn not_found(uri: axum::http::Uri) -> Response {
    if let Some(e2b) = crate::e2b::unrouted(uri.path(), false) {
        return e2b;
    }
    ApiError::new(ErrorCode::NotFound, "no such route").into_response()
}

async fn method_not_allowed(uri: axum::http::Uri) -> Response {
    if let Some(e2b) = crate::e2b::unrouted(uri.path(), true) {
        return e2b;
    }
    ApiError::new(ErrorCode::MethodNotAllowed, "this route does not take this method").into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn openapi() -> Response {
    let mut resp = crate::openapi::document().into_response();
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

async fn metrics(State(app): AppState, req: Request) -> ApiResult<Response> {
    let text = app.control.metrics_for(bearer(&req)).await?;
    crate::listener::authenticated(&req);
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

#[utoipa::path(get, path = "/v1/keys",
    responses((status = 200, body = ApiKeyList), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn list_keys(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<ApiKeyList>> {
    Ok(Json(app.control.list_keys(&caller).await?))
}

#[utoipa::path(get, path = "/v1/nodes",
    responses((status = 200, body = hutch_api::NodeList), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn list_nodes(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<hutch_api::NodeList>> {
    Ok(Json(app.control.list_nodes(&caller).await?))
}

#[utoipa::path(post, path = "/v1/keys", request_body = CreateKey,
    responses((status = 201, body = ApiKey, description = "with its secret, shown once"),
              (status = 400, body = hutch_api::ErrorBody), (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn create_key(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    JsonBody(req): JsonBody<CreateKey>,
) -> ApiResult<Response> {
    let key = app.control.create_key(&caller, &req).await?;
    let id = key.id.clone();
    Ok(crate::audit::created((StatusCode::CREATED, Json(key)).into_response(), id))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/grants", params(("id" = String, Path)), request_body = CreateGrant,
    responses((status = 201, body = Grant, description = "with its token, shown once"),
              (status = 400, body = hutch_api::ErrorBody), (status = 403, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn create_grant(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<CreateGrant>,
) -> ApiResult<Response> {
    let grant = app.control.create_grant(&caller, &SandboxId::parse(&id)?, &req).await?;
    Ok((StatusCode::CREATED, Json(grant)).into_response())
}

#[utoipa::path(post, path = "/v1/keys/{id}/grant-secret/rotate", params(("id" = String, Path)),
    responses((status = 200, body = GrantSecretRotated, description = "every earlier grant of the key is refused"),
              (status = 403, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn rotate_grant_secret(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<GrantSecretRotated>> {
    Ok(Json(app.control.rotate_grant_secret(&caller, &OwnerId::parse(&id)?).await?))
}

#[utoipa::path(delete, path = "/v1/keys/{id}", params(("id" = String, Path)),
    responses((status = 204, description = "revoked; its sandboxes are ending"),
              (status = 403, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn revoke_key(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    app.control.revoke_key(&caller, &OwnerId::parse(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(patch, path = "/v1/keys/{id}", params(("id" = String, Path)), request_body = KeyQuotas,
    responses((status = 200, body = ApiKey), (status = 400, body = hutch_api::ErrorBody),
              (status = 403, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn set_quotas(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<KeyQuotas>,
) -> ApiResult<Json<ApiKey>> {
    Ok(Json(app.control.set_key_quotas(&caller, &OwnerId::parse(&id)?, &req).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct UsageQuery {
    /// Another key's id, or `*` for every key's (admin keys only).
    key: Option<String>,
    /// The metered window's start: RFC 3339 or Unix seconds (default: 30
    /// days before `to`).
    from: Option<String>,
    /// Its end, excluded (default: now); at most 400 days after `from`.
    to: Option<String>,
    /// `key` (default), `sandbox`, `template` or `day` (UTC).
    group_by: Option<hutch_api::UsageGroupBy>,
}

#[utoipa::path(get, path = "/v1/usage", params(UsageQuery),
    responses((status = 200, body = Usage), (status = 400, body = hutch_api::ErrorBody,
              description = "`usage_range_invalid`: from/to malformed, to not after from, or over 400 days"),
              (status = 403, body = hutch_api::ErrorBody)))]
pub(crate) async fn usage(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<UsageQuery>,
) -> ApiResult<Json<Usage>> {
    let f = hutch_control::usage::Filter {
        key: q.key.as_deref(),
        from: q.from.as_deref(),
        to: q.to.as_deref(),
        group_by: q.group_by,
    };
    let report = app.control.usage_report(&caller, &f).await?;
    let mut usage = app.control.usage(&caller, q.key.as_deref()).await?;
    usage.from = Some(report.from);
    usage.to = Some(report.to);
    usage.group_by = Some(report.group_by);
    usage.rows = Some(report.rows);
    Ok(Json(usage))
}

#[utoipa::path(get, path = "/v1/capabilities",
    responses((status = 200, body = hutch_api::Capabilities)))]
pub(crate) async fn capabilities(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<hutch_api::Capabilities>> {
    Ok(Json(app.control.capabilities(&caller).await?))
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
    let (sb, created) = app.control.create(&caller, &req, key.as_deref()).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    let id = sb.id.clone();
    Ok(crate::audit::created((status, Json(sb)).into_response(), id))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    limit: Option<u32>,
    cursor: Option<String>,
    /// Another owner's (a key id), or `*` for every owner's: admin keys only.
    owner: Option<String>,
    /// `true`: only sandboxes not yet terminated.
    live: Option<bool>,
}

#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), (status = 400, body = hutch_api::ErrorBody)))]
pub(crate) async fn list_sandboxes(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SandboxList>> {
    Ok(Json(
        app.control.list(&caller, q.owner.as_deref(), q.limit, q.cursor.as_deref(), q.live.unwrap_or(false)).await?,
    ))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn get_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.get(&caller, &SandboxId::parse(&id)?).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn delete_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.delete(&caller, &SandboxId::parse(&id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/extend", params(("id" = String, Path)), request_body = Extend,
    responses((status = 200, body = Sandbox), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn extend_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<Extend>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.extend(&caller, &SandboxId::parse(&id)?, &req, false).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/suspend", params(("id" = String, Path)), request_body = hutch_api::Suspend,
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn suspend_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<hutch_api::Suspend>,
) -> ApiResult<Json<Sandbox>> {
    let mode = req.mode.unwrap_or(hutch_api::SuspendMode::Memory);
    Ok(Json(app.control.suspend(&caller, &SandboxId::parse(&id)?, mode).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody)))]
pub(crate) async fn resume_sandbox(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.control.resume(&caller, &SandboxId::parse(&id)?).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct MetricsQuery {
    /// Only samples taken at or after this Unix second.
    since: Option<i64>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics", params(("id" = String, Path), MetricsQuery),
    responses((status = 200, body = hutch_api::SandboxMetrics), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn sandbox_metrics(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> ApiResult<Json<hutch_api::SandboxMetrics>> {
    if q.since.is_some_and(|s| s < 0) {
        return Err(ApiError::invalid("since must be a Unix time in seconds"));
    }
    let samples = app.control.metrics_history(&caller, &SandboxId::parse(&id)?, q.since, None).await?;
    let samples = samples
        .into_iter()
        .map(|m| hutch_api::MetricSample {
            at: hutch_control::control::rfc3339(m.at_ms),
            cpu_count: m.cpu_count,
            cpu_used_pct: m.cpu_used_pct,
            mem_used_bytes: m.mem_used,
            mem_total_bytes: m.mem_total,
            mem_cache_bytes: m.mem_cache,
            disk_used_bytes: m.disk_used,
            disk_total_bytes: m.disk_total,
        })
        .collect();
    Ok(Json(hutch_api::SandboxMetrics { samples }))
}

fn wants_ndjson(headers: &HeaderMap) -> bool {
    headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains("application/x-ndjson"))
}

/// Streams events as NDJSON, one flushed line each.
pub(crate) fn ndjson<T: serde::Serialize + Send + 'static>(mut rx: tokio::sync::mpsc::Receiver<T>) -> Response {
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
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<ExecRequest>,
) -> ApiResult<Response> {
    let id = SandboxId::parse(&id)?;
    let key = idempotency_key(&headers)?;
    if wants_ndjson(&headers) && !req.background.unwrap_or(false) {
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let control = app.control.clone();
        let mut task = tokio::spawn(async move { control.exec(&caller, &id, &req, key.as_deref(), Some(tx)).await });
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
        let done = task.await?;
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
            let exit = r.exit_event();
            for ev in [ExecEvent::Stdout { data: r.stdout }, ExecEvent::Stderr { data: r.stderr }, exit] {
                let _ = out_tx.try_send(ev);
            }
        }
        return Ok(ndjson(out_rx));
    }
    match app.control.exec(&caller, &id, &req, key.as_deref(), None).await? {
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
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<ProcessList>> {
    Ok(Json(app.control.processes(&caller, &SandboxId::parse(&id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/signal", params(("id" = String, Path), ("pid" = u32, Path)),
    request_body = SignalRequest,
    responses((status = 204), (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn signal(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    JsonBody(req): JsonBody<SignalRequest>,
) -> ApiResult<StatusCode> {
    app.control.signal(&caller, &SandboxId::parse(&id)?, pid, &req.signal).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/stdin", params(("id" = String, Path), ("pid" = u32, Path)),
    request_body = StdinRequest,
    responses((status = 204), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn stdin(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    JsonBody(req): JsonBody<StdinRequest>,
) -> ApiResult<StatusCode> {
    let mut data = req.data.into_bytes();
    if let Some(b64) = &req.data_base64 {
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| ApiError::new(ErrorCode::InvalidRequest, "data_base64 is not base64 (standard, padded)"))?;
        data.extend_from_slice(&bytes);
    }
    app.control.stdin(&caller, &SandboxId::parse(&id)?, pid, &data, req.eof).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{pid}/stream", params(("id" = String, Path), ("pid" = u32, Path)),
    responses((status = 200, description = "NDJSON stream of ExecEvent"), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn stream(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
) -> ApiResult<Response> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    app.control.attach(&caller, &SandboxId::parse(&id)?, pid, tx).await?;
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
    Ok(Json(app.control.execution(&caller, &req, key.as_deref()).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct PathQuery {
    /// Absolute, or relative to /workspace.
    path: String,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "the file's bytes", content_type = "application/octet-stream"),
              (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_get(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Response> {
    let fs = app.control.fs(&caller, &SandboxId::parse(&id)?).await?;
    let chunks = fs.read_stream(&q.path).await?;
    let mut resp = crate::transfer::body_of(chunks).into_response();
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
    ApiPath(id): ApiPath<String>,
    q: Result<axum::extract::Query<PathQuery>, axum::extract::rejection::QueryRejection>,
    req: Request,
) -> Response {
    // Refused before the body was read: answered once a small one is read.
    let checked = match (q, SandboxId::parse(&id)) {
        (Ok(axum::extract::Query(q)), Ok(sid)) => {
            app.control.fs(&caller, &sid).await.map(|fs| (q, fs)).map_err(ApiError::from)
        }
        (Err(e), _) => Err(ApiError::invalid(e.body_text())),
        (_, Err(e)) => Err(e.into()),
    };
    let (q, fs) = match checked {
        Ok(v) => v,
        Err(e) => return crate::transfer::refuse(req, e.into_response()).await,
    };
    // The body streams into the sandbox; it is never held whole, and a
    // body that breaks leaves nothing.
    let (chunks, feed) = crate::transfer::chunks_of(req.into_body());
    let (written, whole) = crate::transfer::with_feed(feed, fs.write_stream(&q.path, chunks)).await;
    let resp = match written {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => ApiError::from(e).into_response(),
    };
    crate::transfer::close_unless(whole, resp)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/read", params(("id" = String, Path)), request_body = hutch_api::FileRef,
    responses((status = 200, body = hutch_api::FileData), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_read(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    JsonBody(req): JsonBody<hutch_api::FileRef>,
) -> ApiResult<Response> {
    let fs = app.control.fs(&caller, &SandboxId::parse(&id)?).await?;
    // Checked against the cap first, then encoded as it is read.
    let chunks = fs.read_capped(&req.path).await?;
    let mut resp = crate::transfer::base64_json_of(chunks).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(resp)
}

/// The body of `files/write`, borrowed from the request's bytes: the base64
/// is not copied, and it is decoded a piece at a time.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDataIn<'a> {
    #[serde(default, borrow)]
    path: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    data: std::borrow::Cow<'a, str>,
}

/// The body of `file-parts`, borrowed likewise.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePartIn<'a> {
    #[serde(borrow)]
    path: std::borrow::Cow<'a, str>,
    offset: u64,
    size: u64,
    #[serde(borrow)]
    sha256: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    data: std::borrow::Cow<'a, str>,
}

/// A JSON object body's bytes, bounded and checked as `JsonBody` checks them.
async fn json_bytes(req: Request) -> ApiResult<bytes::Bytes> {
    crate::json_object_bytes(req).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/write", params(("id" = String, Path)), request_body = hutch_api::FileData,
    responses((status = 204), (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody),
              (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn files_write(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> ApiResult<StatusCode> {
    let bytes = json_bytes(req).await?;
    let req: FileDataIn<'_> = serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("body: {e}")))?;
    let path = req.path.ok_or_else(|| ApiError::invalid("path is required"))?;
    if req.data.len() > hutch_api::FILE_DATA_CAP / 3 * 4 + 4 {
        return Err(ApiError::new(ErrorCode::PayloadTooLarge, "data above 8 MiB"));
    }
    let fs = app.control.fs(&caller, &SandboxId::parse(&id)?).await?;
    fs.write_base64(&path, &req.data).await?;
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
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ListFilesQuery>,
) -> ApiResult<Json<hutch_api::Listing>> {
    let limit = q.limit.unwrap_or(10_000);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::invalid("limit must be 1 to 10000"));
    }
    let fs = app.control.fs(&caller, &SandboxId::parse(&id)?).await?;
    let opts = hutch_control::files::ListOptions {
        recursive: q.recursive.unwrap_or(true),
        include_sha256: q.include_sha256.unwrap_or(false),
        limit,
        cursor: q.cursor,
    };
    Ok(Json(fs.list(q.path.as_deref().unwrap_or("/workspace"), opts).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/archives", params(("id" = String, Path)),
    request_body(content_type = "multipart/form-data", description = "a `path` field, then an `archive` part (tar, gzip detected)"),
    responses((status = 200, body = hutch_api::ArchiveResult), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn archive_upload(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> Response {
    use axum::extract::FromRequest;
    use hutch_control::files::{pipe, FilesError, UPLOAD_PACKED_CAP};
    let sid = match SandboxId::parse(&id) {
        Ok(sid) => sid,
        Err(e) => return crate::transfer::refuse(req, ApiError::from(e).into_response()).await,
    };
    let fs = match app.control.fs(&caller, &sid).await {
        Ok(fs) => fs,
        Err(e) => return crate::transfer::refuse(req, ApiError::from(e).into_response()).await,
    };
    // Form-level trouble reads as a refused archive; limits as too large.
    let archive_err = |e: FilesError| match e.code {
        ErrorCode::PayloadTooLarge | ErrorCode::SandboxArchiveTooLarge => {
            ApiError::new(ErrorCode::SandboxArchiveTooLarge, e.message)
        }
        ErrorCode::InvalidRequest => ApiError::new(ErrorCode::SandboxArchiveInvalid, e.message),
        _ => ApiError::from(e),
    };
    let (parts, body) = req.into_parts();
    let (wire, feed) = crate::transfer::chunks_of(body);
    let wire = pipe::cap(wire, UPLOAD_PACKED_CAP + (1 << 20), "the form");
    let tap = crate::transfer::FormTap::default();
    let form = Request::from_parts(parts, tap.body(wire));
    let work = async {
        let mut form = axum::extract::Multipart::from_request(form, &())
            .await
            .map_err(|e| ApiError::new(ErrorCode::SandboxArchiveInvalid, e.body_text()))?;
        let mut path = None;
        loop {
            let field = match form.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(archive_err(tap.malformed(e))),
            };
            match field.name() {
                Some("path") => path = Some(tap.text(field, 4096).await.map_err(archive_err)?),
                Some("archive") => {
                    // Streamed into the sandbox as it arrives: the path
                    // must be known by then.
                    let Some(path) = path.take() else {
                        return Err(ApiError::new(
                            ErrorCode::SandboxArchiveInvalid,
                            "the form's path field must come before its archive part",
                        ));
                    };
                    let (chunks, part_feed) = tap.part(field);
                    let done = crate::transfer::with_part(part_feed, fs.upload_archive_stream(&path, chunks)).await;
                    return done.map_err(archive_err);
                }
                _ => tap.skip(field).await.map_err(archive_err)?,
            }
        }
        let missing = if path.is_some() { "the form has no archive part" } else { "the form has no path field" };
        Err(ApiError::new(ErrorCode::SandboxArchiveInvalid, missing))
    };
    let (done, whole) = crate::transfer::with_feed(feed, work).await;
    let resp = match done {
        Ok(result) => Json(result).into_response(),
        Err(e) => e.into_response(),
    };
    crate::transfer::close_unless(whole, resp)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/archives", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "a tar of the directory, streamed; an error after the first byte cuts it short", content_type = "application/x-tar"),
              (status = 400, body = hutch_api::ErrorBody), (status = 404, body = hutch_api::ErrorBody)))]
pub(crate) async fn archive_download(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Response> {
    let fs = app.control.fs(&caller, &SandboxId::parse(&id)?).await?;
    let chunks = fs.download_archive(&q.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], crate::transfer::body_of(chunks)).into_response())
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/file-parts", params(("id" = String, Path)), request_body = hutch_api::FilePart,
    responses((status = 200, body = hutch_api::FilePartResult), (status = 400, body = hutch_api::ErrorBody),
              (status = 404, body = hutch_api::ErrorBody), (status = 409, body = hutch_api::ErrorBody), (status = 413, body = hutch_api::ErrorBody)))]
pub(crate) async fn file_part(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> ApiResult<Json<hutch_api::FilePartResult>> {
    let bytes = json_bytes(req).await?;
    let part: FilePartIn<'_> = serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("body: {e}")))?;
    let fs = app.control.fs(&caller, &SandboxId::parse(&id)?).await?;
    let part = hutch_control::files::PartRef {
        path: &part.path,
        offset: part.offset,
        size: part.size,
        sha256: &part.sha256,
        data: &part.data,
    };
    Ok(Json(fs.put_part_base64(part).await?))
}

#[cfg(test)]
mod tests {
    use super::timing_header;
    use std::time::Duration;

    #[test]
    fn server_timing_names_phases_then_total_in_ms() {
        let phases = [("admit", Duration::from_micros(250)), ("start", Duration::from_micros(1500))];
        assert_eq!(
            timing_header(&phases, Duration::from_millis(2)),
            "admit;dur=0.250, start;dur=1.500, total;dur=2.000"
        );
        assert_eq!(timing_header(&[], Duration::from_micros(1)), "total;dur=0.001");
    }
}
