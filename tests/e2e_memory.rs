//! The agent's memory at the link-local forwarders' bounds, under the DaemonSet's memory limit
//! enforced: a memory cgroup of the test's own (cgroup v1 on this machine kind:
//! `/sys/fs/cgroup/memory/`), `memory.limit_in_bytes` the limit `manifests/base/daemonset.yaml`
//! sets, the agent its first process from its exec on (so every page it ever touches is charged
//! there), removed at the end.
//!
//! An OOM kill during a failover would take the only DNS path of the link-local shape with it.
//! The test takes both forwarders of a dual-stack node (one a family, each with bounds of its
//! own) to their bounds: the cache killed (every query goes to a forwarder), an upstream that
//! answers a second late, and never answers the flood's small queries, so that they stay in
//! flight until the forwarder's timeout (`testdata/slow-dns.py`), and pods
//! (`testdata/dns-flood.py`) from as many addresses as it takes to hold every TCP connection a
//! forwarder relays (each with a large query whose large answer they never read, so that it
//! stays in the forwarder's buffers) and every share of its UDP bound but one, every hundredth
//! query of 60,000 bytes; a pod's lookups (dnsload) take the last share, in each family.
//!
//! What is recorded: the cgroup's peak (`memory.max_usage_in_bytes`), the agent's `VmHWM`, and
//! the memory of its sockets' buffers (`ss -m`). cgroup v1 charges socket buffers to
//! `memory.kmem.tcp` only once a TCP limit is set there, never to the memory limit (the
//! kernel's socket objects, `memory.kmem`, it does charge); cgroup v2, what most nodes run,
//! charges them to the memory limit too: the margin asserted covers both.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nodelocaldns_ha::forwarder::Options;
use testkit::*;

/// One address family's part: the forwarder's listen (link-local) IP, the slow upstream's
/// address (in the "CoreDNS" namespace's subnet: the node routes it there), what the pod asks
/// for, and the flooding pods' addresses (in pod1's namespace, routed to it from the node).
struct Family {
    local: &'static str,
    upstream: &'static str,
    prefix: &'static str,
    qtype: &'static str,
    flood: fn(usize) -> String,
}

const FAMILIES: [Family; 2] = [
    Family {
        local: "169.254.20.10",
        upstream: "10.244.1.9",
        prefix: "24",
        qtype: "A",
        flood: |i| format!("10.244.{}.{}/32", 2 + i / 200, 10 + i % 200),
    },
    Family {
        local: "fd00:169:254::10",
        upstream: "fd00:244:1::9",
        prefix: "64",
        qtype: "AAAA",
        flood: |i| format!("fd00:244:2::{:x}/128", 0x10 + i),
    },
];

/// How late the slow upstream answers: within the forwarder's 2 s upstream timeout.
const UPSTREAM_DELAY_S: &str = "1.0";

/// As many flooding addresses as it takes to fill the forwarder's TCP bound at their shares.
fn flood_addrs(family: &Family, options: &Options) -> Vec<String> {
    let count = options.max_connections.div_ceil(options.max_connections_per_client);
    (0..count).map(family.flood).collect()
}

/// `addr` without its prefix length.
fn bare(addr: &str) -> &str {
    addr.split('/').next().unwrap_or(addr)
}

/// `addr:53` as a socket address (`[addr]:53` for IPv6).
fn dns_server(addr: &str) -> String {
    if addr.contains(':') {
        format!("[{addr}]:53")
    } else {
        format!("{addr}:53")
    }
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The memory limit of the agent's container in `manifests/base/daemonset.yaml`, in bytes.
fn daemonset_memory_limit() -> u64 {
    let yaml = std::fs::read_to_string(repo().join("manifests/base/daemonset.yaml"))
        .expect("the DaemonSet");
    let limits = yaml.split("limits:").nth(1).expect("the container's limits");
    let memory = limits.lines().find_map(|l| l.trim().strip_prefix("memory:")).expect("memory");
    let mib: u64 = memory.trim().strip_suffix("Mi").expect("in Mi").parse().expect("a number");
    mib << 20
}

/// A memory cgroup (v1) of the test's own, with a limit; removed on drop, once its processes
/// are gone.
struct MemoryCgroup(PathBuf);

impl MemoryCgroup {
    fn new(limit: u64) -> MemoryCgroup {
        let root = Path::new("/sys/fs/cgroup/memory");
        assert!(
            root.join("memory.limit_in_bytes").is_file(),
            "no cgroup v1 memory hierarchy at {}",
            root.display()
        );
        let dir = root.join(format!("nlha-memory-{}-{}", std::process::id(), now_ms()));
        std::fs::create_dir(&dir).expect("create the memory cgroup");
        let cgroup = MemoryCgroup(dir);
        cgroup.write("memory.limit_in_bytes", &limit.to_string());
        assert_eq!(cgroup.read("memory.limit_in_bytes"), limit);
        cgroup
    }

    fn write(&self, file: &str, value: &str) {
        std::fs::write(self.0.join(file), value).unwrap_or_else(|e| panic!("{file}: {e}"));
    }

    fn text(&self, file: &str) -> String {
        std::fs::read_to_string(self.0.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
    }

    fn read(&self, file: &str) -> u64 {
        self.text(file).trim().parse().unwrap_or_else(|e| panic!("{file}: {e}"))
    }

    /// A field of a `key value` file (`memory.stat`, `memory.oom_control`).
    fn field(&self, file: &str, key: &str) -> u64 {
        let text = self.text(file);
        let value = text.lines().find_map(|l| l.strip_prefix(&format!("{key} ")));
        value.unwrap_or_else(|| panic!("{file} has no {key}: {text}")).trim().parse().unwrap()
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Removable once its processes have exited (the agent is killed before this).
        let removed = poll(Duration::from_secs(10), || std::fs::remove_dir(&self.0).ok());
        if removed.is_none() {
            eprintln!("could not remove the memory cgroup {}", self.0.display());
        }
    }
}

/// A line of `/proc/<pid>/status`, in bytes (`VmHWM:   12345 kB`).
fn status_bytes(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the agent runs");
    let line = status.lines().find_map(|l| l.strip_prefix(&format!("{key}:"))).expect(key);
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().expect("kB");
    kib << 10
}

/// What `ss -m` shows of the agent's sockets at one moment.
#[derive(Debug, Default, Clone, Copy)]
struct Sockets {
    /// The memory their buffers hold: received, queued to send and allotted ahead
    /// (`r + w + f` of `skmem`): what a cgroup v2 charges the agent for them.
    memory: u64,
    /// TCP connections of its forwarder's, from pods to the link-local IP.
    relayed: u64,
    /// Its open files (`/proc/<pid>/fd`).
    files: u64,
}

/// The agent's sockets in the node's namespace, as `ss` lists them.
fn sockets(node: &SimNode, pid: u32) -> Sockets {
    let out = node.run("node", "ss", &["-tuanpmH"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let owner = format!("pid={pid},");
    let files = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count);
    let mut found = Sockets { files: files as u64, ..Sockets::default() };
    // A socket per line, its `skmem:(…)` on the indented line after it: one block each.
    let mut blocks: Vec<String> = Vec::new();
    for line in text.lines() {
        match blocks.last_mut() {
            Some(block) if line.starts_with(char::is_whitespace) => block.push_str(line),
            _ => blocks.push(line.to_owned()),
        }
    }
    for line in blocks.iter().filter(|l| l.contains(&owner)) {
        let Some(skmem) = line.split("skmem:(").nth(1).and_then(|s| s.split(')').next()) else {
            continue;
        };
        let value = |key: &str| -> u64 {
            skmem
                .split(',')
                .find_map(|f| f.strip_prefix(key).filter(|v| v.starts_with(char::is_numeric)))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        found.memory += value("r") + value("w") + value("f");
        let relayed = FAMILIES.iter().any(|f| line.contains(&format!("{} ", dns_server(f.local))));
        if line.starts_with("tcp") && relayed {
            found.relayed += u64::from(line.contains("ESTAB"));
        }
    }
    found
}

/// A counter of the agent's `/metrics`, summed over its labels' `filter`.
fn metric(node: &SimNode, name: &str, filter: &str) -> u64 {
    let (_, body) = node.http_get("/metrics");
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// The forwarders at their bounds, both families (a dual-stack node: a forwarder each), the
/// cache dead and the upstream slow: every TCP connection each relays taken (each holding a
/// large answer its pod does not read), every UDP slot taken but for a pod's lookups, 60,000-byte
/// messages among them. The agent stays under the DaemonSet's memory limit with margin (no OOM
/// kill, the limit never reached), and the pods' lookups are answered throughout.
#[test]
fn the_forwarder_at_its_bounds_stays_under_the_daemonsets_memory_limit() {
    let limit = daemonset_memory_limit();
    let cgroup = MemoryCgroup::new(limit);
    let node = SimNode::up_with(&["--family", "dual"]);
    let run = |role: &str, args: &[&str]| {
        let out = node.run(role, args[0], &args[1..]);
        assert!(out.status.success(), "{args:?}: {}", describe(&out));
    };
    let bounds = Options::default();
    let mut upstreams = Vec::new();
    for family in &FAMILIES {
        let at = format!("{}/{}", family.upstream, family.prefix);
        let nodad = &["nodad"][..usize::from(family.upstream.contains(':'))];
        run("dns", &[&["ip", "addr", "add", &at, "dev", "eth0"][..], nodad].concat());
        let ready = node.dir.join(format!("slow-dns-{}.ready", family.qtype));
        let mut upstream = node.cmd("dns", "python3");
        upstream.arg(repo().join("testdata/slow-dns.py"));
        upstream.args([family.upstream, UPSTREAM_DELAY_S]).arg(&ready);
        upstreams.push(Proc::spawn(&mut upstream));
        wait_for("the slow upstream", Duration::from_secs(10), || ready.is_file().then_some(()));
        for addr in flood_addrs(family, &bounds) {
            let nodad = &["nodad"][..usize::from(addr.contains(':'))];
            run("pod1", &[&["ip", "addr", "add", &addr, "dev", "eth0"][..], nodad].concat());
            run("node", &["ip", "route", "add", &addr, "dev", "pod1"]);
        }
    }

    let local = FAMILIES.map(|f| f.local).join(",");
    let upstream = FAMILIES.map(|f| f.upstream).join(",");
    let agent = node.agent_in_cgroup(&cgroup.0, &local, "", &upstream, &[]);
    let pid = agent.pid().expect("the agent runs");
    node.kill("cache-kill");
    let idle = (cgroup.read("memory.usage_in_bytes"), status_bytes(pid, "VmRSS"));
    println!("idle, the cache dead: cgroup {} KiB, VmRSS {} KiB", idle.0 >> 10, idle.1 >> 10);

    let mut pods = Vec::new();
    let mut floods = Vec::new();
    for family in &FAMILIES {
        // A pod's lookups, within its share however late the upstream (the forwarder gives up
        // on it after 2 s): 100 a second.
        let args = ["--rate", "100", "--duration", "600s", "--timeout", "3000ms"];
        let more = ["--report-interval", "1s", "--qtype", family.qtype];
        pods.push(node.load("pod2", &dns_server(family.local), &[&args[..], &more].concat()));
        // All but one share of the UDP bound flooded at 150 queries/s an address, never
        // answered (held to the forwarder's 2 s timeout, 256 fill a share), every 100th of
        // 60,000 bytes (answered); every address a few TCP connections more than its share,
        // each held 8 s.
        let summary = node.dir.join(format!("flood-{}.json", family.qtype));
        let addrs: Vec<String> =
            flood_addrs(family, &bounds).iter().map(|a| bare(a).to_owned()).collect();
        let udp_addrs = (bounds.max_in_flight / bounds.max_in_flight_per_client - 1).to_string();
        let tcp = (bounds.max_connections_per_client + 4).to_string();
        let mut flood = node.cmd("pod1", "python3");
        flood.arg(repo().join("testdata/dns-flood.py")).args([family.local, &addrs.join(",")]);
        flood.args([&udp_addrs, "150", "100", "60000", &tcp, "8"]).arg(&summary);
        floods.push((Proc::spawn(&mut flood), summary));
    }

    // The bounds held for a while: 60,000 more UDP queries forwarded (about 15 s) and four
    // times the TCP bounds relayed, the most relayed at once seen at the bounds.
    let queries = |node: &SimNode| metric(node, "nodelocaldns_ha_forwarder_udp_queries_total", "");
    let connections =
        |node: &SimNode| metric(node, "nodelocaldns_ha_forwarder_tcp_connections_total", "");
    let (queries_before, connections_before) = (queries(&node), connections(&node));
    let tcp_bound = (FAMILIES.len() * bounds.max_connections) as u64;
    let mut most = Sockets::default();
    wait_for("the forwarders held at their bounds", Duration::from_secs(300), || {
        let killed = cgroup.field("memory.oom_control", "oom_kill");
        let peak = cgroup.read("memory.max_usage_in_bytes");
        assert_eq!(killed, 0, "the agent was OOM-killed at the bounds ({} KiB)", peak >> 10);
        let now = sockets(&node, pid);
        most.memory = most.memory.max(now.memory);
        most.relayed = most.relayed.max(now.relayed);
        most.files = most.files.max(now.files);
        let done = queries(&node) >= queries_before + 60_000
            && connections(&node) >= connections_before + 4 * tcp_bound;
        done.then_some(())
    });
    let peak = cgroup.read("memory.max_usage_in_bytes");
    let hwm = status_bytes(pid, "VmHWM");
    let busy = metric(&node, "nodelocaldns_ha_forwarder_dropped_total", "reason=\"busy\"");
    let mut flooded = Vec::new();
    for (flood, summary) in floods {
        // SIGTERM: it writes its summary and exits.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(flood.pid() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        assert!(flood.wait().success(), "the flood failed");
        let summary: serde_json::Value = std::fs::read(&summary)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        flooded.push(summary);
    }
    let lookups: Vec<serde_json::Value> = pods.into_iter().map(Load::interrupt).collect();

    let kib = |bytes: u64| bytes >> 10;
    println!(
        "at the bounds: cgroup peak {} KiB of {} KiB ({:.0} %), VmHWM {} KiB; the agent's \
         sockets held up to {} KiB (cgroup v2 would charge it); {} pod connections relayed at \
         once at most, {} open files; {busy} queries or connections turned away at the bounds",
        kib(peak),
        kib(limit),
        100.0 * peak as f64 / limit as f64,
        kib(hwm),
        kib(most.memory),
        most.relayed,
        most.files,
    );
    println!(
        "kmem {} KiB (max {} KiB), kmem.tcp {} KiB; memory.stat rss {} KiB",
        kib(cgroup.read("memory.kmem.usage_in_bytes")),
        kib(cgroup.read("memory.kmem.max_usage_in_bytes")),
        kib(cgroup.read("memory.kmem.tcp.max_usage_in_bytes")),
        kib(cgroup.field("memory.stat", "rss")),
    );
    let (_, metrics) = node.http_get("/metrics");
    let forwarder = metrics.lines().filter(|l| l.starts_with("nodelocaldns_ha_forwarder_"));
    println!("the forwarders: {}", forwarder.collect::<Vec<_>>().join(", "));
    for ((family, flood), lookups) in FAMILIES.iter().zip(&flooded).zip(&lookups) {
        println!("{}: the flood: {flood}; the pod's lookups: {lookups}", family.qtype);
    }

    assert_eq!(cgroup.field("memory.oom_control", "oom_kill"), 0, "the agent was OOM-killed");
    assert_eq!(cgroup.read("memory.failcnt"), 0, "the agent's cgroup reached its limit");
    assert!(agent.state().is_some() && Path::new(&format!("/proc/{pid}")).exists());
    // The bounds were reached: every connection the forwarders relay, and queries turned away.
    assert_eq!(most.relayed, tcp_bound, "not every TCP connection was taken");
    assert!(busy > 0, "nothing was turned away at the bounds");
    for (flood, lookups) in flooded.iter().zip(&lookups) {
        assert!(flood["udp_big_answers"].as_u64() > Some(0), "{flood}");
        assert_eq!(lookups["failed"], 0, "a pod's lookups failed: {lookups}");
        assert!(lookups["ok"].as_u64() > Some(1000), "{lookups}");
    }
    // With margin: the peak, and what cgroup v2 would charge besides (the sockets' buffers),
    // within three quarters of the limit.
    let budget = limit / 4 * 3;
    assert!(
        peak + most.memory <= budget,
        "{} KiB over {} KiB",
        kib(peak + most.memory),
        kib(budget)
    );
    node.tear_down(agent);
}
