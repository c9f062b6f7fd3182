//! The Connect protocol (HTTP/1.1, JSON codec) and envd's `process.Process`
//! service over `Control`'s process sessions: unary calls answer JSON,
//! server streams answer enveloped JSON messages ending in an end-of-stream
//! message that carries any error.

use super::envd::Envd;
use super::EnvdError;
use crate::{App, ChannelBody};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use base64::Engine;
use hutch_api::ErrorCode;
use hutch_control::session::{ProcEvent, ProcSpec, ProcStream, PtySize, Target};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

type AppState = State<Arc<App>>;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Largest request message.
const MAX_MESSAGE: usize = 8 << 20;

pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(connect))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendInput", post(send_input))
        .route("/process.Process/StreamInput", post(stream_input))
        .route("/process.Process/CloseStdin", post(close_stdin))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/Update", post(update))
}

/// A unary answer.
pub fn unary(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// A unary error.
pub fn unary_error(e: EnvdError) -> Response {
    let (code, status) = e.connect();
    let mut resp =
        (status, [(header::CONTENT_TYPE, "application/json")], json!({"code": code, "message": e.message}).to_string())
            .into_response();
    resp.extensions_mut().insert(e.code);
    resp
}

/// A unary request body (plain JSON).
pub fn unary_request<T: DeserializeOwned>(body: &Bytes) -> Result<T, EnvdError> {
    let text: &[u8] = if body.is_empty() { b"{}" } else { body };
    serde_json::from_slice(text).map_err(|e| EnvdError::new(ErrorCode::InvalidRequest, format!("request: {e}")))
}

/// The one message of a server-stream request: a 5-byte envelope, then JSON.
pub fn stream_request<T: DeserializeOwned>(body: &Bytes) -> Result<T, EnvdError> {
    let bad = |m: String| EnvdError::new(ErrorCode::InvalidRequest, m);
    if body.len() < 5 {
        return Err(bad("the request holds no enveloped message".into()));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if body[0] & 0x01 != 0 {
        return Err(bad("compressed messages are not supported".into()));
    }
    if len > MAX_MESSAGE || body.len() < 5 + len {
        return Err(bad("the enveloped message is truncated or too large".into()));
    }
    let msg: &[u8] = if len == 0 { b"{}" } else { &body[5..5 + len] };
    serde_json::from_slice(msg).map_err(|e| bad(format!("request: {e}")))
}

fn envelope(flags: u8, v: &Value) -> Bytes {
    let payload = v.to_string().into_bytes();
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    Bytes::from(out)
}

/// A server stream fed by `rx` (messages; `Err` ends it with that error).
pub fn server_stream(mut rx: mpsc::Receiver<Result<Value, EnvdError>>) -> Response {
    let (tx, body_rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let mut end = json!({});
        while let Some(item) = rx.recv().await {
            match item {
                Ok(v) => {
                    if tx.send(Ok(envelope(0, &v))).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let (code, _) = e.connect();
                    end = json!({"error": {"code": code, "message": e.message}});
                    break;
                }
            }
        }
        let _ = tx.send(Ok(envelope(0x02, &end))).await;
    });
    let mut resp = ChannelBody(body_rx).into_body().into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    resp
}

/// A stream that is only an error.
pub fn stream_error(e: EnvdError) -> Response {
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(Err(e));
    server_stream(rx)
}

/// `Connect-Timeout-Ms`, if any.
pub fn timeout_ms(headers: &HeaderMap) -> Option<u64> {
    super::header(headers, "connect-timeout-ms").and_then(|v| v.trim().parse().ok()).filter(|&ms| ms > 0)
}

/// How often a quiet stream carries a keepalive.
pub fn keepalive(headers: &HeaderMap) -> Duration {
    let secs = super::header(headers, "keepalive-ping-interval").and_then(|v| v.trim().parse().ok()).unwrap_or(15u64);
    Duration::from_secs(secs.clamp(1, 30))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

fn target(s: Option<Selector>) -> Result<Target, EnvdError> {
    match s.unwrap_or_default() {
        Selector { pid: Some(pid), .. } => Ok(Target::Pid(pid)),
        Selector { tag: Some(tag), .. } => Ok(Target::Tag(tag)),
        _ => Err(EnvdError::new(ErrorCode::InvalidRequest, "a process selector (pid or tag) is required")),
    }
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize, Default)]
struct Size {
    #[serde(default)]
    cols: u32,
    #[serde(default)]
    rows: u32,
}

#[derive(Deserialize, Default)]
struct Pty {
    size: Option<Size>,
}

fn pty_size(p: Option<Pty>) -> Result<Option<PtySize>, EnvdError> {
    let Some(p) = p else { return Ok(None) };
    let s = p.size.unwrap_or(Size { cols: 80, rows: 24 });
    let (Ok(cols), Ok(rows)) = (u16::try_from(s.cols), u16::try_from(s.rows)) else {
        return Err(EnvdError::new(ErrorCode::InvalidRequest, "pty size out of range"));
    };
    Ok(Some(PtySize { cols: cols.max(1), rows: rows.max(1) }))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct StartRequest {
    process: Option<ProcessConfig>,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// Process events as envd's `ProcessEvent` messages, wrapped as `{event}`.
fn forward(mut events: mpsc::Receiver<ProcEvent>) -> mpsc::Receiver<Result<Value, EnvdError>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            let item = match ev {
                ProcEvent::Start { pid } => Ok(json!({"start": {"pid": pid}})),
                ProcEvent::Data { stream, data } => {
                    let key = match stream {
                        ProcStream::Stdout => "stdout",
                        ProcStream::Stderr => "stderr",
                        ProcStream::Pty => "pty",
                    };
                    Ok(json!({"data": {key: B64.encode(data)}}))
                }
                ProcEvent::Keepalive => Ok(json!({"keepalive": {}})),
                ProcEvent::End { status } if status.timed_out => Err(EnvdError::deadline()),
                ProcEvent::End { status } => {
                    let text = match (status.code, status.signal) {
                        (Some(c), _) => format!("exit status {c}"),
                        (None, Some(s)) => format!("signal: {}", signal_name(s)),
                        (None, None) => "exited".into(),
                    };
                    Ok(
                        json!({"end": {"exitCode": status.shell_code(), "exited": status.code.is_some(), "status": text}}),
                    )
                }
                ProcEvent::Failed(e) => Err(EnvdError::from(e)),
            };
            let last = item.is_err() || item.as_ref().is_ok_and(|v| v.get("end").is_some());
            let item = item.map(|event| json!({"event": event}));
            if tx.send(item).await.is_err() || last {
                return;
            }
        }
    });
    rx
}

fn signal_name(s: i32) -> String {
    match s {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        other => format!("signal {other}"),
    }
}

async fn start(State(app): AppState, Extension(ctx): Extension<Envd>, headers: HeaderMap, body: Bytes) -> Response {
    let req: StartRequest = match stream_request(&body) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let Some(p) = req.process else {
        return stream_error(EnvdError::new(ErrorCode::InvalidRequest, "process is required"));
    };
    let pty = match pty_size(req.pty) {
        Ok(p) => p,
        Err(e) => return stream_error(e),
    };
    let cwd = match ctx.resolve(p.cwd.as_deref().unwrap_or("")) {
        Ok(c) => c,
        Err(e) => return stream_error(e.into()),
    };
    let mut argv = vec![p.cmd];
    argv.extend(p.args);
    let spec = ProcSpec {
        argv,
        env: p.envs.into_iter().collect(),
        cwd: Some(cwd),
        pty,
        tag: req.tag,
        stdin: req.stdin.unwrap_or(pty.is_some()),
        // The client gives up at the same deadline: kill the command a little
        // before it, so that by the time the client sees its timeout the
        // command is gone, not still dying.
        timeout_ms: timeout_ms(&headers).map(|ms| ms.saturating_sub((ms / 10).min(100)).max(1)),
    };
    match app.control.session_start(&ctx, spec, keepalive(&headers)).await {
        Ok(events) => server_stream(forward(events)),
        Err(e) => stream_error(e.into()),
    }
}

#[derive(Deserialize, Default)]
struct ConnectRequest {
    process: Option<Selector>,
}

async fn connect(State(app): AppState, Extension(ctx): Extension<Envd>, headers: HeaderMap, body: Bytes) -> Response {
    let req: ConnectRequest = match stream_request(&body) {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let t = match target(req.process) {
        Ok(t) => t,
        Err(e) => return stream_error(e),
    };
    match app.control.session_connect(&ctx, &t, keepalive(&headers)).await {
        Ok(events) => server_stream(forward(events)),
        Err(e) => stream_error(e.into()),
    }
}

async fn list(State(app): AppState, Extension(ctx): Extension<Envd>) -> Response {
    match app.control.session_list(&ctx).await {
        Ok(procs) => {
            let processes: Vec<Value> = procs
                .into_iter()
                .map(|p| {
                    let mut argv = p.argv.into_iter();
                    let cmd = argv.next().unwrap_or_default();
                    let args: Vec<String> = argv.collect();
                    let mut v =
                        json!({"pid": p.pid, "config": {"cmd": cmd, "args": args, "envs": p.env, "cwd": p.cwd}});
                    if let Some(tag) = p.tag {
                        v["tag"] = json!(tag);
                    }
                    v
                })
                .collect();
            unary(json!({"processes": processes}))
        }
        Err(e) => unary_error(e.into()),
    }
}

#[derive(Deserialize, Default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Deserialize, Default)]
struct SendInputRequest {
    process: Option<Selector>,
    input: Option<Input>,
}

async fn send_input(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: SendInputRequest = unary_request(&body)?;
        let t = target(req.process)?;
        let input = req.input.unwrap_or_default();
        let data = input.stdin.or(input.pty).unwrap_or_default();
        let data = B64
            .decode(data.as_bytes())
            .map_err(|_| EnvdError::new(ErrorCode::InvalidRequest, "input is not base64"))?;
        app.control.session_input(&ctx, &t, &data).await?;
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}

#[derive(Deserialize, Default)]
struct CloseStdinRequest {
    process: Option<Selector>,
}

async fn close_stdin(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: CloseStdinRequest = unary_request(&body)?;
        let t = target(req.process)?;
        app.control.session_close_stdin(&ctx, &t).await?;
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}

#[derive(Deserialize, Default)]
struct SendSignalRequest {
    process: Option<Selector>,
    signal: Option<Value>,
}

async fn send_signal(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: SendSignalRequest = unary_request(&body)?;
        let t = target(req.process)?;
        let sig = match req.signal {
            Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => 9,
            Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => 15,
            Some(Value::Number(n)) if n.as_i64() == Some(9) || n.as_i64() == Some(15) => {
                n.as_i64().unwrap_or(15) as i32
            }
            _ => {
                return Err(EnvdError::new(
                    ErrorCode::InvalidRequest,
                    "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL",
                ))
            }
        };
        app.control.session_signal(&ctx, &t, sig).await?;
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}

#[derive(Deserialize, Default)]
struct UpdateRequest {
    process: Option<Selector>,
    pty: Option<Pty>,
}

async fn update(State(app): AppState, Extension(ctx): Extension<Envd>, body: Bytes) -> Response {
    let run = async {
        let req: UpdateRequest = unary_request(&body)?;
        let t = target(req.process)?;
        if let Some(size) = pty_size(req.pty)? {
            app.control.session_resize(&ctx, &t, size).await?;
        }
        Ok::<_, EnvdError>(json!({}))
    };
    run.await.map_or_else(unary_error, unary)
}

#[derive(Deserialize, Default)]
struct StreamInputStart {
    process: Option<Selector>,
}

#[derive(Deserialize, Default)]
struct StreamInputData {
    input: Option<Input>,
}

/// One message of a `StreamInput` client stream.
#[derive(Deserialize, Default)]
struct StreamInputRequest {
    start: Option<StreamInputStart>,
    data: Option<StreamInputData>,
}

/// Splits the complete enveloped messages off the front of `buf`.
pub(crate) fn take_messages<T: DeserializeOwned>(buf: &mut Vec<u8>) -> Result<Vec<T>, EnvdError> {
    let bad = |m: String| EnvdError::new(ErrorCode::InvalidRequest, m);
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len() - at >= 5 {
        let len = u32::from_be_bytes([buf[at + 1], buf[at + 2], buf[at + 3], buf[at + 4]]) as usize;
        if buf[at] & 0x01 != 0 {
            return Err(bad("compressed messages are not supported".into()));
        }
        if len > MAX_MESSAGE {
            return Err(bad("an enveloped message is too large".into()));
        }
        if buf.len() - at < 5 + len {
            break;
        }
        let msg: &[u8] = if len == 0 { b"{}" } else { &buf[at + 5..at + 5 + len] };
        out.push(serde_json::from_slice(msg).map_err(|e| bad(format!("request: {e}")))?);
        at += 5 + len;
    }
    buf.drain(..at);
    Ok(out)
}

/// `StreamInput`: a client stream of a start message naming the process,
/// then input messages, each written as it arrives, in order.
async fn stream_input(State(app): AppState, Extension(ctx): Extension<Envd>, body: axum::body::Body) -> Response {
    let run = async {
        let mut chunks = body.into_data_stream();
        let mut buf = Vec::new();
        let mut target_of: Option<Target> = None;
        loop {
            let next =
                std::future::poll_fn(|cx| futures_core::Stream::poll_next(std::pin::Pin::new(&mut chunks), cx)).await;
            let Some(chunk) = next else { break };
            let chunk = chunk.map_err(|e| EnvdError::new(ErrorCode::InvalidRequest, format!("request body: {e}")))?;
            buf.extend_from_slice(&chunk);
            for msg in take_messages::<StreamInputRequest>(&mut buf)? {
                if let Some(start) = msg.start {
                    target_of = Some(target(start.process)?);
                } else if let Some(data) = msg.data {
                    let t = target_of
                        .as_ref()
                        .ok_or_else(|| EnvdError::new(ErrorCode::InvalidRequest, "the first message must be start"))?;
                    let input = data.input.unwrap_or_default();
                    let bytes = B64
                        .decode(input.stdin.or(input.pty).unwrap_or_default().as_bytes())
                        .map_err(|_| EnvdError::new(ErrorCode::InvalidRequest, "input is not base64"))?;
                    app.control.session_input(&ctx, t, &bytes).await?;
                }
            }
        }
        if !buf.is_empty() {
            return Err(EnvdError::new(ErrorCode::InvalidRequest, "the request ends inside a message"));
        }
        Ok::<_, EnvdError>(json!({}))
    };
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(run.await);
    server_stream(rx)
}
