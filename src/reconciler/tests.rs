//! The reconciler on the fake dataplane, the clock passed in: retries, repairs, read-backs.

use super::*;
use crate::dataplane::fake::FakeDataplane;
use crate::dataplane::Shape;
use crate::ruleset::ListenAddrs;

/// The resync period of the agent's default configuration (`--interval 100ms`).
const TICK: Duration = Duration::from_millis(100);

fn addrs() -> ListenAddrs {
    let ip = |s: &str| vec![s.parse().unwrap()];
    ListenAddrs { local: ip("169.254.20.10"), cluster_dns: ip("10.96.0.10") }
}

/// The ruleset of `route`.
fn rules(route: Route) -> RuleSet {
    dataplane::plan(&addrs(), route, Shape::default())
}

/// The route whose ruleset the fake kernel holds.
fn installed(fake: &FakeDataplane) -> Option<Route> {
    dataplane::installed_route(&mut fake.clone(), &addrs(), Shape::default()).unwrap()
}

/// A reconciler keeping `Local` installed through `fake`, handed over as the agent's start
/// does: the `Local` ruleset applied first unless the kernel holds it.
fn reconciler(
    fake: &FakeDataplane,
    tick: Duration,
    metrics: Arc<Metrics>,
    t0: Instant,
) -> Reconciler {
    if installed(fake) != Some(Route::Local) {
        fake.clone().apply(&rules(Route::Local)).unwrap();
    }
    let reader = fake.reader().unwrap();
    Reconciler::new(
        Box::new(fake.clone()),
        reader,
        Route::Local,
        rules(Route::Local),
        tick,
        metrics,
        t0,
    )
}

fn start(fake: &FakeDataplane, t0: Instant) -> Reconciler {
    reconciler(fake, TICK, Arc::new(Metrics::new()), t0)
}

/// The agent's switch to `route`.
fn switch(reconciler: &mut Reconciler, route: Route, now: Instant) {
    reconciler.install(route, rules(route), now);
}

/// A resync with its check run at once, as the loop does on a worker.
fn sync(reconciler: &mut Reconciler, now: Instant) {
    let mut job = reconciler.resync(now);
    while let Some(j) = job {
        job = reconciler.checked(j.run(), now);
    }
}

/// A tick's poll, likewise.
fn poll(reconciler: &mut Reconciler, now: Instant, hearing: bool) {
    if let Some(job) = reconciler.poll(now, hearing) {
        assert!(reconciler.checked(job.run(), now).is_none());
    }
}

/// The retries of a failing apply come 2, 4, 8 … ticks apart, never more than 5 s, none
/// before it is due; a success ends the backoff, and the next failure starts it afresh.
#[test]
fn apply_retries_back_off_doubling_up_to_a_cap() {
    let t0 = Instant::now();
    let tick = TICK;
    let fake = FakeDataplane::holding(rules(Route::Local));
    let mut reconciler = start(&fake, t0);
    let failing = 9;
    fake.kernel().fail_applies = failing;
    // Failed applies so far.
    let attempts = |fake: &FakeDataplane| failing - fake.kernel().fail_applies;
    let mut at = t0;
    // The cache refused: the agent switches.
    switch(&mut reconciler, Route::Upstream, at);
    let mut spacings = Vec::new();
    while reconciler.is_dirty() {
        let due = reconciler.resync_due().expect("a retry is scheduled while dirty");
        // Early, nothing happens: not the retry, nor a read-back.
        let tried = attempts(&fake);
        assert!(reconciler.resync(due - Duration::from_millis(1)).is_none());
        assert_eq!(attempts(&fake), tried, "retried before it was due");
        spacings.push((due - at).as_millis());
        at = due;
        assert!(reconciler.resync(at).is_none(), "a retry applies; it reads nothing back");
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
    assert_eq!(reconciler.resync_due(), None);
    // A new failure (an operator forcing Local) backs off from the start again.
    fake.kernel().fail_next_apply = true;
    switch(&mut reconciler, Route::Local, at);
    assert!(reconciler.is_dirty());
    assert_eq!(reconciler.resync_due(), Some(at + tick * 2));
}

#[test]
fn start_failed_keeps_its_error_until_an_apply_succeeds() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    // The start fell back to a route it could install: nothing to retry, the error stays.
    reconciler.start_failed("installing the local ruleset failed".into(), false, t0);
    assert!(!reconciler.is_dirty());
    assert_eq!(reconciler.resync_due(), None);
    assert_eq!(reconciler.last_error(), Some("installing the local ruleset failed"));
    // It could install nothing: retried like any failed apply, two ticks on.
    reconciler.start_failed("and the upstream one".into(), true, t0);
    assert!(reconciler.is_dirty());
    assert_eq!(reconciler.resync_due(), Some(t0 + TICK * 2));
    assert!(reconciler.resync(t0 + TICK * 2).is_none(), "a retry applies");
    assert_eq!(reconciler.last_error(), None);
}

/// Whichever turn of the loop comes when a retry is due applies there, on the loop; none of
/// them starts a read-back of a ruleset known not to be in.
#[test]
fn a_dirty_ruleset_is_re_applied_on_the_loop_instead_of_a_check() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    fake.kernel().announces = true;
    let mut reconciler = start(&fake, t0);
    fake.kernel().fail_applies = 3;
    switch(&mut reconciler, Route::Upstream, t0);
    let checks = fake.kernel().checks;
    // A tick's poll, though the announcements are heard and the last read-back is recent.
    let due = reconciler.resync_due().expect("a retry");
    assert!(reconciler.poll(due, true).is_none());
    // An announcement.
    let due = reconciler.resync_due().expect("a retry");
    let table = TableRef { family: 1, name: "fake".to_owned() };
    assert!(reconciler.announced(Some(vec![table]), due).is_none());
    // A resync; this one succeeds.
    let due = reconciler.resync_due().expect("a retry");
    assert!(reconciler.resync(due).is_none());
    assert!(!reconciler.is_dirty());
    assert_eq!(fake.kernel().checks, checks, "nothing read back");
    assert_eq!(fake.kernel().fail_applies, 0, "every turn applied");
    assert_eq!(installed(&fake), Some(Route::Upstream));
}

#[test]
fn ticks_check_an_announced_ruleset_only_as_a_safety_net() {
    let t0 = Instant::now();
    let polled = FakeDataplane::default();
    let announced = FakeDataplane::default();
    announced.kernel().announces = true;
    let mut reconcilers = [start(&polled, t0), start(&announced, t0)];
    let checks = |fake: &FakeDataplane| fake.kernel().checks;
    let before = [checks(&polled), checks(&announced)];
    let tick = Duration::from_millis(100);
    for n in 1..=10 {
        reconcilers.iter_mut().for_each(|r| poll(r, t0 + tick * n, true));
    }
    // Looked at on the first tick, then every LOOK_UNANNOUNCED: ticks 1, 4, 7 and 10.
    assert_eq!(LOOK_UNANNOUNCED, tick * 3);
    assert_eq!(checks(&polled) - before[0], 4, "a polled ruleset is checked every third tick");
    assert_eq!(checks(&announced), before[1], "an announced one waits for announcements");
    // Not heard (the watch failed): every tick again.
    poll(&mut reconcilers[1], t0 + tick * 11, false);
    assert_eq!(checks(&announced), before[1] + 1);
    // Heard, but nothing checked for POLL_ANNOUNCED: checked all the same, and repaired.
    announced.kernel().installed = None;
    poll(&mut reconcilers[1], t0 + tick * 11 + POLL_ANNOUNCED / 2, true);
    assert_eq!(installed(&announced), None);
    poll(&mut reconcilers[1], t0 + tick * 11 + POLL_ANNOUNCED, true);
    assert_eq!(installed(&announced), Some(Route::Local));
}

/// The safety net reads an announced ruleset back only when the nftables generation moved
/// since the last whole check began (another commit, heard or not): on an idle iptables-nft
/// node, each read-back was eight child processes.
#[test]
fn the_safety_net_reads_back_only_when_the_generation_moved() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    fake.kernel().announces = true;
    fake.kernel().generation = Some(7);
    let mut reconciler = start(&fake, t0);
    let before = fake.kernel().checks;
    // The first safety net reads back: no generation is known yet.
    poll(&mut reconciler, t0 + POLL_ANNOUNCED, true);
    assert_eq!(fake.kernel().checks, before + 1);
    // The next ones, in the same generation, need not.
    poll(&mut reconciler, t0 + POLL_ANNOUNCED * 2, true);
    poll(&mut reconciler, t0 + POLL_ANNOUNCED * 3, true);
    assert_eq!(fake.kernel().checks, before + 1, "read back in an unchanged generation");
    // Another tool's commit, its announcement lost: the generation moved, the safety net
    // reads back and repairs.
    {
        let mut kernel = fake.kernel();
        kernel.installed = None;
        kernel.generation = Some(9);
    }
    poll(&mut reconciler, t0 + POLL_ANNOUNCED * 4, true);
    assert_eq!(fake.kernel().checks, before + 2);
    assert_eq!(installed(&fake), Some(Route::Local));
    // The repair was a commit of the agent's own: the next safety net reads back once more.
    let repaired = fake.kernel().checks;
    poll(&mut reconciler, t0 + POLL_ANNOUNCED * 5, true);
    assert_eq!(fake.kernel().checks, repaired + 1);
    poll(&mut reconciler, t0 + POLL_ANNOUNCED * 6, true);
    assert_eq!(fake.kernel().checks, repaired + 1);
    // The generation is trusted for FULL_READ_EVERY after a read-back, then read back all the
    // same: the safety net of the agent's own comparisons.
    let read = t0 + POLL_ANNOUNCED * 5;
    let mut at = read + POLL_ANNOUNCED * 2;
    while at < read + FULL_READ_EVERY {
        poll(&mut reconciler, at, true);
        at += POLL_ANNOUNCED;
    }
    assert_eq!(fake.kernel().checks, repaired + 1, "the generation stands: nothing read");
    poll(&mut reconciler, read + FULL_READ_EVERY, true);
    assert_eq!(fake.kernel().checks, repaired + 2, "read back after FULL_READ_EVERY");
}

/// A node that mixes them: the switch announced (nftables, iptables-nft), the ACCEPTs polled
/// (iptables-legacy). The ticks read the polled part alone, every LOOK_UNANNOUNCED; the announced
/// one is read when announced, and with the rest every POLL_ANNOUNCED. Before, the whole ruleset was read back
/// every tick (on the mixed node, every iptables-nft chain of both families: 350 mCPU idle).
#[test]
fn ticks_read_back_only_the_part_that_announces_nothing() {
    let t0 = Instant::now();
    let (switch, accepts) = (FakeDataplane::default(), FakeDataplane::default());
    switch.kernel().announces = true;
    // The fakes' clones share their kernel: `polled` is the ACCEPT part's.
    let polled = accepts.clone();
    let mut layered = dataplane::Layered::new(Box::new(switch.clone()), vec![Box::new(accepts)]);
    assert!(layered.announced_tables().is_some() && layered.polled());
    layered.apply(&rules(Route::Local)).unwrap();
    let reader = layered.reader().unwrap();
    let mut reconciler = Reconciler::new(
        Box::new(layered),
        reader,
        Route::Local,
        rules(Route::Local),
        TICK,
        Arc::new(Metrics::new()),
        t0,
    );
    let checks = |fake: &FakeDataplane| fake.kernel().checks;
    let before = (checks(&switch), checks(&polled));
    for n in 1..=10 {
        poll(&mut reconciler, t0 + TICK * n, true);
    }
    assert_eq!(checks(&polled) - before.1, 4, "the polled part is read every LOOK_UNANNOUNCED");
    assert_eq!(checks(&switch), before.0, "the announced part waits for announcements");
    // Drift in the polled part is repaired at the next look, LOOK_UNANNOUNCED after the last.
    polled.kernel().installed = None;
    poll(&mut reconciler, t0 + TICK * 12, true);
    assert_eq!(polled.kernel().installed, None, "not looked at two ticks after a look");
    poll(&mut reconciler, t0 + TICK * 13, true);
    assert_eq!(polled.kernel().installed, Some(rules(Route::Local)));
    assert_eq!(reconciler.repairs(), 1);
    // The per-tick reads are no whole check: the safety net still comes.
    let switch_checks = checks(&switch);
    switch.kernel().installed = None;
    poll(&mut reconciler, t0 + TICK * 13 + POLL_ANNOUNCED, true);
    assert_eq!(checks(&switch), switch_checks + 1);
    assert_eq!(switch.kernel().installed, Some(rules(Route::Local)), "repaired");
}

/// iptables-legacy's copies of its tables tell an unchanged ruleset in-process: the tick's check
/// is done on the loop, no job handed to a thread (two wake-ups a tick, on an idle legacy node
/// the larger part of the agent's CPU above an nftables node's), and still counted as a check.
/// A change is not told at once: the tick hands a check over, which repairs it.
#[test]
fn a_tick_whose_check_is_told_at_once_runs_no_job() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    fake.kernel().copies = true;
    let metrics = Arc::new(Metrics::new());
    let mut reconciler = reconciler(&fake, TICK, metrics.clone(), t0);
    let checks = fake.kernel().checks;
    for n in 1..=10 {
        assert!(reconciler.poll(t0 + TICK * n, false).is_none(), "tick {n} handed a job over");
    }
    // Ticks 1, 4, 7 and 10 looked (every LOOK_UNANNOUNCED).
    assert_eq!(fake.kernel().unchanged, 4);
    assert_eq!(fake.kernel().checks, checks, "no read-back");
    let counted = "nodelocaldns_ha_dataplane_check_duration_seconds_count 4";
    assert!(metrics.encode_text().contains(counted), "{}", metrics.encode_text());

    fake.kernel().installed = None;
    let job = reconciler.poll(t0 + TICK * 13, false).expect("a check of the changed ruleset");
    assert!(reconciler.checked(job.run(), t0 + TICK * 13).is_none());
    assert_eq!(reconciler.repairs(), 1);
    assert_eq!(installed(&fake), Some(Route::Local));
}

#[test]
fn resync_restores_a_removed_table_with_repairs_spaced() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    sync(&mut reconciler, t0);
    assert_eq!(reconciler.repairs(), 0);
    fake.kernel().installed = None;
    sync(&mut reconciler, t0);
    assert_eq!(installed(&fake), Some(Route::Local));
    assert_eq!(reconciler.repairs(), 1);
    // Someone removes it again at once: repaired after a pause, not in a loop.
    fake.kernel().installed = None;
    sync(&mut reconciler, t0 + Duration::from_millis(1));
    assert_eq!(installed(&fake), None);
    assert_eq!(reconciler.resync_due(), Some(t0 + REPAIR_SPACING));
    sync(&mut reconciler, t0 + REPAIR_SPACING);
    assert_eq!(installed(&fake), Some(Route::Local));
    assert_eq!(reconciler.repairs(), 2);
    // Once due and done, nothing stays scheduled (the loop would spin on it).
    sync(&mut reconciler, t0 + REPAIR_SPACING * 3);
    assert_eq!(reconciler.resync_due(), None);
}

/// Repairs are spaced by the shorter of the tick and [`REPAIR_SPACING`]: a tick under 50 ms
/// spaces them by a tick.
#[test]
fn repairs_are_spaced_by_the_tick_when_it_is_shorter() {
    let t0 = Instant::now();
    let tick = Duration::from_millis(20);
    let fake = FakeDataplane::default();
    let mut reconciler = reconciler(&fake, tick, Arc::new(Metrics::new()), t0);
    fake.kernel().installed = None;
    sync(&mut reconciler, t0);
    assert_eq!(reconciler.repairs(), 1);
    assert_eq!(reconciler.resync_due(), Some(t0 + tick));
}

#[test]
fn a_failed_repair_backs_off_like_any_failed_apply() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    fake.kernel().installed = None;
    fake.kernel().fail_next_apply = true;
    sync(&mut reconciler, t0);
    assert_eq!(reconciler.repairs(), 1);
    assert!(reconciler.is_dirty());
    assert_eq!(reconciler.resync_due(), Some(t0 + TICK * 2), "the backoff, not the spacing");
}

#[test]
fn a_check_of_the_current_generation_repairs_drift() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    let job = reconciler.resync(t0).expect("a check is due");
    fake.kernel().installed = None;
    assert!(reconciler.checked(job.run(), t0).is_none());
    assert_eq!(installed(&fake), Some(Route::Local));
    assert_eq!(reconciler.repairs(), 1);
    assert_eq!(reconciler.stale_checks(), 0);
}

/// What a check read before an apply says nothing about the kernel after it: even drift it
/// found is not repaired (the apply put in the whole ruleset and read it back itself).
#[test]
fn a_check_overtaken_by_an_apply_is_discarded_even_when_it_found_drift() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    let job = reconciler.resync(t0).expect("a check is due");
    // Someone removes the table; the check finds it missing...
    fake.kernel().installed = None;
    let done = job.run();
    // ...and before it is taken, a switch installs the new route's ruleset.
    switch(&mut reconciler, Route::Upstream, t0);
    let applies = fake.kernel().applies;
    assert!(reconciler.checked(done, t0).is_none());
    assert_eq!(reconciler.stale_checks(), 1);
    assert_eq!(reconciler.repairs(), 0);
    assert_eq!(fake.kernel().applies, applies, "no repair");
    assert_eq!(installed(&fake), Some(Route::Upstream));
}

#[test]
fn a_failed_read_back_re_applies() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    let applies = fake.kernel().applies;
    let job = reconciler.resync(t0).expect("a check is due");
    fake.kernel().fail_next_check = true;
    assert!(reconciler.checked(job.run(), t0).is_none());
    assert_eq!(fake.kernel().applies, applies + 1, "re-applied");
    // No drift was seen: no repair counted, and nothing spaced.
    assert_eq!(reconciler.repairs(), 0);
    assert_eq!(reconciler.resync_due(), None);
    assert!(reconciler.resync(t0).is_some(), "the next check is not held back");
}

#[test]
fn announced_tables_scope_the_next_check_and_add_up_while_one_is_in_flight() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    let table = |name: &str| TableRef { family: 2, name: name.to_owned() };
    let job = reconciler.announced(Some(vec![table("filter")]), t0).expect("a check");
    assert_eq!(job.changed, Some(vec![table("filter")]));
    // In flight: announcements add up for the check that follows it.
    assert!(reconciler.checking());
    assert!(reconciler.announced(Some(vec![table("raw")]), t0).is_none());
    assert!(reconciler.announced(Some(vec![table("filter")]), t0).is_none());
    let next = reconciler.checked(job.run(), t0).expect("the announcements meanwhile");
    assert_eq!(next.changed, Some(vec![table("raw"), table("filter")]));
    // A tick's resync, or an announcement that could not be read, checks everything.
    assert!(reconciler.resync(t0).is_none());
    let next = reconciler.checked(next.run(), t0).expect("the resync meanwhile");
    assert_eq!(next.changed, None);
    assert!(reconciler.checked(next.run(), t0).is_none());
    assert_eq!(reconciler.announced(None, t0).expect("a check").changed, None);
}

#[test]
fn settle_retries_a_failed_apply_at_shutdown() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    fake.kernel().fail_next_apply = true;
    switch(&mut reconciler, Route::Upstream, t0);
    assert_eq!(installed(&fake), Some(Route::Local));
    reconciler.settle(t0);
    assert_eq!(installed(&fake), Some(Route::Upstream));
}

#[test]
fn settle_leaves_an_installed_ruleset_alone() {
    let t0 = Instant::now();
    let fake = FakeDataplane::default();
    let mut reconciler = start(&fake, t0);
    let applies = fake.kernel().applies;
    reconciler.settle(t0);
    assert_eq!(fake.kernel().applies, applies);
}

/// Every apply is timed (a failed one counted as an error), every check taken is timed, every
/// repair counted; the start's own applies are not the reconciler's.
#[test]
fn applies_checks_and_repairs_go_into_the_metrics() {
    let t0 = Instant::now();
    let metrics = Arc::new(Metrics::new());
    let fake = FakeDataplane::default();
    let mut reconciler = reconciler(&fake, TICK, metrics.clone(), t0);
    fake.kernel().installed = None;
    sync(&mut reconciler, t0);
    fake.kernel().fail_next_apply = true;
    switch(&mut reconciler, Route::Upstream, t0);
    let scrape = metrics.encode();
    for sample in [
        "nodelocaldns_ha_dataplane_apply_duration_seconds_count 2",
        "nodelocaldns_ha_dataplane_apply_errors_total 1",
        "nodelocaldns_ha_dataplane_check_duration_seconds_count 1",
        "nodelocaldns_ha_drift_repairs_total 1",
    ] {
        assert!(scrape.lines().any(|l| l == sample), "no {sample:?} in\n{scrape}");
    }
}
