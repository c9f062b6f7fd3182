//! `hutch doctor`: what this host offers sandboxes and what it lacks, each
//! finding with how to fix it, and which isolation classes can run.

use crate::cgroup::{Controller, Layout, Placement};
use crate::Config;
use serde::Serialize;
use std::fs;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct Finding {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
    /// How to fix it, when not ok.
    pub fix: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ClassSupport {
    pub class: &'static str,
    pub available: bool,
    pub why: String,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub classes: Vec<ClassSupport>,
}

impl Report {
    /// Whether the default class (`container`) can run here.
    pub fn default_class_ok(&self) -> bool {
        self.classes.iter().any(|c| c.class == "container" && c.available)
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for f in &self.findings {
            out.push_str(&format!("{} {:<16} {}\n", if f.ok { "ok  " } else { "MISS" }, f.name, f.detail));
            if let Some(fix) = &f.fix {
                out.push_str(&format!("     {:<16} fix: {}\n", "", fix));
            }
        }
        out.push_str("\nisolation classes:\n");
        for c in &self.classes {
            out.push_str(&format!("{} {:<16} {}\n", if c.available { "ok  " } else { "no  " }, c.class, c.why));
        }
        out
    }
}

/// Where the sandboxes' disk layers live (the state directory's btrfs, or
/// an image of the daemon's) and how full it is. Without it sandboxes still
/// run, with memory layers only.
fn storage_finding(state_dir: &Path) -> Finding {
    use crate::storage::{inspect, Found};
    let fix =
        "give the host loop devices and btrfs in the kernel (modprobe loop btrfs), or put the state directory on btrfs";
    match inspect(state_dir) {
        Found::Mounted(status) => finding("storage", true, status.to_string(), fix),
        Found::Unmounted { image, size_bytes } => finding(
            "storage",
            true,
            format!(
                "btrfs image {} ({:.1} GiB), not mounted: hutch serve mounts it",
                image.display(),
                size_bytes as f64 / f64::from(1u32 << 30)
            ),
            fix,
        ),
        Found::None { native } => match crate::storage::can_make(native) {
            Ok(()) if native => finding("storage", true, "none yet; hutch serve uses the state directory's btrfs", fix),
            Ok(()) => finding(
                "storage",
                true,
                format!("none yet; hutch serve makes a btrfs image under {}", state_dir.join("storage").display()),
                fix,
            ),
            Err(why) => finding("storage", false, format!("{why}: sandboxes get memory layers only"), fix),
        },
        Found::Foreign { path, fstype } => finding(
            "storage",
            false,
            format!("{} is a {fstype} mount, not hutch's btrfs: sandboxes get memory layers only", path.display()),
            "unmount it, or use another state directory",
        ),
    }
}

fn finding(name: &'static str, ok: bool, detail: impl Into<String>, fix: &str) -> Finding {
    Finding { name, ok, detail: detail.into(), fix: (!ok).then(|| fix.to_owned()) }
}

/// Runs every check. Reads only; changes nothing on the host.
pub fn check(cfg: &Config) -> Report {
    let mut f = Vec::new();
    let release = crate::sys::kernel_release();
    let (major, minor) = parse_release(&release);
    f.push(finding(
        "kernel",
        (major, minor) >= (5, 19),
        format!("Linux {release}"),
        "use Linux 5.19 or newer (overlayfs over id-mapped lower layers)",
    ));
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    f.push(finding("root", root, if root { "running as root" } else { "not root" }, "run hutch as root"));

    let max_userns = read_trim("/proc/sys/user/max_user_namespaces").and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    f.push(finding(
        "user namespaces",
        max_userns > 0,
        format!("user.max_user_namespaces = {max_userns}"),
        "sysctl -w user.max_user_namespaces=65536",
    ));

    let layout = Layout::detect(&cfg.cgroup_root);
    let cgroups_ok = match &layout {
        Ok(l) => {
            let mut missing = Vec::new();
            let mut detail = format!("{}:", l.kind());
            for c in Controller::ALL {
                match l.placement(c) {
                    Some(Placement::V1(_)) => detail.push_str(&format!(" {} (v1)", c.name())),
                    Some(Placement::V2) => detail.push_str(&format!(" {} (v2)", c.name())),
                    None => missing.push(c.name()),
                }
            }
            detail.push_str(if l.can_freeze() { ", freeze" } else { ", no freezer" });
            if l.v2.as_ref().is_some_and(|v2| v2.join("cgroup.procs").exists()) {
                detail.push_str(if l.v2.as_ref().is_some_and(|v2| kill_supported(v2)) { ", cgroup.kill" } else { "" });
            }
            if !missing.is_empty() {
                detail.push_str(&format!("; missing {}", missing.join(", ")));
            }
            let ok = missing.is_empty() && l.can_freeze();
            f.push(finding(
                "cgroups",
                ok,
                detail,
                "mount the memory, pids, cpu (and freezer, on v1) controllers, or enable them in cgroup.subtree_control",
            ));
            let own = l.command_cgroups() && l.v2.as_ref().is_some_and(|v2| kill_supported(v2));
            f.push(finding(
                "command trees",
                true,
                if own {
                    "a cgroup each (the sandbox's v2 directory, delegated to its agent; for a process \
                     sandbox, two made by the daemon)"
                        .to_owned()
                } else {
                    "a supervisor process each (the v2 tree holds workload controllers, or has no cgroup.kill)"
                        .to_owned()
                },
                "",
            ));
            let fast = crate::cgroup::migrations_fast(l);
            f.push(finding(
                "cgroup moves",
                fast,
                if fast {
                    "fast (v2 clone into cgroup, or favordynmods)".to_owned()
                } else {
                    "each v1 cgroup join waits for an RCU grace period (~10 ms)".to_owned()
                },
                "remount the cgroup2 tree with -o remount,favordynmods (hutch does this itself when it runs as root)",
            ));
            ok
        }
        Err(e) => {
            f.push(finding("cgroups", false, e.to_string(), "mount cgroup2 at /sys/fs/cgroup"));
            false
        }
    };

    let filesystems = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let overlay = filesystems.lines().any(|l| l.trim_end().ends_with("overlay"));
    f.push(finding("overlayfs", overlay, if overlay { "available" } else { "not listed" }, "modprobe overlay"));

    let seccomp = read_trim("/proc/sys/kernel/seccomp/actions_avail").unwrap_or_default();
    let seccomp_ok = seccomp.contains("errno") && seccomp.contains("kill_process");
    f.push(finding(
        "seccomp",
        seccomp_ok,
        if seccomp.is_empty() { "not available".into() } else { format!("actions: {seccomp}") },
        "build the kernel with CONFIG_SECCOMP_FILTER",
    ));

    let (run_fs, run_tmpfs) = run_dir_fs(&cfg.run_dir);
    f.push(finding(
        "run directory",
        run_tmpfs,
        format!("{} is on {run_fs}", cfg.run_dir.display()),
        "put it on a tmpfs (HUTCH_RUN_DIR, or /run on a tmpfs as systemd hosts have it): every sandbox binds \
         a socket there, and a disk file system makes and frees an inode each time",
    ));

    let landlock = crate::process::landlock_abi();
    f.push(finding(
        "landlock",
        landlock > 0,
        if landlock > 0 { format!("ABI {landlock}") } else { "not enabled".into() },
        "boot with lsm=landlock,... (needed by the process class)",
    ));

    // The daemon loads its ruleset over nfnetlink (no nft program): try a
    // transaction that makes a table and deletes it again.
    let nf_tables = crate::net::netlink::Netlink::netfilter()
        .and_then(|mut nl| crate::net::nftables::delete_table(&mut nl, "hutch-doctor-probe"));
    f.push(finding(
        "network",
        nf_tables.is_ok(),
        match &nf_tables {
            Ok(()) => "nf_tables available: sandboxes get networks and egress policies".to_owned(),
            Err(e) => format!("nf_tables refused a table ({e}): only deny_all sandboxes (loopback only) can start"),
        },
        "run as root on a kernel with nf_tables, veth and NAT (modprobe nf_tables)",
    ));

    let mmdebstrap = crate::image::debian::mmdebstrap_found();
    f.push(finding(
        "presets",
        mmdebstrap,
        if mmdebstrap {
            "mmdebstrap found: presets and Debian image builds work"
        } else {
            "mmdebstrap not found: presets (python, node, code-interpreter) and `hutch image build` cannot be built; \
             `base`, imports and pulls work"
        },
        "apt-get install mmdebstrap",
    ));

    let agent_ok = cfg.agent.is_file();
    f.push(finding(
        "agent",
        agent_ok,
        cfg.agent.display().to_string(),
        "build it with `cargo build --release` or set HUTCH_AGENT",
    ));

    f.push(storage_finding(&cfg.state_dir));

    let (kvm_ok, kvm_detail) = kvm();
    f.push(finding("kvm", kvm_ok, kvm_detail, "run on a host with hardware virtualisation and /dev/kvm"));

    // The gvisor class runs on ptrace; kvm is reported when /dev/kvm works.
    let runsc = crate::gvisor::runsc_version();
    let gvisor_ok = runsc.is_some() && root && crate::gvisor::probe_platform("ptrace").is_ok();
    let mut platforms = Vec::new();
    if gvisor_ok {
        platforms.push("ptrace");
        if kvm_ok && crate::gvisor::probe_platform("kvm").is_ok() {
            platforms.push("kvm");
        }
    }
    f.push(finding(
        "gvisor",
        gvisor_ok,
        match &runsc {
            Some(v) if gvisor_ok => format!("{v}; platforms that start a sandbox: {}", platforms.join(", ")),
            Some(v) => format!("{v}; no sandbox starts on the ptrace platform"),
            None => "runsc not found".into(),
        },
        "apt-get install runsc (the gvisor class)",
    ));

    let container_ok =
        root && max_userns > 0 && cgroups_ok && overlay && seccomp_ok && agent_ok && (major, minor) >= (5, 19);
    let classes = vec![
        ClassSupport {
            class: "container",
            available: container_ok,
            why: if container_ok {
                "namespaces, overlay, cgroups, seccomp".into()
            } else {
                "see the findings above".into()
            },
        },
        ClassSupport {
            class: "process",
            available: container_ok && landlock > 0,
            why: match crate::process::require_landlock(landlock) {
                Ok(abi) => format!("a uid, Landlock (ABI {abi}) and seccomp in a shared host container"),
                Err(why) => why,
            },
        },
        ClassSupport {
            class: "gvisor",
            available: gvisor_ok && container_ok,
            why: if gvisor_ok {
                "runsc on the ptrace platform, over the container class's root and network".into()
            } else if runsc.is_some() {
                "runsc present, but no sandbox starts on ptrace".into()
            } else {
                "runsc missing".into()
            },
        },
        ClassSupport {
            class: "microvm",
            available: false,
            why: if kvm_ok {
                "KVM present; driver not built yet".into()
            } else {
                "no KVM that boots a stock guest".into()
            },
        },
    ];
    Report { findings: f, classes }
}

/// The file system `run_dir` is on (its nearest existing ancestor's,
/// before the daemon made it), and whether that is a tmpfs.
fn run_dir_fs(run_dir: &Path) -> (String, bool) {
    use hutch_agent::proto::TMPFS_MAGIC;
    let Some(dir) = run_dir.ancestors().find(|d| d.exists()) else { return ("nothing".into(), false) };
    let Ok(magic) = crate::storage::fs_type(dir) else { return ("an unknown file system".into(), false) };
    let name = match magic {
        TMPFS_MAGIC => "tmpfs".to_owned(),
        0xef53 => "ext4".to_owned(),
        0x5846_5342 => "xfs".to_owned(),
        crate::storage::btrfs::SUPER_MAGIC => "btrfs".to_owned(),
        other => format!("a file system of type {other:#x}"),
    };
    (name, magic == TMPFS_MAGIC)
}

fn parse_release(release: &str) -> (u32, u32) {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor)
}

fn read_trim(path: &str) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

fn kill_supported(v2: &Path) -> bool {
    // cgroup.kill exists in every non-root cgroup from 5.14; the root has
    // none, so look at any child.
    fs::read_dir(v2)
        .ok()
        .and_then(|mut it| it.find_map(|e| e.ok().filter(|e| e.path().join("cgroup.kill").exists())))
        .is_some()
}

/// Whether /dev/kvm exists, and whether it is a real hypervisor: PVM (a
/// paravirtual KVM inside a VM) boots no stock guest kernel.
fn kvm() -> (bool, String) {
    if !Path::new("/dev/kvm").exists() {
        return (false, "/dev/kvm absent".into());
    }
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hw = cpuinfo.lines().any(|l| l.starts_with("flags") && (l.contains(" vmx") || l.contains(" svm")));
    let pvm = Path::new("/sys/module/kvm_pvm").exists() || cpuinfo.contains("pvm");
    if pvm || !hw {
        (
            false,
            "/dev/kvm is present but is not hardware KVM (PVM or nested without vmx/svm): stock guests do not boot"
                .into(),
        )
    } else {
        (true, "/dev/kvm with hardware virtualisation".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_parsing() {
        assert_eq!(parse_release("6.18.44-fc-v669"), (6, 18));
        assert_eq!(parse_release("5.4.0"), (5, 4));
        assert_eq!(parse_release("garbage"), (0, 0));
    }
}
