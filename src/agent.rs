//! The agent: probe streams in, route decisions out, the ruleset kept installed.
//!
//! [`Agent`] is the synchronous core — it owns the state machine, the dataplane and the counters
//! and reacts to one event at a time, so it is tested with the fake dataplane and no runtime.
//! [`run`] wires it to the world: probe tasks, the kernel's socket-destroy and nftables-change
//! notifications, a resync tick, the state file, and the shutdown signal.
//!
//! The loop is level-triggered: every tick (and every nftables change notification) reads the
//! table back and restores it if it is not exactly the ruleset of the current route. A failed
//! apply is retried on the next tick; the batch is atomic, so the node never holds half a ruleset.
//!
//! Decisions never wait behind a read-back: a check runs as a [`CheckJob`] on a worker thread
//! with its own handle on the dataplane ([`Dataplane::reader`]), while the loop goes on taking
//! probe results and applying. Applies stay on the loop, one at a time. Every apply starts a new
//! generation; a check that began in an older one is discarded when it returns (what it read
//! may predate the apply, or mix both), so it can never trigger a spurious repair.
//!
//! Exit policy: on SIGTERM or SIGINT the agent leaves the ruleset of its current route installed
//! and exits. `Local` is safe without the agent (the kernel fast path fails pods over when the
//! cache dies); `Upstream` stays because the agent last saw the cache failing. So an agent that
//! stops, crashes or is upgraded leaves the node exactly as it last decided, and a restarted agent
//! adopts the installed route instead of flipping. `teardown` removes everything.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, Notify};
use tokio::task::block_in_place;
use tracing::{debug, error, info, warn};

use crate::config::{AgentConfig, Cadence};
use crate::dataplane::nftables::TableRef;
use crate::dataplane::{self, Check, Dataplane};
use crate::firewall::Blocking;
use crate::health::{Forced, Machine, Sample, Stream, Transition};
use crate::metrics::{Health, Metrics};
use crate::probe::{Outcome, Probe, ProbeResult, Transport};
use crate::ruleset::{ListenAddrs, Route, RuleSet, DNS_PORT};
use crate::state::{self, ProbeStats, Probes, State};
use crate::{control, maintenance};

/// What can stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The dataplane's second handle, for read-backs beside the loop, cannot be opened.
    #[error("opening the dataplane for read-backs failed: {0}")]
    Reader(#[source] dataplane::Error),
    /// The state directory cannot be created.
    #[error("cannot create the state directory {}: {source} (set --state-dir to a writable directory)", .path.display())]
    StateDir {
        path: PathBuf,
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
    /// A probe or watch task ended: the agent is blind and exits.
    #[error("the {task} task {how}; exiting with the current ruleset left in place")]
    TaskDied {
        /// Which task ([`Tasks::spawn`]).
        task: &'static str,
        /// `ended`, or `panicked: <its message>`.
        how: String,
    },
}

/// `/healthz` fails when the control loop has not turned for this long.
const LIVENESS_SILENCE: Duration = Duration::from_secs(30);

/// How often the node is searched for NOTRACK rules of others on the listen addresses.
const FOREIGN_RULES_PERIOD: Duration = Duration::from_secs(10);

/// The least time between two repairs of the ruleset.
const REPAIR_SPACING: Duration = Duration::from_millis(50);

/// How often a ruleset whose changes the kernel announces is checked all the same. Reading
/// iptables-nft back runs child processes (`iptables-nft -S <chain>`: 4 per table and family,
/// a few ms each): too much for every tick, when announcements say when to.
const POLL_ANNOUNCED: Duration = Duration::from_secs(30);

/// A read-back to run off the control loop ([`CheckJob::run`], e.g. in `spawn_blocking`); its
/// result goes back to [`Agent::checked`].
pub struct CheckJob {
    generation: u64,
    rules: RuleSet,
    /// Only what lives in these tables ([`Dataplane::check_changed`]); `None`: everything.
    changed: Option<Vec<TableRef>>,
    reader: Box<dyn Dataplane>,
}

impl CheckJob {
    /// Reads the ruleset back and compares it with the route's (blocks: child processes or
    /// netlink dumps).
    pub fn run(mut self) -> CheckDone {
        let started = Instant::now();
        let result = match &self.changed {
            Some(tables) => self.reader.check_changed(&self.rules, tables),
            None => self.reader.check(&self.rules),
        };
        CheckDone {
            generation: self.generation,
            result,
            took: started.elapsed(),
            reader: self.reader,
        }
    }
}

/// A finished [`CheckJob`].
pub struct CheckDone {
    generation: u64,
    result: Result<Check, dataplane::Error>,
    took: Duration,
    reader: Box<dyn Dataplane>,
}

/// A probe result, tagged with the stream it belongs to.
#[derive(Clone, Debug)]
pub struct Report {
    pub stream: Stream,
    pub result: ProbeResult,
}

/// How the decision sees a probe outcome.
pub fn sample(outcome: &Outcome) -> Sample {
    match outcome {
        Outcome::Answered { .. } => Sample::Good,
        Outcome::Refused => Sample::Refused,
        other => Sample::Bad(other.label()),
    }
}

/// What the agent was told about its dataplane, for `status`.
#[derive(Clone, Debug, Default)]
pub struct Notes {
    /// Why `--dataplane auto` chose the backend.
    pub why: Option<String>,
    /// Where the filter ACCEPTs go.
    pub accepts_in: Vec<String>,
}

/// The synchronous core of the agent.
pub struct Agent {
    addrs: ListenAddrs,
    /// What goes into the ruleset besides the NOTRACK chains.
    shape: dataplane::Shape,
    machine: Machine,
    dataplane: Box<dyn Dataplane>,
    /// The ruleset of the current route, as last rendered.
    desired: RuleSet,
    /// The last apply failed; the next resync must apply without asking.
    dirty: bool,
    /// Failed applies in a row, for the retry backoff.
    apply_failures: u32,
    /// No resync before this: backing off after failed applies, or after a repair so that a
    /// tool fighting over the table (or our own change notification) cannot spin the loop.
    not_before: Option<Instant>,
    /// The resync period; the unit of the backoff.
    tick: Duration,
    /// Whether the kernel announces every change to what a check reads
    /// ([`Dataplane::announced_tables`]).
    announced: bool,
    /// When the ruleset was last read back (checked or applied).
    checked_at: Option<Instant>,
    /// The handle checks read back through, off the loop; `None` while a check is in flight.
    reader: Option<Box<dyn Dataplane>>,
    /// Bumped by every apply: a check begun in an older generation is stale.
    generation: u64,
    /// A whole check is wanted (a tick, a retry, or unknown announcements).
    check_all: bool,
    /// Tables announced changed since the last check began: the next check reads these.
    changed: Vec<TableRef>,
    /// Checks discarded because an apply overtook them.
    stale_checks: u64,
    transitions: u64,
    repairs: u64,
    last_error: Option<String>,
    probes: Probes,
    notes: Notes,
    warnings: Vec<String>,
    metrics: Arc<Metrics>,
    /// Route changes not yet taken by [`Agent::take_changes`].
    changes: Vec<Transition>,
    /// Backends the agent does not use that hold rules of an earlier agent's, to empty once
    /// the agent's own ruleset is in ([`Agent::remove_leftovers`]).
    leftovers: Vec<Box<dyn Dataplane>>,
    /// What was found there and what became of it, for `status`.
    leftover_notes: Vec<String>,
    /// What the node's own nftables firewall would stop, for `status` (as warnings).
    firewall: Vec<String>,
}

/// Why pods on `Local` could not reach the cache: a chain of the node's firewall that would
/// stop their queries to the cluster-DNS IP or the cache's replies from it. (One that stops
/// only the link-local IP is a warning: those clients have no other path to switch to.)
fn blocked_path(addrs: &ListenAddrs, firewall: &[Blocking]) -> Option<String> {
    let blocking: Vec<String> = firewall
        .iter()
        .filter(|b| addrs.cluster_dns.contains(&b.addr))
        .map(|b| format!("{} {} (hook {})", b.table, b.chain, b.hook()))
        .collect();
    (!blocking.is_empty()).then(|| {
        format!("the node's nftables firewall would stop their DNS: {}", blocking.join(", "))
    })
}

impl Agent {
    /// Adopts the route whose ruleset is installed (so a restart does not flip), or `Local`, and
    /// makes sure its ruleset is installed.
    ///
    /// A recorded override (`forced`) decides the first route instead, so a restart under an
    /// override never passes through another route.
    ///
    /// A start never fails on the dataplane: when the `Local` ruleset cannot be installed (the
    /// xtables lock held by kube-proxy for seconds, say), the agent starts on `Upstream`, the
    /// route that needs nothing of the cache, says why in `last_error`, and earns `Local` back
    /// through its probes like after any failover; when even that cannot be installed, it
    /// retries with backoff. Exiting instead would leave the node as the failure left it, on
    /// every restart of a crash loop.
    ///
    /// `firewall` is what the node's own nftables firewall would stop ([`crate::firewall`]):
    /// while it would stop pods' queries to the cluster-DNS IP, `Local` is never installed.
    pub fn start(
        cfg: &AgentConfig,
        mut dataplane: Box<dyn Dataplane>,
        metrics: Arc<Metrics>,
        forced: Option<Forced>,
        firewall: Vec<Blocking>,
        now: Instant,
    ) -> Result<Agent, AgentError> {
        // The second handle the read-backs use, before anything on the node changes.
        let reader = dataplane.reader().map_err(AgentError::Reader)?;
        let blocked = blocked_path(&cfg.addrs, &firewall);
        let installed = dataplane::installed_route(dataplane.as_mut(), &cfg.addrs, cfg.shape)
            .unwrap_or_else(|e| {
                warn!(error = %e, "reading back the installed ruleset failed; installing afresh");
                None
            });
        let forced_route = forced.as_ref().map(|f| f.route);
        let mut route = forced_route.or(installed).unwrap_or(Route::Local);
        if let (Some(why), Route::Local, None) = (&blocked, route, forced_route) {
            warn!(why = %why, "starting on upstream: pods could not reach the cache");
            route = Route::Upstream;
        }
        let mut desired = dataplane::plan(&cfg.addrs, route, cfg.shape);
        let (mut failed, mut dirty) = (None, false);
        if installed != Some(route) {
            if let Err(e) = dataplane.apply(&desired) {
                dirty = true;
                failed = Some(e.to_string());
                if route == Route::Local && forced_route.is_none() {
                    warn!(error = %e, "installing the local ruleset failed; starting on upstream");
                    route = Route::Upstream;
                    desired = dataplane::plan(&cfg.addrs, route, cfg.shape);
                    let upstream = dataplane.apply(&desired);
                    dirty = upstream.is_err();
                    failed = Some(match upstream {
                        Ok(()) => format!(
                            "installing the local ruleset at start failed: {e}; on upstream until \
                             the cache earns it back"
                        ),
                        Err(again) => format!(
                            "installing the local ruleset at start failed: {e}; the upstream \
                             ruleset too: {again}"
                        ),
                    });
                }
            }
        }
        metrics.set_route(route);
        metrics.set_override(forced.as_ref().map(|f| f.route));
        let mut machine = Machine::new(cfg.thresholds, route, now);
        machine.set_blocked(blocked, now);
        if let Some(forced) = forced {
            info!(route = %forced.route, kind = ?forced.kind, why = %forced.why, "recorded override");
            machine.force(forced, now);
        }
        info!(
            route = %route,
            adopted = installed == Some(route),
            dataplane = dataplane.name(),
            "started"
        );
        let announced = dataplane.announced_tables().is_some();
        let stats = |target: std::net::SocketAddr| ProbeStats {
            target: target.to_string(),
            ..ProbeStats::default()
        };
        let mut agent = Agent {
            addrs: cfg.addrs.clone(),
            shape: cfg.shape,
            machine,
            dataplane,
            desired,
            dirty: false,
            apply_failures: 0,
            not_before: None,
            tick: cfg.cache_udp.interval,
            announced,
            checked_at: Some(now),
            reader: Some(reader),
            generation: 0,
            check_all: false,
            changed: Vec::new(),
            stale_checks: 0,
            transitions: 0,
            repairs: 0,
            last_error: failed,
            probes: Probes {
                cache_udp: stats(cfg.cache_target()),
                cache_tcp: cfg.cache_tcp.map(|_| stats(cfg.cache_target())),
                upstream: stats(cfg.upstream_target()),
            },
            notes: Notes::default(),
            warnings: Vec::new(),
            metrics,
            changes: Vec::new(),
            leftovers: Vec::new(),
            leftover_notes: Vec::new(),
            firewall: Vec::new(),
        };
        agent.note_firewall(&firewall);
        if dirty {
            agent.failed_apply(now);
        }
        Ok(agent)
    }

    pub fn route(&self) -> Route {
        self.machine.route()
    }

    /// Takes one probe result; switches the route when the machine says so.
    pub fn on_probe(&mut self, report: &Report, now: Instant) {
        let outcome = &report.result.outcome;
        let Some(stats) = self.stats_mut(report.stream) else {
            return;
        };
        stats.sent += 1;
        if outcome.is_good() {
            stats.good += 1;
        } else {
            stats.bad += 1;
        }
        stats.last = Some(outcome.label().to_owned());
        stats.last_latency_ms = Some(report.result.latency.as_secs_f64() * 1e3);

        let held_before = self.machine.held().is_some();
        let forced_before = self.machine.forced().is_some();
        let transition = self.machine.observe(report.stream, sample(outcome), now);
        if forced_before && self.machine.forced().is_none() {
            info!(reason = %self.machine.reason(), "drain over");
            self.metrics.set_override(None);
        }
        let streak = self.machine.streak(report.stream);
        if let Some(stats) = self.stats_mut(report.stream) {
            stats.streak_good = streak.good;
            stats.streak_bad = streak.bad;
        }
        // The first failure of a streak says what went wrong (garbage from the cache, say);
        // the rest of the streak only counts.
        if !outcome.is_good() {
            if streak.bad == 1 {
                info!(stream = %report.stream, outcome = ?outcome, "probe failed");
            } else {
                debug!(stream = %report.stream, outcome = ?outcome, "probe failed");
            }
        }

        if let Some(held) = self.machine.held() {
            // Once when a hold begins; its text counts on, `status` shows the latest.
            if !held_before {
                warn!(route = %self.machine.route(), reason = %held, "route held");
            }
        }
        self.metrics.probe(report.stream, outcome.label(), report.result.latency);
        if let Some(t) = transition {
            self.switched(t, now);
        }
    }

    /// Installs the new route's ruleset and records the change.
    fn switched(&mut self, t: Transition, now: Instant) {
        self.transitions += 1;
        let evidence = self.evidence();
        info!(from = %t.from, to = %t.to, reason = %t.reason, evidence = %evidence, "route changed");
        self.metrics.transition(t.from, t.to, t.reason.kind());
        self.metrics.set_route(t.to);
        self.desired = dataplane::plan(&self.addrs, t.to, self.shape);
        self.apply(now);
        self.changes.push(t);
    }

    /// The probe streaks behind a decision, for the log.
    fn evidence(&self) -> String {
        let s = |stream| {
            let k = self.machine.streak(stream);
            format!("{stream} +{}/-{}", k.good, k.bad)
        };
        [s(Stream::CacheUdp), s(Stream::CacheTcp), s(Stream::Upstream)].join(", ")
    }

    /// Forces a route by hand (or for a drain).
    pub fn force(&mut self, forced: Forced, now: Instant) {
        info!(route = %forced.route, kind = ?forced.kind, why = %forced.why, "route forced");
        if let Some(t) = self.machine.force(forced, now) {
            self.switched(t, now);
        }
        self.metrics.set_override(self.machine.forced().map(|f| f.route));
    }

    /// Ends a forced route.
    pub fn release(&mut self, now: Instant) {
        if self.machine.forced().is_some() {
            info!("forced route released");
        }
        if let Some(t) = self.machine.release(now) {
            self.switched(t, now);
        }
        self.metrics.set_override(None);
    }

    /// Ends a forced route whose time has come.
    pub fn expire(&mut self, now: Instant) {
        let before = self.machine.forced().is_some();
        if let Some(t) = self.machine.expire(now) {
            self.switched(t, now);
        }
        if before && self.machine.forced().is_none() {
            info!("forced route expired");
            self.metrics.set_override(None);
        }
    }

    /// Ends a drain because its cache is gone (`why` says how that was seen), whatever the
    /// probes say; see [`Machine::end_drain`].
    pub fn end_drain(&mut self, why: &str, now: Instant) {
        if self.machine.end_drain(now) {
            info!(reason = %self.machine.reason(), evidence = why, "drain over");
            self.metrics.set_override(None);
        }
    }

    /// The addresses the cache listens on: the link-local and the cluster-DNS IPs.
    pub fn listen_ips(&self) -> Vec<std::net::IpAddr> {
        self.addrs.local.iter().chain(&self.addrs.cluster_dns).copied().collect()
    }

    /// The forced route, if any.
    pub fn forced(&self) -> Option<&Forced> {
        self.machine.forced()
    }

    /// The route changes since the last call, oldest first.
    pub fn take_changes(&mut self) -> Vec<Transition> {
        std::mem::take(&mut self.changes)
    }

    /// What the cache's probes say now, for an operator forcing `Local`.
    pub fn cache_failing(&self) -> Option<String> {
        let k = self.machine.streak(Stream::CacheUdp);
        (k.bad > 0).then(|| {
            format!("{} consecutive probes failed (last: {})", k.bad, k.last_bad.unwrap_or("bad"))
        })
    }

    /// What the dataplane's checks read, when the kernel announces its changes
    /// ([`Dataplane::announced_tables`]).
    pub fn announced_tables(&self) -> Option<Vec<TableRef>> {
        self.dataplane.announced_tables()
    }

    /// Counted replies of the cache (see [`Dataplane::reply_packets`]).
    pub fn reply_packets(&mut self) -> Result<Option<u64>, dataplane::Error> {
        self.dataplane.reply_packets()
    }

    fn stats_mut(&mut self, stream: Stream) -> Option<&mut ProbeStats> {
        match stream {
            Stream::CacheUdp => Some(&mut self.probes.cache_udp),
            Stream::CacheTcp => self.probes.cache_tcp.as_mut(),
            Stream::Upstream => Some(&mut self.probes.upstream),
        }
    }

    /// The tick's resync: every tick, unless the kernel announces the changes to the ruleset and
    /// `hearing` them (the watch is up), then every [`POLL_ANNOUNCED`] as a safety net.
    #[must_use = "a check to run off the loop"]
    pub fn poll(&mut self, now: Instant, hearing: bool) -> Option<CheckJob> {
        let recent = self.checked_at.is_some_and(|t| now.duration_since(t) < POLL_ANNOUNCED);
        if self.announced && hearing && recent && !self.dirty {
            return None;
        }
        self.resync(now)
    }

    /// Resyncs: re-applies after a failed apply (here, on the loop), else returns the read-back
    /// to run off the loop; its result goes to [`Agent::checked`], which restores the ruleset
    /// when it is not exactly the current route's. Nothing while a check is in flight (one
    /// follows when it returns) or a retry or spaced repair is pending.
    #[must_use = "a check to run off the loop"]
    pub fn resync(&mut self, now: Instant) -> Option<CheckJob> {
        self.check_all = true;
        self.next_check(now)
    }

    /// Like [`Agent::resync`], for the kernel's announcement that `tables` changed (`None`:
    /// unknown ones): the check reads back only what lives there.
    #[must_use = "a check to run off the loop"]
    pub fn announced(&mut self, tables: Option<Vec<TableRef>>, now: Instant) -> Option<CheckJob> {
        match tables {
            Some(tables) => {
                for t in tables {
                    if !self.changed.contains(&t) {
                        self.changed.push(t);
                    }
                }
            }
            None => self.check_all = true,
        }
        self.next_check(now)
    }

    /// The check wanted, unless one is in flight (it follows that one) or a retry or spaced
    /// repair is pending; after a failed apply, the apply (on the loop) instead.
    fn next_check(&mut self, now: Instant) -> Option<CheckJob> {
        if !self.check_all && self.changed.is_empty() {
            return None;
        }
        if self.not_before.is_some_and(|t| now < t) {
            return None;
        }
        self.not_before = None;
        if self.dirty {
            self.apply(now);
            return None;
        }
        let reader = self.reader.take()?;
        let changed = std::mem::take(&mut self.changed);
        let changed = (!std::mem::take(&mut self.check_all)).then_some(changed);
        Some(CheckJob { generation: self.generation, rules: self.desired.clone(), changed, reader })
    }

    /// Takes a finished check: repairs what it found, unless an apply overtook it (then it
    /// is discarded: the apply read back itself). Returns the next check when one was asked
    /// for meanwhile.
    #[must_use = "a check to run off the loop"]
    pub fn checked(&mut self, done: CheckDone, now: Instant) -> Option<CheckJob> {
        self.reader = Some(done.reader);
        self.metrics.check(done.took);
        if done.generation != self.generation {
            self.stale_checks += 1;
            debug!(result = ?done.result.as_ref().ok(), "a check overtaken by an apply, discarded");
        } else {
            self.checked_at = Some(now);
            match done.result {
                Ok(Check::Matches) => {}
                Ok(drift) => {
                    self.repairs += 1;
                    self.metrics.repair();
                    warn!(route = %self.route(), drift = ?drift, "ruleset changed by someone else, restoring");
                    self.apply(now);
                    // Whoever keeps changing the table (our own change notification included)
                    // cannot make the agent spin: repairs are spaced.
                    let spacing = self.tick.min(REPAIR_SPACING);
                    self.not_before = Some(self.not_before.unwrap_or(now).max(now + spacing));
                }
                Err(e) => {
                    warn!(error = %e, "reading the ruleset back failed, re-applying");
                    self.apply(now);
                }
            }
        }
        self.next_check(now)
    }

    /// Checks discarded because an apply overtook them.
    pub fn stale_checks(&self) -> u64 {
        self.stale_checks
    }

    /// Whether a check is in flight.
    pub fn checking(&self) -> bool {
        self.reader.is_none()
    }

    /// Installs the current route's ruleset; on failure, schedules a retry with exponential
    /// backoff (two ticks, doubling, at most 5 s). The batch is atomic: a failure changes nothing.
    fn apply(&mut self, now: Instant) {
        let started = Instant::now();
        // Whatever a check in flight reads now may predate this apply, or mix both.
        self.generation += 1;
        let result = self.dataplane.apply(&self.desired);
        self.metrics.apply(started.elapsed(), result.is_ok());
        match result {
            Ok(()) => {
                self.checked_at = Some(now);
                self.dirty = false;
                self.apply_failures = 0;
                self.not_before = None;
                self.last_error = None;
            }
            Err(e) => {
                self.last_error = Some(e.to_string());
                self.failed_apply(now);
            }
        }
    }

    /// Schedules the retry of a failed apply: two ticks, doubling, at most 5 s.
    fn failed_apply(&mut self, now: Instant) {
        self.apply_failures += 1;
        let backoff =
            self.tick.saturating_mul(1 << self.apply_failures.min(16)).min(Duration::from_secs(5));
        let error = self.last_error.as_deref().unwrap_or("unknown");
        error!(route = %self.route(), error, retry_in = ?backoff, "applying the ruleset failed");
        self.dirty = true;
        self.not_before = Some(now + backoff);
    }

    /// Hands over backends the agent does not use but that hold its rules (left by an agent
    /// that used them): they are emptied once the agent's own ruleset is in.
    pub fn set_leftovers(&mut self, leftovers: Vec<Box<dyn Dataplane>>) {
        for part in &leftovers {
            warn!(backend = part.name(), "rules of an earlier agent in a backend no longer used; removing them once ours are in");
        }
        self.leftover_notes = leftovers.iter().map(|p| format!("{}: found", p.name())).collect();
        self.leftovers = leftovers;
    }

    /// Empties the backends of [`Agent::set_leftovers`] once the agent's own ruleset is in, so
    /// no moment is left without a path: a stale ruleset elsewhere would keep steering pods by
    /// its own rules (an old socket-guarded NOTRACK pins them to a hung cache). A failure
    /// (the xtables lock held) is retried on the next call.
    pub fn remove_leftovers(&mut self) {
        if self.dirty || self.leftovers.is_empty() {
            return;
        }
        let notes = &mut self.leftover_notes;
        self.leftovers.retain_mut(|part| {
            let (keep, note) = match part.remove() {
                Ok(()) => {
                    info!(backend = part.name(), "removed an earlier agent's rules");
                    (false, format!("{}: found and removed", part.name()))
                }
                Err(e) => (true, format!("{}: found; removing failed, retrying: {e}", part.name())),
            };
            let name = part.name();
            if let Some(old) = notes.iter_mut().find(|n| n.split(": ").next() == Some(name)) {
                if keep && *old != note {
                    warn!(backend = name, note = %note, "removing an earlier agent's rules failed");
                }
                *old = note;
            }
            keep
        });
    }

    /// Takes a new look at the node's own nftables firewall: while it would stop pods' DNS to
    /// the cache, the route is `Upstream` (see [`Machine::set_blocked`]).
    pub fn set_firewall(&mut self, found: Vec<Blocking>, now: Instant) {
        self.note_firewall(&found);
        let before = self.machine.blocked().map(str::to_owned);
        let blocked = blocked_path(&self.addrs, &found);
        if blocked.is_none() && before.is_some() {
            info!("the node's firewall lets pods reach the cache again");
        }
        if let Some(t) = self.machine.set_blocked(blocked, now) {
            self.switched(t, now);
        }
    }

    fn note_firewall(&mut self, found: &[Blocking]) {
        let notes: Vec<String> = found.iter().map(ToString::to_string).collect();
        for note in notes.iter().filter(|n| !self.firewall.contains(n)) {
            warn!(problem = %note, "the node's firewall");
        }
        self.firewall = notes;
    }

    /// Records what detection found, for `status`.
    pub fn set_notes(&mut self, notes: Notes) {
        self.notes = notes;
    }

    /// Replaces the warnings about the node (logged when they change).
    pub fn set_warnings(&mut self, warnings: Vec<String>) {
        if warnings != self.warnings {
            for w in warnings.iter().filter(|w| !self.warnings.contains(w)) {
                warn!(warning = %w, "node problem");
            }
            self.warnings = warnings;
        }
    }

    /// When a deferred resync (a retry, a spaced repair) is due.
    pub fn resync_due(&self) -> Option<Instant> {
        self.not_before
    }

    /// Whether the kernel may not hold the current route's ruleset (the last apply failed).
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// One last attempt to install the current route's ruleset, for shutdown.
    pub fn settle(&mut self, now: Instant) {
        if self.dirty {
            self.not_before = None;
            self.apply(now);
        }
    }

    /// The state file's content; `now` and `wall` are the same moment on both clocks.
    pub fn state(&self, now: Instant, wall: SystemTime) -> State {
        let since = crate::overrides::Moment { now, wall }.unix_ms_at(self.machine.since());
        State {
            version: state::VERSION,
            pid: std::process::id(),
            updated_unix_ms: state::unix_ms(wall),
            dataplane: self.dataplane.name().to_owned(),
            dataplane_why: self.notes.why.clone(),
            accepts_in: self.notes.accepts_in.clone(),
            warnings: self.firewall.iter().chain(&self.warnings).cloned().collect(),
            leftovers: self.leftover_notes.clone(),
            route: self.route(),
            since_unix_ms: since,
            reason: self.machine.reason().to_string(),
            held: self.machine.held().map(ToString::to_string),
            transitions: self.transitions,
            repairs: self.repairs,
            last_error: self.last_error.clone(),
            probes: self.probes.clone(),
        }
    }
}

/// Probes `target` every `cadence.interval`, and at once when `wake` is notified.
async fn probe_stream(
    probe: Arc<Probe>,
    target: std::net::SocketAddr,
    transport: Transport,
    stream: Stream,
    interval: Duration,
    wake: Arc<Notify>,
    tx: mpsc::Sender<Report>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = wake.notified() => {}
        }
        // A wake-up during a probe means a cache socket just closed: the query may have gone to
        // a socket that is closing too, and would only time out. Ask again.
        let result = loop {
            tokio::select! {
                result = probe.run(target, transport) => break result,
                _ = wake.notified() => {}
            }
        };
        if tx.send(Report { stream, result }).await.is_err() {
            return;
        }
    }
}

/// Wakes the cache probes when the kernel reports one of the cache's listening sockets closed.
/// Without the notifications (an old kernel), the probes alone still detect a crash.
async fn watch_cache_sockets(addrs: Vec<IpAddr>, wake: [Arc<Notify>; 2]) {
    let mut watch = match crate::sockdiag::SocketWatch::open() {
        Ok(w) => w,
        Err(e) => {
            warn!(error = %e, "socket-destroy notifications unavailable; relying on probes");
            return std::future::pending().await;
        }
    };
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

/// Notifies `resync` whenever one of `tables` changes in this network namespace (any table when
/// `None`), the agent's own changes included: the resync that follows finds them in order and
/// does nothing. `hearing` is true while the announcements are heard; when they are not, the
/// agent checks on every tick.
/// What besides the agent's own tables [`watch_nftables`] tells about.
struct Watched {
    /// Set when an iptables-nft raw table changed (node-cache's rules, say).
    raw: Arc<AtomicBool>,
    /// Notified when a table of the node's own firewall may have changed.
    firewall: Arc<Notify>,
}

async fn watch_nftables(
    tables: Option<Vec<TableRef>>,
    resync: Arc<Notify>,
    changed: Arc<std::sync::Mutex<Option<Vec<TableRef>>>>,
    watched: Watched,
    hearing: Arc<AtomicBool>,
) {
    let raw = dataplane::iptables::Table::Raw.nft_tables();
    let mut watch = match crate::dataplane::nftables::ChangeWatch::new() {
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
                if tables.as_ref().is_none_or(|t| announced.touches(t)) {
                    // Which of them, for the check; taken (and emptied) by the loop. `None`:
                    // unknown, check everything.
                    if let Ok(mut changed) = changed.lock() {
                        let next = match (changed.take(), announced.unknown) {
                            (Some(mut seen), false) => {
                                seen.extend(announced.tables.iter().cloned());
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

/// How often the node's own nftables firewall is read again without being told it changed.
const FIREWALL_PERIOD: Duration = Duration::from_secs(30);

/// The node's own nftables firewall, judged for the listen addresses `addrs`.
fn audit_firewall(addrs: &[IpAddr]) -> Result<Vec<Blocking>, dataplane::Error> {
    let tables = dataplane::nftables::Nftables::new()?.host_firewall()?;
    Ok(crate::firewall::blocking(&tables, addrs))
}

/// Reads the node's own nftables firewall again whenever one of its tables changes (`changed`)
/// and every [`FIREWALL_PERIOD`], and sends what it would stop. A failed read is said once and
/// changes nothing.
async fn watch_firewall(addrs: Vec<IpAddr>, changed: Arc<Notify>, tx: mpsc::Sender<Vec<Blocking>>) {
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

/// Every `period`, looks for NOTRACK rules on the listen addresses that are not the agent's
/// (node-cache run without `-setupiptables=false` re-inserts its own every 60 s): while they
/// exist, the `Upstream` route cannot take effect, and only an operator can fix that.
///
/// iptables-nft is read again only when its raw tables were announced changed (`raw_changed`),
/// or every [`POLL_ANNOUNCED`] (every period while announcements are not `hearing`), and then
/// only the built-in chains node-cache writes to, one `iptables-nft -S <chain>` each
/// ([`gather_builtin_chains`]): `iptables-nft-save` fetches the whole ruleset, 4 s of CPU
/// with kube-proxy's 50,000 nat rules. iptables-legacy announces nothing and reads only the
/// tables it lists; it is read every period.
async fn watch_foreign_rules(
    addrs: Vec<IpAddr>,
    period: Duration,
    raw_changed: Arc<AtomicBool>,
    hearing: Arc<AtomicBool>,
    tx: mpsc::Sender<Vec<String>>,
) {
    use crate::detect::{gather_builtin_chains, gather_flavour, Facts, Flavour, SaveFacts};
    let mut ticker = tokio::time::interval(period);
    let mut nft: Option<(SaveFacts, Vec<String>, Instant)> = None;
    loop {
        ticker.tick().await;
        let changed = raw_changed.swap(false, Ordering::Relaxed);
        let fresh = nft.as_ref().is_some_and(|(_, _, at)| at.elapsed() < POLL_ANNOUNCED);
        let reread = changed || !(fresh && hearing.load(Ordering::Relaxed));
        let addrs = addrs.clone();
        let Ok((legacy, nft_now)) = tokio::task::spawn_blocking(move || {
            let legacy = gather_flavour(Flavour::Legacy, &addrs);
            (legacy, reread.then(|| gather_builtin_chains(Flavour::Nft, &addrs)))
        })
        .await
        else {
            continue;
        };
        if let Some((facts, unreadable)) = nft_now {
            nft = Some((facts, unreadable, Instant::now()));
        }
        let Some((nft_facts, nft_unreadable, _)) = &nft else { continue };
        let (legacy, mut unreadable) = legacy;
        unreadable.extend(nft_unreadable.iter().cloned());
        // Only the foreign rules and what was unreadable are used here.
        let facts = Facts {
            kube_proxy_nftables: false,
            kube_ipvs0: false,
            legacy,
            nft: nft_facts.clone(),
            unreadable,
        };
        let found = crate::detect::decide(&facts);
        let foreign = found.foreign_notrack.into_iter().map(|rule| {
            format!("foreign NOTRACK for a listen address (node-cache needs -setupiptables=false): {rule}")
        });
        let unreadable = found.unreadable.into_iter().map(|problem| {
            format!(
                "cannot read the node's iptables rules (CAP_NET_RAW missing? iptables-legacy also \
                 needs uid 0 to list its tables): {problem}"
            )
        });
        let warnings = foreign.chain(unreadable).collect();
        if tx.send(warnings).await.is_err() {
            return;
        }
    }
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

/// `take()`, retried for up to [`STARTUP_GRACE`] while it fails with what `busy` recognises.
async fn with_grace<T, E>(
    mut take: impl FnMut() -> Result<T, E>,
    busy: impl Fn(&E) -> bool,
) -> Result<T, E> {
    let deadline = Instant::now() + STARTUP_GRACE;
    loop {
        match take() {
            Err(e) if busy(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            taken => return taken,
        }
    }
}

/// The agent's probe and watch tasks, each under a name. Every one of them runs forever: one
/// that ends has panicked (or returned by mistake), and the agent can no longer see what it
/// should.
#[derive(Default)]
struct Tasks {
    set: tokio::task::JoinSet<()>,
    names: std::collections::HashMap<tokio::task::Id, &'static str>,
}

impl Tasks {
    fn spawn(
        &mut self,
        name: &'static str,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let id = self.set.spawn(task).id();
        self.names.insert(id, name);
    }

    /// The first task to end, named and with how it ended; pending while every one runs.
    async fn died(&mut self) -> AgentError {
        let (id, how) = loop {
            match self.set.join_next_with_id().await {
                Some(Ok((id, ()))) => break (id, "ended".to_owned()),
                Some(Err(e)) if e.is_panic() => {
                    let id = e.id();
                    let payload = e.into_panic();
                    let message = payload
                        .downcast_ref::<&str>()
                        .copied()
                        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                        .unwrap_or("no message");
                    break (id, format!("panicked: {message}"));
                }
                // Cancelled: only at shutdown, by us.
                Some(Err(_)) => {}
                None => std::future::pending().await,
            }
        };
        AgentError::TaskDied { task: self.names.get(&id).copied().unwrap_or("unnamed"), how }
    }

    async fn shutdown(&mut self) {
        self.set.shutdown().await;
    }
}

/// Runs the agent until `shutdown` completes. Needs a multi-threaded runtime: applies block
/// (milliseconds, seconds at worst) and run in `block_in_place` so probes go on meanwhile;
/// checks run on blocking threads, beside the loop.
pub async fn run(
    cfg: AgentConfig,
    dataplane: Box<dyn Dataplane>,
    notes: Notes,
    leftovers: Vec<Box<dyn Dataplane>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    run_with(cfg, dataplane, notes, leftovers, shutdown, Tasks::default()).await
}

/// [`run`], supervising `tasks` beside the agent's own: nothing outside the process can make
/// one of those end, so a test hands in one that does.
async fn run_with(
    cfg: AgentConfig,
    dataplane: Box<dyn Dataplane>,
    notes: Notes,
    leftovers: Vec<Box<dyn Dataplane>>,
    shutdown: impl std::future::Future<Output = ()>,
    mut tasks: Tasks,
) -> Result<(), AgentError> {
    // Everything that can be refused is refused before the host is touched.
    let probe = |cadence: Cadence| Probe::new(&cfg.probe_name, cadence.timeout).map(Arc::new);
    let cache_udp = probe(cfg.cache_udp)?;
    let cache_tcp = cfg.cache_tcp.map(|c| probe(c).map(|p| (c, p))).transpose()?;
    let upstream = probe(cfg.upstream_probe)?;
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
    let forced = match crate::overrides::read(&cfg.state_dir) {
        Ok(Some(o)) => {
            let forced = o.forced(crate::overrides::Moment::now());
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
    let listen: Vec<_> = cfg.addrs.local.iter().chain(&cfg.addrs.cluster_dns).copied().collect();
    let firewall = block_in_place(|| audit_firewall(&listen)).unwrap_or_else(|e| {
        warn!(error = %e, "cannot read the node's nftables firewall; assuming it lets DNS through");
        Vec::new()
    });
    let mut agent = block_in_place(|| {
        Agent::start(&cfg, dataplane, metrics.clone(), forced, firewall, Instant::now())
    })?;
    // Ready once a ruleset is in: a start that could install nothing is retried in the loop.
    if !agent.is_dirty() {
        health.set_ready();
    }
    agent.set_notes(notes);
    agent.set_leftovers(leftovers);
    block_in_place(|| agent.remove_leftovers());
    // Written beside the loop: a synced write must not hold a decision up.
    let state_file = state::Writer::start(cfg.state_dir.clone());
    let write_state =
        |agent: &Agent| state_file.submit(agent.state(Instant::now(), SystemTime::now()));
    write_state(&agent);

    let (tx, mut rx) = mpsc::channel(64);
    let cache_wakes = [Arc::new(Notify::new()), Arc::new(Notify::new())];
    let target = cfg.cache_target();
    let every = cfg.cache_udp.interval;
    let wake = cache_wakes[0].clone();
    tasks.spawn(
        "cache UDP probe",
        probe_stream(cache_udp, target, Transport::Udp, Stream::CacheUdp, every, wake, tx.clone()),
    );
    if let Some((cadence, tcp)) = cache_tcp {
        let wake = cache_wakes[1].clone();
        let every = cadence.interval;
        tasks.spawn(
            "cache TCP probe",
            probe_stream(tcp, target, Transport::Tcp, Stream::CacheTcp, every, wake, tx.clone()),
        );
    }
    let (target, every) = (cfg.upstream_target(), cfg.upstream_probe.interval);
    let wake = Arc::new(Notify::new());
    let upstream =
        probe_stream(upstream, target, Transport::Udp, Stream::Upstream, every, wake, tx);
    tasks.spawn("upstream probe", upstream);
    if cfg.socket_events {
        tasks.spawn("socket-destroy watch", watch_cache_sockets(listen.clone(), cache_wakes));
    }
    let nft_changed = Arc::new(Notify::new());
    let hearing = Arc::new(AtomicBool::new(false));
    let tables = agent.announced_tables();
    let raw_changed = Arc::new(AtomicBool::new(false));
    let firewall_changed = Arc::new(Notify::new());
    let watched = Watched { raw: raw_changed.clone(), firewall: firewall_changed.clone() };
    let announced = Arc::new(std::sync::Mutex::new(Some(Vec::new())));
    tasks.spawn(
        "nftables change watch",
        watch_nftables(tables, nft_changed.clone(), announced.clone(), watched, hearing.clone()),
    );
    let (firewall_tx, mut firewall_found) = mpsc::channel(1);
    tasks.spawn("firewall watch", watch_firewall(listen.clone(), firewall_changed, firewall_tx));
    let (warn_tx, mut warnings) = mpsc::channel(1);
    let period = FOREIGN_RULES_PERIOD;
    let foreign = watch_foreign_rules(listen, period, raw_changed, hearing.clone(), warn_tx);
    tasks.spawn("foreign-rule watch", foreign);
    let (control_tx, mut requests) = mpsc::channel(8);
    let dir = cfg.state_dir.clone();
    tasks.spawn("control socket", async move {
        // Without the socket the agent still switches; operators lose the manual flip only.
        let Err(e) = control::serve(&dir, control_tx).await;
        error!(error = %e, "the control socket is unavailable");
        std::future::pending().await
    });
    if let Some(listener) = http {
        let (metrics, health) = (metrics.clone(), health.clone());
        tasks.spawn("metrics endpoint", async move {
            let e = crate::metrics::serve(listener, metrics, health, LIVENESS_SILENCE).await;
            error!(error = %e, "the metrics endpoint stopped");
            std::future::pending().await
        });
    }

    let mut resync = tokio::time::interval(cfg.cache_udp.interval);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut state_tick = tokio::time::interval(Duration::from_secs(1));
    state_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drain: Option<maintenance::Drain> = None;
    let override_file = crate::overrides::path(&cfg.state_dir);
    let mut record_stuck = false;
    // Hooks run one at a time, in order, beside the loop.
    let hooks = cfg.on_transition.clone().map(|path| {
        let (tx, rx) = mpsc::channel(16);
        let hooks = maintenance::run_hooks(path, rx, cfg.hook_timeout, metrics.clone());
        tasks.spawn("transition hook", hooks);
        tx
    });
    // Read-backs run on blocking threads, one at a time; their results come back here.
    let (checks_tx, mut checks) = mpsc::channel(1);
    tokio::pin!(shutdown);
    let outcome = loop {
        health.beat(Instant::now());
        tokio::select! {
            biased;
            _ = &mut shutdown => break Ok(()),
            Some(report) = rx.recv() => block_in_place(|| agent.on_probe(&report, Instant::now())),
            Some(incoming) = requests.recv() => block_in_place(|| {
                maintenance::handle(&mut agent, &cfg.state_dir, incoming, &mut drain, Instant::now())
            }),
            _ = nft_changed.notified() => {
                let tables = announced
                    .lock()
                    .map(|mut a| a.replace(Vec::new()))
                    .unwrap_or(None);
                let job = block_in_place(|| agent.announced(tables, Instant::now()));
                start_check(job, &checks_tx);
            }
            _ = sleep_until(agent.resync_due()) => {
                let job = block_in_place(|| agent.resync(Instant::now()));
                start_check(job, &checks_tx);
            }
            Some(done) = checks.recv() => {
                let job = block_in_place(|| agent.checked(done, Instant::now()));
                start_check(job, &checks_tx);
            }
            _ = resync.tick() => {
                let job = block_in_place(|| {
                    let now = Instant::now();
                    agent.expire(now);
                    maintenance::end_drain_if_its_cache_is_gone(&mut agent, now);
                    let job = agent.poll(now, hearing.load(Ordering::Relaxed));
                    agent.remove_leftovers();
                    drain = drain.take().and_then(|d| d.progress(&mut agent, now));
                    job
                });
                start_check(job, &checks_tx);
            }
            _ = state_tick.tick() => write_state(&agent),
            Some(found) = warnings.recv() => agent.set_warnings(found),
            Some(found) = firewall_found.recv() => block_in_place(|| agent.set_firewall(found, Instant::now())),
            // The agent can no longer see what it should. Exit, leaving the current ruleset;
            // the DaemonSet restarts us.
            died = tasks.died() => break Err(died),
        }
        // A drain that ended by itself, or an expiry, leaves nothing forced: the record goes
        // too (with or without a route change), so a restart cannot bring it back.
        // If it cannot be removed (a directory in its place), that is said once, not on every
        // turn of the loop.
        if agent.forced().is_none() && override_file.exists() {
            match crate::overrides::clear(&cfg.state_dir) {
                Ok(()) => record_stuck = false,
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
    block_in_place(|| agent.settle(Instant::now()));
    write_state(&agent);
    block_in_place(|| state_file.finish());
    if agent.is_dirty() {
        error!(route = %agent.route(), "stopping; the last apply failed, the kernel may still hold the previous route's ruleset");
    } else {
        info!(route = %agent.route(), "stopping; the ruleset of the current route stays installed");
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{test_raw, RawRun};
    use crate::dataplane::fake::FakeDataplane;

    fn cfg() -> AgentConfig {
        let raw = RawRun { state_dir: "/nonexistent".into(), ..test_raw() };
        AgentConfig::from_args(&raw, |_| None).unwrap()
    }

    fn report(stream: Stream, outcome: Outcome) -> Report {
        Report { stream, result: ProbeResult { outcome, latency: Duration::from_millis(1) } }
    }

    /// The route whose ruleset the fake kernel holds.
    fn installed(fake: &FakeDataplane) -> Option<Route> {
        dataplane::installed_route(&mut fake.clone(), &cfg().addrs, Default::default()).unwrap()
    }

    /// A resync with its check run at once, as the loop does on a worker.
    fn sync(agent: &mut Agent, now: Instant) {
        let mut job = agent.resync(now);
        while let Some(j) = job {
            job = agent.checked(j.run(), now);
        }
    }

    /// A tick's poll, likewise.
    fn poll(agent: &mut Agent, now: Instant, hearing: bool) {
        if let Some(job) = agent.poll(now, hearing) {
            assert!(agent.checked(job.run(), now).is_none());
        }
    }

    fn start(fake: &FakeDataplane, t0: Instant) -> Agent {
        Agent::start(&cfg(), Box::new(fake.clone()), Arc::new(Metrics::new()), None, Vec::new(), t0)
            .unwrap()
    }

    #[test]
    fn installs_local_when_nothing_is_installed() {
        let fake = FakeDataplane::default();
        start(&fake, Instant::now());
        assert_eq!(installed(&fake), Some(Route::Local));
        assert_eq!(fake.kernel().applies, 1);
    }

    #[test]
    fn adopts_the_installed_route_without_applying() {
        let fake = FakeDataplane::holding(RuleSet::desired(&cfg().addrs, Route::Upstream));
        let agent = start(&fake, Instant::now());
        assert_eq!(agent.route(), Route::Upstream);
        assert_eq!(fake.kernel().applies, 0);
    }

    #[test]
    fn a_recorded_override_decides_the_first_route() {
        let t0 = Instant::now();
        let fake = FakeDataplane::holding(RuleSet::desired(&cfg().addrs, Route::Local));
        let forced = Forced {
            route: Route::Upstream,
            kind: crate::health::ForceKind::Manual,
            until: None,
            why: "maintenance".into(),
            waits_for: None,
        };
        let metrics = Arc::new(Metrics::new());
        let mut agent =
            Agent::start(&cfg(), Box::new(fake.clone()), metrics, Some(forced), Vec::new(), t0)
                .unwrap();
        assert_eq!(installed(&fake), Some(Route::Upstream));
        assert_eq!(fake.kernel().applies, 1);
        assert!(agent.take_changes().is_empty(), "no transition through another route");
        // Healthy probes do not move a forced route.
        for i in 0..20 {
            let at = t0 + Duration::from_millis(100 * i);
            agent.on_probe(
                &report(
                    Stream::CacheUdp,
                    Outcome::Answered { rcode: hickory_proto::op::ResponseCode::NoError },
                ),
                at,
            );
        }
        assert_eq!(agent.route(), Route::Upstream);
    }

    #[test]
    fn a_failed_local_install_at_start_falls_back_to_upstream() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        fake.kernel().fail_next_apply = true;
        let mut agent = start(&fake, t0);
        // The agent runs on, on the route that needs nothing of the cache.
        assert_eq!(agent.route(), Route::Upstream);
        assert_eq!(installed(&fake), Some(Route::Upstream));
        assert!(!agent.is_dirty());
        let st = agent.state(t0, SystemTime::now());
        assert!(st.last_error.as_deref().is_some_and(|e| e.contains("local ruleset")), "{st:?}");
        // The cache earns Local back like after any failover: rise good probes and min-hold.
        let good = report(
            Stream::CacheUdp,
            Outcome::Answered { rcode: hickory_proto::op::ResponseCode::NoError },
        );
        let thresholds = cfg().thresholds;
        for i in 0..thresholds.rise {
            agent.on_probe(&good, t0 + thresholds.min_hold + Duration::from_millis(u64::from(i)));
        }
        assert_eq!(agent.route(), Route::Local);
        assert_eq!(installed(&fake), Some(Route::Local));
        assert_eq!(agent.state(t0, SystemTime::now()).last_error, None);
    }

    #[test]
    fn a_start_that_can_install_nothing_retries_instead_of_exiting() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        fake.kernel().fail_applies = 2;
        let mut agent = start(&fake, t0);
        assert_eq!(agent.route(), Route::Upstream);
        assert!(agent.is_dirty());
        assert_eq!(installed(&fake), None, "nothing of the agent's: pods go through the DNAT");
        let retry = agent.resync_due().expect("a retry is scheduled");
        assert!(agent.resync(retry).is_none(), "a retry applies; it reads nothing back");
        assert!(!agent.is_dirty());
        assert_eq!(installed(&fake), Some(Route::Upstream));
    }

    #[test]
    fn leftovers_go_once_the_agents_own_ruleset_is_in() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        fake.kernel().fail_applies = 2;
        let mut agent = start(&fake, t0);
        let old = FakeDataplane::holding(RuleSet::desired(&cfg().addrs, Route::Local));
        agent.set_leftovers(vec![Box::new(old.clone())]);
        // Nothing of ours is in yet: the old backend's rules are the only path, they stay.
        agent.remove_leftovers();
        assert!(old.kernel().installed.is_some());
        assert_eq!(agent.state(t0, SystemTime::now()).leftovers, ["fake: found"]);
        assert!(agent.resync(agent.resync_due().unwrap()).is_none());
        assert!(!agent.is_dirty());
        agent.remove_leftovers();
        assert_eq!(old.kernel().installed, None);
        assert_eq!(agent.state(t0, SystemTime::now()).leftovers, ["fake: found and removed"]);
    }

    #[test]
    fn a_refused_probe_switches_the_installed_ruleset() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = start(&fake, t0);
        agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), t0);
        assert_eq!(installed(&fake), Some(Route::Upstream));
        let st = agent.state(t0, SystemTime::now());
        assert_eq!(st.transitions, 1);
        assert_eq!(st.probes.cache_udp.bad, 1);
        assert!(st.reason.contains("refused"), "{}", st.reason);
    }

    #[test]
    fn a_failed_apply_is_retried_with_backoff() {
        let t0 = Instant::now();
        let fake = FakeDataplane::holding(RuleSet::desired(&cfg().addrs, Route::Local));
        let mut agent = start(&fake, t0);
        fake.kernel().fail_next_apply = true;
        agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), t0);
        // The kernel still holds Local: the batch failed whole.
        assert_eq!(installed(&fake), Some(Route::Local));
        assert!(agent.is_dirty());
        assert!(agent.state(t0, SystemTime::now()).last_error.is_some());
        // Not before the backoff (2 ticks after the first failure)...
        sync(&mut agent, t0 + Duration::from_millis(150));
        assert_eq!(installed(&fake), Some(Route::Local));
        // ...but then.
        sync(&mut agent, t0 + Duration::from_millis(200));
        assert_eq!(installed(&fake), Some(Route::Upstream));
        assert!(!agent.is_dirty());
        assert_eq!(agent.state(t0, SystemTime::now()).last_error, None);
    }

    /// The retries of a failing apply come 2, 4, 8 … ticks apart, never more than 5 s, none
    /// before it is due; a success ends the backoff, and the next failure starts it afresh.
    #[test]
    fn apply_retries_back_off_doubling_up_to_a_cap() {
        let t0 = Instant::now();
        let tick = cfg().cache_udp.interval;
        let fake = FakeDataplane::holding(RuleSet::desired(&cfg().addrs, Route::Local));
        let mut agent = start(&fake, t0);
        let failing = 9;
        fake.kernel().fail_applies = failing;
        // Failed applies so far.
        let attempts = |fake: &FakeDataplane| failing - fake.kernel().fail_applies;
        let mut at = t0;
        agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), at);
        let mut spacings = Vec::new();
        while agent.is_dirty() {
            let due = agent.resync_due().expect("a retry is scheduled while dirty");
            // Early, nothing happens: not the retry, nor a read-back.
            let tried = attempts(&fake);
            assert!(agent.resync(due - Duration::from_millis(1)).is_none());
            assert_eq!(attempts(&fake), tried, "retried before it was due");
            spacings.push((due - at).as_millis());
            at = due;
            assert!(agent.resync(at).is_none(), "a retry applies; it reads nothing back");
        }
        assert_eq!((attempts(&fake), fake.kernel().applies), (failing, 1), "failed, then applied");
        let ticks = |n: u32| (tick * n).as_millis();
        let cap = 5000;
        assert_eq!(
            spacings,
            [ticks(2), ticks(4), ticks(8), ticks(16), ticks(32), cap, cap, cap, cap],
            "tick {tick:?}"
        );
        assert_eq!(installed(&fake), Some(Route::Upstream));
        assert_eq!(agent.resync_due(), None);
        // A new failure backs off from the start again.
        fake.kernel().fail_next_apply = true;
        let forced = Forced {
            route: Route::Local,
            kind: crate::health::ForceKind::Manual,
            until: None,
            why: "test".into(),
            waits_for: None,
        };
        agent.force(forced, at);
        assert!(agent.is_dirty());
        assert_eq!(agent.resync_due(), Some(at + tick * 2));
    }

    #[test]
    fn ticks_check_an_announced_ruleset_only_as_a_safety_net() {
        let t0 = Instant::now();
        let polled = FakeDataplane::default();
        let announced = FakeDataplane::default();
        announced.kernel().announces = true;
        let mut agents = [start(&polled, t0), start(&announced, t0)];
        let checks = |fake: &FakeDataplane| fake.kernel().checks;
        let before = [checks(&polled), checks(&announced)];
        let tick = Duration::from_millis(100);
        for n in 1..=10 {
            agents.iter_mut().for_each(|a| poll(a, t0 + tick * n, true));
        }
        assert_eq!(checks(&polled) - before[0], 10, "a polled ruleset is checked every tick");
        assert_eq!(checks(&announced), before[1], "an announced one waits for announcements");
        // Not heard (the watch failed): every tick again.
        poll(&mut agents[1], t0 + tick * 11, false);
        assert_eq!(checks(&announced), before[1] + 1);
        // Heard, but nothing checked for POLL_ANNOUNCED: checked all the same, and repaired.
        announced.kernel().installed = None;
        poll(&mut agents[1], t0 + tick * 11 + POLL_ANNOUNCED / 2, true);
        assert_eq!(installed(&announced), None);
        poll(&mut agents[1], t0 + tick * 11 + POLL_ANNOUNCED, true);
        assert_eq!(installed(&announced), Some(Route::Local));
    }

    #[test]
    fn resync_restores_a_removed_table_with_repairs_spaced() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = start(&fake, t0);
        sync(&mut agent, t0);
        assert_eq!(agent.state(t0, SystemTime::now()).repairs, 0);
        fake.kernel().installed = None;
        sync(&mut agent, t0);
        assert_eq!(installed(&fake), Some(Route::Local));
        assert_eq!(agent.state(t0, SystemTime::now()).repairs, 1);
        // Someone removes it again at once: repaired after a pause, not in a loop.
        fake.kernel().installed = None;
        sync(&mut agent, t0 + Duration::from_millis(1));
        assert_eq!(installed(&fake), None);
        assert_eq!(agent.resync_due(), Some(t0 + REPAIR_SPACING));
        sync(&mut agent, t0 + REPAIR_SPACING);
        assert_eq!(installed(&fake), Some(Route::Local));
        assert_eq!(agent.state(t0, SystemTime::now()).repairs, 2);
        // Once due and done, nothing stays scheduled (the loop would spin on it).
        sync(&mut agent, t0 + REPAIR_SPACING * 3);
        assert_eq!(agent.resync_due(), None);
    }

    #[test]
    fn a_switch_goes_ahead_of_a_check_in_flight_and_the_check_is_discarded() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = start(&fake, t0);
        let gate = Arc::new(crate::dataplane::fake::Gate::default());
        fake.kernel().gate = Some(gate.clone());
        // A check starts and is held in its read-back, as iptables-nft-save is for a second on
        // a node with 50,000 rules.
        let job = agent.resync(t0).expect("a check is due");
        let held = std::thread::spawn(move || job.run());
        gate.wait_for_waiting(1);
        assert!(agent.checking());
        // The cache refuses: the switch is applied now, not after the check.
        agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), t0);
        let upstream = dataplane::plan(&cfg().addrs, Route::Upstream, Default::default());
        assert_eq!(fake.kernel().installed.as_ref(), Some(&upstream), "applied while checking");
        assert_eq!(fake.kernel().applies, 2);
        // Meanwhile nothing else starts a second read-back; one follows the first.
        assert!(agent.resync(t0).is_none());
        // The check returns having compared the new table with the old route's: stale, so it
        // is discarded, not taken for drift.
        gate.open();
        let next = agent.checked(held.join().unwrap(), t0).expect("the resync asked meanwhile");
        assert_eq!(agent.stale_checks(), 1);
        assert_eq!(agent.state(t0, SystemTime::now()).repairs, 0);
        assert_eq!(fake.kernel().applies, 2, "no spurious repair");
        // The check that follows is of the current generation, and finds the table in order.
        assert!(agent.checked(next.run(), t0).is_none());
        assert_eq!(agent.state(t0, SystemTime::now()).repairs, 0);
        assert_eq!(agent.stale_checks(), 1);
        assert_eq!(fake.kernel().installed.as_ref(), Some(&upstream));
    }

    #[test]
    fn a_check_of_the_current_generation_repairs_drift() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = start(&fake, t0);
        let job = agent.resync(t0).expect("a check is due");
        fake.kernel().installed = None;
        assert!(agent.checked(job.run(), t0).is_none());
        assert_eq!(installed(&fake), Some(Route::Local));
        assert_eq!(agent.state(t0, SystemTime::now()).repairs, 1);
        assert_eq!(agent.stale_checks(), 0);
    }

    #[test]
    fn announced_tables_scope_the_next_check_and_add_up_while_one_is_in_flight() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = start(&fake, t0);
        let table = |name: &str| TableRef { family: 2, name: name.to_owned() };
        let job = agent.announced(Some(vec![table("filter")]), t0).expect("a check");
        assert_eq!(job.changed, Some(vec![table("filter")]));
        // In flight: announcements add up for the check that follows it.
        assert!(agent.announced(Some(vec![table("raw")]), t0).is_none());
        assert!(agent.announced(Some(vec![table("filter")]), t0).is_none());
        let next = agent.checked(job.run(), t0).expect("the announcements meanwhile");
        assert_eq!(next.changed, Some(vec![table("raw"), table("filter")]));
        // A tick's resync, or an announcement that could not be read, checks everything.
        assert!(agent.resync(t0).is_none());
        let next = agent.checked(next.run(), t0).expect("the resync meanwhile");
        assert_eq!(next.changed, None);
        assert!(agent.checked(next.run(), t0).is_none());
        assert_eq!(agent.announced(None, t0).expect("a check").changed, None);
    }

    #[test]
    fn settle_retries_a_failed_apply_at_shutdown() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = start(&fake, t0);
        fake.kernel().fail_next_apply = true;
        agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), t0);
        assert_eq!(installed(&fake), Some(Route::Local));
        agent.settle(t0);
        assert_eq!(installed(&fake), Some(Route::Upstream));
    }

    /// Every task of the agent runs forever: the first one to end, by returning or panicking,
    /// is named in the error `run` exits with (exit code 1), however many others still run.
    #[tokio::test]
    async fn a_task_that_ends_or_panics_is_named_in_the_agents_exit() {
        let patience = Duration::from_secs(10);
        let mut tasks = Tasks::default();
        tasks.spawn("steady watch", std::future::pending());
        tasks.spawn("cache UDP probe", async { panic!("a bug") });
        let died = tokio::time::timeout(patience, tasks.died()).await.expect("the panic seen");
        assert_eq!(
            died.to_string(),
            "the cache UDP probe task panicked: a bug; exiting with the current ruleset left in place"
        );
        tasks.spawn("control socket", async {});
        let died = tokio::time::timeout(patience, tasks.died()).await.expect("the return seen");
        assert!(
            matches!(died, AgentError::TaskDied { task: "control socket", ref how } if how == "ended")
        );
        // The steady one never counts as dead.
        let quiet = tokio::time::timeout(Duration::ZERO, tasks.died()).await;
        assert!(quiet.is_err(), "{:?}", quiet.map(|e| e.to_string()));
    }

    /// The whole loop, in a network namespace of its own (it probes, binds its sockets and
    /// reads netfilter there): a task that dies stops the agent with an error naming it (exit
    /// code 1), and the ruleset it installed stays.
    #[test]
    fn the_agent_exits_on_a_dead_task_and_leaves_its_ruleset() {
        crate::testutil::in_netns("nlha-agent", crate::testutil::test_path!(), |_| {
            let dir = std::env::temp_dir().join(format!("nlha-agent-{}", std::process::id()));
            let raw = RawRun { state_dir: dir.clone(), ..test_raw() };
            let cfg = AgentConfig::from_args(&raw, |_| None).unwrap();
            let fake = FakeDataplane::default();
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            let agent = Box::new(fake.clone());
            let result = runtime.block_on(async {
                let mut tasks = Tasks::default();
                // Its end waits in the task set until the loop looks.
                tasks.spawn("doomed watch", async { panic!("injected") });
                let shutdown = std::future::pending();
                let run = run_with(cfg, agent, Notes::default(), Vec::new(), shutdown, tasks);
                tokio::time::timeout(Duration::from_secs(30), run).await
            });
            let _ = std::fs::remove_dir_all(&dir);
            let error = result.expect("the agent went on with a dead task").expect_err("exit 0");
            assert!(
                matches!(error, AgentError::TaskDied { task: "doomed watch", ref how } if how == "panicked: injected"),
                "{error}"
            );
            // Left as it was (Local, or Upstream if a probe found no cache in this namespace
            // before the loop looked at its tasks), not removed.
            assert!(installed(&fake).is_some(), "the ruleset was not left in place");
        });
    }

    #[test]
    fn state_reports_since_on_the_wall_clock() {
        let t0 = Instant::now();
        let mut agent = start(&FakeDataplane::default(), t0);
        agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), t0);
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let st = agent.state(t0 + Duration::from_secs(3), wall);
        assert_eq!(st.since_unix_ms, 97_000);
        assert_eq!(st.route, Route::Upstream);
    }
}
