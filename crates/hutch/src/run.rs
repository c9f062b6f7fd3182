//! `hutch run`: one command in a fresh sandbox, no daemon. Starts a
//! `container` sandbox, asks its agent to run the command, passes stdin,
//! stdout and stderr through, says which limit ended the command if one did,
//! tears everything down, and exits with the command's code.
//!
//! This is the same path the daemon's one-shot executions take: runtime
//! start, agent spawn, stream, destroy.

use crate::units::{parse_duration, parse_size, show_size};
use clap::Args;
use hutch_agent::proto::{Cmd, ExitStatus, FromAgent, Reply, Request, Spawn, Stream};
use hutch_runtime::agent::{AgentConn, AgentError};
use hutch_runtime::cgroup::Limits;
use hutch_runtime::{Config, Runtime, Sandbox, SandboxSpec};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::time::Duration;

/// Exit code when hutch itself fails (the command did not run).
const EXIT_HUTCH: i32 = 125;
/// Exit code when the timeout ended the command (as timeout(1)).
const EXIT_TIMEOUT: i32 = 124;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Memory limit (hard): 512M, 1G, ...
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    memory: u64,
    /// Size of the sandbox's writable layer (held in memory: it counts
    /// toward --memory too).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    disk: u64,
    /// Most processes and threads alive at once.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pids: u32,
    /// CPUs worth of time per period (fractions allowed).
    #[arg(long, default_value_t = 1.0)]
    vcpus: f64,
    /// Kill the command's whole process tree after this long: 30s, 5m, ...
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    env: Vec<String>,
    /// User to run as: `user` (uid 1000) or `root`.
    #[arg(long, default_value = "user")]
    user: String,
    /// Working directory inside the sandbox.
    #[arg(long, short = 'w')]
    workdir: Option<String>,
    /// Root file system: `base` (the host's /usr) or an image of the store
    /// (`hutch image list`); a preset is built first if missing.
    #[arg(long, default_value = "base")]
    image: String,
    /// Name of the sandbox (its cgroup and socket are named after it).
    #[arg(long, value_parser = parse_name)]
    name: Option<String>,
    /// Isolation class: `container` or `gvisor` (runsc, a user-space
    /// kernel in front of the host's).
    #[arg(long, default_value = "container", value_parser = parse_class)]
    class: hutch_api::Class,
    /// Print sandbox start and teardown timings to stderr.
    #[arg(long, hide = true)]
    timings: bool,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

fn parse_class(s: &str) -> Result<hutch_api::Class, String> {
    hutch_api::Class::parse(s).ok_or_else(|| format!("unknown class {s:?}: container, gvisor, process or microvm"))
}

/// The layers and environment of image `name` (a preset is built if missing).
fn image_root(
    state_dir: &std::path::Path,
    name: &str,
) -> Result<(hutch_runtime::RootSource, Vec<(String, String)>), String> {
    use hutch_runtime::image::{debian, ImageStore};
    let show = |e: hutch_runtime::image::ImageError| format!("{e} [{}]", e.code());
    let store = ImageStore::open(state_dir).map_err(show)?;
    let img = if debian::is_preset(name) {
        debian::ensure_preset(&store, name, &|line| eprintln!("hutch: image {name}: {line}")).map_err(show)?
    } else {
        store.get(name).map_err(show)?
    };
    Ok((hutch_runtime::RootSource::Layers(store.layer_dirs(&img).map_err(show)?), img.env_pairs()))
}

fn parse_name(s: &str) -> Result<String, String> {
    hutch_runtime::container::valid_id(s).map_err(|e| e.to_string())
}

pub fn main(args: RunArgs) -> i32 {
    match run(&args) {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("hutch: {msg}");
            EXIT_HUTCH
        }
    }
}

fn run(args: &RunArgs) -> Result<i32, String> {
    if !(args.vcpus > 0.0 && args.vcpus <= 1024.0) {
        return Err(format!("--vcpus {} out of range (0, 1024]", args.vcpus));
    }
    let mut env = Vec::new();
    for kv in &args.env {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => env.push((k.to_owned(), v.to_owned())),
            _ => return Err(format!("--env {kv:?}: expected KEY=VALUE")),
        }
    }
    let t0 = std::time::Instant::now();
    let runtime = Runtime::new(Config::from_env()).map_err(|e| e.to_string())?;
    let t_new = t0.elapsed();
    let limits = Limits {
        memory_bytes: args.memory,
        pids: args.pids,
        cpu_millis: (args.vcpus * 1000.0).round().max(1.0) as u32,
    };
    let mut root = hutch_runtime::RootSource::Base;
    if args.image != hutch_runtime::image::BASE {
        let (image, image_env) = image_root(&runtime.config().state_dir, &args.image)?;
        root = image;
        // The image's environment, under the command line's.
        let mut all: Vec<(String, String)> =
            image_env.into_iter().filter(|(k, _)| !env.iter().any(|(e, _)| e == k)).collect();
        all.append(&mut env);
        env = all;
    }
    let spec = SandboxSpec {
        root,
        id: args.name.clone(),
        limits,
        disk_bytes: args.disk,
        die_with_parent: true,
        class: args.class,
        ..SandboxSpec::default()
    };
    let mut sandbox = runtime.start(&spec).map_err(|e| e.to_string())?;
    let started = t0.elapsed();
    let t_d = std::time::Instant::now();
    let result = drive(&sandbox, args, env);
    let t_drive = t_d.elapsed();
    let status = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = sandbox.destroy();
            return Err(e);
        }
    };
    let verdict = verdict(&sandbox, args, &status);
    let timings = std::mem::take(&mut sandbox.timings);
    let t1 = std::time::Instant::now();
    let destroyed = sandbox.destroy();
    runtime.sweep_own();
    if args.timings {
        let phases: Vec<String> = timings.iter().map(|(p, d)| format!("{p} {d:?}")).collect();
        eprintln!(
            "hutch: runtime {t_new:?}, start {:?} ({}), command {t_drive:?}, teardown {:?}",
            started - t_new,
            phases.join(", "),
            t1.elapsed()
        );
    }
    destroyed.map_err(|e| format!("teardown: {e}"))?;
    if let Some(msg) = verdict.message {
        eprintln!("hutch: {msg}");
    }
    Ok(verdict.code)
}

/// Runs the command in the sandbox and streams it until it exits.
fn drive(sandbox: &Sandbox, args: &RunArgs, env: Vec<(String, String)>) -> Result<ExitStatus, String> {
    let mut conn = sandbox.connect().map_err(|e| format!("connect to the sandbox agent: {e}"))?;
    let stdin_open = !stdin_is_null();
    let spawn = Spawn {
        cmd: Cmd::Argv(args.command.clone()),
        env,
        cwd: args.workdir.clone(),
        user: Some(args.user.clone()),
        stdin: stdin_open,
        pty: None,
        tag: None,
        timeout_ms: args.timeout.map(|t| t.as_millis().min(u64::MAX as u128) as u64),
        subscribe: true,
        output_limit: None,
    };
    let spawn_id = conn.send(Request::Spawn(spawn), &[]).map_err(|e| e.to_string())?;
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    loop {
        let (msg, data) = conn.recv(None).map_err(describe)?;
        match msg {
            FromAgent::Reply { id, reply } if id == spawn_id => match reply {
                Reply::Spawned { pid } => {
                    if stdin_open {
                        forward_stdin(&conn, pid)?;
                    }
                    forward_signals(&conn, pid)?;
                }
                Reply::Error { message, .. } => return Err(message),
                other => return Err(format!("agent answered {other:?} to spawn")),
            },
            FromAgent::Reply { .. } => {}
            FromAgent::Output { stream: Stream::Stdout, .. } => {
                // A closed stdout on our side must not stop the command.
                let _ = stdout.write_all(&data).and_then(|_| stdout.flush());
            }
            FromAgent::Output { stream: Stream::Stderr, .. } => {
                let _ = stderr.write_all(&data);
            }
            FromAgent::Exit { status, .. } => return Ok(status),
            FromAgent::Dropped { .. } | FromAgent::Watch { .. } => {}
        }
    }
}

fn describe(e: AgentError) -> String {
    match e {
        AgentError::Closed => "the sandbox's agent went away".into(),
        other => other.to_string(),
    }
}

/// Copies our stdin to the command's in a thread; EOF closes the command's.
fn forward_stdin(conn: &AgentConn, pid: u32) -> Result<(), String> {
    let mut sender = conn.sender().map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            let mut input = std::io::stdin().lock();
            loop {
                match input.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if sender.send(Request::Stdin { pid }, &buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = sender.send(Request::CloseStdin { pid }, &[]);
        })
        .map_err(|e| format!("start stdin thread: {e}"))?;
    Ok(())
}

/// Passes SIGINT, SIGTERM, SIGHUP and SIGQUIT on to the command, as
/// `docker run` does, instead of dying and leaving it to the parent-death
/// signal.
fn forward_signals(conn: &AgentConn, pid: u32) -> Result<(), String> {
    let mut sender = conn.sender().map_err(|e| e.to_string())?;
    let signals = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];
    let blocked = hutch_runtime::sys::BlockedSignals::block(&signals).map_err(|e| format!("block signals: {e}"))?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let Ok(sig) = blocked.wait() else { return };
            if sender.send(Request::Signal { pid, signal: sig }, &[]).is_err() {
                return;
            }
        })
        .map_err(|e| format!("start signal thread: {e}"))?;
    Ok(())
}

/// True when stdin is /dev/null (or closed): the command then gets no pipe.
fn stdin_is_null() -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(fd) = std::io::stdin().as_fd().try_clone_to_owned() else { return true };
    match std::fs::File::from(fd).metadata() {
        Ok(m) => m.file_type().is_char_device() && m.rdev() == libc::makedev(1, 3),
        Err(_) => true,
    }
}

struct Verdict {
    code: i32,
    message: Option<String>,
}

/// Says which limit, if any, ended the command.
fn verdict(sandbox: &Sandbox, args: &RunArgs, status: &ExitStatus) -> Verdict {
    if status.timed_out {
        let t = args.timeout.map(|t| format!("{t:?}")).unwrap_or_default();
        return Verdict { code: EXIT_TIMEOUT, message: Some(format!("command killed: timeout {t} reached")) };
    }
    let code = status.shell_code();
    if status.oom_killed {
        return Verdict {
            code,
            message: Some(format!(
                "command killed by the OOM killer: memory limit {} exceeded (files in /tmp and the writable layer count)",
                show_size(args.memory)
            )),
        };
    }
    if sandbox.cgroup.pids_limit_hits() > 0 {
        return Verdict { code, message: Some(format!("pids limit {} reached: forks failed", args.pids)) };
    }
    Verdict { code, message: None }
}
