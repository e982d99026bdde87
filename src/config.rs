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
    EmptyList { flag: String },
    /// Two addresses of one family in one flag.
    #[error("{flag} has two {family} addresses ({first}, {second}): give at most one per family")]
    SameFamilyTwice { flag: String, family: &'static str, first: IpAddr, second: IpAddr },
    /// The listen lists cover different families.
    #[error(
        "--local-ip {local} and --cluster-dns-ip {cluster} must cover the same IP families \
         (one address of each, or an IPv4 and an IPv6 address in both)"
    )]
    FamiliesDiffer { local: String, cluster: String },
    /// No upstream address anywhere, and no API client to wait for its Service with.
    #[error(
        "no upstream IP: pass --upstream-ip, or set {env_var} (the ClusterIP of --upstream-svc \
         {svc:?}, as Kubernetes sets it for a Service in the pod's namespace), or give \
         --node-name so that the agent waits for the Service through the API server"
    )]
    NoUpstream { env_var: String, svc: String },
    /// Neither shape is left to fail over.
    #[error(
        "nothing to fail over: without --cluster-dns-ip only the link-local IP fails over, \
         and --link-local-failover=false turns that off (give the kube-dns ClusterIP, or drop \
         --link-local-failover=false)"
    )]
    NothingToFailOver,
    /// The upstream fallback variable holds no IP.
    #[error("{env_var}={value:?} is not an IP address")]
    BadUpstreamEnv { env_var: String, value: String },
    /// A duration that cannot be parsed.
    #[error("{flag}={value:?} is not a duration: write e.g. 100ms, 2s or 1m")]
    BadDuration { flag: &'static str, value: String },
    /// A zero duration where time must pass.
    #[error("{flag}={value:?} must be greater than zero")]
    ZeroDuration { flag: &'static str, value: String },
    /// A probe that could outlive its interval.
    #[error("{timeout_flag} ({timeout:?}) must be shorter than {interval_flag} ({interval:?}): probes must not overlap")]
    TimeoutNotBelowInterval {
        timeout_flag: &'static str,
        timeout: Duration,
        interval_flag: &'static str,
        interval: Duration,
    },
    /// `--fall 0` or `--rise 0`.
    #[error("{flag} 0: must be at least 1 (consecutive probes)")]
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
    /// A probe name still holding a manifest's placeholder: the probes would ask for a name no
    /// cluster has, and the cache would forward it out of the cluster.
    #[error("--probe-name {0:?} holds a placeholder: fill in the cluster's DNS domain (e.g. sed -e s/__PILLAR__DNS__DOMAIN__/cluster.local/g, see manifests/README.md)")]
    ProbeNamePlaceholder(String),
    /// A duration beyond any sensible setting (a typo, or a unit mixed up).
    #[error("{flag}={value:?} is too long: at most {max} (30 days)", max = MAX_DURATION_TEXT)]
    TooLong { flag: &'static str, value: String },
    /// An address no DNS server listens on: unspecified, multicast or broadcast.
    #[error("{flag} {ip} is not a unicast address: give the IP a DNS server listens on")]
    NotUnicast { flag: String, ip: IpAddr },
    /// The upstream is intercepted, or lacks the cache's family.
    #[error(transparent)]
    Upstream(#[from] crate::upstream::Unusable),
    /// No upstream Service name to read the upstream's address from.
    #[error("--upstream-svc is empty: give the upstream Service's name, or --upstream-ip")]
    EmptyUpstreamSvc,
    /// The state directory cannot hold the control socket.
    #[error(
        "--state-dir {} is too long for the control socket in it (a Unix socket path has at \
         most 107 bytes): use a shorter --state-dir", .0.display()
    )]
    StateDirTooLong(PathBuf),
    /// An empty state directory would put the agent's files in its working directory.
    #[error("--state-dir is empty: give a directory, e.g. /run/nodelocaldns-ha")]
    EmptyStateDir,
    /// The transition hook cannot be run.
    #[error("--on-transition {}: not executable (chmod +x it)", .0.display())]
    HookNotExecutable(PathBuf),
    /// A kubeconfig for reports that have no node to go to.
    #[error("--kubeconfig {} without --node-name: give the node's name (NODELOCALDNS_HA_NODE_NAME from spec.nodeName), or leave --kubeconfig out", .0.display())]
    KubeconfigWithoutNode(PathBuf),
    /// The kubeconfig is not a file.
    #[error("--kubeconfig {}: no such file", .0.display())]
    NoKubeconfig(PathBuf),
    /// A startup taint with no node to remove it from.
    #[error("--startup-taint {0:?} without --node-name: give the node's name (NODELOCALDNS_HA_NODE_NAME from spec.nodeName)")]
    TaintWithoutNode(String),
    /// A DaemonSet to ask at SIGTERM with no client to ask it.
    #[error("--daemonset {0:?} without --node-name: give the node's name (NODELOCALDNS_HA_NODE_NAME from spec.nodeName), or leave --daemonset out")]
    DaemonsetWithoutNode(String),
    /// A taint key Kubernetes would refuse.
    #[error("--startup-taint {0:?} is not a taint key: [prefix/]name, the name at most 63 characters of letters, digits, '.', '_' and '-', alphanumeric at both ends")]
    BadTaintKey(String),
    /// A stall bound too short to split into a suspicion and a confirm probe.
    #[error(
        "--stall-bound={0:?} is too short: at least 6ms (a third of it waits before the confirm \
         probe, the rest is that probe's timeout), or 0s to turn the stall watch off"
    )]
    StallBoundTooShort(String),
    /// Looks at the cache's sockets more often than while a queue is non-empty.
    #[error(
        "--stall-look={0:?} is too short: at least 2ms (how often the watch looks while a queue \
         holds queries; it looks less often while they are empty)"
    )]
    StallLookTooShort(String),
}

/// The longest duration any flag takes. Longer ones are typos or mixed-up units; this also keeps
/// every deadline the agent computes far from the clock's limits.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);
const MAX_DURATION_TEXT: &str = "720h";

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

/// Parses the value of a duration flag, at most [`MAX_DURATION`]; the error names the flag and
/// the value.
pub fn duration_flag(flag: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(value)
        .ok_or_else(|| ConfigError::BadDuration { flag, value: value.to_owned() })?;
    if d > MAX_DURATION {
        return Err(ConfigError::TooLong { flag, value: value.to_owned() });
    }
    Ok(d)
}

/// Whether a DNS server can listen on `ip`: not unspecified, multicast or broadcast.
fn is_unicast(ip: IpAddr) -> bool {
    let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    !(ip.is_unspecified() || ip.is_multicast() || broadcast)
}

/// Checks that `list` (from `flag`, a flag or an environment variable) holds one or two unicast
/// addresses, at most one per family; v4 first.
pub fn address_slot(flag: &str, list: &[IpAddr]) -> Result<Vec<IpAddr>, ConfigError> {
    let mut v4 = None;
    let mut v6 = None;
    for &ip in list {
        if !is_unicast(ip) {
            return Err(ConfigError::NotUnicast { flag: flag.to_owned(), ip });
        }
        let (slot, family) = match ip {
            IpAddr::V4(_) => (&mut v4, "IPv4"),
            IpAddr::V6(_) => (&mut v6, "IPv6"),
        };
        if let Some(first) = *slot {
            let flag = flag.to_owned();
            return Err(ConfigError::SameFamilyTwice { flag, family, first, second: ip });
        }
        *slot = Some(ip);
    }
    let out: Vec<IpAddr> = v4.into_iter().chain(v6).collect();
    if out.is_empty() {
        return Err(ConfigError::EmptyList { flag: flag.to_owned() });
    }
    Ok(out)
}

/// The addresses node-local-dns listens on, checked: `--local-ip` one or two unicast addresses;
/// `--cluster-dns-ip` none (the link-local shape: pods query the link-local IP itself) or one or
/// two, covering the same families.
pub fn listen_addrs(local: &[IpAddr], cluster_dns: &[IpAddr]) -> Result<ListenAddrs, ConfigError> {
    let local = address_slot("--local-ip", local)?;
    if cluster_dns.is_empty() {
        return Ok(ListenAddrs { local, cluster_dns: Vec::new() });
    }
    let cluster_dns = address_slot("--cluster-dns-ip", cluster_dns)?;
    if families(&local) != families(&cluster_dns) {
        let describe = |list: &[IpAddr]| {
            let ips: Vec<String> = list.iter().map(ToString::to_string).collect();
            format!("{} ({})", ips.join(","), families(list))
        };
        return Err(ConfigError::FamiliesDiffer {
            local: describe(&local),
            cluster: describe(&cluster_dns),
        });
    }
    Ok(ListenAddrs { local, cluster_dns })
}

/// The longest file name the agent binds in the state directory: the control socket's
/// temporary name, `.control.sock.<pid>`.
fn longest_socket_name() -> String {
    format!(".{}.{}", crate::control::SOCKET, u32::MAX)
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
    /// The kube-dns-upstream ClusterIP(s) at start, and where they came from ([`crate::upstream`]).
    pub upstream: crate::upstream::Upstream,
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
    /// detection: in every iptables flavour the node uses.
    pub shape: crate::dataplane::Shape,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None` when off.
    pub metrics_addr: Option<SocketAddr>,
    /// Run on every route change, with the change in its environment.
    pub on_transition: Option<PathBuf>,
    /// How long the transition hook may run before it is killed.
    pub hook_timeout: Duration,
    /// Probe at once when the kernel reports the cache's sockets closed.
    pub socket_events: bool,
    /// Watch the cache's sockets for stalls (`crate::stall`); `None` when off.
    pub stall: Option<crate::stall::Bounds>,
    /// The quiet pace's period ([`crate::pace`]); `None` when off.
    pub quiet: Option<Duration>,
    /// Where the node condition and Events go, if anywhere.
    pub cluster: Option<crate::cluster::Settings>,
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
    pub link_local_failover: bool,
    pub socket_events: bool,
    /// `0s`: no stall watch.
    pub stall_bound: String,
    pub stall_look: String,
    /// `0s`: no quiet pace.
    pub quiet_interval: String,
    pub node_name: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub startup_taint: Option<String>,
    pub startup_taint_timeout: String,
    pub daemonset: Option<String>,
}

fn cadence(
    interval_flag: &'static str,
    interval: &str,
    timeout_flag: &'static str,
    timeout: &str,
) -> Result<Cadence, ConfigError> {
    let interval_d = duration_flag(interval_flag, interval)?;
    let timeout_d = duration_flag(timeout_flag, timeout)?;
    for (flag, value, d) in
        [(interval_flag, interval, interval_d), (timeout_flag, timeout, timeout_d)]
    {
        if d.is_zero() {
            return Err(ConfigError::ZeroDuration { flag, value: value.to_owned() });
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

/// The stall watch's bounds; `None` for a zero bound (off). Both flags are checked either way.
fn stall_bounds(bound: &str, look: &str) -> Result<Option<crate::stall::Bounds>, ConfigError> {
    let bound_d = duration_flag("--stall-bound", bound)?;
    let look_idle = duration_flag("--stall-look", look)?;
    if look_idle < crate::stall::LOOK_BUSY {
        return Err(ConfigError::StallLookTooShort(look.to_owned()));
    }
    if bound_d.is_zero() {
        return Ok(None);
    }
    if bound_d < Duration::from_millis(6) {
        return Err(ConfigError::StallBoundTooShort(bound.to_owned()));
    }
    Ok(Some(crate::stall::Bounds { bound: bound_d, look_idle }))
}

impl AgentConfig {
    /// Validates `raw`; `env` looks up environment variables (injected for tests).
    pub fn from_args(
        raw: &RawRun,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<AgentConfig, ConfigError> {
        let addrs = listen_addrs(&raw.local_ip, &raw.cluster_dns_ip)?;
        if addrs.cluster_dns.is_empty() && !raw.link_local_failover {
            return Err(ConfigError::NothingToFailOver);
        }
        let upstream = if raw.upstream_ip.is_empty() {
            if raw.upstream_svc.trim().is_empty() {
                return Err(ConfigError::EmptyUpstreamSvc);
            }
            let env_var = service_host_var(&raw.upstream_svc);
            let follows = raw.node_name.as_deref().is_some_and(|n| !n.trim().is_empty());
            match env(&env_var).filter(|v| !v.trim().is_empty()) {
                Some(value) => {
                    let ip: IpAddr = value.trim().parse().map_err(|_| {
                        ConfigError::BadUpstreamEnv { env_var: env_var.clone(), value }
                    })?;
                    let ips = address_slot(&env_var, &[ip])?;
                    crate::upstream::check(&env_var, &ips, &addrs)?;
                    crate::upstream::Upstream { ips, from: env_var }
                }
                // The Service did not exist when the pod started: with the API client, it is
                // waited for ([`crate::upstream`]).
                None if follows => crate::upstream::Upstream::awaited(raw.upstream_svc.trim()),
                None => {
                    let svc = raw.upstream_svc.clone();
                    return Err(ConfigError::NoUpstream { env_var, svc });
                }
            }
        } else {
            let ips = address_slot("--upstream-ip", &raw.upstream_ip)?;
            crate::upstream::check("--upstream-ip", &ips, &addrs)?;
            crate::upstream::Upstream { ips, from: "--upstream-ip".into() }
        };
        if raw.state_dir.as_os_str().is_empty() {
            return Err(ConfigError::EmptyStateDir);
        }
        let socket = raw.state_dir.join(longest_socket_name());
        if socket.as_os_str().len() > 107 {
            return Err(ConfigError::StateDirTooLong(raw.state_dir.clone()));
        }
        if hickory_proto::rr::Name::from_ascii(&raw.probe_name).is_err()
            || raw.probe_name.trim().is_empty()
        {
            return Err(ConfigError::BadProbeName(raw.probe_name.clone()));
        }
        if raw.probe_name.contains("__PILLAR__") {
            return Err(ConfigError::ProbeNamePlaceholder(raw.probe_name.clone()));
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
            text => Some(listen_addr(text).ok_or_else(|| ConfigError::BadAddress {
                flag: "--metrics-addr",
                value: text.to_owned(),
            })?),
        };
        let stall = stall_bounds(&raw.stall_bound, &raw.stall_look)?;
        let quiet = Some(duration_flag("--quiet-interval", &raw.quiet_interval)?)
            .filter(|quiet| !quiet.is_zero());
        let hook_timeout = duration_flag("--hook-timeout", &raw.hook_timeout)?;
        if hook_timeout.is_zero() {
            let value = raw.hook_timeout.clone();
            return Err(ConfigError::ZeroDuration { flag: "--hook-timeout", value });
        }
        if let Some(hook) = &raw.on_transition {
            use std::os::unix::fs::PermissionsExt;
            match std::fs::metadata(hook) {
                Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => {}
                Ok(meta) if meta.is_file() => {
                    return Err(ConfigError::HookNotExecutable(hook.clone()))
                }
                _ => return Err(ConfigError::NoHook(hook.clone())),
            }
        }
        Ok(AgentConfig {
            addrs,
            upstream,
            probe_name: raw.probe_name.clone(),
            cache_udp,
            cache_tcp,
            upstream_probe,
            thresholds: Thresholds { fall: raw.fall, rise: raw.rise, min_hold },
            state_dir: raw.state_dir.clone(),
            shape: crate::dataplane::Shape {
                accepts: false,
                fast_path: raw.fast_path,
                link_local: raw.link_local_failover,
            },
            metrics_addr,
            on_transition: raw.on_transition.clone(),
            hook_timeout,
            socket_events: raw.socket_events,
            stall,
            quiet,
            cluster: cluster_settings(raw)?,
        })
    }

    /// Where the cache is probed: its link-local IP, IPv4 first.
    pub fn cache_target(&self) -> SocketAddr {
        SocketAddr::new(self.addrs.local[0], DNS_PORT)
    }

    /// Where the upstream is probed: same family as the cache target when there is one.
    pub fn upstream_target(&self) -> SocketAddr {
        crate::upstream::pick(&self.upstream.ips, self.addrs.local[0].is_ipv4(), DNS_PORT)
    }
}

/// `IP:PORT`, `[IPv6]:PORT`, or `[IPv4]:PORT` as Go writes it: the DaemonSet's
/// `[$(HOST_IP)]:9254` holds for the node's address of either family (the downward API gives
/// it bare).
fn listen_addr(text: &str) -> Option<SocketAddr> {
    if let Ok(addr) = text.parse() {
        return Some(addr);
    }
    let (ip, port) = text.strip_prefix('[')?.split_once("]:")?;
    let ip: std::net::Ipv4Addr = ip.parse().ok()?;
    Some(SocketAddr::new(ip.into(), port.parse().ok()?))
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
        link_local_failover: true,
        socket_events: true,
        stall_bound: "30ms".into(),
        stall_look: "20ms".into(),
        quiet_interval: "1s".into(),
        node_name: None,
        kubeconfig: None,
        startup_taint: None,
        startup_taint_timeout: "5m".into(),
        daemonset: None,
    }
}

/// The reports' settings: on with a node name; a kubeconfig given must exist.
fn cluster_settings(raw: &RawRun) -> Result<Option<crate::cluster::Settings>, ConfigError> {
    let node_name = raw.node_name.as_deref().map(str::trim).filter(|n| !n.is_empty());
    let taint = raw.startup_taint.as_deref().map(str::trim);
    let daemonset = raw.daemonset.as_deref().map(str::trim).filter(|d| !d.is_empty());
    let Some(node_name) = node_name else {
        return match (&raw.kubeconfig, taint, daemonset) {
            (Some(path), _, _) => Err(ConfigError::KubeconfigWithoutNode(path.clone())),
            (None, Some(key), _) => Err(ConfigError::TaintWithoutNode(key.to_owned())),
            (None, None, Some(ds)) => Err(ConfigError::DaemonsetWithoutNode(ds.to_owned())),
            (None, None, None) => Ok(None),
        };
    };
    if let Some(path) = raw.kubeconfig.as_ref().filter(|p| !p.is_file()) {
        return Err(ConfigError::NoKubeconfig(path.clone()));
    }
    if let Some(key) = taint.filter(|k| !crate::cluster::report::is_taint_key(k)) {
        return Err(ConfigError::BadTaintKey(key.to_owned()));
    }
    let flag = "--startup-taint-timeout";
    let startup_taint_bound = duration_flag(flag, &raw.startup_taint_timeout)?;
    if startup_taint_bound.is_zero() {
        let value = raw.startup_taint_timeout.clone();
        return Err(ConfigError::ZeroDuration { flag, value });
    }
    let (node_name, kubeconfig) = (node_name.to_owned(), raw.kubeconfig.clone());
    let startup_taint = taint.map(str::to_owned);
    // A flag wins: only an upstream from the environment is followed.
    let upstream_svc = raw.upstream_ip.is_empty().then(|| raw.upstream_svc.trim().to_owned());
    let daemonset = daemonset.map(str::to_owned);
    Ok(Some(crate::cluster::Settings {
        node_name,
        kubeconfig,
        startup_taint,
        startup_taint_bound,
        upstream_svc,
        daemonset,
    }))
}

#[cfg(test)]
mod tests;
