//! The audit log: every mutating API call, who made it, what it named,
//! when, from where and how it ended, appended to the store and read by
//! the admin key only (`GET /v1/audit`). No API changes or deletes a row;
//! only the retention prune (`hutch serve --audit-retention`) does.
//!
//! The request path never waits on the database: [`Control::audit`] puts
//! the entry on a bounded channel and returns; one writer task appends
//! what it finds there in batches, one transaction each. A full channel
//! drops the entry, counts it (`hutch_audit_dropped_total`) and logs. The
//! writer gathers entries for up to 100 ms (or 512 of them) per write. A
//! crash loses what was queued and not yet written: the batch being
//! gathered or written (about the last 100 ms of calls) and what waited
//! behind it; a clean stop writes everything queued.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId};
use hutch_api::{AuditEntry, AuditList, ErrorCode};
use hutch_store::{AuditQuery, AuditRecord, Store};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Entries waiting for the writer at most.
pub const QUEUE: usize = 8192;
/// Entries appended in one transaction at most.
const BATCH: usize = 512;
/// How long the writer gathers a batch after its first entry: what a
/// crash can lose beyond the batch being written.
const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(100);
/// Default retention of the log.
pub const DEFAULT_RETENTION: std::time::Duration = std::time::Duration::from_secs(90 * 86_400);
/// Most rows one read returns.
const PAGE_MAX: u32 = 1000;

/// One audited call, as the HTTP layer saw it.
#[derive(Debug, Clone)]
pub struct Call {
    pub key: OwnerId,
    pub method: String,
    /// The route's template, or `mcp:<tool>`.
    pub route: String,
    /// Path parameters by name.
    pub targets: BTreeMap<String, String>,
    pub client: String,
    pub status: u16,
    pub error_code: Option<ErrorCode>,
}

#[derive(Default)]
struct Counters {
    dropped: AtomicU64,
    written: AtomicU64,
    failed: AtomicU64,
}

/// The queue to the writer and its counters.
pub(crate) struct Auditor {
    tx: mpsc::Sender<AuditRecord>,
    rx: Mutex<Option<mpsc::Receiver<AuditRecord>>>,
    counters: Arc<Counters>,
    stop: Arc<tokio::sync::Notify>,
    writer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Default for Auditor {
    fn default() -> Self {
        Auditor::with_capacity(QUEUE)
    }
}

impl Auditor {
    fn with_capacity(queue: usize) -> Auditor {
        let (tx, rx) = mpsc::channel(queue);
        Auditor {
            tx,
            rx: Mutex::new(Some(rx)),
            counters: Arc::default(),
            stop: Arc::default(),
            writer: Mutex::new(None),
        }
    }

    /// Starts the writer task (once; later calls do nothing).
    fn start(&self, store: Arc<dyn Store>) {
        let Some(rx) = self.rx.lock().ok().and_then(|mut r| r.take()) else { return };
        let handle = tokio::spawn(write_loop(store, rx, self.counters.clone(), self.stop.clone()));
        if let Ok(mut w) = self.writer.lock() {
            *w = Some(handle);
        }
    }

    /// Writes what is queued and stops the writer.
    async fn finish(&self) {
        self.stop.notify_one();
        let handle = self.writer.lock().ok().and_then(|mut w| w.take());
        if let Some(h) = handle {
            let _ = h.await;
        }
    }

    /// Queues a row for the writer without waiting: a full queue drops it,
    /// counted (and logged once per power of two dropped).
    fn enqueue(&self, row: AuditRecord) {
        if let Err(e) = self.tx.try_send(row) {
            let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            // Once per power of two: a flood does not flood the log too.
            if n.is_power_of_two() {
                let why = match e {
                    mpsc::error::TrySendError::Full(_) => "its queue is full",
                    mpsc::error::TrySendError::Closed(_) => "its writer stopped",
                };
                tracing::warn!("audit log: an entry was dropped because {why} ({n} dropped so far)");
            }
        }
    }

    /// The counters in the Prometheus text format.
    pub(crate) fn render(&self, out: &mut String) {
        let c = &self.counters;
        for (name, help, v) in [
            ("hutch_audit_written_total", "Audit entries appended to the store.", &c.written),
            ("hutch_audit_dropped_total", "Audit entries dropped because the writer's queue was full.", &c.dropped),
            ("hutch_audit_failed_total", "Audit entries lost to a failed store write.", &c.failed),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
    }
}

/// Appends batches until `stop`, then what is left in the queue.
async fn write_loop(
    store: Arc<dyn Store>,
    rx: mpsc::Receiver<AuditRecord>,
    counters: Arc<Counters>,
    stop: Arc<tokio::sync::Notify>,
) {
    crate::batch::write_batches(rx, BATCH, FLUSH_EVERY, stop, |rows| {
        let (s, counters) = (store.clone(), counters.clone());
        async move {
            let n = rows.len() as u64;
            let outcome = match tokio::task::spawn_blocking(move || s.append_audit(&rows)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match outcome {
                Ok(()) => counters.written.fetch_add(n, Ordering::Relaxed),
                Err(e) => {
                    tracing::error!("audit log: {n} entries not written: {e}");
                    counters.failed.fetch_add(n, Ordering::Relaxed)
                }
            };
        }
    })
    .await;
}

/// `"<seq>"`: the cursor of the next page (the last row's place).
fn decode_cursor(c: &str) -> Result<i64> {
    c.parse::<i64>().ok().filter(|v| *v > 0).ok_or_else(|| ControlError::Invalid("invalid cursor".into()))
}

fn view(r: AuditRecord) -> AuditEntry {
    AuditEntry {
        id: r.seq as u64,
        at: rfc3339(r.at),
        key_id: r.key_id,
        key_name: r.key_name,
        method: r.method,
        route: r.route,
        targets: serde_json::from_str(&r.targets).unwrap_or_default(),
        client: r.client,
        status: r.status,
        error_code: r.error_code,
    }
}

/// What `GET /v1/audit` asks for.
#[derive(Debug, Clone, Default)]
pub struct Filter<'a> {
    pub key: Option<&'a str>,
    /// RFC 3339 bounds, inclusive.
    pub from: Option<&'a str>,
    pub to: Option<&'a str>,
    pub cursor: Option<&'a str>,
    pub limit: Option<u32>,
}

impl Control {
    /// Starts the writer task (once; later calls do nothing).
    pub fn start_audit_writer(&self) {
        self.audit.start(self.store.clone());
    }

    /// Writes what is queued and stops the writer (the daemon is stopping).
    pub async fn finish_audit(&self) {
        self.audit.finish().await;
    }

    /// Queues one call for the log; never waits (a full queue drops it,
    /// counted and logged).
    pub fn audit(&self, call: Call) {
        let row = AuditRecord {
            seq: 0,
            at: now_ms(),
            key_id: call.key.to_string(),
            key_name: String::new(),
            method: call.method,
            route: call.route,
            targets: serde_json::to_string(&call.targets).unwrap_or_else(|_| "{}".into()),
            client: call.client,
            status: call.status,
            error_code: call.error_code.map(|c| c.as_str().to_owned()),
        };
        self.audit.enqueue(row);
    }

    /// `GET /v1/audit`: the admin key's only.
    pub async fn audit_log(&self, caller: &Caller, f: &Filter<'_>) -> Result<AuditList> {
        if !caller.admin {
            return Err(ControlError::Forbidden("only an admin key may read the audit log".into()));
        }
        let time = |what: &str, v: Option<&str>| -> Result<Option<i64>> {
            v.map(|t| {
                crate::control::parse_rfc3339(t)
                    .ok_or_else(|| ControlError::Invalid(format!("{what} must be an RFC 3339 time")))
            })
            .transpose()
        };
        let limit = f.limit.unwrap_or(100);
        if !(1..=PAGE_MAX).contains(&limit) {
            return Err(ControlError::Invalid(format!("limit must be 1 to {PAGE_MAX}")));
        }
        let q = AuditQuery {
            key: f.key.map(|k| OwnerId::parse(k).map(|k| k.to_string())).transpose()?,
            from: time("from", f.from)?,
            to: time("to", f.to)?,
            before: f.cursor.map(decode_cursor).transpose()?,
            limit: limit + 1,
        };
        let mut rows = self.db(move |s| s.list_audit(&q)).await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let next_cursor = if more { rows.last().map(|r| r.seq.to_string()) } else { None };
        Ok(AuditList { entries: rows.into_iter().map(view).collect(), next_cursor })
    }

    /// Deletes rows older than `retention`; how many.
    pub async fn prune_audit(&self, retention: std::time::Duration) -> Result<u64> {
        let before = crate::control::cutoff(retention);
        self.db(move |s| s.prune_audit(before)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_store::SqliteStore;

    fn row(i: i64) -> AuditRecord {
        AuditRecord {
            seq: 0,
            at: i,
            key_id: "key-000000000001".into(),
            key_name: String::new(),
            method: "POST".into(),
            route: "/v1/sandboxes".into(),
            targets: "{}".into(),
            client: "127.0.0.1".into(),
            status: 201,
            error_code: None,
        }
    }

    /// A full queue drops (counted) instead of waiting; what was queued is
    /// written in order, and a stop writes what is left before it ends.
    #[tokio::test]
    async fn a_full_queue_drops_and_a_stop_writes_what_is_queued() {
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_in_memory().expect("open"));
        let a = Auditor::with_capacity(4);
        for i in 0..6 {
            a.enqueue(row(i));
        }
        assert_eq!(a.counters.dropped.load(Ordering::Relaxed), 2);
        a.start(store.clone());
        a.finish().await;
        let rows = store.list_audit(&AuditQuery { limit: 10, ..AuditQuery::default() }).expect("list");
        assert_eq!(rows.iter().map(|r| r.at).collect::<Vec<_>>(), [3, 2, 1, 0]);
        assert_eq!(a.counters.written.load(Ordering::Relaxed), 4);
        assert_eq!(a.counters.failed.load(Ordering::Relaxed), 0);
        // The writer has stopped: a row now is dropped and counted, not kept waiting.
        a.enqueue(row(9));
        assert_eq!(a.counters.dropped.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn cursors_are_positive_places() {
        assert_eq!(decode_cursor("42").expect("ok"), 42);
        for bad in ["", "0", "-1", "x", "1.5"] {
            assert!(decode_cursor(bad).is_err(), "{bad}");
        }
    }
}
