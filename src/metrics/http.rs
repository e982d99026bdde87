//! A tiny HTTP/1.1 server for `/metrics`, `/healthz` and `/readyz`.
//!
//! One request per connection: read the request head (at most 8 KiB, within 5 s), answer, close.
//! Every connection has its own task and is bounded in time, so a slow or silent client holds
//! only its own connection; at most [`Limits::max_connections`] are served at once, so a flood
//! costs neither file descriptors the probes need nor time the control loop needs. The port is
//! on the node's address, open to every pod, and the kubelet's probes come to it too (from the
//! node's own address), so when every place is taken a newcomer takes one from the client
//! address holding the most, whatever its connections are doing (`places`): a pod whose
//! connections never read their answers (each holding its place up to the 5 s write timeout
//! and the 1 s linger) or never finish their requests cannot refuse the kubelet's `/healthz`
//! (which would restart a healthy agent) nor another pod's scrape. A host-network tenant shares
//! the node's address with the kubelet, so nothing tells its connections from the kubelet's
//! probes: a few more places are kept for `/healthz` and `/readyz` alone, where a newcomer no
//! place can be made for is let in. A connection cut before its answer was all handed to the
//! kernel is reset, so no unsent answer stays behind in the kernel. `GET` and `HEAD` are served;
//! the body of a request (there should be none) is never read.
//!
//! One job a file: `accept` takes connections and keeps the limits, `places` decides who gives
//! way, `conn` serves one connection (reads the head, writes the answer, lingers), `request`
//! finds where the head ends and parses its request line, `route` turns a request into an
//! endpoint's answer, and `response` is that answer as bytes; `tests` drives the whole server
//! over loopback.
//!
//! Written by hand rather than on hyper, by measurement (release builds, a simulated node, 2,000
//! scrapes then 100 silent clients): the agent's stripped binary is 4.4 MiB and its RSS 7 MiB
//! idle, 8.6 MiB after, while hyper's HTTP/1.1 server adds 261 KiB of binary and about 200 KiB
//! of RSS to a tokio server that answers the same, and meets a malformed head with its own bare
//! 400 where this one says what is wrong.

mod accept;
mod conn;
mod places;
mod request;
mod response;
mod route;
#[cfg(test)]
mod tests;

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use super::{Health, Metrics};

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
    /// More, kept for health checks: a newcomer no place can be made for takes one, and is
    /// answered only on `/healthz` and `/readyz` (`places`).
    probe_connections: usize,
}

const LIMITS: Limits = Limits {
    max_head: 8 * 1024,
    head_timeout: Duration::from_secs(5),
    write_timeout: Duration::from_secs(5),
    linger: Duration::from_secs(1),
    linger_bytes: 64 * 1024,
    max_connections: 64,
    probe_connections: 4,
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
    accept::run(listener, State { metrics, health, max_silence, clock }, LIMITS).await
}
