//! The agent's quiet pace: on a healthy node without DNS traffic, its fast cadences slow down.
//!
//! An idle agent's CPU is the cost of waking up, and most wake-ups are the cache probe's every
//! `--interval` (100 ms) with the stall watch's look and the resync on the same ticks. On a node
//! where nobody asks the cache anything, those ticks find what the kernel's own signals already
//! say: the kernel's fast path and its socket-destroy events see a killed cache without them,
//! and the stall watch sees a hang by the queue the first query leaves. So, while both of these
//! hold, the fast cadences tick every `--quiet-interval` (1 s) instead:
//!
//! * **the node is quiet** ([`Pace::node_quiet`], the stall watch's word): no DNS traffic in
//!   the node's UDP counter, every cache address watched (no reuseport group left to the
//!   probes), no queue waiting;
//! * **the agent is calm** ([`Pace::calm`], the control loop's word): on `Local`, nothing
//!   forced, held, blocked or failed to apply, and the cache's last `--rise` UDP probes good and
//!   quick.
//!
//! The first sign of anything else (traffic, a queue, a failed or slow probe, a route change)
//! brings the fast pace back at once: the ticks waiting on the quiet pace are woken. What the
//! quiet pace gives up is said in `docs/design.md` ("The quiet pace").

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

/// How many of its own periods the TCP probe waits at the quiet pace.
pub const TCP_QUIET: u32 = 5;

/// Whether the fast cadences may tick at the quiet pace; shared by whoever ticks and whoever
/// judges.
#[derive(Debug)]
pub struct Pace {
    /// The quiet pace's period; `None`: never quiet (`--quiet-interval 0s`, or the node's
    /// signals it rests on are off).
    period: Option<Duration>,
    node_quiet: AtomicBool,
    calm: AtomicBool,
    quiet: watch::Sender<bool>,
}

impl Pace {
    /// A pace that goes quiet at `period` once both judges say so (`None`: never).
    pub fn new(period: Option<Duration>) -> Pace {
        Pace {
            period,
            node_quiet: AtomicBool::new(false),
            calm: AtomicBool::new(false),
            quiet: watch::Sender::new(false),
        }
    }

    /// The stall watch's word: the node carries no DNS traffic and every cache socket is
    /// watched, with nothing queued.
    pub fn node_quiet(&self, quiet: bool) {
        self.node_quiet.store(quiet, Ordering::Relaxed);
        self.update();
    }

    /// The control loop's word: the agent is on `Local` and the cache's probes are good.
    pub fn calm(&self, calm: bool) {
        self.calm.store(calm, Ordering::Relaxed);
        self.update();
    }

    fn update(&self) {
        let quiet = self.period.is_some()
            && self.node_quiet.load(Ordering::Relaxed)
            && self.calm.load(Ordering::Relaxed);
        if self.quiet.send_if_modified(|now| std::mem::replace(now, quiet) != quiet) {
            let every = self.period.filter(|_| quiet);
            tracing::debug!(quiet, ?every, "pace: the fast cadences' quiet pace");
        }
    }

    /// Whether the quiet pace is on now.
    pub fn is_quiet(&self) -> bool {
        *self.quiet.borrow()
    }

    /// The period a cadence of `period` ticks at now.
    pub fn period(&self, period: Duration) -> Duration {
        if self.is_quiet() {
            self.when_quiet(period)
        } else {
            period
        }
    }

    /// The period a cadence of `period` ticks at while the pace is quiet.
    pub fn when_quiet(&self, period: Duration) -> Duration {
        self.period.map_or(period, |quiet| period.max(quiet))
    }

    /// The TCP probe's period while the pace is quiet: [`TCP_QUIET`] of its own, at least the
    /// quiet period. A TCP probe (a connection made and closed) costs as much as the rest of a
    /// quiet second's work; a TCP listener that closes is still told at once by the kernel's
    /// socket-destroy events.
    pub fn tcp_when_quiet(&self, period: Duration) -> Duration {
        self.when_quiet(period.saturating_mul(TCP_QUIET))
    }

    /// Told of every change of the pace.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.quiet.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_only_when_both_judges_say_so_and_it_is_on() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let pace = Pace::new(Some(s(1)));
        let mut told = pace.subscribe();
        assert_eq!(pace.period(ms(100)), ms(100), "fast until told");
        pace.node_quiet(true);
        assert!(!pace.is_quiet(), "the agent is not calm yet");
        pace.calm(true);
        assert!(pace.is_quiet());
        assert!(told.has_changed().unwrap());
        told.mark_unchanged();
        assert_eq!(pace.period(ms(100)), s(1));
        assert_eq!(pace.period(s(5)), s(5), "slower cadences keep theirs");
        pace.calm(true);
        assert!(!told.has_changed().unwrap(), "no change, nobody woken");
        pace.node_quiet(false);
        assert!(!pace.is_quiet() && told.has_changed().unwrap(), "traffic: fast at once");

        let off = Pace::new(None);
        off.node_quiet(true);
        off.calm(true);
        assert!(!off.is_quiet(), "off: never quiet");
        assert_eq!(off.period(ms(100)), ms(100));
        assert_eq!(pace.tcp_when_quiet(s(1)), s(5));
        assert_eq!(Pace::new(Some(s(10))).tcp_when_quiet(s(1)), s(10), "at least the quiet period");
    }
}
