//! A stateful in-memory dataplane for tests of the agent's logic.
//!
//! Like knftables' fake: a transaction either applies whole or fails and changes nothing, and a
//! test keeps a clone of the handle to look at the fake kernel or tamper with it as another
//! process would. Its reader is another clone: a check can be held in flight ([`Gate`]) on
//! another thread while the agent applies.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{Check, Dataplane, Error, TableRef, TableWatch};
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
    /// How many `check` calls ran (counted when they start).
    pub checks: usize,
    /// When set, the next `check` fails (a read-back that went wrong) and reads nothing.
    pub fail_next_check: bool,
    /// Whether the fake's changes are announced, like an nftables table's.
    pub announces: bool,
    /// When set, a `check` waits for the gate to open before it reads the kernel: a slow
    /// read-back (`iptables-nft-save` on a node with 50,000 rules), held as long as a test wants.
    pub gate: Option<Arc<Gate>>,
    /// What `reply_packets` reads: the cache's replies counted so far, or `None` (uncounted).
    pub replies: Option<u64>,
    /// Whether `unchanged` can tell a ruleset installed as wanted at once, as iptables-legacy's
    /// copies of its tables can.
    pub copies: bool,
    /// How many `unchanged` calls told it at once.
    pub unchanged: usize,
    /// The ruleset generation `ruleset_generation` reports (`None`: none known); each apply
    /// and removal moves it, as a commit does; a test moves it for another tool's change.
    pub generation: Option<u32>,
}

/// A gate that held checks wait at, until it is opened.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    open: bool,
    waiting: usize,
}

impl Gate {
    /// Lets every held check (and every later one) through.
    pub fn open(&self) {
        self.state.lock().unwrap().open = true;
        self.changed.notify_all();
    }

    /// Blocks until `n` checks wait at the gate.
    pub fn wait_for_waiting(&self, n: usize) {
        let state = self.state.lock().unwrap();
        drop(self.changed.wait_while(state, |s| s.waiting < n).unwrap());
    }

    fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        state.waiting += 1;
        self.changed.notify_all();
        drop(self.changed.wait_while(state, |s| !s.open).unwrap());
    }
}

/// In-memory dataplane; clones share one fake kernel.
#[derive(Clone, Debug, Default)]
pub struct FakeDataplane(Arc<Mutex<FakeKernel>>);

impl FakeDataplane {
    /// A fake kernel that holds `installed`.
    pub fn holding(installed: RuleSet) -> FakeDataplane {
        let fake = FakeDataplane::default();
        fake.kernel().installed = Some(installed);
        fake
    }

    /// The fake kernel.
    pub fn kernel(&self) -> MutexGuard<'_, FakeKernel> {
        self.0.lock().unwrap()
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
        kernel.generation = kernel.generation.map(|g| g + 1);
        Ok(())
    }

    fn reply_packets(&mut self) -> Result<Option<u64>, Error> {
        Ok(self.kernel().replies)
    }

    fn check(&mut self, rules: &RuleSet) -> Result<Check, Error> {
        let gate = {
            let mut kernel = self.kernel();
            kernel.checks += 1;
            if std::mem::take(&mut kernel.fail_next_check) {
                return Err(Error::Injected("check"));
            }
            kernel.gate.clone()
        };
        // Held without the kernel's lock: applies go on meanwhile, as on a real node.
        if let Some(gate) = gate {
            gate.pass();
        }
        Ok(match &self.kernel().installed {
            None => Check::Missing,
            Some(installed) if installed == rules => Check::Matches,
            Some(_) => Check::Differs("installed ruleset differs".to_owned()),
        })
    }

    fn unchanged(&mut self, rules: &RuleSet) -> Option<Check> {
        let mut kernel = self.kernel();
        let told = kernel.copies && kernel.installed.as_ref() == Some(rules);
        kernel.unchanged += usize::from(told);
        told.then_some(Check::Matches)
    }

    fn announced_tables(&self) -> Option<Vec<TableWatch>> {
        let fake = TableRef { family: 1, name: "fake".to_owned() };
        self.kernel().announces.then(|| vec![TableWatch::whole(fake)])
    }

    fn remove(&mut self) -> Result<(), Error> {
        let mut kernel = self.kernel();
        kernel.installed = None;
        kernel.generation = kernel.generation.map(|g| g + 1);
        Ok(())
    }

    fn ruleset_generation(&mut self) -> Option<u32> {
        self.kernel().generation
    }

    fn reader(&self) -> Result<Box<dyn Dataplane>, Error> {
        Ok(Box::new(self.clone()))
    }
}
