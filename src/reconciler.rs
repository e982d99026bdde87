//! The reconciler: keeps the ruleset of the current route installed.
//!
//! [`Reconciler`] holds the dataplane and, once the agent has started, is the only one to write
//! to it. It decides nothing about routes: the [`Agent`](crate::agent::Agent) hands it the
//! ruleset of each route it switches to ([`Reconciler::install`]), and the reconciler installs
//! it, reads it back now and then, restores it when someone else changed it, and retries a
//! failed apply with backoff. Time comes in as an argument, so it is tested with the fake
//! dataplane and no runtime.
//!
//! The loop is level-triggered: every tick (and every nftables change notification) reads the
//! table back and restores it if it is not exactly the ruleset of the current route. A failed
//! apply is retried on the next tick; the batch is atomic, so the node never holds half a ruleset.
//!
//! Decisions never wait behind a read-back: a check runs as a [`CheckJob`] on a worker thread
//! with its own handle on the dataplane ([`Dataplane::reader`]), while the loop goes on taking
//! probe results and applying. Applies stay on the loop, one at a time. Every apply starts a new
//! generation; a check that began in an older one is discarded when it returns (what it read
//! may predate the apply, or mix both), so it can never trigger a spurious repair. Holding the
//! dataplane is what makes that sound: no apply can reach the kernel without starting a
//! generation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};

use crate::blocking::blocking;
use crate::dataplane::TableRef;
use crate::dataplane::{self, Check, Dataplane, FULL_READ_EVERY, POLL_ANNOUNCED};
use crate::metrics::Metrics;
use crate::ruleset::{Route, RuleSet};

#[cfg(test)]
mod tests;

/// The least time between two repairs of the ruleset.
const REPAIR_SPACING: Duration = Duration::from_millis(50);

/// How often what announces nothing ([`Dataplane::polled`]: iptables-legacy) is looked at: every
/// third tick at the default `--interval`, so that drift there is repaired well within a second.
/// On every tick it was about a tenth of an idle legacy node's CPU (the kernel copies each table
/// out, its counters summed over the CPUs), for drift seen 200 ms sooner.
pub const LOOK_UNANNOUNCED: Duration = Duration::from_millis(300);

/// A read-back to run off the control loop ([`CheckJob::run`], e.g. in `spawn_blocking`); its
/// result goes back to [`Reconciler::checked`].
pub struct CheckJob {
    generation: u64,
    rules: RuleSet,
    /// Only what lives in these tables ([`Dataplane::check_changed`]); `None`: everything.
    changed: Option<Vec<TableRef>>,
    reader: Box<dyn Dataplane>,
    /// The nftables generation before it began ([`Dataplane::ruleset_generation`]).
    began_in: Option<u32>,
}

impl CheckJob {
    /// Reads the ruleset back and compares it with the route's (blocks: child processes or
    /// netlink dumps).
    pub fn run(mut self) -> CheckDone {
        let started = Instant::now();
        let result = match &self.changed {
            Some(tables) => self.reader.check_changed(&self.rules, tables),
            None => self.reader.check(&self.rules),
        };
        CheckDone {
            generation: self.generation,
            began_in: self.began_in,
            whole: self.changed.is_none(),
            result,
            took: started.elapsed(),
            reader: self.reader,
        }
    }
}

/// A finished [`CheckJob`].
pub struct CheckDone {
    generation: u64,
    began_in: Option<u32>,
    /// It read everything ([`Dataplane::check`]).
    whole: bool,
    result: Result<Check, dataplane::Error>,
    took: Duration,
    reader: Box<dyn Dataplane>,
}

/// Keeps the ruleset the agent last asked for installed: applies, read-backs, repairs, retries.
pub struct Reconciler {
    dataplane: Box<dyn Dataplane>,
    /// The route whose ruleset `desired` is, for the logs.
    route: Route,
    /// The ruleset of the current route, as last rendered.
    desired: RuleSet,
    /// The last apply failed; the next resync must apply without asking.
    dirty: bool,
    /// Failed applies in a row, for the retry backoff.
    apply_failures: u32,
    /// No resync before this: backing off after failed applies, or after a repair so that a
    /// tool fighting over the table (or our own change notification) cannot spin the loop.
    not_before: Option<Instant>,
    /// The resync period; the unit of the backoff.
    tick: Duration,
    /// Whether the kernel announces every change to what a check reads
    /// ([`Dataplane::announced_tables`]), but for what is [`Dataplane::polled`].
    announced: bool,
    /// Whether part of it announces nothing and is read every [`LOOK_UNANNOUNCED`] all the same.
    polled: bool,
    /// When the ruleset was last read back whole (checked or applied).
    checked_at: Option<Instant>,
    /// The nftables generation the last whole check that found the ruleset as wanted began
    /// in; `None` after an apply (the agent's own commit moved it) or a check that found
    /// drift.
    checked_in: Option<u32>,
    /// When the ruleset was last really read back whole (not told by its generation).
    read_at: Option<Instant>,
    /// When a tick last looked at what announces nothing ([`LOOK_UNANNOUNCED`]).
    looked_at: Option<Instant>,
    /// The handle checks read back through, off the loop; `None` while a check is in flight.
    reader: Option<Box<dyn Dataplane>>,
    /// Bumped by every apply: a check begun in an older generation is stale.
    generation: u64,
    /// A whole check is wanted (a tick, a retry, or unknown announcements).
    check_all: bool,
    /// A check of what announces nothing is wanted (a tick, when the rest is announced).
    check_polled: bool,
    /// Tables announced changed since the last check began: the next check reads these.
    changed: Vec<TableRef>,
    /// Checks discarded because an apply overtook them.
    stale_checks: u64,
    /// Restores of a ruleset someone else changed or removed.
    repairs: u64,
    /// Why the last apply failed (or what went wrong at the start); `None` once one succeeds.
    last_error: Option<String>,
    metrics: Arc<Metrics>,
}

impl Reconciler {
    /// Keeps `desired`, the ruleset of `route`, installed through `dataplane`, reading it back
    /// through `reader` (the dataplane's second handle). `now` is when the start found it
    /// installed or installed it; a start that could not is told by [`Reconciler::start_failed`].
    pub fn new(
        dataplane: Box<dyn Dataplane>,
        reader: Box<dyn Dataplane>,
        route: Route,
        desired: RuleSet,
        tick: Duration,
        metrics: Arc<Metrics>,
        now: Instant,
    ) -> Reconciler {
        let announced = dataplane.announced_tables().is_some();
        let polled = dataplane.polled();
        Reconciler {
            dataplane,
            route,
            desired,
            dirty: false,
            apply_failures: 0,
            not_before: None,
            tick,
            announced,
            polled,
            checked_at: Some(now),
            checked_in: None,
            read_at: Some(now),
            looked_at: None,
            reader: Some(reader),
            generation: 0,
            check_all: false,
            check_polled: false,
            changed: Vec::new(),
            stale_checks: 0,
            repairs: 0,
            last_error: None,
            metrics,
        }
    }

    /// What went wrong in the start's own applies: `error` stays the last error until an apply
    /// succeeds; when the ruleset is not in (`retry`), it is retried with backoff.
    pub fn start_failed(&mut self, error: String, retry: bool, now: Instant) {
        self.last_error = Some(error);
        if retry {
            self.failed_apply(now);
        }
    }

    /// Installs `rules`, the ruleset of `route`, now (ahead of a check in flight, which it
    /// makes stale), and keeps it installed from then on.
    pub fn install(&mut self, route: Route, rules: RuleSet, now: Instant) {
        self.route = route;
        self.desired = rules;
        self.apply(now);
    }

    /// The tick's resync: every [`LOOK_UNANNOUNCED`] when the kernel announces nothing of the
    /// ruleset (iptables-legacy); when it announces changes and the agent is `hearing` them (the
    /// watch is up), every [`POLL_ANNOUNCED`] as a safety net, and what announces nothing
    /// ([`Dataplane::polled`]: iptables-legacy beside an announced part) alone every
    /// [`LOOK_UNANNOUNCED`]; when they are not heard, every tick. A failed apply is retried
    /// whatever the time.
    #[must_use = "a check to run off the loop"]
    pub fn poll(&mut self, now: Instant, hearing: bool) -> Option<CheckJob> {
        let recent = self.checked_at.is_some_and(|t| now.duration_since(t) < POLL_ANNOUNCED);
        // In ticks (half a tick's slack): a tick that comes a little early is not a tick late.
        let looked = self
            .looked_at
            .is_some_and(|t| now.duration_since(t) + self.tick / 2 < LOOK_UNANNOUNCED);
        if self.announced && hearing && recent && !self.dirty {
            if !self.polled || looked {
                return None;
            }
            self.looked_at = Some(now);
            self.check_polled = true;
            return self.next_check(now);
        }
        if !self.announced && looked && !self.dirty {
            return None;
        }
        self.looked_at = Some(now);
        self.resync(now)
    }

    /// Resyncs: re-applies after a failed apply (here, on the loop), else returns the read-back
    /// to run off the loop; its result goes to [`Reconciler::checked`], which restores the
    /// ruleset when it is not exactly the current route's. Nothing while a check is in flight
    /// (one follows when it returns) or a retry or spaced repair is pending.
    #[must_use = "a check to run off the loop"]
    pub fn resync(&mut self, now: Instant) -> Option<CheckJob> {
        self.check_all = true;
        self.next_check(now)
    }

    /// Like [`Reconciler::resync`], for the kernel's announcement that `tables` changed
    /// (`None`: unknown ones): the check reads back only what lives there.
    #[must_use = "a check to run off the loop"]
    pub fn announced(&mut self, tables: Option<Vec<TableRef>>, now: Instant) -> Option<CheckJob> {
        match tables {
            Some(tables) => {
                for t in tables {
                    if !self.changed.contains(&t) {
                        self.changed.push(t);
                    }
                }
            }
            None => self.check_all = true,
        }
        self.next_check(now)
    }

    /// The check wanted, unless one is in flight (it follows that one) or a retry or spaced
    /// repair is pending; after a failed apply, the apply (on the loop) instead.
    fn next_check(&mut self, now: Instant) -> Option<CheckJob> {
        if !self.check_all && !self.check_polled && self.changed.is_empty() {
            return None;
        }
        if self.not_before.is_some_and(|t| now < t) {
            return None;
        }
        self.not_before = None;
        if self.dirty {
            self.apply(now);
            return None;
        }
        // A check of what announces nothing alone, which the reader can answer at once (the
        // kernel's copies of iptables-legacy's tables, microseconds): done here, on the loop,
        // without handing it to a thread and back (two wake-ups a tick on an idle legacy node).
        if self.changed.is_empty() && !(self.check_all && self.announced) {
            if let Some(reader) = self.reader.as_mut() {
                let started = Instant::now();
                if reader.unchanged(&self.desired) == Some(Check::Matches) {
                    self.metrics.check(started.elapsed());
                    if std::mem::take(&mut self.check_all) {
                        self.checked_at = Some(now);
                    }
                    self.check_polled = false;
                    return None;
                }
            }
        }
        // A whole check of an announced ruleset (the safety net, an announcement not understood)
        // in the nftables generation the last one began in, anything polled unchanged: nothing
        // it would read has changed since. Told here with no read-back (on an iptables-nft
        // node, eight child processes each time), for up to FULL_READ_EVERY.
        let mut began_in = None;
        let trusted = self.read_at.is_some_and(|t| now.duration_since(t) < FULL_READ_EVERY);
        if self.check_all && self.announced {
            if let Some(reader) = self.reader.as_mut() {
                let started = Instant::now();
                began_in = reader.ruleset_generation();
                if trusted
                    && began_in.is_some()
                    && began_in == self.checked_in
                    && (!self.polled || reader.unchanged(&self.desired) == Some(Check::Matches))
                {
                    self.metrics.check(started.elapsed());
                    (self.check_all, self.check_polled) = (false, false);
                    self.changed.clear();
                    self.checked_at = Some(now);
                    return None;
                }
            }
        }
        let reader = self.reader.take()?;
        self.check_polled = false;
        let changed = std::mem::take(&mut self.changed);
        let changed = (!std::mem::take(&mut self.check_all)).then_some(changed);
        let rules = self.desired.clone();
        Some(CheckJob { generation: self.generation, rules, changed, reader, began_in })
    }

    /// Takes a finished check: repairs what it found, unless an apply overtook it (then it
    /// is discarded: the apply read back itself). Returns the next check when one was asked
    /// for meanwhile.
    #[must_use = "a check to run off the loop"]
    pub fn checked(&mut self, done: CheckDone, now: Instant) -> Option<CheckJob> {
        self.reader = Some(done.reader);
        self.metrics.check(done.took);
        if done.generation != self.generation {
            self.stale_checks += 1;
            debug!(result = ?done.result.as_ref().ok(), "a check overtaken by an apply, discarded");
        } else {
            if done.whole {
                (self.checked_at, self.read_at) = (Some(now), Some(now));
            }
            match done.result {
                Ok(Check::Matches) if done.whole => self.checked_in = done.began_in,
                Ok(Check::Matches) => {}
                Ok(drift) => {
                    self.repairs += 1;
                    self.metrics.repair();
                    warn!(route = %self.route, drift = ?drift, "ruleset changed by someone else, restoring");
                    self.apply(now);
                    // Whoever keeps changing the table (our own change notification included)
                    // cannot make the agent spin: repairs are spaced.
                    let spacing = self.tick.min(REPAIR_SPACING);
                    self.not_before = Some(self.not_before.unwrap_or(now).max(now + spacing));
                }
                Err(e) => {
                    warn!(error = %e, "reading the ruleset back failed, re-applying");
                    self.apply(now);
                }
            }
        }
        self.next_check(now)
    }

    /// Checks discarded because an apply overtook them.
    pub fn stale_checks(&self) -> u64 {
        self.stale_checks
    }

    /// Whether a check is in flight.
    pub fn checking(&self) -> bool {
        self.reader.is_none()
    }

    /// Installs the current route's ruleset; on failure, schedules a retry with exponential
    /// backoff (two ticks, doubling, at most 5 s). The batch is atomic: a failure changes nothing.
    fn apply(&mut self, now: Instant) {
        let started = Instant::now();
        // Whatever a check in flight reads now may predate this apply, or mix both.
        self.generation += 1;
        self.checked_in = None;
        let result = blocking(|| self.dataplane.apply(&self.desired));
        self.metrics.apply(started.elapsed(), self.dataplane.last_commit(), result.is_ok());
        match result {
            Ok(()) => {
                (self.checked_at, self.read_at) = (Some(now), Some(now));
                self.dirty = false;
                self.apply_failures = 0;
                self.not_before = None;
                self.last_error = None;
            }
            Err(e) => {
                self.last_error = Some(e.to_string());
                self.failed_apply(now);
            }
        }
    }

    /// Schedules the retry of a failed apply: two ticks, doubling, at most 5 s.
    fn failed_apply(&mut self, now: Instant) {
        self.apply_failures += 1;
        let backoff =
            self.tick.saturating_mul(1 << self.apply_failures.min(16)).min(Duration::from_secs(5));
        let error = self.last_error.as_deref().unwrap_or("unknown");
        error!(route = %self.route, error, retry_in = ?backoff, "applying the ruleset failed");
        self.dirty = true;
        self.not_before = Some(now + backoff);
    }

    /// When a deferred resync (a retry, a spaced repair) is due.
    pub fn resync_due(&self) -> Option<Instant> {
        self.not_before
    }

    /// Whether the kernel may not hold the current route's ruleset (the last apply failed).
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// One last attempt to install the current route's ruleset, for shutdown.
    pub fn settle(&mut self, now: Instant) {
        if self.dirty {
            self.not_before = None;
            self.apply(now);
        }
    }

    /// Restores of a ruleset someone else changed or removed, so far.
    pub fn repairs(&self) -> u64 {
        self.repairs
    }

    /// Why the last apply failed (or what went wrong at the start); `None` once one succeeded.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The dataplane, to look at: every write to it goes through the reconciler.
    pub fn dataplane(&self) -> &dyn Dataplane {
        self.dataplane.as_ref()
    }

    /// Counted replies of the cache (see [`Dataplane::reply_packets`]).
    pub fn reply_packets(&mut self) -> Result<Option<u64>, dataplane::Error> {
        blocking(|| self.dataplane.reply_packets())
    }
}
