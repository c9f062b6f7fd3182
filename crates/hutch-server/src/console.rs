//! `/console`: the web console, a few static files embedded in the binary
//! and served with a strict Content-Security-Policy. The console is a
//! client of the native API like any other: it signs in with an API key it
//! keeps in the browser's session storage and sends only in the
//! `Authorization` header (and, for the terminal's WebSocket, in the
//! `hutch.bearer.` subprotocol; see `pty.rs`). These routes need no key:
//! they serve the same bytes to everyone, and nothing of any key's.
//!
//! The front end is plain JavaScript modules in `console/src`; xterm.js
//! comes from npm at build time (`build.rs`), never from a CDN.
//!
//! The policy allows scripts, styles, images and connections from this
//! origin only; no inline script; no framing. One exception: xterm.js
//! writes `<style>` elements (its measured cell size and colours), so the
//! page's styles also admit the per-response nonce the page hands to the
//! terminal code (a `<meta>` element), which sets it on those elements.

use axum::extract::Path;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;

use crate::{ApiError, App};
use hutch_api::ErrorCode;

const INDEX: &str = include_str!("../../../console/src/index.html");
/// The placeholder in `index.html` replaced by each answer's nonce.
const NONCE_MARK: &str = "{{nonce}}";

/// Every file but the page: (name, content type, bytes).
const ASSETS: &[(&str, &str, &[u8])] = &[
    ("app.js", JS, include_bytes!("../../../console/src/app.js")),
    ("api.js", JS, include_bytes!("../../../console/src/api.js")),
    ("dom.js", JS, include_bytes!("../../../console/src/dom.js")),
    ("sandbox.js", JS, include_bytes!("../../../console/src/sandbox.js")),
    ("terminal.js", JS, include_bytes!("../../../console/src/terminal.js")),
    ("chart.js", JS, include_bytes!("../../../console/src/chart.js")),
    ("console.css", CSS, include_bytes!("../../../console/src/console.css")),
    ("favicon.svg", "image/svg+xml", include_bytes!("../../../console/src/favicon.svg")),
    ("xterm.mjs", JS, include_bytes!(concat!(env!("OUT_DIR"), "/xterm.mjs"))),
    ("addon-fit.mjs", JS, include_bytes!(concat!(env!("OUT_DIR"), "/addon-fit.mjs"))),
    ("xterm.css", CSS, include_bytes!(concat!(env!("OUT_DIR"), "/xterm.css"))),
];
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

pub fn router() -> Router<Arc<App>> {
    Router::new().route("/console", get(index)).route("/console/", get(index)).route("/console/{file}", get(asset))
}

/// The policy of every console answer; `nonce` admits xterm's styles.
fn policy(nonce: Option<&str>) -> String {
    let styles = match nonce {
        Some(n) => format!("style-src 'self' 'nonce-{n}'"),
        None => "style-src 'self'".to_owned(),
    };
    format!(
        "default-src 'self'; script-src 'self'; {styles}; img-src 'self'; connect-src 'self'; \
         object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
}

/// The headers every console answer carries.
fn secured(mut resp: Response, nonce: Option<&str>, cache: &'static str) -> Response {
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&policy(nonce)) {
        h.insert(header::CONTENT_SECURITY_POLICY, v);
    }
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    resp
}

/// 16 random bytes as hex, for the page's style nonce.
fn nonce() -> std::io::Result<String> {
    use std::io::Read as _;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

async fn index() -> Response {
    let nonce = match nonce() {
        Ok(n) => n,
        Err(e) => return ApiError::new(ErrorCode::Internal, format!("console nonce: {e}")).into_response(),
    };
    let page = INDEX.replace(NONCE_MARK, &nonce);
    let resp = ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], page).into_response();
    // Each answer has its own nonce: never stored.
    secured(resp, Some(&nonce), "no-store")
}

async fn asset(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == file) {
        // Revalidated every time: a new daemon serves new files.
        Some((_, kind, bytes)) => secured(([(header::CONTENT_TYPE, *kind)], *bytes).into_response(), None, "no-cache"),
        None => {
            let resp = ApiError::new(ErrorCode::NotFound, "no such console file").into_response();
            secured(resp, None, "no-store")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_only_files_that_are_served() {
        for name in ASSETS.iter().map(|(n, _, _)| *n) {
            assert!(!name.contains('/'), "{name}");
        }
        for part in INDEX.split("/console/").skip(1) {
            let file: String = part.chars().take_while(|c| *c != '"').collect();
            assert!(ASSETS.iter().any(|(n, _, _)| *n == file), "index.html names {file}, which is not served");
        }
        assert!(INDEX.contains(NONCE_MARK));
        assert!(!INDEX.contains("<script>"), "no inline script");
    }

    #[test]
    fn the_policy_allows_this_origin_only_and_no_framing() {
        let p = policy(Some("abc"));
        assert!(p.starts_with("default-src 'self';"));
        assert!(p.contains("script-src 'self';"));
        assert!(p.contains("style-src 'self' 'nonce-abc';"));
        assert!(p.contains("frame-ancestors 'none'"));
        assert!(!p.contains("unsafe"));
        assert_ne!(nonce().expect("nonce"), nonce().expect("nonce"));
    }
}
