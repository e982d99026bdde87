//! The daemon: the [`Agent`] run as a process, with its probe and watch tasks around it.
//!
//! [`run`] refuses bad settings before the host is touched, takes the state directory's lock,
//! starts the agent (adopting the installed route, or the recorded override), spawns its tasks
//! (`spawn`: one constructor each), and then turns the control loop (`control_loop`): probe
//! results, operators' requests ([`crate::maintenance`]), nftables change announcements, the
//! resync tick, finished read-backs and what the node's watchers found go to the agent one at a
//! time; the state file and the transition hook ([`crate::hooks`]) hear of every change. Every
//! task runs forever under a name ([`Tasks`]): one that ends stops the agent, with the ruleset
//! of its current route left installed (the exit policy of [`crate::agent`]).
//!
//! The watchers live beside what they watch: the probe streams in [`crate::probe`], the
//! cache's sockets in [`crate::sockdiag`], nftables' announcements and the node's own
//! firewall (judged by [`crate::firewall`]) in [`crate::dataplane::nftables`], node-cache's
//! rules in [`crate::detect`].

mod control_loop;
mod link_local;
mod spawn;
mod tasks;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, Notify};
use tracing::{error, info, warn};

use crate::agent::{Agent, CheckDone, CheckJob, Notes};
use crate::beat::Beat;
use crate::blocking::blocking;
use crate::cluster::{Removal, Verdict};
use crate::config::{AgentConfig, Cadence};
use crate::control::Incoming;
use crate::dataplane::{nftables, Dataplane};
use crate::metrics::{Health, Metrics};
use crate::overrides::{self, Moment};
use crate::pace::Pace;
use crate::probe::{Probe, ProbeError, Prober};
use crate::state;
use crate::upstream::Following;
use control_loop::ControlLoop;
use tasks::Tasks;

/// What can stop the agent (the `run` command exits 1 with it).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The dataplane's second handle, for read-backs beside the loop, cannot be opened.
    #[error("opening the dataplane for read-backs failed: {0}")]
    Reader(#[source] crate::dataplane::Error),
    /// The state directory cannot be created.
    #[error("cannot create the state directory {}: {source} (set --state-dir to a writable directory)", .path.display())]
    StateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A probe setting was rejected.
    #[error(transparent)]
    Probe(#[from] crate::probe::ProbeError),
    /// Another agent runs with the same state directory, or its lock cannot be taken.
    #[error(transparent)]
    Lock(#[from] state::LockError),
    /// The metrics endpoint cannot listen.
    #[error("cannot listen on --metrics-addr {addr}: {source} (pick a free address, or \"off\")")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The link-local forwarder cannot listen.
    #[error(transparent)]
    Forwarder(#[from] crate::forwarder::Error),
    /// The link-local forwarders' runtime cannot start (threads, an epoll instance).
    #[error("cannot start the link-local forwarders' runtime: {0}")]
    ForwarderRuntime(#[source] std::io::Error),
    /// The kernel refuses the link-local fallback's rules (tried before anything is installed).
    #[error(
        "the kernel refuses the link-local fallback's rules: {0} (it needs nft_tproxy and \
         nft_socket, or xt_TPROXY and xt_socket with the iptables backends; without them \
         nothing can fail over in the link-local shape, and nothing was changed)"
    )]
    Fallback(#[source] crate::dataplane::Error),
    /// The upstream's Service is to be waited for, but there is no API client to follow it.
    #[error("no upstream IP: {0} (pass --upstream-ip, or give the agent an API client: its pod's service account or --kubeconfig)")]
    NoUpstream(String),
    /// A probe or watch task ended: the agent is blind and exits.
    #[error("the {task} task {how}; exiting with the current ruleset left in place")]
    TaskDied {
        /// Which task ([`crate::daemon`] names each one).
        task: &'static str,
        /// `ended`, or `panicked: <its message>`.
        how: String,
    },
}

/// `/healthz` fails when the control loop has not turned for this long.
const LIVENESS_SILENCE: Duration = Duration::from_secs(30);

/// Makes the prober of one stream: its query name, its timeout, and whether it probes the cache
/// (from the loopback address, see [`Probe::from_loopback`]) or the upstream.
type MakeProber =
    Box<dyn Fn(&str, Duration, Target) -> Result<Arc<dyn Prober>, ProbeError> + Send + Sync>;

/// What a probe stream probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Cache,
    Upstream,
}

/// What the control loop is connected to besides its configuration and its dataplane: the node
/// ([`World::node`]), or, in the loop's tests, scripted probes, a request channel the test holds,
/// and nothing of the node.
struct World {
    /// Makes each probe stream's prober.
    probes: MakeProber,
    /// Whether the node itself is watched: the socket-destroy watch, nftables' change
    /// announcements, the node's own firewall (at start and after), the search for others'
    /// NOTRACK rules, and the sockets of a drained cache. Without, none of them runs (they read
    /// the namespace's netfilter and sockets): the firewall is taken to let DNS through, and
    /// only failed probes end a drain.
    watch_node: bool,
    /// Where operators' requests come from; `None`: the control socket in the state directory.
    requests: Option<mpsc::Receiver<Incoming>>,
    /// Tasks supervised beside the agent's own: nothing outside the process can make one of
    /// those end, so a test hands in one that does.
    tasks: Tasks,
}

impl World {
    /// The node the agent runs on: DNS probes on the wire, every watcher, the control socket.
    fn node() -> World {
        World {
            probes: Box::new(|name, timeout, target| {
                let probe = Probe::new(name, timeout)?;
                Ok(Arc::new(match target {
                    Target::Cache => probe.from_loopback(),
                    Target::Upstream => probe,
                }))
            }),
            watch_node: true,
            requests: None,
            tasks: Tasks::default(),
        }
    }
}

/// The control loop's clock: tokio's, so that a test's paused clock drives every decision (on a
/// clock that is not paused, it is the monotonic clock).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Runs `job` (if any) on a blocking thread; its result comes back on `done`.
fn start_check(job: Option<CheckJob>, done: &mpsc::Sender<CheckDone>) {
    if let Some(job) = job {
        let done = done.clone();
        tokio::task::spawn_blocking(move || {
            // Only at shutdown is nobody listening.
            let _ = done.blocking_send(job.run());
        });
    }
}

/// Completes at `at`, never when `None`.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// How long a start waits out a predecessor that was killed a moment ago: a child it had just
/// forked (an `iptables-save`, a hook) holds its listener and its lock until it execs, when
/// close-on-exec releases them.
const STARTUP_GRACE: Duration = Duration::from_secs(2);

/// Tries the link-local fallback's rules on the kernel ([`Dataplane::trial`]), then starts the
/// forwarders and the copies of the link-local IPs. A trial that could not run (a lock, a
/// timeout) is said and passed over: the install itself will tell.
fn start_link_local(
    cfg: &AgentConfig,
    dataplane: &mut dyn Dataplane,
    upstream: &Following,
    beat: Beat,
    tasks: &mut Tasks,
) -> Result<link_local::Forwarding, AgentError> {
    // What would be installed (the fast path off takes the socket guard out of the fallback too).
    let shape = crate::dataplane::Shape { link_local: true, ..cfg.shape };
    let rules = crate::dataplane::plan(&cfg.addrs, crate::ruleset::Route::Local, shape);
    match blocking(|| dataplane.trial(&rules)) {
        Err(e) if e.is_refusal() => return Err(AgentError::Fallback(e)),
        Err(e) => warn!(error = %e, "could not try the link-local fallback's rules on the kernel"),
        Ok(()) => {}
    }
    let leased = dataplane.fallback_leased();
    link_local::start(&cfg.addrs.local, upstream, leased, beat, tasks)
}

/// Whether the ClusterIP shape runs on without the link-local failover after `error`: the
/// kernel refused the fallback's rules, or the forwarder may not listen on port 53.
fn link_local_optional(error: &AgentError) -> bool {
    match error {
        AgentError::Fallback(_) => true,
        AgentError::Forwarder(e) => e.is_permission(),
        _ => false,
    }
}

/// `take()`, retried for up to [`STARTUP_GRACE`] while it fails with what `busy` recognises.
async fn with_grace<T, E>(
    mut take: impl FnMut() -> Result<T, E>,
    busy: impl Fn(&E) -> bool,
) -> Result<T, E> {
    let deadline = tokio::time::Instant::now() + STARTUP_GRACE;
    loop {
        match take() {
            Err(e) if busy(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            taken => return taken,
        }
    }
}

/// Runs the agent on the node until `shutdown` completes; then, if its DaemonSet says it is
/// being removed ([`crate::cluster::removal`]), what cleans its Node once the caller has torn
/// its rules down. Wants a multi-threaded runtime, and
/// to be spawned on it rather than run by `block_on` (a probe's report then wakes no other
/// thread): applies block (milliseconds, seconds at worst) and run in `block_in_place`
/// ([`blocking`]) so probes go on meanwhile; checks run on blocking threads, beside the loop.
pub async fn run(
    cfg: AgentConfig,
    dataplane: Box<dyn Dataplane>,
    notes: Notes,
    leftovers: Vec<Box<dyn Dataplane>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Option<Removal>, AgentError> {
    awaitable(&cfg).await?;
    run_with(cfg, dataplane, notes, leftovers, shutdown, World::node()).await
}

/// [`run`], in `world`. Reads as the order of things: what can be refused is refused, the
/// state directory and the metrics port are claimed, the node is looked at, the agent starts,
/// its tasks are spawned, and the control loop turns.
async fn run_with(
    cfg: AgentConfig,
    dataplane: Box<dyn Dataplane>,
    notes: Notes,
    leftovers: Vec<Box<dyn Dataplane>>,
    shutdown: impl std::future::Future<Output = ()>,
    world: World,
) -> Result<Option<Removal>, AgentError> {
    let World { probes, watch_node, requests, mut tasks } = world;
    // Everything that can be refused is refused before the host is touched.
    let probers = make_probers(&cfg, &probes)?;
    let (_lock, http) = claim(&cfg).await?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new());
    if cfg.upstream.is_awaited() {
        warn!(upstream = %cfg.upstream.from, "waiting for the upstream's Service: until it is there the agent is not ready, the cache serves as it would without the agent, a dead cache's cluster-DNS IP fails over to CoreDNS through kube-proxy, and the link-local IP has no fallback (create the Service node-local-dns reads, or give --upstream-ip)");
        health.set_waiting(Some(format!("the upstream's {}", cfg.upstream.from)));
    }
    let forced = recorded_override(&cfg.state_dir);
    // The last agent's route, for a start that finds neither route's ruleset whole.
    let recorded = state::read(&cfg.state_dir).ok().map(|s| s.route);
    let listen: Vec<_> = cfg.addrs.local.iter().chain(&cfg.addrs.cluster_dns).copied().collect();
    // The Services' addresses: the interface the node reaches them through is no pod's.
    let services: Vec<_> = cfg.addrs.cluster_dns.iter().chain(&cfg.upstream.ips).copied().collect();
    let firewall = if watch_node { audit_firewall(&listen, &services) } else { Vec::new() };
    // Every cadence on one grid (one wake-up for all that fall on an instant).
    let beat = Beat::start();
    // The upstream's address, followed through the API server when its Service is.
    let following = Arc::new(Following::new(cfg.upstream.clone()));
    let mut cfg = cfg;
    let mut dataplane = dataplane;
    let (forwarding, link_local_off) = if watch_node && cfg.shape.link_local {
        link_local_or_without(&mut cfg, dataplane.as_mut(), &following, beat, &mut tasks)?
    } else {
        (None, None)
    };
    if let Some(forwarding) = &forwarding {
        metrics.set_forwarders(forwarding.counters.clone());
    }
    let mut agent = blocking(|| {
        Agent::start(&cfg, dataplane, metrics.clone(), forced, recorded, firewall, now())
    })
    .map_err(AgentError::Reader)?;
    // Ready once a ruleset is in: a start that could install nothing is retried in the loop.
    // Then the forwarders' lease too, which the heartbeats sent before the rules could not take.
    if !agent.is_dirty() {
        health.set_ready();
        if let Some(forwarding) = &forwarding {
            forwarding.renew_lease();
        }
    }
    let startup_taint = cfg
        .cluster
        .as_ref()
        .and_then(|c| c.startup_taint.clone().map(|key| (key, c.startup_taint_bound)));
    agent.set_notes(Notes { link_local_off, startup_taint, ..notes });
    agent.set_leftovers(leftovers);
    blocking(|| agent.remove_leftovers());
    let state_file = state::Writer::start(cfg.state_dir.clone());
    state_file.submit(agent.state(now(), SystemTime::now()));

    let cache_wakes = [Arc::new(Notify::new()), Arc::new(Notify::new())];
    let watched = watch_node.then_some((&listen[..], forwarding.as_ref()));
    // The quiet pace rests on the kernel's signals: the stall watch and the socket events.
    let quiet = cfg.quiet.filter(|_| watch_node && cfg.socket_events && cfg.stall.is_some());
    let pace = Arc::new(Pace::new(quiet));
    let probing = spawn::spawn_probes(
        &cfg,
        probers,
        beat,
        &pace,
        watched,
        &cache_wakes,
        &following,
        &mut tasks,
    );
    let node = watch_node.then(|| spawn::Watched {
        listen: &listen,
        services: &services,
        tables: agent.announced_tables(),
        backend: agent.backend(),
    });
    let node = spawn::spawn_node_watch(&cfg, node, cache_wakes, &mut tasks);
    let requests = match requests {
        Some(requests) => requests,
        None => spawn::spawn_control_socket(&cfg.state_dir, &mut tasks),
    };
    if let Some(listener) = http {
        spawn::spawn_metrics_endpoint(listener, metrics.clone(), health.clone(), &mut tasks);
    }
    let hooks = spawn::spawn_hooks(&cfg, &metrics, &mut tasks);
    let (reporter, removal) = match &cfg.cluster {
        Some(settings) => spawn::spawn_cluster(settings, &cfg.addrs, &following, &mut tasks)
            .await
            .map_or((None, None), |(reporter, removal)| (Some(reporter), removal)),
        None => (None, None),
    };
    // The loop turns on while the DaemonSet is asked (the API server may be slow).
    let stopping = async {
        shutdown.await;
        match &removal {
            Some(removal) => removal.ask().await,
            None => Verdict::Restart("no DaemonSet to ask (--daemonset, --node-name)".into()),
        }
    };
    let control = ControlLoop {
        cfg: &cfg,
        agent,
        beat,
        pace,
        metrics,
        health,
        probing,
        node,
        watch_node,
        requests,
        hooks,
        forwarding,
        state_file,
        reporter,
        upstream: following.subscribe(),
        tasks,
    };
    match control.run(stopping).await? {
        Verdict::Removal(_) => Ok(removal),
        Verdict::Restart(_) => Ok(None),
    }
}

/// An upstream that is waited for needs the API client that follows its Service: without one
/// it would never come, and that is refused before the host is touched. (The loop's tests wait
/// for it with no client: nothing of theirs follows a Service.)
async fn awaitable(cfg: &AgentConfig) -> Result<(), AgentError> {
    match &cfg.cluster {
        _ if !cfg.upstream.is_awaited() => Ok(()),
        Some(settings) => crate::cluster::client(settings)
            .await
            .map(drop)
            .map_err(|e| AgentError::NoUpstream(format!("{}, and {e}", cfg.upstream.from))),
        None => Err(AgentError::NoUpstream(cfg.upstream.from.clone())),
    }
}

/// Every probe stream's prober; a bad setting (the query name) is refused here.
fn make_probers(cfg: &AgentConfig, probes: &MakeProber) -> Result<spawn::Probers, AgentError> {
    let probe = |cadence: Cadence, target| probes(&cfg.probe_name, cadence.timeout, target);
    let cache_udp = probe(cfg.cache_udp, Target::Cache)?;
    let cache_tcp = cfg.cache_tcp.map(|c| probe(c, Target::Cache).map(|p| (c, p))).transpose()?;
    let upstream = probe(cfg.upstream_probe, Target::Upstream)?;
    let confirm = match cfg.stall {
        Some(bounds) => Some((bounds, probes(&cfg.probe_name, bounds.confirm(), Target::Cache)?)),
        None => None,
    };
    Ok(spawn::Probers { cache_udp, cache_tcp, upstream, confirm })
}

/// The state directory's lock, then the metrics listener. The lock first: a second agent on
/// the same state directory is told so, not that the metrics port is taken.
async fn claim(
    cfg: &AgentConfig,
) -> Result<(state::Lock, Option<tokio::net::TcpListener>), AgentError> {
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|source| AgentError::StateDir { path: cfg.state_dir.clone(), source })?;
    let lock = || state::Lock::acquire(&cfg.state_dir);
    let lock = with_grace(lock, |e| matches!(e, state::LockError::Held(..))).await?;
    let bind = |addr| {
        std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
    };
    let http = match cfg.metrics_addr {
        Some(addr) => Some(
            with_grace(|| bind(addr), |e| e.kind() == std::io::ErrorKind::AddrInUse)
                .await
                .map_err(|source| AgentError::Metrics { addr, source })?,
        ),
        None => None,
    };
    Ok((lock, http))
}

/// The route an operator forced and recorded in `state_dir`, if it is still in force.
fn recorded_override(state_dir: &std::path::Path) -> Option<crate::health::Forced> {
    match overrides::read(state_dir) {
        Ok(Some(o)) => {
            let forced = o.forced(Moment { now: now(), wall: SystemTime::now() });
            if forced.is_none() {
                info!("the recorded override has expired");
            }
            forced
        }
        Ok(None) => None,
        // A damaged file must not keep the agent from failing over: automatic, and say so.
        Err(e) => {
            warn!(error = %e, "ignoring the recorded override");
            None
        }
    }
}

/// What the node's own nftables firewall does to DNS for `listen` and `services`.
fn audit_firewall(
    listen: &[std::net::IpAddr],
    services: &[std::net::IpAddr],
) -> Vec<crate::firewall::Blocking> {
    blocking(|| nftables::audit_firewall(listen, services)).unwrap_or_else(|e| {
        warn!(error = %e, "cannot read the node's nftables firewall; assuming it lets DNS through");
        Vec::new()
    })
}

/// The forwarder and the copies of the link-local IPs, before the rules that need them, once
/// the kernel has taken those rules on trial; or, in the ClusterIP shape, the agent without the
/// link-local failover when it cannot have it (`cfg` then says so), and why.
fn link_local_or_without(
    cfg: &mut AgentConfig,
    dataplane: &mut dyn Dataplane,
    upstream: &Following,
    beat: Beat,
    tasks: &mut Tasks,
) -> Result<(Option<link_local::Forwarding>, Option<String>), AgentError> {
    match start_link_local(cfg, dataplane, upstream, beat, tasks) {
        Ok(forwarding) => Ok((Some(forwarding), None)),
        // In the ClusterIP shape, the cluster-DNS IP's failover needs neither the forwarder nor
        // TPROXY: run without the link-local one (no fallback chain), and say so, rather than
        // exit where an older DaemonSet gives no CAP_NET_BIND_SERVICE or the kernel has no
        // TPROXY.
        Err(e) if !cfg.addrs.cluster_dns.is_empty() && link_local_optional(&e) => {
            error!(error = %e, "link-local failover is off");
            cfg.shape.link_local = false;
            Ok((None, Some(e.to_string())))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;
