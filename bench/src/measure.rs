//! Timing one child process from spawn to reap, with a deadline, and the
//! order statistics we report.
//!
//! The clock starts just before `spawn` and stops in a long-lived waiter
//! thread the moment `wait` returns, so the measured span is exactly "start
//! the sandbox, run the command, tear the sandbox down". The waiter thread
//! exists only so a hung runner can be killed after a deadline instead of
//! hanging the whole benchmark; handing a `Child` to it costs a few
//! microseconds, the same for every runner.

use std::io;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

/// What the waiter thread is asked to do with a child.
enum Job {
    /// Reap it; its stdio goes to /dev/null.
    Wait(Child),
    /// Reap it and collect its piped stdout and stderr.
    Output(Child),
}

/// What the waiter thread hands back, stamped when the child was reaped.
enum Reaped {
    Status(io::Result<ExitStatus>, Instant),
    Output(io::Result<Output>),
}

/// Why one run did not produce a usable sample.
#[derive(Debug)]
pub enum RunError {
    /// The runner binary could not be started at all.
    Spawn { program: String, source: io::Error },
    /// Waiting for the child failed.
    Wait(io::Error),
    /// The child ran past the deadline and was killed.
    Timeout(Duration),
    /// The waiter thread is gone (it cannot panic short of a bug in std).
    WaiterGone,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Spawn { program, source } if source.kind() == io::ErrorKind::NotFound => {
                write!(f, "{program} is not installed ({source})")
            }
            RunError::Spawn { program, source } => write!(f, "cannot start {program}: {source}"),
            RunError::Wait(source) => write!(f, "waiting for the child failed: {source}"),
            RunError::Timeout(limit) => write!(f, "timed out after {} s", limit.as_secs()),
            RunError::WaiterGone => write!(f, "the waiter thread exited"),
        }
    }
}

/// A long-lived thread that reaps children on our behalf.
pub struct Waiter {
    jobs: Sender<Job>,
    done: Receiver<Reaped>,
}

impl Waiter {
    pub fn new() -> Self {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel::<Reaped>();
        thread::spawn(move || {
            for job in job_rx {
                let reaped = match job {
                    Job::Wait(mut child) => {
                        let status = child.wait();
                        Reaped::Status(status, Instant::now())
                    }
                    Job::Output(child) => Reaped::Output(child.wait_with_output()),
                };
                if done_tx.send(reaped).is_err() {
                    break;
                }
            }
        });
        Waiter { jobs, done }
    }

    /// Runs `cmd` with stdio to /dev/null and returns its exit status and
    /// wall time from just before spawn to reap.
    pub fn time(&self, cmd: &mut Command, limit: Duration) -> Result<(ExitStatus, Duration), RunError> {
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        let start = Instant::now();
        let child = spawn(cmd)?;
        match self.hand_over(Job::Wait(child), limit)? {
            Reaped::Status(status, end) => Ok((status.map_err(RunError::Wait)?, end.duration_since(start))),
            Reaped::Output(_) => unreachable!("a Wait job is answered with a Status"),
        }
    }

    /// Runs `cmd` with stdout and stderr captured, for the correctness check.
    pub fn output(&self, cmd: &mut Command, limit: Duration) -> Result<Output, RunError> {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let child = spawn(cmd)?;
        match self.hand_over(Job::Output(child), limit)? {
            Reaped::Output(output) => output.map_err(RunError::Wait),
            Reaped::Status(..) => unreachable!("an Output job is answered with an Output"),
        }
    }

    fn hand_over(&self, job: Job, limit: Duration) -> Result<Reaped, RunError> {
        let pid = match &job {
            Job::Wait(child) | Job::Output(child) => child.id(),
        };
        self.jobs.send(job).map_err(|_| RunError::WaiterGone)?;
        match self.done.recv_timeout(limit) {
            Ok(reaped) => Ok(reaped),
            Err(RecvTimeoutError::Timeout) => {
                // The child is not reaped yet (the waiter would have answered),
                // so the pid still names it.
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
                // Drain the answer so the next job's reply is not this one.
                self.done.recv().map_err(|_| RunError::WaiterGone)?;
                Err(RunError::Timeout(limit))
            }
            Err(RecvTimeoutError::Disconnected) => Err(RunError::WaiterGone),
        }
    }
}

fn spawn(cmd: &mut Command) -> Result<Child, RunError> {
    cmd.spawn().map_err(|source| RunError::Spawn { program: cmd.get_program().to_string_lossy().into_owned(), source })
}

/// Median and 95th percentile of a set of samples, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub median_ms: f64,
    pub p95_ms: f64,
    pub runs: usize,
}

/// Median (mean of the two middle samples when even) and nearest-rank p95.
/// `None` when there are no samples.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    let median_ms = if n % 2 == 1 { ms[n / 2] } else { (ms[n / 2 - 1] + ms[n / 2]) / 2.0 };
    // Nearest rank: the smallest sample with at least 95% of samples <= it.
    let rank = (n * 95).div_ceil(100).max(1);
    Some(Summary { median_ms, p95_ms: ms[rank - 1], runs: n })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn summarize_empty_is_none() {
        assert_eq!(summarize(&[]), None);
    }

    #[test]
    fn summarize_odd_and_even_medians() {
        let s = summarize(&ms(&[5, 1, 3])).expect("non-empty");
        assert_eq!(s.median_ms, 3.0);
        let s = summarize(&ms(&[4, 1, 3, 2])).expect("non-empty");
        assert_eq!(s.median_ms, 2.5);
    }

    #[test]
    fn p95_is_nearest_rank() {
        // 1..=20 ms: rank ceil(0.95 * 20) = 19.
        let s = summarize(&ms(&(1..=20).collect::<Vec<_>>())).expect("non-empty");
        assert_eq!(s.p95_ms, 19.0);
        assert_eq!(s.runs, 20);
        // A single sample is its own p95.
        let s = summarize(&ms(&[7])).expect("non-empty");
        assert_eq!(s.p95_ms, 7.0);
    }
}
