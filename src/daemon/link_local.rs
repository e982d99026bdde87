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
    /// The link-local IPs whose lease the forwarders renew (iptables), ended when they stop.
    leased: Vec<IpAddr>,
    /// Each forwarder's lease, renewed every [`lease::RENEW`] by the task that serves its UDP
    /// queries, on the forwarders' runtime: a runtime wedged for most of a lease lets it lapse.
    leases: Vec<Arc<Lease>>,
}

impl Forwarding {
    /// Renews the lease now (when there is one), from the calling thread: for the moment the
    /// agent's rules are first in, which the heartbeats sent before them could not renew.
    pub fn renew_lease(&self) {
        for lease in &self.leases {
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
        // The forwarders are gone: the cache gets the link-local queries now, not a second on.
        if !self.leased.is_empty() {
            lease::release(&self.leased);
        }
    }
}

/// Binds a forwarder for each family of `local` (to the upstream of that family, else the
/// first, as it is at each dial: [`crate::upstream`]), puts the copies of `local` on lo, and
/// starts the forwarders on a runtime of their own ([`Forwarding`]), and the copies' keeper: a
/// forwarder's first lease heartbeat, at its start, goes to a copy already there. A forwarder
/// that cannot bind is an error: the agent would TPROXY queries to nobody. One whose socket
/// fails for good ends its task in `tasks`, and so the agent, to be restarted with a fresh one.
/// Copies that cannot be added now are said and retried by the keeper. With `leased` (the
/// iptables backends), each forwarder renews its lease on its link-local IP, on the agent's
/// grid (`beat`), without which their TPROXY rules do not match.
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
        leases: Vec::new(),
    };
    let runtime = forwarding.runtime.as_ref().expect("just put there");
    let mut forwarders = Vec::new();
    {
        // Binding registers the sockets with the runtime they are in.
        let _in_its_runtime = runtime.enter();
        for &ip in local {
            let to = upstream.addr(ip.is_ipv4());
            let mut forwarder =
                Forwarder::bind(forwarder_for(ip), to.clone(), forwarder::Options::default())?;
            info!(listen = %forwarder.listen(), upstream = %to.now(), "link-local forwarder bound");
            if leased {
                let lease = Arc::new(Lease::new(&[ip]).map_err(AgentError::ForwarderRuntime)?);
                forwarder = forwarder.holding(lease::Holder::new(lease.clone(), beat));
                forwarding.leases.push(lease);
                forwarding.leased.push(ip);
            }
            forwarders.push(forwarder);
        }
    }
    forwarding.counters = forwarders.iter().map(Forwarder::counters).collect();
    // The copies first: each forwarder's first heartbeat goes out as it starts, to the
    // link-local IP, which must be local by then (from the loopback address, nothing else can
    // carry it).
    match addresses::ensure(local) {
        Ok(added) if !added.is_empty() => {
            info!(added = ?added, "copies of the link-local IPs on lo")
        }
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot put the copies of the link-local IPs on lo; retrying"),
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

#[cfg(test)]
impl Forwarding {
    /// Blocks every worker of the forwarders' runtime until the returned sender is dropped: a
    /// wedged runtime, whose tasks are no longer polled.
    fn wedge(&self) -> std::sync::mpsc::Sender<()> {
        let runtime = self.runtime.as_ref().expect("running");
        let workers = runtime.metrics().num_workers();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = Arc::new(std::sync::Mutex::new(released));
        let (blocked_tx, blocked) = std::sync::mpsc::channel();
        let barrier = Arc::new(std::sync::Barrier::new(workers));
        for _ in 0..workers {
            let (released, blocked_tx, barrier) =
                (released.clone(), blocked_tx.clone(), barrier.clone());
            runtime.spawn(async move {
                // Every worker holds one of these before any of them blocks for good.
                barrier.wait();
                let _ = blocked_tx.send(());
                let _ = released.lock().map(|r| r.recv());
            });
        }
        for _ in 0..workers {
            blocked.recv_timeout(Duration::from_secs(10)).expect("every worker blocked");
        }
        release
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, UdpSocket};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testutil::{in_netns, run, test_path};
    use crate::upstream::Upstream;

    /// Receives on `heard` until a heartbeat comes (`true`) or `deadline` passes (`false`).
    fn heartbeat_within(heard: &UdpSocket, deadline: Duration) -> bool {
        heard.set_read_timeout(Some(deadline)).unwrap();
        heard.recv(&mut [0; 16]).is_ok()
    }

    /// Runs `body` in a network namespace of its own (named after `test`) with a leased
    /// forwarder started for 169.254.20.10 on the agent's runtime, and a socket where its lease
    /// heartbeats arrive; the forwarding is dropped after `body`.
    fn with_leased_forwarder(test: &str, body: impl FnOnce(&Forwarding, &UdpSocket)) {
        in_netns("nlha-lease", test, |ns| {
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
            let local: IpAddr = "169.254.20.10".parse().unwrap();
            let upstream = Following::new(Upstream {
                ips: vec!["127.0.0.1".parse().unwrap()],
                from: "test".into(),
            });
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            let _agent = runtime.enter();
            let mut tasks = Tasks::default();
            let forwarding = start(&[local], &upstream, true, Beat::start(), &mut tasks).unwrap();
            // The copy of the link-local IP on lo is in: the heartbeats' destination is here.
            let heard = UdpSocket::bind((local, lease::HEARTBEAT_PORT)).unwrap();
            body(&forwarding, &heard);
            drop(forwarding);
        });
    }

    /// Each forwarder's first lease heartbeat goes out as it starts, to the link-local IP: the
    /// agent's copy of it is on lo by then, so not one heartbeat fails at start (the forwarders
    /// had started first, and their first heartbeats failed with `EINVAL`, said in a warning).
    #[test]
    fn the_first_heartbeats_find_the_link_local_ip_on_lo() {
        with_leased_forwarder(test_path!(), |forwarding, heard| {
            assert!(heartbeat_within(heard, Duration::from_secs(5)), "no heartbeat at all");
            let failed: u64 = forwarding.leases.iter().map(|l| l.failed()).sum();
            assert_eq!(failed, 0, "heartbeats sent before the link-local IP was on lo");
        });
    }

    /// The iptables fallback's lease says that the forwarders serve, not only that the agent
    /// runs: with every worker of the forwarders' runtime blocked (TPROXY would hand queries to
    /// sockets nobody reads), no heartbeat goes out and the lease lapses (a whole lease without
    /// one), the agent's own runtime running all along; once the runtime runs again, so do the
    /// heartbeats.
    #[test]
    fn the_lease_lapses_while_the_forwarders_runtime_is_wedged() {
        with_leased_forwarder(test_path!(), |forwarding, heard| {
            assert!(heartbeat_within(heard, Duration::from_secs(5)), "no heartbeat at all");

            let wedged = forwarding.wedge();
            let lease = Duration::from_secs(u64::from(lease::LEASE_SECONDS));
            let since = Instant::now();
            while heartbeat_within(heard, lease) {
                assert!(
                    since.elapsed() < Duration::from_secs(10),
                    "the heartbeats went on with the forwarders' runtime wedged"
                );
            }
            drop(wedged);
            assert!(heartbeat_within(heard, Duration::from_secs(5)), "no heartbeat once unwedged");
        });
    }
}
