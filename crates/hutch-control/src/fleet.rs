//! The fleet's health: nodes that stop heartbeating are declared lost, a
//! node that comes back ends what the fleet no longer gives it, and an
//! operator drains a node before taking it away.
//!
//! **Loss.** Every reconciler tick, each node looks at the other nodes'
//! heartbeats ([`Control::look_for_lost_nodes`]). A node silent for longer
//! than `--node-lost-after` is declared lost by one conditional update of
//! the store ([`hutch_store::Store::mark_node_lost`]): one winner among the
//! nodes looking, and the declaration is void if the node beat meanwhile.
//! In the same transaction its sandboxes that ran (starting, running,
//! suspended, terminating, warm ones too) take the transition
//! [`Transition::Lose`] to `lost`, with `node_lost` and a reason in words;
//! from then they hold nothing (their owner's quota, its usage, the node's
//! pool). Its disk-paused sandboxes stay `paused` (their files are on its
//! disk; a move through the registry may start them elsewhere) with a note.
//!
//! **Coming back.** A lost node's heartbeat is refused: the node hears it
//! is lost ([`Control::beat`]), ends on its host every sandbox the fleet no
//! longer gives it ([`Control::end_disowned`]: its row is `lost`, or names
//! another node) and registers again. A node that restarts does the same
//! in its recovery, before its sweep.
//!
//! **Drain.** `POST /v1/nodes/{name}/drain` (admin keys) makes a node
//! `draining`: it refuses creates (`node_draining`) and keeps no warm pool.
//! At each of its heartbeats it gives its disk-paused sandboxes to other
//! nodes through the registry ([`Control::move_out_paused`]: pushed if not
//! yet, handed over, their files here deleted). Running and suspended
//! sandboxes are left to end (their lifetime, their owner's delete) or to
//! be paused to disk, after which they move too. `GET /v1/nodes` says
//! `drained: true` once no sandbox names the node: then nothing the
//! fleet holds needs it, and it may be stopped. A paused sandbox that
//! cannot move (on `base`, with volumes, a node without a registry, no
//! other node running its class) keeps it from being drained until it is
//! resumed or deleted.

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, SandboxId};
use crate::lifecycle::{Reason, Transition};
use hutch_api::{Node, SandboxState};
use hutch_store::{NodeLoss, NodeState};
use std::collections::BTreeSet;
use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

/// Default silence after which a node is declared lost.
pub const DEFAULT_LOST_AFTER: Duration = Duration::from_secs(30);

/// Checks `--node-lost-after` against `--heartbeat`: a node must be able
/// to beat at least twice within it, or a slow beat would lose a live node.
pub fn check_lost_after(lost_after: Duration, heartbeat: Duration) -> std::result::Result<(), String> {
    if lost_after < heartbeat.saturating_mul(2) {
        return Err(format!(
            "--node-lost-after ({lost_after:?}) must be at least twice --heartbeat ({heartbeat:?}): \
             a node that beats late would be declared lost while alive"
        ));
    }
    Ok(())
}

/// What a drain or an undrain asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    Drain,
    Undrain,
}

impl Control {
    /// This node's state in the fleet's table (None: no row yet).
    pub(crate) async fn own_node_state(&self) -> Result<Option<NodeState>> {
        let name = self.node.name.clone();
        let nodes = self.db(|s| s.list_nodes()).await?;
        Ok(nodes.into_iter().find(|n| n.name == name).map(|n| n.state))
    }

    /// Refuses a create sent to this node while it is draining (or lost:
    /// it is ending what it held). Placement sends creates elsewhere.
    /// A sandbox's insert reads its node's state in its own transaction
    /// (`Admitted::NodeClosed`); this looks first, before work that a
    /// refusal would waste (a snapshot's files pulled from another node).
    pub(crate) async fn refuse_if_draining(&self) -> Result<()> {
        match self.own_node_state().await? {
            Some(state @ (NodeState::Draining | NodeState::Lost)) => Err(self.node_closed(state)),
            Some(NodeState::Active) | None => Ok(()),
        }
    }

    /// The refusal of a create by this node while it is `state` (draining
    /// or lost).
    pub(crate) fn node_closed(&self, state: NodeState) -> ControlError {
        ControlError::NodeDraining { node: self.node.name.clone(), lost: state == NodeState::Lost }
    }

    /// One look at the other nodes' heartbeats (a reconciler tick):
    /// declares lost every node silent for longer than `lost_after`. A
    /// node that is itself lost, or whose own beat is as old, looks at no
    /// one: it may be the one cut off.
    pub(crate) async fn look_for_lost_nodes(&self) -> Result<()> {
        let nodes = self.db(|s| s.list_nodes()).await?;
        let now = now_ms();
        let lost_after = self.node.lost_after.as_millis().min(i64::MAX as u128) as i64;
        let fresh = |beat: i64| now - beat <= lost_after;
        let me = nodes.iter().find(|n| n.name == self.node.name);
        if !me.is_some_and(|n| n.state != NodeState::Lost && fresh(n.heartbeat_at)) {
            return Ok(());
        }
        for n in nodes.iter().filter(|n| n.name != self.node.name && n.state != NodeState::Lost) {
            if fresh(n.heartbeat_at) {
                continue;
            }
            let since = rfc3339(n.heartbeat_at);
            let reason = format!(
                "node {} stopped heartbeating at {since} and was declared lost after {}s of silence",
                n.name,
                self.node.lost_after.as_secs()
            );
            let paused_reason = format!(
                "node {} stopped heartbeating at {since} and was declared lost; this sandbox stays paused \
                 (its files are on that node)",
                n.name
            );
            let (name, silent_before) = (n.name.clone(), now - lost_after);
            let declared = self
                .db(move |s| {
                    s.mark_node_lost(&NodeLoss {
                        name: &name,
                        silent_before,
                        from: Transition::Lose.from(),
                        code: Reason::NodeLost.as_str(),
                        reason: &reason,
                        paused_reason: &paused_reason,
                    })
                })
                .await?;
            // Another node declared it first, or it beat meanwhile.
            let Some(lost) = declared else { continue };
            self.metrics.nodes_lost_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(
                "node {} stopped heartbeating at {since}: declared lost, with {} of its sandboxes",
                n.name,
                lost.len()
            );
            for r in lost {
                self.emit_transition(Transition::Lose, &r);
                // Its usage ends when its node was last known alive.
                let (rec, at) = (r.clone(), n.heartbeat_at.max(r.created_at));
                if let Err(e) = self.db(move |s| s.usage_mark(&rec, at)).await {
                    tracing::warn!("usage: sandbox {}: {e}", r.id);
                }
            }
        }
        Ok(())
    }

    /// One heartbeat. A node that hears it was declared lost (it was cut
    /// off from the database for longer than `--node-lost-after`) ends
    /// what the fleet no longer gives it, then registers again; a node
    /// with no row registers again.
    pub(crate) async fn beat(self: &Arc<Self>) {
        let name = self.node.name.clone();
        match self.db(move |s| s.heartbeat_node(&name, now_ms())).await {
            Ok(Some(NodeState::Active)) => {}
            Ok(Some(NodeState::Draining)) => {
                // Its paused sandboxes go to other nodes (`moves`), in the
                // background: a push must not hold the next beat.
                let this = self.clone();
                tokio::spawn(async move {
                    match this.move_out_paused().await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!("node {}: draining; moved {n} paused sandboxes", this.node.name),
                        Err(e) => tracing::warn!("node {}: draining; its paused sandboxes: {e}", this.node.name),
                    }
                });
            }
            Ok(Some(NodeState::Lost)) => {
                tracing::warn!(
                    "node {}: the fleet declared this node lost; ending what it no longer gives it",
                    self.node.name
                );
                match self.end_disowned().await {
                    Ok(n) => tracing::info!("node {}: ended {n} sandboxes of a lost node", self.node.name),
                    Err(e) => {
                        // Not active again before what it held is ended:
                        // the next beat tries again.
                        tracing::warn!("node {}: cannot end what it no longer owns: {e}", self.node.name);
                        return;
                    }
                }
                if let Err(e) = self.register_node().await {
                    tracing::warn!("node {}: cannot register again: {e}", self.node.name);
                }
            }
            Ok(None) => {
                if let Err(e) = self.register_node().await {
                    tracing::warn!("node {}: cannot register again: {e}", self.node.name);
                }
            }
            Err(e) => tracing::warn!("node {}: heartbeat failed: {e}", self.node.name),
        }
    }

    /// Ends on this host every sandbox the fleet no longer gives this node:
    /// one it runs (or whose agent socket or gVisor directory is in its
    /// run directory) whose row is `lost`, or names another node. Other
    /// nodes' sandboxes on the same host are never looked at (they are in
    /// other run directories). Their rows are left as they are. How many
    /// were ended.
    pub(crate) async fn end_disowned(self: &Arc<Self>) -> Result<usize> {
        let mut here: BTreeSet<String> = self.lives().iter().map(|l| l.id.to_string()).collect();
        let run_dir = self.runtime.config().run_dir.clone();
        here.extend(tokio::task::spawn_blocking(move || on_host(&run_dir)).await?);
        let mut ended = 0;
        for id in here {
            let sid = SandboxId::from_record(&id);
            let Some(r) = self.sandbox_record(&sid).await? else { continue };
            if r.state != SandboxState::Lost && r.node == self.node.name {
                continue;
            }
            tracing::info!("sandbox {id}: {} here; ending it on this host", disowned_why(&r, &self.node.name));
            self.release_host(&sid, r.origin.clone()).await?;
            ended += 1;
        }
        Ok(ended)
    }

    /// The host's part of a deletion, without a transition, for a sandbox
    /// whose row says it is no longer this node's ([`Control::teardown_host`]).
    async fn release_host(self: &Arc<Self>, id: &SandboxId, origin: Option<String>) -> Result<()> {
        self.cancel(id);
        self.teardown_host(id).await?;
        self.release_origin(origin).await;
        Ok(())
    }

    /// `POST /v1/nodes/{name}/drain` and `/undrain` (admin keys only): a
    /// draining node takes no new sandboxes; undrain makes it active. A
    /// lost node is neither: it comes back by starting (registering).
    pub async fn drain_node(&self, caller: &Caller, name: &str, what: Drain) -> Result<Node> {
        if !caller.admin {
            return Err(ControlError::Forbidden("only an admin key may drain or undrain a node".into()));
        }
        let (from, to) = match what {
            Drain::Drain => ([NodeState::Active, NodeState::Draining], NodeState::Draining),
            Drain::Undrain => ([NodeState::Draining, NodeState::Active], NodeState::Active),
        };
        let n = name.to_owned();
        let moved = self.db(move |s| s.set_node_state(&n, &from, to)).await?;
        // The draining node itself moves its paused sandboxes away, at its
        // next heartbeats (`move_out_paused`): their files are on its disk.
        let node = self.list_nodes(caller).await?.nodes.into_iter().find(|x| x.name == name);
        match (moved, node) {
            (_, None) => Err(ControlError::NoNode(name.chars().take(63).collect())),
            (true, Some(node)) => {
                tracing::info!("node {name}: {}", node.state);
                Ok(node)
            }
            (false, Some(node)) => Err(ControlError::Conflict(format!(
                "node {name} is {}: only an active or draining node is drained or undrained \
                 (a lost node becomes active again when it starts)",
                node.state
            ))),
        }
    }

    /// The fleet's gauges for `/metrics`: nodes by state and the capacity
    /// of those that take sandboxes (for every viewer: no owner's names),
    /// and per node its sandboxes and heartbeat age (the admin's view:
    /// node names are the operator's).
    pub(crate) async fn render_fleet(&self, admin: bool, out: &mut String) -> Result<()> {
        let (nodes, counts) = self.db(|s| Ok((s.list_nodes()?, s.count_by_node()?))).await?;
        let now = now_ms();
        let _ = writeln!(
            out,
            "# HELP hutch_fleet_nodes Nodes sharing the database, by state.\n# TYPE hutch_fleet_nodes gauge"
        );
        for st in [NodeState::Active, NodeState::Draining, NodeState::Lost] {
            let n = nodes.iter().filter(|n| n.state == st).count();
            let _ = writeln!(out, "hutch_fleet_nodes{{state=\"{}\"}} {n}", st.as_str());
        }
        let active = nodes.iter().filter(|n| n.state == NodeState::Active);
        let (sandboxes, memory, disk) =
            active.fold((0u64, 0u64, 0u64), |(s, m, d), n| (s + n.sandboxes, m + n.memory_mib, d + n.disk_mib));
        let _ = writeln!(
            out,
            "# HELP hutch_fleet_capacity_sandboxes Sandboxes the active nodes may hold, together.\n\
             # TYPE hutch_fleet_capacity_sandboxes gauge\nhutch_fleet_capacity_sandboxes {sandboxes}\n\
             # HELP hutch_fleet_capacity_memory_mib Memory of the active nodes for sandboxes, together (MiB).\n\
             # TYPE hutch_fleet_capacity_memory_mib gauge\nhutch_fleet_capacity_memory_mib {memory}\n\
             # HELP hutch_fleet_capacity_disk_mib Disk of the active nodes for sandboxes, together (MiB).\n\
             # TYPE hutch_fleet_capacity_disk_mib gauge\nhutch_fleet_capacity_disk_mib {disk}"
        );
        if !admin {
            return Ok(());
        }
        let _ = writeln!(
            out,
            "# HELP hutch_fleet_node_sandboxes Sandboxes of each node that are neither terminated nor lost.\n\
             # TYPE hutch_fleet_node_sandboxes gauge"
        );
        for n in &nodes {
            let c = counts.iter().find(|(name, _)| *name == n.name).map_or(0, |(_, c)| *c);
            let _ =
                writeln!(out, "hutch_fleet_node_sandboxes{{node=\"{}\",state=\"{}\"}} {c}", n.name, n.state.as_str());
        }
        let _ = writeln!(
            out,
            "# HELP hutch_fleet_node_heartbeat_age_seconds Time since each node's last heartbeat.\n\
             # TYPE hutch_fleet_node_heartbeat_age_seconds gauge"
        );
        for n in &nodes {
            let age = (now - n.heartbeat_at).max(0) as f64 / 1000.0;
            let _ = writeln!(out, "hutch_fleet_node_heartbeat_age_seconds{{node=\"{}\"}} {age}", n.name);
        }
        Ok(())
    }
}

/// Why a sandbox found on this host is no longer this node's.
fn disowned_why(r: &hutch_store::SandboxRecord, me: &str) -> String {
    if r.state == SandboxState::Lost {
        format!("lost ({})", r.reason.as_deref().unwrap_or("its node was declared lost"))
    } else {
        format!("now node {}'s, not {me}'s", r.node)
    }
}

/// Ids of the sandboxes with something in this daemon's run directory:
/// an agent socket, or a gVisor sandbox's directories.
fn on_host(run_dir: &std::path::Path) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let names = |dir: std::path::PathBuf| {
        std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.file_name().to_string_lossy().into_owned())
    };
    ids.extend(names(run_dir.join("sockets")).filter_map(|n| n.strip_suffix(".sock").map(str::to_owned)));
    ids.extend(names(run_dir.join("gv")));
    ids.extend(names(run_dir.join("gvb")));
    ids.retain(|id| id.starts_with("sb-"));
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_after_leaves_room_for_two_beats() {
        assert!(check_lost_after(Duration::from_secs(30), Duration::from_secs(5)).is_ok());
        assert!(check_lost_after(Duration::from_secs(10), Duration::from_secs(5)).is_ok());
        assert!(check_lost_after(Duration::from_secs(9), Duration::from_secs(5)).is_err());
        assert!(check_lost_after(Duration::from_secs(4), Duration::from_secs(5)).is_err());
    }

    #[test]
    fn only_sandbox_names_of_the_run_dir_are_candidates() {
        let dir = std::env::temp_dir().join(format!("hutch-fleet-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sockets")).expect("mkdir");
        std::fs::create_dir_all(dir.join("gv").join("sb-gv1")).expect("mkdir");
        for f in ["sb-one.sock", "sb-two.sock", "agent.sock", "sb-three.tmp"] {
            std::fs::write(dir.join("sockets").join(f), b"").expect("write");
        }
        let ids: Vec<String> = on_host(&dir).into_iter().collect();
        assert_eq!(ids, ["sb-gv1", "sb-one", "sb-two"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
