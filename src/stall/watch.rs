//! The stall watch on the node: the cache's UDP sockets found with a dump, their queues looked
//! at with exact requests ([`QueueReader`]), one [`Detector`] each, confirm probes sent through
//! the cache's prober, and a stall reported to the control loop as a probe outcome of the cache's
//! UDP stream ([`Outcome::Stalled`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Bounds, Detector, Verdict, LOOK_BUSY};
use crate::health::Stream;
use crate::probe::{Outcome, ProbeResult, Prober, Report, Transport};
use crate::ruleset::DNS_PORT;
use crate::sockdiag::{listeners, Listener, QueueReader, Queued};

/// How long after finding no socket to watch (the cache is down, or restarting) the sockets are
/// listed again.
const RELIST: Duration = Duration::from_secs(1);

/// One watched socket.
struct Watched {
    socket: Listener,
    detector: Detector,
}

type Confirming<'a> = Pin<Box<dyn Future<Output = ProbeResult> + Send + 'a>>;

/// Watches the cache's UDP sockets on `addrs` for stalls, confirming with `confirm` (a probe of
/// `target` with [`Bounds::confirm`] as its timeout) and reporting each stall on `tx`. Runs until
/// the control loop is gone; if the kernel's socket diagnostics are unavailable it says so once
/// and leaves hang detection to the probes.
pub(crate) async fn watch_stalls(
    bounds: Bounds,
    addrs: Vec<IpAddr>,
    confirm: Arc<dyn Prober>,
    target: SocketAddr,
    tx: mpsc::Sender<Report>,
) {
    let mut reader = match QueueReader::open() {
        Ok(reader) => reader,
        Err(e) => {
            warn!(error = %e, "cannot read the cache's socket queues; hangs are left to the probes");
            return std::future::pending().await;
        }
    };
    let mut watched: Vec<Watched> = Vec::new();
    let mut list_due = Instant::now();
    let mut shared_said = Vec::new();
    let mut confirming: Option<Confirming<'_>> = None;
    let mut next = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            result = async { confirming.as_mut().expect("guarded").await }, if confirming.is_some() => {
                confirming = None;
                let now = Instant::now();
                let answered = result.outcome.is_good();
                debug!(answered, latency = ?result.latency, "stall watch: confirm probe");
                watched.iter_mut().for_each(|w| w.detector.confirmed(now, answered));
                continue;
            }
        }
        let now = Instant::now();
        if watched.is_empty() && now >= list_due {
            list_due = now + RELIST;
            watched = udp_sockets(&addrs, &mut shared_said)
                .await
                .into_iter()
                .map(|socket| Watched { socket, detector: Detector::new(bounds) })
                .collect();
        }
        let mut ask = false;
        let mut gone = false;
        for w in &mut watched {
            let queued = match reader.queued(&w.socket) {
                Ok(Queued::Bytes(bytes)) => bytes,
                Ok(Queued::Gone) => {
                    gone = true;
                    continue;
                }
                Err(e) => {
                    warn!(socket = %w.socket.local, error = %e, "cannot read the cache socket's queue");
                    gone = true;
                    continue;
                }
            };
            match w.detector.look(now, queued) {
                Verdict::Quiet => {}
                Verdict::Confirm => ask = true,
                Verdict::Stalled(stall) => {
                    info!(
                        socket = %w.socket.local,
                        queued_bytes = stall.queued_bytes,
                        not_draining_ms = stall.for_ms,
                        confirm_timeout = ?bounds.confirm(),
                        "cache socket stalled: queries wait unread and a probe got no answer"
                    );
                    let outcome =
                        Outcome::Stalled { queued_bytes: stall.queued_bytes, for_ms: stall.for_ms };
                    let latency = Duration::from_millis(stall.for_ms);
                    let result = ProbeResult { outcome, latency };
                    if tx.send(Report { stream: Stream::CacheUdp, result }).await.is_err() {
                        return;
                    }
                }
            }
        }
        if gone {
            // Replaced or closed: find what serves the addresses now.
            watched.clear();
            list_due = now;
        }
        if ask && confirming.is_none() {
            confirming = Some(confirm.probe(target, Transport::Udp));
        }
        let busy = watched.iter().any(|w| w.detector.busy());
        let step = if busy { LOOK_BUSY } else { bounds.look_idle };
        // On absolute deadlines, but never catching up a backlog of looks.
        next = (next + step).max(tokio::time::Instant::now());
    }
}

/// The UDP sockets serving port 53 on `addrs`, one per address. Several sockets on one address
/// are a reuseport group (kubespray's second cache): an exact request sees only the member the
/// kernel's hash picks, so such an address is left to the probes, said once in `said`.
async fn udp_sockets(addrs: &[IpAddr], said: &mut Vec<SocketAddr>) -> Vec<Listener> {
    let list = addrs.to_vec();
    let found = match tokio::task::spawn_blocking(move || listeners(&list, DNS_PORT)).await {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            debug!(error = %e, "stall watch: cannot list the cache's sockets");
            return Vec::new();
        }
        Err(_) => return Vec::new(),
    };
    let mut by_address: BTreeMap<SocketAddr, Vec<Listener>> = BTreeMap::new();
    for socket in found.into_iter().filter(|s| s.transport == Transport::Udp) {
        by_address.entry(socket.local).or_default().push(socket);
    }
    let mut sockets = Vec::new();
    for (local, group) in by_address {
        match group.as_slice() {
            [one] => sockets.push(*one),
            _ if !said.contains(&local) => {
                said.push(local);
                info!(
                    socket = %local,
                    sockets = group.len(),
                    "several sockets share this address (SO_REUSEPORT): its stalls are left to the probes"
                );
            }
            _ => {}
        }
    }
    sockets
}
