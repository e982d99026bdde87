//! The stall watch on the node: the cache's UDP sockets found with a dump, their queues looked
//! at with exact requests ([`QueueReader`]), one [`Detector`] each, confirm probes sent to the
//! suspected socket's own address through the cache's prober, and a stall reported to the
//! control loop as a probe outcome of the cache's UDP stream ([`Outcome::Stalled`]). On a node
//! without traffic ([`Traffic`]) it looks every [`QUIET_LOOK`] instead of every `look_idle`, and
//! at the quiet pace ([`crate::pace`]) every quiet period: it is the watch that says whether the
//! node is quiet.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::traffic::{DatagramsSent, Traffic, QUIET_LOOK};
use super::{Bounds, Detector, Verdict, LOOK_BUSY};
use crate::beat::Beat;
use crate::health::Stream;
use crate::pace::Pace;
use crate::probe::{Outcome, ProbeResult, Prober, Report, Transport};
use crate::ruleset::DNS_PORT;
use crate::sockdiag::{listeners, Listener, QueueReader, Queued};

/// How often the sockets are listed again while a listen address has none watched (the cache
/// is down or restarting, or a socket could not be read). A cache probe answered meanwhile
/// (`answered`) lists them at once: a restarted cache is watched from its first answer.
const RELIST: Duration = Duration::from_secs(1);

/// One watched socket, and where its confirm probes go.
struct Watched {
    socket: Listener,
    target: SocketAddr,
    detector: Detector,
    /// When its confirm probe in flight was sent.
    confirming: Option<Instant>,
}

/// How many UDP datagrams a second the agent's own probes and heartbeats make the node send
/// ([`Traffic`]), at the fast pace and at the quiet one.
#[derive(Clone, Copy, Debug)]
pub struct Own {
    pub fast: f64,
    pub quiet: f64,
}

/// Watches the cache's UDP sockets on `addrs` for stalls, confirming with `confirm` (a probe
/// with [`Bounds::confirm`] as its timeout) and reporting each stall on `tx`, looking on the
/// agent's grid (`beat`) while no queue holds, and telling `pace` whether the node is quiet
/// (no traffic beyond the agent's `own`, every address watched, nothing queued);
/// `answered` is told of every cache probe answered. Runs until the control loop is gone; if
/// the kernel's socket diagnostics are unavailable it says so once and leaves hang detection
/// to the probes (and the node never quiet).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn watch_stalls(
    bounds: Bounds,
    beat: Beat,
    addrs: Vec<IpAddr>,
    own: Own,
    pace: Arc<Pace>,
    confirm: Arc<dyn Prober>,
    answered: Arc<Notify>,
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
    // Addresses whose sockets are left to the probes (a reuseport group), said once each.
    let mut said = Vec::new();
    let mut list_due = Instant::now();
    let mut error_said = false;
    // Confirm probes in flight: the socket's cookie, when sent, the outcome.
    let mut probes: JoinSet<(u64, Instant, ProbeResult)> = JoinSet::new();
    let v6 = addrs.iter().any(IpAddr::is_ipv6);
    let mut traffic = Traffic::new(own.fast, Instant::now());
    let mut told = pace.subscribe();
    let mut sent = DatagramsSent::open(v6);
    let (mut read_due, mut was_seen) = (Instant::now(), true);
    let quiet = bounds.look_idle.max(QUIET_LOOK);
    let mut next = tokio::time::Instant::now();
    let mut timer = beat.timer();
    loop {
        let uncovered = !covered(&addrs, &watched);
        tokio::select! {
            () = timer.sleep_until(next) => {}
            // Fast again (a probe failed, the route changed): the next look on the fast grid.
            Ok(()) = told.changed() => {
                if !pace.is_quiet() {
                    next = next.min(beat.next(tokio::time::Instant::now(), quiet));
                }
                continue;
            }
            // The cache answers where no socket is watched: it is back, list its sockets now.
            () = answered.notified(), if uncovered => list_due = Instant::now(),
            Some(Ok((cookie, sent, result))) = probes.join_next(), if !probes.is_empty() => {
                // Any reply shows the cache read the query; only silence is a stall's.
                let answered = !matches!(result.outcome, Outcome::Timeout | Outcome::Error { .. });
                debug!(answered, latency = ?result.latency, "stall watch: confirm probe");
                if let Some(w) = watched.iter_mut().find(|w| w.socket.cookie == cookie) {
                    w.confirming = None;
                    w.detector.confirmed(Instant::now(), sent, answered);
                }
                continue;
            }
        }
        let now = Instant::now();
        if now >= read_due {
            read_due = now + QUIET_LOOK;
            traffic.set_own_per_sec(if pace.is_quiet() { own.quiet } else { own.fast });
            traffic.read(now, sent.read());
            if traffic.seen(now) != was_seen {
                was_seen = !was_seen;
                let every = if was_seen { bounds.look_idle } else { pace.period(quiet) };
                debug!(traffic = was_seen, ?every, "stall watch: looking");
            }
        }
        if now >= list_due && !covered(&addrs, &watched) {
            list_due = now + RELIST;
            let found = udp_sockets(&addrs, &mut said).await;
            // Sockets still there keep their detectors; new ones start afresh.
            let mut kept: Vec<Watched> = Vec::new();
            let mut added = false;
            for socket in found {
                let target = probe_target(socket.local, &addrs);
                match watched.iter().position(|w| w.socket.cookie == socket.cookie) {
                    Some(i) => kept.push(watched.swap_remove(i)),
                    None => {
                        added = true;
                        let detector = Detector::new(bounds);
                        kept.push(Watched { socket, target, detector, confirming: None });
                    }
                }
            }
            // `watched` holds what is gone.
            if added || !watched.is_empty() {
                let sockets: Vec<String> =
                    kept.iter().map(|w| w.socket.local.to_string()).collect();
                debug!(?sockets, "stall watch: watching");
            }
            watched = kept;
        }
        let mut lost = false;
        let mut i = 0;
        while i < watched.len() {
            let w = &mut watched[i];
            let queued = match reader.queued(&w.socket) {
                Ok(Queued::Bytes(bytes)) => bytes,
                Ok(Queued::Gone) => {
                    // Replaced or closed: find what serves the address now.
                    watched.swap_remove(i);
                    lost = true;
                    continue;
                }
                Err(e) => {
                    // Said once; the sockets are listed again every RELIST after that.
                    if !error_said {
                        error_said = true;
                        warn!(socket = %w.socket.local, error = %e, "cannot read the cache socket's queue");
                    }
                    watched.swap_remove(i);
                    list_due = now + RELIST;
                    continue;
                }
            };
            i += 1;
            if let Verdict::Stalled(stall) = w.detector.look(now, queued) {
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
            // One probe in flight per socket; a window that began after it asks again.
            if w.detector.asking() && w.confirming.is_none() {
                w.confirming = Some(now);
                let (prober, target, cookie) = (confirm.clone(), w.target, w.socket.cookie);
                probes.spawn(
                    async move { (cookie, now, prober.probe(target, Transport::Udp).await) },
                );
            }
        }
        if lost {
            list_due = now;
        }
        let busy = watched.iter().any(|w| w.detector.busy());
        let seen = traffic.seen(now);
        pace.node_quiet(!busy && !seen && probes.is_empty() && covered(&addrs, &watched));
        let step = if busy {
            LOOK_BUSY
        } else if seen {
            bounds.look_idle
        } else {
            pace.period(quiet)
        };
        // On the grid (with the probes' ticks) unless a queue holds; never catching up a
        // backlog of looks; with nothing to watch (the cache is down), not before the next
        // listing.
        let now = tokio::time::Instant::now();
        next = if step == LOOK_BUSY { now + step } else { beat.next(now, step) };
        if watched.is_empty() {
            next = next.max(list_due.into());
        }
    }
}

/// Whether every address in `addrs` is served by a watched socket. Until then the sockets are
/// listed again every [`RELIST`] (a reuseport group too, which may have become one socket).
fn covered(addrs: &[IpAddr], watched: &[Watched]) -> bool {
    let serves = |ip: &IpAddr| {
        watched.iter().any(|w| crate::sockdiag::serves_port(w.socket.local, &[*ip], DNS_PORT))
    };
    addrs.iter().all(serves)
}

/// Where a socket's confirm probe goes: its own address, or for a wildcard socket the listen
/// address of its family (else the first).
fn probe_target(local: SocketAddr, addrs: &[IpAddr]) -> SocketAddr {
    let ip = if local.ip().is_unspecified() {
        *addrs.iter().find(|a| a.is_ipv4() == local.is_ipv4()).unwrap_or(&addrs[0])
    } else {
        local.ip()
    };
    SocketAddr::new(ip, DNS_PORT)
}

/// The UDP sockets serving port 53 on `addrs`, one per address. Several sockets on one address
/// are a reuseport group (kubespray's second cache): an exact request sees only the member the
/// kernel's hash picks, so such an address is left to the probes, said once (`said`).
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
