//! Request and response bodies of file transfers as bounded streams of
//! chunks ([`Chunks`]), for the native file routes and E2B's `/files`:
//! a body in, a body out, and a multipart form read one part at a time with
//! a bound on what its parser may hold. No body is ever held whole.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::multipart::Field;
use hutch_api::ErrorCode;
use hutch_control::files::pipe::PIPE_DEPTH;
use hutch_control::files::{Chunks, FilesError};
use tokio::sync::mpsc;

/// Bytes a multipart parser may hold that have not come out as a part's
/// content: its framing (boundaries, a part's headers) plus what is in
/// flight. A part whose headers never end stops here, not at the body's cap.
pub const FORM_SLACK: u64 = 8 << 20;

/// A response body from a transfer's chunks; a stream that breaks aborts
/// the body (the client sees a truncated response, never a complete wrong
/// one).
pub fn body_of(rx: Chunks) -> Body {
    Body::from_stream(ChunkStream(rx))
}

struct ChunkStream(Chunks);

impl futures_core::Stream for ChunkStream {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|item| item.map(|r| r.map(Bytes::from).map_err(|e| std::io::Error::other(e.message))))
    }
}

/// A request body as a transfer's chunks: the returned future feeds them
/// (run it beside the transfer with [`with_feed`]); a body that fails
/// breaks the stream with `invalid_request`.
pub fn chunks_of(body: Body) -> (Chunks, impl std::future::Future<Output = ()>) {
    let (tx, rx) = mpsc::channel(PIPE_DEPTH);
    let feed = async move {
        let mut stream = body.into_data_stream();
        while let Some(chunk) =
            std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut stream), cx)).await
        {
            let item = chunk
                .map(|b| b.to_vec())
                .map_err(|e| FilesError::new(ErrorCode::InvalidRequest, format!("request body: {e}")));
            let stop = item.is_err();
            if tx.send(item).await.is_err() || stop {
                return;
            }
        }
    };
    (rx, feed)
}

/// Runs `work` with `feed` beside it until `work` ends; then `feed` is
/// dropped (so a transfer that stopped early never waits on a client).
pub async fn with_feed<T>(
    feed: impl std::future::Future<Output = ()>,
    work: impl std::future::Future<Output = T>,
) -> T {
    tokio::pin!(feed);
    tokio::pin!(work);
    let mut fed = false;
    loop {
        tokio::select! {
            r = &mut work => return r,
            () = &mut feed, if !fed => fed = true,
        }
    }
}

/// What a form's body and its reader share: bytes handed to the parser,
/// bytes taken out as content, and the error that broke the body.
#[derive(Clone, Default)]
pub struct FormTap {
    taken: Arc<AtomicU64>,
    broken: Arc<Mutex<Option<FilesError>>>,
}

impl FormTap {
    /// Why the body broke, if it did: the error to report instead of the
    /// parser's own.
    pub fn broken(&self) -> Option<FilesError> {
        self.broken.lock().ok().and_then(|b| b.clone())
    }

    fn record(&self, e: FilesError) -> std::io::Error {
        let err = std::io::Error::other(e.message.clone());
        if let Ok(mut b) = self.broken.lock() {
            b.get_or_insert(e);
        }
        err
    }

    /// A body for a multipart parser, fed from `rx`, that breaks when the
    /// parser holds more than [`FORM_SLACK`] bytes that did not come out as
    /// content (read every part's content through [`FormTap::chunk`],
    /// including parts that are skipped).
    pub fn body(&self, rx: Chunks) -> Body {
        Body::from_stream(FormBody { rx, delivered: 0, tap: self.clone() })
    }

    /// The next chunk of a part's content, counted.
    pub async fn chunk(&self, field: &mut Field<'_>) -> Result<Option<Bytes>, FilesError> {
        match field.chunk().await {
            Ok(Some(c)) => {
                self.taken.fetch_add(c.len() as u64, Ordering::Relaxed);
                Ok(Some(c))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.broken().unwrap_or_else(|| {
                FilesError::new(ErrorCode::InvalidRequest, format!("malformed form: {}", e.body_text()))
            })),
        }
    }

    /// A part's content as a transfer's chunks, and the future that feeds
    /// them (run it beside the transfer with [`with_feed`]).
    pub fn part<'f, 'a>(
        &'f self,
        mut field: Field<'a>,
    ) -> (Chunks, impl std::future::Future<Output = ()> + use<'f, 'a>) {
        let (tx, rx) = mpsc::channel(PIPE_DEPTH);
        let feed = async move {
            loop {
                let item = match self.chunk(&mut field).await {
                    Ok(Some(c)) => Ok(c.to_vec()),
                    Ok(None) => return,
                    Err(e) => Err(e),
                };
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    return;
                }
            }
        };
        (rx, feed)
    }

    /// Reads a part that is skipped, counted; or a small one (at most
    /// `max` bytes) as text.
    pub async fn text(&self, mut field: Field<'_>, max: usize) -> Result<String, FilesError> {
        let mut out = Vec::new();
        while let Some(c) = self.chunk(&mut field).await? {
            if out.len() + c.len() > max {
                return Err(FilesError::new(ErrorCode::InvalidRequest, format!("a form field is over {max} bytes")));
            }
            out.extend_from_slice(&c);
        }
        String::from_utf8(out).map_err(|_| FilesError::new(ErrorCode::InvalidRequest, "a form field is not UTF-8"))
    }

    /// Reads a part to its end, counted, keeping nothing.
    pub async fn skip(&self, mut field: Field<'_>) -> Result<(), FilesError> {
        while self.chunk(&mut field).await?.is_some() {}
        Ok(())
    }
}

struct FormBody {
    rx: Chunks,
    delivered: u64,
    tap: FormTap,
}

impl futures_core::Stream for FormBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                self.delivered += chunk.len() as u64;
                let held = self.delivered.saturating_sub(self.tap.taken.load(Ordering::Relaxed));
                if held > FORM_SLACK + chunk.len() as u64 {
                    let e = FilesError::new(
                        ErrorCode::InvalidRequest,
                        format!(
                            "malformed form: more than {FORM_SLACK} bytes of framing (a part's headers do not end)"
                        ),
                    );
                    return Poll::Ready(Some(Err(self.tap.record(e))));
                }
                Poll::Ready(Some(Ok(Bytes::from(chunk))))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(self.tap.record(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}
