//! Credentials of E2B's envd calls as hutch-server reads them: the
//! `Authorization: Basic` user, the sandbox a call names (`E2b-Sandbox-Id`
//! or E2B's host form), and a signed `/files` URL's query. A user is never
//! empty and round-trips through its own header; a named sandbox is a
//! sandbox id; a signed URL's operation is its method's.
#![no_main]

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use http::{HeaderMap, HeaderValue};
use hutch_control::e2b::Operation;
use hutch_control::SandboxId;
use hutch_server::fuzz_api::{e2b_basic_user, e2b_named_sandbox, e2b_signed_url};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = HeaderValue::from_bytes(data) {
        if let Ok(Some(user)) = e2b_basic_user(&one("authorization", value.clone())) {
            assert!(!user.is_empty() && !user.contains(':'));
            let again = format!("Basic {}", STANDARD.encode(format!("{user}:")));
            let again = HeaderValue::from_str(&again).expect("base64 is a header value");
            assert_eq!(e2b_basic_user(&one("authorization", again)), Ok(Some(user)));
        }
        for name in ["host", "e2b-sandbox-id"] {
            if let Some(id) = e2b_named_sandbox(&one(name, value.clone())) {
                assert!(SandboxId::parse(&id).is_ok(), "{id:?}");
            }
        }
    }
    let Ok(s) = std::str::from_utf8(data) else { return };
    for uri in [s.to_owned(), format!("/files?{s}")] {
        for get in [true, false] {
            if let Some(Ok(Some(signed))) = e2b_signed_url(&uri, get) {
                assert_eq!(signed.operation, if get { Operation::Read } else { Operation::Write });
                assert!(!signed.user().is_empty());
            }
        }
    }
});

fn one(name: &'static str, value: HeaderValue) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(name, value);
    h
}
