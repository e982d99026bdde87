//! The cache's sockets watched for their end: [`watch_cache_sockets`] wakes the cache probes the
//! moment the kernel announces one of the cache's listeners closed ([`SocketWatch`]), so a crash
//! is seen at once, not at the next probe.

use std::net::IpAddr;
use std::sync::Arc;

use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::SocketWatch;
use crate::ruleset::DNS_PORT;

/// Wakes the cache probes when the kernel reports one of the cache's listening sockets closed.
/// Without the notifications (an old kernel), the probes alone still detect a crash.
pub(crate) async fn watch_cache_sockets(addrs: Vec<IpAddr>, wake: [Arc<Notify>; 2]) {
    let mut watch = match SocketWatch::open() {
        Ok(w) => w,
        Err(e) => {
            warn!(error = %e, "socket-destroy notifications unavailable; relying on probes");
            return std::future::pending().await;
        }
    };
    if let Err(e) = watch.keep_only_port(DNS_PORT) {
        debug!(error = %e, "cannot filter socket-destroy notifications in the kernel; filtering here");
    }
    loop {
        match watch.next().await {
            Ok(closed) => {
                if let Some(s) = closed.iter().find(|s| s.is_listener_on(&addrs, DNS_PORT)) {
                    info!(socket = %s.local, transport = %s.transport, "cache socket closed, probing now");
                    wake.iter().for_each(|w| w.notify_one());
                }
            }
            // Notifications were dropped: one of them may have been the cache's.
            Err(e) if e.is_overrun() => wake.iter().for_each(|w| w.notify_one()),
            Err(e) => {
                warn!(error = %e, "socket-destroy notifications failed; relying on probes");
                return std::future::pending().await;
            }
        }
    }
}
