//! End to end, the link-local shape (issue 12): pods and host-network clients query the
//! node-local IP itself (kubelet's `--cluster-dns` is 169.254.20.10, as kubespray sets it and as
//! IPVS clusters must), the agent runs without `--cluster-dns-ip`, and when the cache dies or
//! hangs its forwarder answers from the same IP with CoreDNS's answers. The crash, the hang and
//! teardown in every kube-proxy mode, backend and family are the link-local cells of
//! `tests/e2e_matrix.rs`; here what they do not look at.
//!
//! node-cache's addresses sit on an interface of its own (simnode's default `--listen-dev
//! veth`, for its `nodelocaldns` dummy, which this kernel lacks), so that its teardown can be
//! modelled without taking the agent's copies on lo with it. Each test makes its own namespaces (unique
//! prefix) and removes them, whatever happens.

use std::time::Duration;

use testkit::*;

/// A simulated node in the link-local shape, kube-proxy in `mode`, and its agent (`extra` on
/// top of the test defaults, nftables unless it names a backend).
fn link_local_node(mode: &str, extra: &[&str]) -> (SimNode, Agent) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
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

/// A hung cache (SIGSTOP): the route goes to `Upstream` on the `fall`-th failed probe (the
/// probes, sent from the loopback address, still reach the hung cache and not the forwarder),
/// pods' and host clients' lookups lose nothing; after SIGCONT the route returns, and a client
/// that kept one source port through it all is answered by the cache again.
#[test]
fn hang_switches_to_the_forwarder_and_back() {
    // The stall watch off: the probes alone must see the hang, so they reach the hung cache.
    let extra = ["--interval", "100ms", "--timeout", "80ms", "--stall-bound", "0s"];
    let (node, agent) = link_local_node("nftables", &extra);
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
    // What went around the cache is counted, for `status`: answered, or still in flight when
    // the state was written; none lost on the way to CoreDNS.
    let forwarded = &after["forwarded"];
    let count = |key: &str| forwarded[key].as_u64().unwrap_or_else(|| panic!("{key}: {after}"));
    assert!(count("udp_answers") > 0 && count("udp_answers") <= count("udp_queries"), "{after}");
    assert_eq!((count("upstream_failures"), count("dropped")), (0, 0), "{after}");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    for (client, load) in [("pod", pod), ("host", host)] {
        let summary = load.finish();
        println!("{client}: {summary}");
        assert_eq!(summary["failed"], 0, "{client}: {summary}");
        assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 0, "{client}: {summary}");
    }
    assert_eq!(dig_from_port(&node, "pod1", "10.244.0.2", LOCAL_IP), CACHE_ANSWER);
    node.tear_down(agent);
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
    node.tear_down(agent);
}

/// A node with other owners of netfilter, in the link-local shape: a host firewall (`firewall`:
/// simnode's `--filter-reject`, RHEL's REJECT at the end of INPUT, or `--filter-drop`, a DROP
/// policy that accepts only loopback's 127/8), kube-proxy redoing its sync every second and
/// `extra_noise` (simnode loops). The agent's ACCEPTs let the queries to the link-local IP in,
/// to the cache or, TPROXYed, to its forwarder (their destination stays the link-local IP),
/// and the forwarder's queries to CoreDNS come back ESTABLISHED: a SIGKILL and a hang of the
/// cache cost neither pods nor host-network clients a lookup, and the noise ran throughout.
fn busy_firewalled_node(kube_proxy: &str, firewall: &str, dataplane: &str, extra_noise: &[&str]) {
    let node = SimNode::up_with(&["--kube-proxy", kube_proxy, firewall]);
    let mut noise = vec!["kube-proxy-resync"];
    noise.extend_from_slice(extra_noise);
    for loop_name in &noise {
        node.script(&[&format!("{loop_name}-start")]);
    }
    let agent = node.agent_for(LOCAL_IP, "", UPSTREAM_IP, &["--dataplane", dataplane]);
    // Long enough for any machine; interrupted once the hang is over.
    let args = ["--rate", "300", "--duration", "120s", "--report-interval", "100ms"];
    let mut loads = [
        ("pod1", node.load("pod1", LOCAL_IP, &args)),
        ("node", node.load("node", LOCAL_IP, &args)),
    ];
    for (_, load) in &mut loads {
        load.wait_cache_answers();
    }
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(15));
    for (_, load) in &mut loads {
        load.wait_cache_answers();
    }
    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(15));
    for (role, load) in loads {
        let summary = load.interrupt();
        println!("{role}, {firewall}, across kill and hang: {summary}");
        assert_eq!(summary["failed"], 0, "{role}: {summary}");
        assert!(
            summary["by_origin"]["coredns"].as_u64() > Some(0),
            "{role}: never failed over: {summary}"
        );
    }
    for loop_name in &noise {
        let rounds = node.script(&[&format!("{loop_name}-rounds")]);
        println!("{loop_name}: {rounds}");
        assert!(rounds.contains("failed=0") && !rounds.contains("ok=0 "), "{loop_name}: {rounds}");
        node.script(&[&format!("{loop_name}-stop")]);
    }
    node.tear_down(agent);
}

#[test]
fn a_rejecting_firewall_and_kube_proxy_resyncs_cost_no_lookup_iptables_nft() {
    busy_firewalled_node("iptables-nft", "--filter-reject", "iptables-nft", &[]);
}

#[test]
fn a_dropping_firewall_kube_proxy_resyncs_and_a_cni_cost_no_lookup_nftables() {
    busy_firewalled_node("nftables", "--filter-drop", "nftables", &["cni-noise"]);
}

/// A kernel that refuses the fallback's TPROXY costs only the link-local failover
/// ([`fallback_refused`]). The refusal is real netfilter's, made here as a kernel without
/// xt_TPROXY would give it: a chain of the trial's name that a rule in mangle `OUTPUT` jumps to,
/// where TPROXY may not run. (The guest of `tests/e2e_vm.rs` lacks the modules for real.)
#[test]
fn a_kernel_that_refuses_the_fallback_costs_only_the_link_local_failover() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft"]);
    let refusing = |on: bool| {
        let steps: &[&[&str]] = if on {
            &[&["-N", "NODELOCALDNS-HA-TRIAL"], &["-A", "OUTPUT", "-j", "NODELOCALDNS-HA-TRIAL"]]
        } else {
            &[&["-D", "OUTPUT", "-j", "NODELOCALDNS-HA-TRIAL"], &["-X", "NODELOCALDNS-HA-TRIAL"]]
        };
        for step in steps {
            let out = node.run("node", "iptables-nft", &[&["-t", "mangle"][..], step].concat());
            assert!(out.status.success(), "{}", describe(&out));
        }
    };
    fallback_refused(&node, "iptables-nft", &[], &refusing);
}
