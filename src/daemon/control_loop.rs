//! The control loop: probe results, operators' requests ([`maintenance`]), nftables change
//! announcements, the resync tick, finished read-backs and what the node's watchers found go to
//! the agent one at a time; the state file and the transition hook hear of every change. It
//! turns until the shutdown signal, or until a task dies (the agent can no longer see what it
//! should), and leaves the ruleset of the current route installed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

use super::link_local::{self, Forwarding};
use super::spawn::{NodeWatch, Probing};
use super::tasks::Tasks;
use super::{now, sleep_until, start_check, AgentError};
use crate::agent::Agent;
use crate::beat::Beat;
use crate::blocking::blocking;
use crate::cluster::{Reporter, Verdict};
use crate::config::AgentConfig;
use crate::control::Incoming;
use crate::health::{Stream, Transition};
use crate::metrics::{Health, Metrics};
use crate::pace::Pace;
use crate::probe::CacheProbes;
use crate::ruleset::Route;
use crate::upstream::Upstream;
use crate::{maintenance, overrides, state};

/// Everything the loop turns with.
pub(super) struct ControlLoop<'a> {
    pub(super) cfg: &'a AgentConfig,
    pub(super) agent: Agent,
    pub(super) beat: Beat,
    /// The fast cadences' pace, which the loop tells whether the agent is calm.
    pub(super) pace: Arc<Pace>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) health: Arc<Health>,
    pub(super) probing: Probing,
    pub(super) node: NodeWatch,
    /// Whether the node is watched (not in the loop's tests): a drained cache's sockets.
    pub(super) watch_node: bool,
    pub(super) requests: mpsc::Receiver<Incoming>,
    pub(super) hooks: Option<mpsc::Sender<(Transition, u64)>>,
    /// The link-local forwarders, stopped when the loop's owner is dropped.
    pub(super) forwarding: Option<Forwarding>,
    /// The state file, written beside the loop: a synced write must not hold a decision up.
    pub(super) state_file: state::Writer,
    /// The reports to the cluster, handed each state the file gets (never blocks).
    pub(super) reporter: Option<Reporter>,
    /// The upstream's changes ([`crate::upstream`]), when its Service is followed.
    pub(super) upstream: watch::Receiver<Upstream>,
    pub(super) tasks: Tasks,
}

impl ControlLoop<'_> {
    /// Turns until `shutdown` completes or a task dies; then stops the tasks and leaves the
    /// current route's ruleset installed, for the caller to remove on a [`Verdict::Removal`].
    pub(super) async fn run(
        self,
        shutdown: impl std::future::Future<Output = Verdict>,
    ) -> Result<Verdict, AgentError> {
        let ControlLoop {
            cfg,
            mut agent,
            beat,
            pace,
            metrics,
            health,
            mut probing,
            mut node,
            watch_node,
            mut requests,
            hooks,
            forwarding,
            state_file,
            reporter,
            mut upstream,
            mut tasks,
        } = self;
        let forwarders = forwarding.as_ref().map_or_else(Vec::new, |f| f.counters.clone());
        let interval = cfg.cache_udp.interval;
        let mut resync = beat.paced(interval, pace.when_quiet(interval), pace.clone());
        let mut cache_probes = CacheProbes::new(cfg.thresholds.rise, cfg.cache_udp.timeout);
        let mut state_tick = beat.every(Duration::from_secs(1));
        let mut drain: Option<maintenance::Drain> = None;
        let override_file = overrides::path(&cfg.state_dir);
        // The agent writes the record on a request (at start, an earlier agent's may be there),
        // and anyone may write garbage there: it is looked for at start, after each request and
        // once a second, not on every turn (a stat per probe report).
        let mut maybe_recorded = true;
        let mut record_stuck = false;
        // Since when the upstream's Service is waited for, if it is.
        let mut awaited_since = cfg.upstream.is_awaited().then(now);
        // Read-backs run on blocking threads, one at a time; their results come back here.
        let (checks_tx, mut checks) = mpsc::channel(1);
        let write_state = |agent: &Agent| {
            let state = agent.state(now(), SystemTime::now());
            if let Some(reporter) = &reporter {
                reporter.submit(&state);
            }
            state_file.submit(state);
        };
        tokio::pin!(shutdown);
        let outcome = loop {
            health.beat(now());
            tokio::select! {
                biased;
                verdict = &mut shutdown => break Ok(verdict),
                Some(report) = probing.reports.recv() => {
                    if report.stream == Stream::CacheUdp && report.result.outcome.is_good() {
                        probing.cache_answered.notify_one();
                    }
                    cache_probes.observe(&report);
                    agent.on_probe(&report, now())
                }
                Some(incoming) = requests.recv() => {
                    maybe_recorded = true;
                    blocking(|| {
                        maintenance::handle(&mut agent, &cfg.state_dir, incoming, &mut drain, now())
                    })
                }
                _ = node.nft_changed.notified() => {
                    let tables = node
                        .announced
                        .lock()
                        .map(|mut a| a.replace(Vec::new()))
                        .unwrap_or(None);
                    let job = blocking(|| agent.announced(tables, now()));
                    start_check(job, &checks_tx);
                }
                _ = sleep_until(agent.resync_due()) => {
                    let job = blocking(|| agent.resync(now()));
                    start_check(job, &checks_tx);
                }
                Some(done) = checks.recv() => {
                    let job = blocking(|| agent.checked(done, now()));
                    start_check(job, &checks_tx);
                }
                _ = resync.tick() => {
                    let now = now();
                    agent.expire(now);
                    if watch_node {
                        maintenance::end_drain_if_its_cache_is_gone(&mut agent, now);
                    }
                    let job = agent.poll(now, node.hearing.load(Ordering::Relaxed));
                    agent.remove_leftovers();
                    drain = drain.take().and_then(|d| d.progress(&mut agent, now));
                    start_check(job, &checks_tx);
                }
                _ = state_tick.tick() => {
                    maybe_recorded = true;
                    if !forwarders.is_empty() {
                        agent.set_forwarded(link_local::forwarded(&forwarders));
                    }
                    write_state(&agent)
                }
                // Its probe goes to the new address now, not at its next tick.
                Ok(()) = upstream.changed() => {
                    let now_known = upstream.borrow_and_update().clone();
                    agent.set_upstream(&now_known);
                    if !now_known.is_awaited() {
                        if let Some(since) = awaited_since.take() {
                            let waited = now().saturating_duration_since(since);
                            health.set_waiting(None);
                            info!(upstream = %now_known.from, ?waited, "the upstream's Service is there after waiting for it: ready");
                        }
                    }
                    probing.upstream_wake.notify_one();
                    write_state(&agent)
                }
                Some(found) = node.problems.recv() => agent.set_problems(found),
                Some(found) = node.firewall.recv() => blocking(|| agent.set_firewall(found, now())),
                // The agent can no longer see what it should. Exit, leaving the current
                // ruleset; the DaemonSet restarts us.
                died = tasks.died() => break Err(died),
            }
            // A drain that ended by itself, or an expiry, leaves nothing forced: the record
            // goes too (with or without a route change), so a restart cannot bring it back. If
            // it cannot be removed (a directory in its place), that is said once, not on every
            // turn of the loop.
            if maybe_recorded && agent.forced().is_none() {
                match overrides::clear(&cfg.state_dir) {
                    Ok(()) => (maybe_recorded, record_stuck) = (false, false),
                    Err(e) if !record_stuck => {
                        record_stuck = true;
                        warn!(
                            file = %override_file.display(),
                            error = %e,
                            "removing the record of an override not in force failed; remove it by hand"
                        );
                    }
                    Err(_) => {}
                }
            }
            if !health.applied() && !agent.is_dirty() {
                health.set_ready();
                if let Some(forwarding) = &forwarding {
                    forwarding.renew_lease();
                }
            }
            pace.calm(
                cache_probes.calm()
                    && agent.route() == Route::Local
                    && agent.forced().is_none()
                    && !agent.is_dirty()
                    && drain.is_none(),
            );
            let changes = agent.take_changes();
            if !changes.is_empty() {
                write_state(&agent);
            }
            for t in changes {
                // Never blocks: a full queue means the hook is far behind, and the change is
                // dropped for it (counted), not for the dataplane.
                if let Some(hooks) = &hooks {
                    if hooks.try_send((t, state::unix_ms(SystemTime::now()))).is_err() {
                        metrics.hook("dropped");
                    }
                }
            }
        };
        tasks.shutdown().await;
        blocking(|| agent.settle(now()));
        write_state(&agent);
        blocking(|| state_file.finish());
        match &outcome {
            Ok(Verdict::Removal(why)) => {
                warn!(route = %agent.route(), why = %why, "stopping: the agent is being removed from the node; removing its rules, its copies of the link-local IPs, its node condition and its startup taint (pods' DNS goes through kube-proxy to CoreDNS)");
            }
            _ if agent.is_dirty() => {
                error!(route = %agent.route(), "stopping; the last apply failed, the kernel may still hold the previous route's ruleset");
            }
            Ok(Verdict::Restart(why)) => {
                info!(route = %agent.route(), why = %why, "stopping; the ruleset of the current route stays installed");
            }
            Err(_) => {
                info!(route = %agent.route(), "stopping; the ruleset of the current route stays installed");
            }
        }
        outcome
    }
}
