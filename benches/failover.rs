//! `cargo bench --bench failover` (as root; `ci/bench.sh` installs what it needs and runs it):
//! what a pod sees when its node's DNS cache crashes or hangs, with node-cache's static rules,
//! with this agent, with probe-driven switching only, and with two nameservers in the pod's
//! resolv.conf; the same in the link-local shape (issue 12: pods ask 169.254.20.10 itself) with
//! node-cache alone, kubespray's second DaemonSet (two caches in one SO_REUSEPORT group, one of
//! them killed or hung) and the agent; on the node with real kube-proxy and CoreDNS, the
//! agent beside kube-dns with `trafficDistribution: PreferSameNode` (`failover/prefer.rs`);
//! then the agent's drift repair, switch latency, data-path
//! cost (dnsperf; and dnsperf through the link-local fallback against CoreDNS's own forward
//! plugin as node-cache runs it, straight to CoreDNS and a kernel DNAT: `failover/fallback.rs`)
//! and
//! footprint (idle CPU on an nftables, an iptables-nft, an iptables-legacy and a mixed node:
//! `failover/footprint.rs`); then a busy iptables-nft node (issue 17: INPUT policy DROP,
//! kube-proxy syncing every second with filter churn, 0 and 50,000 nat rules; and real
//! kube-proxy under EndpointSlice churn: `failover/busy.rs`): the agent's CPU with its
//! children, and a host-network client across a cache SIGKILL.
//!
//! One file past 600 lines: the arrangements, their checks, the fault runs and the report share
//! their types and are read together; each part is one function.
//!
//! One simulated node (`testdata/simnode.sh`, namespaces `$PREFIX-*`, PREFIX from
//! `NLHA_BENCH_PREFIX` or `b<pid>`) serves every arrangement in turn. Each arrangement is checked
//! to be what it claims before it is measured. Everything it starts is stopped by pid, and the
//! namespaces and `/etc/netns/$PREFIX-*` are removed on the way out (Drop guards, also when a
//! step panics).
//!
//! Output: a table on stdout and in `docs/bench.md`, every figure in `docs/bench.json`, and
//! `docs/failover.svg` (lookups/s by who answered them, per 100 ms of when they ended, per
//! arrangement and fault). Environment: `NLHA_BENCH_RATE` (lookups/s, default 1000),
//! `NLHA_BENCH_OUT` (default `docs`), `NLHA_BENCH_FOOTPRINT_SECS` and `_ROUNDS` (default 2 of 30 s),
//! `NLHA_BENCH_DNSPERF_ROUNDS` and `NLHA_BENCH_DNSPERF_SECS` (of both dnsperf parts, default 2
//! rounds of 5 s),
//! `NLHA_BENCH_MUSL_CLIENT` (the musl client; without it, that arrangement is skipped), and for
//! working on one part `NLHA_BENCH_PARTS` and `NLHA_BENCH_ARRANGEMENTS` (comma lists; the
//! link-local shape alone: `NLHA_BENCH_PARTS=link-local,fallback-dnsperf`).

#![forbid(unsafe_code)]

#[path = "failover/busy.rs"]
mod busy;
#[path = "failover/fallback.rs"]
mod fallback;
#[path = "failover/footprint.rs"]
mod footprint;
#[path = "failover/prefer.rs"]
mod prefer;
#[path = "failover/realnode.rs"]
mod realnode;
#[path = "failover/stall.rs"]
mod stall;
#[path = "failover/thesis.rs"]
mod thesis;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{
    cpu_ticks, describe, dnsload_exe, median, now_ms, percentile, read_lookups, require_root,
    setting, sleep_until_ms, summary_of, Agent, Lookup, Machine, NetnsEtc, Outcome, Proc, SimNode,
    CACHE_ANSWER, CLUSTER_DNS_IP, COREDNS_ANSWER, LOCAL_IP, UPSTREAM_IP,
};

/// The node's address on the real parts' node (testdata/simnode/real.sh), where the cache is an
/// endpoint of kube-dns with PreferSameNode.
const NODE_IP: &str = "10.240.0.1";

/// Load before the fault, the fault itself (kill: time until the restart; hang: SIGSTOP until
/// SIGCONT), and after it.
const PRE_MS: u64 = 2_000;
const FAULT_MS: u64 = 5_000;
const POST_MS: u64 = 12_000;
/// glibc's attempt timeout (`options timeout:5`, its default).
const GLIBC_TIMEOUT_MS: f64 = 5_000.0;
/// Timeline resolution of the SVG.
const BUCKET_MS: u64 = 100;

// ---------------------------------------------------------------------------------------------
// Arrangements.

#[derive(Clone, Copy, PartialEq)]
enum Setup {
    /// node-cache's own static NOTRACK rules, no agent.
    NodeCacheRules,
    /// The agent with these flags (on top of the test defaults: nftables, who.test probes).
    Agent(&'static [&'static str]),
    /// No NOTRACK rules; the pod's resolv.conf lists the cache's link-local IP, then kube-dns.
    TwoNameservers,
    /// The agent with these flags, SIGKILLed before the fault: its rules stay as it left them,
    /// its forwarder and its probes are gone.
    AgentGone(&'static [&'static str]),
    /// kubespray's second DaemonSet (`nodelocaldns-second`): node-cache's static rules and a
    /// second cache on the same IPs and port (simnode's `cache2`), the two in one SO_REUSEPORT
    /// group; no agent. The fault hits the first; the second runs throughout.
    SecondCache,
    /// kube-dns with `trafficDistribution: PreferSameNode`, the cache one of its endpoints, on
    /// this node; no NOTRACK rules, no agent (the real parts' node: [`prefer`]).
    PreferSameNode,
}

/// What the pods ask, and so what has to fail over.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// The kube-dns ClusterIP (10.96.0.10), NOTRACKed to the cache or DNATed by kube-proxy to
    /// CoreDNS; the agent with `--cluster-dns-ip`.
    ClusterIp,
    /// The cache's link-local IP itself (kubelet's `--cluster-dns` 169.254.20.10, as kubespray
    /// sets it); the agent without `--cluster-dns-ip`, its forwarder behind TPROXY.
    LinkLocal,
}

impl Shape {
    /// The address the pod's client asks.
    fn server(self) -> &'static str {
        match self {
            Shape::ClusterIp => CLUSTER_DNS_IP,
            Shape::LinkLocal => LOCAL_IP,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Shape::ClusterIp => "clusterip",
            Shape::LinkLocal => "link-local",
        }
    }
}

/// The pod's DNS client.
#[derive(Clone, Copy, PartialEq)]
enum Client {
    /// dnsload: glibc-like, one nameserver (the shape's), glibc's defaults (timeout 5 s, 2
    /// attempts); it sees each attempt. A new socket (source port) per attempt.
    Dnsload,
    /// `dnsload --system-resolver`: glibc's getaddrinfo, following the pod's resolv.conf. One
    /// socket for both attempts of a lookup: its retry comes from the same source port.
    Glibc,
    /// `testdata/resolver-load.c` built with musl-gcc: musl's getaddrinfo, which asks every
    /// nameserver at once and takes the first answer.
    Musl,
}

struct Arrangement {
    key: &'static str,
    label: &'static str,
    shape: Shape,
    setup: Setup,
    client: Client,
    /// The pod's DNS as the admission webhook sets it (the thesis's table), if not the shape's.
    pod: Option<&'static thesis::PodDns>,
}

const ARRANGEMENTS: &[Arrangement] = &[
    Arrangement {
        key: "node-cache",
        label: "a. node-cache's static rules, no agent",
        shape: Shape::ClusterIp,
        setup: Setup::NodeCacheRules,
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "agent",
        label: "b. agent, kernel fast path (defaults)",
        shape: Shape::ClusterIp,
        setup: Setup::Agent(&[]),
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "probes-default",
        label: "c. agent, probes only, defaults (100ms/80ms, fall 3)",
        shape: Shape::ClusterIp,
        setup: Setup::Agent(&[
            "--fast-path",
            "false",
            "--socket-events",
            "false",
            "--stall-bound",
            "0s",
        ]),
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "probes-kep",
        label: "c. agent, probes only, KEP sketch (2s/1s, fall 3)",
        shape: Shape::ClusterIp,
        setup: Setup::Agent(&[
            "--fast-path",
            "false",
            "--socket-events",
            "false",
            "--stall-bound",
            "0s",
            "--interval",
            "2s",
            "--timeout",
            "1s",
            "--tcp-interval",
            "0s",
        ]),
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "probes-aks",
        label: "c. agent, probes only, AKS-LocalDNS-like (12s/5s, fall 5)",
        shape: Shape::ClusterIp,
        setup: Setup::Agent(&[
            "--fast-path",
            "false",
            "--socket-events",
            "false",
            "--stall-bound",
            "0s",
            "--interval",
            "12s",
            "--timeout",
            "5s",
            "--fall",
            "5",
            "--tcp-interval",
            "0s",
        ]),
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "two-nameservers-glibc",
        label: "d. two nameservers (cache, kube-dns), glibc getaddrinfo",
        shape: Shape::ClusterIp,
        setup: Setup::TwoNameservers,
        client: Client::Glibc,
        pod: None,
    },
    Arrangement {
        key: "two-nameservers-musl",
        label: "d. two nameservers (cache, kube-dns), musl getaddrinfo",
        shape: Shape::ClusterIp,
        setup: Setup::TwoNameservers,
        client: Client::Musl,
        pod: None,
    },
    Arrangement {
        key: "link-local-node-cache",
        label: "e. node-cache alone (its static rules), no agent",
        shape: Shape::LinkLocal,
        setup: Setup::NodeCacheRules,
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "link-local-second-cache",
        label: "f. kubespray's second DaemonSet (2 caches, SO_REUSEPORT)",
        shape: Shape::LinkLocal,
        setup: Setup::SecondCache,
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "link-local-second-cache-glibc",
        label: "f. kubespray's second DaemonSet, glibc getaddrinfo",
        shape: Shape::LinkLocal,
        setup: Setup::SecondCache,
        client: Client::Glibc,
        pod: None,
    },
    Arrangement {
        key: "link-local-agent",
        label: "g. agent, link-local shape (defaults)",
        shape: Shape::LinkLocal,
        setup: Setup::Agent(&[]),
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "link-local-agent-glibc",
        label: "g. agent, link-local shape (defaults), glibc getaddrinfo",
        shape: Shape::LinkLocal,
        setup: Setup::Agent(&[]),
        client: Client::Glibc,
        pod: None,
    },
];

#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    Kill,
    Hang,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Hang => "hang",
        }
    }
}

/// A pod's resolv.conf as the thesis's webhook injects it (glibc's defaults: timeout 5 s,
/// attempts 2).
const TWO_NAMESERVERS: &str = "nameserver 169.254.20.10\nnameserver 10.96.0.10\n";

/// The raw table of the simulated node's iptables flavour (and the legacy one).
fn raw_rules(node: &SimNode) -> String {
    let mut text = String::new();
    for save in ["iptables-nft-save", "iptables-legacy-save"] {
        let out = node.run("node", save, &["-t", "raw"]);
        text.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    text
}

/// A pod's resolv.conf in the link-local shape: kubelet's `--cluster-dns` is the cache's IP.
const LINK_LOCAL_NAMESERVER: &str = "nameserver 169.254.20.10\n";

/// The pod's resolv.conf, when the arrangement sets its own (glibc's defaults: timeout 5 s,
/// attempts 2).
fn resolv_conf(arrangement: &Arrangement) -> Option<String> {
    if let Some(pod) = arrangement.pod {
        return Some(pod.resolv_conf());
    }
    match (arrangement.setup, arrangement.shape) {
        (Setup::TwoNameservers, _) => Some(TWO_NAMESERVERS.into()),
        (_, Shape::LinkLocal) => Some(LINK_LOCAL_NAMESERVER.into()),
        (_, Shape::ClusterIp) => None,
    }
}

/// The pids of the unbound processes with a UDP socket on the link-local IP's port 53: the
/// members of its SO_REUSEPORT group.
fn caches_listening(node: &SimNode) -> Vec<String> {
    let filter = format!("src {LOCAL_IP} and sport = :53");
    let out = node.run("node", "ss", &["-Hulnp", &filter]);
    let text = String::from_utf8_lossy(&out.stdout);
    let mut pids: Vec<String> = text
        .lines()
        .filter(|l| l.contains("\"unbound\""))
        .filter_map(|l| Some(l.split("pid=").nth(1)?.split(',').next()?.to_owned()))
        .collect();
    pids.sort();
    pids.dedup();
    pids
}

/// Checks the node is in the state `arrangement` claims; returns what was checked, for the JSON.
fn verify(node: &SimNode, arrangement: &Arrangement, agent: Option<&Agent>) -> Vec<String> {
    let (setup, shape) = (arrangement.setup, arrangement.shape);
    let mut checked = Vec::new();
    let raw = raw_rules(node);
    let node_cache_rules = raw.matches("NodeLocal DNS Cache: skip conntrack").count();
    let agent_chains = raw.contains("NODELOCALDNS-HA");
    let table = node.agent_table();
    match setup {
        Setup::NodeCacheRules | Setup::SecondCache => {
            let caches = caches_listening(node);
            let want = if setup == Setup::SecondCache { 2 } else { 1 };
            assert!(
                table.is_none() && !agent_chains,
                "{}: the agent's rules exist",
                arrangement.key
            );
            assert!(
                node_cache_rules >= 4,
                "{}: node-cache's rules missing:\n{raw}",
                arrangement.key
            );
            assert!(agent.is_none());
            assert_eq!(caches.len(), want, "{}: caches on {LOCAL_IP}:53", arrangement.key);
            checked.push(format!(
                "no agent table or chains; {node_cache_rules} node-cache NOTRACK rules; \
                 {want} unbound on {LOCAL_IP}:53 (pids {})",
                caches.join(", ")
            ));
        }
        Setup::Agent(flags) | Setup::AgentGone(flags) => {
            let table = table.expect("the agent's table is installed");
            assert_eq!(node_cache_rules, 0, "node-cache's rules are still there");
            let fast = table.contains("socket transparent 0");
            let want_fast = !flags.contains(&"false");
            assert_eq!(fast, want_fast, "fast path in the table:\n{table}");
            let state = agent.and_then(Agent::state).expect("agent state");
            assert_eq!(state["route"], "local");
            let said = state["shape"].as_str().unwrap_or_default();
            let want_shape = match shape {
                Shape::ClusterIp => "ClusterIP",
                Shape::LinkLocal => "link-local",
            };
            assert!(said.starts_with(want_shape), "the agent's shape: {said}");
            if shape == Shape::LinkLocal {
                assert!(table.contains("tproxy"), "the forwarder's TPROXY:\n{table}");
            }
            checked.push(format!("agent table, fast path {fast}, route local, shape {said:?}"));
        }
        Setup::TwoNameservers => {
            assert!(table.is_none() && !agent_chains, "arrangement d: the agent's rules exist");
            assert_eq!(node_cache_rules, 0, "arrangement d: node-cache's rules exist");
        }
        Setup::PreferSameNode => {
            assert!(table.is_none() && !agent_chains, "PreferSameNode: the agent's rules exist");
            assert_eq!(node_cache_rules, 0, "PreferSameNode: node-cache's rules exist");
            let nat = node.run("node", "iptables-nft-save", &["-t", "nat"]);
            let nat = String::from_utf8_lossy(&nat.stdout);
            let cache = format!("--to-destination {NODE_IP}:53");
            assert!(nat.contains(&cache), "PreferSameNode: no DNAT to the cache's endpoint");
            checked.push(format!(
                "no agent, no NOTRACK rules; kube-proxy DNATs to the cache's endpoint {NODE_IP}:53"
            ));
        }
    }
    if let Some(text) = resolv_conf(arrangement) {
        let seen = node.run("pod1", "cat", &["/etc/resolv.conf"]);
        let seen = String::from_utf8_lossy(&seen.stdout).into_owned();
        assert_eq!(seen, text, "the pod's resolv.conf");
        let servers: Vec<&str> =
            seen.lines().filter_map(|l| l.strip_prefix("nameserver ")).collect();
        checked.push(format!("pod resolv.conf nameservers {servers:?}"));
    }
    if setup == Setup::TwoNameservers {
        checked.push("no NOTRACK rules".into());
    }
    // Who answers the pod at each address right now.
    let at_cluster_ip = node.dig("pod1", CLUSTER_DNS_IP);
    let at_local_ip = node.dig("pod1", LOCAL_IP);
    let want_cluster = match (setup, shape) {
        // No NOTRACK rule for the ClusterIP: kube-proxy's DNAT to CoreDNS.
        (Setup::TwoNameservers, _) | (Setup::Agent(_) | Setup::AgentGone(_), Shape::LinkLocal) => {
            COREDNS_ANSWER
        }
        _ => CACHE_ANSWER,
    };
    assert_eq!(at_cluster_ip, want_cluster, "who answers the pod at {CLUSTER_DNS_IP}");
    assert_eq!(at_local_ip, CACHE_ANSWER, "who answers the pod at the link-local IP");
    checked
        .push(format!("pod: {CLUSTER_DNS_IP} -> {at_cluster_ip}, 169.254.20.10 -> {at_local_ip}"));
    checked
}

// ---------------------------------------------------------------------------------------------
// One fault under load.

struct FaultRun {
    fault: Fault,
    fault_at: u64,
    recovered_at: u64,
    lookups: Vec<Lookup>,
    summary: Value,
    client: Client,
    /// The pod's resolv.conf lists the cache's IP and then kube-dns.
    two_nameservers: bool,
    /// PreferSameNode: when the API server took the cache's endpoint's changes (the test bed
    /// playing the kubelet), after the fault and after the recovery.
    endpoint_changes: Option<Value>,
}

/// The arrangement's client in pod1 at `rate` lookups/s (dnsload asking the shape's address;
/// the others follow the pod's resolv.conf) across `fault` of the cache.
fn run_fault(node: &SimNode, arrangement: &Arrangement, fault: Fault, rate: u32) -> FaultRun {
    let client = arrangement.client;
    let server = arrangement.shape.server();
    let out_dir = node.dir.join("load");
    std::fs::create_dir_all(&out_dir).expect("load dir");
    let lookups_path = out_dir.join(format!("lookups-{}.txt", fault.name()));
    let stdout_path = out_dir.join(format!("stdout-{}.txt", fault.name()));
    let total_ms = PRE_MS + FAULT_MS + POST_MS;
    let name = arrangement.pod.map_or("who.test", |p| p.name);
    let both_families = arrangement.pod.is_some_and(|p| p.both_families);
    let mut cmd = match client {
        Client::Musl => {
            let musl = musl_client().expect("the musl client");
            let mut cmd = node.cmd("pod1", &musl.to_string_lossy());
            cmd.args([rate.to_string(), total_ms.to_string(), name.into()]);
            cmd.arg(&lookups_path);
            if both_families {
                cmd.arg("unspec");
            }
            cmd
        }
        Client::Dnsload | Client::Glibc => {
            let mut cmd = node.cmd("pod1", dnsload_exe());
            if client == Client::Glibc {
                cmd.arg("--system-resolver");
                if both_families {
                    cmd.arg("--both-families");
                }
            } else {
                // glibc's defaults for a pod's single-nameserver resolv.conf.
                cmd.args(["--server", server, "--timeout", "5s", "--attempts", "2"]);
            }
            cmd.args(["--name", name, "--rate", &rate.to_string()])
                .args(["--duration", &format!("{total_ms}ms"), "--report-interval", "0"])
                .args(["--origin", &format!("{CACHE_ANSWER}=cache")])
                .args(["--origin", &format!("{COREDNS_ANSWER}=coredns")])
                .arg("--lookups-out")
                .arg(&lookups_path);
            cmd
        }
    };
    cmd.stdout(std::fs::File::create(&stdout_path).expect("stdout file")).stderr(Stdio::inherit());
    let load = Proc::spawn(&mut cmd);
    let started = now_ms();

    sleep_until_ms(started + PRE_MS);
    let fault_at = match fault {
        Fault::Kill => node.signal("cache-kill"),
        Fault::Hang => node.signal("cache-stop"),
    };
    // PreferSameNode: the kubelet (played here) reports the killed container, and the endpoint
    // turns not-ready; a hang it cannot see within the fault ([`prefer`]).
    let kubelet = arrangement.setup == Setup::PreferSameNode && fault == Fault::Kill;
    // When the API server took each change of the cache's endpoint (printed by simnode).
    let endpoint = |condition: &str| -> u64 {
        let out = node.script(&["cache-endpoint", condition]);
        out.trim().parse().unwrap_or_else(|_| panic!("cache-endpoint printed {out:?}"))
    };
    let mut not_ready_at = None;
    if kubelet {
        sleep_until_ms(fault_at + prefer::KUBELET_NOTICES_MS);
        not_ready_at = Some(endpoint("not-ready"));
    }
    sleep_until_ms(fault_at + FAULT_MS);
    let recovered_at = match fault {
        Fault::Kill => {
            node.script(&["cache-start"]);
            now_ms() // the cache answers again (cache-start waits for that)
        }
        Fault::Hang => node.signal("cache-cont"),
    };
    let mut ready_at = None;
    if kubelet {
        sleep_until_ms(recovered_at + prefer::KUBELET_NOTICES_MS);
        ready_at = Some(endpoint("ready"));
    }
    // Each as long after the fault and the recovery.
    let endpoint_changes = not_ready_at.zip(ready_at).map(|(down, up)| {
        json!({
            "not_ready_after_fault_ms": down.saturating_sub(fault_at),
            "ready_after_recovery_ms": up.saturating_sub(recovered_at),
        })
    });
    let status = load.wait();
    assert!(status.success(), "dnsload failed: {status}");

    let stdout = std::fs::read_to_string(&stdout_path).expect("dnsload stdout");
    let summary = summary_of(stdout.lines());
    let lookups = read_lookups(&lookups_path, &summary);
    let two_nameservers = arrangement.setup == Setup::TwoNameservers;
    FaultRun {
        fault,
        fault_at,
        recovered_at,
        lookups,
        summary,
        client,
        two_nameservers,
        endpoint_changes,
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

impl FaultRun {
    /// A lookup whose first try did not give the answer: it failed, an attempt failed, or
    /// (glibc, cache listed first) the second nameserver answered, or (glibc, one nameserver)
    /// it ended only after glibc's attempt timeout. None for musl, which asks both nameservers
    /// at once: its attempts are not visible.
    fn first_attempt_lost(&self, l: &Lookup) -> Option<bool> {
        match self.client {
            Client::Musl => None,
            Client::Glibc if self.two_nameservers => Some(l.outcome != Outcome::Cache),
            Client::Glibc => Some(f64::from(l.latency) >= GLIBC_TIMEOUT_MS),
            Client::Dnsload => Some(l.first_attempt_lost()),
        }
    }

    /// The first good answer once answers flow again, in ms after the fault: in the first
    /// 100 ms of start time after the fault in which at least 90 % of the lookups were answered
    /// within 1 s (a lone answer from the cache just before the signal took effect does not
    /// count, nor queries a hung cache answers late, once it runs again).
    fn first_good_answer_ms(&self) -> Option<f64> {
        let fault = self.fault_at as f64;
        let end = self.lookups.iter().map(|l| l.start).fold(0.0, f64::max);
        let mut from = fault;
        while from < end {
            let bucket: Vec<&Lookup> = self
                .lookups
                .iter()
                .filter(|l| l.start >= from && l.start < from + BUCKET_MS as f64)
                .collect();
            let good: Vec<&&Lookup> =
                bucket.iter().filter(|l| l.answered() && l.latency < 1000.0).collect();
            if !bucket.is_empty() && good.len() * 10 >= bucket.len() * 9 {
                let first = good.iter().map(|l| l.start + f64::from(l.latency) - fault);
                return Some(first.fold(f64::INFINITY, f64::min));
            }
            from += BUCKET_MS as f64;
        }
        None
    }

    /// How many lookups lost their first attempt (None for musl, whose attempts are not
    /// visible).
    fn first_attempts_lost(&self) -> Option<usize> {
        self.lookups.iter().map(|l| self.first_attempt_lost(l).map(usize::from)).sum()
    }

    fn figures(&self) -> Value {
        let fault = self.fault_at as f64;
        let recovered = self.recovered_at as f64;
        let end = self.lookups.iter().map(|l| l.start).fold(0.0, f64::max);
        let failed = self.lookups.iter().filter(|l| l.outcome == Outcome::Failed).count();
        let lost = self.first_attempts_lost();
        let count = |o| self.lookups.iter().filter(|l| l.outcome == o).count();
        // Lookups started in the fault window: time to their answer or to giving up.
        let window: Vec<&Lookup> = self
            .lookups
            .iter()
            .filter(|l| l.start >= fault && l.start < fault + FAULT_MS as f64)
            .collect();
        let mut latencies: Vec<f64> = window.iter().map(|l| f64::from(l.latency)).collect();
        latencies.sort_by(f64::total_cmp);
        let window_failed = window.iter().filter(|l| l.outcome == Outcome::Failed).count();
        // Answered or not, took over 1 s: waited out a timeout, or for a hung server to resume.
        let window_slow = latencies.iter().filter(|&&ms| ms > 1000.0).count();
        let first_good = self.first_good_answer_ms().unwrap_or(f64::INFINITY);
        // Back on the cache: the first lookup after the last one (started after the recovery)
        // not answered by the cache.
        let after: Vec<&Lookup> = self.lookups.iter().filter(|l| l.start >= recovered).collect();
        let back = match after.iter().rposition(|l| l.outcome != Outcome::Cache) {
            None => after.first().map(|l| l.start - recovered),
            Some(i) => after.get(i + 1).map(|l| l.start - recovered),
        };
        let before = self.lookups.iter().filter(|l| l.start < fault).count();
        let before_cache =
            self.lookups.iter().filter(|l| l.start < fault && l.outcome == Outcome::Cache).count();
        json!({
            "fault": self.fault.name(),
            "endpoint_changes": self.endpoint_changes,
            "sent": self.lookups.len(),
            "answered_by_cache": count(Outcome::Cache),
            "answered_by_coredns": count(Outcome::CoreDns),
            "answered_by_other": count(Outcome::Other),
            "failed": failed,
            "first_attempt_lost": lost,
            "fault_window": {
                "lookups": window.len(),
                "failed": window_failed,
                "over_1s": window_slow,
                "latency_ms_p50": round1(percentile(&latencies, 50.0)),
                "latency_ms_p99": round1(percentile(&latencies, 99.0)),
                "latency_ms_max": round1(latencies.last().copied().unwrap_or(0.0)),
            },
            "fault_to_first_good_answer_ms": first_good.is_finite().then(|| round1(first_good)),
            "recovery_to_cache_ms": back.map(round1),
            "cache_share_before_fault": round1(100.0 * before_cache as f64 / before.max(1) as f64) / 100.0,
            "observed_after_recovery_ms": round1(end - recovered),
            "recovery_took_ms": self.recovered_at - self.fault_at - FAULT_MS,
            "client_summary": {
                "failed": self.summary["failed"],
                "first_attempt_lost": self.summary["first_attempt_lost"],
                "skipped": self.summary["skipped"],
                "unfinished": self.summary["unfinished"],
                "timeout_attempts": self.summary["timeout_attempts"],
                "refused_attempts": self.summary["refused_attempts"],
            },
        })
    }

    /// Per bucket of completion time (answer, or giving up), from PRE_MS before the fault:
    /// (t, cache, coredns, failed), per second.
    fn timeline(&self) -> Vec<(f64, f64, f64, f64)> {
        let from = self.fault_at as f64 - PRE_MS as f64;
        let n = ((PRE_MS + FAULT_MS + POST_MS) / BUCKET_MS) as usize + 1;
        let mut buckets = vec![(0u32, 0u32, 0u32); n];
        for l in &self.lookups {
            let i = ((l.start + f64::from(l.latency) - from) / BUCKET_MS as f64).floor();
            if i < 0.0 || i as usize >= n {
                continue;
            }
            let b = &mut buckets[i as usize];
            match l.outcome {
                Outcome::Cache => b.0 += 1,
                Outcome::CoreDns => b.1 += 1,
                Outcome::Failed | Outcome::Other => b.2 += 1,
            }
        }
        let per_s = 1000.0 / BUCKET_MS as f64;
        buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let t = (i as f64 * BUCKET_MS as f64 - PRE_MS as f64) / 1000.0;
                (t, f64::from(b.0) * per_s, f64::from(b.1) * per_s, f64::from(b.2) * per_s)
            })
            .collect()
    }
}

/// Starts the agent with `flags` after removing an earlier agent's state file.
fn start_agent(node: &SimNode, flags: &[&str]) -> Agent {
    start_agent_for(node, Shape::ClusterIp, flags)
}

/// [`start_agent`] for `shape`: in the link-local shape without `--cluster-dns-ip`.
fn start_agent_for(node: &SimNode, shape: Shape, flags: &[&str]) -> Agent {
    let _ = std::fs::remove_file(node.dir.join("agent-state").join("state.json"));
    match shape {
        Shape::ClusterIp => node.agent(flags),
        Shape::LinkLocal => node.agent_for(LOCAL_IP, "", UPSTREAM_IP, flags),
    }
}

/// Stops the agent (SIGTERM) and removes its rules.
fn stop_agent(node: &SimNode, mut agent: Agent) {
    agent.stop(nix::sys::signal::Signal::SIGTERM);
    remove_rules(node, &agent);
}

/// Removes the rules a stopped `agent` left (`teardown`).
fn remove_rules(node: &SimNode, agent: &Agent) {
    let dir = agent.state_dir.to_string_lossy().into_owned();
    let out = node.cli(&["teardown", "--state-dir", &dir]);
    assert!(out.status.success(), "teardown: {}", describe(&out));
}

struct ArrangementResult {
    arrangement: &'static Arrangement,
    checked: Vec<String>,
    runs: Vec<FaultRun>,
    /// Why it was not measured.
    skipped: Option<String>,
}

/// The musl client (`NLHA_BENCH_MUSL_CLIENT`, built by `ci/bench.sh`), if there is one.
fn musl_client() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("NLHA_BENCH_MUSL_CLIENT")?);
    path.is_file().then_some(path)
}

/// The arrangements of `shape` (those `NLHA_BENCH_ARRANGEMENTS` names, if set), each across a
/// kill and a hang of the cache.
fn failover(node: &SimNode, rate: u32, shape: Shape) -> Vec<ArrangementResult> {
    failover_of(node, rate, ARRANGEMENTS.iter().filter(|a| a.shape == shape))
}

/// [`failover`] of `arrangements`.
fn failover_of(
    node: &SimNode,
    rate: u32,
    arrangements: impl Iterator<Item = &'static Arrangement>,
) -> Vec<ArrangementResult> {
    let mut results = Vec::new();
    // For working on one arrangement: NLHA_BENCH_ARRANGEMENTS=agent,two-nameservers-musl.
    let only = std::env::var("NLHA_BENCH_ARRANGEMENTS").ok();
    let wanted = |key: &str| only.as_deref().is_none_or(|o| o.split(',').any(|k| k == key));
    for arrangement in arrangements.filter(|a| wanted(a.key)) {
        let shape = arrangement.shape;
        eprintln!("bench: failover, {} shape, {}", shape.name(), arrangement.label);
        if arrangement.client == Client::Musl && musl_client().is_none() {
            let why = "no musl client (NLHA_BENCH_MUSL_CLIENT; ci/bench.sh builds it)".to_string();
            eprintln!("bench:   skipped: {why}");
            let (checked, runs, skipped) = (Vec::new(), Vec::new(), Some(why));
            results.push(ArrangementResult { arrangement, checked, runs, skipped });
            continue;
        }
        let mut checked = Vec::new();
        let mut runs = Vec::new();
        let _resolv = resolv_conf(arrangement).map(|t| NetnsEtc::resolv_conf(&node.ns("pod1"), &t));
        if matches!(arrangement.setup, Setup::NodeCacheRules | Setup::SecondCache) {
            node.script(&["node-cache-rules"]);
        }
        if arrangement.setup == Setup::SecondCache {
            node.script(&["cache2-start"]);
        }
        // The cache binds the node's address while kube-dns prefers it: restarted around.
        if arrangement.setup == Setup::PreferSameNode {
            node.script(&["prefer-same-node", "on"]);
            node.script(&["cache-kill"]);
            node.script(&["cache-start"]);
        }
        for fault in [Fault::Kill, Fault::Hang] {
            let mut agent = match arrangement.setup {
                Setup::Agent(flags) | Setup::AgentGone(flags) => {
                    Some(start_agent_for(node, shape, flags))
                }
                _ => None,
            };
            // Each fault starts from an empty conntrack table: an entry an earlier run left (a
            // query DNATed to CoreDNS, kept 30 s) would take a later query from the same source
            // port where it went, whatever the route or the endpoints are now.
            let flushed = node.run("node", "conntrack", &["-F"]);
            assert!(flushed.status.success(), "conntrack -F: {}", describe(&flushed));
            // Checked before each fault: the previous one must not have changed the setup.
            checked = verify(node, arrangement, agent.as_ref());
            let gone = matches!(arrangement.setup, Setup::AgentGone(_));
            if let (true, Some(agent)) = (gone, agent.as_mut()) {
                agent.stop(nix::sys::signal::Signal::SIGKILL);
                checked.push("the agent SIGKILLed before the fault, its rules left".into());
            }
            let run = run_fault(node, arrangement, fault, rate);
            eprintln!("bench:   {}: {}", fault.name(), run.figures());
            runs.push(run);
            match agent {
                Some(agent) if gone => remove_rules(node, &agent),
                Some(agent) => stop_agent(node, agent),
                None => {}
            }
        }
        if arrangement.setup == Setup::SecondCache {
            node.script(&["cache2-kill"]);
        }
        if matches!(arrangement.setup, Setup::NodeCacheRules | Setup::SecondCache) {
            node.script(&["node-cache-rules", "--remove"]);
        }
        if arrangement.setup == Setup::PreferSameNode {
            node.script(&["prefer-same-node", "off"]);
            node.script(&["cache-kill"]);
            node.script(&["cache-start"]);
        }
        results.push(ArrangementResult { arrangement, checked, runs, skipped: None });
    }
    results
}

// ---------------------------------------------------------------------------------------------
// Drift repair, switch latency, footprint.

const DATAPLANES: [&str; 3] = ["nftables", "iptables-nft", "iptables-legacy"];

/// Flushes the agent's rules `trials` times and times their return (ms), polling from a shell
/// in the node namespace (each poll is one `nft`/`iptables-save`, a few ms: the resolution).
fn drift_repair(node: &SimNode, trials: u32) -> Value {
    let mut rows = Vec::new();
    for dataplane in DATAPLANES {
        eprintln!("bench: drift repair, {dataplane}");
        let agent = start_agent(node, &["--dataplane", dataplane]);
        let (flush, check) = match dataplane {
            "nftables" => (
                "nft flush table inet nodelocaldns-ha".to_string(),
                "nft list table inet nodelocaldns-ha 2>/dev/null | grep -q notrack".to_string(),
            ),
            flavour => (
                format!("{flavour} -t raw -F NODELOCALDNS-HA-PREROUTING"),
                format!(
                    "{flavour}-save -t raw | grep -q -- '-A NODELOCALDNS-HA-PREROUTING.*NOTRACK'"
                ),
            ),
        };
        // Bounded: at most 2000 polls (several seconds) per trial.
        let script = format!(
            "{check} || exit 3; {flush} || exit 4; t0=$(date +%s%N); \
             for i in $(seq 1 2000); do if {check}; then echo $(( ($(date +%s%N) - t0) / 1000 )); exit 0; fi; done; exit 5"
        );
        let mut times = Vec::new();
        for _ in 0..trials {
            let out = node.run("node", "bash", &["-c", &script]);
            assert!(out.status.success(), "drift trial: {}", describe(&out));
            let us: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("µs");
            times.push(us / 1000.0);
            std::thread::sleep(Duration::from_millis(300)); // repairs are >= 50 ms apart
        }
        let repairs = agent.state().map(|s| s["repairs"].clone()).unwrap_or(Value::Null);
        stop_agent(node, agent);
        let max = times.iter().copied().fold(0.0, f64::max);
        let min = times.iter().copied().fold(f64::INFINITY, f64::min);
        rows.push(json!({
            "dataplane": dataplane,
            "trials": trials,
            "median_ms": round1(median(&mut times)),
            "min_ms": round1(min),
            "max_ms": round1(max),
            "agent_repairs": repairs,
        }));
    }
    Value::Array(rows)
}

/// Reads the apply-duration histogram's (sum, count) from the agent's /metrics.
fn apply_histogram(node: &SimNode) -> (f64, f64) {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "/metrics");
    let value = |name: &str| {
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    (
        value("nodelocaldns_ha_dataplane_apply_duration_seconds_sum"),
        value("nodelocaldns_ha_dataplane_apply_duration_seconds_count"),
    )
}

/// Flips before the counted ones in [`switch_latency`].
const SWITCH_WARM_UP: u32 = 2;

/// Set for this benchmark's own binary run in a node's namespace: it measures the floor there
/// ([`commit_floor_here`]) and exits. `loop`: the median of 20 commits in a row; `once`: one.
const FLOOR_ENV: &str = "NLHA_BENCH_COMMIT_FLOOR";

/// Prints the time (ms) of the least real nftables transaction (`Nftables::commit_floor`: a
/// table created and deleted) committed in the namespace this process runs in: what any
/// writer's switch pays there, timed in-process as the agent's commit is. `once`: one commit,
/// after a request that walks no chain (the socket's first exchange is not timed), as a writer
/// that commits now and then meets the kernel, its data out of the CPU's caches; otherwise the
/// median of 20 in a row, after [`SWITCH_WARM_UP`], caches warm. Refuses the root namespace.
fn commit_floor_here(mode: &str) {
    let ns = |path: &str| std::fs::metadata(path).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    assert_ne!(
        ns("/proc/self/ns/net").ok(),
        ns("/proc/1/ns/net").ok(),
        "not in a node's namespace"
    );
    let mut nft = nodelocaldns_ha::dataplane::nftables::Nftables::new().expect("nftables socket");
    let (warm_up, commits) = if mode == "once" { (0, 1) } else { (SWITCH_WARM_UP, 20) };
    nft.generation().expect("the ruleset generation");
    let mut times = Vec::new();
    for i in 0..warm_up + commits {
        let t0 = Instant::now();
        nft.commit_floor().expect("the floor's commit");
        if i >= warm_up {
            times.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    println!("{}", median(&mut times));
}

/// [`commit_floor_here`] (`mode`) in `node`'s namespace, beside whatever runs there.
fn commit_floor(node: &SimNode, mode: &str) -> f64 {
    let exe = std::env::current_exe().expect("this benchmark's binary");
    let out =
        node.cmd("node", &exe.to_string_lossy()).env(FLOOR_ENV, mode).output().expect("floor");
    assert!(out.status.success(), "the commit floor: {}", describe(&out));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("the floor's median")
}

/// Flips the route [`SWITCH_WARM_UP`] times, then `flips` times counted, per dataplane: the
/// agent's own apply duration of each flip (from its histogram, read around the flip; median
/// and mean: at a few milliseconds a mean follows its outliers), the kernel's commit of it
/// where the backend times one (nftables: the switch itself, the apply less its read-back),
/// and the `flip` command's round trip (median; it returns once the agent applied). For
/// nftables, beside each counted flip, the least transaction committed once by a process of its
/// own, as the flip's is (the two meet the kernel alike, seldom and cold); and 20 of them in a
/// row, warm, at the end.
pub(crate) fn switch_latency(
    node: &SimNode,
    dataplanes: &[&str],
    flips: u32,
    nat_rules: usize,
) -> Vec<Value> {
    let mut rows = Vec::new();
    for &dataplane in dataplanes {
        eprintln!("bench: switch latency, {dataplane}, {nat_rules} nat rules");
        let agent = start_agent(node, &["--dataplane", dataplane]);
        let dir = agent.state_dir.to_string_lossy().into_owned();
        let (mut applies_ms, mut commits_ms, mut round_trips) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut floors_ms = Vec::new();
        let commit = "nodelocaldns_ha_dataplane_commit_duration_seconds";
        for i in 0..SWITCH_WARM_UP + flips {
            let route = if i % 2 == 0 { "upstream" } else { "local" };
            let (sum0, count0) = apply_histogram(node);
            let (commit_sum0, commit_count0) = histogram(node, commit);
            let t0 = Instant::now();
            let out = node.cli(&["flip", route, "--state-dir", &dir, "--reason", "bench"]);
            let round_trip = t0.elapsed().as_secs_f64() * 1000.0;
            assert!(out.status.success(), "flip {route}: {}", describe(&out));
            agent.wait_route(route, Duration::from_secs(10));
            let (sum1, count1) = apply_histogram(node);
            let (commit_sum1, commit_count1) = histogram(node, commit);
            // The first flips warm the agent and the kernel up; they are not counted.
            if i >= SWITCH_WARM_UP && count1 > count0 {
                applies_ms.push((sum1 - sum0) / (count1 - count0) * 1000.0);
                round_trips.push(round_trip);
            }
            if i >= SWITCH_WARM_UP && commit_count1 > commit_count0 {
                let per_commit = (commit_sum1 - commit_sum0) / (commit_count1 - commit_count0);
                commits_ms.push(per_commit * 1000.0);
                floors_ms.push(commit_floor(node, "once"));
            }
        }
        let out = node.cli(&["release", "--state-dir", &dir]);
        assert!(out.status.success(), "release: {}", describe(&out));
        // The floor of an nftables switch in the same namespace, the agent still running.
        let warm_floor = (dataplane == "nftables").then(|| commit_floor(node, "loop"));
        let floor = (!floors_ms.is_empty()).then(|| median(&mut floors_ms));
        let apply_median = median(&mut applies_ms);
        let commit_median = (!commits_ms.is_empty()).then(|| median(&mut commits_ms));
        let hundredths = |x: f64| (x * 100.0).round() / 100.0;
        stop_agent(node, agent);
        rows.push(json!({
            "dataplane": dataplane,
            "nat_rules": nat_rules,
            "commit_floor_once_median_ms": floor.map(hundredths),
            "commit_floor_warm_median_ms": warm_floor.map(hundredths),
            "commit_median_ms": commit_median.map(hundredths),
            "commits_counted": commits_ms.len(),
            "commit_to_floor": commit_median.zip(floor).map(|(c, f)| hundredths(c / f)),
            "apply_to_floor": floor.map(|f| hundredths(apply_median / f)),
            "flips": flips,
            "flips_counted": applies_ms.len(),
            "warm_up_flips": SWITCH_WARM_UP,
            "apply_mean_ms": round1(mean(&applies_ms)),
            "apply_median_ms": round1(apply_median),
            "flip_round_trip_median_ms": round1(median(&mut round_trips)),
        }));
    }
    rows
}

/// `iptables-restore` input: `services` kube-proxy-shaped Services of one endpoint each, 4 nat
/// rules per Service (KUBE-SERVICES match, SVC → SEP jump, SEP masquerade mark and DNAT), in
/// chains nothing jumps to (the simulated DNS traffic does not walk them).
fn kube_proxy_rules(services: u32) -> String {
    let mut s = String::from("*nat\n:KUBE-BENCH-SERVICES - [0:0]\n:KUBE-BENCH-MARK-MASQ - [0:0]\n");
    for i in 0..services {
        let _ = writeln!(s, ":KUBE-SVC-B{i:011} - [0:0]\n:KUBE-SEP-B{i:011} - [0:0]");
    }
    for i in 0..services {
        let (a, b) = (i / 250, i % 250 + 1);
        let svc = format!("bench/svc-{i}:http");
        let _ = writeln!(
            s,
            "-A KUBE-BENCH-SERVICES -d 10.100.{a}.{b}/32 -p tcp -m comment --comment \"{svc} cluster IP\" -m tcp --dport 80 -j KUBE-SVC-B{i:011}\n\
             -A KUBE-SVC-B{i:011} -m comment --comment \"{svc} -> 10.250.{a}.{b}:8080\" -j KUBE-SEP-B{i:011}\n\
             -A KUBE-SEP-B{i:011} -s 10.250.{a}.{b}/32 -m comment --comment {svc} -j KUBE-BENCH-MARK-MASQ\n\
             -A KUBE-SEP-B{i:011} -p tcp -m comment --comment {svc} -m tcp -j DNAT --to-destination 10.250.{a}.{b}:8080"
        );
    }
    s.push_str("COMMIT\n");
    s
}

fn load_nat_rules(node: &SimNode, services: u32, flavours: &[&str]) {
    let path = node.dir.join("kube-proxy-rules.txt");
    std::fs::write(&path, kube_proxy_rules(services)).expect("write rules");
    for &flavour in flavours {
        let t0 = Instant::now();
        let file = std::fs::File::open(&path).expect("rules file");
        let out = node
            .cmd("node", &format!("{flavour}-restore"))
            .arg("--noflush")
            .stdin(file)
            .output()
            .expect("iptables-restore");
        assert!(out.status.success(), "{flavour}-restore: {}", describe(&out));
        eprintln!("bench: {} nat rules loaded in {flavour} in {:?}", services * 4, t0.elapsed());
    }
}

/// A histogram's (sum, count) from the agent's /metrics.
fn histogram(node: &SimNode, name: &str) -> (f64, f64) {
    let (status, body) = node.http_get("/metrics");
    assert_eq!(status, 200, "/metrics");
    let value = |suffix: &str| {
        let key = format!("{name}_{suffix}");
        body.lines()
            .find_map(|l| {
                l.strip_prefix(key.as_str())?.strip_prefix(' ')?.trim().parse::<f64>().ok()
            })
            .unwrap_or(0.0)
    };
    (value("sum"), value("count"))
}

/// dnsperf's query file (`who.test A`), or None when dnsperf is not installed.
fn dnsperf_queries(node: &SimNode) -> Option<String> {
    if Command::new("dnsperf").arg("-h").output().is_err() {
        eprintln!("bench: dnsperf not installed, skipped");
        return None;
    }
    let queries = node.dir.join("dnsperf-queries.txt");
    std::fs::write(&queries, "who.test A\n").expect("query file");
    Some(queries.to_string_lossy().into_owned())
}

/// What one `dnsperf` run reports.
struct DnsperfRun {
    qps: f64,
    lost: u64,
    /// Mean time to an answer. With 200 queries outstanding, queries/s is at most 200 over it.
    latency_ms: f64,
}

/// One `dnsperf` run from pod1 to `server` for `secs` s (4 clients, 200 queries outstanding).
fn dnsperf_run(node: &SimNode, server: &str, queries: &str, secs: u32) -> DnsperfRun {
    dnsperf_run_on(node, server, queries, secs, None)
}

/// [`dnsperf_run`], on the CPUs `cpus` (a taskset list) if given.
fn dnsperf_run_on(
    node: &SimNode,
    server: &str,
    queries: &str,
    secs: u32,
    cpus: Option<&str>,
) -> DnsperfRun {
    let secs = secs.to_string();
    let args = ["-s", server, "-d", queries, "-l", &secs, "-c", "4", "-q", "200"];
    let out = match cpus {
        None => node.run("pod1", "dnsperf", &args),
        Some(cpus) => node.run("pod1", "taskset", &[&["-c", cpus, "dnsperf"][..], &args].concat()),
    };
    assert!(out.status.success(), "dnsperf: {}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| text.lines().find_map(|l| l.trim().strip_prefix(name));
    let first = |name: &str| field(name)?.split_whitespace().next();
    let qps = first("Queries per second:").and_then(|v| v.parse().ok());
    let lost = first("Queries lost:").and_then(|v| v.parse().ok());
    let latency = first("Average Latency (s):").and_then(|v| v.parse::<f64>().ok());
    match (qps, lost, latency) {
        (Some(qps), Some(lost), Some(s)) => DnsperfRun { qps, lost, latency_ms: s * 1000.0 },
        _ => panic!("dnsperf printed no rate, loss or latency:\n{text}"),
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Queries/s of `dnsperf` from a pod to the cluster-DNS IP (the cache answers, from local
/// data): node-cache's rules against the agent's (nftables, fast path), alternating, `rounds`
/// times `secs` s each. None when dnsperf is not installed.
fn dnsperf(node: &SimNode, rounds: u32, secs: u32) -> Option<Value> {
    let queries = dnsperf_queries(node)?;
    let measure = || -> f64 {
        assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), CACHE_ANSWER, "dnsperf: the cache answers");
        dnsperf_run(node, CLUSTER_DNS_IP, &queries, secs).qps
    };
    let (mut node_cache, mut agent_qps) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        eprintln!("bench: dnsperf, round {}", round + 1);
        node.script(&["node-cache-rules"]);
        node_cache.push(measure());
        node.script(&["node-cache-rules", "--remove"]);
        let agent = start_agent(node, &[]);
        agent_qps.push(measure());
        stop_agent(node, agent);
    }
    let (a, b) = (mean(&node_cache), mean(&agent_qps));
    Some(json!({
        "seconds_per_round": secs,
        "rounds": rounds,
        "node_cache_rules_qps": node_cache.iter().map(|q| q.round()).collect::<Vec<_>>(),
        "agent_nftables_qps": agent_qps.iter().map(|q| q.round()).collect::<Vec<_>>(),
        "agent_over_node_cache": (b / a * 1000.0).round() / 1000.0,
    }))
}

/// CPU time of `pid`, its children's included, in clock ticks (0 once it is gone).
fn ticks_of(pid: u32) -> u64 {
    cpu_ticks(pid).map_or(0, |(own, children)| own + children)
}

/// CPU time of this process's children that have been waited for, in clock ticks.
fn children_ticks() -> u64 {
    cpu_ticks(std::process::id()).map_or(0, |(_, children)| children)
}

/// Busy CPU time of the whole machine (all cores, anyone's), in clock ticks: /proc/stat's
/// `cpu` line, user, nice, system, irq and softirq (guest time is within user; idle, iowait and
/// the hypervisor's steal are not this machine's work).
fn machine_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let line = stat.lines().find(|l| l.starts_with("cpu ")).expect("/proc/stat's cpu line");
    let fields: Vec<u64> = line.split_whitespace().skip(1).map_while(|v| v.parse().ok()).collect();
    [0, 1, 2, 5, 6].iter().filter_map(|&i| fields.get(i)).sum()
}

// ---------------------------------------------------------------------------------------------
// Output.

fn ms(v: &Value) -> String {
    match v.as_f64() {
        None => "-".to_string(),
        Some(x) if x >= 1000.0 => format!("{:.2} s", x / 1000.0),
        Some(x) => format!("{x:.1} ms"),
    }
}

/// The failover table of the arrangements of `shape`; empty when none of them ran.
fn failover_table(results: &[ArrangementResult], shape: Shape) -> String {
    let results: Vec<&ArrangementResult> = results
        .iter()
        .filter(|r| r.arrangement.shape == shape && r.arrangement.pod.is_none())
        .collect();
    if results.is_empty() {
        return String::new();
    }
    let mut t = String::from(
        "| arrangement | fault | lookups failed | first attempts lost | fault-window latency p50 / p99 / max | fault → first good answer | recovery → back on cache |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in &results {
        if let Some(why) = &r.skipped {
            let _ = writeln!(t, "| {} | – | not measured: {why} | | | | |", r.arrangement.label);
        }
        for run in &r.runs {
            let f = run.figures();
            let w = &f["fault_window"];
            let share = f["cache_share_before_fault"].as_f64().unwrap_or(0.0);
            let back = match f["recovery_to_cache_ms"].as_f64() {
                _ if share < 0.99 => {
                    format!("– (the cache answered only {:.0} % before the fault)", share * 100.0)
                }
                Some(_) => ms(&f["recovery_to_cache_ms"]),
                None => format!("not within {}", ms(&f["observed_after_recovery_ms"])),
            };
            let _ = writeln!(
                t,
                "| {} | {} | {} of {} | {} | {} / {} / {} | {} | {} |",
                r.arrangement.label,
                run.fault.name(),
                f["failed"],
                f["sent"],
                match &f["first_attempt_lost"] {
                    Value::Null => "not visible".to_string(),
                    n => n.to_string(),
                },
                ms(&w["latency_ms_p50"]),
                ms(&w["latency_ms_p99"]),
                ms(&w["latency_ms_max"]),
                ms(&f["fault_to_first_good_answer_ms"]),
                back,
            );
        }
    }
    t
}

fn svg(
    path: &Path,
    results: &[ArrangementResult],
    rate: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    // The thesis's rows are a table of their own.
    let results: Vec<&ArrangementResult> =
        results.iter().filter(|r| !r.runs.is_empty() && r.arrangement.pod.is_none()).collect();
    let rows = results.len().max(1);
    let root = SVGBackend::new(path, (1400, 230 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.draw_text(
        &format!(
            "Pod lookups/s by when they ended ({rate}/s offered, 100 ms buckets; bursts clipped): answered by the cache (blue), by CoreDNS (green), failed (red). Fault at 0 s, recovery at 5 s."
        ),
        &("sans-serif", 16).into_text_style(&title),
        (10, 12),
    )?;
    let panels = body.split_evenly((rows, 2));
    let y_max = f64::from(rate) * 2.0;
    for (i, r) in results.iter().enumerate() {
        for (j, run) in r.runs.iter().enumerate() {
            let area = &panels[i * 2 + j];
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!(
                        "{}{} — {}",
                        if r.arrangement.shape == Shape::LinkLocal { "link-local: " } else { "" },
                        r.arrangement.label,
                        run.fault.name()
                    ),
                    ("sans-serif", 14),
                )
                .margin(6)
                .x_label_area_size(22)
                .y_label_area_size(44)
                .build_cartesian_2d(
                    -(PRE_MS as f64) / 1000.0..(FAULT_MS + POST_MS) as f64 / 1000.0,
                    0.0..y_max,
                )?;
            chart.configure_mesh().x_desc("s").y_desc("lookups/s").max_light_lines(0).draw()?;
            let tl = run.timeline();
            let series = [
                (BLUE, tl.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>()),
                (RGBColor(0, 150, 0), tl.iter().map(|p| (p.0, p.2)).collect()),
                (RED, tl.iter().map(|p| (p.0, p.3)).collect()),
            ];
            for (color, points) in series {
                let clipped = points.into_iter().map(|(t, v)| (t, v.min(y_max)));
                chart.draw_series(LineSeries::new(clipped, color.stroke_width(2)))?;
            }
        }
    }
    root.present()?;
    Ok(())
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    require_root();
    if let Ok(mode) = std::env::var(FLOOR_ENV) {
        return commit_floor_here(&mode);
    }
    let began = Instant::now();
    let rate: u32 = setting("NLHA_BENCH_RATE", 1000);
    let footprint_secs: u64 = setting("NLHA_BENCH_FOOTPRINT_SECS", 30);
    let footprint_rounds: u32 = setting("NLHA_BENCH_FOOTPRINT_ROUNDS", 2);
    let perf_rounds: u32 = setting("NLHA_BENCH_DNSPERF_ROUNDS", 2);
    let perf_secs: u32 = setting("NLHA_BENCH_DNSPERF_SECS", 5);
    let prefix = std::env::var("NLHA_BENCH_PREFIX")
        .unwrap_or_else(|_| format!("b{}", std::process::id() % 100_000));
    let out_dir = PathBuf::from(
        std::env::var("NLHA_BENCH_OUT")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/docs").into()),
    );
    std::fs::create_dir_all(&out_dir).expect("output dir");

    // For working on one part: NLHA_BENCH_PARTS=drift,switch (default: all). The parts:
    // failover (the ClusterIP shape), link-local (its failover arrangements), drift, footprint,
    // dnsperf, fallback-dnsperf (the link-local fallback against CoreDNS), hang-detection (the
    // stall watch against the probes alone), switch, busy, thesis (the webhook's table),
    // prefer-same-node (the real parts' node: the agent, and kube-dns with PreferSameNode),
    // real-node (the kubelet's node: node-local-dns rolled, the agent upgraded; idle CPU).
    let parts = std::env::var("NLHA_BENCH_PARTS").unwrap_or_else(|_| "all".into());
    let part = |name: &str| parts == "all" || parts.split(',').any(|p| p == name);

    let node = SimNode::up_prefixed(&prefix, &[]);
    let mut results = Vec::new();
    if part("failover") {
        results.extend(failover(&node, rate, Shape::ClusterIp));
    }
    if part("link-local") {
        results.extend(failover(&node, rate, Shape::LinkLocal));
    }
    if part("thesis") {
        results.extend(failover_of(&node, rate, thesis::ARRANGEMENTS.iter()));
    }
    if part("prefer-same-node") {
        let real = SimNode::up_prefixed(&format!("{prefix}p"), &["--kube-proxy", "real-iptables"]);
        results.extend(failover_of(&real, rate, prefer::ARRANGEMENTS.iter()));
    }
    let drift = if part("drift") { drift_repair(&node, 10) } else { json!([]) };
    let footprint = if part("footprint") {
        footprint::idle_cpu(&node, &prefix, footprint_secs, footprint_rounds)
    } else {
        json!({})
    };
    let perf = if part("dnsperf") { dnsperf(&node, perf_rounds, perf_secs) } else { None };
    let fallback_perf = if part("fallback-dnsperf") {
        fallback::dnsperf(&node, perf_rounds, perf_secs)
    } else {
        None
    };
    let hang = if part("hang-detection") { Some(stall::hang_detection(&node, rate)) } else { None };
    let mut switch = Vec::new();
    if part("switch") {
        switch = switch_latency(&node, &DATAPLANES, 20, 0);
        load_nat_rules(&node, 12_500, &["iptables-nft", "iptables-legacy"]);
        switch.extend(switch_latency(&node, &DATAPLANES, 20, 50_000));
    }
    drop(node);
    let (real_node, real_node_idle) = if part("real-node") {
        realnode::real_node(&format!("{prefix}k"), rate.min(200), footprint_secs, footprint_rounds)
    } else {
        (Vec::new(), json!({}))
    };
    let busy = if part("busy") {
        // The busy rows' agent logs, for reading after a surprising row: beside the build,
        // not among the figures.
        let logs = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/bench-logs"));
        std::fs::create_dir_all(&logs).expect("the agent logs' directory");
        busy::busy_node(&prefix, rate, 20, &logs)
    } else {
        Vec::new()
    };

    let Machine { date, cores, kernel } = Machine::this();
    let run_seconds = began.elapsed().as_secs_f64().round();

    let mut md = format!(
        "Benchmark of {date} ({cores}-core VM, kernel {}; `ci/bench.sh`, {run_seconds} s in \
         the benchmark itself). One simulated node; a pod client at {rate} lookups/s for {} s; \
         the fault comes at {} s and lasts {} s (kill: SIGKILL, then the cache is restarted; \
         hang: SIGSTOP, then SIGCONT).\n\n\
         * Clients. a–c: a glibc-like client (dnsload: one nameserver 10.96.0.10, timeout 5 s, \
         2 attempts: glibc's defaults, as in a pod's resolv.conf; a new socket, so a new source \
         port, per attempt). d: the C library's getaddrinfo with resolv.conf `nameserver \
         169.254.20.10` then `nameserver 10.96.0.10` and no NOTRACK rules on the node: glibc \
         (tries them in order) and musl (asks both at once, takes the first answer).\n\
         * c: the agent with the fast path, the socket-destroy events and the stall watch off: only its probes \
         see a kill or a hang, as a periodic watcher would.\n\
         * First attempts lost: lookups whose first try was not answered (glibc in d: answered \
         by the second nameserver; glibc in f and g: ended after its 5 s timeout; musl: not \
         visible). Latency: of the lookups started in the fault window, to their answer or to \
         giving up. Fault → first good answer: the first \
         answer in the first 100 ms (of start time) after the fault in which 90 % of lookups \
         were answered within 1 s. Recovery (restart answering, or SIGCONT) → back on cache: \
         to the first lookup after the last one (started after the recovery) not answered by \
         the cache.\n\
         * The link-local shape (e–g, second table): pods ask 169.254.20.10 itself (resolv.conf \
         `nameserver 169.254.20.10`): dnsload as in a–c but to that address, and glibc's \
         getaddrinfo, which sends a lookup's retry from the same socket (source port) as its \
         first attempt. e: node-cache and its static rules alone (here they change nothing). f: \
         kubespray's second DaemonSet: a second cache on the same IP and port, the two in one \
         SO_REUSEPORT group (the kernel hashes each query's source address and port to one of \
         them); the first is killed or hung, the second runs throughout. g: the agent without \
         `--cluster-dns-ip` at defaults: its forwarder answers through TPROXY (CoreDNS's \
         answers) when the cache's socket is gone or once the probes see the hang.\n\n",
        kernel,
        (PRE_MS + FAULT_MS + POST_MS) / 1000,
        PRE_MS / 1000,
        FAULT_MS / 1000,
    );
    md += &failover_table(&results, Shape::ClusterIp);
    let link_local = failover_table(&results, Shape::LinkLocal);
    if !link_local.is_empty() {
        md += "\nThe link-local shape (pods ask 169.254.20.10 itself):\n\n";
        md += &link_local;
    }
    md += &thesis::table(&results);
    md += "\n| dataplane | drift repair: flush → rules back, median (min–max) of 10 |\n|---|---|\n";
    for d in drift.as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} ({}–{}) |",
            d["dataplane"].as_str().unwrap_or("?"),
            ms(&d["median_ms"]),
            ms(&d["min_ms"]),
            ms(&d["max_ms"])
        );
    }
    md += "\n| dataplane | switch: the kernel's commit of the agent's batch, 0 / 50,000 kube-proxy-shaped nat rules (median of 20 flips after 2 warm-up) | the least nftables transaction's commit in the same namespace, once beside each flip, 0 / 50,000 | commit ÷ it, 0 / 50,000 | the least commit, 20 in a row, 0 / 50,000 | the agent's apply (commit and read-back), 0 / 50,000 | apply, 50,000 ÷ 0 | `flip` round trip, 0 / 50,000 |\n|---|---|---|---|---|---|---|---|\n";
    for dataplane in DATAPLANES {
        let find = |n: u64| {
            switch
                .iter()
                .find(|s| s["dataplane"] == dataplane && s["nat_rules"] == n)
                .cloned()
                .unwrap_or(Value::Null)
        };
        let (a, b) = (find(0), find(50_000));
        let ratio = match (a["apply_median_ms"].as_f64(), b["apply_median_ms"].as_f64()) {
            (Some(x), Some(y)) if x > 0.0 => format!("{:.1}×", y / x),
            _ => "-".into(),
        };
        let precise = |v: &Value| v.as_f64().map_or("-".into(), |f| format!("{f:.2} ms"));
        let to_floor =
            |s: &Value| s["commit_to_floor"].as_f64().map_or("-".into(), |r| format!("{r:.2}"));
        let _ = writeln!(
            md,
            "| {dataplane} | {} / {} | {} / {} | {} / {} | {} / {} | {} / {} | {ratio} | {} / {} |",
            precise(&a["commit_median_ms"]),
            precise(&b["commit_median_ms"]),
            precise(&a["commit_floor_once_median_ms"]),
            precise(&b["commit_floor_once_median_ms"]),
            to_floor(&a),
            to_floor(&b),
            precise(&a["commit_floor_warm_median_ms"]),
            precise(&b["commit_floor_warm_median_ms"]),
            ms(&a["apply_median_ms"]),
            ms(&b["apply_median_ms"]),
            ms(&a["flip_round_trip_median_ms"]),
            ms(&b["flip_round_trip_median_ms"])
        );
    }
    if let Some(p) = &perf {
        let list = |key: &str| {
            let values = p[key].as_array().into_iter().flatten();
            values
                .map(|v| format!("{:.0}", v.as_f64().unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            md,
            "\ndnsperf from a pod through {CLUSTER_DNS_IP} (the cache answers; {} rounds of {} s \
             each, alternating): node-cache's rules {} queries/s, the agent's (nftables, fast \
             path) {} queries/s: ratio {}.",
            p["rounds"],
            p["seconds_per_round"],
            list("node_cache_rules_qps"),
            list("agent_nftables_qps"),
            p["agent_over_node_cache"],
        );
    }
    if let Some(p) = &fallback_perf {
        md += &fallback::table(p);
    }
    if let Some(h) = &hang {
        md += &stall::table(h);
    }
    md += &footprint::table(&footprint);

    if !busy.is_empty() {
        md += &busy::table(&busy);
    }
    md += &realnode::table(&real_node, &real_node_idle);

    let failover_json: Vec<Value> = results
        .iter()
        .map(|r| {
            json!({
                "arrangement": r.arrangement.key,
                "label": r.arrangement.label,
                "shape": r.arrangement.shape.name(),
                "checked": r.checked,
                "skipped": r.skipped,
                "runs": r.runs.iter().map(FaultRun::figures).collect::<Vec<_>>(),
            })
        })
        .collect();
    let report = json!({
        "date": date,
        "machine": { "cores": cores, "kernel": kernel },
        "rate_per_s": rate,
        "windows_ms": { "before": PRE_MS, "fault": FAULT_MS, "after": POST_MS },
        "failover": failover_json,
        "drift_repair": drift,
        "switch_latency": switch,
        "footprint": footprint,
        "busy_node": busy,
        "real_node": { "operations": real_node, "idle": real_node_idle },
        "dnsperf": perf,
        "dnsperf_link_local_fallback": fallback_perf,
        "hang_detection": hang,
        "run_seconds": run_seconds,
    });
    std::fs::write(
        out_dir.join("bench.json"),
        serde_json::to_string_pretty(&report).expect("json") + "\n",
    )
    .expect("write bench.json");
    std::fs::write(out_dir.join("bench.md"), &md).expect("write bench.md");
    if let Err(e) = svg(&out_dir.join("failover.svg"), &results, rate) {
        eprintln!("bench: drawing failover.svg failed: {e}");
    }
    println!("{md}");
}
