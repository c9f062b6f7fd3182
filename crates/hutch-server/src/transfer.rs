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

/// Bytes of a request body read and dropped after its transfer ended early
/// (a refusal, a limit), so that the connection stays usable; past this
/// the connection is closed instead.
pub const DRAIN_LIMIT: u64 = 8 << 20;

/// A request body as a transfer's chunks: the returned future feeds them
/// (run it beside the transfer with [`with_feed`]); a body that fails
/// breaks the stream with `invalid_request`. Once the transfer stops
/// taking chunks, the rest of the body is read and dropped, up to
/// [`DRAIN_LIMIT`]; the future answers whether the body was read to its end.
pub fn chunks_of(body: Body) -> (Chunks, impl std::future::Future<Output = bool>) {
    let (tx, rx) = mpsc::channel(PIPE_DEPTH);
    let feed = async move {
        let mut stream = body.into_data_stream();
        let mut drained: Option<u64> = None;
        while let Some(chunk) =
            std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut stream), cx)).await
        {
            let Ok(chunk) = chunk else {
                let _ = tx.send(Err(FilesError::new(ErrorCode::InvalidRequest, "request body: it broke off"))).await;
                return false;
            };
            if let Some(n) = drained.as_mut() {
                *n += chunk.len() as u64;
                if *n > DRAIN_LIMIT {
                    return false;
                }
                continue;
            }
            if tx.send(Ok(chunk.to_vec())).await.is_err() {
                drained = Some(chunk.len() as u64);
            }
        }
        true
    };
    (rx, feed)
}

/// Runs `work` with `feed` beside it; once `work` ends, lets `feed` finish
/// (it drains what is left of a body, bounded). Answers the work's result
/// and whether the body was read to its end (if not, the connection must
/// close: see [`close_unless`]).
pub async fn with_feed<T>(
    feed: impl std::future::Future<Output = bool>,
    work: impl std::future::Future<Output = T>,
) -> (T, bool) {
    tokio::pin!(feed);
    tokio::pin!(work);
    let mut fed = None;
    let result = loop {
        tokio::select! {
            r = &mut work => break r,
            whole = &mut feed, if fed.is_none() => fed = Some(whole),
        }
    };
    let whole = match fed {
        Some(whole) => whole,
        None => feed.await,
    };
    (result, whole)
}

/// Runs a part's feed beside its transfer; the feed ends with the transfer.
pub async fn with_part<T>(
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

/// Bytes of a body read and dropped when its request is refused before the
/// body was looked at (a bad token or signature, bad parameters), and how
/// long that may take: as Go's net/http does, so that a client still
/// sending a small body reads the refusal rather than a reset connection
/// (closing a socket with unread bytes resets it, losing the answer).
pub const REFUSED_DRAIN_LIMIT: u64 = 256 << 10;
pub const REFUSED_DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// `resp` to `req`, refused before its body was looked at, once the body
/// has been read and dropped (at most [`REFUSED_DRAIN_LIMIT`] bytes within
/// [`REFUSED_DRAIN_TIME`]); `Connection: close` unless it ended. A client
/// that waits for `100 Continue` before sending its body is answered at
/// once (asking for the body would only make it send it).
pub async fn refuse(req: axum::extract::Request, resp: axum::response::Response) -> axum::response::Response {
    let waits = req
        .headers()
        .get(axum::http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let whole = !waits
        && tokio::time::timeout(REFUSED_DRAIN_TIME, drain(req.into_body(), REFUSED_DRAIN_LIMIT)).await.unwrap_or(false);
    close_unless(whole, resp)
}

/// Reads `body` to its end and drops it, unless it holds more than `limit`
/// bytes or breaks; answers whether it ended.
async fn drain(body: Body, limit: u64) -> bool {
    let mut stream = body.into_data_stream();
    let mut read = 0u64;
    while let Some(chunk) = std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut stream), cx)).await
    {
        let Ok(chunk) = chunk else { return false };
        read += chunk.len() as u64;
        if read > limit {
            return false;
        }
    }
    true
}

/// `Connection: close` on `resp` unless the request body was read whole:
/// a connection with unread body bytes cannot carry the next request.
pub fn close_unless(whole: bool, mut resp: axum::response::Response) -> axum::response::Response {
    if !whole {
        resp.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    }
    resp
}

/// What a form's body and its reader share: bytes handed to the parser,
/// bytes taken out as content, and the error that broke the body.
#[derive(Clone, Default)]
pub struct FormTap {
    taken: Arc<AtomicU64>,
    /// Bytes of the body handed to the parser so far.
    read: Arc<AtomicU64>,
    broken: Arc<Mutex<Option<FilesError>>>,
}

impl FormTap {
    /// Why the body broke, if it did: the error to report instead of the
    /// parser's own.
    pub fn broken(&self) -> Option<FilesError> {
        self.broken.lock().ok().and_then(|b| b.clone())
    }

    /// The error for a form the parser refused: why the body broke if it
    /// did, else the parser's reason with how much of the body it read (a
    /// form cut short by its sender reads as an early end, and the count
    /// tells that from framing that does not match).
    pub fn malformed(&self, e: axum::extract::multipart::MultipartError) -> FilesError {
        self.broken().unwrap_or_else(|| {
            let read = self.read.load(Ordering::Relaxed);
            FilesError::new(ErrorCode::InvalidRequest, format!("malformed form: {} ({read} bytes read)", e.body_text()))
        })
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
            Err(e) => Err(self.malformed(e)),
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
                self.tap.read.store(self.delivered, Ordering::Relaxed);
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

/// A JSON body `{"data": "<base64>"}` encoded from a transfer's chunks as
/// they come (the shape of `hutch_api::FileData` without a path); a stream
/// that breaks cuts the body short, so it never parses as a whole answer.
pub fn base64_json_of(rx: Chunks) -> Body {
    Body::from_stream(Base64Json { rx, carry: Vec::new(), state: Json::Start })
}

#[derive(PartialEq, Eq)]
enum Json {
    Start,
    Data,
    Done,
}

struct Base64Json {
    rx: Chunks,
    /// Bytes of the last chunk that did not fill a 3-byte group.
    carry: Vec<u8>,
    state: Json,
}

impl futures_core::Stream for Base64Json {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        use base64::Engine as _;
        let engine = base64::engine::general_purpose::STANDARD;
        match self.state {
            Json::Done => return Poll::Ready(None),
            Json::Start => {
                self.state = Json::Data;
                return Poll::Ready(Some(Ok(Bytes::from_static(b"{\"data\":\""))));
            }
            Json::Data => {}
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                let mut bytes = std::mem::take(&mut self.carry);
                bytes.extend_from_slice(&chunk);
                let whole = bytes.len() / 3 * 3;
                self.carry = bytes.split_off(whole);
                Poll::Ready(Some(Ok(Bytes::from(engine.encode(&bytes)))))
            }
            Poll::Ready(Some(Err(e))) => {
                self.state = Json::Done;
                Poll::Ready(Some(Err(std::io::Error::other(e.message))))
            }
            Poll::Ready(None) => {
                self.state = Json::Done;
                let mut tail = engine.encode(&self.carry).into_bytes();
                tail.extend_from_slice(b"\"}");
                Poll::Ready(Some(Ok(Bytes::from(tail))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::response::IntoResponse;
    use std::collections::VecDeque;

    /// A body arriving as these chunks (an error breaks it there).
    struct Parts(VecDeque<Result<Bytes, std::io::Error>>);

    impl futures_core::Stream for Parts {
        type Item = Result<Bytes, std::io::Error>;

        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    fn chunked(parts: Vec<Result<&'static [u8], std::io::Error>>) -> Body {
        Body::from_stream(Parts(parts.into_iter().map(|p| p.map(Bytes::from_static)).collect()))
    }

    fn request(body: Body) -> axum::extract::Request {
        axum::extract::Request::new(body)
    }

    fn unauthorized() -> axum::response::Response {
        axum::http::StatusCode::UNAUTHORIZED.into_response()
    }

    #[tokio::test]
    async fn a_refusal_drains_a_small_body_and_keeps_the_connection() {
        let resp = refuse(request(chunked(vec![Ok(b"abc"), Ok(b"def")])), unauthorized()).await;
        assert_eq!(resp.status(), axum::http::StatusCode::UNAUTHORIZED);
        assert!(resp.headers().get(axum::http::header::CONNECTION).is_none());
        assert!(refuse(request(Body::empty()), unauthorized()).await.headers().get("connection").is_none());
    }

    #[tokio::test]
    async fn a_refusal_closes_past_its_limit_a_broken_body_or_an_awaited_continue() {
        static BIG: [u8; 1 << 16] = [7; 1 << 16];
        let big = chunked((0..5).map(|_| Ok(&BIG[..])).collect());
        let resp = refuse(request(big), unauthorized()).await;
        assert_eq!(resp.headers()[axum::http::header::CONNECTION], "close");
        assert!(drain(chunked(vec![Ok(b"1234")]), 4).await);
        assert!(!drain(chunked(vec![Ok(b"12345")]), 4).await);
        assert!(!drain(chunked(vec![Ok(b"12"), Err(std::io::Error::other("cut"))]), 4).await);
        // The client sends nothing until it is told to: not asked, and closed.
        let mut waits = request(chunked(vec![Ok(b"abc")]));
        waits.headers_mut().insert(axum::http::header::EXPECT, axum::http::HeaderValue::from_static("100-Continue"));
        assert_eq!(refuse(waits, unauthorized()).await.headers()[axum::http::header::CONNECTION], "close");
    }

    /// A form that ends before its closing boundary is refused with the
    /// parser's reason and how many bytes it read.
    #[tokio::test]
    async fn a_form_cut_short_says_how_much_was_read() {
        let body: &[u8] = b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\none";
        let (tx, rx) = mpsc::channel(PIPE_DEPTH);
        tx.send(Ok(body.to_vec())).await.expect("send");
        drop(tx);
        let tap = FormTap::default();
        let mut req = axum::extract::Request::new(tap.body(rx));
        req.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("multipart/form-data; boundary=b0undary"),
        );
        use axum::extract::FromRequest;
        let mut form = axum::extract::Multipart::from_request(req, &()).await.expect("a form");
        let field = form.next_field().await.expect("its first part").expect("a part");
        let (mut chunks, feed) = tap.part(field);
        let collect = async {
            while let Some(c) = chunks.recv().await {
                c?;
            }
            Ok::<(), FilesError>(())
        };
        let err = with_part(feed, collect).await.expect_err("cut short");
        assert_eq!(err.code, ErrorCode::InvalidRequest);
        assert!(err.message.starts_with("malformed form: "), "{}", err.message);
        assert!(err.message.ends_with(&format!("({} bytes read)", body.len())), "{}", err.message);
    }

    /// A form whose body arrives cut at any two points reads whole: the
    /// tap, the parser and a part's feed lose and reorder nothing, however
    /// the boundaries and the content fall across chunks.
    #[tokio::test]
    async fn a_form_reads_whole_however_its_body_is_split() {
        let content: &[u8] = b"\nimport http.server\r\nprint('hi')\r\n";
        let mut body = Vec::new();
        body.extend_from_slice(b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/e.py\"\r\nContent-Type: text/x-python\r\n\r\n");
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n--b0undary--\r\n");
        let n = body.len();
        for i in 0..=n {
            for j in i..=n {
                let pieces = [&body[..i], &body[i..j], &body[j..]];
                let (tx, rx) = mpsc::channel(PIPE_DEPTH);
                let feed = {
                    let pieces: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
                    async move {
                        for p in pieces {
                            if !p.is_empty() {
                                let _ = tx.send(Ok(p)).await;
                            }
                            tokio::task::yield_now().await;
                        }
                    }
                };
                let tap = FormTap::default();
                let mut req = axum::extract::Request::new(tap.body(rx));
                req.headers_mut().insert(
                    axum::http::header::CONTENT_TYPE,
                    axum::http::HeaderValue::from_static("multipart/form-data; boundary=b0undary"),
                );
                let read = async {
                    use axum::extract::FromRequest;
                    let mut form = axum::extract::Multipart::from_request(req, &()).await.expect("a form");
                    let mut got = Vec::new();
                    while let Some(field) = form.next_field().await.map_err(|e| e.body_text())? {
                        let (mut chunks, feed) = tap.part(field);
                        let collect = async {
                            let mut out = Vec::new();
                            while let Some(c) = chunks.recv().await {
                                out.extend(c.map_err(|e| e.message)?);
                            }
                            Ok::<_, String>(out)
                        };
                        got.push(with_part(feed, collect).await?);
                    }
                    Ok::<_, String>(got)
                };
                let ((), got) = tokio::join!(feed, read);
                assert_eq!(got, Ok(vec![content.to_vec()]), "split at {i} and {j}");
            }
        }
    }
}
