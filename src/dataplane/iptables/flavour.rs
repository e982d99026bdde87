//! Which iptables: iptables-legacy or iptables-nft. One [`Flavour`] serves detection (which one
//! the node uses) and the backend (which one it writes through); this file holds what a flavour
//! is called: its binaries, and its name in status, logs, `state.json` and metrics.

use std::fmt;

use super::table::Family;
use super::Role;

/// An iptables flavour: which implementation of iptables the rules go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flavour {
    /// `iptables-legacy`: the x_tables kernel API, serialised by the xtables lock.
    Legacy,
    /// `iptables-nft`: the same rules as nftables tables `ip raw`, `ip6 filter`, etc.
    Nft,
}

/// Which of a flavour's binaries (one of each per address family).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tool {
    /// `iptables-nft` itself, for chain-scoped listings (`-t <table> -S <chain>`).
    List,
    /// `iptables-nft-save`.
    Save,
    /// `iptables-nft-restore`.
    Restore,
}

impl Flavour {
    /// Both flavours, legacy first.
    pub const ALL: [Flavour; 2] = [Flavour::Legacy, Flavour::Nft];

    /// `legacy` or `nft`, as in the binaries' names.
    pub fn as_str(self) -> &'static str {
        match self {
            Flavour::Legacy => "legacy",
            Flavour::Nft => "nft",
        }
    }

    /// `iptables-legacy` or `iptables-nft`: its name in status, logs, detection's reasons and
    /// `state.json`'s `accepts_in` (also its [`fmt::Display`]).
    pub fn name(self) -> &'static str {
        match self {
            Flavour::Legacy => "iptables-legacy",
            Flavour::Nft => "iptables-nft",
        }
    }

    /// The name of its backend for `role`, in logs, status and metrics
    /// ([`Dataplane::name`](crate::dataplane::Dataplane::name)): `iptables-nft` for the route
    /// switch (raw and mangle), `iptables-nft filter` for the ACCEPTs.
    pub fn backend_name(self, role: Role) -> &'static str {
        match (self, role) {
            (Flavour::Legacy, Role::Switch) => "iptables-legacy",
            (Flavour::Nft, Role::Switch) => "iptables-nft",
            (Flavour::Legacy, Role::Accepts) => "iptables-legacy filter",
            (Flavour::Nft, Role::Accepts) => "iptables-nft filter",
        }
    }

    /// The binaries `tool` for each address family this kernel has (IPv4, then IPv6), e.g.
    /// `iptables-nft-save` and `ip6tables-nft-save`.
    pub fn binaries(self, tool: Tool) -> Vec<&'static str> {
        super::kernel_families().into_iter().map(|family| self.binary(family, tool)).collect()
    }

    /// The binary `tool` of `family`, e.g. `ip6tables-nft-restore`.
    pub(super) fn binary(self, family: Family, tool: Tool) -> &'static str {
        use {Family::*, Flavour::*, Tool::*};
        match (family, self, tool) {
            (V4, Legacy, List) => "iptables-legacy",
            (V4, Nft, List) => "iptables-nft",
            (V6, Legacy, List) => "ip6tables-legacy",
            (V6, Nft, List) => "ip6tables-nft",
            (V4, Legacy, Restore) => "iptables-legacy-restore",
            (V4, Legacy, Save) => "iptables-legacy-save",
            (V4, Nft, Restore) => "iptables-nft-restore",
            (V4, Nft, Save) => "iptables-nft-save",
            (V6, Legacy, Restore) => "ip6tables-legacy-restore",
            (V6, Legacy, Save) => "ip6tables-legacy-save",
            (V6, Nft, Restore) => "ip6tables-nft-restore",
            (V6, Nft, Save) => "ip6tables-nft-save",
        }
    }
}

impl fmt::Display for Flavour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binaries_are_named_family_flavour_tool() {
        for flavour in Flavour::ALL {
            for (family, prefix) in [(Family::V4, "iptables"), (Family::V6, "ip6tables")] {
                let name = |suffix| format!("{prefix}-{}{suffix}", flavour.as_str());
                assert_eq!(flavour.binary(family, Tool::List), name(""));
                assert_eq!(flavour.binary(family, Tool::Save), name("-save"));
                assert_eq!(flavour.binary(family, Tool::Restore), name("-restore"));
            }
        }
    }
}
