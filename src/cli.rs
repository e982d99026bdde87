//! The command line. Doc comments here are the `--help` text; every flag also reads an
//! environment variable `NODELOCALDNS_HA_<FLAG>`.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::RawRun;
use crate::ruleset::Route;

/// Keeps a node's DNS alive when node-local-dns fails: probes the cache and switches the
/// NOTRACK rules that send pods' DNS to it, so queries fall through to CoreDNS while it is down.
#[derive(Debug, Parser)]
#[command(name = "nodelocaldns-ha", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log filter (tracing-subscriber syntax), e.g. `info` or `nodelocaldns_ha=debug`.
    #[arg(long, global = true, env = "NODELOCALDNS_HA_LOG", default_value = "info")]
    pub log: String,
    /// Log format: one line of text, or one JSON object, per event.
    #[arg(
        long,
        global = true,
        env = "NODELOCALDNS_HA_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: probe, decide, switch, until SIGTERM or SIGINT.
    Run(Box<RunArgs>),
    /// Show the running agent's route, why, since when, and probe statistics.
    Status(StatusArgs),
    /// Print the ruleset the agent would install for a route (dry run, changes nothing).
    Rules(RulesArgs),
    /// Send one DNS probe and print its outcome and latency.
    Probe(ProbeArgs),
    /// Remove everything the agent installed. Fine to run when nothing is installed.
    Teardown(TeardownArgs),
    /// Force a route for maintenance (`flip upstream`, `flip local`).
    Flip(FlipArgs),
    /// End a forced route: automatic again.
    Release(ControlArgs),
    /// Before restarting node-local-dns: route to CoreDNS, wait until the cache has gone quiet.
    /// The agent returns to the cache once the new one passes its probes.
    Drain(DrainArgs),
    /// Remove the agents from every node (the chart's pre-delete hook runs it): delete their
    /// DaemonSet with foreground propagation and wait until its pods are gone. Each agent, at its
    /// SIGTERM, finds its DaemonSet being deleted and puts its node back while its RBAC is still
    /// there.
    Uninstall(UninstallArgs),
}

/// Where the running agent is.
#[derive(Debug, Args)]
pub struct ControlArgs {
    /// The running agent's --state-dir.
    #[arg(long, env = "NODELOCALDNS_HA_STATE_DIR", default_value = "/run/nodelocaldns-ha")]
    pub state_dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct FlipArgs {
    /// The route to force.
    #[arg(value_enum)]
    pub route: RouteArg,
    /// Release by itself after this long (e.g. 30m); default: until `release`.
    #[arg(long = "for", allow_hyphen_values = true)]
    pub for_: Option<String>,
    /// Why, for `status` and the log.
    #[arg(long, default_value = "")]
    pub reason: String,
    #[command(flatten)]
    pub control: ControlArgs,
    /// With no agent running: node-local-dns's link-local IP(s), to install the rules directly.
    #[arg(long, env = "NODELOCALDNS_HA_LOCAL_IP", value_delimiter = ',')]
    pub local_ip: Vec<IpAddr>,
    /// With no agent running: the kube-dns ClusterIP(s), to install the rules directly.
    #[arg(long, env = "NODELOCALDNS_HA_CLUSTER_DNS_IP", value_delimiter = ',')]
    pub cluster_dns_ip: Vec<IpAddr>,
}

#[derive(Debug, Args)]
pub struct DrainArgs {
    /// How long to wait for the cache to go quiet.
    #[arg(long, allow_hyphen_values = true, default_value = "10s")]
    pub timeout: String,
    #[command(flatten)]
    pub control: ControlArgs,
}

/// How log lines look.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The netfilter backend for the switching rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DataplaneKind {
    /// What the node's kube-proxy uses (see `status` for what was found and why).
    Auto,
    /// Native nftables over netlink: one table, replaced atomically.
    Nftables,
    /// The agent's chains in iptables-legacy, one iptables-restore transaction per change.
    IptablesLegacy,
    /// The agent's chains in iptables-nft, one iptables-restore transaction per change.
    IptablesNft,
}

/// The addresses node-local-dns listens on.
#[derive(Debug, Args, Clone)]
pub struct ListenArgs {
    /// node-local-dns's link-local IP; an IPv4 and an IPv6 address, comma-separated, for dual stack.
    #[arg(long, env = "NODELOCALDNS_HA_LOCAL_IP", value_delimiter = ',', required = true)]
    pub local_ip: Vec<IpAddr>,
    /// The kube-dns ClusterIP that pods query (one per family), when node-local-dns intercepts
    /// it (kube-proxy in iptables or nftables mode). Without: the link-local shape, where pods
    /// query --local-ip itself (kubelet's --cluster-dns), e.g. kube-proxy in IPVS mode.
    #[arg(long, env = "NODELOCALDNS_HA_CLUSTER_DNS_IP", value_delimiter = ',')]
    pub cluster_dns_ip: Vec<IpAddr>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub listen: ListenArgs,
    /// The kube-dns-upstream ClusterIP (CoreDNS, not intercepted), probed to know whether failing
    /// over helps. Default: the `<SVC>_SERVICE_HOST` variable of --upstream-svc.
    #[arg(long, env = "NODELOCALDNS_HA_UPSTREAM_IP", value_delimiter = ',')]
    pub upstream_ip: Vec<IpAddr>,
    /// The upstream Service whose `<SVC>_SERVICE_HOST` variable gives --upstream-ip.
    #[arg(long, env = "NODELOCALDNS_HA_UPSTREAM_SVC", default_value = "kube-dns-upstream")]
    pub upstream_svc: String,
    /// The name queried (type A) by every probe.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_PROBE_NAME",
        default_value = "kubernetes.default.svc.cluster.local"
    )]
    pub probe_name: String,
    /// Time between UDP probes of the cache; also the resync period of the ruleset.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_INTERVAL",
        allow_hyphen_values = true,
        default_value = "100ms"
    )]
    pub interval: String,
    /// How long a probe of the cache waits for its answer; must be below --interval.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_TIMEOUT",
        allow_hyphen_values = true,
        default_value = "80ms"
    )]
    pub timeout: String,
    /// Time between TCP probes of the cache; 0s disables them.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_TCP_INTERVAL",
        allow_hyphen_values = true,
        default_value = "1s"
    )]
    pub tcp_interval: String,
    /// Time between probes of the upstream.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_UPSTREAM_INTERVAL",
        allow_hyphen_values = true,
        default_value = "1s"
    )]
    pub upstream_interval: String,
    /// How long a probe of the upstream waits for its answer.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_UPSTREAM_TIMEOUT",
        allow_hyphen_values = true,
        default_value = "500ms"
    )]
    pub upstream_timeout: String,
    /// Consecutive failed probes of the cache before switching to the upstream.
    #[arg(long, env = "NODELOCALDNS_HA_FALL", allow_negative_numbers = true, default_value_t = 3)]
    pub fall: u32,
    /// Consecutive good probes of the cache before switching back to it.
    #[arg(long, env = "NODELOCALDNS_HA_RISE", allow_negative_numbers = true, default_value_t = 5)]
    pub rise: u32,
    /// Minimum time on the upstream before switching back to the cache.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_MIN_HOLD",
        allow_hyphen_values = true,
        default_value = "2s"
    )]
    pub min_hold: String,
    /// The netfilter backend for the switching rules.
    #[arg(long, env = "NODELOCALDNS_HA_DATAPLANE", value_enum, default_value = "auto")]
    pub dataplane: DataplaneKind,
    /// How long an iptables change waits for the xtables lock before it is retried later.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_XTABLES_WAIT",
        allow_hyphen_values = true,
        default_value = "1s"
    )]
    pub xtables_wait: String,
    /// Where the state file, the override and the control socket live.
    #[arg(long, env = "NODELOCALDNS_HA_STATE_DIR", default_value = "/run/nodelocaldns-ha")]
    pub state_dir: PathBuf,
    /// Where /metrics, /healthz and /readyz are served (IP:port), or `off`.
    #[arg(long, env = "NODELOCALDNS_HA_METRICS_ADDR", default_value = "127.0.0.1:9254")]
    pub metrics_addr: String,
    /// An executable run on every route change, with NODELOCALDNS_HA_FROM, _TO, _REASON,
    /// _REASON_KIND and _UNIX_MS in its environment; it never delays a switch.
    #[arg(long, env = "NODELOCALDNS_HA_ON_TRANSITION")]
    pub on_transition: Option<PathBuf>,
    /// How long the transition hook may run before it is killed.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_HOOK_TIMEOUT",
        allow_hyphen_values = true,
        default_value = "5s"
    )]
    pub hook_timeout: String,
    /// The kernel fast path (pods fail over on the next packet when the cache's socket is gone).
    /// `false` leaves only the probe-driven switch: for comparisons.
    #[arg(long, env = "NODELOCALDNS_HA_FAST_PATH", default_value_t = true, action = clap::ArgAction::Set)]
    pub fast_path: bool,
    /// Fail the link-local IP over too: queries to it that the cache cannot take go to the
    /// agent's forwarder (TPROXY), which asks the upstream. Needs nft_tproxy and nft_socket (or
    /// xt_TPROXY and xt_socket). `false`: only the cluster-DNS IP fails over.
    #[arg(long, env = "NODELOCALDNS_HA_LINK_LOCAL_FAILOVER", default_value_t = true, action = clap::ArgAction::Set)]
    pub link_local_failover: bool,
    /// Listen to the kernel's socket-destroy events to probe at once when the cache's sockets
    /// close. `false` leaves only the probe cadence: for comparisons.
    #[arg(long, env = "NODELOCALDNS_HA_SOCKET_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub socket_events: bool,
    /// Leave a cache whose socket stalls: queries wait in it unread, the queue not going down,
    /// for this long while a probe gets no answer. Pauses shorter than this never count. 0s
    /// leaves hangs to the probes.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_STALL_BOUND",
        allow_hyphen_values = true,
        default_value = "30ms"
    )]
    pub stall_bound: String,
    /// How often the cache's socket queues are looked at while they are empty (every 2ms while
    /// one is not).
    #[arg(
        long,
        env = "NODELOCALDNS_HA_STALL_LOOK",
        allow_hyphen_values = true,
        default_value = "20ms"
    )]
    pub stall_look: String,
    /// On a healthy node without DNS traffic, the cache probe, the stall watch and the resync
    /// tick every this instead of every --interval (at once back to it on traffic, a queue, a
    /// failed or slow probe). Needs the stall watch and socket events. 0s: always --interval.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_QUIET_INTERVAL",
        allow_hyphen_values = true,
        default_value = "1s"
    )]
    pub quiet_interval: String,
    /// The node the agent runs on (the DaemonSet sets it from `spec.nodeName`): with an API
    /// client, its condition NodeLocalDNSReady and Events on route changes are reported there.
    /// Unset: nothing is reported.
    #[arg(long, env = "NODELOCALDNS_HA_NODE_NAME")]
    pub node_name: Option<String>,
    /// The kubeconfig of the reports' API client; unset: the pod's service account.
    #[arg(long, env = "NODELOCALDNS_HA_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// A taint on the node (its key) that the reports remove once pods on the node have DNS
    /// (the cache answers, or the fallback is in and CoreDNS answers), so that workloads are
    /// scheduled where DNS works; needs --node-name.
    #[arg(long, env = "NODELOCALDNS_HA_STARTUP_TAINT")]
    pub startup_taint: Option<String>,
    /// The longest the startup taint stays: after it, the taint goes whatever DNS does, and the
    /// node condition and the log say why (an agent that cannot get there must not keep its
    /// node unschedulable).
    #[arg(long, env = "NODELOCALDNS_HA_STARTUP_TAINT_TIMEOUT", default_value = "5m")]
    pub startup_taint_timeout: String,
    /// The agent's own DaemonSet, in its pod's namespace (with --node-name): asked at SIGTERM.
    /// Gone or being deleted, the agent is being removed: it removes its rules, its copies of
    /// the link-local IPs, its node condition and the startup taint. There, or not known in 3 s:
    /// a restart, and the rules stay for the next agent. Unset: every SIGTERM leaves the rules.
    #[arg(long, env = "NODELOCALDNS_HA_DAEMONSET")]
    pub daemonset: Option<String>,
}

impl RunArgs {
    /// The raw settings for validation.
    pub fn raw(&self) -> RawRun {
        RawRun {
            local_ip: self.listen.local_ip.clone(),
            cluster_dns_ip: self.listen.cluster_dns_ip.clone(),
            upstream_ip: self.upstream_ip.clone(),
            upstream_svc: self.upstream_svc.clone(),
            probe_name: self.probe_name.clone(),
            interval: self.interval.clone(),
            timeout: self.timeout.clone(),
            tcp_interval: self.tcp_interval.clone(),
            upstream_interval: self.upstream_interval.clone(),
            upstream_timeout: self.upstream_timeout.clone(),
            fall: self.fall,
            rise: self.rise,
            min_hold: self.min_hold.clone(),
            state_dir: self.state_dir.clone(),
            metrics_addr: self.metrics_addr.clone(),
            on_transition: self.on_transition.clone(),
            hook_timeout: self.hook_timeout.clone(),
            fast_path: self.fast_path,
            link_local_failover: self.link_local_failover,
            socket_events: self.socket_events,
            stall_bound: self.stall_bound.clone(),
            stall_look: self.stall_look.clone(),
            quiet_interval: self.quiet_interval.clone(),
            node_name: self.node_name.clone(),
            kubeconfig: self.kubeconfig.clone(),
            startup_taint: self.startup_taint.clone(),
            startup_taint_timeout: self.startup_taint_timeout.clone(),
            daemonset: self.daemonset.clone(),
        }
    }
}

#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// The agents' DaemonSet, in the client's namespace (the pod's).
    #[arg(long, env = "NODELOCALDNS_HA_DAEMONSET", default_value = "nodelocaldns-ha")]
    pub daemonset: String,
    /// How long to wait for its pods to go; then it says which are left and exits 0, so that
    /// the uninstall goes on (an agent on a node that is down never gets its SIGTERM).
    #[arg(long, default_value = "100s", allow_hyphen_values = true)]
    pub timeout: String,
    /// A kubeconfig; unset: the pod's service account.
    #[arg(long, env = "NODELOCALDNS_HA_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print the state as JSON.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 unless an agent runs with this state directory and has its ruleset in (its
    /// readiness), saying which is not so: for a check such as `helm test`.
    #[arg(long)]
    pub check: bool,
    /// The running agent's --state-dir.
    #[arg(long, env = "NODELOCALDNS_HA_STATE_DIR", default_value = "/run/nodelocaldns-ha")]
    pub state_dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct RulesArgs {
    /// The route whose ruleset to print.
    #[arg(long, value_enum)]
    pub route: RouteArg,
    #[command(flatten)]
    pub listen: ListenArgs,
    /// With the link-local IPs' fallback chain, as `run` installs it (`false`: as `flip` does
    /// with no agent running, or `run --link-local-failover false`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub link_local_failover: bool,
}

/// A route, as given on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RouteArg {
    Local,
    Upstream,
}

impl From<RouteArg> for Route {
    fn from(r: RouteArg) -> Route {
        match r {
            RouteArg::Local => Route::Local,
            RouteArg::Upstream => Route::Upstream,
        }
    }
}

#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// The server to probe: IP or IP:port (`[v6]:port`); port 53 by default.
    #[arg(long, env = "NODELOCALDNS_HA_PROBE_SERVER")]
    pub server: String,
    /// Probe over TCP instead of UDP.
    #[arg(long)]
    pub tcp: bool,
    /// The name queried (type A).
    #[arg(
        long,
        env = "NODELOCALDNS_HA_PROBE_NAME",
        default_value = "kubernetes.default.svc.cluster.local"
    )]
    pub probe_name: String,
    /// How long to wait for the answer.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_PROBE_TIMEOUT",
        allow_hyphen_values = true,
        default_value = "1s"
    )]
    pub timeout: String,
}

#[derive(Debug, Args)]
pub struct TeardownArgs {
    /// How long to wait for the xtables lock.
    #[arg(
        long,
        env = "NODELOCALDNS_HA_XTABLES_WAIT",
        allow_hyphen_values = true,
        default_value = "5s"
    )]
    pub xtables_wait: String,
    /// The agent's --state-dir: teardown refuses while an agent runs there, and removes its
    /// state file.
    #[arg(long, env = "NODELOCALDNS_HA_STATE_DIR", default_value = "/run/nodelocaldns-ha")]
    pub state_dir: PathBuf,
}

/// For a refusal that names flags: the environment variables that gave those flags their values,
/// as ` (set by NODELOCALDNS_HA_INTERVAL="1parsec")`, or an empty string. An operator who
/// configures the agent through its environment (a DaemonSet's `env:`) is pointed at the
/// setting to fix. A flag counts as set by its variable when the variable is set and the flag is
/// not among `args` (the command line wins over the environment).
pub fn env_sources(message: &str, args: &[String], env: impl Fn(&str) -> Option<String>) -> String {
    use clap::CommandFactory;
    let cli = Cli::command();
    let mut found: Vec<String> = Vec::new();
    for command in std::iter::once(&cli).chain(cli.get_subcommands()) {
        for arg in command.get_arguments() {
            let (Some(long), Some(var)) = (arg.get_long(), arg.get_env()) else { continue };
            let flag = format!("--{long}");
            let on_command_line =
                args.iter().any(|a| *a == flag || a.starts_with(&format!("{flag}=")));
            let var = var.to_string_lossy();
            let Some(value) = env(&var) else { continue };
            let entry = format!("{var}={value:?}");
            if names_flag(message, &flag) && !on_command_line && !found.contains(&entry) {
                found.push(entry);
            }
        }
    }
    if found.is_empty() {
        String::new()
    } else {
        format!(" (set by {})", found.join(", "))
    }
}

/// Whether `message` mentions `flag` itself, not a longer flag it begins (`--log` in
/// `--log-format`).
fn names_flag(message: &str, flag: &str) -> bool {
    message.match_indices(flag).any(|(at, _)| {
        let next = message[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn a_refusal_names_the_variables_that_set_its_flags() {
        let vars = [
            ("NODELOCALDNS_HA_INTERVAL", "1parsec"),
            ("NODELOCALDNS_HA_LOG_FORMAT", "xml"),
            ("NODELOCALDNS_HA_STATE_DIR", "/x"),
        ];
        let args = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let message = "--interval=\"1parsec\" is not a duration";
        assert_eq!(
            env_sources(message, &args(&["run"]), env_of(&vars)),
            " (set by NODELOCALDNS_HA_INTERVAL=\"1parsec\")"
        );
        // The command line wins: the variable did not set it.
        assert_eq!(env_sources(message, &args(&["run", "--interval", "x"]), env_of(&vars)), "");
        assert_eq!(env_sources(message, &args(&["run", "--interval=x"]), env_of(&vars)), "");
        // `--upstream-interval` is not `--interval`; `--log` is not `--log-format`.
        assert_eq!(env_sources("--upstream-interval x", &args(&[]), env_of(&vars)), "");
        let message = "invalid value 'xml' for '--log-format <LOG_FORMAT>'";
        assert_eq!(
            env_sources(message, &args(&[]), env_of(&vars)),
            " (set by NODELOCALDNS_HA_LOG_FORMAT=\"xml\")"
        );
        // A variable several subcommands read is named once.
        assert_eq!(
            env_sources("--state-dir /x is too long", &args(&[]), env_of(&vars)),
            " (set by NODELOCALDNS_HA_STATE_DIR=\"/x\")"
        );
        assert_eq!(env_sources("--fall 0: must be at least 1", &args(&[]), env_of(&vars)), "");
    }
}
