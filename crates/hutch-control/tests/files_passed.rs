//! Transfers through a descriptor the agent passes (SCM_RIGHTS): a hostile
//! agent that passes anything but one regular file opened as asked is
//! refused, promptly, and the host keeps none of what it sent. Its own test
//! binary, so that counting this process's descriptors sees no other test.
//! Runs as root (CI does) after `cargo build --workspace`.

use std::path::PathBuf;
use std::time::Duration;

use hutch_api::ErrorCode;
use hutch_control::files::{Chunks, FilesError, SandboxFs};
use hutch_runtime::{Config, Runtime, Sandbox, SandboxSpec};

fn agent() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().expect("deps dir").parent().expect("target dir").join("hutch-agent")
}

struct Liar {
    sb: Option<Sandbox>,
    _rt: Runtime,
    base: PathBuf,
}

impl Drop for Liar {
    fn drop(&mut self) {
        if let Some(sb) = self.sb.take() {
            let _ = sb.destroy();
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// The liar: Python as the sandbox's agent. It answers a ping, and every
/// `open_file` with `opened` (passed) carrying what the next of `KINDS`
/// says; anything else with `ok`.
const SCRIPT: &str = r#"
import json, os, socket, struct
KINDS = ["none", "two", "many", "pipe", "devnull", "dir", "socket", "proc", "rdwr", "wronly", "valid", "wvalid"]
with open("/liar-file", "wb") as f:
    f.write(b"hello")
s = socket.socket(fileno=3)
def frame(obj):
    h = json.dumps(obj).encode()
    return struct.pack("<II", 4 + len(h), len(h)) + h
def junk(kind, c):
    r, w = os.pipe()
    ro = lambda p: os.open(p, os.O_RDONLY)
    return {
        "none": [], "two": [ro("/liar-file"), ro("/liar-file")],
        "many": [ro("/liar-file") for _ in range(20)], "pipe": [r], "devnull": [ro("/dev/null")],
        "dir": [ro("/")], "socket": [c.fileno()], "proc": [ro("/proc/self/status")],
        "rdwr": [os.open("/liar-file", os.O_RDWR)], "wronly": [os.open("/liar-file", os.O_WRONLY)],
        "valid": [ro("/liar-file")], "wvalid": [os.open("/liar-file", os.O_WRONLY)],
    }[kind]
n = 0
while True:
    c, _ = s.accept()
    buf = b""
    while True:
        while len(buf) < 8 or len(buf) < 4 + struct.unpack("<I", buf[:4])[0]:
            more = c.recv(1 << 20)
            if not more:
                break
            buf += more
        if len(buf) < 8:
            break
        ln, hl = struct.unpack("<II", buf[:8])
        req = json.loads(buf[8:8 + hl])
        buf = buf[4 + ln:]
        op = req["req"]
        if op.get("op") == "no_follow":
            op = op["req"]
        if op["op"] == "ping":
            c.sendall(frame({"kind": "reply", "id": req["id"], "reply": {"type": "pong", "version": 1}}))
        elif op["op"] == "open_file":
            kind = KINDS[min(n, len(KINDS) - 1)]
            n += 1
            out = frame({"kind": "reply", "id": req["id"], "reply": {"type": "opened", "size": 5, "passed": True}})
            fds = junk(kind, c)
            if fds:
                socket.send_fds(c, [out], fds)
            else:
                c.sendall(out)
        elif op["op"] == "write_file":
            c.sendall(frame({"kind": "reply", "id": req["id"], "reply": {"type": "written", "len": 0}}))
        else:
            c.sendall(frame({"kind": "reply", "id": req["id"], "reply": {"type": "ok"}}))
    c.close()
"#;

impl Liar {
    fn start() -> Liar {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test starts a real sandbox: run it as root (CI does)");
        assert!(agent().is_file(), "hutch-agent not built: run `cargo build --workspace` first");
        let base = std::env::temp_dir().join(format!("hutch-ctl-passed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("state")).expect("mkdir state");
        let cfg =
            Config { state_dir: base.join("state"), run_dir: base.join("run"), agent: agent(), ..Config::from_env() };
        let rt = Runtime::new(cfg).expect("runtime");
        let spec = SandboxSpec {
            agent_override: Some(("/usr/bin/python3".into(), vec!["python3".into(), "-c".into(), SCRIPT.into()])),
            ..SandboxSpec::default()
        };
        let sb = rt.start(&spec).expect("start the liar");
        Liar { sb: Some(sb), _rt: rt, base }
    }

    fn fs(&self) -> SandboxFs {
        SandboxFs::new(self.sb.as_ref().expect("live").socket.clone(), None).passing_writes(true)
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("fd dir").count()
}

async fn collect(mut rx: Chunks) -> Result<Vec<u8>, FilesError> {
    let mut out = Vec::new();
    while let Some(c) = rx.recv().await {
        out.extend(c?);
    }
    Ok(out)
}

/// Bounds a call that must not hang: a hang fails the test instead of
/// stalling it.
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f).await.expect("the host gave up instead of hanging")
}

#[tokio::test]
async fn a_hostile_agent_passing_anything_but_one_regular_file_is_refused_and_nothing_leaks() {
    let liar = Liar::start();
    let fs = liar.fs();
    // Warm up what the runtime and tokio open once, then count.
    let _ = bounded(fs.read("/x")).await;
    let before = open_fds();
    for kind in ["none", "two", "many", "pipe", "devnull", "dir", "socket", "proc", "rdwr", "wronly"] {
        let r = bounded(async { collect(fs.read_stream("/x").await?).await }).await;
        match r {
            Err(e) => assert_eq!(e.code, ErrorCode::Internal, "{kind}: {e:?}"),
            Ok(data) => panic!("{kind}: a read through junk succeeded with {data:?}"),
        }
        assert_eq!(open_fds(), before, "{kind}: descriptors leaked");
    }
    // The harness is honest: a well-formed pass reads the liar's file.
    let got = bounded(async { collect(fs.read_stream("/x").await?).await }).await.expect("a valid pass");
    assert_eq!(got, b"hello");
    // A write through a well-formed pass works too; the liar's next answers
    // are all that last one, so the junk cases above covered refusals.
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tx.send(Ok(b"HELLO".to_vec())).await.expect("send");
    drop(tx);
    assert_eq!(bounded(fs.write_stream("/y", rx)).await.expect("write"), 5);
    assert_eq!(open_fds(), before, "descriptors leaked");
}
