//! What lives in this node's netfilter, and which backend suits it.
//!
//! `--dataplane auto` follows the node's kube-proxy, so the agent never mixes iptables-legacy
//! and iptables-nft rules on one node (kubernetes/dns #338):
//!
//! 1. `table ip kube-proxy` (or `ip6`) in nftables → kube-proxy's nftables mode → nftables;
//! 2. `KUBE-IPTABLES-HINT` or `KUBE-KUBELET-CANARY` in a flavour's mangle table (what
//!    kubernetes-sigs/iptables-wrappers looks at), iptables-nft first → that flavour;
//! 3. otherwise the flavour with more rules, if any has rules;
//! 4. otherwise native nftables.
//!
//! Independently, kube-proxy's IPVS mode is recognised (its `kube-ipvs0` interface, or rules
//! matching its `KUBE-CLUSTER-IP` ipset): there IPVS takes the ClusterIP's packets in its
//! LOCAL_IN hook whatever NOTRACK says, so `auto` refuses to intercept it ([`ipvs_refusal`]).
//!
//! Independently, the filter ACCEPTs go to every iptables flavour the node uses: the one
//! kubelet's canaries are in, and any whose filter table holds a rule or a policy that is not
//! ACCEPT. node-cache prepends them always, whatever the firewall; a NOTRACKed query is neither
//! NEW nor ESTABLISHED, so a firewall that ends INPUT with a REJECT (RHEL's iptables-services,
//! CIS-hardened images) rejects it where its policy alone would accept it, and an nftables
//! ACCEPT cannot override an iptables verdict. Rules that node-cache installed itself (it must
//! run with `-setupiptables=false`) are reported.
//!
//! [`decide`], [`ipvs_refusal`] and [`parse_save`] are pure; [`gather`] runs `iptables-*-save`
//! and looks for the `kube-ipvs0` interface; `foreign` searches the node for node-cache's rules
//! while the agent runs.

mod foreign;
mod wildcard;

use std::fmt;
use std::net::IpAddr;
use std::process::Command;

use crate::dataplane::iptables::{Flavour, Tool};
pub use wildcard::wildcard_refusal;

pub(crate) use foreign::{watch_foreign_rules, NodeProblems, FOREIGN_RULES_PERIOD};

/// Where the switching rules go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    Iptables(Flavour),
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Nftables => f.write_str("nftables"),
            Backend::Iptables(flavour) => flavour.fmt(f),
        }
    }
}

/// What one flavour's `iptables-save` and `ip6tables-save` show.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveFacts {
    /// kubelet's `KUBE-IPTABLES-HINT` or `KUBE-KUBELET-CANARY` chain is in the mangle table.
    pub kube_hint: bool,
    /// Rules (`-A` lines) in all tables.
    pub rules: usize,
    /// The filter table can stop a packet: it holds a rule (a REJECT at the end of INPUT,
    /// kubelet's KUBE-FIREWALL, …) or a built-in chain whose policy is not ACCEPT.
    pub filter_in_use: bool,
    /// A rule matches kube-proxy's IPVS-mode ipset `KUBE-CLUSTER-IP`.
    pub ipvs_sets: bool,
    /// Rules node-cache installed (its comment), or any other NOTRACK for the listen addresses
    /// outside the agent's chains.
    pub foreign_notrack: Vec<String>,
    /// Those of them that NOTRACK queries to a listen address (raw, `-d <IP>`): the ones that
    /// keep pods on the cache unless the agent's rules run before them ([`overrides`]).
    pub notrack_queries: Vec<String>,
}

/// Everything detection looks at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// `table ip kube-proxy` or `table ip6 kube-proxy` exists.
    pub kube_proxy_nftables: bool,
    /// kube-proxy's IPVS-mode interface `kube-ipvs0` exists.
    pub kube_ipvs0: bool,
    pub legacy: SaveFacts,
    pub nft: SaveFacts,
    /// Save commands that exist but failed: what they saw is unknown.
    pub unreadable: Vec<String>,
}

/// The outcome, with its reasons.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detection {
    /// The backend `auto` picks.
    pub backend: Backend,
    /// Why, in a sentence.
    pub why: String,
    /// The flavours the node uses (kubelet's canaries, or anything in the filter table): the
    /// ACCEPTs go there.
    pub accepts_in: Vec<Flavour>,
    /// Rules of node-cache (or anyone else) that NOTRACK the listen addresses, as
    /// `iptables-nft: -A PREROUTING …`. While they exist, `Upstream` cannot take effect.
    pub foreign_notrack: Vec<String>,
    /// kube-proxy runs in IPVS mode, and what showed it.
    pub ipvs: Option<String>,
    /// What could not be looked at, e.g. `iptables-legacy-save: Permission denied` (the agent
    /// lacks CAP_NET_RAW): the choice above may be wrong.
    pub unreadable: Vec<String>,
}

/// Whether the agent's rules, switched by `backend`, run before a NOTRACK in `flavour`'s raw
/// table, so that the packets they pin to conntrack ([`crate::ruleset::Action::Track`]) stay
/// tracked whatever it says: nftables' chains at `raw - 10` run before every iptables raw chain;
/// an iptables backend's jump is kept first in its own flavour's built-in chains only (the two
/// flavours' raw chains share a priority, and which runs first is not ours to choose).
pub fn overrides(backend: Backend, flavour: Flavour) -> bool {
    match backend {
        Backend::Nftables => true,
        Backend::Iptables(own) => own == flavour,
    }
}

impl Backend {
    /// The switching backend a dataplane's [`name`](crate::dataplane::Dataplane::name) stands
    /// for; `None` for a name of none of them (a test's fake).
    pub fn named(name: &str) -> Option<Backend> {
        if name == "nftables" {
            return Some(Backend::Nftables);
        }
        Flavour::ALL.into_iter().find(|f| f.name() == name).map(Backend::Iptables)
    }
}

/// Chains the agent's iptables backend owns: their rules are not foreign.
const OWN_CHAIN_PREFIX: &str = "NODELOCALDNS-HA-";

/// Reads one flavour's save output (IPv4 and IPv6 concatenated) for `addrs`.
pub fn parse_save(text: &str, addrs: &[IpAddr]) -> SaveFacts {
    let mut facts = SaveFacts::default();
    let mut table = "";
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.trim();
        } else if let Some(chain) = line.strip_prefix(':') {
            let mut words = chain.split_whitespace();
            let (name, policy) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            if table == "mangle" && (name == "KUBE-IPTABLES-HINT" || name == "KUBE-KUBELET-CANARY")
            {
                facts.kube_hint = true;
            }
            if table == "filter" && !matches!(policy, "ACCEPT" | "-" | "") {
                facts.filter_in_use = true;
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            facts.rules += 1;
            facts.filter_in_use |= table == "filter";
            if rule.contains("--match-set KUBE-CLUSTER-IP ") {
                facts.ipvs_sets = true;
            }
            let chain = rule.split_whitespace().next().unwrap_or("");
            let node_cache = rule.contains("NodeLocal DNS Cache");
            let notracks_ours = table == "raw"
                && rule.contains("-j NOTRACK")
                && addrs.iter().any(|ip| {
                    let host = if ip.is_ipv4() { "/32" } else { "/128" };
                    rule.contains(&format!("-d {ip}{host}"))
                        || rule.contains(&format!("-s {ip}{host}"))
                });
            if (node_cache || notracks_ours) && !chain.starts_with(OWN_CHAIN_PREFIX) {
                let found = format!("-t {table} {line}");
                let to = |ip: &IpAddr| format!("-d {ip}/{}", if ip.is_ipv4() { 32 } else { 128 });
                let queries =
                    addrs.iter().any(|ip| rule.contains(&to(ip))) && rule.contains("--dport 53 ");
                if table == "raw" && rule.contains("-j NOTRACK") && queries {
                    facts.notrack_queries.push(found.clone());
                }
                facts.foreign_notrack.push(found);
            }
        }
    }
    facts
}

/// The decision, from facts alone.
pub fn decide(facts: &Facts) -> Detection {
    let (backend, why) = if facts.kube_proxy_nftables {
        (
            Backend::Nftables,
            "table kube-proxy exists in nftables: kube-proxy runs in nftables mode".to_owned(),
        )
    } else if facts.nft.kube_hint {
        (Backend::Iptables(Flavour::Nft), "kubelet's canary chains are in iptables-nft".to_owned())
    } else if facts.legacy.kube_hint {
        (
            Backend::Iptables(Flavour::Legacy),
            "kubelet's canary chains are in iptables-legacy".to_owned(),
        )
    } else if facts.legacy.rules > facts.nft.rules {
        let why = format!(
            "no canary chains; iptables-legacy has more rules ({} vs {})",
            facts.legacy.rules, facts.nft.rules
        );
        (Backend::Iptables(Flavour::Legacy), why)
    } else if facts.nft.rules > 0 {
        let why = format!(
            "no canary chains; iptables-nft has at least as many rules ({} vs {})",
            facts.nft.rules, facts.legacy.rules
        );
        (Backend::Iptables(Flavour::Nft), why)
    } else {
        (
            Backend::Nftables,
            "no kube-proxy rules in iptables or nftables: native nftables".to_owned(),
        )
    };
    let flavours = [(Flavour::Legacy, &facts.legacy), (Flavour::Nft, &facts.nft)];
    let accepts_in = flavours
        .iter()
        .filter(|(_, f)| f.kube_hint || f.filter_in_use)
        .map(|(flavour, _)| *flavour)
        .collect();
    let foreign_notrack = flavours
        .iter()
        .flat_map(|(flavour, f)| f.foreign_notrack.iter().map(move |r| format!("{flavour}: {r}")))
        .collect();
    let ipvs_sets = flavours.iter().filter(|(_, f)| f.ipvs_sets).map(|(flavour, _)| *flavour);
    let mut ipvs_signs: Vec<String> = Vec::new();
    if facts.kube_ipvs0 {
        ipvs_signs.push("interface kube-ipvs0 exists".to_owned());
    }
    ipvs_signs.extend(ipvs_sets.map(|f| format!("{f} rules match ipset KUBE-CLUSTER-IP")));
    let ipvs = (!ipvs_signs.is_empty()).then(|| ipvs_signs.join(", "));
    Detection {
        backend,
        why,
        accepts_in,
        foreign_notrack,
        ipvs,
        unreadable: facts.unreadable.clone(),
    }
}

/// Why `--dataplane auto` must not intercept `cluster_dns` on this node: kube-proxy runs in IPVS
/// mode, where IPVS takes every packet for a ClusterIP in its LOCAL_IN hook and forwards it to a
/// CoreDNS pod, NOTRACK or not (KEP-1024's "will not work in IPVS mode"; counted by
/// `ipvs_clusterip_interception_never_reaches_the_cache` in `tests/e2e_vm.rs`).
pub fn ipvs_refusal(found: &Detection, cluster_dns: &[IpAddr]) -> Option<String> {
    if cluster_dns.is_empty() {
        return None; // the link-local shape: nothing of IPVS's is intercepted
    }
    let signs = found.ipvs.as_deref()?;
    let ips: Vec<String> = cluster_dns.iter().map(ToString::to_string).collect();
    Some(format!(
        "kube-proxy runs in IPVS mode here ({signs}): IPVS forwards every packet for the \
         ClusterIP {} to CoreDNS whatever NOTRACK says, so intercepting it cannot reach the \
         node-local cache, and --dataplane auto installs nothing. On IPVS clusters pods must \
         query the node-local IP itself (kubelet --cluster-dns); to install the ClusterIP rules \
         anyway, name a backend with --dataplane",
        ips.join(", ")
    ))
}

/// Runs `iptables-<flavour>-save` and `ip6tables-<flavour>-save`; empty output when a binary is
/// missing (a node without that flavour), and for iptables-legacy when the family has no table
/// here ([`legacy_has_tables`]). Failures of binaries that exist go to `unreadable`.
fn save_output(flavour: Flavour, unreadable: &mut Vec<String>) -> String {
    let mut text = String::new();
    for binary in flavour.binaries(Tool::Save) {
        if flavour == Flavour::Legacy && !legacy_has_tables(binary) {
            continue;
        }
        match Command::new(binary).output() {
            Ok(out) if out.status.success() => text.push_str(&String::from_utf8_lossy(&out.stdout)),
            Ok(out) => unreadable.push(format!("{binary}: {}", complaint(&out.stderr))),
            Err(_) => {}
        }
    }
    text
}

/// Whether iptables-legacy has a table of `binary`'s family (`ip6tables-…` or `iptables-…`) in
/// this network namespace ([`legacy_tables`](crate::dataplane::iptables::legacy_tables); one
/// whose list cannot be read counts as having some). Without a table a save prints nothing, so
/// none is run: on a node whose iptables is nft that is two processes fewer every
/// [`FOREIGN_RULES_PERIOD`](foreign::FOREIGN_RULES_PERIOD).
fn legacy_has_tables(binary: &str) -> bool {
    let ipv6 = binary.starts_with("ip6");
    crate::dataplane::iptables::legacy_tables(ipv6).is_none_or(|tables| !tables.is_empty())
}

/// What a failed command said: the first line of `stderr` that is not blank, or `failed`.
fn complaint(stderr: &[u8]) -> String {
    let stderr = String::from_utf8_lossy(stderr);
    stderr.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("failed").to_owned()
}

/// Looks at this network namespace's netfilter. `kube_proxy_nftables` comes from the nftables
/// backend's netlink socket.
pub fn gather(kube_proxy_nftables: bool, addrs: &[IpAddr]) -> Facts {
    let (legacy, mut unreadable) = gather_flavour(Flavour::Legacy, addrs);
    let (nft, more) = gather_flavour(Flavour::Nft, addrs);
    unreadable.extend(more);
    let kube_ipvs0 = nix::net::if_::if_nametoindex("kube-ipvs0").is_ok();
    Facts { kube_proxy_nftables, kube_ipvs0, legacy, nft, unreadable }
}

/// The built-in chains where node-cache puts its rules (raw `PREROUTING` and `OUTPUT`, filter
/// `INPUT` and `OUTPUT`), listed one by one with `iptables-<flavour> -t <table> -S <chain>`
/// (and `ip6tables-…`): for iptables-nft that fetches those chains alone, where a save fetches
/// every table, seconds of CPU with kube-proxy's 50,000 nat rules. Enough for the periodic
/// search for foreign NOTRACK rules (not for [`decide`]: no hint chains, no rule counts); a
/// NOTRACK in a user chain is found by the whole save at start only.
pub fn gather_builtin_chains(flavour: Flavour, addrs: &[IpAddr]) -> (SaveFacts, Vec<String>) {
    let mut unreadable = Vec::new();
    let mut text = String::new();
    for binary in flavour.binaries(Tool::List) {
        for (table, chain) in
            [("raw", "PREROUTING"), ("raw", "OUTPUT"), ("filter", "INPUT"), ("filter", "OUTPUT")]
        {
            match Command::new(binary).args(["-t", table, "-S", chain]).output() {
                Ok(out) if out.status.success() => {
                    text.push_str(&format!("*{table}\n"));
                    let listed = String::from_utf8_lossy(&out.stdout);
                    for line in listed.lines().filter(|l| l.starts_with("-A ")) {
                        text.push_str(line);
                        text.push('\n');
                    }
                    text.push_str("COMMIT\n");
                }
                Ok(out) => {
                    let complaint = complaint(&out.stderr);
                    unreadable.push(format!("{binary} -t {table} -S {chain}: {complaint}"));
                }
                // Not installed: a node without that flavour (or family).
                Err(_) => break,
            }
        }
    }
    (parse_save(&text, addrs), unreadable)
}

/// What one flavour's save commands show, and those of them that failed.
pub fn gather_flavour(flavour: Flavour, addrs: &[IpAddr]) -> (SaveFacts, Vec<String>) {
    let mut unreadable = Vec::new();
    let facts = parse_save(&save_output(flavour, &mut unreadable), addrs);
    (facts, unreadable)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs() -> Vec<IpAddr> {
        vec!["169.254.20.10".parse().unwrap(), "10.96.0.10".parse().unwrap()]
    }

    const KUBE_PROXY_LEGACY: &str = "\
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m udp --dport 53 -j KUBE-SVC-TCOU7JCQXEZGVUNU
COMMIT
";

    const NODE_CACHE_RAW: &str = "\
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:NODELOCALDNS-HA-PREROUTING - [0:0]
-A PREROUTING -d 10.96.0.10/32 -p udp -m udp --dport 53 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK
-A PREROUTING -j NODELOCALDNS-HA-PREROUTING
-A NODELOCALDNS-HA-PREROUTING -d 10.96.0.10/32 -p udp -m udp --dport 53 -j NOTRACK
-A OUTPUT -s 169.254.20.10/32 -p tcp -m tcp --sport 53 -j NOTRACK
COMMIT
*filter
:INPUT DROP [0:0]
COMMIT
";

    fn facts(kube_proxy_nftables: bool, legacy: &str, nft: &str) -> Facts {
        Facts {
            kube_proxy_nftables,
            kube_ipvs0: false,
            legacy: parse_save(legacy, &addrs()),
            nft: parse_save(nft, &addrs()),
            unreadable: Vec::new(),
        }
    }

    #[test]
    fn parses_hints_counts_policies_and_foreign_notracks() {
        let f = parse_save(KUBE_PROXY_LEGACY, &addrs());
        assert!(f.kube_hint);
        assert_eq!(f.rules, 2);
        assert!(!f.filter_in_use);
        assert!(f.foreign_notrack.is_empty());

        let f = parse_save(NODE_CACHE_RAW, &addrs());
        assert!(!f.kube_hint);
        assert!(f.filter_in_use);
        // node-cache's commented rule and an uncommented NOTRACK for a listen IP; not our chain's.
        assert_eq!(f.foreign_notrack.len(), 2, "{:?}", f.foreign_notrack);
        assert!(f.foreign_notrack[0].starts_with("-t raw -A PREROUTING -d 10.96.0.10/32"));
    }

    #[test]
    fn kube_proxy_nftables_mode_wins() {
        let d = decide(&facts(true, "", KUBE_PROXY_LEGACY));
        assert_eq!(d.backend, Backend::Nftables);
        assert!(d.why.contains("nftables mode"), "{}", d.why);
    }

    #[test]
    fn canary_chains_pick_their_flavour_nft_first() {
        assert_eq!(
            decide(&facts(false, KUBE_PROXY_LEGACY, "")).backend,
            Backend::Iptables(Flavour::Legacy)
        );
        assert_eq!(
            decide(&facts(false, "", KUBE_PROXY_LEGACY)).backend,
            Backend::Iptables(Flavour::Nft)
        );
        assert_eq!(
            decide(&facts(false, KUBE_PROXY_LEGACY, KUBE_PROXY_LEGACY)).backend,
            Backend::Iptables(Flavour::Nft)
        );
    }

    #[test]
    fn without_canaries_the_busier_flavour_wins_then_nftables() {
        let rules = "*nat\n-A PREROUTING -j KUBE-SERVICES\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n";
        let one = "*nat\n-A PREROUTING -j X\nCOMMIT\n";
        let d = decide(&facts(false, rules, one));
        assert_eq!(d.backend, Backend::Iptables(Flavour::Legacy));
        assert!(d.why.contains("2 vs 1"), "{}", d.why);
        assert_eq!(decide(&facts(false, one, rules)).backend, Backend::Iptables(Flavour::Nft));
        assert_eq!(decide(&facts(false, "", "")).backend, Backend::Nftables);
    }

    #[test]
    fn accepts_go_to_every_flavour_the_node_uses() {
        // A REJECT at the end of INPUT under policy ACCEPT (RHEL's iptables-services).
        let reject = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -m state --state RELATED,ESTABLISHED -j ACCEPT\n-A INPUT -j REJECT --reject-with icmp-host-prohibited\nCOMMIT\n";
        assert_eq!(decide(&facts(false, reject, "")).accepts_in, vec![Flavour::Legacy]);
        // kubelet's canaries: the node's flavour, whatever its filter table holds today.
        let d = decide(&facts(false, "", KUBE_PROXY_LEGACY));
        assert_eq!(d.accepts_in, vec![Flavour::Nft]);
        // An output policy that drops.
        let output = "*filter\n:INPUT ACCEPT [0:0]\n:OUTPUT DROP [0:0]\nCOMMIT\n";
        assert_eq!(decide(&facts(false, "", output)).accepts_in, vec![Flavour::Nft]);
        // Rules elsewhere (nat) and empty filter tables: nothing there can stop the cache's traffic.
        let nat_only = "*nat\n-A PREROUTING -j X\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n";
        assert!(decide(&facts(false, nat_only, "")).accepts_in.is_empty());
    }

    #[test]
    fn accepts_go_where_input_drops_and_foreign_rules_are_named() {
        let d = decide(&facts(true, "", NODE_CACHE_RAW));
        assert_eq!(d.backend, Backend::Nftables);
        assert_eq!(d.accepts_in, vec![Flavour::Nft]);
        assert_eq!(d.foreign_notrack.len(), 2);
        assert!(
            d.foreign_notrack[0].starts_with("iptables-nft: -t raw"),
            "{:?}",
            d.foreign_notrack
        );
    }

    /// node-cache's rules for the cluster-DNS IP as `iptables-save` prints them, less the
    /// filter table: its NOTRACK of pods' and host clients' queries, of its replies and of its
    /// health port.
    const NODE_CACHE_OWN: &str = "\
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A PREROUTING -d 10.96.0.10/32 -p udp -m udp --dport 53 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK
-A OUTPUT -s 10.96.0.10/32 -p udp -m udp --sport 53 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK
-A OUTPUT -d 10.96.0.10/32 -p tcp -m tcp --dport 53 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK
-A OUTPUT -d 10.96.0.10/32 -p tcp -m tcp --dport 8080 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK
COMMIT
";

    #[test]
    fn the_agents_rules_override_what_they_run_before() {
        let cluster_dns: Vec<IpAddr> = vec!["10.96.0.10".parse().unwrap()];
        let own = parse_save(NODE_CACHE_OWN, &cluster_dns);
        assert_eq!(own.foreign_notrack.len(), 4);
        // Queries to the cluster-DNS IP's port 53: what would keep pods on the cache.
        assert_eq!(own.notrack_queries.len(), 2, "{:?}", own.notrack_queries);
        assert!(own.notrack_queries.iter().all(|r| r.contains("--dport 53 ")));
        let none = SaveFacts::default();
        let nft = Backend::Iptables(Flavour::Nft);
        let legacy = Backend::Iptables(Flavour::Legacy);
        for (rules_in, backend, in_effect) in [
            (Flavour::Nft, Some(Backend::Nftables), 0),
            (Flavour::Legacy, Some(Backend::Nftables), 0),
            (Flavour::Nft, Some(nft), 0),
            (Flavour::Legacy, Some(legacy), 0),
            (Flavour::Nft, Some(legacy), 2),
            (Flavour::Legacy, Some(nft), 2),
            (Flavour::Nft, None, 2),
        ] {
            let other = if rules_in == Flavour::Nft { Flavour::Legacy } else { Flavour::Nft };
            let found = foreign::problems(&[(rules_in, &own), (other, &none)], backend);
            assert_eq!((found.foreign_notrack, found.in_effect), (4, in_effect), "{backend:?}");
            let cannot = found.warnings.iter().filter(|w| w.contains("cannot get ahead of"));
            assert_eq!(cannot.count(), in_effect, "{:?}", found.warnings);
            let flavour = format!("{rules_in}: -t raw");
            assert!(found.warnings.iter().all(|w| w.contains(&flavour)), "{:?}", found.warnings);
        }
    }

    #[test]
    fn backends_are_known_by_their_dataplanes_names() {
        assert_eq!(Backend::named("nftables"), Some(Backend::Nftables));
        assert_eq!(Backend::named("iptables-nft"), Some(Backend::Iptables(Flavour::Nft)));
        assert_eq!(Backend::named("iptables-legacy"), Some(Backend::Iptables(Flavour::Legacy)));
        assert_eq!(Backend::named("fake"), None);
    }

    const KUBE_PROXY_IPVS: &str = "\
*nat
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
COMMIT
";

    #[test]
    fn ipvs_mode_is_recognised_by_its_interface_or_its_ipset_and_refused() {
        let cluster_dns = ["10.96.0.10".parse().unwrap()];
        // Neither sign: no refusal, whatever the backend.
        for f in [facts(false, KUBE_PROXY_LEGACY, ""), facts(true, "", ""), facts(false, "", "")] {
            let d = decide(&f);
            assert_eq!(d.ipvs, None);
            assert_eq!(ipvs_refusal(&d, &cluster_dns), None);
        }
        // The interface alone.
        let mut f = facts(false, "", KUBE_PROXY_LEGACY);
        f.kube_ipvs0 = true;
        let d = decide(&f);
        assert_eq!(d.ipvs.as_deref(), Some("interface kube-ipvs0 exists"));
        let refusal = ipvs_refusal(&d, &cluster_dns).expect("refused");
        assert!(refusal.contains("IPVS mode") && refusal.contains("10.96.0.10"), "{refusal}");
        assert!(refusal.contains("--dataplane"), "says what to do: {refusal}");
        // The ipset alone (an iptables-nft kube-proxy in IPVS mode, interface not seen).
        let d = decide(&facts(false, "", KUBE_PROXY_IPVS));
        assert_eq!(d.ipvs.as_deref(), Some("iptables-nft rules match ipset KUBE-CLUSTER-IP"));
        assert!(ipvs_refusal(&d, &cluster_dns).is_some());
        // Both.
        let mut f = facts(false, KUBE_PROXY_IPVS, "");
        f.kube_ipvs0 = true;
        let ipvs = decide(&f).ipvs.expect("ipvs");
        assert!(ipvs.contains("kube-ipvs0") && ipvs.contains("iptables-legacy rules"), "{ipvs}");
    }

    /// In a namespace of its own: no legacy table, so no save is run, and a foreign NOTRACK
    /// that iptables-legacy puts in raw is still found once the table exists.
    #[test]
    fn legacy_is_saved_only_where_it_has_tables() {
        use crate::testutil::{in_netns, run, test_path};
        in_netns("det", test_path!(), |ns| {
            assert!(!legacy_has_tables("iptables-legacy-save"));
            assert!(!legacy_has_tables("ip6tables-legacy-save"));
            assert_eq!(gather_flavour(Flavour::Legacy, &addrs()).0, SaveFacts::default());
            let notrack = "-d 10.96.0.10/32 -p udp -m udp --dport 53 -j NOTRACK";
            let args = ["netns", "exec", ns, "iptables-legacy", "-t", "raw", "-I", "PREROUTING"];
            run("ip", &[&args[..], &notrack.split(' ').collect::<Vec<_>>()].concat());
            assert!(legacy_has_tables("iptables-legacy-save"));
            assert!(!legacy_has_tables("ip6tables-legacy-save"));
            let (facts, unreadable) = gather_flavour(Flavour::Legacy, &addrs());
            assert!(unreadable.is_empty(), "{unreadable:?}");
            assert_eq!(facts.foreign_notrack.len(), 1, "{facts:?}");
        });
    }
}
