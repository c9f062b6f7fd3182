//! Events: every transition and notable outcome of what a key owns, in one
//! increasing sequence (one for every daemon sharing the store), stored
//! with the owner, read back by `GET /v1/events`, followed live by
//! `GET /v1/events/stream` and handed to the owner's webhooks (`webhooks`).
//!
//! The request path never waits on the database: [`Control::emit`] puts
//! the event on a bounded queue and returns. One writer task appends what
//! it finds there in batches, one transaction each, which gives the events
//! their ids (the store's: they commit in their order, whichever daemon
//! appends, `Store::append_events`) and makes their webhook deliveries.
//! The stored body has no id of its own (0): the row's id is put in when
//! it is read ([`view`], [`with_id`]). Only once written are events
//! published to live streams, by the [`Tail`]: in id order, each once,
//! this daemon's and (in a fleet, looked for every
//! [`Settings::follow_others`]) other daemons', so a stream that replays
//! from the store and then follows the broadcast misses nothing. A full
//! queue drops the event, counted (`hutch_events_dropped_total`) and
//! logged. A crash loses what was queued and not yet written (at most
//! about [`FLUSH_EVERY`] of events).
//!
//! Sandbox transitions are emitted in one place, [`Control::transition`]
//! (after the store's conditional update succeeded); the rest where their
//! outcome is recorded (a create's insert, an extension, a snapshot, a
//! build's end, a revocation, a quota refusal) and by the reconciler (a
//! coming expiry, OOM kills counted by the sandbox's cgroup).

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::Caller;
use crate::lifecycle::{Reason, Transition};
use hutch_api::{Event, EventList};
use hutch_store::{EventQuery, EventRecord, SandboxRecord, Store};
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};

/// Events waiting for the writer at most.
const QUEUE: usize = 8192;
/// Events appended in one transaction at most.
const BATCH: usize = 512;
/// How long the writer gathers a batch after its first event.
pub const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// Events kept for live streams that fall behind; one further behind
/// replays from the store.
const LIVE_BUFFER: usize = 1024;
/// Default retention of events.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);
/// Default notice of a coming expiry.
pub const DEFAULT_EXPIRING_NOTICE: Duration = Duration::from_secs(60);
/// Most events one read returns.
const PAGE_MAX: u32 = 1000;
/// Events one replay reads from the store at a time.
const REPLAY_PAGE: u32 = 256;
/// How often a daemon sharing its store looks for the events other
/// daemons appended (what their live streams wait at most for them).
pub const FOLLOW_OTHERS: Duration = Duration::from_millis(250);
/// Events the tail reads from the store at a time.
const TAIL_PAGE: u32 = 512;

/// Every event type: one list, the only names a filter or a webhook may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    SandboxCreated,
    SandboxReady,
    SandboxExpiring,
    SandboxExtended,
    SandboxSuspended,
    SandboxPaused,
    SandboxResumed,
    SandboxExpired,
    SandboxDeleted,
    SandboxFailed,
    SandboxOom,
    SandboxSnapshotCreated,
    SandboxForked,
    TemplateBuildStarted,
    TemplateBuildSucceeded,
    TemplateBuildFailed,
    KeyRevoked,
    QuotaExceeded,
}

impl Kind {
    pub const ALL: [Kind; 18] = [
        Kind::SandboxCreated,
        Kind::SandboxReady,
        Kind::SandboxExpiring,
        Kind::SandboxExtended,
        Kind::SandboxSuspended,
        Kind::SandboxPaused,
        Kind::SandboxResumed,
        Kind::SandboxExpired,
        Kind::SandboxDeleted,
        Kind::SandboxFailed,
        Kind::SandboxOom,
        Kind::SandboxSnapshotCreated,
        Kind::SandboxForked,
        Kind::TemplateBuildStarted,
        Kind::TemplateBuildSucceeded,
        Kind::TemplateBuildFailed,
        Kind::KeyRevoked,
        Kind::QuotaExceeded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::SandboxCreated => "sandbox.created",
            Kind::SandboxReady => "sandbox.ready",
            Kind::SandboxExpiring => "sandbox.expiring",
            Kind::SandboxExtended => "sandbox.extended",
            Kind::SandboxSuspended => "sandbox.suspended",
            Kind::SandboxPaused => "sandbox.paused",
            Kind::SandboxResumed => "sandbox.resumed",
            Kind::SandboxExpired => "sandbox.expired",
            Kind::SandboxDeleted => "sandbox.deleted",
            Kind::SandboxFailed => "sandbox.failed",
            Kind::SandboxOom => "sandbox.oom",
            Kind::SandboxSnapshotCreated => "sandbox.snapshot.created",
            Kind::SandboxForked => "sandbox.forked",
            Kind::TemplateBuildStarted => "template.build.started",
            Kind::TemplateBuildSucceeded => "template.build.succeeded",
            Kind::TemplateBuildFailed => "template.build.failed",
            Kind::KeyRevoked => "key.revoked",
            Kind::QuotaExceeded => "quota.exceeded",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The event a sandbox's transition is, if any: `record` is the sandbox
    /// as the transition left it (its `last_error_code` says why it ended).
    fn of_transition(t: Transition, record: &SandboxRecord) -> Option<Kind> {
        let code = record.last_error_code.as_deref();
        let quiet = [None, Some(Reason::DeletedWhileStarting.as_str()), Some(Reason::KeyRevoked.as_str())];
        match t {
            Transition::Ready => Some(Kind::SandboxReady),
            Transition::Suspend => Some(Kind::SandboxSuspended),
            Transition::Resume | Transition::Wake => Some(Kind::SandboxResumed),
            Transition::Pause => Some(Kind::SandboxPaused),
            Transition::Terminate if code == Some(Reason::Expired.as_str()) => Some(Kind::SandboxExpired),
            // A delete (or a revocation of its key).
            Transition::Terminate if quiet.contains(&code) => Some(Kind::SandboxDeleted),
            Transition::Terminate => Some(Kind::SandboxFailed),
            // Its end was the event (the Terminate before).
            Transition::Finish => None,
            // A start cut short by a delete: the delete was the event.
            Transition::FailStart if quiet.contains(&code) => None,
            Transition::FailStart => Some(Kind::SandboxFailed),
            // Its node was declared lost: it failed, with `node_lost`.
            Transition::Lose => Some(Kind::SandboxFailed),
        }
    }
}

/// Parses a comma-separated list of event types (a query's `type`), each
/// one of [`Kind::ALL`]. Pure: fuzzed.
pub fn parse_kinds(list: &str) -> std::result::Result<Vec<Kind>, String> {
    let mut out = Vec::new();
    for t in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let k = Kind::parse(t).ok_or_else(|| format!("unknown event type {:?}", truncate(t)))?;
        if !out.contains(&k) {
            out.push(k);
        }
    }
    Ok(out)
}

fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

/// What the operator set.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Off: nothing is emitted (for measuring the event path's cost).
    pub enabled: bool,
    /// How long before a sandbox's expiry `sandbox.expiring` is emitted.
    pub expiring_notice: Duration,
    /// Where webhooks may deliver and how many a key may have.
    pub webhooks: crate::webhooks::Policy,
    /// How often the events other daemons sharing the store appended are
    /// looked for, to publish them to this daemon's live streams. None:
    /// this daemon is the store's only writer (SQLite).
    pub follow_others: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            enabled: true,
            expiring_notice: DEFAULT_EXPIRING_NOTICE,
            webhooks: crate::webhooks::Policy::default(),
            follow_others: None,
        }
    }
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

/// Publishes stored events to this daemon's live streams: in id order,
/// each once, what this daemon appended and what other daemons sharing the
/// store did. Correct because ids commit in their order
/// (`Store::append_events`): after the last id published, the store never
/// gains a lower one.
struct Tail {
    store: Arc<dyn Store>,
    live: broadcast::Sender<Arc<EventRecord>>,
    /// The last id published.
    last: tokio::sync::Mutex<i64>,
    /// The same, read without waiting (where a stream "from now" starts).
    published: Arc<AtomicI64>,
}

impl Tail {
    /// This daemon appended `rows` (ids increasing). Those right after the
    /// last id published are published as they are; a gap (another
    /// daemon's events, or an append that failed) is read from the store.
    async fn appended(&self, rows: &[EventRecord]) {
        let mut last = self.last.lock().await;
        let fresh: Vec<&EventRecord> = rows.iter().filter(|r| r.id > *last).collect();
        let follows = fresh.iter().zip(1..).all(|(r, i)| r.id == *last + i);
        if !follows {
            return self.catch_up(&mut last).await;
        }
        for r in fresh {
            // No live stream: nobody to tell.
            let _ = self.live.send(Arc::new(r.clone()));
            *last = r.id;
        }
        self.published.store(*last, Ordering::SeqCst);
    }

    /// Publishes what the store has after the last id published.
    async fn follow(&self) {
        let mut last = self.last.lock().await;
        self.catch_up(&mut last).await;
    }

    async fn catch_up(&self, last: &mut i64) {
        loop {
            let q = EventQuery { after: Some(*last), limit: TAIL_PAGE, ..EventQuery::default() };
            let store = self.store.clone();
            let page = match tokio::task::spawn_blocking(move || store.list_events(&q)).await {
                Ok(Ok(page)) => page,
                Ok(Err(e)) => return tracing::warn!("events: cannot read what was appended: {e}"),
                Err(e) => return tracing::warn!("events: cannot read what was appended: {e}"),
            };
            for r in &page {
                let _ = self.live.send(Arc::new(r.clone()));
                *last = r.id;
            }
            self.published.store(*last, Ordering::SeqCst);
            if page.len() < TAIL_PAGE as usize {
                return;
            }
        }
    }
}

/// The queue to the writer, the live broadcast.
pub(crate) struct Events {
    pub(crate) settings: Settings,
    tx: mpsc::Sender<EventRecord>,
    rx: Mutex<Option<mpsc::Receiver<EventRecord>>>,
    /// Events written, as they were, for live streams.
    live: broadcast::Sender<Arc<EventRecord>>,
    /// The last id published to live streams.
    written: Arc<AtomicI64>,
    counters: Arc<Counters>,
    stop: Arc<tokio::sync::Notify>,
    writer: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Looks for other daemons' events (`Settings::follow_others`).
    follower: Mutex<Option<tokio::task::JoinHandle<()>>>,
    started: AtomicBool,
    /// Sandboxes told of their coming expiry, with the expiry told of (an
    /// extension makes a new notice due).
    expiring: Mutex<HashMap<String, i64>>,
    /// Wakes the webhook worker when deliveries were made.
    pub(crate) deliveries: Arc<tokio::sync::Notify>,
    /// The host's OOM kills at the reconciler's last look (`u64::MAX`:
    /// none yet).
    host_oom_kills: AtomicU64,
}

impl Events {
    pub(crate) fn new(settings: Settings) -> Events {
        let (tx, rx) = mpsc::channel(QUEUE);
        let (live, _) = broadcast::channel(LIVE_BUFFER);
        Events {
            settings,
            tx,
            rx: Mutex::new(Some(rx)),
            live,
            written: Arc::default(),
            counters: Arc::default(),
            stop: Arc::default(),
            writer: Mutex::new(None),
            follower: Mutex::new(None),
            started: AtomicBool::new(false),
            expiring: Mutex::new(HashMap::new()),
            deliveries: Arc::default(),
            host_oom_kills: AtomicU64::new(u64::MAX),
        }
    }

    /// Whether the host's OOM killer ran since the last call (true when
    /// that cannot be told): only then may a sandbox's counter have moved.
    /// With thousands of sandboxes, reading each one's counter on every
    /// pass was most of an idle daemon's time.
    pub(crate) fn host_oom_news(&self) -> bool {
        match hutch_runtime::cgroup::host_oom_kills() {
            Some(now) => self.host_oom_kills.swap(now, Ordering::SeqCst) != now,
            None => true,
        }
    }

    /// Queues an event for the writer (which gets its id from the store);
    /// never waits (a full queue drops it, counted and logged).
    pub(crate) fn push(
        &self,
        owner: &str,
        kind: Kind,
        sandbox: Option<&str>,
        details: serde_json::Map<String, serde_json::Value>,
    ) {
        let at = now_ms();
        // The id is the store's, given when appended: the body has none (0).
        let ev = Event {
            id: 0,
            kind: kind.as_str().to_owned(),
            sandbox_id: sandbox.map(str::to_owned),
            at: rfc3339(at),
            owner: owner.to_owned(),
            details,
        };
        let row = EventRecord {
            id: 0,
            at,
            body: serde_json::to_string(&ev).unwrap_or_default(),
            owner: ev.owner,
            kind: ev.kind,
            sandbox_id: ev.sandbox_id,
        };
        match self.tx.try_send(row) {
            Ok(()) => {}
            Err(e) => {
                let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    let why = match e {
                        mpsc::error::TrySendError::Full(_) => "its queue is full",
                        mpsc::error::TrySendError::Closed(_) => "its writer stopped",
                    };
                    tracing::warn!("events: an event was dropped because {why} ({n} dropped so far)");
                }
            }
        }
    }

    /// Starts the writer, and live streams after the stored events' `last`
    /// id.
    pub(crate) fn start_writer(&self, store: Arc<dyn Store>, last: i64) {
        self.written.store(last, Ordering::SeqCst);
        let Some(rx) = self.rx.lock().ok().and_then(|mut r| r.take()) else { return };
        let tail = Arc::new(Tail {
            store: store.clone(),
            live: self.live.clone(),
            last: tokio::sync::Mutex::new(last),
            published: self.written.clone(),
        });
        if let Some(every) = self.settings.follow_others {
            let tail = tail.clone();
            let follower = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    tail.follow().await;
                }
            });
            if let Ok(mut f) = self.follower.lock() {
                *f = Some(follower);
            }
        }
        let handle = tokio::spawn(write_loop(
            store,
            rx,
            tail,
            self.counters.clone(),
            self.stop.clone(),
            self.deliveries.clone(),
        ));
        if let Ok(mut w) = self.writer.lock() {
            *w = Some(handle);
        }
    }

    /// Writes what is queued and stops the writer.
    pub(crate) async fn finish(&self) {
        if let Some(f) = self.follower.lock().ok().and_then(|mut f| f.take()) {
            f.abort();
        }
        self.stop.notify_one();
        let handle = self.writer.lock().ok().and_then(|mut w| w.take());
        if let Some(h) = handle {
            let _ = h.await;
        }
    }

    /// The counters in the Prometheus text format.
    pub(crate) fn render(&self, out: &mut String) {
        let c = &self.counters;
        for (name, help, v) in [
            ("hutch_events_written_total", "Events appended to the store.", &c.written),
            ("hutch_events_dropped_total", "Events dropped because the writer's queue was full.", &c.dropped),
            ("hutch_events_failed_total", "Events lost to a failed store write.", &c.failed),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
    }
}

/// Appends batches until `stop`, then what is left in the queue; each
/// batch's events go to the tail once written.
async fn write_loop(
    store: Arc<dyn Store>,
    rx: mpsc::Receiver<EventRecord>,
    tail: Arc<Tail>,
    counters: Arc<Counters>,
    stop: Arc<tokio::sync::Notify>,
    deliveries: Arc<tokio::sync::Notify>,
) {
    crate::batch::write_batches(rx, BATCH, FLUSH_EVERY, stop, |mut batch| {
        let (store, tail, counters, deliveries) = (store.clone(), tail.clone(), counters.clone(), deliveries.clone());
        async move {
            let n = batch.len() as u64;
            let outcome = match tokio::task::spawn_blocking(move || {
                let made = store.append_events(&mut batch);
                made.map(|made| (made, batch))
            })
            .await
            {
                Ok(Ok(done)) => Ok(done),
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match outcome {
                Ok((made, rows)) => {
                    counters.written.fetch_add(n, Ordering::Relaxed);
                    tail.appended(&rows).await;
                    if made > 0 {
                        deliveries.notify_one();
                    }
                }
                Err(e) => {
                    tracing::error!("events: {n} events not written: {e}");
                    counters.failed.fetch_add(n, Ordering::Relaxed);
                }
            }
        }
    })
    .await;
}

/// The API view of a stored event: its body, with the id the store gave
/// it (a body stored before ids were the store's has the same one).
pub(crate) fn view(r: &EventRecord) -> Event {
    let mut ev = serde_json::from_str(&r.body).unwrap_or_else(|_| Event {
        id: 0,
        kind: r.kind.clone(),
        sandbox_id: r.sandbox_id.clone(),
        at: rfc3339(r.at),
        owner: r.owner.clone(),
        details: serde_json::Map::new(),
    });
    ev.id = r.id as u64;
    ev
}

/// A stored event body (a webhook delivery's payload) with the event's id,
/// as it is sent; a body that is not an event is sent as it is.
pub(crate) fn with_id(body: &str, id: i64) -> String {
    match serde_json::from_str::<Event>(body) {
        Ok(mut ev) => {
            ev.id = id as u64;
            serde_json::to_string(&ev).unwrap_or_else(|_| body.to_owned())
        }
        Err(_) => body.to_owned(),
    }
}

/// What `GET /v1/events` and the stream ask for.
#[derive(Debug, Clone, Default)]
pub struct Filter<'a> {
    /// Comma-separated event types.
    pub kinds: Option<&'a str>,
    pub sandbox: Option<&'a str>,
    /// RFC 3339 bounds, inclusive.
    pub from: Option<&'a str>,
    pub to: Option<&'a str>,
    pub cursor: Option<&'a str>,
    pub limit: Option<u32>,
    /// The admin's: only this key's events.
    pub owner: Option<&'a str>,
}

/// What a stream follows, checked.
#[derive(Debug, Clone)]
pub struct StreamFilter {
    query: EventQuery,
}

impl StreamFilter {
    fn matches(&self, e: &EventRecord) -> bool {
        let q = &self.query;
        q.owner.as_ref().is_none_or(|o| *o == e.owner)
            && q.sandbox_id.as_ref().is_none_or(|s| e.sandbox_id.as_ref() == Some(s))
            && (q.kinds.is_empty() || q.kinds.contains(&e.kind))
    }
}

fn decode_cursor(c: &str) -> Result<i64> {
    c.trim().parse::<i64>().ok().filter(|v| *v >= 0).ok_or_else(|| ControlError::Invalid("invalid cursor".into()))
}

impl Control {
    /// Starts live streams after the stored events, and the writer and
    /// the webhook worker (once; later calls do nothing). Call
    /// before anything can emit (before `recover`).
    pub async fn start_events(self: &Arc<Self>) -> Result<()> {
        if self.events.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let last = self.db(|s| s.last_event_id()).await?;
        self.events.start_writer(self.store.clone(), last);
        // Deliveries this node claimed before it stopped were cut short:
        // sent again now, not when their claims run out.
        let node = self.node.name.clone();
        let freed = self.db(move |s| s.release_deliveries(&node)).await?;
        if freed > 0 {
            tracing::info!("{freed} webhook deliveries were being sent when the daemon stopped; sending them again");
        }
        let this = self.clone();
        tokio::spawn(async move { this.deliver_loop().await });
        Ok(())
    }

    /// Writes what is queued and stops the writer (the daemon is stopping).
    pub async fn finish_events(&self) {
        self.events.finish().await;
    }

    /// Emits one event of `owner`'s; never waits.
    pub(crate) fn emit(
        &self,
        owner: &str,
        kind: Kind,
        sandbox: Option<&str>,
        details: serde_json::Map<String, serde_json::Value>,
    ) {
        if !self.events.settings.enabled {
            return;
        }
        self.events.push(owner, kind, sandbox, details);
    }

    /// A sandbox's transition happened (`record` as it left it): its event.
    pub(crate) fn emit_transition(&self, t: Transition, record: &SandboxRecord) {
        // An unclaimed warm sandbox is nobody's yet.
        if record.pooled {
            return;
        }
        let Some(kind) = Kind::of_transition(t, record) else { return };
        let mut d = serde_json::Map::new();
        d.insert("state".into(), record.state.as_str().into());
        if let Some(code) = &record.last_error_code {
            d.insert("code".into(), code.clone().into());
        }
        if t == Transition::Wake {
            d.insert("from".into(), "paused".into());
        }
        self.emit(&record.owner, kind, Some(&record.id), d);
    }

    /// A sandbox was made (or a warm one claimed) for its owner.
    pub(crate) fn emit_created(&self, r: &SandboxRecord) {
        let mut d = serde_json::Map::new();
        d.insert("template".into(), r.template.clone().into());
        d.insert("expires_at".into(), rfc3339(r.expires_at).into());
        d.insert("warm".into(), r.warm.into());
        self.emit(&r.owner, Kind::SandboxCreated, Some(&r.id), d);
        if r.warm {
            // A claimed warm sandbox is ready already.
            self.emit_transition(Transition::Ready, r);
        }
    }

    /// A refusal: `quota.exceeded` when it is the key's own quota.
    pub(crate) fn refused(&self, owner: &str, e: hutch_store::Exceeded) -> ControlError {
        if e.scope == hutch_store::Scope::Owner {
            let mut d = serde_json::Map::new();
            d.insert("resource".into(), e.resource.as_str().into());
            d.insert("limit".into(), e.limit.into());
            d.insert("used".into(), e.used.into());
            d.insert("asked".into(), e.asked.into());
            self.emit(owner, Kind::QuotaExceeded, None, d);
        }
        ControlError::Exceeded(e)
    }

    /// [`Control::refused`] for an error that may be a quota's refusal.
    pub(crate) fn quota_refusal(&self, owner: &str, e: ControlError) -> ControlError {
        match e {
            ControlError::Exceeded(x) => self.refused(owner, x),
            other => other,
        }
    }

    /// A build started or ended (as recorded).
    pub(crate) fn emit_build(&self, b: &hutch_store::BuildRecord, kind: Kind) {
        let mut d = serde_json::Map::new();
        d.insert("template_id".into(), b.template_id.clone().into());
        d.insert("build_id".into(), b.id.clone().into());
        if let Some(v) = b.version {
            d.insert("version".into(), v.into());
        }
        if let Some(e) = &b.error {
            d.insert("error".into(), e.clone().into());
        }
        self.emit(&b.owner, kind, None, d);
    }

    /// The reconciler's look at one sandbox that runs: a coming expiry, OOM
    /// kills since the last look (read only when `oom_news`, see
    /// [`Events::host_oom_news`]).
    pub(crate) fn watch_sandbox(&self, r: &hutch_store::SandboxBrief, now: i64, oom_news: bool) {
        if r.pooled {
            return;
        }
        let notice = self.events.settings.expiring_notice.as_millis() as i64;
        if r.expires_at > now && r.expires_at - now <= notice {
            let mut told = self.events.expiring.lock().unwrap_or_else(|p| p.into_inner());
            if told.get(&r.id) != Some(&r.expires_at) {
                told.insert(r.id.clone(), r.expires_at);
                drop(told);
                let mut d = serde_json::Map::new();
                d.insert("expires_at".into(), rfc3339(r.expires_at).into());
                d.insert("on_expire".into(), r.on_expire.as_str().into());
                self.emit(&r.owner, Kind::SandboxExpiring, Some(&r.id), d);
            }
        }
        let id = crate::ids::SandboxId::from_record(&r.id);
        if let Some(live) = self.live(&id).filter(|_| oom_news) {
            let kills = live.handle.lock().ok().and_then(|h| h.as_ref().map(|sb| sb.cgroup.oom_kills()));
            if let Some(kills) = kills {
                let before = live.oom_seen.swap(kills, Ordering::SeqCst);
                if kills > before {
                    let mut d = serde_json::Map::new();
                    d.insert("kills".into(), (kills - before).into());
                    d.insert("memory_mb".into(), r.memory_mb.into());
                    self.emit(&r.owner, Kind::SandboxOom, Some(&r.id), d);
                }
            }
        }
    }

    /// Forgets the expiry notices of sandboxes that ended.
    pub(crate) fn forget_notices(&self, live: &std::collections::HashSet<String>) {
        self.events.expiring.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| live.contains(id));
    }

    fn event_query(&self, caller: &Caller, f: &Filter<'_>) -> Result<EventQuery> {
        let owner = if caller.admin {
            f.owner.map(|k| crate::ids::OwnerId::parse(k).map(|k| k.to_string())).transpose()?
        } else {
            if f.owner.is_some_and(|o| o != caller.owner.as_str()) {
                return Err(ControlError::Forbidden("only an admin key may read another key's events".into()));
            }
            Some(caller.owner.to_string())
        };
        let time = |what: &str, v: Option<&str>| -> Result<Option<i64>> {
            v.map(|t| {
                crate::control::parse_rfc3339(t)
                    .ok_or_else(|| ControlError::Invalid(format!("{what} must be an RFC 3339 time")))
            })
            .transpose()
        };
        let kinds = match f.kinds {
            Some(k) => {
                parse_kinds(k).map_err(ControlError::Invalid)?.into_iter().map(|k| k.as_str().to_owned()).collect()
            }
            None => Vec::new(),
        };
        let sandbox_id = f.sandbox.map(|s| crate::ids::SandboxId::parse(s).map(|s| s.to_string())).transpose()?;
        Ok(EventQuery {
            owner,
            kinds,
            sandbox_id,
            from: time("from", f.from)?,
            to: time("to", f.to)?,
            after: f.cursor.map(decode_cursor).transpose()?,
            limit: 0,
        })
    }

    /// `GET /v1/events`: the caller's (an admin's: everyone's, or one key's).
    pub async fn events(&self, caller: &Caller, f: &Filter<'_>) -> Result<EventList> {
        let limit = f.limit.unwrap_or(100);
        if !(1..=PAGE_MAX).contains(&limit) {
            return Err(ControlError::Invalid(format!("limit must be 1 to {PAGE_MAX}")));
        }
        let mut q = self.event_query(caller, f)?;
        q.limit = limit + 1;
        let mut rows = self.db(move |s| s.list_events(&q)).await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let next_cursor = if more { rows.last().map(|r| r.id.to_string()) } else { None };
        Ok(EventList { events: rows.iter().map(view).collect(), next_cursor })
    }

    /// Checks a stream's filter (`from`, `to`, `cursor` and `limit` are not
    /// a stream's).
    pub fn event_stream_filter(&self, caller: &Caller, f: &Filter<'_>) -> Result<StreamFilter> {
        if f.from.is_some() || f.to.is_some() || f.limit.is_some() {
            return Err(ControlError::Invalid("a stream takes type, sandbox, owner and cursor only".into()));
        }
        Ok(StreamFilter { query: self.event_query(caller, f)? })
    }

    /// Follows the events of `filter` after `last` (None: from now) into
    /// `tx`: those in the store first, then live ones as they are written.
    /// A stream that falls behind the live buffer reads from the store
    /// again; one whose client reads too slowly waits on `tx` (bounded),
    /// never holds more. Ends when `tx` closes.
    pub async fn follow_events(&self, filter: StreamFilter, last: Option<u64>, tx: mpsc::Sender<Event>) {
        let mut rx = self.events.live.subscribe();
        let mut last = match last {
            Some(l) => l.min(i64::MAX as u64) as i64,
            None => self.events.written.load(Ordering::SeqCst),
        };
        loop {
            // Replay what the store has after `last`.
            loop {
                let mut q = filter.query.clone();
                q.after = Some(last);
                q.limit = REPLAY_PAGE;
                let page = match self.db(move |s| s.list_events(&q)).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!("event stream: {e}");
                        return;
                    }
                };
                let full = page.len() == REPLAY_PAGE as usize;
                for r in &page {
                    if tx.send(view(r)).await.is_err() {
                        return;
                    }
                    last = r.id;
                }
                if !full {
                    break;
                }
            }
            // Then live.
            loop {
                // A client gone is noticed while nothing happens too.
                let got = tokio::select! {
                    got = rx.recv() => got,
                    () = tx.closed() => return,
                };
                match got {
                    Ok(r) => {
                        if r.id <= last {
                            continue;
                        }
                        if filter.matches(&r) && tx.send(view(&r)).await.is_err() {
                            return;
                        }
                        // Not the stream's: skipped, as a replay would.
                        if r.id > last {
                            last = r.id;
                        }
                    }
                    // Fell behind: the store has what was missed.
                    Err(broadcast::error::RecvError::Lagged(_)) => break,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    }

    /// Deletes events older than `retention` (and deliveries made before
    /// then that are no longer pending); how many events.
    pub async fn prune_events(&self, retention: Duration) -> Result<u64> {
        let before = crate::control::cutoff(retention);
        self.db(move |s| s.prune_events(before)).await
    }

    /// The event path's counters, for `/metrics`.
    pub(crate) fn render_events(&self, out: &mut String) {
        self.events.render(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `emit` costs the request that emits (a measurement, not a
    /// check: `cargo test -p hutch-control --lib emit_cost -- --ignored
    /// --nocapture`), with the writer appending to an in-memory store
    /// meanwhile, as the daemon's does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement, printed; run by hand (bench/README.md)"]
    async fn emit_cost() {
        let store: Arc<dyn Store> = Arc::new(hutch_store::SqliteStore::open_in_memory().expect("open"));
        let e = Events::new(Settings::default());
        e.start_writer(store.clone(), 0);
        let mut times = Vec::new();
        for i in 0..20_000u32 {
            let t = std::time::Instant::now();
            let mut d = serde_json::Map::new();
            d.insert("template".into(), "base".into());
            d.insert("expires_at".into(), rfc3339(now_ms()).into());
            d.insert("warm".into(), false.into());
            e.push("key-000000000001", Kind::SandboxCreated, Some("sb-0123456789abcdef"), d);
            times.push(t.elapsed());
            // Paced as busy traffic: the writer keeps up, nothing is dropped.
            if i % 200 == 199 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        e.finish().await;
        times.sort();
        let (med, p99) = (times[times.len() / 2], times[times.len() * 99 / 100]);
        println!(
            "emit: median {:.1} us, p99 {:.1} us over {} events; written {}, dropped {}",
            med.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            times.len(),
            e.counters.written.load(Ordering::Relaxed),
            e.counters.dropped.load(Ordering::Relaxed)
        );
        assert_eq!(store.last_event_id().expect("last"), 20_000);
    }

    /// Two daemons on one store (as a fleet on one PostgreSQL): the live
    /// streams of one get every event of both, once each, in id order,
    /// whether its own appends follow what it published (published as
    /// they are) or jump over the other's (read from the store), and the
    /// other's events also when it appends nothing (the follower).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_streams_get_every_daemons_events_once_in_id_order() {
        let store: Arc<dyn Store> = Arc::new(hutch_store::SqliteStore::open_in_memory().expect("open"));
        let fleet = Settings { follow_others: Some(Duration::from_millis(10)), ..Settings::default() };
        let (a, b) = (Events::new(fleet.clone()), Events::new(fleet));
        a.start_writer(store.clone(), 0);
        b.start_writer(store.clone(), 0);
        let mut live = a.live.subscribe();
        let written = |n: i64| {
            let store = store.clone();
            async move {
                while store.last_event_id().expect("last") < n {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        let push = |e: &Events| e.push("key-000000000001", Kind::SandboxCreated, None, serde_json::Map::new());
        let mut n = 0;
        for _ in 0..10 {
            // b's events are stored before a's next ones: a's ids jump.
            push(&b);
            push(&b);
            n += 2;
            written(n).await;
            push(&a);
            n += 1;
            written(n).await;
        }
        // Only b's: a's streams get them through its follower.
        for _ in 0..5 {
            push(&b);
        }
        n += 5;
        let mut got = Vec::new();
        while got.len() < n as usize {
            let r = tokio::time::timeout(Duration::from_secs(10), live.recv())
                .await
                .expect("every event reaches a's live streams")
                .expect("live");
            got.push(r.id);
        }
        assert_eq!(got, (1..=n).collect::<Vec<_>>());
        // The last id published is set once a page is sent, so the stream
        // may see the last event a moment before it (a loaded host did).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while a.written.load(Ordering::SeqCst) < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(a.written.load(Ordering::SeqCst), n);
        a.finish().await;
        b.finish().await;
        assert!(live.try_recv().is_err(), "nothing twice");
    }

    #[test]
    fn a_stored_body_gets_its_rows_id() {
        let ev = Event {
            id: 0,
            kind: "sandbox.created".into(),
            sandbox_id: Some("sb-1".into()),
            at: rfc3339(1),
            owner: "key-1".into(),
            details: serde_json::Map::new(),
        };
        let body = serde_json::to_string(&ev).expect("json");
        let r = EventRecord { id: 42, at: 1, owner: ev.owner.clone(), kind: ev.kind.clone(), sandbox_id: None, body };
        assert_eq!(view(&r).id, 42);
        let sent: serde_json::Value = serde_json::from_str(&with_id(&r.body, 42)).expect("json");
        assert_eq!(sent["id"], 42);
        assert_eq!(with_id("not json", 42), "not json");
    }

    #[test]
    fn kinds_parse_as_they_print() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.as_str()), Some(k));
        }
        assert_eq!(parse_kinds("sandbox.ready, sandbox.ready,key.revoked").expect("ok").len(), 2);
        assert!(parse_kinds("sandbox.nope").is_err());
        assert!(parse_kinds("").expect("empty").is_empty());
    }
}
