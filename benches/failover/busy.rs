//! The `busy` part (issue 17, acceptance 6; issue 35, part 4): the agent on a busy node, its
//! CPU with its children (iptables) and a host-network client across a cache SIGKILL, at
//! default settings (`auto`: iptables-nft, its ACCEPTs in iptables-nft's filter table), INPUT
//! policy DROP. Three rows: the stand-in node, its kube-proxy syncing every second and
//! rewriting a filter chain each time as endpoint churn does, with 0 and then 50,000
//! kube-proxy-shaped nat rules; and the node with the real parts, real kube-proxy (iptables
//! mode) holding 5,000 Services of two endpoints each, created through the API, while the test
//! bed, playing the endpoint controller, changes 10 of their EndpointSlices a second (real
//! kube-proxy rewrites its rules after them, at most once a second). On that node, the churn
//! going on, the nftables switch beside the least nftables transaction (issue 35, part 2).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{
    clock_ticks_per_s, cpu_ticks, now_ms, sleep_until_ms, Lookup, Outcome, SimNode, CLUSTER_DNS_IP,
};

use super::{histogram, load_nat_rules, ms, round1, start_agent, stop_agent};

/// Services of the real node's row, two endpoints each (some 35,000 rules of real kube-proxy's).
const REAL_SERVICES: u32 = 5_000;
/// EndpointSlice changes a second on the real node.
const REAL_CHURN_PER_S: &str = "10";

/// The three rows (see the module's doc): the agent's CPU over `cpu_secs` and its read-backs,
/// then a host-network client of the cluster-DNS IP at `rate` lookups/s across a cache SIGKILL
/// (restarted after 2 s); the agents' logs to `logs`.
pub(crate) fn busy_node(prefix: &str, rate: u32, cpu_secs: u64, logs: &Path) -> Vec<Value> {
    let mut rows = Vec::new();
    let node = SimNode::up_prefixed(
        &format!("{prefix}k"),
        &["--kube-proxy", "iptables-nft", "--filter-drop"],
    );
    let resync: [&[&str]; 2] = [&["kube-proxy-resync-start"], &["kube-proxy-resync-stop"]];
    for nat_rules in [0, 50_000] {
        if nat_rules > 0 {
            load_nat_rules(&node, nat_rules / 4, &["iptables-nft"]);
        }
        eprintln!("bench: busy node, {nat_rules} nat rules");
        let log = logs.join(format!("busy-node-{nat_rules}-agent.log"));
        let row = busy_row(&node, resync, rate, cpu_secs, &log);
        rows.push(with(json!({"kube_proxy": "stand-in", "nat_rules": nat_rules}), row));
    }
    drop(node);
    let real = SimNode::up_prefixed(
        &format!("{prefix}q"),
        &["--kube-proxy", "real-iptables", "--filter-drop"],
    );
    eprintln!("bench: busy node, real kube-proxy, {REAL_SERVICES} Services");
    real.script(&["busy-services", &REAL_SERVICES.to_string()]);
    let nat = real.run("node", "iptables-nft-save", &["-t", "nat"]);
    let nat = String::from_utf8_lossy(&nat.stdout);
    let nat_rules = nat.lines().filter(|l| l.starts_with("-A ")).count();
    let churn: [&[&str]; 2] =
        [&["endpoint-churn-start", REAL_CHURN_PER_S], &["endpoint-churn-stop"]];
    let log = logs.join("busy-node-real-agent.log");
    let row = busy_row(&real, churn, rate, cpu_secs, &log);
    let changes = real.script(&["endpoint-churn-changes"]);
    // The nftables switch on the same node, the churn going on, beside the least transaction.
    real.script(churn[0]);
    let switch = super::switch_latency(&real, &["nftables"], 20, nat_rules).pop();
    real.script(churn[1]);
    let base = json!({
        "kube_proxy": "real",
        "services": REAL_SERVICES,
        "nat_rules": nat_rules,
        "endpoint_changes_per_s": REAL_CHURN_PER_S.parse::<u32>().unwrap_or(0),
        "endpoint_changes_accepted": changes.trim().parse::<u64>().ok(),
        "nftables_switch": switch,
    });
    rows.push(with(base, row));
    rows
}

/// `base`'s fields, then `more`'s.
fn with(mut base: Value, more: Value) -> Value {
    if let (Some(b), Value::Object(m)) = (base.as_object_mut(), more) {
        b.extend(m);
    }
    base
}

/// One row on `node`: the agent started at defaults, kube-proxy kept busy (`churn`: the simnode
/// commands that start and stop it), the agent's CPU and read-backs over `cpu_secs`, then the
/// host client across a cache SIGKILL; the agent's log to `log`.
fn busy_row(node: &SimNode, churn: [&[&str]; 2], rate: u32, cpu_secs: u64, log: &Path) -> Value {
    let [churn_start, churn_stop] = churn;
    let agent = start_agent(node, &["--dataplane", "auto"]);
    let state = agent.state().expect("state");
    assert_eq!(state["dataplane"], "iptables-nft", "{state}");
    assert_eq!(state["accepts_in"], json!(["iptables-nft"]), "{state}");
    node.script(churn_start);
    let pid = agent.pid().expect("agent pid");
    let hz = clock_ticks_per_s();
    let check = "nodelocaldns_ha_dataplane_check_duration_seconds";
    let (sum0, count0) = histogram(node, check);
    let (own0, children0) = cpu_ticks(pid).expect("the agent runs");
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(cpu_secs));
    let (own1, children1) = cpu_ticks(pid).expect("the agent runs");
    let wall = t0.elapsed().as_secs_f64();
    let (sum1, count1) = histogram(node, check);
    let mcpu = |ticks: u64| round1(ticks as f64 / hz / wall * 1000.0);
    let checks = count1 - count0;

    // The fault, with kube-proxy still syncing.
    let apply = "nodelocaldns_ha_dataplane_apply_duration_seconds";
    let (asum0, acount0) = histogram(node, apply);
    let duration = "6s";
    let args = ["--rate", &rate.to_string(), "--duration", duration];
    let mut load = node.load("node", CLUSTER_DNS_IP, &args);
    load.wait_cache_answers();
    let started = now_ms();
    sleep_until_ms(started + 1_500);
    let killed = node.signal("cache-kill");
    sleep_until_ms(killed + 2_000);
    node.script(&["cache-start"]);
    let restarted = now_ms();
    let (summary, lookups) = load.finish_recorded();
    let (asum1, acount1) = histogram(node, apply);
    node.script(churn_stop);
    std::fs::write(log, agent.log_text()).expect("write the agent's log");
    stop_agent(node, agent);
    let down: Vec<&Lookup> =
        lookups.iter().filter(|l| l.start >= killed as f64 && l.start < restarted as f64).collect();
    let failed: Vec<f64> =
        down.iter().filter(|l| l.outcome == Outcome::Failed).map(|l| l.start).collect();
    let window = match (failed.first(), failed.last()) {
        (Some(a), Some(b)) => round1(b - a),
        _ => 0.0,
    };
    let first_lost = down.iter().filter(|l| l.first_attempt_lost()).count();
    json!({
        "cpu_seconds_measured": round1(wall),
        "agent_mcpu": mcpu(own1 - own0),
        "children_mcpu": mcpu(children1 - children0),
        "total_mcpu": mcpu(own1 - own0 + children1 - children0),
        "read_backs": checks,
        "read_back_mean_ms": round1((sum1 - sum0) / checks.max(1.0) * 1000.0),
        "applies_in_fault": acount1 - acount0,
        "apply_mean_ms": round1((asum1 - asum0) / (acount1 - acount0).max(1.0) * 1000.0),
        "lookups_while_down": down.len(),
        "failed_while_down": failed.len(),
        "first_attempts_lost_while_down": first_lost,
        "failure_window_ms": window,
        "summary": summary,
    })
}

/// The part's table for docs/bench.md.
pub(crate) fn table(busy: &[Value]) -> String {
    let mut md = "\nA busy node at default settings (the agent in iptables-nft, its ACCEPTs in \
                  iptables-nft's filter table; INPUT policy DROP): the stand-in kube-proxy \
                  syncing every second, rewriting a filter chain each time as endpoint churn \
                  does, with 0 and 50,000 kube-proxy-shaped nat rules; and real kube-proxy \
                  (iptables mode) with 5,000 Services of two endpoints each, 10 of their \
                  EndpointSlices changed a second through the API. CPU over 20 s of it, the \
                  agent's iptables children included; then a host-network client of \
                  10.96.0.10 across a cache SIGKILL (restarted 2 s later).\n\n\
                  | kube-proxy | nat rules | agent CPU, children included | read-backs (mean) | switch (agent's apply) | host client: failed while the cache was down | failure window |\n\
                  |---|---|---|---|---|---|---|\n"
        .to_string();
    for b in busy {
        let kube_proxy = match b["kube_proxy"].as_str() {
            Some("real") => format!(
                "real, {} Services, {} EndpointSlice changes a second",
                b["services"], b["endpoint_changes_per_s"]
            ),
            _ => "stand-in, syncing every second".to_string(),
        };
        let _ = writeln!(
            md,
            "| {kube_proxy} | {} | {} mCPU (own {}, children {}) | {} ({}) | {} | {} of {} | {} |",
            b["nat_rules"],
            b["total_mcpu"],
            b["agent_mcpu"],
            b["children_mcpu"],
            b["read_backs"],
            ms(&b["read_back_mean_ms"]),
            ms(&b["apply_mean_ms"]),
            b["failed_while_down"],
            b["lookups_while_down"],
            ms(&b["failure_window_ms"]),
        );
    }
    let real_switch = busy.iter().find_map(|b| b.get("nftables_switch").filter(|s| !s.is_null()));
    if let Some(s) = real_switch {
        let precise = |v: &Value| v.as_f64().map_or("-".into(), |f| format!("{f:.2} ms"));
        let _ = writeln!(
            md,
            "\nThe agent in nftables on the real node, the churn going on (median of {} flips \
             after {} warm-up): the kernel's commit of its switch {}, the least nftables \
             transaction committed once beside each flip {} (÷: {}), 20 in a row {}; its apply \
             (commit and read-back) {}.",
            s["flips_counted"],
            s["warm_up_flips"],
            precise(&s["commit_median_ms"]),
            precise(&s["commit_floor_once_median_ms"]),
            s["commit_to_floor"],
            precise(&s["commit_floor_warm_median_ms"]),
            ms(&s["apply_median_ms"]),
        );
    }
    md
}
