use super::*;

const BOUNDS: Bounds =
    Bounds { bound: Duration::from_millis(30), look_idle: Duration::from_millis(20) };

/// One query's buffer in the socket (skb truesize, as measured for unbound's socket).
const QUERY: u32 = 832;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Feeds looks every 2 ms from `start` for `len`, the queue given by `queue(t)`; answers every
/// confirm probe after `probe_takes(t)` (None: never). Returns when (since `start`) each stall
/// was reported, and how many confirm probes were asked for.
fn replay(
    len: Duration,
    queue: impl Fn(Duration) -> u32,
    probe_takes: impl Fn(Duration) -> Option<Duration>,
) -> (Vec<Duration>, u32) {
    let start = Instant::now();
    let mut detector = Detector::new(BOUNDS);
    // Seen reading before the trace begins (an empty queue).
    assert_eq!(detector.look(start - LOOK_BUSY, 0), Verdict::Quiet);
    let mut stalls = Vec::new();
    let mut asked = 0;
    // The outstanding confirm probe: when it was sent, when its outcome comes, and whether it
    // is an answer.
    let mut pending: Option<(Duration, Duration, bool)> = None;
    let mut t = Duration::ZERO;
    while t <= len {
        if let Some((sent, at, answered)) = pending {
            if at <= t {
                detector.confirmed(start + at, start + sent, answered);
                pending = None;
            }
        }
        let verdict = detector.look(start + t, queue(t));
        // As the watch does: one probe in flight at a time, a new one once it is back if the
        // window still asks.
        if pending.is_none() && detector.asking() {
            asked += 1;
            pending = Some(match probe_takes(t) {
                Some(took) if took <= BOUNDS.confirm() => (t, t + took, true),
                _ => (t, t + BOUNDS.confirm(), false),
            });
        }
        match verdict {
            Verdict::Quiet | Verdict::Confirm => {}
            Verdict::Stalled(stall) => {
                assert!(stall.queued_bytes > 0 && stall.for_ms >= 30, "{stall:?}");
                stalls.push(t);
            }
        }
        t += LOOK_BUSY;
    }
    (stalls, asked)
}

#[test]
fn the_bounds_split_into_suspicion_and_confirmation() {
    assert_eq!((BOUNDS.suspect(), BOUNDS.confirm()), (ms(10), ms(20)));
}

#[test]
fn a_hang_under_traffic_is_a_stall_at_the_bound() {
    // 1000 queries a second from t = 0, none read.
    let (stalls, asked) = replay(ms(200), |t| (t.as_millis() as u32 + 1) * QUERY, |_| None);
    assert_eq!(asked, 1, "one confirm probe");
    assert_eq!(stalls, [ms(30)], "once, when the window is 30 ms old");
}

#[test]
fn a_saturated_cache_that_drains_never_stalls() {
    // A closed-loop client keeps 191 queries waiting: the queue looks constant, never lower,
    // but the confirm probes are answered (in about 1 ms, as measured behind dnsperf).
    let (stalls, asked) = replay(Duration::from_secs(60), |_| 191 * QUERY, |_| Some(ms(2)));
    assert!(stalls.is_empty(), "{stalls:?}");
    assert!(asked > 1000, "the plateau keeps asking: {asked}");
}

#[test]
fn pauses_below_the_bound_never_stall() {
    // 15 ms paused every 100 ms at 1000/s: the queue grows while paused, then drains in 1 ms;
    // a probe sent during a pause is answered when it ends.
    let paused = |t: Duration| t.as_millis() % 100 < 15;
    let queue = |t: Duration| if paused(t) { (t.as_millis() % 100) as u32 * QUERY } else { 0 };
    let answer = |t: Duration| Some(ms(15 - (t.as_millis() % 100).min(15) as u64 + 1));
    let (stalls, _) = replay(Duration::from_secs(60), queue, answer);
    assert!(stalls.is_empty(), "{stalls:?}");
}

#[test]
fn a_lost_probe_is_not_a_stall_while_the_queue_goes_down() {
    // Overload: the queue rises for 15 ms, falls, rises again; every confirm probe is lost
    // (behind a full buffer), yet the cache reads.
    let queue = |t: Duration| (t.as_millis() % 16) as u32 * 10 * QUERY + QUERY;
    let (stalls, asked) = replay(Duration::from_secs(10), queue, |_| None);
    assert!(stalls.is_empty(), "{stalls:?}");
    assert!(asked > 0);
}

#[test]
fn a_stall_is_reported_once_per_window_and_again_after_a_recovery() {
    // Hung for 100 ms, drained, hung again from 200 ms.
    let queue = |t: Duration| match t.as_millis() {
        0..100 => (t.as_millis() as u32 + 1) * QUERY,
        100..200 => 0,
        n => (n as u32 - 199) * QUERY,
    };
    let (stalls, asked) = replay(ms(400), queue, |_| None);
    assert_eq!(stalls, [ms(30), ms(230)]);
    assert_eq!(asked, 2);
}

#[test]
fn a_socket_never_seen_reading_is_left_to_the_probes() {
    // A cache that has bound its socket and not started reading it (a restart under traffic):
    // its backlog grows, a stall it is not.
    let (start, mut detector) = (Instant::now(), Detector::new(BOUNDS));
    for n in 0..50u32 {
        let verdict = detector.look(start + ms(u64::from(n) * 2), (n + 1) * QUERY);
        assert_eq!(verdict, Verdict::Quiet, "at {} ms", n * 2);
    }
    // It reads (the queue goes down): from now on it is judged.
    assert_eq!(detector.look(start + ms(100), QUERY), Verdict::Quiet);
    assert_eq!(detector.look(start + ms(110), 2 * QUERY), Verdict::Confirm);
}

#[test]
fn a_late_outcome_for_a_window_that_started_over_is_ignored() {
    let start = Instant::now();
    let mut detector = Detector::new(BOUNDS);
    assert_eq!(detector.look(start - ms(2), 0), Verdict::Quiet);
    assert_eq!(detector.look(start, QUERY), Verdict::Quiet);
    assert_eq!(detector.look(start + ms(10), 2 * QUERY), Verdict::Confirm);
    // The cache read something: a new window, which has asked nothing yet.
    assert_eq!(detector.look(start + ms(12), QUERY), Verdict::Quiet);
    detector.confirmed(start + ms(30), start + ms(10), false);
    // Still hung from here: the new window asks on its own.
    assert_eq!(detector.look(start + ms(32), 2 * QUERY), Verdict::Confirm);
    assert!(detector.asking());
    // A probe sent before this window began (lost in the one before) is no answer to it.
    detector.confirmed(start + ms(40), start + ms(11), false);
    assert!(detector.asking(), "an outcome from an earlier window was taken");
    assert_eq!(detector.look(start + ms(50), 3 * QUERY), Verdict::Quiet);
    // Its own probe, sent at 32 ms.
    detector.confirmed(start + ms(52), start + ms(32), false);
    assert!(!detector.asking());
    assert_eq!(
        detector.look(start + ms(52), 4 * QUERY),
        Verdict::Stalled(Stall { queued_bytes: 4 * QUERY, for_ms: 40 })
    );
    assert!(detector.busy());
    assert_eq!(detector.look(start + ms(60), 0), Verdict::Quiet);
    assert!(!detector.busy());
}
