//! Process output kept while nobody is attached, and how a wait status turns
//! into the protocol's exit status.

use std::collections::VecDeque;

use hutch_agent::proto::ExitStatus;

/// The last `cap` bytes of a stream, with a count of what fell out.
pub struct Ring {
    buf: VecDeque<u8>,
    cap: usize,
    dropped: u64,
}

impl Ring {
    pub fn new(cap: usize) -> Ring {
        Ring { buf: VecDeque::new(), cap, dropped: 0 }
    }

    pub fn push(&mut self, data: &[u8]) {
        if data.len() >= self.cap {
            self.dropped += (self.buf.len() + data.len() - self.cap) as u64;
            self.buf.clear();
            self.buf.extend(&data[data.len() - self.cap..]);
            return;
        }
        let over = (self.buf.len() + data.len()).saturating_sub(self.cap);
        self.buf.drain(..over);
        self.dropped += over as u64;
        self.buf.extend(data);
    }

    /// Takes what is kept and how much was discarded, leaving the ring empty.
    pub fn take(&mut self) -> (u64, Vec<u8>) {
        let dropped = std::mem::take(&mut self.dropped);
        (dropped, Vec::from(std::mem::take(&mut self.buf)))
    }
}

/// Decodes a `waitpid` status.
pub fn exit_status(status: i32, timed_out: bool) -> ExitStatus {
    let (code, signal) = if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (None, None)
    };
    ExitStatus { code, signal, timed_out, oom_killed: false, descendants_alive: false }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_tail_and_counts_what_it_dropped() {
        let mut r = Ring::new(5);
        r.push(b"abc");
        r.push(b"def");
        assert_eq!(r.take(), (1, b"bcdef".to_vec()));
        assert_eq!(r.take(), (0, Vec::new()));
        r.push(b"0123456789");
        r.push(b"");
        assert_eq!(r.take(), (5, b"56789".to_vec()));
        let mut zero = Ring::new(0);
        zero.push(b"xyz");
        assert_eq!(zero.take(), (3, Vec::new()));
    }

    #[test]
    fn wait_status_decodes_codes_and_signals() {
        assert_eq!(exit_status(0, false), ExitStatus::exited(0));
        assert_eq!(exit_status(127 << 8, false).code, Some(127));
        let killed = exit_status(libc::SIGKILL, true);
        assert_eq!((killed.code, killed.signal, killed.timed_out), (None, Some(9), true));
        assert_eq!(exit_status(libc::SIGSEGV | 0x80, false).signal, Some(libc::SIGSEGV), "core dumped");
    }
}
