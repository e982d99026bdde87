//! The compatibility matrix: every kube-proxy shape × every agent dataplane × IPv4/IPv6, with a
//! pod and a host-network client in each cell, on the simulated node, in both of node-local-dns's
//! shapes: ClusterIP (pods query the kube-dns IP) and link-local (pods query 169.254.20.10).
//!
//! Each cell: the backend `auto` picks is the right one; a cache SIGKILL loses no pod lookup; a
//! hang moves the route at the `fall`-th failed probe; the route returns after recovery;
//! `teardown` leaves nothing of the agent in nftables or in either iptables flavour. The
//! `real_*` cells run on the real Kubernetes parts (issue 31: real kube-proxy in iptables and
//! nftables mode, real CoreDNS, the API server; `testdata/simnode/real.sh`), their IPv6 cells on
//! a dual-stack cluster.

use std::time::Duration;

use testkit::*;

#[derive(Clone, Copy)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn flag(self) -> &'static str {
        match self {
            Family::V4 => "4",
            Family::V6 => "6",
        }
    }

    /// `--family` for the node. The real parts' cluster is IPv4 or dual-stack (its API server on
    /// IPv4, as in kubeadm's dual-stack clusters): an IPv6 cell there runs on a dual-stack node.
    fn node_flag(self, kube_proxy: &str) -> &'static str {
        match self {
            Family::V6 if kube_proxy.starts_with("real-") => "dual",
            _ => self.flag(),
        }
    }

    /// (local, cluster DNS, upstream) for the agent.
    fn addrs(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Family::V4 => (LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP),
            Family::V6 => ("fd00:169:254::10", "fd00:96::10", "fd00:96::11"),
        }
    }

    /// The cluster-DNS server as dnsload takes it, and the query type.
    fn server(self) -> (&'static str, &'static str) {
        match self {
            Family::V4 => (CLUSTER_DNS_IP, "A"),
            Family::V6 => ("[fd00:96::10]:53", "AAAA"),
        }
    }

    /// The link-local server as dnsload takes it.
    fn link_local_server(self) -> &'static str {
        match self {
            Family::V4 => LOCAL_IP,
            Family::V6 => "[fd00:169:254::10]:53",
        }
    }

    /// pod1's address, to send from.
    fn pod1(self) -> &'static str {
        match self {
            Family::V4 => "10.244.0.2",
            Family::V6 => "fd00:244::2",
        }
    }
}

/// What `auto` must pick for a kube-proxy shape.
fn auto_choice(kube_proxy: &str) -> &'static str {
    match kube_proxy {
        "iptables-legacy" => "iptables-legacy",
        "iptables-nft" => "iptables-nft",
        "nftables" => "nftables",
        // Real kube-proxy (issue 31): iptables mode with the host's iptables, iptables-nft.
        "real-iptables" => "iptables-nft",
        "real-nftables" => "nftables",
        other => panic!("unknown kube-proxy shape {other}"),
    }
}

/// The agent's `--min-hold` in every cell (2 s by default): a cell waits it out twice, and what
/// it checks is not how long the route stays.
const MIN_HOLD: &str = "500ms";

/// The agent's flags in every cell: `dataplane`, probes every 100 ms, [`MIN_HOLD`].
fn agent_args(dataplane: &str) -> [&str; 8] {
    ["--dataplane", dataplane, "--interval", "100ms", "--timeout", "80ms", "--min-hold", MIN_HOLD]
}

/// One ClusterIP cell: the clients run until the last phase is over, then are interrupted.
fn cell(kube_proxy: &str, dataplane: &str, family: Family) {
    let node =
        SimNode::up_with(&["--kube-proxy", kube_proxy, "--family", family.node_flag(kube_proxy)]);
    let (local, cluster_dns, upstream) = family.addrs();
    let agent = node.agent_for(local, cluster_dns, upstream, &agent_args(dataplane));
    let expected = if dataplane == "auto" { auto_choice(kube_proxy) } else { dataplane };
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], expected, "{st}");

    let (server, qtype) = family.server();
    let args =
        ["--rate", "200", "--duration", "60s", "--report-interval", "100ms", "--qtype", qtype];
    let mut pod = node.load("pod1", server, &args);
    let mut host = node.load("node", server, &args);
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }

    let killed_at = node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    pod.wait_alone("coredns");
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));

    let mark = agent.log_mark();
    let stopped_at = node.signal("cache-stop");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        agent.switch_after(mark, "upstream", "cache udp")
    });
    let detection = up["since_unix_ms"].as_u64().unwrap().saturating_sub(stopped_at);
    println!("hang detected after {detection} ms, at failed probe {}", switch.failed);
    // Under traffic the stall watch moves the route, by the agent's counts before the probes'
    // `fall`-th failure, whatever the scheduling on a shared machine (the probes' own bound is
    // `cache_hang_switches_within_the_probe_bound_and_returns_after_hold`).
    switch.assert_stalled();
    // The pace, which the counts cannot see: within twice the probe bound (3 × 100 ms + 80 ms).
    assert!(detection < 2 * 380, "hang detected after {detection} ms: {up}");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    for load in [&mut pod, &mut host] {
        load.wait_alone("cache");
    }

    let summary = pod.interrupt();
    println!("{kube_proxy} × {dataplane} pod: {summary}");
    assert_eq!(summary["failed"], 0, "pod lookups failed: {summary}");
    assert_eq!(summary["by_origin"]["other"], 0, "{summary}");
    let (summary, lookups) = host.interrupt_recorded();
    println!("{kube_proxy} × {dataplane} host: {summary}");
    // Host clients (no fast path) may lose the lookups refused between the kill and the switch,
    // and only those: none sent once the client has seen CoreDNS answer.
    let switched = coredns_seen_after(&lookups, killed_at);
    let failed = sent_at(&summary, "failures_at_ms");
    println!(
        "host: {} failed, all within the {} ms to the switch",
        failed.len(),
        switched - killed_at
    );
    assert_within("failed host lookup", &failed, killed_at - ATTEMPT_TIMEOUT_MS, switched);

    node.tear_down(agent);
}

/// Who answers `dig` from pod1, always from one source port (40053), for the link-local IP:
/// `cache` or `coredns` (by the answer), or what went wrong.
fn fixed_port_answer(node: &SimNode, family: Family) -> String {
    let (local, _, _) = family.addrs();
    let (bind, at) = (format!("{}#40053", family.pod1()), format!("@{local}"));
    let qtype = family.server().1;
    let args = ["-b", &bind, "+short", "+time=1", "+tries=1", &at, "who.test", qtype];
    let out = node.run("pod1", "dig", &args);
    match String::from_utf8_lossy(&out.stdout).trim() {
        "1.1.1.1" | "fd00::1:1:1:1" => "cache".to_owned(),
        "2.2.2.2" | "fd00::2:2:2:2" => "coredns".to_owned(),
        other => format!("{other:?} ({})", describe(&out)),
    }
}

/// A link-local cell: the agent without `--cluster-dns-ip`, pods and host-network clients
/// querying the link-local IP. A SIGKILL loses no lookup of either, in the kernel: their next
/// packet goes to the agent's forwarder (host clients' too: their packets come back in through
/// prerouting on lo); only what the dying cache held loses its first attempt. A hang moves the
/// route at the `fall`-th failed probe and only what was sent to the hung cache before then
/// loses its first attempt. A client that keeps one source port goes to the forwarder and back
/// to the cache with the route. `teardown` leaves nothing, the agent's copies on lo included.
fn link_local_cell(kube_proxy: &str, dataplane: &str, family: Family) {
    let node =
        SimNode::up_with(&["--kube-proxy", kube_proxy, "--family", family.node_flag(kube_proxy)]);
    let (local, _, upstream) = family.addrs();
    let agent = node.agent_for(local, "", upstream, &agent_args(dataplane));
    let expected = if dataplane == "auto" { auto_choice(kube_proxy) } else { dataplane };
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], expected, "{st}");
    assert!(st["shape"].as_str().unwrap().starts_with("link-local"), "{st}");

    let (server, qtype) = (family.link_local_server(), family.server().1);
    let args =
        ["--rate", "200", "--duration", "60s", "--report-interval", "100ms", "--qtype", qtype];
    let mut pod = node.load("pod1", server, &args);
    let mut host = node.load("node", server, &args);
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }
    let (killed_at, gone_at) = node.kill("cache-kill");
    for load in [&mut pod, &mut host] {
        load.wait_alone("coredns");
    }
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }

    let mark = agent.log_mark();
    let stopped_at = node.signal("cache-stop");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        agent.switch_after(mark, "upstream", "cache udp")
    });
    let switched_at = up["since_unix_ms"].as_u64().unwrap();
    switch.assert_stalled();
    let detection = switched_at.saturating_sub(stopped_at);
    assert!(detection < 2 * 380, "hang detected after {detection} ms: {up}");
    assert_eq!(fixed_port_answer(&node, family), "coredns", "one source port, cache hung");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }
    assert_eq!(fixed_port_answer(&node, family), "cache", "one source port, cache back");

    for (client, load) in [("pod", pod), ("host", host)] {
        let (summary, lookups) = load.interrupt_recorded();
        println!("link-local {kube_proxy} × {dataplane} {client}: {summary}");
        assert_eq!(summary["failed"], 0, "{client} lookups failed: {summary}");
        assert_eq!(summary["by_origin"]["other"], 0, "{summary}");
        // First attempts lost: to the dying cache (sent before it was gone), or to the hung one
        // (sent before the client saw the forwarder answer after the switch).
        let after_hang = coredns_seen_after(&lookups, stopped_at);
        for lost in sent_at(&summary, "first_attempt_lost_at_ms") {
            let at_kill = (killed_at - ATTEMPT_TIMEOUT_MS..=gone_at).contains(&lost);
            let at_hang = (stopped_at - ATTEMPT_TIMEOUT_MS..=after_hang).contains(&lost);
            assert!(
                at_kill || at_hang,
                "{client}: a first attempt sent at {lost} was lost (kill {killed_at}..{gone_at}, \
                 hang {stopped_at}..{after_hang})"
            );
        }
    }

    node.tear_down(agent);
}

macro_rules! link_local_matrix {
    ($($name:ident: $kube_proxy:literal, $dataplane:literal, $family:ident;)*) => {
        $(
            #[test]
            fn $name() {
                link_local_cell($kube_proxy, $dataplane, Family::$family);
            }
        )*
    };
}

link_local_matrix! {
    link_local_legacy_auto_v4: "iptables-legacy", "auto", V4;
    link_local_legacy_nftables_v4: "iptables-legacy", "nftables", V4;
    link_local_legacy_auto_v6: "iptables-legacy", "auto", V6;
    link_local_nft_auto_v4: "iptables-nft", "auto", V4;
    link_local_nft_nftables_v4: "iptables-nft", "nftables", V4;
    link_local_nft_legacy_v4: "iptables-nft", "iptables-legacy", V4;
    link_local_nft_auto_v6: "iptables-nft", "auto", V6;
    link_local_nftmode_auto_v4: "nftables", "auto", V4;
    link_local_nftmode_nft_v4: "nftables", "iptables-nft", V4;
    link_local_nftmode_auto_v6: "nftables", "auto", V6;
    // The real parts (issue 31): the forwarder answering through real kube-proxy to real CoreDNS.
    link_local_real_iptables_auto_v4: "real-iptables", "auto", V4;
    link_local_real_nftables_auto_v4: "real-nftables", "auto", V4;
    link_local_real_iptables_auto_v6: "real-iptables", "auto", V6;
    link_local_real_nftables_auto_v6: "real-nftables", "auto", V6;
}

macro_rules! matrix {
    ($($name:ident: $kube_proxy:literal, $dataplane:literal, $family:ident;)*) => {
        $(
            #[test]
            fn $name() {
                cell($kube_proxy, $dataplane, Family::$family);
            }
        )*
    };
}

matrix! {
    legacy_auto_v4: "iptables-legacy", "auto", V4;
    legacy_nftables_v4: "iptables-legacy", "nftables", V4;
    legacy_legacy_v4: "iptables-legacy", "iptables-legacy", V4;
    legacy_nft_v4: "iptables-legacy", "iptables-nft", V4;
    legacy_auto_v6: "iptables-legacy", "auto", V6;
    legacy_nftables_v6: "iptables-legacy", "nftables", V6;
    legacy_legacy_v6: "iptables-legacy", "iptables-legacy", V6;
    legacy_nft_v6: "iptables-legacy", "iptables-nft", V6;
    nft_auto_v4: "iptables-nft", "auto", V4;
    nft_nftables_v4: "iptables-nft", "nftables", V4;
    nft_legacy_v4: "iptables-nft", "iptables-legacy", V4;
    nft_nft_v4: "iptables-nft", "iptables-nft", V4;
    nft_auto_v6: "iptables-nft", "auto", V6;
    nft_nftables_v6: "iptables-nft", "nftables", V6;
    nft_legacy_v6: "iptables-nft", "iptables-legacy", V6;
    nft_nft_v6: "iptables-nft", "iptables-nft", V6;
    nftmode_auto_v4: "nftables", "auto", V4;
    nftmode_nftables_v4: "nftables", "nftables", V4;
    nftmode_legacy_v4: "nftables", "iptables-legacy", V4;
    nftmode_nft_v4: "nftables", "iptables-nft", V4;
    nftmode_auto_v6: "nftables", "auto", V6;
    nftmode_nftables_v6: "nftables", "nftables", V6;
    nftmode_legacy_v6: "nftables", "iptables-legacy", V6;
    nftmode_nft_v6: "nftables", "iptables-nft", V6;
    // The real parts: real kube-proxy's rules, real CoreDNS, the cache the real node-cache with
    // node-local-dns's Corefile (testdata/simnode/real.sh).
    real_iptables_auto_v4: "real-iptables", "auto", V4;
    real_nftables_auto_v4: "real-nftables", "auto", V4;
    // On a dual-stack node: real kube-proxy's IPv6 rules (ip6tables-nft, `table ip6 kube-proxy`).
    real_iptables_auto_v6: "real-iptables", "auto", V6;
    real_nftables_auto_v6: "real-nftables", "auto", V6;
}
