//! One client connection: its partial input frame and its outgoing buffer,
//! with the water marks that drive backpressure.

use std::os::fd::{AsFd, OwnedFd};

use super::sys::{self, Errno};

/// Above this many unsent bytes a connection is congested: the agent stops
/// reading its requests and the pipes of the processes it follows.
pub const HIGH_WATER: usize = 8 * 1024 * 1024;
/// A congested connection is relieved once it is down to this.
pub const LOW_WATER: usize = 2 * 1024 * 1024;
/// A connection holding more than this is dropped.
pub const HARD_CAP: usize = 64 * 1024 * 1024;

pub struct Conn {
    pub fd: OwnedFd,
    /// Bytes of a frame not yet complete.
    pub input: Vec<u8>,
    out: Vec<u8>,
    /// How much of `out` was already sent.
    sent: usize,
    /// Events registered with epoll.
    pub events: u32,
    pub congested: bool,
    /// Queued in the agent's list of connections to flush.
    pub dirty: bool,
    /// Being closed: nothing more is read or sent.
    pub closing: bool,
    /// Complete requests in `input` wait until the replies drain.
    pub held: bool,
    /// The tenant this connection belongs to (accepted on its socket).
    pub tenant: Option<u64>,
    /// Descriptors the host passed, for the request they came with.
    pub fds: Vec<OwnedFd>,
}

impl Conn {
    pub fn new(fd: OwnedFd) -> Conn {
        Conn {
            fd,
            input: Vec::new(),
            out: Vec::new(),
            sent: 0,
            events: 0,
            congested: false,
            dirty: false,
            closing: false,
            held: false,
            tenant: None,
            fds: Vec::new(),
        }
    }

    pub fn pending(&self) -> usize {
        self.out.len() - self.sent
    }

    /// The buffer new frames are appended to.
    pub fn out_buf(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Sends as much as the socket takes; `Err` means the peer is gone.
    pub fn flush(&mut self) -> Result<(), Errno> {
        while self.sent < self.out.len() {
            match sys::send(self.fd.as_fd(), &self.out[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(Errno(libc::EAGAIN)) => break,
                Err(Errno(libc::EINTR)) => {}
                Err(e) => return Err(e),
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
            if self.out.capacity() > HIGH_WATER {
                self.out.shrink_to(64 * 1024);
            }
        } else if self.sent > 1024 * 1024 && self.sent * 2 > self.out.len() {
            self.out.drain(..self.sent);
            self.sent = 0;
        }
        Ok(())
    }

    /// Updates `congested` from the water marks; true when it changed.
    pub fn update_congestion(&mut self) -> bool {
        let was = self.congested;
        if self.pending() > HIGH_WATER {
            self.congested = true;
        } else if self.pending() <= LOW_WATER {
            self.congested = false;
        }
        was != self.congested
    }

    /// The epoll events this connection wants now.
    pub fn wanted_events(&self) -> u32 {
        let mut ev = 0;
        if !self.congested {
            ev |= libc::EPOLLIN as u32;
        }
        if self.pending() > 0 {
            ev |= libc::EPOLLOUT as u32;
        }
        ev
    }
}
