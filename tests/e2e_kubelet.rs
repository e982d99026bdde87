//! End to end on a real node (`testdata/realnode.sh`): a real kubelet and containerd run
//! node-local-dns from upstream's manifest (the real node-cache), kube-proxy and CoreDNS as a
//! kubeadm cluster has them, and client pods whose resolv.conf the kubelet wrote; the agent is
//! installed as an operator installs it (`helm install` of `charts/`, node-local-dns patched as
//! the docs say), from the image the repository's Dockerfile builds (`NLHA_AGENT_IMAGE`, as
//! ci/test.sh passes it).
//!
//! One node for the whole suite (it takes a minute to come up): this file is its own harness
//! (`harness = false`), and runs its cases in order on that node, each leaving the node as it
//! found it (the agent installed, every pod Ready). A failed case is reported, and the next still
//! runs; the run fails if any did. `cargo test --test e2e_kubelet [FILTER...]` runs the cases
//! whose names contain a filter (the install always runs first). Run as root; `REALNODE_KEEP=1`
//! leaves the node up for a look (`testdata/realnode.sh down PREFIX` then).
//!
//! Every fault runs with a client pod under load (glibc's getaddrinfo() through the kubelet's
//! resolv.conf, 100 lookups a second) and asserts the lookups that failed: none.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use serde_json::Value;
use testkit::{counts, describe, Cluster, RealNode};

/// The release name and namespace of the agent's chart.
const RELEASE: &str = "nodelocaldns-ha";
/// The chart, as the repository has it.
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelocaldns-ha");
const NS: &str = "kube-system";
const AGENT: &str = "k8s-app=nodelocaldns-ha";
const NODE_LOCAL_DNS: &str = "k8s-app=node-local-dns";
const CLIENTS: &str = "app=dns-client";
/// The clients' rate under every fault.
const RATE: u32 = 100;

type Case = (&'static str, fn(&Suite));

/// The cases, in the order they run.
const CASES: &[Case] = &[
    ("installed_from_the_chart", installed_from_the_chart),
    ("cache_container_sigkill_loses_no_lookup", cache_container_sigkill_loses_no_lookup),
    ("cache_hang_loses_no_lookup", cache_hang_loses_no_lookup),
    ("cache_oom_killed_loses_no_lookup", cache_oom_killed_loses_no_lookup),
    ("node_local_dns_rollout_loses_no_lookup", node_local_dns_rollout_loses_no_lookup),
    ("agent_upgrade_loses_no_lookup", agent_upgrade_loses_no_lookup),
    ("agent_pod_deleted_loses_no_lookup", agent_pod_deleted_loses_no_lookup),
    ("agent_killed_on_upstream_loses_no_lookup", agent_killed_on_upstream_loses_no_lookup),
    (
        "kubelet_and_containerd_restarted_lose_no_lookup",
        kubelet_and_containerd_restarted_lose_no_lookup,
    ),
    ("helm_uninstall_loses_no_lookup", helm_uninstall_loses_no_lookup),
    (
        "an_uninstall_without_reports_leaves_rules_that_kubectl_debug_tears_down",
        an_uninstall_without_reports_leaves_rules_that_kubectl_debug_tears_down,
    ),
    (
        "a_node_back_with_the_startup_taint_runs_no_pod_before_its_dns",
        a_node_back_with_the_startup_taint_runs_no_pod_before_its_dns,
    ),
    (
        "webhook_gives_a_labelled_namespace_two_nameservers",
        webhook_gives_a_labelled_namespace_two_nameservers,
    ),
    ("node_local_dns_unpatched", node_local_dns_unpatched),
    (
        "kube_proxy_moved_to_nftables_mode_loses_no_lookup",
        kube_proxy_moved_to_nftables_mode_loses_no_lookup,
    ),
];

fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    if std::env::args().any(|a| a == "--list") {
        for (name, _) in CASES {
            println!("{name}: test");
        }
        return;
    }
    let image = std::env::var("NLHA_AGENT_IMAGE").unwrap_or_else(|_| {
        panic!("NLHA_AGENT_IMAGE must name the agent's image (ci/image/build.sh prints it)")
    });
    let started = Instant::now();
    let node = RealNode::up(&["--agent-image", &image]);
    let suite = Suite { node: &node, image };
    let mut failed = Vec::new();
    let mut ran = 0;
    for &(name, case) in CASES {
        let first = name == CASES[0].0;
        if !first && !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        println!("test {name} ...");
        let t = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| case(&suite))) {
            Ok(()) => println!("test {name} ... ok ({:.1} s)", t.elapsed().as_secs_f64()),
            Err(_) => {
                println!("test {name} ... FAILED ({:.1} s)", t.elapsed().as_secs_f64());
                failed.push(name);
                // The install failed: nothing after it can mean anything.
                if first {
                    break;
                }
            }
        }
    }
    drop(node);
    println!(
        "\ntest result: {}. {} passed; {} failed; finished in {:.1} s",
        if failed.is_empty() { "ok" } else { "FAILED" },
        ran - failed.len(),
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        println!("failures: {}", failed.join(", "));
        std::process::exit(101);
    }
}

struct Suite<'a> {
    node: &'a Cluster,
    image: String,
}

impl Suite<'_> {
    /// The agent's image under another tag (an upgrade with the same bits).
    fn image_tagged(&self, tag: &str) -> String {
        let (repo, _) = self.image.rsplit_once(':').expect("the image has a tag");
        let target = format!("{repo}:{tag}");
        self.node.script("image-tag", &[&self.image, &target]);
        target
    }

    fn image_repo_tag(&self) -> (&str, &str) {
        self.image.rsplit_once(':').expect("the image has a tag")
    }

    /// The first client pod.
    fn client(&self) -> String {
        self.node.pods("default", CLIENTS).into_iter().next().expect("a client pod")
    }

    /// The agent's `status --json`, asked in its pod.
    fn agent_status(&self) -> Value {
        self.try_agent_status().unwrap_or_else(|e| panic!("the agent's status: {e}"))
    }

    /// [`Suite::agent_status`], or why it could not be had (a kubelet that has just restarted
    /// refuses an exec into a pod it has not synced yet).
    fn try_agent_status(&self) -> Result<Value, String> {
        let pod = self.node.only_pod(NS, AGENT, Duration::from_secs(60));
        let out = self.node.try_kubectl(&[
            "-n",
            NS,
            "exec",
            &pod,
            "--",
            "nodelocaldns-ha",
            "status",
            "--json",
        ]);
        if !out.status.success() {
            return Err(describe(&out));
        }
        serde_json::from_slice(&out.stdout)
            .map_err(|e| format!("status --json: {e}: {}", describe(&out)))
    }

    /// Waits for the agent (in its pod) to report `route`.
    fn wait_route(&self, route: &str, deadline: Duration) {
        let mut last = Err(String::new());
        let ok = testkit::poll(deadline, || {
            last = self.try_agent_status();
            last.as_ref().is_ok_and(|st| st["route"] == route).then_some(())
        });
        assert!(
            ok.is_some(),
            "the agent did not report route {route} within {deadline:?}: {last:?}"
        );
    }

    /// Every pod of the agent, node-local-dns and the clients Ready, the agent on `Local`.
    fn wait_settled(&self) {
        self.node.wait_rollout(NS, "daemonset/node-local-dns", Duration::from_secs(120));
        self.node.wait_rollout(NS, "daemonset/nodelocaldns-ha", Duration::from_secs(120));
        self.node.wait_rollout("default", "deployment/dns-client", Duration::from_secs(120));
        self.wait_route("local", Duration::from_secs(60));
    }
}

/// Runs `fault` with a client pod under load, waits for the cache to answer again, and asserts
/// that no lookup failed; returns the summary.
fn under_load(s: &Suite, what: &str, fault: impl FnOnce()) -> Value {
    let client = s.client();
    let mut load = s.node.load(&client, RATE);
    load.load.wait_cache_answers();
    fault();
    load.wait_back_on_cache(Duration::from_secs(120));
    let (summary, _lookups) = load.stop();
    println!("{what}: {}", counts(&summary));
    assert_eq!(summary["failed"], 0, "{what}: lookups failed: {summary}");
    assert!(summary["sent"].as_u64().unwrap_or(0) > 0, "{what}: no lookup was sent: {summary}");
    summary
}

/// The agent installed as the README says: the chart with `helm install`, then node-local-dns
/// patched with the two commands the install's NOTES print (`-setupiptables=false
/// -skipteardown`, the drain preStop); every pod Ready; `helm test` passes; the clients'
/// queries answered by the real node-cache.
fn installed_from_the_chart(s: &Suite) {
    let notes = helm_install(s, &[]);
    println!("{notes}");
    // node-local-dns patched with the commands the install's NOTES print, run as printed (by
    // bash from the repository's root; kubectl the node's, run in its mount namespace, so the
    // patch files by their full path there).
    let patches: Vec<&str> = notes
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("kubectl -n kube-system patch"))
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(patches.iter().filter(|l| l.contains("kubectl")).count(), 2, "{notes}");
    let root = env!("CARGO_MANIFEST_DIR");
    let patches = patches.join("\n").replace(" manifests/", &format!(" {root}/manifests/"));
    let prefix = s.node.dir.file_name().and_then(|p| p.to_str()).expect("the node's prefix");
    let script =
        format!("kubectl() {{ testdata/realnode.sh kubectl {prefix} \"$@\"; }}\n{patches}\n");
    let out = std::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(root)
        .env("REALNODE_DIR", s.node.dir.parent().expect("the nodes' directory"))
        .output()
        .expect("bash");
    assert!(out.status.success(), "the NOTES' patches:\n{script}\n{}", describe(&out));
    s.wait_settled();
    let args = node_cache_args(s);
    assert!(args.ends_with(&["-setupiptables=false".into(), "-skipteardown".into()]), "{args:?}");
    let status = s.agent_status();
    println!("the agent: route {}, dataplane {}", status["route"], status["dataplane"]);
    assert_eq!(status["route"], "local", "{status}");
    assert!(agent_rules_in(s), "no rules of the agent's on the node");

    // The chart's own test: its pod asks the node-local IP and the kube-dns ClusterIP, and
    // prints the node's status.
    let out = s.node.helm(&["test", RELEASE, "--namespace", NS, "--logs", "--timeout", "2m"]);
    let text = describe(&out);
    assert!(out.status.success(), "helm test:\n{text}");
    for seen in ["169.254.20.10:53", "10.96.0.10:53", "answered", "agent:       running"] {
        assert!(text.contains(seen), "helm test's logs lack {seen:?}:\n{text}");
    }

    // The cache is the real node-cache: its first words.
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let log = s.node.kubectl(&["-n", NS, "logs", &pod, "-c", "node-cache"]);
    assert!(log.contains("Starting node-cache image: 1.26.8"), "node-cache's log:\n{log}");
    println!(
        "node-cache: {}",
        log.lines().find(|l| l.contains("Starting node-cache")).unwrap_or("")
    );
    // A client's lookups go to it.
    let client = s.client();
    let mut load = s.node.load(&client, 20);
    load.load.wait_alone("cache");
    let (summary, _) = load.stop();
    println!("the cache answering: {}", counts(&summary));
    assert_eq!(summary["failed"], 0, "{summary}");
}

/// `helm install` of the chart with the suite's image and `values` (`--set` pairs), waiting for
/// its pods; its output (the NOTES).
fn helm_install(s: &Suite, values: &[&str]) -> String {
    let (repo, tag) = s.image_repo_tag();
    let image = [format!("image.repository={repo}"), format!("image.tag={tag}")];
    let mut args = vec!["install", RELEASE, CHART, "--namespace", NS, "--wait", "--timeout", "2m"];
    for v in image
        .iter()
        .map(String::as_str)
        .chain(["clusterDNSIP=10.96.0.10"])
        .chain(values.iter().copied())
    {
        args.extend(["--set", v]);
    }
    let out = s.node.helm(&args);
    assert!(out.status.success(), "helm install:\n{}", describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// node-cache's container SIGKILLed (its process, as the OOM killer or a crash would end it):
/// the kubelet restarts it; meanwhile CoreDNS answers.
fn cache_container_sigkill_loses_no_lookup(s: &Suite) {
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    under_load(s, "node-cache SIGKILLed", || {
        nix_kill(pid, "KILL");
    });
    s.wait_settled();
}

/// node-cache's process hung (SIGSTOP) for long enough that the agent leaves it, then resumed.
fn cache_hang_loses_no_lookup(s: &Suite) {
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    under_load(s, "node-cache hung", || {
        nix_kill(pid, "STOP");
        s.wait_route("upstream", Duration::from_secs(30));
        nix_kill(pid, "CONT");
    });
    s.wait_settled();
}

/// node-cache OOM-killed by its container's memory limit (the kernel's OOM killer in the
/// container's memory cgroup, which the kubelet reports as `OOMKilled`): node-local-dns given
/// a limit of 128 MiB (upstream's manifest has none), then a process of the test's joins the
/// container's cgroup and takes 300 MiB, node-cache made the OOM killer's first choice
/// (`oom_score_adj` 1000).
fn cache_oom_killed_loses_no_lookup(s: &Suite) {
    let limit = r#"{"spec":{"template":{"spec":{"containers":[{"name":"node-cache","resources":{"limits":{"memory":"128Mi"}}}]}}}}"#;
    s.node.kubectl(&[
        "-n",
        NS,
        "patch",
        "daemonset",
        "node-local-dns",
        "--type=strategic",
        "-p",
        limit,
    ]);
    s.wait_settled();
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    let cgroup =
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("node-cache's cgroups");
    let memory = cgroup
        .lines()
        .find_map(|l| l.split_once(":memory:").map(|(_, path)| path.to_string()))
        .expect("node-cache's memory cgroup");
    std::fs::write(format!("/proc/{pid}/oom_score_adj"), "1000").expect("oom_score_adj");
    under_load(s, "node-cache OOM-killed", || {
        let mut hog = std::process::Command::new("/usr/bin/python3")
            .args([
                "-c",
                "import sys, time\nsys.stdin.read(1)\nx = b'x' * (300 << 20)\ntime.sleep(60)",
            ])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("the hog");
        let procs = format!("/sys/fs/cgroup/memory{memory}/cgroup.procs");
        std::fs::write(&procs, hog.id().to_string()).expect("the hog into node-cache's cgroup");
        use std::io::Write;
        hog.stdin.take().expect("stdin").write_all(b"go").expect("the hog started");
        let _ = hog.wait();
        let oom = testkit::poll(Duration::from_secs(60), || {
            let p = s.node.get_json(&["-n", NS, "get", "pod", &pod]);
            let last = &p["status"]["containerStatuses"][0]["lastState"]["terminated"];
            (last["reason"] == "OOMKilled").then_some(())
        });
        assert!(oom.is_some(), "node-cache was not OOMKilled");
    });
    s.wait_settled();
}

/// `kubectl rollout restart daemonset/node-local-dns`: the old pod's preStop drains to CoreDNS,
/// the new one takes over.
fn node_local_dns_rollout_loses_no_lookup(s: &Suite) {
    let before = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    under_load(s, "node-local-dns rolled", || {
        s.node.kubectl(&["-n", NS, "rollout", "restart", "daemonset/node-local-dns"]);
        s.node.wait_rollout(NS, "daemonset/node-local-dns", Duration::from_secs(180));
    });
    let after = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    assert_ne!(before, after, "the rollout left the same pod");
    s.wait_settled();
}

/// `helm upgrade` to a new image tag: the agent's DaemonSet rolls.
fn agent_upgrade_loses_no_lookup(s: &Suite) {
    let before = s.node.only_pod(NS, AGENT, Duration::from_secs(60));
    let upgraded = s.image_tagged("upgraded");
    let (repo, tag) = upgraded.rsplit_once(':').expect("a tag");
    under_load(s, "the agent upgraded", || {
        let out = s.node.helm(&[
            "upgrade",
            RELEASE,
            CHART,
            "--namespace",
            NS,
            "--reuse-values",
            "--set",
            &format!("image.repository={repo}"),
            "--set",
            &format!("image.tag={tag}"),
            "--wait",
            "--timeout",
            "2m",
        ]);
        assert!(out.status.success(), "helm upgrade:\n{}", describe(&out));
        s.node.wait_rollout(NS, "daemonset/nodelocaldns-ha", Duration::from_secs(120));
    });
    let after = s.node.only_pod(NS, AGENT, Duration::from_secs(60));
    assert_ne!(before, after, "the upgrade left the same pod");
    s.wait_settled();
}

/// The agent's pod deleted: its DaemonSet makes another.
fn agent_pod_deleted_loses_no_lookup(s: &Suite) {
    let before = s.node.only_pod(NS, AGENT, Duration::from_secs(60));
    under_load(s, "the agent's pod deleted", || {
        s.node.kubectl(&["-n", NS, "delete", "pod", &before, "--wait=true"]);
        s.node.wait_rollout(NS, "daemonset/nodelocaldns-ha", Duration::from_secs(120));
    });
    s.wait_settled();
}

/// The agent's container SIGKILLed while flipped to `Upstream` (maintenance): the kubelet
/// restarts it and it keeps the flip; released, back to the cache.
fn agent_killed_on_upstream_loses_no_lookup(s: &Suite) {
    let pod = s.node.only_pod(NS, AGENT, Duration::from_secs(60));
    let flip = ["-n", NS, "exec", &pod, "--", "nodelocaldns-ha", "flip", "upstream"];
    s.node.kubectl(&[&flip[..], &["--for", "10m", "--reason", "maintenance"]].concat());
    s.wait_route("upstream", Duration::from_secs(10));
    let client = s.client();
    let mut load = s.node.load(&client, RATE);
    load.load.wait_alone("coredns");
    let pid = s.node.container_pid(NS, &pod, "agent");
    nix_kill(pid, "KILL");
    // The kubelet restarts the container; the flip, recorded in the state directory, holds.
    let restarted = testkit::poll(Duration::from_secs(60), || {
        let p = s.node.get_json(&["-n", NS, "get", "pod", &pod]);
        (p["status"]["containerStatuses"][0]["restartCount"].as_u64() >= Some(1)
            && p["status"]["containerStatuses"][0]["ready"] == true)
            .then_some(())
    });
    assert!(restarted.is_some(), "the agent's container was not restarted and Ready");
    s.wait_route("upstream", Duration::from_secs(30));
    s.node.kubectl(&["-n", NS, "exec", &pod, "--", "nodelocaldns-ha", "release"]);
    s.wait_route("local", Duration::from_secs(30));
    load.load.wait_alone("cache");
    let (summary, _) = load.stop();
    println!("the agent killed on Upstream: {}", counts(&summary));
    assert_eq!(summary["failed"], 0, "{summary}");
    s.wait_settled();
}

/// The startup taint: the chart's `clusterReports.startupTaint` on, then the node stopped
/// (every process of it killed, its netfilter, /run and the pods' network gone, as a reboot
/// leaves it) and replaced: its Node object and its pods deleted, as when a new node takes its
/// name; started again, the kubelet registers it with the taint (`--register-with-taints`).
/// Polled from the kubelet's registration on: no client pod is bound to the node while the
/// taint is on it; once it is gone, the clients' first lookups are answered.
fn a_node_back_with_the_startup_taint_runs_no_pod_before_its_dns(s: &Suite) {
    const TAINT: &str = "nodelocaldns-ha.io/dns-not-ready";
    let out = s.node.helm(&[
        "upgrade",
        RELEASE,
        CHART,
        "--namespace",
        NS,
        "--reuse-values",
        "--set",
        "clusterReports.enabled=true",
        "--set",
        "clusterReports.startupTaint=true",
        "--wait",
        "--timeout",
        "2m",
    ]);
    assert!(out.status.success(), "helm upgrade:\n{}", describe(&out));
    s.wait_settled();
    let node = s.node.kubectl(&["get", "nodes", "-o", "jsonpath={.items[0].metadata.name}"]);
    s.node.script("node-stop", &[]);
    s.node.kubectl(&["delete", "node", &node, "--wait=true"]);
    s.node.kubectl(&["delete", "pods", "--all", "--all-namespaces", "--force", "--grace-period=0"]);
    s.node.script("node-start", &["--register-with-taints", &format!("{TAINT}:NoSchedule")]);

    let (mut tainted_samples, mut bound_while_tainted) = (0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        assert!(Instant::now() < deadline, "the clients never ran untainted");
        // The pods first, then the node: the taint is only ever taken off, so a node still
        // tainted after the pods were read was tainted when they were bound.
        let pods = s.node.get_json(&["-n", "default", "get", "pods", "-l", CLIENTS]);
        let pods = pods["items"].as_array().cloned().unwrap_or_default();
        let n = s.node.try_kubectl(&["get", "node", &node, "-o", "json"]);
        if !n.status.success() {
            continue; // not registered yet
        }
        let n: Value = serde_json::from_slice(&n.stdout).expect("the Node's JSON");
        let tainted =
            n["spec"]["taints"].as_array().is_some_and(|t| t.iter().any(|t| t["key"] == TAINT));
        if tainted {
            tainted_samples += 1;
            bound_while_tainted.extend(
                pods.iter()
                    .filter(|p| p["spec"]["nodeName"].is_string())
                    .map(|p| format!("{} ({})", p["metadata"]["name"], p["status"]["phase"])),
            );
        } else if !pods.is_empty() && pods.iter().all(|p| p["status"]["phase"] == "Running") {
            break;
        }
    }
    println!("the node registered with the startup taint: {tainted_samples} samples tainted");
    assert!(tainted_samples > 0, "the node was never seen with the startup taint");
    assert!(
        bound_while_tainted.is_empty(),
        "client pods bound while tainted: {bound_while_tainted:?}"
    );
    // Their DNS works from their first lookup.
    s.node.wait_rollout("default", "deployment/dns-client", Duration::from_secs(120));
    let mut load = s.node.load(&s.client(), RATE);
    load.load.wait_cache_answers();
    let (summary, _) = load.stop();
    println!("the first lookups after the taint: {}", counts(&summary));
    assert_eq!(summary["failed"], 0, "{summary}");
    s.wait_settled();
}

/// The admission webhook as a Deployment (installed as manifests/README.md says, without
/// cert-manager), and a client Deployment in a namespace labelled for it, started by the
/// kubelet: the pod's resolv.conf as the kubelet wrote it from the mutated pod (the node-local
/// IP, then kube-dns; ACK's options), and its lookups through a node-cache kill.
fn webhook_gives_a_labelled_namespace_two_nameservers(s: &Suite) {
    const NSW: &str = "webhooked";
    s.node.script("webhook-install", &[&s.image]);
    s.node.kubectl(&["create", "namespace", NSW]);
    s.node.kubectl(&["label", "namespace", NSW, "nodelocaldns-ha.io/dns-injection=enabled"]);
    s.node.kubectl(&[
        "-n",
        NSW,
        "create",
        "deployment",
        "dns-client",
        "--image=localhost/realnode/dns-client:1",
    ]);
    s.node.wait_rollout(NSW, "deployment/dns-client", Duration::from_secs(120));
    let pod = s.node.only_pod(NSW, CLIENTS, Duration::from_secs(60));
    let stored = s.node.get_json(&["-n", NSW, "get", "pod", &pod]);
    assert_eq!(stored["spec"]["dnsPolicy"], "None", "not mutated: {stored}");
    let resolv = s.node.kubectl(&["-n", NSW, "exec", &pod, "--", "cat", "/etc/resolv.conf"]);
    println!("the mutated pod's resolv.conf, as the kubelet wrote it:\n{resolv}");
    let nameservers: Vec<&str> =
        resolv.lines().filter_map(|l| l.strip_prefix("nameserver ")).collect();
    assert_eq!(nameservers, ["169.254.20.10", "10.96.0.10"], "{resolv}");
    assert!(
        resolv.contains(&format!("search {NSW}.svc.cluster.local svc.cluster.local cluster.local")),
        "{resolv}"
    );
    let options = resolv.lines().find(|l| l.starts_with("options ")).unwrap_or_default();
    for want in ["ndots:3", "attempts:2", "timeout:1"] {
        assert!(options.contains(want), "{want} not in {options:?}");
    }
    let cache = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &cache, "node-cache");
    // `kubectl create deployment` names the container after the image.
    let mut load = s.node.load_in(NSW, &pod, "dns-client", RATE);
    load.load.wait_cache_answers();
    nix_kill(pid, "KILL");
    load.wait_back_on_cache(Duration::from_secs(120));
    let (summary, _) = load.stop();
    println!("the webhook's pod through a kill: {}", counts(&summary));
    assert_eq!(summary["failed"], 0, "{summary}");
    s.node.kubectl(&["delete", "namespace", NSW, "--wait=false"]);
    s.wait_settled();
}

/// node-cache's arguments (its container's `args`).
fn node_cache_args(s: &Suite) -> Vec<String> {
    let ds = s.node.get_json(&["-n", NS, "get", "daemonset", "node-local-dns"]);
    let args = ds["spec"]["template"]["spec"]["containers"][0]["args"].as_array().cloned();
    args.unwrap_or_default().iter().filter_map(|a| a.as_str().map(String::from)).collect()
}

/// node-cache's arguments replaced (a JSON patch), and the rollout waited for.
fn set_node_cache_args(s: &Suite, args: &[String]) {
    let patch = serde_json::json!([
        {"op": "test", "path": "/spec/template/spec/containers/0/name", "value": "node-cache"},
        {"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": args},
    ]);
    let patch = patch.to_string();
    s.node.kubectl(&[
        "-n",
        NS,
        "patch",
        "daemonset",
        "node-local-dns",
        "--type=json",
        "-p",
        &patch,
    ]);
    s.node.wait_rollout(NS, "daemonset/node-local-dns", Duration::from_secs(180));
}

/// The NOTRACK rules node-cache installed itself (its comment), in the node's raw table.
fn node_cache_rules(s: &Suite) -> usize {
    let raw = s.node.in_node(&["iptables-nft-save", "-t", "raw"]);
    raw.lines().filter(|l| l.contains("NodeLocal DNS Cache")).count()
}

/// node-local-dns as an operator who did not patch it runs it: node-cache without
/// `-setupiptables=false` and `-skipteardown`, so it puts its own NOTRACK rules in (at its
/// first sync, a minute after it starts) and keeps them. The agent's rules pin to conntrack
/// what they do not send to the cache, so node-cache's rules cannot keep pods on a dead or hung
/// cache: a kill and a hang lose no lookup, and the agent says the rules are there, harmless.
/// Then patched again: the old node-cache's SIGTERM takes its rules out.
fn node_local_dns_unpatched(s: &Suite) {
    let patched = node_cache_args(s);
    let stock: Vec<String> = patched
        .iter()
        .filter(|a| !matches!(a.as_str(), "-setupiptables=false" | "-skipteardown"))
        .cloned()
        .collect();
    assert_ne!(patched, stock, "node-cache is not patched: {patched:?}");
    set_node_cache_args(s, &stock);
    let rules = testkit::poll(Duration::from_secs(120), || (node_cache_rules(s) > 0).then_some(()));
    assert!(rules.is_some(), "node-cache put no rules in");
    let warned = testkit::poll(Duration::from_secs(60), || {
        let st = s.agent_status();
        let says = st["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| w.as_str().unwrap_or("").contains("node-cache"));
        says.then_some(st)
    });
    let status = warned.expect("the agent never named node-cache's rules");
    println!(
        "node-cache's own rules in ({} NOTRACK); the agent says: {}",
        node_cache_rules(s),
        status["warnings"]
    );

    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    under_load(s, "unpatched, node-cache SIGKILLed", || nix_kill(pid, "KILL"));
    assert!(node_cache_rules(s) > 0, "node-cache's rules went: nothing was unpatched");

    s.wait_route("local", Duration::from_secs(60));
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    under_load(s, "unpatched, node-cache hung 5 s", || {
        nix_kill(pid, "STOP");
        s.wait_route("upstream", Duration::from_secs(30));
        // The fault's length, not a wait for anything: the cache stays hung for 5 s.
        std::thread::sleep(Duration::from_secs(5));
        nix_kill(pid, "CONT");
    });

    set_node_cache_args(s, &patched);
    let gone = testkit::poll(Duration::from_secs(60), || (node_cache_rules(s) == 0).then_some(()));
    assert!(gone.is_some(), "node-cache's rules outlived it: {}", node_cache_rules(s));
    s.wait_settled();
}

/// kube-proxy moved from iptables to nftables mode as an operator does it (its ConfigMap's
/// `mode`, then its DaemonSet rolled: kube-proxy cleans up its iptables rules itself), the
/// agent's DaemonSet rolled after it (`auto` follows kube-proxy into nftables and removes its
/// iptables rules): no lookup lost throughout; then node-cache killed and hung on the nftables
/// node, none lost either.
fn kube_proxy_moved_to_nftables_mode_loses_no_lookup(s: &Suite) {
    let cm = s.node.get_json(&["-n", NS, "get", "configmap", "kube-proxy"]);
    let config = cm["data"]["config.conf"]
        .as_str()
        .expect("config.conf")
        .replace("mode: iptables", "mode: nftables");
    assert!(config.contains("mode: nftables"), "{config}");
    let patch = serde_json::json!({"data": {"config.conf": config}}).to_string();
    under_load(s, "kube-proxy moved to nftables mode, the agent after it", || {
        s.node.kubectl(&[
            "-n",
            NS,
            "patch",
            "configmap",
            "kube-proxy",
            "--type=merge",
            "-p",
            &patch,
        ]);
        s.node.kubectl(&["-n", NS, "rollout", "restart", "daemonset/kube-proxy"]);
        s.node.wait_rollout(NS, "daemonset/kube-proxy", Duration::from_secs(120));
        let moved = testkit::poll(Duration::from_secs(60), || {
            let nat = s.node.in_node(&["iptables-nft-save", "-t", "nat"]);
            let tables = s.node.in_node(&["nft", "list", "tables"]);
            (!nat.contains("KUBE-SERVICES") && tables.contains("table ip kube-proxy")).then_some(())
        });
        assert!(moved.is_some(), "kube-proxy did not move to nftables mode");
        s.node.kubectl(&["-n", NS, "rollout", "restart", "daemonset/nodelocaldns-ha"]);
        s.node.wait_rollout(NS, "daemonset/nodelocaldns-ha", Duration::from_secs(120));
    });
    s.wait_settled();
    let status = s.agent_status();
    assert_eq!(status["dataplane"], "nftables", "{status}");
    let raw = s.node.in_node(&["iptables-nft-save", "-t", "raw"]);
    assert!(!raw.contains("NODELOCALDNS-HA"), "the agent's iptables-nft rules are left:\n{raw}");
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    under_load(s, "node-cache SIGKILLed, nftables mode", || nix_kill(pid, "KILL"));
    s.wait_settled();
    let pod = s.node.only_pod(NS, NODE_LOCAL_DNS, Duration::from_secs(60));
    let pid = s.node.container_pid(NS, &pod, "node-cache");
    under_load(s, "node-cache hung, nftables mode", || {
        nix_kill(pid, "STOP");
        s.wait_route("upstream", Duration::from_secs(30));
        nix_kill(pid, "CONT");
    });
    s.wait_settled();
}

/// `helm uninstall` without clusterReports (the chart's default): the agents cannot tell an
/// uninstall from a restart and leave their rules, as the README says; the README's `kubectl
/// debug` line (the agent's image, the node's namespaces, `teardown`) removes them. The chart is
/// then installed again.
fn an_uninstall_without_reports_leaves_rules_that_kubectl_debug_tears_down(s: &Suite) {
    let out = s.node.helm(&["uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "2m"]);
    assert!(out.status.success(), "helm uninstall:\n{}", describe(&out));
    let gone =
        testkit::poll(Duration::from_secs(60), || s.node.pods(NS, AGENT).is_empty().then_some(()));
    assert!(gone.is_some(), "the agent's pods are still there: {:?}", s.node.pods(NS, AGENT));
    assert!(agent_rules_in(s), "without clusterReports the rules stay");
    let node = s.node.kubectl(&["get", "nodes", "-o", "jsonpath={.items[0].metadata.name}"]);
    let (target, image) = (format!("node/{node}"), format!("--image={}", s.image));
    let args = ["debug", &target, "--profile=sysadmin", &image, "--", "nodelocaldns-ha"];
    let args = [&args[..], &["teardown", "--state-dir", "/host/run/nodelocaldns-ha"]].concat();
    let out = s.node.try_kubectl(&args);
    let said = describe(&out);
    assert!(out.status.success(), "kubectl debug: {said}");
    let pod = said
        .split_whitespace()
        .find(|w| w.starts_with("node-debugger-"))
        .unwrap_or_else(|| panic!("no debugging pod named: {said}"))
        .to_owned();
    let phase = testkit::poll(Duration::from_secs(90), || {
        let phase = s.node.kubectl(&["get", "pod", &pod, "-o", "jsonpath={.status.phase}"]);
        ["Succeeded", "Failed"].contains(&phase.trim()).then(|| phase.trim().to_owned())
    });
    let log = s.node.kubectl(&["logs", &pod]);
    println!("kubectl debug's teardown ({phase:?}):\n{log}");
    s.node.kubectl(&["delete", "pod", &pod, "--wait=false"]);
    assert_eq!(phase.as_deref(), Some("Succeeded"), "{log}");
    assert!(log.contains("removed everything nodelocaldns-ha installed"), "{log}");
    assert!(!agent_rules_in(s), "the agent's rules are left after the teardown");
    let lo = s.node.in_node(&["ip", "-o", "address", "show", "dev", "lo"]);
    assert!(!lo.contains("lo:nlha"), "the agent's copy of the link-local IP is left:\n{lo}");
    let _ = helm_install(s, &[]);
    s.wait_settled();
}

/// Whether the node's netfilter holds the agent's rules: its nftables table, or its chains in
/// either iptables backend.
fn agent_rules_in(s: &Suite) -> bool {
    let nft = s.node.in_node(&["nft", "list", "tables"]);
    let ipt = |save| s.node.in_node(&[save, "-t", "raw"]);
    nft.contains("nodelocaldns-ha")
        || ipt("iptables-nft-save").contains("NODELOCALDNS-HA")
        || ipt("iptables-legacy-save").contains("NODELOCALDNS-HA")
}

/// A signal to a process of the node (a container's main process), by pid.
fn nix_kill(pid: i32, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// The kubelet restarted, then containerd, under the running pods: neither takes a container
/// down (their shims outlive both), and the pods' DNS goes on.
fn kubelet_and_containerd_restarted_lose_no_lookup(s: &Suite) {
    let pods = |ns, sel| s.node.pods(ns, sel);
    let before = (pods(NS, AGENT), pods(NS, NODE_LOCAL_DNS), pods("default", CLIENTS));
    under_load(s, "kubelet and containerd restarted", || {
        s.node.script("kubelet-restart", &[]);
        s.wait_settled();
        s.node.script("containerd-restart", &[]);
        s.wait_settled();
    });
    let after = (pods(NS, AGENT), pods(NS, NODE_LOCAL_DNS), pods("default", CLIENTS));
    assert_eq!(before, after, "the restarts replaced pods");
}

/// `helm uninstall` under load, the agents able to ask the API server (the chart's
/// clusterReports and startupTaint on): the chart's pre-delete hook deletes their DaemonSet,
/// each agent's SIGTERM finds it being deleted and puts the node back. Pods keep their DNS
/// through it and after it (0 failed lookups; afterwards CoreDNS answers them through
/// kube-proxy), and the node has none of the agent's rules, no copy of the link-local IP on lo,
/// no condition NodeLocalDNSReady and no startup taint (put back on the node before the
/// uninstall: the agent had taken it off). The chart is then installed again for the cases
/// after this one.
fn helm_uninstall_loses_no_lookup(s: &Suite) {
    const TAINT: &str = "nodelocaldns-ha.io/dns-not-ready";
    let reports = ["clusterReports.enabled=true", "clusterReports.startupTaint=true"];
    let mut args = vec!["upgrade", RELEASE, CHART, "--namespace", NS, "--reuse-values"];
    args.extend(reports.iter().flat_map(|v| ["--set", *v]));
    args.extend(["--wait", "--timeout", "2m"]);
    let out = s.node.helm(&args);
    assert!(out.status.success(), "helm upgrade:\n{}", describe(&out));
    s.wait_settled();
    let node = s.node.kubectl(&["get", "nodes", "-o", "jsonpath={.items[0].metadata.name}"]);
    let condition = || {
        let n = s.node.get_json(&["get", "node", &node]);
        let conditions = n["status"]["conditions"].as_array().cloned().unwrap_or_default();
        conditions.into_iter().find(|c| c["type"] == "NodeLocalDNSReady")
    };
    let tainted = || {
        let n = s.node.get_json(&["get", "node", &node]);
        n["spec"]["taints"].as_array().is_some_and(|t| t.iter().any(|t| t["key"] == TAINT))
    };
    let reported =
        testkit::poll(Duration::from_secs(60), || condition().filter(|c| c["status"] == "True"));
    assert!(reported.is_some(), "no condition NodeLocalDNSReady True: {:?}", condition());
    s.node.kubectl(&["taint", "node", &node, &format!("{TAINT}:NoSchedule")]);
    assert!(agent_rules_in(s) && tainted(), "nothing for the uninstall to remove");

    let client = s.client();
    let mut load = s.node.load(&client, RATE);
    load.load.wait_cache_answers();
    let out = s.node.helm(&["uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "3m"]);
    println!("helm uninstall: {}", describe(&out));
    assert!(out.status.success(), "helm uninstall:\n{}", describe(&out));
    let gone =
        testkit::poll(Duration::from_secs(60), || s.node.pods(NS, AGENT).is_empty().then_some(()));
    assert!(gone.is_some(), "the agent's pods are still there: {:?}", s.node.pods(NS, AGENT));
    load.wait_on_coredns(Duration::from_secs(30));
    let (summary, _lookups) = load.stop();
    println!("helm uninstall: {}", counts(&summary));
    assert_eq!(summary["failed"], 0, "helm uninstall: lookups failed: {summary}");

    assert!(!agent_rules_in(s), "the agent's rules are left after the uninstall");
    // The agent's copies are labelled (node-cache's own addresses may be on lo too).
    let lo = s.node.in_node(&["ip", "-o", "address", "show", "dev", "lo"]);
    assert!(!lo.contains("lo:nlha"), "the agent's copy of the link-local IP is left:\n{lo}");
    assert_eq!(condition(), None, "the condition NodeLocalDNSReady is left");
    assert!(!tainted(), "the startup taint is left");
    let hooks = s.node.try_kubectl(&["-n", NS, "get", "job", "nodelocaldns-ha-uninstall"]);
    assert!(!hooks.status.success(), "the hook's Job is left: {}", describe(&hooks));

    let _ = helm_install(s, &[]);
    s.wait_settled();
}
