//! The commands that only look: one `probe`, and `status` of the agent from its state file.

use std::net::{IpAddr, SocketAddr};
use std::time::SystemTime;

use nodelocaldns_ha::cli::{ProbeArgs, StatusArgs};
use nodelocaldns_ha::config;
use nodelocaldns_ha::overrides::{self};
use nodelocaldns_ha::probe::{Probe, Transport};
use nodelocaldns_ha::ruleset::DNS_PORT;
use nodelocaldns_ha::state;

use crate::{runtime, with_causes, Failure};

pub(crate) fn parse_server(text: &str) -> Option<SocketAddr> {
    text.parse::<SocketAddr>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, DNS_PORT)))
}

pub(crate) fn probe(args: &ProbeArgs) -> Result<(), Failure> {
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

pub(crate) fn ago(then_ms: u64, now: SystemTime) -> String {
    let secs = state::unix_ms(now).saturating_sub(then_ms) as f64 / 1e3;
    format!("{secs:.1}s ago")
}

pub(crate) fn status(args: &StatusArgs) -> Result<(), Failure> {
    let st = state::read(&args.state_dir).map_err(|e| Failure::runtime(with_causes(&e)))?;
    let now = SystemTime::now();
    let alive = state::agent_running(&args.state_dir);
    let stale = st.is_stale(now);
    // What `--check` asks, decided before `alive` is spent on the printing.
    let not_ready = match (&alive, stale) {
        (Ok(true), false) if st.ruleset_in => None,
        (Ok(true), false) => Some(format!(
            "the agent's ruleset is not in: {}",
            st.last_error.as_deref().unwrap_or("its last apply failed")
        )),
        (Ok(true), true) => {
            Some(format!("the agent is not updating its state ({})", ago(st.updated_unix_ms, now)))
        }
        (Ok(false), _) => Some(format!(
            "no agent is running with --state-dir {} (its last state is shown)",
            args.state_dir.display()
        )),
        (Err(e), _) => Some(format!("cannot tell whether an agent runs: {}", with_causes(e))),
    };
    let checked = || match (&not_ready, args.check) {
        (Some(why), true) => Err(Failure::runtime(format!("status --check: {why}"))),
        _ => Ok(()),
    };
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
        return checked();
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
    if let Some(taint) = &st.startup_taint {
        match &taint.kept {
            Some(why) => println!("taint:       {} kept: {why}", taint.key),
            None => println!(
                "taint:       {} removed (or being removed) by the reports: {}",
                taint.key,
                taint.goes.as_deref().unwrap_or("it may go")
            ),
        }
    }
    if !st.shape.is_empty() {
        println!("shape:       {}", st.shape);
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
    if !st.upstream_from.is_empty() {
        println!("             from {}", st.upstream_from);
    }
    if let Some(f) = &st.forwarded {
        println!(
            "forwarder:   udp {} queries {} answered, tcp {} connections, {} upstream failures, \
             {} dropped (since the agent started)",
            f.udp_queries, f.udp_answers, f.tcp_connections, f.upstream_failures, f.dropped
        );
    }
    checked()
}
