//! `GET /v1/sandboxes/{id}/pty`: an interactive terminal over a WebSocket
//! (the web console's terminal and `hutch exec -it`).
//!
//! Authentication is the API key, as on every `/v1` route: the
//! `Authorization: Bearer` header, or, because browsers cannot set headers
//! on a WebSocket, a subprotocol `hutch.bearer.<key>` offered beside
//! [`PROTOCOL`]. The key never goes in the URL (URLs end up in logs and
//! histories), and the answer names only [`PROTOCOL`], never the offered
//! key. Everything that can be refused is refused before the upgrade, as
//! the API's JSON errors: a bad query (400), no key (401), another owner's
//! or no sandbox (404), a sandbox not running (409), no command slot (429).
//!
//! On the socket, binary frames are terminal bytes both ways; text frames
//! from the client are JSON control messages ([`Control`]); the server's
//! text frames are `exit` (then it closes) and `error`. Output is bounded:
//! a frame is sent only when the previous one was written, and the
//! terminal's output waits in the agent (bounded) and then in the command.
//! Input the command does not read waits in one pending message, and the
//! socket is not read meanwhile. The server pings every [`PING_EVERY`]; a
//! client silent (no frame, no pong) for [`SILENT_LIMIT`] is closed. The
//! command is killed when the socket closes, for whatever reason.

use crate::extract::ApiPath;
use crate::listener::Conn;
use crate::{ApiError, ApiResult, App};
use axum::extract::rejection::ExtensionRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, RawQuery, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use hutch_api::ErrorCode;
use hutch_control::pty::{PtyEvent, PtyRequest, PtySession};
use hutch_control::{Caller, SandboxId};
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The subprotocol the server answers with.
pub const PROTOCOL: &str = "hutch.pty";
/// The prefix of the subprotocol that carries an API key.
pub const BEARER_PROTOCOL: &str = "hutch.bearer.";
/// Largest message a client may send (input is forwarded in these).
const MAX_MESSAGE: usize = 64 << 10;
pub const PING_EVERY: Duration = Duration::from_secs(30);
pub const SILENT_LIMIT: Duration = Duration::from_secs(90);
/// How long input the command does not read waits before it is offered
/// again.
const INPUT_RETRY: Duration = Duration::from_millis(20);

pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/sandboxes/{id}/pty", get(pty))
        .route_layer(middleware::from_fn_with_state(app, authenticate))
}

/// The API key of a WebSocket request: the bearer header, else the
/// subprotocol that carries it.
fn credential(req: &Request) -> String {
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if let Some(b) = bearer {
        return b.to_owned();
    }
    offered(req.headers()).find_map(|p| p.strip_prefix(BEARER_PROTOCOL).map(str::to_owned)).unwrap_or_default()
}

/// The subprotocols a request offers.
fn offered(headers: &axum::http::HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
}

async fn authenticate(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let secret = credential(&req);
    match app.control.authenticate_native(&secret).await {
        Ok(Some(caller)) => {
            if let Err(e) = crate::routes::admit(&caller, &req) {
                return e.into_response();
            }
            crate::listener::authenticated(&req);
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Ok(None) => ApiError::new(
            ErrorCode::Unauthorized,
            "a valid API key is required: Authorization: Bearer <key>, or the subprotocol hutch.bearer.<key>",
        )
        .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The query: `cols`, `rows`, `command`, `user`, `cwd`, and `env` as
/// `NAME=value` (repeatable).
fn parse_query(query: Option<&str>) -> ApiResult<PtyRequest> {
    let mut req = PtyRequest { cols: 80, rows: 24, ..PtyRequest::default() };
    let number = |k: &str, v: &str| {
        v.parse::<u16>()
            .map_err(|_| ApiError::invalid(format!("{k} must be a number of 1 to {}", hutch_control::pty::MAX_SIZE)))
    };
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match &*k {
            "cols" => req.cols = number("cols", &v)?,
            "rows" => req.rows = number("rows", &v)?,
            "command" => req.command = Some(v.into_owned()),
            "user" => req.user = Some(v.into_owned()),
            "cwd" => req.cwd = Some(v.into_owned()),
            "env" => match v.split_once('=') {
                Some((name, value)) => req.env.push((name.to_owned(), value.to_owned())),
                None => return Err(ApiError::invalid("env must be NAME=value")),
            },
            other => {
                let shown: String = other.chars().take(64).collect();
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {shown:?}: use cols, rows, command, user, cwd, env"
                )));
            }
        }
    }
    Ok(req)
}

/// A control message from the client.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum ClientMessage {
    Resize { cols: u16, rows: u16 },
    Signal { signal: serde_json::Value },
}

async fn pty(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    RawQuery(query): RawQuery,
    conn: Result<Extension<ConnectInfo<Conn>>, ExtensionRejection>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> ApiResult<Response> {
    let req = parse_query(query.as_deref())?;
    let ws = ws.map_err(|e| ApiError::invalid(format!("this route takes a WebSocket upgrade: {}", e.body_text())))?;
    let offers_ours = ws.requested_protocols().any(|p| p.as_bytes() == PROTOCOL.as_bytes());
    if ws.requested_protocols().next().is_some() && !offers_ours {
        return Err(ApiError::invalid(format!(
            "offer the subprotocol {PROTOCOL} (with hutch.bearer.<key> if no header carries the key)"
        )));
    }
    let id = SandboxId::parse(&id).map_err(ApiError::from)?;
    let session = app.control.open_pty(&caller, &id, &req).await?;
    let conn = conn.ok().map(|Extension(ConnectInfo(c))| c);
    let ws = ws.protocols([PROTOCOL]).max_message_size(MAX_MESSAGE).max_frame_size(MAX_MESSAGE);
    Ok(ws.on_upgrade(move |socket| async move {
        if let Some(c) = &conn {
            // The socket lives as long as the terminal: no idle timeout of
            // the listener applies; `serve` has its own.
            c.mark_upgraded();
        }
        let mut session = session;
        serve(socket, &mut session, conn).await;
        // Waited for here (a drop would only start it): at shutdown too.
        session.kill().await;
    }))
}

fn text(v: serde_json::Value) -> Message {
    Message::Text(v.to_string().into())
}

fn error_frame(e: &ApiError) -> Message {
    text(serde_json::json!({"type": "error", "code": e.code, "error": e.message}))
}

/// Runs the terminal until its command exits, the client leaves or goes
/// silent, or the daemon shuts down; the caller then kills the command
/// (which has nothing to do in the first case).
async fn serve(mut socket: WebSocket, session: &mut PtySession, conn: Option<Conn>) {
    let killed = async {
        match &conn {
            Some(c) => c.killed().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(killed);
    let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    let mut heard = Instant::now();
    // Input the command's buffer had no room for.
    let mut pending: Option<Vec<u8>> = None;
    let close = |code: u16, reason: &'static str| Message::Close(Some(CloseFrame { code, reason: reason.into() }));
    loop {
        tokio::select! {
            ev = session.next() => match ev {
                Some(PtyEvent::Output(data)) => {
                    if socket.send(Message::Binary(data.into())).await.is_err() {
                        return;
                    }
                }
                Some(PtyEvent::Exit { exit_code }) => {
                    let _ = socket.send(text(serde_json::json!({"type": "exit", "exit_code": exit_code}))).await;
                    let _ = socket.send(close(1000, "exited")).await;
                    return;
                }
                Some(PtyEvent::Failed(e)) => {
                    let _ = socket.send(error_frame(&ApiError::from(e))).await;
                    let _ = socket.send(close(1011, "sandbox link broken")).await;
                    return;
                }
                None => return,
            },
            msg = socket.recv(), if pending.is_none() => {
                heard = Instant::now();
                let result = match msg {
                    None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                    Some(Ok(Message::Binary(data))) => match session.input(&data).await {
                        Ok(true) => Ok(()),
                        Ok(false) => {
                            pending = Some(data.to_vec());
                            Ok(())
                        }
                        Err(e) => Err(ApiError::from(e)),
                    },
                    Some(Ok(Message::Text(t))) => match serde_json::from_str::<ClientMessage>(t.as_str()) {
                        Ok(ClientMessage::Resize { cols, rows }) => session.resize(cols, rows).await.map_err(ApiError::from),
                        Ok(ClientMessage::Signal { signal }) => session.signal(&signal).await.map_err(ApiError::from),
                        Err(e) => Err(ApiError::invalid(format!(
                            "control messages are {{\"type\":\"resize\",\"cols\":N,\"rows\":M}} or {{\"type\":\"signal\",\"signal\":\"INT\"}}: {e}"
                        ))),
                    },
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => Ok(()),
                };
                // A refused request (the command just exited, a bad
                // message) is reported; the terminal goes on.
                if let Err(e) = result {
                    if socket.send(error_frame(&e)).await.is_err() {
                        return;
                    }
                }
            },
            () = tokio::time::sleep(INPUT_RETRY), if pending.is_some() => {
                if let Some(data) = pending.take() {
                    match session.input(&data).await {
                        Ok(true) => {}
                        Ok(false) => pending = Some(data),
                        Err(e) => {
                            if socket.send(error_frame(&ApiError::from(e))).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            },
            _ = ping.tick() => {
                if heard.elapsed() >= SILENT_LIMIT {
                    let _ = socket.send(close(1001, "client silent")).await;
                    return;
                }
                if socket.send(Message::Ping(Default::default())).await.is_err() {
                    return;
                }
            },
            () = &mut killed => {
                let _ = socket.send(close(1001, "daemon shutting down")).await;
                return;
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> Request {
        let mut b = axum::http::Request::builder().uri("/v1/sandboxes/x/pty");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(axum::body::Body::empty()).expect("request")
    }

    #[test]
    fn the_key_comes_from_the_header_or_the_bearer_subprotocol() {
        assert_eq!(credential(&request(&[("authorization", "Bearer k1")])), "k1");
        let both = [("sec-websocket-protocol", "hutch.pty, hutch.bearer.k2")];
        assert_eq!(credential(&request(&both)), "k2");
        let header_wins = [("authorization", "Bearer k1"), ("sec-websocket-protocol", "hutch.bearer.k2")];
        assert_eq!(credential(&request(&header_wins)), "k1");
        assert_eq!(credential(&request(&[("sec-websocket-protocol", "hutch.pty")])), "");
        assert_eq!(credential(&request(&[])), "");
    }

    #[test]
    fn queries_are_parsed_strictly() {
        let q = parse_query(Some("cols=120&rows=40&command=top%20-b&user=root&cwd=src&env=A%3D1&env=B%3Dx%3Dy"))
            .expect("query");
        assert_eq!((q.cols, q.rows), (120, 40));
        assert_eq!(q.command.as_deref(), Some("top -b"));
        assert_eq!(q.user.as_deref(), Some("root"));
        assert_eq!(q.cwd.as_deref(), Some("src"));
        assert_eq!(q.env, [("A".to_owned(), "1".to_owned()), ("B".to_owned(), "x=y".to_owned())]);
        let d = parse_query(None).expect("defaults");
        assert_eq!((d.cols, d.rows, d.command), (80, 24, None));
        for bad in ["cols=-1", "rows=x", "rows=70000", "env=A", "token=k"] {
            assert!(parse_query(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn control_messages_are_resize_and_signal_only() {
        let m: ClientMessage = serde_json::from_str(r#"{"type":"resize","cols":100,"rows":30}"#).expect("resize");
        assert!(matches!(m, ClientMessage::Resize { cols: 100, rows: 30 }));
        let m: ClientMessage = serde_json::from_str(r#"{"type":"signal","signal":"INT"}"#).expect("signal");
        assert!(matches!(m, ClientMessage::Signal { .. }));
        for bad in [r#"{"type":"exit"}"#, r#"{"type":"resize","cols":-1,"rows":1}"#, r#"{"type":"resize"}"#, "[]"] {
            assert!(serde_json::from_str::<ClientMessage>(bad).is_err(), "{bad}");
        }
    }
}
