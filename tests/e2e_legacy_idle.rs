//! Issue 30, 8: on a node whose kube-proxy is iptables-legacy, the idle agent reads its legacy
//! tables back (`iptables-legacy-save`, a child process each) only when one changed, not on
//! every look: a look (every third tick) compares the kernel's own copy of each table,
//! in-process, with the one it last read back. A change (a CNI's rule in front of the agent's jump, the jump
//! deleted) is still read back and repaired within a second, in the agent's own ticks. Counted,
//! not timed: the real binaries run behind wrappers that record each call, and the ticks are
//! the cache probes the agent sent.

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

/// The sum of the agent's samples whose name and labels begin with `series`, from /metrics
/// (counted as they happen; the state file is written once a second).
fn metric(node: &SimNode, series: &str) -> u64 {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "{body}");
    let values: Vec<f64> = body
        .lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
        .collect();
    assert!(!values.is_empty(), "no {series} in /metrics:\n{body}");
    values.iter().sum::<f64>() as u64
}

/// The agent's finished drift checks so far.
fn checks(node: &SimNode) -> u64 {
    metric(node, "nodelocaldns_ha_dataplane_check_duration_seconds_count ")
}

/// Makes `drift`, then waits for the agent's next repair (counted, and `repaired` true);
/// returns the ticks it took (the cache probes sent from before the drift until the repair was
/// seen), at most 10 (a second at `--interval 100ms`). In ticks, not by a clock: a busy machine
/// delays the agent's ticks and its repair alike.
fn repaired_within_a_second(
    node: &SimNode,
    drift: impl FnOnce(),
    repaired: impl Fn() -> bool,
) -> u64 {
    let probes = || metric(node, "nodelocaldns_ha_probes_total{target=\"cache\",protocol=\"udp\"");
    let repairs = || metric(node, "nodelocaldns_ha_drift_repairs_total");
    let (probes0, repairs0) = (probes(), repairs());
    drift();
    wait_for("a repair", Duration::from_secs(20), || {
        (repairs() > repairs0 && repaired()).then_some(())
    });
    let ticks = probes() - probes0;
    assert!(ticks <= 10, "repaired after {ticks} ticks");
    ticks
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

/// The agent with `dataplane` on an iptables-legacy node, idle for [`IDLE_TICKS`]: checked every
/// third tick (`LOOK_UNANNOUNCED`), read back at most `most` times (a safety-net round and the read-back of a
/// change the agent made itself at the start may fall in). Then a CNI's rule in front of the
/// agent's jump in `table`'s `builtin` chain, and the jump deleted: each repaired within 10
/// ticks (a second).
fn idle_then_drift(dataplane: &str, most: usize, table: &str, builtin: &str, own: &str) {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let (saves, path) = Saves::wrap(&node);
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        // At the fast pace: ticks every 100 ms (the quiet pace's are a second apart).
        &["--dataplane", dataplane, "--interval", "100ms", "--quiet-interval", "0s"],
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
    assert!(checked >= IDLE_TICKS / 4, "{checked} checks in {IDLE_TICKS} ticks");
    assert!(saved <= most, "{saved} saves in {IDLE_TICKS} idle ticks ({checked} checks)");

    let jump = format!("-A {builtin} -m comment --comment nodelocaldns-ha -j {own}");
    assert_eq!(chain(&node, table, builtin).first(), Some(&jump));
    let jump_first = || chain(&node, table, builtin).first() == Some(&jump);
    // A CNI's rule in front of the jump.
    let insert = || iptables_legacy(&node, &["-t", table, "-I", builtin, "1", "-j", "ACCEPT"]);
    let ticks = repaired_within_a_second(&node, insert, jump_first);
    // The jump deleted.
    let delete: Vec<&str> = ["-t", table, "-D"].into_iter().chain(jump[3..].split(' ')).collect();
    let ticks_deleted =
        repaired_within_a_second(&node, || iptables_legacy(&node, &delete), jump_first);
    println!("{dataplane}: repaired after {ticks} and {ticks_deleted} ticks");
    let st = agent.wait_repairs(2, Duration::from_secs(10));
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
