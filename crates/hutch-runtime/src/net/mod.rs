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

use netlink::{Netlink, SetOp, SetOpKind, NFPROTO_INET};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

pub const RULESET: &str = include_str!("../../policy/network.nft");
const PEER_NAME: &str = "eth0";
/// Daemons that may run side by side on one host, each with its own
/// table, links and subnet (tests run several).
pub const MAX_INSTANCES: u8 = 32;
/// Namespaces kept ready beyond those in use.
const POOL_KEEP: usize = 64;
/// Addresses a resolver may admit for one sandbox.
pub const MAX_LEARNED: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("network {what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("the network is not set up on this host: {0}")]
    Unavailable(String),
    #[error("no free sandbox address")]
    Exhausted,
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
}

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
    learned: BTreeSet<IpAddr>,
}

#[derive(Debug, Default)]
struct State {
    pool: Vec<Slot>,
    leases: HashMap<String, Lease>,
    /// Address indexes in use (pooled or leased).
    used: BTreeSet<u32>,
    next: u32,
    /// Group names of `private` sandboxes and their marks.
    groups: BTreeMap<String, u32>,
    /// Addresses of sandboxes that outlived the last daemon, until adopted.
    reserved: BTreeSet<u32>,
    /// Namespaces the pool is filled to; released ones are kept up to
    /// twice this, the rest dropped.
    target: usize,
}

/// The host's side of every sandbox network.
#[derive(Debug)]
pub struct Network {
    cfg: NetConfig,
    ipv6: bool,
    /// The ruleset as loaded, to load again if it disappears.
    rules: String,
    mtu: u32,
    resolv_conf: PathBuf,
    rtnl: Mutex<Netlink>,
    nft: Mutex<Netlink>,
    state: Mutex<State>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Network {
    /// Prepares the host: forwarding on, the gateway address, the nftables
    /// table (replacing an older one, so a restarted daemon starts from
    /// empty sets), links left by a previous daemon removed unless `keep`
    /// names them (host link -> address index of sandboxes that outlived
    /// it; their addresses stay reserved until `adopt`).
    pub fn setup(cfg: NetConfig, keep: &BTreeMap<String, u32>) -> Result<Network, NetError> {
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
        let rules = ruleset(&cfg, ipv6, &host_networks());
        load_ruleset(&rules)?;
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
        let nft = Netlink::netfilter().map_err(io_err("open nfnetlink"))?;
        let mtu = uplink_mtu();
        Ok(Network {
            cfg,
            ipv6,
            rules,
            mtu,
            resolv_conf,
            rtnl: Mutex::new(rtnl),
            nft: Mutex::new(nft),
            state: Mutex::new(State {
                next: 2,
                used: keep.values().copied().collect(),
                reserved: keep.values().copied().collect(),
                ..State::default()
            }),
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
            lock(&self.state).pool.push(slot);
        }
        Ok(())
    }

    pub fn pooled(&self) -> usize {
        lock(&self.state).pool.len()
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
            Ok(netns) => Ok(Slot { netns: Arc::new(netns), host_if, index }),
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
                Lease { slot: None, policy: policy.clone(), elements: Vec::new(), learned: BTreeSet::new() },
            );
            return Ok(Attached { netns: None, addr4: None, addr6: None, host_if: None, index: 0 });
        }
        let pooled = lock(&self.state).pool.pop();
        let slot = match pooled {
            Some(s) => s,
            None => self.make_slot()?,
        };
        self.lease(id, slot, policy)
    }

    fn lease(&self, id: &str, slot: Slot, policy: &Policy) -> Result<Attached, NetError> {
        let elements = self.policy_elements(slot.index, policy);
        if let Err(e) = lock(&self.nft).set_elements(NFPROTO_INET, &self.cfg.table(), &elements) {
            lock(&self.state).pool.push(slot);
            return Err(io_err("admit the sandbox to its policy")(e));
        }
        let attached = Attached {
            netns: Some(slot.netns.clone()),
            addr4: Some(self.cfg.addr4(slot.index)),
            addr6: self.ipv6.then(|| self.cfg.addr6(slot.index)),
            host_if: Some(slot.host_if.clone()),
            index: slot.index,
        };
        lock(&self.state).leases.insert(
            id.to_owned(),
            Lease { slot: Some(slot), policy: policy.clone(), elements, learned: BTreeSet::new() },
        );
        Ok(attached)
    }

    /// Takes back the network of a sandbox that outlived a previous daemon:
    /// its namespace (through its PID 1), its link and its policy.
    /// `learned` are the addresses its resolver had admitted.
    pub fn adopt(
        &self,
        id: &str,
        pid: libc::pid_t,
        index: u32,
        host_if: &str,
        policy: &Policy,
        learned: &[IpAddr],
    ) -> Result<(), NetError> {
        if policy.egress == Egress::DenyAll {
            return self.attach(id, policy).map(|_| ());
        }
        let netns = open_fd(&format!("/proc/{pid}/ns/net")).map_err(io_err("open the sandbox's namespace"))?;
        {
            let mut st = lock(&self.state);
            if !(st.reserved.remove(&index) || st.used.insert(index)) {
                return Err(NetError::Unavailable(format!("address {index} is taken twice")));
            }
        }
        let slot = Slot { netns: Arc::new(netns), host_if: host_if.to_owned(), index };
        self.lease(id, slot, policy)?;
        self.admit(id, learned).map(|_| ())
    }

    /// Ends a sandbox's network: its elements leave the sets and its
    /// namespace returns to the pool (or is dropped beyond it).
    pub fn release(&self, id: &str) {
        let Some(lease) = lock(&self.state).leases.remove(id) else { return };
        let mut removals: Vec<SetOp> =
            lease.elements.into_iter().map(|op| SetOp { kind: SetOpKind::Remove, ..op }).collect();
        removals.dedup();
        let mut nft = lock(&self.nft);
        if nft.set_elements(NFPROTO_INET, &self.cfg.table(), &removals).is_err() {
            // One missing element fails the whole batch: remove one by one.
            for op in &removals {
                let _ = nft.set_elements(NFPROTO_INET, &self.cfg.table(), std::slice::from_ref(op));
            }
        }
        drop(nft);
        let Some(slot) = lease.slot else { return };
        let mut st = lock(&self.state);
        if st.pool.len() < (2 * st.target).clamp(1, POOL_KEEP) && Arc::strong_count(&slot.netns) == 1 {
            st.pool.push(slot);
        } else {
            st.used.remove(&slot.index);
            drop(st);
            if let Ok(i) = host_index(&slot.host_if) {
                let _ = lock(&self.rtnl).del_link(i);
            }
        }
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
        let present = lock(&self.nft).has_element(NFPROTO_INET, &self.cfg.table(), "loaded", &gw).unwrap_or(false);
        if present {
            return Ok(true);
        }
        load_ruleset(&self.rules)?;
        let elements: Vec<SetOp> = lock(&self.state).leases.values().flat_map(|l| l.elements.clone()).collect();
        lock(&self.nft)
            .set_elements(NFPROTO_INET, &self.cfg.table(), &elements)
            .map_err(io_err("restore the sandboxes' policies"))?;
        Ok(false)
    }

    /// Every address admitted for sandbox `id` so far.
    pub fn learned(&self, id: &str) -> Vec<IpAddr> {
        lock(&self.state).leases.get(id).map(|l| l.learned.iter().copied().collect()).unwrap_or_default()
    }

    /// Admits addresses the resolver handed out to sandbox `id` (allow-list
    /// mode). Bounded: past MAX_LEARNED, new addresses are refused.
    pub fn admit(&self, id: &str, addrs: &[IpAddr]) -> Result<usize, NetError> {
        let mut ops = Vec::new();
        {
            let mut st = lock(&self.state);
            let Some(lease) = st.leases.get_mut(id) else { return Ok(0) };
            let Some(index) = lease.slot.as_ref().map(|s| s.index) else { return Ok(0) };
            if !lease.policy.listed() {
                return Ok(0);
            }
            for a in addrs {
                if lease.learned.len() >= MAX_LEARNED || lease.learned.contains(a) {
                    continue;
                }
                let Some(op) = self.pair_op("allow", index, *a, if a.is_ipv4() { 32 } else { 128 }) else { continue };
                lease.learned.insert(*a);
                lease.elements.push(op.clone());
                ops.push(op);
            }
        }
        lock(&self.nft)
            .set_elements(NFPROTO_INET, &self.cfg.table(), &ops)
            .map_err(io_err("admit resolved addresses"))?;
        Ok(ops.len())
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
            (Egress::DenyAll, _) => (links == ["lo"]).then_some(Egress::DenyAll),
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

    fn group_mark(&self, group: &str) -> u32 {
        let mut st = lock(&self.state);
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
            }
        }
        match p.egress {
            Egress::DenyAll => {}
            Egress::Private => {
                let mark = self.group_mark(&p.group).to_ne_bytes().to_vec();
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
        ops
    }
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

/// The ruleset with this host's values in place.
pub fn ruleset(cfg: &NetConfig, ipv6: bool, host: &[(IpAddr, u8)]) -> String {
    let list = |v4: bool| -> String {
        host.iter()
            .filter(|(a, _)| a.is_ipv4() == v4)
            .map(|(a, l)| {
                let (lo, _) = range(*a, *l);
                let net: IpAddr = if v4 {
                    IpAddr::V4(Ipv4Addr::new(lo[0], lo[1], lo[2], lo[3]))
                } else {
                    let mut o = [0u8; 16];
                    o.copy_from_slice(&lo);
                    IpAddr::V6(Ipv6Addr::from(o))
                };
                format!(", {net}/{l}, {a}")
            })
            .collect()
    };
    let _ = ipv6;
    RULESET
        .replace("@SUBNET4@", &format!("{}/16", cfg.subnet4))
        .replace("@SUBNET6@", &format!("{}/64", cfg.subnet6))
        .replace(" @HOST4@", &list(true))
        .replace(" @HOST6@", &list(false))
        .replace("@GATEWAY4@", &cfg.gateway4().to_string())
        .replace("@TABLE@", &cfg.table())
        .replace("@PREFIX@", &cfg.host_prefix())
}

/// Loads the ruleset with `nft -f -`, once per daemon start (never per
/// sandbox). nftables' transaction makes the replacement atomic.
fn load_ruleset(text: &str) -> Result<(), NetError> {
    use std::io::Write;
    let nft = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"]
        .iter()
        .find(|p| Path::new(p).is_file())
        .ok_or_else(|| NetError::Unavailable("nft (the nftables package) is not installed".into()))?;
    let mut child = std::process::Command::new(nft)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(io_err("run nft"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes()).map_err(io_err("write the ruleset to nft"))?;
    }
    let out = child.wait_with_output().map_err(io_err("wait for nft"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(NetError::Unavailable(format!("nft refused the ruleset: {}", err.trim())));
    }
    Ok(())
}

impl Network {
    /// Removes what `setup` put on the host: the table, the gateway link,
    /// the pooled namespaces and their links. Only for a daemon that ends
    /// with no sandbox running (their networks would go with it).
    pub fn teardown(&self) {
        let pool = std::mem::take(&mut lock(&self.state).pool);
        let mut rtnl = lock(&self.rtnl);
        for slot in pool {
            if let Ok(i) = host_index(&slot.host_if) {
                let _ = rtnl.del_link(i);
            }
        }
        let t = self.cfg.table();
        let _ = load_ruleset(&format!("table inet {t} {{}}\ndelete table inet {t}\n"));
    }
}

/// The host's own addresses and the networks they are on, excluding
/// loopback and hutch's links.
pub fn host_networks() -> Vec<(IpAddr, u8)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap with a list freed below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy();
        if name == "lo" || is_hutch_link(&name) {
            continue;
        }
        // SAFETY: the family says which sockaddr type both pointers hold.
        let pair = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in);
                    let len = u32::from_be(m.sin_addr.s_addr).count_ones() as u8;
                    Some((IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))), len))
                }
                libc::AF_INET6 => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in6);
                    let len = m.sin6_addr.s6_addr.iter().map(|b| b.count_ones()).sum::<u32>() as u8;
                    Some((IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)), len))
                }
                _ => None,
            }
        };
        if let Some(p) = pair {
            out.push(p);
        }
    }
    // SAFETY: ifap came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    out
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
    // SAFETY: plain socket(2); checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads a live c_int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_IP,
            libc::IP_FREEBIND,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
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
    Ok(std::net::UdpSocket::from(fd))
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
        let text = ruleset(&cfg, true, &[("192.0.2.2".parse().expect("ip"), 24)]);
        for placeholder in ["@SUBNET", "@HOST", "@GATEWAY"] {
            assert!(!text.contains(placeholder), "{text}");
        }
        assert!(text.contains("100.96.0.0/16, 192.0.2.0/24, 192.0.2.2 }"), "{text}");
        assert!(text.contains("ip daddr 100.96.0.1 udp dport 53 accept"));
        assert!(text.contains("table inet hutch {") && text.contains("iifname \"h00s*\" jump from_sandbox"));
    }
}
