//! The host side of the agent link for async callers (the daemon): the
//! [`Codec`] of [`crate::agent`] over a tokio socket.
//!
//! One connection serves one caller at a time (an exec, a file operation);
//! callers open one per task, which costs a connect (tens of microseconds)
//! and keeps each command's output on its own stream.

use crate::agent::{AgentError, Codec, Message};
use hutch_agent::proto::{Reply, Request};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

pub use crate::agent::REPLY_TIMEOUT;

/// How long a connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Most descriptors [`AsyncConn::call_taking_fds`] keeps; more are closed
/// as they arrive.
pub const MAX_FDS: usize = 4;

#[derive(Debug)]
pub struct AsyncConn {
    stream: UnixStream,
    codec: Codec,
    /// While a [`AsyncConn::call_taking_fds`] runs: the descriptors
    /// received so far. Otherwise reads are plain, and the kernel closes
    /// any descriptor the agent sends.
    fds: Option<Vec<OwnedFd>>,
}

impl AsyncConn {
    pub async fn connect(path: &Path) -> Result<AsyncConn, AgentError> {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(path))
            .await
            .map_err(|_| AgentError::Timeout(CONNECT_TIMEOUT))??;
        Ok(AsyncConn { stream, codec: Codec::new(), fds: None })
    }

    /// Whether nothing unread is buffered: the connection can serve another
    /// caller.
    pub fn is_clean(&self) -> bool {
        self.codec.is_clean()
    }

    pub async fn send(&mut self, req: Request, data: &[u8]) -> Result<u64, AgentError> {
        let (id, bytes) = self.codec.request(req, data)?;
        self.stream.write_all(bytes).await?;
        Ok(id)
    }

    /// Sends a request and waits for its reply; other messages are kept for
    /// [`AsyncConn::recv`]. Error replies become [`AgentError::Refused`].
    pub async fn call(&mut self, req: Request, data: &[u8]) -> Result<(Reply, Vec<u8>), AgentError> {
        let id = self.send(req, data).await?;
        self.wait_reply(id).await
    }

    /// [`AsyncConn::call`], also answering every descriptor (SCM_RIGHTS)
    /// that came with the bytes read meanwhile, whatever message they came
    /// with: at most [`MAX_FDS`] of them (the rest closed), close-on-exec.
    /// They are untrusted: the caller checks how many there are and what
    /// each is, and closes them by dropping them.
    pub async fn call_taking_fds(
        &mut self,
        req: Request,
        data: &[u8],
    ) -> Result<(Reply, Vec<u8>, Vec<OwnedFd>), AgentError> {
        self.fds = Some(Vec::new());
        let r = self.call(req, data).await;
        let fds = self.fds.take().unwrap_or_default();
        r.map(|(reply, data)| (reply, data, fds))
    }

    pub async fn wait_reply(&mut self, id: u64) -> Result<(Reply, Vec<u8>), AgentError> {
        let deadline = tokio::time::Instant::now() + REPLY_TIMEOUT;
        loop {
            let msg = match tokio::time::timeout_at(deadline, self.read_message()).await {
                Ok(m) => m?,
                Err(_) => return Err(AgentError::Timeout(REPLY_TIMEOUT)),
            };
            if let Some(reply) = self.codec.take_reply(id, msg)? {
                return Ok(reply);
            }
        }
    }

    /// The next message, kept or read; waits as long as it takes (callers
    /// put their own deadline around it).
    pub async fn recv(&mut self) -> Result<Message, AgentError> {
        if let Some(m) = self.codec.pop_pending() {
            return Ok(m);
        }
        self.read_message().await
    }

    /// Cancel-safe: bytes read stay in the codec when the future is dropped.
    async fn read_message(&mut self) -> Result<Message, AgentError> {
        loop {
            if let Some(m) = self.codec.decode()? {
                return Ok(m);
            }
            let n = match self.fds.as_mut() {
                None => self.stream.read(self.codec.read_buf()).await?,
                Some(fds) => {
                    let buf = self.codec.read_buf();
                    let stream = &self.stream;
                    stream.async_io(Interest::READABLE, || recv_with_fds(stream.as_raw_fd(), buf, fds)).await?
                }
            };
            if n == 0 {
                return Err(AgentError::Closed);
            }
            self.codec.filled(n);
        }
    }
}

/// One `recvmsg` without blocking: bytes into `buf`, descriptors onto
/// `fds` (up to [`MAX_FDS`]; the kernel closes what does not fit the
/// control buffer, and those past the cap are closed here).
fn recv_with_fds(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    // Room for 16 descriptors, aligned for cmsghdr.
    let mut control = [0u64; 10];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg points at a buffer and a control buffer valid for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel filled msg_controllen bytes of control headers;
    // CMSG_FIRSTHDR/CMSG_NXTHDR stay within them, and each SCM_RIGHTS
    // header's data holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors, new in
    // this process and ours to own.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if fds.len() < MAX_FDS {
                        fds.push(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_agent::proto::{self, ErrorCode, FromAgent, ToAgent};
    use tokio::io::AsyncWriteExt;

    /// A fake agent on the other end of a socket pair: answers the first
    /// request with `reply`, after an unsolicited message.
    async fn fake_agent(mut peer: UnixStream, reply: Reply) {
        let mut buf = vec![0u8; 64 * 1024];
        let n = peer.read(&mut buf).await.expect("read request");
        let frame = proto::split_frame(&buf[..n]).expect("valid").expect("whole");
        let req: ToAgent = proto::parse_header(frame.header).expect("request");
        let mut out = Vec::new();
        let noise = FromAgent::Output { pid: 1, stream: proto::Stream::Stdout };
        proto::encode(&noise, b"early", &mut out).expect("encode");
        proto::encode(&FromAgent::Reply { id: req.id, reply }, &[], &mut out).expect("encode");
        // One byte at a time: the reader must reassemble the frames.
        for b in out {
            peer.write_all(&[b]).await.expect("write");
        }
    }

    #[tokio::test]
    async fn a_long_refusal_is_cut_without_a_panic_and_other_messages_wait() {
        let (ours, theirs) = UnixStream::pair().expect("pair");
        let message = format!("{}é{}", "a".repeat(1023), "b".repeat(3000));
        let agent = tokio::spawn(fake_agent(theirs, Reply::Error { code: ErrorCode::NotFound, message }));
        let mut conn = AsyncConn { stream: ours, codec: Codec::new(), fds: None };
        match conn.call(Request::Ping, &[]).await {
            Err(AgentError::Refused { code: ErrorCode::NotFound, message }) => assert!(message.ends_with('…')),
            other => panic!("{other:?}"),
        }
        let (msg, data) = conn.recv().await.expect("kept message");
        assert!(matches!(msg, FromAgent::Output { pid: 1, .. }) && data == b"early");
        assert!(conn.is_clean());
        agent.await.expect("fake agent");
    }
}
