//! The egress proxy's injection of secrets into request headers
//! (hutch-server `egress::inject`, hutch-control
//! `secrets::replace_placeholders`). Input: one header a line (`name:
//! value`), as a sandbox sends them. Whatever is sent:
//! - no header keeps the placeholder of a secret that lists the host;
//! - another secret's placeholder is never replaced (its value never
//!   appears where it was not already);
//! - a value without the listed placeholder is left byte for byte;
//! - the configured header holds exactly its format with the value.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use hutch_control::secrets::{replace_placeholders, Injection};
use hutch_server::egress::inject;
use libfuzzer_sys::fuzz_target;

const LISTED: &str = "hutch-secret-1111111111111111111111111111111111111111";
const OTHER: &str = "hutch-secret-2222222222222222222222222222222222222222";
const VALUE: &str = "sk-VALUE";
const OTHER_VALUE: &str = "sk-OTHER";

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

fuzz_target!(|data: &[u8]| {
    // The byte-level replacement, over the raw input.
    let pairs: [(&[u8], &[u8]); 1] = [(LISTED.as_bytes(), VALUE.as_bytes())];
    let out = replace_placeholders(data, &pairs);
    assert_eq!(count(&out, LISTED.as_bytes()), 0, "a listed placeholder survived");
    assert_eq!(count(&out, OTHER_VALUE.as_bytes()), count(data, OTHER_VALUE.as_bytes()));
    if count(data, LISTED.as_bytes()) == 0 {
        assert_eq!(out, data);
    }

    // The same over a header map, with a configured header.
    let mut headers = HeaderMap::new();
    for line in data.split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else { continue };
        let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(&line[..colon]), HeaderValue::from_bytes(line[colon + 1..].trim_ascii()))
        else {
            continue;
        };
        headers.append(name, value);
    }
    let before: Vec<(String, Vec<u8>)> =
        headers.iter().map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec())).collect();
    let injections = [Injection {
        name: "T".into(),
        placeholder: LISTED.into(),
        value: VALUE.into(),
        hosts: vec!["api.example.com".into()],
        header: Some(("x-configured".into(), format!("Bearer {VALUE}"))),
    }];
    inject(&mut headers, &injections);
    for (name, v) in headers.iter() {
        assert_eq!(count(v.as_bytes(), LISTED.as_bytes()), 0, "{name}: a listed placeholder survived");
    }
    assert_eq!(headers.get_all("x-configured").iter().count(), 1);
    assert_eq!(headers["x-configured"], format!("Bearer {VALUE}").as_str());
    let other_before: usize = before.iter().map(|(_, v)| count(v, OTHER.as_bytes())).sum();
    let other_after: usize = headers.iter().map(|(_, v)| count(v.as_bytes(), OTHER.as_bytes())).sum();
    if !before.iter().any(|(k, _)| k == "x-configured") {
        assert_eq!(other_before, other_after, "another secret's placeholder changed");
    }
});
