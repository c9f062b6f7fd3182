//! File transfers against a real sandbox: round trips, caps, a full disk,
//! paged listings with digests, archives in and out (hostile ones change
//! nothing), files in parts, and symlinks planted by the workload that no
//! write follows. Runs as root (CI does) after `cargo build --workspace`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use hutch_agent::proto::{Cmd, FromAgent, Reply, Request, Spawn, Stream};
use hutch_api::{ErrorCode, FilePart, Listing, FILE_DATA_CAP};
use hutch_control::files::{FilesError, ListOptions, SandboxFs};
use hutch_runtime::agent_async::AsyncConn;
use hutch_runtime::{Config, Runtime, Sandbox, SandboxSpec};
use sha2::{Digest, Sha256};

/// The agent cargo built beside this test's deps directory.
fn agent() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("target dir").join("hutch-agent")
}

/// One test's sandbox and directories; destroyed and removed on drop, even
/// when the test panics.
struct TestSandbox {
    sb: Option<Sandbox>,
    _rt: Runtime,
    base: PathBuf,
}

impl Drop for TestSandbox {
    fn drop(&mut self) {
        if let Some(sb) = self.sb.take() {
            let _ = sb.destroy();
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

impl TestSandbox {
    fn start(name: &str, disk_bytes: u64) -> TestSandbox {
        assert_eq!(
            // SAFETY: geteuid has no preconditions.
            unsafe { libc::geteuid() },
            0,
            "these tests start real sandboxes: run them as root (CI does)"
        );
        assert!(
            agent().is_file(),
            "hutch-agent not built at {}: run `cargo build --workspace` first",
            agent().display()
        );
        let base = std::env::temp_dir().join(format!("hutch-ctl-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("state")).expect("mkdir state");
        let cfg =
            Config { state_dir: base.join("state"), run_dir: base.join("run"), agent: agent(), ..Config::from_env() };
        let rt = Runtime::new(cfg).expect("runtime");
        let spec = SandboxSpec { disk_bytes, ..SandboxSpec::default() };
        let sb = rt.start(&spec).expect("start sandbox");
        TestSandbox { sb: Some(sb), _rt: rt, base }
    }

    fn socket(&self) -> &Path {
        &self.sb.as_ref().expect("live sandbox").socket
    }

    /// As the daemon makes them for a disk layer: streamed writes through
    /// a descriptor the agent passes (reads always try one).
    fn fs(&self) -> SandboxFs {
        SandboxFs::new(self.socket().to_path_buf(), None).passing_writes(true)
    }

    /// As for a memory layer: streamed writes through the agent's frames.
    fn copying_fs(&self) -> SandboxFs {
        SandboxFs::new(self.socket().to_path_buf(), None)
    }

    fn root_fs(&self) -> SandboxFs {
        SandboxFs::new(self.socket().to_path_buf(), Some("root".into()))
    }

    /// Runs a shell command in /workspace; returns stdout, asserting exit 0.
    async fn sh(&self, cmd: &str, user: &str) -> String {
        let mut c = AsyncConn::connect(self.socket()).await.expect("connect");
        let spawn = Spawn {
            cmd: Cmd::Shell(cmd.into()),
            env: vec![],
            cwd: None,
            user: Some(user.into()),
            stdin: false,
            pty: None,
            tag: None,
            timeout_ms: Some(60_000),
            subscribe: true,
            output_limit: None,
        };
        let (reply, _) = c.call(Request::Spawn(spawn), &[]).await.expect("spawn");
        let Reply::Spawned { pid } = reply else { panic!("unexpected {reply:?}") };
        let mut out = Vec::new();
        let mut err = Vec::new();
        loop {
            let (msg, data) =
                tokio::time::timeout(Duration::from_secs(60), c.recv()).await.expect("timely").expect("recv");
            match msg {
                FromAgent::Output { pid: p, stream: Stream::Stdout } if p == pid => out.extend(data),
                FromAgent::Output { pid: p, stream: Stream::Stderr } if p == pid => err.extend(data),
                FromAgent::Exit { pid: p, status } if p == pid => {
                    assert_eq!(status.code, Some(0), "{cmd}: {}", String::from_utf8_lossy(&err));
                    return String::from_utf8_lossy(&out).into_owned();
                }
                _ => {}
            }
        }
    }
}

fn sha_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn code<T: std::fmt::Debug>(r: Result<T, hutch_control::files::FilesError>) -> ErrorCode {
    match r {
        Err(e) => e.code,
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// Every page of a listing.
async fn list_all(fs: &SandboxFs, path: &str, limit: u32, sha: bool) -> (Vec<hutch_api::ListEntry>, usize) {
    let mut all = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let opts = ListOptions { recursive: true, include_sha256: sha, limit, cursor };
        let Listing { entries, next_cursor } = fs.list(path, opts).await.expect("list");
        assert!(entries.len() <= limit as usize);
        pages += 1;
        all.extend(entries);
        match next_cursor {
            Some(c) => cursor = Some(c),
            None => return (all, pages),
        }
    }
}

#[tokio::test]
async fn write_read_round_trip_and_the_8_mib_cap() {
    let t = TestSandbox::start("rw", 1 << 30);
    let fs = t.fs();
    fs.write("hello.txt", b"hello\n").await.expect("write");
    assert_eq!(fs.read("/workspace/hello.txt").await.expect("read"), b"hello\n");
    assert_eq!(t.sh("stat -c '%a %U' hello.txt", "user").await.trim(), "600 user");
    fs.write("hello.txt", b"again").await.expect("overwrite");
    assert_eq!(fs.read("hello.txt").await.expect("read"), b"again");

    let full = vec![7u8; FILE_DATA_CAP];
    fs.write("full.bin", &full).await.expect("8 MiB write");
    assert_eq!(fs.read("full.bin").await.expect("8 MiB read"), full);
    assert_eq!(code(fs.write("over.bin", &vec![0u8; FILE_DATA_CAP + 1]).await), ErrorCode::PayloadTooLarge);
    t.sh("head -c 9437184 /dev/zero > big.bin", "user").await;
    assert_eq!(code(fs.read("big.bin").await), ErrorCode::PayloadTooLarge);

    assert_eq!(code(fs.read("missing").await), ErrorCode::NotFound);
    assert_eq!(code(fs.read("/workspace").await), ErrorCode::InvalidRequest);
    assert_eq!(code(fs.write("no/such/dir/f", b"x").await), ErrorCode::NotFound);
    assert_eq!(code(fs.write("../etc/x", b"x").await), ErrorCode::InvalidPath);
    assert_eq!(code(fs.write("", b"x").await), ErrorCode::InvalidPath);
    // The user cannot write into a root-owned directory.
    assert_eq!(code(fs.write("/etc/x", b"x").await), ErrorCode::SandboxPathConflict);
    // A directory is in the way.
    t.sh("mkdir adir", "user").await;
    assert_eq!(code(fs.write("adir", b"x").await), ErrorCode::SandboxPathConflict);
    let left = t.sh("ls -A /workspace", "user").await;
    assert!(!left.contains(".hutch-upload-"), "a temporary was left: {left}");

    // Streams: 10 MiB up in odd chunks, and down again.
    let data: Vec<u8> = (0..10 << 20).map(|i: u32| (i % 251) as u8).collect();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let chunks: Vec<Vec<u8>> = data.chunks(3_000_000).map(<[u8]>::to_vec).collect();
    let feeder = tokio::spawn(async move {
        for c in chunks {
            tx.send(Ok(c)).await.expect("send");
        }
    });
    assert_eq!(fs.write_stream("stream.bin", rx).await.expect("write_stream"), data.len() as u64);
    feeder.await.expect("feeder");
    let mut rx = fs.read_stream("stream.bin").await.expect("read_stream");
    let mut got = Vec::new();
    while let Some(chunk) = rx.recv().await {
        let chunk = chunk.expect("chunk");
        assert!(chunk.len() <= 1 << 20);
        got.extend(chunk);
    }
    assert_eq!(sha_hex(&got), sha_hex(&data));
    assert_eq!(code(fs.read_stream("missing").await), ErrorCode::NotFound);
    assert_eq!(code(fs.read_stream("adir").await), ErrorCode::InvalidRequest);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    drop(tx);
    assert_eq!(fs.write_stream("empty.bin", rx).await.expect("empty"), 0);
    assert_eq!(fs.read("empty.bin").await.expect("read"), b"");

    // A stream that breaks (a client that went away) leaves nothing, not
    // even over an existing file.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(Ok(vec![7u8; 3 << 20])).await.expect("send");
    tx.send(Err(FilesError::new(ErrorCode::InvalidRequest, "request body: connection reset"))).await.expect("send");
    drop(tx);
    assert_eq!(code(fs.write_stream("stream.bin", rx).await), ErrorCode::InvalidRequest);
    let mut rx = fs.read_stream("stream.bin").await.expect("read_stream");
    let mut kept = Vec::new();
    while let Some(chunk) = rx.recv().await {
        kept.extend(chunk.expect("chunk"));
    }
    assert_eq!(sha_hex(&kept), sha_hex(&data), "a broken stream replaced the file");
    let left = t.sh("ls -A /workspace", "user").await;
    assert!(!left.contains(".hutch-upload-"), "a temporary was left: {left}");
}

#[tokio::test]
async fn a_full_disk_answers_sandbox_disk_full_and_leaves_no_temporary() {
    let t = TestSandbox::start("full", 32 << 20);
    let fs = t.fs();
    let chunk = vec![1u8; FILE_DATA_CAP];
    let mut full = None;
    for i in 0..8 {
        if let Err(e) = fs.write(&format!("f{i}"), &chunk).await {
            full = Some(e);
            break;
        }
    }
    let e = full.expect("a 32 MiB disk filled up");
    assert_eq!(e.code, ErrorCode::SandboxDiskFull, "{e:?}");
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let feeder = tokio::spawn(async move {
        for _ in 0..40 {
            if tx.send(Ok(vec![2u8; 1 << 20])).await.is_err() {
                return;
            }
        }
    });
    assert_eq!(code(fs.write_stream("huge", rx).await), ErrorCode::SandboxDiskFull);
    feeder.await.expect("feeder");
    let left = t.sh("ls -A /workspace", "user").await;
    assert!(!left.contains(".hutch-upload-"), "a temporary was left: {left}");
}

#[tokio::test]
async fn listings_page_with_cursors_and_digests() {
    let t = TestSandbox::start("list", 1 << 30);
    let fs = t.fs();
    t.sh(
        "mkdir -p tree/many tree/a/b tree/secret && for i in $(seq 1 550); do echo $i > tree/many/f$i; done && \
         echo top > tree/a.txt && echo deep > tree/a/b/c && touch tree/secret/hidden && chmod 000 tree/secret && \
         ln -s /etc tree/link && mkfifo tree/fifo && chmod 4755 tree/a.txt",
        "user",
    )
    .await;
    t.sh("echo root > /workspace/tree/rootonly && chmod 600 /workspace/tree/rootonly", "root").await;

    let (all, pages) = list_all(&fs, "tree", 200, true).await;
    assert!(pages >= 3, "550 files in pages of 200 took {pages} pages");
    let paths: Vec<&str> = all.iter().map(|e| e.path.as_str()).collect();
    let mut sorted = paths.clone();
    sorted.sort_by(|a, b| hutch_agent::proto::cmp_paths(a, b));
    assert_eq!(paths, sorted, "entries are in path order");
    let mut dedup = paths.clone();
    dedup.dedup();
    assert_eq!(dedup.len(), paths.len(), "no entry twice across pages");
    assert_eq!(&paths[..5], ["a", "a/b", "a/b/c", "a.txt", "fifo"]);
    assert_eq!(all.len(), 3 + 1 + 1 + 1 + 550 + 1 + 1 + 1, "{paths:?}");
    let get = |p: &str| all.iter().find(|e| e.path == p).unwrap_or_else(|| panic!("{p} listed"));
    assert_eq!(get("a.txt").sha256.as_deref(), Some(sha_hex(b"top\n").as_str()));
    assert_eq!(get("a.txt").mode, 0o4755);
    assert_eq!(get("a.txt").size, 4);
    assert_eq!(get("many/f17").sha256.as_deref(), Some(sha_hex(b"17\n").as_str()));
    assert_eq!(get("a").kind, "directory");
    assert_eq!(get("a").size, 0);
    assert_eq!(get("link").kind, "symlink");
    assert_eq!(get("fifo").kind, "other");
    assert!(get("secret").unreadable);
    assert!(!paths.contains(&"secret/hidden"), "an unreadable directory is not entered");
    assert_eq!(get("rootonly").sha256_skipped.as_deref(), Some("unreadable"));
    assert!(!paths.iter().any(|p| p.starts_with("link/")), "a symlink is never followed");

    // Without digests, one page; non-recursive lists direct entries only.
    let (plain, pages) = list_all(&fs, "/workspace/tree", 10_000, false).await;
    assert_eq!(pages, 1);
    assert_eq!(plain.len(), all.len());
    let opts = ListOptions { recursive: false, ..ListOptions::default() };
    let top = fs.list("tree", opts).await.expect("list");
    assert!(top.entries.iter().all(|e| !e.path.contains('/')));
    assert_eq!(top.entries.len(), 7, "a a.txt fifo link many rootonly secret");

    // A cursor is only good for its own listing.
    let first = fs.list("tree", ListOptions { limit: 5, ..ListOptions::default() }).await.expect("page");
    let cursor = first.next_cursor.expect("more pages");
    let other = ListOptions { cursor: Some(cursor.clone()), ..ListOptions::default() };
    assert_eq!(code(fs.list("tree/many", other).await), ErrorCode::InvalidRequest);
    let flat = ListOptions { cursor: Some(cursor), recursive: false, ..ListOptions::default() };
    assert_eq!(code(fs.list("tree", flat).await), ErrorCode::InvalidRequest);
    let zero = ListOptions { limit: 0, ..ListOptions::default() };
    assert_eq!(code(fs.list("tree", zero).await), ErrorCode::InvalidRequest);

    assert_eq!(code(fs.list("tree/a.txt", ListOptions::default()).await), ErrorCode::SandboxPathNotDirectory);
    assert_eq!(code(fs.list("tree/link", ListOptions::default()).await), ErrorCode::SandboxPathNotDirectory);
    assert_eq!(code(fs.list("tree/secret", ListOptions::default()).await), ErrorCode::SandboxPathUnreadable);
    assert_eq!(code(fs.list("tree/none", ListOptions::default()).await), ErrorCode::SandboxPathNotDirectory);
    // Root lists what the user cannot.
    let (as_root, _) = list_all(&t.root_fs(), "tree", 10_000, true).await;
    assert!(as_root.iter().any(|e| e.path == "secret/hidden"));
}

fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h
}

fn project_tar(gzip: bool) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_data(&mut header(tar::EntryType::Directory, 0, 0o755), "./", std::io::empty()).expect("dir");
    b.append_data(&mut header(tar::EntryType::Directory, 0, 0o700), "./src/", std::io::empty()).expect("dir");
    b.append_data(&mut header(tar::EntryType::Regular, 11, 0o4755), "./src/run.sh", &b"echo hello\n"[..]).expect("f");
    b.append_data(&mut header(tar::EntryType::Regular, 6, 0o444), "README", &b"readme"[..]).expect("f");
    let big: Vec<u8> = (0..5 << 20).map(|i: u32| (i % 253) as u8).collect();
    b.append_data(&mut header(tar::EntryType::Regular, big.len() as u64, 0o400), "data/big.bin", big.as_slice())
        .expect("f");
    b.append_data(&mut header(tar::EntryType::Directory, 0, 0o555), "ro/", std::io::empty()).expect("dir");
    b.append_data(&mut header(tar::EntryType::Regular, 2, 0o644), "ro/x", &b"x\n"[..]).expect("f");
    let raw = b.into_inner().expect("tar");
    if !gzip {
        return raw;
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &raw).expect("gzip");
    gz.finish().expect("gzip")
}

/// Writes a raw header name, as a hostile client would (the builder refuses
/// `..` and absolute names).
fn raw_entry(out: &mut Vec<u8>, name: &[u8], kind: tar::EntryType, data: &[u8], link: &[u8]) {
    let mut h = header(kind, data.len() as u64, 0o644);
    {
        let gnu = h.as_gnu_mut().expect("gnu header");
        gnu.name[..name.len()].copy_from_slice(name);
        gnu.linkname[..link.len()].copy_from_slice(link);
    }
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

/// A gzip'd archive whose one file claims `size` bytes (and holds a few).
fn claims(size: u64) -> Vec<u8> {
    use std::io::Write;
    let mut h = header(tar::EntryType::Regular, size, 0o644);
    h.as_gnu_mut().expect("gnu").name[..3].copy_from_slice(b"big");
    h.set_cksum();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(h.as_bytes()).expect("gzip");
    gz.write_all(&[0u8; 4096]).expect("gzip");
    gz.finish().expect("gzip")
}

/// Every chunk of a stream.
async fn collect(mut rx: hutch_control::files::Chunks) -> Result<Vec<u8>, FilesError> {
    let mut out = Vec::new();
    while let Some(c) = rx.recv().await {
        out.extend(c?);
    }
    Ok(out)
}

fn hostile(name: &[u8], kind: tar::EntryType, link: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    raw_entry(&mut out, b"fine.txt", tar::EntryType::Regular, b"fine", b"");
    raw_entry(&mut out, name, kind, b"", link);
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// A digest of everything below /workspace as root sees it.
async fn snapshot(t: &TestSandbox) -> Vec<hutch_api::ListEntry> {
    list_all(&t.root_fs(), "/workspace", 10_000, true).await.0
}

#[tokio::test]
async fn archives_upload_and_download_and_hostile_ones_change_nothing() {
    let t = TestSandbox::start("archive", 1 << 30);
    let fs = t.fs();
    let r = fs.upload_archive("proj", project_tar(true)).await.expect("upload");
    assert_eq!((r.path.as_str(), r.files, r.bytes), ("proj", 4, 11 + 6 + (5 << 20) + 2));
    assert_eq!(fs.read("proj/src/run.sh").await.expect("read"), b"echo hello\n");
    let modes = t.sh("cd proj && stat -c '%n %a %U' src src/run.sh README data data/big.bin ro ro/x", "user").await;
    assert_eq!(
        modes,
        "src 700 user\nsrc/run.sh 755 user\nREADME 444 user\ndata 755 user\ndata/big.bin 400 user\nro 555 user\nro/x 644 user\n"
    );
    let left = t.sh("ls -A proj", "user").await;
    assert!(!left.contains(".hutch-archive-"), "{left}");

    // A second archive merges into the existing tree and replaces files.
    let mut b = tar::Builder::new(Vec::new());
    b.append_data(&mut header(tar::EntryType::Regular, 3, 0o644), "src/run.sh", &b"new"[..]).expect("f");
    b.append_data(&mut header(tar::EntryType::Regular, 3, 0o644), "src/added", &b"add"[..]).expect("f");
    let r = fs.upload_archive("/workspace/proj", b.into_inner().expect("tar")).await.expect("merge");
    assert_eq!(r.files, 2);
    assert_eq!(fs.read("proj/src/run.sh").await.expect("read"), b"new");
    assert_eq!(fs.read("proj/README").await.expect("kept"), b"readme");
    assert_eq!(t.sh("stat -c %a proj/src", "user").await.trim(), "700", "an existing directory keeps its bits");

    // Download: a tar of the tree, symlinks as symlinks.
    t.sh("ln -s ../README proj/src/readme-link", "user").await;
    let tar_bytes = collect(fs.download_archive("proj").await.expect("download")).await.expect("whole download");
    let mut got = std::collections::BTreeMap::new();
    for e in tar::Archive::new(tar_bytes.as_slice()).entries().expect("entries") {
        let mut e = e.expect("entry");
        let path = String::from_utf8_lossy(&e.path_bytes()).into_owned();
        let kind = e.header().entry_type();
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut data).expect("data");
        let link = e.link_name_bytes().map(|l| String::from_utf8_lossy(&l).into_owned());
        got.insert(path, (kind, data, link));
    }
    assert_eq!(got["src/added"].1, b"add");
    assert_eq!(
        sha_hex(&got["data/big.bin"].1),
        sha_hex(&(0..5 << 20).map(|i: u32| (i % 253) as u8).collect::<Vec<_>>())
    );
    assert_eq!(got["src/readme-link"].0, tar::EntryType::Symlink);
    assert_eq!(got["src/readme-link"].2.as_deref(), Some("../README"));
    assert_eq!(got["ro/"].0, tar::EntryType::Directory);

    // Hostile archives and targets: refused, nothing changes.
    t.sh("mkdir -p /workspace/t && ln -s /etc /workspace/evil && ln -s /etc /workspace/t/evil", "root").await;
    t.sh("chown -h user:user /workspace/t /workspace/t/evil /workspace/evil", "root").await;
    let before = snapshot(&t).await;
    let etc_before = t.root_fs().list("/etc", ListOptions { include_sha256: true, ..ListOptions::default() }).await;
    let mut many = tar::Builder::new(Vec::new());
    for i in 0..10_001 {
        many.append_data(&mut header(tar::EntryType::Directory, 0, 0o755), format!("d{i}/"), std::io::empty())
            .expect("dir");
    }
    let many = many.into_inner().expect("tar");
    let mut evil_child = Vec::new();
    raw_entry(&mut evil_child, b"evil/passwd", tar::EntryType::Regular, b"pwned", b"");
    evil_child.extend_from_slice(&[0u8; 1024]);
    let cases: Vec<(&str, &str, Vec<u8>, ErrorCode)> = vec![
        ("symlink", "x", hostile(b"s", tar::EntryType::Symlink, b"/etc"), ErrorCode::SandboxArchiveInvalid),
        ("hard link", "x", hostile(b"h", tar::EntryType::Link, b"fine.txt"), ErrorCode::SandboxArchiveInvalid),
        ("dotdot", "x", hostile(b"../up", tar::EntryType::Regular, b""), ErrorCode::SandboxArchiveInvalid),
        ("absolute", "x", hostile(b"/abs", tar::EntryType::Regular, b""), ErrorCode::SandboxArchiveInvalid),
        ("device", "x", hostile(b"dev", tar::EntryType::Block, b""), ErrorCode::SandboxArchiveInvalid),
        ("fifo", "x", hostile(b"p", tar::EntryType::Fifo, b""), ErrorCode::SandboxArchiveInvalid),
        ("garbage", "x", vec![0x5a; 4096], ErrorCode::SandboxArchiveInvalid),
        ("many", "x", many, ErrorCode::SandboxArchiveTooLarge),
        ("huge", "x", claims(hutch_control::files::UPLOAD_UNPACKED_CAP + 1), ErrorCode::SandboxArchiveTooLarge),
        ("root", "/", project_tar(false), ErrorCode::SandboxArchiveInvalid),
        ("workspace", "/workspace/.", project_tar(false), ErrorCode::SandboxArchiveInvalid),
        ("dot", ".", project_tar(false), ErrorCode::SandboxArchiveInvalid),
        ("symlink target", "evil", project_tar(false), ErrorCode::SandboxPathConflict),
        ("through symlink", "evil/sub", project_tar(false), ErrorCode::SandboxPathConflict),
        ("into symlink", "t", evil_child, ErrorCode::SandboxPathConflict),
        ("file as dir", "proj/README", project_tar(false), ErrorCode::SandboxPathConflict),
    ];
    for (what, dir, archive, want) in cases {
        let r = fs.upload_archive(dir, archive).await;
        assert_eq!(r.as_ref().map_err(|e| e.code).err(), Some(want), "{what}: {r:?}");
    }
    // As root too: a planted symlink is never followed.
    let mut evil_child = Vec::new();
    raw_entry(&mut evil_child, b"evil/passwd", tar::EntryType::Regular, b"pwned", b"");
    evil_child.extend_from_slice(&[0u8; 1024]);
    assert_eq!(code(t.root_fs().upload_archive("t", evil_child).await), ErrorCode::SandboxPathConflict);
    assert_eq!(snapshot(&t).await, before, "a refused archive changed the workspace");
    let etc_after = t.root_fs().list("/etc", ListOptions { include_sha256: true, ..ListOptions::default() }).await;
    assert_eq!(etc_after, etc_before);

    // One that fails part way is undone: `ro2` belongs to root, so moving
    // `ro2/x` in fails after `a.txt` was placed.
    t.sh("mkdir -p /workspace/m/ro2 && chown user:user /workspace/m", "root").await;
    let before = snapshot(&t).await;
    let mut b = tar::Builder::new(Vec::new());
    b.append_data(&mut header(tar::EntryType::Regular, 1, 0o644), "a.txt", &b"a"[..]).expect("f");
    b.append_data(&mut header(tar::EntryType::Regular, 1, 0o644), "ro2/x", &b"x"[..]).expect("f");
    assert_eq!(code(fs.upload_archive("m", b.into_inner().expect("tar")).await), ErrorCode::SandboxPathConflict);
    assert_eq!(snapshot(&t).await, before, "a failed archive was not undone");
}

fn part(path: &str, offset: u64, size: u64, sha256: &str, data: &[u8]) -> FilePart {
    FilePart {
        path: path.into(),
        offset,
        size,
        sha256: sha256.into(),
        data: base64::engine::general_purpose::STANDARD.encode(data),
    }
}

#[tokio::test]
async fn file_parts_assemble_verify_and_refuse_gaps() {
    let t = TestSandbox::start("parts", 1 << 30);
    let fs = t.fs();
    let data: Vec<u8> = (0..20 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let size = data.len() as u64;
    let sha = sha_hex(&data);
    let path = "cache/deep/pkg.bin";
    let p = |offset: usize, len: usize| part(path, offset as u64, size, &sha, &data[offset..offset + len]);
    let mib8 = 8 << 20;

    let r = fs.put_part(p(0, mib8)).await.expect("part 1");
    assert_eq!((r.received, r.complete), (mib8 as u64, false));
    assert_eq!(code(fs.read(path).await), ErrorCode::NotFound, "nothing at path before the end");
    assert_eq!(code(fs.put_part(p(2 * mib8, 4 << 20)).await), ErrorCode::SandboxFilePartOutOfOrder);
    // Resending a part is fine.
    fs.put_part(p(0, mib8)).await.expect("part 1 again");
    let r = fs.put_part(p(mib8, mib8)).await.expect("part 2");
    assert_eq!(r.received, 2 * mib8 as u64);
    let r = fs.put_part(p(2 * mib8, 4 << 20)).await.expect("part 3");
    assert_eq!((r.received, r.complete), (size, true));
    let mut rx = fs.read_stream(path).await.expect("stream");
    let mut got = Vec::new();
    while let Some(c) = rx.recv().await {
        got.extend(c.expect("chunk"));
    }
    assert_eq!(sha_hex(&got), sha);
    // The final part again answers the same completion.
    let r = fs.put_part(p(2 * mib8, 4 << 20)).await.expect("final part again");
    assert_eq!((r.received, r.complete, r.size), (size, true, size));
    let left = t.sh("ls -A /workspace/cache/deep", "user").await;
    assert_eq!(left, "pkg.bin\n");

    // A mismatch drops the staging file.
    let wrong = sha_hex(b"something else");
    assert_eq!(code(fs.put_part(part("m.bin", 0, 5, &wrong, b"hello")).await), ErrorCode::SandboxFilePartMismatch);
    let left = t.sh("ls -A /workspace", "user").await;
    assert!(!left.contains(".hutch-part-"), "{left}");
    assert_eq!(code(fs.read("m.bin").await), ErrorCode::NotFound);
    // Bad input.
    let upper = sha_hex(b"hello").to_uppercase();
    assert_eq!(code(fs.put_part(part("m.bin", 0, 5, &upper, b"hello")).await), ErrorCode::InvalidRequest);
    let ok = sha_hex(b"hello");
    assert_eq!(code(fs.put_part(part("m.bin", 3, 5, &ok, b"hello")).await), ErrorCode::InvalidRequest);
    assert_eq!(code(fs.put_part(part("m.bin", 0, (1 << 30) + 1, &ok, b"h")).await), ErrorCode::PayloadTooLarge);
    let mut over = part("m.bin", 0, 9 << 20, &ok, &vec![0u8; FILE_DATA_CAP + 1]);
    assert_eq!(code(fs.put_part(over.clone()).await), ErrorCode::PayloadTooLarge);
    over.data = "!!!!".into();
    assert_eq!(code(fs.put_part(over).await), ErrorCode::InvalidRequest);
    let r = fs.put_part(part("m.bin", 0, 5, &ok, b"hello")).await.expect("one-part file");
    assert!(r.complete);
    assert_eq!(fs.read("m.bin").await.expect("read"), b"hello");
}

#[tokio::test]
async fn planted_symlinks_are_never_followed_by_writes() {
    let t = TestSandbox::start("symlinks", 1 << 30);
    t.sh("ln -s /etc /workspace/evil && ln -s /etc/hostname /workspace/to-hostname", "root").await;
    let root = t.root_fs();
    let hostname = root.read("/etc/hostname").await.expect("hostname");
    let etc = root.list("/etc", ListOptions { include_sha256: true, ..ListOptions::default() }).await.expect("etc");

    assert_eq!(code(root.write("evil/passwd", b"pwned").await), ErrorCode::SandboxPathConflict);
    assert_eq!(code(root.write("evil/new", b"pwned").await), ErrorCode::SandboxPathConflict);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Ok(b"pwned".to_vec())).await.expect("send");
    drop(tx);
    assert_eq!(code(root.write_stream("evil/streamed", rx).await), ErrorCode::SandboxPathConflict);
    let sha = sha_hex(b"pwned");
    assert_eq!(code(root.put_part(part("evil/part", 0, 5, &sha, b"pwned")).await), ErrorCode::SandboxPathConflict);
    assert_eq!(code(root.put_part(part("evil/sub/part", 0, 5, &sha, b"pwned")).await), ErrorCode::SandboxPathConflict);
    // A write to the link itself replaces the link, not its target.
    root.write("to-hostname", b"replaced").await.expect("write over a link");
    assert_eq!(t.sh("stat -c %F /workspace/to-hostname", "root").await.trim(), "regular file");
    assert_eq!(root.read("/etc/hostname").await.expect("hostname"), hostname);
    // Reads may follow a link; it stays inside the sandbox.
    assert_eq!(root.read("evil/hostname").await.expect("read through link"), hostname);
    let after = root.list("/etc", ListOptions { include_sha256: true, ..ListOptions::default() }).await.expect("etc");
    assert_eq!(after, etc, "/etc changed");
}

/// Interrupted uploads, as a daemon killed with -9 leaves them, are settled
/// from their journal: undone before the commit, finished after it.
#[tokio::test]
async fn interrupted_uploads_are_settled_from_their_journal() {
    use hutch_control::files::journal::{self, Journal, JournalDir, Move, Phase};
    let t = TestSandbox::start("journal", 1 << 30);
    let dir = JournalDir { dir: t.base.join("state/uploads"), sandbox: "sb-test".into() };
    let user = |s: &str| s.to_owned();

    // Half way through the moves: `a` replaced (its old copy in the
    // backup), `b` between its two renames (old in the backup, new still
    // staged), `c` fresh and placed, `sub` fresh and not yet placed; `t`
    // and `t/deep` were made for the upload.
    t.sh(
        "mkdir -p m && cd m && echo old-a > a && echo old-b > b && \
         mkdir -p .hutch-archive-1/sub && cd .hutch-archive-1 && \
         echo old-a > .old-1 && echo old-b > .old-2 && echo new-b > b && echo new-s > sub/s && \
         cd .. && echo new-a > a && rm b && echo new-c > c",
        "user",
    )
    .await;
    let moving = Journal {
        version: 1,
        user: user("user"),
        target: "/workspace/m".into(),
        staging: "/workspace/m/.hutch-archive-1".into(),
        made: vec![],
        phase: Phase::Moving,
        moves: vec![
            Move { path: "a".into(), backup: Some(".old-1".into()) },
            Move { path: "b".into(), backup: Some(".old-2".into()) },
            Move { path: "c".into(), backup: None },
            Move { path: "sub".into(), backup: None },
        ],
        chmods: vec![("/workspace/m/sub".into(), 0o500)],
    };
    dir.save("1", &moving).await.expect("save");
    // Staged into a target the upload made: undone down to nothing.
    t.sh("mkdir -p made/deep/.hutch-archive-2/x && echo new > made/deep/.hutch-archive-2/x/f", "user").await;
    let staging = Journal {
        version: 1,
        user: user("user"),
        target: "/workspace/made/deep".into(),
        staging: "/workspace/made/deep/.hutch-archive-2".into(),
        made: vec!["/workspace/made".into(), "/workspace/made/deep".into()],
        phase: Phase::Staging,
        moves: vec![],
        chmods: vec![],
    };
    dir.save("2", &staging).await.expect("save");
    // Committed: finished (bits set, staging gone), never undone.
    t.sh(
        "mkdir -p done/.hutch-archive-3 done/ro && echo new > done/f && echo old > done/.hutch-archive-3/.old-1",
        "user",
    )
    .await;
    let committed = Journal {
        version: 1,
        user: user("user"),
        target: "/workspace/done".into(),
        staging: "/workspace/done/.hutch-archive-3".into(),
        made: vec![],
        phase: Phase::Committed,
        moves: vec![Move { path: "f".into(), backup: Some(".old-1".into()) }],
        chmods: vec![("/workspace/done/ro".into(), 0o555)],
    };
    dir.save("3", &committed).await.expect("save");

    assert_eq!(journal::recover(&dir, t.socket()).await, 3);
    assert_eq!(t.sh("cd m && ls -A && cat a b", "user").await, "a\nb\nold-a\nold-b\n");
    assert_eq!(t.sh("ls -A /workspace | grep -c '^made$' || true", "user").await.trim(), "0");
    assert_eq!(t.sh("cd done && ls -A && cat f && stat -c %a ro", "user").await, "f\nro\nnew\n555\n");
    // The records are gone, and settling again changes nothing.
    assert_eq!(journal::recover(&dir, t.socket()).await, 0);
    for (upload, j) in [("1", &moving), ("2", &staging), ("3", &committed)] {
        dir.save(upload, j).await.expect("save");
    }
    assert_eq!(journal::recover(&dir, t.socket()).await, 3);
    assert_eq!(t.sh("cd m && ls -A && cat a b", "user").await, "a\nb\nold-a\nold-b\n");
    assert_eq!(t.sh("cd done && ls -A && cat f", "user").await, "f\nro\nnew\n");
}

/// A big file, different in every MiB.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[(i >> 20) & 3]).collect()
}

async fn feed(data: &[u8]) -> hutch_control::files::Chunks {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let data = data.to_vec();
    tokio::spawn(async move {
        for c in data.chunks(300 << 10) {
            if tx.send(Ok(c.to_vec())).await.is_err() {
                return;
            }
        }
    });
    rx
}

#[tokio::test]
async fn a_64_mib_file_round_trips_byte_identical_through_a_passed_descriptor_and_through_frames() {
    let t = TestSandbox::start("roundtrip", 512 << 20);
    let data = pattern(64 << 20);
    for (name, fs) in [("passed", t.fs()), ("frames", t.copying_fs())] {
        let n = fs.write_stream(&format!("{name}.bin"), feed(&data).await).await.expect("write");
        assert_eq!(n, data.len() as u64, "{name}");
        let got = collect(fs.read_stream(&format!("{name}.bin")).await.expect("read")).await.expect("chunks");
        assert!(got == data, "{name}: the bytes read back differ");
    }
    // The workload sees the same bytes.
    let sums = t.sh("sha256sum passed.bin frames.bin", "user").await;
    let want = sha_hex(&data);
    assert_eq!(sums.matches(&want).count(), 2, "{sums}");
}

#[tokio::test]
async fn passed_descriptors_never_leave_the_sandbox_root() {
    let t = TestSandbox::start("escape", 256 << 20);
    let fs = t.fs();
    // Host paths the sandbox must never reach.
    let host_dir = t.base.join("host-dir");
    std::fs::create_dir_all(&host_dir).expect("mkdir");
    let secret = host_dir.join("secret");
    std::fs::write(&secret, b"host secret").expect("write");
    let (hd, hs) = (host_dir.display(), secret.display());
    t.sh(
        &format!("ln -s {hs} abs; ln -s ../../../../../../../..{hs} rel; ln -s /proc/1/root/etc/passwd magic; ln -s /etc/passwd pw"),
        "user",
    )
    .await;
    // Reads follow symlinks inside the root only.
    for link in ["abs", "rel"] {
        assert_eq!(code(fs.read_stream(link).await), ErrorCode::NotFound, "{link}");
    }
    assert!(fs.read_stream("magic").await.is_err(), "a magic link was followed");
    assert_eq!(code(fs.read_stream("../etc/passwd").await), ErrorCode::InvalidPath);
    let pw = collect(fs.read_stream("pw").await.expect("read")).await.expect("chunks");
    assert_eq!(String::from_utf8_lossy(&pw), t.sh("cat /etc/passwd", "user").await, "not the sandbox's passwd");
    // Writes replace a symlink, never write through it.
    for link in ["abs", "rel"] {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(Ok(b"mine".to_vec())).await.expect("send");
        drop(tx);
        fs.write_stream(link, rx).await.expect("write");
        assert_eq!(t.sh(&format!("cat {link}; test ! -L {link} && echo regular"), "user").await, "mineregular\n");
    }
    assert_eq!(std::fs::read(&secret).expect("secret"), b"host secret");

    // A parent swapped for a symlink while a write streams: the rest of
    // the bytes go to the file already open, inside the sandbox; the
    // rename into place refuses the symlink.
    t.sh(&format!("mkdir d; ln -s {hd} hostlink"), "user").await;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let this = fs.clone();
    let write = tokio::spawn(async move { this.write_stream("d/f", rx).await });
    tx.send(Ok(vec![1u8; 1 << 20])).await.expect("send");
    // Accepted once the first chunk was taken: the file is open by now.
    tx.send(Ok(vec![2u8; 1 << 20])).await.expect("send");
    t.sh(&format!("mv d d.old && ln -s {hd} d"), "user").await;
    let _ = tx.send(Ok(vec![3u8; 1 << 20])).await;
    drop(tx);
    let r = write.await.expect("write task");
    assert!(r.is_err(), "the rename followed the swapped symlink: {r:?}");
    assert!(!host_dir.join("f").exists(), "a write left the sandbox");
    assert_eq!(std::fs::read_dir(&host_dir).expect("host dir").count(), 1, "the host directory changed");

    // A parent swapped while a read streams: the read goes on with the
    // file it opened.
    let data = pattern(16 << 20);
    t.sh("mkdir big", "user").await;
    fs.write_stream("big/f", feed(&data).await).await.expect("write");
    let mut rx = fs.read_stream("big/f").await.expect("read");
    let mut got = rx.recv().await.expect("a first chunk").expect("chunk");
    t.sh(&format!("mv big big.old && ln -s {hd} big"), "user").await;
    while let Some(c) = rx.recv().await {
        got.extend(c.expect("chunk"));
    }
    assert!(got == data, "the read changed files half way");
    assert_eq!(std::fs::read(&secret).expect("secret"), b"host secret");
}
