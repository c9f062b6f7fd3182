//! The resolver the daemon runs for sandboxes, at the gateway address.
//!
//! Every networked sandbox's /etc/resolv.conf names it. It answers by the
//! asking sandbox's policy (known from the query's source address, which
//! the host's rules tie to the sandbox's link): `default` egress is
//! forwarded to the host's resolvers, minus denied names; with an allow
//! list only allowed names are answered, and the addresses in the answer
//! are admitted for that sandbox before it sees them, so it can reach
//! exactly what it resolved; `private` sandboxes get no answers.
//!
//! Queries and answers are untrusted and parsed with bounds; anything
//! malformed is dropped.

use hutch_runtime::net::Network;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UdpSocket;

const MAX_MSG: usize = 4096;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Queries answered at once; more wait.
const CONCURRENCY: usize = 256;

const RCODE_NXDOMAIN: u8 = 3;
const RCODE_REFUSED: u8 = 5;
const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;

/// Called with a sandbox's id and every address admitted for it so far,
/// after new ones were admitted (the daemon stores them, so a restart
/// admits them again).
pub type OnAdmit = Arc<dyn Fn(&str, &[IpAddr]) + Send + Sync>;

/// Serves until the socket fails. Binds before returning.
pub async fn serve(net: Arc<Network>, on_admit: OnAdmit) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let addr = std::net::SocketAddrV4::new(net.config().gateway4(), 53);
    let sock = Arc::new(UdpSocket::from_std(hutch_runtime::net::bind_udp_freebind(addr)?)?);
    let permits = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    Ok(tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_MSG];
        loop {
            let (n, from) = match sock.recv_from(&mut buf).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("resolver: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = permits.clone().acquire_owned().await else { return };
            let query = buf[..n].to_vec();
            let (sock, net, on_admit) = (sock.clone(), net.clone(), on_admit.clone());
            tokio::spawn(async move {
                if let Some(reply) = answer(&net, &on_admit, from.ip(), &query).await {
                    let _ = sock.send_to(&reply, from).await;
                }
                drop(permit);
            });
        }
    }))
}

async fn answer(net: &Arc<Network>, on_admit: &OnAdmit, from: IpAddr, query: &[u8]) -> Option<Vec<u8>> {
    let q = Question::parse(query)?;
    let Some((id, policy)) = net.policy_of(from) else { return Some(refuse(query, q.end, RCODE_REFUSED)) };
    if policy.egress != hutch_runtime::net::Egress::Default {
        return Some(refuse(query, q.end, RCODE_REFUSED));
    }
    if !policy.resolves(&q.name) {
        return Some(refuse(query, q.end, RCODE_NXDOMAIN));
    }
    let reply = forward(&net.config().upstream_dns, query).await?;
    // The upstream's answer must be to this question.
    let rq = Question::parse(&reply)?;
    if reply.get(0..2) != query.get(0..2) || rq.name != q.name || rq.qtype != q.qtype {
        return None;
    }
    if policy.listed() {
        let addrs = addresses(&reply)?;
        let (net, on_admit) = (net.clone(), on_admit.clone());
        let admitted = tokio::task::spawn_blocking(move || {
            let n = net.admit(&id, &addrs)?;
            if n > 0 {
                on_admit(&id, &net.learned(&id));
            }
            Ok::<_, hutch_runtime::net::NetError>(())
        })
        .await;
        if !matches!(admitted, Ok(Ok(()))) {
            // Not admitted: an answer would point at addresses it cannot reach.
            return Some(refuse(query, q.end, RCODE_REFUSED));
        }
    }
    Some(reply)
}

async fn forward(upstreams: &[SocketAddr], query: &[u8]) -> Option<Vec<u8>> {
    for up in upstreams {
        let bind: SocketAddr =
            if up.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
        let Ok(sock) = UdpSocket::bind(bind).await else { continue };
        if sock.connect(up).await.is_err() || sock.send(query).await.is_err() {
            continue;
        }
        let mut buf = vec![0u8; MAX_MSG];
        if let Ok(Ok(n)) = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf)).await {
            buf.truncate(n);
            return Some(buf);
        }
    }
    None
}

/// The question of a query: name (lower case, no trailing dot) and type,
/// and where the question section ends.
#[derive(Debug, PartialEq)]
pub struct Question {
    pub name: String,
    pub qtype: u16,
    pub end: usize,
}

impl Question {
    /// Parses the question of a message (query or answer). Public, like
    /// [`addresses`] and [`refuse`], for the fuzz targets (fuzz/).
    pub fn parse(msg: &[u8]) -> Option<Question> {
        if msg.len() < 12 || u16::from_be_bytes([msg[4], msg[5]]) != 1 {
            return None;
        }
        let (name, off) = read_name(msg, 12)?;
        let qtype = u16::from_be_bytes([*msg.get(off)?, *msg.get(off + 1)?]);
        msg.get(off + 3)?;
        Some(Question { name, qtype, end: off + 4 })
    }
}

/// Reads a (possibly compressed) name at `off`; returns it and the offset
/// after it. Bounded: at most 128 labels and 255 bytes; pointers must go
/// backwards and stay out of the header; no label holds a dot.
fn read_name(msg: &[u8], mut off: usize) -> Option<(String, usize)> {
    let mut name = String::new();
    let mut end = None;
    let mut limit = off;
    for _ in 0..128 {
        let len = *msg.get(off)? as usize;
        if len & 0xc0 == 0xc0 {
            let ptr = (len & 0x3f) << 8 | *msg.get(off + 1)? as usize;
            // Backwards only (no loops), and never into the header.
            if ptr >= limit || ptr < 12 {
                return None;
            }
            end.get_or_insert(off + 2);
            limit = ptr;
            off = ptr;
            continue;
        }
        if len & 0xc0 != 0 {
            return None;
        }
        if len == 0 {
            return Some((name, end.unwrap_or(off + 1)));
        }
        let label = msg.get(off + 1..off + 1 + len)?;
        // A dot inside a label would read as two labels: the name a policy
        // checks would not be the name resolved.
        if label.contains(&b'.') {
            return None;
        }
        if !name.is_empty() {
            name.push('.');
        }
        name.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
        if name.len() > 255 {
            return None;
        }
        off += 1 + len;
    }
    None
}

/// The A and AAAA addresses in an answer's answer section.
pub fn addresses(msg: &[u8]) -> Option<Vec<IpAddr>> {
    let q = Question::parse(msg)?;
    let ancount = u16::from_be_bytes([msg[6], msg[7]]);
    let mut off = q.end;
    let mut out = Vec::new();
    for _ in 0..ancount {
        let (_, after) = read_name(msg, off)?;
        let h = msg.get(after..after + 10)?;
        let rtype = u16::from_be_bytes([h[0], h[1]]);
        let rdlen = u16::from_be_bytes([h[8], h[9]]) as usize;
        let rdata = msg.get(after + 10..after + 10 + rdlen)?;
        match (rtype, rdlen) {
            (TYPE_A, 4) => out.push(IpAddr::V4(Ipv4Addr::new(rdata[0], rdata[1], rdata[2], rdata[3]))),
            (TYPE_AAAA, 16) => {
                let mut o = [0u8; 16];
                o.copy_from_slice(rdata);
                out.push(IpAddr::V6(Ipv6Addr::from(o)));
            }
            _ => {}
        }
        off = after + 10 + rdlen;
    }
    Some(out)
}

/// An answer with no records and `rcode`, to the question of `query`
/// (`question_end` from [`Question::parse`] of it).
pub fn refuse(query: &[u8], question_end: usize, rcode: u8) -> Vec<u8> {
    let mut r = query[..question_end].to_vec();
    r[2] = 0x80 | (query[2] & 0x79); // QR, keep opcode and RD
    r[3] = 0x80 | rcode; // RA
    for b in &mut r[6..12] {
        *b = 0; // no answer, authority or additional records
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend(l.as_bytes());
        }
        m.push(0);
        m.extend(qtype.to_be_bytes());
        m.extend(1u16.to_be_bytes());
        m
    }

    #[test]
    fn questions_parse_and_refusals_echo_them() {
        let q = query("Allowed.Test", TYPE_A);
        let parsed = Question::parse(&q).expect("parse");
        assert_eq!((parsed.name.as_str(), parsed.qtype, parsed.end), ("allowed.test", TYPE_A, q.len()));
        let r = refuse(&q, parsed.end, RCODE_NXDOMAIN);
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(r[3] & 0x0f, RCODE_NXDOMAIN);
        assert_eq!(Question::parse(&r).expect("reparse").name, "allowed.test");
    }

    #[test]
    fn answers_yield_their_addresses_through_compression() {
        let mut m = query("a.test", TYPE_A);
        m[2] = 0x81;
        m[7] = 2; // two answers
        for (ty, data) in
            [(TYPE_A, vec![203, 0, 113, 7]), (TYPE_AAAA, vec![0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9])]
        {
            m.extend([0xc0, 12]); // pointer to the question's name
            m.extend(ty.to_be_bytes());
            m.extend(1u16.to_be_bytes());
            m.extend(60u32.to_be_bytes());
            m.extend((data.len() as u16).to_be_bytes());
            m.extend(data);
        }
        let got = addresses(&m).expect("parse");
        assert_eq!(got, vec!["203.0.113.7".parse::<IpAddr>().expect("ip"), "2001:db8::9".parse().expect("ip")]);
    }

    #[test]
    fn hostile_messages_are_dropped() {
        assert!(Question::parse(&[0; 11]).is_none(), "short");
        let mut loop_ptr = query("a.test", TYPE_A);
        loop_ptr.truncate(12);
        loop_ptr.extend([0xc0, 12, 0, 1, 0, 1]); // points at itself
        assert!(Question::parse(&loop_ptr).is_none());
        let mut truncated = query("a.test", TYPE_A);
        truncated[7] = 1; // claims an answer it lacks
        assert!(addresses(&truncated).is_none());
        let long = query(&["a"; 200].join("."), TYPE_A);
        assert!(Question::parse(&long).is_none(), "too many labels");
    }

    /// Found by fuzz/fuzz_targets/dns_message.rs: a label holding a dot
    /// read as two labels, so the name a policy checked ("x.allowed.test")
    /// was not the name resolved (label "x.allowed" under "test").
    #[test]
    fn a_label_holding_a_dot_names_nothing() {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        m.push(9);
        m.extend(b"x.allowed");
        m.push(4);
        m.extend(b"test");
        m.push(0);
        m.extend(TYPE_A.to_be_bytes());
        m.extend(1u16.to_be_bytes());
        assert_eq!(Question::parse(&m), None);
    }

    /// Found by fuzz/fuzz_targets/dns_message.rs: a compression pointer
    /// into the header read the id, flags and counts as the name, so a
    /// refusal (whose header differs) answered another question.
    #[test]
    fn a_name_is_never_read_from_the_header() {
        // Header bytes 4.. are 0, 1, 0, 0, ...: at offset 5 they read as the
        // label "\0" and the root.
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        m.extend([0xc0, 5]);
        m.extend(TYPE_A.to_be_bytes());
        m.extend(1u16.to_be_bytes());
        assert_eq!(Question::parse(&m), None);
    }
}
