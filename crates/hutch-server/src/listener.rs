//! The daemon's listener: accepts connections, serves HTTP/1.1 on them (with
//! upgrades, for the port proxy's WebSockets), and bounds what clients that
//! have not authenticated can hold, so that no flood of connections starves
//! the daemon of descriptors or memory.
//!
//! A connection is *waiting* while no request is answered on it (just
//! accepted, a head half sent, or idle between requests), *busy* while one
//! is (its response body included, so event streams and downloads are busy
//! for as long as they last), and *upgraded* once the port proxy joined it
//! to a sandbox. It is *authenticated* once a request on it passed an API
//! key, an E2B token or a port grant ([`authenticated`]).
//!
//! - A waiting connection must deliver a request head within the header
//!   timeout (counted from the accept, or from the first byte after an idle
//!   pause) and is closed after the idle timeout without one. Busy and
//!   upgraded connections are never timed out: a stream lives as long as
//!   its request does.
//! - One client (an IPv4 address, an IPv6 /64) holds at most
//!   `max_client_connections` unauthenticated connections: one more closes
//!   its oldest, once that one had `client_grace` to authenticate (a client
//!   that opens many connections at once, each with its request, is not
//!   cut before the daemon read them). All unauthenticated connections
//!   together hold at most half of `max_connections` (and
//!   [`MAX_UNAUTHENTICATED`]): one more closes the oldest of them, whatever
//!   its age.
//! - At `max_connections` a new connection closes the oldest
//!   unauthenticated one; when every connection is authenticated, the new
//!   one is refused (closed at once). Accept errors (out of descriptors) shed
//!   the oldest unauthenticated connection and the loop goes on: it never
//!   stops.
//!
//! `max_connections` is fitted to the open-file limit ([`Limits::fit`]) so
//! that a reserve of descriptors stays for sandbox work: agent sockets,
//! cgroup files, liveness checks.

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::Router;
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Largest request head (request line and headers) a client may send; it
/// also bounds hyper's read buffer, so a waiting connection holds at most
/// this much of the daemon's memory.
pub const MAX_HEAD: usize = 64 << 10;

/// Most unauthenticated connections at once. A waiting connection costs
/// the daemon about 25 KiB (hyper's read and write buffers, its task), so a
/// flood of them holds at most about 100 MiB.
pub const MAX_UNAUTHENTICATED: usize = 4096;

/// The listener's bounds (see the module documentation).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections at once, all clients together.
    pub max_connections: usize,
    /// Unauthenticated connections of one client address (IPv6: one /64).
    pub max_client_connections: usize,
    /// Time to send a request head: from the accept, or from the first byte
    /// after an idle pause.
    pub header_timeout: Duration,
    /// Time a connection may wait between requests.
    pub idle_timeout: Duration,
    /// Age below which a connection is not closed for its client's cap.
    pub client_grace: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 16384,
            max_client_connections: 256,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
            client_grace: Duration::from_secs(1),
        }
    }
}

impl Limits {
    /// Descriptors kept for sandbox work out of an open-file limit of `nofile`.
    pub fn reserve(nofile: u64) -> u64 {
        (nofile / 4).clamp(256, 65536)
    }

    /// These limits with `max_connections` lowered so that connections leave
    /// the reserve free, at two descriptors each (the client's, and its agent
    /// or sandbox port connection).
    pub fn fit(mut self, nofile: u64) -> Limits {
        let usable = nofile.saturating_sub(Limits::reserve(nofile)) / 2;
        self.max_connections = self.max_connections.min(usize::try_from(usable).unwrap_or(usize::MAX)).max(2);
        self
    }

    /// Unauthenticated connections at once, all clients together: half the
    /// table, and at most [`MAX_UNAUTHENTICATED`].
    pub fn max_unauthenticated(&self) -> usize {
        (self.max_connections / 2).clamp(1, MAX_UNAUTHENTICATED)
    }
}

/// The key a client's connections are counted under: its IPv4 address
/// (IPv4-mapped IPv6 included), or the /64 of its IPv6 address, which one
/// host typically holds whole.
pub fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

/// A duration in [`Gate::now`] milliseconds.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 4)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------
// The table of connections

/// Every connection of one listener, and the counters the caps read.
pub struct Gate {
    limits: Limits,
    epoch: Instant,
    table: Mutex<Table>,
    /// Connections whose socket is still open (shed ones until they close).
    open: watch::Sender<usize>,
    stats: Stats,
}

/// What the gate did, for its log lines (and tests).
#[derive(Default)]
struct Stats {
    shed: AtomicU64,
    refused: AtomicU64,
    timed_out: AtomicU64,
    accept_errors: AtomicU64,
    sweeps: AtomicU64,
}

#[derive(Default)]
struct Table {
    next: u64,
    /// The connections the caps count: not yet shed, timed out or closed.
    all: HashMap<u64, Arc<ConnShared>>,
    /// The unauthenticated ones, oldest first (ids grow with each accept),
    /// with their client.
    unauth: BTreeMap<u64, IpAddr>,
    by_client: HashMap<IpAddr, BTreeSet<u64>>,
}

impl Table {
    /// Stops counting connection `id`; its state, if it was still counted.
    fn remove(&mut self, id: u64) -> Option<Arc<ConnShared>> {
        let conn = self.all.remove(&id)?;
        self.forget_unauthenticated(id);
        Some(conn)
    }

    fn forget_unauthenticated(&mut self, id: u64) {
        let Some(client) = self.unauth.remove(&id) else { return };
        if let Some(ids) = self.by_client.get_mut(&client) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_client.remove(&client);
            }
        }
    }

    fn client_count(&self, client: &IpAddr) -> usize {
        self.by_client.get(client).map_or(0, BTreeSet::len)
    }

    fn oldest_of(&self, client: &IpAddr) -> Option<u64> {
        self.by_client.get(client)?.first().copied()
    }

    fn oldest_unauthenticated(&self) -> Option<u64> {
        self.unauth.keys().next().copied()
    }
}

impl Gate {
    pub fn new(limits: Limits) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            epoch: Instant::now(),
            table: Mutex::new(Table::default()),
            open: watch::channel(0).0,
            stats: Stats::default(),
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Milliseconds since the gate was made, never 0 (0 means "unset").
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Connections the caps count now: (all, unauthenticated).
    pub fn counts(&self) -> (usize, usize) {
        let t = lock(&self.table);
        (t.all.len(), t.unauth.len())
    }

    /// Connections whose socket is still open.
    pub fn open(&self) -> usize {
        *self.open.borrow()
    }

    /// Takes a new connection under the caps, closing what it must to make
    /// room; None when it is refused (every connection is authenticated).
    fn admit(self: &Arc<Gate>, tcp: TcpStream, peer: SocketAddr) -> Option<ConnIo> {
        let client = client_key(peer.ip());
        let mut victims = Vec::new();
        let conn = {
            let mut t = lock(&self.table);
            if t.client_count(&client) >= self.limits.max_client_connections {
                let grace = ms(self.limits.client_grace);
                let now = self.now();
                let oldest = t.oldest_of(&client).filter(|id| t.all.get(id).is_some_and(|c| c.accepted + grace <= now));
                victims.extend(oldest.and_then(|id| t.remove(id)));
            }
            if t.unauth.len() >= self.limits.max_unauthenticated() {
                victims.extend(t.oldest_unauthenticated().and_then(|id| t.remove(id)));
            }
            let full = t.all.len() >= self.limits.max_connections;
            if full {
                victims.extend(t.oldest_unauthenticated().and_then(|id| t.remove(id)));
            }
            if full && victims.is_empty() {
                None
            } else {
                let id = t.next;
                t.next += 1;
                let conn = Conn::attached(id, Arc::downgrade(self), self.now());
                t.all.insert(id, conn.0.clone());
                t.unauth.insert(id, client);
                t.by_client.entry(client).or_default().insert(id);
                Some(conn)
            }
        };
        self.stats.shed.fetch_add(victims.len() as u64, SeqCst);
        for v in victims {
            Conn(v).kill();
        }
        let Some(conn) = conn else {
            self.stats.refused.fetch_add(1, SeqCst);
            return None;
        };
        self.open.send_modify(|n| *n += 1);
        // Event streams and Connect messages are small writes: without
        // TCP_NODELAY, Nagle's algorithm and the peer's delayed ACK hold some
        // of them for 40 ms.
        let _ = tcp.set_nodelay(true);
        Some(ConnIo { inner: tcp, conn })
    }

    /// Closes the oldest unauthenticated connection; false if there is none.
    fn shed_oldest(&self) -> bool {
        let victim = {
            let mut t = lock(&self.table);
            t.oldest_unauthenticated().and_then(|id| t.remove(id))
        };
        match victim {
            Some(v) => {
                self.stats.shed.fetch_add(1, SeqCst);
                Conn(v).kill();
                true
            }
            None => false,
        }
    }

    fn authenticated(&self, id: u64) {
        lock(&self.table).forget_unauthenticated(id);
    }

    /// The socket of connection `id` closed.
    fn closed(&self, id: u64) {
        lock(&self.table).remove(id);
        self.open.send_modify(|n| *n = n.saturating_sub(1));
    }

    /// Accepts the next connection. Errors other than a client's abort
    /// (out of descriptors or memory) shed the oldest unauthenticated
    /// connection, or wait a little when there is none: the loop never ends.
    async fn accept(&self, listener: &TcpListener) -> (TcpStream, SocketAddr) {
        loop {
            match listener.accept().await {
                Ok(accepted) => return accepted,
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset) => {}
                Err(e) => {
                    if self.stats.accept_errors.fetch_add(1, SeqCst) == 0 {
                        tracing::warn!("accept: {e}; closing the oldest unauthenticated connection to make room");
                    }
                    // The shed connection's task closes its socket: give it
                    // the time to run before accepting again.
                    let pause = if self.shed_oldest() { 10 } else { 100 };
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
            }
        }
    }

    /// Every tick: closes waiting connections past their deadline, and logs
    /// what the caps did since the last line.
    async fn sweep(self: Arc<Gate>) {
        let shortest = self.limits.header_timeout.min(self.limits.idle_timeout);
        let mut tick = tokio::time::interval((shortest / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reported = [0u64; 3];
        let mut last_report = Instant::now();
        loop {
            tick.tick().await;
            let now = self.now();
            let expired: Vec<Arc<ConnShared>> = {
                let mut t = lock(&self.table);
                let ids: Vec<u64> = t
                    .all
                    .iter()
                    .filter(|(_, c)| c.deadline(&self.limits).is_some_and(|d| d <= now))
                    .map(|(id, _)| *id)
                    .collect();
                ids.into_iter().filter_map(|id| t.remove(id)).collect()
            };
            self.stats.timed_out.fetch_add(expired.len() as u64, SeqCst);
            for c in expired {
                Conn(c).kill();
            }
            self.stats.sweeps.fetch_add(1, SeqCst);
            // Timeouts are ordinary; caps at work are worth a line, at most
            // every few seconds.
            if last_report.elapsed() >= Duration::from_secs(5) {
                let s = &self.stats;
                let seen = [s.shed.load(SeqCst), s.refused.load(SeqCst), s.accept_errors.load(SeqCst)];
                if seen != reported {
                    let (all, unauth) = self.counts();
                    tracing::warn!(
                        shed = seen[0] - reported[0],
                        refused = seen[1] - reported[1],
                        accept_errors = seen[2] - reported[2],
                        connections = all,
                        unauthenticated = unauth,
                        "connection caps at work: at most {} connections, {} unauthenticated, {} unauthenticated per client",
                        self.limits.max_connections,
                        self.limits.max_unauthenticated(),
                        self.limits.max_client_connections,
                    );
                    reported = seen;
                }
                last_report = Instant::now();
            }
        }
    }

    /// Closes every connection but those answering a request (the daemon
    /// is stopping: tunnels and half-sent heads would hold it up).
    fn close_all_but_busy(&self) {
        let closing: Vec<Arc<ConnShared>> = lock(&self.table)
            .all
            .values()
            .filter(|c| c.upgraded.load(SeqCst) || c.in_flight.load(SeqCst) == 0)
            .cloned()
            .collect();
        for c in closing {
            Conn(c).kill();
        }
    }

    #[cfg(test)]
    fn sweeps(&self) -> u64 {
        self.stats.sweeps.load(SeqCst)
    }

    /// Connections admitted so far.
    #[cfg(test)]
    fn admitted(&self) -> u64 {
        lock(&self.table).next
    }
}

// ---------------------------------------------------------------------------
// One connection

/// One client connection as the handlers see it (`ConnectInfo<Conn>`): its
/// state under the caps, a kill switch, and what the port proxy keeps on it.
#[derive(Clone)]
pub struct Conn(pub(crate) Arc<ConnShared>);

pub(crate) struct ConnShared {
    id: u64,
    /// When it was accepted, in [`Gate::now`] milliseconds.
    accepted: u64,
    gate: Weak<Gate>,
    /// Requests being answered (0 or 1 with HTTP/1.1).
    in_flight: AtomicU32,
    /// A request was answered on it.
    served: AtomicBool,
    upgraded: AtomicBool,
    authenticated: AtomicBool,
    /// When it started waiting (accept, or the end of the last response),
    /// and when the first byte of the next head came (0: none yet), in
    /// [`Gate::now`] milliseconds.
    waiting_since: AtomicU64,
    first_byte: AtomicU64,
    killed: watch::Sender<bool>,
    /// Set when the socket is closed.
    pub(crate) closed: watch::Sender<bool>,
    wakers: Mutex<[Option<Waker>; 2]>,
    /// The port proxy's idle connection to a sandbox port, kept for the
    /// next request.
    pub(crate) upstream: Mutex<Option<crate::proxy::Upstream>>,
    /// Grants whose end the port proxy watches for on this connection.
    pub(crate) watched: Mutex<Vec<String>>,
}

impl ConnShared {
    /// When a waiting connection is closed, in [`Gate::now`] milliseconds;
    /// None while it is busy or upgraded.
    fn deadline(&self, limits: &Limits) -> Option<u64> {
        if self.upgraded.load(SeqCst) || self.in_flight.load(SeqCst) > 0 {
            return None;
        }
        let first = self.first_byte.load(SeqCst);
        let since = self.waiting_since.load(SeqCst);
        Some(if !self.served.load(SeqCst) {
            since + ms(limits.header_timeout)
        } else if first != 0 {
            first + ms(limits.header_timeout)
        } else {
            since + ms(limits.idle_timeout)
        })
    }
}

impl Conn {
    fn attached(id: u64, gate: Weak<Gate>, now: u64) -> Conn {
        Conn(Arc::new(ConnShared {
            id,
            accepted: now,
            gate,
            in_flight: AtomicU32::new(0),
            served: AtomicBool::new(false),
            upgraded: AtomicBool::new(false),
            authenticated: AtomicBool::new(false),
            waiting_since: AtomicU64::new(now),
            first_byte: AtomicU64::new(0),
            killed: watch::channel(false).0,
            closed: watch::channel(false).0,
            wakers: Mutex::new([None, None]),
            upstream: Mutex::new(None),
            watched: Mutex::new(Vec::new()),
        }))
    }

    /// A connection no listener counts (handlers served without ours).
    pub(crate) fn detached() -> Conn {
        Conn::attached(0, Weak::new(), 1)
    }

    pub(crate) fn is_killed(&self) -> bool {
        *self.0.killed.borrow()
    }

    fn park(&self, slot: usize, waker: &Waker) {
        let mut wakers = lock(&self.0.wakers);
        match &wakers[slot] {
            Some(w) if w.will_wake(waker) => {}
            _ => wakers[slot] = Some(waker.clone()),
        }
    }

    /// Ends the connection (reads see EOF, writes fail) and its connection
    /// to a sandbox.
    pub(crate) fn kill(&self) {
        self.0.killed.send_replace(true);
        let wakers = std::mem::take(&mut *lock(&self.0.wakers));
        for w in wakers.into_iter().flatten() {
            w.wake();
        }
        if let Some(up) = lock(&self.0.upstream).take() {
            up.close();
        }
    }

    /// Completes once the connection is killed.
    pub(crate) async fn killed(&self) {
        let _ = self.0.killed.subscribe().wait_for(|k| *k).await;
    }

    /// A request passed authentication on this connection: the caps on
    /// unauthenticated connections no longer count it.
    pub(crate) fn mark_authenticated(&self) {
        if !self.0.authenticated.swap(true, SeqCst) {
            if let Some(gate) = self.0.gate.upgrade() {
                gate.authenticated(self.0.id);
            }
        }
    }

    /// The connection was handed to a tunnel: no timeout applies any more.
    pub(crate) fn mark_upgraded(&self) {
        self.0.upgraded.store(true, SeqCst);
    }

    fn begin_request(&self) -> RequestGuard {
        self.0.served.store(true, SeqCst);
        self.0.first_byte.store(0, SeqCst);
        self.0.in_flight.fetch_add(1, SeqCst);
        RequestGuard(self.clone())
    }

    /// Bytes arrived: the first ones while waiting start the header timeout.
    fn saw_bytes(&self) {
        let c = &self.0;
        if c.in_flight.load(SeqCst) == 0 && c.first_byte.load(SeqCst) == 0 && !c.upgraded.load(SeqCst) {
            if let Some(gate) = c.gate.upgrade() {
                c.first_byte.store(gate.now(), SeqCst);
            }
        }
    }
}

/// Marks the connection that carried `req` as authenticated (see [`Conn`]).
/// Every authentication point calls it once a credential was accepted.
pub(crate) fn authenticated<B>(req: &axum::http::Request<B>) {
    if let Some(ConnectInfo(conn)) = req.extensions().get::<ConnectInfo<Conn>>() {
        conn.mark_authenticated();
    }
}

/// Held while a request is answered: from its head to the end of its
/// response body.
struct RequestGuard(Conn);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let c = &self.0 .0;
        if let Some(gate) = c.gate.upgrade() {
            c.waiting_since.store(gate.now(), SeqCst);
        }
        c.first_byte.store(0, SeqCst);
        c.in_flight.fetch_sub(1, SeqCst);
    }
}

/// A response body that holds its request's guard until it is sent whole
/// (or dropped).
struct Tracked {
    inner: Body,
    _guard: RequestGuard,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A client's TCP connection, which ends (reads see EOF, writes fail) once
/// its [`Conn`] is killed: by a cap, a timeout, or the port proxy when a
/// grant the connection used ends.
pub struct ConnIo {
    inner: TcpStream,
    conn: Conn,
}

impl Drop for ConnIo {
    fn drop(&mut self) {
        self.conn.0.closed.send_replace(true);
        if let Some(gate) = self.conn.0.gate.upgrade() {
            gate.closed(self.conn.0.id);
        }
    }
}

const READ: usize = 0;
const WRITE: usize = 1;

fn killed_error() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "connection closed by the daemon")
}

impl AsyncRead for ConnIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.is_killed() {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => {
                this.conn.park(READ, cx.waker());
                // A kill between the check and the park took no waker of ours.
                if this.conn.is_killed() {
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending
            }
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.conn.saw_bytes();
                Poll::Ready(Ok(()))
            }
            ready => ready,
        }
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.is_killed() {
            return Poll::Ready(Err(killed_error()));
        }
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Pending => {
                this.conn.park(WRITE, cx.waker());
                if this.conn.is_killed() {
                    return Poll::Ready(Err(killed_error()));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.is_killed() {
            return Poll::Ready(Err(killed_error()));
        }
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Pending => {
                this.conn.park(WRITE, cx.waker());
                if this.conn.is_killed() {
                    return Poll::Ready(Err(killed_error()));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

// ---------------------------------------------------------------------------
// Serving

/// Serves `router` on `listener` under `gate`'s caps until `shutdown`
/// completes; then closes idle and upgraded connections, lets requests in
/// flight finish, and returns once every connection is closed.
pub async fn serve_router(
    listener: TcpListener,
    router: Router,
    gate: Arc<Gate>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let sweeper = tokio::spawn(gate.clone().sweep());
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = gate.accept(&listener) => accepted,
            () = &mut shutdown => break,
        };
        if let Some(io) = gate.admit(tcp, peer) {
            tokio::spawn(serve_connection(io, peer, router.clone(), stop_rx.clone()));
        }
    }
    drop(listener);
    stop_tx.send_replace(true);
    gate.close_all_but_busy();
    let _ = gate.open.subscribe().wait_for(|n| *n == 0).await;
    sweeper.abort();
    Ok(())
}

async fn serve_connection(io: ConnIo, peer: SocketAddr, router: Router, mut stop: watch::Receiver<bool>) {
    let conn = io.conn.clone();
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        let guard = conn.begin_request();
        req.extensions_mut().insert(ConnectInfo(conn.clone()));
        // The client's address, as the audit log records it.
        req.extensions_mut().insert(ConnectInfo(peer));
        let mut router = router.clone();
        async move {
            // A Router is always ready and never fails.
            let resp = match tower_service::Service::call(&mut router, req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(resp.map(|inner| Tracked { inner, _guard: guard }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.max_buf_size(MAX_HEAD);
    let served = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
    tokio::pin!(served);
    tokio::select! {
        result = served.as_mut() => {
            if let Err(e) = result {
                tracing::debug!("connection: {e}");
            }
            return;
        }
        _ = stop.wait_for(|s| *s) => {}
    }
    served.as_mut().graceful_shutdown();
    let _ = served.await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    /// Bytes of a stream the test feeds.
    type Feed = Arc<Mutex<Option<mpsc::Receiver<Result<Bytes, io::Error>>>>>;

    struct Server {
        addr: SocketAddr,
        gate: Arc<Gate>,
        feed: mpsc::Sender<Result<Bytes, io::Error>>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        served: tokio::task::JoinHandle<io::Result<()>>,
    }

    /// A server with three routes: `/ok`, `/auth` (authenticates its
    /// connection) and `/stream` (a body the test feeds through `feed`).
    async fn start(limits: Limits) -> Server {
        let (feed, rx) = mpsc::channel(4);
        let rx: Feed = Arc::new(Mutex::new(Some(rx)));
        let router = Router::new()
            .route("/ok", get(|| async { "ok" }))
            .route(
                "/auth",
                get(|req: axum::extract::Request| async move {
                    authenticated(&req);
                    "ok"
                }),
            )
            .route(
                "/stream",
                get(move || {
                    let rx = lock(&rx).take();
                    async move {
                        match rx {
                            Some(rx) => crate::ChannelBody(rx).into_body(),
                            None => Body::from("no feed"),
                        }
                    }
                }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let gate = Gate::new(limits);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(serve_router(listener, router, gate.clone(), async move {
            let _ = stopped.await;
        }));
        Server { addr, gate, feed, stop: Some(stop), served }
    }

    fn limits(max: usize, per_client: usize) -> Limits {
        Limits {
            max_connections: max,
            max_client_connections: per_client,
            client_grace: Duration::ZERO,
            ..Limits::default()
        }
    }

    /// Bounds every wait of these tests (they wait on conditions).
    const PATIENCE: Duration = Duration::from_secs(20);

    async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + PATIENCE;
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A connection from `from` (a loopback address), counted by the gate
    /// before this returns.
    async fn connect(srv: &Server, from: &str) -> TcpStream {
        let before = srv.gate.admitted();
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind(format!("{from}:0").parse().expect("addr")).expect("bind");
        let s = sock.connect(srv.addr).await.expect("connect");
        wait_until("the gate to take the connection", || srv.gate.admitted() > before).await;
        s
    }

    /// Sends a request line only: a head half sent.
    async fn half(s: &mut TcpStream) {
        s.write_all(b"GET /ok HTTP/1.1\r\n").await.expect("write");
    }

    /// Sends a request (or finishes a half-sent one) and reads its answer.
    async fn finish(s: &mut TcpStream, path: &str, started: bool) -> String {
        let req =
            if started { "Host: t\r\n\r\n".to_owned() } else { format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n") };
        s.write_all(req.as_bytes()).await.expect("write");
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let read = async {
            while !got.windows(4).any(|w| w == b"\r\n\r\n") || !got.ends_with(b"ok") {
                let n = s.read(&mut buf).await.expect("read");
                assert!(n > 0, "closed before an answer: {:?}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(PATIENCE, read).await.expect("an answer");
        String::from_utf8_lossy(&got).into_owned()
    }

    async fn request(s: &mut TcpStream, path: &str) -> String {
        finish(s, path, false).await
    }

    /// Whether the server closed `s` (EOF or reset), waiting at most PATIENCE.
    async fn closed(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 1024];
        let read = async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(PATIENCE, read).await.is_ok()
    }

    async fn stop(mut srv: Server, open: Vec<TcpStream>) {
        drop(open);
        if let Some(stop) = srv.stop.take() {
            let _ = stop.send(());
        }
        let done = tokio::time::timeout(PATIENCE, &mut srv.served).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "the server stops once its connections are closed");
    }

    #[test]
    fn clients_are_keyed_by_address_and_ipv6_by_their_64() {
        let k = |s: &str| client_key(s.parse().expect("ip")).to_string();
        assert_eq!(k("127.0.0.2"), "127.0.0.2");
        assert_eq!(k("::ffff:10.1.2.3"), "10.1.2.3");
        assert_eq!(k("2001:db8:1:2:aaaa:bbbb:cccc:dddd"), "2001:db8:1:2::");
        assert_eq!(k("2001:db8:1:2::1"), k("2001:db8:1:2:ffff::9"));
        assert_ne!(k("2001:db8:1:2::1"), k("2001:db8:1:3::1"));
    }

    #[test]
    fn the_connection_cap_leaves_a_reserve_of_descriptors() {
        let fit = |nofile| Limits::default().fit(nofile).max_connections;
        assert_eq!(fit(1 << 20), 16384, "the configured cap when descriptors abound");
        assert_eq!(fit(20000), (20000 - 5000) / 2);
        assert_eq!(fit(1024), (1024 - 256) / 2);
        assert_eq!(fit(100), 2, "never below two");
        assert_eq!(Limits::default().fit(20000).max_unauthenticated(), 7500 / 2);
        assert_eq!(Limits::default().fit(1 << 20).max_unauthenticated(), MAX_UNAUTHENTICATED);
        for nofile in [1024, 4096, 20000, 65536, 1 << 20] {
            let l = Limits::default().fit(nofile);
            assert!(2 * l.max_connections as u64 + Limits::reserve(nofile) <= nofile, "{nofile}");
        }
    }

    /// Finding 15 of issue 10: one client could hold every descriptor.
    #[tokio::test]
    async fn one_client_holds_at_most_its_cap_of_unauthenticated_connections() {
        let srv = start(limits(100, 3)).await;
        let mut held = Vec::new();
        for _ in 0..3 {
            let mut s = connect(&srv, "127.0.0.2").await;
            half(&mut s).await;
            held.push(s);
        }
        assert_eq!(srv.gate.counts(), (3, 3));
        // A fourth closes the client's oldest, not another client's.
        let mut other = connect(&srv, "127.0.0.3").await;
        half(&mut other).await;
        let mut fourth = connect(&srv, "127.0.0.2").await;
        assert!(closed(&mut held[0]).await, "the client's oldest connection is closed");
        assert_eq!(srv.gate.counts(), (4, 4));
        assert!(finish(&mut held[1], "/ok", true).await.starts_with("HTTP/1.1 200"));
        assert!(finish(&mut other, "/ok", true).await.starts_with("HTTP/1.1 200"));
        assert!(request(&mut fourth, "/ok").await.starts_with("HTTP/1.1 200"));
        stop(srv, held.into_iter().chain([other, fourth]).collect()).await;
    }

    #[tokio::test]
    async fn stopping_closes_waiting_connections_at_once() {
        let hour = Duration::from_secs(3600);
        let mut srv = start(Limits { header_timeout: hour, idle_timeout: hour, ..limits(100, 100) }).await;
        let mut partial = connect(&srv, "127.0.0.2").await;
        half(&mut partial).await;
        let mut idle = connect(&srv, "127.0.0.3").await;
        assert!(request(&mut idle, "/ok").await.starts_with("HTTP/1.1 200"));
        if let Some(stop) = srv.stop.take() {
            let _ = stop.send(());
        }
        assert!(closed(&mut partial).await && closed(&mut idle).await);
        let done = tokio::time::timeout(PATIENCE, &mut srv.served).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "the server stops though the clients keep their sockets");
    }

    /// A client that opens more connections at once than its cap, each with
    /// its request, loses none of them before the daemon could read them.
    #[tokio::test]
    async fn a_burst_over_the_client_cap_is_not_cut_within_the_grace() {
        let srv = start(Limits { client_grace: Duration::from_secs(3600), ..limits(100, 2) }).await;
        let mut burst = Vec::new();
        for _ in 0..5 {
            let mut s = connect(&srv, "127.0.0.2").await;
            half(&mut s).await;
            burst.push(s);
        }
        assert_eq!(srv.gate.counts(), (5, 5), "over the cap while young");
        for s in &mut burst {
            assert!(finish(s, "/ok", true).await.starts_with("HTTP/1.1 200"));
        }
        stop(srv, burst).await;
    }

    #[tokio::test]
    async fn at_the_caps_the_oldest_unauthenticated_connection_makes_room_and_authenticated_ones_stay() {
        // At most 4 connections, 2 of them unauthenticated.
        let srv = start(limits(4, 100)).await;
        let mut a = connect(&srv, "127.0.0.2").await;
        assert!(request(&mut a, "/auth").await.starts_with("HTTP/1.1 200"));
        wait_until("the authenticated connection to leave the unauthenticated count", || srv.gate.counts().1 == 0)
            .await;
        let mut b = connect(&srv, "127.0.0.3").await;
        half(&mut b).await;
        let mut c = connect(&srv, "127.0.0.4").await;
        half(&mut c).await;
        let mut d = connect(&srv, "127.0.0.5").await;
        assert!(closed(&mut b).await, "the oldest unauthenticated connection made room");
        assert!(request(&mut a, "/ok").await.starts_with("HTTP/1.1 200"), "the authenticated one is kept");
        assert!(finish(&mut c, "/ok", true).await.starts_with("HTTP/1.1 200"));
        // Fill the table with authenticated connections: a new one is refused,
        // and the listener goes on.
        assert!(request(&mut c, "/auth").await.starts_with("HTTP/1.1 200"));
        assert!(request(&mut d, "/auth").await.starts_with("HTTP/1.1 200"));
        let mut e = connect(&srv, "127.0.0.6").await;
        assert!(request(&mut e, "/auth").await.starts_with("HTTP/1.1 200"));
        wait_until("four authenticated connections", || srv.gate.counts() == (4, 0)).await;
        let refused_before = srv.gate.stats.refused.load(SeqCst);
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        let mut f = sock.connect(srv.addr).await.expect("connect");
        assert!(closed(&mut f).await, "no room: the new connection is refused");
        assert_eq!(srv.gate.stats.refused.load(SeqCst), refused_before + 1);
        drop(e);
        wait_until("room again", || srv.gate.counts().0 == 3).await;
        let mut g = connect(&srv, "127.0.0.7").await;
        assert!(request(&mut g, "/ok").await.starts_with("HTTP/1.1 200"));
        stop(srv, vec![a, c, d, g]).await;
    }

    #[tokio::test]
    async fn a_half_sent_head_and_an_idle_connection_are_closed_by_their_timeouts() {
        let srv = start(Limits {
            header_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_millis(400),
            ..limits(100, 100)
        })
        .await;
        let mut partial = connect(&srv, "127.0.0.2").await;
        half(&mut partial).await;
        let mut silent = connect(&srv, "127.0.0.2").await;
        let mut idle = connect(&srv, "127.0.0.2").await;
        assert!(request(&mut idle, "/auth").await.starts_with("HTTP/1.1 200"));
        assert!(closed(&mut partial).await, "a head not sent in time ends the connection");
        assert!(closed(&mut silent).await, "so does a connection that sends nothing");
        assert!(closed(&mut idle).await, "an idle keep-alive connection ends after the idle timeout");
        wait_until("the gate to count none", || srv.gate.counts() == (0, 0)).await;
        assert!(srv.gate.stats.timed_out.load(SeqCst) >= 3);
        stop(srv, vec![]).await;
    }

    #[tokio::test]
    async fn a_stream_outlives_the_idle_timeout_while_its_request_runs() {
        let srv = start(Limits {
            header_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_millis(200),
            ..limits(100, 100)
        })
        .await;
        let mut stream = connect(&srv, "127.0.0.2").await;
        stream.write_all(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n").await.expect("write");
        srv.feed.send(Ok(Bytes::from_static(b"first"))).await.expect("feed");
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&got).contains("first") {
            let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf)).await.expect("data").expect("read");
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        // An idle connection made after the stream began times out: the
        // stream's deadline, were it one, has passed too.
        let mut idle = connect(&srv, "127.0.0.3").await;
        assert!(request(&mut idle, "/ok").await.starts_with("HTTP/1.1 200"));
        let sweeps = srv.gate.sweeps();
        assert!(closed(&mut idle).await);
        wait_until("another sweep", || srv.gate.sweeps() > sweeps + 1).await;
        srv.feed.send(Ok(Bytes::from_static(b"second"))).await.expect("feed");
        got.clear();
        while !String::from_utf8_lossy(&got).contains("second") {
            let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf)).await.expect("data").expect("read");
            assert!(n > 0, "the stream was cut");
            got.extend_from_slice(&buf[..n]);
        }
        drop(srv.feed.clone());
        stop(srv, vec![stream]).await;
    }
}
