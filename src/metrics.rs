//! Observability: Prometheus metrics, and the liveness and readiness the control loop reports.
//!
//! [`Metrics`] holds every metric family, typed by label, and renders them in the OpenMetrics
//! text format; the control loop records into it and never reads it back. [`Health`] is two
//! atomics: the time of the loop's last turn (liveness) and whether a ruleset has been applied
//! (readiness). Liveness says only that the loop turns — never whether DNS works: a cache or a
//! CoreDNS that fails must not get the agent restarted, since failing over is its job.
//! [`serve`] exposes both over HTTP (`/metrics`, `/healthz`, `/readyz`).
//!
//! Families whose labels come from a closed set (routes, probe streams and outcomes, hook
//! results), and the route changes the agent makes by itself, are created at zero up front, so
//! a series exists before its first event and `increase()` counts that event (the alerting
//! rules' flapping alert counts on it).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `nodelocaldns_ha_route` | gauge | `route` |
//! | `nodelocaldns_ha_route_transitions_total` | counter | `from`, `to`, `reason` |
//! | `nodelocaldns_ha_probes_total` | counter | `target`, `protocol`, `outcome` |
//! | `nodelocaldns_ha_probe_duration_seconds` | histogram | `target`, `protocol` |
//! | `nodelocaldns_ha_dataplane_apply_duration_seconds` | histogram | |
//! | `nodelocaldns_ha_dataplane_commit_duration_seconds` | histogram | |
//! | `nodelocaldns_ha_dataplane_apply_errors_total` | counter | |
//! | `nodelocaldns_ha_dataplane_check_duration_seconds` | histogram | |
//! | `nodelocaldns_ha_drift_repairs_total` | counter | |
//! | `nodelocaldns_ha_override_active` | gauge | `route` |
//! | `nodelocaldns_ha_route_held` | gauge | |
//! | `nodelocaldns_ha_foreign_notrack_rules` | gauge | |
//! | `nodelocaldns_ha_foreign_notrack_rules_in_effect` | gauge | |
//! | `nodelocaldns_ha_transition_hook_runs_total` | counter | `result` |
//! | `nodelocaldns_ha_forwarder_udp_queries_total` | counter | |
//! | `nodelocaldns_ha_forwarder_udp_answers_total` | counter | |
//! | `nodelocaldns_ha_forwarder_tcp_connections_total` | counter | |
//! | `nodelocaldns_ha_forwarder_upstream_failures_total` | counter | |
//! | `nodelocaldns_ha_forwarder_dropped_total` | counter | `reason` |
//! | `nodelocaldns_ha_forwarder_stray_answers_total` | counter | |
//!
//! The `forwarder_` families are the link-local forwarders' counters (both families summed),
//! read at each scrape; there are none where the agent runs no forwarder.

mod http;
mod text;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::forwarder;
use crate::health::Stream;
use crate::probe::Transport;
use crate::ruleset::Route;

pub use http::serve;

/// Every metric name starts with this, then `_`.
const PREFIX: &str = "nodelocaldns_ha";

/// Probe latency buckets, in seconds: 50 µs (a refusal on loopback) to 1 s (beyond any probe
/// timeout), in 1–2.5–5 steps so that the usual timeouts (80 ms, 500 ms) fall just under a bound.
const PROBE_BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// Dataplane apply buckets, in seconds: 100 µs (a netlink batch) to 5 s (an `iptables-restore`
/// waiting out the xtables lock).
const APPLY_BUCKETS: [f64; 15] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0,
];

/// The outcomes a probe can have (`probe::Outcome::label`), created at zero for every stream.
const PROBE_OUTCOMES: [&str; 5] = ["answered", "servfail", "timeout", "refused", "error"];

/// What became of a route change handed to the transition hook, created at zero: its run's
/// result, or `dropped` when the hook was too far behind to be given it.
const HOOK_RESULTS: [&str; 4] = ["ok", "failed", "timeout", "dropped"];

const ROUTES: [Route; 2] = [Route::Local, Route::Upstream];

/// The route changes the agent makes by itself when a cache fails and comes back (`from`, `to`,
/// `health::Reason::kind`), created at zero. Forced changes (flip, drain) and rarer reasons are
/// created when they first happen.
const AUTOMATIC_TRANSITIONS: [(Route, Route, &str); 4] = [
    (Route::Local, Route::Upstream, "cache_failing"),
    (Route::Local, Route::Upstream, "cache_stalled"),
    (Route::Local, Route::Upstream, "cache_refused"),
    (Route::Upstream, Route::Local, "cache_recovered"),
];
const STREAMS: [Stream; 3] = [Stream::CacheUdp, Stream::CacheTcp, Stream::Upstream];

/// What a probe asks: the node-local cache or the upstream (CoreDNS).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Target {
    Cache,
    Upstream,
}

impl Target {
    fn as_str(self) -> &'static str {
        match self {
            Target::Cache => "cache",
            Target::Upstream => "upstream",
        }
    }
}

// Label values are the lower-case names used everywhere else (the command line, `status`, logs).
// The derive would write the variant names as they are (`Local`), hence these by hand.

impl EncodeLabelValue for Route {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

impl EncodeLabelValue for Transport {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

impl EncodeLabelValue for Target {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: Route,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    from: Route,
    to: Route,
    /// A short kind such as `cache_failing` (`health::Reason::kind`).
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StreamLabels {
    target: Target,
    protocol: Transport,
}

impl StreamLabels {
    fn of(stream: Stream) -> StreamLabels {
        let (target, protocol) = match stream {
            Stream::CacheUdp => (Target::Cache, Transport::Udp),
            Stream::CacheTcp => (Target::Cache, Transport::Tcp),
            Stream::Upstream => (Target::Upstream, Transport::Udp),
        };
        StreamLabels { target, protocol }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    target: Target,
    protocol: Transport,
    /// `probe::Outcome::label`: `answered`, `servfail`, `timeout`, `refused` or `error`.
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookLabels {
    /// One of [`HOOK_RESULTS`].
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    /// `busy` (at the in-flight bound), `malformed` (shorter than a header, or cut short),
    /// `answer_failed` (its answer could not be sent back).
    reason: &'static str,
}

/// The link-local forwarders' counters, once they run, read at each scrape.
#[derive(Debug, Default)]
struct Forwarders(OnceLock<Vec<Arc<forwarder::Counters>>>);

impl Collector for Forwarders {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(forwarders) = self.0.get() else { return Ok(()) };
        let t: forwarder::Totals = forwarders.iter().map(|f| f.totals()).sum();
        let plain = [
            ("forwarder_udp_queries", t.udp_queries, "UDP queries the link-local forwarder took"),
            ("forwarder_udp_answers", t.udp_answers, "UDP answers it sent back to their clients"),
            ("forwarder_tcp_connections", t.tcp_connections, "TCP connections it relayed"),
            (
                "forwarder_upstream_failures",
                t.upstream_failures,
                "Its queries the upstream refused or left unanswered",
            ),
            (
                "forwarder_stray_answers",
                t.stray_answers,
                "Datagrams from the upstream that answered no query it had pending",
            ),
        ];
        for (name, value, help) in plain {
            // A collector's help text gets no full stop from the registry, as registered ones do.
            let help = format!("{help}.");
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, &help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        let help = "Queries the link-local forwarder dropped, by reason.";
        let kind = ConstCounter::new(0u64).metric_type();
        let mut family = encoder.encode_descriptor("forwarder_dropped", help, None, kind)?;
        for (reason, value) in [
            ("busy", t.dropped_busy),
            ("malformed", t.dropped_malformed),
            ("answer_failed", t.answer_failures),
        ] {
            let labels = DropLabels { reason };
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

fn probe_histogram() -> Histogram {
    Histogram::new(PROBE_BUCKETS)
}

/// The agent's metrics. Cheap to record into from any thread; `encode` renders a scrape.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    route: Family<RouteLabels, Gauge>,
    transitions: Family<TransitionLabels, Counter>,
    probes: Family<ProbeLabels, Counter>,
    probe_duration: Family<StreamLabels, Histogram, fn() -> Histogram>,
    apply_duration: Histogram,
    commit_duration: Histogram,
    apply_errors: Counter,
    check_duration: Histogram,
    repairs: Counter,
    override_active: Family<RouteLabels, Gauge>,
    held: Gauge,
    foreign_notrack: Gauge,
    foreign_in_effect: Gauge,
    hook_runs: Family<HookLabels, Counter>,
    forwarders: Arc<Forwarders>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// Every family registered, the closed label sets created at zero.
    pub fn new() -> Metrics {
        let metrics = Metrics {
            registry: Registry::with_prefix(PREFIX),
            route: Family::default(),
            transitions: Family::default(),
            probes: Family::default(),
            probe_duration: Family::new_with_constructor(probe_histogram),
            apply_duration: Histogram::new(APPLY_BUCKETS),
            commit_duration: Histogram::new(APPLY_BUCKETS),
            apply_errors: Counter::default(),
            check_duration: Histogram::new(APPLY_BUCKETS),
            repairs: Counter::default(),
            override_active: Family::default(),
            held: Gauge::default(),
            foreign_notrack: Gauge::default(),
            foreign_in_effect: Gauge::default(),
            hook_runs: Family::default(),
            forwarders: Arc::default(),
        };
        // `get_or_create` creates the series; its guard is dropped at once.
        for route in ROUTES {
            drop(metrics.route.get_or_create(&RouteLabels { route }));
            drop(metrics.override_active.get_or_create(&RouteLabels { route }));
        }
        for (from, to, reason) in AUTOMATIC_TRANSITIONS {
            drop(metrics.transitions.get_or_create(&TransitionLabels { from, to, reason }));
        }
        for stream in STREAMS {
            let StreamLabels { target, protocol } = StreamLabels::of(stream);
            drop(metrics.probe_duration.get_or_create(&StreamLabels { target, protocol }));
            for outcome in PROBE_OUTCOMES {
                drop(metrics.probes.get_or_create(&ProbeLabels { target, protocol, outcome }));
            }
        }
        for result in HOOK_RESULTS {
            drop(metrics.hook_runs.get_or_create(&HookLabels { result }));
        }
        metrics.register()
    }

    fn register(mut self) -> Metrics {
        // The registry appends `_total` to counters and the unit to the name, and a full stop
        // to the help text.
        let r = &mut self.registry;
        r.register(
            "route",
            "The route DNS for the cluster-DNS IP takes: 1 for the current one, 0 for the other",
            self.route.clone(),
        );
        r.register(
            "route_transitions",
            "Route changes, by the route left, the route taken and why",
            self.transitions.clone(),
        );
        r.register(
            "probes",
            "DNS probes sent, by target (cache or upstream), protocol and outcome",
            self.probes.clone(),
        );
        r.register_with_unit(
            "probe_duration",
            "Time from sending a probe to its outcome (a reply, a refusal, the timeout)",
            Unit::Seconds,
            self.probe_duration.clone(),
        );
        r.register_with_unit(
            "dataplane_apply_duration",
            "Time to install a route's ruleset and read it back, failed attempts included",
            Unit::Seconds,
            self.apply_duration.clone(),
        );
        r.register_with_unit(
            "dataplane_commit_duration",
            "Time the kernel took to commit an applied ruleset (nftables): the switch itself, \
             without the read-back",
            Unit::Seconds,
            self.commit_duration.clone(),
        );
        r.register(
            "dataplane_apply_errors",
            "Attempts to install a ruleset that failed (retried with backoff)",
            self.apply_errors.clone(),
        );
        r.register_with_unit(
            "dataplane_check_duration",
            "Time to read the installed ruleset back and compare it with the route's (drift checks)",
            Unit::Seconds,
            self.check_duration.clone(),
        );
        r.register(
            "drift_repairs",
            "Times the installed ruleset was found changed or removed by someone else and restored",
            self.repairs.clone(),
        );
        r.register(
            "override_active",
            "1 for the route an operator forced (flip or drain) while it is forced, 0 otherwise",
            self.override_active.clone(),
        );
        r.register(
            "route_held",
            "1 while the route stays where it is although its resolver fails, because the other fails too (cache and upstream both failing)",
            self.held.clone(),
        );
        r.register(
            "foreign_notrack_rules",
            "Rules of others for the cluster-DNS IP found at the last look: node-cache's own (it runs without -setupiptables=false), or anyone's NOTRACK; the agent's rules run before them and make them harmless, but for those counted in foreign_notrack_rules_in_effect",
            self.foreign_notrack.clone(),
        );
        r.register(
            "foreign_notrack_rules_in_effect",
            "NOTRACK rules of others for the cluster-DNS IP that the agent's rules do not run before (another iptables flavour than the agent's): while any exists, pods stay on the cache whatever the route",
            self.foreign_in_effect.clone(),
        );
        r.register(
            "transition_hook_runs",
            "Runs of the transition hook, by result (ok, failed, timeout; dropped: not run, the hook too far behind)",
            self.hook_runs.clone(),
        );
        r.register_collector(Box::new(self.forwarders.clone()));
        self
    }

    /// The route now taken: its series 1, the other's 0.
    pub fn set_route(&self, route: Route) {
        for r in ROUTES {
            self.route.get_or_create(&RouteLabels { route: r }).set(i64::from(r == route));
        }
    }

    /// Counts a route change; `reason` is a short kind (`health::Reason::kind`). Does not touch
    /// the `route` gauge: call [`Metrics::set_route`] too.
    pub fn transition(&self, from: Route, to: Route, reason: &'static str) {
        self.transitions.get_or_create(&TransitionLabels { from, to, reason }).inc();
    }

    /// Counts one probe of `stream` with `outcome` (`probe::Outcome::label`) and records how
    /// long it took.
    pub fn probe(&self, stream: Stream, outcome: &'static str, latency: Duration) {
        let StreamLabels { target, protocol } = StreamLabels::of(stream);
        self.probes.get_or_create(&ProbeLabels { target, protocol, outcome }).inc();
        self.probe_duration
            .get_or_create(&StreamLabels { target, protocol })
            .observe(latency.as_secs_f64());
    }

    /// Records one attempt to install a ruleset, successful or not, and the kernel's commit of
    /// a successful one when the backend timed it.
    pub fn apply(&self, duration: Duration, commit: Option<Duration>, ok: bool) {
        self.apply_duration.observe(duration.as_secs_f64());
        if let Some(commit) = commit.filter(|_| ok) {
            self.commit_duration.observe(commit.as_secs_f64());
        }
        if !ok {
            self.apply_errors.inc();
        }
    }

    /// Records one drift check: the ruleset read back and compared.
    pub fn check(&self, duration: Duration) {
        self.check_duration.observe(duration.as_secs_f64());
    }

    /// Counts one repair of a ruleset someone else changed or removed.
    pub fn repair(&self) {
        self.repairs.inc();
    }

    /// The route an operator forced, if any: its series 1, every other 0.
    pub fn set_override(&self, active: Option<Route>) {
        for r in ROUTES {
            let forced = active == Some(r);
            self.override_active.get_or_create(&RouteLabels { route: r }).set(i64::from(forced));
        }
    }

    /// Whether the route is held against its failing resolver (`health::Machine::held`).
    pub fn set_held(&self, held: bool) {
        self.held.set(i64::from(held));
    }

    /// How many rules of others the last look found for the cluster-DNS IPs, and how many of
    /// them are in effect (not made harmless by the agent's rules).
    pub fn set_foreign_notrack(&self, rules: usize, in_effect: usize) {
        self.foreign_notrack.set(i64::try_from(rules).unwrap_or(i64::MAX));
        self.foreign_in_effect.set(i64::try_from(in_effect).unwrap_or(i64::MAX));
    }

    /// Counts one run of the transition hook: `result` is `ok`, `failed` or `timeout`, or
    /// `dropped` for a route change the hook was too far behind to be given.
    pub fn hook(&self, result: &'static str) {
        self.hook_runs.get_or_create(&HookLabels { result }).inc();
    }

    /// The link-local forwarders' counters, for the `forwarder_` families from now on. Only the
    /// first call counts: the agent binds its forwarders once.
    pub fn set_forwarders(&self, counters: Vec<Arc<forwarder::Counters>>) {
        let _ = self.forwarders.0.set(counters);
    }

    /// Every metric in the OpenMetrics text format, `# EOF` included.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail, nor can the label encoders above.
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("encoding metrics into a String");
        text
    }

    /// Every metric in the Prometheus text format 0.0.4 (for clients that do not ask for
    /// OpenMetrics).
    pub fn encode_text(&self) -> String {
        text::from_openmetrics(&self.encode())
    }
}

/// Liveness and readiness, shared with the control loop.
///
/// The loop [`beat`](Health::beat)s every turn and marks itself [ready](Health::set_ready) after
/// its first successful apply. Creating a `Health` counts as a beat, so the loop has
/// `max_silence` to make its first turn.
#[derive(Debug)]
pub struct Health {
    /// The instant the offsets below count from.
    epoch: Instant,
    /// The last beat, in nanoseconds from `epoch` (negative: before it).
    last_beat: AtomicI64,
    ready: AtomicBool,
}

impl Default for Health {
    fn default() -> Health {
        Health::new()
    }
}

impl Health {
    pub fn new() -> Health {
        Health {
            epoch: Instant::now(),
            last_beat: AtomicI64::new(0),
            ready: AtomicBool::new(false),
        }
    }

    /// The control loop turned at `now`.
    pub fn beat(&self, now: Instant) {
        // Ordering: the value stands alone; it publishes nothing else.
        self.last_beat.store(self.offset(now), Ordering::Relaxed);
    }

    /// The first ruleset is installed: the agent does its job from now on.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// The control loop turned within `max_silence` before `now`. Says nothing about DNS.
    pub fn live(&self, now: Instant, max_silence: Duration) -> bool {
        self.silence(now) <= max_silence
    }

    /// A ruleset has been applied.
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// How long before `now` the loop last turned (zero if it turned later).
    fn silence(&self, now: Instant) -> Duration {
        let nanos = self.offset(now).saturating_sub(self.last_beat.load(Ordering::Relaxed));
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(0))
    }

    /// `at` in signed nanoseconds from `epoch` (saturating after 292 years either way).
    fn offset(&self, at: Instant) -> i64 {
        let nanos = |d: Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
        match at.checked_duration_since(self.epoch) {
            Some(after) => nanos(after),
            None => -nanos(self.epoch.duration_since(at)),
        }
    }
}

#[cfg(test)]
mod tests;
