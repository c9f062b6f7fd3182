//! Usage metering's arithmetic: intervals of the ledger clipped to a
//! report's window, split at UTC midnight when grouped by day, and summed
//! per key and group; the running totals a scrape reads. Pure: the stores
//! only select the rows.

use std::collections::BTreeMap;

/// What an interval of the ledger measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageKind {
    /// A sandbox running: memory, vCPUs and its layer.
    Running,
    /// A sandbox paused or suspended: its layer, and paused time.
    Paused,
    /// A sandbox starting or terminating: its layer only.
    Held,
    Snapshot,
    Volume,
}

impl UsageKind {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageKind::Running => "running",
            UsageKind::Paused => "paused",
            UsageKind::Held => "held",
            UsageKind::Snapshot => "snapshot",
            UsageKind::Volume => "volume",
        }
    }

    pub fn parse(s: &str) -> Option<UsageKind> {
        [UsageKind::Running, UsageKind::Paused, UsageKind::Held, UsageKind::Snapshot, UsageKind::Volume]
            .into_iter()
            .find(|k| k.as_str() == s)
    }

    /// What a sandbox in `state` is billed as; None once it ended.
    pub fn of_state(state: crate::SandboxState) -> Option<UsageKind> {
        use crate::SandboxState as S;
        match state {
            S::Running => Some(UsageKind::Running),
            S::Paused | S::Suspended => Some(UsageKind::Paused),
            S::Starting | S::Terminating => Some(UsageKind::Held),
            S::Terminated | S::Lost => None,
        }
    }
}

/// One interval of the ledger. Times are Unix milliseconds; `end` None is
/// still open.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageInterval {
    pub owner: String,
    pub kind: UsageKind,
    /// The sandbox, snapshot or volume.
    pub subject: String,
    pub sandbox_id: Option<String>,
    pub template: Option<String>,
    pub memory_mb: u64,
    pub vcpus: f64,
    pub size_bytes: u64,
    pub start: i64,
    pub end: Option<i64>,
}

impl UsageInterval {
    /// The interval a sandbox's record bills from `at` on; None once it
    /// ended (see [`crate::Store::usage_mark`]).
    pub fn of_sandbox(sb: &crate::SandboxRecord, at: i64) -> Option<UsageInterval> {
        UsageKind::of_state(sb.state).map(|kind| UsageInterval {
            owner: sb.owner.clone(),
            kind,
            subject: sb.id.clone(),
            sandbox_id: Some(sb.id.clone()),
            template: Some(sb.template.clone()),
            memory_mb: sb.memory_mb,
            vcpus: sb.vcpus,
            size_bytes: sb.disk_mib << 20,
            start: at,
            end: None,
        })
    }
}

/// Commands and egress of one sandbox, counted since the last flush.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageCount {
    pub owner: String,
    pub sandbox_id: String,
    pub template: String,
    pub at: i64,
    pub commands: u64,
    pub egress_bytes: u64,
}

/// How a report's rows are grouped (always by key first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageGroup {
    /// One row per key.
    Key,
    Sandbox,
    Template,
    /// Per UTC day (intervals split at midnight).
    Day,
}

/// What a report covers: `[from, to)` in Unix ms; open intervals end at
/// `now`; `owner` None is every key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    pub owner: Option<String>,
    pub from: i64,
    pub to: i64,
    pub now: i64,
    pub group: UsageGroup,
}

/// One row of a report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageRow {
    pub key: String,
    /// The sandbox id, template or day (`YYYY-MM-DD`); None in a row per
    /// key, and for a volume (which is no sandbox's) grouped by sandbox or
    /// template.
    pub group: Option<String>,
    pub memory_mib_seconds: f64,
    pub vcpu_seconds: f64,
    pub paused_seconds: f64,
    pub disk_gib_hours: f64,
    pub snapshot_gib_hours: f64,
    pub volume_gib_hours: f64,
    pub egress_bytes: u64,
    pub commands: u64,
}

const DAY_MS: i64 = 86_400_000;
const GIB: f64 = (1u64 << 30) as f64;

/// `YYYY-MM-DD` of a UTC instant.
fn day_of(ms: i64) -> String {
    let s = hutch_api::time::rfc3339(ms);
    s.get(..10).unwrap_or(&s).to_owned()
}

/// `[start, end)` cut at every UTC midnight inside it.
pub fn split_days(start: i64, end: i64) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut s = start;
    while s < end {
        let midnight = (s.div_euclid(DAY_MS) + 1).saturating_mul(DAY_MS);
        let e = midnight.min(end);
        out.push((s, e));
        s = e;
    }
    out
}

fn group_of(group: UsageGroup, sandbox: Option<&str>, template: Option<&str>, at: i64) -> Option<String> {
    match group {
        UsageGroup::Key => None,
        UsageGroup::Sandbox => sandbox.map(str::to_owned),
        UsageGroup::Template => template.map(str::to_owned),
        UsageGroup::Day => Some(day_of(at)),
    }
}

impl UsageRow {
    /// Adds what interval `i` measures over `[start, end)`, a part of it
    /// (the one place the ledger's figures are worked out: reports and the
    /// running totals both charge through here).
    pub fn charge(&mut self, i: &UsageInterval, start: i64, end: i64) {
        if end <= start {
            return;
        }
        let secs = (end - start) as f64 / 1000.0;
        let gib_hours = i.size_bytes as f64 / GIB * secs / 3600.0;
        match i.kind {
            UsageKind::Running => {
                self.memory_mib_seconds += i.memory_mb as f64 * secs;
                self.vcpu_seconds += i.vcpus * secs;
                self.disk_gib_hours += gib_hours;
            }
            UsageKind::Paused => {
                self.paused_seconds += secs;
                self.disk_gib_hours += gib_hours;
            }
            UsageKind::Held => self.disk_gib_hours += gib_hours,
            UsageKind::Snapshot => self.snapshot_gib_hours += gib_hours,
            UsageKind::Volume => self.volume_gib_hours += gib_hours,
        }
    }

    /// Adds a count of commands and egress.
    pub fn count(&mut self, c: &UsageCount) {
        self.commands = self.commands.saturating_add(c.commands);
        self.egress_bytes = self.egress_bytes.saturating_add(c.egress_bytes);
    }
}

/// A report being summed as the store reads the ledger, row by row: it
/// holds one entry per key and group, never the rows it read.
/// Intervals are clipped to `[q.from, q.to)`, an open one ends at `q.now`
/// (or `q.to`, whichever is first); counts are taken when `at` falls in the
/// window.
pub struct Aggregate<'q> {
    q: &'q UsageQuery,
    rows: BTreeMap<(String, Option<String>), UsageRow>,
}

impl<'q> Aggregate<'q> {
    pub fn new(q: &'q UsageQuery) -> Aggregate<'q> {
        Aggregate { q, rows: BTreeMap::new() }
    }

    fn row(&mut self, key: &str, group: Option<String>) -> &mut UsageRow {
        self.rows.entry((key.to_owned(), group.clone())).or_insert_with(|| UsageRow {
            key: key.to_owned(),
            group,
            ..UsageRow::default()
        })
    }

    pub fn interval(&mut self, i: &UsageInterval) {
        let q = self.q;
        if q.owner.as_deref().is_some_and(|o| o != i.owner) {
            return;
        }
        let start = i.start.max(q.from);
        let end = i.end.unwrap_or(q.now).min(q.to);
        if end <= start {
            return;
        }
        let pieces = if q.group == UsageGroup::Day { split_days(start, end) } else { vec![(start, end)] };
        for (s, e) in pieces {
            let group = group_of(q.group, i.sandbox_id.as_deref(), i.template.as_deref(), s);
            self.row(&i.owner, group).charge(i, s, e);
        }
    }

    pub fn count(&mut self, c: &UsageCount) {
        let q = self.q;
        if q.owner.as_deref().is_some_and(|o| o != c.owner) || c.at < q.from || c.at >= q.to {
            return;
        }
        let group = group_of(q.group, Some(&c.sandbox_id), Some(&c.template), c.at);
        self.row(&c.owner, group).count(c);
    }

    /// The rows, ordered by key then group.
    pub fn rows(self) -> Vec<UsageRow> {
        self.rows.into_values().collect()
    }
}

/// The counts of one flush summed per key, for the running totals.
pub fn counts_by_owner(counts: &[UsageCount]) -> BTreeMap<&str, UsageRow> {
    let mut out: BTreeMap<&str, UsageRow> = BTreeMap::new();
    for c in counts.iter().filter(|c| c.commands > 0 || c.egress_bytes > 0) {
        out.entry(&c.owner).or_default().count(c);
    }
    out
}

/// Per key, the running totals (what closed intervals measured and every
/// count) with the open intervals charged up to `now`: everything metered
/// since metering began, read without the ledger's history.
pub fn totals_until(totals: Vec<UsageRow>, open: &[UsageInterval], now: i64) -> Vec<UsageRow> {
    let mut rows: BTreeMap<String, UsageRow> = totals.into_iter().map(|r| (r.key.clone(), r)).collect();
    for i in open {
        let row =
            rows.entry(i.owner.clone()).or_insert_with(|| UsageRow { key: i.owner.clone(), ..UsageRow::default() });
        row.charge(i, i.start, now);
    }
    rows.into_values().collect()
}
