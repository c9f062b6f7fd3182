//! Paths and cursors of the file API (hutch-control's files, and the
//! agent's `normalize_path` under it): a path that is accepted is absolute,
//! bounded and normalizes to itself; a listing cursor decodes only for the
//! listing it was made for, to the path it was made with.
#![no_main]

use hutch_agent::proto::{normalize_path, MAX_PATH};
use hutch_control::files::{decode_cursor, encode_cursor, normalize};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(p) = normalize(s) {
        absolute(&p);
        assert_eq!(normalize(&p).ok().as_deref(), Some(p.as_str()));
    }
    for base in ["/", "/workspace", "/home/user"] {
        if let Ok(p) = normalize_path(s, base) {
            absolute(&p);
            assert_eq!(normalize_path(&p, "/").ok().as_deref(), Some(p.as_str()));
        }
    }
    let (path, last) = s.split_once('\n').unwrap_or((s, ""));
    let _ = decode_cursor(path, "/workspace", false);
    let cursor = encode_cursor(path, true, last);
    if let Ok(got) = decode_cursor(&cursor, path, true) {
        assert_eq!(got, last);
    }
    assert!(decode_cursor(&cursor, path, false).is_err(), "a cursor for another listing");
});

fn absolute(p: &str) {
    assert!(p.starts_with('/') && p.len() <= MAX_PATH);
    assert!(p == "/" || p[1..].split('/').all(|c| !c.is_empty() && c != "." && c != ".."), "{p:?}");
}
