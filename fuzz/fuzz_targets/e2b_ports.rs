//! How the E2B surface reads the port a request is for: the
//! `E2b-Sandbox-Port` header of an envd call, the `<port>-<sandbox>.<domain>`
//! host form, and which unauthenticated calls reach the code interpreter.
//! A port read is never 0 nor envd's own and reads back from its own text;
//! a host read names a sandbox id and reads back from the host it makes;
//! an open interpreter route is one of its context routes.
#![no_main]

use http::Method;
use hutch_control::e2b::parse_host;
use hutch_control::SandboxId;
use hutch_server::fuzz_api::{e2b_interpreter_open_route, e2b_sandbox_port, E2B_ENVD_PORT};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(port)) = e2b_sandbox_port(Some(data)) {
        assert!(port != 0 && port != E2B_ENVD_PORT);
        assert_eq!(e2b_sandbox_port(Some(port.to_string().as_bytes())), Ok(Some(port)));
    }
    let Ok(s) = std::str::from_utf8(data) else { return };
    // The first line is the Host header, the rest the daemon's domain.
    let (host, domain) = s.split_once('\n').unwrap_or((s, "e2b.localhost"));
    if let Some((port, id)) = parse_host(host, domain) {
        assert!(SandboxId::parse(id.as_str()).is_ok(), "{id}");
        let made = format!("{port}-{id}.{}", domain.trim().trim_end_matches('.'));
        assert_eq!(parse_host(&made, domain), Some((port, id)), "{made:?} under {domain:?}");
    }
    for method in [Method::GET, Method::POST, Method::DELETE] {
        if e2b_interpreter_open_route(&method, s) {
            assert!(s == "/health" || s.starts_with("/contexts"), "{method} {s:?}");
        }
    }
});
