//! The host side of the agent link: one codec ([`Codec`]: request ids, the
//! frame reader, reply matching and the mapping of the agent's refusals)
//! under two transports, the blocking [`AgentConn`] (`hutch run`, tests)
//! and the async [`crate::agent_async::AsyncConn`] (the daemon).
//!
//! Everything read here comes from inside the sandbox and is treated as
//! hostile: the length word is checked before any buffer is allocated, every
//! header must parse as a known message with no unknown fields, messages
//! shown to users are bounded, and replies have a deadline. A lying agent
//! can make a request fail; it cannot make the host allocate without bound,
//! hang past the deadline, or crash.

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
    /// The request itself does not fit in a frame (a caller's bound was
    /// missing); nothing was sent.
    #[error("request does not fit in an agent frame: {0}")]
    RequestTooLarge(proto::FrameError),
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

/// Bytes asked of the socket per read, and the read buffer's resting size.
const READ_CHUNK: usize = 64 * 1024;
/// Most unsolicited messages kept while a caller waits for a reply.
const MAX_PENDING: usize = 4096;
/// Longest agent error message kept (they are shown to users).
const MAX_MESSAGE: usize = 1024;

/// The transport-free half of a connection: ids, the write buffer, the
/// read buffer and its frame reader, and the messages that arrived while a
/// reply was awaited.
#[derive(Debug)]
pub struct Codec {
    ids: Arc<AtomicU64>,
    wbuf: Vec<u8>,
    /// Bytes read from the socket; `rbuf[rpos..rend]` is not yet consumed.
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    pending: VecDeque<Message>,
}

impl Default for Codec {
    fn default() -> Self {
        Codec::new()
    }
}

impl Codec {
    pub fn new() -> Codec {
        Codec {
            ids: Arc::new(AtomicU64::new(1)),
            wbuf: Vec::new(),
            rbuf: Vec::new(),
            rpos: 0,
            rend: 0,
            pending: VecDeque::new(),
        }
    }

    /// Encodes a request with a fresh id; returns the id and the bytes to send.
    pub fn request(&mut self, req: Request, data: &[u8]) -> Result<(u64, &[u8]), AgentError> {
        self.wbuf.clear();
        let id = encode_request(&self.ids, req, data, &mut self.wbuf)?;
        Ok((id, &self.wbuf))
    }

    /// The next complete message of the read buffer, or `None` until more
    /// bytes arrive (see [`Codec::read_buf`]). Refuses a bad length before
    /// anything is allocated for the frame.
    pub fn decode(&mut self) -> Result<Option<Message>, AgentError> {
        let buffered = &self.rbuf[self.rpos..self.rend];
        if buffered.len() < 4 {
            return Ok(None);
        }
        proto::check_len(u32::from_le_bytes([buffered[0], buffered[1], buffered[2], buffered[3]]))?;
        let Some(raw) = proto::split_frame(buffered)? else { return Ok(None) };
        let msg: FromAgent = proto::parse_header(raw.header)?;
        let data = raw.data.to_vec();
        self.rpos += raw.consumed;
        if self.rpos == self.rend {
            self.rpos = 0;
            self.rend = 0;
        }
        Ok(Some((msg, data)))
    }

    /// Room to read into, enough for the rest of the frame being read.
    /// Call after [`Codec::decode`] answered `None`, then [`Codec::filled`].
    pub fn read_buf(&mut self) -> &mut [u8] {
        let buffered = &self.rbuf[self.rpos..self.rend];
        // decode() checked the length word, so this is at most a frame.
        let want = match buffered {
            [a, b, c, d, ..] => 4 + u32::from_le_bytes([*a, *b, *c, *d]) as usize,
            _ => 4,
        };
        if self.rbuf.len() - self.rpos < want.max(READ_CHUNK) {
            // Move the unread tail to the front, and grow only for a large frame.
            self.rbuf.copy_within(self.rpos..self.rend, 0);
            self.rend -= self.rpos;
            self.rpos = 0;
            if self.rbuf.len() < want.max(READ_CHUNK) {
                self.rbuf.resize(want.max(READ_CHUNK), 0);
            }
        }
        &mut self.rbuf[self.rend..]
    }

    /// Records that `n` bytes were read into [`Codec::read_buf`].
    pub fn filled(&mut self, n: usize) {
        self.rend = (self.rend + n).min(self.rbuf.len());
    }

    /// Whether `msg` answers request `id`: its reply (an error reply as
    /// [`AgentError::Refused`]), or `None` after keeping `msg` for
    /// [`Codec::pop_pending`].
    pub fn take_reply(&mut self, id: u64, msg: Message) -> Result<Option<(Reply, Vec<u8>)>, AgentError> {
        match msg {
            (FromAgent::Reply { id: got, reply }, data) if got == id => match reply {
                Reply::Error { code, message } => Err(AgentError::Refused { code, message: bounded(message) }),
                reply => Ok(Some((reply, data))),
            },
            other => {
                if self.pending.len() >= MAX_PENDING {
                    return Err(AgentError::Protocol(proto::FrameError::BadHeader(
                        "too many unsolicited messages".into(),
                    )));
                }
                self.pending.push_back(other);
                Ok(None)
            }
        }
    }

    /// A message kept while a reply was awaited, oldest first.
    pub fn pop_pending(&mut self) -> Option<Message> {
        self.pending.pop_front()
    }

    /// Whether nothing unread is buffered.
    pub fn is_clean(&self) -> bool {
        self.pending.is_empty() && self.rpos == self.rend
    }
}

/// Encodes `req` with the next id of `ids` into `out`.
fn encode_request(ids: &AtomicU64, req: Request, data: &[u8], out: &mut Vec<u8>) -> Result<u64, AgentError> {
    let id = ids.fetch_add(1, Ordering::Relaxed);
    proto::encode(&ToAgent { id, req }, data, out).map_err(AgentError::RequestTooLarge)?;
    Ok(id)
}

/// One blocking connection to an agent.
#[derive(Debug)]
pub struct AgentConn {
    stream: UnixStream,
    codec: Codec,
    reply_timeout: Duration,
    /// Whether a read timeout is set on the socket now.
    timeout_set: bool,
}

/// A handle that can send requests on a connection from another thread
/// (stdin forwarding, signals); replies arrive on the connection.
#[derive(Debug)]
pub struct Sender {
    stream: UnixStream,
    ids: Arc<AtomicU64>,
}

impl Sender {
    pub fn send(&mut self, req: Request, data: &[u8]) -> Result<u64, AgentError> {
        let mut buf = Vec::with_capacity(64 + data.len());
        let id = encode_request(&self.ids, req, data, &mut buf)?;
        self.stream.write_all(&buf)?;
        Ok(id)
    }
}

impl AgentConn {
    pub fn connect(path: &Path) -> Result<AgentConn, AgentError> {
        Ok(AgentConn::from_stream(UnixStream::connect(path)?))
    }

    pub fn from_stream(stream: UnixStream) -> AgentConn {
        AgentConn { stream, codec: Codec::new(), reply_timeout: REPLY_TIMEOUT, timeout_set: false }
    }

    /// How long [`AgentConn::call`] waits for a reply.
    pub fn set_reply_timeout(&mut self, timeout: Duration) {
        self.reply_timeout = timeout;
    }

    pub fn sender(&self) -> Result<Sender, AgentError> {
        Ok(Sender { stream: self.stream.try_clone()?, ids: self.codec.ids.clone() })
    }

    /// Sends a request; its reply arrives later through [`AgentConn::recv`].
    pub fn send(&mut self, req: Request, data: &[u8]) -> Result<u64, AgentError> {
        let (id, bytes) = self.codec.request(req, data)?;
        self.stream.write_all(bytes)?;
        Ok(id)
    }

    /// Like [`AgentConn::call`], passing descriptors with the request
    /// (`SCM_RIGHTS` on its first bytes): [`Request::AddTenant`].
    pub fn call_with_fds(&mut self, req: Request, fds: &[std::os::fd::RawFd]) -> Result<(Reply, Vec<u8>), AgentError> {
        use std::os::fd::AsRawFd;
        let (id, bytes) = self.codec.request(req, &[])?;
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
        let mut control = vec![0u64; space.div_ceil(8)];
        let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
        // SAFETY: a zeroed msghdr is valid; every pointer set below outlives
        // the sendmsg call, and the control buffer is CMSG_SPACE bytes.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg) as *mut std::os::fd::RawFd, fds.len());
            libc::sendmsg(self.stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
        };
        if sent < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let rest = bytes[sent as usize..].to_vec();
        self.stream.write_all(&rest)?;
        self.wait_reply(id)
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
            let msg = self.read_message(Some(self.reply_timeout))?;
            if let Some(reply) = self.codec.take_reply(id, msg)? {
                return Ok(reply);
            }
        }
    }

    /// The next message: one kept by `call`, else one from the socket,
    /// waiting at most `timeout` (forever when `None`).
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Message, AgentError> {
        if let Some(m) = self.codec.pop_pending() {
            return Ok(m);
        }
        self.read_message(timeout)
    }

    fn read_message(&mut self, timeout: Option<Duration>) -> Result<Message, AgentError> {
        // One deadline for the whole frame: an agent that drips a byte at a
        // time must not hold the host longer than a silent one.
        let deadline = timeout.map(|t| (Instant::now() + t, t));
        loop {
            if let Some(m) = self.codec.decode()? {
                return Ok(m);
            }
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
            match self.stream.read(self.codec.read_buf()) {
                Ok(0) => return Err(AgentError::Closed),
                Ok(n) => self.codec.filled(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return Err(AgentError::Timeout(deadline.map(|d| d.1).unwrap_or_default()));
                }
                Err(e) => return Err(AgentError::Io(e)),
            }
        }
    }

    /// Checks the agent answers and speaks our protocol version.
    pub fn ping(&mut self) -> Result<u32, AgentError> {
        match self.call(Request::Ping, &[])? {
            (Reply::Pong { version }, _) => Ok(version),
            (other, _) => Err(AgentError::Unexpected(Box::new(other))),
        }
    }
}

/// Error messages from the agent are shown to users: keep them short, and
/// cut on a character boundary.
fn bounded(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_agent::proto::{ErrorCode, ExitStatus, Stream};

    fn frame(msg: &FromAgent, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        proto::encode(msg, data, &mut out).expect("encode");
        out
    }

    /// Feeds `bytes` to a codec `step` bytes at a time, as reads would.
    fn feed(codec: &mut Codec, bytes: &[u8], step: usize) -> Result<Vec<Message>, AgentError> {
        let mut out = Vec::new();
        let mut rest = bytes;
        loop {
            while let Some(m) = codec.decode()? {
                out.push(m);
            }
            if rest.is_empty() {
                return Ok(out);
            }
            let buf = codec.read_buf();
            let n = step.min(rest.len()).min(buf.len());
            buf[..n].copy_from_slice(&rest[..n]);
            codec.filled(n);
            rest = &rest[n..];
        }
    }

    #[test]
    fn frames_split_anywhere_decode_whole_and_in_order() {
        let mut bytes = frame(&FromAgent::Output { pid: 3, stream: Stream::Stdout }, &vec![7u8; 200_000]);
        bytes.extend(frame(&FromAgent::Exit { pid: 3, status: ExitStatus::exited(0) }, b""));
        for step in [1, 3, 4096, 1 << 20] {
            let mut codec = Codec::new();
            let msgs = feed(&mut codec, &bytes, step).expect("valid");
            assert_eq!(msgs.len(), 2, "step {step}");
            assert_eq!(msgs[0].1.len(), 200_000);
            assert!(matches!(msgs[1].0, FromAgent::Exit { pid: 3, .. }));
            assert!(codec.is_clean());
        }
    }

    #[test]
    fn an_oversized_length_is_refused_before_any_allocation() {
        let mut codec = Codec::new();
        let err = feed(&mut codec, &u32::MAX.to_le_bytes(), 4).expect_err("refused");
        assert!(matches!(err, AgentError::Protocol(proto::FrameError::BadLength(_))), "{err:?}");
        assert!(codec.rbuf.len() <= READ_CHUNK);
    }

    #[test]
    fn replies_are_matched_by_id_and_the_rest_is_kept_in_order() {
        let mut codec = Codec::new();
        let (id, _) = codec.request(Request::Ping, &[]).expect("encode");
        let out = (FromAgent::Output { pid: 1, stream: Stream::Stderr }, b"x".to_vec());
        assert!(codec.take_reply(id, out).expect("kept").is_none());
        let other = (FromAgent::Reply { id: id + 1, reply: Reply::Ok }, Vec::new());
        assert!(codec.take_reply(id, other).expect("kept").is_none());
        let pong = (FromAgent::Reply { id, reply: Reply::Pong { version: 1 } }, Vec::new());
        assert_eq!(codec.take_reply(id, pong).expect("answer"), Some((Reply::Pong { version: 1 }, Vec::new())));
        assert!(matches!(codec.pop_pending(), Some((FromAgent::Output { pid: 1, .. }, _))));
        assert!(matches!(codec.pop_pending(), Some((FromAgent::Reply { .. }, _))));
        assert!(codec.pop_pending().is_none());
    }

    #[test]
    fn refusals_carry_a_bounded_message_cut_on_a_character_boundary() {
        let mut codec = Codec::new();
        // A multi-byte character straddles the cut: it must not panic.
        let message = format!("{}é{}", "a".repeat(MAX_MESSAGE - 1), "b".repeat(5000));
        let reply = (FromAgent::Reply { id: 9, reply: Reply::Error { code: ErrorCode::Io, message } }, Vec::new());
        match codec.take_reply(9, reply) {
            Err(AgentError::Refused { code: ErrorCode::Io, message }) => {
                assert!(message.len() <= MAX_MESSAGE + '…'.len_utf8() && message.ends_with('…'), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unsolicited_messages_are_bounded() {
        let mut codec = Codec::new();
        for _ in 0..MAX_PENDING {
            let m = (FromAgent::Output { pid: 1, stream: Stream::Stdout }, Vec::new());
            codec.take_reply(1, m).expect("kept");
        }
        let m = (FromAgent::Output { pid: 1, stream: Stream::Stdout }, Vec::new());
        assert!(matches!(codec.take_reply(1, m), Err(AgentError::Protocol(_))));
    }

    #[test]
    fn a_request_too_large_for_a_frame_is_not_a_protocol_error() {
        let mut codec = Codec::new();
        let huge = Request::Stat { path: "x".repeat(proto::MAX_HEADER), user: None };
        assert!(matches!(codec.request(huge, &[]), Err(AgentError::RequestTooLarge(_))));
    }
}
