//! The footprint part (issue 30, acceptance 6): the idle agent's CPU, its children (iptables)
//! included, at default settings, on each kind of node, side by side in one run: the nftables
//! node (kube-proxy in nftables mode), the iptables-nft node (the benchmark's own), a node
//! whose kube-proxy is iptables-legacy (`auto`, and `--dataplane nftables`), and the mixed node
//! (kubelet's canary chains in iptables-legacy; kube-proxy in iptables-nft with 50,000 nat
//! rules, INPUT policy DROP), idle and with kube-proxy syncing every second; and the real parts'
//! node (real kube-apiserver and kube-proxy, issue 33's acceptance 6), the agent with its API
//! client off (flags alone) and on (run as its pod: in-cluster configuration, its service
//! account's token and the component's RBAC, reports and the upstream Service followed). The
//! cases take turns, `rounds` times, so that other load on the machine falls on all of them
//! alike. In the same seconds as each case, the real node-cache of the real parts' node is
//! measured too: idle beside no agent (the other nodes' cases), or beside the agent it serves
//! (the real parts' cases, its probes answered): what the agent is held to.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::{clock_ticks_per_s, cpu_ticks, SimNode, CLUSTER_DNS_IP, LOCAL_IP, UPSTREAM_IP};

/// One measurement: a node, the agent's flags, whether kube-proxy syncs meanwhile, and whether
/// the agent runs as its pod with its API client on.
struct Case {
    node: &'static str,
    flags: &'static [&'static str],
    syncing: bool,
    api: bool,
}

const AUTO: &[&str] = &["--dataplane", "auto"];

const CASES: [Case; 8] = [
    Case { node: "nftables", flags: AUTO, syncing: false, api: false },
    Case { node: "iptables-nft", flags: AUTO, syncing: false, api: false },
    Case { node: "iptables-legacy", flags: AUTO, syncing: false, api: false },
    Case {
        node: "iptables-legacy",
        flags: &["--dataplane", "nftables"],
        syncing: false,
        api: false,
    },
    Case { node: "mixed", flags: AUTO, syncing: false, api: false },
    Case { node: "mixed", flags: AUTO, syncing: true, api: false },
    Case { node: "real parts", flags: AUTO, syncing: false, api: false },
    Case { node: "real parts", flags: AUTO, syncing: false, api: true },
];

/// How long an agent runs after its start before it is measured: past its start's read-backs
/// and its first safety-net check (`POLL_ANNOUNCED`, 30 s, the first after a start reads back
/// whole), so that a run of 30 s or more measures a long-running agent, one safety net in it.
const SETTLE: Duration = Duration::from_secs(32);

/// The nodes of [`CASES`] but the iptables-nft one (`main`), their namespaces `PREFIX` + a
/// letter, taken down when dropped.
fn nodes(prefix: &str) -> Vec<(&'static str, SimNode)> {
    let nftables = SimNode::up_prefixed(&format!("{prefix}n"), &["--kube-proxy", "nftables"]);
    let legacy = SimNode::up_prefixed(&format!("{prefix}l"), &["--kube-proxy", "iptables-legacy"]);
    let mixed = SimNode::up_prefixed(
        &format!("{prefix}m"),
        &["--kube-proxy", "iptables-nft", "--filter-drop"],
    );
    // kubelet on iptables-legacy (an older host image), kube-proxy on iptables-nft.
    for ipt in ["iptables-legacy", "ip6tables-legacy"] {
        for table in ["mangle", "nat", "filter"] {
            let out = mixed.run("node", ipt, &["-t", table, "-N", "KUBE-KUBELET-CANARY"]);
            assert!(out.status.success(), "{ipt}: {}", testkit::describe(&out));
        }
    }
    super::load_nat_rules(&mixed, 12_500, &["iptables-nft"]);
    let real = SimNode::up_prefixed(&format!("{prefix}r"), &["--kube-proxy", "real-iptables"]);
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rbac = repo.join("manifests/cluster-reports/rbac.yaml");
    let out = real.kubectl().arg("apply").arg("-f").arg(rbac).output().expect("kubectl");
    assert!(out.status.success(), "the component's RBAC: {}", testkit::describe(&out));
    vec![
        ("nftables", nftables),
        ("iptables-legacy", legacy),
        ("mixed", mixed),
        ("real parts", real),
    ]
}

/// The agent's CPU (own and children's, in mCPU) over `secs` idle, and its read-backs, for
/// each case, `rounds` times in turn; its RSS (max) on each node.
pub fn idle_cpu(main: &SimNode, prefix: &str, secs: u64, rounds: u32) -> Value {
    let others = nodes(prefix);
    let node_of = |name: &str| match name {
        "iptables-nft" => main,
        _ => &others.iter().find(|(n, _)| *n == name).expect("a node").1,
    };
    // Dropped before the nodes.
    let _tmpfs: Vec<StateOnTmpfs> = std::iter::once(main)
        .chain(others.iter().map(|(_, n)| n))
        .map(StateOnTmpfs::mount)
        .collect();
    let hz = clock_ticks_per_s();
    let node_cache = node_cache_pid(node_of("real parts"));
    let mut runs: Vec<Vec<Value>> = CASES.iter().map(|_| Vec::new()).collect();
    let mut about: Vec<Value> = CASES.iter().map(|_| Value::Null).collect();
    for round in 0..rounds {
        for (i, case) in CASES.iter().enumerate() {
            let flags = if case.api {
                format!("{} --node-name (in its pod: the API client on)", case.flags.join(" "))
            } else {
                case.flags.join(" ")
            };
            eprintln!(
                "bench: idle CPU, round {}, {} node, {flags}{}",
                round + 1,
                case.node,
                if case.syncing { ", kube-proxy syncing" } else { "" }
            );
            let node = node_of(case.node);
            let _ = std::fs::remove_file(node.dir.join("agent-state").join("state.json"));
            // At the default log level (the kit's agents log at debug).
            let env = [("NODELOCALDNS_HA_LOG", "info")];
            let agent = if case.api {
                let name = node.ns("node");
                let flags: Vec<&str> =
                    case.flags.iter().copied().chain(["--node-name", &name]).collect();
                node.agent_in_pod_env(&flags, &env)
            } else {
                node.agent_env(LOCAL_IP, CLUSTER_DNS_IP, UPSTREAM_IP, case.flags, &env)
            };
            if case.syncing {
                node.script(&["kube-proxy-resync-start"]);
            }
            std::thread::sleep(SETTLE);
            let pid = agent.pid().expect("agent pid");
            let check = "nodelocaldns_ha_dataplane_check_duration_seconds";
            let (_, checks0) = super::histogram(node, check);
            let (own0, children0) = cpu_ticks(pid).expect("the agent runs");
            let cache0 = cpu_ticks(node_cache).expect("node-cache runs");
            let t0 = Instant::now();
            let mut rss = 0;
            for _ in 0..secs {
                std::thread::sleep(Duration::from_secs(1));
                rss = rss.max(rss_kib(pid));
            }
            let (own1, children1) = cpu_ticks(pid).expect("the agent runs");
            let cache1 = cpu_ticks(node_cache).expect("node-cache runs");
            let wall = t0.elapsed().as_secs_f64();
            let (_, checks1) = super::histogram(node, check);
            if case.syncing {
                node.script(&["kube-proxy-resync-stop"]);
            }
            let state = agent.state().expect("state");
            super::stop_agent(node, agent);
            let mcpu = |ticks: u64| super::round1(ticks as f64 / hz / wall * 1000.0);
            runs[i].push(json!({
                "own_mcpu": mcpu(own1 - own0),
                "children_mcpu": mcpu(children1 - children0),
                "total_mcpu": mcpu(own1 - own0 + children1 - children0),
                "node_cache_mcpu": mcpu(cache1.0 + cache1.1 - cache0.0 - cache0.1),
                "read_backs": checks1 - checks0,
                "rss_kib_max": rss,
                "seconds": super::round1(wall),
            }));
            about[i] = json!({
                "node": case.node,
                "flags": flags,
                "kube_proxy_syncing": case.syncing,
                "dataplane": state["dataplane"],
                "accepts_in": state["accepts_in"],
            });
        }
    }
    let cases: Vec<Value> = about
        .into_iter()
        .zip(runs)
        .map(|(mut about, runs)| {
            about["runs"] = Value::Array(runs);
            about
        })
        .collect();
    json!({ "seconds": secs, "rounds": rounds, "cases": cases })
}

/// The real node-cache's pid on the real parts' node (checked by its name).
fn node_cache_pid(real: &SimNode) -> u32 {
    let pid: u32 = real.script(&["cache-pid"]).trim().parse().expect("the cache's pid");
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert_eq!(comm.trim(), "node-cache", "the real parts' cache is not node-cache");
    pid
}

/// A node's agent state directory on a tmpfs, as the DaemonSet's (a hostPath under /run, which
/// systemd mounts as a tmpfs) is on a node. This machine's /run and /tmp are on its disk, where
/// the state file's synced write once a second costs wake-ups of its own that a node does not
/// pay. Unmounted when dropped.
struct StateOnTmpfs(std::path::PathBuf);

impl StateOnTmpfs {
    fn mount(node: &SimNode) -> StateOnTmpfs {
        let dir = node.dir.join("agent-state");
        std::fs::create_dir_all(&dir).expect("the agent's state directory");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m,mode=0755", "nlha-bench-state"])
            .arg(&dir)
            .output()
            .expect("mount");
        assert!(out.status.success(), "a tmpfs on {}: {}", dir.display(), testkit::describe(&out));
        StateOnTmpfs(dir)
    }
}

impl Drop for StateOnTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// `pid`'s resident set, in KiB (0 once it is gone).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The report's table: one row per case, each round's figures.
pub fn table(footprint: &Value) -> String {
    let Some(cases) = footprint["cases"].as_array() else { return String::new() };
    let mut md = format!(
        "\nIdle CPU at default settings, the agent's iptables children included ({} s per run, \
         the cases in turn, {} rounds; run 1; run 2 …):\n\n\
         | node | agent | kube-proxy | agent CPU, children included | node-cache, same seconds | own; children | read-backs | RSS (max) |\n\
         |---|---|---|---|---|---|---|---|\n",
        footprint["seconds"], footprint["rounds"]
    );
    for case in cases {
        let runs = case["runs"].as_array().cloned().unwrap_or_default();
        let list =
            |key: &str| runs.iter().map(|r| r[key].to_string()).collect::<Vec<_>>().join("; ");
        let own_children = runs
            .iter()
            .map(|r| format!("{} + {}", r["own_mcpu"], r["children_mcpu"]))
            .collect::<Vec<_>>()
            .join("; ");
        let rss = runs.iter().filter_map(|r| r["rss_kib_max"].as_u64()).max().unwrap_or(0);
        md += &format!(
            "| {} | {} ({}, ACCEPTs in {}) | {} | {} mCPU | {} mCPU{} | {} | {} | {} KiB |\n",
            case["node"].as_str().unwrap_or("?"),
            case["flags"].as_str().unwrap_or("?"),
            case["dataplane"].as_str().unwrap_or("?"),
            case["accepts_in"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "))
                .unwrap_or_default(),
            if case["kube_proxy_syncing"] == true { "syncing every second" } else { "idle" },
            list("total_mcpu"),
            list("node_cache_mcpu"),
            if case["node"] == "real parts" { " (beside the agent)" } else { "" },
            own_children,
            list("read_backs"),
            rss,
        );
    }
    let runs: Vec<&Value> = cases.iter().filter_map(|c| c["runs"].as_array()).flatten().collect();
    let under =
        runs.iter().filter(|r| r["total_mcpu"].as_f64() <= r["node_cache_mcpu"].as_f64()).count();
    md += &format!(
        "\nThe agent at or under the real node-cache's CPU of the same seconds in {under} of {} \
         runs.\n",
        runs.len()
    );
    md
}
