//! The host side of the agent link: a connection to a sandbox's agent.
//!
//! Everything read here comes from inside the sandbox and is treated as
//! hostile: the length word is checked before any buffer is allocated, every
//! header must parse as a known message with no unknown fields, and replies
//! have a deadline. A lying agent can make a request fail; it cannot make
//! the host allocate without bound, hang past the deadline, or crash.

use hutch_agent::proto::{self, FromAgent, Reply, Request, ToAgent};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the agent has to answer a request.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent connection failed: {0}")]
    Io(#[from] io::Error),
    #[error("agent sent a malformed frame: {0}")]
    Protocol(#[from] proto::FrameError),
    #[error("agent closed the connection")]
    Closed,
    #[error("agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("agent refused: {code:?}: {message}")]
    Refused { code: proto::ErrorCode, message: String },
    #[error("agent answered {0:?} where another reply was expected")]
    Unexpected(Box<Reply>),
}

/// A message from the agent with its data bytes.
pub type Message = (FromAgent, Vec<u8>);

/// One connection to an agent.
#[derive(Debug)]
pub struct AgentConn {
    stream: UnixStream,
    ids: Arc<AtomicU64>,
    /// Messages that arrived while `call` waited for a reply.
    pending: VecDeque<Message>,
    wbuf: Vec<u8>,
    reply_timeout: Duration,
    /// Bytes read from the socket; `rbuf[rpos..rend]` is not yet consumed.
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    /// Whether a read timeout is set on the socket now.
    timeout_set: bool,
}

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 256 * 1024;

/// A handle that can send requests on a connection from another thread
/// (stdin forwarding, signals); replies arrive on the connection.
#[derive(Debug)]
pub struct Sender {
    stream: UnixStream,
    ids: Arc<AtomicU64>,
}

impl Sender {
    pub fn send(&mut self, req: Request, data: &[u8]) -> Result<u64, AgentError> {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let mut buf = Vec::with_capacity(64 + data.len());
        proto::encode(&ToAgent { id, req }, data, &mut buf)?;
        self.stream.write_all(&buf)?;
        Ok(id)
    }
}

impl AgentConn {
    pub fn connect(path: &Path) -> Result<AgentConn, AgentError> {
        Ok(AgentConn::from_stream(UnixStream::connect(path)?))
    }

    pub fn from_stream(stream: UnixStream) -> AgentConn {
        AgentConn {
            stream,
            ids: Arc::new(AtomicU64::new(1)),
            pending: VecDeque::new(),
            wbuf: Vec::new(),
            reply_timeout: REPLY_TIMEOUT,
            rbuf: Vec::new(),
            rpos: 0,
            rend: 0,
            timeout_set: false,
        }
    }

    /// How long [`AgentConn::call`] waits for a reply.
    pub fn set_reply_timeout(&mut self, timeout: Duration) {
        self.reply_timeout = timeout;
    }

    pub fn sender(&self) -> Result<Sender, AgentError> {
        Ok(Sender { stream: self.stream.try_clone()?, ids: self.ids.clone() })
    }

    /// Sends a request; its reply arrives later through [`AgentConn::recv`].
    pub fn send(&mut self, req: Request, data: &[u8]) -> Result<u64, AgentError> {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        self.wbuf.clear();
        proto::encode(&ToAgent { id, req }, data, &mut self.wbuf)?;
        self.stream.write_all(&self.wbuf)?;
        Ok(id)
    }

    /// Sends a request and waits for its reply, keeping other messages for
    /// `recv`. Error replies become [`AgentError::Refused`].
    pub fn call(&mut self, req: Request, data: &[u8]) -> Result<(Reply, Vec<u8>), AgentError> {
        let id = self.send(req, data)?;
        self.wait_reply(id)
    }

    /// Waits for the reply to request `id`.
    pub fn wait_reply(&mut self, id: u64) -> Result<(Reply, Vec<u8>), AgentError> {
        loop {
            let (msg, data) = self.read_message(Some(self.reply_timeout))?;
            match msg {
                FromAgent::Reply { id: got, reply } if got == id => {
                    if let Reply::Error { code, message } = reply {
                        return Err(AgentError::Refused { code, message: bounded(message) });
                    }
                    return Ok((reply, data));
                }
                other => {
                    // Bounded: at most this many unsolicited messages wait.
                    if self.pending.len() >= 4096 {
                        return Err(AgentError::Protocol(proto::FrameError::BadHeader(
                            "too many unsolicited messages".into(),
                        )));
                    }
                    self.pending.push_back((other, data));
                }
            }
        }
    }

    /// The next message: one kept by `call`, else one from the socket,
    /// waiting at most `timeout` (forever when `None`).
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Message, AgentError> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(m);
        }
        self.read_message(timeout)
    }

    fn read_message(&mut self, timeout: Option<Duration>) -> Result<Message, AgentError> {
        // One deadline for the whole frame: an agent that drips a byte at a
        // time must not hold the host longer than a silent one.
        let deadline = timeout.map(|t| (Instant::now() + t, t));
        self.fill(4, deadline)?;
        let word = &self.rbuf[self.rpos..self.rpos + 4];
        let len = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        proto::check_len(len)?;
        self.fill(4 + len as usize, deadline)?;
        let raw = proto::split_frame(&self.rbuf[self.rpos..self.rend])?.ok_or(proto::FrameError::BadLength(len))?;
        let msg: FromAgent = proto::parse_header(raw.header)?;
        let data = raw.data.to_vec();
        self.rpos += raw.consumed;
        Ok((msg, data))
    }

    /// Reads until at least `want` unread bytes are buffered. `want` is
    /// bounded by the frame limit, checked by the caller.
    fn fill(&mut self, want: usize, deadline: Option<(Instant, Duration)>) -> Result<(), AgentError> {
        if self.rend - self.rpos >= want {
            return Ok(());
        }
        // Move the unread tail to the front, and grow only for a large frame.
        self.rbuf.copy_within(self.rpos..self.rend, 0);
        self.rend -= self.rpos;
        self.rpos = 0;
        if self.rbuf.len() < want.max(READ_CHUNK) {
            self.rbuf.resize(want.max(READ_CHUNK), 0);
        }
        while self.rend < want {
            let remaining = match deadline {
                Some((at, total)) => {
                    let left = at.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(AgentError::Timeout(total));
                    }
                    Some(left)
                }
                None => None,
            };
            if remaining.is_some() || self.timeout_set {
                self.stream.set_read_timeout(remaining)?;
                self.timeout_set = remaining.is_some();
            }
            match self.stream.read(&mut self.rbuf[self.rend..]) {
                Ok(0) => return Err(AgentError::Closed),
                Ok(n) => self.rend += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return Err(AgentError::Timeout(deadline.map(|d| d.1).unwrap_or_default()));
                }
                Err(e) => return Err(AgentError::Io(e)),
            }
        }
        Ok(())
    }

    /// Checks the agent answers and speaks our protocol version.
    pub fn ping(&mut self) -> Result<u32, AgentError> {
        match self.call(Request::Ping, &[])? {
            (Reply::Pong { version }, _) => Ok(version),
            (other, _) => Err(AgentError::Unexpected(Box::new(other))),
        }
    }
}

/// Error messages from the agent are shown to users: keep them short.
fn bounded(mut s: String) -> String {
    const MAX: usize = 1024;
    if s.len() > MAX {
        let mut cut = MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}
