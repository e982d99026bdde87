//! Issue 30, 8: on a node whose kube-proxy is iptables-legacy, the idle agent reads its legacy
//! tables back (`iptables-legacy-save`, a child process each) only when one changed, not on
//! every tick: the tick's check compares the kernel's own copy of each table, in-process, with
//! the one it last read back. A change (a CNI's rule in front of the agent's jump, the jump
//! deleted) is still read back and repaired within a second. Counted, not timed: the real
//! binaries run behind wrappers that record each call.

use std::path::PathBuf;
use std::time::Duration;

use testkit::*;

/// Ticks watched idle: `--interval 100ms`, 3 s.
const IDLE_TICKS: u64 = 30;

/// The saves the wrappers recorded so far, one line each.
struct Saves {
    log: PathBuf,
}

impl Saves {
    /// Wrappers for both families' `iptables-legacy-save` in a directory of `node`'s, and the
    /// `PATH` that puts them first.
    fn wrap(node: &SimNode) -> (Saves, String) {
        let log = node.dir.join("saves.log");
        let path =
            counting_wrappers(node, &["iptables-legacy-save", "ip6tables-legacy-save"], &log);
        (Saves { log }, path)
    }

    fn count(&self) -> usize {
        std::fs::read_to_string(&self.log).unwrap_or_default().lines().count()
    }
}

/// Waits until the agent has sent `n` more cache probes: `n` of its ticks.
fn ticks(agent: &Agent, n: u64) {
    let sent = |s: &serde_json::Value| s["probes"]["cache_udp"]["sent"].as_u64();
    let from = agent.state().as_ref().and_then(sent).expect("state");
    wait_for(&format!("{n} probes"), Duration::from_secs(10), || {
        agent.state().as_ref().and_then(sent).filter(|&s| s >= from + n)
    });
}

/// The agent's finished drift checks so far.
fn checks(node: &SimNode) -> u64 {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| {
            l.strip_prefix("nodelocaldns_ha_dataplane_check_duration_seconds_count ")?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .expect("the check-duration histogram") as u64
}

/// `iptables-legacy args` in the node's namespace, which must succeed.
fn iptables_legacy(node: &SimNode, args: &[&str]) {
    let out = node.run("node", "iptables-legacy", args);
    assert!(out.status.success(), "iptables-legacy {args:?}: {}", describe(&out));
}

/// The rules of `chain` in `table`, as `iptables-legacy -S` prints them.
fn chain(node: &SimNode, table: &str, chain: &str) -> Vec<String> {
    let out = node.run("node", "iptables-legacy", &["-t", table, "-S", chain]);
    assert!(out.status.success(), "{}", describe(&out));
    String::from_utf8_lossy(&out.stdout).lines().skip(1).map(str::to_owned).collect()
}

/// The agent with `dataplane` on an iptables-legacy node, idle for [`IDLE_TICKS`]: checked on
/// every tick, read back at most `most` times (a safety-net round and the read-back of a
/// change the agent made itself at the start may fall in). Then a CNI's rule in front of the
/// agent's jump in `table`'s `builtin` chain, and the jump deleted: each repaired within 1 s.
fn idle_then_drift(dataplane: &str, most: usize, table: &str, builtin: &str, own: &str) {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let (saves, path) = Saves::wrap(&node);
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        &["--dataplane", dataplane, "--interval", "100ms"],
        &[("PATH", &path)],
    );
    let st = agent.state().expect("state");
    assert_eq!(st["accepts_in"], serde_json::json!(["iptables-legacy"]), "{st}");
    ticks(&agent, 3);
    let (checks0, saves0) = (checks(&node), saves.count());
    ticks(&agent, IDLE_TICKS);
    let (checked, saved) = (checks(&node) - checks0, saves.count() - saves0);
    println!(
        "{dataplane}: {IDLE_TICKS} idle ticks, {checked} checks, {saved} iptables-legacy-save"
    );
    assert!(checked >= IDLE_TICKS / 3, "{checked} checks in {IDLE_TICKS} ticks");
    assert!(saved <= most, "{saved} saves in {IDLE_TICKS} idle ticks ({checked} checks)");

    let jump = format!("-A {builtin} -m comment --comment nodelocaldns-ha -j {own}");
    assert_eq!(chain(&node, table, builtin).first(), Some(&jump));
    // A CNI's rule in front of the jump.
    iptables_legacy(&node, &["-t", table, "-I", builtin, "1", "-j", "ACCEPT"]);
    agent.wait_repairs(1, Duration::from_secs(1));
    wait_for("the jump first again", Duration::from_secs(1), || {
        (chain(&node, table, builtin).first() == Some(&jump)).then_some(())
    });
    // The jump deleted.
    let delete: Vec<&str> = ["-t", table, "-D"].into_iter().chain(jump[3..].split(' ')).collect();
    iptables_legacy(&node, &delete);
    agent.wait_repairs(2, Duration::from_secs(1));
    wait_for("the jump back", Duration::from_secs(1), || {
        (chain(&node, table, builtin).first() == Some(&jump)).then_some(())
    });
    let st = agent.state().expect("state");
    assert_eq!(st["repairs"], 2, "{st}");
}

/// `auto` on this node: the route switch in raw and mangle, the ACCEPTs in filter, all legacy.
/// Before: every tick saved raw, mangle and filter (`30 idle ticks, 91 iptables-legacy-save`).
#[test]
fn legacy_node_auto_reads_back_only_on_change() {
    idle_then_drift("auto", 6, "raw", "PREROUTING", "NODELOCALDNS-HA-PREROUTING");
}

/// `--dataplane nftables` on this node: the switch in nftables, the ACCEPTs in legacy filter.
/// Before: filter saved every tick (`30 idle ticks, 30 iptables-legacy-save`).
#[test]
fn legacy_node_nftables_reads_filter_back_only_on_change() {
    idle_then_drift("nftables", 2, "filter", "INPUT", "NODELOCALDNS-HA-INPUT");
}
