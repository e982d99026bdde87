//! Validation of the run settings: every flag and environment variable parsed once, bad values
//! refused.

use super::*;

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn durations() {
    let ms = Duration::from_millis;
    assert_eq!(parse_duration("100ms"), Some(ms(100)));
    assert_eq!(parse_duration("2s"), Some(ms(2000)));
    assert_eq!(parse_duration("1.5s"), Some(ms(1500)));
    assert_eq!(parse_duration("1m30s"), Some(ms(90_000)));
    assert_eq!(parse_duration("30m"), Some(ms(1_800_000)));
    let huge = "18446744073709551615s18446744073709551615s";
    for bad in ["", "100", "ms", "1x", "-1s", "1..2s", "1e9999s", "1s2", huge] {
        assert_eq!(parse_duration(bad), None, "{bad:?}");
    }
}

#[test]
fn defaults_validate() {
    let cfg = AgentConfig::from_args(&test_raw(), no_env).unwrap();
    assert_eq!(cfg.cache_target().to_string(), "169.254.20.10:53");
    assert_eq!(cfg.upstream_target().to_string(), "10.96.0.11:53");
    assert_eq!(cfg.cache_tcp.unwrap().interval, Duration::from_secs(1));
    assert_eq!(cfg.quiet, Some(Duration::from_secs(1)));
    let mut r = test_raw();
    r.quiet_interval = "0s".into();
    assert_eq!(AgentConfig::from_args(&r, no_env).unwrap().quiet, None, "0s: off");
}

#[test]
fn dual_stack_orders_v4_first_and_probes_same_family() {
    let mut r = test_raw();
    r.local_ip = ips(&["fd00::10", "169.254.20.10"]);
    r.cluster_dns_ip = ips(&["10.96.0.10", "fd00::a"]);
    r.upstream_ip = ips(&["fd00::b", "10.96.0.11"]);
    let cfg = AgentConfig::from_args(&r, no_env).unwrap();
    assert_eq!(cfg.addrs.local, ips(&["169.254.20.10", "fd00::10"]));
    assert_eq!(cfg.upstream_target().to_string(), "10.96.0.11:53");
}

#[test]
fn upstream_falls_back_to_the_service_env_var() {
    let mut r = test_raw();
    r.upstream_ip.clear();
    let env = |k: &str| (k == "KUBE_DNS_UPSTREAM_SERVICE_HOST").then(|| "10.96.0.12".into());
    let cfg = AgentConfig::from_args(&r, env).unwrap();
    assert_eq!(cfg.upstream.ips, ips(&["10.96.0.12"]));
    let err = AgentConfig::from_args(&r, no_env).unwrap_err();
    assert!(err.to_string().contains("KUBE_DNS_UPSTREAM_SERVICE_HOST"), "{err}");
    let garbage = |_: &str| Some("not-an-ip".into());
    let err = AgentConfig::from_args(&r, garbage).unwrap_err();
    assert!(err.to_string().contains("not-an-ip"), "{err}");
}

#[test]
fn without_the_variable_the_service_is_waited_for_when_the_api_client_follows_it() {
    let mut r = test_raw();
    r.upstream_ip.clear();
    r.node_name = Some("node-1".into());
    let cfg = AgentConfig::from_args(&r, no_env).unwrap();
    assert!(cfg.upstream.is_awaited());
    assert_eq!(cfg.upstream.from, "Service kube-dns-upstream (waited for: not there yet)");
    let cluster = cfg.cluster.unwrap();
    assert_eq!(cluster.upstream_svc.as_deref(), Some("kube-dns-upstream"));
    // A variable that is there but wrong is still refused.
    let garbage = |_: &str| Some("not-an-ip".into());
    let err = AgentConfig::from_args(&r, garbage).unwrap_err();
    assert!(err.to_string().contains("not-an-ip"), "{err}");
}

/// A file that is not executable (mode 0644), made once per test process.
fn plain_file() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::temp_dir().join(format!("nlha-config-{}.sh", std::process::id()));
    std::fs::write(&path, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

#[test]
fn bad_input_is_refused_with_the_value_named() {
    type Mutation = Box<dyn Fn(&mut RawRun)>;
    let cases: Vec<(Mutation, &str)> = vec![
        (Box::new(|r| r.local_ip.clear()), "--local-ip is empty"),
        (Box::new(|r| r.local_ip = ips(&["169.254.20.10", "169.254.20.11"])), "169.254.20.11"),
        (Box::new(|r| r.cluster_dns_ip = ips(&["10.96.0.10", "fd00::a"])), "same IP families"),
        (Box::new(|r| r.timeout = "100ms".into()), "--timeout (100ms)"),
        (Box::new(|r| r.timeout = "250ms".into()), "must be shorter"),
        (Box::new(|r| r.interval = "0s".into()), "--interval=\"0s\" must be greater"),
        (Box::new(|r| r.interval = "fast".into()), "\"fast\""),
        (Box::new(|r| r.fall = 0), "--fall 0: must be at least 1"),
        (Box::new(|r| r.rise = 0), "--rise 0: must be at least 1"),
        (Box::new(|r| r.min_hold = "2".into()), "--min-hold=\"2\""),
        (Box::new(|r| r.upstream_timeout = "2s".into()), "--upstream-timeout"),
        (Box::new(|r| r.probe_name = "a..b".into()), "a..b"),
        (Box::new(|r| r.probe_name = "".into()), "--probe-name \"\""),
        (Box::new(|r| r.min_hold = "721h".into()), "--min-hold=\"721h\" is too long"),
        (Box::new(|r| r.interval = "5000000000000000h".into()), "at most 720h"),
        (Box::new(|r| r.hook_timeout = "0s".into()), "--hook-timeout=\"0s\" must be greater"),
        (Box::new(|r| r.tcp_interval = "50ms".into()), "--tcp-interval (50ms)"),
        (Box::new(|r| r.upstream_interval = "0s".into()), "--upstream-interval=\"0s\" must be"),
        (Box::new(|r| r.quiet_interval = "slow".into()), "--quiet-interval=\"slow\""),
        (Box::new(|r| r.metrics_addr = "127.0.0.1".into()), "--metrics-addr \"127.0.0.1\""),
        (Box::new(|r| r.metrics_addr = "".into()), "--metrics-addr \"\""),
        (Box::new(|r| r.metrics_addr = "[10.0.0.1]".into()), "--metrics-addr \"[10.0.0.1]\""),
        (Box::new(|r| r.metrics_addr = "[10.0.0.1]:x".into()), "--metrics-addr \"[10.0.0.1]:x\""),
        (Box::new(|r| r.local_ip = ips(&["0.0.0.0"])), "--local-ip 0.0.0.0 is not a unicast"),
        (Box::new(|r| r.cluster_dns_ip = ips(&["224.0.0.1"])), "224.0.0.1 is not a unicast"),
        (Box::new(|r| r.upstream_ip = ips(&["255.255.255.255"])), "not a unicast"),
        (Box::new(|r| r.local_ip = ips(&["::"])), "--local-ip :: is not a unicast"),
        (Box::new(|r| r.upstream_ip = ips(&["10.96.0.10"])), "is also --cluster-dns-ip"),
        (
            Box::new(|r| {
                r.cluster_dns_ip.clear();
                r.link_local_failover = false;
            }),
            "nothing to fail over",
        ),
        (Box::new(|r| r.upstream_ip = ips(&["169.254.20.10"])), "is also --local-ip"),
        (Box::new(|r| r.upstream_ip = ips(&["fd00::b"])), "has no IPv4 address"),
        (Box::new(|r| r.local_ip = ips(&["fd00::10"])), "same IP families"),
        (Box::new(|r| r.state_dir = "".into()), "--state-dir is empty"),
        (Box::new(|r| r.state_dir = "/x".repeat(50).into()), "too long for the control"),
        (Box::new(|r| r.on_transition = Some("/nonexistent".into())), "no such file"),
        (Box::new(|r| r.on_transition = Some(plain_file())), "not executable"),
        (Box::new(|r| r.on_transition = Some("/".into())), "no such file"),
        (
            Box::new(|r| {
                r.upstream_ip.clear();
                r.upstream_svc = " ".into();
            }),
            "--upstream-svc is empty",
        ),
    ];
    for (mutate, needle) in cases {
        let mut r = test_raw();
        mutate(&mut r);
        let err = AgentConfig::from_args(&r, no_env).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should contain {needle:?}");
    }
    let _ = std::fs::remove_file(plain_file());
}

#[test]
fn the_upstream_fallback_variable_is_checked_like_the_flag() {
    let mut r = test_raw();
    r.upstream_ip.clear();
    for (value, needle) in [
        ("10.96.0.10", "KUBE_DNS_UPSTREAM_SERVICE_HOST 10.96.0.10 is also --cluster-dns-ip"),
        ("fd00::b", "KUBE_DNS_UPSTREAM_SERVICE_HOST (fd00::b) has no IPv4 address"),
        ("0.0.0.0", "KUBE_DNS_UPSTREAM_SERVICE_HOST 0.0.0.0 is not a unicast"),
    ] {
        let env = |_: &str| Some(value.to_owned());
        let err = AgentConfig::from_args(&r, env).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should contain {needle:?}");
    }
}

#[test]
fn dual_stack_upstream_needs_only_the_probed_family() {
    let mut r = test_raw();
    r.local_ip = ips(&["169.254.20.10", "fd00::10"]);
    r.cluster_dns_ip = ips(&["10.96.0.10", "fd00::a"]);
    // The Service's variable gives one address: the probed family's is enough.
    assert!(AgentConfig::from_args(&r, no_env).is_ok());
    r.upstream_ip = ips(&["fd00::b"]);
    let err = AgentConfig::from_args(&r, no_env).unwrap_err().to_string();
    assert!(err.contains("has no IPv4 address"), "{err}");
    // A v6-only node probes over IPv6.
    r.local_ip = ips(&["fd00::10"]);
    r.cluster_dns_ip = ips(&["fd00::a"]);
    assert!(AgentConfig::from_args(&r, no_env).is_ok());
    r.upstream_ip = ips(&["10.96.0.11"]);
    let err = AgentConfig::from_args(&r, no_env).unwrap_err().to_string();
    assert!(err.contains("has no IPv6 address"), "{err}");
}

#[test]
fn durations_up_to_the_maximum_are_taken() {
    assert_eq!(duration_flag("--for", "720h"), Ok(MAX_DURATION));
    let err = duration_flag("--for", "720h1ns").unwrap_err();
    assert_eq!(err, ConfigError::TooLong { flag: "--for", value: "720h1ns".into() });
    // The longest state directory the control socket fits in.
    let mut r = test_raw();
    let room = 107 - longest_socket_name().len() - 1;
    r.state_dir = format!("/{}", "d".repeat(room - 1)).into();
    assert!(AgentConfig::from_args(&r, no_env).is_ok());
    r.state_dir = format!("/{}", "d".repeat(room)).into();
    assert!(AgentConfig::from_args(&r, no_env).is_err());
}

#[test]
fn tcp_probes_can_be_disabled() {
    let mut r = test_raw();
    r.tcp_interval = "0s".into();
    assert_eq!(AgentConfig::from_args(&r, no_env).unwrap().cache_tcp, None);
}

#[test]
fn without_a_cluster_dns_ip_the_link_local_shape_is_taken() {
    let mut r = test_raw();
    r.cluster_dns_ip.clear();
    let cfg = AgentConfig::from_args(&r, no_env).unwrap();
    assert!(cfg.addrs.cluster_dns.is_empty());
    assert!(cfg.shape.link_local, "the link-local IP fails over");
    // The upstream is still checked against what is intercepted.
    r.upstream_ip = ips(&["169.254.20.10"]);
    let err = AgentConfig::from_args(&r, no_env).unwrap_err().to_string();
    assert!(err.contains("is also --local-ip"), "{err}");
}

/// The DaemonSet's `[$(HOST_IP)]:9254` holds for a node address of either family.
#[test]
fn the_metrics_address_may_bracket_an_ipv4_address_as_go_does() {
    for (text, expected) in [
        ("[10.0.0.1]:9254", "10.0.0.1:9254"),
        ("[fd00::1]:9254", "[fd00::1]:9254"),
        ("127.0.0.1:9254", "127.0.0.1:9254"),
    ] {
        let raw = RawRun { metrics_addr: text.into(), ..test_raw() };
        let cfg = AgentConfig::from_args(&raw, |_| None).unwrap();
        assert_eq!(cfg.metrics_addr, Some(expected.parse().unwrap()), "{text}");
    }
}

#[test]
fn reports_to_the_cluster_need_a_node_name_and_an_existing_kubeconfig() {
    assert_eq!(AgentConfig::from_args(&test_raw(), no_env).unwrap().cluster, None, "off");
    let mut r = test_raw();
    r.node_name = Some("node-1".into());
    let cluster = AgentConfig::from_args(&r, no_env).unwrap().cluster.expect("on");
    assert_eq!((cluster.node_name.as_str(), cluster.kubeconfig), ("node-1", None));
    r.node_name = Some("  ".into());
    assert_eq!(AgentConfig::from_args(&r, no_env).unwrap().cluster, None, "a blank name");

    let missing = std::path::PathBuf::from("/nonexistent/kubeconfig");
    r.kubeconfig = Some(missing.clone());
    let err = AgentConfig::from_args(&r, no_env).unwrap_err();
    assert!(matches!(err, ConfigError::KubeconfigWithoutNode(_)), "{err}");
    assert!(err.to_string().contains("--node-name"), "{err}");
    r.node_name = Some("node-1".into());
    let err = AgentConfig::from_args(&r, no_env).unwrap_err();
    assert_eq!(err.to_string(), "--kubeconfig /nonexistent/kubeconfig: no such file");
}

#[test]
fn a_startup_taint_needs_a_node_name_and_a_valid_key() {
    let mut r = test_raw();
    r.startup_taint = Some("nodelocaldns-ha.io/dns-not-ready".into());
    let err = AgentConfig::from_args(&r, no_env).unwrap_err();
    assert!(matches!(err, ConfigError::TaintWithoutNode(_)), "{err}");
    r.node_name = Some("node-1".into());
    let cluster = AgentConfig::from_args(&r, no_env).unwrap().cluster.unwrap();
    assert_eq!(cluster.startup_taint.as_deref(), Some("nodelocaldns-ha.io/dns-not-ready"));
    for bad in ["", "-x", "a/b/c", "x y", "x:NoSchedule", &"k".repeat(64)] {
        r.startup_taint = Some(bad.to_owned());
        let err = AgentConfig::from_args(&r, no_env).unwrap_err();
        assert!(matches!(err, ConfigError::BadTaintKey(_)), "{bad:?}: {err}");
    }
    r.startup_taint = Some("nodelocaldns-ha.io/dns-not-ready".into());
    r.startup_taint_timeout = "90s".into();
    let cluster = AgentConfig::from_args(&r, no_env).unwrap().cluster.unwrap();
    assert_eq!(cluster.startup_taint_bound, Duration::from_secs(90));
    for (bad, says) in [("0s", "must be greater than zero"), ("soon", "is not a duration")] {
        r.startup_taint_timeout = bad.into();
        let err = AgentConfig::from_args(&r, no_env).unwrap_err().to_string();
        assert!(err.contains("--startup-taint-timeout") && err.contains(says), "{bad}: {err}");
    }
}
