//! `hutch mcp`: an MCP server on stdio for clients that start their
//! servers as programs. It holds no tools of its own: it relays each
//! JSON-RPC line of stdin to a running daemon's `/mcp` (streamable HTTP,
//! with the key as bearer), and writes every message of the answer (a JSON
//! body, or the events of an SSE stream) to stdout, one line each. So the
//! tools, their session (its default sandbox) and their ownership are the
//! daemon's, one implementation for both transports. At the end of stdin
//! (or a closed stdout) the session is closed with a DELETE, which ends
//! the sandboxes it made and did not keep.
//!
//! Requests run on a thread each, so a long `run_code` does not hold up a
//! `ping`; the handshake (`initialize`, `server/discover`), notifications
//! and responses go in order. An answer that is not JSON-RPC (a 401, an
//! unreachable daemon) becomes a JSON-RPC error for the request's id.
//! Server-initiated messages outside an answer (the GET stream) are not
//! relayed: hutch's tools send none.

use super::ClientOpts;
use clap::Args;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};

#[derive(Args, Debug)]
pub struct McpArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
}

/// Largest JSON answer read whole (a file of 8 MiB in base64, and more).
const BODY_CAP: u64 = 64 << 20;

/// JSON-RPC's code for errors of the server's own (the daemon refused or
/// could not be reached).
const SERVER_ERROR: i64 = -32000;

struct Bridge {
    client: super::client::Client,
    session: Mutex<Option<String>>,
    version: Mutex<Option<String>>,
    out: Mutex<std::io::Stdout>,
    /// Set when stdout is closed: nothing more can be answered.
    closed: std::sync::atomic::AtomicBool,
}

pub fn main(args: McpArgs) -> i32 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("hutch: {e:#}");
            return 2;
        }
    };
    let bridge = Arc::new(Bridge {
        client,
        session: Mutex::new(None),
        version: Mutex::new(None),
        out: Mutex::new(std::io::stdout()),
        closed: std::sync::atomic::AtomicBool::new(false),
    });
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        if line.trim().is_empty() {
            continue;
        }
        let msg: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                bridge.write(&json!({"jsonrpc": "2.0", "id": null,
                    "error": {"code": -32700, "message": format!("not JSON: {e}")}}));
                continue;
            }
        };
        let method = msg.get("method").and_then(Value::as_str).unwrap_or("");
        let request = msg.get("id").is_some() && !method.is_empty();
        if request && !matches!(method, "initialize" | "server/discover") {
            let b = bridge.clone();
            std::thread::spawn(move || b.post(&msg));
        } else {
            bridge.post(&msg);
        }
        if bridge.closed.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
    }
    bridge.close();
    0
}

impl Bridge {
    fn write(&self, msg: &Value) {
        let mut line = msg.to_string();
        line.push('\n');
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if out.write_all(line.as_bytes()).and_then(|()| out.flush()).is_err() {
            self.closed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A JSON-RPC error answering `msg`, if it is a request.
    fn fail(&self, msg: &Value, message: String, data: Value) {
        eprintln!("hutch mcp: {message}");
        if let Some(id) = msg.get("id").filter(|_| msg.get("method").is_some()) {
            self.write(&json!({"jsonrpc": "2.0", "id": id,
                "error": {"code": SERVER_ERROR, "message": message, "data": data}}));
        }
    }

    /// Relays one message and its answer.
    fn post(&self, msg: &Value) {
        let (url, mut req) = self.client.raw("POST", "/mcp");
        req = req.set("Content-Type", "application/json").set("Accept", "application/json, text/event-stream");
        if let Some(s) = self.session.lock().unwrap_or_else(|p| p.into_inner()).as_deref() {
            req = req.set("Mcp-Session-Id", s);
        }
        if let Some(v) = self.version.lock().unwrap_or_else(|p| p.into_inner()).as_deref() {
            req = req.set("MCP-Protocol-Version", v);
        }
        let resp = match req.send_string(&msg.to_string()) {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => {
                return self.fail(msg, format!("cannot reach the hutch daemon at {url}: {e}"), Value::Null);
            }
        };
        if let Some(s) = resp.header("mcp-session-id") {
            *self.session.lock().unwrap_or_else(|p| p.into_inner()) = Some(s.to_owned());
        }
        let status = resp.status();
        if status == 202 {
            return;
        }
        let sse = resp.content_type() == "text/event-stream";
        let reader = resp.into_reader();
        if sse {
            let mut data = String::new();
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                if line.is_empty() {
                    self.relay(msg, status, std::mem::take(&mut data).as_bytes());
                } else if let Some(d) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                }
            }
            self.relay(msg, status, data.as_bytes());
            return;
        }
        let mut body = Vec::new();
        if let Err(e) = reader.take(BODY_CAP).read_to_end(&mut body) {
            return self.fail(msg, format!("reading the answer of {url}: {e}"), Value::Null);
        }
        self.relay(msg, status, &body);
    }

    /// Writes an answer's message (or messages: a batch), or an error
    /// standing for it when it is not JSON-RPC.
    fn relay(&self, msg: &Value, status: u16, body: &[u8]) {
        if body.iter().all(u8::is_ascii_whitespace) {
            if status >= 400 {
                self.fail(msg, format!("the daemon answered HTTP {status}"), json!({"status": status}));
            }
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(body) else {
            let text: String = String::from_utf8_lossy(body).chars().take(200).collect();
            return self.fail(msg, format!("the daemon answered HTTP {status}: {text}"), json!({"status": status}));
        };
        let messages = match v {
            Value::Array(a) => a,
            v => vec![v],
        };
        for m in messages {
            if m.get("jsonrpc").is_some() {
                if let Some(version) = m.pointer("/result/protocolVersion").and_then(Value::as_str) {
                    *self.version.lock().unwrap_or_else(|p| p.into_inner()) = Some(version.to_owned());
                }
                self.write(&m);
            } else {
                // hutch's own error body ({error, code}): a 401, a 404.
                let error = m.get("error").and_then(Value::as_str).unwrap_or("refused");
                let code = m.get("code").cloned().unwrap_or(Value::Null);
                self.fail(msg, format!("{error} (HTTP {status})"), json!({"status": status, "code": code}));
            }
        }
    }

    /// Ends the daemon's session (and the sandboxes it did not keep).
    fn close(&self) {
        let Some(session) = self.session.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let (url, mut req) = self.client.raw("DELETE", "/mcp");
        req = req.set("Mcp-Session-Id", &session);
        if let Some(v) = self.version.lock().unwrap_or_else(|p| p.into_inner()).as_deref() {
            req = req.set("MCP-Protocol-Version", v);
        }
        match req.call() {
            Ok(_) | Err(ureq::Error::Status(404, _)) => {}
            Err(e) => eprintln!("hutch mcp: closing the session at {url}: {e}"),
        }
    }
}
