//! Archive uploads (hutch-control's files archive: `validate`,
//! `normalize_name`, `stream_files`), plain or gzip. A normalized name
//! normalizes to itself; a validated plan is bounded, sorted with every
//! parent a directory before its children, and the archive streams exactly
//! the files and sizes the plan holds.
#![no_main]

use hutch_control::files::archive::{self, PlannedKind, ARCHIVE_ENTRIES, ARCHIVE_UNPACKED_CAP};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(name)) = archive::normalize_name(data) {
        normalized(&name);
    }
    let Ok(plan) = archive::validate(data) else { return };
    assert!(plan.entries.len() <= ARCHIVE_ENTRIES);
    assert!(plan.bytes <= ARCHIVE_UNPACKED_CAP);
    assert_eq!(plan.files as usize, plan.files_in_order.len());
    let mut kinds: BTreeMap<&str, PlannedKind> = BTreeMap::new();
    let mut sizes: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &plan.entries {
        normalized(&e.path);
        assert_eq!(e.mode & !0o777, 0, "no setuid, setgid or sticky bit");
        if let Some((parent, _)) = e.path.rsplit_once('/') {
            assert_eq!(kinds.get(parent), Some(&PlannedKind::Dir), "{parent:?} comes before {:?}", e.path);
        }
        assert!(kinds.insert(&e.path, e.kind).is_none(), "{:?} twice", e.path);
        if let PlannedKind::File(n) = e.kind {
            sizes.insert(&e.path, n);
        }
    }
    assert_eq!(sizes.values().sum::<u64>(), plan.bytes);
    assert_eq!(sizes.len(), plan.files_in_order.len());

    let mut streamed = vec![(0u64, 0usize); plan.files_in_order.len()];
    let mut last = 0;
    archive::stream_files(data, &plan, 512, |i, chunk| {
        assert!(i >= last && chunk.len() <= 512);
        last = i;
        streamed[i].0 += chunk.len() as u64;
        streamed[i].1 += 1;
        true
    })
    .expect("a validated archive streams");
    for (path, (bytes, chunks)) in plan.files_in_order.iter().zip(&streamed) {
        assert_eq!(Some(bytes), sizes.get(path.as_str()), "{path:?}");
        assert!(*chunks >= 1, "{path:?} streamed nothing");
    }
});

/// Relative, `/`-separated, no empty, `.` or `..` element, and a fixed point.
fn normalized(name: &str) {
    assert!(name.split('/').all(|p| !p.is_empty() && p != "." && p != ".."), "{name:?}");
    assert_eq!(archive::normalize_name(name.as_bytes()), Ok(Some(name.to_owned())));
}
