//! The runners under test (hutch and its peers) and the commands they run:
//! how each one turns a workload into a full command line, and the runc /
//! podman root filesystem that is prepared once per benchmark run.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{self, Command, Stdio};

/// A command run inside each sandbox, with the output that proves it ran.
pub struct Workload {
    /// How the table names it.
    pub label: &'static str,
    /// Absolute argv, so no runner depends on PATH (the host PATH starts with
    /// a pyenv shim that no sandbox can see).
    pub argv: &'static [&'static str],
    /// The exact stdout of a correct run.
    pub expect_stdout: &'static str,
}

pub const WORKLOADS: &[Workload] = &[
    Workload { label: "true", argv: &["/usr/bin/true"], expect_stdout: "" },
    Workload { label: "python3 -c 'print(42)'", argv: &["/usr/bin/python3", "-c", "print(42)"], expect_stdout: "42\n" },
];

/// Every runner, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunnerKind {
    Hutch,
    Bwrap,
    Runc,
    Podman,
    ForkExec,
}

impl RunnerKind {
    pub const ALL: [RunnerKind; 5] =
        [RunnerKind::Hutch, RunnerKind::Bwrap, RunnerKind::Runc, RunnerKind::Podman, RunnerKind::ForkExec];

    pub fn name(self) -> &'static str {
        match self {
            RunnerKind::Hutch => "hutch",
            RunnerKind::Bwrap => "bwrap",
            RunnerKind::Runc => "runc",
            RunnerKind::Podman => "podman",
            RunnerKind::ForkExec => "fork+exec",
        }
    }

    pub fn from_name(name: &str) -> Option<RunnerKind> {
        RunnerKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether this runner needs the shared root filesystem directory.
    pub fn needs_rootfs(self) -> bool {
        matches!(self, RunnerKind::Runc | RunnerKind::Podman)
    }
}

impl fmt::Display for RunnerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Prefix of every runc container id we create, followed by our pid.
pub fn runc_id_prefix() -> String {
    format!("sandbox-bench-{}-", process::id())
}

/// Builds command lines for one runner.
pub struct Runner {
    pub kind: RunnerKind,
    hutch: PathBuf,
    bundle: Option<PathBuf>,
    next_id: u64,
}

impl Runner {
    pub fn new(kind: RunnerKind, hutch: &Path, bundle: Option<&Path>) -> Self {
        Runner { kind, hutch: hutch.to_path_buf(), bundle: bundle.map(Path::to_path_buf), next_id: 0 }
    }

    /// The command line for one fresh sandbox running `w`. For runc it also
    /// returns the container id, so a killed run can be cleaned up.
    pub fn command(&mut self, w: &Workload) -> (Command, Option<String>) {
        match self.kind {
            RunnerKind::Hutch => {
                let mut c = Command::new(&self.hutch);
                c.arg("run").arg("--").args(w.argv);
                (c, None)
            }
            RunnerKind::Bwrap => {
                let mut c = Command::new("bwrap");
                c.args([
                    "--unshare-all",
                    "--die-with-parent",
                    "--ro-bind",
                    "/usr",
                    "/usr",
                    "--symlink",
                    "usr/bin",
                    "/bin",
                    "--symlink",
                    "usr/lib",
                    "/lib",
                    "--symlink",
                    "usr/lib64",
                    "/lib64",
                    "--symlink",
                    "usr/sbin",
                    "/sbin",
                    "--proc",
                    "/proc",
                    "--dev",
                    "/dev",
                    "--tmpfs",
                    "/tmp",
                    "--",
                ])
                .args(w.argv);
                (c, None)
            }
            RunnerKind::Runc => {
                // The bundle's config.json carries one argv per workload, so
                // each workload gets its own bundle directory.
                let bundle = self.bundle_dir().join(bundle_name(w));
                self.next_id += 1;
                let id = format!("{}{}", runc_id_prefix(), self.next_id);
                let mut c = Command::new("runc");
                c.arg("run").arg("--bundle").arg(bundle).arg(&id);
                (c, Some(id))
            }
            RunnerKind::Podman => {
                let rootfs = self.bundle_dir().join("rootfs");
                let mut c = Command::new("podman");
                c.args([
                    "run",
                    "--rm",
                    "--network=none",
                    "--ulimit",
                    "nofile=1024:1024",
                    "--ulimit",
                    "nproc=1024:1024",
                    "-v",
                    "/usr:/usr:ro",
                    "--rootfs",
                ])
                .arg(rootfs)
                .args(w.argv);
                (c, None)
            }
            RunnerKind::ForkExec => {
                let mut c = Command::new(w.argv[0]);
                c.args(&w.argv[1..]);
                (c, None)
            }
        }
    }

    fn bundle_dir(&self) -> &Path {
        self.bundle.as_deref().expect("main prepares the bundle for every runner that needs_rootfs")
    }
}

/// Deletes a runc container left behind by a killed `runc run`.
pub fn runc_delete(id: &str) {
    let _ = Command::new("runc").args(["delete", "--force", id]).stdout(Stdio::null()).stderr(Stdio::null()).status();
}

/// Ids of runc containers this process created that still exist.
pub fn runc_leftovers() -> io::Result<Vec<String>> {
    let out = Command::new("runc").args(["list", "--quiet"]).stderr(Stdio::null()).output()?;
    let prefix = runc_id_prefix();
    Ok(String::from_utf8_lossy(&out.stdout).lines().filter(|id| id.starts_with(&prefix)).map(str::to_owned).collect())
}

fn bundle_name(w: &Workload) -> String {
    let index = WORKLOADS.iter().position(|x| std::ptr::eq(x, w)).expect("every workload comes from WORKLOADS");
    format!("bundle-{index}")
}

/// Lays out `dir` for runc and podman:
///
/// ```text
/// dir/rootfs/{usr,proc,dev,sys,tmp,etc,run}   empty mount points
/// dir/rootfs/{bin,lib,lib64,sbin} -> usr/...   merged-/usr symlinks
/// dir/bundle-N/config.json                     one per workload, root
///                                              is the absolute dir/rootfs
/// ```
///
/// The host /usr is bind-mounted read-only at run time (config.json mounts
/// for runc, `-v` for podman), never on the host, so `dir` can be removed
/// with a plain recursive delete.
pub fn prepare_bundles(dir: &Path) -> io::Result<()> {
    let rootfs = dir.join("rootfs");
    for sub in ["usr", "proc", "dev", "sys", "tmp", "etc", "run"] {
        fs::create_dir_all(rootfs.join(sub))?;
    }
    for link in ["bin", "lib", "lib64", "sbin"] {
        std::os::unix::fs::symlink(format!("usr/{link}"), rootfs.join(link))?;
    }
    for w in WORKLOADS {
        let bundle = dir.join(bundle_name(w));
        fs::create_dir_all(&bundle)?;
        fs::write(bundle.join("config.json"), runc_config(w.argv, &rootfs))?;
    }
    Ok(())
}

/// An OCI runtime config close to `runc spec`'s default (pid, network, ipc,
/// uts and mount namespaces, no user namespace, read-only root, the default
/// capability set, no_new_privs) with a non-terminal process running `argv`,
/// the host /usr read-only and a tmpfs /tmp, mirroring the bwrap line.
pub fn runc_config(argv: &[&str], rootfs: &Path) -> String {
    let root = json_string(&rootfs.to_string_lossy());
    let args = argv.iter().map(|a| json_string(a)).collect::<Vec<_>>().join(", ");
    format!(
        r#"{{
  "ociVersion": "1.0.2-dev",
  "process": {{
    "terminal": false,
    "user": {{ "uid": 0, "gid": 0 }},
    "args": [{args}],
    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    "cwd": "/",
    "capabilities": {{
      "bounding": ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"],
      "effective": ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"],
      "permitted": ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"],
      "ambient": ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    }},
    "rlimits": [{{ "type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024 }}],
    "noNewPrivileges": true
  }},
  "root": {{ "path": {root}, "readonly": true }},
  "hostname": "sandbox-bench",
  "mounts": [
    {{ "destination": "/proc", "type": "proc", "source": "proc" }},
    {{ "destination": "/dev", "type": "tmpfs", "source": "tmpfs",
       "options": ["nosuid", "strictatime", "mode=755", "size=65536k"] }},
    {{ "destination": "/dev/pts", "type": "devpts", "source": "devpts",
       "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"] }},
    {{ "destination": "/dev/shm", "type": "tmpfs", "source": "shm",
       "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"] }},
    {{ "destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
       "options": ["nosuid", "noexec", "nodev"] }},
    {{ "destination": "/sys", "type": "sysfs", "source": "sysfs",
       "options": ["nosuid", "noexec", "nodev", "ro"] }},
    {{ "destination": "/usr", "type": "bind", "source": "/usr",
       "options": ["rbind", "ro", "nosuid", "nodev"] }},
    {{ "destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
       "options": ["nosuid", "nodev", "mode=1777"] }}
  ],
  "linux": {{
    "resources": {{ "devices": [{{ "allow": false, "access": "rwm" }}] }},
    "namespaces": [
      {{ "type": "pid" }}, {{ "type": "network" }}, {{ "type": "ipc" }},
      {{ "type": "uts" }}, {{ "type": "mount" }}
    ],
    "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
      "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
      "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
    "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
      "/proc/sysrq-trigger"]
  }}
}}
"#
    )
}

/// A JSON string literal for `s`.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_string_escapes_quotes_backslashes_and_controls() {
        assert_eq!(json_string(r#"print("a\b")"#), r#""print(\"a\\b\")""#);
        assert_eq!(json_string("a\nb"), r#""a\u000ab""#);
    }

    #[test]
    fn runner_names_round_trip() {
        for kind in RunnerKind::ALL {
            assert_eq!(RunnerKind::from_name(kind.name()), Some(kind));
        }
        assert_eq!(RunnerKind::from_name("docker"), None);
    }
}
