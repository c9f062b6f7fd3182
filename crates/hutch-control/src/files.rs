//! File transfers between the control plane and one sandbox, through its
//! agent: whole-file reads and writes, raw streams, listings with digests,
//! tar archives in and out, and files sent in parts.
//!
//! Everything the agent answers is untrusted (a workload that gains the
//! agent's privileges can replace it): every size is bounded here, listings
//! must come in strictly increasing order, and names are checked before they
//! are used. Every write goes through [`Request::NoFollow`], so a symlink the
//! workload planted never redirects it, not even inside the sandbox; reads
//! may follow symlinks, which the agent keeps inside the sandbox's root.
//!
//! Paths are absolute in the sandbox or relative to `/workspace`; `..`, NUL
//! and empty paths are refused ([`normalize_path`]).
//!
//! Digests are computed here, on the host, from chunks the agent reads: the
//! agent is one single-threaded event loop, and hashing 256 MiB in it would
//! stall every command's output for seconds; it also keeps the agent's
//! dependencies at three.
//!
//! Transfers stream: bodies in and out are [`Chunks`] (a channel of a few
//! chunks), so a transfer holds a few MiB here whatever it carries; tar
//! parsing and gzip inflation run on threads of their own ([`pipe`]);
//! archive uploads stage as they are validated and commit under an undo
//! journal on the host ([`journal`]), so a refused archive, a client that
//! goes away or a daemon killed part way leaves the target as it was.

/// Public (hidden) only for the fuzz targets under fuzz/.
#[doc(hidden)]
pub mod archive;
pub mod journal;
pub mod passed;
pub mod pipe;

pub use archive::{
    ArchiveError, ARCHIVE_CAP, ARCHIVE_ENTRIES, ARCHIVE_NAME_BYTES, ARCHIVE_UNPACKED_CAP, UPLOAD_PACKED_CAP,
    UPLOAD_UNPACKED_CAP,
};
pub use journal::JournalDir;
pub use pipe::Chunks;

use std::path::PathBuf;

use base64::Engine as _;
use hutch_agent::proto::{
    self, cmp_paths, normalize_path, Entry, EntryKind, PageEntry, Reply, Request, WriteFile, MAX_DATA,
    MAX_PAGE_ENTRIES, MAX_PATH,
};
use hutch_api::{ArchiveResult, ErrorCode, FilePart, FilePartResult, ListEntry, Listing, FILE_DATA_CAP};
use hutch_runtime::agent::AgentError;
use hutch_runtime::agent_async::AsyncConn;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use archive::{ArchivePlan, PlannedKind};
use journal::{Journal, Move, Phase};

/// Where relative paths resolve.
pub const WORKSPACE: &str = "/workspace";
/// Largest file a raw upload or a file sent in parts may make.
pub const FILE_CAP: u64 = 1 << 30;
/// Largest tar archive a download makes. Downloads stream, so this bounds
/// the work of one request (a sparse file reads as its full size), not
/// memory.
pub const DOWNLOAD_CAP: u64 = 16 << 30;
/// Entries of the listing a download asks the agent for at a time.
const DOWNLOAD_PAGE: u32 = 1000;
/// A download sends tar headers in chunks of about this size.
const TAR_FLUSH: usize = 64 << 10;
/// Bytes of file content per write while an archive is staged.
const ARCHIVE_CHUNK: usize = 1 << 20;
/// Largest file a listing hashes; larger ones are `sha256_skipped: budget`.
pub const HASH_FILE_CAP: u64 = 256 << 20;
/// Most bytes one listing page hashes before it ends early.
pub const HASH_PAGE_BUDGET: u64 = 256 << 20;
/// Most entries in one listing page, and the default.
pub const LIST_LIMIT: u32 = 10_000;
/// Chunk size of a raw download.
pub const STREAM_CHUNK: u32 = 1 << 20;
/// Permission bits of files written by [`SandboxFs::write`],
/// [`SandboxFs::write_stream`] and [`SandboxFs::put_part`]: the file belongs
/// to the sandbox user, and only that user can read or write it (a file
/// replaced by a write gets these bits, not the old ones).
pub const FILE_MODE: u32 = 0o600;
/// Permission bits of a file E2B's envd writes anew.
pub const ENVD_FILE_MODE: u32 = 0o644;
/// The name prefix of the temporary a file is written to before it is
/// renamed into place.
pub const UPLOAD_TEMP: &str = ".hutch-upload-";

/// The temporary of a streamed write, and what its name says about the
/// file it becomes: `.hutch-upload-` then `n` (a new file) or `r` (one
/// replaced) for envd-style writes, then random hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadTemp {
    /// Not said (the native API's writes).
    Plain,
    New,
    Replacing,
}

impl UploadTemp {
    fn name(self) -> String {
        let tag = match self {
            UploadTemp::Plain => "",
            UploadTemp::New => "n",
            UploadTemp::Replacing => "r",
        };
        format!("{UPLOAD_TEMP}{tag}{}", random_suffix())
    }

    /// What a file name says, if it is a temporary.
    pub fn of(name: &str) -> Option<UploadTemp> {
        let rest = name.strip_prefix(UPLOAD_TEMP)?;
        Some(match rest.as_bytes().first() {
            Some(b'n') => UploadTemp::New,
            Some(b'r') => UploadTemp::Replacing,
            _ => UploadTemp::Plain,
        })
    }
}

/// Longest cursor accepted.
const MAX_CURSOR: usize = 3 * MAX_PATH + 256;
/// Chunk of a read or write through the agent: the most one frame carries.
const CHUNK: usize = MAX_DATA;

/// A failed file transfer: the API code and a message naming what failed.
/// Messages hold sandbox paths only, never host paths; the message of an
/// [`ErrorCode::Internal`] error is for the log, not for clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FilesError {
    pub code: ErrorCode,
    pub message: String,
}

/// What an operation does with a path; decides how an agent's refusal
/// reads (a permission refusal is a conflict for a write, unreadable for a
/// read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    List,
    /// A process operation: start, signal, stdin, attach.
    Process,
}

impl FilesError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> FilesError {
        FilesError { code, message: message.into() }
    }

    /// Maps a failed agent call onto an API code: the one place that does.
    pub fn from_agent(e: AgentError, access: Access) -> FilesError {
        use proto::ErrorCode as A;
        let (code, message) = match e {
            AgentError::Refused { code, message } => {
                let code = match code {
                    A::NoSpace => ErrorCode::SandboxDiskFull,
                    A::InvalidPath => ErrorCode::InvalidPath,
                    A::NotFound => match access {
                        // A command's only path is its cwd.
                        Access::Process => ErrorCode::SandboxPathNotDirectory,
                        Access::Read | Access::Write | Access::List => ErrorCode::NotFound,
                    },
                    A::PermissionDenied => match access {
                        Access::Write => ErrorCode::SandboxPathConflict,
                        Access::Read | Access::List | Access::Process => ErrorCode::SandboxPathUnreadable,
                    },
                    A::NotADirectory | A::SymlinkRefused => match access {
                        Access::List | Access::Process => ErrorCode::SandboxPathNotDirectory,
                        Access::Read | Access::Write => ErrorCode::SandboxPathConflict,
                    },
                    A::IsADirectory => match access {
                        Access::Read => ErrorCode::InvalidRequest,
                        Access::Process => ErrorCode::SandboxPathNotDirectory,
                        Access::Write | Access::List => ErrorCode::SandboxPathConflict,
                    },
                    A::AlreadyExists => ErrorCode::SandboxPathConflict,
                    A::UnknownUser => ErrorCode::InvalidRequest,
                    A::InvalidRequest => match access {
                        // "not a regular file": a FIFO or a device.
                        Access::Read | Access::Process => ErrorCode::InvalidRequest,
                        Access::Write | Access::List => ErrorCode::Internal,
                    },
                    A::UnknownProcess => match access {
                        Access::Process => ErrorCode::NotFound,
                        Access::Read | Access::Write | Access::List => ErrorCode::Internal,
                    },
                    A::TagInUse => match access {
                        Access::Process => ErrorCode::InvalidRequest,
                        Access::Read | Access::Write | Access::List => ErrorCode::Internal,
                    },
                    A::Capacity => ErrorCode::SandboxCommandCapacity,
                    A::Io => ErrorCode::Internal,
                    // A process sandbox asked for root.
                    A::Unsupported => ErrorCode::ClassUnsupported,
                };
                (code, message)
            }
            e @ (AgentError::Io(_)
            | AgentError::Protocol(_)
            | AgentError::RequestTooLarge(_)
            | AgentError::Closed
            | AgentError::Timeout(_)
            | AgentError::Unexpected(_)) => (ErrorCode::Internal, format!("sandbox agent: {e}")),
        };
        FilesError { code, message }
    }

    fn unexpected(reply: &Reply) -> FilesError {
        FilesError::new(ErrorCode::Internal, format!("sandbox agent answered {reply:?} unexpectedly"))
    }
}

/// How [`SandboxFs::list`] pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListOptions {
    /// Everything below the path, or only its direct entries.
    pub recursive: bool,
    pub include_sha256: bool,
    /// Most entries in the page, 1 to [`LIST_LIMIT`].
    pub limit: u32,
    /// The previous page's `next_cursor`, for the same path and `recursive`.
    pub cursor: Option<String>,
}

impl Default for ListOptions {
    fn default() -> Self {
        ListOptions { recursive: true, include_sha256: false, limit: LIST_LIMIT, cursor: None }
    }
}

/// One part of a file sent in parts, borrowed from the request (see
/// [`SandboxFs::put_part_base64`]).
#[derive(Debug, Clone, Copy)]
pub struct PartRef<'a> {
    pub path: &'a str,
    pub offset: u64,
    pub size: u64,
    pub sha256: &'a str,
    /// Base64.
    pub data: &'a str,
}

/// The files of one sandbox, as one of its users.
#[derive(Debug, Clone)]
pub struct SandboxFs {
    socket: PathBuf,
    user: String,
    /// Streamed writes as envd makes them (see [`SandboxFs::envd`]).
    envd: bool,
    /// Where archive uploads record their undo journal; without one (tests,
    /// the CLI) a daemon crash mid-upload is not repaired.
    journal: Option<JournalDir>,
    /// Streamed writes go through a descriptor the agent passes (see
    /// [`passed`]); off for memory layers, whose pages are charged to the
    /// writer's memory cgroup (the sandbox's when the agent writes).
    passed_writes: bool,
    /// Raw reads go through a passed descriptor (on unless
    /// [`passing_allowed`] says no).
    passed_reads: bool,
}

/// Whether transfers may use passed descriptors at all: `HUTCH_FILES_PASS=0`
/// in the daemon's environment turns them off (every transfer goes through
/// the agent's frames, as before they existed): an escape hatch, and how
/// `bench/files_bench.py` measures the old path beside the new.
pub fn passing_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("HUTCH_FILES_PASS").map_or(true, |v| v != "0"))
}

/// Normalizes a request path against the workspace.
pub fn normalize(path: &str) -> Result<String, FilesError> {
    normalize_path(path, WORKSPACE).map_err(|_| {
        FilesError::new(
            ErrorCode::InvalidPath,
            format!("invalid path {:?}: empty, too long, or holds NUL or '..'", truncate(path)),
        )
    })
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(256);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The directory holding a normalized path, and its name.
fn split_parent(path: &str) -> Result<(&str, &str), FilesError> {
    match path.rsplit_once('/') {
        Some((_, "")) | None => Err(FilesError::new(ErrorCode::InvalidPath, format!("{path}: not a file path"))),
        Some(("", name)) => Ok(("/", name)),
        Some((dir, name)) => Ok((dir, name)),
    }
}

/// `dir/rel` for a normalized `dir`.
fn join(dir: &str, rel: &str) -> String {
    if dir == "/" {
        format!("/{rel}")
    } else {
        format!("{dir}/{rel}")
    }
}

/// 16 random hex digits for a hidden temporary name.
fn random_suffix() -> String {
    use std::io::Read;
    let mut b = [0u8; 8];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok();
    if !ok {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        b = h.finish().to_le_bytes();
    }
    hex::encode(b)
}

/// Checks a lowercase hex SHA-256.
fn check_sha256(s: &str) -> Result<(), FilesError> {
    if s.len() == 64 && s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        Ok(())
    } else {
        Err(FilesError::new(ErrorCode::InvalidRequest, "sha256 must be 64 lowercase hex digits"))
    }
}

/// Checks a relative path from a cursor or the agent: `/`-separated, no
/// empty, `.` or `..` element, at most [`MAX_PATH`] bytes.
fn valid_rel(p: &str) -> bool {
    !p.is_empty() && p.len() <= MAX_PATH && p.split('/').all(|e| !e.is_empty() && e != "." && e != "..")
}

/// A cursor: base64 (URL-safe) of `[1, path, recursive, last path returned]`.
pub fn encode_cursor(path: &str, recursive: bool, last: &str) -> String {
    let json = serde_json::json!([1, path, recursive, last]);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json.to_string())
}

/// The last path a cursor returned, when it was made for `path` and `recursive`.
pub fn decode_cursor(cursor: &str, path: &str, recursive: bool) -> Result<String, FilesError> {
    let bad = |why: &str| FilesError::new(ErrorCode::InvalidRequest, format!("invalid cursor: {why}"));
    if cursor.len() > MAX_CURSOR {
        return Err(bad("too long"));
    }
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(cursor).map_err(|_| bad("not base64"))?;
    let (version, c_path, c_recursive, last): (u32, String, bool, String) =
        serde_json::from_slice(&raw).map_err(|_| bad("malformed"))?;
    if version != 1 {
        return Err(bad("unknown version"));
    }
    if c_path != path || c_recursive != recursive {
        return Err(bad("it belongs to another path or recursive setting"));
    }
    if !valid_rel(&last) {
        return Err(bad("malformed"));
    }
    Ok(last)
}

fn kind_name(kind: EntryKind) -> &'static str {
    match kind {
        EntryKind::File => "file",
        EntryKind::Dir => "directory",
        EntryKind::Symlink => "symlink",
        EntryKind::Other => "other",
    }
}

/// Why a listed file has no digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HashSkip {
    Unreadable,
    Changing,
}

/// One connection to the agent, as one user.
struct Link {
    conn: AsyncConn,
    user: String,
}

impl Link {
    fn user(&self) -> Option<String> {
        Some(self.user.clone())
    }

    async fn call(&mut self, req: Request, data: &[u8], access: Access) -> Result<(Reply, Vec<u8>), FilesError> {
        self.conn.call(req, data).await.map_err(|e| FilesError::from_agent(e, access))
    }

    /// Calls `req` with no symlink followed on its paths.
    async fn strict(&mut self, req: Request, data: &[u8], access: Access) -> Result<(Reply, Vec<u8>), FilesError> {
        self.call(Request::NoFollow { req: Box::new(req) }, data, access).await
    }

    /// Describes a path without following symlinks; `None` when missing.
    async fn stat(&mut self, path: &str) -> Result<Option<Entry>, FilesError> {
        let req = Request::Stat { path: path.into(), user: self.user() };
        match self.strict(req, &[], Access::Write).await {
            Ok((Reply::Stat { entry }, _)) => Ok(Some(entry)),
            Ok((other, _)) => Err(FilesError::unexpected(&other)),
            Err(e) if e.code == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads up to [`CHUNK`] bytes at `offset`: (data, eof, file size).
    async fn read_chunk(
        &mut self,
        path: &str,
        offset: u64,
        len: u32,
        strict: bool,
    ) -> Result<(Vec<u8>, bool, u64), FilesError> {
        let req = Request::ReadFile { path: path.into(), offset, len: len.min(CHUNK as u32), user: self.user() };
        let r =
            if strict { self.strict(req, &[], Access::Read).await } else { self.call(req, &[], Access::Read).await };
        match r? {
            (Reply::Data { eof, size }, data) => {
                if data.len() > len as usize {
                    return Err(FilesError::new(ErrorCode::Internal, "sandbox agent sent more than asked for"));
                }
                Ok((data, eof, size))
            }
            (other, _) => Err(FilesError::unexpected(&other)),
        }
    }

    /// Writes `data` at `offset` (split into frames); the first frame
    /// creates the file with `mode` and, with `truncate`, cuts it at `offset`.
    async fn write_at(
        &mut self,
        path: &str,
        offset: u64,
        data: &[u8],
        truncate: bool,
        mode: u32,
    ) -> Result<(), FilesError> {
        let mut done = 0usize;
        loop {
            let end = (done + CHUNK).min(data.len());
            let w = WriteFile {
                path: path.into(),
                offset: offset + done as u64,
                truncate: truncate && done == 0,
                append: false,
                parents: false,
                mode: Some(mode),
                user: self.user(),
            };
            match self.strict(Request::WriteFile(w), &data[done..end], Access::Write).await? {
                (Reply::Written { .. }, _) => {}
                (other, _) => return Err(FilesError::unexpected(&other)),
            }
            done = end;
            if done >= data.len() {
                return Ok(());
            }
        }
    }

    /// The descriptor of a regular file, opened by the agent
    /// ([`Request::OpenFile`], with no symlink followed when `strict`) and
    /// checked by [`passed::check`]; `None` when the agent passes none (a
    /// file system it does not pass, or an agent that does not know the
    /// request's fields): the caller then moves bytes through frames.
    async fn open_passed(
        &mut self,
        path: &str,
        write: bool,
        strict: bool,
    ) -> Result<Option<(std::fs::File, u64)>, FilesError> {
        let access = if write { Access::Write } else { Access::Read };
        let mut req = Request::OpenFile { path: path.into(), write, user: self.user() };
        if strict {
            req = Request::NoFollow { req: Box::new(req) };
        }
        match self.conn.call_taking_fds(req, &[]).await {
            Ok((Reply::Opened { size, passed: true }, _, fds)) => Ok(Some((passed::check(fds, write)?, size))),
            Ok((Reply::Opened { passed: false, .. }, _, _)) => Ok(None),
            Ok((other, _, _)) => Err(FilesError::unexpected(&other)),
            Err(AgentError::Refused { code: proto::ErrorCode::InvalidRequest, .. }) => Ok(None),
            Err(e) => Err(FilesError::from_agent(e, access)),
        }
    }

    async fn expect_ok(&mut self, req: Request, access: Access) -> Result<(), FilesError> {
        match self.strict(req, &[], access).await? {
            (Reply::Ok, _) | (Reply::Created { .. }, _) => Ok(()),
            (other, _) => Err(FilesError::unexpected(&other)),
        }
    }

    async fn rename(&mut self, from: &str, to: &str) -> Result<(), FilesError> {
        let req = Request::Rename { from: from.into(), to: to.into(), user: self.user(), commit: false };
        self.expect_ok(req, Access::Write).await
    }

    /// Puts the upload temporary `tmp` in place of `path` (a rename; see
    /// [`Request::Rename`]'s `commit`).
    async fn commit(&mut self, tmp: &str, path: &str) -> Result<(), FilesError> {
        let req = Request::Rename { from: tmp.into(), to: path.into(), user: self.user(), commit: true };
        self.expect_ok(req, Access::Write).await
    }

    async fn remove(&mut self, path: &str) -> Result<(), FilesError> {
        self.expect_ok(Request::Remove { path: path.into(), user: self.user() }, Access::Write).await
    }

    /// Removes the directory `path` if it holds nothing.
    async fn remove_if_empty(&mut self, path: &str) -> Result<(), FilesError> {
        let (page, _) = self.list_page(path, false, None, 1).await?;
        if page.is_empty() {
            self.remove(path).await?;
        }
        Ok(())
    }

    /// Removes a temporary, ignoring failure (it is hidden and named randomly).
    async fn discard(&mut self, path: &str) {
        let _ = self.remove(path).await;
    }

    async fn mkdir(&mut self, path: &str, parents: bool) -> Result<(), FilesError> {
        self.expect_ok(Request::Mkdir { path: path.into(), parents, user: self.user() }, Access::Write).await
    }

    async fn chmod(&mut self, path: &str, mode: u32) -> Result<(), FilesError> {
        self.expect_ok(Request::Chmod { path: path.into(), mode, user: self.user() }, Access::Write).await
    }

    /// One page from the agent, checked: at most `limit` entries, valid
    /// relative paths, strictly increasing after `after`.
    async fn list_page(
        &mut self,
        path: &str,
        recursive: bool,
        after: Option<&str>,
        limit: u32,
    ) -> Result<(Vec<PageEntry>, bool), FilesError> {
        let req = Request::ListPage {
            path: path.into(),
            recursive,
            after: after.map(str::to_string),
            limit,
            user: self.user(),
        };
        let (more, data) = match self.call(req, &[], Access::List).await? {
            (Reply::Page { more, .. }, data) => (more, data),
            (other, _) => return Err(FilesError::unexpected(&other)),
        };
        let entries: Vec<PageEntry> = serde_json::from_slice(&data)
            .map_err(|e| FilesError::new(ErrorCode::Internal, format!("sandbox agent sent a malformed page: {e}")))?;
        if entries.len() > limit as usize {
            return Err(FilesError::new(ErrorCode::Internal, "sandbox agent sent more entries than asked for"));
        }
        let mut prev = after;
        for e in &entries {
            let ordered = prev.is_none_or(|p| cmp_paths(p, &e.path).is_lt());
            if !valid_rel(&e.path) || !ordered || (!recursive && e.path.contains('/')) {
                return Err(FilesError::new(
                    ErrorCode::Internal,
                    "sandbox agent sent a malformed or unordered listing",
                ));
            }
            prev = Some(&e.path);
        }
        if more && entries.is_empty() {
            return Err(FilesError::new(ErrorCode::Internal, "sandbox agent sent an empty page with more to come"));
        }
        Ok((entries, more))
    }

    /// Hashes a regular file of `size` bytes through chunked reads, with no
    /// symlink followed; `Err(skip)` when it cannot or it changed meanwhile.
    async fn hash(
        &mut self,
        path: &str,
        size: u64,
        mtime_ns: Option<i64>,
    ) -> Result<Result<String, HashSkip>, FilesError> {
        let mut hasher = Sha256::new();
        let mut offset = 0u64;
        loop {
            let want = (size - offset).min(CHUNK as u64) as u32;
            let (data, eof, now) = match self.read_chunk(path, offset, want.max(1), true).await {
                Ok(r) => r,
                Err(e) => {
                    return match e.code {
                        ErrorCode::SandboxPathUnreadable => Ok(Err(HashSkip::Unreadable)),
                        ErrorCode::NotFound
                        | ErrorCode::InvalidRequest
                        | ErrorCode::SandboxPathConflict
                        | ErrorCode::InvalidPath => Ok(Err(HashSkip::Changing)),
                        _ => Err(e),
                    }
                }
            };
            if now != size || data.len() as u64 > size - offset {
                return Ok(Err(HashSkip::Changing));
            }
            offset += data.len() as u64;
            hasher = tokio::task::spawn_blocking(move || {
                hasher.update(&data);
                hasher
            })
            .await
            .map_err(|e| FilesError::new(ErrorCode::Internal, format!("hashing task failed: {e}")))?;
            if offset == size {
                break;
            }
            if eof || want == 0 {
                return Ok(Err(HashSkip::Changing));
            }
        }
        if let Some(mtime) = mtime_ns {
            match self.stat(path).await? {
                Some(e) if e.kind == EntryKind::File && e.size == size && e.mtime_ns == i128::from(mtime) => {}
                _ => return Ok(Err(HashSkip::Changing)),
            }
        }
        Ok(Ok(hex::encode(hasher.finalize())))
    }
}

impl SandboxFs {
    /// The files of the sandbox whose agent listens on `socket`, as `user`
    /// (`user`, uid 1000, when `None`; `root` allowed).
    pub fn new(socket: PathBuf, user: Option<String>) -> SandboxFs {
        SandboxFs {
            socket,
            user: user.unwrap_or_else(|| "user".into()),
            envd: false,
            journal: None,
            passed_writes: false,
            passed_reads: passing_allowed(),
        }
    }

    /// The same, writing streamed files as E2B's envd does: a new file
    /// gets mode 0644 (a shell's umask 022), a replaced one keeps its
    /// permission bits; and the temporary says which it was
    /// ([`UploadTemp`]), so that a directory watch can report the write
    /// as envd's watchers see it.
    pub fn envd(self) -> SandboxFs {
        SandboxFs { envd: true, ..self }
    }

    /// The same, with streamed writes through a passed descriptor when
    /// `on` (a disk layer: see [`passed`]); reads always try one.
    pub fn passing_writes(self, on: bool) -> SandboxFs {
        SandboxFs { passed_writes: on && passing_allowed(), ..self }
    }

    /// The same, with archive uploads journaled in `journal`.
    pub fn with_journal(self, journal: JournalDir) -> SandboxFs {
        SandboxFs { journal: Some(journal), ..self }
    }

    async fn link(&self) -> Result<Link, FilesError> {
        let conn = AsyncConn::connect(&self.socket).await.map_err(|e| FilesError::from_agent(e, Access::Read))?;
        Ok(Link { conn, user: self.user.clone() })
    }

    /// A whole regular file, at most [`FILE_DATA_CAP`] bytes. Symlinks are
    /// followed inside the sandbox.
    pub async fn read(&self, path: &str) -> Result<Vec<u8>, FilesError> {
        let path = normalize(path)?;
        let mut link = self.link().await?;
        let mut out = Vec::new();
        loop {
            let (data, eof, size) = link.read_chunk(&path, out.len() as u64, CHUNK as u32, false).await?;
            if size > FILE_DATA_CAP as u64 || out.len() + data.len() > FILE_DATA_CAP {
                return Err(FilesError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("{path} is larger than {FILE_DATA_CAP} bytes; download it raw"),
                ));
            }
            let empty = data.is_empty();
            out.extend_from_slice(&data);
            if eof || empty {
                return Ok(out);
            }
        }
    }

    /// Writes a whole file of at most [`FILE_DATA_CAP`] bytes, with mode
    /// [`FILE_MODE`], owned by the user. The parent directory must exist.
    /// The content goes to a hidden temporary beside the file, which is then
    /// renamed over it, so readers see the old file or the new one.
    pub async fn write(&self, path: &str, data: &[u8]) -> Result<(), FilesError> {
        if data.len() > FILE_DATA_CAP {
            return Err(FilesError::new(
                ErrorCode::PayloadTooLarge,
                format!("{} bytes exceed the {FILE_DATA_CAP} bytes of one write; send the file in parts", data.len()),
            ));
        }
        let path = normalize(path)?;
        let (parent, _) = split_parent(&path)?;
        let tmp = join(parent, &UploadTemp::Plain.name());
        let mut link = self.link().await?;
        if let Err(e) = link.write_at(&tmp, 0, data, true, FILE_MODE).await {
            link.discard(&tmp).await;
            return Err(missing_parent(e, parent));
        }
        if let Err(e) = link.commit(&tmp, &path).await {
            link.discard(&tmp).await;
            return Err(e);
        }
        Ok(())
    }

    /// [`SandboxFs::write`] of base64 `data`: checked whole first (nothing
    /// is written for bad base64), then decoded and written a piece at a
    /// time, never held decoded.
    pub async fn write_base64(&self, path: &str, data: &str) -> Result<(), FilesError> {
        let len = base64_len(data).map_err(|_| FilesError::new(ErrorCode::InvalidRequest, "data is not base64"))?;
        if len > FILE_DATA_CAP {
            return Err(FilesError::new(
                ErrorCode::PayloadTooLarge,
                format!("{len} bytes exceed the {FILE_DATA_CAP} bytes of one write; send the file in parts"),
            ));
        }
        let path = normalize(path)?;
        let (parent, _) = split_parent(&path)?;
        let tmp = join(parent, &UploadTemp::Plain.name());
        let mut link = self.link().await?;
        if let Err(e) = write_base64_at(&mut link, &tmp, 0, data, true).await {
            link.discard(&tmp).await;
            return Err(missing_parent(e, parent));
        }
        if let Err(e) = link.commit(&tmp, &path).await {
            link.discard(&tmp).await;
            return Err(e);
        }
        Ok(())
    }

    /// A regular file of at most [`FILE_DATA_CAP`] bytes, as chunks: the
    /// size is checked before the first chunk (`payload_too_large`), and
    /// the bytes it held when the read started are streamed, so a caller
    /// that renders them (base64 in JSON) holds a chunk, not the file.
    /// Files that report no size (`/proc`) are read whole first, bounded.
    pub async fn read_capped(&self, path: &str) -> Result<Chunks, FilesError> {
        let norm = normalize(path)?;
        let mut link = self.link().await?;
        let (first, eof, size) = link.read_chunk(&norm, 0, STREAM_CHUNK, false).await?;
        if size > FILE_DATA_CAP as u64 {
            return Err(FilesError::new(
                ErrorCode::PayloadTooLarge,
                format!("{norm} is larger than {FILE_DATA_CAP} bytes; download it raw"),
            ));
        }
        if size == 0 && !(eof || first.is_empty()) {
            drop(link);
            let data = self.read(path).await?;
            return Ok(pipe::from_bytes(data, STREAM_CHUNK as usize));
        }
        Ok(stream_rest(link, norm, first, eof, size).await)
    }

    /// Streams a regular file in chunks of [`STREAM_CHUNK`] bytes: the
    /// bytes it held when the download started (a growing file is cut
    /// there). Errors about the path come back before any chunk; later
    /// failures arrive in the channel.
    pub async fn read_stream(&self, path: &str) -> Result<Chunks, FilesError> {
        let path = normalize(path)?;
        let mut link = self.link().await?;
        let passed = if self.passed_reads { link.open_passed(&path, false, false).await? } else { None };
        if let Some((file, size)) = passed {
            let end = if size > 0 { size } else { FILE_DATA_CAP as u64 };
            return passed::read(file, path, end);
        }
        let (first, eof, size) = link.read_chunk(&path, 0, STREAM_CHUNK, false).await?;
        // Files of /proc report size 0: read those to their end, bounded.
        let end = if size > 0 { size } else { FILE_DATA_CAP as u64 };
        Ok(stream_rest(link, path, first, eof, end).await)
    }

    /// Writes a file of any size up to [`FILE_CAP`] from a stream of chunks,
    /// with mode [`FILE_MODE`]; the parent directory must exist. The chunks
    /// go to a hidden `.hutch-upload-*` beside the file, renamed over it
    /// once the stream ends, and removed on any failure: a stream that
    /// breaks (its sender sends an error) or a file over the cap leaves
    /// nothing. Runs in a task of its own, so a caller that goes away ends
    /// the stream instead of leaving the temporary behind. Returns the
    /// bytes written.
    pub async fn write_stream(&self, path: &str, rx: Chunks) -> Result<u64, FilesError> {
        let (this, path) = (self.clone(), path.to_owned());
        detach(async move { this.write_stream_detached(&path, rx).await }).await
    }

    async fn write_stream_detached(&self, path: &str, mut rx: Chunks) -> Result<u64, FilesError> {
        let path = normalize(path)?;
        let (parent, _) = split_parent(&path)?;
        let mut link = self.link().await?;
        let (temp, mode) = match self.envd {
            false => (UploadTemp::Plain, FILE_MODE),
            true => match link.stat(&path).await? {
                Some(e) if e.kind == EntryKind::File => (UploadTemp::Replacing, e.mode & 0o777),
                _ => (UploadTemp::New, ENVD_FILE_MODE),
            },
        };
        let tmp = join(parent, &temp.name());
        if let Err(e) = link.write_at(&tmp, 0, &[], true, mode).await {
            link.discard(&tmp).await;
            return Err(missing_parent(e, parent));
        }
        if self.passed_writes {
            match link.open_passed(&tmp, true, true).await {
                Ok(Some((file, _))) => {
                    let written = passed::write(file, tmp.clone(), rx).await;
                    return match written {
                        Ok(total) => match link.commit(&tmp, &path).await {
                            Ok(()) => Ok(total),
                            Err(e) => {
                                link.discard(&tmp).await;
                                Err(e)
                            }
                        },
                        Err(e) => {
                            link.discard(&tmp).await;
                            Err(e)
                        }
                    };
                }
                Ok(None) => {}
                Err(e) => {
                    drop(rx);
                    link.discard(&tmp).await;
                    return Err(e);
                }
            }
        }
        let mut total = 0u64;
        while let Some(chunk) = rx.recv().await {
            let written = match chunk {
                Ok(chunk) if total + chunk.len() as u64 > FILE_CAP => {
                    Err(FilesError::new(ErrorCode::PayloadTooLarge, format!("the file exceeds {FILE_CAP} bytes")))
                }
                Ok(chunk) => link.write_at(&tmp, total, &chunk, false, mode).await.map(|()| chunk.len()),
                Err(e) => Err(e),
            };
            match written {
                Ok(n) => total += n as u64,
                Err(e) => {
                    drop(rx);
                    link.discard(&tmp).await;
                    return Err(e);
                }
            }
        }
        if let Err(e) = link.commit(&tmp, &path).await {
            link.discard(&tmp).await;
            return Err(e);
        }
        Ok(total)
    }

    /// One page of a listing of the directory `path`: entries relative to
    /// it, sorted by [`cmp_paths`], symlinks never followed, directories the
    /// user cannot list marked `unreadable` and not entered. With
    /// `include_sha256`, regular files get a digest, or `sha256_skipped`
    /// (`budget` over [`HASH_FILE_CAP`], `unreadable`, `changing`); a page
    /// ends early after [`HASH_PAGE_BUDGET`] bytes of hashing.
    pub async fn list(&self, path: &str, opts: ListOptions) -> Result<Listing, FilesError> {
        if opts.limit == 0 || opts.limit > LIST_LIMIT {
            return Err(FilesError::new(ErrorCode::InvalidRequest, format!("limit must be 1 to {LIST_LIMIT}")));
        }
        let path = normalize(path)?;
        let mut after = match &opts.cursor {
            Some(c) => Some(decode_cursor(c, &path, opts.recursive)?),
            None => None,
        };
        let mut link = self.link().await?;
        let mut entries: Vec<ListEntry> = Vec::new();
        let mut hashed = 0u64;
        let limit = opts.limit.min(MAX_PAGE_ENTRIES) as usize;
        let mut more = true;
        'pages: while more && entries.len() < limit {
            let want = (limit - entries.len()) as u32;
            let (page, agent_more) =
                link.list_page(&path, opts.recursive, after.as_deref(), want).await.map_err(|e| {
                    // A missing path is not a directory to list.
                    if e.code == ErrorCode::NotFound {
                        FilesError::new(ErrorCode::SandboxPathNotDirectory, format!("{path}: no such directory"))
                    } else {
                        e
                    }
                })?;
            more = agent_more;
            for e in page {
                let mut out = ListEntry {
                    path: e.path.clone(),
                    kind: kind_name(e.kind).into(),
                    size: if e.kind == EntryKind::File { e.size } else { 0 },
                    mode: e.mode & 0o7777,
                    sha256: None,
                    sha256_skipped: None,
                    unreadable: e.kind == EntryKind::Dir && e.unreadable,
                };
                if opts.include_sha256 && e.kind == EntryKind::File {
                    if e.size > HASH_FILE_CAP {
                        out.sha256_skipped = Some("budget".into());
                    } else if hashed + e.size > HASH_PAGE_BUDGET && !entries.is_empty() {
                        more = true;
                        break 'pages;
                    } else {
                        hashed += e.size;
                        match link.hash(&join(&path, &e.path), e.size, Some(e.mtime_ns)).await? {
                            Ok(digest) => out.sha256 = Some(digest),
                            Err(HashSkip::Unreadable) => out.sha256_skipped = Some("unreadable".into()),
                            Err(HashSkip::Changing) => out.sha256_skipped = Some("changing".into()),
                        }
                    }
                }
                after = Some(e.path);
                entries.push(out);
            }
        }
        let next_cursor = match (&after, more) {
            (Some(last), true) => Some(encode_cursor(&path, opts.recursive, last)),
            _ => None,
        };
        Ok(Listing { entries, next_cursor })
    }

    /// Extracts a tar archive held in memory; see [`SandboxFs::upload_archive_stream`].
    pub async fn upload_archive(&self, dir: &str, archive: Vec<u8>) -> Result<ArchiveResult, FilesError> {
        self.upload_archive_stream(dir, pipe::from_bytes(archive, ARCHIVE_CHUNK)).await
    }

    /// Extracts a tar archive (gzip detected by its magic) arriving as
    /// `input` into the directory `dir`, made when missing. The archive is
    /// validated as it arrives (see the `archive` module) and written at
    /// once into a hidden `.hutch-archive-*` directory inside `dir`, so
    /// nothing but a few chunks is held here; once it is whole and valid,
    /// its top entries are moved into place: directories that exist are
    /// merged into, files are replaced, anything else in the way (a symlink,
    /// a file where a directory belongs, the reverse) is a conflict. A
    /// refused or failed archive changes nothing in the end, and neither
    /// does a daemon killed part way: every step is recorded in a journal
    /// on the host first (see the `journal` module). Permission bits are
    /// kept without setuid, setgid and sticky; directories that already
    /// existed keep theirs.
    ///
    /// The work runs in a task of its own: a caller that goes away (a
    /// client that disconnects) ends `input`, which refuses the archive as
    /// truncated, but never leaves an upload half done.
    pub async fn upload_archive_stream(&self, dir: &str, input: Chunks) -> Result<ArchiveResult, FilesError> {
        let (this, dir) = (self.clone(), dir.to_owned());
        detach(async move { this.upload_archive_detached(dir, input).await }).await
    }

    async fn upload_archive_detached(&self, dir: String, input: Chunks) -> Result<ArchiveResult, FilesError> {
        let target = normalize(&dir)?;
        if target == "/" || target == WORKSPACE {
            return Err(FilesError::new(
                ErrorCode::SandboxArchiveInvalid,
                format!("{target} is not allowed: name a directory below the workspace root"),
            ));
        }
        let mut link = self.link().await?;
        let made = missing_components(&mut link, &target).await?;
        let upload = random_suffix();
        let mut journal = Journal {
            version: 1,
            user: self.user.clone(),
            staging: join(&target, &format!(".hutch-archive-{upload}")),
            target,
            made,
            phase: Phase::Staging,
            moves: Vec::new(),
            chmods: Vec::new(),
        };
        self.save_journal(&upload, &journal).await?;
        let result = stage_and_commit(&mut link, &mut journal, self.journal.as_ref(), &upload, input).await;
        // Undo what failed, or finish what committed; the journal goes once
        // that is done (a refused step is logged: retrying cannot help).
        let settled = match journal::settle(&mut link, &journal).await {
            Err(_) => match self.link().await {
                Ok(mut fresh) => journal::settle(&mut fresh, &journal).await,
                Err(e) => Err(e),
            },
            done => done,
        };
        match settled {
            Ok(clean) => {
                if !clean {
                    tracing::warn!("archive upload into {}: some steps of its settling were refused", journal.target);
                }
                self.remove_journal(&upload).await;
            }
            Err(e) => {
                tracing::warn!("archive upload into {}: kept for the next adoption: {e}", journal.target);
            }
        }
        let plan = result?;
        Ok(ArchiveResult { path: dir, files: plan.files, bytes: plan.bytes })
    }

    async fn save_journal(&self, upload: &str, j: &Journal) -> Result<(), FilesError> {
        save_journal(self.journal.as_ref(), upload, j).await
    }

    async fn remove_journal(&self, upload: &str) {
        if let Some(dir) = &self.journal {
            dir.remove(upload).await;
        }
    }

    /// An uncompressed tar of the directory `dir`, streamed in chunks:
    /// regular files, directories, and symlinks recorded as symlinks (never
    /// followed); at most [`DOWNLOAD_CAP`] bytes. Directories the user
    /// cannot list appear without their contents; FIFOs, sockets and devices
    /// are left out. Errors about `dir` come back before any chunk; later
    /// ones (a file the user cannot read, one that shrinks while it is
    /// read, the cap) break the stream, so the client sees a truncated
    /// archive, never a wrong one. Nothing but a chunk or two is held here,
    /// however large the tree (sparse files included).
    pub async fn download_archive(&self, dir: &str) -> Result<Chunks, FilesError> {
        let root = normalize(dir)?;
        let mut link = self.link().await?;
        let (page, more) = link.list_page(&root, true, None, DOWNLOAD_PAGE).await?;
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            if let Err(e) = tar_out(&mut link, &root, page, more, &tx).await {
                if !tx.is_closed() {
                    tracing::warn!("archive download of {root} ended early: {}", e.message);
                    let _ = tx.send(Err(e)).await;
                }
            }
        });
        Ok(rx)
    }

    /// Receives one part of a file of up to [`FILE_CAP`] bytes. Parts
    /// collect in a hidden `.hutch-part-<name>` beside `path`; a part may
    /// start anywhere up to the bytes received (the staging file is cut at
    /// its offset, so offset 0 starts again), past that is
    /// `sandbox_file_part_out_of_order`. The part that ends at `size` checks
    /// the whole file's size and SHA-256 and renames it into place (missing
    /// parents made), or answers `sandbox_file_part_mismatch` and drops it.
    /// Resending that final part answers the same completion while the file
    /// at `path` still matches.
    pub async fn put_part(&self, part: FilePart) -> Result<FilePartResult, FilesError> {
        let FilePart { path, offset, size, sha256, data } = part;
        self.put_part_base64(PartRef { path: &path, offset, size, sha256: &sha256, data: &data }).await
    }

    /// [`SandboxFs::put_part`] over borrowed fields: the base64 is checked
    /// whole, then decoded and written a piece at a time, never held
    /// decoded.
    pub async fn put_part_base64(&self, part: PartRef<'_>) -> Result<FilePartResult, FilesError> {
        check_sha256(part.sha256)?;
        if part.size > FILE_CAP {
            return Err(FilesError::new(ErrorCode::PayloadTooLarge, format!("files are at most {FILE_CAP} bytes")));
        }
        let too_large =
            || FilesError::new(ErrorCode::PayloadTooLarge, format!("a part is at most {FILE_DATA_CAP} bytes"));
        if part.data.len() > FILE_DATA_CAP.div_ceil(3) * 4 + 4 {
            return Err(too_large());
        }
        let len = base64_len(part.data)
            .map_err(|_| FilesError::new(ErrorCode::InvalidRequest, "part data is not valid base64"))?;
        if len > FILE_DATA_CAP {
            return Err(too_large());
        }
        let end = part.offset.checked_add(len as u64).filter(|&e| e <= part.size).ok_or_else(|| {
            FilesError::new(ErrorCode::InvalidRequest, format!("the part ends past the file's size {}", part.size))
        })?;
        let path = normalize(part.path)?;
        let (parent, name) = split_parent(&path)?;
        let staging = join(parent, &format!(".hutch-part-{name}"));
        if staging.len() > MAX_PATH {
            return Err(FilesError::new(ErrorCode::InvalidPath, format!("{path}: name too long for parts")));
        }
        let result = |received, complete| FilePartResult {
            path: part.path.to_owned(),
            offset: part.offset,
            size: part.size,
            received,
            complete,
        };
        let mut link = self.link().await?;
        let received = match link.stat(&staging).await? {
            None => 0,
            Some(e) if e.kind == EntryKind::File => e.size,
            Some(e) => {
                return Err(FilesError::new(
                    ErrorCode::SandboxPathConflict,
                    format!("{staging} is a {}, not a part file", kind_name(e.kind)),
                ))
            }
        };
        if part.offset > received {
            // The final part again, after the file completed?
            if received == 0 && end == part.size && self.matches(&mut link, &path, part.size, part.sha256).await? {
                return Ok(result(part.size, true));
            }
            return Err(FilesError::new(
                ErrorCode::SandboxFilePartOutOfOrder,
                format!("the part starts at {} but {received} bytes were received; resend from there", part.offset),
            ));
        }
        if part.offset == 0 {
            link.mkdir(parent, true).await?;
        }
        write_base64_at(&mut link, &staging, part.offset, part.data, true).await?;
        if end < part.size {
            return Ok(result(end, false));
        }
        if !self.matches(&mut link, &staging, part.size, part.sha256).await? {
            link.discard(&staging).await;
            return Err(FilesError::new(
                ErrorCode::SandboxFilePartMismatch,
                format!("the file does not match size {} and its sha256; start again at offset 0", part.size),
            ));
        }
        link.rename(&staging, &path).await?;
        Ok(result(part.size, true))
    }

    /// Whether the regular file at `path` has `size` bytes and digest `sha256`.
    async fn matches(&self, link: &mut Link, path: &str, size: u64, sha256: &str) -> Result<bool, FilesError> {
        match link.stat(path).await? {
            Some(e) if e.kind == EntryKind::File && e.size == size => {}
            _ => return Ok(false),
        }
        Ok(matches!(link.hash(path, size, None).await?, Ok(d) if d == sha256))
    }
}

fn planned_name(kind: PlannedKind) -> &'static str {
    match kind {
        PlannedKind::Dir => "directory",
        PlannedKind::File(_) => "file",
    }
}

fn archive_error(e: ArchiveError) -> FilesError {
    match e {
        ArchiveError::Invalid(m) => FilesError::new(ErrorCode::SandboxArchiveInvalid, m),
        ArchiveError::TooLarge(m) => FilesError::new(ErrorCode::SandboxArchiveTooLarge, m),
    }
}

/// A write whose directory is missing says so.
fn missing_parent(e: FilesError, parent: &str) -> FilesError {
    if e.code == ErrorCode::NotFound {
        FilesError::new(ErrorCode::NotFound, format!("{parent}: no such directory; create it first"))
    } else {
        e
    }
}

/// A move that failed because something changed there meanwhile.
fn moved_meanwhile(e: FilesError, at: &str) -> FilesError {
    match e.code {
        ErrorCode::SandboxPathConflict | ErrorCode::NotFound => {
            FilesError::new(ErrorCode::SandboxPathConflict, format!("{at} changed while the archive was written"))
        }
        _ => e,
    }
}

async fn save_journal(store: Option<&JournalDir>, upload: &str, j: &Journal) -> Result<(), FilesError> {
    match store {
        Some(dir) => dir.save(upload, j).await,
        None => Ok(()),
    }
}

/// Streams a file from `link` after its `first` chunk, up to `end` bytes
/// (the rest of what it held when the first chunk was read), in chunks of
/// [`STREAM_CHUNK`] bytes; a failed read breaks the stream.
async fn stream_rest(mut link: Link, path: String, first: Vec<u8>, eof: bool, end: u64) -> Chunks {
    let (tx, rx) = mpsc::channel(2);
    let mut offset = first.len() as u64;
    let done = eof || first.is_empty() || offset >= end;
    if tx.send(Ok(first)).await.is_err() || done {
        return rx;
    }
    tokio::spawn(async move {
        while offset < end {
            let want = (end - offset).min(u64::from(STREAM_CHUNK)) as u32;
            let (data, eof) = match link.read_chunk(&path, offset, want, false).await {
                Ok((data, eof, _)) => (data, eof),
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            offset += data.len() as u64;
            let stop = eof || data.is_empty();
            if tx.send(Ok(data)).await.is_err() || stop {
                return;
            }
        }
    });
    rx
}

/// Base64 text decoded per piece: a multiple of 4 characters, so pieces
/// decode as the whole would (padding only ends the text).
const B64_PIECE: usize = 1 << 20;

/// The decoded length of standard, padded base64 `data`, checked whole
/// without holding what it decodes to.
fn base64_len(data: &str) -> Result<usize, base64::DecodeSliceError> {
    let mut scratch = vec![0u8; B64_PIECE / 4 * 3];
    let mut total = 0;
    for piece in data.as_bytes().chunks(B64_PIECE) {
        total += base64::engine::general_purpose::STANDARD.decode_slice(piece, &mut scratch)?;
    }
    Ok(total)
}

/// Writes base64 `data` (checked by [`base64_len`]) decoded into `path` at
/// `offset`, a piece at a time; the first write creates the file with
/// [`FILE_MODE`] and, with `truncate`, cuts it at `offset`.
async fn write_base64_at(
    link: &mut Link,
    path: &str,
    offset: u64,
    data: &str,
    truncate: bool,
) -> Result<(), FilesError> {
    let mut buf = vec![0u8; B64_PIECE / 4 * 3];
    let mut at = offset;
    let mut pieces = data.as_bytes().chunks(B64_PIECE).peekable();
    if pieces.peek().is_none() {
        return link.write_at(path, offset, &[], truncate, FILE_MODE).await;
    }
    for piece in pieces {
        let n = base64::engine::general_purpose::STANDARD
            .decode_slice(piece, &mut buf)
            .map_err(|_| FilesError::new(ErrorCode::InvalidRequest, "data is not base64"))?;
        link.write_at(path, at, &buf[..n], truncate && at == offset, FILE_MODE).await?;
        at += n as u64;
    }
    Ok(())
}

/// Runs a transfer in a task of its own, so that a caller that goes away
/// never cuts it half way (its input ends instead, and it cleans up).
async fn detach<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, FilesError>> + Send + 'static,
) -> Result<T, FilesError> {
    tokio::spawn(work)
        .await
        .map_err(|e| FilesError::new(ErrorCode::Internal, format!("file transfer task failed: {e}")))?
}

/// The components of `target` that do not exist yet, outermost first;
/// a symlink or a non-directory on the way is a conflict.
async fn missing_components(link: &mut Link, target: &str) -> Result<Vec<String>, FilesError> {
    let mut prefix = String::new();
    let mut missing = Vec::new();
    for part in target.split('/').filter(|p| !p.is_empty()) {
        prefix.push('/');
        prefix.push_str(part);
        if !missing.is_empty() {
            missing.push(prefix.clone());
            continue;
        }
        match link.stat(&prefix).await? {
            None => missing.push(prefix.clone()),
            Some(e) if e.kind == EntryKind::Dir => {}
            Some(e) => {
                return Err(FilesError::new(
                    ErrorCode::SandboxPathConflict,
                    format!("{prefix} is a {} where a directory belongs", kind_name(e.kind)),
                ))
            }
        }
    }
    Ok(missing)
}

/// Whether `path` lies below `dir` (both relative).
fn below(path: &str, dir: &str) -> bool {
    path.strip_prefix(dir).is_some_and(|r| r.starts_with('/'))
}

/// Checks where each entry lands; returns, for each planned entry,
/// whether nothing is there yet. A directory over a directory merges; a
/// file over a file replaces it; anything else is a conflict.
async fn check_landing(
    link: &mut Link,
    target: &str,
    plan: &ArchivePlan,
    target_missing: bool,
) -> Result<Vec<bool>, FilesError> {
    let mut fresh = vec![true; plan.entries.len()];
    if target_missing {
        return Ok(fresh);
    }
    // A missing path: everything below it is missing too, and (in
    // `cmp_paths` order) comes right after it.
    let mut absent: Option<&str> = None;
    for (i, e) in plan.entries.iter().enumerate() {
        if absent.is_some_and(|a| below(&e.path, a)) {
            continue;
        }
        let at = join(target, &e.path);
        match (link.stat(&at).await?, e.kind) {
            (None, _) => absent = Some(&e.path),
            (Some(x), PlannedKind::Dir) if x.kind == EntryKind::Dir => fresh[i] = false,
            (Some(x), PlannedKind::File(_)) if x.kind == EntryKind::File => fresh[i] = false,
            (Some(x), _) => {
                return Err(FilesError::new(
                    ErrorCode::SandboxPathConflict,
                    format!("{at} is a {} where the archive has a {}", kind_name(x.kind), planned_name(e.kind)),
                ))
            }
        }
    }
    Ok(fresh)
}

/// The moves that put a staged archive in place (a fresh entry moves with
/// everything below it; a file replaced first goes to a backup), and the
/// bits of the directories it makes, deepest first.
fn commit_moves(plan: &ArchivePlan, fresh: &[bool], target: &str) -> (Vec<Move>, Vec<(String, u32)>) {
    let mut moves = Vec::new();
    let mut placed: Option<&str> = None;
    let mut backups = 0u32;
    for (i, e) in plan.entries.iter().enumerate() {
        if placed.is_some_and(|p| below(&e.path, p)) {
            continue;
        }
        if fresh[i] {
            moves.push(Move { path: e.path.clone(), backup: None });
            placed = Some(&e.path);
        } else if let PlannedKind::File(_) = e.kind {
            backups += 1;
            moves.push(Move { path: e.path.clone(), backup: Some(format!(".old-{backups}")) });
        }
    }
    let chmods = plan
        .entries
        .iter()
        .enumerate()
        .rev()
        .filter(|(i, e)| e.kind == PlannedKind::Dir && fresh[*i] && e.mode != 0o755)
        .map(|(_, e)| (join(target, &e.path), e.mode))
        .collect();
    (moves, chmods)
}

/// Stages the archive, checks where it lands, and moves it into place,
/// saving the journal before each phase; on success the journal is
/// `committed`. On failure the journal says what to undo.
async fn stage_and_commit(
    link: &mut Link,
    journal: &mut Journal,
    store: Option<&JournalDir>,
    upload: &str,
    input: Chunks,
) -> Result<ArchivePlan, FilesError> {
    for dir in &journal.made {
        link.mkdir(dir, false).await?;
    }
    link.mkdir(&journal.staging, false).await?;
    let plan = stage(link, &journal.staging, input).await?;
    let fresh = check_landing(link, &journal.target, &plan, !journal.made.is_empty()).await?;
    let (moves, chmods) = commit_moves(&plan, &fresh, &journal.target);
    let mut next = journal.clone();
    next.phase = Phase::Moving;
    next.moves = moves;
    next.chmods = chmods;
    save_journal(store, upload, &next).await?;
    *journal = next;
    for m in &journal.moves {
        let from = join(&journal.staging, &m.path);
        let to = join(&journal.target, &m.path);
        if let Some(backup) = &m.backup {
            match link.stat(&to).await? {
                Some(x) if x.kind == EntryKind::File => {}
                _ => return Err(moved_meanwhile(FilesError::new(ErrorCode::SandboxPathConflict, ""), &to)),
            }
            link.rename(&to, &join(&journal.staging, backup)).await?;
        }
        link.rename(&from, &to).await.map_err(|err| moved_meanwhile(err, &to))?;
    }
    let mut done = journal.clone();
    done.phase = Phase::Committed;
    save_journal(store, upload, &done).await?;
    *journal = done;
    Ok(plan)
}

/// What the archive parser hands the writer.
enum Staged {
    Dir(String),
    File { path: String, mode: u32, size: u64 },
    Data(Vec<u8>),
}

/// The file being staged: where, its bits, and how far it got.
struct StagedFile {
    path: String,
    mode: u32,
    offset: u64,
    /// Read-only and written in several frames: made 0600, its bits set
    /// once it is whole.
    late_bits: bool,
}

impl StagedFile {
    async fn finish(self, link: &mut Link) -> Result<(), FilesError> {
        if self.late_bits {
            link.chmod(&self.path, self.mode).await?;
        }
        Ok(())
    }
}

/// Parses `input` on a thread of its own and writes what it validates
/// into `staging` as it goes: directories at 0755 (their bits come with
/// the commit), files with their bits. Returns the plan once the archive
/// is whole and valid.
async fn stage(link: &mut Link, staging: &str, input: Chunks) -> Result<ArchivePlan, FilesError> {
    let (tx, mut rx) = mpsc::channel::<Staged>(pipe::PIPE_DEPTH);
    let parsed = pipe::spawn_thread("hutch-untar", move || {
        let mut reader = pipe::ChannelReader::new(input);
        let result = archive::validate_stream(&mut reader, &archive::Limits::UPLOAD, ARCHIVE_CHUNK, |ev| {
            let staged = match ev {
                archive::Event::Dir { path } => Staged::Dir(path.to_owned()),
                archive::Event::File { path, mode, size, .. } => Staged::File { path: path.to_owned(), mode, size },
                archive::Event::Data(d) => Staged::Data(d.to_vec()),
            };
            tx.blocking_send(staged).is_ok()
        });
        (result, reader.error())
    })?;
    let mut file: Option<StagedFile> = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            Staged::Dir(path) => {
                if let Some(f) = file.take() {
                    f.finish(link).await?;
                }
                link.mkdir(&join(staging, &path), false).await?;
            }
            Staged::File { path, mode, size } => {
                if let Some(f) = file.take() {
                    f.finish(link).await?;
                }
                let path = join(staging, &path);
                if size == 0 {
                    link.write_at(&path, 0, &[], true, mode).await?;
                }
                let late_bits = mode & 0o200 == 0 && size > ARCHIVE_CHUNK as u64;
                file = Some(StagedFile { path, mode, offset: 0, late_bits });
            }
            Staged::Data(data) => {
                let Some(f) = file.as_mut() else {
                    return Err(FilesError::new(ErrorCode::Internal, "archive data arrived outside a file"));
                };
                let create_mode = if f.late_bits { FILE_MODE } else { f.mode };
                link.write_at(&f.path, f.offset, &data, f.offset == 0, create_mode).await?;
                f.offset += data.len() as u64;
            }
        }
    }
    if let Some(f) = file.take() {
        f.finish(link).await?;
    }
    let (result, broken) = parsed
        .await
        .map_err(|_| FilesError::new(ErrorCode::Internal, "the archive parser thread ended without an answer"))?;
    if let Some(e) = broken {
        return Err(e);
    }
    result.map_err(archive_error)
}

/// Writes the tar of the directory `root` into `tx`, a page of its listing
/// at a time; headers collect into chunks of about [`TAR_FLUSH`] bytes,
/// file content goes out as the agent reads it.
async fn tar_out(
    link: &mut Link,
    root: &str,
    mut page: Vec<PageEntry>,
    mut more: bool,
    tx: &mpsc::Sender<Result<Vec<u8>, FilesError>>,
) -> Result<(), FilesError> {
    let tar_err = |e: std::io::Error| FilesError::new(ErrorCode::Internal, format!("building the archive: {e}"));
    let closed = || FilesError::new(ErrorCode::Internal, "the client went away");
    let too_large =
        || FilesError::new(ErrorCode::PayloadTooLarge, format!("{root} makes an archive over {DOWNLOAD_CAP} bytes"));
    // Headers are built into the builder's buffer and taken out of it;
    // nothing else is ever written there, and its end blocks come last.
    let mut b = tar::Builder::new(Vec::new());
    let mut sent = 0u64;
    loop {
        let mut after = None;
        for e in page {
            let mut h = tar::Header::new_gnu();
            h.set_mode(e.mode & 0o7777);
            h.set_uid(u64::from(e.uid));
            h.set_gid(u64::from(e.gid));
            h.set_mtime(u64::try_from(e.mtime_ns / 1_000_000_000).unwrap_or(0));
            match e.kind {
                EntryKind::Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    b.append_data(&mut h, format!("{}/", e.path), std::io::empty()).map_err(tar_err)?;
                }
                EntryKind::Symlink => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    let target = e.target.clone().unwrap_or_default();
                    b.append_link(&mut h, &e.path, &target).map_err(tar_err)?;
                }
                EntryKind::File => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(e.size);
                    // The header (and a long name's blocks) only: the
                    // content follows from the agent, then its padding.
                    b.append_data(&mut h, &e.path, std::io::empty()).map_err(tar_err)?;
                    let pending = b.get_ref().len() as u64;
                    if sent + pending + e.size + 1024 + 512 > DOWNLOAD_CAP {
                        return Err(too_large());
                    }
                    let head = std::mem::take(b.get_mut());
                    sent += head.len() as u64;
                    tx.send(Ok(head)).await.map_err(|_| closed())?;
                    let full = join(root, &e.path);
                    let mut offset = 0u64;
                    while offset < e.size {
                        let want = (e.size - offset).min(u64::from(STREAM_CHUNK)) as u32;
                        let (data, eof, _) = link.read_chunk(&full, offset, want, true).await?;
                        if data.is_empty() {
                            break;
                        }
                        offset += data.len() as u64;
                        sent += data.len() as u64;
                        tx.send(Ok(data)).await.map_err(|_| closed())?;
                        if eof {
                            break;
                        }
                    }
                    if offset != e.size {
                        return Err(FilesError::new(
                            ErrorCode::SandboxPathConflict,
                            format!("{full} changed while it was archived"),
                        ));
                    }
                    let pad = (512 - e.size % 512) % 512;
                    b.get_mut().resize(pad as usize, 0);
                }
                EntryKind::Other => {}
            }
            if b.get_ref().len() >= TAR_FLUSH {
                let chunk = std::mem::take(b.get_mut());
                sent += chunk.len() as u64;
                if sent > DOWNLOAD_CAP {
                    return Err(too_large());
                }
                tx.send(Ok(chunk)).await.map_err(|_| closed())?;
            }
            after = Some(e.path);
        }
        if !more {
            break;
        }
        let Some(last) = after else { break };
        (page, more) = link.list_page(root, true, Some(&last), DOWNLOAD_PAGE).await?;
    }
    let rest = b.into_inner().map_err(tar_err)?;
    tx.send(Ok(rest)).await.map_err(|_| closed())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_only_for_their_listing() {
        let c = encode_cursor("/workspace/src", true, "a/b c/ü");
        assert_eq!(decode_cursor(&c, "/workspace/src", true).as_deref(), Ok("a/b c/ü"));
        assert_eq!(decode_cursor(&c, "/workspace/src", false).map_err(|e| e.code), Err(ErrorCode::InvalidRequest));
        assert_eq!(decode_cursor(&c, "/workspace", true).map_err(|e| e.code), Err(ErrorCode::InvalidRequest));
        for bad in ["", "!!!", "W10", &"A".repeat(MAX_CURSOR + 1)] {
            assert_eq!(decode_cursor(bad, "/w", true).map_err(|e| e.code), Err(ErrorCode::InvalidRequest), "{bad}");
        }
        let dotdot = encode_cursor("/w", true, "../x");
        assert!(decode_cursor(&dotdot, "/w", true).is_err());
    }

    #[test]
    fn paths_sort_one_element_at_a_time() {
        let mut v = vec!["b", "a.txt", "a/z", "a", "a b", "a/b/c"];
        v.sort_by(|a, b| cmp_paths(a, b));
        assert_eq!(v, ["a", "a/b/c", "a/z", "a b", "a.txt", "b"]);
    }

    #[test]
    fn sha256_format_is_checked() {
        assert!(check_sha256(&"a".repeat(64)).is_ok());
        assert!(check_sha256(&"A".repeat(64)).is_err());
        assert!(check_sha256(&"a".repeat(63)).is_err());
        assert!(check_sha256(&"g".repeat(64)).is_err());
    }

    #[test]
    fn paths_normalize_against_the_workspace() {
        assert_eq!(normalize("a/b").as_deref(), Ok("/workspace/a/b"));
        assert_eq!(normalize("../etc").map_err(|e| e.code), Err(ErrorCode::InvalidPath));
        assert_eq!(split_parent("/workspace/a").ok(), Some(("/workspace", "a")));
        assert_eq!(split_parent("/a").ok(), Some(("/", "a")));
        assert!(split_parent("/").is_err());
    }

    #[test]
    fn agent_codes_map_by_access() {
        let refused = |code| AgentError::Refused { code, message: "m".into() };
        use proto::ErrorCode as A;
        assert_eq!(FilesError::from_agent(refused(A::NoSpace), Access::Write).code, ErrorCode::SandboxDiskFull);
        assert_eq!(
            FilesError::from_agent(refused(A::PermissionDenied), Access::Write).code,
            ErrorCode::SandboxPathConflict
        );
        assert_eq!(
            FilesError::from_agent(refused(A::PermissionDenied), Access::List).code,
            ErrorCode::SandboxPathUnreadable
        );
        assert_eq!(
            FilesError::from_agent(refused(A::NotADirectory), Access::List).code,
            ErrorCode::SandboxPathNotDirectory
        );
        assert_eq!(FilesError::from_agent(refused(A::Io), Access::Read).code, ErrorCode::Internal);
        assert_eq!(FilesError::from_agent(AgentError::Closed, Access::Read).code, ErrorCode::Internal);
    }
}
