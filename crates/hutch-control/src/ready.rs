//! Startup commands and readiness checks: when a sandbox of a template that
//! has them boots (a create, a warm pool refill, a build's validation), the
//! startup command is started in the background through the agent, tagged
//! `startup` (it shows in the process list and outlives this wait), and the
//! readiness check is polled until it passes, the startup command exits, or
//! the timeout passes. The sandbox is `running` only once ready.
//!
//! A readiness check is a command that must exit 0, or a TCP port that must
//! accept a connection on 127.0.0.1 inside the sandbox; the port is probed
//! by a tiny bash command (`/dev/tcp`), so no listener of the host is ever
//! involved.

use hutch_agent::proto::{Cmd, ExitStatus, FromAgent, Reply, Request, Spawn};
use hutch_api::{Readiness, Startup};
use hutch_runtime::agent_async::AsyncConn;
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

/// Tag of the startup command in the sandbox's process list.
pub const STARTUP_TAG: &str = "startup";
/// Between two readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// Longest one probe may run.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// What to wait for.
#[derive(Debug, Clone)]
pub struct ReadyCheck<'a> {
    pub startup: Option<&'a Startup>,
    pub readiness: Option<&'a Readiness>,
    /// Working directory of the startup command and the probes.
    pub cwd: Option<String>,
    pub timeout: Duration,
    /// Without a readiness check: how long the startup command must keep
    /// running to count as started (0: started once spawned).
    pub grace: Duration,
}

/// Why a sandbox did not become ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReady {
    /// The startup command could not start, or exited first.
    StartupFailed(String),
    /// The readiness check did not pass in time.
    Timeout(String),
    /// The sandbox went away (deleted, agent gone) while we waited.
    Gone(String),
}

impl NotReady {
    /// The sandbox's `last_error_code` for this failure.
    pub fn reason(&self) -> crate::lifecycle::Reason {
        use crate::lifecycle::Reason;
        match self {
            NotReady::StartupFailed(_) => Reason::StartupFailed,
            NotReady::Timeout(_) => Reason::ReadinessTimeout,
            NotReady::Gone(_) => Reason::AgentExited,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            NotReady::StartupFailed(m) | NotReady::Timeout(m) | NotReady::Gone(m) => m,
        }
    }
}

pub fn describe_exit(s: &ExitStatus) -> String {
    match (s.code, s.signal) {
        _ if s.timed_out => "timed out".to_owned(),
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        (None, None) => "ended".to_owned(),
    }
}

/// The probe command of a readiness check.
fn probe_cmd(r: &Readiness) -> Cmd {
    match (&r.command, r.port) {
        (Some(c), _) => Cmd::Shell(c.clone()),
        (None, Some(port)) => Cmd::Argv(vec![
            "/bin/bash".into(),
            "-c".into(),
            // The port is a number: nothing of the caller's reaches the shell.
            format!("exec 3<>/dev/tcp/127.0.0.1/{port}"),
        ]),
        (None, None) => Cmd::Argv(vec!["true".into()]),
    }
}

/// Runs one probe to its end on its own connection; true when it exited 0.
async fn probe(socket: &Path, r: &Readiness, cwd: Option<&str>, limit: Duration) -> bool {
    let run = async {
        let mut conn = AsyncConn::connect(socket).await.ok()?;
        let spawn = Spawn {
            cmd: probe_cmd(r),
            env: Vec::new(),
            cwd: cwd.map(str::to_owned),
            user: None,
            stdin: false,
            pty: None,
            tag: None,
            timeout_ms: Some(limit.as_millis() as u64),
            subscribe: true,
            // Only its exit counts.
            output_limit: Some(0),
        };
        let (Reply::Spawned { pid }, _) = conn.call(Request::Spawn(spawn), &[]).await.ok()? else { return None };
        loop {
            match conn.recv().await.ok()? {
                (FromAgent::Exit { pid: p, status }, _) if p == pid => return Some(status.code == Some(0)),
                _ => {}
            }
        }
    };
    tokio::time::timeout(limit + Duration::from_secs(1), run).await.ok().flatten().unwrap_or(false)
}

/// Starts the startup command and waits until the sandbox is ready.
/// `output` receives the startup command's output while we wait;
/// `wanted` is asked between probes and ends the wait when false.
pub async fn until_ready(
    socket: &Path,
    check: &ReadyCheck<'_>,
    mut output: impl FnMut(&[u8]),
    wanted: impl Fn() -> bool,
) -> Result<(), NotReady> {
    let deadline = Instant::now() + check.timeout;
    let mut startup = None;
    if let Some(s) = check.startup {
        let mut conn = AsyncConn::connect(socket)
            .await
            .map_err(|e| NotReady::Gone(format!("cannot reach the sandbox's agent: {e}")))?;
        let spawn = Spawn {
            cmd: Cmd::Shell(s.command.clone()),
            env: Vec::new(),
            cwd: check.cwd.clone(),
            user: s.user.clone(),
            stdin: false,
            pty: None,
            tag: Some(STARTUP_TAG.into()),
            timeout_ms: None,
            subscribe: true,
            output_limit: None,
        };
        let pid = match conn.call(Request::Spawn(spawn), &[]).await {
            Ok((Reply::Spawned { pid }, _)) => pid,
            Ok(_) => return Err(NotReady::StartupFailed("the agent did not start the startup command".into())),
            Err(e) => return Err(NotReady::StartupFailed(format!("the startup command did not start: {e}"))),
        };
        startup = Some((conn, pid));
    }
    let ready_at = match check.readiness {
        None => Some(Instant::now() + check.grace),
        Some(_) => None,
    };
    loop {
        let now = Instant::now();
        if ready_at.is_some_and(|t| now >= t) {
            return Ok(());
        }
        if now >= deadline {
            let what = match check.readiness {
                Some(Readiness { port: Some(p), .. }) => format!("nothing accepted connections on port {p}"),
                Some(_) => "the readiness command did not exit 0".to_owned(),
                None => "the startup command did not keep running".to_owned(),
            };
            return Err(NotReady::Timeout(format!(
                "not ready after {} s: {what}",
                check.timeout.as_secs_f64().round() as u64
            )));
        }
        if !wanted() {
            return Err(NotReady::Gone("the sandbox was deleted while it started".into()));
        }
        // Watch the startup command until the next probe is due.
        let next = ready_at.unwrap_or(now + PROBE_INTERVAL).min(deadline);
        if let Some((conn, pid)) = startup.as_mut() {
            loop {
                match tokio::time::timeout_at(next, conn.recv()).await {
                    Err(_) => break,
                    Ok(Ok((FromAgent::Output { pid: p, .. }, data))) if p == *pid => output(&data),
                    Ok(Ok((FromAgent::Exit { pid: p, status }, _))) if p == *pid => {
                        return Err(NotReady::StartupFailed(format!(
                            "the startup command ended before the sandbox was ready: {}",
                            describe_exit(&status)
                        )));
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(NotReady::Gone(format!("lost the sandbox's agent: {e}"))),
                }
            }
        } else {
            tokio::time::sleep_until(next).await;
        }
        if let Some(r) = check.readiness {
            let left = deadline.saturating_duration_since(Instant::now());
            if probe(socket, r, check.cwd.as_deref(), PROBE_TIMEOUT.min(left)).await {
                return Ok(());
            }
        }
    }
}
