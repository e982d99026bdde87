//! The commands that talk to the running agent over its control socket, or act for it when none
//! runs: `flip` (and what `release` and `drain` share with it).

use std::time::{Duration, SystemTime};

use nodelocaldns_ha::cli::{DataplaneKind, FlipArgs, ListenArgs};
use nodelocaldns_ha::config;
use nodelocaldns_ha::control::{self, ControlError, Request, Response};
use nodelocaldns_ha::dataplane;
use nodelocaldns_ha::dataplane::Dataplane;
use nodelocaldns_ha::overrides::{self, Override};
use nodelocaldns_ha::ruleset::Route;
use nodelocaldns_ha::state;

use crate::backends::{
    listen_addrs, open_dataplane, require_net_admin, require_net_raw_for_legacy,
};
use crate::{millis, with_causes, Failure, CALL_TIMEOUT};

/// Whether an agent runs with the state directory `dir`; a failure when that cannot be told (the
/// lock file cannot be opened or locked), never "no agent".
pub(crate) fn agent_running(dir: &std::path::Path) -> Result<bool, Failure> {
    state::agent_running(dir).map_err(|e| {
        Failure::runtime(format!(
            "cannot tell whether an agent is running with --state-dir {}: {}; nothing was changed",
            dir.display(),
            with_causes(&e)
        ))
    })
}

/// An agent holds the lock in `dir` but nothing answers on its control socket.
pub(crate) fn not_answering(dir: &std::path::Path) -> Failure {
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
pub(crate) fn answered(answer: Result<Response, ControlError>) -> Result<(), Failure> {
    match answer.map_err(|e| Failure::runtime(with_causes(&e)))? {
        Response::Ok { message } => {
            println!("{message}");
            Ok(())
        }
        Response::Error { message } => Err(Failure::runtime(message)),
    }
}

pub(crate) fn flip(args: &FlipArgs) -> Result<(), Failure> {
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
            "no agent is running: give --local-ip and --cluster-dns-ip to install the rules directly \
             (in the link-local shape, without --cluster-dns-ip, only the agent can fail over: \
             start it)",
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
    // No forwarder without the agent: no fallback chain either (the agent puts it back).
    let shape =
        dataplane::Shape { accepts: dataplane.has_accepts(), fast_path: true, link_local: false };
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
pub(crate) fn recorded_dataplane(
    dir: &std::path::Path,
) -> Result<(DataplaneKind, String), Failure> {
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
