//! The `code-interpreter` preset: the image of the built-in template
//! `code-interpreter-v1`, which serves E2B's code interpreter protocol.
//!
//! Debian bookworm (mmdebstrap from the host's mirror, like every preset)
//! with Python and Node, a virtual environment of pinned wheels (ipykernel,
//! jupyter_client, matplotlib, pandas and their closure:
//! `interp/requirements.lock`, each wheel by sha256), and hutch's own
//! server (`interp/server.py`, `interp/jsrunner.js`). The wheels are
//! downloaded by the host's pip (`python3 -m pip download`), so from the
//! package index, proxy and certificates the host is configured with, and
//! checked against the lock; the install inside the root is offline
//! (`interp/hook.sh`, an mmdebstrap customize hook). What the image is made
//! of is digested into its `source`: a hutch whose files differ rebuilds
//! it on the next use.

use super::debian::{self, DebianSpec, Extra};
use super::{io_err, Image, ImageError, ImageStore};
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// The preset's name.
pub const NAME: &str = "code-interpreter";
/// The port the server listens on inside the sandbox (127.0.0.1 only).
pub const PORT: u16 = 49999;
/// How a sandbox starts the server (as the sandbox's user).
pub const START_COMMAND: &str = "exec /opt/hutch/python/bin/python /opt/hutch/interp/server.py";

const SUITE: &str = "bookworm";
const PACKAGES: &[&str] = &["python3", "python3-venv", "nodejs"];
/// The suite's CPython, which the wheels are chosen for.
const PYTHON_VERSION: &str = "3.11";
const PYTHON_ABI: &str = "cp311";
/// The suite's glibc is 2.36: every manylinux tag up to it fits.
const GLIBC_MINOR: u32 = 36;
const ENV: &[&str] = &["PATH=/opt/hutch/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"];

const LOCK: &str = include_str!("interp/requirements.lock");
const HOOK: &str = include_str!("interp/hook.sh");
/// Files the hook installs, by name.
const FILES: &[(&str, &str)] = &[
    ("server.py", include_str!("interp/server.py")),
    ("jsrunner.js", include_str!("interp/jsrunner.js")),
    ("startup.py", include_str!("interp/startup.py")),
    ("kernel_config.py", include_str!("interp/kernel_config.py")),
    ("kernel.json", include_str!("interp/kernel.json")),
];

/// The image's `source`: its suite and packages, and a digest of
/// everything else it is made of.
pub fn source() -> String {
    let mut h = Sha256::new();
    let parts = FILES.iter().copied().chain([("requirements.lock", LOCK), ("hook.sh", HOOK)]);
    for (name, text) in parts {
        for part in [name.as_bytes(), text.as_bytes()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
    }
    let digest = hex::encode(h.finalize());
    format!("debian:{SUITE}+{}+{NAME}:{}", PACKAGES.join(","), &digest[..16])
}

fn build_err(reason: impl Into<String>) -> ImageError {
    ImageError::Build { name: NAME.to_owned(), reason: reason.into() }
}

/// The machine name in manylinux tags of this host's architecture.
fn wheel_arch() -> Result<&'static str, ImageError> {
    match std::env::consts::ARCH {
        "x86_64" => Ok("x86_64"),
        "aarch64" => Ok("aarch64"),
        other => Err(build_err(format!("no wheels are locked for {other}"))),
    }
}

/// `pip download` arguments that pick the image's wheels: CPython 3.11,
/// glibc up to the suite's, binary only, no dependency resolution (the
/// lock is the whole closure), every file checked against its hash.
pub fn pip_download_args(arch: &str, dest: &Path, lock: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--abi",
        PYTHON_ABI,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let first = if arch == "x86_64" { 5 } else { 17 };
    for minor in first..=GLIBC_MINOR {
        args.push("--platform".into());
        args.push(format!("manylinux_2_{minor}_{arch}"));
    }
    let legacy: &[&str] =
        if arch == "x86_64" { &["manylinux1", "manylinux2010", "manylinux2014"] } else { &["manylinux2014"] };
    for tag in legacy {
        args.push("--platform".into());
        args.push(format!("{tag}_{arch}"));
    }
    args.push("--dest".into());
    args.push(dest.display().to_string());
    args.push("--requirement".into());
    args.push(lock.display().to_string());
    args
}

/// Downloads the locked wheels into `dest` with the host's pip.
fn fetch_wheels(work: &Path, progress: &(dyn Fn(&str) + Sync)) -> Result<(), ImageError> {
    let dest = work.join("wheels");
    let lock = work.join("requirements.lock");
    std::fs::create_dir(&dest).map_err(io_err(format!("mkdir {}", dest.display())))?;
    progress("downloading the locked wheels with the host's pip (python3 -m pip download)");
    let mut child = Command::new("python3")
        .args(pip_download_args(wheel_arch()?, &dest, &lock))
        .current_dir(work)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                build_err("python3 is not installed on the host (apt-get install python3-pip)")
            }
            _ => build_err(format!("cannot start pip: {e}")),
        })?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let tail = std::thread::scope(|s| {
        let out = s.spawn(|| {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                progress(&line);
            }
        });
        let mut tail: Vec<String> = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            progress(&line);
            tail.push(line);
            if tail.len() > 10 {
                tail.remove(0);
            }
        }
        let _ = out.join();
        tail
    });
    let status = child.wait().map_err(|e| build_err(format!("wait for pip: {e}")))?;
    if !status.success() {
        return Err(build_err(format!(
            "pip download failed ({status}; the host needs python3 -m pip and its package index): {}",
            tail.join(" | ")
        )));
    }
    Ok(())
}

/// Builds the image: wheels first (a failure there costs no mmdebstrap
/// run), then the Debian root with the hook that installs them.
pub fn build(store: &ImageStore, progress: &(dyn Fn(&str) + Sync)) -> Result<Image, ImageError> {
    let work = store.temp_dir()?;
    let result = build_in(store, &work, progress);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn build_in(store: &ImageStore, work: &Path, progress: &(dyn Fn(&str) + Sync)) -> Result<Image, ImageError> {
    let path = work.to_str().filter(|p| !p.contains('\'')).ok_or_else(|| {
        build_err(format!("the state directory's path {} must be UTF-8 without a quote", work.display()))
    })?;
    progress(&format!("building preset {NAME}: debian {SUITE} + {} + locked wheels", PACKAGES.join(",")));
    let write = |name: &str, text: &str| {
        let p = work.join(name);
        std::fs::write(&p, text).map_err(io_err(format!("write {}", p.display())))
    };
    write("requirements.lock", LOCK)?;
    write("hook.sh", HOOK)?;
    std::fs::create_dir(work.join("files")).map_err(io_err("mkdir files"))?;
    for (name, text) in FILES {
        write(&format!("files/{name}"), text)?;
    }
    fetch_wheels(work, progress)?;
    let spec = DebianSpec {
        suite: SUITE.to_owned(),
        packages: PACKAGES.iter().map(|p| (*p).to_owned()).collect(),
        name: NAME.to_owned(),
    };
    let extra = Extra {
        hooks: vec![format!("sh '{path}/hook.sh' \"$1\" '{path}'")],
        env: ENV.iter().map(|e| (*e).to_owned()).collect(),
        source: Some(source()),
    };
    debian::build_with(store, &spec, &extra, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_names_a_digest_of_what_the_image_is_made_of() {
        let s = source();
        assert!(s.starts_with("debian:bookworm+python3,python3-venv,nodejs+code-interpreter:"), "{s}");
        assert_eq!(s, source());
        assert_eq!(s.rsplit(':').next().map(str::len), Some(16));
    }

    #[test]
    fn every_locked_requirement_is_pinned_with_a_hash() {
        let mut pins = 0;
        for req in LOCK.split("\n").filter(|l| !l.starts_with('#') && !l.starts_with(' ') && !l.is_empty()) {
            let name = req.trim_end_matches(" \\");
            assert!(name.contains("=="), "{req}: not pinned");
            pins += 1;
        }
        assert!(pins >= 4, "the lock names {pins} packages");
        let blocks = LOCK.split("\n").filter(|l| l.contains("==")).count();
        assert_eq!(blocks, pins);
        for name in ["ipykernel==", "jupyter-client==", "matplotlib==", "pandas=="] {
            assert!(LOCK.lines().any(|l| l.starts_with(name)), "{name} is not locked");
        }
        // Every requirement line is followed by at least one hash.
        let lines: Vec<&str> = LOCK.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            if l.contains("==") {
                assert!(lines.get(i + 1).is_some_and(|n| n.trim_start().starts_with("--hash=sha256:")), "{l}");
            }
        }
    }

    #[test]
    fn pip_picks_the_images_python_and_glibc() {
        let args = pip_download_args("x86_64", Path::new("/w/wheels"), Path::new("/w/lock"));
        let joined = args.join(" ");
        for want in ["--require-hashes", "--only-binary=:all:", "--no-deps", "--abi cp311", "--python-version 3.11"] {
            assert!(joined.contains(want), "{want} missing from {joined}");
        }
        assert!(args.iter().any(|a| a == "manylinux_2_36_x86_64") && args.iter().any(|a| a == "manylinux_2_5_x86_64"));
        assert!(!args.iter().any(|a| a == "manylinux_2_37_x86_64"));
        let arm = pip_download_args("aarch64", Path::new("/w/wheels"), Path::new("/w/lock"));
        assert!(arm.iter().any(|a| a == "manylinux2014_aarch64") && !arm.iter().any(|a| a.contains("x86_64")));
    }
}
