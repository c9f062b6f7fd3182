//! The JSON of images (hutch-runtime's image archive and registry code):
//! OCI and Docker manifests, indexes and manifest lists, image
//! configurations and `docker save`'s manifest.json, as a registry or an
//! archive hands them over, and the image configuration a moved image
//! carries in a label (hutch-runtime's image/moved.rs). Every digest taken is a well-formed sha256,
//! layer counts stay in bounds, and what a configuration gives to run is
//! bounded.
#![no_main]

use hutch_runtime::image::archive::{diff_ids, is_index, parse_docker_manifest, parse_manifest, pick_platform};
use hutch_runtime::image::extract::digest_hex;
use hutch_runtime::image::moved::parse_config_label;
use hutch_runtime::image::{ImageConfig, MAX_LAYERS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(run) = std::str::from_utf8(data).ok().and_then(parse_config_label) {
        assert!(run.env.len() <= 1024 && run.cmd.len() <= 2048);
        assert!(run.env.iter().chain(&run.cmd).all(|s| s.chars().count() <= 8192));
    }
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let label = "fuzz";
    if is_index(&doc) {
        if let Ok(d) = pick_platform(label, &doc) {
            assert!(digest_hex(&d).is_ok());
        }
    }
    if let Ok((config, layers)) = parse_manifest(label, &doc) {
        assert!(digest_hex(&config).is_ok());
        assert!(!layers.is_empty() && layers.len() < MAX_LAYERS);
        for l in &layers {
            assert!(digest_hex(&l.digest).is_ok());
        }
    }
    for n in 0..4 {
        if let Ok(ids) = diff_ids(label, &doc, n) {
            assert_eq!(ids.len(), n);
            assert!(ids.iter().all(|id| digest_hex(id).is_ok()));
        }
    }
    let run = ImageConfig::from_oci(&doc);
    assert!(run.env.len() <= 1024 && run.cmd.len() <= 2048);
    assert!(run.env.iter().chain(&run.cmd).all(|s| s.chars().count() <= 8192));
    if let Some(w) = &run.workdir {
        assert!(w.starts_with('/') && w.len() <= 4096);
    }
    if let Ok(m) = parse_docker_manifest(label, &doc) {
        assert!(!m.layers.is_empty() && m.layers.len() < MAX_LAYERS);
    }
});
