//! The host's shared images through the API: imports of `docker save` and
//! OCI-layout archives, registry pulls, removal and collection. Shared
//! images can be named by every key's templates, so only an admin key
//! makes or removes them; any key lists those it may name
//! ([`Control::list_images`]). A key's own images are its template builds'.
//!
//! An archive arrives as a stream of chunks and is spooled to a file under
//! the store's `tmp/` (never held in memory), capped at [`IMPORT_CAP`]
//! bytes, then imported by the same importer as on the host. Spooling and
//! importing run on a thread of their own (a slow client holds no worker
//! of tokio's pools). Whatever fails, the spooled file goes and no image is
//! recorded; layers an import committed before it failed are named by no
//! image and go at the next collection.

use crate::control::{rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::files::{Chunks, FilesError};
use crate::ids::Caller;
use hutch_api::{BuildImage, ErrorCode, ImageInfo, PullImage};
use hutch_runtime::image::{self, archive, debian, registry, Image, ImageError, ImageStore, Limits};
use std::io::Write;
use std::path::Path;

/// Largest archive `POST /v1/images/import` takes (bytes, as sent:
/// compressed or not). Each layer is also held to [`Limits`] unpacked.
pub const IMPORT_CAP: u64 = 16 << 30;

/// What an import is called.
#[derive(Debug, Clone, Default)]
pub struct ImportImage {
    /// The image's name (default: the archive's tag, else `filename`'s stem).
    pub name: Option<String>,
    /// The client's name of the archive: its label and the default name.
    pub filename: Option<String>,
}

/// An image build the caller may start, checked whole before anything
/// runs: made only by [`Control::check_image_build`], taken by
/// [`Control::build_image`].
#[derive(Debug)]
pub struct ImageBuild(Recipe);

#[derive(Debug)]
enum Recipe {
    Preset(String),
    Debian(debian::DebianSpec),
}

impl Control {
    /// Checks a `POST /v1/images/build`: an admin key, a known kind, and a
    /// name, suite and packages mmdebstrap may be given. Nothing runs yet,
    /// so a refusal is still a plain error answer.
    pub fn check_image_build(&self, caller: &Caller, req: BuildImage) -> Result<ImageBuild> {
        self.may_manage_images(caller)?;
        if debian::is_preset(&req.kind) {
            if req.suite.is_some() || !req.packages.is_empty() || req.name.is_some() {
                return Err(ControlError::Invalid(format!(
                    "preset {:?} takes no suite, packages or name; use kind `debian` for those",
                    req.kind
                )));
            }
            return Ok(ImageBuild(Recipe::Preset(req.kind)));
        }
        if req.kind != "debian" {
            return Err(ControlError::Invalid(format!(
                "unknown image kind {:?}: `debian`, `python`, `node` or `{}`",
                req.kind.chars().take(64).collect::<String>(),
                image::interp::NAME
            )));
        }
        let suite = req.suite.unwrap_or_else(|| "bookworm".into());
        let spec = debian::DebianSpec {
            name: req.name.unwrap_or_else(|| format!("debian-{suite}")),
            suite,
            packages: req.packages.into_iter().filter(|p| !p.is_empty()).collect(),
        };
        check_name(&spec.name)?;
        spec.check().map_err(from_image)?;
        Ok(ImageBuild(Recipe::Debian(spec)))
    }

    /// Runs a checked build on a thread of its own, giving `progress` each
    /// line as it comes. A preset that is already current is answered at
    /// once; two builds of one preset make it once.
    pub async fn build_image(
        &self,
        build: ImageBuild,
        progress: impl Fn(&str) + Send + Sync + 'static,
    ) -> Result<ImageInfo> {
        let store = self.images()?;
        let img = tokio::task::spawn_blocking(move || match build.0 {
            Recipe::Preset(name) => debian::ensure_preset(&store, &name, &progress),
            Recipe::Debian(spec) => debian::build(&store, &spec, &progress),
        })
        .await?
        .map_err(from_image)?;
        Ok(self.info(img).await)
    }

    /// Refuses every key but an admin key: what it would make or remove is
    /// named by every key's templates.
    pub fn may_manage_images(&self, caller: &Caller) -> Result<()> {
        if caller.admin {
            Ok(())
        } else {
            Err(ControlError::Forbidden(
                "only an admin key may import, pull or remove the host's shared images \
                 (a key's own images are its templates' builds)"
                    .into(),
            ))
        }
    }

    /// Imports the archive arriving on `rx` (at most [`IMPORT_CAP`] bytes).
    pub async fn import_image(&self, caller: &Caller, req: ImportImage, rx: Chunks) -> Result<ImageInfo> {
        self.may_manage_images(caller)?;
        if let Some(n) = &req.name {
            check_name(n)?;
        }
        let store = self.images()?;
        let (tx, done) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("hutch-image-import".into())
            .spawn(move || {
                let _ = tx.send(spool_and_import(&store, req, rx));
            })
            .map_err(|e| ControlError::Runtime(format!("start an import thread: {e}")))?;
        let img =
            done.await.map_err(|_| ControlError::Runtime("the import thread ended without an answer".into()))??;
        Ok(self.info(img).await)
    }

    /// Pulls `req.reference` from its registry into the store.
    pub async fn pull_image(&self, caller: &Caller, req: PullImage) -> Result<ImageInfo> {
        self.may_manage_images(caller)?;
        if let Some(n) = &req.name {
            check_name(n)?;
        }
        registry::Reference::parse(&req.reference).map_err(|e| ControlError::Invalid(e.to_string()))?;
        let store = self.images()?;
        let opts = registry::PullOptions { insecure: req.insecure, name: req.name, limits: Limits::default() };
        let img = tokio::task::spawn_blocking(move || registry::pull(&store, &req.reference, &opts))
            .await?
            .map_err(from_image)?;
        Ok(self.info(img).await)
    }

    /// Removes a shared image, unless a live template or a template build's
    /// image stands on it (`409 conflict`: those would stop starting).
    /// Its layers go at the next collection if nothing else names them.
    pub async fn remove_image(&self, caller: &Caller, name: &str) -> Result<()> {
        self.may_manage_images(caller)?;
        let store = self.images()?;
        let n = name.to_owned();
        let img = tokio::task::spawn_blocking(move || store.get(&n)).await?;
        match img {
            Ok(img) if img.is_shared() => {}
            // Builds' images go with their templates.
            Ok(_) | Err(ImageError::NotFound(_)) => return Err(ControlError::NoImage(name.to_owned())),
            Err(e) => return Err(from_image(e)),
        }
        let templates = self.db(|s| s.list_templates(None)).await?;
        let users = templates.iter().filter(|t| t.image == name).count();
        let store = self.images()?;
        let n = name.to_owned();
        let children = tokio::task::spawn_blocking(move || {
            store.list().into_iter().filter(|i| i.parent.as_deref() == Some(n.as_str())).count()
        })
        .await?;
        if users + children > 0 {
            return Err(ControlError::Conflict(format!(
                "image {name:?} is used by {users} template(s) and {children} template build(s); \
                 delete or change those first"
            )));
        }
        let store = self.images()?;
        let n = name.to_owned();
        tokio::task::spawn_blocking(move || store.remove(&n)).await?.map_err(|e| match e {
            ImageError::NotFound(n) => ControlError::NoImage(n),
            e => from_image(e),
        })
    }

    /// Removes layers no image names (older than an hour) and stale
    /// temporary files; answers how many layers went.
    pub async fn collect_images(&self, caller: &Caller) -> Result<usize> {
        self.may_manage_images(caller)?;
        let store = self.images()?;
        let removed = tokio::task::spawn_blocking(move || store.gc()).await?.map_err(from_image)?;
        Ok(removed.len())
    }

    async fn info(&self, img: Image) -> ImageInfo {
        let store = self.images().ok();
        let name = img.name.clone();
        let size = match store {
            Some(store) => tokio::task::spawn_blocking(move || {
                store.summaries().into_iter().find(|s| s.name == name).map(|s| s.size_bytes).unwrap_or(0)
            })
            .await
            .unwrap_or(0),
            None => 0,
        };
        ImageInfo {
            name: img.name,
            layers: img.layers.len() as u64,
            size_bytes: size,
            source: img.source,
            created_at: rfc3339(img.created_at.saturating_mul(1000).min(i64::MAX as u64) as i64),
        }
    }
}

pub fn check_name(name: &str) -> Result<()> {
    if image::valid_name(name) && name != image::BASE && !image::is_build_name(name) {
        return Ok(());
    }
    Err(ControlError::Image(ImageError::Invalid {
        name: name.to_owned(),
        reason: format!(
            "names are 1 to 63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit; `base` and `{}*` \
             are reserved",
            image::BUILD_PREFIX
        ),
    }))
}

/// An image error as the control plane's.
pub(crate) fn from_image(e: ImageError) -> ControlError {
    ControlError::Image(e)
}

/// Removes a file when dropped.
struct Spooled<'a>(&'a Path);

impl Drop for Spooled<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// On the import's own thread: writes the chunks to a file under the
/// store's `tmp/` (at most [`IMPORT_CAP`] bytes), imports it, removes it.
fn spool_and_import(store: &ImageStore, req: ImportImage, mut rx: Chunks) -> Result<Image> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = store.upload_path();
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| ControlError::Runtime(format!("create {}: {e}", path.display())))?;
    let _guard = Spooled(&path);
    let mut total = 0u64;
    while let Some(chunk) = rx.blocking_recv() {
        let chunk = chunk.map_err(ControlError::Files)?;
        total += chunk.len() as u64;
        if total > IMPORT_CAP {
            return Err(ControlError::Files(FilesError::new(
                ErrorCode::PayloadTooLarge,
                format!("image archive above {} GiB; nothing was imported", IMPORT_CAP >> 30),
            )));
        }
        file.write_all(&chunk).map_err(|e| spool_error(&path, e))?;
    }
    drop(rx);
    file.flush().map_err(|e| spool_error(&path, e))?;
    drop(file);
    let label = req.filename.as_deref().map(clean_label).unwrap_or_else(|| "upload".into());
    let stem = [".tar.gz", ".tgz", ".tar", ".gz"].iter().find_map(|s| label.strip_suffix(s)).unwrap_or(&label);
    let default = if stem.is_empty() { "image".to_owned() } else { stem.to_owned() };
    archive::import_as(store, &path, &label, &default, req.name.as_deref(), &Limits::default()).map_err(from_image)
}

fn spool_error(path: &Path, e: std::io::Error) -> ControlError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        ControlError::StorageFull(format!("spooling an image archive to {}", path.display()))
    } else {
        ControlError::Runtime(format!("write {}: {e}", path.display()))
    }
}

/// A client's file name as a label: its last component, printable, short.
fn clean_label(name: &str) -> String {
    let last = name.rsplit('/').next().unwrap_or(name);
    let s: String = last.chars().filter(|c| !c.is_control()).take(128).collect();
    if s.is_empty() || s == "." || s == ".." {
        "upload".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_a_last_component() {
        assert_eq!(clean_label("/home/me/app.tar.gz"), "app.tar.gz");
        assert_eq!(clean_label("a\nb.tar"), "ab.tar");
        assert_eq!(clean_label(".."), "upload");
        assert_eq!(clean_label(""), "upload");
    }

    #[test]
    fn names_are_checked_before_any_byte_is_read() {
        assert!(check_name("app-1.2").is_ok());
        for bad in ["", "base", "tpl-x", "Up", "-a", &"a".repeat(64)] {
            let e = check_name(bad).expect_err(bad);
            assert_eq!(e.code(), ErrorCode::ImageInvalid, "{bad}");
        }
    }
}
