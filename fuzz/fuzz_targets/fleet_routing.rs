//! How a node reads a request for routing (hutch-server's fleet layer):
//! what it aims at, from its method, path, Host and `E2b-Sandbox-Id`, and
//! the headers it passes to the owner node. Input: lines `method`, `path`,
//! `host`, `sandbox header`, then one header a line (`name: value`).
//! Whatever is sent:
//! - a sandbox aimed at is one the same path, host or header names;
//! - only a POST is ever a create;
//! - no hop-by-hop header, no header `Connection` names and no `Expect`
//!   reaches the owner node.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use hutch_server::fleet::{aim, end_to_end, http_authority, Aim};
use libfuzzer_sys::fuzz_target;

const HOP_BY_HOP: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.split('\n');
    let method = Method::from_bytes(lines.next().unwrap_or("GET").as_bytes()).unwrap_or(Method::GET);
    let path = lines.next().unwrap_or("/");
    let host = lines.next().filter(|h| !h.is_empty());
    let sandbox = lines.next().filter(|s| !s.is_empty());
    let aimed = aim(&method, path, host, Some("e2b.example.com"), sandbox);
    match &aimed {
        Aim::Sandbox(id) => {
            let named = path.split('/').any(|seg| seg == id)
                || host.is_some_and(|h| h.to_ascii_lowercase().contains(&id.to_ascii_lowercase()))
                || sandbox == Some(id.as_str());
            assert!(named, "{id} is named nowhere in {path:?} {host:?} {sandbox:?}");
        }
        Aim::Create(_) => assert_eq!(method, Method::POST),
        Aim::Volume(v) => assert!(path.split('/').any(|seg| seg == v), "{v} is named nowhere in {path:?}"),
        Aim::Local => {}
    }
    let _ = http_authority(path);

    let mut headers = HeaderMap::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value.trim()))
        else {
            continue;
        };
        headers.append(name, value);
    }
    let named: Vec<String> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| hutch_server::proxy::connection_list(v.as_bytes()))
        .collect();
    for name in end_to_end(&headers).keys() {
        let n = name.as_str();
        assert!(!HOP_BY_HOP.contains(&n), "{n} reached the owner node");
        assert!(!named.iter().any(|c| c == n), "{n}, named by Connection, reached the owner node");
    }
});
