//! Validated configuration: everything `run` needs, checked before anything touches the host.
//!
//! The command line ([`crate::cli`]) hands over raw values; [`AgentConfig::from_args`] turns them
//! into typed, consistent settings or a [`ConfigError`] that names the bad value and says what
//! to do. Nothing here does I/O except reading the environment for the upstream fallback.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::health::Thresholds;
use crate::ruleset::{ListenAddrs, DNS_PORT};

/// A bad setting: what, where, what to do.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A flag that takes a list got nothing.
    #[error(
        "{flag} is empty: give one address, or one IPv4 and one IPv6 address separated by a comma"
    )]
    EmptyList { flag: &'static str },
    /// Two addresses of one family in one flag.
    #[error("{flag} has two {family} addresses ({first}, {second}): give at most one per family")]
    SameFamilyTwice { flag: &'static str, family: &'static str, first: IpAddr, second: IpAddr },
    /// The listen lists cover different families.
    #[error(
        "--local-ip ({local}) and --cluster-dns-ip ({cluster}) must cover the same IP families"
    )]
    FamiliesDiffer { local: String, cluster: String },
    /// No upstream address anywhere.
    #[error(
        "no upstream IP: pass --upstream-ip (the ClusterIP of the kube-dns-upstream Service) or set {env_var}"
    )]
    NoUpstream { env_var: String },
    /// The upstream fallback variable holds no IP.
    #[error("{env_var}={value:?} is not an IP address")]
    BadUpstreamEnv { env_var: String, value: String },
    /// A duration that cannot be parsed.
    #[error("{flag}={value:?} is not a duration: write e.g. 100ms, 2s or 1m")]
    BadDuration { flag: &'static str, value: String },
    /// A zero duration where time must pass.
    #[error("{flag} must be greater than zero")]
    ZeroDuration { flag: &'static str },
    /// A probe that could outlive its interval.
    #[error("{timeout_flag} ({timeout:?}) must be shorter than {interval_flag} ({interval:?}): probes must not overlap")]
    TimeoutNotBelowInterval {
        timeout_flag: &'static str,
        timeout: Duration,
        interval_flag: &'static str,
        interval: Duration,
    },
    /// `--fall 0` or `--rise 0`.
    #[error("{flag} must be at least 1 (consecutive probes)")]
    ZeroCount { flag: &'static str },
    /// An address that is not `host:port`.
    #[error("{flag} {value:?} is not an address: write IP:port, e.g. 127.0.0.1:9254, or off")]
    BadAddress { flag: &'static str, value: String },
    /// The transition hook is not a file.
    #[error("--on-transition {}: no such file (give the path of an executable)", .0.display())]
    NoHook(PathBuf),
    /// A probe name that is not a DNS name.
    #[error("--probe-name {0:?} is not a valid DNS name")]
    BadProbeName(String),
}

/// Parses `100ms`, `2s`, `1m`, `1h`, `1m30s`, `1.5s`. A bare number is refused: units matter.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let split = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let (number, tail) = rest.split_at(split);
        let value: f64 = number.parse().ok()?;
        let unit_len = tail.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let seconds = match unit {
            "ns" => value / 1e9,
            "us" | "µs" => value / 1e6,
            "ms" => value / 1e3,
            "s" => value,
            "m" => value * 60.0,
            "h" => value * 3600.0,
            _ => return None,
        };
        total = total.checked_add(Duration::try_from_secs_f64(seconds).ok()?)?;
        rest = tail;
    }
    Some(total)
}

/// Parses the value of a duration flag; the error names the flag and the value.
pub fn duration_flag(flag: &'static str, value: &str) -> Result<Duration, ConfigError> {
    parse_duration(value).ok_or_else(|| ConfigError::BadDuration { flag, value: value.to_owned() })
}

/// Checks that `list` holds one or two addresses, at most one per family; v4 first.
pub fn address_slot(flag: &'static str, list: &[IpAddr]) -> Result<Vec<IpAddr>, ConfigError> {
    let mut v4 = None;
    let mut v6 = None;
    for &ip in list {
        let (slot, family) = match ip {
            IpAddr::V4(_) => (&mut v4, "IPv4"),
            IpAddr::V6(_) => (&mut v6, "IPv6"),
        };
        if let Some(first) = *slot {
            return Err(ConfigError::SameFamilyTwice { flag, family, first, second: ip });
        }
        *slot = Some(ip);
    }
    let out: Vec<IpAddr> = v4.into_iter().chain(v6).collect();
    if out.is_empty() {
        return Err(ConfigError::EmptyList { flag });
    }
    Ok(out)
}

fn families(list: &[IpAddr]) -> String {
    let names: Vec<&str> =
        list.iter().map(|ip| if ip.is_ipv4() { "IPv4" } else { "IPv6" }).collect();
    names.join("+")
}

/// The environment variable node-cache reads a Service's ClusterIP from: `<SVC>_SERVICE_HOST`.
pub fn service_host_var(service: &str) -> String {
    format!("{}_SERVICE_HOST", service.to_ascii_uppercase().replace(['-', '.'], "_"))
}

/// Cadence of one probe stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cadence {
    pub interval: Duration,
    pub timeout: Duration,
}

/// Everything `run` needs, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    pub addrs: ListenAddrs,
    /// The kube-dns-upstream ClusterIP(s): CoreDNS, not intercepted.
    pub upstream: Vec<IpAddr>,
    pub probe_name: String,
    /// UDP probes of the cache.
    pub cache_udp: Cadence,
    /// TCP probes of the cache; `None` when disabled.
    pub cache_tcp: Option<Cadence>,
    /// UDP probes of the upstream.
    pub upstream_probe: Cadence,
    pub thresholds: Thresholds,
    pub state_dir: PathBuf,
    /// What goes into the ruleset besides the NOTRACK chains: `accepts` is set after
    /// detection, when the host's firewall drops by default.
    pub shape: crate::dataplane::Shape,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None` when off.
    pub metrics_addr: Option<SocketAddr>,
    /// Run on every route change, with the change in its environment.
    pub on_transition: Option<PathBuf>,
    /// How long the transition hook may run before it is killed.
    pub hook_timeout: Duration,
    /// Probe at once when the kernel reports the cache's sockets closed.
    pub socket_events: bool,
}

/// Raw `run` settings as the command line gives them.
#[derive(Clone, Debug, Default)]
pub struct RawRun {
    pub local_ip: Vec<IpAddr>,
    pub cluster_dns_ip: Vec<IpAddr>,
    pub upstream_ip: Vec<IpAddr>,
    pub upstream_svc: String,
    pub probe_name: String,
    pub interval: String,
    pub timeout: String,
    pub tcp_interval: String,
    pub upstream_interval: String,
    pub upstream_timeout: String,
    pub fall: u32,
    pub rise: u32,
    pub min_hold: String,
    pub state_dir: PathBuf,
    /// `host:port`, or `off`.
    pub metrics_addr: String,
    pub on_transition: Option<PathBuf>,
    pub hook_timeout: String,
    pub fast_path: bool,
    pub socket_events: bool,
}

fn cadence(
    interval_flag: &'static str,
    interval: &str,
    timeout_flag: &'static str,
    timeout: &str,
) -> Result<Cadence, ConfigError> {
    let interval_d = duration_flag(interval_flag, interval)?;
    let timeout_d = duration_flag(timeout_flag, timeout)?;
    for (flag, d) in [(interval_flag, interval_d), (timeout_flag, timeout_d)] {
        if d.is_zero() {
            return Err(ConfigError::ZeroDuration { flag });
        }
    }
    if timeout_d >= interval_d {
        return Err(ConfigError::TimeoutNotBelowInterval {
            timeout_flag,
            timeout: timeout_d,
            interval_flag,
            interval: interval_d,
        });
    }
    Ok(Cadence { interval: interval_d, timeout: timeout_d })
}

impl AgentConfig {
    /// Validates `raw`; `env` looks up environment variables (injected for tests).
    pub fn from_args(
        raw: &RawRun,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<AgentConfig, ConfigError> {
        let local = address_slot("--local-ip", &raw.local_ip)?;
        let cluster_dns = address_slot("--cluster-dns-ip", &raw.cluster_dns_ip)?;
        if families(&local) != families(&cluster_dns) {
            return Err(ConfigError::FamiliesDiffer {
                local: families(&local),
                cluster: families(&cluster_dns),
            });
        }
        let upstream = if raw.upstream_ip.is_empty() {
            let env_var = service_host_var(&raw.upstream_svc);
            let value = env(&env_var)
                .filter(|v| !v.trim().is_empty())
                .ok_or_else(|| ConfigError::NoUpstream { env_var: env_var.clone() })?;
            let ip =
                value.trim().parse().map_err(|_| ConfigError::BadUpstreamEnv { env_var, value })?;
            vec![ip]
        } else {
            address_slot("--upstream-ip", &raw.upstream_ip)?
        };
        if hickory_proto::rr::Name::from_ascii(&raw.probe_name).is_err()
            || raw.probe_name.trim().is_empty()
        {
            return Err(ConfigError::BadProbeName(raw.probe_name.clone()));
        }
        let cache_udp = cadence("--interval", &raw.interval, "--timeout", &raw.timeout)?;
        let tcp_interval = duration_flag("--tcp-interval", &raw.tcp_interval)?;
        let cache_tcp = if tcp_interval.is_zero() {
            None
        } else if cache_udp.timeout >= tcp_interval {
            return Err(ConfigError::TimeoutNotBelowInterval {
                timeout_flag: "--timeout",
                timeout: cache_udp.timeout,
                interval_flag: "--tcp-interval",
                interval: tcp_interval,
            });
        } else {
            Some(Cadence { interval: tcp_interval, timeout: cache_udp.timeout })
        };
        let upstream_probe = cadence(
            "--upstream-interval",
            &raw.upstream_interval,
            "--upstream-timeout",
            &raw.upstream_timeout,
        )?;
        for (flag, n) in [("--fall", raw.fall), ("--rise", raw.rise)] {
            if n == 0 {
                return Err(ConfigError::ZeroCount { flag });
            }
        }
        let min_hold = duration_flag("--min-hold", &raw.min_hold)?;
        let metrics_addr = match raw.metrics_addr.trim() {
            "off" => None,
            text => Some(text.parse().map_err(|_| ConfigError::BadAddress {
                flag: "--metrics-addr",
                value: text.to_owned(),
            })?),
        };
        let hook_timeout = duration_flag("--hook-timeout", &raw.hook_timeout)?;
        if hook_timeout.is_zero() {
            return Err(ConfigError::ZeroDuration { flag: "--hook-timeout" });
        }
        if let Some(hook) = &raw.on_transition {
            if !hook.is_file() {
                return Err(ConfigError::NoHook(hook.clone()));
            }
        }
        Ok(AgentConfig {
            addrs: ListenAddrs { local, cluster_dns },
            upstream,
            probe_name: raw.probe_name.clone(),
            cache_udp,
            cache_tcp,
            upstream_probe,
            thresholds: Thresholds { fall: raw.fall, rise: raw.rise, min_hold },
            state_dir: raw.state_dir.clone(),
            shape: crate::dataplane::Shape { accepts: false, fast_path: raw.fast_path },
            metrics_addr,
            on_transition: raw.on_transition.clone(),
            hook_timeout,
            socket_events: raw.socket_events,
        })
    }

    /// Where the cache is probed: its link-local IP, IPv4 first.
    pub fn cache_target(&self) -> SocketAddr {
        SocketAddr::new(self.addrs.local[0], DNS_PORT)
    }

    /// Where the upstream is probed: same family as the cache target when there is one.
    pub fn upstream_target(&self) -> SocketAddr {
        let family_v4 = self.addrs.local[0].is_ipv4();
        let ip =
            self.upstream.iter().find(|ip| ip.is_ipv4() == family_v4).unwrap_or(&self.upstream[0]);
        SocketAddr::new(*ip, DNS_PORT)
    }
}

/// Valid `run` settings for tests: one IPv4 address of each kind, the command line's defaults
/// for the rest.
#[cfg(test)]
pub(crate) fn test_raw() -> RawRun {
    let ip = |s: &str| vec![s.parse().unwrap()];
    RawRun {
        local_ip: ip("169.254.20.10"),
        cluster_dns_ip: ip("10.96.0.10"),
        upstream_ip: ip("10.96.0.11"),
        upstream_svc: "kube-dns-upstream".into(),
        probe_name: "kubernetes.default.svc.cluster.local".into(),
        interval: "100ms".into(),
        timeout: "80ms".into(),
        tcp_interval: "1s".into(),
        upstream_interval: "1s".into(),
        upstream_timeout: "500ms".into(),
        fall: 3,
        rise: 5,
        min_hold: "2s".into(),
        state_dir: "/run/nodelocaldns-ha".into(),
        metrics_addr: "127.0.0.1:9254".into(),
        on_transition: None,
        hook_timeout: "5s".into(),
        fast_path: true,
        socket_events: true,
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(cfg.upstream, ips(&["10.96.0.12"]));
        let err = AgentConfig::from_args(&r, no_env).unwrap_err();
        assert!(err.to_string().contains("KUBE_DNS_UPSTREAM_SERVICE_HOST"), "{err}");
        let garbage = |_: &str| Some("not-an-ip".into());
        let err = AgentConfig::from_args(&r, garbage).unwrap_err();
        assert!(err.to_string().contains("not-an-ip"), "{err}");
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
            (Box::new(|r| r.interval = "0s".into()), "--interval must be greater"),
            (Box::new(|r| r.interval = "fast".into()), "\"fast\""),
            (Box::new(|r| r.fall = 0), "--fall must be at least 1"),
            (Box::new(|r| r.rise = 0), "--rise must be at least 1"),
            (Box::new(|r| r.min_hold = "2".into()), "--min-hold=\"2\""),
            (Box::new(|r| r.upstream_timeout = "2s".into()), "--upstream-timeout"),
            (Box::new(|r| r.probe_name = "a..b".into()), "a..b"),
        ];
        for (mutate, needle) in cases {
            let mut r = test_raw();
            mutate(&mut r);
            let err = AgentConfig::from_args(&r, no_env).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should contain {needle:?}");
        }
    }

    #[test]
    fn tcp_probes_can_be_disabled() {
        let mut r = test_raw();
        r.tcp_interval = "0s".into();
        assert_eq!(AgentConfig::from_args(&r, no_env).unwrap().cache_tcp, None);
    }
}
