//! One owner of the agent's rules across backends (issue 17, point 2): an agent that starts with
//! another backend than the last one (an operator changing `--dataplane`, or `auto` following
//! kube-proxy from iptables to nftables mode) removes its predecessor's rules from the backend
//! it no longer uses, once its own are in. Left there, a stale socket-guarded NOTRACK would keep
//! pinning pods to a hung cache.

use std::time::Duration;

use nix::sys::signal::Signal;
use testkit::*;

/// The agent's chains in an iptables flavour's raw table, or its nftables table.
fn holds_agent_rules(node: &SimNode, backend: &str) -> bool {
    match backend {
        "nftables" => node.agent_table().is_some(),
        flavour => {
            let out = node.run("node", &format!("{flavour}-save"), &["-t", "raw"]);
            assert!(out.status.success(), "{}", describe(&out));
            String::from_utf8_lossy(&out.stdout).contains("NODELOCALDNS-HA")
        }
    }
}

/// After a change of backend, a hang of the cache moves pods to CoreDNS within the probe bound
/// and no lookup fails (glibc-like client: 1 s timeout, 2 attempts).
fn hang_fails_over(node: &SimNode, agent: &Agent) {
    let mut load = node.load(
        "pod1",
        CLUSTER_DNS_IP,
        &["--rate", "300", "--duration", "4s", "--report-interval", "100ms"],
    );
    load.wait_cache_answers();
    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    let summary = load.finish();
    node.signal("cache-cont");
    println!("hang after the change: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert!(summary["by_origin"]["coredns"].as_u64() > Some(0), "never reached CoreDNS: {summary}");
}

/// The agent on `from`, stopped with SIGTERM (its rules stay, by design), then started on `to`.
fn change(kube_proxy: &str, from: &str, to: &str) {
    let node = SimNode::up_with(&["--kube-proxy", kube_proxy]);
    let mut first = node.agent(&["--dataplane", from]);
    assert!(holds_agent_rules(&node, from));
    assert!(first.stop(Signal::SIGTERM).success());
    assert!(holds_agent_rules(&node, from), "SIGTERM leaves the rules");

    let agent = node.agent(&["--dataplane", to]);
    let st = wait_for("the leftovers to be removed", Duration::from_secs(10), || {
        agent.state().filter(|s| {
            s["leftovers"].as_array().is_some_and(|l| {
                !l.is_empty()
                    && l.iter().all(|n| n.as_str().unwrap().ends_with("found and removed"))
            })
        })
    });
    println!("{from} -> {to}: {}", st["leftovers"]);
    assert!(st["leftovers"].to_string().contains(from), "{st}");
    assert!(!holds_agent_rules(&node, from), "{from} still holds the agent's rules");
    assert!(holds_agent_rules(&node, to));
    let dir = agent.state_dir.display().to_string();
    let status = node.cli(&["status", "--state-dir", &dir]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("leftover:") && text.contains(from), "{text}");
    hang_fails_over(&node, &agent);
}

#[test]
fn backend_change_iptables_legacy_to_nftables() {
    change("iptables-legacy", "iptables-legacy", "nftables");
}

#[test]
fn backend_change_iptables_nft_to_nftables() {
    change("iptables-nft", "iptables-nft", "nftables");
}

#[test]
fn backend_change_nftables_to_iptables_legacy() {
    change("iptables-legacy", "nftables", "iptables-legacy");
}

#[test]
fn backend_change_nftables_to_iptables_nft() {
    change("iptables-nft", "nftables", "iptables-nft");
}

/// kube-proxy moves from iptables (nft) to nftables mode between two starts of the agent:
/// `auto` follows it, and the iptables-nft raw rules of the first agent go.
#[test]
fn kube_proxy_migration_to_nftables_mode_leaves_nothing_behind() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft"]);
    let mut first = node.agent(&["--dataplane", "auto"]);
    assert_eq!(first.state().unwrap()["dataplane"], "iptables-nft");
    assert!(first.stop(Signal::SIGTERM).success());
    node.script(&["kube-proxy-migrate"]);

    let agent = node.agent(&["--dataplane", "auto"]);
    let st = agent.wait_leftovers_removed(Duration::from_secs(10));
    println!("after the migration: {st}");
    assert_eq!(st["dataplane"], "nftables", "{st}");
    assert!(!holds_agent_rules(&node, "iptables-nft"), "iptables-nft still holds the raw chains");
    hang_fails_over(&node, &agent);
}
