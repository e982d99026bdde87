//! A tiny HTTP/1.1 server for `/metrics`, `/healthz` and `/readyz`.
//!
//! One request per connection: read the request head (at most 8 KiB, within 5 s), answer, close.
//! Every connection has its own task and is bounded in time, so a slow or silent client holds
//! only its own connection; at most [`Limits::max_connections`] are served at once, so a flood
//! costs neither file descriptors the probes need nor time the control loop needs. When all of
//! them are taken, a new connection closes the oldest one still waiting for its request head:
//! clients that connect and say nothing cannot starve the kubelet's `/healthz` (which would
//! restart a healthy agent), and a new connection is closed at once only when every place is
//! busy answering. `GET` and `HEAD` are served; the body of a request (there should be none) is
//! never read.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::timeout;
use tracing::{debug, warn};

use super::{Health, Metrics};
use crate::waiting::{Reading, Waiting};

/// The content type of an OpenMetrics text exposition.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PLAIN: &str = "text/plain; charset=utf-8";

/// How long to wait before accepting again after the process ran out of file descriptors or
/// memory: the condition lasts, and retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What the server allows its clients.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// The longest request head; a longer one is answered 400.
    max_head: usize,
    /// Time for the whole request head to arrive; a client slower than that is dropped.
    head_timeout: Duration,
    /// Time for the answer to be written.
    write_timeout: Duration,
    /// After answering, how long to keep reading (and discarding) what the client still sends,
    /// so that closing with unread data does not reset the connection under the answer.
    linger: Duration,
    /// How much to read and discard at most while lingering.
    linger_bytes: usize,
    /// Connections served at once.
    max_connections: usize,
}

const LIMITS: Limits = Limits {
    max_head: 8 * 1024,
    head_timeout: Duration::from_secs(5),
    write_timeout: Duration::from_secs(5),
    linger: Duration::from_secs(1),
    linger_bytes: 64 * 1024,
    max_connections: 64,
};

/// What the endpoints read.
struct State {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    /// `/healthz` fails when the control loop has not turned for longer than this.
    max_silence: Duration,
    /// What time it is when a request is answered: the monotonic clock, or a test's.
    clock: Clock,
}

/// A source of the current instant.
type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` forever. Returns only when
/// accepting fails for a reason other than one client's connection or a passing shortage of
/// file descriptors or memory, with that error. Dropping the future closes every connection.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    max_silence: Duration,
) -> io::Error {
    let clock = Arc::new(Instant::now);
    serve_with(listener, State { metrics, health, max_silence, clock }, LIMITS).await
}

async fn serve_with(listener: TcpListener, state: State, limits: Limits) -> io::Error {
    let state = Arc::new(state);
    let mut connections = JoinSet::new();
    // The connections still reading their request head.
    let mut waiting = Waiting::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(done) = connections.join_next() => {
                if let Err(e) = done {
                    warn!(error = %e, "an HTTP connection task failed");
                }
                continue;
            }
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => match accept_error(&e) {
                AcceptError::OneConnection => continue,
                AcceptError::Shortage => {
                    warn!(error = %e, "accepting HTTP connections failed; retrying");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
                AcceptError::Fatal => return e,
            },
        };
        // Count only connections still being served.
        while let Some(done) = connections.try_join_next() {
            if let Err(e) = done {
                warn!(error = %e, "an HTTP connection task failed");
            }
        }
        if connections.len() >= limits.max_connections {
            if !waiting.evict_oldest() {
                debug!(%peer, limit = limits.max_connections, "too many HTTP connections; closing");
                continue;
            }
            debug!(
                limit = limits.max_connections,
                "too many HTTP connections; closing the oldest idle one"
            );
        }
        let reading = waiting.join();
        let state = state.clone();
        connections.spawn(async move {
            if let Err(e) = handle(stream, &state, limits, reading).await {
                debug!(%peer, error = %e, "HTTP connection failed");
            }
        });
    }
}

/// How bad an accept error is.
#[derive(Debug, PartialEq, Eq)]
enum AcceptError {
    /// Only the connection being accepted failed.
    OneConnection,
    /// Out of file descriptors or memory: try again a little later.
    Shortage,
    /// The listener itself is broken.
    Fatal,
}

fn accept_error(e: &io::Error) -> AcceptError {
    use io::ErrorKind::*;
    match (e.kind(), e.raw_os_error()) {
        (ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock, _) => {
            AcceptError::OneConnection
        }
        // accept(2): Linux passes the new connection's pending network errors on; and EPERM
        // is a firewall rule refusing it.
        (
            _,
            Some(
                libc::ENETDOWN
                | libc::EPROTO
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
                | libc::ETIMEDOUT
                | libc::EPERM,
            ),
        ) => AcceptError::OneConnection,
        (_, Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
            AcceptError::Shortage
        }
        _ => AcceptError::Fatal,
    }
}

/// Serves one connection: one request, one answer, then close.
async fn handle(
    mut stream: TcpStream,
    state: &State,
    limits: Limits,
    reading: Reading,
) -> io::Result<()> {
    let mut buf = vec![0; limits.max_head];
    let head = tokio::select! {
        head = timeout(limits.head_timeout, read_head(&mut stream, &mut buf)) => head,
        // Closed to make room: it had said nothing useful yet.
        () = reading.evicted() => return Ok(()),
    };
    drop(reading);
    let response = match head {
        // Too slow, or silent: not worth an answer.
        Err(_elapsed) => return Ok(()),
        Ok(head) => match head? {
            Head::Closed => return Ok(()),
            Head::Complete(len) => answer(parse(&buf[..len]), state, (state.clock)()),
            Head::Truncated => Response::bad_request("the connection closed mid-request"),
            Head::TooLarge => Response::bad_request("the request head is larger than 8 KiB"),
        },
    };
    let write = async {
        stream.write_all(&response.bytes).await?;
        stream.shutdown().await
    };
    timeout(limits.write_timeout, write).await.map_err(|_| io::ErrorKind::TimedOut)??;
    // Lingering close: a client whose request was not read to the end would otherwise get a
    // reset, which may destroy the answer before it reads it.
    let mut scratch = [0; 4096];
    let mut discarded = 0;
    let drain = async {
        while discarded < limits.linger_bytes {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => discarded += n,
            }
        }
    };
    let _ = timeout(limits.linger, drain).await;
    Ok(())
}

/// How reading a request head ended.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// The head is the first `usize` bytes of the buffer (its blank line included).
    Complete(usize),
    /// The client closed before sending anything.
    Closed,
    /// The client closed in the middle of the head.
    Truncated,
    /// The buffer filled without the head ending.
    TooLarge,
}

async fn read_head(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<Head> {
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            return Ok(Head::TooLarge);
        }
        let n = stream.read(&mut buf[filled..]).await?;
        if n == 0 {
            return Ok(if filled == 0 { Head::Closed } else { Head::Truncated });
        }
        // The blank line may straddle two reads.
        let from = filled.saturating_sub(3);
        filled += n;
        if let Some(end) = head_end(&buf[from..filled]) {
            return Ok(Head::Complete(from + end));
        }
    }
}

/// Where the head ends (after its blank line: CRLF CRLF, or a lenient LF LF), if it does.
fn head_end(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len()).find_map(|i| {
        let rest = &bytes[i..];
        if rest.starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else if rest.starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// The parts of a request the endpoints look at.
#[derive(Debug, PartialEq, Eq)]
struct Request<'a> {
    method: &'a str,
    /// The target less its query.
    path: &'a str,
}

/// Parses the request line; the headers are not needed. The error says what is wrong.
fn parse(head: &[u8]) -> Result<Request<'_>, &'static str> {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let line =
        std::str::from_utf8(&head[..line_end]).map_err(|_| "the request line is not UTF-8")?;
    let line = line.strip_suffix('\r').unwrap_or(line);
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("the request line is not METHOD /PATH HTTP/1.1");
    };
    if method.is_empty() || !method.bytes().all(is_token) {
        return Err("the method is not a token");
    }
    if !target.starts_with('/') {
        return Err("the target is not an absolute path");
    }
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Err("the version is not HTTP/1.0 or HTTP/1.1");
    }
    let path = target.split_once('?').map_or(target, |(path, _query)| path);
    Ok(Request { method, path })
}

/// RFC 9110's `tchar`.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Metrics,
    Healthz,
    Readyz,
}

/// The answer to `request`, received at `now`.
fn answer(request: Result<Request<'_>, &'static str>, state: &State, now: Instant) -> Response {
    let request = match request {
        Ok(request) => request,
        Err(why) => return Response::bad_request(why),
    };
    let endpoint = match request.path {
        "/metrics" => Endpoint::Metrics,
        "/healthz" => Endpoint::Healthz,
        "/readyz" => Endpoint::Readyz,
        _ => {
            let body = "not found: the paths are /metrics, /healthz and /readyz\n";
            return Response::new(Status::NotFound, PLAIN, body.into());
        }
    };
    let head_only = match request.method {
        "GET" => false,
        "HEAD" => true,
        _ => {
            let body = "method not allowed: use GET or HEAD\n";
            return Response::new(Status::MethodNotAllowed, PLAIN, body.into());
        }
    };
    let response = match endpoint {
        Endpoint::Metrics => Response::new(Status::Ok, OPENMETRICS, state.metrics.encode()),
        Endpoint::Healthz if state.health.live(now, state.max_silence) => {
            Response::new(Status::Ok, PLAIN, "ok\n".into())
        }
        Endpoint::Healthz => {
            let silence = state.health.silence(now);
            let body = format!(
                "not live: the control loop last turned {silence:.1?} ago (allowed: {:.1?})\n",
                state.max_silence
            );
            Response::new(Status::ServiceUnavailable, PLAIN, body)
        }
        Endpoint::Readyz if state.health.ready() => Response::new(Status::Ok, PLAIN, "ok\n".into()),
        Endpoint::Readyz => {
            let body = "not ready: no ruleset applied yet\n".into();
            Response::new(Status::ServiceUnavailable, PLAIN, body)
        }
    };
    if head_only {
        response.without_body()
    } else {
        response
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Ok,
    BadRequest,
    NotFound,
    MethodNotAllowed,
    ServiceUnavailable,
}

impl Status {
    fn line(self) -> &'static str {
        match self {
            Status::Ok => "200 OK",
            Status::BadRequest => "400 Bad Request",
            Status::NotFound => "404 Not Found",
            Status::MethodNotAllowed => "405 Method Not Allowed",
            Status::ServiceUnavailable => "503 Service Unavailable",
        }
    }
}

/// A whole response, ready to write.
#[derive(Debug)]
struct Response {
    bytes: Vec<u8>,
    /// Where the body starts in `bytes`.
    body_at: usize,
}

impl Response {
    fn new(status: Status, content_type: &str, body: String) -> Response {
        let allow = if status == Status::MethodNotAllowed { "Allow: GET, HEAD\r\n" } else { "" };
        let head = format!(
            "HTTP/1.1 {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}\
             Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            status.line(),
            body.len(),
        );
        let body_at = head.len();
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body.as_bytes());
        Response { bytes, body_at }
    }

    fn bad_request(why: &str) -> Response {
        Response::new(Status::BadRequest, PLAIN, format!("bad request: {why}\n"))
    }

    /// The same head (its Content-Length included), no body: the answer to HEAD.
    fn without_body(mut self) -> Response {
        self.bytes.truncate(self.body_at);
        self
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::ruleset::Route;

    /// Long enough for any answer on loopback; the tests never wait for it to pass.
    const PATIENCE: Duration = Duration::from_secs(10);

    struct Server {
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        /// How far the server's clock runs ahead of the monotonic clock, in ms: a test moves
        /// time on without waiting, and whatever the machine's uptime.
        ahead_ms: Arc<AtomicU64>,
        task: tokio::task::JoinHandle<io::Error>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn start(limits: Limits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let health = Arc::new(Health::new());
        let ahead_ms = Arc::new(AtomicU64::new(0));
        let ahead = ahead_ms.clone();
        let state = State {
            metrics: metrics.clone(),
            health: health.clone(),
            max_silence: Duration::from_secs(30),
            clock: Arc::new(move || {
                Instant::now() + Duration::from_millis(ahead.load(Ordering::Relaxed))
            }),
        };
        let task = tokio::spawn(serve_with(listener, state, limits));
        Server { addr, metrics, health, ahead_ms, task }
    }

    /// A response, split up.
    #[derive(Debug)]
    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            let found = self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name));
            found.map(|(_, v)| v.as_str())
        }
    }

    /// Sends `request` as it is and reads the reply until the server closes.
    async fn send(addr: SocketAddr, request: &[u8]) -> Reply {
        let exchange = async {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(request).await.unwrap();
            let mut raw = Vec::new();
            stream.read_to_end(&mut raw).await.unwrap();
            raw
        };
        let raw = timeout(PATIENCE, exchange).await.expect("no answer");
        let text = String::from_utf8(raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{text:?}"));
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap();
        let status = status_line.strip_prefix("HTTP/1.1 ").unwrap()[..3].parse().unwrap();
        let headers = lines
            .map(|l| l.split_once(": ").unwrap())
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect();
        let reply = Reply { status, headers, body: body.to_owned() };
        if let Some(len) = reply.header("Content-Length") {
            if !request.starts_with(b"HEAD ") {
                assert_eq!(len.parse::<usize>().unwrap(), reply.body.len(), "{reply:?}");
            }
        }
        reply
    }

    async fn get(addr: SocketAddr, path: &str) -> Reply {
        send(addr, format!("GET {path} HTTP/1.1\r\nHost: node\r\n\r\n").as_bytes()).await
    }

    #[tokio::test]
    async fn metrics_are_served_as_openmetrics() {
        let server = start(LIMITS).await;
        server.metrics.set_route(Route::Upstream);
        let reply = get(server.addr, "/metrics").await;
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header("Content-Type"), Some(OPENMETRICS));
        assert_eq!(reply.header("Connection"), Some("close"));
        assert!(reply.body.contains("\nnodelocaldns_ha_route{route=\"upstream\"} 1\n"));
        assert!(reply.body.ends_with("# EOF\n"));
        // A query string is ignored; HEAD gets the head alone.
        assert_eq!(get(server.addr, "/metrics?x=1").await.status, 200);
        let head = send(server.addr, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
        assert_eq!((head.status, head.body.as_str()), (200, ""));
        assert!(head.header("Content-Length").unwrap().parse::<usize>().unwrap() > 100);
    }

    #[tokio::test]
    async fn healthz_follows_the_control_loop_only() {
        let server = start(LIMITS).await;
        let healthz = || async { get(server.addr, "/healthz").await };
        server.health.beat(Instant::now());
        let reply = healthz().await;
        assert_eq!((reply.status, reply.body.as_str()), (200, "ok\n"));
        // The loop stops turning: live for the 30 s allowed, not after.
        server.ahead_ms.store(29_000, Ordering::Relaxed);
        assert_eq!(healthz().await.status, 200);
        server.ahead_ms.store(60_000, Ordering::Relaxed);
        let reply = healthz().await;
        assert_eq!(reply.status, 503, "{reply:?}");
        assert!(reply.body.starts_with("not live: the control loop last turned 60.0"), "{reply:?}");
        assert!(reply.body.ends_with("ago (allowed: 30.0s)\n"), "{reply:?}");
        // It turns again: live again.
        server.health.beat(Instant::now() + Duration::from_secs(60));
        assert_eq!(healthz().await.status, 200);
    }

    #[tokio::test]
    async fn readyz_waits_for_the_first_apply() {
        let server = start(LIMITS).await;
        let reply = get(server.addr, "/readyz").await;
        assert_eq!(reply.status, 503);
        assert_eq!(reply.body, "not ready: no ruleset applied yet\n");
        server.health.set_ready();
        let reply = get(server.addr, "/readyz").await;
        assert_eq!((reply.status, reply.body.as_str()), (200, "ok\n"));
    }

    #[tokio::test]
    async fn unknown_paths_and_methods_are_refused() {
        let server = start(LIMITS).await;
        assert_eq!(get(server.addr, "/").await.status, 404);
        assert_eq!(get(server.addr, "/metricsx").await.status, 404);
        let reply = send(server.addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").await;
        assert_eq!(reply.status, 405);
        assert_eq!(reply.header("Allow"), Some("GET, HEAD"));
        assert_eq!(send(server.addr, b"DELETE /readyz HTTP/1.0\r\n\r\n").await.status, 405);
    }

    #[tokio::test]
    async fn malformed_requests_get_400() {
        let server = start(LIMITS).await;
        for request in [
            &b"garbage\r\n\r\n"[..],
            b"GET /metrics\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/2.0\r\n\r\n",
            b"G(T /metrics HTTP/1.1\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
        ] {
            let reply = send(server.addr, request).await;
            assert_eq!(reply.status, 400, "{:?}: {reply:?}", String::from_utf8_lossy(request));
            assert!(reply.body.starts_with("bad request: "), "{reply:?}");
        }
        // Bare LFs are accepted.
        assert_eq!(send(server.addr, b"GET /healthz HTTP/1.1\n\n").await.status, 200);
    }

    #[tokio::test]
    async fn an_oversized_request_head_gets_400() {
        let server = start(LIMITS).await;
        let request = format!("GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(9 * 1024));
        let reply = send(server.addr, request.as_bytes()).await;
        assert_eq!(reply.status, 400, "{reply:?}");
        assert_eq!(reply.body, "bad request: the request head is larger than 8 KiB\n");
        // Just under the limit is fine.
        let pad = "a".repeat(8 * 1024 - 200);
        let request = format!("GET /readyz HTTP/1.1\r\nX-Pad: {pad}\r\n\r\n");
        assert_eq!(send(server.addr, request.as_bytes()).await.status, 503);
    }

    #[tokio::test]
    async fn a_silent_client_does_not_block_another() {
        let server = start(LIMITS).await;
        let silent = TcpStream::connect(server.addr).await.unwrap();
        // The second client is answered while the first still holds its connection.
        assert_eq!(get(server.addr, "/readyz").await.status, 503);
        assert_eq!(get(server.addr, "/healthz").await.status, 200);
        let mut buf = [0; 1];
        let still_open = silent.try_read(&mut buf).unwrap_err();
        assert_eq!(still_open.kind(), io::ErrorKind::WouldBlock);
    }

    #[tokio::test]
    async fn a_silent_client_is_dropped_after_the_head_timeout() {
        let limits = Limits { head_timeout: Duration::from_millis(50), ..LIMITS };
        let server = start(limits).await;
        let mut silent = TcpStream::connect(server.addr).await.unwrap();
        let mut raw = Vec::new();
        let closed = timeout(PATIENCE, silent.read_to_end(&mut raw)).await.expect("never closed");
        assert_eq!(closed.unwrap(), 0);
        // A client that sends part of a head and stops is dropped just the same.
        let mut slow = TcpStream::connect(server.addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\nHost:").await.unwrap();
        let closed = timeout(PATIENCE, slow.read_to_end(&mut raw)).await.expect("never closed");
        assert_eq!(closed.unwrap(), 0);
        assert_eq!(get(server.addr, "/healthz").await.status, 200);
    }

    #[tokio::test]
    async fn silent_clients_cannot_starve_healthz() {
        // As many silent clients as there are places (the real limit), and more coming.
        let server = start(LIMITS).await;
        let mut silent = Vec::new();
        for _ in 0..LIMITS.max_connections {
            silent.push(TcpStream::connect(server.addr).await.unwrap());
        }
        for round in 0..3 {
            let reply = timeout(PATIENCE, get(server.addr, "/healthz")).await.expect("starved");
            assert_eq!(reply.status, 200, "round {round}: {reply:?}");
            silent.push(TcpStream::connect(server.addr).await.unwrap());
        }
        // Each answered request took the place of the oldest silent client (a newer silent one
        // may have taken another's too): the first three were closed, long before 5 s.
        for (i, stream) in silent.iter_mut().enumerate().take(3) {
            let mut raw = Vec::new();
            let read = timeout(Duration::from_secs(2), stream.read_to_end(&mut raw)).await;
            assert!(matches!(read, Ok(Ok(0))), "silent client {i} still open: {read:?}");
        }
        let mut buf = [0; 1];
        let newest = silent.last().unwrap().try_read(&mut buf).unwrap_err();
        assert_eq!(newest.kind(), io::ErrorKind::WouldBlock, "the newest was closed");
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_are_closed_when_none_is_idle() {
        // Two clients whose requests were answered and who keep their end open: their
        // connections linger (busy, not idle), so a third is closed at once, not queued.
        let limits = Limits { max_connections: 2, linger: PATIENCE, ..LIMITS };
        let server = start(limits).await;
        let mut busy = Vec::new();
        for _ in 0..2 {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            stream.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
            let mut first = [0; 12];
            stream.read_exact(&mut first).await.unwrap();
            assert_eq!(&first, b"HTTP/1.1 200");
            busy.push(stream);
        }
        let mut third = TcpStream::connect(server.addr).await.unwrap();
        // The write may fail if the close came first: either way, no answer.
        let _ = third.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await;
        let mut raw = Vec::new();
        let read = timeout(PATIENCE, third.read_to_end(&mut raw)).await.expect("queued");
        // Closed without an answer (a reset, as the request was never read, or a plain close).
        assert!(read.is_err() || raw.is_empty(), "{:?}", String::from_utf8_lossy(&raw));
        drop(busy);
    }

    #[test]
    fn accept_errors_stop_the_server_only_when_the_listener_is_broken() {
        let os = io::Error::from_raw_os_error;
        assert_eq!(accept_error(&os(libc::ECONNABORTED)), AcceptError::OneConnection);
        assert_eq!(accept_error(&os(libc::EHOSTUNREACH)), AcceptError::OneConnection);
        assert_eq!(accept_error(&os(libc::EMFILE)), AcceptError::Shortage);
        assert_eq!(accept_error(&os(libc::ENOBUFS)), AcceptError::Shortage);
        assert_eq!(accept_error(&os(libc::EBADF)), AcceptError::Fatal);
        assert_eq!(accept_error(&os(libc::EINVAL)), AcceptError::Fatal);
    }

    #[test]
    fn the_head_ends_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
    }

    #[test]
    fn the_request_line_is_parsed() {
        let req = parse(b"GET /metrics?a=b HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(req, Request { method: "GET", path: "/metrics" });
        assert_eq!(parse(b"\r\n\r\n"), Err("the request line is not METHOD /PATH HTTP/1.1"));
    }
}
