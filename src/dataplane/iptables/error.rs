//! What the iptables backend can fail at, and how a failed `iptables-restore` is told apart:
//! the xtables lock held by someone else, or a rule the kernel refused (named by its line).

use std::process::ExitStatus;
use std::time::Duration;

use super::command::Finished;
use super::text::{ParseError, MAX_COMMENT_BYTES};
use super::FALLBACK_DIRS;

/// What `iptables-legacy` prints when `-w` ran out.
const LOCK_BUSY_TEXT: &str = "holding the xtables lock";
/// `iptables-legacy`'s exit status for resource problems, a held lock among them.
const RESOURCE_PROBLEM: i32 = 4;

/// What the iptables backend failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A binary the backend runs is not installed.
    #[error(
        "{binary} is not installed (looked in PATH and {}): install the Debian package \
         `iptables` (it ships iptables-legacy and iptables-nft), or use the nftables dataplane",
        FALLBACK_DIRS.join(", ")
    )]
    NotInstalled {
        /// The binary's name, e.g. `ip6tables-nft-restore`.
        binary: &'static str,
    },
    /// A binary could not be started.
    #[error("starting {binary} failed: {source} (is it executable by the agent's user?)")]
    Spawn {
        /// Its name.
        binary: &'static str,
        /// Why it could not be started or waited for.
        #[source]
        source: std::io::Error,
    },
    /// A binary ran past its time bound and was killed.
    #[error(
        "{binary} on {tables} did not finish within {limit:?} and was killed \
         (iptables-restore commits each table's section whole or not at all; the next check \
         shows which); is another process stuck holding the xtables lock or the kernel's \
         netfilter?"
    )]
    Timeout {
        /// Its name.
        binary: &'static str,
        /// The tables it worked on, e.g. `the raw and mangle tables`.
        tables: &'static str,
        /// How long it was allowed to run.
        limit: Duration,
    },
    /// Another process held the xtables lock for the whole wait; the table it was waiting to
    /// change and any after it were left as they were (iptables-legacy-restore takes the lock
    /// table by table).
    #[error(
        "xtables lock held by another process: {binary} gave up on {tables} after waiting \
         {waited:?}; the table it waited for was left as it was, and any after it (kube-proxy or \
         a CNI plugin rewriting its rules; the agent retries, raise the lock wait if this \
         persists)"
    )]
    LockBusy {
        /// The binary that waited.
        binary: &'static str,
        /// The tables it was to change, e.g. `the raw table`.
        tables: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// `iptables-restore` refused the transaction at a table's section; that section and the
    /// ones after it were not applied (the ones before it were: it commits table by table).
    #[error(
        "{binary} failed on {tables} ({status}): {stderr}{at}; the table it failed in was left \
         as it was, and any after it (needs CAP_NET_ADMIN in the node's network namespace, with \
         iptables-legacy CAP_NET_RAW too, and the kernel modules the rules use: xt_comment, \
         xt_addrtype, xt_socket, xt_CT, xt_TPROXY, with iptables-nft nft_compat too)"
    )]
    RestoreFailed {
        /// Its name.
        binary: &'static str,
        /// The tables of the transaction, e.g. `the raw and mangle tables`.
        tables: &'static str,
        /// How it exited.
        status: ExitStatus,
        /// What it said, in one line.
        stderr: String,
        /// The line of the transaction it refused, as ` (at `…`)`, if it said which.
        at: String,
    },
    /// The ruleset has rules for an address family the kernel does not have.
    #[error(
        "the ruleset has {family} rules but this kernel has no {family} (booted with \
         ipv6.disable=1?): give --local-ip and --cluster-dns-ip addresses of the node's families"
    )]
    FamilyMissing {
        /// `IPv6`.
        family: &'static str,
    },
    /// `iptables-save` failed.
    #[error(
        "{binary} -t {table} failed ({status}): {stderr} (needs CAP_NET_ADMIN in the node's \
         network namespace; with iptables-legacy, CAP_NET_RAW and the ip_tables kernel modules)"
    )]
    SaveFailed {
        /// Its name.
        binary: &'static str,
        /// The table.
        table: &'static str,
        /// How it exited.
        status: ExitStatus,
        /// What it said, in one line.
        stderr: String,
    },
    /// `iptables-save` printed something this backend cannot read.
    #[error(
        "the output of {binary} -t {table} could not be parsed: {source} (an iptables version \
         this agent does not know; please report it with `iptables --version`)"
    )]
    Unparsable {
        /// Its name.
        binary: &'static str,
        /// The table.
        table: &'static str,
        /// What is wrong with it.
        #[source]
        source: ParseError,
    },
    /// A rule's comment cannot be stored by iptables as it is; nothing was changed.
    #[error(
        "the rule comment {0:?} cannot be stored by iptables: it must be at most \
         {MAX_COMMENT_BYTES} bytes (longer ones are cut short), without control characters"
    )]
    Comment(String),
    /// The transaction went in but the tables read back are not what was applied.
    #[error(
        "the tables read back after iptables-restore differ from what was applied: \
         {difference} (did another process change them at the same moment?)"
    )]
    NotApplied {
        /// What differs first, naming the family, table and chain.
        difference: String,
    },
}

/// What a failed iptables command said, in one line: its first few non-empty lines but the
/// usage hint (iptables-nft puts its message on the second line).
pub(super) fn summary(stderr: &str) -> String {
    const LINES: usize = 3;
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("Try `"))
        .take(LINES)
        .collect();
    if lines.is_empty() {
        "(no message)".to_owned()
    } else {
        lines.join(" ")
    }
}

/// The line of `script` that iptables-restore names in `stderr` ("line 5 failed",
/// "Error occurred at line: 5", "line 5: CHAIN_DEL failed").
pub(super) fn failed_line<'a>(stderr: &str, script: &'a str) -> Option<&'a str> {
    let after = stderr.split("line").skip(1);
    let number = after
        .filter_map(|rest| {
            let digits: String = rest
                .trim_start_matches([':', ' '])
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse::<usize>().ok()
        })
        .next()?;
    script.lines().nth(number.checked_sub(1)?)
}

/// The outcome of one `iptables-restore` run.
pub(super) fn classify(
    binary: &'static str,
    tables: &'static str,
    done: &Finished,
    waited: Duration,
    script: &str,
) -> Result<(), Error> {
    if done.status.success() {
        return Ok(());
    }
    if done.status.code() == Some(RESOURCE_PROBLEM) && done.stderr.contains(LOCK_BUSY_TEXT) {
        return Err(Error::LockBusy { binary, tables, waited });
    }
    let at = failed_line(&done.stderr, script).map(|line| format!(" (at `{line}`)"));
    Err(Error::RestoreFailed {
        binary,
        tables,
        status: done.status,
        stderr: summary(&done.stderr),
        at: at.unwrap_or_default(),
    })
}
