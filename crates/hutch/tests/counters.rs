//! Host-wide kernel counters are shared per user: a sandbox must draw only
//! on a share of its own. Sandbox A takes all it can of every per-user
//! counter it can reach (inotify instances, fanotify groups, POSIX message
//! queue bytes, queued signals, locked shared memory, pseudo-terminals);
//! while it holds them, sandbox B and the host still get theirs, and A
//! cannot raise its own caps.

mod common;

use common::*;
use hutch_agent::proto::{Cmd, FromAgent, Reply, Request, Spawn, Stream};
use hutch_runtime::agent::AgentConn;
use hutch_runtime::container::KERNEL_CAPS;
use hutch_runtime::SandboxSpec;
use std::collections::BTreeMap;
use std::time::Duration;

fn python(script: &str, user: &str) -> Request {
    Request::Spawn(Spawn {
        cmd: Cmd::Argv(vec!["python3".into(), "-c".into(), script.into()]),
        env: vec![],
        cwd: None,
        user: Some(user.into()),
        stdin: false,
        pty: None,
        tag: None,
        timeout_ms: Some(120_000),
        subscribe: true,
        output_limit: None,
    })
}

/// Starts `script` and returns its stdout once a line equal to `until`
/// arrived (the script keeps running), or once it exited.
fn run_until(conn: &mut AgentConn, script: &str, user: &str, until: Option<&str>) -> String {
    let (reply, _) = conn.call(python(script, user), &[]).expect("spawn");
    let Reply::Spawned { pid } = reply else { panic!("unexpected {reply:?}") };
    let mut out = Vec::new();
    loop {
        let (msg, data) = conn.recv(Some(Duration::from_secs(120))).expect("recv");
        match msg {
            FromAgent::Output { pid: p, stream: Stream::Stdout } if p == pid => {
                out.extend(data);
                let text = String::from_utf8_lossy(&out);
                if until.is_some_and(|u| text.lines().any(|l| l == u)) {
                    return text.into_owned();
                }
            }
            FromAgent::Output { pid: p, stream: Stream::Stderr } if p == pid => {
                eprint!("{}", String::from_utf8_lossy(&data));
            }
            FromAgent::Exit { pid: p, status } if p == pid => {
                let text = String::from_utf8_lossy(&out).into_owned();
                assert!(until.is_none(), "the probe exited ({status:?}) before {until:?}: {text}");
                return text;
            }
            _ => {}
        }
    }
}

/// Python that defines `take(name, make)`: calls `make` until it fails and
/// prints `name count error`; `one(name, make)` prints `name ok` or
/// `name error`. Each `make` returns a negative number on failure, with
/// errno set.
const KIT: &str = r#"
import ctypes, os, resource, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
def err():
    return os.strerror(ctypes.get_errno())
def take(name, make, limit=200000):
    n = 0
    while n < limit:
        if make() < 0:
            print(name, n, err(), flush=True)
            return
        n += 1
    print(name, n, 'no-limit', flush=True)
def one(name, make):
    print(name, 'ok' if make() >= 0 else err(), flush=True)

def inotify():
    return libc.inotify_init1(0)
def fanotify():
    # FAN_CLASS_NOTIF | FAN_REPORT_FID: what an unprivileged caller may ask.
    return libc.fanotify_init(0x200, os.O_RDONLY)
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
queues = [0]
def mqueue():
    queues[0] += 1
    fd = libc.mq_open(b'/hutch-%d-%d' % (os.getpid(), queues[0]), os.O_CREAT | os.O_RDWR, 0o600, None)
    if fd >= 0:
        libc.mq_unlink(b'/hutch-%d-%d' % (os.getpid(), queues[0]))
    return fd
def pty():
    try:
        return os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY)
    except OSError as e:
        ctypes.set_errno(e.errno)
        return -1
class sigval(ctypes.Union):
    _fields_ = [('i', ctypes.c_int), ('p', ctypes.c_void_p)]
libc.sigqueue.argtypes = [ctypes.c_int, ctypes.c_int, sigval]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
def sigpending():
    return libc.sigqueue(os.getpid(), signal.SIGRTMIN, sigval(0))
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
def shmlock():
    # 1 MiB of SysV shared memory, locked (SHM_LOCK); it lives as long as
    # the sandbox's IPC namespace.
    i = libc.shmget(0, 1 << 20, 0o1000 | 0o600)
    if i < 0:
        return -1
    if libc.shmctl(i, 11, None) < 0:
        e = ctypes.get_errno()
        libc.shmctl(i, 0, None)
        ctypes.set_errno(e)
        return -1
    return i
"#;

/// `name -> rest of its line` of a probe's output.
fn lines(text: &str) -> BTreeMap<String, String> {
    text.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

/// The count and error of a `take` line.
fn taken(found: &BTreeMap<String, String>, name: &str) -> (u64, String) {
    let line = found.get(name).unwrap_or_else(|| panic!("no {name} line in {found:?}"));
    let (n, why) = line.split_once(' ').expect("count and error");
    (n.parse().expect("count"), why.to_owned())
}

fn host_sysctl(name: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/sys/user/{name}")).expect("sysctl").trim().parse().expect("number")
}

#[test]
fn one_sandbox_exhausts_only_its_own_share_of_per_user_kernel_counters() {
    let env = Env::new("counters");
    let rt = runtime(&env);
    let a = Guard(Some(rt.start(&SandboxSpec::default()).expect("start A")));
    let b = Guard(Some(rt.start(&SandboxSpec::default()).expect("start B")));
    let mut conn_a = a.connect().expect("connect A");

    // A, as its root, takes all it can of everything and holds on.
    let exhaust = format!(
        "{KIT}\nfor name, make in [('inotify', inotify), ('fanotify', fanotify), ('mqueue', mqueue), ('pty', pty), ('sigpending', sigpending), ('shmlock', shmlock)]:\n    take(name, make)\nprint('holding', flush=True)\ntime.sleep(600)\n"
    );
    let text = run_until(&mut conn_a, &exhaust, "root", Some("holding"));
    let found = lines(&text);

    let (n, why) = taken(&found, "inotify");
    assert!(n > 0 && n <= host_sysctl("max_inotify_instances"), "A took {n} inotify instances: {text}");
    assert_eq!(why, "Too many open files", "{text}");
    let (n, why) = taken(&found, "fanotify");
    assert!(n > 0 && n <= host_sysctl("max_fanotify_groups"), "A took {n} fanotify groups: {text}");
    assert_eq!(why, "Too many open files", "{text}");
    // A queue of the default size costs about 82 KiB.
    let (n, why) = taken(&found, "mqueue");
    assert!(n > 0 && n * 80 * 1024 <= KERNEL_CAPS.mqueue_bytes, "A made {n} message queues: {text}");
    assert_eq!(why, "Too many open files", "{text}");
    let (n, why) = taken(&found, "pty");
    assert_eq!(n, u64::from(KERNEL_CAPS.ptys), "{text}");
    assert_eq!(why, "No space left on device", "{text}");
    let (n, why) = taken(&found, "sigpending");
    assert!(n > 0 && n <= KERNEL_CAPS.pending_signals, "A queued {n} signals: {text}");
    assert_eq!(why, "Resource temporarily unavailable", "{text}");
    let (n, why) = taken(&found, "shmlock");
    assert!(n > 0 && n <= KERNEL_CAPS.locked_bytes >> 20, "A locked {n} MiB: {text}");
    assert_eq!(why, "Cannot allocate memory", "{text}");

    // B gets one of each, as root and as user.
    let one_each = format!(
        "{KIT}\nfor name, make in [('inotify', inotify), ('fanotify', fanotify), ('mqueue', mqueue), ('pty', pty), ('sigpending', sigpending), ('shmlock', shmlock)]:\n    one(name, make)\n"
    );
    let mut conn_b = b.connect().expect("connect B");
    for user in ["root", "user"] {
        let text = run_until(&mut conn_b, &one_each, user, None);
        let found = lines(&text);
        for name in ["inotify", "fanotify", "mqueue", "pty", "sigpending", "shmlock"] {
            assert_eq!(found.get(name).map(String::as_str), Some("ok"), "B ({user}) was refused {name}: {text}");
        }
    }

    // So does the host (as root: the user that sandboxes used to be
    // charged to). Locked memory and terminals are left out: host root may
    // lock without limit, and the host's terminals come from a reserve.
    let host = std::process::Command::new("python3")
        .arg("-c")
        .arg(format!(
            "{KIT}\nfor name, make in [('inotify', inotify), ('fanotify', fanotify), ('mqueue', mqueue), ('sigpending', sigpending)]:\n    one(name, make)\n"
        ))
        .output()
        .expect("host probe");
    let text = stdout(&host);
    let found = lines(&text);
    for name in ["inotify", "fanotify", "mqueue", "sigpending"] {
        assert_eq!(found.get(name).map(String::as_str), Some("ok"), "the host was refused {name}: {text}");
    }

    // A cannot raise its caps: its /proc/sys is read-only, its root lacks
    // CAP_SYS_RESOURCE, hard limits only go down, and it still gets no more.
    let mut conn_a2 = a.connect().expect("connect A again");
    let raise = format!(
        "{KIT}\ntry:\n    open('/proc/sys/user/max_inotify_instances', 'w').write('100000'); print('sysctl written')\nexcept OSError as e: print('sysctl', e.errno)\nprint('userns', open('/proc/sys/user/max_user_namespaces').read().strip())\nfor r in [resource.RLIMIT_MSGQUEUE, resource.RLIMIT_SIGPENDING, resource.RLIMIT_MEMLOCK]:\n    s, h = resource.getrlimit(r)\n    try:\n        resource.setrlimit(r, (h * 2, h * 2)); print('rlimit', r, 'raised')\n    except (ValueError, OSError): print('rlimit', r, 'refused')\none('inotify', inotify)\none('mqueue', mqueue)\none('sigpending', sigpending)\n"
    );
    let text = run_until(&mut conn_a2, &raise, "root", None);
    assert!(text.contains("sysctl 30\n"), "EROFS expected: {text}");
    assert!(text.contains("userns 0\n"), "no user namespace may be made inside: {text}");
    assert_eq!(text.matches(" refused\n").count(), 3, "{text}");
    assert!(text.contains("inotify Too many open files\n"), "{text}");
    assert!(text.contains("mqueue Too many open files\n"), "{text}");
    assert!(text.contains("sigpending Resource temporarily unavailable\n"), "{text}");
}
