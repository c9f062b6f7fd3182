//! Interactive terminals: a command on a new pseudo-terminal in a running
//! sandbox (the user's login shell by default), its bytes both ways,
//! resizes and signals, and its exit ([`PtySession`]). The web console's
//! terminal and `hutch exec -it` use it through the daemon's
//! `GET /v1/sandboxes/{id}/pty` WebSocket.
//!
//! The terminal is an agent process like any command: it takes one of the
//! sandbox's command slots (the agent refuses a spawn past them) and is
//! killed, with its whole process tree, when its session is dropped (the
//! client went away). Output is bounded end to end: the session hands it
//! out through a small channel, and while nobody reads it the agent stops
//! reading the terminal once its own buffer for this connection is full,
//! so a slow client stalls the command, never the daemon's memory.

use crate::control::Control;
use crate::error::{from_agent, ControlError, Result};
use crate::files::Access;
use crate::history::LogLevel;
use crate::ids::{Caller, SandboxId};
use crate::lifecycle::Live;
use hutch_agent::proto::{self, Cmd, ErrorCode as AgentCode, FromAgent, PtySize, Reply, Request, Spawn};
use hutch_runtime::agent::AgentError;
use hutch_runtime::agent_async::AsyncConn;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Largest terminal either way, in columns and in rows.
pub const MAX_SIZE: u16 = 1000;
/// Output chunks (of at most the agent's 64 KiB reads) held between the
/// agent and the client.
const OUTPUT_CHUNKS: usize = 16;

/// The command a terminal runs without one: the user's login shell (from
/// the sandbox's passwd, which the agent puts in `SHELL`), `/bin/sh` when
/// that is missing or refuses logins.
pub const LOGIN_SHELL: &str = r#"case "$SHELL" in ""|*/nologin|*/false) SHELL=/bin/sh;; esac; [ -x "$SHELL" ] || SHELL=/bin/sh; exec "$SHELL" -l"#;

/// What to run on the terminal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtyRequest {
    pub cols: u16,
    pub rows: u16,
    /// A shell command line (`/bin/sh -c`); the login shell when absent.
    pub command: Option<String>,
    /// `user` (the default) or `root`.
    pub user: Option<String>,
    /// Relative to /workspace; /workspace when absent.
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
}

/// A terminal size within bounds, or why not.
pub fn size(cols: u16, rows: u16) -> Result<PtySize> {
    if !(1..=MAX_SIZE).contains(&cols) || !(1..=MAX_SIZE).contains(&rows) {
        return Err(ControlError::Invalid(format!("cols and rows must be 1 to {MAX_SIZE}")));
    }
    Ok(PtySize { cols, rows })
}

fn validate(req: &PtyRequest) -> Result<(Cmd, PtySize)> {
    let size = size(req.cols, req.rows)?;
    let cmd = match &req.command {
        None => Cmd::Shell(LOGIN_SHELL.to_owned()),
        Some(c) if !c.trim().is_empty() && c.len() <= 64 * 1024 && !c.contains('\0') => Cmd::Shell(c.clone()),
        Some(_) => return Err(ControlError::Invalid("command is empty, above 64 KiB or holds NUL".into())),
    };
    if let Some(u) = &req.user {
        if !crate::session::valid_user(u) {
            return Err(ControlError::Invalid("user must be `user` (the default) or `root`".into()));
        }
    }
    if let Some(c) = &req.cwd {
        proto::normalize_path(c, "/workspace").map_err(|_| {
            ControlError::Invalid("cwd must be a path of at most 4096 bytes without NUL or `..`".into())
        })?;
    }
    if req.env.len() > 256
        || req.env.iter().any(|(k, v)| {
            k.is_empty() || k.len() > 256 || k.contains(['=', '\0']) || v.contains('\0') || v.len() > 32 * 1024
        })
    {
        return Err(ControlError::Invalid("env: invalid entry (NAME=value, at most 256 of them)".into()));
    }
    Ok((cmd, size))
}

/// What a terminal reports.
#[derive(Debug)]
pub enum PtyEvent {
    /// Bytes the terminal wrote (at most 64 KiB).
    Output(Vec<u8>),
    /// The command ended: its exit code, signals as 128 + n.
    Exit { exit_code: i32 },
    /// The link to the sandbox broke (the sandbox ended, or its agent).
    Failed(ControlError),
}

/// A running terminal. Dropping it kills the command's process tree (unless
/// it has exited).
pub struct PtySession {
    pid: u32,
    id: SandboxId,
    /// Requests (input, resizes, signals); the output comes on another
    /// connection, read by the task that feeds `events`.
    ctl: Option<AsyncConn>,
    events: mpsc::Receiver<PtyEvent>,
    live: Arc<Live>,
    ended: bool,
}

impl Control {
    /// Starts a command on a new terminal in a running sandbox of the
    /// caller's.
    pub async fn open_pty(&self, caller: &Caller, id: &SandboxId, req: &PtyRequest) -> Result<PtySession> {
        let (cmd, size) = validate(req)?;
        let live = self.running(caller, id).await?;
        let link = |e| from_agent(id, e, Access::Process);
        let mut out = live.fresh_conn().await.map_err(link)?;
        let ctl = live.fresh_conn().await.map_err(link)?;
        let shown = match (&req.command, &cmd) {
            (None, _) => "login shell".to_owned(),
            (_, Cmd::Shell(c)) => c.clone(),
            (_, Cmd::Argv(a)) => a.join(" "),
        };
        let spawn = Spawn {
            cmd,
            env: req.env.clone(),
            cwd: req.cwd.as_deref().and_then(|c| proto::normalize_path(c, "/workspace").ok()),
            user: req.user.clone(),
            stdin: true,
            pty: Some(size),
            tag: None,
            timeout_ms: None,
            subscribe: true,
            output_limit: None,
        };
        self.count_command(id);
        let pid = match out.call(Request::Spawn(spawn), &[]).await.map_err(link)? {
            (Reply::Spawned { pid }, _) => pid,
            (other, _) => return Err(ControlError::Runtime(format!("agent answered {other:?} to spawn"))),
        };
        self.log(
            id,
            LogLevel::Info,
            format!("terminal {pid} opened ({}x{}): {shown}", size.cols, size.rows),
            &[("pid", pid.to_string()), ("user", req.user.clone().unwrap_or_else(|| "user".into()))],
        );
        let events = pump(out, live.clone(), self.history.clone(), pid);
        Ok(PtySession { pid, id: id.clone(), ctl: Some(ctl), events, live, ended: false })
    }
}

impl PtySession {
    /// The command's pid in the sandbox.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The next event; none after the exit or a failure was handed out.
    /// Cancel-safe.
    pub async fn next(&mut self) -> Option<PtyEvent> {
        let ev = self.events.recv().await;
        if matches!(ev, None | Some(PtyEvent::Exit { .. } | PtyEvent::Failed(_))) {
            self.ended = true;
        }
        ev
    }

    fn ctl(&mut self) -> Result<&mut AsyncConn> {
        self.ctl.as_mut().ok_or_else(|| ControlError::Runtime("terminal link closed".into()))
    }

    /// Types `data` (at most the agent's frame size). `Ok(false)`: the
    /// command's input buffer is full (it does not read); try again later,
    /// still reading output.
    pub async fn input(&mut self, data: &[u8]) -> Result<bool> {
        if data.is_empty() {
            return Ok(true);
        }
        if data.len() > proto::MAX_DATA {
            return Err(ControlError::Invalid("terminal input above 4 MiB in one message".into()));
        }
        let pid = self.pid;
        match self.ctl()?.call(Request::Stdin { pid }, data).await {
            Ok(_) => Ok(true),
            Err(AgentError::Refused { code: AgentCode::Capacity, .. }) => Ok(false),
            Err(e) => Err(self.failed(e)),
        }
    }

    pub async fn resize(&mut self, cols: u16, rows: u16) -> Result<()> {
        let size = size(cols, rows)?;
        let pid = self.pid;
        match self.ctl()?.call(Request::Resize { pid, size }, &[]).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Sends a signal (a name like `INT` or `SIGINT`, or a number) to the
    /// command's process tree.
    pub async fn signal(&mut self, signal: &serde_json::Value) -> Result<()> {
        let signal = crate::exec::parse_signal(signal).ok_or_else(|| ControlError::Invalid("unknown signal".into()))?;
        let pid = self.pid;
        match self.ctl()?.call(Request::Signal { pid, signal }, &[]).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Kills the command's process tree now (unless it has exited), and
    /// waits for the agent to take the signal; dropping the session does the
    /// same without waiting.
    pub async fn kill(mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        let pid = self.pid;
        let conn = match self.ctl.take() {
            Some(c) => Ok(c),
            None => self.live.fresh_conn().await,
        };
        if let Ok(mut conn) = conn {
            let _ = conn.call(Request::Signal { pid, signal: libc::SIGKILL }, &[]).await;
        }
    }

    /// A failed request: a refusal (the command just exited) is its own
    /// error; a broken link ends the session's requests.
    fn failed(&mut self, e: AgentError) -> ControlError {
        if !matches!(e, AgentError::Refused { .. }) {
            self.ctl = None;
        }
        from_agent(&self.id, e, Access::Process)
    }
}

impl Drop for PtySession {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let (pid, live) = (self.pid, self.live.clone());
        let ctl = self.ctl.take();
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            let conn = match ctl {
                Some(c) => Ok(c),
                None => live.fresh_conn().await,
            };
            if let Ok(mut conn) = conn {
                let _ = conn.call(Request::Signal { pid, signal: libc::SIGKILL }, &[]).await;
            }
        });
    }
}

/// Feeds the terminal's output and exit to the session until it exits or
/// the session goes away.
fn pump(
    mut conn: AsyncConn,
    live: Arc<Live>,
    history: Arc<crate::history::History>,
    pid: u32,
) -> mpsc::Receiver<PtyEvent> {
    let (tx, rx) = mpsc::channel(OUTPUT_CHUNKS);
    tokio::spawn(async move {
        loop {
            let msg = tokio::select! {
                () = tx.closed() => return,
                m = conn.recv() => m,
            };
            let ev = match msg {
                Err(e) => PtyEvent::Failed(crate::session::broken_link(&live, e)),
                Ok((FromAgent::Output { pid: p, .. }, data)) if p == pid => PtyEvent::Output(data),
                Ok((FromAgent::Exit { pid: p, status }, _)) if p == pid => {
                    let exit_code = status.shell_code();
                    let level = if exit_code == 0 { LogLevel::Info } else { LogLevel::Warn };
                    let how = crate::ready::describe_exit(&status);
                    let fields = [("pid", pid.to_string()), ("exit_code", exit_code.to_string())];
                    history.log(&live.id, level, format!("terminal {pid} ended: {how}"), &fields);
                    PtyEvent::Exit { exit_code }
                }
                Ok(_) => continue,
            };
            let last = !matches!(ev, PtyEvent::Output(_));
            // Waits while the client reads slowly: the agent then holds
            // (a bounded amount of) output, and then the command.
            if tx.send(ev).await.is_err() || last {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> PtyRequest {
        PtyRequest { cols: 80, rows: 24, ..PtyRequest::default() }
    }

    #[test]
    fn requests_are_bounded_and_default_to_the_login_shell() {
        let (cmd, size) = validate(&req()).expect("valid");
        assert_eq!(cmd, Cmd::Shell(LOGIN_SHELL.to_owned()));
        assert_eq!(size, PtySize { cols: 80, rows: 24 });
        for (cols, rows) in [(0, 24), (80, 0), (MAX_SIZE + 1, 24), (80, MAX_SIZE + 1)] {
            assert!(validate(&PtyRequest { cols, rows, ..req() }).is_err(), "{cols}x{rows}");
        }
        let bad = [
            PtyRequest { command: Some(" ".into()), ..req() },
            PtyRequest { command: Some("a\0b".into()), ..req() },
            PtyRequest { user: Some("nobody".into()), ..req() },
            PtyRequest { cwd: Some("../etc".into()), ..req() },
            PtyRequest { env: vec![("A=B".into(), "c".into())], ..req() },
            PtyRequest { env: vec![(String::new(), "c".into())], ..req() },
        ];
        for r in bad {
            assert!(matches!(validate(&r), Err(ControlError::Invalid(_))), "{r:?}");
        }
        let ok = PtyRequest {
            command: Some("top".into()),
            user: Some("root".into()),
            cwd: Some("src".into()),
            env: vec![("A".into(), "1".into())],
            ..req()
        };
        assert_eq!(validate(&ok).expect("valid").0, Cmd::Shell("top".into()));
    }
}
