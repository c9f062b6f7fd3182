//! A small netlink client: the rtnetlink requests that give a sandbox its
//! network (a veth pair, addresses, routes, links up) and the nf_tables
//! set-element requests that admit it to a policy. No `ip` or `nft`
//! process per sandbox: each request is one message on a socket we keep.
//!
//! Messages are built into a byte buffer with the kernel's layouts
//! (`nlmsghdr`, `ifinfomsg`, `ifaddrmsg`, `rtmsg`, `nfgenmsg`, attributes
//! aligned to 4 bytes). Replies are parsed only for acknowledgements,
//! errors and the few fields we read back (links, addresses, routes), by
//! pure functions over byte slices (`messages`, `Attrs`, `parse_link`,
//! `parse_addr`, `parse_route`): they are bounds-checked and fuzzable.
//!
//! Also: a socket subscribed to the host's address and route changes
//! (`Netlink::subscribe`), and the conntrack flush of one sandbox's flows
//! (`flush_conntrack`, over ctnetlink).

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_ROOT: u16 = 0x100;
const NLM_F_MATCH: u16 = 0x200;
const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_REPLACE: u16 = 0x100;
const NLA_F_NESTED: u16 = 0x8000;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
pub const RTM_NEWADDR: u16 = 20;
pub const RTM_DELADDR: u16 = 21;
const RTM_GETADDR: u16 = 22;
pub const RTM_NEWROUTE: u16 = 24;
pub const RTM_DELROUTE: u16 = 25;
const RTM_GETROUTE: u16 = 26;

/// Multicast groups of rtnetlink: address and route changes.
pub const RTMGRP_IPV4_IFADDR: u32 = 0x10;
pub const RTMGRP_IPV4_ROUTE: u32 = 0x40;
pub const RTMGRP_IPV6_IFADDR: u32 = 0x100;
pub const RTMGRP_IPV6_ROUTE: u32 = 0x400;

const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_MTU: u16 = 4;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;

const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
const IFA_F_NODAD: u32 = 0x02;

const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_MULTIPATH: u16 = 9;
const RTA_TABLE: u16 = 15;
const RTA_VIA: u16 = 18;
pub const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
pub const RT_SCOPE_LINK: u8 = 253;
pub const RTN_UNICAST: u8 = 1;

/// ctnetlink: flush the conntrack entries of one mark.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_MARK: u16 = 8;
const CTA_MARK_MASK: u16 = 21;

/// nf_tables over nfnetlink.
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;
pub const NFPROTO_INET: u8 = 1;

/// Replies larger than this are not ours to read.
const RECV_BUF: usize = 64 * 1024;
/// Set elements in one nf_tables transaction (about 120 bytes each, and
/// an acknowledgement each).
const BATCH: usize = 256;

/// A netlink message under construction.
pub(super) struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    pub(super) fn new(ty: u16, flags: u16) -> Msg {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set in finish
        buf.extend_from_slice(&ty.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // sequence, set on send
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
        Msg { buf, nests: Vec::new() }
    }

    pub(super) fn bytes(&mut self, b: &[u8]) -> &mut Msg {
        self.buf.extend_from_slice(b);
        self
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    pub(super) fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Msg {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    pub(super) fn attr_str(&mut self, ty: u16, s: &str) -> &mut Msg {
        let mut data = s.as_bytes().to_vec();
        data.push(0);
        self.attr(ty, &data)
    }

    fn attr_u32(&mut self, ty: u16, v: u32) -> &mut Msg {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// A 32-bit value in network order (nf_tables' integers).
    pub(super) fn attr_be32(&mut self, ty: u16, v: u32) -> &mut Msg {
        self.attr(ty, &v.to_be_bytes())
    }

    pub(super) fn attr_be64(&mut self, ty: u16, v: u64) -> &mut Msg {
        self.attr(ty, &v.to_be_bytes())
    }

    pub(super) fn nest(&mut self, ty: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub(super) fn end(&mut self) -> &mut Msg {
        if let Some(start) = self.nests.pop() {
            let len = (self.buf.len() - start) as u16;
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    fn finish(mut self, seq: u32) -> Vec<u8> {
        debug_assert!(self.nests.is_empty(), "unclosed netlink nest");
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        self.buf
    }
}

fn ifinfomsg(family: u8, index: i32, flags: u32, change: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0] = family;
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b[8..12].copy_from_slice(&flags.to_ne_bytes());
    b[12..16].copy_from_slice(&change.to_ne_bytes());
    b
}

fn family(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

fn octets(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// A netlink socket of one protocol, bound to the network namespace of the
/// thread that opened it (a socket keeps its namespace for life).
#[derive(Debug)]
pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

impl Netlink {
    pub fn route() -> io::Result<Netlink> {
        Netlink::open(libc::NETLINK_ROUTE)
    }

    pub fn netfilter() -> io::Result<Netlink> {
        Netlink::open(libc::NETLINK_NETFILTER)
    }

    fn open(protocol: libc::c_int) -> io::Result<Netlink> {
        // SAFETY: plain socket(2); the result is checked and owned below.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Extended acks name the attribute a request got wrong; best effort.
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with a pointer to a live c_int and its size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_NETLINK,
                libc::NETLINK_EXT_ACK,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        Ok(Netlink { fd, seq: 1 })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    fn send(&self, buf: &[u8]) -> io::Result<()> {
        // SAFETY: the kernel reads buf.len() bytes from a live slice.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), buf.as_ptr() as *const libc::c_void, buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != buf.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short netlink send"));
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: the kernel writes at most buf.len() bytes into buf.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Sends one request and waits for its acknowledgement.
    fn call(&mut self, msg: Msg, what: &str) -> io::Result<()> {
        let seq = self.next_seq();
        self.send(&msg.finish(seq))?;
        self.wait_acks(&[seq], what, |_, _| {})
    }

    /// Reads replies until every sequence number in `seqs` was acknowledged
    /// or one failed. Other messages go to `on_msg(type, payload)`.
    fn wait_acks(&self, seqs: &[u32], what: &str, mut on_msg: impl FnMut(u16, &[u8])) -> io::Result<()> {
        let mut pending: Vec<u32> = seqs.to_vec();
        let mut buf = vec![0u8; RECV_BUF];
        while !pending.is_empty() {
            let n = self.recv(&mut buf)?;
            for msg in messages(&buf[..n]) {
                let msg = msg?;
                // A reply to an earlier request (the rest of a batch that
                // failed part way) is not ours to act on.
                if !seqs.contains(&msg.seq) {
                    continue;
                }
                match msg.reply() {
                    Reply::Ack => pending.retain(|s| *s != msg.seq),
                    Reply::Error(errno) => {
                        let e = io::Error::from_raw_os_error(errno);
                        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
                    }
                    Reply::Data => on_msg(msg.ty, msg.payload),
                }
            }
        }
        Ok(())
    }

    /// Creates a veth pair: `host` stays here, `peer` is moved into the
    /// network namespace `netns` (and renamed there).
    pub fn add_veth(&mut self, host: &str, peer: &str, netns: &OwnedFd, mtu: u32) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
        m.bytes(&ifinfomsg(0, 0, 0, 0)).attr_str(IFLA_IFNAME, host).attr_u32(IFLA_MTU, mtu);
        m.nest(IFLA_LINKINFO).attr_str(IFLA_INFO_KIND, "veth");
        m.nest(IFLA_INFO_DATA).nest(VETH_INFO_PEER);
        m.bytes(&ifinfomsg(0, 0, 0, 0)).attr_str(IFLA_IFNAME, peer).attr_u32(IFLA_MTU, mtu);
        m.attr_u32(IFLA_NET_NS_FD, netns.as_raw_fd() as u32);
        m.end().end().end();
        self.call(m, &format!("create veth {host}"))
    }

    /// Brings a link up.
    pub fn link_up(&mut self, index: u32) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.bytes(&ifinfomsg(0, index as i32, libc::IFF_UP as u32, libc::IFF_UP as u32));
        self.call(m, &format!("set link {index} up"))
    }

    /// Creates a link of a kind that needs no options (`dummy`).
    pub fn add_link(&mut self, name: &str, kind: &str) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE);
        m.bytes(&ifinfomsg(0, 0, 0, 0)).attr_str(IFLA_IFNAME, name);
        m.nest(IFLA_LINKINFO).attr_str(IFLA_INFO_KIND, kind).end();
        self.call(m, &format!("create {kind} link {name}"))
    }

    /// Sets a link's hardware address.
    pub fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.bytes(&ifinfomsg(0, index as i32, 0, 0)).attr(IFLA_ADDRESS, &mac);
        self.call(m, &format!("set address of link {index}"))
    }

    pub fn del_link(&mut self, index: u32) -> io::Result<()> {
        let mut m = Msg::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.bytes(&ifinfomsg(0, index as i32, 0, 0));
        self.call(m, &format!("delete link {index}"))
    }

    /// Adds `addr/prefix` to a link, without duplicate address detection
    /// (the address is ours alone; DAD would hold an IPv6 address back ~1 s).
    pub fn add_addr(&mut self, index: u32, addr: IpAddr, prefix: u8) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWADDR, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE);
        let mut hdr = [0u8; 8];
        hdr[0] = family(addr);
        hdr[1] = prefix;
        hdr[2] = IFA_F_NODAD as u8;
        hdr[4..8].copy_from_slice(&index.to_ne_bytes());
        m.bytes(&hdr);
        let o = octets(addr);
        if addr.is_ipv4() {
            m.attr(IFA_LOCAL, &o);
        }
        m.attr(IFA_ADDRESS, &o).attr_u32(IFA_FLAGS, IFA_F_NODAD);
        self.call(m, &format!("add address {addr}/{prefix} to link {index}"))
    }

    /// Adds (or replaces) a route to `dst/prefix` out of link `oif`, through
    /// `via` when given, on the link itself otherwise.
    pub fn add_route(&mut self, dst: IpAddr, prefix: u8, oif: u32, via: Option<IpAddr>) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWROUTE, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE);
        let scope = if via.is_some() { RT_SCOPE_UNIVERSE } else { RT_SCOPE_LINK };
        let mut hdr = [0u8; 12];
        hdr[0] = family(dst);
        hdr[1] = prefix;
        hdr[4] = RT_TABLE_MAIN;
        hdr[5] = RTPROT_BOOT;
        hdr[6] = scope;
        hdr[7] = RTN_UNICAST;
        m.bytes(&hdr);
        if prefix > 0 {
            m.attr(RTA_DST, &octets(dst));
        }
        if let Some(gw) = via {
            m.attr(RTA_GATEWAY, &octets(gw));
        }
        m.attr_u32(RTA_OIF, oif);
        self.call(m, &format!("add route {dst}/{prefix} via link {oif}"))
    }

    /// Names of every link in this socket's network namespace.
    pub fn link_names(&mut self) -> io::Result<Vec<String>> {
        Ok(self.links()?.into_iter().map(|(_, name)| name).collect())
    }

    /// Every link in this socket's network namespace: (index, name).
    pub fn links(&mut self) -> io::Result<Vec<(u32, String)>> {
        let mut m = Msg::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP);
        m.bytes(&ifinfomsg(0, 0, 0, 0));
        Ok(self
            .dump(m, "list links")?
            .iter()
            .filter_map(|(ty, p)| (*ty == RTM_NEWLINK).then(|| parse_link(p)).flatten())
            .collect())
    }

    /// Every address of every link (both families).
    pub fn addresses(&mut self) -> io::Result<Vec<AddrMsg>> {
        let mut m = Msg::new(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP);
        m.bytes(&[0u8; 8]);
        Ok(self
            .dump(m, "list addresses")?
            .iter()
            .filter_map(|(ty, p)| (*ty == RTM_NEWADDR).then(|| parse_addr(p)).flatten())
            .collect())
    }

    /// Every route of every table (both families).
    pub fn routes(&mut self) -> io::Result<Vec<RouteMsg>> {
        let mut m = Msg::new(RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP);
        m.bytes(&[0u8; 12]);
        Ok(self
            .dump(m, "list routes")?
            .iter()
            .filter_map(|(ty, p)| (*ty == RTM_NEWROUTE).then(|| parse_route(p)).flatten())
            .collect())
    }

    /// Sends a dump request; answers every message of the reply.
    fn dump(&mut self, m: Msg, what: &str) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let seq = self.next_seq();
        self.send(&m.finish(seq))?;
        let mut out = Vec::new();
        self.wait_acks(&[seq], what, |ty, payload| out.push((ty, payload.to_vec())))?;
        Ok(out)
    }

    /// A socket that receives the host's address and route changes
    /// (`groups`: RTMGRP_* bits). Reads wait at most `timeout`.
    pub fn subscribe(groups: u32, timeout: std::time::Duration) -> io::Result<Netlink> {
        let nl = Netlink::open(libc::NETLINK_ROUTE)?;
        // SAFETY: sockaddr_nl is plain old data; zero is a valid value.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        sa.nl_groups = groups;
        // SAFETY: bind reads a sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                nl.fd.as_raw_fd(),
                &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: setsockopt reads a live timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                nl.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(nl)
    }

    /// Reads one datagram of notifications into `buf` (a subscribed
    /// socket). `WouldBlock` after the timeout; `ENOBUFS` when the kernel
    /// dropped some (the reader must then read the whole state again).
    pub fn recv_notifications(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf)
    }

    /// Forgets every tracked flow (conntrack entry) whose mark is `mark`,
    /// in every family. Nothing to forget is not an error.
    pub fn flush_conntrack(&mut self, mark: u32) -> io::Result<()> {
        let mut m = Msg::new(NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK);
        m.bytes(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
        m.attr(CTA_MARK, &mark.to_be_bytes()).attr(CTA_MARK_MASK, &u32::MAX.to_be_bytes());
        match self.call(m, &format!("flush conntrack mark {mark:#x}")) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            other => other,
        }
    }

    /// Adds or removes elements of nf_tables sets: all apply or none does.
    /// One transaction holds at most `BATCH` elements (a socket's send
    /// buffer bounds a message, and each element is acknowledged); when a
    /// later transaction fails, the earlier ones are undone.
    pub fn set_elements(&mut self, family: u8, table: &str, ops: &[SetOp]) -> io::Result<()> {
        for (i, chunk) in ops.chunks(BATCH).enumerate() {
            if let Err(e) = self.set_elements_once(family, table, chunk) {
                let undo: Vec<SetOp> = ops[..i * BATCH].iter().rev().map(SetOp::inverse).collect();
                for part in undo.chunks(BATCH) {
                    let _ = self.set_elements_once(family, table, part);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// One transaction.
    fn set_elements_once(&mut self, family: u8, table: &str, ops: &[SetOp]) -> io::Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let msgs = ops
            .iter()
            .map(|op| {
                let (ty, flags) = match op.kind {
                    SetOpKind::Add => (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE),
                    SetOpKind::Remove => (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK),
                };
                set_elem_msg(ty, flags, family, table, op)
            })
            .collect();
        self.transaction(msgs, &format!("update nftables sets of table {table}"))
    }

    /// Sends nf_tables messages (`NFNL_SUBSYS_NFTABLES << 8 | type`, each
    /// with its `nfgenmsg`) as one transaction: the kernel applies all of
    /// them or none. Each is acknowledged; the first error is answered.
    pub(super) fn transaction(&mut self, msgs: Vec<Msg>, what: &str) -> io::Result<()> {
        let mut batch = Vec::new();
        let mut seqs = Vec::new();
        let begin = self.next_seq();
        batch.extend(batch_marker(NFNL_MSG_BATCH_BEGIN).finish(begin));
        for mut m in msgs {
            let flags = u16::from_ne_bytes([m.buf[6], m.buf[7]]) | NLM_F_REQUEST | NLM_F_ACK;
            m.buf[6..8].copy_from_slice(&flags.to_ne_bytes());
            let seq = self.next_seq();
            seqs.push(seq);
            batch.extend(m.finish(seq));
        }
        let end = self.next_seq();
        batch.extend(batch_marker(NFNL_MSG_BATCH_END).finish(end));
        self.send(&batch)?;
        self.wait_acks(&seqs, what, |_, _| {})
    }

    /// Whether an element is in a set (for reading back what is applied).
    pub fn has_element(&mut self, family: u8, table: &str, set: &str, key: &[u8]) -> io::Result<bool> {
        let op = SetOp { kind: SetOpKind::Add, set: set.to_owned(), key: key.to_vec(), ..SetOp::default() };
        let m = set_elem_msg(NFT_MSG_GETSETELEM, NLM_F_REQUEST | NLM_F_ACK, family, table, &op);
        let seq = self.next_seq();
        self.send(&m.finish(seq))?;
        let mut found = false;
        match self.wait_acks(&[seq], "read an nftables set", |ty, _| {
            if ty == (NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWSETELEM) {
                found = true;
            }
        }) {
            Ok(()) => Ok(found),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) || e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn batch_marker(ty: u16) -> Msg {
    let mut m = Msg::new(ty, NLM_F_REQUEST);
    m.bytes(&[libc::AF_UNSPEC as u8, 0]).bytes(&NFNL_SUBSYS_NFTABLES.to_be_bytes());
    m
}

fn set_elem_msg(ty: u16, flags: u16, family: u8, table: &str, op: &SetOp) -> Msg {
    let mut m = Msg::new(NFNL_SUBSYS_NFTABLES << 8 | ty, flags);
    m.bytes(&[family, 0, 0, 0]);
    m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table).attr_str(NFTA_SET_ELEM_LIST_SET, &op.set);
    m.nest(NFTA_SET_ELEM_LIST_ELEMENTS).nest(NFTA_LIST_ELEM);
    m.nest(NFTA_SET_ELEM_KEY).attr(NFTA_DATA_VALUE, &op.key).end();
    if let Some(end) = &op.key_end {
        m.nest(NFTA_SET_ELEM_KEY_END).attr(NFTA_DATA_VALUE, end).end();
    }
    if let Some(data) = &op.data {
        m.nest(NFTA_SET_ELEM_DATA).attr(NFTA_DATA_VALUE, data).end();
    }
    if let Some(ms) = op.timeout_ms {
        m.attr(NFTA_SET_ELEM_TIMEOUT, &ms.to_be_bytes());
    }
    m.end().end();
    m
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SetOpKind {
    #[default]
    Add,
    Remove,
}

/// One element added to or removed from an nf_tables set or map. Keys are
/// in the set's own layout: addresses in network order, marks in host
/// order, each part of a concatenation padded to 4 bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetOp {
    pub kind: SetOpKind,
    pub set: String,
    pub key: Vec<u8>,
    /// The end of a range, for sets with `flags interval` on concatenations.
    pub key_end: Option<Vec<u8>>,
    /// The value, for maps.
    pub data: Option<Vec<u8>>,
    /// For sets with `flags timeout`.
    pub timeout_ms: Option<u64>,
}

/// One netlink message in a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    pub ty: u16,
    pub seq: u32,
    pub payload: &'a [u8],
}

/// What a message says about the request it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// `NLMSG_ERROR` with 0, or `NLMSG_DONE`: the request is complete.
    Ack,
    /// `NLMSG_ERROR` with this errno (positive).
    Error(i32),
    /// Anything else: data for the caller.
    Data,
}

impl Message<'_> {
    pub fn reply(&self) -> Reply {
        match self.ty {
            NLMSG_DONE => Reply::Ack,
            NLMSG_ERROR => {
                let errno = self.payload.get(0..4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]])).unwrap_or(0);
                match errno.checked_neg() {
                    Some(0) | None => Reply::Ack,
                    Some(e) if e > 0 => Reply::Error(e),
                    // A positive "errno" is not the kernel's: say so.
                    Some(_) => Reply::Error(libc::EPROTO),
                }
            }
            _ => Reply::Data,
        }
    }
}

/// The messages of one datagram, bounds-checked: a header whose length is
/// below 16 or past the end ends the walk with an error. Pure: for fuzzing.
pub fn messages(buf: &[u8]) -> impl Iterator<Item = io::Result<Message<'_>>> + '_ {
    let mut off = 0usize;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || off + 16 > buf.len() {
            return None;
        }
        let word = |at: usize| u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
        let len = word(off) as usize;
        if len < 16 || len > buf.len() - off {
            failed = true;
            return Some(Err(io::Error::new(io::ErrorKind::InvalidData, "malformed netlink reply")));
        }
        let msg = Message {
            ty: u16::from_ne_bytes([buf[off + 4], buf[off + 5]]),
            seq: word(off + 8),
            payload: &buf[off + 16..off + len],
        };
        off = off.saturating_add((len + 3) & !3);
        Some(Ok(msg))
    })
}

/// A link from an `RTM_NEWLINK` payload: (index, name). Pure: for fuzzing.
pub fn parse_link(payload: &[u8]) -> Option<(u32, String)> {
    let hdr = payload.get(0..16)?;
    let index = i32::from_ne_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let name = Attrs(&payload[16..]).find(|(ty, _)| *ty == IFLA_IFNAME).map(|(_, data)| {
        let end = data.iter().position(|b| *b == 0).unwrap_or(data.len());
        String::from_utf8_lossy(&data[..end]).into_owned()
    })?;
    Some((u32::try_from(index).ok()?, name))
}

/// An address of a link, from an `RTM_NEWADDR`/`RTM_DELADDR` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddrMsg {
    pub index: u32,
    pub prefix: u8,
    pub addr: IpAddr,
}

/// Pure: for fuzzing. The local address (`IFA_LOCAL`, else `IFA_ADDRESS`).
pub fn parse_addr(payload: &[u8]) -> Option<AddrMsg> {
    let hdr = payload.get(0..8)?;
    let family = hdr[0] as i32;
    let prefix = hdr[1];
    let index = u32::from_ne_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let (mut local, mut address) = (None, None);
    for (ty, data) in Attrs(&payload[8..]) {
        match ty {
            IFA_LOCAL => local = ip_of(family, data),
            IFA_ADDRESS => address = ip_of(family, data),
            _ => {}
        }
    }
    let addr = local.or(address)?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (prefix <= max).then_some(AddrMsg { index, prefix, addr })
}

/// A route, from an `RTM_NEWROUTE`/`RTM_DELROUTE` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMsg {
    /// The destination; the family's unspecified address for a default route.
    pub dst: IpAddr,
    pub dst_len: u8,
    pub table: u32,
    pub scope: u8,
    pub kind: u8,
    pub oif: Option<u32>,
    /// Through a gateway (or several): not a network the host is on.
    pub via_gateway: bool,
}

/// Pure: for fuzzing.
pub fn parse_route(payload: &[u8]) -> Option<RouteMsg> {
    let hdr = payload.get(0..12)?;
    let family = hdr[0] as i32;
    let unspecified = match family {
        libc::AF_INET => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        libc::AF_INET6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        _ => return None,
    };
    let mut r = RouteMsg {
        dst: unspecified,
        dst_len: hdr[1],
        table: hdr[4] as u32,
        scope: hdr[6],
        kind: hdr[7],
        oif: None,
        via_gateway: false,
    };
    for (ty, data) in Attrs(&payload[12..]) {
        match ty {
            RTA_DST => r.dst = ip_of(family, data)?,
            RTA_OIF => r.oif = data.get(0..4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
            RTA_TABLE => {
                if let Some(b) = data.get(0..4) {
                    r.table = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            RTA_GATEWAY | RTA_VIA | RTA_MULTIPATH => r.via_gateway = true,
            _ => {}
        }
    }
    let max = if r.dst.is_ipv4() { 32 } else { 128 };
    (r.dst_len <= max).then_some(r)
}

fn ip_of(family: i32, data: &[u8]) -> Option<IpAddr> {
    match family {
        libc::AF_INET => {
            let b: [u8; 4] = data.get(0..4)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        libc::AF_INET6 => {
            let b: [u8; 16] = data.get(0..16)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        _ => None,
    }
}

impl SetOp {
    /// The operation that undoes this one.
    pub fn inverse(&self) -> SetOp {
        let kind = match self.kind {
            SetOpKind::Add => SetOpKind::Remove,
            SetOpKind::Remove => SetOpKind::Add,
        };
        SetOp { kind, ..self.clone() }
    }
}

/// Iterates the attributes in a payload, bounds-checked.
pub struct Attrs<'a>(pub &'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([self.0[0], self.0[1]]) as usize;
        let ty = u16::from_ne_bytes([self.0[2], self.0[3]]) & !NLA_F_NESTED;
        if len < 4 || len > self.0.len() {
            return None;
        }
        let data = &self.0[4..len];
        let next = ((len + 3) & !3).min(self.0.len());
        self.0 = &self.0[next..];
        Some((ty, data))
    }
}

/// The index of a link in the calling thread's network namespace.
pub fn link_index(name: &str) -> io::Result<u32> {
    let c = crate::launch::cstr(name)?;
    // SAFETY: c is a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        return Err(io::Error::new(io::Error::last_os_error().kind(), format!("no link named {name}")));
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `RTM_NEWLINK` payload: ifinfomsg, then attributes.
    fn link_payload(index: i32, name: &str, attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut p = ifinfomsg(0, index, 0, 0).to_vec();
        let mut name = name.as_bytes().to_vec();
        name.push(0);
        for (ty, data) in std::iter::once(&(IFLA_IFNAME, name)).chain(attrs) {
            p.extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
            p.extend_from_slice(&ty.to_ne_bytes());
            p.extend_from_slice(data);
            while !p.len().is_multiple_of(4) {
                p.push(0);
            }
        }
        p
    }

    #[test]
    fn links_give_their_index_and_name() {
        assert_eq!(parse_link(&link_payload(3, "hv1", &[])), Some((3, "hv1".to_owned())));
        assert_eq!(parse_link(&link_payload(-1, "hv1", &[])), None, "a negative index is no link");
        assert_eq!(parse_link(&ifinfomsg(0, 3, 0, 0)), None, "a link without a name");
        assert_eq!(parse_link(&[0u8; 8]), None, "shorter than ifinfomsg");
    }

    #[test]
    fn nested_attributes_carry_their_length() {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST);
        m.nest(IFLA_LINKINFO).attr_str(IFLA_INFO_KIND, "veth").end();
        let buf = m.finish(7);
        assert_eq!(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize, buf.len());
        assert_eq!(u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]), 7);
        // nest header: 4 + inner attribute (4 + "veth\0" = 9, padded to 12)
        assert_eq!(u16::from_ne_bytes([buf[16], buf[17]]), 16);
        assert_eq!(u16::from_ne_bytes([buf[18], buf[19]]), IFLA_LINKINFO | NLA_F_NESTED);
        let inner: Vec<_> = Attrs(&buf[20..]).collect();
        assert_eq!(inner, vec![(IFLA_INFO_KIND, &b"veth\0"[..])]);
    }

    fn nlmsg(ty: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = Msg::new(ty, 0);
        m.bytes(payload);
        m.finish(seq)
    }

    #[test]
    fn replies_split_into_messages_and_stop_at_garbage() {
        let mut buf = nlmsg(RTM_NEWLINK, 5, &[1, 2, 3, 4]);
        buf.extend(nlmsg(NLMSG_ERROR, 5, &(-libc::EEXIST).to_ne_bytes()));
        buf.extend(nlmsg(NLMSG_DONE, 6, &[0; 4]));
        let msgs: Vec<_> = messages(&buf).collect::<io::Result<_>>().expect("parse");
        assert_eq!(msgs.len(), 3);
        assert_eq!((msgs[0].ty, msgs[0].seq, msgs[0].payload), (RTM_NEWLINK, 5, &[1u8, 2, 3, 4][..]));
        assert_eq!(msgs[0].reply(), Reply::Data);
        assert_eq!(msgs[1].reply(), Reply::Error(libc::EEXIST));
        assert_eq!(msgs[2].reply(), Reply::Ack);
        let mut bad = nlmsg(RTM_NEWLINK, 1, &[]);
        bad[0] = 200; // longer than the datagram
        assert!(messages(&bad).next().expect("one").is_err());
        bad[0..4].copy_from_slice(&8u32.to_ne_bytes()); // shorter than a header
        assert!(messages(&bad).next().expect("one").is_err());
        let mut positive = nlmsg(NLMSG_ERROR, 1, &5i32.to_ne_bytes());
        assert_eq!(messages(&positive).next().expect("one").expect("ok").reply(), Reply::Error(libc::EPROTO));
        positive.truncate(17);
        assert_eq!(messages(&positive).count(), 1, "a torn datagram yields what is whole, then an error");
    }

    #[test]
    fn addresses_routes_and_links_parse_from_their_payloads() {
        let mut m = Msg::new(RTM_NEWADDR, 0);
        m.bytes(&[libc::AF_INET as u8, 24, 0, 0]).bytes(&7u32.to_ne_bytes());
        m.attr(IFA_ADDRESS, &[192, 0, 2, 9]).attr(IFA_LOCAL, &[192, 0, 2, 10]);
        let buf = m.finish(1);
        let a = parse_addr(&buf[16..]).expect("addr");
        assert_eq!(a, AddrMsg { index: 7, prefix: 24, addr: "192.0.2.10".parse().expect("ip") });
        let mut m = Msg::new(RTM_NEWROUTE, 0);
        m.bytes(&[libc::AF_INET6 as u8, 64, 0, 0, RT_TABLE_MAIN, 2, RT_SCOPE_LINK, RTN_UNICAST, 0, 0, 0, 0]);
        m.attr(RTA_DST, &"2001:db8::".parse::<std::net::Ipv6Addr>().expect("ip").octets()).attr_u32(RTA_OIF, 3);
        let buf = m.finish(1);
        let r = parse_route(&buf[16..]).expect("route");
        assert_eq!(
            (r.dst.to_string(), r.dst_len, r.table, r.oif, r.via_gateway),
            ("2001:db8::".into(), 64, 254, Some(3), false)
        );
        let mut m = Msg::new(RTM_NEWLINK, 0);
        m.bytes(&ifinfomsg(0, 9, 0, 0)).attr_str(IFLA_IFNAME, "eth1");
        let buf = m.finish(1);
        assert_eq!(parse_link(&buf[16..]), Some((9, "eth1".to_owned())));
        // Truncated or inconsistent payloads give nothing.
        assert!(parse_addr(&[2, 24, 0]).is_none());
        assert!(parse_addr(&[2, 33, 0, 0, 1, 0, 0, 0, 8, 0, 2, 0, 1, 2, 3, 4]).is_none(), "prefix past 32");
        assert!(parse_addr(&[2, 24, 0, 0, 1, 0, 0, 0, 6, 0, 2, 0, 1, 2]).is_none(), "address too short");
        assert!(parse_route(&[99; 12]).is_none(), "unknown family");
        assert!(parse_link(&[0; 15]).is_none());
    }

    /// Mutated replies never panic the parsers (a smoke test until the
    /// fuzz targets run: deterministic, bounded).
    #[test]
    fn mutated_replies_never_panic() {
        let mut m = Msg::new(RTM_NEWROUTE, 0);
        m.bytes(&[libc::AF_INET as u8, 24, 0, 0, RT_TABLE_MAIN, 2, RT_SCOPE_LINK, RTN_UNICAST, 0, 0, 0, 0]);
        m.attr(RTA_DST, &[10, 8, 0, 0]).attr_u32(RTA_OIF, 3).attr_u32(RTA_TABLE, 254);
        let seed = m.finish(1);
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let mut b = seed.clone();
            for _ in 0..(rand() % 4 + 1) {
                if b.is_empty() {
                    break;
                }
                let at = (rand() as usize) % b.len();
                match rand() % 3 {
                    0 => b[at] = rand() as u8,
                    1 => b.truncate(at),
                    _ => b.insert(at, rand() as u8),
                }
            }
            for msg in messages(&b).flatten() {
                let _ = msg.reply();
                let _ = (parse_route(msg.payload), parse_addr(msg.payload), parse_link(msg.payload));
            }
            let payload = b.get(16..).unwrap_or_default();
            let _ = (parse_route(payload), parse_addr(payload), parse_link(payload), Attrs(payload).count());
        }
    }

    #[test]
    fn attribute_iterator_stops_at_garbage() {
        assert_eq!(Attrs(&[8, 0, 1, 0, 1, 2]).count(), 0, "length past the end");
        assert_eq!(Attrs(&[2, 0, 1, 0]).count(), 0, "length below the header");
    }
}
