//! Commands in a running sandbox: foreground (a capped JSON result or a
//! stream of events), background, reattach, signals, stdin; the 64 command
//! slots; the Idempotency-Key journal; and one-shot executions.
//!
//! Idempotency: a key's first use takes it (`running`); the outcome is
//! stored when the command ends (without output when output is not kept).
//! A retry with the same key and body replays it; another body is a
//! conflict; a key whose command still runs, or whose outcome was lost in a
//! restart, is refused and never run twice. A capacity refusal frees the key;
//! a not-running refusal is stored and replayed.

use crate::control::{request_hash, Control, Need};
use crate::error::{from_agent, ControlError, Result};
use crate::files::Access;
use crate::history::LogLevel;
use crate::ids::{Caller, SandboxId};
use crate::lifecycle::Live;
use hutch_agent::proto::{self, Cmd, FromAgent, Reply, Request, Spawn, Stream, Target};
use hutch_api::{
    CreateSandbox, ErrorBody, ErrorCode, ExecEvent, ExecRequest, ExecResult, ExecutionRequest, ExecutionResult,
    Process, ProcessList, Started, OUTPUT_CAP,
};
use hutch_store::ExecState;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How often a quiet event stream carries a ping.
pub const PING_EVERY: Duration = Duration::from_secs(15);

/// What an exec answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum ExecReply {
    /// A one-shot execution replayed from the journal.
    Execution(ExecutionResult),
    Result(ExecResult),
    Background(Started),
}

/// The journal form of an outcome: a reply or a stored refusal.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum Stored {
    Refused(ErrorBody),
    /// A one-shot execution's result, with the sandbox it ran in.
    Execution(ExecutionResult),
    Reply(ExecReply),
}

/// The users a command may run as: the two the API documents.
const USERS: [&str; 2] = ["user", "root"];

fn validate(req: &ExecRequest) -> Result<Cmd> {
    let cmd = match (&req.command, &req.argv) {
        (Some(c), None) if !c.is_empty() && c.len() <= 256 * 1024 && !c.contains('\0') => Cmd::Shell(c.clone()),
        (None, Some(a))
            if !a.is_empty()
                && a.len() <= 4096
                && a.iter().all(|s| !s.contains('\0'))
                && a.iter().map(String::len).sum::<usize>() <= 256 * 1024 =>
        {
            Cmd::Argv(a.clone())
        }
        (Some(_), Some(_)) | (None, None) => {
            return Err(ControlError::Invalid("give exactly one of command and argv".into()));
        }
        _ => return Err(ControlError::Invalid("command or argv is empty, too long or holds NUL".into())),
    };
    if req.env.len() > 256
        || req
            .env
            .iter()
            .any(|(k, v)| k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') || v.len() > 32 * 1024)
    {
        return Err(ControlError::Invalid("env: invalid entry".into()));
    }
    if let Some(t) = req.timeout_seconds {
        if !(1..=86_400).contains(&t) {
            return Err(ControlError::Invalid("timeout_seconds must be 1 to 86400".into()));
        }
    }
    if let Some(u) = &req.user {
        if !USERS.contains(&u.as_str()) {
            return Err(ControlError::Invalid("user must be `user` (the default) or `root`".into()));
        }
    }
    if let Some(c) = &req.cwd {
        proto::normalize_path(c, "/workspace").map_err(|_| {
            ControlError::Invalid("cwd must be a path of at most 4096 bytes without NUL or `..`".into())
        })?;
    }
    if req.stdin.as_ref().is_some_and(|s| s.len() > proto::MAX_DATA) {
        return Err(ControlError::Invalid("stdin above 4 MiB".into()));
    }
    Ok(cmd)
}

/// The agent request for a command; refused when it does not fit in one
/// frame header (the command line, argv, env and cwd together).
fn spawn_request(cmd: Cmd, req: &ExecRequest) -> Result<Spawn> {
    let background = req.background.unwrap_or(false);
    let spawn = Spawn {
        cmd,
        env: req.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        // Relative to /workspace (validated), not to the user's home.
        cwd: req.cwd.as_deref().and_then(|c| proto::normalize_path(c, "/workspace").ok()),
        user: req.user.clone(),
        stdin: req.stdin.is_some() || background,
        pty: None,
        tag: None,
        timeout_ms: req.timeout_seconds.map(|s| s * 1000),
        // A background command's output is kept by the agent for whoever
        // reattaches; nothing here consumes it.
        subscribe: !background,
        // Set by `run` when nobody streams the output.
        output_limit: None,
    };
    // What the frame's header holds besides the request: its id and tags.
    const SLACK: usize = 64;
    let size = serde_json::to_vec(&spawn).map_or(usize::MAX, |v| v.len());
    if size + SLACK > proto::MAX_HEADER {
        return Err(ControlError::Invalid(format!(
            "the command, its arguments, environment and cwd take {size} bytes as JSON; at most {} fit",
            proto::MAX_HEADER - SLACK
        )));
    }
    Ok(spawn)
}

/// Output of one stream, kept up to the cap.
#[derive(Default)]
struct Capped {
    data: Vec<u8>,
    truncated: bool,
}

impl Capped {
    fn push(&mut self, bytes: &[u8]) {
        let room = OUTPUT_CAP - self.data.len();
        if bytes.len() > room {
            self.truncated = true;
        }
        self.data.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.data).into_owned()
    }
}

/// How a command failed: before anything started (its Idempotency-Key is
/// freed, a retry may run it) or after its spawn (the outcome is unknown;
/// the key is never run again).
enum RunError {
    NotStarted(ControlError),
    Started(ControlError),
}

impl RunError {
    fn into_inner(self) -> ControlError {
        match self {
            RunError::NotStarted(e) | RunError::Started(e) => e,
        }
    }
}

impl Control {
    /// Runs a command. With `events`, output is also streamed there as it
    /// comes (the stream ends when the command does; a dropped receiver does
    /// not stop the command).
    pub async fn exec(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        req: &ExecRequest,
        key: Option<&str>,
        events: Option<mpsc::Sender<ExecEvent>>,
    ) -> Result<ExecReply> {
        let t0 = Instant::now();
        let cmd = validate(req)?;
        let hash = request_hash(req);
        let live = match key {
            None => self.running(caller, id).await?,
            Some(key) => {
                // The sandbox must be the caller's (404) before a key is taken for it.
                self.record_here(caller, id, Need::Use).await?;
                if let Some(replay) = self.journal_begin(id.as_str(), key, &hash).await? {
                    return replay;
                }
                match self.running(caller, id).await {
                    Ok(l) => l,
                    Err(e) => {
                        let refused = Stored::Refused(ErrorBody { error: e.to_string(), code: e.code() });
                        self.journal_finish(id.as_str(), key, &refused).await;
                        return Err(e);
                    }
                }
            }
        };
        // The agent counts command slots (it sees every process tree) and
        // refuses a spawn past them; see `run`.
        self.count_command(id);
        let keep = req.keep_output.unwrap_or(true);
        let shown = match &cmd {
            Cmd::Shell(c) => c.clone(),
            Cmd::Argv(a) => a.join(" "),
        };
        let t1 = crate::timing::mark("lookup", t0);
        let outcome = self.run(&live, cmd, req, events).await;
        crate::timing::mark("run", t1);
        match &outcome {
            Ok(ExecReply::Result(r)) => {
                let level = if r.exit_code == 0 { LogLevel::Info } else { LogLevel::Warn };
                let msg = format!("command ended with exit code {}: {shown}", r.exit_code);
                self.log(id, level, msg, &[("exit_code", r.exit_code.to_string())]);
            }
            Ok(ExecReply::Background(b)) => {
                let msg = format!("command started in the background as process {}: {shown}", b.pid);
                self.log(id, LogLevel::Info, msg, &[("pid", b.pid.to_string())]);
            }
            _ => {}
        }
        if let Some(key) = key {
            match &outcome {
                Ok(ExecReply::Result(r)) if !keep => {
                    let stripped = ExecResult { stdout: String::new(), stderr: String::new(), ..r.clone() };
                    self.journal_finish(id.as_str(), key, &Stored::Reply(ExecReply::Result(stripped))).await;
                }
                Ok(reply) => self.journal_finish(id.as_str(), key, &Stored::Reply(reply.clone())).await,
                // Refused before the spawn: the key is free again.
                Err(RunError::NotStarted(_)) => {
                    let (scope, k) = (id.to_string(), key.to_owned());
                    let _ = self.db(move |s| s.release_exec(&scope, &k)).await;
                }
                // After it: the outcome is unknown, the key stays taken.
                Err(RunError::Started(_)) => {}
            }
        }
        outcome.map_err(RunError::into_inner)
    }

    /// Takes the key, or answers what it holds.
    async fn journal_begin(&self, scope: &str, key: &str, hash: &str) -> Result<Option<Result<ExecReply>>> {
        if key.is_empty() || key.len() > 256 {
            return Err(ControlError::Invalid("Idempotency-Key must be 1 to 256 characters".into()));
        }
        let (sc, k, h, node) = (scope.to_owned(), key.to_owned(), hash.to_owned(), self.node.name.clone());
        match self.db(move |s| s.begin_exec(&sc, &k, &h, crate::control::now_ms(), &node)).await? {
            hutch_store::Begin::Started => Ok(None),
            hutch_store::Begin::Existing(e) if e.request_hash != hash => Err(ControlError::IdempotencyConflict),
            hutch_store::Begin::Existing(e) if e.state == ExecState::Done => {
                let stored: Stored = e
                    .result
                    .as_deref()
                    .and_then(|r| serde_json::from_str(r).ok())
                    .ok_or_else(|| ControlError::Runtime("unreadable journal entry".into()))?;
                Ok(Some(match stored {
                    Stored::Reply(r) => Ok(r),
                    Stored::Execution(e) => Ok(ExecReply::Execution(e)),
                    Stored::Refused(b) => Err(ControlError::Replayed { code: b.code, message: b.error }),
                }))
            }
            hutch_store::Begin::Existing(_) => Err(ControlError::OutcomeUnknown),
        }
    }

    async fn journal_finish(&self, scope: &str, key: &str, stored: &Stored) {
        match serde_json::to_string(stored) {
            Ok(json) => {
                let (sc, k) = (scope.to_owned(), key.to_owned());
                if let Err(e) = self.db(move |s| s.finish_exec(&sc, &k, &json)).await {
                    tracing::warn!("journal {scope}/{key}: {e}");
                }
            }
            Err(e) => tracing::warn!("journal {scope}/{key}: {e}"),
        }
    }

    async fn run(
        self: &Arc<Self>,
        live: &Arc<Live>,
        cmd: Cmd,
        req: &ExecRequest,
        events: Option<mpsc::Sender<ExecEvent>>,
    ) -> std::result::Result<ExecReply, RunError> {
        let t0 = Instant::now();
        let sid = &live.id;
        let broken = |e| RunError::Started(from_agent(sid, e, Access::Process));
        let background = req.background.unwrap_or(false);
        let mut spawn = spawn_request(cmd, req).map_err(RunError::NotStarted)?;
        if events.is_none() {
            // Only the reply's capped output is wanted: past the cap the
            // agent drops a flood in the sandbox, on the sandbox's CPU,
            // instead of sending it here to be dropped on the daemon's.
            spawn.output_limit = Some(OUTPUT_CAP as u64);
        }
        let mut conn = live.conn().await.map_err(|e| RunError::NotStarted(from_agent(sid, e, Access::Process)))?;
        let pid = match conn.call(Request::Spawn(spawn), &[]).await {
            Ok((Reply::Spawned { pid }, _)) => pid,
            // A refusal: nothing started.
            Err(e @ hutch_runtime::agent::AgentError::Refused { .. }) => {
                return Err(RunError::NotStarted(from_agent(sid, e, Access::Process)))
            }
            // The link broke, or the agent answered nonsense: it may have
            // started the command.
            Err(e) => return Err(broken(e)),
            Ok((other, _)) => {
                return Err(RunError::Started(ControlError::Runtime(format!("agent answered {other:?} to spawn"))))
            }
        };
        if let Some(input) = &req.stdin {
            // A command that exits (or closes its stdin) before reading its
            // input has run all the same: the agent refuses the write, the
            // input is dropped, and the outcome is collected below. Only a
            // broken link ends the call.
            let refused =
                |e: &hutch_runtime::agent::AgentError| matches!(e, hutch_runtime::agent::AgentError::Refused { .. });
            match conn.call(Request::Stdin { pid }, input.as_bytes()).await {
                Ok(_) => match conn.call(Request::CloseStdin { pid }, &[]).await {
                    Err(e) if !refused(&e) => return Err(broken(e)),
                    _ => {}
                },
                Err(e) if refused(&e) => {}
                Err(e) => return Err(broken(e)),
            }
        }
        if background {
            // Running until the idle sweeper sees it end.
            live.set_busy(true);
            // The agent holds the command's slot until its tree exits.
            if let Ok(mut started) = live.started.lock() {
                if started.len() >= 4096 {
                    started.clear();
                }
                started.insert(pid, t0);
            }
            live.reuse(conn);
            return Ok(ExecReply::Background(Started { pid }));
        }
        let mut events = events;
        if let Some(tx) = &events {
            if tx.send(ExecEvent::Start { pid }).await.is_err() {
                events = None;
            }
        }
        let (mut out, mut err) = (Capped::default(), Capped::default());
        let status = loop {
            let next = tokio::time::timeout(PING_EVERY, conn.recv()).await;
            let (msg, data) = match next {
                Err(_) => {
                    if let Some(tx) = &events {
                        if tx.send(ExecEvent::Ping).await.is_err() {
                            events = None;
                        }
                    }
                    continue;
                }
                Ok(m) => m.map_err(broken)?,
            };
            match msg {
                FromAgent::Output { pid: p, stream } if p == pid => {
                    if let Some(tx) = &events {
                        if tx.send(output_event(stream, &data)).await.is_err() {
                            // The client left; the command goes on.
                            events = None;
                        }
                    }
                    match stream {
                        Stream::Stdout => out.push(&data),
                        Stream::Stderr => err.push(&data),
                    }
                }
                FromAgent::Dropped { pid: p, stream, .. } if p == pid => match stream {
                    Stream::Stdout => out.truncated = true,
                    Stream::Stderr => err.truncated = true,
                },
                FromAgent::Exit { pid: p, status } if p == pid => break status,
                _ => {}
            }
        };
        live.reuse(conn);
        let duration_ms = t0.elapsed().as_millis() as u64;
        self.metrics.exec_latency.observe(t0.elapsed().as_secs_f64());
        let result = ExecResult {
            stdout: out.text(),
            stderr: err.text(),
            exit_code: status.shell_code(),
            stdout_truncated: out.truncated,
            stderr_truncated: err.truncated,
            timed_out: status.timed_out,
            duration_ms,
            output_kept: req.keep_output.unwrap_or(true),
            oom_killed: status.oom_killed,
            descendants_alive: status.descendants_alive,
        };
        if let Some(tx) = &events {
            let _ = tx.send(result.exit_event()).await;
        }
        Ok(ExecReply::Result(result))
    }

    pub async fn processes(&self, caller: &Caller, id: &SandboxId) -> Result<ProcessList> {
        let live = self.running(caller, id).await?;
        let mut conn = live.fresh_conn().await.map_err(|e| from_agent(id, e, Access::Process))?;
        match conn.call(Request::List, &[]).await.map_err(|e| from_agent(id, e, Access::Process))? {
            (Reply::Processes { processes }, _) => Ok(ProcessList {
                processes: processes
                    .into_iter()
                    .map(|p| Process {
                        pid: p.pid,
                        tag: p.tag,
                        command: match p.cmd {
                            Cmd::Argv(a) => a,
                            Cmd::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s],
                        },
                        user: p.user,
                        cwd: p.cwd,
                        main_exited: p.exited.is_some(),
                        exit_code: p.exited.map(|s| s.shell_code()),
                    })
                    .collect(),
            }),
            (other, _) => Err(ControlError::Runtime(format!("agent answered {other:?} to list"))),
        }
    }

    pub async fn signal(&self, caller: &Caller, id: &SandboxId, pid: u32, signal: &serde_json::Value) -> Result<()> {
        let sig = parse_signal(signal).ok_or_else(|| ControlError::Invalid("unknown signal".into()))?;
        let live = self.running(caller, id).await?;
        let mut conn = live.fresh_conn().await.map_err(|e| from_agent(id, e, Access::Process))?;
        conn.call(Request::Signal { pid, signal: sig }, &[]).await.map_err(|e| no_process(id, pid, e))?;
        Ok(())
    }

    pub async fn stdin(&self, caller: &Caller, id: &SandboxId, pid: u32, data: &[u8], eof: bool) -> Result<()> {
        let live = self.running(caller, id).await?;
        let mut conn = live.fresh_conn().await.map_err(|e| from_agent(id, e, Access::Process))?;
        if !data.is_empty() {
            conn.call(Request::Stdin { pid }, data).await.map_err(|e| no_process(id, pid, e))?;
        }
        if eof {
            conn.call(Request::CloseStdin { pid }, &[]).await.map_err(|e| no_process(id, pid, e))?;
        }
        Ok(())
    }

    /// Reattaches to a running command: its kept output, then live output,
    /// then its exit, as events.
    pub async fn attach(&self, caller: &Caller, id: &SandboxId, pid: u32, tx: mpsc::Sender<ExecEvent>) -> Result<()> {
        let live = self.running(caller, id).await?;
        let mut conn = live.fresh_conn().await.map_err(|e| from_agent(id, e, Access::Process))?;
        conn.call(Request::Attach { target: Target::Pid(pid) }, &[]).await.map_err(|e| no_process(id, pid, e))?;
        let sid = id.to_string();
        let attached = live.started.lock().ok().and_then(|s| s.get(&pid).copied()).unwrap_or_else(Instant::now);
        tokio::spawn(async move {
            if tx.send(ExecEvent::Start { pid }).await.is_err() {
                return;
            }
            loop {
                let ev = match tokio::time::timeout(PING_EVERY, conn.recv()).await {
                    Err(_) => ExecEvent::Ping,
                    Ok(Err(e)) => {
                        let message = crate::error::public_message(ErrorCode::Internal, &format!("sandbox {sid}: {e}"));
                        ExecEvent::Error { code: ErrorCode::Internal, error: message }
                    }
                    Ok(Ok((FromAgent::Output { pid: p, stream }, data))) if p == pid => output_event(stream, &data),
                    Ok(Ok((FromAgent::Exit { pid: p, status }, _))) if p == pid => {
                        // From the start of a background command; from the
                        // attach for a command started otherwise.
                        let duration_ms = attached.elapsed().as_millis() as u64;
                        ExecEvent::Exit {
                            exit_code: status.shell_code(),
                            timed_out: status.timed_out,
                            duration_ms,
                            oom_killed: status.oom_killed,
                            descendants_alive: status.descendants_alive,
                        }
                    }
                    Ok(Ok(_)) => continue,
                };
                let last = matches!(ev, ExecEvent::Exit { .. } | ExecEvent::Error { .. });
                if tx.send(ev).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(())
    }

    /// One command in a fresh sandbox, destroyed before the answer.
    pub async fn execution(
        self: &Arc<Self>,
        caller: &Caller,
        req: &ExecutionRequest,
        key: Option<&str>,
    ) -> Result<ExecutionResult> {
        let exec = ExecRequest {
            command: req.command.clone(),
            argv: req.argv.clone(),
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            user: req.user.clone(),
            timeout_seconds: req.timeout_seconds,
            keep_output: req.keep_output,
            background: None,
            stdin: req.stdin.clone(),
        };
        validate(&exec)?;
        let recipe = self.recipe(&caller.owner, req.template.as_deref()).await?;
        crate::control::resolve_limits(req.memory_mb, req.limits.as_ref())?;
        let scope = format!("owner:{}", caller.owner);
        let hash = request_hash(req);
        if let Some(key) = key {
            if let Some(replay) = self.journal_begin(&scope, key, &hash).await? {
                return match replay? {
                    ExecReply::Execution(e) => Ok(e),
                    ExecReply::Result(_) | ExecReply::Background(_) => Err(ControlError::OutcomeUnknown),
                };
            }
        }
        let create = CreateSandbox {
            template: req.template.clone(),
            ttl_seconds: Some(req.timeout_seconds.unwrap_or(3600).saturating_add(60).min(recipe.max_ttl.as_secs())),
            memory_mb: req.memory_mb,
            limits: req.limits.clone(),
            wait_seconds: Some(60),
            network: req.network.clone(),
            storage: req.storage,
            ..CreateSandbox::default()
        };
        let created = self.create(caller, &create, None).await;
        let (sb, _) = match created {
            Ok(c) => c,
            Err(e) => {
                if let Some(key) = key {
                    let (sc, k) = (scope.clone(), key.to_owned());
                    let _ = self.db(move |s| s.release_exec(&sc, &k)).await;
                }
                return Err(e);
            }
        };
        let sid = SandboxId::from_record(&sb.id);
        let outcome = self.exec(caller, &sid, &exec, None, None).await;
        let _ = self.destroy(&sid, None).await;
        let result = match outcome? {
            ExecReply::Result(r) => r,
            ExecReply::Background(_) | ExecReply::Execution(_) => {
                return Err(ControlError::Runtime("one-shot ran in the background".into()));
            }
        };
        if let Some(key) = key {
            let kept = if req.keep_output.unwrap_or(true) {
                result.clone()
            } else {
                ExecResult { stdout: String::new(), stderr: String::new(), ..result.clone() }
            };
            self.journal_finish(
                &scope,
                key,
                &Stored::Execution(ExecutionResult { sandbox_id: sb.id.clone(), result: kept }),
            )
            .await;
        }
        Ok(ExecutionResult { sandbox_id: sb.id, result })
    }
}

/// An agent's refusal of a process operation: an unknown pid is not found.
fn no_process(id: &SandboxId, pid: u32, e: hutch_runtime::agent::AgentError) -> ControlError {
    match e {
        hutch_runtime::agent::AgentError::Refused { code: proto::ErrorCode::UnknownProcess, .. } => {
            ControlError::NoProcess { sandbox: id.to_string(), pid }
        }
        other => from_agent(id, other, Access::Process),
    }
}

/// An output chunk as a stream event (bytes shown as UTF-8, lossily).
fn output_event(stream: Stream, data: &[u8]) -> ExecEvent {
    let data = String::from_utf8_lossy(data).into_owned();
    match stream {
        Stream::Stdout => ExecEvent::Stdout { data },
        Stream::Stderr => ExecEvent::Stderr { data },
    }
}

/// A signal as a number (1..=64) or a name, with or without `SIG`.
pub fn parse_signal(v: &serde_json::Value) -> Option<i32> {
    if let Some(n) = v.as_i64() {
        return (1..=64).contains(&n).then_some(n as i32);
    }
    let name = v.as_str()?.to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    Some(match name {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "TERM" => libc::SIGTERM,
        "CONT" => libc::SIGCONT,
        "STOP" => libc::SIGSTOP,
        "TSTP" => libc::SIGTSTP,
        "WINCH" => libc::SIGWINCH,
        "ALRM" => libc::SIGALRM,
        "PIPE" => libc::SIGPIPE,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_of_command_and_argv() {
        let both = ExecRequest { command: Some("x".into()), argv: Some(vec!["x".into()]), ..Default::default() };
        assert!(validate(&both).is_err());
        assert!(validate(&ExecRequest::default()).is_err());
        let nul = ExecRequest { command: Some("a\0b".into()), ..Default::default() };
        assert!(validate(&nul).is_err());
        let ok = ExecRequest { argv: Some(vec!["true".into()]), ..Default::default() };
        assert_eq!(validate(&ok).expect("valid"), Cmd::Argv(vec!["true".into()]));
        let bad_cwd = ExecRequest { command: Some("x".into()), cwd: Some("../etc".into()), ..Default::default() };
        assert!(validate(&bad_cwd).is_err());
    }

    #[test]
    fn output_is_capped_with_a_flag() {
        let mut c = Capped::default();
        c.push(&vec![b'a'; OUTPUT_CAP - 1]);
        assert!(!c.truncated);
        c.push(b"bc");
        assert!(c.truncated);
        assert_eq!(c.data.len(), OUTPUT_CAP);
    }

    #[test]
    fn signals_parse_by_number_and_name() {
        assert_eq!(parse_signal(&serde_json::json!(9)), Some(9));
        assert_eq!(parse_signal(&serde_json::json!("SIGTERM")), Some(libc::SIGTERM));
        assert_eq!(parse_signal(&serde_json::json!("kill")), Some(libc::SIGKILL));
        assert_eq!(parse_signal(&serde_json::json!(0)), None);
        assert_eq!(parse_signal(&serde_json::json!("BOGUS")), None);
    }

    #[test]
    fn stored_outcomes_round_trip() {
        let r = Stored::Reply(ExecReply::Background(Started { pid: 7 }));
        let json = serde_json::to_string(&r).expect("ser");
        assert!(matches!(serde_json::from_str::<Stored>(&json).expect("de"), Stored::Reply(ExecReply::Background(_))));
        let e = Stored::Refused(ErrorBody { error: "no".into(), code: ErrorCode::SandboxSessionNotRunning });
        let json = serde_json::to_string(&e).expect("ser");
        assert!(matches!(serde_json::from_str::<Stored>(&json).expect("de"), Stored::Refused(_)));
    }
}
