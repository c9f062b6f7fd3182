//! E2B's control REST API (`/sandboxes`, `/v2/sandboxes`, `/snapshots`):
//! create, get, list, kill, timeout, pause, connect, metrics, snapshots and
//! forks, over `Control`, with the API key in `X-API-KEY`.

use super::{E2bError, ENVD_VERSION};
use super::{E2bPath as ApiPath, E2bQuery as ApiQuery};
use crate::routes::Caller;
use crate::App;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use hutch_api::{CreateSandbox, CreateSnapshot, Extend, Fork, Sandbox, SandboxState, Snapshot};
use hutch_control::control::{now_ms, parse_rfc3339, rfc3339};
use hutch_control::history::{LogEntry, LogLevel, LogQuery};
use hutch_control::network::E2bNetwork;
use hutch_control::{SandboxId, SnapshotId};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

type AppState = State<Arc<App>>;
type E2bResult<T> = Result<T, E2bError>;

/// Default lifetime of a sandbox created without a timeout, in seconds.
const DEFAULT_TIMEOUT: u64 = 300;

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/network", put(update_network))
        .route("/sandboxes/{id}/logs", get(logs_v1))
        .route("/sandboxes/{id}/snapshots", post(create_snapshot))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", axum::routing::delete(delete_template))
        .route("/v2/sandboxes/{id}/logs", get(logs_v2))
        .merge(super::templates::keyed())
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

pub(super) async fn authenticate(State(app): AppState, mut req: Request, next: Next) -> Response {
    let secret = super::header(req.headers(), "x-api-key").map(str::trim).unwrap_or("").to_owned();
    match app.control.authenticate(&secret).await {
        Ok(Some(caller)) => {
            crate::listener::authenticated(&req);
            crate::audit::identified(&req, &caller.owner, &[]);
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        // Answered once a small body is read (`transfer::refuse`).
        Ok(None) => {
            crate::transfer::refuse(req, E2bError::new(StatusCode::UNAUTHORIZED, "Invalid API key").into_response())
                .await
        }
        Err(e) => crate::transfer::refuse(req, E2bError::from(e).into_response()).await,
    }
}

/// A JSON body, tolerant of fields hutch does not use; malformed is a 400.
pub(super) async fn body<T: serde::de::DeserializeOwned + Default>(req: Request) -> E2bResult<T> {
    let bytes = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .map_err(|_| E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, "body above 1 MiB"))?;
    if bytes.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("body: {e}")))
}

fn valid(id: &str) -> E2bResult<SandboxId> {
    SandboxId::parse(id).map_err(|_| not_found(id))
}

fn not_found(id: &str) -> E2bError {
    E2bError::new(StatusCode::NOT_FOUND, format!("sandbox \"{id}\" doesn't exist or you don't have access to it"))
}

/// E2B's state of a sandbox; `None` for one that is gone (E2B has no
/// `lost`: a sandbox of a lost node is gone to its clients, as a killed one).
fn e2b_state(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Starting | SandboxState::Running => Some("running"),
        SandboxState::Suspended | SandboxState::Paused => Some("paused"),
        SandboxState::Terminating | SandboxState::Terminated | SandboxState::Lost => None,
    }
}

/// A sandbox that is not gone, as the caller may see it; 404 otherwise.
async fn live_view(app: &App, caller: &Caller, id: &str) -> E2bResult<(SandboxId, Sandbox, &'static str)> {
    let sid = valid(id)?;
    let sb = app.control.get(caller, &sid).await.map_err(|e| match e.code() {
        hutch_api::ErrorCode::NotFound => not_found(id),
        _ => E2bError::from(e),
    })?;
    let state = e2b_state(sb.state).ok_or_else(|| not_found(id))?;
    Ok((sid, sb, state))
}

/// The `Sandbox` model (create and connect answers): with the operator's
/// domain (the SDK's `get_host` names ports under it), and the traffic
/// token when the sandbox's ports are not public.
fn created(app: &App, sb: &Sandbox, settings: Option<&E2bNetwork>) -> Value {
    let mut v = json!({
        "templateID": sb.template,
        "sandboxID": sb.id,
        "clientID": "hutch",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token(app, &sb.id),
        "domain": app.control.e2b_domain(),
        "trafficAccessToken": Value::Null,
    });
    if !settings.is_some_and(|s| s.public) {
        if let Ok(id) = SandboxId::parse(&sb.id) {
            v["trafficAccessToken"] = json!(app.control.e2b_traffic_token(&id));
        }
    }
    v
}

/// The envd access token of a sandbox.
fn token(app: &App, id: &str) -> String {
    SandboxId::parse(id).map(|id| app.control.e2b_token(&id)).unwrap_or_default()
}

/// The E2B settings of a sandbox (none for one the E2B API did not make).
async fn settings_of(app: &App, caller: &Caller, id: &SandboxId) -> Option<E2bNetwork> {
    app.control.e2b_settings(caller, id).await.ok().flatten()
}

/// The `ListedSandbox` model, and with `detail` the `SandboxDetail` one.
fn listed(app: &App, sb: &Sandbox, state: &str, detail: bool) -> Value {
    let mut v = json!({
        "templateID": sb.template,
        "sandboxID": sb.id,
        "clientID": "hutch",
        "startedAt": sb.created_at,
        "endAt": sb.expires_at,
        "cpuCount": sb.limits.vcpus.ceil().max(1.0) as u64,
        "memoryMB": sb.memory_mb,
        "diskSizeMB": sb.limits.disk_mib,
        "metadata": sb.metadata,
        "state": state,
        "envdVersion": ENVD_VERSION,
    });
    if detail {
        v["envdAccessToken"] = json!(token(app, &sb.id));
        v["domain"] = json!(app.control.e2b_domain());
    }
    v
}

/// `SandboxDetail`'s network fields, from the E2B settings kept.
fn with_network(mut v: Value, sb: &Sandbox, settings: Option<&E2bNetwork>) -> Value {
    let Some(s) = settings else { return v };
    let mut net = json!({"allowPublicTraffic": s.public});
    if !s.allow_out.is_empty() {
        net["allowOut"] = json!(s.allow_out);
    }
    if !s.deny_out.is_empty() {
        net["denyOut"] = json!(s.deny_out);
    }
    if let Some(m) = &s.mask_request_host {
        net["maskRequestHost"] = json!(m);
    }
    v["network"] = net;
    v["allowInternetAccess"] = json!(s.allow_internet_access);
    let on_timeout = match sb.on_expire {
        hutch_api::OnExpire::Pause => "pause",
        hutch_api::OnExpire::Delete => "kill",
    };
    v["lifecycle"] = json!({"autoResume": s.auto_resume, "onTimeout": on_timeout});
    v
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    allow_internet_access: Option<bool>,
    network: Option<NewNetwork>,
    auto_resume: Option<AutoResume>,
    /// `lifecycle.on_timeout: "pause"`.
    auto_pause: Option<bool>,
    /// Volumes (by name) and where each goes, read-write.
    volume_mounts: Option<Vec<E2bVolumeMount>>,
}

#[derive(Deserialize)]
struct E2bVolumeMount {
    name: String,
    path: String,
}

#[derive(Deserialize, Default)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// E2B's network settings of a new sandbox: egress rules (CIDRs,
/// addresses and names out of it) and who reaches its ports.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NewNetwork {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    allow_public_traffic: Option<bool>,
    mask_request_host: Option<String>,
    #[serde(flatten)]
    unsupported: Unsupported,
}

/// E2B network settings hutch does not implement: refused rather than
/// ignored (each changes what the sandbox may reach).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Unsupported {
    egress_proxy: Option<Value>,
    dns_servers: Option<Value>,
    rules: Option<Value>,
    https_ports: Option<Value>,
}

impl Unsupported {
    fn check(&self) -> E2bResult<()> {
        let set = |v: &Option<Value>| {
            v.as_ref().is_some_and(|v| match v {
                Value::Null => false,
                Value::Array(a) => !a.is_empty(),
                Value::Object(o) => !o.is_empty(),
                _ => true,
            })
        };
        for (name, v) in [
            ("egressProxy", &self.egress_proxy),
            ("dnsServers", &self.dns_servers),
            ("rules", &self.rules),
            ("httpsPorts", &self.https_ports),
        ] {
            if set(v) {
                return Err(E2bError::new(
                    StatusCode::BAD_REQUEST,
                    format!("network.{name} is not supported by this server"),
                ));
            }
        }
        Ok(())
    }
}

/// A refusal of the control plane, in E2B's words for a missing sandbox.
fn refusal(id: &str) -> impl FnOnce(hutch_control::ControlError) -> E2bError + '_ {
    move |e| match e.code() {
        hutch_api::ErrorCode::NotFound => not_found(id),
        _ => E2bError::from(e),
    }
}

async fn create(State(app): AppState, Extension(caller): Extension<Caller>, req: Request) -> E2bResult<Response> {
    let new: NewSandbox = body(req).await?;
    // E2B's templateID names one of the caller's templates (warm pools,
    // images, builds and network policy included).
    let template = match new.template_id.as_deref() {
        None | Some("base") | Some("") => None,
        // A template's name, id, or `name:tag`, as the SDK's builds name
        // them; another name goes on (a snapshot's, the built-in ones).
        Some(other) => match app.control.e2b_template_name(&caller, other).await {
            Ok(name) => Some(name),
            Err(hutch_control::ControlError::UnknownTemplate(_) | hutch_control::ControlError::NoTemplate(_))
                if !other.contains(':') && hutch_control::templates::TemplateId::parse(other).is_err() =>
            {
                Some(other.to_owned())
            }
            Err(hutch_control::ControlError::UnknownTemplate(_) | hutch_control::ControlError::NoTemplate(_)) => {
                return Err(E2bError::new(StatusCode::NOT_FOUND, format!("template '{other}' not found")));
            }
            Err(hutch_control::ControlError::Invalid(_)) => Some(other.to_owned()),
            Err(e) => return Err(E2bError::from(e)),
        },
    };
    // A snapshot's id stands where E2B takes a template (`Sandbox.create(
    // snapshot_id)`); so does its name when no template has that name.
    let snapshot = template.as_deref().filter(|t| SnapshotId::parse(t).is_ok()).map(str::to_owned);
    let template = if snapshot.is_some() { None } else { template };
    let ttl = new.timeout.unwrap_or(DEFAULT_TIMEOUT).max(1);
    let net = new.network.unwrap_or_default();
    net.unsupported.check()?;
    let settings = E2bNetwork {
        allow_out: net.allow_out.unwrap_or_default(),
        deny_out: net.deny_out.unwrap_or_default(),
        allow_internet_access: new.allow_internet_access,
        public: net.allow_public_traffic.unwrap_or(true),
        mask_request_host: net.mask_request_host.filter(|m| !m.is_empty()),
        auto_resume: new.auto_resume.is_some_and(|a| a.enabled),
    };
    let mut create = CreateSandbox {
        template,
        snapshot,
        ttl_seconds: Some(ttl),
        // E2B keeps what a sandbox paused at its timeout holds until it is
        // killed; ours are kept for the longest `paused_ttl_seconds`.
        on_expire: new.auto_pause.unwrap_or(false).then_some(hutch_api::OnExpire::Pause),
        paused_ttl_seconds: new.auto_pause.unwrap_or(false).then_some(hutch_control::PAUSED_TTL_MAX),
        env: new.env_vars.unwrap_or_default(),
        metadata: new.metadata.unwrap_or_default(),
        wait_seconds: Some(60),
        volumes: new
            .volume_mounts
            .unwrap_or_default()
            .into_iter()
            .map(|m| hutch_api::VolumeMount { name: m.name, path: m.path, read_only: false })
            .collect(),
        ..CreateSandbox::default()
    };
    let mut made = app.control.create_e2b(&caller, &create, settings.clone()).await;
    if let Err(hutch_control::ControlError::UnknownTemplate(_)) = &made {
        // No template of that name: one of the caller's snapshots, maybe.
        create.snapshot = create.template.take();
        made = app.control.create_e2b(&caller, &create, settings.clone()).await;
    }
    let (sb, _) = match made {
        Err(hutch_control::ControlError::UnknownTemplate(_) | hutch_control::ControlError::NoSnapshot(_)) => {
            let name = new.template_id.as_deref().unwrap_or_default();
            return Err(E2bError::new(StatusCode::NOT_FOUND, format!("template '{name}' not found")));
        }
        r => r?,
    };
    if sb.state != SandboxState::Running {
        if let Ok(id) = SandboxId::parse(&sb.id) {
            let _ = app.control.delete(&caller, &id).await;
        }
        return Err(E2bError::new(StatusCode::SERVICE_UNAVAILABLE, "the sandbox did not start in time"));
    }
    Ok((StatusCode::CREATED, Json(created(&app, &sb, Some(&settings)))).into_response())
}

async fn detail(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<Json<Value>> {
    let (sid, sb, state) = live_view(&app, &caller, &id).await?;
    let settings = settings_of(&app, &caller, &sid).await;
    let mut v = with_network(listed(&app, &sb, state, true), &sb, settings.as_ref());
    if !sb.volumes.is_empty() {
        v["volumeMounts"] =
            json!(sb.volumes.iter().map(|m| json!({"name": m.name, "path": m.path})).collect::<Vec<_>>());
    }
    Ok(Json(v))
}

async fn kill(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<StatusCode> {
    let (sid, _, _) = live_view(&app, &caller, &id).await?;
    app.control.delete(&caller, &sid).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct Timeout {
    timeout: Option<u64>,
}

/// Sets the expiry to `timeout` seconds from now (shorter or longer),
/// clamped to the latest the sandbox may live to, as E2B clamps.
async fn expire_in(app: &App, caller: &Caller, id: &SandboxId, seconds: u64) -> E2bResult<()> {
    let until = now_ms().saturating_add((seconds.clamp(1, 86_400) * 1000) as i64);
    app.control.extend(caller, id, &Extend { by: None, until: Some(rfc3339(until)) }, true).await?;
    Ok(())
}

async fn set_timeout(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<StatusCode> {
    let t: Timeout = body(req).await?;
    let seconds = t.timeout.ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, "timeout is required"))?;
    let (sid, _, _) = live_view(&app, &caller, &id).await?;
    expire_in(&app, &caller, &sid, seconds).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct PauseRequest {
    /// `false` (the SDK's `keep_memory=False`, `mode="filesystem"`): a
    /// pause to disk; otherwise the memory is kept.
    memory: Option<bool>,
}

/// Pause: E2B's full pause is the native memory suspend, its filesystem
/// pause the native pause to disk (processes end, files kept).
async fn pause(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<StatusCode> {
    let p: PauseRequest = body(req).await?;
    let (sid, sb, state) = live_view(&app, &caller, &id).await?;
    if state == "paused" {
        return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox \"{id}\" is already paused")));
    }
    let mode = if p.memory == Some(false) {
        // The SDK reads 409 as "already paused": a sandbox that cannot be
        // paused to disk is a 400.
        if sb.storage != hutch_api::StorageKind::Disk {
            return Err(E2bError::new(
                StatusCode::BAD_REQUEST,
                format!("sandbox \"{id}\" keeps its files in memory: it cannot be paused to disk"),
            ));
        }
        hutch_api::SuspendMode::Disk
    } else {
        hutch_api::SuspendMode::Memory
    };
    app.control.suspend(&caller, &sid, mode).await.map_err(refusal(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

/// The legacy resume: 201 when resumed, 409 when it already runs.
async fn resume(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<Response> {
    let t: Timeout = body(req).await?;
    let (sid, _, state) = live_view(&app, &caller, &id).await?;
    if state == "running" {
        return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox \"{id}\" is already running")));
    }
    let sb = app.control.resume(&caller, &sid).await?;
    if let Some(s) = t.timeout {
        expire_in(&app, &caller, &sid, s).await?;
    }
    let settings = settings_of(&app, &caller, &sid).await;
    Ok((StatusCode::CREATED, Json(created(&app, &sb, settings.as_ref()))).into_response())
}

/// Connect: 200 for a running sandbox, 201 for a paused one now resumed. A
/// timeout only ever lengthens the sandbox's life here.
async fn connect(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<Response> {
    let t: Timeout = body(req).await?;
    let (sid, mut sb, state) = live_view(&app, &caller, &id).await?;
    let status = if state == "paused" {
        sb = app.control.resume(&caller, &sid).await?;
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    if let Some(s) = t.timeout {
        let wanted = now_ms().saturating_add((s.min(86_400) * 1000) as i64);
        if parse_rfc3339(&sb.expires_at).is_some_and(|e| e < wanted) {
            expire_in(&app, &caller, &sid, s).await?;
        }
    }
    let settings = settings_of(&app, &caller, &sid).await;
    Ok((status, Json(created(&app, &sb, settings.as_ref()))).into_response())
}

#[derive(Deserialize, Default)]
struct MetricsQuery {
    start: Option<String>,
    end: Option<String>,
}

/// A Unix time in a query, refused (400) when it is not one.
fn unix_param(name: &str, v: Option<&str>) -> E2bResult<Option<i64>> {
    v.map(|s| {
        s.trim()
            .parse::<i64>()
            .ok()
            .filter(|v| *v >= 0)
            .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, format!("{name} must be a Unix time, not {s:?}")))
    })
    .transpose()
}

/// The samples the daemon took of the sandbox (every five seconds while it
/// runs, the last hour's), from `start` to `end` (Unix seconds; the
/// sandbox's start and now when absent).
async fn metrics(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> E2bResult<Json<Value>> {
    let start = unix_param("start", q.start.as_deref())?;
    let end = unix_param("end", q.end.as_deref())?;
    let (sid, _, _) = live_view(&app, &caller, &id).await?;
    let samples = app.control.metrics_history(&caller, &sid, start, end).await.map_err(refusal(&id))?;
    let rows: Vec<Value> = samples
        .iter()
        .map(|m| {
            json!({
                "timestamp": rfc3339(m.at_ms),
                "timestampUnix": m.at_ms / 1000,
                "cpuCount": m.cpu_count,
                "cpuUsedPct": m.cpu_used_pct,
                "memUsed": m.mem_used,
                "memTotal": m.mem_total,
                "memCache": m.mem_cache,
                "diskUsed": m.disk_used,
                "diskTotal": m.disk_total,
            })
        })
        .collect();
    Ok(Json(Value::Array(rows)))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NetworkUpdate {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    allow_internet_access: Option<bool>,
    #[serde(flatten)]
    unsupported: Unsupported,
}

/// `PUT /sandboxes/{id}/network`: the egress rules of a running sandbox
/// are replaced (what the body leaves out is cleared), live.
async fn update_network(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<StatusCode> {
    let u: NetworkUpdate = body(req).await?;
    u.unsupported.check()?;
    let (sid, _, state) = live_view(&app, &caller, &id).await?;
    if state == "paused" {
        return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox \"{id}\" is paused")));
    }
    app.control
        .update_e2b_network(
            &caller,
            &sid,
            u.allow_out.unwrap_or_default(),
            u.deny_out.unwrap_or_default(),
            u.allow_internet_access,
        )
        .await
        .map_err(refusal(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct LogsQuery {
    start: Option<String>,
    cursor: Option<String>,
    limit: Option<String>,
    direction: Option<String>,
    level: Option<String>,
    search: Option<String>,
}

/// Most log entries one answer carries.
const LOG_LIMIT: usize = 1000;

fn log_limit(v: Option<&str>) -> E2bResult<usize> {
    match v {
        None => Ok(LOG_LIMIT),
        Some(s) => s
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|l| *l <= LOG_LIMIT)
            .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, format!("limit must be 0 to {LOG_LIMIT}"))),
    }
}

fn log_entry(e: &LogEntry) -> Value {
    json!({
        "timestamp": rfc3339(e.at_ms),
        "level": e.level.as_str(),
        "message": e.message,
        "fields": e.fields,
    })
}

/// `GET /sandboxes/{id}/logs`: the sandbox's log from `start` (Unix
/// milliseconds), oldest first, as lines and as entries.
async fn logs_v1(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<LogsQuery>,
) -> E2bResult<Json<Value>> {
    let start = unix_param("start", q.start.as_deref())?;
    let limit = log_limit(q.limit.as_deref())?;
    let (sid, _, _) = live_view(&app, &caller, &id).await?;
    let query = LogQuery { from_ms: start, limit, ..LogQuery::default() };
    let entries = app.control.sandbox_log(&caller, &sid, &query).await.map_err(refusal(&id))?;
    let lines: Vec<Value> = entries.iter().map(|e| json!({"timestamp": rfc3339(e.at_ms), "line": e.message})).collect();
    let entries: Vec<Value> = entries.iter().map(log_entry).collect();
    Ok(Json(json!({"logs": lines, "logEntries": entries})))
}

/// `GET /v2/sandboxes/{id}/logs`: entries from the `cursor` (Unix
/// milliseconds) in `direction` (`backward`, newest first, by default),
/// at least `level`, holding `search`.
async fn logs_v2(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<LogsQuery>,
) -> E2bResult<Json<Value>> {
    let bad = |m: String| E2bError::new(StatusCode::BAD_REQUEST, m);
    let cursor = unix_param("cursor", q.cursor.as_deref())?;
    let limit = log_limit(q.limit.as_deref())?;
    let backward = match q.direction.as_deref() {
        None | Some("backward") => true,
        Some("forward") => false,
        Some(d) => return Err(bad(format!("direction must be forward or backward, not {d:?}"))),
    };
    let level = match q.level.as_deref() {
        None => None,
        Some(l) => Some(
            LogLevel::parse(l).ok_or_else(|| bad(format!("level must be debug, info, warn or error, not {l:?}")))?,
        ),
    };
    if q.search.as_deref().is_some_and(|s| s.len() > 256) {
        return Err(bad("search is at most 256 bytes".into()));
    }
    let (sid, _, _) = live_view(&app, &caller, &id).await?;
    let (from_ms, until_ms) = match (cursor, backward) {
        (Some(c), true) => (None, Some(c)),
        (Some(c), false) => (Some(c), None),
        (None, _) => (None, None),
    };
    let query = LogQuery { from_ms, until_ms, backward, level, search: q.search.clone(), limit };
    let entries = app.control.sandbox_log(&caller, &sid, &query).await.map_err(refusal(&id))?;
    Ok(Json(json!({"logs": entries.iter().map(log_entry).collect::<Vec<Value>>()})))
}

/// A sandbox paused to disk has no layer in use to capture: 409 (a
/// memory-suspended one is captured as it is).
fn disk_paused(sb: &Sandbox) -> E2bResult<()> {
    if sb.state == SandboxState::Paused {
        return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox \"{}\" is paused: resume it first", sb.id)));
    }
    Ok(())
}

#[derive(Deserialize, Default)]
struct SnapshotRequest {
    name: Option<String>,
    memory: Option<bool>,
}

/// `SnapshotInfo`: E2B names a snapshot by `snapshotID` (what
/// `Sandbox.create` takes) and its `names`.
fn snapshot_info(s: &Snapshot) -> Value {
    json!({"snapshotID": s.id, "names": s.name.iter().collect::<Vec<_>>()})
}

/// `POST /sandboxes/{id}/snapshots`: the native snapshot. `mode="full"`
/// (`memory: true`) keeps memory too where the sandbox's class can (a
/// gvisor sandbox without a network) and is refused elsewhere (409
/// `class_unsupported`) rather than half kept; the SDK's default and
/// `mode="filesystem"` keep files.
async fn create_snapshot(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<Response> {
    let r: SnapshotRequest = body(req).await?;
    let (sid, sb, _) = live_view(&app, &caller, &id).await?;
    disk_paused(&sb)?;
    let snap = app
        .control
        .snapshot(&caller, &sid, &CreateSnapshot { name: r.name.filter(|n| !n.is_empty()), memory: r.memory })
        .await
        .map_err(refusal(&id))?;
    Ok((StatusCode::CREATED, Json(snapshot_info(&snap))).into_response())
}

/// `GET /snapshots`: the caller's snapshots, newest first; `sandboxID`
/// and `name` (its name or id) filter, `limit` and `nextToken` page.
async fn list_snapshots(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<HashMap<String, String>>,
) -> E2bResult<Response> {
    let bad = |m: &str| E2bError::new(StatusCode::BAD_REQUEST, m.to_owned());
    let limit: usize = match q.get("limit") {
        Some(l) => l.parse().map_err(|_| bad("limit must be a number"))?,
        None => 100,
    };
    if !(1..=1000).contains(&limit) {
        return Err(bad("limit must be 1 to 1000"));
    }
    let all = app.control.list_snapshots(&caller, None).await?.snapshots;
    let rows: Vec<&Snapshot> = all
        .iter()
        .filter(|s| q.get("sandboxID").is_none_or(|sb| s.sandbox_id == *sb))
        .filter(|s| q.get("name").is_none_or(|n| s.id == *n || s.name.as_ref() == Some(n)))
        .collect();
    // The token is the id of the last snapshot of the previous page.
    let start = match q.get("nextToken") {
        Some(t) => rows.iter().position(|s| s.id == *t).map(|i| i + 1).ok_or_else(|| bad("invalid nextToken"))?,
        None => 0,
    };
    let page = &rows[start.min(rows.len())..(start + limit).min(rows.len())];
    let mut resp = Json(Value::Array(page.iter().map(|s| snapshot_info(s)).collect())).into_response();
    if start + limit < rows.len() {
        if let Some(v) = page.last().and_then(|s| HeaderValue::from_str(&s.id).ok()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

/// `DELETE /templates/{id}`, as the SDK's `delete_snapshot` calls it: a
/// snapshot of the caller's, by id or name (templates are not deleted
/// through the E2B API: anything else is 404).
async fn delete_template(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> E2bResult<StatusCode> {
    let gone = || E2bError::new(StatusCode::NOT_FOUND, format!("snapshot \"{id}\" not found"));
    let snap = match SnapshotId::parse(&id) {
        Ok(s) => s,
        Err(_) => {
            let all = app.control.list_snapshots(&caller, None).await?.snapshots;
            let found = all.iter().find(|s| s.name.as_deref() == Some(id.as_str())).ok_or_else(gone)?;
            SnapshotId::parse(&found.id).map_err(|_| gone())?
        }
    };
    app.control.delete_snapshot(&caller, &snap).await.map_err(|e| match e.code() {
        hutch_api::ErrorCode::NotFound => gone(),
        _ => E2bError::from(e),
    })?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct ForkRequest {
    timeout: Option<u64>,
    count: Option<u32>,
}

/// `POST /sandboxes/{id}/fork`: the native fork (all or nothing), each
/// child answered as a `SandboxForkResult` with its `sandbox`, living
/// `timeout` seconds (300 by default) like a new sandbox.
async fn fork(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> E2bResult<Response> {
    let f: ForkRequest = body(req).await?;
    let (sid, sb, _) = live_view(&app, &caller, &id).await?;
    disk_paused(&sb)?;
    let made = app.control.fork_e2b(&caller, &sid, &Fork { count: f.count }).await.map_err(refusal(&id))?;
    let seconds = f.timeout.unwrap_or(DEFAULT_TIMEOUT);
    let mut out = Vec::new();
    let mut ids = Vec::new();
    let mut failed = None;
    for child in &made.sandboxes {
        let Ok(cid) = SandboxId::parse(&child.id) else { continue };
        ids.push(cid.clone());
        if failed.is_none() {
            match expire_in(&app, &caller, &cid, seconds).await {
                Ok(()) => {
                    let settings = settings_of(&app, &caller, &cid).await;
                    out.push(json!({"sandbox": created(&app, child, settings.as_ref())}));
                }
                Err(e) => failed = Some(e),
            }
        }
    }
    if let Some(e) = failed {
        // All or nothing, as the native fork.
        for cid in &ids {
            let _ = app.control.delete(&caller, cid).await;
        }
        return Err(e);
    }
    Ok((StatusCode::CREATED, Json(Value::Array(out))).into_response())
}

/// Every sandbox of the caller that is not gone, newest first.
async fn all_live(app: &App, caller: &Caller) -> E2bResult<Vec<(Sandbox, &'static str)>> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = app.control.list(caller, None, Some(1000), cursor.as_deref(), true).await?;
        for sb in page.sandboxes {
            if let Some(state) = e2b_state(sb.state) {
                out.push((sb, state));
            }
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    out.sort_by(|a, b| b.0.created_at.cmp(&a.0.created_at).then_with(|| b.0.id.cmp(&a.0.id)));
    Ok(out)
}

/// Decodes `%XX` and `+`.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The metadata filter: `k=v&k2=v2`, each part percent-encoded once more.
fn metadata_filter(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

async fn list_v1(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<HashMap<String, String>>,
) -> E2bResult<Json<Value>> {
    let filter = q.get("metadata").map(|m| metadata_filter(m)).unwrap_or_default();
    let rows: Vec<Value> = all_live(&app, &caller)
        .await?
        .iter()
        .filter(|(sb, _)| filter.iter().all(|(k, v)| sb.metadata.get(k) == Some(v)))
        .map(|(sb, state)| listed(&app, sb, state, false))
        .collect();
    Ok(Json(Value::Array(rows)))
}

async fn list_v2(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<HashMap<String, String>>,
) -> E2bResult<Response> {
    let bad = |m: &str| E2bError::new(StatusCode::BAD_REQUEST, m.to_owned());
    let filter = q.get("metadata").map(|m| metadata_filter(m)).unwrap_or_default();
    let states: Vec<String> = match q.get("state") {
        Some(s) => s.split(',').map(|x| x.trim().to_owned()).filter(|x| !x.is_empty()).collect(),
        None => vec!["running".into(), "paused".into()],
    };
    if states.iter().any(|s| s != "running" && s != "paused") {
        return Err(bad("state must be running or paused"));
    }
    let limit: usize = match q.get("limit") {
        Some(l) => l.parse().map_err(|_| bad("limit must be a number"))?,
        None => 100,
    };
    if !(1..=1000).contains(&limit) {
        return Err(bad("limit must be 1 to 1000"));
    }
    let started_after = match q.get("startedAfter") {
        Some(s) => Some(parse_rfc3339(s).ok_or_else(|| bad("startedAfter must be RFC 3339 in UTC"))?),
        None => None,
    };
    let template = q.get("template");
    let mut rows: Vec<(Sandbox, &'static str)> = all_live(&app, &caller)
        .await?
        .into_iter()
        .filter(|(sb, state)| {
            states.iter().any(|s| s == state)
                && filter.iter().all(|(k, v)| sb.metadata.get(k) == Some(v))
                && template.is_none_or(|t| *t == sb.template)
                && started_after.is_none_or(|after| parse_rfc3339(&sb.created_at).is_some_and(|c| c >= after))
        })
        .collect();
    if q.get("order").is_some_and(|o| o.eq_ignore_ascii_case("asc")) {
        rows.reverse();
    }
    // The token is the id of the last sandbox of the previous page.
    let start = match q.get("nextToken") {
        Some(t) => {
            rows.iter().position(|(sb, _)| sb.id == *t).map(|i| i + 1).ok_or_else(|| bad("invalid nextToken"))?
        }
        None => 0,
    };
    let page = &rows[start.min(rows.len())..(start + limit).min(rows.len())];
    let more = start + limit < rows.len();
    let body: Vec<Value> = page.iter().map(|(sb, state)| listed(&app, sb, state, false)).collect();
    let mut resp = Json(Value::Array(body)).into_response();
    if more {
        if let Some(v) = page.last().and_then(|(sb, _)| HeaderValue::from_str(&sb.id).ok()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode_twice_encoded_pairs() {
        assert_eq!(
            metadata_filter("a%20b=c%26d&e=f"),
            vec![("a b".to_owned(), "c&d".to_owned()), ("e".to_owned(), "f".to_owned())]
        );
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%4"), "%4");
    }
}
