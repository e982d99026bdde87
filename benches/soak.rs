//! `cargo bench --bench soak` (as root; `ci/soak.sh` installs what it needs and runs it): the
//! agent under steady pod load for a long time while its cache is stopped and started again
//! over and over. It checks the soak's three claims — no lookup lost, the agent's RSS flat, no
//! file-descriptor growth — and prints the figures behind them.
//!
//! One simulated node (`testdata/simnode.sh`, namespaces `$PREFIX-*`, PREFIX from `SOAK_PREFIX`
//! or `s<pid>`), the agent (the release build `cargo bench` makes; default timings, log level
//! info) and `dnsload` in pod1 asking the kube-dns ClusterIP with glibc's defaults for a pod
//! (one nameserver, timeout 5 s, 2 attempts). Every restart period the cache is stopped — by
//! SIGKILL and SIGTERM in turn (`SOAK_SIGNALS`): SIGKILL is a crash or an OOM kill, SIGTERM the
//! kubelet stopping the container (unbound closes its sockets and exits; the listen addresses
//! stay, unlike in node-cache's own teardown) — and, once the agent has switched to
//! `Upstream`, started again after `SOAK_DOWN_SECS`. Each restart waits for the agent to go to
//! `Upstream` and back to `Local`; a restart that does not is a failure.
//!
//! The agent's RSS, file descriptors, threads and CPU time (and, as they cost nothing, dnsload's
//! and the cache's) are read from `/proc` every `SOAK_SAMPLE_SECS`. Warm-up ends when the first
//! restart is over (the agent is back on `Local`: every code path has run once), or after
//! min(60 s, a quarter of the run) without restarts. From then on:
//! * RSS is **flat** when the end value is at most [`RSS_FLAT_KIB`] above the start value;
//! * file descriptors are **flat** when the end value is not above the start value;
//!
//! where start and end are the lowest of the first and of the last three samples (30 s by
//! default), so a probe socket that happens to be open at one sample is not growth.
//!
//! Output: a summary on stdout and in `docs/soak.md`, every figure in `docs/soak.json` (the
//! directory from `SOAK_OUT`). Exit code 1, after writing them, when a lookup was lost, a
//! restart did not complete, or the RSS or the descriptors grew; the reasons are printed.
//!
//! Environment (defaults in brackets): `SOAK_MINUTES` [30, fractions allowed], `SOAK_RATE`
//! lookups/s [2000], `SOAK_RESTART_SECS` [120; 0 = no restarts], `SOAK_DOWN_SECS` [0],
//! `SOAK_SIGNALS` [kill,term: used in turn], `SOAK_DATAPLANE` [nftables], `SOAK_SAMPLE_SECS` [10],
//! `SOAK_PREFIX`, `SOAK_OUT` [docs].

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{
    clock_ticks_per_s, cpu_ticks, dnsload_exe, now_ms, poll, read_lookups, require_root, setting,
    sleep_until_ms, summary_of, Agent, Lookup, Machine, Outcome, Proc, SimNode, CACHE_ANSWER,
    CLUSTER_DNS_IP, COREDNS_ANSWER, LOCAL_IP, UPSTREAM_IP,
};

/// RSS growth after warm-up that still counts as flat: pages touched for the first time late
/// (allocator arenas, a metrics series first used at a restart) stay well below it, while a
/// leak of 60 bytes per cache probe (18,000 in 30 minutes) crosses it. Smaller, slower growth
/// shows in the reported figures (the growth in the second half), not in the verdict.
const RSS_FLAT_KIB: u64 = 1024;
/// Samples at each end of the post-warm-up series whose lowest value is the start/end.
const EDGE_SAMPLES: usize = 3;
/// How long a restart may take to show in the agent's route before it counts as failed.
const SWITCH_DEADLINE: Duration = Duration::from_secs(10);
const RETURN_DEADLINE: Duration = Duration::from_secs(30);
/// First attempts lost this close to a stop (before or after it) are queries the stopping cache
/// had taken: sent a few ms before its signal, or before its sockets closed. A restart's lookups
/// are those started from this long before its stop to this long before the next one.
const NEAR_STOP_MS: f64 = 1000.0;
/// A restart is only scheduled if this much of the run is left after it.
const RESTART_TAIL_MS: u64 = 30_000;
/// The pod client: glibc's defaults for a single-nameserver resolv.conf.
const CLIENT_TIMEOUT: &str = "5s";
const CLIENT_ATTEMPTS: &str = "2";

// ---------------------------------------------------------------------------------------------
// Settings.

#[derive(Clone, Copy, PartialEq, Debug)]
enum StopSignal {
    Kill,
    Term,
}

impl StopSignal {
    fn name(self) -> &'static str {
        match self {
            StopSignal::Kill => "SIGKILL",
            StopSignal::Term => "SIGTERM",
        }
    }
}

struct Settings {
    duration_ms: u64,
    rate: u32,
    restart_ms: u64,
    down_ms: u64,
    signals: Vec<StopSignal>,
    dataplane: String,
    sample_ms: u64,
    prefix: String,
    out_dir: PathBuf,
}

impl Settings {
    fn from_env() -> Settings {
        let minutes: f64 = setting("SOAK_MINUTES", 30.0);
        assert!(minutes > 0.0, "SOAK_MINUTES must be above 0");
        let rate: u32 = setting("SOAK_RATE", 2000);
        assert!((1..=100_000).contains(&rate), "SOAK_RATE must be 1..=100000");
        let restart_secs: f64 = setting("SOAK_RESTART_SECS", 120.0);
        let down_secs: f64 = setting("SOAK_DOWN_SECS", 0.0);
        let sample_secs: f64 = setting("SOAK_SAMPLE_SECS", 10.0);
        assert!(restart_secs >= 0.0 && down_secs >= 0.0, "SOAK_RESTART_SECS, SOAK_DOWN_SECS >= 0");
        assert!(sample_secs >= 0.1, "SOAK_SAMPLE_SECS must be at least 0.1");
        let signals = setting("SOAK_SIGNALS", "kill,term".to_string())
            .split(',')
            .map(|s| match s.trim().to_ascii_lowercase().as_str() {
                "kill" | "sigkill" => StopSignal::Kill,
                "term" | "sigterm" => StopSignal::Term,
                other => panic!("SOAK_SIGNALS: {other:?} is neither kill nor term"),
            })
            .collect();
        let dataplane = setting("SOAK_DATAPLANE", "nftables".to_string());
        assert!(
            ["nftables", "iptables-nft", "iptables-legacy", "auto"].contains(&dataplane.as_str()),
            "SOAK_DATAPLANE must be nftables, iptables-nft, iptables-legacy or auto"
        );
        let prefix = std::env::var("SOAK_PREFIX")
            .unwrap_or_else(|_| format!("s{}", std::process::id() % 100_000));
        let out_dir = PathBuf::from(
            std::env::var("SOAK_OUT")
                .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/docs").into()),
        );
        Settings {
            duration_ms: (minutes * 60_000.0).round() as u64,
            rate,
            restart_ms: (restart_secs * 1000.0).round() as u64,
            down_ms: (down_secs * 1000.0).round() as u64,
            signals,
            dataplane,
            sample_ms: (sample_secs * 1000.0).round() as u64,
            prefix,
            out_dir,
        }
    }

    /// Restart times, ms after the load's start: every period, while the tail fits.
    fn restart_offsets(&self) -> Vec<u64> {
        if self.restart_ms == 0 {
            return Vec::new();
        }
        (1..)
            .map(|k| k * self.restart_ms)
            .take_while(|t| t + RESTART_TAIL_MS <= self.duration_ms)
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// /proc.

fn proc_text(pid: u32, file: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()
}

/// A `Name:   N ...` line of /proc/PID/status.
fn status_field(pid: u32, name: &str) -> Option<u64> {
    let status = proc_text(pid, "status")?;
    status.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok())
}

fn fd_count(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// Runs and is not a zombie.
fn alive(pid: u32) -> bool {
    proc_text(pid, "stat")
        .and_then(|s| s.rfind(')').and_then(|i| s.get(i + 2..i + 3)).map(|st| st != "Z"))
        .unwrap_or(false)
}

/// The cache's pid from simnode's pidfile, if it runs.
fn cache_pid(node: &SimNode) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(node.dir.join("cache.pid")).ok()?.trim().parse().ok()?;
    (proc_text(pid, "comm")?.trim() == "unbound" && alive(pid)).then_some(pid)
}

// ---------------------------------------------------------------------------------------------
// Sampling.

#[derive(Clone, Default)]
struct Sample {
    at: u64,
    agent_rss_kib: Option<u64>,
    agent_fds: Option<u64>,
    agent_threads: Option<u64>,
    agent_cpu_ticks: Option<u64>,
    load_rss_kib: Option<u64>,
    load_cpu_ticks: Option<u64>,
    cache_rss_kib: Option<u64>,
}

impl Sample {
    fn take(agent: u32, load: u32, cache: Option<u32>) -> Sample {
        Sample {
            at: now_ms(),
            agent_rss_kib: status_field(agent, "VmRSS:"),
            agent_fds: fd_count(agent),
            agent_threads: status_field(agent, "Threads:"),
            agent_cpu_ticks: cpu_ticks(agent).map(|(own, _)| own),
            load_rss_kib: status_field(load, "VmRSS:"),
            load_cpu_ticks: cpu_ticks(load).map(|(own, _)| own),
            cache_rss_kib: cache.and_then(|pid| status_field(pid, "VmRSS:")),
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "at_unix_ms": self.at,
            "agent_rss_kib": self.agent_rss_kib,
            "agent_fds": self.agent_fds,
            "agent_threads": self.agent_threads,
            "agent_cpu_ticks": self.agent_cpu_ticks,
            "load_rss_kib": self.load_rss_kib,
            "load_cpu_ticks": self.load_cpu_ticks,
            "cache_rss_kib": self.cache_rss_kib,
        })
    }
}

/// Samples every `every_ms` until `stop` says so (or its sender is gone), then once more.
fn sample_loop(
    stop: &mpsc::Receiver<()>,
    every_ms: u64,
    agent: u32,
    load: u32,
    cache: impl Fn() -> Option<u32>,
) -> Vec<Sample> {
    let first = Sample::take(agent, load, cache());
    let started = first.at;
    let mut samples = vec![first];
    let mut next = started + every_ms;
    loop {
        let wait = Duration::from_millis(next.saturating_sub(now_ms()));
        match stop.recv_timeout(wait) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => break,
        }
        let s = Sample::take(agent, load, cache());
        if samples.len() % 6 == 0 {
            eprintln!(
                "soak: t={:.0} s agent RSS {} KiB, {} fds, {} threads",
                (s.at - started) as f64 / 1000.0,
                s.agent_rss_kib.unwrap_or(0),
                s.agent_fds.unwrap_or(0),
                s.agent_threads.unwrap_or(0)
            );
        }
        samples.push(s);
        next += every_ms;
    }
    samples.push(Sample::take(agent, load, cache()));
    samples
}

// ---------------------------------------------------------------------------------------------
// Restarts.

struct Restart {
    n: usize,
    signal: StopSignal,
    /// When the signal went out (ms since the epoch).
    stopped_at: u64,
    /// SIGTERM: how long the cache took to exit (ms).
    exit_ms: Option<u64>,
    /// When the agent's route became `Upstream` (its `since_unix_ms`), if it did.
    switched_at: Option<u64>,
    /// When `cache-start` was run, and when it returned (the cache answers again).
    started_at: u64,
    ready_at: u64,
    /// When the agent's route became `Local` again, if it did.
    returned_at: Option<u64>,
    /// Route transitions during this restart (from the agent's state).
    transitions: Option<u64>,
}

/// The agent's state file, with `route` and `since_unix_ms` when they satisfy `f`.
fn state_when(agent: &Agent, f: impl Fn(&str, u64) -> bool) -> Option<Value> {
    let s = agent.state()?;
    f(s["route"].as_str()?, s["since_unix_ms"].as_u64()?).then_some(s)
}

/// Stops the cache with `signal`; returns (when the signal went out, SIGTERM: ms to exit).
fn stop_cache(node: &SimNode, signal: StopSignal) -> (u64, Option<u64>) {
    match signal {
        StopSignal::Kill => (node.signal("cache-kill"), None),
        StopSignal::Term => {
            let pid = cache_pid(node).expect("the cache runs before it is stopped");
            let at = now_ms();
            let target = nix::unistd::Pid::from_raw(pid as i32);
            nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
            let exited = poll(Duration::from_secs(10), || (!alive(pid)).then(now_ms));
            match exited {
                Some(t) => (at, Some(t - at)),
                None => {
                    eprintln!("soak: the cache ignored SIGTERM for 10 s; killing it");
                    node.signal("cache-kill");
                    (at, None)
                }
            }
        }
    }
}

fn restart(node: &SimNode, agent: &Agent, n: usize, signal: StopSignal, down_ms: u64) -> Restart {
    let before = agent.state().and_then(|s| s["transitions"].as_u64());
    let (stopped_at, exit_ms) = stop_cache(node, signal);
    let switched = poll(SWITCH_DEADLINE, || {
        state_when(agent, |route, since| route == "upstream" && since >= stopped_at)
    });
    let switched_at = switched.as_ref().and_then(|s| s["since_unix_ms"].as_u64());
    sleep_until_ms(now_ms() + down_ms);
    let started_at = now_ms();
    node.script(&["cache-start"]);
    let ready_at = now_ms();
    let returned = poll(RETURN_DEADLINE, || {
        state_when(agent, |route, since| route == "local" && since >= stopped_at)
    });
    let returned_at = returned.as_ref().and_then(|s| s["since_unix_ms"].as_u64());
    let after = returned.as_ref().and_then(|s| s["transitions"].as_u64());
    let r = Restart {
        n,
        signal,
        stopped_at,
        exit_ms,
        switched_at,
        started_at,
        ready_at,
        returned_at,
        transitions: before.zip(after).map(|(b, a)| a - b),
    };
    let ms = |v: Option<i64>| v.map_or_else(|| "never".to_string(), |v| format!("{v} ms"));
    eprintln!(
        "soak: restart {n} ({}): Upstream after {}, cache answering after {} ms, Local {} after that",
        signal.name(),
        ms(r.switch_ms()),
        ready_at - stopped_at,
        ms(r.return_ms()),
    );
    r
}

impl Restart {
    fn switch_ms(&self) -> Option<i64> {
        self.switched_at.map(|t| t as i64 - self.stopped_at as i64)
    }

    fn return_ms(&self) -> Option<i64> {
        self.returned_at.map(|t| t as i64 - self.ready_at as i64)
    }

    fn complete(&self) -> bool {
        self.switched_at.is_some() && self.returned_at.is_some()
    }
}

// ---------------------------------------------------------------------------------------------
// The pods' view: dnsload's per-lookup file.

/// The lookups started in `from..to` (ms since the epoch); `lookups` is sorted by start.
fn window(lookups: &[Lookup], from: f64, to: f64) -> &[Lookup] {
    let a = lookups.partition_point(|l| l.start < from);
    let b = lookups.partition_point(|l| l.start < to);
    &lookups[a..b]
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Signed ms from a restart's stop: "1.2 ms after the stop", "0.8 ms before the stop".
fn around_stop(ms: f64) -> String {
    let side = if ms < 0.0 { "before" } else { "after" };
    format!("{:.1} ms {side} the stop", ms.abs())
}

/// What the pods saw around one restart: the lookups started from [`NEAR_STOP_MS`] before its
/// stop to `until`.
fn pod_view(lookups: &[Lookup], r: &Restart, until: f64) -> Value {
    let stop = r.stopped_at as f64;
    let all = window(lookups, stop - NEAR_STOP_MS, until);
    let lost: Vec<f64> =
        all.iter().filter(|l| l.first_attempt_lost()).map(|l| l.start - stop).collect();
    let first_coredns = window(lookups, stop, until)
        .iter()
        .find(|l| l.outcome == Outcome::CoreDns)
        .map(|l| l.start - stop);
    // Back on the cache: the first lookup after the last one (started once the cache answered
    // again) not answered by the cache.
    let ready = r.ready_at as f64;
    let after = window(lookups, ready, until);
    let back = match after.iter().rposition(|l| l.outcome != Outcome::Cache) {
        None => after.first().map(|l| l.start - ready),
        Some(i) => after.get(i + 1).map(|l| l.start - ready),
    };
    json!({
        "lookups": all.len(),
        "failed": all.iter().filter(|l| l.outcome == Outcome::Failed).count(),
        "first_attempt_lost": lost.len(),
        "first_attempt_lost_ms_from_stop": {
            "earliest": lost.iter().copied().reduce(f64::min).map(round1),
            "latest": lost.iter().copied().reduce(f64::max).map(round1),
        },
        "answered_by_coredns": all.iter().filter(|l| l.outcome == Outcome::CoreDns).count(),
        "first_coredns_answer_ms_after_stop": first_coredns.map(round1),
        "back_on_cache_ms_after_ready": back.map(round1),
    })
}

/// Lookups started per second: overall, and in the slowest full 10-s window.
fn achieved_rate(lookups: &[Lookup]) -> (f64, f64) {
    let (Some(first), Some(last)) = (lookups.first(), lookups.last()) else {
        return (0.0, 0.0);
    };
    let span = (last.start - first.start).max(1.0);
    let windows = (span / 10_000.0).floor() as usize;
    let mut counts = vec![0u64; windows.max(1)];
    for l in lookups {
        let i = ((l.start - first.start) / 10_000.0) as usize;
        if i < windows {
            counts[i] += 1;
        }
    }
    let slowest = counts.iter().min().copied().unwrap_or(0) as f64 / 10.0;
    (lookups.len() as f64 / span * 1000.0, if windows == 0 { 0.0 } else { slowest })
}

/// Where a lookup lies relative to the restarts (windows as in [`pod_view`]): "restart 3
/// (SIGKILL): 12.3 ms after the stop, …" or "before the first restart, 1234.5 ms after the load
/// started".
fn when(l: &Lookup, restarts: &[Restart], load_start: f64) -> String {
    match restarts.iter().rev().find(|r| r.stopped_at as f64 - NEAR_STOP_MS <= l.start) {
        None => format!(
            "before the first restart, {:.1} ms after the load started",
            l.start - load_start
        ),
        Some(r) => format!(
            "restart {} ({}): {}, {:.1} ms after the cache answered again",
            r.n,
            r.signal.name(),
            around_stop(l.start - r.stopped_at as f64),
            l.start - r.ready_at as f64
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Footprint.

/// start/min/max/end of one series after warm-up, with start and end the lowest of the first and
/// last [`EDGE_SAMPLES`].
struct Series {
    start: u64,
    min: u64,
    max: u64,
    end: u64,
    /// The value halfway (lowest of [`EDGE_SAMPLES`] there): pages first touched late in the
    /// warm-up make a curve that flattens; a leak keeps its slope in the second half.
    middle: u64,
}

impl Series {
    fn of(values: &[u64]) -> Option<Series> {
        if values.len() < 2 * EDGE_SAMPLES {
            return None;
        }
        let low = |s: &[u64]| s.iter().copied().min().expect("not empty");
        let mid = (values.len() - EDGE_SAMPLES) / 2;
        Some(Series {
            middle: low(&values[mid..mid + EDGE_SAMPLES]),
            start: low(&values[..EDGE_SAMPLES]),
            min: low(values),
            max: values.iter().copied().max().expect("not empty"),
            end: low(&values[values.len() - EDGE_SAMPLES..]),
        })
    }

    fn growth(&self) -> i64 {
        self.end as i64 - self.start as i64
    }

    fn second_half_growth(&self) -> i64 {
        self.end as i64 - self.middle as i64
    }

    fn to_json(&self) -> Value {
        json!({ "start": self.start, "min": self.min, "max": self.max, "end": self.end,
                "middle": self.middle, "growth": self.growth(),
                "second_half_growth": self.second_half_growth() })
    }
}

/// CPU time between two samples' tick counts, as (seconds, % of one core).
fn cpu(first: Option<(u64, u64)>, last: Option<(u64, u64)>) -> Option<(f64, f64)> {
    let ((t0, c0), (t1, c1)) = (first?, last?);
    let secs = c1.saturating_sub(c0) as f64 / clock_ticks_per_s();
    let wall = (t1.saturating_sub(t0) as f64 / 1000.0).max(0.001);
    Some(((secs * 100.0).round() / 100.0, (secs / wall * 10_000.0).round() / 100.0))
}

// ---------------------------------------------------------------------------------------------
// The run.

struct Run {
    settings_json: Value,
    restarts: Vec<Restart>,
    samples: Vec<Sample>,
    lookups: Vec<Lookup>,
    summary: Value,
    load_started: u64,
    agent_started: u64,
    final_state: Value,
    transitions_metric: Option<f64>,
    checked: Vec<String>,
    agent_log_warnings: usize,
}

/// The sum of a counter family's series in the agent's /metrics, if it serves them.
fn metric_sum(node: &SimNode, family: &str) -> Option<f64> {
    let (status, body) = node.http_get("/metrics");
    if status != 200 {
        return None;
    }
    let values = body.lines().filter(|l| l.starts_with(family)).filter_map(|l| {
        let rest = &l[family.len()..];
        (rest.starts_with('{') || rest.starts_with(' '))
            .then(|| l.rsplit(' ').next()?.parse::<f64>().ok())
            .flatten()
    });
    Some(values.sum())
}

fn run(s: &Settings) -> Run {
    let node = SimNode::up_prefixed(&s.prefix, &[]);
    let agent = node.agent_env(
        LOCAL_IP,
        CLUSTER_DNS_IP,
        UPSTREAM_IP,
        &["--dataplane", &s.dataplane],
        &[("NODELOCALDNS_HA_LOG", "info")],
    );
    let agent_started = now_ms();
    let agent_pid = agent.pid().expect("agent pid");

    // The node is what it claims before the load starts.
    let state = agent.state().expect("agent state");
    let mut checked = vec![format!(
        "agent pid {agent_pid}, dataplane {}, route {}",
        state["dataplane"], state["route"]
    )];
    assert_eq!(state["route"], "local", "the agent starts on Local");
    if s.dataplane != "auto" {
        assert_eq!(state["dataplane"], s.dataplane.as_str(), "the agent's dataplane");
    }
    if s.dataplane == "nftables" {
        let table = node.agent_table().expect("the agent's table");
        assert!(table.contains("socket transparent 0"), "fast path in the table:\n{table}");
        checked.push("nftables table with the fast path".into());
    }
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), CACHE_ANSWER, "the cache answers the pod");
    checked.push(format!("pod: {CLUSTER_DNS_IP} answered by the cache"));

    let out_dir = node.dir.join("load");
    std::fs::create_dir_all(&out_dir).expect("load dir");
    let lookups_path = out_dir.join("lookups.txt");
    let stdout_path = out_dir.join("stdout.txt");
    let mut cmd = node.cmd("pod1", dnsload_exe());
    cmd.args(["--server", CLUSTER_DNS_IP, "--timeout", CLIENT_TIMEOUT])
        .args(["--attempts", CLIENT_ATTEMPTS, "--name", "who.test"])
        .args(["--rate", &s.rate.to_string(), "--duration", &format!("{}ms", s.duration_ms)])
        .args(["--report-interval", "0"])
        .args(["--origin", &format!("{CACHE_ANSWER}=cache")])
        .args(["--origin", &format!("{COREDNS_ANSWER}=coredns")])
        .arg("--lookups-out")
        .arg(&lookups_path)
        .stdout(std::fs::File::create(&stdout_path).expect("stdout file"))
        .stderr(Stdio::inherit());
    let load = Proc::spawn(&mut cmd);
    // `ip netns exec` execs dnsload: the child's pid is dnsload's.
    let load_pid = load.pid();
    let load_started = now_ms();
    eprintln!(
        "soak: {} lookups/s for {} s, {} restarts planned, prefix {}",
        s.rate,
        s.duration_ms / 1000,
        s.restart_offsets().len(),
        s.prefix
    );

    let (stop_sampling, stop_rx) = mpsc::channel::<()>();
    let (restarts, samples, status) = std::thread::scope(|scope| {
        let node = &node;
        let sampler = scope.spawn(move || {
            sample_loop(&stop_rx, s.sample_ms, agent_pid, load_pid, || cache_pid(node))
        });
        let mut restarts = Vec::new();
        for (i, offset) in s.restart_offsets().into_iter().enumerate() {
            sleep_until_ms(load_started + offset);
            let signal = s.signals[i % s.signals.len()];
            restarts.push(restart(node, &agent, i + 1, signal, s.down_ms));
        }
        let status = load.wait();
        let _ = stop_sampling.send(());
        (restarts, sampler.join().expect("sampler"), status)
    });
    assert!(status.success(), "dnsload failed: {status}");

    let final_state = agent.state().expect("agent state at the end");
    let transitions_metric = metric_sum(&node, "nodelocaldns_ha_route_transitions_total");
    assert_eq!(
        node.dig("pod1", CLUSTER_DNS_IP),
        CACHE_ANSWER,
        "the cache answers the pod at the end"
    );
    checked.push(format!("at the end: route {}, pod answered by the cache", final_state["route"]));
    let agent_log_warnings =
        agent.log_text().lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).count();

    let stdout = std::fs::read_to_string(&stdout_path).expect("dnsload stdout");
    let summary = summary_of(stdout.lines());
    let lookups = read_lookups(&lookups_path, &summary);
    let settings_json = json!({
        "minutes": s.duration_ms as f64 / 60_000.0,
        "rate_per_s": s.rate,
        "restart_every_s": s.restart_ms as f64 / 1000.0,
        "down_s": s.down_ms as f64 / 1000.0,
        "signals": s.signals.iter().map(|g| g.name()).collect::<Vec<_>>(),
        "dataplane": s.dataplane,
        "sample_every_s": s.sample_ms as f64 / 1000.0,
        "client": { "server": CLUSTER_DNS_IP, "timeout": CLIENT_TIMEOUT, "attempts": CLIENT_ATTEMPTS },
        "rss_flat_kib": RSS_FLAT_KIB,
    });
    drop(agent);
    drop(node);
    Run {
        settings_json,
        restarts,
        samples,
        lookups,
        summary,
        load_started,
        agent_started,
        final_state,
        transitions_metric,
        checked,
        agent_log_warnings,
    }
}

// ---------------------------------------------------------------------------------------------
// Report.

fn spread(values: &[i64]) -> String {
    if values.is_empty() {
        return "-".into();
    }
    let mut v = values.to_vec();
    v.sort_unstable();
    format!("{} ms median ({}–{})", v[(v.len() - 1) / 2], v[0], v[v.len() - 1])
}

fn spread_f(values: &[f64]) -> String {
    let ints: Vec<i64> = values.iter().map(|v| v.round() as i64).collect();
    spread(&ints)
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    require_root();
    let s = Settings::from_env();
    std::fs::create_dir_all(&s.out_dir).expect("output dir");
    let began = Instant::now();
    let r = run(&s);
    let run_seconds = began.elapsed().as_secs_f64().round();

    // Totals: dnsload's own summary, and the per-lookup file for where things happened.
    let sum = &r.summary;
    let sent = sum["sent"].as_u64().unwrap_or(0);
    let failed = sum["failed"].as_u64().unwrap_or(0);
    let first_lost = sum["first_attempt_lost"].as_u64().unwrap_or(0);
    let by = |o: Outcome| r.lookups.iter().filter(|l| l.outcome == o).count();
    let (rate_mean, rate_slowest) = achieved_rate(&r.lookups);
    let load_keeps_up = rate_mean >= 0.98 * f64::from(s.rate)
        && sum["skipped"].as_u64() == Some(0)
        && r.lookups.len() as u64 == sent;

    let stops: Vec<f64> = r.restarts.iter().map(|x| x.stopped_at as f64).collect();
    let pod: Vec<Value> = r
        .restarts
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let until = stops.get(i + 1).map_or(f64::MAX, |next| next - NEAR_STOP_MS);
            pod_view(&r.lookups, x, until)
        })
        .collect();
    let load_start = sum["start_unix_ms"].as_f64().unwrap_or(0.0);
    // First attempts lost soon after a stop were queries the stopping cache had already taken;
    // the others have no cause in the soak's faults and are listed.
    let near_stop = |l: &Lookup| stops.iter().any(|&s| (l.start - s).abs() < NEAR_STOP_MS);
    let lost_lookups: Vec<&Lookup> = r.lookups.iter().filter(|l| l.first_attempt_lost()).collect();
    let lost_elsewhere: Vec<&Lookup> =
        lost_lookups.iter().copied().filter(|l| !near_stop(l)).collect();
    let failed_lookups: Vec<&Lookup> =
        r.lookups.iter().filter(|l| l.outcome == Outcome::Failed).collect();

    // Route transitions.
    let transitions_state = r.final_state["transitions"].as_u64();
    let expected_transitions = 2 * r.restarts.len() as u64;
    let incomplete: Vec<usize> = r.restarts.iter().filter(|x| !x.complete()).map(|x| x.n).collect();

    // Footprint after warm-up.
    let warm_until = match r.restarts.first() {
        Some(x) => x.returned_at.unwrap_or(x.ready_at),
        None => r.load_started + 60_000.min(s.duration_ms / 4),
    };
    let after: Vec<&Sample> = r.samples.iter().filter(|x| x.at >= warm_until).collect();
    let series = |f: fn(&Sample) -> Option<u64>| {
        Series::of(&after.iter().filter_map(|x| f(x)).collect::<Vec<_>>())
    };
    let rss = series(|x| x.agent_rss_kib);
    let fds = series(|x| x.agent_fds);
    let threads = series(|x| x.agent_threads);
    let rss_flat = rss.as_ref().map(|x| x.growth() <= RSS_FLAT_KIB as i64);
    let fds_flat = fds.as_ref().map(|x| x.growth() <= 0);
    let ticks = |f: fn(&Sample) -> Option<u64>, from: &[&Sample]| {
        let points: Vec<(u64, u64)> = from.iter().filter_map(|x| Some((x.at, f(x)?))).collect();
        (points.first().copied(), points.last().copied())
    };
    let all: Vec<&Sample> = r.samples.iter().collect();
    let (a0, a1) = ticks(|x| x.agent_cpu_ticks, &after);
    let agent_cpu_after = cpu(a0, a1);
    let (w0, w1) = ticks(|x| x.agent_cpu_ticks, &all);
    let agent_cpu_whole = cpu(w0, w1);
    let (l0, l1) = ticks(|x| x.load_cpu_ticks, &all);
    let load_cpu = cpu(l0, l1);
    let load_rss_max = r.samples.iter().filter_map(|x| x.load_rss_kib).max();
    let cache_rss_max = r.samples.iter().filter_map(|x| x.cache_rss_kib).max();

    // Verdict.
    let mut problems = Vec::new();
    if failed > 0 {
        problems.push(format!("{failed} of {sent} lookups failed"));
    }
    if !incomplete.is_empty() {
        problems.push(format!("restarts {incomplete:?} did not complete (see the table)"));
    }
    match (&rss, rss_flat) {
        (Some(x), Some(false)) => problems.push(format!(
            "agent RSS grew {} KiB after warm-up (flat: at most {RSS_FLAT_KIB} KiB)",
            x.growth()
        )),
        (None, _) => problems.push("too few samples after warm-up for an RSS verdict".into()),
        _ => {}
    }
    if let (Some(x), Some(false)) = (&fds, fds_flat) {
        problems.push(format!("agent file descriptors grew by {}", x.growth()));
    }

    let Machine { date, cores, kernel } = Machine::this();

    let signals: Vec<&str> = s.signals.iter().map(|g| g.name()).collect();
    let restarts_md = if r.restarts.is_empty() {
        format!(
            "The cache is not restarted; warm-up ends {} s after the load started.",
            (warm_until - r.load_started) / 1000
        )
    } else {
        format!(
            "Every {} s the cache is stopped ({}, in turn), started again {} s after the agent \
             switched to Upstream, and the run waits for the agent to return to Local; warm-up \
             ends with the first restart's return to Local.",
            s.restart_ms as f64 / 1000.0,
            signals.join(", "),
            s.down_ms as f64 / 1000.0,
        )
    };
    let mut md = format!(
        "Soak of {date} ({cores}-core VM, kernel {}; `ci/soak.sh`, {run_seconds} s in the \
         benchmark itself). One simulated node; the agent (release build, `--dataplane {}`, \
         default timings, log level info); a pod client (dnsload in pod1: one nameserver \
         {CLUSTER_DNS_IP}, timeout {CLIENT_TIMEOUT}, {CLIENT_ATTEMPTS} attempts: glibc's \
         defaults) at {} lookups/s for {:.1} min. {restarts_md} The agent's footprint is sampled \
         every {} s. RSS counts as flat when it ends at most {RSS_FLAT_KIB} KiB above its start \
         after warm-up, file descriptors when they end at or below theirs (start/end: the lowest \
         of the first/last {EDGE_SAMPLES} samples).\n\n",
        kernel,
        s.dataplane,
        s.rate,
        s.duration_ms as f64 / 60_000.0,
        s.sample_ms as f64 / 1000.0,
    );
    let verdict = if problems.is_empty() {
        "**PASS**: no lookup lost, RSS flat, no file-descriptor growth".to_string()
    } else {
        format!("**FAIL**: {}", problems.join("; "))
    };
    let _ = writeln!(md, "{verdict}\n\n| figure | value |\n|---|---|");
    let _ = writeln!(
        md,
        "| lookups sent | {sent} (achieved {rate_mean:.0}/s, slowest 10 s {rate_slowest:.0}/s{}) |",
        if load_keeps_up { "" } else { "; **the load generator did not keep up**" }
    );
    let _ = writeln!(md, "| lookups failed | {failed} |");
    let lost_ms = |key: &'static str| -> Vec<f64> {
        pod.iter().filter_map(|p| p["first_attempt_lost_ms_from_stop"][key].as_f64()).collect()
    };
    let lost_range = lost_ms("earliest")
        .into_iter()
        .reduce(f64::min)
        .zip(lost_ms("latest").into_iter().reduce(f64::max));
    let _ = writeln!(
        md,
        "| first attempts lost (answered by the retry) | {first_lost}: {} within {NEAR_STOP_MS} ms \
         of a stop{}, {} elsewhere{} |",
        lost_lookups.len() - lost_elsewhere.len(),
        lost_range.map_or(String::new(), |(a, b)| format!(" (from {a:.0} to {b:.0} ms)")),
        lost_elsewhere.len(),
        if lost_elsewhere.is_empty() { "" } else { " (listed below)" },
    );
    let _ = writeln!(
        md,
        "| answered by the cache / CoreDNS / other | {} / {} / {} |",
        by(Outcome::Cache),
        by(Outcome::CoreDns),
        by(Outcome::Other)
    );
    let _ = writeln!(
        md,
        "| latency p50 / p99 / max | {} / {} / {} ms |",
        sum["latency_ms"]["p50"], sum["latency_ms"]["p99"], sum["latency_ms"]["max"]
    );
    let n_sig = |g: StopSignal| r.restarts.iter().filter(|x| x.signal == g).count();
    let _ = writeln!(
        md,
        "| cache restarts | {} ({} SIGKILL, {} SIGTERM){} |",
        r.restarts.len(),
        n_sig(StopSignal::Kill),
        n_sig(StopSignal::Term),
        if incomplete.is_empty() { String::new() } else { format!("; incomplete: {incomplete:?}") }
    );
    let _ = writeln!(
        md,
        "| route transitions | {} (state), {} (metrics); 2 per restart: {expected_transitions} |",
        transitions_state.map_or("-".into(), |v| v.to_string()),
        r.transitions_metric.map_or("-".into(), |v| v.to_string()),
    );
    let switch: Vec<i64> = r.restarts.iter().filter_map(Restart::switch_ms).collect();
    let back: Vec<i64> = r.restarts.iter().filter_map(Restart::return_ms).collect();
    let f = |key: &str| -> Vec<f64> { pod.iter().filter_map(|p| p[key].as_f64()).collect() };
    let ready: Vec<i64> =
        r.restarts.iter().map(|x| x.ready_at as i64 - x.started_at as i64).collect();
    let _ = writeln!(md, "| stop → agent on Upstream | {} |", spread(&switch));
    let _ = writeln!(
        md,
        "| stop → first pod lookup answered by CoreDNS | {} |",
        spread_f(&f("first_coredns_answer_ms_after_stop"))
    );
    let _ = writeln!(md, "| cache-start → the cache answers | {} |", spread(&ready));
    let _ = writeln!(md, "| cache answers → agent back on Local | {} |", spread(&back));
    let _ = writeln!(
        md,
        "| cache answers → pods back on the cache | {} |",
        spread_f(&f("back_on_cache_ms_after_ready"))
    );
    let series_md = |x: &Option<Series>, unit: &str, flat: Option<bool>| {
        match x {
        None => "too few samples after warm-up".to_string(),
        Some(x) => format!(
            "start {}{unit}, min {}, max {}, end {}: {} ({:+}{unit} in all, {:+}{unit} in the second \
             half)",
            x.start,
            x.min,
            x.max,
            x.end,
            if flat == Some(true) { "flat" } else { "**grew**" },
            x.growth(),
            x.second_half_growth(),
        ),
    }
    };
    let _ = writeln!(
        md,
        "| agent RSS after warm-up ({} samples) | {} |",
        after.len(),
        series_md(&rss, " KiB", rss_flat)
    );
    let _ = writeln!(md, "| agent file descriptors | {} |", series_md(&fds, "", fds_flat));
    let _ = writeln!(
        md,
        "| agent threads | {} |",
        threads
            .as_ref()
            .map_or("-".into(), |x| format!("start {}, max {}, end {}", x.start, x.max, x.end))
    );
    let cpu_md = |c: Option<(f64, f64)>| {
        c.map_or("-".to_string(), |(secs, pct)| format!("{secs} s = {pct} % of one core"))
    };
    let _ = writeln!(
        md,
        "| agent CPU (utime+stime) | after warm-up {}; whole run {} |",
        cpu_md(agent_cpu_after),
        cpu_md(agent_cpu_whole)
    );
    let _ = writeln!(
        md,
        "| dnsload | CPU {}; RSS max {} KiB |",
        cpu_md(load_cpu),
        load_rss_max.map_or("-".into(), |v| v.to_string())
    );
    let _ = writeln!(
        md,
        "| cache (unbound) RSS max | {} KiB |",
        cache_rss_max.map_or("-".into(), |v| v.to_string())
    );
    let _ = writeln!(
        md,
        "| agent: drift repairs, last error, WARN/ERROR log lines | {}, {}, {} |",
        r.final_state["repairs"], r.final_state["last_error"], r.agent_log_warnings
    );

    let _ = writeln!(
        md,
        "\n| restart | signal | stop → Upstream | cache answers after | → Local | pods back on cache | transitions | first attempts lost (ms from the stop) | failed |\n|---|---|---|---|---|---|---|---|---|"
    );
    let opt = |v: Option<i64>| v.map_or("never".to_string(), |v| format!("{v} ms"));
    for (x, p) in r.restarts.iter().zip(&pod) {
        let _ = writeln!(
            md,
            "| {} | {}{} | {} | {} ms | {} | {} | {} | {} ({}) | {} |",
            x.n,
            x.signal.name(),
            x.exit_ms.map_or(String::new(), |ms| format!(" (exit {ms} ms)")),
            opt(x.switch_ms()),
            x.ready_at - x.stopped_at,
            opt(x.return_ms()),
            p["back_on_cache_ms_after_ready"].as_f64().map_or("-".into(), |v| format!("{v:.0} ms")),
            x.transitions.map_or("-".into(), |v| v.to_string()),
            p["first_attempt_lost"],
            match &p["first_attempt_lost_ms_from_stop"] {
                r if r["earliest"].is_f64() => format!(
                    "{:.0} to {:.0} ms",
                    r["earliest"].as_f64().unwrap_or(0.0),
                    r["latest"].as_f64().unwrap_or(0.0)
                ),
                _ => "-".into(),
            },
            p["failed"],
        );
    }
    // Up to 20 lookups, each with when it started and `what` of it; the rest are in the JSON.
    let list_lookups = |md: &mut String, lookups: &[&Lookup], what: fn(&Lookup) -> String| {
        for l in lookups.iter().take(20) {
            let _ = writeln!(md, "* started {} ({})", when(l, &r.restarts, load_start), what(l));
        }
        if lookups.len() > 20 {
            let _ = writeln!(md, "* … and {} more (docs/soak.json)", lookups.len() - 20);
        }
    };
    if !failed_lookups.is_empty() {
        let _ = writeln!(
            md,
            "\nFailed lookups ({}; attempts: {} timeouts, {} refused, {} SERVFAIL, {} bad replies, {} I/O errors; {} unfinished):",
            failed_lookups.len(),
            sum["timeout_attempts"],
            sum["refused_attempts"],
            sum["servfail_attempts"],
            sum["bad_reply_attempts"],
            sum["io_error_attempts"],
            sum["unfinished"],
        );
        list_lookups(&mut md, &failed_lookups, |l| {
            format!("{} failed attempts, {:.0} ms", l.failed_attempts, l.latency)
        });
    }
    let lost_answered: Vec<&Lookup> =
        lost_elsewhere.iter().copied().filter(|l| l.outcome != Outcome::Failed).collect();
    if !lost_answered.is_empty() {
        let _ = writeln!(
            md,
            "\nFirst attempts lost not within {NEAR_STOP_MS} ms of a stop (answered by the retry):"
        );
        list_lookups(&mut md, &lost_answered, |l| {
            format!("{} failed attempts, answered in {:.0} ms", l.failed_attempts, l.latency)
        });
    }

    let restarts_json: Vec<Value> = r
        .restarts
        .iter()
        .zip(&pod)
        .map(|(x, p)| {
            json!({
                "n": x.n,
                "signal": x.signal.name(),
                "stopped_at_unix_ms": x.stopped_at,
                "term_exit_ms": x.exit_ms,
                "stop_to_upstream_ms": x.switch_ms(),
                "cache_start_ms": x.ready_at - x.started_at,
                "stop_to_cache_answering_ms": x.ready_at - x.stopped_at,
                "cache_answering_to_local_ms": x.return_ms(),
                "transitions": x.transitions,
                "pods": p,
            })
        })
        .collect();
    let report = json!({
        "date": date,
        "machine": { "cores": cores, "kernel": kernel },
        "settings": r.settings_json,
        "pass": problems.is_empty(),
        "problems": problems,
        "checked": r.checked,
        "lookups": {
            "sent": sent,
            "failed": failed,
            "first_attempt_lost": first_lost,
            "first_attempt_lost_within_ms_of_a_stop": {
                "ms": NEAR_STOP_MS,
                "count": lost_lookups.len() - lost_elsewhere.len(),
            },
            "first_attempt_lost_elsewhere": lost_elsewhere
                .iter()
                .take(1000)
                .map(|l| when(l, &r.restarts, load_start))
                .collect::<Vec<_>>(),
            "answered_by_cache": by(Outcome::Cache),
            "answered_by_coredns": by(Outcome::CoreDns),
            "answered_by_other": by(Outcome::Other),
            "achieved_rate_per_s": round1(rate_mean),
            "slowest_10s_rate_per_s": round1(rate_slowest),
            "load_kept_up": load_keeps_up,
            "failed_started": failed_lookups.iter().take(1000).map(|l| when(l, &r.restarts, load_start)).collect::<Vec<_>>(),
            "client_summary": {
                "latency_ms": sum["latency_ms"],
                "skipped": sum["skipped"],
                "unfinished": sum["unfinished"],
                "timeout_attempts": sum["timeout_attempts"],
                "refused_attempts": sum["refused_attempts"],
                "servfail_attempts": sum["servfail_attempts"],
                "io_error_attempts": sum["io_error_attempts"],
            },
        },
        "route_transitions": {
            "state": transitions_state,
            "metrics": r.transitions_metric,
            "expected": expected_transitions,
        },
        "restarts": restarts_json,
        "agent": {
            "warm_up_ends_unix_ms": warm_until,
            "warm_up_s": round1(warm_until.saturating_sub(r.agent_started) as f64 / 1000.0),
            "samples_after_warm_up": after.len(),
            "rss_kib": rss.as_ref().map(Series::to_json),
            "rss_flat": rss_flat,
            "fds": fds.as_ref().map(Series::to_json),
            "fds_flat": fds_flat,
            "threads": threads.as_ref().map(Series::to_json),
            "cpu_after_warm_up": agent_cpu_after.map(|(s, p)| json!({ "seconds": s, "percent_of_one_core": p })),
            "cpu_whole_run": agent_cpu_whole.map(|(s, p)| json!({ "seconds": s, "percent_of_one_core": p })),
            "repairs": r.final_state["repairs"],
            "last_error": r.final_state["last_error"],
            "log_warn_error_lines": r.agent_log_warnings,
        },
        "load": {
            "cpu": load_cpu.map(|(s, p)| json!({ "seconds": s, "percent_of_one_core": p })),
            "rss_kib_max": load_rss_max,
        },
        "cache_rss_kib_max": cache_rss_max,
        "samples": r.samples.iter().map(Sample::to_json).collect::<Vec<_>>(),
        "run_seconds": run_seconds,
    });
    std::fs::write(
        s.out_dir.join("soak.json"),
        serde_json::to_string_pretty(&report).expect("json") + "\n",
    )
    .expect("write soak.json");
    std::fs::write(s.out_dir.join("soak.md"), &md).expect("write soak.md");
    println!("{md}");
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("soak: FAILED: {}", problems.join("; "));
        ExitCode::FAILURE
    }
}
