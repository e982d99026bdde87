//! A simulated node for end-to-end tests: `testdata/simnode.sh` namespaces, the real agent
//! binary inside the node namespace, and the `dnsload` client in a pod or the node.
//!
//! Everything a test starts is stopped by its own handle's `Drop` (by pid), and the namespaces
//! are deleted by [`SimNode`]'s `Drop`, so a failing test leaves nothing behind.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

pub const LOCAL_IP: &str = "169.254.20.10";
pub const CLUSTER_DNS_IP: &str = "10.96.0.10";
pub const UPSTREAM_IP: &str = "10.96.0.11";
pub const CACHE_ANSWER: &str = "1.1.1.1";
pub const COREDNS_ANSWER: &str = "2.2.2.2";
/// How long `dnsload` waits for each attempt unless a test gives its own `--timeout`. A first
/// attempt sent longer than this before a fault was lost, if at all, while the server was fine.
pub const ATTEMPT_TIMEOUT_MS: u64 = 1000;

/// The agent's binary.
pub fn agent_exe() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| built("nodelocaldns-ha"))
}

/// The load client's binary (crates/dnsload).
pub fn dnsload_exe() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| built("dnsload"))
}

/// The path of the workspace's binary `name`, found where cargo puts it: a test or benchmark
/// runs from `target/<profile>/deps/`, the binaries are built into `target/<profile>/`.
/// (`env!("CARGO_BIN_EXE_<name>")` names only the binaries of the package whose test is being
/// compiled: not dnsload, a package of its own. The VM guest of `tests/e2e_vm.rs` runs the test
/// binary from the same path, so it finds them too.)
fn built(name: &str) -> String {
    let exe = std::env::current_exe().expect("the running test's path");
    let deps = exe.parent().expect("the test's directory");
    let path = deps.parent().expect("the profile's directory").join(name);
    assert!(
        path.is_file(),
        "{} is not built: build the workspace's binaries with `cargo build` (or `cargo test`, \
         `cargo bench` in the repository's root, which build them all)",
        path.display()
    );
    path.into_os_string().into_string().expect("a UTF-8 path")
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Fails loudly when not root: these tests exist to run on real netfilter.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "end-to-end tests need root (network namespaces, netfilter); run ci/test.sh as root"
    );
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Waits until `f` returns `Some`, polling every 5 ms, or panics with `what` at the deadline.
pub fn wait_for<T>(what: &str, deadline: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < deadline, "timed out after {deadline:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A unique, short namespace prefix for this process and test.
fn unique_prefix() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("t{}{}", std::process::id() % 100_000, (b'a' + (n % 26) as u8) as char)
}

/// One simulated node: namespaces node, pod1, pod2, dns.
pub struct SimNode {
    pub prefix: String,
    pub dir: PathBuf,
}

impl SimNode {
    /// Sets up the namespaces and the kube-proxy-shaped DNAT rules, starts CoreDNS (dnsmasq)
    /// and the cache (unbound).
    pub fn up() -> SimNode {
        SimNode::up_with(&[])
    }

    /// Like [`SimNode::up`], with `simnode.sh up` options (`--family dual`, `--kube-proxy …`).
    pub fn up_with(options: &[&str]) -> SimNode {
        let prefix = unique_prefix();
        SimNode::start(prefix, "nlha-e2e", options)
    }

    /// Sets up the node `prefix` (run dir under `$TMPDIR/<area>`) and starts both servers.
    fn start(prefix: String, area: &str, options: &[&str]) -> SimNode {
        require_root();
        let dir = std::env::temp_dir().join(area).join(&prefix);
        let node = SimNode { prefix, dir };
        let mut args = vec!["up"];
        args.extend_from_slice(options);
        node.script(&args);
        node.script(&["coredns-start"]);
        node.script(&["cache-start"]);
        node
    }

    /// Runs `simnode.sh CMD PREFIX ARGS...`, panicking with its output on failure.
    pub fn script(&self, args: &[&str]) -> String {
        let (cmd, rest) = args.split_first().expect("a simnode command");
        let out = Command::new(repo().join("testdata/simnode.sh"))
            .arg(cmd)
            .arg(&self.prefix)
            .args(rest)
            .env("SIMNODE_DIR", self.dir.parent().expect("dir has a parent"))
            .output()
            .expect("run testdata/simnode.sh");
        assert!(out.status.success(), "simnode.sh {args:?} failed:\n{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Sends a signal through `simnode.sh CMD` (`cache-kill`, `cache-stop`, …); returns when it
    /// went out, in ms since the epoch.
    pub fn signal(&self, cmd: &str) -> u64 {
        let out = self.script(&[cmd]);
        let at = out.lines().next().and_then(|l| l.trim().parse().ok());
        at.unwrap_or_else(|| panic!("simnode.sh {cmd} printed no time: {out:?}"))
    }

    /// `simnode.sh cache-kill` (or `coredns-kill`): (when the SIGKILL went out, when the process
    /// was seen gone), in ms since the epoch. Gone is seen at most one poll (50 ms) after the
    /// sockets closed, however busy the machine: a bound for what the dead process could lose.
    pub fn kill(&self, cmd: &str) -> (u64, u64) {
        let out = self.script(&[cmd]);
        let mut times = out.lines().filter_map(|l| l.trim().parse().ok());
        match (times.next(), times.next()) {
            (Some(at), Some(gone)) => (at, gone),
            _ => panic!("simnode.sh {cmd} printed no times: {out:?}"),
        }
    }

    /// The namespace name of `role` (node, pod1, pod2, dns).
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    /// A command run inside `role`'s namespace.
    pub fn cmd(&self, role: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(role), program]);
        c
    }

    /// Runs `program args` in `role`'s namespace and returns its output (any exit status).
    pub fn run(&self, role: &str, program: &str, args: &[&str]) -> Output {
        self.cmd(role, program).args(args).output().expect("ip netns exec")
    }

    /// The agent's table as `nft list` prints it, counters zeroed; `None` when absent.
    pub fn agent_table(&self) -> Option<String> {
        let out = self.run("node", "nft", &["list", "table", "inet", "nodelocaldns-ha"]);
        if !out.status.success() {
            return None;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        Some(strip_counters(&text))
    }

    /// What `nodelocaldns-ha rules` prints for `route`.
    pub fn expected_table(&self, route: &str) -> String {
        self.expected_table_for(route, LOCAL_IP, CLUSTER_DNS_IP)
    }

    /// [`SimNode::expected_table`] for the given (comma-separated, dual-stack) addresses.
    pub fn expected_table_for(&self, route: &str, local: &str, cluster_dns: &str) -> String {
        let out = Command::new(agent_exe())
            .args(["rules", "--route", route, "--local-ip", local])
            .args(["--cluster-dns-ip", cluster_dns])
            .output()
            .expect("run nodelocaldns-ha rules");
        assert!(out.status.success(), "{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts the agent in the node namespace with the default test settings plus `extra`.
    pub fn agent(&self, extra: &[&str]) -> Agent {
        self.agent_for(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, extra)
    }

    /// Starts the agent for the given (comma-separated, dual-stack) addresses.
    pub fn agent_for(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
    ) -> Agent {
        self.agent_env(local, cluster_dns, upstream, extra, &[])
    }

    /// [`SimNode::agent_for`] with extra environment variables.
    pub fn agent_env(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        self.spawn_agent(local, cluster_dns, upstream, extra, env, true)
    }

    fn spawn_agent(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        wait_local: bool,
    ) -> Agent {
        let state_dir = self.dir.join("agent-state");
        let log = self.dir.join("agent.log");
        let child = self
            .cmd("node", agent_exe())
            .args(["run", "--local-ip", local, "--cluster-dns-ip", cluster_dns])
            .args(["--upstream-ip", upstream, "--probe-name", "who.test"])
            // nftables unless the test picks a backend.
            .args(if extra.contains(&"--dataplane") {
                &[][..]
            } else {
                &["--dataplane", "nftables"][..]
            })
            .arg("--state-dir")
            .arg(&state_dir)
            .args(extra)
            .env("NODELOCALDNS_HA_LOG", "nodelocaldns_ha=debug")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("create agent log"))
            .spawn()
            .expect("spawn agent");
        let agent = Agent { child: Some(child), state_dir, log };
        if wait_local {
            // Generous: at start, `auto` saves every table (seconds with 50,000 nat rules).
            agent.wait_route("local", Duration::from_secs(30));
        } else {
            wait_for("the agent's state", Duration::from_secs(10), || agent.state());
        }
        agent
    }

    /// Starts the agent (v4, nftables unless `extra` says otherwise) without assuming its first
    /// route: the state file of an earlier agent is removed first.
    pub fn agent_starting(&self, extra: &[&str]) -> Agent {
        self.agent_starting_env(extra, &[])
    }

    /// [`SimNode::agent_starting`] with extra environment variables.
    pub fn agent_starting_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let _ = std::fs::remove_file(self.dir.join("agent-state").join("state.json"));
        self.spawn_agent(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, extra, env, false)
    }

    /// [`SimNode::agent_starting`] for the given (comma-separated, dual-stack) addresses.
    pub fn agent_starting_for(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
    ) -> Agent {
        let _ = std::fs::remove_file(self.dir.join("agent-state").join("state.json"));
        self.spawn_agent(local, cluster_dns, upstream, extra, &[], false)
    }

    /// Starts the agent again with the same state directory (v4, nftables unless `extra` says
    /// otherwise), without assuming its first route; returns once it has written its own state
    /// (a `pid` other than `previous`).
    pub fn agent_restarting(&self, extra: &[&str], previous: &Value) -> Agent {
        let agent = self.spawn_agent(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, extra, &[], false);
        wait_for("the restarted agent's state", Duration::from_secs(10), || {
            agent.state().filter(|s| s["pid"] != previous["pid"])
        });
        agent
    }

    /// The agent's table as `nft -a list` prints it (every handle; counters zeroed): a table
    /// replaced by an apply, even by the same ruleset, gets new handles.
    pub fn agent_table_handles(&self) -> Option<String> {
        let out = self.run("node", "nft", &["-a", "list", "table", "inet", "nodelocaldns-ha"]);
        out.status.success().then(|| strip_counters(&String::from_utf8_lossy(&out.stdout)))
    }

    /// Starts `dnsload` in `role`'s namespace against `server`, with `extra` flags (2 attempts
    /// of 1 s each, unless `extra` gives its own `--timeout`).
    pub fn load(&self, role: &str, server: &str, extra: &[&str]) -> Load {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let lookups = self.dir.join(format!("lookups-{role}-{n}.txt"));
        let mut child = self
            .cmd(role, dnsload_exe())
            .args(["--server", server, "--name", "who.test", "--attempts", "2"])
            // 1 s unless the test sets its own (the VM tests: TCG is 5-20x slower).
            .args(if extra.contains(&"--timeout") { &[][..] } else { &["--timeout", "1000ms"][..] })
            .arg("--lookups-out")
            .arg(&lookups)
            .args(["--origin", &format!("{CACHE_ANSWER}=cache")])
            .args(["--origin", &format!("{COREDNS_ANSWER}=coredns")])
            .args(["--origin", "fd00::1:1:1:1=cache", "--origin", "fd00::2:2:2:2=coredns"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn dnsload");
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
        Load { child: Proc(Some(child)), lines: rx, seen: Vec::new(), lookups }
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        let out = Command::new(repo().join("testdata/simnode.sh"))
            .args(["down", &self.prefix])
            .env("SIMNODE_DIR", self.dir.parent().expect("dir has a parent"))
            .output();
        if let Ok(out) = out {
            if !out.status.success() {
                eprintln!("simnode down failed: {}", describe(&out));
            }
        }
    }
}

/// `counter packets N bytes N` → `counter`.
pub fn strip_counters(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut words: Vec<&str> = Vec::new();
        let mut it = line.split(' ').peekable();
        while let Some(w) = it.next() {
            words.push(w);
            if w.ends_with("counter") && it.peek() == Some(&"packets") {
                it.nth(3);
            }
        }
        out.push_str(&words.join(" "));
        out.push('\n');
    }
    out
}

pub fn describe(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The agent process; killed (SIGKILL) on drop if still running.
pub struct Agent {
    child: Option<Child>,
    pub state_dir: PathBuf,
    pub log: PathBuf,
}

impl Agent {
    /// The handle of an agent the caller started itself (under a privilege wrapper, say).
    pub fn adopt(child: Child, state_dir: PathBuf, log: PathBuf) -> Agent {
        Agent { child: Some(child), state_dir, log }
    }

    /// The state file, if it is there and complete.
    pub fn state(&self) -> Option<Value> {
        let bytes = std::fs::read(self.state_dir.join("state.json")).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Waits until the state file counts `n` repairs of foreign changes, the last of them
    /// finished (no apply error outstanding). The state is written after the loop's turn, so a
    /// tamper made after this returns cannot race the agent's read-back of its own repair.
    pub fn wait_repairs(&self, n: u64, deadline: Duration) -> Value {
        wait_for(&format!("{n} repairs to be counted"), deadline, || {
            self.state().filter(|s| s["repairs"].as_u64() >= Some(n) && s["last_error"].is_null())
        })
    }

    /// Waits until the state file says `route`; returns the state.
    pub fn wait_route(&self, route: &str, deadline: Duration) -> Value {
        wait_for(&format!("route {route}"), deadline, || {
            self.state().filter(|s| s["route"] == route)
        })
    }

    /// Sends `signal` and waits for the exit status.
    pub fn stop(&mut self, signal: nix::sys::signal::Signal) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("agent running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, signal);
        child.wait().expect("wait for agent")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How much the agent has logged so far, for [`Agent::switch_after`].
    pub fn log_mark(&self) -> usize {
        self.log_text().len()
    }

    /// The first route change to `to` the agent logged after `mark` (from [`Agent::log_mark`]),
    /// by its own counts: the streak of probe stream `stream` (`cache udp`, `cache tcp`,
    /// `upstream`) it decided on, and the failed probes of `stream` it logged from `mark` until
    /// then. `None` until that change is logged.
    pub fn switch_after(&self, mark: usize, to: &str, stream: &str) -> Option<Switch> {
        let log = self.log_text();
        let mut failed = 0;
        for line in log.get(mark..)?.lines() {
            if line.contains("probe failed") && line.contains(&format!("stream={stream} ")) {
                failed += 1;
            }
            if !(line.contains("route changed") && line.contains(&format!(" to={to} "))) {
                continue;
            }
            // `evidence=cache udp +0/-3, cache tcp +1/-0, upstream +9/-0`
            let evidence = line.split_once("evidence=")?.1;
            let streak =
                evidence.split(", ").find_map(|s| s.strip_prefix(stream)?.strip_prefix(" +"));
            let (good, bad) = streak?.split_once("/-")?;
            let (good, bad) = (good.parse().ok()?, bad.trim().parse().ok()?);
            return Some(Switch { good, bad, failed, line: line.to_owned() });
        }
        None
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("agent log:\n{}", self.log_text());
        }
    }
}

/// A route change as the agent logged it: see [`Agent::switch_after`].
#[derive(Debug)]
pub struct Switch {
    /// The stream's streak of good and of failed probes when the agent decided.
    pub good: u32,
    pub bad: u32,
    /// The stream's failed probes logged from the mark until the change.
    pub failed: u32,
    /// The log line.
    pub line: String,
}

/// A child process, killed (by pid) and reaped on drop.
pub struct Proc(Option<Child>);

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        Proc(Some(cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"))))
    }

    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }

    pub fn wait(mut self) -> std::process::ExitStatus {
        self.0.take().expect("running").wait().expect("wait")
    }

    /// The child, no longer killed on drop (to hand it to an [`Agent`], say).
    pub fn into_child(mut self) -> Child {
        self.0.take().expect("running")
    }

    /// Its exit status, if it has exited (reaped then); `None` while it runs.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().expect("started").try_wait().expect("try_wait")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
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

    /// Waits (5 s at most) for a timeline line with answers from the cache.
    pub fn wait_cache_answers(&mut self) {
        self.wait_line("answers from the cache", Duration::from_secs(5), |l| {
            field(l, "cache").is_some_and(|n| n > 0)
        });
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

/// Prints when the lost first attempts in `lost` were sent, against a kill and its end.
pub fn print_lost(lost: &[u64], killed_at: u64, gone_at: u64) {
    let offsets: Vec<i64> = lost.iter().map(|&t| t as i64 - killed_at as i64).collect();
    println!(
        "first attempts lost: {} (sent at {offsets:?} ms from the SIGKILL; gone {} ms after it)",
        lost.len(),
        gone_at - killed_at
    );
}

impl SimNode {
    /// `GET path` on the agent's metrics address in the node namespace: (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        let script = format!(
            "exec 3<>/dev/tcp/127.0.0.1/9254 && printf 'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n' >&3 && cat <&3"
        );
        let out = self.run("node", "bash", &["-c", &script]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        (status, body)
    }

    /// Nothing of the agent's anywhere in the node's netfilter: nftables (iptables-nft
    /// included) and iptables-legacy, both families.
    pub fn assert_nothing_left(&self) {
        let ruleset = self.run("node", "nft", &["list", "ruleset"]);
        let text = String::from_utf8_lossy(&ruleset.stdout);
        assert!(!text.contains("nodelocaldns-ha"), "nftables still has the agent's table:\n{text}");
        assert!(
            !text.contains("NODELOCALDNS-HA"),
            "iptables-nft still has the agent's chains:\n{text}"
        );
        for save in ["iptables-legacy-save", "ip6tables-legacy-save"] {
            let out = self.run("node", save, &[]);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                !text.contains("NODELOCALDNS-HA"),
                "{save} still has the agent's chains:\n{text}"
            );
        }
    }

    /// Runs the agent binary's CLI in the node namespace.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.run("node", agent_exe(), args)
    }
}

impl SimNode {
    /// Like [`SimNode::up_with`] with a prefix of the caller's (benchmarks pick theirs, so a
    /// wrapper script can clean up after a crash), state under `<tmp>/nlha-bench/PREFIX`.
    pub fn up_prefixed(prefix: &str, options: &[&str]) -> SimNode {
        SimNode::start(prefix.to_owned(), "nlha-bench", options)
    }
}

impl Agent {
    /// The agent's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Load {
    /// Stops a client started with a long `--duration` (SIGINT: it starts no more lookups and
    /// waits for those in flight) and returns its summary.
    pub fn interrupt(self) -> Value {
        let pid = nix::unistd::Pid::from_raw(self.child.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        self.finish()
    }
}

impl Load {
    /// [`Load::interrupt`], with every lookup, in the order they started.
    pub fn interrupt_recorded(self) -> (Value, Vec<Lookup>) {
        let pid = nix::unistd::Pid::from_raw(self.child.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        self.finish_recorded()
    }
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

/// What a benchmark's report says of where it ran.
pub struct Machine {
    /// Today, `YYYY-MM-DD` (UTC).
    pub date: String,
    pub cores: usize,
    /// `uname -r`.
    pub kernel: String,
}

impl Machine {
    pub fn this() -> Machine {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let date = Command::new("date").args(["-u", "+%Y-%m-%d"]).output();
        let date = date.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        Machine { date: date.unwrap_or_default(), cores, kernel: kernel.trim().to_owned() }
    }
}
