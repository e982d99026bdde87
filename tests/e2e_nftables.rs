//! End to end on a simulated node: the real agent on real nftables, unbound as node-local-dns,
//! dnsmasq as CoreDNS behind kube-proxy-shaped DNAT, a glibc-like client in a pod.
//!
//! Each test makes its own namespaces (unique prefix) and removes them, whatever happens.

use std::time::Duration;

use nix::sys::signal::Signal;
use testkit::*;

const POD_SERVER: &str = CLUSTER_DNS_IP;

/// Acceptance 1: SIGKILL under load from a pod loses no lookup; CoreDNS answers until the cache
/// is back, then the cache again.
#[test]
fn cache_sigkill_loses_no_pod_lookup() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    testkit::cache_sigkill_loses_no_pod_lookup(&node, &agent);
}

/// Acceptance 2 (and 5 for a hang): a hung cache (SIGSTOP) moves the route at its `fall`-th
/// failed probe, by the agent's own counts; only queries sent to it before the switch lose their
/// first attempt, from pods and host-network clients alike; after SIGCONT the route returns only
/// after `rise` good probes and `min-hold`. The probes' own bound, the stall watch off: what
/// holds when no traffic shows the hang sooner (`tests/e2e_stall.rs` has it on).
#[test]
fn cache_hang_switches_within_the_probe_bound_and_returns_after_hold() {
    let node = SimNode::up();
    // fall 3 × interval 100 ms + timeout 80 ms = 380 ms; rise 5; min-hold 2 s.
    let agent = node.agent(&["--interval", "100ms", "--timeout", "80ms", "--stall-bound", "0s"]);
    let args = ["--rate", "300", "--duration", "6s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", POD_SERVER, &args);
    let mut host = node.load("node", CLUSTER_DNS_IP, &args);
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }
    let mark = agent.log_mark();
    let stopped_at = node.signal("cache-stop");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    let switch_ms = up["since_unix_ms"].as_u64().unwrap();
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        agent.switch_after(mark, "upstream", "cache udp")
    });
    println!(
        "hung cache detected in {} ms (fall 3 × 100 ms + 80 ms = 380 ms), at failed probe {}",
        switch_ms.saturating_sub(stopped_at),
        switch.failed
    );
    // Judged by the agent's counts, not the clock of a shared machine: the switch comes with the
    // 3rd failed probe of the hung cache (`fall`), neither a probe earlier nor later, and every
    // failure since the stop counted in the streak.
    assert_eq!((switch.good, switch.bad, switch.failed), (0, 3, 3), "{}", switch.line);
    // What the counts cannot see is the probes' pace (interval, timeout): within twice the
    // probe bound, so a pace off by half fails while a loaded machine gets the bound again.
    let detection = switch_ms.saturating_sub(stopped_at);
    assert!(detection < 2 * 380, "detection took {detection} ms: {up}");
    assert!(up["reason"].as_str().unwrap().contains("3 consecutive"), "{up}");

    // Keep it hung until the clients' first attempts to it have timed out (1 s).
    for load in [&mut pod, &mut host] {
        load.wait_line("first attempts lost to the hung cache", Duration::from_secs(5), |l| {
            field(l, "first_attempt_lost").is_some_and(|n| n > 0)
        });
    }
    let resumed_at = node.signal("cache-cont");
    let local = agent.wait_route("local", Duration::from_secs(10));
    let back_ms = local["since_unix_ms"].as_u64().unwrap();
    assert!(back_ms - switch_ms >= 2000, "returned before min-hold: {local}");
    assert!(back_ms >= resumed_at, "returned before the cache resumed");
    assert!(
        local["probes"]["cache_udp"]["streak_good"].as_u64().unwrap() >= 5,
        "returned before rise good probes: {local}"
    );
    for (client, load) in [("pod", pod), ("host", host)] {
        let (summary, lookups) = load.finish_recorded();
        println!("{client}: {summary}");
        assert_eq!(summary["failed"], 0, "{client}: {summary}");
        let lost = sent_at(&summary, "first_attempt_lost_at_ms");
        assert!(!lost.is_empty(), "{client}: no lookup met the hung cache: {summary}");
        // Sent to the hung cache: from the stop (less what it had queued and not yet answered:
        // at most one attempt timeout's worth) until the switch, and none once the client has
        // seen CoreDNS answer.
        let switched = coredns_seen_after(&lookups, stopped_at);
        assert_within(client, &lost, stopped_at - ATTEMPT_TIMEOUT_MS, switched);
    }
}

/// Acceptance 3: a cache answering SERVFAIL fails over when CoreDNS is healthy, and stays when
/// CoreDNS is failing too.
#[test]
fn servfail_cache_fails_over_only_when_coredns_works() {
    let node = SimNode::up();
    let agent = node.agent(&[]);

    // CoreDNS down first: the agent must see the upstream failing.
    node.script(&["coredns-kill"]);
    wait_for("the upstream to be seen failing", Duration::from_secs(10), || {
        agent.state().filter(|s| s["probes"]["upstream"]["streak_bad"].as_u64() >= Some(3))
    });
    node.script(&["cache-kill"]);
    node.script(&["cache-start", "--mode", "servfail"]);
    let held = wait_for("the route to be held", Duration::from_secs(10), || {
        agent
            .state()
            .filter(|s| s["held"].is_string() && s["probes"]["cache_udp"]["last"] == "servfail")
    });
    println!("held: {}", held["held"]);
    assert_eq!(held["route"], "local", "{held}");
    // Many more failing probes later, still local.
    let seen = held["probes"]["cache_udp"]["bad"].as_u64().unwrap();
    let later = wait_for("more probes", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["cache_udp"]["bad"].as_u64() >= Some(seen + 10))
    });
    assert_eq!(later["route"], "local", "moved although CoreDNS is down: {later}");

    // CoreDNS back: the still failing cache is left.
    node.script(&["coredns-start"]);
    let up = agent.wait_route("upstream", Duration::from_secs(10));
    assert!(up["reason"].as_str().unwrap().contains("servfail"), "{up}");
}

/// Acceptance 4: someone deletes or flushes the agent's table; a change notification brings it
/// back, with no tick.
#[test]
fn foreign_changes_to_the_table_are_repaired() {
    let node = SimNode::up();
    // Probes every 60 s, the first at start: no tick comes before `started + 60 s`, so every
    // repair before then came from a change notification (and the count of cache probes, which
    // is the count of ticks, says none ran).
    let started = now_ms();
    let agent = node.agent(&["--interval", "60s", "--timeout", "1s", "--tcp-interval", "0s"]);
    let sent_before = cache_probes_sent(&first_tick_counted(&agent));
    let expected = node.expected_table("local");
    assert_eq!(node.agent_table().as_deref(), Some(expected.as_str()));

    let tampers = [
        vec!["delete", "table", "inet", "nodelocaldns-ha"],
        vec!["flush", "chain", "inet", "nodelocaldns-ha", "prerouting"],
        vec!["add", "rule", "inet", "nodelocaldns-ha", "output", "accept"],
        vec!["flush", "ruleset"],
    ];
    for (i, tamper) in (1..).zip(&tampers) {
        let out = node.run("node", "nft", tamper);
        assert!(out.status.success(), "nft {tamper:?}: {}", describe(&out));
        wait_for(&format!("repair after nft {tamper:?}"), Duration::from_secs(5), || {
            (node.agent_table().as_deref() == Some(expected.as_str())).then_some(())
        });
        let st = agent.wait_repairs(i, Duration::from_secs(5));
        assert_eq!(cache_probes_sent(&st), sent_before, "a tick ran, not a notification: {st}");
    }
    assert!(now_ms() < started + 60_000, "ran past the second tick: the repairs prove nothing");
}

/// Acceptance 5: a host-network client loses lookups only at the instant of a SIGKILL.
#[test]
fn host_network_client_fails_over_on_sigkill_at_once() {
    let node = SimNode::up();
    // Probes every 60 s (the first at start, the next a minute later): a switch within 500 ms of
    // the kill can only come from the socket-destroy event.
    let started = now_ms();
    let agent = node.agent(&["--interval", "60s", "--timeout", "1s", "--tcp-interval", "0s"]);
    let mut load = node.load(
        "node",
        CLUSTER_DNS_IP,
        &["--rate", "500", "--duration", "5s", "--report-interval", "250ms"],
    );
    load.wait_cache_answers();
    let killed_at = node.signal("cache-kill");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    let switch_ms = up["since_unix_ms"].as_u64().unwrap();
    println!("switched {} ms after the kill", switch_ms.saturating_sub(killed_at));
    // A switch before the second tick (checked last) can only come from the event.
    assert!(up["reason"].as_str().unwrap().contains("refused"), "{up}");
    let (summary, lookups) = load.finish_recorded();
    println!("summary: {summary}");
    // Lost only between the kill and the switch: none once the client has seen CoreDNS answer.
    let switched = coredns_seen_after(&lookups, killed_at);
    let failed = sent_at(&summary, "failures_at_ms");
    println!("host lookups failed: {} (all between the kill and the switch)", failed.len());
    // (From one attempt timeout before the kill: a send time is taken just before the send,
    // which a busy machine may delay.)
    assert_within("failed host lookup", &failed, killed_at - ATTEMPT_TIMEOUT_MS, switched);
    assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 0, "{summary}");
    assert!(now_ms() < started + 60_000, "ran past the second tick: the switch proves nothing");
}

/// The cache's probes sent so far (`cache_udp.sent`) in a state.
fn cache_probes_sent(state: &serde_json::Value) -> u64 {
    state["probes"]["cache_udp"]["sent"].as_u64().expect("cache_udp.sent")
}

/// Waits for the probes of the agent's first tick (at start) to be counted; returns the state.
fn first_tick_counted(agent: &Agent) -> serde_json::Value {
    let st = wait_for("the first tick's probes", Duration::from_secs(5), || {
        agent.state().filter(|s| {
            cache_probes_sent(s) >= 1 && s["probes"]["upstream"]["sent"].as_u64() >= Some(1)
        })
    });
    assert_eq!(cache_probes_sent(&st), 1, "more than the first tick's cache probe: {st}");
    st
}

/// Socket-destroy events alone move the route. Probes run every 60 s, the first at start, so
/// no ordinary probe is due before `started + 60 s`: a switch before then, and the one cache
/// probe behind it, can only come from the event that woke the probes. Broken events
/// (`--socket-events false`, or a watch that does not wake the probes) leave the route on
/// `Local` with no probe sent after the kill: this fails every time, not when a tick happens to
/// fall outside a window.
#[test]
fn socket_destroy_event_alone_wakes_the_probes_and_switches() {
    let node = SimNode::up();
    let started = now_ms();
    let agent = node.agent(&["--interval", "60s", "--timeout", "1s", "--tcp-interval", "0s"]);
    let sent_before = cache_probes_sent(&first_tick_counted(&agent));

    let killed_at = node.signal("cache-kill");
    // The woken probe is refused within a round trip; 5 s is slack for a loaded machine, and
    // still far from the next tick.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let st = wait_for("the agent's state", Duration::from_secs(10), || {
        let st = agent.state()?;
        (st["route"] == "upstream" || std::time::Instant::now() >= deadline).then_some(st)
    });
    let woken = cache_probes_sent(&st) - sent_before;
    println!("cache probes sent between the kill and the switch: {woken}");
    assert_eq!(
        st["route"], "upstream",
        "no switch within 5 s of the kill ({woken} cache probes sent since): {st}"
    );
    let switch_ms = st["since_unix_ms"].as_u64().unwrap();
    println!("switched {} ms after the kill", switch_ms.saturating_sub(killed_at));
    assert!(st["reason"].as_str().unwrap().contains("refused"), "{st}");
    // The state is written in the loop's turn that switched: exactly the probe the event woke.
    assert_eq!(woken, 1, "not one woken probe behind the switch: {st}");
    assert!(now_ms() < started + 60_000, "ran past the second tick: the switch proves nothing");
}

/// The kernel fast path alone fails pods over. With socket events off and probes every 60 s the
/// agent cannot notice the cache's SIGKILL (no probe is due before `started + 60 s`): the route
/// stays `Local` and no cache probe is sent, yet no pod lookup fails, CoreDNS answers while the
/// cache is dead and the cache again once it is back, and only queries already queued in the
/// dying cache lose their first attempt. Without the fast path (`--fast-path false`) every pod
/// query meets the dead cache's address and is refused twice: red every time.
#[test]
fn cache_sigkill_fast_path_alone_fails_pods_over() {
    let node = SimNode::up();
    let started = now_ms();
    let agent = node.agent(&[
        "--interval",
        "60s",
        "--timeout",
        "1s",
        "--tcp-interval",
        "0s",
        "--socket-events",
        "false",
    ]);
    let sent_before = cache_probes_sent(&first_tick_counted(&agent));
    let mut load = node.load(
        "pod1",
        POD_SERVER,
        &["--rate", "500", "--duration", "4s", "--report-interval", "250ms"],
    );
    load.wait_cache_answers();

    let (killed_at, gone_at) = node.kill("cache-kill");
    // A whole interval after the kill: answered by CoreDNS (fast path), or failing (none).
    load.wait_line("a whole interval without the cache", Duration::from_secs(5), |l| {
        field(l, "cache") == Some(0)
            && (field(l, "coredns") > Some(0) || field(l, "failed") > Some(0))
    });
    node.script(&["cache-start"]);
    load.wait_alone("cache");
    let summary = load.finish();
    println!("summary: {summary}");
    let st = agent.state().expect("the agent's state");
    assert!(now_ms() < started + 60_000, "ran past the second tick: the result proves nothing");
    // The agent did nothing: the kernel alone moved the pods, both ways.
    assert_eq!(st["route"], "local", "{st}");
    assert_eq!(st["transitions"], 0, "{st}");
    assert_eq!(cache_probes_sent(&st), sent_before, "a cache probe was sent: {st}");
    assert_eq!(summary["failed"], 0, "lookups failed: {summary}");
    assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 0, "{summary}");
    assert!(summary["by_origin"]["cache"].as_u64().unwrap() > 0, "{summary}");
    // Only queries already queued in the dying cache lose their first attempt.
    assert_lost_to_the_kill("first attempt lost", &summary, killed_at, gone_at);
}

/// Issue 18, point 7: DNS over TCP from a pod and from the host follows the route
/// ([`testkit::tcp_lookups_follow_the_route`]).
#[test]
fn tcp_lookups_from_pods_and_hosts_follow_the_route() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    testkit::tcp_lookups_follow_the_route(&node, &agent);
}

/// Acceptance 6 and the exit policy: SIGTERM leaves the current route's rules; a restarted agent
/// adopts them without a transition; teardown removes everything, twice.
#[test]
fn sigterm_leaves_rules_restart_adopts_teardown_removes() {
    let node = SimNode::up();
    let mut agent = node.agent(&[]);
    let status = agent.stop(Signal::SIGTERM);
    assert!(status.success(), "agent exited with {status}");
    assert_eq!(node.agent_table(), Some(node.expected_table("local")));

    let pid_before = agent.state().unwrap()["pid"].clone();
    drop(agent);
    let agent = node.agent(&[]);
    let st = wait_for("the new agent's state", Duration::from_secs(5), || {
        agent.state().filter(|s| s["pid"] != pid_before)
    });
    assert_eq!(st["transitions"], 0, "{st}");
    assert!(agent.log_text().contains("adopted=true"), "{}", agent.log_text());

    // Teardown refuses while an agent runs: it would put the rules back.
    let state_dir = agent.state_dir.display().to_string();
    let teardown = ["teardown", "--state-dir", state_dir.as_str()];
    let out = node.run("node", agent_exe(), &teardown);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("stop it first"), "{}", describe(&out));
    assert_eq!(node.agent_table(), Some(node.expected_table("local")));
    drop(agent);

    for _ in 0..2 {
        let out = node.run("node", agent_exe(), &teardown);
        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(node.agent_table(), None);
        assert!(!std::path::Path::new(&state_dir).join("state.json").exists());
    }
    let tables = node.run("node", "nft", &["list", "tables"]);
    assert!(!String::from_utf8_lossy(&tables.stdout).contains("nodelocaldns-ha"));
    // With the cache still answering on the cluster-DNS IP, kube-proxy's DNAT takes pods to
    // CoreDNS: nothing of the agent's steers them any more.
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=2", "@10.96.0.10", "who.test"]);
    assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), COREDNS_ANSWER, "after teardown");
}

/// Issue 18, point 4: an agent stopped (SIGTERM) on `Upstream` while the cache is still dead,
/// restarted with the same flags, adopts `Upstream`: no transition, and the installed table is
/// never replaced (its handles are unchanged: any apply, even of `Local` for a moment, renumbers
/// them; a restarted agent's first replaces the whole table). Pods lose nothing across the restart. It returns to
/// `Local` only once the cache is back, after `rise` good probes and `min-hold` counted from the
/// restart.
#[test]
fn restart_on_upstream_with_the_cache_dead_adopts_upstream() {
    let node = SimNode::up();
    // rise 5 × 100 ms = 0.5 s, well inside min-hold 2 s: the return waits for min-hold.
    let flags = ["--interval", "100ms", "--timeout", "80ms", "--min-hold", "2s"];
    let mut agent = node.agent(&flags);
    let mut load = node.load(
        "pod1",
        POD_SERVER,
        &["--rate", "200", "--duration", "60s", "--report-interval", "100ms"],
    );
    load.wait_cache_answers();
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    let upstream = node.expected_table("upstream");
    assert_eq!(node.agent_table().as_deref(), Some(upstream.as_str()));
    let handles = node.agent_table_handles().expect("the agent's table");

    let status = agent.stop(Signal::SIGTERM);
    assert!(status.success(), "agent exited with {status}");
    let before = agent.state().expect("the stopped agent's state");
    drop(agent);
    assert_eq!(node.agent_table_handles().as_ref(), Some(&handles), "SIGTERM changed the table");
    let agent = node.agent_restarting(&flags, &before);
    let st = agent.state().expect("state");
    assert_eq!(st["route"], "upstream", "{st}");
    assert_eq!(st["transitions"], 0, "{st}");
    let log = agent.log_text();
    assert!(log.contains("route=upstream adopted=true"), "{log}");
    // Some ticks later, on the dead cache: still the very table the first agent installed.
    let sent = st["probes"]["cache_udp"]["sent"].as_u64().unwrap_or(0);
    let later = wait_for("5 probes of the dead cache", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["cache_udp"]["sent"].as_u64() >= Some(sent + 5))
    });
    assert_eq!(later["route"], "upstream", "{later}");
    assert_eq!(later["transitions"], 0, "{later}");
    assert_eq!(
        node.agent_table_handles().as_ref(),
        Some(&handles),
        "the restarted agent replaced the Upstream table"
    );
    let adopted_at = later["since_unix_ms"].as_u64().expect("since_unix_ms");

    let started = node.script(&["cache-start"]);
    println!("cache started: {started}");
    let local = agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(local["transitions"], 1, "{local}");
    assert!(local["reason"].as_str().unwrap().contains("answered"), "{local}");
    assert!(
        local["probes"]["cache_udp"]["streak_good"].as_u64().unwrap() >= 5,
        "returned before rise good probes: {local}"
    );
    let back = local["since_unix_ms"].as_u64().unwrap();
    assert!(back >= adopted_at + 2000, "returned before min-hold from the restart: {local}");
    assert_eq!(node.agent_table(), Some(node.expected_table("local")));
    load.wait_alone("cache");
    let summary = load.interrupt();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "pod lookups failed across the restart: {summary}");
}

/// Dual stack, kube-proxy on iptables-legacy: IPv4 and IPv6 pods both survive a SIGKILL, and
/// both come back to the cache.
#[test]
fn dual_stack_pods_survive_sigkill() {
    let node = SimNode::up_with(&["--family", "dual", "--kube-proxy", "iptables-legacy"]);
    let agent = node.agent_for(
        "169.254.20.10,fd00:169:254::10",
        "10.96.0.10,fd00:96::10",
        "10.96.0.11,fd00:96::11",
        &[],
    );
    let args = ["--rate", "300", "--duration", "6s", "--report-interval", "250ms"];
    let mut v4 = node.load("pod1", CLUSTER_DNS_IP, &args);
    let mut v6_args = args.to_vec();
    v6_args.extend(["--qtype", "AAAA"]);
    let mut v6 = node.load("pod2", "[fd00:96::10]:53", &v6_args);
    for load in [&mut v4, &mut v6] {
        load.wait_cache_answers();
    }
    node.script(&["cache-kill"]);
    agent.wait_route("upstream", Duration::from_secs(5));
    for load in [&mut v4, &mut v6] {
        load.wait_alone("coredns");
    }
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    for load in [&mut v4, &mut v6] {
        load.wait_alone("cache");
    }
    for (family, load) in [("IPv4", v4), ("IPv6", v6)] {
        let summary = load.finish();
        println!("{family}: {summary}");
        assert_eq!(summary["failed"], 0, "{family}: {summary}");
        assert_eq!(summary["by_origin"]["other"], 0, "{family}: {summary}");
    }
    let table = node.agent_table().unwrap();
    assert!(table
        .contains("ip6 daddr fd00:96::10 udp dport 53 fib daddr type local socket transparent 0"));
}
