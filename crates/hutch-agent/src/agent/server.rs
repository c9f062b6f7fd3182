//! The agent's single-threaded epoll loop: accepts host connections, answers
//! their requests, streams process output to subscribers with backpressure,
//! reaps commands and their supervisors, and runs the timers (command
//! timeouts, pty drains).
//!
//! Architecture invariant: nothing a client does ends the agent; a broken
//! client loses its own connection and nothing else, and a closed
//! connection never kills a process.

use std::collections::{BTreeSet, HashMap};
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use hutch_agent::proto::{
    self, Cmd, ErrorCode, ExitStatus, FrameError, FromAgent, ProcessInfo, Reply, Request, Spawn, Stream, Target,
    ToAgent, PROTOCOL_VERSION,
};

use super::child::{self, ChildPlan};
use super::config::Config;
use super::conn::{Conn, HARD_CAP, HIGH_WATER};
use super::env;
use super::files::{self, Fs, FsCreds, FsError};
use super::output::{exit_status, Ring};
use super::sys::{self, CStrArray, Epoll, Errno};
use super::tenants::{self, Tenants};
use super::tree::{self, TreeCgroup, TreeCgroups};
use super::users::Users;
use super::watch::Watches;

const T_LISTEN: u64 = 1;
const T_SIGNAL: u64 = 2;
const T_INOTIFY: u64 = 3;
const T_CONN: u64 = 4;
const T_STDOUT: u64 = 5;
const T_STDERR: u64 = 6;
const T_STDIN: u64 = 7;
const T_STATUS: u64 = 8;
/// A tenant's listening socket (process class); the id is the tenant's.
const T_TENANT: u64 = 9;
/// A command's `cgroup.events` (tree.rs): its tree may have ended.
const T_TREE: u64 = 10;

fn token(kind: u64, id: u64) -> u64 {
    kind << 56 | id
}

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;
const PRI: u32 = libc::EPOLLPRI as u32;
const HUP_ERR: u32 = (libc::EPOLLHUP | libc::EPOLLERR) as u32;

/// Most processes started through the agent alive at once.
pub const MAX_PROCS: usize = 1024;
/// Most client connections at once.
const MAX_CONNS: usize = 1024;
/// Largest read from an output pipe.
const READ_CHUNK: usize = 64 * 1024;
/// Most output read from a process's pipes once it has exited.
const EXIT_DRAIN: usize = 16 * 1024 * 1024;
/// Stdin bytes buffered per process while its pipe is full.
const STDIN_BUFFER: usize = 1024 * 1024;
/// How long output of an exited pty process may trail its exit.
const PTY_GRACE: Duration = Duration::from_millis(50);
/// How long a spawn waits for the supervisor to report the child's pid.
const SPAWN_WAIT_MS: i32 = 10_000;
/// How long the listener rests after running out of descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often a quiesced agent looks for its resume file.
const RESUME_POLL: Duration = Duration::from_millis(5);
/// Largest resume file read.
const RESUME_MAX: u64 = 1 << 20;

/// Where the agent is in a [`Request::Quiesce`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quiesce {
    Serving,
    /// Answered: connections and listener close once flushed.
    Closing,
    /// Closed; the resume file is looked for at this instant.
    Waiting(Instant),
}

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error { code, message: message.into() }
}

type SpawnError = (ErrorCode, String);

/// The workload cgroup's descriptors the host passed (see `AgentConfig`).
#[derive(Default)]
pub struct WorkCgroup {
    pub procs: Vec<OwnedFd>,
    pub oom_events: Option<OwnedFd>,
    /// The delegated directory command cgroups are made in (tree.rs).
    pub trees: Option<OwnedFd>,
}

/// What holds a command's process tree together until it ends.
enum Keeper {
    /// Its supervisor (child.rs), the agent's child, which exits once
    /// nothing of the tree is left.
    Supervisor(i32),
    /// A cgroup of its own (tree.rs); the main process is the agent's child.
    Cgroup(CgroupKeeper),
}

struct CgroupKeeper {
    /// Until the tree ended; then back to the agent's pool.
    cgroup: Option<TreeCgroup>,
    /// The main process, until it is reaped.
    main: Option<i32>,
    /// Events `cgroup.events` is registered for in the epoll set.
    events: u32,
    /// The tree is being killed: the main process's end is told once
    /// nothing of the tree is left, so that a killed command's exit means
    /// its whole tree is gone (as with a supervisor).
    killing: bool,
    /// The main process's wait status, held while a killed tree empties.
    held: Option<i32>,
}

struct OutStream {
    fd: Option<OwnedFd>,
    events: u32,
    ring: Ring,
}

/// A command: from its spawn until its whole process tree has exited,
/// which is when its slot is free.
struct Proc {
    keeper: Keeper,
    /// Nothing of the tree is left: its supervisor said so (it is exiting)
    /// or was reaped, or its cgroup emptied. No signal goes to it any more.
    tree_gone: bool,
    info: ProcessInfo,
    /// stdout and stderr; with a pty, stdout is the terminal's master side.
    streams: [OutStream; 2],
    /// Write end of the stdin pipe (not used with a pty).
    stdin: Option<OwnedFd>,
    stdin_events: u32,
    stdin_buf: Vec<u8>,
    /// Close stdin once `stdin_buf` is written.
    stdin_close: bool,
    status: Option<OwnedFd>,
    status_events: u32,
    /// Connections receiving output and exit.
    subs: Vec<u64>,
    timeout_at: Option<Instant>,
    timed_out: bool,
    /// A SIGKILL was asked for through [`Request::Signal`].
    kill_requested: bool,
    /// The workload cgroup's OOM kill count when the command started.
    oom_at_start: Option<u64>,
    /// Wait status of the main child, while a pty's output still drains.
    exited: Option<(i32, Instant)>,
    /// The main child exited while other processes of its tree lived.
    descendants_alive: bool,
    /// The tenant whose command this is (process class).
    tenant: Option<u64>,
    /// The exit was sent and the streams closed (`info.exited` is set);
    /// the record stays while the rest of the tree lives.
    finished: bool,
    /// What the spawning connection still takes of each stream.
    limit: Option<Limit>,
}

/// The spawn's `output_limit`: bytes of each stream its connection still
/// takes, and whether it was told of a loss.
struct Limit {
    conn: u64,
    left: [u64; 2],
    told: [bool; 2],
}

impl Limit {
    /// How much of `n` new bytes of stream `idx` go to the connection, and
    /// whether to tell it that the rest is lost (once per stream).
    fn take(&mut self, idx: usize, n: usize) -> (usize, bool) {
        let send = n.min(usize::try_from(self.left[idx]).unwrap_or(usize::MAX));
        self.left[idx] -= send as u64;
        let tell = send < n && !self.told[idx];
        self.told[idx] |= send < n;
        (send, tell)
    }
}

impl Proc {
    fn stream_kind(idx: usize) -> Stream {
        if idx == 0 {
            Stream::Stdout
        } else {
            Stream::Stderr
        }
    }

    /// The descriptor stdin bytes go to.
    fn stdin_fd(&self) -> Option<&OwnedFd> {
        if self.info.pty {
            self.streams[0].fd.as_ref()
        } else {
            self.stdin.as_ref()
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum TimerKind {
    Timeout,
    PtyDrain,
}

/// Connections and what is queued for them.
#[derive(Default)]
struct Outbox {
    conns: HashMap<u64, Conn>,
    /// Connections with bytes to flush.
    dirty: Vec<u64>,
    /// Connections to close.
    doomed: Vec<u64>,
}

impl Outbox {
    fn send(&mut self, id: u64, msg: &FromAgent, data: &[u8]) -> Result<(), FrameError> {
        let Some(c) = self.conns.get_mut(&id) else { return Ok(()) };
        if c.closing {
            return Ok(());
        }
        proto::encode(msg, data, c.out_buf())?;
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(id);
        }
        Ok(())
    }

    /// [`Outbox::send`] of a message that carries `fd` (SCM_RIGHTS).
    fn send_with_fd(&mut self, id: u64, msg: &FromAgent, fd: OwnedFd) -> Result<(), FrameError> {
        let mut frame = Vec::new();
        proto::encode(msg, &[], &mut frame)?;
        let Some(c) = self.conns.get_mut(&id) else { return Ok(()) };
        if c.closing {
            return Ok(());
        }
        c.pass_fd(fd);
        c.out_buf().extend_from_slice(&frame);
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(id);
        }
        Ok(())
    }

    fn doom(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            if !c.closing {
                c.closing = true;
                self.doomed.push(id);
            }
        }
    }

    fn congested(&self, id: u64) -> bool {
        self.conns.get(&id).is_some_and(|c| c.congested)
    }
}

fn close_fd(epoll: &Epoll, fd: &mut Option<OwnedFd>, events: &mut u32) {
    if let Some(f) = fd.take() {
        epoll.update(f.as_raw_fd(), 0, events, 0);
    }
}

/// Brings a process's epoll registrations in line with its state: output
/// is read unless a subscriber is congested, stdin is polled while bytes
/// wait for it.
fn sync_proc(epoll: &Epoll, out: &Outbox, serial: u64, p: &mut Proc) {
    let paused = p.subs.iter().any(|&c| out.congested(c));
    let stdin_waiting = !p.stdin_buf.is_empty();
    for (i, s) in p.streams.iter_mut().enumerate() {
        let Some(fd) = &s.fd else { continue };
        let mut want = if paused { 0 } else { IN };
        if i == 0 && p.info.pty && stdin_waiting {
            want |= OUT;
        }
        epoll.update(fd.as_raw_fd(), token(T_STDOUT + i as u64, serial), &mut s.events, want);
    }
    if let Some(fd) = &p.stdin {
        let want = if stdin_waiting { OUT } else { 0 };
        epoll.update(fd.as_raw_fd(), token(T_STDIN, serial), &mut p.stdin_events, want);
    }
    if let Some(fd) = &p.status {
        epoll.update(fd.as_raw_fd(), token(T_STATUS, serial), &mut p.status_events, IN);
    }
}

/// Hands output to the subscribers, or to the replay ring when there are none.
fn deliver(out: &mut Outbox, p: &mut Proc, idx: usize, data: &[u8]) {
    if p.subs.is_empty() {
        p.streams[idx].ring.push(data);
        return;
    }
    let (pid, stream) = (p.info.pid, Proc::stream_kind(idx));
    let msg = FromAgent::Output { pid, stream };
    for &c in &p.subs {
        let (send, tell) = match &mut p.limit {
            Some(l) if l.conn == c => l.take(idx, data.len()),
            _ => (data.len(), false),
        };
        if send > 0 {
            let _ = out.send(c, &msg, &data[..send]);
        }
        if tell {
            let _ = out.send(c, &FromAgent::Dropped { pid, stream, bytes: (data.len() - send) as u64 }, &[]);
        }
    }
}

/// Writes buffered stdin until the pipe is full; closes stdin afterwards
/// when asked to. `Err` when the reading side is gone.
fn pump_stdin(epoll: &Epoll, p: &mut Proc) -> Result<(), Errno> {
    let Some(fd) = p.stdin_fd().map(|f| f.as_raw_fd()) else {
        p.stdin_buf.clear();
        return Err(Errno(libc::EPIPE));
    };
    let mut done = 0;
    let result = loop {
        if done == p.stdin_buf.len() {
            break Ok(());
        }
        match sys::write(fd, &p.stdin_buf[done..]) {
            Ok(n) => done += n,
            Err(Errno(libc::EAGAIN)) => break Ok(()),
            Err(Errno(libc::EINTR)) => {}
            Err(e) => break Err(e),
        }
    };
    if result.is_err() {
        p.stdin_buf.clear();
    } else {
        p.stdin_buf.drain(..done);
    }
    if p.stdin_buf.is_empty() && p.stdin_close {
        p.stdin_close = false;
        close_fd(epoll, &mut p.stdin, &mut p.stdin_events);
    }
    result
}

fn is_executable(path: &str) -> bool {
    let Ok(c) = CString::new(path) else { return false };
    sys::stat(&c).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_mode & 0o111 != 0)
}

pub struct Agent {
    cfg: Config,
    /// `cgroup.procs` files of the workload cgroup, which every command
    /// joins before it execs.
    work_cgroups: Vec<OwnedFd>,
    /// The workload cgroup's OOM counter file.
    oom_events: Option<OwnedFd>,
    nofile: Option<libc::rlimit>,
    /// The host lowered our OOM score (it may lack the privilege to).
    reset_oom: bool,
    bounding_reduced: bool,
    epoll: Epoll,
    /// Taken while quiesced.
    listener: Option<OwnedFd>,
    listen_events: u32,
    /// The directory of an agent started with `--dir` (gvisor class).
    dir: Option<std::path::PathBuf>,
    quiesce: Quiesce,
    listen_retry: Option<Instant>,
    sigfd: OwnedFd,
    fs: Fs,
    users: Users,
    devnull: Option<OwnedFd>,
    out: Outbox,
    congestion_changed: bool,
    next_conn: u64,
    procs: HashMap<u64, Proc>,
    by_pid: HashMap<u32, u64>,
    by_sup: HashMap<i32, u64>,
    /// Supervisors not yet reaped.
    supervisors: std::collections::HashSet<i32>,
    /// Main processes of commands without a supervisor, not yet reaped.
    by_main: HashMap<i32, u64>,
    /// Where commands get a cgroup of their own, when the host delegated one.
    tree_cgroups: Option<TreeCgroups>,
    tags: HashMap<String, u64>,
    next_proc: u64,
    timers: BTreeSet<(Instant, u64, TimerKind)>,
    watches: Watches,
    scratch: Vec<u8>,
    /// The descriptor the file operation being answered passes.
    passing: Option<OwnedFd>,
    /// Process-class sandboxes sharing this agent.
    tenants: Tenants,
}

impl Agent {
    /// Sets the agent up around the host's listening socket.
    pub fn new(
        cfg: Config,
        cgroups: WorkCgroup,
        listener: OwnedFd,
        nofile: Option<libc::rlimit>,
        bounding_reduced: bool,
    ) -> Result<Agent, Errno> {
        let epoll = Epoll::new()?;
        sys::set_nonblocking(listener.as_fd())?;
        let sigfd = sys::signalfd(&[libc::SIGCHLD])?;
        let root = sys::open(c"/", libc::O_PATH | libc::O_DIRECTORY)?;
        let mut listen_events = 0;
        epoll.update(listener.as_raw_fd(), token(T_LISTEN, 0), &mut listen_events, IN);
        epoll.add(sigfd.as_raw_fd(), IN, token(T_SIGNAL, 0))?;
        Ok(Agent {
            cfg,
            work_cgroups: cgroups.procs,
            oom_events: cgroups.oom_events,
            nofile,
            reset_oom: std::fs::read("/proc/self/oom_score_adj").map(|v| v.trim_ascii() != b"0").unwrap_or(true),
            bounding_reduced,
            epoll,
            listener: Some(listener),
            listen_events,
            dir: None,
            quiesce: Quiesce::Serving,
            listen_retry: None,
            sigfd,
            fs: Fs::new(root),
            users: Users::default(),
            devnull: None,
            out: Outbox::default(),
            congestion_changed: false,
            next_conn: 1,
            procs: HashMap::new(),
            by_pid: HashMap::new(),
            by_sup: HashMap::new(),
            supervisors: std::collections::HashSet::new(),
            by_main: HashMap::new(),
            tree_cgroups: cgroups.trees.map(TreeCgroups::new),
            tags: HashMap::new(),
            next_proc: 1,
            timers: BTreeSet::new(),
            watches: Watches::default(),
            scratch: Vec::with_capacity(READ_CHUNK),
            passing: None,
            tenants: Tenants::default(),
        })
    }

    /// The agent's directory (`--dir`): what makes [`Request::Quiesce`] possible.
    pub fn set_dir(&mut self, dir: std::path::PathBuf) {
        self.dir = Some(dir);
    }

    /// Runs until the listening socket fails; returns that error.
    pub fn run(&mut self) -> Errno {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        loop {
            let n = match self.epoll.wait(&mut events, self.timeout_ms()) {
                Ok(n) => n,
                Err(Errno(libc::EINTR)) => 0,
                Err(e) => return e,
            };
            for ev in &events[..n] {
                let (tok, evs) = (ev.u64, ev.events);
                if let Err(e) = self.dispatch(tok, evs) {
                    return e;
                }
                self.settle();
            }
            self.fire_timers();
            self.settle();
        }
    }

    fn dispatch(&mut self, tok: u64, events: u32) -> Result<(), Errno> {
        let (kind, id) = (tok >> 56, tok & ((1 << 56) - 1));
        match kind {
            T_LISTEN => return self.accept(),
            T_SIGNAL => self.reap(),
            T_INOTIFY => self.watch_events(),
            T_CONN => {
                if events & (IN | HUP_ERR) != 0 {
                    self.conn_readable(id);
                }
                if events & OUT != 0 {
                    self.mark_dirty(id);
                }
            }
            T_STDOUT | T_STDERR => {
                let idx = (kind - T_STDOUT) as usize;
                if events & (IN | HUP_ERR) != 0 {
                    self.read_stream(id, idx);
                }
                if idx == 0 && events & (OUT | HUP_ERR) != 0 {
                    self.stdin_writable(id);
                }
            }
            T_STDIN => self.stdin_writable(id),
            T_STATUS => self.status_readable(id),
            T_TENANT => self.accept_tenant(id),
            T_TREE => self.tree_changed(id),
            _ => {}
        }
        Ok(())
    }

    // -- connections -------------------------------------------------------

    fn accept(&mut self) -> Result<(), Errno> {
        let Some(listener) = self.listener.as_ref().map(|l| l.as_raw_fd()) else { return Ok(()) };
        loop {
            // SAFETY: the listener stays open for this call (nothing below
            // takes it).
            match sys::accept(unsafe { std::os::fd::BorrowedFd::borrow_raw(listener) }) {
                Ok(fd) => self.admit(fd, None),
                Err(Errno(libc::EAGAIN)) => return Ok(()),
                Err(Errno(libc::EINTR | libc::ECONNABORTED | libc::EPROTO | libc::EPERM)) => {}
                Err(Errno(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
                    self.epoll.update(listener, 0, &mut self.listen_events, 0);
                    self.listen_retry = Some(Instant::now() + ACCEPT_BACKOFF);
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Registers an accepted connection (of `tenant`, when accepted on a
    /// tenant's socket); past [`MAX_CONNS`] it is closed at once.
    fn admit(&mut self, fd: OwnedFd, tenant: Option<u64>) {
        if self.out.conns.len() >= MAX_CONNS {
            return;
        }
        let id = self.next_conn;
        self.next_conn += 1;
        let mut c = Conn::new(fd);
        c.tenant = tenant;
        self.epoll.update(c.fd.as_raw_fd(), token(T_CONN, id), &mut c.events, IN);
        self.out.conns.insert(id, c);
    }

    /// Accepts connections on a tenant's socket: each is the tenant's.
    fn accept_tenant(&mut self, tenant: u64) {
        loop {
            let Some(t) = self.tenants.get(tenant) else { return };
            match sys::accept(t.listener.as_fd()) {
                Ok(fd) => self.admit(fd, Some(tenant)),
                Err(Errno(libc::EINTR | libc::ECONNABORTED | libc::EPROTO | libc::EPERM)) => {}
                Err(_) => return,
            }
        }
    }

    fn mark_dirty(&mut self, id: u64) {
        if let Some(c) = self.out.conns.get_mut(&id) {
            if !c.dirty {
                c.dirty = true;
                self.out.dirty.push(id);
            }
        }
    }

    /// Reads what a connection sent and answers the complete requests.
    fn conn_readable(&mut self, id: u64) {
        let Some(c) = self.out.conns.get_mut(&id) else { return };
        if c.closing || c.congested {
            return;
        }
        // Only the host's own connections may pass descriptors (tenants).
        let read = match c.tenant {
            None => sys::recv_append(c.fd.as_fd(), &mut c.input, 256 * 1024, &mut c.received),
            Some(_) => sys::read_append(c.fd.as_fd(), &mut c.input, 256 * 1024),
        };
        if c.received.len() > proto::MAX_TENANT_FDS {
            return self.out.doom(id);
        }
        match read {
            Ok(0) => return self.out.doom(id),
            Ok(_) => {}
            Err(Errno(libc::EAGAIN | libc::EINTR)) => return,
            Err(_) => return self.out.doom(id),
        }
        self.process_input(id);
    }

    /// Answers the complete requests in a connection's input, until its
    /// replies pile up past the high-water mark; the rest waits until the
    /// connection drains (see `settle`), so that a client cannot make the
    /// agent queue more than it reads.
    fn process_input(&mut self, id: u64) {
        let Some(c) = self.out.conns.get_mut(&id) else { return };
        let mut input = std::mem::take(&mut c.input);
        let mut pos = 0;
        let mut held = false;
        loop {
            if self.out.conns.get(&id).is_none_or(|c| c.pending() > HIGH_WATER) {
                held = true;
                break;
            }
            let frame = match proto::split_frame(&input[pos..]) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(_) => return self.out.doom(id),
            };
            let Ok(msg) = proto::parse_header::<ToAgent>(frame.header) else { return self.out.doom(id) };
            pos += frame.consumed;
            self.handle(id, msg.id, msg.req, frame.data);
            if self.out.conns.get(&id).is_none_or(|c| c.closing) {
                return;
            }
        }
        input.drain(..pos);
        if let Some(c) = self.out.conns.get_mut(&id) {
            c.input = input;
            c.held = held;
        }
    }

    /// Flushes connections, drops the broken ones, re-evaluates
    /// backpressure and resumes requests held back by it; runs after every
    /// event.
    fn settle(&mut self) {
        loop {
            let mut relieved = Vec::new();
            for id in std::mem::take(&mut self.out.dirty) {
                let Some(c) = self.out.conns.get_mut(&id) else { continue };
                c.dirty = false;
                if c.closing {
                    continue;
                }
                if c.flush().is_err() || c.pending() > HARD_CAP {
                    self.out.doom(id);
                    continue;
                }
                if c.update_congestion() {
                    self.congestion_changed = true;
                }
                if c.held && !c.congested && c.pending() <= HIGH_WATER {
                    relieved.push(id);
                }
                let want = c.wanted_events();
                self.epoll.update(c.fd.as_raw_fd(), token(T_CONN, id), &mut c.events, want);
            }
            if relieved.is_empty() {
                break;
            }
            for id in relieved {
                self.process_input(id);
            }
        }
        for id in std::mem::take(&mut self.out.doomed) {
            self.out.conns.remove(&id);
            self.watches.remove_conn(id);
            for p in self.procs.values_mut() {
                p.subs.retain(|&c| c != id);
            }
            self.congestion_changed = true;
        }
        if std::mem::take(&mut self.congestion_changed) {
            for (&serial, p) in self.procs.iter_mut() {
                sync_proc(&self.epoll, &self.out, serial, p);
            }
        }
        if self.quiesce == Quiesce::Closing {
            self.close_all();
        }
    }

    // -- checkpoints (gvisor class) ------------------------------------------

    fn start_quiesce(&mut self) -> Reply {
        let Some(dir) = &self.dir else {
            return error(ErrorCode::Unsupported, "only an agent with a directory (gvisor class) quiesces");
        };
        // Only the host's resume file, written from now on, ends the wait.
        let _ = std::fs::remove_file(dir.join(proto::RESUME_FILE));
        self.quiesce = Quiesce::Closing;
        Reply::Ok
    }

    /// Closes every connection (after a last flush of what was answered)
    /// and the listening socket: nothing of the host's sockets is left in
    /// the sandbox for a checkpoint.
    fn close_all(&mut self) {
        // The listener first: a host that sees its connection end knows
        // the listener is closed too.
        if let Some(l) = self.listener.take() {
            self.epoll.update(l.as_raw_fd(), 0, &mut self.listen_events, 0);
        }
        self.listen_retry = None;
        let ids: Vec<u64> = self.out.conns.keys().copied().collect();
        for id in &ids {
            if let Some(c) = self.out.conns.get_mut(id) {
                let _ = c.flush();
                let mut events = c.events;
                self.epoll.update(c.fd.as_raw_fd(), 0, &mut events, 0);
            }
            self.out.conns.remove(id);
            self.watches.remove_conn(*id);
        }
        for (&serial, p) in self.procs.iter_mut() {
            p.subs.clear();
            sync_proc(&self.epoll, &self.out, serial, p);
        }
        self.out.dirty.clear();
        self.out.doomed.clear();
        self.quiesce = Quiesce::Waiting(Instant::now() + RESUME_POLL);
    }

    /// Looks for the resume file; once there, listens again, takes the
    /// identity it gives and feeds its entropy to the kernel.
    fn try_resume(&mut self) -> Result<(), Errno> {
        let Some(dir) = self.dir.clone() else { return Ok(()) };
        let path = dir.join(proto::RESUME_FILE);
        let Ok(f) = std::fs::File::open(&path) else {
            self.quiesce = Quiesce::Waiting(Instant::now() + RESUME_POLL);
            return Ok(());
        };
        // Listening first: a failure leaves the file for the next look.
        let listener: OwnedFd = match super::bind_socket(&dir) {
            Ok(l) => l.into(),
            Err(e) => return Err(Errno(e.raw_os_error().unwrap_or(libc::EIO))),
        };
        let mut bytes = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::Read::take(f, RESUME_MAX), &mut bytes);
        let _ = std::fs::remove_file(&path);
        if let Ok(Some(frame)) = proto::split_frame(&bytes) {
            if let Ok(resume) = proto::parse_header::<proto::Resume>(frame.header) {
                if let Some(vars) = resume.env {
                    self.cfg.env = vars.into_iter().filter(|(k, v)| env::check_var(k, v).is_ok()).collect();
                }
                if let Some(name) = resume.hostname.filter(|n| !n.is_empty() && n.len() <= 64) {
                    let _ = sys::sethostname(name.as_bytes());
                }
            }
            if !frame.data.is_empty() {
                if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open("/dev/urandom") {
                    let _ = std::io::Write::write_all(&mut f, frame.data);
                }
            }
        }
        sys::set_nonblocking(listener.as_fd())?;
        self.epoll.update(listener.as_raw_fd(), token(T_LISTEN, 0), &mut self.listen_events, IN);
        self.listener = Some(listener);
        self.quiesce = Quiesce::Serving;
        Ok(())
    }

    fn reply(&mut self, conn: u64, id: u64, reply: Reply, data: &[u8]) {
        if let Err(e) = self.out.send(conn, &FromAgent::Reply { id, reply }, data) {
            let reply = error(ErrorCode::InvalidRequest, format!("the reply does not fit in a frame: {e}"));
            let _ = self.out.send(conn, &FromAgent::Reply { id, reply }, &[]);
        }
    }

    fn handle(&mut self, conn: u64, id: u64, req: Request, data: &[u8]) {
        let tenant = self.out.conns.get(&conn).and_then(|c| c.tenant);
        let req = match self.scope(conn, tenant, req) {
            Ok(r) => r,
            Err(reply) => return self.reply(conn, id, *reply, &[]),
        };
        let (reply, bytes) = match req {
            Request::AddTenant(spec) => (self.add_tenant(conn, spec), Vec::new()),
            Request::RemoveTenant { name } => (self.remove_tenant(&name), Vec::new()),
            Request::Quiesce => (self.start_quiesce(), Vec::new()),
            Request::Ping => (Reply::Pong { version: PROTOCOL_VERSION }, Vec::new()),
            Request::Spawn(s) => (self.spawn(conn, s), Vec::new()),
            Request::Attach { target } => return self.attach(conn, id, target),
            Request::Detach { pid } => (self.detach(conn, pid), Vec::new()),
            Request::Stdin { pid } => (self.stdin(pid, data), Vec::new()),
            Request::CloseStdin { pid } => (self.close_stdin(pid), Vec::new()),
            Request::Signal { pid, signal } => (self.signal(pid, signal), Vec::new()),
            Request::Resize { pid, size } => (self.resize(pid, size.cols, size.rows), Vec::new()),
            Request::List => (self.list(tenant), Vec::new()),
            Request::Unwatch { watch } => {
                let reply = if self.watches.owner(watch) == Some(conn) && self.watches.remove(watch) {
                    Reply::Ok
                } else {
                    error(ErrorCode::InvalidRequest, format!("no watch {watch} on this connection"))
                };
                (reply, Vec::new())
            }
            other => match self.file_op(conn, other, data) {
                Ok(r) => r,
                Err(e) => (error(e.code, e.message), Vec::new()),
            },
        };
        if let Some(fd) = self.passing.take() {
            if let Reply::Opened { passed: true, .. } = reply {
                if self.out.send_with_fd(conn, &FromAgent::Reply { id, reply }, fd).is_err() {
                    let reply = error(ErrorCode::Io, "the reply does not fit in a frame");
                    let _ = self.out.send(conn, &FromAgent::Reply { id, reply }, &[]);
                }
                return;
            }
        }
        self.reply(conn, id, reply, &bytes);
    }

    // -- tenants (process class) ---------------------------------------------

    /// Holds a tenant's connection to what is the tenant's: no tenant
    /// administration, and only its own processes.
    fn scope(&self, conn: u64, tenant: Option<u64>, req: Request) -> Result<Request, Box<Reply>> {
        let Some(t) = tenant else { return Ok(req) };
        let pid = match &req {
            Request::AddTenant(_) | Request::RemoveTenant { .. } | Request::Quiesce => {
                return Err(Box::new(error(ErrorCode::InvalidRequest, "not on a sandbox's connection")))
            }
            Request::Detach { pid }
            | Request::Stdin { pid }
            | Request::CloseStdin { pid }
            | Request::Signal { pid, .. }
            | Request::Resize { pid, .. }
            | Request::Attach { target: Target::Pid(pid) } => *pid,
            _ => return Ok(req),
        };
        let owner = self.by_pid.get(&pid).and_then(|s| self.procs.get(s)).map(|p| p.tenant);
        if owner != Some(Some(t)) {
            let _ = conn;
            return Err(Box::new(error(ErrorCode::UnknownProcess, format!("no process {pid}"))));
        }
        Ok(req)
    }

    fn add_tenant(&mut self, conn: u64, spec: proto::TenantSpec) -> Reply {
        let fds = self.out.conns.get_mut(&conn).map(|c| std::mem::take(&mut c.received)).unwrap_or_default();
        match self.tenants.add(spec, fds, sys::landlock_abi()) {
            Ok(id) => {
                let t = self.tenants.by_id.get_mut(&id).expect("just added");
                self.epoll.update(t.listener.as_raw_fd(), token(T_TENANT, id), &mut t.listen_events, IN);
                Reply::TenantAdded { uid: t.uid, home: t.home.clone() }
            }
            Err((code, message)) => error(code, message),
        }
    }

    /// Ends a tenant: its socket and connections, what is left of its
    /// commands (the host killed its cgroup already, normally), its
    /// directories. Removing one that does not exist is not an error.
    fn remove_tenant(&mut self, name: &str) -> Reply {
        let Some((id, t)) = self.tenants.remove(name) else { return Reply::Ok };
        let mut events = t.listen_events;
        self.epoll.update(t.listener.as_raw_fd(), 0, &mut events, 0);
        drop(t);
        let conns: Vec<u64> = self.out.conns.iter().filter(|(_, c)| c.tenant == Some(id)).map(|(&k, _)| k).collect();
        for c in conns {
            self.out.doom(c);
        }
        let serials: Vec<u64> = self.procs.iter().filter(|(_, p)| p.tenant == Some(id)).map(|(&s, _)| s).collect();
        for serial in serials {
            self.kill_tree(serial);
        }
        Reply::Ok
    }

    // -- processes -----------------------------------------------------------

    fn spawn(&mut self, conn: u64, req: Spawn) -> Reply {
        match self.try_spawn(conn, req) {
            Ok(pid) => Reply::Spawned { pid },
            Err((code, message)) => error(code, message),
        }
    }

    fn try_spawn(&mut self, conn: u64, req: Spawn) -> Result<u32, SpawnError> {
        if self.procs.len() >= MAX_PROCS {
            return Err((ErrorCode::Capacity, format!("at most {MAX_PROCS} processes")));
        }
        if self.procs.values().filter(|p| !p.tree_gone).count() >= self.cfg.max_commands {
            return Err((
                ErrorCode::Capacity,
                format!(
                    "all {} command slots are in use; a command holds its slot while any process it started lives",
                    self.cfg.max_commands
                ),
            ));
        }
        let tenant = self.out.conns.get(&conn).and_then(|c| c.tenant);
        if let Some(t) = tenant {
            let max = self.tenants.get(t).map_or(0, |t| t.max_commands);
            let held = self.procs.values().filter(|p| p.tenant == Some(t) && !p.tree_gone).count();
            if held >= max {
                return Err((
                    ErrorCode::Capacity,
                    format!(
                        "all {max} command slots are in use; a command holds its slot while any process it started lives"
                    ),
                ));
            }
        }
        if let Some(tag) = &req.tag {
            if self.tags.contains_key(&tag_key(tenant, tag)) {
                return Err((ErrorCode::TagInUse, format!("tag {tag:?} is in use")));
            }
        }
        let name = req.user.as_deref().unwrap_or("user");
        let tenant_of = tenant.and_then(|t| self.tenants.get(t));
        let user = match tenant_of {
            Some(t) if name == "user" => t.user(),
            Some(_) => {
                return Err((
                    ErrorCode::Unsupported,
                    format!("user {name:?}: a process sandbox runs only as \"user\" (no root)"),
                ))
            }
            None => self
                .users
                .lookup(self.fs.root(), name)
                .ok_or_else(|| (ErrorCode::UnknownUser, format!("unknown user {name:?}")))?,
        };
        let default_cwd = if tenant_of.is_some() { user.home.as_str() } else { "/workspace" };
        let cwd =
            files::normalize(req.cwd.as_deref().unwrap_or(default_cwd), &user.home).map_err(|e| (e.code, e.message))?;
        let cwd = if tenant_of.is_some() { tenants::workspace_is_home(cwd, &user.home) } else { cwd };
        let env = match tenant_of {
            Some(t) => {
                let mut base = self.cfg.env.clone();
                base.extend(t.env.iter().cloned());
                base.push(("TMPDIR".into(), t.tmp()));
                env::build(&base, &user, req.pty.is_some(), &req.env)
            }
            None => env::build(&self.cfg.env, &user, req.pty.is_some(), &req.env),
        }
        .map_err(|m| (ErrorCode::InvalidRequest, m))?;
        let argv: Vec<String> = match &req.cmd {
            Cmd::Argv(v) if v.is_empty() => return Err((ErrorCode::InvalidRequest, "empty argv".into())),
            Cmd::Argv(v) => v.clone(),
            Cmd::Shell(s) => {
                let shell = if is_executable("/bin/bash") { "/bin/bash" } else { "/bin/sh" };
                vec![shell.into(), "-c".into(), s.clone()]
            }
        };
        let bad_nul = || (ErrorCode::InvalidRequest, "argv holds a NUL byte".to_string());
        let argv_c: Vec<CString> =
            argv.iter().map(|a| CString::new(a.as_str())).collect::<Result<_, _>>().map_err(|_| bad_nul())?;
        let envp_c: Vec<CString> = env
            .iter()
            .map(|(k, v)| CString::new(format!("{k}={v}")))
            .collect::<Result<_, _>>()
            .map_err(|_| (ErrorCode::InvalidRequest, "environment holds a NUL byte".to_string()))?;
        let path_var = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str());
        let exe = env::search_path(&argv[0], path_var, &cwd, is_executable);
        let exe = exe.map(CString::new).transpose().map_err(|_| bad_nul())?;
        let cwd_fd = {
            let _creds = FsCreds::switch(user.uid, user.gid);
            let fd = self.fs.open_dir(&cwd).map_err(|e| (e.code, e.message))?;
            // An O_PATH open needs no search permission on the directory
            // itself, and the child changes into it while still root: check
            // that the user may enter it by looking up "." through it.
            sys::openat(fd.as_fd(), c".", libc::O_PATH | libc::O_DIRECTORY, 0)
                .map_err(|e| FsError::os("enter", &cwd, e))
                .map_err(|e| (e.code, e.message))?;
            fd
        };

        let io = |what: &str, e: Errno| (ErrorCode::Io, format!("{what}: {e}"));
        // Output: a pty's master, or a pipe per stream.
        let (out_r, out_w, err, slave) = match req.pty {
            Some(size) => {
                let (master, slave) = sys::open_pty(size.cols, size.rows).map_err(|e| io("pty", e))?;
                let _ = sys::fchown(slave.as_fd(), user.uid, user.gid);
                (master, None, None, Some(slave))
            }
            None => {
                let (out_r, out_w) = sys::pipe().map_err(|e| io("pipe", e))?;
                let (err_r, err_w) = sys::pipe().map_err(|e| io("pipe", e))?;
                sys::set_nonblocking_fresh(out_r.as_fd()).map_err(|e| io("pipe", e))?;
                sys::set_nonblocking_fresh(err_r.as_fd()).map_err(|e| io("pipe", e))?;
                (out_r, Some(out_w), Some((err_r, err_w)), None)
            }
        };
        let (stdin_r, stdin_w) = if slave.is_none() && req.stdin {
            let (r, w) = sys::pipe().map_err(|e| io("pipe", e))?;
            sys::set_nonblocking_fresh(w.as_fd()).map_err(|e| io("pipe", e))?;
            (Some(r), Some(w))
        } else {
            (None, None)
        };
        // A cgroup of its own holds the tree: one made in the directory the
        // host delegated, or for a tenant one of those the host made while
        // one is free; else a supervisor, which reports over a pipe.
        let direct = match tenant {
            Some(t) => self.tenants.get(t).and_then(|t| t.trees.as_ref()).is_some_and(TreeCgroups::has_free),
            None => self.tree_cgroups.is_some(),
        };
        let status = if direct {
            None
        } else {
            let (status_r, status_w) = sys::pipe().map_err(|e| io("pipe", e))?;
            sys::set_nonblocking_fresh(status_r.as_fd()).map_err(|e| io("pipe", e))?;
            Some((status_r, status_w))
        };

        let devnull = self.devnull()?;
        let tenant_of = tenant.and_then(|t| self.tenants.get(t));
        let work_fds: Vec<i32> = match tenant_of {
            Some(t) => t.cgroups.iter().map(|f| f.as_raw_fd()).collect(),
            None => self.work_cgroups.iter().map(|f| f.as_raw_fd()).collect(),
        };
        let oom_at_start = oom_kills(match tenant_of {
            Some(t) => t.oom_events.as_ref(),
            None => self.oom_events.as_ref(),
        });
        let (stdin_fd, stdout_fd, stderr_fd) = match (&slave, &out_w, &err) {
            (Some(s), _, _) => (s.as_raw_fd(), s.as_raw_fd(), s.as_raw_fd()),
            (None, Some(o), Some((_, e))) => {
                (stdin_r.as_ref().map_or(devnull, |r| r.as_raw_fd()), o.as_raw_fd(), e.as_raw_fd())
            }
            _ => return Err((ErrorCode::Io, "inconsistent process descriptors".into())),
        };
        // Last before the spawn: nothing returns early with it taken.
        let cgroup = match self.trees_of(tenant).filter(|_| direct) {
            Some(trees) => Some(trees.take().map_err(|e| io("command cgroup", e))?),
            None => None,
        };
        let tenant_of = tenant.and_then(|t| self.tenants.get(t));
        let plan = ChildPlan {
            exe,
            argv0: argv_c[0].clone(),
            argv: CStrArray::new(argv_c),
            envp: CStrArray::new(envp_c),
            uid: user.uid,
            gid: user.gid,
            root_caps: self.cfg.root_caps,
            bounding_reduced: self.bounding_reduced,
            stdin: stdin_fd,
            stdout: stdout_fd,
            stderr: stderr_fd,
            tty: slave.is_some(),
            cwd: cwd_fd.as_raw_fd(),
            status: status.as_ref().map_or(-1, |(_, w)| w.as_raw_fd()),
            nofile: self.nofile,
            reset_oom: self.reset_oom,
            filter: &self.cfg.filter,
            work_cgroups: &work_fds,
            tenant: tenant_of.map(|t| child::TenantLimits { landlock: t.ruleset.as_raw_fd(), rlimits: &t.rlimits }),
        };
        let spawned = match &cgroup {
            Some(c) => child::spawn_direct(&plan, c.procs()),
            // SAFETY: the agent is single threaded.
            None => match unsafe { sys::fork() } {
                Ok(0) => child::supervise(&plan),
                r => r,
            },
        };
        // The child's ends must close here, so that EOF reaches the agent.
        drop((plan, out_w, slave, stdin_r, cwd_fd));
        let err_r = err.map(|(r, w)| {
            drop(w);
            r
        });
        let spawned = match spawned {
            Ok(pid) => pid,
            Err(e) => {
                if let (Some(c), Some(trees)) = (cgroup, self.trees_of(tenant)) {
                    trees.put(c);
                }
                return Err(io("fork", e));
            }
        };
        let (keeper, pid, status_r) = match (cgroup, status) {
            (Some(c), _) => {
                let keeper =
                    CgroupKeeper { cgroup: Some(c), main: Some(spawned), events: 0, killing: false, held: None };
                (Keeper::Cgroup(keeper), spawned as u32, None)
            }
            (None, Some((status_r, status_w))) => {
                drop(status_w);
                match wait_for_pid(&status_r) {
                    Ok(pid) => (Keeper::Supervisor(spawned), pid, Some(status_r)),
                    Err(e) => {
                        let _ = sys::kill(spawned, libc::SIGKILL);
                        return Err(e);
                    }
                }
            }
            (None, None) => return Err((ErrorCode::Io, "a command needs a supervisor or a cgroup".into())),
        };

        let serial = self.next_proc;
        self.next_proc += 1;
        let timeout_at = req.timeout_ms.and_then(|ms| Instant::now().checked_add(Duration::from_millis(ms)));
        let replay = self.cfg.replay_bytes;
        let stream = |fd: Option<OwnedFd>| OutStream { fd, events: 0, ring: Ring::new(replay) };
        let mut p = Proc {
            keeper,
            tree_gone: false,
            info: ProcessInfo {
                pid,
                tag: req.tag.clone(),
                cmd: req.cmd,
                user: user.name,
                cwd,
                pty: req.pty.is_some(),
                stdin: req.stdin,
                env: req.env,
                exited: None,
            },
            streams: [stream(Some(out_r)), stream(err_r)],
            stdin: stdin_w,
            stdin_events: 0,
            stdin_buf: Vec::new(),
            stdin_close: false,
            status: status_r,
            status_events: 0,
            subs: if req.subscribe { vec![conn] } else { Vec::new() },
            timeout_at,
            timed_out: false,
            kill_requested: false,
            oom_at_start,
            exited: None,
            descendants_alive: false,
            finished: false,
            tenant,
            limit: req.output_limit.filter(|_| req.subscribe).map(|n| Limit { conn, left: [n; 2], told: [false; 2] }),
        };
        sync_proc(&self.epoll, &self.out, serial, &mut p);
        if let Some(at) = timeout_at {
            self.timers.insert((at, serial, TimerKind::Timeout));
        }
        if let Some(tag) = req.tag {
            self.tags.insert(tag_key(tenant, &tag), serial);
        }
        self.by_pid.insert(pid, serial);
        match &p.keeper {
            Keeper::Supervisor(sup) => {
                self.by_sup.insert(*sup, serial);
                self.supervisors.insert(*sup);
            }
            Keeper::Cgroup(_) => {
                self.by_main.insert(spawned, serial);
            }
        }
        self.procs.insert(serial, p);
        Ok(pid)
    }

    /// /dev/null for a stdin nobody writes to, opened once.
    fn devnull(&mut self) -> Result<i32, SpawnError> {
        if self.devnull.is_none() {
            let fd = sys::open(c"/dev/null", libc::O_RDONLY).map_err(|e| (ErrorCode::Io, format!("/dev/null: {e}")))?;
            self.devnull = Some(fd);
        }
        Ok(self.devnull.as_ref().map_or(-1, |f| f.as_raw_fd()))
    }

    fn find(&self, pid: u32) -> Result<u64, Box<Reply>> {
        self.by_pid
            .get(&pid)
            .copied()
            .ok_or_else(|| Box::new(error(ErrorCode::UnknownProcess, format!("no process {pid}"))))
    }

    /// A command whose main process still runs (for stdin and terminals).
    fn find_running(&self, pid: u32) -> Result<u64, Box<Reply>> {
        let serial = self.find(pid)?;
        match self.procs.get(&serial) {
            Some(p) if !p.finished => Ok(serial),
            _ => Err(Box::new(error(
                ErrorCode::UnknownProcess,
                format!("process {pid} exited; processes it started still run"),
            ))),
        }
    }

    fn attach(&mut self, conn: u64, id: u64, target: Target) {
        let serial = match &target {
            Target::Pid(pid) => self.by_pid.get(pid),
            Target::Tag(tag) => {
                let tenant = self.out.conns.get(&conn).and_then(|c| c.tenant);
                self.tags.get(&tag_key(tenant, tag))
            }
        };
        let Some(p) = serial.and_then(|s| self.procs.get_mut(s)) else {
            let reply = error(ErrorCode::UnknownProcess, format!("no process {target:?}"));
            return self.reply(conn, id, reply, &[]);
        };
        let pid = p.info.pid;
        let _ = self.out.send(conn, &FromAgent::Reply { id, reply: Reply::Attached { pid } }, &[]);
        if let (true, Some(status)) = (p.finished, p.info.exited) {
            // The main process is gone, its output with it: only the exit.
            let _ = self.out.send(conn, &FromAgent::Exit { pid, status }, &[]);
            return;
        }
        for idx in 0..2 {
            let stream = Proc::stream_kind(idx);
            let (dropped, kept) = p.streams[idx].ring.take();
            if dropped > 0 {
                let _ = self.out.send(conn, &FromAgent::Dropped { pid, stream, bytes: dropped }, &[]);
            }
            for chunk in kept.chunks(proto::MAX_DATA) {
                let _ = self.out.send(conn, &FromAgent::Output { pid, stream }, chunk);
            }
        }
        if !p.subs.contains(&conn) {
            p.subs.push(conn);
        }
        self.congestion_changed = true;
    }

    fn detach(&mut self, conn: u64, pid: u32) -> Reply {
        let serial = match self.find(pid) {
            Ok(s) => s,
            Err(r) => return *r,
        };
        if let Some(p) = self.procs.get_mut(&serial) {
            p.subs.retain(|&c| c != conn);
        }
        self.congestion_changed = true;
        Reply::Ok
    }

    fn stdin(&mut self, pid: u32, data: &[u8]) -> Reply {
        let serial = match self.find_running(pid) {
            Ok(s) => s,
            Err(r) => return *r,
        };
        let Some(p) = self.procs.get_mut(&serial) else { return error(ErrorCode::UnknownProcess, "gone") };
        if p.stdin_fd().is_none() || p.stdin_close {
            return error(ErrorCode::InvalidRequest, format!("stdin of process {pid} is not open"));
        }
        if !p.stdin_buf.is_empty() && p.stdin_buf.len() + data.len() > STDIN_BUFFER {
            return error(ErrorCode::Capacity, format!("stdin of process {pid} is full; retry later"));
        }
        p.stdin_buf.extend_from_slice(data);
        let r = pump_stdin(&self.epoll, p);
        sync_proc(&self.epoll, &self.out, serial, p);
        match r {
            Ok(()) => Reply::Ok,
            Err(e) => error(ErrorCode::Io, format!("stdin of process {pid}: {e}")),
        }
    }

    fn stdin_writable(&mut self, serial: u64) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        if !p.stdin_buf.is_empty() {
            let _ = pump_stdin(&self.epoll, p);
        }
        sync_proc(&self.epoll, &self.out, serial, p);
    }

    fn close_stdin(&mut self, pid: u32) -> Reply {
        let serial = match self.find_running(pid) {
            Ok(s) => s,
            Err(r) => return *r,
        };
        let Some(p) = self.procs.get_mut(&serial) else { return error(ErrorCode::UnknownProcess, "gone") };
        if p.info.pty {
            // End of file on a terminal is the EOF character at a line start.
            if p.streams[0].fd.is_some() {
                p.stdin_buf.push(0x04);
                let _ = pump_stdin(&self.epoll, p);
            }
        } else if !p.info.stdin {
            return error(ErrorCode::InvalidRequest, format!("process {pid} has no stdin"));
        } else if p.stdin_buf.is_empty() {
            close_fd(&self.epoll, &mut p.stdin, &mut p.stdin_events);
        } else {
            p.stdin_close = true;
        }
        sync_proc(&self.epoll, &self.out, serial, p);
        Reply::Ok
    }

    fn signal(&mut self, pid: u32, signal: i32) -> Reply {
        if !(1..=64).contains(&signal) {
            return error(ErrorCode::InvalidRequest, format!("signal {signal} out of range"));
        }
        let serial = match self.find(pid) {
            Ok(s) => s,
            Err(r) => return *r,
        };
        let Some(p) = self.procs.get_mut(&serial) else { return error(ErrorCode::UnknownProcess, "gone") };
        if signal == libc::SIGKILL {
            p.kill_requested = true;
            self.kill_tree(serial);
            return Reply::Ok;
        }
        // Every process of the tree gets it: processes that left the
        // process group or the session, and those left after the main
        // process exited, are reached too.
        let sup = match &p.keeper {
            _ if p.tree_gone => return Reply::Ok,
            Keeper::Supervisor(sup) => *sup,
            Keeper::Cgroup(k) => {
                for member in k.cgroup.as_ref().map(TreeCgroup::members).unwrap_or_default() {
                    let _ = sys::kill(member, signal);
                }
                return Reply::Ok;
            }
        };
        // The supervisor sends it on (see child::tree_signal).
        match sys::sigqueue(sup, child::tree_signal(), signal) {
            // ESRCH: the supervisor exited (the tree is gone) and is not yet reaped.
            Ok(()) | Err(Errno(libc::ESRCH)) => Reply::Ok,
            Err(Errno(libc::EAGAIN)) => error(ErrorCode::Capacity, format!("too many signals queued for {pid}; retry")),
            Err(e) => error(ErrorCode::Io, format!("signal {signal} to {pid}: {e}")),
        }
    }

    fn resize(&mut self, pid: u32, cols: u16, rows: u16) -> Reply {
        let serial = match self.find_running(pid) {
            Ok(s) => s,
            Err(r) => return *r,
        };
        let Some(p) = self.procs.get(&serial) else { return error(ErrorCode::UnknownProcess, "gone") };
        match (&p.streams[0].fd, p.info.pty) {
            (Some(master), true) => match sys::set_winsize(master.as_fd(), cols, rows) {
                Ok(()) => Reply::Ok,
                Err(e) => error(ErrorCode::Io, format!("resize {pid}: {e}")),
            },
            (None, true) => error(ErrorCode::InvalidRequest, format!("terminal of {pid} is closed")),
            _ => error(ErrorCode::InvalidRequest, format!("process {pid} has no terminal")),
        }
    }

    /// Commands holding a slot, sorted by pid; cut to fit one frame header
    /// (first without their environments, then fewer of them).
    fn list(&self, tenant: Option<u64>) -> Reply {
        let mut processes: Vec<ProcessInfo> =
            self.procs.values().filter(|p| p.tenant == tenant).map(|p| p.info.clone()).collect();
        processes.sort_by_key(|p| p.pid);
        let budget = proto::MAX_HEADER - 256;
        let size = |ps: &[ProcessInfo]| serde_json::to_vec(ps).map_or(usize::MAX, |v| v.len());
        if size(&processes) > budget {
            for p in &mut processes {
                p.env.clear();
            }
            while size(&processes) > budget {
                let keep = processes.len() * 9 / 10;
                processes.truncate(keep);
            }
        }
        Reply::Processes { processes }
    }

    fn read_stream(&mut self, serial: u64, idx: usize) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        let Some(fd) = p.streams[idx].fd.as_ref() else { return };
        self.scratch.clear();
        match sys::read_append(fd.as_fd(), &mut self.scratch, READ_CHUNK) {
            Ok(0) | Err(Errno(libc::EIO)) => {}
            Ok(_) => return deliver(&mut self.out, p, idx, &self.scratch),
            Err(Errno(libc::EAGAIN | libc::EINTR)) => return,
            Err(_) => {}
        }
        // End of the stream (EIO: a pty whose slave side is closed).
        let s = &mut p.streams[idx];
        close_fd(&self.epoll, &mut s.fd, &mut s.events);
        if !p.finished && p.exited.is_some() && p.streams.iter().all(|s| s.fd.is_none()) {
            self.finish(serial, None);
        }
    }

    fn status_readable(&mut self, serial: u64) {
        loop {
            let Some(p) = self.procs.get_mut(&serial) else { return };
            let Some(fd) = p.status.as_ref() else { return };
            let mut m = [0u8; 8];
            match sys::read(fd.as_fd(), &mut m) {
                Ok(8) => match child::decode_msg(m) {
                    (child::MSG_STATUS, status) => return self.main_exited(serial, status, false),
                    (child::MSG_STATUS_LIVE, status) => return self.main_exited(serial, status, true),
                    _ => {}
                },
                Err(Errno(libc::EAGAIN)) => return,
                Err(Errno(libc::EINTR)) => {}
                // EOF (or garbage): the supervisor is gone; its reaping decides.
                _ => {
                    close_fd(&self.epoll, &mut p.status, &mut p.status_events);
                    return;
                }
            }
        }
    }

    /// The main process exited; `live`: other processes of its tree did not.
    fn main_exited(&mut self, serial: u64, status: i32, live: bool) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        close_fd(&self.epoll, &mut p.status, &mut p.status_events);
        p.descendants_alive = live;
        if !live {
            // Nothing is left to list or signal (a supervisor exits now).
            p.tree_gone = true;
        }
        if p.info.pty && p.streams[0].fd.is_some() {
            // A pty hands output to the master asynchronously: give it a moment.
            let at = Instant::now() + PTY_GRACE;
            p.exited = Some((status, at));
            self.timers.insert((at, serial, TimerKind::PtyDrain));
        } else {
            p.exited = Some((status, Instant::now()));
            self.finish(serial, None);
        }
    }

    /// Sends the rest of the output and the exit, and closes the command's
    /// descriptors; forgets it when nothing of its tree is left, else keeps
    /// it listed (see `forget`). `died` is the supervisor's own status when
    /// it never reported.
    fn finish(&mut self, serial: u64, died: Option<i32>) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        if p.finished {
            return;
        }
        let mut budget = EXIT_DRAIN;
        for idx in 0..2 {
            while budget > 0 {
                let Some(fd) = p.streams[idx].fd.as_ref() else { break };
                self.scratch.clear();
                match sys::read_append(fd.as_fd(), &mut self.scratch, READ_CHUNK.min(budget)) {
                    Ok(0) => break,
                    Ok(n) => {
                        budget -= n;
                        deliver(&mut self.out, p, idx, &self.scratch);
                    }
                    Err(Errno(libc::EINTR)) => {}
                    Err(_) => break,
                }
            }
        }
        let mut status = match (p.exited, died) {
            (Some((ws, _)), _) => exit_status(ws, p.timed_out),
            (None, Some(died)) => exit_status(died, p.timed_out),
            (None, None) => ExitStatus { code: None, signal: None, timed_out: p.timed_out, ..ExitStatus::exited(0) },
        };
        status.descendants_alive = p.descendants_alive && !p.tree_gone;
        status.oom_killed = killed_by_sigkill(&status)
            && !status.timed_out
            && !p.kill_requested
            && matches!((p.oom_at_start, oom_kills(self.oom_events.as_ref())), (Some(b), Some(a)) if a > b);
        p.info.exited = Some(status);
        p.finished = true;
        let msg = FromAgent::Exit { pid: p.info.pid, status };
        for &c in &p.subs {
            let _ = self.out.send(c, &msg, &[]);
        }
        p.subs.clear();
        p.stdin_buf = Vec::new();
        for s in &mut p.streams {
            close_fd(&self.epoll, &mut s.fd, &mut s.events);
            s.ring = Ring::new(0);
        }
        close_fd(&self.epoll, &mut p.stdin, &mut p.stdin_events);
        close_fd(&self.epoll, &mut p.status, &mut p.status_events);
        if let Some((_, at)) = p.exited {
            self.timers.remove(&(at, serial, TimerKind::PtyDrain));
        }
        if p.tree_gone {
            self.forget(serial);
        }
    }

    /// Drops a command whose tree has ended: its record, tag, pid and timer.
    fn forget(&mut self, serial: u64) {
        let Some(p) = self.procs.remove(&serial) else { return };
        if let Some(at) = p.timeout_at {
            self.timers.remove(&(at, serial, TimerKind::Timeout));
        }
        if let Some(tag) = &p.info.tag {
            self.tags.remove(&tag_key(p.tenant, tag));
        }
        if self.by_pid.get(&p.info.pid) == Some(&serial) {
            self.by_pid.remove(&p.info.pid);
        }
        // (A command cgroup went back to the pool as its tree ended.)
        if let Keeper::Supervisor(sup) = p.keeper {
            if self.by_sup.get(&sup) == Some(&serial) {
                self.by_sup.remove(&sup);
            }
        }
    }

    /// Reaps every exited child: supervisors, commands' main processes,
    /// and orphans PID 1 inherits.
    fn reap(&mut self) {
        sys::drain_signalfd(self.sigfd.as_fd());
        let mut orphans = false;
        loop {
            match sys::waitpid(-1, libc::WNOHANG) {
                Ok(Some((pid, status))) => {
                    if self.supervisors.remove(&pid) {
                        if let Some(serial) = self.by_sup.remove(&pid) {
                            self.supervisor_gone(serial, status);
                        }
                    } else if let Some(serial) = self.by_main.remove(&pid) {
                        self.main_reaped(serial, status);
                    } else {
                        orphans = true;
                    }
                }
                Err(Errno(libc::EINTR)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        if orphans {
            // Under gVisor supervisors are no subreapers: the last process
            // of a command's tree to exit is an orphan of ours, and its
            // supervisor, which tracks the tree by a cgroup, hears of it
            // only from us (see child.rs). Elsewhere orphans come here only
            // when their supervisor is gone, and no supervisor has a cgroup.
            let root = std::path::Path::new(child::TREE_CGROUP_ROOT);
            for &sup in &self.supervisors {
                if child::tree_emptied(root, sup) {
                    let _ = sys::kill(sup, libc::SIGCHLD);
                }
            }
        }
    }

    /// The main process of a command without a supervisor was reaped.
    fn main_reaped(&mut self, serial: u64, status: i32) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        let Keeper::Cgroup(k) = &mut p.keeper else { return };
        k.main = None;
        // Its own exit already left the cgroup (a zombie counts for none).
        let live = k.cgroup.as_ref().is_some_and(|c| c.populated().unwrap_or(false));
        if live {
            // Woken when the rest of the tree is gone (see tree_changed);
            // registering after the read misses no change.
            if let Some(c) = &k.cgroup {
                self.epoll.update(c.events().as_raw_fd(), token(T_TREE, serial), &mut k.events, PRI);
            }
            if k.killing {
                k.held = Some(status);
                return;
            }
        } else {
            self.release_cgroup(serial);
        }
        self.main_exited(serial, status, live);
    }

    /// A command's `cgroup.events` changed: once its tree is empty and its
    /// main process reaped, the command's slot is free.
    fn tree_changed(&mut self, serial: u64) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        let Keeper::Cgroup(k) = &mut p.keeper else { return };
        // Read, which also acknowledges the change; a failed read is taken
        // for an empty tree rather than a wake-up forever.
        if k.cgroup.as_ref().is_none_or(|c| c.populated().unwrap_or(false)) || k.main.is_some() {
            // The main process's reaping looks again.
            return;
        }
        let held = k.held.take();
        self.release_cgroup(serial);
        match held {
            Some(status) => self.main_exited(serial, status, false),
            None => self.tree_ended(serial, None),
        }
    }

    /// Gives a command's emptied cgroup back to the pool it came from (a
    /// removed tenant's is dropped).
    fn release_cgroup(&mut self, serial: u64) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        let Keeper::Cgroup(k) = &mut p.keeper else { return };
        let Some(c) = k.cgroup.take() else { return };
        self.epoll.update(c.events().as_raw_fd(), 0, &mut k.events, 0);
        let tenant = p.tenant;
        if let Some(trees) = self.trees_of(tenant) {
            trees.put(c);
        }
    }

    /// The command cgroups a command of `tenant` (or the sandbox's own,
    /// for none) takes from.
    fn trees_of(&mut self, tenant: Option<u64>) -> Option<&mut TreeCgroups> {
        match tenant {
            Some(t) => self.tenants.by_id.get_mut(&t).and_then(|t| t.trees.as_mut()),
            None => self.tree_cgroups.as_mut(),
        }
    }

    /// Ends every process of a command's tree (timeout, SIGKILL, a
    /// tenant's removal); nothing when the tree is gone.
    fn kill_tree(&mut self, serial: u64) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        if p.tree_gone {
            return;
        }
        match &mut p.keeper {
            Keeper::Supervisor(sup) => {
                let _ = sys::kill(*sup, libc::SIGUSR1);
            }
            Keeper::Cgroup(k) => {
                if let Some(c) = &k.cgroup {
                    k.killing = true;
                    let _ = c.kill();
                }
            }
        }
    }

    fn supervisor_gone(&mut self, serial: u64, status: i32) {
        // A report may still sit in the pipe.
        self.status_readable(serial);
        self.tree_ended(serial, Some(status));
    }

    /// Nothing of a command's tree is left: its slot is free. `died`: the
    /// supervisor's own status, for a command whose end was never told.
    fn tree_ended(&mut self, serial: u64, died: Option<i32>) {
        let Some(p) = self.procs.get_mut(&serial) else { return };
        p.tree_gone = true;
        if p.finished {
            self.forget(serial);
        } else if p.exited.is_none() {
            self.finish(serial, died);
        }
        // Else a pty's output drains; its timer finishes and forgets it.
    }

    // -- files and watches ---------------------------------------------------

    fn file_op(&mut self, conn: u64, req: Request, data: &[u8]) -> Result<(Reply, Vec<u8>), FsError> {
        let (req, _no_follow) = match req {
            Request::NoFollow { req } => match *req {
                Request::NoFollow { .. } | Request::Watch { .. } => {
                    return Err(FsError::new(ErrorCode::InvalidRequest, "no_follow cannot wrap this operation"))
                }
                inner => (inner, Some(self.fs.no_follow())),
            },
            other => (other, None),
        };
        let user = match &req {
            Request::ReadFile { user, .. }
            | Request::Stat { user, .. }
            | Request::ListDir { user, .. }
            | Request::Mkdir { user, .. }
            | Request::Rename { user, .. }
            | Request::Remove { user, .. }
            | Request::Watch { user, .. }
            | Request::SetXattrs { user, .. }
            | Request::GetXattrs { user, .. }
            | Request::ListPage { user, .. }
            | Request::Chmod { user, .. }
            | Request::OpenFile { user, .. } => user.as_deref(),
            Request::WriteFile(w) => w.user.as_deref(),
            _ => return Err(FsError::new(ErrorCode::InvalidRequest, "not a file operation")),
        };
        let name = user.unwrap_or("user");
        let tenant = self.out.conns.get(&conn).and_then(|c| c.tenant).and_then(|t| self.tenants.get(t));
        let user = match tenant {
            Some(t) if name == "user" => t.user(),
            Some(_) => {
                return Err(FsError::new(
                    ErrorCode::Unsupported,
                    format!("user {name:?}: a process sandbox runs only as \"user\" (no root)"),
                ))
            }
            None => self
                .users
                .lookup(self.fs.root(), name)
                .ok_or_else(|| FsError::new(ErrorCode::UnknownUser, format!("unknown user {name:?}")))?,
        };
        let base = user.home.as_str();
        let _creds = FsCreds::switch(user.uid, user.gid);
        let fs = &self.fs;
        let in_tenant = tenant.is_some();
        let norm = |p: &str| {
            files::normalize(p, base).map(|p| if in_tenant { tenants::workspace_is_home(p, base) } else { p })
        };
        let none = Vec::new;
        Ok(match req {
            Request::ReadFile { path, offset, len, .. } => fs.read_file(&norm(&path)?, offset, len)?,
            Request::WriteFile(w) => (fs.write_file(&norm(&w.path)?, &w, data)?, none()),
            Request::Stat { path, .. } => (Reply::Stat { entry: fs.stat(&norm(&path)?)? }, none()),
            Request::ListDir { path, depth, .. } => (fs.list_dir(&norm(&path)?, depth)?, none()),
            Request::Mkdir { path, parents, .. } => (fs.mkdir(&norm(&path)?, parents)?, none()),
            Request::Rename { from, to, commit: false, .. } => (fs.rename(&norm(&from)?, &norm(&to)?)?, none()),
            Request::Rename { from, to, commit: true, .. } => (fs.commit(&norm(&from)?, &norm(&to)?)?, none()),
            Request::Remove { path, .. } => (fs.remove(&norm(&path)?)?, none()),
            Request::SetXattrs { path, attrs, .. } => (fs.set_xattrs(&norm(&path)?, &attrs)?, none()),
            Request::GetXattrs { path, .. } => (fs.get_xattrs(&norm(&path)?)?, none()),
            Request::ListPage { path, recursive, after, limit, .. } => {
                fs.list_page(&norm(&path)?, recursive, after.as_deref(), limit)?
            }
            Request::Chmod { path, mode, .. } => (fs.chmod(&norm(&path)?, mode)?, none()),
            Request::OpenFile { path, write, .. } => {
                let (size, fd) = fs.open_passed(&norm(&path)?, write)?;
                // Under gVisor (`--dir`) a descriptor is the sentry's own and
                // cannot cross its host socket (it drops the connection):
                // the bytes go through frames.
                let fd = fd.filter(|_| self.dir.is_none());
                let passed = fd.is_some();
                self.passing = fd;
                (Reply::Opened { size, passed }, none())
            }
            Request::Watch { path, recursive, allow_network_mounts, .. } => {
                let path = norm(&path)?;
                let dir = fs.open_dir(&path)?;
                if !allow_network_mounts && files::Fs::on_network_mount(dir.as_fd()) {
                    return Err(FsError::new(
                        ErrorCode::InvalidRequest,
                        format!("cannot watch {path}: it is on a network file system (allow network mounts to)"),
                    ));
                }
                let (watch, created) = self.watches.add(conn, &path, recursive)?;
                if created {
                    if let Some(fd) = self.watches.fd() {
                        self.epoll
                            .add(fd.as_raw_fd(), IN, token(T_INOTIFY, 0))
                            .map_err(|e| FsError::os("watch", &path, e))?;
                    }
                }
                (Reply::Watching { watch }, none())
            }
            _ => return Err(FsError::new(ErrorCode::InvalidRequest, "not a file operation")),
        })
    }

    fn watch_events(&mut self) {
        let out = &self.out;
        let deliveries = self.watches.read_events(|c| out.congested(c));
        for d in deliveries {
            let _ = self.out.send(d.conn, &FromAgent::Watch { watch: d.watch, event: d.event }, &[]);
        }
    }

    // -- timers --------------------------------------------------------------

    fn timeout_ms(&self) -> i32 {
        let resume = match self.quiesce {
            Quiesce::Waiting(at) => Some(at),
            _ => None,
        };
        let next = [self.timers.first().map(|t| t.0), self.listen_retry, resume].into_iter().flatten().min();
        let Some(at) = next else { return -1 };
        let left = at.saturating_duration_since(Instant::now());
        // Round up, so that the loop does not wake just before the deadline.
        let ms = left.as_micros().div_ceil(1000);
        ms.min(i32::MAX as u128) as i32
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(&(at, serial, kind)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            match kind {
                TimerKind::Timeout => {
                    if let Some(p) = self.procs.get_mut(&serial) {
                        p.timeout_at = None;
                        if p.exited.is_none() {
                            p.timed_out = true;
                        }
                    }
                    // Also after the main process exited: the timeout
                    // ends the whole tree.
                    self.kill_tree(serial);
                }
                TimerKind::PtyDrain => self.finish(serial, None),
            }
        }
        if self.listen_retry.is_some_and(|at| at <= now) {
            self.listen_retry = None;
            if let Some(l) = &self.listener {
                self.epoll.update(l.as_raw_fd(), token(T_LISTEN, 0), &mut self.listen_events, IN);
            }
        }
        if matches!(self.quiesce, Quiesce::Waiting(at) if at <= now) {
            // A resume that cannot listen leaves the agent unreachable:
            // look again later rather than end PID 1.
            if self.try_resume().is_err() {
                self.quiesce = Quiesce::Waiting(now + ACCEPT_BACKOFF);
            }
        }
    }
}

/// Whether an exit may be the OOM killer's: the main process died of
/// SIGKILL or, as a shell, reports a child's SIGKILL as 137. It was, when
/// nobody asked for that kill (a timeout or a signal request) and the
/// workload cgroup's OOM kill count rose while the command ran (the kernel
/// counts before it sends the signal).
fn killed_by_sigkill(status: &ExitStatus) -> bool {
    status.signal == Some(libc::SIGKILL) || status.code == Some(128 + libc::SIGKILL)
}

/// The workload cgroup's OOM kills so far, from its counter file.
/// The key of a command's tag: tenants' tags live apart from each other's.
fn tag_key(tenant: Option<u64>, tag: &str) -> String {
    match tenant {
        Some(t) => format!("{t}\0{tag}"),
        None => tag.to_owned(),
    }
}

fn oom_kills(file: Option<&OwnedFd>) -> Option<u64> {
    let mut buf = [0u8; 512];
    let n = sys::pread(file?.as_fd(), &mut buf, 0).ok()?;
    parse_oom_kills(&buf[..n])
}

/// The `oom_kill` count of a cgroup's `memory.events` (v2) or
/// `memory.oom_control` (v1): lines of "key value".
pub fn parse_oom_kills(text: &[u8]) -> Option<u64> {
    tree::cgroup_key(text, "oom_kill")?.trim().parse().ok()
}

/// Reads the supervisor's first report: the real child's pid.
fn wait_for_pid(status: &OwnedFd) -> Result<u32, SpawnError> {
    let deadline = Instant::now() + Duration::from_millis(SPAWN_WAIT_MS as u64);
    let mut m = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match sys::read(status.as_fd(), &mut m[got..]) {
            Ok(0) => return Err((ErrorCode::Io, "the process supervisor exited at start".into())),
            Ok(n) => got += n,
            Err(Errno(libc::EINTR)) => {}
            Err(Errno(libc::EAGAIN)) => {
                let left = deadline.saturating_duration_since(Instant::now()).as_millis() as i32;
                if left == 0 || !sys::poll_in(status.as_fd(), left).unwrap_or(true) {
                    return Err((ErrorCode::Io, "the process supervisor did not start".into()));
                }
            }
            Err(e) => return Err((ErrorCode::Io, format!("supervisor status: {e}"))),
        }
    }
    match child::decode_msg(m) {
        (child::MSG_PID, pid) if pid > 0 => Ok(pid as u32),
        (child::MSG_FORK_FAILED, errno) => Err((ErrorCode::Io, format!("fork: {}", Errno(errno)))),
        (kind, value) => Err((ErrorCode::Io, format!("unexpected supervisor report {kind}/{value}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kill_counts_are_read_from_v1_and_v2_files() {
        let v2 = b"low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        let v1 = b"oom_kill_disable 0\nunder_oom 0\noom_kill 7\n";
        assert_eq!(parse_oom_kills(v2), Some(2));
        assert_eq!(parse_oom_kills(v1), Some(7));
        assert_eq!(parse_oom_kills(b"oom_kill_disable 0\n"), None);
        assert_eq!(parse_oom_kills(b"oom_kill x\n"), None);
        assert_eq!(parse_oom_kills(&[0xff, 0xfe]), None);
    }

    #[test]
    fn only_sigkill_or_a_shells_137_can_be_an_oom_kill() {
        let st = |code, signal| ExitStatus { code, signal, ..ExitStatus::exited(0) };
        assert!(killed_by_sigkill(&st(None, Some(libc::SIGKILL))));
        assert!(killed_by_sigkill(&st(Some(137), None)));
        assert!(!killed_by_sigkill(&st(None, Some(libc::SIGTERM))));
        assert!(!killed_by_sigkill(&st(Some(1), None)));
    }
}
