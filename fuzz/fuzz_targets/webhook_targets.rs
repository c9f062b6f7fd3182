//! What a webhook create and a delivery parse from untrusted bytes: the
//! URL (`parse_url`), the operator's and a query's lists (`Cidr::parse_list`,
//! `parse_kinds`) and the receiver's answer (`parse_status_line`). A parsed
//! URL is https or http with a visible-ASCII host and a path starting `/`,
//! and parses again to the same target from its own parts; a range's prefix
//! fits its family; a status is 100 to 599.
#![no_main]

use hutch_control::events::parse_kinds;
use hutch_control::webhooks::{parse_status_line, parse_url, Cidr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(code) = parse_status_line(data) {
        assert!((100..=599).contains(&code));
    }
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(t) = parse_url(s) {
        assert!(t.path.starts_with('/') && !t.host.is_empty() && t.port > 0, "{t:?}");
        assert!(t.host.bytes().all(|b| b.is_ascii_graphic() && b != b'@' && b != b'/'), "{t:?}");
        let host = if t.host.contains(':') { format!("[{}]", t.host) } else { t.host.clone() };
        let scheme = if t.https { "https" } else { "http" };
        let again = parse_url(&format!("{scheme}://{host}:{}{}", t.port, t.path));
        assert_eq!(again.as_ref(), Ok(&t), "{s:?}");
    }
    if let Ok(list) = Cidr::parse_list(s) {
        for c in list {
            assert!(c.prefix <= if c.addr.is_ipv4() { 32 } else { 128 });
            assert!(c.contains(c.addr));
        }
    }
    if let Ok(kinds) = parse_kinds(s) {
        for k in kinds {
            assert!(s.contains(k.as_str()));
        }
    }
});
