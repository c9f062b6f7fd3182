//! Bounded pipes between the async side of a transfer and the thread that
//! parses or inflates it.
//!
//! Parsing a tar and inflating gzip are blocking code over `Read`, and they
//! wait on the client's bytes. They run on a thread of their own per
//! transfer (not tokio's blocking pool: a slow client would hold one of its
//! threads for as long as it likes, and enough of them would stall every
//! other use of the pool), fed through channels of a few chunks, so a
//! transfer holds a few MiB whatever it carries, and the async workers
//! never run a decoder.

use std::io::{self, Read};

use hutch_api::ErrorCode;
use tokio::sync::{mpsc, oneshot};

use super::FilesError;

/// Chunks of a transfer: bytes, or why the stream broke (a body that failed,
/// a limit passed). A sender that ends without an error ends the stream.
pub type Chunks = mpsc::Receiver<Result<Vec<u8>, FilesError>>;

/// Chunks in flight per pipe.
pub const PIPE_DEPTH: usize = 4;
/// Bytes a decoder hands on at a time.
pub const PIPE_CHUNK: usize = 256 << 10;

/// A blocking reader over [`Chunks`]: for a dedicated thread only (it
/// blocks on the channel). A broken stream reads as an IO error, and the
/// [`FilesError`] that broke it is kept for [`ChannelReader::error`].
pub struct ChannelReader {
    rx: Chunks,
    cur: Vec<u8>,
    pos: usize,
    error: Option<FilesError>,
}

impl ChannelReader {
    pub fn new(rx: Chunks) -> ChannelReader {
        ChannelReader { rx, cur: Vec::new(), pos: 0, error: None }
    }

    /// What broke the stream, if its sender said.
    pub fn error(&self) -> Option<FilesError> {
        self.error.clone()
    }
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.pos == self.cur.len() {
            if self.error.is_some() {
                return Err(io::Error::other("the stream broke"));
            }
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(chunk)) => {
                    self.cur = chunk;
                    self.pos = 0;
                }
                Some(Err(e)) => {
                    let msg = e.message.clone();
                    self.error = Some(e);
                    return Err(io::Error::other(msg));
                }
            }
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// A blocking writer into [`Chunks`], for a dedicated thread only: bytes
/// go out in chunks of [`PIPE_CHUNK`] as the receiver takes them, so a
/// writer of any size holds one chunk. A receiver gone (the client left)
/// reads as a broken pipe.
pub struct ChunkWriter {
    tx: mpsc::Sender<Result<Vec<u8>, FilesError>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    /// A writer and the chunks it sends.
    pub fn new() -> (ChunkWriter, Chunks) {
        let (tx, rx) = mpsc::channel(PIPE_DEPTH);
        (ChunkWriter { tx, buf: Vec::with_capacity(PIPE_CHUNK) }, rx)
    }

    /// Breaks the stream with `e` (what was written before it is sent).
    pub fn fail(mut self, e: FilesError) {
        let _ = io::Write::flush(&mut self);
        let _ = self.tx.blocking_send(Err(e));
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(PIPE_CHUNK));
        self.tx.blocking_send(Ok(chunk)).map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the reader went away"))
    }
}

impl io::Write for ChunkWriter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = b.len().min(PIPE_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&b[..n]);
        if self.buf.len() == PIPE_CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// Runs `f` on a thread of its own named `name`; its answer arrives on
/// the returned channel (closed without one if it panicked).
pub fn spawn_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<oneshot::Receiver<T>, FilesError> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .stack_size(1 << 20)
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| FilesError::new(ErrorCode::Internal, format!("starting a {name} thread: {e}")))?;
    Ok(rx)
}

/// Caps a stream at `cap` bytes: past it, the stream breaks with
/// `payload_too_large`, naming `what`.
pub fn cap(mut input: Chunks, cap: u64, what: &'static str) -> Chunks {
    let (tx, rx) = mpsc::channel(PIPE_DEPTH);
    tokio::spawn(async move {
        let mut total = 0u64;
        while let Some(item) = input.recv().await {
            let item = item.and_then(|c| {
                total += c.len() as u64;
                if total > cap {
                    Err(FilesError::new(ErrorCode::PayloadTooLarge, format!("{what} exceeds {cap} bytes")))
                } else {
                    Ok(c)
                }
            });
            let stop = item.is_err();
            if tx.send(item).await.is_err() || stop {
                return;
            }
        }
    });
    rx
}

/// Inflates a gzip stream (one or more members) on a thread of its own, in
/// chunks of [`PIPE_CHUNK`] bytes; more than `cap` bytes out breaks the
/// stream with `payload_too_large` (a gzip bomb stops there, having cost a
/// bounded buffer and the time to inflate `cap` bytes at the pace the
/// receiver takes them). Malformed gzip breaks it with `invalid_request`.
pub fn inflate(input: Chunks, cap: u64) -> Result<Chunks, FilesError> {
    let (tx, rx) = mpsc::channel(PIPE_DEPTH);
    let done = spawn_thread("hutch-gunzip", move || {
        let mut reader = flate2::read::MultiGzDecoder::new(ChannelReader::new(input));
        let mut total = 0u64;
        loop {
            let mut buf = vec![0u8; PIPE_CHUNK];
            let n = match read_full(&mut reader, &mut buf) {
                Ok(n) => n,
                Err(e) => {
                    let err = reader.get_ref().error().unwrap_or_else(|| {
                        FilesError::new(ErrorCode::InvalidRequest, format!("the gzip body is malformed: {e}"))
                    });
                    let _ = tx.blocking_send(Err(err));
                    return;
                }
            };
            if n == 0 {
                return;
            }
            total += n as u64;
            if total > cap {
                let err = FilesError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("the gzip body inflates to more than {cap} bytes"),
                );
                let _ = tx.blocking_send(Err(err));
                return;
            }
            buf.truncate(n);
            if tx.blocking_send(Ok(buf)).is_err() {
                return;
            }
        }
    })?;
    drop(done);
    Ok(rx)
}

/// Fills `buf` from `r` unless the stream ends first; the bytes read.
pub fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The chunks of `data`, for callers that hold bytes already (tests, small
/// bodies).
pub fn from_bytes(data: Vec<u8>, chunk: usize) -> Chunks {
    let (tx, rx) = mpsc::channel(PIPE_DEPTH);
    tokio::spawn(async move {
        if data.is_empty() {
            return;
        }
        for c in data.chunks(chunk.max(1)) {
            if tx.send(Ok(c.to_vec())).await.is_err() {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    async fn collect(mut rx: Chunks) -> Result<Vec<u8>, FilesError> {
        let mut out = Vec::new();
        while let Some(c) = rx.recv().await {
            out.extend(c?);
        }
        Ok(out)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_writer_sends_what_is_written_in_bounded_chunks_and_its_failure() {
        let (mut w, mut rx) = ChunkWriter::new();
        let data: Vec<u8> = (0..3 * PIPE_CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&sent).expect("write");
            w.fail(FilesError::new(ErrorCode::Internal, "stopped"));
        });
        let mut got = Vec::new();
        let mut err = None;
        while let Some(c) = rx.recv().await {
            match c {
                Ok(c) => {
                    assert!(c.len() <= PIPE_CHUNK, "{}", c.len());
                    got.extend(c);
                }
                Err(e) => err = Some(e.message),
            }
        }
        writer.join().expect("writer");
        assert_eq!(got, data);
        assert_eq!(err.as_deref(), Some("stopped"));
        // A reader gone is a broken pipe to the writer, not a hang.
        let (mut w, rx) = ChunkWriter::new();
        drop(rx);
        let e = std::thread::spawn(move || w.write_all(&vec![0u8; 2 * PIPE_CHUNK]).and_then(|()| w.flush()))
            .join()
            .expect("writer");
        assert_eq!(e.expect_err("broken").kind(), io::ErrorKind::BrokenPipe);
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(data).expect("gzip");
        gz.finish().expect("gzip")
    }

    #[tokio::test]
    async fn inflation_round_trips_in_bounded_chunks() {
        let data: Vec<u8> = (0..3 * PIPE_CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let mut rx = inflate(from_bytes(gzip(&data), 1000), 1 << 30).expect("inflate");
        let mut out = Vec::new();
        while let Some(c) = rx.recv().await {
            let c = c.expect("chunk");
            assert!(c.len() <= PIPE_CHUNK);
            out.extend(c);
        }
        assert_eq!(out, data);
    }

    #[tokio::test]
    async fn a_gzip_bomb_stops_at_the_cap_as_too_large() {
        let bomb = gzip(&vec![0u8; 8 << 20]);
        let e = collect(inflate(from_bytes(bomb, 4096), 1 << 20).expect("inflate")).await.expect_err("over the cap");
        assert_eq!(e.code, ErrorCode::PayloadTooLarge, "{e}");
    }

    #[tokio::test]
    async fn malformed_gzip_is_invalid_and_a_broken_input_keeps_its_error() {
        let e = collect(inflate(from_bytes(b"\x1f\x8bnot gzip at all".to_vec(), 4), 1 << 20).expect("inflate"))
            .await
            .expect_err("malformed");
        assert_eq!(e.code, ErrorCode::InvalidRequest, "{e}");
        let (tx, rx) = mpsc::channel(2);
        let data = gzip(b"hello");
        tx.send(Ok(data[..4].to_vec())).await.expect("send");
        tx.send(Err(FilesError::new(ErrorCode::PayloadTooLarge, "wire cap"))).await.expect("send");
        drop(tx);
        let e = collect(inflate(rx, 1 << 20).expect("inflate")).await.expect_err("broken");
        assert_eq!((e.code, e.message.as_str()), (ErrorCode::PayloadTooLarge, "wire cap"));
    }

    #[tokio::test]
    async fn a_capped_stream_breaks_past_its_cap() {
        assert_eq!(collect(cap(from_bytes(vec![1; 100], 7), 100, "x")).await.expect("at the cap").len(), 100);
        let e = collect(cap(from_bytes(vec![1; 101], 7), 100, "x")).await.expect_err("over");
        assert_eq!(e.code, ErrorCode::PayloadTooLarge);
    }
}
