//! End to end, the stall watch (issue 14): the cache's UDP sockets looked at through sock_diag,
//! a hang seen as a queue that stops draining while a confirm probe goes unanswered. Under
//! traffic it moves the route before the probes' `fall`-th failure in every cell of
//! `tests/e2e_matrix.rs` (kill and hang, every backend and kube-proxy mode, both families);
//! here what those cells do not look at: a hang with no traffic, pauses below the bound, and
//! what the agent says of a stall. Each test makes its own namespaces and removes them.

use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use testkit::*;

/// What the watch logs when it goes to its quiet pace (a node without DNS traffic), and back.
const QUIET: &str = "stall watch: looking traffic=false";
const TRAFFIC: &str = "stall watch: looking traffic=true";
/// What the agent logs when its fast cadences go to the quiet pace, and back.
const PACE_QUIET: &str = "quiet pace quiet=true";
const PACE_FAST: &str = "quiet pace quiet=false";

/// Whether the agent logged `line` after `mark` (from [`Agent::log_mark`]).
fn said(agent: &Agent, line: &str, mark: usize) -> Option<()> {
    agent.log_text().get(mark..).is_some_and(|since| since.contains(line)).then_some(())
}

/// A hang with no client traffic: the probes' own queries wait unread in the hung cache's
/// socket, so the stall watch still sees it before the probes' `fall`-th failure (acceptance 2:
/// within `fall × interval + timeout`, by the agent's counts). The change says why, with the
/// evidence, in the log, in `status` and in `/metrics`.
#[test]
fn a_hang_without_traffic_is_seen_within_the_probe_bound() {
    let node = SimNode::up();
    let agent = node.agent(&["--interval", "100ms", "--timeout", "80ms"]);
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), CACHE_ANSWER);
    // Only the agent's own datagrams on the node's counters: the watch looks at its quiet pace,
    // the probes go once a second, and the hang is still seen first by the watch.
    wait_for("the quiet pace", Duration::from_secs(5), || said(&agent, QUIET, 0));
    wait_for("the probes' quiet pace", Duration::from_secs(10), || said(&agent, PACE_QUIET, 0));
    let mark = agent.log_mark();
    node.signal("cache-stop");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        agent.switch_after(mark, "upstream", "cache udp")
    });
    println!("{}", switch.line);
    switch.assert_stalled();
    let reason = up["reason"].as_str().expect("a reason");
    assert!(reason.contains("stopped reading") && reason.contains("bytes of queries"), "{up}");
    let log = agent.log_text();
    let evidence = log.lines().find(|l| l.contains("cache socket stalled")).expect("evidence");
    assert!(evidence.contains("queued_bytes=") && evidence.contains("not_draining_ms="), "{log}");
    let (status, metrics) = node.http_get("/metrics");
    assert_eq!(status, 200);
    let stalled = "reason=\"cache_stalled\"";
    assert!(metrics.lines().any(|l| l.contains(stalled) && l.ends_with(" 1")), "{metrics}");
    assert!(metrics.contains("outcome=\"stalled\""), "{metrics}");
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER);
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    node.tear_down(agent);
}

/// A cache paused for less than the bound (a CPU-throttled process) is never taken for stalled,
/// though pods' queries pile up in its socket: each pause is long enough for a confirm probe
/// (the bound 90 ms, so a probe after 30 ms of queue), and the probe is answered when the pause
/// ends. 40 pauses of 40 ms at 500 lookups/s: no route change, the probes answered, no lookup
/// failed. (With a bound far above the pauses, a test machine's scheduling cannot lengthen one
/// past it.)
#[test]
fn pauses_below_the_bound_are_not_stalls() {
    let node = SimNode::up();
    let agent = node.agent(&["--interval", "100ms", "--timeout", "80ms", "--stall-bound", "90ms"]);
    wait_for("the quiet pace", Duration::from_secs(5), || said(&agent, QUIET, 0));
    let mark = agent.log_mark();
    let args = ["--rate", "500", "--duration", "30s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    pod.wait_cache_answers();
    // The pods' queries show on the node's counters: back to the faster pace.
    wait_for("the traffic pace", Duration::from_secs(5), || said(&agent, TRAFFIC, mark));
    let pid = node.script(&["cache-pid"]).trim().parse().expect("the cache's pid");
    let cache = Pid::from_raw(pid);
    let mut longest = Duration::ZERO;
    for _ in 0..40 {
        kill(cache, Signal::SIGSTOP).expect("SIGSTOP the cache");
        let stopped = Instant::now();
        std::thread::sleep(Duration::from_millis(40));
        kill(cache, Signal::SIGCONT).expect("SIGCONT the cache");
        longest = longest.max(stopped.elapsed());
        // A cycle of 97 ms, no multiple of the watch's 20 ms looks: the pauses begin at every
        // phase of them (a pause that begins just after a look is seen 20 ms late, too late to
        // reach a confirm probe).
        std::thread::sleep(Duration::from_millis(57));
    }
    println!("longest pause: {longest:?}");
    let summary = pod.interrupt();
    println!("pod: {summary}");
    let st = agent.state().expect("state");
    assert_eq!(st["transitions"], 0, "a pause was taken for a stall: {st}");
    assert_eq!(st["route"], "local", "{st}");
    let log = agent.log_text();
    let answered = log.lines().filter(|l| l.contains("confirm probe answered=true")).count();
    println!("confirm probes answered: {answered}");
    assert!(answered > 0, "no pause reached a confirm probe, so nothing was tested:\n{log}");
    assert!(!log.contains("answered=false"), "a confirm probe went unanswered:\n{log}");
    assert_eq!(summary["failed"], 0, "{summary}");
    node.tear_down(agent);
}

/// kubespray's second cache: two sockets on each address (SO_REUSEPORT), which one exact request
/// cannot tell apart (it sees the member the kernel's hash picks). The watch leaves them to the
/// probes and says so; once the second cache is gone, the socket left is watched again and a
/// hang under traffic is a stall.
#[test]
fn a_reuseport_group_is_left_to_the_probes_until_it_is_one_socket() {
    let node = SimNode::up();
    node.script(&["cache2-start"]);
    let agent = node.agent(&["--interval", "100ms", "--timeout", "80ms"]);
    let said = |needle: &str| agent.log_text().contains(needle).then_some(());
    wait_for("the reuseport note", Duration::from_secs(5), || {
        said("several sockets share this address")
    });
    let mark = agent.log_mark();
    node.kill("cache2-kill");
    wait_for("the single sockets watched", Duration::from_secs(5), || {
        let since = agent.log_text().get(mark..).map(str::to_owned).unwrap_or_default();
        // The latest: each closed socket is announced on its own, so a first look may name
        // one address only.
        let watching = since.lines().rev().find(|l| l.contains("stall watch: watching"))?;
        (watching.contains("169.254.20.10:53") && watching.contains("10.96.0.10:53")).then_some(())
    });
    let args = ["--rate", "300", "--duration", "10s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    pod.wait_cache_answers();
    let mark = agent.log_mark();
    node.signal("cache-stop");
    agent.wait_route("upstream", Duration::from_secs(5));
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        agent.switch_after(mark, "upstream", "cache udp")
    });
    switch.assert_stalled();
    node.signal("cache-cont");
    agent.wait_route("local", Duration::from_secs(10));
    let summary = pod.interrupt();
    assert_eq!(summary["failed"], 0, "{summary}");
    node.tear_down(agent);
}

/// The cache UDP probes' sent count and the upstream's, from the state file.
fn probes_sent(agent: &Agent) -> (u64, u64) {
    let st = agent.state().expect("state");
    let sent = |stream: &str| st["probes"][stream]["sent"].as_u64().expect("sent");
    (sent("cache_udp"), sent("upstream"))
}

/// How many cache UDP probes went out while the upstream's probe (once a second whatever the
/// pace) went `n` times: the agent's own clock, not the test's.
fn cache_probes_per_upstream(agent: &Agent, n: u64) -> u64 {
    let (cache0, upstream0) = probes_sent(agent);
    let (cache1, _) = wait_for(&format!("{n} upstream probes"), Duration::from_secs(30), || {
        let (cache, upstream) = probes_sent(agent);
        (upstream >= upstream0 + n).then_some((cache, upstream))
    });
    cache1 - cache0
}

/// The quiet pace, at the defaults: on a healthy node without DNS traffic the cache probe goes
/// once a second (as the upstream's does), not every 100 ms; pods' queries bring it back to
/// every 100 ms, and once they stop it goes quiet again. A kill there is still seen at once
/// (the kernel's socket-destroy events; the switch is by a refusal, not a count of timeouts).
#[test]
fn the_probes_go_quiet_on_an_idle_healthy_node_and_fast_under_traffic() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    wait_for("the quiet pace", Duration::from_secs(10), || said(&agent, PACE_QUIET, 0));
    let quiet = cache_probes_per_upstream(&agent, 6);
    println!("quiet: {quiet} cache probes for 6 upstream probes");
    assert!(quiet <= 6 + 2, "the cache probe did not slow down: {quiet} for 6 upstream probes");

    let mark = agent.log_mark();
    let args = ["--rate", "200", "--duration", "60s", "--report-interval", "100ms"];
    let mut pod = node.load("pod1", CLUSTER_DNS_IP, &args);
    pod.wait_cache_answers();
    wait_for("the fast pace", Duration::from_secs(10), || said(&agent, PACE_FAST, mark));
    let fast = cache_probes_per_upstream(&agent, 3);
    println!("under traffic: {fast} cache probes for 3 upstream probes");
    assert!(fast >= 3 * 5, "the cache probe stayed slow under traffic: {fast} for 3 upstream");
    let summary = pod.interrupt();
    assert_eq!(summary["failed"], 0, "{summary}");

    let mark = agent.log_mark();
    wait_for("quiet again", Duration::from_secs(10), || said(&agent, PACE_QUIET, mark));
    let mark = agent.log_mark();
    node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    let switch = wait_for("the switch in the log", Duration::from_secs(5), || {
        let log = agent.log_text();
        let since = log.get(mark..)?;
        let line =
            since.lines().find(|l| l.contains("route changed") && l.contains(" to=upstream "));
        line.map(str::to_owned)
    });
    println!("{switch}");
    assert!(switch.contains("probe refused"), "not seen at once by a refusal: {switch}");
    node.tear_down(agent);
}
