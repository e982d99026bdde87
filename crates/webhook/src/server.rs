//! The webhook's two listeners: HTTPS for the API server (`POST /mutate`, and `/healthz`,
//! `/readyz`, `/metrics`), and plain HTTP for the kubelet's probes and Prometheus (`/metrics`,
//! `/healthz`, `/readyz`). HTTP/2 and HTTP/1.1 on both, by hyper.
//!
//! Either port is open to every pod, so whatever a client can make the webhook hold is bounded,
//! and no client can keep the API server or the kubelet out:
//!
//! * **Places.** A port serves [`HTTPS_PLACES`] (or [`HTTP_PLACES`]) connections at once,
//!   shared by client address ([`places`]): a newcomer takes the place of the greediest
//!   address's oldest connection, or of its own address's oldest idle one.
//! * **Time.** A connection with no request in flight is closed after [`IDLE`], counted from
//!   its accept (its TLS handshake, the protocol hyper sniffs, its first request's head all
//!   within it) and from its last request's end; told to close (a GOAWAY), it is cut
//!   [`GRACE`] later. A request's body must be in, and its answer decided, within
//!   [`REQUEST_TIME`] of its head.
//! * **Memory.** Bodies are refused over [`MAX_BODY`]. Each connection may have [`RESERVE`]
//!   bytes of bodies in flight on its own; a body that does not fit there takes one of
//!   [`LARGE_BODIES`] buffers of [`MAX_BODY`], first come first served, before a byte of it is
//!   read. The buffers are kept and used again: large bodies never make the allocator hand out
//!   and take back megabytes (glibc keeps what it took back for a while, in every thread's
//!   arena). Reviews in those buffers are decided one at a time, on a thread of their own, so
//!   that the runtime's threads go on serving the others. HTTP/2 lets a connection have
//!   [`H2_STREAMS`] streams open, headers of [`H2_HEADER_LIST`] bytes, and [`H2_WINDOW`] bytes
//!   sent ahead of what the webhook read; HTTP/1.1 buffers [`H1_BUFFER`] bytes. What a review
//!   costs to decide is bounded by its body ([`review`]).
//!
//! A review is answered by [`review::answer`]; what cannot be read is answered with an HTTP error
//! (the API server then admits the pod unmutated, by the configuration's `failurePolicy:
//! Ignore`), logged once (a client's text cut short), and counted.

mod places;

use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use self::places::{Occupant, Places};
use crate::metrics::Metrics;
use crate::mutate::Settings;
use crate::review::{self, Answer, Outcome};

/// The largest body taken: the API server refuses requests over 3 MiB, and a CREATE's review
/// carries the object once.
pub const MAX_BODY: usize = 4 * 1024 * 1024;
/// Connections served at once on the HTTPS port.
pub const HTTPS_PLACES: usize = 64;
/// Connections served at once on the metrics port.
pub const HTTP_PLACES: usize = 16;
/// A connection with no request in flight is closed after this.
pub const IDLE: Duration = Duration::from_secs(10);
/// A connection told to close is cut this long after, whatever it is doing: time for a request
/// that crossed the GOAWAY to be answered.
pub const GRACE: Duration = REQUEST_TIME;
/// A request's body read and its answer decided within this, from its head.
pub const REQUEST_TIME: Duration = Duration::from_secs(10);
/// Bytes of review bodies a connection may have in flight of its own: a pod's review is a few
/// KiB.
pub const RESERVE: usize = 64 * 1024;
/// Review bodies in flight beyond the connections' own [`RESERVE`], each in a buffer of
/// [`MAX_BODY`].
pub const LARGE_BODIES: usize = 2;
/// HTTP/2 streams a connection may have open (hyper's default is 200): the API server opens
/// another connection when it needs more.
pub const H2_STREAMS: u32 = 32;
/// The largest HTTP/2 header list (hyper's default).
pub const H2_HEADER_LIST: u32 = 16 * 1024;
/// What an HTTP/2 client may send on a connection, and on a stream, ahead of what the webhook
/// read (hyper's default is 1 MiB).
pub const H2_WINDOW: u32 = 64 * 1024;
/// What HTTP/1.1 buffers of a connection's input (hyper's default is about 400 KiB); a request
/// head must fit.
pub const H1_BUFFER: usize = 16 * 1024;

/// What the handlers share.
#[derive(Debug)]
pub struct Webhook {
    pub settings: Settings,
    pub metrics: Metrics,
    /// The turns to use one of the [`LARGE_BODIES`] buffers.
    large: Arc<Semaphore>,
    /// The buffers not in use.
    buffers: Arc<Mutex<Vec<Vec<u8>>>>,
    /// The turn to decide a review in one of the large buffers.
    deciding: Arc<Semaphore>,
}

impl Webhook {
    pub fn new(settings: Settings, metrics: Metrics) -> Webhook {
        let large = Arc::new(Semaphore::new(LARGE_BODIES));
        let buffers = Arc::new(Mutex::new(Vec::with_capacity(LARGE_BODIES)));
        Webhook { settings, metrics, large, buffers, deciding: Arc::new(Semaphore::new(1)) }
    }
}

/// Which port a connection came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Port {
    /// HTTPS: reviews, and the rest.
    Reviews,
    /// Plain HTTP: `/metrics`, `/healthz`, `/readyz`.
    Metrics,
}

/// Serves reviews over TLS on `listener` until accepting fails.
pub async fn serve_https(
    listener: TcpListener,
    tls: TlsAcceptor,
    hook: Arc<Webhook>,
) -> std::io::Error {
    accept(listener, hook, Port::Reviews, HTTPS_PLACES, move |tcp| {
        let tls = tls.clone();
        async move {
            match tls.accept(tcp).await {
                Ok(stream) => Some(stream),
                Err(e) => {
                    tracing::debug!(error = %e, "TLS handshake failed");
                    None
                }
            }
        }
    })
    .await
}

/// Serves `/metrics`, `/healthz` and `/readyz` over plain HTTP on `listener`.
pub async fn serve_http(listener: TcpListener, hook: Arc<Webhook>) -> std::io::Error {
    accept(listener, hook, Port::Metrics, HTTP_PLACES, |tcp| async move { Some(tcp) }).await
}

/// What a connection does, as its place knows it.
#[derive(Debug)]
struct Activity {
    /// Its requests in flight, and since when it has had none.
    state: Mutex<(usize, Instant)>,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity { state: Mutex::new((0, Instant::now())) })
    }

    /// A request begins; it ends when the guard is dropped.
    fn begin(self: &Arc<Self>) -> InFlight {
        self.state.lock().unwrap().0 += 1;
        InFlight(self.clone())
    }

    /// When the connection will have been idle for [`IDLE`], if it stays as it is (while a
    /// request is in flight: [`IDLE`] from now, to look again).
    fn idle_until(&self) -> Instant {
        let (in_flight, since) = *self.state.lock().unwrap();
        if in_flight > 0 {
            Instant::now() + IDLE
        } else {
            since + IDLE
        }
    }
}

/// A request in flight.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap();
        state.0 -= 1;
        if state.0 == 0 {
            state.1 = Instant::now();
        }
    }
}

/// A connection in its place: how busy it is, and how it is told to go.
struct Connection {
    activity: Arc<Activity>,
    evict: oneshot::Sender<()>,
}

impl Occupant for Connection {
    fn busy(&self) -> bool {
        self.activity.state.lock().unwrap().0 > 0
    }
}

/// A connection's place, given up when its task ends.
struct Place {
    places: Arc<Mutex<Places<Connection>>>,
    client: IpAddr,
    id: u64,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.lock().unwrap().leave(self.client, self.id);
    }
}

async fn accept<S, F, Fut>(
    listener: TcpListener,
    hook: Arc<Webhook>,
    port: Port,
    limit: usize,
    wrap: F,
) -> std::io::Error
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = Option<S>> + Send + 'static,
{
    let places = Arc::new(Mutex::new(Places::new(limit)));
    let http = http_builder();
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            // One client's connection failing, or a passing shortage: go on.
            Err(e) if is_transient(&e) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return e,
        };
        let activity = Activity::new();
        let (evict, evicted) = oneshot::channel();
        let connection = Connection { activity: activity.clone(), evict };
        let admitted = places.lock().unwrap().admit(peer.ip(), connection);
        let Some(admitted) = admitted else {
            hook.metrics.cut("refused");
            continue;
        };
        if let Some(other) = admitted.evicted {
            hook.metrics.cut("evicted");
            let _ = other.evict.send(());
        }
        let place = Place { places: places.clone(), client: peer.ip(), id: admitted.id };
        let (stream, hook, http) = (wrap(tcp), hook.clone(), http.clone());
        tokio::spawn(async move {
            let _place = place;
            serve(stream, port, hook, http, activity, evicted).await;
        });
    }
}

/// hyper's server, for both protocols, with the bounds of the module's doc.
fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(IDLE).max_buf_size(H1_BUFFER);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(IDLE))
        .max_concurrent_streams(H2_STREAMS)
        .max_header_list_size(H2_HEADER_LIST)
        .initial_stream_window_size(H2_WINDOW)
        .initial_connection_window_size(H2_WINDOW)
        .max_send_buf_size(H2_WINDOW as usize);
    builder
}

/// Serves one connection: `stream` once it is ready (the TLS handshake), until it ends, is
/// evicted, or has been idle for [`IDLE`] (told to close, then cut [`GRACE`] later).
async fn serve<S>(
    stream: impl Future<Output = Option<S>>,
    port: Port,
    hook: Arc<Webhook>,
    http: auto::Builder<TokioExecutor>,
    activity: Arc<Activity>,
    mut evicted: oneshot::Receiver<()>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let ready = tokio::select! {
        stream = tokio::time::timeout_at(activity.idle_until(), stream) => stream,
        _ = &mut evicted => return,
    };
    let stream = match ready {
        Ok(Some(stream)) => stream,
        Ok(None) => return,
        Err(_) => {
            hook.metrics.cut("idle");
            return;
        }
    };
    let reserve = Arc::new(Semaphore::new(RESERVE));
    let service = service_fn({
        let (hook, activity) = (hook.clone(), activity.clone());
        move |req| {
            let in_flight = activity.begin();
            let (hook, reserve) = (hook.clone(), reserve.clone());
            async move {
                let response = handle(req, port, &hook, &reserve).await;
                drop(in_flight);
                Ok::<_, Infallible>(response)
            }
        }
    });
    let conn = http.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut closing = None;
    loop {
        let wake = closing.map_or_else(|| activity.idle_until(), |at| at + GRACE);
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "connection ended");
                }
                return;
            }
            _ = &mut evicted => return,
            () = tokio::time::sleep_until(wake) => {
                if closing.is_some() {
                    return;
                }
                if activity.idle_until() <= Instant::now() {
                    hook.metrics.cut("idle");
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now());
                }
            }
        }
    }
}

/// An accept error that ends one client's connection (it was reset while queued) or comes of a
/// passing shortage (ENFILE, EMFILE, ENOBUFS, ENOMEM), rather than of the listener.
fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
    matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted)
        || matches!(e.raw_os_error(), Some(23 | 24 | 105 | 12))
}

async fn handle(
    req: Request<Incoming>,
    port: Port,
    hook: &Arc<Webhook>,
    reserve: &Arc<Semaphore>,
) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path(), port) {
        (&Method::POST, "/mutate", Port::Reviews) => mutate(req, hook, reserve).await,
        (&Method::GET, "/healthz" | "/readyz", _) => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/metrics", _) => {
            let mut response = Response::new(Full::from(hook.metrics.encode()));
            let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
            response.headers_mut().insert(CONTENT_TYPE, kind.parse().expect("a header value"));
            response
        }
        (_, "/mutate", Port::Reviews) | (_, "/healthz" | "/readyz" | "/metrics", _) => {
            text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        (_, _, Port::Reviews) => {
            text(StatusCode::NOT_FOUND, "not found: /mutate, /healthz, /readyz, /metrics\n")
        }
        (_, _, Port::Metrics) => {
            text(StatusCode::NOT_FOUND, "not found: /metrics, /healthz, /readyz\n")
        }
    }
}

async fn mutate(
    req: Request<Incoming>,
    hook: &Arc<Webhook>,
    reserve: &Arc<Semaphore>,
) -> Response<Full<Bytes>> {
    let started = std::time::Instant::now();
    let deadline = Instant::now() + REQUEST_TIME;
    let declared = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
    if declared.is_some_and(|n: usize| n > MAX_BODY) {
        return too_large(hook);
    }
    let Ok(mut room) = tokio::time::timeout_at(deadline, Room::take(declared, reserve, hook)).await
    else {
        return timed_out(hook, "no room for a review's body");
    };
    match tokio::time::timeout_at(deadline, read(req.into_body(), &mut room)).await {
        Ok(Ok(())) => {}
        Ok(Err(ReadError::TooLarge)) => return too_large(hook),
        Ok(Err(ReadError::Failed(e))) => {
            tracing::warn!(error = %e, "a review's body could not be read");
            return text(StatusCode::BAD_REQUEST, "the body could not be read\n");
        }
        Err(_) => return timed_out(hook, "a review's body did not arrive in time"),
    }
    let answer = if room.pool.is_some() {
        // Large: decided on a thread of its own, one at a time, so that the runtime's threads
        // go on serving the other connections (the kubelet's probes among them). The turn and
        // the room go with the body: a client that leaves meanwhile frees neither before the
        // thread is done with it.
        let turn = hook.deciding.clone().acquire_owned();
        let Ok(turn) = tokio::time::timeout_at(deadline, turn).await else {
            return timed_out(hook, "no turn to decide a large review");
        };
        let turn = turn.expect("the turn is never closed");
        let settings = hook.settings.clone();
        let decided = tokio::task::spawn_blocking(move || {
            let answer = review::answer(&room.body, &settings);
            drop((turn, room));
            answer
        });
        match decided.await {
            Ok(answer) => answer,
            Err(e) => {
                tracing::error!(error = %e, "deciding a review failed");
                return text(StatusCode::INTERNAL_SERVER_ERROR, "the review failed\n");
            }
        }
    } else {
        let answer = review::answer(&room.body, &hook.settings);
        drop(room);
        answer
    };
    respond(answer, hook, started)
}

fn respond(answer: Answer, hook: &Webhook, started: std::time::Instant) -> Response<Full<Bytes>> {
    hook.metrics.review(&answer.outcome, started.elapsed());
    match &answer.outcome {
        Outcome::Mutated => tracing::info!("mutated a pod"),
        Outcome::Skipped(skip) => tracing::debug!(reason = skip.as_str(), "left a pod alone"),
        Outcome::Unexpected(what) => tracing::warn!(what, "allowed as it is, unpatched"),
        Outcome::Malformed(why) => tracing::warn!(why, "refused a request that is no review"),
    }
    let mut response = Response::new(Full::from(answer.body));
    *response.status_mut() = StatusCode::from_u16(answer.status).expect("a valid status");
    response
        .headers_mut()
        .insert(CONTENT_TYPE, "application/json".parse().expect("a header value"));
    response
}

/// The room a body takes while its review is read and decided.
struct Room {
    /// The body, as it is read.
    body: Vec<u8>,
    /// Its most bytes: what it declared, or [`MAX_BODY`].
    size: usize,
    /// Where the buffer goes back once the review is decided, if it is one of the
    /// [`LARGE_BODIES`].
    pool: Option<Arc<Mutex<Vec<Vec<u8>>>>>,
    _permit: OwnedSemaphorePermit,
}

impl Room {
    /// Room for a body that declared `declared` bytes (at most [`MAX_BODY`]): of the
    /// connection's `reserve` if it fits there now, else one of the webhook's large buffers once
    /// one is free.
    async fn take(declared: Option<usize>, reserve: &Arc<Semaphore>, hook: &Webhook) -> Room {
        let size = declared.unwrap_or(MAX_BODY);
        if size <= RESERVE {
            let permits = u32::try_from(size).expect("at most RESERVE");
            if let Ok(permit) = reserve.clone().try_acquire_many_owned(permits) {
                return Room { body: Vec::with_capacity(size), size, pool: None, _permit: permit };
            }
        }
        let permit = hook.large.clone().acquire_owned().await.expect("never closed");
        let body = hook.buffers.lock().unwrap().pop();
        let body = body.unwrap_or_else(|| Vec::with_capacity(MAX_BODY));
        Room { body, size, pool: Some(hook.buffers.clone()), _permit: permit }
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            let mut body = std::mem::take(&mut self.body);
            body.clear();
            pool.lock().unwrap().push(body);
        }
    }
}

/// Why a body was not read.
enum ReadError {
    /// Over its room.
    TooLarge,
    /// The connection failed, or sent what is no body.
    Failed(hyper::Error),
}

/// Reads a body into its room.
async fn read(body: Incoming, room: &mut Room) -> Result<(), ReadError> {
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ReadError::Failed)?;
        if let Ok(data) = frame.into_data() {
            if room.body.len() + data.len() > room.size {
                return Err(ReadError::TooLarge);
            }
            room.body.extend_from_slice(&data);
        }
    }
    Ok(())
}

fn too_large(hook: &Webhook) -> Response<Full<Bytes>> {
    hook.metrics.too_large();
    tracing::warn!(limit = MAX_BODY, "refused a review over the size limit");
    text(StatusCode::PAYLOAD_TOO_LARGE, "the body is over the size limit\n")
}

fn timed_out(hook: &Webhook, what: &'static str) -> Response<Full<Bytes>> {
    hook.metrics.timed_out();
    tracing::warn!(within = ?REQUEST_TIME, "{what}");
    text(StatusCode::REQUEST_TIMEOUT, "the review did not come through in time\n")
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::from(body));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests;
