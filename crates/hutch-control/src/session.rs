//! Sessions of the E2B API (envd) in a sandbox: an [`EnvdSession`] proves
//! which sandbox, owner and sandbox user a call acts for (see `e2b`); on it,
//! processes started with a terminal, a tag or an open stdin stream their
//! events, directory watches stream theirs (or are polled), and typed file
//! operations run (`fileops`). The same sandboxes and agent connections as
//! the native commands; no HTTP here, and no way to send the agent anything
//! but these operations.

use crate::control::Control;
use crate::error::{from_agent, ControlError, Result};
use crate::files::{Access, UploadTemp};
use crate::history::{History, LogLevel};
use crate::ids::{OwnerId, SandboxId};
use crate::lifecycle::Live;
use hutch_agent::proto::{self, Cmd, FromAgent, ProcessInfo, Reply, Request, Spawn, Stream};
use hutch_runtime::agent_async::AsyncConn;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Plain data of the agent link that sessions hand out, read-only.
pub use hutch_agent::proto::{Entry, EntryKind, ExitStatus, PtySize, Target, WatchEvent, WatchKind};

/// Most polled watchers one sandbox may hold; they end with it.
pub const WATCHERS_PER_SANDBOX: usize = 64;
/// Most events a polled watcher keeps unread; older ones are dropped (an
/// overflow event says so).
const WATCHER_BACKLOG: usize = 4096;

/// Who an envd call acts for: a sandbox, its owner (proved by the
/// sandbox's token or a signed URL) and the sandbox user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdSession {
    pub(crate) id: SandboxId,
    pub(crate) owner: OwnerId,
    user: String,
}

/// A sandbox user a call may name: `user` or `root` (the users every
/// sandbox has).
pub fn valid_user(user: &str) -> bool {
    matches!(user, "user" | "root")
}

impl EnvdSession {
    pub(crate) fn new(id: SandboxId, owner: OwnerId, user: &str) -> Result<EnvdSession> {
        if !valid_user(user) {
            return Err(ControlError::Invalid(format!("unknown user {:?}: use `user` or `root`", truncate(user))));
        }
        Ok(EnvdSession { id, owner, user: user.to_owned() })
    }

    pub fn sandbox(&self) -> &SandboxId {
        &self.id
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    /// The key that owns the sandbox (whose call this is, for the audit log).
    pub fn owner(&self) -> &OwnerId {
        &self.owner
    }

    /// The same session as another sandbox user (the `username` of a
    /// `/files` call).
    pub fn as_user(&self, user: &str) -> Result<EnvdSession> {
        EnvdSession::new(self.id.clone(), self.owner.clone(), user)
    }

    /// The user's home directory.
    pub fn home(&self) -> &'static str {
        if self.user == "root" {
            "/root"
        } else {
            "/home/user"
        }
    }

    /// A path made absolute against the user's home (E2B's rule), normalized;
    /// empty is the home itself.
    pub fn resolve(&self, path: &str) -> Result<String> {
        if path.is_empty() {
            return Ok(self.home().to_owned());
        }
        proto::normalize_path(path, self.home()).map_err(|_| {
            ControlError::Files(crate::files::FilesError::new(
                hutch_api::ErrorCode::InvalidPath,
                format!("invalid path {:?}", truncate(path)),
            ))
        })
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ProcSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Absolute.
    pub cwd: Option<String>,
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

/// A process as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub tag: Option<String>,
    /// The program and its arguments (a shell command as `/bin/sh -c`).
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub pty: bool,
}

impl From<ProcessInfo> for ProcInfo {
    fn from(p: ProcessInfo) -> ProcInfo {
        ProcInfo {
            pid: p.pid,
            tag: p.tag,
            argv: match p.cmd {
                Cmd::Argv(a) => a,
                Cmd::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s],
            },
            env: p.env.into_iter().collect(),
            cwd: p.cwd,
            pty: p.pty,
        }
    }
}

/// What a watch asks for beyond its path.
#[derive(Debug, Clone, Copy, Default)]
pub struct WatchOptions {
    /// Events that leave an entry carry it.
    pub include_entry: bool,
    /// A directory on a network file system may be watched.
    pub allow_network_mounts: bool,
}

/// One event of a directory watch: what happened to which entry (its name
/// relative to the watched directory), and the entry, when asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsEvent {
    pub kind: WatchKind,
    pub name: String,
    pub entry: Option<Entry>,
}

/// Turns the agent's events of a watched directory into what envd's
/// watchers report. A file written through the files API goes to a
/// temporary beside it (whose events are not reported) that is put in its
/// place; envd writes in place, so its watchers see the file created
/// (made by root and given to the user: a chmod) and written, or for a
/// file replaced, its owner set again and written. The temporary's name
/// says which ([`UploadTemp`]); its rename and the create of the target
/// that follows in the same directory become those events.
///
/// A temporary that replaces a file is swapped with it (the agent's
/// commit): the old file's rename to the temporary's name follows the
/// target's create, and is held until the next event shows which it was
/// (the create of a temporary in the same directory) or
/// [`UploadEvents::flush`] lets it go.
#[derive(Debug, Default)]
pub struct UploadEvents {
    /// A temporary just renamed away: its directory and kind.
    renamed: Option<(String, UploadTemp)>,
    /// The target of the upload just reported.
    put: Option<String>,
    /// A rename of that target, held: the swap's, or the user's.
    held: Option<WatchEvent>,
}

/// How long a held rename may wait for the event that says what it was.
pub const UPLOAD_HOLD: Duration = Duration::from_millis(100);

impl UploadEvents {
    /// The events that stand for `e`.
    pub fn push(&mut self, e: WatchEvent) -> Vec<WatchEvent> {
        let (dir, base) = match e.name.rsplit_once('/') {
            Some((d, b)) => (d, b),
            None => ("", e.name.as_str()),
        };
        let mut out = Vec::new();
        if let Some(held) = self.held.take() {
            let held_dir = held.name.rsplit_once('/').map_or("", |(d, _)| d);
            let swapped = e.kind == WatchKind::Create && UploadTemp::of(base).is_some() && held_dir == dir;
            if !swapped {
                out.push(held);
            }
        }
        if let Some(temp) = UploadTemp::of(base) {
            if e.kind == WatchKind::Rename {
                self.renamed = Some((dir.to_owned(), temp));
            }
            return out;
        }
        if self.put.take().is_some_and(|p| p == e.name) && e.kind == WatchKind::Rename {
            self.held = Some(e);
            return out;
        }
        if let Some((from, temp)) = self.renamed.take() {
            if e.kind == WatchKind::Create && from == dir {
                let as_kind = |kind| WatchEvent { kind, name: e.name.clone() };
                out.extend(match temp {
                    UploadTemp::New => {
                        vec![as_kind(WatchKind::Create), as_kind(WatchKind::Chmod), as_kind(WatchKind::Write)]
                    }
                    UploadTemp::Replacing => vec![as_kind(WatchKind::Chmod), as_kind(WatchKind::Write)],
                    UploadTemp::Plain => vec![as_kind(WatchKind::Create), as_kind(WatchKind::Write)],
                });
                self.put = Some(e.name);
                return out;
            }
        }
        out.push(e);
        out
    }

    /// Whether a rename is held (see [`UploadEvents::flush`]).
    pub fn holding(&self) -> bool {
        self.held.is_some()
    }

    /// The held rename, once [`UPLOAD_HOLD`] passed with no event: a swap
    /// sends its events together, so it was the user's.
    pub fn flush(&mut self) -> Option<WatchEvent> {
        self.put = None;
        self.held.take()
    }
}

fn join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// The entry at `path` as `user` sees it, through `conn` (opened on first
/// use); none when it is gone or cannot be read.
async fn entry_of(live: &Live, conn: &mut Option<AsyncConn>, path: &str, user: &str) -> Option<Entry> {
    if conn.is_none() {
        *conn = live.fresh_conn().await.ok();
    }
    let req = Request::Stat { path: path.to_owned(), user: Some(user.to_owned()) };
    match conn.as_mut()?.call(req, &[]).await {
        Ok((Reply::Stat { entry }, _)) => Some(entry),
        Ok(_) => None,
        Err(e) => {
            // A broken connection is opened again next time; a refusal
            // (gone, unreadable) leaves the event without its entry.
            if !matches!(e, hutch_runtime::agent::AgentError::Refused { .. }) {
                *conn = None;
            }
            None
        }
    }
}

/// One event of a directory watch.
#[derive(Debug)]
pub enum WatchItem {
    Event(FsEvent),
    Keepalive,
    /// The watch broke (the agent or the sandbox went away).
    Failed(ControlError),
}

/// The polled watchers of one sandbox (kept in its [`Live`], so they end
/// with it).
#[derive(Default)]
pub struct Watchers {
    next: u64,
    by_id: BTreeMap<String, Watcher>,
}

struct Watcher {
    events: mpsc::Receiver<WatchItem>,
    /// Read from `events` but not yet fetched.
    backlog: VecDeque<FsEvent>,
}

/// What a poll of a watcher got.
#[derive(Debug)]
pub enum Polled {
    Events(Vec<FsEvent>),
    /// The watch ended; these were its last events.
    Ended(Vec<FsEvent>),
}

impl Control {
    async fn session_live(&self, s: &EnvdSession) -> Result<Arc<Live>> {
        self.running_of(&s.owner, &s.id).await
    }

    async fn session_conn(&self, s: &EnvdSession) -> Result<AsyncConn> {
        Ok(self.session_link(s).await?.1)
    }

    /// The live sandbox and a fresh agent connection to it.
    async fn session_link(&self, s: &EnvdSession) -> Result<(Arc<Live>, AsyncConn)> {
        let live = self.session_live(s).await?;
        let conn = live.fresh_conn().await.map_err(|e| from_agent(&s.id, e, Access::Process))?;
        Ok((live, conn))
    }

    /// The pid a selector names.
    async fn resolve_target(&self, conn: &mut AsyncConn, s: &EnvdSession, target: &Target) -> Result<u32> {
        match target {
            Target::Pid(p) => Ok(*p),
            Target::Tag(tag) => {
                let list = agent_list(conn, &s.id).await?;
                list.into_iter()
                    .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                    .map(|p| p.pid)
                    .ok_or_else(|| ControlError::NoProcess { sandbox: s.id.to_string(), pid: 0 })
            }
        }
    }

    /// Starts a process and streams its events (start first, end last). A
    /// dropped receiver leaves the process running.
    pub async fn session_start(
        &self,
        s: &EnvdSession,
        spec: ProcSpec,
        keepalive: Duration,
    ) -> Result<mpsc::Receiver<ProcEvent>> {
        if spec.argv.is_empty() || spec.argv.iter().any(|a| a.contains('\0')) {
            return Err(ControlError::Invalid("the command is empty or holds NUL".into()));
        }
        let (live, mut conn) = self.session_link(s).await?;
        let pty = spec.pty.is_some();
        let shown = spec.argv.join(" ");
        let spawn = Spawn {
            cmd: Cmd::Argv(spec.argv),
            env: spec.env,
            cwd: spec.cwd,
            user: Some(s.user.clone()),
            stdin: spec.stdin,
            pty: spec.pty,
            tag: spec.tag,
            timeout_ms: spec.timeout_ms,
            subscribe: true,
            output_limit: None,
        };
        self.count_command(&live.id);
        let pid =
            match conn.call(Request::Spawn(spawn), &[]).await.map_err(|e| from_agent(&s.id, e, Access::Process))? {
                (Reply::Spawned { pid }, _) => pid,
                (other, _) => return Err(ControlError::Runtime(format!("agent answered {other:?} to spawn"))),
            };
        self.log(
            &s.id,
            LogLevel::Info,
            format!("process {pid} started: {shown}"),
            &[("pid", pid.to_string()), ("user", s.user.clone())],
        );
        Ok(pump(conn, live, self.history.clone(), pid, pty, keepalive))
    }

    /// Attaches to a running process: its kept output, live output, its end.
    pub async fn session_connect(
        &self,
        s: &EnvdSession,
        target: &Target,
        keepalive: Duration,
    ) -> Result<mpsc::Receiver<ProcEvent>> {
        let (live, mut conn) = self.session_link(s).await?;
        let pid = self.resolve_target(&mut conn, s, target).await?;
        let list = agent_list(&mut conn, &s.id).await?;
        let pty = list.iter().find(|p| p.pid == pid).is_some_and(|p| p.pty);
        conn.call(Request::Attach { target: Target::Pid(pid) }, &[])
            .await
            .map_err(|e| from_agent(&s.id, e, Access::Process))?;
        Ok(pump(conn, live, self.history.clone(), pid, pty, keepalive))
    }

    /// The processes started through the agent that still run.
    pub async fn session_list(&self, s: &EnvdSession) -> Result<Vec<ProcInfo>> {
        let mut conn = self.session_conn(s).await?;
        Ok(agent_list(&mut conn, &s.id).await?.into_iter().map(ProcInfo::from).collect())
    }

    /// Writes to a process's stdin (or terminal).
    pub async fn session_input(&self, s: &EnvdSession, target: &Target, data: &[u8]) -> Result<()> {
        let mut conn = self.session_conn(s).await?;
        let pid = self.resolve_target(&mut conn, s, target).await?;
        for chunk in data.chunks(proto::MAX_DATA) {
            conn.call(Request::Stdin { pid }, chunk).await.map_err(|e| from_agent(&s.id, e, Access::Process))?;
        }
        Ok(())
    }

    pub async fn session_close_stdin(&self, s: &EnvdSession, target: &Target) -> Result<()> {
        let mut conn = self.session_conn(s).await?;
        let pid = self.resolve_target(&mut conn, s, target).await?;
        conn.call(Request::CloseStdin { pid }, &[]).await.map_err(|e| from_agent(&s.id, e, Access::Process))?;
        Ok(())
    }

    pub async fn session_signal(&self, s: &EnvdSession, target: &Target, signal: i32) -> Result<()> {
        let mut conn = self.session_conn(s).await?;
        let pid = self.resolve_target(&mut conn, s, target).await?;
        conn.call(Request::Signal { pid, signal }, &[]).await.map_err(|e| from_agent(&s.id, e, Access::Process))?;
        Ok(())
    }

    pub async fn session_resize(&self, s: &EnvdSession, target: &Target, size: PtySize) -> Result<()> {
        let mut conn = self.session_conn(s).await?;
        let pid = self.resolve_target(&mut conn, s, target).await?;
        conn.call(Request::Resize { pid, size }, &[]).await.map_err(|e| from_agent(&s.id, e, Access::Process))?;
        Ok(())
    }

    /// Watches a directory (as the session's user, recursively or not) and
    /// streams its events, as envd's watchers report them (see
    /// [`UploadEvents`]); with `opts.include_entry`, a create, write or
    /// chmod carries the entry as it is when the event is read (none when
    /// it is gone by then). The watch lives on its own agent connection:
    /// dropping the receiver closes that connection, which ends the watch
    /// in the agent.
    pub async fn session_watch(
        &self,
        s: &EnvdSession,
        path: String,
        recursive: bool,
        opts: WatchOptions,
        keepalive: Duration,
    ) -> Result<mpsc::Receiver<WatchItem>> {
        let (live, mut conn) = self.session_link(s).await?;
        let req = Request::Watch {
            path: path.clone(),
            recursive,
            user: Some(s.user.clone()),
            allow_network_mounts: opts.allow_network_mounts,
        };
        let watch = match conn.call(req, &[]).await {
            Ok((Reply::Watching { watch }, _)) => watch,
            Ok((other, _)) => return Err(ControlError::Runtime(format!("agent answered {other:?} to watch"))),
            Err(e) => return Err(from_agent(&s.id, e, Access::Read)),
        };
        let (tx, rx) = mpsc::channel(256);
        let user = s.user.clone();
        tokio::spawn(async move {
            let mut uploads = UploadEvents::default();
            // A second connection for the entries (this one carries events).
            let mut stats: Option<AsyncConn> = None;
            loop {
                let events = tokio::select! {
                    () = tx.closed() => return,
                    got = tokio::time::timeout(if uploads.holding() { UPLOAD_HOLD } else { keepalive }, conn.recv()) => match got {
                        Err(_) if uploads.holding() => {
                            uploads.flush().map(|e| WatchItem::Event(FsEvent { kind: e.kind, name: e.name, entry: None })).into_iter().collect()
                        }
                        Err(_) => vec![WatchItem::Keepalive],
                        Ok(Err(e)) => vec![WatchItem::Failed(broken_link(&live, e))],
                        Ok(Ok((FromAgent::Watch { watch: w, event }, _))) if w == watch => {
                            let mut out = Vec::new();
                            for e in uploads.push(event) {
                                let carries = matches!(e.kind, WatchKind::Create | WatchKind::Write | WatchKind::Chmod);
                                let entry = match opts.include_entry && carries {
                                    true => entry_of(&live, &mut stats, &join(&path, &e.name), &user).await,
                                    false => None,
                                };
                                out.push(WatchItem::Event(FsEvent { kind: e.kind, name: e.name, entry }));
                            }
                            out
                        }
                        Ok(Ok(_)) => continue,
                    },
                };
                for item in events {
                    let last = matches!(item, WatchItem::Failed(_));
                    if tx.send(item).await.is_err() || last {
                        return;
                    }
                }
            }
        });
        Ok(rx)
    }

    /// Starts a polled watcher: at most [`WATCHERS_PER_SANDBOX`] per
    /// sandbox, each ending with its sandbox.
    pub async fn create_watcher(
        &self,
        s: &EnvdSession,
        path: String,
        recursive: bool,
        opts: WatchOptions,
    ) -> Result<String> {
        let live = self.session_live(s).await?;
        if lock(&live).by_id.len() >= WATCHERS_PER_SANDBOX {
            return Err(ControlError::WatcherCapacity { id: s.id.to_string(), max: WATCHERS_PER_SANDBOX });
        }
        let events = self.session_watch(s, path, recursive, opts, Duration::from_secs(30)).await?;
        let mut w = lock(&live);
        if w.by_id.len() >= WATCHERS_PER_SANDBOX {
            return Err(ControlError::WatcherCapacity { id: s.id.to_string(), max: WATCHERS_PER_SANDBOX });
        }
        w.next += 1;
        let id = format!("w{}", w.next);
        w.by_id.insert(id.clone(), Watcher { events, backlog: VecDeque::new() });
        Ok(id)
    }

    /// The events a polled watcher got since the last poll (at most `max`).
    pub async fn poll_watcher(&self, s: &EnvdSession, watcher: &str, max: usize) -> Result<Polled> {
        let live = self.session_live(s).await?;
        let mut table = lock(&live);
        let w = table.by_id.get_mut(watcher).ok_or_else(|| ControlError::NoWatcher(truncate(watcher)))?;
        let mut ended = None;
        loop {
            match w.events.try_recv() {
                Ok(WatchItem::Event(e)) => {
                    if w.backlog.len() >= WATCHER_BACKLOG {
                        w.backlog.pop_front();
                        w.backlog.push_front(FsEvent { kind: WatchKind::Overflow, name: String::new(), entry: None });
                    }
                    w.backlog.push_back(e);
                }
                Ok(WatchItem::Keepalive) => {}
                Ok(WatchItem::Failed(e)) => {
                    ended = Some(Err(e));
                    break;
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    ended = Some(Ok(()));
                    break;
                }
            }
        }
        let n = w.backlog.len().min(max);
        let events: Vec<FsEvent> = w.backlog.drain(..n).collect();
        match ended {
            None => Ok(Polled::Events(events)),
            Some(end) => {
                if w.backlog.is_empty() {
                    table.by_id.remove(watcher);
                }
                match end {
                    Err(e) if events.is_empty() => Err(e),
                    _ if events.is_empty() => {
                        Err(ControlError::NoWatcher(format!("{} (it has ended)", truncate(watcher))))
                    }
                    _ => Ok(Polled::Ended(events)),
                }
            }
        }
    }

    /// Ends a polled watcher (its agent connection closes with it).
    pub async fn remove_watcher(&self, s: &EnvdSession, watcher: &str) -> Result<()> {
        let live = self.session_live(s).await?;
        let removed = lock(&live).by_id.remove(watcher);
        removed.map(|_| ()).ok_or_else(|| ControlError::NoWatcher(truncate(watcher)))
    }
}

fn lock(live: &Live) -> std::sync::MutexGuard<'_, Watchers> {
    live.watchers.lock().unwrap_or_else(|p| p.into_inner())
}

async fn agent_list(conn: &mut AsyncConn, id: &SandboxId) -> Result<Vec<ProcessInfo>> {
    match conn.call(Request::List, &[]).await.map_err(|e| from_agent(id, e, Access::Process))? {
        (Reply::Processes { processes }, _) => Ok(processes),
        (other, _) => Err(ControlError::Runtime(format!("agent answered {other:?} to list"))),
    }
}

/// Why an agent link broke: the sandbox ended (its deletion takes the
/// runtime handle before it kills the agent), or the agent failed.
pub(crate) fn broken_link(live: &Live, e: hutch_runtime::agent::AgentError) -> ControlError {
    let ended = live.handle.lock().map(|h| h.is_none()).unwrap_or(true);
    if ended {
        ControlError::NoSandbox(live.id.to_string())
    } else {
        ControlError::Agent { sandbox: live.id.to_string(), source: e }
    }
}

/// Forwards a subscribed connection's events for `pid` until it exits or
/// the receiver goes away; the exit goes to the sandbox's log.
fn pump(
    mut conn: AsyncConn,
    live: Arc<Live>,
    history: Arc<History>,
    pid: u32,
    pty: bool,
    keepalive: Duration,
) -> mpsc::Receiver<ProcEvent> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        if tx.send(ProcEvent::Start { pid }).await.is_err() {
            return;
        }
        loop {
            let ev = match tokio::time::timeout(keepalive, conn.recv()).await {
                Err(_) => ProcEvent::Keepalive,
                Ok(Err(e)) => ProcEvent::Failed(broken_link(&live, e)),
                Ok(Ok((FromAgent::Output { pid: p, stream }, data))) if p == pid => {
                    let stream = match (pty, stream) {
                        (true, _) => ProcStream::Pty,
                        (false, Stream::Stdout) => ProcStream::Stdout,
                        (false, Stream::Stderr) => ProcStream::Stderr,
                    };
                    ProcEvent::Data { stream, data }
                }
                Ok(Ok((FromAgent::Exit { pid: p, status }, _))) if p == pid => {
                    let (level, how) = match status.code {
                        Some(0) => (LogLevel::Info, crate::ready::describe_exit(&status)),
                        _ => (LogLevel::Warn, crate::ready::describe_exit(&status)),
                    };
                    let code = status.shell_code().to_string();
                    history.log(
                        &live.id,
                        level,
                        format!("process {pid} ended: {how}"),
                        &[("pid", pid.to_string()), ("exit_code", code)],
                    );
                    ProcEvent::End { status }
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_show_as_envd_writes_in_place() {
        let ev = |kind, name: &str| WatchEvent { kind, name: name.to_owned() };
        let mut u = UploadEvents::default();
        fn feed(u: &mut UploadEvents, events: Vec<WatchEvent>) -> Vec<(WatchKind, String)> {
            events.into_iter().flat_map(|e| u.push(e)).map(|e| (e.kind, e.name)).collect()
        }
        // A new file: the temporary's own events are hidden.
        let got = feed(
            &mut u,
            vec![
                ev(WatchKind::Create, "sub/.hutch-upload-n0123abcd"),
                ev(WatchKind::Write, "sub/.hutch-upload-n0123abcd"),
                ev(WatchKind::Rename, "sub/.hutch-upload-n0123abcd"),
                ev(WatchKind::Create, "sub/f.txt"),
            ],
        );
        let names = |v: &[(WatchKind, &str)]| v.iter().map(|(k, n)| (*k, n.to_string())).collect::<Vec<_>>();
        assert_eq!(
            got,
            names(&[
                (WatchKind::Create, "sub/f.txt"),
                (WatchKind::Chmod, "sub/f.txt"),
                (WatchKind::Write, "sub/f.txt")
            ])
        );
        // A replaced file, and a native write (which says neither).
        let got = feed(&mut u, vec![ev(WatchKind::Rename, ".hutch-upload-r99"), ev(WatchKind::Create, "g")]);
        assert_eq!(got, names(&[(WatchKind::Chmod, "g"), (WatchKind::Write, "g")]));
        let got = feed(&mut u, vec![ev(WatchKind::Rename, ".hutch-upload-0a1b"), ev(WatchKind::Create, "h")]);
        assert_eq!(got, names(&[(WatchKind::Create, "h"), (WatchKind::Write, "h")]));
        // A create elsewhere after a temporary's rename is itself.
        let got = feed(&mut u, vec![ev(WatchKind::Rename, "a/.hutch-upload-n1"), ev(WatchKind::Create, "b/x")]);
        assert_eq!(got, names(&[(WatchKind::Create, "b/x")]));
        // Everything else passes as it is.
        let got = feed(
            &mut u,
            vec![ev(WatchKind::Rename, "old"), ev(WatchKind::Create, "new"), ev(WatchKind::Remove, "new")],
        );
        assert_eq!(got, names(&[(WatchKind::Rename, "old"), (WatchKind::Create, "new"), (WatchKind::Remove, "new")]));
        // A file replaced by a swap: the old file's move to the
        // temporary's name and its removal are hidden.
        let got = feed(
            &mut u,
            vec![
                ev(WatchKind::Rename, "d/.hutch-upload-r7"),
                ev(WatchKind::Create, "d/g"),
                ev(WatchKind::Rename, "d/g"),
                ev(WatchKind::Create, "d/.hutch-upload-r7"),
                ev(WatchKind::Remove, "d/.hutch-upload-r7"),
                ev(WatchKind::Write, "d/h"),
            ],
        );
        assert_eq!(got, names(&[(WatchKind::Chmod, "d/g"), (WatchKind::Write, "d/g"), (WatchKind::Write, "d/h")]));
        // The user's own rename of a file just written is held until the
        // next event, or until it is flushed, and then reported.
        let got = feed(
            &mut u,
            vec![
                ev(WatchKind::Rename, ".hutch-upload-n1"),
                ev(WatchKind::Create, "f"),
                ev(WatchKind::Rename, "f"),
                ev(WatchKind::Create, "moved"),
            ],
        );
        assert_eq!(
            got,
            names(&[
                (WatchKind::Create, "f"),
                (WatchKind::Chmod, "f"),
                (WatchKind::Write, "f"),
                (WatchKind::Rename, "f"),
                (WatchKind::Create, "moved")
            ])
        );
        assert!(feed(
            &mut u,
            vec![ev(WatchKind::Rename, ".hutch-upload-1"), ev(WatchKind::Create, "k"), ev(WatchKind::Rename, "k")]
        )
        .iter()
        .all(|(k, _)| *k != WatchKind::Rename));
        assert!(u.holding());
        assert_eq!(u.flush().map(|e| (e.kind, e.name)), Some((WatchKind::Rename, "k".to_owned())));
        assert!(!u.holding() && u.flush().is_none());
        // A rename of the target later, after other events, is not held.
        let got = feed(
            &mut u,
            vec![
                ev(WatchKind::Rename, ".hutch-upload-2"),
                ev(WatchKind::Create, "m"),
                ev(WatchKind::Write, "other"),
                ev(WatchKind::Rename, "m"),
            ],
        );
        assert_eq!(got.last(), Some(&(WatchKind::Rename, "m".to_owned())));
    }

    #[test]
    fn sessions_name_only_the_users_a_sandbox_has_and_resolve_against_home() {
        let id = SandboxId::from_record("sb-0000000000000001");
        let owner = OwnerId::from_record("key-000000000001");
        assert!(EnvdSession::new(id.clone(), owner.clone(), "nobody").is_err());
        let s = EnvdSession::new(id, owner, "user").expect("user");
        assert_eq!(s.resolve("").expect("home"), "/home/user");
        assert_eq!(s.resolve("a/b").expect("relative"), "/home/user/a/b");
        assert_eq!(s.as_user("root").expect("root").resolve("x").expect("root's"), "/root/x");
        assert!(s.resolve("../../etc").is_err());
    }
}
