//! The PostgreSQL store: the same [`Store`] as the SQLite one, for daemons
//! that share one database.
//!
//! # Connections
//!
//! The blocking `postgres` client (the trait is blocking and called on a
//! blocking pool), in a small pool of our own ([`Pool`]: a `Mutex<Vec>` of
//! idle clients and a `Condvar`, no more than `pool_size` open). There is
//! no TLS: reach the server by a unix socket
//! (`postgres://hutch@%2Fvar%2Frun%2Fpostgresql/hutch`, or
//! `postgres:///hutch?host=/var/run/postgresql`), by localhost, or over a
//! trusted network; a remote server on an untrusted one is reached through
//! a local pgbouncer or stunnel that speaks TLS for us.
//!
//! # Single winners
//!
//! Every call is one transaction at READ COMMITTED, PostgreSQL's default.
//! What must have one winner among daemons is written so that it has:
//!
//! - A state change is one conditional update (`UPDATE ... WHERE id = $1
//!   AND state = ANY($n) RETURNING ...`). A second writer of the same row
//!   waits for the first to commit, then re-evaluates its `WHERE` on the
//!   row the first left: the state it expected is gone, it changes
//!   nothing and gets no row (None). The same holds for builds, templates
//!   (`updated_at` as the version read), the drain of a pooled sandbox and
//!   the revocation of a key.
//! - A warm claim locks the template's row (`FOR SHARE`: no new version
//!   commits meanwhile) and then the oldest ready sandbox with
//!   `FOR UPDATE OF s SKIP LOCKED`: two claimers take two different
//!   sandboxes, never one twice, and neither waits for the other.
//! - Admission (a check of what is held, then an insert) takes an
//!   advisory transaction lock first: one lock for everything that counts
//!   toward the sandbox and disk caps (sandboxes, their volume claims,
//!   volumes and their sizes, a volume's delete), and one per owner for
//!   the snapshot, build and webhook caps. The lock is released at
//!   commit, after the commit is visible, and each statement at READ
//!   COMMITTED reads a fresh snapshot, so the next holder counts what the
//!   last one inserted. What is held only grows by these inserts (a
//!   transition only frees, and a terminated sandbox never comes back), so
//!   a transition needs no lock. Explicit locks rather than SERIALIZABLE:
//!   an admission reads every live sandbox, so under SERIALIZABLE nearly
//!   every pair of concurrent creates would abort one of them and retry;
//!   the lock makes them queue instead, with no aborted work, and keeps
//!   the reasoning in one place (here).
//! - The usage ledger's open interval of a subject is rewritten under a
//!   per-subject advisory lock; an idempotent command's key is taken by
//!   `INSERT ... ON CONFLICT DO NOTHING`.
//!
//! Should a serialization failure or a deadlock (SQLSTATE 40001, 40P01)
//! still happen, the call's transaction is run again, a few times.

use crate::sqlite::{
    bills_alike, over, split_classes, totals_values, BRIEF_COLUMNS, BUILD_COLUMNS, HOLDING, KEY_COLUMNS, NODE_COLUMNS,
    SANDBOX_COLUMNS, SECRET_COLUMNS, SNAPSHOT_COLUMNS, TEMPLATE_COLUMNS, TOTALS_ADD, TOTALS_COLUMNS, USAGE_COLUMNS,
    VOLUME_COLUMNS,
};
use crate::sqlite_events::{events_json, parse_events, DELIVERY_COLS, WEBHOOK_COLS};
use crate::*;
use postgres::error::SqlState;
use postgres::fallible_iterator::FallibleIterator;
use postgres::types::ToSql;
use postgres::{Client, GenericClient, NoTls, Row, Transaction};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

const MIGRATIONS: &[(&str, &str)] = &[
    ("0001_init", include_str!("../migrations/postgres/0001_init.sql")),
    ("0002_nodes", include_str!("../migrations/postgres/0002_nodes.sql")),
    ("0003_node_loss", include_str!("../migrations/postgres/0003_node_loss.sql")),
    ("0004_moves", include_str!("../migrations/postgres/0004_moves.sql")),
    ("0005_build_push", include_str!("../migrations/postgres/0005_build_push.sql")),
    ("0006_volume_node", include_str!("../migrations/postgres/0006_volume_node.sql")),
    ("0007_event_ids", include_str!("../migrations/postgres/0007_event_ids.sql")),
    ("0008_delivery_claims", include_str!("../migrations/postgres/0008_delivery_claims.sql")),
    ("0009_node_work", include_str!("../migrations/postgres/0009_node_work.sql")),
    ("0010_node_clock", include_str!("../migrations/postgres/0010_node_clock.sql")),
    ("0011_pooled_live", include_str!("../migrations/postgres/0011_pooled_live.sql")),
    ("0012_running_totals", include_str!("../migrations/postgres/0012_running_totals.sql")),
    ("0013_sandbox_retention", include_str!("../migrations/postgres/0013_sandbox_retention.sql")),
    ("0014_no_state_index", include_str!("../migrations/postgres/0014_no_state_index.sql")),
];

/// Connections a store opens at most, unless told otherwise.
pub const DEFAULT_POOL_SIZE: usize = 8;

/// How long a call waits for a free connection.
const POOL_WAIT: Duration = Duration::from_secs(30);

/// How many times a transaction that lost a serialization race or a
/// deadlock is run again.
const RETRIES: u32 = 5;

/// Advisory lock keys (the first of the two-key form; "hut" and a number,
/// to stay clear of other users of the database).
mod lock {
    pub const MIGRATE: i32 = 0x6875_7401;
    /// Sandboxes, volume claims and volumes: what the sandbox, memory and
    /// disk caps count.
    pub const ADMISSION: i32 = 0x6875_7402;
    pub const SNAPSHOTS: i32 = 0x6875_7403;
    pub const BUILDS: i32 = 0x6875_7404;
    pub const WEBHOOKS: i32 = 0x6875_7405;
    pub const USAGE: i32 = 0x6875_7406;
    /// Appends of events: their ids commit in their order.
    pub const EVENTS: i32 = 0x6875_7407;
    /// The first key (the admin key a daemon makes at its first start).
    pub const KEYS: i32 = 0x6875_7408;
}

type Param<'a> = &'a (dyn ToSql + Sync);

/// The PostgreSQL store.
pub struct PgStore {
    pool: Pool,
}

struct Pool {
    config: postgres::Config,
    size: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

struct PoolState {
    idle: Vec<Client>,
    /// Clients open: idle or lent.
    open: usize,
}

/// A client lent by the pool, given back when dropped.
struct Lease<'a> {
    pool: &'a Pool,
    client: Option<Client>,
}

impl Pool {
    fn lease(&self) -> Result<Lease<'_>> {
        let mut st = self.state.lock().map_err(|_| StoreError::Poisoned)?;
        loop {
            if let Some(c) = st.idle.pop() {
                if c.is_closed() {
                    st.open -= 1;
                    continue;
                }
                return Ok(Lease { pool: self, client: Some(c) });
            }
            if st.open < self.size {
                st.open += 1;
                drop(st);
                return match self.config.connect(NoTls) {
                    Ok(c) => Ok(Lease { pool: self, client: Some(c) }),
                    Err(e) => {
                        if let Ok(mut st) = self.state.lock() {
                            st.open -= 1;
                        }
                        self.freed.notify_one();
                        Err(e.into())
                    }
                };
            }
            let (guard, wait) = self.freed.wait_timeout(st, POOL_WAIT).map_err(|_| StoreError::Poisoned)?;
            st = guard;
            if wait.timed_out() && st.idle.is_empty() && st.open >= self.size {
                return Err(StoreError::PoolExhausted(self.size));
            }
        }
    }
}

impl Lease<'_> {
    fn client(&mut self) -> &mut Client {
        self.client.as_mut().expect("a lease holds its client until dropped")
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let Some(c) = self.client.take() else { return };
        if let Ok(mut st) = self.pool.state.lock() {
            if c.is_closed() {
                st.open -= 1;
            } else {
                st.idle.push(c);
            }
        }
        self.pool.freed.notify_one();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Each client owns a small runtime, which must not be dropped on
        // an async worker.
        if let Ok(st) = self.state.get_mut() {
            let idle = std::mem::take(&mut st.idle);
            blocking(move || drop(idle));
        }
    }
}

/// Runs `f`, which blocks, where blocking is allowed: the postgres client
/// drives its own small runtime, which cannot run inside an async worker
/// of another. Callers are meant to use a blocking pool; a call made from
/// an async worker of a multi-threaded runtime is moved off it here
/// rather than panicking.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn retryable(e: &StoreError) -> bool {
    match e {
        StoreError::Postgres(e) => {
            matches!(e.code(), Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED)
        }
        _ => false,
    }
}

/// A unique or foreign key violation is [`StoreError::Conflict`], as in
/// the SQLite store.
fn conflict(e: postgres::Error) -> StoreError {
    match e.code() {
        Some(c) if *c == SqlState::UNIQUE_VIOLATION || *c == SqlState::FOREIGN_KEY_VIOLATION => StoreError::Conflict,
        _ => StoreError::Postgres(e),
    }
}

/// `$first, ..., $(first+n-1)`.
fn marks(first: usize, n: usize) -> String {
    (first..first + n).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ")
}

fn lock_xact(c: &mut impl GenericClient, key: i32, on: &str) -> Result<()> {
    c.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", &[&key, &on])?;
    Ok(())
}

fn insert_key(c: &mut impl GenericClient, k: &KeyRecord) -> Result<()> {
    c.execute(
        &format!("INSERT INTO api_keys ({KEY_COLUMNS}) VALUES ({})", marks(1, 12)),
        &[
            &k.id,
            &k.name,
            &k.hash,
            &k.admin,
            &k.created_at,
            &k.revoked_at,
            &opt_i64(k.quotas.sandboxes),
            &opt_i64(k.quotas.memory_mb),
            &opt_i64(k.quotas.disk_mib),
            &opt_i64(k.quotas.ttl_seconds),
            &opt_i64(k.quotas.builds),
            &opt_i64(k.quotas.snapshots),
        ],
    )
    .map_err(conflict)?;
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl PgStore {
    /// Connects to `url` (`postgres://...`, or key=value pairs) with a
    /// pool of [`DEFAULT_POOL_SIZE`] and brings its schema up to date.
    pub fn open(url: &str) -> Result<PgStore> {
        Self::open_with(url, DEFAULT_POOL_SIZE)
    }

    pub fn open_with(url: &str, pool_size: usize) -> Result<PgStore> {
        Self::open_config(url.parse()?, pool_size)
    }

    pub(crate) fn open_config(mut config: postgres::Config, pool_size: usize) -> Result<PgStore> {
        if config.get_application_name().is_none() {
            config.application_name("hutch");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        let store = PgStore {
            pool: Pool {
                config,
                size: pool_size.max(1),
                state: Mutex::new(PoolState { idle: Vec::new(), open: 0 }),
                freed: Condvar::new(),
            },
        };
        store.migrate()?;
        Ok(store)
    }

    /// Applies the migrations not yet recorded in `schema_version`, in
    /// order, in one transaction under an advisory lock: daemons starting
    /// together migrate once.
    fn migrate(&self) -> Result<()> {
        self.tx(|t| {
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::MIGRATE])?;
            t.batch_execute(
                "CREATE TABLE IF NOT EXISTS schema_version (name TEXT PRIMARY KEY, applied_at BIGINT NOT NULL)",
            )?;
            for (name, sql) in MIGRATIONS {
                if t.query_opt("SELECT 1 FROM schema_version WHERE name = $1", &[name])?.is_none() {
                    t.batch_execute(sql)?;
                    t.execute("INSERT INTO schema_version (name, applied_at) VALUES ($1, $2)", &[name, &now_ms()])?;
                }
            }
            Ok(())
        })
    }

    /// The sandboxes of `node` (None: every node's) in any of `states`,
    /// oldest first, each read as `columns` by `row`.
    fn sandboxes_with<T>(
        &self,
        columns: &str,
        node: Option<&str>,
        states: &[SandboxState],
        row: fn(&Row) -> Result<T>,
    ) -> Result<Vec<T>> {
        let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
        let sql = format!(
            "SELECT {columns} FROM sandboxes WHERE state = ANY($1) \
             AND ($2::TEXT IS NULL OR node = $2) ORDER BY created_at, id"
        );
        self.with(|c| rows(c.query(&sql, &[&states, &node])?, row))
    }

    /// Runs `f` on a pooled client, again if it lost a serialization race
    /// or a deadlock. A statement on the client is its own transaction.
    fn with<T>(&self, mut f: impl FnMut(&mut Client) -> Result<T>) -> Result<T> {
        blocking(|| {
            let mut lease = self.pool.lease()?;
            let mut tries = 0;
            loop {
                match f(lease.client()) {
                    Err(e) if retryable(&e) && tries < RETRIES => tries += 1,
                    r => return r,
                }
            }
        })
    }

    /// [`PgStore::with`] in one transaction, committed when `f` returns Ok.
    fn tx<T>(&self, mut f: impl FnMut(&mut Transaction<'_>) -> Result<T>) -> Result<T> {
        self.with(|c| {
            let mut t = c.transaction()?;
            let v = f(&mut t)?;
            t.commit()?;
            Ok(v)
        })
    }

    /// Runs SQL as it is, for tests that check what the database itself
    /// refuses.
    #[cfg(test)]
    pub(crate) fn raw_execute_for_tests(&self, sql: &str) -> std::result::Result<(), String> {
        self.with(|c| Ok(c.batch_execute(sql))).expect("connection").map_err(|e| format!("{e:?}"))
    }
}

// Rows.

fn text_enum<T>(r: &Row, idx: usize, what: &'static str, parse: impl Fn(&str) -> Option<T>) -> Result<T> {
    let value: String = r.try_get(idx)?;
    parse(&value).ok_or_else(|| StoreError::Corrupt { what, id: r.try_get(0).unwrap_or_default(), value })
}

fn opt_enum<T>(r: &Row, idx: usize, what: &'static str, parse: impl Fn(&str) -> Option<T>) -> Result<Option<T>> {
    match r.try_get::<_, Option<String>>(idx)? {
        None => Ok(None),
        Some(_) => text_enum(r, idx, what, parse).map(Some),
    }
}

fn uint(r: &Row, idx: usize) -> Result<u64> {
    Ok(r.try_get::<_, i64>(idx)?.max(0) as u64)
}

fn opt_uint(r: &Row, idx: usize) -> Result<Option<u64>> {
    Ok(r.try_get::<_, Option<i64>>(idx)?.map(|v| v.max(0) as u64))
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(|v| v.min(i64::MAX as u64) as i64)
}

fn rows<T>(rows: Vec<Row>, f: impl Fn(&Row) -> Result<T>) -> Result<Vec<T>> {
    rows.iter().map(f).collect()
}

fn sandbox_row(r: &Row) -> Result<SandboxRecord> {
    Ok(SandboxRecord {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        template: r.try_get(2)?,
        state: text_enum(r, 3, "sandbox state", SandboxState::parse)?,
        created_at: r.try_get(4)?,
        expires_at: r.try_get(5)?,
        max_expires_at: r.try_get(6)?,
        memory_mb: uint(r, 7)?,
        vcpus: r.try_get(8)?,
        disk_mib: uint(r, 9)?,
        pids: uint(r, 10)? as u32,
        env: r.try_get(11)?,
        metadata: r.try_get(12)?,
        limits_applied: r.try_get(13)?,
        last_error_code: r.try_get(14)?,
        host_pid: r.try_get(15)?,
        idempotency_key: r.try_get(16)?,
        request_hash: r.try_get(17)?,
        template_id: r.try_get(18)?,
        template_version: r.try_get(19)?,
        warm: r.try_get(20)?,
        pooled: r.try_get(21)?,
        network: r.try_get(22)?,
        storage: text_enum(r, 23, "sandbox storage", StorageKind::parse)?,
        origin: r.try_get(24)?,
        on_expire: text_enum(r, 25, "sandbox on_expire", OnExpire::parse)?,
        ttl_s: opt_uint(r, 26)?,
        paused_ttl_s: opt_uint(r, 27)?,
        class: text_enum(r, 28, "sandbox class", Class::parse)?,
        node: r.try_get(29)?,
        reason: r.try_get(30)?,
    })
}

fn brief_row(r: &Row) -> Result<SandboxBrief> {
    Ok(SandboxBrief {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        state: text_enum(r, 2, "sandbox state", SandboxState::parse)?,
        created_at: r.try_get(3)?,
        expires_at: r.try_get(4)?,
        memory_mb: uint(r, 5)?,
        vcpus: r.try_get(6)?,
        disk_mib: uint(r, 7)?,
        pooled: r.try_get(8)?,
        on_expire: text_enum(r, 9, "sandbox on_expire", OnExpire::parse)?,
    })
}

fn template_row(r: &Row) -> Result<TemplateRecord> {
    Ok(TemplateRecord {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        name: r.try_get(2)?,
        version: r.try_get(3)?,
        image: r.try_get(4)?,
        class: r.try_get(5)?,
        memory_mb: uint(r, 6)?,
        vcpus: r.try_get(7)?,
        disk_mib: uint(r, 8)?,
        pids: uint(r, 9)? as u32,
        env: r.try_get(10)?,
        default_ttl_s: uint(r, 11)?,
        max_ttl_s: uint(r, 12)?,
        warm_min: uint(r, 13)? as u32,
        warm_max: uint(r, 14)? as u32,
        created_at: r.try_get(15)?,
        updated_at: r.try_get(16)?,
        deleted_at: r.try_get(17)?,
        startup: r.try_get(18)?,
        readiness: r.try_get(19)?,
        network: r.try_get(20)?,
        storage: opt_enum(r, 21, "template storage", StorageKind::parse)?,
        on_expire: opt_enum(r, 22, "template on_expire", OnExpire::parse)?,
        paused_ttl_s: opt_uint(r, 23)?,
        idle_timeout_s: opt_uint(r, 24)?,
        on_idle: opt_enum(r, 25, "template on_idle", OnIdle::parse)?,
        secrets: r.try_get(26)?,
    })
}

/// A template's values in [`TEMPLATE_COLUMNS`] order.
fn template_values(t: &TemplateRecord) -> Vec<Box<dyn ToSql + Sync>> {
    vec![
        Box::new(t.id.clone()),
        Box::new(t.owner.clone()),
        Box::new(t.name.clone()),
        Box::new(t.version),
        Box::new(t.image.clone()),
        Box::new(t.class.clone()),
        Box::new(t.memory_mb as i64),
        Box::new(t.vcpus),
        Box::new(t.disk_mib as i64),
        Box::new(i64::from(t.pids)),
        Box::new(t.env.clone()),
        Box::new(t.default_ttl_s as i64),
        Box::new(t.max_ttl_s as i64),
        Box::new(i64::from(t.warm_min)),
        Box::new(i64::from(t.warm_max)),
        Box::new(t.created_at),
        Box::new(t.updated_at),
        Box::new(t.deleted_at),
        Box::new(t.startup.clone()),
        Box::new(t.readiness.clone()),
        Box::new(t.network.clone()),
        Box::new(t.storage.map(StorageKind::as_str)),
        Box::new(t.on_expire.map(OnExpire::as_str)),
        Box::new(opt_i64(t.paused_ttl_s)),
        Box::new(opt_i64(t.idle_timeout_s)),
        Box::new(t.on_idle.map(OnIdle::as_str)),
        Box::new(t.secrets.clone()),
    ]
}

fn params_of(values: &[Box<dyn ToSql + Sync>]) -> Vec<Param<'_>> {
    values.iter().map(|v| v.as_ref() as Param<'_>).collect()
}

fn build_row(r: &Row) -> Result<BuildRecord> {
    Ok(BuildRecord {
        id: r.try_get(0)?,
        template_id: r.try_get(1)?,
        owner: r.try_get(2)?,
        state: text_enum(r, 3, "build state", BuildState::parse)?,
        created_at: r.try_get(4)?,
        finished_at: r.try_get(5)?,
        error: r.try_get(6)?,
        parent: r.try_get(7)?,
        image: r.try_get(8)?,
        version: r.try_get(9)?,
        node: r.try_get::<_, Option<String>>(10)?.unwrap_or_default(),
    })
}

fn key_row(r: &Row) -> Result<KeyRecord> {
    Ok(KeyRecord {
        id: r.try_get(0)?,
        name: r.try_get(1)?,
        hash: r.try_get(2)?,
        admin: r.try_get(3)?,
        created_at: r.try_get(4)?,
        revoked_at: r.try_get(5)?,
        quotas: Quotas {
            sandboxes: opt_uint(r, 6)?,
            memory_mb: opt_uint(r, 7)?,
            disk_mib: opt_uint(r, 8)?,
            ttl_seconds: opt_uint(r, 9)?,
            builds: opt_uint(r, 10)?,
            snapshots: opt_uint(r, 11)?,
        },
    })
}

fn exec_row(r: &Row) -> Result<ExecRecord> {
    Ok(ExecRecord {
        scope: r.try_get(0)?,
        key: r.try_get(1)?,
        request_hash: r.try_get(2)?,
        state: text_enum(r, 3, "execution state", ExecState::parse)?,
        result: r.try_get(4)?,
        created_at: r.try_get(5)?,
    })
}

fn snapshot_row(r: &Row) -> Result<SnapshotRecord> {
    Ok(SnapshotRecord {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        name: r.try_get(2)?,
        sandbox_id: r.try_get(3)?,
        created_at: r.try_get(4)?,
        size_bytes: uint(r, 5)?,
        recipe: r.try_get(6)?,
    })
}

fn volume_row(r: &Row) -> Result<VolumeRecord> {
    Ok(VolumeRecord {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        name: r.try_get(2)?,
        size_mib: uint(r, 3)?,
        created_at: r.try_get(4)?,
        node: r.try_get(5)?,
    })
}

fn claim_row(r: &Row) -> Result<VolumeClaim> {
    Ok(VolumeClaim {
        volume_id: r.try_get(0)?,
        sandbox_id: r.try_get(1)?,
        path: r.try_get(2)?,
        read_only: r.try_get(3)?,
    })
}

fn secret_row(r: &Row) -> Result<SecretRecord> {
    Ok(SecretRecord {
        id: r.try_get(0)?,
        owner: r.try_get(1)?,
        name: r.try_get(2)?,
        hosts: r.try_get(3)?,
        header: r.try_get(4)?,
        format: r.try_get(5)?,
        metadata: r.try_get(6)?,
        version: r.try_get(7)?,
        sealed: r.try_get(8)?,
        created_at: r.try_get(9)?,
        updated_at: r.try_get(10)?,
    })
}

fn usage_row(r: &Row) -> Result<UsageInterval> {
    Ok(UsageInterval {
        owner: r.try_get(0)?,
        kind: text_enum(r, 1, "usage kind", UsageKind::parse)?,
        subject: r.try_get(2)?,
        sandbox_id: r.try_get(3)?,
        template: r.try_get(4)?,
        memory_mb: uint(r, 5)?,
        vcpus: r.try_get(6)?,
        size_bytes: uint(r, 7)?,
        start: r.try_get(8)?,
        end: r.try_get(9)?,
    })
}

fn webhook_row(r: &Row, first: usize) -> Result<WebhookRecord> {
    let events: String = r.try_get(first + 3)?;
    Ok(WebhookRecord {
        id: r.try_get(first)?,
        owner: r.try_get(first + 1)?,
        url: r.try_get(first + 2)?,
        events: parse_events(&events),
        secret: r.try_get(first + 4)?,
        created_at: r.try_get(first + 5)?,
        format: r.try_get(first + 6)?,
        name: r.try_get(first + 7)?,
        enabled: r.try_get(first + 8)?,
    })
}

fn delivery_row(r: &Row) -> Result<DeliveryRecord> {
    let status: String = r.try_get(5)?;
    Ok(DeliveryRecord {
        id: r.try_get(0)?,
        webhook_id: r.try_get(1)?,
        event_id: r.try_get(2)?,
        event_type: r.try_get(3)?,
        payload: r.try_get(4)?,
        status: DeliveryStatus::parse(&status).unwrap_or(DeliveryStatus::Failed),
        attempts: uint(r, 6)?.min(u64::from(u32::MAX)) as u32,
        created_at: r.try_get(7)?,
        next_at: r.try_get(8)?,
        last_at: r.try_get(9)?,
        last_status: opt_uint(r, 10)?.map(|v| v.min(u64::from(u16::MAX)) as u16),
        last_error: r.try_get(11)?,
    })
}

fn event_row(r: &Row) -> Result<EventRecord> {
    Ok(EventRecord {
        id: r.try_get(0)?,
        at: r.try_get(1)?,
        owner: r.try_get(2)?,
        kind: r.try_get(3)?,
        sandbox_id: r.try_get(4)?,
        body: r.try_get(5)?,
    })
}

// Reads and writes shared by several calls.

fn get_sandbox_in(c: &mut impl GenericClient, id: &str) -> Result<Option<SandboxRecord>> {
    c.query_opt(&format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1"), &[&id])?
        .map(|r| sandbox_row(&r))
        .transpose()
}

/// What sandboxes hold, volumes' sizes counted in `disk_mib`.
fn usage_in(c: &mut impl GenericClient, owner: Option<&str>) -> Result<Usage> {
    usage_of(c, owner, None)
}

/// What the sandboxes of `owner` (None: everyone's) on `node` (None: every
/// node) hold, with the owner's volumes.
fn usage_of(c: &mut impl GenericClient, owner: Option<&str>, node: Option<&str>) -> Result<Usage> {
    let r = c.query_one(
        &format!(
            "SELECT COUNT(*), COALESCE(SUM(memory_mb), 0)::BIGINT, (COALESCE(SUM(disk_mib), 0) \
             + (SELECT COALESCE(SUM(size_mib), 0) FROM volumes WHERE $1::TEXT IS NULL OR owner = $1))::BIGINT \
             FROM sandboxes WHERE state IN {HOLDING} AND ($1::TEXT IS NULL OR owner = $1) \
             AND ($2::TEXT IS NULL OR node = $2)"
        ),
        &[&owner, &node],
    )?;
    Ok(Usage { sandboxes: uint(&r, 0)?, memory_mb: uint(&r, 1)?, disk_mib: uint(&r, 2)? })
}

/// The volume a claim cannot take, if any (as the SQLite store's).
fn claim_conflict(c: &mut impl GenericClient, claim: &VolumeClaim) -> Result<Option<String>> {
    let r = c.query_one(
        &format!(
            "SELECT COUNT(*) FROM volume_mounts m JOIN sandboxes s ON s.id = m.sandbox_id \
             WHERE m.volume_id = $1 AND s.state IN {HOLDING} AND (NOT m.read_only OR NOT $2::BOOLEAN)"
        ),
        &[&claim.volume_id, &claim.read_only],
    )?;
    Ok((r.try_get::<_, i64>(0)? > 0).then(|| claim.volume_id.clone()))
}

/// Whether `asked` more MiB of disk fits under the host's and the owner's caps.
fn disk_fits(c: &mut impl GenericClient, owner: &str, admission: &Admission, asked: u64) -> Result<Option<Exceeded>> {
    let asked = Usage { sandboxes: 0, memory_mb: 0, disk_mib: asked };
    if let Some(e) = over(Scope::Host, &admission.host, usage_in(c, None)?, asked) {
        return Ok(Some(e));
    }
    Ok(over(Scope::Owner, &admission.owner, usage_in(c, Some(owner))?, asked))
}

fn insert_sandbox_in(c: &mut impl GenericClient, s: &SandboxRecord) -> Result<()> {
    c.execute(
        &format!("INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES ({})", marks(1, 31)),
        &[
            &s.id,
            &s.owner,
            &s.template,
            &s.state.as_str(),
            &s.created_at,
            &s.expires_at,
            &s.max_expires_at,
            &(s.memory_mb as i64),
            &s.vcpus,
            &(s.disk_mib as i64),
            &i64::from(s.pids),
            &s.env,
            &s.metadata,
            &s.limits_applied,
            &s.last_error_code,
            &s.host_pid,
            &s.idempotency_key,
            &s.request_hash,
            &s.template_id,
            &s.template_version,
            &s.warm,
            &s.pooled,
            &s.network,
            &s.storage.as_str(),
            &s.origin,
            &s.on_expire.as_str(),
            &opt_i64(s.ttl_s),
            &opt_i64(s.paused_ttl_s),
            &s.class.as_str(),
            &s.node,
            &s.reason,
        ],
    )
    .map_err(conflict)?;
    Ok(())
}

/// The state of `node` when it takes no new sandbox (draining or lost).
fn node_closed(c: &mut impl GenericClient, node: &str) -> Result<Option<NodeState>> {
    let row = c.query_opt("SELECT name, state FROM nodes WHERE name = $1", &[&node])?;
    let state = row.map(|r| text_enum(&r, 1, "node state", NodeState::parse)).transpose()?;
    Ok(state.filter(|s| *s != NodeState::Active))
}

fn open_interval(c: &mut impl GenericClient, subject: &str) -> Result<Option<(i64, UsageInterval)>> {
    c.query_opt(
        &format!("SELECT {USAGE_COLUMNS}, id FROM usage_intervals WHERE subject = $1 AND end_ms IS NULL"),
        &[&subject],
    )?
    .map(|r| Ok((r.try_get(10)?, usage_row(&r)?)))
    .transpose()
}

/// Adds `r`'s figures to `owner`'s running totals.
fn add_totals(t: &mut Transaction<'_>, owner: &str, r: &UsageRow) -> Result<()> {
    let v = totals_values(r);
    t.execute(
        &format!("INSERT INTO usage_totals ({TOTALS_COLUMNS}) VALUES ({}) {TOTALS_ADD}", marks(1, 9)),
        &[&owner, &v.0, &v.1, &v.2, &v.3, &v.4, &v.5, &v.6, &v.7],
    )?;
    Ok(())
}

/// A sandbox's usage interval follows its record, in the transaction
/// that wrote the record, when the caller asked for it (`at`). A mark
/// that fails (a ledger row the store cannot read) is logged and undone
/// alone, within a savepoint: metering never blocks a state change.
fn mark_sandbox_in(t: &mut Transaction<'_>, sb: &SandboxRecord, at: Option<i64>) -> Result<()> {
    let Some(at) = at else { return Ok(()) };
    let mut sp = t.savepoint("usage_mark")?;
    match mark_in(&mut sp, &sb.id, UsageInterval::of_sandbox(sb, at).as_ref(), at) {
        Ok(()) => sp.commit()?,
        // The whole transaction is tried again (`with`).
        Err(e) if retryable(&e) => return Err(e),
        // Dropped uncommitted: rolled back to the savepoint.
        Err(e) => tracing::warn!("usage: sandbox {}: {e}", sb.id),
    }
    Ok(())
}

/// Replaces `subject`'s open interval by `open` (None: ends it) at `at`,
/// unless it already bills alike; under the subject's lock.
fn mark_in(t: &mut Transaction<'_>, subject: &str, open: Option<&UsageInterval>, at: i64) -> Result<()> {
    lock_xact(t, lock::USAGE, subject)?;
    let current = open_interval(t, subject)?;
    match (&current, open) {
        (Some((_, cur)), Some(new)) if bills_alike(cur, new) => return Ok(()),
        (None, None) => return Ok(()),
        _ => {}
    }
    let mut start = at;
    if let Some((id, cur)) = &current {
        t.execute("UPDATE usage_intervals SET end_ms = GREATEST(start_ms, $2) WHERE id = $1", &[id, &at])?;
        let mut measured = UsageRow::default();
        measured.charge(cur, cur.start, at);
        add_totals(t, &cur.owner, &measured)?;
        start = at.max(cur.start);
    }
    if let Some(i) = open {
        t.execute(
            &format!("INSERT INTO usage_intervals ({USAGE_COLUMNS}) VALUES ({})", marks(1, 10)),
            &[
                &i.owner,
                &i.kind.as_str(),
                &i.subject,
                &i.sandbox_id,
                &i.template,
                &(i.memory_mb as i64),
                &i.vcpus,
                &(i.size_bytes.min(i64::MAX as u64) as i64),
                &start,
                &None::<i64>,
            ],
        )?;
    }
    Ok(())
}

impl QuickReads for PgStore {
    fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE hash = $1"), &[&hash])?
                .map(|r| key_row(&r))
                .transpose()
        })
    }

    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.with(|c| get_sandbox_in(c, id))
    }

    fn template_by_name(&self, owner: &str, name: &str) -> Result<Option<TemplateRecord>> {
        self.with(|c| {
            c.query_opt(
                &format!(
                    "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE owner = $1 AND name = $2 AND deleted_at IS NULL"
                ),
                &[&owner, &name],
            )?
            .map(|r| template_row(&r))
            .transpose()
        })
    }
}

impl Store for PgStore {
    fn insert_key(&self, k: &KeyRecord) -> Result<()> {
        self.with(|c| insert_key(c, k))
    }

    fn insert_first_key(&self, k: &KeyRecord) -> Result<bool> {
        self.tx(|t| {
            // Daemons starting together on an empty database: the second
            // holder of the lock counts the first one's key.
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::KEYS])?;
            if uint(&t.query_one("SELECT COUNT(*) FROM api_keys", &[])?, 0)? > 0 {
                return Ok(false);
            }
            insert_key(t, k)?;
            Ok(true)
        })
    }

    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1"), &[&id])?
                .map(|r| key_row(&r))
                .transpose()
        })
    }

    fn list_keys(&self) -> Result<Vec<KeyRecord>> {
        self.with(|c| {
            rows(c.query(&format!("SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"), &[])?, key_row)
        })
    }

    fn revoke_key(&self, id: &str, at: i64) -> Result<bool> {
        self.with(|c| {
            Ok(c.execute("UPDATE api_keys SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL", &[&id, &at])? == 1)
        })
    }

    fn set_sandbox_idle(&self, id: &str, timeout_s: u64, on_idle: &str) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET idle_timeout_s = $2, on_idle = $3 WHERE id = $1",
                &[&id, &(timeout_s.min(i64::MAX as u64) as i64), &on_idle],
            )?;
            Ok(())
        })
    }

    fn sandbox_idle_all(&self, node: Option<&str>) -> Result<Vec<(String, u64, String)>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT id, idle_timeout_s, COALESCE(on_idle, 'pause') FROM sandboxes \
                         WHERE idle_timeout_s IS NOT NULL AND state IN {HOLDING} AND ($1::TEXT IS NULL OR node = $1)"
                    ),
                    &[&node],
                )?,
                |r| Ok((r.try_get(0)?, uint(r, 1)?, r.try_get(2)?)),
            )
        })
    }

    fn grant_secret(&self, id: &str) -> Result<Option<Option<String>>> {
        self.with(|c| {
            c.query_opt("SELECT grant_secret FROM api_keys WHERE id = $1 AND revoked_at IS NULL", &[&id])?
                .map(|r| Ok(r.try_get(0)?))
                .transpose()
        })
    }

    fn set_grant_secret(&self, id: &str, secret: &str, only_if_unset: bool) -> Result<bool> {
        self.with(|c| {
            let sql = if only_if_unset {
                "UPDATE api_keys SET grant_secret = $2 WHERE id = $1 AND revoked_at IS NULL AND grant_secret IS NULL"
            } else {
                "UPDATE api_keys SET grant_secret = $2 WHERE id = $1 AND revoked_at IS NULL"
            };
            Ok(c.execute(sql, &[&id, &secret])? == 1)
        })
    }

    fn set_quotas(&self, id: &str, q: &Quotas) -> Result<bool> {
        self.with(|c| {
            let n = c.execute(
                "UPDATE api_keys SET max_sandboxes = $2, max_memory_mb = $3, max_disk_mib = $4, \
                 max_ttl_seconds = $5, max_builds = $6, max_snapshots = $7 WHERE id = $1 AND revoked_at IS NULL",
                &[
                    &id,
                    &opt_i64(q.sandboxes),
                    &opt_i64(q.memory_mb),
                    &opt_i64(q.disk_mib),
                    &opt_i64(q.ttl_seconds),
                    &opt_i64(q.builds),
                    &opt_i64(q.snapshots),
                ],
            )?;
            Ok(n == 1)
        })
    }

    fn count_keys(&self) -> Result<u64> {
        self.with(|c| uint(&c.query_one("SELECT COUNT(*) FROM api_keys", &[])?, 0))
    }

    fn insert_sandbox_claiming(
        &self,
        s: &SandboxRecord,
        admission: &Admission,
        claims: &[VolumeClaim],
        usage_at: Option<i64>,
    ) -> Result<Admitted> {
        self.tx(|t| {
            // One admission at a time: the counts read below include what
            // the last holder of the lock inserted.
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::ADMISSION])?;
            if let Some(closed) = node_closed(t, &s.node)? {
                return Ok(Admitted::NodeClosed(closed));
            }
            let asked = Usage { sandboxes: 1, memory_mb: s.memory_mb, disk_mib: s.disk_mib };
            // The host's caps count its own node's sandboxes.
            if let Some(e) = over(Scope::Host, &admission.host, usage_of(t, None, Some(&s.node))?, asked) {
                return Ok(Admitted::Refused(e));
            }
            if let Some(e) = over(Scope::Owner, &admission.owner, usage_in(t, Some(&s.owner))?, asked) {
                return Ok(Admitted::Refused(e));
            }
            for claim in claims {
                if t.query_opt("SELECT 1 FROM volumes WHERE id = $1", &[&claim.volume_id])?.is_none() {
                    return Ok(Admitted::VolumeGone(claim.volume_id.clone()));
                }
                if let Some(busy) = claim_conflict(t, claim)? {
                    return Ok(Admitted::VolumeInUse(busy));
                }
            }
            insert_sandbox_in(t, s)?;
            for claim in claims {
                t.execute(
                    "INSERT INTO volume_mounts (volume_id, sandbox_id, path, read_only) VALUES ($1, $2, $3, $4)",
                    &[&claim.volume_id, &claim.sandbox_id, &claim.path, &claim.read_only],
                )
                .map_err(conflict)?;
            }
            mark_sandbox_in(t, s, usage_at)?;
            Ok(Admitted::Inserted)
        })
    }

    fn sandbox_by_key(&self, owner: &str, key: &str) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            c.query_opt(
                &format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE owner = $1 AND idempotency_key = $2"),
                &[&owner, &key],
            )?
            .map(|r| sandbox_row(&r))
            .transpose()
        })
    }

    fn transition(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        ch: &Changes<'_>,
    ) -> Result<Option<SandboxRecord>> {
        if from.is_empty() {
            return Ok(None);
        }
        let states: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        self.tx(|t| {
            let moved = t
                .query_opt(
                    &format!(
                        "UPDATE sandboxes SET state = $2, \
                         last_error_code = COALESCE($3, last_error_code), host_pid = COALESCE($4, host_pid), \
                         limits_applied = COALESCE($5, limits_applied), network = COALESCE($6, network) \
                         WHERE id = $1 AND state = ANY($7) AND ($8::text IS NULL OR node = $8) \
                         RETURNING {SANDBOX_COLUMNS}"
                    ),
                    &[
                        &id,
                        &to.as_str(),
                        &ch.last_error_code,
                        &ch.host_pid,
                        &ch.limits_applied,
                        &ch.network,
                        &states,
                        &ch.on_node,
                    ],
                )?
                .map(|r| sandbox_row(&r))
                .transpose()?;
            if let Some(r) = &moved {
                mark_sandbox_in(t, r, ch.usage_at)?;
            }
            Ok(moved)
        })
    }

    fn set_expiry(
        &self,
        id: &str,
        expires_at: i64,
        raise_max: bool,
        states: &[SandboxState],
    ) -> Result<Option<SandboxRecord>> {
        if states.is_empty() {
            return Ok(None);
        }
        let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
        let set = if raise_max {
            "expires_at = $2, max_expires_at = GREATEST(max_expires_at, $2)"
        } else {
            "expires_at = $2"
        };
        self.with(|c| {
            c.query_opt(
                &format!("UPDATE sandboxes SET {set} WHERE id = $1 AND state = ANY($3) RETURNING {SANDBOX_COLUMNS}"),
                &[&id, &expires_at, &states],
            )?
            .map(|r| sandbox_row(&r))
            .transpose()
        })
    }

    fn set_network(&self, id: &str, json: &str) -> Result<()> {
        self.with(|c| {
            c.execute("UPDATE sandboxes SET network = $2 WHERE id = $1", &[&id, &json])?;
            Ok(())
        })
    }

    fn set_net_learned(&self, id: &str, json: &str) -> Result<()> {
        self.with(|c| {
            c.execute("UPDATE sandboxes SET net_learned = $2 WHERE id = $1", &[&id, &json])?;
            Ok(())
        })
    }

    fn net_learned(&self, id: &str) -> Result<String> {
        self.with(|c| {
            Ok(match c.query_opt("SELECT net_learned FROM sandboxes WHERE id = $1", &[&id])? {
                Some(r) => r.try_get(0)?,
                None => "[]".into(),
            })
        })
    }

    fn list_sandboxes(
        &self,
        owner: Option<&str>,
        after: Option<(i64, &str)>,
        limit: u32,
        live: bool,
    ) -> Result<Vec<SandboxRecord>> {
        let (ts, id) = after.unwrap_or((i64::MAX, ""));
        let sql = format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE ($1::TEXT IS NULL OR owner = $1) AND NOT pooled \
             AND (created_at < $2 OR (created_at = $2 AND id < $3) OR $4::BOOLEAN) \
             AND (NOT $6::BOOLEAN OR state <> $7) ORDER BY created_at DESC, id DESC LIMIT $5"
        );
        let ended = SandboxState::Terminated.as_str();
        self.with(|c| {
            rows(c.query(&sql, &[&owner, &ts, &id, &after.is_none(), &i64::from(limit), &live, &ended])?, sandbox_row)
        })
    }

    fn sandboxes_on(&self, node: Option<&str>, states: &[SandboxState]) -> Result<Vec<SandboxRecord>> {
        self.sandboxes_with(SANDBOX_COLUMNS, node, states, sandbox_row)
    }

    fn briefs_on(&self, node: Option<&str>, states: &[SandboxState]) -> Result<Vec<SandboxBrief>> {
        self.sandboxes_with(BRIEF_COLUMNS, node, states, brief_row)
    }

    fn count_by_state(&self) -> Result<Vec<(SandboxState, u64)>> {
        self.with(|c| {
            // Live sandboxes by the state index; ended ones by the counts
            // the triggers of migration 0012 keep, not by their rows.
            let sql = format!(
                "SELECT state, COUNT(*) FROM sandboxes WHERE state IN {HOLDING} GROUP BY state \
                 UNION ALL SELECT state, n FROM sandboxes_ended"
            );
            rows(c.query(&sql, &[])?, |r| Ok((text_enum(r, 0, "sandbox state", SandboxState::parse)?, uint(r, 1)?)))
        })
    }

    fn usage(&self, owner: Option<&str>) -> Result<Usage> {
        self.with(|c| usage_in(c, owner))
    }

    fn begin_exec(&self, scope: &str, key: &str, request_hash: &str, now: i64, node: &str) -> Result<Begin> {
        self.tx(|t| {
            // A key released meanwhile is taken again: at most twice.
            for _ in 0..2 {
                let taken = t.execute(
                    "INSERT INTO executions (scope, key, request_hash, state, result, created_at, node) \
                     VALUES ($1, $2, $3, 'running', NULL, $4, $5) ON CONFLICT (scope, key) DO NOTHING",
                    &[&scope, &key, &request_hash, &now, &node],
                )?;
                if taken == 1 {
                    return Ok(Begin::Started);
                }
                if let Some(r) = t.query_opt(
                    "SELECT scope, key, request_hash, state, result, created_at FROM executions \
                     WHERE scope = $1 AND key = $2",
                    &[&scope, &key],
                )? {
                    return Ok(Begin::Existing(exec_row(&r)?));
                }
            }
            Err(StoreError::Conflict)
        })
    }

    fn finish_exec(&self, scope: &str, key: &str, result: &str) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE executions SET state = 'done', result = $3 WHERE scope = $1 AND key = $2",
                &[&scope, &key, &result],
            )?;
            Ok(())
        })
    }

    fn release_exec(&self, scope: &str, key: &str) -> Result<()> {
        self.with(|c| {
            c.execute("DELETE FROM executions WHERE scope = $1 AND key = $2 AND state = 'running'", &[&scope, &key])?;
            Ok(())
        })
    }

    fn mark_running_execs_lost(&self, node: &str) -> Result<u64> {
        self.with(|c| {
            let sql = "UPDATE executions SET state = 'lost' WHERE state = 'running' AND (node = $1 OR node IS NULL)";
            Ok(c.execute(sql, &[&node])?)
        })
    }

    fn insert_template(&self, t: &TemplateRecord) -> Result<()> {
        let values = template_values(t);
        let sql = format!("INSERT INTO templates ({TEMPLATE_COLUMNS}) VALUES ({})", marks(1, values.len()));
        self.with(|c| {
            c.execute(&sql, &params_of(&values)).map_err(conflict)?;
            Ok(())
        })
    }

    fn get_template(&self, id: &str) -> Result<Option<TemplateRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {TEMPLATE_COLUMNS} FROM templates WHERE id = $1"), &[&id])?
                .map(|r| template_row(&r))
                .transpose()
        })
    }

    fn list_templates(&self, owner: Option<&str>) -> Result<Vec<TemplateRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE ($1::TEXT IS NULL OR owner = $1) \
                         AND deleted_at IS NULL ORDER BY created_at, id"
                    ),
                    &[&owner],
                )?,
                template_row,
            )
        })
    }

    fn update_template(&self, t: &TemplateRecord, updated_at: i64) -> Result<bool> {
        let mut values = template_values(t);
        let n = values.len();
        values.push(Box::new(updated_at));
        // Every column (the list an insert writes), if the row is still
        // the version that was read.
        let sql = format!(
            "UPDATE templates SET ({TEMPLATE_COLUMNS}) = ({}) WHERE id = $1 AND updated_at = ${} AND deleted_at IS NULL",
            marks(1, n),
            n + 1
        );
        self.with(|c| Ok(c.execute(&sql, &params_of(&values)).map_err(conflict)? == 1))
    }

    fn claim_warm(&self, cl: &Claim<'_>) -> Result<Option<SandboxRecord>> {
        self.tx(|t| {
            // A draining node's pool is drained; a claim racing the drain
            // takes nothing (the insert that follows is refused).
            if node_closed(t, cl.node)?.is_some() {
                return Ok(None);
            }
            // The template's row first: no new version commits until this
            // claim does, and the version read below is the latest.
            if t.query_opt("SELECT 1 FROM templates WHERE id = $1 FOR SHARE", &[&cl.template_id])?.is_none() {
                return Ok(None);
            }
            let Some(row) = t.query_opt(
                "SELECT s.id FROM sandboxes s JOIN templates t ON t.id = s.template_id \
                 WHERE s.pooled AND s.state = 'running' AND s.template_id = $1 AND s.owner = $2 \
                 AND t.deleted_at IS NULL AND s.template_version = t.version AND s.storage = $3 \
                 AND s.node = $4 ORDER BY s.created_at, s.id LIMIT 1 FOR UPDATE OF s SKIP LOCKED",
                &[&cl.template_id, &cl.owner, &cl.storage.as_str(), &cl.node],
            )?
            else {
                return Ok(None);
            };
            let id: String = row.try_get(0)?;
            let claimed = t
                .query_opt(
                    &format!(
                        "UPDATE sandboxes SET pooled = FALSE, created_at = $2, expires_at = $3, max_expires_at = $4, \
                         metadata = $5, idempotency_key = $6, request_hash = $7, on_expire = $8, ttl_s = $9, \
                         paused_ttl_s = $10 WHERE id = $1 RETURNING {SANDBOX_COLUMNS}"
                    ),
                    &[
                        &id,
                        &cl.now,
                        &cl.expires_at,
                        &cl.max_expires_at,
                        &cl.metadata,
                        &cl.idempotency_key,
                        &cl.request_hash,
                        &cl.on_expire.as_str(),
                        &opt_i64(cl.ttl_s),
                        &opt_i64(cl.paused_ttl_s),
                    ],
                )
                .map_err(conflict)?
                .map(|r| sandbox_row(&r))
                .transpose()?;
            if let Some(r) = &claimed {
                mark_sandbox_in(t, r, Some(cl.now))?;
            }
            Ok(claimed)
        })
    }

    fn drain_pooled(&self, id: &str) -> Result<bool> {
        self.with(|c| {
            Ok(c.execute(
                "UPDATE sandboxes SET state = 'terminating', last_error_code = 'warm_pool_drained' \
                 WHERE id = $1 AND pooled AND state = 'running'",
                &[&id],
            )? == 1)
        })
    }

    fn pooled_sandboxes(&self, node: Option<&str>) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE pooled AND state IN {HOLDING} \
                         AND ($1::TEXT IS NULL OR node = $1) ORDER BY created_at, id"
                    ),
                    &[&node],
                )?,
                sandbox_row,
            )
        })
    }

    fn insert_snapshot(&self, snap: &SnapshotRecord, max: Option<u64>) -> Result<bool> {
        self.tx(|t| {
            if let Some(max) = max {
                lock_xact(t, lock::SNAPSHOTS, &snap.owner)?;
                let n = uint(&t.query_one("SELECT COUNT(*) FROM snapshots WHERE owner = $1", &[&snap.owner])?, 0)?;
                if n >= max {
                    return Ok(false);
                }
            }
            t.execute(
                &format!("INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES ({})", marks(1, 7)),
                &[
                    &snap.id,
                    &snap.owner,
                    &snap.name,
                    &snap.sandbox_id,
                    &snap.created_at,
                    &(snap.size_bytes.min(i64::MAX as u64) as i64),
                    &snap.recipe,
                ],
            )
            .map_err(conflict)?;
            Ok(true)
        })
    }

    fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = $1"), &[&id])?
                .map(|r| snapshot_row(&r))
                .transpose()
        })
    }

    fn snapshot_by_name(&self, owner: &str, name: &str) -> Result<Option<SnapshotRecord>> {
        self.with(|c| {
            c.query_opt(
                &format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE owner = $1 AND name = $2"),
                &[&owner, &name],
            )?
            .map(|r| snapshot_row(&r))
            .transpose()
        })
    }

    fn list_snapshots(&self, owner: Option<&str>) -> Result<Vec<SnapshotRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE $1::TEXT IS NULL OR owner = $1 \
                         ORDER BY created_at DESC, id"
                    ),
                    &[&owner],
                )?,
                snapshot_row,
            )
        })
    }

    fn delete_snapshot(&self, id: &str) -> Result<bool> {
        self.with(|c| Ok(c.execute("DELETE FROM snapshots WHERE id = $1", &[&id])? == 1))
    }

    fn insert_volume(&self, v: &VolumeRecord, admission: &Admission) -> Result<VolumeAdmitted> {
        self.tx(|t| {
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::ADMISSION])?;
            if let Some(e) = disk_fits(t, &v.owner, admission, v.size_mib)? {
                return Ok(VolumeAdmitted::Refused(e));
            }
            t.execute(
                &format!("INSERT INTO volumes ({VOLUME_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)"),
                &[&v.id, &v.owner, &v.name, &(v.size_mib.min(i64::MAX as u64) as i64), &v.created_at, &v.node],
            )
            .map_err(conflict)?;
            Ok(VolumeAdmitted::Written)
        })
    }

    fn get_volume(&self, id: &str) -> Result<Option<VolumeRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = $1"), &[&id])?
                .map(|r| volume_row(&r))
                .transpose()
        })
    }

    fn volume_by_name(&self, owner: &str, name: &str) -> Result<Option<VolumeRecord>> {
        self.with(|c| {
            c.query_opt(
                &format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE owner = $1 AND name = $2"),
                &[&owner, &name],
            )?
            .map(|r| volume_row(&r))
            .transpose()
        })
    }

    fn list_volumes(&self, owner: Option<&str>) -> Result<Vec<VolumeRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {VOLUME_COLUMNS} FROM volumes WHERE $1::TEXT IS NULL OR owner = $1 \
                         ORDER BY created_at, id"
                    ),
                    &[&owner],
                )?,
                volume_row,
            )
        })
    }

    fn resize_volume(&self, id: &str, size_mib: u64, admission: &Admission) -> Result<Option<VolumeAdmitted>> {
        self.tx(|t| {
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::ADMISSION])?;
            let Some(v) = t
                .query_opt(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = $1"), &[&id])?
                .map(|r| volume_row(&r))
                .transpose()?
            else {
                return Ok(None);
            };
            if let Some(e) = disk_fits(t, &v.owner, admission, size_mib.saturating_sub(v.size_mib))? {
                return Ok(Some(VolumeAdmitted::Refused(e)));
            }
            t.execute(
                "UPDATE volumes SET size_mib = $2 WHERE id = $1",
                &[&id, &(size_mib.min(i64::MAX as u64) as i64)],
            )?;
            Ok(Some(VolumeAdmitted::Written))
        })
    }

    fn delete_volume(&self, id: &str) -> Result<VolumeDeleted> {
        self.tx(|t| {
            // Claims are made under this lock: none can start meanwhile.
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::ADMISSION])?;
            if let Some(r) = t.query_opt(
                &format!(
                    "SELECT m.sandbox_id FROM volume_mounts m JOIN sandboxes s ON s.id = m.sandbox_id \
                     WHERE m.volume_id = $1 AND s.state IN {HOLDING} LIMIT 1"
                ),
                &[&id],
            )? {
                return Ok(VolumeDeleted::InUse(r.try_get(0)?));
            }
            t.execute("DELETE FROM volume_mounts WHERE volume_id = $1", &[&id])?;
            let n = t.execute("DELETE FROM volumes WHERE id = $1", &[&id])?;
            Ok(if n == 1 { VolumeDeleted::Deleted } else { VolumeDeleted::NotFound })
        })
    }

    fn volume_claims(&self, sandbox_id: &str) -> Result<Vec<VolumeClaim>> {
        self.with(|c| {
            rows(
                c.query(
                    "SELECT volume_id, sandbox_id, path, read_only FROM volume_mounts WHERE sandbox_id = $1 \
                     ORDER BY path",
                    &[&sandbox_id],
                )?,
                claim_row,
            )
        })
    }

    fn volume_holders(&self, volume_id: &str) -> Result<Vec<VolumeClaim>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT m.volume_id, m.sandbox_id, m.path, m.read_only FROM volume_mounts m \
                         JOIN sandboxes s ON s.id = m.sandbox_id WHERE m.volume_id = $1 AND s.state IN {HOLDING} \
                         ORDER BY s.created_at, s.id"
                    ),
                    &[&volume_id],
                )?,
                claim_row,
            )
        })
    }

    fn volume_usage(&self, owner: Option<&str>) -> Result<(u64, u64)> {
        self.with(|c| {
            let r = c.query_one(
                "SELECT COUNT(*), COALESCE(SUM(size_mib), 0)::BIGINT FROM volumes WHERE $1::TEXT IS NULL OR owner = $1",
                &[&owner],
            )?;
            Ok((uint(&r, 0)?, uint(&r, 1)?))
        })
    }

    fn insert_build(&self, b: &BuildRecord, max_running: Option<u64>) -> Result<bool> {
        self.tx(|t| {
            if let Some(max) = max_running {
                lock_xact(t, lock::BUILDS, &b.owner)?;
                let n = uint(
                    &t.query_one(
                        "SELECT COUNT(*) FROM builds WHERE state IN ('queued', 'building') AND owner = $1",
                        &[&b.owner],
                    )?,
                    0,
                )?;
                if n >= max {
                    return Ok(false);
                }
            }
            t.execute(
                &format!("INSERT INTO builds ({BUILD_COLUMNS}) VALUES ({})", marks(1, 11)),
                &[
                    &b.id,
                    &b.template_id,
                    &b.owner,
                    &b.state.as_str(),
                    &b.created_at,
                    &b.finished_at,
                    &b.error,
                    &b.parent,
                    &b.image,
                    &b.version,
                    &b.node,
                ],
            )
            .map_err(conflict)?;
            Ok(true)
        })
    }

    fn update_build(&self, b: &BuildRecord, from: &[BuildState]) -> Result<bool> {
        if from.is_empty() {
            return Ok(false);
        }
        let states: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        self.with(|c| {
            Ok(c.execute(
                "UPDATE builds SET state = $2, finished_at = $3, error = $4, image = $5, version = $6 \
                 WHERE id = $1 AND state = ANY($7)",
                &[&b.id, &b.state.as_str(), &b.finished_at, &b.error, &b.image, &b.version, &states],
            )? == 1)
        })
    }

    fn get_build(&self, id: &str) -> Result<Option<BuildRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {BUILD_COLUMNS} FROM builds WHERE id = $1"), &[&id])?
                .map(|r| build_row(&r))
                .transpose()
        })
    }

    fn list_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {BUILD_COLUMNS} FROM builds WHERE template_id = $1 \
                         ORDER BY created_at DESC, id DESC LIMIT 100"
                    ),
                    &[&template_id],
                )?,
                build_row,
            )
        })
    }

    fn count_running_builds(&self, owner: Option<&str>) -> Result<u64> {
        self.with(|c| {
            uint(
                &c.query_one(
                    "SELECT COUNT(*) FROM builds WHERE state IN ('queued', 'building') \
                     AND ($1::TEXT IS NULL OR owner = $1)",
                    &[&owner],
                )?,
                0,
            )
        })
    }

    fn fail_unfinished_builds(&self, node: &str, now: i64, error: &str) -> Result<u64> {
        self.with(|c| {
            Ok(c.execute(
                "UPDATE builds SET state = 'failed', finished_at = $1, error = $2 \
                 WHERE state IN ('queued', 'building') AND (node = $3 OR node IS NULL OR node = '')",
                &[&now, &error, &node],
            )?)
        })
    }

    fn insert_secret(&self, s: &SecretRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                &format!("INSERT INTO secrets ({SECRET_COLUMNS}) VALUES ({})", marks(1, 11)),
                &[
                    &s.id,
                    &s.owner,
                    &s.name,
                    &s.hosts,
                    &s.header,
                    &s.format,
                    &s.metadata,
                    &s.version,
                    &s.sealed,
                    &s.created_at,
                    &s.updated_at,
                ],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn secret_by_name(&self, owner: &str, name: &str) -> Result<Option<SecretRecord>> {
        self.with(|c| {
            c.query_opt(
                &format!("SELECT {SECRET_COLUMNS} FROM secrets WHERE owner = $1 AND name = $2"),
                &[&owner, &name],
            )?
            .map(|r| secret_row(&r))
            .transpose()
        })
    }

    fn list_secrets(&self, owner: Option<&str>) -> Result<Vec<SecretRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {SECRET_COLUMNS} FROM secrets WHERE $1::TEXT IS NULL OR owner = $1 ORDER BY owner, name"
                    ),
                    &[&owner],
                )?,
                secret_row,
            )
        })
    }

    fn update_secret(&self, s: &SecretRecord) -> Result<bool> {
        self.with(|c| {
            Ok(c.execute(
                "UPDATE secrets SET hosts = $2, header = $3, format = $4, metadata = $5, version = $6, sealed = $7, \
                 updated_at = $8 WHERE id = $1",
                &[&s.id, &s.hosts, &s.header, &s.format, &s.metadata, &s.version, &s.sealed, &s.updated_at],
            )? == 1)
        })
    }

    fn delete_secret(&self, owner: &str, name: &str) -> Result<bool> {
        self.with(|c| Ok(c.execute("DELETE FROM secrets WHERE owner = $1 AND name = $2", &[&owner, &name])? == 1))
    }

    fn append_audit(&self, rows: &[AuditRecord]) -> Result<()> {
        self.tx(|t| {
            let st = t.prepare(
                "INSERT INTO audit (at, key_id, key_name, method, route, targets, client, status, error_code) \
                 VALUES ($1, $2, COALESCE((SELECT name FROM api_keys WHERE id = $2), ''), $3, $4, $5, $6, $7, $8)",
            )?;
            for r in rows {
                t.execute(
                    &st,
                    &[
                        &r.at,
                        &r.key_id,
                        &r.method,
                        &r.route,
                        &r.targets,
                        &r.client,
                        &i64::from(r.status),
                        &r.error_code,
                    ],
                )?;
            }
            Ok(())
        })
    }

    fn list_audit(&self, q: &AuditQuery) -> Result<Vec<AuditRecord>> {
        let mut sql = String::from(
            "SELECT seq, at, key_id, key_name, method, route, targets, client, status, error_code FROM audit WHERE TRUE",
        );
        let mut args: Vec<Box<dyn ToSql + Sync>> = Vec::new();
        let mut arg = |cond: &str, v: Box<dyn ToSql + Sync>| {
            args.push(v);
            sql.push_str(&format!(" AND {cond} ${}", args.len()));
        };
        if let Some(k) = &q.key {
            arg("key_id =", Box::new(k.clone()));
        }
        if let Some(f) = q.from {
            arg("at >=", Box::new(f));
        }
        if let Some(t) = q.to {
            arg("at <=", Box::new(t));
        }
        if let Some(b) = q.before {
            arg("seq <", Box::new(b));
        }
        args.push(Box::new(i64::from(q.limit)));
        sql.push_str(&format!(" ORDER BY seq DESC LIMIT ${}", args.len()));
        self.with(|c| {
            rows(c.query(&sql, &params_of(&args))?, |r| {
                Ok(AuditRecord {
                    seq: r.try_get(0)?,
                    at: r.try_get(1)?,
                    key_id: r.try_get(2)?,
                    key_name: r.try_get(3)?,
                    method: r.try_get(4)?,
                    route: r.try_get(5)?,
                    targets: r.try_get(6)?,
                    client: r.try_get(7)?,
                    status: uint(r, 8)?.min(u64::from(u16::MAX)) as u16,
                    error_code: r.try_get(9)?,
                })
            })
        })
    }

    fn prune_audit(&self, before: i64) -> Result<u64> {
        self.with(|c| Ok(c.execute("DELETE FROM audit WHERE at < $1", &[&before])?))
    }

    fn last_event_id(&self) -> Result<i64> {
        self.with(|c| Ok(c.query_one("SELECT COALESCE(MAX(id), 0) FROM events", &[])?.try_get(0)?))
    }

    fn append_events(&self, rows: &mut [EventRecord]) -> Result<u64> {
        let (ids, made) = self.tx(|t| {
            // Ids are taken and committed under one lock, so they commit in
            // their order: a reader that sees an id sees every lower one
            // (the lock is released after the commit is visible).
            t.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&lock::EVENTS])?;
            let ev = t.prepare(
                "INSERT INTO events (at, owner, type, sandbox_id, body) VALUES ($1, $2, $3, $4, $5) RETURNING id",
            )?;
            // The owner's enabled webhooks that want this type (`*` or the
            // type itself).
            let dl = t.prepare(
                "INSERT INTO webhook_deliveries (webhook_id, event_id, event_type, payload, status, attempts, \
                 created_at, next_at) SELECT w.id, $1, $2, $3, 'pending', 0, $4, $4 FROM webhooks w \
                 WHERE w.owner = $5 AND w.enabled AND EXISTS (SELECT 1 FROM \
                 jsonb_array_elements_text(w.events::jsonb) e(v) WHERE e.v = '*' OR e.v = $2)",
            )?;
            let mut made = 0;
            let mut ids = Vec::with_capacity(rows.len());
            for r in rows.iter() {
                let id: i64 = t.query_one(&ev, &[&r.at, &r.owner, &r.kind, &r.sandbox_id, &r.body])?.try_get(0)?;
                made += t.execute(&dl, &[&id, &r.kind, &r.body, &r.at, &r.owner])?;
                ids.push(id);
            }
            Ok((ids, made))
        })?;
        for (r, id) in rows.iter_mut().zip(ids) {
            r.id = id;
        }
        Ok(made)
    }

    fn list_events(&self, q: &EventQuery) -> Result<Vec<EventRecord>> {
        let mut sql = String::from("SELECT id, at, owner, type, sandbox_id, body FROM events WHERE TRUE");
        let mut args: Vec<Box<dyn ToSql + Sync>> = Vec::new();
        let mut arg = |sql: &mut String, cond: &str, v: Box<dyn ToSql + Sync>| {
            args.push(v);
            sql.push_str(&format!(" AND {cond} ${}", args.len()));
        };
        if let Some(o) = &q.owner {
            arg(&mut sql, "owner =", Box::new(o.clone()));
        }
        if let Some(s) = &q.sandbox_id {
            arg(&mut sql, "sandbox_id =", Box::new(s.clone()));
        }
        if let Some(f) = q.from {
            arg(&mut sql, "at >=", Box::new(f));
        }
        if let Some(t) = q.to {
            arg(&mut sql, "at <=", Box::new(t));
        }
        if let Some(a) = q.after {
            arg(&mut sql, "id >", Box::new(a));
        }
        if !q.kinds.is_empty() {
            args.push(Box::new(q.kinds.clone()));
            sql.push_str(&format!(" AND type = ANY(${})", args.len()));
        }
        args.push(Box::new(i64::from(q.limit)));
        sql.push_str(&format!(" ORDER BY id LIMIT ${}", args.len()));
        self.with(|c| rows(c.query(&sql, &params_of(&args))?, event_row))
    }

    fn prune_sandboxes(&self, before: i64, batch: u32) -> Result<u64> {
        self.tx(|t| {
            let ids: Vec<String> = t
                .query(
                    &format!(
                        "SELECT id FROM sandboxes WHERE ended_at < $1 AND state NOT IN {HOLDING} \
                         ORDER BY ended_at LIMIT $2"
                    ),
                    &[&before, &(batch as i64)],
                )?
                .iter()
                .map(|r| r.try_get(0))
                .collect::<std::result::Result<_, _>>()?;
            t.execute("DELETE FROM volume_mounts WHERE sandbox_id = ANY($1)", &[&ids])?;
            t.execute("DELETE FROM executions WHERE scope = ANY($1)", &[&ids])?;
            t.execute("DELETE FROM sandboxes WHERE id = ANY($1)", &[&ids])?;
            Ok(ids.len() as u64)
        })
    }

    fn prune_events(&self, before: i64) -> Result<u64> {
        self.tx(|t| {
            let n = t.execute("DELETE FROM events WHERE at < $1", &[&before])?;
            t.execute("DELETE FROM webhook_deliveries WHERE created_at < $1 AND status <> 'pending'", &[&before])?;
            Ok(n)
        })
    }

    fn insert_webhook(&self, w: &WebhookRecord, max: u64) -> Result<bool> {
        self.tx(|t| {
            lock_xact(t, lock::WEBHOOKS, &w.owner)?;
            let n = uint(&t.query_one("SELECT COUNT(*) FROM webhooks WHERE owner = $1", &[&w.owner])?, 0)?;
            if n >= max {
                return Ok(false);
            }
            t.execute(
                &format!("INSERT INTO webhooks ({WEBHOOK_COLS}) VALUES ({})", marks(1, 9)),
                &[
                    &w.id,
                    &w.owner,
                    &w.url,
                    &events_json(&w.events),
                    &w.secret,
                    &w.created_at,
                    &w.format,
                    &w.name,
                    &w.enabled,
                ],
            )
            .map_err(conflict)?;
            Ok(true)
        })
    }

    fn get_webhook(&self, id: &str) -> Result<Option<WebhookRecord>> {
        self.with(|c| {
            c.query_opt(&format!("SELECT {WEBHOOK_COLS} FROM webhooks WHERE id = $1"), &[&id])?
                .map(|r| webhook_row(&r, 0))
                .transpose()
        })
    }

    fn list_webhooks(&self, owner: Option<&str>) -> Result<Vec<WebhookRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {WEBHOOK_COLS} FROM webhooks WHERE $1::TEXT IS NULL OR owner = $1 ORDER BY created_at, id"
                    ),
                    &[&owner],
                )?,
                |r| webhook_row(r, 0),
            )
        })
    }

    fn delete_webhook(&self, id: &str) -> Result<bool> {
        self.tx(|t| {
            t.execute("DELETE FROM webhook_deliveries WHERE webhook_id = $1", &[&id])?;
            Ok(t.execute("DELETE FROM webhooks WHERE id = $1", &[&id])? > 0)
        })
    }

    fn update_webhook(&self, w: &WebhookRecord) -> Result<bool> {
        self.with(|c| {
            Ok(c.execute(
                "UPDATE webhooks SET url = $2, events = $3, name = $4, enabled = $5 WHERE id = $1",
                &[&w.id, &w.url, &events_json(&w.events), &w.name, &w.enabled],
            )? > 0)
        })
    }

    fn list_deliveries(&self, webhook_id: &str, before: Option<i64>, limit: u32) -> Result<Vec<DeliveryRecord>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT {DELIVERY_COLS} FROM webhook_deliveries d WHERE d.webhook_id = $1 \
                         AND ($2::BIGINT IS NULL OR d.id < $2) ORDER BY d.id DESC LIMIT $3"
                    ),
                    &[&webhook_id, &before, &i64::from(limit)],
                )?,
                delivery_row,
            )
        })
    }

    fn claim_deliveries(
        &self,
        node: &str,
        now: i64,
        until: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
        // The due rows are locked as they are picked, skipping those
        // another node is claiming: two claimers take different rows. A
        // row claimed and committed meanwhile is checked again on its new
        // version (READ COMMITTED) and left out.
        let mut got = self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "UPDATE webhook_deliveries d SET claimed_by = $1, claimed_until = $3 FROM webhooks w \
                         WHERE w.id = d.webhook_id AND d.id IN (SELECT id FROM webhook_deliveries \
                         WHERE status = 'pending' AND next_at <= $2 AND (claimed_until IS NULL OR claimed_until <= $2) \
                         ORDER BY next_at, id LIMIT $4 FOR UPDATE SKIP LOCKED) \
                         RETURNING {DELIVERY_COLS}, w.id, w.owner, w.url, w.events, w.secret, w.created_at, w.format, \
                         w.name, w.enabled"
                    ),
                    &[&node, &now, &until, &i64::from(limit)],
                )?,
                |r| Ok((delivery_row(r)?, webhook_row(r, 12)?)),
            )
        })?;
        got.sort_by_key(|(d, _)| (d.next_at, d.id));
        Ok(got)
    }

    fn release_deliveries(&self, node: &str) -> Result<u64> {
        self.with(|c| {
            let sql = "UPDATE webhook_deliveries SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = $1";
            Ok(c.execute(sql, &[&node])?)
        })
    }

    fn next_delivery_at(&self) -> Result<Option<i64>> {
        self.with(|c| {
            Ok(c.query_one(
                "SELECT MIN(GREATEST(next_at, claimed_until)) FROM webhook_deliveries WHERE status = 'pending'",
                &[],
            )?
            .try_get(0)?)
        })
    }

    fn record_attempt(&self, id: i64, node: &str, a: &Attempt) -> Result<bool> {
        self.with(|c| {
            let n = c.execute(
                "UPDATE webhook_deliveries SET status = $2, attempts = attempts + 1, next_at = $3, last_at = $4, \
                 last_status = $5, last_error = $6, claimed_by = NULL, claimed_until = NULL \
                 WHERE id = $1 AND claimed_by = $7",
                &[&id, &a.status.as_str(), &a.next_at, &a.at, &a.http_status.map(i64::from), &a.error, &node],
            )?;
            Ok(n > 0)
        })
    }

    fn usage_mark(&self, sb: &SandboxRecord, at: i64) -> Result<()> {
        self.tx(|t| mark_in(t, &sb.id, UsageInterval::of_sandbox(sb, at).as_ref(), at))
    }

    fn usage_mark_object(&self, open: Option<&UsageInterval>, subject: &str, at: i64) -> Result<()> {
        self.tx(|t| mark_in(t, subject, open, at))
    }

    fn usage_lost(&self, sandbox_id: &str, at: i64) -> Result<()> {
        self.tx(|t| {
            lock_xact(t, lock::USAGE, sandbox_id)?;
            let Some((_, cur)) = open_interval(t, sandbox_id)? else { return Ok(()) };
            if cur.kind == UsageKind::Held {
                return Ok(());
            }
            mark_in(t, sandbox_id, Some(&UsageInterval { kind: UsageKind::Held, ..cur }), at)
        })
    }

    fn usage_flush(&self, counts: &[UsageCount], node: &str, alive_at: i64) -> Result<()> {
        self.tx(|t| {
            let st = t.prepare(
                "INSERT INTO usage_counts (owner, sandbox_id, template, at, commands, egress_bytes) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )?;
            for n in counts.iter().filter(|n| n.commands > 0 || n.egress_bytes > 0) {
                t.execute(
                    &st,
                    &[
                        &n.owner,
                        &n.sandbox_id,
                        &n.template,
                        &n.at,
                        &(n.commands.min(i64::MAX as u64) as i64),
                        &(n.egress_bytes.min(i64::MAX as u64) as i64),
                    ],
                )?;
            }
            // By key in order, so that two flushes take the rows alike.
            for (owner, counted) in crate::usage::counts_by_owner(counts) {
                add_totals(t, owner, &counted)?;
            }
            t.execute(
                "INSERT INTO usage_node_clock (node, alive_at) VALUES ($1, $2) ON CONFLICT (node) \
                 DO UPDATE SET alive_at = GREATEST(usage_node_clock.alive_at, excluded.alive_at)",
                &[&node, &alive_at],
            )?;
            Ok(())
        })
    }

    fn usage_alive_at(&self, node: &str) -> Result<Option<i64>> {
        self.with(|c| {
            Ok(c.query_one(
                "SELECT COALESCE((SELECT alive_at FROM usage_node_clock WHERE node = $1), \
                 (SELECT alive_at FROM usage_clock WHERE id = 1))",
                &[&node],
            )?
            .try_get(0)?)
        })
    }

    fn usage_report(&self, q: &UsageQuery) -> Result<Vec<UsageRow>> {
        self.tx(|t| {
            // One transaction at REPEATABLE READ: the intervals and the
            // counts are of one instant.
            t.batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")?;
            // Summed as read, a row at a time: the report holds a row per
            // group, never the window's intervals.
            let mut sum = crate::usage::Aggregate::new(q);
            let window: [Param<'_>; 3] = [&q.owner, &q.from, &q.to];
            let mut it = t.query_raw(
                &format!(
                    "SELECT {USAGE_COLUMNS} FROM usage_intervals WHERE ($1::TEXT IS NULL OR owner = $1) \
                     AND start_ms < $3 AND (end_ms IS NULL OR end_ms > $2) ORDER BY id"
                ),
                window,
            )?;
            while let Some(r) = it.next()? {
                sum.interval(&usage_row(&r)?);
            }
            drop(it);
            let mut it = t.query_raw(
                "SELECT owner, sandbox_id, template, at, commands, egress_bytes FROM usage_counts \
                 WHERE ($1::TEXT IS NULL OR owner = $1) AND at >= $2 AND at < $3 ORDER BY id",
                window,
            )?;
            while let Some(r) = it.next()? {
                sum.count(&UsageCount {
                    owner: r.try_get(0)?,
                    sandbox_id: r.try_get(1)?,
                    template: r.try_get(2)?,
                    at: r.try_get(3)?,
                    commands: uint(&r, 4)?,
                    egress_bytes: uint(&r, 5)?,
                });
            }
            Ok(sum.rows())
        })
    }

    fn usage_totals(&self, owner: Option<&str>, now: i64) -> Result<Vec<UsageRow>> {
        self.tx(|t| {
            // One instant: an interval closing meanwhile is counted once.
            t.batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")?;
            let totals = rows(
                t.query(
                    &format!("SELECT {TOTALS_COLUMNS} FROM usage_totals WHERE ($1::TEXT IS NULL OR owner = $1)"),
                    &[&owner],
                )?,
                |r| {
                    Ok(UsageRow {
                        key: r.try_get(0)?,
                        group: None,
                        memory_mib_seconds: r.try_get(1)?,
                        vcpu_seconds: r.try_get(2)?,
                        paused_seconds: r.try_get(3)?,
                        disk_gib_hours: r.try_get(4)?,
                        snapshot_gib_hours: r.try_get(5)?,
                        volume_gib_hours: r.try_get(6)?,
                        egress_bytes: uint(r, 7)?,
                        commands: uint(r, 8)?,
                    })
                },
            )?;
            let open = rows(
                t.query(
                    &format!(
                        "SELECT {USAGE_COLUMNS} FROM usage_intervals WHERE end_ms IS NULL \
                         AND ($1::TEXT IS NULL OR owner = $1)"
                    ),
                    &[&owner],
                )?,
                usage_row,
            )?;
            Ok(crate::usage::totals_until(totals, &open, now))
        })
    }

    fn usage_open_subjects(&self) -> Result<Vec<(UsageKind, String)>> {
        self.with(|c| {
            let all = rows(
                c.query("SELECT kind, subject FROM usage_intervals WHERE end_ms IS NULL ORDER BY id", &[])?,
                |r| Ok((r.try_get::<_, String>(0)?, r.try_get::<_, String>(1)?)),
            )?;
            Ok(all.into_iter().filter_map(|(k, s)| Some((UsageKind::parse(&k)?, s))).collect())
        })
    }

    fn register_node(&self, n: &NodeRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                &format!(
                    "INSERT INTO nodes ({NODE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, 'active', $7, $8) \
                     ON CONFLICT (name) DO UPDATE SET advertise = excluded.advertise, \
                     memory_mib = excluded.memory_mib, disk_mib = excluded.disk_mib, \
                     sandboxes = excluded.sandboxes, classes = excluded.classes, \
                     state = CASE WHEN nodes.state = 'draining' THEN 'draining' ELSE 'active' END, \
                     started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at"
                ),
                &[
                    &n.name,
                    &n.advertise,
                    &opt_i64(Some(n.memory_mib)),
                    &opt_i64(Some(n.disk_mib)),
                    &opt_i64(Some(n.sandboxes)),
                    &n.classes.join(","),
                    &n.started_at,
                    &n.heartbeat_at,
                ],
            )?;
            Ok(())
        })
    }

    fn heartbeat_node(&self, name: &str, at: i64) -> Result<Option<NodeState>> {
        self.with(|c| {
            // One statement: the beat is written unless the node is lost,
            // and its state is read in the same snapshot.
            let row = c.query_opt(
                "WITH beat AS (UPDATE nodes SET heartbeat_at = $2 WHERE name = $1 AND state <> 'lost' RETURNING state) \
                 SELECT state FROM beat UNION ALL SELECT state FROM nodes WHERE name = $1 AND state = 'lost'",
                &[&name, &at],
            )?;
            row.map(|r| text_enum(&r, 0, "node state", NodeState::parse)).transpose()
        })
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>> {
        self.with(|c| {
            rows(c.query(&format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY name"), &[])?, |r| {
                Ok(NodeRecord {
                    name: r.try_get(0)?,
                    advertise: r.try_get(1)?,
                    memory_mib: uint(r, 2)?,
                    disk_mib: uint(r, 3)?,
                    sandboxes: uint(r, 4)?,
                    classes: split_classes(&r.try_get::<_, String>(5)?),
                    state: text_enum(r, 6, "node state", NodeState::parse)?,
                    started_at: r.try_get(7)?,
                    heartbeat_at: r.try_get(8)?,
                })
            })
        })
    }

    fn mark_node_lost(&self, loss: &NodeLoss<'_>) -> Result<Option<Vec<SandboxRecord>>> {
        self.tx(|t| {
            // The node's row is the lock: a second declarer waits on it,
            // then finds it lost and changes nothing.
            let won = t.execute(
                "UPDATE nodes SET state = 'lost' WHERE name = $1 AND state <> 'lost' AND heartbeat_at < $2",
                &[&loss.name, &loss.silent_before],
            )?;
            if won == 0 {
                return Ok(None);
            }
            let states: Vec<&str> = loss.from.iter().map(|s| s.as_str()).collect();
            let lost = rows(
                t.query(
                    &format!(
                        "UPDATE sandboxes SET state = 'lost', last_error_code = $3, reason = $4 \
                         WHERE node = $1 AND state = ANY($2) RETURNING {SANDBOX_COLUMNS}"
                    ),
                    &[&loss.name, &states, &loss.code, &loss.reason],
                )?,
                sandbox_row,
            )?;
            t.execute(
                "UPDATE sandboxes SET reason = $2 WHERE node = $1 AND state = 'paused'",
                &[&loss.name, &loss.paused_reason],
            )?;
            Ok(Some(lost))
        })
    }

    fn set_node_state(&self, name: &str, from: &[NodeState], to: NodeState) -> Result<bool> {
        let states: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        self.with(|c| {
            Ok(c.execute(
                "UPDATE nodes SET state = $2 WHERE name = $1 AND state = ANY($3)",
                &[&name, &to.as_str(), &states],
            )? == 1)
        })
    }

    fn give_all_to(&self, node: &str) -> Result<u64> {
        self.with(|c| {
            let sandboxes = c.execute("UPDATE sandboxes SET node = $1 WHERE node <> $1", &[&node])?;
            c.execute("UPDATE executions SET node = $1 WHERE node IS DISTINCT FROM $1", &[&node])?;
            c.execute("UPDATE builds SET node = $1 WHERE node IS DISTINCT FROM $1", &[&node])?;
            Ok(sandboxes + c.execute("UPDATE volumes SET node = $1 WHERE node <> $1", &[&node])?)
        })
    }

    fn set_pushed(&self, object: Pushed, id: &str, reference: Option<&str>) -> Result<bool> {
        let sql = format!("UPDATE {} SET pushed_ref = $2 WHERE id = $1", object.table());
        self.with(|c| Ok(c.execute(&sql, &[&id, &reference])? == 1))
    }

    fn pushed(&self, object: Pushed, id: &str) -> Result<Option<String>> {
        let sql = format!("SELECT pushed_ref FROM {} WHERE id = $1", object.table());
        self.with(|c| Ok(c.query_opt(&sql, &[&id])?.map(|r| r.try_get::<_, Option<String>>(0)).transpose()?.flatten()))
    }

    fn move_paused(&self, id: &str, from: &str, to: &str) -> Result<bool> {
        self.with(|c| {
            Ok(c.execute(
                "UPDATE sandboxes SET node = $3 WHERE id = $1 AND node = $2 AND state = 'paused' \
                 AND pushed_ref IS NOT NULL",
                &[&id, &from, &to],
            )? == 1)
        })
    }

    fn count_by_node(&self) -> Result<Vec<(String, u64)>> {
        self.with(|c| {
            rows(
                c.query(
                    &format!(
                        "SELECT node, COUNT(*) FROM sandboxes WHERE state IN {HOLDING} GROUP BY node ORDER BY node"
                    ),
                    &[],
                )?,
                |r| Ok((r.try_get(0)?, uint(r, 1)?)),
            )
        })
    }
}
