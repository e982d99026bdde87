//! The agent's synchronous core on the fake dataplane, the clock passed in: start, adoption,
//! switches, leftovers, state.

use std::time::Duration;

use super::*;
use crate::config::{test_raw, RawRun};
use crate::dataplane::fake::FakeDataplane;
use crate::probe::ProbeResult;
use crate::ruleset::RuleSet;

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

fn start(fake: &FakeDataplane, t0: Instant) -> Agent {
    Agent::start(
        &cfg(),
        Box::new(fake.clone()),
        Arc::new(Metrics::new()),
        None,
        None,
        Vec::new(),
        t0,
    )
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

/// A start that recognises neither route's ruleset (the rules' text changed by an
/// upgrade) installs the route the last agent recorded, not `Local`.
#[test]
fn a_ruleset_of_neither_route_gives_way_to_the_recorded_route() {
    let start_recorded = |fake: &FakeDataplane, recorded| {
        let metrics = Arc::new(Metrics::new());
        let (forced, firewall, t0) = (None, Vec::new(), Instant::now());
        Agent::start(&cfg(), Box::new(fake.clone()), metrics, forced, recorded, firewall, t0)
            .unwrap()
    };
    let mut other = RuleSet::desired(&cfg().addrs, Route::Upstream);
    other.chains[0].rules[0].comment = "an older agent's text".into();
    for (recorded, first) in [
        (Some(Route::Upstream), Route::Upstream),
        (Some(Route::Local), Route::Local),
        (None, Route::Local),
    ] {
        let fake = FakeDataplane::holding(other.clone());
        assert_eq!(start_recorded(&fake, recorded).route(), first, "recorded {recorded:?}");
        assert_eq!(installed(&fake), Some(first));
    }
    // An installed route wins over the record.
    let fake = FakeDataplane::holding(RuleSet::desired(&cfg().addrs, Route::Local));
    assert_eq!(start_recorded(&fake, Some(Route::Upstream)).route(), Route::Local);
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
        Agent::start(&cfg(), Box::new(fake.clone()), metrics, Some(forced), None, Vec::new(), t0)
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
fn state_reports_since_on_the_wall_clock() {
    let t0 = Instant::now();
    let mut agent = start(&FakeDataplane::default(), t0);
    agent.on_probe(&report(Stream::CacheUdp, Outcome::Refused), t0);
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
    let st = agent.state(t0 + Duration::from_secs(3), wall);
    assert_eq!(st.since_unix_ms, 97_000);
    assert_eq!(st.route, Route::Upstream);
}

/// A route held (the cache and the upstream both failing) and others' NOTRACK rules are in the
/// metrics the alerting rules read: `route_held` 1 while held, 0 again once the upstream answers
/// and the agent leaves; `foreign_notrack_rules` and `_in_effect` as the last look counted, and
/// in the state.
#[test]
fn a_held_route_and_foreign_rules_show_in_the_metrics() {
    use hickory_proto::op::ResponseCode;
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let metrics = Arc::new(Metrics::new());
    let mut agent =
        Agent::start(&cfg(), Box::new(fake.clone()), metrics.clone(), None, None, Vec::new(), t0)
            .unwrap();
    let held = || metrics.encode().contains("\nnodelocaldns_ha_route_held 1\n");
    let servfail = Outcome::ServerFailure { rcode: ResponseCode::ServFail };
    let fall = cfg().thresholds.fall;
    let mut at = t0;
    for stream in [Stream::Upstream, Stream::CacheUdp] {
        for _ in 0..fall {
            at += Duration::from_millis(100);
            agent.on_probe(&report(stream, servfail.clone()), at);
        }
    }
    assert_eq!(agent.route(), Route::Local);
    assert!(held(), "{}", metrics.encode());
    at += Duration::from_millis(100);
    let answered = Outcome::Answered { rcode: ResponseCode::NoError };
    agent.on_probe(&report(Stream::Upstream, answered), at);
    assert_eq!(agent.route(), Route::Upstream);
    assert!(!held(), "{}", metrics.encode());

    let warnings = vec!["foreign NOTRACK".into()];
    agent.set_problems(NodeProblems { foreign_notrack: 2, in_effect: 1, warnings });
    let text = metrics.encode();
    assert!(text.contains("\nnodelocaldns_ha_foreign_notrack_rules 2\n"), "{text}");
    assert!(text.contains("\nnodelocaldns_ha_foreign_notrack_rules_in_effect 1\n"), "{text}");
    let st = agent.state(at, std::time::SystemTime::now());
    assert_eq!(st.foreign, crate::state::Foreign { rules: 2, in_effect: 1 });
    assert_eq!(st.warnings, ["foreign NOTRACK"]);
    agent.set_problems(NodeProblems::default());
    let text = metrics.encode();
    assert!(text.contains("\nnodelocaldns_ha_foreign_notrack_rules 0\n"), "{text}");
    assert!(text.contains("\nnodelocaldns_ha_foreign_notrack_rules_in_effect 0\n"), "{text}");
}
