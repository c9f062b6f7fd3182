//! hutch's durable state behind the [`Store`] trait, and its embedded SQLite
//! implementation. The only crate of hutch that knows SQL.
//!
//! The trait speaks in plain records (strings, integers, Unix milliseconds)
//! so that a PostgreSQL implementation can follow without touching callers.
//! Migrations live in `migrations/` and run in order at open.

use rusqlite::{params, Connection, OptionalExtension};
use std::path::Path;
use std::sync::Mutex;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("a row with this key already exists")]
    Conflict,
    #[error("database lock poisoned")]
    Poisoned,
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// An API key; `hash` is the SHA-256 (hex) of its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    pub hash: String,
    pub admin: bool,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
}

/// A sandbox as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: String,
    /// Id of the API key that created it.
    pub owner: String,
    pub template: String,
    pub state: String,
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
}

/// A template build as stored. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildRecord {
    pub id: String,
    pub template_id: String,
    pub owner: String,
    /// `queued`, `building`, `succeeded` or `failed`.
    pub state: String,
    pub created_at: i64,
    pub finished_at: Option<i64>,
    pub error: Option<String>,
    /// The image built on (`base`).
    pub parent: String,
    /// The image made and the template version it became, on success.
    pub image: Option<String>,
    pub version: Option<i64>,
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
}

/// The journal entry of an idempotent command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRecord {
    pub scope: String,
    pub key: String,
    pub request_hash: String,
    /// `running`, `done` or `lost`.
    pub state: String,
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

/// Everything hutch keeps. Implementations must be safe to share between
/// threads; each call is one transaction.
pub trait Store: Send + Sync {
    fn insert_key(&self, key: &KeyRecord) -> Result<()>;
    fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>>;
    fn list_keys(&self) -> Result<Vec<KeyRecord>>;
    /// Marks a key revoked; false when no live key has this id.
    fn revoke_key(&self, id: &str, at: i64) -> Result<bool>;
    fn count_keys(&self) -> Result<u64>;

    /// Inserts a sandbox; [`StoreError::Conflict`] when its id, or its
    /// owner's idempotency key, is taken.
    fn insert_sandbox(&self, sb: &SandboxRecord) -> Result<()>;
    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>>;
    fn sandbox_by_key(&self, owner: &str, key: &str) -> Result<Option<SandboxRecord>>;
    fn update_sandbox(&self, sb: &SandboxRecord) -> Result<()>;
    /// Addresses admitted for a sandbox by the resolver (JSON array); kept
    /// apart from `update_sandbox`, which never writes them.
    fn set_net_learned(&self, id: &str, json: &str) -> Result<()>;
    fn net_learned(&self, id: &str) -> Result<String>;
    /// Newest first; `after` is the (created_at, id) of the last row of the
    /// previous page.
    fn list_sandboxes(&self, owner: Option<&str>, after: Option<(i64, &str)>, limit: u32)
        -> Result<Vec<SandboxRecord>>;
    /// Sandboxes in any of these states, oldest first.
    fn sandboxes_in(&self, states: &[&str]) -> Result<Vec<SandboxRecord>>;
    /// How many sandboxes are in each state.
    fn count_by_state(&self) -> Result<Vec<(String, u64)>>;

    /// Takes an idempotency key for a command, or returns its entry.
    fn begin_exec(&self, scope: &str, key: &str, request_hash: &str, now: i64) -> Result<Begin>;
    /// Records a command's outcome (`result` already stripped of output
    /// when output is not kept).
    fn finish_exec(&self, scope: &str, key: &str, result: &str) -> Result<()>;
    /// Frees a key whose command never started (capacity refusal).
    fn release_exec(&self, scope: &str, key: &str) -> Result<()>;
    /// After a restart: commands that were running have lost their outcome.
    fn mark_running_execs_lost(&self) -> Result<u64>;

    /// Inserts a template; [`StoreError::Conflict`] when its owner has a
    /// live template of that name.
    fn insert_template(&self, t: &TemplateRecord) -> Result<()>;
    /// A template by id, deleted ones included.
    fn get_template(&self, id: &str) -> Result<Option<TemplateRecord>>;
    /// The owner's live template of this name.
    fn template_by_name(&self, owner: &str, name: &str) -> Result<Option<TemplateRecord>>;
    /// Live templates (of one owner, or all), oldest first.
    fn list_templates(&self, owner: Option<&str>) -> Result<Vec<TemplateRecord>>;
    /// Rewrites every field but id, owner and created_at; [`StoreError::Conflict`]
    /// on a name clash.
    fn update_template(&self, t: &TemplateRecord) -> Result<()>;

    /// Claims the oldest running pooled sandbox of the template's current
    /// version, in one transaction: it leaves the pool and its lifetime
    /// starts now. None when the pool has none ready.
    fn claim_warm(&self, claim: &Claim<'_>) -> Result<Option<SandboxRecord>>;
    /// Takes a running pooled sandbox out of its pool for draining (state
    /// `terminating`); false when a claim took it first.
    fn drain_pooled(&self, id: &str) -> Result<bool>;
    /// Pooled sandboxes (any state but terminated), oldest first.
    fn pooled_sandboxes(&self) -> Result<Vec<SandboxRecord>>;

    // Template builds.
    fn insert_build(&self, b: &BuildRecord) -> Result<()>;
    /// Writes state, finished_at, error, image and version.
    fn update_build(&self, b: &BuildRecord) -> Result<()>;
    fn get_build(&self, id: &str) -> Result<Option<BuildRecord>>;
    /// A template's builds, newest first (at most 100).
    fn list_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>>;
    /// Marks builds that a stopped daemon left queued or building as failed.
    fn fail_unfinished_builds(&self, now: i64, error: &str) -> Result<u64>;
}

/// The embedded SQLite store (WAL mode) in one file.
pub struct SqliteStore {
    conn: Mutex<Connection>,
}

const MIGRATIONS: &[(&str, &str)] = &[
    ("0001_init", include_str!("../migrations/0001_init.sql")),
    ("0002_templates", include_str!("../migrations/0002_templates.sql")),
    ("0003_builds", include_str!("../migrations/0003_builds.sql")),
    ("0004_network", include_str!("../migrations/0004_network.sql")),
];

impl SqliteStore {
    pub fn open(path: &Path) -> Result<SqliteStore> {
        let conn = Connection::open(path)?;
        Self::init(conn)
    }

    pub fn open_in_memory() -> Result<SqliteStore> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(mut conn: Connection) -> Result<SqliteStore> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
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
        Ok(SqliteStore { conn: Mutex::new(conn) })
    }

    fn with<T>(&self, f: impl FnOnce(&mut Connection) -> Result<T>) -> Result<T> {
        let mut conn = self.conn.lock().map_err(|_| StoreError::Poisoned)?;
        f(&mut conn)
    }
}

fn conflict(e: rusqlite::Error) -> StoreError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::ConstraintViolation => {
            StoreError::Conflict
        }
        _ => StoreError::Sqlite(e),
    }
}

const SANDBOX_COLUMNS: &str = "id, owner, template, state, created_at, expires_at, max_expires_at, memory_mb, vcpus, \
     disk_mib, pids, env, metadata, limits_applied, last_error_code, host_pid, idempotency_key, request_hash, \
     template_id, template_version, warm, pooled, network";

const TEMPLATE_COLUMNS: &str = "id, owner, name, version, image, class, memory_mb, vcpus, disk_mib, pids, env, \
     default_ttl_s, max_ttl_s, warm_min, warm_max, created_at, updated_at, deleted_at, startup, readiness, network";

const BUILD_COLUMNS: &str = "id, template_id, owner, state, created_at, finished_at, error, parent, image, version";

fn build_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<BuildRecord> {
    Ok(BuildRecord {
        id: r.get(0)?,
        template_id: r.get(1)?,
        owner: r.get(2)?,
        state: r.get(3)?,
        created_at: r.get(4)?,
        finished_at: r.get(5)?,
        error: r.get(6)?,
        parent: r.get(7)?,
        image: r.get(8)?,
        version: r.get(9)?,
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
    })
}

fn sandbox_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxRecord> {
    Ok(SandboxRecord {
        id: r.get(0)?,
        owner: r.get(1)?,
        template: r.get(2)?,
        state: r.get(3)?,
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
    })
}

fn key_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRecord> {
    Ok(KeyRecord {
        id: r.get(0)?,
        name: r.get(1)?,
        hash: r.get(2)?,
        admin: r.get::<_, i64>(3)? != 0,
        created_at: r.get(4)?,
        revoked_at: r.get(5)?,
    })
}

fn exec_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ExecRecord> {
    Ok(ExecRecord {
        scope: r.get(0)?,
        key: r.get(1)?,
        request_hash: r.get(2)?,
        state: r.get(3)?,
        result: r.get(4)?,
        created_at: r.get(5)?,
    })
}

impl Store for SqliteStore {
    fn insert_key(&self, k: &KeyRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO api_keys (id, name, hash, admin, created_at, revoked_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![k.id, k.name, k.hash, k.admin as i64, k.created_at, k.revoked_at],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT id, name, hash, admin, created_at, revoked_at FROM api_keys WHERE hash = ?1",
                [hash],
                key_row,
            )
            .optional()?)
        })
    }

    fn list_keys(&self) -> Result<Vec<KeyRecord>> {
        self.with(|c| {
            let mut st =
                c.prepare("SELECT id, name, hash, admin, created_at, revoked_at FROM api_keys ORDER BY created_at")?;
            let rows = st.query_map([], key_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn revoke_key(&self, id: &str, at: i64) -> Result<bool> {
        self.with(|c| {
            let n =
                c.execute("UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL", params![id, at])?;
            Ok(n == 1)
        })
    }

    fn count_keys(&self) -> Result<u64> {
        self.with(|c| Ok(c.query_row("SELECT COUNT(*) FROM api_keys", [], |r| r.get::<_, i64>(0))? as u64))
    }

    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                &format!("INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23)"),
                params![
                    s.id,
                    s.owner,
                    s.template,
                    s.state,
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
                    s.network
                ],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            Ok(c.query_row(&format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = ?1"), [id], sandbox_row)
                .optional()?)
        })
    }

    fn sandbox_by_key(&self, owner: &str, key: &str) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            Ok(c.query_row(
                &format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE owner = ?1 AND idempotency_key = ?2"),
                [owner, key],
                sandbox_row,
            )
            .optional()?)
        })
    }

    fn set_net_learned(&self, id: &str, json: &str) -> Result<()> {
        self.with(|c| {
            c.execute("UPDATE sandboxes SET net_learned = ?2 WHERE id = ?1", params![id, json])?;
            Ok(())
        })
    }

    fn net_learned(&self, id: &str) -> Result<String> {
        self.with(|c| {
            Ok(c.query_row("SELECT net_learned FROM sandboxes WHERE id = ?1", [id], |r| r.get(0))
                .optional()?
                .unwrap_or_else(|| "[]".into()))
        })
    }

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET state = ?2, expires_at = ?3, limits_applied = ?4, last_error_code = ?5, host_pid = ?6, \
                 network = ?7 WHERE id = ?1",
                params![s.id, s.state, s.expires_at, s.limits_applied, s.last_error_code, s.host_pid, s.network],
            )?;
            Ok(())
        })
    }

    fn list_sandboxes(
        &self,
        owner: Option<&str>,
        after: Option<(i64, &str)>,
        limit: u32,
    ) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            let (ts, id) = after.unwrap_or((i64::MAX, ""));
            let sql = format!(
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE (?1 IS NULL OR owner = ?1) AND pooled = 0 \
                 AND (created_at < ?2 OR (created_at = ?2 AND id < ?3) OR ?4) \
                 ORDER BY created_at DESC, id DESC LIMIT ?5"
            );
            let mut st = c.prepare(&sql)?;
            let rows = st
                .query_map(params![owner, ts, id, after.is_none(), limit as i64], sandbox_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn sandboxes_in(&self, states: &[&str]) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            let mut out = Vec::new();
            let mut st = c.prepare(&format!(
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE state = ?1 ORDER BY created_at, id"
            ))?;
            for state in states {
                out.extend(st.query_map([state], sandbox_row)?.collect::<rusqlite::Result<Vec<_>>>()?);
            }
            out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
            Ok(out)
        })
    }

    fn count_by_state(&self) -> Result<Vec<(String, u64)>> {
        self.with(|c| {
            let mut st = c.prepare("SELECT state, COUNT(*) FROM sandboxes GROUP BY state")?;
            let rows = st
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn begin_exec(&self, scope: &str, key: &str, request_hash: &str, now: i64) -> Result<Begin> {
        self.with(|c| {
            let tx = c.transaction()?;
            let existing = tx
                .query_row(
                    "SELECT scope, key, request_hash, state, result, created_at FROM executions WHERE scope = ?1 AND key = ?2",
                    [scope, key],
                    exec_row,
                )
                .optional()?;
            if let Some(e) = existing {
                return Ok(Begin::Existing(e));
            }
            tx.execute(
                "INSERT INTO executions (scope, key, request_hash, state, result, created_at) VALUES (?1, ?2, ?3, 'running', NULL, ?4)",
                params![scope, key, request_hash, now],
            )?;
            tx.commit()?;
            Ok(Begin::Started)
        })
    }

    fn finish_exec(&self, scope: &str, key: &str, result: &str) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE executions SET state = 'done', result = ?3 WHERE scope = ?1 AND key = ?2",
                params![scope, key, result],
            )?;
            Ok(())
        })
    }

    fn release_exec(&self, scope: &str, key: &str) -> Result<()> {
        self.with(|c| {
            c.execute("DELETE FROM executions WHERE scope = ?1 AND key = ?2 AND state = 'running'", [scope, key])?;
            Ok(())
        })
    }

    fn mark_running_execs_lost(&self) -> Result<u64> {
        self.with(|c| Ok(c.execute("UPDATE executions SET state = 'lost' WHERE state = 'running'", [])? as u64))
    }

    fn insert_template(&self, t: &TemplateRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                &format!(
                    "INSERT INTO templates ({TEMPLATE_COLUMNS}) VALUES \
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21)"
                ),
                params![
                    t.id,
                    t.owner,
                    t.name,
                    t.version,
                    t.image,
                    t.class,
                    t.memory_mb as i64,
                    t.vcpus,
                    t.disk_mib as i64,
                    t.pids as i64,
                    t.env,
                    t.default_ttl_s as i64,
                    t.max_ttl_s as i64,
                    t.warm_min as i64,
                    t.warm_max as i64,
                    t.created_at,
                    t.updated_at,
                    t.deleted_at,
                    t.startup,
                    t.readiness,
                    t.network
                ],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn get_template(&self, id: &str) -> Result<Option<TemplateRecord>> {
        self.with(|c| {
            Ok(c.query_row(&format!("SELECT {TEMPLATE_COLUMNS} FROM templates WHERE id = ?1"), [id], template_row)
                .optional()?)
        })
    }

    fn template_by_name(&self, owner: &str, name: &str) -> Result<Option<TemplateRecord>> {
        self.with(|c| {
            Ok(c.query_row(
                &format!(
                    "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE owner = ?1 AND name = ?2 AND deleted_at IS NULL"
                ),
                [owner, name],
                template_row,
            )
            .optional()?)
        })
    }

    fn list_templates(&self, owner: Option<&str>) -> Result<Vec<TemplateRecord>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE (?1 IS NULL OR owner = ?1) AND deleted_at IS NULL \
                 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map(params![owner], template_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn update_template(&self, t: &TemplateRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE templates SET name = ?2, version = ?3, image = ?4, class = ?5, memory_mb = ?6, vcpus = ?7, \
                 disk_mib = ?8, pids = ?9, env = ?10, default_ttl_s = ?11, max_ttl_s = ?12, warm_min = ?13, \
                 warm_max = ?14, updated_at = ?15, deleted_at = ?16, startup = ?17, readiness = ?18, \
                 network = ?19 WHERE id = ?1",
                params![
                    t.id,
                    t.name,
                    t.version,
                    t.image,
                    t.class,
                    t.memory_mb as i64,
                    t.vcpus,
                    t.disk_mib as i64,
                    t.pids as i64,
                    t.env,
                    t.default_ttl_s as i64,
                    t.max_ttl_s as i64,
                    t.warm_min as i64,
                    t.warm_max as i64,
                    t.updated_at,
                    t.deleted_at,
                    t.startup,
                    t.readiness,
                    t.network
                ],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn insert_build(&self, b: &BuildRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                &format!("INSERT INTO builds ({BUILD_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"),
                params![
                    b.id,
                    b.template_id,
                    b.owner,
                    b.state,
                    b.created_at,
                    b.finished_at,
                    b.error,
                    b.parent,
                    b.image,
                    b.version
                ],
            )
            .map_err(conflict)?;
            Ok(())
        })
    }

    fn update_build(&self, b: &BuildRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE builds SET state = ?2, finished_at = ?3, error = ?4, image = ?5, version = ?6 WHERE id = ?1",
                params![b.id, b.state, b.finished_at, b.error, b.image, b.version],
            )?;
            Ok(())
        })
    }

    fn get_build(&self, id: &str) -> Result<Option<BuildRecord>> {
        self.with(|c| {
            Ok(c.query_row(&format!("SELECT {BUILD_COLUMNS} FROM builds WHERE id = ?1"), [id], build_row).optional()?)
        })
    }

    fn list_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {BUILD_COLUMNS} FROM builds WHERE template_id = ?1 ORDER BY created_at DESC, id DESC LIMIT 100"
            ))?;
            let rows = st.query_map([template_id], build_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }

    fn fail_unfinished_builds(&self, now: i64, error: &str) -> Result<u64> {
        self.with(|c| {
            let n = c.execute(
                "UPDATE builds SET state = 'failed', finished_at = ?1, error = ?2 \
                 WHERE state IN ('queued', 'building')",
                params![now, error],
            )?;
            Ok(n as u64)
        })
    }

    fn claim_warm(&self, cl: &Claim<'_>) -> Result<Option<SandboxRecord>> {
        self.with(|c| {
            let tx = c.transaction()?;
            // The version is read in the same transaction: a sandbox of an
            // older version is never claimed, whatever raced with us.
            let id: Option<String> = tx
                .query_row(
                    "SELECT s.id FROM sandboxes s JOIN templates t ON t.id = s.template_id \
                     WHERE s.pooled = 1 AND s.state = 'running' AND s.template_id = ?1 AND s.owner = ?2 \
                     AND t.deleted_at IS NULL AND s.template_version = t.version \
                     ORDER BY s.created_at, s.id LIMIT 1",
                    [cl.template_id, cl.owner],
                    |r| r.get(0),
                )
                .optional()?;
            let Some(id) = id else { return Ok(None) };
            tx.execute(
                "UPDATE sandboxes SET pooled = 0, created_at = ?2, expires_at = ?3, max_expires_at = ?4, \
                 metadata = ?5, idempotency_key = ?6, request_hash = ?7 WHERE id = ?1",
                params![id, cl.now, cl.expires_at, cl.max_expires_at, cl.metadata, cl.idempotency_key, cl.request_hash],
            )
            .map_err(conflict)?;
            let r =
                tx.query_row(&format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = ?1"), [&id], sandbox_row)?;
            tx.commit()?;
            Ok(Some(r))
        })
    }

    fn drain_pooled(&self, id: &str) -> Result<bool> {
        self.with(|c| {
            let n = c.execute(
                "UPDATE sandboxes SET state = 'terminating', last_error_code = 'warm_pool_drained' \
                 WHERE id = ?1 AND pooled = 1 AND state = 'running'",
                [id],
            )?;
            Ok(n == 1)
        })
    }

    fn pooled_sandboxes(&self) -> Result<Vec<SandboxRecord>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE pooled = 1 AND state != 'terminated' \
                 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map([], sandbox_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, created_at: i64) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            owner: "k1".into(),
            template: "base".into(),
            state: "running".into(),
            created_at,
            expires_at: created_at + 1000,
            max_expires_at: created_at + 5000,
            memory_mb: 512,
            vcpus: 1.0,
            disk_mib: 1024,
            pids: 512,
            env: "{}".into(),
            metadata: "{}".into(),
            limits_applied: "enforced".into(),
            last_error_code: None,
            host_pid: None,
            idempotency_key: Some(format!("key-{id}")),
            request_hash: Some("h".into()),
            template_id: None,
            template_version: None,
            warm: false,
            pooled: false,
            network: "{}".into(),
        }
    }

    #[test]
    fn learned_addresses_survive_other_updates() {
        let s = SqliteStore::open_in_memory().expect("open");
        let r = sandbox("a", 1);
        s.insert_sandbox(&r).expect("insert");
        s.set_net_learned("a", "[\"198.51.100.3\"]").expect("learn");
        s.update_sandbox(&SandboxRecord { state: "suspended".into(), ..r }).expect("update");
        assert_eq!(s.net_learned("a").expect("read"), "[\"198.51.100.3\"]");
        assert_eq!(s.net_learned("missing").expect("read"), "[]");
    }

    #[test]
    fn migrations_apply_once_and_reopen_keeps_rows() {
        let dir = std::env::temp_dir().join(format!("hutch-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("hutch.db");
        {
            let s = SqliteStore::open(&path).expect("open");
            s.insert_sandbox(&sandbox("a", 1)).expect("insert");
        }
        let s = SqliteStore::open(&path).expect("reopen");
        assert_eq!(s.get_sandbox("a").expect("get").map(|r| r.id), Some("a".into()));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn listing_pages_newest_first() {
        let s = SqliteStore::open_in_memory().expect("open");
        for (i, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            s.insert_sandbox(&sandbox(id, i as i64)).expect("insert");
        }
        let page1 = s.list_sandboxes(Some("k1"), None, 2).expect("list");
        assert_eq!(page1.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["e", "d"]);
        let last = &page1[1];
        let page2 = s.list_sandboxes(Some("k1"), Some((last.created_at, &last.id)), 2).expect("list");
        assert_eq!(page2.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["c", "b"]);
        assert!(s.list_sandboxes(Some("other"), None, 10).expect("list").is_empty());
    }

    #[test]
    fn idempotency_keys_are_unique_per_owner() {
        let s = SqliteStore::open_in_memory().expect("open");
        s.insert_sandbox(&sandbox("a", 1)).expect("insert");
        let mut dup = sandbox("b", 2);
        dup.idempotency_key = Some("key-a".into());
        assert!(matches!(s.insert_sandbox(&dup), Err(StoreError::Conflict)));
        assert_eq!(s.sandbox_by_key("k1", "key-a").expect("get").map(|r| r.id), Some("a".into()));
    }

    #[test]
    fn exec_journal_begins_once_finishes_and_loses_running_on_restart() {
        let s = SqliteStore::open_in_memory().expect("open");
        assert_eq!(s.begin_exec("sb", "k", "h1", 1).expect("begin"), Begin::Started);
        match s.begin_exec("sb", "k", "h1", 2).expect("begin") {
            Begin::Existing(e) => assert_eq!(e.state, "running"),
            other => panic!("{other:?}"),
        }
        s.finish_exec("sb", "k", "{\"exit_code\":0}").expect("finish");
        match s.begin_exec("sb", "k", "h1", 3).expect("begin") {
            Begin::Existing(e) => {
                assert_eq!((e.state.as_str(), e.result.as_deref()), ("done", Some("{\"exit_code\":0}")))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.begin_exec("sb", "k2", "h", 4).expect("begin"), Begin::Started);
        assert_eq!(s.mark_running_execs_lost().expect("lost"), 1);
        s.release_exec("sb", "k2").expect("release only frees running keys");
        match s.begin_exec("sb", "k2", "h", 5).expect("begin") {
            Begin::Existing(e) => assert_eq!(e.state, "lost"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.begin_exec("sb", "k3", "h", 6).expect("begin"), Begin::Started);
        s.release_exec("sb", "k3").expect("release");
        assert_eq!(s.begin_exec("sb", "k3", "h", 7).expect("begin"), Begin::Started);
    }

    fn template(id: &str, version: i64) -> TemplateRecord {
        TemplateRecord {
            id: id.into(),
            owner: "k1".into(),
            name: "py".into(),
            version,
            image: "base".into(),
            class: "container".into(),
            memory_mb: 512,
            vcpus: 1.0,
            disk_mib: 1024,
            pids: 512,
            env: "{}".into(),
            default_ttl_s: 600,
            max_ttl_s: 3600,
            warm_min: 2,
            warm_max: 2,
            created_at: 1,
            updated_at: 1,
            deleted_at: None,
            startup: None,
            readiness: None,
            network: "{}".into(),
        }
    }

    fn pooled(id: &str, created_at: i64, version: i64) -> SandboxRecord {
        SandboxRecord {
            template_id: Some("tpl-1".into()),
            template_version: Some(version),
            warm: true,
            pooled: true,
            idempotency_key: None,
            ..sandbox(id, created_at)
        }
    }

    fn claim(now: i64) -> Claim<'static> {
        Claim {
            template_id: "tpl-1",
            owner: "k1",
            now,
            expires_at: now + 60,
            max_expires_at: now + 3600,
            metadata: "{\"a\":\"b\"}",
            idempotency_key: None,
            request_hash: "h",
        }
    }

    #[test]
    fn warm_claims_take_the_oldest_of_the_current_version_only() {
        let s = SqliteStore::open_in_memory().expect("open");
        s.insert_template(&template("tpl-1", 1)).expect("insert");
        s.insert_sandbox(&pooled("old", 1, 1)).expect("insert");
        s.insert_sandbox(&pooled("new", 2, 1)).expect("insert");
        // Pooled sandboxes are nobody's yet.
        assert!(s.list_sandboxes(Some("k1"), None, 10).expect("list").is_empty());
        let got = s.claim_warm(&claim(100)).expect("claim").expect("one ready");
        assert_eq!((got.id.as_str(), got.pooled, got.warm, got.created_at), ("old", false, true, 100));
        assert_eq!(got.metadata, "{\"a\":\"b\"}");
        assert_eq!(s.list_sandboxes(Some("k1"), None, 10).expect("list").len(), 1);
        // A new version: the remaining v1 sandbox can no longer be claimed.
        let mut t = template("tpl-1", 2);
        s.update_template(&t).expect("update");
        assert_eq!(s.claim_warm(&claim(101)).expect("claim"), None);
        // A drained one cannot be claimed either, and a deleted template has no pool.
        s.insert_sandbox(&pooled("v2", 3, 2)).expect("insert");
        assert!(s.drain_pooled("v2").expect("drain"));
        assert_eq!(s.claim_warm(&claim(102)).expect("claim"), None);
        s.insert_sandbox(&pooled("v2b", 4, 2)).expect("insert");
        t.deleted_at = Some(5);
        s.update_template(&t).expect("delete");
        assert_eq!(s.claim_warm(&claim(103)).expect("claim"), None);
        assert!(s.template_by_name("k1", "py").expect("get").is_none());
        assert_eq!(s.pooled_sandboxes().expect("pooled").len(), 3);
    }

    #[test]
    fn template_names_are_unique_among_live_templates() {
        let s = SqliteStore::open_in_memory().expect("open");
        s.insert_template(&template("tpl-1", 1)).expect("insert");
        assert!(matches!(s.insert_template(&template("tpl-2", 1)), Err(StoreError::Conflict)));
        let mut t = template("tpl-1", 1);
        t.deleted_at = Some(2);
        s.update_template(&t).expect("delete");
        s.insert_template(&template("tpl-2", 1)).expect("the name is free again");
        assert_eq!(s.list_templates(Some("k1")).expect("list").len(), 1);
    }

    #[test]
    fn builds_are_listed_newest_first_and_unfinished_ones_fail_on_restart() {
        let s = SqliteStore::open_in_memory().expect("open");
        let mut t = template("tpl-1", 1);
        t.startup = Some(r#"{"command":"serve"}"#.into());
        s.insert_template(&t).expect("template");
        assert_eq!(
            s.get_template("tpl-1").expect("get").and_then(|t| t.startup).as_deref(),
            Some(r#"{"command":"serve"}"#)
        );
        for (i, state) in ["succeeded", "building", "queued"].iter().enumerate() {
            let b = BuildRecord {
                id: format!("bld-{i}"),
                template_id: "tpl-1".into(),
                owner: "k1".into(),
                state: (*state).into(),
                created_at: i as i64,
                finished_at: None,
                error: None,
                parent: "base".into(),
                image: None,
                version: None,
            };
            s.insert_build(&b).expect("insert");
        }
        let ids: Vec<String> = s.list_builds("tpl-1").expect("list").into_iter().map(|b| b.id).collect();
        assert_eq!(ids, ["bld-2", "bld-1", "bld-0"]);
        assert_eq!(s.fail_unfinished_builds(9, "interrupted").expect("fail"), 2);
        let b = s.get_build("bld-1").expect("get").expect("some");
        assert_eq!((b.state.as_str(), b.finished_at, b.error.as_deref()), ("failed", Some(9), Some("interrupted")));
        assert_eq!(s.get_build("bld-0").expect("get").expect("some").state, "succeeded");
    }

    #[test]
    fn keys_are_found_by_hash_and_revoked() {
        let s = SqliteStore::open_in_memory().expect("open");
        let k = KeyRecord {
            id: "k1".into(),
            name: "admin".into(),
            hash: "abc".into(),
            admin: true,
            created_at: 1,
            revoked_at: None,
        };
        s.insert_key(&k).expect("insert");
        assert_eq!(s.key_by_hash("abc").expect("get"), Some(k));
        assert!(s.revoke_key("k1", 5).expect("revoke"));
        assert!(!s.revoke_key("k1", 6).expect("revoke twice"));
        assert_eq!(s.key_by_hash("abc").expect("get").and_then(|k| k.revoked_at), Some(5));
        assert_eq!(s.count_keys().expect("count"), 1);
    }
}
