//! The agent under test: started in the node namespace, its state file and log read back, killed
//! when the handle is dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::binaries::agent_exe;
use crate::clock::wait_for;
use crate::simnode::{
    describe, SimNode, CACHE_ANSWER, CLUSTER_DNS_IP, COREDNS_ANSWER, LOCAL_IP, UPSTREAM_IP,
};

impl SimNode {
    /// Starts the agent in the node namespace with the default test settings plus `extra`.
    pub fn agent(&self, extra: &[&str]) -> Agent {
        self.agent_for(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, extra)
    }

    /// Starts the agent for the given (comma-separated, dual-stack) addresses; `cluster_dns`
    /// empty: the link-local shape (no `--cluster-dns-ip`).
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
        let launch = self.cmd("node", agent_exe());
        self.spawn_agent(launch, local, cluster_dns, upstream, extra, env, true)
    }

    /// Starts the agent by `launch` (the agent's binary, or a command that ends by running it
    /// with the arguments that follow).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn spawn_agent(
        &self,
        launch: Command,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        wait_local: bool,
    ) -> Agent {
        let state_dir = self.dir.join("agent-state");
        let log = self.dir.join("agent.log");
        let mut launch = launch;
        let child = launch
            .args(["run", "--local-ip", local])
            // None: the link-local shape.
            .args(if cluster_dns.is_empty() {
                vec![]
            } else {
                vec!["--cluster-dns-ip", cluster_dns]
            })
            // None: from the environment (`KUBE_DNS_UPSTREAM_SERVICE_HOST`), as in a pod.
            .args(if upstream.is_empty() { vec![] } else { vec!["--upstream-ip", upstream] })
            .args(["--probe-name", "who.test"])
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
            agent.wait_listening();
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
        self.starting(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, extra, env)
    }

    /// [`SimNode::agent_starting`] for the given (comma-separated, dual-stack) addresses.
    pub fn agent_starting_for(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
    ) -> Agent {
        self.starting(local, cluster_dns, upstream, extra, &[])
    }

    /// Starts the agent for the given addresses (as [`SimNode::agent_for`]) as the first
    /// process of the cgroup `cgroup` (a directory of a cgroup v1 hierarchy, or v2), which it
    /// joins before it execs the agent: every page the agent ever touches is charged there.
    pub fn agent_in_cgroup(
        &self,
        cgroup: &std::path::Path,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
    ) -> Agent {
        let mut launch = Command::new("sh");
        launch.args(["-c", r#"echo $$ > "$0/cgroup.procs" && exec "$@""#]).arg(cgroup);
        launch.args(["ip", "netns", "exec", &self.ns("node"), agent_exe()]);
        self.spawn_agent(launch, local, cluster_dns, upstream, extra, &[], true)
    }

    /// The earlier agent's state file removed, then an agent started without waiting for a route.
    fn starting(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let _ = std::fs::remove_file(self.dir.join("agent-state").join("state.json"));
        let launch = self.cmd("node", agent_exe());
        self.spawn_agent(launch, local, cluster_dns, upstream, extra, env, false)
    }

    /// Starts the agent again with the same state directory (v4, nftables unless `extra` says
    /// otherwise), without assuming its first route; returns once it has written its own state
    /// (a `pid` other than `previous`).
    pub fn agent_restarting(&self, extra: &[&str], previous: &Value) -> Agent {
        self.agent_restarting_for(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, extra, previous)
    }

    /// [`SimNode::agent_restarting`] for the given addresses (`cluster_dns` empty: the
    /// link-local shape).
    pub fn agent_restarting_for(
        &self,
        local: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
        previous: &Value,
    ) -> Agent {
        let launch = self.cmd("node", agent_exe());
        let agent = self.spawn_agent(launch, local, cluster_dns, upstream, extra, &[], false);
        wait_for("the restarted agent's state", Duration::from_secs(10), || {
            agent.state().filter(|s| s["pid"] != previous["pid"])
        });
        agent.wait_listening();
        agent
    }
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

    /// The agent's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Waits until the control socket takes a connection. It listens a moment after the state
    /// is written, and an earlier agent's socket file may still be there: a `flip` or
    /// `release` sent before then finds the agent's lock but nobody answering, and fails (CI
    /// saw it once, after a restart).
    fn wait_listening(&self) {
        let socket = self.state_dir.join("control.sock");
        wait_for("the control socket", Duration::from_secs(10), || {
            std::os::unix::net::UnixStream::connect(&socket).ok().map(drop)
        });
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

    /// Waits until the state has warnings (`any`), or none; returns the state.
    pub fn wait_warnings(&self, any: bool, deadline: Duration) -> Value {
        let what = if any { "a warning" } else { "the warnings to clear" };
        wait_for(what, deadline, || {
            let has = |s: &Value| s["warnings"].as_array().is_some_and(|w| !w.is_empty());
            self.state().filter(|s| has(s) == any)
        })
    }

    /// Waits until the state reports the leftovers of another backend found and removed;
    /// returns the state.
    pub fn wait_leftovers_removed(&self, deadline: Duration) -> Value {
        wait_for("the leftovers to be removed", deadline, || {
            self.state().filter(|s| s["leftovers"].to_string().contains("found and removed"))
        })
    }

    /// Waits until the state file says `route`; returns the state.
    pub fn wait_route(&self, route: &str, deadline: Duration) -> Value {
        wait_for(&format!("route {route}"), deadline, || {
            self.state().filter(|s| s["route"] == route)
        })
    }

    /// Waits until the agent has settled on `Local`: its last `good` probes of the cache
    /// answered; returns the state. A host that starves the agent and the cache while they
    /// start (a TCG guest) can make the cache miss `fall` probes in the first seconds, a switch
    /// and back that is the probes doing their job; a test that checks something else counts
    /// from here.
    pub fn wait_settled(&self, good: u64, deadline: Duration) -> Value {
        wait_for("the agent settled on local", deadline, || {
            let streak = |s: &Value| s["probes"]["cache_udp"]["streak_good"].as_u64();
            self.state().filter(|s| s["route"] == "local" && streak(s) >= Some(good))
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

impl Switch {
    /// Asserts that the stall watch made this change, under traffic, before the probes could:
    /// the cache's socket stopped draining and a confirm probe went unanswered, with fewer than
    /// `fall` (3) failed probes of the stream, the stall's own report included.
    pub fn assert_stalled(&self) {
        assert!(
            self.line.contains("the cache stopped reading") && self.bad < 3 && self.failed < 3,
            "not the stall watch's switch (failed probes {}, streak -{}): {}",
            self.failed,
            self.bad,
            self.line
        );
    }
}

/// A kernel that refuses the link-local fallback's rules (no TPROXY) costs only the link-local
/// failover. In the link-local shape, where nothing else could fail over, the agent exits 1
/// naming what the kernel lacks, and has changed nothing. In the ClusterIP shape it runs on
/// without the link-local failover and says why in `shape:`; nothing of TPROXY is installed,
/// and pods on the ClusterIP get the cache, then CoreDNS once it is killed. `refusing(on)`
/// makes the kernel refuse (or stop refusing, so that what is left can be checked) where it
/// does not by itself; `extra` goes on the agent's command line.
pub fn fallback_refused(node: &SimNode, dataplane: &str, extra: &[&str], refusing: &dyn Fn(bool)) {
    refusing(true);
    let dir = node.dir.join("refused-state").display().to_string();
    let run = ["run", "--local-ip", LOCAL_IP, "--upstream-ip", UPSTREAM_IP];
    let flags = [&["--dataplane", dataplane][..], extra].concat();
    let named = ["--probe-name", "who.test", "--state-dir", &dir];
    // Bounded: an agent that did not see the refusal would retry its install for ever.
    let bounded = [&["60", agent_exe()][..], &run, &flags, &named].concat();
    let out = node.run("node", "timeout", &bounded);
    assert_eq!(out.status.code(), Some(1), "(124: still running after 60 s) {}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("the link-local shape, refused: {stderr}");
    assert!(stderr.contains("refuses the link-local fallback's rules"), "{stderr}");
    assert!(stderr.contains("nft_tproxy") && stderr.contains("xt_TPROXY"), "{stderr}");
    refusing(false);
    node.assert_nothing_left();

    refusing(true);
    let agent = node.agent(&flags);
    let st = agent.state().expect("the agent's state");
    let shape = st["shape"].as_str().unwrap_or_default();
    println!("the ClusterIP shape: {shape}");
    assert!(shape.contains("not failed over") && shape.contains("refuses"), "{st}");
    for (program, args) in [("nft", &["list", "ruleset"][..]), ("iptables-legacy-save", &[])] {
        let out = node.run("node", program, args);
        let text = String::from_utf8_lossy(&out.stdout).to_lowercase();
        assert!(!text.contains("tproxy"), "{program}:\n{text}");
    }
    // The ClusterIP failover works as ever: a crash (which the kernel fast path alone would
    // survive) and a hang (which only the agent's switch does).
    let route = Duration::from_secs(30);
    agent.wait_settled(10, route);
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), CACHE_ANSWER);
    node.kill("cache-kill");
    agent.wait_route("upstream", route);
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER);
    node.script(&["cache-start"]);
    agent.wait_route("local", route);
    node.signal("cache-stop");
    agent.wait_route("upstream", route);
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER);
    node.signal("cache-cont");
    agent.wait_route("local", route);
    refusing(false);
    node.tear_down(agent);
}
