//! envd's directory watches over the agent's inotify watches: the
//! `WatchDir` server stream, and the polled watchers of `CreateWatcher`,
//! `GetWatcherEvents` and `RemoveWatcher`. A polled watcher is the receiver
//! of one watch session kept in a table of the daemon's E2B layer; removing
//! it (or the daemon stopping) closes its agent connection, which ends the
//! watch in the agent.

use super::connect::{self, server_stream, stream_error, unary, unary_error, unary_request};
use super::envd::Envd;
use super::EnvdError;
use crate::App;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Router};
use hutch_agent::proto::{WatchEvent, WatchKind};
use hutch_api::ErrorCode;
use hutch_control::session::WatchItem;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc;

type AppState = State<Arc<App>>;

/// Most polled watchers the daemon keeps at once.
const MAX_WATCHERS: usize = 1024;

/// Most events one `GetWatcherEvents` answer carries; the rest wait.
const MAX_EVENTS: usize = 4096;

/// Polled keepalive interval: polled watchers need none, so rarely.
const POLLED_KEEPALIVE: Duration = Duration::from_secs(30);

/// The name prefix of the files API's temporary upload files.
const UPLOAD_TEMP: &str = ".hutch-upload-";

pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/filesystem.Filesystem/WatchDir", post(watch_dir))
        .route("/filesystem.Filesystem/CreateWatcher", post(create_watcher))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(get_watcher_events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(remove_watcher))
}

/// A polled watcher: its sandbox and the events not yet fetched.
struct Watcher {
    sandbox: String,
    events: mpsc::Receiver<WatchItem>,
}

/// The polled watchers by id. Ids are scoped to their sandbox: a token for
/// another sandbox does not reach them.
static WATCHERS: LazyLock<Mutex<HashMap<String, Watcher>>> = LazyLock::new(Mutex::default);
static NEXT_WATCHER: AtomicU64 = AtomicU64::new(1);

fn watchers() -> MutexGuard<'static, HashMap<String, Watcher>> {
    // A panic while holding the lock leaves the map consistent (every
    // operation on it is a single insert, remove or drain).
    WATCHERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// envd's `FilesystemEvent`, or nothing for a kind E2B has no name for
/// and for the temporary file an upload is written to before it is renamed
/// into place (the rename shows as the target's `create`).
fn fs_event(e: WatchEvent) -> Option<Value> {
    if e.name.rsplit('/').next().is_some_and(|n| n.starts_with(UPLOAD_TEMP)) {
        return None;
    }
    let kind = match e.kind {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
        WatchKind::Overflow => return None,
    };
    Some(json!({"name": e.name, "type": kind}))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatchRequest {
    path: Option<String>,
    #[serde(default)]
    recursive: bool,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatcherRequest {
    watcher_id: Option<String>,
}

async fn open(
    app: &App,
    ctx: &Envd,
    req: WatchRequest,
    keepalive: Duration,
) -> Result<mpsc::Receiver<WatchItem>, EnvdError> {
    let path = ctx.resolve(req.path.as_deref().unwrap_or(""))?;
    Ok(app.control.session_watch(&ctx.owner, &ctx.id, path, req.recursive, ctx.user.clone(), keepalive).await?)
}

async fn watch_dir(State(app): AppState, Extension(ctx): Extension<Envd>, headers: HeaderMap, body: Bytes) -> Response {
    let req: WatchRequest = match connect::stream_request(&body) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let mut items = match open(&app, &ctx, req, connect::keepalive(&headers)).await {
        Ok(rx) => rx,
        Err(e) => return stream_error(e),
    };
    let deadline = connect::timeout_ms(&headers).map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        if tx.send(Ok(json!({"start": {}}))).await.is_err() {
            return;
        }
        loop {
            let item = match deadline {
                Some(at) => match tokio::time::timeout_at(at, items.recv()).await {
                    Ok(item) => item,
                    Err(_) => {
                        let _ = tx.send(Err(EnvdError::deadline_of("the watch"))).await;
                        return;
                    }
                },
                None => items.recv().await,
            };
            let msg = match item {
                None => return,
                Some(WatchItem::Keepalive) => Ok(json!({"keepalive": {}})),
                Some(WatchItem::Event(e)) => match fs_event(e) {
                    Some(v) => Ok(json!({"filesystem": v})),
                    None => continue,
                },
                Some(WatchItem::Failed(e)) => Err(EnvdError::from(e)),
            };
            let last = msg.is_err();
            if tx.send(msg).await.is_err() || last {
                return;
            }
        }
    });
    server_stream(rx)
}

async fn create_watcher(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: WatchRequest = unary_request(&body)?;
        if watchers().len() >= MAX_WATCHERS {
            return Err(EnvdError::new(ErrorCode::SandboxCommandCapacity, "too many watchers; remove some first"));
        }
        let events = open(&app, &ctx, req, POLLED_KEEPALIVE).await?;
        let id = format!("w{}", NEXT_WATCHER.fetch_add(1, Ordering::Relaxed));
        watchers().insert(id.clone(), Watcher { sandbox: ctx.id.clone(), events });
        Ok::<_, EnvdError>(json!({"watcherId": id}))
    };
    run.await.map_or_else(unary_error, unary)
}

fn unknown(id: &str) -> EnvdError {
    EnvdError::new(ErrorCode::NotFound, format!("watcher {id} not found"))
}

async fn get_watcher_events(Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = || {
        let req: WatcherRequest = unary_request(&body)?;
        let id = req.watcher_id.unwrap_or_default();
        let mut table = watchers();
        let w = table.get_mut(&id).filter(|w| w.sandbox == ctx.id).ok_or_else(|| unknown(&id))?;
        let mut events = Vec::new();
        while events.len() < MAX_EVENTS {
            match w.events.try_recv() {
                Ok(WatchItem::Event(e)) => events.extend(fs_event(e)),
                Ok(WatchItem::Keepalive) => {}
                Ok(WatchItem::Failed(e)) => {
                    table.remove(&id);
                    return Err(EnvdError::from(e));
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    table.remove(&id);
                    if events.is_empty() {
                        return Err(EnvdError::new(ErrorCode::NotFound, format!("watcher {id} has ended")));
                    }
                    break;
                }
            }
        }
        Ok::<_, EnvdError>(json!({"events": events}))
    };
    run().map_or_else(unary_error, unary)
}

async fn remove_watcher(Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = || {
        let req: WatcherRequest = unary_request(&body)?;
        let id = req.watcher_id.unwrap_or_default();
        let mut table = watchers();
        if table.get(&id).is_none_or(|w| w.sandbox != ctx.id) {
            return Err(unknown(&id));
        }
        // Dropping the receiver closes the watch's agent connection.
        table.remove(&id);
        Ok::<_, EnvdError>(json!({}))
    };
    run().map_or_else(unary_error, unary)
}
