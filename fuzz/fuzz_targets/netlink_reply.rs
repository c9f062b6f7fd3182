//! Netlink replies (hutch-runtime's netlink client): the messages of a
//! datagram, what each says about its request, the attributes of a
//! payload and the links (and their received bytes) of a dump. Everything read stays inside the
//! datagram, the walk stops at the first malformed header, and an error
//! reply is a positive errno.
#![no_main]

use hutch_runtime::net::netlink::{messages, parse_link, Attrs, Reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|buf: &[u8]| {
    let mut seen = 0usize;
    let mut failed = false;
    for m in messages(buf) {
        assert!(!failed, "nothing after a malformed header");
        let Ok(m) = m else {
            failed = true;
            continue;
        };
        seen += 1;
        assert!(16 + m.payload.len() <= buf.len());
        if let Reply::Error(errno) = m.reply() {
            assert!(errno > 0, "errno {errno}");
        }
        let mut inside = 0usize;
        for (_, data) in Attrs(m.payload) {
            inside += 4 + data.len();
            assert!(inside <= m.payload.len());
        }
        if let Some((index, name)) = parse_link(m.payload) {
            assert!(index <= i32::MAX as u32);
            assert!(!name.contains('\0'));
        }
    }
    assert!(seen * 16 <= buf.len());
});
