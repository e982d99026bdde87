//! The server driven over loopback, as a client sees it: the endpoints' answers, malformed and
//! oversized requests, and the limits on slow, silent and surplus clients.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::route::{OPENMETRICS, TEXT_FORMAT};
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
    let task = tokio::spawn(accept::run(listener, state, limits));
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
async fn metrics_are_served_as_openmetrics_to_who_asks_and_as_text_to_others() {
    let server = start(LIMITS).await;
    server.metrics.set_route(Route::Upstream);
    let accept = "Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5";
    let asked = format!("GET /metrics HTTP/1.1\r\n{accept}\r\n\r\n");
    let reply = send(server.addr, asked.as_bytes()).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header("Content-Type"), Some(OPENMETRICS));
    assert_eq!(reply.header("Connection"), Some("close"));
    assert!(reply.body.contains("\nnodelocaldns_ha_route{route=\"upstream\"} 1\n"));
    assert!(reply.body.ends_with("# EOF\n"));
    let text = get(server.addr, "/metrics").await;
    assert_eq!(text.header("Content-Type"), Some(TEXT_FORMAT));
    assert!(text.body.contains("\nnodelocaldns_ha_route{route=\"upstream\"} 1\n"));
    assert!(text.body.contains("\n# TYPE nodelocaldns_ha_probes_total counter\n"), "{text:?}");
    assert!(!text.body.contains("# EOF"));
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
async fn readyz_fails_while_something_is_waited_for() {
    let server = start(LIMITS).await;
    server.health.set_ready();
    server.health.set_waiting(Some("the upstream's Service kube-dns-upstream".into()));
    let reply = get(server.addr, "/readyz").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.body, "not ready: waiting for the upstream's Service kube-dns-upstream\n");
    assert!(server.health.applied(), "the ruleset is in all the same");
    server.health.set_waiting(None);
    assert_eq!(get(server.addr, "/readyz").await.status, 200);
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
    // connections linger (busy, not idle), so a third is closed at once, not queued (with no
    // place kept for health checks: the test below has them).
    let limits = Limits { max_connections: 2, linger: PATIENCE, probe_connections: 0, ..LIMITS };
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

#[tokio::test]
async fn an_address_holding_every_place_gives_one_to_another() {
    // As in the test above, every place is held by a connection whose answer is out and which
    // lingers, but these are of 127.0.0.2: a client of another address is answered at once, in
    // the place of one of them (which one: `places`' tests).
    let limits = Limits { max_connections: 2, linger: PATIENCE, ..LIMITS };
    let server = start(limits).await;
    let mut greedy = Vec::new();
    for _ in 0..2 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut stream = socket.connect(server.addr).await.unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
        let mut first = [0; 12];
        stream.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        greedy.push(stream);
    }
    let reply = timeout(Duration::from_secs(2), get(server.addr, "/healthz")).await;
    assert_eq!(reply.expect("kept out").status, 200);
    drop(greedy);
}

#[tokio::test]
async fn health_checks_keep_places_of_their_own() {
    // Every place held by connections of the kubelet's own address whose answers are out and
    // which linger, as a host-network tenant's: a newcomer of that address is let in a place
    // kept for health checks, where /healthz and /readyz are answered and /metrics is not.
    let limits = Limits { max_connections: 2, linger: PATIENCE, probe_connections: 1, ..LIMITS };
    let server = start(limits).await;
    server.health.set_ready();
    let mut tenant = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        stream.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.unwrap();
        let mut first = [0; 12];
        stream.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        tenant.push(stream);
    }
    for path in ["/healthz", "/readyz", "/healthz"] {
        let reply = timeout(Duration::from_secs(2), get(server.addr, path)).await;
        assert_eq!(reply.expect("kept out").status, 200, "{path}");
    }
    let busy = timeout(Duration::from_secs(2), get(server.addr, "/metrics")).await;
    let busy = busy.expect("kept out");
    assert_eq!(busy.status, 503, "{busy:?}");
    assert!(busy.body.contains("kept for /healthz and /readyz"), "{busy:?}");
    drop(tenant);
}
