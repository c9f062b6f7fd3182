//! The resolver the daemon runs for sandboxes, at the gateway address.
//!
//! Every networked sandbox's /etc/resolv.conf names it. It answers by the
//! asking sandbox's policy (known from the query's source address, which
//! the host's rules tie to the sandbox's link): `default` egress is
//! forwarded to the host's resolvers, minus denied names; with an allow
//! list only allowed names are answered, and the addresses that answer the
//! question are admitted for that sandbox (for their TTL, within bounds)
//! before it sees them, so it can reach exactly what it resolved;
//! `private` sandboxes get no answers.
//!
//! An answer counts only through its chain: from the question's name
//! through each CNAME to the A and AAAA records of the last name. Every
//! name of the chain must be one the sandbox may resolve (a CNAME into a
//! denied or unlisted name is refused as that name would be), and records
//! of other names are never admitted.
//!
//! The resolver is shared, so it is shared fairly: the host's rules cap
//! each sandbox's query rate before its packets reach the socket, and here
//! each sandbox has its own queue and at most `PER_SANDBOX` queries in
//! flight; a free slot goes to the next sandbox in turn (round robin), so
//! a sandbox that floods, or asks names that never answer, waits behind
//! itself only.
//!
//! Queries and answers are untrusted. Messages are parsed by hickory-proto
//! after a bounds check of our own (`precheck`): its decoder reserves
//! room for as many questions as the header claims, so a 12-byte message
//! claiming 65535 would cost megabytes. Anything malformed is dropped.

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};
use hutch_runtime::net::{Network, Policy};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::UdpSocket;

const MAX_MSG: usize = 4096;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Queries in flight to the upstreams at once, every sandbox together.
const CONCURRENCY: usize = 256;
/// Queries in flight at once for one sandbox.
const PER_SANDBOX: usize = 16;
/// Queries one sandbox may have waiting; past it, its new ones are dropped.
const QUEUE: usize = 64;
/// CNAMEs followed in one answer.
pub const MAX_CHAIN: usize = 16;
/// The resolver socket's receive buffer: room for bursts of many sandboxes.
const RECV_BUFFER: usize = 4 << 20;

/// Called with a sandbox's id and every address admitted for it now,
/// after that set changed (the daemon stores them, so a restart admits
/// them again).
pub type OnAdmit = Arc<dyn Fn(&str, &[IpAddr]) + Send + Sync>;

struct Job {
    from: SocketAddr,
    query: Vec<u8>,
}

struct Resolver {
    net: Arc<Network>,
    on_admit: OnAdmit,
    sock: UdpSocket,
    queue: Mutex<Fair<Job>>,
}

/// Serves until the socket fails. Binds before returning.
pub async fn serve(net: Arc<Network>, on_admit: OnAdmit) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let addr = std::net::SocketAddrV4::new(net.config().gateway4(), 53);
    let std_sock = hutch_runtime::net::bind_udp_freebind(addr)?;
    hutch_runtime::net::set_recv_buffer(&std_sock, RECV_BUFFER);
    let sock = UdpSocket::from_std(std_sock)?;
    let r = Arc::new(Resolver {
        net,
        on_admit,
        sock,
        queue: Mutex::new(Fair::new(Limits { total: CONCURRENCY, per_source: PER_SANDBOX, queue: QUEUE })),
    });
    Ok(tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_MSG];
        loop {
            let (n, from) = match r.sock.recv_from(&mut buf).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("resolver: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if n < 12 {
                continue;
            }
            let job = Job { from, query: buf[..n].to_vec() };
            // Dropped when the sandbox's queue is full: its own flood.
            let _ = lock(&r.queue).push(from.ip(), job);
            pump(&r);
        }
    }))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts every query that may start now.
fn pump(r: &Arc<Resolver>) {
    loop {
        let Some((src, job)) = lock(&r.queue).next() else { return };
        let r = r.clone();
        tokio::spawn(async move {
            if let Some(reply) = answer(&r.net, &r.on_admit, job.from.ip(), &job.query).await {
                let _ = r.sock.send_to(&reply, job.from).await;
            }
            lock(&r.queue).done(src);
            pump(&r);
        });
    }
}

async fn answer(net: &Arc<Network>, on_admit: &OnAdmit, from: IpAddr, query: &[u8]) -> Option<Vec<u8>> {
    let q = parse_query(query)?;
    let Some((id, policy)) = net.policy_of(from) else { return refuse(&q, ResponseCode::Refused) };
    if policy.egress != hutch_runtime::net::Egress::Default {
        return refuse(&q, ResponseCode::Refused);
    }
    if !policy.resolves(&q.name) {
        return refuse(&q, ResponseCode::NXDomain);
    }
    let reply = forward(&net.config().upstream_dns, query).await?;
    let found = parse_answer(&q, &reply)?;
    if !chain_allowed(&policy, &found) {
        return refuse(&q, ResponseCode::NXDomain);
    }
    if policy.listed() && !found.addrs.is_empty() {
        let addrs: Vec<(IpAddr, Duration)> =
            found.addrs.iter().map(|(a, ttl)| (*a, Duration::from_secs(u64::from(*ttl)))).collect();
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
            return refuse(&q, ResponseCode::Refused);
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

/// Whether every name an answer went through may be resolved by `policy`.
fn chain_allowed(policy: &Policy, found: &Found) -> bool {
    found.chain.iter().all(|name| policy.resolves(name))
}

/// A query's question: its name (lower case, no trailing dot), type, and
/// the query itself (to answer it with an error).
#[derive(Debug)]
pub struct Question {
    pub name: String,
    pub qtype: RecordType,
    id: u16,
    recursion_desired: bool,
    query: Query,
}

/// What an answer says through its chain.
#[derive(Debug, Default, PartialEq)]
pub struct Found {
    /// The CNAME targets from the question's name, in order.
    pub chain: Vec<String>,
    /// The A and AAAA records of the question's name or of a name of the
    /// chain, with their TTLs.
    pub addrs: Vec<(IpAddr, u32)>,
}

/// Checks a message's header counts against its length before it is
/// decoded: one question, and no more records than could fit (each takes
/// at least 11 bytes). Bounds what the decoder may reserve.
fn precheck(msg: &[u8]) -> Option<()> {
    if msg.len() < 12 || msg.len() > MAX_MSG {
        return None;
    }
    let count = |i: usize| u16::from_be_bytes([msg[i], msg[i + 1]]) as usize;
    let records = count(6) + count(8) + count(10);
    (count(4) == 1 && records <= (msg.len() - 12) / 11).then_some(())
}

/// Lower case, no trailing dot: how policies name names. `None` for a
/// name with a label that holds a dot, a backslash, a space or a byte
/// outside printable ASCII: written out (escaped), such a name could match
/// a policy's pattern that the name resolved does not (`evil\.example.com`
/// ends in `.example.com`, but is a name under `com`), so it is never
/// resolved, followed or admitted.
fn name_of(name: &hickory_proto::rr::Name) -> Option<String> {
    let mut out = String::new();
    for label in name.iter() {
        if label.is_empty() || !label.iter().all(|b| b.is_ascii_graphic() && *b != b'.' && *b != b'\\') {
            return None;
        }
        if !out.is_empty() {
            out.push('.');
        }
        out.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
    }
    Some(out)
}

/// Parses a sandbox's query. Pure: for fuzzing.
pub fn parse_query(msg: &[u8]) -> Option<Question> {
    precheck(msg)?;
    let m = Message::from_vec(msg).ok()?;
    if m.metadata.message_type != MessageType::Query || m.metadata.op_code != OpCode::Query {
        return None;
    }
    let query = m.queries.first()?.clone();
    if query.query_class() != DNSClass::IN {
        return None;
    }
    Some(Question {
        name: name_of(query.name())?,
        qtype: query.query_type(),
        id: m.metadata.id,
        recursion_desired: m.metadata.recursion_desired,
        query,
    })
}

/// Parses an upstream's answer to question `q`: it must be a response with
/// the query's id and question. Pure: for fuzzing.
pub fn parse_answer(q: &Question, msg: &[u8]) -> Option<Found> {
    precheck(msg)?;
    let m = Message::from_vec(msg).ok()?;
    let rq = m.queries.first()?;
    if m.metadata.message_type != MessageType::Response
        || m.metadata.id != q.id
        || name_of(rq.name()).as_deref() != Some(q.name.as_str())
        || rq.query_type() != q.qtype
    {
        return None;
    }
    Some(follow(&q.name, &m.answers))
}

/// Follows the CNAMEs from `qname` through `answers` and collects the
/// addresses of the names on the way; records of other names are left.
fn follow(qname: &str, answers: &[Record]) -> Found {
    let mut found = Found::default();
    let mut names = vec![qname.to_owned()];
    for _ in 0..MAX_CHAIN {
        let Some(current) = names.last() else { break };
        let next = answers.iter().find_map(|r| match &r.data {
            RData::CNAME(target) if r.dns_class == DNSClass::IN && name_of(&r.name).as_ref() == Some(current) => {
                name_of(&target.0)
            }
            _ => None,
        });
        match next {
            Some(target) if !names.contains(&target) => {
                found.chain.push(target.clone());
                names.push(target);
            }
            _ => break,
        }
    }
    for r in answers {
        if r.dns_class != DNSClass::IN || !name_of(&r.name).is_some_and(|n| names.contains(&n)) {
            continue;
        }
        match &r.data {
            RData::A(a) => found.addrs.push((IpAddr::V4(a.0), r.ttl)),
            RData::AAAA(a) => found.addrs.push((IpAddr::V6(a.0), r.ttl)),
            _ => {}
        }
    }
    found
}

/// An answer with no records and `rcode`, to question `q` (`None` if it
/// cannot be encoded: then nothing is sent). Public for fuzz/ only.
#[doc(hidden)]
pub fn refuse(q: &Question, rcode: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::error_msg(q.id, OpCode::Query, rcode);
    m.metadata.recursion_desired = q.recursion_desired;
    m.metadata.recursion_available = true;
    m.add_query(q.query.clone());
    m.to_vec().ok()
}

/// Bounds of the fair queue.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Jobs running at once, every source together.
    total: usize,
    /// Jobs running at once for one source.
    per_source: usize,
    /// Jobs one source may have waiting.
    queue: usize,
}

struct Source<J> {
    waiting: VecDeque<J>,
    running: usize,
    in_ring: bool,
}

/// Jobs from many sources, started fairly: a free slot goes to the next
/// source in turn that has a job waiting and room to run it. A source is
/// in `ring` exactly when it has a job waiting and fewer than
/// `per_source` running. Sources with nothing waiting or running are
/// forgotten.
struct Fair<J> {
    limits: Limits,
    sources: HashMap<IpAddr, Source<J>>,
    ring: VecDeque<IpAddr>,
    running: usize,
}

impl<J> Fair<J> {
    fn new(limits: Limits) -> Fair<J> {
        Fair { limits, sources: HashMap::new(), ring: VecDeque::new(), running: 0 }
    }

    /// Queues a job; `false` (and the job dropped) when its source's queue
    /// is full.
    fn push(&mut self, src: IpAddr, job: J) -> bool {
        let s =
            self.sources.entry(src).or_insert_with(|| Source { waiting: VecDeque::new(), running: 0, in_ring: false });
        if s.waiting.len() >= self.limits.queue {
            return false;
        }
        s.waiting.push_back(job);
        if !s.in_ring && s.running < self.limits.per_source {
            s.in_ring = true;
            self.ring.push_back(src);
        }
        true
    }

    /// The next job to start, if a slot is free; the caller calls `done`
    /// with its source when it ends.
    fn next(&mut self) -> Option<(IpAddr, J)> {
        if self.running >= self.limits.total {
            return None;
        }
        let src = self.ring.pop_front()?;
        let s = self.sources.get_mut(&src)?;
        let job = s.waiting.pop_front()?;
        s.running += 1;
        self.running += 1;
        s.in_ring = !s.waiting.is_empty() && s.running < self.limits.per_source;
        if s.in_ring {
            self.ring.push_back(src);
        }
        Some((src, job))
    }

    fn done(&mut self, src: IpAddr) {
        let Some(s) = self.sources.get_mut(&src) else { return };
        s.running = s.running.saturating_sub(1);
        self.running = self.running.saturating_sub(1);
        if !s.in_ring && !s.waiting.is_empty() && s.running < self.limits.per_source {
            s.in_ring = true;
            self.ring.push_back(src);
        }
        if s.waiting.is_empty() && s.running == 0 {
            self.sources.remove(&src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_runtime::net::{Egress, Rule};

    const A: u16 = 1;
    const CNAME: u16 = 5;
    const AAAA: u16 = 28;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        m.extend(wire_name(name));
        m.extend(qtype.to_be_bytes());
        m.extend(1u16.to_be_bytes());
        m
    }

    fn wire_name(name: &str) -> Vec<u8> {
        let mut m = Vec::new();
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend(l.as_bytes());
        }
        m.push(0);
        m
    }

    /// An answer to `query(qname, qtype)` with `records` (owner, type, data).
    fn answer_msg(qname: &str, qtype: u16, records: &[(&str, u16, Vec<u8>)]) -> Vec<u8> {
        let mut m = query(qname, qtype);
        m[2] = 0x81;
        m[3] = 0x80;
        m[7] = records.len() as u8;
        for (owner, ty, data) in records {
            m.extend(wire_name(owner));
            m.extend(ty.to_be_bytes());
            m.extend(1u16.to_be_bytes());
            m.extend(300u32.to_be_bytes());
            m.extend((data.len() as u16).to_be_bytes());
            m.extend(data);
        }
        m
    }

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy {
            egress: Egress::Default,
            allow: allow.iter().map(|s| Rule::parse(s).expect("rule")).collect(),
            deny: deny.iter().map(|s| Rule::parse(s).expect("rule")).collect(),
            group: String::new(),
            inject: false,
        }
    }

    #[test]
    fn questions_parse_and_refusals_echo_them() {
        let q = query("Allowed.Test", A);
        let parsed = parse_query(&q).expect("parse");
        assert_eq!((parsed.name.as_str(), parsed.qtype), ("allowed.test", RecordType::A));
        let r = refuse(&parsed, ResponseCode::NXDomain).expect("encode");
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(r[2] & 0x80, 0x80, "a response");
        assert_eq!(r[3] & 0x0f, 3, "NXDOMAIN");
        // The question comes back as asked (0x20 case randomization).
        assert_eq!(&r[12..], &q[12..]);
    }

    #[test]
    fn answers_yield_the_addresses_of_their_question() {
        let q = parse_query(&query("a.test", A)).expect("q");
        let m = answer_msg(
            "a.test",
            A,
            &[
                ("a.test", A, vec![203, 0, 113, 7]),
                ("a.test", AAAA, vec![0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]),
            ],
        );
        let found = parse_answer(&q, &m).expect("parse");
        assert!(found.chain.is_empty());
        assert_eq!(
            found.addrs,
            vec![("203.0.113.7".parse().expect("ip"), 300), ("2001:db8::9".parse().expect("ip"), 300)]
        );
    }

    #[test]
    fn records_of_other_names_are_not_admitted() {
        let q = parse_query(&query("a.test", A)).expect("q");
        let m =
            answer_msg("a.test", A, &[("a.test", A, vec![203, 0, 113, 7]), ("other.test", A, vec![198, 51, 100, 4])]);
        let found = parse_answer(&q, &m).expect("parse");
        assert_eq!(found.addrs, vec![("203.0.113.7".parse().expect("ip"), 300)]);
    }

    #[test]
    fn a_cname_into_a_denied_or_unlisted_name_is_refused() {
        let q = parse_query(&query("x.wild.test", A)).expect("q");
        let m = answer_msg(
            "x.wild.test",
            A,
            &[("other.test", A, vec![198, 51, 100, 4]), ("x.wild.test", CNAME, wire_name("other.test"))],
        );
        let found = parse_answer(&q, &m).expect("parse");
        assert_eq!(found.chain, vec!["other.test".to_owned()]);
        assert_eq!(found.addrs, vec![("198.51.100.4".parse().expect("ip"), 300)]);
        assert!(!chain_allowed(&policy(&["*.wild.test"], &[]), &found), "unlisted target");
        assert!(!chain_allowed(&policy(&[], &["other.test"]), &found), "denied target");
        assert!(chain_allowed(&policy(&["*.wild.test", "other.test"], &[]), &found));
        assert!(chain_allowed(&policy(&[], &[]), &found));
    }

    /// A label with a dot inside (`evil.example` under `com`) would be
    /// written `evil\.example.com`, which ends in `.example.com`: such a
    /// name is never parsed, followed or admitted. Found by
    /// fuzz/fuzz_targets/dns_message.rs.
    #[test]
    fn names_with_odd_labels_are_refused_not_escaped() {
        let labels = |ls: &[&[u8]]| {
            let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
            for l in ls {
                m.push(l.len() as u8);
                m.extend(*l);
            }
            m.extend([0, 0, 1, 0, 1]);
            m
        };
        for odd in [&b"evil.example"[..], b"a\\b", b"a b", b"\x06x", b"caf\xc3\xa9"] {
            assert!(parse_query(&labels(&[odd, b"com"])).is_none(), "{odd:?}");
        }
        assert_eq!(parse_query(&labels(&[b"Ok_1-x", b"com"])).expect("plain").name, "ok_1-x.com");
        // A CNAME into such a name ends the chain there: nothing admitted.
        let q = parse_query(&query("x.wild.test", A)).expect("q");
        let mut odd_target = vec![12];
        odd_target.extend(b"evil.example");
        odd_target.extend([4, b'w', b'i', b'l', b'd', 4, b't', b'e', b's', b't', 0]);
        let m = answer_msg("x.wild.test", A, &[("x.wild.test", CNAME, odd_target)]);
        let found = parse_answer(&q, &m).expect("parse");
        assert!(found.chain.is_empty() && found.addrs.is_empty(), "{found:?}");
    }

    #[test]
    fn cname_loops_end() {
        let q = parse_query(&query("a.test", A)).expect("q");
        let m =
            answer_msg("a.test", A, &[("a.test", CNAME, wire_name("b.test")), ("b.test", CNAME, wire_name("a.test"))]);
        let found = parse_answer(&q, &m).expect("parse");
        assert_eq!(found.chain, vec!["b.test".to_owned()]);
    }

    #[test]
    fn answers_to_another_question_are_dropped() {
        let q = parse_query(&query("a.test", A)).expect("q");
        assert!(parse_answer(&q, &answer_msg("b.test", A, &[])).is_none(), "another name");
        assert!(parse_answer(&q, &answer_msg("a.test", AAAA, &[])).is_none(), "another type");
        let mut other_id = answer_msg("a.test", A, &[]);
        other_id[1] ^= 1;
        assert!(parse_answer(&q, &other_id).is_none(), "another id");
        assert!(parse_answer(&q, &query("a.test", A)).is_none(), "not a response");
    }

    #[test]
    fn hostile_messages_are_dropped() {
        assert!(parse_query(&[0; 11]).is_none(), "short");
        let mut loop_ptr = query("a.test", A);
        loop_ptr.truncate(12);
        loop_ptr.extend([0xc0, 12, 0, 1, 0, 1]); // points at itself
        assert!(parse_query(&loop_ptr).is_none());
        let mut truncated = answer_msg("a.test", A, &[]);
        truncated[7] = 1; // claims an answer it lacks
        let q = parse_query(&query("a.test", A)).expect("q");
        assert!(parse_answer(&q, &truncated).is_none());
        // Counts no message of this size could hold never reach the decoder.
        let mut counts = query("a.test", A);
        counts[4..12].copy_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert!(precheck(&counts).is_none());
        counts[4..6].copy_from_slice(&[0, 1]);
        assert!(parse_query(&counts).is_none());
        let long = query(&["a"; 200].join("."), A);
        assert!(parse_query(&long).is_none(), "a name past 255 bytes");
        let mut chaos = query("version.bind", 16);
        let last = chaos.len() - 1;
        chaos[last] = 3; // class CH
        assert!(parse_query(&chaos).is_none());
    }

    /// Mutated messages never panic the parsers (a smoke test until the
    /// fuzz targets run: deterministic, bounded).
    #[test]
    fn mutated_messages_never_panic() {
        let q = parse_query(&query("a.wild.test", A)).expect("q");
        let seeds = [
            query("a.wild.test", A),
            answer_msg(
                "a.wild.test",
                A,
                &[("a.wild.test", CNAME, wire_name("b.test")), ("b.test", A, vec![1, 2, 3, 4])],
            ),
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000 {
            let mut m = seeds[i % 2].clone();
            for _ in 0..(rand() % 4 + 1) {
                let at = (rand() as usize) % m.len();
                match rand() % 3 {
                    0 => m[at] = rand() as u8,
                    1 => m.truncate(at.max(1)),
                    _ => m.insert(at, rand() as u8),
                }
            }
            let _ = parse_query(&m);
            if let Some(found) = parse_answer(&q, &m) {
                assert!(found.chain.len() <= MAX_CHAIN);
            }
        }
    }

    fn ip(i: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(100, 96, 0, i))
    }

    #[test]
    fn a_flooding_source_waits_behind_itself() {
        let mut f = Fair::new(Limits { total: 4, per_source: 2, queue: 8 });
        for n in 0..20 {
            f.push(ip(1), n);
        }
        assert_eq!(f.sources[&ip(1)].waiting.len(), 8, "its queue is bounded");
        // It gets at most its own share of slots...
        let started: Vec<_> = std::iter::from_fn(|| f.next()).collect();
        assert_eq!(started, vec![(ip(1), 0), (ip(1), 1)]);
        // ...so a quiet source starts at once.
        assert!(f.push(ip(2), 100));
        assert_eq!(f.next(), Some((ip(2), 100)));
        f.done(ip(2));
        assert!(!f.sources.contains_key(&ip(2)), "an idle source is forgotten");
        f.done(ip(1));
        assert_eq!(f.next(), Some((ip(1), 2)));
    }

    #[test]
    fn free_slots_go_round_robin() {
        let mut f = Fair::new(Limits { total: 3, per_source: 3, queue: 8 });
        for n in 0..4 {
            f.push(ip(1), n);
        }
        f.push(ip(2), 10);
        f.push(ip(3), 20);
        let order: Vec<_> = std::iter::from_fn(|| f.next()).map(|(s, _)| s).collect();
        assert_eq!(order, vec![ip(1), ip(2), ip(3)], "one each before a second for anyone");
        assert_eq!(f.next(), None, "every slot taken");
        f.done(ip(2));
        assert_eq!(f.next(), Some((ip(1), 1)));
    }
}
