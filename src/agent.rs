//! The agent: probe streams in, route decisions out, the ruleset kept installed.
//!
//! [`Agent`] is the synchronous core — it owns the state machine and the counters, hands each
//! route's ruleset to its [`Reconciler`] (which keeps it installed), and reacts to one event at
//! a time, so it is tested with the fake dataplane and no runtime. [`crate::daemon`] wires it to
//! the world: probes, the kernel's notifications, a resync tick, the state file, the signals.
//!
//! Exit policy: on SIGTERM or SIGINT the agent leaves its current route's ruleset and exits.
//! `Local` is safe without the agent (the kernel fast path fails pods over when the cache dies);
//! `Upstream` stays because the agent last saw the cache failing. A restarted agent adopts the
//! installed route instead of flipping. `teardown` removes everything, and so does an agent
//! whose DaemonSet is gone or being deleted at its SIGTERM (`crate::cluster::removal`).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, info, warn};

use crate::blocking::blocking;
use crate::config::AgentConfig;
use crate::dataplane::{self, Dataplane, TableRef, TableWatch};
use crate::detect::NodeProblems;
use crate::firewall::Blocking;
use crate::health::{Forced, Machine, Sample, Stall, Stream, Transition};
use crate::metrics::Metrics;
use crate::probe::{Outcome, Report};
use crate::reconciler::Reconciler;
use crate::ruleset::{ListenAddrs, Route};
use crate::state::{self, ProbeStats, Probes, State};

pub use crate::reconciler::{CheckDone, CheckJob};

/// How the decision sees a probe outcome.
pub fn sample(outcome: &Outcome) -> Sample {
    match outcome {
        Outcome::Answered { .. } => Sample::Good,
        Outcome::Refused => Sample::Refused,
        &Outcome::Stalled { queued_bytes, for_ms } => {
            Sample::Stalled(Stall { queued_bytes, for_ms })
        }
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
    /// Why the link-local IP is not failed over although it should be.
    pub link_local_off: Option<String>,
    /// The startup taint's key (`--startup-taint`) and the longest it stays
    /// (`--startup-taint-timeout`).
    pub startup_taint: Option<(String, Duration)>,
}

/// The synchronous core of the agent.
pub struct Agent {
    addrs: ListenAddrs,
    /// What goes into the ruleset besides the NOTRACK chains.
    shape: dataplane::Shape,
    machine: Machine,
    /// Keeps the ruleset of the current route installed; the only writer to the dataplane.
    reconciler: Reconciler,
    transitions: u64,
    probes: Probes,
    /// Where the upstream's address came from ([`State::upstream_from`]).
    upstream_from: String,
    notes: Notes,
    /// The link-local forwarder's counts, when the daemon runs one.
    forwarded: Option<state::Forwarded>,
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
    /// When it started: the startup taint's bound counts from here.
    started: Instant,
    /// Others' rules for the cluster-DNS IP at the last look, counted.
    foreign: state::Foreign,
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
    /// Adopts the route whose ruleset is installed (so a restart does not flip), and makes sure
    /// its ruleset is installed. When neither route's ruleset is there whole (an upgrade that
    /// changed the rules' text, a kill between two transactions), the route the last agent
    /// `recorded` in its state file, or else `Local`: an upgrade while the cache hangs stays
    /// on `Upstream` rather than send pods back to the hung cache until the probes notice.
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
        recorded: Option<Route>,
        firewall: Vec<Blocking>,
        now: Instant,
    ) -> Result<Agent, dataplane::Error> {
        // The second handle the read-backs use, before anything on the node changes.
        let reader = dataplane.reader()?;
        let blocked = blocked_path(&cfg.addrs, &firewall);
        let installed = dataplane::installed_route(dataplane.as_mut(), &cfg.addrs, cfg.shape)
            .unwrap_or_else(|e| {
                warn!(error = %e, "reading back the installed ruleset failed; installing afresh");
                None
            });
        let forced_route = forced.as_ref().map(|f| f.route);
        let mut route = forced_route.or(installed).or(recorded).unwrap_or(Route::Local);
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
        let tick = cfg.cache_udp.interval;
        let reconciler =
            Reconciler::new(dataplane, reader, route, desired, tick, metrics.clone(), now);
        let stats = |target: std::net::SocketAddr| ProbeStats {
            target: target.to_string(),
            ..ProbeStats::default()
        };
        let mut agent = Agent {
            addrs: cfg.addrs.clone(),
            shape: cfg.shape,
            machine,
            reconciler,
            transitions: 0,
            probes: Probes {
                cache_udp: stats(cfg.cache_target()),
                cache_tcp: cfg.cache_tcp.map(|_| stats(cfg.cache_target())),
                upstream: ProbeStats::default(),
            },
            upstream_from: String::new(),
            notes: Notes::default(),
            forwarded: None,
            warnings: Vec::new(),
            metrics,
            changes: Vec::new(),
            leftovers: Vec::new(),
            leftover_notes: Vec::new(),
            firewall: Vec::new(),
            started: now,
            foreign: state::Foreign::default(),
        };
        agent.set_upstream(&cfg.upstream);
        agent.note_firewall(&firewall);
        if let Some(failed) = failed {
            agent.reconciler.start_failed(failed, dirty, now);
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
        if held_before != self.machine.held().is_some() {
            self.metrics.set_held(!held_before);
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
        self.reconciler.install(t.to, dataplane::plan(&self.addrs, t.to, self.shape), now);
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
    pub fn announced_tables(&self) -> Option<Vec<TableWatch>> {
        self.reconciler.dataplane().announced_tables()
    }

    /// The switching backend, as detection names it; `None` for a dataplane of none of them.
    pub fn backend(&self) -> Option<crate::detect::Backend> {
        crate::detect::Backend::named(self.reconciler.dataplane().name())
    }

    /// Counted replies of the cache (see [`Dataplane::reply_packets`]).
    pub fn reply_packets(&mut self) -> Result<Option<u64>, dataplane::Error> {
        self.reconciler.reply_packets()
    }

    fn stats_mut(&mut self, stream: Stream) -> Option<&mut ProbeStats> {
        match stream {
            Stream::CacheUdp => Some(&mut self.probes.cache_udp),
            Stream::CacheTcp => self.probes.cache_tcp.as_mut(),
            Stream::Upstream => Some(&mut self.probes.upstream),
        }
    }

    /// The tick's resync ([`Reconciler::poll`]): a check to run off the loop, if one is due.
    #[must_use = "a check to run off the loop"]
    pub fn poll(&mut self, now: Instant, hearing: bool) -> Option<CheckJob> {
        self.reconciler.poll(now, hearing)
    }

    /// A resync ([`Reconciler::resync`]): a retry applies here; a check is returned to run off
    /// the loop.
    #[must_use = "a check to run off the loop"]
    pub fn resync(&mut self, now: Instant) -> Option<CheckJob> {
        self.reconciler.resync(now)
    }

    /// The kernel's announcement that `tables` changed ([`Reconciler::announced`]).
    #[must_use = "a check to run off the loop"]
    pub fn announced(&mut self, tables: Option<Vec<TableRef>>, now: Instant) -> Option<CheckJob> {
        self.reconciler.announced(tables, now)
    }

    /// Takes a finished check ([`Reconciler::checked`]); returns the next one, if asked for
    /// meanwhile.
    #[must_use = "a check to run off the loop"]
    pub fn checked(&mut self, done: CheckDone, now: Instant) -> Option<CheckJob> {
        self.reconciler.checked(done, now)
    }

    /// Checks discarded because an apply overtook them.
    pub fn stale_checks(&self) -> u64 {
        self.reconciler.stale_checks()
    }

    /// Whether a check is in flight.
    pub fn checking(&self) -> bool {
        self.reconciler.checking()
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
        if self.reconciler.is_dirty() || self.leftovers.is_empty() {
            return;
        }
        let notes = &mut self.leftover_notes;
        self.leftovers.retain_mut(|part| {
            let (keep, note) = match blocking(|| part.remove()) {
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

    /// Records what the link-local forwarder has done, for `status`.
    pub fn set_forwarded(&mut self, forwarded: state::Forwarded) {
        self.forwarded = Some(forwarded);
    }

    /// Records what detection found, for `status`.
    pub fn set_notes(&mut self, notes: Notes) {
        self.notes = notes;
    }

    /// The upstream's address changed ([`crate::upstream`]): its probes' target, and where it
    /// came from, as `status` shows them.
    pub fn set_upstream(&mut self, upstream: &crate::upstream::Upstream) {
        let v4 = self.addrs.local[0].is_ipv4();
        let target = crate::upstream::pick(&upstream.ips, v4, crate::ruleset::DNS_PORT);
        let awaited = upstream.is_awaited();
        self.probes.upstream.target = if awaited { "none yet".into() } else { target.to_string() };
        self.upstream_from.clone_from(&upstream.from);
    }

    /// Replaces the warnings about the node (logged when they change), and counts its foreign
    /// NOTRACK rules in the metrics.
    pub fn set_problems(&mut self, problems: NodeProblems) {
        let NodeProblems { foreign_notrack, in_effect, warnings } = problems;
        self.metrics.set_foreign_notrack(foreign_notrack, in_effect);
        self.foreign =
            state::Foreign { rules: foreign_notrack as u64, in_effect: in_effect as u64 };
        if warnings != self.warnings {
            for w in warnings.iter().filter(|w| !self.warnings.contains(w)) {
                warn!(warning = %w, "node problem");
            }
            self.warnings = warnings;
        }
    }

    /// When a deferred resync (a retry, a spaced repair) is due.
    pub fn resync_due(&self) -> Option<Instant> {
        self.reconciler.resync_due()
    }

    /// Whether the kernel may not hold the current route's ruleset (the last apply failed).
    pub fn is_dirty(&self) -> bool {
        self.reconciler.is_dirty()
    }

    /// One last attempt to install the current route's ruleset, for shutdown.
    pub fn settle(&mut self, now: Instant) {
        self.reconciler.settle(now);
    }

    /// The state file's content; `now` and `wall` are the same moment on both clocks.
    pub fn state(&self, now: Instant, wall: SystemTime) -> State {
        let since = crate::overrides::Moment { now, wall }.unix_ms_at(self.machine.since());
        let mut state = State {
            version: state::VERSION,
            pid: std::process::id(),
            updated_unix_ms: state::unix_ms(wall),
            dataplane: self.reconciler.dataplane().name().to_owned(),
            shape: match &self.notes.link_local_off {
                None => describe_shape(&self.addrs, self.shape.link_local),
                Some(why) => format!("{} ({why})", describe_shape(&self.addrs, false)),
            },
            dataplane_why: self.notes.why.clone(),
            accepts_in: self.notes.accepts_in.clone(),
            warnings: self.firewall.iter().chain(&self.warnings).cloned().collect(),
            leftovers: self.leftover_notes.clone(),
            route: self.route(),
            since_unix_ms: since,
            reason: self.machine.reason().to_string(),
            reason_kind: self.machine.reason().kind().to_owned(),
            startup_taint: None,
            held: self.machine.held().map(ToString::to_string),
            transitions: self.transitions,
            repairs: self.reconciler.repairs(),
            last_error: self.reconciler.last_error().map(str::to_owned),
            ruleset_in: !self.is_dirty(),
            probes: self.probes.clone(),
            upstream_from: self.upstream_from.clone(),
            forwarded: self.forwarded.clone(),
            foreign: self.foreign,
        };
        let up_for = now.saturating_duration_since(self.started);
        let taint =
            |(key, bound)| crate::cluster::report::startup_taint(key, &state, up_for, bound);
        state.startup_taint = self.notes.startup_taint.clone().map(taint);
        state
    }
}

/// What `status` says of the shape: which IPs fail over, and how.
pub fn describe_shape(addrs: &ListenAddrs, failover: bool) -> String {
    let list = |ips: &[std::net::IpAddr]| {
        ips.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    };
    let clusterip = format!(
        "ClusterIP: pods query {}, NOTRACKed to the cache or DNATed by kube-proxy to CoreDNS",
        list(&addrs.cluster_dns)
    );
    let forwarders: Vec<String> =
        addrs.local.iter().map(|&ip| crate::ruleset::forwarder_for(ip).to_string()).collect();
    let fallback = format!(
        "link-local: queries to {} go to the cache, or TPROXYed to the agent's forwarder ({}) \
         and on to the upstream",
        list(&addrs.local),
        forwarders.join(", ")
    );
    match (addrs.cluster_dns.is_empty(), failover) {
        (true, _) => fallback,
        (false, true) => format!("{clusterip}; {fallback}"),
        (false, false) => {
            format!("{clusterip}; link-local {} not failed over", list(&addrs.local))
        }
    }
}

#[cfg(test)]
mod tests;
