//! Host firewalls and half-applied rulesets (issue 17): what pods experience is what the agent
//! decides on. A firewall that rejects at the end of INPUT, an ACCEPT that cannot be installed
//! (the xtables lock held) at start or in the middle of a switch: pods keep their DNS.

use std::time::Duration;

use testkit::*;

/// Pod lookups at 300/s (glibc-like: 1 s timeout, 2 attempts) until `finish`.
fn pod_load(node: &SimNode, duration: &str) -> Load {
    node.load(
        "pod1",
        CLUSTER_DNS_IP,
        &["--rate", "300", "--duration", duration, "--report-interval", "100ms"],
    )
}

/// A second of pod lookups at 200/s: every one answered, all by `origin` (`cache`, `coredns`).
fn all_answered_by(node: &SimNode, origin: &str) {
    let args = ["--rate", "200", "--duration", "1s", "--report-interval", "0"];
    let summary = node.load("pod1", CLUSTER_DNS_IP, &args).finish();
    println!("a second of lookups: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert_eq!(summary["by_origin"][origin], summary["sent"], "{summary}");
}

/// Issue 17, acceptance 1: INPUT policy ACCEPT ending in a REJECT (RHEL's iptables-services).
/// The agent puts its ACCEPTs first in the node's iptables flavour, as node-cache does, so pods
/// are answered by the cache; a SIGKILL and a hang of the cache cost no lookup.
fn reject_firewall(kube_proxy: &str, dataplane: &str, flavour: &str) {
    let node = SimNode::up_with(&["--kube-proxy", kube_proxy, "--filter-reject"]);
    let agent = node.agent(&["--dataplane", dataplane]);
    let st = agent.state().expect("state");
    assert_eq!(st["accepts_in"], serde_json::json!([flavour]), "{st}");

    // Before any fault, the cache answers every pod lookup.
    all_answered_by(&node, "cache");

    let mut load = pod_load(&node, "9s");
    load.wait_cache_answers();
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(15));
    load.wait_cache_answers();
    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.signal("cache-cont");
    let summary = load.finish();
    println!("{dataplane} across kill and hang: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert!(summary["by_origin"]["coredns"].as_u64() > Some(0), "never failed over: {summary}");
}

#[test]
fn reject_firewall_nftables() {
    reject_firewall("nftables", "nftables", "iptables-nft");
}

#[test]
fn reject_firewall_iptables_legacy() {
    reject_firewall("iptables-legacy", "iptables-legacy", "iptables-legacy");
}

#[test]
fn reject_firewall_iptables_nft() {
    reject_firewall("iptables-nft", "iptables-nft", "iptables-nft");
}

/// The agent's chains in iptables-legacy's `table`, as `iptables-legacy-save` shows them.
fn legacy_has_agent_chains(node: &SimNode, table: &str) -> bool {
    let out = node.run("node", "iptables-legacy-save", &["-t", table]);
    String::from_utf8_lossy(&out.stdout).contains("NODELOCALDNS-HA")
}

/// Issue 17, acceptance 4 (start): a DROP-policy node whose ACCEPTs go to iptables-legacy while
/// the agent switches with nftables; the xtables lock is held for 8 s as the agent starts. The
/// Local NOTRACK never goes in without its ACCEPTs: the agent starts on Upstream (nothing
/// needed of the cache), keeps running, and gets Local once the lock is free.
#[test]
fn accept_failure_at_start_never_strands_pods() {
    let node = SimNode::up_with(&[
        "--kube-proxy",
        "iptables-legacy",
        "--filter-drop",
        "--filter-accept-lo",
    ]);
    let lock = node.dir.join("xtables.lock").display().to_string();
    node.script(&["xtables-lock-hold", "8"]);
    let load = pod_load(&node, "12s");
    let env = [("XTABLES_LOCKFILE", lock.as_str())];
    let agent = node.agent_starting_env(&["--dataplane", "nftables", "--xtables-wait", "1s"], &env);
    let st = wait_for("the failed install to be told", Duration::from_secs(10), || {
        agent.state().filter(|s| s["last_error"].as_str().is_some_and(|e| e.contains("lock")))
    });
    println!("while locked: {st}");
    assert_eq!(st["route"], "upstream", "{st}");
    assert!(!legacy_has_agent_chains(&node, "filter"), "ACCEPTs went in under a held lock?");
    // Whatever of the agent's is in nftables does not NOTRACK pods' queries to the cluster IP.
    if let Some(table) = node.agent_table() {
        assert!(!table.contains("socket transparent"), "Local NOTRACK without ACCEPTs:\n{table}");
    }
    // Alive meanwhile: the state keeps being written.
    let before = st["updated_unix_ms"].as_u64().unwrap();
    wait_for("the state to keep updating", Duration::from_secs(5), || {
        agent.state().filter(|s| s["updated_unix_ms"].as_u64() > Some(before))
    });
    node.script(&["xtables-lock-release"]);
    wait_for("Local to be installed", Duration::from_secs(20), || {
        agent.state().filter(|s| s["route"] == "local" && s["last_error"].is_null())
    });
    assert_eq!(node.agent_table(), Some(node.expected_table("local")));
    assert!(legacy_has_agent_chains(&node, "filter"), "no ACCEPTs after the lock was freed");
    let summary = load.finish();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert!(summary["by_origin"]["cache"].as_u64() > Some(0), "never back on the cache: {summary}");
}

/// Issue 17, acceptance 4 (mid-switch): the same node, the agent on Local. The lock is held and
/// a firewall reload removes the agent's ACCEPTs: the agent cannot put them back, so it takes
/// the Local NOTRACK out instead of leaving it without them. Then the cache is killed and
/// restarted: the way out (Upstream) needs no lock; the way back to Local waits for its ACCEPTs.
/// Pods (glibc-like, 3 s timeout) keep their DNS throughout.
#[test]
fn accept_failure_mid_switch_never_strands_pods() {
    let node = SimNode::up_with(&[
        "--kube-proxy",
        "iptables-legacy",
        "--filter-drop",
        "--filter-accept-lo",
    ]);
    let lock = node.dir.join("xtables.lock").display().to_string();
    let env = [("XTABLES_LOCKFILE", lock.as_str())];
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        &["--dataplane", "nftables", "--xtables-wait", "1s", "--min-hold", "1s"],
        &env,
    );
    assert!(legacy_has_agent_chains(&node, "filter"));
    let args = ["--rate", "300", "--duration", "14s", "--report-interval", "100ms"];
    let mut load = node.load("pod1", CLUSTER_DNS_IP, &[&args[..], &["--timeout", "3s"]].concat());
    load.wait_cache_answers();
    node.script(&["xtables-lock-hold", "10"]);
    // A firewall reload (without the node's lock file: it is not the agent's) drops the jump.
    let reload = node.run(
        "node",
        "iptables-legacy",
        &[
            "-D",
            "INPUT",
            "-m",
            "comment",
            "--comment",
            "nodelocaldns-ha",
            "-j",
            "NODELOCALDNS-HA-INPUT",
        ],
    );
    assert!(reload.status.success(), "{}", describe(&reload));
    let safe = wait_for("the steering to be taken out", Duration::from_secs(5), || {
        node.agent_table().filter(|t| !t.contains("socket transparent"))
    });
    assert_eq!(safe, node.expected_table("upstream"));
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.script(&["cache-start"]);
    let local = agent.wait_route("local", Duration::from_secs(10));
    println!("decided local while locked: {local}");
    // Decided, but not installed without its ACCEPTs: pods still go to CoreDNS.
    assert_eq!(node.agent_table(), Some(node.expected_table("upstream")));
    assert!(local["last_error"].as_str().is_some_and(|e| e.contains("lock")), "{local}");
    node.script(&["xtables-lock-release"]);
    wait_for("Local to be installed", Duration::from_secs(15), || {
        agent.state().filter(|s| s["last_error"].is_null())
    });
    assert_eq!(node.agent_table(), Some(node.expected_table("local")));
    assert!(legacy_has_agent_chains(&node, "filter"));
    load.wait_cache_answers();
    let summary = load.finish();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
}

/// Issue 17, acceptance 2: a native nftables firewall (firewalld's shape) whose input chain
/// ends in `reject`. No ACCEPT of the agent's can override it, so the agent keeps pods off the
/// cache: it stays Upstream, `status` names the chain and the rule to add, and no pod lookup
/// fails. With that rule added, the cache earns Local back; without it again, Upstream.
#[test]
fn nftables_firewall_that_rejects_keeps_pods_upstream() {
    let node = SimNode::up_with(&["--kube-proxy", "nftables", "--nft-firewall"]);
    let load = node.load(
        "pod1",
        CLUSTER_DNS_IP,
        &["--rate", "200", "--duration", "3s", "--report-interval", "0"],
    );
    let agent = node.agent_starting(&["--dataplane", "nftables", "--min-hold", "1s"]);
    let st = agent.wait_route("upstream", Duration::from_secs(5));
    println!("state: {st}");
    assert_eq!(st["transitions"], 0, "never Local, not even for a moment: {st}");
    let reason = st["reason"].as_str().unwrap();
    assert!(reason.contains("inet simnode-firewalld filter_INPUT"), "{st}");
    let dir = agent.state_dir.display().to_string();
    let status = node.cli(&["status", "--state-dir", &dir]);
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    println!("{text}");
    let fixes: Vec<String> = text
        .lines()
        .filter_map(|l| {
            l.split_once("add `").map(|(_, rest)| rest.trim_end_matches('`').to_owned())
        })
        .collect();
    let prefix = "nft insert rule inet simnode-firewalld filter_INPUT ip daddr";
    for ip in [LOCAL_IP, CLUSTER_DNS_IP] {
        let want = format!("{prefix} {ip} th dport 53 accept");
        assert!(fixes.contains(&want), "status does not say `{want}`:\n{text}");
    }
    let summary = load.finish();
    println!("blocked: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert_eq!(summary["by_origin"]["coredns"], summary["sent"], "{summary}");

    // The operator adds the rules status gave, word for word: the cache earns Local back.
    for fix in &fixes {
        let words: Vec<&str> = fix.split_whitespace().collect();
        let added = node.run("node", words[0], &words[1..]);
        assert!(added.status.success(), "{}", describe(&added));
    }
    let local = agent.wait_route("local", Duration::from_secs(10));
    assert!(
        local["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| !w.to_string().contains("filter_INPUT")),
        "{local}"
    );
    all_answered_by(&node, "cache");

    // A firewall reload that drops the rule again: back to Upstream, told by the kernel's
    // change announcement (not the 30 s safety net).
    let reload =
        node.run("node", "nft", &["flush", "chain", "inet", "simnode-firewalld", "filter_INPUT"]);
    assert!(reload.status.success(), "{}", describe(&reload));
    let reject = node.run(
        "node",
        "nft",
        &["add", "rule", "inet", "simnode-firewalld", "filter_INPUT", "reject"],
    );
    assert!(reject.status.success(), "{}", describe(&reject));
    agent.wait_route("upstream", Duration::from_secs(3));
}

/// A UDP listener in the node namespace on `[::]:9999` (IPv4 too), a port the host firewall of
/// `--filter-drop` closes, reporting every datagram it gets until the marker, which the node
/// sends it over lo (accepted by the firewall's `-i lo -d 127.0.0.0/8`): packets sent before
/// the marker have been judged by INPUT once it arrives (a veth delivers on the sender's send).
const CLOSED_PORT_LISTENER: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", 9999))
s.settimeout(10)
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(64)
    if data == b"marker":
        break
    print("got", data.decode(), peer[0], flush=True)
print("done", flush=True)
"#;

/// Sends one datagram from `[src]:53` (an address the sender need not have: IP_TRANSPARENT,
/// which, unlike IP_FREEBIND, also lets it be routed from there) to
/// `[dst]:9999`, its text `label`; from `[src]:<sport>` when a fourth argument gives one.
const SPOOFER: &str = r#"
import socket, sys
src, dst, label = sys.argv[1:4]
sport = int(sys.argv[4]) if len(sys.argv) > 4 else 53
v6 = ":" in src
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
if v6:
    s.setsockopt(socket.IPPROTO_IPV6, 75, 1)  # IPV6_TRANSPARENT
else:
    s.setsockopt(socket.IPPROTO_IP, 19, 1)  # IP_TRANSPARENT
s.bind((src, sport))
s.sendto(label.encode(), (dst, 9999))
"#;

/// Issue 30 (2): the ACCEPT for the cache's replies to host clients (`-s <listen IP> --sport
/// 53`, first in INPUT) took any packet claiming that source, from anywhere, to any port. It
/// now takes them only from lo. From a pod, datagrams from each listen IP's port 53 to a port
/// the host firewall closes are dropped, IPv4 and IPv6; the listen addresses are first removed
/// from the node (a reboot before node-cache makes its interface), so that IPv4's own check of
/// a local source address does not drop them first. Host clients still get their answers.
#[test]
fn spoofed_replies_from_a_listen_ip_do_not_pass_the_host_firewall() {
    let node =
        SimNode::up_with(&["--kube-proxy", "iptables-legacy", "--family", "dual", "--filter-drop"]);
    let agent = node.agent_for(
        "169.254.20.10,fd00:169:254::10",
        "10.96.0.10,fd00:96::10",
        "10.96.0.11,fd00:96::11",
        &["--dataplane", "iptables-legacy"],
    );
    // Host-network clients are answered: their replies come in on lo.
    for server in [CLUSTER_DNS_IP, "fd00:96::10"] {
        assert_eq!(node.dig("node", server), CACHE_ANSWER, "host client of {server}");
    }
    node.script(&["listen-addrs-del"]);

    let mut listener = node
        .cmd("node", "python3")
        .args(["-c", CLOSED_PORT_LISTENER])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("listener");
    let mut out = std::io::BufReader::new(listener.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let spoofs = [
        ("10.96.0.10", "10.244.0.1", "cluster-dns-v4"),
        ("169.254.20.10", "10.244.0.1", "link-local-v4"),
        ("fd00:96::10", "fd00:244::1", "cluster-dns-v6"),
        ("fd00:169:254::10", "fd00:244::1", "link-local-v6"),
    ];
    for (src, dst, label) in spoofs {
        let sent = node.run("pod1", "python3", &["-c", SPOOFER, src, dst, label]);
        assert!(sent.status.success(), "{label}: {}", describe(&sent));
    }
    let marker =
        node.run("node", "python3", &["-c", SPOOFER, "127.0.0.1", "127.0.0.1", "marker", "0"]);
    assert!(marker.status.success(), "{}", describe(&marker));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(listener.wait().unwrap().success(), "the listener saw no marker: {rest}");
    println!("the closed port received: {rest}");
    assert_eq!(rest.trim(), "done", "spoofed replies passed the host firewall");
    node.tear_down(agent);
}

/// `nft` in the node's namespace, each argument a word; must succeed.
fn nft(node: &SimNode, words: &str) {
    let out = node.run("node", "nft", &words.split_whitespace().collect::<Vec<_>>());
    assert!(out.status.success(), "nft {words}: {}", describe(&out));
}

/// Issue 30, defect 4: firewalld's usual allowance for pods, a trusted zone for the pod CIDR
/// (`ip saddr`) or the CNI's interfaces (`iifname`), was an unknown match to the agent, which
/// kept the route on Upstream for good where node-local-dns alone served the pods (red before:
/// the agent never left Upstream). The agent now judges the firewall for each place the node's
/// routes put pods (here the pods' /32 routes on their veths, `pod1` and `pod2`): trusted, the
/// cache serves them; untrusted again, Upstream.
#[test]
fn a_firewalld_trusted_zone_for_the_pods_lets_the_cache_serve_them() {
    let node = SimNode::up_with(&["--kube-proxy", "nftables", "--nft-firewall"]);
    let table = "inet simnode-firewalld";
    nft(&node, &format!("add chain {table} filter_IN_trusted"));
    nft(&node, &format!("add rule {table} filter_IN_trusted accept"));
    // The zones' dispatch replaced in one transaction, as firewalld's reload does: flushed
    // alone, the chain would fall through to filter_INPUT's reject for a moment.
    let batch = std::env::temp_dir().join(format!("nlha-zones-{}.nft", std::process::id()));
    let zones = |dispatch: &str| {
        let rules = format!(
            "flush chain {table} filter_INPUT_ZONES\n{}add rule {table} filter_INPUT_ZONES goto filter_IN_public\n",
            if dispatch.is_empty() { String::new() } else { format!("add rule {table} filter_INPUT_ZONES {dispatch}\n") }
        );
        std::fs::write(&batch, rules).unwrap();
        nft(&node, &format!("-f {}", batch.display()));
    };
    // firewall-cmd --zone=trusted --add-source=10.244.0.0/16
    zones("ip saddr 10.244.0.0/16 goto filter_IN_trusted");
    let agent = node.agent(&["--dataplane", "nftables", "--min-hold", "1s"]);
    let st = agent.wait_route("local", Duration::from_secs(10));
    println!("trusted by source: {st}");
    all_answered_by(&node, "cache");

    // firewall-cmd --zone=trusted --add-interface=pod+ (the CNI's veths)
    zones("iifname \"pod*\" goto filter_IN_trusted");
    all_answered_by(&node, "cache");
    assert_eq!(agent.state().expect("state")["route"], "local");

    // Trust withdrawn: the public zone rejects DNS, and the agent says which pods it stops.
    zones("");
    let st = agent.wait_route("upstream", Duration::from_secs(3));
    println!("untrusted: {st}");
    let warned = st["warnings"].as_array().unwrap().iter();
    assert!(
        warned.filter_map(|w| w.as_str()).any(|w| w.contains("(pods on pod1 10.244.0.2/32)")),
        "{st}"
    );
    all_answered_by(&node, "coredns");
    let _ = std::fs::remove_file(&batch);
}
