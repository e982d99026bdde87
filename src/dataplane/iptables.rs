//! iptables backend: installs a [`RuleSet`] in the raw table (its NOTRACK chains) or the filter
//! table (its ACCEPTs) with `iptables-restore`, for nodes whose kube-proxy uses iptables.
//!
//! The agent owns two chains per table, each reached by one jump at the top of a built-in
//! chain: raw `PREROUTING` → `NODELOCALDNS-HA-PREROUTING` and `OUTPUT` →
//! `NODELOCALDNS-HA-OUTPUT`; filter `INPUT` → `NODELOCALDNS-HA-INPUT` and `OUTPUT` →
//! `NODELOCALDNS-HA-OUTPUT`. The jumps carry the comment `nodelocaldns-ha`.
//!
//! * [`Iptables::apply`] reads the table with `iptables-save -t <table>`, then runs **one**
//!   `iptables-restore --noflush` transaction per address family: it declares the agent's
//!   chains (which creates or flushes them), appends their rules, and, unless the jump is
//!   already the first rule and the only one, deletes every copy of the jump and inserts it at
//!   position 1, in the same transaction. So the jump is exactly once and first, atomically with
//!   the chain contents; there is no per-rule `-C`/`-I` loop (node-cache's duplicate rules,
//!   kubernetes/dns #568). A family the ruleset has no rules for is cleaned of the agent's
//!   objects. Then the table is read back.
//! * [`Iptables::check`] parses `iptables-save -t <table>` and compares text lines: the rules are
//!   written exactly in the form `iptables-save` prints them ([`render`] shows them).
//! * [`Iptables::remove`] deletes every jump to the agent's chains, then flushes and deletes the
//!   chains, in one transaction per family; nothing runs when nothing is there.
//!
//! Transactions are atomic per address family (IPv4 and IPv6 are separate tables to iptables):
//! after a failure between the two, the next apply finishes the job.
//!
//! iptables-legacy serialises writers with the xtables lock (`/run/xtables.lock`, or the file
//! named by `XTABLES_LOCKFILE`, which is passed through). `iptables-legacy-restore` waits for it
//! at most the configured time (`-w`, whole seconds, at least 1: `-w 0` would wait forever) and
//! a timeout there is [`Error::LockBusy`]. iptables-nft takes no lock. Every child process is
//! killed if it outlives the lock wait by 2 s, so the agent never hangs on iptables.
//!
//! `flavour` says which iptables ([`Flavour`], which detection uses too) and names its binaries;
//! `text` is the pure half (rendering, parsing, comparing, the restore scripts); `command` runs
//! the child processes.

mod command;
mod error;
mod flavour;
mod text;

use std::path::{Path, PathBuf};

use std::time::Duration;

use super::{Check, Dataplane, TableRef};
use crate::ruleset::RuleSet;
use command::{Finished, RunError};
use text::{Family, Hooked, Saved, State};

pub use error::Error;
use error::{classify, summary};
pub use flavour::{Flavour, Tool};
pub use text::ParseError;

/// Where the binaries are looked for after `PATH` (a service's `PATH` may lack the sbin dirs).
const FALLBACK_DIRS: [&str; 3] = ["/usr/sbin", "/sbin", "/usr/local/sbin"];
/// How much longer than the lock wait a child process may run before it is killed.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// Which table a backend writes, and so which part of the [`RuleSet`] it installs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Table {
    /// The NOTRACK chains ([`RuleSet::chains`]).
    Raw,
    /// The ACCEPTs ([`RuleSet::accepts`]).
    Filter,
}

impl Table {
    /// The table's name, as after `-t`.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Raw => "raw",
            Table::Filter => "filter",
        }
    }

    /// The nftables tables iptables-nft keeps this table in: one per family, of the same name
    /// (`ip raw` and `ip6 raw`, …).
    pub fn nft_tables(self) -> Vec<TableRef> {
        let name = self.as_str();
        Family::ALL.map(|f| TableRef { family: f.nfproto(), name: name.to_owned() }).into()
    }

    /// The built-in chains the agent jumps from, and its chains: the first for
    /// prerouting/input, the second for output.
    fn hooks(self) -> [Hooked; 2] {
        match self {
            Table::Raw => [
                Hooked { builtin: "PREROUTING", own: "NODELOCALDNS-HA-PREROUTING" },
                Hooked { builtin: "OUTPUT", own: "NODELOCALDNS-HA-OUTPUT" },
            ],
            Table::Filter => [
                Hooked { builtin: "INPUT", own: "NODELOCALDNS-HA-INPUT" },
                Hooked { builtin: "OUTPUT", own: "NODELOCALDNS-HA-OUTPUT" },
            ],
        }
    }
}

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

/// The iptables dataplane: owns the agent's chains of one table, in IPv4 and IPv6.
#[derive(Clone, Debug)]
pub struct Iptables {
    flavour: Flavour,
    table: Table,
    /// `-w` for `iptables-legacy-restore`: whole seconds, at least 1.
    lock_wait_secs: u64,
    /// Indexed like [`Family::ALL`].
    binaries: [Binaries; 2],
    /// What this backend's last apply found in each family when it read back (indexed like
    /// [`Family::ALL`]): lets the next apply go straight to its transaction.
    verified: [Verified; 2],
    /// The families the kernel has: IPv4, and IPv6 unless it was booted with
    /// `ipv6.disable=1` (then `ip6tables-*` fail, and there is nothing of ours to find there).
    families: Vec<Family>,
}

/// What an apply's read-back found in one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verified {
    /// Not read back yet, or not as wanted.
    Unknown,
    /// The agent's chains, each jumped to once, first.
    Placed,
    /// Nothing of the agent's.
    Empty,
}

impl Iptables {
    /// A backend for `table` through `flavour`'s binaries, which must be installed. It waits at
    /// most `lock_wait` (rounded up to whole seconds, at least 1) for the xtables lock.
    pub fn new(flavour: Flavour, table: Table, lock_wait: Duration) -> Result<Self, Error> {
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
            table,
            lock_wait_secs: lock_wait_secs(lock_wait),
            binaries: [binaries(Family::V4)?, binaries(Family::V6)?],
            verified: [Verified::Unknown; 2],
            families: kernel_families(),
        })
    }

    /// The iptables flavour it writes through.
    pub fn flavour(&self) -> Flavour {
        self.flavour
    }

    /// The table it writes.
    pub fn table(&self) -> Table {
        self.table
    }

    fn binaries(&self, family: Family) -> &Binaries {
        &self.binaries[family.index()]
    }

    /// How long a child process may run.
    fn limit(&self) -> Duration {
        Duration::from_secs(self.lock_wait_secs) + KILL_GRACE
    }

    /// What the agent's objects of `family` are compared with: its chains and the built-in
    /// chains that jump to them. iptables-legacy: `iptables-legacy-save -t <table>` (the kernel
    /// hands out that table alone). iptables-nft: `iptables-nft -t <table> -S <chain>` for each
    /// of the four chains, which fetches only that chain's rules; `iptables-nft-save -t <table>`
    /// (and `-S` without a chain) fetch every table's chains of the family, about 0.3 s with
    /// kube-proxy's 50,000 nat rules instead of a few ms. So a read-back costs the same on
    /// every node; a jump to the agent's chains from another user chain goes unseen (only
    /// [`Iptables::remove`] looks for those, with a whole save).
    fn read(&self, family: Family) -> Result<Saved, Error> {
        let Some(list) = &self.binaries(family).list else {
            return self.save(family);
        };
        let table = self.table.as_str();
        let mut listed = String::new();
        for hooked in self.table.hooks() {
            for chain in [hooked.builtin, hooked.own] {
                let done = self.run(list, &["-t", table, "-S", chain], None)?;
                if done.status.success() {
                    listed.push_str(&done.stdout);
                } else if !(chain == hooked.own && text::no_such_chain(&done.stderr, chain)) {
                    return Err(Error::SaveFailed {
                        binary: list.name,
                        table,
                        status: done.status,
                        stderr: summary(&done.stderr),
                    });
                }
            }
        }
        text::parse_listing(&listed, table).map_err(|source| Error::Unparsable {
            binary: list.name,
            table,
            source,
        })
    }

    /// `iptables-save -t <table>` for `family`, parsed.
    fn save(&self, family: Family) -> Result<Saved, Error> {
        let binary = &self.binaries(family).save;
        let table = self.table.as_str();
        let done = self.run(binary, &["-t", table], None)?;
        if !done.status.success() {
            return Err(Error::SaveFailed {
                binary: binary.name,
                table,
                status: done.status,
                stderr: summary(&done.stderr),
            });
        }
        text::parse_save(&done.stdout, table).map_err(|source| Error::Unparsable {
            binary: binary.name,
            table,
            source,
        })
    }

    /// Runs `script` as one `iptables-restore --noflush` transaction for `family`.
    fn restore(&self, family: Family, script: &str) -> Result<(), Error> {
        let binary = &self.binaries(family).restore;
        let wait = self.lock_wait_secs.to_string();
        let mut args = vec!["--noflush"];
        // iptables-nft-restore takes no lock (it accepts -w and ignores it). -W is left out:
        // iptables 1.8.9 ignores it with a warning.
        if self.flavour == Flavour::Legacy {
            args.extend(["-w", wait.as_str()]);
        }
        let done = self.run(binary, &args, Some(script))?;
        classify(
            binary.name,
            self.table.as_str(),
            &done,
            Duration::from_secs(self.lock_wait_secs),
            script,
        )
    }

    fn run(&self, binary: &Binary, args: &[&str], input: Option<&str>) -> Result<Finished, Error> {
        let limit = self.limit();
        command::run(&binary.path, args, input, limit).map_err(|error| match error {
            RunError::Io(source) => Error::Spawn { binary: binary.name, source },
            RunError::TimedOut => {
                Error::Timeout { binary: binary.name, table: self.table.as_str(), limit }
            }
        })
    }

    /// Brings `family` to `rules`: its share installed, or nothing of the agent's when the
    /// ruleset has no rules of that family. Runs no transaction when it already is.
    ///
    /// With `trusting`, when the last read-back found the family as wanted (the jumps in place,
    /// or nothing there) it reads nothing first: it only refills the agent's chains (or does
    /// nothing), so a switch is one `iptables-restore` whatever the node holds. The read-back
    /// after it tells whether that was enough. Returns whether it trusted.
    fn apply_family(&self, family: Family, rules: &RuleSet, trusting: bool) -> Result<bool, Error> {
        let wanted = text::wanted(rules, self.table, family);
        if trusting {
            match (&wanted, self.verified[family.index()]) {
                (Some(wanted), Verified::Placed) => {
                    self.restore(family, &text::fill_script(self.table, wanted))?;
                    return Ok(true);
                }
                (None, Verified::Empty) => return Ok(true),
                _ => {}
            }
        }
        self.apply_family_read(family, rules)?;
        Ok(false)
    }

    /// [`Iptables::apply_family`], reading the family first.
    fn apply_family_read(&self, family: Family, rules: &RuleSet) -> Result<(), Error> {
        let saved = self.read(family)?;
        let script = match text::wanted(rules, self.table, family) {
            None => text::remove_script(self.table, &saved),
            Some(wanted) => match text::compare(self.table, family, &saved, Some(&wanted)) {
                State::Matches => None,
                State::Nothing | State::Differs(_) => {
                    Some(text::apply_script(self.table, &saved, &wanted))
                }
            },
        };
        match script {
            Some(script) => self.restore(family, &script),
            None => Ok(()),
        }
    }

    fn check_families(&self, rules: &RuleSet) -> Result<Check, Error> {
        self.check_some(rules, |_| true)
    }

    /// Reads back the families `read` picks; the others count as holding their share (or
    /// nothing, when they have none), as at the last read-back.
    fn check_some(&self, rules: &RuleSet, read: impl Fn(Family) -> bool) -> Result<Check, Error> {
        Ok(text::combine(self.table, self.states(rules, read)?))
    }

    /// Each family's state (`(family, wanted, state)`), read back where `read` says.
    fn states(
        &self,
        rules: &RuleSet,
        read: impl Fn(Family) -> bool,
    ) -> Result<Vec<(Family, bool, State)>, Error> {
        let mut states = Vec::new();
        for &family in &self.families {
            let wanted = text::wanted(rules, self.table, family);
            let state = if read(family) {
                let saved = self.read(family)?;
                text::compare(self.table, family, &saved, wanted.as_ref())
            } else if wanted.is_some() {
                State::Matches
            } else {
                State::Nothing
            };
            states.push((family, wanted.is_some(), state));
        }
        Ok(states)
    }

    fn remove_families(&self) -> Result<(), Error> {
        for &family in &self.families {
            if let Some(script) = text::remove_script(self.table, &self.save(family)?) {
                self.restore(family, &script)?;
            }
        }
        Ok(())
    }
}

impl Dataplane for Iptables {
    fn name(&self) -> &'static str {
        self.flavour.backend_name(self.table)
    }

    fn apply(&mut self, rules: &RuleSet) -> Result<(), super::Error> {
        if let Some(comment) = text::unstorable_comment(rules, self.table) {
            return Err(Error::Comment(comment.to_owned()).into());
        }
        if let Some(&missing) = Family::ALL
            .iter()
            .find(|f| !self.families.contains(f) && text::wanted(rules, self.table, **f).is_some())
        {
            return Err(Error::FamilyMissing { family: missing.label() }.into());
        }
        let families = self.families.clone();
        let mut trusted = false;
        for &family in &families {
            trusted |= self.apply_family(family, rules, true)?;
        }
        let mut states = self.states(rules, |_| true)?;
        let as_wanted = |states: &[(Family, bool, State)]| {
            states.iter().all(|(_, wanted, state)| {
                *state == if *wanted { State::Matches } else { State::Nothing }
            })
        };
        if trusted && !as_wanted(&states) {
            // Someone moved or removed a jump since: read, then change what is needed.
            for &family in &families {
                self.apply_family(family, rules, false)?;
            }
            states = self.states(rules, |_| true)?;
        }
        for (family, wanted, state) in &states {
            self.verified[family.index()] = match (wanted, state) {
                (true, State::Matches) => Verified::Placed,
                (false, State::Nothing) => Verified::Empty,
                _ => Verified::Unknown,
            };
        }
        let wants_any = Family::ALL.iter().any(|&f| text::wanted(rules, self.table, f).is_some());
        match text::combine(self.table, states) {
            Check::Matches => Ok(()),
            Check::Missing if !wants_any => Ok(()),
            Check::Missing => Err(Error::NotApplied {
                table: self.table.as_str(),
                difference: "nothing of the agent's is there".to_owned(),
            }
            .into()),
            Check::Differs(difference) => {
                Err(Error::NotApplied { table: self.table.as_str(), difference }.into())
            }
        }
    }

    fn check(&mut self, rules: &RuleSet) -> Result<Check, super::Error> {
        Ok(self.check_families(rules)?)
    }

    /// iptables-nft: the families whose table was announced changed (kube-proxy's filter
    /// churn in IPv4 costs no IPv6 read-back). iptables-legacy announces nothing: all.
    fn check_changed(
        &mut self,
        rules: &RuleSet,
        changed: &[TableRef],
    ) -> Result<Check, super::Error> {
        if self.flavour == Flavour::Legacy {
            return self.check(rules);
        }
        let table = self.table.as_str();
        let announced = |family: Family| {
            changed.iter().any(|t| t.family == family.nfproto() && t.name == table)
        };
        Ok(self.check_some(rules, announced)?)
    }

    /// iptables-legacy's tables announce nothing.
    fn announced_tables(&self) -> Option<Vec<TableRef>> {
        (self.flavour == Flavour::Nft).then(|| self.table.nft_tables())
    }

    fn remove(&mut self) -> Result<(), super::Error> {
        Ok(self.remove_families()?)
    }

    /// Every call runs its own child processes: a copy is a reader.
    fn reader(&self) -> Result<Box<dyn Dataplane>, super::Error> {
        Ok(Box::new(self.clone()))
    }

    fn reply_packets(&mut self) -> Result<Option<u64>, super::Error> {
        if self.table != Table::Raw {
            return Ok(None);
        }
        let mut total = 0;
        for &family in &self.families {
            let binary = &self.binaries(family).save;
            let done = self.run(binary, &["-c", "-t", "raw"], None)?;
            if !done.status.success() {
                return Err(Error::SaveFailed {
                    binary: binary.name,
                    table: "raw",
                    status: done.status,
                    stderr: summary(&done.stderr),
                }
                .into());
            }
            total += text::reply_packets(&done.stdout);
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

/// The agent's share of `rules` for `table`, as `iptables-save -t <table>` prints it on a node
/// with nothing else in the table: the agent's chains, the jumps, the rules; one section per
/// address family with rules. This is what `apply` installs and `check` compares with.
pub fn render(rules: &RuleSet, table: Table) -> String {
    let mut text = String::new();
    for family in Family::ALL {
        if let Some(wanted) = text::wanted(rules, table, family) {
            text.push_str(&format!("# {} ({}tables)\n", family.label(), family.prefix()));
            text.push_str(&text::render_family(table, &wanted));
        }
    }
    text
}

/// For the fuzz targets: `text` read as `iptables-save -t <table>` output and compared with both
/// families' share of `rules`, as a check does. Must never panic; a parse that succeeds must
/// keep every declared chain.
#[cfg(fuzzing)]
pub(crate) fn fuzz_saved(text: &str, rules: &RuleSet) {
    for table in [Table::Raw, Table::Filter] {
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
