//! Never worse than node-local-dns alone (issue 30): whatever state the agent is in when it
//! stops, a healthy cache keeps answering every pod and host-network client with the agent gone,
//! and a new agent takes the node over without a failed lookup.
//!
//! One test per backend (nftables, iptables-legacy, iptables-nft, each beside a kube-proxy of
//! its own kind) and shape (ClusterIP, link-local). Each walks the states the agent can leave
//! behind, each stopped once by SIGTERM and once by SIGKILL:
//!
//! * `Local`, settled on the cache;
//! * `Upstream`, failed over from a hung cache (stopped while it hangs; the cache resumes);
//! * held: on `Upstream` with CoreDNS down too (both come back once the agent is gone);
//! * forced: `flip upstream --for 120s`, the cache healthy;
//! * draining: `drain` (node-cache's preStop), the cache healthy.
//!
//! After each stop, pods and the node's own clients look names up while no agent runs, then a
//! new agent starts under that load (adopting the route, or the recorded override, which is
//! then released) and settles on the cache: 0 failed lookups over it all, and no answer from
//! anyone but the cache or CoreDNS. On the iptables backends in the link-local shape the
//! fallback's TPROXY outlives the agent by its lease (a second, `forwarder::lease`): queries
//! sent then lose their first attempt and their retry reaches the cache. That lease is the
//! agent's alone: a pod forging its heartbeat holds nothing (`forged_heartbeats_hold_no_lease`).

use std::cell::Cell;
use std::time::Duration;

use nix::sys::signal::Signal;
use testkit::*;

/// Where pods send their queries.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    ClusterIp,
    LinkLocal,
}

/// A state the agent is stopped in.
#[derive(Clone, Copy, Debug)]
enum Leave {
    Local,
    Upstream,
    Held,
    Forced,
    Draining,
}

const STATES: [Leave; 5] =
    [Leave::Local, Leave::Upstream, Leave::Held, Leave::Forced, Leave::Draining];

/// The agent's flags: `backend`, probes every 100 ms, a short hold so that a new agent is back
/// on the cache soon.
fn agent_args(backend: &str) -> [&str; 8] {
    ["--dataplane", backend, "--interval", "100ms", "--timeout", "80ms", "--min-hold", "500ms"]
}

fn never_worse(backend: &str, shape: Shape) {
    let node = SimNode::up_with(&["--kube-proxy", backend]);
    let cluster_dns = if shape == Shape::ClusterIp { CLUSTER_DNS_IP } else { "" };
    let server = if shape == Shape::ClusterIp { CLUSTER_DNS_IP } else { LOCAL_IP };
    let args = agent_args(backend);
    let mut agent = node.agent_for(LOCAL_IP, cluster_dns, UPSTREAM_IP, &args);
    agent.wait_settled(5, Duration::from_secs(10));
    let dir = agent.state_dir.display().to_string();
    for state in STATES {
        for signal in [Signal::SIGTERM, Signal::SIGKILL] {
            let cell = format!("{backend} {} {state:?} {signal}", label(shape));
            leave_in(&node, &agent, &dir, state);
            let previous = agent.state().expect("state");
            agent.stop(signal);
            // The node as it is once the agent is gone: the cache healthy, CoreDNS too.
            if matches!(state, Leave::Upstream | Leave::Held) {
                node.signal("cache-cont");
            }
            if matches!(state, Leave::Held) {
                node.signal("coredns-cont");
            }

            let load_args = ["--rate", "200", "--duration", "60s", "--report-interval", "100ms"];
            let mut pod = node.load("pod1", server, &load_args);
            let mut host = node.load("node", server, &load_args);
            // Two seconds of lookups with no agent: past the iptables fallback's lease.
            for load in [&mut pod, &mut host] {
                let answered = Cell::new(0);
                load.wait_line("2 s answered without the agent", Duration::from_secs(10), |l| {
                    let n = field(l, "cache").unwrap_or(0) + field(l, "coredns").unwrap_or(0);
                    answered.set(answered.get() + u64::from(n > 0));
                    answered.get() >= 20
                });
            }

            agent = node.agent_restarting_for(LOCAL_IP, cluster_dns, UPSTREAM_IP, &args, &previous);
            if matches!(state, Leave::Forced | Leave::Draining) {
                // The new agent honours the recorded override; the operator ends it.
                let out = node.cli(&["release", "--state-dir", &dir]);
                assert!(out.status.success(), "{cell}: {}", describe(&out));
            }
            agent.wait_settled(5, Duration::from_secs(15));
            for load in [&mut pod, &mut host] {
                load.wait_cache_answers();
            }
            for (client, load) in [("pod", pod), ("host", host)] {
                let summary = load.interrupt();
                println!("{cell} {client}: {summary}");
                assert_eq!(summary["failed"], 0, "{cell}: {client} lookups failed: {summary}");
                assert_eq!(summary["by_origin"]["other"], 0, "{cell}: {summary}");
            }
        }
    }
    node.tear_down(agent);
}

fn label(shape: Shape) -> &'static str {
    match shape {
        Shape::ClusterIp => "ClusterIP",
        Shape::LinkLocal => "link-local",
    }
}

/// Brings the running, settled `agent` into `state`.
fn leave_in(node: &SimNode, agent: &Agent, dir: &str, state: Leave) {
    match state {
        Leave::Local => {}
        Leave::Upstream => {
            node.signal("cache-stop");
            agent.wait_route("upstream", Duration::from_secs(5));
        }
        Leave::Held => {
            node.signal("cache-stop");
            agent.wait_route("upstream", Duration::from_secs(5));
            node.signal("coredns-stop");
            wait_for("the route held", Duration::from_secs(10), || {
                agent.state().filter(|s| s["route"] == "upstream" && !s["held"].is_null())
            });
        }
        Leave::Forced => {
            let flip =
                ["flip", "upstream", "--for", "120s", "--reason", "test", "--state-dir", dir];
            let out = node.cli(&flip);
            assert!(out.status.success(), "{}", describe(&out));
            agent.wait_route("upstream", Duration::from_secs(5));
        }
        Leave::Draining => {
            let out = node.cli(&["drain", "--timeout", "5s", "--state-dir", dir]);
            assert!(out.status.success(), "{}", describe(&out));
            agent.wait_route("upstream", Duration::from_secs(5));
        }
    }
}

macro_rules! cells {
    ($($name:ident: $backend:literal, $shape:ident;)*) => {
        $(
            #[test]
            fn $name() {
                never_worse($backend, Shape::$shape);
            }
        )*
    };
}

cells! {
    nftables_cluster_ip: "nftables", ClusterIp;
    nftables_link_local: "nftables", LinkLocal;
    iptables_legacy_cluster_ip: "iptables-legacy", ClusterIp;
    iptables_legacy_link_local: "iptables-legacy", LinkLocal;
    iptables_nft_cluster_ip: "iptables-nft", ClusterIp;
    iptables_nft_link_local: "iptables-nft", LinkLocal;
}

/// The iptables fallback's lease is the agent's own: a pod with `CAP_NET_RAW` that forges its
/// heartbeat (127.0.0.1 to the link-local IP's port 9, ten a second, from a raw socket) holds
/// nothing. While the agent runs the forgery changes nothing: the cache answers on `Local`, the
/// forwarder on `Upstream`. Once the agent is SIGKILLed on `Upstream` (`flip`), its real lease
/// lapses a second after its last heartbeat and the healthy cache answers every pod lookup
/// again, however long the forger goes on (without `-i lo` on the heartbeat rule, xt_TPROXY
/// kept dropping every link-local query of the node for as long as the forger ran).
fn forged_heartbeats_hold_no_lease(backend: &str) {
    let node = SimNode::up_with(&["--kube-proxy", backend]);
    let mut agent = node.agent_for(LOCAL_IP, "", UPSTREAM_IP, &agent_args(backend));
    agent.wait_settled(5, Duration::from_secs(10));
    let dir = agent.state_dir.display().to_string();
    let local_ip = LOCAL_IP.parse().expect("an IPv4 address");
    let forger = node.forge_heartbeats("pod1", local_ip, Duration::from_millis(100));
    assert_eq!(node.dig("pod1", LOCAL_IP), CACHE_ANSWER, "{backend}: Local, forged heartbeats");
    let flip = ["flip", "upstream", "--for", "120s", "--reason", "test", "--state-dir", &dir];
    let out = node.cli(&flip);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(5));
    assert_eq!(
        node.dig("pod1", LOCAL_IP),
        COREDNS_ANSWER,
        "{backend}: Upstream, forged heartbeats"
    );

    agent.stop(Signal::SIGKILL);
    // Once the real lease has lapsed, the cache takes the link-local queries again.
    wait_for("the cache to answer a pod with the agent gone", Duration::from_secs(10), || {
        (node.dig("pod1", LOCAL_IP) == CACHE_ANSWER).then_some(())
    });
    let load = node.load("pod1", LOCAL_IP, &["--rate", "200", "--duration", "3s"]);
    let summary = load.finish();
    let forged = forger.stop();
    println!("{backend}: {forged} forged heartbeats; pod lookups with the agent gone: {summary}");
    assert!(forged >= 20, "{backend}: the forger sent only {forged} heartbeats");
    assert_eq!(summary["failed"], 0, "{backend}: pod lookups failed: {summary}");
    assert_eq!(summary["ok"], summary["by_origin"]["cache"], "{backend}: {summary}");
    node.tear_down(agent);
}

#[test]
fn forged_heartbeats_hold_no_lease_iptables_legacy() {
    forged_heartbeats_hold_no_lease("iptables-legacy");
}

#[test]
fn forged_heartbeats_hold_no_lease_iptables_nft() {
    forged_heartbeats_hold_no_lease("iptables-nft");
}
