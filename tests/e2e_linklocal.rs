//! End to end, the link-local shape (issue 12): pods and host-network clients query the
//! node-local IP itself (kubelet's `--cluster-dns` is 169.254.20.10, as kubespray sets it and as
//! IPVS clusters must), the agent runs without `--cluster-dns-ip`, and when the cache dies or
//! hangs its forwarder answers from the same IP with CoreDNS's answers.
//!
//! node-cache's addresses sit on an interface of its own (`--listen-dev veth`, standing in for
//! its `nodelocaldns` dummy, which this kernel lacks), so that its teardown can be modelled
//! without taking the agent's copies on lo with it. Each test makes its own namespaces (unique
//! prefix) and removes them, whatever happens.

use std::time::Duration;

use testkit::*;

const V6_LOCAL_IP: &str = "fd00:169:254::10";
const V6_UPSTREAM_IP: &str = "fd00:96::11";

/// A simulated node in the link-local shape, kube-proxy in `mode`, and its agent (`extra` on
/// top of the test defaults, nftables unless it names a backend).
fn link_local_node(mode: &str, extra: &[&str]) -> (SimNode, Agent) {
    let node = SimNode::up_with(&["--kube-proxy", mode, "--listen-dev", "veth"]);
    let agent = node.agent_for(LOCAL_IP, "", UPSTREAM_IP, extra);
    (node, agent)
}

/// `dig` from `role` to `server` from one fixed source port: what answered (its A record), or
/// the failure.
fn dig_from_port(node: &SimNode, role: &str, source: &str, server: &str) -> String {
    let bind = format!("{source}#40053");
    let at = format!("@{server}");
    let args = ["-b", &bind, "+short", "+time=1", "+tries=1", &at, "who.test"];
    let out = node.run(role, "dig", &args);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Nothing of the agent's left: its table, its copies of the link-local IPs on lo.
fn assert_torn_down(node: &SimNode, agent: Agent) {
    let state_dir = agent.state_dir.display().to_string();
    drop(agent);
    let out = node.cli(&["teardown", "--state-dir", &state_dir]);
    assert!(out.status.success(), "{}", describe(&out));
    node.assert_nothing_left();
    let lo = node.run("node", "ip", &["addr", "show", "dev", "lo"]);
    let lo = String::from_utf8_lossy(&lo.stdout);
    assert!(!lo.contains(LOCAL_IP) && !lo.contains(V6_LOCAL_IP), "copies left on lo:\n{lo}");
}

/// SIGKILL of the cache at 500 lookups/s from a pod, in one kube-proxy mode: no lookup fails,
/// CoreDNS answers (through the agent's forwarder) from the next packet on, the cache again once
/// it is back; `teardown` leaves nothing.
fn sigkill_loses_no_pod_lookup(mode: &str) {
    let (node, agent) = link_local_node(mode, &[]);
    let mut load = node.load(
        "pod1",
        LOCAL_IP,
        &["--rate", "500", "--duration", "6s", "--report-interval", "250ms"],
    );
    load.wait_cache_answers();
    let (killed_at, gone_at) = node.kill("cache-kill");
    load.wait_line("answers from CoreDNS", Duration::from_secs(5), |l| {
        field(l, "coredns").is_some_and(|n| n > 0) && field(l, "cache") == Some(0)
    });
    node.script(&["cache-start"]);
    load.wait_line("the cache answering again", Duration::from_secs(10), |l| {
        field(l, "cache").is_some_and(|n| n > 0) && field(l, "coredns") == Some(0)
    });
    let summary = load.finish();
    println!("{mode}: {summary}");
    assert_eq!(summary["failed"], 0, "lookups failed: {summary}");
    assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 0, "{summary}");
    let lost = sent_at(&summary, "first_attempt_lost_at_ms");
    print_lost(&lost, killed_at, gone_at);
    assert_within("first attempt lost", &lost, killed_at - ATTEMPT_TIMEOUT_MS, gone_at);
    agent.wait_route("local", Duration::from_secs(10));
    assert_torn_down(&node, agent);
}

#[test]
fn sigkill_loses_no_pod_lookup_iptables_nft() {
    sigkill_loses_no_pod_lookup("iptables-nft");
}

#[test]
fn sigkill_loses_no_pod_lookup_iptables_legacy() {
    sigkill_loses_no_pod_lookup("iptables-legacy");
}

#[test]
fn sigkill_loses_no_pod_lookup_nftables() {
    sigkill_loses_no_pod_lookup("nftables");
}

/// A hung cache (SIGSTOP): the route goes to `Upstream` on the `fall`-th failed probe (the
/// probes, sent from the loopback address, still reach the hung cache and not the forwarder),
/// pods' and host clients' lookups lose nothing; after SIGCONT the route returns, and a client
/// that kept one source port through it all is answered by the cache again.
#[test]
fn hang_switches_to_the_forwarder_and_back() {
    let (node, agent) = link_local_node("nftables", &["--interval", "100ms", "--timeout", "80ms"]);
    assert_eq!(dig_from_port(&node, "pod1", "10.244.0.2", LOCAL_IP), CACHE_ANSWER);
    let args = ["--rate", "300", "--duration", "6s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", LOCAL_IP, &args);
    let mut host = node.load("node", LOCAL_IP, &args);
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }
    let mark = agent.log_mark();
    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        agent.switch_after(mark, "upstream", "cache udp")
    });
    assert_eq!((switch.good, switch.bad, switch.failed), (0, 3, 3), "{}", switch.line);
    assert_eq!(dig_from_port(&node, "pod1", "10.244.0.2", LOCAL_IP), COREDNS_ANSWER);
    // The probes go on meeting the hung cache, not the forwarder: five more, none answered.
    let probes =
        |state: &serde_json::Value, key: &str| state["probes"]["cache_udp"][key].as_u64().unwrap();
    let before = agent.state().unwrap();
    let after = wait_for("five more probes of the hung cache", Duration::from_secs(5), || {
        agent.state().filter(|s| probes(s, "sent") >= probes(&before, "sent") + 5)
    });
    assert_eq!(probes(&after, "good"), probes(&before, "good"), "{after}");
    assert_eq!(after["route"], "upstream", "{after}");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    for (client, load) in [("pod", pod), ("host", host)] {
        let summary = load.finish();
        println!("{client}: {summary}");
        assert_eq!(summary["failed"], 0, "{client}: {summary}");
        assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 0, "{client}: {summary}");
    }
    assert_eq!(dig_from_port(&node, "pod1", "10.244.0.2", LOCAL_IP), CACHE_ANSWER);
    assert_torn_down(&node, agent);
}

/// node-cache's teardown (it deletes its interface, and the IPs with it, on every rolling
/// update): the agent's copies keep the link-local IP on the node, so the cache still answers
/// while it runs, and CoreDNS (through the forwarder) once it is gone, for pods and host-network
/// clients alike.
#[test]
fn node_cache_teardown_leaves_the_ip_and_the_fallback() {
    let (node, agent) = link_local_node("iptables-nft", &[]);
    node.script(&["listen-addrs-del"]);
    for role in ["pod1", "node"] {
        assert_eq!(node.dig(role, LOCAL_IP), CACHE_ANSWER, "{role}, the cache still running");
    }
    node.kill("cache-kill");
    for role in ["pod1", "node"] {
        assert_eq!(node.dig(role, LOCAL_IP), COREDNS_ANSWER, "{role}, the cache gone");
    }
    node.script(&["listen-addrs-add"]);
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(node.dig("pod1", LOCAL_IP), CACHE_ANSWER);
    assert_torn_down(&node, agent);
}

/// Acceptance 2: host-network clients of the link-local IP fail over on a SIGKILL with no agent
/// reaction at all: their packets come back in through prerouting on lo, where the kernel's
/// socket lookup sends the next one to the forwarder. Only what the dying cache held is lost.
#[test]
fn host_network_clients_fail_over_on_sigkill_in_the_kernel() {
    let (node, agent) = link_local_node("iptables-nft", &[]);
    let mut load = node.load(
        "node",
        LOCAL_IP,
        &["--rate", "500", "--duration", "4s", "--report-interval", "250ms"],
    );
    load.wait_cache_answers();
    let (killed_at, gone_at) = node.kill("cache-kill");
    let (summary, lookups) = load.finish_recorded();
    println!("host: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    let lost = sent_at(&summary, "first_attempt_lost_at_ms");
    print_lost(&lost, killed_at, gone_at);
    assert_within("first attempt lost", &lost, killed_at - ATTEMPT_TIMEOUT_MS, gone_at);
    let after = coredns_seen_after(&lookups, killed_at);
    println!("CoreDNS answered the host {} ms after the kill", after.saturating_sub(killed_at));
    drop(agent);
}

/// IPv6 and IPv4 side by side (dual stack): a SIGKILL loses no AAAA lookup from a pod, and a
/// hung cache's AAAA queries go to the forwarder too.
#[test]
fn dual_stack_pods_survive_sigkill() {
    let node =
        SimNode::up_with(&["--kube-proxy", "nftables", "--listen-dev", "veth", "--family", "dual"]);
    let local = format!("{LOCAL_IP},{V6_LOCAL_IP}");
    let upstream = format!("{UPSTREAM_IP},{V6_UPSTREAM_IP}");
    let agent = node.agent_for(&local, "", &upstream, &[]);
    let mut v6 = node.load(
        "pod1",
        V6_LOCAL_IP,
        &["--qtype", "AAAA", "--rate", "300", "--duration", "5s", "--report-interval", "250ms"],
    );
    v6.wait_cache_answers();
    let (killed_at, gone_at) = node.kill("cache-kill");
    v6.wait_line("AAAA answers from CoreDNS", Duration::from_secs(5), |l| {
        field(l, "coredns").is_some_and(|n| n > 0) && field(l, "cache") == Some(0)
    });
    let summary = v6.finish();
    println!("v6: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    let lost = sent_at(&summary, "first_attempt_lost_at_ms");
    assert_within("first attempt lost", &lost, killed_at - ATTEMPT_TIMEOUT_MS, gone_at);
    assert_torn_down(&node, agent);
}
