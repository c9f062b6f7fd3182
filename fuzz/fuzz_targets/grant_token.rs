//! Grant tokens (`hg_...`), as any client can send them in a bearer
//! header: a token parses only in its one form (it re-encodes to itself),
//! and no bytes verify under a secret but the ones the secret signed.
#![no_main]

use hutch_control::grants::{parse_token, TokenError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    match parse_token(s) {
        Ok(claims) => {
            assert_eq!(claims.token(), s, "a token has one form");
            assert!(claims.sandbox.as_str().starts_with("sb-") && claims.key.as_str().starts_with("key-"));
            assert!(!claims.verify(&[0u8; 32]), "an unsigned token verified");
            assert!(!claims.scopes.names().is_empty());
        }
        Err(TokenError::NotAGrant) => assert!(!s.starts_with("hg_")),
        Err(TokenError::Malformed) => {}
    }
});
