//! Hang detection at the speed of the traffic. A hung cache stops reading its
//! sockets while queries keep arriving, and the kernel shows it within a millisecond: the
//! socket's receive queue grows and never goes down. Probes alone need `fall` × `interval` to say
//! the same (300 ms at the defaults). The measurements behind every choice here are in
//! docs/design/hang-detection.md.
//!
//! [`Detector`] is the pure half: fed looks at one socket's queue and the outcomes of the
//! confirm probes it asks for, it says when that socket has stalled. `watch` runs one per UDP
//! socket of the cache, looking every [`Bounds::look_idle`] while the queues are empty and every
//! [`LOOK_BUSY`] while one is not; on a node without DNS traffic, every 100 ms (`traffic`).
//!
//! * A socket is judged only once it has been seen reading: its queue empty, or lower than at
//!   the look before. A cache that binds its sockets and takes a moment to start reading them
//!   (a restart under traffic) has not *stopped*; the probes judge one that never starts.
//! * A *window* opens at a look that finds the queue non-empty. It starts over at a look that
//!   finds less than the look before (the cache read something) and closes at an empty queue.
//! * A window [`Bounds::suspect`] old asks for one confirm probe, which waits
//!   [`Bounds::confirm`] for its answer. An answer starts the window over.
//! * **Stalled**: the confirm probe went unanswered *and* the window is [`Bounds::bound`] old.
//!   Neither alone is enough. A saturated cache that drains as fast as a closed-loop client
//!   sends keeps a constant queue; a probe can be lost behind a full buffer. A pause shorter
//!   than the bound (a CPU-throttled cache) answers the probe late, but within its timeout.
//!
//! A stall counts at once, as a refusal does (`crate::health`); the probes stay the backstop
//! (a hang with no traffic, a reuseport group) and the way back.

mod traffic;
mod watch;

use std::time::{Duration, Instant};

pub(crate) use watch::{watch_stalls, Own};

use crate::health::Stall;

/// How often the queues are looked at while one is not empty.
pub const LOOK_BUSY: Duration = Duration::from_millis(2);

/// The stall watch's settings, validated by the caller (`bound` > 0, `look_idle` > 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// How long a queue may hold without going down, with a probe unanswered, before the
    /// cache counts as stalled. Pauses shorter than this never count.
    pub bound: Duration,
    /// How often the queues are looked at while all are empty.
    pub look_idle: Duration,
}

impl Bounds {
    /// A window this old asks for a confirm probe: a third of the bound.
    pub fn suspect(&self) -> Duration {
        self.bound / 3
    }

    /// The confirm probe's timeout: the rest of the bound, so that its verdict is in when the
    /// window reaches the bound.
    pub fn confirm(&self) -> Duration {
        self.bound - self.suspect()
    }
}

/// What a look concluded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to do.
    Quiet,
    /// Send a confirm probe and tell [`Detector::confirmed`] its outcome.
    Confirm,
    /// The socket has stalled.
    Stalled(Stall),
}

/// Where the current window's confirm probe stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Confirm {
    NotAsked,
    Asked,
    Unanswered,
    /// The stall was reported: nothing more for this window.
    Reported,
}

/// The queue of one socket has been non-empty and not gone down since `since`.
#[derive(Clone, Copy, Debug)]
struct Window {
    since: Instant,
    confirm: Confirm,
}

/// One socket's stall detector.
#[derive(Clone, Debug)]
pub struct Detector {
    bounds: Bounds,
    /// The socket has been seen reading (see the module's doc).
    armed: bool,
    /// The queue at the last look, in bytes.
    last: u32,
    window: Option<Window>,
}

impl Detector {
    pub fn new(bounds: Bounds) -> Detector {
        Detector { bounds, armed: false, last: 0, window: None }
    }

    /// A look at `now` found `queued` bytes waiting.
    pub fn look(&mut self, now: Instant, queued: u32) -> Verdict {
        let drained = queued < self.last;
        self.last = queued;
        self.armed |= queued == 0 || drained;
        if queued == 0 || !self.armed {
            self.window = None;
            return Verdict::Quiet;
        }
        let window = match &mut self.window {
            Some(window) if !drained => window,
            _ => self.window.insert(Window { since: now, confirm: Confirm::NotAsked }),
        };
        let age = now.saturating_duration_since(window.since);
        match window.confirm {
            Confirm::NotAsked if age >= self.bounds.suspect() => {
                window.confirm = Confirm::Asked;
                Verdict::Confirm
            }
            Confirm::Unanswered if age >= self.bounds.bound => {
                window.confirm = Confirm::Reported;
                let for_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                Verdict::Stalled(Stall { queued_bytes: queued, for_ms })
            }
            _ => Verdict::Quiet,
        }
    }

    /// A confirm probe sent at `sent` came back at `now`, `answered` or not. An answer means the
    /// cache reads: the window starts over. Only a probe sent in the current window counts: one
    /// sent before it began says nothing of it (that window asks again: [`Detector::asking`]).
    pub fn confirmed(&mut self, now: Instant, sent: Instant, answered: bool) {
        if let Some(window) = &mut self.window {
            if window.confirm == Confirm::Asked && sent >= window.since {
                *window = if answered {
                    Window { since: now, confirm: Confirm::NotAsked }
                } else {
                    Window { confirm: Confirm::Unanswered, ..*window }
                };
            }
        }
    }

    /// Whether the current window waits for a confirm probe (one sent before it began was no
    /// answer to it).
    pub fn asking(&self) -> bool {
        self.window.is_some_and(|w| w.confirm == Confirm::Asked)
    }

    /// Whether the queue was non-empty at the last look (look again soon).
    pub fn busy(&self) -> bool {
        self.last > 0
    }
}

#[cfg(test)]
mod tests;
