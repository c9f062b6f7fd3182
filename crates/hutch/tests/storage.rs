//! Disk-backed writable layers, for real: a btrfs image under the test's
//! state directory, sandboxes on its subvolumes. A layer's quota stops
//! writes, a small sandbox writes far more than its memory, files keep
//! their image ids whatever uid range wrote them, and a layer outlives its
//! sandbox (and the file system its unmount and a detached loop device).

mod common;

use common::*;
use hutch_agent::proto::{Cmd, ErrorCode, FromAgent, Reply, Request, Spawn, Stream, WriteFile};
use hutch_runtime::agent::AgentError;
use hutch_runtime::cgroup::Limits;
use hutch_runtime::rootfs::UPPER_DIRS;
use hutch_runtime::storage::{Backing, Kind, LayerName, Quotas, Storage, StorageConfig, StorageError};
use hutch_runtime::{Sandbox, SandboxSpec, Writable};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;
use std::time::Duration;

/// Runs a shell command to completion: (stdout and stderr, exit code or
/// -signal).
fn sh(sb: &Sandbox, cmd: &str, user: &str) -> (String, i32) {
    let mut conn = sb.connect().expect("connect");
    let spawn = Spawn {
        cmd: Cmd::Shell(cmd.into()),
        env: vec![],
        cwd: None,
        user: Some(user.into()),
        stdin: false,
        pty: None,
        tag: None,
        timeout_ms: Some(120_000),
        subscribe: true,
        output_limit: None,
    };
    let (reply, _) = conn.call(Request::Spawn(spawn), &[]).expect("spawn");
    let Reply::Spawned { pid } = reply else { panic!("unexpected {reply:?}") };
    let mut out = Vec::new();
    loop {
        let (msg, data) = conn.recv(Some(Duration::from_secs(150))).expect("recv");
        match msg {
            FromAgent::Output { pid: p, stream: Stream::Stdout | Stream::Stderr } if p == pid => out.extend(data),
            FromAgent::Exit { pid: p, status } if p == pid => {
                let code = status.code.unwrap_or_else(|| -status.signal.unwrap_or(0));
                return (String::from_utf8_lossy(&out).into_owned(), code);
            }
            _ => {}
        }
    }
}

fn on(layer: &hutch_runtime::storage::Layer, disk_bytes: u64) -> SandboxSpec {
    SandboxSpec { disk_bytes, writable: Writable::Layer(layer.clone()), ..SandboxSpec::default() }
}

fn name(id: &str) -> LayerName {
    LayerName::sandbox(id).expect("layer name")
}

#[test]
fn layers_are_made_snapshotted_limited_measured_and_deleted() {
    let env = Env::new("storage-prim");
    let st = storage(&env, 2 << 30);
    let layer = st.create(&name("prim-a"), UPPER_DIRS).expect("create");
    // The overlay's form, owned by image ids.
    let up = layer.upper();
    assert_eq!(std::fs::metadata(up.join("home/user")).expect("home").uid(), 1000);
    assert_eq!(std::fs::metadata(up.join("workspace")).expect("workspace").uid(), 1000);
    assert_eq!(std::fs::metadata(up.join("tmp")).expect("tmp").permissions().mode() & 0o7777, 0o1777);
    assert!(layer.path().join("work").is_dir());
    assert!(!layer.read_only());
    assert!(matches!(st.create(&name("prim-a"), &[]), Err(StorageError::Exists(_))));
    assert_eq!(st.open_layer(&name("prim-a")).expect("open"), Some(layer.clone()));
    assert_eq!(st.open_layer(&name("nothing")).expect("open"), None);
    // Nothing half made is left in tmp/ (failed or not).
    assert!(st.list(Kind::Sandbox).expect("list") == ["prim-a"]);

    st.set_limit(&layer, Some(64 << 20)).expect("limit");
    std::fs::write(up.join("workspace/f"), vec![1u8; 8 << 20]).expect("write");
    let u = st.usage(&layer).expect("usage");
    assert_eq!(u.limit_bytes, Some(64 << 20));
    assert!(u.used_bytes >= 8 << 20, "{u:?}");
    st.sync().expect("sync");
    let u = st.usage(&layer).expect("usage");
    assert!(u.referenced_bytes >= 8 << 20 && u.exclusive_bytes >= 8 << 20, "{u:?}");

    // A read-only snapshot holds the file; it cannot be written.
    let snap = st.snapshot(&layer, &LayerName::new(Kind::Snapshot, "s1").expect("name"), true).expect("snapshot");
    assert!(snap.read_only());
    assert_eq!(std::fs::read(snap.upper().join("workspace/f")).expect("read").len(), 8 << 20);
    let e = std::fs::write(snap.upper().join("workspace/g"), b"x").expect_err("read-only");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    // Shared until written: with simple quotas (what a file system of ours
    // gets on this kernel) the bytes stay charged to the layer that wrote
    // them and the snapshot is charged nothing.
    st.sync().expect("sync");
    assert_eq!(st.quotas(), Quotas::Simple);
    let su = st.usage(&snap).expect("usage");
    assert!(su.referenced_bytes < 1 << 20, "{su:?}");
    assert!(st.usage(&layer).expect("usage").referenced_bytes >= 8 << 20);
    // A writable snapshot of it is another layer; neither sees the other's writes.
    let fork = st.snapshot(&snap, &name("prim-b"), false).expect("fork");
    std::fs::write(fork.upper().join("workspace/f"), b"changed").expect("write fork");
    assert_eq!(std::fs::read(snap.upper().join("workspace/f")).expect("read").len(), 8 << 20);
    // Its limit caps what it writes on top of what it shares: 4 MiB below
    // the 8 MiB it started with still lets it write 2 MiB, not 6.
    st.set_limit(&fork, Some(4 << 20)).expect("limit");
    std::fs::write(fork.upper().join("workspace/g"), vec![1u8; 2 << 20]).expect("write within the limit");
    st.sync().expect("sync");
    let e = std::fs::write(fork.upper().join("workspace/h"), vec![1u8; 6 << 20]).expect_err("past the limit");
    assert_eq!(e.raw_os_error(), Some(libc::EDQUOT));
    assert!(matches!(
        st.snapshot(&layer, &name("prim-b"), false),
        Err(StorageError::Exists(n)) if n == name("prim-b")
    ));

    // Deleting the source leaves the snapshot whole.
    assert!(st.delete(&name("prim-a")).expect("delete"));
    assert!(!st.delete(&name("prim-a")).expect("delete again"));
    assert!(!layer.path().exists());
    assert_eq!(st.open_layer(&name("prim-a")).expect("open"), None);
    assert_eq!(std::fs::read(snap.upper().join("workspace/f")).expect("read").len(), 8 << 20);

    // A sweep deletes what it is not told to keep, of its own kind only.
    st.create(&name("prim-c"), &[]).expect("create");
    let mut swept = st.sweep(Kind::Sandbox, |n| n == "prim-c");
    swept.sort();
    assert_eq!(swept, ["prim-b"]);
    assert_eq!(st.list(Kind::Sandbox).expect("list"), ["prim-c"]);
    assert_eq!(st.list(Kind::Snapshot).expect("list"), ["s1"]);

    // A layer half made by a killed daemon (in tmp/) is gone at the next open.
    let status = std::process::Command::new("btrfs")
        .args(["-q", "subvolume", "create"])
        .arg(st.mount_point().join("tmp/half.0000"))
        .status()
        .expect("btrfs");
    assert!(status.success());
    let again = Storage::open(&StorageConfig::new(&env.state, None)).expect("reopen");
    assert!(!st.mount_point().join("tmp/half.0000").exists());
    assert_eq!(again.list(Kind::Sandbox).expect("list"), ["prim-c"]);
}

#[test]
fn a_disk_layer_stops_writes_at_its_limit_and_frees_what_is_deleted() {
    let env = Env::new("storage-limit");
    let st = storage(&env, 2 << 30);
    let rt = runtime(&env).with_storage(Some(st.clone()));
    let layer = st.create(&name("limit"), UPPER_DIRS).expect("create");
    let sb = start(&rt, &on(&layer, 64 << 20));
    let (out, code) = sh(&sb, "dd if=/dev/zero of=/workspace/big bs=1M count=200; echo rc=$?", "user");
    assert_eq!(code, 0, "{out}");
    // What a workload sees past its limit: EDQUOT, "Disk quota exceeded".
    assert!(out.contains("Disk quota exceeded") && out.contains("rc=1"), "{out}");
    let written = std::fs::metadata(layer.upper().join("workspace/big")).expect("on the host").len();
    assert!((32 << 20..=64 << 20).contains(&written), "{written}");
    let usage = sb.usage();
    assert_eq!(usage.disk_total_bytes, 64 << 20);
    assert!(usage.disk_used_bytes >= 32 << 20, "{usage:?}");
    // The file API's writes are refused as a full disk.
    let mut conn = sb.connect().expect("connect");
    let chunk = vec![7u8; 4 << 20];
    let mut refused = None;
    for i in 0..32u64 {
        let w = WriteFile {
            path: "/workspace/more".into(),
            offset: i * chunk.len() as u64,
            truncate: false,
            append: false,
            parents: false,
            mode: None,
            user: None,
        };
        if let Err(e) = conn.call(Request::WriteFile(w), &chunk) {
            refused = Some(e);
            break;
        }
    }
    match refused {
        Some(AgentError::Refused { code: ErrorCode::NoSpace, .. }) => {}
        other => panic!("expected no_space past the quota, got {other:?}"),
    }
    // Deleting gives the space back at once.
    let (out, code) =
        sh(&sb, "rm /workspace/big /workspace/more; dd if=/dev/zero of=/workspace/b2 bs=1M count=32 2>&1", "user");
    assert_eq!(code, 0, "{out}");
}

#[test]
fn a_256_mib_sandbox_writes_2_gib_to_its_disk_layer() {
    let env = Env::new("storage-big");
    let st = storage_in_memory(&env, 3 << 30);
    let rt = runtime(&env).with_storage(Some(st.clone()));
    let layer = st.create(&name("big"), UPPER_DIRS).expect("create");
    let defaults = SandboxSpec::default();
    let spec =
        SandboxSpec { limits: Limits { memory_bytes: 256 << 20, ..defaults.limits }, ..on(&layer, (5 << 30) / 2) };
    let sb = start(&rt, &spec);
    let (out, code) = sh(&sb, "dd if=/dev/zero of=/workspace/big bs=1M count=2048 2>&1; echo rc=$?", "user");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("rc=0"), "{out}");
    assert_eq!(std::fs::metadata(layer.upper().join("workspace/big")).expect("on the host").len(), 2 << 30);
    assert_eq!(sb.cgroup.oom_kills(), 0, "nothing was OOM-killed");
    assert!(sb.usage().disk_used_bytes >= 2 << 30);
}

#[test]
fn a_memory_layer_still_counts_toward_memory() {
    let env = Env::new("storage-mem");
    let rt = runtime(&env);
    let defaults = SandboxSpec::default();
    let spec =
        SandboxSpec { limits: Limits { memory_bytes: 256 << 20, ..defaults.limits }, disk_bytes: 1 << 30, ..defaults };
    let sb = start(&rt, &spec);
    // 600 MiB of files in a 256 MiB sandbox's tmpfs: the kernel has nowhere
    // to put them, and the writer is killed.
    let (out, code) = sh(&sb, "dd if=/dev/zero of=/workspace/big bs=1M count=600 2>&1; echo rc=$?", "user");
    assert!(!out.contains("rc=0"), "600 MiB fit in a 256 MiB memory layer: {out}");
    assert!(code == -9 || out.contains("rc=137"), "{code} {out}");
    assert!(sb.cgroup.oom_kills() > 0);
}

#[test]
fn a_layer_keeps_image_ids_whatever_range_wrote_it() {
    let env = Env::new("storage-ids");
    let st = storage(&env, 2 << 30);
    let rt = runtime(&env).with_storage(Some(st.clone()));
    let la = st.create(&name("ids-a"), UPPER_DIRS).expect("create");
    let a = start(&rt, &on(&la, 256 << 20));
    let (out, code) = sh(&a, "echo mine > /workspace/mine && mkdir /workspace/d && touch /workspace/d/x", "user");
    assert_eq!(code, 0, "{out}");
    let (out, code) = sh(
        &a,
        "echo r > /root/rootfile && touch /workspace/other && chown 1234:1234 /workspace/other \
         && echo extra >> /etc/hosts",
        "root",
    );
    assert_eq!(code, 0, "{out}");
    // On disk: the image's ids, not A's host range.
    let up = la.upper();
    for (path, uid) in [
        ("workspace/mine", 1000),
        ("workspace/d/x", 1000),
        ("workspace/other", 1234),
        ("root/rootfile", 0),
        ("etc/hosts", 0),
    ] {
        let m = std::fs::metadata(up.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!((m.uid(), m.gid()), (uid, uid), "{path}");
    }
    // A writable copy, started while A still holds its range, runs with
    // another range and sees the same owners.
    let lb = st.snapshot(&la, &name("ids-b"), false).expect("snapshot");
    let b = start(&rt, &on(&lb, 256 << 20));
    assert_ne!(a.id_base(), b.id_base());
    let (out, code) = sh(
        &b,
        "stat -c '%u:%g %n' /workspace/mine /workspace/d/x /workspace/other /root/rootfile /etc/hosts; \
         tail -1 /etc/hosts",
        "root",
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out,
        "1000:1000 /workspace/mine\n1000:1000 /workspace/d/x\n1234:1234 /workspace/other\n\
         0:0 /root/rootfile\n0:0 /etc/hosts\nextra\n"
    );
    // The user's files stay the user's: it writes and removes them; root's
    // stay out of its reach.
    let (out, code) = sh(&b, "echo more >> /workspace/mine && rm /workspace/d/x && cat /workspace/mine", "user");
    assert_eq!((out.as_str(), code), ("mine\nmore\n", 0));
    let (_, code) = sh(&b, "echo x >> /root/rootfile", "user");
    assert_ne!(code, 0, "user wrote root's file");
    // A file made in B is on disk with the image's id too.
    let (_, code) = sh(&b, "touch /workspace/from-b", "user");
    assert_eq!(code, 0);
    assert_eq!(std::fs::metadata(lb.upper().join("workspace/from-b")).expect("stat").uid(), 1000);
}

#[test]
fn a_layer_outlives_its_sandbox_and_mounts_again() {
    let env = Env::new("storage-again");
    let st = storage(&env, 2 << 30);
    let rt = runtime(&env).with_storage(Some(st.clone()));
    let layer = st.create(&name("again"), UPPER_DIRS).expect("create");
    let mut sb = start(&rt, &on(&layer, 256 << 20));
    let (out, code) = sh(&sb, "echo kept > /workspace/f && mkdir -p /home/user/.cache && rm -rf /tmp", "root");
    assert_eq!(code, 0, "{out}");
    sb.0.take().expect("sandbox").destroy().expect("destroy");
    // Its processes are gone; its layer is not, with overlay's mark of a
    // volatile mount, which would stop a plain remount.
    assert!(layer.upper().join("workspace/f").is_file());
    assert!(layer.path().join("work/work/incompat").exists());
    let sb = start(&rt, &on(&layer, 256 << 20));
    let (out, code) = sh(&sb, "cat /workspace/f; test -d /home/user/.cache && ! test -e /tmp && echo same", "user");
    assert_eq!((out.as_str(), code), ("kept\nsame\n", 0));
    drop(sb);
    assert!(st.delete(layer.name()).expect("delete"));
    assert!(!layer.path().exists());
    env.assert_no_residue();
}

#[test]
fn a_read_only_layer_or_a_runtime_without_storage_is_refused() {
    let env = Env::new("storage-refuse");
    let st = storage(&env, 1 << 30);
    let layer = st.create(&name("ro-src"), UPPER_DIRS).expect("create");
    let snap = st.snapshot(&layer, &LayerName::new(Kind::Snapshot, "ro").expect("name"), true).expect("snapshot");
    let rt = runtime(&env).with_storage(Some(st.clone()));
    let e = rt.start(&on(&snap, 64 << 20)).expect_err("a read-only upper");
    assert!(matches!(e, hutch_runtime::RuntimeError::Storage(StorageError::ReadOnly(_))), "{e}");
    let bare = runtime(&env);
    let e = bare.start(&on(&layer, 64 << 20)).expect_err("no storage");
    assert!(matches!(e, hutch_runtime::RuntimeError::NoStorage), "{e}");
    env.assert_no_residue();
}

/// Loop devices whose backing file is `image`.
fn attached(image: &std::path::Path) -> Vec<String> {
    let image = std::fs::canonicalize(image).expect("image");
    loop_devices()
        .into_iter()
        .filter(|d| {
            std::fs::read_to_string(format!("/sys/block/{d}/loop/backing_file"))
                .is_ok_and(|b| b.trim_end() == image.to_str().expect("utf8"))
        })
        .collect()
}

#[test]
fn the_storage_comes_back_after_an_unmount_and_a_detached_loop_device() {
    let env = Env::new("storage-reboot");
    let st = storage(&env, 1 << 30);
    let Backing::Image { image, device } = st.backing().clone() else { panic!("the test's state dir is not on btrfs") };
    assert_eq!(attached(&image), [device.file_name().expect("name").to_string_lossy()]);
    // Made from the 128 MiB seed (no mkfs.btrfs), grown to the image's size
    // when mounted.
    assert!(st.status().size_bytes > 7 << 27, "{:?}", st.status());
    let layer = st.create(&name("reboot"), UPPER_DIRS).expect("create");
    std::fs::write(layer.upper().join("workspace/f"), b"survives").expect("write");
    st.set_limit(&layer, Some(100 << 20)).expect("limit");
    // Opened again while mounted: the same file system.
    let again = Storage::open(&StorageConfig::new(&env.state, None)).expect("reopen");
    assert_eq!(again.backing(), st.backing());
    drop(again);
    // Unmounted: the loop device detaches itself (autoclear), as after a
    // reboot nothing is attached.
    Arc::try_unwrap(st).expect("one owner").release().expect("release");
    wait_until("the loop device to detach", Duration::from_secs(10), || attached(&image).is_empty());
    let st = Storage::open(&StorageConfig::new(&env.state, None)).expect("open after the unmount");
    let layer = st.open_layer(&name("reboot")).expect("open").expect("the layer is still there");
    assert_eq!(std::fs::read(layer.upper().join("workspace/f")).expect("read"), b"survives");
    assert_eq!(st.usage(&layer).expect("usage").limit_bytes, Some(100 << 20));
    // Grown when asked for more (never shrunk).
    drop(st);
    let size = |p: &std::path::Path| std::fs::metadata(p).expect("image").len();
    assert_eq!(size(&image), 1 << 30);
    let st = Storage::open(&StorageConfig::new(&env.state, Some(2 << 30))).expect("grow");
    assert_eq!(size(&image), 2 << 30);
    assert!(st.status().size_bytes > 3 << 29, "{:?}", st.status());
    drop(st);
    let st = Storage::open(&StorageConfig::new(&env.state, Some(1 << 30))).expect("no shrink");
    assert_eq!(size(&image), 2 << 30);
    drop(st);
}

#[test]
fn a_state_directory_on_btrfs_is_used_as_it_is() {
    let env = Env::new("storage-native");
    let outer = storage(&env, 1 << 30);
    // A state directory that is itself on btrfs (a plain directory of the
    // outer file system): no image, no loop device.
    let state = outer.mount_point().join("native-state");
    std::fs::create_dir(&state).expect("mkdir");
    let st = Storage::open(&StorageConfig::new(&state, None)).expect("open native");
    assert_eq!(st.backing(), &Backing::Native);
    assert!(!state.join("storage/btrfs.img").exists());
    let layer = st.create(&name("native"), UPPER_DIRS).expect("create");
    st.set_limit(&layer, Some(16 << 20)).expect("limit");
    let e = std::fs::write(layer.upper().join("workspace/f"), vec![0u8; 32 << 20]).expect_err("quota");
    assert_eq!(e.raw_os_error(), Some(libc::EDQUOT));
    assert_eq!(st.status().quota_mode, "squota");
    st.release().expect("nothing to unmount");
}

#[test]
fn spares_of_a_snapshot_are_taken_by_a_rename_and_go_with_it() {
    let env = Env::new("storage-spares");
    let st = storage(&env, 1 << 30);
    let layer = st.create(&name("spare-src"), UPPER_DIRS).expect("create");
    std::fs::write(layer.upper().join("workspace/f"), b"snapped").expect("write");
    let snap = LayerName::new(Kind::Snapshot, "snap-spares").expect("name");
    st.snapshot(&layer, &snap, true).expect("snapshot");
    std::fs::write(layer.upper().join("workspace/f"), b"later").expect("write after");
    assert_eq!(st.spares_of(&snap), 0);
    assert_eq!(st.take_spare(&snap, &name("spare-a")).expect("take"), None);
    st.keep_spares(&snap, 2).expect("refill");
    st.keep_spares(&snap, 2).expect("refill again makes none");
    assert_eq!(st.spares_of(&snap), 2);
    // A spare holds the snapshot's files, is writable, and is the taker's
    // own: its writes reach neither the snapshot nor the other spare.
    let a = st.take_spare(&snap, &name("spare-a")).expect("take").expect("one ready");
    assert_eq!((a.name(), a.read_only()), (&name("spare-a"), false));
    assert_eq!(std::fs::read(a.upper().join("workspace/f")).expect("read"), b"snapped");
    std::fs::write(a.upper().join("workspace/f"), b"mine").expect("write spare");
    let b = st.take_spare(&snap, &name("spare-b")).expect("take").expect("the second");
    assert_eq!(std::fs::read(b.upper().join("workspace/f")).expect("read"), b"snapped");
    assert_eq!(st.spares_of(&snap), 0);
    assert!(matches!(st.take_spare(&snap, &name("spare-b")), Ok(None)));
    // A taken spare is an ordinary layer: limited, deleted like any.
    st.set_limit(&a, Some(8 << 20)).expect("limit");
    assert!(st.delete(&name("spare-b")).expect("delete"));
    // Deleting the snapshot deletes its spares; an open empties spares/.
    st.keep_spares(&snap, 1).expect("refill");
    assert!(st.delete(&snap).expect("delete snapshot"));
    assert_eq!(st.spares_of(&snap), 0);
    let other = LayerName::new(Kind::Snapshot, "snap-other").expect("name");
    st.snapshot(&layer, &other, true).expect("snapshot");
    st.keep_spares(&other, 1).expect("refill");
    drop(st);
    let st = Storage::open(&StorageConfig::new(&env.state, None)).expect("reopen");
    assert_eq!(st.spares_of(&other), 0);
    assert!(std::fs::read_dir(st.mount_point().join("spares")).expect("spares/").next().is_none());
    assert_eq!(std::fs::read(a.upper().join("workspace/f")).expect("taken spare stays"), b"mine");
}
