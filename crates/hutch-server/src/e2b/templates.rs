//! E2B's template routes, as the SDK's `Template` builder calls them:
//! `POST /v3/templates`, `GET /templates/{id}/files/{hash}` and the signed
//! upload it hands out, `POST /v2/templates/{id}/builds/{build}`, build
//! status, aliases and tags. Parsing and rendering only: the control plane
//! (`hutch_control::build::e2b`) maps them onto hutch's templates and
//! builds.

use super::{E2bError, E2bPath as ApiPath, E2bQuery as ApiQuery};
use crate::routes::Caller;
use crate::App;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use hutch_control::build::e2b::{self as tpl, BuildRequest, BuildSpec};
use hutch_control::control::rfc3339;
use hutch_control::ControlError;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

type AppState = State<Arc<App>>;
type E2bResult<T> = Result<T, E2bError>;

/// Most log entries one status answer carries (E2B's default).
const STATUS_LIMIT: usize = 100;

/// The routes behind the API key (merged into the control router).
pub fn keyed() -> Router<Arc<App>> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/templates/{id}/files/{hash}", get(files))
        .route("/v2/templates/{id}/builds/{build}", post(start_build))
        .route("/templates/{id}/builds/{build}/status", get(status))
        .route("/templates/aliases/{alias}", get(alias))
        .route("/templates/tags", post(assign_tags).delete(remove_tags))
        .route("/templates/{id}/tags", get(list_tags))
}

/// The signed upload, which carries no key (the URL's signature is the
/// credential, as E2B's storage URLs are).
pub fn unkeyed() -> Router<Arc<App>> {
    Router::new().route("/templates/{id}/files/{hash}/upload", put(upload))
}

async fn json_body<T: serde::de::DeserializeOwned + Default>(req: Request) -> E2bResult<T> {
    let bytes = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .map_err(|_| E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, "body above 1 MiB"))?;
    if bytes.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("body: {e}")))
}

/// Unknown templates and builds in E2B's words.
fn refusal(e: ControlError) -> E2bError {
    match e {
        ControlError::NoTemplate(t) | ControlError::UnknownTemplate(t) => {
            E2bError::new(StatusCode::NOT_FOUND, format!("template '{t}' not found"))
        }
        ControlError::NoBuild(b) => E2bError::new(StatusCode::NOT_FOUND, format!("build '{b}' not found")),
        e => E2bError::from(e),
    }
}

async fn request_build(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    req: Request,
) -> E2bResult<Response> {
    let body: BuildRequest = json_body(req).await?;
    let r = app.control.e2b_request_build(&caller, &body).await.map_err(refusal)?;
    let answer = json!({
        "templateID": r.template_id,
        "buildID": tpl::wire_build_id(&r.build_id),
        "public": false,
        "names": [r.name],
        "aliases": [r.name],
        "tags": r.tags,
    });
    Ok((StatusCode::ACCEPTED, Json(answer)).into_response())
}

/// The scheme and host the client reached us at: an upload URL is made of
/// them (it is the caller's own, so nothing is trusted by using them).
fn origin(headers: &HeaderMap) -> String {
    let host = super::header(headers, "host").unwrap_or("127.0.0.1");
    let https = super::header(headers, "x-forwarded-proto").is_some_and(|p| p.eq_ignore_ascii_case("https"));
    format!("{}://{host}", if https { "https" } else { "http" })
}

async fn files(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    ApiPath((id, hash)): ApiPath<(String, String)>,
) -> E2bResult<Response> {
    let answer = match app.control.e2b_files(&caller, &id, &hash).await.map_err(refusal)? {
        None => json!({"present": true}),
        Some(path) => json!({"present": false, "url": format!("{}{path}", origin(&headers))}),
    };
    Ok((StatusCode::CREATED, Json(answer)).into_response())
}

#[derive(Deserialize)]
struct UploadQuery {
    expires: i64,
    signature: String,
}

async fn upload(
    State(app): AppState,
    ApiPath((id, hash)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    req: Request,
) -> Response {
    // The signature is the credential: checked before the body is read
    // (a refusal is answered once a small body is read and dropped).
    if let Err(e) = app.control.e2b_upload_authorized(&id, &hash, q.expires, &q.signature).await {
        return crate::transfer::refuse(req, E2bError::from(e).into_response()).await;
    }
    crate::listener::authenticated(&req);
    let (chunks, feed) = crate::transfer::chunks_of(req.into_body());
    let work = app.control.e2b_upload(&id, &hash, q.expires, &q.signature, chunks);
    let (result, whole) = crate::transfer::with_feed(feed, work).await;
    let resp = match result {
        Ok(()) => StatusCode::OK.into_response(),
        Err(ControlError::Files(e)) if e.code == hutch_api::ErrorCode::PayloadTooLarge => {
            E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, e.message).into_response()
        }
        Err(e) => E2bError::from(e).into_response(),
    };
    crate::transfer::close_unless(whole, resp)
}

async fn start_build(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, build)): ApiPath<(String, String)>,
    req: Request,
) -> E2bResult<StatusCode> {
    let spec: BuildSpec = json_body(req).await?;
    app.control.e2b_start_build(&caller, &id, &build, &spec).await.map_err(refusal)?;
    Ok(StatusCode::ACCEPTED)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatusQuery {
    logs_offset: Option<usize>,
    limit: Option<usize>,
    /// The least level shown: `debug`, `info`, `warn` or `error`.
    level: Option<String>,
}

fn log_entry(l: &tpl::LogLine) -> Value {
    json!({"timestamp": rfc3339(l.at_ms), "level": l.level, "message": l.message})
}

async fn status(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath((id, build)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<StatusQuery>,
) -> E2bResult<Json<Value>> {
    let limit = q.limit.unwrap_or(STATUS_LIMIT).min(STATUS_LIMIT);
    let errors_only = match q.level.as_deref() {
        None | Some("debug" | "info" | "warn") => false,
        Some("error") => true,
        Some(other) => return Err(E2bError::new(StatusCode::BAD_REQUEST, format!("unknown level {other:?}"))),
    };
    let s =
        app.control.e2b_build_status(&caller, &id, &build, q.logs_offset.unwrap_or(0), limit).await.map_err(refusal)?;
    let entries: Vec<Value> = s.entries.iter().filter(|l| !errors_only || l.level == "error").map(log_entry).collect();
    let mut v = json!({
        "templateID": s.template_id,
        "buildID": tpl::wire_build_id(&s.build_id),
        "status": s.status,
        "logs": [],
        "logEntries": entries,
    });
    if let Some((message, step)) = s.reason {
        let mut r = json!({"message": message});
        if let Some(step) = step {
            r["step"] = json!(step);
        }
        v["reason"] = r;
    }
    Ok(Json(v))
}

async fn alias(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(alias): ApiPath<String>,
) -> E2bResult<Json<Value>> {
    let id = app.control.e2b_alias(&caller, &alias).await.map_err(refusal)?;
    Ok(Json(json!({"templateID": id, "public": false})))
}

#[derive(Deserialize, Default)]
struct AssignTags {
    #[serde(default)]
    target: String,
    #[serde(default)]
    tags: Vec<String>,
}

#[derive(Deserialize, Default)]
struct RemoveTags {
    #[serde(default)]
    name: String,
    #[serde(default)]
    tags: Vec<String>,
}

async fn assign_tags(State(app): AppState, Extension(caller): Extension<Caller>, req: Request) -> E2bResult<Response> {
    let body: AssignTags = json_body(req).await?;
    let build = app.control.e2b_assign_tags(&caller, &body.target, &body.tags).await.map_err(refusal)?;
    let answer = json!({"tags": body.tags, "buildID": tpl::wire_build_id(&build)});
    Ok((StatusCode::CREATED, Json(answer)).into_response())
}

async fn remove_tags(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    req: Request,
) -> E2bResult<StatusCode> {
    let body: RemoveTags = json_body(req).await?;
    app.control.e2b_remove_tags(&caller, &body.name, &body.tags).await.map_err(refusal)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_tags(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<Json<Value>> {
    let tags = app.control.e2b_list_tags(&caller, &id).await.map_err(refusal)?;
    let list: Vec<Value> = tags
        .iter()
        .map(|t| json!({"tag": t.tag, "buildID": tpl::wire_build_id(&t.build_id), "createdAt": rfc3339(t.at_ms)}))
        .collect();
    Ok(Json(Value::Array(list)))
}
