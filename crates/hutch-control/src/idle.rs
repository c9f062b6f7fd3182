//! Idle timeouts that count work: a sandbox with `idle_timeout_seconds` is
//! paused (or ended: `on_idle`) once it has had that long with no API use
//! and no command running.
//!
//! Activity is kept in memory, per live sandbox: an atomic timestamp that
//! every use of it (a command, a file, a terminal, a process call: every
//! path through [`Control::running`]) sets, and a flag that says a command
//! was seen running. Reading a sandbox (`GET`) is not use. No call writes
//! the store. The reconciler's tick ([`Control::sweep_idle`]) asks the
//! agent which commands run only for sandboxes that have an idle timeout
//! and either passed it or were seen busy: a background command started
//! through the API counts as running until it exits (its exit starts the
//! idle time), and an open terminal or a streaming exec is a command the
//! agent runs. The policies themselves are stored (migration 0015) and
//! read back into memory at the first tick after a start.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, OwnerId, SandboxId};
use crate::lifecycle::{Live, Reason};
use hutch_api::{OnIdle, Sandbox, SandboxState, StorageKind, MAX_IDLE_SECONDS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A sandbox's idle policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    pub timeout_s: u64,
    pub on_idle: OnIdle,
}

impl IdlePolicy {
    /// The policy a create asks for: none without a timeout; `on_idle`
    /// alone is refused.
    pub fn from_request(timeout: Option<u64>, on_idle: Option<OnIdle>) -> Result<Option<IdlePolicy>> {
        match timeout {
            None if on_idle.is_some() => Err(ControlError::Invalid("on_idle needs idle_timeout_seconds".into())),
            None => Ok(None),
            Some(t) if (1..=MAX_IDLE_SECONDS).contains(&t) => {
                Ok(Some(IdlePolicy { timeout_s: t, on_idle: on_idle.unwrap_or_default() }))
            }
            Some(_) => Err(ControlError::Invalid(format!("idle_timeout_seconds must be 1 to {MAX_IDLE_SECONDS}"))),
        }
    }
}

/// The idle policies of sandboxes, by id.
#[derive(Default)]
pub struct Idle {
    policies: Mutex<HashMap<String, IdlePolicy>>,
    loaded: AtomicBool,
}

impl Idle {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, IdlePolicy>> {
        self.policies.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn get(&self, id: &str) -> Option<IdlePolicy> {
        self.lock().get(id).copied()
    }

    pub(crate) fn forget(&self, id: &str) {
        self.lock().remove(id);
    }
}

impl Control {
    /// Gives a sandbox its idle policy: in memory first (the sweeper reads
    /// it there), then in the store (a restart reads it back).
    pub(crate) async fn set_idle(&self, id: &SandboxId, policy: IdlePolicy) -> Result<()> {
        self.idle.lock().insert(id.to_string(), policy);
        let (sid, t, o) = (id.to_string(), policy.timeout_s, policy.on_idle.as_str());
        self.db(move |s| s.set_sandbox_idle(&sid, t, o)).await
    }

    /// A sandbox as the API shows it, with its idle policy and since when
    /// it is idle.
    pub(crate) fn with_idle(&self, mut sb: Sandbox) -> Sandbox {
        let Some(p) = self.idle.get(&sb.id) else { return sb };
        sb.idle_timeout_seconds = Some(p.timeout_s);
        sb.on_idle = Some(p.on_idle);
        sb.idle_since = None;
        if sb.state == SandboxState::Running {
            if let Some(live) = SandboxId::parse(&sb.id).ok().and_then(|id| self.live(&id)) {
                if !live.is_busy() && !live.is_suspended() {
                    sb.idle_since = Some(rfc3339(live.last_active()));
                }
            }
        }
        sb
    }

    /// The reconciler's idle pass: pauses or ends every running sandbox
    /// past its idle timeout with no command running.
    pub(crate) async fn sweep_idle(self: &Arc<Self>) {
        if !self.idle.loaded.load(Ordering::SeqCst) {
            let node = self.node.name.clone();
            match self.db(move |s| s.sandbox_idle_all(Some(&node))).await {
                Ok(rows) => {
                    let mut map = self.idle.lock();
                    for (id, t, o) in rows {
                        map.entry(id)
                            .or_insert(IdlePolicy { timeout_s: t, on_idle: OnIdle::parse(&o).unwrap_or_default() });
                    }
                    self.idle.loaded.store(true, Ordering::SeqCst);
                }
                Err(e) => {
                    tracing::warn!("idle policies: {e}; read again at the next tick");
                    return;
                }
            }
        }
        let policies: Vec<(String, IdlePolicy)> = self.idle.lock().iter().map(|(k, v)| (k.clone(), *v)).collect();
        let now = now_ms();
        for (id, policy) in policies {
            let Ok(sid) = SandboxId::parse(&id) else { continue };
            let Some(live) = self.live(&sid) else { continue };
            if live.is_pooled() || live.is_suspended() {
                continue;
            }
            let quiet_ms = now - live.last_active();
            if !live.is_busy() && quiet_ms < (policy.timeout_s * 1000) as i64 {
                continue;
            }
            match self.runs_commands(&live).await {
                Some(true) => {
                    live.set_busy(true);
                    continue;
                }
                Some(false) if live.is_busy() => {
                    // Its last command just ended: idle from now.
                    live.set_busy(false);
                    live.touch();
                    continue;
                }
                Some(false) => {}
                // The agent did not answer: no verdict.
                None => continue,
            }
            if quiet_ms >= (policy.timeout_s * 1000) as i64 {
                self.act_on_idle(&sid, &live, policy).await;
            }
        }
    }

    /// Whether the agent runs any command of this sandbox but its startup
    /// command (None: it did not answer).
    async fn runs_commands(&self, live: &Live) -> Option<bool> {
        let processes = live.processes(std::time::Duration::from_secs(5)).await?;
        // The template's startup command (a server, often) is not work of
        // the API's.
        Some(processes.iter().any(|p| p.tag.as_deref() != Some(crate::ready::STARTUP_TAG)))
    }

    async fn act_on_idle(self: &Arc<Self>, id: &SandboxId, live: &Live, policy: IdlePolicy) {
        let owner = Caller::key(OwnerId::from_record(live.owner.as_str()), false);
        let secs = policy.timeout_s;
        match policy.on_idle {
            OnIdle::Pause => {
                let disk = match self.sandbox_record(id).await {
                    Ok(Some(r)) => r.storage == StorageKind::Disk,
                    _ => return,
                };
                let mode = if disk { hutch_api::SuspendMode::Disk } else { hutch_api::SuspendMode::Memory };
                match self.suspend(&owner, id, mode).await {
                    Ok(_) => self.log(id, crate::history::LogLevel::Info, format!("paused after {secs} s idle"), &[]),
                    Err(e) => tracing::warn!("sandbox {id}: cannot pause it when idle ({e}); tried again"),
                }
            }
            OnIdle::Delete => {
                self.log(id, crate::history::LogLevel::Info, format!("ended after {secs} s idle"), &[]);
                if let Err(e) = self.destroy(id, Some(Reason::Idle)).await {
                    tracing::warn!("sandbox {id}: cannot end it when idle ({e}); tried again");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_policies_are_bounded() {
        assert_eq!(IdlePolicy::from_request(None, None).expect("none"), None);
        assert!(IdlePolicy::from_request(None, Some(OnIdle::Delete)).is_err());
        assert!(IdlePolicy::from_request(Some(0), None).is_err());
        assert!(IdlePolicy::from_request(Some(MAX_IDLE_SECONDS + 1), None).is_err());
        assert_eq!(
            IdlePolicy::from_request(Some(60), None).expect("ok"),
            Some(IdlePolicy { timeout_s: 60, on_idle: OnIdle::Pause })
        );
    }
}
