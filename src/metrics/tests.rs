//! The metrics registry and the health endpoints: series present from the start, labels, liveness
//! and readiness.

use std::collections::HashMap;

use super::*;
use crate::probe::Outcome;

/// A scrape, parsed: `# TYPE` lines by family, samples by series (`name{labels}`).
struct Scrape {
    types: HashMap<String, String>,
    helps: HashMap<String, String>,
    samples: HashMap<String, f64>,
}

impl Scrape {
    fn of(metrics: &Metrics) -> Scrape {
        let text = metrics.encode();
        assert!(text.ends_with("# EOF\n"), "{text}");
        let mut scrape =
            Scrape { types: HashMap::new(), helps: HashMap::new(), samples: HashMap::new() };
        for line in text.lines().filter(|l| *l != "# EOF") {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                scrape.types.insert(name.to_owned(), kind.to_owned());
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                scrape.helps.insert(name.to_owned(), help.to_owned());
            } else if line.starts_with("# UNIT ") {
            } else {
                assert!(!line.starts_with('#'), "unexpected line {line:?}");
                let (series, value) = line.rsplit_once(' ').unwrap();
                let value = value.parse().unwrap_or_else(|_| panic!("{line:?}"));
                assert!(scrape.samples.insert(series.to_owned(), value).is_none(), "{line}");
            }
        }
        scrape
    }

    fn family(&self, name: &str, kind: &str) {
        assert_eq!(self.types.get(name).map(String::as_str), Some(kind), "# TYPE of {name}");
        let help = &self.helps[name];
        assert!(help.len() > 10 && help.ends_with('.'), "{name}: {help:?}");
    }

    #[track_caller]
    fn value(&self, series: &str) -> f64 {
        *self.samples.get(series).unwrap_or_else(|| {
            let mut known: Vec<_> = self.samples.keys().collect();
            known.sort();
            panic!("no sample {series}; have {known:#?}")
        })
    }
}

#[test]
fn metrics_and_health_are_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<Metrics>();
    shared::<Health>();
}

#[test]
fn every_name_has_the_prefix_help_and_a_type() {
    let m = Metrics::new();
    m.transition(Route::Local, Route::Upstream, "cache_refused");
    let s = Scrape::of(&m);
    assert_eq!(s.types.len(), 14, "{:?}", s.types.keys());
    for name in s.types.keys().chain(s.samples.keys()) {
        assert!(name.starts_with("nodelocaldns_ha_"), "{name}");
    }
    assert_eq!(s.helps.len(), s.types.len());
}

/// Every series a scrape shows before anything happened: a dashboard's `increase()` counts
/// the first event of each only if its series was there, at zero, before it. Route changes
/// other than the automatic ones show up as they happen (their reasons are too many to create
/// up front).
#[test]
fn every_series_exists_from_the_start() {
    let s = Scrape::of(&Metrics::new());
    let mut series: Vec<&str> =
        s.samples.keys().map(String::as_str).filter(|name| !name.contains("_bucket{")).collect();
    series.sort_unstable();
    let probes = |target: &str, protocol: &str| {
        ["answered", "servfail", "timeout", "refused", "error"].map(|outcome| {
            format!(
                r#"nodelocaldns_ha_probes_total{{target="{target}",protocol="{protocol}",outcome="{outcome}"}}"#
            )
        })
    };
    let mut expected: Vec<String> = [
        "nodelocaldns_ha_dataplane_apply_duration_seconds_count",
        "nodelocaldns_ha_dataplane_apply_duration_seconds_sum",
        "nodelocaldns_ha_dataplane_apply_errors_total",
        "nodelocaldns_ha_dataplane_check_duration_seconds_count",
        "nodelocaldns_ha_dataplane_check_duration_seconds_sum",
        "nodelocaldns_ha_dataplane_commit_duration_seconds_count",
        "nodelocaldns_ha_dataplane_commit_duration_seconds_sum",
        "nodelocaldns_ha_drift_repairs_total",
        "nodelocaldns_ha_foreign_notrack_rules",
        "nodelocaldns_ha_foreign_notrack_rules_in_effect",
        r#"nodelocaldns_ha_override_active{route="local"}"#,
        r#"nodelocaldns_ha_override_active{route="upstream"}"#,
        r#"nodelocaldns_ha_probe_duration_seconds_count{target="cache",protocol="tcp"}"#,
        r#"nodelocaldns_ha_probe_duration_seconds_count{target="cache",protocol="udp"}"#,
        r#"nodelocaldns_ha_probe_duration_seconds_count{target="upstream",protocol="udp"}"#,
        r#"nodelocaldns_ha_probe_duration_seconds_sum{target="cache",protocol="tcp"}"#,
        r#"nodelocaldns_ha_probe_duration_seconds_sum{target="cache",protocol="udp"}"#,
        r#"nodelocaldns_ha_probe_duration_seconds_sum{target="upstream",protocol="udp"}"#,
        r#"nodelocaldns_ha_route{route="local"}"#,
        r#"nodelocaldns_ha_route{route="upstream"}"#,
        "nodelocaldns_ha_route_held",
        r#"nodelocaldns_ha_route_transitions_total{from="local",to="upstream",reason="cache_failing"}"#,
        r#"nodelocaldns_ha_route_transitions_total{from="local",to="upstream",reason="cache_refused"}"#,
        r#"nodelocaldns_ha_route_transitions_total{from="local",to="upstream",reason="cache_stalled"}"#,
        r#"nodelocaldns_ha_route_transitions_total{from="upstream",to="local",reason="cache_recovered"}"#,
        r#"nodelocaldns_ha_transition_hook_runs_total{result="dropped"}"#,
        r#"nodelocaldns_ha_transition_hook_runs_total{result="failed"}"#,
        r#"nodelocaldns_ha_transition_hook_runs_total{result="ok"}"#,
        r#"nodelocaldns_ha_transition_hook_runs_total{result="timeout"}"#,
    ]
    .map(str::to_owned)
    .into_iter()
    .chain(probes("cache", "udp"))
    .chain(probes("cache", "tcp"))
    .chain(probes("upstream", "udp"))
    .collect();
    expected.sort_unstable();
    assert_eq!(series, expected);
    assert!(s.samples.values().all(|v| *v == 0.0), "not all at zero");
    // Each histogram with its buckets: three of probes, one each of applies, commits and checks.
    let buckets = s.samples.keys().filter(|name| name.contains("_bucket{")).count();
    assert_eq!(buckets, 3 * (PROBE_BUCKETS.len() + 1) + 3 * (APPLY_BUCKETS.len() + 1));
}

#[test]
fn route_gauge_follows_set_route() {
    let m = Metrics::new();
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_route", "gauge");
    assert_eq!(s.value(r#"nodelocaldns_ha_route{route="local"}"#), 0.0);
    m.set_route(Route::Local);
    m.set_route(Route::Upstream);
    let s = Scrape::of(&m);
    assert_eq!(s.value(r#"nodelocaldns_ha_route{route="local"}"#), 0.0);
    assert_eq!(s.value(r#"nodelocaldns_ha_route{route="upstream"}"#), 1.0);
}

#[test]
fn transitions_are_counted_by_from_to_and_reason() {
    let m = Metrics::new();
    let series = |from, to, reason| {
        format!(
            r#"nodelocaldns_ha_route_transitions_total{{from="{from}",to="{to}",reason="{reason}"}}"#
        )
    };
    // The automatic changes are there at zero, so that `increase()` counts the first of each
    // (the flapping alert); a forced one appears when it first happens.
    let s = Scrape::of(&m);
    assert_eq!(s.value(&series("local", "upstream", "cache_failing")), 0.0);
    assert_eq!(s.value(&series("upstream", "local", "cache_recovered")), 0.0);
    assert!(!m.encode().contains("manual"));
    m.transition(Route::Upstream, Route::Local, "manual");
    assert_eq!(Scrape::of(&m).value(&series("upstream", "local", "manual")), 1.0);
    m.transition(Route::Local, Route::Upstream, "cache_refused");
    m.transition(Route::Upstream, Route::Local, "cache_recovered");
    m.transition(Route::Local, Route::Upstream, "cache_refused");
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_route_transitions", "counter");
    assert_eq!(s.value(&series("local", "upstream", "cache_refused")), 2.0);
    assert_eq!(s.value(&series("upstream", "local", "cache_recovered")), 1.0);
}

#[test]
fn probes_are_counted_and_timed_per_stream() {
    let m = Metrics::new();
    m.probe(Stream::CacheUdp, "answered", Duration::from_micros(300));
    m.probe(Stream::CacheUdp, "refused", Duration::from_micros(40));
    m.probe(Stream::CacheTcp, "timeout", Duration::from_millis(80));
    m.probe(Stream::Upstream, "answered", Duration::from_millis(3));
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_probes", "counter");
    s.family("nodelocaldns_ha_probe_duration_seconds", "histogram");
    let probes = |target, protocol, outcome| {
        let labels = format!(r#"target="{target}",protocol="{protocol}",outcome="{outcome}""#);
        s.value(&format!("nodelocaldns_ha_probes_total{{{labels}}}"))
    };
    assert_eq!(probes("cache", "udp", "answered"), 1.0);
    assert_eq!(probes("cache", "udp", "refused"), 1.0);
    assert_eq!(probes("cache", "tcp", "timeout"), 1.0);
    assert_eq!(probes("upstream", "udp", "answered"), 1.0);
    // Created at zero before they happen.
    assert_eq!(probes("upstream", "udp", "servfail"), 0.0);
    assert_eq!(probes("cache", "tcp", "error"), 0.0);

    let duration = |labels: &str, suffix: &str| {
        s.value(&format!("nodelocaldns_ha_probe_duration_seconds_{suffix}{{{labels}}}"))
    };
    let cache_udp = r#"target="cache",protocol="udp""#;
    assert_eq!(duration(cache_udp, "count"), 2.0);
    assert!((duration(cache_udp, "sum") - 0.000_34).abs() < 1e-9);
    // The `le` label comes first in a family's buckets.
    let bucket = |labels: &str, le: &str| duration(&format!(r#"le="{le}",{labels}"#), "bucket");
    assert_eq!(bucket(cache_udp, "0.00005"), 1.0);
    assert_eq!(bucket(cache_udp, "0.00025"), 1.0);
    assert_eq!(bucket(cache_udp, "0.0005"), 2.0);
    assert_eq!(bucket(cache_udp, "+Inf"), 2.0);
    let cache_tcp = r#"target="cache",protocol="tcp""#;
    assert_eq!(bucket(cache_tcp, "0.05"), 0.0);
    assert_eq!(bucket(cache_tcp, "0.1"), 1.0);
    assert_eq!(duration(r#"target="upstream",protocol="udp""#, "count"), 1.0);
}

#[test]
fn probe_buckets_span_50_microseconds_to_1_second() {
    let s = Scrape::of(&Metrics::new());
    let mut bounds: Vec<&str> = s
        .samples
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix(r#"nodelocaldns_ha_probe_duration_seconds_bucket{le=""#)?;
            rest.strip_suffix(r#"",target="cache",protocol="udp"}"#)
        })
        .collect();
    bounds.sort_by(|a, b| {
        let v = |s: &str| if s == "+Inf" { f64::INFINITY } else { s.parse::<f64>().unwrap() };
        v(a).total_cmp(&v(b))
    });
    assert_eq!(bounds.first(), Some(&"0.00005"));
    assert_eq!(bounds[bounds.len() - 2..], ["1.0", "+Inf"]);
    assert_eq!(bounds.len(), PROBE_BUCKETS.len() + 1);
    assert!(PROBE_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    assert!(APPLY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    assert_eq!((APPLY_BUCKETS[0], APPLY_BUCKETS[APPLY_BUCKETS.len() - 1]), (0.000_1, 5.0));
}

#[test]
fn probe_outcomes_created_up_front_are_the_probes_labels() {
    let outcomes = [
        Outcome::Answered { rcode: hickory_proto::op::ResponseCode::NoError },
        Outcome::ServerFailure { rcode: hickory_proto::op::ResponseCode::ServFail },
        Outcome::Timeout,
        Outcome::Refused,
        Outcome::Error { reason: String::new() },
    ];
    let labels: Vec<_> = outcomes.iter().map(Outcome::label).collect();
    assert_eq!(labels, PROBE_OUTCOMES);
}

#[test]
fn applies_are_timed_and_failures_counted() {
    let m = Metrics::new();
    m.apply(Duration::from_micros(700), Some(Duration::from_micros(200)), true);
    m.apply(Duration::from_secs(2), Some(Duration::from_millis(1)), false);
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_dataplane_apply_duration_seconds", "histogram");
    s.family("nodelocaldns_ha_dataplane_apply_errors", "counter");
    let bucket = |le: &str| {
        s.value(&format!(r#"nodelocaldns_ha_dataplane_apply_duration_seconds_bucket{{le="{le}"}}"#))
    };
    assert_eq!(bucket("0.0001"), 0.0);
    assert_eq!(bucket("0.001"), 1.0);
    assert_eq!(bucket("1.0"), 1.0);
    assert_eq!(bucket("2.5"), 2.0);
    assert_eq!(bucket("5.0"), 2.0);
    assert_eq!(bucket("+Inf"), 2.0);
    assert_eq!(s.value("nodelocaldns_ha_dataplane_apply_duration_seconds_count"), 2.0);
    assert_eq!(s.value("nodelocaldns_ha_dataplane_apply_errors_total"), 1.0);
    // Only a successful apply's commit is recorded.
    s.family("nodelocaldns_ha_dataplane_commit_duration_seconds", "histogram");
    assert_eq!(s.value("nodelocaldns_ha_dataplane_commit_duration_seconds_count"), 1.0);
    assert_eq!(s.value("nodelocaldns_ha_dataplane_commit_duration_seconds_sum"), 0.0002);
}

#[test]
fn repairs_are_counted() {
    let m = Metrics::new();
    assert_eq!(Scrape::of(&m).value("nodelocaldns_ha_drift_repairs_total"), 0.0);
    m.repair();
    m.repair();
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_drift_repairs", "counter");
    assert_eq!(s.value("nodelocaldns_ha_drift_repairs_total"), 2.0);
}

#[test]
fn override_gauge_marks_the_forced_route() {
    let m = Metrics::new();
    let local = r#"nodelocaldns_ha_override_active{route="local"}"#;
    let upstream = r#"nodelocaldns_ha_override_active{route="upstream"}"#;
    m.set_override(Some(Route::Upstream));
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_override_active", "gauge");
    assert_eq!((s.value(local), s.value(upstream)), (0.0, 1.0));
    m.set_override(Some(Route::Local));
    let s = Scrape::of(&m);
    assert_eq!((s.value(local), s.value(upstream)), (1.0, 0.0));
    m.set_override(None);
    let s = Scrape::of(&m);
    assert_eq!((s.value(local), s.value(upstream)), (0.0, 0.0));
}

#[test]
fn hook_runs_are_counted_by_result() {
    let m = Metrics::new();
    m.hook("ok");
    m.hook("timeout");
    m.hook("ok");
    m.hook("dropped");
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_transition_hook_runs", "counter");
    let runs = |result| {
        s.value(&format!(r#"nodelocaldns_ha_transition_hook_runs_total{{result="{result}"}}"#))
    };
    let all = (runs("ok"), runs("failed"), runs("timeout"), runs("dropped"));
    assert_eq!(all, (2.0, 0.0, 1.0, 1.0));
}

#[test]
fn liveness_follows_the_beat_only() {
    let t0 = Instant::now();
    let h = Health::new();
    let limit = Duration::from_secs(5);
    // Creation counts as a beat.
    assert!(h.live(t0, limit));
    h.beat(t0 + Duration::from_secs(10));
    assert!(h.live(t0 + Duration::from_secs(15), limit));
    assert!(!h.live(t0 + Duration::from_secs(16), limit));
    // A beat stamped before the Health was made (t0 is) still counts from its own time.
    let h = Health::new();
    h.beat(t0);
    let later = t0 + Duration::from_secs(60);
    assert!(!h.live(later, limit));
    assert_eq!(h.silence(later), Duration::from_secs(60));
    assert!(h.live(later, Duration::from_secs(60)));
    // Readiness is separate from liveness.
    assert!(!h.ready());
    h.set_ready();
    assert!(h.ready());
}

/// The link-local forwarders' families: none before the agent binds a forwarder (nothing would
/// count into them), then each forwarder's counters summed, read at the scrape.
#[test]
fn forwarder_counters_appear_with_the_forwarders_summed() {
    let m = Metrics::new();
    assert!(!m.encode().contains("forwarder"), "{}", m.encode());
    let (v4, v6) =
        (Arc::new(forwarder::Counters::default()), Arc::new(forwarder::Counters::default()));
    m.set_forwarders(vec![v4.clone(), v6.clone()]);
    let bump = |counter: &std::sync::atomic::AtomicU64, n| counter.fetch_add(n, Ordering::Relaxed);
    bump(&v4.udp_queries, 5);
    bump(&v6.udp_queries, 2);
    bump(&v4.udp_answers, 4);
    bump(&v6.tcp_connections, 3);
    bump(&v4.upstream_failures, 1);
    bump(&v6.dropped_busy, 6);
    bump(&v4.answer_failures, 7);
    bump(&v6.stray_answers, 8);
    let s = Scrape::of(&m);
    for (family, value) in [
        ("nodelocaldns_ha_forwarder_udp_queries", 7.0),
        ("nodelocaldns_ha_forwarder_udp_answers", 4.0),
        ("nodelocaldns_ha_forwarder_tcp_connections", 3.0),
        ("nodelocaldns_ha_forwarder_upstream_failures", 1.0),
        ("nodelocaldns_ha_forwarder_stray_answers", 8.0),
    ] {
        s.family(family, "counter");
        assert_eq!(s.value(&format!("{family}_total")), value, "{family}");
    }
    s.family("nodelocaldns_ha_forwarder_dropped", "counter");
    for (reason, value) in [("busy", 6.0), ("malformed", 0.0), ("answer_failed", 7.0)] {
        let series = format!(r#"nodelocaldns_ha_forwarder_dropped_total{{reason="{reason}"}}"#);
        assert_eq!(s.value(&series), value, "{series}");
    }
    // Read at each scrape.
    bump(&v4.udp_queries, 1);
    assert_eq!(Scrape::of(&m).value("nodelocaldns_ha_forwarder_udp_queries_total"), 8.0);
}

#[test]
fn a_held_route_and_foreign_rules_are_gauges_from_zero() {
    let m = Metrics::new();
    let s = Scrape::of(&m);
    s.family("nodelocaldns_ha_route_held", "gauge");
    s.family("nodelocaldns_ha_foreign_notrack_rules", "gauge");
    s.family("nodelocaldns_ha_foreign_notrack_rules_in_effect", "gauge");
    assert_eq!(s.value("nodelocaldns_ha_route_held"), 0.0);
    assert_eq!(s.value("nodelocaldns_ha_foreign_notrack_rules"), 0.0);
    assert_eq!(s.value("nodelocaldns_ha_foreign_notrack_rules_in_effect"), 0.0);
    m.set_held(true);
    m.set_foreign_notrack(2, 1);
    let s = Scrape::of(&m);
    assert_eq!(s.value("nodelocaldns_ha_route_held"), 1.0);
    assert_eq!(s.value("nodelocaldns_ha_foreign_notrack_rules"), 2.0);
    assert_eq!(s.value("nodelocaldns_ha_foreign_notrack_rules_in_effect"), 1.0);
    m.set_held(false);
    assert_eq!(Scrape::of(&m).value("nodelocaldns_ha_route_held"), 0.0);
}
