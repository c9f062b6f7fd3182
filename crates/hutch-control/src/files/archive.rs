//! Validation of an uploaded tar archive, done in full before a sandbox is
//! touched: only regular files and directories with normalized UTF-8 names,
//! bounded in size and count. Pure code over bytes, so that hostile archives
//! are tested (and can be fuzzed) without a sandbox.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hutch_agent::proto::{cmp_paths, MAX_PATH};

/// Most bytes of archive accepted, compressed or not.
pub const ARCHIVE_CAP: usize = 32 << 20;
/// Most entries (files and directories) in one archive.
pub const ARCHIVE_ENTRIES: usize = 10_000;
/// Most bytes of file content in one archive.
pub const ARCHIVE_UNPACKED_CAP: u64 = 256 << 20;
/// Most bytes the decompressed tar stream may hold: the file content plus
/// room for headers, long names and padding of every entry.
const STREAM_CAP: u64 = ARCHIVE_UNPACKED_CAP + (ARCHIVE_ENTRIES as u64 + 16) * 4096;
/// Longest name of one path element.
const MAX_NAME: usize = 255;

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

/// Whether `bytes` start with the gzip magic.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

/// A reader that fails once more than `cap` bytes went through it, and
/// records that it did (so a bomb reads as "too large", not "malformed").
struct Capped<R> {
    inner: R,
    left: u64,
    hit: Arc<AtomicBool>,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more tells a stream that ends here from one that goes on.
            let mut probe = [0u8; 1];
            if self.inner.read(&mut probe)? == 0 {
                return Ok(0);
            }
            self.hit.store(true, Ordering::Relaxed);
            return Err(io::Error::other("decompressed archive exceeds its limit"));
        }
        let want = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// The decompressed tar stream of `bytes`, capped.
fn open(bytes: &[u8], hit: Arc<AtomicBool>) -> Box<dyn Read + '_> {
    if is_gzip(bytes) {
        Box::new(Capped { inner: flate2::read::MultiGzDecoder::new(bytes), left: STREAM_CAP, hit })
    } else {
        Box::new(Capped { inner: bytes, left: STREAM_CAP, hit })
    }
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

fn malformed(hit: &AtomicBool, what: &str, e: io::Error) -> ArchiveError {
    if hit.load(Ordering::Relaxed) {
        ArchiveError::TooLarge(format!("more than {ARCHIVE_UNPACKED_CAP} bytes uncompressed"))
    } else {
        ArchiveError::Invalid(format!("{what}: {e}"))
    }
}

/// Parses and checks the whole archive; nothing is written anywhere.
pub fn validate(bytes: &[u8]) -> Result<ArchivePlan, ArchiveError> {
    if bytes.len() > ARCHIVE_CAP {
        return Err(ArchiveError::TooLarge(format!("{} bytes of archive exceed {ARCHIVE_CAP}", bytes.len())));
    }
    let hit = Arc::new(AtomicBool::new(false));
    let mut archive = tar::Archive::new(open(bytes, hit.clone()));
    let mut seen: BTreeMap<String, PlannedEntry> = BTreeMap::new();
    let mut files_in_order = Vec::new();
    let mut count = 0usize;
    let mut total = 0u64;
    let entries = archive.entries().map_err(|e| malformed(&hit, "unreadable archive", e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| malformed(&hit, "malformed archive", e))?;
        count += 1;
        if count > ARCHIVE_ENTRIES {
            return Err(ArchiveError::TooLarge(format!("more than {ARCHIVE_ENTRIES} entries")));
        }
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::XGlobalHeader {
            // Global attributes (git archive puts the commit id there): ignored.
            continue;
        }
        let raw = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        if let Some(pax) = entry.pax_extensions().map_err(|e| malformed(&hit, "malformed pax header", e))? {
            for ext in pax {
                let ext = ext.map_err(|e| malformed(&hit, "malformed pax header", e))?;
                if ext.key_bytes().starts_with(b"GNU.sparse") {
                    return Err(ArchiveError::Invalid(format!("entry {shown:?} is a sparse file")));
                }
            }
        }
        let planned = match kind {
            tar::EntryType::Regular => {
                let size = entry.size();
                total = total.saturating_add(size);
                if total > ARCHIVE_UNPACKED_CAP {
                    return Err(ArchiveError::TooLarge(format!("more than {ARCHIVE_UNPACKED_CAP} bytes uncompressed")));
                }
                let got = io::copy(&mut entry, &mut io::sink()).map_err(|e| malformed(&hit, "truncated archive", e))?;
                if got != size {
                    return Err(ArchiveError::Invalid(format!("entry {shown:?} is truncated")));
                }
                PlannedKind::File(size)
            }
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
        let Some(path) = normalize_name(&raw)? else {
            if planned == PlannedKind::Dir {
                continue;
            }
            return Err(ArchiveError::Invalid(format!("entry {shown:?} names the target directory itself")));
        };
        let mode = entry.header().mode().map_err(|e| malformed(&hit, "malformed mode", e))? & 0o777;
        if seen.contains_key(&path) {
            return Err(ArchiveError::Invalid(format!("entry {path:?} appears twice")));
        }
        if let PlannedKind::File(_) = planned {
            files_in_order.push(path.clone());
        }
        seen.insert(path.clone(), PlannedEntry { path, kind: planned, mode, implicit: false });
    }
    // Every parent must be a directory: add the ones the archive left out,
    // refuse a file that another entry would sit below.
    let names: Vec<String> = seen.keys().cloned().collect();
    for path in names {
        let mut prefix = path.as_str();
        while let Some((parent, _)) = prefix.rsplit_once('/') {
            match seen.get(parent) {
                Some(PlannedEntry { kind: PlannedKind::File(_), .. }) => {
                    return Err(ArchiveError::Invalid(format!("entry {path:?} lies below the file {parent:?}")))
                }
                Some(_) => {}
                None => {
                    let dir =
                        PlannedEntry { path: parent.to_string(), kind: PlannedKind::Dir, mode: 0o755, implicit: true };
                    seen.insert(parent.to_string(), dir);
                }
            }
            prefix = parent;
        }
    }
    if seen.len() > ARCHIVE_ENTRIES {
        return Err(ArchiveError::TooLarge(format!("more than {ARCHIVE_ENTRIES} entries")));
    }
    let mut entries: Vec<PlannedEntry> = seen.into_values().collect();
    entries.sort_by(|a, b| cmp_paths(&a.path, &b.path));
    let files = files_in_order.len() as u64;
    Ok(ArchivePlan { entries, files_in_order, files, bytes: total })
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
    let hit = Arc::new(AtomicBool::new(false));
    let mut archive = tar::Archive::new(open(bytes, hit.clone()));
    let entries = archive.entries().map_err(|e| malformed(&hit, "unreadable archive", e))?;
    let mut index = 0;
    for entry in entries {
        let mut entry = entry.map_err(|e| malformed(&hit, "malformed archive", e))?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let path = normalize_name(&entry.path_bytes())?;
        if path.as_ref() != plan.files_in_order.get(index) {
            return Err(ArchiveError::Invalid("archive changed between validation and extraction".into()));
        }
        let mut first = true;
        loop {
            let mut buf = Vec::with_capacity(chunk);
            let n =
                (&mut entry).take(chunk as u64).read_to_end(&mut buf).map_err(|e| malformed(&hit, "truncated", e))?;
            if n == 0 && !first {
                break;
            }
            first = false;
            if !send(index, buf) {
                return Ok(());
            }
            if n < chunk {
                break;
            }
        }
        index += 1;
    }
    Ok(())
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
}
