//! Chaos on the simulated node (issue 6, items 1-4), with the real agent on real netfilter, unbound
//! as the cache and dnsmasq as CoreDNS: the agent SIGKILLed in the middle of a route change, a
//! cache that keeps crashing, the cache and CoreDNS down together, and node-cache's SIGTERM
//! teardown.
//!
//! Random choices come from one seed per test, printed first; `NLHA_CHAOS_SEED=N` replays it.
//! `NLHA_FLAP_SECS` shortens the flapping test for local runs (default 60). The sleeps here are
//! the chaos itself (random delays before a kill), never a way to wait for something: waits are
//! conditions with deadlines.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use serde_json::Value;
use testkit::*;

/// The local-only rule of the ruleset, as `nft` reads it back: pods to the cache while it listens.
const NFT_FAST_PATH_RULE: &str = "ip daddr 10.96.0.10 udp dport 53 fib daddr type local socket transparent 0 socket wildcard 0 counter notrack comment \"pods to cache while it listens\"";
/// The same rule as iptables-save prints it (raw, the agent's PREROUTING chain).
const IPT_FAST_PATH_RULE: &str = "-A NODELOCALDNS-HA-PREROUTING -d 10.96.0.10/32 -p udp -m udp --dport 53 -m addrtype --dst-type LOCAL -m socket -m comment --comment \"pods to cache while it listens\" -j NOTRACK";
/// Host-network clients' rule of the Local ruleset: only the address guard (no socket guard in
/// the output hook).
const IPT_HOST_RULE: &str = "-A NODELOCALDNS-HA-OUTPUT -d 10.96.0.10/32 -p udp -m udp --dport 53 -m addrtype --dst-type LOCAL -m comment --comment \"host to cache\" -j NOTRACK";

/// xorshift64*: reproducible dice without a crate.
struct Dice(u64);

impl Dice {
    /// Seeded from `NLHA_CHAOS_SEED`, else from the clock; prints the seed.
    fn new(test: &str) -> Dice {
        let seed = match std::env::var("NLHA_CHAOS_SEED") {
            Ok(s) => s.trim().parse().expect("NLHA_CHAOS_SEED must be a u64"),
            Err(_) => SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64,
        };
        println!("{test}: seed {seed} (NLHA_CHAOS_SEED={seed} replays it)");
        // xorshift stays at zero from a zero state; no usable seed maps there.
        Dice(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Which backend the agent runs, on a node whose kube-proxy uses the matching shape.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Plane {
    Nftables,
    /// `legacy` or `nft`.
    Iptables(&'static str),
}

/// The address families of the node and the agent.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stack {
    V4,
    /// IPv4 and IPv6: the iptables backends change them in one transaction each.
    Dual,
}

impl Stack {
    /// The agent's (local, cluster DNS, upstream) addresses.
    fn addrs(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Stack::V4 => (LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP),
            Stack::Dual => (
                "169.254.20.10,fd00:169:254::10",
                "10.96.0.10,fd00:96::10",
                "10.96.0.11,fd00:96::11",
            ),
        }
    }
}

impl Plane {
    fn dataplane(self) -> &'static str {
        match self {
            Plane::Nftables => "nftables",
            Plane::Iptables("legacy") => "iptables-legacy",
            Plane::Iptables(_) => "iptables-nft",
        }
    }

    fn node(self) -> SimNode {
        self.node_with(Stack::V4)
    }

    fn node_with(self, stack: Stack) -> SimNode {
        let family = if stack == Stack::Dual { "dual" } else { "4" };
        match self {
            Plane::Nftables => SimNode::up_with(&["--family", family]),
            Plane::Iptables(_) => {
                SimNode::up_with(&["--kube-proxy", self.dataplane(), "--family", family])
            }
        }
    }

    /// The agent's rules as installed (counters left out), `None` when there are none.
    fn installed(self, node: &SimNode) -> Option<String> {
        let view: String = self.by_transaction(node).into_iter().flatten().collect();
        (!view.is_empty()).then_some(view)
    }

    /// The agent's rules per transaction: nftables' one inet table; for iptables, each table of
    /// each family (a switch is one `iptables-restore` per family, which commits table by table:
    /// raw, then mangle), as every line of `iptables-*-save`, then of `ip6tables-*-save`, that
    /// names the agent's chains, with its table and its position in its chain, so a jump that
    /// is no longer first shows too.
    fn by_transaction(self, node: &SimNode) -> Vec<Option<String>> {
        const TABLES: [&str; 3] = ["raw", "mangle", "filter"];
        let Plane::Iptables(variant) = self else {
            return vec![node.agent_table()];
        };
        let mut views = Vec::new();
        for save in [format!("iptables-{variant}-save"), format!("ip6tables-{variant}-save")] {
            let mut by_table: [String; 3] = Default::default();
            let out = node.run("node", &save, &[]);
            assert!(out.status.success(), "{save}: {}", describe(&out));
            let mut table = String::new();
            let mut positions = std::collections::HashMap::<String, usize>::new();
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some(name) = line.strip_prefix('*') {
                    table = name.to_owned();
                    positions.clear();
                    continue;
                }
                let position = line.strip_prefix("-A ").map(|rest| {
                    let chain = rest.split(' ').next().unwrap_or_default().to_owned();
                    let n = positions.entry(chain).or_default();
                    *n += 1;
                    *n - 1
                });
                if !line.contains("NODELOCALDNS-HA") {
                    continue;
                }
                // `:CHAIN - [packets:bytes]`: the counters move, the declaration does not.
                let line = match line.strip_prefix(':') {
                    Some(_) => line.split(" [").next().unwrap_or(line),
                    None => line,
                };
                let at = position.map_or(String::new(), |p| format!(" #{p}"));
                let Some(i) = TABLES.iter().position(|t| *t == table) else {
                    panic!("{save}: the agent's rule in table {table}: {line}")
                };
                by_table[i].push_str(&format!("{save} {table}{at} {line}\n"));
            }
            views.extend(by_table.map(|view| (!view.is_empty()).then_some(view)));
        }
        views
    }

    /// Adds Local's fast-path rule to the installed Upstream ruleset: a half-applied change.
    fn mix(self, node: &SimNode) {
        let out = match self {
            Plane::Nftables => node.run(
                "node",
                "nft",
                &[&format!("add rule inet nodelocaldns-ha prerouting {NFT_FAST_PATH_RULE}")],
            ),
            Plane::Iptables(variant) => {
                let rule = "-t raw -A NODELOCALDNS-HA-PREROUTING -d 10.96.0.10/32 -p udp -m udp \
                            --dport 53 -m addrtype --dst-type LOCAL -m socket";
                let mut args: Vec<&str> = rule.split_whitespace().collect();
                args.extend(["-m", "comment", "--comment", "pods to cache while it listens"]);
                args.extend(["-j", "NOTRACK"]);
                node.run("node", &format!("iptables-{variant}"), &args)
            }
        };
        assert!(out.status.success(), "{}", describe(&out));
    }

    /// Checks the references read back from the agent: each is what its route must be.
    fn check_references(self, node: &SimNode, stack: Stack, local: &str, upstream: &str) {
        assert_ne!(local, upstream);
        let (local_ip, cluster_dns_ip, _) = stack.addrs();
        match self {
            Plane::Nftables => {
                assert_eq!(local, node.expected_table_for("local", local_ip, cluster_dns_ip));
                assert_eq!(upstream, node.expected_table_for("upstream", local_ip, cluster_dns_ip));
            }
            Plane::Iptables(_) => {
                for rule in [IPT_FAST_PATH_RULE, IPT_HOST_RULE] {
                    assert!(local.contains(rule), "Local lacks {rule}:\n{local}");
                }
                assert!(local.contains("raw #0 -A PREROUTING -m comment --comment nodelocaldns-ha -j NODELOCALDNS-HA-PREROUTING"), "{local}");
                // (The filter ACCEPTs name the address in both routes: raw is what steers.)
                for ip in cluster_dns_ip.split(',') {
                    let daddr = format!("-d {ip}/{}", if ip.contains(':') { 128 } else { 32 });
                    let steers = |rules: &str| {
                        rules.lines().any(|l| l.contains(" raw ") && l.contains(&daddr))
                    };
                    assert!(steers(local), "Local does not steer {ip}:\n{local}");
                    assert!(!steers(upstream), "Upstream intercepts {ip}:\n{upstream}");
                }
            }
        }
    }
}

/// The processes `pid` started (and theirs), deepest first.
fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return found;
    };
    for task in tasks.flatten() {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
            found.extend(descendants(child));
            found.push(child);
        }
    }
    found
}

/// SIGKILLs the agent and everything it started, as a container runtime or systemd ends it (the
/// whole cgroup at once; a child outliving it would hold its sockets and lock). The agent is
/// stopped first, so it cannot start a child or reap one while its tree is killed, leaves first.
/// Returns how many processes besides the agent were killed.
fn kill_agent_tree(agent: &mut Agent) -> usize {
    let pid = agent.pid().expect("agent running");
    let agent_pid = nix::unistd::Pid::from_raw(pid as i32);
    nix::sys::signal::kill(agent_pid, Signal::SIGSTOP).expect("SIGSTOP the agent");
    wait_for("the agent to stop", Duration::from_secs(2), || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit(')').next()?.split_whitespace().next()?.to_owned();
        (state == "T").then_some(())
    });
    let tree = descendants(pid);
    for &child in &tree {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child as i32), Signal::SIGKILL);
    }
    agent.stop(Signal::SIGKILL);
    tree.len()
}

/// Which route each transaction's rules in `seen` are (see [`Plane::by_transaction`]); an error
/// for any that is neither. A transaction whose rules are the same in both routes (the IPv6
/// family of a v4-only node: none) must be as it is in both and is left out.
fn classify(
    seen: &[Option<String>],
    local: &[Option<String>],
    upstream: &[Option<String>],
) -> Result<Vec<&'static str>, String> {
    let mut routes = Vec::new();
    for (i, seen) in seen.iter().enumerate() {
        match seen {
            s if s == &local[i] && s == &upstream[i] => {}
            s if s == &local[i] => routes.push("local"),
            s if s == &upstream[i] => routes.push("upstream"),
            Some(t) => return Err(format!("neither the Local nor the Upstream ruleset:\n{t}")),
            None => return Err(format!("transaction {i}: no ruleset at all")),
        }
    }
    Ok(routes)
}

/// The views of [`Plane::by_transaction`] as one text.
fn join(views: &[Option<String>]) -> String {
    views.iter().flatten().map(String::as_str).collect()
}

fn other(route: &str) -> &'static str {
    if route == "local" {
        "upstream"
    } else {
        "local"
    }
}

/// Connects to the agent's control socket, which listens a moment after the state file appears.
fn connect(agent: &Agent) -> UnixStream {
    let path = agent.state_dir.join("control.sock");
    wait_for("the control socket", Duration::from_secs(5), || UnixStream::connect(&path).ok())
}

fn send_flip(stream: &mut UnixStream, route: &str, why: &str) {
    let line = format!("{{\"op\":\"flip\",\"route\":\"{route}\",\"reason\":\"{why}\"}}\n");
    stream.write_all(line.as_bytes()).expect("send the flip request");
}

/// The agent's answer line, if it sent one before the connection ended.
fn reply(stream: &UnixStream, wait: Duration) -> Option<String> {
    stream.set_read_timeout(Some(wait)).expect("read timeout");
    let mut line = String::new();
    let _ = BufReader::new(stream).read_line(&mut line);
    (!line.is_empty()).then_some(line)
}

/// A flip the agent is left to finish; its round trip.
fn calm_flip(agent: &Agent, route: &str) -> Duration {
    let mut stream = connect(agent);
    let sent = Instant::now();
    send_flip(&mut stream, route, "calm");
    let answer = reply(&stream, Duration::from_secs(5)).expect("an answer to a calm flip");
    let rtt = sent.elapsed();
    assert!(answer.contains("\"ok\""), "{answer}");
    rtt
}

/// The route of the override recorded in the agent's state dir.
fn recorded_override(agent: &Agent) -> Option<String> {
    let bytes = std::fs::read(agent.state_dir.join("override.json")).ok()?;
    let o: Value = serde_json::from_slice(&bytes).expect("override.json is JSON");
    o["route"].as_str().map(str::to_owned)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Issue 6, item 1, on one backend: `trials` flips (`flip` requests on the control socket, each
/// to the other route), each cut short by SIGKILL (of the agent and any iptables process it runs)
/// after a random delay spread around the moment the change reaches the kernel, so kills land
/// before, during and after it. After each kill the installed rules of each transaction (the
/// nftables table; each table of each address family of iptables) must be exactly the Local or
/// the Upstream ruleset's: the new one if the agent answered, or if it recorded the override (it
/// records only after the rules are in). The iptables backends change IPv4, then IPv6, in each
/// raw, then mangle: a kill between two of these leaves each whole, on different routes, and is
/// counted. A
/// restarted agent starts in the recorded override with its whole ruleset in place by the time it
/// writes its state (it installs before it reports). A pod (IPv4 and, on a dual-stack node,
/// IPv6) resolves throughout, with both DNS servers healthy: nothing may fail. Last, the checker
/// is shown a half-applied change (Upstream plus one Local rule): it must reject it, and a
/// restarted agent must replace it.
fn sigkill_mid_change(plane: Plane, stack: Stack, trials: usize) {
    let mut dice = Dice::new(&format!("sigkill mid-change, {}, {stack:?}", plane.dataplane()));
    let node = plane.node_with(stack);
    let (local_ip, cluster_dns_ip, upstream_ip) = stack.addrs();
    let flags = ["--dataplane", plane.dataplane(), "--interval", "100ms", "--timeout", "80ms"];
    let mut agent = node.agent_for(local_ip, cluster_dns_ip, upstream_ip, &flags);
    let load_args = ["--rate", "200", "--duration", "600s", "--report-interval", "0"];
    let mut loads = vec![("IPv4", node.load("pod1", CLUSTER_DNS_IP, &load_args))];
    if stack == Stack::Dual {
        let mut args = load_args.to_vec();
        args.extend(["--qtype", "AAAA"]);
        loads.push(("IPv6", node.load("pod2", "[fd00:96::10]:53", &args)));
    }

    // The references, read back from the agent itself after calm flips.
    let local = plane.by_transaction(&node);
    let mut rtts = vec![calm_flip(&agent, "upstream")];
    let upstream = plane.by_transaction(&node);
    plane.check_references(&node, stack, &join(&local), &join(&upstream));
    for route in ["local", "upstream", "local", "upstream", "local"] {
        rtts.push(calm_flip(&agent, route));
        let want = if route == "local" { &local } else { &upstream };
        assert_eq!(&plane.by_transaction(&node), want, "after a calm flip to {route}");
    }
    // When the change begins and ends after the request is learnt as the trials go, one edge
    // for each: the first transaction's commit (a kill before it leaves the old ruleset), the
    // last one's (a kill after it leaves the new). Trials take turns: each kill falls uniformly
    // in 0..=2×edge of its turn's edge, which moves 10% towards the outcome its side missed, so
    // each settles around its commit and both sides, and what lies between, keep being hit
    // (one adaptive edge for both starved one side when several transactions spread the change:
    // seen old 0 / new 6 and old 8 / new 0 of 60). They start at half a calm round trip and may
    // grow far past it: a freshly restarted agent on a busy machine can take much longer.
    let rtt_us = median(rtts).as_micros() as f64;
    let (mut first_us, mut last_us) = (rtt_us / 2.0, rtt_us / 2.0);
    println!("calm flip round trip median {:.2} ms", rtt_us / 1e3);

    let mut current = "local";
    let (mut old, mut new, mut split, mut answered, mut children) = (0, 0, 0, 0, 0);
    let (mut ready, mut delays) = (Vec::new(), Vec::new());
    let started = Instant::now();
    for trial in 0..trials {
        let target = other(current);
        let aims_first = trial % 2 == 0;
        let edge_us = if aims_first { first_us } else { last_us };
        let delay = Duration::from_micros(dice.between(0, (2.0 * edge_us) as u64));
        delays.push(delay);
        let mut stream = connect(&agent);
        send_flip(&mut stream, target, &format!("chaos trial {trial}"));
        std::thread::sleep(delay);
        children += kill_agent_tree(&mut agent);
        let answer = reply(&stream, Duration::from_millis(200));
        let what = format!("trial {trial}: flip to {target}, SIGKILL after {delay:?}");

        let seen = plane.by_transaction(&node);
        let routes = classify(&seen, &local, &upstream)
            .unwrap_or_else(|e| panic!("{what}: the kill left a broken ruleset: {e}"));
        let all = |route: &str| routes.iter().all(|r| *r == route);
        if let Some(answer) = &answer {
            answered += 1;
            assert!(answer.contains("\"ok\""), "{what}: {answer}");
            assert!(all(target), "{what}: the agent answered {answer} but left {routes:?}");
        }
        let recorded = recorded_override(&agent).expect("an override is recorded");
        if recorded == target {
            assert!(all(target), "{what}: the override was recorded before the rules: {routes:?}");
        }
        let (began, ended) = if all(target) {
            new += 1;
            (true, true)
        } else if all(current) {
            old += 1;
            (false, false)
        } else {
            // Between two transactions (families, or raw and mangle): each whole, the change
            // half done.
            split += 1;
            (true, false)
        };
        if aims_first {
            first_us *= if began { 0.9 } else { 1.1 };
        } else {
            last_us *= if ended { 0.9 } else { 1.1 };
        }
        first_us = first_us.clamp(20.0, 100_000.0);
        last_us = last_us.clamp(20.0, 100_000.0);

        // The restarted agent starts in the recorded override, its ruleset already in place.
        drop(agent);
        let spawned = Instant::now();
        agent = node.agent_starting_for(local_ip, cluster_dns_ip, upstream_ip, &flags);
        ready.push(spawned.elapsed());
        let st = agent.state().expect("state");
        assert_eq!(st["route"], recorded.as_str(), "{what}: restarted agent: {st}");
        let want = if recorded == "local" { &local } else { &upstream };
        assert_eq!(
            &plane.by_transaction(&node),
            want,
            "{what}: the restarted agent wrote its state before its ruleset was in: {st}"
        );
        current = if recorded == "local" { "local" } else { "upstream" };
    }
    let took = started.elapsed();
    let worst = |v: &[Duration]| ms(*v.iter().max().unwrap());
    println!(
        "{trials} trials in {:.1} s: SIGKILL {:.2}..{:.2} ms after the request (median {:.2}; the change begins about {:.2} ms after it and ends about {:.2} ms after it); the old ruleset left {old} times, the new {new} times, the transactions on different routes {split} times ({answered} answered before the kill; {children} processes of the agent's killed with it)",
        took.as_secs_f64(),
        ms(*delays.iter().min().unwrap()),
        worst(&delays),
        ms(median(delays.clone())),
        first_us / 1e3,
        last_us / 1e3,
    );
    println!(
        "restarted agent: state written (its ruleset in place) after median {:.1} / max {:.1} ms",
        ms(median(ready.clone())),
        worst(&ready),
    );
    // The kills fell on both sides of the change, so the ones in between were tried too.
    assert!(old > 0 && new > 0, "the kills all fell on one side: old {old}, new {new}");
    if several_transactions(plane) {
        assert!(split > 0, "no kill fell between two transactions");
    } else {
        assert_eq!(split, 0, "one transaction, yet parts of it were left on different routes");
    }

    // The checker sees a half-applied change: Upstream plus one of Local's rules.
    if current == "local" {
        calm_flip(&agent, "upstream");
    }
    kill_agent_tree(&mut agent);
    plane.mix(&node);
    let mixed = plane.by_transaction(&node);
    let verdict = classify(&mixed, &local, &upstream);
    assert!(verdict.is_err(), "the checker took a mixed ruleset for {verdict:?}: {mixed:?}");
    drop(agent);
    let _agent = node.agent_starting_for(local_ip, cluster_dns_ip, upstream_ip, &flags);
    assert_eq!(
        plane.by_transaction(&node),
        upstream,
        "the mixed ruleset was not replaced at start"
    );

    for (family, load) in loads {
        let summary = load.interrupt();
        println!("{family} pod during the trials: {summary}");
        println!("{family} pod first attempts lost: {}", summary["first_attempt_lost"]);
        assert!(summary["sent"].as_u64().unwrap() > 0, "{family}: {summary}");
        assert_eq!(summary["failed"], 0, "{family} pod lookups failed: {summary}");
        assert_eq!(summary["by_origin"]["other"], 0, "{family}: {summary}");
    }
}

/// Whether a route change is more than one transaction: iptables' raw and mangle, in each family.
fn several_transactions(plane: Plane) -> bool {
    matches!(plane, Plane::Iptables(_))
}

/// Issue 6, item 1: 200 SIGKILLs in the middle of flips on nftables.
#[test]
fn agent_sigkill_mid_change_leaves_old_or_new_ruleset() {
    sigkill_mid_change(Plane::Nftables, Stack::V4, 200);
}

/// Issue 6, item 1 on iptables-nft (kube-proxy iptables-nft), dual-stack: one transaction per
/// table and family.
#[test]
fn agent_sigkill_mid_change_leaves_old_or_new_ruleset_iptables_nft() {
    sigkill_mid_change(Plane::Iptables("nft"), Stack::Dual, 60);
}

/// Issue 6, item 1 on iptables-legacy (kube-proxy iptables-legacy), dual-stack.
#[test]
fn agent_sigkill_mid_change_leaves_old_or_new_ruleset_iptables_legacy() {
    sigkill_mid_change(Plane::Iptables("legacy"), Stack::Dual, 60);
}

/// Issue 18, point 1: nftables on a dual-stack node, where one inet table holds both families.
#[test]
fn agent_sigkill_mid_change_leaves_old_or_new_ruleset_dual_stack() {
    sigkill_mid_change(Plane::Nftables, Stack::Dual, 60);
}

/// Route changes counted by the agent's `/metrics`: (to Upstream, to Local).
fn transitions(node: &SimNode) -> (u64, u64) {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "{body}");
    let mut counts = (0, 0);
    for line in body.lines().filter(|l| l.starts_with("nodelocaldns_ha_route_transitions_total{")) {
        let value: f64 = line.rsplit(' ').next().unwrap().parse().expect("a counter value");
        if line.contains("to=\"local\"") {
            counts.1 += value as u64;
        } else {
            counts.0 += value as u64;
        }
    }
    counts
}

/// The agent's resident memory (KiB) and open file descriptors: the least of 20 looks 10 ms
/// apart, so a probe socket open at one instant does not count.
fn resources(pid: u32) -> (u64, usize) {
    let look = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("agent status");
        let rss: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS");
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("agent fds").count();
        (rss, fds)
    };
    let mut least = look();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(10));
        let (rss, fds) = look();
        least = (least.0.min(rss), least.1.min(fds));
    }
    least
}

/// One crash of the flapping cache, in ms since the epoch.
struct Crash {
    /// The SIGKILL went out.
    killed: u64,
    /// The process was seen gone (at most one 50 ms poll after its sockets closed).
    gone: u64,
    /// The next cache was exec'd (it listens a moment later).
    restarted: u64,
}

/// Kills the cache and starts it again (without waiting for it to answer, like a crash loop),
/// each after a random 50-500 ms, for `how_long`; each crash goes to `crashes`.
fn flap(node: &SimNode, dice: &mut Dice, how_long: Duration, crashes: &mut Vec<Crash>) {
    let end = Instant::now() + how_long;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(dice.between(50, 500)));
        let (killed, gone) = node.kill("cache-kill");
        std::thread::sleep(Duration::from_millis(dice.between(50, 500)));
        let out = node.script(&["cache-start", "--no-wait"]);
        let restarted = out.lines().next().and_then(|l| l.trim().parse().ok());
        let restarted = restarted.unwrap_or_else(|| panic!("cache-start printed no time: {out}"));
        crashes.push(Crash { killed, gone, restarted });
    }
}

/// Issue 6, item 2: the cache is killed and restarted at random 50-500 ms intervals for
/// `NLHA_FLAP_SECS` (60) under pod load.
///
/// * Route changes: every return to Local needs `min-hold` in Upstream first, so there are at
///   most ⌈duration / min-hold⌉ + 1 of them, and at most one more change to Upstream.
/// * Pod lookups: a kill loses the first attempt of the queries inside the dying cache (sent
///   just before it); their retry comes `--timeout` (1 s) later, when the route is still Upstream
///   (it cannot return before `min-hold`, 1.5 s > 1 s) and CoreDNS answers. While the cache is down
///   with the route still Local, the kernel fast path sends pods to CoreDNS. So no lookup may
///   fail, no first attempt sent while the cache was dead (seen gone, not yet restarted) may be
///   lost, and every lost one was sent to a cache that a kill then took: at most one attempt
///   timeout before the kill, and before the process was gone. (Judged by when the client sent
///   it and when the process was seen gone: a busy machine widens nothing.)
/// * The agent's descriptors: the same at the end as after a warm-up; its memory: no trend (the
///   second half of the run grows it by allocator noise at most).
#[test]
fn flapping_cache_keeps_transitions_bounded_and_resources_flat() {
    let secs: u64 = std::env::var("NLHA_FLAP_SECS").map_or(60, |s| s.parse().expect("seconds"));
    let mut dice = Dice::new("flapping cache");
    let (min_hold, attempt_timeout) = (Duration::from_millis(1500), Duration::from_secs(1));
    assert!(min_hold > attempt_timeout, "the no-failure argument needs min-hold > the timeout");
    let node = SimNode::up();
    // Quick to return (rise 3 × 50 ms, TCP every 250 ms), so that min-hold, not rise, is what
    // holds the route back and the bound is close to what the agent does.
    let flags = "--interval 50ms --timeout 40ms --tcp-interval 250ms --fall 3 --rise 3 \
                 --min-hold 1500ms";
    let agent = node.agent(&flags.split_whitespace().collect::<Vec<_>>());
    let pid = agent.pid().expect("agent running");
    let load = node.load(
        "pod1",
        CLUSTER_DNS_IP,
        &["--rate", "200", "--duration", "600s", "--report-interval", "0"],
    );
    let mut crashes = Vec::new();
    // Warm-up: whatever the agent allocates on first use (metric series, buffers) exists.
    flap(&node, &mut dice, Duration::from_secs(3), &mut crashes);
    let (rss_before, fds_before) = resources(pid);
    let before = transitions(&node);

    let started = Instant::now();
    flap(&node, &mut dice, Duration::from_secs(secs / 2), &mut crashes);
    let (rss_half, _) = resources(pid);
    let half = transitions(&node);
    flap(&node, &mut dice, Duration::from_secs(secs - secs / 2), &mut crashes);
    let flapped = started.elapsed();
    let after = transitions(&node);
    let st = agent.wait_route("local", Duration::from_secs(10));
    let (rss_after, fds_after) = resources(pid);
    let summary = load.interrupt();

    let (to_upstream, to_local) = (after.0 - before.0, after.1 - before.1);
    let bound = flapped.as_millis().div_ceil(min_hold.as_millis()) as u64 + 1;
    println!(
        "{} kills in {:.1} s; route changes: {to_upstream} to Upstream, {to_local} to Local (bound {bound} returns: ⌈{:.1} s / min-hold 1.5 s⌉ + 1); agent: {} transitions, {} repairs in all",
        crashes.len(),
        flapped.as_secs_f64(),
        flapped.as_secs_f64(),
        st["transitions"],
        st["repairs"]
    );
    let changes = |from: (u64, u64), to: (u64, u64)| to.0 + to.1 - from.0 - from.1;
    let halves = [
        (rss_half as i64 - rss_before as i64, changes(before, half)),
        (rss_after as i64 - rss_half as i64, changes(half, after)),
    ];
    println!(
        "agent RSS {rss_before} -> {rss_half} -> {rss_after} KiB (halves: {:+} KiB in {} route changes, {:+} KiB in {}), fds {fds_before} -> {fds_after} (least of 20 looks)",
        halves[0].0, halves[0].1, halves[1].0, halves[1].1
    );
    println!("pod: {summary}");
    println!(
        "pod: {} lookups, {} failed, {} first attempts lost",
        summary["sent"], summary["failed"], summary["first_attempt_lost"]
    );
    assert!(to_local <= bound, "{to_local} returns to Local in {flapped:?} (bound {bound})");
    assert!(to_upstream <= to_local + 1, "{to_upstream} changes to Upstream, {to_local} back");
    assert!(to_upstream > 0, "the route never moved: the kills did not reach the agent");
    assert!(st["last_error"].is_null(), "{st}");

    assert_eq!(summary["failed"], 0, "pod lookups failed: {summary}");
    assert_eq!(summary["by_origin"]["other"], 0, "{summary}");
    let lost = sent_at(&summary, "first_attempt_lost_at_ms");
    let before_kill: Vec<i64> = lost
        .iter()
        .filter_map(|&t| crashes.iter().find(|c| c.gone >= t).map(|c| c.killed as i64 - t as i64))
        .collect();
    println!("lost first attempts, ms before the next kill: {before_kill:?}");
    for t in lost {
        let dead = crashes.iter().find(|c| (c.gone..c.restarted).contains(&t));
        assert!(dead.is_none(), "a first attempt sent at {t}, while the cache was dead, was lost");
        let taken = crashes
            .iter()
            .any(|c| (c.killed.saturating_sub(ATTEMPT_TIMEOUT_MS)..c.gone).contains(&t));
        assert!(taken, "a first attempt sent at {t} was lost, but no kill took it");
    }

    // Descriptors: the same set (the least of several looks leaves out probe sockets in flight).
    assert!(fds_after <= fds_before, "fds grew from {fds_before} to {fds_after}");
    // Memory: a leak grows with the route changes and the probes, so it shows in both halves;
    // what settles (allocator arenas, buffers) does so mostly in the first. Seen in green runs
    // (debug build): +276 to +468 KiB in all, +44 to +196 in the second half; the 30-minute soak
    // grew 112 KiB. So at most 384 KiB in the second half and 1 MiB in all: a leak of 16 KiB
    // per route change (~30 a half) fails both (+624 and +1432 KiB, where 4 MiB let it pass).
    let second_half = halves[1].0;
    assert!(second_half <= 384, "RSS grew {second_half} KiB in the second half: {halves:?}");
    assert!(rss_after <= rss_before + 1024, "RSS grew from {rss_before} to {rss_after} KiB");
}

/// `nodelocaldns-ha status` for `agent`.
fn status_text(node: &SimNode, agent: &Agent) -> String {
    let dir = agent.state_dir.display().to_string();
    let out = node.cli(&["status", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `held:` line of `status` output (empty when there is none).
fn held_line(status: &str) -> &str {
    status.lines().find(|l| l.starts_with("held:")).unwrap_or_default()
}

/// Waits until the agent has seen the upstream fail `fall` (3) times in a row.
fn wait_upstream_failing(agent: &Agent) -> Value {
    wait_for("the upstream to be seen failing", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["upstream"]["streak_bad"].as_u64() >= Some(3))
    })
}

/// Waits until `stream`'s probes have been counted `more` more times, and returns the state.
fn wait_probes(agent: &Agent, stream: &str, more: u64) -> Value {
    let seen = agent.state().unwrap()["probes"][stream]["sent"].as_u64().unwrap();
    wait_for(&format!("{more} more {stream} probes"), Duration::from_secs(10), || {
        agent.state().filter(|s| s["probes"][stream]["sent"].as_u64() >= Some(seen + more))
    })
}

fn since(st: &Value) -> u64 {
    st["since_unix_ms"].as_u64().expect("since_unix_ms")
}

/// Issue 6, item 3: the cache and CoreDNS both dead. The agent stays where it is and says so
/// (state `held`, `status`, log); when one comes back, the route follows src/health.rs:
///
/// * Local, both dead: held Local (a half-dead cache may still answer from its cache; CoreDNS
///   down gains nothing). CoreDNS back → Upstream at once (the cache still refuses); cache back
///   first → stays Local, the hold ends.
/// * Upstream, both dead: stays Upstream. Cache back first → Local without waiting for
///   min-hold (the cache is the only resolver that works); CoreDNS back first → stays Upstream
///   until the cache answers `rise` probes and min-hold has passed.
#[test]
fn both_down_stays_put_and_follows_policy() {
    let node = SimNode::up();
    // Long enough that the steps of recovery 3 (about 3 s, more on a busy machine) cannot
    // make a return that skipped min-hold look like one that waited for it.
    let min_hold_ms = 10_000;
    let flags = "--interval 100ms --timeout 80ms --upstream-interval 200ms \
                 --upstream-timeout 100ms --min-hold 10s";
    let agent = node.agent(&flags.split_whitespace().collect::<Vec<_>>());

    // Local; CoreDNS dies, then the cache: held.
    let held_local = |agent: &Agent| {
        let before = agent.state().expect("state");
        node.script(&["coredns-kill"]);
        // CoreDNS down, the cache fine: the route does not move.
        wait_upstream_failing(agent);
        let st = wait_probes(agent, "cache_udp", 3);
        assert_eq!(st["route"], "local", "{st}");
        assert_eq!(st["transitions"], before["transitions"], "{st}");
        assert!(st["held"].is_null(), "held with the cache answering: {st}");
        node.signal("cache-kill");
        let held = wait_for("the route to be held", Duration::from_secs(5), || {
            agent.state().filter(|s| s["held"].is_string())
        });
        let transitions = held["transitions"].clone();
        // Twenty more refused probes later it still stays, and says why.
        let st = wait_probes(agent, "cache_udp", 20);
        assert_eq!(st["route"], "local", "moved with CoreDNS down: {st}");
        assert_eq!(st["transitions"], transitions, "{st}");
        let held = st["held"].as_str().expect("still held").to_owned();
        assert!(held.contains("refused") && held.contains("staying local"), "{held}");
        let status = status_text(&node, agent);
        println!("held Local, status:\n{status}");
        let line = held_line(&status);
        assert!(line.contains("refused") && line.contains("but staying local"), "{status}");
        assert!(logged_hold(agent, "but staying local"), "not logged: {held}");
        st
    };

    // Recovery 1: CoreDNS back first → Upstream at once, then Local after rise and min-hold.
    held_local(&agent);
    node.script(&["coredns-start"]);
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    assert!(up["reason"].as_str().unwrap().contains("refused"), "{up}");
    assert!(up["held"].is_null(), "{up}");
    node.script(&["cache-start"]);
    let local = agent.wait_route("local", Duration::from_secs(20));
    assert!(since(&local) - since(&up) >= min_hold_ms, "back before min-hold: {local}");
    assert!(local["reason"].as_str().unwrap().contains("cache answered"), "{local}");

    // Recovery 2: the cache back first → the hold ends, Local all along.
    let st = held_local(&agent);
    node.script(&["cache-start"]);
    let unheld = wait_for("the hold to end", Duration::from_secs(5), || {
        agent.state().filter(|s| s["held"].is_null())
    });
    assert_eq!(unheld["route"], "local", "{unheld}");
    assert_eq!(unheld["transitions"], st["transitions"], "{unheld}");
    node.script(&["coredns-start"]);
    let st = wait_probes(&agent, "upstream", 3);
    assert_eq!(st["route"], "local", "{st}");
    assert_eq!(st["transitions"], unheld["transitions"], "{st}");

    // Upstream; then CoreDNS dies too: it stays, and says so.
    let held_upstream = |agent: &Agent| {
        node.signal("cache-kill");
        let up = agent.wait_route("upstream", Duration::from_secs(5));
        node.script(&["coredns-kill"]);
        wait_upstream_failing(agent);
        let st = wait_probes(agent, "upstream", 3);
        assert_eq!(st["route"], "upstream", "{st}");
        assert_eq!(st["transitions"], up["transitions"], "{st}");
        let held = st["held"].as_str().unwrap_or_else(|| panic!("not said: {st}"));
        assert!(held.contains("staying upstream"), "{held}");
        let status = status_text(&node, agent);
        println!("held Upstream, status:\n{status}");
        assert!(held_line(&status).contains("but staying upstream"), "{status}");
        assert!(logged_hold(agent, "but staying upstream"), "not logged: {held}");
        up
    };

    // Recovery 3: the cache back first → Local without waiting for min-hold.
    let up = held_upstream(&agent);
    node.script(&["cache-start"]);
    let local = agent.wait_route("local", Duration::from_secs(5));
    let waited = since(&local) - since(&up);
    println!("back to Local {waited} ms after entering Upstream (min-hold {min_hold_ms} ms)");
    assert!(waited < min_hold_ms, "waited for min-hold: {local}");
    assert!(local["reason"].as_str().unwrap().contains("upstream is failing"), "{local}");
    node.script(&["coredns-start"]);
    wait_for("the upstream to answer", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["upstream"]["streak_good"].as_u64() >= Some(1))
    });

    // Recovery 4: CoreDNS back first → still Upstream (the cache is dead); then the cache →
    // Local after rise and min-hold.
    let up = held_upstream(&agent);
    node.script(&["coredns-start"]);
    let st = wait_for("the upstream to answer", Duration::from_secs(5), || {
        agent.state().filter(|s| s["probes"]["upstream"]["streak_good"].as_u64() >= Some(2))
    });
    assert_eq!(st["route"], "upstream", "{st}");
    assert!(st["held"].is_null(), "{st}");
    node.script(&["cache-start"]);
    let local = agent.wait_route("local", Duration::from_secs(20));
    assert!(since(&local) - since(&up) >= min_hold_ms, "back before min-hold: {local}");
    let reason = local["reason"].as_str().unwrap();
    assert!(reason.contains("cache answered") && !reason.contains("upstream"), "{local}");
    // Said once when each hold begins, not again as its counts go up.
    let warnings = agent.log_text().lines().filter(|l| l.contains("route held")).count();
    assert_eq!(warnings, 4, "one warning per hold");
}

/// Whether the agent's log has a "route held" warning whose reason says `what`.
fn logged_hold(agent: &Agent, what: &str) -> bool {
    agent.log_text().lines().any(|l| l.contains("route held") && l.contains(what))
}

/// How node-cache runs in the teardown tests.
#[derive(Clone, Copy, PartialEq)]
enum NodeCache {
    /// `-setupiptables=false` (as the overlay runs it, but without `-skipteardown`): on SIGTERM
    /// it deletes its interface only.
    WithoutRules,
    /// Stock: its own NOTRACK rules too, which its teardown deletes after the interface.
    WithItsRules,
}

/// Issue 6, item 4, on one backend: node-cache's SIGTERM teardown, in its order
/// (cmd/node-cache/app/cache_app.go, `TeardownNetworking`: the interface, then its rules, then
/// it exits), while the agent runs in Local and a pod and a host-network client resolve at
/// 300/s. Here the interface is the listen addresses on node-cache's `nodelocaldns` interface;
/// unbound runs until they are gone.
///
/// With the cluster-DNS IP gone, the Local ruleset's address guard (`fib daddr type local`,
/// iptables `-m addrtype --dst-type LOCAL`) stops matching for pods and host clients alike, so
/// their next query is DNATed to CoreDNS: no query is NOTRACKed towards an address that is no
/// longer on the node. Only a query already inside the cache when its address goes may lose its
/// first attempt (the reply cannot leave from a deleted address): it was sent before the
/// addresses were gone, and its retry succeeds. The guard does it alone: the route stays
/// `Local` until the cache is killed, since the agent's copy of the link-local IP on lo keeps
/// the cache it probes reachable.
///
/// node-cache's own rules have no such guard: they would NOTRACK queries into that blackhole
/// while they outlive the addresses. The agent's rules run before them and pin every query they
/// do not NOTRACK themselves to conntrack, which node-cache's NOTRACK then leaves alone: with
/// them in too, nothing more is lost.
fn node_cache_teardown(plane: Plane, node_cache: NodeCache) {
    let node = plane.node();
    if node_cache == NodeCache::WithItsRules {
        node.script(&["node-cache-rules"]);
    }
    let agent = node.agent(&["--dataplane", plane.dataplane(), "--interval", "100ms"]);
    let installed = plane.installed(&node).expect("the agent's rules");
    match plane {
        Plane::Nftables => assert_eq!(installed, node.expected_table("local")),
        Plane::Iptables(_) => {
            for rule in [IPT_FAST_PATH_RULE, IPT_HOST_RULE] {
                assert!(installed.contains(rule), "the address guard is missing:\n{installed}");
            }
        }
    }
    let args = ["--rate", "300", "--duration", "600s", "--report-interval", "250ms"];
    let mut pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    let mut host = node.load("node", CLUSTER_DNS_IP, &args);
    for load in [&mut pod, &mut host] {
        load.wait_cache_answers();
    }

    // The teardown: the interface, then node-cache's rules, with unbound running; then it exits.
    let addrs_gone = node.signal("listen-addrs-del");
    if node_cache == NodeCache::WithItsRules {
        // Pods meanwhile resolve through CoreDNS, node-cache's NOTRACK overridden.
        for load in [&mut pod, &mut host] {
            load.wait_alone("coredns");
        }
        node.script(&["node-cache-rules", "--remove"]);
        println!("node-cache's rules gone {} ms after its addresses", now_ms() - addrs_gone);
    }
    // The `fib` guard alone takes the cluster-DNS IP's queries to CoreDNS: the route stays
    // `Local`, since the agent's copy of the link-local IP on lo keeps the cache it probes
    // reachable while unbound still runs.
    for load in [&mut pod, &mut host] {
        load.wait_alone("coredns");
    }
    let st = agent.state().expect("state");
    assert_eq!((&st["route"], &st["transitions"]), (&"local".into(), &0.into()), "{st}");
    let killed = node.signal("cache-kill");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    println!(
        "route upstream {} ms after the kill ({})",
        since(&up) as i64 - killed as i64,
        up["reason"]
    );
    pod.wait_line("lookups after the cache exited", Duration::from_secs(5), |l| {
        field(l, "coredns").is_some_and(|n| n > 0)
    });

    // node-local-dns starts again.
    node.signal("listen-addrs-add");
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(plane.installed(&node).as_ref(), Some(&installed), "not the Local ruleset");
    for load in [&mut pod, &mut host] {
        load.wait_alone("cache");
    }
    for (client, load) in [("pod", pod), ("host", host)] {
        let summary = load.interrupt();
        println!("{} {client}: {summary}", plane.dataplane());
        let lost = sent_at(&summary, "first_attempt_lost_at_ms");
        let from_removal: Vec<i64> = lost.iter().map(|&t| t as i64 - addrs_gone as i64).collect();
        println!(
            "{} {client}: {} lookups, {} failed, {} first attempts lost (sent at {from_removal:?} ms from the address removal; cache killed at +{} ms)",
            plane.dataplane(),
            summary["sent"],
            summary["failed"],
            lost.len(),
            killed - addrs_gone
        );
        assert_eq!(summary["by_origin"]["other"], 0, "{client}: {summary}");
        // `addrs_gone` is when the removal was complete; 5 ms for rounding.
        assert_within(client, &lost, addrs_gone - 200, addrs_gone + 5);
        assert_eq!(summary["failed"], 0, "{client}: lookups failed: {summary}");
    }
}

/// Issue 6, item 4 (nftables): node-cache without its own rules tears down; nothing is lost
/// but queries already inside the cache, whose retries succeed.
#[test]
fn node_cache_teardown_never_blackholes() {
    node_cache_teardown(Plane::Nftables, NodeCache::WithoutRules);
}

/// Issue 6, item 4 on iptables-nft.
#[test]
fn node_cache_teardown_never_blackholes_iptables_nft() {
    node_cache_teardown(Plane::Iptables("nft"), NodeCache::WithoutRules);
}

/// Issue 6, item 4 on iptables-legacy.
#[test]
fn node_cache_teardown_never_blackholes_iptables_legacy() {
    node_cache_teardown(Plane::Iptables("legacy"), NodeCache::WithoutRules);
}

/// Issue 6, item 4 with a stock node-cache (its own rules, deleted after its interface): its
/// rules, overridden by the agent's, blackhole nothing while they outlive its addresses.
#[test]
fn node_cache_teardown_with_its_own_rules_never_blackholes() {
    node_cache_teardown(Plane::Nftables, NodeCache::WithItsRules);
}
