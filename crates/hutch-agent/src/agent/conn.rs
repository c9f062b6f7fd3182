//! One client connection: its partial input frame and its outgoing buffer,
//! with the water marks that drive backpressure.

use std::collections::VecDeque;
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
    /// Descriptors to pass, each with the position in `out` of the byte it
    /// goes with (the first of a reply's frame), in order.
    passing: VecDeque<(usize, OwnedFd)>,
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
    pub received: Vec<OwnedFd>,
}

impl Conn {
    pub fn new(fd: OwnedFd) -> Conn {
        Conn {
            fd,
            input: Vec::new(),
            out: Vec::new(),
            sent: 0,
            passing: VecDeque::new(),
            events: 0,
            congested: false,
            dirty: false,
            closing: false,
            held: false,
            tenant: None,
            received: Vec::new(),
        }
    }

    pub fn pending(&self) -> usize {
        self.out.len() - self.sent
    }

    /// The buffer new frames are appended to.
    pub fn out_buf(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Passes `fd` with the next byte appended to the output (a reply's
    /// frame, appended next).
    pub fn pass_fd(&mut self, fd: OwnedFd) {
        self.passing.push_back((self.out.len(), fd));
    }

    /// Sends as much as the socket takes; `Err` means the peer is gone.
    /// A descriptor to pass goes with its byte, in a send of its own.
    pub fn flush(&mut self) -> Result<(), Errno> {
        while self.sent < self.out.len() {
            let (end, pass) = match self.passing.front() {
                Some((at, fd)) if *at <= self.sent => {
                    (self.passing.get(1).map_or(self.out.len(), |(next, _)| *next), Some(fd.as_fd()))
                }
                Some((at, _)) => (*at, None),
                None => (self.out.len(), None),
            };
            let passing = pass.is_some();
            let chunk = &self.out[self.sent..end.max(self.sent + 1).min(self.out.len())];
            let r = match pass {
                Some(p) => sys::send_with_fd(self.fd.as_fd(), chunk, p),
                None => sys::send(self.fd.as_fd(), chunk),
            };
            match r {
                Ok(n) => {
                    if passing && n > 0 {
                        // Sent: the peer holds it now; ours closes.
                        self.passing.pop_front();
                    }
                    self.sent += n;
                }
                Err(Errno(libc::EAGAIN)) => break,
                Err(Errno(libc::EINTR)) => {}
                Err(e) => return Err(e),
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
            self.passing.clear();
            if self.out.capacity() > HIGH_WATER {
                self.out.shrink_to(64 * 1024);
            }
        } else if self.sent > 1024 * 1024 && self.sent * 2 > self.out.len() {
            self.out.drain(..self.sent);
            for (at, _) in self.passing.iter_mut() {
                *at -= self.sent;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd};

    /// Reads what is there, and the descriptors that came with it.
    fn recv(fd: &OwnedFd) -> (Vec<u8>, Vec<OwnedFd>) {
        let mut buf = vec![0u8; 256];
        let mut control = [0u64; 8];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: msghdr is plain data; the pointers outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        // SAFETY: msg points at live buffers.
        let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        assert!(n >= 0, "recvmsg");
        buf.truncate(n as usize);
        let mut fds = Vec::new();
        // SAFETY: the kernel filled the control headers walked here.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        (buf, fds)
    }

    #[test]
    fn a_passed_descriptor_goes_with_the_first_byte_of_its_frame() {
        let mut pair = [0; 2];
        // SAFETY: socketpair fills two descriptors we then own.
        assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, pair.as_mut_ptr()) }, 0);
        // SAFETY: both are new descriptors of ours.
        let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };
        let mut c = Conn::new(ours);
        c.out_buf().extend_from_slice(b"before");
        let passed = sys::open(c"/", libc::O_PATH | libc::O_DIRECTORY).expect("open /");
        c.pass_fd(passed);
        c.out_buf().extend_from_slice(b"frame");
        c.flush().expect("flush");
        assert_eq!(c.pending(), 0);
        assert!(c.passing.is_empty(), "the sent descriptor is closed on our side");
        // It arrives with a read that takes its frame's first byte (the
        // kernel may join the bytes before it into the same read), never
        // with one that ends before.
        let mut got = Vec::new();
        let mut passed = Vec::new();
        while got.len() < b"beforeframe".len() {
            let (bytes, fds) = recv(&theirs);
            got.extend(bytes);
            if !fds.is_empty() {
                assert!(got.len() > b"before".len(), "the descriptor came before its frame");
            }
            passed.extend(fds);
        }
        assert_eq!((got.as_slice(), passed.len()), (&b"beforeframe"[..], 1));
    }
}
