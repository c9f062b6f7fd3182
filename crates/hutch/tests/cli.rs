//! The command line as a pipe's writer: a reader that goes away ends the
//! command quietly, as it ends any Unix tool, never with a panic.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

/// Runs `hutch args` with stdout a pipe whose read end is already closed,
/// so its first write fails as `hutch ... | head` does once head is gone.
fn to_a_closed_pipe(args: &[&str]) -> (std::process::ExitStatus, String) {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_hutch"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("run hutch");
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn printing_to_a_closed_pipe_ends_quietly() {
    for args in [&["doctor", "--json"][..], &["doctor"], &["--help"], &["sandbox", "--help"]] {
        let (status, stderr) = to_a_closed_pipe(args);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_ne!(status.code(), Some(101), "{args:?}: {stderr}");
        assert!(
            status.signal() == Some(libc::SIGPIPE) || status.code().is_some_and(|c| c != 0),
            "{args:?} claims success though nothing was printed: {status:?}"
        );
    }
}
