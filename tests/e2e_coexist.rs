//! Living beside the node's other netfilter owners: a host firewall that drops by default, a CNI
//! plugin that keeps its raw ACCEPT in front, kube-proxy re-syncing its chains, a process holding
//! the xtables lock, and node-cache installing its own rules.

use std::time::Duration;

use testkit::*;

/// Issue 3, acceptance 3: with filter INPUT DROP (strict: not even all of lo is accepted), DNS to
/// the cache works from a pod and from the host with every dataplane choice.
fn filter_drop(dataplane: &str) {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft", "--filter-drop"]);
    let agent = node.agent(&["--dataplane", dataplane]);
    let st = agent.state().expect("state");
    assert_eq!(st["accepts_in"], serde_json::json!(["iptables-nft"]), "{st}");
    let args = ["--rate", "200", "--duration", "2s", "--report-interval", "0"];
    let pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    let host = node.load("node", CLUSTER_DNS_IP, &args);
    for (client, load) in [("pod", pod), ("host", host)] {
        let summary = load.finish();
        println!("{dataplane} {client}: {summary}");
        assert_eq!(summary["failed"], 0, "{client}: {summary}");
        assert_eq!(summary["by_origin"]["cache"], summary["sent"], "{client}: {summary}");
    }
}

#[test]
fn filter_drop_auto() {
    filter_drop("auto");
}

#[test]
fn filter_drop_nftables() {
    filter_drop("nftables");
}

#[test]
fn filter_drop_iptables_legacy() {
    filter_drop("iptables-legacy");
}

#[test]
fn filter_drop_iptables_nft() {
    filter_drop("iptables-nft");
}

/// Issue 18, point 7: behind the same firewall, lookups keep working through a cache SIGKILL,
/// the cache's return and the agent's teardown, and the teardown leaves nothing of the agent
/// (its ACCEPTs included). Pods lose nothing; host-network clients (no kernel fast path) only
/// lookups sent between the kill and the switch. While the NOTRACK is in, its untracked packets
/// pass INPUT only through the agent's ACCEPTs: a teardown that took those out first would drop
/// pods' queries (first attempts lost after the kill window, or failed lookups).
fn filter_drop_failover_and_teardown(dataplane: &str) {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft", "--filter-drop"]);
    let mut agent = node.agent(&["--dataplane", dataplane]);
    let args = ["--rate", "200", "--duration", "60s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    let mut host = node.load("node", CLUSTER_DNS_IP, &args);
    let killed_at = kill_and_restart_cache(&node, &agent, &mut [&mut pod, &mut host]).killed_at;

    let status = agent.stop(nix::sys::signal::Signal::SIGTERM);
    assert!(status.success(), "agent exited with {status}");
    let dir = agent.state_dir.display().to_string();
    let out = node.cli(&["teardown", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    node.assert_nothing_left();
    // Without the agent's rules, everything goes through kube-proxy's DNAT.
    for load in [&mut pod, &mut host] {
        load.wait_alone("coredns");
    }
    for (client, load) in [("pod", pod), ("host", host)] {
        let (summary, lookups) = load.interrupt_recorded();
        println!("{dataplane} {client}: {summary}");
        assert_eq!(summary["by_origin"]["other"], 0, "{client}: {summary}");
        // Lost only at the kill: until the client has seen CoreDNS answer after it.
        let switched = coredns_seen_after(&lookups, killed_at);
        let failed = sent_at(&summary, "failures_at_ms");
        let lost = sent_at(&summary, "first_attempt_lost_at_ms");
        println!("{client}: {} failed, {} first attempts lost", failed.len(), lost.len());
        if client == "pod" {
            assert_eq!(summary["failed"], 0, "{client}: {summary}");
        }
        assert_within(client, &failed, killed_at - 100, switched);
        assert_within(client, &lost, killed_at - 100, switched.max(killed_at + 100));
    }
}

#[test]
fn filter_drop_failover_and_teardown_nftables() {
    filter_drop_failover_and_teardown("nftables");
}

#[test]
fn filter_drop_failover_and_teardown_iptables_legacy() {
    filter_drop_failover_and_teardown("iptables-legacy");
}

#[test]
fn filter_drop_failover_and_teardown_iptables_nft() {
    filter_drop_failover_and_teardown("iptables-nft");
}

/// What a simnode noise loop's rounds did since its `-start` (`simnode.sh NOISE-rounds`).
#[derive(Debug, Clone, Copy)]
struct Rounds {
    ok: u64,
    failed: u64,
    /// cni-noise: rounds that found its rule already first in raw PREROUTING.
    in_front: u64,
}

impl Rounds {
    /// `ok=N failed=M in_front=K`.
    fn parse(text: &str) -> Option<Rounds> {
        let count = |key: &str| {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
        };
        Some(Rounds { ok: count("ok")?, failed: count("failed")?, in_front: count("in_front")? })
    }
}

fn rounds(node: &SimNode, noise: &str) -> Rounds {
    let text = node.script(&[&format!("{noise}-rounds")]);
    Rounds::parse(&text).unwrap_or_else(|| panic!("{noise}-rounds printed {text:?}"))
}

/// What one run under noise saw: the client's summary, the agent's state, the loop's rounds
/// that ended while the client ran (`during`, its `in_front` included) and in all (`total`),
/// the first rule of raw PREROUTING read (in the flavour's iptables) as the client ended, and
/// the answer a pod got once the noise had stopped and the agent had undone its last round.
struct Noisy {
    summary: serde_json::Value,
    st: serde_json::Value,
    during: Rounds,
    total: Rounds,
    raw_first: String,
    settled: String,
}

/// Runs pod lookups at 200/s while simnode's `noise` loop (`cni-noise`, `kube-proxy-resync`)
/// rewrites the node's rules, until the loop has finished `n` more successful rounds (one a
/// second); a failed round fails the test at once.
fn under_noise(kube_proxy: &str, dataplane: &str, noise: &str, n: u64) -> Noisy {
    let node = SimNode::up_with(&["--kube-proxy", kube_proxy]);
    let agent = node.agent(&["--dataplane", dataplane]);
    node.script(&[&format!("{noise}-start")]);
    let before = rounds(&node, noise);
    let args = ["--rate", "200", "--duration", "120s", "--report-interval", "0"];
    let load = node.load("pod1", CLUSTER_DNS_IP, &args);
    let counts = node.dir.join(format!("{noise}.rounds"));
    wait_for(&format!("{n} successful rounds of {noise}"), Duration::from_secs(30), || {
        let now = std::fs::read_to_string(&counts).ok().as_deref().and_then(Rounds::parse);
        if let Some(r) = now.filter(|r| r.failed > 0) {
            panic!("a round of {noise} failed: {r:?} (its log: {noise}.log)");
        }
        now.filter(|r| r.ok >= before.ok + n)
    });
    let raw_prerouting = || {
        // The CNI's flavour is kube-proxy's (`iptables-nft` or `iptables-legacy`).
        let out = node.run("node", kube_proxy, &["-t", "raw", "-S", "PREROUTING"]);
        assert!(out.status.success(), "{}", describe(&out));
        let raw = String::from_utf8_lossy(&out.stdout).into_owned();
        raw.lines().find(|l| l.starts_with("-A PREROUTING ")).unwrap_or("").replace('"', "")
    };
    if noise == "cni-noise" && dataplane != "nftables" {
        // The last round put the CNI's rule first: end once the agent has moved its jump back
        // (one repair per round that found it moved), not in the middle of the CNI's win.
        let done = Rounds::parse(&std::fs::read_to_string(&counts).unwrap_or_default());
        let moved = done.map_or(0, |r| r.ok - r.in_front);
        agent.wait_repairs(moved, Duration::from_secs(10));
    }
    let summary = load.interrupt();
    let after = rounds(&node, noise);
    let raw_first = if noise == "cni-noise" { raw_prerouting() } else { String::new() };
    node.script(&[&format!("{noise}-stop")]);
    let total = rounds(&node, noise);
    if noise == "cni-noise" && dataplane != "nftables" {
        agent.wait_repairs(total.ok - total.in_front, Duration::from_secs(10));
    }
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test"]);
    let settled = String::from_utf8_lossy(&answer.stdout).trim().to_owned();
    let during = Rounds {
        ok: after.ok - before.ok,
        failed: after.failed - before.failed,
        in_front: after.in_front - before.in_front,
    };
    println!("{noise}: {during:?} while the client ran, {total:?} in all");
    Noisy { summary, st: agent.state().expect("state"), during, total, raw_first, settled }
}

/// Asserts no round of the noise failed (those that succeeded while the client ran were
/// waited for).
fn assert_ran(noisy: &Noisy) {
    assert_eq!(noisy.total.failed, 0, "rounds of the noise failed: {:?}", noisy.total);
}

/// Issue 3, acceptance 4: a CNI that puts an ACCEPT-everything rule at the top of raw
/// PREROUTING every second. nftables' chain runs before every iptables raw chain, so nothing
/// changes: the CNI's rule stays first in raw PREROUTING (every round finds it there) while pods
/// are answered by the cache; the iptables backends get their jump back before every next round,
/// and pods are answered by the cache once they have.
fn cni_noise(kube_proxy: &str, dataplane: &str) {
    let noisy = under_noise(kube_proxy, dataplane, "cni-noise", 4);
    let (summary, st) = (&noisy.summary, &noisy.st);
    println!("{dataplane}: repairs {} summary {summary}", st["repairs"]);
    assert_ran(&noisy);
    assert_eq!(summary["failed"], 0, "{summary}");
    let coredns = summary["by_origin"]["coredns"].as_u64().unwrap();
    let sent = summary["sent"].as_u64().unwrap();
    if dataplane == "nftables" {
        let cni = "-A PREROUTING -m comment --comment cali:fake -j ACCEPT";
        assert_eq!(noisy.raw_first, cni, "the CNI's rule is not first in raw PREROUTING");
        // Every round that ended while the client ran found it first: it stayed in front.
        assert_eq!(noisy.during.in_front, noisy.during.ok, "{:?}", noisy.during);
        assert_eq!(coredns, 0, "the CNI's raw ACCEPT got in front of nftables: {summary}");
        assert_eq!(summary["by_origin"]["cache"], summary["sent"], "{summary}");
    } else {
        // Judged by rounds, not by the share CoreDNS answered (that grows with the time a repair
        // takes on a loaded machine): no round of the CNI found its rule still first, so the
        // agent put its jump back before every next round, a second later (it looks every
        // tick, 100 ms; a repair takes tens of ms); and after the last, pods reach the cache.
        println!("CoreDNS answered {coredns} of {sent}");
        assert_eq!(noisy.total.in_front, 0, "the CNI's rule stayed first: {:?}", noisy.total);
        assert!(st["repairs"].as_u64().unwrap() >= 3, "the agent never fought back: {st}");
    }
    assert_eq!(noisy.settled, CACHE_ANSWER, "after the noise, pods are not on the cache");
}

#[test]
fn cni_noise_nftables() {
    cni_noise("iptables-nft", "nftables");
}

#[test]
fn cni_noise_iptables_nft() {
    cni_noise("iptables-nft", "iptables-nft");
}

#[test]
fn cni_noise_iptables_legacy() {
    cni_noise("iptables-legacy", "iptables-legacy");
}

/// Issue 3, acceptance 4: kube-proxy re-running `iptables-restore --noflush` of its own chains
/// (or its nftables transaction) every second never touches the agent's rules; every sync
/// succeeded, 3 of them while the client ran.
fn kube_proxy_resync(kube_proxy: &str, dataplane: &str) {
    let noisy = under_noise(kube_proxy, dataplane, "kube-proxy-resync", 3);
    assert_ran(&noisy);
    assert_eq!(noisy.st["repairs"], 0, "kube-proxy's sync changed the agent's rules: {}", noisy.st);
    assert_eq!(noisy.summary["by_origin"]["cache"], noisy.summary["sent"], "{}", noisy.summary);
}

#[test]
fn kube_proxy_resync_iptables_legacy() {
    kube_proxy_resync("iptables-legacy", "iptables-legacy");
}

#[test]
fn kube_proxy_resync_iptables_nft() {
    kube_proxy_resync("iptables-nft", "iptables-nft");
}

#[test]
fn kube_proxy_resync_nftables_mode() {
    kube_proxy_resync("nftables", "nftables");
}

/// Issue 3, acceptance 5: another process holds the xtables lock for 10 s. iptables-legacy
/// changes wait (reported in the state), the agent keeps running, the ruleset is never half
/// written, and the change lands once the lock is free. Pods fail over meanwhile through the
/// kernel fast path.
#[test]
fn xtables_lock_held_delays_legacy_changes_only() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let lock = node.dir.join("xtables.lock").display().to_string();
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        &["--dataplane", "iptables-legacy", "--xtables-wait", "1s"],
        &[("XTABLES_LOCKFILE", &lock)],
    );
    let held = node.script(&["xtables-lock-hold", "10"]);
    assert_eq!(held.trim(), lock);
    let load = node.load(
        "pod1",
        CLUSTER_DNS_IP,
        &["--rate", "200", "--duration", "6s", "--report-interval", "0"],
    );
    node.signal("cache-kill");
    let busy = wait_for("the lock to be reported", Duration::from_secs(8), || {
        agent.state().filter(|s| s["last_error"].as_str().is_some_and(|e| e.contains("lock")))
    });
    println!("while locked: {}", busy["last_error"]);
    assert_eq!(busy["route"], "upstream", "{busy}");
    // The kernel still holds the Local ruleset, whole: the fast path fails pods over.
    let raw = node.run("node", "iptables-legacy-save", &["-t", "raw"]);
    let raw = String::from_utf8_lossy(&raw.stdout);
    assert!(raw.contains("-d 10.96.0.10/32 -p udp -m udp --dport 53 -m addrtype"), "{raw}");
    // The agent is alive and writing its state while it waits.
    let before = busy["updated_unix_ms"].as_u64().unwrap();
    wait_for("the state to keep updating", Duration::from_secs(5), || {
        agent.state().filter(|s| s["updated_unix_ms"].as_u64() > Some(before))
    });
    node.script(&["xtables-lock-release"]);
    wait_for("the change to land", Duration::from_secs(10), || {
        agent.state().filter(|s| s["last_error"].is_null())
    });
    let raw = node.run("node", "iptables-legacy-save", &["-t", "raw"]);
    let raw = String::from_utf8_lossy(&raw.stdout);
    // Upstream: no NOTRACK of the cluster-DNS IP (its conntrack pin, `-j CT`, stays).
    let steered = raw.lines().any(|l| l.contains("-d 10.96.0.10/32") && l.ends_with("-j NOTRACK"));
    assert!(!steered, "Upstream not installed after the lock: {raw}");
    let summary = load.finish();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
}

#[test]
fn xtables_lock_held_does_not_touch_nftables() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let lock = node.dir.join("xtables.lock").display().to_string();
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        &["--dataplane", "nftables"],
        &[("XTABLES_LOCKFILE", &lock)],
    );
    node.script(&["xtables-lock-hold", "10"]);
    node.signal("cache-kill");
    let up = agent.wait_route("upstream", Duration::from_secs(2));
    assert!(up["last_error"].is_null(), "{up}");
    assert_eq!(node.agent_table(), Some(node.expected_table("upstream")));
    node.script(&["xtables-lock-release"]);
}

/// Issue 3, acceptance 6: node-cache's own rules (it runs without -setupiptables=false) are
/// reported in the state and by `status`.
#[test]
fn node_cache_rules_are_reported() {
    node_cache_rules_reported("iptables-nft");
}

/// The same with iptables-legacy, whose tables the search copies from the kernel each period
/// and saves only when changed, raw and filter alone: never a whole save (kube-proxy's nat
/// table, seconds of CPU every 10 s on a busy node). Before: `iptables-legacy-save` of every
/// table every period.
#[test]
fn node_cache_rules_in_iptables_legacy_are_reported_without_saving_nat() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let log = node.dir.join("saves.log");
    let path = counting_wrappers(&node, &["iptables-legacy-save", "ip6tables-legacy-save"], &log);
    // The start's detection saves everything once; what is counted comes after.
    let started = || std::fs::write(&log, "").unwrap();
    node_cache_rules_reported_on(&node, &[("PATH", &path)], started);
    let saves = std::fs::read_to_string(&log).unwrap_or_default();
    println!("saves after the start:\n{saves}");
    assert!(!saves.is_empty(), "the removal was not read back");
    for save in saves.lines() {
        let table = save.split_once(" -t ").map(|(_, t)| t.trim());
        assert!(matches!(table, Some("raw" | "mangle" | "filter")), "a save of {save:?}");
    }
}

/// node-cache's rules in iptables-nft, the agent told to switch in iptables-legacy: the two
/// flavours' raw chains share a priority, so its rules may run after node-cache's, and the
/// NOTRACK of queries to the cluster-DNS IP (pods' and host clients', UDP and TCP) is in effect:
/// counted apart in the state and `/metrics`, and named as such.
#[test]
fn node_cache_rules_the_agent_cannot_get_ahead_of_are_said_to_be_in_effect() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft"]);
    node.script(&["node-cache-rules"]);
    let agent = node.agent(&["--dataplane", "iptables-legacy"]);
    let st = testkit::node_cache_rules_are_named(&node, &agent);
    assert_eq!(st["foreign"]["in_effect"], 4, "{st}");
    let warnings = st["warnings"].as_array().expect("warnings");
    let in_effect: Vec<&str> = warnings
        .iter()
        .filter_map(|w| w.as_str())
        .filter(|w| w.contains("cannot get ahead of"))
        .collect();
    assert_eq!(in_effect.len(), 4, "{in_effect:?}");
    assert!(in_effect.iter().all(|w| w.contains("-d 10.96.0.10/32")), "{in_effect:?}");
    let (_, metrics) = node.http_get("/metrics");
    assert!(metrics.contains("\nnodelocaldns_ha_foreign_notrack_rules_in_effect 4\n"), "{metrics}");
    node.script(&["node-cache-rules", "--remove"]);
    agent.wait_warnings(false, Duration::from_secs(15));
    node.tear_down(agent);
}

fn node_cache_rules_reported(kube_proxy: &str) {
    let node = SimNode::up_with(&["--kube-proxy", kube_proxy]);
    node_cache_rules_reported_on(&node, &[], || {});
}

/// node-cache's rules on `node`, the agent started (`started` called once the warning shows),
/// the warning shown; the rules removed, the warning gone.
fn node_cache_rules_reported_on(node: &SimNode, env: &[(&str, &str)], started: impl FnOnce()) {
    node.script(&["node-cache-rules"]);
    let agent =
        node.agent_env(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, &["--dataplane", "auto"], env);
    testkit::node_cache_rules_are_named(node, &agent);
    started();

    // Once node-cache's rules are gone, so is the warning.
    node.script(&["node-cache-rules", "--remove"]);
    agent.wait_warnings(false, Duration::from_secs(15));
}

/// Issue 3, drift: someone flushes the raw table, deletes the jump, or replaces the agent's
/// chain; the agent puts back exactly its ruleset within a tick, counted in its own ticks.
fn iptables_drift(flavour: &str) {
    let node = SimNode::up_with(&["--kube-proxy", flavour]);
    let dataplane = format!("iptables-{}", flavour.trim_start_matches("iptables-"));
    let agent = node.agent(&["--dataplane", &dataplane]);
    let iptables = flavour.to_owned();
    let save = format!("{flavour}-save");
    let restore = format!("{flavour}-restore");
    let ours = || {
        let out = node.run("node", &save, &["-t", "raw"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| l.contains("NODELOCALDNS-HA") && l.starts_with("-A"))
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    };
    let installed = ours();
    assert!(installed.len() > 4, "{installed:?}");
    let tampers: Vec<Box<dyn Fn()>> = vec![
        Box::new(|| {
            node.run("node", &iptables, &["-t", "raw", "-F"]);
        }),
        Box::new(|| {
            let jump = ["-t", "raw", "-D", "PREROUTING", "-m", "comment", "--comment"];
            let mut args = jump.to_vec();
            args.extend(["nodelocaldns-ha", "-j", "NODELOCALDNS-HA-PREROUTING"]);
            let out = node.run("node", &iptables, &args);
            assert!(out.status.success(), "{}", describe(&out));
        }),
        Box::new(|| {
            // A restore that declares the agent's chain replaces its contents.
            let script = "*raw\n:NODELOCALDNS-HA-PREROUTING - [0:0]\n-A NODELOCALDNS-HA-PREROUTING -j RETURN\nCOMMIT\n";
            let mut child = node
                .cmd("node", &restore)
                .arg("--noflush")
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
            assert!(child.wait().unwrap().success());
        }),
    ];
    for (i, tamper) in (1..).zip(&tampers) {
        tamper();
        let before = checks_and_repairs(&node);
        // Deadlines are slack for a busy machine; the agent's own checks are what is judged.
        wait_for(&format!("repair of tamper {i}"), Duration::from_secs(5), || {
            (ours() == installed).then_some(())
        });
        let after = wait_for(&format!("repair {i} counted"), Duration::from_secs(5), || {
            let (checks, repairs) = checks_and_repairs(&node);
            (repairs >= i).then_some(checks)
        });
        // At the next check (one a tick when none is in flight): counted from after the tamper
        // (so a check the test was slow to look past cannot count), at most the check in
        // flight across it, then the one that found it; none if the finder was done already.
        // And one more that the scrape which saw the repair may count: a legacy node is
        // checked every third tick (300 ms), and the scrape's round trip can span one (CI saw
        // it at every tick).
        let took = after - before.0;
        assert!(before.1 >= i || took <= 3, "tamper {i} repaired {took} checks later");
        // The next tamper waits until the agent has also read its repair back.
        agent.wait_repairs(i, Duration::from_secs(5));
    }
}

#[test]
fn iptables_nft_drift_is_repaired() {
    iptables_drift("iptables-nft");
}

#[test]
fn iptables_legacy_drift_is_repaired() {
    iptables_drift("iptables-legacy");
}

/// The agent's finished drift checks and its repairs so far, from one scrape.
fn checks_and_repairs(node: &SimNode) -> (u64, u64) {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "{body}");
    let value = |name: &str| {
        let line = body.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '));
        let value = line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
        value.unwrap_or_else(|| panic!("no {name} in /metrics:\n{body}")) as u64
    };
    (
        value("nodelocaldns_ha_dataplane_check_duration_seconds_count"),
        value("nodelocaldns_ha_drift_repairs_total"),
    )
}

/// Drift checks the agent has run (`iptables-save` per family each, for the iptables backends).
fn checks(node: &SimNode) -> u64 {
    checks_and_repairs(node).0
}

/// Waits until the agent has sent `n` more cache probes: `n` of its ticks.
fn ticks(agent: &Agent, n: u64) {
    let sent = |s: &serde_json::Value| s["probes"]["cache_udp"]["sent"].as_u64();
    let from = agent.state().as_ref().and_then(sent).expect("state");
    wait_for(&format!("{n} probes"), Duration::from_secs(10), || {
        agent.state().as_ref().and_then(sent).filter(|&s| s >= from + n)
    });
}

/// iptables-nft's tables are nftables tables, whose every change the kernel announces: the agent
/// reads them back (two `iptables-nft-save` runs, each fetching its family's whole ruleset: about
/// a second with kube-proxy's 50,000 nat rules) when one of its own tables changes, not on every
/// tick and not when kube-proxy rewrites nat.
#[test]
fn iptables_nft_is_checked_when_its_tables_change_not_every_tick() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft"]);
    // At the fast pace: ticks every 100 ms.
    let args = ["--dataplane", "iptables-nft", "--interval", "100ms", "--quiet-interval", "0s"];
    let agent = node.agent(&args);
    ticks(&agent, 3);
    let calm = checks(&node);
    ticks(&agent, 20);
    assert_eq!(checks(&node), calm, "checked on the tick although the kernel announces changes");

    // kube-proxy's churn: nat rules come and go.
    let iptables = |args: &[&str]| {
        let out = node.run("node", "iptables-nft", args);
        assert!(out.status.success(), "iptables-nft {args:?}: {}", describe(&out));
    };
    iptables(&["-t", "nat", "-N", "KUBE-CHURN"]);
    for _ in 0..10 {
        iptables(&["-t", "nat", "-A", "KUBE-CHURN", "-d", "10.96.7.7/32", "-j", "RETURN"]);
        iptables(&["-t", "nat", "-F", "KUBE-CHURN"]);
    }
    ticks(&agent, 5);
    assert_eq!(checks(&node), calm, "kube-proxy's nat changes made the agent read raw back");

    // A change to the agent's raw table is heard and repaired, long before the 30 s safety net
    // (the state file that counts it is written once a second).
    iptables(&["-t", "raw", "-I", "PREROUTING", "-d", "10.96.0.10/32", "-j", "ACCEPT"]);
    agent.wait_repairs(1, Duration::from_secs(10));
    assert!(checks(&node) > calm);
}

/// iptables-legacy announces nothing: its tables are checked every third tick
/// (`LOOK_UNANNOUNCED`, 300 ms at `--interval 100ms`; each copied from the kernel in-process;
/// `iptables-legacy-save` runs only when a copy changed, `tests/e2e_legacy_idle.rs`), with no
/// announcement to wait for.
#[test]
fn iptables_legacy_is_checked_every_third_tick() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    // Ticks every 100 ms: at the fast pace (the quiet pace's ticks are a second apart).
    let args = ["--dataplane", "iptables-legacy", "--interval", "100ms", "--quiet-interval", "0s"];
    let agent = node.agent(&args);
    ticks(&agent, 3);
    let before = checks(&node);
    ticks(&agent, 30);
    let after = checks(&node);
    // Ten looks in 30 ticks; a tick that slips past a look's instant may take one.
    assert!(after >= before + 8, "{} checks in 30 ticks", after - before);
}

/// Issues 17 and 14: on an iptables-nft node whose kube-proxy rewrites a filter chain every
/// second (endpoint churn), the kernel announces each sync, but no change to a chain the agent
/// reads back: no sync costs a read-back (one was a few `iptables-nft -S <chain>` processes,
/// half the agent's CPU on such a node), and none is ever `iptables-nft-save` of a whole family
/// (0.3 s of CPU with kube-proxy's 50,000 nat rules). A rule put in front of the agent's jump
/// in that table is still read back and repaired at once. The real iptables binaries run
/// behind wrappers that record each call.
#[test]
fn kube_proxy_churn_costs_no_read_back() {
    const SYNCS: usize = 5;
    let node = SimNode::up_with(&["--kube-proxy", "iptables-nft", "--filter-drop"]);
    let calls = node.dir.join("iptables-calls.log");
    let binaries = ["iptables-nft", "ip6tables-nft", "iptables-nft-save", "ip6tables-nft-save"];
    let path = counting_wrappers(&node, &binaries, &calls);
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        &["--dataplane", "iptables-nft"],
        &[("PATH", &path)],
    );
    let st = agent.state().expect("state");
    assert_eq!(st["accepts_in"], serde_json::json!(["iptables-nft"]), "{st}");
    let read_backs = || {
        let (status, body) = node.http_get("/metrics");
        assert_eq!(status, 200, "/metrics");
        body.lines()
            .find_map(|l| {
                l.strip_prefix("nodelocaldns_ha_dataplane_check_duration_seconds_count ")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .expect("the check-duration histogram")
    };
    let logged = || std::fs::read_to_string(&calls).unwrap_or_default();
    // Detection at start saves whole families; what counts is what follows.
    let (checks0, calls0) = (read_backs(), logged().lines().count());
    node.script(&["kube-proxy-resync-start"]);
    let synced = || {
        let log = std::fs::read_to_string(node.dir.join("kube-proxy-resync.log")).unwrap();
        log.lines().filter(|l| l.ends_with(" synced")).count()
    };
    wait_for("kube-proxy's syncs", Duration::from_secs(30), || (synced() > SYNCS).then_some(()));
    node.script(&["kube-proxy-resync-stop"]);
    let syncs = synced() as u64;
    let checks = read_backs() - checks0;
    let text = logged();
    let after: Vec<&str> = text.lines().skip(calls0).collect();
    let whole: Vec<&&str> =
        after.iter().filter(|l| l.contains("-save ") && l.contains("-t ")).collect();
    assert!(whole.is_empty(), "whole-table saves after start: {whole:?}");
    let listings = after.iter().filter(|l| l.contains(" -S ")).count() as u64;
    println!("{syncs} syncs: {checks} read-backs, {listings} chain listings");
    // Two whole read-backs (16 listings each: both tables, both families) are allowed, for
    // ticks that came before the change watch was heard, or an announcement that could not
    // be read; the safety net's every 30 s is one more. One per sync would be 6 or more.
    assert!(checks <= 3, "{checks} read-backs for {syncs} syncs");
    assert!(listings <= 48, "{listings} listings for {checks} read-backs");
    let st = agent.state().expect("state");
    assert_eq!(st["repairs"], 0, "{st}");

    // A CNI's rule in front of the agent's jump in INPUT: read back and repaired.
    let ipt = |args: &[&str]| node.cmd("node", "iptables-nft").args(args).output().unwrap();
    assert!(ipt(&["-I", "INPUT", "1", "-j", "ACCEPT"]).status.success());
    agent.wait_repairs(1, Duration::from_secs(5));
    assert!(read_backs() > checks0 + checks);
}
