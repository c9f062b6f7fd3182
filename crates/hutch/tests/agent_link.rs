//! The host-agent link inside a real sandbox: file operations stay inside
//! the sandbox root, a timeout kills a command's whole tree while the
//! sandbox lives on, and a hostile agent cannot crash, hang or leak the host.

mod common;

use common::*;
use hutch_agent::proto::{Cmd, ErrorCode, ExitStatus, FromAgent, Reply, Request, Spawn, Stream, WriteFile};
use hutch_runtime::agent::{AgentConn, AgentError};
use hutch_runtime::cgroup::Limits;
use hutch_runtime::{Runtime, SandboxSpec};
use std::time::Duration;

fn spawn(cmd: &str, user: &str, timeout_ms: Option<u64>) -> Request {
    Request::Spawn(Spawn {
        cmd: Cmd::Shell(cmd.into()),
        env: vec![],
        cwd: None,
        user: Some(user.into()),
        stdin: false,
        pty: None,
        tag: None,
        timeout_ms,
        subscribe: true,
        output_limit: None,
    })
}

/// Runs a shell command to completion; returns (stdout, status).
fn sh(conn: &mut AgentConn, cmd: &str, user: &str, timeout_ms: Option<u64>) -> (String, ExitStatus) {
    let (reply, _) = conn.call(spawn(cmd, user, timeout_ms), &[]).expect("spawn");
    let Reply::Spawned { pid } = reply else { panic!("unexpected {reply:?}") };
    let mut out = Vec::new();
    loop {
        let (msg, data) = conn.recv(Some(Duration::from_secs(30))).expect("recv");
        match msg {
            FromAgent::Output { pid: p, stream: Stream::Stdout } if p == pid => out.extend(data),
            FromAgent::Exit { pid: p, status } if p == pid => {
                return (String::from_utf8_lossy(&out).into_owned(), status)
            }
            _ => {}
        }
    }
}

fn refused(r: Result<(Reply, Vec<u8>), AgentError>) -> ErrorCode {
    match r {
        Err(AgentError::Refused { code, .. }) => code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn file_operations_never_follow_a_symlink_out_of_the_sandbox() {
    let env = Env::new("link-files");
    let rt = runtime(&env);
    let sb = start(&rt, &SandboxSpec::default());
    let mut conn = sb.connect().expect("connect");
    let (_, st) = sh(
        &mut conn,
        "ln -s /etc/passwd /workspace/to-passwd; ln -s /proc/1/root /workspace/to-root; ln -s ../../../../../../etc /workspace/up",
        "user",
        None,
    );
    assert_eq!(st.code, Some(0));
    // An absolute link resolves inside the sandbox: its passwd, not the host's.
    let read = |conn: &mut AgentConn, path: &str| {
        conn.call(Request::ReadFile { path: path.into(), offset: 0, len: 1 << 20, user: None }, &[])
    };
    let (_, data) = read(&mut conn, "/workspace/to-passwd").expect("read through link");
    let text = String::from_utf8_lossy(&data);
    assert!(text.contains("user:x:1000:1000"), "{text}");
    assert_eq!(text, hutch_runtime::rootfs::PASSWD);
    // `..` past the root stays at the sandbox's root.
    let (_, data) = read(&mut conn, "/workspace/up/passwd").expect("read through ../ link");
    assert_eq!(String::from_utf8_lossy(&data), hutch_runtime::rootfs::PASSWD);
    // /proc magic links would leave the root: refused.
    assert_eq!(refused(read(&mut conn, "/workspace/to-root/etc/hostname")), ErrorCode::SymlinkRefused);
    // Paths with `..` or NUL are refused outright.
    assert_eq!(refused(read(&mut conn, "/workspace/../etc/passwd")), ErrorCode::InvalidPath);
    assert_eq!(refused(read(&mut conn, "/etc/pass\0wd")), ErrorCode::InvalidPath);
    // Writes through a link land inside the sandbox too.
    let w = WriteFile { path: "/workspace/up/evil".into(), truncate: true, ..blank_write() };
    let r = conn.call(Request::WriteFile(w), b"x");
    if r.is_ok() {
        let (_, data) = read(&mut conn, "/etc/evil").expect("written inside");
        assert_eq!(data, b"x");
    }
    assert!(!std::path::Path::new("/etc/evil").exists(), "a write escaped to the host");
}

fn blank_write() -> WriteFile {
    WriteFile { path: String::new(), offset: 0, truncate: false, append: false, parents: false, mode: None, user: None }
}

#[test]
fn file_operations_round_trip_as_the_sandbox_user() {
    let env = Env::new("link-fileops");
    let rt = runtime(&env);
    // The writable layer is memory-backed: keep it below the memory limit.
    let sb = start(&rt, &SandboxSpec { disk_bytes: 64 << 20, ..SandboxSpec::default() });
    let mut conn = sb.connect().expect("connect");
    let w = WriteFile { path: "/workspace/a/b/c.txt".into(), parents: true, truncate: true, ..blank_write() };
    conn.call(Request::WriteFile(w), b"hello").expect("write");
    let (reply, _) = conn.call(Request::Stat { path: "/workspace/a/b/c.txt".into(), user: None }, &[]).expect("stat");
    let Reply::Stat { entry } = reply else { panic!("{reply:?}") };
    assert_eq!((entry.size, entry.uid), (5, 1000));
    let (reply, _) =
        conn.call(Request::ListDir { path: "/workspace".into(), depth: 3, user: None }, &[]).expect("list");
    let Reply::Entries { entries, .. } = reply else { panic!("{reply:?}") };
    let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["/workspace/a", "/workspace/a/b", "/workspace/a/b/c.txt"]);
    conn.call(
        Request::Rename {
            from: "/workspace/a/b/c.txt".into(),
            to: "/workspace/d.txt".into(),
            user: None,
            commit: false,
        },
        &[],
    )
    .expect("rename");
    let (out, _) = sh(&mut conn, "cat /workspace/d.txt; stat -c %U /workspace/d.txt", "user", None);
    assert_eq!(out, "hellouser\n");
    conn.call(Request::Remove { path: "/workspace/a".into(), user: None }, &[]).expect("remove");
    let r = conn.call(Request::Stat { path: "/workspace/a".into(), user: None }, &[]);
    assert_eq!(refused(r), ErrorCode::NotFound);
    // The sandbox user cannot read root's files through the API.
    let r = conn.call(Request::ReadFile { path: "/etc/shadow".into(), offset: 0, len: 100, user: None }, &[]);
    assert_eq!(refused(r), ErrorCode::PermissionDenied);
    // A full writable layer is reported as such.
    let w = WriteFile { path: "/workspace/big".into(), truncate: true, ..blank_write() };
    let chunk = vec![7u8; 4 << 20];
    let mut full = None;
    for i in 0..64u64 {
        let w = WriteFile { offset: i * chunk.len() as u64, truncate: false, ..w.clone() };
        if let Err(e) = conn.call(Request::WriteFile(w), &chunk) {
            full = Some(e);
            break;
        }
    }
    match full {
        Some(AgentError::Refused { code: ErrorCode::NoSpace, .. }) => {}
        other => panic!("expected no_space from a 64 MiB layer, got {other:?}"),
    }
}

#[test]
fn timeout_kills_the_commands_whole_tree_and_the_sandbox_lives_on() {
    let env = Env::new("link-timeout");
    let rt = runtime(&env);
    let sb = start(&rt, &SandboxSpec::default());
    let mut conn = sb.connect().expect("connect");
    let (_, st) =
        sh(&mut conn, "setsid sleep 7343 & (setsid sh -c 'sleep 7343 & wait' &); sleep 7343", "user", Some(500));
    assert!(st.timed_out, "{st:?}");
    // The exit of a killed command comes once its whole tree is gone.
    let (out, _) = sh(&mut conn, "pgrep -c -f 'sleep [7]343' || true", "user", None);
    assert_eq!(out.trim(), "0", "descendants survived the timeout");
    // A background process of a finished command keeps running.
    let (_, st) = sh(&mut conn, "setsid sleep 7344 >/dev/null 2>&1 &", "user", None);
    assert_eq!(st.code, Some(0));
    // It execs sleep a moment after its shell exited: wait for that.
    let (out, _) =
        sh(&mut conn, "for i in $(seq 500); do pgrep -f 'sleep [7]344' && break; sleep 0.02; done", "user", None);
    assert_eq!(out.lines().count(), 1, "{out}");
}

#[test]
fn processes_outlive_the_client_that_started_them() {
    let env = Env::new("link-detach");
    let rt = runtime(&env);
    let sb = start(&rt, &SandboxSpec::default());
    let mut first = sb.connect().expect("connect");
    // It prints, marks that it did, and waits for the test to let it go on.
    let req = Request::Spawn(Spawn {
        cmd: Cmd::Shell(
            "echo tick 1; touch /tmp/printed; while [ ! -e /tmp/go ]; do sleep 0.01; done; echo tick 2".into(),
        ),
        env: vec![],
        cwd: None,
        user: None,
        stdin: false,
        pty: None,
        tag: Some("ticker".into()),
        timeout_ms: None,
        // Output nobody is attached to is kept for replay.
        subscribe: false,
        output_limit: None,
    });
    let (reply, _) = first.call(req, &[]).expect("spawn");
    let Reply::Spawned { pid } = reply else { panic!("{reply:?}") };
    drop(first);
    let mut second = sb.connect().expect("reconnect");
    let stat =
        |conn: &mut AgentConn, path: &str| conn.call(Request::Stat { path: path.into(), user: None }, &[]).is_ok();
    wait_for("the first line", Duration::from_secs(10), || stat(&mut second, "/tmp/printed"));
    let (reply, _) =
        second.call(Request::Attach { target: hutch_agent::proto::Target::Tag("ticker".into()) }, &[]).expect("attach");
    assert_eq!(reply, Reply::Attached { pid });
    let go = WriteFile { path: "/tmp/go".into(), truncate: true, ..blank_write() };
    second.call(Request::WriteFile(go), b"").expect("open the gate");
    let mut out = Vec::new();
    loop {
        let (msg, data) = second.recv(Some(Duration::from_secs(10))).expect("recv");
        match msg {
            FromAgent::Output { pid: p, .. } if p == pid => out.extend(data),
            FromAgent::Exit { pid: p, status } if p == pid => {
                assert_eq!(status.code, Some(0));
                break;
            }
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&out);
    // Output from before the attach was kept and replayed.
    assert_eq!(text, "tick 1\ntick 2\n");
}

/// A liar in the agent's place: Python run as PID 1, speaking garbage.
fn liar(rt: &Runtime, script: &str) -> Guard {
    let spec = SandboxSpec {
        agent_override: Some(("/usr/bin/python3".into(), vec!["python3".into(), "-c".into(), script.into()])),
        ..SandboxSpec::default()
    };
    start(rt, &spec)
}

const ACCEPT: &str = "import socket, struct, time\ns = socket.socket(fileno=3)\nc, _ = s.accept()\nc.recv(65536)\n";

#[test]
fn a_hostile_agent_cannot_crash_hang_or_bloat_the_host() {
    let env = Env::new("liar");
    let rt = runtime(&env);
    // An oversized length word: refused before any allocation.
    let sb = liar(&rt, &format!("{ACCEPT}c.sendall(struct.pack('<I', 0xffffffff) + b'x' * 64)\ntime.sleep(30)"));
    let mut conn = sb.connect().expect("connect");
    match conn.call(Request::Ping, &[]) {
        Err(AgentError::Protocol(_)) => {}
        other => panic!("oversized frame not refused: {other:?}"),
    }
    drop(sb);
    // A header that is not a message.
    let sb = liar(&rt, &format!("{ACCEPT}h = b'{{\"kind\":\"format_disk\"}}'\nc.sendall(struct.pack('<II', 4 + len(h), len(h)) + h)\ntime.sleep(30)"));
    let mut conn = sb.connect().expect("connect");
    assert!(matches!(conn.call(Request::Ping, &[]), Err(AgentError::Protocol(_))));
    drop(sb);
    // A header length beyond the frame.
    let sb = liar(&rt, &format!("{ACCEPT}c.sendall(struct.pack('<II', 8, 1 << 30) + b'xxxx')\ntime.sleep(30)"));
    let mut conn = sb.connect().expect("connect");
    assert!(matches!(conn.call(Request::Ping, &[]), Err(AgentError::Protocol(_))));
    drop(sb);
    // Silence: the host gives up at its deadline instead of hanging.
    let sb = liar(&rt, &format!("{ACCEPT}time.sleep(30)"));
    let mut conn = sb.connect().expect("connect");
    conn.set_reply_timeout(Duration::from_millis(300));
    // A timeout, not the connection's end 30 s later when the liar exits.
    assert!(matches!(conn.call(Request::Ping, &[]), Err(AgentError::Timeout(_))));
    drop(sb);
    // A flood of unsolicited messages is bounded too.
    let flood = "h = b'{\"kind\":\"dropped\",\"pid\":1,\"stream\":\"stdout\",\"bytes\":1}'\nf = struct.pack('<II', 4 + len(h), len(h)) + h\nc.sendall(f * 10000)\ntime.sleep(30)";
    let sb = liar(&rt, &format!("{ACCEPT}{flood}"));
    let mut conn = sb.connect().expect("connect");
    assert!(conn.call(Request::Ping, &[]).is_err());
    drop(sb);
    env.assert_no_residue();
}

#[test]
fn freeze_stops_every_process_and_thaw_resumes_them() {
    let env = Env::new("link-freeze");
    let rt = runtime(&env);
    let sb = start(&rt, &SandboxSpec::default());
    let mut conn = sb.connect().expect("connect");
    let (_, st) =
        sh(&mut conn, "(while :; do date +%s%N >> /tmp/ticks; sleep 0.01; done) >/dev/null 2>&1 &", "user", None);
    assert_eq!(st.code, Some(0));
    let count = |conn: &mut AgentConn| -> usize {
        // Not there before the loop's first tick.
        let data = conn
            .call(Request::ReadFile { path: "/tmp/ticks".into(), offset: 0, len: 1 << 20, user: None }, &[])
            .map(|(_, data)| data)
            .unwrap_or_default();
        data.iter().filter(|b| **b == b'\n').count()
    };
    wait_for("the loop to tick", Duration::from_secs(10), || count(&mut conn) >= 2);
    assert!(!frozen(&sb.id));
    sb.freeze().expect("freeze");
    // The kernel's own word that every process of the sandbox, the loop
    // among them, is stopped: no wait could show it better.
    assert!(frozen(&sb.id), "freeze returned, but the cgroup is not frozen");
    sb.thaw().expect("thaw");
    assert!(!frozen(&sb.id), "thaw returned, but the cgroup is still frozen");
    let after = count(&mut conn);
    wait_for("the loop to tick again after thaw", Duration::from_secs(10), || count(&mut conn) > after);
}

/// Issue 10, finding 12: a workload that fills the sandbox's memory, here
/// with a file in RAM-backed /tmp, is OOM-killed in its own cgroup; the
/// agent is not, and its exit status says what happened.
#[test]
fn filling_memory_kills_the_command_never_the_agent() {
    let env = Env::new("link-oom");
    let rt = runtime(&env);
    let defaults = SandboxSpec::default();
    let spec = SandboxSpec { limits: Limits { memory_bytes: 128 << 20, ..defaults.limits }, ..defaults };
    let sb = start(&rt, &spec);
    let mut conn = sb.connect().expect("connect");
    let (out, _) = sh(&mut conn, "cat /proc/self/cgroup", "user", None);
    assert!(out.lines().any(|l| l.ends_with("/work")), "commands run in the workload's cgroup: {out}");
    let (_, st) = sh(&mut conn, "head -c 400M /dev/zero > /tmp/fill", "user", Some(120_000));
    assert!(st.oom_killed && st.signal == Some(libc::SIGKILL) && !st.timed_out, "{st:?}");
    assert!(sb.cgroup.oom_kills() >= 1);
    assert!(sb.is_alive());
    // The agent still answers; the file's pages stay charged to the workload
    // until it goes.
    conn.call(Request::Remove { path: "/tmp/fill".into(), user: None }, &[]).expect("remove");
    // The killed writer's last close of the file is deferred by the kernel
    // (an exiting task's final fput runs from a work queue), so the space
    // comes back shortly after its exit: wait for it.
    wait_until("the removed file's space to come back", Duration::from_secs(10), || {
        sb.usage().disk_used_bytes < 32 << 20
    });
    let (out, st) = sh(&mut conn, "echo alive", "user", None);
    assert_eq!((out.as_str(), st.oom_killed), ("alive\n", false));
    // A SIGKILL that is not the OOM killer's is not reported as one.
    let (_, st) = sh(&mut conn, "kill -9 $$", "user", None);
    assert!(st.signal == Some(libc::SIGKILL) && !st.oom_killed, "{st:?}");
}

/// Issue 16: a daemon keeps an ended sandbox's cgroup for the next one
/// (no memory cgroup made or taken offline). The next sandbox gets it
/// empty, under its own limits, with its counters from zero, though the
/// last one was OOM-killed in it; and nothing of it is left once the
/// runtime goes.
#[test]
fn a_kept_cgroup_serves_the_next_sandbox_from_zero() {
    let env = Env::new("link-spare");
    let rt = runtime(&env).keep_cgroups(4);
    let Some(spares) = rt.spares().cloned() else {
        // Only cgroup v1 renames a cgroup: elsewhere every sandbox gets a
        // new one, which the other tests cover.
        let layout = hutch_runtime::cgroup::Layout::detect(std::path::Path::new("/sys/fs/cgroup")).expect("layout");
        assert!(!matches!(layout.memory, Some(hutch_runtime::cgroup::Placement::V1(_))), "v1 memory keeps cgroups");
        return;
    };
    let layout = hutch_runtime::cgroup::Layout::detect(std::path::Path::new("/sys/fs/cgroup")).expect("layout");
    let Some(hutch_runtime::cgroup::Placement::V1(memory_root)) = layout.memory else {
        unreachable!("kept cgroups need v1 memory")
    };
    let dir = |name: &str| memory_root.join(hutch_runtime::cgroup::PARENT).join(name);
    let spare_dirs = || -> Vec<String> {
        std::fs::read_dir(dir(""))
            .expect("read hutch/")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('_'))
            .collect()
    };
    let before = spare_dirs();
    let defaults = SandboxSpec::default();

    let mut first =
        start(&rt, &SandboxSpec { limits: Limits { memory_bytes: 128 << 20, ..defaults.limits }, ..defaults.clone() });
    let mut conn = first.connect().expect("connect");
    let (_, st) = sh(&mut conn, "head -c 400M /dev/zero > /tmp/fill", "user", Some(120_000));
    assert!(st.oom_killed, "{st:?}");
    assert!(first.cgroup.oom_kills() >= 1);
    drop(conn);
    let first_id = first.id.clone();
    first.0.take().expect("live").destroy().expect("destroy");
    assert!(!dir(&first_id).exists(), "the ended sandbox's name is gone");
    assert_eq!(spares.len(), 1, "its cgroup was kept");
    let kept: Vec<String> = spare_dirs().into_iter().filter(|n| !before.contains(n)).collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let usage: u64 = std::fs::read_to_string(dir(&kept[0]).join("memory.usage_in_bytes"))
        .expect("usage")
        .trim()
        .parse()
        .expect("number");
    assert!(usage <= hutch_runtime::cgroup::SPARE_CHARGE_BYTES, "the last sandbox's charges were reclaimed: {usage}");

    let second = start(
        &rt,
        &SandboxSpec { limits: Limits { memory_bytes: 256 << 20, pids: 50, ..defaults.limits }, ..defaults },
    );
    assert_eq!(spares.len(), 0, "the next sandbox took it");
    assert!(!dir(&kept[0]).exists() && dir(&second.id).join("work").is_dir());
    let read = |p: &str| std::fs::read_to_string(dir(&second.id).join(p)).expect(p).trim().to_owned();
    assert_eq!(read("work/memory.limit_in_bytes"), (256u64 << 20).to_string());
    assert_eq!(second.cgroup.oom_kills(), 0, "the last sandbox's OOM kill is not this one's");
    let mut conn = second.connect().expect("connect");
    let (out, st) = sh(&mut conn, "head -c 200M /dev/zero > /tmp/fill && echo written", "user", Some(120_000));
    assert_eq!((out.as_str(), st.oom_killed), ("written\n", false), "its own, larger limit holds: {st:?}");
    drop(conn);
    drop(second);
    assert_eq!(spares.len(), 1);
    drop(rt);
    assert_eq!(spare_dirs(), before, "the runtime's kept cgroups go with it");
}
