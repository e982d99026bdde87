//! What the agent tells the cluster, decided from its state alone (pure): the node condition
//! [`CONDITION`] and an Event for the route changes since the last report.

use crate::ruleset::Route;
use crate::state::State;

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

/// Why the startup taint stays on the node, as `state` says; `None`: it may go. It goes once the
/// cache has answered a probe, the ruleset of route Local is in, and nothing is held: a node
/// whose pods' DNS works through its cache.
pub fn taint_kept(state: &State) -> Option<String> {
    if state.probes.cache_udp.good == 0 {
        return Some("the cache has not answered a probe yet".into());
    }
    if let Some(error) = &state.last_error {
        return Some(format!("the ruleset is not in: {error}"));
    }
    if state.route != Route::Local || state.held.is_some() {
        return Some(format!("the cache does not serve: {}", state.reason));
    }
    None
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
    fn the_startup_taint_goes_once_the_cache_answered_and_the_ruleset_is_in() {
        let mut s = state(Route::Local, "start", "started with route local", None, 0);
        assert_eq!(taint_kept(&s).as_deref(), Some("the cache has not answered a probe yet"));
        s.probes.cache_udp.good = 1;
        assert_eq!(taint_kept(&s), None);
        s.last_error = Some("iptables-restore: lock".into());
        assert!(taint_kept(&s).unwrap().contains("the ruleset is not in"));
        s.last_error = None;
        s.route = Route::Upstream;
        s.reason = "cache udp probe refused".into();
        assert!(taint_kept(&s).unwrap().contains("cache udp probe refused"));
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
