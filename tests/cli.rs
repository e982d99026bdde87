//! The command line against bad input: every case exits 2, names the bad value, and leaves the
//! host as it was (no netfilter change, no state directory). Runs inside a namespace of its own.

mod support;

use std::process::Command;

use support::*;

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

    fn agent(&self) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, AGENT]);
        c.env_remove("KUBE_DNS_UPSTREAM_SERVICE_HOST");
        c
    }

    fn ruleset(&self) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0, "nft", "list", "ruleset"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

const GOOD: [&str; 6] = [
    "--local-ip",
    "169.254.20.10",
    "--cluster-dns-ip",
    "10.96.0.10",
    "--upstream-ip",
    "10.96.0.11",
];

/// `GOOD` with `flag` replaced by (or given) `value`.
fn args_with(flag: &str, value: &str) -> Vec<String> {
    let mut args: Vec<String> = GOOD.iter().map(|s| s.to_string()).collect();
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value.to_owned(),
        None => args.extend([flag.to_owned(), value.to_owned()]),
    }
    args
}

#[test]
fn bad_input_exits_2_names_the_value_and_changes_nothing() {
    let ns = Netns::new("a");
    let state_dir = std::env::temp_dir().join(format!("nlha-cli-{}", std::process::id()));
    let cases: Vec<(Vec<String>, &str)> = vec![
        (args_with("--local-ip", "169.254.20.300"), "169.254.20.300"),
        (args_with("--local-ip", "169.254.20.10,169.254.20.11"), "169.254.20.11"),
        (args_with("--cluster-dns-ip", "10.96.0.10,fd00::a"), "same IP families"),
        (args_with("--upstream-ip", "not-an-ip"), "not-an-ip"),
        (args_with("--timeout", "100ms"), "--timeout (100ms)"),
        (args_with("--timeout", "250ms"), "must be shorter than --interval"),
        (args_with("--interval", "banana"), "banana"),
        (args_with("--interval", "0s"), "--interval must be greater than zero"),
        (args_with("--min-hold", "1d"), "1d"),
        (args_with("--fall", "0"), "--fall must be at least 1"),
        (args_with("--rise", "0"), "--rise must be at least 1"),
        (args_with("--rise", "-3"), "-3"),
        (args_with("--probe-name", "a..b"), "a..b"),
        (args_with("--dataplane", "ipchains"), "ipchains"),
        (GOOD[..4].iter().map(|s| s.to_string()).collect(), "KUBE_DNS_UPSTREAM_SERVICE_HOST"),
    ];
    for (args, needle) in cases {
        let out =
            ns.agent().arg("run").args(&args).arg("--state-dir").arg(&state_dir).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", describe(&out));
        assert!(stderr.contains(needle), "{args:?}: stderr should name {needle:?}:\n{stderr}");
        assert!(!state_dir.exists(), "{args:?} created the state directory");
        assert_eq!(ns.ruleset(), "", "{args:?} changed netfilter");
    }
}

#[test]
fn bad_environment_values_are_refused_like_flags() {
    let ns = Netns::new("b");
    for (var, value) in [
        ("NODELOCALDNS_HA_LOCAL_IP", "garbage"),
        ("NODELOCALDNS_HA_INTERVAL", "1parsec"),
        ("NODELOCALDNS_HA_FALL", "many"),
    ] {
        let args: Vec<&str> =
            if var == "NODELOCALDNS_HA_LOCAL_IP" { GOOD[2..].to_vec() } else { GOOD.to_vec() };
        let out = ns.agent().arg("run").args(&args).env(var, value).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{var}={value:?}: {}", describe(&out));
        assert_eq!(ns.ruleset(), "", "{var} changed netfilter");
    }
    // The upstream fallback variable, set to garbage.
    let out = ns
        .agent()
        .arg("run")
        .args(&GOOD[..4])
        .env("KUBE_DNS_UPSTREAM_SERVICE_HOST", "10.96.0.x")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("10.96.0.x"));
}

#[test]
fn missing_cap_net_admin_is_one_clear_line() {
    let ns = Netns::new("c");
    let state_dir = std::env::temp_dir().join(format!("nlha-cap-{}", std::process::id()));
    let script = format!("exec {AGENT} run {} --state-dir {}", GOOD.join(" "), state_dir.display());
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0, "capsh", "--drop=cap_net_admin", "--", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(stderr.contains("CAP_NET_ADMIN"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "more than one line: {stderr}");
    assert_eq!(ns.ruleset(), "");
    assert!(!state_dir.exists());
}

#[test]
fn rules_prints_the_golden_ruleset() {
    let out = Command::new(AGENT)
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
    let out = Command::new(AGENT)
        .args(["probe", "--server", &format!("127.0.0.1:{port}"), "--timeout", "2s"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(stdout.contains("refused"), "{stdout}");
}
