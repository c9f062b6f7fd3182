//! Ids in request paths (hutch-control's ids, and build ids): an id parses
//! only in its one form (prefix and lowercase hex), as itself, and a
//! refusal's message stays short whatever the path held.
#![no_main]

use hutch_control::build::parse_build_id;
use hutch_control::{OwnerId, SandboxId, TemplateId, VolumeId};
use libfuzzer_sys::fuzz_target;

/// Room for the longest refusal: its words and an id cut to 64 characters.
const MAX_MESSAGE: usize = 128 + 64 * 4;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    check(s, "sb-", 16, SandboxId::parse(s).map(|id| id.to_string()));
    check(s, "key-", 12, OwnerId::parse(s).map(|id| id.to_string()));
    check(s, "tpl-", 16, TemplateId::parse(s).map(|id| id.to_string()));
    check(s, "bld-", 16, parse_build_id(s).map(str::to_owned));
    check(s, "vol-", 16, VolumeId::parse(s).map(|id| id.to_string()));
});

fn check(s: &str, prefix: &str, digits: usize, parsed: Result<String, hutch_control::ControlError>) {
    match parsed {
        Ok(id) => {
            assert_eq!(id, s);
            let hex = s.strip_prefix(prefix).expect("the prefix");
            assert_eq!(hex.len(), digits);
            assert!(hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{s:?}");
        }
        Err(e) => {
            let message = e.to_string();
            assert!(message.len() <= MAX_MESSAGE, "a refusal of {} bytes: {message:.200}", message.len());
        }
    }
}
