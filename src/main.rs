//! `nodelocaldns-ha`: parse the command line, run one command, map errors to exit codes.
//!
//! Exit codes: 0 success; 1 a runtime failure (netlink, I/O); 2 bad input or a missing
//! privilege, reported before anything on the host changed.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Parser;
use tracing_subscriber::EnvFilter;

use nodelocaldns_ha::cli::{
    self, Cli, Command, DataplaneKind, FlipArgs, ListenArgs, LogFormat, ProbeArgs, StatusArgs,
};
use nodelocaldns_ha::config::{self, AgentConfig};
use nodelocaldns_ha::control::{self, ControlError, Request, Response};
use nodelocaldns_ha::dataplane;
use nodelocaldns_ha::dataplane::iptables::{Flavour, Iptables, Table};
use nodelocaldns_ha::dataplane::{nftables::Nftables, Dataplane, Layered};
use nodelocaldns_ha::detect::{self, Backend};
use nodelocaldns_ha::overrides::{self, Override};
use nodelocaldns_ha::probe::{Probe, Transport};
use nodelocaldns_ha::ruleset::Route;
use nodelocaldns_ha::ruleset::{ListenAddrs, RuleSet, DNS_PORT};
use nodelocaldns_ha::state;
use nodelocaldns_ha::{agent, daemon};

/// A failure and the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn usage(error: impl std::fmt::Display) -> Failure {
        Failure { code: 2, message: error.to_string() }
    }

    fn runtime(error: impl std::fmt::Display) -> Failure {
        Failure { code: 1, message: error.to_string() }
    }
}

/// `error: cause: cause's cause`, so the root of a failure reaches the user.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text = format!("{text}: {line}");
        }
        source = cause.source();
    }
    text
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line, like every other refusal; `--help` has the rest.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            let first = first.trim_start_matches("error: ");
            eprintln!("nodelocaldns-ha: {first}{} (see --help)", env_sources(first));
            return ExitCode::from(2);
        }
    };
    let filter = match EnvFilter::try_new(&cli.log) {
        Ok(f) => f,
        Err(e) => {
            let message = format!("--log {:?} is not a valid filter: {e}", cli.log);
            eprintln!("nodelocaldns-ha: {message}{}", env_sources(&message));
            return ExitCode::from(2);
        }
    };
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => {
            logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init()
        }
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            let sources = if f.code == 2 { env_sources(&f.message) } else { String::new() };
            eprintln!("nodelocaldns-ha: {}{sources}", f.message);
            ExitCode::from(f.code)
        }
    }
}

/// The environment variables behind the flags a refusal names (see [`cli::env_sources`]).
fn env_sources(message: &str) -> String {
    let args: Vec<String> =
        std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    cli::env_sources(message, &args, |name| std::env::var(name).ok())
}

fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Run(args) => {
            let mut cfg = AgentConfig::from_args(&args.raw(), |k| std::env::var(k).ok())
                .map_err(Failure::usage)?;
            let xtables_wait = config::duration_flag("--xtables-wait", &args.xtables_wait)
                .map_err(Failure::usage)?;
            require_net_admin()?;
            let v6 = cfg.addrs.local.iter().chain(&cfg.addrs.cluster_dns).find(|ip| ip.is_ipv6());
            if let (Some(ip), false) = (v6, detect::kernel_has_ipv6()) {
                return Err(Failure::usage(format!(
                    "{ip} is an IPv6 address, but this kernel has no IPv6 (booted with \
                     ipv6.disable=1?): give --local-ip and --cluster-dns-ip IPv4 addresses only"
                )));
            }
            if args.dataplane == DataplaneKind::IptablesLegacy {
                require_net_raw_for_legacy()?;
            }
            let (dataplane, notes) = open_dataplane(args.dataplane, &cfg.addrs, xtables_wait)?;
            cfg.shape.accepts = dataplane.has_accepts();
            let leftovers = leftovers(&dataplane, &cfg.addrs, xtables_wait);
            let dataplane = Box::new(dataplane);
            runtime()?.block_on(async {
                daemon::run(cfg, dataplane, notes, leftovers, shutdown_signal())
                    .await
                    .map_err(|e| Failure::runtime(with_causes(&e)))
            })
        }
        Command::Status(args) => status(&args),
        Command::Flip(args) => flip(&args),
        Command::Release(args) => {
            let answer = control::call(&args.state_dir, &Request::Release, CALL_TIMEOUT);
            match answer {
                Err(ControlError::NoAgent { .. }) if !agent_running(&args.state_dir)? => {
                    overrides::clear(&args.state_dir).map_err(Failure::runtime)?;
                    println!("no agent is running; removed the recorded override, if any");
                    Ok(())
                }
                Err(ControlError::NoAgent { .. }) => Err(not_answering(&args.state_dir)),
                other => answered(other),
            }
        }
        Command::Drain(args) => {
            let timeout =
                config::duration_flag("--timeout", &args.timeout).map_err(Failure::usage)?;
            let request = Request::Drain { timeout_ms: millis("--timeout", timeout)? };
            // The agent answers within timeout + 5 s; wait a little longer than that.
            let wait = timeout.saturating_add(CALL_TIMEOUT + Duration::from_secs(2));
            let dir = &args.control.state_dir;
            match control::call(dir, &request, wait) {
                // Without an agent the kernel fast path alone fails pods over when the cache
                // stops: nothing to wait for, and a preStop hook must not fail for it.
                Err(ControlError::NoAgent { .. }) if !agent_running(dir)? => {
                    println!("no agent is running: nothing to drain");
                    Ok(())
                }
                Err(ControlError::NoAgent { .. }) => Err(not_answering(dir)),
                other => answered(other),
            }
        }
        Command::Rules(args) => {
            let addrs = listen_addrs(&args.listen)?;
            print!("{}", RuleSet::desired(&addrs, args.route.into()));
            Ok(())
        }
        Command::Probe(args) => probe(&args),
        Command::Teardown(args) => {
            let xtables_wait = config::duration_flag("--xtables-wait", &args.xtables_wait)
                .map_err(Failure::usage)?;
            require_net_admin()?;
            if agent_running(&args.state_dir)? {
                return Err(Failure::runtime(format!(
                    "an agent is running with --state-dir {} and would put its rules back: stop \
                     it first (e.g. delete its DaemonSet), then tear down",
                    args.state_dir.display()
                )));
            }
            // Whatever backend an agent used, with whatever flags: everything goes.
            let mut dataplane = every_dataplane(xtables_wait)?;
            dataplane.remove().map_err(|e| Failure::runtime(with_causes(&e)))?;
            state::remove(&args.state_dir).map_err(|e| {
                Failure::runtime(format!(
                    "removing the state file in {}: {e}",
                    args.state_dir.display()
                ))
            })?;
            println!("removed everything nodelocaldns-ha installed (nftables and iptables)");
            Ok(())
        }
    }
}

/// How long the CLI waits for the agent's answer (a drain adds its own timeout).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A duration as whole milliseconds for the control protocol; bad input if it does not fit.
fn millis(flag: &str, d: Duration) -> Result<u64, Failure> {
    u64::try_from(d.as_millis()).map_err(|_| Failure::usage(format!("{flag} is too long")))
}

/// Whether an agent runs with the state directory `dir`; a failure when that cannot be told (the
/// lock file cannot be opened or locked), never "no agent".
fn agent_running(dir: &std::path::Path) -> Result<bool, Failure> {
    state::agent_running(dir).map_err(|e| {
        Failure::runtime(format!(
            "cannot tell whether an agent is running with --state-dir {}: {}; nothing was changed",
            dir.display(),
            with_causes(&e)
        ))
    })
}

/// An agent holds the lock in `dir` but nothing answers on its control socket.
fn not_answering(dir: &std::path::Path) -> Failure {
    Failure::runtime(format!(
        "an agent is running with --state-dir {} (it holds {}) but does not answer on {}: check \
         its log, or restart it; nothing was changed",
        dir.display(),
        state::LOCK_FILE,
        control::socket_path(dir).display()
    ))
}

/// Prints the agent's answer; an error answer is a runtime failure. (`NoAgent` while the
/// agent's lock is held means its socket is broken, not that it is gone: callers check.)
fn answered(answer: Result<Response, ControlError>) -> Result<(), Failure> {
    match answer.map_err(|e| Failure::runtime(with_causes(&e)))? {
        Response::Ok { message } => {
            println!("{message}");
            Ok(())
        }
        Response::Error { message } => Err(Failure::runtime(message)),
    }
}

fn flip(args: &FlipArgs) -> Result<(), Failure> {
    let route: Route = args.route.into();
    let for_ = args.for_.as_deref().map(|d| config::duration_flag("--for", d)).transpose();
    let for_ = for_.map_err(Failure::usage)?;
    if for_.is_some_and(|d| d.is_zero()) {
        let value = args.for_.clone().unwrap_or_default();
        return Err(Failure::usage(config::ConfigError::ZeroDuration { flag: "--for", value }));
    }
    let for_ms = for_.map(|d| millis("--for", d)).transpose()?;
    let until_unix_ms = match for_ms {
        Some(ms) => Some(
            state::unix_ms(SystemTime::now())
                .checked_add(ms)
                .ok_or_else(|| Failure::usage("--for is too long"))?,
        ),
        None => None,
    };
    let request = Request::Flip { route, for_ms, reason: args.reason.clone() };
    let dir = &args.control.state_dir;
    match control::call(dir, &request, CALL_TIMEOUT) {
        Err(ControlError::NoAgent { .. }) if !agent_running(dir)? => {}
        Err(ControlError::NoAgent { .. }) => return Err(not_answering(dir)),
        other => return answered(other),
    }
    // No agent: install the route's rules here, and record the override for the next agent.
    if args.local_ip.is_empty() || args.cluster_dns_ip.is_empty() {
        return Err(Failure::runtime(
            "no agent is running: give --local-ip and --cluster-dns-ip to install the rules directly",
        ));
    }
    let addrs = listen_addrs(&ListenArgs {
        local_ip: args.local_ip.clone(),
        cluster_dns_ip: args.cluster_dns_ip.clone(),
    })?;
    require_net_admin()?;
    // The agent's lock, held until the rules and the record are both in place: an agent that
    // started in between would read no override, put its own route back as "changed by someone
    // else" and remove the record as not its own, after this command reported success. An agent
    // starting meanwhile waits for the lock (and gives up, to be restarted, if this takes long).
    std::fs::create_dir_all(dir).map_err(|e| {
        Failure::runtime(format!("cannot create the state directory {}: {e}", dir.display()))
    })?;
    let _lock = match state::Lock::acquire_for(dir, "nodelocaldns-ha flip (no agent running)") {
        Ok(lock) => lock,
        Err(state::LockError::Held(..)) => return Err(not_answering(dir)),
        Err(e) => return Err(Failure::runtime(with_causes(&e))),
    };
    let (kind, chosen) = recorded_dataplane(dir)?;
    if kind == DataplaneKind::IptablesLegacy {
        require_net_raw_for_legacy()?;
    }
    let (mut dataplane, _) = open_dataplane(kind, &addrs, Duration::from_secs(5))?;
    let shape = dataplane::Shape { accepts: dataplane.has_accepts(), fast_path: true };
    let rules = dataplane::plan(&addrs, route, shape);
    dataplane.apply(&rules).map_err(|e| Failure::runtime(with_causes(&e)))?;
    let record = Override::manual(
        route,
        until_unix_ms,
        args.reason.clone(),
        "nodelocaldns-ha flip (no agent running)".to_owned(),
        state::unix_ms(SystemTime::now()),
    );
    overrides::write(dir, &record).map_err(|e| {
        Failure::runtime(format!(
            "the {route} ruleset is installed, but recording the override in {} failed: {e}; a \
             starting agent will decide the route by itself",
            dir.display()
        ))
    })?;
    println!(
        "no agent is running: installed the {route} ruleset directly ({}, {chosen}) and recorded \
         the override in {} for the next agent",
        dataplane.name(),
        dir.display()
    );
    Ok(())
}

/// The backend for a `flip` without an agent: the one the last agent recorded in its state file
/// (where its rules are), else `auto` when no agent has recorded one; with the reason, for the
/// user. A record that cannot be read or names no backend is a failure: guessing could put the
/// rules where the agent's are not, and leave pods pinned to the cache.
fn recorded_dataplane(dir: &std::path::Path) -> Result<(DataplaneKind, String), Failure> {
    use clap::ValueEnum;
    let st = match state::read(dir) {
        Ok(st) => st,
        Err(state::ReadError::Missing(_)) => {
            let why = format!(
                "chosen by --dataplane auto: no agent has recorded a backend in {}",
                state::path(dir).display()
            );
            return Ok((DataplaneKind::Auto, why));
        }
        Err(e) => {
            return Err(Failure::runtime(format!(
                "{}: it says which backend the last agent used; remove it to let --dataplane auto \
                 choose, or start the agent; nothing was changed",
                with_causes(&e)
            )))
        }
    };
    match DataplaneKind::from_str(&st.dataplane, false) {
        Ok(kind) if kind != DataplaneKind::Auto => {
            let why =
                format!("the backend the last agent recorded in {}", state::path(dir).display());
            Ok((kind, why))
        }
        _ => Err(Failure::runtime(format!(
            "{} names the backend {:?}, which this version does not know: remove the file to let \
             --dataplane auto choose, or start the agent; nothing was changed",
            state::path(dir).display(),
            st.dataplane
        ))),
    }
}

fn listen_addrs(args: &ListenArgs) -> Result<ListenAddrs, Failure> {
    config::listen_addrs(&args.local_ip, &args.cluster_dns_ip).map_err(Failure::usage)
}

fn nftables() -> Result<Nftables, Failure> {
    Nftables::new().map_err(|e| Failure::runtime(with_causes(&e)))
}

fn iptables(flavour: Flavour, table: Table, wait: Duration) -> Result<Box<dyn Dataplane>, Failure> {
    let backend = Iptables::new(flavour, table, wait);
    Ok(Box::new(backend.map_err(|e| Failure::runtime(with_causes(&e)))?))
}

/// The switching backend `kind` names (or detection picks), plus iptables filter backends for
/// the ACCEPTs in every iptables flavour the node uses.
fn open_dataplane(
    kind: DataplaneKind,
    addrs: &ListenAddrs,
    wait: Duration,
) -> Result<(Layered, agent::Notes), Failure> {
    let mut nft = nftables()?;
    let kube_proxy_nftables = nft.kube_proxy_tables().unwrap_or(false);
    let listen: Vec<_> = addrs.local.iter().chain(&addrs.cluster_dns).copied().collect();
    let found = detect::decide(&detect::gather(kube_proxy_nftables, &listen));
    if kind == DataplaneKind::Auto {
        if let Some(refusal) = detect::ipvs_refusal(&found, &addrs.cluster_dns) {
            return Err(Failure::usage(refusal));
        }
    }
    let (backend, why) = match kind {
        DataplaneKind::Auto => (found.backend, Some(found.why)),
        DataplaneKind::Nftables => (Backend::Nftables, None),
        DataplaneKind::IptablesLegacy => (Backend::Iptables(Flavour::Legacy), None),
        DataplaneKind::IptablesNft => (Backend::Iptables(Flavour::Nft), None),
    };
    let switch: Box<dyn Dataplane> = match backend {
        Backend::Nftables => Box::new(nft),
        Backend::Iptables(flavour) => iptables(flavour, Table::Raw, wait)?,
    };
    let accepts = found
        .accepts_in
        .iter()
        .map(|&flavour| iptables(flavour, Table::Filter, wait))
        .collect::<Result<Vec<_>, _>>()?;
    let accepts_in = found.accepts_in.iter().map(ToString::to_string).collect();
    Ok((Layered::new(switch, accepts), agent::Notes { why, accepts_in }))
}

/// The backends (and iptables tables) that `in_use` does not use but that hold rules of the
/// agent's: an earlier agent ran with another `--dataplane`, or `auto` chose another backend
/// before kube-proxy changed modes. The agent empties them once its own ruleset is in, the way
/// kube-proxy cleans up its other modes when it starts. One that cannot be read (iptables-legacy
/// without CAP_NET_RAW) is said and skipped.
fn leftovers(in_use: &Layered, addrs: &ListenAddrs, wait: Duration) -> Vec<Box<dyn Dataplane>> {
    let used: Vec<&str> = std::iter::once(in_use.name()).chain(in_use.accept_names()).collect();
    let mut candidates = iptables_parts(wait);
    if let Ok(nft) = Nftables::new() {
        candidates.insert(0, Box::new(nft));
    }
    // Compared with the fullest ruleset: anything of the agent's there is not `Missing`.
    let rules =
        dataplane::plan(addrs, Route::Local, dataplane::Shape { accepts: true, fast_path: true });
    candidates
        .into_iter()
        .filter(|part| !used.contains(&part.name()))
        .filter_map(|mut part| match part.check(&rules) {
            Ok(dataplane::Check::Missing) => None,
            Ok(_) => Some(part),
            Err(e) => {
                tracing::warn!(backend = part.name(), error = %with_causes(&e), "cannot look for an earlier agent's rules there");
                None
            }
        })
        .collect()
}

/// Every backend the agent could have used, to remove all of it. Where iptables-legacy is
/// installed, that needs CAP_NET_RAW: checked before anything is removed, so a teardown never
/// stops half-way for a missing privilege.
fn every_dataplane(wait: Duration) -> Result<Layered, Failure> {
    if Iptables::new(Flavour::Legacy, Table::Raw, wait).is_ok() {
        require_capability(
            13,
            "CAP_NET_RAW",
            "iptables-legacy is installed, and reading or changing its tables needs a raw \
             socket; add NET_RAW",
        )?;
    }
    Ok(Layered::new(Box::new(nftables()?), iptables_parts(wait)))
}

/// Every iptables table the agent may have written (raw and filter of both flavours) whose
/// flavour is installed: a node without a flavour's binaries has nothing of ours in it.
fn iptables_parts(wait: Duration) -> Vec<Box<dyn Dataplane>> {
    let mut parts: Vec<Box<dyn Dataplane>> = Vec::new();
    for flavour in Flavour::ALL {
        for table in [Table::Raw, Table::Filter] {
            if let Ok(backend) = Iptables::new(flavour, table, wait) {
                parts.push(Box::new(backend));
            }
        }
    }
    parts
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the async runtime: {e}")))
}

/// CAP_NET_ADMIN, checked up front so a missing privilege is one clear line, not a netlink error.
fn require_net_admin() -> Result<(), Failure> {
    require_capability(12, "CAP_NET_ADMIN", "run as root or add NET_ADMIN")
}

/// CAP_NET_RAW, which iptables-legacy needs besides CAP_NET_ADMIN: libiptc talks to the kernel
/// through a raw socket ("Permission denied (you must be root)" without it).
fn require_net_raw_for_legacy() -> Result<(), Failure> {
    require_capability(
        13,
        "CAP_NET_RAW",
        "--dataplane iptables-legacy reads and writes its tables through a raw socket; add NET_RAW",
    )
}

/// Fails with one line naming capability `name` (bit `bit`) unless this process has it in
/// its effective set; `what_to_do` completes the line.
fn require_capability(bit: u32, name: &str, what_to_do: &str) -> Result<(), Failure> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| Failure::runtime(format!("cannot read /proc/self/status: {e}")))?;
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    if effective & (1 << bit) == 0 {
        return Err(Failure::usage(format!(
            "missing capability {name}: {what_to_do} to the container's \
             securityContext.capabilities"
        )));
    }
    Ok(())
}

/// Completes on SIGTERM or SIGINT. The handlers are installed by this call, not when the future
/// is first polled, so a SIGTERM that comes while the agent is still starting is a clean stop,
/// not the default disposition's sudden death. Call it within the runtime.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            tracing::error!("cannot install signal handlers; stop the agent with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    }
}

fn parse_server(text: &str) -> Option<SocketAddr> {
    text.parse::<SocketAddr>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, DNS_PORT)))
}

fn probe(args: &ProbeArgs) -> Result<(), Failure> {
    let server = parse_server(&args.server).ok_or_else(|| {
        Failure::usage(format!(
            "--server {:?} is not an IP address or IP:port (IPv6 with a port: [fd00::a]:53)",
            args.server
        ))
    })?;
    let timeout = config::duration_flag("--timeout", &args.timeout).map_err(Failure::usage)?;
    if timeout.is_zero() {
        let value = args.timeout.clone();
        return Err(Failure::usage(config::ConfigError::ZeroDuration { flag: "--timeout", value }));
    }
    let probe = Probe::new(&args.probe_name, timeout).map_err(Failure::usage)?;
    let transport = if args.tcp { Transport::Tcp } else { Transport::Udp };
    let result = runtime()?.block_on(probe.run(server, transport));
    let ms = result.latency.as_secs_f64() * 1e3;
    let detail = match &result.outcome {
        nodelocaldns_ha::probe::Outcome::Answered { rcode }
        | nodelocaldns_ha::probe::Outcome::ServerFailure { rcode } => {
            format!(" ({})", nodelocaldns_ha::probe::rcode_name(*rcode))
        }
        nodelocaldns_ha::probe::Outcome::Error { reason } => format!(" ({reason})"),
        _ => String::new(),
    };
    println!("{server} {transport}: {}{detail} in {ms:.3} ms", result.outcome.label());
    if result.outcome.is_good() {
        Ok(())
    } else {
        Err(Failure::runtime(format!("probe of {server} failed: {}", result.outcome.label())))
    }
}

fn ago(then_ms: u64, now: SystemTime) -> String {
    let secs = state::unix_ms(now).saturating_sub(then_ms) as f64 / 1e3;
    format!("{secs:.1}s ago")
}

fn status(args: &StatusArgs) -> Result<(), Failure> {
    let st = state::read(&args.state_dir).map_err(|e| Failure::runtime(with_causes(&e)))?;
    let now = SystemTime::now();
    let alive = state::agent_running(&args.state_dir);
    let stale = st.is_stale(now);
    if args.json {
        let mut value = serde_json::to_value(&st).map_err(Failure::runtime)?;
        // `null` when it cannot be told (the lock file cannot be opened).
        value["agent_running"] = match &alive {
            Ok(alive) => serde_json::Value::Bool(*alive && !stale),
            Err(_) => serde_json::Value::Null,
        };
        value["override"] = match overrides::read(&args.state_dir) {
            Ok(o) => serde_json::to_value(o).map_err(Failure::runtime)?,
            Err(e) => serde_json::Value::String(e.to_string()),
        };
        println!("{value}");
        return Ok(());
    }
    let running = match (alive, stale) {
        (Ok(true), false) => format!("running (pid {})", st.pid),
        (Ok(true), true) => {
            format!("running but not updating its state ({})", ago(st.updated_unix_ms, now))
        }
        (Ok(false), _) => "not running (its last ruleset stays installed)".to_owned(),
        (Err(e), _) => format!("cannot tell whether it runs: {}", with_causes(&e)),
    };
    println!("agent:       {running}");
    println!("route:       {} since {} ({})", st.route, ago(st.since_unix_ms, now), st.reason);
    match overrides::read(&args.state_dir) {
        Ok(Some(o)) => {
            let until = o.until_unix_ms.map_or("until released".to_owned(), |ms| {
                format!("for {:.0}s more", ms.saturating_sub(state::unix_ms(now)) as f64 / 1e3)
            });
            let why = if o.reason.is_empty() { String::new() } else { format!(": {}", o.reason) };
            println!("override:    {} ({:?}, {until}) set by {}{why}", o.route, o.kind, o.set_by);
        }
        Ok(None) => {}
        Err(e) => println!("override:    unreadable: {e}"),
    }
    if let Some(held) = &st.held {
        println!("held:        {held}");
    }
    println!(
        "dataplane:   {} ({} route changes, {} repairs of foreign changes)",
        st.dataplane, st.transitions, st.repairs
    );
    if let Some(why) = &st.dataplane_why {
        println!("             chosen because {why}");
    }
    if !st.accepts_in.is_empty() {
        println!("accepts:     in {} (the iptables the node uses)", st.accepts_in.join(", "));
    }
    for leftover in &st.leftovers {
        println!("leftover:    {leftover} (an earlier agent's rules in a backend not in use)");
    }
    if let Some(err) = &st.last_error {
        println!("last error:  {err}");
    }
    for warning in &st.warnings {
        println!("WARNING:     {warning}");
    }
    let line = |name: &str, p: &state::ProbeStats| {
        println!(
            "{name:<12} {} sent {} good {} bad {} last {} ({}) streak +{}/-{}",
            p.target,
            p.sent,
            p.good,
            p.bad,
            p.last.as_deref().unwrap_or("-"),
            p.last_latency_ms.map_or("-".to_owned(), |ms| format!("{ms:.2} ms")),
            p.streak_good,
            p.streak_bad
        )
    };
    line("cache udp:", &st.probes.cache_udp);
    if let Some(tcp) = &st.probes.cache_tcp {
        line("cache tcp:", tcp);
    }
    line("upstream:", &st.probes.upstream);
    Ok(())
}
