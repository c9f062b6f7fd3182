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
}

/// The embedded SQLite store (WAL mode) in one file.
pub struct SqliteStore {
    conn: Mutex<Connection>,
}

const MIGRATIONS: &[(&str, &str)] = &[("0001_init", include_str!("../migrations/0001_init.sql"))];

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
     disk_mib, pids, env, metadata, limits_applied, last_error_code, host_pid, idempotency_key, request_hash";

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
                &format!("INSERT INTO sandboxes ({SANDBOX_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)"),
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
                    s.request_hash
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

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET state = ?2, expires_at = ?3, limits_applied = ?4, last_error_code = ?5, host_pid = ?6 \
                 WHERE id = ?1",
                params![s.id, s.state, s.expires_at, s.limits_applied, s.last_error_code, s.host_pid],
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
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE (?1 IS NULL OR owner = ?1) \
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
        }
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
