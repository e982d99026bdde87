//! What the link-local fallback needs on the node besides its rules: the agent's forwarder, one
//! per family of the link-local IPs, and the agent's copies of those IPs on lo, kept there.
//!
//! The fallback chain TPROXYs to the forwarder whatever the cache's socket cannot take; without
//! the forwarder those queries would meet nobody. The copies keep the IPs local when
//! node-cache's teardown deletes its interface (every rolling update), so that both the cache,
//! while it runs, and the forwarder, once it is gone, still get the queries.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::tasks::Tasks;
use super::AgentError;
use crate::addresses;
use crate::beat::Beat;
use crate::forwarder::lease::{self, Lease};
use crate::forwarder::{self, Counters, Forwarder};
use crate::ruleset::forwarder_for;
use crate::upstream::Following;

/// How often the copies on lo are checked (one netlink dump of the namespace's addresses).
const COPIES_PERIOD: Duration = Duration::from_secs(1);

/// The forwarders' own runtime, two threads apart from the agent's: a saturated fallback (every
/// query of the node through it) cannot delay a probe or a decision, and the agent's control
/// thread wakes for nothing of theirs. Shut down without waiting when dropped (dropping a
/// runtime from within another one may not block).
pub(super) struct Forwarding {
    runtime: Option<tokio::runtime::Runtime>,
    /// The forwarders' counters, live.
    pub counters: Vec<Arc<Counters>>,
    /// The link-local IPs whose lease the agent renews (iptables), ended when the forwarders
    /// stop.
    leased: Vec<IpAddr>,
    /// That lease, renewed every [`lease::RENEW`] by a task on the agent's runtime (its ticks'
    /// wake-ups), which goes when the forwarders do.
    lease: Option<(Arc<Lease>, tokio::task::AbortHandle)>,
}

impl Forwarding {
    /// Renews the lease now (when there is one), from the calling thread: for the moment the
    /// agent's rules are first in, which the heartbeats sent before them could not renew.
    pub fn renew_lease(&self) {
        if let Some((lease, _)) = &self.lease {
            // A failure is the heartbeats' to say, at their next renewal.
            let _ = lease.renew();
        }
    }

    /// The datagrams a second its lease's heartbeats make the node send (none without a lease):
    /// the agent's own, not DNS traffic, to the stall watch.
    pub fn heartbeats_per_sec(&self) -> f64 {
        self.leased.len() as f64 / lease::RENEW.as_secs_f64()
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        if let Some((_, heartbeats)) = &self.lease {
            heartbeats.abort();
        }
        // The forwarders are gone: the cache gets the link-local queries now, not a second on.
        if !self.leased.is_empty() {
            lease::release(&self.leased);
        }
    }
}

/// Binds a forwarder for each family of `local` (to the upstream of that family, else the
/// first, as it is at each dial: [`crate::upstream`]) and starts it on a runtime of its own
/// ([`Forwarding`]), then puts the copies of `local` on lo and spawns their keeper. A forwarder
/// that cannot bind is an error: the agent would TPROXY queries to nobody. One whose socket
/// fails for good ends its task in `tasks`, and so the agent, to be restarted with a fresh one.
/// Copies that cannot be added now are said and retried by the keeper. With `leased` (the
/// iptables backends), the agent's runtime also renews the forwarders' lease on the link-local
/// IPs, without which their TPROXY rules do not match.
pub(super) fn start(
    local: &[IpAddr],
    upstream: &Following,
    leased: bool,
    beat: Beat,
    tasks: &mut Tasks,
) -> Result<Forwarding, AgentError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("forwarder")
        .enable_all()
        .build()
        .map_err(AgentError::ForwarderRuntime)?;
    // Held from here, so that a failed bind below drops it without blocking.
    let mut forwarding = Forwarding {
        runtime: Some(runtime),
        counters: Vec::new(),
        leased: Vec::new(),
        lease: None,
    };
    let runtime = forwarding.runtime.as_ref().expect("just put there");
    let mut forwarders = Vec::new();
    {
        // Binding registers the sockets with the runtime they are in.
        let _in_its_runtime = runtime.enter();
        for &ip in local {
            let to = upstream.addr(ip.is_ipv4());
            let forwarder =
                Forwarder::bind(forwarder_for(ip), to.clone(), forwarder::Options::default())?;
            info!(listen = %forwarder.listen(), upstream = %to.now(), "link-local forwarder bound");
            forwarders.push(forwarder);
        }
    }
    forwarding.counters = forwarders.iter().map(Forwarder::counters).collect();
    if leased {
        let lease = Arc::new(Lease::new(local).map_err(AgentError::ForwarderRuntime)?);
        let heartbeats = tokio::spawn(lease::hold(lease.clone(), beat)).abort_handle();
        forwarding.leased = local.to_vec();
        forwarding.lease = Some((lease, heartbeats));
    }
    for forwarder in forwarders {
        let listen = forwarder.listen();
        let serving = runtime.spawn(forwarder.run());
        tasks.spawn("link-local forwarder", async move {
            match serving.await {
                Ok(Err(e)) => {
                    tracing::error!(%listen, error = %e, "the link-local forwarder stopped")
                }
                Err(e) => {
                    tracing::error!(%listen, error = %e, "the link-local forwarder's task ended")
                }
            }
        });
    }
    match addresses::ensure(local) {
        Ok(added) if !added.is_empty() => {
            info!(added = ?added, "copies of the link-local IPs on lo")
        }
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot put the copies of the link-local IPs on lo; retrying"),
    }
    tasks.spawn("link-local address copies", keep_copies(local.to_vec(), beat));
    Ok(forwarding)
}

/// What the forwarders have done, summed, for `status`.
pub(super) fn forwarded(counters: &[Arc<Counters>]) -> crate::state::Forwarded {
    let t: forwarder::Totals = counters.iter().map(|c| c.totals()).sum();
    crate::state::Forwarded {
        udp_queries: t.udp_queries,
        udp_answers: t.udp_answers,
        tcp_connections: t.tcp_connections,
        upstream_failures: t.upstream_failures,
        dropped: t.dropped_busy + t.dropped_malformed + t.answer_failures,
    }
}

/// Puts back any copy someone removed, every [`COPIES_PERIOD`] on the agent's grid (`beat`);
/// level-triggered, so a failure is only said and tried again.
async fn keep_copies(local: Vec<IpAddr>, beat: Beat) {
    let mut tick = beat.every(COPIES_PERIOD);
    loop {
        tick.tick().await;
        // One netlink dump, and a request per missing copy, answered by the kernel at once
        // (a millisecond with thousands of addresses): run on the worker as it is. Handing the
        // worker over to a thread (`blocking`) woke a second thread every second.
        let checked = addresses::missing(&local).and_then(|missing| {
            if missing.is_empty() {
                return Ok(missing);
            }
            addresses::ensure(&missing).map(|_| missing)
        });
        match checked {
            Ok(missing) if !missing.is_empty() => {
                warn!(restored = ?missing, "a copy of a link-local IP was gone from lo; put back")
            }
            Ok(_) => {}
            Err(e) => warn!(error = %e, "cannot check the copies of the link-local IPs on lo"),
        }
    }
}
