//! Dataplane backends: install a [`RuleSet`] atomically, read it back, remove it.
//!
//! Every backend owns its objects outright (for nftables, one table) and replaces them whole in
//! one transaction, so a ruleset on the node is always exactly one that [`RuleSet::desired`]
//! produced, never a mix.

#[cfg(test)]
pub mod fake;
pub mod nftables;

use crate::ruleset::{ListenAddrs, Route, RuleSet};

/// What a dataplane failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The nftables backend failed.
    #[error(transparent)]
    Nftables(#[from] nftables::Error),
    /// Injected by the fake dataplane in tests.
    #[cfg(test)]
    #[error("injected failure: {0}")]
    Injected(&'static str),
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
pub trait Dataplane {
    /// Short name for logs and status, e.g. `nftables`.
    fn name(&self) -> &'static str;
    /// Replaces whatever the agent has installed with `rules`, in one atomic transaction, then
    /// reads it back: `Ok` only when the kernel holds exactly `rules`.
    fn apply(&mut self, rules: &RuleSet) -> Result<(), Error>;
    /// Reads back what is installed and compares it with `rules`.
    fn check(&mut self, rules: &RuleSet) -> Result<Check, Error>;
    /// Removes everything the agent installed; `Ok` when nothing was.
    fn remove(&mut self) -> Result<(), Error>;
}

/// The route whose ruleset is installed now, if the installed state is exactly one of them.
pub fn installed_route(
    dp: &mut dyn Dataplane,
    addrs: &ListenAddrs,
) -> Result<Option<Route>, Error> {
    for route in [Route::Local, Route::Upstream] {
        if dp.check(&RuleSet::desired(addrs, route))? == Check::Matches {
            return Ok(Some(route));
        }
    }
    Ok(None)
}
