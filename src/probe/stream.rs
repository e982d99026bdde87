//! A probe stream: one server probed on a cadence, and at once when woken, its results sent to
//! the control loop as [`Report`]s.
//!
//! The stream sends its probes through a [`Prober`]: a real DNS query ([`Probe`]) in the agent,
//! a script in the control loop's tests, which run on a paused clock with no network.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{mpsc, Notify};

use super::{Probe, ProbeResult, Transport};
use crate::beat::Ticks;
use crate::health::Stream;

/// A probe result, tagged with the stream it belongs to.
#[derive(Clone, Debug)]
pub struct Report {
    pub stream: Stream,
    pub result: ProbeResult,
}

/// What a probe stream probes with.
pub trait Prober: Send + Sync {
    /// One probe of `target` over `transport`, as [`Probe::run`]: every problem is an
    /// [`Outcome`](super::Outcome), and it never takes (much) longer than its timeout.
    fn probe(
        &self,
        target: SocketAddr,
        transport: Transport,
    ) -> Pin<Box<dyn Future<Output = ProbeResult> + Send + '_>>;
}

impl Prober for Probe {
    fn probe(
        &self,
        target: SocketAddr,
        transport: Transport,
    ) -> Pin<Box<dyn Future<Output = ProbeResult> + Send + '_>> {
        Box::pin(self.run(target, transport))
    }
}

/// Probes `target` at each tick of `ticker`, and at once when `wake` is notified. The target is
/// asked anew for each probe: the upstream's follows its Service ([`crate::upstream`]).
pub(crate) async fn probe_stream(
    probe: Arc<dyn Prober>,
    target: impl Fn() -> std::net::SocketAddr + Send,
    transport: Transport,
    stream: Stream,
    mut ticker: Ticks,
    wake: Arc<Notify>,
    tx: mpsc::Sender<Report>,
) {
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = wake.notified() => {}
        }
        // A wake-up during a probe means a cache socket just closed: the query may have gone to
        // a socket that is closing too, and would only time out. Ask again.
        let result = loop {
            tokio::select! {
                result = probe.probe(target(), transport) => break result,
                _ = wake.notified() => {}
            }
        };
        if tx.send(Report { stream, result }).await.is_err() {
            return;
        }
    }
}
