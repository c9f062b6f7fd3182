//! RFC 3339 times on the wire (hutch-api's time): a time that parses is
//! written back as one that parses to the same instant, to the
//! millisecond and to the second; any instant renders without a panic.
#![no_main]

use hutch_api::time::{parse_rfc3339, rfc3339, rfc3339_seconds};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(b) = data.get(..8) {
        let ms = i64::from_le_bytes(b.try_into().expect("8 bytes"));
        let _ = (rfc3339(ms), rfc3339_seconds(ms));
    }
    let Ok(s) = std::str::from_utf8(data) else { return };
    let Some(ms) = parse_rfc3339(s) else { return };
    let again = rfc3339(ms);
    assert_eq!(parse_rfc3339(&again), Some(ms), "{s:?} is {ms}, written {again:?}");
    let seconds = rfc3339_seconds(ms);
    assert_eq!(parse_rfc3339(&seconds), Some(ms.div_euclid(1000) * 1000), "{s:?} is {ms}, written {seconds:?}");
});
