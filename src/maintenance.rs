//! Operators' hands on the agent: manual flips, drains, and the transition hook.
//!
//! Requests arrive over the control socket ([`crate::control`]); [`handle`] applies them to the
//! [`Agent`] and persists the override so it survives a restart. A drain answers later, once the
//! cache has gone quiet ([`Drain::progress`]). [`run_hook`] tells an external program (a CNI
//! agent, say) about every route change without ever holding the switch up.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::agent::Agent;
use crate::control::{self, Incoming, Override, OverrideKind, Request, Response};
use crate::health::{ForceKind, Forced, Transition};
use crate::metrics::Metrics;
use crate::ruleset::{Route, DNS_PORT};
use crate::sockdiag;
use crate::state;

/// How long a drain holds `Upstream` at most if the drained cache never goes away.
pub const DRAIN_HOLD_MAX: Duration = Duration::from_secs(600);
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

/// Instant `at` on the wall clock, given that `now` and `wall` are the same moment.
fn unix_ms_at(at: Instant, now: Instant, wall: SystemTime) -> u64 {
    let wall_at = if at >= now { wall + (at - now) } else { wall - (now - at) };
    state::unix_ms(wall_at)
}

/// The forced route an override file describes, or `None` when it has expired.
pub fn forced_from(o: &Override, now: Instant, wall: SystemTime) -> Option<Forced> {
    let now_ms = state::unix_ms(wall);
    if o.expired(now_ms) {
        return None;
    }
    let until = o.until_unix_ms.map(|ms| now + Duration::from_millis(ms.saturating_sub(now_ms)));
    let waits_for = o.drained_sockets.clone();
    Some(Forced { route: o.route, kind: o.kind, until, why: o.reason.clone(), waits_for })
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
    let open = match sockdiag::listeners(&agent.listen_ips(), DNS_PORT) {
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
    let wall = SystemTime::now();
    let who = peer.to_string();
    let record = |route, kind, until: Option<Instant>, reason: &str, sockets: Option<Vec<u64>>| {
        let o = Override {
            version: control::OVERRIDE_VERSION,
            route,
            until_unix_ms: until.map(|u| unix_ms_at(u, now, wall)),
            reason: reason.to_owned(),
            set_by: who.clone(),
            set_unix_ms: state::unix_ms(wall),
            kind,
            drained_sockets: sockets,
        };
        control::write_override(dir, &o).map_err(|e| {
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
            match record(route, OverrideKind::Manual, until, &why, None) {
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
            match control::clear_override(dir) {
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
                    if let Err(message) =
                        record(Route::Upstream, OverrideKind::Drain, until, &forced.why, sockets)
                    {
                        warn!(error = %message, "drain not persisted");
                    }
                    agent.force(forced, now);
                }
                let deadline = now + Duration::from_millis(timeout_ms);
                *drain = Some(Drain { reply, started: now, deadline, last: None, quiet: 0 });
                return;
            }
        }
        Request::Status => match serde_json::to_string(&agent.state(now, wall)) {
            Ok(message) => Response::Ok { message },
            Err(e) => Response::Error { message: e.to_string() },
        },
    };
    let _ = reply.send(response);
}

/// Runs the transition hook for each change from `changes`, one at a time and in order, each
/// bounded by `timeout`; never ends (the agent treats a task that ends as dead).
pub async fn run_hooks(
    path: PathBuf,
    mut changes: tokio::sync::mpsc::Receiver<(Transition, u64)>,
    timeout: Duration,
    metrics: Arc<Metrics>,
) {
    while let Some((t, at_unix_ms)) = changes.recv().await {
        let result = run_hook(&path, &t, at_unix_ms, timeout).await;
        metrics.hook(result);
    }
    std::future::pending().await
}

/// Runs the hook once; `ok`, `failed` or `timeout`. The program gets the change in its
/// environment: `NODELOCALDNS_HA_FROM`, `_TO`, `_REASON`, `_REASON_KIND`, `_UNIX_MS` (when the
/// route changed). It runs in its own process group, all of which is killed on timeout; its
/// output is discarded (the agent's log stays one event per line).
async fn run_hook(path: &Path, t: &Transition, at_unix_ms: u64, timeout: Duration) -> &'static str {
    let mut command = tokio::process::Command::new(path);
    command
        .env("NODELOCALDNS_HA_FROM", t.from.as_str())
        .env("NODELOCALDNS_HA_TO", t.to.as_str())
        .env("NODELOCALDNS_HA_REASON", t.reason.to_string())
        .env("NODELOCALDNS_HA_REASON_KIND", t.reason.kind())
        .env("NODELOCALDNS_HA_UNIX_MS", at_unix_ms.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            warn!(hook = %path.display(), error = %e, "transition hook could not start");
            return "failed";
        }
    };
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) if status.success() => "ok",
        Ok(Ok(status)) => {
            warn!(hook = %path.display(), %status, "transition hook failed");
            "failed"
        }
        Ok(Err(e)) => {
            warn!(hook = %path.display(), error = %e, "transition hook failed");
            "failed"
        }
        Err(_) => {
            warn!(hook = %path.display(), timeout = ?timeout, "transition hook timed out; killed");
            if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) {
                let group = nix::unistd::Pid::from_raw(pid);
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            }
            let _ = child.kill().await;
            "timeout"
        }
    }
}
