//! Disk storage of sandboxes' writable layers: one btrfs file system owned
//! by the runtime under `<state>/storage/`, a subvolume per layer, a quota
//! group limit per subvolume, snapshots by the kernel's copy-on-write.
//!
//! ```text
//! <state>/storage/            0700, this module's alone
//!   btrfs.img                 the sparse image, when the state directory
//!                             is not on btrfs (attached to a loop device)
//!   fs/                       where that image is mounted; on a btrfs
//!                             state directory, a plain directory of it
//!     sandboxes/<id>/         a sandbox's writable layer (a subvolume):
//!       upper/  work/         the overlay's upper and work directories
//!     snapshots/<id>/         read-only or writable copies of layers
//!     volumes/<id>/           layers that outlive sandboxes
//!     spares/<snap>.<hex>/    writable copies of snapshots made ahead for
//!                             sandboxes to take; emptied at every open
//!     tmp/                    layers being made; emptied at every open
//! ```
//!
//! Files in a layer carry the *image's* ids (0 to 65535, as image layers
//! do), never a sandbox's host range: the runtime mounts a layer id-mapped
//! through the sandbox's user namespace, as it mounts lower layers, so a
//! layer written by one sandbox can be mounted by another with another
//! range (a snapshot, a fork) and its owners stay right.
//!
//! Every primitive on a create's path is one ioctl or a few `*at` calls on
//! directory descriptors held open (measured here: a subvolume create
//! ~0.04 ms, a quota limit ~0.003 ms, a delete ~0.03 ms; a snapshot commits
//! a transaction, ~3 ms with simple quotas, 10-30 ms with full quota
//! groups: see [`Quotas`]). Usage comes from the quota group's figures in
//! sysfs (`/sys/fs/btrfs/<fsid>/qgroups/0_<subvolume>`): committed bytes
//! plus what is reserved for writes not committed yet.
//!
//! `unsafe` in this module (btrfs.rs, loopdev.rs and the `*at` wrappers at
//! the end of this file) is the storage's own, each block with a SAFETY
//! note.

pub mod btrfs;
pub mod diff;
mod loopdev;
pub mod seed;

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Size of a new storage image when the operator sets none: 64 GiB, or the
/// free space of the state directory's file system if that is less. The
/// image is sparse: it takes host disk only as layers fill it (and gives it
/// back as they are deleted: the file system discards freed blocks, which
/// punches holes in the image).
pub const DEFAULT_SIZE: u64 = 64 << 30;
/// The smallest image we make (btrfs itself needs ~110 MiB).
pub const MIN_SIZE: u64 = 256 << 20;
/// Where the kernel shows btrfs file systems and their quota groups.
pub const SYSFS: &str = "/sys/fs/btrfs";

/// Mount options of the image: no set-id or device files reach the host
/// through it, no access-time writes, freed blocks go back to the image's
/// file as they are freed.
const MOUNT_FLAGS: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
const MOUNT_DATA: &str = "discard=async";

/// What kind of thing a layer is: each lives in a directory of its own, so
/// a sweep of one kind never touches another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A sandbox's writable layer, named after the sandbox.
    Sandbox,
    /// A copy of a layer taken at one instant.
    Snapshot,
    /// A layer that outlives sandboxes.
    Volume,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Sandbox, Kind::Snapshot, Kind::Volume];

    fn dir(self) -> &'static str {
        match self {
            Kind::Sandbox => "sandboxes",
            Kind::Snapshot => "snapshots",
            Kind::Volume => "volumes",
        }
    }

    fn index(self) -> usize {
        match self {
            Kind::Sandbox => 0,
            Kind::Snapshot => 1,
            Kind::Volume => 2,
        }
    }
}

/// A layer's name: its kind and an id (1 to 64 of `a-z 0-9 - _ .`, not
/// starting with `.` or `-`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayerName {
    kind: Kind,
    id: String,
}

impl LayerName {
    pub fn new(kind: Kind, id: &str) -> Result<LayerName, StorageError> {
        let ok = !id.is_empty()
            && id.len() <= 64
            && !id.starts_with(['.', '-'])
            && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(StorageError::InvalidName(id.to_owned()));
        }
        Ok(LayerName { kind, id: id.to_owned() })
    }

    /// The writable layer of sandbox `id`.
    pub fn sandbox(id: &str) -> Result<LayerName, StorageError> {
        LayerName::new(Kind::Sandbox, id)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn id(&self) -> &str {
        &self.id
    }
}

impl fmt::Display for LayerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind.dir(), self.id)
    }
}

/// One layer: a subvolume holding `upper/` and `work/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    name: LayerName,
    path: PathBuf,
    subvol: u64,
    read_only: bool,
}

impl Layer {
    pub fn name(&self) -> &LayerName {
        &self.name
    }

    /// The subvolume's root directory on the host.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The btrfs subvolume id (its level-0 quota group is `0/<id>`).
    pub fn subvol_id(&self) -> u64 {
        self.subvol
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The overlay's upper directory: the files of the sandbox's root that
    /// differ from its image (with overlay's whiteouts for deletions).
    pub fn upper(&self) -> PathBuf {
        self.path.join("upper")
    }
}

/// What a layer holds, from its quota group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerUsage {
    /// Bytes it takes now: referenced as of the last commit plus what is
    /// reserved for writes since. This is what its limit is checked against.
    pub used_bytes: u64,
    /// Bytes it references as of the last commit (shared with snapshots
    /// included).
    pub referenced_bytes: u64,
    /// Bytes only it references as of the last commit: what deleting it
    /// would free.
    pub exclusive_bytes: u64,
    /// Its limit, if any.
    pub limit_bytes: Option<u64>,
}

/// How the file system charges bytes to layers, which decides what a
/// layer's limit and usage mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quotas {
    /// Simple quotas (`squota`, Linux 6.7+; what a file system of ours gets
    /// where the kernel has them): bytes are charged to the layer that
    /// wrote them. A layer made from a snapshot starts at zero and its
    /// limit caps what it writes on top; a snapshot is charged nothing
    /// (its bytes stay charged to the layer that wrote them, even after
    /// that layer is deleted).
    Simple,
    /// Full quota groups (`qgroup`): every layer is charged for every byte
    /// it references, shared ones included, so a layer made from a
    /// snapshot starts at the snapshot's size. Each snapshot costs an
    /// accounting commit.
    Full,
}

/// Where the file system comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// The state directory's own btrfs.
    Native,
    /// An image file of ours attached to a loop device.
    Image { image: PathBuf, device: PathBuf },
}

/// The file system as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub backing: Backing,
    pub mount: PathBuf,
    pub size_bytes: u64,
    pub used_bytes: u64,
    /// `qgroup` or `squota`.
    pub quota_mode: String,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        match &self.backing {
            Backing::Native => write!(f, "btrfs of the state directory at {}", self.mount.display())?,
            Backing::Image { image, device } => {
                write!(f, "btrfs on {} ({}) mounted at {}", image.display(), device.display(), self.mount.display())?
            }
        }
        write!(f, ", {:.1} of {:.1} GiB used, quotas: {}", gib(self.used_bytes), gib(self.size_bytes), self.quota_mode)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("invalid layer name {0:?}: use 1 to 64 of a-z, 0-9, '-', '_' and '.', not starting with '.' or '-'")]
    InvalidName(String),
    #[error("layer {0} already exists")]
    Exists(LayerName),
    #[error("layer {0} does not exist")]
    NotFound(LayerName),
    #[error("layer {0} is read-only: a sandbox writes into a writable snapshot of it")]
    ReadOnly(LayerName),
    #[error("this host has no btrfs: {0}")]
    NoBtrfs(String),
    #[error("this host has no loop devices (/dev/loop-control): {0}")]
    NoLoop(io::Error),
    #[error("{path} is a mount of {fstype}, not btrfs: unmount it or use another state directory")]
    Foreign { path: PathBuf, fstype: String },
    #[error(
        "{path} has {free} bytes free; the storage image needs at least {needed}: free space or set --storage-size"
    )]
    NoSpace { path: PathBuf, free: u64, needed: u64 },
    #[error("storage size {0} is below the minimum of {MIN_SIZE} bytes")]
    TooSmall(u64),
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: io::Error },
}

impl StorageError {
    /// Whether the file system ran out of space (or of metadata space).
    pub fn is_full(&self) -> bool {
        matches!(self, StorageError::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

fn io_err(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> StorageError {
    let path = path.into();
    move |source| StorageError::Io { what, path, source }
}

/// How to open the storage.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    pub state_dir: PathBuf,
    /// Size of the image when one is made (None: [`DEFAULT_SIZE`] or the
    /// free space); an existing image smaller than this is grown to it.
    pub size: Option<u64>,
    /// Normally [`SYSFS`].
    pub sysfs: PathBuf,
}

impl StorageConfig {
    pub fn new(state_dir: &Path, size: Option<u64>) -> StorageConfig {
        StorageConfig { state_dir: state_dir.to_path_buf(), size, sysfs: PathBuf::from(SYSFS) }
    }
}

/// The storage of one state directory. Cheap to share (`Arc`): every
/// method takes `&self` and works on directory descriptors opened once.
#[derive(Debug)]
pub struct Storage {
    mount: PathBuf,
    backing: Backing,
    fsid: [u8; 16],
    sysfs: PathBuf,
    quotas: Quotas,
    /// The mount's root directory.
    top: OwnedFd,
    /// One directory per [`Kind`], in [`Kind::index`] order.
    kinds: [OwnedFd; 3],
    tmp: OwnedFd,
    /// `spares/`: see [`Storage::make_spare`].
    spares: OwnedFd,
    refilling: std::sync::Mutex<()>,
}

impl Storage {
    /// Opens the storage of a state directory, making and mounting its file
    /// system if needed: the state directory's own btrfs, or an image of
    /// ours (made once from the btrfs seed, attached to a loop device, mounted
    /// at `<state>/storage/fs`). An image mounted already (by an earlier
    /// daemon) is used as it is; after a host reboot it is attached and
    /// mounted again. Quotas are switched on; layers half made by an
    /// earlier run (`tmp/`) are deleted.
    pub fn open(cfg: &StorageConfig) -> Result<Storage, StorageError> {
        let root = cfg.state_dir.join("storage");
        let mount = root.join("fs");
        for d in [&root, &mount] {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(d).map_err(io_err("mkdir", d))?;
        }
        let mounted = mount_at(&read_mountinfo()?, &mount);
        let backing = match mounted {
            Some(m) if m.fstype == "btrfs" => Backing::Image { image: root.join("btrfs.img"), device: m.source.into() },
            Some(m) => return Err(StorageError::Foreign { path: mount, fstype: m.fstype }),
            None if fs_type(&cfg.state_dir)? == btrfs::SUPER_MAGIC => Backing::Native,
            None => mount_image(&root, &mount, cfg.size)?,
        };
        if let (Backing::Image { image, device }, Some(size)) = (&backing, cfg.size) {
            grow(image, device, &mount, size)?;
        }
        let top = open_dir(&mount)?;
        let fsid = btrfs::fsid(top.as_fd()).map_err(io_err("read the file system id of", &mount))?;
        let quotas = match btrfs::quota_mode(&cfg.sysfs, &fsid).as_deref() {
            Some("squota") => Quotas::Simple,
            // A file system with full quota groups on (an earlier
            // version's) keeps them: switching would drop every limit.
            Some(_) => Quotas::Full,
            None => match btrfs::quota_enable_simple(top.as_fd()) {
                Ok(()) => Quotas::Simple,
                // Kernels before 6.7 know only full quota groups.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => {
                    btrfs::quota_enable(top.as_fd()).map_err(io_err("enable quotas on", &mount))?;
                    Quotas::Full
                }
                Err(e) => return Err(io_err("enable simple quotas on", &mount)(e)),
            },
        };
        let dir = |name: &str| -> Result<OwnedFd, StorageError> {
            let p = mount.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err("mkdir", &p)(e)),
            }
            open_dir(&p)
        };
        let kinds = [dir(Kind::Sandbox.dir())?, dir(Kind::Snapshot.dir())?, dir(Kind::Volume.dir())?];
        let tmp = dir("tmp")?;
        let spares = dir("spares")?;
        let storage = Storage {
            mount,
            backing,
            fsid,
            sysfs: cfg.sysfs.clone(),
            quotas,
            top,
            kinds,
            tmp,
            spares,
            refilling: std::sync::Mutex::new(()),
        };
        // Spares are made again on demand: none is kept across an open.
        for name in list_dir(&storage.mount.join("spares"))? {
            delete_subvol_or_dir(&storage.spares, &storage.mount.join("spares"), &name)?;
        }
        for name in list_dir(&storage.mount.join("tmp"))? {
            delete_subvol_or_dir(&storage.tmp, &storage.mount.join("tmp"), &name)?;
        }
        Ok(storage)
    }

    pub fn mount_point(&self) -> &Path {
        &self.mount
    }

    /// How layers' bytes are counted (see [`Quotas`]).
    pub fn quotas(&self) -> Quotas {
        self.quotas
    }

    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    fn kind_fd(&self, kind: Kind) -> &OwnedFd {
        &self.kinds[kind.index()]
    }

    fn path_of(&self, name: &LayerName) -> PathBuf {
        self.mount.join(name.kind.dir()).join(&name.id)
    }

    /// Makes an empty layer: `upper/` (0755, image root's) holding `dirs`
    /// (path under upper, mode, owner as an image id: uid = gid), and
    /// `work/`. It is made under `tmp/` and renamed into place, so a layer
    /// under its name is always whole. No limit is set.
    pub fn create(&self, name: &LayerName, dirs: &[(&str, u32, u32)]) -> Result<Layer, StorageError> {
        let tmp_name = format!("{}.{}", name.id, crate::sys::random_hex(4));
        let tmp_path = self.mount.join("tmp").join(&tmp_name);
        btrfs::subvol_create(self.tmp.as_fd(), &tmp_name).map_err(io_err("create subvolume", &tmp_path))?;
        let made = (|| -> Result<Layer, StorageError> {
            let fd = openat_dir(&self.tmp, &tmp_name).map_err(io_err("open", &tmp_path))?;
            fchmod(&fd, 0o700).map_err(io_err("chmod", &tmp_path))?;
            mkdirat(&fd, "upper", 0o755, 0).map_err(io_err("mkdir upper in", &tmp_path))?;
            mkdirat(&fd, "work", 0o700, 0).map_err(io_err("mkdir work in", &tmp_path))?;
            for (rel, mode, owner) in dirs {
                mkdirat(&fd, &format!("upper/{rel}"), *mode, *owner).map_err(io_err("mkdir in", &tmp_path))?;
            }
            let subvol = btrfs::subvol_id(fd.as_fd()).map_err(io_err("look up subvolume", &tmp_path))?;
            match renameat_noreplace(&self.tmp, &tmp_name, self.kind_fd(name.kind), &name.id) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => return Err(StorageError::Exists(name.clone())),
                Err(e) => return Err(io_err("rename into place", self.path_of(name))(e)),
            }
            Ok(Layer { name: name.clone(), path: self.path_of(name), subvol, read_only: false })
        })();
        if made.is_err() {
            let _ = btrfs::subvol_delete(self.tmp.as_fd(), &tmp_name);
        }
        made
    }

    /// The layer `name`, if it exists.
    pub fn open_layer(&self, name: &LayerName) -> Result<Option<Layer>, StorageError> {
        let path = self.path_of(name);
        let fd = match openat_dir(self.kind_fd(name.kind), &name.id) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let ino = fstat(&fd).map_err(io_err("stat", &path))?.st_ino;
        if ino != 256 {
            return Err(io_err("open layer", &path)(io::Error::new(io::ErrorKind::InvalidData, "not a subvolume")));
        }
        let subvol = btrfs::subvol_id(fd.as_fd()).map_err(io_err("look up subvolume", &path))?;
        let read_only = btrfs::subvol_read_only(fd.as_fd()).map_err(io_err("read the flags of", &path))?;
        Ok(Some(Layer { name: name.clone(), path, subvol, read_only }))
    }

    /// Snapshots `source` as `name`: writable (a sandbox's layer to start
    /// from, a fork) or read-only (a snapshot to keep). The snapshot holds
    /// every write made to `source` before the call; it shares all its
    /// blocks with `source` until either changes. No limit is set.
    pub fn snapshot(&self, source: &Layer, name: &LayerName, read_only: bool) -> Result<Layer, StorageError> {
        let src = open_dir(&source.path)?;
        match btrfs::snapshot(src.as_fd(), self.kind_fd(name.kind).as_fd(), &name.id, read_only) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => return Err(StorageError::Exists(name.clone())),
            Err(e) => return Err(io_err("snapshot", &source.path)(e)),
        }
        self.open_layer(name)?.ok_or_else(|| StorageError::NotFound(name.clone()))
    }

    /// Makes a spare of snapshot layer `snapshot`: a writable copy of it,
    /// ready for [`Storage::take_spare`], so that a sandbox started from
    /// the snapshot takes its layer by a rename (microseconds) rather than
    /// a snapshot (a transaction commit, ~3 ms with simple quotas). Spares
    /// live in `spares/<snapshot>.<hex>`; none is kept across an open, and
    /// deleting the snapshot deletes its spares.
    pub fn make_spare(&self, snapshot: &LayerName) -> Result<(), StorageError> {
        let source = self.open_layer(snapshot)?.ok_or_else(|| StorageError::NotFound(snapshot.clone()))?;
        let src = open_dir(&source.path)?;
        let name = format!("{}.{}", snapshot.id, crate::sys::random_hex(4));
        btrfs::snapshot(src.as_fd(), self.spares.as_fd(), &name, false)
            .map_err(io_err("snapshot a spare of", &source.path))
    }

    /// How many spares snapshot layer `snapshot` has now.
    pub fn spares_of(&self, snapshot: &LayerName) -> usize {
        self.spare_names(snapshot).len()
    }

    /// Makes spares of `snapshot` until it has `want` (one refill at a time
    /// per storage, so concurrent refills do not overshoot).
    pub fn keep_spares(&self, snapshot: &LayerName, want: usize) -> Result<(), StorageError> {
        let _one = self.refilling.lock().unwrap_or_else(|p| p.into_inner());
        for _ in self.spares_of(snapshot)..want {
            self.make_spare(snapshot)?;
        }
        Ok(())
    }

    fn spare_names(&self, snapshot: &LayerName) -> Vec<String> {
        let prefix = format!("{}.", snapshot.id);
        list_dir(&self.mount.join("spares"))
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.strip_prefix(&prefix).is_some_and(|rest| !rest.contains('.')))
            .collect()
    }

    /// Takes a spare of snapshot layer `snapshot` as layer `name` (a
    /// rename); None when it has none left (another taker may have won
    /// the last one).
    pub fn take_spare(&self, snapshot: &LayerName, name: &LayerName) -> Result<Option<Layer>, StorageError> {
        for spare in self.spare_names(snapshot) {
            match renameat_noreplace(&self.spares, &spare, self.kind_fd(name.kind), &name.id) {
                Ok(()) => return self.open_layer(name),
                // Taken by a concurrent taker: try the next.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => return Err(StorageError::Exists(name.clone())),
                Err(e) => return Err(io_err("take a spare as", self.path_of(name))(e)),
            }
        }
        Ok(None)
    }

    /// Deletes layer `name` with everything in it; false if there was none.
    /// Its blocks are freed by the kernel in the background (those shared
    /// with a snapshot stay with the snapshot).
    pub fn delete(&self, name: &LayerName) -> Result<bool, StorageError> {
        // No refill runs meanwhile: none makes a spare of a snapshot going.
        let _one = (name.kind == Kind::Snapshot).then(|| self.refilling.lock().unwrap_or_else(|p| p.into_inner()));
        if name.kind == Kind::Snapshot {
            for spare in self.spare_names(name) {
                if let Err(e) = btrfs::subvol_delete(self.spares.as_fd(), &spare) {
                    if e.raw_os_error() != Some(libc::ENOENT) {
                        return Err(io_err("delete the spare", self.mount.join("spares").join(&spare))(e));
                    }
                }
            }
        }
        match btrfs::subvol_delete(self.kind_fd(name.kind).as_fd(), &name.id) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(io_err("delete", self.path_of(name))(e)),
        }
    }

    /// Sets the most bytes a layer may hold (None: no limit). Writes past
    /// it fail with EDQUOT ("Disk quota exceeded").
    pub fn set_limit(&self, layer: &Layer, bytes: Option<u64>) -> Result<(), StorageError> {
        btrfs::qgroup_limit(self.top.as_fd(), layer.subvol, bytes).map_err(io_err("set the quota of", &layer.path))
    }

    /// What a layer holds now (see [`LayerUsage`]).
    pub fn usage(&self, layer: &Layer) -> Result<LayerUsage, StorageError> {
        let q = btrfs::qgroup_info(&self.sysfs, &self.fsid, layer.subvol)
            .map_err(io_err("read the quota group of", &layer.path))?;
        Ok(LayerUsage {
            used_bytes: q.referenced.saturating_add(q.reserved),
            referenced_bytes: q.referenced,
            exclusive_bytes: q.exclusive,
            limit_bytes: q.max_referenced,
        })
    }

    /// Readies a layer for a sandbox's overlay: overlay refuses an upper
    /// whose last `volatile` mount left its mark (`work/work/incompat`),
    /// which every such mount does, cleanly unmounted or not. Data the
    /// kernel had not written back when the host went down may be missing
    /// from such a layer; it is mounted anyway, as a machine boots after a
    /// crash (see ARCHITECTURE.md, "The writable layer").
    pub fn prepare_mount(&self, layer: &Layer) -> Result<(), StorageError> {
        let fd = open_dir(&layer.path)?;
        for (rel, dir) in [
            ("work/work/incompat/volatile/dirty", false),
            ("work/work/incompat/volatile", true),
            ("work/work/incompat", true),
        ] {
            match unlinkat(&fd, rel, dir) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                // "dirty" is a directory on some kernels.
                Err(e) if !dir && e.raw_os_error() == Some(libc::EISDIR) => {
                    unlinkat(&fd, rel, true).map_err(io_err("remove", layer.path.join(rel)))?
                }
                Err(e) => return Err(io_err("remove", layer.path.join(rel))(e)),
            }
        }
        Ok(())
    }

    /// Names of the layers of one kind.
    pub fn list(&self, kind: Kind) -> Result<Vec<String>, StorageError> {
        list_dir(&self.mount.join(kind.dir()))
    }

    /// Deletes every layer of `kind` that `keep` does not want; returns the
    /// names deleted. Failures are logged and left for the next sweep.
    pub fn sweep(&self, kind: Kind, keep: impl Fn(&str) -> bool) -> Vec<String> {
        let mut deleted = Vec::new();
        let names = match self.list(kind) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("storage sweep: {e}");
                return deleted;
            }
        };
        for name in names.into_iter().filter(|n| !keep(n)) {
            match delete_subvol_or_dir(self.kind_fd(kind), &self.mount.join(kind.dir()), &name) {
                Ok(()) => deleted.push(name),
                Err(e) => tracing::warn!("storage sweep: {e}"),
            }
        }
        deleted
    }

    /// Writes everything written to the file system so far to its device
    /// (and, for an image, to the host's disk): the durability point of a
    /// layer, whose overlay mount is `volatile`.
    pub fn sync(&self) -> Result<(), StorageError> {
        // SAFETY: syncfs takes a descriptor and no memory.
        if unsafe { libc::syncfs(self.top.as_raw_fd()) } < 0 {
            return Err(io_err("sync", &self.mount)(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Size, use and origin of the file system.
    pub fn status(&self) -> Status {
        let (size_bytes, used_bytes) = statvfs_used(&self.mount).unwrap_or((0, 0));
        Status {
            backing: self.backing.clone(),
            mount: self.mount.clone(),
            size_bytes,
            used_bytes,
            quota_mode: btrfs::quota_mode(&self.sysfs, &self.fsid).unwrap_or_else(|| "off".into()),
        }
    }

    /// Unmounts an image's file system (its loop device detaches itself
    /// once no sandbox holds it); a native one has nothing to undo. For a
    /// daemon that stops with no sandbox left.
    pub fn release(self) -> Result<(), StorageError> {
        // Every descriptor of the mount is closed before the unmount.
        let Storage { mount, backing, top, kinds, tmp, spares, .. } = self;
        drop((top, kinds, tmp, spares));
        if let Backing::Image { .. } = backing {
            umount(&mount).map_err(io_err("unmount", &mount))?;
        }
        Ok(())
    }
    /// Like [`Storage::release`] for a storage still shared (the runtime's
    /// `Arc`): the image's mount is detached from the host's tree now and
    /// goes, with its loop device, once this process's descriptors close
    /// (at exit). For a daemon that stops with no sandbox running: the
    /// next start mounts the image again.
    pub fn detach(&self) -> Result<(), StorageError> {
        if let Backing::Image { .. } = self.backing {
            let c = crate::launch::cstr(&self.mount).map_err(io_err("unmount", &self.mount))?;
            // SAFETY: c is a valid C string.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } < 0 {
                return Err(io_err("unmount", &self.mount)(io::Error::last_os_error()));
            }
        }
        Ok(())
    }
}

/// Makes (once) and mounts the image of `root`; returns how it is backed.
fn mount_image(root: &Path, mount: &Path, size: Option<u64>) -> Result<Backing, StorageError> {
    if !loopdev::available() {
        return Err(StorageError::NoLoop(io::Error::from(io::ErrorKind::NotFound)));
    }
    let image = root.join("btrfs.img");
    if !image.exists() {
        make_image(root, &image, size)?;
    }
    // Attached already: an earlier daemon's device, still held by sandboxes
    // (the host's mount of it was undone) or never mounted.
    let (device, held) = match loopdev::find(&image) {
        Some(d) => (d, None),
        None => {
            let a = loopdev::attach(&image).map_err(|e| match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENXIO) => StorageError::NoLoop(e),
                _ => io_err("attach a loop device to", &image)(e),
            })?;
            (a.device, Some(a.fd))
        }
    };
    let mounted = mount_btrfs(&device, mount);
    drop(held);
    mounted.map_err(|e| match e.raw_os_error() {
        Some(libc::ENODEV) => StorageError::NoBtrfs(format!("mount -t btrfs {}: {e}", device.display())),
        _ => io_err("mount", mount)(e),
    })?;
    // A file system made from the seed is smaller than its image until it
    // grows to the device's size (a no-op once it has).
    let top = open_dir(mount)?;
    btrfs::resize_max(top.as_fd()).map_err(io_err("resize the file system at", mount))?;
    Ok(Backing::Image { image, device })
}

/// Makes the sparse image and its file system under a temporary name, then
/// renames it into place: an image under its name is always whole.
fn make_image(root: &Path, image: &Path, size: Option<u64>) -> Result<(), StorageError> {
    let size = match size {
        Some(s) if s < MIN_SIZE => return Err(StorageError::TooSmall(s)),
        Some(s) => s,
        None => {
            let free = statvfs_free(root).map_err(io_err("statvfs", root))?;
            if free < MIN_SIZE {
                return Err(StorageError::NoSpace { path: root.to_path_buf(), free, needed: MIN_SIZE });
            }
            DEFAULT_SIZE.min(free)
        }
    };
    let size = size & !((1 << 20) - 1);
    let tmp = root.join(format!(".btrfs.img.{}", crate::sys::random_hex(4)));
    let made = (|| -> Result<(), StorageError> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        f.set_len(size).map_err(io_err("size", &tmp))?;
        // The seed's file system (no mkfs.btrfs); it grows to the image's
        // size when mounted.
        seed::write_fs(&f).map_err(io_err("write a btrfs file system into", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, image).map_err(io_err("rename", image))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made
}

/// Grows an image (and its file system) to `size` when it is smaller.
/// Shrinking is never done: a smaller size than the image's is ignored.
fn grow(image: &Path, device: &Path, mount: &Path, size: u64) -> Result<(), StorageError> {
    let size = size & !((1 << 20) - 1);
    let now = std::fs::metadata(image).map_err(io_err("stat", image))?.len();
    if size <= now {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new().write(true).open(image).map_err(io_err("open", image))?;
    f.set_len(size).map_err(io_err("grow", image))?;
    loopdev::set_capacity(device).map_err(io_err("resize", device))?;
    let top = open_dir(mount)?;
    btrfs::resize_max(top.as_fd()).map_err(io_err("resize the file system at", mount))?;
    tracing::info!("storage image {} grown to {size} bytes", image.display());
    Ok(())
}

/// One line of /proc/self/mountinfo, the parts we need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub fstype: String,
    pub source: String,
}

/// The mount on top at `target` in a mountinfo text, if any. A pure
/// function over the kernel's text (mount points are octal-escaped there).
pub fn mount_at(mountinfo: &str, target: &Path) -> Option<MountEntry> {
    let want = target.as_os_str().as_bytes();
    let mut found = None;
    for line in mountinfo.lines() {
        let mut fields = line.split(' ');
        let Some(point) = fields.nth(4) else { continue };
        if unescape(point) != want {
            continue;
        }
        let mut rest = fields.skip_while(|f| *f != "-");
        rest.next();
        let (Some(fstype), Some(source)) = (rest.next(), rest.next()) else { continue };
        found =
            Some(MountEntry { fstype: fstype.to_owned(), source: String::from_utf8_lossy(&unescape(source)).into() });
    }
    found
}

/// Undoes mountinfo's `\NNN` octal escapes.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') as u32 * 64 + (b[i + 2] - b'0') as u32 * 8 + (b[i + 3] - b'0') as u32;
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

fn read_mountinfo() -> Result<String, StorageError> {
    std::fs::read_to_string("/proc/self/mountinfo").map_err(io_err("read", "/proc/self/mountinfo"))
}

/// What a doctor can learn about a state directory's storage without
/// changing anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Mounted and usable.
    Mounted(Status),
    /// An image exists but is not mounted (the daemon mounts it at start).
    Unmounted { image: PathBuf, size_bytes: u64 },
    /// Nothing yet; the daemon would make it (an image, or the state
    /// directory's own btrfs).
    None { native: bool },
    /// Something that is not ours, or not btrfs, is mounted there.
    Foreign { path: PathBuf, fstype: String },
}

/// Whether a storage could be made here where none exists yet: btrfs in
/// the kernel, and for an image, loop devices. Says what is missing.
pub fn can_make(native: bool) -> Result<(), String> {
    kernel_support(Path::new("/proc"), Path::new("/lib/modules"))?;
    if native {
        return Ok(());
    }
    if !loopdev::available() {
        return Err("no loop devices (/dev/loop-control)".into());
    }
    Ok(())
}

/// Looks at a state directory's storage, read-only.
pub fn inspect(state_dir: &Path) -> Found {
    let root = state_dir.join("storage");
    let mount = root.join("fs");
    let image = root.join("btrfs.img");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    match mount_at(&mountinfo, &mount) {
        Some(m) if m.fstype != "btrfs" => Found::Foreign { path: mount, fstype: m.fstype },
        Some(m) => Found::Mounted(status_of(&mount, Backing::Image { image, device: m.source.into() })),
        None => {
            let native = fs_type(state_dir).is_ok_and(|t| t == btrfs::SUPER_MAGIC);
            if native && mount.is_dir() {
                Found::Mounted(status_of(&mount, Backing::Native))
            } else if let Ok(meta) = std::fs::metadata(&image) {
                Found::Unmounted { image, size_bytes: meta.len() }
            } else {
                Found::None { native }
            }
        }
    }
}

fn status_of(mount: &Path, backing: Backing) -> Status {
    let (size_bytes, used_bytes) = statvfs_used(mount).unwrap_or((0, 0));
    let quota_mode = open_dir(mount)
        .ok()
        .and_then(|fd| btrfs::fsid(fd.as_fd()).ok())
        .and_then(|fsid| btrfs::quota_mode(Path::new(SYSFS), &fsid))
        .unwrap_or_else(|| "off".into());
    Status { backing, mount: mount.to_path_buf(), size_bytes, used_bytes, quota_mode }
}

/// Whether this host's kernel can mount btrfs (built in, loaded, or a
/// module it can load), and why not.
pub fn kernel_support(proc_root: &Path, modules_root: &Path) -> Result<(), String> {
    let fs = std::fs::read_to_string(proc_root.join("filesystems")).unwrap_or_default();
    if fs.lines().any(|l| l.split_whitespace().last() == Some("btrfs")) {
        return Ok(());
    }
    let release = crate::sys::kernel_release();
    let dir = modules_root.join(&release);
    let listed =
        |file: &str| std::fs::read_to_string(dir.join(file)).is_ok_and(|t| t.lines().any(|l| l.contains("/btrfs.ko")));
    if listed("modules.builtin") || listed("modules.dep") {
        return Ok(());
    }
    Err(format!("btrfs is neither in {}/filesystems nor a module of Linux {release}", proc_root.display()))
}

// ---------------------------------------------------------------------------
// System calls on directory descriptors.

fn open_dir(path: &Path) -> Result<OwnedFd, StorageError> {
    crate::sys::open(path, libc::O_RDONLY | libc::O_DIRECTORY).map_err(io_err("open", path))
}

fn openat_dir(dir: &OwnedFd, name: &str) -> io::Result<OwnedFd> {
    let c = crate::sys::cstr(name)?;
    // SAFETY: c is a valid C string; the descriptor returned is owned below.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// mkdirat + fchmodat (the umask narrows mkdir's mode) + fchownat, the
/// owner as uid = gid.
fn mkdirat(dir: &OwnedFd, rel: &str, mode: u32, owner: u32) -> io::Result<()> {
    let c = crate::sys::cstr(rel)?;
    // SAFETY: c is a valid C string for the duration of each call below.
    unsafe {
        if libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), mode) < 0
            || libc::fchmodat(dir.as_raw_fd(), c.as_ptr(), mode, 0) < 0
            || libc::fchownat(dir.as_raw_fd(), c.as_ptr(), owner, owner, libc::AT_SYMLINK_NOFOLLOW) < 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn fchmod(fd: &OwnedFd, mode: u32) -> io::Result<()> {
    // SAFETY: fchmod takes a descriptor and no memory.
    if unsafe { libc::fchmod(fd.as_raw_fd(), mode) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: zeroed is a valid stat (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn unlinkat(dir: &OwnedFd, rel: &str, is_dir: bool) -> io::Result<()> {
    let c = crate::sys::cstr(rel)?;
    let flags = if is_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: c is a valid C string.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn renameat_noreplace(from_dir: &OwnedFd, from: &str, to_dir: &OwnedFd, to: &str) -> io::Result<()> {
    let (a, b) = (crate::sys::cstr(from)?, crate::sys::cstr(to)?);
    // SAFETY: a and b are valid C strings.
    let r = unsafe {
        libc::renameat2(from_dir.as_raw_fd(), a.as_ptr(), to_dir.as_raw_fd(), b.as_ptr(), libc::RENAME_NOREPLACE)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Deletes a subvolume of `dir`; an entry that is not one (a stray
/// directory) is removed as a tree.
fn delete_subvol_or_dir(dir: &OwnedFd, path: &Path, name: &str) -> Result<(), StorageError> {
    match btrfs::subvol_delete(dir.as_fd(), name) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        // Not a subvolume.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOTDIR) | Some(libc::EPERM)) => {
            let p = path.join(name);
            std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p)).map_err(io_err("remove", p))
        }
        Err(e) => Err(io_err("delete", path.join(name))(e)),
    }
}

fn list_dir(path: &Path) -> Result<Vec<String>, StorageError> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(path).map_err(io_err("list", path))? {
        let e = e.map_err(io_err("list", path))?;
        if let Some(n) = e.file_name().to_str() {
            names.push(n.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// `statfs.f_type` of the file system holding `path`.
pub(crate) fn fs_type(path: &Path) -> Result<i64, StorageError> {
    let c = crate::launch::cstr(path).map_err(io_err("statfs", path))?;
    // SAFETY: zeroed is a valid statfs (plain integers).
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string, st a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io_err("statfs", path)(io::Error::last_os_error()));
    }
    Ok(st.f_type as i64)
}

fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    let c = crate::launch::cstr(path)?;
    // SAFETY: zeroed is a valid statvfs (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string, st a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// (size, used) bytes of the file system holding `path`.
fn statvfs_used(path: &Path) -> io::Result<(u64, u64)> {
    let st = statvfs(path)?;
    let size = st.f_blocks.saturating_mul(st.f_frsize);
    Ok((size, size.saturating_sub(st.f_bfree.saturating_mul(st.f_frsize))))
}

/// Bytes an unprivileged writer may still use on the file system of `path`.
fn statvfs_free(path: &Path) -> io::Result<u64> {
    let st = statvfs(path)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

fn mount_btrfs(device: &Path, target: &Path) -> io::Result<()> {
    let (src, dst) = (crate::launch::cstr(device)?, crate::launch::cstr(target)?);
    let data = crate::sys::cstr(MOUNT_DATA)?;
    // SAFETY: every pointer is a valid C string for the call.
    let r = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), c"btrfs".as_ptr(), MOUNT_FLAGS, data.as_ptr().cast()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn umount(target: &Path) -> io::Result<()> {
    let c = crate::launch::cstr(target)?;
    // SAFETY: c is a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_are_plain() {
        assert!(LayerName::sandbox("sb-0123abcd").is_ok());
        assert!(LayerName::new(Kind::Snapshot, "snap-1.v2_x").is_ok());
        for bad in ["", ".", "..", ".x", "-x", "A", "a/b", "a b", "a\0b", &"a".repeat(65)] {
            assert!(LayerName::sandbox(bad).is_err(), "{bad:?}");
        }
        assert_eq!(LayerName::sandbox("x").expect("name").to_string(), "sandboxes/x");
    }

    #[test]
    fn mountinfo_finds_the_top_mount_at_a_path() {
        let text = "22 27 0:21 / /proc rw,relatime - proc proc rw\n\
                    90 27 7:0 / /var/lib/my\\040state/storage/fs rw,nosuid - tmpfs none rw\n\
                    91 90 7:0 / /var/lib/my\\040state/storage/fs rw,nosuid shared:5 - btrfs /dev/loop0 rw,space_cache=v2\n\
                    bad line\n";
        let m = mount_at(text, Path::new("/var/lib/my state/storage/fs")).expect("found");
        assert_eq!(m, MountEntry { fstype: "btrfs".into(), source: "/dev/loop0".into() });
        assert_eq!(mount_at(text, Path::new("/var/lib/my state")), None);
        assert_eq!(mount_at(text, Path::new("/proc")).map(|m| m.fstype), Some("proc".into()));
        // Garbage never panics.
        for junk in ["", "\\", "a b c d \\7", "1 2 3 4 /x - ", "1 2 3 4 \\777 5 - t s"] {
            let _ = mount_at(junk, Path::new("/x"));
        }
    }
}
