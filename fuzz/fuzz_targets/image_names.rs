//! Names in image pulls and archives (hutch-runtime's image registry and
//! archive code): image references, a registry's `WWW-Authenticate`
//! challenge and a push's upload `Location`, and the member names, symlink targets and digest-named
//! members of an image archive. A reference re-parses from its parts to
//! itself, member names stay inside the archive and normalize to
//! themselves, a name's digest is a well-formed sha256, and an upload
//! goes on at the registry itself, with the blob's digest.
#![no_main]

use hutch_runtime::image::archive::{name_digest, normalize, resolve_link};
use hutch_runtime::image::extract::digest_hex;
use hutch_runtime::image::push::upload_url;
use hutch_runtime::image::registry::{parse_params, Reference};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(name) = normalize(data) {
        inside(&name);
        assert_eq!(normalize(name.as_bytes()).as_deref(), Some(name.as_str()));
    }
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(r) = Reference::parse(s) {
        assert!(!r.registry.is_empty() && !r.repository.is_empty() && r.reference.len() <= 128);
        let sep = if r.reference.contains(':') { '@' } else { ':' };
        let again = format!("{}/{}{sep}{}", r.registry, r.repository, r.reference);
        assert_eq!(Reference::parse(&again).ok(), Some(r.clone()), "{again:?}");
        let _ = r.is_loopback();
    }
    let base = "http://127.0.0.1:5000";
    if let Ok(url) = upload_url(base, s, "ab") {
        assert!(url.starts_with(&format!("{base}/")), "{url:?}");
        assert!(url.ends_with("digest=sha256:ab"), "{url:?}");
        assert!(!url.chars().any(|c| c.is_control() || c.is_whitespace()), "{url:?}");
    }
    let params = parse_params(s);
    assert!(params.len() <= s.matches('=').count());
    if let Some(d) = name_digest(s) {
        assert!(digest_hex(&d).is_ok());
    }
    // A symlink member (its name normalized, as the archive index keeps it)
    // and its target.
    let (from, target) = s.split_once('\n').unwrap_or((s, ""));
    if let Some(to) = normalize(from.as_bytes()).and_then(|from| resolve_link(&from, target)) {
        assert!(!to.starts_with('/'));
        assert!(to.split('/').all(|c| c != ".." && c != "."), "{to:?}");
    }
});

/// A member name: relative, no `.` or `..` element.
fn inside(name: &str) {
    assert!(!name.starts_with('/'));
    assert!(name.split('/').all(|c| c != ".." && c != "."), "{name:?}");
}
