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
//! [`crate::fleet`].
//!
//! Routing: any node answers any call. The HTTP layer asks
//! [`Control::locate`] where a sandbox lives and forwards the request to
//! the owner node's advertised URL ([`Route::Node`]); a create asks
//! [`Control::place`] which node should take it (class support, a warm
//! sandbox of its template, free capacity). Both read a [`FleetView`]
//! kept for one heartbeat, so a lone node pays nothing per request. A
//! forwarded request names its node and, with a fleet secret, is signed
//! ([`Control::sign_forward`], [`Control::verify_forward`]).

use crate::control::{now_ms, rfc3339, Control, Need};
use crate::error::{ControlError, Result};
use crate::ids::{Caller, SandboxId};
use hmac::{Hmac, Mac};
use hutch_api::{Node, NodeCapacity, NodeList};
use hutch_store::{NodeRecord, NodeState, SandboxRecord};
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// The fleet's shared secret, which signs forwarded requests (None:
    /// forwarded requests are unsigned and carry no trust of their own).
    pub secret: Option<Arc<[u8]>>,
}

impl NodeConfig {
    /// The local node, for tests.
    pub fn local() -> NodeConfig {
        NodeConfig {
            name: LOCAL.to_owned(),
            advertise: String::new(),
            heartbeat: DEFAULT_HEARTBEAT,
            lost_after: crate::fleet::DEFAULT_LOST_AFTER,
            secret: None,
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

/// Where a request is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// By this node.
    Here,
    /// By another node of the fleet, at its advertised URL.
    Node { name: String, url: String },
}

/// A signed forward is honoured this long after it was signed (clocks of
/// the fleet's hosts are assumed to agree within it).
pub const FORWARD_SKEW_S: i64 = 60;

/// What this daemon last read of the fleet: the nodes, their sandboxes and
/// their warm sandboxes per template. Read again after a heartbeat's time;
/// placements made meanwhile are counted in, so a burst of creates spreads.
#[derive(Default)]
pub(crate) struct FleetView(Mutex<Option<View>>);

#[derive(Clone)]
struct View {
    read: Instant,
    nodes: Arc<Vec<NodeRecord>>,
    /// Sandboxes (not terminated) per node.
    counts: HashMap<String, u64>,
    /// Ready warm sandboxes per (node, template id).
    warm: HashMap<(String, String), u64>,
}

impl FleetView {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<View>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `me`'s part of `total` split over `members` (sorted): `total / n`, one
/// more for the first `total % n`; none when `me` is not a member, the
/// whole when nobody is (a view without this node yet).
fn share(total: u32, members: &[&str], me: &str) -> u32 {
    if members.is_empty() {
        return total;
    }
    let Some(i) = members.iter().position(|m| *m == me) else { return 0 };
    let n = members.len() as u32;
    total / n + u32::from((i as u32) < total % n)
}

/// The node a create goes to (see [`Control::place`]): of the active,
/// `fresh` nodes that run `class` and have room (or a warm sandbox of
/// `template`), one with a warm sandbox first, then the largest free share
/// of its capacity, then `me`. Pure, for the tests.
fn choose<'a>(
    view: &'a View,
    me: &str,
    class: &str,
    template: Option<&str>,
    fresh: impl Fn(&NodeRecord) -> bool,
) -> Option<&'a NodeRecord> {
    view.nodes
        .iter()
        .filter(|n| n.state == NodeState::Active && fresh(n))
        .filter(|n| n.classes.iter().any(|c| c == class))
        .filter_map(|n| {
            let used = view.counts.get(&n.name).copied().unwrap_or(0);
            let free = n.sandboxes.saturating_sub(used);
            let warm = template.map_or(0, |t| view.warm.get(&(n.name.clone(), t.to_owned())).copied().unwrap_or(0));
            (free > 0 || warm > 0).then(|| {
                let share = free.saturating_mul(1000) / n.sandboxes.max(1);
                ((warm > 0, share, n.name == me), n)
            })
        })
        .max_by_key(|(key, _)| *key)
        .map(|(_, n)| n)
}

impl Control {
    /// The fleet as last read (again when older than a heartbeat); None
    /// when it cannot be read (the caller answers here, which says what
    /// is wrong in its own words).
    async fn fleet_view(&self) -> Option<View> {
        let max_age = self.node.heartbeat.min(Duration::from_secs(5));
        if let Some(v) = self.fleet.lock().as_ref() {
            if v.read.elapsed() < max_age {
                return Some(v.clone());
            }
        }
        let read = self.db(|s| Ok((s.list_nodes()?, s.count_by_node()?, s.pooled_sandboxes(None)?))).await;
        let (nodes, counts, pooled) = match read {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("node {}: cannot read the fleet: {e}", self.node.name);
                return None;
            }
        };
        let mut warm: HashMap<(String, String), u64> = HashMap::new();
        for p in pooled.iter().filter(|p| p.state == hutch_api::SandboxState::Running) {
            if let Some(t) = &p.template_id {
                *warm.entry((p.node.clone(), t.clone())).or_default() += 1;
            }
        }
        let view = View { read: Instant::now(), nodes: Arc::new(nodes), counts: counts.into_iter().collect(), warm };
        *self.fleet.lock() = Some(view.clone());
        Some(view)
    }

    /// Whether a node is there to take requests: active or draining (it
    /// still answers for its sandboxes), heartbeating within three beats.
    fn answering(&self, n: &NodeRecord, now: i64) -> bool {
        let silent = Duration::from_millis((now - n.heartbeat_at).max(0) as u64);
        n.state != NodeState::Lost && !n.advertise.is_empty() && silent <= self.node.heartbeat * 3
    }

    fn others_take_creates(&self, view: &View, now: i64) -> bool {
        view.nodes.iter().any(|n| n.name != self.node.name && n.state == NodeState::Active && self.answering(n, now))
    }

    /// Whether no other node takes creates now (a lone daemon, or a fleet
    /// whose other nodes are silent, lost or draining): creates stay here.
    pub async fn alone(&self) -> bool {
        match self.fleet_view().await {
            Some(view) => !self.others_take_creates(&view, now_ms()),
            None => true,
        }
    }

    /// This node's share of a template's warm pool size `total`, which is
    /// the fleet's: split evenly over the active nodes heartbeating within
    /// three beats that run `class`, the remainder going to the first
    /// names. A node outside them (draining, or not running the class)
    /// keeps none; a node that cannot read the fleet keeps the whole.
    pub(crate) async fn fleet_share(&self, total: u32, class: &str) -> u32 {
        let Some(view) = self.fleet_view().await else { return total };
        let now = now_ms();
        let mut members: Vec<&str> = view
            .nodes
            .iter()
            .filter(|n| n.state == NodeState::Active && (n.name == self.node.name || self.answering(n, now)))
            .filter(|n| n.classes.iter().any(|c| c == class))
            .map(|n| n.name.as_str())
            .collect();
        members.sort_unstable();
        share(total, &members, &self.node.name)
    }

    /// Where calls for sandbox `id` are answered: here when it is this
    /// node's (or unknown, or malformed: this node says so), else at its
    /// node's advertised URL. A node that is lost, or advertises no URL,
    /// is not asked: this node answers (its state says what happened); so
    /// does this node for a paused sandbox of a silent node, or of a
    /// draining one that pushed its files (a resume here moves it).
    pub async fn locate(&self, id: &str) -> Route {
        let Ok(id) = SandboxId::parse(id) else { return Route::Here };
        if self.live(&id).is_some() {
            return Route::Here;
        }
        let Some(view) = self.fleet_view().await else { return Route::Here };
        if view.nodes.iter().all(|n| n.name == self.node.name) {
            return Route::Here;
        }
        let record = match self.db_read(move |s| s.get_sandbox(id.as_str())).await {
            Ok(Some(r)) if r.node != self.node.name => r,
            _ => return Route::Here,
        };
        let now = now_ms();
        let node = view.nodes.iter().find(|n| n.name == record.node);
        // A paused sandbox of a node that does not answer is answered here
        // (a resume moves it if its files are in the registry, or says why
        // not: see `moves`); so is one of a draining node whose files are.
        if record.state == hutch_api::SandboxState::Paused {
            if node.is_some_and(|n| !self.answering(n, now)) {
                return Route::Here;
            }
            if node.is_some_and(|n| n.state == NodeState::Draining) {
                let id = record.id.clone();
                if let Ok(Some(_)) = self.db(move |s| s.pushed(hutch_store::Pushed::Sandbox, &id)).await {
                    return Route::Here;
                }
            }
        }
        match node {
            Some(n) if n.state != NodeState::Lost && !n.advertise.is_empty() => {
                Route::Node { name: n.name.clone(), url: n.advertise.clone() }
            }
            _ => Route::Here,
        }
    }

    /// The node a create of `template` (None: `base`) by `caller` goes to:
    /// among the active nodes heartbeating within three beats that run the
    /// template's class and have room, one holding a warm sandbox of it,
    /// else the one with the largest free share of its capacity; this node
    /// wins ties. Here when no other node qualifies (this node then takes
    /// it or refuses it in its own words) or the template is unknown.
    ///
    /// A create that names its node (`pinned`, an admin's) goes there when
    /// it is an active node; else here, which refuses it. A template on an
    /// image other than `base` or a preset stays here (images are on the
    /// node that made them) unless it is a build pushed to the fleet's
    /// registry (any node pulls it), as does a create naming a snapshot
    /// or volumes (the HTTP layer keeps those here).
    pub async fn place(&self, caller: &Caller, template: Option<&str>, pinned: Option<&str>) -> Route {
        let Some(view) = self.fleet_view().await else { return Route::Here };
        let now = now_ms();
        if let Some(name) = pinned {
            return match view.nodes.iter().find(|n| n.name == name) {
                Some(n) if n.name != self.node.name && n.state == NodeState::Active && !n.advertise.is_empty() => {
                    Route::Node { name: n.name.clone(), url: n.advertise.clone() }
                }
                _ => Route::Here,
            };
        }
        if !self.others_take_creates(&view, now) {
            return Route::Here;
        }
        let Ok(recipe) = self.recipe(&caller.owner, template).await else { return Route::Here };
        // An image other than `base` and the presets (which every node makes
        // on first use) is on the node that pulled, imported or built it;
        // a build pushed to the fleet's registry, on every node that asks
        // (`moves`).
        if recipe.image != "base" && !hutch_runtime::image::debian::is_preset(&recipe.image) {
            match self.build_pushed(recipe.id.as_deref(), &recipe.image).await {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return Route::Here,
            }
        }
        let fresh = |n: &NodeRecord| n.name == self.node.name || self.answering(n, now);
        let chosen = choose(&view, &self.node.name, recipe.class.as_str(), recipe.id.as_deref(), fresh);
        let Some(n) = chosen else {
            self.metrics.placement_failed();
            return Route::Here;
        };
        // Count it in until the next read, so a burst spreads.
        if let Some(v) = self.fleet.lock().as_mut() {
            *v.counts.entry(n.name.clone()).or_default() += 1;
            if let Some(t) = &recipe.id {
                if let Some(w) = v.warm.get_mut(&(n.name.clone(), t.clone())) {
                    *w = w.saturating_sub(1);
                }
            }
        }
        if n.name == self.node.name {
            Route::Here
        } else {
            Route::Node { name: n.name.clone(), url: n.advertise.clone() }
        }
    }

    /// The route to node `name`: there when it answers (active or
    /// draining, heartbeating, advertising a URL), else here.
    pub(crate) async fn route_to(&self, name: &str) -> Route {
        let Some(view) = self.fleet_view().await else { return Route::Here };
        match view.nodes.iter().find(|n| n.name == name) {
            Some(n) if n.name != self.node.name && self.answering(n, now_ms()) => {
                Route::Node { name: n.name.clone(), url: n.advertise.clone() }
            }
            _ => Route::Here,
        }
    }

    /// The node a paused sandbox of class `class` moves to as this node
    /// drains: chosen as a create without a template is ([`choose`]);
    /// None when no other active node runs the class and has room.
    pub(crate) async fn place_moved(&self, class: &str) -> Option<String> {
        let view = self.fleet_view().await?;
        let now = now_ms();
        let fresh = |n: &NodeRecord| n.name != self.node.name && self.answering(n, now);
        let name = choose(&view, &self.node.name, class, None, fresh)?.name.clone();
        if let Some(v) = self.fleet.lock().as_mut() {
            *v.counts.entry(name.clone()).or_default() += 1;
        }
        Some(name)
    }

    fn forward_mac(&self, secret: &[u8], node: &str, at: i64, method: &str, path: &str, client: &str) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
        for part in [node, &at.to_string(), method, path, client] {
            mac.update(part.as_bytes());
            mac.update(b"\n");
        }
        mac
    }

    /// The signature of a request this node forwards (None without a
    /// fleet secret): over this node's name, the time, the method, the
    /// path and query, and the client's address it vouches for.
    pub fn sign_forward(&self, at: i64, method: &str, path: &str, client: &str) -> Option<String> {
        let secret = self.node.secret.as_ref()?;
        let mac = self.forward_mac(secret, &self.node.name, at, method, path, client);
        Some(hex::encode(mac.finalize().into_bytes()))
    }

    /// Whether a forwarded request's signature is a fleet node's, made
    /// within [`FORWARD_SKEW_S`] of `now` (seconds). False without a secret.
    #[allow(clippy::too_many_arguments)]
    pub fn verify_forward(
        &self,
        node: &str,
        at: i64,
        now: i64,
        method: &str,
        path: &str,
        client: &str,
        signature: &str,
    ) -> bool {
        let Some(secret) = self.node.secret.as_ref() else { return false };
        if (now - at).abs() > FORWARD_SKEW_S || !valid_name(node) {
            return false;
        }
        let Ok(sig) = hex::decode(signature) else { return false };
        self.forward_mac(secret, node, at, method, path, client).verify_slice(&sig).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn node_names_are_host_names() {
        for ok in ["local", "node-a", "host1.example.com", "a", "n_1"] {
            assert!(super::valid_name(ok), "{ok}");
        }
        for bad in ["", "-a", "A", "a b", "a/b", &"x".repeat(64)] {
            assert!(!super::valid_name(bad), "{bad}");
        }
    }

    fn node(name: &str, sandboxes: u64, classes: &[&str], state: NodeState) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            advertise: format!("http://{name}:7700"),
            memory_mib: 1024,
            disk_mib: 1024,
            sandboxes,
            classes: classes.iter().map(|c| c.to_string()).collect(),
            state,
            started_at: 0,
            heartbeat_at: 0,
        }
    }

    fn view(nodes: Vec<NodeRecord>, counts: &[(&str, u64)], warm: &[(&str, &str, u64)]) -> View {
        View {
            read: Instant::now(),
            nodes: Arc::new(nodes),
            counts: counts.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
            warm: warm.iter().map(|(n, t, c)| ((n.to_string(), t.to_string()), *c)).collect(),
        }
    }

    fn chosen(v: &View, class: &str, template: Option<&str>, silent: &[&str]) -> Option<String> {
        choose(v, "a", class, template, |n| !silent.contains(&n.name.as_str())).map(|n| n.name.clone())
    }

    #[test]
    fn a_fleet_wide_count_is_split_evenly_and_whole() {
        let m = ["a", "b", "c"];
        assert_eq!([share(5, &m, "a"), share(5, &m, "b"), share(5, &m, "c")], [2, 2, 1]);
        assert_eq!([share(1, &m, "a"), share(1, &m, "b"), share(1, &m, "c")], [1, 0, 0]);
        for total in 0..20 {
            assert_eq!(m.iter().map(|me| share(total, &m, me)).sum::<u32>(), total);
        }
        assert_eq!(share(4, &m, "d"), 0);
        assert_eq!(share(4, &[], "a"), 4);
    }

    #[test]
    fn placement_takes_the_freest_share_and_this_node_on_ties() {
        let c = ["container"];
        let v = view(
            vec![node("a", 100, &c, NodeState::Active), node("b", 100, &c, NodeState::Active)],
            &[("a", 10), ("b", 10)],
            &[],
        );
        assert_eq!(chosen(&v, "container", None, &[]).as_deref(), Some("a"));
        let v = view(
            vec![node("a", 100, &c, NodeState::Active), node("b", 1000, &c, NodeState::Active)],
            &[("a", 10), ("b", 500)],
            &[],
        );
        // a: 90% free; b: 50% free.
        assert_eq!(chosen(&v, "container", None, &[]).as_deref(), Some("a"));
        let v = view(
            vec![node("a", 100, &c, NodeState::Active), node("b", 100, &c, NodeState::Active)],
            &[("a", 11), ("b", 10)],
            &[],
        );
        assert_eq!(chosen(&v, "container", None, &[]).as_deref(), Some("b"));
    }

    #[test]
    fn placement_prefers_a_warm_sandbox_and_skips_full_silent_draining_lost_and_classless_nodes() {
        let v = view(
            vec![
                node("a", 100, &["container"], NodeState::Active),
                node("b", 100, &["container"], NodeState::Active),
                node("c", 100, &["container", "gvisor"], NodeState::Active),
                node("d", 100, &["container", "gvisor"], NodeState::Draining),
                node("e", 100, &["container", "gvisor"], NodeState::Lost),
            ],
            &[("a", 0), ("b", 99), ("c", 50)],
            &[("b", "tpl-1", 1)],
        );
        assert_eq!(chosen(&v, "container", Some("tpl-1"), &[]).as_deref(), Some("b"));
        assert_eq!(chosen(&v, "container", Some("tpl-2"), &[]).as_deref(), Some("a"));
        assert_eq!(chosen(&v, "gvisor", None, &[]).as_deref(), Some("c"));
        assert_eq!(chosen(&v, "gvisor", None, &["c"]), None);
        assert_eq!(chosen(&v, "process", None, &[]), None);
        let full = view(vec![node("a", 10, &["container"], NodeState::Active)], &[("a", 10)], &[]);
        assert_eq!(chosen(&full, "container", None, &[]), None);
    }
}
