//! The MCP server: `/mcp` on the daemon, the Model Context Protocol over
//! streamable HTTP (the `rmcp` crate), behind the same bearer
//! authentication as `/v1` (`routes::authenticate` puts the key's `Caller`
//! into the request, and every tool reads it from there).
//!
//! The tools are thin: each parses its arguments (typed, with a JSON
//! schema from their doc comments), makes the calls of the control plane a
//! native route would make, and renders the answer. A refusal is an MCP
//! tool error (`isError: true`) whose structured content is the API's
//! error body, `{"error", "code"}`, with the stable code of
//! `ControlError::code`; arguments that do not fit the schema are
//! `invalid_request` the same way.
//!
//! Sessions. An MCP session (one `initialize`, its `Mcp-Session-Id`) is
//! bound to the key that opened it. A tool called without `sandbox_id`
//! runs in the session's default sandbox, created (from the `base`
//! template) on first use; `create_sandbox` makes its new sandbox the
//! default. Sandboxes the session created end with the session (a DELETE
//! of it, or `SESSION_IDLE` without a request) unless the call that
//! created them said `keep: true`. `hutch mcp` (stdio) is a bridge to this
//! endpoint, so both transports run this one implementation.
//!
//! Only the protocol revisions with the `initialize` handshake are
//! offered: the stateless revision (2026-07-28) has no session to tie a
//! default sandbox to, and its clients fall back to the handshake.

use crate::routes::Caller;
use crate::App;
use axum::http::request::Parts;
use hutch_api::{CreateAccess, CreateSandbox, ErrorCode, ExecRequest, ExecResult, SandboxState};
use hutch_control::exec::ExecReply;
use hutch_control::{Control, ControlError, SandboxId};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, InitializeRequestParams,
    InitializeResult, ProtocolVersion, ServerCapabilities, ServerConfig,
};
use rmcp::schemars::{self, JsonSchema};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::{LocalSessionManager, SessionConfig};
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{tool, tool_handler, tool_router, RoleServer, ServerHandler};
use serde::Deserialize;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A session with no request for this long ends, and its sandboxes with it.
pub const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);

/// The largest request body the MCP endpoint reads (the transport refuses
/// more while it streams, whatever `Content-Length` says): what bounds a
/// `write_file`'s content to about 4 MiB of text or 3 MiB of base64'd bytes.
pub const MAX_REQUEST_BODY: usize = 4 << 20;

/// Most entries `list_files` answers with.
const LIST_MAX: u32 = 1000;

/// The `/mcp` service: one `Session` per MCP session. When `stop` is
/// cancelled (the daemon is stopping) every session ends, and the
/// sandboxes of the sessions live on to their expiry: a session does not
/// survive a restart, but a restart is no reason to delete work.
pub fn service(app: Arc<App>, stop: CancellationToken) -> StreamableHttpService<Session, LocalSessionManager> {
    let mut sessions = LocalSessionManager::default();
    let mut cfg = SessionConfig::default();
    cfg.keep_alive = Some(SESSION_IDLE);
    sessions.session_config = cfg;
    // Every request carries an API key: a page that rebinds a name to us
    // has none, so Host and Origin are not what guards this endpoint.
    // Streams keep rmcp's pings (a long command's answer waits on one).
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_max_request_body_bytes(MAX_REQUEST_BODY)
        .with_cancellation_token(stop.child_token());
    let control = app.control.clone();
    StreamableHttpService::new(move || Ok(Session::new(control.clone(), stop.clone())), Arc::new(sessions), config)
}

/// What a session holds: its key, its default sandbox, and the sandboxes
/// that end with it. Dropped when the session ends (every clone of the
/// `Session` gone), which ends those sandboxes.
struct SessionState {
    control: Arc<Control>,
    /// Cancelled when the daemon stops.
    stop: CancellationToken,
    inner: tokio::sync::Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    caller: Option<Caller>,
    default: Option<SandboxId>,
    /// Created by this session without `keep`.
    owned: Vec<SandboxId>,
}

impl Drop for SessionState {
    fn drop(&mut self) {
        let inner = self.inner.get_mut();
        let (Some(caller), owned) = (inner.caller.take(), std::mem::take(&mut inner.owned)) else {
            return;
        };
        if owned.is_empty() {
            return;
        }
        if self.stop.is_cancelled() {
            tracing::info!(
                sandboxes = owned.len(),
                "MCP session ended with the daemon; its sandboxes live to their expiry"
            );
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                sandboxes = owned.len(),
                "MCP session ended outside the runtime; its sandboxes live to their expiry"
            );
            return;
        };
        let control = self.control.clone();
        rt.spawn(async move {
            for id in owned {
                match control.delete(&caller, &id).await {
                    Ok(_) | Err(ControlError::NoSandbox(_)) => {
                        tracing::info!(sandbox = %id.as_str(), "ended with its MCP session")
                    }
                    Err(e) => tracing::warn!(sandbox = %id.as_str(), "ending with its MCP session: {e}"),
                }
            }
        });
    }
}

/// One MCP session's handler.
#[derive(Clone)]
pub struct Session {
    state: Arc<SessionState>,
    tool_router: ToolRouter<Session>,
}

/// A refusal, rendered as a tool error.
struct Refusal {
    code: ErrorCode,
    message: String,
}

impl Refusal {
    fn new(code: ErrorCode, message: impl Into<String>) -> Refusal {
        let message = message.into();
        Refusal { message: hutch_control::error::public_message(code, &message), code }
    }

    fn invalid(message: impl Into<String>) -> Refusal {
        Refusal::new(ErrorCode::InvalidRequest, message)
    }
}

impl From<ControlError> for Refusal {
    fn from(e: ControlError) -> Refusal {
        Refusal { code: e.code(), message: e.public_message() }
    }
}

impl From<hutch_control::files::FilesError> for Refusal {
    fn from(e: hutch_control::files::FilesError) -> Refusal {
        Refusal::new(e.code, e.message)
    }
}

/// A tool error carrying the API's error body.
fn tool_error(code: ErrorCode, message: &str) -> CallToolResult {
    CallToolResult::structured_error(json!({ "error": message, "code": code }))
}

type ToolResult = Result<CallToolResult, rmcp::ErrorData>;

/// A tool's answer: its result, or its refusal as a tool error.
fn answer(r: Result<CallToolResult, Refusal>) -> ToolResult {
    Ok(r.unwrap_or_else(|e| tool_error(e.code, &e.message)))
}

/// The HTTP request a tool call came in, when it came over HTTP.
fn parts(ctx: &RequestContext<RoleServer>) -> Option<&Parts> {
    ctx.extensions.get::<Parts>()
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxArgs {
    /// Template name; `base` (the host's userland) when absent.
    #[serde(default)]
    pub template: Option<String>,
    /// Lifetime in seconds from now; the template's default when absent.
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    /// Memory limit in MiB (64 to 262144); the template's when absent.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Environment of every process in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels (at most 64).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Keep the sandbox when this MCP session ends (default false: it is
    /// deleted with the session). It lives to its expiry either way.
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    #[default]
    Python,
    Bash,
    Node,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeArgs {
    /// The program's source (passed as one argument: at most 128 KiB).
    pub code: String,
    /// `python` (python3 -c, the default), `bash` (bash -c) or `node` (node -e).
    #[serde(default)]
    pub language: Language,
    /// Kill it after this many seconds (1 to 86400; default 60).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    /// The sandbox to use; the session's default sandbox (created on first
    /// use) when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// When this call creates the session's default sandbox: keep it after
    /// the session ends (default false).
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// A shell command line (bash -c). Give this or `argv`.
    #[serde(default)]
    pub command: Option<String>,
    /// A program and its arguments, run without a shell.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// Working directory; /workspace when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment of the command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// `user` (default) or `root` (root of the sandbox, not of the host).
    #[serde(default)]
    pub user: Option<String>,
    /// Text written to the command's stdin, then closed.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Kill it after this many seconds (1 to 86400; default 60).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    /// The sandbox to use; the session's default sandbox (created on first
    /// use) when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// When this call creates the session's default sandbox: keep it after
    /// the session ends (default false).
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// Absolute, or relative to /workspace.
    pub path: String,
    /// The sandbox to use; the session's default sandbox (created on first
    /// use) when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// When this call creates the session's default sandbox: keep it after
    /// the session ends (default false).
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// `content` is the file's text.
    #[default]
    Utf8,
    /// `content` is the file's bytes in base64.
    Base64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// Absolute, or relative to /workspace. Missing parent directories are made.
    pub path: String,
    /// The new content (the whole request is at most 4 MiB: about 4 MiB of
    /// text, 3 MiB of bytes as base64); replaces the file whole.
    pub content: String,
    /// `utf8` (default) or `base64`.
    #[serde(default)]
    pub encoding: Encoding,
    /// The sandbox to use; the session's default sandbox (created on first
    /// use) when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// When this call creates the session's default sandbox: keep it after
    /// the session ends (default false).
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The directory; /workspace when absent.
    #[serde(default)]
    pub path: Option<String>,
    /// Everything below (default false: direct entries only).
    #[serde(default)]
    pub recursive: bool,
    /// The sandbox to use; the session's default sandbox (created on first
    /// use) when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// When this call creates the session's default sandbox: keep it after
    /// the session ends (default false).
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposePortArgs {
    /// The TCP port a server listens on inside the sandbox (1 to 65532).
    pub port: u16,
    /// How long the URL's token works: 1 to 300 seconds (default 300).
    #[serde(default)]
    pub expires_in_seconds: Option<u64>,
    /// The sandbox to use; the session's default sandbox (created on first
    /// use) when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// When this call creates the session's default sandbox: keep it after
    /// the session ends (default false).
    #[serde(default)]
    pub keep: bool,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteSandboxArgs {
    /// The sandbox to delete; the session's default sandbox when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

/// An exec result as the tools answer it.
fn exec_answer(id: &SandboxId, r: ExecResult) -> CallToolResult {
    CallToolResult::structured(json!({
        "sandbox_id": id.as_str(),
        "stdout": r.stdout,
        "stderr": r.stderr,
        "exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "oom_killed": r.oom_killed,
        "stdout_truncated": r.stdout_truncated,
        "stderr_truncated": r.stderr_truncated,
        "duration_ms": r.duration_ms,
    }))
}

/// The image type of `data` by its magic bytes, for the kinds MCP clients show.
fn image_mime(data: &[u8]) -> Option<&'static str> {
    if data.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if data.starts_with(b"\xff\xd8\xff") {
        Some("image/jpeg")
    } else if data.starts_with(b"GIF87a") || data.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if data.len() >= 12 && &data[..4] == b"RIFF" && &data[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// How `run_code` runs python: as `python3 -c` would (the code compiled as
/// `<string>` in a fresh `__main__`, `sys.argv == ['-c']`), with
/// matplotlib on its file backend, and then every open matplotlib figure
/// saved as a PNG into `$HUTCH_MCP_FIGURES` (at most 8), which the tool
/// returns as images. The variable is removed before the code runs.
const PYTHON_RUNNER: &str = r#"import os as _o, sys as _s
_o.environ.setdefault("MPLBACKEND", "Agg")
_d = _o.environ.pop("HUTCH_MCP_FIGURES", "")
_c = _s.argv.pop(1)
def _figures():
    p = _s.modules.get("matplotlib.pyplot")
    if p is None or not _d:
        return
    try:
        nums = p.get_fignums()[:8]
        if nums:
            _o.makedirs(_d, exist_ok=True)
        for i, n in enumerate(nums):
            p.figure(n).savefig(_o.path.join(_d, "%02d.png" % i), format="png")
    except Exception as e:
        print("hutch: could not save the figures: %r" % (e,), file=_s.stderr)
try:
    exec(compile(_c, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException:
    # As the interpreter reports it, without this runner's frame.
    import traceback as _t
    _e = _s.exc_info()
    _t.print_exception(_e[0], _e[1], _e[2].tb_next if _e[2] else None)
    _s.exit(1)
finally:
    _figures()
"#;

/// A directory of the sandbox's /tmp for one run's figures.
fn figures_dir() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("/tmp/.hutch-mcp-figures-{}-{n}-{nanos}", std::process::id())
}

/// The tools that change something (audited); the others only read.
const MUTATING_TOOLS: &[&str] = &["create_sandbox", "run_code", "exec", "write_file", "expose_port", "delete_sandbox"];

/// Default command timeout of the tools (an agent waits for the answer).
const DEFAULT_TIMEOUT: u64 = 60;

impl Session {
    fn new(control: Arc<Control>, stop: CancellationToken) -> Session {
        Session {
            state: Arc::new(SessionState { control, stop, inner: tokio::sync::Mutex::new(Inner::default()) }),
            tool_router: Self::tool_router(),
        }
    }

    fn control(&self) -> &Arc<Control> {
        &self.state.control
    }

    /// The caller of this request: the key's, which must be the key that
    /// opened the session.
    async fn caller(&self, ctx: &RequestContext<RoleServer>) -> Result<Caller, Refusal> {
        let Some(caller) = parts(ctx).and_then(|p| p.extensions.get::<Caller>()).cloned() else {
            return Err(Refusal::new(ErrorCode::Unauthorized, "a valid API key is required"));
        };
        let mut inner = self.state.inner.lock().await;
        match &inner.caller {
            None => inner.caller = Some(caller.clone()),
            Some(bound) if *bound != caller => {
                return Err(Refusal::new(ErrorCode::Unauthorized, "this MCP session belongs to another API key"))
            }
            Some(_) => {}
        }
        Ok(caller)
    }

    /// The sandbox a tool runs in: the named one, or the session's default
    /// (created now if it has none, or if it has ended: expired, or deleted
    /// elsewhere; the answer's `sandbox_id` then names the new one).
    async fn target(&self, caller: &Caller, sandbox_id: Option<&str>, keep: bool) -> Result<SandboxId, Refusal> {
        if let Some(id) = sandbox_id {
            return Ok(SandboxId::parse(id)?);
        }
        let mut inner = self.state.inner.lock().await;
        if let Some(id) = inner.default.clone() {
            match self.control().get(caller, &id).await {
                Ok(sb) if !matches!(sb.state, SandboxState::Terminating | SandboxState::Terminated) => return Ok(id),
                Ok(_) | Err(ControlError::NoSandbox(_)) => {
                    inner.owned.retain(|o| *o != id);
                    inner.default = None;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let (sb, _) = self.control().create(caller, &CreateSandbox::default(), None).await?;
        let id = SandboxId::parse(&sb.id)?;
        if !keep {
            inner.owned.push(id.clone());
        }
        inner.default = Some(id.clone());
        Ok(id)
    }

    async fn run(&self, caller: &Caller, id: &SandboxId, req: ExecRequest) -> Result<CallToolResult, Refusal> {
        match self.control().exec(caller, id, &req, None, None).await? {
            ExecReply::Result(r) => Ok(exec_answer(id, r)),
            ExecReply::Background(_) | ExecReply::Execution(_) => {
                Err(Refusal::new(ErrorCode::Internal, "a foreground command answered as a background one"))
            }
        }
    }

    async fn do_create(
        &self,
        ctx: &RequestContext<RoleServer>,
        a: CreateSandboxArgs,
    ) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let req = CreateSandbox {
            template: a.template,
            ttl_seconds: a.ttl_seconds,
            memory_mb: a.memory_mb,
            env: a.env,
            metadata: a.metadata,
            ..CreateSandbox::default()
        };
        let (sb, _) = self.control().create(&caller, &req, None).await?;
        let id = SandboxId::parse(&sb.id)?;
        let mut inner = self.state.inner.lock().await;
        if !a.keep {
            inner.owned.push(id.clone());
        }
        inner.default = Some(id);
        drop(inner);
        let mut v = serde_json::to_value(&sb).map_err(|e| Refusal::new(ErrorCode::Internal, e.to_string()))?;
        v["kept"] = Value::Bool(a.keep);
        Ok(CallToolResult::structured(v))
    }

    async fn do_run_code(&self, ctx: &RequestContext<RoleServer>, a: RunCodeArgs) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let id = self.target(&caller, a.sandbox_id.as_deref(), a.keep).await?;
        let timeout_seconds = Some(a.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT));
        let (argv, figures) = match a.language {
            Language::Python => {
                let dir = figures_dir();
                (vec!["python3".into(), "-c".into(), PYTHON_RUNNER.into(), a.code], Some(dir))
            }
            Language::Bash => (vec!["bash".into(), "-c".into(), a.code], None),
            Language::Node => (vec!["node".into(), "-e".into(), a.code], None),
        };
        let mut env = BTreeMap::new();
        if let Some(dir) = &figures {
            env.insert("HUTCH_MCP_FIGURES".to_owned(), dir.clone());
        }
        let req =
            ExecRequest { argv: Some(argv), env, timeout_seconds, keep_output: Some(false), ..ExecRequest::default() };
        let mut answer = self.run(&caller, &id, req).await?;
        if let Some(dir) = figures {
            let images = self.figures(&caller, &id, &dir).await;
            if let Some(v) = answer.structured_content.as_mut() {
                v["images"] = json!(images.len());
            }
            answer.content =
                vec![ContentBlock::text(answer.structured_content.clone().unwrap_or_default().to_string())];
            answer.content.extend(images);
        }
        Ok(answer)
    }

    /// The figures a python run left in `dir` (PNG, in order), then `dir`
    /// removed. Best effort: a figure that cannot be read is left out.
    async fn figures(&self, caller: &Caller, id: &SandboxId, dir: &str) -> Vec<ContentBlock> {
        let Ok(fs) = self.control().fs(caller, id).await else { return Vec::new() };
        let opts =
            hutch_control::files::ListOptions { recursive: false, include_sha256: false, limit: 64, cursor: None };
        let Ok(listing) = fs.list(dir, opts).await else { return Vec::new() };
        let mut images = Vec::new();
        for e in listing.entries.iter().filter(|e| e.kind == "file" && e.path.ends_with(".png")) {
            if let Ok(data) = fs.read(&format!("{dir}/{}", e.path)).await {
                if image_mime(&data) == Some("image/png") {
                    use base64::Engine;
                    images.push(ContentBlock::image(
                        base64::engine::general_purpose::STANDARD.encode(&data),
                        "image/png",
                    ));
                }
            }
        }
        let rm = ExecRequest {
            argv: Some(vec!["rm".into(), "-rf".into(), "--".into(), dir.to_owned()]),
            timeout_seconds: Some(30),
            keep_output: Some(false),
            ..ExecRequest::default()
        };
        if let Err(e) = self.control().exec(caller, id, &rm, None, None).await {
            tracing::debug!(sandbox = %id.as_str(), "removing {dir}: {e}");
        }
        images
    }

    async fn do_exec(&self, ctx: &RequestContext<RoleServer>, a: ExecArgs) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        if a.command.is_some() == a.argv.is_some() {
            return Err(Refusal::invalid("give exactly one of command and argv"));
        }
        let id = self.target(&caller, a.sandbox_id.as_deref(), a.keep).await?;
        let req = ExecRequest {
            command: a.command,
            argv: a.argv,
            env: a.env,
            cwd: a.cwd,
            user: a.user,
            stdin: a.stdin,
            timeout_seconds: Some(a.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT)),
            keep_output: Some(false),
            background: None,
        };
        self.run(&caller, &id, req).await
    }

    async fn do_read_file(&self, ctx: &RequestContext<RoleServer>, a: ReadFileArgs) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let id = self.target(&caller, a.sandbox_id.as_deref(), a.keep).await?;
        let data = self.control().fs(&caller, &id).await?.read(&a.path).await?;
        use base64::Engine;
        if let Some(mime) = image_mime(&data) {
            let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
            return Ok(CallToolResult::success(vec![ContentBlock::image(b64, mime)]));
        }
        Ok(match String::from_utf8(data) {
            Ok(text) => CallToolResult::success(vec![ContentBlock::text(text)]),
            Err(e) => CallToolResult::structured(json!({
                "path": a.path,
                "encoding": "base64",
                "size": e.as_bytes().len(),
                "content": base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            })),
        })
    }

    async fn do_write_file(
        &self,
        ctx: &RequestContext<RoleServer>,
        a: WriteFileArgs,
    ) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let path = hutch_control::files::normalize(&a.path)?;
        let id = self.target(&caller, a.sandbox_id.as_deref(), a.keep).await?;
        let fs = self.control().fs(&caller, &id).await?;
        let write = || async {
            match a.encoding {
                Encoding::Utf8 => fs.write(&path, a.content.as_bytes()).await,
                Encoding::Base64 => fs.write_base64(&path, &a.content).await,
            }
        };
        match write().await {
            Ok(()) => {}
            // The parent is missing: made (as the sandbox's user), then again.
            Err(e) if e.code == ErrorCode::NotFound => {
                let parent = path.rsplit_once('/').map(|(p, _)| p).filter(|p| !p.is_empty()).unwrap_or("/");
                let mkdir = ExecRequest {
                    argv: Some(vec!["mkdir".into(), "-p".into(), "--".into(), parent.to_owned()]),
                    timeout_seconds: Some(30),
                    keep_output: Some(false),
                    ..ExecRequest::default()
                };
                match self.control().exec(&caller, &id, &mkdir, None, None).await? {
                    ExecReply::Result(r) if r.exit_code == 0 => write().await?,
                    _ => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
        Ok(CallToolResult::structured(json!({ "sandbox_id": id.as_str(), "path": path })))
    }

    async fn do_list_files(
        &self,
        ctx: &RequestContext<RoleServer>,
        a: ListFilesArgs,
    ) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let id = self.target(&caller, a.sandbox_id.as_deref(), a.keep).await?;
        let dir = a.path.unwrap_or_else(|| "/workspace".to_owned());
        let opts = hutch_control::files::ListOptions {
            recursive: a.recursive,
            include_sha256: false,
            limit: LIST_MAX,
            cursor: None,
        };
        let listing = self.control().fs(&caller, &id).await?.list(&dir, opts).await?;
        let entries: Vec<Value> =
            listing.entries.iter().map(|e| json!({ "path": e.path, "type": e.kind, "size": e.size })).collect();
        Ok(CallToolResult::structured(json!({
            "sandbox_id": id.as_str(),
            "path": dir,
            "entries": entries,
            "truncated": listing.next_cursor.is_some(),
        })))
    }

    async fn do_expose_port(
        &self,
        ctx: &RequestContext<RoleServer>,
        a: ExposePortArgs,
    ) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let id = self.target(&caller, a.sandbox_id.as_deref(), a.keep).await?;
        let req = CreateAccess { port: a.port, expires_in_seconds: a.expires_in_seconds };
        let g = self.control().create_access(&caller, &id, &req).await?;
        let empty = axum::http::HeaderMap::new();
        let headers = parts(ctx).map(|p| &p.headers).unwrap_or(&empty);
        let view = crate::access::view(headers, id.as_str(), g.id, g.port, g.expires_at, Some(g.token));
        Ok(CallToolResult::structured(json!({
            "sandbox_id": id.as_str(),
            "grant_id": view.id,
            "port": view.port,
            "url": view.url,
            "path_url": view.path_url,
            "token": view.token,
            "token_header": crate::proxy::TOKEN_HEADER,
            "expires_at": view.expires_at,
        })))
    }

    async fn do_delete(
        &self,
        ctx: &RequestContext<RoleServer>,
        a: DeleteSandboxArgs,
    ) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let id =
            match a.sandbox_id {
                Some(id) => SandboxId::parse(&id)?,
                None => {
                    self.state.inner.lock().await.default.clone().ok_or_else(|| {
                        Refusal::invalid("no sandbox_id given and this session has no default sandbox")
                    })?
                }
            };
        let sb = self.control().delete(&caller, &id).await?;
        let mut inner = self.state.inner.lock().await;
        inner.owned.retain(|o| *o != id);
        if inner.default.as_ref() == Some(&id) {
            inner.default = None;
        }
        drop(inner);
        Ok(CallToolResult::structured(
            serde_json::to_value(&sb).map_err(|e| Refusal::new(ErrorCode::Internal, e.to_string()))?,
        ))
    }

    async fn do_list(&self, ctx: &RequestContext<RoleServer>) -> Result<CallToolResult, Refusal> {
        let caller = self.caller(ctx).await?;
        let list = self.control().list(&caller, None, Some(100), None, true).await?;
        let default = self.state.inner.lock().await.default.clone();
        let mut v = serde_json::to_value(&list).map_err(|e| Refusal::new(ErrorCode::Internal, e.to_string()))?;
        v["session_default"] = default.map_or(Value::Null, |d| Value::String(d.as_str().to_owned()));
        Ok(CallToolResult::structured(v))
    }
}

#[tool_router]
impl Session {
    /// Creates a sandbox and makes it this session's default.
    #[tool(
        description = "Create a sandbox (an isolated Linux machine with python3, bash and the host's tools) and make it \
                       this session's default. It is deleted when the MCP session ends unless keep is true. Returns \
                       the sandbox (id, state, template, expires_at, limits)."
    )]
    async fn create_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        Parameters(a): Parameters<CreateSandboxArgs>,
    ) -> ToolResult {
        answer(self.do_create(&ctx, a).await)
    }

    #[tool(
        description = "Run a program in a sandbox: language python (default), bash or node. Returns stdout, stderr and \
                       exit_code (plus timed_out, oom_killed, *_truncated). Python's open matplotlib figures come back \
                       as PNG images. Without sandbox_id it runs in the session's default sandbox, created on first use."
    )]
    async fn run_code(&self, ctx: RequestContext<RoleServer>, Parameters(a): Parameters<RunCodeArgs>) -> ToolResult {
        answer(self.do_run_code(&ctx, a).await)
    }

    #[tool(
        description = "Run a command in a sandbox: a shell command line (command) or a program and its arguments (argv). \
                       Returns stdout, stderr and exit_code. Without sandbox_id it runs in the session's default \
                       sandbox, created on first use."
    )]
    async fn exec(&self, ctx: RequestContext<RoleServer>, Parameters(a): Parameters<ExecArgs>) -> ToolResult {
        answer(self.do_exec(&ctx, a).await)
    }

    #[tool(
        description = "Read a file of a sandbox (at most 8 MiB). Text comes back as text, PNG/JPEG/GIF/WebP images as \
                       images, other bytes as base64 (encoding: base64)."
    )]
    async fn read_file(&self, ctx: RequestContext<RoleServer>, Parameters(a): Parameters<ReadFileArgs>) -> ToolResult {
        answer(self.do_read_file(&ctx, a).await)
    }

    #[tool(description = "Write a file in a sandbox (text, or bytes as base64), replacing it whole; missing parent \
                          directories are made.")]
    async fn write_file(
        &self,
        ctx: RequestContext<RoleServer>,
        Parameters(a): Parameters<WriteFileArgs>,
    ) -> ToolResult {
        answer(self.do_write_file(&ctx, a).await)
    }

    #[tool(description = "List a directory of a sandbox (default /workspace; recursive: everything below). Entries \
                          have path (relative), type and size; at most 1000.")]
    async fn list_files(
        &self,
        ctx: RequestContext<RoleServer>,
        Parameters(a): Parameters<ListFilesArgs>,
    ) -> ToolResult {
        answer(self.do_list_files(&ctx, a).await)
    }

    #[tool(
        description = "Make a port of a sandbox reachable over HTTP: returns a url and a short-lived token (at most 5 \
                       minutes), sent in the X-Hutch-Sandbox-Token header (or posted once to <url>_hutch/access as a \
                       form field token, which sets a cookie)."
    )]
    async fn expose_port(
        &self,
        ctx: RequestContext<RoleServer>,
        Parameters(a): Parameters<ExposePortArgs>,
    ) -> ToolResult {
        answer(self.do_expose_port(&ctx, a).await)
    }

    #[tool(description = "Delete a sandbox (default: this session's default sandbox). Idempotent.")]
    async fn delete_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        Parameters(a): Parameters<DeleteSandboxArgs>,
    ) -> ToolResult {
        answer(self.do_delete(&ctx, a).await)
    }

    #[tool(description = "List this API key's live sandboxes (at most 100) and the session's default one.")]
    async fn list_sandboxes(&self, ctx: RequestContext<RoleServer>, Parameters(_): Parameters<NoArgs>) -> ToolResult {
        answer(self.do_list(&ctx).await)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Session {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("hutch", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Sandboxes for running code. Tools without sandbox_id share this session's default sandbox, created \
                 on first use and deleted when the session ends (unless keep: true). Refusals are tool errors whose \
                 structured content is {error, code} with hutch's stable error code.",
            )
    }

    /// The handshake binds the session to the key that sent it.
    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, rmcp::ErrorData> {
        if let Some(caller) = parts(&context).and_then(|p| p.extensions.get::<Caller>()).cloned() {
            self.state.inner.lock().await.caller.get_or_insert(caller);
        }
        context.peer.set_peer_info(request.clone());
        self.negotiate_initialize(&request)
    }

    /// The handshake revisions only (see the module's head).
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::LATEST_WITH_INITIALIZE))
    }

    /// As the router calls it, except that arguments that do not fit a
    /// tool's schema (which the router answers as a tool error of bare
    /// text: every refusal of ours has its structured body) are a tool
    /// error with the API's `invalid_request`.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, rmcp::ErrorData> {
        // Mutating tools are audited here (the audit layer leaves `/mcp`
        // alone: one POST carries any operation).
        let audited = MUTATING_TOOLS.contains(&request.name.as_ref()).then(|| {
            let sandbox = request.arguments.as_ref().and_then(|a| a.get("sandbox_id")).and_then(|v| v.as_str());
            let targets: std::collections::BTreeMap<String, String> =
                sandbox.map(|s| ("sandbox_id".to_owned(), s.to_owned())).into_iter().collect();
            let who = parts(&context).and_then(|p| {
                let client = p
                    .extensions
                    .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                    .map_or_else(|| "unknown".to_owned(), |c| c.0.ip().to_canonical().to_string());
                Some((p.extensions.get::<Caller>()?.owner.clone(), client))
            });
            (request.name.to_string(), targets, who)
        });
        let tcc = ToolCallContext::new(self, request, context);
        let result = match self.tool_router.call(tcc).await {
            Ok(CallToolResponse::Complete(r)) if r.is_error == Some(true) && r.structured_content.is_none() => {
                let text: Vec<&str> = r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.as_str())).collect();
                Ok(tool_error(ErrorCode::InvalidRequest, &text.join("; ")).into())
            }
            other => other,
        };
        if let Some((tool, targets, Some((key, client)))) = audited {
            let code = match &result {
                Ok(CallToolResponse::Complete(r)) if r.is_error == Some(true) => Some(
                    r.structured_content
                        .as_ref()
                        .and_then(|v| serde_json::from_value::<ErrorCode>(v.get("code")?.clone()).ok())
                        .unwrap_or(ErrorCode::Internal),
                ),
                Ok(_) => None,
                Err(_) => Some(ErrorCode::InvalidRequest),
            };
            crate::audit::record(&self.state.control, &key, &tool, targets, client, code);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_known_by_their_magic() {
        assert_eq!(image_mime(b"\x89PNG\r\n\x1a\nrest"), Some("image/png"));
        assert_eq!(image_mime(b"\xff\xd8\xff\xe0"), Some("image/jpeg"));
        assert_eq!(image_mime(b"GIF89a.."), Some("image/gif"));
        assert_eq!(image_mime(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(image_mime(b"hello"), None);
        assert_eq!(image_mime(b"RIFF"), None);
    }

    #[test]
    fn every_tool_has_an_object_schema() {
        let router = Session::tool_router();
        let names: Vec<String> = router.list_all().iter().map(|t| t.name.to_string()).collect();
        for want in [
            "create_sandbox",
            "run_code",
            "exec",
            "read_file",
            "write_file",
            "list_files",
            "expose_port",
            "delete_sandbox",
            "list_sandboxes",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
        }
        for t in router.list_all() {
            assert_eq!(t.input_schema.get("type"), Some(&json!("object")), "{}", t.name);
        }
    }
}
