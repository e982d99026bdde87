//! Reading the node's own nftables firewall for [`crate::firewall`], which judges whether it
//! would stop pods' DNS to the cache; and [`watch_firewall`], which reads it again whenever it
//! may have changed and sends the control loop what it would stop.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use tokio::sync::{mpsc, Notify};
use tracing::warn;

use super::{objects, Error, Nftables, Snapshot, READ_ATTEMPTS};
use crate::firewall::{self, Blocking};
use crate::netlink::{NLM_F_DUMP, NLM_F_REQUEST};
use crate::ruleset;

/// Whether table `name` of `family` (`NFPROTO_*`) may be part of the node's own firewall, as
/// [`Nftables::host_firewall`] reads it: not the agent's, kube-proxy's or iptables-nft's.
pub fn host_firewall_candidate(family: u8, name: &str) -> bool {
    const IPTABLES_NFT: [&str; 5] = ["filter", "raw", "mangle", "nat", "security"];
    match family {
        1 => name != ruleset::TABLE,
        2 | 10 => name != "kube-proxy" && !IPTABLES_NFT.contains(&name),
        _ => false,
    }
}

impl Nftables {
    /// Whether kube-proxy's nftables mode is at work here: `table ip kube-proxy` or
    /// `table ip6 kube-proxy` exists.
    pub fn kube_proxy_tables(&mut self) -> Result<bool, Error> {
        let name = c"kube-proxy".to_bytes_with_nul();
        for family in [libc::NFPROTO_IPV4 as u8, libc::NFPROTO_IPV6 as u8] {
            let mut snapshot = Snapshot::default();
            let answer = self.request_in(
                family,
                &mut snapshot,
                "kube-proxy's table",
                objects::NFT_MSG_GETTABLE,
                NLM_F_REQUEST,
                &[(objects::NFTA_TABLE_NAME, name)],
                |_, _| Ok(()),
            )?;
            match answer {
                Ok(()) => return Ok(true),
                Err(Errno::ENOENT) => {}
                Err(source) => return Err(Error::List { what: "tables", source }),
            }
        }
        Ok(false)
    }

    /// The node's own nftables firewall: every table of another owner with a base chain on the
    /// `input` or `output` hook, with all its chains and rules, for [`crate::firewall`]. Left
    /// out: the agent's table; kube-proxy's (`ip`/`ip6 kube-proxy`: it judges only new
    /// connections, `ct state new`, and an untracked packet is never new); and iptables-nft's
    /// (`ip`/`ip6` `filter`, `raw`, `mangle`, `nat`, `security`: the agent's ACCEPTs go first in
    /// the iptables flavours the node uses).
    pub fn host_firewall(&mut self) -> Result<Vec<crate::firewall::Table>, Error> {
        for _ in 0..READ_ATTEMPTS {
            if let Some(tables) = self.host_firewall_once()? {
                return Ok(tables);
            }
        }
        Err(Error::Unsettled)
    }

    fn host_firewall_once(&mut self) -> Result<Option<Vec<crate::firewall::Table>>, Error> {
        use crate::firewall::{self, Chain, Table};
        let mut snapshot = Snapshot::default();
        let mut tables = Vec::new();
        for family in [libc::NFPROTO_INET as u8, libc::NFPROTO_IPV4 as u8, libc::NFPROTO_IPV6 as u8]
        {
            let chains = self
                .dump_chains(family, &mut snapshot, "the node's chains", |chain| {
                    host_firewall_candidate(family, &chain.table)
                })?
                .map_err(|source| Error::List { what: "chains", source })?;
            let hooked = |c: &objects::Chain| {
                c.chain_type.as_deref() == Some("filter")
                    && c.hook.is_some_and(|h| {
                        h.hooknum == firewall::HOOK_INPUT || h.hooknum == firewall::HOOK_OUTPUT
                    })
            };
            let mut names: Vec<String> =
                chains.iter().filter(|c| hooked(c)).map(|c| c.table.clone()).collect();
            names.sort();
            names.dedup();
            for name in names {
                let mut rules: Vec<(String, firewall::Rule)> = Vec::new();
                let table_name = std::ffi::CString::new(name.clone()).unwrap_or_default();
                let answer = self.request_in(
                    family,
                    &mut snapshot,
                    "the node's rules",
                    objects::NFT_MSG_GETRULE,
                    NLM_F_REQUEST | NLM_F_DUMP,
                    &[(objects::NFTA_RULE_TABLE, table_name.to_bytes_with_nul())],
                    |message, attrs| {
                        if message == objects::NFT_MSG_NEWRULE {
                            rules.push(objects::parse_foreign_rule(attrs)?);
                        }
                        Ok(())
                    },
                )?;
                match answer {
                    // The table went away meanwhile: read again.
                    Err(Errno::ENOENT) => return Ok(None),
                    Err(source) => return Err(Error::List { what: "rules", source }),
                    Ok(()) => {}
                }
                let chains = chains
                    .iter()
                    .filter(|c| c.table == name)
                    .map(|c| Chain {
                        name: c.name.clone(),
                        hook: c.hook.map(|h| (h.hooknum, h.priority)),
                        policy: c.policy,
                        rules: rules
                            .iter()
                            .filter(|(chain, _)| *chain == c.name)
                            .map(|(_, r)| r.clone())
                            .collect(),
                    })
                    .collect();
                tables.push(Table { family, name, chains });
            }
        }
        Ok(snapshot.consistent().then_some(tables))
    }
}

/// How often the node's own nftables firewall is read again without being told it changed.
const FIREWALL_PERIOD: Duration = Duration::from_secs(30);

/// The node's own nftables firewall, judged for the listen addresses `addrs` and the pods the
/// node's routes show (`services`: the kube-dns and upstream IPs, whose interface is no pod's).
pub fn audit_firewall(addrs: &[IpAddr], services: &[IpAddr]) -> Result<Vec<Blocking>, Error> {
    let tables = Nftables::new()?.host_firewall()?;
    let pods = firewall::read_pod_sources(services);
    Ok(firewall::blocking(&tables, addrs, &pods))
}

/// Reads the node's own nftables firewall (and the node's routes) again whenever one of its
/// tables changes (`changed`) and every [`FIREWALL_PERIOD`], and sends what it would stop. A failed read is said once and
/// changes nothing.
pub async fn watch_firewall(
    addrs: Vec<IpAddr>,
    services: Vec<IpAddr>,
    changed: Arc<Notify>,
    tx: mpsc::Sender<Vec<Blocking>>,
) {
    let mut failing = false;
    loop {
        tokio::select! {
            _ = changed.notified() => {}
            _ = tokio::time::sleep(FIREWALL_PERIOD) => {}
        }
        let (addrs, services) = (addrs.clone(), services.clone());
        let look = move || audit_firewall(&addrs, &services);
        let Ok(found) = tokio::task::spawn_blocking(look).await else {
            continue;
        };
        match found {
            Ok(found) => {
                failing = false;
                if tx.send(found).await.is_err() {
                    return;
                }
            }
            Err(e) if !failing => {
                failing = true;
                warn!(error = %e, "cannot read the node's nftables firewall; keeping the last look");
            }
            Err(_) => {}
        }
    }
}
