//! A sandbox's lifecycle: the typed transitions between its states, the
//! reasons a sandbox ends with, and the handle of a sandbox this daemon
//! runs ([`Live`]).
//!
//! ```text
//!   starting ──Ready──► running ◄──Resume── suspended
//!      │                 │  └──Suspend──────►  │
//!      │ FailStart       └──────Terminate──────┤ (also from starting)
//!      ▼                                       ▼
//!   terminated ◄────────────Finish──────── terminating
//!
//!   running, suspended ──Pause──► paused ──Wake──► starting
//!   paused ──Terminate──► terminating
//!   starting, running, suspended, terminating ──Lose──► lost
//! ```
//!
//! `Lose` is taken by another node, for every sandbox of a node declared
//! lost at once ([`hutch_store::Store::mark_node_lost`], see
//! [`crate::fleet`]); `lost` is final.
//!
//! Every change of state is one of these, made by a conditional update of
//! the store ([`hutch_store::Store::transition`]): it names the states it
//! leaves, so two writers never both win, and nothing written meanwhile by
//! a targeted update (an expiry, a network record) is lost.

use crate::ids::{OwnerId, SandboxId};
use hutch_api::SandboxState;
use hutch_runtime::agent::AgentError;
use hutch_runtime::agent_async::AsyncConn;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One change of a sandbox's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// Its runtime sandbox started (and its template's readiness passed).
    Ready,
    Suspend,
    Resume,
    /// A delete, an expiry, or a failure: it is being torn down.
    Terminate,
    /// Its teardown finished.
    Finish,
    /// Its start failed (or it was deleted while starting).
    FailStart,
    /// Paused to disk: its processes are ending, its layer stays.
    Pause,
    /// A paused sandbox starts again on its layer.
    Wake,
    /// Its node was declared lost (it stopped heartbeating).
    Lose,
}

impl Transition {
    pub(crate) fn from(self) -> &'static [SandboxState] {
        use SandboxState::*;
        match self {
            Transition::Ready => &[Starting],
            Transition::Suspend => &[Running],
            Transition::Resume => &[Suspended],
            Transition::Terminate => &[Starting, Running, Suspended, Paused],
            Transition::Finish => &[Terminating],
            Transition::FailStart => &[Starting, Terminating],
            Transition::Pause => &[Running, Suspended],
            Transition::Wake => &[Paused],
            Transition::Lose => &[Starting, Running, Suspended, Terminating],
        }
    }

    pub(crate) fn to(self) -> SandboxState {
        match self {
            Transition::Ready | Transition::Resume => SandboxState::Running,
            Transition::Suspend => SandboxState::Suspended,
            Transition::Terminate => SandboxState::Terminating,
            Transition::Finish | Transition::FailStart => SandboxState::Terminated,
            Transition::Pause => SandboxState::Paused,
            Transition::Wake => SandboxState::Starting,
            Transition::Lose => SandboxState::Lost,
        }
    }
}

/// States in which a sandbox holds host resources.
pub const HOLDING_STATES: [SandboxState; 4] =
    [SandboxState::Starting, SandboxState::Running, SandboxState::Suspended, SandboxState::Terminating];
pub(crate) const HOLDING: &[SandboxState] = &HOLDING_STATES;
/// States in which a sandbox keeps its files: holding, or paused to disk.
pub(crate) const KEEPING_FILES: [SandboxState; 5] = [
    SandboxState::Starting,
    SandboxState::Running,
    SandboxState::Suspended,
    SandboxState::Terminating,
    SandboxState::Paused,
];

/// Why a sandbox ended or failed to start: its `last_error_code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Expired,
    AgentExited,
    LostOnRestart,
    WarmPoolDrained,
    KeyRevoked,
    /// Its start was cut short by a delete.
    DeletedWhileStarting,
    NetworkUnavailable,
    NetworkUntrusted,
    StartupFailed,
    ReadinessTimeout,
    CapacityUnavailable,
    CgroupFailed,
    SetupFailed,
    AgentFailed,
    StartRejected,
    ImageNotFound,
    ImageUnavailable,
    /// Its disk layer could not be made or readied.
    StorageFailed,
    /// Idle past its `idle_timeout_seconds` with `on_idle: "delete"`.
    Idle,
    /// Its node was declared lost.
    NodeLost,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Expired => "sandbox_expired",
            Reason::AgentExited => "sandbox_agent_exited",
            Reason::LostOnRestart => "sandbox_lost_on_restart",
            Reason::WarmPoolDrained => "warm_pool_drained",
            Reason::KeyRevoked => "key_revoked",
            Reason::DeletedWhileStarting => "sandbox_deleted_while_starting",
            Reason::NetworkUnavailable => "sandbox_network_unavailable",
            Reason::NetworkUntrusted => "sandbox_network_untrusted",
            Reason::StartupFailed => "sandbox_startup_failed",
            Reason::ReadinessTimeout => "sandbox_readiness_timeout",
            Reason::CapacityUnavailable => "sandbox_capacity_unavailable",
            Reason::CgroupFailed => "sandbox_cgroup_failed",
            Reason::SetupFailed => "sandbox_setup_failed",
            Reason::AgentFailed => "sandbox_agent_failed",
            Reason::StartRejected => "sandbox_start_rejected",
            Reason::ImageNotFound => "image_not_found",
            Reason::ImageUnavailable => "image_unavailable",
            Reason::StorageFailed => "sandbox_storage_failed",
            Reason::Idle => "sandbox_idle",
            Reason::NodeLost => "node_lost",
        }
    }

    /// Why the runtime could not start a sandbox: one exhaustive match.
    pub(crate) fn of_start(e: &hutch_runtime::RuntimeError) -> Reason {
        use hutch_runtime::RuntimeError as E;
        match e {
            E::Uids(_) => Reason::CapacityUnavailable,
            E::Cgroup(_) => Reason::CgroupFailed,
            E::Setup(_) => Reason::SetupFailed,
            E::Agent(_) | E::NoAgent { .. } => Reason::AgentFailed,
            E::Storage(_) | E::NoStorage => Reason::StorageFailed,
            E::InvalidId(_) | E::ClassUnavailable(..) | E::Rootfs(_) | E::Seccomp(_) | E::Io { .. } => {
                Reason::StartRejected
            }
        }
    }
}

/// Idle agent connections kept per sandbox.
const IDLE_CONNS: usize = 4;
/// How long an idle agent connection is kept (see [`Live::drop_idle_conns`]).
pub(crate) const IDLE_CONN_AGE: Duration = Duration::from_secs(30);

/// Idle connections of one sandbox, the most recently put back last, each
/// with when it was.
#[derive(Debug)]
struct IdleConns<T> {
    conns: Vec<(T, Instant)>,
}

impl<T> IdleConns<T> {
    fn new() -> IdleConns<T> {
        IdleConns { conns: Vec::new() }
    }

    /// Keeps `c` unless [`IDLE_CONNS`] are kept already (then it is dropped).
    fn put(&mut self, c: T, now: Instant) {
        if self.conns.len() < IDLE_CONNS {
            self.conns.push((c, now));
        }
    }

    /// The most recently put back.
    fn take(&mut self) -> Option<T> {
        self.take_aged().map(|(c, _)| c)
    }

    /// The most recently put back, with when it was (to put it back as old
    /// as it was).
    fn take_aged(&mut self) -> Option<(T, Instant)> {
        self.conns.pop()
    }

    /// Drops those put back `age` or longer before `now`.
    fn expire(&mut self, age: Duration, now: Instant) {
        self.conns.retain(|(_, at)| now.saturating_duration_since(*at) < age);
    }

    /// Counts every one as put back `now`.
    fn touch(&mut self, now: Instant) {
        self.conns.iter_mut().for_each(|(_, at)| *at = now);
    }

    fn clear(&mut self) {
        self.conns.clear();
    }
}

/// A sandbox this daemon runs now: what every command, file transfer and
/// port connection of it goes through. Its owner is fixed for its life.
pub struct Live {
    pub(crate) id: SandboxId,
    pub(crate) owner: OwnerId,
    pub(crate) socket: PathBuf,
    /// The runtime's handle; taken by the deletion.
    pub(crate) handle: Mutex<Option<hutch_runtime::Sandbox>>,
    /// Set while frozen: no new commands.
    suspended: AtomicBool,
    /// In a warm pool, unclaimed: nobody's yet.
    pooled: AtomicBool,
    /// Idle agent connections, reused by commands (a connect and an accept
    /// saved per command), each with when it was put back.
    idle: Mutex<IdleConns<AsyncConn>>,
    /// When background commands started, by pid, for reattached streams.
    pub(crate) started: Mutex<HashMap<u32, Instant>>,
    /// The E2B API's polled directory watchers of this sandbox; they end
    /// with it.
    pub(crate) watchers: Mutex<crate::session::Watchers>,
    /// OOM kills its cgroup counted at the reconciler's last look.
    pub(crate) oom_seen: std::sync::atomic::AtomicU64,
    /// When it was last used through the API (Unix ms; see [`crate::idle`]).
    last_active: AtomicI64,
    /// A command was seen running (by a background start or the idle
    /// sweeper) and not yet seen ended.
    busy: AtomicBool,
}

impl Live {
    /// Whether its writable layer is on disk (see [`crate::files::SandboxFs::passing_writes`]).
    pub(crate) fn on_disk(&self) -> bool {
        self.handle.lock().ok().is_some_and(|h| h.as_ref().is_some_and(|sb| sb.on_disk()))
    }

    pub(crate) fn new(sb: hutch_runtime::Sandbox, owner: OwnerId, pooled: bool) -> Arc<Live> {
        Arc::new(Live {
            id: SandboxId::from_record(&sb.id),
            owner,
            socket: sb.socket.clone(),
            handle: Mutex::new(Some(sb)),
            suspended: AtomicBool::new(false),
            pooled: AtomicBool::new(pooled),
            idle: Mutex::new(IdleConns::new()),
            started: Mutex::new(HashMap::new()),
            watchers: Mutex::new(crate::session::Watchers::default()),
            oom_seen: std::sync::atomic::AtomicU64::new(0),
            last_active: AtomicI64::new(hutch_api::time::now_ms()),
            busy: AtomicBool::new(false),
        })
    }

    /// Notes a use through the API: one atomic store.
    pub(crate) fn touch(&self) {
        self.last_active.store(hutch_api::time::now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn last_active(&self) -> i64 {
        self.last_active.load(Ordering::Relaxed)
    }

    pub(crate) fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed)
    }

    pub(crate) fn set_busy(&self, v: bool) {
        self.busy.store(v, Ordering::Relaxed);
    }

    pub(crate) fn is_suspended(&self) -> bool {
        self.suspended.load(Ordering::SeqCst)
    }

    pub(crate) fn set_suspended(&self, v: bool) {
        self.suspended.store(v, Ordering::SeqCst);
    }

    pub(crate) fn is_pooled(&self) -> bool {
        self.pooled.load(Ordering::SeqCst)
    }

    pub(crate) fn claimed(&self) {
        // The connection its refill left for the first command counts as
        // used now: the reconciler's next pass does not close it.
        if let Ok(mut v) = self.idle.lock() {
            v.touch(Instant::now());
        }
        self.pooled.store(false, Ordering::SeqCst);
    }

    /// An agent connection: an idle one, or a new one.
    pub(crate) async fn conn(&self) -> std::result::Result<AsyncConn, AgentError> {
        if let Some(c) = self.idle_conn() {
            return Ok(c);
        }
        AsyncConn::connect(&self.socket).await
    }

    /// The most recently used idle connection, if any.
    pub(crate) fn idle_conn(&self) -> Option<AsyncConn> {
        self.idle.lock().ok().and_then(|mut v| v.take())
    }

    /// Closes the idle connections older than `age`, unless it waits in a
    /// warm pool (its refill made one for the claim's first command). Each
    /// is a descriptor of the daemon's, a budget that its sandboxes share
    /// with its clients: kept for ever, one command in each of 10,000
    /// sandboxes would hold 10,000.
    pub(crate) fn drop_idle_conns(&self, age: Duration) {
        if self.is_pooled() {
            return;
        }
        if let Ok(mut v) = self.idle.lock() {
            v.expire(age, Instant::now());
        }
    }

    /// Gives a connection back when nothing unread is left on it.
    pub(crate) fn reuse(&self, conn: AsyncConn) {
        if conn.is_clean() {
            if let Ok(mut v) = self.idle.lock() {
                v.put(conn, Instant::now());
            }
        }
    }

    /// Drops the idle connections: its agent closed them (a checkpoint).
    pub(crate) fn drop_conns(&self) {
        if let Ok(mut v) = self.idle.lock() {
            v.clear();
        }
    }

    /// A new connection of its own (for a stream that outlives the call).
    pub(crate) async fn fresh_conn(&self) -> std::result::Result<AsyncConn, AgentError> {
        AsyncConn::connect(&self.socket).await
    }

    /// What its agent runs, or None when it did not answer within `limit`.
    /// Asked for the daemon itself (the idle sweep, a metrics scrape), not
    /// for a client: an idle connection is borrowed and put back as old as
    /// it was, so that such asking keeps none from expiring; a connection
    /// made for it is closed after.
    pub(crate) async fn processes(&self, limit: Duration) -> Option<Vec<hutch_agent::proto::ProcessInfo>> {
        let borrowed = self.idle.lock().ok().and_then(|mut v| v.take_aged());
        let (mut conn, at) = match borrowed {
            Some((c, at)) => (c, Some(at)),
            None => (self.fresh_conn().await.ok()?, None),
        };
        let asked = tokio::time::timeout(limit, conn.call(hutch_agent::proto::Request::List, &[])).await;
        // A call cut short leaves its reply unread: that connection is not
        // given back.
        let answered = asked.is_ok();
        let processes = match asked {
            Ok(Ok((hutch_agent::proto::Reply::Processes { processes }, _))) => Some(processes),
            _ => None,
        };
        if let (Some(at), true) = (at, answered) {
            if conn.is_clean() {
                if let Ok(mut v) = self.idle.lock() {
                    v.put(conn, at);
                }
            }
        }
        processes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_connections_are_bounded_newest_first_and_expire_unless_touched() {
        let t0 = Instant::now();
        let mut idle = IdleConns::new();
        for c in 0..IDLE_CONNS + 2 {
            idle.put(c, t0);
        }
        assert_eq!(idle.conns.len(), IDLE_CONNS, "at most IDLE_CONNS are kept");
        assert_eq!(idle.take(), Some(IDLE_CONNS - 1), "the newest first");
        idle.put(9, t0 + Duration::from_secs(20));
        // 30 s after t0: those put back then go, the one of t0 + 20 s stays.
        idle.expire(IDLE_CONN_AGE, t0 + IDLE_CONN_AGE);
        assert_eq!(idle.conns.iter().map(|(c, _)| *c).collect::<Vec<_>>(), [9]);
        // Touched (a claim): counted from then.
        idle.touch(t0 + Duration::from_secs(60));
        idle.expire(IDLE_CONN_AGE, t0 + Duration::from_secs(80));
        assert_eq!(idle.take(), Some(9));
        // Borrowed and put back as old as it was (the daemon's own asking):
        // it expires when it would have.
        idle.put(5, t0);
        let (c, at) = idle.take_aged().expect("the one put back");
        assert_eq!((c, at), (5, t0));
        idle.put(c, at);
        idle.expire(IDLE_CONN_AGE, t0 + IDLE_CONN_AGE);
        assert_eq!(idle.take(), None);
        idle.put(1, t0);
        idle.clear();
        assert_eq!(idle.take(), None);
    }

    #[test]
    fn every_transition_leaves_states_it_does_not_enter() {
        for t in [
            Transition::Ready,
            Transition::Suspend,
            Transition::Resume,
            Transition::Terminate,
            Transition::Finish,
            Transition::FailStart,
        ] {
            assert!(!t.from().contains(&t.to()), "{t:?}");
            assert!(!t.from().contains(&SandboxState::Terminated), "{t:?}: terminated is final");
        }
    }
}
