//! The `dnsload` client on the simulated node, and what it reports: the timeline lines, the
//! `SUMMARY` JSON, every lookup of `--lookups-out`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::agent::Agent;
use crate::binaries::dnsload_exe;
use crate::process::Proc;
use crate::simnode::{SimNode, CACHE_ANSWER, COREDNS_ANSWER};

/// How long `dnsload` waits for each attempt unless a test gives its own `--timeout`. A first
/// attempt sent longer than this before a fault was lost, if at all, while the server was fine.
pub const ATTEMPT_TIMEOUT_MS: u64 = 1000;

impl SimNode {
    /// Starts `dnsload` in `role`'s namespace against `server`, with `extra` flags (2 attempts
    /// of 1 s each, unless `extra` gives its own `--timeout`).
    pub fn load(&self, role: &str, server: &str, extra: &[&str]) -> Load {
        let mut args = vec!["--server", server, "--name", "who.test", "--attempts", "2"];
        // 1 s unless the test sets its own (the VM tests: TCG is 5-20x slower).
        if !extra.contains(&"--timeout") {
            args.extend(["--timeout", "1000ms"]);
        }
        args.extend(extra);
        self.dnsload(role, &args)
    }

    /// Starts `dnsload --system-resolver` in `role`'s namespace: each lookup of `name` is one
    /// getaddrinfo() of glibc, following the namespace's resolv.conf ([`crate::NetnsEtc`]).
    pub fn system_load(&self, role: &str, name: &str, extra: &[&str]) -> Load {
        let mut args = vec!["--system-resolver", "--name", name];
        args.extend(extra);
        self.dnsload(role, &args)
    }

    fn dnsload(&self, role: &str, args: &[&str]) -> Load {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let lookups = self.dir.join(format!("lookups-{role}-{n}.txt"));
        let mut cmd = self.cmd(role, dnsload_exe());
        cmd.arg("--lookups-out").arg(&lookups).args(origins()).args(args);
        Load::spawn(&mut cmd, lookups)
    }
}

/// dnsload's `--origin` flags: who answered, by the address (v4 and v6) each answers who.test
/// with.
pub(crate) fn origins() -> Vec<String> {
    [
        (CACHE_ANSWER, "cache"),
        (COREDNS_ANSWER, "coredns"),
        ("fd00::1:1:1:1", "cache"),
        ("fd00::2:2:2:2", "coredns"),
    ]
    .iter()
    .flat_map(|(addr, who)| ["--origin".to_string(), format!("{addr}={who}")])
    .collect()
}

/// A running `dnsload`; its timeline lines are collected as they come.
pub struct Load {
    child: Proc,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
    /// Where dnsload writes every lookup (`--lookups-out`), complete once it exits.
    lookups: PathBuf,
}

impl Load {
    /// Starts `cmd`, a dnsload (or a command that runs one and passes its output on: `kubectl
    /// exec`), whose lookups go to `lookups` (`--lookups-out`, read once it has finished).
    pub(crate) fn spawn(cmd: &mut std::process::Command, lookups: PathBuf) -> Load {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                println!("dnsload: {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Load { child: Proc::adopt(child), lines: rx, seen: Vec::new(), lookups }
    }

    /// Waits for a timeline line satisfying `f`.
    pub fn wait_line(&mut self, what: &str, deadline: Duration, f: impl Fn(&str) -> bool) {
        let end = Instant::now() + deadline;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let hit = f(&line);
                    self.seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!("timed out waiting for dnsload to show {what}"),
            }
        }
    }

    /// Waits (5 s at most) for a timeline line answered by `who` (`cache` or `coredns`) alone.
    pub fn wait_alone(&mut self, who: &str) {
        let other = if who == "cache" { "coredns" } else { "cache" };
        self.wait_line(&format!("{who} answering alone"), Duration::from_secs(5), |l| {
            field(l, who).is_some_and(|n| n > 0) && field(l, other) == Some(0)
        });
    }

    /// Waits (5 s at most) for a timeline line with answers from the cache.
    pub fn wait_cache_answers(&mut self) {
        self.wait_line("answers from the cache", Duration::from_secs(5), |l| {
            field(l, "cache").is_some_and(|n| n > 0)
        });
    }

    /// Stops a client started with a long `--duration` (SIGINT: it starts no more lookups and
    /// waits for those in flight) and returns its summary.
    pub fn interrupt(self) -> Value {
        self.sigint();
        self.finish()
    }

    /// [`Load::interrupt`], with every lookup, in the order they started.
    pub fn interrupt_recorded(self) -> (Value, Vec<Lookup>) {
        self.sigint();
        self.finish_recorded()
    }

    fn sigint(&self) {
        let pid = nix::unistd::Pid::from_raw(self.child.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
    }

    /// Waits for the client to finish and returns its summary.
    pub fn finish(mut self) -> Value {
        let status = self.child.wait();
        assert!(status.success(), "dnsload failed: {status}");
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(line);
        }
        summary_of(self.seen.iter().map(String::as_str))
    }

    /// Like [`Load::finish`], with every lookup, in the order they started.
    pub fn finish_recorded(self) -> (Value, Vec<Lookup>) {
        let path = self.lookups.clone();
        let summary = self.finish();
        let lookups = read_lookups(&path, &summary);
        (summary, lookups)
    }
}

/// Counts of one timeline line, e.g. `cache=250 coredns=0`.
pub fn field(line: &str, name: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// The wall-clock send times (ms since the epoch) of the lookups a summary lists under `key`
/// (`failures_at_ms` or `first_attempt_lost_at_ms`).
pub fn sent_at(summary: &Value, key: &str) -> Vec<u64> {
    let start = summary["start_unix_ms"].as_u64().expect("start_unix_ms");
    summary[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} missing: {summary}"))
        .iter()
        .map(|v| start + v.as_u64().expect("ms"))
        .collect()
}

/// When a client saw the route switched to CoreDNS after `after` (ms since the epoch): the end of
/// the first lookup CoreDNS answered. A lookup sent later cannot have met the old route, however
/// long the agent and the kernel took to switch on a loaded machine.
pub fn coredns_seen_after(lookups: &[Lookup], after: u64) -> u64 {
    lookups
        .iter()
        .filter(|l| l.outcome == Outcome::CoreDns)
        .map(|l| l.start + f64::from(l.latency))
        .filter(|&end| end >= after as f64)
        .reduce(f64::min)
        .unwrap_or_else(|| panic!("no lookup answered by CoreDNS after {after}"))
        .ceil() as u64
}

/// Asserts every time in `times` lies in `from..=to` (ms since the epoch).
pub fn assert_within(what: &str, times: &[u64], from: u64, to: u64) {
    for &t in times {
        assert!(
            (from..=to).contains(&t),
            "{what}: a lookup sent at {t} is outside {from}..={to} ({} ms from the start)",
            t as i64 - from as i64
        );
    }
}

/// Asserts that the first attempts `summary` lost were lost to a kill: queries already queued
/// in the dying cache, sent before it was gone and within one attempt timeout of the kill (an
/// older loss is not the kill's). Prints when they were sent, against the kill and its end.
pub fn assert_lost_to_the_kill(what: &str, summary: &Value, killed_at: u64, gone_at: u64) {
    let lost = sent_at(summary, "first_attempt_lost_at_ms");
    let offsets: Vec<i64> = lost.iter().map(|&t| t as i64 - killed_at as i64).collect();
    println!(
        "first attempts lost: {} (sent at {offsets:?} ms from the SIGKILL; gone {} ms after it)",
        lost.len(),
        gone_at - killed_at
    );
    assert_within(what, &lost, killed_at - ATTEMPT_TIMEOUT_MS, gone_at);
}

/// Asserts that the first attempts a TCP client lost were lost to the kill (as
/// [`assert_lost_to_the_kill`]) or to the return to Local: a connection kube-proxy DNATed to
/// CoreDNS while on Upstream and still open when the NOTRACK came back sends its next segment to
/// the cache, which resets it. Such a lookup was sent within one attempt timeout before the
/// return, and was answered at once by its next attempt, no timeout paid.
pub fn assert_tcp_lost_to_the_kill_or_return(what: &str, lookups: &[Lookup], restart: &Restart) {
    let returning = restart.returned_at - ATTEMPT_TIMEOUT_MS..=restart.local_seen_at;
    let (at_return, at_kill): (Vec<&Lookup>, Vec<&Lookup>) = lookups
        .iter()
        .filter(|l| l.first_attempt_lost())
        .partition(|l| returning.contains(&(l.start as u64)));
    for l in &at_return {
        println!(
            "{what}: first attempt reset at the return: sent {:+} ms from it, answered in {} ms",
            l.start as i64 - restart.returned_at as i64,
            l.latency
        );
        assert!(
            l.answered() && l.latency < ATTEMPT_TIMEOUT_MS as f32,
            "{what}: a lookup at the return paid a timeout or failed"
        );
    }
    let sent: Vec<u64> = at_kill.iter().map(|l| l.start as u64).collect();
    assert_within(what, &sent, restart.killed_at - ATTEMPT_TIMEOUT_MS, restart.gone_at);
}

/// dnsload's `SUMMARY {json}` line among `lines` (its standard output).
pub fn summary_of<'a>(mut lines: impl Iterator<Item = &'a str>) -> Value {
    let summary =
        lines.find_map(|l| l.strip_prefix("SUMMARY ")).expect("dnsload printed a SUMMARY line");
    serde_json::from_str(summary).expect("SUMMARY is JSON")
}

/// Who answered a lookup of dnsload's `--lookups-file`.
#[derive(Clone, Copy, PartialEq)]
pub enum Outcome {
    Cache,
    CoreDns,
    Other,
    Failed,
}

/// One line of dnsload's `--lookups-file`.
pub struct Lookup {
    /// Start, ms since the Unix epoch.
    pub start: f64,
    /// ms (f32: the soak keeps millions of these).
    pub latency: f32,
    pub outcome: Outcome,
    pub failed_attempts: u8,
}

impl Lookup {
    pub fn answered(&self) -> bool {
        matches!(self.outcome, Outcome::Cache | Outcome::CoreDns)
    }

    pub fn first_attempt_lost(&self) -> bool {
        self.outcome == Outcome::Failed || self.failed_attempts > 0
    }
}

/// The lookups dnsload wrote to `path` (in the order they completed: `START_MS LATENCY_MS
/// ORIGIN FAILED_ATTEMPTS`, the start relative to the `start_unix_ms` of its `summary`), in the
/// order they started.
pub fn read_lookups(path: &Path, summary: &Value) -> Vec<Lookup> {
    let start_unix_ms = summary["start_unix_ms"].as_f64().expect("start_unix_ms");
    let file = std::fs::File::open(path).expect("dnsload's lookups file");
    let mut lookups: Vec<Lookup> = BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| {
            let mut w = line.split_whitespace();
            let start: f64 = w.next()?.parse().ok()?;
            let latency: f32 = w.next()?.parse().ok()?;
            let outcome = match w.next()? {
                "cache" => Outcome::Cache,
                "coredns" => Outcome::CoreDns,
                "failed" => Outcome::Failed,
                _ => Outcome::Other,
            };
            let failed_attempts = w.next()?.parse().ok()?;
            Some(Lookup { start: start_unix_ms + start, latency, outcome, failed_attempts })
        })
        .collect();
    lookups.sort_by(|a, b| a.start.total_cmp(&b.start));
    lookups
}

/// What [`kill_and_restart_cache`] saw, in ms since the Unix epoch.
pub struct Restart {
    /// When the SIGKILL went out.
    pub killed_at: u64,
    /// When the process was seen gone.
    pub gone_at: u64,
    /// When the agent switched back to Local (its state's `since_unix_ms`).
    pub returned_at: u64,
    /// When the test saw it there: the rules are in by then.
    pub local_seen_at: u64,
}

/// A cache SIGKILL and its restart as the clients see them: the cache answering alone, then,
/// the agent on Upstream, CoreDNS alone, then, back on Local, the cache alone again.
pub fn kill_and_restart_cache(node: &SimNode, agent: &Agent, loads: &mut [&mut Load]) -> Restart {
    for load in loads.iter_mut() {
        load.wait_alone("cache");
    }
    let (killed_at, gone_at) = node.kill("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    for load in loads.iter_mut() {
        load.wait_alone("coredns");
    }
    node.script(&["cache-start"]);
    let state = agent.wait_route("local", Duration::from_secs(10));
    let local_seen_at = crate::now_ms();
    let returned_at = state["since_unix_ms"].as_u64().expect("since_unix_ms");
    for load in loads.iter_mut() {
        load.wait_alone("cache");
    }
    Restart { killed_at, gone_at, returned_at, local_seen_at }
}
