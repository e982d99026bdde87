//! The real node part (`testdata/realnode.sh`: a real kubelet and containerd running
//! node-local-dns from upstream's manifest with the real node-cache, kube-proxy and CoreDNS as
//! a kubeadm cluster has them): what a client pod sees across the operations operators run,
//! with node-local-dns alone (upstream's manifest as it ships: node-cache's own NOTRACK rules,
//! no preStop) and with the agent (installed from the chart, node-local-dns patched as the
//! README says: the `drain` preStop, `-setupiptables=false -skipteardown`):
//! * `kubectl -n kube-system rollout restart daemonset/node-local-dns`, each arrangement;
//! * the agent's own upgrade (`helm upgrade` to a new image tag: its DaemonSet rolls);
//!
//! and, idle on that node, node-cache's CPU beside the agent's (the agent should cost less than
//! what it guards), two rounds of `secs`, side by side.
//!
//! The client: dnsload in a client pod (entered from the machine, so that nothing of the
//! kubelet carries its output), asking 10.96.0.10 as glibc does by default (timeout 5 s, 2
//! attempts, a new source port per attempt), at `rate` lookups a second, from 2 s before the
//! operation until the cache answers alone again and 2 s more. Needs the agent's image
//! (`NLHA_AGENT_IMAGE`, as `ci/bench.sh` builds it).

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{clock_ticks_per_s, Cluster, RealNode};

const NS: &str = "kube-system";
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelocaldns-ha");
/// How long the client runs before the operation and after the cache is back alone.
const AROUND: Duration = Duration::from_secs(2);
/// How long node-local-dns alone may take to send pods back to its cache after a restart:
/// node-cache as upstream runs it (no `-pidfile`) puts its rules in at its first sync, a
/// minute after it starts.
const BACK_ALONE: Duration = Duration::from_secs(150);

/// The rows (event, arrangement, the client's figures) and the idle CPU of each.
pub fn real_node(prefix: &str, rate: u32, secs: u64, rounds: u32) -> (Vec<Value>, Value) {
    let image = std::env::var("NLHA_AGENT_IMAGE")
        .expect("the real node part needs NLHA_AGENT_IMAGE (ci/image/build.sh prints it)");
    let node = RealNode::up_prefixed(prefix, &["--agent-image", &image]);
    let mut rows = Vec::new();

    // node-local-dns alone, once node-cache's own rules are in (its first sync).
    let rules =
        testkit::poll(Duration::from_secs(120), || (node_cache_rules(&node) > 0).then_some(()));
    assert!(rules.is_some(), "node-cache put no rules in");
    rows.push(row(
        "node-local-dns rolled",
        "node-local-dns alone",
        measure(&node, rate, BACK_ALONE, || rollout(&node, "daemonset/node-local-dns")),
    ));

    // With the agent: installed as the README says.
    let (repo, tag) = image.rsplit_once(':').expect("the image has a tag");
    helm(
        &node,
        &[
            "install",
            "nodelocaldns-ha",
            CHART,
            "--namespace",
            NS,
            "--set",
            &format!("image.repository={repo}"),
            "--set",
            &format!("image.tag={tag}"),
            "--set",
            "clusterDNSIP=10.96.0.10",
            "--wait",
            "--timeout",
            "2m",
        ],
    );
    node.script("node-local-dns-patch", &[&image]);
    let quick = Duration::from_secs(60);
    rows.push(row(
        "node-local-dns rolled",
        "the agent",
        measure(&node, rate, quick, || rollout(&node, "daemonset/node-local-dns")),
    ));
    let upgraded = format!("{repo}:upgraded");
    node.script("image-tag", &[&image, &upgraded]);
    rows.push(row(
        "the agent upgraded",
        "the agent",
        measure(&node, rate, quick, || {
            helm(
                &node,
                &[
                    "upgrade",
                    "nodelocaldns-ha",
                    CHART,
                    "--namespace",
                    NS,
                    "--reuse-values",
                    "--set",
                    "image.tag=upgraded",
                    "--wait",
                    "--timeout",
                    "2m",
                ],
            );
            node.wait_rollout(NS, "daemonset/nodelocaldns-ha", Duration::from_secs(120));
        }),
    ));

    let idle = idle_cpu(&node, secs, rounds);
    (rows, idle)
}

fn row(event: &str, arrangement: &str, summary: Value) -> Value {
    println!("bench: real node, {event}, {arrangement}: {}", testkit::counts(&summary));
    json!({
        "event": event,
        "arrangement": arrangement,
        "sent": summary["sent"],
        "failed": summary["failed"],
        "first_attempt_lost": summary["first_attempt_lost"],
        "by_origin": summary["by_origin"],
        "longest_ms": summary["latency_ms"]["max"],
    })
}

/// The client's summary across `operation`: started 2 s before it, stopped 2 s after the cache
/// answers alone again (waited for up to `back`).
fn measure(node: &Cluster, rate: u32, back: Duration, operation: impl FnOnce()) -> Value {
    let client = node.pods("default", "app=dns-client").into_iter().next().expect("a client pod");
    let rate = rate.to_string();
    let args = ["--server", "10.96.0.10", "--timeout", "5s", "--attempts", "2", "--rate", &rate];
    let mut load = node.dnsload_in("default", &client, "client", &args);
    load.load.wait_cache_answers();
    std::thread::sleep(AROUND);
    operation();
    load.wait_back_on_cache(back);
    std::thread::sleep(AROUND);
    load.stop().0
}

fn rollout(node: &Cluster, what: &str) {
    node.kubectl(&["-n", NS, "rollout", "restart", what]);
    node.wait_rollout(NS, what, Duration::from_secs(180));
}

fn helm(node: &Cluster, args: &[&str]) {
    let out = node.helm(args);
    assert!(out.status.success(), "helm {args:?}: {}", testkit::describe(&out));
}

fn node_cache_rules(node: &Cluster) -> usize {
    let raw = node.in_node(&["iptables-nft-save", "-t", "raw"]);
    raw.lines().filter(|l| l.contains("NodeLocal DNS Cache")).count()
}

/// The CPU ticks (own and reaped children's) of the process `pid`.
fn ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    let after = stat.rsplit_once(") ").expect("stat's comm").1;
    let f: Vec<u64> = after.split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
    // utime, stime, cutime, cstime: fields 14-17, here 11-14 (counted from the state).
    f[11] + f[12] + f[13] + f[14]
}

/// node-cache's and the agent's idle CPU (mCPU, children included), `rounds` of `secs` each,
/// measured side by side over the same seconds.
fn idle_cpu(node: &Cluster, secs: u64, rounds: u32) -> Value {
    let cache_pod = node.only_pod(NS, "k8s-app=node-local-dns", Duration::from_secs(60));
    let agent_pod = node.only_pod(NS, "k8s-app=nodelocaldns-ha", Duration::from_secs(60));
    let cache = node.container_pid(NS, &cache_pod, "node-cache");
    let agent = node.container_pid(NS, &agent_pod, "agent");
    let hz = clock_ticks_per_s() as f64;
    let mut cache_m = Vec::new();
    let mut agent_m = Vec::new();
    for _ in 0..rounds {
        let (c0, a0, t0) = (ticks(cache), ticks(agent), Instant::now());
        std::thread::sleep(Duration::from_secs(secs));
        let (c1, a1, dt) = (ticks(cache), ticks(agent), t0.elapsed().as_secs_f64());
        cache_m.push(((c1 - c0) as f64 / hz / dt * 1000.0 * 10.0).round() / 10.0);
        agent_m.push(((a1 - a0) as f64 / hz / dt * 1000.0 * 10.0).round() / 10.0);
    }
    println!("bench: real node idle, node-cache {cache_m:?} mCPU, the agent {agent_m:?} mCPU");
    json!({"seconds": secs, "node_cache_mcpu": cache_m, "agent_mcpu": agent_m})
}

/// The part's table, for docs/bench.md.
pub fn table(rows: &[Value], idle: &Value) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\nOn the real node (a real kubelet runs node-local-dns from upstream's manifest and the \
         agent from the chart; a client pod asks 10.96.0.10 with glibc's defaults):\n\n\
         | event | arrangement | lookups | failed | first attempts lost | answered by CoreDNS | \
         longest lookup |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        md += &format!(
            "| {} | {} | {} | {} | {} | {} | {} ms |\n",
            r["event"].as_str().unwrap_or(""),
            r["arrangement"].as_str().unwrap_or(""),
            r["sent"],
            r["failed"],
            r["first_attempt_lost"],
            r["by_origin"]["coredns"],
            r["longest_ms"]
        );
    }
    let list = |key: &str| {
        idle[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    md += &format!(
        "\nIdle on that node, {} s a round, side by side: node-cache {} mCPU, the agent {} mCPU.\n",
        idle["seconds"],
        list("node_cache_mcpu"),
        list("agent_mcpu")
    );
    md
}
