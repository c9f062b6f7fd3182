//! Validation of an uploaded tar archive: only regular files and
//! directories with normalized UTF-8 names, bounded in size, count and name
//! bytes. [`validate_stream`] parses a stream (a `Read`) once, front to back,
//! and hands each directory, file and chunk of file content to a sink as it
//! is checked, so an upload can be staged while it arrives and never held
//! whole; a refusal can come at any point, and the caller undoes what it
//! staged. It is pure code over bytes (no IO but the reader, no clock, no
//! randomness), so hostile archives are tested, and fuzzed, without a
//! sandbox.
//!
//! The tar crate is used in raw mode: GNU long names and pax headers are
//! read here, each bounded before it is read (the crate's own handling reads
//! them whole, whatever size they claim).

use std::cell::Cell;
use std::collections::HashMap;
use std::io::{self, Read};
use std::rc::Rc;

use hutch_agent::proto::{cmp_paths, MAX_PATH};

/// Most bytes of archive accepted when it is held in memory (build
/// contexts), compressed or not.
pub const ARCHIVE_CAP: usize = 32 << 20;
/// Most entries (files and directories) in one archive.
pub const ARCHIVE_ENTRIES: usize = 10_000;
/// Most bytes of file content in an archive held in memory.
pub const ARCHIVE_UNPACKED_CAP: u64 = 256 << 20;
/// Most bytes of file content in an archive streamed into a sandbox.
pub const UPLOAD_UNPACKED_CAP: u64 = 1 << 30;
/// Most bytes an upload's request may carry (compressed or not): room for
/// the content, headers and names, and gzip's overhead; a gzip stream of
/// empty members, which inflates to nothing, ends here too.
pub const UPLOAD_PACKED_CAP: u64 = UPLOAD_UNPACKED_CAP + (UPLOAD_UNPACKED_CAP >> 3);
/// Most bytes of entry names (normalized) in one archive, implicit parent
/// directories included: a plan and an upload's journal stay small.
pub const ARCHIVE_NAME_BYTES: usize = 4 << 20;
/// Longest name of one path element.
const MAX_NAME: usize = 255;
/// Largest pax extended header read (a path, times, owners: a few KiB).
const MAX_PAX: u64 = 64 << 10;

/// The bounds of one archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Entries, explicit and implicit.
    pub entries: usize,
    /// Bytes of file content.
    pub unpacked: u64,
    /// Bytes of normalized names.
    pub name_bytes: usize,
    /// Bytes read from the input, compressed or not.
    pub packed: u64,
}

impl Limits {
    /// Archives held in memory: build contexts.
    pub const CONTEXT: Limits = Limits {
        entries: ARCHIVE_ENTRIES,
        unpacked: ARCHIVE_UNPACKED_CAP,
        name_bytes: ARCHIVE_NAME_BYTES,
        packed: ARCHIVE_CAP as u64,
    };
    /// Archives streamed into a sandbox.
    pub const UPLOAD: Limits = Limits {
        entries: ARCHIVE_ENTRIES,
        unpacked: UPLOAD_UNPACKED_CAP,
        name_bytes: ARCHIVE_NAME_BYTES,
        packed: UPLOAD_PACKED_CAP,
    };

    /// Most bytes the decompressed tar stream may hold: the content plus
    /// room for headers, long names and padding of every entry.
    fn stream(&self) -> u64 {
        self.unpacked + (self.entries as u64 + 16) * 4096 + 2 * self.name_bytes as u64
    }
}

/// Why an archive was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArchiveError {
    /// The archive is malformed or holds an entry that is not allowed.
    #[error("archive refused: {0}")]
    Invalid(String),
    /// The archive exceeds a per-request limit.
    #[error("archive too large: {0}")]
    TooLarge(String),
}

/// The message of the error [`validate_stream`] returns when its sink
/// stopped it; the caller knows why it did.
pub const STOPPED: &str = "stopped by the receiver";

/// What an archive entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannedKind {
    Dir,
    /// A regular file of this many bytes.
    File(u64),
}

/// One entry to write, relative to the target directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEntry {
    /// Normalized: UTF-8, `/`-separated, no empty, `.` or `..` element.
    pub path: String,
    pub kind: PlannedKind,
    /// Permission bits without setuid, setgid and sticky.
    pub mode: u32,
    /// Made because an entry below it needed it; the archive has no entry.
    pub implicit: bool,
}

/// A validated archive: every entry sorted by [`cmp_paths`] (so a directory
/// comes before its contents), and the order of the files in the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchivePlan {
    pub entries: Vec<PlannedEntry>,
    /// Paths of the regular files in archive order, as [`stream_files`]
    /// yields them.
    pub files_in_order: Vec<String>,
    pub files: u64,
    pub bytes: u64,
}

/// What [`validate_stream`] hands its sink, in archive order, each only
/// once it is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// A directory to make; its parent came before it. Each directory comes
    /// once (an archive's entry for a directory already made implicitly
    /// changes only the plan's mode). Modes come with the plan, at the end.
    Dir { path: &'a str },
    /// A regular file begins: its index in `files_in_order`, its mode
    /// (without setuid, setgid and sticky) and size. Its content follows as
    /// [`Event::Data`], `size` bytes in all, before the next event.
    File { index: usize, path: &'a str, mode: u32, size: u64 },
    /// The next bytes of the current file, at most the chunk size.
    Data(&'a [u8]),
}

/// Whether `bytes` start with the gzip magic.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

/// Which limit a stream went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Over {
    Packed(u64),
    Unpacked(u64),
}

/// A reader that fails once more than `left` bytes went through it, and
/// records that it did (so a bomb reads as "too large", not "malformed").
struct Capped<R> {
    inner: R,
    left: u64,
    which: Over,
    over: Rc<Cell<Option<Over>>>,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more tells a stream that ends here from one that goes on.
            let mut probe = [0u8; 1];
            if self.inner.read(&mut probe)? == 0 {
                return Ok(0);
            }
            self.over.set(Some(self.which));
            return Err(io::Error::other("archive exceeds its limit"));
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// The decompressed tar stream of `input` (gzip detected by its magic),
/// capped on both sides.
fn open<'r>(input: impl Read + 'r, limits: &Limits, over: &Rc<Cell<Option<Over>>>) -> io::Result<Box<dyn Read + 'r>> {
    let mut raw = Capped { inner: input, left: limits.packed, which: Over::Packed(limits.packed), over: over.clone() };
    let mut magic = [0u8; 2];
    let mut got = 0;
    while got < magic.len() {
        match raw.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let joined = io::Cursor::new(magic).take(got as u64).chain(raw);
    let stream: Box<dyn Read + 'r> =
        if is_gzip(&magic[..got]) { Box::new(flate2::read::MultiGzDecoder::new(joined)) } else { Box::new(joined) };
    let cap = limits.stream();
    Ok(Box::new(Capped { inner: stream, left: cap, which: Over::Unpacked(limits.unpacked), over: over.clone() }))
}

/// Normalizes an entry name: UTF-8, relative, `.` and empty elements
/// dropped (`./a/` is `a`), no `..`. `None` for the archive's root (`.`).
pub fn normalize_name(raw: &[u8]) -> Result<Option<String>, ArchiveError> {
    let name = std::str::from_utf8(raw)
        .map_err(|_| ArchiveError::Invalid(format!("entry name {:?} is not UTF-8", String::from_utf8_lossy(raw))))?;
    if name.starts_with('/') {
        return Err(ArchiveError::Invalid(format!("entry {name:?} has an absolute name")));
    }
    if name.contains('\0') {
        return Err(ArchiveError::Invalid(format!("entry {name:?} holds NUL")));
    }
    let mut parts = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(ArchiveError::Invalid(format!("entry {name:?} has a '..' component"))),
            p if p.len() > MAX_NAME => {
                return Err(ArchiveError::Invalid(format!("entry {name:?} has an element over {MAX_NAME} bytes")))
            }
            p => parts.push(p),
        }
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let path = parts.join("/");
    if path.len() > MAX_PATH - 512 {
        return Err(ArchiveError::Invalid(format!("entry name of {} bytes is too long", path.len())));
    }
    Ok(Some(path))
}

fn malformed(over: &Cell<Option<Over>>, what: &str, e: io::Error) -> ArchiveError {
    match over.get() {
        Some(Over::Unpacked(cap)) => ArchiveError::TooLarge(format!("more than {cap} bytes uncompressed")),
        Some(Over::Packed(cap)) => ArchiveError::TooLarge(format!("more than {cap} bytes of archive")),
        None => ArchiveError::Invalid(format!("{what}: {e}")),
    }
}

fn stopped() -> ArchiveError {
    ArchiveError::Invalid(STOPPED.into())
}

/// Reads an extension header's data, at most `max` bytes.
fn read_bounded(entry: &mut impl Read, size: u64, max: u64, what: &str) -> Result<Vec<u8>, io::Error> {
    if size > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{what} of {size} bytes is over {max}")));
    }
    let mut v = Vec::with_capacity(size as usize);
    entry.take(size).read_to_end(&mut v)?;
    if v.len() as u64 != size {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("truncated {what}")));
    }
    Ok(v)
}

/// Fills `buf` from `r` unless the stream ends first; the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The entries seen so far.
struct Seen<'l> {
    limits: &'l Limits,
    by_path: HashMap<String, PlannedEntry>,
    files_in_order: Vec<String>,
    name_bytes: usize,
}

impl Seen<'_> {
    fn insert(&mut self, path: &str, kind: PlannedKind, mode: u32, implicit: bool) -> Result<(), ArchiveError> {
        if self.by_path.len() >= self.limits.entries {
            return Err(ArchiveError::TooLarge(format!("more than {} entries", self.limits.entries)));
        }
        self.name_bytes += path.len();
        if self.name_bytes > self.limits.name_bytes {
            return Err(ArchiveError::TooLarge(format!("more than {} bytes of entry names", self.limits.name_bytes)));
        }
        let entry = PlannedEntry { path: path.to_owned(), kind, mode, implicit };
        self.by_path.insert(path.to_owned(), entry);
        Ok(())
    }

    /// Records an entry of the archive, making its missing parents first;
    /// hands the sink what is new. `Ok(false)`: the sink stopped.
    fn add(
        &mut self,
        path: &str,
        kind: PlannedKind,
        mode: u32,
        sink: &mut impl FnMut(Event<'_>) -> bool,
    ) -> Result<bool, ArchiveError> {
        if let Some(e) = self.by_path.get_mut(path) {
            return match (e.implicit, kind) {
                (true, PlannedKind::Dir) => {
                    e.mode = mode;
                    e.implicit = false;
                    Ok(true)
                }
                (true, PlannedKind::File(_)) => {
                    Err(ArchiveError::Invalid(format!("entry {path:?} is a file, but entries before it lie below it")))
                }
                (false, _) => Err(ArchiveError::Invalid(format!("entry {path:?} appears twice"))),
            };
        }
        for (i, _) in path.match_indices('/') {
            let parent = &path[..i];
            match self.by_path.get(parent) {
                Some(PlannedEntry { kind: PlannedKind::File(_), .. }) => {
                    return Err(ArchiveError::Invalid(format!("entry {path:?} lies below the file {parent:?}")))
                }
                Some(_) => {}
                None => {
                    self.insert(parent, PlannedKind::Dir, 0o755, true)?;
                    if !sink(Event::Dir { path: parent }) {
                        return Ok(false);
                    }
                }
            }
        }
        self.insert(path, kind, mode, false)?;
        let event = match kind {
            PlannedKind::Dir => Event::Dir { path },
            PlannedKind::File(size) => {
                self.files_in_order.push(path.to_owned());
                Event::File { index: self.files_in_order.len() - 1, path, mode, size }
            }
        };
        Ok(sink(event))
    }
}

/// Parses and checks an archive (gzip detected by its magic) from `input`,
/// front to back, handing `sink` each directory, file and chunk of content
/// (at most `chunk` bytes) once it is checked. Nothing is read past a
/// limit, and nothing is held but the entries' names and one chunk. The
/// sink returns false to stop: the answer is then `Invalid(STOPPED)`.
///
/// A refusal can come after the sink saw events: everything it was handed
/// belongs to a refused archive.
pub fn validate_stream(
    input: impl Read,
    limits: &Limits,
    chunk: usize,
    mut sink: impl FnMut(Event<'_>) -> bool,
) -> Result<ArchivePlan, ArchiveError> {
    let over = Rc::new(Cell::new(None));
    let stream = open(input, limits, &over).map_err(|e| malformed(&over, "unreadable archive", e))?;
    let mut archive = tar::Archive::new(stream);
    let entries = archive.entries().map_err(|e| malformed(&over, "unreadable archive", e))?.raw(true);
    let mut seen = Seen { limits, by_path: HashMap::new(), files_in_order: Vec::new(), name_bytes: 0 };
    let mut count = 0usize;
    let mut total = 0u64;
    let mut long_name: Option<Vec<u8>> = None;
    let mut pax: Option<Vec<u8>> = None;
    let mut buf = vec![0u8; chunk.max(1)];
    for entry in entries {
        let mut entry = entry.map_err(|e| malformed(&over, "malformed archive", e))?;
        let kind = entry.header().entry_type();
        let size = entry.size();
        if kind.is_gnu_longname() {
            if long_name.is_some() {
                return Err(ArchiveError::Invalid("two long names describe one entry".into()));
            }
            let name = read_bounded(&mut entry, size, MAX_PATH as u64 + 1, "long name")
                .map_err(|e| malformed(&over, "malformed long name", e))?;
            long_name = Some(name);
            continue;
        }
        if kind.is_gnu_longlink() {
            return Err(ArchiveError::Invalid("an entry has a long link name; links are not allowed".into()));
        }
        if kind.is_pax_local_extensions() {
            if pax.is_some() {
                return Err(ArchiveError::Invalid("two pax headers describe one entry".into()));
            }
            let ext = read_bounded(&mut entry, size, MAX_PAX, "pax header")
                .map_err(|e| malformed(&over, "malformed pax header", e))?;
            pax = Some(ext);
            continue;
        }
        count += 1;
        if count > limits.entries {
            return Err(ArchiveError::TooLarge(format!("more than {} entries", limits.entries)));
        }
        if kind.is_pax_global_extensions() {
            // Global attributes (git archive puts the commit id there): ignored.
            read_bounded(&mut entry, size, MAX_PAX, "pax global header")
                .map_err(|e| malformed(&over, "malformed pax header", e))?;
            continue;
        }
        // The entry's name: a GNU long name, else a pax path, else the header's.
        let mut raw = match long_name.take() {
            Some(mut n) => {
                if n.last() == Some(&0) {
                    n.pop();
                }
                Some(n)
            }
            None => None,
        };
        if let Some(ext) = pax.take() {
            for field in tar::PaxExtensions::new(&ext) {
                let field = field.map_err(|e| malformed(&over, "malformed pax header", e))?;
                let key = field.key_bytes();
                if key.starts_with(b"GNU.sparse") {
                    let shown =
                        String::from_utf8_lossy(raw.as_deref().unwrap_or(&entry.header().path_bytes())).into_owned();
                    return Err(ArchiveError::Invalid(format!("entry {shown:?} is a sparse file")));
                }
                if key == b"size" {
                    // The crate does not apply a pax size in raw mode; a
                    // size other than the header's would be parsed as
                    // another archive by other tools: refused.
                    let agrees = field.value().ok().and_then(|v| v.parse::<u64>().ok()) == Some(size);
                    if !agrees {
                        return Err(ArchiveError::Invalid("a pax size disagrees with its header".into()));
                    }
                }
                if key == b"path" && raw.is_none() {
                    raw = Some(field.value_bytes().to_vec());
                }
            }
        }
        let raw = raw.unwrap_or_else(|| entry.header().path_bytes().into_owned());
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let planned = match kind {
            tar::EntryType::Regular => PlannedKind::File(size),
            tar::EntryType::Directory => PlannedKind::Dir,
            tar::EntryType::Symlink => return Err(ArchiveError::Invalid(format!("entry {shown:?} is a symlink"))),
            tar::EntryType::Link => return Err(ArchiveError::Invalid(format!("entry {shown:?} is a hard link"))),
            tar::EntryType::GNUSparse => {
                return Err(ArchiveError::Invalid(format!("entry {shown:?} is a sparse file")))
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                return Err(ArchiveError::Invalid(format!("entry {shown:?} is a device")))
            }
            tar::EntryType::Fifo => return Err(ArchiveError::Invalid(format!("entry {shown:?} is a fifo"))),
            other => {
                return Err(ArchiveError::Invalid(format!(
                    "entry {shown:?} has unsupported type {:?}",
                    other.as_byte()
                )))
            }
        };
        if let PlannedKind::File(size) = planned {
            total = total.saturating_add(size);
            if total > limits.unpacked {
                return Err(ArchiveError::TooLarge(format!("more than {} bytes uncompressed", limits.unpacked)));
            }
        }
        let Some(path) = normalize_name(&raw)? else {
            if planned == PlannedKind::Dir {
                continue;
            }
            return Err(ArchiveError::Invalid(format!("entry {shown:?} names the target directory itself")));
        };
        let mode = entry.header().mode().map_err(|e| malformed(&over, "malformed mode", e))? & 0o777;
        if !seen.add(&path, planned, mode, &mut sink)? {
            return Err(stopped());
        }
        if let PlannedKind::File(size) = planned {
            let mut got = 0u64;
            loop {
                let n = read_full(&mut entry, &mut buf).map_err(|e| malformed(&over, "truncated archive", e))?;
                if n == 0 {
                    break;
                }
                got += n as u64;
                if !sink(Event::Data(&buf[..n])) {
                    return Err(stopped());
                }
            }
            if got != size {
                return Err(ArchiveError::Invalid(format!("entry {shown:?} is truncated")));
            }
        }
    }
    if long_name.is_some() || pax.is_some() {
        return Err(ArchiveError::Invalid("the archive ends with a header that describes no entry".into()));
    }
    let files = seen.files_in_order.len() as u64;
    let mut entries: Vec<PlannedEntry> = seen.by_path.into_values().collect();
    entries.sort_by(|a, b| cmp_paths(&a.path, &b.path));
    Ok(ArchivePlan { entries, files_in_order: seen.files_in_order, files, bytes: total })
}

/// Parses and checks a whole archive held in memory, within
/// [`Limits::CONTEXT`]; nothing is written anywhere.
pub fn validate(bytes: &[u8]) -> Result<ArchivePlan, ArchiveError> {
    if bytes.len() > ARCHIVE_CAP {
        return Err(ArchiveError::TooLarge(format!("{} bytes of archive exceed {ARCHIVE_CAP}", bytes.len())));
    }
    validate_stream(bytes, &Limits::CONTEXT, 64 << 10, |_| true)
}

/// Streams the content of a validated archive's regular files, in archive
/// order, as `(index into files_in_order, chunk)`; each file yields at least
/// one chunk (an empty one for an empty file) and chunks of at most
/// `chunk` bytes. `send` returns false to stop. Entries are checked against
/// `plan` again, so a changed archive cannot slip through.
pub fn stream_files(
    bytes: &[u8],
    plan: &ArchivePlan,
    chunk: usize,
    mut send: impl FnMut(usize, Vec<u8>) -> bool,
) -> Result<(), ArchiveError> {
    let mut current = None;
    let mut stopped_here = false;
    let mut changed = false;
    let r = validate_stream(bytes, &Limits::CONTEXT, chunk, |ev| match ev {
        Event::Dir { .. } => true,
        Event::File { index, path, size, .. } => {
            if plan.files_in_order.get(index).map(String::as_str) != Some(path) {
                changed = true;
                return false;
            }
            current = Some(index);
            if size == 0 && !send(index, Vec::new()) {
                stopped_here = true;
                return false;
            }
            true
        }
        Event::Data(d) => {
            let Some(i) = current else { return false };
            if !send(i, d.to_vec()) {
                stopped_here = true;
                return false;
            }
            true
        }
    });
    if stopped_here {
        return Ok(());
    }
    if changed {
        return Err(ArchiveError::Invalid("archive changed between validation and extraction".into()));
    }
    r.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h
    }

    /// Writes a raw name into a header, bypassing the builder's checks (which
    /// refuse `..` and absolute names, as a hostile client would not).
    fn raw_entry(out: &mut Vec<u8>, name: &[u8], kind: tar::EntryType, data: &[u8], link: Option<&[u8]>) {
        let mut h = header(kind, data.len() as u64, 0o644);
        {
            let gnu = h.as_gnu_mut().expect("gnu header");
            gnu.name[..name.len()].copy_from_slice(name);
            if let Some(link) = link {
                gnu.linkname[..link.len()].copy_from_slice(link);
            }
        }
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    fn finish(mut out: Vec<u8>) -> Vec<u8> {
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    fn good_tar() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = header(tar::EntryType::Directory, 0, 0o750);
        b.append_data(&mut h, "./", io::empty()).expect("dir");
        let mut h = header(tar::EntryType::Directory, 0, 0o700);
        b.append_data(&mut h, "./src/", io::empty()).expect("dir");
        let mut h = header(tar::EntryType::Regular, 5, 0o4755);
        b.append_data(&mut h, "./src/main.sh", &b"hello"[..]).expect("file");
        let mut h = header(tar::EntryType::Regular, 0, 0o644);
        b.append_data(&mut h, "deep/er/empty", io::empty()).expect("file");
        b.into_inner().expect("finish")
    }

    #[test]
    fn a_plain_archive_is_planned_with_implicit_parents_and_no_setuid() {
        let plan = validate(&good_tar()).expect("valid");
        let paths: Vec<&str> = plan.entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["deep", "deep/er", "deep/er/empty", "src", "src/main.sh"]);
        assert_eq!(plan.files, 2);
        assert_eq!(plan.bytes, 5);
        let main = plan.entries.iter().find(|e| e.path == "src/main.sh").expect("main");
        assert_eq!(main.mode, 0o755, "setuid dropped");
        assert!(plan.entries[0].implicit);
        assert_eq!(plan.entries[3].mode, 0o700);
    }

    #[test]
    fn gzip_is_detected_by_its_magic() {
        let raw = good_tar();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&raw).expect("gzip");
        let gz = gz.finish().expect("gzip");
        assert!(is_gzip(&gz));
        assert!(!is_gzip(&raw));
        assert_eq!(validate(&gz).expect("valid gzip"), validate(&raw).expect("valid"));
    }

    #[test]
    fn hostile_entries_refuse_the_whole_archive() {
        type Case = (&'static [u8], tar::EntryType, Option<&'static [u8]>);
        let cases: [Case; 8] = [
            (b"evil", tar::EntryType::Symlink, Some(b"/etc")),
            (b"hard", tar::EntryType::Link, Some(b"ok")),
            (b"../x", tar::EntryType::Regular, None),
            (b"a/../../x", tar::EntryType::Regular, None),
            (b"/abs", tar::EntryType::Regular, None),
            (b"dev", tar::EntryType::Char, None),
            (b"fifo", tar::EntryType::Fifo, None),
            (b"sparse", tar::EntryType::GNUSparse, None),
        ];
        for (name, kind, link) in cases {
            let mut out = Vec::new();
            raw_entry(&mut out, b"ok", tar::EntryType::Regular, b"fine", None);
            raw_entry(&mut out, name, kind, b"", link);
            let r = validate(&finish(out));
            assert!(
                matches!(r, Err(ArchiveError::Invalid(_))),
                "{:?} of type {kind:?} was not refused: {r:?}",
                String::from_utf8_lossy(name)
            );
        }
    }

    #[test]
    fn non_utf8_names_duplicates_and_files_as_parents_are_refused() {
        for names in [&[&b"caf\xe9"[..]][..], &[b"same", b"same"], &[b"f", b"f/child"]] {
            let mut out = Vec::new();
            for name in names {
                raw_entry(&mut out, name, tar::EntryType::Regular, b"x", None);
            }
            assert!(matches!(validate(&finish(out)), Err(ArchiveError::Invalid(_))), "{names:?}");
        }
    }

    #[test]
    fn garbage_and_truncated_archives_are_invalid() {
        assert!(matches!(validate(&[0x42; 2048]), Err(ArchiveError::Invalid(_))));
        let full = good_tar();
        let cut = &full[..512 + 100];
        assert!(matches!(validate(cut), Err(ArchiveError::Invalid(_))), "{:?}", validate(cut));
        assert!(matches!(validate(&[0x1f, 0x8b, 1, 2, 3]), Err(ArchiveError::Invalid(_))));
    }

    #[test]
    fn too_many_entries_is_too_large() {
        let mut b = tar::Builder::new(Vec::new());
        for i in 0..=ARCHIVE_ENTRIES {
            let mut h = header(tar::EntryType::Directory, 0, 0o755);
            b.append_data(&mut h, format!("d{i}/"), io::empty()).expect("dir");
        }
        let raw = b.into_inner().expect("finish");
        assert!(matches!(validate(&raw), Err(ArchiveError::TooLarge(_))));
    }

    #[test]
    fn too_much_content_and_oversized_input_are_too_large() {
        // A gzip bomb: 300 MiB of zeros in one file compresses to ~300 KiB.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let h = header(tar::EntryType::Regular, 300 << 20, 0o644);
        let mut h = h;
        h.as_gnu_mut().expect("gnu").name[..4].copy_from_slice(b"bomb");
        h.set_cksum();
        gz.write_all(h.as_bytes()).expect("write");
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..300 {
            gz.write_all(&zeros).expect("write");
        }
        let gz = gz.finish().expect("finish");
        assert!(gz.len() < ARCHIVE_CAP);
        assert!(matches!(validate(&gz), Err(ArchiveError::TooLarge(_))));
        let big = vec![0u8; ARCHIVE_CAP + 1];
        assert!(matches!(validate(&big), Err(ArchiveError::TooLarge(_))));
    }

    #[test]
    fn names_are_normalized() {
        assert_eq!(normalize_name(b"./a//b/").expect("ok").as_deref(), Some("a/b"));
        assert_eq!(normalize_name(b"./").expect("ok"), None);
        assert!(normalize_name(b"a/..").is_err());
        assert!(normalize_name(b"/a").is_err());
    }

    #[test]
    fn streamed_files_match_the_plan() {
        let raw = good_tar();
        let plan = validate(&raw).expect("valid");
        let mut got = Vec::new();
        stream_files(&raw, &plan, 2, |i, c| {
            got.push((i, c));
            true
        })
        .expect("stream");
        assert_eq!(got, [(0, b"he".to_vec()), (0, b"ll".to_vec()), (0, b"o".to_vec()), (1, Vec::new())]);
    }

    /// Reads one byte at a time: a stream that arrives in the smallest
    /// pieces parses the same.
    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0.is_empty() || buf.is_empty() {
                return Ok(0);
            }
            buf[0] = self.0[0];
            self.0 = &self.0[1..];
            Ok(1)
        }
    }

    fn events(input: impl Read, limits: &Limits) -> (Result<ArchivePlan, ArchiveError>, Vec<String>) {
        let mut seen = Vec::new();
        let r = validate_stream(input, limits, 3, |ev| {
            seen.push(match ev {
                Event::Dir { path } => format!("dir {path}"),
                Event::File { index, path, mode, size } => format!("file {index} {path} {mode:o} {size}"),
                Event::Data(d) => format!("data {}", String::from_utf8_lossy(d)),
            });
            true
        });
        (r, seen)
    }

    #[test]
    fn a_stream_hands_on_each_checked_entry_once_parents_first() {
        let mut out = Vec::new();
        raw_entry(&mut out, b"a/b/f", tar::EntryType::Regular, b"hello", None);
        raw_entry(&mut out, b"a/", tar::EntryType::Directory, b"", None);
        raw_entry(&mut out, b"a/e", tar::EntryType::Regular, b"", None);
        let tar = finish(out);
        let (plan, seen) = events(Trickle(&tar), &Limits::UPLOAD);
        assert_eq!(
            seen,
            ["dir a", "dir a/b", "file 0 a/b/f 644 5", "data hel", "data lo", "file 1 a/e 644 0"],
            "a directory made implicitly is not handed on again"
        );
        let plan = plan.expect("valid");
        let a = plan.entries.iter().find(|e| e.path == "a").expect("a");
        assert!(!a.implicit, "the archive's own entry for a made directory counts");
        assert_eq!(plan, validate(&tar).expect("valid in memory"));
    }

    #[test]
    fn a_sink_that_stops_ends_the_parse() {
        let mut calls = 0;
        let r = validate_stream(good_tar().as_slice(), &Limits::UPLOAD, 1, |_| {
            calls += 1;
            calls < 2
        });
        assert_eq!(r, Err(ArchiveError::Invalid(STOPPED.into())));
        assert_eq!(calls, 2);
    }

    /// One pax record: its length counts its own digits.
    fn pax(key: &str, value: &str) -> String {
        let body = format!(" {key}={value}\n");
        let mut n = body.len() + 1;
        while n.to_string().len() + body.len() != n {
            n += 1;
        }
        format!("{n}{body}")
    }

    /// A GNU long-name or pax entry of `size` bytes holding `data`.
    fn extension(out: &mut Vec<u8>, kind: u8, size: u64, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::new(kind));
        h.set_size(size);
        h.as_gnu_mut().expect("gnu").name[..13].copy_from_slice(b"././@LongLink");
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    #[test]
    fn long_names_and_pax_headers_name_entries_and_are_bounded_before_they_are_read() {
        // A long name and a pax path both name the next entry.
        let long = "d/".repeat(60) + "f";
        let mut out = Vec::new();
        extension(&mut out, b'L', long.len() as u64 + 1, format!("{long}\0").as_bytes());
        raw_entry(&mut out, b"short", tar::EntryType::Regular, b"x", None);
        let record = pax("path", "p/q");
        extension(&mut out, b'x', record.len() as u64, record.as_bytes());
        raw_entry(&mut out, b"ignored", tar::EntryType::Regular, b"y", None);
        let plan = validate(&finish(out)).expect("valid");
        assert_eq!(plan.files_in_order, [long, "p/q".to_owned()]);
        // Claims too large to read are refused at once, whatever follows
        // (here nothing does: a reader would fail as truncated instead).
        for (kind, size) in [(b'L', 4098), (b'L', 1 << 30), (b'x', (64 << 10) + 1), (b'g', 1 << 30)] {
            let mut out = Vec::new();
            extension(&mut out, kind, size, b"");
            let r = validate(&out);
            assert!(
                matches!(&r, Err(ArchiveError::Invalid(m)) if m.contains("over")),
                "{} of {size}: {r:?}",
                kind as char
            );
        }
        // A long link name, two long names, a pax size other than the
        // header's, and a header that describes nothing are refused.
        let cases: [Vec<(u8, String)>; 4] = [
            vec![(b'K', "target\0".into())],
            vec![(b'L', "a\0".into()), (b'L', "b\0".into())],
            vec![(b'x', pax("size", "99"))],
            vec![(b'x', pax("path", "z"))],
        ];
        for (n, case) in cases.iter().enumerate() {
            let mut out = Vec::new();
            for (kind, data) in case {
                extension(&mut out, *kind, data.len() as u64, data.as_bytes());
            }
            if n < 3 {
                raw_entry(&mut out, b"f", tar::EntryType::Regular, b"x", None);
            }
            let r = validate(&finish(out));
            assert!(matches!(r, Err(ArchiveError::Invalid(_))), "case {n}: {r:?}");
        }
    }

    #[test]
    fn names_and_packed_bytes_are_capped() {
        let small = Limits { name_bytes: 20, ..Limits::UPLOAD };
        let mut out = Vec::new();
        raw_entry(&mut out, b"0123456789/abcdefghij", tar::EntryType::Regular, b"", None);
        assert!(matches!(
            validate_stream(finish(out).as_slice(), &small, 64, |_| true),
            Err(ArchiveError::TooLarge(_))
        ));
        // Empty gzip members inflate to nothing: the input's own cap ends them.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"").expect("gzip");
        let member = gz.finish().expect("gzip");
        let packed = Limits { packed: 64 << 10, ..Limits::UPLOAD };
        let many: Vec<u8> = member.iter().copied().cycle().take(member.len() * 10_000).collect();
        let r = validate_stream(many.as_slice(), &packed, 64, |_| true);
        assert!(matches!(&r, Err(ArchiveError::TooLarge(m)) if m.contains("of archive")), "{r:?}");
    }
}
