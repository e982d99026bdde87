//! Hang detection (issue 14), side by side in one run: a hung cache (SIGSTOP) under a pod's
//! lookups, left by the stall watch (defaults) or by the probes alone (`--stall-bound 0s`),
//! trial after trial, alternating; then two runs in which a stall switch would be a false one:
//! dnsperf saturating a healthy cache, and a cache paused 15 ms every 101 ms (a CPU-throttled
//! one). `NLHA_BENCH_STALL_TRIALS` (default 10) and `NLHA_BENCH_STALL_SECS` (of each of the two
//! runs, default 60) set their lengths.

use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use testkit::{
    dnsload_exe, median, now_ms, percentile, read_lookups, setting, sleep_until_ms, summary_of,
    Agent, Outcome, Proc, SimNode, CACHE_ANSWER, CLUSTER_DNS_IP, COREDNS_ANSWER,
};

use super::{
    dnsperf_queries, dnsperf_run, round1, start_agent, stop_agent, Client, Fault, FaultRun,
};

/// Load before the hang, the hang, and the load's whole length. The hang outlasts the client's
/// 5 s attempt timeout, so a query the hung cache holds is a lost first attempt, as in a real
/// hang (a shorter one would answer it late instead); a trial ends some 12 s after it starts.
const PRE_MS: u64 = 1_000;
const HANG_MS: u64 = 5_500;
const LOAD_MS: u64 = 7_000;

const VARIANTS: [(&str, &[&str]); 2] =
    [("stall-watch", &[]), ("probes-only", &["--stall-bound", "0s"])];

/// The agent's route changes so far.
fn transitions(agent: &Agent) -> u64 {
    agent.state().expect("state")["transitions"].as_u64().unwrap_or(0)
}

/// Confirm probes the stall watch has sent so far, by its debug log.
fn confirm_probes(agent: &Agent) -> usize {
    agent.log_text().lines().filter(|l| l.contains("stall watch: confirm probe")).count()
}

/// One trial: a pod's glibc-like client (timeout 5 s, 2 attempts) at `rate` lookups/s to the
/// cluster-DNS IP, the cache hung for [`HANG_MS`] after [`PRE_MS`] + `phase_ms`.
/// Also returns when the agent's route moved, in ms after the signal.
fn hang_trial(
    node: &SimNode,
    agent: &Agent,
    rate: u32,
    n: usize,
    phase_ms: u64,
) -> (FaultRun, Option<u64>) {
    let out_dir = node.dir.join("load");
    std::fs::create_dir_all(&out_dir).expect("load dir");
    let lookups_path = out_dir.join(format!("lookups-stall-{n}.txt"));
    let stdout_path = out_dir.join(format!("stdout-stall-{n}.txt"));
    let mut cmd = node.cmd("pod1", dnsload_exe());
    cmd.args(["--server", CLUSTER_DNS_IP, "--timeout", "5s", "--attempts", "2"])
        .args(["--name", "who.test", "--rate", &rate.to_string()])
        .args(["--duration", &format!("{LOAD_MS}ms"), "--report-interval", "0"])
        .args(["--origin", &format!("{CACHE_ANSWER}=cache")])
        .args(["--origin", &format!("{COREDNS_ANSWER}=coredns")])
        .arg("--lookups-out")
        .arg(&lookups_path)
        .stdout(std::fs::File::create(&stdout_path).expect("stdout file"))
        .stderr(Stdio::inherit());
    let load = Proc::spawn(&mut cmd);
    sleep_until_ms(now_ms() + PRE_MS + phase_ms);
    let fault_at = node.signal("cache-stop");
    let up = agent.wait_route("upstream", Duration::from_secs(5));
    let switch_ms = up["since_unix_ms"].as_u64().map(|at| at.saturating_sub(fault_at));
    sleep_until_ms(fault_at + HANG_MS);
    let recovered_at = node.signal("cache-cont");
    let status = load.wait();
    assert!(status.success(), "dnsload failed: {status}");
    let stdout = std::fs::read_to_string(&stdout_path).expect("dnsload stdout");
    let summary = summary_of(stdout.lines());
    let lookups = read_lookups(&lookups_path, &summary);
    let (client, two_nameservers) = (Client::Dnsload, false);
    let fault = Fault::Hang;
    let endpoint_changes = None;
    let run = FaultRun {
        fault,
        fault_at,
        recovered_at,
        lookups,
        summary,
        client,
        two_nameservers,
        endpoint_changes,
    };
    (run, switch_ms)
}

/// Fault → first good answer: the first answer from CoreDNS to a lookup sent after the fault
/// (ms). (The failover table's measure works in 100 ms buckets of start time, too coarse here.)
fn first_coredns_answer_ms(run: &FaultRun) -> Option<f64> {
    let fault = run.fault_at as f64;
    run.lookups
        .iter()
        .filter(|l| l.start >= fault && l.outcome == Outcome::CoreDns)
        .map(|l| l.start + f64::from(l.latency) - fault)
        .min_by(f64::total_cmp)
}

/// Waits (bounded) for the agent's route to be `route`.
fn settle(agent: &Agent, route: &str) {
    agent.wait_route(route, Duration::from_secs(30));
}

pub(super) fn hang_detection(node: &SimNode, rate: u32) -> Value {
    let trials: usize = setting("NLHA_BENCH_STALL_TRIALS", 10);
    let secs: u32 = setting("NLHA_BENCH_STALL_SECS", 60);
    let mut rows: Vec<Value> =
        VARIANTS.iter().map(|(key, _)| json!({ "variant": key, "trials": [] })).collect();
    for trial in 0..trials {
        // The agent looks on a 20 ms grid counted from its start; a hang at a fixed time after
        // that start would meet the same point of the grid in every trial (up to 20 ms of
        // difference in every figure). Spread over one step, the trials meet every point of it.
        let phase_ms = (trial * 20 / trials) as u64;
        for (i, (key, flags)) in VARIANTS.iter().enumerate() {
            eprintln!("bench: hang detection, trial {}, {key}", trial + 1);
            let agent = start_agent(node, flags);
            let n = trial * VARIANTS.len() + i;
            let (run, switch_ms) = hang_trial(node, &agent, rate, n, phase_ms);
            settle(&agent, "local");
            let stalled = agent.log_text().contains("cache socket stalled");
            let row = json!({
                "first_good_answer_ms": first_coredns_answer_ms(&run).map(round1),
                "switch_ms": switch_ms,
                "first_attempts_lost": run.first_attempts_lost(),
                "failed": run.summary["failed"],
                "switched_by_stall": stalled,
            });
            eprintln!("bench:   {row}");
            rows[i]["trials"].as_array_mut().expect("trials").push(row);
            stop_agent(node, agent);
        }
    }
    for row in &mut rows {
        let trials = row["trials"].as_array().expect("trials").clone();
        let mut good: Vec<f64> =
            trials.iter().filter_map(|t| t["first_good_answer_ms"].as_f64()).collect();
        let mut lost: Vec<f64> =
            trials.iter().filter_map(|t| t["first_attempts_lost"].as_f64()).collect();
        good.sort_by(f64::total_cmp);
        row["first_good_answer_ms_median"] = json!(round1(median(&mut good.clone())));
        row["first_good_answer_ms_p90"] = json!(round1(percentile(&good, 90.0)));
        row["first_attempts_lost_median"] = json!(median(&mut lost));
        let mut switch: Vec<f64> = trials.iter().filter_map(|t| t["switch_ms"].as_f64()).collect();
        switch.sort_by(f64::total_cmp);
        row["switch_ms_median"] = json!(median(&mut switch.clone()));
        row["switch_ms_p90"] = json!(percentile(&switch, 90.0));
        row["failed_total"] =
            json!(trials.iter().filter_map(|t| t["failed"].as_u64()).sum::<u64>());
    }
    let lost_ratio = match (
        rows[0]["first_attempts_lost_median"].as_f64(),
        rows[1]["first_attempts_lost_median"].as_f64(),
    ) {
        // Three places, divided last: 13.7 / 100 prints as 0.13699999999999998.
        (Some(watch), Some(probes)) if probes > 0.0 => {
            Some((1000.0 * watch / probes).round() / 1000.0)
        }
        _ => None,
    };

    // A healthy cache saturated by dnsperf: queries always wait in its socket.
    let saturation = dnsperf_queries(node).map(|queries| {
        eprintln!("bench: hang detection, dnsperf saturation for {secs} s");
        let agent = start_agent(node, &[]);
        let run = dnsperf_run(node, CLUSTER_DNS_IP, &queries, secs);
        let row = json!({
            "seconds": secs,
            "qps": run.qps.round(),
            "lost": run.lost,
            "route_changes": transitions(&agent),
            "confirm_probes": confirm_probes(&agent),
        });
        eprintln!("bench:   {row}");
        stop_agent(node, agent);
        row
    });

    // Paused 15 ms every 101 ms, at `rate` lookups/s. Not every 100: a cycle that is a
    // multiple of the agent's 20 ms looks meets them at the same point of each pause (seen: no
    // pause ever reached a confirm probe in 600); drifting 1 ms a cycle, the pauses meet every
    // point of the looks every 20 cycles.
    eprintln!("bench: hang detection, 15 ms pauses every 101 ms for {secs} s");
    let agent = start_agent(node, &[]);
    let mut cmd = node.cmd("pod1", dnsload_exe());
    cmd.args(["--server", CLUSTER_DNS_IP, "--timeout", "5s", "--attempts", "2"])
        .args(["--name", "who.test", "--rate", &rate.to_string()])
        .args(["--duration", &format!("{secs}s"), "--report-interval", "0"])
        .args(["--origin", &format!("{CACHE_ANSWER}=cache")])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let load = Proc::spawn(&mut cmd);
    let pid: i32 = node.script(&["cache-pid"]).trim().parse().expect("the cache's pid");
    let cache = Pid::from_raw(pid);
    let (mut pauses, mut longest) = (0u32, Duration::ZERO);
    let end = Instant::now() + Duration::from_secs(u64::from(secs));
    let mut next = Instant::now();
    while next < end {
        kill(cache, Signal::SIGSTOP).expect("SIGSTOP the cache");
        let stopped = Instant::now();
        std::thread::sleep(Duration::from_millis(15));
        kill(cache, Signal::SIGCONT).expect("SIGCONT the cache");
        longest = longest.max(stopped.elapsed());
        pauses += 1;
        next += Duration::from_millis(101);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let output = load.into_child().wait_with_output().expect("dnsload's output");
    let summary = summary_of(String::from_utf8_lossy(&output.stdout).lines());
    let pulses = json!({
        "seconds": secs,
        "pauses": pauses,
        "longest_pause_ms": round1(longest.as_secs_f64() * 1000.0),
        "route_changes": transitions(&agent),
        "confirm_probes": confirm_probes(&agent),
        "lookups_failed": summary["failed"],
        "first_attempts_lost": summary["first_attempt_lost"],
    });
    eprintln!("bench:   {pulses}");
    stop_agent(node, agent);

    json!({
        "rate_per_s": rate,
        "hang_ms": HANG_MS,
        "variants": rows,
        "first_attempts_lost_watch_over_probes": lost_ratio,
        "saturation": saturation,
        "pulses": pulses,
    })
}

/// The report's paragraph and table for [`hang_detection`]'s figures.
pub(super) fn table(h: &Value) -> String {
    let trials = h["variants"][0]["trials"].as_array().map_or(0, Vec::len);
    let mut md = format!(
        "\nHang detection: a pod's glibc-like client at {} lookups/s to \
         {CLUSTER_DNS_IP}, the cache hung (SIGSTOP) for {} ms; {trials} trials per agent, \
         alternating, the agent restarted for each.\n\n\
         | agent | fault → route change, median (p90) | fault → first good answer (CoreDNS), \
         median (p90) | first attempts lost, median | failed | trials switched by the stall \
         watch |\n|---|---|---|---|---|---|\n",
        h["rate_per_s"], h["hang_ms"],
    );
    for v in h["variants"].as_array().into_iter().flatten() {
        let label = match v["variant"].as_str() {
            Some("stall-watch") => "stall watch (defaults: bound 30 ms, look 20 ms)",
            _ => "probes only (`--stall-bound 0s`: fall 3 × 100 ms, timeout 80 ms)",
        };
        let runs = v["trials"].as_array().into_iter().flatten();
        let stalled = runs.filter(|t| t["switched_by_stall"] == true).count();
        md += &format!(
            "| {label} | {} ms ({} ms) | {} ms ({} ms) | {} | {} | {stalled} of {trials} |\n",
            v["switch_ms_median"],
            v["switch_ms_p90"],
            v["first_good_answer_ms_median"],
            v["first_good_answer_ms_p90"],
            v["first_attempts_lost_median"],
            v["failed_total"],
        );
    }
    md += &format!(
        "\nFirst attempts lost, stall watch over probes only: {} (the target: at most 0.2).",
        h["first_attempts_lost_watch_over_probes"]
    );
    let s = &h["saturation"];
    if s.is_object() {
        md += &format!(
            " A healthy cache saturated by dnsperf for {} s ({} queries/s, {} lost): {} route \
             changes, {} confirm probes sent.",
            s["seconds"], s["qps"], s["lost"], s["route_changes"], s["confirm_probes"],
        );
    }
    let p = &h["pulses"];
    md += &format!(
        " The cache paused 15 ms every 101 ms for {} s ({} pauses, the longest {} ms) at {} \
         lookups/s: {} route changes, {} confirm probes sent, {} lookups failed, {} first \
         attempts lost.\n",
        p["seconds"],
        p["pauses"],
        p["longest_pause_ms"],
        h["rate_per_s"],
        p["route_changes"],
        p["confirm_probes"],
        p["lookups_failed"],
        p["first_attempts_lost"],
    );
    md
}
