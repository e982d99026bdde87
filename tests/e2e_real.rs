//! End to end on a simulated node with real Kubernetes parts, built by `ci/k8s/build.sh`: etcd
//! and kube-apiserver on a control-plane namespace of their own, real kube-proxy (iptables mode,
//! iptables-nft; or nftables mode) in the node's namespace writing its own rules from the
//! Services and EndpointSlices created through the API, real CoreDNS (the kubernetes plugin
//! reading the API server) at the kube-dns endpoints, and the real node-cache (kubernetes/dns,
//! built from its source) with node-local-dns's own Corefile and flags. The matrix's `real_*`
//! cells (tests/e2e_matrix.rs) run the hang, host-network clients and the link-local shape on
//! these parts; tests/e2e_kubelet.rs runs them all as pods of a real kubelet.
//!
//! A real part that does not build or start fails `simnode.sh up` naming the part and its log's
//! tail, and so the test: never a skip, never a stand-in. Each test makes its own namespaces
//! (unique prefix, `-cp` for the control plane) and removes them, whatever happens.

use testkit::*;

/// The core case on the real parts, kube-proxy in `mode` (`real-iptables`, `real-nftables`):
/// 500 lookups/s from a pod to the kube-dns ClusterIP; the cache SIGKILLed loses no lookup, real
/// CoreDNS answers through real kube-proxy's DNAT until the cache is back, then the cache again.
/// The agent's `auto` must find real kube-proxy's backend: `dataplane`.
fn cache_sigkill_loses_no_pod_lookup(mode: &str, dataplane: &str) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
    // Without the agent, the pod's query goes where real kube-proxy's DNAT sends it: CoreDNS.
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER, "real kube-proxy's DNAT");
    let agent = node.agent(&["--dataplane", "auto"]);
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], dataplane, "{st}");
    testkit::cache_sigkill_loses_no_pod_lookup(&node, &agent);
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_cache_sigkill_loses_no_pod_lookup() {
    cache_sigkill_loses_no_pod_lookup("real-iptables", "iptables-nft");
}

#[test]
fn real_kube_proxy_nftables_cache_sigkill_loses_no_pod_lookup() {
    cache_sigkill_loses_no_pod_lookup("real-nftables", "nftables");
}

/// DNS over TCP from a pod and from the host across a cache SIGKILL, on the real parts: through
/// real kube-proxy's DNAT to real CoreDNS while the cache is gone.
fn tcp_lookups_follow_the_route(mode: &str) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
    let agent = node.agent(&["--dataplane", "auto"]);
    testkit::tcp_lookups_follow_the_route(&node, &agent);
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_tcp_lookups_follow_the_route() {
    tcp_lookups_follow_the_route("real-iptables");
}

#[test]
fn real_kube_proxy_nftables_tcp_lookups_follow_the_route() {
    tcp_lookups_follow_the_route("real-nftables");
}

/// A node-cache rolling update on the real parts (acceptance 3): `drain` (node-local-dns's
/// preStop), then node-cache's own SIGTERM teardown (the process exits, its interface's
/// addresses go), the new pod's interface and cache: no pod lookup fails and no first attempt is
/// lost, real CoreDNS answering through real kube-proxy meanwhile.
fn rolling_update_under_drain_is_lossless(mode: &str) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
    let agent = node.agent(&["--dataplane", "auto"]);
    let dir = agent.state_dir.display().to_string();
    let args = ["--rate", "500", "--duration", "8s", "--report-interval", "250ms"];
    let mut load = node.load("pod1", CLUSTER_DNS_IP, &args);
    load.wait_cache_answers();
    let out = node.cli(&["drain", "--timeout", "5s", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(agent.state().expect("state")["route"], "upstream");

    node.script(&["cache-term"]);
    node.script(&["listen-addrs-del"]);
    node.script(&["listen-addrs-add"]);
    node.script(&["cache-start"]);
    agent.wait_route("local", std::time::Duration::from_secs(10));
    load.wait_line("the new cache answering", std::time::Duration::from_secs(5), |l| {
        field(l, "cache").is_some_and(|n| n > 0) && field(l, "coredns") == Some(0)
    });
    let summary = load.finish();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert_eq!(summary["first_attempt_lost"], 0, "{summary}");
    assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 0, "{summary}");
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_rolling_update_under_drain_is_lossless() {
    rolling_update_under_drain_is_lossless("real-iptables");
}

#[test]
fn real_kube_proxy_nftables_rolling_update_under_drain_is_lossless() {
    rolling_update_under_drain_is_lossless("real-nftables");
}

/// Acceptance 4: kube-proxy migrates from iptables to nftables mode (KEP-5343) under pod load:
/// real kube-proxy restarted in nftables mode cleans up its iptables rules itself; the agent,
/// restarted with it (`auto`), follows it into nftables and removes its iptables-nft rules. A
/// hang then fails pods over through kube-proxy's new rules. No pod lookup fails throughout, and
/// nothing of kube-proxy's iptables mode or of the agent's old backend is left.
#[test]
fn real_kube_proxy_migration_to_nftables_mode_under_load() {
    use std::time::Duration;
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let mut first = node.agent(&["--dataplane", "auto"]);
    assert_eq!(first.state().expect("state")["dataplane"], "iptables-nft");
    let args = ["--rate", "300", "--duration", "60s", "--report-interval", "100ms"];
    let mut load = node.load("pod1", CLUSTER_DNS_IP, &args);
    load.wait_cache_answers();

    assert!(first.stop(nix::sys::signal::Signal::SIGTERM).success());
    drop(first);
    node.script(&["kube-proxy-migrate"]);
    let agent = node.agent(&["--dataplane", "auto"]);
    let st = agent.wait_leftovers_removed(Duration::from_secs(10));
    println!("after the migration: {st}");
    assert_eq!(st["dataplane"], "nftables", "{st}");
    let nat = node.run("node", "iptables-nft-save", &["-t", "nat"]);
    let nat = String::from_utf8_lossy(&nat.stdout).into_owned();
    assert!(
        !nat.contains("KUBE-SERVICES") && !nat.contains("KUBE-SVC-"),
        "kube-proxy's iptables mode is left:\n{nat}"
    );
    let raw = node.run("node", "iptables-nft-save", &["-t", "raw"]);
    assert!(
        !String::from_utf8_lossy(&raw.stdout).contains("NODELOCALDNS-HA"),
        "{}",
        describe(&raw)
    );
    load.wait_cache_answers();

    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    load.wait_alone("coredns");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    load.wait_cache_answers();
    let summary = load.interrupt();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert_eq!(summary["by_origin"]["other"], 0, "{summary}");
    node.tear_down(agent);
}

/// Acceptance 5: the busy node. 5,000 Services with two endpoints each, created through the API,
/// in real kube-proxy's rules, and the endpoint controller changing 10 EndpointSlices a second
/// (kube-proxy rewriting its rules after each): the core case, a cache SIGKILL under 500 pod
/// lookups/s, loses no lookup.
fn busy_node_cache_sigkill_loses_no_pod_lookup(mode: &str) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
    node.script(&["busy-services", "5000"]);
    node.script(&["endpoint-churn-start", "10"]);
    let agent = node.agent(&["--dataplane", "auto"]);
    testkit::cache_sigkill_loses_no_pod_lookup(&node, &agent);
    let changes = node.script(&["endpoint-churn-changes"]);
    println!("EndpointSlice changes accepted meanwhile: {changes}");
    assert!(changes.trim().parse::<u64>().expect("a count") >= 50, "the churn stalled: {changes}");
    node.script(&["endpoint-churn-stop"]);
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_busy_node_cache_sigkill_loses_no_pod_lookup() {
    busy_node_cache_sigkill_loses_no_pod_lookup("real-iptables");
}

#[test]
fn real_kube_proxy_nftables_busy_node_cache_sigkill_loses_no_pod_lookup() {
    busy_node_cache_sigkill_loses_no_pod_lookup("real-nftables");
}

/// node-cache's own rules as `node-cache-rules` lists them in iptables-nft (the simulated node's
/// flavour for the real parts), each line as `iptables-nft-save` prints it, sorted.
fn node_cache_rules(node: &SimNode) -> Vec<String> {
    let mut rules = Vec::new();
    for table in ["raw", "filter"] {
        let out = node.run("node", "iptables-nft-save", &["-t", table]);
        assert!(out.status.success(), "{}", describe(&out));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let ours = text.lines().filter(|l| l.contains("NodeLocal DNS Cache"));
        rules.extend(ours.map(|l| format!("-t {table} {l}")));
    }
    rules.sort();
    rules
}

/// node-local-dns as upstream ships it: node-cache without `-setupiptables=false`, its own
/// unconditional NOTRACK and ACCEPT rules beside real kube-proxy's (`node-cache-rules`, put back
/// at every sync of its), kube-proxy in `mode`; the agent (`auto` picks `dataplane`) with the
/// cluster reports on. Returns the node, the agent and node-cache's rules as they were put in.
fn with_stock_node_cache_rules(mode: &str, dataplane: &str) -> (SimNode, Agent, Vec<String>) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
    node.script(&["node-cache-rules"]);
    let stock = node_cache_rules(&node);
    assert!(stock.len() >= 20, "{stock:?}");
    let name = node.ns("node");
    let kubeconfig = node.dir.join("admin.kubeconfig").display().to_string();
    let agent =
        node.agent(&["--dataplane", "auto", "--node-name", &name, "--kubeconfig", &kubeconfig]);
    assert_eq!(agent.state().expect("state")["dataplane"], dataplane);
    (node, agent, stock)
}

/// What the agent says of node-cache's rules: each named in `status` as harmless beside its
/// own, counted in the state and in `/metrics`, none in effect.
fn stock_rules_are_said_to_be_harmless(node: &SimNode, agent: &Agent) {
    let st = testkit::node_cache_rules_are_named(node, agent);
    let warnings = st["warnings"].as_array().expect("warnings");
    let harmless = |w: &serde_json::Value| {
        w.as_str().is_some_and(|w| w.contains("harmless beside the agent's rules"))
    };
    assert!(warnings.iter().all(harmless), "{st}");
    assert_eq!(st["foreign"]["rules"].as_u64(), Some(warnings.len() as u64), "{st}");
    assert_eq!(st["foreign"]["in_effect"], 0, "{st}");
    let (status, metrics) = node.http_get("/metrics");
    assert_eq!(status, 200);
    let gauge = |name: &str| {
        metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} "))?.parse::<u64>().ok())
    };
    assert_eq!(gauge("nodelocaldns_ha_foreign_notrack_rules"), Some(warnings.len() as u64));
    assert_eq!(gauge("nodelocaldns_ha_foreign_notrack_rules_in_effect"), Some(0));
}

/// The messages of the node's Events from the agent with `reason`, oldest first.
fn event_messages(node: &SimNode, reason: &str) -> Vec<String> {
    let out = node.kubectl().args(["get", "events", "-n", "default", "-o", "json"]).output();
    let events: serde_json::Value =
        serde_json::from_slice(&out.expect("kubectl").stdout).expect("JSON");
    let items = events["items"].as_array().cloned().unwrap_or_default();
    items
        .iter()
        .filter(|e| e["reason"] == reason && e["source"]["component"] == "nodelocaldns-ha")
        .filter_map(|e| e["message"].as_str().map(str::to_owned))
        .collect()
}

/// The stock arrangement ([`with_stock_node_cache_rules`]) across a cache SIGKILL under 500 pod
/// lookups/s: none lost, where node-cache's rules alone pin pods to the dead cache until it is
/// back. The agent never touches them: while the cache is healthy (node-cache's next sync,
/// `node-cache-rules` again, finds every rule as it left it and puts nothing back), nor while
/// it is dead. Its own rules run before them and pin every query they do not send to the cache
/// to conntrack, so node-cache's NOTRACK leaves it to kube-proxy's DNAT. The failover Event
/// names the rules it overrode.
fn stock_node_cache_rules_cost_no_lookup_on_a_kill(mode: &str, dataplane: &str) {
    use std::time::Duration;
    let (node, agent, stock) = with_stock_node_cache_rules(mode, dataplane);
    let sent = |st: &serde_json::Value| st["probes"]["cache_udp"]["sent"].as_u64().unwrap_or(0);
    let before = sent(&agent.state().expect("state"));
    // Ten turns of its loop with the cache healthy (once a second at the quiet pace).
    wait_for("10 more cache probes", Duration::from_secs(30), || {
        agent.state().filter(|s| sent(s) >= before + 10)
    });
    node.script(&["node-cache-rules"]);
    assert_eq!(node_cache_rules(&node), stock, "node-cache's rules changed while it was healthy");

    testkit::cache_sigkill_loses_no_pod_lookup(&node, &agent);
    assert_eq!(node_cache_rules(&node), stock, "node-cache's rules changed across the kill");
    stock_rules_are_said_to_be_harmless(&node, &agent);
    let failovers = wait_for("the failover Event", Duration::from_secs(10), || {
        Some(event_messages(&node, "FailedOverToCoreDNS")).filter(|m| !m.is_empty())
    });
    println!("failover Events: {failovers:?}");
    assert!(failovers.iter().all(|m| m.contains("overridden by the agent's")), "{failovers:?}");
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_stock_node_cache_rules_cost_no_lookup_on_a_kill() {
    stock_node_cache_rules_cost_no_lookup_on_a_kill("real-iptables", "iptables-nft");
}

#[test]
fn real_kube_proxy_nftables_stock_node_cache_rules_cost_no_lookup_on_a_kill() {
    stock_node_cache_rules_cost_no_lookup_on_a_kill("real-nftables", "nftables");
}

/// The stock arrangement ([`with_stock_node_cache_rules`]) across a hang (SIGSTOP) longer than
/// glibc's 2 × 5 s would survive: 11 s by the client's own timeline, 500 pod lookups/s. With
/// node-cache's rules alone every lookup sent to the hung cache fails; with the agent none does
/// (the stall watch or the probes move the route, its rules pin the queries to conntrack, and
/// node-cache's NOTRACK leaves them to kube-proxy's DNAT), and node-cache's rules are left as
/// they were. The node's condition says, while it lasts, that they are overridden.
fn stock_node_cache_rules_cost_no_lookup_on_a_hang(mode: &str, dataplane: &str) {
    use std::time::Duration;
    let (node, agent, stock) = with_stock_node_cache_rules(mode, dataplane);
    let name = node.ns("node");
    let args = ["--rate", "500", "--duration", "120s", "--report-interval", "250ms"];
    let mut load = node.load("pod1", CLUSTER_DNS_IP, &args);
    load.wait_cache_answers();
    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    // The hang's length, by the client's own timeline: 44 report intervals of 250 ms.
    for _ in 0..44 {
        load.wait_line("a report during the hang", Duration::from_secs(5), |_| true);
    }
    let condition = wait_for("the node condition", Duration::from_secs(10), || {
        let out = node.kubectl().args(["get", "node", &name, "-o", "json"]).output().ok()?;
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let conditions = got["status"]["conditions"].as_array()?.clone();
        let ours = conditions.into_iter().find(|c| c["type"] == "NodeLocalDNSReady")?;
        (ours["reason"] == "FailedOverToCoreDNS").then_some(ours)
    });
    assert_eq!(node_cache_rules(&node), stock, "node-cache's rules changed during the hang");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(20));
    load.wait_alone("cache");
    let summary = load.interrupt();
    println!("a hang of 11 s beside node-cache's own rules: {summary}");
    assert_eq!(summary["failed"], 0, "lookups failed: {summary}");
    assert!(summary["by_origin"]["coredns"].as_u64().unwrap() > 4000, "{summary}");
    assert_eq!(summary["by_origin"]["other"], 0, "{summary}");
    println!("during the hang: {condition}");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(message.contains("node-cache's own rules"), "{condition}");
    assert!(message.contains("overridden by the agent's"), "{condition}");
    stock_rules_are_said_to_be_harmless(&node, &agent);
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_stock_node_cache_rules_cost_no_lookup_on_a_hang() {
    stock_node_cache_rules_cost_no_lookup_on_a_hang("real-iptables", "iptables-nft");
}

#[test]
fn real_kube_proxy_nftables_stock_node_cache_rules_cost_no_lookup_on_a_hang() {
    stock_node_cache_rules_cost_no_lookup_on_a_hang("real-nftables", "nftables");
}

/// A dual-stack cluster on the real parts: kube-dns with a ClusterIP of each family, real
/// kube-proxy's rules for both (iptables mode: iptables-nft and ip6tables-nft; nftables mode:
/// `table ip` and `table ip6 kube-proxy`), CoreDNS on both families' endpoints, and one agent for
/// both families, as a dual-stack node's DaemonSet gives it. IPv4 and IPv6 pods under load: a
/// cache SIGKILL and a hang each move both families to real CoreDNS through real kube-proxy and
/// back, and no lookup of either fails.
fn dual_stack_pods_survive_kill_and_hang(mode: &str, dataplane: &str) {
    use std::time::Duration;
    let node = SimNode::up_with(&["--kube-proxy", mode, "--family", "dual"]);
    let agent = node.agent_for(
        "169.254.20.10,fd00:169:254::10",
        "10.96.0.10,fd00:96::10",
        "10.96.0.11,fd00:96::11",
        &["--dataplane", "auto"],
    );
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], dataplane, "{st}");
    let args = ["--rate", "250", "--duration", "60s", "--report-interval", "100ms"];
    let mut v4 = node.load("pod1", CLUSTER_DNS_IP, &args);
    let mut v6_args = args.to_vec();
    v6_args.extend(["--qtype", "AAAA"]);
    let mut v6 = node.load("pod2", "[fd00:96::10]:53", &v6_args);
    for (down, up) in [("cache-kill", "cache-start"), ("cache-stop", "cache-cont")] {
        for load in [&mut v4, &mut v6] {
            load.wait_cache_answers();
        }
        node.signal(down);
        agent.wait_route("upstream", Duration::from_secs(5));
        for load in [&mut v4, &mut v6] {
            load.wait_alone("coredns");
        }
        node.script(&[up]);
        agent.wait_route("local", Duration::from_secs(10));
    }
    for load in [&mut v4, &mut v6] {
        load.wait_alone("cache");
    }
    for (family, load) in [("IPv4", v4), ("IPv6", v6)] {
        let summary = load.interrupt();
        println!("{mode}, {family}: {summary}");
        assert_eq!(summary["failed"], 0, "{family}: {summary}");
        assert_eq!(summary["by_origin"]["other"], 0, "{family}: {summary}");
    }
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_dual_stack_pods_survive_kill_and_hang() {
    dual_stack_pods_survive_kill_and_hang("real-iptables", "iptables-nft");
}

#[test]
fn real_kube_proxy_nftables_dual_stack_pods_survive_kill_and_hang() {
    dual_stack_pods_survive_kill_and_hang("real-nftables", "nftables");
}

/// node-local-dns's node-cache bound to the wildcard address, as deliveryhero's chart binds it by
/// default (`config.bindIp: false`), the real node-cache: the agent refuses at once, exit 2,
/// naming the socket, the cause and the value to change, and changes nothing; pods are answered
/// by CoreDNS through kube-proxy, as without the agent. (Before: exit 1 with "binding
/// 127.53.0.53:53 (udp, IP_TRANSPARENT) failed: Address already in use", and so on at every
/// restart; with the link-local failover off it ran, and its NOTRACK, guarded by `socket
/// wildcard 0`, never took a query to the cache.)
#[test]
fn a_cache_bound_to_the_wildcard_is_refused_at_once() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    node.script(&["cache-term"]);
    node.script(&["cache-start", "--bind", "wildcard"]);
    let listening = node.run("node", "ss", &["-Hulnp", "sport = :53"]);
    println!("node-cache bound: {}", String::from_utf8_lossy(&listening.stdout));
    let dir = node.dir.join("refused-state").display().to_string();
    let run = [
        &["60", agent_exe(), "run", "--local-ip", LOCAL_IP][..],
        &["--cluster-dns-ip", CLUSTER_DNS_IP, "--upstream-ip", UPSTREAM_IP],
        &["--probe-name", "who.test", "--state-dir", &dir],
    ]
    .concat();
    // Bounded: an agent that did not refuse would run on.
    let out = node.run("node", "timeout", &run);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("refused: {stderr}");
    assert_eq!(out.status.code(), Some(2), "(124: still running after 60 s) {}", describe(&out));
    // Go's runtime listens on 0.0.0.0 with one dual-stack socket: `[::]:53` on a node with IPv6.
    assert!(["0.0.0.0:53", "[::]:53"].iter().any(|a| stderr.contains(a)), "no socket: {stderr}");
    for says in ["every address", "config.bindIp=true", "nothing was changed"] {
        assert!(stderr.contains(says), "{says:?} not said: {stderr}");
    }
    node.assert_nothing_left();
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER, "kube-proxy's DNAT, as before");
}
