//! `nodelocaldns-ha`: parse the command line, run one command, map errors to exit codes.
//!
//! Exit codes: 0 success; 1 a runtime failure (netlink, I/O); 2 bad input or a missing
//! privilege, reported before anything on the host changed.
//!
//! The commands that talk to a running agent (or act for it when none runs) are in `to_agent`;
//! opening the node's netfilter backends and checking privileges in `backends`; `probe` and
//! `status` in `inspect`.

#![forbid(unsafe_code)]

mod backends;
mod inspect;
mod to_agent;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use nodelocaldns_ha::addresses;
use nodelocaldns_ha::cli::{self, Cli, Command, DataplaneKind, LogFormat};
use nodelocaldns_ha::config::{self, AgentConfig};
use nodelocaldns_ha::control::{self, ControlError, Request};
use nodelocaldns_ha::daemon;
use nodelocaldns_ha::dataplane::iptables::kernel_has_ipv6;
use nodelocaldns_ha::dataplane::Dataplane;
use nodelocaldns_ha::malloc;
use nodelocaldns_ha::overrides;
use nodelocaldns_ha::ruleset::{ListenAddrs, RuleSet, DNS_PORT};
use nodelocaldns_ha::{detect, sockdiag, state};

use crate::backends::{
    every_dataplane, leftovers, listen_addrs, open_dataplane, require_net_admin,
    require_net_raw_for_legacy,
};
use crate::inspect::{probe, status};
use crate::to_agent::{agent_running, answered, flip, not_answering};

/// A failure and the exit code it maps to.
pub(crate) struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    pub(crate) fn usage(error: impl std::fmt::Display) -> Failure {
        Failure { code: 2, message: error.to_string() }
    }

    pub(crate) fn runtime(error: impl std::fmt::Display) -> Failure {
        Failure { code: 1, message: error.to_string() }
    }
}

/// `error: cause: cause's cause`, so the root of a failure reaches the user.
pub(crate) fn with_causes(error: &dyn std::error::Error) -> String {
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
    // Before any thread starts.
    malloc::one_arena();
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

/// Lifts the soft limit on open files to the hard one, as Go's runtime does for itself: a
/// process often starts with a soft limit of 1,024, and the forwarders at their bounds hold two
/// sockets for each connection they relay (256 a family), beside the agent's own. Where the
/// hard limit is lower, it stays what it is.
fn raise_open_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
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
            raise_open_files();
            let v6 = cfg.addrs.local.iter().chain(&cfg.addrs.cluster_dns).find(|ip| ip.is_ipv6());
            if let (Some(ip), false) = (v6, kernel_has_ipv6()) {
                return Err(Failure::usage(format!(
                    "{ip} is an IPv6 address, but this kernel has no IPv6 (booted with \
                     ipv6.disable=1?): give --local-ip and --cluster-dns-ip IPv4 addresses only"
                )));
            }
            if args.dataplane == DataplaneKind::IptablesLegacy {
                require_net_raw_for_legacy()?;
            }
            refuse_a_wildcard_cache(&cfg.addrs)?;
            let (dataplane, notes) = open_dataplane(args.dataplane, &cfg.addrs, xtables_wait)?;
            cfg.shape.accepts = dataplane.has_accepts();
            let leftovers = leftovers(&dataplane, &cfg.addrs, xtables_wait);
            let dataplane = Box::new(dataplane);
            // The loop runs as a task on the workers, beside the probes and watches, not on
            // this thread: each report would otherwise wake one more thread.
            runtime()?.block_on(async {
                tokio::spawn(async {
                    let mut every = tokio::time::interval(malloc::TRIM_EVERY);
                    loop {
                        every.tick().await;
                        malloc::trim();
                    }
                });
                let shutdown = shutdown_signal();
                let state_dir = cfg.state_dir.clone();
                let agent = daemon::run(cfg, dataplane, notes, leftovers, shutdown);
                let removal = match tokio::spawn(agent).await {
                    Ok(outcome) => outcome.map_err(|e| Failure::runtime(with_causes(&e)))?,
                    Err(e) => {
                        return Err(Failure::runtime(format!("the agent's loop panicked: {e}")))
                    }
                };
                match removal {
                    Some(removal) => leave_the_node(&removal, &state_dir, xtables_wait).await,
                    None => Ok(()),
                }
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
        Command::Uninstall(args) => uninstall(&args),
        Command::Rules(args) => {
            let addrs = listen_addrs(&args.listen)?;
            let mut rules = RuleSet::desired(&addrs, args.route.into());
            if !args.link_local_failover {
                rules.chains.retain(|chain| !chain.is_fallback());
            }
            print!("{rules}");
            Ok(())
        }
        Command::Probe(args) => probe(&args),
        Command::Teardown(args) => {
            let xtables_wait = config::duration_flag("--xtables-wait", &args.xtables_wait)
                .map_err(Failure::usage)?;
            require_net_admin()?;
            for line in teardown(&args.state_dir, xtables_wait)? {
                println!("{line}");
            }
            Ok(())
        }
    }
}

/// Removes everything an agent installed on the node, as `teardown` does: the rules of every
/// backend, the copies of the link-local IPs on lo, the state file; what it did, line by line.
/// Refused while an agent runs with `state_dir` (it would put its rules back).
fn teardown(state_dir: &std::path::Path, xtables_wait: Duration) -> Result<Vec<String>, Failure> {
    if agent_running(state_dir)? {
        return Err(Failure::runtime(format!(
            "an agent is running with --state-dir {} and would put its rules back: stop it first \
             (e.g. delete its DaemonSet), then tear down",
            state_dir.display()
        )));
    }
    // Whatever backend an agent used, with whatever flags: everything goes.
    let mut dataplane = every_dataplane(xtables_wait)?;
    dataplane.remove().map_err(|e| Failure::runtime(with_causes(&e)))?;
    // The agent's copies of the link-local IPs on lo (known by their address protocol; on a
    // kernel before 5.18, by their label, IPv4 only: see `addresses`).
    let removed = addresses::remove_ours(&[]).map_err(|e| Failure::runtime(with_causes(&e)))?;
    let mut said: Vec<_> =
        removed.iter().map(|ip| format!("removed the agent's copy of {ip} on lo")).collect();
    state::remove(state_dir).map_err(|e| {
        Failure::runtime(format!("removing the state file in {}: {e}", state_dir.display()))
    })?;
    said.push("removed everything nodelocaldns-ha installed (nftables and iptables)".into());
    Ok(said)
}

/// `uninstall`: the agents' DaemonSet deleted (foreground) and waited for, so that each agent
/// puts its node back at its SIGTERM ([`nodelocaldns_ha::cluster::removal`]).
fn uninstall(args: &cli::UninstallArgs) -> Result<(), Failure> {
    use nodelocaldns_ha::cluster::{self, Uninstalled};
    let timeout = config::duration_flag("--timeout", &args.timeout).map_err(Failure::usage)?;
    runtime()?.block_on(async {
        let client = cluster::client_of(args.kubeconfig.as_ref())
            .await
            .map_err(|e| Failure::runtime(with_causes(&e)))?;
        let ds = format!("DaemonSet {}/{}", client.default_namespace(), args.daemonset);
        println!("deleting {ds} (foreground): each agent puts its node back at its SIGTERM");
        let ended = cluster::uninstall(client, &args.daemonset, timeout)
            .await
            .map_err(|e| Failure::runtime(format!("deleting {ds}: {}", with_causes(&e))))?;
        match ended {
            Uninstalled::NotThere => println!("{ds} is not there: nothing to remove"),
            Uninstalled::Gone => println!("{ds} and its pods are gone"),
            Uninstalled::StillThere => println!(
                "{ds} is still being deleted after {timeout:?}: an agent on a node that is down \
                 (or that did not stop) keeps its rules there; `nodelocaldns-ha teardown` on \
                 that node removes them"
            ),
        }
        Ok(())
    })
}

/// The agent's last act when it is being removed (its DaemonSet gone or being deleted): the
/// same teardown as the `teardown` command, then its condition and startup taint off its Node.
/// Each step says what it did; a Node the API server does not let it clean is said, and the
/// agent still exits 0 (its rules, what matters to pods, are gone).
async fn leave_the_node(
    removal: &nodelocaldns_ha::cluster::Removal,
    state_dir: &std::path::Path,
    xtables_wait: Duration,
) -> Result<(), Failure> {
    // Blocking, and nothing else runs any more.
    for line in teardown(state_dir, xtables_wait)? {
        tracing::warn!("{line}");
    }
    match removal.clean_node().await {
        Ok(said) => {
            for line in said {
                tracing::warn!("{line}");
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot take the agent's condition and startup taint off its Node; remove them by hand (kubectl edit node --subresource status; kubectl taint node)")
        }
    }
    tracing::warn!("the agent is removed from this node: nothing of it is left in its netfilter");
    Ok(())
}

/// Refuses a node where a socket listens on port 53 of the wildcard address (node-cache bound
/// to 0.0.0.0: [`detect::wildcard_refusal`]), before anything is changed. The sockets cannot
/// be listed (no sock_diag): said, and the agent starts.
fn refuse_a_wildcard_cache(addrs: &ListenAddrs) -> Result<(), Failure> {
    let listen: Vec<_> = addrs.local.iter().chain(&addrs.cluster_dns).copied().collect();
    match sockdiag::listeners(&listen, DNS_PORT) {
        Ok(listening) => match detect::wildcard_refusal(&listening) {
            Some(refusal) => Err(Failure::usage(refusal)),
            None => Ok(()),
        },
        Err(e) => {
            tracing::warn!(error = %with_causes(&e), "cannot list the sockets on port 53; a cache bound to the wildcard address would go unnoticed");
            Ok(())
        }
    }
}

/// How long the CLI waits for the agent's answer (a drain adds its own timeout).
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A duration as whole milliseconds for the control protocol; bad input if it does not fit.
pub(crate) fn millis(flag: &str, d: Duration) -> Result<u64, Failure> {
    u64::try_from(d.as_millis()).map_err(|_| Failure::usage(format!("{flag} is too long")))
}

/// One worker: the agent's tasks wait nearly all the time, and a second worker is woken, at a
/// cost, to share what one does at each tick. Multi-threaded all the same, for
/// `block_in_place`: a blocking apply hands the worker over, so the probes go on. The
/// link-local forwarders run on a runtime of their own.
fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the async runtime: {e}")))
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
