//! The search for NOTRACK rules of others on the listen addresses, every
//! [`FOREIGN_RULES_PERIOD`]: [`watch_foreign_rules`] sends the control loop what it found, as
//! warnings for `status`.

use std::net::IpAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::{complaint, parse_save, SaveFacts};
use crate::dataplane::iptables::{
    legacy_snapshot, legacy_tables, Flavour, LegacyTables, Table, Tool,
};
use crate::dataplane::{nftables_generation, FULL_READ_EVERY, POLL_ANNOUNCED};

/// What one look at the node found that only an operator can fix.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeProblems {
    /// Rules of others for the cluster-DNS IPs: node-cache's own, or anyone's NOTRACK.
    pub foreign_notrack: usize,
    /// Those of them that NOTRACK queries where the agent's rules do not run first
    /// ([`super::overrides`]): while any is there, pods stay on the cache whatever the route.
    pub in_effect: usize,
    /// Each problem in words, the foreign rules' first: for `status` and the log.
    pub warnings: Vec<String>,
}

/// How often the node is searched for NOTRACK rules of others on the listen addresses.
pub(crate) const FOREIGN_RULES_PERIOD: Duration = Duration::from_secs(10);

/// Every `period`, looks for NOTRACK rules on `addrs` (the cluster-DNS IPs) that are not the
/// agent's (node-cache run without `-setupiptables=false` re-inserts its own every 60 s). Those
/// the agent's rules, switched by `backend`, run before are made harmless by them: the agent
/// never touches another owner's rules, so it never fights a live node-cache, and a dead or
/// hung one's rules keep no pod on it. A NOTRACK of queries it cannot get ahead of (in the
/// other iptables flavour than its own) is in effect: while it is there, `Upstream` cannot take
/// effect, and only an operator can fix that. `None` for `backend`: none is overridden.
///
/// iptables-nft is read again only when its raw tables were announced changed (`raw_changed`),
/// or every [`POLL_ANNOUNCED`] (every period while announcements are not `hearing`), and not
/// even then while the nftables generation is the one its last read began in (nothing in
/// nftables changed since), for up to [`FULL_READ_EVERY`]; then only the built-in chains node-cache writes to, one `iptables-nft -S <chain>` each
/// ([`gather_builtin_chains`]): `iptables-nft-save` fetches the whole ruleset, 4 s of CPU
/// with kube-proxy's 50,000 nat rules. iptables-legacy announces nothing: its raw and filter
/// tables (where node-cache writes) are copied from the kernel in-process every period, and
/// saved only when a copy changed ([`gather_legacy`]); its nat table, kube-proxy's, is never
/// read (a whole save every period was seconds of CPU on a busy legacy node).
pub(crate) async fn watch_foreign_rules(
    addrs: Vec<IpAddr>,
    backend: Option<super::Backend>,
    period: Duration,
    raw_changed: Arc<AtomicBool>,
    hearing: Arc<AtomicBool>,
    tx: mpsc::Sender<NodeProblems>,
) {
    use crate::detect::gather_builtin_chains;
    let mut ticker = tokio::time::interval(period);
    let mut nft: Option<NftRead> = None;
    let mut legacy_read: Option<LegacyRead> = None;
    loop {
        ticker.tick().await;
        let changed = raw_changed.swap(false, Ordering::Relaxed);
        let fresh = nft.as_ref().is_some_and(|n| n.looked_at.elapsed() < POLL_ANNOUNCED);
        let reread = changed || !(fresh && hearing.load(Ordering::Relaxed));
        let trusted = nft.as_ref().filter(|n| n.read_at.elapsed() < FULL_READ_EVERY);
        let read_in = trusted.and_then(|n| n.began_in);
        let addrs = addrs.clone();
        let last = legacy_read.take();
        let Ok((legacy, nft_now)) = tokio::task::spawn_blocking(move || {
            let legacy = gather_legacy(&addrs, last);
            // `Err`: not read again, nothing in nftables having changed since the last read.
            let nft_now = reread.then(|| {
                let now = nftables_generation();
                if now.is_some() && now == read_in {
                    return Err(());
                }
                let (facts, unreadable) = gather_builtin_chains(Flavour::Nft, &addrs);
                Ok((facts, unreadable, now))
            });
            (legacy, nft_now)
        })
        .await
        else {
            continue;
        };
        let now = Instant::now();
        match (nft_now, nft.as_mut()) {
            (Some(Ok((facts, unreadable, began_in))), _) => {
                nft = Some(NftRead { facts, unreadable, began_in, read_at: now, looked_at: now });
            }
            (Some(Err(())), Some(last)) => last.looked_at = now,
            _ => {}
        }
        let Some(NftRead { facts: nft_facts, unreadable: nft_unreadable, .. }) = &nft else {
            continue;
        };
        let mut unreadable = legacy.unreadable.clone();
        let legacy = &legacy_read.insert(legacy).facts;
        unreadable.extend(nft_unreadable.iter().cloned());
        let flavours = [(Flavour::Legacy, legacy), (Flavour::Nft, nft_facts)];
        let mut found = problems(&flavours, backend);
        found.warnings.extend(unreadable.into_iter().map(|problem| {
            format!(
                "cannot read the node's iptables rules (CAP_NET_RAW missing? iptables-legacy also \
                 needs uid 0 to list its tables): {problem}"
            )
        }));
        if tx.send(found).await.is_err() {
            return;
        }
    }
}

/// What each flavour's foreign rules mean, with the agent's rules switched by `backend`: each
/// named, and whether the agent's rules make it harmless or it keeps pods on the cache.
pub(crate) fn problems(
    found: &[(Flavour, &SaveFacts)],
    backend: Option<super::Backend>,
) -> NodeProblems {
    let mut problems = NodeProblems::default();
    for &(flavour, facts) in found {
        let overridden = backend.is_some_and(|b| super::overrides(b, flavour));
        for rule in &facts.foreign_notrack {
            problems.foreign_notrack += 1;
            let warning = if overridden || !facts.notrack_queries.contains(rule) {
                format!(
                    "foreign rule for a listen address (node-cache runs without \
                     -setupiptables=false), harmless beside the agent's rules: {flavour}: {rule}"
                )
            } else {
                problems.in_effect += 1;
                let own = backend.map_or("none".to_owned(), |b| b.to_string());
                format!(
                    "foreign NOTRACK the agent's rules ({own}) cannot get ahead of: while it is \
                     there, pods stay on the cache whatever the route; run node-cache with \
                     -setupiptables=false: {flavour}: {rule}"
                )
            };
            problems.warnings.push(warning);
        }
    }
    problems
}

/// What the search last read of iptables-nft: what it found, the nftables generation the read
/// began in, when it was read, and when the generation last said it still stood.
struct NftRead {
    facts: SaveFacts,
    unreadable: Vec<String>,
    began_in: Option<u32>,
    read_at: Instant,
    looked_at: Instant,
}

/// What the search last read of iptables-legacy, and the kernel's copy of its tables then.
struct LegacyRead {
    /// The tables as read; `None` when they could not be copied, or changed while read: the
    /// next search reads them again.
    tables: Option<LegacyTables>,
    facts: SaveFacts,
    unreadable: Vec<String>,
}

/// The tables of iptables-legacy where node-cache writes.
const NODE_CACHE_TABLES: [Table; 2] = [Table::Raw, Table::Filter];

/// iptables-legacy's raw and filter tables, as `last` read them if the kernel holds them as it
/// did then, else saved again (`iptables-legacy-save -t <table>` of each listed table).
fn gather_legacy(addrs: &[IpAddr], last: Option<LegacyRead>) -> LegacyRead {
    let before = legacy_snapshot(&NODE_CACHE_TABLES);
    if let Some(last) = last {
        if before.is_some() && last.tables == before {
            return last;
        }
    }
    let mut unreadable = Vec::new();
    let mut text = String::new();
    for binary in Flavour::Legacy.binaries(Tool::Save) {
        let ipv6 = binary.starts_with("ip6");
        let Some(listed) = legacy_tables(ipv6) else {
            unreadable.push(format!("{binary}: cannot list its tables"));
            continue;
        };
        for table in NODE_CACHE_TABLES.iter().map(|t| t.as_str()) {
            if !listed.iter().any(|name| name == table) {
                continue;
            }
            match Command::new(binary).args(["-t", table]).output() {
                Ok(out) if out.status.success() => {
                    text.push_str(&String::from_utf8_lossy(&out.stdout))
                }
                Ok(out) => {
                    unreadable.push(format!("{binary} -t {table}: {}", complaint(&out.stderr)))
                }
                // Not installed: a node without iptables-legacy (or that family).
                Err(_) => break,
            }
        }
    }
    // Kept only when every save ran, and nothing changed meanwhile.
    let after = legacy_snapshot(&NODE_CACHE_TABLES);
    let tables = before.filter(|b| after.as_ref() == Some(b) && unreadable.is_empty());
    LegacyRead { tables, facts: parse_save(&text, addrs), unreadable }
}
