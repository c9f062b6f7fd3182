//! Import of image archives: `docker save` tarballs (manifest.json, a
//! configuration, layer tars) and OCI image layouts (oci-layout,
//! index.json, blobs/sha256/...), plain or gzip-compressed, with plain or
//! gzip layers. Every digest the archive gives is checked: blobs named by
//! digest, the configuration, and each layer's diff_id.
//!
//! The outer archive is indexed once (regular files and the symlinks newer
//! `docker save` writes between its two layouts) and its members are read
//! in place; nothing of it is extracted to disk but the layers, through
//! [`super::extract`].

use super::extract::{self, digest_hex, import_layer};
use super::{local_name, Image, ImageConfig, ImageError, ImageStore, Limits};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

/// Largest manifest, index or configuration read (bytes).
pub const MAX_JSON: u64 = 4 << 20;
/// Most members an outer archive may list.
const MAX_MEMBERS: usize = 100_000;

fn invalid(name: &str, reason: impl Into<String>) -> ImageError {
    ImageError::Invalid { name: name.to_owned(), reason: reason.into() }
}

enum Member {
    File { offset: u64, size: u64 },
    Link(String),
}

/// An archive file and where its members are.
struct Outer {
    file: File,
    members: HashMap<String, Member>,
    label: String,
}

/// The normalized form of a member name (components joined by `/`).
#[doc(hidden)] // public for the fuzz targets (fuzz/), as the parsers below
pub fn normalize(name: &[u8]) -> Option<String> {
    let comps = extract::components(name).ok()?;
    let parts: Option<Vec<&str>> = comps.iter().map(|c| std::str::from_utf8(c).ok()).collect();
    Some(parts?.join("/"))
}

/// Resolves `target` (a symlink's target) relative to the directory of
/// `from`, staying inside the archive.
#[doc(hidden)]
pub fn resolve_link(from: &str, target: &str) -> Option<String> {
    if target.starts_with('/') {
        return None;
    }
    let mut parts: Vec<&str> = from.split('/').collect();
    parts.pop();
    for c in target.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    Some(parts.join("/"))
}

impl Outer {
    fn open(path: &Path, label: &str, store: &ImageStore) -> Result<(Outer, Option<tempfile::Guard>), ImageError> {
        let label = label.to_owned();
        let mut file = File::open(path).map_err(super::io_err(format!("open {label}")))?;
        let mut magic = [0u8; 2];
        let n = file.read(&mut magic).map_err(super::io_err(format!("read {label}")))?;
        file.seek(SeekFrom::Start(0)).map_err(super::io_err(format!("seek {label}")))?;
        let mut guard = None;
        if n == 2 && magic == [0x1f, 0x8b] {
            // A compressed archive: decompress once beside the store, then
            // read it in place like a plain one.
            let dir = store.temp_dir()?;
            let g = tempfile::Guard(dir.clone());
            let plain = dir.join("archive.tar");
            let mut out = File::create(&plain).map_err(super::io_err("create a temporary file"))?;
            let mut dec = flate2::read::MultiGzDecoder::new(io::BufReader::new(file)).take(Limits::default().max_bytes);
            io::copy(&mut dec, &mut out).map_err(|e| invalid(&label, format!("bad gzip: {e}")))?;
            file = File::open(&plain).map_err(super::io_err("reopen a temporary file"))?;
            guard = Some(g);
        }
        let mut members = HashMap::new();
        {
            let mut ar = tar::Archive::new(&file);
            for entry in ar.entries().map_err(|e| invalid(&label, format!("not a tar archive: {e}")))? {
                let entry = entry.map_err(|e| invalid(&label, format!("malformed tar: {e}")))?;
                if members.len() >= MAX_MEMBERS {
                    return Err(invalid(&label, format!("more than {MAX_MEMBERS} members")));
                }
                let Some(name) = normalize(&entry.path_bytes()) else { continue };
                match entry.header().entry_type() {
                    tar::EntryType::Regular | tar::EntryType::Continuous => {
                        let size = entry.header().size().map_err(|e| invalid(&label, e.to_string()))?;
                        members.insert(name, Member::File { offset: entry.raw_file_position(), size });
                    }
                    tar::EntryType::Symlink => {
                        if let Some(t) = entry.link_name_bytes().and_then(|t| String::from_utf8(t.into_owned()).ok()) {
                            members.insert(name, Member::Link(t));
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok((Outer { file, members, label }, guard))
    }

    /// The extent of a regular member, following up to 8 symlinks.
    fn find(&self, name: &str) -> Result<(u64, u64), ImageError> {
        let mut cur = name.trim_start_matches("./").to_owned();
        for _ in 0..8 {
            match self.members.get(&cur) {
                Some(Member::File { offset, size }) => return Ok((*offset, *size)),
                Some(Member::Link(t)) => {
                    cur = resolve_link(&cur, t)
                        .ok_or_else(|| invalid(&self.label, format!("{name}: link leaves the archive")))?;
                }
                None => return Err(invalid(&self.label, format!("{name} is not in the archive"))),
            }
        }
        Err(invalid(&self.label, format!("{name}: too many links")))
    }

    fn reader(&self, name: &str) -> Result<impl Read, ImageError> {
        let (offset, size) = self.find(name)?;
        let mut f = self.file.try_clone().map_err(super::io_err("dup archive"))?;
        f.seek(SeekFrom::Start(offset)).map_err(super::io_err("seek archive"))?;
        Ok(io::BufReader::with_capacity(256 * 1024, f).take(size))
    }

    /// A member read whole (bounded), checked against `digest` if given.
    fn bytes(&self, name: &str, digest: Option<&str>) -> Result<Vec<u8>, ImageError> {
        let (_, size) = self.find(name)?;
        if size > MAX_JSON {
            return Err(invalid(&self.label, format!("{name}: {size} bytes, more than {MAX_JSON}")));
        }
        let mut buf = Vec::with_capacity(size as usize);
        self.reader(name)?.read_to_end(&mut buf).map_err(super::io_err(format!("read {name}")))?;
        check_bytes(name, &buf, digest)?;
        Ok(buf)
    }

    fn json(&self, name: &str, digest: Option<&str>) -> Result<serde_json::Value, ImageError> {
        serde_json::from_slice(&self.bytes(name, digest)?)
            .map_err(|e| invalid(&self.label, format!("{name}: not JSON: {e}")))
    }
}

/// Checks bytes against a `sha256:` digest.
pub(crate) fn check_bytes(what: &str, bytes: &[u8], digest: Option<&str>) -> Result<(), ImageError> {
    if let Some(d) = digest {
        let want = digest_hex(d)?;
        let got = hex::encode(Sha256::digest(bytes));
        if got != want {
            return Err(ImageError::LayerRefused(format!(
                "{what}: digest mismatch: expected {d}, content is sha256:{got}"
            )));
        }
    }
    Ok(())
}

/// A small RAII removal of a temporary directory.
mod tempfile {
    pub struct Guard(pub std::path::PathBuf);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// One layer as a manifest describes it.
#[derive(Debug, Clone)]
pub struct LayerRef {
    pub digest: String,
    pub size: Option<u64>,
}

/// The configuration digest and the layers of an OCI or Docker schema 2
/// manifest.
#[doc(hidden)]
pub fn parse_manifest(label: &str, m: &serde_json::Value) -> Result<(String, Vec<LayerRef>), ImageError> {
    if m["schemaVersion"].as_u64() != Some(2) {
        return Err(invalid(label, "only schema 2 manifests (OCI or Docker v2.2) are supported"));
    }
    let config = m["config"]["digest"].as_str().ok_or_else(|| invalid(label, "manifest without config"))?;
    digest_hex(config)?;
    let layers = m["layers"].as_array().ok_or_else(|| invalid(label, "manifest without layers"))?;
    if layers.is_empty() || layers.len() >= super::MAX_LAYERS {
        return Err(invalid(label, format!("{} layers; 1 to {} are allowed", layers.len(), super::MAX_LAYERS - 1)));
    }
    let mut out = Vec::new();
    for l in layers {
        let media = l["mediaType"].as_str().unwrap_or("");
        if media.contains("zstd") || media.contains("nondistributable") || media.contains("foreign") {
            return Err(invalid(label, format!("layer media type {media} is not supported")));
        }
        let digest = l["digest"].as_str().ok_or_else(|| invalid(label, "layer without digest"))?;
        digest_hex(digest)?;
        out.push(LayerRef { digest: digest.to_owned(), size: l["size"].as_u64() });
    }
    Ok((config.to_owned(), out))
}

/// Whether a JSON document is an index / manifest list.
#[doc(hidden)]
pub fn is_index(m: &serde_json::Value) -> bool {
    m["manifests"].is_array()
        || matches!(
            m["mediaType"].as_str(),
            Some(
                "application/vnd.oci.image.index.v1+json" | "application/vnd.docker.distribution.manifest.list.v2+json"
            )
        )
}

/// The digest of the linux/amd64 manifest of an index (or of its only entry).
#[doc(hidden)]
pub fn pick_platform(label: &str, index: &serde_json::Value) -> Result<String, ImageError> {
    let list = index["manifests"].as_array().ok_or_else(|| invalid(label, "index without manifests"))?;
    let digest = |m: &serde_json::Value| m["digest"].as_str().map(str::to_owned);
    let amd64 = list.iter().find(|m| {
        m["platform"]["os"].as_str() == Some("linux") && m["platform"]["architecture"].as_str() == Some("amd64")
    });
    let chosen = match (amd64, list.as_slice()) {
        (Some(m), _) => digest(m),
        (None, [only]) if only["platform"].is_null() => digest(only),
        _ => None,
    };
    let d = chosen.ok_or_else(|| invalid(label, "no linux/amd64 image in the index"))?;
    digest_hex(&d)?;
    Ok(d)
}

/// The diff_ids of a configuration, one per layer.
#[doc(hidden)]
pub fn diff_ids(label: &str, config: &serde_json::Value, layers: usize) -> Result<Vec<String>, ImageError> {
    let ids: Vec<String> = config["rootfs"]["diff_ids"]
        .as_array()
        .ok_or_else(|| invalid(label, "configuration without rootfs.diff_ids"))?
        .iter()
        .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| invalid(label, "diff_id is not a string")))
        .collect::<Result<_, _>>()?;
    if ids.len() != layers {
        return Err(invalid(label, format!("{} layers but {} diff_ids", layers, ids.len())));
    }
    for id in &ids {
        digest_hex(id)?;
    }
    Ok(ids)
}

/// Imports the archive at `path` as image `name` (default: from its tags,
/// else from the file name).
pub fn import(store: &ImageStore, path: &Path, name: Option<&str>, limits: &Limits) -> Result<Image, ImageError> {
    let default = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "image".into());
    import_as(store, path, &path.display().to_string(), &default, name, limits)
}

/// Imports the archive at `path` as [`import`] does, under another label
/// (its errors and its image's `source` say `label`, not `path`) and with
/// `default` as the name when neither `name` nor a tag gives one: for an
/// archive spooled from a request, whose path is the store's own.
pub fn import_as(
    store: &ImageStore,
    path: &Path,
    label: &str,
    default: &str,
    name: Option<&str>,
    limits: &Limits,
) -> Result<Image, ImageError> {
    let _lock = store.lock(libc::LOCK_SH)?;
    let (outer, _tmp) = Outer::open(path, label, store)?;
    let label = outer.label.clone();
    let (tag, config, layers): (Option<String>, serde_json::Value, Vec<String>) = if outer.find("index.json").is_ok() {
        import_oci(store, &outer, limits)?
    } else if outer.find("manifest.json").is_ok() {
        import_docker(store, &outer, limits)?
    } else {
        return Err(invalid(&label, "neither an OCI layout (index.json) nor a `docker save` archive (manifest.json)"));
    };
    let name = match name {
        Some(n) => n.to_owned(),
        None => local_name(tag.as_deref().unwrap_or(default)),
    };
    store.finish_image(&name, layers, ImageConfig::from_oci(&config), format!("import:{label}"))
}

fn import_docker(
    store: &ImageStore,
    outer: &Outer,
    limits: &Limits,
) -> Result<(Option<String>, serde_json::Value, Vec<String>), ImageError> {
    let label = &outer.label;
    let manifest = parse_docker_manifest(label, &outer.json("manifest.json", None)?)?;
    let config = outer.json(&manifest.config, name_digest(&manifest.config).as_deref())?;
    let ids = diff_ids(label, &config, manifest.layers.len())?;
    let mut layers = Vec::new();
    for (file, id) in manifest.layers.iter().zip(&ids) {
        let blob = name_digest(file);
        layers.push(import_layer(store, outer.reader(file)?, blob.as_deref(), Some(id), limits)?);
    }
    Ok((manifest.tag, config, layers))
}

/// The first image of a `docker save` manifest.json.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerManifest {
    /// The member holding the configuration.
    pub config: String,
    /// The members holding the layers, bottom first.
    pub layers: Vec<String>,
    /// Its first tag, if any.
    pub tag: Option<String>,
}

/// Reads the first image of a `docker save` manifest.json.
#[doc(hidden)] // public for the fuzz targets (fuzz/)
pub fn parse_docker_manifest(label: &str, manifest: &serde_json::Value) -> Result<DockerManifest, ImageError> {
    let entry =
        manifest.as_array().and_then(|a| a.first()).ok_or_else(|| invalid(label, "manifest.json lists no image"))?;
    let config = entry["Config"].as_str().ok_or_else(|| invalid(label, "manifest.json: no Config"))?;
    let layers: Vec<String> = entry["Layers"]
        .as_array()
        .ok_or_else(|| invalid(label, "manifest.json: no Layers"))?
        .iter()
        .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| invalid(label, "manifest.json: a layer is not a string")))
        .collect::<Result<_, _>>()?;
    if layers.is_empty() || layers.len() >= super::MAX_LAYERS {
        return Err(invalid(label, format!("{} layers; 1 to {} allowed", layers.len(), super::MAX_LAYERS - 1)));
    }
    let tag = entry["RepoTags"].as_array().and_then(|t| t.first()).and_then(|t| t.as_str()).map(str::to_owned);
    Ok(DockerManifest { config: config.to_owned(), layers, tag })
}

/// The digest a member's name states: `blobs/sha256/<hex>` or `<hex>.json`.
#[doc(hidden)]
pub fn name_digest(name: &str) -> Option<String> {
    let base = name.rsplit('/').next()?;
    let hex = base.strip_suffix(".json").unwrap_or(base);
    let by_dir = name.contains("sha256/") || name.ends_with(".json");
    (by_dir && hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| format!("sha256:{}", hex.to_ascii_lowercase()))
}

fn blob_path(digest: &str) -> Result<String, ImageError> {
    Ok(format!("blobs/sha256/{}", digest_hex(digest)?))
}

fn import_oci(
    store: &ImageStore,
    outer: &Outer,
    limits: &Limits,
) -> Result<(Option<String>, serde_json::Value, Vec<String>), ImageError> {
    let label = &outer.label;
    let index = outer.json("index.json", None)?;
    let first = index["manifests"].as_array().and_then(|a| a.first()).cloned().unwrap_or_default();
    // Docker's own OCI export names the image fully in a containerd
    // annotation and only the tag in the OCI one.
    let notes = &first["annotations"];
    let tag = notes["io.containerd.image.name"]
        .as_str()
        .or_else(|| notes["org.opencontainers.image.ref.name"].as_str())
        .map(str::to_owned);
    let mut doc = index;
    let mut digest: Option<String> = None;
    // An index may name an index (docker's OCI export does): up to 4 levels.
    for _ in 0..4 {
        if !is_index(&doc) {
            break;
        }
        let d = pick_platform(label, &doc)?;
        doc = outer.json(&blob_path(&d)?, Some(&d))?;
        digest = Some(d);
    }
    if digest.is_none() || is_index(&doc) {
        return Err(invalid(label, "index.json does not lead to an image manifest"));
    }
    let (config_digest, refs) = parse_manifest(label, &doc)?;
    let config = outer.json(&blob_path(&config_digest)?, Some(&config_digest))?;
    let ids = diff_ids(label, &config, refs.len())?;
    let mut layers = Vec::new();
    for (r, id) in refs.iter().zip(&ids) {
        let path = blob_path(&r.digest)?;
        if let (Some(want), Ok((_, size))) = (r.size, outer.find(&path)) {
            if want != size {
                return Err(ImageError::LayerRefused(format!("{}: size {size}, manifest says {want}", r.digest)));
            }
        }
        layers.push(import_layer(store, outer.reader(&path)?, Some(&r.digest), Some(id), limits)?);
    }
    Ok((tag, config, layers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_and_names_stay_in_the_archive() {
        assert_eq!(resolve_link("abc/layer.tar", "../blobs/sha256/x").as_deref(), Some("blobs/sha256/x"));
        assert_eq!(resolve_link("layer.tar", "../../x"), None);
        assert_eq!(resolve_link("a", "/etc/passwd"), None);
        assert_eq!(normalize(b"./blobs//sha256/x").as_deref(), Some("blobs/sha256/x"));
        assert_eq!(normalize(b"../x"), None);
        let hex = "a".repeat(64);
        assert_eq!(name_digest(&format!("blobs/sha256/{hex}")), Some(format!("sha256:{hex}")));
        assert_eq!(name_digest(&format!("{hex}.json")), Some(format!("sha256:{hex}")));
        assert_eq!(name_digest(&format!("{hex}/layer.tar")), None);
    }

    /// Found by fuzz/fuzz_targets/image_names.rs: a member named with
    /// upper-case hex stated a digest that no check accepts, so the archive
    /// was refused as a digest mismatch; the name states the same digest in
    /// either case.
    #[test]
    fn a_digest_named_in_upper_case_is_checked_as_the_same_digest() {
        let lower = "ab".repeat(32);
        for name in [format!("blobs/sha256/{}", lower.to_uppercase()), format!("{}.json", lower.to_uppercase())] {
            let d = name_digest(&name).expect("a digest");
            assert_eq!(d, format!("sha256:{lower}"));
            assert!(digest_hex(&d).is_ok(), "{d}");
        }
    }
}
