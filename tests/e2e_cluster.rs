//! The agent part of the cluster (issue 33), on the simulated node's real kube-apiserver
//! (`--kube-proxy real-iptables`, issue 31): with `--node-name` and `--kubeconfig`, the node's
//! condition NodeLocalDNSReady and one Event per route change, as `kubectl` shows them.

use std::time::Duration;

use serde_json::Value;
use testkit::*;

/// `kubectl ARGS -o json` as the cluster's admin, parsed.
fn get(node: &SimNode, args: &[&str]) -> Value {
    let out = node.kubectl().args(args).args(["-o", "json"]).output().expect("kubectl");
    assert!(out.status.success(), "kubectl {args:?}: {}", describe(&out));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The node's NodeLocalDNSReady condition, if it has one.
fn condition(node: &SimNode, name: &str) -> Option<Value> {
    let conditions = get(node, &["get", "node", name])["status"]["conditions"].clone();
    conditions.as_array()?.iter().find(|c| c["type"] == "NodeLocalDNSReady").cloned()
}

/// Waits until the condition has `status` and `reason`; returns it.
fn wait_condition(node: &SimNode, name: &str, status: &str, reason: &str) -> Value {
    let what = format!("condition NodeLocalDNSReady {status} {reason}");
    // Reports retried after a failure wait out their backoff: up to 30 s.
    wait_for(&what, Duration::from_secs(40), || {
        condition(node, name).filter(|c| c["status"] == status && c["reason"] == reason)
    })
}

/// The node's Events by the agent, oldest first.
fn events(node: &SimNode, name: &str) -> Vec<Value> {
    let selector = format!("involvedObject.kind=Node,involvedObject.name={name}");
    let list = get(node, &["get", "events", "-n", "default", "--field-selector", &selector]);
    let mut items: Vec<Value> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["source"]["component"] == "nodelocaldns-ha")
        .cloned()
        .collect();
    items.sort_by_key(|e| e["metadata"]["creationTimestamp"].as_str().unwrap_or("").to_owned());
    items
}

/// `kubectl ARGS` as the cluster's admin, `input` on its stdin; it must succeed.
fn kubectl_with(node: &SimNode, args: &[&str], input: &[u8]) {
    let out = node.kubectl_input(args, input);
    assert!(out.status.success(), "kubectl {args:?}: {}", describe(&out));
}

/// The agent's user on the test bed (`agent.kubeconfig`, made by simnode's real parts): no
/// rights until [`grant`].
const AGENT_USER: &str = "nodelocaldns-ha-agent";

/// Grants the agent's user what `component`'s RBAC (`manifests/<component>/rbac.yaml`) grants
/// the DaemonSet's service account, and waits until it is in force (`can`, as can-i asks it).
fn grant(node: &SimNode, component: &str, can: &[&str]) {
    grant_rbac(node, &rbac_of(component), can);
}

/// `manifests/<component>/rbac.yaml`.
fn rbac_of(component: &str) -> String {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(repo.join("manifests").join(component).join("rbac.yaml"))
        .expect("the component's RBAC")
}

/// Grants the agent's user what `rbac` grants the DaemonSet's service account; see [`grant`].
fn grant_rbac(node: &SimNode, rbac: &str, can: &[&str]) {
    let account = "{kind: ServiceAccount, name: nodelocaldns-ha, namespace: kube-system}";
    assert!(rbac.contains(account), "{rbac}");
    let user = format!("{{kind: User, name: {AGENT_USER}, apiGroup: rbac.authorization.k8s.io}}");
    let rbac = rbac.replace(account, &user);
    kubectl_with(node, &["apply", "-f", "-"], rbac.as_bytes());
    let who = format!("--as={AGENT_USER}");
    wait_for("the grant in force", Duration::from_secs(10), || {
        let out = node.kubectl().args(["auth", "can-i"]).args(can).arg(&who).output().ok()?;
        (String::from_utf8_lossy(&out.stdout).trim() == "yes").then_some(())
    });
}

/// The agent's kubeconfig on the test bed.
fn agent_kubeconfig(node: &SimNode) -> String {
    node.dir.join("agent.kubeconfig").display().to_string()
}

/// Acceptance 1: a cache SIGKILL and its recovery: the condition goes to FailedOverToCoreDNS
/// with the reason, then back to CacheServing; exactly one Event per route change, and
/// `kubectl describe node` shows both. The agent reports as a user with exactly the RBAC of
/// `manifests/cluster-reports`: it suffices.
#[test]
fn the_nodes_condition_and_events_follow_a_cache_kill() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    grant(&node, "cluster-reports", &["patch", "nodes", "--subresource=status"]);
    let kubeconfig = agent_kubeconfig(&node);
    let agent = node.agent(&["--node-name", &name, "--kubeconfig", &kubeconfig]);
    let serving = wait_condition(&node, &name, "True", "CacheServing");
    println!("at start: {serving}");
    assert!(events(&node, &name).is_empty(), "the start is no route change");

    node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    let failed = wait_condition(&node, &name, "False", "FailedOverToCoreDNS");
    println!("failed over: {failed}");
    assert!(failed["message"].as_str().unwrap().contains("refused"), "{failed}");
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    wait_condition(&node, &name, "True", "CacheServing");

    let seen = wait_for("two Events", Duration::from_secs(10), || {
        Some(events(&node, &name)).filter(|e| e.len() >= 2)
    });
    let reasons: Vec<_> = seen.iter().map(|e| (e["reason"].clone(), e["count"].clone())).collect();
    assert_eq!(
        reasons,
        [
            (Value::from("FailedOverToCoreDNS"), Value::from(1)),
            (Value::from("BackToCache"), Value::from(1))
        ],
        "{seen:?}"
    );
    assert_eq!(seen[0]["type"], "Warning");
    let out = node.kubectl().args(["describe", "node", &name]).output().expect("kubectl");
    let text = String::from_utf8_lossy(&out.stdout);
    for shown in ["NodeLocalDNSReady", "FailedOverToCoreDNS", "BackToCache"] {
        assert!(text.contains(shown), "kubectl describe node shows {shown}:\n{text}");
    }
    node.tear_down(agent);
}

/// Acceptance 4: the API server hung (SIGSTOP: it takes connections and answers nothing)
/// through a cache SIGKILL and its recovery: the failover is as without it (no pod lookup
/// fails), the reporting failure is logged once, and once the API server answers again the
/// condition is caught up and the route changes are reported, in one Event.
#[test]
fn a_hung_api_server_changes_nothing_in_the_failover_and_is_caught_up() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    let kubeconfig = node.dir.join("admin.kubeconfig").display().to_string();
    let agent = node.agent(&["--node-name", &name, "--kubeconfig", &kubeconfig]);
    wait_condition(&node, &name, "True", "CacheServing");
    node.script(&["kube-apiserver-stop"]);
    kill_and_restart_under_load(&node, &agent);
    wait_for("the reporting failure in the log", Duration::from_secs(15), || {
        agent.log_text().contains("reporting to the API server failed").then_some(())
    });
    node.script(&["kube-apiserver-cont"]);
    assert_caught_up(&node, &name, &agent);
    node.tear_down(agent);
}

/// A cache SIGKILL and its restart under 300 lookups/s from a pod: no lookup fails, and a
/// first attempt is lost only to the kill.
fn kill_and_restart_under_load(node: &SimNode, agent: &Agent) {
    let args = ["--rate", "300", "--duration", "60s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    let restart = kill_and_restart_cache(node, agent, &mut [&mut pod]);
    let summary = pod.interrupt();
    println!("pod: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert_lost_to_the_kill("pod", &summary, restart.killed_at, restart.gone_at);
}

/// Once the API server takes the reports again: the failure was logged once (and the return),
/// the condition is back to CacheServing, and the kill's two route changes are one Event.
fn assert_caught_up(node: &SimNode, name: &str, agent: &Agent) {
    wait_for("reporting again", Duration::from_secs(40), || {
        agent.log_text().contains("reporting to the API server again").then_some(())
    });
    let log = agent.log_text();
    assert_eq!(log.matches("reporting to the API server failed").count(), 1, "{log}");
    let back = wait_condition(node, name, "True", "CacheServing");
    println!("caught up: {back}");
    let seen = wait_for("the Event of the two changes", Duration::from_secs(10), || {
        Some(events(node, name)).filter(|e| !e.is_empty())
    });
    assert_eq!(seen.len(), 1, "{seen:?}");
    let two = (&Value::from("BackToCache"), &Value::from(2));
    assert_eq!((&seen[0]["reason"], &seen[0]["count"]), two);
}

/// Acceptance 5: the reports' RBAC is the least they need. The base with the cluster-reports
/// component and its startup-taint one, built by kubectl's kustomize, is accepted by the real
/// API server (server-side dry run); the reports' RBAC applied, the agent's service account may
/// patch nodes/status, create Events in `default`, list and watch the upstream Service by
/// name and get its own DaemonSet, and nothing else asked of it; the startup taint's added, it
/// may also get and patch nodes, and no more.
#[test]
fn the_reports_rbac_is_the_least_they_need() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = node.dir.join("kustomize-reports");
    std::fs::create_dir_all(&dir).unwrap();
    // kustomize takes relative paths only: up to / from the scratch directory, then down.
    let up = "../".repeat(dir.components().count() - 1);
    let from_root =
        |p: &str| format!("{up}{}", repo.join(p).display().to_string().trim_start_matches('/'));
    let kustomization = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [{}]\ncomponents: [{}, {}]\n",
        from_root("manifests/base"),
        from_root("manifests/cluster-reports"),
        from_root("manifests/cluster-reports/startup-taint"),
    );
    std::fs::write(dir.join("kustomization.yaml"), kustomization).unwrap();
    let run = |args: &[&str]| {
        let out = node.kubectl().args(args).output().expect("kubectl");
        (out.status.success(), describe(&out))
    };
    let dir_arg = dir.display().to_string();
    let built = node
        .kubectl()
        .args(["kustomize", &dir_arg, "--load-restrictor", "LoadRestrictionsNone"])
        .output()
        .expect("kubectl kustomize");
    assert!(built.status.success(), "{}", describe(&built));
    let text = String::from_utf8(built.stdout).unwrap();
    assert!(text.contains("NODELOCALDNS_HA_NODE_NAME"), "{text}");
    assert!(text.contains("NODELOCALDNS_HA_STARTUP_TAINT"), "{text}");
    let manifest = node.dir.join("reports.yaml");
    std::fs::write(&manifest, &text).unwrap();
    let manifest = manifest.display().to_string();
    let (ok, out) = run(&["apply", "--dry-run=server", "-f", &manifest]);
    assert!(ok, "the API server accepts the base with the component: {out}");

    let rbac = repo.join("manifests/cluster-reports/rbac.yaml").display().to_string();
    let account = repo.join("manifests/base/serviceaccount.yaml").display().to_string();
    for file in [&account, &rbac] {
        let (ok, out) = run(&["apply", "-f", file]);
        assert!(ok, "{out}");
    }
    let who = "--as=system:serviceaccount:kube-system:nodelocaldns-ha";
    // `what` as RESOURCE or RESOURCE/SUBRESOURCE (can-i reads `nodes/status` as a node's name).
    let can = |verb: &str, what: &str, namespace: &str| {
        let (resource, sub) = what.split_once('/').unwrap_or((what, ""));
        let mut cmd = node.kubectl();
        cmd.args(["auth", "can-i", verb, resource, "-n", namespace, who]);
        if !sub.is_empty() {
            cmd.arg(format!("--subresource={sub}"));
        }
        let out = cmd.output().expect("kubectl auth can-i");
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    // RBAC objects take effect through the API server's informer: wait for the first grant.
    wait_for("the grant in force", Duration::from_secs(10), || {
        can("patch", "nodes/status", "default").then_some(())
    });
    assert!(can("create", "events", "default"));
    // The upstream Service, by name (a metadata.name field selector), and no other.
    let can_named = |verb: &str, name: &str, namespace: &str| {
        let what = format!("services/{name}");
        let out =
            node.kubectl().args(["auth", "can-i", verb, &what, "-n", namespace, who]).output();
        String::from_utf8_lossy(&out.expect("kubectl auth can-i").stdout).trim() == "yes"
    };
    assert!(can_named("list", "kube-dns-upstream", "kube-system"));
    assert!(can_named("watch", "kube-dns-upstream", "kube-system"));
    for (verb, name, namespace) in [
        ("get", "kube-dns-upstream", "kube-system"),
        ("update", "kube-dns-upstream", "kube-system"),
        ("watch", "kube-dns", "kube-system"),
        ("watch", "kube-dns-upstream", "default"),
    ] {
        assert!(!can_named(verb, name, namespace), "{verb} services/{name} in {namespace}");
    }
    assert!(!can("list", "services", "kube-system"), "every Service: not needed");
    // Its own DaemonSet, read at SIGTERM (removal or restart), by name, and nothing more.
    let can_ds = |verb: &str, name: &str| {
        let what = format!("daemonsets.apps/{name}");
        let args = ["auth", "can-i", verb, &what, "-n", "kube-system", who];
        let out = node.kubectl().args(args).output().expect("kubectl auth can-i");
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    assert!(can_ds("get", "nodelocaldns-ha"));
    for (verb, name) in
        [("get", "kube-proxy"), ("delete", "nodelocaldns-ha"), ("patch", "nodelocaldns-ha")]
    {
        assert!(!can_ds(verb, name), "{verb} daemonsets/{name}");
    }
    let only_reports = [("patch", "nodes", "default"), ("get", "nodes", "default")];
    for (verb, what, namespace) in only_reports {
        assert!(!can(verb, what, namespace), "{verb} {what}: not for the reports alone");
    }
    // The startup taint's component adds the node's read and patch, and nothing more.
    let taint_rbac = repo.join("manifests/cluster-reports/startup-taint/rbac.yaml");
    let (ok, out) = run(&["apply", "-f", &taint_rbac.display().to_string()]);
    assert!(ok, "{out}");
    wait_for("the taint's grant in force", Duration::from_secs(10), || {
        can("patch", "nodes", "default").then_some(())
    });
    assert!(can("get", "nodes", "default"));
    for (verb, what, namespace) in [
        ("delete", "nodes", "default"),
        ("create", "nodes", "default"),
        ("update", "nodes/status", "default"),
        ("create", "events", "kube-system"),
        ("delete", "events", "default"),
        ("get", "secrets", "kube-system"),
        ("list", "pods", "default"),
    ] {
        assert!(!can(verb, what, namespace), "{verb} {what} in {namespace} is not needed");
    }
}

/// Whether `name`'s taints have one with `key`.
fn tainted(node: &SimNode, name: &str, key: &str) -> bool {
    let taints = get(node, &["get", "node", name])["spec"]["taints"].clone();
    taints.as_array().into_iter().flatten().any(|t| t["key"] == key)
}

/// The startup taint's key, as manifests/cluster-reports/startup-taint gives it.
const KEY: &str = "nodelocaldns-ha.io/dns-not-ready";

/// Taints `name` with [`KEY`] (NoSchedule), as the cluster's admin.
fn taint(node: &SimNode, name: &str) {
    let out = node.kubectl().args(["taint", "node", name, &format!("{KEY}:NoSchedule")]).output();
    let out = out.expect("kubectl taint");
    assert!(out.status.success(), "{}", describe(&out));
    assert!(tainted(node, name, KEY));
}

/// The agent's `status`, as text.
fn status(node: &SimNode, agent: &Agent) -> String {
    let dir = agent.state_dir.display().to_string();
    String::from_utf8_lossy(&node.cli(&["status", "--state-dir", &dir]).stdout).into_owned()
}

/// `--startup-taint` is a promise of DNS, not of the cache: with the cache dead at start and
/// CoreDNS answering, the taint goes once the fallback is in and CoreDNS answers (route
/// Upstream), `status` and the log saying so; the cache back, it stays gone.
#[test]
fn the_startup_taint_goes_once_pods_have_dns_through_the_cache_or_coredns() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    taint(&node, &name);
    node.kill("cache-kill");
    let kubeconfig = node.dir.join("admin.kubeconfig").display().to_string();
    // Started with the cache dead: its first route is not Local to wait for.
    let flags = ["--node-name", &name, "--kubeconfig", &kubeconfig, "--startup-taint", KEY];
    let agent = node.agent_starting(&flags);
    wait_condition(&node, &name, "False", "FailedOverToCoreDNS");
    wait_for("the taint gone", Duration::from_secs(15), || {
        (!tainted(&node, &name, KEY)).then_some(())
    });
    let said = "removed the startup taint: the fallback to CoreDNS is in and CoreDNS answers";
    assert!(agent.log_text().contains(said), "{}", agent.log_text());
    let text = status(&node, &agent);
    assert!(text.contains(&format!("taint:       {KEY} removed")), "{text}");
    assert!(text.contains("CoreDNS answers"), "{text}");
    let failed = condition(&node, &name).expect("the condition");
    assert!(!failed["message"].as_str().unwrap().contains("startup taint"), "{failed}");

    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    wait_condition(&node, &name, "True", "CacheServing");
    assert!(!tainted(&node, &name, KEY), "the taint came back");
    node.tear_down(agent);
}

/// Neither the cache nor CoreDNS answers: the startup taint stays (`status` says why), until
/// its bound (`--startup-taint-timeout`, 15 s here); then it goes all the same, and the node
/// condition's message and a warning in the log say why.
#[test]
fn without_dns_the_startup_taint_stays_until_its_bound_then_goes_said() {
    const BOUND: Duration = Duration::from_secs(15);
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    taint(&node, &name);
    node.kill("cache-kill");
    node.kill("coredns-kill");
    let kubeconfig = node.dir.join("admin.kubeconfig").display().to_string();
    let flags = [
        "--node-name",
        &name,
        "--kubeconfig",
        &kubeconfig,
        "--startup-taint",
        KEY,
        "--startup-taint-timeout",
        "15s",
    ];
    let started = std::time::Instant::now();
    let agent = node.agent_starting(&flags);
    // Reported (the reports work), and the taint stays, said.
    let reported = wait_for("a condition", Duration::from_secs(10), || condition(&node, &name));
    println!("without DNS: {reported}");
    let kept = wait_for("status saying why the taint stays", Duration::from_secs(10), || {
        Some(status(&node, &agent)).filter(|t| t.contains(&format!("taint:       {KEY} kept:")))
    });
    assert!(tainted(&node, &name, KEY), "the taint went without DNS");
    assert!(started.elapsed() < BOUND, "too slow to see it kept before the bound");
    println!("{kept}");

    wait_for("the taint gone", BOUND + Duration::from_secs(15), || {
        (!tainted(&node, &name, KEY)).then_some(())
    });
    let after = started.elapsed();
    println!("the taint went {after:.1?} after the start");
    assert!(after >= BOUND, "the taint went after {after:?}, before its bound {BOUND:?}");
    let why = "no DNS on the node within --startup-taint-timeout 15s";
    let said = wait_for("the condition saying why", Duration::from_secs(10), || {
        condition(&node, &name).filter(|c| c["message"].as_str().unwrap_or("").contains(why))
    });
    println!("condition: {said}");
    assert_eq!(said["status"], "False", "{said}");
    let log = agent.log_text();
    assert!(log.contains(&format!("removed the startup taint: {why}")), "{log}");
    assert!(log.contains("WARN"), "said as a warning: {log}");
    node.tear_down(agent);
}

/// The agent held to its own Node by manifests/cluster-reports' admission policy, on the real
/// API server. The agent runs as its pod does, with a token bound to its pod on this node (as
/// the kubelet's is), the reports' and the startup taint's RBAC, and the policy: its own writes
/// pass (the condition, the taint's removal). Then writes forged with its token: to another
/// Node, another condition, another taint, a label, a cordon, and with a token that names no
/// node, are each refused with the policy's reason; the condition and its own taint key pass;
/// the admin's writes are not the policy's business.
#[test]
fn the_agent_changes_only_its_own_node() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    let other = node.ns("other");
    for component in ["cluster-reports", "cluster-reports/startup-taint"] {
        kubectl_with(&node, &["apply", "-f", "-"], rbac_of(component).as_bytes());
    }
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let policy = repo.join("manifests/cluster-reports/own-node.yaml").display().to_string();
    kubectl_with(&node, &["apply", "-f", &policy], b"");
    let new_node =
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": other}});
    kubectl_with(&node, &["create", "-f", "-"], new_node.to_string().as_bytes());
    taint(&node, &name);
    let token = node.agent_pod_token();
    let condition_patch = serde_json::json!({"status": {"conditions": [{
        "type": "NodeLocalDNSReady", "status": "True", "reason": "Forged", "message": "forged",
    }]}});
    let to_other = Forged::status(&other, &condition_patch);
    // The policy takes effect through the API server's informer: until its first refusal.
    wait_for("the policy in force", Duration::from_secs(20), || {
        let (code, text) = to_other.send(&node, &token);
        (code == 422).then_some(text)
    });

    let agent = node.agent_in_pod(&["--node-name", &name, "--startup-taint", KEY]);
    wait_condition(&node, &name, "True", "CacheServing");
    wait_for("the taint gone", Duration::from_secs(15), || {
        (!tainted(&node, &name, KEY)).then_some(())
    });
    let log = agent.log_text();
    assert!(!log.contains("denied") && !log.contains("failed"), "{log}");

    let own = |patch: serde_json::Value| Forged::node(&name, &patch);
    let label = serde_json::json!({"metadata": {"labels": {"example.com/forged": "yes"}}});
    // The node's other taints kept (the API server's own node.kubernetes.io/not-ready among
    // them): only the key's changes.
    let taints = get(&node, &["get", "node", &name])["spec"]["taints"].clone();
    let taints: Vec<Value> = taints.as_array().cloned().unwrap_or_default();
    let with = |key: &str| {
        let mut taints = taints.clone();
        taints.push(serde_json::json!({"key": key, "effect": "NoSchedule"}));
        serde_json::json!({"spec": {"taints": taints}})
    };
    let (own_taint, other_taint) = (with(KEY), with("example.com/forged"));
    let cordon = serde_json::json!({"spec": {"unschedulable": true}});
    let other_condition = serde_json::json!({"status": {"conditions": [{
        "type": "Forged", "status": "True", "reason": "Forged", "message": "forged",
    }]}});
    let refused = [
        (
            "another Node's condition",
            to_other,
            format!("the agent of node {name} may change only its own Node, not {other}"),
        ),
        (
            "another condition",
            Forged::status(&name, &other_condition),
            "may change only the NodeLocalDNSReady condition".to_owned(),
        ),
        ("another taint", own(other_taint), format!("may change only the taint {KEY}")),
        ("a label", own(label.clone()), "may not change a Node's labels or annotations".to_owned()),
        ("a cordon", own(cordon), "may not cordon a Node".to_owned()),
    ];
    for (what, write, says) in &refused {
        let (code, text) = write.send(&node, &token);
        println!("{what}: {code} {text}");
        assert_eq!(code, 422, "{what}: {text}");
        assert!(
            text.contains("ValidatingAdmissionPolicy 'nodelocaldns-ha-own-node'"),
            "{what}: {text}"
        );
        assert!(text.contains(says.as_str()), "{what}: {text}");
    }
    for (what, write) in
        [("its condition", Forged::status(&name, &condition_patch)), ("its taint", own(own_taint))]
    {
        let (code, text) = write.send(&node, &token);
        assert_eq!(code, 200, "{what}: {text}");
    }
    assert!(tainted(&node, &name, KEY), "the taint put back with the agent's token");
    // A token of the same account that names no node (not a pod's): nothing.
    let unbound = node.agent_token(&[]);
    let (code, text) = Forged::status(&name, &condition_patch).send(&node, &unbound);
    assert_eq!(code, 422, "{text}");
    assert!(text.contains("the agent's token names no node"), "{text}");
    // Others' writes are not the policy's.
    kubectl_with(&node, &["label", "node", &name, "example.com/by-the-admin=yes"], b"");
    node.tear_down(agent);
}

/// A write to a Node as the agent's token makes it, sent by curl from the node.
struct Forged {
    path: String,
    body: String,
}

impl Forged {
    /// A strategic merge patch of `name`'s status.
    fn status(name: &str, patch: &Value) -> Forged {
        Forged { path: format!("/api/v1/nodes/{name}/status"), body: patch.to_string() }
    }

    /// A strategic merge patch of `name`.
    fn node(name: &str, patch: &Value) -> Forged {
        Forged { path: format!("/api/v1/nodes/{name}"), body: patch.to_string() }
    }

    /// Sends it with `token`: the HTTP status and the answer's message (or body).
    fn send(&self, node: &SimNode, token: &str) -> (u16, String) {
        let server = api_server(node);
        let ca = node.dir.join("pki/ca.crt").display().to_string();
        let auth = format!("Authorization: Bearer {token}");
        let url = format!("{server}{}", self.path);
        let args = [
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            &ca,
            "-H",
            &auth,
            "-X",
            "PATCH",
            "-H",
            "Content-Type: application/strategic-merge-patch+json",
            "-d",
            &self.body,
            "-w",
            "\n%{http_code}",
            &url,
        ];
        let out = node.run("node", "curl", &args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        let code = code.trim().parse().unwrap_or_else(|_| panic!("curl: {}", describe(&out)));
        let message = serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned));
        (code, message.unwrap_or_else(|| body.to_owned()))
    }
}

/// The API server's URL, as the admin's kubeconfig has it.
fn api_server(node: &SimNode) -> String {
    let kubeconfig = std::fs::read_to_string(node.dir.join("admin.kubeconfig")).unwrap();
    let at = kubeconfig.find("https://").expect("the kubeconfig's server");
    let url = &kubeconfig[at..];
    url[..url.find(['"', '\n', ' ']).unwrap_or(url.len())].to_owned()
}

/// A pod started before node-local-dns's upstream Service existed (no
/// `KUBE_DNS_UPSTREAM_SERVICE_HOST` in its environment) waits for it through the API server
/// rather than exits: it starts, says it waits, installs the ruleset of route Local (the cache
/// serves as without the agent), and is not ready; the Service created, it is picked up within
/// seconds, probed, and the agent is ready, the log saying how long it waited.
#[test]
fn a_missing_upstream_service_is_waited_for() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    kubectl_with(&node, &["apply", "-f", "-"], rbac_of("cluster-reports").as_bytes());
    let old = get(&node, &["get", "service", "-n", "kube-system", "kube-dns-upstream"]);
    kubectl_with(&node, &["delete", "service", "-n", "kube-system", "kube-dns-upstream"], b"");
    // Waits for route Local: the cache serves meanwhile.
    let agent =
        node.agent_in_pod_env(&["--node-name", &name], &[("KUBE_DNS_UPSTREAM_SERVICE_HOST", "")]);
    let readyz = || {
        let args =
            ["-sS", "--max-time", "5", "-w", "\n%{http_code}", "http://127.0.0.1:9254/readyz"];
        let out = node.run("node", "curl", &args);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let waiting = wait_for("the state saying it waits", Duration::from_secs(10), || {
        agent.state().filter(|s| s["upstream_from"].as_str().unwrap_or("").contains("waited for"))
    });
    println!("waiting: {}", waiting["upstream_from"]);
    assert_eq!(waiting["route"], "local");
    assert_eq!(waiting["probes"]["upstream"]["sent"], 0, "an upstream without an address probed");
    assert_eq!(waiting["probes"]["upstream"]["target"], "none yet");
    let not_ready = readyz();
    assert!(not_ready.ends_with("503"), "{not_ready}");
    assert!(
        not_ready.contains("waiting for the upstream's Service kube-dns-upstream"),
        "{not_ready}"
    );
    wait_condition(&node, &name, "True", "CacheServing");
    assert!(
        agent.log_text().contains("waiting for the upstream's Service"),
        "{}",
        agent.log_text()
    );

    let mut service = old.clone();
    service["metadata"] = serde_json::json!({
        "name": "kube-dns-upstream",
        "namespace": "kube-system",
        "labels": old["metadata"]["labels"],
    });
    service.as_object_mut().unwrap().remove("status");
    let created = std::time::Instant::now();
    kubectl_with(&node, &["create", "-f", "-"], &serde_json::to_vec(&service).unwrap());
    let followed = "Service kube-system/kube-dns-upstream";
    let found = wait_for("the Service picked up and answering", Duration::from_secs(10), || {
        agent.state().filter(|s| {
            s["upstream_from"] == followed
                && s["probes"]["upstream"]["target"] == format!("{UPSTREAM_IP}:53")
                && s["probes"]["upstream"]["streak_good"].as_u64() >= Some(1)
        })
    });
    println!(
        "picked up {:.1?} after its creation: {}",
        created.elapsed(),
        found["probes"]["upstream"]
    );
    assert_eq!(found["route"], "local");
    wait_for("ready", Duration::from_secs(5), || Some(readyz()).filter(|r| r.ends_with("200")));
    let log = agent.log_text();
    assert!(log.contains("the upstream's Service is there after waiting for it"), "{log}");
    node.tear_down(agent);
}

/// Events refused (the reports' RBAC without `create events`, as a tighter policy or an
/// EventRateLimit would have it): the node condition and the startup taint do not wait for
/// them. The agent starts with the cache dead, on a tainted node: the condition says so, and the
/// taint goes once CoreDNS answers through the fallback; the cache comes back: the condition
/// goes to CacheServing; though every Event (one per route change) is refused, which the log
/// says once.
#[test]
fn refused_events_hold_back_neither_the_condition_nor_the_startup_taint() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    let reports = rbac_of("cluster-reports");
    let without_events: Vec<&str> =
        reports.split("\n---\n").filter(|doc| !doc.contains("nodelocaldns-ha-events")).collect();
    let rbac = [without_events.join("\n---\n"), rbac_of("cluster-reports/startup-taint")];
    grant_rbac(&node, &rbac.join("\n---\n"), &["patch", "nodes", "--subresource=status"]);
    let who = format!("--as={AGENT_USER}");
    let can_i = ["auth", "can-i", "create", "events", "-n", "default", &who];
    let out = node.kubectl().args(can_i).output().expect("kubectl auth can-i");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no", "{}", describe(&out));
    let taint = ["taint", "node", &name, &format!("{KEY}:NoSchedule")];
    let out = node.kubectl().args(taint).output().expect("kubectl taint");
    assert!(out.status.success(), "{}", describe(&out));

    node.kill("cache-kill");
    let kubeconfig = agent_kubeconfig(&node);
    let flags = ["--node-name", &name, "--kubeconfig", &kubeconfig, "--startup-taint", KEY];
    let agent = node.agent_starting(&flags);
    wait_condition(&node, &name, "False", "FailedOverToCoreDNS");
    wait_for("the taint gone", Duration::from_secs(15), || {
        (!tainted(&node, &name, KEY)).then_some(())
    });
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    let serving = wait_condition(&node, &name, "True", "CacheServing");
    println!("with Events refused: {serving}");
    assert!(events(&node, &name).is_empty(), "an Event was recorded: {:?}", events(&node, &name));
    let refused = "recording an Event on the node failed";
    wait_for("the refused Event in the log", Duration::from_secs(10), || {
        agent.log_text().contains(refused).then_some(())
    });
    assert_eq!(agent.log_text().matches(refused).count(), 1, "said once: {}", agent.log_text());
    node.tear_down(agent);
}

/// Acceptance 4, an API server that refuses (403: the agent's user has no rights yet) through a
/// cache SIGKILL: the failover is as without it (no pod lookup fails), the refusal is logged
/// once; once the rights are granted, the condition is caught up and the route changes are
/// reported in one Event.
#[test]
fn a_refusing_api_server_changes_nothing_in_the_failover_and_is_caught_up() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    let kubeconfig = agent_kubeconfig(&node);
    let agent = node.agent(&["--node-name", &name, "--kubeconfig", &kubeconfig]);
    wait_for("the refusal in the log", Duration::from_secs(10), || {
        agent.log_text().contains("reporting to the API server failed").then_some(())
    });
    assert!(agent.log_text().contains("403"), "{}", agent.log_text());
    kill_and_restart_under_load(&node, &agent);
    assert!(condition(&node, &name).is_none(), "nothing reported while refused");
    grant(&node, "cluster-reports", &["patch", "nodes", "--subresource=status"]);
    assert_caught_up(&node, &name, &agent);
    node.tear_down(agent);
}

/// Acceptance 3: kube-dns-upstream deleted and re-created with a new ClusterIP. The agent runs
/// as its pod does (in-cluster configuration, a token the API server issued to its service
/// account, which has exactly the component's RBAC; the upstream from the pod's environment,
/// `KUBE_DNS_UPSTREAM_SERVICE_HOST`, fixed when the pod started). It reports (the condition),
/// and follows the Service: while it is gone the old address fails its probes (without
/// following, a cache failure would be held on the cache from then on); once re-created, the
/// new address is probed and answers within seconds, and a cache SIGKILL fails no lookup of the
/// cluster-DNS IP, nor of the link-local IP, whose forwarder dials the new address too.
#[test]
fn a_recreated_upstream_service_is_followed() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rbac = repo.join("manifests/cluster-reports/rbac.yaml").display().to_string();
    let out = node.kubectl().args(["apply", "-f", &rbac]).output().expect("kubectl");
    assert!(out.status.success(), "{}", describe(&out));
    let agent = node.agent_in_pod(&["--node-name", &name]);
    wait_condition(&node, &name, "True", "CacheServing");
    let followed = "Service kube-system/kube-dns-upstream";
    let upstream = |state: &Value| state["probes"]["upstream"].clone();
    wait_for("the Service followed", Duration::from_secs(10), || {
        agent.state().filter(|s| s["upstream_from"] == followed)
    });

    let old = get(&node, &["get", "service", "-n", "kube-system", "kube-dns-upstream"]);
    let out = node
        .kubectl()
        .args(["delete", "service", "-n", "kube-system", "kube-dns-upstream"])
        .output()
        .expect("kubectl");
    assert!(out.status.success(), "{}", describe(&out));
    let gone = wait_for("the old address failing", Duration::from_secs(15), || {
        agent.state().filter(|s| {
            let from = s["upstream_from"].as_str().unwrap_or("");
            from.contains("not found") && upstream(s)["streak_bad"].as_u64() >= Some(1)
        })
    });
    println!("gone: {} {}", gone["upstream_from"], upstream(&gone));
    assert_eq!(upstream(&gone)["target"], format!("{UPSTREAM_IP}:53"));

    let new_ip = "10.96.0.12";
    let mut service = old.clone();
    service["metadata"] = serde_json::json!({
        "name": "kube-dns-upstream",
        "namespace": "kube-system",
        "labels": old["metadata"]["labels"],
    });
    service["spec"]["clusterIP"] = Value::from(new_ip);
    service["spec"]["clusterIPs"] = Value::from(vec![new_ip]);
    service.as_object_mut().unwrap().remove("status");
    kubectl_with(&node, &["create", "-f", "-"], &serde_json::to_vec(&service).unwrap());
    let moved = wait_for("the new address answering", Duration::from_secs(15), || {
        agent.state().filter(|s| {
            let probes = upstream(s);
            s["upstream_from"] == followed
                && probes["target"] == format!("{new_ip}:53")
                && probes["streak_good"].as_u64() >= Some(2)
        })
    });
    println!("moved: {}", upstream(&moved));

    let args = ["--rate", "300", "--duration", "60s", "--report-interval", "100ms"];
    let mut cluster_dns = node.load("pod1", CLUSTER_DNS_IP, &args);
    let mut link_local = node.load("pod2", LOCAL_IP, &args);
    let restart = kill_and_restart_cache(&node, &agent, &mut [&mut cluster_dns, &mut link_local]);
    for (who, load) in [("cluster-DNS IP", cluster_dns), ("link-local IP", link_local)] {
        let summary = load.interrupt();
        println!("{who}: {summary}");
        assert_eq!(summary["failed"], 0, "{who}: {summary}");
        assert_lost_to_the_kill(who, &summary, restart.killed_at, restart.gone_at);
    }
    let log = agent.log_text();
    assert!(log.contains("the upstream follows its Service"), "{log}");
    node.tear_down(agent);
}

/// The agent's DaemonSet on the test bed, as the chart and manifests/base name it (no
/// controller runs here: it never has pods, and a foreground deletion leaves it there, being
/// deleted, as while the garbage collector deletes its pods).
const AGENT_DAEMONSET: &str = r#"{"apiVersion": "apps/v1", "kind": "DaemonSet",
 "metadata": {"name": "nodelocaldns-ha", "namespace": "kube-system"},
 "spec": {"selector": {"matchLabels": {"k8s-app": "nodelocaldns-ha"}},
  "template": {"metadata": {"labels": {"k8s-app": "nodelocaldns-ha"}},
   "spec": {"containers": [{"name": "agent", "image": "nodelocaldns-ha"}]}}}}"#;

/// The node's netfilter and lo's addresses, as lines to compare: the whole nftables ruleset
/// (iptables-nft's tables included), what iptables-legacy holds, lo's addresses; counters left
/// out, and sorted (kube-proxy's resyncs may list its chains in another order).
fn netfilter(node: &SimNode) -> Vec<String> {
    let run = |cmd: &str, args: &[&str]| {
        let out = node.run("node", cmd, args);
        assert!(out.status.success(), "{cmd} {args:?}: {}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let nft = run("nft", &["list", "ruleset"]);
    let legacy = run("iptables-legacy-save", &[]);
    let lo = run("ip", &["-o", "address", "show", "dev", "lo"]);
    let mut lines: Vec<String> = nft
        .lines()
        .chain(legacy.lines().filter(|l| !l.starts_with('#')))
        .chain(lo.lines())
        .map(without_counters)
        .collect();
    lines.sort();
    lines
}

/// `line` without its counters: nftables' `packets N bytes M`, iptables-save's `[N:M]`.
fn without_counters(line: &str) -> String {
    let mut words: Vec<&str> = line.split(' ').collect();
    while let Some(i) = words.windows(4).position(|w| w[0] == "packets" && w[2] == "bytes") {
        words.drain(i..i + 4);
    }
    words.retain(|w| !(w.starts_with('[') && w.ends_with(']') && w.contains(':')));
    words.join(" ")
}

/// The agent's own: its nftables table and lo's addresses (counters left out).
fn agent_rules(node: &SimNode) -> Vec<String> {
    let out = node.run("node", "nft", &["list", "table", "inet", "nodelocaldns-ha"]);
    assert!(out.status.success(), "the agent's table: {}", describe(&out));
    let lo = node.run("node", "ip", &["-o", "address", "show", "dev", "lo"]);
    let (table, lo) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&lo.stdout));
    table.lines().chain(lo.lines()).map(without_counters).collect()
}

/// The agent as its pod runs it with the chart's clusterReports and startupTaint: its user with
/// exactly the RBAC of `manifests/cluster-reports` and its startup-taint component, its
/// DaemonSet named; started once the Node has the condition and had its taint removed.
fn agent_of_the_daemonset(node: &SimNode, name: &str) -> Agent {
    let rbac = format!(
        "{}\n---\n{}",
        rbac_of("cluster-reports"),
        rbac_of("cluster-reports/startup-taint")
    );
    grant_rbac(node, &rbac, &["get", "daemonsets/nodelocaldns-ha", "-n", "kube-system"]);
    let kubeconfig = agent_kubeconfig(node);
    let flags = [
        "--node-name",
        name,
        "--kubeconfig",
        &kubeconfig,
        "--startup-taint",
        KEY,
        "--daemonset",
        "nodelocaldns-ha",
    ];
    let agent = node.agent(&flags);
    wait_condition(node, name, "True", "CacheServing");
    agent
}

/// The uninstall: the agent's DaemonSet deleted by `uninstall`, as the chart's pre-delete hook
/// runs it (foreground: there, being deleted, while its pods get their SIGTERM), then the
/// agent's SIGTERM. It tears down as `teardown` does and cleans its Node: the node's netfilter and lo
/// are as before the agent started, byte for byte but for counters; the condition is gone, and
/// so is the startup taint (put back on the node for this: the agent had taken it off at start).
#[test]
fn sigterm_with_the_daemonset_deleted_puts_the_node_back() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    kubectl_with(&node, &["apply", "-f", "-"], AGENT_DAEMONSET.as_bytes());
    taint(&node, &name);
    let before = netfilter(&node);
    let mut agent = agent_of_the_daemonset(&node, &name);
    wait_for("the startup taint removed", Duration::from_secs(15), || {
        (!tainted(&node, &name, KEY)).then_some(())
    });
    assert_ne!(netfilter(&node), before, "the agent installed nothing");
    taint(&node, &name);
    // The chart's pre-delete hook: `uninstall`, with its Role's rights (get and delete of the
    // DaemonSet); no garbage collector here, so the DaemonSet stays being deleted, said.
    let hook_role = r#"{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
     "metadata": {"name": "nodelocaldns-ha-uninstall", "namespace": "kube-system"},
     "rules": [{"apiGroups": ["apps"], "resources": ["daemonsets"],
       "resourceNames": ["nodelocaldns-ha"], "verbs": ["get", "delete"]}]}"#;
    kubectl_with(&node, &["apply", "-f", "-"], hook_role.as_bytes());
    let binding = ["create", "rolebinding", "nodelocaldns-ha-uninstall", "-n", "kube-system"];
    let binding = [&binding[..], &["--role=nodelocaldns-ha-uninstall", "--user", AGENT_USER]];
    kubectl_with(&node, &binding.concat(), b"");
    let kubeconfig = agent_kubeconfig(&node);
    wait_for("the hook's grant in force", Duration::from_secs(10), || {
        let args = ["auth", "can-i", "delete", "daemonsets.apps/nodelocaldns-ha", "-n"];
        let who = format!("--as={AGENT_USER}");
        let out = node.kubectl().args(args).args(["kube-system", &who]).output().ok()?;
        (String::from_utf8_lossy(&out.stdout).trim() == "yes").then_some(())
    });
    let hook = node.cli(&["uninstall", "--kubeconfig", &kubeconfig, "--timeout", "2s"]);
    let said = describe(&hook);
    println!("uninstall: {said}");
    assert!(hook.status.success(), "{said}");
    assert!(said.contains("is still being deleted after 2s"), "{said}");

    let exit = agent.stop(nix::sys::signal::Signal::SIGTERM);
    let log = agent.log_text();
    println!("{}", log.lines().rev().take(8).collect::<Vec<_>>().join("\n"));
    assert_eq!(exit.code(), Some(0), "{log}");
    for says in [
        "DaemonSet kube-system/nodelocaldns-ha is being deleted",
        "the agent is being removed from the node",
        "removed everything nodelocaldns-ha installed",
        "removed the condition NodeLocalDNSReady",
        "removed the startup taint",
    ] {
        assert!(log.contains(says), "{says:?} not said:\n{log}");
    }
    assert_eq!(netfilter(&node), before, "the node's netfilter is not as before the agent");
    node.assert_nothing_left();
    assert_eq!(condition(&node, &name), None, "the condition is left");
    assert!(!tainted(&node, &name, KEY), "the startup taint is left");
    // DNS as without the agent: kube-proxy's DNAT to CoreDNS.
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER);
}

/// A restart: the DaemonSet there at SIGTERM (a rolling update, the pod deleted, a drain). The
/// rules stay, and so does the condition, and the log says why; the next agent adopts them.
/// Then the API server hung (SIGSTOP) at the next agent's SIGTERM: it cannot be asked within
/// 3 s, and the rules stay, said, the agent gone within the pod's grace period.
#[test]
fn sigterm_with_the_daemonset_there_or_the_api_server_hung_keeps_the_rules() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let name = node.ns("node");
    kubectl_with(&node, &["apply", "-f", "-"], AGENT_DAEMONSET.as_bytes());
    let mut agent = agent_of_the_daemonset(&node, &name);
    let installed = agent_rules(&node);
    let state = agent.state().expect("the agent's state");
    assert_eq!(agent.stop(nix::sys::signal::Signal::SIGTERM).code(), Some(0));
    let log = agent.log_text();
    assert!(log.contains("DaemonSet kube-system/nodelocaldns-ha is still there"), "{log}");
    assert!(log.contains("the ruleset of the current route stays installed"), "{log}");
    assert_eq!(agent_rules(&node), installed, "the rules went with a restart");
    assert!(condition(&node, &name).is_some(), "the condition went with a restart");

    let kubeconfig = agent_kubeconfig(&node);
    let flags =
        ["--node-name", &name, "--kubeconfig", &kubeconfig, "--daemonset", "nodelocaldns-ha"];
    let mut agent = node.agent_restarting(&flags, &state);
    agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(agent.state().unwrap()["transitions"], 0, "the restart flipped the route");
    node.script(&["kube-apiserver-stop"]);
    let asked = std::time::Instant::now();
    let exit = agent.stop(nix::sys::signal::Signal::SIGTERM);
    let took = asked.elapsed();
    node.script(&["kube-apiserver-cont"]);
    let log = agent.log_text();
    assert_eq!(exit.code(), Some(0), "{log}");
    assert!(log.contains("the API server did not say within 3s"), "{log}");
    assert!(took < Duration::from_secs(5), "SIGTERM took {took:?}");
    assert_eq!(agent_rules(&node), installed, "the rules went with the API server hung");
    let out = node.cli(&["teardown", "--state-dir", &agent.state_dir.display().to_string()]);
    assert!(out.status.success(), "{}", describe(&out));
    node.assert_nothing_left();
}
