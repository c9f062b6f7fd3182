//! envd's directory watches over the agent's inotify watches: the
//! `WatchDir` server stream, and the polled watchers of `CreateWatcher`,
//! `GetWatcherEvents` and `RemoveWatcher`. Polled watchers are kept by the
//! control plane with their sandbox (at most 64 each, ended with it);
//! removing one closes its agent connection, which ends the watch in the
//! agent.

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
use hutch_control::session::{FsEvent, Polled, WatchItem, WatchKind, WatchOptions};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

type AppState = State<Arc<App>>;

/// Most events one `GetWatcherEvents` answer carries; the rest wait.
const MAX_EVENTS: usize = 4096;

pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/filesystem.Filesystem/WatchDir", post(watch_dir))
        .route("/filesystem.Filesystem/CreateWatcher", post(create_watcher))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(get_watcher_events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(remove_watcher))
}

/// envd's `FilesystemEvent`, or nothing for a kind E2B has no name for.
fn fs_event(e: FsEvent) -> Option<Value> {
    let kind = match e.kind {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
        WatchKind::Overflow => return None,
    };
    let mut v = json!({"name": e.name, "type": kind});
    if let Some(entry) = &e.entry {
        v["entry"] = super::envd::entry_info(entry);
    }
    Some(v)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatchRequest {
    path: Option<String>,
    #[serde(default)]
    recursive: bool,
    #[serde(default)]
    include_entry: bool,
    #[serde(default)]
    allow_network_mounts: bool,
}

impl WatchRequest {
    fn options(&self) -> WatchOptions {
        WatchOptions { include_entry: self.include_entry, allow_network_mounts: self.allow_network_mounts }
    }
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
    Ok(app.control.session_watch(ctx, path, req.recursive, req.options(), keepalive).await?)
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
        let path = ctx.resolve(req.path.as_deref().unwrap_or(""))?;
        let id = app.control.create_watcher(&ctx, path, req.recursive, req.options()).await?;
        Ok::<_, EnvdError>(json!({"watcherId": id}))
    };
    run.await.map_or_else(unary_error, unary)
}

async fn get_watcher_events(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: WatcherRequest = unary_request(&body)?;
        let id = req.watcher_id.unwrap_or_default();
        let events = match app.control.poll_watcher(&ctx, &id, MAX_EVENTS).await? {
            Polled::Events(e) | Polled::Ended(e) => e,
        };
        let events: Vec<Value> = events.into_iter().filter_map(fs_event).collect();
        Ok::<_, EnvdError>(json!({"events": events}))
    };
    run.await.map_or_else(unary_error, unary)
}

async fn remove_watcher(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: WatcherRequest = unary_request(&body)?;
        app.control.remove_watcher(&ctx, &req.watcher_id.unwrap_or_default()).await?;
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}
