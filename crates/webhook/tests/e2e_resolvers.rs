//! The webhook's safety net as real resolvers meet it: the resolv.conf
//! kubelet writes for a mutated pod (the mutation's `dnsConfig`, in the runtime's format) in the
//! pod's namespace, read by glibc's getaddrinfo (`dnsload --system-resolver`) and musl's
//! (`testdata/resolver-load.c`), on the simulated node in the link-local shape.
//!
//! * With the agent running: across a cache SIGKILL and a hang no lookup fails, and a lookup
//!   pays a resolver timeout (1 s, `options timeout:1`) only if it was sent to the cache as it
//!   died or while it hung, before the agent switched (the agent's failover alone decides).
//! * With the agent gone as well (SIGKILL, its rules left as they were): no lookup fails,
//!   the second nameserver answering; what that costs is printed (the benchmark has the table).
//!
//! The clients look up `who.test.` (absolute): the stand-in servers answer no cluster names,
//! so the search list is written but not walked.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodSpec};
use nodelocaldns_ha_webhook::mutate::{self, Settings};
use serde_json::Value;
use testkit::{
    musl_client, read_lookups, summary_of, Agent, Load, Lookup, NetnsEtc, Proc, SimNode,
    CLUSTER_DNS_IP, LOCAL_IP, UPSTREAM_IP,
};

/// The resolvers' attempt timeout (`options timeout:1`, ACK's).
const TIMEOUT_MS: f32 = 1000.0;
/// Each phase's clients run this long; the phase ends within it.
const PHASE: Duration = Duration::from_secs(9);
const RATE: &str = "40";

/// The resolv.conf of a pod the webhook mutated in namespace `shop`.
fn mutated_resolv_conf() -> String {
    let settings = Settings::ack(&[LOCAL_IP, CLUSTER_DNS_IP]);
    let pod = Pod { spec: Some(PodSpec::default()), ..Pod::default() };
    let mutation = mutate::mutate(&pod, "shop", &settings).expect("mutated");
    mutate::resolv_conf(&mutation.dns_config)
}

/// One phase's clients: glibc (with a timeline to wait on) and musl.
struct Clients {
    glibc: Load,
    musl: Proc,
    musl_stdout: std::path::PathBuf,
    musl_lookups: std::path::PathBuf,
}

impl Clients {
    fn start(node: &SimNode, phase: &str) -> Clients {
        let secs = format!("{}s", PHASE.as_secs());
        let glibc = node.system_load(
            "pod1",
            "who.test.",
            &["--rate", RATE, "--duration", &secs, "--report-interval", "100ms"],
        );
        let musl_stdout = node.dir.join(format!("musl-{phase}.out"));
        let musl_lookups = node.dir.join(format!("musl-{phase}.lookups"));
        let mut cmd = node.cmd("pod1", musl_client());
        cmd.args([RATE, &PHASE.as_millis().to_string(), "who.test."]).arg(&musl_lookups);
        cmd.stdout(std::fs::File::create(&musl_stdout).unwrap());
        let musl = Proc::spawn(&mut cmd);
        Clients { glibc, musl, musl_stdout, musl_lookups }
    }

    /// Both clients' summaries and lookups, once they are done.
    fn finish(self) -> [(&'static str, Value, Vec<Lookup>); 2] {
        let glibc = self.glibc.finish_recorded();
        assert!(self.musl.wait().success(), "the musl client failed");
        let text = std::fs::read_to_string(&self.musl_stdout).unwrap();
        let summary = summary_of(text.lines());
        let lookups = read_lookups(&self.musl_lookups, &summary);
        [("glibc", glibc.0, glibc.1), ("musl", summary, lookups)]
    }
}

/// Asserts that no lookup failed and that every lookup that paid a timeout was sent within
/// `from..=to` (ms since the epoch); prints what the fault cost.
fn assert_lookups(phase: &str, clients: Clients, from: u64, to: u64) {
    for (client, summary, lookups) in clients.finish() {
        let slow: Vec<&Lookup> = lookups.iter().filter(|l| l.latency >= TIMEOUT_MS).collect();
        let max = lookups.iter().map(|l| l.latency).fold(0.0, f32::max);
        println!(
            "{phase}, {client}: {} lookups, {} failed, {} paid a timeout, slowest {max:.0} ms",
            lookups.len(),
            summary["failed"],
            slow.len()
        );
        assert!(lookups.len() > 100, "{phase}, {client}: {summary}");
        assert_eq!(summary["failed"], 0, "{phase}, {client}: {summary}");
        assert_eq!(summary["unfinished"].as_u64().unwrap_or(0), 0, "{phase}, {client}: {summary}");
        for l in slow {
            let sent = l.start as u64;
            assert!(
                (from..=to).contains(&sent),
                "{phase}, {client}: a lookup sent at {sent} paid a timeout ({} ms) outside {from}..={to}",
                l.latency
            );
        }
    }
}

/// When the agent last changed its route (its state's `since_unix_ms`), once it is on `route`.
fn switched(agent: &Agent, route: &str) -> u64 {
    let state = agent.wait_route(route, Duration::from_secs(10));
    state["since_unix_ms"].as_u64().expect("since_unix_ms")
}

#[test]
fn a_mutated_pods_resolvers_lose_nothing_with_the_agent_and_without_it() {
    testkit::require_root();
    let node = SimNode::up_with(&["--kube-proxy", "nftables"]);
    let mut agent = node.agent_for(LOCAL_IP, "", UPSTREAM_IP, &[]);
    let text = mutated_resolv_conf();
    println!("the pod's resolv.conf:\n{text}");
    let _etc = NetnsEtc::resolv_conf(&node.ns("pod1"), &text);
    let seen = node.run("pod1", "cat", &["/etc/resolv.conf"]);
    assert_eq!(String::from_utf8_lossy(&seen.stdout), text, "the pod's resolv.conf");

    // A SIGKILL: only what the dying cache had taken may pay a timeout.
    let mut clients = Clients::start(&node, "kill");
    clients.glibc.wait_alone("cache");
    let (killed_at, gone_at) = node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    clients.glibc.wait_alone("cache");
    assert_lookups("SIGKILL", clients, killed_at - TIMEOUT_MS as u64, gone_at);

    // A hang: what was sent to the hung cache before the agent switched may pay one.
    let mut clients = Clients::start(&node, "hang");
    clients.glibc.wait_alone("cache");
    let stopped_at = node.signal("cache-stop");
    let upstream_at = switched(&agent, "upstream");
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    clients.glibc.wait_alone("cache");
    assert_lookups("hang", clients, stopped_at - TIMEOUT_MS as u64, upstream_at);

    // The agent gone too (its rules stay, on Local): the second nameserver answers, a cache
    // SIGKILL and a hang cost what the resolvers make them cost, and nothing fails.
    agent.stop(nix::sys::signal::Signal::SIGKILL);
    let mut clients = Clients::start(&node, "agent-gone-kill");
    clients.glibc.wait_alone("cache");
    let (killed_at, _) = node.kill("cache-kill");
    clients.glibc.wait_alone("coredns");
    assert_lookups("no agent, SIGKILL", clients, killed_at - TIMEOUT_MS as u64, u64::MAX);
    node.script(&["cache-start"]);
    let mut clients = Clients::start(&node, "agent-gone-hang");
    clients.glibc.wait_alone("cache");
    let stopped_at = node.signal("cache-stop");
    clients.glibc.wait_alone("coredns");
    node.signal("cache-cont");
    assert_lookups("no agent, hang", clients, stopped_at - TIMEOUT_MS as u64, u64::MAX);
    drop(node);
}
