//! The images of files that move between the nodes of a fleet (a
//! snapshot, a sandbox paused to disk) through an OCI registry: the layers
//! of the image they ran on, bottom first, then their own files as the
//! top layer. The image's name and configuration travel as labels of the
//! image configuration, so a node without that image makes it from the
//! pulled layers (a template build's image as its parent image plus its
//! own layers, as the build made them).
//!
//! A node with an image of that name already uses its own: images of one
//! name are the same image across a fleet (the operator imports or pulls
//! them on every node, or lets them come with the first move).

use super::registry::{PullOptions, Pulling};
use super::{is_build_name, now_secs, Image, ImageConfig, ImageError, ImageStore, BASE};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Labels of a moved image's configuration.
pub const LABEL_IMAGE: &str = "dev.hutch.image";
pub const LABEL_PARENT: &str = "dev.hutch.image.parent";
pub const LABEL_PARENT_LAYERS: &str = "dev.hutch.image.parent.layers";
pub const LABEL_PARENT_CONFIG: &str = "dev.hutch.image.parent.config";

/// An image as it leaves: its layers' trees, its configuration and the
/// labels that let another node make it again.
#[derive(Debug, Clone)]
pub struct Leaving {
    pub dirs: Vec<PathBuf>,
    pub config: ImageConfig,
    pub labels: BTreeMap<String, String>,
}

fn config_json(c: &ImageConfig) -> String {
    serde_json::json!({"env": c.env, "cmd": c.cmd, "workdir": c.workdir}).to_string()
}

fn config_of(img: &Image) -> ImageConfig {
    ImageConfig { env: img.env.clone(), cmd: img.cmd.clone(), workdir: img.workdir.clone() }
}

/// Image `name` (`owner`'s, if a template build's) as it leaves; None when
/// its files are the host's own (`base`, or a build over `base`): those
/// cannot move.
pub fn leaving(store: &ImageStore, name: &str, owner: &str) -> Result<Option<Leaving>, ImageError> {
    if name.is_empty() || name == BASE {
        return Ok(None);
    }
    let img = store.get(name)?;
    if !img.is_shared() && img.owner.as_deref() != Some(owner) {
        return Err(ImageError::NotFound(name.to_owned()));
    }
    let mut labels = BTreeMap::new();
    labels.insert(LABEL_IMAGE.to_owned(), name.to_owned());
    let mut dirs = Vec::new();
    match img.parent.as_deref() {
        None => {}
        Some(BASE) => return Ok(None),
        Some(parent) => {
            let p = store.get(parent)?;
            dirs.extend(store.layer_dirs(&p)?);
            labels.insert(LABEL_PARENT.to_owned(), parent.to_owned());
            labels.insert(LABEL_PARENT_LAYERS.to_owned(), p.layers.len().to_string());
            labels.insert(LABEL_PARENT_CONFIG.to_owned(), config_json(&config_of(&p)));
        }
    }
    dirs.extend(store.layer_dirs(&img)?);
    Ok(Some(Leaving { dirs, config: config_of(&img), labels }))
}

fn bad(reference: &str, why: impl std::fmt::Display) -> ImageError {
    ImageError::Registry(format!("{reference}: not a moved image: {why}"))
}

/// An image configuration kept in a label (`{"env":[..],"cmd":[..],"workdir":..}`).
#[doc(hidden)] // public for the fuzz targets (fuzz/)
pub fn parse_config_label(text: &str) -> Option<ImageConfig> {
    if text.len() > 256 * 1024 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    ImageConfig::from_oci(
        &serde_json::json!({"config": {"Env": v["env"], "Cmd": v["cmd"], "WorkingDir": v["workdir"]}}),
    )
    .into()
}

/// Pulls moved image `reference` (a reference by digest the caller's
/// store gave it): makes the image it names unless this node has one of
/// that name (`owner` owns a template build's), and extracts the top layer
/// into `top` (an existing, empty directory; on an error the caller
/// removes what is in it). Every blob is checked against its digest.
pub fn pull_moved(
    store: &ImageStore,
    reference: &str,
    opts: &PullOptions,
    owner: &str,
    top: &Path,
) -> Result<String, ImageError> {
    let _lock = store.lock(libc::LOCK_SH)?;
    let mut p = Pulling::open(reference, opts)?;
    let n = p.layers();
    if n < 2 {
        return Err(bad(reference, "fewer than two layers"));
    }
    let labels = p.config()["config"]["Labels"].clone();
    let label = |k: &str| labels[k].as_str().map(str::to_owned);
    let name = label(LABEL_IMAGE).ok_or_else(|| bad(reference, "no image label"))?;
    if !super::valid_name(&name) || name == BASE {
        return Err(bad(reference, "an image label that names no image"));
    }
    let have = match store.get(&name) {
        Ok(_) => true,
        Err(ImageError::NotFound(_)) => false,
        Err(e) => return Err(e),
    };
    if !have {
        let config = ImageConfig::from_oci(p.config());
        let mut layers = Vec::new();
        for i in 0..n - 1 {
            layers.push(p.import(store, i, &opts.limits)?);
        }
        let image =
            |name: &str, layers: Vec<String>, c: ImageConfig, parent: Option<String>, owner: Option<String>| Image {
                name: name.to_owned(),
                layers,
                env: c.env,
                cmd: c.cmd,
                workdir: c.workdir,
                source: format!("pull:{reference}"),
                created_at: now_secs(),
                parent,
                owner,
            };
        if is_build_name(&name) {
            let parent = label(LABEL_PARENT).filter(|p| super::valid_name(p) && p != BASE && !is_build_name(p));
            let parent = parent.ok_or_else(|| bad(reference, "a build's image without its parent"))?;
            let k: usize = label(LABEL_PARENT_LAYERS)
                .and_then(|k| k.parse().ok())
                .filter(|k| *k >= 1 && *k < layers.len())
                .ok_or_else(|| bad(reference, "a build's image without its parent's layers"))?;
            if matches!(store.get(&parent), Err(ImageError::NotFound(_))) {
                let pc = label(LABEL_PARENT_CONFIG).and_then(|t| parse_config_label(&t)).unwrap_or_default();
                store.put(&image(&parent, layers[..k].to_vec(), pc, None, None))?;
            }
            store.put(&image(&name, layers[k..].to_vec(), config, Some(parent), Some(owner.to_owned())))?;
        } else {
            store.put(&image(&name, layers, config, None, None))?;
        }
    }
    p.extract(n - 1, top, &opts.limits)?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::super::export::{Export, ExportLayer};
    use super::super::push::tests::Registry;
    use super::super::push::{push, Mounts, Target};
    use super::super::{LayerScope, Limits};
    use super::*;

    fn store(root: &Path, name: &str) -> ImageStore {
        ImageStore::open(&root.join(name)).expect("store")
    }

    fn layer(store: &ImageStore, file: &str, body: &str) -> String {
        let tmp = store.temp_dir().expect("tmp");
        std::fs::write(tmp.join(file), body).expect("write");
        store.commit_layer(&tmp, LayerScope::Shared).expect("commit")
    }

    #[test]
    fn a_template_builds_image_moves_with_its_parent_and_owner_and_the_files_on_top() {
        let reg = Registry::start();
        let root = std::env::temp_dir().join(format!("hutch-moved-{}", crate::sys::random_hex(4)));
        let here = store(&root, "here");
        let (p1, b1) = (layer(&here, "base-file", "parent\n"), layer(&here, "built", "by the build\n"));
        let config = |env: &str| (vec![env.to_owned()], vec!["/bin/sh".to_owned()], Some("/workspace".to_owned()));
        let (env, cmd, workdir) = config("FROM=parent");
        let parent = Image {
            name: "app".into(),
            layers: vec![p1],
            env,
            cmd,
            workdir,
            source: "import:x".into(),
            created_at: 1,
            parent: None,
            owner: None,
        };
        here.put(&parent).expect("parent");
        let (env, cmd, workdir) = config("FROM=build");
        let build = Image {
            name: "tpl-0123".into(),
            layers: vec![b1],
            env,
            cmd,
            workdir,
            source: "build".into(),
            created_at: 2,
            parent: Some("app".into()),
            owner: Some("k1".into()),
        };
        here.put(&build).expect("build");
        // Another owner does not get it; `base` does not move.
        assert!(leaving(&here, "tpl-0123", "k2").is_err());
        assert!(leaving(&here, BASE, "k1").expect("base").is_none());
        let out = leaving(&here, "tpl-0123", "k1").expect("leaving").expect("movable");
        assert_eq!(out.dirs.len(), 2);
        let upper = root.join("upper");
        std::fs::create_dir_all(upper.join("workspace")).expect("mkdir");
        std::fs::write(upper.join("workspace/note"), "mine\n").expect("write");
        let mut layers: Vec<ExportLayer> =
            out.dirs.iter().map(|d| ExportLayer { dir: d.clone(), created_by: "image".into() }).collect();
        layers.push(ExportLayer { dir: upper.clone(), created_by: "files".into() });
        let export = Export {
            layers,
            env: out.config.env.clone(),
            cmd: out.config.cmd.clone(),
            workdir: out.config.workdir.clone(),
            labels: out.labels.clone(),
            created: "2026-01-01T00:00:00Z".into(),
            tag: "moved:latest".into(),
            ..Export::default()
        };
        let target = Target::parse(&format!("http://127.0.0.1:{}/fleet", reg.port), false).expect("target");
        let pushed = push(&target, "sandbox-sb-1", &export.plan().expect("plan"), &Mounts::default()).expect("push");

        // A node without either image makes both, as they were.
        let there = store(&root, "there");
        let top = root.join("top");
        std::fs::create_dir_all(&top).expect("mkdir");
        let opts = PullOptions { limits: Limits::default(), ..PullOptions::default() };
        assert_eq!(pull_moved(&there, &pushed.reference, &opts, "k1", &top).expect("pull"), "tpl-0123");
        assert_eq!(std::fs::read_to_string(top.join("workspace/note")).expect("read"), "mine\n");
        let b = there.get("tpl-0123").expect("build");
        assert_eq!((b.parent.as_deref(), b.owner.as_deref(), b.env.clone()), (Some("app"), Some("k1"), build.env));
        let p = there.get("app").expect("parent");
        assert_eq!((p.parent.clone(), p.owner.clone(), p.env.clone()), (None, None, parent.env.clone()));
        assert_eq!(p.workdir.as_deref(), Some("/workspace"));
        let dirs = there.layer_dirs(&p).expect("dirs");
        assert_eq!(std::fs::read_to_string(dirs[0].join("base-file")).expect("read"), "parent\n");
        let dirs = there.layer_dirs(&b).expect("dirs");
        assert_eq!(std::fs::read_to_string(dirs[0].join("built")).expect("read"), "by the build\n");
        let _ = std::fs::remove_dir_all(&root);
    }
}
