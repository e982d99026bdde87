//! Operating the agent on the simulated node: manual flips, drains for a rolling update of
//! node-local-dns, metrics and health endpoints, the transition hook.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::Signal;
use testkit::*;

fn state_dir(agent: &Agent) -> String {
    agent.state_dir.display().to_string()
}

/// Issue 4, acceptance 1: `flip upstream --for 2s` routes to CoreDNS at once and is automatic
/// again when the 2 s are over: not before, and at the tick that finds them over.
#[test]
fn flip_for_a_while_then_automatic() {
    let node = SimNode::up();
    // min-hold (and rise 5 × 100 ms) well inside the 2 s, so that only the override's end can
    // time the return: with min-hold equal to it, an override ending early went unnoticed.
    let agent = node.agent(&["--interval", "100ms", "--min-hold", "500ms"]);
    let dir = state_dir(&agent);
    let asked_at = now_ms();
    let out =
        node.cli(&["flip", "upstream", "--for", "2s", "--reason", "test", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    let answered_at = now_ms();
    let up = agent.wait_route("upstream", Duration::from_secs(1));
    assert!(up["reason"].as_str().unwrap().contains("forced by hand: test"), "{up}");
    // The agent's record: set while `flip` ran, ending 2 s later.
    let record = std::fs::read(agent.state_dir.join("override.json")).expect("override.json");
    let record: serde_json::Value = serde_json::from_slice(&record).expect("override JSON");
    let set = record["set_unix_ms"].as_u64().expect("set_unix_ms");
    let until = record["until_unix_ms"].as_u64().expect("until_unix_ms");
    assert!((asked_at..=answered_at).contains(&set), "set outside {asked_at}..: {record}");
    assert_eq!(until - set, 2000, "{record}");
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test"]);
    assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), COREDNS_ANSWER);
    let status = node.cli(&["status", "--state-dir", &dir]);
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("override:    upstream"),
        "{}",
        describe(&status)
    );

    let local = agent.wait_route("local", Duration::from_secs(5));
    let back = local["since_unix_ms"].as_u64().unwrap();
    println!("automatic again {} ms after the override's end", back as i64 - until as i64);
    // The agent checks the expiry every tick (100 ms): back at the first tick past `until`, so
    // never before it (less 10 ms: the agent reads its two clocks one after the other), and
    // within 500 ms of it (a tick, and 400 ms for the loop being scheduled late on a loaded
    // machine). An override lasting a quarter longer or shorter is outside.
    assert!(back + 10 >= until, "automatic {} ms before the override's end: {local}", until - back);
    assert!(back <= until + 500, "automatic {} ms after the override's end: {local}", back - until);
    assert!(
        !agent.state_dir.join("override.json").exists(),
        "the expired override is still recorded"
    );
}

/// Issue 4, acceptance 1: the override survives killing and restarting the agent; `release`
/// ends it; a non-root peer is refused.
#[test]
fn override_survives_restart_and_only_root_may_flip() {
    let node = SimNode::up();
    let mut agent = node.agent(&[]);
    let dir = state_dir(&agent);
    let out = node.cli(&["flip", "upstream", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(1));
    agent.stop(Signal::SIGKILL);
    drop(agent);

    let agent = node.agent_starting(&[]);
    let st = agent.wait_route("upstream", Duration::from_secs(5));
    assert!(st["reason"].as_str().unwrap().contains("forced"), "{st}");
    // Still upstream after many good probes: the override holds.
    wait_for("good probes", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["cache_udp"]["streak_good"].as_u64() >= Some(10))
    });
    let st = agent.state().unwrap();
    assert_eq!(st["route"], "upstream");
    assert!(st["reason"].as_str().unwrap().contains("forced"), "adopted, not forced: {st}");

    let nobody = node.run(
        "node",
        "setpriv",
        &[
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            agent_exe(),
            "release",
            "--state-dir",
            &dir,
        ],
    );
    assert!(!nobody.status.success(), "{}", describe(&nobody));
    let err = String::from_utf8_lossy(&nobody.stderr).to_lowercase();
    assert!(err.contains("root") || err.contains("permission"), "{}", describe(&nobody));
    assert_eq!(agent.state().unwrap()["route"], "upstream");

    let out = node.cli(&["release", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("local", Duration::from_secs(2));
}

/// Issue 4, acceptance 2: `drain` (the preStop hook of node-local-dns), then the cache is killed
/// and a new one starts: no lookup fails and no first attempt is lost.
#[test]
fn drain_makes_a_rolling_update_lossless() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    let dir = state_dir(&agent);
    let mut load = node.load(
        "pod1",
        CLUSTER_DNS_IP,
        &["--rate", "500", "--duration", "7s", "--report-interval", "250ms"],
    );
    load.wait_cache_answers();
    let out = node.cli(&["drain", "--timeout", "5s", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("quiet"), "drain did not see the cache go quiet: {said}");
    assert_eq!(agent.state().unwrap()["route"], "upstream");

    node.signal("cache-kill");
    node.script(&["cache-start"]);
    let local = agent.wait_route("local", Duration::from_secs(10));
    println!("back: {}", local["reason"]);
    load.wait_alone("cache");
    let summary = load.finish();
    println!("summary: {summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
    assert_eq!(summary["first_attempt_lost"], 0, "{summary}");
    // The drain is over: no record left to revive it on a restart, no override reported.
    assert!(!agent.state_dir.join("override.json").exists(), "the drain is still recorded");
    let (_, metrics) = node.http_get("/metrics");
    let active: Vec<_> =
        metrics.lines().filter(|l| l.starts_with("nodelocaldns_ha_override_active{")).collect();
    assert!(!active.is_empty() && active.iter().all(|l| l.ends_with(" 0")), "{active:?}");
}

/// A pod's DNS client on one TCP connection to the link-local IP: a query every 50 ms for
/// `argv[1]` seconds, each answer awaited; prints `connected` after the first answer, then
/// `answered N last_ms T` (unix ms of the last answer) at the end.
const TCP_CLIENT: &str = r#"
import socket, struct, sys, time
query = struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\x03who\x04test\x00" + struct.pack(">HH", 1, 1)
s = socket.create_connection(("169.254.20.10", 53), timeout=5)
def ask():
    s.sendall(struct.pack(">H", len(query)) + query)
    n = struct.unpack(">H", s.recv(2, socket.MSG_WAITALL))[0]
    s.recv(n, socket.MSG_WAITALL)
ask()
print("connected", flush=True)
answered, end, last = 1, time.time() + float(sys.argv[1]), 0
while time.time() < end:
    time.sleep(0.05)
    ask()
    answered, last = answered + 1, int(time.time() * 1000)
print("answered", answered, "last_ms", last, flush=True)
"#;

/// Issue 30 (9): in the link-local shape a drain waits for the cache's replies to pods too. A
/// TCP connection a pod opened to the cache before the drain stays with the cache on
/// `Upstream` (TPROXY leaves an established socket's segments to it), so the cache answers it
/// until it closes; the drain ends only after its last answer. Before, a drain counted the
/// cluster-DNS IP's replies only, found none in this shape, and ended at once (3 checks).
#[test]
fn a_link_local_drain_waits_for_the_caches_last_reply() {
    let node = SimNode::up();
    let args = ["--interval", "100ms", "--timeout", "80ms"];
    let agent = node.agent_for(LOCAL_IP, "", UPSTREAM_IP, &args);
    let dir = state_dir(&agent);
    let mut client = node
        .cmd("pod1", "python3")
        .args(["-c", TCP_CLIENT, "3"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("tcp client");
    let mut out = std::io::BufReader::new(client.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "connected");

    let out_drain = node.cli(&["drain", "--timeout", "10s", "--state-dir", &dir]);
    let drained_at = now_ms();
    assert!(out_drain.status.success(), "{}", describe(&out_drain));
    let said = String::from_utf8_lossy(&out_drain.stdout);
    assert!(said.contains("quiet"), "drain did not see the cache go quiet: {said}");

    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(client.wait().unwrap().success(), "the pod's connection failed: {rest}");
    let last_ms: u64 = rest.split_whitespace().last().unwrap().parse().unwrap();
    println!(
        "{}; drain ended {} ms after the last answer",
        rest.trim(),
        drained_at as i64 - last_ms as i64
    );
    assert!(drained_at >= last_ms, "the drain ended while the cache still answered a pod: {said}");
    node.tear_down(agent);
}

/// In the link-local shape the forwarder answers pods from the link-local IP once the route is
/// `Upstream`, as the cache did; its answers are not the cache's. A drain under pod load ends
/// once the cache's own replies stop, by its own word ("gone quiet"), not at its timeout: the
/// forwarder keeps answering meanwhile, and no pod lookup fails. `backend` is the agent's
/// dataplane (each counts the replies with rules of its own), beside a kube-proxy of its kind.
fn a_link_local_drain_under_pod_load_ends_when_the_cache_is_quiet(backend: &str) {
    let node = SimNode::up_with(&["--kube-proxy", backend]);
    let args = ["--dataplane", backend, "--interval", "100ms", "--timeout", "80ms"];
    let agent = node.agent_for(LOCAL_IP, "", UPSTREAM_IP, &args);
    let dir = state_dir(&agent);
    let load_args = ["--rate", "300", "--duration", "60s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", LOCAL_IP, &load_args);
    let mut host = node.load("node", LOCAL_IP, &load_args);
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }
    let out = node.cli(&["drain", "--timeout", "10s", "--state-dir", &dir]);
    assert!(out.status.success(), "{backend}: {}", describe(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    println!("{backend}: {}", said.trim());
    assert!(
        said.contains("the cache has gone quiet") && !said.contains("timed out"),
        "{backend}: the drain did not see the cache go quiet under the forwarder's answers: {said}"
    );
    assert_eq!(agent.state().unwrap()["route"], "upstream");
    for load in [&mut pod, &mut host] {
        load.wait_alone("coredns");
    }
    for (client, load) in [("pod", pod), ("host", host)] {
        let summary = load.interrupt();
        assert_eq!(summary["failed"], 0, "{backend}: {client} lookups failed: {summary}");
    }
    node.tear_down(agent);
}

#[test]
fn a_link_local_drain_under_pod_load_ends_when_the_cache_is_quiet_nftables() {
    a_link_local_drain_under_pod_load_ends_when_the_cache_is_quiet("nftables");
}

#[test]
fn a_link_local_drain_under_pod_load_ends_when_the_cache_is_quiet_iptables_legacy() {
    a_link_local_drain_under_pod_load_ends_when_the_cache_is_quiet("iptables-legacy");
}

/// Issue 4, acceptance 3: every metric family is served and parses; /healthz stays 200 while
/// the cache is dead (liveness is never tied to DNS); /readyz is 200 once the ruleset is in.
#[test]
fn metrics_and_health_endpoints() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    // A pod asking the link-local IP itself: the forwarder answers, and counts it.
    assert_eq!(node.dig("pod1", LOCAL_IP), COREDNS_ANSWER);
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "{body}");
    let lines = body.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the exposition parses");
    let names: std::collections::BTreeSet<_> =
        scrape.samples.iter().map(|s| s.metric.clone()).collect();
    for family in [
        "nodelocaldns_ha_route",
        "nodelocaldns_ha_route_transitions_total",
        "nodelocaldns_ha_probes_total",
        // Histograms, as the parser groups their buckets.
        "nodelocaldns_ha_probe_duration_seconds",
        "nodelocaldns_ha_dataplane_apply_duration_seconds",
        "nodelocaldns_ha_dataplane_apply_errors_total",
        "nodelocaldns_ha_dataplane_check_duration_seconds",
        "nodelocaldns_ha_drift_repairs_total",
        "nodelocaldns_ha_override_active",
        "nodelocaldns_ha_transition_hook_runs_total",
        "nodelocaldns_ha_forwarder_udp_queries_total",
        "nodelocaldns_ha_forwarder_udp_answers_total",
        "nodelocaldns_ha_forwarder_tcp_connections_total",
        "nodelocaldns_ha_forwarder_upstream_failures_total",
        "nodelocaldns_ha_forwarder_dropped_total",
        "nodelocaldns_ha_forwarder_stray_answers_total",
    ] {
        assert!(names.contains(family), "{family} missing from {names:?}");
    }
    // The parser knows OpenMetrics' `_total` samples by name only: untyped.
    let counter = |name: &str| match scrape.samples.iter().find(|s| s.metric == name) {
        Some(prometheus_parse::Sample {
            value: prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v),
            ..
        }) => *v,
        other => panic!("{name}: {other:?}"),
    };
    for name in [
        "nodelocaldns_ha_forwarder_udp_queries_total",
        "nodelocaldns_ha_forwarder_udp_answers_total",
    ] {
        assert!(counter(name) >= 1.0, "{name}: the dig went through the forwarder");
    }
    let upstream = scrape
        .samples
        .iter()
        .find(|s| s.metric == "nodelocaldns_ha_route" && s.labels.get("route") == Some("upstream"));
    assert!(
        matches!(upstream.map(|s| &s.value), Some(prometheus_parse::Value::Gauge(v)) if *v == 1.0),
        "{upstream:?}"
    );
    assert_eq!(node.http_get("/healthz").0, 200, "liveness failed while the cache is dead");
    assert_eq!(node.http_get("/readyz").0, 200);
}

/// `status --check`, as the chart's `helm test` runs it: exit 1 unless an agent runs with the
/// state directory and its ruleset is in, saying which is not so. No agent at all; an agent
/// whose ruleset could not go in (the xtables lock held from its start); the same once the lock
/// is free; the agent stopped, its state file left: 1, 1, 0, 1. Plain `status` shows each state
/// file and exits 0.
#[test]
fn status_check_fails_unless_an_agent_runs_with_its_ruleset_in() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let dir = node.dir.join("agent-state").display().to_string();
    let check = |what: &str, code: i32, says: &str| {
        let out = node.cli(&["status", "--check", "--state-dir", &dir]);
        let text = describe(&out);
        println!("{what}: {text}");
        assert_eq!(out.status.code(), Some(code), "{what}: {text}");
        assert!(text.contains(says), "{what}: {says:?} not said: {text}");
        if code == 1 && out.status.code() == Some(1) && !out.stdout.is_empty() {
            let plain = node.cli(&["status", "--state-dir", &dir]);
            assert!(plain.status.success(), "{what}, plain status: {}", describe(&plain));
        }
    };
    check("no agent", 1, "no state in");
    let lock = node.dir.join("xtables.lock").display().to_string();
    let held = node.script(&["xtables-lock-hold", "60"]);
    assert_eq!(held.trim(), lock);
    let flags = ["--dataplane", "iptables-legacy", "--xtables-wait", "1s"];
    let mut agent = node.agent_starting_env(&flags, &[("XTABLES_LOCKFILE", &lock)]);
    wait_for("the lock reported", Duration::from_secs(15), || {
        agent.state().filter(|s| s["last_error"].as_str().is_some_and(|e| e.contains("lock")))
    });
    check("the ruleset not in", 1, "the agent's ruleset is not in");
    node.script(&["xtables-lock-release"]);
    wait_for("the ruleset in", Duration::from_secs(15), || {
        agent.state().filter(|s| s["ruleset_in"] == true)
    });
    check("the ruleset in", 0, "agent:       running");
    assert_eq!(agent.stop(nix::sys::signal::Signal::SIGTERM).code(), Some(0));
    check("the agent stopped", 1, "no agent is running");
}

/// Issue 4, acceptance 4: a transition hook that never ends does not delay the switch, and its
/// timeout is counted.
#[test]
fn a_hung_transition_hook_never_delays_a_switch() {
    let node = SimNode::up();
    let hook = node.dir.join("hook.sh");
    std::fs::write(&hook, "#!/bin/sh\nexec sleep 1000\n").unwrap();
    let executable = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(&hook, executable).unwrap();
    let hook = hook.display().to_string();
    let agent = node.agent(&["--on-transition", &hook, "--hook-timeout", "2s"]);
    node.signal("cache-kill");
    // A switch (or its state) that waited for the hook would come after the hook's timeout: the
    // deadline is that timeout, a hundred times what the switch takes.
    agent.wait_route("upstream", Duration::from_secs(2));
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    wait_for("both hook timeouts to be counted", Duration::from_secs(5), || {
        let (_, body) = node.http_get("/metrics");
        body.lines()
            .any(|l| {
                l.starts_with("nodelocaldns_ha_transition_hook_runs_total")
                    && l.contains("timeout")
                    && l.trim_end().ends_with(" 2")
            })
            .then_some(())
    });
}

/// Issue 4: with no agent running, `flip` installs the rules itself, says so, and records the
/// override for the next agent, which honours it.
#[test]
fn flip_without_an_agent_applies_directly() {
    let node = SimNode::up_with(&["--kube-proxy", "nftables"]);
    let dir = node.dir.join("agent-state").display().to_string();
    let out = flip_upstream_without_agent(&node, &dir);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("no agent is running"),
        "{}",
        describe(&out)
    );
    // kube-proxy in nftables mode: auto installed the nftables table, for Upstream, without
    // the link-local fallback (no forwarder runs without the agent).
    let rules = ["rules", "--route", "upstream", "--local-ip", LOCAL_IP];
    let rules =
        [&rules[..], &["--cluster-dns-ip", CLUSTER_DNS_IP, "--link-local-failover", "false"]];
    let expected = node.cli(&rules.concat());
    assert!(expected.status.success(), "{}", describe(&expected));
    let expected = String::from_utf8_lossy(&expected.stdout).into_owned();
    assert!(!expected.contains("fallback"), "{expected}");
    assert_eq!(node.agent_table(), Some(expected));
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test"]);
    assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), COREDNS_ANSWER);

    let agent = node.agent_starting(&["--dataplane", "auto"]);
    wait_for("good probes", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["cache_udp"]["streak_good"].as_u64() >= Some(10))
    });
    let st = agent.state().unwrap();
    assert_eq!(st["route"], "upstream", "the recorded override was not honoured: {st}");
    assert!(st["reason"].as_str().unwrap().contains("forced"), "{st}");
}

/// Runs the agent binary with `args` in the node namespace, in a mount namespace of its own in
/// which the state directory `dir` is mounted read-only, as the node-local-dns overlay mounts it
/// for node-cache's preStop `drain`.
fn cli_read_only(node: &SimNode, dir: &str, args: &[&str]) -> std::process::Output {
    let script = r#"dir=$1; shift; mount -o bind,ro "$dir" "$dir" && exec "$@""#;
    let mut argv = vec!["--mount", "--propagation", "private", "sh", "-c", script, "sh", dir];
    argv.push(agent_exe());
    argv.extend_from_slice(args);
    node.run("node", "unshare", &argv)
}

/// Issue 17 (5): `drain` on a read-only state mount tells "no agent is running" (success: the
/// kernel fast path alone fails pods over) from "an agent runs but does not answer" (failure,
/// nothing drained, and said so). Before, a lock it could not open for writing counted as no
/// agent, and `drain` exited 0 while the agent kept the node on the cache.
#[test]
fn drain_on_a_read_only_mount_tells_no_agent_from_an_agent_that_does_not_answer() {
    let node = SimNode::up();
    let mut agent = node.agent(&[]);
    let dir = state_dir(&agent);
    // The agent runs and holds its lock, but its control socket is gone: only the lock says so.
    // (The state file comes before the socket: wait for the socket to be there.)
    let socket = agent.state_dir.join("control.sock");
    wait_for("the control socket", Duration::from_secs(5), || socket.exists().then_some(()));
    std::fs::remove_file(&socket).expect("remove control.sock");
    let out = cli_read_only(&node, &dir, &["drain", "--timeout", "1s", "--state-dir", &dir]);
    assert!(
        out.status.code() == Some(1),
        "drain reported success with an agent running: {}",
        describe(&out)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("agent is running") && err.contains("control.sock"),
        "the refusal does not say what failed: {}",
        describe(&out)
    );
    assert_eq!(agent.state().unwrap()["route"], "local");

    // No agent at all: nothing to drain, on the same read-only mount.
    agent.stop(Signal::SIGTERM);
    let out = cli_read_only(&node, &dir, &["drain", "--timeout", "1s", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("no agent is running"),
        "{}",
        describe(&out)
    );
}

/// Issue 17 (2): with no agent running, `flip` switches in the backend the last agent recorded,
/// not in whatever `--dataplane auto` would pick: here kube-proxy runs in nftables mode (auto:
/// nftables) but the DaemonSet named iptables-legacy. A flip into nftables would leave the legacy
/// Local rules pinning pods to the cache while reporting success.
#[test]
fn flip_without_an_agent_uses_the_backend_the_last_agent_recorded() {
    let node = SimNode::up_with(&["--kube-proxy", "nftables"]);
    let mut agent = node.agent(&["--dataplane", "iptables-legacy"]);
    let dir = state_dir(&agent);
    agent.stop(Signal::SIGTERM);
    drop(agent);
    let out = flip_upstream_without_agent(&node, &dir);
    assert!(out.status.success(), "{}", describe(&out));
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test"]);
    assert_eq!(
        String::from_utf8_lossy(&answer.stdout).trim(),
        COREDNS_ANSWER,
        "pods still go to the cache"
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("iptables-legacy") && said.contains("recorded"),
        "flip does not say which backend it used and why: {}",
        describe(&out)
    );
    assert_eq!(node.agent_table(), None, "flip put rules in nftables, which the agent never used");
}

/// The pids of the running children of `parent` whose command line contains `name`.
fn children_named(parent: u32, name: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`; comm may hold spaces, so split after its `)`.
            let Some((_, tail)) = stat.rsplit_once(')') else { return false };
            let ppid = tail.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(parent) && String::from_utf8_lossy(&cmdline).contains(name)
        })
        .collect()
}

/// Issue 17 (5): `flip` with no agent running holds the agent's lock while it installs the rules
/// and records the override, so an agent starting meanwhile cannot miss the record and remove it
/// as not its own (while putting its old route back) after the CLI reported success. The window
/// is held open by the node's xtables lock, which `flip`'s iptables-legacy-restore waits for.
#[test]
fn flip_without_an_agent_is_not_undone_by_an_agent_starting_meanwhile() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let legacy = ["--dataplane", "iptables-legacy"];
    let mut agent = node.agent(&legacy);
    let dir = state_dir(&agent);
    agent.stop(Signal::SIGTERM);
    drop(agent);

    let lock = node.dir.join("xtables.lock").display().to_string();
    assert_eq!(node.script(&["xtables-lock-hold", "30"]).trim(), lock);
    let mut flip = Proc::spawn(
        node.cmd("node", agent_exe())
            .args(["flip", "upstream", "--reason", "race", "--state-dir", &dir])
            .args(["--local-ip", LOCAL_IP, "--cluster-dns-ip", CLUSTER_DNS_IP])
            .env("XTABLES_LOCKFILE", &lock)
            .stdout(Stdio::piped()),
    );
    wait_for("flip to wait for the xtables lock", Duration::from_secs(5), || {
        (!children_named(flip.pid(), "restore").is_empty()).then_some(())
    });

    // An agent starts (on the host's xtables lock, which nobody holds) while flip waits.
    let log = node.dir.join("agent-race.log");
    let mut racer = Proc::spawn(
        node.cmd("node", agent_exe())
            .args(["run", "--local-ip", LOCAL_IP, "--cluster-dns-ip", CLUSTER_DNS_IP])
            .args(["--upstream-ip", UPSTREAM_IP, "--probe-name", "who.test"])
            .args(legacy)
            .args(["--state-dir", &dir])
            .stderr(std::fs::File::create(&log).unwrap()),
    );
    let state_file = std::path::Path::new(&dir).join("state.json");
    let written_before = std::fs::metadata(&state_file).and_then(|m| m.modified()).ok();
    // It either runs (its state file rewritten) or gives up on the agent lock that flip holds.
    let racer_ran = wait_for("the racing agent to run or give up", Duration::from_secs(10), || {
        if racer.try_wait().is_some() {
            return Some(false);
        }
        let written = std::fs::metadata(&state_file).and_then(|m| m.modified()).ok();
        (written != written_before).then_some(true)
    });
    node.script(&["xtables-lock-release"]);
    let status = wait_for("flip to finish", Duration::from_secs(10), || flip.try_wait());
    assert!(status.success(), "flip failed: {status}");

    // Whatever agent runs from now on honours the override flip reported.
    let agent = if racer_ran {
        Agent::adopt(racer.into_child(), std::path::PathBuf::from(&dir), log)
    } else {
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(said.contains("flip"), "the racing agent's refusal does not name flip: {said}");
        node.agent_starting(&legacy)
    };
    let st = agent.wait_route("upstream", Duration::from_secs(5));
    assert!(st["reason"].as_str().unwrap().contains("forced by hand: race"), "{st}");
    wait_for("good probes", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["cache_udp"]["streak_good"].as_u64() >= Some(10))
    });
    assert_eq!(agent.state().unwrap()["route"], "upstream", "the override was undone");
    assert!(agent.state_dir.join("override.json").exists(), "the override's record was removed");
}

/// Issue 17 (5): a drain ends when the cache it drained is gone, not only when a probe fails.
/// Here the agent is killed during the drain, the old cache stops and a new one answers before
/// the agent is back: every probe it sends is answered, yet the node must not stay on CoreDNS
/// for the drain's 10-minute limit. The drain recorded the old cache's sockets; they are gone.
#[test]
fn a_drain_whose_cache_went_while_the_agent_was_down_ends_at_its_restart() {
    let node = SimNode::up();
    let mut agent = node.agent(&[]);
    let dir = state_dir(&agent);
    let out = node.cli(&["drain", "--timeout", "5s", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(1));
    agent.stop(Signal::SIGKILL);
    drop(agent);

    // The rolling update goes on without the agent: the old cache goes, the new one answers.
    node.signal("cache-kill");
    node.script(&["cache-start"]);
    let agent = node.agent_starting(&[]);
    let st = agent.wait_route("upstream", Duration::from_secs(5));
    // The restarted agent resumes the recorded drain (and may have ended it already).
    assert!(st["reason"].as_str().unwrap().contains("drain"), "the drain was not resumed: {st}");
    // Back on the new cache once it has passed its probes and --min-hold (2 s), not 10 minutes.
    let local = agent.wait_route("local", Duration::from_secs(10));
    println!("back: {}", local["reason"]);
    assert!(!agent.state_dir.join("override.json").exists(), "the drain is still recorded");
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test"]);
    assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), CACHE_ANSWER);
}

/// Issue 17 (5): an agent killed between the IPv4 and the IPv6 transaction of an iptables switch
/// leaves the families on different routes. The restarted agent must notice (neither route's
/// ruleset is installed whole) and bring both to one route. The kill's result is made exactly:
/// IPv4's raw table as the Upstream ruleset left it, IPv6's as the Local one.
#[test]
fn a_kill_between_the_families_is_noticed_and_evened_out_on_restart() {
    let node = SimNode::up_with(&["--family", "dual", "--kube-proxy", "iptables-legacy"]);
    let (local, cluster_dns, upstream) =
        ("169.254.20.10,fd00:169:254::10", "10.96.0.10,fd00:96::10", "10.96.0.11,fd00:96::11");
    let legacy = ["--dataplane", "iptables-legacy"];
    let mut agent = node.agent_for(local, cluster_dns, upstream, &legacy);
    let dir = state_dir(&agent);
    let raw = |binary: &str| {
        let out = node.run("node", binary, &["-t", "raw"]);
        assert!(out.status.success(), "{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // The pods' NOTRACK (to the IP); the cache's replies are NOTRACKed on both routes.
    let notracked = |text: &str, ip: &str| {
        text.lines().any(|l| l.contains(&format!("-d {ip} ")) && l.ends_with("-j NOTRACK"))
    };
    let out = node.cli(&["flip", "upstream", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(2));
    let v4_upstream = raw("iptables-legacy-save");
    assert!(!notracked(&v4_upstream, "10.96.0.10/32"), "{v4_upstream}");
    assert!(node.cli(&["release", "--state-dir", &dir]).status.success());
    agent.wait_route("local", Duration::from_secs(5));
    agent.stop(Signal::SIGKILL);
    drop(agent);

    let saved = node.dir.join("v4-upstream.rules");
    std::fs::write(&saved, &v4_upstream).unwrap();
    let restore = format!("iptables-legacy-restore < {}", saved.display());
    let out = node.run("node", "sh", &["-c", &restore]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(!notracked(&raw("iptables-legacy-save"), "10.96.0.10/32"), "IPv4 is not on Upstream");
    assert!(notracked(&raw("ip6tables-legacy-save"), "fd00:96::10/128"), "IPv6 is not on Local");

    std::fs::remove_file(node.dir.join("agent-state/state.json")).unwrap();
    let agent = node.agent_for(local, cluster_dns, upstream, &legacy);
    wait_for("both families on one route", Duration::from_secs(5), || {
        let (v4, v6) = (raw("iptables-legacy-save"), raw("ip6tables-legacy-save"));
        (notracked(&v4, "10.96.0.10/32") == notracked(&v6, "fd00:96::10/128")).then_some(())
    });
    let st = agent.state().unwrap();
    println!("restarted: {} ({})", st["route"], st["reason"]);
    for (qtype, want) in [("A", CACHE_ANSWER), ("AAAA", "fd00::1:1:1:1")] {
        let answer = node.run(
            "pod1",
            "dig",
            &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test", qtype],
        );
        assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), want, "{qtype}");
    }
    let answer = node.run(
        "pod1",
        "dig",
        &["+short", "+time=1", "+tries=1", "@fd00:96::10", "who.test", "AAAA"],
    );
    assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), "fd00::1:1:1:1", "IPv6 pods");
}

/// `flip upstream` for the state directory `dir` with the listen addresses, as with no agent
/// running.
fn flip_upstream_without_agent(node: &SimNode, dir: &str) -> std::process::Output {
    node.cli(&[
        "flip",
        "upstream",
        "--state-dir",
        dir,
        "--local-ip",
        LOCAL_IP,
        "--cluster-dns-ip",
        CLUSTER_DNS_IP,
    ])
}
