//! `GET /v1/usage`'s window (hutch-control's usage): any `from`/`to` pair
//! of query bytes is either refused with `usage_range_invalid` or gives a
//! window that is not empty and at most 400 days long.
#![no_main]

use hutch_control::usage::window;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let (from, to) = s.split_once('\n').unwrap_or((s, ""));
    let from = (!from.is_empty()).then_some(from);
    let to = (!to.is_empty()).then_some(to);
    match window(from, to, 1_764_633_600_000) {
        Ok((f, t)) => assert!(f < t && t - f <= 400 * 86_400_000, "{f} {t}"),
        Err(e) => assert_eq!(e.code(), hutch_api::ErrorCode::UsageRangeInvalid),
    }
});
