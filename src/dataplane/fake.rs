//! A stateful in-memory dataplane for tests of the agent's logic.
//!
//! Like knftables' fake: a transaction either applies whole or fails and changes nothing, and a
//! test keeps a clone of the handle to look at the fake kernel or tamper with it as another
//! process would.

use std::cell::{RefCell, RefMut};
use std::rc::Rc;

use super::{Check, Dataplane, Error};
use crate::ruleset::RuleSet;

/// What the fake kernel holds, and knobs for tests.
#[derive(Debug, Default)]
pub struct FakeKernel {
    /// The installed ruleset.
    pub installed: Option<RuleSet>,
    /// When set, the next `apply` fails and changes nothing.
    pub fail_next_apply: bool,
    /// So many `apply` calls fail (after `fail_next_apply`), changing nothing.
    pub fail_applies: usize,
    /// How many `apply` calls succeeded.
    pub applies: usize,
    /// How many `check` calls ran.
    pub checks: usize,
    /// Whether the fake's changes are announced, like an nftables table's.
    pub announces: bool,
}

/// In-memory dataplane; clones share one fake kernel.
#[derive(Clone, Debug, Default)]
pub struct FakeDataplane(Rc<RefCell<FakeKernel>>);

impl FakeDataplane {
    /// A fake kernel that holds `installed`.
    pub fn holding(installed: RuleSet) -> FakeDataplane {
        let fake = FakeDataplane::default();
        fake.kernel().installed = Some(installed);
        fake
    }

    /// The fake kernel.
    pub fn kernel(&self) -> RefMut<'_, FakeKernel> {
        self.0.borrow_mut()
    }
}

impl Dataplane for FakeDataplane {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn apply(&mut self, rules: &RuleSet) -> Result<(), Error> {
        let mut kernel = self.kernel();
        if std::mem::take(&mut kernel.fail_next_apply) {
            return Err(Error::Injected("apply"));
        }
        if kernel.fail_applies > 0 {
            kernel.fail_applies -= 1;
            return Err(Error::Injected("apply"));
        }
        kernel.installed = Some(rules.clone());
        kernel.applies += 1;
        Ok(())
    }

    fn check(&mut self, rules: &RuleSet) -> Result<Check, Error> {
        self.kernel().checks += 1;
        Ok(match &self.kernel().installed {
            None => Check::Missing,
            Some(installed) if installed == rules => Check::Matches,
            Some(_) => Check::Differs("installed ruleset differs".to_owned()),
        })
    }

    fn announced_tables(&self) -> Option<Vec<super::nftables::TableRef>> {
        self.kernel()
            .announces
            .then(|| vec![super::nftables::TableRef { family: 1, name: "fake".to_owned() }])
    }

    fn remove(&mut self) -> Result<(), Error> {
        self.kernel().installed = None;
        Ok(())
    }
}
