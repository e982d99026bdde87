//! One grid for the agent's periodic work. The probes, the resync tick, the state file and the
//! stall watch each keep a cadence of their own; started at different moments, they would each
//! wake the process apart from the others (each wake-up costs about as much CPU as the work it
//! does). On one grid, the cadences that divide each other fall on the same instants, and the
//! timer wakes the process once for all of them: at the defaults, ten times a second.
//!
//! The grid's timers are the kernel's: a timerfd each, armed at absolute instants of
//! `CLOCK_MONOTONIC` (the clock of [`Instant`]). tokio's timer wheel keeps a timer due more than
//! 64 ms ahead in a coarser level and wakes the process at that level's slot boundary to move it
//! down, a second wake-up for nearly every 100 ms tick (`docs/failsafe.md`, "What an idle agent
//! costs"). A timerfd wakes the process when it expires and not before. The lib's unit tests,
//! whose clock may be paused, run on tokio's timers; so does a process that cannot make a
//! timerfd (said once).

use std::io;
use std::os::fd::AsFd;
use std::sync::{Arc, Once};
use std::time::Duration;

use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use tokio::time::{interval_at, Instant, Interval, MissedTickBehavior};

use crate::netlink::socket::AsyncSocket;
use crate::pace::Pace;

/// The grid's origin; cadences are multiples of their period from it.
#[derive(Clone, Copy, Debug)]
pub struct Beat {
    origin: Instant,
    /// `CLOCK_MONOTONIC` at `origin`, for the kernel's timers; `None`: tokio's.
    kernel: Option<Duration>,
}

impl Beat {
    /// A grid starting now, on the kernel's timers (tokio's in the lib's unit tests).
    pub fn start() -> Beat {
        Beat::new(!cfg!(test))
    }

    fn new(kernel: bool) -> Beat {
        let origin = Instant::now();
        let monotonic = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC);
        Beat { origin, kernel: kernel.then(|| monotonic.ok().map(Duration::from)).flatten() }
    }

    /// Ticks every `period` on the grid, the first at once. A tick that comes late (a busy
    /// runtime) is not caught up, nor does it move the ones after it off the grid. Call it
    /// within the runtime that will await the ticks.
    pub fn every(self, period: Duration) -> Ticks {
        let kernel = self.kernel_timer().filter(|kernel| {
            let first = self.on_kernel_clock(self.next(Instant::now(), period));
            let every = Expiration::IntervalDelayed(first, TimeSpec::from_duration(period));
            kernel.timer.set(every, TimerSetTimeFlags::TFD_TIMER_ABSTIME).is_ok()
        });
        Ticks(match kernel {
            Some(timer) => Clock::Kernel { timer, first: true },
            None => {
                let mut ticks = interval_at(self.origin, period);
                ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
                Clock::Tokio(ticks)
            }
        })
    }

    /// Ticks every `period` on the grid, or every `quiet` while `pace` is quiet
    /// ([`crate::pace`]), the first at once. A change of pace takes effect at once: a tick
    /// waiting on the quiet period comes at the next instant of `period` when the pace turns
    /// fast. Call it within the runtime that will await the ticks.
    pub fn paced(self, period: Duration, quiet: Duration, pace: Arc<Pace>) -> Ticks {
        let told = pace.subscribe();
        let timer = self.timer();
        Ticks(Clock::Paced { timer, periods: [period, quiet], pace, told, due: Instant::now() })
    }

    /// A timer to sleep until an instant, on the grid or off it (see [`Timer::sleep_until`]).
    /// Call it within the runtime that will await it.
    pub fn timer(self) -> Timer {
        Timer { kernel: self.kernel_timer(), beat: self }
    }

    /// The first instant after `now` on the grid of `step` (> 0).
    pub fn next(self, now: Instant, step: Duration) -> Instant {
        let (since, step) =
            (now.saturating_duration_since(self.origin).as_nanos(), step.as_nanos());
        let nanos = (since / step + 1) * step;
        self.origin + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// A timerfd on the current runtime's reactor, or `None` (tokio's timers then).
    fn kernel_timer(self) -> Option<KernelTimer> {
        self.kernel?;
        let made = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_CLOEXEC)
            .map_err(io::Error::from)
            .and_then(|timer| {
                let ready = AsyncSocket::register(timer.as_fd().try_clone_to_owned()?)?;
                Ok(KernelTimer { timer, ready })
            });
        match made {
            Ok(timer) => Some(timer),
            Err(e) => {
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    tracing::warn!(
                        error = %e,
                        "cannot make a timerfd; the grid runs on tokio's timers, at about a \
                         third more wake-ups"
                    )
                });
                None
            }
        }
    }

    /// `at` on `CLOCK_MONOTONIC` (never 0, which would disarm a timerfd).
    fn on_kernel_clock(self, at: Instant) -> TimeSpec {
        let origin = self.kernel.unwrap_or_default();
        let at = if at >= self.origin {
            origin.saturating_add(at - self.origin)
        } else {
            origin.saturating_sub(self.origin - at)
        };
        TimeSpec::from_duration(at.max(Duration::from_nanos(1)))
    }
}

/// A cadence on the grid ([`Beat::every`]).
pub struct Ticks(Clock);

enum Clock {
    Tokio(Interval),
    Kernel {
        timer: KernelTimer,
        first: bool,
    },
    /// One instant at a time, each on the grid of the pace's period then.
    Paced {
        timer: Timer,
        /// Fast, quiet.
        periods: [Duration; 2],
        pace: Arc<Pace>,
        told: tokio::sync::watch::Receiver<bool>,
        due: Instant,
    },
}

impl Ticks {
    /// The next tick (the first at once). Cancel-safe: a tick not awaited to its end is not lost.
    pub async fn tick(&mut self) {
        match &mut self.0 {
            Clock::Tokio(ticks) => {
                ticks.tick().await;
            }
            Clock::Kernel { timer, first } => {
                if !std::mem::take(first) {
                    timer.expired().await;
                }
            }
            Clock::Paced { timer, periods, pace, told, due } => loop {
                let beat = timer.beat;
                let period = || periods[usize::from(pace.is_quiet())];
                tokio::select! {
                    () = timer.sleep_until(*due) => {
                        *due = beat.next(Instant::now(), period());
                        return;
                    }
                    // Faster now: the next instant of the fast period, if sooner.
                    Ok(()) = told.changed() => {
                        *due = (*due).min(beat.next(Instant::now(), period()));
                    }
                }
            },
        }
    }
}

/// A one-shot timer ([`Beat::timer`]).
pub struct Timer {
    kernel: Option<KernelTimer>,
    beat: Beat,
}

impl Timer {
    /// Completes at `at` (at once if it has passed). Cancel-safe; each call sets the timer
    /// afresh.
    pub async fn sleep_until(&mut self, at: Instant) {
        if let Some(kernel) = &self.kernel {
            let when = Expiration::OneShot(self.beat.on_kernel_clock(at));
            // Not seen to fail (the arguments are valid); if it did, tokio's timer serves.
            if kernel.timer.set(when, TimerSetTimeFlags::TFD_TIMER_ABSTIME).is_ok() {
                return kernel.expired().await;
            }
        }
        tokio::time::sleep_until(at).await
    }
}

/// A timerfd, and its duplicate on tokio's reactor.
struct KernelTimer {
    timer: TimerFd,
    ready: AsyncSocket,
}

impl KernelTimer {
    /// Until the timer has expired at least once since it was last read (expirations merged).
    async fn expired(&self) {
        loop {
            if self.ready.readable().await.is_err() {
                // The runtime is shutting down; its tasks go with it.
                return std::future::pending().await;
            }
            match self.ready.try_read(&mut [0; 8]) {
                Ok(_) => return,
                // A readiness seen before the timer was set afresh: wait for the new expiry.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // Not seen: a timerfd of `CLOCK_MONOTONIC` read 8 bytes at a time fails with
                // `EAGAIN` alone. Never tick rather than tick in a busy loop.
                Err(e) => {
                    tracing::error!(error = %e, "reading a timerfd failed; its cadence stops");
                    return std::future::pending().await;
                }
            }
        }
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

    /// Paced ticks: at the quiet period while the pace is quiet, on the grid; back to their own
    /// period at once when it turns fast, the tick waiting on the quiet period woken.
    #[tokio::test(start_paused = true)]
    async fn paced_ticks_slow_down_while_quiet_and_speed_up_at_once() {
        let beat = Beat::start();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let pace = Arc::new(Pace::new(Some(ms(1000))));
        let mut ticks = beat.paced(ms(100), ms(1000), pace.clone());
        ticks.tick().await; // at once
        ticks.tick().await;
        assert_eq!(Instant::now() - t0, ms(100));
        pace.node_quiet(true);
        pace.calm(true);
        ticks.tick().await; // the one already due
        ticks.tick().await;
        assert_eq!(Instant::now() - t0, ms(1000), "the quiet period's grid");
        let waiting = tokio::spawn(async move {
            ticks.tick().await;
            Instant::now()
        });
        tokio::time::advance(ms(330)).await;
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "quiet: no tick at 1.3 s");
        pace.calm(false);
        assert_eq!(waiting.await.unwrap() - t0, ms(1400), "fast again: the next 100 ms instant");
    }

    /// The kernel's timers, on the real clock: a tick never comes before its grid instant, a
    /// late one is not caught up, and a one-shot timer wakes at its instant, set afresh each
    /// time (a timer left from a sleep given up does not end the next one early).
    #[tokio::test]
    async fn the_kernel_timers_keep_the_grid() {
        let beat = Beat::new(true);
        assert!(beat.kernel.is_some());
        let ms = Duration::from_millis;
        let mut ticks = beat.every(ms(20));
        assert!(matches!(ticks.0, Clock::Kernel { .. }), "a timerfd");
        let before = Instant::now();
        ticks.tick().await; // at once
        ticks.tick().await;
        let second = Instant::now();
        assert!(second >= beat.next(before, ms(20)), "not before its grid instant");
        // A busy runtime: three grid instants go by; one tick comes for them, then the grid.
        std::thread::sleep(ms(70));
        let late = Instant::now();
        ticks.tick().await;
        ticks.tick().await;
        assert!(Instant::now() >= beat.next(late, ms(20)), "the missed ticks are not caught up");

        let mut timer = beat.timer();
        let far = Instant::now() + ms(10_000);
        tokio::select! {
            () = timer.sleep_until(far) => panic!("woke 10 s early"),
            () = tokio::task::yield_now() => {}
        }
        // A sleep given up after its timer expired, the expiry unread: the next sleep is not
        // ended by it.
        tokio::select! {
            () = timer.sleep_until(Instant::now() + ms(1)) => panic!("woke before its time"),
            () = tokio::task::yield_now() => {}
        }
        std::thread::sleep(ms(5));
        let at = Instant::now() + ms(30);
        timer.sleep_until(at).await;
        assert!(Instant::now() >= at);
        let passed = Instant::now() - ms(5);
        timer.sleep_until(passed).await;
    }
}
