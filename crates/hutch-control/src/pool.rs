//! Warm pools: for each template with `warm.min > 0`, sandboxes of its
//! current version started ahead of demand, hidden from their owner until a
//! create claims one (the oldest first). The reconciler tends the pools every
//! tick: it refills up to `min`, drains sandboxes beyond `max`, of an older
//! version or of a deleted template, and a refill that fails is logged and
//! tried again on the next tick.
//!
//! Invariant: a claim is one store transaction that checks the template's
//! current version, so no sandbox of an older version is ever claimed, and a
//! sandbox being drained (state `terminating`) can no longer be claimed.

use crate::control::{now_ms, Control};
use crate::error::{ControlError, Result};
use crate::ids::{OwnerId, SandboxId};
use crate::lifecycle::Reason;
use crate::network::NetRecord;
use crate::templates::Recipe;
use hutch_api::SandboxState;
use hutch_store::{Admitted, SandboxRecord};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Warm sandboxes starting at once, across every pool.
const REFILLS_IN_FLIGHT: usize = 4;
/// Most warm sandboxes (ready or starting) on the host, across every pool.
const POOLED_TOTAL: usize = 64;

/// The pools' bookkeeping inside [`Control`].
#[derive(Default)]
pub struct PoolState {
    refilling: AtomicUsize,
}

/// Releases a refill slot when the refill ends, however it ends.
struct RefillSlot(Arc<Control>);

impl Drop for RefillSlot {
    fn drop(&mut self) {
        self.0.pool.refilling.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Control {
    /// Claims a ready warm sandbox of `recipe` for a create, or None (a miss).
    /// the lifetime (`lifecycle.ttl`) runs from now; `metadata` is set on the claimed sandbox.
    /// Only a warm sandbox with the template's storage is claimed (the
    /// caller asks for no other). `StoreError::Conflict`: a concurrent
    /// create took the idempotency key.
    pub(crate) async fn claim_warm(
        &self,
        owner: &OwnerId,
        recipe: &Recipe,
        lifecycle: &crate::sandboxes::Lifecycle,
        metadata: &str,
        key: Option<&str>,
        hash: &str,
    ) -> Result<Option<SandboxRecord>> {
        let Some(template_id) = recipe.id.clone() else { return Ok(None) };
        let storage = self.sandbox_storage(recipe.class, recipe.storage)?;
        let now = now_ms();
        let (owner_s, metadata, key, hash) =
            (owner.to_string(), metadata.to_owned(), key.map(str::to_owned), hash.to_owned());
        let (expires_at, max_expires_at) =
            (now + lifecycle.ttl.as_millis() as i64, now + recipe.max_ttl.as_millis() as i64);
        let lifecycle = *lifecycle;
        let node = self.node.name.clone();
        // The claim and the usage interval it opens: one transaction.
        let claimed = self
            .db(move |s| {
                s.claim_warm(&hutch_store::Claim {
                    template_id: &template_id,
                    owner: &owner_s,
                    now,
                    expires_at,
                    max_expires_at,
                    metadata: &metadata,
                    idempotency_key: key.as_deref(),
                    request_hash: &hash,
                    storage,
                    on_expire: lifecycle.on_expire,
                    ttl_s: lifecycle.ttl_s(),
                    paused_ttl_s: lifecycle.paused_ttl_s,
                    node: &node,
                })
            })
            .await?;
        match &claimed {
            Some(r) => {
                if let Some(live) = self.live(&SandboxId::from_record(&r.id)) {
                    live.claimed();
                }
                self.metrics.warm_claims_total.fetch_add(1, Ordering::Relaxed);
                self.emit_created(r);
            }
            None if recipe.warm_min > 0 => {
                self.metrics.warm_misses_total.fetch_add(1, Ordering::Relaxed);
            }
            None => {}
        }
        Ok(claimed)
    }

    /// Takes a pooled sandbox out of service and destroys it. A running one
    /// is first marked `terminating` in the store so no claim can take it; one
    /// still starting is torn down by its boot.
    async fn drain(self: &Arc<Self>, r: &SandboxRecord) {
        let id = SandboxId::from_record(&r.id);
        let take = match r.state {
            SandboxState::Running => self.drain_pooled(&id).await.unwrap_or(false),
            SandboxState::Starting => true,
            _ => false,
        };
        if take {
            if let Err(e) = self.destroy(&id, Some(Reason::WarmPoolDrained)).await {
                tracing::warn!("warm sandbox {}: drain failed, will retry: {e}", r.id);
            }
        }
    }

    /// Drains every warm sandbox of a template (after its delete).
    pub(crate) async fn drain_template(self: &Arc<Self>, template_id: &str) {
        let node = self.node.name.clone();
        let pooled = match self.db(move |s| s.pooled_sandboxes(Some(&node))).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("template {template_id}: cannot list its warm pool: {e}");
                return;
            }
        };
        for r in pooled.iter().filter(|r| r.template_id.as_deref() == Some(template_id)) {
            self.drain(r).await;
        }
    }

    /// One pass over every pool: drain what must go, refill what is short,
    /// and publish the pool sizes.
    /// Templates of `revoked` keys keep no pool.
    pub(crate) async fn tend_pools(self: &Arc<Self>, revoked: &HashSet<String>) -> Result<()> {
        let templates = self.db(|s| s.list_templates(None)).await?;
        let templates: Vec<_> = templates.into_iter().filter(|t| !revoked.contains(&t.owner)).collect();
        let by_id: HashMap<&str, &hutch_store::TemplateRecord> = templates.iter().map(|t| (t.id.as_str(), t)).collect();
        // This node's pools only: each keeps its share of every template's
        // sizes, which are the fleet's (`fleet_share`). A draining (or lost)
        // node keeps none: its warm sandboxes go, none are made.
        let own = self.own_node_state().await?;
        let keeps = !matches!(own, Some(hutch_store::NodeState::Draining | hutch_store::NodeState::Lost));
        let mut shares: HashMap<&str, (u32, u32)> = HashMap::new();
        for t in &templates {
            let class = crate::templates::Recipe::from_record(t).class;
            let min = self.fleet_share(t.warm_min, class.as_str()).await;
            let max = self.fleet_share(t.warm_max, class.as_str()).await;
            shares.insert(t.id.as_str(), (min, max));
        }
        let node = self.node.name.clone();
        let pooled = self.db(move |s| s.pooled_sandboxes(Some(&node))).await?;
        // Per template: (ready, starting) of the current version.
        let mut counts: HashMap<&str, (u32, u32)> = HashMap::new();
        let mut total = 0usize;
        for r in &pooled {
            if !matches!(r.state, SandboxState::Running | SandboxState::Starting) {
                // Terminating: the reconciler finishes it.
                continue;
            }
            let current =
                r.template_id.as_deref().and_then(|id| by_id.get(id)).filter(|t| Some(t.version) == r.template_version);
            let Some(t) = current.filter(|_| keeps) else {
                self.drain(r).await;
                continue;
            };
            let c = counts.entry(t.id.as_str()).or_default();
            if c.0 + c.1 >= shares.get(t.id.as_str()).map_or(t.warm_max, |s| s.1) {
                self.drain(r).await;
                continue;
            }
            if r.state == SandboxState::Running {
                c.0 += 1;
            } else {
                c.1 += 1;
            }
            total += 1;
        }
        let mut sizes = Vec::new();
        for t in &templates {
            let (ready, starting) = counts.get(t.id.as_str()).copied().unwrap_or_default();
            if t.warm_min > 0 || ready > 0 {
                sizes.push(crate::metrics::WarmPoolSize {
                    owner: t.owner.clone(),
                    template: t.name.clone(),
                    template_id: t.id.clone(),
                    ready: u64::from(ready),
                });
            }
            // A sandbox's placeholders are made for it at create: a
            // template whose sandboxes name secrets keeps no warm pool.
            let share = shares.get(t.id.as_str()).map_or(t.warm_min, |s| s.0);
            let warm_min = if keeps && crate::templates::Recipe::from_record(t).secrets.is_empty() { share } else { 0 };
            for _ in (ready + starting)..warm_min {
                if self.is_shutting_down() {
                    break;
                }
                if total >= POOLED_TOTAL {
                    tracing::warn!(
                        "warm pool of template {} ({}) is short: the host keeps at most {POOLED_TOTAL} warm sandboxes",
                        t.name,
                        t.id
                    );
                    break;
                }
                if self.pool.refilling.fetch_add(1, Ordering::SeqCst) >= REFILLS_IN_FLIGHT {
                    self.pool.refilling.fetch_sub(1, Ordering::SeqCst);
                    break;
                }
                let slot = RefillSlot(self.clone());
                total += 1;
                let this = self.clone();
                let recipe = Recipe::from_record(t);
                let owner = OwnerId::from_record(&t.owner);
                tokio::spawn(async move {
                    let _slot = slot;
                    this.refill(&owner, &recipe).await;
                });
            }
        }
        self.metrics.set_warm_pool_sizes(sizes);
        Ok(())
    }

    /// Starts one warm sandbox of `recipe`'s current version.
    async fn refill(self: &Arc<Self>, owner: &OwnerId, recipe: &Recipe) {
        let t0 = Instant::now();
        let id = match SandboxId::random() {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!("warm pool of template {}: no sandbox id: {e}", recipe.name);
                return;
            }
        };
        let now = now_ms();
        let life = now + recipe.max_ttl.as_millis() as i64;
        let record = SandboxRecord {
            id: id.to_string(),
            owner: owner.to_string(),
            template: recipe.name.clone(),
            state: SandboxState::Starting,
            created_at: now,
            expires_at: life,
            max_expires_at: life,
            memory_mb: recipe.memory_mb,
            vcpus: recipe.vcpus,
            disk_mib: recipe.disk_mib,
            pids: recipe.pids,
            env: serde_json::to_string(&recipe.env).unwrap_or_else(|_| "{}".into()),
            metadata: "{}".into(),
            limits_applied: "unknown".into(),
            last_error_code: None,
            host_pid: None,
            idempotency_key: None,
            request_hash: None,
            template_id: recipe.id.clone(),
            template_version: recipe.version,
            warm: true,
            pooled: true,
            // The template's policy; a host without networking runs none
            // but deny_all, and the refill says why.
            network: match NetRecord::from_request(Some(&recipe.network)) {
                Ok(n) => n.to_json(),
                Err(e) => {
                    tracing::warn!("warm pool of template {}: {e}", recipe.name);
                    return;
                }
            },
            storage: match self.sandbox_storage(recipe.class, recipe.storage) {
                Ok(k) => k,
                Err(e) => {
                    tracing::warn!("warm pool of template {}: {e}", recipe.name);
                    return;
                }
            },
            origin: None,
            // A claim sets what the claimed sandbox does at its expiry.
            on_expire: hutch_api::OnExpire::Delete,
            ttl_s: None,
            paused_ttl_s: None,
            class: recipe.class,
            node: self.node.name.clone(),
            reason: None,
        };
        // Warm sandboxes count toward their owner's quotas and the host's
        // capacity like any other.
        let admitted = match self.quotas_of(owner).await {
            Ok(q) => match self.admission(q, record.memory_mb, record.disk_mib) {
                Ok(adm) => {
                    // Its usage interval opens in the insert's transaction.
                    let rec = record.clone();
                    self.db(move |s| s.insert_sandbox_claiming(&rec, &adm, &[], Some(now_ms()))).await
                }
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match admitted {
            Ok(Admitted::Inserted) => {}
            Ok(Admitted::Refused(e)) => {
                tracing::warn!("warm pool of template {} is short: {}", recipe.name, ControlError::Exceeded(e));
                return;
            }
            // A draining node keeps no pool.
            Ok(Admitted::VolumeInUse(_) | Admitted::VolumeGone(_) | Admitted::NodeClosed(_)) => return,
            Err(e) => {
                tracing::warn!("warm pool of template {}: cannot record a sandbox: {e}; retrying", recipe.name);
                return;
            }
        }
        match self.clone().boot(record, recipe).await {
            Ok(r) => {
                // Agent up: it answers a ping, on a connection that the first
                // command after the claim reuses (no connect on the claim path).
                if let Some(live) = self.live(&SandboxId::from_record(&r.id)) {
                    if let Ok(mut conn) = live.conn().await {
                        if conn.call(hutch_agent::proto::Request::Ping, &[]).await.is_ok() {
                            // One throwaway command pays what a fresh agent pays
                            // on its first spawn (its pages, the passwd file),
                            // here rather than on the claim's first exec.
                            let warmed =
                                tokio::time::timeout(std::time::Duration::from_secs(5), warm_up(&mut conn)).await;
                            if matches!(warmed, Ok(true)) {
                                live.reuse(conn);
                            }
                        }
                    }
                }
                self.metrics.warm_refill.observe(t0.elapsed().as_secs_f64());
            }
            Err(e) => tracing::warn!(
                "warm pool of template {} ({}) cannot refill: {e}; retrying next tick",
                recipe.name,
                recipe.id.as_deref().unwrap_or("base")
            ),
        }
    }
}

/// Runs `true` as the sandbox user and waits for it; false if it did not
/// run cleanly (the connection is then not reused).
async fn warm_up(conn: &mut hutch_runtime::agent_async::AsyncConn) -> bool {
    use hutch_agent::proto::{Cmd, FromAgent, Reply, Request, Spawn};
    let spawn = Spawn {
        cmd: Cmd::Argv(vec!["true".into()]),
        env: Vec::new(),
        cwd: None,
        user: None,
        stdin: false,
        pty: None,
        tag: None,
        timeout_ms: Some(5_000),
        subscribe: true,
        output_limit: None,
    };
    let Ok((Reply::Spawned { pid }, _)) = conn.call(Request::Spawn(spawn), &[]).await else { return false };
    loop {
        match conn.recv().await {
            Ok((FromAgent::Exit { pid: p, .. }, _)) if p == pid => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}
