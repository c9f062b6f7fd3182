//! Nodes: the daemons (`hutch serve`) sharing one database. Each
//! registers at start (its name, the URL it advertises, its capacity) and
//! heartbeats; every sandbox names the node it lives on.
//!
//! The ownership rule: a daemon acts only on the sandboxes of its own
//! node. Its recovery at start, its reconciler (expiry, deaths, retried
//! deletions, revoked keys), its warm pools and its idle sweep read only
//! its node's sandboxes; an operation through the API on another node's
//! sandbox is refused with `sandbox_on_other_node` (naming the node).
//! Reads (list, get) show every node's sandboxes. Lost nodes and drains:
//! [`crate::fleet`]. Not yet: forwarding to the owner node, placement
//! across nodes.

use crate::control::{now_ms, rfc3339, Control, Need};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, SandboxId};
use hutch_api::{Node, NodeCapacity, NodeList};
use hutch_store::{NodeRecord, NodeState, SandboxRecord};
use std::sync::Arc;
use std::time::Duration;

/// The node name of a daemon not told one, and of every sandbox made
/// before nodes existed.
pub const LOCAL: &str = "local";

/// Default time between heartbeats.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

/// Who this daemon is among the nodes.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// 1 to 63 of `a-z0-9-`, starting with a letter or digit.
    pub name: String,
    /// The URL its API is reached at.
    pub advertise: String,
    pub heartbeat: Duration,
    /// Silence after which another node is declared lost
    /// ([`crate::fleet`]).
    pub lost_after: Duration,
}

impl NodeConfig {
    /// The local node, for tests.
    pub fn local() -> NodeConfig {
        NodeConfig {
            name: LOCAL.to_owned(),
            advertise: String::new(),
            heartbeat: DEFAULT_HEARTBEAT,
            lost_after: crate::fleet::DEFAULT_LOST_AFTER,
        }
    }
}

/// Whether `name` may name a node: 1 to 63 of `a-z0-9-._`, starting with a
/// letter or digit (a host name's label, or a dotted host name).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | '_'))
}

impl Control {
    /// This daemon's node name.
    pub fn node_name(&self) -> &str {
        &self.node.name
    }

    /// Refuses to act on a sandbox of another node.
    pub(crate) fn on_this_node(&self, r: &SandboxRecord) -> Result<()> {
        if r.node == self.node.name {
            Ok(())
        } else {
            Err(ControlError::OtherNode { id: r.id.clone(), node: r.node.clone() })
        }
    }

    /// [`Control::record`] of a sandbox this node acts on.
    pub(crate) async fn record_here(&self, caller: &Caller, id: &SandboxId, need: Need) -> Result<SandboxRecord> {
        let r = self.record(caller, id, need).await?;
        self.on_this_node(&r)?;
        Ok(r)
    }

    fn node_record(&self, now: i64) -> NodeRecord {
        let runs: Vec<String> = hutch_api::Class::ALL
            .into_iter()
            .filter(|c| self.runtime.runs(*c).is_ok())
            .map(|c| c.as_str().to_owned())
            .collect();
        NodeRecord {
            name: self.node.name.clone(),
            advertise: self.node.advertise.clone(),
            memory_mib: self.capacity.memory_mb,
            disk_mib: self.capacity.disk_mib,
            sandboxes: self.capacity.sandboxes,
            classes: runs,
            state: NodeState::Active,
            started_at: now,
            heartbeat_at: now,
        }
    }

    /// Registers this node (again, after a restart): active, with its
    /// address and capacity.
    pub async fn register_node(&self) -> Result<()> {
        let n = self.node_record(now_ms());
        self.db(move |s| s.register_node(&n)).await
    }

    /// Heartbeats every `heartbeat` until the daemon shuts down. A beat
    /// that finds no row (the row was deleted) registers the node again;
    /// one that finds the node lost ends what it no longer owns first
    /// ([`Control::beat`]).
    pub fn spawn_heartbeat(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.node.heartbeat);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            while !this.is_shutting_down() {
                tick.tick().await;
                this.beat().await;
            }
        })
    }

    /// `GET /v1/nodes`: every node, with its sandboxes (admin only).
    pub async fn list_nodes(&self, caller: &Caller) -> Result<NodeList> {
        if !caller.admin {
            return Err(ControlError::Forbidden("only an admin key may list nodes".into()));
        }
        let (nodes, counts) = self.db(|s| Ok((s.list_nodes()?, s.count_by_node()?))).await?;
        let now = now_ms();
        Ok(NodeList {
            nodes: nodes
                .into_iter()
                .map(|n| {
                    let held = counts.iter().find(|(name, _)| *name == n.name).map_or(0, |(_, c)| *c);
                    (n, held)
                })
                .map(|(n, held)| Node {
                    sandboxes: held,
                    drained: (n.state == NodeState::Draining).then_some(held == 0),
                    heartbeat_age_ms: (now - n.heartbeat_at).max(0) as u64,
                    started_at: rfc3339(n.started_at),
                    heartbeat_at: rfc3339(n.heartbeat_at),
                    state: n.state.as_str().to_owned(),
                    capacity: NodeCapacity {
                        memory_mib: n.memory_mib,
                        disk_mib: n.disk_mib,
                        sandboxes: n.sandboxes,
                        classes: n.classes,
                    },
                    advertise: n.advertise,
                    name: n.name,
                })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn node_names_are_host_names() {
        for ok in ["local", "node-a", "host1.example.com", "a", "n_1"] {
            assert!(super::valid_name(ok), "{ok}");
        }
        for bad in ["", "-a", "A", "a b", "a/b", &"x".repeat(64)] {
            assert!(!super::valid_name(bad), "{bad}");
        }
    }
}
