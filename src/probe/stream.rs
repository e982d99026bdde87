//! A probe stream: one server probed on a cadence, and at once when woken, its results sent to
//! the control loop as [`Report`]s.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

use super::{Probe, Transport};
use crate::agent::Report;
use crate::health::Stream;

/// Probes `target` every `cadence.interval`, and at once when `wake` is notified.
pub(crate) async fn probe_stream(
    probe: Arc<Probe>,
    target: std::net::SocketAddr,
    transport: Transport,
    stream: Stream,
    interval: Duration,
    wake: Arc<Notify>,
    tx: mpsc::Sender<Report>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = wake.notified() => {}
        }
        // A wake-up during a probe means a cache socket just closed: the query may have gone to
        // a socket that is closing too, and would only time out. Ask again.
        let result = loop {
            tokio::select! {
                result = probe.run(target, transport) => break result,
                _ = wake.notified() => {}
            }
        };
        if tx.send(Report { stream, result }).await.is_err() {
            return;
        }
    }
}
