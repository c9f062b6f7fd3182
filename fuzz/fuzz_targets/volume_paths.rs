//! Volume mount paths of a create (hutch-control's `volumes::check_path`):
//! a path is accepted only normalized, absolute, with no `..`, at or under
//! one of the places volumes go; accepting is idempotent; what is accepted
//! the runtime's mount plan takes; a refusal's message stays short.
#![no_main]

use hutch_control::volumes::{check_path, MOUNT_ROOTS};
use libfuzzer_sys::fuzz_target;
use std::path::{Path, PathBuf};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    match check_path(s) {
        Ok(normal) => {
            assert!(
                MOUNT_ROOTS.iter().any(|r| normal == *r || normal.starts_with(&format!("{r}/"))),
                "{normal:?}"
            );
            assert!(normal.split('/').skip(1).all(|c| !c.is_empty() && c != "." && c != ".."), "{normal:?}");
            assert!(!normal.chars().any(char::is_control), "{normal:?}");
            assert_eq!(check_path(&normal).expect("normal again"), normal);
            let mount = hutch_runtime::rootfs::VolumeMount { source: PathBuf::from("/v"), target: normal, read_only: true };
            let mut plan = hutch_runtime::launch::Plan::default();
            hutch_runtime::rootfs::plan_volumes(&mut plan, Path::new("/stage"), 1 << 20, 3, &[mount]).expect("planned");
        }
        Err(e) => assert!(e.to_string().len() <= 320, "a refusal of {} bytes", e.to_string().len()),
    }
});
