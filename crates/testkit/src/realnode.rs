//! The real node: `testdata/realnode.sh`'s kubelet and containerd in network namespaces, with a
//! control plane of their own, running node-local-dns (the real node-cache), kube-proxy,
//! CoreDNS and the clients as pods; the agent installed from the chart by the tests. What the
//! tests do there goes through the cluster's own tools (kubectl, helm), as an operator's would.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::binaries::dnsload_exe;
use crate::load::{field, origins, Load, Lookup};
use crate::simnode::{describe, repo};

/// A real node, up until dropped (`realnode.sh down`: every process of it by its cgroup, the
/// namespaces, the cgroups, the mount points). What is done on it: [`Cluster`].
pub struct RealNode(Cluster);

/// What a test does on a real node: the cluster's tools, its pods, the node's namespaces.
#[derive(Clone)]
pub struct Cluster {
    prefix: String,
    /// The node's state directory (`REALNODE_DIR/PREFIX`): its logs are under `log/`.
    pub dir: PathBuf,
}

impl std::ops::Deref for RealNode {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.0
    }
}

impl RealNode {
    /// Brings a real node up (`realnode.sh up PREFIX OPTIONS`), its clients' image carrying this
    /// build's dnsload. Panics with the script's output if it does not come up.
    pub fn up(options: &[&str]) -> RealNode {
        RealNode::up_prefixed(&format!("r{:05x}", std::process::id() & 0xfffff), options)
    }

    /// [`RealNode::up`] with namespaces `PREFIX-*` (1-8 characters of [a-z0-9]), for a caller
    /// that cleans up after a kill by that name.
    pub fn up_prefixed(prefix: &str, options: &[&str]) -> RealNode {
        crate::require_root();
        let prefix = prefix.to_string();
        let base = std::env::temp_dir().join("nlha-realnode");
        let node = RealNode(Cluster { dir: base.join(&prefix), prefix });
        let started = Instant::now();
        let out = node.script_cmd("up", options).env("REALNODE_DNSLOAD", dnsload_exe()).output();
        let out = out.expect("run testdata/realnode.sh up");
        assert!(out.status.success(), "realnode.sh up failed:\n{}", describe(&out));
        eprintln!(
            "realnode {} up in {:.1} s:\n{}",
            node.prefix,
            started.elapsed().as_secs_f64(),
            String::from_utf8_lossy(&out.stderr)
        );
        node
    }

    /// Brings the node down now (also done on drop).
    pub fn down(self) {}
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if std::env::var_os("REALNODE_KEEP").is_some() {
            eprintln!("REALNODE_KEEP: realnode {} left up ({})", self.prefix, self.dir.display());
            return;
        }
        let out = self.run("down", &[]);
        if !out.status.success() {
            eprintln!("realnode.sh down {} failed:\n{}", self.prefix, describe(&out));
        }
    }
}

impl Cluster {
    fn script_cmd(&self, cmd: &str, args: &[&str]) -> Command {
        let mut c = Command::new(repo().join("testdata/realnode.sh"));
        c.arg(cmd).arg(&self.prefix).args(args);
        c.env("REALNODE_DIR", self.dir.parent().expect("the nodes' directory"));
        c
    }

    /// `realnode.sh CMD PREFIX ARGS...`, its output whatever it exits with.
    pub fn run(&self, cmd: &str, args: &[&str]) -> Output {
        self.script_cmd(cmd, args).output().unwrap_or_else(|e| panic!("realnode.sh {cmd}: {e}"))
    }

    /// `realnode.sh CMD PREFIX ARGS...`, panicking with its output unless it succeeds; its
    /// standard output.
    pub fn script(&self, cmd: &str, args: &[&str]) -> String {
        let out = self.run(cmd, args);
        assert!(out.status.success(), "realnode.sh {cmd} {args:?} failed:\n{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// kubectl as the cluster's admin; its standard output, panicking unless it succeeds.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.script("kubectl", args)
    }

    /// kubectl as the cluster's admin, whatever it exits with.
    pub fn try_kubectl(&self, args: &[&str]) -> Output {
        self.run("kubectl", args)
    }

    /// `kubectl get … -o json`, parsed.
    pub fn get_json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.kubectl(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}: {text}"))
    }

    /// helm as the cluster's admin, whatever it exits with.
    pub fn helm(&self, args: &[&str]) -> Output {
        self.run("helm", args)
    }

    /// A command in the node's network and mount namespaces, panicking unless it succeeds.
    pub fn in_node(&self, args: &[&str]) -> String {
        self.script("in-node", args)
    }

    /// The names of the pods of `namespace` with `selector` (`k8s-app=node-local-dns`), sorted.
    pub fn pods(&self, namespace: &str, selector: &str) -> Vec<String> {
        let out = self.kubectl(&[
            "-n",
            namespace,
            "get",
            "pods",
            "-l",
            selector,
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ]);
        let mut names: Vec<String> = out.split_whitespace().map(String::from).collect();
        names.sort();
        names
    }

    /// The one pod of `namespace` with `selector` that is not being deleted, waiting up to
    /// `deadline` for there to be exactly one.
    pub fn only_pod(&self, namespace: &str, selector: &str, deadline: Duration) -> String {
        let mut last = Value::Null;
        let found = crate::poll(deadline, || {
            last = self.get_json(&["-n", namespace, "get", "pods", "-l", selector]);
            let live: Vec<String> = last["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
                .collect();
            (live.len() == 1).then(|| live[0].clone())
        });
        found.unwrap_or_else(|| panic!("not exactly one pod {selector} in {namespace}: {last}"))
    }

    /// The pid (as the machine sees it) of `container`'s main process in `pod`.
    pub fn container_pid(&self, namespace: &str, pod: &str, container: &str) -> i32 {
        let out = self.script("container-pid", &[namespace, pod, container]);
        out.trim().parse().unwrap_or_else(|e| panic!("container-pid printed {out:?}: {e}"))
    }

    /// Waits up to `deadline` for `kubectl rollout status KIND/NAME` in `namespace` to succeed.
    pub fn wait_rollout(&self, namespace: &str, what: &str, deadline: Duration) {
        let timeout = format!("--timeout={}s", deadline.as_secs());
        let out = self.try_kubectl(&["-n", namespace, "rollout", "status", what, &timeout]);
        assert!(out.status.success(), "rollout of {what} in {namespace}:\n{}", describe(&out));
    }

    /// Starts dnsload in the client pod `pod`: glibc's getaddrinfo() of who.test through the
    /// resolv.conf the kubelet wrote, `rate` lookups a second, with a timeline line every 250 ms,
    /// until [`PodLoad::stop`]. It runs in the pod's network and mount namespaces, entered from
    /// the machine (`nsenter` into its container's): a `kubectl exec` stream would go with the
    /// kubelet when a test restarts it.
    pub fn load(&self, pod: &str, rate: u32) -> PodLoad {
        self.load_in("default", pod, "client", rate)
    }

    /// [`Cluster::load`] in `container` (of the client image) of `pod` in `namespace`.
    pub fn load_in(&self, namespace: &str, pod: &str, container: &str, rate: u32) -> PodLoad {
        let rate = rate.to_string();
        let args = ["--system-resolver", "--name", "who.test", "--rate", &rate];
        self.dnsload_in(namespace, pod, container, &args)
    }

    /// dnsload with `args` (what to ask and how fast) in `container` of `pod` in `namespace`,
    /// its lookups labelled by who answered, a timeline line every 250 ms, until
    /// [`PodLoad::stop`]: as [`Cluster::load`], whose client is glibc's; with `--server` it is
    /// dnsload's own glibc-like client, whose every attempt is seen.
    pub fn dnsload_in(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        args: &[&str],
    ) -> PodLoad {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let container = self.container_pid(namespace, pod, container);
        let in_pod = format!("/tmp/lookups-{n}.txt");
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &container.to_string(), "-n", "-m", "--", "/usr/local/bin/dnsload"]);
        cmd.args(args);
        cmd.args(["--duration", "1h", "--report-interval", "250ms", "--lookups-out", &in_pod]);
        cmd.args(origins());
        // nsenter execs dnsload: the child is dnsload itself, and its file is the pod's.
        let seen_from_here = PathBuf::from(format!("/proc/{container}/root{in_pod}"));
        let started = Instant::now();
        PodLoad { load: Load::spawn(&mut cmd, seen_from_here), started }
    }
}

/// dnsload running in a client pod ([`Cluster::load`]).
pub struct PodLoad {
    /// Its timeline lines, as they come (`wait_line`, `wait_alone`, …).
    pub load: Load,
    /// Just before it was started: its timeline's `t=` counts from a little after.
    started: Instant,
}

impl PodLoad {
    /// Waits up to `deadline` for a timeline line of a quarter second that begins after now
    /// in which the cache answered every lookup and none failed: the lines already out (those
    /// of before a fault, say) are not looked at.
    pub fn wait_back_on_cache(&mut self, deadline: Duration) {
        self.wait_answered_alone_by("cache", "coredns", deadline);
    }

    /// [`PodLoad::wait_back_on_cache`], for CoreDNS: a quarter second from now on in which
    /// CoreDNS answered every lookup (through kube-proxy, the cache out of pods' path).
    pub fn wait_on_coredns(&mut self, deadline: Duration) {
        self.wait_answered_alone_by("coredns", "cache", deadline);
    }

    fn wait_answered_alone_by(&mut self, who: &str, other: &str, deadline: Duration) {
        let now = self.started.elapsed().as_secs_f64();
        self.load.wait_line(&format!("{who} answering alone"), deadline, |l| {
            timeline_t(l).is_some_and(|t| t > now + 0.25)
                && field(l, who).is_some_and(|n| n > 0)
                && field(l, other) == Some(0)
                && field(l, "failed") == Some(0)
        });
    }

    /// Stops it (SIGINT: it starts no more lookups and waits for those in flight) and returns
    /// its summary and every lookup, in the order they started.
    pub fn stop(self) -> (Value, Vec<Lookup>) {
        self.load.interrupt_recorded()
    }
}

/// A timeline line's end (`t=  7.75s ...`: seconds since the client started).
fn timeline_t(line: &str) -> Option<f64> {
    line.strip_prefix("t=")?.trim_start().split('s').next()?.parse().ok()
}

/// The counts of a summary a test asserts, in one line: sent, failed, first attempts lost, who
/// answered, the longest lookup.
pub fn counts(summary: &Value) -> String {
    format!(
        "sent {} failed {} first_attempt_lost {} by_origin {} max {} ms",
        summary["sent"],
        summary["failed"],
        summary["first_attempt_lost"],
        summary["by_origin"],
        summary["latency_ms"]["max"]
    )
}
