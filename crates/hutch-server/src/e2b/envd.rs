//! envd's API inside a sandbox, answered by the daemon: the sandbox headers
//! and access token, `/health`, `/files` (download; multipart and
//! octet-stream uploads, gzip; signed URLs; `X-Metadata-*` headers as
//! `user.e2b.*` xattrs) and the `filesystem.Filesystem` RPCs. Paths
//! and commands run as the user of `Authorization: Basic` (default `user`),
//! relative paths against that user's home.

use super::connect::{self, unary, unary_error, unary_request};
use super::{E2bError, EnvdError};
use crate::App;
use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use base64::Engine;
use hutch_api::ErrorCode;
use hutch_control::e2b::{Operation, SignedUrl};
use hutch_control::fileops::{META_BYTES, META_KEYS};
use hutch_control::files::{pipe, Chunks, SandboxFs};
use hutch_control::session::{Entry, EntryKind, EnvdSession};
use hutch_control::{ControlError, SandboxId};
use serde::Deserialize;
use serde_json::{json, Value};

use std::collections::BTreeMap;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// Who an envd call acts for: a session the control plane made.
pub type Envd = EnvdSession;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/health", get(health))
        // Uploads stream under their own caps (`UPLOAD_CAP`).
        .route("/files", get(download).post(upload).layer(axum::extract::DefaultBodyLimit::disable()))
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .merge(connect::routes())
        .merge(super::watch::routes())
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

/// The user named by `Authorization: Basic base64(user:)`, if any.
pub(crate) fn basic_user(headers: &HeaderMap) -> Result<Option<String>, E2bError> {
    let Some(v) = super::header(headers, "authorization") else { return Ok(None) };
    let bad = || E2bError::new(StatusCode::BAD_REQUEST, "Authorization must be Basic base64(user:)");
    let b64 = v.strip_prefix("Basic ").ok_or_else(bad)?;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let user = text.split(':').next().unwrap_or("");
    Ok((!user.is_empty()).then(|| user.to_owned()))
}

/// The signed-URL parameters of a `/files` request.
#[derive(Deserialize, Default)]
struct SignedQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<String>,
}

/// The signature parameters of a `/files` request without a token, if any.
pub(crate) fn signed_url(req: &Request) -> Result<Option<SignedUrl>, E2bError> {
    if req.uri().path() != "/files" {
        return Ok(None);
    }
    let Ok(Query(q)) = Query::<SignedQuery>::try_from_uri(req.uri()) else { return Ok(None) };
    let Some(signature) = q.signature else { return Ok(None) };
    let operation = if req.method() == axum::http::Method::GET { Operation::Read } else { Operation::Write };
    let expiration = match q.signature_expiration.as_deref() {
        None => None,
        Some(e) => Some(
            e.parse::<i64>()
                .map_err(|_| E2bError::new(StatusCode::BAD_REQUEST, "signature_expiration must be a unix timestamp"))?,
        ),
    };
    Ok(Some(SignedUrl {
        path: q.path.unwrap_or_default(),
        operation,
        username: q.username.unwrap_or_default(),
        signature,
        expiration,
    }))
}

/// The sandbox a request names: its `E2b-Sandbox-Id` header, or E2B's host
/// form `<port>-<id>.<domain>`.
pub(crate) fn named_sandbox(headers: &HeaderMap) -> Option<SandboxId> {
    let named = super::header(headers, "e2b-sandbox-id").map(str::to_owned).or_else(|| {
        let host = super::header(headers, "host")?;
        let (first, _) = host.split_once('.')?;
        let (port, id) = first.split_once('-')?;
        port.parse::<u16>().ok()?;
        Some(id.to_owned())
    })?;
    SandboxId::parse(&named).ok()
}

/// A refused envd call, as E2B's proxy and envd answer it: a sandbox that
/// is gone is 502 "was not found".
pub(super) fn refused(e: ControlError, id: Option<&SandboxId>) -> Response {
    match e {
        ControlError::NoSandbox(_) => {
            let id = id.map(SandboxId::to_string).unwrap_or_default();
            let body = json!({"code": 502, "message": format!("The sandbox {id} was not found"), "sandboxId": id});
            (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
        }
        ControlError::Unauthorized(m) => E2bError::new(StatusCode::UNAUTHORIZED, m).into_response(),
        e => E2bError::from(e).into_response(),
    }
}

/// Checks the sandbox headers and token, or a `/files` URL's signature,
/// through the control plane (which also checks the owner's key is live).
/// A refusal is answered once the request's body is read and dropped
/// (bounded: [`crate::transfer::refuse`]), so that a client streaming an
/// upload to a wrong token or signature reads the refusal.
async fn authenticate(State(app): AppState, mut req: Request, next: Next) -> Response {
    let headers = req.headers();
    let basic = match basic_user(headers) {
        Ok(u) => u,
        Err(e) => return crate::transfer::refuse(req, e.into_response()).await,
    };
    let named = named_sandbox(headers);
    let session = match super::header(headers, "x-access-token") {
        Some(token) => match named.clone() {
            Some(id) => {
                let token = token.to_owned();
                app.control.envd_by_token(&id, &token, basic.as_deref().unwrap_or("user")).await.map_err(Some)
            }
            None => Err(None),
        },
        None => match signed_url(&req) {
            Ok(Some(signed)) => {
                app.control.envd_by_signature(named.as_ref(), &signed, basic.as_deref()).await.map_err(Some)
            }
            Ok(None) if named.is_none() && super::header(req.headers(), "e2b-sandbox-id").is_none() => Err(None),
            Ok(None) => Err(Some(ControlError::Unauthorized("a valid X-Access-Token is required"))),
            Err(e) => return crate::transfer::refuse(req, e.into_response()).await,
        },
    };
    match session {
        Ok(s) => {
            crate::listener::authenticated(&req);
            crate::audit::identified(&req, s.owner(), &[("sandbox", s.sandbox().as_str())]);
            req.extensions_mut().insert(s);
            next.run(req).await
        }
        Err(Some(e)) => crate::transfer::refuse(req, refused(e, named.as_ref())).await,
        Err(None) => {
            let e = E2bError::new(StatusCode::BAD_REQUEST, "the E2b-Sandbox-Id header is required");
            crate::transfer::refuse(req, e.into_response()).await
        }
    }
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// An error of the `/files` routes: `{"code": status, "message"}`.
fn http_error(e: EnvdError) -> Response {
    let (_, status) = e.connect();
    let status = if e.code == ErrorCode::SandboxPathConflict { StatusCode::BAD_REQUEST } else { status };
    let status = if e.code == ErrorCode::SandboxDiskFull { StatusCode::INSUFFICIENT_STORAGE } else { status };
    let status = if e.code == ErrorCode::PayloadTooLarge { StatusCode::PAYLOAD_TOO_LARGE } else { status };
    E2bError { code: Some(e.code), ..E2bError::new(status, e.message) }.into_response()
}

async fn fs_for(app: &App, ctx: &Envd) -> Result<hutch_control::files::SandboxFs, EnvdError> {
    Ok(app.control.envd_fs(ctx).await?)
}

#[derive(Deserialize, Default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

/// The context with the `username` query parameter, if given, as the user.
fn with_user(ctx: &Envd, username: Option<&str>) -> Result<Envd, EnvdError> {
    match username.filter(|u| !u.is_empty()) {
        Some(u) => Ok(ctx.as_user(u)?),
        None => Ok(ctx.clone()),
    }
}

async fn download(
    State(app): AppState,
    Extension(ctx): Extension<Envd>,
    super::E2bQuery(q): super::E2bQuery<FileQuery>,
) -> Response {
    let run = async {
        let ctx = with_user(&ctx, q.username.as_deref())?;
        let path = ctx.resolve(q.path.as_deref().unwrap_or(""))?;
        let fs = fs_for(&app, &ctx).await?;
        let chunks = fs.read_stream(&path).await?;
        Ok::<_, EnvdError>(chunks)
    };
    let chunks = match run.await {
        Ok(c) => c,
        Err(e) => return http_error(e),
    };
    let mut resp = crate::transfer::body_of(chunks).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    resp
}

/// The `X-Metadata-*` headers as `user.e2b.*` xattrs (header names arrive
/// lowercased, so keys are lowercased, as envd does).
fn metadata_attrs(headers: &HeaderMap) -> Result<BTreeMap<String, String>, EnvdError> {
    let mut attrs = BTreeMap::new();
    let mut total = 0;
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else { continue };
        let bad = |why: &str| EnvdError::new(ErrorCode::InvalidRequest, format!("metadata key {key:?}: {why}"));
        if key.is_empty() {
            return Err(bad("must not be empty"));
        }
        let value = value.to_str().map_err(|_| bad("the value must be printable ASCII"))?;
        total += key.len() + value.len();
        if attrs.len() >= META_KEYS || total > META_BYTES {
            return Err(EnvdError::new(
                ErrorCode::InvalidRequest,
                format!("metadata is limited to {META_KEYS} keys and {META_BYTES} bytes"),
            ));
        }
        attrs.insert(key.to_owned(), value.to_owned());
    }
    Ok(attrs)
}

/// The E2B metadata of an entry; empty when it has none or they cannot be
/// read (a file the user may not open).
async fn metadata_of(app: &App, ctx: &Envd, path: &str) -> Value {
    let meta = app.control.fs_metadata(ctx, path).await;
    Value::Object(meta.into_iter().map(|(k, v)| (k, Value::String(v))).collect())
}

/// Writes one file from `data` with its metadata, making its missing
/// parent directories, as the user.
async fn write_one(
    app: &App,
    ctx: &Envd,
    fs: &SandboxFs,
    path: &str,
    data: Chunks,
    meta: &BTreeMap<String, String>,
) -> Result<Value, EnvdError> {
    let path = ctx.resolve(path)?;
    if let Some((parent, _)) = path.rsplit_once('/') {
        if !parent.is_empty() {
            app.control.fs_mkdir(ctx, parent).await?;
        }
    }
    fs.write_stream(&path, data).await?;
    if !meta.is_empty() {
        app.control.fs_set_metadata(ctx, &path, meta).await?;
    }
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    let metadata: serde_json::Map<String, Value> =
        meta.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    Ok(json!({"name": name, "type": "file", "path": path, "metadata": metadata}))
}

/// Writes the files of a multipart form read from `body` (already inflated):
/// each part streams into its file as it arrives.
async fn write_form(
    app: &App,
    ctx: &Envd,
    fs: &SandboxFs,
    path: Option<&str>,
    parts: axum::http::request::Parts,
    body: Chunks,
    meta: &BTreeMap<String, String>,
) -> Result<Vec<Value>, EnvdError> {
    let tap = crate::transfer::FormTap::default();
    let form = Request::from_parts(parts, tap.body(body));
    let mut form = axum::extract::Multipart::from_request(form, &())
        .await
        .map_err(|e| EnvdError::new(ErrorCode::InvalidRequest, e.body_text()))?;
    let mut written = Vec::new();
    loop {
        let field = match form.next_field().await {
            Ok(f) => f,
            Err(e) => return Err(tap.malformed(e).into()),
        };
        let Some(field) = field else { break };
        let target = match (path, field.file_name()) {
            (Some(p), _) => p.to_owned(),
            (None, Some(n)) => n.to_owned(),
            (None, None) => return Err(EnvdError::new(ErrorCode::InvalidRequest, "a file part has no name")),
        };
        let (chunks, feed) = tap.part(field);
        written.push(crate::transfer::with_part(feed, write_one(app, ctx, fs, &target, chunks, meta)).await?);
    }
    Ok(written)
}

/// Most bytes one upload may carry, as sent and once inflated: a file of the
/// files API's cap, with room for a form's framing. A gzip body that
/// inflates past it is refused with 413, having cost a bounded buffer.
const UPLOAD_CAP: u64 = hutch_control::files::FILE_CAP + (1 << 20);

/// `POST /files`: a multipart form of files, or one file as the raw body
/// (`application/octet-stream`), optionally `Content-Encoding: gzip`. The
/// body streams into the sandbox (inflated on a thread of its own); it is
/// never held whole.
async fn upload(
    State(app): AppState,
    Extension(ctx): Extension<Envd>,
    super::E2bQuery(q): super::E2bQuery<FileQuery>,
    req: Request,
) -> Response {
    // What the headers and query say, read before anything waits (a
    // borrowed request cannot be held across an await).
    let params = (|| {
        let ctx = with_user(&ctx, q.username.as_deref())?;
        let headers = req.headers();
        let multipart = super::header(headers, "content-type").unwrap_or("").starts_with("multipart/form-data");
        let encoding = super::header(headers, "content-encoding").unwrap_or("").trim().to_ascii_lowercase();
        let gzip = match encoding.as_str() {
            "" | "identity" => false,
            "gzip" | "x-gzip" => true,
            other => {
                return Err(EnvdError::new(
                    ErrorCode::InvalidRequest,
                    format!("Content-Encoding {other:?} is not supported: send gzip or none"),
                ))
            }
        };
        let meta = metadata_attrs(headers)?;
        if !multipart && q.path.is_none() {
            return Err(EnvdError::new(ErrorCode::InvalidRequest, "path is required"));
        }
        Ok::<_, EnvdError>((ctx, multipart, gzip, meta))
    })();
    let checked = match params {
        Ok((ctx, multipart, gzip, meta)) => fs_for(&app, &ctx).await.map(|fs| (ctx, multipart, gzip, meta, fs)),
        Err(e) => Err(e),
    };
    let (ctx, multipart, gzip, meta, fs) = match checked {
        Ok(v) => v,
        // Refused before the body was looked at.
        Err(e) => return crate::transfer::refuse(req, http_error(e)).await,
    };
    let (parts, body) = req.into_parts();
    let (wire, feed) = crate::transfer::chunks_of(body);
    let wire = pipe::cap(wire, UPLOAD_CAP, "the upload");
    let run = async {
        let plain = if gzip { pipe::inflate(wire, UPLOAD_CAP)? } else { wire };
        if multipart {
            write_form(&app, &ctx, &fs, q.path.as_deref(), parts, plain, &meta).await
        } else {
            let path = q.path.as_deref().unwrap_or_default();
            Ok(vec![write_one(&app, &ctx, &fs, path, plain, &meta).await?])
        }
    };
    match crate::transfer::with_feed(feed, run).await {
        (Ok(v), whole) => crate::transfer::close_unless(whole, axum::Json(Value::Array(v)).into_response()),
        (Err(e), whole) => crate::transfer::close_unless(whole, http_error(e)),
    }
}

use axum::extract::FromRequest;

/// `-rwxr-xr-x` for a mode and kind.
fn permissions(kind: EntryKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        EntryKind::Dir => 'd',
        EntryKind::Symlink => 'L',
        EntryKind::File | EntryKind::Other => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn owner_name(id: u32) -> String {
    match id {
        0 => "root".into(),
        1000 => "user".into(),
        other => other.to_string(),
    }
}

/// envd's `FileType` of an entry kind (other kinds are unspecified).
fn file_type(kind: EntryKind) -> &'static str {
    match kind {
        EntryKind::File => "FILE_TYPE_FILE",
        EntryKind::Dir => "FILE_TYPE_DIRECTORY",
        EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        EntryKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// envd's `EntryInfo` of an agent entry. A symlink is described as envd
/// describes it: the type and permission bits of what it leads to (every
/// link on the way followed), its own size, owner and times, and
/// `symlinkTarget` the absolute path it resolves to; one that leads
/// nowhere has an unspecified type and its own path as its target.
pub fn entry_info(e: &Entry) -> Value {
    let (kind, mode) = match (e.kind, &e.resolved) {
        (EntryKind::Symlink, Some(r)) => (file_type(r.kind), r.mode),
        (EntryKind::Symlink, None) => ("FILE_TYPE_UNSPECIFIED", 0),
        (k, _) => (file_type(k), e.mode),
    };
    let ms = (e.mtime_ns / 1_000_000).clamp(i64::MIN as i128, i64::MAX as i128) as i64;
    let mut v = json!({
        "name": e.name,
        "type": kind,
        "path": e.path,
        "size": e.size.to_string(),
        "mode": mode & 0o777,
        "permissions": permissions(e.kind, e.mode),
        "owner": owner_name(e.uid),
        "group": owner_name(e.gid),
        "modifiedTime": hutch_control::control::rfc3339(ms),
        "metadata": {},
    });
    if e.kind == EntryKind::Symlink {
        let target = e.resolved.as_ref().map_or(e.path.as_str(), |r| r.path.as_str());
        v["symlinkTarget"] = json!(target);
    }
    v
}

/// envd's `EntryInfo` with the entry's E2B metadata (files and directories;
/// a symlink's are its target's, so none are read for it).
async fn with_metadata(app: &App, ctx: &Envd, e: &Entry) -> Value {
    let mut v = entry_info(e);
    if matches!(e.kind, EntryKind::File | EntryKind::Dir) {
        v["metadata"] = metadata_of(app, ctx, &e.path).await;
    }
    v
}

#[derive(Deserialize, Default)]
struct PathRequest {
    path: Option<String>,
    depth: Option<u32>,
}

fn rpc_path(ctx: &Envd, p: Option<String>) -> Result<String, EnvdError> {
    let p = p.unwrap_or_default();
    if p.is_empty() {
        return Err(EnvdError::new(ErrorCode::InvalidRequest, "path is required"));
    }
    Ok(ctx.resolve(&p)?)
}

async fn stat(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        let entry = app.control.fs_stat(&ctx, &path).await?;
        Ok::<_, EnvdError>(json!({"entry": with_metadata(&app, &ctx, &entry).await}))
    };
    run.await.map_or_else(unary_error, unary)
}

async fn list_dir(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        let depth = req.depth.unwrap_or(1).max(1);
        let entries = app.control.fs_list(&ctx, &path, depth).await?;
        let mut out = Vec::with_capacity(entries.len());
        for e in &entries {
            out.push(with_metadata(&app, &ctx, e).await);
        }
        Ok::<_, EnvdError>(json!({"entries": out}))
    };
    run.await.map_or_else(unary_error, unary)
}

async fn stat_entry(app: &App, ctx: &Envd, path: String) -> Result<Value, EnvdError> {
    let entry = app.control.fs_stat(ctx, &path).await?;
    Ok(with_metadata(app, ctx, &entry).await)
}

async fn make_dir(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        if app.control.fs_mkdir(&ctx, &path).await? {
            Ok(json!({"entry": stat_entry(&app, &ctx, path).await?}))
        } else {
            Err(EnvdError::new(ErrorCode::SandboxPathConflict, format!("directory {path} already exists")))
        }
    };
    run.await.map_or_else(unary_error, unary)
}

#[derive(Deserialize, Default)]
struct MoveRequest {
    source: Option<String>,
    destination: Option<String>,
}

async fn move_entry(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: MoveRequest = unary_request(&body)?;
        let from = rpc_path(&ctx, req.source)?;
        let to = rpc_path(&ctx, req.destination)?;
        app.control.fs_rename(&ctx, &from, &to).await?;
        Ok(json!({"entry": stat_entry(&app, &ctx, to).await?}))
    };
    run.await.map_or_else(unary_error, unary)
}

async fn remove(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        app.control.fs_remove(&ctx, &path).await?;
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}
