//! The port proxy's reading of what clients and applications send
//! (hutch-server's proxy): proxy host names, and the headers passed each
//! way. Input: one header a line (`name: value`); the first byte says
//! whether the request upgrades. Whatever is sent:
//! - a host name that names a sandbox port round-trips through its label;
//! - the application never receives the credential (header or cookie, as
//!   a server reads a `Cookie` header byte by byte), a spoofable header, a
//!   hop-by-hop header other than the upgrade, or `Expect`;
//! - the client never receives a `Set-Cookie` that a browser would send
//!   back as the credential cookie, nor `Clear-Site-Data`, and always our
//!   CSP and `Cache-Control`.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use hutch_control::SandboxId;
use hutch_server::proxy::{
    parse_label, proxy_label, request_headers, response_headers, strip_port, COOKIE, CSP, HOST_SUFFIX,
};
use libfuzzer_sys::fuzz_target;

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
];

fuzz_target!(|data: &[u8]| {
    let upgrade = data.first().is_some_and(|b| b & 1 == 1);
    let mut headers = HeaderMap::new();
    for line in data.get(1..).unwrap_or_default().split(|b| *b == b'\n') {
        if let Ok(host) = std::str::from_utf8(line) {
            host_name(host);
        }
        let Some(colon) = line.iter().position(|b| *b == b':') else { continue };
        let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(&line[..colon]), HeaderValue::from_bytes(trim(&line[colon + 1..])))
        else {
            continue;
        };
        headers.append(name, value);
    }

    let to_app = request_headers(&headers, upgrade);
    for (name, value) in &to_app {
        let n = name.as_str();
        let folded = n.replace(['_', '.'], "-");
        assert!(
            !folded.starts_with("x-hutch-")
                && folded != "forwarded"
                && !folded.starts_with("x-forwarded-")
                && folded != "x-real-ip",
            "{n} reached the application"
        );
        assert!(n != "expect");
        if HOP_BY_HOP.contains(&n) {
            assert!(upgrade && (n == "upgrade" || n == "connection"), "{n} reached the application");
        }
        if name == http::header::COOKIE {
            for pair in value.as_bytes().split(|b| *b == b';') {
                let cookie_name = trim(pair.split(|b| *b == b'=').next().unwrap_or_default());
                assert!(cookie_name != COOKIE.as_bytes(), "the credential cookie reached the application: {value:?}");
            }
        }
    }

    let to_client = response_headers(&headers, upgrade);
    assert!(to_client.get_all(http::header::CONTENT_SECURITY_POLICY).iter().any(|v| v == CSP));
    let cache: Vec<_> = to_client.get_all(http::header::CACHE_CONTROL).iter().collect();
    assert_eq!(cache, [HeaderValue::from_static("private, no-store")]);
    assert!(!to_client.contains_key("clear-site-data"));
    for value in to_client.get_all(http::header::SET_COOKIE) {
        assert!(sent_name(value.as_bytes()) != COOKIE.as_bytes(), "the client may be given the credential: {value:?}");
    }
});

/// A Host header's name: when it names a sandbox port, its label
/// re-made from the id and port names the same.
fn host_name(host: &str) {
    let Some(label) = proxy_label(strip_port(host)) else { return };
    let Ok((id, port)) = parse_label(&label) else { return };
    assert!(SandboxId::parse(&id).is_ok() && port != 0);
    let again = format!("{id}--{port}{HOST_SUFFIX}");
    let label = proxy_label(&again).expect("a proxy host name");
    assert_eq!(parse_label(&label).ok(), Some((id, port)));
}

/// Spaces and tabs around a cookie's name or value.
fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !matches!(c, b' ' | b'\t')).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !matches!(c, b' ' | b'\t')).map_or(start, |i| i + 1);
    &b[start..end]
}

/// The cookie name a browser sends back for a `Set-Cookie` value (RFC
/// 6265bis 5.6 and 5.7.4): the trimmed name before the first `=` of the
/// first part; a nameless cookie (`=v`, or no `=`) is sent as its value
/// alone, which a server reads up to its first `=` as a name.
fn sent_name(value: &[u8]) -> &[u8] {
    let pair = value.split(|b| *b == b';').next().unwrap_or_default();
    let (name, rest) = match pair.iter().position(|b| *b == b'=') {
        Some(i) => (trim(&pair[..i]), &pair[i + 1..]),
        None => (&pair[..0], pair),
    };
    if !name.is_empty() {
        return name;
    }
    let sent = trim(rest);
    trim(sent.split(|b| *b == b'=').next().unwrap_or_default())
}
