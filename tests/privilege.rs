//! Least privilege: the agent does its whole job (starts, installs its rules, fails over on a
//! cache crash and comes back, obeys `flip`, stops, is torn down) with nothing but the
//! capabilities its backend needs, as root with a reduced bounding set (how the DaemonSet runs
//! it: uid 0, `drop: ALL`, `add: NET_ADMIN, NET_RAW, NET_BIND_SERVICE`) and as another user with ambient
//! capabilities. Its control socket serves root only, and its metrics endpoint listens on
//! loopback unless told otherwise.
//!
//! What each backend needs, as these tests establish it:
//! * nftables and iptables-nft: CAP_NET_ADMIN and CAP_NET_BIND_SERVICE (the link-local
//!   forwarder listens on port 53; without it only the link-local failover is off, and said);
//! * iptables-legacy: CAP_NET_RAW too (libiptc uses a raw socket);
//! * `teardown` on a node with iptables-legacy installed: CAP_NET_RAW too (it cleans every
//!   backend), and without it, it refuses before removing anything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use nix::sys::signal::Signal;
use testkit::*;

const NOBODY: u32 = 65534;

/// How the agent is run: as which user, with which capabilities, through which tool.
#[derive(Clone, Copy, Debug)]
struct Privileges {
    uid: u32,
    /// Capability names as setpriv and capsh spell them, without `cap_`.
    caps: &'static [&'static str],
    /// capsh instead of setpriv (root only).
    capsh: bool,
}

impl Privileges {
    /// The effective set these should leave, as `/proc/PID/status` shows it.
    fn mask(&self) -> u64 {
        self.caps.iter().map(|c| 1u64 << cap_bit(c)).fold(0, |a, b| a | b)
    }

    fn has(&self, cap: &str) -> bool {
        self.caps.contains(&cap)
    }

    /// The command prefix that drops everything else; `program args…` follow it.
    fn wrapper(&self) -> Vec<String> {
        let list: Vec<String> = self.caps.iter().map(|c| format!("+{c}")).collect();
        let keep =
            if list.is_empty() { "-all".to_owned() } else { format!("-all,{}", list.join(",")) };
        if self.capsh {
            assert_eq!(self.uid, 0, "capsh is used as root");
            let drop: Vec<String> = bounding_set()
                .into_iter()
                .filter(|c| !self.caps.iter().any(|k| c == &format!("cap_{k}")))
                .collect();
            return vec![
                "capsh".into(),
                format!("--drop={}", drop.join(",")),
                "--".into(),
                "-c".into(),
                "exec \"$0\" \"$@\"".into(),
            ];
        }
        let mut w = vec!["setpriv".to_owned()];
        if self.uid != 0 {
            w.extend([
                format!("--reuid={}", self.uid),
                format!("--regid={}", self.uid),
                "--clear-groups".to_owned(),
                format!("--ambient-caps={keep}"),
            ]);
        }
        w.extend([
            format!("--inh-caps={}", if self.uid == 0 { "-all".to_owned() } else { keep.clone() }),
            format!("--bounding-set={keep}"),
            "--no-new-privs".to_owned(),
            "--".to_owned(),
        ]);
        w
    }
}

fn cap_bit(name: &str) -> u32 {
    match name {
        "net_bind_service" => 10,
        "net_admin" => 12,
        "net_raw" => 13,
        other => panic!("unknown capability {other}"),
    }
}

/// This process's bounding set, as capsh names it.
fn bounding_set() -> Vec<String> {
    let out = Command::new("capsh").arg("--print").output().expect("capsh (libcap2-bin) runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("Bounding set =")).expect("a bounding set");
    line.split(',').map(|c| c.trim().to_owned()).filter(|c| !c.is_empty()).collect()
}

/// `Uid:` and `CapEff:` of the running agent, from `/proc`.
fn identity(agent: &Agent) -> (u32, u64) {
    let pid = agent.pid().expect("running");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).unwrap().trim();
    let uid = field("Uid:").split_whitespace().nth(1).unwrap().parse().unwrap();
    let caps = u64::from_str_radix(field("CapEff:"), 16).unwrap();
    (uid, caps)
}

/// A directory (or file) under the node's run directory that `uid` owns.
fn owned(node: &SimNode, name: &str, uid: u32, dir: bool) -> PathBuf {
    let path = node.dir.join(name);
    if dir {
        std::fs::create_dir_all(&path).unwrap();
    } else {
        std::fs::write(&path, b"").unwrap();
    }
    let id = Some(nix::unistd::Uid::from_raw(uid));
    nix::unistd::chown(&path, id, Some(nix::unistd::Gid::from_raw(uid))).unwrap();
    path
}

/// `ip netns exec NODE <wrapper> program args…`, with the node's own xtables lock.
fn wrapped(node: &SimNode, p: Privileges, lock: &Path, program: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &node.ns("node")]).args(p.wrapper()).arg(program).args(args);
    c.env("XTABLES_LOCKFILE", lock);
    c
}

fn start(node: &SimNode, p: Privileges, dataplane: &str, tag: &str) -> Agent {
    let state_dir = owned(node, &format!("state-{tag}"), p.uid, true);
    let lock = owned(node, &format!("xtables-{tag}.lock"), p.uid, false);
    let log = node.dir.join(format!("agent-{tag}.log"));
    let dir = state_dir.display().to_string();
    let args = [
        "run",
        "--local-ip",
        LOCAL_IP,
        "--cluster-dns-ip",
        CLUSTER_DNS_IP,
        "--upstream-ip",
        UPSTREAM_IP,
        "--probe-name",
        "who.test",
        "--dataplane",
        dataplane,
        "--min-hold",
        "500ms",
        "--state-dir",
        &dir,
    ];
    let child = wrapped(node, p, &lock, agent_exe(), &args)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start the agent");
    Agent::adopt(child, state_dir, log)
}

/// Who answers a pod's query for who.test at the cluster-DNS IP.
fn pod_answer(node: &SimNode) -> String {
    let out =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=2", "@10.96.0.10", "who.test"]);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Everything of the agent's left in netfilter (nftables and both iptables flavours).
fn leftovers(node: &SimNode) -> Vec<String> {
    let mut found = Vec::new();
    if node.agent_table().is_some() {
        found.push("table inet nodelocaldns-ha".to_owned());
    }
    for save in ["iptables-legacy-save", "iptables-nft-save"] {
        let out = node.run("node", save, &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        found.extend(
            text.lines().filter(|l| l.contains("NODELOCALDNS-HA")).map(|l| format!("{save}: {l}")),
        );
    }
    found
}

fn iptables_legacy_installed() -> bool {
    Command::new("sh")
        .args(["-c", "command -v iptables-legacy-save"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The whole job under `p` with `dataplane`: start, fail over and back, flip and release as an
/// operator, stop, tear down. Returns the agent's warnings, for the report.
fn full_cycle(node: &SimNode, p: Privileges, dataplane: &str, tag: &str) -> Vec<String> {
    let mut agent = start(node, p, dataplane, tag);
    let what = format!("{p:?} --dataplane {dataplane}");
    let st = agent.wait_route("local", Duration::from_secs(10));
    let (uid, caps) = identity(&agent);
    assert_eq!((uid, caps), (p.uid, p.mask()), "{what}: the agent runs with more than it should");
    println!("{what}: uid {uid}, CapEff {caps:#x}, dataplane {}", st["dataplane"]);
    assert_eq!(pod_answer(node), CACHE_ANSWER, "{what}");

    // The cache crashes: the route follows, pods get CoreDNS; it comes back: the cache again.
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    assert_eq!(pod_answer(node), COREDNS_ANSWER, "{what}");
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(pod_answer(node), CACHE_ANSWER, "{what}");

    // The operator (root) flips and releases through the control socket.
    let dir = agent.state_dir.display().to_string();
    let out = node.cli(&["flip", "upstream", "--reason", "privilege test", "--state-dir", &dir]);
    assert!(out.status.success(), "{what}: {}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(2));
    let out = node.cli(&["release", "--state-dir", &dir]);
    assert!(out.status.success(), "{what}: {}", describe(&out));
    agent.wait_route("local", Duration::from_secs(5));
    assert_eq!(node.http_get("/healthz").0, 200, "{what}");

    // Nothing it needs was out of reach: no watcher fell back, nothing panicked.
    let log = agent.log_text();
    for sign in ["unavailable", "panicked", "failed; relying on", "applying the ruleset failed"] {
        assert!(!log.contains(sign), "{what}: {sign:?} in the log:\n{log}");
    }
    let warnings: Vec<String> =
        log.lines().filter(|l| l.contains(" WARN ")).map(|l| l.to_owned()).collect();
    let status = agent.stop(Signal::SIGTERM);
    assert!(status.success(), "{what}: stopped with {status}");

    // Teardown with the same privileges. Where iptables-legacy is installed it needs
    // CAP_NET_RAW; without, it says so and removes nothing.
    let lock = node.dir.join(format!("xtables-{tag}.lock"));
    let out =
        wrapped(node, p, &lock, agent_exe(), &["teardown", "--state-dir", &dir]).output().unwrap();
    if iptables_legacy_installed() && !p.has("net_raw") {
        assert_eq!(out.status.code(), Some(2), "{what}: {}", describe(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("missing capability CAP_NET_RAW") && stderr.lines().count() == 1,
            "{stderr}"
        );
        assert!(!leftovers(node).is_empty(), "{what}: a refused teardown removed something");
        let out = node.cli(&["teardown", "--state-dir", &dir]);
        assert!(out.status.success(), "{}", describe(&out));
    } else {
        assert!(out.status.success(), "{what}: teardown: {}", describe(&out));
    }
    assert_eq!(leftovers(node), Vec::<String>::new(), "{what}");
    warnings
}

const ROOT_NET_ADMIN: Privileges =
    Privileges { uid: 0, caps: &["net_admin", "net_bind_service"], capsh: false };
const ROOT_BOTH: Privileges =
    Privileges { uid: 0, caps: &["net_admin", "net_raw", "net_bind_service"], capsh: false };

#[test]
fn nftables_and_iptables_nft_need_cap_net_admin_and_net_bind_service() {
    let node = SimNode::up();
    full_cycle(&node, ROOT_NET_ADMIN, "nftables", "a");
    full_cycle(&node, ROOT_NET_ADMIN, "iptables-nft", "b");
    // The same through capsh.
    let capsh = Privileges { capsh: true, ..ROOT_NET_ADMIN };
    full_cycle(&node, capsh, "nftables", "c");
}

/// Without CAP_NET_BIND_SERVICE (an older DaemonSet) the forwarder cannot listen on port 53. In
/// the ClusterIP shape the agent runs on without the link-local failover: no fallback chain
/// (nothing TPROXYed to a forwarder that is not there), and `status` says why. In the link-local
/// shape there would be nothing left to do: it exits (1) naming the capability.
#[test]
fn without_net_bind_service_the_link_local_failover_is_off_and_said() {
    let node = SimNode::up();
    let p = Privileges { uid: 0, caps: &["net_admin"], capsh: false };
    let agent = start(&node, p, "nftables", "i");
    let st = agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(identity(&agent), (0, p.mask()));
    let shape = st["shape"].as_str().unwrap();
    assert!(shape.contains("not failed over") && shape.contains("CAP_NET_BIND_SERVICE"), "{st}");
    let table = node.agent_table().expect("the agent's table");
    assert!(table.contains("10.96.0.10") && !table.contains("tproxy"), "{table}");
    assert_eq!(pod_answer(&node), CACHE_ANSWER);
    drop(agent);
    let out = node.cli(&["teardown", "--state-dir", "/nonexistent-nlha"]);
    assert!(out.status.success(), "{}", describe(&out));

    let lock = node.dir.join("xtables-j.lock");
    let args = ["run", "--local-ip", LOCAL_IP, "--upstream-ip", UPSTREAM_IP];
    let dir = owned(&node, "state-j", 0, true).display().to_string();
    let args = [&args[..], &["--dataplane", "nftables", "--state-dir", &dir]].concat();
    let out = wrapped(&node, p, &lock, agent_exe(), &args).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("CAP_NET_BIND_SERVICE"), "{stderr}");
}

#[test]
fn iptables_legacy_and_the_daemonsets_privileges() {
    // A node whose kube-proxy uses iptables-legacy: with NET_ADMIN and NET_RAW (the
    // DaemonSet's), `auto` finds it and uses it.
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    full_cycle(&node, ROOT_BOTH, "iptables-legacy", "d");
    let mut agent = start(&node, ROOT_BOTH, "auto", "e");
    let st = agent.wait_route("local", Duration::from_secs(10));
    assert_eq!(st["dataplane"], "iptables-legacy", "{st}");
    assert!(agent.stop(Signal::SIGTERM).success());
    let out = node.cli(&["teardown", "--state-dir", &agent.state_dir.display().to_string()]);
    assert!(out.status.success(), "{}", describe(&out));

    // Without NET_RAW, `auto` cannot see iptables-legacy's rules: it says so (a warning in the
    // log and in `status`) and falls back to what it can see.
    let mut agent = start(&node, ROOT_NET_ADMIN, "auto", "f");
    let st = agent.wait_route("local", Duration::from_secs(10));
    wait_for("the warning", Duration::from_secs(5), || {
        agent
            .log_text()
            .contains("cannot read the node's iptables rules (CAP_NET_RAW missing?")
            .then_some(())
    });
    println!(
        "auto without NET_RAW on a legacy node picked {} ({})",
        st["dataplane"], st["dataplane_why"]
    );
    assert!(agent.stop(Signal::SIGTERM).success());
    let out = node.cli(&["teardown", "--state-dir", &agent.state_dir.display().to_string()]);
    assert!(out.status.success(), "{}", describe(&out));
}

#[test]
fn a_user_who_is_not_root_runs_it_with_ambient_capabilities() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let nobody = Privileges { uid: NOBODY, caps: &["net_admin", "net_bind_service"], capsh: false };
    for warning in full_cycle(&node, nobody, "nftables", "g") {
        println!("not root, nftables: {warning}");
    }
    let caps = &["net_admin", "net_raw", "net_bind_service"];
    let nobody_raw = Privileges { uid: NOBODY, caps, capsh: false };
    for warning in full_cycle(&node, nobody_raw, "iptables-legacy", "h") {
        println!("not root, iptables-legacy: {warning}");
    }
}

/// Runs the agent binary's CLI in the node's namespace as nobody.
fn as_nobody(node: &SimNode, args: &[&str]) -> Output {
    let ids = ["--reuid=65534", "--regid=65534", "--clear-groups", agent_exe()];
    node.run("node", "setpriv", &[&ids[..], args].concat())
}

#[test]
fn only_root_may_use_the_control_socket() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    let dir = agent.state_dir.display().to_string();
    let socket = agent.state_dir.join("control.sock");
    wait_for("the control socket", Duration::from_secs(5), || {
        std::os::unix::net::UnixStream::connect(&socket).ok()
    });
    // The socket's mode keeps others out...
    let out = as_nobody(&node, &["flip", "upstream", "--state-dir", &dir]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(stderr.contains("Permission denied") && stderr.contains("root only"), "{stderr}");
    // ...and should it ever be looser, the agent checks who is calling (SO_PEERCRED).
    std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let out = as_nobody(&node, &["flip", "upstream", "--state-dir", &dir]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(stderr.contains("only root may control the agent"), "{stderr}");
    assert!(agent.log_text().contains("refused a control connection: not root"));
    assert_eq!(agent.state().unwrap()["route"], "local");
    // Root may.
    let out = node.cli(&["flip", "upstream", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(2));
}

/// The agent's listening TCP sockets, as `ss` shows them in the node's namespace, sorted.
fn listening(node: &SimNode, pid: u32) -> Vec<String> {
    let out = node.run("node", "ss", &["-Hltnp"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let mine = format!("pid={pid},");
    let mut found: Vec<String> = text
        .lines()
        .filter(|l| l.contains(&mine))
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .collect();
    found.sort();
    found
}

/// From pod1: `GET /healthz` at `addr`'s port 9254; the status line, or what went wrong.
fn healthz_from_pod(node: &SimNode, ip: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/{ip}/9254 || exit 7; printf 'GET /healthz HTTP/1.1\\r\\n\\r\\n' >&3; \
         timeout 5 head -c 12 <&3"
    );
    let out = node.run("pod1", "bash", &["-c", &script]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn metrics_listen_on_loopback_unless_told_otherwise() {
    let node = SimNode::up();
    let mut agent = node.agent(&[]);
    let pid = agent.pid().unwrap();
    let found = wait_for("the agent to listen", Duration::from_secs(5), || {
        Some(listening(&node, pid)).filter(|l| !l.is_empty())
    });
    // The metrics endpoint, and the link-local forwarder on an address of its own in 127/8.
    assert_eq!(found, ["127.0.0.1:9254", "127.53.0.53:53"], "listening beyond loopback");
    // The node's address on the pods' side: nothing listens there for a pod.
    assert_eq!(healthz_from_pod(&node, "10.244.0.1"), "");
    agent.stop(Signal::SIGTERM);
    drop(agent);

    // Asked for an address the pods can reach, it serves there and only there.
    let agent = node.agent(&["--metrics-addr", "10.244.0.1:9254"]);
    let pid = agent.pid().unwrap();
    let found = wait_for("the agent to listen", Duration::from_secs(5), || {
        Some(listening(&node, pid)).filter(|l| !l.is_empty())
    });
    assert_eq!(found, ["10.244.0.1:9254", "127.53.0.53:53"]);
    assert_eq!(healthz_from_pod(&node, "10.244.0.1"), "HTTP/1.1 200");
}
