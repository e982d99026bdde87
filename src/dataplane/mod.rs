//! Dataplane backends: install a [`RuleSet`] atomically, read it back, remove it.
//!
//! Every backend owns its objects outright (for nftables, one table) and replaces what they hold
//! in one transaction (iptables: one per address family; nftables: its chains' rules, or the
//! whole table), so what each transaction leaves is always exactly its share of a ruleset
//! [`RuleSet::desired`] produced, never a mix.

#[cfg(test)]
#[forbid(unsafe_code)]
pub mod fake;
#[forbid(unsafe_code)]
pub mod iptables;
#[allow(unsafe_code)]
mod iptables_sockopt;
pub mod nftables;

use std::time::Duration;

use crate::ruleset::{ListenAddrs, Route, RuleSet};

/// How often a ruleset whose changes the kernel announces is checked all the same. Reading
/// iptables-nft back runs child processes (`iptables-nft -S <chain>`: two per chain of the
/// agent's, in each table and family, a few ms each): too much for every tick, when
/// announcements say when to.
pub const POLL_ANNOUNCED: Duration = Duration::from_secs(30);

/// How long a read-back is trusted while the kernel's own evidence says nothing it read has
/// changed since (the nftables generation it began in, iptables-legacy's copies of its tables
/// as then): each is exact, so reading back all the same only guards the agent's own
/// comparisons, and needs no shorter period. On an idle node that mixes iptables-nft and
/// iptables-legacy a whole read-back was twenty child processes.
pub const FULL_READ_EVERY: Duration = Duration::from_secs(300);

/// The namespace's nftables generation ([`nftables::Nftables::generation`]), read on a netlink
/// socket of its own for the call; `None` when it cannot be read.
pub(crate) fn nftables_generation() -> Option<u32> {
    nftables::Nftables::new().and_then(|mut nft| nft.generation()).ok()
}

/// What a dataplane failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The nftables backend failed.
    #[error(transparent)]
    Nftables(#[from] nftables::Error),
    /// The iptables backend failed.
    #[error(transparent)]
    Iptables(#[from] iptables::Error),
    /// Injected by the fake dataplane in tests.
    #[cfg(test)]
    #[error("injected failure: {0}")]
    Injected(&'static str),
}

impl Error {
    /// Whether the kernel (or iptables-restore on its behalf) refused a rule itself, as it
    /// refuses one that needs a module it lacks (ENOENT) or cannot run where it is
    /// (EOPNOTSUPP, EINVAL): the same rule will be refused again. A lock, a timeout, a signal,
    /// a lack of memory or of privilege, or a batch refused as a whole may pass, or are not the
    /// rule's doing.
    pub fn is_refusal(&self) -> bool {
        use nix::errno::Errno;
        match self {
            Error::Nftables(nftables::Error::Rejected { at, source }) => {
                at.contains(": rule ")
                    && matches!(source, Errno::ENOENT | Errno::EOPNOTSUPP | Errno::EINVAL)
            }
            Error::Iptables(iptables::Error::RestoreFailed { status, stderr, .. }) => {
                let passing =
                    ["temporarily unavailable", "Cannot allocate memory", "Permission denied"];
                status.code().is_some() && !passing.iter().any(|p| stderr.contains(p))
            }
            Error::Nftables(_) | Error::Iptables(_) => false,
            #[cfg(test)]
            Error::Injected(_) => false,
        }
    }
}

/// A netfilter table as the kernel's nftables change announcements name it: its family
/// (`NFPROTO_*`) and name. The nftables backend's `inet nodelocaldns-ha`, iptables-nft's
/// `ip raw` or `ip6 filter`, kube-proxy's or the node firewall's tables: what
/// [`Dataplane::announced_tables`] lists and [`Dataplane::check_changed`] hears changed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TableRef {
    /// `NFPROTO_INET`, `NFPROTO_IPV4`, `NFPROTO_IPV6`, …
    pub family: u8,
    /// The table's name.
    pub name: String,
}

/// A table whose announced changes call for a read-back ([`Dataplane::announced_tables`]): every
/// change of it (`chains: None`), or only those that may touch `chains`, the chains a check
/// lists: a change to their rules, or any change not confined to one chain's rules (the table,
/// a chain made, renamed or deleted, a set). kube-proxy rewriting its own chains of iptables-nft's
/// filter table every second then costs no read-back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableWatch {
    /// The table.
    pub table: TableRef,
    /// The only chains whose rules matter, when not all do.
    pub chains: Option<Vec<&'static str>>,
}

impl TableWatch {
    /// Every change of `table` matters.
    pub fn whole(table: TableRef) -> TableWatch {
        TableWatch { table, chains: None }
    }
}

/// How the installed state compares with the wanted one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// Installed exactly as wanted.
    Matches,
    /// Nothing of the agent's is installed.
    Missing,
    /// Something is installed but not what is wanted; says what differs first.
    Differs(String),
}

/// A netfilter backend the agent can switch routes with.
///
/// `Send`, so that a [`Dataplane::reader`] can read back on a worker thread while the control
/// loop decides and applies.
pub trait Dataplane: Send {
    /// Short name for logs and status, e.g. `nftables`.
    fn name(&self) -> &'static str;
    /// Replaces whatever the agent has installed with `rules`, in one atomic transaction, then
    /// reads it back: `Ok` only when the kernel holds exactly `rules`.
    fn apply(&mut self, rules: &RuleSet) -> Result<(), Error>;
    /// Reads back what is installed and compares it with `rules`.
    fn check(&mut self, rules: &RuleSet) -> Result<Check, Error>;
    /// [`Dataplane::check`] of what lives in the `changed` tables only (announced changed
    /// since the last check), and of what announces nothing ([`Dataplane::polled`]); the rest
    /// is taken to be as last read back, since every change to it is announced. The default
    /// reads everything.
    fn check_changed(&mut self, rules: &RuleSet, changed: &[TableRef]) -> Result<Check, Error> {
        let _ = changed;
        self.check(rules)
    }
    /// Removes everything the agent installed; `Ok` when nothing was.
    fn remove(&mut self) -> Result<(), Error>;
    /// Whether the kernel takes `rules`' link-local fallback, whose TPROXY and socket matches
    /// need modules a node's kernel may lack: its chains put in under names of their own,
    /// reachable from no hook, and taken out again (nftables: in the same transaction;
    /// iptables: in the next), the node left as it was. `Ok` when the ruleset has no fallback;
    /// the default, for a backend with nothing to try, takes anything.
    fn trial(&mut self, rules: &RuleSet) -> Result<(), Error> {
        let _ = rules;
        Ok(())
    }
    /// Whether its fallback's TPROXY rules match only while the forwarder renews its lease
    /// ([`crate::forwarder::lease`]): iptables, whose TPROXY drops what no socket takes. The
    /// default, nftables' `tproxy`, lets such a packet go on to the cache and needs none.
    fn fallback_leased(&self) -> bool {
        false
    }
    /// A second handle on the same objects, for [`Dataplane::check`]s off the control loop: it
    /// shares nothing with this one but what the kernel holds (its own netlink socket), so a
    /// check can run on another thread while this one applies. Only `check` is called on it.
    fn reader(&self) -> Result<Box<dyn Dataplane>, Error>;
    /// Packets the cache has sent from its listen IPs so far to pods and host clients, as
    /// counted by the agent's "cache replies" rules ([`reply_weight`]): a drain waits for this
    /// to stop moving. The answers to the agent's own probes, which never stop, are left out.
    /// `None` when the backend has no such counters.
    fn reply_packets(&mut self) -> Result<Option<u64>, Error> {
        Ok(None)
    }
    /// The nftables tables [`Dataplane::check`] reads, when they are all it reads, each with the
    /// chains it lists when it does not read the whole table: the kernel announces every change
    /// to them, so the agent checks when one that matters is announced instead of on every
    /// tick. `None` (the default) when a check must be polled: iptables-legacy's tables announce
    /// nothing.
    fn announced_tables(&self) -> Option<Vec<TableWatch>> {
        None
    }
    /// Whether part of what a check reads announces nothing (iptables-legacy's tables) and is
    /// looked at every few ticks (`reconciler::LOOK_UNANNOUNCED`) even where [`Dataplane::announced_tables`] lists the rest: a
    /// [`Dataplane::check_changed`] always reads that part, whatever was announced. The
    /// default: when nothing is announced.
    fn polled(&self) -> bool {
        self.announced_tables().is_none()
    }
    /// What a check of the [`Dataplane::polled`] part would find, when it can be told at once,
    /// in-process and without a child process (an iptables-legacy table the kernel holds
    /// exactly as at its last read-back): then `Some(Check::Matches)`, and the tick's check
    /// needs no thread. `None`: a check must read it (the default). The announced part counts
    /// as matching, as in [`Dataplane::check_changed`] with nothing announced.
    fn unchanged(&mut self, rules: &RuleSet) -> Option<Check> {
        let _ = rules;
        None
    }
    /// The nftables ruleset's generation now ([`nftables::Nftables::generation`]), for a
    /// dataplane whose announced part is nftables objects (nftables, iptables-nft): a whole
    /// check that began in the generation still current would read the announced part as it
    /// did then, so the reconciler's safety net can tell it unchanged without a read-back.
    /// `None` (the default): not known.
    fn ruleset_generation(&mut self) -> Option<u32> {
        None
    }
    /// How long the kernel took with the last [`Dataplane::apply`]'s transactions (one, unless
    /// the first was refused or read back wrong): the switch itself, which packets take at its
    /// end, without the read-back that follows. `None` (the default) when the backend cannot
    /// tell it apart.
    fn last_commit(&self) -> Option<Duration> {
        None
    }
}

pub use crate::ruleset::{reply_weight, REPLY_COMMENT};

/// What besides the NOTRACK chains goes into the ruleset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Filter ACCEPTs (in the iptables flavours the node uses).
    pub accepts: bool,
    /// The kernel fast path (`socket` guard); off only for comparisons.
    pub fast_path: bool,
    /// The link-local IPs' fallback chain (TPROXY to the agent's forwarder): only where the
    /// agent runs its forwarder.
    pub link_local: bool,
}

impl Default for Shape {
    fn default() -> Shape {
        Shape { accepts: false, fast_path: true, link_local: true }
    }
}

/// The ruleset the agent wants for `route`.
pub fn plan(addrs: &ListenAddrs, route: Route, shape: Shape) -> RuleSet {
    let mut rules = RuleSet::desired(addrs, route);
    if !shape.fast_path {
        rules = rules.without_fast_path();
    }
    if shape.accepts {
        rules = rules.with_accepts(addrs);
    }
    if !shape.link_local {
        rules.chains.retain(|chain| !chain.is_fallback());
    }
    rules
}

/// The route whose ruleset is installed now, if the installed state is exactly one of them.
pub fn installed_route(
    dp: &mut dyn Dataplane,
    addrs: &ListenAddrs,
    shape: Shape,
) -> Result<Option<Route>, Error> {
    for route in [Route::Local, Route::Upstream] {
        if dp.check(&plan(addrs, route, shape))? == Check::Matches {
            return Ok(Some(route));
        }
    }
    Ok(None)
}

/// A switching backend plus the backends that hold the filter ACCEPTs: one dataplane to the
/// agent. Each part installs only its share of the [`RuleSet`] (the switching backend its
/// chains, an iptables filter backend its accepts).
///
/// The parts are applied in the order that keeps every intermediate state one the node can live
/// on: towards `Local` the ACCEPTs go in first, so the cluster-DNS NOTRACK never reaches the
/// kernel without them (a NOTRACKed query that a host firewall rejects is lost, where one that
/// is not NOTRACKed is DNATed to CoreDNS); towards `Upstream` the switching part goes first, so
/// a failed ACCEPT (a held xtables lock) never delays a failover. Removal takes the switching
/// part first too.
///
/// The ACCEPTs are the same in both routes: a route switch that follows a complete apply leaves
/// them as they are (no xtables lock to wait for, no transaction of another program on the
/// way). Any other apply, a repair or a retry, rewrites every part.
pub struct Layered {
    switch: Box<dyn Dataplane>,
    accepts: Vec<Box<dyn Dataplane>>,
    name: &'static str,
    /// The ruleset of the last apply that succeeded whole.
    applied: Option<RuleSet>,
}

impl Layered {
    /// `switch` alone when `accepts` is empty.
    pub fn new(switch: Box<dyn Dataplane>, accepts: Vec<Box<dyn Dataplane>>) -> Layered {
        let name = switch.name();
        Layered { switch, accepts, name, applied: None }
    }

    /// Applies the ACCEPT parts, unless `rules` only switches the route after a complete apply
    /// with the same ACCEPTs.
    fn apply_accepts(&mut self, rules: &RuleSet) -> Result<(), Error> {
        let switch_only = self
            .applied
            .as_ref()
            .is_some_and(|last| last.accepts == rules.accepts && last.chains != rules.chains);
        if switch_only {
            return Ok(());
        }
        self.accepts.iter_mut().try_for_each(|d| d.apply(rules))
    }

    fn parts(&mut self) -> impl Iterator<Item = &mut Box<dyn Dataplane>> {
        std::iter::once(&mut self.switch).chain(self.accepts.iter_mut())
    }

    /// Whether ACCEPT backends are part of it (and so the ruleset must carry accepts).
    pub fn has_accepts(&self) -> bool {
        !self.accepts.is_empty()
    }

    /// The names of the ACCEPT backends.
    pub fn accept_names(&self) -> Vec<&'static str> {
        self.accepts.iter().map(|d| d.name()).collect()
    }
}

impl Dataplane for Layered {
    fn name(&self) -> &'static str {
        self.name
    }

    fn apply(&mut self, rules: &RuleSet) -> Result<(), Error> {
        let result = if rules.steers_to_cache() {
            match self.apply_accepts(rules) {
                // The ACCEPTs may be gone (a firewall reload flushed them) and cannot be put
                // back now: take the steering out rather than leave it without them. Best
                // effort: the error returned is the ACCEPTs', and the retry restores it all.
                Err(e) => {
                    let _ = self.switch.apply(&rules.clone().without_cache_steering());
                    Err(e)
                }
                Ok(()) => self.switch.apply(rules),
            }
        } else {
            self.switch.apply(rules).and_then(|()| self.apply_accepts(rules))
        };
        self.applied = result.is_ok().then(|| rules.clone());
        result
    }

    /// The tables of the parts that announce theirs; `None` when no part does. A part that
    /// announces nothing (iptables-legacy's ACCEPTs beside nftables, or beside iptables-nft on
    /// a node that mixes them) makes the whole [`Dataplane::polled`], not unannounced: the
    /// announced parts are read back only when their tables change, not on every tick with it.
    fn announced_tables(&self) -> Option<Vec<TableWatch>> {
        let mut all: Option<Vec<TableWatch>> = None;
        for part in std::iter::once(&self.switch).chain(&self.accepts) {
            if let Some(tables) = part.announced_tables() {
                all.get_or_insert_with(Vec::new).extend(tables);
            }
        }
        all
    }

    fn polled(&self) -> bool {
        std::iter::once(&self.switch).chain(&self.accepts).any(|part| part.polled())
    }

    /// Matches when every part that announces nothing is unchanged.
    fn unchanged(&mut self, rules: &RuleSet) -> Option<Check> {
        for part in self.parts() {
            if part.announced_tables().is_none() && part.unchanged(rules)? != Check::Matches {
                return None;
            }
        }
        Some(Check::Matches)
    }

    fn check(&mut self, rules: &RuleSet) -> Result<Check, Error> {
        let checks = self.parts().map(|p| p.check(rules)).collect::<Result<Vec<_>, _>>()?;
        self.combine(checks)
    }

    /// The namespace's one generation, as every part that announces its tables (each is
    /// nftables objects) reads it; none when one of them knows none.
    fn ruleset_generation(&mut self) -> Option<u32> {
        let mut generation = None;
        for part in self.parts().filter(|p| p.announced_tables().is_some()) {
            generation = Some(part.ruleset_generation()?);
        }
        generation
    }

    /// Reads back only the parts whose tables were announced changed, and those that announce
    /// nothing; the others count as matching (they did at the last read-back, and nothing of
    /// theirs changed since).
    fn check_changed(&mut self, rules: &RuleSet, changed: &[TableRef]) -> Result<Check, Error> {
        let checks = self
            .parts()
            .map(|p| match p.announced_tables() {
                Some(tables) if !tables.iter().any(|t| changed.contains(&t.table)) => {
                    Ok(Check::Matches)
                }
                _ => p.check_changed(rules, changed),
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.combine(checks)
    }

    fn reply_packets(&mut self) -> Result<Option<u64>, Error> {
        self.switch.reply_packets()
    }

    /// The fallback is the switching part's.
    fn trial(&mut self, rules: &RuleSet) -> Result<(), Error> {
        self.switch.trial(rules)
    }

    fn fallback_leased(&self) -> bool {
        self.switch.fallback_leased()
    }

    fn last_commit(&self) -> Option<Duration> {
        self.switch.last_commit()
    }

    fn reader(&self) -> Result<Box<dyn Dataplane>, Error> {
        let accepts = self.accepts.iter().map(|d| d.reader()).collect::<Result<_, _>>()?;
        Ok(Box::new(Layered::new(self.switch.reader()?, accepts)))
    }

    fn remove(&mut self) -> Result<(), Error> {
        // Every part, even after a failure, then the first failure.
        let mut first = Ok(());
        for part in self.parts() {
            let result = part.remove();
            if first.is_ok() {
                first = result;
            }
        }
        first
    }
}

impl Layered {
    /// One check from the parts' checks, in the order of [`Layered::parts`].
    fn combine(&mut self, checks: Vec<Check>) -> Result<Check, Error> {
        if let Some(differs) = checks.iter().find(|c| matches!(c, Check::Differs(_))) {
            return Ok(differs.clone());
        }
        Ok(if checks.iter().all(|c| *c == Check::Missing) {
            Check::Missing
        } else if checks.iter().all(|c| *c == Check::Matches) {
            Check::Matches
        } else {
            let missing: Vec<_> = self
                .parts()
                .zip(&checks)
                .filter(|(_, c)| **c == Check::Missing)
                .map(|(p, _)| p.name())
                .collect();
            Check::Differs(format!("missing in {}", missing.join(", ")))
        })
    }
}

#[cfg(test)]
#[forbid(unsafe_code)]
mod tests {
    use super::fake::FakeDataplane;
    use super::*;

    fn addrs() -> ListenAddrs {
        ListenAddrs {
            local: vec!["169.254.20.10".parse().unwrap()],
            cluster_dns: vec!["10.96.0.10".parse().unwrap()],
        }
    }

    #[test]
    fn layered_never_installs_local_notrack_without_its_accepts() {
        let (switch, accepts) = (FakeDataplane::default(), FakeDataplane::default());
        let mut layered = Layered::new(Box::new(switch.clone()), vec![Box::new(accepts.clone())]);
        let shape = Shape { accepts: true, ..Shape::default() };
        let local = plan(&addrs(), Route::Local, shape);
        assert!(local.steers_to_cache());
        assert_eq!(layered.check(&local).unwrap(), Check::Missing);

        // Towards Local, a failed ACCEPT part stops the change before the NOTRACK goes in: the
        // switching part gets the Upstream ruleset, which steers nothing to the cache.
        let upstream = plan(&addrs(), Route::Upstream, shape);
        assert_eq!(local.clone().without_cache_steering(), upstream);
        accepts.kernel().fail_next_apply = true;
        assert!(layered.apply(&local).is_err());
        assert_eq!(switch.kernel().installed.as_ref(), Some(&upstream), "NOTRACK without ACCEPTs");
        assert_eq!(accepts.kernel().installed, None);

        layered.apply(&local).unwrap();
        assert_eq!(layered.check(&local).unwrap(), Check::Matches);
        assert_eq!(installed_route(&mut layered, &addrs(), shape).unwrap(), Some(Route::Local));

        // A switch after a complete apply leaves the ACCEPTs (the same in both routes) alone:
        // a held xtables lock cannot touch it.
        assert!(!upstream.steers_to_cache());
        let before = accepts.kernel().applies;
        accepts.kernel().fail_next_apply = true;
        layered.apply(&upstream).unwrap();
        assert_eq!(accepts.kernel().applies, before, "the ACCEPTs were rewritten");
        assert_eq!(switch.kernel().installed.as_ref(), Some(&upstream));

        // A repair (the same ruleset again) rewrites every part; towards Upstream the
        // switching part goes first, so a failed ACCEPT does not delay it.
        switch.kernel().installed = None;
        assert!(layered.apply(&upstream).is_err());
        assert_eq!(switch.kernel().installed.as_ref(), Some(&upstream));
        // After a failure nothing is taken for granted: the next switch rewrites the ACCEPTs.
        layered.apply(&local).unwrap();
        assert_eq!(accepts.kernel().applies, before + 1);

        layered.remove().unwrap();
        assert_eq!(layered.check(&local).unwrap(), Check::Missing);
    }

    #[test]
    fn layered_reads_back_only_the_parts_announced_changed() {
        let (switch, accepts) = (FakeDataplane::default(), FakeDataplane::default());
        accepts.kernel().announces = true;
        let mut layered = Layered::new(Box::new(switch.clone()), vec![Box::new(accepts.clone())]);
        let rules = plan(&addrs(), Route::Local, Shape { accepts: true, ..Shape::default() });
        layered.apply(&rules).unwrap();
        let fake_table = TableRef { family: 1, name: "fake".to_owned() };
        let other = TableRef { family: 2, name: "nat".to_owned() };
        accepts.kernel().installed = None;
        // Another table changed: the announced part is not read (its change would have been
        // announced); the part that announces nothing always is.
        let before = (switch.kernel().checks, accepts.kernel().checks);
        assert_eq!(layered.check_changed(&rules, &[other]).unwrap(), Check::Matches);
        assert_eq!(switch.kernel().checks, before.0 + 1);
        assert_eq!(accepts.kernel().checks, before.1);
        assert_eq!(
            layered.check_changed(&rules, &[fake_table]).unwrap(),
            Check::Differs("missing in fake".into())
        );
    }
}
