//! Escape probes: small programs run inside a sandbox, as its root (the
//! strongest user there), that try to reach the host and must be refused.
//! Each policy is also tested the other way: what it allows still works.

mod common;

use common::*;
use std::process::Command;

/// Runs a Python probe as root in a fresh sandbox; returns its stdout.
fn probe(env: &Env, script: &str) -> String {
    let out = env.run(&["--user", "root"], &["python3", "-c", script]);
    let text = stdout(&out);
    assert!(out.status.success(), "probe failed: {text}\n{}", stderr(&out));
    text
}

const SYSCALL: &str = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef call(nr, *args):\n    r = libc.syscall(nr, *args)\n    return 'ok' if r >= 0 else os.strerror(ctypes.get_errno())\n";

#[test]
fn host_files_outside_the_template_are_invisible() {
    let env = Env::new("esc-files");
    let secret = std::env::temp_dir().join(format!("hutch-secret-{}", std::process::id()));
    std::fs::write(&secret, "host secret").expect("write");
    let script = format!(
        "import os\nfor p in ['{}', '/root/.bashrc', '/var/lib/hutch', '{}', '/etc/machine-id', '/work', '/home/user/../../proc/1/root/etc/hostname']:\n    print(p, os.path.exists(p))\nprint('shadow-hash', '$' in open('/etc/shadow').read())",
        secret.display(),
        env.state.display()
    );
    let text = probe(&env, &script);
    std::fs::remove_file(&secret).expect("cleanup");
    for line in text.lines().filter(|l| !l.starts_with("/home/user")) {
        assert!(line.ends_with("False"), "visible inside the sandbox: {line}");
    }
    // /proc/1 is the agent; its root is the sandbox's root, not the host's.
    assert!(text.contains("shadow-hash False"), "{text}");
}

#[test]
fn host_processes_cannot_be_seen_or_signalled() {
    let env = Env::new("esc-procs");
    let mut victim = Command::new("sleep").arg("9321").spawn().expect("spawn victim");
    let pid = victim.id();
    let script = format!(
        "import os, signal\nprint('visible', os.path.exists('/proc/{pid}'))\ntry:\n    os.kill({pid}, signal.SIGKILL); print('signal ok')\nexcept OSError as e: print('signal', e.errno)\nprint('count', len([p for p in os.listdir('/proc') if p.isdigit()]))"
    );
    let text = probe(&env, &script);
    let alive = victim.try_wait().expect("try_wait").is_none();
    victim.kill().expect("kill victim");
    victim.wait().expect("reap victim");
    assert!(alive, "the sandbox killed a host process");
    assert!(text.contains("visible False"), "{text}");
    assert!(text.contains("signal 3"), "ESRCH expected: {text}");
    // The agent, its per-command supervisor, python: a handful at most.
    let count: usize = text.lines().find_map(|l| l.strip_prefix("count ")).and_then(|n| n.parse().ok()).expect("count");
    assert!(count <= 5, "sandbox sees {count} processes");
}

#[test]
fn the_hosts_root_and_usr_cannot_be_written() {
    let env = Env::new("esc-write");
    let name = format!("hutch-probe-{}", std::process::id());
    let script = format!(
        "import os\nfor p in ['/usr/{name}', '/{name}', '/etc/{name}']:\n    try:\n        open(p, 'w').write('x'); print(p, 'written')\n    except OSError as e: print(p, e.errno)"
    );
    let text = probe(&env, &script);
    assert!(text.contains(&format!("/usr/{name} 30")), "EROFS expected on /usr: {text}");
    // Writes to / and /etc land in the sandbox's own layer, never the host's.
    for host in [format!("/{name}"), format!("/etc/{name}"), format!("/usr/{name}")] {
        assert!(!std::path::Path::new(&host).exists(), "{host} appeared on the host");
    }
}

#[test]
fn mounting_is_refused_even_to_root() {
    let env = Env::new("esc-mount");
    let script = format!(
        "{SYSCALL}print('mount', call(165, b'none', b'/mnt', b'tmpfs', 0, None))\nprint('umount', call(166, b'/proc', 2))\nprint('fsopen', call(430, b'tmpfs', 0))\nprint('open_tree', call(428, -100, b'/usr', 1))"
    );
    let text = probe(&env, &script);
    for op in ["mount", "umount", "fsopen", "open_tree"] {
        assert!(text.contains(&format!("{op} Operation not permitted")), "{op} not refused: {text}");
    }
    // The shell tool too.
    let out = env.run(&["--user", "root"], &["mount", "-t", "tmpfs", "none", "/mnt"]);
    assert!(!out.status.success());
}

#[test]
fn module_loading_bpf_keyring_and_clock_are_refused() {
    let env = Env::new("esc-kernel");
    let script = format!(
        "{SYSCALL}print('finit_module', call(313, -1, b'', 0))\nprint('init_module', call(175, None, 0, b''))\nprint('bpf', call(321, 0, None, 0))\nprint('keyctl', call(250, 0, 0))\nprint('add_key', call(248, b'user', b'x', b'y', 1, -2))\nprint('settimeofday', call(164, None, None))\nprint('kexec_load', call(246, 0, 0, None, 0))\nprint('perf_event_open', call(298, None, 0, -1, -1, 0))\nprint('userfaultfd', call(323, 0))\nprint('open_by_handle_at', call(304, -100, None, 0))\nprint('swapon', call(167, b'/x', 0))\nprint('reboot', call(169, 0, 0, 0, None))"
    );
    let text = probe(&env, &script);
    for line in text.lines() {
        assert!(line.ends_with("Operation not permitted"), "not refused: {line}\n{text}");
    }
    assert_eq!(text.lines().count(), 12, "{text}");
}

#[test]
fn new_user_namespaces_are_refused_but_threads_and_forks_work() {
    let env = Env::new("esc-userns");
    let script = format!(
        "{SYSCALL}print('unshare-user', call(272, 0x10000000))\nprint('unshare-net', call(272, 0x40000000))\nprint('clone-user', call(56, 0x10000000 | 17, 0, 0, 0, 0))\nprint('clone3', call(435, None, 0))\nimport threading, subprocess\nt = threading.Thread(target=lambda: None); t.start(); t.join(); print('thread ok')\nprint(subprocess.run(['true']).returncode)"
    );
    let text = probe(&env, &script);
    assert!(text.contains("unshare-user Operation not permitted"), "{text}");
    assert!(text.contains("unshare-net Operation not permitted"), "{text}");
    assert!(text.contains("clone-user Operation not permitted"), "{text}");
    assert!(text.contains("clone3 Function not implemented"), "{text}");
    assert!(text.contains("thread ok\n0\n"), "{text}");
    let out = env.run(&["--user", "root"], &["unshare", "-U", "true"]);
    assert!(!out.status.success(), "unshare -U succeeded");
}

#[test]
fn pid_one_cannot_be_traced_read_or_killed() {
    let env = Env::new("esc-pid1");
    let script = format!(
        "{SYSCALL}import signal\nprint('ptrace', call(101, 16, 1, 0, 0))\nprint('seize', call(101, 0x4206, 1, 0, 0))\ntry:\n    open('/proc/1/environ').read(); print('environ readable')\nexcept OSError as e: print('environ', e.errno)\nfor s in [signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP, signal.SIGINT]:\n    os.kill(1, s)\nimport time; time.sleep(0.2)\nprint('agent state', open('/proc/1/stat').read().rsplit(')', 1)[1].split()[0])\nprint('agent', [l for l in open('/proc/1/status') if l.startswith('Seccomp:')][0].strip())"
    );
    let text = probe(&env, &script);
    assert!(text.contains("ptrace Operation not permitted"), "{text}");
    assert!(text.contains("seize Operation not permitted"), "{text}");
    assert!(text.contains("environ 13"), "EACCES expected: {text}");
    // The agent ignores signals from inside its namespace and keeps serving:
    // the probe's output arrived through it after the signals.
    assert!(text.contains("agent state S"), "{text}");
    // The agent runs under the same seccomp filter as the workload.
    assert!(text.contains("agent Seccomp:\t2"), "{text}");
}

#[test]
fn only_loopback_exists_and_nothing_else_is_reachable() {
    let env = Env::new("esc-net");
    // A service on the host's loopback must not be reachable from inside.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let script = format!(
        "import socket, os\nprint('ifaces', sorted(os.listdir('/sys/class/net')))\nfor host in ['127.0.0.1', '1.1.1.1', '10.0.0.1', '169.254.169.254']:\n    s = socket.socket(); s.settimeout(1)\n    try:\n        s.connect((host, {port})); print(host, 'connected')\n    except OSError as e: print(host, 'refused', e.errno)\ntry:\n    socket.getaddrinfo('example.com', 80); print('dns ok')\nexcept OSError: print('dns failed')\nsrv = socket.socket(); srv.bind(('127.0.0.1', 80)); srv.listen(); c = socket.create_connection(('127.0.0.1', 80)); print('own loopback ok')"
    );
    let text = probe(&env, &script);
    assert!(text.contains("ifaces ['lo']"), "{text}");
    for host in ["127.0.0.1", "1.1.1.1", "10.0.0.1", "169.254.169.254"] {
        assert!(text.contains(&format!("{host} refused")), "{host} reachable: {text}");
    }
    assert!(text.contains("dns failed"), "{text}");
    assert!(text.contains("own loopback ok"), "binding a low port on its own loopback must work: {text}");
    drop(listener);
}

#[test]
fn what_the_profile_allows_still_works() {
    let env = Env::new("allowed");
    // Ordinary tools: a shell pipeline, python, a package-manager-like chown
    // as root, a pty-less terminal check, DNS-free networking on loopback.
    let out = env.run(
        &["--user", "root"],
        &["bash", "-c", "set -e; echo hi | sha256sum >/dev/null; mkdir -p /opt/x; chown 1000:1000 /opt/x; su -s /bin/sh user -c 'touch /opt/x/f' 2>/dev/null || true; python3 -c 'import ssl, sqlite3; print(1)'; stat -c %U /opt/x; ls -l /etc/passwd | awk '{print $3}'"],
    );
    assert_eq!(stdout(&out), "1\nuser\nroot\n", "{}", stderr(&out));
}
