//! A minimal stand-in for the image store (`hutch_runtime::image`, written
//! in parallel): the few operations builds need, over the agreed on-disk
//! format, so that the integrator can swap these functions for the store's
//! API without touching the build logic.
//!
//! - `<state>/images/layers/<sha256hex>/`: a layer in overlayfs format,
//!   owned by image ids, read-only once committed (built aside, renamed).
//! - `<state>/images/images/<name>.json`: an image, written atomically.
//!
//! Built images carry `"parent": "base"`: their layers go over the `base`
//! lower layer (the store's own images are whole root filesystems).

use hutch_runtime::capture::{tree_digest, CaptureLimits};
use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// An image as `images/<name>.json` holds it: the store's own record, whose
/// `parent` names what a build's layers go over.
pub use hutch_runtime::image::Image as ImageJson;
use hutch_runtime::image::{ImageError, ImageStore};

/// `<state>/images`, made (0700: layers hold files owned by image root,
/// some setuid, which no host user may reach) when missing.
pub fn root(state_dir: &Path) -> io::Result<PathBuf> {
    let dir = state_dir.join("images");
    for sub in ["", "layers", "images", "cache", "tmp", "builds", "scratch"] {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir.join(sub))?;
    }
    Ok(dir)
}

pub fn layer_path(state_dir: &Path, hex: &str) -> PathBuf {
    state_dir.join("images").join("layers").join(hex)
}

pub fn valid_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A fresh directory under `images/tmp` to build a layer in.
pub fn tmp_dir(state_dir: &Path, what: &str) -> io::Result<PathBuf> {
    let mut b = [0u8; 8];
    hutch_runtime::sys::random_bytes(&mut b)?;
    let dir = root(state_dir)?.join("tmp").join(format!("{what}-{}", hex::encode(b)));
    Ok(dir)
}

/// Names the layer built in `tmp` by its content digest and renames it into
/// `layers/<hex>`; an identical layer already there wins and `tmp` goes.
pub fn commit_layer(state_dir: &Path, tmp: &Path) -> io::Result<String> {
    let hex = tree_digest(tmp, CaptureLimits::default()).map_err(io::Error::other)?;
    let dest = layer_path(state_dir, &hex);
    if dest.is_dir() {
        fs::remove_dir_all(tmp)?;
        return Ok(hex);
    }
    match fs::rename(tmp, &dest) {
        Ok(()) => Ok(hex),
        Err(_) if dest.is_dir() => {
            fs::remove_dir_all(tmp)?;
            Ok(hex)
        }
        Err(e) => Err(e),
    }
}

/// Records an image through the store (atomically; its name and layer
/// rules).
pub fn put(state_dir: &Path, image: &ImageJson) -> io::Result<()> {
    ImageStore::open(state_dir).and_then(|store| store.put(image)).map_err(io::Error::other)
}

/// An image's record, read by the store itself (its name and layer rules).
pub fn get(state_dir: &Path, name: &str) -> io::Result<Option<ImageJson>> {
    let store = ImageStore::open(state_dir).map_err(io::Error::other)?;
    match store.get(name) {
        Ok(image) => Ok(Some(image)),
        Err(ImageError::NotFound(_)) => Ok(None),
        Err(e) => Err(io::Error::other(e)),
    }
}

/// The cached layer of a build step's key, if the layer still exists.
pub fn cached(state_dir: &Path, key: &str) -> Option<String> {
    let hex = fs::read_to_string(state_dir.join("images").join("cache").join(key)).ok()?;
    let hex = hex.trim();
    (valid_hex(hex) && layer_path(state_dir, hex).is_dir()).then(|| hex.to_owned())
}

pub fn remember(state_dir: &Path, key: &str, hex: &str) -> io::Result<()> {
    let dir = root(state_dir)?.join("cache");
    let tmp = dir.join(format!(".{key}.tmp"));
    fs::write(&tmp, hex)?;
    fs::rename(tmp, dir.join(key))
}
