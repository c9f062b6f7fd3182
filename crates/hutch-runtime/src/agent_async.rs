//! The host side of the agent link for async callers (the daemon): the same
//! validation as [`crate::agent::AgentConn`] over a tokio socket.
//!
//! One connection serves one caller at a time (an exec, a file operation);
//! callers open one per task, which costs a connect (tens of microseconds)
//! and keeps each command's output on its own stream.

use crate::agent::{AgentError, Message};
use hutch_agent::proto::{self, FromAgent, Reply, Request, ToAgent};
use std::collections::VecDeque;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// How long the agent has to answer a request.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct AsyncConn {
    stream: UnixStream,
    next_id: u64,
    pending: VecDeque<Message>,
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    wbuf: Vec<u8>,
}

impl AsyncConn {
    pub async fn connect(path: &Path) -> Result<AsyncConn, AgentError> {
        let stream = tokio::time::timeout(Duration::from_secs(5), UnixStream::connect(path))
            .await
            .map_err(|_| AgentError::Timeout(Duration::from_secs(5)))??;
        Ok(AsyncConn {
            stream,
            next_id: 1,
            pending: VecDeque::new(),
            rbuf: vec![0; 64 * 1024],
            rpos: 0,
            rend: 0,
            wbuf: Vec::new(),
        })
    }

    /// Whether nothing unread is buffered: the connection can serve another
    /// caller.
    pub fn is_clean(&self) -> bool {
        self.pending.is_empty() && self.rpos == self.rend
    }

    pub async fn send(&mut self, req: Request, data: &[u8]) -> Result<u64, AgentError> {
        let id = self.next_id;
        self.next_id += 1;
        self.wbuf.clear();
        proto::encode(&ToAgent { id, req }, data, &mut self.wbuf)?;
        self.stream.write_all(&self.wbuf).await?;
        Ok(id)
    }

    /// Sends a request and waits for its reply; other messages are kept for
    /// [`AsyncConn::recv`]. Error replies become [`AgentError::Refused`].
    pub async fn call(&mut self, req: Request, data: &[u8]) -> Result<(Reply, Vec<u8>), AgentError> {
        let id = self.send(req, data).await?;
        self.wait_reply(id).await
    }

    pub async fn wait_reply(&mut self, id: u64) -> Result<(Reply, Vec<u8>), AgentError> {
        let deadline = tokio::time::Instant::now() + REPLY_TIMEOUT;
        loop {
            let (msg, data) = match tokio::time::timeout_at(deadline, self.read_message()).await {
                Ok(m) => m?,
                Err(_) => return Err(AgentError::Timeout(REPLY_TIMEOUT)),
            };
            match msg {
                FromAgent::Reply { id: got, reply } if got == id => {
                    if let Reply::Error { code, message } = reply {
                        let mut message = message;
                        message.truncate(1024);
                        return Err(AgentError::Refused { code, message });
                    }
                    return Ok((reply, data));
                }
                other => {
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

    /// The next message, kept or read; waits as long as it takes (callers
    /// put their own deadline around it).
    pub async fn recv(&mut self) -> Result<Message, AgentError> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(m);
        }
        self.read_message().await
    }

    async fn read_message(&mut self) -> Result<Message, AgentError> {
        self.fill(4).await?;
        let w = &self.rbuf[self.rpos..self.rpos + 4];
        let len = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        proto::check_len(len)?;
        self.fill(4 + len as usize).await?;
        let raw = proto::split_frame(&self.rbuf[self.rpos..self.rend])?.ok_or(proto::FrameError::BadLength(len))?;
        let msg: FromAgent = proto::parse_header(raw.header)?;
        let data = raw.data.to_vec();
        self.rpos += raw.consumed;
        Ok((msg, data))
    }

    async fn fill(&mut self, want: usize) -> Result<(), AgentError> {
        if self.rend - self.rpos >= want {
            return Ok(());
        }
        self.rbuf.copy_within(self.rpos..self.rend, 0);
        self.rend -= self.rpos;
        self.rpos = 0;
        if self.rbuf.len() < want {
            self.rbuf.resize(want, 0);
        }
        while self.rend < want {
            let n = self.stream.read(&mut self.rbuf[self.rend..]).await?;
            if n == 0 {
                return Err(AgentError::Closed);
            }
            self.rend += n;
        }
        Ok(())
    }
}
