//! `hutch files ...`: copy files into and out of a sandbox, list them, and
//! push a whole directory as one tar.gz.

use super::client::ListQuery;
use super::output::{self, table};
use super::{report, ClientOpts};
use clap::{Args, Subcommand};
use std::fs::File;
use std::io::{self, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Most bytes of one archive upload, compressed (the daemon's limit).
pub const ARCHIVE_CAP: usize = 32 << 20;
/// Uploads larger than this show progress on a terminal.
const PROGRESS_OVER: u64 = 8 << 20;

#[derive(Args, Debug)]
pub struct FilesArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    #[command(subcommand)]
    pub command: FilesCommand,
}

#[derive(Subcommand, Debug)]
pub enum FilesCommand {
    /// Upload one file (`-` reads stdin).
    Put { id: String, local: PathBuf, remote: String },
    /// Download one file (to LOCAL, `-` for stdout; the remote name in the
    /// current directory when absent).
    Get { id: String, remote: String, local: Option<PathBuf> },
    /// List a directory (/workspace when absent).
    Ls {
        id: String,
        path: Option<String>,
        /// Descend into subdirectories.
        #[arg(long, short = 'r')]
        recursive: bool,
        /// Show each file's SHA-256.
        #[arg(long)]
        sha256: bool,
        /// Print JSON (a Listing).
        #[arg(long)]
        json: bool,
    },
    /// Upload a directory tree (regular files and directories) as one
    /// tar.gz, unpacked under REMOTE_DIR.
    PushDir { id: String, local_dir: PathBuf, remote_dir: String },
}

pub fn main(args: FilesArgs) -> i32 {
    report(run(args), 1)
}

fn run(args: FilesArgs) -> anyhow::Result<i32> {
    let client = args.conn.client()?;
    match args.command {
        FilesCommand::Put { id, local, remote } => {
            if local.as_os_str() == "-" {
                client.write_file(&id, &remote, io::stdin().lock(), None)?;
                return Ok(0);
            }
            let f = File::open(&local).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", local.display()))?;
            let len = f.metadata().map_err(|e| anyhow::anyhow!("{}: {e}", local.display()))?.len();
            if len > PROGRESS_OVER && io::stderr().is_terminal() {
                let mut p = Progress::new(f, len, io::stderr());
                let res = client.write_file(&id, &remote, &mut p, Some(len));
                p.done(res.is_ok());
                res?;
            } else {
                client.write_file(&id, &remote, f, Some(len))?;
            }
            Ok(0)
        }
        FilesCommand::Get { id, remote, local } => {
            let local = match local {
                Some(l) => l,
                None => PathBuf::from(remote_name(&remote)?),
            };
            let body = client.read_file(&id, &remote)?;
            let mut reader = body.into_reader();
            if local.as_os_str() == "-" {
                let mut out = io::stdout().lock();
                io::copy(&mut reader, &mut out).map_err(|e| anyhow::anyhow!("copying {remote}: {e}"))?;
                out.flush()?;
            } else {
                save(&mut reader, &local).map_err(|e| anyhow::anyhow!("writing {}: {e}", local.display()))?;
            }
            Ok(0)
        }
        FilesCommand::Ls { id, path, recursive, sha256, json } => {
            let mut q = ListQuery { path, recursive, include_sha256: sha256, ..ListQuery::default() };
            let mut listing = client.list_files(&id, &q)?;
            while let Some(c) = listing.next_cursor.take() {
                q.cursor = Some(c);
                let more = client.list_files(&id, &q)?;
                listing.entries.extend(more.entries);
                listing.next_cursor = more.next_cursor;
            }
            if json {
                print!("{}", output::json(&listing)?);
            } else {
                print!("{}", listing_table(&listing.entries, sha256));
            }
            Ok(0)
        }
        FilesCommand::PushDir { id, local_dir, remote_dir } => {
            let mut warn = |m: &str| eprintln!("hutch: warning: {m}");
            let archive = tar_gz_dir(&local_dir, ARCHIVE_CAP, &mut warn)?;
            eprintln!(
                "packed {} file(s) and {} directory(ies) into {:.1} KiB",
                archive.files,
                archive.dirs,
                archive.bytes.len() as f64 / 1024.0
            );
            let res = client.upload_archive(&id, &remote_dir, &archive.bytes)?;
            println!("{} files, {} bytes into {}", res.files, res.bytes, res.path);
            Ok(0)
        }
    }
}

/// The last component of a remote path, as a local file name.
fn remote_name(remote: &str) -> anyhow::Result<String> {
    match remote.trim_end_matches('/').rsplit('/').next() {
        Some(n) if !n.is_empty() && n != "." && n != ".." => Ok(n.to_owned()),
        _ => anyhow::bail!("cannot name a local file after {remote:?}: give LOCAL (or - for stdout)"),
    }
}

/// Writes a download next to `dest` and renames it into place, so that a
/// failed download leaves no partial file behind.
pub(crate) fn save(reader: &mut dyn Read, dest: &Path) -> io::Result<u64> {
    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.hutch-{}", std::process::id()));
    let res = (|| {
        let mut f = File::create(&tmp)?;
        let n = io::copy(reader, &mut f)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dest)?;
        Ok(n)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Columns of `files ls`.
pub fn listing_table(entries: &[hutch_api::ListEntry], sha256: bool) -> String {
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            let mut row = vec![
                format!("{}{}", kind_char(&e.kind), mode_string(e.mode)),
                e.size.to_string(),
                if e.kind == "directory" { format!("{}/", e.path) } else { e.path.clone() },
            ];
            if e.unreadable {
                row[2].push_str("  (unreadable)");
            }
            if sha256 {
                let digest = match (&e.sha256, &e.sha256_skipped) {
                    (Some(d), _) => d.clone(),
                    (None, Some(why)) => format!("({why})"),
                    (None, None) => "-".to_owned(),
                };
                row.insert(2, digest);
            }
            row
        })
        .collect();
    let headers: &[&str] = if sha256 { &["MODE", "SIZE", "SHA256", "PATH"] } else { &["MODE", "SIZE", "PATH"] };
    table(headers, &rows)
}

fn kind_char(kind: &str) -> char {
    match kind {
        "file" => '-',
        "directory" => 'd',
        "symlink" => 'l',
        _ => '?',
    }
}

/// `rwxr-xr-x` of the permission bits.
fn mode_string(mode: u32) -> String {
    let mut s = String::with_capacity(9);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// A directory tree packed as tar.gz.
#[derive(Debug)]
pub struct Archive {
    pub bytes: Vec<u8>,
    pub files: u64,
    pub dirs: u64,
}

/// Packs `dir`'s regular files and directories (names relative to `dir`)
/// into a tar.gz in memory. Symlinks and special files are skipped with a
/// warning; more than `cap` compressed bytes is refused as soon as it is
/// reached. Owners are not recorded; modes keep only the executable bit.
pub fn tar_gz_dir(dir: &Path, cap: usize, warn: &mut dyn FnMut(&str)) -> anyhow::Result<Archive> {
    use flate2::write::GzEncoder;
    let meta = std::fs::metadata(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    if !meta.is_dir() {
        anyhow::bail!("{} is not a directory (use `hutch files put` for one file)", dir.display());
    }
    let gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    let (mut files, mut dirs) = (0u64, 0u64);
    let too_big = |dir: &Path| {
        anyhow::anyhow!(
            "{} packs to more than {} MiB compressed, the limit of one upload; push its subdirectories \
             separately, or large files with `hutch files put`",
            dir.display(),
            cap >> 20
        )
    };
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        let mut children: Vec<_> = std::fs::read_dir(&abs)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", abs.display()))?
            .collect::<io::Result<Vec<_>>>()
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", abs.display()))?;
        children.sort_by_key(|c| c.file_name());
        // Subdirectories go on the stack in reverse so they pop in order.
        let mut subdirs = Vec::new();
        for child in children {
            let name = rel.join(child.file_name());
            let path = child.path();
            let m = std::fs::symlink_metadata(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let ft = m.file_type();
            let mut header = tar::Header::new_gnu();
            header.set_metadata_in_mode(&m, tar::HeaderMode::Deterministic);
            if let Ok(t) = m.modified() {
                if let Ok(d) = t.duration_since(std::time::UNIX_EPOCH) {
                    header.set_mtime(d.as_secs());
                }
            }
            if ft.is_dir() {
                header.set_size(0);
                tar.append_data(&mut header, &name, io::empty())
                    .map_err(|e| anyhow::anyhow!("packing {}: {e}", path.display()))?;
                dirs += 1;
                subdirs.push(name);
            } else if ft.is_file() {
                let f = File::open(&path).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
                // The header holds the size seen now; a file that shrinks
                // while it is packed fails, one that grows is cut there.
                let exact = Exact { inner: f.take(m.len()), left: m.len() };
                tar.append_data(&mut header, &name, exact)
                    .map_err(|e| anyhow::anyhow!("packing {}: {e}", path.display()))?;
                files += 1;
            } else if ft.is_symlink() {
                warn(&format!("skipping symlink {}", path.display()));
                continue;
            } else {
                warn(&format!("skipping {} (not a regular file or directory)", path.display()));
                continue;
            }
            if tar.get_ref().get_ref().len() > cap {
                return Err(too_big(dir));
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
    let gz = tar.into_inner().map_err(|e| anyhow::anyhow!("packing {}: {e}", dir.display()))?;
    let bytes = gz.finish().map_err(|e| anyhow::anyhow!("packing {}: {e}", dir.display()))?;
    if bytes.len() > cap {
        return Err(too_big(dir));
    }
    Ok(Archive { bytes, files, dirs })
}

/// Exactly `left` bytes of a file, or an error if it ends sooner.
struct Exact<R: Read> {
    inner: io::Take<R>,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.left > 0 && !buf.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file shrank while it was packed"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// A reader that draws `sent / total  rate` on a terminal as it is read.
struct Progress<R: Read, W: Write> {
    inner: R,
    out: W,
    total: u64,
    sent: u64,
    start: Instant,
    last: Option<Instant>,
}

impl<R: Read, W: Write> Progress<R, W> {
    fn new(inner: R, total: u64, out: W) -> Self {
        Progress { inner, out, total, sent: 0, start: Instant::now(), last: None }
    }

    fn draw(&mut self) {
        let secs = self.start.elapsed().as_secs_f64().max(0.001);
        let line = progress_line(self.sent, self.total, self.sent as f64 / secs);
        let _ = write!(self.out, "\r{line}\x1b[K");
        let _ = self.out.flush();
    }

    /// Draws the final figures and ends the line (or clears it on failure).
    fn done(&mut self, ok: bool) {
        if ok {
            self.draw();
            let _ = writeln!(self.out);
        } else {
            let _ = write!(self.out, "\r\x1b[K");
            let _ = self.out.flush();
        }
    }
}

impl<R: Read, W: Write> Read for Progress<R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.sent += n as u64;
        if self.last.is_none_or(|t| t.elapsed() >= Duration::from_millis(200)) {
            self.last = Some(Instant::now());
            self.draw();
        }
        Ok(n)
    }
}

/// `12.0 MiB / 100.0 MiB  34.5 MiB/s`.
fn progress_line(sent: u64, total: u64, rate: f64) -> String {
    let mib = |b: f64| b / f64::from(1u32 << 20);
    let pct = sent.saturating_mul(100).checked_div(total).unwrap_or(100);
    format!("{:.1} MiB / {:.1} MiB ({pct}%)  {:.1} MiB/s", mib(sent as f64), mib(total as f64), mib(rate))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hutch-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    fn unpack(bytes: &[u8]) -> Vec<(String, tar::EntryType, Vec<u8>, u32)> {
        let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
        let mut out = Vec::new();
        for e in ar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let name = e.path().expect("path").to_string_lossy().into_owned();
            let kind = e.header().entry_type();
            let mode = e.header().mode().expect("mode");
            let mut data = Vec::new();
            e.read_to_end(&mut data).expect("read");
            out.push((name, kind, data, mode));
        }
        out
    }

    #[test]
    fn tar_gz_round_trips_files_and_dirs_and_skips_symlinks() {
        use std::os::unix::fs::PermissionsExt;
        let d = temp_dir("tar");
        std::fs::create_dir_all(d.join("src/deep")).expect("mkdir");
        std::fs::write(d.join("a.txt"), b"alpha").expect("write");
        std::fs::write(d.join("src/deep/b.bin"), [0u8, 1, 2, 255]).expect("write");
        std::fs::write(d.join("run.sh"), b"#!/bin/sh\n").expect("write");
        std::fs::set_permissions(d.join("run.sh"), std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::os::unix::fs::symlink("/etc/passwd", d.join("escape")).expect("symlink");
        let mut warnings = Vec::new();
        let ar = tar_gz_dir(&d, ARCHIVE_CAP, &mut |m: &str| warnings.push(m.to_owned())).expect("pack");
        assert_eq!((ar.files, ar.dirs), (3, 2));
        let entries = unpack(&ar.bytes);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["a.txt", "run.sh", "src", "src/deep", "src/deep/b.bin"]);
        assert_eq!(entries[0].2, b"alpha");
        assert_eq!(entries[4].2, [0u8, 1, 2, 255]);
        assert_eq!(entries[2].1, tar::EntryType::Directory);
        assert!(entries.iter().all(|e| e.1 != tar::EntryType::Symlink));
        assert_eq!(entries[1].3 & 0o111, 0o111, "the executable bit survives");
        assert_eq!(entries[0].3 & 0o111, 0);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("symlink") && warnings[0].contains("escape"));
        std::fs::remove_dir_all(&d).expect("cleanup");
    }

    #[test]
    fn tar_gz_over_the_cap_is_refused_with_advice() {
        let d = temp_dir("cap");
        // Random bytes do not compress.
        let mut noise = vec![0u8; 64 << 10];
        hutch_runtime::sys::random_bytes(&mut noise).expect("random");
        std::fs::write(d.join("noise"), &noise).expect("write");
        let e = tar_gz_dir(&d, 16 << 10, &mut |_: &str| {}).expect_err("too big");
        assert!(e.to_string().contains("separately"), "{e}");
        assert!(tar_gz_dir(&d.join("noise"), ARCHIVE_CAP, &mut |_: &str| {}).is_err());
        std::fs::remove_dir_all(&d).expect("cleanup");
    }

    #[test]
    fn save_leaves_no_partial_file_on_failure() {
        struct Failing;
        impl Read for Failing {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::other("connection reset"))
            }
        }
        let d = temp_dir("save");
        let dest = d.join("out.txt");
        assert_eq!(save(&mut Cursor::new(b"hello".to_vec()), &dest).expect("save"), 5);
        assert_eq!(std::fs::read(&dest).expect("read"), b"hello");
        assert!(save(&mut Failing, &d.join("bad.txt")).is_err());
        let left: Vec<_> = std::fs::read_dir(&d).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from("out.txt")]);
        std::fs::remove_dir_all(&d).expect("cleanup");
    }

    #[test]
    fn remote_names_and_listing_rows() {
        assert_eq!(remote_name("/workspace/out/report.csv").expect("name"), "report.csv");
        assert_eq!(remote_name("/workspace/dir/").expect("name"), "dir");
        assert!(remote_name("/").is_err());
        let entries = vec![
            hutch_api::ListEntry {
                path: "src".into(),
                kind: "directory".into(),
                size: 4096,
                mode: 0o755,
                sha256: None,
                sha256_skipped: None,
                unreadable: false,
            },
            hutch_api::ListEntry {
                path: "src/main.rs".into(),
                kind: "file".into(),
                size: 12,
                mode: 0o644,
                sha256: Some("ab12".into()),
                sha256_skipped: None,
                unreadable: false,
            },
        ];
        assert_eq!(
            listing_table(&entries, false),
            "MODE        SIZE  PATH\ndrwxr-xr-x  4096  src/\n-rw-r--r--  12    src/main.rs\n"
        );
        let t = listing_table(&entries, true);
        assert!(t.contains("4096  -       src/\n") && t.contains("12    ab12    src/main.rs\n"), "{t}");
    }

    #[test]
    fn progress_counts_bytes_and_prints_rate() {
        let mut sink = Vec::new();
        let mut p = Progress::new(Cursor::new(vec![7u8; 3 << 20]), 3 << 20, &mut sink);
        let mut buf = Vec::new();
        p.read_to_end(&mut buf).expect("read");
        assert_eq!(p.sent, 3 << 20);
        p.done(true);
        let shown = String::from_utf8_lossy(&sink).into_owned();
        assert!(shown.contains("3.0 MiB / 3.0 MiB (100%)"), "{shown}");
        assert!(shown.ends_with('\n'));
        assert_eq!(progress_line(1 << 20, 4 << 20, 2.0 * f64::from(1u32 << 20)), "1.0 MiB / 4.0 MiB (25%)  2.0 MiB/s");
    }
}
