//! Each live sandbox's recent history, kept in the daemon's memory for the
//! E2B API's metrics and logs: metric samples (the daemon takes one of
//! every running sandbox every [`SAMPLE_EVERY`], and one when it starts;
//! at most [`SAMPLES`] each, the oldest give way) and a log of what
//! happened to it and the commands it ran (at most [`LOG_ENTRIES`], each
//! message at most [`LOG_MESSAGE`] bytes). Both end with the sandbox, and
//! a daemon restart loses them: they are a window, not a record.

use crate::control::{now_ms, Control};
use crate::ids::SandboxId;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// Between two samples of a running sandbox.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Longest time between two reads of an idle sandbox's page cache and disk
/// use (`Sandbox::slow_usage`: its memory cgroup's statistics and its
/// btrfs quota group). A sample reads them when the sandbox used CPU since
/// the previous one (its agent serves every file call), else repeats the
/// previous figures until this much time passed: with thousands of idle
/// sandboxes, those reads every 5 s were most of the daemon's time.
pub const SLOW_SAMPLE_EVERY: Duration = Duration::from_secs(30);
/// Samples kept per sandbox: an hour at one every five seconds.
pub const SAMPLES: usize = 720;
/// Log entries kept per sandbox.
pub const LOG_ENTRIES: usize = 1000;
/// Longest log message kept; longer ones are cut (on a character
/// boundary) and end with an ellipsis.
pub const LOG_MESSAGE: usize = 1024;

/// One metric sample, as the E2B API shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Unix milliseconds.
    pub at_ms: i64,
    pub cpu_count: u32,
    /// CPU used since the previous sample (since the start for the first),
    /// in percent of the sandbox's CPUs.
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// How much a log entry matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<LogLevel> {
        match s {
            "debug" => Some(LogLevel::Debug),
            "info" => Some(LogLevel::Info),
            "warn" => Some(LogLevel::Warn),
            "error" => Some(LogLevel::Error),
            _ => None,
        }
    }
}

/// One entry of a sandbox's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Unix milliseconds.
    pub at_ms: i64,
    pub level: LogLevel,
    pub message: String,
    pub fields: BTreeMap<String, String>,
}

/// Which entries of a log a read wants.
#[derive(Debug, Clone, Default)]
pub struct LogQuery {
    /// Unix milliseconds, both ends included.
    pub from_ms: Option<i64>,
    pub until_ms: Option<i64>,
    /// Newest first (else oldest first).
    pub backward: bool,
    /// The least level shown.
    pub level: Option<LogLevel>,
    /// Only messages holding this (case-sensitive).
    pub search: Option<String>,
    pub limit: usize,
}

#[derive(Default)]
struct Kept {
    samples: VecDeque<Sample>,
    log: VecDeque<LogEntry>,
    /// CPU time and wall time of the last sample.
    last_cpu: Option<(i64, u64)>,
    /// When its page cache and disk use were last read (Unix ms).
    slow_at: Option<i64>,
}

/// See [`History::plan`].
#[derive(Debug, Clone, Copy)]
pub struct SamplePlan {
    due: bool,
    last_cpu_ns: Option<u64>,
}

impl SamplePlan {
    /// Whether a sample whose CPU time is `cpu_ns` reads the slow figures.
    pub fn read(&self, cpu_ns: u64) -> bool {
        self.due || self.last_cpu_ns != Some(cpu_ns)
    }
}

/// The history of every live sandbox.
#[derive(Default)]
pub struct History {
    inner: Mutex<HashMap<SandboxId, Kept>>,
}

fn cut(mut s: String) -> String {
    if s.len() > LOG_MESSAGE {
        let mut end = LOG_MESSAGE - 3;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

impl History {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Kept>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds an entry to a sandbox's log.
    pub fn log(&self, id: &SandboxId, level: LogLevel, message: impl Into<String>, fields: &[(&str, String)]) {
        let entry = LogEntry {
            at_ms: now_ms(),
            level,
            message: cut(message.into()),
            fields: fields.iter().map(|(k, v)| ((*k).to_owned(), cut(v.clone()))).collect(),
        };
        let mut all = self.lock();
        let kept = all.entry(id.clone()).or_default();
        if kept.log.len() >= LOG_ENTRIES {
            kept.log.pop_front();
        }
        kept.log.push_back(entry);
    }

    /// What a sample at `at_ms` needs to tell whether it reads the
    /// sandbox's page cache and disk use: whether [`SLOW_SAMPLE_EVERY`]
    /// passed since they were last read, and the CPU time of the last
    /// sample (they are read too when the sandbox's moved:
    /// [`SamplePlan::read`]).
    pub fn plan(&self, id: &SandboxId, at_ms: i64) -> SamplePlan {
        let all = self.lock();
        let kept = all.get(id);
        let last = kept.and_then(|k| k.slow_at);
        SamplePlan {
            due: last.is_none_or(|t| at_ms - t >= SLOW_SAMPLE_EVERY.as_millis() as i64),
            last_cpu_ns: kept.and_then(|k| k.last_cpu).map(|(_, ns)| ns),
        }
    }

    /// Records a sample from a sandbox's cumulative counters; the CPU share
    /// is over the time since the previous sample (or since `started_ms`).
    /// Without `slow_read`, its page cache and disk figures are the
    /// previous sample's.
    pub fn sample(&self, id: &SandboxId, at_ms: i64, started_ms: i64, cpu_ns: u64, mut s: Sample, slow_read: bool) {
        let mut all = self.lock();
        let kept = all.entry(id.clone()).or_default();
        if slow_read {
            kept.slow_at = Some(at_ms);
        } else if let Some(last) = kept.samples.back() {
            (s.mem_cache, s.disk_used, s.disk_total) = (last.mem_cache, last.disk_used, last.disk_total);
        }
        let (since_ms, since_ns) = kept.last_cpu.unwrap_or((started_ms, 0));
        let wall_ms = (at_ms - since_ms).max(1) as f64;
        let used_ms = cpu_ns.saturating_sub(since_ns) as f64 / 1e6;
        let pct = used_ms / wall_ms / f64::from(s.cpu_count.max(1)) * 100.0;
        s.cpu_used_pct = (pct.clamp(0.0, 100.0) * 100.0).round() / 100.0;
        s.at_ms = at_ms;
        kept.last_cpu = Some((at_ms, cpu_ns));
        if kept.samples.len() >= SAMPLES {
            kept.samples.pop_front();
        }
        kept.samples.push_back(s);
    }

    /// The samples taken from `from_ms` to `until_ms` (Unix milliseconds,
    /// both included), oldest first.
    pub fn samples(&self, id: &SandboxId, from_ms: i64, until_ms: i64) -> Vec<Sample> {
        let all = self.lock();
        let Some(kept) = all.get(id) else { return Vec::new() };
        kept.samples.iter().filter(|s| (from_ms..=until_ms).contains(&s.at_ms)).cloned().collect()
    }

    /// The entries of a sandbox's log that `q` asks for.
    pub fn entries(&self, id: &SandboxId, q: &LogQuery) -> Vec<LogEntry> {
        let all = self.lock();
        let Some(kept) = all.get(id) else { return Vec::new() };
        select(&kept.log, q)
    }

    /// Forgets a sandbox that ended.
    pub fn forget(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// Forgets every sandbox but those `keep` names (an entry logged for a
    /// sandbox as it ended, after [`History::forget`], goes this way).
    pub fn retain(&self, keep: impl Fn(&SandboxId) -> bool) {
        self.lock().retain(|id, _| keep(id));
    }
}

/// The entries of `log` (oldest first) that `q` asks for, in its order.
fn select(log: &VecDeque<LogEntry>, q: &LogQuery) -> Vec<LogEntry> {
    let wanted = |e: &&LogEntry| {
        q.from_ms.is_none_or(|f| e.at_ms >= f)
            && q.until_ms.is_none_or(|u| e.at_ms <= u)
            && q.level.is_none_or(|l| e.level >= l)
            && q.search.as_deref().is_none_or(|s| e.message.contains(s))
    };
    if q.backward {
        log.iter().rev().filter(wanted).take(q.limit).cloned().collect()
    } else {
        log.iter().filter(wanted).take(q.limit).cloned().collect()
    }
}

/// A sample of use `u` of a sandbox of `vcpus` and `memory_mb` (its CPU
/// share is filled in by [`History::sample`]).
fn sample_of(vcpus: f64, memory_mb: u64, u: &hutch_runtime::container::Usage) -> Sample {
    Sample {
        at_ms: 0,
        cpu_count: vcpus.ceil().max(1.0) as u32,
        cpu_used_pct: 0.0,
        mem_used: u.memory_bytes,
        mem_total: memory_mb << 20,
        mem_cache: u.memory_cache_bytes,
        disk_used: u.disk_used_bytes,
        disk_total: u.disk_total_bytes,
    }
}

impl Control {
    /// Adds an entry to a sandbox's log.
    pub(crate) fn log(&self, id: &SandboxId, level: LogLevel, message: impl Into<String>, fields: &[(&str, String)]) {
        self.history.log(id, level, message, fields);
    }

    /// Takes a sample of every running sandbox (suspended ones are not
    /// sampled: their counters stand still). Called every
    /// [`SAMPLE_EVERY`] by the daemon. One read of the store and one
    /// blocking task for them all: with thousands alive, a query and a task
    /// per sandbox were most of an idle daemon's work.
    pub async fn sample_metrics(&self) {
        let lives = self.lives();
        let ids: std::collections::HashSet<&SandboxId> = lives.iter().map(|l| &l.id).collect();
        self.history.retain(|id| ids.contains(id));
        let lives: Vec<_> = lives.into_iter().filter(|l| !l.is_suspended() && !l.is_pooled()).collect();
        if lives.is_empty() {
            return;
        }
        let node = self.node.name.clone();
        let Ok(rows) = self.db(move |s| s.briefs_on(Some(&node), &[hutch_store::SandboxState::Running])).await else {
            return;
        };
        let rows: std::collections::HashMap<String, hutch_store::SandboxBrief> =
            rows.into_iter().map(|r| (r.id.clone(), r)).collect();
        let at = now_ms();
        let lives: Vec<_> = lives.into_iter().map(|l| (self.history.plan(&l.id, at), l)).collect();
        let usages = tokio::task::spawn_blocking(move || {
            lives
                .into_iter()
                .filter_map(|(plan, live)| {
                    let guard = live.handle.lock().ok()?;
                    let sb = guard.as_ref()?;
                    let mut usage = sb.quick_usage();
                    let slow = plan.read(usage.cpu_ns);
                    if slow {
                        (usage.memory_cache_bytes, usage.disk_used_bytes, usage.disk_total_bytes) = sb.slow_usage();
                    }
                    Some((live.id.clone(), usage, slow))
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        for (id, u, slow) in usages {
            if let Some(r) = rows.get(id.as_str()) {
                self.history.sample(&id, at, r.created_at, u.cpu_ns, sample_of(r.vcpus, r.memory_mb, &u), slow);
            }
        }
    }

    /// Takes one sample of a running sandbox now.
    pub(crate) async fn sample_one(&self, r: &hutch_store::SandboxRecord) {
        let id = SandboxId::from_record(&r.id);
        let Some(live) = self.live(&id) else { return };
        let usage = tokio::task::spawn_blocking(move || {
            let guard = live.handle.lock().ok()?;
            guard.as_ref().map(|sb| sb.usage())
        })
        .await;
        let Ok(Some(u)) = usage else { return };
        self.history.sample(&id, now_ms(), r.created_at, u.cpu_ns, sample_of(r.vcpus, r.memory_mb, &u), true);
    }

    /// The samples of a sandbox of the caller between two instants (Unix
    /// seconds, both included; the sandbox's start and now when absent).
    pub async fn metrics_history(
        &self,
        caller: &crate::ids::Caller,
        id: &SandboxId,
        from_s: Option<i64>,
        until_s: Option<i64>,
    ) -> crate::error::Result<Vec<Sample>> {
        let r = self.record_here(caller, id, crate::control::Need::Manage).await?;
        let from = from_s.map_or(r.created_at, |s| s.saturating_mul(1000));
        // The end second is included whole.
        let until = until_s.map_or(now_ms(), |s| s.saturating_mul(1000).saturating_add(999));
        // A window the caller closed the wrong way round is refused; one
        // that starts later than now is merely empty.
        if from_s.is_some() && until_s.is_some() && from > until {
            return Err(crate::error::ControlError::Invalid("start must not be after end".into()));
        }
        Ok(self.history.samples(id, from, until))
    }

    /// The log entries of a sandbox of the caller that `q` asks for.
    pub async fn sandbox_log(
        &self,
        caller: &crate::ids::Caller,
        id: &SandboxId,
        q: &LogQuery,
    ) -> crate::error::Result<Vec<LogEntry>> {
        self.record_here(caller, id, crate::control::Need::Manage).await?;
        Ok(self.history.entries(id, q))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Sample {
        Sample {
            at_ms: 0,
            cpu_count: 2,
            cpu_used_pct: 0.0,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 0,
            disk_used: 0,
            disk_total: 0,
        }
    }

    #[test]
    fn an_idle_sandboxs_page_cache_and_disk_use_are_read_every_slow_sample_every_and_repeated_in_between() {
        let h = History::default();
        let id = SandboxId::from_record("sb-0000000000000002");
        let disk = |used: u64| Sample { disk_used: used, disk_total: 100, mem_cache: used + 1, ..sample() };
        let every = SLOW_SAMPLE_EVERY.as_millis() as i64;
        assert!(h.plan(&id, 0).read(7), "the first sample reads it");
        h.sample(&id, 0, 0, 7, disk(10), true);
        // Idle (the same CPU time): not read; the figures are the last ones.
        let plan = h.plan(&id, 5_000);
        assert!(!plan.read(7));
        assert!(plan.read(8), "read when the sandbox used CPU");
        h.sample(&id, 5_000, 0, 7, disk(0), false);
        assert!(h.plan(&id, every).read(7), "and when it was idle for SLOW_SAMPLE_EVERY");
        h.sample(&id, every, 0, 7, disk(30), true);
        let got: Vec<(u64, u64, u64)> =
            h.samples(&id, 0, every).iter().map(|s| (s.mem_cache, s.disk_used, s.disk_total)).collect();
        assert_eq!(got, [(11, 10, 100), (11, 10, 100), (31, 30, 100)]);
    }

    #[test]
    fn samples_are_bounded_and_their_cpu_share_is_since_the_last() {
        let h = History::default();
        let id = SandboxId::from_record("sb-0000000000000001");
        // One CPU second over two CPUs and one second: 50 %.
        h.sample(&id, 1_000, 0, 1_000_000_000, sample(), true);
        h.sample(&id, 2_000, 0, 1_500_000_000, sample(), true);
        let got = h.samples(&id, 0, 10_000);
        assert_eq!(got.iter().map(|s| s.cpu_used_pct).collect::<Vec<_>>(), vec![50.0, 25.0]);
        assert_eq!(h.samples(&id, 1_500, 10_000).len(), 1);
        for i in 0..SAMPLES as i64 + 10 {
            h.sample(&id, 3_000 + i, 0, 2_000_000_000, sample(), true);
        }
        assert_eq!(h.samples(&id, 0, i64::MAX).len(), SAMPLES);
        h.forget(&id);
        assert!(h.samples(&id, 0, i64::MAX).is_empty());
        // Logged after its end: pruned with the sandboxes that are gone.
        h.log(&id, LogLevel::Info, "late", &[]);
        let other = SandboxId::from_record("sb-0000000000000003");
        h.log(&other, LogLevel::Info, "kept", &[]);
        h.retain(|i| *i == other);
        assert!(h.entries(&id, &LogQuery { limit: 10, ..LogQuery::default() }).is_empty());
        assert_eq!(h.entries(&other, &LogQuery { limit: 10, ..LogQuery::default() }).len(), 1);
    }

    #[test]
    fn logs_are_bounded_cut_and_selected() {
        let h = History::default();
        let id = SandboxId::from_record("sb-0000000000000002");
        for i in 0..LOG_ENTRIES + 5 {
            let level = if i % 2 == 0 { LogLevel::Info } else { LogLevel::Warn };
            h.log(&id, level, format!("entry {i}"), &[]);
        }
        h.log(&id, LogLevel::Error, "é".repeat(LOG_MESSAGE), &[("k", "v".into())]);
        let all = h.entries(&id, &LogQuery { limit: usize::MAX, ..LogQuery::default() });
        assert_eq!(all.len(), LOG_ENTRIES);
        assert_eq!(all[0].message, "entry 6");
        let last = &all[LOG_ENTRIES - 1];
        assert!(last.message.len() <= LOG_MESSAGE && last.message.ends_with("..."));
        assert_eq!(last.fields.get("k").map(String::as_str), Some("v"));
        let q = LogQuery { backward: true, level: Some(LogLevel::Warn), limit: 2, ..LogQuery::default() };
        let newest: Vec<LogLevel> = h.entries(&id, &q).iter().map(|e| e.level).collect();
        assert_eq!(newest, vec![LogLevel::Error, LogLevel::Warn]);
        let q = LogQuery { search: Some("entry 99".into()), limit: 100, ..LogQuery::default() };
        let found: Vec<String> = h.entries(&id, &q).into_iter().map(|e| e.message).collect();
        assert_eq!(
            found,
            vec![
                "entry 99",
                "entry 990",
                "entry 991",
                "entry 992",
                "entry 993",
                "entry 994",
                "entry 995",
                "entry 996",
                "entry 997",
                "entry 998",
                "entry 999"
            ]
        );
        assert_eq!(LogLevel::parse("warn"), Some(LogLevel::Warn));
        assert_eq!(LogLevel::parse("fatal"), None);
    }
}
