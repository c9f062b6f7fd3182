//! `hutch exec`: run a command in a sandbox. By default the output streams
//! (NDJSON events copied to the local stdout and stderr as they arrive) and
//! hutch exits with the command's code; `--json` prints the whole result,
//! `--background` the pid; `-i` also forwards this process's stdin to the
//! command until it ends; `-it` is an interactive terminal (see `tty`).

use super::{parse_pairs, parse_seconds, ClientOpts};
use clap::Args;
use hutch_api::ExecRequest;
use std::io::{self, Write};

/// Exit code when hutch itself fails (the command did not run, or its
/// outcome is unknown), as docker and timeout(1) use it.
pub const EXIT_HUTCH: i32 = 125;
/// Exit code when the timeout ended the command, as timeout(1).
pub const EXIT_TIMEOUT: i32 = 124;
/// Exit code when our stdout was closed under us (128 + SIGPIPE).
const EXIT_PIPE: i32 = 141;

#[derive(Args, Debug)]
pub struct ExecArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    /// User to run as: `user` (the default) or `root`.
    #[arg(long)]
    user: Option<String>,
    /// Working directory (/workspace when absent).
    #[arg(long, short = 'w', value_name = "DIR")]
    cwd: Option<String>,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    env: Vec<String>,
    /// Kill the command's process tree after this long: 30s, 5m, ...
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    timeout: Option<u64>,
    /// Start the command and print its pid; do not wait.
    #[arg(long, conflicts_with = "json")]
    background: bool,
    /// Forward stdin to the command (bytes as they come, closed at EOF).
    /// Interrupting hutch leaves the command to its timeout: signal it
    /// with the API, as with --background.
    #[arg(long, short = 'i', conflicts_with_all = ["background", "json"])]
    interactive: bool,
    /// Run on a terminal (with -i: an interactive one, resized with the
    /// local window; the command defaults to the user's login shell).
    /// Needs a terminal on stdin.
    #[arg(long, short = 't', conflicts_with_all = ["background", "json", "timeout"])]
    tty: bool,
    /// Wait for the command and print its result as JSON (an ExecResult);
    /// the exit code is still the command's.
    #[arg(long)]
    json: bool,
    /// The sandbox.
    id: String,
    /// The command: one argument with spaces or shell syntax runs through
    /// the shell; several run as a program and its arguments.
    #[arg(required_unless_present = "tty", trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    command: Vec<String>,
}

pub fn main(args: ExecArgs) -> i32 {
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hutch: {e:#}");
            EXIT_HUTCH
        }
    }
}

fn run(args: &ExecArgs) -> anyhow::Result<i32> {
    if args.tty {
        return terminal(args);
    }
    let req = request(args)?;
    let client = args.conn.client()?;
    let key = super::uuid_v4()?;
    if args.background {
        let started = client.exec_background(&args.id, &req, &key)?;
        println!("{}", started.pid);
        return Ok(0);
    }
    if args.json {
        let res = client.exec(&args.id, &req, &key)?;
        print!("{}", super::output::json(&res)?);
        return Ok(if res.timed_out { EXIT_TIMEOUT } else { exit_code(res.exit_code) });
    }
    let body = if args.interactive {
        // Started with stdin open and its output kept, then attached (the
        // attach replays what came before it), then fed: a command that
        // ends as soon as it has read its input must not end before the
        // attach, which would find no process.
        let req = ExecRequest { background: Some(true), keep_output: Some(true), ..req };
        let pid = client.exec_background(&args.id, &req, &key)?.pid;
        let body = client.process_stream(&args.id, pid)?;
        let (c, id) = (client.clone(), args.id.clone());
        std::thread::spawn(move || forward_stdin(&c, &id, pid, io::stdin().lock()));
        body
    } else {
        client.exec_stream(&args.id, &req, &key)?
    };
    let stdout = io::stdout();
    let stderr = io::stderr();
    let mut stream = Stream::new(stdout.lock(), stderr.lock());
    for line in body.lines() {
        let line = line.map_err(|e| anyhow::anyhow!("reading the output stream from {}: {e}", client.base_url()))?;
        if let Some(code) = stream.line(&line)? {
            return Ok(code);
        }
    }
    stream.finish()
}

/// `-t`: the command (the login shell without one) on a terminal.
fn terminal(args: &ExecArgs) -> anyhow::Result<i32> {
    if !super::tty::stdin_is_tty() {
        anyhow::bail!("the input device is not a terminal: -t needs one (use -i alone to pipe input)");
    }
    let command = match split_command(&args.command) {
        _ if args.command.is_empty() => None,
        Ok((Some(line), _)) => Some(line),
        Ok((None, Some(words))) => Some(super::tty::shell_line(&words)),
        Ok((None, None)) => None,
        Err(e) => return Err(e),
    };
    let client = args.conn.client()?;
    let req = super::tty::TtyRequest {
        id: &args.id,
        command,
        user: args.user.as_deref(),
        cwd: args.cwd.as_deref(),
        env: parse_pairs("--env", &args.env)?.into_iter().collect(),
    };
    super::tty::run(client.base_url(), client.api_key(), &req)
}

/// Copies `input` to the command's stdin in chunks of at most 64 KiB,
/// then closes it. Stops quietly when the command is gone: its exit comes
/// through the output stream.
fn forward_stdin(client: &super::client::Client, id: &str, pid: u32, mut input: impl io::Read) {
    use base64::Engine as _;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match input.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => 0,
        };
        let req = hutch_api::StdinRequest {
            data: String::new(),
            data_base64: (n > 0).then(|| base64::engine::general_purpose::STANDARD.encode(&buf[..n])),
            eof: n == 0,
        };
        if client.stdin(id, pid, &req).is_err() || n == 0 {
            return;
        }
    }
}

/// The API request of the flags and the command.
fn request(args: &ExecArgs) -> anyhow::Result<ExecRequest> {
    let (command, argv) = split_command(&args.command)?;
    Ok(ExecRequest {
        command,
        argv,
        env: parse_pairs("--env", &args.env)?,
        cwd: args.cwd.clone(),
        user: args.user.clone(),
        timeout_seconds: args.timeout,
        ..ExecRequest::default()
    })
}

/// One argument with whitespace or shell syntax is a shell command line;
/// anything else is an argv.
fn split_command(words: &[String]) -> anyhow::Result<(Option<String>, Option<Vec<String>>)> {
    match words {
        [] => anyhow::bail!("no command given"),
        [one] if one.trim().is_empty() => anyhow::bail!("the command is empty"),
        [one] if one.chars().any(|c| c.is_whitespace() || "|&;<>()$`\\\"'*?[]{}~".contains(c)) => {
            Ok((Some(one.clone()), None))
        }
        _ => Ok((None, Some(words.to_vec()))),
    }
}

/// A process exit status as a shell exit code: signals as 128 + n.
pub(crate) fn exit_code(code: i32) -> i32 {
    match code {
        0..=255 => code,
        c if c < 0 => 128 + c.saturating_neg().min(127),
        _ => 255,
    }
}

/// Copies an NDJSON command stream to two writers and works out the exit
/// code. Fed one line at a time, so it is testable without a daemon.
pub struct Stream<O: Write, E: Write> {
    out: O,
    err: E,
    pid: Option<u32>,
}

/// One event of the stream, read leniently: unknown event types and error
/// codes are accepted, as the API asks of clients.
#[derive(Debug, PartialEq)]
enum Event {
    Start { pid: u32 },
    Stdout(String),
    Stderr(String),
    Ping,
    Exit { exit_code: i32, timed_out: bool, oom_killed: bool },
    Error { error: String, code: String },
    Unknown,
}

fn decode(line: &str) -> anyhow::Result<Event> {
    use hutch_api::ExecEvent;
    if let Ok(ev) = serde_json::from_str::<ExecEvent>(line) {
        return Ok(match ev {
            ExecEvent::Start { pid } => Event::Start { pid },
            ExecEvent::Stdout { data } => Event::Stdout(data),
            ExecEvent::Stderr { data } => Event::Stderr(data),
            ExecEvent::Ping => Event::Ping,
            ExecEvent::Exit { exit_code, timed_out, oom_killed, .. } => {
                Event::Exit { exit_code, timed_out, oom_killed }
            }
            ExecEvent::Error { code, error } => Event::Error { error, code: code.as_str().to_owned() },
        });
    }
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| anyhow::anyhow!("malformed event in the output stream: {e}"))?;
    let text = |k: &str| v.get(k).and_then(serde_json::Value::as_str).map(str::to_owned);
    match v.get("type").and_then(serde_json::Value::as_str) {
        Some("error") => Ok(Event::Error {
            error: text("error").unwrap_or_else(|| "the command failed".to_owned()),
            code: text("code").unwrap_or_else(|| "unknown".to_owned()),
        }),
        Some("start" | "stdout" | "stderr" | "exit") => anyhow::bail!("malformed event in the output stream: {line}"),
        _ => Ok(Event::Unknown),
    }
}

impl<O: Write, E: Write> Stream<O, E> {
    pub fn new(out: O, err: E) -> Self {
        Stream { out, err, pid: None }
    }

    /// Handles one line; `Some(code)` when the stream is over and hutch
    /// should exit with `code`.
    pub fn line(&mut self, line: &str) -> anyhow::Result<Option<i32>> {
        if line.trim().is_empty() {
            return Ok(None);
        }
        match decode(line)? {
            Event::Start { pid } => self.pid = Some(pid),
            Event::Stdout(data) => {
                if let Err(e) = self.out.write_all(data.as_bytes()).and_then(|()| self.out.flush()) {
                    if e.kind() == io::ErrorKind::BrokenPipe {
                        return Ok(Some(EXIT_PIPE));
                    }
                    anyhow::bail!("writing to stdout: {e}");
                }
            }
            Event::Stderr(data) => {
                // Nowhere left to report a failing stderr; the stream goes on.
                let _ = self.err.write_all(data.as_bytes()).and_then(|()| self.err.flush());
            }
            Event::Ping | Event::Unknown => {}
            Event::Exit { exit_code: code, timed_out, oom_killed } => {
                let _ = self.out.flush();
                if timed_out {
                    let _ = writeln!(self.err, "hutch: the command timed out and was killed");
                    return Ok(Some(EXIT_TIMEOUT));
                }
                if oom_killed {
                    let _ = writeln!(
                        self.err,
                        "hutch: the command was killed by the OOM killer (the sandbox's memory is full)"
                    );
                }
                return Ok(Some(exit_code(code)));
            }
            Event::Error { error, code } => {
                let _ = self.out.flush();
                let when = if self.pid.is_some() { " (the command had started; its outcome is unknown)" } else { "" };
                let _ = writeln!(self.err, "hutch: {error} ({code}){when}");
                return Ok(Some(EXIT_HUTCH));
            }
        }
        Ok(None)
    }

    /// The stream ended without an exit event.
    pub fn finish(mut self) -> anyhow::Result<i32> {
        let _ = self.out.flush();
        match self.pid {
            Some(pid) => anyhow::bail!("the output stream ended before process {pid} exited; its outcome is unknown"),
            None => anyhow::bail!("the output stream ended before the command started"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: ExecArgs,
    }

    fn feed(lines: &[&str]) -> (Vec<u8>, Vec<u8>, anyhow::Result<i32>) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = {
            let mut s = Stream::new(&mut out, &mut err);
            let mut code = None;
            for l in lines {
                match s.line(l) {
                    Ok(Some(c)) => {
                        code = Some(Ok(c));
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        code = Some(Err(e));
                        break;
                    }
                }
            }
            code.unwrap_or_else(|| s.finish())
        };
        (out, err, code)
    }

    #[test]
    fn stream_copies_output_and_exits_with_the_commands_code() {
        let (out, err, code) = feed(&[
            r#"{"type":"start","pid":42}"#,
            r#"{"type":"stdout","data":"hello "}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"stderr","data":"warn\n"}"#,
            "",
            r#"{"type":"stdout","data":"world\n"}"#,
            r#"{"type":"exit","exit_code":3,"timed_out":false,"duration_ms":12}"#,
        ]);
        assert_eq!(out, b"hello world\n");
        assert_eq!(err, b"warn\n");
        assert_eq!(code.expect("code"), 3);
    }

    #[test]
    fn stream_timeout_exits_124() {
        let (_, err, code) = feed(&[
            r#"{"type":"start","pid":1}"#,
            r#"{"type":"exit","exit_code":-9,"timed_out":true,"duration_ms":1000}"#,
        ]);
        assert_eq!(code.expect("code"), EXIT_TIMEOUT);
        assert!(String::from_utf8_lossy(&err).contains("timed out"));
    }

    #[test]
    fn stream_oom_kill_is_said_and_keeps_the_code() {
        let (_, err, code) = feed(&[
            r#"{"type":"start","pid":1}"#,
            r#"{"type":"exit","exit_code":137,"timed_out":false,"duration_ms":90,"oom_killed":true}"#,
        ]);
        assert_eq!(code.expect("code"), 137);
        assert!(String::from_utf8_lossy(&err).contains("OOM killer"));
    }

    #[test]
    fn stream_error_before_start_exits_125_with_the_code() {
        let (out, err, code) =
            feed(&[r#"{"type":"error","code":"sandbox_session_not_running","error":"sandbox is suspended"}"#]);
        assert!(out.is_empty());
        assert_eq!(String::from_utf8_lossy(&err), "hutch: sandbox is suspended (sandbox_session_not_running)\n");
        assert_eq!(code.expect("code"), EXIT_HUTCH);
    }

    #[test]
    fn stream_accepts_unknown_codes_and_event_types() {
        let (_, err, code) = feed(&[
            r#"{"type":"start","pid":7}"#,
            r#"{"type":"resize","cols":80}"#,
            r#"{"type":"error","code":"brand_new_code","error":"agent lost"}"#,
        ]);
        assert_eq!(code.expect("code"), EXIT_HUTCH);
        let err = String::from_utf8_lossy(&err);
        assert!(err.contains("agent lost (brand_new_code)") && err.contains("outcome is unknown"), "{err}");
    }

    #[test]
    fn stream_that_ends_early_is_an_error() {
        let (out, _, code) = feed(&[r#"{"type":"start","pid":9}"#, r#"{"type":"stdout","data":"partial"}"#]);
        assert_eq!(out, b"partial");
        let e = code.expect_err("no exit event");
        assert!(e.to_string().contains("process 9"), "{e}");
        assert!(feed(&["not json"]).2.is_err());
        assert!(feed(&[r#"{"type":"exit"}"#]).2.is_err());
    }

    #[test]
    fn signals_map_to_128_plus_n() {
        assert_eq!(exit_code(0), 0);
        assert_eq!(exit_code(1), 1);
        assert_eq!(exit_code(-9), 137);
        assert_eq!(exit_code(-15), 143);
        assert_eq!(exit_code(300), 255);
    }

    #[test]
    fn one_word_with_spaces_is_a_shell_line_several_are_argv() {
        let one = |s: &str| split_command(&[s.to_owned()]).expect("split");
        assert_eq!(one("ls -la /tmp"), (Some("ls -la /tmp".to_owned()), None));
        assert_eq!(one("make&&make install"), (Some("make&&make install".to_owned()), None));
        assert_eq!(one("true"), (None, Some(vec!["true".to_owned()])));
        let several = split_command(&["echo".into(), "a b".into()]).expect("split");
        assert_eq!(several, (None, Some(vec!["echo".to_owned(), "a b".to_owned()])));
        assert!(split_command(&["  ".into()]).is_err());
    }

    #[test]
    fn exec_flags_parse_before_the_id_and_the_command_after_dashes() {
        let t = T::try_parse_from([
            "x",
            "--user",
            "root",
            "-e",
            "A=1",
            "--timeout",
            "30s",
            "--cwd",
            "/tmp",
            "sb-1",
            "--",
            "ls",
            "-l",
        ])
        .expect("parse");
        assert_eq!(t.a.id, "sb-1");
        assert_eq!(t.a.command, ["ls", "-l"]);
        let req = request(&t.a).expect("request");
        assert_eq!(req.argv, Some(vec!["ls".to_owned(), "-l".to_owned()]));
        assert_eq!(req.command, None);
        assert_eq!(req.user.as_deref(), Some("root"));
        assert_eq!(req.cwd.as_deref(), Some("/tmp"));
        assert_eq!(req.timeout_seconds, Some(30));
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(req.background, None);
        let t = T::try_parse_from(["x", "sb-1", "echo $HOME"]).expect("parse");
        assert_eq!(request(&t.a).expect("request").command.as_deref(), Some("echo $HOME"));
        assert!(T::try_parse_from(["x", "sb-1"]).is_err());
        assert!(T::try_parse_from(["x", "--json", "--background", "sb-1", "true"]).is_err());
    }

    #[test]
    fn exec_it_takes_no_command_and_no_timeout() {
        let t = T::try_parse_from(["x", "-it", "sb-1"]).expect("parse");
        assert!(t.a.tty && t.a.interactive && t.a.command.is_empty());
        let t = T::try_parse_from(["x", "-it", "-e", "A=1", "sb-1", "--", "bash", "-l"]).expect("parse");
        assert_eq!(t.a.command, ["bash", "-l"]);
        for bad in [
            &["x", "-it", "--timeout", "5s", "sb-1"][..],
            &["x", "-t", "--background", "sb-1"],
            &["x", "-t", "--json", "sb-1"],
        ] {
            assert!(T::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }
}
