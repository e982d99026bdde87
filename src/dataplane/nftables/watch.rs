//! The loop's ear on nftables: [`watch_nftables`] turns the kernel's change announcements
//! ([`ChangeWatch`]) into resyncs of the agent's tables, and tells the watchers of iptables-nft's
//! raw tables and of the node's own firewall that theirs may have changed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;
use tracing::{debug, warn};

use super::ChangeWatch;
use crate::dataplane;
use crate::dataplane::{TableRef, TableWatch};

/// What besides the agent's own tables [`watch_nftables`] tells about.
pub(crate) struct Watched {
    /// Set when an iptables-nft raw table changed (node-cache's rules, say).
    pub(crate) raw: Arc<AtomicBool>,
    /// Notified when a table of the node's own firewall may have changed.
    pub(crate) firewall: Arc<Notify>,
}

/// Notifies `resync` whenever a change that matters to one of `tables` is announced in this
/// network namespace (any change when `None`), the agent's own changes included: the resync that
/// follows finds them in order and does nothing. `changed` gathers the tables of those changes.
/// `hearing` is true while the announcements are heard; when they are not, the agent checks on
/// every tick.
pub(crate) async fn watch_nftables(
    tables: Option<Vec<TableWatch>>,
    resync: Arc<Notify>,
    changed: Arc<std::sync::Mutex<Option<Vec<TableRef>>>>,
    watched: Watched,
    hearing: Arc<AtomicBool>,
) {
    let raw = dataplane::iptables::Table::Raw.nft_tables();
    let mut watch = match ChangeWatch::new() {
        Ok(w) => w,
        Err(e) => {
            warn!(error = %e, "nftables change notifications unavailable; resyncing on the tick only");
            return std::future::pending().await;
        }
    };
    hearing.store(true, Ordering::Relaxed);
    loop {
        match watch.changed().await {
            Ok(announced) => {
                if announced.touches(&raw) {
                    watched.raw.store(true, Ordering::Relaxed);
                }
                let candidate =
                    |t: &TableRef| dataplane::nftables::host_firewall_candidate(t.family, &t.name);
                if announced.unknown || announced.tables.iter().any(candidate) {
                    watched.firewall.notify_one();
                }
                let concerned: Vec<TableRef> = match &tables {
                    Some(tables) => tables
                        .iter()
                        .filter(|t| announced.concerns(t))
                        .map(|t| t.table.clone())
                        .collect(),
                    None => announced.tables.clone(),
                };
                if announced.unknown || !concerned.is_empty() {
                    debug!(
                        unknown = announced.unknown,
                        whole = ?announced.whole,
                        rules = ?announced.rules,
                        "a change to the agent's chains announced, checking"
                    );
                    // Which of them, for the check; taken (and emptied) by the loop. `None`:
                    // unknown, check everything.
                    if let Ok(mut changed) = changed.lock() {
                        let next = match (changed.take(), announced.unknown) {
                            (Some(mut seen), false) => {
                                seen.extend(concerned);
                                Some(seen)
                            }
                            _ => None,
                        };
                        *changed = next;
                    }
                    resync.notify_one();
                }
            }
            Err(e) => {
                hearing.store(false, Ordering::Relaxed);
                warn!(error = %e, "nftables change notifications failed; resyncing on the tick only");
                return std::future::pending().await;
            }
        }
    }
}
