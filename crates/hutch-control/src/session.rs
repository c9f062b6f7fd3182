//! Raw process and file sessions for compatibility APIs (E2B's envd): a
//! process started with a terminal, a tag or an open stdin, its events as a
//! typed stream, and single agent file operations. The same sandboxes and
//! agent connections as the native commands; no HTTP here.

use crate::control::{Control, Live};
use crate::error::{ControlError, Result};
use crate::files::{Access, FilesError};
use hutch_agent::proto::{
    self, Cmd, ExitStatus, FromAgent, ProcessInfo, PtySize, Reply, Request, Spawn, Stream, Target, WatchEvent,
};
use hutch_runtime::agent::AgentError;
use hutch_runtime::agent_async::AsyncConn;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// What to start.
#[derive(Debug, Clone)]
pub struct ProcSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Absolute.
    pub cwd: Option<String>,
    pub user: String,
    pub pty: Option<PtySize>,
    pub tag: Option<String>,
    pub stdin: bool,
    pub timeout_ms: Option<u64>,
}

/// Where output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcStream {
    Stdout,
    Stderr,
    Pty,
}

/// One event of a process session.
#[derive(Debug)]
pub enum ProcEvent {
    Start {
        pid: u32,
    },
    Data {
        stream: ProcStream,
        data: Vec<u8>,
    },
    End {
        status: ExitStatus,
    },
    Keepalive,
    /// The session broke (the agent went away); the process may still run.
    Failed(ControlError),
}

/// One event of a directory watch.
#[derive(Debug)]
pub enum WatchItem {
    Event(WatchEvent),
    Keepalive,
    /// The watch broke (the agent or the sandbox went away).
    Failed(ControlError),
}

/// An agent refusal or failure as a control error: an unknown process is
/// not found, file refusals keep their file codes.
fn agent_error(sandbox: &str, e: AgentError) -> ControlError {
    match e {
        AgentError::Refused { code: proto::ErrorCode::UnknownProcess, message } => {
            ControlError::Files { code: hutch_api::ErrorCode::NotFound, message }
        }
        AgentError::Refused { code: proto::ErrorCode::Capacity, .. } => {
            ControlError::Capacity(hutch_api::COMMAND_SLOTS)
        }
        e @ AgentError::Refused { .. } => {
            let f = FilesError::from_agent(e, Access::Read);
            ControlError::Files { code: f.code, message: f.message }
        }
        // A command or path too large for one agent frame is the caller's.
        e @ AgentError::RequestTooLarge(_) => ControlError::Invalid(e.to_string()),
        source => ControlError::Agent { sandbox: sandbox.to_owned(), source },
    }
}

impl Control {
    /// The running sandbox of a record the caller proved access to.
    fn session_live(&self, owner: &str, id: &str) -> Result<Arc<Live>> {
        self.running(owner, id)
    }

    async fn session_conn(&self, owner: &str, id: &str) -> Result<AsyncConn> {
        let live = self.session_live(owner, id)?;
        AsyncConn::connect(&live.socket).await.map_err(|e| agent_error(id, e))
    }

    /// The pid a selector names.
    async fn resolve(&self, conn: &mut AsyncConn, id: &str, target: &Target) -> Result<u32> {
        match target {
            Target::Pid(p) => Ok(*p),
            Target::Tag(tag) => {
                let list = self.agent_list(conn, id).await?;
                list.into_iter().find(|p| p.tag.as_deref() == Some(tag.as_str())).map(|p| p.pid).ok_or_else(|| {
                    ControlError::Files {
                        code: hutch_api::ErrorCode::NotFound,
                        message: format!("no process tagged {tag:?}"),
                    }
                })
            }
        }
    }

    async fn agent_list(&self, conn: &mut AsyncConn, id: &str) -> Result<Vec<ProcessInfo>> {
        match conn.call(Request::List, &[]).await.map_err(|e| agent_error(id, e))? {
            (Reply::Processes { processes }, _) => Ok(processes),
            (other, _) => Err(ControlError::Runtime(format!("agent answered {other:?} to list"))),
        }
    }

    /// Starts a process and streams its events (start first, end last). A
    /// dropped receiver leaves the process running.
    pub async fn session_start(
        &self,
        owner: &str,
        id: &str,
        spec: ProcSpec,
        keepalive: Duration,
    ) -> Result<mpsc::Receiver<ProcEvent>> {
        if spec.argv.is_empty() || spec.argv.iter().any(|a| a.contains('\0')) {
            return Err(ControlError::Invalid("the command is empty or holds NUL".into()));
        }
        let mut conn = self.session_conn(owner, id).await?;
        let pty = spec.pty.is_some();
        let spawn = Spawn {
            cmd: Cmd::Argv(spec.argv),
            env: spec.env,
            cwd: spec.cwd,
            user: Some(spec.user),
            stdin: spec.stdin,
            pty: spec.pty,
            tag: spec.tag,
            timeout_ms: spec.timeout_ms,
            subscribe: true,
        };
        self.metrics.commands_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = match conn.call(Request::Spawn(spawn), &[]).await.map_err(|e| agent_error(id, e))? {
            (Reply::Spawned { pid }, _) => pid,
            (other, _) => return Err(ControlError::Runtime(format!("agent answered {other:?} to spawn"))),
        };
        Ok(pump(conn, id.to_owned(), pid, pty, keepalive))
    }

    /// Attaches to a running process: its kept output, live output, its end.
    pub async fn session_connect(
        &self,
        owner: &str,
        id: &str,
        target: &Target,
        keepalive: Duration,
    ) -> Result<mpsc::Receiver<ProcEvent>> {
        let mut conn = self.session_conn(owner, id).await?;
        let pid = self.resolve(&mut conn, id, target).await?;
        let list = self.agent_list(&mut conn, id).await?;
        let pty = list.iter().find(|p| p.pid == pid).is_some_and(|p| p.pty);
        conn.call(Request::Attach { target: Target::Pid(pid) }, &[]).await.map_err(|e| agent_error(id, e))?;
        Ok(pump(conn, id.to_owned(), pid, pty, keepalive))
    }

    /// The processes started through the agent that still run.
    pub async fn session_list(&self, owner: &str, id: &str) -> Result<Vec<ProcessInfo>> {
        let mut conn = self.session_conn(owner, id).await?;
        self.agent_list(&mut conn, id).await
    }

    /// Writes to a process's stdin (or terminal).
    pub async fn session_input(&self, owner: &str, id: &str, target: &Target, data: &[u8]) -> Result<()> {
        let mut conn = self.session_conn(owner, id).await?;
        let pid = self.resolve(&mut conn, id, target).await?;
        for chunk in data.chunks(proto::MAX_DATA) {
            conn.call(Request::Stdin { pid }, chunk).await.map_err(|e| agent_error(id, e))?;
        }
        Ok(())
    }

    pub async fn session_close_stdin(&self, owner: &str, id: &str, target: &Target) -> Result<()> {
        let mut conn = self.session_conn(owner, id).await?;
        let pid = self.resolve(&mut conn, id, target).await?;
        conn.call(Request::CloseStdin { pid }, &[]).await.map_err(|e| agent_error(id, e))?;
        Ok(())
    }

    pub async fn session_signal(&self, owner: &str, id: &str, target: &Target, signal: i32) -> Result<()> {
        let mut conn = self.session_conn(owner, id).await?;
        let pid = self.resolve(&mut conn, id, target).await?;
        conn.call(Request::Signal { pid, signal }, &[]).await.map_err(|e| agent_error(id, e))?;
        Ok(())
    }

    pub async fn session_resize(&self, owner: &str, id: &str, target: &Target, size: PtySize) -> Result<()> {
        let mut conn = self.session_conn(owner, id).await?;
        let pid = self.resolve(&mut conn, id, target).await?;
        conn.call(Request::Resize { pid, size }, &[]).await.map_err(|e| agent_error(id, e))?;
        Ok(())
    }

    /// Watches a directory (as `user`, recursively or not) and streams its
    /// events. The watch lives on its own agent connection: dropping the
    /// receiver closes that connection, which ends the watch in the agent.
    pub async fn session_watch(
        &self,
        owner: &str,
        id: &str,
        path: String,
        recursive: bool,
        user: String,
        keepalive: Duration,
    ) -> Result<mpsc::Receiver<WatchItem>> {
        let mut conn = self.session_conn(owner, id).await?;
        let req = Request::Watch { path, recursive, user: Some(user) };
        let watch = match conn.call(req, &[]).await {
            Ok((Reply::Watching { watch }, _)) => watch,
            Ok((other, _)) => return Err(ControlError::Runtime(format!("agent answered {other:?} to watch"))),
            Err(e @ AgentError::Refused { .. }) => {
                let f = FilesError::from_agent(e, Access::Read);
                return Err(ControlError::Files { code: f.code, message: f.message });
            }
            Err(source) => return Err(ControlError::Agent { sandbox: id.to_owned(), source }),
        };
        let (tx, rx) = mpsc::channel(256);
        let sid = id.to_owned();
        tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    () = tx.closed() => return,
                    got = tokio::time::timeout(keepalive, conn.recv()) => match got {
                        Err(_) => WatchItem::Keepalive,
                        Ok(Err(e)) => WatchItem::Failed(ControlError::Agent { sandbox: sid.clone(), source: e }),
                        Ok(Ok((FromAgent::Watch { watch: w, event }, _))) if w == watch => WatchItem::Event(event),
                        Ok(Ok(_)) => continue,
                    },
                };
                let last = matches!(item, WatchItem::Failed(_));
                if tx.send(item).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(rx)
    }

    /// One file operation (stat, list, mkdir, rename, remove) as the agent
    /// answers it.
    pub async fn session_file_op(&self, owner: &str, id: &str, req: Request, access: Access) -> Result<Reply> {
        let mut conn = self.session_conn(owner, id).await?;
        match conn.call(req, &[]).await {
            Ok((reply, _)) => Ok(reply),
            Err(e @ AgentError::Refused { .. }) => {
                let f = FilesError::from_agent(e, access);
                Err(ControlError::Files { code: f.code, message: f.message })
            }
            Err(source) => Err(ControlError::Agent { sandbox: id.to_owned(), source }),
        }
    }
}

/// Forwards a subscribed connection's events for `pid` until it exits or
/// the receiver goes away.
fn pump(mut conn: AsyncConn, sid: String, pid: u32, pty: bool, keepalive: Duration) -> mpsc::Receiver<ProcEvent> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        if tx.send(ProcEvent::Start { pid }).await.is_err() {
            return;
        }
        loop {
            let ev = match tokio::time::timeout(keepalive, conn.recv()).await {
                Err(_) => ProcEvent::Keepalive,
                Ok(Err(e)) => ProcEvent::Failed(ControlError::Agent { sandbox: sid.clone(), source: e }),
                Ok(Ok((FromAgent::Output { pid: p, stream }, data))) if p == pid => {
                    let stream = match (pty, stream) {
                        (true, _) => ProcStream::Pty,
                        (false, Stream::Stdout) => ProcStream::Stdout,
                        (false, Stream::Stderr) => ProcStream::Stderr,
                    };
                    ProcEvent::Data { stream, data }
                }
                Ok(Ok((FromAgent::Exit { pid: p, status }, _))) if p == pid => ProcEvent::End { status },
                Ok(Ok(_)) => continue,
            };
            let last = matches!(ev, ProcEvent::End { .. } | ProcEvent::Failed(_));
            if tx.send(ev).await.is_err() || last {
                return;
            }
        }
    });
    rx
}
