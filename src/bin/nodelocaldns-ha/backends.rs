//! The node's netfilter backends as the commands open them (the one `--dataplane` names or
//! detection picks, the ACCEPTs' tables, an earlier agent's leftovers, everything for `teardown`),
//! and the privileges they need, checked up front.

use std::time::Duration;

use nodelocaldns_ha::agent;
use nodelocaldns_ha::cli::{DataplaneKind, ListenArgs};
use nodelocaldns_ha::config;
use nodelocaldns_ha::dataplane;
use nodelocaldns_ha::dataplane::iptables::{Flavour, Iptables, Role};
use nodelocaldns_ha::dataplane::{nftables::Nftables, Dataplane, Layered};
use nodelocaldns_ha::detect::{self, Backend};
use nodelocaldns_ha::ruleset::ListenAddrs;
use nodelocaldns_ha::ruleset::Route;

use crate::{with_causes, Failure};

pub(crate) fn listen_addrs(args: &ListenArgs) -> Result<ListenAddrs, Failure> {
    config::listen_addrs(&args.local_ip, &args.cluster_dns_ip).map_err(Failure::usage)
}

pub(crate) fn nftables() -> Result<Nftables, Failure> {
    Nftables::new().map_err(|e| Failure::runtime(with_causes(&e)))
}

pub(crate) fn iptables(
    flavour: Flavour,
    role: Role,
    wait: Duration,
) -> Result<Box<dyn Dataplane>, Failure> {
    let backend = Iptables::new(flavour, role, wait);
    Ok(Box::new(backend.map_err(|e| Failure::runtime(with_causes(&e)))?))
}

/// The switching backend `kind` names (or detection picks), plus iptables filter backends for
/// the ACCEPTs in every iptables flavour the node uses.
pub(crate) fn open_dataplane(
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
        Backend::Iptables(flavour) => iptables(flavour, Role::Switch, wait)?,
    };
    let accepts = found
        .accepts_in
        .iter()
        .map(|&flavour| iptables(flavour, Role::Accepts, wait))
        .collect::<Result<Vec<_>, _>>()?;
    let accepts_in = found.accepts_in.iter().map(ToString::to_string).collect();
    let notes = agent::Notes { why, accepts_in, link_local_off: None, startup_taint: None };
    Ok((Layered::new(switch, accepts), notes))
}

/// The backends (and iptables tables) that `in_use` does not use but that hold rules of the
/// agent's: an earlier agent ran with another `--dataplane`, or `auto` chose another backend
/// before kube-proxy changed modes. The agent empties them once its own ruleset is in, the way
/// kube-proxy cleans up its other modes when it starts. One that cannot be read (iptables-legacy
/// without CAP_NET_RAW) is said and skipped.
pub(crate) fn leftovers(
    in_use: &Layered,
    addrs: &ListenAddrs,
    wait: Duration,
) -> Vec<Box<dyn Dataplane>> {
    let used: Vec<&str> = std::iter::once(in_use.name()).chain(in_use.accept_names()).collect();
    let mut candidates = iptables_parts(wait);
    if let Ok(nft) = Nftables::new() {
        candidates.insert(0, Box::new(nft));
    }
    // Compared with the fullest ruleset: anything of the agent's there is not `Missing`.
    let rules = dataplane::plan(
        addrs,
        Route::Local,
        dataplane::Shape { accepts: true, ..dataplane::Shape::default() },
    );
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
pub(crate) fn every_dataplane(wait: Duration) -> Result<Layered, Failure> {
    if Iptables::new(Flavour::Legacy, Role::Switch, wait).is_ok() {
        require_capability(
            13,
            "CAP_NET_RAW",
            "iptables-legacy is installed, and reading or changing its tables needs a raw \
             socket; add NET_RAW",
        )?;
    }
    Ok(Layered::new(Box::new(nftables()?), iptables_parts(wait)))
}

/// Every iptables table the agent may have written (raw and mangle, which the switching backend
/// owns, and filter, of both flavours) whose flavour is installed: a node without a flavour's
/// binaries has nothing of ours in it.
pub(crate) fn iptables_parts(wait: Duration) -> Vec<Box<dyn Dataplane>> {
    let mut parts: Vec<Box<dyn Dataplane>> = Vec::new();
    for flavour in Flavour::ALL {
        for role in [Role::Switch, Role::Accepts] {
            if let Ok(backend) = Iptables::new(flavour, role, wait) {
                parts.push(Box::new(backend));
            }
        }
    }
    parts
}

/// CAP_NET_ADMIN, checked up front so a missing privilege is one clear line, not a netlink error.
pub(crate) fn require_net_admin() -> Result<(), Failure> {
    require_capability(12, "CAP_NET_ADMIN", "run as root or add NET_ADMIN")
}

/// CAP_NET_RAW, which iptables-legacy needs besides CAP_NET_ADMIN: libiptc talks to the kernel
/// through a raw socket ("Permission denied (you must be root)" without it).
pub(crate) fn require_net_raw_for_legacy() -> Result<(), Failure> {
    require_capability(
        13,
        "CAP_NET_RAW",
        "--dataplane iptables-legacy reads and writes its tables through a raw socket; add NET_RAW",
    )
}

/// Fails with one line naming capability `name` (bit `bit`) unless this process has it in
/// its effective set; `what_to_do` completes the line.
pub(crate) fn require_capability(bit: u32, name: &str, what_to_do: &str) -> Result<(), Failure> {
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
