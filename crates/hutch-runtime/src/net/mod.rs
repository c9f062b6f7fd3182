//! Sandbox networks: a network namespace per sandbox with a veth to the
//! host, an address from a pool, a default route, NAT, and an egress policy
//! the host enforces (policy/network.nft).
//!
//! Network namespaces are slow to tear down (the kernel frees them
//! asynchronously, seconds later), so they are kept in a pool and reused:
//! a namespace, its veth pair and its addresses are made once, handed to
//! one sandbox after another, and only the sandbox's policy (set elements)
//! changes between them. Nothing inside a namespace survives its sandbox:
//! processes and their sockets die with the sandbox's cgroup, and the
//! sandbox never had the capability to configure the namespace itself.
//!
//! `deny_all` sandboxes get no veth at all: their namespace holds only
//! `lo`, so there is no rule that could be lifted.

pub mod netlink;
pub mod nftables;

use netlink::{Netlink, SetOp, SetOpKind, NFPROTO_INET};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const RULESET: &str = include_str!("../../policy/network.nft");
const PEER_NAME: &str = "eth0";
/// Daemons that may run side by side on one host, each with its own
/// table, links and subnet (tests run several).
pub const MAX_INSTANCES: u8 = 32;
/// Namespaces kept ready beyond those in use.
const POOL_KEEP: usize = 64;
/// Released namespaces kept for reuse, at most. Deleting a veth costs a
/// walk of the host's whole IPv6 routing table under the lock every link
/// change takes (several routes per sandbox link): with thousands alive,
/// each deletion costs milliseconds and they all queue on that lock. So a
/// sandbox's end keeps its namespace (its processes, sockets, flows and
/// set elements gone), the next creates take them back, and the pool is
/// trimmed to [`POOL_KEEP`] off the request path ([`Network::trim_pool`])
/// once no create has taken from it for [`POOL_IDLE`]. About 0.35 MiB of
/// kernel memory each (a namespace and a veth pair; measured 0.352).
const POOL_RETAIN: usize = 4096;
/// How long the pool must go untouched before it is trimmed.
const POOL_IDLE: Duration = Duration::from_secs(10);
/// Links deleted per trim, at most, and the time a trim may spend: each
/// deletion holds the lock every create's link setup takes (for tens of
/// milliseconds with thousands of links on the host).
const TRIM_BATCH: usize = 8;
const TRIM_BUDGET: Duration = Duration::from_millis(20);
/// How long a daemon's exit spends deleting pooled links one by one; the
/// rest go with their namespaces, which the kernel tears down after.
const TEARDOWN_BUDGET: Duration = Duration::from_secs(5);
/// Addresses a resolver may admit for one sandbox.
pub const MAX_LEARNED: usize = 4096;
/// An admitted address stays at least this long, whatever its answer's
/// TTL (clients cache answers, and connections outlive them)...
pub const LEARNED_TTL_FLOOR: Duration = Duration::from_secs(600);
/// ... and at most this long, so that addresses handed out over a
/// sandbox's life (DNS rebinding, rotation) do not pile up.
pub const LEARNED_TTL_CAP: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("network {what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("the network is not set up on this host: {0}")]
    Unavailable(String),
    #[error("no free sandbox address")]
    Exhausted,
    #[error(
        "sandbox {0} was started without a network interface (deny_all): its policy cannot be opened while it runs"
    )]
    NoInterface(String),
    #[error(
        "network instance {instance} is held by another hutch daemon{holder} (lock {path}); \
         give this one another --net-instance"
    )]
    InstanceHeld { instance: u8, path: String, holder: String },
}

/// Where daemons lock their network instances: host-wide, whatever each
/// daemon's run directory.
pub const INSTANCE_LOCK_DIR: &str = "/run/hutch";

/// A daemon's exclusive hold on its network instance (its table, links,
/// subnet and conntrack marks): an `flock` on
/// `/run/hutch/net-<N>.lock`, released when the daemon's process ends,
/// however it ends. A second daemon with the same instance refuses to
/// start instead of sweeping the first one's links.
#[derive(Debug)]
pub struct InstanceLock {
    instance: u8,
    _file: std::fs::File,
}

impl InstanceLock {
    pub fn acquire(instance: u8) -> Result<InstanceLock, NetError> {
        Self::acquire_in(Path::new(INSTANCE_LOCK_DIR), instance)
    }

    pub fn acquire_in(dir: &Path, instance: u8) -> Result<InstanceLock, NetError> {
        use std::io::{Read, Seek, Write};
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(io_err(format!("create {}", dir.display())))?;
        let path = dir.join(format!("net-{instance}.lock"));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err(format!("open {}", path.display())))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io_err(format!("lock {}", path.display()))(e));
            }
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let pid = pid.trim();
            let holder = if pid.is_empty() { String::new() } else { format!(" (pid {pid})") };
            return Err(NetError::InstanceHeld { instance, path: path.display().to_string(), holder });
        }
        let _ = file.set_len(0);
        let _ = file.rewind();
        let _ = writeln!(file, "{}", std::process::id());
        Ok(InstanceLock { instance, _file: file })
    }

    pub fn instance(&self) -> u8 {
        self.instance
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Io { what, source }
}

/// What a sandbox may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    Default,
    DenyAll,
    Private,
}

impl Egress {
    pub fn as_str(self) -> &'static str {
        match self {
            Egress::Default => "default",
            Egress::DenyAll => "deny_all",
            Egress::Private => "private",
        }
    }
}

/// An entry of an allow or deny list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    Cidr(IpAddr, u8),
    /// A name (`pypi.org`) or every name under one (`*.github.com`),
    /// lower case, without the trailing dot.
    Domain(String),
}

impl Rule {
    /// Parses `1.2.3.0/24`, `1.2.3.4`, `2001:db8::/32`, `pypi.org` or
    /// `*.github.com`.
    pub fn parse(s: &str) -> Result<Rule, String> {
        let s = s.trim();
        if let Some((addr, len)) = s.split_once('/') {
            let addr: IpAddr = addr.parse().map_err(|_| format!("{s:?} is not a CIDR"))?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let len: u8 = len.parse().ok().filter(|l| *l <= max).ok_or_else(|| format!("{s:?}: bad prefix length"))?;
            return Ok(Rule::Cidr(addr, len));
        }
        if let Ok(addr) = s.parse::<IpAddr>() {
            return Ok(Rule::Cidr(addr, if addr.is_ipv4() { 32 } else { 128 }));
        }
        let name = s.trim_end_matches('.').to_ascii_lowercase();
        let body = name.strip_prefix("*.").unwrap_or(&name);
        let valid = !body.is_empty()
            && name.len() <= 253
            && body.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            });
        if !valid {
            return Err(format!("{s:?} is neither a CIDR nor a domain name"));
        }
        Ok(Rule::Domain(name))
    }

    /// Whether a (lower case, dot-less) query name matches this domain rule.
    pub fn matches_name(&self, qname: &str) -> bool {
        match self {
            Rule::Domain(d) => match d.strip_prefix("*.") {
                Some(suffix) => qname.len() > suffix.len() + 1 && qname.ends_with(&format!(".{suffix}")),
                None => qname == d,
            },
            Rule::Cidr(..) => false,
        }
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rule::Cidr(a, l) => write!(f, "{a}/{l}"),
            Rule::Domain(d) => f.write_str(d),
        }
    }
}

/// A sandbox's network policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub egress: Egress,
    pub allow: Vec<Rule>,
    pub deny: Vec<Rule>,
    /// For `private`: who may talk to each other (owner and template).
    pub group: String,
    /// It names secrets: its HTTPS flows that its policy allows go to the
    /// daemon's egress proxy (the `inject` sets of policy/network.nft).
    pub inject: bool,
}

impl Policy {
    /// With an allow list, only its entries are reachable.
    pub fn listed(&self) -> bool {
        !self.allow.is_empty()
    }

    /// Whether the resolver answers `qname` for this sandbox.
    pub fn resolves(&self, qname: &str) -> bool {
        if self.egress != Egress::Default || self.deny.iter().any(|r| r.matches_name(qname)) {
            return false;
        }
        !self.listed() || self.allow.iter().any(|r| r.matches_name(qname))
    }
}

/// Addresses and names of the network.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Sandboxes get /32s from this /16; `.1` is the gateway.
    pub subnet4: Ipv4Addr,
    /// Sandboxes get /128s from this /64 when the host has IPv6.
    pub subnet6: Ipv6Addr,
    /// Resolvers the daemon forwards allowed queries to.
    pub upstream_dns: Vec<std::net::SocketAddr>,
    /// Force IPv6 on or off; `None`: on when the host has a default route.
    pub ipv6: Option<bool>,
    /// Where the sandboxes' resolv.conf is written.
    pub run_dir: PathBuf,
    /// Which of the host's hutch networks this is (0 normally).
    pub instance: u8,
    /// The egress proxy's port on the gateway address.
    pub egress_port: u16,
}

/// The egress proxy's port unless the operator picks another.
pub const EGRESS_PORT: u16 = 3130;

impl NetConfig {
    /// Instance `n` (below MAX_INSTANCES) uses 100.(96+n).0.0/16 and
    /// fd68:7574:6368:n::/64.
    pub fn new(run_dir: &Path, instance: u8) -> NetConfig {
        let n = instance.min(MAX_INSTANCES - 1);
        NetConfig {
            subnet4: Ipv4Addr::new(100, 96 + n, 0, 0),
            subnet6: Ipv6Addr::new(0xfd68, 0x7574, 0x6368, n as u16, 0, 0, 0, 0),
            upstream_dns: host_resolvers(Path::new("/etc/resolv.conf")),
            ipv6: None,
            run_dir: run_dir.to_path_buf(),
            instance: n,
            egress_port: EGRESS_PORT,
        }
    }

    /// The nftables table of this instance.
    pub fn table(&self) -> String {
        if self.instance == 0 {
            "hutch".into()
        } else {
            format!("hutch{}", self.instance)
        }
    }

    /// Host ends of veths are named this + 8 random hex digits: a name is
    /// never reused while the kernel may still be tearing down an old link.
    pub fn host_prefix(&self) -> String {
        format!("h{:02x}s", self.instance)
    }

    pub fn gateway4(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet4) | 1)
    }

    /// The sandboxes' IPv6 gateway: a link-local address on every host veth.
    pub fn gateway6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1)
    }

    fn addr4(&self, index: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet4) + index)
    }

    fn addr6(&self, index: u32) -> Ipv6Addr {
        Ipv6Addr::from(u128::from(self.subnet6) + index as u128)
    }
}

/// The `nameserver` lines of a resolv.conf, as port-53 addresses.
pub fn host_resolvers(path: &Path) -> Vec<std::net::SocketAddr> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().split('%').next()?.parse::<IpAddr>().ok())
        .map(|a| std::net::SocketAddr::new(a, 53))
        .collect()
}

/// One network namespace with its veth and addresses, ready for a sandbox.
#[derive(Debug)]
struct Slot {
    netns: Arc<OwnedFd>,
    host_if: String,
    index: u32,
    /// The packets its host link had received when the flows of its
    /// address were last flushed (None: never). Each flow that carries the
    /// address's mark began with a packet from the sandbox, which that link
    /// received; while the count stays there, no such flow was made since,
    /// and a release skips the flush (a walk of the host's whole conntrack
    /// table, about half a millisecond here).
    flushed_at: Option<u64>,
}

/// A sandbox's network, while it runs.
#[derive(Debug, Clone)]
pub struct Attached {
    pub netns: Option<Arc<OwnedFd>>,
    pub addr4: Option<Ipv4Addr>,
    pub addr6: Option<Ipv6Addr>,
    pub host_if: Option<String>,
    /// Index of the address in the pool (stored to adopt it after a restart).
    pub index: u32,
}

#[derive(Debug)]
struct Lease {
    slot: Option<Slot>,
    policy: Policy,
    /// Every set element added for this sandbox, removed at release.
    elements: Vec<SetOp>,
    /// Addresses the resolver admitted, each until its answer expires.
    learned: BTreeMap<IpAddr, Instant>,
}

#[derive(Debug, Default)]
struct State {
    /// Namespaces made ahead of time, never used: for any sandbox.
    pool: std::collections::VecDeque<Slot>,
    /// Namespaces of sandboxes that ended, with their policy group (owner
    /// and template), oldest first: each is handed again only within its
    /// group, the most recently released first (the oldest are trimmed
    /// first). What a sandbox leaves in its namespace after its
    /// processes die (TCP connections in TIME_WAIT or orphaned, listed in
    /// its `/proc/net/tcp` with their peers for up to a minute) is seen
    /// only by its group, which `private` egress already lets talk to it.
    released: std::collections::VecDeque<(String, Slot)>,
    /// When a create last took from the pools (or a release filled one).
    pool_used: Option<Instant>,
    leases: HashMap<String, Lease>,
    /// Address indexes in use (pooled or leased).
    used: BTreeSet<u32>,
    next: u32,
    /// Group names of `private` sandboxes and their marks.
    groups: BTreeMap<String, u32>,
    /// Addresses of sandboxes that outlived the last daemon, until adopted.
    reserved: BTreeSet<u32>,
    /// Namespaces the pool is filled to; released ones are kept up to
    /// [`POOL_RETAIN`], and trimmed back to twice this when idle.
    target: usize,
}

/// The host's side of every sandbox network.
#[derive(Debug)]
pub struct Network {
    cfg: NetConfig,
    ipv6: bool,
    mtu: u32,
    resolv_conf: PathBuf,
    rtnl: Mutex<Netlink>,
    /// Lock order: `nft`, then `state`. Every change of set elements holds
    /// both, so the kernel's sets and the leases change together: no
    /// element is added for a lease that a release already ended.
    nft: Mutex<Netlink>,
    state: Mutex<State>,
    /// The host's networks as last loaded into the `host4`/`host6` sets.
    host: Mutex<Vec<(IpAddr, u8)>>,
    /// Egress metering: by host link, the received-bytes counter up to
    /// which its bytes were handed out (a pooled link serves many
    /// sandboxes; a new one starts at 0).
    rx_seen: Mutex<HashMap<String, u64>>,
    /// Bytes of released sandboxes, not yet taken by [`Network::take_egress`].
    egress_released: Mutex<Vec<(String, u64)>>,
    /// Called inside `admit` between recording an element and adding it,
    /// so a test can force a `release` into that gap.
    #[cfg(test)]
    admit_pause: TestHook,
    /// Conntrack flushes made, for the tests.
    #[cfg(test)]
    flushes: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
#[derive(Default)]
struct TestHook(Mutex<Option<Arc<dyn Fn() + Send + Sync>>>);

#[cfg(test)]
impl std::fmt::Debug for TestHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestHook")
    }
}

#[cfg(test)]
impl TestHook {
    fn set(&self, hook: Option<Arc<dyn Fn() + Send + Sync>>) {
        *lock(&self.0) = hook;
    }

    fn run(&self) {
        let hook = lock(&self.0).clone();
        if let Some(hook) = hook {
            hook();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Network {
    /// Prepares the host: forwarding on, the gateway address, the nftables
    /// table (replacing an older one, so a restarted daemon starts from
    /// empty sets), links left by a previous daemon removed unless `keep`
    /// names them (host link -> address index of sandboxes that outlived
    /// it; their addresses stay reserved until `adopt`). Only the holder
    /// of the instance's lock may do this: it sweeps the instance's links.
    pub fn setup(cfg: NetConfig, keep: &BTreeMap<String, u32>, held: &InstanceLock) -> Result<Network, NetError> {
        if held.instance != cfg.instance {
            return Err(NetError::Unavailable(format!(
                "network instance {} is not the one locked ({})",
                cfg.instance, held.instance
            )));
        }
        let has_v6 = std::fs::read_to_string("/proc/net/ipv6_route")
            .map(|t| t.lines().any(|l| l.starts_with("00000000000000000000000000000000 00")))
            .unwrap_or(false);
        let ipv6 = cfg.ipv6.unwrap_or(has_v6) && Path::new("/proc/sys/net/ipv6").exists();
        write_sysctl("net/ipv4/ip_forward", "1")?;
        if ipv6 {
            // Forwarding turns off router advertisements on links that take
            // them with accept_ra=1; 2 keeps the host's own addresses.
            for dir in std::fs::read_dir("/proc/sys/net/ipv6/conf").map_err(io_err("read ipv6 conf"))?.flatten() {
                let p = dir.path().join("accept_ra");
                if std::fs::read_to_string(&p).map(|v| v.trim() == "1").unwrap_or(false) {
                    let _ = std::fs::write(&p, "2");
                }
            }
            write_sysctl("net/ipv6/conf/all/forwarding", "1")?;
        }
        let mut rtnl = Netlink::route().map_err(io_err("open rtnetlink"))?;
        let host = host_networks(&mut rtnl).map_err(io_err("read the host's networks"))?;
        let mut nft = Netlink::netfilter().map_err(io_err("open nfnetlink"))?;
        load_ruleset(&mut nft, &cfg, &host)?;
        let mut stale = Vec::new();
        for name in rtnl.link_names().map_err(io_err("list links"))? {
            if name.starts_with(&cfg.host_prefix()) && !keep.contains_key(&name) {
                stale.push(name);
            }
        }
        for name in stale {
            if let Ok(i) = netlink::link_index(&name) {
                let _ = rtnl.del_link(i);
            }
        }
        let resolv_conf = cfg.run_dir.join("resolv.conf");
        let mut text = format!("# hutch: the daemon's resolver for this sandbox\nnameserver {}\n", cfg.gateway4());
        text.push_str("options edns0 trust-ad\n");
        std::fs::write(&resolv_conf, text).map_err(io_err("write resolv.conf"))?;
        let mtu = uplink_mtu();
        Ok(Network {
            cfg,
            ipv6,
            mtu,
            resolv_conf,
            rtnl: Mutex::new(rtnl),
            rx_seen: Mutex::new(HashMap::new()),
            egress_released: Mutex::new(Vec::new()),
            nft: Mutex::new(nft),
            host: Mutex::new(host),
            state: Mutex::new(State {
                next: 2,
                used: keep.values().copied().collect(),
                reserved: keep.values().copied().collect(),
                ..State::default()
            }),
            #[cfg(test)]
            admit_pause: TestHook::default(),
            #[cfg(test)]
            flushes: Default::default(),
        })
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    pub fn ipv6(&self) -> bool {
        self.ipv6
    }

    /// The file every networked sandbox sees as /etc/resolv.conf.
    pub fn resolv_conf(&self) -> &Path {
        &self.resolv_conf
    }

    /// Keeps `n` namespaces ready (called off the request path).
    pub fn fill_pool(&self, n: usize) -> Result<(), NetError> {
        lock(&self.state).target = n.min(POOL_KEEP);
        while lock(&self.state).pool.len() < n.min(POOL_KEEP) {
            let slot = self.make_slot()?;
            lock(&self.state).pool.push_back(slot);
        }
        Ok(())
    }

    /// Deletes a few pooled namespaces beyond what the pool is kept at,
    /// once no create has taken from it for [`POOL_IDLE`] (called off the
    /// request path, repeatedly). Returns how many were deleted.
    pub fn trim_pool(&self, now: Instant) -> usize {
        let started = Instant::now();
        let mut n = 0;
        while n < TRIM_BATCH && started.elapsed() < TRIM_BUDGET {
            let slot = {
                let mut st = lock(&self.state);
                let keep = (2 * st.target).clamp(1, POOL_KEEP);
                let busy = st.pool_used.is_some_and(|t| now.saturating_duration_since(t) < POOL_IDLE);
                if busy {
                    break;
                }
                // The oldest released first (the newest are handed out
                // next), then fresh ones beyond what the pool keeps.
                let slot = match st.released.pop_front() {
                    Some((_, slot)) => Some(slot),
                    None if st.pool.len() > keep => st.pool.pop_back(),
                    None => None,
                };
                let Some(slot) = slot else { break };
                st.used.remove(&slot.index);
                slot
            };
            self.drop_slot(slot);
            n += 1;
        }
        n
    }

    /// Deletes a namespace's host link; the namespace goes with its last
    /// descriptor.
    fn drop_slot(&self, slot: Slot) {
        lock(&self.rx_seen).remove(&slot.host_if);
        if let Ok(i) = host_index(&slot.host_if) {
            let _ = lock(&self.rtnl).del_link(i);
        }
    }

    pub fn pooled(&self) -> usize {
        lock(&self.state).pool.len()
    }

    /// Namespaces of ended sandboxes kept for their groups.
    pub fn released(&self) -> usize {
        lock(&self.state).released.len()
    }

    fn take_index(&self) -> Result<u32, NetError> {
        let mut st = lock(&self.state);
        // Round robin: an address freed now is the last to be given again.
        for _ in 0..0xfffe {
            let i = st.next;
            st.next = if st.next >= 0xfffe { 2 } else { st.next + 1 };
            if st.used.insert(i) {
                return Ok(i);
            }
        }
        Err(NetError::Exhausted)
    }

    fn make_slot(&self) -> Result<Slot, NetError> {
        let index = self.take_index()?;
        let host_if = format!("{}{}", self.cfg.host_prefix(), crate::sys::random_hex(4));
        let made = std::thread::scope(|s| {
            s.spawn(|| self.build_slot(index, &host_if))
                .join()
                .unwrap_or_else(|_| Err(NetError::Unavailable("network setup thread panicked".into())))
        });
        match made {
            Ok(netns) => Ok(Slot { netns: Arc::new(netns), host_if, index, flushed_at: None }),
            Err(e) => {
                lock(&self.state).used.remove(&index);
                if let Ok(i) = netlink::link_index(&host_if) {
                    let _ = lock(&self.rtnl).del_link(i);
                }
                Err(e)
            }
        }
    }

    /// Runs on a thread of its own, which moves into the new namespace:
    /// the host's side is configured through the socket opened before.
    fn build_slot(&self, index: u32, host_if: &str) -> Result<OwnedFd, NetError> {
        // SAFETY: unshare affects only this thread's network namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(io_err("unshare the network namespace")(io::Error::last_os_error()));
        }
        let netns = open_fd("/proc/thread-self/ns/net").map_err(io_err("open the new namespace"))?;
        // The namespace is the sandbox's alone: any of its users may bind
        // low ports and ping. Its gids are somewhere in hutch's range.
        write_sysctl("net/ipv4/ip_unprivileged_port_start", "0")?;
        let _ =
            write_sysctl("net/ipv4/ping_group_range", &format!("{} {}", crate::uids::FIRST_ID, i32::MAX as u32 * 2));
        for key in ["accept_ra", "autoconf"] {
            let _ = write_sysctl(&format!("net/ipv6/conf/default/{key}"), "0");
        }
        let mut inside = Netlink::route().map_err(io_err("open rtnetlink in the namespace"))?;
        inside.link_up(1).map_err(io_err("bring lo up"))?;
        {
            let mut rtnl = lock(&self.rtnl);
            rtnl.add_veth(host_if, PEER_NAME, &netns, self.mtu).map_err(io_err("create the veth"))?;
            // if_nametoindex asks the namespace of the calling thread: ask
            // through a socket of the host instead.
        }
        let peer = netlink::link_index(PEER_NAME).map_err(io_err("find eth0"))?;
        let host = host_index(host_if)?;
        let gw4 = self.cfg.gateway4();
        let addr4 = self.cfg.addr4(index);
        {
            let mut rtnl = lock(&self.rtnl);
            rtnl.link_up(host).map_err(io_err("bring the host veth up"))?;
            rtnl.add_addr(host, IpAddr::V4(gw4), 32).map_err(io_err("address the host veth"))?;
            rtnl.add_route(IpAddr::V4(addr4), 32, host, None).map_err(io_err("route to the sandbox"))?;
            if self.ipv6 {
                rtnl.add_addr(host, IpAddr::V6(self.cfg.gateway6()), 64).map_err(io_err("address the host veth"))?;
                rtnl.add_route(IpAddr::V6(self.cfg.addr6(index)), 128, host, None)
                    .map_err(io_err("route to the sandbox"))?;
            }
        }
        inside.add_addr(peer, IpAddr::V4(addr4), 32).map_err(io_err("address eth0"))?;
        inside.link_up(peer).map_err(io_err("bring eth0 up"))?;
        inside.add_route(IpAddr::V4(gw4), 32, peer, None).map_err(io_err("route to the gateway"))?;
        inside
            .add_route(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0, peer, Some(IpAddr::V4(gw4)))
            .map_err(io_err("default route"))?;
        if self.ipv6 {
            inside.add_addr(peer, IpAddr::V6(self.cfg.addr6(index)), 128).map_err(io_err("address eth0"))?;
            inside
                .add_route(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0, peer, Some(IpAddr::V6(self.cfg.gateway6())))
                .map_err(io_err("default route"))?;
        }
        Ok(netns)
    }

    /// Gives sandbox `id` a network with `policy`: the set elements are in
    /// place before this returns, so the sandbox's first packet is judged.
    /// `deny_all` gets no namespace here (the sandbox makes its own, with
    /// only `lo`).
    pub fn attach(&self, id: &str, policy: &Policy) -> Result<Attached, NetError> {
        if policy.egress == Egress::DenyAll {
            lock(&self.state).leases.insert(
                id.to_owned(),
                Lease { slot: None, policy: policy.clone(), elements: Vec::new(), learned: BTreeMap::new() },
            );
            return Ok(Attached { netns: None, addr4: None, addr6: None, host_if: None, index: 0 });
        }
        self.attach_with_interface(id, policy)
    }

    /// Gives sandbox `id` a namespace with an interface whatever its
    /// policy, so that [`Network::update`] can change the policy while it
    /// runs. Under `deny_all` its address is in no set: every packet it
    /// sends through the host is refused, and the resolver answers nothing.
    pub fn attach_with_interface(&self, id: &str, policy: &Policy) -> Result<Attached, NetError> {
        let pooled = {
            let mut st = lock(&self.state);
            st.pool_used = Some(Instant::now());
            match st.released.iter().rposition(|(group, _)| *group == policy.group) {
                Some(at) => st.released.remove(at).map(|(_, slot)| slot),
                None => st.pool.pop_front(),
            }
        };
        let slot = match pooled {
            Some(s) => s,
            None => self.make_slot()?,
        };
        self.lease(id, slot, policy)
    }

    /// Replaces the policy of a running sandbox: its old set elements
    /// leave and the new ones come in one nftables transaction (several,
    /// for more than a batch, ordered so that no step in between allows
    /// more than either policy), and the addresses its resolver admitted
    /// for the old policy are forgotten (an allow list looks names up
    /// again). A sandbox started without an interface (`deny_all` through
    /// [`Network::attach`]) can only stay `deny_all`.
    pub fn update(&self, id: &str, policy: &Policy) -> Result<(), NetError> {
        let mut nft = lock(&self.nft);
        let mut st = lock(&self.state);
        let Some(lease) = st.leases.get(id) else {
            return Err(NetError::Unavailable(format!("sandbox {id} has no network here")));
        };
        let Some(index) = lease.slot.as_ref().map(|s| s.index) else {
            if policy.egress == Egress::DenyAll {
                if let Some(l) = st.leases.get_mut(id) {
                    l.policy = policy.clone();
                }
                return Ok(());
            }
            return Err(NetError::NoInterface(id.to_owned()));
        };
        let new = self.policy_elements_locked(&mut st, index, policy);
        let Some(lease) = st.leases.get_mut(id) else { return Ok(()) };
        let ops = replacement(&lease.elements, &new);
        nft.set_elements(NFPROTO_INET, &self.cfg.table(), &ops).map_err(io_err("replace the sandbox's policy"))?;
        lease.policy = policy.clone();
        lease.elements = new;
        lease.learned.clear();
        Ok(())
    }

    fn lease(&self, id: &str, slot: Slot, policy: &Policy) -> Result<Attached, NetError> {
        let elements = self.policy_elements(slot.index, policy);
        let attached = Attached {
            netns: Some(slot.netns.clone()),
            addr4: Some(self.cfg.addr4(slot.index)),
            addr6: self.ipv6.then(|| self.cfg.addr6(slot.index)),
            host_if: Some(slot.host_if.clone()),
            index: slot.index,
        };
        let mut nft = lock(&self.nft);
        let mut st = lock(&self.state);
        if let Err(e) = nft.set_elements(NFPROTO_INET, &self.cfg.table(), &elements) {
            // Kept for this group only: it may have served it before.
            st.released.push_back((policy.group.clone(), slot));
            return Err(io_err("admit the sandbox to its policy")(e));
        }
        st.leases.insert(
            id.to_owned(),
            Lease { slot: Some(slot), policy: policy.clone(), elements, learned: BTreeMap::new() },
        );
        Ok(attached)
    }

    /// Takes back the network of a sandbox that outlived a previous daemon:
    /// its namespace (through its PID 1), its link and its policy, whatever
    /// the policy (a sandbox without a link, `deny_all` through
    /// [`Network::attach`], is attached again instead, by the caller).
    /// `learned` are the addresses its resolver had admitted; they are
    /// admitted again for the shortest time an answer is kept.
    pub fn adopt(
        &self,
        id: &str,
        pid: libc::pid_t,
        index: u32,
        host_if: &str,
        policy: &Policy,
        learned: &[IpAddr],
    ) -> Result<(), NetError> {
        let netns = open_fd(&format!("/proc/{pid}/ns/net")).map_err(io_err("open the sandbox's namespace"))?;
        {
            let mut st = lock(&self.state);
            if !(st.reserved.remove(&index) || st.used.insert(index)) {
                return Err(NetError::Unavailable(format!("address {index} is taken twice")));
            }
        }
        let slot = Slot { netns: Arc::new(netns), host_if: host_if.to_owned(), index, flushed_at: None };
        self.lease(id, slot, policy)?;
        // What it sent before now was the last daemon's to count.
        if let Some(rx) = Self::rx_bytes(host_if) {
            lock(&self.rx_seen).insert(host_if.to_owned(), rx);
        }
        let again: Vec<(IpAddr, Duration)> = learned.iter().map(|a| (*a, LEARNED_TTL_FLOOR)).collect();
        self.admit(id, &again).map(|_| ())
    }

    /// Ends a sandbox's network: its elements leave the sets, the flows it
    /// had tracked are forgotten (so whoever gets its address next starts
    /// with none of them), and its namespace returns to the pool (or is
    /// dropped beyond it).
    pub fn release(&self, id: &str) {
        let host_if = lock(&self.state).leases.get(id).and_then(|l| Some(l.slot.as_ref()?.host_if.clone()));
        if let Some(bytes) = host_if.as_deref().and_then(|h| self.account(h)) {
            lock(&self.egress_released).push((id.to_owned(), bytes));
        }
        // Read before the flush: a packet counted after it may have made a
        // flow the flush did not see.
        let received = host_if.and_then(|h| Self::link_counter(&h, "rx_packets"));
        let slot = {
            let mut nft = lock(&self.nft);
            let mut st = lock(&self.state);
            let Some(lease) = st.leases.remove(id) else { return };
            let mut removals: Vec<SetOp> =
                lease.elements.into_iter().map(|op| SetOp { kind: SetOpKind::Remove, ..op }).collect();
            removals.dedup();
            if nft.set_elements(NFPROTO_INET, &self.cfg.table(), &removals).is_err() {
                // One missing element fails the whole batch: remove one by one.
                for op in &removals {
                    let _ = nft.set_elements(NFPROTO_INET, &self.cfg.table(), std::slice::from_ref(op));
                }
            }
            let Some(mut slot) = lease.slot else { return };
            if needs_flush(slot.flushed_at, received) {
                #[cfg(test)]
                self.flushes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                slot.flushed_at = match nft.flush_conntrack(self.ct_mark(slot.index)) {
                    Ok(()) => received,
                    Err(e) => {
                        tracing::warn!("sandbox {id}: cannot forget its tracked flows: {e}");
                        None
                    }
                };
            }
            if st.released.len() < POOL_RETAIN && Arc::strong_count(&slot.netns) == 1 {
                st.released.push_back((lease.policy.group, slot));
                st.pool_used = Some(Instant::now());
                return;
            }
            st.used.remove(&slot.index);
            slot
        };
        self.drop_slot(slot);
    }

    /// The bytes link `host_if` received (its sandbox sent), from /sys of
    /// the host. Not over rtnetlink: the kernel answers a veth's
    /// `RTM_GETLINK` with its peer's namespace id, found by a walk over
    /// every namespace id of the host, under the lock every link change
    /// takes; a dump of all links costs the square of the sandboxes alive.
    fn rx_bytes(host_if: &str) -> Option<u64> {
        Self::link_counter(host_if, "rx_bytes")
    }

    /// A counter of `host_if` from /sys/class/net/*/statistics.
    fn link_counter(host_if: &str, name: &str) -> Option<u64> {
        std::fs::read_to_string(format!("/sys/class/net/{host_if}/statistics/{name}")).ok()?.trim().parse().ok()
    }

    /// Hands out the bytes `counter` of `host_if` shows beyond what was
    /// handed out before (all of them if the counter went back).
    fn attribute(&self, host_if: &str, counter: u64) -> u64 {
        let mut seen = lock(&self.rx_seen);
        let before = seen.insert(host_if.to_owned(), counter).unwrap_or(0);
        if counter >= before {
            counter - before
        } else {
            counter
        }
    }

    /// Bytes the sandbox on host link `host_if` sent out since they were
    /// last taken.
    fn account(&self, host_if: &str) -> Option<u64> {
        let rx = Self::rx_bytes(host_if)?;
        Some(self.attribute(host_if, rx))
    }

    /// Egress metering: the bytes each sandbox sent out through its link
    /// (its host link's received bytes) since the last call, released
    /// sandboxes' included; with `live` false, only the released ones'
    /// (cheap: no link is read). Sandboxes without a link send nothing out.
    pub fn take_egress(&self, live: bool) -> Vec<(String, u64)> {
        let mut out = std::mem::take(&mut *lock(&self.egress_released));
        if live {
            let links: Vec<(String, String)> = lock(&self.state)
                .leases
                .iter()
                .filter_map(|(id, l)| Some((id.clone(), l.slot.as_ref()?.host_if.clone())))
                .collect();
            for (id, host_if) in links {
                if let Some(rx) = Self::rx_bytes(&host_if) {
                    out.push((id, self.attribute(&host_if, rx)));
                }
            }
        }
        out.retain(|(_, n)| *n > 0);
        out
    }

    /// The policy of the sandbox at `addr` (for the resolver).
    pub fn policy_of(&self, addr: IpAddr) -> Option<(String, Policy)> {
        let index = match addr {
            IpAddr::V4(a) => u32::from(a).checked_sub(u32::from(self.cfg.subnet4)).filter(|i| *i < 0x10000)?,
            IpAddr::V6(a) => {
                u128::from(a).checked_sub(u128::from(self.cfg.subnet6)).filter(|i| *i < 0x10000).map(|i| i as u32)?
            }
        };
        let st = lock(&self.state);
        st.leases
            .iter()
            .find(|(_, l)| l.slot.as_ref().map(|s| s.index) == Some(index))
            .map(|(id, l)| (id.clone(), l.policy.clone()))
    }

    /// Whether the host still holds this daemon's table. If not (someone
    /// flushed the ruleset), loads it again with every running sandbox's
    /// elements, and answers `Ok(false)`. Until then, the sandboxes'
    /// traffic through the host is not judged: call this often.
    pub fn heal(&self) -> Result<bool, NetError> {
        let gw = self.cfg.gateway4().octets();
        let mut nft = lock(&self.nft);
        if nft.has_element(NFPROTO_INET, &self.cfg.table(), "loaded", &gw).unwrap_or(false) {
            return Ok(true);
        }
        load_ruleset(&mut nft, &self.cfg, &lock(&self.host))?;
        let st = lock(&self.state);
        let elements: Vec<SetOp> = st.leases.values().flat_map(|l| l.elements.clone()).collect();
        nft.set_elements(NFPROTO_INET, &self.cfg.table(), &elements)
            .map_err(io_err("restore the sandboxes' policies"))?;
        Ok(false)
    }

    /// Every address admitted for sandbox `id` and not yet expired.
    pub fn learned(&self, id: &str) -> Vec<IpAddr> {
        lock(&self.state).leases.get(id).map(|l| l.learned.keys().copied().collect()).unwrap_or_default()
    }

    /// Admits addresses the resolver handed out to sandbox `id` (allow-list
    /// mode), each for its answer's TTL within [LEARNED_TTL_FLOOR,
    /// LEARNED_TTL_CAP]; an address admitted again lives on to the later
    /// expiry. At MAX_LEARNED, the addresses closest to expiry make room.
    /// Answers the number of addresses new to the sandbox.
    pub fn admit(&self, id: &str, addrs: &[(IpAddr, Duration)]) -> Result<usize, NetError> {
        self.admit_at(id, addrs, Instant::now())
    }

    fn admit_at(&self, id: &str, addrs: &[(IpAddr, Duration)], now: Instant) -> Result<usize, NetError> {
        let mut nft = lock(&self.nft);
        let mut st = lock(&self.state);
        let Some(lease) = st.leases.get_mut(id) else { return Ok(0) };
        let Some(index) = lease.slot.as_ref().map(|s| s.index) else { return Ok(0) };
        if !lease.policy.listed() {
            return Ok(0);
        }
        let before = lease.learned.clone();
        let mut ops = Vec::new();
        let mut added = Vec::new();
        for (addr, ttl) in addrs {
            let until = now + (*ttl).clamp(LEARNED_TTL_FLOOR, LEARNED_TTL_CAP);
            if let Some(t) = lease.learned.get_mut(addr) {
                *t = (*t).max(until);
                continue;
            }
            let Some(op) = self.pair_op("allow", index, *addr, if addr.is_ipv4() { 32 } else { 128 }) else {
                continue;
            };
            if lease.learned.len() >= MAX_LEARNED {
                let Some((&oldest, _)) = lease.learned.iter().min_by_key(|(_, t)| **t) else { continue };
                lease.learned.remove(&oldest);
                if let Some(old) = self.pair_op("allow", index, oldest, if oldest.is_ipv4() { 32 } else { 128 }) {
                    lease.elements.retain(|e| *e != old);
                    ops.push(SetOp { kind: SetOpKind::Remove, ..old });
                }
            }
            lease.learned.insert(*addr, until);
            lease.elements.push(op.clone());
            added.push(op.clone());
            ops.push(op);
        }
        #[cfg(test)]
        self.admit_pause.run();
        if let Err(e) = nft.set_elements(NFPROTO_INET, &self.cfg.table(), &ops) {
            // Nothing of the batch applied: the lease goes back to what the
            // kernel holds.
            lease.learned = before;
            lease.elements.retain(|el| !added.contains(el));
            return Err(io_err("admit resolved addresses")(e));
        }
        Ok(added.len())
    }

    /// Removes the admitted addresses whose time is over at `now`; answers
    /// the sandboxes that lost some.
    pub fn expire(&self, now: Instant) -> Vec<String> {
        let mut nft = lock(&self.nft);
        let mut st = lock(&self.state);
        let mut changed = Vec::new();
        for (id, lease) in st.leases.iter_mut() {
            let Some(index) = lease.slot.as_ref().map(|s| s.index) else { continue };
            let gone: Vec<IpAddr> = lease.learned.iter().filter(|(_, t)| **t <= now).map(|(a, _)| *a).collect();
            if gone.is_empty() {
                continue;
            }
            let mut removals = Vec::new();
            for addr in &gone {
                lease.learned.remove(addr);
                if let Some(op) = self.pair_op("allow", index, *addr, if addr.is_ipv4() { 32 } else { 128 }) {
                    lease.elements.retain(|e| *e != op);
                    removals.push(SetOp { kind: SetOpKind::Remove, ..op });
                }
            }
            if nft.set_elements(NFPROTO_INET, &self.cfg.table(), &removals).is_err() {
                for op in &removals {
                    let _ = nft.set_elements(NFPROTO_INET, &self.cfg.table(), std::slice::from_ref(op));
                }
            }
            changed.push(id.clone());
        }
        changed
    }

    /// What the host shows for sandbox `id`: the policy whose elements are
    /// loaded for it, or, for `deny_all`, that its namespace (through its
    /// PID 1) holds only `lo`. `None` when what is seen does not match.
    pub fn observe(&self, id: &str, pid: libc::pid_t) -> Option<Egress> {
        let (policy, index) = {
            let st = lock(&self.state);
            let l = st.leases.get(id)?;
            (l.policy.clone(), l.slot.as_ref().map(|s| s.index))
        };
        let links = links_of(pid).ok()?;
        match (policy.egress, index) {
            (Egress::DenyAll, None) => (links == ["lo"]).then_some(Egress::DenyAll),
            // An interface kept for updates: its address is in no set.
            (Egress::DenyAll, Some(index)) => {
                let key = self.cfg.addr4(index).octets().to_vec();
                let mut nft = lock(&self.nft);
                for set in ["default4", "listed4", "private4"] {
                    if nft.has_element(NFPROTO_INET, &self.cfg.table(), set, &key).ok()? {
                        return None;
                    }
                }
                Some(Egress::DenyAll)
            }
            (egress, Some(index)) => {
                if !links.iter().any(|l| l == PEER_NAME) {
                    return None;
                }
                let key = self.cfg.addr4(index).octets().to_vec();
                let set = match (egress, policy.listed()) {
                    (Egress::Private, _) => "private4",
                    (_, true) => "listed4",
                    _ => "default4",
                };
                lock(&self.nft).has_element(NFPROTO_INET, &self.cfg.table(), set, &key).ok()?.then_some(egress)
            }
            (_, None) => None,
        }
    }

    /// The conntrack mark of the flows of the sandbox at address `index`:
    /// unique on the host (instance and index), so one daemon's flush never
    /// touches another's flows.
    fn ct_mark(&self, index: u32) -> u32 {
        0x4800_0000 | (self.cfg.instance as u32) << 16 | (index & 0xffff)
    }

    fn group_mark(st: &mut State, group: &str) -> u32 {
        let next = 0x4855_0000 + st.groups.len() as u32 + 1;
        *st.groups.entry(group.to_owned()).or_insert(next)
    }

    fn pair_op(&self, set: &str, index: u32, dst: IpAddr, len: u8) -> Option<SetOp> {
        let (lo, hi) = range(dst, len);
        let (suffix, src) = match dst {
            IpAddr::V4(_) => ("4", self.cfg.addr4(index).octets().to_vec()),
            IpAddr::V6(_) if self.ipv6 => ("6", self.cfg.addr6(index).octets().to_vec()),
            IpAddr::V6(_) => return None,
        };
        Some(SetOp {
            set: format!("{set}{suffix}"),
            key: [src.clone(), lo].concat(),
            key_end: Some([src, hi].concat()),
            ..SetOp::default()
        })
    }

    fn policy_elements(&self, index: u32, p: &Policy) -> Vec<SetOp> {
        self.policy_elements_locked(&mut lock(&self.state), index, p)
    }

    /// [`Network::policy_elements`] with the state lock held.
    fn policy_elements_locked(&self, st: &mut State, index: u32, p: &Policy) -> Vec<SetOp> {
        let a4 = self.cfg.addr4(index).octets().to_vec();
        let a6 = self.ipv6.then(|| self.cfg.addr6(index).octets().to_vec());
        let mut addrs = vec![("4", a4)];
        if let Some(a6) = a6 {
            addrs.push(("6", a6));
        }
        let mut ops = Vec::new();
        let add = |set: String, key: Vec<u8>, data: Option<Vec<u8>>| SetOp { set, key, data, ..SetOp::default() };
        for rule in &p.deny {
            if let Rule::Cidr(a, l) = rule {
                ops.extend(self.pair_op("deny", index, *a, *l));
                // The IPv6 forms that embed an IPv4 range are denied with it.
                if let IpAddr::V4(v4) = a {
                    for (a6, l6) in embedded_forms(*v4, *l) {
                        ops.extend(self.pair_op("deny", index, IpAddr::V6(a6), l6));
                    }
                }
            }
        }
        if p.egress != Egress::DenyAll {
            let mark = self.ct_mark(index).to_ne_bytes().to_vec();
            for (v, a) in &addrs {
                ops.push(add(format!("ctmark{v}"), a.clone(), Some(mark.clone())));
            }
        }
        match p.egress {
            Egress::DenyAll => {}
            Egress::Private => {
                let mark = Self::group_mark(st, &p.group).to_ne_bytes().to_vec();
                for (v, a) in &addrs {
                    ops.push(add(format!("private{v}"), a.clone(), None));
                    ops.push(add(format!("group{v}"), a.clone(), Some(mark.clone())));
                    ops.push(add(format!("member{v}"), [a.clone(), mark.clone()].concat(), None));
                }
            }
            Egress::Default if p.listed() => {
                for rule in &p.allow {
                    if let Rule::Cidr(a, l) = rule {
                        ops.extend(self.pair_op("allow", index, *a, *l));
                    }
                }
                for (v, a) in &addrs {
                    ops.push(add(format!("listed{v}"), a.clone(), None));
                }
            }
            Egress::Default => {
                for (v, a) in &addrs {
                    ops.push(add(format!("default{v}"), a.clone(), None));
                }
            }
        }
        if p.inject && p.egress == Egress::Default {
            for (v, a) in &addrs {
                ops.push(add(format!("inject{v}"), a.clone(), None));
            }
        }
        ops
    }
}

/// The set operations that turn a sandbox's elements `old` into `new`,
/// leaving alone what both hold, ordered so that every prefix of the list
/// (a cut between two transactions) allows no more than `old` or `new`
/// would: new denials first, then old allowances and memberships leave,
/// then new ones come (allowances before memberships), and old denials
/// leave last.
fn replacement(old: &[SetOp], new: &[SetOp]) -> Vec<SetOp> {
    let is_deny = |op: &SetOp| op.set.starts_with("deny");
    let is_membership = |op: &SetOp| {
        ["default", "listed", "private"].iter().any(|m| op.set.strip_prefix(m).is_some_and(|v| v == "4" || v == "6"))
    };
    let gone: Vec<&SetOp> = old.iter().filter(|op| !new.contains(op)).collect();
    let added: Vec<&SetOp> = new.iter().filter(|op| !old.contains(op)).collect();
    let remove = |op: &&SetOp| SetOp { kind: SetOpKind::Remove, ..(*op).clone() };
    let add = |op: &&SetOp| SetOp { kind: SetOpKind::Add, ..(*op).clone() };
    let mut ops: Vec<SetOp> = added.iter().filter(|op| is_deny(op)).map(add).collect();
    ops.extend(gone.iter().filter(|op| !is_deny(op)).map(remove));
    ops.extend(added.iter().filter(|op| !is_deny(op) && !is_membership(op)).map(add));
    ops.extend(added.iter().filter(|op| is_membership(op)).map(add));
    ops.extend(gone.iter().filter(|op| is_deny(op)).map(remove));
    ops.dedup();
    ops
}

/// The IPv6 ranges that carry the IPv4 range `addr/len` inside them: its
/// NAT64 form (64:ff9b::/96, RFC 6052), its IPv4-mapped form
/// (::ffff:0:0/96) and its 6to4 form (2002::/16, RFC 3056). Every one of
/// these prefixes is also special (never reachable); a deny list names
/// them anyway, so a deny of an IPv4 range holds whatever the special sets
/// say.
pub fn embedded_forms(addr: Ipv4Addr, len: u8) -> Vec<(Ipv6Addr, u8)> {
    let v4 = u32::from(addr) as u128;
    let len = len.min(32);
    let nat64 = (0x0064_ff9b_u128 << 96) | v4;
    let mapped = (0xffff_u128 << 32) | v4;
    let six_to_four = (0x2002_u128 << 112) | (v4 << 80);
    vec![(Ipv6Addr::from(nat64), 96 + len), (Ipv6Addr::from(mapped), 96 + len), (Ipv6Addr::from(six_to_four), 16 + len)]
}

/// First and last address of `addr/len`, in network order.
fn range(addr: IpAddr, len: u8) -> (Vec<u8>, Vec<u8>) {
    match addr {
        IpAddr::V4(a) => {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len as u32) };
            let lo = u32::from(a) & mask;
            (lo.to_be_bytes().to_vec(), (lo | !mask).to_be_bytes().to_vec())
        }
        IpAddr::V6(a) => {
            let mask = if len == 0 { 0 } else { u128::MAX << (128 - len as u32) };
            let lo = u128::from(a) & mask;
            (lo.to_be_bytes().to_vec(), (lo | !mask).to_be_bytes().to_vec())
        }
    }
}

/// Flows one sandbox may have tracked at once (conntrack entries, and so
/// NAT mappings toward any one destination).
pub const MAX_FLOWS: u32 = 4096;
/// New flows a sandbox may open.
pub const NEW_FLOWS: nftables::Rate = nftables::Rate { per_second: 1000, burst: 2000 };
/// Queries a sandbox may send the resolver.
pub const DNS_RATE: nftables::Rate = nftables::Rate { per_second: 200, burst: 400 };

/// `prefix/len` with the host bits cleared, as nftables writes it.
fn cidr(addr: IpAddr, len: u8) -> String {
    let (lo, _) = range(addr, len);
    let net: IpAddr = match addr {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::new(lo[0], lo[1], lo[2], lo[3])),
        IpAddr::V6(_) => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&lo);
            IpAddr::V6(Ipv6Addr::from(o))
        }
    };
    format!("{net}/{len}")
}

/// The nftables elements of the host's networks of one family: each
/// network and each address.
fn host_elements(host: &[(IpAddr, u8)], v4: bool) -> Vec<String> {
    let mut out: Vec<String> =
        host.iter().filter(|(a, _)| a.is_ipv4() == v4).flat_map(|(a, l)| [cidr(*a, *l), a.to_string()]).collect();
    out.sort();
    out.dedup();
    out
}

/// The ruleset with this host's values in place.
pub fn ruleset(cfg: &NetConfig, host: &[(IpAddr, u8)]) -> String {
    ruleset_text(&ruleset_values(cfg, host))
}

/// policy/network.nft with `v`'s values in place: the text `nft -f` takes
/// for the same table that `nftables::ruleset(v)` describes.
pub fn ruleset_text(v: &nftables::Values) -> String {
    let elements = |v4: bool| {
        let list = host_elements(&v.host, v4);
        if list.is_empty() {
            String::new()
        } else {
            format!("elements = {{ {} }}", list.join(", "))
        }
    };
    RULESET
        .replace("@SUBNET4@", &format!("{}/{}", v.subnet4.0, v.subnet4.1))
        .replace("@SUBNET6@", &format!("{}/{}", v.subnet6.0, v.subnet6.1))
        .replace("@HOST4@", &elements(true))
        .replace("@HOST6@", &elements(false))
        .replace("@GATEWAY4@", &v.gateway4.to_string())
        .replace("@EGRESS_PORT@", &v.egress_port.to_string())
        .replace("@TABLE@", &v.table)
        .replace("@PREFIX@", &v.prefix)
        .replace("@MAX_FLOWS@", &v.max_flows.to_string())
        .replace("@NEW_FLOWS@", &v.new_flows.to_string())
        .replace("@DNS_RATE@", &v.dns_rate.to_string())
}

/// The same ruleset as data, for loading over netlink.
pub fn ruleset_values(cfg: &NetConfig, host: &[(IpAddr, u8)]) -> nftables::Values {
    nftables::Values {
        table: cfg.table(),
        prefix: cfg.host_prefix(),
        subnet4: (IpAddr::V4(cfg.subnet4), 16),
        subnet6: (IpAddr::V6(cfg.subnet6), 64),
        gateway4: cfg.gateway4(),
        host: host.to_vec(),
        max_flows: MAX_FLOWS,
        new_flows: NEW_FLOWS,
        dns_rate: DNS_RATE,
        egress_port: cfg.egress_port,
    }
}

/// Loads the ruleset over nfnetlink, once per daemon start (never per
/// sandbox), replacing the table in one transaction.
fn load_ruleset(nl: &mut Netlink, cfg: &NetConfig, host: &[(IpAddr, u8)]) -> Result<(), NetError> {
    let rs = nftables::ruleset(&ruleset_values(cfg, host));
    nftables::load(nl, &rs).map_err(|e| NetError::Unavailable(format!("nf_tables refused the ruleset: {e}")))
}

impl Network {
    /// Removes what `setup` put on the host: the table, the gateway link,
    /// the pooled namespaces and their links. Only for a daemon that ends
    /// with no sandbox running (their networks would go with it).
    pub fn teardown(&self) {
        let pool: Vec<Slot> = {
            let mut st = lock(&self.state);
            let released = std::mem::take(&mut st.released).into_iter().map(|(_, slot)| slot);
            std::mem::take(&mut st.pool).into_iter().chain(released).collect()
        };
        let started = Instant::now();
        // Past the budget (thousands pooled), the rest of the namespaces
        // are only closed: the kernel deletes each veth pair as it frees
        // its namespace.
        for slot in pool.into_iter().take_while(|_| started.elapsed() < TEARDOWN_BUDGET) {
            self.drop_slot(slot);
        }
        let _ = nftables::delete_table(&mut lock(&self.nft), &self.cfg.table());
    }
}

/// The host's own addresses and the networks it is directly on, read over
/// rtnetlink: every address of a link but loopback and hutch's veths (with
/// the network of its prefix), and every on-link route of the main table
/// (no gateway: a VPN's or a bridge's network). Routes through a gateway
/// lead elsewhere and are not the host's networks.
///
/// Link names come from `if_indextoname`, not from a dump of every link:
/// the kernel fills each veth of a dump with its peer's namespace id by
/// walking every namespace id, so a dump costs the square of the
/// sandboxes alive, under the lock every sandbox's link change takes.
pub fn host_networks(rtnl: &mut Netlink) -> io::Result<Vec<(IpAddr, u8)>> {
    let (addrs, routes) = (rtnl.addresses()?, rtnl.routes()?);
    let indices: BTreeSet<u32> = addrs.iter().map(|a| a.index).chain(routes.iter().filter_map(|r| r.oif)).collect();
    let links: HashMap<u32, String> = indices.into_iter().filter_map(|i| Some((i, link_name(i)?))).collect();
    Ok(host_networks_from(&addrs, &routes, &links))
}

/// The name of host link `index`, if it exists (`if_indextoname`).
fn link_name(index: u32) -> Option<String> {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: if_indextoname writes at most IF_NAMESIZE bytes into name.
    let p = unsafe { libc::if_indextoname(index, name.as_mut_ptr()) };
    // SAFETY: on success, name holds a NUL-terminated string.
    (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
}

/// Pure part of `host_networks`, sorted and without duplicates.
pub fn host_networks_from(
    addrs: &[netlink::AddrMsg],
    routes: &[netlink::RouteMsg],
    links: &HashMap<u32, String>,
) -> Vec<(IpAddr, u8)> {
    let foreign = |index: u32| links.get(&index).is_some_and(|n| n != "lo" && !is_hutch_link(n));
    let mut out: Vec<(IpAddr, u8)> = addrs.iter().filter(|a| foreign(a.index)).map(|a| (a.addr, a.prefix)).collect();
    for r in routes {
        if r.table == netlink::RT_TABLE_MAIN as u32
            && r.kind == netlink::RTN_UNICAST
            && !r.via_gateway
            && r.dst_len > 0
            && r.oif.is_some_and(foreign)
        {
            let (lo, _) = range(r.dst, r.dst_len);
            let dst = match r.dst {
                IpAddr::V4(_) => IpAddr::from(<[u8; 4]>::try_from(lo.as_slice()).unwrap_or([0; 4])),
                IpAddr::V6(_) => IpAddr::from(<[u8; 16]>::try_from(lo.as_slice()).unwrap_or([0; 16])),
            };
            out.push((dst, r.dst_len));
        }
    }
    out.sort();
    out.dedup();
    out
}

impl Network {
    /// Reads the host's networks again and, when they changed, replaces
    /// the `host4`/`host6` elements in one transaction. Answers whether
    /// they changed.
    pub fn refresh_host(&self, rtnl: &mut Netlink) -> Result<bool, NetError> {
        let now = host_networks(rtnl).map_err(io_err("read the host's networks"))?;
        let mut nft = lock(&self.nft);
        let mut host = lock(&self.host);
        if *host == now {
            return Ok(false);
        }
        let sets = [
            ("host4", nftables::interval_elements(&nftables::host_nets(&now), true)),
            ("host6", nftables::interval_elements(&nftables::host_nets(&now), false)),
        ];
        nftables::replace_ranges(&mut nft, &self.cfg.table(), &sets).map_err(io_err("replace the host's networks"))?;
        *host = now;
        Ok(true)
    }

    /// Follows the host's address and route changes (rtnetlink
    /// notifications) on a thread of its own, for the daemon's life: a
    /// network that appears later (a router advertisement, DHCP, a VPN, a
    /// new bridge) is special as soon as the host is on it. It also reads
    /// everything again when notifications were lost (the socket says so:
    /// ENOBUFS) and every [`HOST_REREAD`], to be sure.
    pub fn follow_host(self: &Arc<Self>, on_change: impl Fn(Result<(), NetError>) + Send + 'static) -> io::Result<()> {
        use netlink::{RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE};
        let groups = RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE;
        let events = Netlink::subscribe(groups, HOST_REREAD)?;
        let mut rtnl = Netlink::route()?;
        let net = Arc::downgrade(self);
        std::thread::Builder::new().name("hutch-net-host".into()).spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            // The state may have changed between setup and subscribing.
            let mut dirty = true;
            loop {
                let Some(net) = net.upgrade() else { return };
                if dirty {
                    match net.refresh_host(&mut rtnl) {
                        Ok(true) => on_change(Ok(())),
                        Ok(false) => {}
                        Err(e) => on_change(Err(e)),
                    }
                }
                drop(net);
                dirty = match events.recv_notifications(&mut buf) {
                    Ok(n) => notifications_matter(&buf[..n]),
                    // Timeout: read everything again, to be sure.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
                    // ENOBUFS and the like: notifications were lost.
                    Err(_) => true,
                };
            }
        })?;
        Ok(())
    }
}

/// How often the host's networks are read again with no notification
/// asking for it. Not often: a read dumps every address and route of the
/// host, and each sandbox adds its veth's (with 2,000 alive, a read every
/// 5 s was a tenth of what the idle daemon spent); a notification lost to
/// an overflow is reported by the socket and read again at once.
const HOST_REREAD: Duration = Duration::from_secs(60);

/// Whether a datagram of rtnetlink notifications may change the host's
/// networks: anything but the addresses and routes of hutch's own veths
/// (which change with every sandbox network made and ended) and of links
/// already gone. A link that is gone took its networks with it: until the
/// next full read (within [`HOST_REREAD`]) they stay special, which only keeps
/// sandboxes away from them a little longer. Reading everything again for
/// each of those would make every sandbox's end cost as much as the
/// sandboxes alive.
fn notifications_matter(buf: &[u8]) -> bool {
    use netlink::{RTM_DELADDR, RTM_DELROUTE, RTM_NEWADDR, RTM_NEWROUTE};
    for msg in netlink::messages(buf) {
        let Ok(msg) = msg else { return true };
        let index = match msg.ty {
            RTM_NEWADDR | RTM_DELADDR => netlink::parse_addr(msg.payload).map(|a| a.index),
            RTM_NEWROUTE | RTM_DELROUTE => netlink::parse_route(msg.payload).map(|r| r.oif.unwrap_or(0)),
            _ => continue,
        };
        match index.filter(|i| *i != 0).map(link_name) {
            Some(None) => continue,
            Some(Some(name)) if is_hutch_link(&name) => continue,
            _ => return true,
        }
    }
    false
}

/// Host ends of veths of any hutch network.
fn is_hutch_link(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() == 12 && b[0] == b'h' && b[3] == b's'
}

/// A UDP socket bound to `addr` even while no link holds the address yet:
/// the gateway address lives on the host end of each veth, and the
/// resolver listens before the first one exists.
pub fn bind_udp_freebind(addr: std::net::SocketAddrV4) -> io::Result<std::net::UdpSocket> {
    bind_freebind(addr, libc::SOCK_DGRAM).map(std::net::UdpSocket::from)
}

/// A TCP listener on `addr` even while no link holds the address yet (the
/// egress proxy on the gateway address starts before the first veth).
pub fn listen_tcp_freebind(addr: std::net::SocketAddrV4) -> io::Result<std::net::TcpListener> {
    let fd = bind_freebind(addr, libc::SOCK_STREAM)?;
    // SAFETY: listen(2) on a bound socket we own.
    if unsafe { libc::listen(fd.as_raw_fd(), 1024) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::net::TcpListener::from(fd))
}

/// A nonblocking socket of `kind` with IP_FREEBIND, bound to `addr`.
fn bind_freebind(addr: std::net::SocketAddrV4, kind: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, kind | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // A listener also rebinds past connections of a previous daemon that
    // linger in TIME_WAIT, as std's and tokio's listeners do.
    let mut opts = vec![(libc::SOL_IP, libc::IP_FREEBIND)];
    if kind == libc::SOCK_STREAM {
        opts.push((libc::SOL_SOCKET, libc::SO_REUSEADDR));
    }
    for (level, opt) in opts {
        // SAFETY: setsockopt reads a live c_int of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                opt,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*addr.ip()).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: bind reads a sockaddr_in of the size given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Asks for a receive buffer of `bytes` (past `rmem_max`, as root);
/// best effort: a smaller buffer only drops bursts sooner.
pub fn set_recv_buffer(sock: &std::net::UdpSocket, bytes: usize) {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt reads a live c_int of the size given.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            return;
        }
    }
}

/// The smallest MTU of the host's up, non-loopback links (at most 1500):
/// a veth larger than the uplink would need fragmentation on the way out.
fn uplink_mtu() -> u32 {
    let mut mtu = 1500u32;
    if let Ok(dir) = std::fs::read_dir("/sys/class/net") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "lo" || is_hutch_link(&name) {
                continue;
            }
            let up = std::fs::read_to_string(e.path().join("operstate")).map(|s| s.trim() == "up").unwrap_or(false);
            let m = std::fs::read_to_string(e.path().join("mtu")).ok().and_then(|s| s.trim().parse::<u32>().ok());
            if let (true, Some(m)) = (up, m) {
                mtu = mtu.min(m.max(1280));
            }
        }
    }
    mtu
}

/// The names of the links in the network namespace of `pid`.
fn links_of(pid: libc::pid_t) -> io::Result<Vec<String>> {
    let ns = open_fd(&format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns moves only this short-lived thread.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Netlink::route()?.link_names()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("thread panicked")))
    })
}

/// if_nametoindex of a host link, from any thread (threads that built a
/// slot are in another namespace): through /sys of the host.
fn host_index(name: &str) -> Result<u32, NetError> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| NetError::Unavailable(format!("host link {name} is missing")))
}

/// Whether a released address's flows must be flushed: unless its link
/// received nothing since the last flush (an unreadable count, or none
/// yet, flushes).
fn needs_flush(flushed_at: Option<u64>, received: Option<u64>) -> bool {
    received.is_none() || flushed_at != received
}

fn write_sysctl(key: &str, value: &str) -> Result<(), NetError> {
    let path = format!("/proc/sys/{key}");
    std::fs::write(&path, value).map_err(io_err(format!("write {path}")))
}

fn open_fd(path: &str) -> io::Result<OwnedFd> {
    crate::sys::open(path, libc::O_RDONLY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The egress proxy listens on the gateway address before any veth
    /// holds it: a plain bind there fails, ours does not, and both kinds
    /// report the address they took.
    #[test]
    fn freebind_sockets_bind_an_address_no_link_holds() {
        // TEST-NET-2: on no link of any host.
        let addr = std::net::SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 1), 0);
        assert!(std::net::TcpListener::bind(addr).is_err(), "198.51.100.1 is on a link of this host");
        let tcp = listen_tcp_freebind(addr).expect("tcp");
        let udp = bind_udp_freebind(addr).expect("udp");
        for local in [tcp.local_addr().expect("tcp addr"), udp.local_addr().expect("udp addr")] {
            assert_eq!(local.ip(), std::net::IpAddr::V4(*addr.ip()));
            assert_ne!(local.port(), 0);
        }
    }

    /// A network instance no other test or daemon on this host holds: the
    /// same per-instance lock files as tests/net_instances.py, then the
    /// daemon's own instance lock.
    fn claim_instance() -> (std::fs::File, InstanceLock) {
        std::fs::create_dir_all("/run/hutch-tests").expect("lock dir");
        for n in 1..MAX_INSTANCES {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(format!("/run/hutch-tests/net-{n}.lock"))
                .expect("lock file");
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            if let Ok(held) = InstanceLock::acquire(n) {
                return (f, held);
            }
        }
        panic!("every network instance is held");
    }

    /// A real network of a free instance, torn down when dropped.
    struct TestNet {
        net: Arc<Network>,
        _lock: std::fs::File,
        _held: InstanceLock,
        _dir: PathBuf,
    }

    impl TestNet {
        fn new() -> TestNet {
            let (lock, held) = claim_instance();
            let n = held.instance();
            let dir = std::env::temp_dir().join(format!("hutch-net-test-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("run dir");
            let mut cfg = NetConfig::new(&dir, n);
            cfg.ipv6 = Some(false);
            let net = Network::setup(cfg, &BTreeMap::new(), &held).expect("network setup (run the tests as root)");
            TestNet { net: Arc::new(net), _lock: lock, _held: held, _dir: dir }
        }
    }

    impl Drop for TestNet {
        fn drop(&mut self) {
            self.net.teardown();
            let _ = std::fs::remove_dir_all(&self._dir);
        }
    }

    fn listed() -> Policy {
        Policy {
            egress: Egress::Default,
            allow: vec![Rule::parse("allowed.test").expect("rule")],
            deny: vec![],
            group: String::new(),
            inject: false,
        }
    }

    fn allowed(net: &Network, index: u32, dst: IpAddr) -> bool {
        let op = net.pair_op("allow", index, dst, 32).expect("op");
        lock(&net.nft).has_element(NFPROTO_INET, &net.cfg.table(), &op.set, &op.key).expect("read set")
    }

    #[test]
    fn admitted_addresses_expire_within_their_bounds() {
        let t = TestNet::new();
        let net = &t.net;
        let a = net.attach("sb-ttl", &listed()).expect("attach");
        let (short, long): (IpAddr, IpAddr) = ("203.0.113.6".parse().expect("ip"), "203.0.113.7".parse().expect("ip"));
        let now = Instant::now();
        // A TTL of 0 is kept for the floor; a year only for the cap.
        net.admit_at("sb-ttl", &[(short, Duration::ZERO), (long, Duration::from_secs(365 * 86400))], now)
            .expect("admit");
        assert!(allowed(net, a.index, short) && allowed(net, a.index, long));
        assert!(net.expire(now + LEARNED_TTL_FLOOR - Duration::from_secs(1)).is_empty());
        assert!(allowed(net, a.index, short), "kept for the floor");
        assert_eq!(net.expire(now + LEARNED_TTL_FLOOR), vec!["sb-ttl".to_owned()]);
        assert!(!allowed(net, a.index, short), "gone after the floor");
        assert!(allowed(net, a.index, long));
        assert_eq!(net.learned("sb-ttl"), vec![long]);
        assert_eq!(net.expire(now + LEARNED_TTL_CAP), vec!["sb-ttl".to_owned()]);
        assert!(!allowed(net, a.index, long), "gone at the cap");
        // Looked up again, an address lives on to the later expiry.
        net.admit_at("sb-ttl", &[(short, Duration::ZERO)], now).expect("admit");
        net.admit_at("sb-ttl", &[(short, Duration::from_secs(3600))], now).expect("admit again");
        assert!(net.expire(now + LEARNED_TTL_FLOOR).is_empty());
        assert!(allowed(net, a.index, short));
        net.release("sb-ttl");
        assert!(!allowed(net, a.index, short));
    }

    #[test]
    fn a_sandbox_holds_at_most_max_learned_addresses() {
        let t = TestNet::new();
        let net = &t.net;
        let a = net.attach("sb-cap", &listed()).expect("attach");
        let now = Instant::now();
        let addr = |i: usize| IpAddr::V4(Ipv4Addr::from(0xcb00_0000 + i as u32));
        // Each expires a second after the one before.
        let many: Vec<(IpAddr, Duration)> =
            (0..MAX_LEARNED).map(|i| (addr(i), LEARNED_TTL_FLOOR + Duration::from_secs(i as u64))).collect();
        assert_eq!(net.admit_at("sb-cap", &many, now).expect("admit"), MAX_LEARNED);
        let one_more = addr(MAX_LEARNED);
        assert_eq!(net.admit_at("sb-cap", &[(one_more, LEARNED_TTL_CAP)], now).expect("admit"), 1);
        assert_eq!(net.learned("sb-cap").len(), MAX_LEARNED);
        assert!(!allowed(net, a.index, addr(0)), "the address closest to expiry made room");
        assert!(allowed(net, a.index, addr(1)) && allowed(net, a.index, one_more));
        net.release("sb-cap");
    }

    fn member(net: &Network, set: &str, index: u32) -> bool {
        let key = net.cfg.addr4(index).octets().to_vec();
        lock(&net.nft).has_element(NFPROTO_INET, &net.cfg.table(), set, &key).expect("read set")
    }

    fn denied(net: &Network, index: u32, dst: IpAddr) -> bool {
        let op = net.pair_op("deny", index, dst, 32).expect("op");
        lock(&net.nft).has_element(NFPROTO_INET, &net.cfg.table(), &op.set, &op.key).expect("read set")
    }

    fn policy(egress: Egress, allow: &[&str], deny: &[&str]) -> Policy {
        Policy {
            egress,
            allow: allow.iter().map(|s| Rule::parse(s).expect("rule")).collect(),
            deny: deny.iter().map(|s| Rule::parse(s).expect("rule")).collect(),
            group: String::new(),
            inject: false,
        }
    }

    #[test]
    fn an_update_replaces_a_running_sandboxs_elements() {
        let t = TestNet::new();
        let net = &t.net;
        let a = net.attach("sb-upd", &policy(Egress::Default, &[], &["198.51.100.0/24"])).expect("attach");
        let (listed_dst, learned, denied_dst): (IpAddr, IpAddr, IpAddr) = (
            "203.0.113.9".parse().expect("ip"),
            "203.0.113.10".parse().expect("ip"),
            "198.51.100.7".parse().expect("ip"),
        );
        assert!(member(net, "default4", a.index) && denied(net, a.index, denied_dst));
        // To an allow list: the old membership and denial leave, the new ones come.
        net.update("sb-upd", &policy(Egress::Default, &["203.0.113.9", "allowed.test"], &[])).expect("to a list");
        assert!(!member(net, "default4", a.index) && member(net, "listed4", a.index));
        assert!(allowed(net, a.index, listed_dst) && !denied(net, a.index, denied_dst));
        // Addresses the resolver admitted for the old list are forgotten.
        net.admit("sb-upd", &[(learned, Duration::from_secs(60))]).expect("admit");
        // Many of them, so that the replacement takes several transactions.
        let many: Vec<(IpAddr, Duration)> =
            (0..600u32).map(|i| (IpAddr::V4(Ipv4Addr::from(0xcb00_7100 + i)), Duration::from_secs(60))).collect();
        net.admit("sb-upd", &many).expect("admit many");
        net.update("sb-upd", &policy(Egress::Default, &["203.0.113.9"], &[])).expect("a shorter list");
        assert!(allowed(net, a.index, listed_dst) && !allowed(net, a.index, learned));
        assert!(!allowed(net, a.index, many[599].0) && net.learned("sb-upd").is_empty());
        // Closed: in no set at all, but the interface stays for the next update.
        net.update("sb-upd", &policy(Egress::DenyAll, &[], &[])).expect("to deny_all");
        for set in ["default4", "listed4", "private4"] {
            assert!(!member(net, set, a.index), "{set}");
        }
        assert!(!allowed(net, a.index, listed_dst));
        net.update("sb-upd", &policy(Egress::Default, &[], &[])).expect("open again");
        assert!(member(net, "default4", a.index));
        net.release("sb-upd");
        assert!(!member(net, "default4", a.index));
        // Without an interface, deny_all stays deny_all.
        net.attach("sb-lo", &policy(Egress::DenyAll, &[], &[])).expect("attach deny_all");
        assert!(matches!(net.update("sb-lo", &policy(Egress::Default, &[], &[])), Err(NetError::NoInterface(_))));
        net.update("sb-lo", &policy(Egress::DenyAll, &[], &[])).expect("still deny_all");
        assert!(matches!(net.update("sb-none", &policy(Egress::Default, &[], &[])), Err(NetError::Unavailable(_))));
        net.release("sb-lo");
    }

    #[test]
    fn an_interface_kept_under_deny_all_is_in_no_set() {
        let t = TestNet::new();
        let net = &t.net;
        let a = net.attach_with_interface("sb-closed", &policy(Egress::DenyAll, &[], &[])).expect("attach");
        assert!(a.netns.is_some() && a.addr4.is_some());
        for set in ["default4", "listed4", "private4"] {
            assert!(!member(net, set, a.index), "{set}");
        }
        net.update("sb-closed", &policy(Egress::Default, &["203.0.113.9"], &[])).expect("open it");
        assert!(member(net, "listed4", a.index));
        net.release("sb-closed");
    }

    #[test]
    fn a_replacement_never_allows_more_between_two_transactions() {
        let op = |set: &str, k: u8| SetOp { set: set.into(), key: vec![k], ..SetOp::default() };
        let old = vec![op("ctmark4", 1), op("default4", 1), op("deny4", 2), op("deny4", 3)];
        let new = vec![op("ctmark4", 1), op("deny4", 3), op("deny4", 4), op("allow4", 5), op("listed4", 1)];
        let ops = replacement(&old, &new);
        let names: Vec<(SetOpKind, &str, u8)> = ops.iter().map(|o| (o.kind, o.set.as_str(), o.key[0])).collect();
        assert_eq!(
            names,
            [
                (SetOpKind::Add, "deny4", 4),
                (SetOpKind::Remove, "default4", 1),
                (SetOpKind::Add, "allow4", 5),
                (SetOpKind::Add, "listed4", 1),
                (SetOpKind::Remove, "deny4", 2),
            ]
        );
        assert!(replacement(&old, &old).is_empty());
    }

    #[test]
    fn a_network_the_host_joins_later_becomes_special() {
        let t = TestNet::new();
        let mut rtnl = Netlink::route().expect("rtnetlink");
        let name = format!("hnt{}", std::process::id() % 100_000);
        let here = open_fd("/proc/thread-self/ns/net").expect("this namespace");
        rtnl.add_veth(&name, &format!("{name}p"), &here, 1500).expect("a veth pair on the host");
        struct Gone(String);
        impl Drop for Gone {
            fn drop(&mut self) {
                if let Ok(i) = netlink::link_index(&self.0) {
                    let _ = Netlink::route().and_then(|mut r| r.del_link(i));
                }
            }
        }
        let _gone = Gone(name.clone());
        let index = netlink::link_index(&name).expect("index");
        let host4 = |a: [u8; 4]| {
            lock(&t.net.nft).has_element(NFPROTO_INET, &t.net.cfg.table(), "host4", &a).expect("read host4")
        };
        assert!(!host4([203, 0, 113, 77]));
        rtnl.link_up(index).expect("up");
        rtnl.add_addr(index, "203.0.113.1".parse().expect("ip"), 24).expect("address");
        assert!(t.net.refresh_host(&mut rtnl).expect("refresh"), "the host's networks changed");
        assert!(host4([203, 0, 113, 77]), "a neighbour on the new network");
        assert!(host4([203, 0, 113, 1]), "the host's new address");
        assert!(!t.net.refresh_host(&mut rtnl).expect("refresh"), "nothing new");
        rtnl.del_link(index).expect("remove the link");
        assert!(t.net.refresh_host(&mut rtnl).expect("refresh"));
        assert!(!host4([203, 0, 113, 77]), "gone with the link");
    }

    #[test]
    fn ipv4_ranges_have_their_embedded_ipv6_forms() {
        let forms = embedded_forms("198.51.100.0".parse().expect("ip"), 24);
        let want: Vec<(Ipv6Addr, u8)> =
            [("64:ff9b::c633:6400", 120), ("::ffff:c633:6400", 120), ("2002:c633:6400::", 40)]
                .iter()
                .map(|(a, l)| (a.parse().expect("ip"), *l))
                .collect();
        assert_eq!(forms, want);
    }

    #[test]
    fn host_networks_are_addresses_and_on_link_routes_of_other_links() {
        use netlink::{AddrMsg, RouteMsg};
        let links: HashMap<u32, String> = [(1, "lo"), (2, "eth0"), (3, "h00sdeadbeef"), (4, "tun0")]
            .iter()
            .map(|(i, n)| (*i, n.to_string()))
            .collect();
        let addr = |index, a: &str, prefix| AddrMsg { index, prefix, addr: a.parse().expect("ip") };
        let route = |oif, dst: &str, dst_len, via_gateway| RouteMsg {
            dst: dst.parse().expect("ip"),
            dst_len,
            table: 254,
            scope: 0,
            kind: netlink::RTN_UNICAST,
            oif: Some(oif),
            via_gateway,
        };
        let got = host_networks_from(
            &[addr(1, "127.0.0.1", 8), addr(2, "192.0.2.10", 24), addr(3, "100.96.0.1", 32)],
            &[
                route(4, "10.8.0.0", 24, false),
                route(2, "0.0.0.0", 0, true),
                route(2, "198.51.100.0", 24, true),
                route(3, "100.96.0.5", 32, false),
            ],
            &links,
        );
        let want: Vec<(IpAddr, u8)> =
            [("10.8.0.0", 24), ("192.0.2.10", 24)].iter().map(|(a, l)| (a.parse().expect("ip"), *l)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn released_namespaces_serve_only_their_group_and_go_a_few_at_a_time_once_idle() {
        let t = TestNet::new();
        let net = &t.net;
        let group = |g: &str| Policy { group: g.into(), ..listed() };
        let ids: Vec<String> = (0..TRIM_BATCH + 3).map(|i| format!("sb-pool{i}")).collect();
        let mut links = Vec::new();
        for id in &ids {
            links.push(net.attach(id, &group("owner-a/t")).expect("attach").host_if.expect("a link"));
        }
        for id in &ids {
            net.release(id);
        }
        // Every released namespace is kept, its link still on the host.
        assert_eq!(net.released(), ids.len());
        assert!(links.iter().all(|l| host_index(l).is_ok()), "a released link was deleted");
        // Another group never gets one; the same group gets the newest.
        let other = net.attach("sb-other", &group("owner-b/t")).expect("attach").host_if.expect("a link");
        assert!(!links.contains(&other), "owner-b was given owner-a's namespace {other}");
        let again = net.attach("sb-again", &group("owner-a/t")).expect("attach").host_if.expect("a link");
        assert_eq!(Some(&again), links.last());
        net.release("sb-other");
        net.release("sb-again");
        assert_eq!(net.released(), ids.len() + 1);
        // Not trimmed while creates or releases touched the pool lately.
        let now = Instant::now();
        assert_eq!(net.trim_pool(now), 0);
        // Idle: each pass deletes at least one and at most a batch (fewer
        // when deletions are slow), until none is left.
        let later = now + POOL_IDLE + Duration::from_secs(1);
        let mut passes = Vec::new();
        loop {
            let n = net.trim_pool(later);
            if n == 0 {
                break;
            }
            passes.push(n);
        }
        assert!(passes.iter().all(|n| *n <= TRIM_BATCH), "a pass deleted more than a batch: {passes:?}");
        assert_eq!(passes.iter().sum::<usize>(), ids.len() + 1, "passes: {passes:?}");
        assert_eq!(net.released(), 0);
        let left: Vec<&String> = links.iter().chain([&other]).filter(|l| host_index(l).is_ok()).collect();
        assert!(left.is_empty(), "links left on the host: {left:?}");
    }

    /// Sends one datagram from the namespace `netns` to `to`.
    fn send_from(netns: &OwnedFd, to: std::net::SocketAddr) {
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns only moves this thread, which ends here.
                assert_eq!(unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
                let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
                sock.send_to(b"x", to).expect("send");
            });
        });
    }

    #[test]
    fn a_release_flushes_its_flows_only_when_its_sandbox_sent_something() {
        let t = TestNet::new();
        let net = &t.net;
        let policy = Policy { group: "owner-f/t".into(), ..listed() };
        let flushes = || net.flushes.load(std::sync::atomic::Ordering::SeqCst);
        // A namespace never flushed is flushed at its first release.
        // (Only the link's name is kept: a namespace still held elsewhere
        // is not pooled.)
        let link = net.attach("sb-flush0", &policy).expect("attach").host_if;
        net.release("sb-flush0");
        assert_eq!(flushes(), 1);
        // The next sandbox of the group gets it and sends nothing: no flush.
        let quiet = net.attach("sb-flush1", &policy).expect("attach").host_if;
        assert_eq!(quiet, link, "the group's released namespace");
        net.release("sb-flush1");
        assert_eq!(flushes(), 1);
        // One that sends a datagram out is flushed; the next quiet one not.
        let loud = net.attach("sb-flush2", &policy).expect("attach");
        assert_eq!(loud.host_if, link);
        send_from(loud.netns.as_deref().expect("a namespace"), "198.51.100.7:9".parse().expect("addr"));
        drop(loud);
        net.release("sb-flush2");
        assert_eq!(flushes(), 2);
        assert_eq!(net.attach("sb-flush3", &policy).expect("attach").host_if, link);
        net.release("sb-flush3");
        assert_eq!(flushes(), 2);
    }

    #[test]
    fn release_during_admit_leaves_no_element() {
        let t = TestNet::new();
        let net = t.net.clone();
        let a = net.attach("sb-race", &listed()).expect("attach");
        let dst: IpAddr = "203.0.113.5".parse().expect("ip");
        // Admission pauses between recording the element and adding it;
        // a release is started in that gap.
        let (paused_tx, paused_rx) = std::sync::mpsc::channel::<()>();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        net.admit_pause.set(Some(Arc::new(move || {
            let _ = paused_tx.send(());
            let _ = lock(&go_rx).recv();
        })));
        let admitting = {
            let net = net.clone();
            std::thread::spawn(move || net.admit("sb-race", &[(dst, Duration::from_secs(30))]))
        };
        paused_rx.recv().expect("admission reached the gap");
        let (released_tx, released_rx) = std::sync::mpsc::channel::<()>();
        let releasing = {
            let net = net.clone();
            std::thread::spawn(move || {
                net.release("sb-race");
                let _ = released_tx.send(());
            })
        };
        // Without ordering, the release finishes inside the gap; with it,
        // the release waits for the admission. Either way, go on after a
        // bound: what is checked is the set, not the time.
        let release_finished_in_gap = released_rx.recv_timeout(std::time::Duration::from_millis(500)).is_ok();
        go_tx.send(()).expect("resume the admission");
        let _ = admitting.join().expect("admit thread");
        releasing.join().expect("release thread");
        net.admit_pause.set(None);
        assert!(
            !allowed(&net, a.index, dst),
            "an element outlived its lease (release finished in the gap: {release_finished_in_gap})"
        );
        assert!(!release_finished_in_gap, "a release ran between an admission's record and its add");
    }

    #[test]
    fn rules_parse_cidrs_and_names() {
        assert_eq!(Rule::parse("10.1.2.0/24"), Ok(Rule::Cidr("10.1.2.0".parse().expect("ip"), 24)));
        assert_eq!(Rule::parse("2001:db8::1"), Ok(Rule::Cidr("2001:db8::1".parse().expect("ip"), 128)));
        assert_eq!(Rule::parse("PyPI.org."), Ok(Rule::Domain("pypi.org".into())));
        for bad in ["10.0.0.0/33", "", "*.", "a..b", "-x.org", "a b.org", "x/y"] {
            assert!(Rule::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn wildcards_match_names_below_only() {
        let r = Rule::parse("*.github.com").expect("rule");
        assert!(r.matches_name("api.github.com"));
        assert!(r.matches_name("a.b.github.com"));
        assert!(!r.matches_name("github.com"));
        assert!(!r.matches_name("evilgithub.com"));
        let exact = Rule::parse("pypi.org").expect("rule");
        assert!(exact.matches_name("pypi.org") && !exact.matches_name("x.pypi.org"));
    }

    #[test]
    fn resolver_answers_by_policy() {
        let p = |egress, allow: &[&str], deny: &[&str]| Policy {
            egress,
            allow: allow.iter().map(|s| Rule::parse(s).expect("rule")).collect(),
            deny: deny.iter().map(|s| Rule::parse(s).expect("rule")).collect(),
            group: String::new(),
            inject: false,
        };
        assert!(p(Egress::Default, &[], &[]).resolves("example.com"));
        assert!(!p(Egress::Default, &[], &["example.com"]).resolves("example.com"));
        assert!(!p(Egress::Private, &[], &[]).resolves("example.com"));
        let listed = p(Egress::Default, &["allowed.test", "10.0.0.0/8"], &[]);
        assert!(listed.resolves("allowed.test") && !listed.resolves("other.test"));
    }

    #[test]
    fn ranges_cover_the_prefix() {
        let (lo, hi) = range("10.1.2.3".parse().expect("ip"), 24);
        assert_eq!((lo, hi), (vec![10, 1, 2, 0], vec![10, 1, 2, 255]));
        let (lo, hi) = range("2001:db8::".parse().expect("ip"), 127);
        assert_eq!(lo[15], 0);
        assert_eq!(hi[15], 1);
    }

    #[test]
    fn ruleset_has_no_placeholders_left() {
        let cfg = NetConfig::new(Path::new("/run/hutch"), 0);
        let text = ruleset(&cfg, &[("192.0.2.2".parse().expect("ip"), 24)]);
        for placeholder in
            ["@SUBNET", "@HOST", "@GATEWAY", "@TABLE", "@PREFIX", "@MAX_FLOWS", "@NEW_FLOWS", "@DNS_RATE"]
        {
            assert!(!text.contains(placeholder), "{text}");
        }
        assert!(
            text.contains(
                "set host4 { type ipv4_addr; flags interval; auto-merge; elements = { 192.0.2.0/24, 192.0.2.2 } }"
            ),
            "{text}"
        );
        assert!(text.contains("set host6 { type ipv6_addr; flags interval; auto-merge;  }"), "{text}");
        assert!(text.contains("ip daddr 100.96.0.1 udp dport 53 accept"));
        assert!(text.contains("table inet hutch {") && text.contains("iifname \"h00s*\" jump from_sandbox"));
    }
}
