//! Debian root filesystems made with `mmdebstrap --variant=minbase` from
//! the host's configured Debian mirror, streamed as a tar straight into one
//! layer, and the presets built that way on first use.

use super::extract::import_layer;
use super::{Image, ImageConfig, ImageError, ImageStore, Limits};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebianSpec {
    pub suite: String,
    pub packages: Vec<String>,
    pub name: String,
}

/// Presets: name, suite, packages. Built on first use.
pub const PRESETS: &[(&str, &str, &[&str])] =
    &[("python", "bookworm", &["python3"]), ("node", "bookworm", &["nodejs"])];

const PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Used when the host names no Debian mirror.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// Whether `name` is a preset: one of [`PRESETS`] or the code
/// interpreter's image ([`super::interp::NAME`]).
pub fn is_preset(name: &str) -> bool {
    PRESETS.iter().any(|(n, _, _)| *n == name) || name == super::interp::NAME
}

fn invalid(name: &str, reason: String) -> ImageError {
    ImageError::Invalid { name: name.to_owned(), reason }
}

fn build_err(name: &str, reason: impl Into<String>) -> ImageError {
    ImageError::Build { name: name.to_owned(), reason: reason.into() }
}

fn valid_package(p: &str) -> bool {
    let b = p.as_bytes();
    !b.is_empty()
        && b.len() <= 100
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'+' | b'-' | b'.'))
}

/// The Debian mirror the host's apt uses (`/etc/apt/sources.list` and
/// `sources.list.d/*.list|*.sources`): the first `URIs:` or `deb` URL whose
/// path ends in `/debian`.
pub fn host_mirror(etc_apt: &Path) -> String {
    let mut files = vec![etc_apt.join("sources.list")];
    if let Ok(rd) = std::fs::read_dir(etc_apt.join("sources.list.d")) {
        let mut more: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
            let urls: Vec<&str> = if let Some(rest) = line.strip_prefix("URIs:") {
                rest.split_whitespace().collect()
            } else if let Some(rest) = line.strip_prefix("deb ") {
                rest.split_whitespace().filter(|w| !w.starts_with('[')).take(1).collect()
            } else {
                continue;
            };
            if let Some(u) = urls.into_iter().find(|u| {
                (u.starts_with("http://") || u.starts_with("https://")) && u.trim_end_matches('/').ends_with("/debian")
            }) {
                return u.trim_end_matches('/').to_owned();
            }
        }
    }
    DEFAULT_MIRROR.to_owned()
}

/// What a preset adds to a plain mmdebstrap build.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extra {
    /// mmdebstrap `--customize-hook` commands: run on the host as root
    /// once the packages are installed, with the root directory as `$1`.
    pub hooks: Vec<String>,
    /// The image's environment; `PATH` alone when empty.
    pub env: Vec<String>,
    /// The image's `source`; `debian:<suite>+<packages>` when absent.
    pub source: Option<String>,
}

impl DebianSpec {
    /// Refuses a name, suite or package list mmdebstrap must not be given
    /// (nothing here reaches a shell, but every word is still checked).
    pub fn check(&self) -> Result<(), ImageError> {
        let name = self.name.as_str();
        if !super::valid_name(name) || name == super::BASE {
            return Err(invalid(name, "not a valid image name".into()));
        }
        if !(1..=32).contains(&self.suite.len()) || !self.suite.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
            return Err(invalid(name, format!("{:?} is not a Debian suite", self.suite)));
        }
        if self.packages.len() > 256 {
            return Err(invalid(name, "at most 256 packages".into()));
        }
        if let Some(bad) = self.packages.iter().find(|p| !valid_package(p)) {
            return Err(invalid(name, format!("{bad:?} is not a Debian package name")));
        }
        Ok(())
    }
}

/// Whether `mmdebstrap` is on PATH (presets and Debian builds need it).
pub fn mmdebstrap_found() -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join("mmdebstrap").is_file())
}

/// Builds a Debian image with mmdebstrap and records it. `progress` gets
/// mmdebstrap's own progress lines (`I: downloading packages...`) as they
/// come.
pub fn build(store: &ImageStore, spec: &DebianSpec, progress: &(dyn Fn(&str) + Sync)) -> Result<Image, ImageError> {
    build_with(store, spec, &Extra::default(), progress)
}

pub(crate) fn build_with(
    store: &ImageStore,
    spec: &DebianSpec,
    extra: &Extra,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Image, ImageError> {
    spec.check()?;
    let name = spec.name.as_str();
    let mirror = host_mirror(Path::new("/etc/apt"));
    let mut cmd = Command::new("mmdebstrap");
    cmd.arg("--variant=minbase").arg("--format=tar").arg("--mode=root");
    if !spec.packages.is_empty() {
        cmd.arg(format!("--include={}", spec.packages.join(",")));
    }
    for hook in &extra.hooks {
        cmd.arg(format!("--customize-hook={hook}"));
    }
    cmd.arg(&spec.suite).arg("-").arg(&mirror);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    progress(&format!("mmdebstrap {} from {mirror}", spec.suite));
    let mut child = cmd.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => build_err(name, "mmdebstrap is not installed (apt-get install mmdebstrap)"),
        _ => build_err(name, format!("cannot start mmdebstrap: {e}")),
    })?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let _lock = store.lock(libc::LOCK_SH)?;
    let (layer, tail) = std::thread::scope(|s| {
        let errs = s.spawn(move || {
            let mut tail: Vec<String> = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                progress(&line);
                tail.push(line);
                if tail.len() > 20 {
                    tail.remove(0);
                }
            }
            tail
        });
        let layer = import_layer(store, stdout, None, None, &Limits::default());
        if layer.is_err() {
            let _ = child.kill();
        }
        (layer, errs.join().unwrap_or_default())
    });
    let status = child.wait().map_err(|e| build_err(name, format!("wait for mmdebstrap: {e}")))?;
    if !status.success() {
        return Err(build_err(name, format!("mmdebstrap failed ({status}): {}", tail.join(" | "))));
    }
    let layer = layer?;
    let source = match &extra.source {
        Some(s) => s.clone(),
        None if spec.packages.is_empty() => format!("debian:{}", spec.suite),
        None => format!("debian:{}+{}", spec.suite, spec.packages.join(",")),
    };
    progress("writing the image");
    let env = if extra.env.is_empty() { vec![PATH.into()] } else { extra.env.clone() };
    let config = ImageConfig { env, cmd: vec!["/bin/bash".into()], workdir: None };
    store.finish_image(name, vec![layer], config, source)
}

/// The preset `name` as the store has it, if it is current: the code
/// interpreter's image is rebuilt when what it is made of changed (its
/// `source` names a digest of its files and lock).
fn current(store: &ImageStore, name: &str) -> Result<Option<Image>, ImageError> {
    match store.get(name) {
        Ok(img) if name == super::interp::NAME && img.source != super::interp::source() => Ok(None),
        Ok(img) => Ok(Some(img)),
        Err(ImageError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The preset `name`, built now if the store lacks it (one builder at a
/// time per preset; others wait for it and use its result).
pub fn ensure_preset(store: &ImageStore, name: &str, progress: &(dyn Fn(&str) + Sync)) -> Result<Image, ImageError> {
    if !is_preset(name) {
        return Err(ImageError::NotFound(name.to_owned()));
    }
    if let Some(img) = current(store, name)? {
        return Ok(img);
    }
    let _lock = store.lock_file(&format!(".preset-{name}.lock"), libc::LOCK_EX)?;
    if let Some(img) = current(store, name)? {
        return Ok(img);
    }
    if name == super::interp::NAME {
        return super::interp::build(store, progress);
    }
    let Some((_, suite, packages)) = PRESETS.iter().find(|(n, _, _)| *n == name) else {
        return Err(ImageError::NotFound(name.to_owned()));
    };
    progress(&format!("building preset {name}: debian {suite} + {}", packages.join(",")));
    let spec = DebianSpec {
        suite: (*suite).to_owned(),
        packages: packages.iter().map(|p| (*p).to_owned()).collect(),
        name: name.to_owned(),
    };
    build(store, &spec, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_from_deb822_and_one_line_sources() {
        let dir = std::env::temp_dir().join(format!("hutch-apt-{}", super::super::random_suffix()));
        std::fs::create_dir_all(dir.join("sources.list.d")).expect("mkdir");
        assert_eq!(host_mirror(&dir), DEFAULT_MIRROR);
        std::fs::write(
            dir.join("sources.list.d/debian.sources"),
            "Types: deb\nURIs: http://mirror.example/debian-security\n\nTypes: deb\nURIs: http://mirror.example/debian/\n",
        )
        .expect("write");
        assert_eq!(host_mirror(&dir), "http://mirror.example/debian");
        std::fs::write(dir.join("sources.list"), "deb [arch=amd64] https://m.example/debian bookworm main\n")
            .expect("write");
        assert_eq!(host_mirror(&dir), "https://m.example/debian");
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert!(valid_package("python3") && valid_package("g++") && !valid_package("-x") && !valid_package("a b"));
    }
}
