//! The daemon's tasks, one constructor each: what it watches or serves, and the handles the
//! control loop hears it through. Each runs forever under its name in [`Tasks`].

use std::net::IpAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tracing::error;

use super::link_local::{self, Forwarding};
use super::tasks::Tasks;
use super::LIVENESS_SILENCE;
use crate::beat::Beat;
use crate::config::{AgentConfig, Cadence};
use crate::control::Incoming;
use crate::dataplane::{nftables, TableRef, TableWatch};
use crate::detect::{self, NodeProblems};
use crate::firewall::Blocking;
use crate::health::{Stream, Transition};
use crate::metrics::{Health, Metrics};
use crate::pace::Pace;
use crate::probe::{self, Prober, Report, Transport};
use crate::upstream::Following;
use crate::{control, hooks, sockdiag, stall};

/// The probers of every stream, made (and so refused, when a setting is bad) before the host
/// is touched.
pub(super) struct Probers {
    pub(super) cache_udp: Arc<dyn Prober>,
    pub(super) cache_tcp: Option<(Cadence, Arc<dyn Prober>)>,
    pub(super) upstream: Arc<dyn Prober>,
    /// The stall watch's confirming prober, with its bounds.
    pub(super) confirm: Option<(stall::Bounds, Arc<dyn Prober>)>,
}

/// What the probe streams report through.
pub(super) struct Probing {
    /// Every probe's result.
    pub(super) reports: mpsc::Receiver<Report>,
    /// Told of every cache probe answered: the stall watch lists a restarted cache's sockets
    /// then.
    pub(super) cache_answered: Arc<Notify>,
    /// Wakes the upstream's probe (its address changed).
    pub(super) upstream_wake: Arc<Notify>,
}

/// The probe streams (cache UDP, cache TCP, upstream), and the stall watch beside them. The
/// socket-destroy watch wakes the cache streams (`cache_wakes`); the cache's UDP probe goes at
/// `pace`, which the stall watch tells whether the node is quiet.
#[allow(clippy::too_many_arguments)]
pub(super) fn spawn_probes(
    cfg: &AgentConfig,
    probers: Probers,
    beat: Beat,
    pace: &Arc<Pace>,
    watch_node: Option<(&[IpAddr], Option<&Forwarding>)>,
    cache_wakes: &[Arc<Notify>; 2],
    following: &Following,
    tasks: &mut Tasks,
) -> Probing {
    let Probers { cache_udp, cache_tcp, upstream, confirm } = probers;
    let (tx, reports) = mpsc::channel(64);
    let cache_answered = Arc::new(Notify::new());
    let target = cfg.cache_target();
    let target = move || target;
    let interval = cfg.cache_udp.interval;
    let every = beat.paced(interval, pace.when_quiet(interval), pace.clone());
    let wake = cache_wakes[0].clone();
    let stream = Stream::CacheUdp;
    let udp =
        probe::probe_stream(cache_udp, target, Transport::Udp, stream, every, wake, tx.clone());
    tasks.spawn("cache UDP probe", udp);
    if let Some((cadence, tcp)) = cache_tcp {
        let quiet = pace.tcp_when_quiet(cadence.interval);
        let (wake, every) =
            (cache_wakes[1].clone(), beat.paced(cadence.interval, quiet, pace.clone()));
        let stream = Stream::CacheTcp;
        let tcp = probe::probe_stream(tcp, target, Transport::Tcp, stream, every, wake, tx.clone());
        tasks.spawn("cache TCP probe", tcp);
    }
    if let (Some((listen, forwarding)), Some((bounds, confirm))) = (watch_node, confirm) {
        // Each cache probe and its answer, each upstream probe: the node's UDP datagrams the
        // agent accounts for.
        let per_sec = |every: Duration| 1.0 / every.as_secs_f64();
        // And the forwarders' lease heartbeats (iptables): 20 a second that, counted as
        // traffic, kept the watch at its faster pace on every idle iptables node.
        let heartbeats = forwarding.map_or(0.0, link_local::Forwarding::heartbeats_per_sec);
        let others = per_sec(cfg.upstream_probe.interval) + heartbeats;
        let own = stall::Own {
            fast: 2.0 * per_sec(cfg.cache_udp.interval) + others,
            quiet: 2.0 * per_sec(pace.when_quiet(cfg.cache_udp.interval)) + others,
        };
        let answered = cache_answered.clone();
        let (listen, pace) = (listen.to_vec(), pace.clone());
        let stalls =
            stall::watch_stalls(bounds, beat, listen, own, pace, confirm, answered, tx.clone());
        tasks.spawn("stall watch", stalls);
    }
    let target = following.addr(cfg.addrs.local[0].is_ipv4());
    let mut known = target.clone();
    let every = beat.every(cfg.upstream_probe.interval);
    let upstream_wake = Arc::new(Notify::new());
    let wake = upstream_wake.clone();
    let stream = Stream::Upstream;
    let target = move || target.now();
    let upstream = probe::probe_stream(upstream, target, Transport::Udp, stream, every, wake, tx);
    // An upstream waited for is not probed before it has an address ([`crate::upstream`]).
    tasks.spawn("upstream probe", async move {
        known.known().await;
        upstream.await
    });
    Probing { reports, cache_answered, upstream_wake }
}

/// What the node's watchers tell the control loop.
pub(super) struct NodeWatch {
    /// Notified when nftables announces a change to the agent's tables.
    pub(super) nft_changed: Arc<Notify>,
    /// The tables those changes were in (`None`: unknown ones).
    pub(super) announced: Arc<Mutex<Option<Vec<TableRef>>>>,
    /// Whether the announcements are heard (when not, the agent checks on every tick).
    pub(super) hearing: Arc<AtomicBool>,
    /// The node's firewall, judged again after it changed.
    pub(super) firewall: mpsc::Receiver<Vec<Blocking>>,
    /// Others' NOTRACK rules and the node's other problems.
    pub(super) problems: mpsc::Receiver<NodeProblems>,
    /// The senders, kept while nothing watches (a test's world): the loop's receivers then wait
    /// forever rather than end.
    _idle: Option<(mpsc::Sender<Vec<Blocking>>, mpsc::Sender<NodeProblems>)>,
}

/// What of the node is watched.
pub(super) struct Watched<'a> {
    /// The cache's addresses (its sockets; the firewall's verdict on them).
    pub(super) listen: &'a [IpAddr],
    /// The Services' addresses (the firewall's view of pods' traffic).
    pub(super) services: &'a [IpAddr],
    /// The agent's tables whose changes nftables announces (`None`: any change).
    pub(super) tables: Option<Vec<TableWatch>>,
    /// The agent's switching backend: whose raw rules its own run before.
    pub(super) backend: Option<detect::Backend>,
}

/// The node's watchers: the cache's sockets (the socket-destroy events wake the cache probes),
/// nftables' change announcements, the node's own firewall, and others' NOTRACK rules. `None`
/// for `node`: nothing is watched (the loop's tests).
pub(super) fn spawn_node_watch(
    cfg: &AgentConfig,
    node: Option<Watched<'_>>,
    cache_wakes: [Arc<Notify>; 2],
    tasks: &mut Tasks,
) -> NodeWatch {
    let nft_changed = Arc::new(Notify::new());
    let hearing = Arc::new(AtomicBool::new(false));
    let announced = Arc::new(Mutex::new(Some(Vec::new())));
    let (firewall_tx, firewall) = mpsc::channel(1);
    let (problems_tx, problems) = mpsc::channel(1);
    let mut watch = NodeWatch {
        nft_changed: nft_changed.clone(),
        announced: announced.clone(),
        hearing: hearing.clone(),
        firewall,
        problems,
        _idle: None,
    };
    let Some(Watched { listen, services, tables, backend }) = node else {
        watch._idle = Some((firewall_tx, problems_tx));
        return watch;
    };
    if cfg.socket_events {
        let sockets = sockdiag::watch_cache_sockets(listen.to_vec(), cache_wakes);
        tasks.spawn("socket-destroy watch", sockets);
    }
    let raw_changed = Arc::new(AtomicBool::new(false));
    let firewall_changed = Arc::new(Notify::new());
    let watched =
        nftables::Watched { raw: raw_changed.clone(), firewall: firewall_changed.clone() };
    let changes =
        nftables::watch_nftables(tables, nft_changed, announced, watched, hearing.clone());
    tasks.spawn("nftables change watch", changes);
    let firewall =
        nftables::watch_firewall(listen.to_vec(), services.to_vec(), firewall_changed, firewall_tx);
    tasks.spawn("firewall watch", firewall);
    // Others' NOTRACK on the link-local IP is harmless: the fallback's TPROXY acts on untracked
    // packets all the same. On the cluster-DNS IP it would pin pods to the cache, where the
    // agent's rules do not run before it.
    let period = detect::FOREIGN_RULES_PERIOD;
    let cluster_dns = cfg.addrs.cluster_dns.clone();
    let foreign = detect::watch_foreign_rules(
        cluster_dns,
        backend,
        period,
        raw_changed,
        hearing,
        problems_tx,
    );
    tasks.spawn("foreign-rule watch", foreign);
    watch
}

/// The control socket in `state_dir`: operators' requests. Without it the agent still switches;
/// operators lose the manual flip only.
pub(super) fn spawn_control_socket(
    state_dir: &std::path::Path,
    tasks: &mut Tasks,
) -> mpsc::Receiver<Incoming> {
    let (tx, requests) = mpsc::channel(8);
    let dir = state_dir.to_owned();
    tasks.spawn("control socket", async move {
        let Err(e) = control::serve(&dir, tx).await;
        error!(error = %e, "the control socket is unavailable");
        std::future::pending().await
    });
    requests
}

/// `/metrics`, `/healthz` and `/readyz` on `listener`.
pub(super) fn spawn_metrics_endpoint(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    tasks: &mut Tasks,
) {
    tasks.spawn("metrics endpoint", async move {
        let e = crate::metrics::serve(listener, metrics, health, LIVENESS_SILENCE).await;
        error!(error = %e, "the metrics endpoint stopped");
        std::future::pending().await
    });
}

/// The transition hook (`--on-transition`), if configured: route changes go to it one at a
/// time, in order, beside the loop.
pub(super) fn spawn_hooks(
    cfg: &AgentConfig,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Option<mpsc::Sender<(Transition, u64)>> {
    let path = cfg.on_transition.clone()?;
    let (tx, rx) = mpsc::channel(16);
    tasks.spawn("transition hook", hooks::run_hooks(path, rx, cfg.hook_timeout, metrics.clone()));
    Some(tx)
}

/// The cluster's tasks, if a client can be had: the reports (the node condition, Events), and
/// the upstream Service followed when no flag fixes it; with the agent's DaemonSet named, what
/// asks it at SIGTERM. Without a client the agent runs on from its flags alone, and says why.
pub(super) async fn spawn_cluster(
    settings: &crate::cluster::Settings,
    addrs: &crate::ruleset::ListenAddrs,
    following: &Arc<Following>,
    tasks: &mut Tasks,
) -> Option<(crate::cluster::Reporter, Option<crate::cluster::Removal>)> {
    let client = match crate::cluster::client(settings).await {
        Ok(client) => client,
        Err(e) => {
            tracing::warn!(error = %e, node = %settings.node_name, "no reports to the cluster, and the upstream Service is not followed");
            return None;
        }
    };
    if let Some(name) = &settings.upstream_svc {
        let follower = crate::cluster::Follower {
            name: name.clone(),
            addrs: addrs.clone(),
            following: following.clone(),
        };
        tasks.spawn("upstream Service follower", crate::cluster::follow(client.clone(), follower));
    }
    let removal = settings.daemonset.as_ref().map(|daemonset| {
        let (node, taint) = (settings.node_name.clone(), settings.startup_taint.clone());
        crate::cluster::Removal::new(client.clone(), daemonset.clone(), node, taint)
    });
    let (reporter, task) = crate::cluster::reports(client, settings);
    tasks.spawn("cluster reports", task);
    Some((reporter, removal))
}
