//! Export of layers in overlayfs form (the image store's, a snapshot's
//! upper directory) as one image archive that `docker load`, `podman load`
//! and our own import read: an OCI image layout (oci-layout, index.json,
//! blobs/sha256/...) that also carries a `docker save` manifest.json over
//! the same blobs, as `docker save` of Docker 25 and later writes it.
//!
//! Layers leave in the tar form of the OCI specification: a whiteout (a
//! 0:0 character device) becomes an empty `.wh.<name>`, an opaque
//! directory (`trusted.overlay.opaque=y`) gets a `.wh..wh..opq` entry.
//! They are not compressed, so a layer's blob digest is its diff_id.
//!
//! Nothing is buffered or written to disk: the layers are immutable (store
//! layers are never written after their commit, a snapshot is a read-only
//! subvolume) and the tar writer is deterministic (entries sorted by name,
//! modes, image ids and modification times from `lstat`, no access or
//! change times, no user or group names), so each layer is written twice:
//! once into a hashing counter, which gives its digest and size before
//! the archive's first byte (and the whole archive's length), then into
//! the archive, checked against the first pass as it goes.
//!
//! Layers written by sandboxes are hostile: the walk goes through
//! directory descriptors opened `O_NOFOLLOW` (a symlink is an entry, never
//! followed; nothing outside the layer is read), bounded in entries, depth
//! and bytes as our own import bounds a layer.

use crate::sys::{cstr, lstatat, openat_nofollow};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Most entries one exported layer may hold (what an import accepts).
pub const MAX_ENTRIES: u64 = 1_000_000;
/// Most bytes of one exported layer's tar (what an import accepts).
pub const MAX_LAYER_BYTES: u64 = 16 << 30;
/// Deepest nesting exported, in components (what an import accepts).
pub const MAX_DEPTH: usize = super::extract::MAX_DEPTH;

pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";

const BLOCK: u64 = 512;
const WHITEOUT: &[u8] = b".wh.";
const OPAQUE_MARK: &[u8] = b".wh..wh..opq";

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// What a layer holds cannot go into an image archive (the message
    /// says which path and why).
    #[error("{0}")]
    Refused(String),
    /// A layer read differently on the second pass than on the first.
    #[error("layer {0} changed while it was exported")]
    Changed(String),
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ExportError {
    let what = what.into();
    move |source| ExportError::Io { what, source }
}

/// A blob's SHA-256 (hex) and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub digest: String,
    pub size: u64,
}

impl Blob {
    fn of(bytes: &[u8]) -> Blob {
        Blob { digest: hex::encode(Sha256::digest(bytes)), size: bytes.len() as u64 }
    }

    fn path(&self) -> String {
        format!("blobs/sha256/{}", self.digest)
    }
}

// ---------------------------------------------------------------------------
// Walking a layer.

fn readlinkat(dir: &OwnedFd, name: &OsStr) -> io::Result<Vec<u8>> {
    let c = cstr(name)?;
    let mut buf = vec![0u8; 4097];
    // SAFETY: c is a valid C string, buf a valid buffer of its length.
    let n = unsafe { libc::readlinkat(dir.as_raw_fd(), c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize >= buf.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "symlink target too long"));
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// Whether a directory (by descriptor) is marked opaque.
fn is_opaque(dir: &OwnedFd) -> io::Result<bool> {
    let mut v = [0u8; 4];
    // SAFETY: the name is a valid C string, v a valid buffer of its length.
    let n =
        unsafe { libc::fgetxattr(dir.as_raw_fd(), c"trusted.overlay.opaque".as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::EOPNOTSUPP) | Some(libc::ERANGE) => Ok(false),
            _ => Err(e),
        };
    }
    Ok(n == 1 && v[0] == b'y')
}

/// The names in a directory (by descriptor), sorted by their bytes.
fn names(dir: &OwnedFd) -> io::Result<Vec<Vec<u8>>> {
    let dup = openat_nofollow(dir, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY)?;
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/self/fd/{}", dup.as_raw_fd()))? {
        out.push(e?.file_name().as_bytes().to_vec());
    }
    out.sort();
    Ok(out)
}

/// Reads exactly `size` bytes of a file: one that ends sooner (or is
/// longer) than its header says fails instead of misframing the tar.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::new(io::ErrorKind::InvalidData, "the file grew while it was read")),
            };
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file shrank while it was read"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

struct LayerWalk<W: Write> {
    tar: tar::Builder<W>,
    entries: u64,
    bytes: u64,
    /// First path of each regular file with more than one link.
    links: HashMap<(u64, u64), Vec<u8>>,
}

fn show(path: &[u8]) -> String {
    format!("/{}", String::from_utf8_lossy(path))
}

impl<W: Write> LayerWalk<W> {
    fn header(st: &libc::stat, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(u64::from(st.st_uid));
        h.set_gid(u64::from(st.st_gid));
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(0);
        h
    }

    fn count(&mut self, path: &[u8], bytes: u64) -> Result<(), ExportError> {
        self.entries += 1;
        // Each entry's headers and padding, at most.
        self.bytes = self.bytes.saturating_add(bytes).saturating_add(3 * BLOCK);
        if self.entries > MAX_ENTRIES {
            return Err(ExportError::Refused(format!("more than {MAX_ENTRIES} entries in one layer")));
        }
        if self.bytes > MAX_LAYER_BYTES {
            return Err(ExportError::Refused(format!(
                "{}: the layer's archive would pass {MAX_LAYER_BYTES} bytes",
                show(path)
            )));
        }
        Ok(())
    }

    fn put(&mut self, h: &mut tar::Header, path: &[u8], data: impl Read) -> Result<(), ExportError> {
        self.tar.append_data(h, OsStr::from_bytes(path), data).map_err(io_err(format!("archive {}", show(path))))
    }

    /// Writes the entries under directory `dir`, whose path in the layer
    /// is `prefix` (empty for the root, else ending in `/`).
    fn dir(&mut self, dir: &OwnedFd, prefix: &mut Vec<u8>, depth: usize) -> Result<(), ExportError> {
        if depth > MAX_DEPTH {
            return Err(ExportError::Refused(format!("{}: nested deeper than {MAX_DEPTH}", show(prefix))));
        }
        let here = show(prefix);
        if !prefix.is_empty() && is_opaque(dir).map_err(io_err(format!("read the attributes of {here}")))? {
            let mark = [prefix.as_slice(), OPAQUE_MARK].concat();
            self.count(&mark, 0)?;
            let st = lstatat(dir, OsStr::new(".")).map_err(io_err(format!("stat {here}")))?;
            let mut h = Self::header(&st, tar::EntryType::Regular);
            h.set_mode(0o644);
            self.put(&mut h, &mark, io::empty())?;
        }
        for name in names(dir).map_err(io_err(format!("list {here}")))? {
            let os = OsStr::from_bytes(&name);
            let len = prefix.len();
            prefix.extend_from_slice(&name);
            if name.starts_with(WHITEOUT) {
                return Err(ExportError::Refused(format!(
                    "{}: names starting with `.wh.` mean deletions in an image layer and cannot be exported",
                    show(prefix)
                )));
            }
            let st = lstatat(dir, os).map_err(io_err(format!("stat {}", show(prefix))))?;
            match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => {
                    self.count(prefix, 0)?;
                    let mut h = Self::header(&st, tar::EntryType::Directory);
                    self.put(&mut h, prefix, io::empty())?;
                    let sub = openat_nofollow(dir, os, libc::O_RDONLY | libc::O_DIRECTORY)
                        .map_err(io_err(format!("open {}", show(prefix))))?;
                    prefix.push(b'/');
                    self.dir(&sub, prefix, depth + 1)?;
                }
                libc::S_IFREG => {
                    let size = st.st_size as u64;
                    let key = (st.st_dev, st.st_ino);
                    match self.links.get(&key).filter(|_| st.st_nlink > 1).cloned() {
                        Some(first) => {
                            self.count(prefix, 0)?;
                            let mut h = Self::header(&st, tar::EntryType::Link);
                            self.tar
                                .append_link(&mut h, OsStr::from_bytes(prefix), OsStr::from_bytes(&first))
                                .map_err(io_err(format!("archive {}", show(prefix))))?;
                        }
                        None => {
                            self.count(prefix, size)?;
                            if st.st_nlink > 1 {
                                self.links.insert(key, prefix.clone());
                            }
                            let f = openat_nofollow(dir, os, libc::O_RDONLY)
                                .map_err(io_err(format!("open {}", show(prefix))))?;
                            let mut h = Self::header(&st, tar::EntryType::Regular);
                            h.set_size(size);
                            let data = Exact { inner: std::fs::File::from(f), left: size };
                            self.put(&mut h, prefix, data)?;
                        }
                    }
                }
                libc::S_IFLNK => {
                    self.count(prefix, 0)?;
                    let target = readlinkat(dir, os).map_err(io_err(format!("read the link {}", show(prefix))))?;
                    let mut h = Self::header(&st, tar::EntryType::Symlink);
                    self.tar
                        .append_link(&mut h, OsStr::from_bytes(prefix), OsStr::from_bytes(&target))
                        .map_err(io_err(format!("archive {}", show(prefix))))?;
                }
                libc::S_IFCHR if st.st_rdev == 0 => {
                    // An overlay whiteout: the OCI form is an empty `.wh.<name>`.
                    let wh = [&prefix[..len], WHITEOUT, &name].concat();
                    self.count(&wh, 0)?;
                    let mut h = Self::header(&st, tar::EntryType::Regular);
                    h.set_mode(0o644);
                    self.put(&mut h, &wh, io::empty())?;
                }
                libc::S_IFIFO => {
                    self.count(prefix, 0)?;
                    let mut h = Self::header(&st, tar::EntryType::Fifo);
                    self.put(&mut h, prefix, io::empty())?;
                }
                // Sockets and device nodes: not carried (no import keeps
                // them either).
                _ => {}
            }
            prefix.truncate(len);
        }
        Ok(())
    }
}

/// Writes the layer whose overlayfs-form tree is at `dir` to `out` as a
/// tar in OCI form, deterministically: the same tree gives the same bytes.
pub fn layer_tar<W: Write>(dir: &Path, out: W) -> Result<W, ExportError> {
    let root = crate::sys::open(dir, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .map_err(io_err(format!("open {}", dir.display())))?;
    let mut walk = LayerWalk { tar: tar::Builder::new(out), entries: 0, bytes: 0, links: HashMap::new() };
    walk.dir(&root, &mut Vec::new(), 0)?;
    walk.tar.into_inner().map_err(io_err(format!("finish the archive of {}", dir.display())))
}

/// A writer that only hashes and counts.
#[derive(Default)]
struct Measure {
    hash: Sha256,
    n: u64,
}

impl Write for Measure {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.hash.update(b);
        self.n += b.len() as u64;
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The digest and size of [`layer_tar`] of `dir`, without keeping it.
pub fn measure(dir: &Path) -> Result<Blob, ExportError> {
    let m = layer_tar(dir, Measure::default())?;
    Ok(Blob { digest: hex::encode(m.hash.finalize()), size: m.n })
}

/// Passes bytes on while hashing them, refusing any past `limit`.
struct Checked<'a, W: Write> {
    inner: &'a mut W,
    hash: Sha256,
    n: u64,
    limit: u64,
}

impl<W: Write> Write for Checked<'_, W> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        if self.n + b.len() as u64 > self.limit {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the layer grew since it was measured"));
        }
        let n = self.inner.write(b)?;
        self.hash.update(&b[..n]);
        self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

// ---------------------------------------------------------------------------
// The archive.

/// One layer to export and the line of history that says where it came from.
#[derive(Debug, Clone)]
pub struct ExportLayer {
    /// The layer's tree in overlayfs form.
    pub dir: PathBuf,
    pub created_by: String,
}

/// What to export: the layers bottom first, and the image configuration.
#[derive(Debug, Clone, Default)]
pub struct Export {
    pub layers: Vec<ExportLayer>,
    pub env: Vec<String>,
    pub cmd: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    /// RFC 3339, for the configuration and its history.
    pub created: String,
    /// Unix seconds, for the archive's own members.
    pub mtime: u64,
    /// A reference (`name:tag`) for `docker load` and the OCI index.
    pub tag: String,
}

/// An export measured (every layer's digest and size known, the JSON
/// documents made), ready to be written as often as wanted.
#[derive(Debug, Clone)]
pub struct Plan {
    layers: Vec<(PathBuf, Blob)>,
    /// The JSON members and blobs: (archive path, bytes).
    config: (Blob, Vec<u8>),
    manifest: (Blob, Vec<u8>),
    index: Vec<u8>,
    docker_manifest: Vec<u8>,
    mtime: u64,
}

const OCI_LAYOUT: &[u8] = b"{\"imageLayoutVersion\":\"1.0.0\"}";

/// The OCI name of this host's architecture.
fn architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

fn to_json(v: &serde_json::Value) -> Vec<u8> {
    // A Value always serializes.
    serde_json::to_vec(v).unwrap_or_default()
}

impl Export {
    /// The first pass: measures every layer (see the module's notes) and
    /// makes the configuration, manifest and indexes.
    pub fn plan(&self) -> Result<Plan, ExportError> {
        self.plan_with(&|_| None)
    }

    /// [`Export::plan`] with layers measured before: `known(dir)` gives
    /// the blob of a layer that cannot have changed since (an image
    /// store's layer); a wrong one stops the writing, as a layer that
    /// changed does.
    pub fn plan_with(&self, known: &dyn Fn(&Path) -> Option<Blob>) -> Result<Plan, ExportError> {
        if self.layers.is_empty() || self.layers.len() >= super::MAX_LAYERS {
            return Err(ExportError::Refused(format!(
                "{} layers; an image archive carries 1 to {}",
                self.layers.len(),
                super::MAX_LAYERS - 1
            )));
        }
        let mut layers = Vec::new();
        for l in &self.layers {
            let blob = match known(&l.dir) {
                Some(b) => b,
                None => measure(&l.dir)?,
            };
            layers.push((l.dir.clone(), blob));
        }
        let history: Vec<serde_json::Value> = self
            .layers
            .iter()
            .map(|l| serde_json::json!({"created": self.created, "created_by": l.created_by}))
            .collect();
        let mut config = serde_json::json!({
            "Env": self.env,
            "Labels": self.labels,
        });
        if !self.cmd.is_empty() {
            config["Cmd"] = serde_json::json!(self.cmd);
        }
        if let Some(w) = &self.workdir {
            config["WorkingDir"] = serde_json::json!(w);
        }
        if let Some(u) = &self.user {
            config["User"] = serde_json::json!(u);
        }
        let config = to_json(&serde_json::json!({
            "created": self.created,
            "architecture": architecture(),
            "os": "linux",
            "config": config,
            "rootfs": {
                "type": "layers",
                "diff_ids": layers.iter().map(|(_, b)| format!("sha256:{}", b.digest)).collect::<Vec<_>>(),
            },
            "history": history,
        }));
        let config_blob = Blob::of(&config);
        let manifest = to_json(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": format!("sha256:{}", config_blob.digest), "size": config_blob.size},
            "layers": layers.iter().map(|(_, b)| serde_json::json!({
                "mediaType": MEDIA_LAYER, "digest": format!("sha256:{}", b.digest), "size": b.size,
            })).collect::<Vec<_>>(),
            "annotations": {"org.opencontainers.image.created": self.created},
        }));
        let manifest_blob = Blob::of(&manifest);
        // No platform in the index's entry: an index of one image needs
        // none, and an importer on another architecture takes it as it is.
        let index = to_json(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [{
                "mediaType": MEDIA_MANIFEST,
                "digest": format!("sha256:{}", manifest_blob.digest),
                "size": manifest_blob.size,
                "annotations": {"org.opencontainers.image.ref.name": self.tag},
            }],
        }));
        let docker_manifest = to_json(&serde_json::json!([{
            "Config": config_blob.path(),
            "RepoTags": [self.tag],
            "Layers": layers.iter().map(|(_, b)| b.path()).collect::<Vec<_>>(),
        }]));
        Ok(Plan {
            layers,
            config: (config_blob, config),
            manifest: (manifest_blob, manifest),
            index,
            docker_manifest,
            mtime: self.mtime,
        })
    }
}

/// One member of the outer archive.
enum Member<'a> {
    Dir(&'static str),
    Bytes(String, &'a [u8]),
    Layer(&'a Path, &'a Blob),
}

/// Writes the layer at `dir` as its tar (what [`measure`] gave `blob`):
/// one that reads differently stops with [`ExportError::Changed`] before
/// anything past `blob.size` is written.
pub fn write_layer<W: Write>(dir: &Path, blob: &Blob, out: &mut W) -> Result<(), ExportError> {
    let mut checked = Checked { inner: out, hash: Sha256::new(), n: 0, limit: blob.size };
    let changed = || ExportError::Changed(dir.display().to_string());
    let written = match layer_tar(dir, &mut checked) {
        Ok(_) => (checked.n, hex::encode(checked.hash.finalize())),
        Err(ExportError::Io { source, .. }) if source.kind() == io::ErrorKind::InvalidData => return Err(changed()),
        Err(e) => return Err(e),
    };
    if written != (blob.size, blob.digest.clone()) {
        return Err(changed());
    }
    Ok(())
}

impl Plan {
    /// The layers (their trees and their blobs), bottom first.
    pub fn layers(&self) -> &[(PathBuf, Blob)] {
        &self.layers
    }

    /// The image configuration: its blob and bytes.
    pub fn config(&self) -> (&Blob, &[u8]) {
        (&self.config.0, &self.config.1)
    }

    /// The OCI image manifest: its blob and bytes.
    pub fn manifest(&self) -> (&Blob, &[u8]) {
        (&self.manifest.0, &self.manifest.1)
    }

    /// The diff_ids (hex) of the layers, bottom first.
    pub fn diff_ids(&self) -> Vec<String> {
        self.layers.iter().map(|(_, b)| b.digest.clone()).collect()
    }

    fn members(&self) -> Vec<Member<'_>> {
        let mut out =
            vec![Member::Bytes("oci-layout".into(), OCI_LAYOUT), Member::Dir("blobs/"), Member::Dir("blobs/sha256/")];
        let mut seen = std::collections::HashSet::new();
        for (dir, blob) in &self.layers {
            // Two layers of the same content share their blob.
            if seen.insert(blob.digest.clone()) {
                out.push(Member::Layer(dir, blob));
            }
        }
        for (blob, bytes) in [&self.config, &self.manifest] {
            if seen.insert(blob.digest.clone()) {
                out.push(Member::Bytes(blob.path(), bytes));
            }
        }
        out.push(Member::Bytes("index.json".into(), &self.index));
        out.push(Member::Bytes("manifest.json".into(), &self.docker_manifest));
        out
    }

    /// Bytes of the whole archive.
    pub fn size(&self) -> u64 {
        let padded = |n: u64| n.div_ceil(BLOCK) * BLOCK;
        let body: u64 = self
            .members()
            .iter()
            .map(|m| {
                BLOCK
                    + match m {
                        Member::Dir(_) => 0,
                        Member::Bytes(_, b) => padded(b.len() as u64),
                        Member::Layer(_, blob) => padded(blob.size),
                    }
            })
            .sum();
        body + 2 * BLOCK
    }

    fn member_header(&self, name: &str, size: u64, dir: bool) -> Result<tar::Header, ExportError> {
        let mut h = tar::Header::new_ustar();
        h.set_path(name).map_err(io_err(format!("name {name}")))?;
        h.set_entry_type(if dir { tar::EntryType::Directory } else { tar::EntryType::Regular });
        h.set_mode(if dir { 0o755 } else { 0o644 });
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(self.mtime);
        h.set_size(size);
        h.set_cksum();
        Ok(h)
    }

    /// The second pass: writes the archive ([`Plan::size`] bytes). A layer
    /// that reads differently than when it was measured stops it with
    /// [`ExportError::Changed`] before anything past the layer's measured
    /// size is written.
    pub fn write<W: Write>(&self, out: &mut W) -> Result<(), ExportError> {
        let w = |e: io::Error| ExportError::Io { what: "write the archive".into(), source: e };
        let pad = |out: &mut W, n: u64| -> Result<(), ExportError> {
            let rest = (BLOCK - n % BLOCK) % BLOCK;
            out.write_all(&[0u8; BLOCK as usize][..rest as usize]).map_err(w)
        };
        for m in self.members() {
            match m {
                Member::Dir(name) => {
                    out.write_all(self.member_header(name, 0, true)?.as_bytes()).map_err(w)?;
                }
                Member::Bytes(name, bytes) => {
                    out.write_all(self.member_header(&name, bytes.len() as u64, false)?.as_bytes()).map_err(w)?;
                    out.write_all(bytes).map_err(w)?;
                    pad(out, bytes.len() as u64)?;
                }
                Member::Layer(dir, blob) => {
                    out.write_all(self.member_header(&blob.path(), blob.size, false)?.as_bytes()).map_err(w)?;
                    write_layer(dir, blob, out)?;
                    pad(out, blob.size)?;
                }
            }
        }
        out.write_all(&[0u8; 2 * BLOCK as usize]).map_err(w)?;
        out.flush().map_err(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::os::unix::fs::symlink;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hutch-export-{name}-{}", crate::sys::random_hex(4)));
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    fn mknod_whiteout(p: &Path) {
        let c = crate::launch::cstr(p).expect("c path");
        // SAFETY: c is a valid C string.
        assert_eq!(unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, 0) }, 0, "mknod {}", p.display());
    }

    fn set_opaque(p: &Path) {
        let c = crate::launch::cstr(p).expect("c path");
        // SAFETY: c and the name are valid C strings, the value one valid byte.
        let r = unsafe { libc::lsetxattr(c.as_ptr(), c"trusted.overlay.opaque".as_ptr(), b"y".as_ptr().cast(), 1, 0) };
        assert_eq!(r, 0, "setxattr: {}", io::Error::last_os_error());
    }

    /// A layer in overlay form: files, a symlink out of the layer, a hard
    /// link, a whiteout and an opaque directory.
    fn overlay_layer(root: &Path) {
        std::fs::create_dir_all(root.join("data/sub")).expect("mkdir");
        std::fs::create_dir_all(root.join("opq")).expect("mkdir");
        std::fs::write(root.join("data/kept"), "kept\n").expect("write");
        std::fs::write(root.join("data/sub/b"), "b").expect("write");
        std::fs::hard_link(root.join("data/kept"), root.join("data/again")).expect("link");
        std::fs::write(root.join("opq/new"), "new\n").expect("write");
        symlink("/etc/shadow", root.join("data/escape")).expect("symlink");
        mknod_whiteout(&root.join("data/gone"));
        set_opaque(&root.join("opq"));
    }

    fn entries(tar_bytes: &[u8]) -> BTreeMap<String, (tar::EntryType, Vec<u8>, Option<String>)> {
        let mut out = BTreeMap::new();
        let mut ar = tar::Archive::new(tar_bytes);
        for e in ar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let name = String::from_utf8(e.path_bytes().to_vec()).expect("utf8");
            let link = e.link_name_bytes().map(|l| String::from_utf8_lossy(&l).into_owned());
            let kind = e.header().entry_type();
            let mut data = Vec::new();
            e.read_to_end(&mut data).expect("read");
            out.insert(name, (kind, data, link));
        }
        out
    }

    #[test]
    fn whiteouts_and_opaque_dirs_take_their_oci_form() {
        let root = tmp("form");
        overlay_layer(&root);
        let bytes = layer_tar(&root, Vec::new()).expect("tar");
        let got = entries(&bytes);
        let names: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            vec![
                "data",
                "data/.wh.gone",
                "data/again",
                "data/escape",
                "data/kept",
                "data/sub",
                "data/sub/b",
                "opq",
                "opq/.wh..wh..opq",
                "opq/new"
            ]
        );
        assert_eq!(got["data/.wh.gone"].0, tar::EntryType::Regular);
        assert!(got["data/.wh.gone"].1.is_empty());
        assert_eq!(got["opq/.wh..wh..opq"].0, tar::EntryType::Regular);
        // The symlink is an entry, never followed.
        assert_eq!(got["data/escape"].0, tar::EntryType::Symlink);
        assert_eq!(got["data/escape"].2.as_deref(), Some("/etc/shadow"));
        // The first name of a file with two links carries it, the other links to it.
        assert_eq!(got["data/again"].1, b"kept\n");
        assert_eq!(got["data/kept"].0, tar::EntryType::Link);
        assert_eq!(got["data/kept"].2.as_deref(), Some("data/again"));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_layer_tar_is_the_same_bytes_every_time_and_its_measure_matches() {
        let root = tmp("det");
        overlay_layer(&root);
        let a = layer_tar(&root, Vec::new()).expect("tar");
        // Reading the files (their access times) changes nothing.
        let b = layer_tar(&root, Vec::new()).expect("tar");
        assert_eq!(a, b);
        let m = measure(&root).expect("measure");
        assert_eq!(m, Blob::of(&a));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_name_that_reads_as_a_whiteout_is_refused() {
        let root = tmp("wh");
        std::fs::write(root.join(".wh.x"), "").expect("write");
        assert!(matches!(layer_tar(&root, Vec::new()), Err(ExportError::Refused(m)) if m.contains(".wh.x")));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_sparse_file_past_the_bound_is_refused_before_it_is_read() {
        let root = tmp("sparse");
        let f = std::fs::File::create(root.join("huge")).expect("create");
        f.set_len(MAX_LAYER_BYTES + 1).expect("sparse");
        let err = measure(&root).expect_err("too large");
        assert!(matches!(&err, ExportError::Refused(m) if m.contains("/huge")), "{err}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_layer_that_changed_since_it_was_measured_stops_the_archive_at_its_measured_size() {
        let root = tmp("changed");
        std::fs::write(root.join("f"), "before").expect("write");
        let export = Export {
            layers: vec![ExportLayer { dir: root.clone(), created_by: "x".into() }],
            tag: "t:latest".into(),
            ..Export::default()
        };
        let plan = export.plan().expect("plan");
        std::fs::write(root.join("f"), "after, and longer: the tar grows by a block").expect("write");
        std::fs::write(root.join("g"), "new").expect("write");
        let mut out = Vec::new();
        let err = plan.write(&mut out).expect_err("changed");
        assert!(matches!(err, ExportError::Changed(_)), "{err}");
        // Nothing past the layer's measured bytes: oci-layout (a header and
        // a block), two directories and the layer's header, then at most
        // the layer's measured size.
        let layer = plan.layers[0].1.size;
        assert!((out.len() as u64) <= 5 * BLOCK + layer, "{} bytes", out.len());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn the_archive_is_consistent_sized_and_readable_by_our_import() {
        let (lower, upper) = (tmp("lower"), tmp("upper"));
        std::fs::create_dir_all(lower.join("data")).expect("mkdir");
        std::fs::write(lower.join("data/gone"), "lower").expect("write");
        std::fs::write(lower.join("data/kept"), "kept").expect("write");
        overlay_layer(&upper);
        let export = Export {
            layers: vec![
                ExportLayer { dir: lower.clone(), created_by: "lower".into() },
                ExportLayer { dir: upper.clone(), created_by: "upper".into() },
            ],
            env: vec!["A=1".into()],
            cmd: vec!["/bin/sh".into()],
            workdir: Some("/workspace".into()),
            user: Some("1000:1000".into()),
            labels: BTreeMap::new(),
            created: "2026-01-01T00:00:00Z".into(),
            mtime: 1_700_000_000,
            tag: "snap-0123456789abcdef:latest".into(),
        };
        let plan = export.plan().expect("plan");
        let mut out = Vec::new();
        plan.write(&mut out).expect("write");
        assert_eq!(out.len() as u64, plan.size());
        let mut again = Vec::new();
        export.plan().expect("plan").write(&mut again).expect("write");
        assert_eq!(out, again, "deterministic");
        let got = entries(&out);
        let docker: serde_json::Value = serde_json::from_slice(&got["manifest.json"].1).expect("json");
        let ids = plan.diff_ids();
        assert_eq!(docker[0]["Layers"][1], format!("blobs/sha256/{}", ids[1]));
        assert_eq!(hex::encode(Sha256::digest(&got[&format!("blobs/sha256/{}", ids[1])].1)), ids[1]);
        // Our own import reads it back, every digest checked.
        let state = tmp("state");
        let store = super::super::ImageStore::open(&state).expect("store");
        let path = state.join("x.tar");
        std::fs::write(&path, &out).expect("write");
        let img = super::super::archive::import(&store, &path, Some("back"), &super::super::Limits::default())
            .expect("import");
        assert_eq!(img.layers[..2], ids[..]);
        assert_eq!(img.env, vec!["A=1".to_owned()]);
        let top = store.layer_dir(&ids[1]);
        assert_eq!(std::fs::read(top.join("data/kept")).expect("read"), b"kept\n");
        let wh = std::fs::symlink_metadata(top.join("data/gone")).expect("whiteout");
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()));
        assert!(super::super::extract::get_opaque(&top.join("opq")).expect("xattr"));
        for d in [lower, upper, state] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
