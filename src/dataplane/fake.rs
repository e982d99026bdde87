//! A stateful in-memory dataplane for tests of the agent's logic.
//!
//! Like knftables' fake: a transaction is applied to a copy and kept only when it succeeds, so
//! tests can inject failures and tamper with the "kernel" state as another process would.

use super::{Check, Dataplane, Error};
use crate::ruleset::RuleSet;

/// In-memory dataplane.
#[derive(Debug, Default)]
pub struct FakeDataplane {
    /// What the fake kernel holds.
    pub installed: Option<RuleSet>,
    /// When set, the next `apply` fails and changes nothing.
    pub fail_next_apply: bool,
    /// How many `apply` calls succeeded.
    pub applies: usize,
}

impl Dataplane for FakeDataplane {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn apply(&mut self, rules: &RuleSet) -> Result<(), Error> {
        if std::mem::take(&mut self.fail_next_apply) {
            return Err(Error::Injected("apply"));
        }
        self.installed = Some(rules.clone());
        self.applies += 1;
        Ok(())
    }

    fn check(&mut self, rules: &RuleSet) -> Result<Check, Error> {
        Ok(match &self.installed {
            None => Check::Missing,
            Some(installed) if installed == rules => Check::Matches,
            Some(_) => Check::Differs("installed ruleset differs".to_owned()),
        })
    }

    fn remove(&mut self) -> Result<(), Error> {
        self.installed = None;
        Ok(())
    }
}
