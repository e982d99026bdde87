//! The node's own nftables firewall, read again whenever it may have changed: [`watch_firewall`]
//! sends the control loop what it would stop ([`super::blocking`]).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tracing::warn;

use super::Blocking;
use crate::dataplane;

/// How often the node's own nftables firewall is read again without being told it changed.
const FIREWALL_PERIOD: Duration = Duration::from_secs(30);

/// The node's own nftables firewall, judged for the listen addresses `addrs`.
pub(crate) fn audit_firewall(addrs: &[IpAddr]) -> Result<Vec<Blocking>, dataplane::Error> {
    let tables = dataplane::nftables::Nftables::new()?.host_firewall()?;
    Ok(crate::firewall::blocking(&tables, addrs))
}

/// Reads the node's own nftables firewall again whenever one of its tables changes (`changed`)
/// and every [`FIREWALL_PERIOD`], and sends what it would stop. A failed read is said once and
/// changes nothing.
pub(crate) async fn watch_firewall(
    addrs: Vec<IpAddr>,
    changed: Arc<Notify>,
    tx: mpsc::Sender<Vec<Blocking>>,
) {
    let mut failing = false;
    loop {
        tokio::select! {
            _ = changed.notified() => {}
            _ = tokio::time::sleep(FIREWALL_PERIOD) => {}
        }
        let addrs = addrs.clone();
        let Ok(found) = tokio::task::spawn_blocking(move || audit_firewall(&addrs)).await else {
            continue;
        };
        match found {
            Ok(found) => {
                failing = false;
                if tx.send(found).await.is_err() {
                    return;
                }
            }
            Err(e) if !failing => {
                failing = true;
                warn!(error = %e, "cannot read the node's nftables firewall; keeping the last look");
            }
            Err(_) => {}
        }
    }
}
