//! What the webhook costs a pod's creation, on the simulated node's real
//! kube-apiserver: pods created as a ReplicaSet creates them, one request each (`kubectl create`
//! of a list, one POST after the other; kubectl's `-v=6` log gives each request's latency), in a
//! labelled namespace (the API server calls the webhook, which mutates the pod) and in an
//! unlabelled one (no call), alternating, in the same run. Also the webhook's own time per
//! review (its histogram), the API server's for the call (`apiserver_admission_webhook_admission_
//! duration_seconds`), and the webhook's RSS after it all. Not a test: `ci/bench.sh` runs it and
//! writes `docs/webhook-bench.md`.

#![forbid(unsafe_code)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use common::{configuration, kubectl, namespace, publish, Ca, Webhook, WEBHOOK_ADDR, WEBHOOK_IP};
use rcgen::SanType;
use serde_json::json;
use testkit::{percentile, require_root, setting, wait_for, Machine, SimNode};

/// One round: this many pods in each namespace.
const PODS: usize = 500;

fn main() {
    require_root();
    let rounds: usize = setting("NLHA_BENCH_WEBHOOK_ROUNDS", 2);
    let out_dir = PathBuf::from(
        std::env::var("NLHA_BENCH_OUT")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs").into()),
    );
    let prefix = std::env::var("NLHA_BENCH_PREFIX")
        .map(|p| format!("{p}w"))
        .unwrap_or_else(|_| format!("w{}", std::process::id() % 100_000));
    let node = SimNode::up_prefixed(&prefix, &["--kube-proxy", "real-iptables"]);
    let tls = node.dir.join("webhook-tls");
    std::fs::create_dir_all(&tls).unwrap();
    let ca = Ca::new();
    let (cert, _, key) = ca.leaf(SanType::IpAddress(WEBHOOK_IP.parse().unwrap()));
    publish(&tls, 1, &cert, &key);
    let hook = Webhook::start(&node, &tls, "169.254.20.10,10.96.0.10");
    let url = format!("https://{WEBHOOK_ADDR}/mutate");
    kubectl(&node, &["apply", "-f", "-"], &configuration(&url, &ca.pem()).to_string());
    namespace(&node, "injected", json!({"nodelocaldns-ha.io/dns-injection": "enabled"}));
    namespace(&node, "plain", json!({}));
    wait_for("the API server calling the webhook", Duration::from_secs(30), || {
        let out =
            kubectl(&node, &["create", "-f", "-", "-o", "json"], &pod("injected").to_string());
        let pod: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (pod["spec"]["dnsPolicy"] == "None").then_some(())
    });

    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        eprintln!("bench: webhook, round {} of {rounds}", round + 1);
        with.extend(create_many(&node, "injected"));
        without.extend(create_many(&node, "plain"));
    }
    let rss_kib = rss_kib(hook.pid());
    let metrics = fetch(&node, &["get", "--raw", "/metrics"]);
    let calls = histogram(
        &metrics,
        "apiserver_admission_webhook_admission_duration_seconds",
        "dns.nodelocaldns-ha.io",
    );
    hook.stop();
    drop(node);

    with.sort_by(f64::total_cmp);
    without.sort_by(f64::total_cmp);
    let p = |v: &[f64], q: f64| percentile(v, q);
    let Machine { date, cores, kernel } = Machine::this();
    let mut md = format!(
        "Webhook benchmark of {date} ({cores}-core VM, kernel {kernel}; `ci/bench.sh`). The \
         simulated node's real kube-apiserver (ci/k8s), the webhook's release build in the node's \
         namespace, its MutatingWebhookConfiguration applied; {n} pods created in each of a \
         labelled namespace (the webhook called, every pod mutated) and an unlabelled one (not \
         called), {PODS} at a time, alternating, one POST each (kubectl `-v=6` gives each \
         request's latency, in whole milliseconds).\n\n\
         | pods created | n | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|\n",
        n = with.len(),
    );
    for (label, v) in [("through the webhook", &with), ("not called", &without)] {
        let max = v.iter().copied().fold(0.0, f64::max);
        writeln!(
            md,
            "| {label} | {} | {} ms | {} ms | {} ms | {max} ms |",
            v.len(),
            p(v, 50.0),
            p(v, 90.0),
            p(v, 99.0)
        )
        .unwrap();
    }
    let added = p(&with, 99.0) - p(&without, 99.0);
    writeln!(
        md,
        "\nAdded by the webhook at p99: **{added} ms** (bound: 5 ms). The API server's own \
         measure of the call (its histogram's buckets): {calls}. The webhook's RSS after \
         them all: **{:.1} MiB** (bound: 20 MiB).",
        rss_kib as f64 / 1024.0
    )
    .unwrap();
    print!("{md}");
    std::fs::write(out_dir.join("webhook-bench.md"), md).expect("write docs/webhook-bench.md");
}

fn pod(namespace: &str) -> serde_json::Value {
    common::pod(namespace, json!({"app": "web"}), json!({}))
}

/// Creates [`PODS`] pods in `namespace`, one POST each; each one's latency, ms.
fn create_many(node: &SimNode, namespace: &str) -> Vec<f64> {
    let items: Vec<_> = (0..PODS).map(|_| pod(namespace)).collect();
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    let out = kubectl(node, &["create", "-f", "-", "-o", "name", "-v=6"], &list.to_string());
    let log = String::from_utf8_lossy(&out.stderr);
    let latencies: Vec<f64> = log
        .lines()
        .filter(|l| l.contains("POST") && l.contains("201 Created"))
        .filter_map(milliseconds)
        .collect();
    assert_eq!(latencies.len(), PODS, "one POST per pod in kubectl's log:\n{log}");
    latencies
}

/// The latency of one request in kubectl's `-v=6` log: `… milliseconds=7` (structured) or
/// `… in 7 milliseconds`.
fn milliseconds(line: &str) -> Option<f64> {
    if let Some(rest) = line.split("milliseconds=").nth(1) {
        return rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok();
    }
    let before = line.split(" milliseconds").next()?;
    before.rsplit(' ').next()?.parse().ok()
}

fn fetch(node: &SimNode, args: &[&str]) -> String {
    String::from_utf8(kubectl(node, args, "").stdout).unwrap()
}

/// A histogram's cumulative buckets for `webhook`'s calls, as `≤ 5 ms: 99.8 %, …`.
fn histogram(metrics: &str, family: &str, webhook: &str) -> String {
    let prefix = format!("{family}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(&format!("name=\"{webhook}\"")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let count: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((le.parse().unwrap_or(f64::INFINITY), count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(_, total)) = buckets.last() else { return "not found".into() };
    buckets
        .iter()
        .filter(|(le, _)| le.is_finite() && *le <= 0.1)
        .map(|(le, n)| format!("≤ {} ms: {:.1} %", le * 1000.0, 100.0 * n / total))
        .collect::<Vec<_>>()
        .join(", ")
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}
