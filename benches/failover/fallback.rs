//! The link-local fallback's data path (issue 12, acceptance 4; issue 35, part 1): dnsperf from a
//! pod to 169.254.20.10 with the cache killed, through the agent's forwarder; through the peer
//! that does the same job, real CoreDNS bound where the cache was and configured as node-cache
//! forwards a miss (`forward` to kube-dns-upstream, no cache: every query is forwarded); and
//! straight to CoreDNS through kube-dns-upstream. The three alternate within each round, beside
//! one agent whose route is flipped by hand: `upstream` TPROXYs every query to its forwarder,
//! `local` lets it reach the socket that listens on the link-local IP, the peer's. Then, the
//! agent stopped, through a kernel DNAT: the floor of any fallback, no process between.

use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{
    clock_ticks_per_s, describe, kernel_ticks, real_bin, wait_for, Agent, Proc, SimNode,
    COREDNS_ANSWER, LOCAL_IP, UPSTREAM_IP,
};

use super::{
    children_ticks, dnsperf_queries, dnsperf_run_on, machine_ticks, mean, round1, start_agent_for,
    stop_agent, ticks_of, Shape,
};

/// The nft table of [`dnat_to_coredns`].
const DNAT_TABLE: &str = "nlha-bench-dnat";

/// What a kernel-only fallback would get, for comparison (docs/design/link-local.md, option B,
/// not built): 169.254.20.10's UDP port 53 DNATed to simnode's two CoreDNS endpoints
/// (testdata/simnode.sh's layout); no process between the pod and CoreDNS. Only without the
/// agent, whose NOTRACK of the link-local IP (node-cache's too, on a real node) keeps NAT away.
fn dnat_to_coredns() -> String {
    format!(
        "table ip {DNAT_TABLE} {{\n  chain pre {{\n    type nat hook prerouting priority -100;\n    \
         ip daddr {LOCAL_IP} udp dport 53 dnat to numgen random mod 2 map \
         {{ 0 : 10.244.1.2, 1 : 10.244.1.3 }}\n  }}\n}}\n"
    )
}

/// The peer's Corefile: node-cache's server block for a zone it forwards (bind, forward,
/// errors, prometheus on its :9253), less its cache, so that every query is a miss forwarded
/// to kube-dns-upstream, over UDP as the agent's forwarder asks. (node-cache forwards
/// cluster.local with `force_tcp`; its other zones, like this query's, over UDP.)
fn peer_corefile() -> String {
    format!(
        ".:53 {{\n    bind {LOCAL_IP}\n    errors\n    forward . {UPSTREAM_IP}\n    \
         prometheus {LOCAL_IP}:9253\n}}\n"
    )
}

/// The peer: real CoreDNS (`ci/k8s/build.sh coredns`) in the node's namespace on
/// [`peer_corefile`], its GOMAXPROCS the machine's; returns once it answers.
fn start_peer(node: &SimNode) -> Proc {
    let build = concat!(env!("CARGO_MANIFEST_DIR"), "/ci/k8s/build.sh");
    let out = Command::new(build).arg("coredns").output().expect("ci/k8s/build.sh");
    assert!(out.status.success(), "ci/k8s/build.sh coredns: {}", describe(&out));
    let corefile = node.dir.join("peer.Corefile");
    std::fs::write(&corefile, peer_corefile()).expect("write the peer's Corefile");
    let coredns = real_bin().join("coredns");
    let log = std::fs::File::create(node.dir.join("peer.log")).expect("the peer's log");
    let peer = Proc::spawn(
        node.cmd("node", &coredns.to_string_lossy())
            .arg("-conf")
            .arg(&corefile)
            .stdout(log.try_clone().expect("log"))
            .stderr(log),
    );
    // From the loopback address, as the agent's probes: the agent's route sends those to
    // whatever listens on the link-local IP, never to its forwarder.
    let server = format!("@{LOCAL_IP}");
    let args = ["-b", "127.0.0.1", "+time=1", "+tries=1", "+short", &server, "who.test"];
    wait_for("the peer to answer", Duration::from_secs(20), || {
        let out = node.run("node", "dig", &args);
        String::from_utf8_lossy(&out.stdout).lines().any(|l| l == COREDNS_ANSWER).then_some(())
    });
    peer
}

/// Flips the agent's route by hand and waits for it: `upstream` sends 169.254.20.10 to its
/// forwarder, `local` to whatever listens there.
fn flip(node: &SimNode, agent: &Agent, route: &str) {
    let dir = agent.state_dir.to_string_lossy().into_owned();
    let out = node.cli(&["flip", route, "--state-dir", &dir, "--reason", "bench"]);
    assert!(out.status.success(), "flip {route}: {}", describe(&out));
    agent.wait_route(route, Duration::from_secs(10));
}

/// The agent's forwarder's UDP queries so far (its /metrics).
fn forwarded(node: &SimNode) -> u64 {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "/metrics");
    let name = "nodelocaldns_ha_forwarder_udp_queries_total ";
    let value = body.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok());
    value.unwrap_or_else(|| panic!("{name}missing from /metrics")) as u64
}

/// Queries/s of `dnsperf` from a pod (4 clients, 200 queries outstanding) to 169.254.20.10, the
/// cache killed: through the agent's forwarder (its route `upstream`: TPROXY), through the peer
/// ([`start_peer`]; the route `local`: the peer's socket takes them), and straight to CoreDNS
/// through kube-dns-upstream; alternating, `rounds` times `secs` s each. Then, the agent
/// stopped, straight against [`dnat_to_coredns`], the kernel-only floor.
///
/// In three arrangements: with every process free to run on any core (`shared`: the
/// forwarder's CPU is taken from dnsperf's and CoreDNS's), and, on a machine of two cores or
/// more, with the forwarder (the agent or the peer) on a core of its own and dnsperf and
/// CoreDNS on another (`agent-own-core`, taskset; the same pinning for every path), as on a
/// cluster's node, whose cores CoreDNS does not share, or CoreDNS on a core of its own and the
/// client with the forwarder (`coredns-own-core`). The CPU of CoreDNS (dnsmasq, one thread) and
/// of the forwarder, and the forwarder's share of it spent in the kernel, say which one limits;
/// the forwarder's CPU over the queries it carried is its cost per query. None when dnsperf is
/// not installed.
pub(crate) fn dnsperf(node: &SimNode, rounds: u32, secs: u32) -> Option<Value> {
    let queries = dnsperf_queries(node)?;
    let pid = |svc: &str| -> u32 {
        let out = node.script(&[&format!("{svc}-pid")]);
        out.trim().parse().unwrap_or_else(|_| panic!("{svc}-pid printed {out:?}"))
    };
    let coredns = pid("coredns");
    let agent = start_agent_for(node, Shape::LinkLocal, &[]);
    let agent_pid = agent.pid().expect("the agent runs");
    node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(10));
    flip(node, &agent, "upstream");
    let table = node.agent_table().expect("the agent's table");
    assert!(table.contains("tproxy"), "the forwarder's TPROXY:\n{table}");
    assert_eq!(node.dig("pod1", LOCAL_IP), COREDNS_ANSWER, "the forwarder answers");
    assert_eq!(node.dig("pod1", UPSTREAM_IP), COREDNS_ANSWER, "CoreDNS answers");
    let peer = start_peer(node);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let every_core = format!("0-{}", cores - 1);
    let variants: &[&str] =
        if cores >= 2 { &["shared", "agent-own-core", "coredns-own-core"] } else { &["shared"] };
    // agent-own-core: the forwarder has a core; coredns-own-core: CoreDNS has one, as off the
    // node, and the client shares the other with the forwarder, as pods do on a node.
    let cpus = |variant: &str| match variant {
        "agent-own-core" => ("0".to_string(), "1".to_string(), Some("1")),
        "coredns-own-core" => ("0".to_string(), "1".to_string(), Some("0")),
        _ => (every_core.clone(), every_core.clone(), None),
    };
    let mut rows = Vec::new();
    for &variant in variants {
        let (forwarder_cpu, coredns_cpu, dnsperf_cpus) = cpus(variant);
        pin(agent_pid, &forwarder_cpu);
        pin(peer.pid(), &forwarder_cpu);
        pin(coredns, &coredns_cpu);
        for round in 1..=rounds {
            eprintln!("bench: dnsperf through the link-local fallback, {variant}, round {round}");
            for (path, server, forwarder) in [
                ("coredns", UPSTREAM_IP, None),
                ("fallback", LOCAL_IP, Some(agent_pid)),
                ("peer", LOCAL_IP, Some(peer.pid())),
            ] {
                flip(node, &agent, if path == "peer" { "local" } else { "upstream" });
                let before = forwarded(node);
                let run = Run { variant, round, series: "fallback", path, server };
                let row = run.measure(node, &queries, secs, dnsperf_cpus, coredns, forwarder);
                // Who answered: the agent's forwarder took the fallback's queries, and none of
                // the peer's.
                let took = forwarded(node) - before;
                match path {
                    "fallback" => assert!(took > 0, "the forwarder took none: {row}"),
                    "peer" => assert_eq!(took, 0, "the forwarder took the peer's: {row}"),
                    _ => {}
                }
                rows.push(row);
            }
        }
    }
    drop(peer);
    // The route back to the agent's own: a held flip outlives the agent in its state directory.
    let dir = agent.state_dir.to_string_lossy().into_owned();
    let out = node.cli(&["release", "--state-dir", &dir]);
    assert!(out.status.success(), "release: {}", describe(&out));
    stop_agent(node, agent);
    let file = node.dir.join("dnat.nft");
    std::fs::write(&file, dnat_to_coredns()).expect("write the DNAT's ruleset");
    let out = node.run("node", "nft", &["-f", &file.display().to_string()]);
    assert!(out.status.success(), "nft -f {}: {}", file.display(), describe(&out));
    assert_eq!(node.dig("pod1", LOCAL_IP), COREDNS_ANSWER, "the DNAT to CoreDNS answers");
    for &variant in variants {
        let (_, coredns_cpu, dnsperf_cpus) = cpus(variant);
        pin(coredns, &coredns_cpu);
        for round in 1..=rounds {
            eprintln!("bench: dnsperf through a kernel DNAT, {variant}, round {round}");
            for (path, server) in [("coredns", UPSTREAM_IP), ("dnat", LOCAL_IP)] {
                let run = Run { variant, round, series: "dnat", path, server };
                rows.push(run.measure(node, &queries, secs, dnsperf_cpus, coredns, None));
            }
        }
    }
    let out = node.run("node", "nft", &["delete", "table", "ip", DNAT_TABLE]);
    assert!(out.status.success(), "{}", describe(&out));
    pin(coredns, &every_core);
    node.script(&["cache-start"]);
    let summary: Vec<Value> = variants.iter().map(|&variant| summarise(&rows, variant)).collect();
    Some(json!({
        "seconds_per_round": secs,
        "rounds": rounds,
        "peer_corefile": peer_corefile(),
        "variants": summary,
        "runs": rows,
    }))
}

/// One arrangement's figures over its rounds: each path's queries/s, the ratios, and the
/// forwarders' CPU per query.
fn summarise(rows: &[Value], variant: &str) -> Value {
    let of = |series: &'static str, path: &'static str| {
        rows.iter()
            .filter(move |r| r["variant"] == variant && r["series"] == series && r["path"] == path)
    };
    let qps = |series, path| -> Vec<f64> {
        of(series, path).map(|r| r["qps"].as_f64().unwrap_or(0.0)).collect()
    };
    let cpu_us = |path| -> Vec<f64> {
        of("fallback", path).filter_map(|r| r["forwarder_cpu_us_per_query"].as_f64()).collect()
    };
    let over = |of: &[f64], to: &[f64]| (mean(of) / mean(to) * 1000.0).round() / 1000.0;
    let (direct, fallback, peer) =
        (qps("fallback", "coredns"), qps("fallback", "fallback"), qps("fallback", "peer"));
    let (direct_b, dnat) = (qps("dnat", "coredns"), qps("dnat", "dnat"));
    let (agent_us, peer_us) = (cpu_us("fallback"), cpu_us("peer"));
    json!({
        "variant": variant,
        "coredns_qps": direct,
        "fallback_qps": fallback,
        "peer_qps": peer,
        "fallback_over_coredns": over(&fallback, &direct),
        "fallback_over_peer": over(&fallback, &peer),
        "fallback_cpu_us_per_query": round1(mean(&agent_us)),
        "peer_cpu_us_per_query": round1(mean(&peer_us)),
        "fallback_cpu_over_peer": over(&agent_us, &peer_us),
        "coredns_qps_beside_dnat": direct_b,
        "dnat_qps": dnat,
        "dnat_over_coredns": over(&dnat, &direct_b),
    })
}

/// Pins every thread of `pid` to `cpus` (taskset's list).
fn pin(pid: u32, cpus: &str) {
    let out = Command::new("taskset").args(["-a", "-p", "-c", cpus, &pid.to_string()]).output();
    let out = out.expect("run taskset");
    assert!(out.status.success(), "taskset -a -p -c {cpus} {pid}: {}", describe(&out));
}

/// One dnsperf run of [`dnsperf`].
struct Run<'a> {
    variant: &'a str,
    round: u32,
    /// `fallback` (the agent running) or `dnat` (the agent stopped, [`dnat_to_coredns`]).
    series: &'a str,
    /// `coredns` (straight, through the Service), `fallback` (the agent's forwarder), `peer`
    /// (CoreDNS's forward plugin) or `dnat`.
    path: &'a str,
    server: &'a str,
}

impl Run<'_> {
    /// Runs dnsperf to the run's server; its figures, with the CPU of CoreDNS, of the process
    /// that forwards (the agent or the peer, when one does), of dnsperf and of the machine over
    /// the run.
    fn measure(
        &self,
        node: &SimNode,
        queries: &str,
        secs: u32,
        dnsperf_cpus: Option<&str>,
        coredns: u32,
        forwarder: Option<u32>,
    ) -> Value {
        // The forwarder asks the Service from a few long-lived sockets: a conntrack entry each.
        // (A socket per query, as it once had, left one per query, kept 30 s.) Each run starts
        // from an empty table, so that the rounds compare.
        let flushed = node.run("node", "conntrack", &["-F"]);
        assert!(flushed.status.success(), "conntrack -F: {}", describe(&flushed));
        let (t0, coredns0, forwarder0) =
            (Instant::now(), ticks_of(coredns), forwarder.map(ticks_of));
        let kernel0 = forwarder.and_then(kernel_ticks).unwrap_or_default();
        // dnsperf is this process's child once it is waited for; the machine's share is
        // everyone's, this benchmark's and any other load's.
        let (dnsperf0, machine0) = (children_ticks(), machine_ticks());
        let run = dnsperf_run_on(node, self.server, queries, secs, dnsperf_cpus);
        let wall = t0.elapsed().as_secs_f64();
        let mcpu = |from: u64, to: u64| {
            round1(to.saturating_sub(from) as f64 / clock_ticks_per_s() / wall * 1000.0)
        };
        let kernel1 = forwarder.and_then(kernel_ticks).unwrap_or_default();
        let kernel = kernel1.0.saturating_sub(kernel0.0);
        let total = kernel1.1.saturating_sub(kernel0.1);
        let kernel_share = (total > 0).then(|| (kernel as f64 / total as f64 * 100.0).round());
        let forwarder_mcpu = forwarder.zip(forwarder0).map(|(pid, from)| mcpu(from, ticks_of(pid)));
        // mCPU over queries/s: CPU-µs per query.
        let per_query = forwarder_mcpu.map(|m| round1(m * 1000.0 / run.qps.max(1.0)));
        let conntrack = node.run("node", "cat", &["/proc/sys/net/netfilter/nf_conntrack_count"]);
        let conntrack: Option<u64> = String::from_utf8_lossy(&conntrack.stdout).trim().parse().ok();
        json!({
            "variant": self.variant,
            "round": self.round,
            "series": self.series,
            "path": self.path,
            "server": self.server,
            "qps": run.qps.round(),
            "lost": run.lost,
            "latency_ms_mean": (run.latency_ms * 100.0).round() / 100.0,
            "coredns_mcpu": mcpu(coredns0, ticks_of(coredns)),
            "forwarder_mcpu": forwarder_mcpu,
            "forwarder_kernel_percent": kernel_share,
            "forwarder_cpu_us_per_query": per_query,
            "dnsperf_mcpu": mcpu(dnsperf0, children_ticks()),
            "machine_busy_mcpu": mcpu(machine0, machine_ticks()),
            "conntrack_entries_after": conntrack,
        })
    }
}

/// The part's tables for docs/bench.md.
pub(crate) fn table(p: &Value) -> String {
    let mut md = String::new();
    let list = |variant: &str, series: &str, path: &str| {
        let runs = p["runs"].as_array().into_iter().flatten();
        let runs =
            runs.filter(|r| r["variant"] == variant && r["series"] == series && r["path"] == path);
        runs.map(|r| {
            let who = if path == "peer" { "the peer" } else { "agent" };
            let forwarder = match (
                r["forwarder_mcpu"].as_f64(),
                r["forwarder_kernel_percent"].as_f64(),
                r["forwarder_cpu_us_per_query"].as_f64(),
            ) {
                (Some(a), Some(k), Some(q)) => {
                    format!(", {who} {a:.0} ({k:.0} % of it in the kernel; {q:.1} µs a query)")
                }
                _ => String::new(),
            };
            format!(
                "{:.0} ({:.2} ms mean latency; mCPU: dnsperf {:.0}, CoreDNS {:.0}{forwarder}, \
                 the machine {:.0} busy; {} conntrack entries after)",
                r["qps"].as_f64().unwrap_or(0.0),
                r["latency_ms_mean"].as_f64().unwrap_or(0.0),
                r["dnsperf_mcpu"].as_f64().unwrap_or(0.0),
                r["coredns_mcpu"].as_f64().unwrap_or(0.0),
                r["machine_busy_mcpu"].as_f64().unwrap_or(0.0),
                r["conntrack_entries_after"],
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
    };
    let label = |variant: &str| match variant {
        "shared" => "every process on either core",
        "agent-own-core" => "the forwarder on a core of its own; dnsperf and CoreDNS on the other",
        _ => "CoreDNS on a core of its own; dnsperf and the forwarder on the other",
    };
    let variants = || p["variants"].as_array().into_iter().flatten();
    let _ = writeln!(
        md,
        "\ndnsperf from a pod in the link-local shape, the cache killed ({} rounds of {} s each \
         per arrangement, the paths alternating, same settings): through the agent's forwarder \
         (the agent at defaults, its route `upstream`: 169.254.20.10 TPROXYed to the forwarder, \
         which asks kube-dns-upstream {UPSTREAM_IP}), through the peer (real CoreDNS bound at \
         169.254.20.10 where the cache was, configured as node-cache forwards a miss: \
         `forward . {UPSTREAM_IP}`, no cache; the agent's route `local`, so its socket takes \
         them), and straight to CoreDNS through {UPSTREAM_IP}. The forwarder's target: \
         at least the peer's queries/s and at most half its CPU per query:\n\n\
         | arrangement | through the forwarder, queries/s | through the peer | forwarder ÷ peer, \
         queries/s | CPU-µs a query, forwarder / peer | ratio |\n|---|---|---|---|---|---|",
        p["rounds"], p["seconds_per_round"],
    );
    for v in variants() {
        let variant = v["variant"].as_str().unwrap_or("?");
        let _ = writeln!(
            md,
            "| {} | {} | {} | **{}** | {} / {} | **{}** |",
            label(variant),
            list(variant, "fallback", "fallback"),
            list(variant, "fallback", "peer"),
            v["fallback_over_peer"],
            v["fallback_cpu_us_per_query"],
            v["peer_cpu_us_per_query"],
            v["fallback_cpu_over_peer"],
        );
    }
    let table = |series: &str, path: &str, through: &str, ratio: &str| {
        let mut rows = format!(
            "| arrangement | straight to CoreDNS, queries/s | through {through}, queries/s | \
             ratio |\n|---|---|---|---|\n"
        );
        for v in variants() {
            let variant = v["variant"].as_str().unwrap_or("?");
            let _ = writeln!(
                rows,
                "| {} | {} | {} | **{}** |",
                label(variant),
                list(variant, series, "coredns"),
                list(variant, series, path),
                v[ratio],
            );
        }
        rows
    };
    let _ = writeln!(
        md,
        "\nThe forwarder against straight to CoreDNS through kube-dns-upstream, in the same \
         rounds (the target: at least 0.8):\n"
    );
    md += &table("fallback", "fallback", "the forwarder", "fallback_over_coredns");
    let _ = writeln!(
        md,
        "\nFor comparison, what a kernel-only fallback gets: the agent stopped (its NOTRACK \
         of 169.254.20.10 with it, which on a real node node-cache's own would keep), \
         169.254.20.10 DNATed straight to CoreDNS's two endpoints (option B of \
         docs/design/link-local.md, not built: docs/benchmark.md says why), against straight to \
         CoreDNS, alternating, with the same pinning of CoreDNS and dnsperf:\n",
    );
    md += &table("dnat", "dnat", "a kernel DNAT", "dnat_over_coredns");
    let _ = writeln!(
        md,
        "\nThe CPU figures (over each run) say which side limits a path: CoreDNS here is \
         dnsmasq, one thread (1000 mCPU at most); the machine's figure counts every \
         process, other load included, out of 1000 mCPU per core. Straight, a query is two \
         packets through the kernel (the query, the answer); through a forwarder it is \
         four, and the forwarder's CPU is mostly the kernel's work on its two; through the \
         DNAT it is two again, with a NAT per packet and no process between. With every \
         process on either core that CPU is taken from dnsperf and CoreDNS; with a core of \
         its own, as on a node whose cores CoreDNS does not share, it is not. Each run \
         starts from an empty conntrack table in the node's namespace; a forwarder's \
         queries to the Service leave one entry per socket it asks from. dnsperf keeps 200 \
         queries outstanding: its rate is at most 200 over the mean latency.",
    );
    md
}
