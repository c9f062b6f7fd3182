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

/// Public (hidden) only for the fuzz targets under fuzz/.
#[doc(hidden)]
pub mod archive;

pub use archive::{ArchiveError, ARCHIVE_CAP, ARCHIVE_ENTRIES, ARCHIVE_UNPACKED_CAP};

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

/// Where relative paths resolve.
pub const WORKSPACE: &str = "/workspace";
/// Largest file a raw upload or a file sent in parts may make.
pub const FILE_CAP: u64 = 1 << 30;
/// Largest tar archive a download makes.
pub const DOWNLOAD_CAP: u64 = 1 << 30;
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
                    A::NotFound => ErrorCode::NotFound,
                    A::PermissionDenied => match access {
                        Access::Write => ErrorCode::SandboxPathConflict,
                        Access::Read | Access::List => ErrorCode::SandboxPathUnreadable,
                        Access::Process => ErrorCode::InvalidRequest,
                    },
                    A::NotADirectory | A::SymlinkRefused => match access {
                        Access::List => ErrorCode::SandboxPathNotDirectory,
                        Access::Read | Access::Write => ErrorCode::SandboxPathConflict,
                        Access::Process => ErrorCode::InvalidRequest,
                    },
                    A::IsADirectory => match access {
                        Access::Read | Access::Process => ErrorCode::InvalidRequest,
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
                };
                (code, message)
            }
            e @ (AgentError::Io(_)
            | AgentError::Protocol(_)
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

/// The files of one sandbox, as one of its users.
#[derive(Debug, Clone)]
pub struct SandboxFs {
    socket: PathBuf,
    user: String,
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

    async fn expect_ok(&mut self, req: Request, access: Access) -> Result<(), FilesError> {
        match self.strict(req, &[], access).await? {
            (Reply::Ok, _) | (Reply::Created { .. }, _) => Ok(()),
            (other, _) => Err(FilesError::unexpected(&other)),
        }
    }

    async fn rename(&mut self, from: &str, to: &str) -> Result<(), FilesError> {
        self.expect_ok(Request::Rename { from: from.into(), to: to.into(), user: self.user() }, Access::Write).await
    }

    async fn remove(&mut self, path: &str) -> Result<(), FilesError> {
        self.expect_ok(Request::Remove { path: path.into(), user: self.user() }, Access::Write).await
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

/// What an archive upload did, so that a failure can be undone.
enum Undo {
    /// A directory made on the way to the target.
    Made(String),
    /// An entry moved into place where nothing was.
    Placed(String),
    /// A file replaced; the old one waits at the second path.
    Replaced(String, String),
    /// A directory whose bits were set; put back to 0755 before removal.
    Chmodded(String),
}

impl SandboxFs {
    /// The files of the sandbox whose agent listens on `socket`, as `user`
    /// (`user`, uid 1000, when `None`; `root` allowed).
    pub fn new(socket: PathBuf, user: Option<String>) -> SandboxFs {
        SandboxFs { socket, user: user.unwrap_or_else(|| "user".into()) }
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
        let tmp = join(parent, &format!(".hutch-upload-{}", random_suffix()));
        let mut link = self.link().await?;
        if let Err(e) = link.write_at(&tmp, 0, data, true, FILE_MODE).await {
            link.discard(&tmp).await;
            return Err(missing_parent(e, parent));
        }
        if let Err(e) = link.rename(&tmp, &path).await {
            link.discard(&tmp).await;
            return Err(e);
        }
        Ok(())
    }

    /// Streams a regular file in chunks of [`STREAM_CHUNK`] bytes: the
    /// bytes it held when the download started (a growing file is cut
    /// there). Errors about the path come back before any chunk; later
    /// failures arrive in the channel.
    pub async fn read_stream(&self, path: &str) -> Result<mpsc::Receiver<Result<Vec<u8>, FilesError>>, FilesError> {
        let path = normalize(path)?;
        let mut link = self.link().await?;
        let (first, eof, size) = link.read_chunk(&path, 0, STREAM_CHUNK, false).await?;
        // Files of /proc report size 0: read those to their end, bounded.
        let end = if size > 0 { size } else { FILE_DATA_CAP as u64 };
        let (tx, rx) = mpsc::channel(4);
        let mut offset = first.len() as u64;
        let done = eof || first.is_empty() || offset >= end;
        if tx.send(Ok(first)).await.is_err() || done {
            return Ok(rx);
        }
        tokio::spawn(async move {
            while offset < end {
                let want = (end - offset).min(STREAM_CHUNK as u64) as u32;
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
        Ok(rx)
    }

    /// Writes a file of any size up to [`FILE_CAP`] from a stream of chunks,
    /// with mode [`FILE_MODE`]; the parent directory must exist. The chunks
    /// go to a hidden `.hutch-upload-*` beside the file, renamed over it at
    /// the end and removed on any failure. Returns the bytes written.
    pub async fn write_stream(&self, path: &str, mut rx: mpsc::Receiver<Vec<u8>>) -> Result<u64, FilesError> {
        let path = normalize(path)?;
        let (parent, _) = split_parent(&path)?;
        let tmp = join(parent, &format!(".hutch-upload-{}", random_suffix()));
        let mut link = self.link().await?;
        if let Err(e) = link.write_at(&tmp, 0, &[], true, FILE_MODE).await {
            link.discard(&tmp).await;
            return Err(missing_parent(e, parent));
        }
        let mut total = 0u64;
        while let Some(chunk) = rx.recv().await {
            if total + chunk.len() as u64 > FILE_CAP {
                link.discard(&tmp).await;
                return Err(FilesError::new(ErrorCode::PayloadTooLarge, format!("the file exceeds {FILE_CAP} bytes")));
            }
            if let Err(e) = link.write_at(&tmp, total, &chunk, false, FILE_MODE).await {
                link.discard(&tmp).await;
                return Err(e);
            }
            total += chunk.len() as u64;
        }
        if let Err(e) = link.rename(&tmp, &path).await {
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

    /// Extracts a tar archive (gzip detected by its magic) into the
    /// directory `dir`, made when missing. The archive is validated in full
    /// first (see the `archive` module); it is then written into a hidden
    /// `.hutch-archive-*` directory inside `dir`, and its top entries are
    /// moved into place: directories that exist are merged into, files are
    /// replaced, anything else in the way (a symlink, a file where a
    /// directory belongs, the reverse) is a conflict. A refused archive
    /// changes nothing; one that fails part way is undone. Permission bits
    /// are kept without setuid, setgid and sticky; directories that already
    /// existed keep theirs.
    pub async fn upload_archive(&self, dir: &str, archive: Vec<u8>) -> Result<ArchiveResult, FilesError> {
        if archive.len() > ARCHIVE_CAP {
            return Err(FilesError::new(
                ErrorCode::SandboxArchiveTooLarge,
                format!("{} bytes of archive exceed {ARCHIVE_CAP}", archive.len()),
            ));
        }
        let target = normalize(dir)?;
        if target == "/" || target == WORKSPACE {
            return Err(FilesError::new(
                ErrorCode::SandboxArchiveInvalid,
                format!("{target} is not allowed: name a directory below the workspace root"),
            ));
        }
        let archive = std::sync::Arc::new(archive);
        let bytes = archive.clone();
        let plan = tokio::task::spawn_blocking(move || archive::validate(&bytes))
            .await
            .map_err(|e| FilesError::new(ErrorCode::Internal, format!("archive validation task failed: {e}")))?
            .map_err(archive_error)?;
        let mut link = self.link().await?;
        // Read-only checks first: the target and everything the archive
        // would land on.
        let missing = self.missing_components(&mut link, &target).await?;
        let fresh = self.check_landing(&mut link, &target, &plan, !missing.is_empty()).await?;
        let mut undo = Vec::new();
        let result = self.place_archive(&mut link, &target, &missing, &fresh, &plan, archive, &mut undo).await;
        match result {
            Ok(()) => Ok(ArchiveResult { path: dir.to_string(), files: plan.files, bytes: plan.bytes }),
            Err(e) => {
                undo_archive(&mut link, undo).await;
                Err(e)
            }
        }
    }

    /// The components of `target` that do not exist yet, outermost first;
    /// a symlink or a non-directory on the way is a conflict.
    async fn missing_components(&self, link: &mut Link, target: &str) -> Result<Vec<String>, FilesError> {
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

    /// Checks where each entry lands; returns, for each planned entry,
    /// whether nothing is there yet. A directory over a directory merges; a
    /// file over a file replaces it; anything else is a conflict.
    async fn check_landing(
        &self,
        link: &mut Link,
        target: &str,
        plan: &ArchivePlan,
        target_missing: bool,
    ) -> Result<Vec<bool>, FilesError> {
        let mut fresh = vec![true; plan.entries.len()];
        if target_missing {
            return Ok(fresh);
        }
        // Paths known to be missing: everything below them is too.
        let mut absent: Vec<&str> = Vec::new();
        for (i, e) in plan.entries.iter().enumerate() {
            if absent.iter().any(|a| e.path.strip_prefix(a).is_some_and(|r| r.starts_with('/'))) {
                continue;
            }
            let at = join(target, &e.path);
            match (link.stat(&at).await?, e.kind) {
                (None, _) => absent.push(&e.path),
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

    #[allow(clippy::too_many_arguments)]
    async fn place_archive(
        &self,
        link: &mut Link,
        target: &str,
        missing: &[String],
        fresh: &[bool],
        plan: &ArchivePlan,
        archive: std::sync::Arc<Vec<u8>>,
        undo: &mut Vec<Undo>,
    ) -> Result<(), FilesError> {
        for dir in missing {
            link.mkdir(dir, false).await?;
            undo.push(Undo::Made(dir.clone()));
        }
        let staging = join(target, &format!(".hutch-archive-{}", random_suffix()));
        link.mkdir(&staging, false).await?;
        undo.push(Undo::Made(staging.clone()));
        // Directories first (sorted: parents before children), at 0755 so
        // that their files can be written; their own bits come last.
        for e in plan.entries.iter().filter(|e| e.kind == PlannedKind::Dir) {
            link.mkdir(&join(&staging, &e.path), false).await?;
        }
        self.write_archive_files(link, &staging, plan, archive).await?;
        // Move into place: an entry whose parent was placed moved with it.
        let mut placed: Vec<&str> = Vec::new();
        let mut backups = 0u32;
        for (i, e) in plan.entries.iter().enumerate() {
            if placed.iter().any(|p| e.path.strip_prefix(p).is_some_and(|r| r.starts_with('/'))) {
                continue;
            }
            let from = join(&staging, &e.path);
            let to = join(target, &e.path);
            if fresh[i] {
                link.rename(&from, &to).await.map_err(|err| moved_meanwhile(err, &to))?;
                undo.push(Undo::Placed(to));
                placed.push(&e.path);
            } else if let PlannedKind::File(_) = e.kind {
                match link.stat(&to).await? {
                    Some(x) if x.kind == EntryKind::File => {}
                    _ => return Err(moved_meanwhile(FilesError::new(ErrorCode::SandboxPathConflict, ""), &to)),
                }
                backups += 1;
                let old = join(&staging, &format!(".old-{backups}"));
                link.rename(&to, &old).await?;
                undo.push(Undo::Replaced(to.clone(), old));
                link.rename(&from, &to).await.map_err(|err| moved_meanwhile(err, &to))?;
            }
        }
        // Bits of the directories the archive made, deepest first.
        for (i, e) in plan.entries.iter().enumerate().rev() {
            if e.kind == PlannedKind::Dir && fresh[i] && e.mode != 0o755 {
                let at = join(target, &e.path);
                link.chmod(&at, e.mode).await?;
                undo.push(Undo::Chmodded(at));
            }
        }
        // The staging directory now holds only replaced files.
        link.remove(&staging).await?;
        Ok(())
    }

    async fn write_archive_files(
        &self,
        link: &mut Link,
        staging: &str,
        plan: &ArchivePlan,
        archive: std::sync::Arc<Vec<u8>>,
    ) -> Result<(), FilesError> {
        let modes: std::collections::HashMap<&str, (u32, u64)> = plan
            .entries
            .iter()
            .filter_map(|e| match e.kind {
                PlannedKind::File(size) => Some((e.path.as_str(), (e.mode, size))),
                PlannedKind::Dir => None,
            })
            .collect();
        let (tx, mut rx) = mpsc::channel::<(usize, Vec<u8>)>(2);
        let producer_plan = plan.clone();
        let producer = tokio::task::spawn_blocking(move || {
            archive::stream_files(&archive, &producer_plan, CHUNK, |i, chunk| tx.blocking_send((i, chunk)).is_ok())
        });
        let mut current: Option<(usize, u64)> = None;
        let mut needs_chmod: Option<(String, u32)> = None;
        while let Some((i, chunk)) = rx.recv().await {
            let Some(rel) = plan.files_in_order.get(i) else {
                return Err(FilesError::new(ErrorCode::Internal, "archive stream out of step with its plan"));
            };
            let path = join(staging, rel);
            let (mode, size) = modes.get(rel.as_str()).copied().unwrap_or((0o644, 0));
            let offset = match current {
                Some((ci, off)) if ci == i => off,
                _ => {
                    if let Some((p, m)) = needs_chmod.take() {
                        link.chmod(&p, m).await?;
                    }
                    // A read-only file larger than one frame is written as
                    // 0600 and gets its bits once complete.
                    if mode & 0o200 == 0 && size > CHUNK as u64 {
                        needs_chmod = Some((path.clone(), mode));
                    }
                    0
                }
            };
            let create_mode = if needs_chmod.is_some() { 0o600 } else { mode };
            link.write_at(&path, offset, &chunk, offset == 0, create_mode).await?;
            current = Some((i, offset + chunk.len() as u64));
        }
        if let Some((p, m)) = needs_chmod.take() {
            link.chmod(&p, m).await?;
        }
        producer
            .await
            .map_err(|e| FilesError::new(ErrorCode::Internal, format!("archive extraction task failed: {e}")))?
            .map_err(archive_error)?;
        Ok(())
    }

    /// An uncompressed tar of the directory `dir`: regular files,
    /// directories, and symlinks recorded as symlinks (never followed); at
    /// most [`DOWNLOAD_CAP`] bytes, built in memory. Directories the user
    /// cannot list appear without their contents; FIFOs, sockets and devices
    /// are left out; a file the user cannot read fails the download with
    /// `sandbox_path_unreadable`, one that changes size with
    /// `sandbox_path_conflict`.
    pub async fn download_archive(&self, dir: &str) -> Result<Vec<u8>, FilesError> {
        let root = normalize(dir)?;
        let mut link = self.link().await?;
        let mut builder = tar::Builder::new(Vec::new());
        let too_large = || {
            FilesError::new(ErrorCode::PayloadTooLarge, format!("{root} makes an archive over {DOWNLOAD_CAP} bytes"))
        };
        let tar_err = |e: std::io::Error| FilesError::new(ErrorCode::Internal, format!("building the archive: {e}"));
        let mut after: Option<String> = None;
        loop {
            let (page, more) = link.list_page(&root, true, after.as_deref(), MAX_PAGE_ENTRIES).await?;
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
                        builder.append_data(&mut h, format!("{}/", e.path), std::io::empty()).map_err(tar_err)?;
                    }
                    EntryKind::Symlink => {
                        h.set_entry_type(tar::EntryType::Symlink);
                        h.set_size(0);
                        let target = e.target.clone().unwrap_or_default();
                        builder.append_link(&mut h, &e.path, &target).map_err(tar_err)?;
                    }
                    EntryKind::File => {
                        if builder.get_ref().len() as u64 + e.size + 1024 > DOWNLOAD_CAP {
                            return Err(too_large());
                        }
                        let full = join(&root, &e.path);
                        let data = read_exact_size(&mut link, &full, e.size).await?;
                        h.set_entry_type(tar::EntryType::Regular);
                        h.set_size(data.len() as u64);
                        builder.append_data(&mut h, &e.path, data.as_slice()).map_err(tar_err)?;
                    }
                    EntryKind::Other => {}
                }
                if builder.get_ref().len() as u64 + 1024 > DOWNLOAD_CAP {
                    return Err(too_large());
                }
                after = Some(e.path);
            }
            if !more {
                break;
            }
        }
        builder.into_inner().map_err(tar_err)
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
        check_sha256(&part.sha256)?;
        if part.size > FILE_CAP {
            return Err(FilesError::new(ErrorCode::PayloadTooLarge, format!("files are at most {FILE_CAP} bytes")));
        }
        if part.data.len() > FILE_DATA_CAP.div_ceil(3) * 4 + 4 {
            return Err(FilesError::new(
                ErrorCode::PayloadTooLarge,
                format!("a part is at most {FILE_DATA_CAP} bytes"),
            ));
        }
        let data = base64::engine::general_purpose::STANDARD
            .decode(part.data.as_bytes())
            .map_err(|_| FilesError::new(ErrorCode::InvalidRequest, "part data is not valid base64"))?;
        if data.len() > FILE_DATA_CAP {
            return Err(FilesError::new(
                ErrorCode::PayloadTooLarge,
                format!("a part is at most {FILE_DATA_CAP} bytes"),
            ));
        }
        let end = part.offset.checked_add(data.len() as u64).filter(|&e| e <= part.size).ok_or_else(|| {
            FilesError::new(ErrorCode::InvalidRequest, format!("the part ends past the file's size {}", part.size))
        })?;
        let path = normalize(&part.path)?;
        let (parent, name) = split_parent(&path)?;
        let staging = join(parent, &format!(".hutch-part-{name}"));
        if staging.len() > MAX_PATH {
            return Err(FilesError::new(ErrorCode::InvalidPath, format!("{path}: name too long for parts")));
        }
        let result = |received, complete| FilePartResult {
            path: part.path.clone(),
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
            if received == 0 && end == part.size && self.matches(&mut link, &path, part.size, &part.sha256).await? {
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
        link.write_at(&staging, part.offset, &data, true, FILE_MODE).await?;
        if end < part.size {
            return Ok(result(end, false));
        }
        if !self.matches(&mut link, &staging, part.size, &part.sha256).await? {
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

/// Reads a whole regular file that the listing said holds `size` bytes,
/// with no symlink followed; refuses one that changed size meanwhile.
async fn read_exact_size(link: &mut Link, path: &str, size: u64) -> Result<Vec<u8>, FilesError> {
    let mut out = Vec::new();
    while (out.len() as u64) < size {
        let want = (size - out.len() as u64).min(CHUNK as u64) as u32;
        let (data, eof, _) = link.read_chunk(path, out.len() as u64, want, true).await?;
        if data.is_empty() {
            break;
        }
        out.extend_from_slice(&data);
        if eof {
            break;
        }
    }
    if out.len() as u64 != size {
        return Err(FilesError::new(ErrorCode::SandboxPathConflict, format!("{path} changed while it was archived")));
    }
    Ok(out)
}

/// Undoes a failed archive upload, newest step first; best effort.
async fn undo_archive(link: &mut Link, undo: Vec<Undo>) {
    for step in undo.into_iter().rev() {
        let _ = match step {
            Undo::Chmodded(p) => link.chmod(&p, 0o755).await,
            Undo::Replaced(at, old) => link.rename(&old, &at).await,
            Undo::Placed(p) | Undo::Made(p) => link.remove(&p).await,
        };
    }
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
