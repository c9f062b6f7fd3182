//! hutch's nftables ruleset as data, and its encoding as nf_tables
//! netlink messages: the daemon loads it without the `nft` program.
//!
//! `policy/network.nft` is the same ruleset in nft's language, for people
//! to read and review; a test (tests/nft_parity.rs in the hutch crate)
//! loads both, one with `nft -f` and one with `load`, and checks that
//! `nft list table` prints them alike. A rule added there is added here
//! too, in the same place: `ruleset()` reads like the file, rule by rule.
//!
//! The encoding is what nft 1.x sends for the same text (attribute by
//! attribute: registers, byte orders, the set descriptions nft keeps in a
//! set's user data so that `nft list` prints its types back).

use super::netlink::{Msg, Netlink, NFNL_SUBSYS_NFTABLES};
use std::io;
use std::net::IpAddr;

const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;

const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;

const NFPROTO_INET: u8 = 1;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

// Attributes of tables, chains, rules, sets and elements.
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;
const NFTA_SET_DATA_LEN: u16 = 7;
const NFTA_SET_DESC: u16 = 9;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_TIMEOUT: u16 = 11;
const NFTA_SET_USERDATA: u16 = 13;
const NFTA_SET_DESC_SIZE: u16 = 1;
const NFTA_SET_DESC_CONCAT: u16 = 2;
const NFTA_SET_FIELD_LEN: u16 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_SET_ELEM_USERDATA: u16 = 6;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

const NFT_SET_ANONYMOUS: u32 = 0x1;
const NFT_SET_CONSTANT: u32 = 0x2;
const NFT_SET_INTERVAL: u32 = 0x4;
const NFT_SET_MAP: u32 = 0x8;
const NFT_SET_TIMEOUT: u32 = 0x10;
const NFT_SET_EVAL: u32 = 0x20;
const NFT_SET_CONCAT: u32 = 0x80;
const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;

/// nft's own notes in a set's user data (`NFTNL_UDATA_SET_*`), which `nft
/// list` reads to print the set's types back: the key's byte order, the
/// data's, `auto-merge`, and how a concatenation or an anonymous set's
/// key was written. Bytes as nft 1.x writes them for these set types.
mod udata {
    /// A key of addresses (big endian).
    pub const ADDR: &[u8] = &[0, 4, 2, 0, 0, 0];
    /// `flags interval; auto-merge`.
    pub const ADDR_MERGED: &[u8] = &[0, 4, 2, 0, 0, 0, 2, 4, 1, 0, 0, 0];
    /// A map from addresses to marks (host order).
    pub const ADDR_TO_MARK: &[u8] = &[0, 4, 2, 0, 0, 0, 1, 4, 1, 0, 0, 0, 6, 4, 0, 0, 0, 0];
    /// A concatenation.
    pub const CONCAT: &[u8] = &[0, 4, 0, 0, 0, 0, 3, 8, 0, 4, 13, 0, 0, 0, 1, 0];
    /// The anonymous set of `icmpv6 type { ... }`.
    pub const ICMPV6_TYPES: &[u8] =
        &[0, 4, 2, 0, 0, 0, 3, 20, 0, 4, 7, 0, 0, 0, 1, 12, 0, 4, 14, 0, 0, 0, 1, 4, 1, 0, 0, 0];
    /// An element's interval reaches the end of the key space (no end
    /// element follows it).
    pub const ELEM_INTERVAL_OPEN: &[u8] = &[1, 4, 1, 0, 0, 0];
}

/// A field's type, as nftables numbers it (`datatype`), and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Type {
    Ipv4,
    Ipv6,
    Mark,
    Icmpv6Type,
}

impl Type {
    fn id(self) -> u32 {
        match self {
            Type::Ipv4 => 7,
            Type::Ipv6 => 8,
            Type::Mark => 19,
            Type::Icmpv6Type => 29,
        }
    }

    fn len(self) -> u32 {
        match self {
            Type::Ipv4 | Type::Mark => 4,
            Type::Ipv6 => 16,
            Type::Icmpv6Type => 1,
        }
    }
}

/// A set's elements as the kernel takes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Element {
    pub key: Vec<u8>,
    /// `NFT_SET_ELEM_INTERVAL_END`: the first key past a range.
    pub end: bool,
    pub udata: &'static [u8],
}

/// A named (or anonymous) set or map.
#[derive(Debug, Clone)]
pub struct Set {
    pub name: String,
    pub key: Vec<Type>,
    /// The value's type, for maps.
    pub data: Option<Type>,
    pub flags: u32,
    pub size: Option<u32>,
    pub timeout_ms: Option<u64>,
    pub udata: &'static [u8],
    pub elements: Vec<Element>,
}

/// A base chain's hook.
#[derive(Debug, Clone, Copy)]
pub struct Hook {
    pub kind: &'static str,
    pub hook: u32,
    pub priority: i32,
}

const HOOK_PREROUTING: u32 = 0;
const HOOK_INPUT: u32 = 1;
const HOOK_FORWARD: u32 = 2;
const HOOK_OUTPUT: u32 = 3;
const HOOK_POSTROUTING: u32 = 4;
/// `priority filter`, `priority srcnat`.
const PRIORITY_FILTER: i32 = 0;
const PRIORITY_SRCNAT: i32 = 100;
/// `priority dstnat`.
const PRIORITY_DSTNAT: i32 = -100;

#[derive(Debug, Clone)]
pub struct Chain {
    pub name: &'static str,
    /// Base chains: their hook (policy accept); regular chains: none.
    pub hook: Option<Hook>,
}

/// Registers: the verdict, then 16-byte registers (`NFT_REG_1`...), which
/// concatenations fill in 4-byte steps (`NFT_REG32_00`...).
const REG_VERDICT: u32 = 0;
const REG_1: u32 = 1;

/// The register `offset` bytes into register 1, named as nft names it.
fn reg_at(offset: u32) -> u32 {
    if offset.is_multiple_of(16) {
        REG_1 + offset / 16
    } else {
        8 + offset / 4
    }
}

/// One expression of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// `meta KEY` into a register.
    Meta {
        key: u32,
        dreg: u32,
    },
    /// `meta KEY set` from a register.
    MetaSet {
        key: u32,
        sreg: u32,
    },
    Cmp {
        op: u32,
        data: Vec<u8>,
    },
    /// Bytes of the packet: base 1 network header, 2 transport header.
    Payload {
        base: u32,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    Bitwise {
        len: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    /// `ct KEY` into a register.
    Ct {
        key: u32,
        dreg: u32,
    },
    CtSet {
        key: u32,
        sreg: u32,
    },
    /// `fib FLAGS RESULT`.
    Fib {
        result: u32,
        flags: u32,
    },
    /// A set membership test; with `dreg`, a map's value into it.
    Lookup {
        set: String,
        set_id: u32,
        dreg: Option<u32>,
    },
    /// Adds (op 0) or updates (op 1) the element of register 1's key, with
    /// a stateful expression (`connlimit` or `limit`) of its own.
    Dynset {
        set: String,
        set_id: u32,
        op: u32,
        stateful: Stateful,
    },
    /// `reject with icmpx admin-prohibited`.
    Reject,
    /// `reject with tcp reset`.
    RejectTcpReset,
    /// A value into a register (`immediate`).
    Immediate {
        dreg: u32,
        data: Vec<u8>,
    },
    Verdict(Verdict),
    Masquerade,
    /// `dnat ip to` the address in register 1 and the port in register 2.
    Dnat4,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stateful {
    /// `ct count over N`.
    ConnlimitOver(u32),
    /// `limit rate over R/second burst B packets`.
    LimitOver(Rate),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
}

/// A rate in packets per second with a burst, as `limit` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_second: u64,
    pub burst: u32,
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/second burst {} packets", self.per_second, self.burst)
    }
}

const META_MARK: u32 = 3;
const META_IIFNAME: u32 = 6;
const META_OIFNAME: u32 = 7;
const META_NFPROTO: u32 = 15;
const META_L4PROTO: u32 = 16;
const CT_STATE: u32 = 0;
const CT_STATUS: u32 = 2;
/// `IPS_DST_NAT`: the flow's destination was rewritten (`ct status dnat`).
const CT_STATUS_DNAT: u32 = 1 << 5;
const CT_MARK: u32 = 3;
const CT_STATE_ESTABLISHED: u32 = 2;
const CT_STATE_RELATED: u32 = 4;
const CT_STATE_NEW: u32 = 8;
const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const FIB_RESULT_OIF: u32 = 1;
const FIB_SADDR: u32 = 0x1;
const FIB_IIF: u32 = 0x8;
const FIB_PRESENT: u32 = 0x20;
const BASE_NETWORK: u32 = 1;
const BASE_TRANSPORT: u32 = 2;
const ICMPV6_ND_NEIGHBOR_SOLICIT: u8 = 135;
const ICMPV6_ND_NEIGHBOR_ADVERT: u8 = 136;

/// IP version of a rule written once per family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn suffix(self) -> &'static str {
        match self {
            Family::V4 => "4",
            Family::V6 => "6",
        }
    }

    fn addr(self) -> Type {
        match self {
            Family::V4 => Type::Ipv4,
            Family::V6 => Type::Ipv6,
        }
    }
}

/// A rule under construction: its expressions in order, with helpers
/// named after what they match in nft's language.
#[derive(Debug, Clone)]
pub struct Rule {
    pub chain: &'static str,
    pub exprs: Vec<Expr>,
    /// Loaded into register 1 so far (for concatenations).
    next: u32,
}

impl Rule {
    pub fn new(chain: &'static str) -> Rule {
        Rule { chain, exprs: Vec::new(), next: 0 }
    }

    fn push(mut self, e: Expr) -> Rule {
        self.exprs.push(e);
        self
    }

    fn cmp(self, op: u32, data: &[u8]) -> Rule {
        self.push(Expr::Cmp { op, data: data.to_vec() })
    }

    /// `iifname "PREFIX*"` / `oifname "PREFIX*"` (`!=` when `not`).
    fn ifname(self, key: u32, not: bool, prefix: &str) -> Rule {
        self.push(Expr::Meta { key, dreg: REG_1 }).cmp(if not { CMP_NEQ } else { CMP_EQ }, prefix.as_bytes())
    }

    pub fn iifname_prefix(self, prefix: &str) -> Rule {
        self.ifname(META_IIFNAME, false, prefix)
    }

    pub fn oifname_prefix(self, prefix: &str) -> Rule {
        self.ifname(META_OIFNAME, false, prefix)
    }

    pub fn oifname_not_prefix(self, prefix: &str) -> Rule {
        self.ifname(META_OIFNAME, true, prefix)
    }

    /// `fib saddr . iif oif missing`: no route back out of the link the
    /// packet came in on.
    pub fn fib_saddr_iif_missing(self) -> Rule {
        self.push(Expr::Fib { result: FIB_RESULT_OIF, flags: FIB_SADDR | FIB_IIF | FIB_PRESENT })
            .cmp(CMP_EQ, &[0, 0, 0, 0])
    }

    /// `ct state S1,S2`.
    pub fn ct_state(self, states: u32) -> Rule {
        self.push(Expr::Ct { key: CT_STATE, dreg: REG_1 })
            .push(Expr::Bitwise { len: 4, mask: states.to_ne_bytes().to_vec(), xor: vec![0; 4] })
            .cmp(CMP_NEQ, &[0, 0, 0, 0])
    }

    /// `ip ...` / `ip6 ...` in an inet table: the family first.
    pub fn family(mut self, f: Family) -> Rule {
        self.next = 0;
        let proto = match f {
            Family::V4 => NFPROTO_IPV4,
            Family::V6 => NFPROTO_IPV6,
        };
        self.push(Expr::Meta { key: META_NFPROTO, dreg: REG_1 }).cmp(CMP_EQ, &[proto])
    }

    /// Loads network-header bytes into the next part of the key.
    fn load(mut self, base: u32, offset: u32, len: u32) -> Rule {
        let dreg = reg_at(self.next);
        self.next += len.next_multiple_of(4);
        self.push(Expr::Payload { base, offset, len, dreg })
    }

    /// `ip saddr` / `ip6 saddr` (after `family`).
    pub fn saddr(self, f: Family) -> Rule {
        match f {
            Family::V4 => self.load(BASE_NETWORK, 12, 4),
            Family::V6 => self.load(BASE_NETWORK, 8, 16),
        }
    }

    pub fn daddr(self, f: Family) -> Rule {
        match f {
            Family::V4 => self.load(BASE_NETWORK, 16, 4),
            Family::V6 => self.load(BASE_NETWORK, 24, 16),
        }
    }

    /// `meta mark` as the next part of the key.
    pub fn mark(mut self) -> Rule {
        let dreg = reg_at(self.next);
        self.next += 4;
        self.push(Expr::Meta { key: META_MARK, dreg })
    }

    /// `ip daddr ADDR` (IPv4).
    pub fn daddr4_is(self, addr: std::net::Ipv4Addr) -> Rule {
        self.family(Family::V4).daddr4_eq(addr)
    }

    /// `ip daddr ADDR` in a rule that already matched IPv4.
    pub fn daddr4_eq(self, addr: std::net::Ipv4Addr) -> Rule {
        let r = self.daddr(Family::V4);
        Rule { next: 0, ..r }.cmp(CMP_EQ, &addr.octets())
    }

    /// `udp dport PORT` / `tcp dport PORT`.
    fn dport(self, proto: i32, port: u16) -> Rule {
        let r = self.push(Expr::Meta { key: META_L4PROTO, dreg: REG_1 }).cmp(CMP_EQ, &[proto as u8]);
        let r = Rule { next: 0, ..r }.load(BASE_TRANSPORT, 2, 2);
        Rule { next: 0, ..r }.cmp(CMP_EQ, &port.to_be_bytes())
    }

    pub fn udp_dport(self, port: u16) -> Rule {
        self.dport(libc::IPPROTO_UDP, port)
    }

    pub fn tcp_dport(self, port: u16) -> Rule {
        self.dport(libc::IPPROTO_TCP, port)
    }

    /// `ct status dnat`.
    pub fn ct_status_dnat(self) -> Rule {
        self.push(Expr::Ct { key: CT_STATUS, dreg: REG_1 })
            .push(Expr::Bitwise { len: 4, mask: CT_STATUS_DNAT.to_ne_bytes().to_vec(), xor: vec![0; 4] })
            .cmp(CMP_NEQ, &[0, 0, 0, 0])
    }

    /// `icmpv6 type @set` (an anonymous set).
    pub fn icmpv6_type_in(self, set: &Set, set_id: u32) -> Rule {
        let r = self.family(Family::V6);
        let r = r.push(Expr::Meta { key: META_L4PROTO, dreg: REG_1 }).cmp(CMP_EQ, &[libc::IPPROTO_ICMPV6 as u8]);
        Rule { next: 0, ..r }.load(BASE_TRANSPORT, 0, 1).in_set(&set.name, set_id)
    }

    /// `... @set`: the key loaded so far is in the set.
    pub fn in_set(mut self, set: &str, set_id: u32) -> Rule {
        self.next = 0;
        self.push(Expr::Lookup { set: set.into(), set_id, dreg: None })
    }

    /// `... map @set`: the map's value for the key, into register 1.
    pub fn map(mut self, set: &str, set_id: u32) -> Rule {
        self.next = 0;
        self.push(Expr::Lookup { set: set.into(), set_id, dreg: Some(REG_1) })
    }

    /// `ct mark set` register 1.
    pub fn ct_mark_set(self) -> Rule {
        self.push(Expr::CtSet { key: CT_MARK, sreg: REG_1 })
    }

    /// `meta mark set` register 1.
    pub fn meta_mark_set(self) -> Rule {
        self.push(Expr::MetaSet { key: META_MARK, sreg: REG_1 })
    }

    /// `add @set { KEY ct count over N }`.
    pub fn add_connlimit_over(mut self, set: &str, set_id: u32, count: u32) -> Rule {
        self.next = 0;
        self.push(Expr::Dynset { set: set.into(), set_id, op: 0, stateful: Stateful::ConnlimitOver(count) })
    }

    /// `update @set { KEY limit rate over R }`.
    pub fn update_limit_over(mut self, set: &str, set_id: u32, rate: Rate) -> Rule {
        self.next = 0;
        self.push(Expr::Dynset { set: set.into(), set_id, op: 1, stateful: Stateful::LimitOver(rate) })
    }

    pub fn reject(self) -> Rule {
        self.push(Expr::Reject)
    }

    pub fn reject_tcp_reset(self) -> Rule {
        self.push(Expr::RejectTcpReset)
    }

    /// `dnat ip to ADDR:PORT`.
    pub fn dnat4(self, addr: std::net::Ipv4Addr, port: u16) -> Rule {
        self.push(Expr::Immediate { dreg: REG_1, data: addr.octets().to_vec() })
            .push(Expr::Immediate { dreg: REG_1 + 1, data: port.to_be_bytes().to_vec() })
            .push(Expr::Dnat4)
    }

    /// `return`.
    pub fn ret(self) -> Rule {
        self.push(Expr::Verdict(Verdict::Return))
    }

    pub fn accept(self) -> Rule {
        self.push(Expr::Verdict(Verdict::Accept))
    }

    pub fn drop(self) -> Rule {
        self.push(Expr::Verdict(Verdict::Drop))
    }

    pub fn jump(self, chain: &str) -> Rule {
        self.push(Expr::Verdict(Verdict::Jump(chain.into())))
    }

    pub fn masquerade(self) -> Rule {
        self.push(Expr::Masquerade)
    }
}

/// What the ruleset needs from the host and the daemon's configuration.
#[derive(Debug, Clone)]
pub struct Values {
    pub table: String,
    /// Host ends of the sandboxes' veths start with this.
    pub prefix: String,
    pub subnet4: (IpAddr, u8),
    pub subnet6: (IpAddr, u8),
    pub gateway4: std::net::Ipv4Addr,
    /// The host's addresses and networks.
    pub host: Vec<(IpAddr, u8)>,
    pub max_flows: u32,
    pub new_flows: Rate,
    pub dns_rate: Rate,
    /// The egress proxy's port on the gateway address.
    pub egress_port: u16,
}

/// The whole ruleset: what `load` sends.
#[derive(Debug, Clone)]
pub struct Ruleset {
    pub table: String,
    pub chains: Vec<Chain>,
    /// Named sets, in the order they are made (their ids are 1, 2, ...).
    pub sets: Vec<Set>,
    /// Rules in order; each may come with anonymous sets of its own.
    pub rules: Vec<(Vec<Set>, Rule)>,
}

fn set(name: &str, key: &[Type], udata: &'static [u8]) -> Set {
    Set {
        name: name.into(),
        key: key.to_vec(),
        data: None,
        flags: 0,
        size: None,
        timeout_ms: None,
        udata,
        elements: Vec::new(),
    }
}

/// A plain set of addresses.
fn addr_set(name: &str, f: Family) -> Set {
    set(name, &[f.addr()], udata::ADDR)
}

/// `flags interval` on (sandbox . destination range).
fn pair_ranges(name: &str, f: Family) -> Set {
    Set { flags: NFT_SET_INTERVAL | NFT_SET_CONCAT, ..set(name, &[f.addr(), f.addr()], udata::CONCAT) }
}

/// `flags interval; auto-merge` with elements.
fn ranges(name: &str, f: Family, nets: &[(IpAddr, u8)]) -> Set {
    Set {
        flags: NFT_SET_INTERVAL,
        elements: interval_elements(nets, f == Family::V4),
        ..set(name, &[f.addr()], udata::ADDR_MERGED)
    }
}

/// A map from addresses to marks.
fn mark_map(name: &str, f: Family) -> Set {
    Set { flags: NFT_SET_MAP, data: Some(Type::Mark), ..set(name, &[f.addr()], udata::ADDR_TO_MARK) }
}

/// `size 65536; flags dynamic` (and `timeout` when given).
fn dynamic(name: &str, f: Family, timeout_ms: Option<u64>) -> Set {
    let flags = NFT_SET_EVAL | if timeout_ms.is_some() { NFT_SET_TIMEOUT } else { 0 };
    Set { flags, size: Some(65536), timeout_ms, ..addr_set(name, f) }
}

/// Merged, sorted ranges of `nets` (one family), as interval elements: a
/// start element per range and an end element (`INTERVAL_END`) at the
/// first key past it, an end element at zero when no range starts there,
/// and the last start marked open when it reaches the top of the space.
/// This is what nft makes of an `auto-merge` set's elements.
pub fn interval_elements(nets: &[(IpAddr, u8)], v4: bool) -> Vec<Element> {
    let bits: u32 = if v4 { 32 } else { 128 };
    let max: u128 = if v4 { u32::MAX as u128 } else { u128::MAX };
    let mut ranges: Vec<(u128, u128)> = nets
        .iter()
        .filter(|(a, _)| a.is_ipv4() == v4)
        .map(|(a, len)| {
            let v: u128 = match a {
                IpAddr::V4(a) => u32::from(*a) as u128,
                IpAddr::V6(a) => u128::from(*a),
            };
            let len = (*len as u32).min(bits);
            let host = max.checked_shr(len).unwrap_or(0);
            (v & !host & max, (v | host) & max)
        })
        .collect();
    ranges.sort();
    let mut merged: Vec<(u128, u128)> = Vec::new();
    for (lo, hi) in ranges {
        match merged.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    let key = |v: u128| if v4 { (v as u32).to_be_bytes().to_vec() } else { v.to_be_bytes().to_vec() };
    let mut out = Vec::new();
    if merged.first().is_some_and(|(lo, _)| *lo != 0) {
        out.push(Element { key: key(0), end: true, udata: &[] });
    }
    for (lo, hi) in merged {
        if hi == max {
            out.push(Element { key: key(lo), end: false, udata: udata::ELEM_INTERVAL_OPEN });
        } else {
            out.push(Element { key: key(lo), end: false, udata: &[] });
            out.push(Element { key: key(hi + 1), end: true, udata: &[] });
        }
    }
    out
}

/// Never reachable from a sandbox outside its group (see network.nft).
const SPECIAL4: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/3",
];
const SPECIAL6: &[&str] = &[
    "::/96",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "2001::/32",
    "2002::/16",
    "fc00::/7",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
];

fn nets(list: &[&str], extra: (IpAddr, u8)) -> Vec<(IpAddr, u8)> {
    let mut out: Vec<(IpAddr, u8)> = list
        .iter()
        .filter_map(|s| {
            let (a, l) = s.split_once('/')?;
            Some((a.parse().ok()?, l.parse().ok()?))
        })
        .collect();
    out.push(extra);
    out
}

/// hutch's ruleset: policy/network.nft, statement by statement.
pub fn ruleset(v: &Values) -> Ruleset {
    use Family::{V4, V6};
    let hook = |kind, hook, priority| Some(Hook { kind, hook, priority });
    let chains = vec![
        Chain { name: "forward", hook: hook("filter", HOOK_FORWARD, PRIORITY_FILTER - 5) },
        Chain { name: "from_sandbox", hook: None },
        Chain { name: "private_out4", hook: None },
        Chain { name: "private_out6", hook: None },
        Chain { name: "to_sandbox", hook: None },
        Chain { name: "input", hook: hook("filter", HOOK_INPUT, PRIORITY_FILTER - 5) },
        Chain { name: "sandbox_in", hook: None },
        Chain { name: "output", hook: hook("filter", HOOK_OUTPUT, PRIORITY_FILTER - 5) },
        Chain { name: "to_sandbox_local", hook: None },
        Chain { name: "inject_prerouting", hook: hook("nat", HOOK_PREROUTING, PRIORITY_DSTNAT) },
        Chain { name: "inject_out4", hook: None },
        Chain { name: "inject_forward", hook: hook("filter", HOOK_FORWARD, PRIORITY_FILTER - 6) },
        Chain { name: "postrouting", hook: hook("nat", HOOK_POSTROUTING, PRIORITY_SRCNAT) },
    ];
    let minute = Some(60_000);
    let mut loaded = addr_set("loaded", V4);
    loaded.elements.push(Element { key: v.gateway4.octets().to_vec(), end: false, udata: &[] });
    let sets = vec![
        loaded,
        addr_set("default4", V4),
        addr_set("default6", V6),
        addr_set("listed4", V4),
        addr_set("listed6", V6),
        pair_ranges("allow4", V4),
        pair_ranges("allow6", V6),
        pair_ranges("deny4", V4),
        pair_ranges("deny6", V6),
        addr_set("private4", V4),
        addr_set("private6", V6),
        mark_map("group4", V4),
        mark_map("group6", V6),
        set("member4", &[Type::Ipv4, Type::Mark], udata::CONCAT),
        set("member6", &[Type::Ipv6, Type::Mark], udata::CONCAT),
        ranges("special4", V4, &nets(SPECIAL4, v.subnet4)),
        ranges("special6", V6, &nets(SPECIAL6, v.subnet6)),
        ranges("host4", V4, &host_nets(&v.host)),
        ranges("host6", V6, &host_nets(&v.host)),
        mark_map("ctmark4", V4),
        mark_map("ctmark6", V6),
        dynamic("flows4", V4, None),
        dynamic("flows6", V6, None),
        dynamic("newflows4", V4, minute),
        dynamic("newflows6", V6, minute),
        dynamic("dnsrate4", V4, minute),
        addr_set("inject4", V4),
        addr_set("inject6", V6),
    ];
    // Named sets are referred to by name and by their id in this
    // transaction; anonymous ones get the ids after them.
    let id = |name: &str| sets.iter().position(|s| s.name == name).map(|i| i as u32 + 1).unwrap_or(0);
    let mut anon_id = sets.len() as u32;
    let mut rules: Vec<(Vec<Set>, Rule)> = Vec::new();
    let mut add = |r: Rule| rules.push((Vec::new(), r));
    let prefix = v.prefix.as_str();
    let both = [V4, V6];

    add(Rule::new("forward").iifname_prefix(prefix).jump("from_sandbox"));
    add(Rule::new("forward").oifname_prefix(prefix).jump("to_sandbox"));

    let from = || Rule::new("from_sandbox");
    add(from().fib_saddr_iif_missing().drop());
    for f in both {
        let s = format!("ctmark{}", f.suffix());
        add(from().ct_state(CT_STATE_NEW).family(f).saddr(f).map(&s, id(&s)).ct_mark_set());
    }
    for f in both {
        let s = format!("flows{}", f.suffix());
        add(from().ct_state(CT_STATE_NEW).family(f).saddr(f).add_connlimit_over(&s, id(&s), v.max_flows).reject());
    }
    for f in both {
        let s = format!("newflows{}", f.suffix());
        add(from().ct_state(CT_STATE_NEW).family(f).saddr(f).update_limit_over(&s, id(&s), v.new_flows).reject());
    }
    for f in both {
        let s = format!("deny{}", f.suffix());
        add(from().family(f).saddr(f).daddr(f).in_set(&s, id(&s)).reject());
    }
    for f in both {
        let s = format!("private{}", f.suffix());
        add(from().family(f).saddr(f).in_set(&s, id(&s)).jump(&format!("private_out{}", f.suffix())));
    }
    for name in ["special", "host"] {
        for f in both {
            let s = format!("{name}{}", f.suffix());
            add(from().family(f).daddr(f).in_set(&s, id(&s)).reject());
        }
    }
    for f in both {
        let s = format!("allow{}", f.suffix());
        add(from().family(f).saddr(f).daddr(f).in_set(&s, id(&s)).accept());
    }
    for f in both {
        let s = format!("listed{}", f.suffix());
        add(from().family(f).saddr(f).in_set(&s, id(&s)).reject());
    }
    for f in both {
        let s = format!("default{}", f.suffix());
        add(from().family(f).saddr(f).in_set(&s, id(&s)).accept());
    }
    add(from().reject());

    for (f, chain) in [(V4, "private_out4"), (V6, "private_out6")] {
        let (group, member) = (format!("group{}", f.suffix()), format!("member{}", f.suffix()));
        add(Rule::new(chain).family(f).saddr(f).map(&group, id(&group)).meta_mark_set());
        add(Rule::new(chain).family(f).daddr(f).mark().in_set(&member, id(&member)).accept());
        add(Rule::new(chain).reject());
    }

    add(Rule::new("to_sandbox").ct_state(CT_STATE_ESTABLISHED | CT_STATE_RELATED).accept());
    add(Rule::new("to_sandbox").drop());

    add(Rule::new("input").iifname_prefix(prefix).jump("sandbox_in"));

    // `icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept`,
    // with a set of its own in each chain.
    let mut neighbour_discovery = |chain: &'static str| {
        anon_id += 1;
        let s = Set {
            flags: NFT_SET_ANONYMOUS | NFT_SET_CONSTANT,
            size: Some(2),
            elements: [ICMPV6_ND_NEIGHBOR_SOLICIT, ICMPV6_ND_NEIGHBOR_ADVERT]
                .iter()
                .map(|t| Element { key: vec![*t], end: false, udata: &[] })
                .collect(),
            ..set("__set%d", &[Type::Icmpv6Type], udata::ICMPV6_TYPES)
        };
        let r = Rule::new(chain).icmpv6_type_in(&s, anon_id).accept();
        (vec![s], r)
    };
    let nd_in = neighbour_discovery("sandbox_in");
    let nd_out = neighbour_discovery("to_sandbox_local");
    rules.push(nd_in);
    let mut add = |r: Rule| rules.push((Vec::new(), r));
    add(Rule::new("sandbox_in").fib_saddr_iif_missing().drop());
    add(Rule::new("sandbox_in")
        .daddr4_is(v.gateway4)
        .udp_dport(53)
        .saddr(V4)
        .update_limit_over("dnsrate4", id("dnsrate4"), v.dns_rate)
        .drop());
    add(Rule::new("sandbox_in").daddr4_is(v.gateway4).udp_dport(53).accept());
    add(Rule::new("sandbox_in")
        .family(V4)
        .saddr(V4)
        .in_set("inject4", id("inject4"))
        .daddr4_eq(v.gateway4)
        .tcp_dport(v.egress_port)
        .ct_status_dnat()
        .accept());
    add(Rule::new("sandbox_in").reject());

    add(Rule::new("output").oifname_prefix(prefix).jump("to_sandbox_local"));
    rules.push(nd_out);
    let mut add = |r: Rule| rules.push((Vec::new(), r));
    add(Rule::new("to_sandbox_local").ct_state(CT_STATE_ESTABLISHED | CT_STATE_RELATED).accept());
    add(Rule::new("to_sandbox_local").drop());

    // The redirect of sandboxes that name secrets to the egress proxy,
    // mirroring from_sandbox's verdicts (see network.nft).
    add(Rule::new("inject_prerouting")
        .iifname_prefix(prefix)
        .family(V4)
        .saddr(V4)
        .in_set("inject4", id("inject4"))
        .tcp_dport(443)
        .jump("inject_out4"));
    let out = || Rule::new("inject_out4");
    add(out().family(V4).saddr(V4).daddr(V4).in_set("deny4", id("deny4")).ret());
    add(out().family(V4).daddr(V4).in_set("special4", id("special4")).ret());
    add(out().family(V4).daddr(V4).in_set("host4", id("host4")).ret());
    add(out().ct_state(CT_STATE_NEW).family(V4).saddr(V4).map("ctmark4", id("ctmark4")).ct_mark_set());
    add(out()
        .family(V4)
        .saddr(V4)
        .daddr(V4)
        .in_set("allow4", id("allow4"))
        .tcp_dport(443)
        .dnat4(v.gateway4, v.egress_port));
    add(out().family(V4).saddr(V4).in_set("listed4", id("listed4")).ret());
    add(out().family(V4).saddr(V4).in_set("default4", id("default4")).tcp_dport(443).dnat4(v.gateway4, v.egress_port));
    add(Rule::new("inject_forward")
        .iifname_prefix(prefix)
        .family(V6)
        .saddr(V6)
        .in_set("inject6", id("inject6"))
        .tcp_dport(443)
        .reject_tcp_reset());

    add(Rule::new("postrouting").iifname_prefix(prefix).oifname_not_prefix(prefix).masquerade());

    Ruleset { table: v.table.clone(), chains, sets, rules }
}

/// The host's networks and each of its addresses.
pub fn host_nets(host: &[(IpAddr, u8)]) -> Vec<(IpAddr, u8)> {
    host.iter().flat_map(|(a, l)| [(*a, *l), (*a, if a.is_ipv4() { 32 } else { 128 })]).collect()
}

fn nf_msg(ty: u16, flags: u16) -> Msg {
    let mut m = Msg::new(NFNL_SUBSYS_NFTABLES << 8 | ty, flags);
    m.bytes(&[NFPROTO_INET, 0, 0, 0]);
    m
}

fn table_msg(ty: u16, table: &str) -> Msg {
    let mut m = nf_msg(ty, 0);
    m.attr_str(NFTA_TABLE_NAME, table);
    if ty == NFT_MSG_NEWTABLE {
        m.attr_be32(NFTA_TABLE_FLAGS, 0);
    }
    m
}

fn chain_msg(table: &str, c: &Chain) -> Msg {
    let mut m = nf_msg(NFT_MSG_NEWCHAIN, NLM_F_CREATE);
    m.attr_str(NFTA_CHAIN_TABLE, table).attr_str(NFTA_CHAIN_NAME, c.name);
    if let Some(h) = c.hook {
        m.attr_str(NFTA_CHAIN_TYPE, h.kind).attr_be32(NFTA_CHAIN_POLICY, 1);
        m.nest(NFTA_CHAIN_HOOK)
            .attr_be32(NFTA_HOOK_HOOKNUM, h.hook)
            .attr_be32(NFTA_HOOK_PRIORITY, h.priority as u32)
            .end();
    }
    m
}

fn set_msg(table: &str, s: &Set, id: u32) -> Msg {
    let mut m = nf_msg(NFT_MSG_NEWSET, NLM_F_CREATE);
    m.attr_str(NFTA_SET_TABLE, table).attr_str(NFTA_SET_NAME, &s.name).attr_be32(NFTA_SET_FLAGS, s.flags);
    let key_type = s.key.iter().fold(0u32, |acc, t| acc << 6 | t.id());
    let key_len: u32 = s.key.iter().map(|t| t.len().next_multiple_of(4)).sum();
    let key_len = if s.key.len() == 1 { s.key[0].len() } else { key_len };
    m.attr_be32(NFTA_SET_KEY_TYPE, key_type).attr_be32(NFTA_SET_KEY_LEN, key_len);
    if let Some(d) = s.data {
        m.attr_be32(NFTA_SET_DATA_TYPE, d.id()).attr_be32(NFTA_SET_DATA_LEN, d.len());
    }
    m.attr_be32(NFTA_SET_ID, id);
    let concat_desc = s.flags & NFT_SET_CONCAT != 0;
    if s.size.is_some() || concat_desc {
        m.nest(NFTA_SET_DESC);
        if let Some(size) = s.size {
            m.attr_be32(NFTA_SET_DESC_SIZE, size);
        }
        if concat_desc {
            m.nest(NFTA_SET_DESC_CONCAT);
            for t in &s.key {
                m.nest(NFTA_LIST_ELEM).attr_be32(NFTA_SET_FIELD_LEN, t.len()).end();
            }
            m.end();
        }
        m.end();
    }
    if let Some(ms) = s.timeout_ms {
        m.attr_be64(NFTA_SET_TIMEOUT, ms);
    }
    m.attr(NFTA_SET_USERDATA, s.udata);
    m
}

/// Adds `elements` to a set (by name, or by `id` within the transaction).
fn elements_msg(table: &str, set: &str, id: Option<u32>, elements: &[Element]) -> Msg {
    let mut m = nf_msg(NFT_MSG_NEWSETELEM, NLM_F_CREATE);
    m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table).attr_str(NFTA_SET_ELEM_LIST_SET, set);
    if let Some(id) = id {
        m.attr_be32(NFTA_SET_ELEM_LIST_SET_ID, id);
    }
    m.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
    for e in elements {
        m.nest(NFTA_LIST_ELEM);
        if e.end {
            m.attr_be32(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
        }
        m.nest(NFTA_SET_ELEM_KEY).attr(NFTA_DATA_VALUE, &e.key).end();
        if !e.udata.is_empty() {
            m.attr(NFTA_SET_ELEM_USERDATA, e.udata);
        }
        m.end();
    }
    m.end();
    m
}

fn data_value(m: &mut Msg, ty: u16, value: &[u8]) {
    m.nest(ty).attr(NFTA_DATA_VALUE, value).end();
}

fn expr(m: &mut Msg, e: &Expr) {
    let name = match e {
        Expr::Meta { .. } | Expr::MetaSet { .. } => "meta",
        Expr::Cmp { .. } => "cmp",
        Expr::Payload { .. } => "payload",
        Expr::Bitwise { .. } => "bitwise",
        Expr::Ct { .. } | Expr::CtSet { .. } => "ct",
        Expr::Fib { .. } => "fib",
        Expr::Lookup { .. } => "lookup",
        Expr::Dynset { .. } => "dynset",
        Expr::Reject | Expr::RejectTcpReset => "reject",
        Expr::Verdict(_) | Expr::Immediate { .. } => "immediate",
        Expr::Masquerade => "masq",
        Expr::Dnat4 => "nat",
    };
    m.nest(NFTA_LIST_ELEM).attr_str(NFTA_EXPR_NAME, name).nest(NFTA_EXPR_DATA);
    match e {
        // NFTA_META_DREG 1, KEY 2, SREG 3
        Expr::Meta { key, dreg } => {
            m.attr_be32(2, *key).attr_be32(1, *dreg);
        }
        Expr::MetaSet { key, sreg } => {
            m.attr_be32(2, *key).attr_be32(3, *sreg);
        }
        // NFTA_CMP_SREG 1, OP 2, DATA 3
        Expr::Cmp { op, data } => {
            m.attr_be32(1, REG_1).attr_be32(2, *op);
            data_value(m, 3, data);
        }
        // NFTA_PAYLOAD_DREG 1, BASE 2, OFFSET 3, LEN 4
        Expr::Payload { base, offset, len, dreg } => {
            m.attr_be32(1, *dreg).attr_be32(2, *base).attr_be32(3, *offset).attr_be32(4, *len);
        }
        // NFTA_BITWISE_SREG 1, DREG 2, LEN 3, MASK 4, XOR 5
        Expr::Bitwise { len, mask, xor } => {
            m.attr_be32(1, REG_1).attr_be32(2, REG_1).attr_be32(3, *len);
            data_value(m, 4, mask);
            data_value(m, 5, xor);
        }
        // NFTA_CT_DREG 1, KEY 2, SREG 4
        Expr::Ct { key, dreg } => {
            m.attr_be32(2, *key).attr_be32(1, *dreg);
        }
        Expr::CtSet { key, sreg } => {
            m.attr_be32(2, *key).attr_be32(4, *sreg);
        }
        // NFTA_FIB_DREG 1, RESULT 2, FLAGS 3
        Expr::Fib { result, flags } => {
            m.attr_be32(3, *flags).attr_be32(2, *result).attr_be32(1, REG_1);
        }
        // NFTA_LOOKUP_SET 1, SREG 2, DREG 3, SET_ID 4
        Expr::Lookup { set, set_id, dreg } => {
            m.attr_be32(2, REG_1);
            if let Some(d) = dreg {
                m.attr_be32(3, *d);
            }
            m.attr_str(1, set).attr_be32(4, *set_id);
        }
        // NFTA_DYNSET_SET_NAME 1, SET_ID 2, OP 3, SREG_KEY 4, EXPR 7
        Expr::Dynset { set, set_id, op, stateful } => {
            m.attr_be32(4, REG_1).attr_be32(3, *op).attr_str(1, set).attr_be32(2, *set_id);
            m.nest(7);
            match stateful {
                // NFTA_CONNLIMIT_COUNT 1, FLAGS 2 (1: over)
                Stateful::ConnlimitOver(n) => {
                    m.attr_str(NFTA_EXPR_NAME, "connlimit").nest(NFTA_EXPR_DATA).attr_be32(1, *n).attr_be32(2, 1).end();
                }
                // NFTA_LIMIT_RATE 1, UNIT 2 (seconds), BURST 3, TYPE 4
                // (packets), FLAGS 5 (1: over)
                Stateful::LimitOver(r) => {
                    m.attr_str(NFTA_EXPR_NAME, "limit").nest(NFTA_EXPR_DATA);
                    m.attr_be64(1, r.per_second).attr_be64(2, 1).attr_be32(3, r.burst).attr_be32(4, 0).attr_be32(5, 1);
                    m.end();
                }
            }
            m.end();
        }
        // NFTA_REJECT_TYPE 1 (2: icmpx), ICMP_CODE 2 (3: admin-prohibited)
        Expr::Reject => {
            m.attr_be32(1, 2).attr(2, &[3]);
        }
        // NFT_REJECT_TCP_RST 1
        Expr::RejectTcpReset => {
            m.attr_be32(1, 1).attr(2, &[0]);
        }
        Expr::Immediate { dreg, data } => {
            m.attr_be32(1, *dreg);
            data_value(m, 2, data);
        }
        // NFTA_NAT_TYPE 1 (1: dnat), FAMILY 2, REG_ADDR_MIN 3,
        // REG_PROTO_MIN 5, FLAGS 7 (2: NF_NAT_RANGE_PROTO_SPECIFIED)
        Expr::Dnat4 => {
            m.attr_be32(1, 1).attr_be32(2, NFPROTO_IPV4 as u32).attr_be32(3, REG_1).attr_be32(5, REG_1 + 1);
            m.attr_be32(7, 2);
        }
        // NFTA_IMMEDIATE_DREG 1, DATA 2
        Expr::Verdict(v) => {
            m.attr_be32(1, REG_VERDICT);
            m.nest(2).nest(NFTA_DATA_VERDICT);
            match v {
                Verdict::Accept => m.attr_be32(NFTA_VERDICT_CODE, 1),
                Verdict::Drop => m.attr_be32(NFTA_VERDICT_CODE, 0),
                Verdict::Return => m.attr_be32(NFTA_VERDICT_CODE, (-5i32) as u32),
                Verdict::Jump(chain) => {
                    m.attr_be32(NFTA_VERDICT_CODE, (-3i32) as u32).attr_str(NFTA_VERDICT_CHAIN, chain)
                }
            };
            m.end().end();
        }
        Expr::Masquerade => {}
    }
    m.end().end();
}

fn rule_msg(table: &str, r: &Rule) -> Msg {
    let mut m = nf_msg(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND);
    m.attr_str(NFTA_RULE_TABLE, table).attr_str(NFTA_RULE_CHAIN, r.chain);
    m.nest(NFTA_RULE_EXPRESSIONS);
    for e in &r.exprs {
        expr(&mut m, e);
    }
    m.end();
    m
}

/// The messages of one transaction that makes the table anew: an empty
/// table made (so that deleting it never fails), deleted, and made again
/// with its chains, sets, elements and rules.
fn messages(rs: &Ruleset) -> Vec<Msg> {
    let t = rs.table.as_str();
    let mut out = vec![table_msg(NFT_MSG_NEWTABLE, t), table_msg(NFT_MSG_DELTABLE, t), table_msg(NFT_MSG_NEWTABLE, t)];
    out.extend(rs.chains.iter().map(|c| chain_msg(t, c)));
    for (i, s) in rs.sets.iter().enumerate() {
        let id = i as u32 + 1;
        out.push(set_msg(t, s, id));
        if !s.elements.is_empty() {
            out.push(elements_msg(t, &s.name, Some(id), &s.elements));
        }
    }
    let mut id = rs.sets.len() as u32;
    for (anon, r) in &rs.rules {
        for s in anon {
            id += 1;
            out.push(set_msg(t, s, id));
            out.push(elements_msg(t, &s.name, Some(id), &s.elements));
        }
        out.push(rule_msg(t, r));
    }
    out
}

/// Loads the ruleset: the table is replaced in one transaction.
pub fn load(nl: &mut Netlink, rs: &Ruleset) -> io::Result<()> {
    nl.transaction(messages(rs), &format!("load nftables table {}", rs.table))
}

/// Deletes a table; a table that is not there is not an error.
pub fn delete_table(nl: &mut Netlink, table: &str) -> io::Result<()> {
    nl.transaction(
        vec![table_msg(NFT_MSG_NEWTABLE, table), table_msg(NFT_MSG_DELTABLE, table)],
        &format!("delete nftables table {table}"),
    )
}

/// Replaces the elements of interval sets (`flush set` then `add
/// element`), in one transaction.
pub fn replace_ranges(nl: &mut Netlink, table: &str, sets: &[(&str, Vec<Element>)]) -> io::Result<()> {
    let mut msgs = Vec::new();
    for (set, elements) in sets {
        let mut flush = nf_msg(NFT_MSG_DELSETELEM, 0);
        flush.attr_str(NFTA_SET_ELEM_LIST_TABLE, table).attr_str(NFTA_SET_ELEM_LIST_SET, set);
        msgs.push(flush);
        if !elements.is_empty() {
            msgs.push(elements_msg(table, set, None, elements));
        }
    }
    nl.transaction(msgs, &format!("replace the elements of table {table}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_end_like_nfts() {
        let n = |s: &str, l: u8| (s.parse::<IpAddr>().expect("ip"), l);
        let e = interval_elements(&[n("10.0.2.15", 32), n("10.0.2.0", 24), n("224.0.0.0", 3)], true);
        let keys: Vec<(Vec<u8>, bool)> = e.iter().map(|e| (e.key.clone(), e.end)).collect();
        assert_eq!(
            keys,
            vec![
                (vec![0, 0, 0, 0], true),
                (vec![10, 0, 2, 0], false),
                (vec![10, 0, 3, 0], true),
                (vec![224, 0, 0, 0], false),
            ]
        );
        assert_eq!(e[3].udata, udata::ELEM_INTERVAL_OPEN);
        // Adjacent ranges merge; one starting at zero needs no end at zero.
        let e = interval_elements(&[n("0.0.0.0", 8), n("1.0.0.0", 8)], true);
        assert_eq!(e.len(), 2);
        assert_eq!((e[0].key.clone(), e[1].key.clone(), e[1].end), (vec![0; 4], vec![2, 0, 0, 0], true));
        assert!(interval_elements(&[n("::1", 128)], true).is_empty(), "the other family is left out");
    }

    #[test]
    fn concatenations_fill_registers_as_nft_names_them() {
        let r = Rule::new("c").family(Family::V4).saddr(Family::V4).daddr(Family::V4);
        assert!(matches!(r.exprs[3], Expr::Payload { dreg: 9, .. }), "{:?}", r.exprs);
        let r = Rule::new("c").family(Family::V6).daddr(Family::V6).mark();
        assert!(matches!(r.exprs[3], Expr::Meta { key: META_MARK, dreg: 2 }), "{:?}", r.exprs);
    }
}
