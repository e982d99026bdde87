//! What the nftables backend fails to do, each error saying what to check.

use nix::errno::Errno;

use super::{ParseError, READ_ATTEMPTS, REPLY_TIMEOUT_SECS};

/// What the nftables backend failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The netlink socket could not be opened.
    #[error(
        "opening a netfilter netlink socket failed: {0} \
         (needs CAP_NET_ADMIN in the node's network namespace)"
    )]
    Open(#[source] Errno),
    /// A batch or a request could not be sent.
    #[error(
        "sending {what} to nftables failed: {source} \
         (needs CAP_NET_ADMIN in the node's network namespace)"
    )]
    Send {
        /// What was being sent.
        what: &'static str,
        /// The socket's error.
        #[source]
        source: Errno,
    },
    /// The kernel's answer did not arrive.
    #[error(
        "reading the kernel's answer to {what} failed: {source} \
         (EAGAIN: no answer within {REPLY_TIMEOUT_SECS} s)"
    )]
    Receive {
        /// What the answer was to.
        what: &'static str,
        /// The socket's error.
        #[source]
        source: Errno,
    },
    /// The kernel refused the batch; nothing of it was applied.
    #[error(
        "the kernel rejected the nftables batch at {at}: {source}; nothing was changed \
         (EPERM: needs CAP_NET_ADMIN; ENOENT or EOPNOTSUPP at a rule: a kernel module is \
         missing, needs kernel ≥ 5.x with nf_tables, nft_fib_inet and nft_socket, and for the \
         chain fallback nft_tproxy; --link-local-failover=false runs without that chain)"
    )]
    Rejected {
        /// The message the kernel refused, e.g. `chain prerouting: rule 3 (…)`.
        at: String,
        /// The kernel's error.
        #[source]
        source: Errno,
    },
    /// Listing the installed table failed.
    #[error(
        "listing nftables {what} failed: {source} \
         (needs CAP_NET_ADMIN; is nf_tables available?)"
    )]
    List {
        /// Tables, chains or rules.
        what: &'static str,
        /// The kernel's error.
        #[source]
        source: Errno,
    },
    /// The kernel's answer could not be parsed.
    #[error(
        "the kernel's answer to {what} could not be parsed: {source} \
         (an nf_tables this agent does not know; please report it with the kernel version)"
    )]
    Malformed {
        /// What the answer was to.
        what: &'static str,
        /// What is wrong with it.
        #[source]
        source: ParseError,
    },
    /// The ruleset changed during every attempt to read it back.
    #[error(
        "the nftables ruleset kept changing while it was read back ({READ_ATTEMPTS} attempts); \
         is another process rewriting it in a loop?"
    )]
    Unsettled,
    /// A rule's comment cannot be stored by nftables.
    #[error("the rule comment {0:?} cannot be stored: it must be under 128 bytes, without NUL")]
    Comment(String),
    /// The batch was accepted but the table read back is not the one applied.
    #[error(
        "the nftables table read back differs from the one just applied: {0} \
         (did another process change it at the same moment?)"
    )]
    NotApplied(String),
    /// Watching for nftables changes failed.
    #[error(
        "watching for nftables changes failed: {0} \
         (needs CAP_NET_ADMIN in the node's network namespace, and a tokio runtime)"
    )]
    Watch(#[source] std::io::Error),
}
