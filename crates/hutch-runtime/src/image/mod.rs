//! The image store: root filesystems as stacks of content-addressed layers
//! on the host, shared between images and mounted read-only (id-mapped) as
//! overlay lower layers of every sandbox that runs on them. It is the one
//! owner of `<state_dir>/images/` (mode 0700: layers hold files owned by
//! the image's own ids, setuid bits included, and no host user may reach
//! them); template builds keep their cache, scratch layers and logs there
//! through it too:
//!
//! - `layers/<hex>/`: one layer in overlayfs form (a whiteout is a 0:0
//!   character device, an opaque directory carries
//!   `trusted.overlay.opaque=y`), built in `tmp/` and renamed into place,
//!   never written after that. An imported layer is named by the sha256 of
//!   its uncompressed tar (the OCI diff_id); a layer made on the host by
//!   [`ImageStore::commit_layer`]: its [`tree_digest`] for a shared layer
//!   (an image's generated top layer), or a digest of its owner and its
//!   tree digest for a layer of one owner's build ([`LayerScope`]), so no
//!   owner's layer is ever the directory another owner's names.
//! - `images/<name>.json`: an [`Image`], written to a temporary file and
//!   renamed. Names `tpl-*` are reserved for template builds' images,
//!   which name their owner.
//! - `cache/<owner>/<key>`: the build step cache, one directory per owner
//!   (a digest of the owner's id), each entry naming a layer.
//! - `builds/<id>.log`: build logs. `scratch/`: build sandboxes' writable
//!   layers (size-capped tmpfs mounts). `tmp/`: layers and downloads being
//!   made (`tmp/build-*` for builds).
//!
//! Every layer that comes from outside is untrusted: see [`extract`].

pub mod archive;
pub mod debian;
pub mod export;
pub mod extract;
pub mod interp;
pub mod moved;
pub mod push;
pub mod registry;
mod top;
pub mod tree;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use debian::ensure_preset;
pub use extract::{import_layer, Limits};
pub use tree::tree_digest;

/// Most layers an image may stack (overlayfs allows 500; the mount options
/// must also fit one page).
pub const MAX_LAYERS: usize = 128;

/// Layers younger than this are never collected: an import or a build may
/// have committed them and not yet written the image that names them.
const GC_GRACE: Duration = Duration::from_secs(3600);

/// The name reserved for the host-based root filesystem (not in the store).
pub const BASE: &str = "base";

/// An image: a named stack of layers and the metadata a sandbox on it gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    pub name: String,
    /// Layer digests (hex), bottom first; the last is our generated layer.
    pub layers: Vec<String>,
    /// `K=V` entries from the image's configuration.
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    #[serde(default)]
    pub workdir: Option<String>,
    /// Where it came from: `debian:bookworm+python3`, `import:FILE`, `pull:REF`.
    pub source: String,
    /// Unix seconds.
    pub created_at: u64,
    /// Set on a template build's image: the image (`base`, a preset, a
    /// store image) its `layers` go over; they are then only the build's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The key that owns a template build's image; none for the host's
    /// shared images (imports, pulls, Debian images, presets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl Image {
    /// Whether every key may name the image: the host's own images, not a
    /// template build's (an old build's image that names no owner is no
    /// one's to share either).
    pub fn is_shared(&self) -> bool {
        self.owner.is_none() && self.parent.is_none() && !is_build_name(&self.name)
    }

    /// The image's environment as pairs; malformed entries are skipped.
    pub fn env_pairs(&self) -> Vec<(String, String)> {
        self.env
            .iter()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .filter(|(k, _)| !k.is_empty())
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("no image {0:?}")]
    NotFound(String),
    #[error("image {name:?}: {reason}")]
    Invalid { name: String, reason: String },
    #[error("layer refused: {0}")]
    LayerRefused(String),
    #[error("registry: {0}")]
    Registry(String),
    #[error("building image {name:?}: {reason}")]
    Build { name: String, reason: String },
    #[error("image store: {what}: {source}")]
    Io { what: String, source: io::Error },
}

impl ImageError {
    /// The stable code of each error: one exhaustive match.
    pub fn code(&self) -> &'static str {
        match self {
            ImageError::NotFound(_) => "image_not_found",
            ImageError::Invalid { .. } => "image_invalid",
            ImageError::LayerRefused(_) => "image_layer_refused",
            ImageError::Registry(_) => "registry_error",
            ImageError::Build { .. } => "image_build_failed",
            ImageError::Io { .. } => "internal",
        }
    }
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// Whether `name` may name an image: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'-'))
}

/// Prefix of the names of template builds' images (`tpl-<id>-v<n>`),
/// reserved for them.
pub const BUILD_PREFIX: &str = "tpl-";

/// Whether `name` is under the prefix reserved for builds' images.
pub fn is_build_name(name: &str) -> bool {
    name.starts_with(BUILD_PREFIX)
}

/// The local name of a registry reference or a file: lowercased, every run
/// of other characters turned into one `-`, leading punctuation dropped, cut
/// to 63 bytes. `localhost:5000/x/y:tag` becomes `localhost-5000-x-y-tag`.
pub fn local_name(reference: &str) -> String {
    let mut out = String::new();
    for c in reference.chars().map(|c| c.to_ascii_lowercase()) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '_' {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let trimmed = out.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
    let mut name: String = trimmed.chars().take(63).collect();
    while name.ends_with('-') {
        name.pop();
    }
    if name.is_empty() {
        "image".into()
    } else {
        name
    }
}

/// Whether `hex` is 64 lowercase hex digits (a layer's or a key's name).
pub fn valid_hex(hex: &str) -> bool {
    hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A random name for something temporary.
pub(crate) fn random_suffix() -> String {
    crate::sys::random_hex(8)
}

/// The image store of one state directory.
#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
}

/// An image's summary, for listings.
#[derive(Debug, Clone, Serialize)]
pub struct ImageSummary {
    pub name: String,
    /// Whether every key may name it ([`Image::is_shared`]).
    pub shared: bool,
    /// The key that owns a build's image.
    pub owner: Option<String>,
    pub layers: usize,
    /// Bytes of the image's layers on disk (shared layers counted in full).
    pub size_bytes: u64,
    pub source: String,
    pub created_at: u64,
}

impl ImageStore {
    /// Opens (and creates) the store under `state_dir`.
    pub fn open(state_dir: &Path) -> Result<ImageStore, ImageError> {
        let root = state_dir.join("images");
        let dirs = ["", "layers", "images", "tmp", "cache", "builds", "scratch"].map(|d| root.join(d));
        for dir in dirs {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(io_err(format!("mkdir {}", dir.display())))?;
        }
        // Layers hold setuid files owned by the image's ids: no host user may
        // reach them, whatever the state directory's own mode.
        fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(io_err(format!("chmod {}", root.display())))?;
        Ok(ImageStore { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the layer `hex` lives (whether or not it exists).
    pub fn layer_dir(&self, hex: &str) -> PathBuf {
        self.root.join("layers").join(hex)
    }

    pub fn has_layer(&self, hex: &str) -> bool {
        valid_hex(hex) && self.layer_dir(hex).is_dir()
    }

    /// A fresh path under `tmp/` for an archive received from a client
    /// (`tmp/upload-*`): [`ImageStore::gc`] removes one an hour after its
    /// last write, if its importer did not.
    pub fn upload_path(&self) -> PathBuf {
        self.root.join("tmp").join(format!("upload-{}", random_suffix()))
    }

    /// A new empty directory beside the layers, for a layer being made (then
    /// [`ImageStore::commit_layer`]) or a download.
    pub fn temp_dir(&self) -> Result<PathBuf, ImageError> {
        let dir = self.root.join("tmp").join(random_suffix());
        fs::DirBuilder::new().mode(0o755).create(&dir).map_err(io_err(format!("mkdir {}", dir.display())))?;
        Ok(dir)
    }

    fn image_path(&self, name: &str) -> PathBuf {
        self.root.join("images").join(format!("{name}.json"))
    }

    pub fn get(&self, name: &str) -> Result<Image, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::NotFound(name.to_owned()));
        }
        let text = match fs::read(self.image_path(name)) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ImageError::NotFound(name.to_owned())),
            Err(e) => return Err(io_err(format!("read image {name}"))(e)),
        };
        let image: Image = serde_json::from_slice(&text)
            .map_err(|e| ImageError::Invalid { name: name.to_owned(), reason: format!("unreadable record: {e}") })?;
        if image.name != name || image.layers.iter().any(|h| !valid_hex(h)) {
            return Err(ImageError::Invalid { name: name.to_owned(), reason: "inconsistent record".into() });
        }
        Ok(image)
    }

    /// Every readable image, by name.
    pub fn list(&self) -> Vec<Image> {
        let mut out = Vec::new();
        if let Ok(rd) = fs::read_dir(self.root.join("images")) {
            for e in rd.flatten() {
                let file = e.file_name();
                let Some(name) = file.to_str().and_then(|f| f.strip_suffix(".json")) else { continue };
                if let Ok(img) = self.get(name) {
                    out.push(img);
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Listings with sizes.
    pub fn summaries(&self) -> Vec<ImageSummary> {
        self.list()
            .into_iter()
            .map(|img| ImageSummary {
                shared: img.is_shared(),
                owner: img.owner.clone(),
                layers: img.layers.len(),
                size_bytes: img.layers.iter().map(|h| self.layer_size(h)).sum(),
                name: img.name,
                source: img.source,
                created_at: img.created_at,
            })
            .collect()
    }

    /// Bytes of a layer's regular files, from a `size` file written at commit
    /// (computed once and kept).
    fn layer_size(&self, hex: &str) -> u64 {
        let meta = self.root.join("layers").join(format!(".{hex}.size"));
        if let Some(n) = fs::read_to_string(&meta).ok().and_then(|s| s.trim().parse().ok()) {
            return n;
        }
        let n = dir_size(&self.layer_dir(hex));
        let _ = fs::write(&meta, n.to_string());
        n
    }

    /// Records an image (atomically). Every layer must exist.
    pub fn put(&self, image: &Image) -> Result<(), ImageError> {
        if !valid_name(&image.name) || image.name == BASE {
            return Err(ImageError::Invalid {
                name: image.name.clone(),
                reason: "names are 1 to 63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit; \
                         `base` is reserved"
                    .into(),
            });
        }
        // `tpl-*` names a template build's image, which names its owner and
        // its parent; no other image may take such a name.
        let built = image.parent.is_some() && image.owner.is_some();
        if is_build_name(&image.name) != built {
            return Err(ImageError::Invalid {
                name: image.name.clone(),
                reason: format!(
                    "names starting with `{BUILD_PREFIX}` are reserved for template builds' images \
                     (which name their owner and parent)"
                ),
            });
        }
        // A build's image may add no layer to its parent; a root needs one.
        let least = usize::from(image.parent.is_none());
        if image.layers.len() < least || image.layers.len() > MAX_LAYERS {
            return Err(ImageError::Invalid {
                name: image.name.clone(),
                reason: format!("an image has {least} to {MAX_LAYERS} layers"),
            });
        }
        if let Some(missing) = image.layers.iter().find(|h| !self.has_layer(h)) {
            return Err(ImageError::Invalid { name: image.name.clone(), reason: format!("no layer {missing}") });
        }
        let body = serde_json::to_vec_pretty(image)
            .map_err(|e| ImageError::Invalid { name: image.name.clone(), reason: format!("cannot encode: {e}") })?;
        let tmp = self.root.join("images").join(format!(".{}.{}", image.name, random_suffix()));
        let write = || -> io::Result<()> {
            let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            fs::rename(&tmp, self.image_path(&image.name))
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err(format!("write image {}", image.name))(e)
        })
    }

    /// Forgets an image. Its layers stay until [`ImageStore::gc`].
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        if !valid_name(name) {
            return Err(ImageError::NotFound(name.to_owned()));
        }
        match fs::remove_file(self.image_path(name)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ImageError::NotFound(name.to_owned())),
            Err(e) => Err(io_err(format!("remove image {name}"))(e)),
        }
    }

    /// The one way a layer made on the host enters the store: moves a
    /// finished layer directory (made under [`ImageStore::temp_dir`] or
    /// [`ImageStore::build_temp_dir`]) to `layers/<hex>`, named by its
    /// [`tree_digest`] within `scope`, and returns that name. If the store
    /// has that layer already, `tmp_dir` is removed instead. The tree must
    /// hold image ids (below 65536) and no device node but whiteouts
    /// (sockets are deleted first); anything else refuses it (and removes
    /// it).
    pub fn commit_layer(&self, tmp_dir: &Path, scope: LayerScope<'_>) -> Result<String, ImageError> {
        // Sockets a build's processes left behind mean nothing in an image.
        prune_sockets(tmp_dir, 0);
        let hex = match tree_digest(tmp_dir) {
            Ok(h) => scope.name(&h),
            Err(e) => {
                let _ = fs::remove_dir_all(tmp_dir);
                return Err(e);
            }
        };
        self.commit_as(tmp_dir, &hex)?;
        Ok(hex)
    }

    /// The layer a build step of `owner` made under cache key `key`, if it
    /// is still in the store. Only that owner's entries are ever read.
    pub fn cached_step(&self, owner: &str, key: &str) -> Option<String> {
        if !valid_hex(key) {
            return None;
        }
        let hex = fs::read_to_string(self.owner_cache(owner).join(key)).ok()?;
        let hex = hex.trim();
        self.has_layer(hex).then(|| hex.to_owned())
    }

    /// Records that `owner`'s build step `key` made layer `hex`.
    pub fn remember_step(&self, owner: &str, key: &str, hex: &str) -> Result<(), ImageError> {
        if !valid_hex(key) || !valid_hex(hex) {
            return Err(ImageError::Invalid { name: key.to_owned(), reason: "not a cache key or layer".into() });
        }
        let dir = self.owner_cache(owner);
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(io_err("make the build cache"))?;
        let tmp = dir.join(format!(".{key}.{}", random_suffix()));
        fs::write(&tmp, hex).and_then(|()| fs::rename(&tmp, dir.join(key))).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err("record a build cache entry")(e)
        })
    }

    /// Forgets every build cache entry of `owner` (its layers stay until
    /// [`ImageStore::gc`]).
    pub fn forget_owner_cache(&self, owner: &str) -> Result<(), ImageError> {
        match fs::remove_dir_all(self.owner_cache(owner)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove a build cache")(e)),
            _ => Ok(()),
        }
    }

    /// `cache/<digest of owner>`: the owner's id is never a path.
    fn owner_cache(&self, owner: &str) -> PathBuf {
        let mut h = Sha256::new();
        h.update(b"hutch-build-cache-owner\0");
        h.update(owner.as_bytes());
        self.root.join("cache").join(&hex::encode(h.finalize())[..32])
    }

    /// Removes the step cache entries of earlier versions, which were
    /// keyed without their owner (`cache/<key>` files): they could answer
    /// one owner's step with another's layer. Returns how many went.
    pub fn drop_unowned_cache(&self) -> Result<usize, ImageError> {
        let mut n = 0;
        for e in fs::read_dir(self.root.join("cache")).map_err(io_err("list the build cache"))?.flatten() {
            if e.file_type().is_ok_and(|t| !t.is_dir()) {
                fs::remove_file(e.path()).map_err(io_err("remove an old build cache entry"))?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// A new empty directory for a build to make a layer in (then
    /// [`ImageStore::commit_layer`]); what a stopped build left of these
    /// goes with [`ImageStore::sweep_builds`].
    pub fn build_temp_dir(&self, what: &str) -> Result<PathBuf, ImageError> {
        let dir = self.build_temp_path(what);
        fs::DirBuilder::new().mode(0o755).create(&dir).map_err(io_err(format!("mkdir {}", dir.display())))?;
        Ok(dir)
    }

    /// Like [`ImageStore::build_temp_dir`], but not made (for a
    /// [`crate::capture::capture`], which makes its destination).
    pub fn build_temp_path(&self, what: &str) -> PathBuf {
        self.root.join("tmp").join(format!("build-{what}-{}", random_suffix()))
    }

    /// Where a build sandbox's scratch layer is mounted (not made yet).
    pub fn scratch_dir(&self) -> PathBuf {
        self.root.join("scratch").join(random_suffix())
    }

    /// The log of build `id` (an id the caller checked).
    pub fn build_log(&self, id: &str) -> PathBuf {
        self.root.join("builds").join(format!("{id}.log"))
    }

    /// Removes what builds and API imports of an earlier run of the daemon
    /// left: scratch mounts, half-made layers, spooled archives
    /// (`upload-*`). Imports of the CLI's `--local` (which may run now)
    /// keep their temporary directories.
    pub fn sweep_builds(&self) {
        crate::capture::sweep_scratch(&self.root.join("scratch"));
        if let Ok(entries) = fs::read_dir(self.root.join("tmp")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("build-") {
                    let _ = fs::remove_dir_all(e.path());
                } else if name.starts_with("upload-") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }

    /// Moves `tmp_dir` to `layers/<hex>` (or drops it if that exists).
    pub(crate) fn commit_as(&self, tmp_dir: &Path, hex: &str) -> Result<(), ImageError> {
        let dst = self.layer_dir(hex);
        if dst.is_dir() {
            let _ = fs::remove_dir_all(tmp_dir);
            return Ok(());
        }
        match fs::rename(tmp_dir, &dst) {
            Ok(()) => Ok(()),
            Err(_) if dst.is_dir() => {
                // A concurrent commit of the same content won.
                let _ = fs::remove_dir_all(tmp_dir);
                Ok(())
            }
            Err(e) => {
                let _ = fs::remove_dir_all(tmp_dir);
                Err(io_err(format!("commit layer {hex}"))(e))
            }
        }
    }

    /// Removes layers no image names (older than an hour, so that imports
    /// and builds in progress keep theirs) and stale temporary files.
    /// Returns the digests removed. Sandboxes still running on a removed
    /// image keep their mounts, but files they have not opened yet vanish:
    /// run it when none do.
    pub fn gc(&self) -> Result<Vec<String>, ImageError> {
        let _lock = self.lock(libc::LOCK_EX)?;
        let used: std::collections::HashSet<String> = self.list().into_iter().flat_map(|i| i.layers).collect();
        let old = |p: &Path| {
            fs::symlink_metadata(p)
                .and_then(|m| m.modified())
                .map(|t| t.elapsed().unwrap_or_default() > GC_GRACE)
                .unwrap_or(false)
        };
        let mut removed = Vec::new();
        let layers = self.root.join("layers");
        for e in fs::read_dir(&layers).map_err(io_err("list layers"))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if valid_hex(&name) && !used.contains(&name) && old(&e.path()) {
                fs::remove_dir_all(e.path()).map_err(io_err(format!("remove layer {name}")))?;
                let _ = fs::remove_file(layers.join(format!(".{name}.size")));
                removed.push(name);
            }
        }
        for e in fs::read_dir(self.root.join("tmp")).map_err(io_err("list tmp"))?.flatten() {
            if old(&e.path()) {
                let _ = fs::remove_dir_all(e.path()).or_else(|_| fs::remove_file(e.path()));
            }
        }
        Ok(removed)
    }

    /// A lock over the whole store: imports and builds hold it shared, the
    /// collector exclusive, preset builds exclusive on their own file.
    pub(crate) fn lock(&self, how: libc::c_int) -> Result<fs::File, ImageError> {
        self.lock_file(".lock", how)
    }

    pub(crate) fn lock_file(&self, name: &str, how: libc::c_int) -> Result<fs::File, ImageError> {
        let path = self.root.join(name);
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(format!("open {}", path.display())))?;
        loop {
            // SAFETY: flock on a descriptor we own; no memory is involved.
            if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
                return Ok(f);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(io_err(format!("lock {}", path.display()))(e));
            }
        }
    }

    /// Records an image made of `layers` (bottom first) plus our generated
    /// top layer (see [`top`]), under `name`.
    pub fn finish_image(
        &self,
        name: &str,
        layers: Vec<String>,
        config: ImageConfig,
        source: String,
    ) -> Result<Image, ImageError> {
        if !valid_name(name) || name == BASE || is_build_name(name) {
            return Err(ImageError::Invalid {
                name: name.to_owned(),
                reason: format!("not a valid image name (`base` and `{BUILD_PREFIX}*` are reserved)"),
            });
        }
        if layers.len() + 1 > MAX_LAYERS {
            return Err(ImageError::Invalid {
                name: name.to_owned(),
                reason: format!("{} layers; at most {} are allowed", layers.len(), MAX_LAYERS - 1),
            });
        }
        let dirs: Vec<PathBuf> = layers.iter().map(|h| self.layer_dir(h)).collect();
        let tmp = self.temp_dir()?;
        if let Err(e) = top::build(&tmp, &dirs) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(io_err("generate the image's top layer")(e));
        }
        let top = self.commit_layer(&tmp, LayerScope::Shared)?;
        let mut all = layers;
        all.push(top);
        let image = Image {
            name: name.to_owned(),
            layers: all,
            env: config.env,
            cmd: config.cmd,
            workdir: config.workdir,
            source,
            created_at: now_secs(),
            parent: None,
            owner: None,
        };
        self.put(&image)?;
        Ok(image)
    }

    /// The directories of an image's layers, bottom first, all present.
    pub fn layer_dirs(&self, image: &Image) -> Result<Vec<PathBuf>, ImageError> {
        image
            .layers
            .iter()
            .map(|h| {
                if self.has_layer(h) {
                    Ok(self.layer_dir(h))
                } else {
                    Err(ImageError::Invalid { name: image.name.clone(), reason: format!("layer {h} is missing") })
                }
            })
            .collect()
    }
}

/// Whose a layer made on the host is, which decides its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerScope<'a> {
    /// A layer any image may share (an image's generated top layer): named
    /// by its [`tree_digest`], one directory for the same content.
    Shared,
    /// A layer of one owner's build: named by a digest of the owner and
    /// its tree digest, so the same content of two owners is two
    /// directories, and nothing about a layer (its name, whether a commit
    /// found it there, its files' times) says what another owner has.
    Owner(&'a str),
}

impl LayerScope<'_> {
    fn name(&self, tree: &str) -> String {
        match self {
            LayerScope::Shared => tree.to_owned(),
            LayerScope::Owner(owner) => {
                let mut h = Sha256::new();
                for part in [&b"hutch-owner-layer-v1"[..], owner.as_bytes(), tree.as_bytes()] {
                    h.update((part.len() as u64).to_le_bytes());
                    h.update(part);
                }
                hex::encode(h.finalize())
            }
        }
    }
}

/// What an image's configuration says about how to run it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub cmd: Vec<String>,
    pub workdir: Option<String>,
}

impl ImageConfig {
    /// Reads the `config` object of an OCI or Docker image configuration.
    pub fn from_oci(config: &serde_json::Value) -> ImageConfig {
        let c = &config["config"];
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter().filter_map(|s| s.as_str()).take(1024).map(|s| s.chars().take(8192).collect()).collect()
                })
                .unwrap_or_default()
        };
        let mut cmd = strings(&c["Entrypoint"]);
        cmd.extend(strings(&c["Cmd"]));
        let workdir = c["WorkingDir"].as_str().filter(|w| w.starts_with('/') && w.len() <= 4096).map(str::to_owned);
        ImageConfig { env: strings(&c["Env"]), cmd, workdir }
    }
}

/// Deletes the unix sockets under `dir` (never following a symlink).
fn prune_sockets(dir: &Path, depth: usize) {
    use std::os::unix::fs::FileTypeExt;
    if depth > extract::MAX_DEPTH {
        return;
    }
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        match e.file_type() {
            Ok(t) if t.is_socket() => {
                let _ = fs::remove_file(e.path());
            }
            Ok(t) if t.is_dir() => prune_sockets(&e.path(), depth + 1),
            _ => {}
        }
    }
}

fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.path().symlink_metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                total += m.len();
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_references() {
        for ok in ["python", "a", "x.y_z-1", &"a".repeat(63)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "-a", ".a", "A", "a/b", "a:b", &"a".repeat(64), "../x"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert_eq!(local_name("localhost:5000/x/y:tag"), "localhost-5000-x-y-tag");
        assert_eq!(local_name("/tmp/My Image.tar"), "tmp-my-image.tar");
        assert_eq!(local_name("::"), "image");
        assert!(valid_name(&local_name(&"Z/".repeat(100))));
    }

    #[test]
    fn store_round_trip_commit_dedupe_and_gc() {
        let state = std::env::temp_dir().join(format!("hutch-images-{}", random_suffix()));
        let store = ImageStore::open(&state).expect("open");
        let make = |content: &str| {
            let d = store.temp_dir().expect("tmp");
            fs::create_dir(d.join("etc")).expect("mkdir");
            fs::write(d.join("etc/hello"), content).expect("write");
            d
        };
        let a = store.commit_layer(&make("one"), LayerScope::Shared).expect("commit");
        let tmp = make("one");
        assert_eq!(store.commit_layer(&tmp, LayerScope::Shared).expect("commit again"), a, "same content, same digest");
        assert!(!tmp.exists(), "a duplicate is dropped");
        let b = store.commit_layer(&make("two"), LayerScope::Shared).expect("commit");
        assert_ne!(a, b);
        let img = store.finish_image("t1", vec![a.clone()], ImageConfig::default(), "test".into()).expect("finish");
        assert_eq!(img.layers.len(), 2);
        assert_eq!(store.get("t1").expect("get"), img);
        assert_eq!(store.list().len(), 1);
        assert!(matches!(store.get("nope"), Err(ImageError::NotFound(_))));
        assert!(store.put(&Image { name: "base".into(), ..img.clone() }).is_err());
        // A root needs a layer; a build over a parent may add none.
        assert!(store.put(&Image { name: "empty".into(), layers: vec![], ..img.clone() }).is_err());
        let over = Image {
            name: "tpl-0123456789abcdef-v2".into(),
            layers: vec![],
            parent: Some("t1".into()),
            owner: Some("key-a".into()),
            ..img.clone()
        };
        store.put(&over).expect("a build that added no layer");
        assert_eq!(store.get(&over.name).expect("get"), over);
        assert!(!over.is_shared() && img.is_shared());
        // `tpl-*` is a build's, with its owner and parent; nothing else.
        let unowned = Image { owner: None, ..over.clone() };
        assert!(store.put(&unowned).is_err(), "a build's image names its owner");
        assert!(store.put(&Image { name: "over".into(), ..over.clone() }).is_err(), "a build's image is tpl-*");
        assert!(store.put(&Image { name: "tpl-x".into(), ..img.clone() }).is_err(), "tpl-* is reserved");
        assert!(store.finish_image("tpl-x", vec![a.clone()], ImageConfig::default(), "t".into()).is_err());
        store.remove(&over.name).expect("remove");
        // Layer b is unused but young: kept. Make it old, then it goes.
        assert!(store.gc().expect("gc").is_empty());
        let old = SystemTime::now() - Duration::from_secs(7200);
        fs::File::open(store.layer_dir(&b)).and_then(|f| f.set_modified(old)).expect("age");
        fs::File::open(store.layer_dir(&a)).and_then(|f| f.set_modified(old)).expect("age");
        assert_eq!(store.gc().expect("gc"), vec![b.clone()]);
        assert!(store.has_layer(&a), "a layer in use is kept");
        // A tree with host ids or a device node is no layer.
        let bad = make("three");
        std::os::unix::fs::chown(bad.join("etc/hello"), Some(70_000), None).expect("chown");
        let err = store.commit_layer(&bad, LayerScope::Shared).expect_err("ids outside the image");
        assert_eq!(err.code(), "image_layer_refused");
        assert!(!bad.exists(), "a refused tree is removed");
        let bad = make("four");
        let dev = std::ffi::CString::new(bad.join("etc/null").into_os_string().into_encoded_bytes()).expect("c");
        // SAFETY: dev is a valid C string.
        assert_eq!(unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) }, 0);
        assert!(store
            .commit_layer(&bad, LayerScope::Shared)
            .expect_err("a device node")
            .to_string()
            .contains("device"));
        let with_socket = make("one");
        let _listener = std::os::unix::net::UnixListener::bind(with_socket.join("etc/sock")).expect("bind");
        assert_eq!(store.commit_layer(&with_socket, LayerScope::Shared).expect("sockets are dropped"), a);
        store.remove("t1").expect("rm");
        assert!(matches!(store.remove("t1"), Err(ImageError::NotFound(_))));
        fs::remove_dir_all(&state).expect("cleanup");
    }

    #[test]
    fn owners_layers_and_cache_entries_are_their_own() {
        let state = std::env::temp_dir().join(format!("hutch-images-own-{}", random_suffix()));
        let store = ImageStore::open(&state).expect("open");
        let make = || {
            let d = store.build_temp_dir("t").expect("tmp");
            fs::write(d.join("secret"), "same bytes").expect("write");
            d
        };
        let shared = store.commit_layer(&make(), LayerScope::Shared).expect("commit");
        let a = store.commit_layer(&make(), LayerScope::Owner("key-a")).expect("commit");
        let b = store.commit_layer(&make(), LayerScope::Owner("key-b")).expect("commit");
        // The same content: three directories, none named after another's.
        assert_eq!(shared, tree_digest(&store.layer_dir(&shared)).expect("digest"));
        assert!(a != b && a != shared && b != shared, "{a} {b} {shared}");
        assert_eq!(store.commit_layer(&make(), LayerScope::Owner("key-a")).expect("again"), a);
        // A step cache entry answers its owner only.
        let key = "1".repeat(64);
        assert_eq!(store.cached_step("key-a", &key), None);
        store.remember_step("key-a", &key, &a).expect("remember");
        assert_eq!(store.cached_step("key-a", &key), Some(a.clone()));
        assert_eq!(store.cached_step("key-b", &key), None, "another owner's entry");
        assert_eq!(store.cached_step("key-a", "../x"), None);
        // Entries of the old flat layout are dropped, owners' kept.
        fs::write(store.root().join("cache").join("2".repeat(64)), &a).expect("old entry");
        assert_eq!(store.drop_unowned_cache().expect("drop"), 1);
        assert_eq!(store.cached_step("key-a", &key), Some(a.clone()));
        store.forget_owner_cache("key-a").expect("forget");
        assert_eq!(store.cached_step("key-a", &key), None);
        // Builds' leftovers and spooled uploads go; a local import's
        // temporary directory stays.
        let import = store.temp_dir().expect("tmp");
        let left = store.build_temp_dir("run").expect("tmp");
        let upload = store.upload_path();
        fs::write(&upload, b"half an archive").expect("upload");
        store.sweep_builds();
        assert!(import.is_dir() && !left.exists() && !upload.exists());
        fs::remove_dir_all(&state).expect("cleanup");
    }
}
