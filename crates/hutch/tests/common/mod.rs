//! Helpers shared by the end-to-end tests: run the real `hutch` binary as
//! root, each test with its own state and runtime directories, and check
//! that nothing of a sandbox is left on the host afterwards.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Polls `cond` until it holds; fails the test after `timeout`. These tests
/// wait on conditions, never for a fixed time.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether the kernel reports the cgroup of sandbox `name` frozen, every
/// process in it stopped (`freezer.state` FROZEN on cgroup v1, `frozen 1` in
/// `cgroup.events` on v2). Fails when it has no freezer cgroup.
pub fn frozen(name: &str) -> bool {
    let dirs = cgroups_named(name);
    for d in &dirs {
        if let Ok(state) = std::fs::read_to_string(d.join("freezer.state")) {
            return state.trim() == "FROZEN";
        }
        if d.join("cgroup.freeze").exists() {
            let events = std::fs::read_to_string(d.join("cgroup.events")).expect("cgroup.events");
            return events.lines().any(|l| l == "frozen 1");
        }
    }
    panic!("sandbox {name} has no freezer cgroup: {dirs:?}");
}

/// Directories of one test, removed on drop (even when the test fails).
pub struct Env {
    pub state: PathBuf,
    pub run: PathBuf,
}

impl Env {
    pub fn new(name: &str) -> Env {
        assert_eq!(
            // SAFETY: geteuid has no preconditions.
            unsafe { libc::geteuid() },
            0,
            "these tests make real namespaces and cgroups: run them as root (CI does)"
        );
        assert!(
            agent().is_file(),
            "hutch-agent not built at {}: run `cargo build --workspace` first",
            agent().display()
        );
        let base = std::env::temp_dir().join(format!("hutch-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let env = Env { state: base.join("state"), run: base.join("run") };
        std::fs::create_dir_all(&env.state).expect("mkdir state");
        env
    }

    /// `hutch ARGS...` with this test's directories.
    pub fn hutch(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hutch"));
        cmd.env("HUTCH_STATE_DIR", &self.state).env("HUTCH_RUN_DIR", &self.run).env("HUTCH_AGENT", agent());
        cmd
    }

    /// Runs `hutch run [opts] -- cmd...` with stdin closed and returns its
    /// output, in the isolation class of [`class`].
    pub fn run(&self, opts: &[&str], cmd: &[&str]) -> Output {
        let mut c = self.hutch();
        c.arg("run").arg("--class").arg(class()).args(opts).arg("--").args(cmd).stdin(Stdio::null());
        c.output().expect("spawn hutch")
    }

    /// Asserts nothing of any sandbox of this test is left: no socket, no
    /// uid slot, no cgroup named after a sandbox of ours, no mount.
    pub fn assert_no_residue(&self) {
        let dir = self.run.join("sockets");
        let left: Vec<_> =
            std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        assert!(left.is_empty(), "{} still holds {left:?}", dir.display());
        // Uid slots are host-wide; ours are those that name our run directory.
        let slots = Path::new(hutch_runtime::uids::HOST_DIR);
        let ours: Vec<_> = std::fs::read_dir(slots)
            .map(|d| d.flatten().collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter(|e| {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                hutch_runtime::uids::parse_record(&text).1.as_deref() == Some(self.run.as_path())
            })
            .map(|e| e.file_name())
            .collect();
        assert!(ours.is_empty(), "{} still holds slots of {}: {ours:?}", slots.display(), self.run.display());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        assert!(!mounts.contains(self.run.to_str().expect("utf8")), "a mount under {} is left", self.run.display());
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // A storage image a test mounted goes first (its loop device
        // detaches itself once nothing holds the file system).
        // (And the tmpfs under it, if the test put the image on one.)
        for dir in [self.state.join("storage/fs"), self.state.join("storage")] {
            let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
            if mounts.lines().any(|l| l.split(' ').nth(4) == dir.to_str()) {
                let c = std::ffi::CString::new(dir.to_string_lossy().as_bytes()).expect("path");
                // SAFETY: c is a valid C string; umount2 has no other memory effects.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
        if let Some(base) = self.state.parent() {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

/// The test's disk storage: a sparse btrfs image of `size` bytes under its
/// state directory, unmounted when the [`Env`] drops.
pub fn storage(env: &Env, size: u64) -> std::sync::Arc<hutch_runtime::storage::Storage> {
    open_storage(env, size)
}

/// Like [`storage`], with the image on a tmpfs of its own: for tests that
/// write gigabytes, which the host's disk may not have to spare. What the
/// sandbox sees (its page cache under its memory limit, the quota) is the
/// same; only where the loop device's blocks end up differs.
pub fn storage_in_memory(env: &Env, size: u64) -> std::sync::Arc<hutch_runtime::storage::Storage> {
    let dir = env.state.join("storage");
    std::fs::create_dir_all(&dir).expect("mkdir storage");
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o"])
        .arg(format!("size={},mode=0700", size + (64 << 20)))
        .arg("hutch-test")
        .arg(&dir)
        .status()
        .expect("mount");
    assert!(status.success(), "mount a tmpfs at {}", dir.display());
    open_storage(env, size)
}

fn open_storage(env: &Env, size: u64) -> std::sync::Arc<hutch_runtime::storage::Storage> {
    let cfg = hutch_runtime::storage::StorageConfig::new(&env.state, Some(size));
    std::sync::Arc::new(hutch_runtime::storage::Storage::open(&cfg).expect("open the storage"))
}

/// The agent binary cargo built next to `hutch`.
pub fn agent() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_hutch")).with_file_name("hutch-agent")
}

/// Cgroup directories named `name` under any hierarchy's `hutch/`.
pub fn cgroups_named(name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                let p = e.path().join("hutch").join(name);
                if p.is_dir() {
                    found.push(p);
                }
            }
        }
        let p = Path::new(root).join("hutch").join(name);
        if p.is_dir() && !found.contains(&p) {
            found.push(p);
        }
    }
    found
}

/// Loop devices with a backing file (hutch must never leave one).
pub fn loop_devices() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/sys/block") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("loop") && e.path().join("loop/backing_file").exists() {
                out.push(name);
            }
        }
    }
    out
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Host pids whose command line contains `needle`.
pub fn host_pids_with(needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if text.contains(needle) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// A runtime with the test's own state and run directories.
pub fn runtime(env: &Env) -> hutch_runtime::Runtime {
    let cfg = hutch_runtime::Config {
        state_dir: env.state.clone(),
        run_dir: env.run.clone(),
        agent: agent(),
        ..hutch_runtime::Config::from_env()
    };
    hutch_runtime::Runtime::new(cfg).expect("runtime")
}

/// Destroys the sandbox even when the test panics.
pub struct Guard(pub Option<hutch_runtime::Sandbox>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(sb) = self.0.take() {
            let _ = sb.destroy();
        }
    }
}

impl std::ops::Deref for Guard {
    type Target = hutch_runtime::Sandbox;
    fn deref(&self) -> &hutch_runtime::Sandbox {
        self.0.as_ref().expect("live sandbox")
    }
}

/// Starts a sandbox that ends with the guard.
pub fn start(rt: &hutch_runtime::Runtime, spec: &hutch_runtime::SandboxSpec) -> Guard {
    Guard(Some(rt.start(spec).expect("start sandbox")))
}

/// Polls `cond` until it holds; panics naming `what` after `timeout`.
pub fn wait_until(what: &str, timeout: std::time::Duration, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The isolation class `hutch run` tests use: HUTCH_TEST_CLASS, else
/// `container` (scripts/test.sh runs the escape tests on gvisor too).
pub fn class() -> String {
    std::env::var("HUTCH_TEST_CLASS").unwrap_or_else(|_| "container".into())
}
