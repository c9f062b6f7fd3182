//! hutch's durable state behind the [`Store`] trait, with two
//! implementations: embedded SQLite ([`SqliteStore`], the default, one
//! file in the state directory) and PostgreSQL ([`PgStore`], for daemons
//! that share one database). The only crate of hutch that knows SQL.
//!
//! Records are plain values (strings, integers, Unix milliseconds, the API's
//! state enums), the same whatever the backend. Migrations live in
//! `migrations/` (SQLite) and `migrations/postgres/`, and run in order at
//! open.
//!
//! Sandbox records are never written back whole. A state changes only by
//! [`Store::transition`], an update conditional on the state it leaves
//! (`UPDATE ... WHERE state IN (...)`), so two writers (two tasks, or two
//! daemons sharing a PostgreSQL database) cannot both win one transition
//! and a change made meanwhile (an extension during a boot) is never lost;
//! other fields change by targeted updates ([`Store::set_expiry`],
//! [`Store::set_network`]). How each backend keeps admissions (checks of
//! what is held, then an insert) right under concurrency is said in its
//! module: SQLite has one writer at a time; PostgreSQL takes advisory
//! locks.

mod pg;
mod sqlite;
mod sqlite_events;
mod usage;

pub use hutch_api::{BuildState, Class, OnExpire, OnIdle, SandboxState, StorageKind};
pub use pg::{PgStore, DEFAULT_POOL_SIZE};
pub use sqlite::SqliteStore;
pub use usage::{split_days, Aggregate, UsageCount, UsageGroup, UsageInterval, UsageKind, UsageQuery, UsageRow};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("database error: {}", pg_message(.0))]
    Postgres(#[from] ::postgres::Error),
    #[error("no free database connection (all {0} in use)")]
    PoolExhausted(usize),
    #[error("a row with this key already exists")]
    Conflict,
    #[error("database lock poisoned")]
    Poisoned,
    #[error("unreadable {what} in row {id}: {value:?}")]
    Corrupt { what: &'static str, id: String, value: String },
    #[error("start a thread of the store: {0}")]
    Thread(std::io::Error),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A PostgreSQL error with the server's own words (its `Display` alone
/// says only "db error").
fn pg_message(e: &::postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {} (SQLSTATE {})", db.severity(), db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// Per-key caps; `None` is no cap of the key's own (the host's still apply).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quotas {
    /// Sandboxes that are not terminated (warm ones of its templates included).
    pub sandboxes: Option<u64>,
    pub memory_mb: Option<u64>,
    pub disk_mib: Option<u64>,
    /// Longest lifetime a create or an extension may give, in seconds.
    pub ttl_seconds: Option<u64>,
    /// Template builds queued or running at once.
    pub builds: Option<u64>,
    /// Snapshots kept.
    pub snapshots: Option<u64>,
}

/// An API key; `hash` is the SHA-256 (hex) of its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    pub hash: String,
    pub admin: bool,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
    pub quotas: Quotas,
}

/// What the daemon's periodic passes read of each of its sandboxes (the
/// reconciler every 0.5 s, the metric sample every 5 s): ten fields of a
/// [`SandboxRecord`]'s thirty-one. With thousands alive, reading whole
/// records was the largest part of an idle daemon's work.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxBrief {
    pub id: String,
    pub owner: String,
    pub state: SandboxState,
    pub created_at: i64,
    pub expires_at: i64,
    pub memory_mb: u64,
    pub vcpus: f64,
    pub disk_mib: u64,
    pub pooled: bool,
    pub on_expire: OnExpire,
}

/// A sandbox as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: String,
    /// Id of the API key that created it.
    pub owner: String,
    pub template: String,
    pub state: SandboxState,
    pub created_at: i64,
    pub expires_at: i64,
    /// The latest expiry an extension may reach.
    pub max_expires_at: i64,
    pub memory_mb: u64,
    pub vcpus: f64,
    pub disk_mib: u64,
    pub pids: u32,
    /// JSON object.
    pub env: String,
    /// JSON object.
    pub metadata: String,
    pub limits_applied: String,
    pub last_error_code: Option<String>,
    pub host_pid: Option<i64>,
    pub idempotency_key: Option<String>,
    pub request_hash: Option<String>,
    /// The template it runs (None for the builtin `base`) and its version.
    pub template_id: Option<String>,
    pub template_version: Option<i64>,
    /// Started by a warm pool (stays true once claimed).
    pub warm: bool,
    /// In a warm pool, unclaimed: hidden from its owner's reads.
    pub pooled: bool,
    /// JSON: the network policy, what was observed, and host addressing.
    pub network: String,
    /// Where its files live.
    pub storage: StorageKind,
    /// The snapshot it started from (its files' origin), if any.
    pub origin: Option<String>,
    /// What happens at its expiry.
    pub on_expire: OnExpire,
    /// The lifetime it was given (seconds), if known: what a resume of a
    /// sandbox paused at its expiry gives it again.
    pub ttl_s: Option<u64>,
    /// How long it is kept once paused at its expiry (seconds).
    pub paused_ttl_s: Option<u64>,
    /// How it is isolated.
    pub class: Class,
    /// The node (daemon) it lives on: the only one that acts on it.
    pub node: String,
    /// Why it is in its state, in words, when more is known than
    /// `last_error_code` (a node's loss).
    pub reason: Option<String>,
}

/// Where a node of the fleet is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    Active,
    /// Takes no new sandboxes.
    Draining,
    /// Declared gone (it stopped heartbeating).
    Lost,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<NodeState> {
        [NodeState::Active, NodeState::Draining, NodeState::Lost].into_iter().find(|n| n.as_str() == s)
    }
}

/// A node (one `hutch serve`) of the daemons sharing the database. Times
/// are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    pub name: String,
    /// The URL other nodes and clients reach its API at.
    pub advertise: String,
    /// Its capacity: memory and disk (MiB) and sandboxes it may hold.
    pub memory_mib: u64,
    pub disk_mib: u64,
    pub sandboxes: u64,
    /// The isolation classes it can run.
    pub classes: Vec<String>,
    pub state: NodeState,
    pub started_at: i64,
    pub heartbeat_at: i64,
}

/// What declaring a node lost does ([`Store::mark_node_lost`]).
#[derive(Debug, Clone, Copy)]
pub struct NodeLoss<'a> {
    pub name: &'a str,
    /// Only if its last heartbeat is older than this (Unix ms).
    pub silent_before: i64,
    /// The states of its sandboxes that become `lost`.
    pub from: &'a [SandboxState],
    /// Their `last_error_code`.
    pub code: &'a str,
    pub reason: &'a str,
    /// The note its paused sandboxes get.
    pub paused_reason: &'a str,
}

/// A snapshot as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub id: String,
    pub owner: String,
    /// Unique among the owner's snapshots.
    pub name: Option<String>,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    pub created_at: i64,
    pub size_bytes: u64,
    /// JSON: what a sandbox started from it runs.
    pub recipe: String,
}

/// A volume as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    pub id: String,
    pub owner: String,
    /// Unique among the owner's volumes.
    pub name: String,
    pub size_mib: u64,
    pub created_at: i64,
    /// The node whose disk holds its files.
    pub node: String,
}

/// A sandbox's mount of a volume. It holds while the sandbox is in any
/// state but terminated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeClaim {
    pub volume_id: String,
    pub sandbox_id: String,
    pub path: String,
    pub read_only: bool,
}

/// What [`Store::delete_volume`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeDeleted {
    Deleted,
    NotFound,
    /// A sandbox that has not ended holds it; nothing was deleted.
    InUse(String),
}

/// One audited API call. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// Its place in the log (0 in a row not yet appended).
    pub seq: i64,
    pub at: i64,
    pub key_id: String,
    /// Read from the key's record when appended ("" for an unknown key).
    pub key_name: String,
    pub method: String,
    /// The route's template (`/v1/sandboxes/{id}/exec`).
    pub route: String,
    /// JSON object: the route's path parameters.
    pub targets: String,
    /// The client's address.
    pub client: String,
    pub status: u16,
    pub error_code: Option<String>,
}

/// Which audit rows a read wants: newest first, below `before` (a `seq`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditQuery {
    pub key: Option<String>,
    /// `at` bounds, inclusive.
    pub from: Option<i64>,
    pub to: Option<i64>,
    pub before: Option<i64>,
    pub limit: u32,
}

/// One event as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRecord {
    /// Given by the store when appended: one increasing sequence for every
    /// daemon sharing it.
    pub id: i64,
    pub at: i64,
    pub owner: String,
    pub kind: String,
    pub sandbox_id: Option<String>,
    /// The event as the API shows it (JSON object).
    pub body: String,
}

/// Which events a read wants: oldest first, after `after` (an id).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventQuery {
    /// None: every owner's (the admin's view).
    pub owner: Option<String>,
    pub kinds: Vec<String>,
    pub sandbox_id: Option<String>,
    /// `at` bounds, inclusive.
    pub from: Option<i64>,
    pub to: Option<i64>,
    pub after: Option<i64>,
    pub limit: u32,
}

/// A webhook as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookRecord {
    pub id: String,
    pub owner: String,
    pub url: String,
    /// Event types, or `*`.
    pub events: Vec<String>,
    pub secret: String,
    pub created_at: i64,
    /// `native` or `e2b`: the payload rendered and how it is signed.
    pub format: String,
    /// E2B's name for it (empty for native ones).
    pub name: String,
    /// A disabled webhook gets no new deliveries.
    pub enabled: bool,
}

/// Where a delivery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryStatus {
    Pending,
    Delivered,
    Failed,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<DeliveryStatus> {
        [DeliveryStatus::Pending, DeliveryStatus::Delivered, DeliveryStatus::Failed]
            .into_iter()
            .find(|d| d.as_str() == s)
    }
}

/// One delivery of an event to a webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryRecord {
    pub id: i64,
    pub webhook_id: String,
    pub event_id: i64,
    pub event_type: String,
    pub payload: String,
    pub status: DeliveryStatus,
    pub attempts: u32,
    pub created_at: i64,
    pub next_at: Option<i64>,
    pub last_at: Option<i64>,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
}

/// What one delivery attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub at: i64,
    pub status: DeliveryStatus,
    /// When a pending one is tried again.
    pub next_at: Option<i64>,
    pub http_status: Option<u16>,
    pub error: Option<String>,
}

/// What a transition sets besides the state; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Changes<'a> {
    pub last_error_code: Option<&'a str>,
    pub host_pid: Option<i64>,
    pub limits_applied: Option<&'a str>,
    /// JSON, as [`SandboxRecord::network`].
    pub network: Option<&'a str>,
    /// A condition, not a change: the transition happens only while the
    /// row names this node (a sandbox another node took meanwhile, as a
    /// move does, is not started here).
    pub on_node: Option<&'a str>,
    /// The sandbox's usage interval follows its new state as of this time
    /// ([`Store::usage_mark`]), in the transition's transaction.
    pub usage_at: Option<i64>,
}

/// A template as stored. Times are Unix milliseconds; lifetimes seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateRecord {
    pub id: String,
    pub owner: String,
    pub name: String,
    pub version: i64,
    pub image: String,
    pub class: String,
    pub memory_mb: u64,
    pub vcpus: f64,
    pub disk_mib: u64,
    pub pids: u32,
    /// JSON object.
    pub env: String,
    pub default_ttl_s: u64,
    pub max_ttl_s: u64,
    pub warm_min: u32,
    pub warm_max: u32,
    pub created_at: i64,
    pub updated_at: i64,
    pub deleted_at: Option<i64>,
    /// JSON `{"command"}`, or None.
    pub startup: Option<String>,
    /// JSON `{"command"|"port", "timeout_seconds"}`, or None.
    pub readiness: Option<String>,
    /// JSON: the network policy of its sandboxes (`{}` is `default`).
    pub network: String,
    /// Where its sandboxes' files live; None: the host's default.
    pub storage: Option<StorageKind>,
    /// What happens to its sandboxes at their expiry; None: delete.
    pub on_expire: Option<OnExpire>,
    /// How long its sandboxes paused at their expiry are kept; None: the
    /// default.
    pub paused_ttl_s: Option<u64>,
    /// Its sandboxes' idle timeout and what idleness does; None: none.
    pub idle_timeout_s: Option<u64>,
    pub on_idle: Option<OnIdle>,
    /// JSON array: the names of the owner's secrets its sandboxes name.
    pub secrets: String,
}

/// A secret as stored: its value only sealed (nonce, ciphertext and tag),
/// never in the clear. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRecord {
    pub id: String,
    pub owner: String,
    /// Unique among the owner's secrets.
    pub name: String,
    /// JSON array of host names (`*.` wildcards allowed).
    pub hosts: String,
    /// The header the egress proxy sets, and its format (`{value}`).
    pub header: Option<String>,
    pub format: Option<String>,
    /// JSON object.
    pub metadata: String,
    /// Raised by each change of the value.
    pub version: i64,
    pub sealed: Vec<u8>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A template build as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildRecord {
    pub id: String,
    pub template_id: String,
    pub owner: String,
    pub state: BuildState,
    pub created_at: i64,
    pub finished_at: Option<i64>,
    pub error: Option<String>,
    /// The image built on (`base`).
    pub parent: String,
    /// The image made and the template version it became, on success.
    pub image: Option<String>,
    pub version: Option<i64>,
    /// The node that runs it ("" when unknown: made before builds named
    /// their node).
    pub node: String,
}

/// What a claim of a warm sandbox sets on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim<'a> {
    pub template_id: &'a str,
    pub owner: &'a str,
    pub now: i64,
    pub expires_at: i64,
    pub max_expires_at: i64,
    /// JSON object.
    pub metadata: &'a str,
    pub idempotency_key: Option<&'a str>,
    pub request_hash: &'a str,
    /// Only a warm sandbox whose files live there.
    pub storage: StorageKind,
    /// What the claimed sandbox does at its expiry, its lifetime and how
    /// long it is kept paused (as [`SandboxRecord`]).
    pub on_expire: OnExpire,
    pub ttl_s: Option<u64>,
    pub paused_ttl_s: Option<u64>,
    /// Only a warm sandbox of this node (the claimer's).
    pub node: &'a str,
}

/// Where an idempotent command is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecState {
    Running,
    Done,
    /// Running when a daemon stopped: its outcome is unknown.
    Lost,
}

impl ExecState {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecState::Running => "running",
            ExecState::Done => "done",
            ExecState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<ExecState> {
        [ExecState::Running, ExecState::Done, ExecState::Lost].into_iter().find(|e| e.as_str() == s)
    }
}

/// The journal entry of an idempotent command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRecord {
    pub scope: String,
    pub key: String,
    pub request_hash: String,
    pub state: ExecState,
    pub result: Option<String>,
    pub created_at: i64,
}

/// What [`Store::begin_exec`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The key was free and is now held by the caller (state `running`).
    Started,
    /// The key was used before; here is its journal entry.
    Existing(ExecRecord),
}

/// What sandboxes hold now (those not terminated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub sandboxes: u64,
    pub memory_mb: u64,
    pub disk_mib: u64,
}

/// A resource a quota or the host's capacity bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Sandboxes,
    MemoryMb,
    DiskMib,
    Builds,
    Snapshots,
    /// Seconds of lifetime one sandbox may have.
    TtlSeconds,
}

impl Resource {
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Sandboxes => "sandboxes",
            Resource::MemoryMb => "memory_mb",
            Resource::DiskMib => "disk_mib",
            Resource::Builds => "builds",
            Resource::Snapshots => "snapshots",
            Resource::TtlSeconds => "ttl_seconds",
        }
    }
}

/// Caps a new sandbox must fit under, checked in the insert's transaction:
/// the owner's quotas (over every node's sandboxes) and what the host may
/// hold (over the sandboxes of the new one's node).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admission {
    pub owner: Quotas,
    pub host: Quotas,
}

/// Whose cap a refusal hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Owner,
    Host,
}

/// A refused admission: which cap, its limit, what is held and what was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exceeded {
    pub scope: Scope,
    pub resource: Resource,
    pub limit: u64,
    pub used: u64,
    pub asked: u64,
}

/// What an admitted volume write (an insert or a resize) did: a volume
/// claims nothing and belongs to no node, so quotas alone can refuse it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeAdmitted {
    Written,
    Refused(Exceeded),
}

/// What an admitted sandbox insert did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    Inserted,
    Refused(Exceeded),
    /// A volume it claims is held by a sandbox that has not ended (the
    /// volume's id): read-write by one, or read-only by one when
    /// read-write is asked.
    VolumeInUse(String),
    /// A volume it claims was deleted meanwhile (the volume's id).
    VolumeGone(String),
    /// Its node is draining or lost and takes no new sandbox: read in the
    /// insert's transaction, so a drain committed first is seen.
    NodeClosed(NodeState),
}

/// Reads of one row by its key, the ones every request makes (its key,
/// its sandbox, its template). Every store answers them; a local store
/// also hands out a connection of their own ([`Store::quick_reads`]).
pub trait QuickReads: Send + Sync {
    fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>>;
    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>>;
    /// The owner's live template of this name.
    fn template_by_name(&self, owner: &str, name: &str) -> Result<Option<TemplateRecord>>;
}

/// Everything hutch keeps. Implementations must be safe to share between
/// threads; each call is one transaction. Calls block: async callers run
/// them on a blocking pool, but for [`Store::quick_reads`].
pub trait Store: QuickReads + Send + Sync {
    /// The point reads on a connection of their own, short enough for an
    /// async worker to make in place, where handing them to a blocking
    /// thread would cost more than the read: a local file's, which in WAL
    /// mode never waits for a writer (tens of microseconds). None where a
    /// read crosses a network, as PostgreSQL's do.
    fn quick_reads(&self) -> Option<&dyn QuickReads> {
        None
    }

    fn insert_key(&self, key: &KeyRecord) -> Result<()>;
    /// Inserts `key` only if the store has no key at all (the admin key a
    /// daemon makes at its first start); false when one exists. Of daemons
    /// starting together on an empty database, one inserts.
    fn insert_first_key(&self, key: &KeyRecord) -> Result<bool>;
    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>>;
    fn list_keys(&self) -> Result<Vec<KeyRecord>>;
    /// Marks a key revoked; false when no live key has this id.
    fn revoke_key(&self, id: &str, at: i64) -> Result<bool>;
    /// Sets a sandbox's idle policy (`on_idle`: `pause` or `delete`).
    fn set_sandbox_idle(&self, id: &str, timeout_s: u64, on_idle: &str) -> Result<()>;
    /// The idle policies of sandboxes that have not ended, of one node
    /// (None: of every node): (id, timeout, on_idle).
    fn sandbox_idle_all(&self, node: Option<&str>) -> Result<Vec<(String, u64, String)>>;
    /// A live key's grant secret: None when no live key has this id,
    /// Some(None) when it has none yet.
    fn grant_secret(&self, id: &str) -> Result<Option<Option<String>>>;
    /// Sets a live key's grant secret (with `only_if_unset`, only if it has
    /// none); false when nothing was set.
    fn set_grant_secret(&self, id: &str, secret: &str, only_if_unset: bool) -> Result<bool>;
    /// Sets a live key's quotas; false when no live key has this id.
    fn set_quotas(&self, id: &str, quotas: &Quotas) -> Result<bool>;
    fn count_keys(&self) -> Result<u64>;

    /// Inserts a sandbox if it fits under `admission` (checked in the same
    /// transaction, so concurrent creates cannot both slip under a cap);
    /// [`StoreError::Conflict`] when its id, or its owner's idempotency
    /// key, is taken.
    fn insert_sandbox(&self, sb: &SandboxRecord, admission: &Admission) -> Result<Admitted> {
        self.insert_sandbox_claiming(sb, admission, &[], None)
    }
    /// [`Store::insert_sandbox`] that also claims volumes, in the same
    /// transaction: refused ([`Admitted::VolumeInUse`]) when a read-write
    /// claim meets any other live claim of the volume. With `usage_at`,
    /// the sandbox's usage interval opens then, in that transaction too.
    fn insert_sandbox_claiming(
        &self,
        sb: &SandboxRecord,
        admission: &Admission,
        claims: &[VolumeClaim],
        usage_at: Option<i64>,
    ) -> Result<Admitted>;
    fn sandbox_by_key(&self, owner: &str, key: &str) -> Result<Option<SandboxRecord>>;
    /// Moves a sandbox from one of `from` to `to`, setting `changes`, in one
    /// conditional update. None when it is in none of `from` (or unknown):
    /// someone else moved it first.
    fn transition(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        changes: &Changes<'_>,
    ) -> Result<Option<SandboxRecord>>;
    /// Sets the expiry of a sandbox in one of `states` (and with
    /// `raise_max`, its latest expiry to at least that); None otherwise.
    fn set_expiry(
        &self,
        id: &str,
        expires_at: i64,
        raise_max: bool,
        states: &[SandboxState],
    ) -> Result<Option<SandboxRecord>>;
    /// Sets a sandbox's network record (JSON).
    fn set_network(&self, id: &str, json: &str) -> Result<()>;
    /// Addresses admitted for a sandbox by the resolver (JSON array).
    fn set_net_learned(&self, id: &str, json: &str) -> Result<()>;
    fn net_learned(&self, id: &str) -> Result<String>;
    /// Newest first; `after` is the (created_at, id) of the last row of the
    /// previous page. `owner` None lists every owner's; `live` leaves out
    /// terminated sandboxes.
    fn list_sandboxes(
        &self,
        owner: Option<&str>,
        after: Option<(i64, &str)>,
        limit: u32,
        live: bool,
    ) -> Result<Vec<SandboxRecord>>;
    /// Sandboxes in any of these states, oldest first: every node's.
    fn sandboxes_in(&self, states: &[SandboxState]) -> Result<Vec<SandboxRecord>> {
        self.sandboxes_on(None, states)
    }
    /// [`Store::sandboxes_in`] of one node only (None: every node's).
    fn sandboxes_on(&self, node: Option<&str>, states: &[SandboxState]) -> Result<Vec<SandboxRecord>>;
    /// [`Store::sandboxes_on`], each as a [`SandboxBrief`].
    fn briefs_on(&self, node: Option<&str>, states: &[SandboxState]) -> Result<Vec<SandboxBrief>>;
    /// How many sandboxes are in each state.
    fn count_by_state(&self) -> Result<Vec<(SandboxState, u64)>>;
    /// What the sandboxes of `owner` (None: of everyone) hold now.
    fn usage(&self, owner: Option<&str>) -> Result<Usage>;

    /// Takes an idempotency key for a command that `node` runs, or returns
    /// its entry.
    fn begin_exec(&self, scope: &str, key: &str, request_hash: &str, now: i64, node: &str) -> Result<Begin>;
    /// Records a command's outcome (`result` already stripped of output
    /// when output is not kept).
    fn finish_exec(&self, scope: &str, key: &str, result: &str) -> Result<()>;
    /// Frees a key whose command never started (capacity refusal).
    fn release_exec(&self, scope: &str, key: &str) -> Result<()>;
    /// After a restart of `node`: its commands that were running have lost
    /// their outcome (and those of no known node). Other nodes' run on.
    fn mark_running_execs_lost(&self, node: &str) -> Result<u64>;

    /// Inserts a template; [`StoreError::Conflict`] when its owner has a
    /// live template of that name.
    fn insert_template(&self, t: &TemplateRecord) -> Result<()>;
    /// A template by id, deleted ones included.
    fn get_template(&self, id: &str) -> Result<Option<TemplateRecord>>;
    /// Live templates (of one owner, or all), oldest first.
    fn list_templates(&self, owner: Option<&str>) -> Result<Vec<TemplateRecord>>;
    /// Rewrites every field but id, owner and created_at of a live template
    /// last updated at `updated_at` (an edit based on what was read); false
    /// when it changed or was deleted meanwhile. [`StoreError::Conflict`] on
    /// a name clash.
    fn update_template(&self, t: &TemplateRecord, updated_at: i64) -> Result<bool>;

    /// Claims the oldest running pooled sandbox of the template's current
    /// version, in one transaction: it leaves the pool, its lifetime
    /// starts now and its usage is its claimer's from `claim.now` on.
    /// None when the pool has none ready.
    fn claim_warm(&self, claim: &Claim<'_>) -> Result<Option<SandboxRecord>>;
    /// Takes a running pooled sandbox out of its pool for draining (state
    /// `terminating`); false when a claim took it first.
    fn drain_pooled(&self, id: &str) -> Result<bool>;
    /// Pooled sandboxes (any state but terminated), oldest first, of one
    /// node (None: of every node).
    fn pooled_sandboxes(&self, node: Option<&str>) -> Result<Vec<SandboxRecord>>;

    // Template builds.
    /// Inserts a build if its owner has fewer than `max_running` builds
    /// queued or running (None: no cap); false when it has that many.
    /// Inserts a snapshot unless its owner keeps `max` already (false);
    /// a name the owner uses already is `Conflict`.
    fn insert_snapshot(&self, snap: &SnapshotRecord, max: Option<u64>) -> Result<bool>;
    fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRecord>>;
    fn snapshot_by_name(&self, owner: &str, name: &str) -> Result<Option<SnapshotRecord>>;
    /// Newest first: one owner's, or (None) everyone's.
    fn list_snapshots(&self, owner: Option<&str>) -> Result<Vec<SnapshotRecord>>;
    /// False when there was none.
    fn delete_snapshot(&self, id: &str) -> Result<bool>;
    fn insert_build(&self, b: &BuildRecord, max_running: Option<u64>) -> Result<bool>;

    // Volumes.
    /// Inserts a volume if its size fits under `admission`'s `disk_mib`
    /// caps (volumes count toward disk); [`StoreError::Conflict`] when its
    /// owner has a volume of that name.
    fn insert_volume(&self, v: &VolumeRecord, admission: &Admission) -> Result<VolumeAdmitted>;
    fn get_volume(&self, id: &str) -> Result<Option<VolumeRecord>>;
    fn volume_by_name(&self, owner: &str, name: &str) -> Result<Option<VolumeRecord>>;
    /// Oldest first: one owner's, or (None) everyone's.
    fn list_volumes(&self, owner: Option<&str>) -> Result<Vec<VolumeRecord>>;
    /// Sets a volume's size if the growth fits under `admission`; None
    /// when there is no such volume.
    fn resize_volume(&self, id: &str, size_mib: u64, admission: &Admission) -> Result<Option<VolumeAdmitted>>;
    /// Deletes a volume no live sandbox holds, with its claims.
    fn delete_volume(&self, id: &str) -> Result<VolumeDeleted>;
    /// A sandbox's claims (whatever its state), by path.
    fn volume_claims(&self, sandbox_id: &str) -> Result<Vec<VolumeClaim>>;
    /// The live claims of a volume (sandboxes not terminated).
    fn volume_holders(&self, volume_id: &str) -> Result<Vec<VolumeClaim>>;
    /// How many volumes `owner` (None: everyone) keeps, and their MiB.
    fn volume_usage(&self, owner: Option<&str>) -> Result<(u64, u64)>;
    /// Moves a build from one of `from` to `b.state`, writing finished_at,
    /// error, image and version; false when it is in none of `from`.
    fn update_build(&self, b: &BuildRecord, from: &[BuildState]) -> Result<bool>;
    fn get_build(&self, id: &str) -> Result<Option<BuildRecord>>;
    /// A template's builds, newest first (at most 100).
    fn list_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>>;
    /// Builds queued or running, of one owner or of everyone.
    fn count_running_builds(&self, owner: Option<&str>) -> Result<u64>;
    /// After a restart of `node`: marks the builds it left queued or
    /// building (and those of no known node) as failed. Other nodes' run on.
    fn fail_unfinished_builds(&self, node: &str, now: i64, error: &str) -> Result<u64>;

    // Secrets.
    /// [`StoreError::Conflict`] when its owner has a secret of that name.
    fn insert_secret(&self, s: &SecretRecord) -> Result<()>;
    fn secret_by_name(&self, owner: &str, name: &str) -> Result<Option<SecretRecord>>;
    /// By name: one owner's, or (None) everyone's.
    fn list_secrets(&self, owner: Option<&str>) -> Result<Vec<SecretRecord>>;
    /// Writes every field but id, owner, name and created_at; false when
    /// there is no such secret.
    fn update_secret(&self, s: &SecretRecord) -> Result<bool>;
    /// False when there was none.
    fn delete_secret(&self, owner: &str, name: &str) -> Result<bool>;

    // The audit log: appended and pruned, never rewritten.
    /// Appends rows in order, in one transaction, each with its key's name.
    fn append_audit(&self, rows: &[AuditRecord]) -> Result<()>;
    /// Rows matching `q`, newest first.
    fn list_audit(&self, q: &AuditQuery) -> Result<Vec<AuditRecord>>;
    /// Deletes rows older than `before`; how many.
    fn prune_audit(&self, before: i64) -> Result<u64>;

    // Events and webhooks.
    /// The highest event id stored (0 when none): where a daemon's live
    /// view of the events starts.
    fn last_event_id(&self) -> Result<i64>;
    /// Appends events in one transaction, giving each its id (what `id`
    /// held is ignored; it is set), and for each, a pending delivery to
    /// every webhook of its owner that wants its type; how many deliveries
    /// were made. Ids increase in the rows' order, are never given twice
    /// (not even after a prune), and commit in their order, whichever
    /// daemon appends: a reader that sees an id sees every lower one that
    /// will ever be stored, so reading "after the last id seen" misses
    /// nothing. Ids may have gaps (an append that failed).
    fn append_events(&self, rows: &mut [EventRecord]) -> Result<u64>;
    /// Events matching `q`, oldest first.
    fn list_events(&self, q: &EventQuery) -> Result<Vec<EventRecord>>;
    /// Deletes events older than `before`, and deliveries made before it
    /// that are no longer pending; how many events.
    fn prune_events(&self, before: i64) -> Result<u64>;
    /// Deletes at most `batch` sandboxes that ended before `before` (their
    /// `ended_at`, which triggers set as they end), with their volume
    /// mounts and their commands' Idempotency-Key journal; how many. Live
    /// and paused sandboxes are never touched.
    fn prune_sandboxes(&self, before: i64, batch: u32) -> Result<u64>;
    /// Inserts a webhook if its owner has fewer than `max`; false otherwise.
    fn insert_webhook(&self, w: &WebhookRecord, max: u64) -> Result<bool>;
    fn get_webhook(&self, id: &str) -> Result<Option<WebhookRecord>>;
    /// Oldest first; None: every owner's.
    fn list_webhooks(&self, owner: Option<&str>) -> Result<Vec<WebhookRecord>>;
    /// Deletes a webhook and its deliveries; false when there was none.
    fn delete_webhook(&self, id: &str) -> Result<bool>;
    /// Rewrites a webhook's url, events, name and enabled flag; false when
    /// there was none.
    fn update_webhook(&self, w: &WebhookRecord) -> Result<bool>;
    /// A webhook's deliveries, newest first, below `before` (an id).
    fn list_deliveries(&self, webhook_id: &str, before: Option<i64>, limit: u32) -> Result<Vec<DeliveryRecord>>;
    /// Claims for `node` until `until` at most `limit` pending deliveries
    /// due by `now` that no node holds (or whose claim ran out by `now`),
    /// oldest first, with their webhook: of nodes claiming at once, each
    /// delivery goes to one.
    fn claim_deliveries(
        &self,
        node: &str,
        now: i64,
        until: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>>;
    /// Frees the claims of `node` (at its start: none of its attempts is
    /// in flight, so what it holds was cut short by its stop); how many.
    fn release_deliveries(&self, node: &str) -> Result<u64>;
    /// When the next pending delivery is due and free to claim, if any is.
    fn next_delivery_at(&self) -> Result<Option<i64>>;
    /// Records an attempt of a delivery `node` claimed, and frees it;
    /// false (nothing recorded) when the delivery is no longer `node`'s
    /// (its claim ran out and another node took it).
    fn record_attempt(&self, id: i64, node: &str, a: &Attempt) -> Result<bool>;
    // Usage metering: a ledger of intervals (see [`UsageKind`]).
    /// Brings a sandbox's open interval in line with its record at `at`:
    /// nothing when it already bills the same (kind, owner, limits);
    /// otherwise the open one ends at `at` and (unless the sandbox is
    /// terminated) a new one starts then.
    fn usage_mark(&self, sb: &SandboxRecord, at: i64) -> Result<()>;
    /// The same for a snapshot or a volume: `open` Some starts (or, with
    /// another size, restarts) its interval, None ends it.
    fn usage_mark_object(&self, open: Option<&UsageInterval>, subject: &str, at: i64) -> Result<()>;
    /// Ends a sandbox's open interval at `at` (the last moment it is known
    /// to have run) and opens a `held` one from then: what a restart does
    /// for a sandbox that died with the last daemon.
    fn usage_lost(&self, sandbox_id: &str, at: i64) -> Result<()>;
    /// Adds counts and records that `node` was alive at `alive_at`, in
    /// one transaction.
    fn usage_flush(&self, counts: &[UsageCount], node: &str, alive_at: i64) -> Result<()>;
    /// When `node` last flushed (None: never). A node that has not flushed
    /// since clocks were kept per node gets the one clock kept before.
    fn usage_alive_at(&self, node: &str) -> Result<Option<i64>>;
    /// The report `q` asks for.
    fn usage_report(&self, q: &UsageQuery) -> Result<Vec<UsageRow>>;
    /// Per key (`owner` None: every key), everything metered from the
    /// start to `now`: the running totals kept as intervals close and
    /// counts are flushed, plus the open intervals. Reads no history.
    fn usage_totals(&self, owner: Option<&str>, now: i64) -> Result<Vec<UsageRow>>;
    /// Subjects with an open interval (sandbox, snapshot and volume ids).
    fn usage_open_subjects(&self) -> Result<Vec<(UsageKind, String)>>;

    // Nodes: the daemons sharing the database.
    /// Registers a node, or registers it again (a restart): its address,
    /// capacity, `started_at` and heartbeat are written and it is active
    /// (a draining node stays draining: an operator's drain outlives a
    /// restart).
    fn register_node(&self, n: &NodeRecord) -> Result<()>;
    /// Records a heartbeat of a node that is not lost, and says its state
    /// (None: no node has this name). A lost node's beat is not recorded:
    /// it must first end what the fleet no longer gives it, then register
    /// again.
    fn heartbeat_node(&self, name: &str, at: i64) -> Result<Option<NodeState>>;
    /// Every node, by name.
    fn list_nodes(&self) -> Result<Vec<NodeRecord>>;
    /// Declares a node lost, in one transaction with its sandboxes, if it
    /// is not lost already and has not beaten since `loss.silent_before`
    /// (one winner among the nodes looking). Its sandboxes in `loss.from`
    /// become `lost` (with `loss.code` and `loss.reason`); its paused ones
    /// keep their state and get `loss.paused_reason`. None when it was not
    /// declared (lost already, it beat meanwhile, or unknown); otherwise
    /// the sandboxes made lost, as they are now.
    fn mark_node_lost(&self, loss: &NodeLoss<'_>) -> Result<Option<Vec<SandboxRecord>>>;
    /// Moves a node from one of `from` to `to` (a drain, an undrain);
    /// false when it is in none of `from` (or unknown).
    fn set_node_state(&self, name: &str, from: &[NodeState], to: NodeState) -> Result<bool>;
    /// Sandboxes neither terminated nor lost (pooled ones included), per node.
    fn count_by_node(&self) -> Result<Vec<(String, u64)>>;
    /// Gives every sandbox and volume of another node to `node`; how many
    /// (its commands and builds go too, uncounted). Only for a database
    /// one daemon keeps alone (SQLite): its sandboxes and volumes are that
    /// daemon's whatever node name it had (none, before nodes existed).
    fn give_all_to(&self, node: &str) -> Result<u64>;

    // Moves between nodes, through the fleet's OCI registry.
    /// Records where `object` `id`'s files were pushed (None: forgets it);
    /// false when there is no such row.
    fn set_pushed(&self, object: Pushed, id: &str, reference: Option<&str>) -> Result<bool>;
    /// Where `object` `id`'s files were pushed, if they were.
    fn pushed(&self, object: Pushed, id: &str) -> Result<Option<String>>;
    /// Gives sandbox `id` from node `from` to node `to`, only if it is
    /// still on `from`, paused to disk and pushed: of two nodes taking it,
    /// one wins.
    fn move_paused(&self, id: &str, from: &str, to: &str) -> Result<bool>;
}

/// What a push reference is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// A sandbox paused to disk: its image's layers and its files.
    Sandbox,
    /// A snapshot: its sandbox's image's layers and the snapshot's files.
    Snapshot,
    /// A successful template build: its image's layers (its parent's,
    /// then its own) and an empty top layer.
    Build,
}

impl Pushed {
    fn table(self) -> &'static str {
        match self {
            Pushed::Sandbox => "sandboxes",
            Pushed::Snapshot => "snapshots",
            Pushed::Build => "builds",
        }
    }
}

#[cfg(test)]
mod tests;
