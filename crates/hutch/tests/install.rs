//! scripts/install.sh and deploy/systemd/hutch.service, without installing
//! into the host: the script parses, installs under DESTDIR or a PREFIX and
//! UNIT_DIR of a temporary directory (with stand-in binaries, and nothing
//! started), and the unit it writes passes `systemd-analyze verify` where
//! that tool is installed (scripts/test.sh installs it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo")
}

/// A fresh directory, removed when dropped.
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str) -> Temp {
        let dir = std::env::temp_dir().join(format!("hutch-install-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Temp(dir)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A directory of stand-in `hutch` and `hutch-agent` executables.
fn fake_binaries(root: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = root.join("bins");
    std::fs::create_dir_all(&dir).expect("bins");
    for b in ["hutch", "hutch-agent"] {
        let p = dir.join(b);
        std::fs::write(&p, format!("#!/bin/sh\necho {b}\n")).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    dir
}

fn install(envs: &[(&str, &Path)], extra: &[(&str, &str)]) -> Output {
    let mut c = Command::new("bash");
    c.arg(repo().join("scripts/install.sh"));
    // Nothing of the caller's environment chooses where it installs.
    for v in ["DESTDIR", "PREFIX", "UNIT_DIR", "NO_START", "HUTCH_BINARY_DIR"] {
        c.env_remove(v);
    }
    for (k, v) in envs {
        c.env(k, v);
    }
    for (k, v) in extra {
        c.env(k, v);
    }
    c.output().expect("run install.sh")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn systemd_analyze() -> Option<PathBuf> {
    ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"].iter().map(PathBuf::from).find(|p| p.is_file())
}

#[test]
fn the_install_script_parses() {
    let out = Command::new("bash").arg("-n").arg(repo().join("scripts/install.sh")).output().expect("bash -n");
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn destdir_installs_the_binaries_and_the_unit_and_starts_nothing() {
    let t = Temp::new("destdir");
    let bins = fake_binaries(&t.0);
    let dest = t.0.join("root");
    let out = install(&[("DESTDIR", &dest), ("HUTCH_BINARY_DIR", &bins)], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("not started"), "{}", text(&out));
    for b in ["hutch", "hutch-agent"] {
        let p = dest.join("usr/local/bin").join(b);
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&p).expect("installed").permissions());
        assert_eq!(mode & 0o777, 0o755, "{}", p.display());
        assert_eq!(std::fs::read(&p).expect("read"), std::fs::read(bins.join(b)).expect("read"));
    }
    let unit = std::fs::read_to_string(dest.join("etc/systemd/system/hutch.service")).expect("unit");
    assert!(unit.contains("\nExecStart=/usr/local/bin/hutch serve "), "{unit}");
    assert!(unit.contains("--state-dir /var/lib/hutch"), "{unit}");
    assert!(unit.contains("\nRestart=on-failure\n"), "{unit}");
    // Nothing half-written is left beside them.
    let leftovers: Vec<_> = std::fs::read_dir(dest.join("usr/local/bin"))
        .expect("bin")
        .chain(std::fs::read_dir(dest.join("etc/systemd/system")).expect("units"))
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_prefix_install_names_its_binary_in_a_unit_that_systemd_accepts() {
    let t = Temp::new("prefix");
    let bins = fake_binaries(&t.0);
    let (prefix, units) = (t.0.join("prefix"), t.0.join("units"));
    let out = install(&[("PREFIX", &prefix), ("UNIT_DIR", &units), ("HUTCH_BINARY_DIR", &bins)], &[("NO_START", "1")]);
    assert!(out.status.success(), "{}", text(&out));
    let unit_path = units.join("hutch.service");
    let unit = std::fs::read_to_string(&unit_path).expect("unit");
    let exec = format!("\nExecStart={}/bin/hutch serve ", prefix.display());
    assert!(unit.contains(&exec), "{unit}");
    match systemd_analyze() {
        Some(tool) => {
            let out = Command::new(tool).arg("verify").arg(&unit_path).output().expect("systemd-analyze");
            assert!(out.status.success(), "systemd-analyze verify: {}", text(&out));
            assert!(!text(&out).contains("hutch.service:"), "warnings about the unit: {}", text(&out));
        }
        None => eprintln!("systemd-analyze is not installed: the unit was not verified"),
    }
}

#[test]
fn a_missing_binary_is_refused_before_anything_is_installed() {
    let t = Temp::new("missing");
    let bins = t.0.join("empty");
    std::fs::create_dir_all(&bins).expect("mkdir");
    let dest = t.0.join("root");
    let out = install(&[("DESTDIR", &dest), ("HUTCH_BINARY_DIR", &bins)], &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("hutch is missing"), "{}", text(&out));
    assert!(!dest.exists(), "nothing is installed");
}
