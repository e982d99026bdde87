//! Where the agent's iptables rules live: the address families (`iptables` and `ip6tables`), the
//! tables (raw, mangle, filter) with the built-in chains the agent jumps from, and which tables
//! a backend writes ([`Role`]).

use std::net::IpAddr;

use super::text::Hooked;
use crate::dataplane::{TableRef, TableWatch};

/// The tables iptables-legacy has of one family (IPv6 when `ipv6`) in this network namespace,
/// as the kernel names them in `/proc/net/ip_tables_names` (`ip6_tables_names`): none until
/// something names one, and the file is missing while the module is not loaded. Naming a table
/// to iptables-legacy, even to save it, makes the kernel create it, hooks and all (every packet
/// of the node then passes it, and iptables-nft warns on each call that legacy tables are
/// present): a table not listed holds nothing and is better left unnamed. `None` when the list
/// cannot be read for another reason.
pub fn legacy_tables(ipv6: bool) -> Option<Vec<String>> {
    match std::fs::read_to_string(names_path(ipv6)) {
        Ok(names) => Some(names.lines().map(str::to_owned).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(Vec::new()),
        Err(_) => None,
    }
}

/// Where the kernel lists a family's iptables-legacy tables.
pub(super) fn names_path(ipv6: bool) -> &'static str {
    if ipv6 {
        "/proc/net/ip6_tables_names"
    } else {
        "/proc/net/ip_tables_names"
    }
}

/// An address family, and so a pair of binaries (`iptables-*` or `ip6tables-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Family {
    V4,
    V6,
}

impl Family {
    /// IPv4 first.
    pub(super) const ALL: [Family; 2] = [Family::V4, Family::V6];

    /// The family of `addr`.
    pub(super) fn of(addr: IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// `NFPROTO_IPV4` or `NFPROTO_IPV6`: the family of iptables-nft's nftables tables.
    pub(super) fn nfproto(self) -> u8 {
        match self {
            Family::V4 => libc::NFPROTO_IPV4 as u8,
            Family::V6 => libc::NFPROTO_IPV6 as u8,
        }
    }

    /// `IPv4` or `IPv6`, for messages.
    pub(super) fn label(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// `ip` or `ip6`, as in `iptables` and `ip6tables`.
    pub(super) fn prefix(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }

    /// Its position in [`Family::ALL`].
    pub(super) fn index(self) -> usize {
        match self {
            Family::V4 => 0,
            Family::V6 => 1,
        }
    }

    /// The prefix length of one host, which `iptables-save` always prints.
    pub(super) fn host_bits(self) -> u8 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}

/// An iptables table the agent has chains in, and so a part of the [`RuleSet`](crate::ruleset::RuleSet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Table {
    /// The NOTRACK chains ([`RuleSet::chains`](crate::ruleset::RuleSet::chains) but the fallback).
    Raw,
    /// The link-local fallback chain ([`Chain::is_fallback`](crate::ruleset::Chain::is_fallback)):
    /// xt_TPROXY works in mangle `PREROUTING` only, after conntrack, as nftables' `priority
    /// mangle` chain.
    Mangle,
    /// The ACCEPTs ([`RuleSet::accepts`](crate::ruleset::RuleSet::accepts)).
    Filter,
}

impl Table {
    /// Every table the agent may have written.
    pub const ALL: [Table; 3] = [Table::Raw, Table::Mangle, Table::Filter];

    /// The table's name, as after `-t`.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Raw => "raw",
            Table::Mangle => "mangle",
            Table::Filter => "filter",
        }
    }

    /// The nftables tables iptables-nft keeps this table in: one per family, of the same name
    /// (`ip raw` and `ip6 raw`, …).
    pub fn nft_tables(self) -> Vec<TableRef> {
        let name = self.as_str();
        Family::ALL.map(|f| TableRef { family: f.nfproto(), name: name.to_owned() }).into()
    }

    /// Whether iptables-legacy has no such table of `family` here ([`legacy_tables`]).
    pub(super) fn unlisted_in_legacy(self, family: Family) -> bool {
        let listed = |names: Vec<String>| names.iter().any(|n| n == self.as_str());
        legacy_tables(family == Family::V6).is_some_and(|names| !listed(names))
    }

    /// The built-in chains the agent jumps from, each with its chain.
    pub(super) fn hooks(self) -> &'static [Hooked] {
        const RAW: [Hooked; 2] = [
            Hooked { builtin: "PREROUTING", own: "NODELOCALDNS-HA-PREROUTING" },
            Hooked { builtin: "OUTPUT", own: "NODELOCALDNS-HA-OUTPUT" },
        ];
        const MANGLE: [Hooked; 1] =
            [Hooked { builtin: "PREROUTING", own: "NODELOCALDNS-HA-FALLBACK" }];
        const FILTER: [Hooked; 2] = [
            Hooked { builtin: "INPUT", own: "NODELOCALDNS-HA-INPUT" },
            Hooked { builtin: "OUTPUT", own: "NODELOCALDNS-HA-OUTPUT" },
        ];
        match self {
            Table::Raw => &RAW,
            Table::Mangle => &MANGLE,
            Table::Filter => &FILTER,
        }
    }

    /// Its position in [`Table::ALL`].
    pub(super) fn index(self) -> usize {
        match self {
            Table::Raw => 0,
            Table::Mangle => 1,
            Table::Filter => 2,
        }
    }
}

/// Which share of the [`RuleSet`](crate::ruleset::RuleSet) a backend installs, and so which tables it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The route switch: the NOTRACK chains in raw and the link-local fallback in mangle, in
    /// one `iptables-restore` per family (a switch changes both).
    Switch,
    /// The filter ACCEPTs.
    Accepts,
}

impl Role {
    /// Its tables, in the order an apply writes them (a removal goes backwards; see the
    /// module's documentation for why).
    pub fn tables(self) -> &'static [Table] {
        match self {
            Role::Switch => &[Table::Raw, Table::Mangle],
            Role::Accepts => &[Table::Filter],
        }
    }

    /// The nftables tables iptables-nft keeps its tables in, each with the chains a read-back
    /// lists ([`Table::hooks`]): a change to any other chain's rules cannot change what it finds.
    pub fn nft_tables(self) -> Vec<TableWatch> {
        let watch = |table: &Table| {
            let chains: Vec<&'static str> =
                table.hooks().iter().flat_map(|h| [h.builtin, h.own]).collect();
            table
                .nft_tables()
                .into_iter()
                .map(move |t| TableWatch { table: t, chains: Some(chains.clone()) })
        };
        self.tables().iter().flat_map(watch).collect()
    }
}

/// `tables` in words, for messages: `the raw table`, `the raw and mangle tables`.
pub(super) fn describe(tables: &[Table]) -> &'static str {
    use Table::*;
    match tables {
        [Raw] => "the raw table",
        [Mangle] => "the mangle table",
        [Filter] => "the filter table",
        [Raw, Mangle] => "the raw and mangle tables",
        [Mangle, Raw] => "the mangle and raw tables",
        _ => "the agent's tables",
    }
}
