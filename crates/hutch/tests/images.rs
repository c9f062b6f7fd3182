//! Images end to end through the real binary: a `docker save` archive made
//! here (a shell and its libraries from the host, then a layer of
//! whiteouts, an opaque directory and a write under a lower layer's
//! symlink) is imported with `hutch image import` and run with
//! `hutch run --image`.

mod common;

use common::*;
use sha2::{Digest, Sha256};
use std::path::Path;

/// A tar layer built in memory.
struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Layer {
        Layer(tar::Builder::new(Vec::new()))
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h
    }

    fn file(mut self, name: &str, data: &[u8], mode: u32) -> Layer {
        let mut h = Layer::header(tar::EntryType::Regular, mode, data.len() as u64);
        self.0.append_data(&mut h, name, data).expect("append");
        self
    }

    fn dir(mut self, name: &str) -> Layer {
        let mut h = Layer::header(tar::EntryType::Directory, 0o755, 0);
        self.0.append_data(&mut h, name, &b""[..]).expect("append");
        self
    }

    fn symlink(mut self, name: &str, target: &str) -> Layer {
        let mut h = Layer::header(tar::EntryType::Symlink, 0o777, 0);
        self.0.append_link(&mut h, name, target).expect("append");
        self
    }

    fn bytes(self) -> Vec<u8> {
        self.0.into_inner().expect("finish")
    }
}

/// A layer holding the host's dash as /bin/sh and what it needs to run.
fn shell_layer() -> Layer {
    let ld = std::fs::canonicalize("/lib64/ld-linux-x86-64.so.2").expect("the host's dynamic loader");
    let libc = std::fs::canonicalize("/lib/x86_64-linux-gnu/libc.so.6").expect("the host's libc");
    Layer::new()
        .dir("usr")
        .dir("usr/bin")
        .symlink("bin", "usr/bin")
        .symlink("lib", "usr/lib")
        .symlink("lib64", "usr/lib64")
        .dir("usr/lib64")
        .dir("usr/lib/x86_64-linux-gnu")
        .file("usr/bin/sh", &std::fs::read("/bin/dash").expect("dash"), 0o755)
        .file("usr/bin/cat", &std::fs::read("/usr/bin/cat").expect("cat"), 0o755)
        .file("usr/lib64/ld-linux-x86-64.so.2", &std::fs::read(&ld).expect("ld.so"), 0o755)
        .file("usr/lib/x86_64-linux-gnu/libc.so.6", &std::fs::read(&libc).expect("libc"), 0o755)
}

fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A `docker save` archive (the classic layout: <id>/layer.tar, <hex>.json).
fn docker_save(layers: &[Vec<u8>], env: &[&str], tag: &str) -> Vec<u8> {
    let diff_ids: Vec<String> = layers.iter().map(|l| format!("sha256:{}", sha(l))).collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": env, "Cmd": ["/bin/sh"], "WorkingDir": "/workspace"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    })
    .to_string();
    let config_name = format!("{}.json", sha(config.as_bytes()));
    let names: Vec<String> = layers.iter().enumerate().map(|(i, _)| format!("layer{i}/layer.tar")).collect();
    let manifest = serde_json::json!([{"Config": config_name, "RepoTags": [tag], "Layers": names}]).to_string();
    let mut out =
        Layer::new().file("manifest.json", manifest.as_bytes(), 0o644).file(&config_name, config.as_bytes(), 0o644);
    for (name, l) in names.iter().zip(layers) {
        out = out.file(name, l, 0o644);
    }
    out.bytes()
}

#[test]
fn an_imported_image_runs_and_its_whiteouts_hide_lower_files() {
    let env = Env::new("img-import");
    let probe = Path::new("/etc").join(format!("hutch-img-probe-{}", std::process::id()));
    let _ = std::fs::remove_file(&probe);
    let lower = shell_layer()
        .dir("data")
        .file("data/gone", b"lower\n", 0o644)
        .file("data/kept", b"kept\n", 0o644)
        .dir("opq")
        .file("opq/old", b"old\n", 0o644)
        .symlink("redir", "/etc")
        .bytes();
    let upper = Layer::new()
        .file("data/.wh.gone", b"", 0o644)
        .file("opq/.wh..wh..opq", b"", 0o644)
        .file("opq/new", b"new\n", 0o644)
        .file(&format!("redir/{}", probe.file_name().and_then(|n| n.to_str()).expect("name")), b"x\n", 0o644)
        .bytes();
    let archive = env.state.join("img.tar");
    std::fs::write(&archive, docker_save(&[lower, upper], &["GREETING=hello", "PATH=/usr/bin"], "test/img:1"))
        .expect("write archive");

    let out = env.hutch().args(["image", "--local", "import"]).arg(&archive).output().expect("import");
    assert!(out.status.success(), "import: {}", stderr(&out));
    assert!(stdout(&out).contains("test-img-1 (3 layers"), "{}", stdout(&out));
    assert!(!probe.exists(), "the import wrote through a lower layer's symlink onto the host");

    let script = "for p in /data/gone /data/kept /opq/old /opq/new; do \
                  if [ -e $p ]; then echo \"$p yes\"; else echo \"$p no\"; fi; done; \
                  [ -d /redir ] && echo redir-dir; echo \"greeting=$GREETING\"; id -u 2>/dev/null; \
                  cat /etc/passwd; [ -w /workspace ] && echo workspace-writable";
    let out = env.run(&["--image", "test-img-1"], &["/bin/sh", "-c", script]);
    let text = stdout(&out);
    assert!(out.status.success(), "run: {text}\n{}", stderr(&out));
    for want in ["/data/gone no", "/data/kept yes", "/opq/old no", "/opq/new yes", "redir-dir", "greeting=hello"] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    assert!(text.contains("user:x:1000:1000:user:/home/user:/bin/sh"), "{text}");
    assert!(text.contains("workspace-writable"), "{text}");
    assert!(!probe.exists());
    env.assert_no_residue();

    // A second import of the same layers shares them.
    let out =
        env.hutch().args(["image", "--local", "import", "--name", "again"]).arg(&archive).output().expect("import");
    assert!(out.status.success(), "{}", stderr(&out));
    let layers = std::fs::read_dir(env.state.join("images/layers"))
        .expect("layers")
        .flatten()
        .filter(|e| e.path().is_dir())
        .count();
    assert_eq!(layers, 3, "two imported layers and one generated, shared by both images");
    let out = env.hutch().args(["image", "--local", "list"]).output().expect("list");
    assert!(stdout(&out).contains("again") && stdout(&out).contains("test-img-1"), "{}", stdout(&out));
    let out = env.hutch().args(["image", "--local", "rm", "again"]).output().expect("rm");
    assert!(out.status.success());
}

#[test]
fn an_archive_with_a_wrong_diff_id_is_refused_whole() {
    let env = Env::new("img-bad");
    let layer = shell_layer().bytes();
    let mut archive = docker_save(&[layer], &[], "bad:1");
    // One byte of the shell's content changed: the tar stays well-formed,
    // its digest no longer matches the configuration's diff_id.
    let dash = std::fs::read("/bin/dash").expect("dash");
    let pos = archive.windows(256).position(|w| w == &dash[4096..4096 + 256]).expect("dash in the archive");
    archive[pos + 10] ^= 0xff;
    let path = env.state.join("bad.tar");
    std::fs::write(&path, archive).expect("write");
    let out = env.hutch().args(["image", "--local", "import"]).arg(&path).output().expect("import");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("digest mismatch") && stderr(&out).contains("image_layer_refused"),
        "{}",
        stderr(&out)
    );
    let out = env.hutch().args(["image", "--local", "list", "--json"]).output().expect("list");
    assert_eq!(stdout(&out).trim(), "[]");
    let tmp: Vec<_> = std::fs::read_dir(env.state.join("images/tmp")).expect("tmp").flatten().collect();
    assert!(tmp.is_empty(), "{tmp:?}");
}
