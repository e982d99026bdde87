//! One grid for the agent's periodic work. The probes, the resync tick, the state file and the
//! stall watch each keep a cadence of their own; started at different moments, they would each
//! wake the process apart from the others (each wake-up costs about as much CPU as the work it
//! does). On one grid, the cadences that divide each other fall on the same instants, and the
//! timer wakes the process once for all of them: at the defaults, ten times a second.

use std::time::Duration;

use tokio::time::{interval_at, Instant, Interval, MissedTickBehavior};

/// The grid's origin; cadences are multiples of their period from it.
#[derive(Clone, Copy, Debug)]
pub struct Beat(Instant);

impl Beat {
    /// A grid starting now.
    pub fn start() -> Beat {
        Beat(Instant::now())
    }

    /// Ticks every `period` on the grid, the first at once. A tick that comes late (a busy
    /// runtime) is not caught up, nor does it move the ones after it off the grid.
    pub fn every(self, period: Duration) -> Interval {
        let mut ticks = interval_at(self.0, period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
        ticks
    }

    /// The first instant after `now` on the grid of `step` (> 0).
    pub fn next(self, now: Instant, step: Duration) -> Instant {
        let (since, step) = (now.saturating_duration_since(self.0).as_nanos(), step.as_nanos());
        let nanos = (since / step + 1) * step;
        self.0 + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn cadences_that_divide_each_other_fall_on_the_same_instants() {
        let beat = Beat::start();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        tokio::time::advance(ms(35)).await;
        // Started later, on the grid all the same.
        let mut probe = beat.every(ms(100));
        probe.tick().await; // the first, at once (its instant has passed)
        probe.tick().await;
        assert_eq!(Instant::now() - t0, ms(100));
        assert_eq!(beat.next(Instant::now(), ms(20)), t0 + ms(120));
        assert_eq!(beat.next(t0 + ms(119), ms(20)), t0 + ms(120));
        assert_eq!(beat.next(t0, ms(20)), t0 + ms(20));
        // A late tick is skipped, not caught up, and the grid stays.
        tokio::time::advance(ms(250)).await;
        probe.tick().await;
        assert_eq!(Instant::now() - t0, ms(350));
        probe.tick().await;
        assert_eq!(Instant::now() - t0, ms(400));
    }
}
