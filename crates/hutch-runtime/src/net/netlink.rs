//! A small netlink client: the rtnetlink requests that give a sandbox its
//! network (a veth pair, addresses, routes, links up) and the nf_tables
//! set-element requests that admit it to a policy. No `ip` or `nft`
//! process per sandbox: each request is one message on a socket we keep.
//!
//! Messages are built into a byte buffer with the kernel's layouts
//! (`nlmsghdr`, `ifinfomsg`, `ifaddrmsg`, `rtmsg`, `nfgenmsg`, attributes
//! aligned to 4 bytes). Replies are parsed only for acknowledgements,
//! errors and the few fields we read back (link names).

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
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;

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
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_LINK: u8 = 253;
const RTN_UNICAST: u8 = 1;

/// nf_tables over nfnetlink.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
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

/// A netlink message under construction.
struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    fn new(ty: u16, flags: u16) -> Msg {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set in finish
        buf.extend_from_slice(&ty.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // sequence, set on send
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
        Msg { buf, nests: Vec::new() }
    }

    fn bytes(&mut self, b: &[u8]) -> &mut Msg {
        self.buf.extend_from_slice(b);
        self
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Msg {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    fn attr_str(&mut self, ty: u16, s: &str) -> &mut Msg {
        let mut data = s.as_bytes().to_vec();
        data.push(0);
        self.attr(ty, &data)
    }

    fn attr_u32(&mut self, ty: u16, v: u32) -> &mut Msg {
        self.attr(ty, &v.to_ne_bytes())
    }

    fn nest(&mut self, ty: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    fn end(&mut self) -> &mut Msg {
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
        let mut m = Msg::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP);
        m.bytes(&ifinfomsg(0, 0, 0, 0));
        let seq = self.next_seq();
        self.send(&m.finish(seq))?;
        let mut names = Vec::new();
        self.wait_acks(&[seq], "list links", |ty, payload| {
            if ty != RTM_NEWLINK {
                return;
            }
            if let Some((_, name)) = parse_link(payload) {
                names.push(name);
            }
        })?;
        Ok(names)
    }

    /// Adds or removes elements of nf_tables sets in one transaction: all
    /// apply or none does.
    pub fn set_elements(&mut self, family: u8, table: &str, ops: &[SetOp]) -> io::Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let mut batch = Vec::new();
        let mut seqs = Vec::new();
        let begin = self.next_seq();
        batch.extend(batch_marker(NFNL_MSG_BATCH_BEGIN).finish(begin));
        for op in ops {
            let (ty, flags) = match op.kind {
                SetOpKind::Add => (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE),
                SetOpKind::Remove => (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK),
            };
            let m = set_elem_msg(ty, flags, family, table, op);
            let seq = self.next_seq();
            seqs.push(seq);
            batch.extend(m.finish(seq));
        }
        let end = self.next_seq();
        batch.extend(batch_marker(NFNL_MSG_BATCH_END).finish(end));
        self.send(&batch)?;
        self.wait_acks(&seqs, &format!("update nftables sets of table {table}"), |_, _| {})
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

/// One netlink message of a datagram.
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
                    Some(0) => Reply::Ack,
                    Some(e) if e > 0 => Reply::Error(e),
                    // Not a negated errno (positive, or i32::MIN): not the
                    // kernel's word, so a protocol error.
                    _ => Reply::Error(libc::EPROTO),
                }
            }
            _ => Reply::Data,
        }
    }
}

/// The messages of one datagram, bounds-checked: a header whose length is
/// below 16 or past the end ends the walk with an error. Pure, so that it is
/// fuzzed (fuzz/fuzz_targets/netlink_reply.rs).
pub fn messages(buf: &[u8]) -> impl Iterator<Item = io::Result<Message<'_>>> + '_ {
    let mut off = 0usize;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || off + 16 > buf.len() {
            return None;
        }
        let word = |at: usize| u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
        let len = word(off) as usize;
        if len < 16 || off + len > buf.len() {
            failed = true;
            return Some(Err(io::Error::new(io::ErrorKind::InvalidData, "malformed netlink reply")));
        }
        let msg = Message {
            ty: u16::from_ne_bytes([buf[off + 4], buf[off + 5]]),
            seq: word(off + 8),
            payload: &buf[off + 16..off + len],
        };
        off += (len + 3) & !3;
        Some(Ok(msg))
    })
}

/// A link from an `RTM_NEWLINK` payload: (index, name). Pure, for fuzzing.
pub fn parse_link(payload: &[u8]) -> Option<(u32, String)> {
    let hdr = payload.get(0..16)?;
    let index = i32::from_ne_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let name = Attrs(&payload[16..]).find(|(ty, _)| *ty == IFLA_IFNAME).map(|(_, data)| {
        let end = data.iter().position(|b| *b == 0).unwrap_or(data.len());
        String::from_utf8_lossy(&data[..end]).into_owned()
    })?;
    Some((u32::try_from(index).ok()?, name))
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

    /// Found by fuzz/fuzz_targets/netlink_reply.rs: an error reply's errno
    /// was negated as it came, so i32::MIN overflowed (a panic with debug
    /// assertions) and a positive one became a negative "OS error".
    #[test]
    fn error_replies_are_positive_errnos_whatever_the_word_holds() {
        let error = |word: i32| {
            let payload = word.to_ne_bytes();
            Message { ty: NLMSG_ERROR, seq: 1, payload: &payload }.reply()
        };
        assert_eq!(error(0), Reply::Ack);
        assert_eq!(error(-libc::EEXIST), Reply::Error(libc::EEXIST));
        assert_eq!(error(i32::MIN), Reply::Error(libc::EPROTO));
        assert_eq!(error(4096), Reply::Error(libc::EPROTO));
        assert_eq!(Message { ty: NLMSG_ERROR, seq: 1, payload: &[] }.reply(), Reply::Ack);
        assert_eq!(Message { ty: NLMSG_DONE, seq: 1, payload: &[] }.reply(), Reply::Ack);
        assert_eq!(Message { ty: RTM_NEWLINK, seq: 1, payload: &[] }.reply(), Reply::Data);
    }

    #[test]
    fn messages_stop_at_a_malformed_header() {
        let mut buf = Vec::new();
        for (ty, len) in [(NLMSG_DONE, 20u32), (RTM_NEWLINK, 8)] {
            buf.extend(len.to_ne_bytes());
            buf.extend(ty.to_ne_bytes());
            buf.extend([0u8; 10]);
            buf.extend([0u8; 4]);
        }
        let got: Vec<_> = messages(&buf).map(|m| m.map(|m| m.ty).map_err(|e| e.kind())).collect();
        assert_eq!(got, vec![Ok(NLMSG_DONE), Err(io::ErrorKind::InvalidData)]);
    }

    #[test]
    fn attribute_iterator_stops_at_garbage() {
        assert_eq!(Attrs(&[8, 0, 1, 0, 1, 2]).count(), 0, "length past the end");
        assert_eq!(Attrs(&[2, 0, 1, 0]).count(), 0, "length below the header");
    }
}
