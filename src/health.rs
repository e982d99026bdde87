//! The decision: which [`Route`] DNS for the cluster-DNS IP takes, from probe outcomes.
//!
//! A pure hysteresis state machine: it does no I/O and reads no clock; every input carries the
//! time. Its policy, in order:
//!
//! 1. **Leave `Local`** when the cache has failed `fall` consecutive probes on one transport, or
//!    at once when a probe was *refused* (nothing listens on port 53: the cache is gone, no
//!    reason to wait) or the cache's socket *stalled* (queries waited in it unread past the
//!    stall bound and a probe went unanswered: `crate::stall`) — unless the upstream is
//!    failing too: a half-dead cache may still serve from its cache, and CoreDNS down gains
//!    nothing. The machine then *holds* and says so.
//! 2. **Return to `Local`** after `rise` consecutive good UDP probes of the cache, with the last
//!    TCP probe (if any) good too, and at least `min_hold` in `Upstream` (flap damping). When the
//!    upstream itself is failing, `min_hold` is waived: the cache is the only working resolver.
//!    Until the cache gets there, a failing upstream *holds* `Upstream` too, and says so.
//! 3. Leaving `Local` is never delayed by `min_hold`: failing over is what the agent is for.
//!
//! The upstream counts as failing after `fall` consecutive bad probes (a refusal is no
//! different there: kube-proxy rejects while a Service has no endpoints, which may pass), and as
//! healthy again after one good one; before its first probe it is presumed healthy. A refusal
//! from the cache, or a stall, is forgotten as soon as the cache answers on any transport.

use std::fmt;
use std::time::{Duration, Instant};

use crate::ruleset::Route;

/// Hysteresis settings, validated by the caller (`fall`, `rise` ≥ 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thresholds {
    /// Consecutive bad cache probes that make the route leave `Local`.
    pub fall: u32,
    /// Consecutive good cache probes needed to return to `Local`.
    pub rise: u32,
    /// Minimum time in `Upstream` before returning to `Local`.
    pub min_hold: Duration,
}

/// One probe outcome, as far as the decision is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sample {
    /// The server answered (NOERROR or NXDOMAIN).
    Good,
    /// Nothing listens (ICMP port unreachable, TCP RST): definitive, counts at once.
    Refused,
    /// Any other failure; the label says which (`timeout`, `servfail`, `error`).
    Bad(&'static str),
    /// Queries waited unread in the cache's socket past the stall bound, and a probe got no
    /// answer: the cache stopped reading. Definitive, counts at once.
    Stalled(Stall),
}

/// What a stall was seen as: the bytes waiting in the cache's socket, and for how long the
/// queue had not gone down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stall {
    pub queued_bytes: u32,
    pub for_ms: u64,
}

/// Which probe stream a sample comes from. The cache is probed over UDP and TCP; the two are
/// counted apart so a cache that fails only over TCP still trips the threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    CacheUdp,
    CacheTcp,
    Upstream,
}

/// Why the route is what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The route the agent started in (installed before it, or the default).
    Start(Route),
    /// `count` consecutive probes of the cache failed, the last with `last`.
    CacheFailing { stream: Stream, count: u32, last: &'static str },
    /// A probe of the cache was refused: nothing listens on port 53.
    CacheRefused(Stream),
    /// The cache's socket stalled: queries waited in it unread, and a probe got no answer.
    CacheStalled(Stall),
    /// The cache answered `count` consecutive probes (and `min_hold` passed).
    CacheRecovered { count: u32 },
    /// The cache answered `count` consecutive probes while the upstream is failing.
    CacheRecoveredUpstreamFailing { count: u32 },
    /// An operator (or a drain) forced the route.
    Forced { kind: ForceKind, why: String },
    /// A forced route was released, or its time ran out: automatic again.
    Automatic { expired: bool },
    /// The drained cache is gone: automatic again, the new cache must pass its probes.
    DrainEnded,
    /// The node's own firewall would stop pods' DNS to the cache: the cache is of no use to
    /// them, whatever its probes say.
    PathBlocked(String),
}

impl Reason {
    /// A short, fixed name for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Reason::Start(_) => "start",
            Reason::CacheFailing { .. } => "cache_failing",
            Reason::CacheRefused(_) => "cache_refused",
            Reason::CacheStalled(_) => "cache_stalled",
            Reason::CacheRecovered { .. } => "cache_recovered",
            Reason::CacheRecoveredUpstreamFailing { .. } => "cache_recovered_upstream_failing",
            Reason::Forced { kind: ForceKind::Manual, .. } => "manual",
            Reason::Forced { kind: ForceKind::Drain, .. } => "drain",
            Reason::Automatic { expired: true } => "override_expired",
            Reason::Automatic { expired: false } => "released",
            Reason::DrainEnded => "drain_ended",
            Reason::PathBlocked(_) => "firewall",
        }
    }
}

/// Who forced a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForceKind {
    /// `nodelocaldns-ha flip`: held until released or until it expires.
    Manual,
    /// `nodelocaldns-ha drain`: `Upstream` until the cache it drained is gone — one of the
    /// sockets it served on when the drain began is closed ([`Machine::end_drain`]), or a probe
    /// fails — from then on the automatic policy brings the route back once the new cache
    /// answers.
    Drain,
}

/// A route forced by hand, overriding the automatic decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forced {
    pub route: Route,
    pub kind: ForceKind,
    /// When it ends by itself, if ever.
    pub until: Option<Instant>,
    /// What the operator said.
    pub why: String,
    /// For a drain: the cookies of the sockets the drained cache served on when the drain began.
    /// The drain is over once one of them is closed (the caller looks, and calls
    /// [`Machine::end_drain`]), whether or not a new cache answers already. `None` when they
    /// could not be listed: then only failed probes end it.
    pub waits_for: Option<Vec<u64>>,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Start(route) => write!(f, "started with route {route}"),
            Reason::CacheFailing { stream, count, last } => {
                write!(f, "{count} consecutive {stream} probes failed (last: {last})")
            }
            Reason::CacheRefused(stream) => {
                write!(f, "{stream} probe refused: nothing listens on the cache's port 53")
            }
            Reason::CacheStalled(Stall { queued_bytes, for_ms }) => write!(
                f,
                "the cache stopped reading: {queued_bytes} bytes of queries waited in its socket \
                 and the queue did not go down for {for_ms} ms, and a probe got no answer"
            ),
            Reason::CacheRecovered { count } => {
                write!(f, "cache answered {count} consecutive probes")
            }
            Reason::CacheRecoveredUpstreamFailing { count } => {
                write!(f, "cache answered {count} consecutive probes and the upstream is failing")
            }
            Reason::Forced { kind: ForceKind::Manual, why } => write!(f, "forced by hand: {why}"),
            Reason::Forced { kind: ForceKind::Drain, why } => {
                write!(f, "draining the cache: {why}")
            }
            Reason::Automatic { expired: true } => f.write_str("forced route expired; automatic"),
            Reason::Automatic { expired: false } => f.write_str("forced route released; automatic"),
            Reason::DrainEnded => f.write_str("the drained cache is gone; automatic"),
            Reason::PathBlocked(why) => write!(f, "pods cannot reach the cache: {why}"),
        }
    }
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stream::CacheUdp => "cache udp",
            Stream::CacheTcp => "cache tcp",
            Stream::Upstream => "upstream",
        })
    }
}

/// A change of route, with its reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub from: Route,
    pub to: Route,
    pub reason: Reason,
}

/// What keeps the route where it is although its resolver fails: the other resolver fails too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// `Local` stays although the cache fails (`cache`: why it would leave), because the upstream
    /// has failed `upstream_failed` consecutive probes, the last with `upstream_last`: a
    /// half-dead cache may still serve from its cache, and a dead CoreDNS gains nothing.
    Local { cache: Reason, upstream_failed: u32, upstream_last: &'static str },
    /// `Upstream` stays although the upstream has failed `upstream_failed` consecutive probes,
    /// the last with `upstream_last`, because the cache has not answered `rise` consecutive
    /// probes yet.
    Upstream { upstream_failed: u32, upstream_last: &'static str, rise: u32 },
}

impl fmt::Display for Hold {
    /// The words `status`, the state file and the log show.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hold::Local { cache, upstream_failed, upstream_last } => write!(
                f,
                "{cache}, but staying local: {upstream_failed} consecutive upstream probes failed \
                 (last: {upstream_last})"
            ),
            Hold::Upstream { upstream_failed, upstream_last, rise } => write!(
                f,
                "{upstream_failed} consecutive upstream probes failed (last: {upstream_last}), but \
                 staying upstream: the cache has not answered {rise} consecutive probes yet"
            ),
        }
    }
}

/// Consecutive good and bad samples of one stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streak {
    pub good: u32,
    pub bad: u32,
    /// The last sample was a refusal.
    pub refused: bool,
    /// The last sample was a stall.
    pub stalled: Option<Stall>,
    /// Label of the last bad sample.
    pub last_bad: Option<&'static str>,
}

impl Streak {
    fn record(&mut self, sample: Sample) {
        match sample {
            Sample::Good => {
                self.good = self.good.saturating_add(1);
                self.bad = 0;
                self.refused = false;
                self.stalled = None;
            }
            Sample::Refused | Sample::Bad(_) | Sample::Stalled(_) => {
                self.good = 0;
                self.bad = self.bad.saturating_add(1);
                self.refused = sample == Sample::Refused;
                self.stalled = match sample {
                    Sample::Stalled(stall) => Some(stall),
                    _ => None,
                };
                self.last_bad = Some(match sample {
                    Sample::Bad(label) => label,
                    Sample::Stalled(_) => "stalled",
                    _ => "refused",
                });
            }
        }
    }
}

/// The route decision and everything it rests on.
#[derive(Clone, Debug)]
pub struct Machine {
    thresholds: Thresholds,
    route: Route,
    since: Instant,
    reason: Reason,
    /// Set while both the cache and the upstream fail, so the route stays where it is.
    held: Option<Hold>,
    cache_udp: Streak,
    cache_tcp: Streak,
    upstream: Streak,
    /// The operator's override, while it lasts.
    forced: Option<Forced>,
    /// Why pods could not reach the cache on `Local` (the node's firewall), while that lasts.
    blocked: Option<String>,
}

impl Machine {
    /// A machine in `route` since `now`.
    pub fn new(thresholds: Thresholds, route: Route, now: Instant) -> Machine {
        Machine {
            thresholds,
            route,
            since: now,
            reason: Reason::Start(route),
            held: None,
            cache_udp: Streak::default(),
            cache_tcp: Streak::default(),
            upstream: Streak::default(),
            forced: None,
            blocked: None,
        }
    }

    /// Pods cannot reach the cache (the node's firewall would stop them), or can again
    /// (`None`). While blocked the route leaves `Local` at once and does not return to it; once
    /// unblocked, the cache earns `Local` back as after any failover (`rise` good probes, which
    /// went on being counted, and `min_hold`). A forced route stays forced.
    pub fn set_blocked(&mut self, why: Option<String>, now: Instant) -> Option<Transition> {
        self.blocked = why;
        let why = self.blocked.clone()?;
        if self.route == Route::Upstream || self.forced.is_some() {
            if self.route == Route::Upstream && self.forced.is_none() {
                self.reason = Reason::PathBlocked(why);
            }
            return None;
        }
        Some(self.switch(Route::Upstream, Reason::PathBlocked(why), now))
    }

    /// Why pods cannot reach the cache, while they cannot.
    pub fn blocked(&self) -> Option<&str> {
        self.blocked.as_deref()
    }

    /// The route forced by hand, if any.
    pub fn forced(&self) -> Option<&Forced> {
        self.forced.as_ref()
    }

    /// Forces a route until released (or until `forced.until`); probes go on being counted.
    pub fn force(&mut self, forced: Forced, now: Instant) -> Option<Transition> {
        let reason = Reason::Forced { kind: forced.kind, why: forced.why.clone() };
        let to = forced.route;
        self.forced = Some(forced);
        self.held = None;
        if to == self.route {
            self.reason = reason;
            return None;
        }
        Some(self.switch(to, reason, now))
    }

    /// Back to automatic: the policy decides at once from the streaks it kept counting (a
    /// resulting change carries the policy's reason).
    pub fn release(&mut self, now: Instant) -> Option<Transition> {
        self.unforce(Reason::Automatic { expired: false }, now)
    }

    /// Releases a forced route whose time has come; call it on every tick.
    pub fn expire(&mut self, now: Instant) -> Option<Transition> {
        match self.forced.as_ref().and_then(|f| f.until) {
            Some(until) if now >= until => self.unforce(Reason::Automatic { expired: true }, now),
            _ => None,
        }
    }

    /// Ends a drain because the drained cache is gone (its sockets are closed), whatever the
    /// probes say: a new cache may answer already (a surge rollout), or it may have been gone
    /// before this agent started. The route stays where it is; from `now` on, the new cache earns
    /// its way back with `rise` good probes and `min_hold`. Returns whether a drain ended.
    pub fn end_drain(&mut self, now: Instant) -> bool {
        if self.forced.as_ref().is_none_or(|f| f.kind != ForceKind::Drain) {
            return false;
        }
        self.forced = None;
        self.held = None;
        self.since = now;
        self.reason = Reason::DrainEnded;
        true
    }

    fn unforce(&mut self, reason: Reason, now: Instant) -> Option<Transition> {
        self.forced.take()?;
        self.reason = reason.clone();
        match self.decide(now) {
            Some(next) => Some(self.switch(self.route.other(), next, now)),
            None => None,
        }
    }

    fn switch(&mut self, to: Route, reason: Reason, now: Instant) -> Transition {
        let from = self.route;
        self.route = to;
        self.since = now;
        self.reason = reason.clone();
        self.held = None;
        Transition { from, to, reason }
    }

    /// The automatic policy's verdict now: why the route should change, if it should.
    fn decide(&mut self, now: Instant) -> Option<Reason> {
        match self.route {
            Route::Local => self.why_leave_local(),
            Route::Upstream => self.why_return_local(now),
        }
    }

    pub fn route(&self) -> Route {
        self.route
    }

    /// When the current route was entered.
    pub fn since(&self) -> Instant {
        self.since
    }

    pub fn reason(&self) -> &Reason {
        &self.reason
    }

    /// Why the route stays where it is although its resolver fails, if it does: `Local` with the
    /// cache failing, or `Upstream` with the upstream failing, because the other fails too.
    pub fn held(&self) -> Option<&Hold> {
        self.held.as_ref()
    }

    pub fn streak(&self, stream: Stream) -> Streak {
        match stream {
            Stream::CacheUdp => self.cache_udp,
            Stream::CacheTcp => self.cache_tcp,
            Stream::Upstream => self.upstream,
        }
    }

    /// The upstream has failed `fall` consecutive probes.
    pub fn upstream_failing(&self) -> bool {
        self.upstream.bad >= self.thresholds.fall
    }

    /// Feeds one sample taken at `now`; returns the route change it causes, if any.
    pub fn observe(&mut self, stream: Stream, sample: Sample, now: Instant) -> Option<Transition> {
        match stream {
            Stream::CacheUdp => self.cache_udp.record(sample),
            Stream::CacheTcp => self.cache_tcp.record(sample),
            Stream::Upstream => self.upstream.record(sample),
        }
        // A refusal means "nothing listens": an answer on the other transport since proves it
        // stale. (A transport that keeps failing still trips `fall` on its own.)
        if sample == Sample::Good && stream != Stream::Upstream {
            for streak in [&mut self.cache_udp, &mut self.cache_tcp] {
                streak.refused = false;
                streak.stalled = None;
            }
        }
        if let Some(forced) = &self.forced {
            // A drain ends when the drained cache is gone — refused, or `fall` failures in a row
            // (one slow answer under load is not an exit) — and from then on the new cache
            // earns its way back with `rise` good probes and `min_hold`, counted from here.
            let streak = self.streak(stream);
            let gone = sample == Sample::Refused || streak.bad >= self.thresholds.fall;
            if forced.kind == ForceKind::Drain && stream != Stream::Upstream && gone {
                self.forced = None;
                self.since = now;
                self.reason = Reason::DrainEnded;
            }
            return None;
        }
        let reason = self.decide(now)?;
        Some(self.switch(self.route.other(), reason, now))
    }

    fn why_leave_local(&mut self) -> Option<Reason> {
        if let Some(why) = &self.blocked {
            return Some(Reason::PathBlocked(why.clone()));
        }
        let failing = [(Stream::CacheUdp, self.cache_udp), (Stream::CacheTcp, self.cache_tcp)]
            .into_iter()
            .find_map(|(stream, s)| {
                if s.refused {
                    Some(Reason::CacheRefused(stream))
                } else if let Some(stall) = s.stalled {
                    Some(Reason::CacheStalled(stall))
                } else if s.bad >= self.thresholds.fall {
                    Some(Reason::CacheFailing {
                        stream,
                        count: s.bad,
                        last: s.last_bad.unwrap_or("bad"),
                    })
                } else {
                    None
                }
            });
        let Some(reason) = failing else {
            self.held = None;
            return None;
        };
        if self.upstream_failing() {
            self.held = Some(Hold::Local {
                cache: reason,
                upstream_failed: self.upstream.bad,
                upstream_last: self.upstream.last_bad.unwrap_or("bad"),
            });
            return None;
        }
        Some(reason)
    }

    fn why_return_local(&mut self, now: Instant) -> Option<Reason> {
        if self.blocked.is_some() {
            return None;
        }
        let count = self.cache_udp.good;
        let recovered = count >= self.thresholds.rise && self.cache_tcp.bad == 0;
        if self.upstream_failing() {
            if recovered {
                return Some(Reason::CacheRecoveredUpstreamFailing { count });
            }
            self.held = Some(Hold::Upstream {
                upstream_failed: self.upstream.bad,
                upstream_last: self.upstream.last_bad.unwrap_or("bad"),
                rise: self.thresholds.rise,
            });
            return None;
        }
        self.held = None;
        if !recovered || now.duration_since(self.since) < self.thresholds.min_hold {
            return None;
        }
        Some(Reason::CacheRecovered { count })
    }
}

#[cfg(test)]
mod tests;
