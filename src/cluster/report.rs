//! What the agent tells the cluster, decided from its state alone (pure): the node condition
//! [`CONDITION`] and an Event for the route changes since the last report.

use std::time::Duration;

use crate::ruleset::Route;
use crate::state::{StartupTaint, State};

/// The node condition's type.
pub const CONDITION: &str = "NodeLocalDNSReady";

/// The node condition, as patched on the node's status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// `True`: node-local-dns serves the node's pods; `False`: it does not (failed over, held,
    /// forced, draining).
    pub status: &'static str,
    /// CamelCase, as conditions' reasons are.
    pub reason: &'static str,
    pub message: String,
    /// Since when the route is what it is (ms since the epoch): the condition's
    /// `lastTransitionTime`.
    pub since_unix_ms: u64,
}

/// The condition `state` describes.
pub fn condition(state: &State) -> Condition {
    let serving = state.route == Route::Local;
    let status = if serving && state.held.is_none() { "True" } else { "False" };
    let (reason, message) = match (&state.held, state.reason_kind.as_str(), state.route) {
        (Some(held), _, Route::Local) => {
            ("CacheFailingHeld", format!("the cache fails, but so does CoreDNS: {held}"))
        }
        (Some(held), _, Route::Upstream) => {
            ("CoreDNSFailingHeld", format!("CoreDNS fails, but the cache is not back: {held}"))
        }
        (None, "manual", _) => ("ForcedByHand", state.reason.clone()),
        (None, "drain", _) => ("Draining", state.reason.clone()),
        (None, "firewall", _) => ("PathBlocked", state.reason.clone()),
        (None, _, Route::Local) => {
            ("CacheServing", format!("node-local-dns serves: {}", state.reason))
        }
        (None, _, Route::Upstream) => {
            ("FailedOverToCoreDNS", format!("queries go to CoreDNS: {}", state.reason))
        }
    };
    let message = match state.startup_taint.as_ref().filter(|t| t.overdue) {
        Some(taint) => {
            let why = taint.goes.as_deref().unwrap_or("");
            format!("{message}; the startup taint {} was removed: {why}", taint.key)
        }
        None => message,
    };
    let message = message + &foreign_note(state);
    Condition { status, reason, message, since_unix_ms: state.since_unix_ms }
}

/// What others' rules for the cluster-DNS IP mean for the route, said where it matters: those
/// in effect, always (pods stay on the cache whatever the route); those the agent's rules make
/// harmless, on `Upstream` (they would have kept pods on the cache the route left).
fn foreign_note(state: &State) -> String {
    let foreign = state.foreign;
    if foreign.in_effect > 0 {
        format!(
            "; {} NOTRACK rules of others keep pods on the cache whatever the route (run \
             node-cache with -setupiptables=false)",
            foreign.in_effect
        )
    } else if foreign.rules > 0 && state.route == Route::Upstream {
        format!(
            "; node-cache's own rules for the cluster-DNS IP ({}, it runs without \
             -setupiptables=false) overridden by the agent's",
            foreign.rules
        )
    } else {
        String::new()
    }
}

/// An Event on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// `Normal` or `Warning`.
    pub kind: &'static str,
    pub reason: &'static str,
    pub message: String,
    /// How many route changes it stands for (more than one: a flapping cache, reported once).
    pub count: u64,
}

/// The Event for the route changes between `reported` (the transitions counted at the last
/// report) and `state`, if there were any: one Event, however many (aggregated, as the event
/// recorder does, so a flapping cache makes no storm).
pub fn event(reported: u64, state: &State) -> Option<Event> {
    let count = state.transitions.checked_sub(reported).filter(|&n| n > 0)?;
    let (kind, reason, what) = match (state.route, state.reason_kind.as_str()) {
        (_, "manual") => ("Normal", "RouteForced", "node-local DNS route forced"),
        (_, "drain") => ("Normal", "Draining", "node-local DNS draining the cache"),
        (Route::Upstream, _) => {
            ("Warning", "FailedOverToCoreDNS", "node-local DNS failed over to CoreDNS")
        }
        (Route::Local, _) => ("Normal", "BackToCache", "node-local DNS back to the cache"),
    };
    let message = match count {
        1 => format!("{what}: {}", state.reason),
        n => format!("{what} ({n} route changes since the last report): {}", state.reason),
    } + &foreign_note(state);
    Some(Event { kind, reason, message, count })
}

/// Whether `key` is a taint key Kubernetes takes: an optional prefix and `/`, then a name of at
/// most 63 characters of letters, digits, `.`, `_` and `-`, alphanumeric at both ends.
pub fn is_taint_key(key: &str) -> bool {
    let name = key.rsplit('/').next().unwrap_or(key);
    let inner = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    let ends = name.chars().next().zip(name.chars().last());
    !name.is_empty()
        && name.len() <= 63
        && name.chars().all(inner)
        && ends.is_some_and(|(a, b)| a.is_ascii_alphanumeric() && b.is_ascii_alphanumeric())
        && key.matches('/').count() <= 1
}

/// Whether pods on the node have DNS, as `state` says: why (`Ok`), or why not (`Err`). They
/// have once the ruleset of the route is in, nothing is held, and the route's resolver answers:
/// the cache on `Local` (it has answered a probe), CoreDNS on `Upstream` (its last probe was
/// answered: the fallback reaches it).
pub fn dns_on_node(state: &State) -> Result<&'static str, String> {
    if let Some(error) = &state.last_error {
        return Err(format!("the ruleset is not in: {error}"));
    }
    if let Some(held) = &state.held {
        return Err(format!("neither the cache nor CoreDNS answers: {held}"));
    }
    match state.route {
        Route::Local if state.probes.cache_udp.good > 0 => Ok("the cache answers"),
        Route::Local => Err("the cache has not answered a probe yet".into()),
        Route::Upstream if state.probes.upstream.streak_good > 0 => {
            Ok("the fallback to CoreDNS is in and CoreDNS answers")
        }
        Route::Upstream => Err(format!(
            "the cache does not serve ({}) and CoreDNS has not answered a probe yet",
            state.reason
        )),
    }
}

/// The startup taint `key` as `state` and the time decide, `up_for` after the agent started:
/// it goes once pods on the node have DNS ([`dns_on_node`]), or once `bound` has passed
/// whatever DNS does (an agent that cannot get there must not keep its node unschedulable),
/// then `overdue` (the route's reason, in the condition, says what is wrong).
pub fn startup_taint(
    key: String,
    state: &State,
    up_for: Duration,
    bound: Duration,
) -> StartupTaint {
    let (kept, goes, overdue) = match dns_on_node(state) {
        Ok(why) => (None, Some(why.to_owned()), false),
        Err(_) if up_for >= bound => {
            let goes = format!("no DNS on the node within --startup-taint-timeout {bound:?}");
            (None, Some(goes), true)
        }
        Err(why) => (Some(why), None, false),
    };
    StartupTaint { key, kept, goes, overdue }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(
        route: Route,
        kind: &str,
        reason: &str,
        held: Option<&str>,
        transitions: u64,
    ) -> State {
        let mut s: State = serde_json::from_value(serde_json::json!({
            "version": 1, "pid": 1, "updated_unix_ms": 5, "dataplane": "nftables",
            "route": "local", "since_unix_ms": 3, "reason": "", "held": null, "transitions": 0,
            "repairs": 0, "last_error": null,
            "probes": crate::state::Probes::default(),
        }))
        .expect("a state");
        s.route = route;
        s.reason_kind = kind.into();
        s.reason = reason.into();
        s.held = held.map(Into::into);
        s.transitions = transitions;
        s
    }

    #[test]
    fn the_condition_says_whether_the_cache_serves_and_why() {
        let cases = [
            (Route::Local, "start", None, "True", "CacheServing"),
            (Route::Local, "cache_recovered", None, "True", "CacheServing"),
            (Route::Upstream, "cache_refused", None, "False", "FailedOverToCoreDNS"),
            (Route::Upstream, "cache_stalled", None, "False", "FailedOverToCoreDNS"),
            (Route::Local, "cache_failing", Some("upstream failed 3"), "False", "CacheFailingHeld"),
            (
                Route::Upstream,
                "cache_refused",
                Some("cache not back"),
                "False",
                "CoreDNSFailingHeld",
            ),
            (Route::Upstream, "manual", None, "False", "ForcedByHand"),
            (Route::Local, "manual", None, "True", "ForcedByHand"),
            (Route::Upstream, "drain", None, "False", "Draining"),
            (Route::Upstream, "firewall", None, "False", "PathBlocked"),
        ];
        for (route, kind, held, status, reason) in cases {
            let c = condition(&state(route, kind, "why", held, 0));
            assert_eq!((c.status, c.reason), (status, reason), "{route:?} {kind} {held:?}");
            assert!(c.message.contains(held.unwrap_or("why")), "{}", c.message);
            assert_eq!(c.since_unix_ms, 3);
        }
    }

    #[test]
    fn others_rules_are_said_where_they_matter() {
        let mut up = state(Route::Upstream, "cache_refused", "cache udp probe refused", None, 1);
        up.foreign = crate::state::Foreign { rules: 18, in_effect: 0 };
        let said = "node-cache's own rules for the cluster-DNS IP (18, it runs without \
                    -setupiptables=false) overridden by the agent's";
        assert!(condition(&up).message.ends_with(said), "{}", condition(&up).message);
        assert!(event(0, &up).unwrap().message.ends_with(said));
        // On Local they change nothing: not said.
        let mut local = state(Route::Local, "cache_recovered", "cache answered 3", None, 2);
        local.foreign = up.foreign;
        assert_eq!(condition(&local).message, "node-local-dns serves: cache answered 3");
        assert_eq!(
            event(1, &local).unwrap().message,
            "node-local DNS back to the cache: cache answered 3"
        );
        // In effect: said on either route.
        local.foreign.in_effect = 4;
        let message = condition(&local).message;
        assert!(message.contains("4 NOTRACK rules of others keep pods on the cache"), "{message}");
    }

    #[test]
    fn the_startup_taint_goes_once_pods_have_dns_or_at_its_bound() {
        let (bound, early, late) =
            (Duration::from_secs(300), Duration::from_secs(10), Duration::from_secs(300));
        let taint = |s: &State, up_for| startup_taint("k".into(), s, up_for, bound);
        let kept = |s: &State| taint(s, early).kept.unwrap_or_default();
        let mut s = state(Route::Local, "start", "started with route local", None, 0);
        assert_eq!(kept(&s), "the cache has not answered a probe yet");
        s.probes.cache_udp.good = 1;
        let goes = taint(&s, early);
        assert_eq!((goes.kept, goes.goes.as_deref()), (None, Some("the cache answers")));
        s.last_error = Some("iptables-restore: lock".into());
        assert!(kept(&s).contains("the ruleset is not in"), "{}", kept(&s));
        s.last_error = None;
        // The cache dead: DNS once CoreDNS answers through the fallback.
        s.route = Route::Upstream;
        s.reason = "cache udp probe refused".into();
        assert!(kept(&s).contains("cache udp probe refused"), "{}", kept(&s));
        assert!(kept(&s).contains("CoreDNS has not answered"), "{}", kept(&s));
        s.probes.upstream.streak_good = 1;
        let goes = taint(&s, early).goes.unwrap();
        assert_eq!(goes, "the fallback to CoreDNS is in and CoreDNS answers");
        // Both fail: held, and kept until the bound, then gone and said.
        s.held = Some("cache not back".into());
        assert!(kept(&s).contains("neither the cache nor CoreDNS answers"), "{}", kept(&s));
        let overdue = taint(&s, late);
        assert!(overdue.overdue && overdue.kept.is_none());
        let goes = overdue.goes.unwrap();
        assert_eq!(goes, "no DNS on the node within --startup-taint-timeout 300s");
        s.startup_taint = Some(taint(&s, late));
        let c = condition(&s);
        let said = "cache not back; the startup taint k was removed: no DNS on the node within";
        assert!(c.message.contains(said), "{}", c.message);
        s.startup_taint = Some(taint(&s, early));
        assert!(!condition(&s).message.contains("startup taint"));
    }

    #[test]
    fn one_event_per_report_however_many_changes() {
        let s = state(Route::Upstream, "cache_refused", "cache udp probe refused", None, 1);
        assert_eq!(event(1, &s), None, "nothing changed since");
        let e = event(0, &s).expect("an event");
        assert_eq!((e.kind, e.reason, e.count), ("Warning", "FailedOverToCoreDNS", 1));
        assert_eq!(e.message, "node-local DNS failed over to CoreDNS: cache udp probe refused");
        let back = state(Route::Local, "cache_recovered", "cache answered 3", None, 2);
        let e = event(1, &back).expect("an event");
        assert_eq!((e.kind, e.reason, e.count), ("Normal", "BackToCache", 1));
        // A flapping cache between two reports: one event, counted.
        let e = event(2, &state(Route::Upstream, "cache_failing", "3 failed", None, 9)).unwrap();
        assert_eq!(e.count, 7);
        assert!(e.message.contains("7 route changes"), "{}", e.message);
    }
}
