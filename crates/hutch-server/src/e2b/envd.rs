//! envd's API inside a sandbox, answered by the daemon: the sandbox headers
//! and access token, `/health`, `/files` (download; multipart and
//! octet-stream uploads, gzip; signed URLs; `X-Metadata-*` headers as
//! `user.e2b.*` xattrs) and the `filesystem.Filesystem` RPCs. Paths
//! and commands run as the user of `Authorization: Basic` (default `user`),
//! relative paths against that user's home.

use super::connect::{self, unary, unary_error, unary_request};
use super::{access_token, same, E2bError, EnvdError};
use crate::{App, ChannelBody};
use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use base64::Engine;
use hutch_agent::proto::{normalize_path, Entry, EntryKind, Reply, Request as AgentRequest};
use hutch_api::ErrorCode;
use hutch_control::files::{Access, SandboxFs};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::Digest;

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;

type AppState = State<Arc<App>>;

/// Largest upload body (the files API's own cap applies per file).
const UPLOAD_LIMIT: usize = 512 << 20;

/// Who an envd call acts for: the sandbox, its owner, the sandbox user.
#[derive(Clone, Debug)]
pub struct Envd {
    pub id: String,
    pub owner: String,
    pub user: String,
}

impl Envd {
    /// The user's home directory.
    fn home(&self) -> String {
        if self.user == "root" {
            "/root".into()
        } else {
            format!("/home/{}", self.user)
        }
    }

    /// A path made absolute against the user's home, normalized.
    pub fn resolve(&self, path: &str) -> Result<String, EnvdError> {
        let home = self.home();
        if path.is_empty() {
            return Ok(home);
        }
        normalize_path(path, &home)
            .map_err(|_| EnvdError::new(ErrorCode::InvalidPath, format!("invalid path {path:?}")))
    }
}

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(download).post(upload).layer(axum::extract::DefaultBodyLimit::max(UPLOAD_LIMIT)))
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .merge(connect::routes())
        .merge(super::watch::routes())
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

/// The user named by `Authorization: Basic base64(user:)`, else `user`.
fn basic_user(headers: &HeaderMap) -> Result<String, E2bError> {
    let Some(v) = super::header(headers, "authorization") else { return Ok("user".into()) };
    let bad = || E2bError::new(StatusCode::BAD_REQUEST, "Authorization must be Basic base64(user:)");
    let b64 = v.strip_prefix("Basic ").ok_or_else(bad)?;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let user = text.split(':').next().unwrap_or("");
    if user.is_empty() {
        return Ok("user".into());
    }
    if user.len() > 32 || !user.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(bad());
    }
    Ok(user.to_owned())
}

/// The signed-URL parameters of a `/files` request.
#[derive(Deserialize, Default)]
struct SignedQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<String>,
}

/// A signed `/files` request: what the SDK's `get_signature` covers.
struct Signed {
    signature: String,
    /// `path:operation:user` (the token and expiration follow).
    prefix: String,
    expiration: Option<i64>,
}

impl Signed {
    /// The signature parameters of a `/files` request without a token, if any.
    fn of(req: &Request) -> Result<Option<Signed>, E2bError> {
        if req.uri().path() != "/files" {
            return Ok(None);
        }
        let Ok(Query(q)) = Query::<SignedQuery>::try_from_uri(req.uri()) else { return Ok(None) };
        let Some(signature) = q.signature else { return Ok(None) };
        let operation = if req.method() == axum::http::Method::GET { "read" } else { "write" };
        let expiration = match q.signature_expiration.as_deref() {
            None => None,
            Some(e) => Some(e.parse::<i64>().map_err(|_| {
                E2bError::new(StatusCode::BAD_REQUEST, "signature_expiration must be a unix timestamp")
            })?),
        };
        let prefix =
            format!("{}:{}:{}", q.path.as_deref().unwrap_or(""), operation, q.username.as_deref().unwrap_or(""));
        Ok(Some(Signed { signature, prefix, expiration }))
    }

    /// Whether the signature is the one `sandbox`'s access token makes:
    /// `v1_` + unpadded base64 of SHA-256 over
    /// `path:operation:user:token[:expiration]`, compared without an early exit.
    fn matches(&self, secret: &[u8], sandbox: &str) -> bool {
        let token = access_token(secret, sandbox);
        let raw = match self.expiration {
            None => format!("{}:{}", self.prefix, token),
            Some(e) => format!("{}:{}:{}", self.prefix, token, e),
        };
        let digest = sha2::Sha256::digest(raw.as_bytes());
        let expected = format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest));
        same(self.signature.as_bytes(), expected.as_bytes())
    }

    /// Whether the expiration has passed.
    fn expired(&self) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.expiration.is_some_and(|e| e < now)
    }
}

/// The sandbox a signed URL is for. E2B puts the id in the host
/// (`<port>-<id>.<domain>`); with `E2B_SANDBOX_URL` the SDK's URL names no
/// sandbox at all, so the running sandboxes are tried in turn (one hash
/// each). `None` if none matches.
fn signed_sandbox(app: &App, headers: &HeaderMap, signed: &Signed) -> Result<Option<String>, E2bError> {
    let named = super::header(headers, "e2b-sandbox-id").map(str::to_owned).or_else(|| {
        let host = super::header(headers, "host")?;
        let (first, _) = host.split_once('.')?;
        let (port, id) = first.split_once('-')?;
        port.parse::<u16>().ok()?;
        Some(id.to_owned())
    });
    if let Some(id) = named {
        return Ok(signed.matches(&app.e2b_secret, &id).then_some(id));
    }
    let live = app
        .control
        .store
        .sandboxes_in(&["running", "starting"])
        .map_err(|e| E2bError::from(hutch_control::ControlError::Store(e)))?;
    Ok(live.into_iter().map(|r| r.id).find(|id| signed.matches(&app.e2b_secret, id)))
}

/// Checks the sandbox headers and token, or a `/files` URL's signature. A
/// sandbox that is gone answers 502 "was not found", as E2B's proxy does.
async fn authenticate(State(app): AppState, mut req: Request, next: Next) -> Response {
    let headers = req.headers();
    let has_token = super::header(headers, "x-access-token").is_some();
    let signed = if has_token {
        None
    } else {
        match Signed::of(&req) {
            Ok(s) => s,
            Err(e) => return e.into_response(),
        }
    };
    let headers = req.headers();
    let id = if let Some(signed) = signed {
        let id = match signed_sandbox(&app, headers, &signed) {
            Ok(Some(id)) => id,
            Ok(None) => return E2bError::new(StatusCode::UNAUTHORIZED, "invalid signature").into_response(),
            Err(e) => return e.into_response(),
        };
        if signed.expired() {
            return E2bError::new(StatusCode::UNAUTHORIZED, "signature is already expired").into_response();
        }
        id
    } else {
        let Some(id) = super::header(headers, "e2b-sandbox-id").map(str::to_owned) else {
            return E2bError::new(StatusCode::BAD_REQUEST, "the E2b-Sandbox-Id header is required").into_response();
        };
        let token = super::header(headers, "x-access-token").unwrap_or("");
        if !same(token.as_bytes(), access_token(&app.e2b_secret, &id).as_bytes()) {
            return E2bError::new(StatusCode::UNAUTHORIZED, "a valid X-Access-Token is required").into_response();
        }
        id
    };
    let user = match basic_user(headers) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let gone = || {
        let body = json!({"code": 502, "message": format!("The sandbox {id} was not found"), "sandboxId": id});
        (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
    };
    let record = match app.control.store.get_sandbox(&id) {
        Ok(Some(r)) => r,
        Ok(None) => return gone(),
        Err(e) => return E2bError::from(hutch_control::ControlError::Store(e)).into_response(),
    };
    if !matches!(record.state.as_str(), "running" | "starting") {
        // Terminated, terminating or paused: envd is not reachable.
        return gone();
    }
    crate::listener::authenticated(&req);
    req.extensions_mut().insert(Envd { id, owner: record.owner, user });
    next.run(req).await
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// An error of the `/files` routes: `{"code": status, "message"}`.
fn http_error(e: EnvdError) -> Response {
    let (_, status) = e.connect();
    let status = if e.code == ErrorCode::SandboxPathConflict { StatusCode::BAD_REQUEST } else { status };
    let status = if e.code == ErrorCode::SandboxDiskFull { StatusCode::INSUFFICIENT_STORAGE } else { status };
    E2bError::new(status, e.message).into_response()
}

fn fs_for(app: &App, ctx: &Envd) -> Result<SandboxFs, EnvdError> {
    let live = app.control.running(&ctx.owner, &ctx.id)?;
    Ok(SandboxFs::new(live.socket.clone(), Some(ctx.user.clone())))
}

#[derive(Deserialize, Default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

/// The context with the `username` query parameter, if given, as the user.
fn with_user(ctx: &Envd, username: Option<&str>) -> Result<Envd, EnvdError> {
    let mut c = ctx.clone();
    if let Some(u) = username.filter(|u| !u.is_empty()) {
        if u.len() > 32 || !u.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(EnvdError::new(ErrorCode::InvalidRequest, "invalid username"));
        }
        c.user = u.to_owned();
    }
    Ok(c)
}

async fn download(State(app): AppState, Extension(ctx): Extension<Envd>, Query(q): Query<FileQuery>) -> Response {
    let run = async {
        let ctx = with_user(&ctx, q.username.as_deref())?;
        let path = ctx.resolve(q.path.as_deref().unwrap_or(""))?;
        let fs = fs_for(&app, &ctx)?;
        let chunks = fs.read_stream(&path).await?;
        Ok::<_, EnvdError>(chunks)
    };
    let mut chunks = match run.await {
        Ok(c) => c,
        Err(e) => return http_error(e),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Some(chunk) = chunks.recv().await {
            let item = chunk.map(Bytes::from).map_err(|e| std::io::Error::other(e.message));
            if tx.send(item).await.is_err() {
                return;
            }
        }
    });
    let mut resp = ChannelBody(rx).into_body().into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    resp
}

/// The xattr prefix of E2B file metadata: `X-Metadata-<key>` is stored as
/// `user.e2b.<key>`.
const META_PREFIX: &str = "user.e2b.";
/// At most this many metadata keys per upload.
const META_KEYS: usize = 64;
/// At most this many bytes of metadata keys and values per upload (the
/// agent caps a file's xattrs at 64 KiB).
const META_BYTES: usize = 16 << 10;

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
        attrs.insert(format!("{META_PREFIX}{key}"), value.to_owned());
    }
    Ok(attrs)
}

/// The E2B metadata (`user.e2b.*` xattrs) of an entry; empty when it has
/// none or they cannot be read (a file the user may not open).
async fn metadata_of(app: &App, ctx: &Envd, path: &str) -> Value {
    let op = AgentRequest::GetXattrs { path: path.to_owned(), user: Some(ctx.user.clone()) };
    let mut out = serde_json::Map::new();
    if let Ok(Reply::Xattrs { attrs }) = app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Read).await {
        for (k, v) in attrs {
            if let Some(key) = k.strip_prefix(META_PREFIX) {
                out.insert(key.to_owned(), Value::String(v));
            }
        }
    }
    Value::Object(out)
}

/// Writes one file with its metadata, making its missing parent
/// directories, as the user.
async fn write_one(
    app: &App,
    ctx: &Envd,
    path: &str,
    data: Vec<u8>,
    meta: &BTreeMap<String, String>,
) -> Result<Value, EnvdError> {
    let path = ctx.resolve(path)?;
    if let Some((parent, _)) = path.rsplit_once('/') {
        if !parent.is_empty() {
            let mkdir = AgentRequest::Mkdir { path: parent.to_owned(), parents: true, user: Some(ctx.user.clone()) };
            app.control.session_file_op(&ctx.owner, &ctx.id, mkdir, Access::Write).await?;
        }
    }
    let fs = fs_for(app, ctx)?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let feed = tokio::spawn(async move {
        for chunk in data.chunks(1 << 20) {
            if tx.send(chunk.to_vec()).await.is_err() {
                return;
            }
        }
    });
    let written = fs.write_stream(&path, rx).await;
    let _ = feed.await;
    written?;
    if !meta.is_empty() {
        let op = AgentRequest::SetXattrs { path: path.clone(), attrs: meta.clone(), user: Some(ctx.user.clone()) };
        app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Write).await?;
    }
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    let metadata: serde_json::Map<String, Value> = meta
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(META_PREFIX)?.to_owned(), Value::String(v.clone()))))
        .collect();
    Ok(json!({"name": name, "type": "file", "path": path, "metadata": metadata}))
}

fn gunzip(data: &[u8]) -> Result<Vec<u8>, EnvdError> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(hutch_control::files::FILE_CAP + 1)
        .read_to_end(&mut out)
        .map_err(|e| EnvdError::new(ErrorCode::InvalidRequest, format!("gzip body: {e}")))?;
    Ok(out)
}

async fn upload(
    State(app): AppState,
    Extension(ctx): Extension<Envd>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Response {
    let run = async {
        let ctx = with_user(&ctx, q.username.as_deref())?;
        let headers = req.headers().clone();
        let content_type = super::header(&headers, "content-type").unwrap_or("").to_owned();
        let gzip = super::header(&headers, "content-encoding").is_some_and(|v| v.eq_ignore_ascii_case("gzip"));
        let meta = metadata_attrs(&headers)?;
        let mut written = Vec::new();
        if content_type.starts_with("multipart/form-data") {
            let mut form = axum::extract::Multipart::from_request(req, &())
                .await
                .map_err(|e| EnvdError::new(ErrorCode::InvalidRequest, e.body_text()))?;
            loop {
                let field = form.next_field().await.map_err(|e| {
                    EnvdError::new(ErrorCode::InvalidRequest, format!("malformed form: {}", e.body_text()))
                })?;
                let Some(field) = field else { break };
                let name = field.file_name().map(str::to_owned);
                let data = field.bytes().await.map_err(|e| {
                    EnvdError::new(ErrorCode::InvalidRequest, format!("malformed form: {}", e.body_text()))
                })?;
                let path = match (&q.path, name) {
                    (Some(p), _) => p.clone(),
                    (None, Some(n)) => n,
                    (None, None) => return Err(EnvdError::new(ErrorCode::InvalidRequest, "a file part has no name")),
                };
                written.push(write_one(&app, &ctx, &path, data.to_vec(), &meta).await?);
            }
        } else {
            let path = q.path.clone().ok_or_else(|| EnvdError::new(ErrorCode::InvalidRequest, "path is required"))?;
            let body = axum::body::to_bytes(req.into_body(), UPLOAD_LIMIT)
                .await
                .map_err(|_| EnvdError::new(ErrorCode::PayloadTooLarge, "the upload is too large"))?;
            let data = if gzip { gunzip(&body)? } else { body.to_vec() };
            written.push(write_one(&app, &ctx, &path, data, &meta).await?);
        }
        Ok::<_, EnvdError>(Value::Array(written))
    };
    match run.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => http_error(e),
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

/// envd's `EntryInfo` of an agent entry.
fn entry_info(e: &Entry) -> Value {
    let kind = match e.kind {
        EntryKind::Dir => "FILE_TYPE_DIRECTORY",
        EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        EntryKind::File | EntryKind::Other => "FILE_TYPE_FILE",
    };
    let ms = (e.mtime_ns / 1_000_000).clamp(i64::MIN as i128, i64::MAX as i128) as i64;
    let mut v = json!({
        "name": e.name,
        "type": kind,
        "path": e.path,
        "size": e.size.to_string(),
        "mode": e.mode & 0o7777,
        "permissions": permissions(e.kind, e.mode),
        "owner": owner_name(e.uid),
        "group": owner_name(e.gid),
        "modifiedTime": hutch_control::control::rfc3339(ms),
        "metadata": {},
    });
    if let Some(t) = &e.target {
        v["symlinkTarget"] = json!(t);
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
    ctx.resolve(&p)
}

async fn stat(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        let op = AgentRequest::Stat { path, user: Some(ctx.user.clone()) };
        match app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Read).await? {
            Reply::Stat { entry } => Ok(json!({"entry": with_metadata(&app, &ctx, &entry).await})),
            other => Err(unexpected(&other)),
        }
    };
    run.await.map_or_else(unary_error, unary)
}

fn unexpected(r: &Reply) -> EnvdError {
    EnvdError::new(ErrorCode::Internal, format!("sandbox agent answered {r:?} unexpectedly"))
}

async fn list_dir(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        let depth = req.depth.unwrap_or(1).max(1);
        let op = AgentRequest::ListDir { path, depth, user: Some(ctx.user.clone()) };
        match app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::List).await? {
            Reply::Entries { entries, .. } => {
                let mut out = Vec::with_capacity(entries.len());
                for e in &entries {
                    out.push(with_metadata(&app, &ctx, e).await);
                }
                Ok(json!({"entries": out}))
            }
            other => Err(unexpected(&other)),
        }
    };
    run.await.map_or_else(unary_error, unary)
}

async fn stat_entry(app: &App, ctx: &Envd, path: String) -> Result<Value, EnvdError> {
    let op = AgentRequest::Stat { path, user: Some(ctx.user.clone()) };
    match app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Read).await? {
        Reply::Stat { entry } => Ok(with_metadata(app, ctx, &entry).await),
        other => Err(unexpected(&other)),
    }
}

async fn make_dir(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        let op = AgentRequest::Mkdir { path: path.clone(), parents: true, user: Some(ctx.user.clone()) };
        match app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Write).await? {
            Reply::Created { created: true } => Ok(json!({"entry": stat_entry(&app, &ctx, path).await?})),
            Reply::Created { created: false } => {
                Err(EnvdError::new(ErrorCode::SandboxPathConflict, format!("directory {path} already exists")))
            }
            other => Err(unexpected(&other)),
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
        let op = AgentRequest::Rename { from, to: to.clone(), user: Some(ctx.user.clone()) };
        app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Write).await?;
        Ok(json!({"entry": stat_entry(&app, &ctx, to).await?}))
    };
    run.await.map_or_else(unary_error, unary)
}

async fn remove(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: PathRequest = unary_request(&body)?;
        let path = rpc_path(&ctx, req.path)?;
        let op = AgentRequest::Remove { path, user: Some(ctx.user.clone()) };
        app.control.session_file_op(&ctx.owner, &ctx.id, op, Access::Write).await?;
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}
