//! The simulated node: `testdata/simnode.sh`'s namespaces (node, pod1, pod2, dns), kube-proxy's
//! rules, CoreDNS (dnsmasq) and the cache (unbound); commands run inside it and what its
//! netfilter holds.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::binaries::agent_exe;

/// The cache's listen address (node-local-dns's link-local IP).
pub const LOCAL_IP: &str = "169.254.20.10";
/// The kube-dns ClusterIP pods ask.
pub const CLUSTER_DNS_IP: &str = "10.96.0.10";
/// The kube-dns-upstream ClusterIP (CoreDNS, not intercepted).
pub const UPSTREAM_IP: &str = "10.96.0.11";
/// The address the cache answers for who.test, so a client sees who answered.
pub const CACHE_ANSWER: &str = "1.1.1.1";
/// The address CoreDNS answers for who.test.
pub const COREDNS_ANSWER: &str = "2.2.2.2";

/// The repository (this crate is `crates/testkit` in it): `testdata/simnode.sh` is there.
pub(crate) fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The directory of the real Kubernetes parts (`ci/k8s/build.sh --bin-dir`), built by a node
/// brought up with `--kube-proxy real-*`; or `NLHA_K8S_BIN`, where the host built them (the
/// ci/vm guest has no Go: [`real_parts_built`]).
pub fn real_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("NLHA_K8S_BIN") {
        return PathBuf::from(dir);
    }
    let out = Command::new(repo().join("ci/k8s/build.sh"))
        .arg("--bin-dir")
        .output()
        .expect("ci/k8s/build.sh");
    assert!(out.status.success(), "ci/k8s/build.sh --bin-dir: {}", describe(&out));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The real parts a node with `--kube-proxy real-*` runs, built here if they are not yet (as
/// `simnode.sh up` does), and their directory: for a guest to be given as `NLHA_K8S_BIN`. An
/// `NLHA_K8S_BIN` already set is taken as it is.
pub fn real_parts_built() -> PathBuf {
    if std::env::var_os("NLHA_K8S_BIN").is_some() {
        return real_bin();
    }
    let out = Command::new(repo().join("ci/k8s/build.sh"))
        .args(["etcd", "kube-apiserver", "kube-proxy", "kubectl", "coredns", "node-cache"])
        .output()
        .expect("ci/k8s/build.sh");
    assert!(out.status.success(), "ci/k8s/build.sh: a real part did not build: {}", describe(&out));
    real_bin()
}

impl SimNode {
    /// kubectl as the cluster's admin, from the node namespace, on a node with the real parts.
    pub fn kubectl(&self) -> Command {
        let mut c = self.cmd("node", real_bin().join("kubectl").to_str().expect("a UTF-8 path"));
        c.arg("--kubeconfig").arg(self.dir.join("admin.kubeconfig")).arg("--request-timeout=10s");
        c
    }

    /// [`SimNode::kubectl`] `args` with `input` on its stdin: its output, whatever its status.
    pub fn kubectl_input(&self, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .kubectl()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl");
        child.stdin.take().expect("stdin").write_all(input).expect("kubectl's stdin");
        child.wait_with_output().expect("kubectl")
    }
}

/// Fails loudly when not root: these tests exist to run on real netfilter.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "end-to-end tests need root (network namespaces, netfilter); run ci/test.sh as root"
    );
}

/// A unique, short namespace prefix for this process and test.
fn unique_prefix() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("t{}{}", std::process::id() % 100_000, (b'a' + (n % 26) as u8) as char)
}

/// One simulated node: namespaces node, pod1, pod2, dns.
pub struct SimNode {
    /// The namespaces' prefix: `PREFIX-node`, `PREFIX-pod1`, …
    pub prefix: String,
    /// Its run directory: the servers' pid files and logs, the agent's state and log.
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
        if options.iter().any(|o| o.starts_with("real-")) {
            // The cache is the real node-cache: the test's log says which (its first words).
            let log = std::fs::read_to_string(node.dir.join("cache.log")).unwrap_or_default();
            let started = log.lines().find(|l| l.contains("Starting node-cache image"));
            println!(
                "{}: {}",
                node.prefix,
                started.expect("node-cache's first words in cache.log")
            );
        }
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

    /// [`SimNode::expected_table`] for the given (comma-separated, dual-stack) addresses;
    /// `cluster_dns` empty: the link-local shape.
    pub fn expected_table_for(&self, route: &str, local: &str, cluster_dns: &str) -> String {
        let out = Command::new(agent_exe())
            .args(["rules", "--route", route, "--local-ip", local])
            .args(if cluster_dns.is_empty() {
                vec![]
            } else {
                vec!["--cluster-dns-ip", cluster_dns]
            })
            .output()
            .expect("run nodelocaldns-ha rules");
        assert!(out.status.success(), "{}", describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The agent's table as `nft -a list` prints it (every handle; counters zeroed): a table
    /// replaced by an apply, even by the same ruleset, gets new handles.
    pub fn agent_table_handles(&self) -> Option<String> {
        let out = self.run("node", "nft", &["-a", "list", "table", "inet", "nodelocaldns-ha"]);
        out.status.success().then(|| strip_counters(&String::from_utf8_lossy(&out.stdout)))
    }

    /// Like [`SimNode::up_with`] with a prefix of the caller's (benchmarks pick theirs, so a
    /// wrapper script can clean up after a crash), state under `<tmp>/nlha-bench/PREFIX`.
    pub fn up_prefixed(prefix: &str, options: &[&str]) -> SimNode {
        SimNode::start(prefix.to_owned(), "nlha-bench", options)
    }

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
    /// included) and iptables-legacy, both families; and no copy of a listen IP on lo (unless
    /// node-cache's addresses are there, `--listen-dev lo`), only the loopback addresses.
    pub fn assert_nothing_left(&self) {
        let listen_dev = std::fs::read_to_string(self.dir.join("listen-dev")).unwrap_or_default();
        if listen_dev.trim() != "lo" {
            let out = self.run("node", "ip", &["-o", "addr", "show", "dev", "lo"]);
            let text = String::from_utf8_lossy(&out.stdout);
            let others: Vec<&str> = text
                .lines()
                .filter(|l| !l.contains(" 127.0.0.1/8 ") && !l.contains(" ::1/128 "))
                .collect();
            assert!(others.is_empty(), "addresses of the agent's left on lo: {others:?}");
        }
        // The tables, not the whole ruleset: on the busy node, kube-proxy's nat table holds
        // 50,000 rules that `nft list ruleset` translates for minutes, restarting its dump
        // whenever kube-proxy rewrites them. The agent's chains are in raw, mangle and filter.
        let tables = self.run("node", "nft", &["list", "tables"]);
        let text = String::from_utf8_lossy(&tables.stdout);
        assert!(tables.status.success(), "{}", describe(&tables));
        assert!(!text.contains("nodelocaldns-ha"), "nftables still has the agent's table:\n{text}");
        for save in ["iptables-nft-save", "ip6tables-nft-save"] {
            for table in ["raw", "mangle", "filter"] {
                let out = self.run("node", save, &["-t", table]);
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(
                    !text.contains("NODELOCALDNS-HA"),
                    "{save} still has the agent's chains in {table}:\n{text}"
                );
            }
        }
        // Whole: naming a legacy table would make the kernel create it.
        for save in ["iptables-legacy-save", "ip6tables-legacy-save"] {
            let out = self.run("node", save, &[]);
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                !text.contains("NODELOCALDNS-HA"),
                "{save} still has the agent's chains:\n{text}"
            );
        }
    }

    /// Stops `agent`, runs `teardown` on its state directory, and asserts that it succeeded and
    /// left nothing ([`SimNode::assert_nothing_left`]).
    pub fn tear_down(&self, agent: crate::Agent) {
        let state_dir = agent.state_dir.display().to_string();
        drop(agent);
        let out = self.cli(&["teardown", "--state-dir", &state_dir]);
        assert!(out.status.success(), "teardown: {}", describe(&out));
        self.assert_nothing_left();
    }

    /// Runs the agent binary's CLI in the node namespace.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.run("node", agent_exe(), args)
    }

    /// The first line `dig +short` prints for who.test asked at `server` from `role`'s
    /// namespace (one try of 1 s): the answer's address, or empty.
    pub fn dig(&self, role: &str, server: &str) -> String {
        let out = self.run(
            role,
            "dig",
            &["+time=1", "+tries=1", "+short", &format!("@{server}"), "who.test"],
        );
        String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string()
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

/// Wrappers in `node`'s run directory for the installed binaries `names`, each appending
/// `<name> <args>` to `log` before it execs the real one; returns the `PATH` that puts them
/// first, for an agent started with it (what a test counts: the agent's child processes).
pub fn counting_wrappers(node: &SimNode, names: &[&str], log: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let wrappers = node.dir.join("wrappers");
    std::fs::create_dir_all(&wrappers).unwrap();
    for name in names {
        let real = ["/usr/sbin", "/sbin"]
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{name} is not installed"));
        let script = format!(
            "#!/bin/sh\necho \"{name} $*\" >>{}\nexec {} \"$@\"\n",
            log.display(),
            real.display()
        );
        let path = wrappers.join(name);
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    format!("{}:{}", wrappers.display(), std::env::var("PATH").unwrap_or_default())
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

/// A finished command's status and output, for an assertion's message.
pub fn describe(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
