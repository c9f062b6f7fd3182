//! The embedded SQLite store (WAL mode) in one file.

use crate::*;
use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension, Transaction};
use std::path::Path;
use std::sync::Mutex;

/// The embedded SQLite store: one connection behind a lock, and for a
/// store in a file a second one for [`Store::quick_reads`].
pub struct SqliteStore {
    conn: Mutex<Connection>,
    reader: Option<Reader>,
    /// A daemon's store's ([`SqliteStore::open_checkpointing`]), held for
    /// its drop: the thread stops with the store.
    _checkpointer: Option<Checkpointer>,
}

/// The WAL's checkpoints on a thread and connection of their own (see
/// [`SqliteStore::open_checkpointing`]); stopped and joined on drop.
struct Checkpointer {
    stop: std::sync::Arc<(Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often the checkpointer syncs the WAL and copies what it can into
/// the database: a commit is on disk within about that.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Checkpointer {
    fn start(path: &Path) -> Result<Checkpointer> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let stop = std::sync::Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let signal = stop.clone();
        let thread = std::thread::Builder::new()
            .name("hutch-checkpoint".into())
            .spawn(move || Self::run(&conn, &signal))
            .map_err(StoreError::Thread)?;
        Ok(Checkpointer { stop, thread: Some(thread) })
    }

    fn run(conn: &Connection, stop: &(Mutex<bool>, std::sync::Condvar)) {
        let (lock, cv) = stop;
        loop {
            let Ok(stopped) = lock.lock() else { return };
            let Ok((stopped, _)) = cv.wait_timeout_while(stopped, CHECKPOINT_EVERY, |s| !*s) else { return };
            if *stopped {
                return;
            }
            drop(stopped);
            // PASSIVE: syncs the WAL, then copies what no reader still
            // needs, waiting for nobody; commits go on meanwhile. A WAL
            // with nothing new costs a look at its index.
            if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                tracing::warn!("store: checkpoint: {e}");
            }
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        if let Ok(mut stopped) = lock.lock() {
            *stopped = true;
        }
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A read-only connection for the point reads of [`QuickReads`]. In WAL
/// mode a reader sees every commit made before its read began, by this
/// process or another (`hutch key revoke`), and waits for no writer.
struct Reader(Mutex<Connection>);

impl Reader {
    fn open(path: &Path) -> Result<Reader> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "query_only", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Ok(Reader(Mutex::new(conn)))
    }
}

/// A connection behind a lock, which answers the point reads: the store's
/// own, and the reader's.
trait Locked: Send + Sync {
    fn locked(&self) -> &Mutex<Connection>;

    fn read<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let conn = self.locked().lock().map_err(|_| StoreError::Poisoned)?;
        f(&conn)
    }
}

impl Locked for Reader {
    fn locked(&self) -> &Mutex<Connection> {
        &self.0
    }
}

impl Locked for SqliteStore {
    fn locked(&self) -> &Mutex<Connection> {
        &self.conn
    }
}

impl<L: Locked> QuickReads for L {
    fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        self.read(|c| key_by_hash_in(c, hash))
    }

    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.read(|c| get_sandbox_in(c, id))
    }

    fn template_by_name(&self, owner: &str, name: &str) -> Result<Option<TemplateRecord>> {
        self.read(|c| template_by_name_in(c, owner, name))
    }
}

const MIGRATIONS: &[(&str, &str)] = &[
    ("0001_init", include_str!("../migrations/0001_init.sql")),
    ("0002_templates", include_str!("../migrations/0002_templates.sql")),
    ("0003_builds", include_str!("../migrations/0003_builds.sql")),
    ("0004_network", include_str!("../migrations/0004_network.sql")),
    ("0005_trust", include_str!("../migrations/0005_trust.sql")),
    ("0006_storage", include_str!("../migrations/0006_storage.sql")),
    ("0007_snapshots", include_str!("../migrations/0007_snapshots.sql")),
    ("0008_volumes", include_str!("../migrations/0008_volumes.sql")),
    ("0009_lifecycle", include_str!("../migrations/0009_lifecycle.sql")),
    ("0010_audit", include_str!("../migrations/0010_audit.sql")),
    ("0011_events", include_str!("../migrations/0011_events.sql")),
    ("0012_webhooks", include_str!("../migrations/0012_webhooks.sql")),
    ("0013_usage", include_str!("../migrations/0013_usage.sql")),
    ("0014_grants", include_str!("../migrations/0014_grants.sql")),
    ("0015_idle", include_str!("../migrations/0015_idle.sql")),
    ("0016_secrets", include_str!("../migrations/0016_secrets.sql")),
    ("0017_webhook_format", include_str!("../migrations/0017_webhook_format.sql")),
    ("0018_class", include_str!("../migrations/0018_class.sql")),
    ("0019_nodes", include_str!("../migrations/0019_nodes.sql")),
    ("0020_node_loss", include_str!("../migrations/0020_node_loss.sql")),
    ("0021_moves", include_str!("../migrations/0021_moves.sql")),
    ("0022_build_push", include_str!("../migrations/0022_build_push.sql")),
    ("0023_volume_node", include_str!("../migrations/0023_volume_node.sql")),
    ("0024_event_ids", include_str!("../migrations/0024_event_ids.sql")),
    ("0025_delivery_claims", include_str!("../migrations/0025_delivery_claims.sql")),
    ("0026_node_work", include_str!("../migrations/0026_node_work.sql")),
    ("0027_node_clock", include_str!("../migrations/0027_node_clock.sql")),
    ("0028_pooled_live", include_str!("../migrations/0028_pooled_live.sql")),
    ("0029_running_totals", include_str!("../migrations/0029_running_totals.sql")),
    ("0030_sandbox_retention", include_str!("../migrations/0030_sandbox_retention.sql")),
    ("0031_no_state_index", include_str!("../migrations/0031_no_state_index.sql")),
];

/// Statements the connection keeps prepared: more than the store has, so
/// that none is parsed twice.
const STATEMENT_CACHE: usize = 512;

/// Runs statements through the connection's cache of prepared ones: a
/// create's or a transition's statements are parsed once, not at every
/// call (parsing and planning them was about a third of the store's
/// time). SQL built with `format!` is cached per text like any other.
trait Cached {
    fn execute_c<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn query_row_c<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl Cached for Connection {
    fn execute_c<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn query_row_c<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

/// States in which a sandbox holds resources: every state but the final
/// two (`terminated`, `lost`). A query for the sandboxes not yet ended
/// names these rather than `NOT IN` the final ones, which no index serves:
/// ended sandboxes pile up with the host's history, the others do not.
/// (A paused sandbox keeps its admission: its resume is never refused.)
pub(crate) const HOLDING: &str = "('starting', 'running', 'suspended', 'terminating', 'paused')";

/// The oldest claimable warm sandbox of a template (`claim_warm`), found
/// through the pool's own index, which holds live warm sandboxes only
/// (`state IN HOLDING` names its condition): SQLite, without statistics,
/// would otherwise walk every sandbox the owner ever had.
pub(crate) fn claim_pick_sql() -> String {
    format!(
        "SELECT s.id FROM sandboxes s INDEXED BY sandboxes_pooled JOIN templates t ON t.id = s.template_id \
         WHERE s.pooled = 1 AND s.state IN {HOLDING} AND s.state = 'running' AND s.template_id = ?1 \
         AND s.owner = ?2 AND t.deleted_at IS NULL AND s.template_version = t.version AND s.storage = ?3 \
         AND s.node = ?4 ORDER BY s.created_at, s.id LIMIT 1"
    )
}

/// This node's live warm sandboxes (`pooled_sandboxes`, each pool pass),
/// from the pool's index: the few live warm sandboxes of the host.
pub(crate) fn pooled_sql() -> String {
    format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes INDEXED BY sandboxes_pooled \
         WHERE pooled = 1 AND state IN {HOLDING} AND (?1 IS NULL OR node = ?1) ORDER BY created_at, id"
    )
}

/// The idle policies of the sandboxes not yet ended (`sandbox_idle_all`,
/// each idle sweep).
pub(crate) fn idle_all_sql() -> String {
    format!(
        "SELECT id, idle_timeout_s, COALESCE(on_idle, 'pause') FROM sandboxes \
         WHERE idle_timeout_s IS NOT NULL AND state IN {HOLDING} AND (?1 IS NULL OR node = ?1)"
    )
}

/// Sandboxes by state: the live ones counted by the state index, the
/// ended ones read from the counts the triggers of migration 0029 keep.
pub(crate) fn count_by_state_sql() -> String {
    format!(
        "SELECT state, COUNT(*) FROM sandboxes WHERE state IN {HOLDING} GROUP BY state \
         UNION ALL SELECT state, n FROM sandboxes_ended"
    )
}

/// Open intervals (every live sandbox, snapshot and volume has one), by an
/// index search for a NULL end (the plan test checks it).
pub(crate) fn open_intervals_sql() -> String {
    format!("SELECT {USAGE_COLUMNS} FROM usage_intervals WHERE end_ms IS NULL AND (?1 IS NULL OR owner = ?1)")
}

/// The ended sandboxes a retention pass deletes, oldest first, by the
/// `ended_at` index (live sandboxes have none).
pub(crate) fn prune_pick_sql() -> String {
    format!("SELECT id FROM sandboxes WHERE ended_at < ?1 AND state NOT IN {HOLDING} ORDER BY ended_at LIMIT ?2")
}

/// The sandboxes not yet ended per node (`count_by_node`, placement).
pub(crate) fn count_by_node_sql() -> String {
    format!("SELECT node, COUNT(*) FROM sandboxes WHERE state IN {HOLDING} GROUP BY node ORDER BY node")
}

impl SqliteStore {
    pub fn open(path: &Path) -> Result<SqliteStore> {
        let conn = Connection::open(path)?;
        // The reader opens once the schema is there.
        let store = Self::init(conn)?;
        Ok(SqliteStore { reader: Some(Reader::open(path)?), ..store })
    }

    /// [`SqliteStore::open`], with the WAL checkpointed every second on a
    /// thread of its own: a daemon's store. With `synchronous = NORMAL` a
    /// commit is on disk only once a checkpoint synced the WAL, and SQLite
    /// checkpoints when a commit takes the WAL past 1,000 pages, which on a
    /// quiet host may be hours after a commit (a key's revocation, say)
    /// returned. It still does: a checkpoint that runs beside commits
    /// rarely copies every frame, and only a complete one lets the next
    /// commit start the WAL over, so without it the WAL would grow (a
    /// fan-out took it from 4 MiB to the 32 MiB its limit allowed). What
    /// the thread copied, that commit's checkpoint does not copy again.
    pub fn open_checkpointing(path: &Path) -> Result<SqliteStore> {
        let store = Self::open(path)?;
        Ok(SqliteStore { _checkpointer: Some(Checkpointer::start(path)?), ..store })
    }

    /// A store of its own in memory, with no second connection: its quick
    /// reads go through the one connection, as every call does.
    pub fn open_in_memory() -> Result<SqliteStore> {
        Self::init(Connection::open_in_memory()?)
    }

    /// SQLite's plan for `sql` (`EXPLAIN QUERY PLAN`), one line per step,
    /// with every parameter NULL.
    #[cfg(test)]
    pub(crate) fn query_plan(&self, sql: &str) -> Result<Vec<String>> {
        self.with(|c| {
            let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
            let n = st.parameter_count();
            let nulls = vec![rusqlite::types::Null; n];
            let rows = st
                .query_map(rusqlite::params_from_iter(nulls), |r| r.get::<_, String>(3))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn init(mut conn: Connection) -> Result<SqliteStore> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        // Room for every statement of the store (see `Cached`).
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (name TEXT PRIMARY KEY)", [])?;
        for (name, sql) in MIGRATIONS {
            let done: bool = conn
                .query_row("SELECT 1 FROM schema_migrations WHERE name = ?1", [name], |_| Ok(true))
                .optional()?
                .unwrap_or(false);
            if !done {
                let tx = conn.transaction()?;
                tx.execute_batch(sql)?;
                tx.execute("INSERT INTO schema_migrations (name) VALUES (?1)", [name])?;
                tx.commit()?;
            }
        }
        Ok(SqliteStore { conn: Mutex::new(conn), reader: None, _checkpointer: None })
    }

    /// The connection, for tests that check what SQL itself refuses.
    #[cfg(test)]
    pub(crate) fn raw_conn_for_tests(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().expect("lock")
    }

    /// The quick reads' connection, for tests of what it refuses.
    #[cfg(test)]
    pub(crate) fn reader_for_tests(&self) -> Option<std::sync::MutexGuard<'_, Connection>> {
        self.reader.as_ref().map(|r| r.0.lock().expect("lock"))
    }

    fn with<T>(&self, f: impl FnOnce(&mut Connection) -> Result<T>) -> Result<T> {
        let mut conn = self.conn.lock().map_err(|_| StoreError::Poisoned)?;
        f(&mut conn)
    }
}

pub(crate) fn conflict(e: rusqlite::Error) -> StoreError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::ConstraintViolation => {
            StoreError::Conflict
        }
        _ => StoreError::Sqlite(e),
    }
}

/// `?N, ?N+1, ...` for `n` parameters.
fn placeholders(first: usize, n: usize) -> String {
    (first..first + n).map(|i| format!("?{i}")).collect::<Vec<_>>().join(", ")
}

/// Runs `update`, a statement ending in `WHERE ... AND state IN`, with
/// `values` as its first parameters and `states` as the list it ends with:
/// the conditional update every state change is. Returns the rows changed.
fn update_in_states(c: &Connection, update: &str, mut values: Vec<Value>, states: &[&str]) -> Result<usize> {
    let sql = format!("{update} ({})", placeholders(values.len() + 1, states.len()));
    values.extend(states.iter().map(|s| Value::from((*s).to_owned())));
    Ok(c.execute_c(&sql, params_from_iter(values))?)
}

pub(crate) const SANDBOX_COLUMNS: &str =
    "id, owner, template, state, created_at, expires_at, max_expires_at, memory_mb, vcpus, \
     disk_mib, pids, env, metadata, limits_applied, last_error_code, host_pid, idempotency_key, request_hash, \
     template_id, template_version, warm, pooled, network, storage, origin, on_expire, ttl_s, paused_ttl_s, class, node, reason";

/// The columns of a [`SandboxBrief`], in [`brief_row`]'s order.
pub(crate) const BRIEF_COLUMNS: &str =
    "id, owner, state, created_at, expires_at, memory_mb, vcpus, disk_mib, pooled, on_expire";

pub(crate) const TEMPLATE_COLUMNS: &str =
    "id, owner, name, version, image, class, memory_mb, vcpus, disk_mib, pids, env, \
     default_ttl_s, max_ttl_s, warm_min, warm_max, created_at, updated_at, deleted_at, startup, readiness, network, \
     storage, on_expire, paused_ttl_s, idle_timeout_s, on_idle, secrets";

pub(crate) const BUILD_COLUMNS: &str =
    "id, template_id, owner, state, created_at, finished_at, error, parent, image, version, node";

pub(crate) const KEY_COLUMNS: &str = "id, name, hash, admin, created_at, revoked_at, max_sandboxes, max_memory_mb, \
     max_disk_mib, max_ttl_seconds, max_builds, max_snapshots";

pub(crate) const SNAPSHOT_COLUMNS: &str = "id, owner, name, sandbox_id, created_at, size_bytes, recipe";

pub(crate) const SECRET_COLUMNS: &str =
    "id, owner, name, hosts, header, format, metadata, version, sealed, created_at, updated_at";

fn secret_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SecretRecord> {
    Ok(SecretRecord {
        id: r.get(0)?,
        owner: r.get(1)?,
        name: r.get(2)?,
        hosts: r.get(3)?,
        header: r.get(4)?,
        format: r.get(5)?,
        metadata: r.get(6)?,
        version: r.get(7)?,
        sealed: r.get(8)?,
        created_at: r.get(9)?,
        updated_at: r.get(10)?,
    })
}

fn snapshot_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SnapshotRecord> {
    Ok(SnapshotRecord {
        id: r.get(0)?,
        owner: r.get(1)?,
        name: r.get(2)?,
        sandbox_id: r.get(3)?,
        created_at: r.get(4)?,
        size_bytes: r.get::<_, i64>(5)?.max(0) as u64,
        recipe: r.get(6)?,
    })
}

pub(crate) const NODE_COLUMNS: &str =
    "name, advertise, memory_mib, disk_mib, sandboxes, classes, state, started_at, heartbeat_at";

/// The classes a node runs, as stored (comma-separated).
pub(crate) fn split_classes(s: &str) -> Vec<String> {
    s.split(',').filter(|c| !c.is_empty()).map(str::to_owned).collect()
}

fn node_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<NodeRecord> {
    Ok(NodeRecord {
        name: r.get(0)?,
        advertise: r.get(1)?,
        memory_mib: r.get::<_, i64>(2)?.max(0) as u64,
        disk_mib: r.get::<_, i64>(3)?.max(0) as u64,
        sandboxes: r.get::<_, i64>(4)?.max(0) as u64,
        classes: split_classes(&r.get::<_, String>(5)?),
        state: parsed(r, 6, "node state", NodeState::parse)?,
        started_at: r.get(7)?,
        heartbeat_at: r.get(8)?,
    })
}

/// A column that must hold one of an enum's names.
fn parsed<T>(
    r: &rusqlite::Row<'_>,
    idx: usize,
    what: &'static str,
    parse: impl Fn(&str) -> Option<T>,
) -> rusqlite::Result<T> {
    let text: String = r.get(idx)?;
    parse(&text).ok_or_else(|| {
        let id: String = r.get(0).unwrap_or_default();
        rusqlite::Error::FromSqlConversionFailure(
            idx,
            rusqlite::types::Type::Text,
            Box::new(StoreError::Corrupt { what, id, value: text }),
        )
    })
}

fn opt_u64(r: &rusqlite::Row<'_>, idx: usize) -> rusqlite::Result<Option<u64>> {
    Ok(r.get::<_, Option<i64>>(idx)?.map(|v| v.max(0) as u64))
}

fn build_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<BuildRecord> {
    Ok(BuildRecord {
        id: r.get(0)?,
        template_id: r.get(1)?,
        owner: r.get(2)?,
        state: parsed(r, 3, "build state", BuildState::parse)?,
        created_at: r.get(4)?,
        finished_at: r.get(5)?,
        error: r.get(6)?,
        parent: r.get(7)?,
        image: r.get(8)?,
        version: r.get(9)?,
        node: r.get::<_, Option<String>>(10)?.unwrap_or_default(),
    })
}

fn template_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<TemplateRecord> {
    Ok(TemplateRecord {
        id: r.get(0)?,
        owner: r.get(1)?,
        name: r.get(2)?,
        version: r.get(3)?,
        image: r.get(4)?,
        class: r.get(5)?,
        memory_mb: r.get::<_, i64>(6)? as u64,
        vcpus: r.get(7)?,
        disk_mib: r.get::<_, i64>(8)? as u64,
        pids: r.get::<_, i64>(9)? as u32,
        env: r.get(10)?,
        default_ttl_s: r.get::<_, i64>(11)? as u64,
        max_ttl_s: r.get::<_, i64>(12)? as u64,
        warm_min: r.get::<_, i64>(13)? as u32,
        warm_max: r.get::<_, i64>(14)? as u32,
        created_at: r.get(15)?,
        updated_at: r.get(16)?,
        deleted_at: r.get(17)?,
        startup: r.get(18)?,
        readiness: r.get(19)?,
        network: r.get(20)?,
        storage: match r.get::<_, Option<String>>(21)? {
            None => None,
            Some(_) => Some(parsed(r, 21, "template storage", StorageKind::parse)?),
        },
        on_expire: match r.get::<_, Option<String>>(22)? {
            None => None,
            Some(_) => Some(parsed(r, 22, "template on_expire", OnExpire::parse)?),
        },
        paused_ttl_s: r.get::<_, Option<i64>>(23)?.map(|v| v as u64),
        idle_timeout_s: r.get::<_, Option<i64>>(24)?.map(|v| v.max(0) as u64),
        on_idle: match r.get::<_, Option<String>>(25)? {
            None => None,
            Some(_) => Some(parsed(r, 25, "template on_idle", OnIdle::parse)?),
        },
        secrets: r.get(26)?,
    })
}

/// A template's values in [`TEMPLATE_COLUMNS`] order: what an insert and
/// an update write.
fn template_values(t: &TemplateRecord) -> Vec<Value> {
    let text = |v: Option<&str>| v.map_or(Value::Null, |v| Value::from(v.to_owned()));
    let int = |v: Option<i64>| v.map_or(Value::Null, Value::from);
    vec![
        Value::from(t.id.clone()),
        Value::from(t.owner.clone()),
        Value::from(t.name.clone()),
        Value::from(t.version),
        Value::from(t.image.clone()),
        Value::from(t.class.clone()),
        Value::from(t.memory_mb as i64),
        Value::from(t.vcpus),
        Value::from(t.disk_mib as i64),
        Value::from(t.pids as i64),
        Value::from(t.env.clone()),
        Value::from(t.default_ttl_s as i64),
        Value::from(t.max_ttl_s as i64),
        Value::from(t.warm_min as i64),
        Value::from(t.warm_max as i64),
        Value::from(t.created_at),
        Value::from(t.updated_at),
        int(t.deleted_at),
        text(t.startup.as_deref()),
        text(t.readiness.as_deref()),
        Value::from(t.network.clone()),
        text(t.storage.map(StorageKind::as_str)),
        text(t.on_expire.map(OnExpire::as_str)),
        int(t.paused_ttl_s.map(|v| v as i64)),
        int(t.idle_timeout_s.map(|v| v as i64)),
        text(t.on_idle.map(OnIdle::as_str)),
        Value::from(t.secrets.clone()),
    ]
}

fn sandbox_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxRecord> {
    Ok(SandboxRecord {
        id: r.get(0)?,
        owner: r.get(1)?,
        template: r.get(2)?,
        state: parsed(r, 3, "sandbox state", SandboxState::parse)?,
        created_at: r.get(4)?,
        expires_at: r.get(5)?,
        max_expires_at: r.get(6)?,
        memory_mb: r.get::<_, i64>(7)? as u64,
        vcpus: r.get(8)?,
        disk_mib: r.get::<_, i64>(9)? as u64,
        pids: r.get::<_, i64>(10)? as u32,
        env: r.get(11)?,
        metadata: r.get(12)?,
        limits_applied: r.get(13)?,
        last_error_code: r.get(14)?,
        host_pid: r.get(15)?,
        idempotency_key: r.get(16)?,
        request_hash: r.get(17)?,
        template_id: r.get(18)?,
        template_version: r.get(19)?,
        warm: r.get::<_, i64>(20)? != 0,
        pooled: r.get::<_, i64>(21)? != 0,
        network: r.get(22)?,
        storage: parsed(r, 23, "sandbox storage", StorageKind::parse)?,
        origin: r.get(24)?,
        on_expire: parsed(r, 25, "sandbox on_expire", OnExpire::parse)?,
        ttl_s: r.get::<_, Option<i64>>(26)?.map(|v| v as u64),
        paused_ttl_s: r.get::<_, Option<i64>>(27)?.map(|v| v as u64),
        class: parsed(r, 28, "sandbox class", Class::parse)?,
        node: r.get(29)?,
        reason: r.get(30)?,
    })
}

fn brief_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxBrief> {
    Ok(SandboxBrief {
        id: r.get(0)?,
        owner: r.get(1)?,
        state: parsed(r, 2, "sandbox state", SandboxState::parse)?,
        created_at: r.get(3)?,
        expires_at: r.get(4)?,
        memory_mb: r.get::<_, i64>(5)? as u64,
        vcpus: r.get(6)?,
        disk_mib: r.get::<_, i64>(7)? as u64,
        pooled: r.get::<_, i64>(8)? != 0,
        on_expire: parsed(r, 9, "sandbox on_expire", OnExpire::parse)?,
    })
}

/// The sandboxes of `node` (None: every node's) in any of `states`, oldest
/// first (by `key`: creation, then id), each read as `columns` by `row`.
fn sandboxes_with<T>(
    c: &Connection,
    columns: &str,
    node: Option<&str>,
    states: &[SandboxState],
    row: fn(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    key: fn(&T) -> (i64, &str),
) -> Result<Vec<T>> {
    let mut out = Vec::new();
    let mut st = c.prepare_cached(&format!(
        "SELECT {columns} FROM sandboxes WHERE state = ?1 AND (?2 IS NULL OR node = ?2) ORDER BY created_at, id"
    ))?;
    for state in states {
        out.extend(st.query_map(params![state.as_str(), node], row)?.collect::<rusqlite::Result<Vec<_>>>()?);
    }
    out.sort_by(|a, b| key(a).cmp(&key(b)));
    Ok(out)
}

fn key_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRecord> {
    Ok(KeyRecord {
        id: r.get(0)?,
        name: r.get(1)?,
        hash: r.get(2)?,
        admin: r.get::<_, i64>(3)? != 0,
        created_at: r.get(4)?,
        revoked_at: r.get(5)?,
        quotas: Quotas {
            sandboxes: opt_u64(r, 6)?,
            memory_mb: opt_u64(r, 7)?,
            disk_mib: opt_u64(r, 8)?,
            ttl_seconds: opt_u64(r, 9)?,
            builds: opt_u64(r, 10)?,
            snapshots: opt_u64(r, 11)?,
        },
    })
}

fn exec_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ExecRecord> {
    Ok(ExecRecord {
        scope: r.get(0)?,
        key: r.get(1)?,
        request_hash: r.get(2)?,
        state: parsed(r, 3, "execution state", ExecState::parse)?,
        result: r.get(4)?,
        created_at: r.get(5)?,
    })
}

fn get_sandbox_in(c: &Connection, id: &str) -> Result<Option<SandboxRecord>> {
    Ok(c.query_row_c(&format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = ?1"), [id], sandbox_row)
        .optional()?)
}

fn key_by_hash_in(c: &Connection, hash: &str) -> Result<Option<KeyRecord>> {
    Ok(c.query_row_c(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE hash = ?1"), [hash], key_row).optional()?)
}

fn template_by_name_in(c: &Connection, owner: &str, name: &str) -> Result<Option<TemplateRecord>> {
    Ok(c.query_row_c(
        &format!("SELECT {TEMPLATE_COLUMNS} FROM templates WHERE owner = ?1 AND name = ?2 AND deleted_at IS NULL"),
        [owner, name],
        template_row,
    )
    .optional()?)
}

/// What sandboxes hold, volumes' sizes counted in `disk_mib`.
fn usage_in(c: &Connection, owner: Option<&str>) -> Result<Usage> {
    usage_of(c, owner, None)
}

/// The state of `node` when it takes no new sandbox (draining or lost).
fn node_closed(c: &Connection, node: &str) -> Result<Option<NodeState>> {
    let state = c
        .query_row_c("SELECT name, state FROM nodes WHERE name = ?1", [node], |r| {
            parsed(r, 1, "node state", NodeState::parse)
        })
        .optional()?;
    Ok(state.filter(|s| *s != NodeState::Active))
}

/// What the sandboxes of `owner` (None: everyone's) on `node` (None: every
/// node) hold, with the owner's volumes.
fn usage_of(c: &Connection, owner: Option<&str>, node: Option<&str>) -> Result<Usage> {
    Ok(c.query_row_c(
        &format!(
            "SELECT COUNT(*), COALESCE(SUM(memory_mb), 0), COALESCE(SUM(disk_mib), 0) \
             + (SELECT COALESCE(SUM(size_mib), 0) FROM volumes WHERE ?1 IS NULL OR owner = ?1) FROM sandboxes \
             WHERE state IN {HOLDING} AND (?1 IS NULL OR owner = ?1) AND (?2 IS NULL OR node = ?2)"
        ),
        params![owner, node],
        |r| {
            Ok(Usage {
                sandboxes: r.get::<_, i64>(0)? as u64,
                memory_mb: r.get::<_, i64>(1)? as u64,
                disk_mib: r.get::<_, i64>(2)? as u64,
            })
        },
    )?)
}

/// The volume a claim cannot take (held read-write by a live sandbox, or
/// read-only by one when read-write is asked), if any.
fn claim_conflict(c: &Connection, claim: &VolumeClaim) -> Result<Option<String>> {
    let held: i64 = c.query_row_c(
        &format!(
            "SELECT COUNT(*) FROM volume_mounts m JOIN sandboxes s ON s.id = m.sandbox_id \
             WHERE m.volume_id = ?1 AND s.state IN {HOLDING} AND (m.read_only = 0 OR NOT ?2)"
        ),
        params![claim.volume_id, claim.read_only],
        |r| r.get(0),
    )?;
    Ok((held > 0).then(|| claim.volume_id.clone()))
}

pub(crate) const VOLUME_COLUMNS: &str = "id, owner, name, size_mib, created_at, node";

fn volume_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<VolumeRecord> {
    Ok(VolumeRecord {
        id: r.get(0)?,
        owner: r.get(1)?,
        name: r.get(2)?,
        size_mib: r.get::<_, i64>(3)?.max(0) as u64,
        created_at: r.get(4)?,
        node: r.get(5)?,
    })
}

fn claim_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<VolumeClaim> {
    Ok(VolumeClaim { volume_id: r.get(0)?, sandbox_id: r.get(1)?, path: r.get(2)?, read_only: r.get(3)? })
}

/// Whether `asked` more MiB of disk fits under the host's and the owner's caps.
fn disk_fits(c: &Connection, owner: &str, admission: &Admission, asked: u64) -> Result<Option<Exceeded>> {
    let asked = Usage { sandboxes: 0, memory_mb: 0, disk_mib: asked };
    if let Some(e) = over(Scope::Host, &admission.host, usage_in(c, None)?, asked) {
        return Ok(Some(e));
    }
    Ok(over(Scope::Owner, &admission.owner, usage_in(c, Some(owner))?, asked))
}

/// The first cap of `caps` that `asked` on top of `used` would pass.
pub(crate) fn over(scope: Scope, caps: &Quotas, used: Usage, asked: Usage) -> Option<Exceeded> {
    [
        (Resource::Sandboxes, caps.sandboxes, used.sandboxes, asked.sandboxes),
        (Resource::MemoryMb, caps.memory_mb, used.memory_mb, asked.memory_mb),
        (Resource::DiskMib, caps.disk_mib, used.disk_mib, asked.disk_mib),
    ]
    .into_iter()
    .find_map(|(resource, limit, used, asked)| {
        let limit = limit?;
        (used.saturating_add(asked) > limit).then_some(Exceeded { scope, resource, limit, used, asked })
    })
}

fn insert_sandbox_in(tx: &Transaction<'_>, s: &SandboxRecord) -> Result<()> {
    tx.execute_c(
        &format!("INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES ({})", placeholders(1, 31)),
        params![
            s.id,
            s.owner,
            s.template,
            s.state.as_str(),
            s.created_at,
            s.expires_at,
            s.max_expires_at,
            s.memory_mb as i64,
            s.vcpus,
            s.disk_mib as i64,
            s.pids as i64,
            s.env,
            s.metadata,
            s.limits_applied,
            s.last_error_code,
            s.host_pid,
            s.idempotency_key,
            s.request_hash,
            s.template_id,
            s.template_version,
            s.warm as i64,
            s.pooled as i64,
            s.network,
            s.storage.as_str(),
            s.origin,
            s.on_expire.as_str(),
            s.ttl_s.map(|v| v as i64),
            s.paused_ttl_s.map(|v| v as i64),
            s.class.as_str(),
            s.node,
            s.reason
        ],
    )
    .map_err(conflict)?;
    Ok(())
}

pub(crate) const USAGE_COLUMNS: &str =
    "owner, kind, subject, sandbox_id, template, memory_mb, vcpus, size_bytes, start_ms, end_ms";

fn usage_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<UsageInterval> {
    let kind: String = r.get(1)?;
    Ok(UsageInterval {
        owner: r.get(0)?,
        kind: UsageKind::parse(&kind).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                1,
                rusqlite::types::Type::Text,
                format!("usage kind {kind:?}").into(),
            )
        })?,
        subject: r.get(2)?,
        sandbox_id: r.get(3)?,
        template: r.get(4)?,
        memory_mb: r.get::<_, i64>(5)? as u64,
        vcpus: r.get(6)?,
        size_bytes: r.get::<_, i64>(7)? as u64,
        start: r.get(8)?,
        end: r.get(9)?,
    })
}

fn open_interval(c: &Connection, subject: &str) -> Result<Option<(i64, UsageInterval)>> {
    Ok(c.query_row_c(
        &format!("SELECT {USAGE_COLUMNS}, id FROM usage_intervals WHERE subject = ?1 AND end_ms IS NULL"),
        [subject],
        |r| Ok((r.get::<_, i64>(10)?, usage_row(r)?)),
    )
    .optional()?)
}

/// Ends the open interval `id` (`cur`) at `at` (never before it started),
/// and adds what it measured to its key's running totals.
fn close_interval(c: &Connection, id: i64, cur: &UsageInterval, at: i64) -> Result<()> {
    c.execute_c("UPDATE usage_intervals SET end_ms = MAX(start_ms, ?2) WHERE id = ?1", params![id, at])?;
    let mut measured = UsageRow::default();
    measured.charge(cur, cur.start, at);
    add_totals(c, &cur.owner, &measured)
}

/// The columns of `usage_totals`, as both stores read and write them.
pub(crate) const TOTALS_COLUMNS: &str = "owner, memory_mib_seconds, vcpu_seconds, paused_seconds, disk_gib_hours, \
     snapshot_gib_hours, volume_gib_hours, egress_bytes, commands";

/// What an insert into `usage_totals` does when the key has a row: adds.
pub(crate) const TOTALS_ADD: &str = "ON CONFLICT (owner) DO UPDATE SET \
     memory_mib_seconds = usage_totals.memory_mib_seconds + excluded.memory_mib_seconds, \
     vcpu_seconds = usage_totals.vcpu_seconds + excluded.vcpu_seconds, \
     paused_seconds = usage_totals.paused_seconds + excluded.paused_seconds, \
     disk_gib_hours = usage_totals.disk_gib_hours + excluded.disk_gib_hours, \
     snapshot_gib_hours = usage_totals.snapshot_gib_hours + excluded.snapshot_gib_hours, \
     volume_gib_hours = usage_totals.volume_gib_hours + excluded.volume_gib_hours, \
     egress_bytes = usage_totals.egress_bytes + excluded.egress_bytes, \
     commands = usage_totals.commands + excluded.commands";

/// `r`'s figures as `usage_totals` stores them, after the owner.
pub(crate) fn totals_values(r: &UsageRow) -> (f64, f64, f64, f64, f64, f64, i64, i64) {
    (
        r.memory_mib_seconds,
        r.vcpu_seconds,
        r.paused_seconds,
        r.disk_gib_hours,
        r.snapshot_gib_hours,
        r.volume_gib_hours,
        r.egress_bytes.min(i64::MAX as u64) as i64,
        r.commands.min(i64::MAX as u64) as i64,
    )
}

/// Adds `r`'s figures to `owner`'s running totals.
fn add_totals(c: &Connection, owner: &str, r: &UsageRow) -> Result<()> {
    let v = totals_values(r);
    c.execute_c(
        &format!("INSERT INTO usage_totals ({TOTALS_COLUMNS}) VALUES ({}) {TOTALS_ADD}", placeholders(1, 9)),
        params![owner, v.0, v.1, v.2, v.3, v.4, v.5, v.6, v.7],
    )?;
    Ok(())
}

fn insert_interval(c: &Connection, i: &UsageInterval) -> Result<()> {
    c.execute_c(
        &format!("INSERT INTO usage_intervals ({USAGE_COLUMNS}) VALUES ({})", placeholders(1, 10)),
        params![
            i.owner,
            i.kind.as_str(),
            i.subject,
            i.sandbox_id,
            i.template,
            i.memory_mb as i64,
            i.vcpus,
            i.size_bytes as i64,
            i.start,
            i.end
        ],
    )?;
    Ok(())
}

/// Whether two intervals bill the same (so one need not end for the other).
pub(crate) fn bills_alike(a: &UsageInterval, b: &UsageInterval) -> bool {
    a.kind == b.kind
        && a.owner == b.owner
        && a.memory_mb == b.memory_mb
        && a.vcpus == b.vcpus
        && a.size_bytes == b.size_bytes
        && a.template == b.template
}

/// Replaces `subject`'s open interval by `open` (None: ends it) at `at`,
/// unless it already bills alike.
fn mark_in(c: &mut Connection, subject: &str, open: Option<UsageInterval>, at: i64) -> Result<()> {
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    if mark_tx(&tx, subject, open, at)? {
        tx.commit()?;
    }
    Ok(())
}

/// [`mark_in`] in the caller's transaction: true when it wrote.
fn mark_tx(tx: &Connection, subject: &str, open: Option<UsageInterval>, at: i64) -> Result<bool> {
    let current = open_interval(tx, subject)?;
    match (&current, &open) {
        (Some((_, cur)), Some(new)) if bills_alike(cur, new) => return Ok(false),
        (None, None) => return Ok(false),
        _ => {}
    }
    let mut start = at;
    if let Some((id, cur)) = &current {
        close_interval(tx, *id, cur, at)?;
        start = at.max(cur.start);
    }
    if let Some(mut new) = open {
        new.start = start;
        new.end = None;
        insert_interval(tx, &new)?;
    }
    Ok(true)
}

/// A sandbox's usage interval follows its record, in the transaction
/// that wrote the record, when the caller asked for it (`at`). A mark
/// that fails (a ledger row the store cannot read) is logged and undone
/// alone, within a savepoint: metering never blocks a state change.
fn mark_sandbox_tx(tx: &Connection, sb: &SandboxRecord, at: Option<i64>) -> Result<()> {
    let Some(at) = at else { return Ok(()) };
    tx.execute_c("SAVEPOINT usage_mark", [])?;
    match mark_tx(tx, &sb.id, UsageInterval::of_sandbox(sb, at), at) {
        Ok(_) => {
            tx.execute_c("RELEASE usage_mark", [])?;
        }
        Err(e) => {
            tracing::warn!("usage: sandbox {}: {e}", sb.id);
            tx.execute_batch("ROLLBACK TO usage_mark; RELEASE usage_mark")?;
        }
    }
    Ok(())
}

fn insert_key(c: &Connection, k: &KeyRecord) -> Result<()> {
    c.execute_c(
        &format!("INSERT INTO api_keys ({KEY_COLUMNS}) VALUES ({})", placeholders(1, 12)),
        params![
            k.id,
            k.name,
            k.hash,
            k.admin as i64,
            k.created_at,
            k.revoked_at,
            k.quotas.sandboxes.map(|v| v as i64),
            k.quotas.memory_mb.map(|v| v as i64),
            k.quotas.disk_mib.map(|v| v as i64),
            k.quotas.ttl_seconds.map(|v| v as i64),
            k.quotas.builds.map(|v| v as i64),
            k.quotas.snapshots.map(|v| v as i64)
        ],
    )
    .map_err(conflict)?;
    Ok(())
}

impl Store for SqliteStore {
    fn quick_reads(&self) -> Option<&dyn QuickReads> {
        self.reader.as_ref().map(|r| r as &dyn QuickReads)
    }

    fn insert_key(&self, k: &KeyRecord) -> Result<()> {
        self.with(|c| insert_key(c, k))
    }

    fn insert_first_key(&self, k: &KeyRecord) -> Result<bool> {
        self.with(|c| {
            // IMMEDIATE: the count and the insert are one writer's.
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if tx.query_row_c("SELECT COUNT(*) FROM api_keys", [], |r| r.get::<_, i64>(0))? > 0 {
                return Ok(false);
            }
            insert_key(&tx, k)?;
            tx.commit()?;
            Ok(true)
        })
    }

    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = ?1"), [id], key_row).optional()?)
        })
    }

    fn list_keys(&self) -> Result<Vec<KeyRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!("SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"))?;
            let rows = st.query_map([], key_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn revoke_key(&self, id: &str, at: i64) -> Result<bool> {
        self.with(|c| {
            let n = c.execute_c(
                "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
                params![id, at],
            )?;
            Ok(n == 1)
        })
    }

    fn set_sandbox_idle(&self, id: &str, timeout_s: u64, on_idle: &str) -> Result<()> {
        self.with(|c| {
            c.execute_c(
                "UPDATE sandboxes SET idle_timeout_s = ?2, on_idle = ?3 WHERE id = ?1",
                params![id, timeout_s as i64, on_idle],
            )?;
            Ok(())
        })
    }

    fn sandbox_idle_all(&self, node: Option<&str>) -> Result<Vec<(String, u64, String)>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&idle_all_sql())?;
            let rows = st
                .query_map([node], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64, r.get(2)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn grant_secret(&self, id: &str) -> Result<Option<Option<String>>> {
        self.with(|c| {
            Ok(c.query_row_c("SELECT grant_secret FROM api_keys WHERE id = ?1 AND revoked_at IS NULL", [id], |r| {
                r.get::<_, Option<String>>(0)
            })
            .optional()?)
        })
    }

    fn set_grant_secret(&self, id: &str, secret: &str, only_if_unset: bool) -> Result<bool> {
        self.with(|c| {
            let sql = if only_if_unset {
                "UPDATE api_keys SET grant_secret = ?2 WHERE id = ?1 AND revoked_at IS NULL AND grant_secret IS NULL"
            } else {
                "UPDATE api_keys SET grant_secret = ?2 WHERE id = ?1 AND revoked_at IS NULL"
            };
            Ok(c.execute_c(sql, params![id, secret])? == 1)
        })
    }

    fn set_quotas(&self, id: &str, q: &Quotas) -> Result<bool> {
        self.with(|c| {
            let n = c.execute_c(
                "UPDATE api_keys SET max_sandboxes = ?2, max_memory_mb = ?3, max_disk_mib = ?4, \
                 max_ttl_seconds = ?5, max_builds = ?6, max_snapshots = ?7 WHERE id = ?1 AND revoked_at IS NULL",
                params![
                    id,
                    q.sandboxes.map(|v| v as i64),
                    q.memory_mb.map(|v| v as i64),
                    q.disk_mib.map(|v| v as i64),
                    q.ttl_seconds.map(|v| v as i64),
                    q.builds.map(|v| v as i64),
                    q.snapshots.map(|v| v as i64)
                ],
            )?;
            Ok(n == 1)
        })
    }

    fn count_keys(&self) -> Result<u64> {
        self.with(|c| Ok(c.query_row_c("SELECT COUNT(*) FROM api_keys", [], |r| r.get::<_, i64>(0))? as u64))
    }

    fn insert_sandbox_claiming(
        &self,
        s: &SandboxRecord,
        admission: &Admission,
        claims: &[VolumeClaim],
        usage_at: Option<i64>,
    ) -> Result<Admitted> {
        self.with(|c| {
            // IMMEDIATE: the usage read and the insert are one writer's, so
            // two creates cannot both fit under the last free unit.
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some(closed) = node_closed(&tx, &s.node)? {
                return Ok(Admitted::NodeClosed(closed));
            }
            let asked = Usage { sandboxes: 1, memory_mb: s.memory_mb, disk_mib: s.disk_mib };
            // The host's caps count its own node's sandboxes.
            let host = usage_of(&tx, None, Some(&s.node))?;
            if let Some(e) = over(Scope::Host, &admission.host, host, asked) {
                return Ok(Admitted::Refused(e));
            }
            let own = usage_in(&tx, Some(&s.owner))?;
            if let Some(e) = over(Scope::Owner, &admission.owner, own, asked) {
                return Ok(Admitted::Refused(e));
            }
            for claim in claims {
                let exists = tx
                    .query_row_c("SELECT 1 FROM volumes WHERE id = ?1", [&claim.volume_id], |_| Ok(()))
                    .optional()?
                    .is_some();
                if !exists {
                    return Ok(Admitted::VolumeGone(claim.volume_id.clone()));
                }
                if let Some(busy) = claim_conflict(&tx, claim)? {
                    return Ok(Admitted::VolumeInUse(busy));
                }
            }
            insert_sandbox_in(&tx, s)?;
            for claim in claims {
                tx.execute_c(
                    "INSERT INTO volume_mounts (volume_id, sandbox_id, path, read_only) VALUES (?1, ?2, ?3, ?4)",
                    params![claim.volume_id, claim.sandbox_id, claim.path, claim.read_only],
                )
                .map_err(conflict)?;
            }
            mark_sandbox_tx(&tx, s, usage_at)?;
            tx.commit()?;
            Ok(Admitted::Inserted)
        })
    }

    fn sandbox_by_key(&self, owner: &str, key: &str) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(
                &format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE owner = ?1 AND idempotency_key = ?2"),
                [owner, key],
                sandbox_row,
            )
            .optional()?)
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
        self.with(|c| {
            let tx = c.transaction()?;
            let values: Vec<Value> = vec![
                id.to_owned().into(),
                to.as_str().to_owned().into(),
                ch.last_error_code.map(str::to_owned).into(),
                ch.host_pid.into(),
                ch.limits_applied.map(str::to_owned).into(),
                ch.network.map(str::to_owned).into(),
                ch.on_node.map(str::to_owned).into(),
            ];
            let states: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
            let update = "UPDATE sandboxes SET state = ?2, \
                 last_error_code = COALESCE(?3, last_error_code), host_pid = COALESCE(?4, host_pid), \
                 limits_applied = COALESCE(?5, limits_applied), network = COALESCE(?6, network) \
                 WHERE id = ?1 AND (?7 IS NULL OR node = ?7) AND state IN";
            if update_in_states(&tx, update, values, &states)? == 0 {
                return Ok(None);
            }
            let r = get_sandbox_in(&tx, id)?;
            if let Some(r) = &r {
                mark_sandbox_tx(&tx, r, ch.usage_at)?;
            }
            tx.commit()?;
            Ok(r)
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
        self.with(|c| {
            let tx = c.transaction()?;
            let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
            let update = if raise_max {
                "UPDATE sandboxes SET expires_at = ?2, max_expires_at = MAX(max_expires_at, ?2) WHERE id = ?1 AND state IN"
            } else {
                "UPDATE sandboxes SET expires_at = ?2 WHERE id = ?1 AND state IN"
            };
            if update_in_states(&tx, update, vec![id.to_owned().into(), expires_at.into()], &states)? == 0 {
                return Ok(None);
            }
            let r = get_sandbox_in(&tx, id)?;
            tx.commit()?;
            Ok(r)
        })
    }

    fn set_network(&self, id: &str, json: &str) -> Result<()> {
        self.with(|c| {
            c.execute_c("UPDATE sandboxes SET network = ?2 WHERE id = ?1", params![id, json])?;
            Ok(())
        })
    }

    fn set_net_learned(&self, id: &str, json: &str) -> Result<()> {
        self.with(|c| {
            c.execute_c("UPDATE sandboxes SET net_learned = ?2 WHERE id = ?1", params![id, json])?;
            Ok(())
        })
    }

    fn net_learned(&self, id: &str) -> Result<String> {
        self.with(|c| {
            Ok(c.query_row_c("SELECT net_learned FROM sandboxes WHERE id = ?1", [id], |r| r.get(0))
                .optional()?
                .unwrap_or_else(|| "[]".into()))
        })
    }

    fn list_sandboxes(
        &self,
        owner: Option<&str>,
        after: Option<(i64, &str)>,
        limit: u32,
        live: bool,
    ) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            let (ts, id) = after.unwrap_or((i64::MAX, ""));
            let sql = format!(
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE (?1 IS NULL OR owner = ?1) AND pooled = 0 \
                 AND (created_at < ?2 OR (created_at = ?2 AND id < ?3) OR ?4) AND (NOT ?6 OR state != ?7) \
                 ORDER BY created_at DESC, id DESC LIMIT ?5"
            );
            let mut st = c.prepare_cached(&sql)?;
            let ended = SandboxState::Terminated.as_str();
            let rows = st
                .query_map(params![owner, ts, id, after.is_none(), limit as i64, live, ended], sandbox_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn sandboxes_on(&self, node: Option<&str>, states: &[SandboxState]) -> Result<Vec<SandboxRecord>> {
        self.with(|c| sandboxes_with(c, SANDBOX_COLUMNS, node, states, sandbox_row, |r| (r.created_at, &r.id)))
    }

    fn briefs_on(&self, node: Option<&str>, states: &[SandboxState]) -> Result<Vec<SandboxBrief>> {
        self.with(|c| sandboxes_with(c, BRIEF_COLUMNS, node, states, brief_row, |b| (b.created_at, &b.id)))
    }

    fn count_by_state(&self) -> Result<Vec<(SandboxState, u64)>> {
        self.with(|c| {
            // Live sandboxes by the state index; ended ones by the counts
            // the triggers of migration 0029 keep, not by their rows.
            let mut st = c.prepare_cached(&count_by_state_sql())?;
            let rows = st
                .query_map([], |r| {
                    Ok((parsed(r, 0, "sandbox state", SandboxState::parse)?, r.get::<_, i64>(1)? as u64))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn usage(&self, owner: Option<&str>) -> Result<Usage> {
        self.with(|c| usage_in(c, owner))
    }

    fn begin_exec(&self, scope: &str, key: &str, request_hash: &str, now: i64, node: &str) -> Result<Begin> {
        self.with(|c| {
            let tx = c.transaction()?;
            let existing = tx
                .query_row_c(
                    "SELECT scope, key, request_hash, state, result, created_at FROM executions WHERE scope = ?1 AND key = ?2",
                    [scope, key],
                    exec_row,
                )
                .optional()?;
            if let Some(e) = existing {
                return Ok(Begin::Existing(e));
            }
            tx.execute_c(
                "INSERT INTO executions (scope, key, request_hash, state, result, created_at, node) \
                 VALUES (?1, ?2, ?3, 'running', NULL, ?4, ?5)",
                params![scope, key, request_hash, now, node],
            )?;
            tx.commit()?;
            Ok(Begin::Started)
        })
    }

    fn finish_exec(&self, scope: &str, key: &str, result: &str) -> Result<()> {
        self.with(|c| {
            c.execute_c(
                "UPDATE executions SET state = 'done', result = ?3 WHERE scope = ?1 AND key = ?2",
                params![scope, key, result],
            )?;
            Ok(())
        })
    }

    fn release_exec(&self, scope: &str, key: &str) -> Result<()> {
        self.with(|c| {
            c.execute_c("DELETE FROM executions WHERE scope = ?1 AND key = ?2 AND state = 'running'", [scope, key])?;
            Ok(())
        })
    }

    fn mark_running_execs_lost(&self, node: &str) -> Result<u64> {
        self.with(|c| {
            let sql = "UPDATE executions SET state = 'lost' WHERE state = 'running' AND (node = ?1 OR node IS NULL)";
            Ok(c.execute_c(sql, [node])? as u64)
        })
    }

    fn insert_template(&self, t: &TemplateRecord) -> Result<()> {
        self.with(|c| {
            let values = template_values(t);
            c.execute_c(
                &format!("INSERT INTO templates ({TEMPLATE_COLUMNS}) VALUES ({})", placeholders(1, values.len())),
                params_from_iter(values),
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn get_template(&self, id: &str) -> Result<Option<TemplateRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(&format!("SELECT {TEMPLATE_COLUMNS} FROM templates WHERE id = ?1"), [id], template_row)
                .optional()?)
        })
    }

    fn list_templates(&self, owner: Option<&str>) -> Result<Vec<TemplateRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE (?1 IS NULL OR owner = ?1) AND deleted_at IS NULL \
                 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map(params![owner], template_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn update_template(&self, t: &TemplateRecord, updated_at: i64) -> Result<bool> {
        self.with(|c| {
            // Every column from the record (the same list an insert
            // writes), if the row is still the version that was read.
            let mut values = template_values(t);
            let n = values.len();
            values.push(Value::from(updated_at));
            let changed = c
                .execute_c(
                    &format!(
                        "UPDATE templates SET ({TEMPLATE_COLUMNS}) = ({}) \
                         WHERE id = ?1 AND updated_at = ?{} AND deleted_at IS NULL",
                        placeholders(1, n),
                        n + 1
                    ),
                    params_from_iter(values),
                )
                .map_err(conflict)?;
            Ok(changed == 1)
        })
    }

    fn insert_snapshot(&self, snap: &SnapshotRecord, max: Option<u64>) -> Result<bool> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some(max) = max {
                let n: i64 =
                    tx.query_row_c("SELECT COUNT(*) FROM snapshots WHERE owner = ?1", [&snap.owner], |r| r.get(0))?;
                if n as u64 >= max {
                    return Ok(false);
                }
            }
            tx.execute_c(
                &format!("INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES ({})", placeholders(1, 7)),
                params![
                    snap.id,
                    snap.owner,
                    snap.name,
                    snap.sandbox_id,
                    snap.created_at,
                    snap.size_bytes as i64,
                    snap.recipe
                ],
            )
            .map_err(conflict)?;
            tx.commit()?;
            Ok(true)
        })
    }

    fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(&format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ?1"), [id], snapshot_row)
                .optional()?)
        })
    }

    fn snapshot_by_name(&self, owner: &str, name: &str) -> Result<Option<SnapshotRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(
                &format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE owner = ?1 AND name = ?2"),
                [owner, name],
                snapshot_row,
            )
            .optional()?)
        })
    }

    fn list_snapshots(&self, owner: Option<&str>) -> Result<Vec<SnapshotRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE ?1 IS NULL OR owner = ?1 ORDER BY created_at DESC, id"
            ))?;
            let rows = st.query_map([owner], snapshot_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn delete_snapshot(&self, id: &str) -> Result<bool> {
        self.with(|c| Ok(c.execute_c("DELETE FROM snapshots WHERE id = ?1", [id])? == 1))
    }

    fn insert_volume(&self, v: &VolumeRecord, admission: &Admission) -> Result<VolumeAdmitted> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some(e) = disk_fits(&tx, &v.owner, admission, v.size_mib)? {
                return Ok(VolumeAdmitted::Refused(e));
            }
            tx.execute_c(
                &format!("INSERT INTO volumes ({VOLUME_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"),
                params![v.id, v.owner, v.name, v.size_mib as i64, v.created_at, v.node],
            )
            .map_err(conflict)?;
            tx.commit()?;
            Ok(VolumeAdmitted::Written)
        })
    }

    fn get_volume(&self, id: &str) -> Result<Option<VolumeRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = ?1"), [id], volume_row)
                .optional()?)
        })
    }

    fn volume_by_name(&self, owner: &str, name: &str) -> Result<Option<VolumeRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(
                &format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE owner = ?1 AND name = ?2"),
                [owner, name],
                volume_row,
            )
            .optional()?)
        })
    }

    fn list_volumes(&self, owner: Option<&str>) -> Result<Vec<VolumeRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {VOLUME_COLUMNS} FROM volumes WHERE ?1 IS NULL OR owner = ?1 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map([owner], volume_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn resize_volume(&self, id: &str, size_mib: u64, admission: &Admission) -> Result<Option<VolumeAdmitted>> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let Some(v) = tx
                .query_row_c(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = ?1"), [id], volume_row)
                .optional()?
            else {
                return Ok(None);
            };
            if let Some(e) = disk_fits(&tx, &v.owner, admission, size_mib.saturating_sub(v.size_mib))? {
                return Ok(Some(VolumeAdmitted::Refused(e)));
            }
            tx.execute_c("UPDATE volumes SET size_mib = ?2 WHERE id = ?1", params![id, size_mib as i64])?;
            tx.commit()?;
            Ok(Some(VolumeAdmitted::Written))
        })
    }

    fn delete_volume(&self, id: &str) -> Result<VolumeDeleted> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let holder: Option<String> = tx
                .query_row_c(
                    &format!(
                        "SELECT m.sandbox_id FROM volume_mounts m JOIN sandboxes s ON s.id = m.sandbox_id \
                         WHERE m.volume_id = ?1 AND s.state IN {HOLDING} LIMIT 1"
                    ),
                    [id],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(sb) = holder {
                return Ok(VolumeDeleted::InUse(sb));
            }
            tx.execute_c("DELETE FROM volume_mounts WHERE volume_id = ?1", [id])?;
            let n = tx.execute_c("DELETE FROM volumes WHERE id = ?1", [id])?;
            tx.commit()?;
            Ok(if n == 1 { VolumeDeleted::Deleted } else { VolumeDeleted::NotFound })
        })
    }

    fn volume_claims(&self, sandbox_id: &str) -> Result<Vec<VolumeClaim>> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT volume_id, sandbox_id, path, read_only FROM volume_mounts WHERE sandbox_id = ?1 ORDER BY path",
            )?;
            let rows = st.query_map([sandbox_id], claim_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn volume_holders(&self, volume_id: &str) -> Result<Vec<VolumeClaim>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT m.volume_id, m.sandbox_id, m.path, m.read_only FROM volume_mounts m \
                 JOIN sandboxes s ON s.id = m.sandbox_id WHERE m.volume_id = ?1 AND s.state IN {HOLDING} \
                 ORDER BY s.created_at, s.id"
            ))?;
            let rows = st.query_map([volume_id], claim_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn volume_usage(&self, owner: Option<&str>) -> Result<(u64, u64)> {
        self.with(|c| {
            Ok(c.query_row_c(
                "SELECT COUNT(*), COALESCE(SUM(size_mib), 0) FROM volumes WHERE ?1 IS NULL OR owner = ?1",
                [owner],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
            )?)
        })
    }

    fn insert_build(&self, b: &BuildRecord, max_running: Option<u64>) -> Result<bool> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some(max) = max_running {
                let n: i64 = tx.query_row_c(
                    "SELECT COUNT(*) FROM builds WHERE state IN ('queued', 'building') AND owner = ?1",
                    [&b.owner],
                    |r| r.get(0),
                )?;
                if n as u64 >= max {
                    return Ok(false);
                }
            }
            tx.execute_c(
                &format!("INSERT INTO builds ({BUILD_COLUMNS}) VALUES ({})", placeholders(1, 11)),
                params![
                    b.id,
                    b.template_id,
                    b.owner,
                    b.state.as_str(),
                    b.created_at,
                    b.finished_at,
                    b.error,
                    b.parent,
                    b.image,
                    b.version,
                    b.node
                ],
            )
            .map_err(conflict)?;
            tx.commit()?;
            Ok(true)
        })
    }

    fn update_build(&self, b: &BuildRecord, from: &[BuildState]) -> Result<bool> {
        if from.is_empty() {
            return Ok(false);
        }
        self.with(|c| {
            let values: Vec<Value> = vec![
                b.id.clone().into(),
                b.state.as_str().to_owned().into(),
                b.finished_at.into(),
                b.error.clone().into(),
                b.image.clone().into(),
                b.version.into(),
            ];
            let states: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
            let update = "UPDATE builds SET state = ?2, finished_at = ?3, error = ?4, image = ?5, version = ?6 \
                 WHERE id = ?1 AND state IN";
            Ok(update_in_states(c, update, values, &states)? == 1)
        })
    }

    fn get_build(&self, id: &str) -> Result<Option<BuildRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(&format!("SELECT {BUILD_COLUMNS} FROM builds WHERE id = ?1"), [id], build_row)
                .optional()?)
        })
    }

    fn list_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {BUILD_COLUMNS} FROM builds WHERE template_id = ?1 ORDER BY created_at DESC, id DESC LIMIT 100"
            ))?;
            let rows = st.query_map([template_id], build_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn count_running_builds(&self, owner: Option<&str>) -> Result<u64> {
        self.with(|c| {
            let n: i64 = c.query_row_c(
                "SELECT COUNT(*) FROM builds WHERE state IN ('queued', 'building') AND (?1 IS NULL OR owner = ?1)",
                params![owner],
                |r| r.get(0),
            )?;
            Ok(n as u64)
        })
    }

    fn fail_unfinished_builds(&self, node: &str, now: i64, error: &str) -> Result<u64> {
        self.with(|c| {
            let n = c.execute_c(
                "UPDATE builds SET state = 'failed', finished_at = ?1, error = ?2 \
                 WHERE state IN ('queued', 'building') AND (node = ?3 OR node IS NULL OR node = '')",
                params![now, error, node],
            )?;
            Ok(n as u64)
        })
    }

    fn claim_warm(&self, cl: &Claim<'_>) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            let tx = c.transaction()?;
            // A draining node's pool is drained; a claim racing the drain
            // takes nothing (the insert that follows is refused).
            if node_closed(&tx, cl.node)?.is_some() {
                return Ok(None);
            }
            // The version is read in the same transaction: a sandbox of an
            // older version is never claimed, whatever raced with us.
            let id: Option<String> = tx
                .query_row_c(&claim_pick_sql(), [cl.template_id, cl.owner, cl.storage.as_str(), cl.node], |r| r.get(0))
                .optional()?;
            let Some(id) = id else { return Ok(None) };
            tx.execute_c(
                "UPDATE sandboxes SET pooled = 0, created_at = ?2, expires_at = ?3, max_expires_at = ?4, \
                 metadata = ?5, idempotency_key = ?6, request_hash = ?7, on_expire = ?8, ttl_s = ?9, \
                 paused_ttl_s = ?10 WHERE id = ?1",
                params![
                    id,
                    cl.now,
                    cl.expires_at,
                    cl.max_expires_at,
                    cl.metadata,
                    cl.idempotency_key,
                    cl.request_hash,
                    cl.on_expire.as_str(),
                    cl.ttl_s.map(|v| v as i64),
                    cl.paused_ttl_s.map(|v| v as i64)
                ],
            )
            .map_err(conflict)?;
            let r = get_sandbox_in(&tx, &id)?;
            if let Some(r) = &r {
                mark_sandbox_tx(&tx, r, Some(cl.now))?;
            }
            tx.commit()?;
            Ok(r)
        })
    }

    fn drain_pooled(&self, id: &str) -> Result<bool> {
        self.with(|c| {
            let n = c.execute_c(
                "UPDATE sandboxes SET state = 'terminating', last_error_code = 'warm_pool_drained' \
                 WHERE id = ?1 AND pooled = 1 AND state = 'running'",
                [id],
            )?;
            Ok(n == 1)
        })
    }

    fn pooled_sandboxes(&self, node: Option<&str>) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&pooled_sql())?;
            let rows = st.query_map([node], sandbox_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn append_audit(&self, rows: &[AuditRecord]) -> Result<()> {
        self.with(|c| {
            let tx = c.transaction()?;
            {
                let mut st = tx.prepare_cached(
                    "INSERT INTO audit (at, key_id, key_name, method, route, targets, client, status, error_code) \
                     VALUES (?1, ?2, COALESCE((SELECT name FROM api_keys WHERE id = ?2), ''), ?3, ?4, ?5, ?6, ?7, ?8)",
                )?;
                for r in rows {
                    st.execute(params![
                        r.at,
                        r.key_id,
                        r.method,
                        r.route,
                        r.targets,
                        r.client,
                        r.status,
                        r.error_code
                    ])?;
                }
            }
            tx.commit()?;
            Ok(())
        })
    }

    fn list_audit(&self, q: &AuditQuery) -> Result<Vec<AuditRecord>> {
        let mut sql = String::from(
            "SELECT seq, at, key_id, key_name, method, route, targets, client, status, error_code FROM audit WHERE 1 = 1",
        );
        let mut args: Vec<Value> = Vec::new();
        let arg = |sql: &mut String, args: &mut Vec<Value>, cond: &str, v: Value| {
            args.push(v);
            sql.push_str(&format!(" AND {cond} ?{}", args.len()));
        };
        if let Some(k) = &q.key {
            arg(&mut sql, &mut args, "key_id =", Value::Text(k.clone()));
        }
        if let Some(f) = q.from {
            arg(&mut sql, &mut args, "at >=", Value::Integer(f));
        }
        if let Some(t) = q.to {
            arg(&mut sql, &mut args, "at <=", Value::Integer(t));
        }
        if let Some(b) = q.before {
            arg(&mut sql, &mut args, "seq <", Value::Integer(b));
        }
        args.push(Value::Integer(i64::from(q.limit)));
        sql.push_str(&format!(" ORDER BY seq DESC LIMIT ?{}", args.len()));
        self.with(|c| {
            let mut st = c.prepare_cached(&sql)?;
            let rows = st
                .query_map(params_from_iter(args), |r| {
                    Ok(AuditRecord {
                        seq: r.get(0)?,
                        at: r.get(1)?,
                        key_id: r.get(2)?,
                        key_name: r.get(3)?,
                        method: r.get(4)?,
                        route: r.get(5)?,
                        targets: r.get(6)?,
                        client: r.get(7)?,
                        status: r.get(8)?,
                        error_code: r.get(9)?,
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn prune_audit(&self, before: i64) -> Result<u64> {
        self.with(|c| Ok(c.execute_c("DELETE FROM audit WHERE at < ?1", [before])? as u64))
    }

    fn last_event_id(&self) -> Result<i64> {
        self.with(crate::sqlite_events::last_event_id)
    }

    fn append_events(&self, rows: &mut [EventRecord]) -> Result<u64> {
        self.with(|c| crate::sqlite_events::append_events(c, rows))
    }

    fn list_events(&self, q: &EventQuery) -> Result<Vec<EventRecord>> {
        self.with(|c| crate::sqlite_events::list_events(c, q))
    }

    fn prune_events(&self, before: i64) -> Result<u64> {
        self.with(|c| crate::sqlite_events::prune_events(c, before))
    }

    fn prune_sandboxes(&self, before: i64, batch: u32) -> Result<u64> {
        self.with(|c| {
            let tx = c.transaction()?;
            let ids: Vec<String> = {
                let mut st = tx.prepare_cached(&prune_pick_sql())?;
                let rows = st.query_map(params![before, batch], |r| r.get(0))?;
                rows.collect::<rusqlite::Result<_>>()?
            };
            for id in &ids {
                tx.execute_c("DELETE FROM volume_mounts WHERE sandbox_id = ?1", [id])?;
                tx.execute_c("DELETE FROM executions WHERE scope = ?1", [id])?;
                tx.execute_c("DELETE FROM sandboxes WHERE id = ?1", [id])?;
            }
            tx.commit()?;
            Ok(ids.len() as u64)
        })
    }

    fn insert_webhook(&self, w: &WebhookRecord, max: u64) -> Result<bool> {
        self.with(|c| crate::sqlite_events::insert_webhook(c, w, max))
    }

    fn get_webhook(&self, id: &str) -> Result<Option<WebhookRecord>> {
        self.with(|c| crate::sqlite_events::get_webhook(c, id))
    }

    fn list_webhooks(&self, owner: Option<&str>) -> Result<Vec<WebhookRecord>> {
        self.with(|c| crate::sqlite_events::list_webhooks(c, owner))
    }

    fn delete_webhook(&self, id: &str) -> Result<bool> {
        self.with(|c| crate::sqlite_events::delete_webhook(c, id))
    }

    fn update_webhook(&self, w: &WebhookRecord) -> Result<bool> {
        self.with(|c| crate::sqlite_events::update_webhook(c, w))
    }

    fn list_deliveries(&self, webhook_id: &str, before: Option<i64>, limit: u32) -> Result<Vec<DeliveryRecord>> {
        self.with(|c| crate::sqlite_events::list_deliveries(c, webhook_id, before, limit))
    }

    fn claim_deliveries(
        &self,
        node: &str,
        now: i64,
        until: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
        self.with(|c| crate::sqlite_events::claim_deliveries(c, node, now, until, limit))
    }

    fn release_deliveries(&self, node: &str) -> Result<u64> {
        self.with(|c| {
            let sql = "UPDATE webhook_deliveries SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = ?1";
            Ok(c.execute_c(sql, [node])? as u64)
        })
    }

    fn next_delivery_at(&self) -> Result<Option<i64>> {
        self.with(crate::sqlite_events::next_delivery_at)
    }

    fn record_attempt(&self, id: i64, node: &str, a: &Attempt) -> Result<bool> {
        self.with(|c| crate::sqlite_events::record_attempt(c, id, node, a))
    }

    fn usage_mark(&self, sb: &SandboxRecord, at: i64) -> Result<()> {
        self.with(|c| mark_in(c, &sb.id, UsageInterval::of_sandbox(sb, at), at))
    }

    fn usage_mark_object(&self, open: Option<&UsageInterval>, subject: &str, at: i64) -> Result<()> {
        self.with(|c| mark_in(c, subject, open.cloned(), at))
    }

    fn usage_lost(&self, sandbox_id: &str, at: i64) -> Result<()> {
        self.with(|c| {
            let Some((_, cur)) = open_interval(c, sandbox_id)? else { return Ok(()) };
            if cur.kind == UsageKind::Held {
                return Ok(());
            }
            mark_in(c, sandbox_id, Some(UsageInterval { kind: UsageKind::Held, ..cur }), at)
        })
    }

    fn usage_flush(&self, counts: &[UsageCount], node: &str, alive_at: i64) -> Result<()> {
        self.with(|c| {
            let tx = c.transaction()?;
            {
                let mut st = tx.prepare_cached(
                    "INSERT INTO usage_counts (owner, sandbox_id, template, at, commands, egress_bytes) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )?;
                for n in counts.iter().filter(|n| n.commands > 0 || n.egress_bytes > 0) {
                    st.execute(params![
                        n.owner,
                        n.sandbox_id,
                        n.template,
                        n.at,
                        n.commands.min(i64::MAX as u64) as i64,
                        n.egress_bytes.min(i64::MAX as u64) as i64
                    ])?;
                }
            }
            for (owner, counted) in crate::usage::counts_by_owner(counts) {
                add_totals(&tx, owner, &counted)?;
            }
            tx.execute_c(
                "INSERT INTO usage_node_clock (node, alive_at) VALUES (?1, ?2) \
                 ON CONFLICT (node) DO UPDATE SET alive_at = MAX(alive_at, excluded.alive_at)",
                params![node, alive_at],
            )?;
            tx.commit()?;
            Ok(())
        })
    }

    fn usage_alive_at(&self, node: &str) -> Result<Option<i64>> {
        self.with(|c| {
            Ok(c.query_row_c(
                "SELECT COALESCE((SELECT alive_at FROM usage_node_clock WHERE node = ?1), \
                 (SELECT alive_at FROM usage_clock WHERE id = 1))",
                [node],
                |r| r.get(0),
            )?)
        })
    }

    fn usage_report(&self, q: &UsageQuery) -> Result<Vec<UsageRow>> {
        self.with(|c| {
            // Summed as read: the report holds a row per group, never the
            // window's intervals (a year of a busy key is millions).
            let mut sum = crate::usage::Aggregate::new(q);
            let mut st = c.prepare_cached(&format!(
                "SELECT {USAGE_COLUMNS} FROM usage_intervals WHERE (?1 IS NULL OR owner = ?1) \
                 AND start_ms < ?3 AND (end_ms IS NULL OR end_ms > ?2) ORDER BY id"
            ))?;
            for i in st.query_map(params![q.owner, q.from, q.to], usage_row)? {
                sum.interval(&i?);
            }
            let mut st = c.prepare_cached(
                "SELECT owner, sandbox_id, template, at, commands, egress_bytes FROM usage_counts \
                 WHERE (?1 IS NULL OR owner = ?1) AND at >= ?2 AND at < ?3 ORDER BY id",
            )?;
            let counts = st.query_map(params![q.owner, q.from, q.to], |r| {
                Ok(UsageCount {
                    owner: r.get(0)?,
                    sandbox_id: r.get(1)?,
                    template: r.get(2)?,
                    at: r.get(3)?,
                    commands: r.get::<_, i64>(4)? as u64,
                    egress_bytes: r.get::<_, i64>(5)? as u64,
                })
            })?;
            for n in counts {
                sum.count(&n?);
            }
            Ok(sum.rows())
        })
    }

    fn usage_totals(&self, owner: Option<&str>, now: i64) -> Result<Vec<UsageRow>> {
        self.with(|c| {
            let tx = c.transaction()?;
            let totals = {
                let mut st = tx.prepare_cached(&format!(
                    "SELECT {TOTALS_COLUMNS} FROM usage_totals WHERE (?1 IS NULL OR owner = ?1)"
                ))?;
                let rows = st.query_map([owner], |r| {
                    Ok(UsageRow {
                        key: r.get(0)?,
                        group: None,
                        memory_mib_seconds: r.get(1)?,
                        vcpu_seconds: r.get(2)?,
                        paused_seconds: r.get(3)?,
                        disk_gib_hours: r.get(4)?,
                        snapshot_gib_hours: r.get(5)?,
                        volume_gib_hours: r.get(6)?,
                        egress_bytes: r.get::<_, i64>(7)?.max(0) as u64,
                        commands: r.get::<_, i64>(8)?.max(0) as u64,
                    })
                })?;
                rows.collect::<rusqlite::Result<Vec<_>>>()?
            };
            let open = {
                let mut st = tx.prepare_cached(&open_intervals_sql())?;
                let rows = st.query_map([owner], usage_row)?;
                rows.collect::<rusqlite::Result<Vec<_>>>()?
            };
            Ok(crate::usage::totals_until(totals, &open, now))
        })
    }

    fn usage_open_subjects(&self) -> Result<Vec<(UsageKind, String)>> {
        self.with(|c| {
            let mut st =
                c.prepare_cached("SELECT kind, subject FROM usage_intervals WHERE end_ms IS NULL ORDER BY id")?;
            let rows = st
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows.into_iter().filter_map(|(k, s)| Some((UsageKind::parse(&k)?, s))).collect())
        })
    }

    fn register_node(&self, n: &NodeRecord) -> Result<()> {
        self.with(|c| {
            c.execute_c(
                &format!(
                    "INSERT INTO nodes ({NODE_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'active', ?7, ?8) \
                     ON CONFLICT (name) DO UPDATE SET advertise = excluded.advertise, \
                     memory_mib = excluded.memory_mib, disk_mib = excluded.disk_mib, \
                     sandboxes = excluded.sandboxes, classes = excluded.classes, \
                     state = CASE WHEN nodes.state = 'draining' THEN 'draining' ELSE 'active' END, \
                     started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at"
                ),
                params![
                    n.name,
                    n.advertise,
                    n.memory_mib as i64,
                    n.disk_mib as i64,
                    n.sandboxes as i64,
                    n.classes.join(","),
                    n.started_at,
                    n.heartbeat_at
                ],
            )?;
            Ok(())
        })
    }

    fn heartbeat_node(&self, name: &str, at: i64) -> Result<Option<NodeState>> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            tx.execute_c("UPDATE nodes SET heartbeat_at = ?2 WHERE name = ?1 AND state != 'lost'", params![name, at])?;
            let state: Option<String> =
                tx.query_row_c("SELECT state FROM nodes WHERE name = ?1", [name], |r| r.get(0)).optional()?;
            tx.commit()?;
            state
                .map(|s| {
                    NodeState::parse(&s).ok_or_else(|| StoreError::Corrupt {
                        what: "node state",
                        id: name.to_owned(),
                        value: s.clone(),
                    })
                })
                .transpose()
        })
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY name"))?;
            let rows = st.query_map([], node_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn mark_node_lost(&self, loss: &NodeLoss<'_>) -> Result<Option<Vec<SandboxRecord>>> {
        self.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let won = tx.execute_c(
                "UPDATE nodes SET state = 'lost' WHERE name = ?1 AND state != 'lost' AND heartbeat_at < ?2",
                params![loss.name, loss.silent_before],
            )?;
            if won == 0 {
                return Ok(None);
            }
            let states: Vec<&str> = loss.from.iter().map(|s| s.as_str()).collect();
            let ids: Vec<String> = if states.is_empty() {
                Vec::new()
            } else {
                let sql = format!(
                    "SELECT id FROM sandboxes WHERE node = ?1 AND state IN ({}) ORDER BY created_at, id",
                    placeholders(2, states.len())
                );
                let mut values: Vec<Value> = vec![loss.name.to_owned().into()];
                values.extend(states.iter().map(|s| Value::from((*s).to_owned())));
                let mut st = tx.prepare_cached(&sql)?;
                let ids = st.query_map(params_from_iter(values), |r| r.get(0))?.collect::<rusqlite::Result<_>>()?;
                ids
            };
            let mut lost = Vec::with_capacity(ids.len());
            for id in &ids {
                tx.execute_c(
                    "UPDATE sandboxes SET state = 'lost', last_error_code = ?2, reason = ?3 WHERE id = ?1",
                    params![id, loss.code, loss.reason],
                )?;
                lost.extend(get_sandbox_in(&tx, id)?);
            }
            tx.execute_c(
                "UPDATE sandboxes SET reason = ?2 WHERE node = ?1 AND state = 'paused'",
                params![loss.name, loss.paused_reason],
            )?;
            tx.commit()?;
            Ok(Some(lost))
        })
    }

    fn set_node_state(&self, name: &str, from: &[NodeState], to: NodeState) -> Result<bool> {
        if from.is_empty() {
            return Ok(false);
        }
        self.with(|c| {
            let states: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
            let values: Vec<Value> = vec![name.to_owned().into(), to.as_str().to_owned().into()];
            let n = update_in_states(c, "UPDATE nodes SET state = ?2 WHERE name = ?1 AND state IN", values, &states)?;
            Ok(n == 1)
        })
    }

    fn give_all_to(&self, node: &str) -> Result<u64> {
        self.with(|c| {
            let sandboxes = c.execute_c("UPDATE sandboxes SET node = ?1 WHERE node != ?1", [node])?;
            c.execute_c("UPDATE executions SET node = ?1 WHERE node IS NOT ?1", [node])?;
            c.execute_c("UPDATE builds SET node = ?1 WHERE node IS NOT ?1", [node])?;
            Ok((sandboxes + c.execute_c("UPDATE volumes SET node = ?1 WHERE node != ?1", [node])?) as u64)
        })
    }

    fn set_pushed(&self, object: Pushed, id: &str, reference: Option<&str>) -> Result<bool> {
        let sql = format!("UPDATE {} SET pushed_ref = ?2 WHERE id = ?1", object.table());
        self.with(|c| Ok(c.execute_c(&sql, params![id, reference])? == 1))
    }

    fn pushed(&self, object: Pushed, id: &str) -> Result<Option<String>> {
        let sql = format!("SELECT pushed_ref FROM {} WHERE id = ?1", object.table());
        self.with(|c| Ok(c.query_row_c(&sql, [id], |r| r.get::<_, Option<String>>(0)).optional()?.flatten()))
    }

    fn move_paused(&self, id: &str, from: &str, to: &str) -> Result<bool> {
        self.with(|c| {
            Ok(c.execute_c(
                "UPDATE sandboxes SET node = ?3 WHERE id = ?1 AND node = ?2 AND state = 'paused' \
                 AND pushed_ref IS NOT NULL",
                params![id, from, to],
            )? == 1)
        })
    }

    fn count_by_node(&self) -> Result<Vec<(String, u64)>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&count_by_node_sql())?;
            let rows = st
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn insert_secret(&self, s: &SecretRecord) -> Result<()> {
        self.with(|c| {
            c.execute_c(
                &format!(
                    "INSERT INTO secrets ({SECRET_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
                ),
                params![
                    s.id,
                    s.owner,
                    s.name,
                    s.hosts,
                    s.header,
                    s.format,
                    s.metadata,
                    s.version,
                    s.sealed,
                    s.created_at,
                    s.updated_at
                ],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn secret_by_name(&self, owner: &str, name: &str) -> Result<Option<SecretRecord>> {
        self.with(|c| {
            Ok(c.query_row_c(
                &format!("SELECT {SECRET_COLUMNS} FROM secrets WHERE owner = ?1 AND name = ?2"),
                [owner, name],
                secret_row,
            )
            .optional()?)
        })
    }

    fn list_secrets(&self, owner: Option<&str>) -> Result<Vec<SecretRecord>> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {SECRET_COLUMNS} FROM secrets WHERE ?1 IS NULL OR owner = ?1 ORDER BY owner, name"
            ))?;
            let rows = st.query_map([owner], secret_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn update_secret(&self, s: &SecretRecord) -> Result<bool> {
        self.with(|c| {
            let n = c.execute_c(
                "UPDATE secrets SET hosts = ?2, header = ?3, format = ?4, metadata = ?5, version = ?6, sealed = ?7, \
                 updated_at = ?8 WHERE id = ?1",
                params![s.id, s.hosts, s.header, s.format, s.metadata, s.version, s.sealed, s.updated_at],
            )?;
            Ok(n == 1)
        })
    }

    fn delete_secret(&self, owner: &str, name: &str) -> Result<bool> {
        self.with(|c| Ok(c.execute_c("DELETE FROM secrets WHERE owner = ?1 AND name = ?2", [owner, name])? == 1))
    }
}
