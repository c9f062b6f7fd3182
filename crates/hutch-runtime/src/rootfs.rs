//! Root filesystems: the `base` template's lower layer, and the mounts that
//! turn a lower layer into a sandbox's root (overlay with a size-capped
//! writable layer, /usr, /proc with its masks, a minimal /dev, /sys).
//!
//! `base` needs no download: it is the host's /usr, read-only, under a small
//! directory tree of our own with a synthesized /etc. Nothing else of the
//! host is visible: the tree is built from an allow list, never by copying
//! the host's /etc.

use crate::launch::{cstr, Plan, Step};
use std::fs;
use std::io;
use std::os::unix::fs::{symlink, DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Bumped whenever the layout of `base` changes, so old trees are rebuilt.
const BASE_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
#[error("building the base root filesystem at {path}: {source}")]
pub struct RootfsError {
    pub path: PathBuf,
    pub source: io::Error,
}

/// Users every `base` sandbox has. The workload runs as `user` by default.
pub const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
user:x:1000:1000:user:/home/user:/bin/bash\n\
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";

pub const GROUP: &str = "root:x:0:\ntty:x:5:user\nusers:x:100:user\nuser:x:1000:\nnogroup:x:65534:\n";

const HOSTS: &str = "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n";

const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n\
protocols: files\nservices: files\nethers: files\nrpc: files\n";

/// A sandbox without a network has no resolver; the network layer writes a
/// real one into the sandbox's own layer when it gives it a network.
const RESOLV_CONF: &str = "# This sandbox has no network, so no resolver.\n";

/// Files taken from the host's /etc: what programs in /usr need to run,
/// nothing that holds a secret or describes the host. Regular files are
/// copied and symlinks recreated; a missing entry is skipped.
const FROM_HOST_ETC: &[&str] = &[
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates.conf",
    "protocols",
    "services",
    "ethertypes",
    "mime.types",
    "shells",
    "bash.bashrc",
    "profile",
    "inputrc",
    "os-release",
    "debian_version",
    "localtime",
    "timezone",
    "python3",
    "python3.11",
    "environment",
];

/// Returns the `base` lower layer under `state_dir`, building it first if
/// needed. Safe against concurrent builders: each builds aside and renames.
pub fn ensure_base(state_dir: &Path) -> Result<PathBuf, RootfsError> {
    let dir = state_dir.join("rootfs").join(format!("base-v{BASE_VERSION}"));
    if dir.join("etc/passwd").is_file() {
        return Ok(dir);
    }
    let tmp = state_dir.join("rootfs").join(format!(".base-v{BASE_VERSION}.{}", std::process::id()));
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RootfsError { path, source }
    };
    let _ = fs::remove_dir_all(&tmp);
    build_base(&tmp, Path::new("/")).map_err(err(&tmp))?;
    match fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        Err(_) if dir.join("etc/passwd").is_file() => {
            // Another builder won the race; theirs is as good as ours.
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(RootfsError { path: dir, source: e })
        }
    }
}

/// Builds the tree at `dir`, reading host files under `host_root`.
pub fn build_base(dir: &Path, host_root: &Path) -> io::Result<()> {
    let mkdir = |rel: &str, mode: u32| fs::DirBuilder::new().recursive(true).mode(mode).create(dir.join(rel));
    mkdir("", 0o755)?;
    for d in ["usr", "etc", "home", "proc", "sys", "dev", "run", "mnt", "opt", "srv", "var/tmp", "var/cache", "var/lib"]
    {
        mkdir(d, 0o755)?;
    }
    mkdir("root", 0o700)?;
    fs::set_permissions(dir.join("var/tmp"), fs::Permissions::from_mode(0o1777))?;
    for (link, target) in [("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib")] {
        symlink(target, dir.join(link))?;
    }
    for lib in ["lib64", "lib32", "libx32"] {
        if host_root.join("usr").join(lib).is_dir() {
            symlink(format!("usr/{lib}"), dir.join(lib))?;
        }
    }
    let etc = dir.join("etc");
    fs::write(etc.join("passwd"), PASSWD)?;
    fs::write(etc.join("group"), GROUP)?;
    fs::write(etc.join("hosts"), HOSTS)?;
    fs::write(etc.join("hostname"), "sandbox\n")?;
    fs::write(etc.join("nsswitch.conf"), NSSWITCH)?;
    fs::write(etc.join("resolv.conf"), RESOLV_CONF)?;
    fs::write(etc.join("shadow"), "root:*:19000:0:99999:7:::\nuser:*:19000:0:99999:7:::\n")?;
    fs::set_permissions(etc.join("shadow"), fs::Permissions::from_mode(0o640))?;
    for rel in FROM_HOST_ETC {
        copy_tree(&host_root.join("etc").join(rel), &etc.join(rel))?;
    }
    // The CA bundle is what TLS clients read; require it when the host has one.
    let bundle = host_root.join("etc/ssl/certs/ca-certificates.crt");
    if bundle.exists() && !etc.join("ssl/certs/ca-certificates.crt").exists() {
        fs::create_dir_all(etc.join("ssl/certs"))?;
        fs::copy(&bundle, etc.join("ssl/certs/ca-certificates.crt"))?;
    }
    Ok(())
}

/// Copies regular files, directories and symlinks (as links); anything else
/// is skipped. Missing sources are skipped.
fn copy_tree(src: &Path, dst: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(src) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if let Some(parent) = dst.parent() {
        fs::create_dir_all(parent)?;
    }
    let ft = meta.file_type();
    if ft.is_symlink() {
        symlink(fs::read_link(src)?, dst)?;
    } else if ft.is_dir() {
        fs::DirBuilder::new().mode(meta.permissions().mode() & 0o755).create(dst)?;
        for e in fs::read_dir(src)? {
            let e = e?;
            copy_tree(&e.path(), &dst.join(e.file_name()))?;
        }
    } else if ft.is_file() {
        fs::copy(src, dst)?;
        fs::set_permissions(dst, fs::Permissions::from_mode(meta.permissions().mode() & 0o755))?;
    }
    Ok(())
}

/// What the filesystem part of a sandbox's plan needs to know.
#[derive(Debug)]
pub struct FsSpec<'a> {
    /// Empty directory on the host over which the child mounts its private
    /// staging tmpfs (inside its own mount namespace, invisible to the host).
    pub stage: &'a Path,
    /// The read-only lower layers, bottom first: [`ensure_base`]'s tree,
    /// or an image's layers. Each is mounted id-mapped.
    pub lowers: &'a [PathBuf],
    /// Host directory bind mounted read-only at /usr, if any (`base` only).
    pub usr: Option<&'a Path>,
    /// Where the overlay's writes go.
    pub upper: Upper<'a>,
    /// Host id of the sandbox's root (start of its uid range).
    pub id_base: u32,
    /// Descriptor of the sandbox's user namespace, for id-mapped mounts.
    pub userns_fd: i32,
    /// An empty directory of the host that nobody can write to, bound
    /// read-only over the /proc directories the sandbox must not see (a
    /// bind costs no superblock; see [`plan_proc`]).
    pub empty: &'a Path,
    /// Size cap of /dev/shm (and /dev, which holds it).
    pub shm_bytes: u64,
    /// Most pseudo-terminals open at once (devpts `max=`): the kernel's
    /// pool for all non-initial devpts instances (`kernel.pty.max` minus
    /// `kernel.pty.reserve`) is shared by every sandbox.
    pub max_ptys: u32,
    /// Mount /proc with `hidepid=invisible`: a process sees only its own
    /// uid's processes (the process class's host containers, whose tenants
    /// are uids).
    pub hidepid: bool,
}

/// The writable layer of a sandbox's overlay.
#[derive(Debug, Clone, Copy)]
pub enum Upper<'a> {
    /// `upper/` and `work/` in the staging tmpfs, capped at this many
    /// bytes, owned by the sandbox's host ids.
    Memory(u64),
    /// A host directory holding `upper/` and `work/`, owned by the
    /// sandbox's host ids (build sandboxes, whose layer is captured after
    /// they end; see [`crate::capture`]).
    HostDir(&'a Path),
    /// A storage layer (see [`crate::storage`]) holding `upper/` and
    /// `work/`, owned by image ids: mounted id-mapped through the sandbox's
    /// user namespace, and the overlay made with the sandbox's root as its
    /// creator (see [`Step::FsIds`]).
    Layer(&'a Path),
}

/// Directories every writable layer holds in `upper/`: (path, mode, owner
/// as an image id). `base` has none of them; an image's generated top
/// layer has them too, and the layer's own copy sets their owners.
pub const UPPER_DIRS: &[(&str, u32, u32)] =
    &[("home", 0o755, 0), ("home/user", 0o750, 1000), ("workspace", 0o755, 1000), ("tmp", 0o1777, 0)];

/// What /dev holds besides /dev/shm: device nodes, links and directories.
const DEV_BYTES: u64 = 64 << 10;

/// Size of the staging tmpfs when it holds only mount points.
const STAGE_BYTES: u64 = 1 << 20;

/// /proc entries hidden behind an empty file or directory (they leak host
/// information or offer host-wide knobs): binds of /dev/null and of
/// [`FsSpec::empty`].
const PROC_MASKED_FILES: &[&str] =
    &["kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug", "sysrq-trigger", "kallsyms"];
const PROC_MASKED_DIRS: &[&str] = &["acpi", "scsi", "asound"];
/// /proc entries bound read-only.
const PROC_READONLY: &[&str] = &["bus", "fs", "irq", "sys"];

/// Devices bound from the host into the sandbox's /dev (mode, major, minor).
const DEVICES: &[(&str, u32, u32)] =
    &[("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];

/// Appends the steps that build the sandbox's root under `spec.stage/root`
/// and pivot into it.
pub fn plan_root(plan: &mut Plan, spec: &FsSpec) -> io::Result<()> {
    let stage = spec.stage;
    let root = stage.join("root");
    let (upper, work, stage_bytes) = match spec.upper {
        Upper::Memory(bytes) => (stage.join("upper"), stage.join("work"), bytes),
        Upper::HostDir(dir) => (dir.join("upper"), dir.join("work"), STAGE_BYTES),
        Upper::Layer(_) => (stage.join("layer/upper"), stage.join("layer/work"), STAGE_BYTES),
    };
    let lower = stage.join("lower");
    let base = spec.id_base;
    // Nothing we mount may propagate back to the host.
    plan.mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    plan.mount(
        Some("hutch"),
        stage,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("size={},mode=0755", stage_bytes.max(1 << 20))),
    )?;
    for d in [&root, &lower] {
        plan.mkdir(d, 0o755)?;
    }
    match spec.upper {
        Upper::Memory(_) => {
            for d in [&upper, &work] {
                plan.mkdir(d, 0o755)?;
            }
        }
        Upper::HostDir(_) => {}
        Upper::Layer(layer) => {
            // The layer keeps image ids on disk; the sandbox sees them
            // through its own range, as it sees its lower layers.
            let at = stage.join("layer");
            plan.mkdir(&at, 0o755)?;
            plan.push(Step::IdmapBind {
                source: cstr(layer)?,
                target: cstr(&at)?,
                attrs: crate::launch::MOUNT_ATTR_NOSUID | crate::launch::MOUNT_ATTR_NODEV,
                userns: spec.userns_fd,
            });
        }
    }
    if !matches!(spec.upper, Upper::Layer(_)) {
        // The writable layer's own directories: owned by the sandbox's users.
        plan.push(Step::Chown { path: cstr(&upper)?, uid: base, gid: base });
        for (rel, mode, owner) in UPPER_DIRS {
            let p = upper.join(rel);
            plan.mkdir(&p, *mode)?;
            plan.push(Step::Chmod { path: cstr(&p)?, mode: *mode });
            plan.push(Step::Chown { path: cstr(&p)?, uid: base + owner, gid: base + owner });
        }
    }
    // Lower layers appear owned by the sandbox's root, not by nobody. Each
    // gets its own mount point; overlay wants the topmost first.
    if spec.lowers.is_empty() || spec.lowers.len() > crate::image::MAX_LAYERS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a root needs 1 to 128 lower layers"));
    }
    let mut lowerdirs = Vec::with_capacity(spec.lowers.len());
    for (i, layer) in spec.lowers.iter().enumerate() {
        let target = lower.join(i.to_string());
        plan.mkdir(&target, 0o755)?;
        plan.push(Step::IdmapBind {
            source: cstr(layer)?,
            target: cstr(&target)?,
            attrs: crate::launch::MOUNT_ATTR_RDONLY
                | crate::launch::MOUNT_ATTR_NOSUID
                | crate::launch::MOUNT_ATTR_NODEV,
            userns: spec.userns_fd,
        });
        lowerdirs.push(target.display().to_string());
    }
    lowerdirs.reverse();
    let mut data =
        format!("lowerdir={},upperdir={},workdir={},volatile", lowerdirs.join(":"), upper.display(), work.display());
    if !matches!(spec.upper, Upper::Memory(_)) {
        // A captured layer, or one that outlives the sandbox (snapshots,
        // forks, diffs), must be self-contained: no file whose data stays
        // in a lower layer (metacopy), no directory renamed by reference.
        data.push_str(",redirect_dir=off,metacopy=off");
    }
    // Mount options must fit in one page.
    if data.len() >= 4000 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "overlay options too long: too many layers"));
    }
    let creator = matches!(spec.upper, Upper::Layer(_));
    if creator {
        // Overlay makes its work directory and copies files up with its
        // creator's ids; through the id-mapped layer only the sandbox's
        // range maps, so the creator must be the sandbox's root.
        plan.push(Step::FsIds { uid: base, gid: base });
    }
    plan.mount(Some("overlay"), &root, Some("overlay"), libc::MS_NOSUID, Some(&data))?;
    if creator {
        plan.push(Step::FsIds { uid: 0, gid: 0 });
    }
    if let Some(usr) = spec.usr {
        plan.push(Step::IdmapBind {
            source: cstr(usr)?,
            target: cstr(root.join("usr"))?,
            attrs: crate::launch::MOUNT_ATTR_RDONLY
                | crate::launch::MOUNT_ATTR_NOSUID
                | crate::launch::MOUNT_ATTR_NODEV,
            userns: spec.userns_fd,
        });
    }
    plan_proc(plan, &root, spec.empty, spec.hidepid)?;
    plan_dev(plan, &root, base, spec.shm_bytes, spec.max_ptys)?;
    plan.mount(Some("sysfs"), &root.join("sys"), Some("sysfs"), crate::sys::MS_RO_NOSUID_NODEV_NOEXEC, None)?;
    Ok(())
}

/// A volume a sandbox mounts: a host directory holding image ids (a
/// storage layer's), mounted id-mapped like the writable layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMount {
    pub source: PathBuf,
    /// Absolute, normalized (no `.`, `..` or empty component): checked by
    /// the caller, refused here too.
    pub target: String,
    pub read_only: bool,
}

/// Appends the steps that mount `volumes` into the root built by
/// [`plan_root`] (before the pivot). Mount points are made as the
/// sandbox's root (an id-mapped upper takes no other), and resolved with
/// no symlink followed: an image's symlink cannot send a mount elsewhere.
pub fn plan_volumes(
    plan: &mut Plan,
    stage: &Path,
    id_base: u32,
    userns_fd: i32,
    volumes: &[VolumeMount],
) -> io::Result<()> {
    if volumes.is_empty() {
        return Ok(());
    }
    let root = cstr(stage.join("root"))?;
    let mut targets = Vec::with_capacity(volumes.len());
    for v in volumes {
        let rel = v.target.strip_prefix('/').unwrap_or("");
        let parts: Vec<&str> = rel.split('/').collect();
        if rel.is_empty() || parts.iter().any(|p| p.is_empty() || *p == "." || *p == "..") {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad volume path {:?}", v.target)));
        }
        targets.push(parts.into_iter().map(cstr).collect::<io::Result<Vec<_>>>()?);
    }
    plan.push(Step::FsIds { uid: id_base, gid: id_base });
    for components in &targets {
        plan.push(Step::MkdirsAt { root: root.clone(), components: components.clone() });
    }
    plan.push(Step::FsIds { uid: 0, gid: 0 });
    for (v, components) in volumes.iter().zip(targets) {
        let mut attrs = crate::launch::MOUNT_ATTR_NOSUID | crate::launch::MOUNT_ATTR_NODEV;
        if v.read_only {
            attrs |= crate::launch::MOUNT_ATTR_RDONLY;
        }
        plan.push(Step::IdmapBindAt {
            source: cstr(&v.source)?,
            root: root.clone(),
            components,
            attrs,
            userns: userns_fd,
        });
    }
    Ok(())
}

/// Mounts /proc and hides or freezes what it must not offer. Masks are
/// binds, not file systems of their own: every superblock on the host makes
/// each memory cgroup's removal longer (the kernel walks every superblock's
/// reclaim lists as a cgroup goes), so a sandbox makes no more than it needs.
fn plan_proc(plan: &mut Plan, root: &Path, empty: &Path, hidepid: bool) -> io::Result<()> {
    let proc_dir = root.join("proc");
    let data = hidepid.then_some("hidepid=invisible");
    plan.mount(Some("proc"), &proc_dir, Some("proc"), libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC, data)?;
    let mut masks = Plan::default();
    for rel in PROC_READONLY {
        let p = proc_dir.join(rel);
        masks.bind(&p, &p, true, crate::sys::MS_RO_NOSUID_NODEV_NOEXEC)?;
    }
    for rel in PROC_MASKED_FILES {
        masks.mount(Some("/dev/null"), &proc_dir.join(rel), None, libc::MS_BIND, None)?;
    }
    for rel in PROC_MASKED_DIRS {
        masks.bind(empty, &proc_dir.join(rel), false, crate::sys::MS_RO_NOSUID_NODEV_NOEXEC)?;
    }
    for step in masks.steps {
        plan.push(Step::IfExists(Box::new(step)));
    }
    Ok(())
}

/// A minimal /dev: the harmless devices, a devpts instance of its own, and
/// /dev/shm. /dev/shm is a directory of /dev's tmpfs (sized for both), bound
/// over itself to add `nodev`: one superblock for the two (see [`plan_proc`]).
fn plan_dev(plan: &mut Plan, root: &Path, base: u32, shm_bytes: u64, max_ptys: u32) -> io::Result<()> {
    let dev = root.join("dev");
    plan.mount(
        Some("hutch"),
        &dev,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&format!("size={},mode=0755,uid={base},gid={base}", DEV_BYTES + shm_bytes.max(1 << 20))),
    )?;
    for (name, major, minor) in DEVICES {
        let p = dev.join(name);
        plan.push(Step::Mknod { path: cstr(&p)?, mode: libc::S_IFCHR | 0o666, dev: libc::makedev(*major, *minor) });
        // mknod honours the umask; the device must be usable by everyone.
        plan.push(Step::Chmod { path: cstr(&p)?, mode: 0o666 });
        plan.push(Step::Chown { path: cstr(&p)?, uid: base, gid: base });
    }
    let pts = dev.join("pts");
    plan.mkdir(&pts, 0o755)?;
    plan.mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&format!("newinstance,ptmxmode=0666,mode=0620,gid={},max={max_ptys}", base + 5)),
    )?;
    let shm = dev.join("shm");
    plan.mkdir(&shm, 0o1777)?;
    plan.push(Step::Chmod { path: cstr(&shm)?, mode: 0o1777 });
    plan.push(Step::Chown { path: cstr(&shm)?, uid: base, gid: base });
    plan.bind(&shm, &shm, false, libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC)?;
    for (target, link) in [
        ("pts/ptmx", "ptmx"),
        ("/proc/self/fd", "fd"),
        ("/proc/self/fd/0", "stdin"),
        ("/proc/self/fd/1", "stdout"),
        ("/proc/self/fd/2", "stderr"),
    ] {
        plan.push(Step::Symlink { target: cstr(target)?, path: cstr(dev.join(link))? });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_tree_holds_the_users_and_nothing_secret() {
        let dir = std::env::temp_dir().join(format!("hutch-base-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        build_base(&dir, Path::new("/")).expect("build");
        let passwd = fs::read_to_string(dir.join("etc/passwd")).expect("passwd");
        assert!(passwd.contains("user:x:1000:1000:user:/home/user:/bin/bash"));
        assert_eq!(fs::read_link(dir.join("bin")).expect("link"), Path::new("usr/bin"));
        let shadow = fs::read_to_string(dir.join("etc/shadow")).expect("shadow");
        assert!(!shadow.contains('$'), "no password hashes, ours or the host's");
        for absent in ["etc/ssh", "etc/sudoers", "etc/machine-id", "root/.bashrc", "etc/hutch"] {
            assert!(!dir.join(absent).exists(), "{absent} must not be in base");
        }
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn volumes_are_mounted_where_asked_and_bad_paths_refused() {
        let mut plan = Plan::default();
        let vols = [
            VolumeMount {
                source: PathBuf::from("/s/volumes/vol-1/upper/data"),
                target: "/data/x".into(),
                read_only: false,
            },
            VolumeMount {
                source: PathBuf::from("/s/volumes/vol-2/upper/data"),
                target: "/mnt".into(),
                read_only: true,
            },
        ];
        plan_volumes(&mut plan, Path::new("/run/hutch/stage"), 1 << 20, 9, &vols).expect("plan");
        let text: Vec<String> = plan.steps.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            text,
            [
                "take file system ids 1048576:1048576",
                "mkdir -p /run/hutch/stage/root/data/x",
                "mkdir -p /run/hutch/stage/root/mnt",
                "take file system ids 0:0",
                "id-mapped bind of /s/volumes/vol-1/upper/data on /run/hutch/stage/root/data/x",
                "id-mapped bind of /s/volumes/vol-2/upper/data on /run/hutch/stage/root/mnt",
            ]
        );
        let ro = plan.steps.iter().filter_map(|s| match s {
            Step::IdmapBindAt { attrs, .. } => Some(attrs & crate::launch::MOUNT_ATTR_RDONLY != 0),
            _ => None,
        });
        assert_eq!(ro.collect::<Vec<_>>(), [false, true]);
        for bad in ["", "/", "data", "/data/../etc", "/data//x", "/data/./x"] {
            let v = [VolumeMount { source: PathBuf::from("/s"), target: bad.into(), read_only: false }];
            assert!(plan_volumes(&mut Plan::default(), Path::new("/st"), 1, 9, &v).is_err(), "{bad}");
        }
    }

    #[test]
    fn plan_masks_proc_and_builds_dev() {
        let mut plan = Plan::default();
        let spec = FsSpec {
            stage: Path::new("/run/hutch/stage"),
            lowers: &[PathBuf::from("/var/lib/hutch/rootfs/base-v1")],
            usr: Some(Path::new("/usr")),
            upper: Upper::Memory(1 << 30),
            id_base: 1 << 31,
            userns_fd: 9,
            empty: Path::new("/run/hutch/empty"),
            shm_bytes: 64 << 20,
            max_ptys: 128,
            hidepid: false,
        };
        plan_root(&mut plan, &spec).expect("plan");
        let text: Vec<String> = plan.steps.iter().map(|s| s.to_string()).collect();
        assert!(text.iter().any(|s| s == "mount bind on /run/hutch/stage/root/proc/kcore"), "{text:#?}");
        assert!(text.iter().any(|s| s == "mknod /run/hutch/stage/root/dev/null"));
        assert!(text.iter().any(|s| s.starts_with("mount overlay on /run/hutch/stage/root")));
        assert!(text.iter().any(|s| s == "id-mapped bind of /usr on /run/hutch/stage/root/usr"));
        // Each file system mounted is a superblock, which every memory
        // cgroup's removal walks: masks and /dev/shm are binds.
        let made: Vec<&str> =
            text.iter().filter_map(|s| s.strip_prefix("mount ")).filter(|s| !s.starts_with("bind on")).collect();
        let want = [
            "tmpfs on /run/hutch/stage",
            "overlay on /run/hutch/stage/root",
            "proc on /run/hutch/stage/root/proc",
            "tmpfs on /run/hutch/stage/root/dev",
            "devpts on /run/hutch/stage/root/dev/pts",
            "sysfs on /run/hutch/stage/root/sys",
        ];
        assert_eq!(made, want, "{text:#?}");
        assert!(text.iter().any(|s| s.ends_with("bind on /run/hutch/stage/root/proc/acpi")), "{text:#?}");
        assert!(text.iter().any(|s| s == "mount bind on /run/hutch/stage/root/dev/shm"), "{text:#?}");
    }

    #[test]
    fn plan_stacks_extra_lowers_and_takes_a_given_upper() {
        let mut plan = Plan::default();
        let layers = [
            PathBuf::from("/var/lib/hutch/rootfs/base-v1"),
            PathBuf::from("/state/images/layers/aa"),
            PathBuf::from("/state/images/layers/bb"),
        ];
        let spec = FsSpec {
            stage: Path::new("/run/hutch/stage"),
            lowers: &layers,
            usr: Some(Path::new("/usr")),
            upper: Upper::HostDir(Path::new("/state/images/scratch/b1")),
            id_base: 1 << 31,
            userns_fd: 9,
            empty: Path::new("/run/hutch/empty"),
            shm_bytes: 64 << 20,
            max_ptys: 128,
            hidepid: false,
        };
        plan_root(&mut plan, &spec).expect("plan");
        let text: Vec<String> = plan.steps.iter().map(|s| s.to_string()).collect();
        assert!(text.iter().any(|s| s == "id-mapped bind of /state/images/layers/bb on /run/hutch/stage/lower/2"));
        assert!(!text.iter().any(|s| s == "mkdir /run/hutch/stage/upper"), "{text:#?}");
        let overlay = plan
            .steps
            .iter()
            .find_map(|s| match s {
                Step::Mount { data: Some(d), .. } if d.to_string_lossy().contains("lowerdir") => {
                    Some(d.to_string_lossy().into_owned())
                }
                _ => None,
            })
            .expect("an overlay mount");
        assert!(
            overlay.starts_with(
                "lowerdir=/run/hutch/stage/lower/2:/run/hutch/stage/lower/1:/run/hutch/stage/lower/0,\
                 upperdir=/state/images/scratch/b1/upper,workdir=/state/images/scratch/b1/work"
            ),
            "{overlay}"
        );
        assert!(overlay.contains("metacopy=off"));
    }

    #[test]
    fn a_disk_layer_is_mounted_id_mapped_and_the_overlay_made_as_the_sandboxs_root() {
        let mut plan = Plan::default();
        let spec = FsSpec {
            stage: Path::new("/run/hutch/stage"),
            lowers: &[PathBuf::from("/var/lib/hutch/rootfs/base-v1")],
            usr: Some(Path::new("/usr")),
            upper: Upper::Layer(Path::new("/var/lib/hutch/storage/fs/sandboxes/sb-1")),
            id_base: 1 << 31,
            userns_fd: 9,
            empty: Path::new("/run/hutch/empty"),
            shm_bytes: 64 << 20,
            max_ptys: 128,
            hidepid: false,
        };
        plan_root(&mut plan, &spec).expect("plan");
        let text: Vec<String> = plan.steps.iter().map(|s| s.to_string()).collect();
        let at = |want: &str| text.iter().position(|s| s == want).unwrap_or_else(|| panic!("{want}: {text:#?}"));
        let bind = at("id-mapped bind of /var/lib/hutch/storage/fs/sandboxes/sb-1 on /run/hutch/stage/layer");
        let as_sandbox_root = at("take file system ids 2147483648:2147483648");
        let overlay = at("mount overlay on /run/hutch/stage/root");
        let back = at("take file system ids 0:0");
        assert!(bind < as_sandbox_root && as_sandbox_root + 1 == overlay && overlay + 1 == back, "{text:#?}");
        // The layer brings its own directories, owned by image ids: the
        // plan makes and chowns nothing in it.
        assert!(!text.iter().any(|s| s.starts_with("chown /run/hutch/stage/layer")), "{text:#?}");
        assert!(!text.iter().any(|s| s.starts_with("mkdir /run/hutch/stage/layer/")), "{text:#?}");
        let data = plan
            .steps
            .iter()
            .find_map(|s| match s {
                Step::Mount { data: Some(d), .. } if d.to_string_lossy().contains("lowerdir") => {
                    Some(d.to_string_lossy().into_owned())
                }
                _ => None,
            })
            .expect("an overlay mount");
        assert!(
            data.contains("upperdir=/run/hutch/stage/layer/upper,workdir=/run/hutch/stage/layer/work,volatile"),
            "{data}"
        );
        assert!(data.contains("redirect_dir=off,metacopy=off"), "{data}");
    }
}
