//! DNS messages the sandboxes' resolver reads (hutch-control's dns): a
//! sandbox's query and an upstream's answer. The question stays inside the
//! message and within DNS's bounds, a refusal echoes the question it
//! refuses, and the addresses of an answer are no more than its records.
#![no_main]

use hutch_control::dns::{addresses, refuse, Question};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|msg: &[u8]| {
    if let Some(q) = Question::parse(msg) {
        // Header, at least the root name (1 byte), type and class.
        assert!(q.end >= 12 + 1 + 4 && q.end <= msg.len());
        assert!(q.name.len() <= 255);
        assert!(!q.name.starts_with('.') && !q.name.ends_with('.'));
        for rcode in [3u8, 5] {
            let r = refuse(msg, q.end, rcode);
            assert_eq!(r.len(), q.end);
            assert_eq!(r[0..2], msg[0..2], "the id is kept");
            assert_eq!(r[3] & 0x0f, rcode);
            let back = Question::parse(&r).expect("a refusal has a question");
            assert_eq!(back, q, "a refusal echoes the question it refuses");
            assert_eq!(addresses(&r), Some(Vec::new()), "a refusal holds no records");
        }
    }
    if let Some(addrs) = addresses(msg) {
        let ancount = u16::from_be_bytes([msg[6], msg[7]]) as usize;
        assert!(addrs.len() <= ancount);
        // Each address record takes at least a pointer, 10 bytes and 4.
        assert!(12 + addrs.len() * 16 <= msg.len());
    }
});
