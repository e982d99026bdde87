//! nftables backend: installs a [`RuleSet`] as the table `inet nodelocaldns-ha` over netlink.
//!
//! * [`Nftables::apply`] installs a ruleset in **one atomic batch**, built with nftnl and sent on
//!   a `NETLINK_NETFILTER` socket, then reads the table back. A route switch refills the base
//!   chains in place (each flushed and given its rules; their hooks stay registered); a first
//!   apply, or one after anything else changed the table, replaces the whole table
//!   (create-if-absent, delete, create, base chains, rules). Either the new rules are all in
//!   place or the old ones still are.
//! * [`Nftables::check`] reads the table back with netlink dumps (built and parsed in safe Rust by
//!   `objects`) and `compare`s tables, chains (hook, priority, type, policy), rules in order,
//!   their comments and every expression value (counter values aside) with what `expr` says
//!   the rules consist of. The same function builds the batch, so the two cannot drift.
//! * [`ChangeWatch`] (`changes`) hears every nftables change in the namespace (the kernel
//!   announces them on the `NFNLGRP_NFTABLES` group), so the agent can re-check at once when
//!   another tool touches the table; `watch` is the agent's task that listens.
//! * [`Nftables::host_firewall`] (`host_firewall`) reads the node's own firewall tables for
//!   [`crate::firewall`] to judge; [`watch_firewall`] reads them again as they change.
//!
//! This file holds the exchange itself: the socket, the batch, the requests and their answers.
//! Everything runs in the network namespace that is current when the sockets are opened (the
//! agent runs with hostNetwork). `unsafe` is confined to `ffi`, which hands expressions to
//! libnftnl.

#[forbid(unsafe_code)]
mod batch;
#[forbid(unsafe_code)]
pub(crate) mod changes;
#[forbid(unsafe_code)]
mod compare;
#[forbid(unsafe_code)]
mod error;
#[forbid(unsafe_code)]
mod expr;
#[allow(unsafe_code)]
mod ffi;
#[forbid(unsafe_code)]
mod host_firewall;
#[forbid(unsafe_code)]
pub(crate) mod objects;
#[forbid(unsafe_code)]
mod watch;

use std::ffi::CStr;
use std::fmt;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nftnl::FinalizedBatch;
use nix::errno::Errno;
use nix::sys::socket::{self, sockopt, MsgFlags, NetlinkAddr, SockProtocol};
use nix::sys::time::TimeVal;
use tracing::debug;

use super::{Check, Dataplane, TableRef, TableWatch};
use crate::netlink::{
    self, Message, NLMSG_DONE, NLMSG_ERROR, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST,
};
use crate::ruleset::{self, RuleSet};
use compare::{compare, Installed};
use objects::{nft_body, nft_type};

pub use crate::netlink::ParseError;
pub use changes::{Announced, ChangeWatch};
pub use error::Error;
pub use host_firewall::{audit_firewall, host_firewall_candidate, watch_firewall};
pub(crate) use watch::{watch_nftables, Watched};

/// [`ruleset::TABLE`] for nftnl.
const TABLE_NAME: &CStr = c"nodelocaldns-ha";

/// The table [`Dataplane::trial`] creates and deletes in one transaction.
const TRIAL_TABLE_NAME: &CStr = c"nodelocaldns-ha-trial";
/// `NFPROTO_INET`: the table serves IPv4 and IPv6.
const FAMILY: u8 = libc::NFPROTO_INET as u8;
/// How long to wait for the kernel's answer before giving up.
const REPLY_TIMEOUT_SECS: i64 = 5;
/// Receive buffer: the kernel's dump messages are at most 32 KiB.
const RECV_BUFFER: usize = 64 * 1024;
/// Read-back attempts while the ruleset keeps changing underneath.
const READ_ATTEMPTS: usize = 3;
/// Sequence numbers of this backend's requests; nftnl numbers batch messages from 1.
const FIRST_REQUEST_SEQ: u32 = 1 << 31;

/// The nftables dataplane: owns the table `inet nodelocaldns-ha`.
pub struct Nftables {
    /// A `NETLINK_NETFILTER` socket for batches and dumps, with a receive timeout.
    socket: OwnedFd,
    /// The socket's netlink port, which the kernel puts on the notifications of our changes.
    portid: u32,
    next_seq: u32,
    buf: Vec<u8>,
    /// What the last apply left in the kernel, as read back: a switch from it to a ruleset of
    /// the same chains refills them (`batch::refilling`). `None` after a failure.
    applied: Option<RuleSet>,
    /// How long the kernel took to commit the last apply's batches.
    last_commit: Option<Duration>,
}

impl fmt::Debug for Nftables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nftables")
            .field("socket", &self.socket)
            .field("portid", &self.portid)
            .finish_non_exhaustive()
    }
}

/// Whether the replies of a read-back form a consistent snapshot.
#[derive(Debug, Default)]
struct Snapshot {
    /// The ruleset generation (`nfgenmsg.res_id`) of every reply.
    generations: Vec<u16>,
    /// The kernel flagged a dump as interrupted by a change.
    interrupted: bool,
}

impl Snapshot {
    fn consistent(&self) -> bool {
        !self.interrupted && self.generations.windows(2).all(|w| w[0] == w[1])
    }
}

impl Nftables {
    /// Opens a netfilter netlink socket in the current network namespace.
    pub fn new() -> Result<Self, Error> {
        let socket = netlink::socket::open(SockProtocol::NetlinkNetFilter).map_err(Error::Open)?;
        netlink::socket::bind(&socket, &[]).map_err(Error::Open)?;
        let timeout = TimeVal::new(REPLY_TIMEOUT_SECS, 0);
        socket::setsockopt(&socket, sockopt::ReceiveTimeout, &timeout).map_err(Error::Open)?;
        let portid =
            socket::getsockname::<NetlinkAddr>(socket.as_raw_fd()).map_err(Error::Open)?.pid();
        Ok(Nftables {
            socket,
            portid,
            next_seq: FIRST_REQUEST_SEQ,
            buf: vec![0; RECV_BUFFER],
            applied: None,
            last_commit: None,
        })
    }

    /// The ruleset's generation (`NFT_MSG_GETGEN`): the namespace's count of committed nftables
    /// transactions, iptables-nft's included. A read-back begun in it finds the same while it
    /// stands.
    pub fn generation(&mut self) -> Result<u32, Error> {
        let what = "the ruleset generation";
        let mut found = None;
        let read = |_, attrs: &[u8]| {
            let a = netlink::attribute_table::<2>(attrs)?;
            let id = netlink::required(a[usize::from(objects::NFTA_GEN_ID)], "NFTA_GEN_ID")?;
            found = Some(netlink::be_u32(id, "NFTA_GEN_ID")?);
            Ok(())
        };
        let (get, snapshot) = (objects::NFT_MSG_GETGEN, &mut Snapshot::default());
        match self.request(snapshot, what, get, NLM_F_REQUEST, &[], read)? {
            Ok(()) => found.ok_or(Error::Malformed { what, source: ParseError::Missing("NEWGEN") }),
            Err(source) => Err(Error::List { what, source }),
        }
    }

    /// Commits the least real transaction (a table of its own created and deleted), leaving the
    /// ruleset as it was: the floor of any writer's switch in this namespace, which the
    /// benchmark (`ci/bench.sh`) puts beside the agent's.
    pub fn commit_floor(&mut self) -> Result<(), Error> {
        let (batch, described) = batch::floor();
        self.send_batch(&batch, &described)
    }

    /// A [`ChangeWatch`] that ignores the changes made through `self`, so the agent's own
    /// applies do not wake it. Must be called inside a tokio runtime.
    pub fn change_watch(&self) -> Result<ChangeWatch, Error> {
        ChangeWatch::open(Some(self.portid))
    }

    /// Commits a batch `batch` built (with its descriptions), its time added to the apply's
    /// [`Dataplane::last_commit`] (a refill that reads back wrong is followed by a replacement:
    /// both count).
    fn commit(&mut self, built: (FinalizedBatch, Vec<String>)) -> Result<(), Error> {
        let started = Instant::now();
        let result = self.send_batch(&built.0, &built.1);
        self.last_commit = Some(self.last_commit.unwrap_or_default() + started.elapsed());
        result
    }

    /// Puts `rules` in and reads them back: by refilling the chains in place when the last
    /// apply left the same ones, and when that is refused or does not read back as `rules`
    /// (another writer changed the table meanwhile), by replacing the whole table.
    fn install(&mut self, rules: &RuleSet) -> Result<Check, Error> {
        if self.applied.take().is_some_and(|applied| batch::same_chains(&applied, rules)) {
            match self.commit(batch::refilling(rules)?) {
                Ok(()) if self.check_table(rules)? == Check::Matches => {
                    self.applied = Some(rules.clone());
                    return Ok(Check::Matches);
                }
                Ok(()) => debug!("the refilled nftables table reads back wrong: replacing it"),
                // Refused whole (a chain gone): nothing changed, and the replacement below puts
                // everything back. Any other failure leaves the exchange in doubt: returned.
                Err(Error::Rejected { at, source }) => {
                    debug!(at, error = %source, "the nftables refill was refused: replacing the table");
                }
                Err(e) => return Err(e),
            }
        }
        self.commit(batch::replacing(rules)?)?;
        let check = self.check_table(rules)?;
        self.applied = (check == Check::Matches).then(|| rules.clone());
        Ok(check)
    }

    /// Deletes the table in one batch; nothing happens when it is absent.
    fn delete(&mut self) -> Result<(), Error> {
        self.applied = None;
        let (batch, described) = batch::deleting();
        self.send_batch(&batch, &described)
    }

    /// Sends `batch` and waits for the kernel to acknowledge each of its messages.
    /// `described[i]` names the i-th message after the batch begin, for error messages.
    fn send_batch(&mut self, batch: &FinalizedBatch, described: &[String]) -> Result<(), Error> {
        const WHAT: &str = "the nftables batch";
        self.drain();
        let pages: Vec<IoSlice<'_>> = batch.iter().map(IoSlice::new).collect();
        socket::sendmsg::<NetlinkAddr>(
            self.socket.as_raw_fd(),
            &pages,
            &[],
            MsgFlags::empty(),
            None,
        )
        .map_err(|source| Error::Send { what: WHAT, source })?;

        // Kernels ≥ 6.10 also acknowledge the batch begin and end messages; nftnl then numbers
        // them too.
        let seqs = batch.sequence_numbers();
        let has_begin_end = seqs.len() == described.len() + 2;
        let describe = |seq: u32| -> String {
            let offset = seq.wrapping_sub(seqs.start) as usize;
            let index = if has_begin_end { offset.checked_sub(1) } else { Some(offset) };
            match index {
                _ if seq == 0 => "the batch".to_owned(),
                None => "the batch begin".to_owned(),
                Some(index) => described
                    .get(index)
                    .cloned()
                    .unwrap_or_else(|| "the batch end (commit)".to_owned()),
            }
        };
        let mut acked = vec![false; seqs.len()];
        while acked.contains(&false) {
            let len = self.receive(WHAT)?;
            for message in netlink::messages(&self.buf[..len]) {
                let message = message.map_err(|source| Error::Malformed { what: WHAT, source })?;
                // Errors about the batch as a whole (e.g. EPERM) carry the begin message's
                // sequence number, which is 0 on older kernels.
                let ours = seqs.contains(&message.seq) || message.seq == 0;
                if message.kind != NLMSG_ERROR || !ours {
                    continue;
                }
                match message.error_code() {
                    Ok(0) => {
                        if let Some(flag) =
                            acked.get_mut(message.seq.wrapping_sub(seqs.start) as usize)
                        {
                            *flag = true;
                        }
                    }
                    Ok(errno) => {
                        return Err(Error::Rejected {
                            at: describe(message.seq),
                            source: Errno::from_raw(errno),
                        })
                    }
                    Err(source) => return Err(Error::Malformed { what: WHAT, source }),
                }
            }
        }
        Ok(())
    }

    /// Reads back the table, its chains and its rules, consistently: a read during which the
    /// ruleset changed (an interrupted dump, or replies from different generations) is retried.
    fn read_installed(&mut self) -> Result<Installed, Error> {
        for _ in 0..READ_ATTEMPTS {
            if let Some(installed) = self.read_once()? {
                return Ok(installed);
            }
        }
        Err(Error::Unsettled)
    }

    /// One read-back; `None` when it may be inconsistent.
    fn read_once(&mut self) -> Result<Option<Installed>, Error> {
        let name = TABLE_NAME.to_bytes_with_nul();
        let mut installed = Installed::default();
        let mut snapshot = Snapshot::default();

        let table = self.request(
            &mut snapshot,
            "the table",
            objects::NFT_MSG_GETTABLE,
            NLM_F_REQUEST,
            &[(objects::NFTA_TABLE_NAME, name)],
            |message, attrs| {
                if message == objects::NFT_MSG_NEWTABLE {
                    installed.table = Some(objects::parse_table(attrs)?);
                }
                Ok(())
            },
        )?;
        match table {
            Err(Errno::ENOENT) => return Ok(Some(Installed::default())),
            Err(source) => return Err(Error::List { what: "tables", source }),
            Ok(()) => {}
        }
        let chains = self.dump_chains(FAMILY, &mut snapshot, "the chains", |chain| {
            chain.table == ruleset::TABLE
        })?;
        let chains = chains.map(|ours| installed.chains = ours);
        let rules = self.request(
            &mut snapshot,
            "the rules",
            objects::NFT_MSG_GETRULE,
            NLM_F_REQUEST | NLM_F_DUMP,
            &[(objects::NFTA_RULE_TABLE, name)],
            |message, attrs| {
                if message == objects::NFT_MSG_NEWRULE {
                    let rule = objects::parse_rule(attrs)?;
                    if rule.table == ruleset::TABLE {
                        installed.rules.push(rule);
                    }
                }
                Ok(())
            },
        )?;
        for (answer, what) in [(chains, "chains"), (rules, "rules")] {
            match answer {
                // The table went away meanwhile: read again.
                Err(Errno::ENOENT) => return Ok(None),
                Err(source) => return Err(Error::List { what, source }),
                Ok(()) => {}
            }
        }
        Ok(snapshot.consistent().then_some(installed))
    }

    /// The chains of `family` that `keep` accepts: chain dumps cannot be filtered by table, so
    /// this dumps them all. The outer error is a failure to talk to the kernel, the inner one
    /// the kernel's answer.
    fn dump_chains(
        &mut self,
        family: u8,
        snapshot: &mut Snapshot,
        what: &'static str,
        keep: impl Fn(&objects::Chain) -> bool,
    ) -> Result<Result<Vec<objects::Chain>, Errno>, Error> {
        let mut chains = Vec::new();
        let answer = self.request_in(
            family,
            snapshot,
            what,
            objects::NFT_MSG_GETCHAIN,
            NLM_F_REQUEST | NLM_F_DUMP,
            &[],
            |message, attrs| {
                if message == objects::NFT_MSG_NEWCHAIN {
                    let chain = objects::parse_chain(attrs)?;
                    if keep(&chain) {
                        chains.push(chain);
                    }
                }
                Ok(())
            },
        )?;
        Ok(answer.map(|()| chains))
    }

    /// Sends one nf_tables request and passes each nf_tables message of the answer (type and
    /// attributes) to `each`. The outer error is a failure to talk to the kernel, the inner one
    /// the kernel's answer.
    fn request(
        &mut self,
        snapshot: &mut Snapshot,
        what: &'static str,
        msg: u16,
        flags: u16,
        attrs: &[(u16, &[u8])],
        each: impl FnMut(u16, &[u8]) -> Result<(), ParseError>,
    ) -> Result<Result<(), Errno>, Error> {
        self.request_in(FAMILY, snapshot, what, msg, flags, attrs, each)
    }

    /// [`Self::request`] for tables of another family.
    #[allow(clippy::too_many_arguments)]
    fn request_in(
        &mut self,
        family: u8,
        snapshot: &mut Snapshot,
        what: &'static str,
        msg: u16,
        flags: u16,
        attrs: &[(u16, &[u8])],
        mut each: impl FnMut(u16, &[u8]) -> Result<(), ParseError>,
    ) -> Result<Result<(), Errno>, Error> {
        self.drain();
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1).max(FIRST_REQUEST_SEQ);
        let request = objects::request(msg, flags, seq, family, attrs);
        socket::send(self.socket.as_raw_fd(), &request, MsgFlags::empty())
            .map_err(|source| Error::Send { what, source })?;

        let malformed = |source| Error::Malformed { what, source };
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        loop {
            let len = self.receive(what)?;
            let mut complete = false;
            for message in netlink::messages(&self.buf[..len]) {
                let message: Message<'_> = message.map_err(malformed)?;
                if message.seq != seq {
                    continue;
                }
                snapshot.interrupted |= message.flags & NLM_F_DUMP_INTR != 0;
                match message.kind {
                    NLMSG_ERROR => {
                        return Ok(match message.error_code().map_err(malformed)? {
                            0 => Ok(()),
                            errno => Err(Errno::from_raw(errno)),
                        })
                    }
                    NLMSG_DONE => complete = true,
                    _ => {
                        if let Some(nft_msg) = nft_type(&message) {
                            let (generation, attrs) = nft_body(&message).map_err(malformed)?;
                            snapshot.generations.push(generation);
                            each(nft_msg, attrs).map_err(malformed)?;
                        }
                        complete |= !dump;
                    }
                }
            }
            if complete {
                return Ok(Ok(()));
            }
        }
    }

    /// Receives one datagram into the buffer; its length.
    fn receive(&mut self, what: &'static str) -> Result<usize, Error> {
        loop {
            // MSG_TRUNC makes recv return the full length, so truncation is detected.
            match socket::recv(self.socket.as_raw_fd(), &mut self.buf, MsgFlags::MSG_TRUNC) {
                Ok(len) if len > self.buf.len() => {
                    return Err(Error::Receive { what, source: Errno::EMSGSIZE })
                }
                Ok(len) => return Ok(len),
                Err(Errno::EINTR) => {}
                Err(source) => return Err(Error::Receive { what, source }),
            }
        }
    }

    /// Discards whatever an earlier, failed exchange left unread.
    fn drain(&mut self) {
        // Bounded, in case the kernel kept answering; an abandoned dump ends after a few reads.
        for _ in 0..1024 {
            match socket::recv(self.socket.as_raw_fd(), &mut self.buf, MsgFlags::MSG_DONTWAIT) {
                Ok(_) | Err(Errno::EINTR) | Err(Errno::ENOBUFS) => {}
                Err(_) => return,
            }
        }
    }

    fn check_table(&mut self, rules: &RuleSet) -> Result<Check, Error> {
        Ok(compare(rules, &self.read_installed()?))
    }
}

impl Dataplane for Nftables {
    fn name(&self) -> &'static str {
        "nftables"
    }

    fn announced_tables(&self) -> Option<Vec<TableWatch>> {
        Some(vec![TableWatch::whole(TableRef { family: FAMILY, name: ruleset::TABLE.to_owned() })])
    }

    fn apply(&mut self, rules: &RuleSet) -> Result<(), super::Error> {
        self.last_commit = None;
        match self.install(rules)? {
            Check::Matches => Ok(()),
            Check::Missing => Err(Error::NotApplied("the table is missing".to_owned()).into()),
            Check::Differs(difference) => Err(Error::NotApplied(difference).into()),
        }
    }

    fn check(&mut self, rules: &RuleSet) -> Result<Check, super::Error> {
        Ok(self.check_table(rules)?)
    }

    fn ruleset_generation(&mut self) -> Option<u32> {
        self.generation().ok()
    }

    fn last_commit(&self) -> Option<Duration> {
        self.last_commit
    }

    fn reply_packets(&mut self) -> Result<Option<u64>, super::Error> {
        let installed = self.read_installed()?;
        let weighed = installed.rules.iter().map(|r| {
            let weight = r.comment.as_deref().map_or(0, super::reply_weight);
            weight * r.packets.unwrap_or(0) as i64
        });
        Ok(Some(weighed.sum::<i64>().max(0) as u64))
    }

    fn remove(&mut self) -> Result<(), super::Error> {
        Ok(self.delete()?)
    }

    fn trial(&mut self, rules: &RuleSet) -> Result<(), super::Error> {
        match batch::trial(rules)? {
            Some((batch, described)) => Ok(self.send_batch(&batch, &described)?),
            None => Ok(()),
        }
    }

    /// Its own socket: a dump on it cannot mix with a batch on this one.
    fn reader(&self) -> Result<Box<dyn Dataplane>, super::Error> {
        Ok(Box::new(Nftables::new()?))
    }
}

#[cfg(test)]
#[forbid(unsafe_code)]
mod tests;
