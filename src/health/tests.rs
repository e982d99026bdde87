//! The hysteresis state machine, table-style: probe samples and times in, transitions out.

use super::*;
use Route::{Local, Upstream};
use Sample::{Bad, Good, Refused};
use Stream::{CacheTcp, CacheUdp};

const T: Thresholds = Thresholds { fall: 3, rise: 5, min_hold: Duration::from_secs(2) };

/// Feeds `samples` of `stream` 100 ms apart starting at `t0 + start_ms`; returns the route
/// changed to after each one (None when unchanged).
fn feed(
    m: &mut Machine,
    t0: Instant,
    start_ms: u64,
    stream: Stream,
    samples: &[Sample],
) -> Vec<Option<Route>> {
    samples
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let now = t0 + Duration::from_millis(start_ms + 100 * i as u64);
            m.observe(stream, s, now).map(|t| t.to)
        })
        .collect()
}

const TIMEOUT: Sample = Bad("timeout");

#[test]
fn leaves_local_after_fall_consecutive_failures() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    let got = feed(&mut m, t0, 0, CacheUdp, &[TIMEOUT, TIMEOUT, TIMEOUT]);
    assert_eq!(got, [None, None, Some(Upstream)]);
    assert_eq!(m.reason(), &Reason::CacheFailing { stream: CacheUdp, count: 3, last: "timeout" });
}

#[test]
fn a_good_probe_resets_the_failure_count() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    let got = feed(&mut m, t0, 0, CacheUdp, &[TIMEOUT, TIMEOUT, Good, TIMEOUT, TIMEOUT, Good]);
    assert_eq!(got, [None; 6]);
    assert_eq!(m.route(), Local);
}

#[test]
fn refused_leaves_local_at_once() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[Refused]), [Some(Upstream)]);
    assert_eq!(m.reason(), &Reason::CacheRefused(CacheUdp));
}

const STALL: Sample = Sample::Stalled(Stall { queued_bytes: 1664, for_ms: 31 });

#[test]
fn a_stall_leaves_local_at_once_and_says_so() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[STALL]), [Some(Upstream)]);
    let reason = Reason::CacheStalled(Stall { queued_bytes: 1664, for_ms: 31 });
    assert_eq!(m.reason(), &reason);
    assert_eq!(reason.kind(), "cache_stalled");
    assert!(reason.to_string().contains("1664 bytes") && reason.to_string().contains("31 ms"));
    assert_eq!(m.streak(CacheUdp).last_bad, Some("stalled"));
}

#[test]
fn a_stall_holds_local_while_the_upstream_fails_and_is_forgotten_on_an_answer() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    let upstream = feed(&mut m, t0, 0, Stream::Upstream, &[TIMEOUT, TIMEOUT, TIMEOUT]);
    assert_eq!(upstream, [None; 3]);
    assert_eq!(feed(&mut m, t0, 300, CacheUdp, &[STALL]), [None], "held");
    assert!(matches!(m.held(), Some(Hold::Local { cache: Reason::CacheStalled(_), .. })));
    // The cache reads again (an answer on TCP): the stall is forgotten, nothing to leave for.
    assert_eq!(feed(&mut m, t0, 400, CacheTcp, &[Good]), [None]);
    assert_eq!(m.streak(CacheUdp).stalled, None);
    assert_eq!(feed(&mut m, t0, 500, Stream::Upstream, &[Good]), [None]);
    assert_eq!(m.route(), Local);
}

#[test]
fn a_stall_on_upstream_restarts_the_rise_count() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[STALL]), [Some(Upstream)]);
    // Past min-hold, four good probes, a stall, then `rise` good ones again before the return.
    let got = feed(&mut m, t0, 3000, CacheUdp, &[Good, Good, Good, Good, STALL]);
    assert_eq!(got, [None; 5]);
    let back = feed(&mut m, t0, 3500, CacheUdp, &[Good, Good, Good, Good, Good]);
    assert_eq!(back, [None, None, None, None, Some(Local)]);
}

#[test]
fn tcp_failures_count_on_their_own() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    // UDP keeps answering between the TCP failures: TCP's streak is not reset by it.
    let mut got = Vec::new();
    for i in 0..3 {
        got.extend(feed(&mut m, t0, 1000 * i, CacheUdp, &[Good]));
        got.extend(feed(&mut m, t0, 1000 * i + 50, CacheTcp, &[TIMEOUT]));
    }
    assert_eq!(got, [None, None, None, None, None, Some(Upstream)]);
}

#[test]
fn returns_only_after_rise_good_probes_and_min_hold() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[Refused]), [Some(Upstream)]);
    // Five good probes within 500 ms: rise is met, min_hold (2 s) is not.
    assert_eq!(feed(&mut m, t0, 100, CacheUdp, &[Good; 5]), [None; 5]);
    // Still good at 2.0 s after the switch: back to Local.
    let got = feed(&mut m, t0, 1900, CacheUdp, &[Good, Good]);
    assert_eq!(got, [None, Some(Local)]);
    assert_eq!(m.reason(), &Reason::CacheRecovered { count: 7 });
}

#[test]
fn min_hold_alone_is_not_enough() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    feed(&mut m, t0, 0, CacheUdp, &[Refused]);
    // Long after min_hold, but a failure in the middle restarts the rise count.
    let got = feed(
        &mut m,
        t0,
        5000,
        CacheUdp,
        &[Good, Good, Good, Good, TIMEOUT, Good, Good, Good, Good, Good],
    );
    assert_eq!(got, [None, None, None, None, None, None, None, None, None, Some(Local)]);
}

#[test]
fn holds_local_when_the_upstream_fails_too() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    feed(&mut m, t0, 0, Stream::Upstream, &[TIMEOUT, TIMEOUT, TIMEOUT]);
    let got = feed(&mut m, t0, 300, CacheUdp, &[Bad("servfail"); 4]);
    assert_eq!(got, [None; 4]);
    let cache = Reason::CacheFailing { stream: CacheUdp, count: 4, last: "servfail" };
    let held = Hold::Local { cache, upstream_failed: 3, upstream_last: "timeout" };
    assert_eq!(m.held(), Some(&held));
    // The upstream answers again: the cache is still failing, so the route moves at once.
    assert_eq!(feed(&mut m, t0, 700, Stream::Upstream, &[Good]), [Some(Upstream)]);
    assert_eq!(m.held(), None);
}

#[test]
fn upstream_failing_waives_min_hold_on_return() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    feed(&mut m, t0, 0, CacheUdp, &[Refused]);
    assert_eq!(m.route(), Upstream);
    feed(&mut m, t0, 100, Stream::Upstream, &[TIMEOUT; 3]);
    let got = feed(&mut m, t0, 400, CacheUdp, &[Good; 5]);
    assert_eq!(got, [None, None, None, None, Some(Local)]);
    assert_eq!(m.reason(), &Reason::CacheRecoveredUpstreamFailing { count: 5 });
}

#[test]
fn holds_upstream_while_both_fail_and_says_so() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    feed(&mut m, t0, 0, CacheUdp, &[Refused]);
    assert_eq!(m.held(), None);
    feed(&mut m, t0, 100, Stream::Upstream, &[TIMEOUT; 3]);
    let held =
        |upstream_failed| Hold::Upstream { upstream_failed, upstream_last: "timeout", rise: 5 };
    assert_eq!(m.held(), Some(&held(3)));
    // More failures on both sides: still held, on the same route, and counting.
    feed(&mut m, t0, 400, Stream::Upstream, &[TIMEOUT; 3]);
    assert_eq!(feed(&mut m, t0, 700, CacheUdp, &[Refused; 5]), [None; 5]);
    assert_eq!(m.held(), Some(&held(6)));
    // The upstream answers: nothing holds the route any more, it is where it should be.
    assert_eq!(feed(&mut m, t0, 1200, Stream::Upstream, &[Good]), [None]);
    assert_eq!((m.route(), m.held()), (Upstream, None));
    // Both down again, then the cache answers: back at once, and the hold is over.
    feed(&mut m, t0, 1300, Stream::Upstream, &[TIMEOUT; 3]);
    assert!(m.held().is_some());
    assert_eq!(feed(&mut m, t0, 1600, CacheUdp, &[Good; 5])[4], Some(Local));
    assert_eq!(m.held(), None);
}

#[test]
fn a_failing_tcp_stream_blocks_the_return() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    feed(&mut m, t0, 0, CacheTcp, &[Refused]);
    assert_eq!(m.route(), Upstream);
    assert_eq!(feed(&mut m, t0, 3000, CacheUdp, &[Good; 6]), [None; 6]);
    assert_eq!(feed(&mut m, t0, 3600, CacheTcp, &[Good]), [Some(Local)]);
}

#[test]
fn a_stale_tcp_refusal_does_not_move_a_held_route_once_udp_answers() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    feed(&mut m, t0, 0, Stream::Upstream, &[TIMEOUT; 3]);
    feed(&mut m, t0, 300, CacheTcp, &[Refused]);
    assert!(m.held().is_some());
    // The cache answers over UDP again; then the upstream recovers.
    feed(&mut m, t0, 400, CacheUdp, &[Good]);
    assert_eq!(feed(&mut m, t0, 500, Stream::Upstream, &[Good]), [None]);
    assert_eq!(m.route(), Local);
}

#[test]
fn upstream_route_ignores_cache_failures() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Upstream, t0);
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[TIMEOUT; 10]), [None; 10]);
    assert_eq!(m.reason(), &Reason::Start(Upstream));
}

fn forced(route: Route, kind: ForceKind, until: Option<Instant>) -> Forced {
    Forced { route, kind, until, why: "maintenance".into(), waits_for: None }
}

#[test]
fn a_forced_route_holds_whatever_the_probes_say() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    let t = m.force(forced(Upstream, ForceKind::Manual, None), t0).unwrap();
    assert_eq!((t.from, t.to, t.reason.kind()), (Local, Upstream, "manual"));
    assert_eq!(feed(&mut m, t0, 100, CacheUdp, &[Good; 50]), [None; 50]);
    // Released with a healthy cache: back at once (the streak was counted meanwhile).
    let t = m.release(t0 + Duration::from_secs(10)).unwrap();
    assert_eq!((t.to, t.reason), (Local, Reason::CacheRecovered { count: 50 }));
}

#[test]
fn forcing_local_onto_a_dead_cache_lasts_only_while_forced() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    assert_eq!(m.force(forced(Local, ForceKind::Manual, None), t0), None);
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[Refused; 5]), [None; 5]);
    assert_eq!(m.route(), Local);
    let t = m.release(t0 + Duration::from_secs(1)).unwrap();
    assert_eq!(t.to, Upstream);
}

#[test]
fn a_forced_route_expires_by_itself() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    let until = t0 + Duration::from_secs(2);
    m.force(forced(Upstream, ForceKind::Manual, Some(until)), t0);
    feed(&mut m, t0, 0, CacheUdp, &[Good; 10]);
    assert_eq!(m.expire(t0 + Duration::from_millis(1999)), None);
    let t = m.expire(until).unwrap();
    assert_eq!((t.to, t.reason.kind()), (Local, "cache_recovered"));
    assert_eq!(m.forced(), None);
}

#[test]
fn a_drain_ends_when_the_cache_goes_and_the_new_one_must_rise() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    m.force(forced(Upstream, ForceKind::Drain, None), t0);
    // The old cache still answers: the drain holds.
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[Good; 30]), [None; 30]);
    assert!(m.forced().is_some());
    // One slow answer under load is not the end of the old cache.
    feed(&mut m, t0, 3000, CacheUdp, &[TIMEOUT, Good, Good, Good, Good, Good]);
    assert!(m.forced().is_some());
    // It is stopped: the drain is over, the route stays on the upstream...
    assert_eq!(feed(&mut m, t0, 4000, CacheUdp, &[Refused]), [None]);
    assert_eq!(m.forced(), None);
    assert_eq!(m.reason(), &Reason::DrainEnded);
    // ...until the new cache answers `rise` probes and `min_hold` has passed since then.
    let got = feed(&mut m, t0, 4100, CacheUdp, &[Good; 5]);
    assert_eq!(got, [None; 5]);
    assert_eq!(feed(&mut m, t0, 6000, CacheUdp, &[Good]), [Some(Local)]);
}

#[test]
fn a_drain_ends_when_its_cache_is_gone_though_a_new_one_answers() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    m.force(forced(Upstream, ForceKind::Drain, None), t0);
    // A new cache answers every probe (surge rollout, or the old one went before a restart):
    // the probes alone never end the drain.
    assert_eq!(feed(&mut m, t0, 0, CacheUdp, &[Good; 30]), [None; 30]);
    assert!(m.forced().is_some());
    // The drained cache's sockets are gone: the drain is over, the route stays...
    assert!(m.end_drain(t0 + Duration::from_millis(3000)));
    assert_eq!((m.route(), m.forced(), m.reason()), (Upstream, None, &Reason::DrainEnded));
    assert!(!m.end_drain(t0 + Duration::from_millis(3000)), "no drain left to end");
    // ...until the new cache has answered `rise` probes and `min_hold` has passed since then.
    assert_eq!(feed(&mut m, t0, 3100, CacheUdp, &[Good; 5]), [None; 5]);
    assert_eq!(feed(&mut m, t0, 5000, CacheUdp, &[Good]), [Some(Local)]);
}

#[test]
fn end_drain_leaves_a_manual_override_alone() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    m.force(forced(Upstream, ForceKind::Manual, None), t0);
    assert!(!m.end_drain(t0));
    assert_eq!(m.forced().map(|f| f.kind), Some(ForceKind::Manual));
}

#[test]
fn reasons_read_well() {
    let r = Reason::CacheFailing { stream: CacheUdp, count: 3, last: "timeout" };
    assert_eq!(r.to_string(), "3 consecutive cache udp probes failed (last: timeout)");
}

#[test]
fn holds_read_as_status_and_the_state_file_have_always_said() {
    let local = Hold::Local {
        cache: Reason::CacheRefused(CacheTcp),
        upstream_failed: 3,
        upstream_last: "timeout",
    };
    assert_eq!(
        local.to_string(),
        "cache tcp probe refused: nothing listens on the cache's port 53, but staying local: \
         3 consecutive upstream probes failed (last: timeout)"
    );
    let upstream = Hold::Upstream { upstream_failed: 6, upstream_last: "refused", rise: 5 };
    assert_eq!(
        upstream.to_string(),
        "6 consecutive upstream probes failed (last: refused), but staying upstream: the \
         cache has not answered 5 consecutive probes yet"
    );
}

#[test]
fn a_blocked_path_leaves_local_and_keeps_it_left_until_cleared() {
    let t0 = Instant::now();
    let mut m = Machine::new(T, Local, t0);
    let t = m.set_blocked(Some("chain x rejects".into()), t0).expect("a switch");
    assert_eq!((t.from, t.to, t.reason.kind()), (Local, Upstream, "firewall"));
    // Good probes are counted but do not bring it back while blocked.
    let after = feed(&mut m, t0, 3000, CacheUdp, &[Good; 8]);
    assert!(after.iter().all(Option::is_none), "{after:?}");
    assert_eq!(m.route(), Upstream);
    // Cleared: the streak it kept counting and min-hold bring it back at the next probe.
    assert_eq!(m.set_blocked(None, t0 + Duration::from_secs(4)), None);
    assert_eq!(feed(&mut m, t0, 4000, CacheUdp, &[Good]), [Some(Local)]);
    // An operator's flip local stands; released, the policy leaves at once if blocked.
    m.set_blocked(Some("again".into()), t0 + Duration::from_secs(5));
    let forced = Forced {
        route: Local,
        kind: ForceKind::Manual,
        until: None,
        why: "ops".into(),
        waits_for: Default::default(),
    };
    m.force(forced, t0 + Duration::from_secs(6));
    assert_eq!(m.route(), Local);
    let t = m.release(t0 + Duration::from_secs(7)).expect("leaves at once");
    assert_eq!(t.reason.kind(), "firewall");
}
