//! Usage metering: what each key's sandboxes, snapshots and volumes used,
//! accounted from recorded changes rather than samples.
//!
//! Timed usage (memory and vCPUs while running, time paused, disk layers,
//! snapshots, volumes) is a ledger of intervals in the store: each
//! transition of a sandbox ([`Control::transition`]), each insert, claim
//! or drain of one, and each snapshot or volume made, resized or deleted
//! ends the interval of what changed and opens the next
//! ([`hutch_store::Store::usage_mark`]). A report closes open intervals at
//! the time it is asked, so two reports agree on everything but the
//! seconds between them, and a restart loses nothing: the intervals are
//! on disk.
//!
//! Counted usage (commands started, bytes sent out) is gathered in memory
//! and written in batches ([`Control::flush_usage`]): when a sandbox is
//! paused or ends, before every report, and every [`FLUSH_EVERY`] by the
//! daemon. A crash loses what was counted since the last flush (at most
//! that period). Each flush also records that the daemon was alive then:
//! after a crash, the restart ends the running intervals of sandboxes that
//! did not survive at that last known moment, not at the restart.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, SandboxId};
use hutch_api::{SandboxState, UsageGroupBy, UsageReport, UsageRow};
use hutch_store::{SandboxRecord, SnapshotRecord, UsageCount, UsageGroup, UsageInterval, UsageKind, UsageQuery};
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::Mutex;

/// How often the daemon writes what it counted: what a crash can lose.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_secs(60);
/// The longest window one report covers.
const MAX_RANGE_MS: i64 = 400 * 86_400_000;
/// The window of a report that names no `from`.
const DEFAULT_RANGE_MS: i64 = 30 * 86_400_000;

/// Counts not yet written, by sandbox id.
#[derive(Default)]
pub(crate) struct Meter {
    pending: Mutex<HashMap<String, (u64, u64)>>,
    /// One flush at a time: counts are taken and written in order.
    flushing: tokio::sync::Mutex<()>,
}

impl Meter {
    fn add(&self, id: &str, commands: u64, egress: u64) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry(id.to_owned()).or_default();
        e.0 = e.0.saturating_add(commands);
        e.1 = e.1.saturating_add(egress);
    }

    /// Adds the bytes links received (as `Network::take_egress` hands
    /// them), under one lock.
    fn add_egress(&self, bytes: Vec<(String, u64)>) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for (id, b) in bytes {
            let e = p.entry(id).or_default();
            e.1 = e.1.saturating_add(b);
        }
    }
}

/// A report's time bound: RFC 3339, or Unix seconds. Pure: for fuzzing.
pub fn parse_time(what: &str, v: &str) -> Result<i64> {
    if !v.is_empty() && v.len() <= 12 && v.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(secs) = v.parse::<i64>() {
            return Ok(secs * 1000);
        }
    }
    crate::control::parse_rfc3339(v)
        .ok_or_else(|| ControlError::UsageRange(format!("{what} must be an RFC 3339 time or Unix seconds")))
}

/// The window `[from, to)` a report asks for, checked: `to` defaults to
/// `now`, `from` to 30 days before `to`. Pure: for fuzzing.
pub fn window(from: Option<&str>, to: Option<&str>, now: i64) -> Result<(i64, i64)> {
    let to = to.map(|t| parse_time("to", t)).transpose()?.unwrap_or(now);
    let from = from.map(|f| parse_time("from", f)).transpose()?.unwrap_or(to.saturating_sub(DEFAULT_RANGE_MS));
    if to <= from {
        return Err(ControlError::UsageRange("to must be after from".into()));
    }
    if to - from > MAX_RANGE_MS {
        return Err(ControlError::UsageRange("a report covers at most 400 days".into()));
    }
    Ok((from, to))
}

/// What `GET /v1/usage` asks for.
#[derive(Debug, Clone, Default)]
pub struct Filter<'a> {
    /// Another key's (admin only), or `*`: every key's.
    pub key: Option<&'a str>,
    pub from: Option<&'a str>,
    pub to: Option<&'a str>,
    pub group_by: Option<UsageGroupBy>,
}

fn view(group_by: UsageGroupBy, r: hutch_store::UsageRow) -> UsageRow {
    let (mut sandbox_id, mut template, mut day) = (None, None, None);
    match group_by {
        UsageGroupBy::Key => {}
        UsageGroupBy::Sandbox => sandbox_id = r.group,
        UsageGroupBy::Template => template = r.group,
        UsageGroupBy::Day => day = r.group,
    }
    UsageRow {
        key: r.key,
        sandbox_id,
        template,
        day,
        memory_mib_seconds: r.memory_mib_seconds,
        vcpu_seconds: r.vcpu_seconds,
        paused_seconds: r.paused_seconds,
        disk_gib_hours: r.disk_gib_hours,
        snapshot_gib_hours: r.snapshot_gib_hours,
        volume_gib_hours: r.volume_gib_hours,
        egress_bytes: r.egress_bytes,
        commands: r.commands,
    }
}

/// A snapshot's interval: its size, while it is kept.
pub(crate) fn snapshot_interval(r: &SnapshotRecord, template: Option<String>) -> UsageInterval {
    UsageInterval {
        owner: r.owner.clone(),
        kind: UsageKind::Snapshot,
        subject: r.id.clone(),
        sandbox_id: Some(r.sandbox_id.clone()),
        template,
        memory_mb: 0,
        vcpus: 0.0,
        size_bytes: r.size_bytes,
        start: r.created_at,
        end: None,
    }
}

/// A volume's interval: its size limit, while it exists.
pub(crate) fn volume_interval(r: &hutch_store::VolumeRecord) -> UsageInterval {
    UsageInterval {
        owner: r.owner.clone(),
        kind: UsageKind::Volume,
        subject: r.id.clone(),
        sandbox_id: None,
        template: None,
        memory_mb: 0,
        vcpus: 0.0,
        size_bytes: r.size_mib << 20,
        start: r.created_at,
        end: None,
    }
}

impl Control {
    /// The ledger follows a sandbox's record (after a drain). A failed
    /// write is logged: the next change of the sandbox, or the next start,
    /// brings it in line.
    pub(crate) async fn usage_mark(&self, r: &SandboxRecord) {
        let rec = r.clone();
        if let Err(e) = self.db(move |s| s.usage_mark(&rec, now_ms())).await {
            tracing::warn!("usage: sandbox {}: {e}", r.id);
        }
    }

    /// Runs `transition`, one that pauses or ends sandbox `id`, and in the
    /// same trip to the blocking pool writes what the sandbox counted so far
    /// (commands, and the bytes of links released since the last flush, its
    /// own among them), with the owner and template of the record the
    /// transition returns, in a transaction of its own after the
    /// transition's. Counts not written (no transition, or a failed write)
    /// wait in the meter for the next [`Control::flush_usage`]. Other
    /// sandboxes' counts wait for it too: reading every live link, or every
    /// counted sandbox's record, here would make each end cost as much as
    /// the sandboxes alive.
    pub(crate) async fn transition_counted<F>(&self, id: &SandboxId, transition: F) -> Result<Option<SandboxRecord>>
    where
        F: FnOnce(&dyn hutch_store::Store) -> hutch_store::Result<Option<SandboxRecord>> + Send + 'static,
    {
        let _one = self.meter.flushing.lock().await;
        if let Ok(n) = &self.network {
            // A lock and a take, no link read.
            self.meter.add_egress(n.take_egress(false));
        }
        let taken = self.meter.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(id.as_str());
        let node = self.node.name.clone();
        let done = self
            .db(move |s| {
                let moved = transition(s)?;
                let (Some(r), Some((commands, egress_bytes))) = (&moved, taken) else {
                    return Ok((moved, taken.is_none()));
                };
                let now = now_ms();
                let count = UsageCount {
                    owner: r.owner.clone(),
                    sandbox_id: r.id.clone(),
                    template: r.template.clone(),
                    at: now,
                    commands,
                    egress_bytes,
                };
                let written = match s.usage_flush(std::slice::from_ref(&count), &node, now) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!("usage: counts of {} not written ({e}); retrying with the next flush", r.id);
                        false
                    }
                };
                Ok((moved, written))
            })
            .await;
        let (moved, written) = match done {
            Ok(done) => (Ok(done.0), done.1),
            Err(e) => (Err(e), false),
        };
        if let (false, Some((commands, egress_bytes))) = (written, taken) {
            self.meter.add(id.as_str(), commands, egress_bytes);
        }
        moved
    }

    /// The ledger follows a snapshot or a volume: `open` Some while it
    /// exists (with its size), None once deleted.
    pub(crate) async fn usage_mark_object(&self, subject: &str, open: Option<UsageInterval>) {
        let sub = subject.to_owned();
        if let Err(e) = self.db(move |s| s.usage_mark_object(open.as_ref(), &sub, now_ms())).await {
            tracing::warn!("usage: {subject}: {e}");
        }
    }

    /// One more command started in sandbox `id`.
    pub(crate) fn count_command(&self, id: &SandboxId) {
        self.metrics.commands_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.meter.add(id.as_str(), 1, 0);
    }

    /// Writes what was counted (commands, and the bytes each sandbox's link
    /// received since the last read) and the daemon's liveness clock.
    pub async fn flush_usage(&self) {
        let _one = self.meter.flushing.lock().await;
        if let Ok(n) = &self.network {
            let n = n.clone();
            if let Ok(bytes) = tokio::task::spawn_blocking(move || n.take_egress(true)).await {
                self.meter.add_egress(bytes);
            }
        }
        let pending = std::mem::take(&mut *self.meter.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let now = now_ms();
        let (taken, node) = (pending.clone(), self.node.name.clone());
        let written = self
            .db(move |s| {
                let mut counts = Vec::with_capacity(taken.len());
                for (id, (commands, egress_bytes)) in taken {
                    // A sandbox whose row is gone has nobody to bill.
                    let Some(r) = s.get_sandbox(&id)? else { continue };
                    counts.push(UsageCount {
                        owner: r.owner,
                        sandbox_id: id,
                        template: r.template,
                        at: now,
                        commands,
                        egress_bytes,
                    });
                }
                s.usage_flush(&counts, &node, now)
            })
            .await;
        if let Err(e) = written {
            tracing::warn!("usage: counts not written ({e}); retrying with the next flush");
            for (id, (c, b)) in pending {
                self.meter.add(&id, c, b);
            }
        }
    }

    /// After a restart (`recover`, before anything runs): brings the ledger
    /// in line with the records. Returns when this node's last daemon was
    /// last known alive (its last flush; another node's flushes are not
    /// its), the time at which the intervals of sandboxes that did not
    /// outlive it end.
    pub(crate) async fn usage_alive_at(&self) -> Option<i64> {
        let node = self.node.name.clone();
        self.db(move |s| s.usage_alive_at(&node)).await.ok().flatten()
    }

    /// A sandbox that did not outlive the last daemon stopped running at
    /// `at` (the last daemon's last flush) as far as usage goes; its layer
    /// is kept (and billed) until it is deleted.
    pub(crate) async fn usage_lost(&self, id: &SandboxId, at: i64) {
        let sid = id.to_string();
        if let Err(e) = self.db(move |s| s.usage_lost(&sid, at)).await {
            tracing::warn!("usage: sandbox {id}: {e}");
        }
    }

    /// After a restart: open intervals whose subject ended or changed while
    /// no ledger write followed (a crash in between) are ended at `at`, and
    /// whatever has no interval yet (made before metering) gets one now.
    pub(crate) async fn usage_reconcile(&self, at: i64) -> Result<()> {
        let now = now_ms();
        let node = self.node.name.clone();
        self.db(move |s| {
            for (kind, subject) in s.usage_open_subjects()? {
                match kind {
                    UsageKind::Running | UsageKind::Paused | UsageKind::Held => match s.get_sandbox(&subject)? {
                        Some(r) if r.state == SandboxState::Terminated => s.usage_mark(&r, at)?,
                        Some(_) => {}
                        None => s.usage_mark_object(None, &subject, at)?,
                    },
                    UsageKind::Snapshot if s.get_snapshot(&subject)?.is_none() => {
                        s.usage_mark_object(None, &subject, at)?
                    }
                    UsageKind::Volume if s.get_volume(&subject)?.is_none() => {
                        s.usage_mark_object(None, &subject, at)?
                    }
                    UsageKind::Snapshot | UsageKind::Volume => {}
                }
            }
            let alive: Vec<SandboxState> =
                SandboxState::ALL.into_iter().filter(|s| *s != SandboxState::Terminated).collect();
            for r in s.sandboxes_on(Some(&node), &alive)? {
                // A state change no ledger write followed happened between
                // the last flush and the crash: `at` is the best bound.
                s.usage_mark(&r, at.max(r.created_at))?;
            }
            for v in s.list_volumes(None)? {
                s.usage_mark_object(Some(&volume_interval(&v)), &v.id, now)?;
            }
            for snap in s.list_snapshots(None)? {
                let template = s.get_sandbox(&snap.sandbox_id)?.map(|r| r.template);
                s.usage_mark_object(Some(&snapshot_interval(&snap, template)), &snap.id, now)?;
            }
            Ok(())
        })
        .await
    }

    /// `GET /v1/usage`: the caller's usage (an admin's: another key's, or
    /// with `*` every key's).
    pub async fn usage_report(&self, caller: &Caller, f: &Filter<'_>) -> Result<UsageReport> {
        let owners = caller.listing(f.key)?;
        let now = now_ms();
        let (from, to) = window(f.from, f.to, now)?;
        let group_by = f.group_by.unwrap_or(UsageGroupBy::Key);
        let group = match group_by {
            UsageGroupBy::Key => UsageGroup::Key,
            UsageGroupBy::Sandbox => UsageGroup::Sandbox,
            UsageGroupBy::Template => UsageGroup::Template,
            UsageGroupBy::Day => UsageGroup::Day,
        };
        // What was counted so far is in the report.
        self.flush_usage().await;
        let q = UsageQuery { owner: owners.filter().map(str::to_owned), from, to, now, group };
        let rows = self.db(move |s| s.usage_report(&q)).await?;
        Ok(UsageReport {
            from: rfc3339(from),
            to: rfc3339(to),
            group_by,
            rows: rows.into_iter().map(|r| view(group_by, r)).collect(),
        })
    }

    /// Per-key totals since metering began, as Prometheus counters (label:
    /// the key's id only): `owner` None is every key's. Read from the
    /// running totals and the open intervals: a scrape costs what is alive,
    /// not the host's history.
    pub(crate) async fn render_usage(&self, owner: Option<&str>, out: &mut String) -> Result<()> {
        let now = now_ms();
        let owner = owner.map(str::to_owned);
        let rows = self.db(move |s| s.usage_totals(owner.as_deref(), now)).await?;
        type Figure = fn(&hutch_store::UsageRow) -> f64;
        let figures: [(&str, &str, Figure); 8] = [
            ("memory_mib_seconds", "Memory limit (MiB) times seconds running.", |r| r.memory_mib_seconds),
            ("vcpu_seconds", "vCPU limit times seconds running.", |r| r.vcpu_seconds),
            ("paused_seconds", "Seconds sandboxes were paused or suspended.", |r| r.paused_seconds),
            ("disk_gib_hours", "Writable layer limits (GiB) times hours.", |r| r.disk_gib_hours),
            ("snapshot_gib_hours", "Snapshot sizes (GiB) times hours kept.", |r| r.snapshot_gib_hours),
            ("volume_gib_hours", "Volume sizes (GiB) times hours kept.", |r| r.volume_gib_hours),
            ("egress_bytes", "Bytes sandboxes sent out (as last flushed).", |r| r.egress_bytes as f64),
            ("commands", "Commands started (as last flushed).", |r| r.commands as f64),
        ];
        for (name, help, get) in figures {
            let _ = writeln!(out, "# HELP hutch_usage_{name}_total {help}\n# TYPE hutch_usage_{name}_total counter");
            for r in &rows {
                let _ = writeln!(out, "hutch_usage_{name}_total{{key=\"{}\"}} {}", r.key, get(r));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_checked() {
        let now = 1_000_000_000_000;
        assert_eq!(window(None, None, now).expect("default"), (now - DEFAULT_RANGE_MS, now));
        assert_eq!(window(Some("10"), Some("20"), now).expect("seconds"), (10_000, 20_000));
        assert_eq!(
            window(Some("2026-01-01T00:00:00Z"), Some("2026-01-02T00:00:00+00:00"), now).expect("rfc3339"),
            (1_767_225_600_000, 1_767_312_000_000)
        );
        for (from, to) in [("20", "10"), ("10", "10"), ("x", "10"), ("0", "40000000"), ("-5", "10"), ("", "1")] {
            let e = window(Some(from), Some(to), now).expect_err(from);
            assert_eq!(e.code(), hutch_api::ErrorCode::UsageRangeInvalid, "{from} {to}");
        }
    }
}
