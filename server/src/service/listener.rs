//! The gRPC listener: an accept loop that caps open connections (`max_connections`: one
//! more is accepted and closed at once), backs off when accept fails (fd exhaustion:
//! 1 ms doubling to 1 s, logged once per interval) instead of spinning, and wraps each
//! connection so that one that has not sent the HTTP/2 preface in time
//! (`handshake_timeout_ms`) or has had no call for `idle_timeout_ms` is closed.
//! [`AcceptBackoff`] is shared with the metrics listener.

use crate::config::Config;
use crate::metrics::{ACCEPT_ERRORS, CONNECTIONS, CONNECTIONS_CLOSED};
use http_body::{Body, Frame, SizeHint};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::codegen::http::{Request, Response};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tower::{Layer, Service};

/// First wait after a failed accept; doubles per failure in a row.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(1);
/// Longest wait between accepts that fail: a second is short enough to serve again
/// promptly once fds free up, and long enough to cost nothing meanwhile.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// A failing accept, or connections refused over the cap, are logged at most this often.
const LOG_INTERVAL: Duration = Duration::from_secs(5);
/// A connection found idle that read bytes this recently is given this long again (once
/// per idle period, so pings cannot keep it): the bytes may hold a call's HEADERS that
/// hyper has read but not yet handed to the service.
const IDLE_READ_GRACE: Duration = Duration::from_millis(250);

/// What the listener enforces on each connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most open connections.
    pub max_connections: usize,
    /// Until the client's HTTP/2 preface and SETTINGS frame arrive; `None`: no limit.
    pub handshake_timeout: Option<Duration>,
    /// With no call open; `None`: never closed for idling.
    pub idle_timeout: Option<Duration>,
}

impl ConnectionLimits {
    pub fn from_config(config: &Config) -> ConnectionLimits {
        let millis = |ms: u64| (ms > 0).then(|| Duration::from_millis(ms));
        ConnectionLimits {
            max_connections: config.max_connections.max(1),
            handshake_timeout: millis(config.handshake_timeout_ms),
            idle_timeout: millis(config.idle_timeout_ms),
        }
    }
}

/// Says "log now" at most once per interval, and how many events it held back since.
#[derive(Debug)]
pub(crate) struct LogEvery {
    interval: Duration,
    last: Option<Instant>,
    held_back: u64,
}

impl LogEvery {
    pub(crate) fn new(interval: Duration) -> LogEvery {
        LogEvery {
            interval,
            last: None,
            held_back: 0,
        }
    }

    /// One more event at `now`: `Some(events held back before it)` if it is to be logged.
    pub(crate) fn event(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.interval => {
                self.held_back += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held_back))
            }
        }
    }
}

/// Accepts from a listener without spinning when accept fails: the failures that are
/// the process's (no fd left: EMFILE, ENFILE; no memory) wait 1 ms, doubling to 1 s,
/// before the next try, and are logged once per interval with the error. Failures of
/// one connection (reset before it was accepted) are skipped at once.
pub struct AcceptBackoff {
    /// Which listener, for the log.
    listener: &'static str,
    delay: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    log: LogEvery,
}

impl AcceptBackoff {
    pub fn new(listener: &'static str) -> AcceptBackoff {
        AcceptBackoff {
            listener,
            delay: ACCEPT_BACKOFF_MIN,
            sleep: None,
            log: LogEvery::new(LOG_INTERVAL),
        }
    }

    /// The next accepted connection; never fails (see the type's doc).
    pub async fn accept(&mut self, listener: &TcpListener) -> (TcpStream, SocketAddr) {
        std::future::poll_fn(|cx| self.poll_accept(listener, cx)).await
    }

    pub fn poll_accept(
        &mut self,
        listener: &TcpListener,
        cx: &mut Context<'_>,
    ) -> Poll<(TcpStream, SocketAddr)> {
        self.poll_accept_with(cx, |cx| listener.poll_accept(cx))
    }

    /// `poll_accept` over any accept function (tests fail it on purpose).
    fn poll_accept_with<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut accept: impl FnMut(&mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<T> {
        loop {
            if let Some(sleep) = self.sleep.as_mut() {
                ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
            }
            match ready!(accept(cx)) {
                Ok(accepted) => {
                    self.delay = ACCEPT_BACKOFF_MIN;
                    return Poll::Ready(accepted);
                }
                Err(error) if is_connection_error(&error) => {
                    tracing::debug!(listener = self.listener, %error, "a connection failed before it was accepted");
                }
                Err(error) => {
                    let wait = self.failed();
                    metrics::counter!(ACCEPT_ERRORS, "listener" => self.listener).increment(1);
                    if let Some(held_back) = self.log.event(Instant::now()) {
                        tracing::error!(
                            listener = self.listener,
                            %error,
                            retry_in = ?wait,
                            failures_not_logged = held_back,
                            "cannot accept connections (at most one such line per {LOG_INTERVAL:?}); \
                             retrying with backoff"
                        );
                    }
                    self.sleep = Some(Box::pin(tokio::time::sleep(wait)));
                }
            }
        }
    }

    /// One more failure: how long to wait before the next accept.
    fn failed(&mut self) -> Duration {
        let wait = self.delay;
        self.delay = (self.delay * 2).min(ACCEPT_BACKOFF_MAX);
        wait
    }
}

/// File descriptors the server needs besides its gRPC connections (data files, runtime,
/// metrics, remote processors), as a margin for the start-up check of the open-file limit.
const FDS_BESIDES_CONNECTIONS: u64 = 256;

/// The soft limit on open files (`ulimit -n`), where `/proc` tells it.
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|line| line.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// An accept error of one connection, not of the listener: the next accept may succeed.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// The connections of the gRPC listener, as tonic's `serve_with_incoming*` takes them.
pub struct Incoming {
    listener: TcpListener,
    backoff: AcceptBackoff,
    permits: Arc<Semaphore>,
    limits: ConnectionLimits,
    calls: Calls,
    /// False once TLS sits between the socket and HTTP/2 (see [`Incoming::behind_tls`]).
    preface_in_clear: bool,
    refused_log: LogEvery,
}

impl Incoming {
    pub fn new(listener: TcpListener, limits: ConnectionLimits) -> Incoming {
        if let Some(open_files) = open_files_limit()
            && open_files < limits.max_connections as u64 + FDS_BESIDES_CONNECTIONS
        {
            tracing::warn!(
                open_files,
                max_connections = limits.max_connections,
                "the open-file limit is below max_connections: accepts will fail (and wait) for want of \
                 file descriptors before the cap is reached; raise `ulimit -n` or lower max_connections"
            );
        }
        Incoming {
            listener,
            backoff: AcceptBackoff::new("grpc"),
            permits: Arc::new(Semaphore::new(limits.max_connections.min(Semaphore::MAX_PERMITS))),
            limits,
            calls: Calls::new(limits.idle_timeout.is_some()),
            preface_in_clear: true,
            refused_log: LogEvery::new(LOG_INTERVAL),
        }
    }

    /// With TLS in front of HTTP/2 the bytes read here are ciphertext, so the preface
    /// cannot be seen: the handshake deadline is then the TLS acceptor's (tonic's
    /// `ServerTlsConfig::timeout`, to be set to the same `handshake_timeout_ms`), and a
    /// client that completes TLS and then sends nothing is closed by the idle timeout.
    pub fn behind_tls(mut self) -> Incoming {
        self.preface_in_clear = false;
        self
    }

    /// The layer that tells each connection when its calls start and end (the idle
    /// timeout counts from the end of the last one): add it to the server.
    pub fn calls_layer(&self) -> CallsLayer {
        CallsLayer {
            calls: self.calls.clone(),
        }
    }
}

impl Stream for Incoming {
    type Item = io::Result<Connection>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            let (stream, peer) = ready!(this.backoff.poll_accept(&this.listener, cx));
            let Ok(permit) = this.permits.clone().try_acquire_owned() else {
                // Accepted and closed at once rather than left in the backlog: the client
                // learns now (connection closed) instead of at its own deadline.
                metrics::counter!(CONNECTIONS_CLOSED, "reason" => "over_limit").increment(1);
                if let Some(held_back) = this.refused_log.event(Instant::now()) {
                    tracing::warn!(
                        %peer,
                        max_connections = this.limits.max_connections,
                        refused_not_logged = held_back,
                        "max_connections reached: closed a new connection (at most one such line per \
                         {LOG_INTERVAL:?})"
                    );
                }
                drop(stream);
                continue;
            };
            // TCP_NODELAY: a small unary answer must not wait for the client's delayed ACK
            // (Nagle), which costs ~40 ms per call.
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%peer, %error, "cannot set TCP_NODELAY");
            }
            let connection = Connection::new(
                stream,
                peer,
                permit,
                this.limits,
                &this.calls,
                this.preface_in_clear,
            );
            return Poll::Ready(Some(Ok(connection)));
        }
    }
}

/// Why a connection was closed by the listener's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expired {
    Handshake,
    Idle,
}

impl Expired {
    fn reason(self) -> &'static str {
        match self {
            Expired::Handshake => "handshake_timeout",
            Expired::Idle => "idle_timeout",
        }
    }

    fn error(self) -> io::Error {
        let message = match self {
            Expired::Handshake => "no HTTP/2 preface within handshake_timeout_ms",
            Expired::Idle => "no call within idle_timeout_ms",
        };
        io::Error::new(io::ErrorKind::TimedOut, message)
    }
}

/// When the connection's timer should act next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Due {
    Now(Expired),
    At(Instant),
    Never,
}

/// An accepted gRPC connection: the socket, its place under `max_connections`, and its
/// handshake and idle deadlines. A deadline that passes fails the next read, which makes
/// hyper drop the connection (no GOAWAY: hyper's connection is out of reach here).
pub struct Connection {
    stream: TcpStream,
    peer: SocketAddr,
    _permit: OwnedSemaphorePermit,
    limits: ConnectionLimits,
    opened: Instant,
    /// Until the preface is complete; `None` after, or when it is not checked.
    preface: Option<Preface>,
    activity: Option<Registered>,
    last_read: Instant,
    /// The idle period (its start) that was given `IDLE_READ_GRACE` already.
    idle_grace_given: Option<Instant>,
    /// Fires at the earliest deadline (or later: it is re-armed when it fires early).
    timer: Option<Pin<Box<Sleep>>>,
    expired: Option<Expired>,
}

impl Connection {
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        permit: OwnedSemaphorePermit,
        limits: ConnectionLimits,
        calls: &Calls,
        preface_in_clear: bool,
    ) -> Connection {
        let opened = Instant::now();
        metrics::gauge!(CONNECTIONS).increment(1.0);
        let mut connection = Connection {
            stream,
            peer,
            _permit: permit,
            limits,
            opened,
            preface: (preface_in_clear && limits.handshake_timeout.is_some()).then(Preface::default),
            activity: calls.register(peer),
            last_read: opened,
            idle_grace_given: None,
            timer: None,
            expired: None,
        };
        if let Due::At(at) = connection.due(opened) {
            connection.timer = Some(Box::pin(tokio::time::sleep_until(at.into())));
        }
        connection
    }

    /// What the deadlines say at `now`: the earliest of them.
    fn due(&mut self, now: Instant) -> Due {
        let handshake = match (&self.preface, self.limits.handshake_timeout) {
            (Some(_), Some(timeout)) => Some((self.opened + timeout, Expired::Handshake)),
            _ => None,
        };
        let idle = match (self.limits.idle_timeout, &self.activity) {
            (Some(timeout), Some(activity)) => Some(match activity.0.idle_since() {
                // The idle clock starts when the last call ends: look again one timeout
                // from now at the earliest.
                None => (now + timeout, None),
                Some(idle_since) => {
                    let at = idle_since.max(self.opened) + timeout;
                    let grace = self.last_read + IDLE_READ_GRACE;
                    if now >= at && now < grace && self.idle_grace_given != Some(idle_since) {
                        self.idle_grace_given = Some(idle_since);
                        (grace, None)
                    } else {
                        (at, Some(Expired::Idle))
                    }
                }
            }),
            _ => None,
        };
        let mut earliest = Due::Never;
        // `None`: a time to look again, not a deadline.
        let candidates = handshake.map(|(at, why)| (at, Some(why))).into_iter().chain(idle);
        for (at, why) in candidates {
            if let Some(why) = why
                && now >= at
            {
                return Due::Now(why);
            }
            earliest = match earliest {
                Due::At(current) if current <= at => earliest,
                _ => Due::At(at),
            };
        }
        earliest
    }

    /// Polls the timer; `Some` once a deadline has passed.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Option<Expired> {
        if self.expired.is_some() {
            return self.expired;
        }
        loop {
            if self.timer.as_mut()?.as_mut().poll(cx).is_pending() {
                return None;
            }
            match self.due(Instant::now()) {
                Due::Now(expired) => {
                    tracing::debug!(peer = %self.peer, reason = expired.reason(), "closing a connection");
                    metrics::counter!(CONNECTIONS_CLOSED, "reason" => expired.reason()).increment(1);
                    self.expired = Some(expired);
                    self.timer = None;
                    return Some(expired);
                }
                Due::At(at) => {
                    if let Some(timer) = self.timer.as_mut() {
                        timer.as_mut().reset(at.into());
                    }
                }
                Due::Never => self.timer = None,
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        metrics::gauge!(CONNECTIONS).decrement(1.0);
    }
}

impl Connected for Connection {
    /// Tonic's own, so `Request::remote_addr` (and with TLS `peer_certs`) keep working.
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(expired) = this.poll_expired(cx) {
            return Poll::Ready(Err(expired.error()));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
        let read = &buf.filled()[before..];
        if !read.is_empty() {
            this.last_read = Instant::now();
            if let Some(preface) = &mut this.preface
                && preface.feed(read) == PrefaceProgress::Done
            {
                this.preface = None;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Connection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The client connection preface of HTTP/2 (RFC 9113 §3.4); a SETTINGS frame follows it.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Length of an HTTP/2 frame header.
const FRAME_HEADER: usize = 9;
/// Frame type of SETTINGS.
const SETTINGS: u8 = 0x4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefaceProgress {
    Pending,
    /// The preface and a whole SETTINGS frame arrived.
    Done,
    /// Something else arrived; hyper refuses it, else the deadline closes the connection.
    Invalid,
}

/// Follows the first bytes of a connection to where the client's preface and its
/// SETTINGS frame end.
#[derive(Debug, Default)]
struct Preface {
    seen: usize,
    header: [u8; FRAME_HEADER],
    /// Bytes up to the end of the SETTINGS frame, once its header is known.
    end: Option<usize>,
    invalid: bool,
}

impl Preface {
    fn feed(&mut self, bytes: &[u8]) -> PrefaceProgress {
        let mut at = 0;
        while at < bytes.len() && !self.invalid {
            if let Some(end) = self.end {
                // The SETTINGS payload: skipped whole, and nothing after it matters.
                let skip = end.saturating_sub(self.seen).min(bytes.len() - at);
                self.seen += skip;
                break;
            }
            let byte = bytes[at];
            if self.seen < PREFACE.len() {
                self.invalid = byte != PREFACE[self.seen];
            } else {
                let index = self.seen - PREFACE.len();
                self.header[index] = byte;
                if index == FRAME_HEADER - 1 {
                    let length = u32::from_be_bytes([0, self.header[0], self.header[1], self.header[2]]);
                    self.invalid = self.header[3] != SETTINGS;
                    self.end = Some(PREFACE.len() + FRAME_HEADER + length as usize);
                }
            }
            self.seen += 1;
            at += 1;
        }
        if self.invalid {
            PrefaceProgress::Invalid
        } else if self.end.is_some_and(|end| self.seen >= end) {
            PrefaceProgress::Done
        } else {
            PrefaceProgress::Pending
        }
    }
}

/// Per connection: calls open and when the last one ended.
#[derive(Debug, Default)]
struct Activity {
    open: AtomicUsize,
    /// Milliseconds after [`epoch`] when `open` last dropped to 0 (0: never).
    idle_since_ms: AtomicU64,
}

/// The instant `Activity` times count from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Activity {
    /// When the connection became idle, or `None` while a call is open.
    fn idle_since(&self) -> Option<Instant> {
        if self.open.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(epoch() + Duration::from_millis(self.idle_since_ms.load(Ordering::SeqCst)))
    }
}

/// The connections' activity by peer address: the calls layer sees a call's
/// `TcpConnectInfo` (tonic's request extension), not the connection itself.
#[derive(Debug, Clone)]
struct Calls(Option<Arc<ByPeer>>);

/// Each open connection's activity, by its peer address. Every call reads it, only
/// connecting and closing write it: a read lock, so calls on different workers never
/// wait for each other here (a worker that waits for a lock held by one descheduled
/// stalls every call it holds).
type ByPeer = RwLock<HashMap<SocketAddr, Arc<Activity>>>;

impl Calls {
    /// `enabled`: there is an idle timeout to feed.
    fn new(enabled: bool) -> Calls {
        Calls(enabled.then(Arc::default))
    }

    fn register(&self, peer: SocketAddr) -> Option<Registered> {
        let map = self.0.as_ref()?;
        let activity = Arc::new(Activity::default());
        map.write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(peer, activity.clone());
        Some(Registered(activity, peer, map.clone()))
    }

    fn start(&self, peer: SocketAddr) -> Option<CallGuard> {
        let activity = self
            .0
            .as_ref()?
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&peer)?
            .clone();
        activity.open.fetch_add(1, Ordering::SeqCst);
        Some(CallGuard(activity))
    }
}

/// A connection's entry in `Calls`, removed when the connection goes.
struct Registered(Arc<Activity>, SocketAddr, Arc<ByPeer>);

impl Drop for Registered {
    fn drop(&mut self) {
        let mut map = self.2.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Only our own: a new connection from the same address may have replaced it.
        if map
            .get(&self.1)
            .is_some_and(|activity| Arc::ptr_eq(activity, &self.0))
        {
            map.remove(&self.1);
        }
    }
}

/// One open call; its end is the connection's latest activity.
struct CallGuard(Arc<Activity>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        let since = u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX);
        // The time first: whoever sees `open` reach 0 then reads the new time.
        self.0.idle_since_ms.store(since, Ordering::SeqCst);
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts each connection's open calls (see [`Incoming::calls_layer`]).
#[derive(Debug, Clone)]
pub struct CallsLayer {
    calls: Calls,
}

impl<S> Layer<S> for CallsLayer {
    type Service = CountCalls<S>;

    fn layer(&self, inner: S) -> CountCalls<S> {
        CountCalls {
            inner,
            calls: self.calls.clone(),
        }
    }
}

/// See [`CallsLayer`]. A call lasts until its response body ends or is dropped.
#[derive(Debug, Clone)]
pub struct CountCalls<S> {
    inner: S,
    calls: Calls,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for CountCalls<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<CallBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let call = request
            .extensions()
            .get::<TcpConnectInfo>()
            .and_then(TcpConnectInfo::remote_addr)
            .and_then(|peer| self.calls.start(peer));
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|inner| CallBody { inner, _call: call }))
        })
    }
}

/// A response body that holds its call open until it ends or is dropped.
pub struct CallBody<B> {
    inner: B,
    _call: Option<CallGuard>,
}

impl<B: Body + Unpin> Body for CallBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_1_ms_to_1_s_and_restarts_after_a_success() {
        let mut backoff = AcceptBackoff::new("test");
        let waits: Vec<u128> = (0..12).map(|_| backoff.failed().as_millis()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1000]);
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert_eq!(
            backoff.poll_accept_with(&mut cx, |_| Poll::Ready(Ok(7))),
            Poll::Ready(7)
        );
        assert_eq!(backoff.failed(), ACCEPT_BACKOFF_MIN);
    }

    /// EMFILE five times, then a connection: six tries in all, spaced 1 + 2 + 4 + 8 + 16 ms.
    #[tokio::test]
    async fn a_failing_accept_waits_between_tries_instead_of_spinning() {
        let mut backoff = AcceptBackoff::new("test");
        let mut tries = 0;
        let started = tokio::time::Instant::now();
        let accepted = std::future::poll_fn(|cx| {
            backoff.poll_accept_with(cx, |_| {
                tries += 1;
                Poll::Ready(match tries {
                    1..=5 => Err(io::Error::from_raw_os_error(24)), // EMFILE
                    _ => Ok("connection"),
                })
            })
        })
        .await;
        assert_eq!(accepted, "connection");
        assert_eq!(tries, 6);
        assert!(
            started.elapsed() >= Duration::from_millis(31),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_connection_reset_before_accept_is_skipped_without_waiting() {
        let mut backoff = AcceptBackoff::new("test");
        let mut tries = 0;
        let accepted = std::future::poll_fn(|cx| {
            backoff.poll_accept_with(cx, |_| {
                tries += 1;
                Poll::Ready(match tries {
                    1..=3 => Err(io::Error::from(io::ErrorKind::ConnectionAborted)),
                    _ => Ok(tries),
                })
            })
        })
        .await;
        assert_eq!(accepted, 4);
        assert!(backoff.sleep.is_none());
        assert_eq!(backoff.failed(), ACCEPT_BACKOFF_MIN);
    }

    #[test]
    fn the_open_file_limit_is_read_from_proc() {
        if std::path::Path::new("/proc/self/limits").exists() {
            assert!(open_files_limit().is_some_and(|limit| limit > 0));
        }
    }

    #[test]
    fn log_every_lets_one_event_through_per_interval_and_counts_the_rest() {
        let mut log = LogEvery::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(log.event(t0), Some(0));
        assert_eq!(log.event(t0 + Duration::from_secs(1)), None);
        assert_eq!(log.event(t0 + Duration::from_secs(4)), None);
        assert_eq!(log.event(t0 + Duration::from_secs(5)), Some(2));
        assert_eq!(log.event(t0 + Duration::from_secs(6)), None);
    }

    fn client_preface(settings_payload: &[u8]) -> Vec<u8> {
        let mut bytes = PREFACE.to_vec();
        let length = settings_payload.len() as u32;
        bytes.extend_from_slice(&length.to_be_bytes()[1..]);
        bytes.extend_from_slice(&[SETTINGS, 0, 0, 0, 0, 0]);
        bytes.extend_from_slice(settings_payload);
        bytes
    }

    #[test]
    fn preface_is_done_after_the_settings_frame_however_the_bytes_are_cut() {
        let payload = [0, 3, 0, 0, 0, 100, 0, 4, 0, 1, 0, 0];
        let mut bytes = client_preface(&payload);
        // A frame of the first call right behind, as clients send it.
        bytes.extend_from_slice(&[0, 0, 4, 1, 4, 0, 0, 0, 1, 1, 2, 3, 4]);
        let end = PREFACE.len() + FRAME_HEADER + payload.len();
        for cut in 1..bytes.len() {
            let mut preface = Preface::default();
            let mut progress = PrefaceProgress::Pending;
            for (i, chunk) in bytes.chunks(cut).enumerate() {
                progress = preface.feed(chunk);
                let fed = ((i + 1) * cut).min(bytes.len());
                let expected = if fed >= end {
                    PrefaceProgress::Done
                } else {
                    PrefaceProgress::Pending
                };
                assert_eq!(progress, expected, "chunks of {cut}, after {fed} bytes");
            }
            assert_eq!(progress, PrefaceProgress::Done);
        }
        // An empty SETTINGS frame is done at its header's end.
        assert_eq!(
            Preface::default().feed(&client_preface(&[])),
            PrefaceProgress::Done
        );
    }

    #[test]
    fn a_truncated_or_foreign_preface_is_never_done() {
        let bytes = client_preface(&[0, 3, 0, 0, 0, 100]);
        assert_eq!(
            Preface::default().feed(&bytes[..bytes.len() - 1]),
            PrefaceProgress::Pending
        );
        assert_eq!(Preface::default().feed(&bytes[..10]), PrefaceProgress::Pending);
        assert_eq!(
            Preface::default().feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            PrefaceProgress::Invalid
        );
        let mut not_settings = client_preface(&[]);
        not_settings[PREFACE.len() + 3] = 0x8; // WINDOW_UPDATE
        assert_eq!(Preface::default().feed(&not_settings), PrefaceProgress::Invalid);
    }

    #[test]
    fn calls_keep_a_connection_busy_until_the_last_one_ends() {
        let calls = Calls::new(true);
        let peer: SocketAddr = "127.0.0.1:4000".parse().expect("an address");
        let registered = calls.register(peer).expect("enabled");
        let before = Instant::now();
        let first = calls.start(peer).expect("registered");
        let second = calls.start(peer).expect("registered");
        assert_eq!(registered.0.idle_since(), None);
        drop(first);
        assert_eq!(registered.0.idle_since(), None);
        drop(second);
        let idle_since = registered.0.idle_since().expect("idle");
        // Millisecond resolution.
        assert!(
            idle_since + Duration::from_millis(1) >= before,
            "{idle_since:?} vs {before:?}"
        );
        drop(registered);
        assert!(calls.start(peer).is_none(), "the entry goes with the connection");
        assert!(Calls::new(false).register(peer).is_none());
    }
}
