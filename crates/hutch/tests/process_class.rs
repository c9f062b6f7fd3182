//! The `process` class at the runtime's level: tenants of one host
//! container cannot read, write or signal each other, see each other's
//! processes, or pass their own limits; deleting one leaves nothing of it.

mod common;

use common::*;
use hutch_agent::proto::{Cmd, ErrorCode, ExitStatus, FromAgent, Reply, Request, Spawn, Stream, WriteFile};
use hutch_runtime::agent::{AgentConn, AgentError};
use hutch_runtime::cgroup::Limits;
use hutch_runtime::{ProcessSpec, Runtime, SandboxSpec};
use std::time::Duration;

fn spawn(cmd: &str, subscribe: bool) -> Request {
    Request::Spawn(Spawn {
        cmd: Cmd::Shell(cmd.into()),
        env: vec![],
        cwd: None,
        user: None,
        stdin: false,
        pty: None,
        tag: None,
        timeout_ms: Some(60_000),
        subscribe,
        output_limit: None,
    })
}

/// Runs a shell command to completion; returns (stdout+stderr, status).
fn sh(conn: &mut AgentConn, cmd: &str) -> (String, ExitStatus) {
    let (reply, _) = conn.call(spawn(cmd, true), &[]).expect("spawn");
    let Reply::Spawned { pid } = reply else { panic!("unexpected {reply:?}") };
    let mut out = Vec::new();
    loop {
        let (msg, data) = conn.recv(Some(Duration::from_secs(60))).expect("recv");
        match msg {
            FromAgent::Output { pid: p, stream: Stream::Stdout | Stream::Stderr } if p == pid => out.extend(data),
            FromAgent::Exit { pid: p, status } if p == pid => {
                return (String::from_utf8_lossy(&out).into_owned(), status)
            }
            _ => {}
        }
    }
}

fn ok(conn: &mut AgentConn, cmd: &str) -> String {
    let (out, st) = sh(conn, cmd);
    assert_eq!(st.code, Some(0), "{cmd}: {out}");
    out
}

fn refused(r: Result<(Reply, Vec<u8>), AgentError>) -> ErrorCode {
    match r {
        Err(AgentError::Refused { code, .. }) => code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn tenant(rt: &Runtime, host: &hutch_runtime::Sandbox, id: &str, limits: Limits) -> Guard {
    let spec = ProcessSpec { id: Some(id.into()), limits, env: vec![("FROM_TENANT".into(), id.into())] };
    Guard(Some(rt.start_tenant(host, &spec).expect("start tenant")))
}

const LIMITS: Limits = Limits { memory_bytes: 128 << 20, pids: 64, cpu_millis: 1000 };

fn host(rt: &Runtime) -> Guard {
    let spec = SandboxSpec {
        limits: Limits { memory_bytes: 1 << 30, pids: 4096, cpu_millis: 2000 },
        disk_bytes: 256 << 20,
        ..SandboxSpec::default()
    };
    Guard(Some(rt.start_host(&spec).expect("start host container")))
}

#[test]
fn tenants_cannot_reach_each_other() {
    let env = Env::new("proc-isolation");
    let rt = runtime(&env);
    let host = host(&rt);
    let a = tenant(&rt, &host, "ta", LIMITS);
    let b = tenant(&rt, &host, "tb", LIMITS);
    let mut ca = a.connect().expect("connect a");
    let mut cb = b.connect().expect("connect b");

    // Each runs as a uid of its own, in its home, with its environment.
    let out = ok(&mut ca, "id -u; id -G; pwd; echo $HOME $TMPDIR $FROM_TENANT");
    let lines: Vec<&str> = out.lines().collect();
    let uid_a: u32 = lines[0].parse().expect("uid");
    assert!(uid_a >= 10_000, "{out}");
    assert_eq!(lines[1], lines[0], "no supplementary groups: {out}");
    assert_eq!(lines[2], "/home/ta");
    assert_eq!(lines[3], "/home/ta /tmp/ta ta");
    let uid_b: u32 = ok(&mut cb, "id -u").trim().parse().expect("uid");
    assert_ne!(uid_a, uid_b);

    // Own home and /tmp are writable; the other's are neither readable nor
    // writable; the shared root and the shared /tmp are not writable.
    ok(&mut ca, "echo secret > ~/s && echo t > $TMPDIR/t && cat ~/s $TMPDIR/t");
    for cmd in [
        "cat /home/ta/s",
        "ls /home/ta",
        "touch /home/ta/x",
        "cat /tmp/ta/t",
        "touch /tmp/x",
        "touch /dev/shm/x",
        "touch /var/tmp/x",
        "touch /etc/x",
        "mkdir /workspace/x",
    ] {
        let (out, st) = sh(&mut cb, cmd);
        assert_ne!(st.code, Some(0), "tenant b could: {cmd}: {out}");
    }
    // Landlock holds even where DAC would allow: a directory b owns
    // elsewhere cannot exist, and writing through /proc/self/root is refused.
    let (out, st) = sh(&mut cb, "echo x > /proc/self/root/tmp/y");
    assert_ne!(st.code, Some(0), "{out}");

    // The file API is the tenant's too.
    let read = |c: &mut AgentConn, path: &str| {
        c.call(Request::ReadFile { path: path.into(), offset: 0, len: 1 << 20, user: None }, &[])
    };
    assert_eq!(read(&mut ca, "/home/ta/s").expect("own file").1, b"secret\n");
    assert_eq!(read(&mut ca, "s").expect("relative to home").1, b"secret\n");
    assert_eq!(refused(read(&mut cb, "/home/ta/s")), ErrorCode::PermissionDenied);
    let w = WriteFile {
        path: "/home/ta/planted".into(),
        offset: 0,
        truncate: true,
        append: false,
        parents: false,
        mode: None,
        user: None,
    };
    assert_eq!(refused(cb.call(Request::WriteFile(w.clone()), b"x")), ErrorCode::PermissionDenied);
    for path in ["/tmp/planted", "/etc/planted"] {
        let w = WriteFile { path: path.into(), ..w.clone() };
        assert_eq!(refused(cb.call(Request::WriteFile(w), b"x")), ErrorCode::PermissionDenied, "{path}");
    }
    let w = WriteFile { path: "/home/tb/mine".into(), ..w.clone() };
    cb.call(Request::WriteFile(w), b"mine").expect("write own home");
    assert_eq!(ok(&mut cb, "stat -c %u ~/mine").trim(), uid_b.to_string());
    // Root is not a tenant's to ask for.
    let mut as_root = spawn("id -u", false);
    if let Request::Spawn(s) = &mut as_root {
        s.user = Some("root".into());
    }
    assert_eq!(refused(cb.call(as_root, &[])), ErrorCode::Unsupported);

    // a's long-running process: b cannot see it, list it, or signal it.
    let (reply, _) = ca.call(spawn("exec sleep 600", false), &[]).expect("spawn sleep");
    let Reply::Spawned { pid } = reply else { panic!("{reply:?}") };
    let (out, _) = sh(&mut cb, &format!("test -e /proc/{pid} && echo visible; kill -9 {pid}; echo rc=$?"));
    assert!(!out.contains("visible"), "{out}");
    assert!(out.contains("rc=1"), "{out}");
    let (reply, _) = cb.call(Request::List, &[]).expect("list");
    let Reply::Processes { processes } = reply else { panic!("{reply:?}") };
    assert!(processes.iter().all(|p| p.pid != pid), "b lists a's process");
    assert_eq!(refused(cb.call(Request::Signal { pid, signal: 9 }, &[])), ErrorCode::UnknownProcess);
    // Nor can it reach the host's own agent operations.
    let spec = hutch_agent::proto::TenantSpec {
        name: "evil".into(),
        cgroups: 1,
        oom_events: false,
        tree_cgroups: 0,
        env: vec![],
        max_commands: 1,
        rlimits: vec![],
    };
    assert_eq!(refused(cb.call(Request::AddTenant(spec), &[])), ErrorCode::InvalidRequest);
    assert_eq!(refused(cb.call(Request::RemoveTenant { name: "ta".into() }, &[])), ErrorCode::InvalidRequest);
    // a's process is alive and in a's cgroup.
    let (reply, _) = ca.call(Request::List, &[]).expect("list");
    let Reply::Processes { processes } = reply else { panic!("{reply:?}") };
    assert!(processes.iter().any(|p| p.pid == pid && p.exited.is_none()), "{processes:?}");

    // Deleting a kills its processes and removes its directories.
    drop(ca);
    drop(a);
    assert_eq!(ok(&mut cb, "test -e /home/ta || echo gone; test -e /tmp/ta || echo gone2").trim(), "gone\ngone2");
    ok(&mut cb, "true");
}

#[test]
fn a_tenant_is_held_to_its_own_limits() {
    let env = Env::new("proc-limits");
    let rt = runtime(&env);
    let host = host(&rt);
    let a = tenant(&rt, &host, "la", Limits { memory_bytes: 64 << 20, pids: 16, cpu_millis: 1000 });
    let b = tenant(&rt, &host, "lb", LIMITS);
    let mut ca = a.connect().expect("connect a");
    let mut cb = b.connect().expect("connect b");
    // A fork bomb meets a's pids limit; b runs on.
    // (RLIMIT_NPROC, at the pids limit too, refuses it first: EAGAIN.)
    let (out, _) = sh(&mut ca, "for i in $(seq 64); do sleep 8 & done 2>&1; echo forked");
    assert!(out.contains("Resource temporarily unavailable"), "{out}");
    let held = std::fs::read_to_string(a.cgroup.work_procs_files()[0].clone()).expect("cgroup.procs");
    assert!(held.lines().count() <= 16, "{held}");
    ok(&mut cb, "for i in $(seq 20); do sleep 0 & done; wait");
    // Memory past a's limit is an OOM kill of a's, not b's.
    let (_, st) = sh(&mut ca, "pkill sleep; head -c 200m /dev/zero | tail > /dev/null");
    assert_ne!(st.code, Some(0));
    assert!(a.cgroup.oom_kills() > 0);
    assert_eq!(ok(&mut cb, "echo fine").trim(), "fine");
}

#[test]
fn a_tenants_commands_get_cgroups_of_their_own_while_one_is_free() {
    let env = Env::new("proc-trees");
    let rt = runtime(&env);
    let host = host(&rt);
    let a = tenant(&rt, &host, "tt", LIMITS);
    let mut c = a.connect().expect("connect");
    // The command's v2 cgroup (relative to the host container's cgroup
    // namespace) and its parent.
    let probe = |c: &mut AgentConn| -> (String, String) {
        let out = ok(c, "grep '^0::' /proc/self/cgroup; echo $PPID");
        let mut lines = out.lines().map(str::to_owned);
        (lines.next().unwrap_or_default(), lines.next().unwrap_or_default())
    };
    let own = |line: &str| line.ends_with("/tt/c0") || line.ends_with("/tt/c1");
    let (cgroup, parent) = probe(&mut c);
    if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        // A pure v2 host: every command has a supervisor for a parent.
        assert!(!own(&cgroup) && parent != "1", "{cgroup} {parent}");
        return;
    }
    // Hybrid: a cgroup the host made below the tenant's, and the host
    // container's agent (its PID 1) for a parent, not a supervisor.
    assert!(own(&cgroup), "{cgroup}");
    assert_eq!(parent, "1");
    // Two commands alive hold both; a third is supervised, in the
    // tenant's cgroup itself.
    let mut held = Vec::new();
    for _ in 0..2 {
        let (reply, _) = c.call(spawn("exec sleep 600", false), &[]).expect("spawn sleep");
        let Reply::Spawned { pid } = reply else { panic!("{reply:?}") };
        held.push(pid);
    }
    let (cgroup, parent) = probe(&mut c);
    assert!(cgroup.ends_with("/tt"), "{cgroup}");
    assert_ne!(parent, "1");
    // One ends: its cgroup serves the next command once its tree is gone.
    let (reply, _) = c.call(Request::Signal { pid: held[0], signal: 9 }, &[]).expect("signal");
    assert_eq!(reply, Reply::Ok);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (cgroup, parent) = probe(&mut c);
        if own(&cgroup) && parent == "1" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the cgroup was not given back: {cgroup} {parent}");
    }
    // Deleting the tenant removes the cgroups made for it.
    drop(c);
    drop(a);
    assert!(cgroups_named("tt").is_empty(), "{:?}", cgroups_named("tt"));
}
