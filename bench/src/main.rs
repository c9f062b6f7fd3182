//! sandbox-bench: wall time of "start a fresh sandbox, run one command, tear
//! it down" for hutch and its peers (bwrap, runc, podman, plain fork+exec),
//! all measured in the same run, interleaved so machine noise hits every
//! runner alike. Prints median and p95 per (runner, command).
//!
//! See bench/README.md for how to run it and how to read the table.

mod measure;
mod runners;

use std::fs;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use measure::{summarize, RunError, Waiter};
use runners::{Runner, RunnerKind, WORKLOADS};

/// Deadline for the correctness check (podman's first run can be slow).
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline for one measured run; anything near it is broken, not slow.
const RUN_TIMEOUT: Duration = Duration::from_secs(30);

const USAGE: &str = "\
usage: sandbox-bench [--iters N] [--warmup W] [--only RUNNER,...] [--hutch PATH]
                     [--podman-iters N]

  --iters N          measured runs per runner and command (default 50)
  --warmup W         unrecorded runs per runner and command first (default 3)
  --only LIST        comma-separated subset of: hutch,bwrap,runc,podman,fork+exec
  --hutch PATH       hutch binary (default: `hutch` next to this executable)
  --podman-iters N   measured runs for podman, which is slow (default 10)";

/// What the command line asks for.
#[derive(Debug, PartialEq)]
struct Config {
    iters: usize,
    warmup: usize,
    runners: Vec<RunnerKind>,
    hutch: PathBuf,
    podman_iters: usize,
}

impl Config {
    fn iters_for(&self, kind: RunnerKind) -> usize {
        match kind {
            RunnerKind::Podman => self.podman_iters,
            _ => self.iters,
        }
    }
}

/// Parses the arguments after the program name. `Ok(None)` means `--help`.
fn parse_args(args: impl IntoIterator<Item = String>, default_hutch: PathBuf) -> Result<Option<Config>, String> {
    let mut cfg =
        Config { iters: 50, warmup: 3, runners: RunnerKind::ALL.to_vec(), hutch: default_hutch, podman_iters: 10 };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let mut value = || inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--iters" => cfg.iters = parse_count(&flag, &value()?, 1)?,
            "--warmup" => cfg.warmup = parse_count(&flag, &value()?, 0)?,
            "--podman-iters" => cfg.podman_iters = parse_count(&flag, &value()?, 1)?,
            "--hutch" => cfg.hutch = PathBuf::from(value()?),
            "--only" => {
                let list = value()?;
                let mut picked = Vec::new();
                for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let kind = RunnerKind::from_name(name).ok_or_else(|| format!("--only: unknown runner {name:?}"))?;
                    if !picked.contains(&kind) {
                        picked.push(kind);
                    }
                }
                if picked.is_empty() {
                    return Err("--only needs at least one runner".to_owned());
                }
                // Keep table order whatever order they were given in.
                cfg.runners = RunnerKind::ALL.into_iter().filter(|k| picked.contains(k)).collect();
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    Ok(Some(cfg))
}

fn parse_count(flag: &str, value: &str, min: usize) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!("{flag}: expected an integer >= {min}, got {value:?}")),
    }
}

/// One (runner, command) cell of the table.
#[derive(Default)]
struct Series {
    samples: Vec<Duration>,
    /// Measured runs that exited non-zero, and the first such status.
    failed: usize,
    first_failure: Option<String>,
}

/// A runner and everything measured for it.
struct Slot {
    runner: Runner,
    /// Why it is skipped, when it is.
    unavailable: Option<String>,
    /// Why it stopped part way through the measurement, when it did.
    stopped: Option<String>,
    version: String,
    series: Vec<Series>,
}

fn main() -> ExitCode {
    let default_hutch = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("hutch")))
        .unwrap_or_else(|| PathBuf::from("hutch"));
    let cfg = match parse_args(std::env::args().skip(1), default_hutch) {
        Ok(Some(cfg)) => cfg,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("sandbox-bench: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };

    print_header(&cfg);

    // The runc bundles and podman rootfs, prepared once.
    let work_dir = std::env::temp_dir().join(format!("sandbox-bench-{}", std::process::id()));
    let bundle_error = if cfg.runners.iter().any(|k| k.needs_rootfs()) {
        runners::prepare_bundles(&work_dir).err().map(|e| format!("cannot prepare {}: {e}", work_dir.display()))
    } else {
        None
    };

    let waiter = Waiter::new();
    let mut slots: Vec<Slot> = cfg
        .runners
        .iter()
        .map(|&kind| {
            let mut slot = Slot {
                runner: Runner::new(kind, &cfg.hutch, Some(&work_dir)),
                unavailable: None,
                stopped: None,
                version: String::new(),
                series: WORKLOADS.iter().map(|_| Series::default()).collect(),
            };
            slot.unavailable = match (&bundle_error, kind.needs_rootfs()) {
                (Some(e), true) => Some(e.clone()),
                _ => check(&mut slot.runner, &waiter, &cfg.hutch).err(),
            };
            if slot.unavailable.is_none() {
                slot.version = version(kind, &cfg.hutch, &waiter);
            }
            slot
        })
        .collect();

    for slot in &slots {
        let state = match &slot.unavailable {
            Some(reason) => format!("unavailable: {reason}"),
            None => slot.version.clone(),
        };
        println!("# {:<10} {state}", slot.runner.kind.name());
    }
    println!();

    let rounds =
        slots.iter().filter(|s| s.unavailable.is_none()).map(|s| cfg.iters_for(s.runner.kind)).max().unwrap_or(0);
    for round in 0..cfg.warmup {
        run_round(&mut slots, &waiter, &cfg, round, None);
    }
    let progress = std::io::stderr().is_terminal();
    for round in 0..rounds {
        if progress {
            eprint!("\rsandbox-bench: round {}/{rounds}", round + 1);
        }
        run_round(&mut slots, &waiter, &cfg, round, Some(round));
    }
    if progress && rounds > 0 {
        eprintln!();
    }

    let measured = print_table(&slots);
    print_ratios(&slots);
    print_warnings(&slots);
    cleanup(&cfg, &work_dir);

    if measured {
        ExitCode::SUCCESS
    } else {
        eprintln!("sandbox-bench: no runner produced a measurement");
        ExitCode::FAILURE
    }
}

fn print_header(cfg: &Config) {
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M:%S UTC"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown date".to_owned());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned());
    let nproc = std::thread::available_parallelism().map(|n| n.to_string()).unwrap_or_else(|_| "?".to_owned());
    let podman = if cfg.runners.contains(&RunnerKind::Podman) {
        format!(" (podman {})", cfg.podman_iters)
    } else {
        String::new()
    };
    println!("# sandbox-bench {date}");
    println!(
        "# kernel {kernel}, nproc {nproc}, N = {}{podman} runs per runner and command, {} warmup",
        cfg.iters, cfg.warmup
    );
}

/// Runs every workload once with output captured and checks exit status and
/// stdout. `Err` carries the reason the runner is skipped.
fn check(runner: &mut Runner, waiter: &Waiter, hutch: &Path) -> Result<(), String> {
    if runner.kind == RunnerKind::Hutch && !hutch.is_file() {
        return Err(format!("no hutch binary at {}", hutch.display()));
    }
    for w in WORKLOADS {
        let (mut cmd, runc_id) = runner.command(w);
        let out = match waiter.output(&mut cmd, CHECK_TIMEOUT) {
            Ok(out) => out,
            Err(e) => {
                if let (RunError::Timeout(_), Some(id)) = (&e, &runc_id) {
                    runners::runc_delete(id);
                }
                return Err(format!("`{}`: {e}", w.label));
            }
        };
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
            return Err(format!(
                "`{}` {}{}",
                w.label,
                out.status,
                last.map(|l| format!(": {}", l.trim())).unwrap_or_default()
            ));
        }
        if out.stdout != w.expect_stdout.as_bytes() {
            return Err(format!(
                "`{}` printed {:?}, expected {:?}",
                w.label,
                String::from_utf8_lossy(&out.stdout),
                w.expect_stdout
            ));
        }
    }
    Ok(())
}

/// The runner's version line, for the header.
fn version(kind: RunnerKind, hutch: &Path, waiter: &Waiter) -> String {
    let mut cmd = match kind {
        RunnerKind::Hutch => return hutch.display().to_string(),
        RunnerKind::ForkExec => return "std::process::Command".to_owned(),
        RunnerKind::Bwrap => Command::new("bwrap"),
        RunnerKind::Runc => Command::new("runc"),
        RunnerKind::Podman => Command::new("podman"),
    };
    cmd.arg("--version");
    match waiter.output(&mut cmd, CHECK_TIMEOUT) {
        Ok(out) => String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").trim().to_owned(),
        Err(e) => format!("version unknown: {e}"),
    }
}

/// One round: every live (runner, command) pair once, starting at a
/// different pair each round so no runner always follows the same one.
/// `record` is the measured round number, or `None` for warmup.
fn run_round(slots: &mut [Slot], waiter: &Waiter, cfg: &Config, round: usize, record: Option<usize>) {
    let pairs: Vec<(usize, usize)> = (0..slots.len()).flat_map(|s| (0..WORKLOADS.len()).map(move |w| (s, w))).collect();
    if pairs.is_empty() {
        return;
    }
    let start = round % pairs.len();
    for &(s, w) in pairs[start..].iter().chain(&pairs[..start]) {
        let slot = &mut slots[s];
        if slot.unavailable.is_some() || slot.stopped.is_some() {
            continue;
        }
        if record.is_some_and(|r| r >= cfg.iters_for(slot.runner.kind)) {
            continue;
        }
        let workload = &WORKLOADS[w];
        let (mut cmd, runc_id) = slot.runner.command(workload);
        match waiter.time(&mut cmd, RUN_TIMEOUT) {
            Ok((status, elapsed)) => {
                if record.is_none() {
                    continue;
                }
                let series = &mut slot.series[w];
                if status.success() {
                    series.samples.push(elapsed);
                } else {
                    series.failed += 1;
                    series.first_failure.get_or_insert_with(|| status.to_string());
                }
            }
            Err(e) => {
                if let (RunError::Timeout(_), Some(id)) = (&e, &runc_id) {
                    runners::runc_delete(id);
                }
                slot.stopped = Some(format!("`{}`: {e}", workload.label));
            }
        }
    }
}

/// Prints the table; returns whether any cell has numbers.
fn print_table(slots: &[Slot]) -> bool {
    let mut measured = false;
    println!("{:<11} {:<24} {:>10} {:>9} {:>6}", "runner", "command", "median_ms", "p95_ms", "runs");
    for slot in slots {
        let name = slot.runner.kind.name();
        if let Some(reason) = &slot.unavailable {
            println!("{name:<11} unavailable: {reason}");
            continue;
        }
        for (w, series) in WORKLOADS.iter().zip(&slot.series) {
            match summarize(&series.samples) {
                Some(s) => {
                    measured = true;
                    println!("{name:<11} {:<24} {:>10.2} {:>9.2} {:>6}", w.label, s.median_ms, s.p95_ms, s.runs);
                }
                None => println!("{name:<11} {:<24} {:>10} {:>9} {:>6}", w.label, "-", "-", 0),
            }
        }
    }
    println!();
    measured
}

fn median_of(slots: &[Slot], kind: RunnerKind, w: usize) -> Result<f64, String> {
    let slot = slots.iter().find(|s| s.runner.kind == kind).ok_or_else(|| format!("{kind} not selected"))?;
    if slot.unavailable.is_some() {
        return Err(format!("{kind} unavailable"));
    }
    summarize(&slot.series[w].samples).map(|s| s.median_ms).ok_or_else(|| format!("no {kind} runs"))
}

fn print_ratios(slots: &[Slot]) {
    for (w, workload) in WORKLOADS.iter().enumerate() {
        let ratio = median_of(slots, RunnerKind::Hutch, w)
            .and_then(|h| median_of(slots, RunnerKind::Bwrap, w).map(|b| format!("{:.2}", h / b)));
        let text = ratio.unwrap_or_else(|why| format!("n/a ({why})"));
        println!("hutch/bwrap median ratio [{}]: {text}", workload.label);
    }
}

fn print_warnings(slots: &[Slot]) {
    for slot in slots {
        let name = slot.runner.kind.name();
        if let Some(why) = &slot.stopped {
            println!("warning: {name} stopped part way: {why}");
        }
        for (w, series) in WORKLOADS.iter().zip(&slot.series) {
            if series.failed > 0 {
                println!(
                    "warning: {name} `{}`: {} measured runs failed (first: {}); they are not in the table",
                    w.label,
                    series.failed,
                    series.first_failure.as_deref().unwrap_or("?")
                );
            }
        }
    }
}

/// Checks that no runc container of ours survived and removes the work dir.
fn cleanup(cfg: &Config, work_dir: &Path) {
    if cfg.runners.contains(&RunnerKind::Runc) {
        match runners::runc_leftovers() {
            Ok(ids) if ids.is_empty() => {}
            Ok(ids) => {
                println!("warning: {} runc containers leaked; deleting them", ids.len());
                for id in &ids {
                    runners::runc_delete(id);
                }
            }
            Err(e) => println!("warning: `runc list` failed: {e}"),
        }
    }
    if !work_dir.exists() {
        return;
    }
    // The host /usr is only ever bind-mounted inside the sandboxes' mount
    // namespaces; refuse to recurse into the work dir if that ever changes.
    let mounted = fs::read_to_string("/proc/self/mountinfo")
        .map(|info| info.lines().any(|l| l.split(' ').nth(4).is_some_and(|mp| Path::new(mp).starts_with(work_dir))))
        .unwrap_or(true);
    if mounted {
        println!("warning: something is mounted under {}; left it in place", work_dir.display());
    } else if let Err(e) = fs::remove_dir_all(work_dir) {
        println!("warning: cannot remove {}: {e}", work_dir.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Config>, String> {
        parse_args(args.iter().map(|s| s.to_string()), PathBuf::from("/x/hutch"))
    }

    #[test]
    fn defaults() {
        let cfg = parse(&[]).expect("valid").expect("not help");
        assert_eq!(cfg.iters, 50);
        assert_eq!(cfg.warmup, 3);
        assert_eq!(cfg.podman_iters, 10);
        assert_eq!(cfg.runners, RunnerKind::ALL.to_vec());
        assert_eq!(cfg.hutch, PathBuf::from("/x/hutch"));
    }

    #[test]
    fn flags_with_space_or_equals() {
        let cfg = parse(&["--iters", "7", "--warmup=0", "--only", "runc,bwrap", "--hutch=/h", "--podman-iters", "2"])
            .expect("valid")
            .expect("not help");
        assert_eq!(cfg.iters, 7);
        assert_eq!(cfg.warmup, 0);
        assert_eq!(cfg.podman_iters, 2);
        assert_eq!(cfg.hutch, PathBuf::from("/h"));
        // Table order, not argument order.
        assert_eq!(cfg.runners, vec![RunnerKind::Bwrap, RunnerKind::Runc]);
    }

    #[test]
    fn bad_arguments_are_rejected() {
        assert!(parse(&["--iters", "0"]).is_err());
        assert!(parse(&["--iters"]).is_err());
        assert!(parse(&["--only", "docker"]).is_err());
        assert!(parse(&["--only", ","]).is_err());
        assert!(parse(&["--frobnicate"]).is_err());
        assert!(matches!(parse(&["--help"]), Ok(None)));
    }
}
