//! `hutch run` end to end: limits are enforced and reported, timeouts kill
//! whole trees, output is bounded, bad input gets clear errors, and every
//! run leaves nothing behind.

mod common;

use common::*;
use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

#[test]
fn runs_a_command_and_passes_output_and_exit_code_through() {
    let env = Env::new("basic");
    let out = env.run(&[], &["sh", "-c", "echo out; echo err >&2; exit 7"]);
    assert_eq!(stdout(&out), "out\n");
    assert_eq!(stderr(&out), "err\n");
    assert_eq!(out.status.code(), Some(7));
    env.assert_no_residue();
}

#[test]
fn runs_as_user_in_workspace_by_default_and_root_on_request() {
    let env = Env::new("user");
    let out = env.run(&[], &["sh", "-c", "id -u; id -g; pwd; echo $HOME"]);
    assert_eq!(stdout(&out), "1000\n1000\n/workspace\n/home/user\n", "{}", stderr(&out));
    let out = env.run(&["--user", "root"], &["id", "-u"]);
    assert_eq!(stdout(&out), "0\n");
    env.assert_no_residue();
}

#[test]
fn stdin_is_passed_through() {
    let env = Env::new("stdin");
    let mut child = env
        .hutch()
        .args(["run", "--", "tr", "a-z", "A-Z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(b"hello sandbox\n").expect("write");
    }
    let out = child.wait_with_output().expect("wait");
    assert_eq!(stdout(&out), "HELLO SANDBOX\n");
    assert!(out.status.success());
}

#[test]
fn env_and_workdir_options_apply() {
    let env = Env::new("envopt");
    let out = env.run(&["-e", "GREETING=hi there", "-w", "/tmp"], &["sh", "-c", "echo $GREETING; pwd"]);
    assert_eq!(stdout(&out), "hi there\n/tmp\n", "{}", stderr(&out));
}

#[test]
fn memory_hog_is_killed_and_reported_as_oom() {
    let env = Env::new("oom");
    let out = env.run(
        &["--memory", "64M", "--name", "t-oom"],
        &["python3", "-c", "b = bytearray(512 << 20); print('survived')"],
    );
    assert_eq!(out.status.code(), Some(137), "stderr: {}", stderr(&out));
    assert!(stderr(&out).contains("memory limit 64M exceeded"), "stderr: {}", stderr(&out));
    assert!(!stdout(&out).contains("survived"));
    assert!(cgroups_named("t-oom").is_empty(), "cgroup left: {:?}", cgroups_named("t-oom"));
    env.assert_no_residue();
}

#[test]
fn fork_bomb_stops_at_the_pids_limit() {
    let env = Env::new("pids");
    let script = "import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('forks', n, e.errno)\n";
    let out = env.run(&["--pids", "32", "--name", "t-pids"], &["python3", "-c", script]);
    let text = stdout(&out);
    let forks: u32 = text.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(9999);
    assert!(forks < 32, "forked {forks} times under a limit of 32: {text} {}", stderr(&out));
    assert!(text.trim_end().ends_with(" 11"), "fork must fail with EAGAIN: {text}");
    assert!(stderr(&out).contains("pids limit 32 reached"), "stderr: {}", stderr(&out));
    // The sleeping children died with the sandbox.
    assert!(cgroups_named("t-pids").is_empty());
    env.assert_no_residue();
}

#[test]
fn disk_filler_gets_enospc() {
    let env = Env::new("disk");
    let out = env.run(
        &["--disk", "16M"],
        &["sh", "-c", "dd if=/dev/zero of=/workspace/fill bs=1M count=64 2>&1; echo rc=$?; ls -s /workspace"],
    );
    let text = stdout(&out);
    assert!(text.contains("No space left on device"), "{text}");
    assert!(text.contains("rc=1"), "{text}");
    env.assert_no_residue();
}

#[test]
fn cpu_spinner_is_throttled_to_its_vcpus() {
    let env = Env::new("cpu");
    let script = "import os, time\nt = time.time()\nc = os.times()\nwhile time.time() - t < 1.5: pass\nu = os.times()\nprint((u.user + u.system - c.user - c.system) / (time.time() - t))";
    let out = env.run(&["--vcpus", "0.2"], &["python3", "-c", script]);
    let share: f64 = stdout(&out).trim().parse().unwrap_or_else(|_| panic!("{} {}", stdout(&out), stderr(&out)));
    // Not a timed assertion but the limit itself: CPU time over wall time is
    // what the quota caps, a ceiling that holds however loaded the machine
    // is (load only lowers the share).
    assert!(share < 0.3, "a 0.2 vCPU sandbox used {share:.2} of a CPU");
    assert!(share > 0.02, "the spinner barely ran ({share:.3}): the test measured nothing");
}

#[test]
fn timeout_kills_a_tree_that_used_setsid() {
    let env = Env::new("timeout");
    let marker = "7341.25";
    let out = env.run(
        &["--timeout", "1s"],
        &["bash", "-c", &format!("setsid sleep {marker} & (setsid sh -c 'sleep {marker}' &); sleep {marker}")],
    );
    assert_eq!(out.status.code(), Some(124), "stderr: {}", stderr(&out));
    assert!(stderr(&out).contains("timeout"), "{}", stderr(&out));
    assert!(host_pids_with(&format!("sleep {marker}")).is_empty(), "setsid'd sleeps survived the timeout");
    env.assert_no_residue();
}

#[test]
fn a_command_has_a_cgroup_of_its_own_that_the_sandbox_cannot_reach() {
    let env = Env::new("treecg");
    // On a host whose v2 tree holds no controller (hybrid), the agent
    // tracks each command by a cgroup of its own below the sandbox's v2
    // directory, with no supervisor process: the command's v2 line names
    // it, relative to the sandbox's cgroup namespace. On a pure v2 host
    // the command is supervised and stays in the workload's cgroup.
    let pure_v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let script = "grep '^0::' /proc/self/cgroup; echo $PPID; \
                  mkdir /sys/fs/cgroup/x 2>/dev/null && echo made || echo refused; \
                  mount -t cgroup2 none /mnt 2>/dev/null && echo mounted || echo refused";
    let out = env.run(&["--name", "t-treecg", "--user", "root"], &["sh", "-c", script]);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text} {}", stderr(&out));
    if pure_v2 {
        assert_eq!(lines[0], "0::/", "{text}");
    } else {
        assert_eq!(lines[0], "0::/c0", "{text}");
        // Its parent is the agent (PID 1), not a supervisor.
        assert_eq!(lines[1], "1", "{text}");
    }
    // Root in the sandbox can neither make a cgroup nor mount the tree.
    assert_eq!(&lines[2..], ["refused", "refused"], "{text}");
    assert!(cgroups_named("t-treecg").is_empty(), "the sandbox's cgroups are left");
    env.assert_no_residue();
}

#[test]
fn output_of_a_gigabyte_is_streamed_in_bounded_memory() {
    let env = Env::new("bigout");
    let mut child = env
        .hutch()
        .args(["run", "--", "head", "-c", "1G", "/dev/zero"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut peak_kb = 0u64;
    loop {
        let n = stdout.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        assert!(buf[..n].iter().all(|b| *b == 0));
        total += n as u64;
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", child.id())) {
            if let Some(kb) = status.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1))
            {
                peak_kb = peak_kb.max(kb.parse().unwrap_or(0));
            }
        }
    }
    let status = child.wait().expect("wait");
    assert!(status.success());
    assert_eq!(total, 1 << 30);
    assert!(peak_kb > 0 && peak_kb < 64 * 1024, "hutch run held {peak_kb} KiB while streaming");
    env.assert_no_residue();
}

#[test]
fn zombies_are_reaped() {
    let env = Env::new("zombies");
    // Orphans whose parent exits are reparented inside the sandbox and must
    // be reaped there, not pile up as zombies.
    // The script learns its grandchildren's pids, waits (10 s at most) until
    // each has exited, then until none is left a zombie, and counts them.
    let script = r#"import os, time
r, w = os.pipe()
for _ in range(20):
    if os.fork() == 0:
        g = os.fork()
        if g == 0:
            os._exit(0)
        os.write(w, f"{g}\n".encode())
        os._exit(0)
os.close(w)
grandchildren = [int(p) for p in os.fdopen(r).read().split()]
for _ in range(20):
    try: os.wait()
    except ChildProcessError: break
def state(p):
    try: return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError: return None
end = time.monotonic() + 10
while any(state(g) not in ("Z", None) for g in grandchildren) and time.monotonic() < end: time.sleep(0.01)
while any(state(g) == "Z" for g in grandchildren) and time.monotonic() < end: time.sleep(0.01)
print(len(grandchildren), "orphans", "zombies", sum(state(g) == "Z" for g in grandchildren))"#;
    let out = env.run(&[], &["python3", "-c", script]);
    assert_eq!(stdout(&out).trim(), "20 orphans zombies 0", "{}", stderr(&out));
}

#[test]
fn missing_command_exits_127_with_a_message() {
    let env = Env::new("missing");
    let out = env.run(&[], &["no-such-command-xyz"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(stderr(&out).contains("no-such-command-xyz"), "{}", stderr(&out));
    env.assert_no_residue();
}

#[test]
fn unknown_user_is_refused_and_leaves_nothing() {
    let env = Env::new("nouser");
    let out = env.run(&["--user", "mallory", "--name", "t-nouser"], &["true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("mallory"), "{}", stderr(&out));
    assert!(cgroups_named("t-nouser").is_empty());
    env.assert_no_residue();
}

#[test]
fn bad_options_are_refused_before_anything_starts() {
    let env = Env::new("badopts");
    for opts in [
        &["--memory", "lots"][..],
        &["--vcpus", "0"],
        &["--timeout", "5w"],
        &["--env", "NOEQUALS"],
        &["--name", "Bad/Name"],
    ] {
        let out = env.run(opts, &["true"]);
        assert_ne!(out.status.code(), Some(0), "{opts:?} was accepted");
        assert!(!stderr(&out).is_empty());
    }
    env.assert_no_residue();
}

#[test]
fn teardown_after_every_run_leaves_no_cgroup_mount_or_loop_device() {
    let env = Env::new("residue");
    let loops_before = loop_devices();
    for i in 0..5 {
        let name = format!("t-residue-{i}");
        let out = env.run(&["--name", &name], &["sh", "-c", "sleep 100 & echo started"]);
        assert_eq!(stdout(&out), "started\n");
        assert!(cgroups_named(&name).is_empty(), "cgroup {name} left");
    }
    assert_eq!(loop_devices(), loops_before);
    assert!(host_pids_with("sleep 100").iter().all(|p| {
        // A sleep 100 of someone else's is fine; ours lived in our sandboxes
        // and must have died: none of them may still sit in a hutch cgroup.
        let cg = std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap_or_default();
        !cg.contains("/hutch/t-residue-")
    }));
    env.assert_no_residue();
}

#[test]
fn a_killed_hutch_run_takes_its_sandbox_down_and_the_next_run_sweeps_it() {
    let env = Env::new("sweep");
    let mut child = env
        .hutch()
        .args(["run", "--name", "t-sweep", "--", "sleep", "8123"])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn");
    wait_for("the sandboxed sleep to start", Duration::from_secs(10), || !host_pids_with("sleep 8123").is_empty());
    // SAFETY: kill has no memory effects; the pid is our own child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().expect("wait");
    wait_for("the sandbox to end with the hutch run that owned it", Duration::from_secs(5), || {
        host_pids_with("sleep 8123").is_empty()
    });
    // Its cgroup and uid slot are stale now; the next run sweeps them.
    let out = env.run(&[], &["true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(cgroups_named("t-sweep").is_empty(), "stale cgroup not swept");
    env.assert_no_residue();
}

#[test]
fn a_missing_workdir_is_refused_before_anything_runs() {
    let env = Env::new("noworkdir");
    let out = env.run(&["-w", "/no/such/dir"], &["sh", "-c", "echo ran"]);
    assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
    assert!(stderr(&out).contains("/no/such/dir"), "{}", stderr(&out));
    assert!(!stdout(&out).contains("ran"));
    env.assert_no_residue();
}

#[test]
fn doctor_reports_the_host_and_the_container_class() {
    let env = Env::new("doctor");
    let out = env.hutch().args(["doctor", "--json"]).output().expect("doctor");
    assert!(out.status.success(), "the container class must run on the CI host: {}", stdout(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json prints JSON");
    let findings = report["findings"].as_array().expect("findings");
    for name in ["kernel", "user namespaces", "cgroups", "command trees", "overlayfs", "seccomp", "landlock", "kvm"] {
        assert!(findings.iter().any(|f| f["name"] == name), "doctor says nothing about {name}");
    }
    // What a_command_has_a_cgroup_of_its_own_that_the_sandbox_cannot_reach
    // finds, said: a cgroup per command where the v2 tree holds no
    // workload controller (hybrid), a supervisor on a pure v2 host.
    let trees = findings.iter().find(|f| f["name"] == "command trees").expect("command trees");
    let pure_v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let detail = trees["detail"].as_str().expect("detail");
    assert_eq!(detail.starts_with("a cgroup each"), !pure_v2, "{detail}");
    let classes = report["classes"].as_array().expect("classes");
    assert!(classes.iter().any(|c| c["class"] == "container" && c["available"] == true));
    // The process class runs where Landlock does (the CI host's kernel has it).
    let landlock = findings.iter().find(|f| f["name"] == "landlock").expect("landlock");
    let process = classes.iter().find(|c| c["class"] == "process").expect("process");
    assert_eq!(process["available"], landlock["ok"], "{process}");
    // The run directory's file system, as statfs(1) names it.
    let run = findings.iter().find(|f| f["name"] == "run directory").expect("run directory");
    let fs = std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(env.run.parent().expect("parent"))
        .output()
        .expect("stat");
    let tmpfs = String::from_utf8_lossy(&fs.stdout).trim() == "tmpfs";
    assert_eq!(run["ok"], tmpfs, "{run}");
    // A host without the agent cannot run the default class: non-zero exit.
    let out = env.hutch().args(["doctor"]).env("HUTCH_AGENT", "/nonexistent/hutch-agent").output().expect("doctor");
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("MISS agent"), "{}", stdout(&out));
}
