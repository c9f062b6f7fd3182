//! E2B template builds' steps (the SDK's `TemplateBuildStartV2`, JSON from
//! any key) as hutch-control's build e2b `translate` makes them into a
//! Dockerfile fragment: it never panics, and a fragment it makes is one
//! line per step that the Dockerfile parser reads back step for step, or
//! refuses with a line of it (an ENV name no shell takes, say).
#![no_main]

use hutch_control::build::dockerfile;
use hutch_control::build::e2b::{translate, BuildSpec};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

fuzz_target!(|data: &[u8]| {
    // The first byte picks how many top paths each COPY's upload holds.
    let Some((&n, rest)) = data.split_first() else { return };
    let Ok(spec) = serde_json::from_slice::<BuildSpec>(rest) else { return };
    let roots: HashMap<usize, Vec<String>> = (0..spec.steps.len())
        .map(|i| (i, (0..(n % 4)).map(|j| format!("p{j}")).collect()))
        .collect();
    let Ok(t) = translate(&spec, &roots) else { return };
    let lines = t.dockerfile.lines().count();
    assert_eq!(lines, t.origins.len(), "{}", t.dockerfile);
    match dockerfile::parse(&t.dockerfile) {
        Ok(steps) => assert_eq!(steps.len(), lines, "{}", t.dockerfile),
        Err(refused) => assert!(refused.line >= 1 && refused.line <= lines),
    }
});
