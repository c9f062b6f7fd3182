//! The stores the tests run on: an in-memory SQLite database, or a
//! PostgreSQL database made for one test on the server
//! `HUTCH_TEST_POSTGRES` names (a URL or key=value pairs of a role that
//! may create databases) and dropped after it, even when it fails.

use super::*;
use crate::pg::PgStore;
use std::sync::atomic::{AtomicU32, Ordering};

pub(crate) enum Backend {
    Sqlite(Box<SqliteStore>),
    Postgres(Box<PgTestDb>),
}

impl std::ops::Deref for Backend {
    type Target = dyn Store;

    fn deref(&self) -> &(dyn Store + 'static) {
        match self {
            Backend::Sqlite(s) => s.as_ref(),
            Backend::Postgres(p) => p.store.as_ref().expect("open until dropped"),
        }
    }
}

impl Backend {
    pub(crate) fn sqlite() -> Backend {
        Backend::Sqlite(Box::new(SqliteStore::open_in_memory().expect("open")))
    }

    /// None when `HUTCH_TEST_POSTGRES` is unset (the test then passes
    /// without running: scripts/test.sh always sets it).
    pub(crate) fn postgres() -> Option<Backend> {
        let mut db = PgTestDb::create()?;
        db.store = Some(db.open());
        Some(Backend::Postgres(Box::new(db)))
    }

    /// Runs SQL around the trait, for tests of what the schema refuses.
    pub(crate) fn raw_execute(&self, sql: &str) -> std::result::Result<(), String> {
        match self {
            Backend::Sqlite(s) => s.raw_conn_for_tests().execute_batch(sql).map_err(|e| e.to_string()),
            Backend::Postgres(p) => p.store.as_ref().expect("open").raw_execute_for_tests(sql),
        }
    }
}

/// A database of one test, dropped with it.
pub(crate) struct PgTestDb {
    admin: ::postgres::Config,
    name: String,
    pub(crate) store: Option<PgStore>,
}

impl PgTestDb {
    /// A new empty database (no schema yet); None without a server.
    pub(crate) fn create() -> Option<PgTestDb> {
        let url = std::env::var("HUTCH_TEST_POSTGRES").ok().filter(|u| !u.is_empty())?;
        let admin: ::postgres::Config = url.parse().expect("HUTCH_TEST_POSTGRES is a connection URL");
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let name = format!("hutch_test_{}_{}_{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let mut c = admin.connect(::postgres::NoTls).expect("connect to HUTCH_TEST_POSTGRES");
        c.batch_execute(&format!("CREATE DATABASE {name}")).expect("create a test database");
        Some(PgTestDb { admin, name, store: None })
    }

    /// Another store on this database: its own pool, as another daemon's.
    pub(crate) fn open(&self) -> PgStore {
        let mut config = self.admin.clone();
        config.dbname(&self.name);
        PgStore::open_config(config, 4).expect("open the test database")
    }
}

impl Drop for PgTestDb {
    fn drop(&mut self) {
        self.store.take();
        if let Ok(mut c) = self.admin.connect(::postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
        }
    }
}
