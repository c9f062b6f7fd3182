//! End-to-end tests of the agent binary outside a sandbox: each test starts
//! the real binary with the host's start-up contract (fd 3 a listening
//! socket, fd 4 the config frame, fd 5 a lock file), talks the protocol to
//! it, and kills it at the end. The agent's root is the host's "/" here, and
//! commands run as root (the host has no "user"). Needs root, as CI has.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use hutch_agent::proto::{
    self, AgentConfig, Cmd, EntryKind, ErrorCode, ExitStatus, FromAgent, ProcessInfo, PtySize, Reply, Request, Spawn,
    Stream, Target, ToAgent, WatchKind, WriteFile,
};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A running agent; killed (by pid) and cleaned up on drop, also when a test fails.
struct Agent {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Agent {
        Agent::start_with(64)
    }

    fn start_with(max_commands: u32) -> Agent {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("hutch-agent-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let sock = dir.join("agent.sock");
        let listener = UnixListener::bind(&sock).expect("bind");
        let lock = File::create(dir.join("lock")).expect("lock file");

        let mut fds = [0i32; 2];
        // SAFETY: fds is a valid array of two ints.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: pipe2 returned two new descriptors that we now own.
        let (cfg_r, mut cfg_w) = unsafe {
            use std::os::fd::FromRawFd;
            (std::os::fd::OwnedFd::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
        };
        let cfg = AgentConfig {
            version: proto::PROTOCOL_VERSION,
            env: vec![("HUTCH_TEST".into(), "1".into())],
            root_caps: 0,
            replay_bytes: 65536,
            max_commands,
            work_cgroups: 0,
            oom_events: false,
            tree_cgroup: false,
        };
        let mut frame = Vec::new();
        proto::encode(&cfg, &[], &mut frame).expect("encode config");
        cfg_w.write_all(&frame).expect("write config");
        drop(cfg_w);

        let (l, c, k) = (listener.as_raw_fd(), cfg_r.as_raw_fd(), lock.as_raw_fd());
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hutch-agent"));
        cmd.arg0("hutch-agent").env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // SAFETY: the closure only calls async-signal-safe fcntl/dup2.
        unsafe {
            cmd.pre_exec(move || {
                let moved = [l, c, k].map(|fd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10));
                for (i, fd) in moved.into_iter().enumerate() {
                    if fd < 0 || libc::dup2(fd, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start the agent");
        Agent { child, dir, sock }
    }

    fn connect(&self) -> Client {
        let s = UnixStream::connect(&self.sock).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        Client { s, next: 1, queue: VecDeque::new(), buf: Vec::new(), pos: 0 }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }
}

/// Pids below `pid`, from /proc/<pid>/task/*/children.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut stack = vec![pid];
    while let Some(p) = stack.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else { continue };
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(c);
                stack.push(c);
            }
        }
    }
    out
}

/// Polls `cond` until it holds; fails the test after `timeout`. These tests
/// wait on conditions, never for a fixed time.
fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A process held by a pidfd, so that its end is seen without a race
/// against pid reuse or against its exec.
struct Pidfd(std::os::fd::OwnedFd);

impl Pidfd {
    /// None when the process is already gone.
    fn open(pid: u32) -> Option<Pidfd> {
        // SAFETY: pidfd_open takes no pointers.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "pidfd_open({pid}): {e}");
            return None;
        }
        // SAFETY: pidfd_open returned a new descriptor that we now own.
        Some(Pidfd(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) }))
    }

    /// Whether the process has ended (a zombie has), waiting at most `ms`.
    fn ended_within(&self, ms: i32) -> bool {
        let mut p = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: p is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::EINTR), "poll of a pidfd: {e}");
            return false;
        }
        n == 1
    }

    fn ended(&self) -> bool {
        self.ended_within(0)
    }

    /// Waits (at most 10 s) for the process to end.
    fn wait_ended(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.ended_within(1000) {
            assert!(Instant::now() < deadline, "{what} still runs");
        }
    }
}

/// Bytes `pid` wrote to its stdout pipe that the agent has not read yet.
fn unread_stdout(pid: u32) -> usize {
    use std::os::unix::fs::OpenOptionsExt;
    let pipe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/{pid}/fd/1"))
        .expect("open the command's stdout pipe");
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer given.
    assert_eq!(unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut n) }, 0, "FIONREAD");
    n as usize
}

/// Waits until `pid` has written `marker` (a file it makes after its output)
/// and the agent has read all of that output from the pipe: it is then in
/// the agent's keeping, as nobody's attached.
fn wait_output_taken(pid: u32, marker: &Path) {
    wait_for("the command's output", Duration::from_secs(10), || marker.exists());
    wait_for("the agent to read the output", Duration::from_secs(10), || unread_stdout(pid) == 0);
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Outside a pid namespace the agent's death does not end its
        // supervisors and their commands: stop them first, by pid.
        // The agent (a subreaper) reaps them; give it a moment to.
        let pid = self.child.id();
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let below = descendants(pid);
            if below.is_empty() || Instant::now() > deadline {
                break;
            }
            for p in below {
                // SAFETY: kill takes no pointers; p descends from our agent.
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: kill takes no pointers; the pid is our own child's.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Client {
    s: UnixStream,
    next: u64,
    /// Messages read while waiting for a reply.
    queue: VecDeque<(FromAgent, Vec<u8>)>,
    buf: Vec<u8>,
    pos: usize,
}

#[derive(Default, Debug)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    dropped: u64,
    /// The stream of each `Dropped` message, in order.
    dropped_on: Vec<Stream>,
    status: Option<ExitStatus>,
}

impl Client {
    fn send(&mut self, req: Request, data: &[u8]) -> u64 {
        let id = self.next;
        self.next += 1;
        let mut frame = Vec::new();
        proto::encode(&ToAgent { id, req }, data, &mut frame).expect("encode");
        self.s.write_all(&frame).expect("send");
        id
    }

    /// The next message from the socket; None on EOF.
    fn read_msg(&mut self) -> Option<(FromAgent, Vec<u8>)> {
        loop {
            if let Some(f) = proto::split_frame(&self.buf[self.pos..]).expect("valid frame from agent") {
                let msg = proto::parse_header::<FromAgent>(f.header).expect("valid header");
                let data = f.data.to_vec();
                self.pos += f.consumed;
                if self.pos > 8 << 20 {
                    self.buf.drain(..self.pos);
                    self.pos = 0;
                }
                return Some((msg, data));
            }
            let mut chunk = vec![0u8; 256 * 1024];
            let n = self.s.read(&mut chunk).expect("read from agent (timed out?)");
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    fn next_event(&mut self) -> (FromAgent, Vec<u8>) {
        match self.queue.pop_front() {
            Some(m) => m,
            None => self.read_msg().expect("agent closed the connection"),
        }
    }

    fn call(&mut self, req: Request, data: &[u8]) -> (Reply, Vec<u8>) {
        let id = self.send(req, data);
        loop {
            let (msg, data) = self.read_msg().expect("agent closed the connection");
            match msg {
                FromAgent::Reply { id: got, reply } if got == id => return (reply, data),
                other => self.queue.push_back((other, data)),
            }
        }
    }

    fn ok(&mut self, req: Request) {
        let (reply, _) = self.call(req, &[]);
        assert_eq!(reply, Reply::Ok);
    }

    fn spawn(&mut self, spawn: Spawn) -> u32 {
        match self.call(Request::Spawn(spawn), &[]).0 {
            Reply::Spawned { pid } => pid,
            other => panic!("spawn failed: {other:?}"),
        }
    }

    /// Output and exit of `pid`, up to its Exit message.
    fn collect(&mut self, pid: u32) -> Collected {
        let mut c = Collected::default();
        loop {
            match self.next_event() {
                (FromAgent::Output { pid: p, stream }, data) if p == pid => match stream {
                    Stream::Stdout => c.stdout.extend_from_slice(&data),
                    Stream::Stderr => c.stderr.extend_from_slice(&data),
                },
                (FromAgent::Dropped { pid: p, stream, bytes }, _) if p == pid => {
                    c.dropped += bytes;
                    c.dropped_on.push(stream);
                }
                (FromAgent::Exit { pid: p, status }, _) if p == pid => {
                    c.status = Some(status);
                    return c;
                }
                _ => {}
            }
        }
    }
}

fn root_spawn(cmd: Cmd) -> Spawn {
    Spawn {
        cmd,
        env: Vec::new(),
        cwd: Some("/".into()),
        user: Some("root".into()),
        stdin: false,
        pty: None,
        tag: None,
        timeout_ms: None,
        subscribe: true,
        output_limit: None,
    }
}

fn argv(args: &[&str]) -> Cmd {
    Cmd::Argv(args.iter().map(|s| s.to_string()).collect())
}

fn exited(code: i32) -> Option<ExitStatus> {
    Some(ExitStatus::exited(code))
}

/// The commands the agent lists.
fn listed(c: &mut Client) -> Vec<ProcessInfo> {
    match c.call(Request::List, &[]).0 {
        Reply::Processes { processes } => processes,
        other => panic!("list: {other:?}"),
    }
}

/// Waits until `pid` no longer runs our sleep (gone, a zombie, or another program).
fn wait_dead(pid: u32, what: &str) {
    wait_for(&format!("{what} {pid} to end"), Duration::from_secs(10), || !alive(pid));
}

/// Waits until `pid` runs sleep (a background job execs it a moment after
/// its shell reported the pid).
fn wait_sleeping(pid: u32) {
    wait_for(&format!("{pid} to run sleep"), Duration::from_secs(10), || alive(pid));
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains("(sleep)") && !s.contains(") Z"))
}

/// Polls the agent's list until `done` holds for it.
fn wait_listed(c: &mut Client, what: &str, done: impl Fn(&[ProcessInfo]) -> bool) -> Vec<ProcessInfo> {
    let mut last = Vec::new();
    wait_for(what, Duration::from_secs(15), || {
        last = listed(c);
        done(&last)
    });
    last
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("utf-8 temp path").to_string()
}

#[test]
fn ping_and_echo_run_as_root() {
    let agent = Agent::start();
    let mut c = agent.connect();
    assert_eq!(c.call(Request::Ping, &[]).0, Reply::Pong { version: proto::PROTOCOL_VERSION });
    let pid = c.spawn(root_spawn(argv(&["echo", "hi"])));
    let out = c.collect(pid);
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.status, exited(0));

    let mut s = root_spawn(Cmd::Shell("echo $HOME:$USER:$HUTCH_TEST:$FOO:$PWD; echo err >&2".into()));
    s.env = vec![("FOO".into(), "bar".into())];
    s.cwd = Some("/tmp".into());
    let pid = c.spawn(s);
    let out = c.collect(pid);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "/root:root:1:bar:/tmp\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status, exited(0));
}

#[test]
fn shell_reads_stdin_until_closed() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut s = root_spawn(Cmd::Shell("cat; echo done".into()));
    s.stdin = true;
    let pid = c.spawn(s);
    let (reply, _) = c.call(Request::Stdin { pid }, b"hello\n");
    assert_eq!(reply, Reply::Ok);
    c.ok(Request::CloseStdin { pid });
    let out = c.collect(pid);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\ndone\n");
    assert_eq!(out.status, exited(0));
}

#[test]
fn timeout_kills_the_whole_tree_including_setsid_descendants() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut s = root_spawn(argv(&["sh", "-c", "setsid sleep 100 & echo $!; sleep 100"]));
    s.timeout_ms = Some(500);
    let pid = c.spawn(s);
    let out = c.collect(pid);
    let status = out.status.expect("exit");
    assert!(status.timed_out, "{status:?}");
    assert_eq!(status.signal, Some(libc::SIGKILL));
    let text = String::from_utf8_lossy(&out.stdout);
    let orphan: u32 = text.trim().parse().expect("pid of the setsid'd sleep");
    // The exit comes once the whole tree is gone: nothing left to wait for.
    assert!(Pidfd::open(orphan).is_none_or(|p| p.ended()), "setsid'd sleep {orphan} survived the timeout");
}

#[test]
fn fifty_megabytes_of_output_arrive_in_full_and_in_order() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let pid = c.spawn(root_spawn(argv(&["seq", "1", "6500000"])));
    let out = c.collect(pid);
    assert_eq!(out.status, exited(0));
    let mut expected = Vec::with_capacity(52 << 20);
    for i in 1..=6_500_000u32 {
        writeln!(expected, "{i}").expect("vec write");
    }
    assert!(expected.len() > 50_000_000);
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected, "output differs from seq's");
}

#[test]
fn past_its_output_limit_a_stream_is_dropped_in_the_sandbox_and_the_loss_said_once() {
    let agent = Agent::start();
    let mut c = agent.connect();
    // Many reads' worth of stdout, a line of stderr under the limit.
    let mut s = root_spawn(Cmd::Shell("head -c 300000 /dev/zero; echo tail >&2".into()));
    s.output_limit = Some(1000);
    let pid = c.spawn(s);
    let out = c.collect(pid);
    assert_eq!(out.status, exited(0));
    assert_eq!(out.stdout, vec![0u8; 1000]);
    assert_eq!(out.stderr, b"tail\n");
    assert_eq!(out.dropped_on, vec![Stream::Stdout], "one loss message, for stdout only");
    assert!(out.dropped > 0 && out.dropped <= 299_000, "{} bytes said lost", out.dropped);
}

#[test]
fn missing_command_exits_127_with_a_message() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let pid = c.spawn(root_spawn(argv(&["hutch-no-such-command"])));
    let out = c.collect(pid);
    assert_eq!(out.status, exited(127));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "hutch: hutch-no-such-command: No such file or directory\n");
    let pid = c.spawn(root_spawn(argv(&["/nonexistent/tool"])));
    assert_eq!(c.collect(pid).status, exited(127));
}

#[test]
fn spawn_errors_are_replies_not_processes() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut s = root_spawn(argv(&["true"]));
    s.user = Some("hutch-no-such-user".into());
    assert!(matches!(c.call(Request::Spawn(s), &[]).0, Reply::Error { code: ErrorCode::UnknownUser, .. }));
    let mut s = root_spawn(argv(&["true"]));
    s.cwd = Some("/hutch-no-such-dir".into());
    assert!(matches!(c.call(Request::Spawn(s), &[]).0, Reply::Error { code: ErrorCode::NotFound, .. }));
    let mut s = root_spawn(argv(&["true"]));
    s.env = vec![("A=B".into(), "x".into())];
    assert!(matches!(c.call(Request::Spawn(s), &[]).0, Reply::Error { code: ErrorCode::InvalidRequest, .. }));
    let s = root_spawn(Cmd::Argv(Vec::new()));
    assert!(matches!(c.call(Request::Spawn(s), &[]).0, Reply::Error { code: ErrorCode::InvalidRequest, .. }));

    let mut s = root_spawn(argv(&["sleep", "100"]));
    s.tag = Some("t".into());
    let pid = c.spawn(s.clone());
    assert!(matches!(c.call(Request::Spawn(s), &[]).0, Reply::Error { code: ErrorCode::TagInUse, .. }));
    match c.call(Request::List, &[]).0 {
        Reply::Processes { processes } => {
            assert_eq!(processes.len(), 1);
            assert_eq!((processes[0].pid, processes[0].tag.as_deref()), (pid, Some("t")));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        c.call(Request::Signal { pid, signal: 0 }, &[]).0,
        Reply::Error { code: ErrorCode::InvalidRequest, .. }
    ));
    c.ok(Request::Signal { pid, signal: libc::SIGTERM });
    let status = c.collect(pid).status.expect("exit");
    assert_eq!((status.code, status.signal, status.timed_out), (None, Some(libc::SIGTERM), false));
    assert!(matches!(
        c.call(Request::Attach { target: Target::Pid(pid) }, &[]).0,
        Reply::Error { code: ErrorCode::UnknownProcess, .. }
    ));
}

#[test]
fn attach_replays_detach_buffers_and_processes_outlive_connections() {
    let agent = Agent::start();
    let mut c = agent.connect();

    // Each command prints, marks that it did, and then waits for its gate
    // file, so it is still running when the test attaches.
    let marker = |name: &str| agent.dir.join(format!("printed-{name}"));
    let gate = |name: &str| agent.dir.join(format!("go-{name}"));
    let gated = |print: &str, name: &str| {
        Cmd::Shell(format!(
            "{print}; touch {}; while [ ! -e {} ]; do sleep 0.01; done",
            marker(name).display(),
            gate(name).display()
        ))
    };
    let open = |name: &str| std::fs::write(gate(name), b"").expect("open the gate");

    // Output while nobody is attached is replayed on attach.
    let mut s = root_spawn(gated("echo replayed", "r"));
    s.subscribe = false;
    s.tag = Some("r".into());
    let pid = c.spawn(s);
    wait_output_taken(pid, &marker("r"));
    assert_eq!(c.call(Request::Attach { target: Target::Tag("r".into()) }, &[]).0, Reply::Attached { pid });
    open("r");
    let out = c.collect(pid);
    assert_eq!((out.stdout.as_slice(), out.dropped), (&b"replayed\n"[..], 0));
    assert_eq!(out.status, exited(0));

    // More than the replay buffer: the head is dropped and counted.
    let mut s = root_spawn(gated("head -c 100000 /dev/zero", "big"));
    s.subscribe = false;
    let pid = c.spawn(s);
    wait_output_taken(pid, &marker("big"));
    assert_eq!(c.call(Request::Attach { target: Target::Pid(pid) }, &[]).0, Reply::Attached { pid });
    open("big");
    let out = c.collect(pid);
    assert_eq!((out.stdout.len(), out.dropped), (65536, 100000 - 65536));

    // Detached output is kept for the next attach; a closed connection
    // neither kills the process nor loses it.
    // It prints only once detached: its own gate first.
    let first = format!("while [ ! -e {} ]; do sleep 0.01; done; echo late", gate("detached").display());
    let mut s = root_spawn(gated(&first, "d"));
    s.tag = Some("d".into());
    let pid = c.spawn(s);
    c.ok(Request::Detach { pid });
    drop(c);
    open("detached");
    wait_output_taken(pid, &marker("d"));
    let mut c = agent.connect();
    match c.call(Request::List, &[]).0 {
        Reply::Processes { processes } => assert!(processes.iter().any(|p| p.pid == pid)),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.call(Request::Attach { target: Target::Tag("d".into()) }, &[]).0, Reply::Attached { pid });
    open("d");
    let out = c.collect(pid);
    assert_eq!(out.stdout, b"late\n");
    assert_eq!(out.status, exited(0));
}

#[test]
fn pty_process_sees_a_terminal() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut s = root_spawn(Cmd::Shell("tty; echo $TERM; stty size".into()));
    s.pty = Some(PtySize { cols: 100, rows: 30 });
    let pid = c.spawn(s);
    let out = c.collect(pid);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("/dev/pts/"), "{text:?}");
    assert!(text.contains("xterm-256color"), "{text:?}");
    assert!(text.contains("30 100"), "{text:?}");
    assert_eq!(out.status, exited(0));
}

#[test]
fn file_operations_work_in_a_temp_dir() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let base = path_str(&agent.dir.join("files"));
    let root = Some("root".to_string());
    let write = |path: &str| WriteFile {
        path: path.into(),
        offset: 0,
        truncate: false,
        append: false,
        parents: false,
        mode: None,
        user: root.clone(),
    };

    let mkdir = |path: &str, parents: bool| Request::Mkdir { path: path.into(), parents, user: root.clone() };
    assert_eq!(c.call(mkdir(&format!("{base}/a/b"), true), &[]).0, Reply::Created { created: true });
    assert_eq!(c.call(mkdir(&format!("{base}/a/b"), true), &[]).0, Reply::Created { created: false });
    assert!(matches!(
        c.call(mkdir(&format!("{base}/a/b"), false), &[]).0,
        Reply::Error { code: ErrorCode::AlreadyExists, .. }
    ));

    let file = format!("{base}/a/b/f.txt");
    let (reply, _) = c.call(Request::WriteFile(write(&file)), b"hello world");
    assert_eq!(reply, Reply::Written { len: 11 });
    let mut w = write(&file);
    w.append = true;
    assert_eq!(c.call(Request::WriteFile(w), b"!").0, Reply::Written { len: 1 });
    let mut w = write(&format!("{base}/new/deep/g.txt"));
    w.parents = true;
    w.mode = Some(0o600);
    assert_eq!(c.call(Request::WriteFile(w), b"x").0, Reply::Written { len: 1 });

    let read = |path: &str, offset, len| Request::ReadFile { path: path.into(), offset, len, user: root.clone() };
    let (reply, data) = c.call(read(&file, 0, 1000), &[]);
    assert_eq!((reply, data.as_slice()), (Reply::Data { eof: true, size: 12 }, &b"hello world!"[..]));
    let (reply, data) = c.call(read(&file, 6, 5), &[]);
    assert_eq!((reply, data.as_slice()), (Reply::Data { eof: false, size: 12 }, &b"world"[..]));
    assert!(matches!(
        c.call(read(&format!("{base}/a"), 0, 10), &[]).0,
        Reply::Error { code: ErrorCode::IsADirectory, .. }
    ));

    match c.call(Request::Stat { path: file.clone(), user: root.clone() }, &[]).0 {
        Reply::Stat { entry } => {
            assert_eq!((entry.kind, entry.size, entry.name.as_str()), (EntryKind::File, 12, "f.txt"));
            assert_eq!(entry.mode, 0o644);
        }
        other => panic!("{other:?}"),
    }
    match c.call(Request::Stat { path: format!("{base}/new/deep/g.txt"), user: root.clone() }, &[]).0 {
        Reply::Stat { entry } => assert_eq!(entry.mode, 0o600),
        other => panic!("{other:?}"),
    }

    std::os::unix::fs::symlink("/etc/passwd", agent.dir.join("files/link")).expect("symlink");
    match c.call(Request::ListDir { path: base.clone(), depth: 3, user: root.clone() }, &[]).0 {
        Reply::Entries { entries, truncated } => {
            assert!(!truncated);
            let names: Vec<&str> = entries.iter().map(|e| e.path.strip_prefix(&base).unwrap_or("?")).collect();
            assert_eq!(names, ["/a", "/a/b", "/a/b/f.txt", "/link", "/new", "/new/deep", "/new/deep/g.txt"]);
            let link = &entries[3];
            assert_eq!((link.kind, link.target.as_deref()), (EntryKind::Symlink, Some("/etc/passwd")));
        }
        other => panic!("{other:?}"),
    }
    match c.call(Request::ListDir { path: base.clone(), depth: 1, user: root.clone() }, &[]).0 {
        Reply::Entries { entries, .. } => assert_eq!(entries.len(), 3),
        other => panic!("{other:?}"),
    }

    // The symlink is followed inside the root (here the host's /).
    let (reply, data) = c.call(read(&format!("{base}/link"), 0, 4096), &[]);
    assert!(matches!(reply, Reply::Data { .. }), "{reply:?}");
    assert!(data.starts_with(b"root:"));

    let renamed = format!("{base}/a/renamed.txt");
    c.ok(Request::Rename { from: file.clone(), to: renamed.clone(), user: root.clone(), commit: false });
    assert!(matches!(
        c.call(Request::Stat { path: file.clone(), user: root.clone() }, &[]).0,
        Reply::Error { code: ErrorCode::NotFound, .. }
    ));
    let mut attrs = std::collections::BTreeMap::new();
    attrs.insert("user.hutch".to_string(), "yes".to_string());
    let set = Request::SetXattrs { path: renamed.clone(), attrs: attrs.clone(), user: root.clone() };
    match c.call(set, &[]).0 {
        Reply::Ok => match c.call(Request::GetXattrs { path: renamed.clone(), user: root.clone() }, &[]).0 {
            Reply::Xattrs { attrs: got } => assert_eq!(got, attrs),
            other => panic!("{other:?}"),
        },
        // tmpfs without user xattrs (older kernels) refuses; that is the file system's call.
        Reply::Error { code: ErrorCode::Io, message } => assert!(message.contains("setxattr"), "{message}"),
        other => panic!("{other:?}"),
    }
    let mut bad = std::collections::BTreeMap::new();
    bad.insert("trusted.x".to_string(), "1".to_string());
    assert!(matches!(
        c.call(Request::SetXattrs { path: renamed.clone(), attrs: bad, user: root.clone() }, &[]).0,
        Reply::Error { code: ErrorCode::InvalidRequest, .. }
    ));

    c.ok(Request::Remove { path: format!("{base}/a"), user: root.clone() });
    c.ok(Request::Remove { path: format!("{base}/link"), user: root.clone() });
    assert!(!agent.dir.join("files/a").exists());
    assert!(Path::new("/etc/passwd").exists(), "removing a symlink must not touch its target");

    for bad in [format!("{base}/../etc/passwd"), String::new(), "a\0b".to_string()] {
        assert!(matches!(c.call(read(&bad, 0, 10), &[]).0, Reply::Error { code: ErrorCode::InvalidPath, .. }));
    }
    assert!(matches!(
        c.call(Request::Remove { path: "/".into(), user: root.clone() }, &[]).0,
        Reply::Error { code: ErrorCode::InvalidRequest, .. }
    ));
}

#[test]
fn watch_reports_created_files() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let dir = agent.dir.join("watched");
    std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
    let req = Request::Watch {
        path: path_str(&dir),
        recursive: true,
        user: Some("root".into()),
        allow_network_mounts: false,
    };
    let watch = match c.call(req, &[]).0 {
        Reply::Watching { watch } => watch,
        other => panic!("{other:?}"),
    };
    std::fs::write(dir.join("sub/new.txt"), b"x").expect("write");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "no create event");
        if let (FromAgent::Watch { watch: w, event }, _) = c.next_event() {
            assert_eq!(w, watch);
            if event.kind == WatchKind::Create {
                assert_eq!(event.name, "sub/new.txt");
                break;
            }
        }
    }
    c.ok(Request::Unwatch { watch });
}

#[test]
fn oversized_frame_closes_only_that_connection() {
    let mut agent = Agent::start();
    let mut c = agent.connect();
    assert_eq!(c.call(Request::Ping, &[]).0, Reply::Pong { version: proto::PROTOCOL_VERSION });
    c.s.write_all(&u32::MAX.to_le_bytes()).expect("send");
    assert!(c.read_msg().is_none(), "the agent must close the connection");

    let mut c = agent.connect();
    c.s.write_all(&[12, 0, 0, 0, 4, 0, 0, 0, b'n', b'u', b'l', b'l', 0, 0, 0, 0]).expect("send");
    assert!(c.read_msg().is_none(), "a header that is no request closes the connection");

    let mut c = agent.connect();
    assert_eq!(c.call(Request::Ping, &[]).0, Reply::Pong { version: proto::PROTOCOL_VERSION });
    assert!(agent.alive());
}

/// Whether `pid` sleeps in epoll_wait (or epoll_pwait): idle, waiting for
/// an event.
fn waiting_in_epoll(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let sleeping = stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('S'));
    let Ok(call) = std::fs::read_to_string(format!("/proc/{pid}/syscall")) else { return false };
    let nr: i64 = call.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(-1);
    sleeping && [libc::SYS_epoll_wait, libc::SYS_epoll_pwait, libc::SYS_epoll_pwait2].contains(&nr)
}

/// Bytes waiting to be read on `s`.
fn unread_socket(s: &UnixStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer given.
    assert_eq!(unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) }, 0, "FIONREAD");
    n as usize
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("agent status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS line");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS value")
}

#[test]
fn pipelined_requests_are_held_back_while_replies_are_unread() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let file = agent.dir.join("one-mib");
    std::fs::write(&file, vec![7u8; 1 << 20]).expect("write");
    let read = Request::ReadFile { path: path_str(&file), offset: 0, len: 1 << 20, user: Some("root".into()) };
    let mut batch = Vec::new();
    for id in 0..400u64 {
        proto::encode(&ToAgent { id: 1000 + id, req: read.clone() }, &[], &mut batch).expect("encode");
    }
    c.s.write_all(&batch).expect("send the whole batch");
    // Once the agent is back asleep in epoll_wait with replies waiting in
    // our socket, it has done all it will do until we read: measure then.
    let agent_pid = agent.child.id();
    wait_for("the agent to stop, replies unread", Duration::from_secs(30), || {
        waiting_in_epoll(agent_pid) && unread_socket(&c.s) > 0
    });
    // 400 MiB of replies were asked for; the agent holds at most the
    // high-water mark plus one reply beyond what the socket buffers.
    let rss = rss_kib(agent.child.id());
    assert!(rss < 64 * 1024, "agent RSS {rss} KiB while replies are unread");
    let mut got = 0;
    while got < 400 {
        match c.read_msg().expect("reply") {
            (FromAgent::Reply { reply: Reply::Data { size, .. }, .. }, data) => {
                assert_eq!((size, data.len()), (1 << 20, 1 << 20));
                got += 1;
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Issue 10, finding 9: a command whose main process exits while processes
/// it started live on holds its slot; it stays listed, a signal reaches
/// those processes, and only their end frees the slot.
#[test]
fn children_left_behind_keep_the_command_listed_signallable_and_holding_its_slot() {
    let agent = Agent::start_with(2);
    let mut c = agent.connect();
    let mut left = Vec::new();
    let mut mains = Vec::new();
    for _ in 0..2 {
        let pid = c.spawn(root_spawn(Cmd::Shell("sleep 1000 & setsid sleep 1000 & echo $!".into())));
        let out = c.collect(pid);
        let status = out.status.expect("exit");
        assert_eq!((status.code, status.descendants_alive), (Some(0), true), "{status:?}");
        left.push(String::from_utf8_lossy(&out.stdout).trim().parse::<u32>().expect("pid of setsid sleep"));
        mains.push(pid);
    }
    // Both slots are held: the third command is refused and starts nothing.
    assert!(matches!(
        c.call(Request::Spawn(root_spawn(argv(&["true"]))), &[]).0,
        Reply::Error { code: ErrorCode::Capacity, .. }
    ));
    let l = listed(&mut c);
    let mut sorted = mains.clone();
    sorted.sort();
    assert_eq!(l.iter().map(|p| p.pid).collect::<Vec<_>>(), sorted);
    let lingering = ExitStatus { descendants_alive: true, ..ExitStatus::exited(0) };
    assert!(l.iter().all(|p| p.exited == Some(lingering)), "{l:?}");
    // Stdin is gone with the main process; a reattach gets its exit.
    assert!(matches!(
        c.call(Request::CloseStdin { pid: mains[0] }, &[]).0,
        Reply::Error { code: ErrorCode::UnknownProcess, .. }
    ));
    let mut other = agent.connect();
    let reply = other.call(Request::Attach { target: Target::Pid(mains[0]) }, &[]).0;
    assert_eq!(reply, Reply::Attached { pid: mains[0] });
    assert_eq!(other.collect(mains[0]).status, Some(lingering));
    // SIGTERM reaches the setsid'd sleep, which left the process group.
    c.ok(Request::Signal { pid: mains[0], signal: libc::SIGTERM });
    wait_dead(left[0], "setsid'd sleep");
    wait_listed(&mut c, "the first command to go", |l| l.len() == 1 && l[0].pid == mains[1]);
    wait_sleeping(left[1]);
    let pid = c.spawn(root_spawn(argv(&["true"])));
    assert_eq!(c.collect(pid).status, exited(0));
    c.ok(Request::Signal { pid: mains[1], signal: libc::SIGKILL });
    wait_dead(left[1], "setsid'd sleep");
    wait_listed(&mut c, "an empty list", |l| l.is_empty());
}

#[test]
fn the_timeout_ends_children_left_after_the_main_process_exited() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let mut s = root_spawn(Cmd::Shell("sleep 1000 & echo $!; setsid sleep 1000 & echo $!".into()));
    s.timeout_ms = Some(1500);
    let pid = c.spawn(s);
    let out = c.collect(pid);
    let status = out.status.expect("exit");
    assert_eq!((status.code, status.timed_out, status.descendants_alive), (Some(0), false, true), "{status:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let pids: Vec<u32> = text.split_whitespace().map(|p| p.parse().expect("pid")).collect();
    assert_eq!(pids.len(), 2);
    // Held by pidfd: the timeout may end them at any moment from now on.
    let held: Vec<Pidfd> = pids.iter().filter_map(|&p| Pidfd::open(p)).collect();
    wait_listed(&mut c, "the timeout to end the tree", |l| l.is_empty());
    for p in held {
        p.wait_ended("a background sleep");
    }
}

#[test]
fn a_signal_reaches_the_whole_tree_while_the_main_process_runs() {
    let agent = Agent::start();
    let mut c = agent.connect();
    let pid = c.spawn(root_spawn(Cmd::Shell("setsid sleep 1000 & echo $!; wait".into())));
    let mut text = Vec::new();
    let orphan: u32 = loop {
        match c.next_event() {
            (FromAgent::Output { pid: p, .. }, data) if p == pid => {
                text.extend(data);
                if text.ends_with(b"\n") {
                    break String::from_utf8_lossy(&text).trim().parse().expect("pid");
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    wait_sleeping(orphan);
    c.ok(Request::Signal { pid, signal: libc::SIGTERM });
    let status = c.collect(pid).status.expect("exit");
    assert_eq!(status.signal, Some(libc::SIGTERM), "{status:?}");
    wait_dead(orphan, "setsid'd sleep");
    wait_listed(&mut c, "an empty list", |l| l.is_empty());
}

/// A killed command's exit (timeout or SIGKILL) is sent once its whole tree
/// is gone, so a caller that gets it sees nothing of the tree left.
#[test]
fn a_killed_commands_exit_comes_after_its_whole_tree_is_gone() {
    let agent = Agent::start();
    let mut c = agent.connect();
    for (timeout_ms, kill) in [(Some(1000), false), (None, true)] {
        let mut s = root_spawn(Cmd::Shell("setsid sleep 1000 & echo $!; sleep 1000 & sleep 1000".into()));
        s.timeout_ms = timeout_ms;
        let pid = c.spawn(s);
        let mut text = Vec::new();
        let orphan: u32 = loop {
            match c.next_event() {
                (FromAgent::Output { pid: p, .. }, data) if p == pid => {
                    text.extend(data);
                    if text.ends_with(b"\n") {
                        break String::from_utf8_lossy(&text).trim().parse().expect("pid");
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        let held = Pidfd::open(orphan);
        // Past its setsid (it runs sleep), unless the timeout ended it first.
        wait_for("the orphan to run sleep", Duration::from_secs(10), || {
            alive(orphan) || held.as_ref().is_none_or(|h| h.ended())
        });
        if kill {
            c.ok(Request::Signal { pid, signal: libc::SIGKILL });
        }
        let status = c.collect(pid).status.expect("exit");
        assert_eq!((status.timed_out, status.descendants_alive), (!kill, false), "{status:?}");
        let gone = held.is_none_or(|h| h.ended()) && !Path::new(&format!("/proc/{orphan}")).exists();
        assert!(gone, "the setsid'd sleep outlived the exit");
        assert!(listed(&mut c).is_empty());
    }
}

/// Issue 16: a command that daemonizes (forks, the child calls setsid and
/// forks again, both parents exit) still holds its slot until that
/// grandchild ends, and a signal to the command reaches it.
#[test]
fn a_double_forked_daemon_holds_its_commands_slot_until_it_ends() {
    let agent = Agent::start_with(1);
    let mut c = agent.connect();
    // The intermediate shell writes the sleep's pid and exits before the
    // command does (output of processes left behind is not collected).
    let file = path_str(&agent.dir.join("daemon.pid"));
    let script = format!("setsid sh -c 'sleep 1000 & echo $! > {file}' & wait; cat {file}");
    let pid = c.spawn(root_spawn(Cmd::Shell(script)));
    let out = c.collect(pid);
    let status = out.status.expect("exit");
    assert_eq!((status.code, status.descendants_alive), (Some(0), true), "{status:?}");
    let daemon: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("pid of the daemon's sleep");
    wait_sleeping(daemon);
    let held = Pidfd::open(daemon).expect("the daemon runs");
    // Its parents are gone; the slot is still the command's.
    assert!(matches!(
        c.call(Request::Spawn(root_spawn(argv(&["true"]))), &[]).0,
        Reply::Error { code: ErrorCode::Capacity, .. }
    ));
    assert_eq!(listed(&mut c).iter().map(|p| p.pid).collect::<Vec<_>>(), vec![pid]);
    c.ok(Request::Signal { pid, signal: libc::SIGKILL });
    held.wait_ended("the daemon's sleep");
    wait_listed(&mut c, "the slot to be free", |l| l.is_empty());
    let next = c.spawn(root_spawn(argv(&["true"])));
    assert_eq!(c.collect(next).status, exited(0));
}

/// The host-side `--reap` mode (the daemon starts `runsc run --detach`
/// through it): the caller gets the program's exit status when the program
/// ends; a process the program left running is the reaper's child, is
/// reaped as soon as it ends (no zombie left for init), and the reaper
/// exits after its last child.
#[test]
fn the_reap_mode_passes_the_status_back_and_reaps_what_the_program_left() {
    let agent = env!("CARGO_BIN_EXE_hutch-agent");
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("hutch-agent-reap-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("left.pid");
    let script = format!("sleep 1000 & echo $! > {}; exit 7", path_str(&file));
    let status = Command::new(agent).args([proto::REAP_FLAG, "sh", "-c", &script]).status().expect("run the reaper");
    assert_eq!(status.code(), Some(7));
    let left: u32 = std::fs::read_to_string(&file).expect("pid file").trim().parse().expect("a pid");
    let _ = std::fs::remove_dir_all(&dir);
    wait_sleeping(left);
    let held = Pidfd::open(left).expect("the sleep runs");
    let stat = std::fs::read_to_string(format!("/proc/{left}/stat")).expect("stat of the sleep");
    let reaper: u32 =
        stat.rsplit(')').next().and_then(|s| s.split_whitespace().nth(1)).and_then(|p| p.parse().ok()).expect("ppid");
    let cmdline = std::fs::read(format!("/proc/{reaper}/cmdline")).unwrap_or_default();
    let reaper_held = Pidfd::open(reaper);
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(left as i32, libc::SIGKILL) };
    assert!(
        cmdline.split(|b| *b == 0).any(|a| a == proto::REAP_FLAG.as_bytes()),
        "the sleep's parent {reaper} is not the reaper: {:?}",
        String::from_utf8_lossy(&cmdline)
    );
    held.wait_ended("the sleep");
    // Reaped: not even a zombie is left.
    wait_for("the sleep to be reaped", Duration::from_secs(10), || !Path::new(&format!("/proc/{left}")).exists());
    reaper_held.expect("the reaper runs until its child ends").wait_ended("the reaper");

    // A program killed by a signal: 128 + its number; one that cannot run: 127.
    let status = Command::new(agent).args([proto::REAP_FLAG, "sh", "-c", "kill -9 $$"]).status().expect("run");
    assert_eq!(status.code(), Some(128 + libc::SIGKILL));
    let status = Command::new(agent).args([proto::REAP_FLAG, "/nonexistent/program"]).status().expect("run");
    assert_eq!(status.code(), Some(127));
}
