//! The daemon: the [`Agent`] run as a process, with its probe and watch tasks around it.
//!
//! [`run`] refuses bad settings before the host is touched, takes the state directory's lock,
//! starts the agent (adopting the installed route, or the recorded override), and then turns
//! the control loop: probe results, operators' requests ([`maintenance`]), nftables change
//! announcements, the resync tick, finished read-backs and what the node's watchers found go to
//! the agent one at a time; the state file and the transition hook ([`hooks`]) hear of every
//! change. Every task runs forever under a name ([`Tasks`]): one that ends stops the agent, with
//! the ruleset of its current route left installed (the exit policy of [`crate::agent`]).
//!
//! The watchers live beside what they watch: the probe streams in [`crate::probe`], the
//! cache's sockets in [`crate::sockdiag`], nftables' announcements and the node's own
//! firewall (judged by [`crate::firewall`]) in [`crate::dataplane::nftables`], node-cache's
//! rules in [`crate::detect`].

mod link_local;
mod tasks;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, Notify};
use tracing::{error, info, warn};

use crate::agent::{Agent, CheckDone, CheckJob, Notes};
use crate::beat::Beat;
use crate::blocking::blocking;
use crate::config::{AgentConfig, Cadence};
use crate::control::Incoming;
use crate::dataplane::{nftables, Dataplane};
use crate::health::Stream;
use crate::metrics::{Health, Metrics};
use crate::overrides::{self, Moment};
use crate::probe::{self, Probe, ProbeError, Prober, Transport};
use crate::{control, detect, hooks, maintenance, sockdiag, stall, state};
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
    link_local::start(&cfg.addrs.local, &cfg.upstream, leased, beat, tasks)
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

/// Runs the agent on the node until `shutdown` completes. Wants a multi-threaded runtime, and
/// to be spawned on it rather than run by `block_on` (a probe's report then wakes no other
/// thread): applies block (milliseconds, seconds at worst) and run in `block_in_place`
/// ([`blocking`]) so probes go on meanwhile; checks run on blocking threads, beside the loop.
pub async fn run(
    cfg: AgentConfig,
    dataplane: Box<dyn Dataplane>,
    notes: Notes,
    leftovers: Vec<Box<dyn Dataplane>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    run_with(cfg, dataplane, notes, leftovers, shutdown, World::node()).await
}

/// [`run`], in `world`.
async fn run_with(
    cfg: AgentConfig,
    dataplane: Box<dyn Dataplane>,
    notes: Notes,
    leftovers: Vec<Box<dyn Dataplane>>,
    shutdown: impl std::future::Future<Output = ()>,
    world: World,
) -> Result<(), AgentError> {
    let World { probes, watch_node, requests, mut tasks } = world;
    // Everything that can be refused is refused before the host is touched.
    let probe = |cadence: Cadence, target| probes(&cfg.probe_name, cadence.timeout, target);
    let cache_udp = probe(cfg.cache_udp, Target::Cache)?;
    let cache_tcp = cfg.cache_tcp.map(|c| probe(c, Target::Cache).map(|p| (c, p))).transpose()?;
    let upstream = probe(cfg.upstream_probe, Target::Upstream)?;
    let confirm = match cfg.stall {
        Some(bounds) => Some((bounds, probes(&cfg.probe_name, bounds.confirm(), Target::Cache)?)),
        None => None,
    };
    // The lock first: a second agent on the same state directory is told so, not that the
    // metrics port is taken.
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|source| AgentError::StateDir { path: cfg.state_dir.clone(), source })?;
    let lock = || state::Lock::acquire(&cfg.state_dir);
    let _lock = with_grace(lock, |e| matches!(e, state::LockError::Held(..))).await?;
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

    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new());
    let forced = match overrides::read(&cfg.state_dir) {
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
    };
    // The last agent's route, for a start that finds neither route's ruleset whole.
    let recorded = state::read(&cfg.state_dir).ok().map(|s| s.route);
    let listen: Vec<_> = cfg.addrs.local.iter().chain(&cfg.addrs.cluster_dns).copied().collect();
    // The Services' addresses: the interface the node reaches them through is no pod's.
    let services: Vec<_> = cfg.addrs.cluster_dns.iter().chain(&cfg.upstream).copied().collect();
    let firewall = if watch_node {
        blocking(|| nftables::audit_firewall(&listen, &services)).unwrap_or_else(|e| {
            warn!(error = %e, "cannot read the node's nftables firewall; assuming it lets DNS through");
            Vec::new()
        })
    } else {
        Vec::new()
    };
    // Every cadence on one grid (one wake-up for all that fall on an instant).
    let beat = Beat::start();
    // The forwarder and the copies of the link-local IPs before the rules that need them, once
    // the kernel has taken those rules on trial.
    let mut cfg = cfg;
    let mut dataplane = dataplane;
    let mut link_local_off = None;
    let forwarding = if watch_node && cfg.shape.link_local {
        match start_link_local(&cfg, dataplane.as_mut(), beat, &mut tasks) {
            Ok(forwarding) => Some(forwarding),
            // In the ClusterIP shape, the cluster-DNS IP's failover needs neither the forwarder
            // nor TPROXY: run without the link-local one (no fallback chain), and say so,
            // rather than exit where an older DaemonSet gives no CAP_NET_BIND_SERVICE or the
            // kernel has no TPROXY.
            Err(e) if !cfg.addrs.cluster_dns.is_empty() && link_local_optional(&e) => {
                error!(error = %e, "link-local failover is off");
                link_local_off = Some(e.to_string());
                cfg.shape.link_local = false;
                None
            }
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    let forwarders = forwarding.as_ref().map_or_else(Vec::new, |f| f.counters.clone());
    if !forwarders.is_empty() {
        metrics.set_forwarders(forwarders.clone());
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
    agent.set_notes(Notes { link_local_off, ..notes });
    agent.set_leftovers(leftovers);
    blocking(|| agent.remove_leftovers());
    // Written beside the loop: a synced write must not hold a decision up.
    let state_file = state::Writer::start(cfg.state_dir.clone());
    let write_state = |agent: &Agent| state_file.submit(agent.state(now(), SystemTime::now()));
    write_state(&agent);

    let (tx, mut rx) = mpsc::channel(64);
    let cache_wakes = [Arc::new(Notify::new()), Arc::new(Notify::new())];
    // Told of every cache probe answered: the stall watch lists a restarted cache's sockets then.
    let cache_answered = Arc::new(Notify::new());
    let target = cfg.cache_target();
    let every = beat.every(cfg.cache_udp.interval);
    let wake = cache_wakes[0].clone();
    tasks.spawn(
        "cache UDP probe",
        probe::probe_stream(
            cache_udp,
            target,
            Transport::Udp,
            Stream::CacheUdp,
            every,
            wake,
            tx.clone(),
        ),
    );
    if let Some((cadence, tcp)) = cache_tcp {
        let wake = cache_wakes[1].clone();
        let every = beat.every(cadence.interval);
        tasks.spawn(
            "cache TCP probe",
            probe::probe_stream(
                tcp,
                target,
                Transport::Tcp,
                Stream::CacheTcp,
                every,
                wake,
                tx.clone(),
            ),
        );
    }
    if let (true, Some((bounds, confirm))) = (watch_node, confirm) {
        // Each cache probe and its answer, each upstream probe: the node's UDP datagrams the
        // agent accounts for.
        let per_sec = |every: Duration| 1.0 / every.as_secs_f64();
        // And the forwarders' lease heartbeats (iptables): 20 a second that, counted as
        // traffic, kept the watch at its faster pace on every idle iptables node.
        let heartbeats =
            forwarding.as_ref().map_or(0.0, link_local::Forwarding::heartbeats_per_sec);
        let own = 2.0 * per_sec(cfg.cache_udp.interval)
            + per_sec(cfg.upstream_probe.interval)
            + heartbeats;
        let answered = cache_answered.clone();
        let stalls =
            stall::watch_stalls(bounds, beat, listen.clone(), own, confirm, answered, tx.clone());
        tasks.spawn("stall watch", stalls);
    }
    let (target, every) = (cfg.upstream_target(), beat.every(cfg.upstream_probe.interval));
    let wake = Arc::new(Notify::new());
    let upstream =
        probe::probe_stream(upstream, target, Transport::Udp, Stream::Upstream, every, wake, tx);
    tasks.spawn("upstream probe", upstream);
    let nft_changed = Arc::new(Notify::new());
    let hearing = Arc::new(AtomicBool::new(false));
    let announced = Arc::new(std::sync::Mutex::new(Some(Vec::new())));
    let (firewall_tx, mut firewall_found) = mpsc::channel(1);
    let (warn_tx, mut warnings) = mpsc::channel(1);
    if watch_node {
        if cfg.socket_events {
            tasks.spawn(
                "socket-destroy watch",
                sockdiag::watch_cache_sockets(listen.clone(), cache_wakes),
            );
        }
        let tables = agent.announced_tables();
        let raw_changed = Arc::new(AtomicBool::new(false));
        let firewall_changed = Arc::new(Notify::new());
        let watched =
            nftables::Watched { raw: raw_changed.clone(), firewall: firewall_changed.clone() };
        tasks.spawn(
            "nftables change watch",
            nftables::watch_nftables(
                tables,
                nft_changed.clone(),
                announced.clone(),
                watched,
                hearing.clone(),
            ),
        );
        tasks.spawn(
            "firewall watch",
            nftables::watch_firewall(listen.clone(), services, firewall_changed, firewall_tx),
        );
        // Others' NOTRACK on the link-local IP is harmless: the fallback's TPROXY acts on
        // untracked packets all the same. On the cluster-DNS IP it pins pods to the cache.
        let period = detect::FOREIGN_RULES_PERIOD;
        let cluster_dns = cfg.addrs.cluster_dns.clone();
        let foreign =
            detect::watch_foreign_rules(cluster_dns, period, raw_changed, hearing.clone(), warn_tx);
        tasks.spawn("foreign-rule watch", foreign);
    }
    let mut requests = match requests {
        Some(requests) => requests,
        None => {
            let (control_tx, requests) = mpsc::channel(8);
            let dir = cfg.state_dir.clone();
            tasks.spawn("control socket", async move {
                // Without the socket the agent still switches; operators lose the manual flip
                // only.
                let Err(e) = control::serve(&dir, control_tx).await;
                error!(error = %e, "the control socket is unavailable");
                std::future::pending().await
            });
            requests
        }
    };
    if let Some(listener) = http {
        let (metrics, health) = (metrics.clone(), health.clone());
        tasks.spawn("metrics endpoint", async move {
            let e = crate::metrics::serve(listener, metrics, health, LIVENESS_SILENCE).await;
            error!(error = %e, "the metrics endpoint stopped");
            std::future::pending().await
        });
    }

    let mut resync = beat.every(cfg.cache_udp.interval);
    let mut state_tick = beat.every(Duration::from_secs(1));
    let mut drain: Option<maintenance::Drain> = None;
    let override_file = overrides::path(&cfg.state_dir);
    // The agent writes the record on a request (at start, an earlier agent's may be there), and
    // anyone may write garbage there: it is looked for at start, after each request and once a
    // second, not on every turn (a stat per probe report).
    let mut maybe_recorded = true;
    let mut record_stuck = false;
    // Hooks run one at a time, in order, beside the loop.
    let hooks = cfg.on_transition.clone().map(|path| {
        let (tx, rx) = mpsc::channel(16);
        let hooks = hooks::run_hooks(path, rx, cfg.hook_timeout, metrics.clone());
        tasks.spawn("transition hook", hooks);
        tx
    });
    // Read-backs run on blocking threads, one at a time; their results come back here.
    let (checks_tx, mut checks) = mpsc::channel(1);
    tokio::pin!(shutdown);
    let outcome = loop {
        health.beat(now());
        tokio::select! {
            biased;
            _ = &mut shutdown => break Ok(()),
            Some(report) = rx.recv() => {
                if report.stream == Stream::CacheUdp && report.result.outcome.is_good() {
                    cache_answered.notify_one();
                }
                agent.on_probe(&report, now())
            }
            Some(incoming) = requests.recv() => {
                maybe_recorded = true;
                blocking(|| {
                    maintenance::handle(&mut agent, &cfg.state_dir, incoming, &mut drain, now())
                })
            }
            _ = nft_changed.notified() => {
                let tables = announced
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
                let job = agent.poll(now, hearing.load(Ordering::Relaxed));
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
            Some(found) = warnings.recv() => agent.set_problems(found),
            Some(found) = firewall_found.recv() => blocking(|| agent.set_firewall(found, now())),
            // The agent can no longer see what it should. Exit, leaving the current ruleset;
            // the DaemonSet restarts us.
            died = tasks.died() => break Err(died),
        }
        // A drain that ended by itself, or an expiry, leaves nothing forced: the record goes
        // too (with or without a route change), so a restart cannot bring it back.
        // If it cannot be removed (a directory in its place), that is said once, not on every
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
        if !health.ready() && !agent.is_dirty() {
            health.set_ready();
            if let Some(forwarding) = &forwarding {
                forwarding.renew_lease();
            }
        }
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
    if agent.is_dirty() {
        error!(route = %agent.route(), "stopping; the last apply failed, the kernel may still hold the previous route's ruleset");
    } else {
        info!(route = %agent.route(), "stopping; the ruleset of the current route stays installed");
    }
    outcome
}

#[cfg(test)]
mod tests;
