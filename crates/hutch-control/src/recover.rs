//! What the daemon does on its own: after a restart, take charge of the
//! sandboxes that outlived the last daemon and finish what it left half
//! done (`recover`); every tick, expire sandboxes, end those of revoked
//! keys, retry deletions, notice dead ones and tend the warm pools
//! (`reconcile`).

use crate::control::{now_ms, Control};
use crate::error::Result;
use crate::ids::{OwnerId, SandboxId};
use crate::lifecycle::{Live, Reason, HOLDING};
use crate::network::NetRecord;
use hutch_api::SandboxState;
use hutch_runtime::container::{Liveness, Sandbox};
use hutch_store::SandboxRecord;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// How long a kept sandbox cgroup waits for a sandbox before it is removed.
const SPARE_IDLE: Duration = Duration::from_secs(30);
/// Kept cgroups one reconciler pass removes at most.
const SPARES_TRIMMED_PER_PASS: usize = 8;

impl Control {
    /// After a restart: takes charge of sandboxes that outlived the last
    /// daemon, finishes interrupted deletions, cleans up interrupted creates.
    pub async fn recover(self: &Arc<Self>) -> Result<()> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.recover_builds()).await??;
        // When the last daemon was last known alive (its last usage flush):
        // sandboxes that did not outlive it stopped counting then.
        let alive_at = self.usage_alive_at().await.unwrap_or_else(now_ms);
        // Only this node's commands and sandboxes: other nodes' live on
        // other hosts.
        let node = self.node.name.clone();
        let lost = self.db(move |s| s.mark_running_execs_lost(&node)).await?;
        if lost > 0 {
            tracing::info!("{lost} commands were running when the daemon stopped; their outcome is unknown");
        }
        let node = self.node.name.clone();
        for r in self.db(move |s| s.sandboxes_on(Some(&node), HOLDING)).await? {
            let id = SandboxId::from_record(&r.id);
            let handle = self.runtime.adopt(&r.id);
            let (handle, alive) = tokio::task::spawn_blocking(move || {
                let alive = adoptable(&handle);
                (handle, alive)
            })
            .await?;
            let live = Live::new(handle, OwnerId::from_record(&r.owner), r.pooled);
            match (r.state, alive) {
                (SandboxState::Running | SandboxState::Suspended, true) => {
                    let pid = r.host_pid.map(|p| p as libc::pid_t).unwrap_or(0);
                    let this = self.clone();
                    let rec = r.clone();
                    let adopted = tokio::task::spawn_blocking(move || this.adopt_network(&rec, pid)).await?;
                    self.insert_live(live.clone());
                    if let Err(e) = adopted {
                        tracing::warn!("sandbox {id}: its network cannot be taken back ({e}); ending it");
                        let _ = self.destroy(&id, Some(Reason::NetworkUnavailable)).await;
                        continue;
                    }
                    live.set_suspended(r.state == SandboxState::Suspended);
                    // OOM kills before the restart were told of then (or lost with it).
                    let kills = live.handle.lock().ok().and_then(|h| h.as_ref().map(|sb| sb.cgroup.oom_kills()));
                    live.oom_seen.store(kills.unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
                    tracing::info!("adopted sandbox {id}");
                    // Archive uploads the last daemon left half done are
                    // undone (or finished); a frozen agent cannot answer,
                    // so a suspended sandbox's wait for its resume.
                    if r.state == SandboxState::Running {
                        crate::files::journal::recover(&self.upload_journal(&id), &live.socket).await;
                    }
                }
                (state, _) => {
                    let reason = if state == SandboxState::Terminating { None } else { Some(Reason::LostOnRestart) };
                    self.usage_lost(&id, alive_at).await;
                    self.insert_live(live);
                    let _ = self.destroy(&id, reason).await;
                }
            }
        }
        // Paused sandboxes keep their layers; processes a daemon stopped
        // while pausing left behind end now.
        let node = self.node.name.clone();
        for r in self.db(move |s| s.sandboxes_on(Some(&node), &[SandboxState::Paused])).await? {
            if let Err(e) = self.end_processes(&SandboxId::from_record(&r.id)).await {
                tracing::warn!("paused sandbox {}: {e}", r.id);
            }
        }
        // Back after being declared lost (or after its sandboxes moved): what
        // the fleet no longer gives this node ends here (its rows stay).
        let disowned = self.end_disowned().await?;
        if disowned > 0 {
            tracing::info!("ended {disowned} sandboxes that are no longer this node's");
        }
        // Upload journals of sandboxes that are gone describe nothing left.
        let live: HashSet<String> = self.lives().iter().map(|l| l.id.to_string()).collect();
        crate::files::journal::sweep(&self.runtime.config().state_dir.join("uploads"), move |id| live.contains(id))
            .await;
        // Host containers of the process class a former daemon left: their
        // tenants were ended above (a tenant does not outlive its daemon).
        let rt = self.runtime.clone();
        let net = self.network.as_ref().ok().cloned();
        let _ = tokio::task::spawn_blocking(move || {
            for id in rt.cgroups().into_iter().filter(|c| c.starts_with(crate::process::HOST_PREFIX)) {
                if let Err(e) = rt.adopt(&id).destroy() {
                    tracing::warn!("host container {id}: {e}");
                }
                if let Some(n) = &net {
                    n.release(&id);
                }
            }
        })
        .await;
        // Anything on the host with no record (rows come first, so only
        // what a stopped daemon was tearing down) is swept.
        let rt = self.runtime.clone();
        let _ = tokio::task::spawn_blocking(move || rt.sweep()).await;
        // Disk layers of sandboxes that ended (or never were: a create cut
        // short), were lost, or are another node's now are deleted; those
        // of this node's sandboxes that keep files stay. The storage is this
        // state directory's: only this daemon's layers.
        if let Some(storage) = self.runtime.storage().cloned() {
            let node = self.node.name.clone();
            let keep: HashSet<String> = self
                .db(move |s| s.sandboxes_on(Some(&node), &crate::lifecycle::KEEPING_FILES))
                .await?
                .into_iter()
                .map(|r| r.id)
                .collect();
            let swept = tokio::task::spawn_blocking(move || {
                storage.sweep(hutch_runtime::storage::Kind::Sandbox, |name| keep.contains(name))
            })
            .await?;
            if !swept.is_empty() {
                tracing::info!("deleted the disk layers of {} sandboxes that are gone: {swept:?}", swept.len());
            }
        }
        self.sweep_snapshots().await?;
        self.sweep_volumes().await?;
        self.usage_reconcile(alive_at).await?;
        Ok(())
    }

    fn adopt_network(&self, r: &SandboxRecord, pid: libc::pid_t) -> std::result::Result<(), String> {
        let net = NetRecord::parse(&r.network);
        let policy = net.policy(&r.owner, r.template_id.as_deref().unwrap_or(&r.template));
        match (&self.network, net.host_if.as_deref()) {
            (Ok(n), Some(host_if)) => {
                let learned: Vec<std::net::IpAddr> =
                    serde_json::from_str(&self.store.net_learned(&r.id).map_err(|e| e.to_string())?)
                        .unwrap_or_default();
                n.adopt(&r.id, pid, net.index, host_if, &policy, &learned).map_err(|e| e.to_string())
            }
            // No host link: its namespace holds only `lo` (deny_all, or a
            // sandbox started before networking), whatever it asked.
            (Ok(n), None) => {
                let lo_only = hutch_runtime::net::Policy { egress: hutch_runtime::net::Egress::DenyAll, ..policy };
                n.attach(&r.id, &lo_only).map(|_| ()).map_err(|e| e.to_string())
            }
            // Without networking only namespaces with `lo` exist.
            (Err(_), _) => Ok(()),
        }
    }

    /// Ids of revoked keys.
    pub(crate) async fn revoked_owners(&self) -> Result<HashSet<String>> {
        let keys = self.db(|s| s.list_keys()).await?;
        let revoked: HashSet<String> = keys.into_iter().filter(|k| k.revoked_at.is_some()).map(|k| k.id).collect();
        self.set_revoked(revoked.clone());
        Ok(revoked)
    }

    /// One pass of the reconciler: expire sandboxes, end those of revoked
    /// keys, retry deletions, notice sandboxes whose PID 1 died.
    pub async fn reconcile(self: &Arc<Self>) -> Result<()> {
        let now = now_ms();
        let mut lag = 0.0f64;
        let (mut unknown, mut first_unknown) = (0usize, None);
        let revoked = self.revoked_owners().await?;
        let states = [SandboxState::Running, SandboxState::Suspended, SandboxState::Terminating, SandboxState::Paused];
        let node = self.node.name.clone();
        // Only what a pass reads of each: the whole record is read for a
        // sandbox that is acted on.
        let rows = self.db(move |s| s.briefs_on(Some(&node), &states)).await?;
        self.forget_notices(&rows.iter().map(|r| r.id.clone()).collect());
        let oom_news = self.events.host_oom_news();
        for r in rows {
            let id = SandboxId::from_record(&r.id);
            if r.state == SandboxState::Terminating {
                let _ = self.destroy(&id, None).await;
                continue;
            }
            let reason = if revoked.contains(&r.owner) {
                Some(Reason::KeyRevoked)
            } else if r.expires_at <= now {
                lag = lag.max((now - r.expires_at) as f64 / 1000.0);
                Some(Reason::Expired)
            } else {
                None
            };
            if let Some(reason) = reason {
                // A warm sandbox is taken from its pool first, so that no
                // claim gets it while it is destroyed.
                if r.pooled && !self.drain_pooled(&id).await? {
                    continue;
                }
                if reason == Reason::Expired && r.on_expire == hutch_api::OnExpire::Pause {
                    if let Some(whole) = self.sandbox_record(&id).await? {
                        if self.pause_at_expiry(&whole).await {
                            continue;
                        }
                    }
                }
                let _ = self.destroy(&id, Some(reason)).await;
                continue;
            }
            if matches!(r.state, SandboxState::Running | SandboxState::Suspended | SandboxState::Paused) {
                self.watch_sandbox(&r, now, oom_news);
            }
            if let Some(live) = self.live(&id) {
                live.drop_idle_conns(crate::lifecycle::IDLE_CONN_AGE);
                // Only a positive observation of death ends a sandbox; a
                // check that failed (out of descriptors) is no verdict.
                let seen = live.handle.lock().ok().and_then(|h| h.as_ref().map(|sb| sb.liveness()));
                match seen {
                    Some(Liveness::Dead) => {
                        if !r.pooled || self.drain_pooled(&id).await? {
                            let _ = self.destroy(&id, Some(Reason::AgentExited)).await;
                        }
                    }
                    Some(Liveness::Unknown(e)) => {
                        unknown += 1;
                        first_unknown.get_or_insert_with(|| format!("sandbox {id}: {e}"));
                    }
                    Some(Liveness::Alive) | None => {}
                }
            }
        }
        if let Some(first) = first_unknown {
            tracing::warn!("cannot tell whether {unknown} sandboxes are alive ({first}); they are left running");
        }
        self.metrics.set_reconciler_lag(lag);
        // Kept cgroups unused for a while go, a few per pass: once a burst
        // is over, taking them offline is cheap again.
        if let Some(spares) = self.runtime.spares().cloned() {
            let _ = tokio::task::spawn_blocking(move || spares.trim(SPARE_IDLE, SPARES_TRIMMED_PER_PASS)).await;
        }
        if !self.is_shutting_down() {
            if let Err(e) = self.look_for_lost_nodes().await {
                tracing::warn!("fleet: cannot look for lost nodes: {e}; retrying next tick");
            }
        }
        if !self.is_shutting_down() {
            if let Err(e) = self.tend_pools(&revoked).await {
                tracing::warn!("warm pools: {e}; retrying next tick");
            }
        }
        if !self.is_shutting_down() && !self.idle_sweeping.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // Off the tick: a sweep may wait on agents.
            let this = self.clone();
            tokio::spawn(async move {
                this.sweep_idle().await;
                this.idle_sweeping.store(false, std::sync::atomic::Ordering::SeqCst);
            });
        }
        self.metrics.reconciler_ticks_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Takes a running warm sandbox out of its pool (state `terminating`);
    /// false when a claim took it first.
    pub(crate) async fn drain_pooled(&self, id: &SandboxId) -> Result<bool> {
        let sid = id.to_string();
        let drained = self.db(move |s| s.drain_pooled(&sid)).await?;
        if drained {
            if let Some(r) = self.sandbox_record(id).await? {
                self.usage_mark(&r).await;
            }
        }
        Ok(drained)
    }
}

/// Whether a sandbox found at start-up can be adopted: its processes are not
/// known to be gone and its agent's socket is not known to be dead. A check
/// that fails (EMFILE, ENOMEM) is no verdict: the sandbox is adopted and the
/// reconciler looks again.
fn adoptable(handle: &Sandbox) -> bool {
    if let Liveness::Dead = handle.liveness() {
        return false;
    }
    match hutch_runtime::agent::AgentConn::connect(&handle.socket) {
        Ok(_) => true,
        Err(hutch_runtime::agent::AgentError::Io(e))
            if !matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT | libc::ENOTSOCK)) =>
        {
            tracing::warn!("sandbox {}: cannot reach its agent ({e}); adopting it and checking again later", handle.id);
            true
        }
        Err(_) => false,
    }
}
