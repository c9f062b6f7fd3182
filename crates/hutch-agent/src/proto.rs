//! Frames and messages of the host-agent protocol.
//!
//! One frame on the wire is
//!
//! ```text
//! u32 len | u32 header_len | header: JSON, header_len bytes | data: len - 4 - header_len bytes
//! ```
//!
//! little endian, where `len` counts everything after itself. The header is
//! one of the message types below; the data part carries raw bytes (process
//! output, stdin, file contents) so that bulk data is never base64-encoded.
//! Both sides reject a frame whose sizes are out of bounds before they
//! allocate anything for it: the host treats every byte from the agent as
//! hostile, because a workload that gains the agent's privileges can replace
//! the agent.
//!
//! Requests carry an `id` chosen by the host; every request gets exactly one
//! [`FromAgent::Reply`] with that id. Process output, process exits and file
//! watch events arrive as separate, unsolicited messages on each connection
//! that subscribed to them.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of this protocol; the agent reports it in [`Reply::Pong`].
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest JSON header in either direction.
pub const MAX_HEADER: usize = 64 * 1024;
/// Largest data part in either direction (a file chunk, an output chunk).
pub const MAX_DATA: usize = 4 * 1024 * 1024;
/// Largest frame, not counting the leading length word.
pub const MAX_FRAME: usize = 4 + MAX_HEADER + MAX_DATA;
/// Largest path accepted in a request.
pub const MAX_PATH: usize = 4096;

/// Why a frame could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The frame's length word exceeds [`MAX_FRAME`] or is shorter than a header.
    BadLength(u32),
    /// The header length exceeds [`MAX_HEADER`] or the frame.
    BadHeaderLength(u32),
    /// The header is not valid JSON for the expected message type.
    BadHeader(String),
    /// The data part exceeds [`MAX_DATA`].
    DataTooLarge(usize),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::BadLength(n) => write!(f, "frame length {n} out of bounds"),
            FrameError::BadHeaderLength(n) => write!(f, "frame header length {n} out of bounds"),
            FrameError::BadHeader(e) => write!(f, "malformed frame header: {e}"),
            FrameError::DataTooLarge(n) => write!(f, "frame data of {n} bytes exceeds the limit"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Appends one frame holding `header` and `data` to `out`.
pub fn encode<T: Serialize>(header: &T, data: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    if data.len() > MAX_DATA {
        return Err(FrameError::DataTooLarge(data.len()));
    }
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    serde_json::to_writer(&mut *out, header).map_err(|e| FrameError::BadHeader(e.to_string()))?;
    let header_len = out.len() - start - 8;
    if header_len > MAX_HEADER {
        out.truncate(start);
        return Err(FrameError::BadHeaderLength(header_len as u32));
    }
    out.extend_from_slice(data);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&(header_len as u32).to_le_bytes());
    Ok(())
}

/// A frame split out of a buffer: its header bytes and its data bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct RawFrame<'a> {
    pub header: &'a [u8],
    pub data: &'a [u8],
    /// Bytes of the buffer this frame used, including its length word.
    pub consumed: usize,
}

/// Splits the first frame out of `buf`, or `Ok(None)` when `buf` does not yet
/// hold all of it. Validates both lengths, and so the data's, before
/// anything is trusted.
pub fn split_frame(buf: &[u8]) -> Result<Option<RawFrame<'_>>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    check_len(len)?;
    let total = 4 + len as usize;
    if buf.len() < 8 {
        return Ok(None);
    }
    let header_len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if header_len as usize > MAX_HEADER || header_len > len - 4 {
        return Err(FrameError::BadHeaderLength(header_len));
    }
    let data_len = (len - 4 - header_len) as usize;
    if data_len > MAX_DATA {
        return Err(FrameError::DataTooLarge(data_len));
    }
    if buf.len() < total {
        return Ok(None);
    }
    let header_end = 8 + header_len as usize;
    Ok(Some(RawFrame { header: &buf[8..header_end], data: &buf[header_end..total], consumed: total }))
}

/// Validates a frame's length word; exposed so that readers can refuse an
/// oversized frame before they allocate a buffer for it.
pub fn check_len(len: u32) -> Result<(), FrameError> {
    if (len as usize) < 4 || len as usize > MAX_FRAME {
        return Err(FrameError::BadLength(len));
    }
    Ok(())
}

/// Parses a frame header as message type `T`.
pub fn parse_header<'a, T: Deserialize<'a>>(header: &'a [u8]) -> Result<T, FrameError> {
    serde_json::from_slice(header).map_err(|e| FrameError::BadHeader(e.to_string()))
}

/// Configuration the host hands the agent once, at start, as one frame on the
/// agent's file descriptor 4. Its data part is the compiled seccomp filter
/// (classic BPF, 8 bytes an instruction) every workload process installs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub version: u32,
    /// Environment every process in the sandbox starts with (before the
    /// request's own variables).
    pub env: Vec<(String, String)>,
    /// Capabilities (as a bit mask of `CAP_*` numbers) that processes run as
    /// root inside the sandbox keep; everything else is dropped, also from
    /// the bounding set. Processes of other users keep none.
    pub root_caps: u64,
    /// Bytes of output kept per stream for a process nobody is attached to.
    pub replay_bytes: u32,
    /// Most commands whose process trees are alive at once: a command holds
    /// its slot until every process it started has exited. A spawn past it
    /// is refused with [`ErrorCode::Capacity`] and starts nothing.
    #[serde(default = "default_max_commands")]
    pub max_commands: u32,
    /// How many `cgroup.procs` files of the sandbox's workload cgroup the
    /// host passes, open for writing, as descriptors [`WORK_CGROUP_FD`] and
    /// up (at most [`MAX_WORK_CGROUPS`]): every command writes itself into
    /// them before it execs, so that the workload's memory and pids limits,
    /// and its OOM kills, never reach the agent.
    #[serde(default)]
    pub work_cgroups: u32,
    /// Whether the descriptor after those (`WORK_CGROUP_FD + work_cgroups`)
    /// is the workload cgroup's OOM counter file, open for reading
    /// (`memory.events` on cgroup v2, `memory.oom_control` on v1), from
    /// which exits are told apart as OOM kills.
    #[serde(default)]
    pub oom_events: bool,
    /// Whether the descriptor after those is a directory of the sandbox's
    /// cgroup v2 tree that the host delegated to the sandbox's root (the
    /// directory and its `cgroup.procs` are owned by it): the agent makes a
    /// cgroup per command there and tracks the command's process tree by
    /// it, with no supervisor process. The host sets the directory's
    /// `cgroup.max.descendants` and `cgroup.max.depth`, and removes what
    /// the agent made with the sandbox.
    #[serde(default)]
    pub tree_cgroup: bool,
}

/// The first descriptor of the workload cgroup's `cgroup.procs` files (see
/// [`AgentConfig::work_cgroups`]); the descriptors after the lock file (5)
/// are numbered without gaps.
pub const WORK_CGROUP_FD: i32 = 6;
/// Most workload `cgroup.procs` descriptors (one per cgroup hierarchy).
pub const MAX_WORK_CGROUPS: u32 = 4;

/// The default of [`AgentConfig::max_commands`].
pub const MAX_COMMANDS: u32 = 64;

fn default_max_commands() -> u32 {
    MAX_COMMANDS
}

/// A request from the host, with the id its reply will carry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ToAgent {
    pub id: u64,
    pub req: Request,
}

/// Every operation the agent offers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Liveness and version check.
    Ping,
    /// Starts a process. Replies [`Reply::Spawned`]; when `subscribe` is set
    /// this connection then receives the process's output and exit.
    Spawn(Spawn),
    /// Subscribes this connection to a running process's output and exit.
    /// The output kept while nobody was attached is replayed first.
    Attach { target: Target },
    /// Stops this connection's subscription to a process.
    Detach { pid: u32 },
    /// Writes the frame's data to the process's stdin.
    Stdin { pid: u32 },
    /// Closes the process's stdin.
    CloseStdin { pid: u32 },
    /// Sends a signal to every process of the command's tree: its main
    /// process (while it runs) and every process it started, including
    /// those that left its process group or session.
    Signal { pid: u32, signal: i32 },
    /// Resizes the process's terminal.
    Resize { pid: u32, size: PtySize },
    /// Lists the commands that hold a slot: those whose main process runs,
    /// and those whose main process exited while processes it started live
    /// on ([`ProcessInfo::exited`] set).
    List,
    /// Reads up to `len` bytes of a regular file from `offset`.
    ReadFile {
        path: String,
        offset: u64,
        len: u32,
        #[serde(default)]
        user: Option<String>,
    },
    /// Writes the frame's data into a file at `offset`.
    WriteFile(WriteFile),
    /// Describes a path without following a final symlink.
    Stat {
        path: String,
        #[serde(default)]
        user: Option<String>,
    },
    /// Lists a directory, `depth` levels deep (1 = its direct entries).
    ListDir {
        path: String,
        depth: u32,
        #[serde(default)]
        user: Option<String>,
    },
    /// Makes a directory and, with `parents`, its missing parents.
    Mkdir {
        path: String,
        parents: bool,
        #[serde(default)]
        user: Option<String>,
    },
    /// Renames `from` to `to`. With `commit`, `from` is an upload's
    /// temporary put in place: a regular file at `to` on the same file
    /// system is swapped out and removed instead of renamed over (the
    /// same result; see the agent's `Fs::commit`).
    Rename {
        from: String,
        to: String,
        #[serde(default)]
        user: Option<String>,
        #[serde(default)]
        commit: bool,
    },
    /// Removes a file, or a directory with everything below it.
    Remove {
        path: String,
        #[serde(default)]
        user: Option<String>,
    },
    /// Watches a directory through inotify; events arrive as [`FromAgent::Watch`].
    Watch {
        path: String,
        recursive: bool,
        #[serde(default)]
        user: Option<String>,
        /// Watch a directory on a network file system (NFS, CIFS/SMB,
        /// FUSE) too, whose events may never come; refused otherwise.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        allow_network_mounts: bool,
    },
    /// Ends a watch.
    Unwatch { watch: u64 },
    /// Sets extended attributes in the `user.` namespace.
    SetXattrs {
        path: String,
        attrs: BTreeMap<String, String>,
        #[serde(default)]
        user: Option<String>,
    },
    /// Reads the extended attributes in the `user.` namespace.
    GetXattrs {
        path: String,
        #[serde(default)]
        user: Option<String>,
    },
    /// One page of a listing of the directory `path`, in [`cmp_paths`]
    /// order (a directory right before its contents), starting after the
    /// relative path `after`. Never follows a symlink, not even for `path`
    /// itself. Replies [`Reply::Page`]; the entries are a JSON array of
    /// [`PageEntry`] in the frame's data part, because a page of them does
    /// not fit in a header.
    ListPage {
        path: String,
        /// Everything below `path`, or only its direct entries.
        recursive: bool,
        /// Resume after this path, relative to `path`.
        #[serde(default)]
        after: Option<String>,
        /// Most entries in the page, 1 to [`MAX_PAGE_ENTRIES`].
        limit: u32,
        #[serde(default)]
        user: Option<String>,
    },
    /// Sets the permission bits of a file or directory; refuses a symlink.
    Chmod {
        path: String,
        mode: u32,
        #[serde(default)]
        user: Option<String>,
    },
    /// Runs the file operation `req` with no symlink followed anywhere on
    /// its paths (`RESOLVE_NO_SYMLINKS`, `AT_SYMLINK_NOFOLLOW`): a symlink
    /// on the way answers [`ErrorCode::SymlinkRefused`]. Hosts use it for
    /// writes, so that a symlink the workload planted never redirects them.
    NoFollow { req: Box<Request> },
    /// Opens a regular file (read-only, or with `write` write-only: it must
    /// exist) and passes its descriptor to the host with the reply: one
    /// descriptor (SCM_RIGHTS) on the frame of [`Reply::Opened`], so that
    /// the host moves the file's bytes itself instead of through frames.
    /// The path is resolved as every other (inside the root, as `user`).
    /// A file on a file system whose descriptors are not passed (see
    /// [`passable_fs`]: /proc, /sys...) answers `Opened` with `passed`
    /// false and no descriptor; the host then uses [`Request::ReadFile`]
    /// and [`Request::WriteFile`], which stay for that and for agents that
    /// do not know this request.
    OpenFile {
        path: String,
        #[serde(default)]
        write: bool,
        #[serde(default)]
        user: Option<String>,
    },
    /// Makes a tenant: a process-class sandbox inside this (shared host)
    /// container. Only on the agent's own listening socket, never on a
    /// tenant's. The descriptors come with the frame (`SCM_RIGHTS`), in
    /// this order: the tenant's listening socket, then `cgroups`
    /// `cgroup.procs` files (open for writing) its commands join in order,
    /// then, with `oom_events`, its OOM counter file. Replies
    /// [`Reply::TenantAdded`]. Every connection accepted on that socket is
    /// the tenant's: its commands and file operations run as the tenant's
    /// uid under its Landlock rules, and it sees only its own processes.
    AddTenant(TenantSpec),
    /// Ends a tenant: kills what is left of its processes, closes its
    /// socket and connections, removes its home and its /tmp directory.
    /// Its uid is never given out again by this agent.
    RemoveTenant { name: String },
    /// Before a checkpoint of the sandbox (gvisor class, agent started
    /// with `--dir`): replies [`Reply::Ok`], then closes every connection
    /// and its listening socket (a host socket cannot be saved) and waits
    /// for a [`Resume`] file (`RESUME_FILE` in its directory), after
    /// which it binds a fresh socket there. Processes keep running; their
    /// output is kept as for a process nobody is attached to. Only on the
    /// agent's own socket; refused ([`ErrorCode::Unsupported`]) by an
    /// agent without a directory.
    Quiesce,
}

/// The file, in the directory of an agent started with `--dir`, that
/// ends its [`Request::Quiesce`]: one frame whose header is a [`Resume`]
/// and whose data is entropy the agent writes into `/dev/urandom`.
pub const RESUME_FILE: &str = "resume";

/// The agent binary's flag for its host-side mode, `hutch-agent --reap
/// PROGRAM ARGS...`: PROGRAM runs with a reaper of its own for the
/// processes it leaves behind (the agent's `reaper` module). The host runs
/// `runsc run --detach` and `runsc restore --detach` through it.
pub const REAP_FLAG: &str = "--reap";

/// Who a sandbox is after a restore (its own, or a new copy's).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Resume {
    /// The sandbox-wide environment from now on (replaces the one of
    /// [`AgentConfig::env`]; `None` keeps it); commands started before
    /// keep theirs.
    #[serde(default)]
    pub env: Option<Vec<(String, String)>>,
    /// The host name to set, if any.
    #[serde(default)]
    pub hostname: Option<String>,
}

/// Most descriptors an [`Request::AddTenant`] carries.
pub const MAX_TENANT_FDS: usize = 2 + 2 * MAX_WORK_CGROUPS as usize + 3 * TENANT_TREE_CGROUPS as usize;

/// Command cgroups the host makes below a tenant's v2 cgroup, where it
/// can (see [`TenantSpec::tree_cgroups`]): commands beyond them alive at
/// once get a supervisor.
pub const TENANT_TREE_CGROUPS: u32 = 2;

/// A tenant of a shared host container (see [`Request::AddTenant`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// The sandbox's id: 1 to 64 of a-z, 0-9 and -; names its home
    /// (`/home/<name>`) and its temporary directory (`/tmp/<name>`).
    pub name: String,
    /// How many `cgroup.procs` descriptors follow the listening socket.
    pub cgroups: u32,
    /// Whether the OOM counter's descriptor follows them.
    pub oom_events: bool,
    /// How many command cgroups follow, three descriptors each: its
    /// `cgroup.procs` (read-write), `cgroup.events` and `cgroup.kill`. The
    /// host made them below the tenant's v2 cgroup (at most
    /// [`TENANT_TREE_CGROUPS`]); a command of the tenant runs in a free one
    /// without a supervisor, as a container's does in its own.
    #[serde(default)]
    pub tree_cgroups: u32,
    /// Environment of the tenant's processes (after the container's,
    /// before the request's).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Most commands of this tenant alive at once.
    pub max_commands: u32,
    /// Resource limits (`RLIMIT_*` number, soft and hard value) every
    /// process of the tenant starts with.
    #[serde(default)]
    pub rlimits: Vec<(i32, u64)>,
}

/// File systems whose regular files the agent passes to the host by
/// descriptor ([`Request::OpenFile`]), by `statfs` magic: overlay (the
/// sandbox's root), btrfs (disk layers, volumes), tmpfs (memory layers),
/// ext2/3/4 and xfs (host directories of volumes). Nothing else: the host
/// reads and writes these with its own identity, so a file whose contents
/// the kernel computes for the reader (procfs, sysfs, cgroupfs, debugfs)
/// or that a process in the sandbox serves (FUSE) must never reach it.
/// The host checks the same list on every descriptor it receives.
pub const PASSABLE_FS: [i64; 5] = [0x794c_7630, 0x9123_683e, TMPFS_MAGIC, 0xef53, 0x5846_5342];

/// tmpfs's `statfs` magic.
pub const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Whether a file on a file system of `statfs` type `magic` is passed.
pub fn passable_fs(magic: i64) -> bool {
    PASSABLE_FS.contains(&magic)
}

/// Whether a file on a file system of `statfs` type `magic` is passed
/// for reading, or with `write` for writing: the agent asks it before it
/// passes a descriptor, the host of every descriptor it receives. Not for
/// writing on tmpfs, whose pages are charged to the memory cgroup of the
/// process that writes them and are not reclaimed but by swap: written by
/// the host, they would count against the host's memory, not the
/// sandbox's. (A memory layer's files are on overlay: the host asks for no
/// descriptor to write those; see the daemon's `SandboxFs::passing_writes`.)
pub fn passable(magic: i64, write: bool) -> bool {
    passable_fs(magic) && !(write && magic == TMPFS_MAGIC)
}

/// Most entries in one [`Request::ListPage`] reply.
pub const MAX_PAGE_ENTRIES: u32 = 10_000;

/// One entry of a [`Request::ListPage`] reply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PageEntry {
    /// Relative to the listed directory; UTF-8, no empty, `.` or `..`
    /// component (names that are not UTF-8 are skipped and counted).
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits (the low 12 bits of st_mode).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Where a symlink points, as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A directory the user cannot list (lacks read or search permission);
    /// it is not entered.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unreadable: bool,
}

/// The order of listings: paths compared one `/`-separated element at a
/// time, by bytes, so that a directory comes right before its contents
/// (`a`, `a/b`, `a.txt`), unlike a plain byte comparison (`a`, `a.txt`, `a/b`).
pub fn cmp_paths(a: &str, b: &str) -> std::cmp::Ordering {
    a.split('/').map(str::as_bytes).cmp(b.split('/').map(str::as_bytes))
}

/// What to run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Cmd {
    /// Executed directly, searched in `PATH` when it holds no slash.
    Argv(Vec<String>),
    /// Run with `/bin/bash -c` where bash exists, else `/bin/sh -c`.
    Shell(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Spawn {
    pub cmd: Cmd,
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Working directory; `/workspace` when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// User name from the sandbox's /etc/passwd; `user` when absent.
    #[serde(default)]
    pub user: Option<String>,
    /// Whether stdin stays open for [`Request::Stdin`]; else it is /dev/null.
    #[serde(default)]
    pub stdin: bool,
    /// Run on a new terminal of this size; output then arrives as stdout.
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// A name to attach by; unique among running processes.
    #[serde(default)]
    pub tag: Option<String>,
    /// Kill the whole process tree after this long.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Whether this connection receives output and exit.
    #[serde(default = "yes")]
    pub subscribe: bool,
    /// At most this many bytes of each stream reach this connection; the
    /// rest is read and discarded in the sandbox, and one
    /// [`FromAgent::Dropped`] per stream says output was lost. A host
    /// that keeps only so much of a command's output then does not pay
    /// for a flood past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_limit: Option<u64>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Target {
    Pid(u32),
    Tag(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WriteFile {
    pub path: String,
    /// Where the data goes; ignored with `append`.
    #[serde(default)]
    pub offset: u64,
    /// Truncate the file to `offset` before writing.
    #[serde(default)]
    pub truncate: bool,
    #[serde(default)]
    pub append: bool,
    /// Make missing parent directories.
    #[serde(default)]
    pub parents: bool,
    /// Permission bits for a file that is created.
    #[serde(default)]
    pub mode: Option<u32>,
    #[serde(default)]
    pub user: Option<String>,
}

/// A message from the agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum FromAgent {
    /// The answer to the request with this id.
    Reply { id: u64, reply: Reply },
    /// A chunk of a process's output; the bytes are the frame's data.
    Output { pid: u32, stream: Stream },
    /// Output of this stream was discarded (nobody attached and the
    /// replay buffer was full, or past the spawn's `output_limit`); `bytes`
    /// says how much, so far.
    Dropped { pid: u32, stream: Stream, bytes: u64 },
    /// The process ended. Always the last message about a pid.
    Exit { pid: u32, status: ExitStatus },
    /// Something changed below a watched directory.
    Watch { watch: u64, event: WatchEvent },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ExitStatus {
    /// The exit code, when the process exited.
    pub code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// The agent killed the process tree because its timeout passed.
    pub timed_out: bool,
    /// The kernel's OOM killer ended it: it died of SIGKILL (or, as a
    /// shell, reported a child's SIGKILL as 137) while the OOM killer ran
    /// in the workload's cgroup, and neither its timeout nor a requested
    /// SIGKILL ended it.
    #[serde(default)]
    pub oom_killed: bool,
    /// Processes the command started were still alive when its main process
    /// exited: they keep the command's slot and its entry in
    /// [`Request::List`] until they end, a [`Request::Signal`] reaches them,
    /// and the command's timeout ends them.
    #[serde(default)]
    pub descendants_alive: bool,
}

impl ExitStatus {
    /// A process that exited with `code`.
    pub fn exited(code: i32) -> ExitStatus {
        ExitStatus { code: Some(code), signal: None, timed_out: false, oom_killed: false, descendants_alive: false }
    }

    /// The shell's convention: the code, or 128 + the signal.
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 255,
        }
    }
}

/// The answer to one request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Ok,
    Pong {
        version: u32,
    },
    Spawned {
        pid: u32,
    },
    Attached {
        pid: u32,
    },
    Processes {
        processes: Vec<ProcessInfo>,
    },
    /// File bytes are the frame's data; `eof` says the read reached the end.
    Data {
        eof: bool,
        size: u64,
    },
    Written {
        len: u64,
    },
    /// The answer to [`Request::OpenFile`]: with `passed`, the frame
    /// carries the file's descriptor; `size` is the file's size when opened.
    Opened {
        size: u64,
        passed: bool,
    },
    Stat {
        entry: Entry,
    },
    Entries {
        entries: Vec<Entry>,
        truncated: bool,
    },
    Created {
        created: bool,
    },
    Watching {
        watch: u64,
    },
    Xattrs {
        attrs: BTreeMap<String, String>,
    },
    /// A page of a listing: the entries are a JSON array of [`PageEntry`]
    /// in the frame's data part. `more` says entries remain after the last
    /// one; `skipped` counts names that could not be listed (not UTF-8, or
    /// a path over [`MAX_PATH`]) with everything below them.
    Page {
        more: bool,
        skipped: u64,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    /// A tenant was made: its uid (its gid is the same) and its home.
    TenantAdded {
        uid: u32,
        home: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProcessInfo {
    pub pid: u32,
    pub tag: Option<String>,
    pub cmd: Cmd,
    pub user: String,
    pub cwd: String,
    pub pty: bool,
    pub stdin: bool,
    pub env: Vec<(String, String)>,
    /// How the main process ended, once it has: the command is listed on
    /// while processes it started live.
    #[serde(default)]
    pub exited: Option<ExitStatus>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One file system entry, described without following a final symlink.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Absolute path inside the sandbox.
    pub path: String,
    pub name: String,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits (the low 12 bits of st_mode).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, nanoseconds since the epoch.
    #[serde(with = "nanos_as_i64")]
    pub mtime_ns: i128,
    /// Where a symlink points, as stored (not resolved).
    pub target: Option<String>,
    /// For a symlink of a [`Request::Stat`] or [`Request::ListDir`]: what
    /// it resolves to inside the sandbox, followed to the end; absent when
    /// it does not resolve (or from agents older than this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<Box<Resolved>>,
}

/// What a symlink leads to.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Resolved {
    /// Absolute path inside the sandbox, every symlink on the way followed.
    pub path: String,
    pub kind: EntryKind,
    /// Permission bits of the target.
    pub mode: u32,
}

/// Nanosecond timestamps travel as JSON integers in the i64 range (years
/// 1677 to 2262): serde buffers the content of an internally tagged enum such
/// as [`Reply`] before decoding it, and that buffer cannot hold an i128.
mod nanos_as_i64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &i128, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i64((*v).clamp(i64::MIN as i128, i64::MAX as i128) as i64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i128, D::Error> {
        i64::deserialize(d).map(i128::from)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WatchEvent {
    pub kind: WatchKind,
    /// Path relative to the watched directory.
    pub name: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
    /// Events were lost (the kernel queue overflowed).
    Overflow,
}

/// Stable error codes of the agent.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request was malformed or out of bounds.
    InvalidRequest,
    /// A path was empty, too long, held NUL or a `..` component.
    InvalidPath,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    NotADirectory,
    IsADirectory,
    /// A symlink or a mount on the way would leave the sandbox root.
    SymlinkRefused,
    /// The writable layer is full (ENOSPC).
    NoSpace,
    UnknownUser,
    UnknownProcess,
    /// A tag is already used by a running process.
    TagInUse,
    /// The agent holds as many processes or watches as it allows.
    Capacity,
    /// Anything else the kernel refused; the message has the errno.
    Io,
    /// Not for this sandbox's class: a process sandbox asked for root, or
    /// a tenant where Landlock is missing.
    Unsupported,
}

impl ErrorCode {
    /// Maps an errno from a file operation onto a code.
    pub fn from_errno(errno: i32) -> ErrorCode {
        match errno {
            libc::ENOENT => ErrorCode::NotFound,
            libc::EEXIST | libc::ENOTEMPTY => ErrorCode::AlreadyExists,
            libc::EACCES | libc::EPERM | libc::EROFS => ErrorCode::PermissionDenied,
            libc::ENOTDIR => ErrorCode::NotADirectory,
            libc::EISDIR => ErrorCode::IsADirectory,
            libc::ELOOP | libc::EXDEV => ErrorCode::SymlinkRefused,
            libc::ENOSPC | libc::EDQUOT => ErrorCode::NoSpace,
            libc::ENAMETOOLONG | libc::EINVAL => ErrorCode::InvalidPath,
            _ => ErrorCode::Io,
        }
    }
}

/// Checks a path from a request: not empty, at most [`MAX_PATH`] bytes, no
/// NUL, no `..` component. Returns it made absolute against `base` with `.`
/// components and repeated slashes removed. Resolution of what remains is
/// still done with `RESOLVE_IN_ROOT`; this check is so that a confused or
/// hostile caller gets a clear error instead of a surprising file.
pub fn normalize_path(path: &str, base: &str) -> Result<String, ErrorCode> {
    if path.is_empty() || path.len() > MAX_PATH || path.contains('\0') {
        return Err(ErrorCode::InvalidPath);
    }
    let mut parts: Vec<&str> = Vec::new();
    let joined;
    let full = if path.starts_with('/') {
        path
    } else {
        joined = format!("{base}/{path}");
        &joined
    };
    for part in full.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(ErrorCode::InvalidPath),
            p => parts.push(p),
        }
    }
    let mut out = String::with_capacity(full.len());
    for p in &parts {
        out.push('/');
        out.push_str(p);
    }
    if out.is_empty() {
        out.push('/');
    }
    if out.len() > MAX_PATH {
        return Err(ErrorCode::InvalidPath);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_file_keeps_or_replaces_the_environment() {
        let mut buf = Vec::new();
        let env = vec![("HUTCH_SANDBOX_ID".to_owned(), "sb-1".to_owned())];
        encode(&Resume { env: Some(env.clone()), hostname: None }, &[7; 64], &mut buf).expect("encode");
        let frame = split_frame(&buf).expect("frame").expect("whole");
        assert_eq!(frame.consumed, buf.len());
        let r: Resume = parse_header(frame.header).expect("header");
        assert_eq!((r.env, r.hostname, frame.data), (Some(env), None, &[7u8; 64][..]));
        // An empty header keeps the agent's environment; unknown fields are refused.
        assert_eq!(parse_header::<Resume>(b"{}").expect("empty"), Resume { env: None, hostname: None });
        assert!(parse_header::<Resume>(br#"{"root": true}"#).is_err());
    }

    #[test]
    fn frame_round_trip_keeps_header_and_data() {
        let mut buf = Vec::new();
        let msg = FromAgent::Output { pid: 7, stream: Stream::Stderr };
        encode(&msg, b"hello", &mut buf).expect("encode");
        encode(&FromAgent::Exit { pid: 7, status: ExitStatus::exited(0) }, b"", &mut buf).expect("encode");
        let first = split_frame(&buf).expect("valid").expect("complete");
        assert_eq!(parse_header::<FromAgent>(first.header).expect("parse"), msg);
        assert_eq!(first.data, b"hello");
        let second = split_frame(&buf[first.consumed..]).expect("valid").expect("complete");
        assert!(matches!(parse_header::<FromAgent>(second.header).expect("parse"), FromAgent::Exit { pid: 7, .. }));
        assert_eq!(first.consumed + second.consumed, buf.len());
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let mut buf = Vec::new();
        encode(&ToAgent { id: 1, req: Request::Ping }, b"xyz", &mut buf).expect("encode");
        for cut in 0..buf.len() {
            assert_eq!(split_frame(&buf[..cut]).expect("valid prefix"), None, "cut at {cut}");
        }
    }

    #[test]
    fn oversized_length_is_refused_before_allocation() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&(u32::MAX).to_le_bytes());
        assert_eq!(split_frame(&buf), Err(FrameError::BadLength(u32::MAX)));
        let mut buf = Vec::new();
        buf.extend_from_slice(&(MAX_FRAME as u32 + 1).to_le_bytes());
        assert!(split_frame(&buf).is_err());
    }

    #[test]
    fn header_longer_than_frame_is_refused() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&8u32.to_le_bytes());
        buf.extend_from_slice(&100u32.to_le_bytes());
        buf.extend_from_slice(&[0; 4]);
        assert_eq!(split_frame(&buf), Err(FrameError::BadHeaderLength(100)));
    }

    #[test]
    fn unknown_fields_and_ops_are_refused() {
        assert!(parse_header::<ToAgent>(br#"{"id":1,"req":{"op":"format_disk"}}"#).is_err());
        assert!(parse_header::<ToAgent>(br#"{"id":1,"req":{"op":"ping"},"extra":1}"#).is_err());
        assert!(parse_header::<FromAgent>(br#"{"kind":"reply","id":1,"reply":{"type":"ok"}}"#).is_ok());
    }

    /// Found while writing fuzz/fuzz_targets/agent_frames.rs ("the
    /// splitter keeps its bounds"): a frame with a short header could carry
    /// up to MAX_HEADER bytes more data than MAX_DATA, which the sender's
    /// `encode` refuses.
    #[test]
    fn a_split_frame_carries_no_more_data_than_encode_allows() {
        let mut buf = Vec::new();
        encode(&FromAgent::Output { pid: 1, stream: Stream::Stdout }, &vec![7u8; MAX_DATA], &mut buf).expect("encode");
        let header_len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
        assert_eq!(split_frame(&buf).expect("at the limit").expect("complete").data.len(), MAX_DATA);
        buf.push(7);
        let len = (buf.len() - 4) as u32;
        buf[0..4].copy_from_slice(&len.to_le_bytes());
        // (Lengths only: a failure must not print 4 MiB.)
        let data_len = |b: &[u8]| split_frame(b).map(|f| f.map(|f| f.data.len()));
        assert_eq!(data_len(&buf), Err(FrameError::DataTooLarge(MAX_DATA + 1)));
        assert_eq!(data_len(&buf[..8 + header_len]), Err(FrameError::DataTooLarge(MAX_DATA + 1)), "checked early");
    }

    #[test]
    fn data_over_the_limit_is_refused() {
        let big = vec![0u8; MAX_DATA + 1];
        assert_eq!(encode(&Request::Ping, &big, &mut Vec::new()), Err(FrameError::DataTooLarge(MAX_DATA + 1)));
    }

    #[test]
    fn entries_with_mtimes_decode_inside_replies() {
        let entry = Entry {
            path: "/a".into(),
            name: "a".into(),
            kind: EntryKind::File,
            size: 1,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_ns: 1_700_000_000_123_456_789,
            target: None,
            resolved: Some(Box::new(Resolved { path: "/b".into(), kind: EntryKind::Dir, mode: 0o755 })),
        };
        let msg = FromAgent::Reply { id: 3, reply: Reply::Stat { entry } };
        let mut buf = Vec::new();
        encode(&msg, b"", &mut buf).expect("encode");
        let frame = split_frame(&buf).expect("valid").expect("complete");
        assert_eq!(parse_header::<FromAgent>(frame.header).expect("decodes"), msg);
    }

    #[test]
    fn cmp_paths_puts_a_directory_right_before_its_contents() {
        let mut v = vec!["a.txt", "a/b", "a", "a/b/c", "a-b", "b", "a/a"];
        v.sort_by(|x, y| cmp_paths(x, y));
        assert_eq!(v, ["a", "a/a", "a/b", "a/b/c", "a-b", "a.txt", "b"]);
    }

    #[test]
    fn old_request_shapes_still_parse_and_new_ones_round_trip() {
        let old = br#"{"id":1,"req":{"op":"list_dir","path":"/w","depth":2}}"#;
        assert!(parse_header::<ToAgent>(old).is_ok());
        let req = Request::NoFollow {
            req: Box::new(Request::ListPage {
                path: "/w".into(),
                recursive: true,
                after: Some("a/b".into()),
                limit: 10,
                user: None,
            }),
        };
        let mut buf = Vec::new();
        encode(&ToAgent { id: 2, req: req.clone() }, b"", &mut buf).expect("encode");
        let frame = split_frame(&buf).expect("valid").expect("complete");
        assert_eq!(parse_header::<ToAgent>(frame.header).expect("parse").req, req);
        let short = br#"{"id":1,"req":{"op":"list_page","path":"/w","recursive":false,"limit":5}}"#;
        assert!(parse_header::<ToAgent>(short).is_ok());
    }

    #[test]
    fn normalize_path_refuses_dotdot_nul_and_empty() {
        assert_eq!(normalize_path("a/../b", "/workspace"), Err(ErrorCode::InvalidPath));
        assert_eq!(normalize_path("/etc/..", "/"), Err(ErrorCode::InvalidPath));
        assert_eq!(normalize_path("a\0b", "/"), Err(ErrorCode::InvalidPath));
        assert_eq!(normalize_path("", "/"), Err(ErrorCode::InvalidPath));
        assert_eq!(normalize_path(&"a/".repeat(3000), "/"), Err(ErrorCode::InvalidPath));
    }

    #[test]
    fn normalize_path_joins_relative_paths_and_drops_dots() {
        assert_eq!(normalize_path("a/./b//c", "/workspace").as_deref(), Ok("/workspace/a/b/c"));
        assert_eq!(normalize_path("/", "/workspace").as_deref(), Ok("/"));
        assert_eq!(normalize_path("/etc/hosts", "/workspace").as_deref(), Ok("/etc/hosts"));
        assert_eq!(normalize_path("...", "/w").as_deref(), Ok("/w/..."));
    }

    /// Random and mutated frames: the parser refuses or accepts, never
    /// panics, never reads past the buffer, never consumes more than it has.
    #[test]
    fn random_and_mutated_frames_never_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut valid = Vec::new();
        encode(&FromAgent::Output { pid: 3, stream: Stream::Stdout }, b"abc", &mut valid).expect("encode");
        encode(&ToAgent { id: 9, req: Request::Stat { path: "/x".into(), user: None } }, b"", &mut valid)
            .expect("encode");
        for round in 0..20_000 {
            let mut buf = if round % 2 == 0 {
                let len = (next() % 64) as usize;
                (0..len).map(|_| next() as u8).collect::<Vec<u8>>()
            } else {
                let mut b = valid.clone();
                for _ in 0..(next() % 4 + 1) {
                    let i = (next() as usize) % b.len();
                    b[i] = next() as u8;
                }
                b
            };
            if round % 7 == 0 {
                buf.truncate((next() as usize) % (buf.len() + 1));
            }
            if let Ok(Some(frame)) = split_frame(&buf) {
                assert!(frame.consumed <= buf.len());
                let _ = parse_header::<FromAgent>(frame.header);
                let _ = parse_header::<ToAgent>(frame.header);
            }
        }
    }
}
