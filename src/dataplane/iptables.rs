//! iptables backend: installs a [`RuleSet`] with `iptables-restore`, for nodes whose kube-proxy
//! uses iptables. The switching backend ([`Role::Switch`]) writes the raw table (its NOTRACK
//! chains) and the mangle table (the link-local fallback); an ACCEPT backend ([`Role::Accepts`])
//! writes the filter table.
//!
//! The agent owns its chains in each table, each reached by one jump at the top of a built-in
//! chain: raw `PREROUTING` → `NODELOCALDNS-HA-PREROUTING` and `OUTPUT` →
//! `NODELOCALDNS-HA-OUTPUT`; mangle `PREROUTING` → `NODELOCALDNS-HA-FALLBACK`; filter `INPUT` →
//! `NODELOCALDNS-HA-INPUT` and `OUTPUT` → `NODELOCALDNS-HA-OUTPUT`. The jumps carry the comment
//! `nodelocaldns-ha`. (Chain names are per table in both flavours, iptables-nft's tables being
//! nftables tables of their own; the fallback's is named for what it is, not for its hook.)
//!
//! * [`Iptables::apply`] reads each of its tables with `iptables-save -t <table>`, then runs
//!   **one** `iptables-restore --noflush` per address family holding a `*<table> … COMMIT`
//!   section per table: it declares the agent's chains (which creates or flushes them), appends
//!   their rules, and, unless the jump is already the first rule and the only one, deletes every
//!   copy of the jump and inserts it at position 1, in the same section. So the jump is exactly
//!   once and first, atomically with the chain contents; there is no per-rule `-C`/`-I` loop
//!   (node-cache's duplicate rules, kubernetes/dns #568). A family (or table) the ruleset has no
//!   rules for is cleaned of the agent's objects. Then the tables are read back.
//! * [`Iptables::check`] parses `iptables-save -t <table>` and compares text lines: the rules are
//!   written exactly in the form `iptables-save` prints them ([`render`] shows them).
//!   iptables-legacy's tables announce no change, so a check runs every third tick
//!   (`reconciler::LOOK_UNANNOUNCED`); a save on every tick was 30 child processes a second on
//!   an idle node. The kernel hands out a legacy table
//!   in-process (`snapshot`, what `iptables-legacy-save` reads, counters zeroed): a table whose
//!   snapshot is the one taken around its last read-back would print the same again, and that
//!   read-back's outcome stands. A read-back runs when a table changed (anyone's change: a
//!   CNI's rule in front of the jump, kube-proxy's filter sync), and every
//!   [`FULL_READ_EVERY`] regardless, as a safety net.
//! * [`Iptables::remove`] deletes every jump to the agent's chains, then flushes and deletes the
//!   chains, in one `iptables-restore` per family; nothing runs when nothing is there.
//!
//! A section is atomic; a script of several is not. Both iptables-legacy-restore and
//! iptables-nft-restore (1.8.9) commit at each `COMMIT`, in order, and stop at the first section
//! that fails, leaving the ones before it committed (measured: a raw section and then a mangle
//! section with an unknown match leave the raw one in, in both flavours). IPv4 and IPv6 are
//! separate programs. So the switching backend orders its sections so that every prefix of a
//! script is a state the node can live on:
//!
//! * apply: raw, then mangle. A route switch changes both (the cluster-DNS NOTRACK in raw, the
//!   fallback's socket guard in mangle); raw first means a mangle section the kernel refuses
//!   (no xt_TPROXY) never holds back the cluster-DNS failover, and either half alone is safe:
//!   the link-local IP reaches the cache or the forwarder in both of its routes.
//! * remove: mangle, then raw. The fallback TPROXYs to the agent's forwarder, which goes with
//!   the agent; raw's NOTRACK without it is node-cache's own setup.
//!
//! One program for both tables is one child process, not two, in the way of a switch; it does
//! not make them one transaction: iptables-legacy-restore takes the xtables lock at each
//! `*<table>` and releases it at its `COMMIT` (iptables 1.8), so another writer may get in
//! between, and a lock wait that runs out at mangle leaves raw changed. Whatever stopped a
//! script, the read-back says what is in, and the next apply finishes the job.
//!
//! iptables-legacy serialises writers with the xtables lock (`/run/xtables.lock`, or the file
//! named by `XTABLES_LOCKFILE`, which is passed through). `iptables-legacy-restore` waits for it
//! at most the configured time (`-w`, whole seconds, at least 1: `-w 0` would wait forever) and
//! a timeout there is [`Error::LockBusy`]. iptables-nft takes no lock. Every child process is
//! killed if it outlives the lock wait by 2 s, so the agent never hangs on iptables.
//!
//! `flavour` says which iptables ([`Flavour`], which detection uses too) and names its binaries;
//! `text` is the pure half (rendering, parsing, comparing, the restore scripts); `command` runs
//! the child processes; `snapshot` copies a legacy table out of the kernel; `replies` counts
//! the cache's replies. This file is past 600 lines: what is left is the backend's own
//! sequence (apply, read back, check, remove, each per family and table), which reads best in
//! one place.

mod command;
mod error;
mod flavour;
mod lease_rules;
mod replies;
mod snapshot;
mod table;
mod text;

use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use super::{Check, Dataplane, TableRef, TableWatch};
use crate::ruleset::RuleSet;
use command::{Finished, RunError};
use snapshot::Snapshot;
use table::{describe, Family};
use text::{Saved, State};

pub use error::Error;
use error::{classify, summary};
pub use flavour::{Flavour, Tool};
pub use snapshot::{legacy_tables as legacy_snapshot, LegacyTables};
pub use table::{legacy_tables, Role, Table};
pub use text::ParseError;

/// Where the binaries are looked for after `PATH` (a service's `PATH` may lack the sbin dirs).
const FALLBACK_DIRS: [&str; 3] = ["/usr/sbin", "/sbin", "/usr/local/sbin"];
/// How much longer than the lock wait a child process may run before it is killed.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How long an iptables-legacy check trusts a read-back whose table has not changed since (its
/// [`Snapshot`] the same): after that it reads back all the same ([`super::FULL_READ_EVERY`]:
/// the snapshot is the blob a save prints).
pub const FULL_READ_EVERY: Duration = super::FULL_READ_EVERY;

/// The binaries for one address family.
#[derive(Clone, Debug)]
struct Binaries {
    restore: Binary,
    save: Binary,
    /// `iptables-nft` itself, for chain-scoped listings (`-S <chain>`); `None` for legacy.
    list: Option<Binary>,
}

/// A binary, found.
#[derive(Clone, Debug)]
struct Binary {
    name: &'static str,
    path: PathBuf,
}

/// The iptables dataplane: owns the agent's chains of its [`Role`]'s tables, in IPv4 and IPv6.
#[derive(Clone, Debug)]
pub struct Iptables {
    flavour: Flavour,
    role: Role,
    /// `-w` for `iptables-legacy-restore`: whole seconds, at least 1.
    lock_wait_secs: u64,
    /// Indexed like [`Family::ALL`].
    binaries: [Binaries; 2],
    /// What this backend's last apply found in each family and table when it read back
    /// (indexed like [`Family::ALL`], then [`Table::ALL`]): lets the next apply go straight to
    /// its transaction.
    verified: [[Verified; 3]; 2],
    /// The families the kernel has: IPv4, and IPv6 unless it was booted with
    /// `ipv6.disable=1` (then `ip6tables-*` fail, and there is nothing of ours to find there).
    families: Vec<Family>,
    /// iptables-legacy: each family's tables as the last check's read-back found them (indexed
    /// like `verified`), while they have not changed since.
    seen: [[Option<Seen>; 3]; 2],
    /// How long a [`Seen`] stands ([`FULL_READ_EVERY`]).
    full_read_every: Duration,
    /// iptables-legacy: what its checks read the kernel's copies of the tables through.
    kernel: snapshot::Kernel,
    /// The ruleset [`Iptables::unchanged_legacy`] last looked for, and what each family's
    /// tables (indexed like `seen`) should hold of it: rendered once a ruleset, not every tick.
    wanted: Option<(RuleSet, [[Option<text::Wanted>; 3]; 2])>,
    /// Tables read back (saved or listed) by checks so far.
    read_backs: u64,
}

/// A check's read-back of one iptables-legacy table, and the table as the kernel held it then.
#[derive(Clone, Debug)]
struct Seen {
    /// Taken before the read-back and again after it, the same both times.
    snapshot: Snapshot,
    /// What the table was compared with.
    wanted: Option<text::Wanted>,
    /// What it found.
    state: State,
    /// When.
    at: Instant,
}

/// What an apply's read-back found in one family's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verified {
    /// Not read back yet, or not as wanted.
    Unknown,
    /// The agent's chains, each jumped to once, first.
    Placed,
    /// Nothing of the agent's.
    Empty,
}

/// One family's table as read back: `(family, table, wanted, state)`, `wanted` saying whether
/// the ruleset has rules there.
type TableState = (Family, Table, bool, State);

impl Iptables {
    /// A backend for `role` through `flavour`'s binaries, which must be installed. It waits at
    /// most `lock_wait` (rounded up to whole seconds, at least 1) for the xtables lock.
    pub fn new(flavour: Flavour, role: Role, lock_wait: Duration) -> Result<Self, Error> {
        let dirs = search_dirs();
        let find = |family, tool| find_binary(flavour.binary(family, tool), &dirs);
        let binaries = |family| -> Result<Binaries, Error> {
            Ok(Binaries {
                restore: find(family, Tool::Restore)?,
                save: find(family, Tool::Save)?,
                list: match flavour {
                    Flavour::Nft => Some(find(family, Tool::List)?),
                    Flavour::Legacy => None,
                },
            })
        };
        Ok(Iptables {
            flavour,
            role,
            lock_wait_secs: lock_wait_secs(lock_wait),
            binaries: [binaries(Family::V4)?, binaries(Family::V6)?],
            verified: [[Verified::Unknown; 3]; 2],
            families: kernel_families(),
            seen: Default::default(),
            full_read_every: FULL_READ_EVERY,
            kernel: snapshot::Kernel::default(),
            wanted: None,
            read_backs: 0,
        })
    }

    /// The iptables flavour it writes through.
    pub fn flavour(&self) -> Flavour {
        self.flavour
    }

    /// The share of the ruleset it installs.
    pub fn role(&self) -> Role {
        self.role
    }

    fn binaries(&self, family: Family) -> &Binaries {
        &self.binaries[family.index()]
    }

    fn verified(&self, family: Family, table: Table) -> Verified {
        self.verified[family.index()][table.index()]
    }

    /// Tables its checks have read back (with `iptables-save`, or `iptables-nft -S`) so far: on
    /// iptables-legacy, only those that changed, and every [`FULL_READ_EVERY`].
    pub fn read_backs(&self) -> u64 {
        self.read_backs
    }

    /// How long a child process may run.
    fn limit(&self) -> Duration {
        Duration::from_secs(self.lock_wait_secs) + KILL_GRACE
    }

    /// What the agent's objects of `family` in `table` are compared with: its chains and the
    /// built-in chains that jump to them. iptables-legacy: `iptables-legacy-save -t <table>`
    /// (the kernel hands out that table alone). iptables-nft: `iptables-nft -t <table> -S
    /// <chain>` for each of those chains, which fetches only that chain's rules;
    /// `iptables-nft-save -t <table>` (and `-S` without a chain) fetch every table's chains of
    /// the family, about 0.3 s with kube-proxy's 50,000 nat rules instead of a few ms. So a
    /// read-back costs the same on every node; a jump to the agent's chains from another user
    /// chain goes unseen (only [`Iptables::remove`] looks for those, with a whole save).
    fn read(&self, family: Family, table: Table) -> Result<Saved, Error> {
        let Some(list) = &self.binaries(family).list else {
            return self.save(family, table);
        };
        let name = table.as_str();
        let mut listed = String::new();
        for hooked in table.hooks() {
            for chain in [hooked.builtin, hooked.own] {
                let done = self.run(list, &["-t", name, "-S", chain], None, describe(&[table]))?;
                if done.status.success() {
                    listed.push_str(&done.stdout);
                } else if !(chain == hooked.own && text::no_such_chain(&done.stderr, chain)) {
                    return Err(Error::SaveFailed {
                        binary: list.name,
                        table: name,
                        status: done.status,
                        stderr: summary(&done.stderr),
                    });
                }
            }
        }
        text::parse_listing(&listed, name).map_err(|source| Error::Unparsable {
            binary: list.name,
            table: name,
            source,
        })
    }

    /// `iptables-save -t <table>` for `family`, parsed. An iptables-legacy table the kernel does
    /// not list ([`legacy_tables`]) holds nothing, and saving it would create it: not named.
    fn save(&self, family: Family, table: Table) -> Result<Saved, Error> {
        if self.flavour == Flavour::Legacy && table.unlisted_in_legacy(family) {
            return Ok(Saved::default());
        }
        let binary = &self.binaries(family).save;
        let name = table.as_str();
        let done = self.run(binary, &["-t", name], None, describe(&[table]))?;
        if !done.status.success() {
            return Err(Error::SaveFailed {
                binary: binary.name,
                table: name,
                status: done.status,
                stderr: summary(&done.stderr),
            });
        }
        text::parse_save(&done.stdout, name).map_err(|source| Error::Unparsable {
            binary: binary.name,
            table: name,
            source,
        })
    }

    /// Runs `script`, whose sections change `tables`, as one `iptables-restore --noflush` for
    /// `family`.
    fn restore(&self, family: Family, script: &str, tables: &[Table]) -> Result<(), Error> {
        let binary = &self.binaries(family).restore;
        let wait = self.lock_wait_secs.to_string();
        let mut args = vec!["--noflush"];
        // iptables-nft-restore takes no lock (it accepts -w and ignores it). -W is left out:
        // iptables 1.8.9 ignores it with a warning.
        if self.flavour == Flavour::Legacy {
            args.extend(["-w", wait.as_str()]);
        }
        let tables = describe(tables);
        let done = self.run(binary, &args, Some(script), tables)?;
        classify(binary.name, tables, &done, Duration::from_secs(self.lock_wait_secs), script)
    }

    /// Runs `binary`, which works on `tables` (in words, for a timeout's message).
    fn run(
        &self,
        binary: &Binary,
        args: &[&str],
        input: Option<&str>,
        tables: &'static str,
    ) -> Result<Finished, Error> {
        let limit = self.limit();
        command::run(&binary.path, args, input, limit).map_err(|error| match error {
            RunError::Io(source) => Error::Spawn { binary: binary.name, source },
            RunError::TimedOut => Error::Timeout { binary: binary.name, tables, limit },
        })
    }

    /// Brings `family` to `rules`: each table its share installed, or nothing of the agent's
    /// where the ruleset has no rules. One `iptables-restore` for all of the family's tables,
    /// none when they already are.
    ///
    /// With `trusting`, a table whose last read-back found it as wanted (the jumps in place, or
    /// nothing there) is not read first: its chains are only refilled (or it is left alone),
    /// so a switch is one `iptables-restore` whatever the node holds. The read-back after it
    /// tells whether that was enough. Returns whether it trusted any table.
    fn apply_family(&self, family: Family, rules: &RuleSet, trusting: bool) -> Result<bool, Error> {
        let mut script = String::new();
        let mut changed = Vec::new();
        let mut trusted = false;
        for &table in self.role.tables() {
            let wanted = text::wanted(rules, table, family);
            let section = match (trusting, &wanted, self.verified(family, table)) {
                (true, Some(wanted), Verified::Placed) => {
                    trusted = true;
                    Some(text::fill_script(table, wanted))
                }
                (true, None, Verified::Empty) => {
                    trusted = true;
                    None
                }
                _ => self.section(family, table, wanted.as_ref())?,
            };
            if let Some(section) = section {
                script.push_str(&section);
                changed.push(table);
            }
        }
        if !script.is_empty() {
            self.restore(family, &script, &changed)?;
        }
        Ok(trusted)
    }

    /// The restore section that brings `family`'s `table` to `wanted`, having read it; `None`
    /// when it already is.
    fn section(
        &self,
        family: Family,
        table: Table,
        wanted: Option<&text::Wanted>,
    ) -> Result<Option<String>, Error> {
        let saved = self.read(family, table)?;
        Ok(match wanted {
            None => text::remove_script(table, &saved),
            Some(wanted) => match text::compare(table, family, &saved, Some(wanted)) {
                State::Matches => None,
                State::Nothing | State::Differs(_) => {
                    Some(text::apply_script(table, &saved, wanted))
                }
            },
        })
    }

    /// Reads back the family's tables `read` picks; the others count as holding their share
    /// (or nothing, when they have none), as at the last read-back.
    /// An iptables-legacy table whose [`Snapshot`] is unchanged since the last read-back (within
    /// [`FULL_READ_EVERY`]) is not read again.
    fn check_some(
        &mut self,
        rules: &RuleSet,
        read: impl Fn(Family, Table) -> bool,
    ) -> Result<Check, Error> {
        let families = self.families.clone();
        let mut states = Vec::new();
        for family in families {
            // iptables-legacy's list of the family's tables, read once for all of them.
            let listed =
                (self.flavour == Flavour::Legacy).then(|| self.kernel.listed(family)).flatten();
            for &table in self.role.tables() {
                let wanted = text::wanted(rules, table, family);
                let has_rules = wanted.is_some();
                let state = if read(family, table) {
                    let unlisted =
                        listed.as_ref().is_some_and(|l| !l.iter().any(|n| n == table.as_str()));
                    self.read_back(family, table, wanted, unlisted)?
                } else if has_rules {
                    State::Matches
                } else {
                    State::Nothing
                };
                states.push((family, table, has_rules, state));
            }
        }
        Ok(text::combine(states))
    }

    /// How `family`'s `table` compares with `wanted`, for a check: read back, unless it is an
    /// iptables-legacy table the kernel holds exactly as at the last read-back, not long ago, or
    /// one it does not list (`unlisted`: it holds nothing).
    fn read_back(
        &mut self,
        family: Family,
        table: Table,
        wanted: Option<text::Wanted>,
        unlisted: bool,
    ) -> Result<State, Error> {
        let (f, t) = (family.index(), table.index());
        let legacy = self.flavour == Flavour::Legacy;
        // Not named unless listed (naming it creates it): it holds nothing.
        if legacy && unlisted {
            self.seen[f][t] = None;
            return Ok(text::compare(table, family, &Saved::default(), wanted.as_ref()));
        }
        let before = legacy.then(|| self.kernel.take(family, table).ok()).flatten();
        if let Some(state) =
            before.as_ref().and_then(|now| self.seen_as(family, table, now, &wanted))
        {
            return Ok(state);
        }
        self.seen[f][t] = None;
        let at = Instant::now();
        let saved = self.read(family, table)?;
        self.read_backs += 1;
        let state = text::compare(table, family, &saved, wanted.as_ref());
        // Kept only when nothing changed while the save ran: what it printed is then exactly
        // what the snapshot holds.
        let after = before.as_ref().and_then(|_| self.kernel.take(family, table).ok());
        if let (Some(snapshot), Some(after)) = (before, after) {
            if snapshot == after {
                let state = state.clone();
                self.seen[f][t] = Some(Seen { snapshot, wanted, state, at });
            }
        }
        Ok(state)
    }

    /// What the last read-back of `family`'s `table` found, if the kernel holds it as then
    /// (`now`), it was compared with `wanted`, and not long ago ([`FULL_READ_EVERY`]).
    fn seen_as(
        &self,
        family: Family,
        table: Table,
        now: &Snapshot,
        wanted: &Option<text::Wanted>,
    ) -> Option<State> {
        let seen = self.seen[family.index()][table.index()].as_ref()?;
        let fresh = seen.at.elapsed() < self.full_read_every;
        (seen.snapshot == *now && seen.wanted == *wanted && fresh).then(|| seen.state.clone())
    }

    /// [`Dataplane::unchanged`] for iptables-legacy: every table as at its last read-back, by
    /// the kernel's copy of each (a table the kernel does not list holds nothing); `None`
    /// for iptables-nft, or when one is not.
    fn unchanged_legacy(&mut self, rules: &RuleSet) -> Option<Check> {
        if self.flavour != Flavour::Legacy {
            return None;
        }
        if self.wanted.as_ref().is_none_or(|(for_rules, _)| for_rules != rules) {
            let mut wanted: [[Option<text::Wanted>; 3]; 2] = Default::default();
            for family in Family::ALL {
                for table in Table::ALL {
                    wanted[family.index()][table.index()] = text::wanted(rules, table, family);
                }
            }
            self.wanted = Some((rules.clone(), wanted));
        }
        let (_, all_wanted) = self.wanted.as_ref()?;
        let mut states = Vec::new();
        for &family in &self.families {
            let listed = self.kernel.listed(family)?;
            for &table in self.role.tables() {
                let wanted = &all_wanted[family.index()][table.index()];
                let has_rules = wanted.is_some();
                let state = if listed.iter().any(|n| n == table.as_str()) {
                    let now = self.kernel.take(family, table).ok()?;
                    self.seen_as(family, table, &now, wanted)?
                } else {
                    text::compare(table, family, &Saved::default(), wanted.as_ref())
                };
                states.push((family, table, has_rules, state));
            }
        }
        let check = text::combine(states);
        (check == Check::Matches).then_some(check)
    }

    /// Each family's tables' states, each read back.
    fn states(&self, rules: &RuleSet) -> Result<Vec<TableState>, Error> {
        let mut states = Vec::new();
        for &family in &self.families {
            for &table in self.role.tables() {
                let wanted = text::wanted(rules, table, family);
                let saved = self.read(family, table)?;
                let state = text::compare(table, family, &saved, wanted.as_ref());
                states.push((family, table, wanted.is_some(), state));
            }
        }
        Ok(states)
    }

    /// Every family's tables emptied of the agent's objects, the tables in reverse order of
    /// [`Role::tables`], one `iptables-restore` per family.
    fn remove_families(&self) -> Result<(), Error> {
        for &family in &self.families {
            let mut script = String::new();
            let mut changed = Vec::new();
            for &table in self.role.tables().iter().rev() {
                if let Some(section) = text::remove_script(table, &self.save(family, table)?) {
                    script.push_str(&section);
                    changed.push(table);
                }
            }
            if !script.is_empty() {
                self.restore(family, &script, &changed)?;
            }
        }
        Ok(())
    }
}

impl Dataplane for Iptables {
    fn name(&self) -> &'static str {
        self.flavour.backend_name(self.role)
    }

    fn apply(&mut self, rules: &RuleSet) -> Result<(), super::Error> {
        let tables = self.role.tables();
        if let Some(comment) = tables.iter().find_map(|&t| text::unstorable_comment(rules, t)) {
            return Err(Error::Comment(comment.to_owned()).into());
        }
        let wants =
            |family: Family| tables.iter().any(|&t| text::wanted(rules, t, family).is_some());
        if let Some(&missing) =
            Family::ALL.iter().find(|f| !self.families.contains(f) && wants(**f))
        {
            return Err(Error::FamilyMissing { family: missing.label() }.into());
        }
        let families = self.families.clone();
        let mut trusted = false;
        for &family in &families {
            trusted |= self.apply_family(family, rules, true)?;
        }
        let mut states = self.states(rules)?;
        let as_wanted = |states: &[TableState]| {
            states.iter().all(|(_, _, wanted, state)| {
                *state == if *wanted { State::Matches } else { State::Nothing }
            })
        };
        if trusted && !as_wanted(&states) {
            // Someone moved or removed a jump since: read, then change what is needed.
            for &family in &families {
                self.apply_family(family, rules, false)?;
            }
            states = self.states(rules)?;
        }
        for (family, table, wanted, state) in &states {
            self.verified[family.index()][table.index()] = match (wanted, state) {
                (true, State::Matches) => Verified::Placed,
                (false, State::Nothing) => Verified::Empty,
                _ => Verified::Unknown,
            };
        }
        let wants_any = Family::ALL.iter().any(|&f| wants(f));
        match text::combine(states) {
            Check::Matches => Ok(()),
            Check::Missing if !wants_any => Ok(()),
            Check::Missing => {
                Err(Error::NotApplied { difference: "nothing of the agent's is there".to_owned() }
                    .into())
            }
            Check::Differs(difference) => Err(Error::NotApplied { difference }.into()),
        }
    }

    /// iptables-legacy: a table read back once is read again when the kernel holds it otherwise
    /// ([`Snapshot`]), or after [`FULL_READ_EVERY`].
    fn check(&mut self, rules: &RuleSet) -> Result<Check, super::Error> {
        Ok(self.check_some(rules, |_, _| true)?)
    }

    /// iptables-nft: the families' tables announced changed (kube-proxy's filter churn in IPv4
    /// costs no IPv6 read-back, and no mangle one). iptables-legacy announces nothing: all, as
    /// [`Iptables::check`] (each read back only if it changed).
    fn check_changed(
        &mut self,
        rules: &RuleSet,
        changed: &[TableRef],
    ) -> Result<Check, super::Error> {
        if self.flavour == Flavour::Legacy {
            return self.check(rules);
        }
        let announced = |family: Family, table: Table| {
            changed.iter().any(|t| t.family == family.nfproto() && t.name == table.as_str())
        };
        Ok(self.check_some(rules, announced)?)
    }

    fn unchanged(&mut self, rules: &RuleSet) -> Option<Check> {
        self.unchanged_legacy(rules)
    }

    /// iptables-legacy's tables announce nothing.
    fn announced_tables(&self) -> Option<Vec<TableWatch>> {
        (self.flavour == Flavour::Nft).then(|| self.role.nft_tables())
    }

    fn remove(&mut self) -> Result<(), super::Error> {
        Ok(self.remove_families()?)
    }

    /// For each family, one `iptables-restore` of the mangle table's trial (`text::trial_script`);
    /// only the switching role has a fallback. A trial that failed between its two commits (the
    /// lock taken by someone else, a timeout, the kernel refusing the rules) would leave its
    /// chain: it is deleted at once, as far as it can be.
    fn trial(&mut self, rules: &RuleSet) -> Result<(), super::Error> {
        if !self.role.tables().contains(&Table::Mangle) {
            return Ok(());
        }
        for family in kernel_families() {
            if let Some(wanted) = text::wanted(rules, Table::Mangle, family) {
                let script = text::trial_script(Table::Mangle, &wanted);
                if let Err(error) = self.restore(family, &script, &[Table::Mangle]) {
                    let cleanup =
                        "*mangle\n-F NODELOCALDNS-HA-TRIAL\n-X NODELOCALDNS-HA-TRIAL\nCOMMIT\n";
                    // Fails harmlessly where the chain is gone or was never made.
                    let _ = self.restore(family, cleanup, &[Table::Mangle]);
                    return Err(error.into());
                }
            }
        }
        Ok(())
    }

    /// Its mangle chain's TPROXY: xt_TPROXY drops a packet no socket takes.
    fn fallback_leased(&self) -> bool {
        self.role.tables().contains(&Table::Mangle)
    }

    /// iptables-nft's rules are nftables objects: their generation is the namespace's, read on a
    /// netlink socket of its own for the call (only the reconciler's safety net asks).
    fn ruleset_generation(&mut self) -> Option<u32> {
        if self.flavour != Flavour::Nft {
            return None;
        }
        super::nftables_generation()
    }

    /// Every call runs its own child processes: a copy is a reader.
    fn reader(&self) -> Result<Box<dyn Dataplane>, super::Error> {
        Ok(Box::new(self.clone()))
    }

    fn reply_packets(&mut self) -> Result<Option<u64>, super::Error> {
        if self.role != Role::Switch {
            return Ok(None);
        }
        let mut total = 0;
        for &family in &self.families {
            let binary = &self.binaries(family).save;
            let done = self.run(binary, &["-c", "-t", "raw"], None, describe(&[Table::Raw]))?;
            if !done.status.success() {
                return Err(Error::SaveFailed {
                    binary: binary.name,
                    table: "raw",
                    status: done.status,
                    stderr: summary(&done.stderr),
                }
                .into());
            }
            total += replies::reply_packets(&done.stdout);
        }
        Ok(Some(total))
    }
}
/// Whether this kernel has IPv6 at all: not on one booted with `ipv6.disable=1`, where every
/// `ip6tables-*` command fails. A family the kernel lacks is absent, not an error.
pub fn kernel_has_ipv6() -> bool {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    match socket(AddressFamily::Inet6, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None) {
        Ok(_) => true,
        Err(errno) => errno != nix::errno::Errno::EAFNOSUPPORT,
    }
}

/// The address families this kernel has: IPv4, and IPv6 unless it was booted with
/// `ipv6.disable=1` (then every `ip6tables-*` command fails, and there is nothing of ours to find
/// there).
fn kernel_families() -> Vec<Family> {
    Family::ALL.into_iter().filter(|&f| f == Family::V4 || kernel_has_ipv6()).collect()
}

/// `PATH`, then [`FALLBACK_DIRS`].
fn search_dirs() -> Vec<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain(FALLBACK_DIRS.iter().map(PathBuf::from)).collect()
}

/// The first executable file `name` in `dirs`.
fn find_binary(name: &'static str, dirs: &[PathBuf]) -> Result<Binary, Error> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    dirs.iter()
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|path| executable(path))
        .map(|path| Binary { name, path })
        .ok_or(Error::NotInstalled { binary: name })
}

/// `-w` takes whole seconds, and `-w 0` waits forever: round up, at least 1.
fn lock_wait_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

/// The agent's share of `rules` for `role`, as `iptables-save -t <table>` prints each of its
/// tables on a node with nothing else in them: the agent's chains, the jumps, the rules; one
/// section per address family with rules. This is what `apply` installs and `check` compares
/// with.
pub fn render(rules: &RuleSet, role: Role) -> String {
    let mut out = String::new();
    for family in Family::ALL {
        let shares =
            role.tables().iter().filter_map(|&t| Some((t, text::wanted(rules, t, family)?)));
        for (i, (table, wanted)) in shares.enumerate() {
            if i == 0 {
                out.push_str(&format!("# {} ({}tables)\n", family.label(), family.prefix()));
            }
            out.push_str(&text::render_family(table, &wanted));
        }
    }
    out
}

/// For the fuzz targets: `text` read as `iptables-save -t <table>` output and compared with both
/// families' share of `rules`, as a check does. Must never panic; a parse that succeeds must
/// keep every declared chain.
#[cfg(fuzzing)]
pub(crate) fn fuzz_saved(text: &str, rules: &RuleSet) {
    for table in Table::ALL {
        let Ok(saved) = text::parse_save(text, table.as_str()) else { continue };
        let declared = text.lines().filter(|l| l.starts_with(':')).count();
        assert!(saved.chains.len() <= declared, "more chains than declarations");
        for family in Family::ALL {
            let wanted = text::wanted(rules, table, family);
            let _ = text::compare(table, family, &saved, wanted.as_ref());
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod fallback_tests;
