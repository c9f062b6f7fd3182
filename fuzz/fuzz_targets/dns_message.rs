//! DNS messages the sandboxes' resolver reads (hutch-control's dns, over
//! hickory-proto): a sandbox's query and an upstream's answer. A question's
//! name is lower case, its labels as they are (a name with a dot, a
//! backslash or an odd byte in a label is refused), within DNS's bounds; a
//! refusal answers the question it refuses and holds no records; what an
//! answer says is bounded by its records and the chain limit.
#![no_main]

use hickory_proto::op::ResponseCode;
use hutch_control::dns::{parse_answer, parse_query, refuse, MAX_CHAIN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|msg: &[u8]| {
    let Some(q) = parse_query(msg) else { return };
    // A name is its labels as they are, joined by dots: no label holds a
    // dot, a backslash or an odd byte (written escaped, such a name could
    // match a pattern the resolved name does not; it is refused instead).
    assert!(q.name.len() <= 255, "{}", q.name);
    assert!(!q.name.ends_with('.') && !q.name.starts_with('.') && !q.name.contains(".."), "{}", q.name);
    assert!(q.name.bytes().all(|b| b.is_ascii_graphic() && b != b'\\'), "{}", q.name);
    assert_eq!(q.name, q.name.to_lowercase());
    for rcode in [ResponseCode::NXDomain, ResponseCode::Refused, ResponseCode::ServFail] {
        let Some(r) = refuse(&q, rcode) else { continue };
        assert!(parse_query(&r).is_none(), "a refusal is no query");
        let found = parse_answer(&q, &r).expect("a refusal answers its question");
        assert!(found.chain.is_empty() && found.addrs.is_empty(), "a refusal holds no records");
    }
    // The same bytes read as an upstream's answer to this question.
    if let Some(found) = parse_answer(&q, msg) {
        let ancount = u16::from_be_bytes([msg[6], msg[7]]) as usize;
        assert!(found.addrs.len() <= ancount);
        assert!(found.chain.len() <= MAX_CHAIN.min(ancount));
    }
});
