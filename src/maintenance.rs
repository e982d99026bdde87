//! Operators' hands on the agent: manual flips and drains.
//!
//! Requests arrive over the control socket ([`crate::control`]); [`handle`] applies them to the
//! [`Agent`] and persists the override so it survives a restart. A drain answers later, once the
//! cache has gone quiet ([`Drain::progress`]). The transition hook is [`crate::hooks`].

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::agent::Agent;
use crate::blocking::blocking;
use crate::control::{Incoming, Request, Response};
use crate::health::{ForceKind, Forced};
use crate::overrides::{self, Moment, Override, DRAIN_HOLD_MAX};
use crate::ruleset::{Route, DNS_PORT};
use crate::sockdiag;

/// Reply counters unchanged for this many checks in a row: the cache has gone quiet.
const QUIET_CHECKS: u32 = 3;

/// A drain waiting for the cache to go quiet.
pub struct Drain {
    reply: oneshot::Sender<Response>,
    started: Instant,
    deadline: Instant,
    last: Option<u64>,
    quiet: u32,
}

impl Drain {
    /// Checks the reply counters once (call it every tick); answers the requester and returns
    /// `None` when done.
    pub fn progress(mut self, agent: &mut Agent, now: Instant) -> Option<Drain> {
        let waited = now.saturating_duration_since(self.started);
        if agent.route() != Route::Upstream {
            let message = format!(
                "drain interrupted after {waited:.1?}: the route is {} again",
                agent.route()
            );
            let _ = self.reply.send(Response::Error { message });
            return None;
        }
        // Quiet counts only once the upstream ruleset is really in, and counters were read.
        match (agent.is_dirty(), agent.reply_packets()) {
            (false, Ok(None)) => {
                let message = "route is upstream; this dataplane cannot count the cache's replies";
                let _ = self.reply.send(Response::ok(message));
                return None;
            }
            (false, Ok(Some(count))) if self.last == Some(count) => self.quiet += 1,
            (false, Ok(Some(count))) => {
                self.last = Some(count);
                self.quiet = 0;
            }
            (true, _) => self.quiet = 0,
            (false, Err(e)) => {
                warn!(error = %e, "reading the reply counters failed");
                self.quiet = 0;
            }
        }
        let message = if self.quiet >= QUIET_CHECKS {
            format!("route is upstream and the cache has gone quiet (after {waited:.1?})")
        } else if now < self.deadline {
            return Some(self);
        } else if agent.is_dirty() {
            let message =
                format!("timed out after {waited:.1?}: the upstream ruleset is not installed yet");
            let _ = self.reply.send(Response::Error { message });
            return None;
        } else {
            format!("route is upstream; the cache still answered after {waited:.1?} (timed out)")
        };
        info!(waited = ?waited, quiet = self.quiet >= QUIET_CHECKS, "drain done");
        let _ = self.reply.send(Response::ok(message));
        None
    }
}

/// The cookies of the sockets the cache serves on now (its listen addresses, port 53), for a
/// drain to wait for; `None`, said in the log, when they cannot be listed.
fn cache_sockets(agent: &Agent) -> Option<Vec<u64>> {
    match sockdiag::listeners(&agent.listen_ips(), DNS_PORT) {
        Ok(found) => Some(found.iter().map(|l| l.cookie).collect()),
        Err(e) => {
            warn!(error = %e, "cannot list the cache's sockets; only failed probes will end the drain");
            None
        }
    }
}

/// Ends a drain whose cache is gone: one of the sockets the drained cache served on when the
/// drain began is closed (or it served on none). Whether a new cache answers already does not
/// matter; nor whether this agent was running when the old one went. Call it on every tick; it
/// lists sockets only while a drain that knows its sockets is in force.
pub fn end_drain_if_its_cache_is_gone(agent: &mut Agent, now: Instant) {
    let Some(waits_for) =
        agent.forced().filter(|f| f.kind == ForceKind::Drain).and_then(|f| f.waits_for.clone())
    else {
        return;
    };
    let open = match blocking(|| sockdiag::listeners(&agent.listen_ips(), DNS_PORT)) {
        Ok(found) => found.iter().map(|l| l.cookie).collect::<Vec<_>>(),
        Err(e) => {
            debug!(error = %e, "cannot list the cache's sockets; the drain goes on");
            return;
        }
    };
    let closed = waits_for.iter().filter(|c| !open.contains(c)).count();
    if waits_for.is_empty() || closed > 0 {
        let why = format!(
            "{closed} of the {} sockets the drained cache served on are closed",
            waits_for.len()
        );
        agent.end_drain(&why, now);
    }
}

/// Applies one control request; a drain is left in `drain`, to answer later.
pub fn handle(
    agent: &mut Agent,
    dir: &Path,
    incoming: Incoming,
    drain: &mut Option<Drain>,
    now: Instant,
) {
    let Incoming { request, peer, reply } = incoming;
    let moment = Moment { now, wall: SystemTime::now() };
    let who = peer.to_string();
    let record = |o: Override| {
        overrides::write(dir, &o).map_err(|e| {
            format!("the route is forced, but recording it in {} failed: {e}", dir.display())
        })
    };
    let response = match request {
        Request::Flip { route, for_ms, reason } => {
            let until = for_ms.map(|ms| now + Duration::from_millis(ms));
            let why = if reason.is_empty() { format!("by {who}") } else { reason.clone() };
            let warning = match route {
                Route::Local => {
                    agent.cache_failing().map(|f| format!("; WARNING: the cache is failing ({f})"))
                }
                Route::Upstream => None,
            };
            let forced =
                Forced { route, kind: ForceKind::Manual, until, why: why.clone(), waits_for: None };
            agent.force(forced, now);
            let until_unix_ms = until.map(|u| moment.unix_ms_at(u));
            match record(Override::manual(route, until_unix_ms, why, who, moment.unix_ms())) {
                Ok(()) => {
                    let until = for_ms.map_or(" until released".to_owned(), |ms| {
                        format!(" for {:?}", Duration::from_millis(ms))
                    });
                    Response::Ok {
                        message: format!(
                            "route forced to {route}{until}{}",
                            warning.unwrap_or_default()
                        ),
                    }
                }
                Err(message) => Response::Error { message },
            }
        }
        Request::Release => {
            agent.release(now);
            match overrides::clear(dir) {
                Ok(()) => {
                    Response::Ok { message: format!("automatic again; route is {}", agent.route()) }
                }
                Err(e) => Response::Error {
                    message: format!("released, but removing the override file failed: {e}"),
                },
            }
        }
        Request::Drain { timeout_ms } => {
            let manual = agent.forced().filter(|f| f.kind == ForceKind::Manual).map(|f| f.route);
            if drain.is_some() {
                Response::error("a drain is already running")
            } else if manual == Some(Route::Local) {
                Response::error("a manual override forces the route to local: release it first")
            } else {
                // Already on the upstream by hand: keep that override, just wait for quiet.
                if manual.is_none() {
                    let why = format!("drain requested by {who}");
                    let until = Some(now + DRAIN_HOLD_MAX);
                    // What the drain waits for: the sockets the cache serves on now.
                    let waits_for = cache_sockets(agent);
                    let sockets = waits_for.clone();
                    let forced = Forced {
                        route: Route::Upstream,
                        kind: ForceKind::Drain,
                        until,
                        why,
                        waits_for,
                    };
                    let o = Override::drain(forced.why.clone(), who, sockets, moment.unix_ms());
                    if let Err(message) = record(o) {
                        warn!(error = %message, "drain not persisted");
                    }
                    agent.force(forced, now);
                }
                let deadline = now + Duration::from_millis(timeout_ms);
                *drain = Some(Drain { reply, started: now, deadline, last: None, quiet: 0 });
                return;
            }
        }
        Request::Status => match serde_json::to_string(&agent.state(now, moment.wall)) {
            Ok(message) => Response::Ok { message },
            Err(e) => Response::Error { message: e.to_string() },
        },
    };
    let _ = reply.send(response);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{test_raw, AgentConfig, RawRun};
    use crate::control::Peer;
    use crate::dataplane::fake::FakeDataplane;
    use crate::metrics::Metrics;
    use std::path::PathBuf;
    use std::sync::Arc;

    fn agent(fake: &FakeDataplane, t0: Instant) -> Agent {
        let raw = RawRun { state_dir: "/nonexistent".into(), ..test_raw() };
        let cfg = AgentConfig::from_args(&raw, |_| None).unwrap();
        let metrics = Arc::new(Metrics::new());
        Agent::start(&cfg, Box::new(fake.clone()), metrics, None, None, Vec::new(), t0).unwrap()
    }

    /// A drain begun at `t0` with `timeout`, as [`handle`] begins one (the route forced to
    /// `Upstream`), and where its answer arrives.
    fn drain(agent: &mut Agent, t0: Instant, timeout: Duration) -> (Drain, Receiver) {
        let forced = Forced {
            route: Route::Upstream,
            kind: ForceKind::Drain,
            until: Some(t0 + DRAIN_HOLD_MAX),
            why: "drain".into(),
            waits_for: None,
        };
        agent.force(forced, t0);
        let (reply, answer) = oneshot::channel();
        (Drain { reply, started: t0, deadline: t0 + timeout, last: None, quiet: 0 }, answer)
    }

    type Receiver = oneshot::Receiver<Response>;

    /// Ticks `drain` every 100 ms from `t0` until it answers; the answer and the ticks it took.
    /// `each` runs before every tick.
    fn tick_until_done(
        mut drain: Drain,
        agent: &mut Agent,
        t0: Instant,
        mut answer: Receiver,
        mut each: impl FnMut(u32),
    ) -> (Response, u32) {
        for n in 1..=1000 {
            each(n);
            match drain.progress(agent, t0 + Duration::from_millis(100) * n) {
                Some(going_on) => drain = going_on,
                None => return (answer.try_recv().expect("a drain that ends answers"), n),
            }
        }
        panic!("the drain never ended");
    }

    fn message(response: &Response) -> &str {
        match response {
            Response::Ok { message } | Response::Error { message } => message,
        }
    }

    #[test]
    fn a_drain_ends_once_the_reply_counters_stand_still_for_three_ticks() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let (d, answer) = drain(&mut agent, t0, Duration::from_secs(5));
        // The cache answers for 4 ticks, then goes quiet.
        let counts = |n: u32| fake.kernel().replies = Some(u64::from(n.min(4)) * 10);
        let (response, ticks) = tick_until_done(d, &mut agent, t0, answer, counts);
        assert!(matches!(response, Response::Ok { .. }), "{response:?}");
        assert!(message(&response).contains("gone quiet"), "{response:?}");
        // The count first seen still at tick 4, then unchanged at 5, 6 and 7.
        assert_eq!(ticks, 4 + QUIET_CHECKS);
        assert_eq!(agent.route(), Route::Upstream);
    }

    #[test]
    fn a_drain_that_cannot_count_answers_at_once() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let (d, answer) = drain(&mut agent, t0, Duration::from_secs(5));
        let (response, ticks) = tick_until_done(d, &mut agent, t0, answer, |_| {});
        assert_eq!(ticks, 1);
        assert!(message(&response).contains("cannot count"), "{response:?}");
        assert!(matches!(response, Response::Ok { .. }));
    }

    #[test]
    fn a_drain_times_out_while_the_cache_still_answers() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let (d, answer) = drain(&mut agent, t0, Duration::from_secs(1));
        let counts = |n: u32| fake.kernel().replies = Some(u64::from(n));
        let (response, ticks) = tick_until_done(d, &mut agent, t0, answer, counts);
        // The tick at the deadline (10 × 100 ms) answers: the route is in, the cache not quiet.
        assert_eq!(ticks, 10);
        assert!(matches!(response, Response::Ok { .. }), "{response:?}");
        assert!(message(&response).contains("still answered"), "{response:?}");
    }

    #[test]
    fn a_drain_whose_ruleset_is_not_in_fails_at_its_deadline() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        fake.kernel().replies = Some(7);
        fake.kernel().fail_applies = 1000;
        let (d, answer) = drain(&mut agent, t0, Duration::from_secs(1));
        assert!(agent.is_dirty());
        // Unchanged counters do not count as quiet while the ruleset is not in.
        let (response, ticks) = tick_until_done(d, &mut agent, t0, answer, |_| {});
        assert_eq!(ticks, 10);
        assert!(matches!(response, Response::Error { .. }), "{response:?}");
        assert!(message(&response).contains("not installed yet"), "{response:?}");
    }

    #[test]
    fn a_drain_is_interrupted_when_the_route_leaves_upstream() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        fake.kernel().replies = Some(7);
        let mut agent = agent(&fake, t0);
        let (d, answer) = drain(&mut agent, t0, Duration::from_secs(5));
        let d = d.progress(&mut agent, t0).expect("going on");
        // An operator forces `Local` meanwhile.
        let local = Forced {
            route: Route::Local,
            kind: ForceKind::Manual,
            until: None,
            why: "test".into(),
            waits_for: None,
        };
        agent.force(local, t0);
        assert_eq!(agent.route(), Route::Local);
        let (response, ticks) = tick_until_done(d, &mut agent, t0, answer, |_| {});
        assert_eq!(ticks, 1);
        assert!(matches!(response, Response::Error { .. }), "{response:?}");
        assert!(message(&response).contains("drain interrupted"), "{response:?}");
    }

    /// One request through [`handle`], from `uid 0 pid 7`; where its answer arrives (a drain's
    /// later, from the [`Drain`] left in `drain`).
    fn send(
        agent: &mut Agent,
        dir: &Path,
        request: Request,
        drain: &mut Option<Drain>,
        now: Instant,
    ) -> Receiver {
        let (reply, answer) = oneshot::channel();
        let peer = Peer { uid: 0, gid: 0, pid: Some(7) };
        handle(agent, dir, Incoming { request, peer, reply }, drain, now);
        answer
    }

    /// One request through [`handle`]; its answer, if it has one yet.
    fn request(
        agent: &mut Agent,
        dir: &Path,
        request: Request,
        drain: &mut Option<Drain>,
        now: Instant,
    ) -> Option<Response> {
        send(agent, dir, request, drain, now).try_recv().ok()
    }

    /// A state directory of the test's own.
    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nlha-maint-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_flip_forces_and_records_the_route_and_a_release_ends_both() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let dir = dir("flip");
        let mut drain = None;
        let flip = Request::Flip { route: Route::Upstream, for_ms: Some(2000), reason: "".into() };
        let response = request(&mut agent, &dir, flip, &mut drain, t0).expect("an answer");
        assert_eq!(response, Response::ok("route forced to upstream for 2s"));
        assert_eq!(agent.route(), Route::Upstream);
        let recorded = overrides::read(&dir).unwrap().expect("recorded");
        assert_eq!((recorded.route, recorded.kind), (Route::Upstream, ForceKind::Manual));
        assert_eq!(recorded.set_by, "uid 0 pid 7");
        assert_eq!(recorded.reason, "by uid 0 pid 7");
        assert_eq!(recorded.until_unix_ms, Some(recorded.set_unix_ms + 2000));
        // Forced: failing probes or not, the route stays until the override ends.
        let forced = agent.forced().expect("forced");
        assert_eq!(forced.until, Some(t0 + Duration::from_secs(2)));

        let response = request(&mut agent, &dir, Request::Release, &mut drain, t0).unwrap();
        assert_eq!(response, Response::ok("automatic again; route is upstream"));
        assert!(agent.forced().is_none());
        assert_eq!(overrides::read(&dir).unwrap(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn what_handle_records_is_what_the_constructors_build() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let dir = dir("constructors");
        let flip = Request::Flip { route: Route::Local, for_ms: Some(1500), reason: "ops".into() };
        request(&mut agent, &dir, flip, &mut None, t0).expect("an answer");
        let recorded = overrides::read(&dir).unwrap().expect("recorded");
        let set = recorded.set_unix_ms;
        let who = "uid 0 pid 7".to_owned();
        let built =
            Override::manual(Route::Local, Some(set + 1500), "ops".into(), who.clone(), set);
        assert_eq!(recorded, built);
        // Read back at once, it forces what was forced.
        let forced = agent.forced().cloned();
        assert_eq!(recorded.forced(Moment { now: t0, wall: wall_at(set) }), forced);

        request(&mut agent, &dir, Request::Release, &mut None, t0).expect("an answer");
        let mut drain = None;
        let _answer = send(&mut agent, &dir, Request::Drain { timeout_ms: 5000 }, &mut drain, t0);
        let recorded = overrides::read(&dir).unwrap().expect("recorded");
        let set = recorded.set_unix_ms;
        let sockets = recorded.drained_sockets.clone();
        let why = "drain requested by uid 0 pid 7".to_owned();
        assert_eq!(recorded, Override::drain(why, who, sockets, set));
        let forced = agent.forced().cloned();
        assert_eq!(recorded.forced(Moment { now: t0, wall: wall_at(set) }), forced);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The wall-clock time `unix_ms` milliseconds after the epoch.
    fn wall_at(unix_ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(unix_ms)
    }

    #[test]
    fn forcing_local_on_a_failing_cache_warns() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let refused = crate::probe::Report {
            stream: crate::health::Stream::CacheUdp,
            result: crate::probe::ProbeResult {
                outcome: crate::probe::Outcome::Refused,
                latency: Duration::from_millis(1),
            },
        };
        agent.on_probe(&refused, t0);
        let dir = dir("warn");
        let flip = Request::Flip { route: Route::Local, for_ms: None, reason: "test".into() };
        let response = request(&mut agent, &dir, flip, &mut None, t0).unwrap();
        let text = message(&response);
        assert!(text.starts_with("route forced to local until released; WARNING: the cache is failing (1 consecutive probes failed"), "{text}");
        assert_eq!(agent.route(), Route::Local);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_drain_is_refused_while_one_runs_or_local_is_forced() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let dir = dir("refuse");
        let (running, _answer) = drain(&mut agent, t0, Duration::from_secs(5));
        let mut current = Some(running);
        let ask = Request::Drain { timeout_ms: 1000 };
        let response = request(&mut agent, &dir, ask.clone(), &mut current, t0).unwrap();
        assert_eq!(response, Response::error("a drain is already running"));
        assert!(current.is_some(), "the running drain goes on");

        let flip = Request::Flip { route: Route::Local, for_ms: None, reason: "test".into() };
        request(&mut agent, &dir, flip, &mut None, t0).unwrap();
        let mut none = None;
        let response = request(&mut agent, &dir, ask, &mut none, t0).unwrap();
        assert!(message(&response).contains("release it first"), "{response:?}");
        assert!(none.is_none());
        assert_eq!(agent.route(), Route::Local);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_drain_forces_upstream_records_itself_and_answers_once_quiet() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        fake.kernel().replies = Some(5);
        let mut agent = agent(&fake, t0);
        let dir = dir("drain");
        let mut drain = None;
        let ask = Request::Drain { timeout_ms: 5000 };
        let mut answer = send(&mut agent, &dir, ask, &mut drain, t0);
        assert!(answer.try_recv().is_err(), "a drain answers once the cache is quiet");
        assert_eq!(agent.route(), Route::Upstream);
        let forced = agent.forced().expect("forced").clone();
        assert_eq!((forced.kind, forced.until), (ForceKind::Drain, Some(t0 + DRAIN_HOLD_MAX)));
        assert_eq!(forced.why, "drain requested by uid 0 pid 7");
        // Recorded as forced, for an agent that restarts meanwhile.
        let recorded = overrides::read(&dir).unwrap().expect("recorded");
        assert_eq!((recorded.route, recorded.kind), (Route::Upstream, ForceKind::Drain));
        assert_eq!(
            (recorded.reason.as_str(), recorded.set_by.as_str()),
            (forced.why.as_str(), "uid 0 pid 7")
        );
        let limit = u64::try_from(DRAIN_HOLD_MAX.as_millis()).unwrap();
        assert_eq!(recorded.until_unix_ms, Some(recorded.set_unix_ms + limit));
        assert_eq!(recorded.drained_sockets, forced.waits_for);
        // The counters stand still from the first tick on.
        let d = drain.take().expect("the drain waits");
        let (response, ticks) = tick_until_done(d, &mut agent, t0, answer, |_| {});
        assert_eq!(ticks, 1 + QUIET_CHECKS);
        assert!(message(&response).contains("gone quiet"), "{response:?}");
        assert_eq!(agent.forced().map(|f| f.kind), Some(ForceKind::Drain), "held after the answer");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_drain_keeps_a_manual_flip_upstream() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        fake.kernel().replies = Some(5);
        let mut agent = agent(&fake, t0);
        let dir = dir("drain-manual");
        let flip = Request::Flip { route: Route::Upstream, for_ms: None, reason: "ops".into() };
        request(&mut agent, &dir, flip, &mut None, t0).expect("an answer");
        let manual = agent.forced().cloned();
        let recorded = overrides::read(&dir).unwrap();
        let mut drain = None;
        let answer = send(&mut agent, &dir, Request::Drain { timeout_ms: 5000 }, &mut drain, t0);
        // The operator's override stands, in the agent and on disk; the drain only waits.
        assert_eq!(agent.forced().cloned(), manual);
        assert_eq!(overrides::read(&dir).unwrap(), recorded);
        let d = drain.take().expect("the drain waits");
        let (response, _) = tick_until_done(d, &mut agent, t0, answer, |_| {});
        assert!(message(&response).contains("gone quiet"), "{response:?}");
        assert_eq!(agent.forced().cloned(), manual);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_drain_that_cannot_be_recorded_goes_on() {
        let t0 = Instant::now();
        let fake = FakeDataplane::default();
        let mut agent = agent(&fake, t0);
        let nowhere = Path::new("/nonexistent/state");
        let mut drain = None;
        let answer = send(&mut agent, nowhere, Request::Drain { timeout_ms: 5000 }, &mut drain, t0);
        assert_eq!(agent.route(), Route::Upstream);
        assert_eq!(agent.forced().map(|f| f.kind), Some(ForceKind::Drain));
        let d = drain.take().expect("the drain waits");
        let (response, _) = tick_until_done(d, &mut agent, t0, answer, |_| {});
        assert!(matches!(response, Response::Ok { .. }), "{response:?}");
    }

    #[test]
    fn status_answers_the_state_as_json() {
        let t0 = Instant::now();
        let mut agent = agent(&FakeDataplane::default(), t0);
        let response =
            request(&mut agent, Path::new("/nonexistent"), Request::Status, &mut None, t0);
        let text = message(response.as_ref().unwrap()).to_owned();
        let state: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(state["route"], "local", "{text}");
        assert_eq!(state["dataplane"], "fake", "{text}");
    }
}
