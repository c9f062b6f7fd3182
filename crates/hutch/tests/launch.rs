//! Starting sandboxes: host uid ranges are unique on the host whatever run
//! directory a runtime uses, and a launch that fails at the very end (the
//! agent's exec) says so instead of passing for a started sandbox.

mod common;

use common::*;
use hutch_runtime::container::RuntimeError;
use hutch_runtime::{uids, Sandbox, SandboxSpec};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Destroys the sandboxes even when the test panics.
struct Guard(Vec<Sandbox>);

impl Drop for Guard {
    fn drop(&mut self) {
        for sb in self.0.drain(..) {
            let _ = sb.destroy();
        }
    }
}

/// A slot looks held while any open description of its file is locked, and
/// a launching sandbox's child holds, until it execs, a copy of every
/// descriptor this process had open: the slot files another test is taking
/// or probing included. In a daemon such a slot is swept on a later pass;
/// here, tests that start sandboxes or count what a sweep finds take this
/// lock so that they run one at a time.
static SLOTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SLOTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The host uid of a process's root (`Uid:` of /proc/PID/status, real).
fn host_uid(pid: i32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("Uid:")).expect("Uid line");
    line.split_whitespace().nth(1).expect("real uid").parse().expect("number")
}

#[test]
fn two_runtimes_on_different_run_dirs_never_share_a_uid_range() {
    let _one = one_at_a_time();
    let env_a = Env::new("uids-a");
    let env_b = Env::new("uids-b");
    let (rt_a, rt_b) = (runtime(&env_a), runtime(&env_b));
    assert_eq!(rt_a.config().uid_dir, rt_b.config().uid_dir, "one host-wide slot directory");
    assert_eq!(rt_a.config().uid_dir, Path::new(uids::HOST_DIR));
    let mut held = Guard(Vec::new());
    for _ in 0..3 {
        held.0.push(rt_a.start(&SandboxSpec::default()).expect("start in A"));
        held.0.push(rt_b.start(&SandboxSpec::default()).expect("start in B"));
    }
    let bases: Vec<u32> = held.0.iter().map(|s| s.id_base().expect("a started sandbox knows its range")).collect();
    let mut unique = bases.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), bases.len(), "two sandboxes share a range: {bases:?}");
    // The kernel agrees: each sandbox's PID 1 runs as its own base.
    for (sb, base) in held.0.iter().zip(&bases) {
        assert_eq!(host_uid(sb.pid), *base);
    }
    // A range held through one runtime cannot be taken through the other.
    for (i, base) in bases.iter().enumerate() {
        let index = (base - uids::FIRST_ID) / uids::RANGE;
        let other = if i % 2 == 0 { &env_b.run } else { &env_a.run };
        let taken = uids::take(&rt_b.config().uid_dir, index, "intruder", other).expect("take");
        assert!(taken.is_none(), "slot {index} handed out twice");
    }
    drop(held);
    env_a.assert_no_residue();
    env_b.assert_no_residue();
}

#[test]
fn a_runtime_sweeps_only_the_slots_of_its_own_sandboxes() {
    let _one = one_at_a_time();
    let env_a = Env::new("sweep-a");
    let env_b = Env::new("sweep-b");
    let (rt_a, rt_b) = (runtime(&env_a), runtime(&env_b));
    let dir = rt_a.config().uid_dir.clone();
    // Two dead sandboxes' slots (dropped without release: unlocked, file left).
    let of_a = uids::allocate(&dir, "t-sweep-of-a", &env_a.run).expect("slot");
    let of_b = uids::allocate(&dir, "t-sweep-of-b", &env_b.run).expect("slot");
    let (path_a, path_b) = (dir.join(of_a.index.to_string()), dir.join(of_b.index.to_string()));
    drop((of_a, of_b));
    let cleaned = rt_a.sweep();
    assert!(cleaned.contains(&"t-sweep-of-a".to_owned()), "{cleaned:?}");
    assert!(!cleaned.contains(&"t-sweep-of-b".to_owned()), "{cleaned:?}");
    assert!(!path_a.exists(), "A's stale slot is freed");
    assert!(path_b.exists(), "B's stale slot is B's to sweep");
    assert!(rt_b.sweep().contains(&"t-sweep-of-b".to_owned()));
    assert!(!path_b.exists());
    // A slot whose runtime's run directory is gone is freed by anyone.
    let gone = env_b.run.join("gone");
    std::fs::create_dir(&gone).expect("mkdir");
    let orphan = uids::allocate(&dir, "t-sweep-orphan", &gone).expect("slot");
    let path = dir.join(orphan.index.to_string());
    drop(orphan);
    std::fs::remove_dir_all(&gone).expect("rm");
    rt_a.sweep();
    assert!(!path.exists(), "an orphaned slot stays taken forever");
}

#[test]
fn a_runtimes_own_sweep_reads_the_slots_it_marked() {
    let _one = one_at_a_time();
    let env_a = Env::new("own-a");
    let env_b = Env::new("own-b");
    let (rt_a, rt_b) = (runtime(&env_a), runtime(&env_b));
    let dir = rt_a.config().uid_dir.clone();
    let mark_a = |i: u32| env_a.run.join("slots").join(i.to_string());
    // Dead sandboxes' slots (dropped without release: unlocked, file and mark left).
    let of_a = uids::allocate(&dir, "t-own-of-a", &env_a.run).expect("slot");
    let of_b = uids::allocate(&dir, "t-own-of-b", &env_b.run).expect("slot");
    let (ia, ib) = (of_a.index, of_b.index);
    assert!(mark_a(ia).exists(), "a slot taken is marked in its runtime's run directory");
    drop((of_a, of_b));
    assert_eq!(rt_a.sweep_own(), vec!["t-own-of-a".to_owned()]);
    assert!(!dir.join(ia.to_string()).exists() && !mark_a(ia).exists(), "A's slot and mark are gone");
    assert!(dir.join(ib.to_string()).exists(), "B's stale slot is B's to sweep");
    // A's mark of a slot that B took over after A's sandbox died: left
    // while B holds it, dropped once the slot is found to be B's.
    let dead = uids::allocate(&dir, "t-own-dead", &env_a.run).expect("slot");
    let index = dead.index;
    drop(dead);
    let of_b2 = uids::take(&dir, index, "t-own-of-b2", &env_b.run).expect("take").expect("a dead slot is free");
    assert!(rt_a.sweep_own().is_empty(), "B holds it");
    assert!(mark_a(index).exists());
    drop(of_b2);
    assert!(rt_a.sweep_own().is_empty(), "the slot is B's now");
    assert!(!mark_a(index).exists(), "A's mark of B's slot is dropped");
    assert!(dir.join(index.to_string()).exists(), "and the slot is left to B");
    let mut of_b = rt_b.sweep_own();
    of_b.sort();
    assert_eq!(of_b, vec!["t-own-of-b".to_owned(), "t-own-of-b2".to_owned()]);
    assert!(!dir.join(index.to_string()).exists() && !dir.join(ib.to_string()).exists());
}

#[test]
fn a_sandbox_whose_agent_cannot_be_executed_reports_the_exec_step_and_errno() {
    let _one = one_at_a_time();
    let env = Env::new("noexec");
    let rt = runtime(&env);
    // An "agent" the kernel refuses to run: no ELF header and no #! line.
    let bad = env.state.join("not-an-agent");
    std::fs::write(&bad, b"\x7fELF but not really").expect("write");
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let spec = SandboxSpec { agent_override: Some((bad, vec!["not-an-agent".into()])), ..SandboxSpec::default() };
    match rt.start(&spec) {
        Err(RuntimeError::Setup(e)) => {
            assert_eq!(e.step, "exec the agent", "{e}");
            assert_eq!(e.source.raw_os_error(), Some(libc::ENOEXEC), "{e}");
        }
        Err(other) => panic!("expected the exec step to fail, got {other}"),
        Ok(sb) => {
            let _ = sb.destroy();
            panic!("a sandbox whose agent never ran was reported started");
        }
    }
    env.assert_no_residue();
}
