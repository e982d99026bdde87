//! The command line against bad input: every case exits 2 with one line on stderr that names the
//! flag (or the environment variable) and the bad value, and leaves the host as it was (no
//! netfilter change, no state directory). Each test runs in a network namespace of its own.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use testkit::*;

/// A network namespace for one test, deleted on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        require_root();
        let name = format!("cli{}{tag}", std::process::id() % 100_000);
        let out = Command::new("ip").args(["netns", "add", &name]).output().unwrap();
        assert!(out.status.success(), "{}", describe(&out));
        Netns(name)
    }

    /// The agent binary in this namespace, with a clean environment (no variable of ours, no
    /// upstream Service variable), so each case sets exactly what it tests.
    fn agent(&self) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, agent_exe()]);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("NODELOCALDNS_HA_") {
                c.env_remove(name);
            }
        }
        c.env_remove("KUBE_DNS_UPSTREAM_SERVICE_HOST");
        c
    }

    /// Everything in netfilter, nftables and both iptables flavours.
    fn netfilter(&self) -> String {
        let mut all = String::new();
        for (program, args) in [
            ("nft", &["list", "ruleset"][..]),
            ("iptables-legacy-save", &[][..]),
            ("iptables-nft-save", &[][..]),
        ] {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.0, program])
                .args(args)
                .output()
                .unwrap();
            // A fresh namespace: iptables-save prints nothing, not even a table header.
            all.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        all
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// A scratch directory for one test, removed on drop. Cases point `--state-dir` inside it, so
/// "no state directory was created" is "this directory does not exist".
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("nlha-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }

    fn state_dir(&self) -> String {
        self.0.join("state").display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What is wrong with a refusal: it must exit 2, print nothing on stdout and exactly one line on
/// stderr containing every needle, and change neither netfilter nor the state directory.
fn problems(
    what: &str,
    out: &Output,
    needles: &[String],
    ns: &Netns,
    scratch: &Path,
) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut found = Vec::new();
    if out.status.code() != Some(2) || !out.stdout.is_empty() {
        found.push(format!("{what}: not a refusal: {}", describe(out)));
    }
    if stderr.lines().count() != 1 || !stderr.starts_with("nodelocaldns-ha: ") {
        found.push(format!("{what}: not one line on stderr:\n{stderr}"));
    }
    for needle in needles.iter().filter(|n| !stderr.contains(n.as_str())) {
        found.push(format!("{what}: stderr should name {needle:?}:\n{stderr}"));
    }
    if scratch.exists() {
        found.push(format!("{what}: created {}", scratch.display()));
    }
    let netfilter = ns.netfilter();
    if !netfilter.is_empty() {
        found.push(format!("{what}: changed netfilter:\n{netfilter}"));
    }
    found
}

fn assert_refused(what: &str, out: &Output, needles: &[String], ns: &Netns, scratch: &Path) {
    let found = problems(what, out, needles, ns, scratch);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// A valid `run` command line; cases replace one flag's value, or drop a flag and set its
/// variable instead.
fn good_run(state_dir: &str) -> Vec<(String, String)> {
    [
        ("--local-ip", LOCAL_IP),
        ("--cluster-dns-ip", CLUSTER_DNS_IP),
        ("--upstream-ip", UPSTREAM_IP),
        ("--dataplane", "nftables"),
        ("--state-dir", state_dir),
    ]
    .iter()
    .map(|(f, v)| (f.to_string(), v.to_string()))
    .collect()
}

fn flatten(pairs: &[(String, String)]) -> Vec<String> {
    pairs.iter().flat_map(|(f, v)| [f.clone(), v.clone()]).collect()
}

/// The flag a `NODELOCALDNS_HA_*` variable stands for: `NODELOCALDNS_HA_LOCAL_IP` → `--local-ip`.
fn flag_of(var: &str) -> Option<String> {
    let name = var.strip_prefix("NODELOCALDNS_HA_")?;
    Some(format!("--{}", name.to_ascii_lowercase().replace('_', "-")))
}

/// One bad `run` setting and what the refusal must say besides the setting's name and value.
struct Case {
    /// A flag (`--interval`) or an environment variable (`NODELOCALDNS_HA_INTERVAL`).
    name: &'static str,
    value: &'static str,
    /// Says why.
    says: &'static str,
    /// Flags left out of the good command line (the upstream fallback cases).
    without: &'static [&'static str],
}

const fn case(name: &'static str, value: &'static str, says: &'static str) -> Case {
    Case { name, value, says, without: &[] }
}

/// Every flag of `run`, and every variable, with empty, malformed, out-of-range, zero, huge
/// and wrong-family values.
const RUN_CASES: &[Case] = &[
    // Addresses.
    case("--local-ip", "", "invalid IP address syntax"),
    case("--local-ip", "169.254.20.300", "invalid IP address syntax"),
    case("--local-ip", "169.254.20.10,169.254.20.11", "two IPv4 addresses"),
    case("--local-ip", "0.0.0.0", "not a unicast address"),
    case("--local-ip", "fd00::10", "must cover the same IP families"),
    case("--local-ip", "169.254.20.10,fd00::10", "must cover the same IP families"),
    case("--cluster-dns-ip", "", "invalid IP address syntax"),
    case("--cluster-dns-ip", "10.96.0.10,fd00::a", "must cover the same IP families"),
    case("--cluster-dns-ip", "224.0.0.10", "not a unicast address"),
    case("--cluster-dns-ip", "10.96.0.10/32", "invalid IP address syntax"),
    case("--upstream-ip", "not-an-ip", "invalid IP address syntax"),
    case("--upstream-ip", "", "invalid IP address syntax"),
    case("--upstream-ip", "fd00::b", "has no IPv4 address"),
    case("--upstream-ip", "10.96.0.10", "is also --cluster-dns-ip"),
    case("--upstream-ip", "255.255.255.255", "not a unicast address"),
    Case {
        name: "--upstream-svc",
        value: "",
        says: "give the upstream Service's name",
        without: &["--upstream-ip"],
    },
    case("--probe-name", "", "not a valid DNS name"),
    case("--probe-name", "a..b", "not a valid DNS name"),
    case(
        "--probe-name",
        "kubernetes.default.svc.__PILLAR__DNS__DOMAIN__",
        "fill in the cluster's DNS domain",
    ),
    case(
        "--probe-name",
        "a-label-of-sixty-four-characters-is-one-more-than-dns-allows-xxxx.test",
        "not a valid DNS name",
    ),
    // Durations.
    case("--interval", "", "is not a duration"),
    case("--interval", "banana", "is not a duration"),
    case("--interval", "100", "is not a duration"),
    case("--interval", "0s", "must be greater than zero"),
    case("--interval", "721h", "too long: at most 720h"),
    case("--interval", "5000000000000000h", "too long"),
    case("--interval", "99999999999999999999999s", "is not a duration"),
    case("--timeout", "100ms", "must be shorter than --interval"),
    case("--timeout", "0s", "must be greater than zero"),
    case("--timeout", "-1s", "is not a duration"),
    case("--tcp-interval", "50ms", "must be shorter than --tcp-interval"),
    case("--tcp-interval", "soon", "is not a duration"),
    case("--upstream-interval", "0ms", "must be greater than zero"),
    case("--upstream-timeout", "2s", "must be shorter than --upstream-interval"),
    case("--upstream-timeout", "1e3ms", "is not a duration"),
    case("--min-hold", "1d", "is not a duration"),
    case("--min-hold", "100000h", "too long"),
    case("--hook-timeout", "0s", "must be greater than zero"),
    case("--hook-timeout", "forever", "is not a duration"),
    case("--xtables-wait", "1y", "is not a duration"),
    case("--xtables-wait", "1000h", "too long"),
    case("--stall-bound", "5ms", "too short: at least 6ms"),
    case("--stall-bound", "fast", "is not a duration"),
    case("--stall-look", "1ms", "too short: at least 2ms"),
    case("--stall-look", "0s", "too short: at least 2ms"),
    case("--stall-look", "often", "is not a duration"),
    case("--quiet-interval", "often", "is not a duration"),
    // Counts.
    case("--fall", "0", "must be at least 1"),
    case("--fall", "4294967296", "is not in 0..=4294967295"),
    case("--rise", "-3", "is not in 0..=4294967295"),
    case("--rise", "", "cannot parse integer from empty string"),
    case("--rise", "0", "must be at least 1"),
    // Choices and switches.
    case("--dataplane", "ipchains", "invalid value"),
    case("--dataplane", "", "a value is required"),
    case("--fast-path", "maybe", "invalid value"),
    case("--socket-events", "2", "invalid value"),
    case("--log-format", "xml", "invalid value"),
    case("--log", "==", "not a valid filter"),
    // Places.
    case("--metrics-addr", "", "is not an address"),
    case("--metrics-addr", "localhost:9254", "is not an address"),
    case("--metrics-addr", "127.0.0.1", "is not an address"),
    case("--metrics-addr", "127.0.0.1:99999", "is not an address"),
    case("--state-dir", "", "a value is required"),
    case("--on-transition", "/nonexistent/hook", "no such file"),
    case("--on-transition", "/", "no such file"),
    // The same through the environment.
    case("NODELOCALDNS_HA_LOCAL_IP", "garbage", "invalid IP address syntax"),
    case("NODELOCALDNS_HA_LOCAL_IP", "", "invalid IP address syntax"),
    case("NODELOCALDNS_HA_CLUSTER_DNS_IP", "fd00::a", "must cover the same IP families"),
    case("NODELOCALDNS_HA_UPSTREAM_IP", "10.96.0.10", "is also --cluster-dns-ip"),
    case("NODELOCALDNS_HA_PROBE_NAME", "a..b", "not a valid DNS name"),
    case("NODELOCALDNS_HA_INTERVAL", "1parsec", "is not a duration"),
    case("NODELOCALDNS_HA_INTERVAL", "", "is not a duration"),
    case("NODELOCALDNS_HA_TIMEOUT", "0s", "must be greater than zero"),
    case("NODELOCALDNS_HA_TCP_INTERVAL", "x", "is not a duration"),
    case("NODELOCALDNS_HA_UPSTREAM_INTERVAL", "x", "is not a duration"),
    case("NODELOCALDNS_HA_UPSTREAM_TIMEOUT", "x", "is not a duration"),
    case("NODELOCALDNS_HA_FALL", "many", "invalid digit"),
    case("NODELOCALDNS_HA_RISE", "0", "must be at least 1"),
    case("NODELOCALDNS_HA_MIN_HOLD", "999999h", "too long"),
    case("NODELOCALDNS_HA_DATAPLANE", "iptables", "invalid value"),
    case("NODELOCALDNS_HA_XTABLES_WAIT", "1y", "is not a duration"),
    case("NODELOCALDNS_HA_STATE_DIR", "", "a value is required"),
    case("NODELOCALDNS_HA_METRICS_ADDR", ":9254", "is not an address"),
    case("NODELOCALDNS_HA_ON_TRANSITION", "/nonexistent/hook", "no such file"),
    case("NODELOCALDNS_HA_HOOK_TIMEOUT", "forever", "is not a duration"),
    case("NODELOCALDNS_HA_FAST_PATH", "yes", "invalid value"),
    case("NODELOCALDNS_HA_SOCKET_EVENTS", "1", "invalid value"),
    case("NODELOCALDNS_HA_LOG", "==", "not a valid filter"),
    case("NODELOCALDNS_HA_LOG_FORMAT", "xml", "invalid value"),
    // The upstream's fallback variables.
    Case {
        name: "KUBE_DNS_UPSTREAM_SERVICE_HOST",
        value: "10.96.0.x",
        says: "is not an IP address",
        without: &["--upstream-ip"],
    },
    Case {
        name: "KUBE_DNS_UPSTREAM_SERVICE_HOST",
        value: "fd00::b",
        says: "has no IPv4 address",
        without: &["--upstream-ip"],
    },
    Case {
        name: "KUBE_DNS_UPSTREAM_SERVICE_HOST",
        value: "",
        says: "no upstream IP",
        without: &["--upstream-ip"],
    },
    Case {
        name: "NODELOCALDNS_HA_UPSTREAM_SVC",
        value: "my-dns",
        says: "set MY_DNS_SERVICE_HOST",
        without: &["--upstream-ip"],
    },
];

#[test]
fn every_bad_run_setting_exits_2_names_it_and_changes_nothing() {
    let ns = Netns::new("a");
    let scratch = Scratch::new("run");
    let state_dir = scratch.state_dir();
    let mut failures = Vec::new();
    for case in RUN_CASES {
        let mut pairs = good_run(&state_dir);
        pairs.retain(|(f, _)| !case.without.contains(&f.as_str()));
        let mut command = ns.agent();
        let mut needles = vec![case.name.to_owned(), case.says.to_owned()];
        if case.name.starts_with("--") {
            match pairs.iter_mut().find(|(f, _)| f == case.name) {
                Some(pair) => pair.1 = case.value.to_owned(),
                None => pairs.push((case.name.to_owned(), case.value.to_owned())),
            }
            // A list's addresses may be named one by one.
            needles.extend(case.value.split(',').filter(|v| !v.is_empty()).map(str::to_owned));
        } else {
            // The variable's flag is not on the command line, or it would win.
            let flag = flag_of(case.name);
            pairs.retain(|(f, _)| Some(f) != flag.as_ref());
            command.env(case.name, case.value);
            if !case.value.is_empty() {
                needles.push(case.value.to_owned());
            }
        }
        let out = command.arg("run").args(flatten(&pairs)).output().unwrap();
        let what = format!("{}={:?}", case.name, case.value);
        failures.extend(problems(&what, &out, &needles, &ns, &scratch.0));
    }
    assert!(failures.is_empty(), "{} problems:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn a_state_dir_too_long_for_the_control_socket_is_refused_up_front() {
    let ns = Netns::new("b");
    let scratch = Scratch::new("long");
    let long = scratch.0.join("d".repeat(100)).display().to_string();
    let mut pairs = good_run(&long);
    pairs.retain(|(f, _)| f != "--dataplane");
    let out = ns.agent().arg("run").args(flatten(&pairs)).output().unwrap();
    let needles = ["--state-dir".to_owned(), long.clone(), "too long".to_owned()];
    assert_refused("a long --state-dir", &out, &needles, &ns, &scratch.0);

    // A hook that is a plain file, not a program.
    std::fs::create_dir_all(&scratch.0).unwrap();
    let hook = scratch.0.join("hook.sh");
    std::fs::write(&hook, "#!/bin/sh\n").unwrap();
    let state_dir = scratch.0.join("state");
    let out = ns
        .agent()
        .arg("run")
        .args(flatten(&good_run(&state_dir.display().to_string())))
        .arg("--on-transition")
        .arg(&hook)
        .output()
        .unwrap();
    let needles = ["--on-transition".to_owned(), hook.display().to_string(), "chmod +x".into()];
    assert_refused("a hook that is not executable", &out, &needles, &ns, &state_dir);

    // An argument that is not UTF-8 at all.
    let bytes = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"\xff\xfe");
    let out = ns.agent().arg("run").arg("--probe-name").arg(bytes).output().unwrap();
    let needles = ["invalid UTF-8".to_owned()];
    assert_refused("a name that is not UTF-8", &out, &needles, &ns, &state_dir);
}

#[test]
fn the_other_commands_refuse_bad_input_the_same_way() {
    let ns = Netns::new("c");
    let scratch = Scratch::new("cmds");
    let dir = scratch.state_dir();
    let v4 = ["--local-ip", LOCAL_IP, "--cluster-dns-ip", CLUSTER_DNS_IP];
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        // flip: with no agent running it would install rules; bad input must stop it first.
        (vec!["flip", "sideways"], vec!["sideways", "invalid value"]),
        (vec!["flip", "upstream", "--for", "soon"], vec!["--for", "soon", "not a duration"]),
        (vec!["flip", "upstream", "--for", "0s"], vec!["--for=\"0s\" must be greater than zero"]),
        (vec!["flip", "upstream", "--for", "721h"], vec!["--for", "721h", "too long"]),
        (
            vec!["flip", "upstream", "--local-ip", "fd00::10", "--cluster-dns-ip", "10.96.0.10"],
            vec!["fd00::10", "10.96.0.10", "must cover the same IP families"],
        ),
        (
            vec!["flip", "upstream", "--local-ip", "0.0.0.0", "--cluster-dns-ip", "10.96.0.10"],
            vec!["--local-ip 0.0.0.0", "not a unicast address"],
        ),
        (vec!["flip", "local", "--local-ip", "x"], vec!["--local-ip", "'x'"]),
        // drain and release.
        (vec!["drain", "--timeout", "x"], vec!["--timeout", "\"x\"", "not a duration"]),
        (vec!["drain", "--timeout", "100000h"], vec!["--timeout", "100000h", "too long"]),
        (vec!["release", "--force"], vec!["--force", "unexpected argument"]),
        // rules: a dry run, but a wrong ruleset printed is as bad as one installed.
        (
            vec![
                "rules",
                "--route",
                "local",
                "--local-ip",
                "fd00::10",
                "--cluster-dns-ip",
                "10.96.0.10",
            ],
            vec!["must cover the same IP families"],
        ),
        (vec!["rules", "--route", "both"], vec!["both", "invalid value"]),
        // probe, teardown, status.
        (vec!["probe", "--server", "dns.example"], vec!["--server", "dns.example"]),
        (vec!["probe", "--server", "10.0.0.1:99999"], vec!["--server", "10.0.0.1:99999"]),
        (
            vec!["probe", "--server", "127.0.0.1", "--timeout", "0ms"],
            vec!["--timeout=\"0ms\" must be"],
        ),
        (
            vec!["probe", "--server", "127.0.0.1", "--probe-name", "a..b"],
            vec!["a..b", "invalid probe query name"],
        ),
        (vec!["teardown", "--xtables-wait", "x"], vec!["--xtables-wait", "\"x\""]),
        (vec!["status", "--json=yes"], vec!["--json"]),
        (vec!["reboot"], vec!["reboot", "unrecognized subcommand"]),
    ];
    let mut failures = Vec::new();
    for (args, needles) in cases {
        let mut command = ns.agent();
        command.args(&args);
        if !matches!(args[0], "rules" | "probe" | "reboot") {
            command.args(["--state-dir", &dir]);
        }
        if args[0] == "rules" && !args.contains(&"--local-ip") {
            command.args(v4);
        }
        let out = command.output().unwrap();
        let needles: Vec<String> = needles.iter().map(|s| s.to_string()).collect();
        failures.extend(problems(&format!("{args:?}"), &out, &needles, &ns, &scratch.0));
    }
    assert!(failures.is_empty(), "{} problems:\n{}", failures.len(), failures.join("\n"));
}

/// Runs `wrapper… 'grep CapEff; exec agent run …'` in the namespace (the wrapper ends in a
/// shell's `-c`): returns the shell's
/// effective capability set (the agent's, as exec keeps it) and the agent's output.
fn run_with_capabilities(
    ns: &Netns,
    wrapper: &[&str],
    extra: &str,
    state_dir: &str,
) -> (u64, Output) {
    let script = format!(
        "grep CapEff /proc/self/status >&2; exec {agent} run --local-ip {LOCAL_IP} \
         --cluster-dns-ip {CLUSTER_DNS_IP} --upstream-ip {UPSTREAM_IP} --state-dir {state_dir} {extra}",
        agent = agent_exe(),
    );
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .args(wrapper)
        .arg(&script)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let caps = stderr
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or_else(|| panic!("no CapEff line: {}", describe(&out)));
    let rest: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("CapEff:")).collect();
    let out = Output { stderr: rest.join("\n").into_bytes(), ..out };
    (caps, out)
}

const CAP_NET_ADMIN: u64 = 1 << 12;
const CAP_NET_RAW: u64 = 1 << 13;

#[test]
fn missing_cap_net_admin_is_one_clear_line() {
    let ns = Netns::new("d");
    let scratch = Scratch::new("cap");
    let dir = scratch.state_dir();
    // capsh and setpriv as root, and a user who is not root: each really runs the agent
    // without CAP_NET_ADMIN (its effective set, read by the shell that execs it, says so).
    let wrappers: [&[&str]; 3] = [
        &["capsh", "--drop=cap_net_admin", "--", "-c"],
        &["setpriv", "--bounding-set=-net_admin", "--inh-caps=-all", "--", "sh", "-c"],
        &["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "sh", "-c"],
    ];
    for wrapper in wrappers {
        let (caps, out) = run_with_capabilities(&ns, wrapper, "", &dir);
        assert_eq!(caps & CAP_NET_ADMIN, 0, "{wrapper:?} kept CAP_NET_ADMIN");
        let needles = ["missing capability CAP_NET_ADMIN".to_owned(), "NET_ADMIN".to_owned()];
        assert_refused(&format!("{wrapper:?}"), &out, &needles, &ns, &scratch.0);
    }
    // iptables-legacy needs CAP_NET_RAW as well, and says so before touching anything.
    let wrapper =
        ["setpriv", "--bounding-set=-all,+net_admin", "--inh-caps=-all", "--", "sh", "-c"];
    let (caps, out) = run_with_capabilities(&ns, &wrapper, "--dataplane iptables-legacy", &dir);
    assert_eq!(caps & (CAP_NET_ADMIN | CAP_NET_RAW), CAP_NET_ADMIN);
    let needles = ["missing capability CAP_NET_RAW".to_owned(), "iptables-legacy".to_owned()];
    assert_refused("iptables-legacy without CAP_NET_RAW", &out, &needles, &ns, &scratch.0);
}

#[test]
fn rules_prints_the_golden_ruleset() {
    let out = Command::new(agent_exe())
        .args([
            "rules",
            "--route",
            "local",
            "--local-ip",
            LOCAL_IP,
            "--cluster-dns-ip",
            CLUSTER_DNS_IP,
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let golden = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/testdata/golden/ipv4-local.nft"
    ))
    .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), golden);
}

#[test]
fn probe_reports_refused_fast_on_a_closed_port() {
    // Loopback only: a port nobody listens on.
    let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = Command::new(agent_exe())
        .args(["probe", "--server", &format!("127.0.0.1:{port}"), "--timeout", "2s"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(stdout.contains("refused"), "{stdout}");
}
