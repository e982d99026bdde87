//! Hearing other writers: the kernel announces every nftables change in a network namespace
//! (tables, chains, rules, sets, and a new generation per batch) to the `NFNLGRP_NFTABLES`
//! multicast group. [`ChangeWatch`] listens there and [`Announced`] says which tables changed, so
//! the agent re-checks its own table at once when another tool touches it, and notices changes to
//! kube-proxy's, iptables-nft's and the node firewall's tables.

use std::collections::BTreeSet;
use std::fmt;

use nix::sys::socket::{setsockopt, sockopt, SockProtocol};

use super::objects::{self, nft_body, nft_type, NFT_MSG_NEWRULE};
use super::{Error, RECV_BUFFER};
use crate::dataplane::{TableRef, TableWatch};
use crate::netlink::socket::{self, AsyncSocket};
use crate::netlink::{attributes, messages, string};

/// `NFNLGRP_NFTABLES`: the multicast group of nftables change announcements.
const NFNLGRP_NFTABLES: u32 = libc::NFNLGRP_NFTABLES as u32;

/// `NFT_MSG_NEWGEN`: the end of a batch; it names no table (the batch's other messages do).
const NFT_MSG_NEWGEN: u16 = libc::NFT_MSG_NEWGEN as u16;
/// The table's name in every object's message: `NFTA_TABLE_NAME`, `NFTA_CHAIN_TABLE`,
/// `NFTA_RULE_TABLE`, `NFTA_SET_TABLE`, … are all attribute 1.
const OBJECT_TABLE: u16 = objects::NFTA_TABLE_NAME;
/// The chain in a rule's message.
const RULE_CHAIN: u16 = objects::NFTA_RULE_CHAIN;
/// `NFT_MSG_DELRULE`; `NFT_MSG_NEWRULE` is [`objects`]'.
const NFT_MSG_DELRULE: u16 = 8;
/// The change watch's receive buffer. Real kube-proxy (iptables mode, iptables-nft) rewrites
/// its `KUBE-SERVICES` chain whole on every sync, one rule per Service: with 5,000 Services a
/// sync announces some 10,000 rules deleted and added. At the default buffer
/// (net.core.rmem_default, 208 KiB) every sync overflowed it, each loss made the agent read
/// everything back (eight `iptables-nft` children, 20 ms), and the agent spent 30 mCPU under 10
/// EndpointSlice changes a second; at 2 MiB none was lost and it spent 10. The kernel holds this
/// only while announcements wait to be read; 8 MiB leaves room for some 20,000 Services.
const CHANGES_RECV_BUFFER: usize = 8 << 20;
/// How many chains' rule changes are kept per table; past that the table counts as changed
/// whole. kube-proxy's full sync of 50,000 rules names some 25,000 chains of its nat table,
/// which would be megabytes of names held for nothing.
const CHAINS_PER_TABLE: usize = 64;

/// What change announcements said, merged over any number of reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Announced {
    /// The tables changed, each once, sorted.
    pub tables: Vec<TableRef>,
    /// Of those, the ones changed otherwise than in their chains' rules (the table itself, a
    /// chain, a set, …), each once, sorted.
    pub whole: Vec<TableRef>,
    /// The chains whose rules changed, by table, at most [`CHAINS_PER_TABLE`] each.
    pub rules: BTreeSet<(TableRef, String)>,
    /// Something changed that could not be read (or announcements were lost): any table may
    /// have changed.
    pub unknown: bool,
}

impl Announced {
    /// Whether anything was announced.
    pub fn any(&self) -> bool {
        self.unknown || !self.tables.is_empty()
    }

    /// Whether a change to one of `tables` may have been announced.
    pub fn touches(&self, tables: &[TableRef]) -> bool {
        self.unknown || self.tables.iter().any(|t| tables.contains(t))
    }

    /// Whether a change that matters to `watch` may have been announced: any change of its
    /// table, or only one that may touch its chains.
    pub fn concerns(&self, watch: &TableWatch) -> bool {
        let table = &watch.table;
        if self.unknown || self.whole.contains(table) {
            return true;
        }
        let Some(chains) = &watch.chains else { return self.tables.contains(table) };
        self.chains_of(table).any(|chain| chains.contains(&chain))
    }

    /// The chains of `table` whose rules changed.
    fn chains_of<'a>(&'a self, table: &'a TableRef) -> impl Iterator<Item = &'a str> + 'a {
        let from = (table.clone(), String::new());
        self.rules.range(from..).take_while(move |(t, _)| t == table).map(|(_, c)| c.as_str())
    }

    /// Adds what `buf` (as received on the `NFNLGRP_NFTABLES` group) announces of the changes
    /// made by any socket but `ignore_portid`. Every nf_tables change message (of a table, a
    /// chain, a rule, a set, an object, …) carries its table's name ([`OBJECT_TABLE`]), a
    /// rule's also its chain's ([`RULE_CHAIN`]); a message that cannot be read makes the
    /// announcement `unknown`.
    pub fn add(&mut self, buf: &[u8], ignore_portid: Option<u32>) {
        // The last change counted, as its message's bytes: a busy writer's batch announces
        // thousands of rules of one chain in a row (kube-proxy rewriting `KUBE-SERVICES`), and
        // counting the same change again would change nothing.
        let mut last = None;
        for message in messages(buf) {
            let Ok(message) = message else {
                self.unknown = true;
                return;
            };
            let Some(kind) = nft_type(&message) else { continue };
            if kind == NFT_MSG_NEWGEN || Some(message.portid) == ignore_portid {
                continue;
            }
            let family = message.payload.first().copied();
            let attrs = nft_body(&message).map(|(_, attrs)| attrs).unwrap_or_default();
            let (mut name, mut chain) = (None, None);
            for attr in attributes(attrs).map_while(Result::ok) {
                match attr.kind {
                    OBJECT_TABLE => name = name.or(Some(attr.value)),
                    RULE_CHAIN => chain = chain.or(Some(attr.value)),
                    _ => {}
                }
            }
            let (Some(family), Some(name)) = (family, name) else {
                self.unknown = true;
                continue;
            };
            let chain = chain.filter(|_| [NFT_MSG_NEWRULE, NFT_MSG_DELRULE].contains(&kind));
            if last.replace((family, name, chain)) == Some((family, name, chain)) {
                continue;
            }
            self.count(TableRef { family, name: string(name) }, chain);
        }
    }

    /// Counts a change of `table`: of the rules of `chain`, or with none, of the table whole.
    fn count(&mut self, table: TableRef, chain: Option<&[u8]>) {
        if !self.whole.contains(&table) {
            match chain.map(|chain| (table.clone(), string(chain))) {
                Some(rule) if self.rules.contains(&rule) => {}
                Some(rule) if self.chains_of(&table).count() < CHAINS_PER_TABLE => {
                    self.rules.insert(rule);
                }
                _ => {
                    self.rules.retain(|(t, _)| *t != table);
                    insert(&mut self.whole, &table);
                }
            }
        }
        insert(&mut self.tables, &table);
    }
}

/// Adds `table` to the sorted `tables` unless it is there.
fn insert(tables: &mut Vec<TableRef>, table: &TableRef) {
    if let Err(at) = tables.binary_search(table) {
        tables.insert(at, table.clone());
    }
}

/// What `buf` announces (see [`Announced::add`]).
#[cfg(any(test, fuzzing))]
pub fn announced(buf: &[u8], ignore_portid: Option<u32>) -> Announced {
    let mut out = Announced::default();
    out.add(buf, ignore_portid);
    out
}

/// Hears every nftables change in the network namespace it was opened in.
pub struct ChangeWatch {
    socket: AsyncSocket,
    /// Announcements from this netlink port (the agent's own [`Nftables`](super::Nftables)) are not changes.
    ignore_portid: Option<u32>,
    buf: Vec<u8>,
}

impl fmt::Debug for ChangeWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChangeWatch")
            .field("socket", &self.socket)
            .field("ignore_portid", &self.ignore_portid)
            .finish_non_exhaustive()
    }
}

impl ChangeWatch {
    /// Watches for every nftables change in the current network namespace, the agent's own
    /// included (see [`Nftables::change_watch`](super::Nftables::change_watch) to leave those out). Must be called inside a
    /// tokio runtime.
    pub fn new() -> Result<Self, Error> {
        Self::open(None)
    }

    /// Watches for the changes made by any socket but the one with port id `ignore_portid`.
    pub(super) fn open(ignore_portid: Option<u32>) -> Result<Self, Error> {
        let failed = |e: nix::Error| Error::Watch(e.into());
        let fd = socket::open(SockProtocol::NetlinkNetFilter).map_err(failed)?;
        // Room for a busy kube-proxy's sync (see CHANGES_RECV_BUFFER); RcvBufForce passes
        // net.core.rmem_max with CAP_NET_ADMIN. Less room only costs whole read-backs.
        if setsockopt(&fd, sockopt::RcvBufForce, &CHANGES_RECV_BUFFER).is_err() {
            let _ = setsockopt(&fd, sockopt::RcvBuf, &CHANGES_RECV_BUFFER);
        }
        socket::bind(&fd, &[NFNLGRP_NFTABLES]).map_err(failed)?;
        Ok(ChangeWatch {
            socket: AsyncSocket::register(fd).map_err(Error::Watch)?,
            ignore_portid,
            buf: vec![0; RECV_BUFFER],
        })
    }

    /// Returns once a change has been announced, after reading every announcement pending: the
    /// tables changed.
    ///
    /// Lost announcements (the socket's buffer overflowed, `ENOBUFS`) make it `unknown`.
    /// Cancel-safe: dropping the future loses nothing that a later call would report.
    pub async fn changed(&mut self) -> Result<Announced, Error> {
        let ChangeWatch { socket, ignore_portid, buf } = self;
        let mut announced = Announced::default();
        loop {
            socket.readable().await.map_err(Error::Watch)?;
            loop {
                match socket.try_recv(buf) {
                    Ok(len) => announced.add(&buf[..len.min(buf.len())], *ignore_portid),
                    Err(e) if socket::lost_messages(&e) => announced.unknown = true,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(Error::Watch(e)),
                }
            }
            if announced.any() {
                return Ok(announced);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{attr, Message};
    use objects::{NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE, NFT_MSG_NEWTABLE};

    fn message(kind: u16, portid: u32, payload: &[u8]) -> Vec<u8> {
        Message { kind, flags: 0, seq: 1, portid, payload }.encode()
    }

    #[test]
    fn change_announcements() {
        let kind = |msg| (NFNL_SUBSYS_NFTABLES << 8) | msg;
        let body = |family: u8, table: &[u8]| [vec![family, 0, 0, 0], attr(1, table)].concat();
        let ours = message(kind(NFT_MSG_NEWTABLE), 4242, &body(1, b"ours\0"));
        let theirs = message(kind(NFT_MSG_NEWRULE), 99, &body(2, b"raw\0"));
        let again = message(kind(NFT_MSG_NEWCHAIN), 99, &body(2, b"raw\0"));
        let ip6 = message(kind(NFT_MSG_NEWRULE), 99, &body(10, b"raw\0"));
        let generation = message(kind(NFT_MSG_NEWGEN), 99, &[0, 0, 0, 0]);
        let raw = |family| TableRef { family, name: "raw".to_owned() };
        let ours_ref = TableRef { family: 1, name: "ours".to_owned() };

        assert!(!announced(&ours, Some(4242)).any());
        assert_eq!(announced(&ours, None).tables, std::slice::from_ref(&ours_ref));
        let all = [ours.clone(), ip6, theirs.clone(), again, generation.clone()].concat();
        let seen = announced(&all, Some(4242));
        assert_eq!(seen.tables, [raw(2), raw(10)]);
        // Those rules name no chain: they may be any chain's.
        assert_eq!((&seen.whole, seen.unknown), (&seen.tables, false));
        assert!(seen.touches(&[raw(10)]));
        assert!(!seen.touches(&[ours_ref.clone(), raw(7)]));
        // A batch's end names no table and is not a change by itself.
        assert!(!announced(&generation, None).any());
        // Unreadable: anything may have changed.
        let cut = announced(&theirs[..10], Some(4242));
        assert!(cut.unknown && cut.touches(std::slice::from_ref(&ours_ref)));
        let nameless = message(kind(NFT_MSG_NEWRULE), 99, &[2, 0, 0, 0]);
        assert!(announced(&nameless, None).unknown);
        assert!(!announced(&[], None).any());
    }

    #[test]
    fn a_watch_with_chains_is_concerned_only_by_what_may_touch_them() {
        let kind = |msg| (NFNL_SUBSYS_NFTABLES << 8) | msg;
        let rule = |msg, chain: &[u8]| {
            let body = [vec![2, 0, 0, 0], attr(1, b"filter\0"), attr(2, chain)].concat();
            message(kind(msg), 99, &body)
        };
        let filter = TableRef { family: 2, name: "filter".to_owned() };
        let watch = TableWatch { table: filter.clone(), chains: Some(vec!["INPUT", "OURS"]) };
        let everything = TableWatch::whole(filter.clone());
        // kube-proxy rewriting its chain: the table changed, nothing the watch reads.
        let churn = [rule(NFT_MSG_DELRULE, b"KUBE-FORWARD\0"), rule(NFT_MSG_NEWRULE, b"KUBE-A\0")];
        let seen = announced(&churn.concat(), None);
        assert_eq!(seen.tables, std::slice::from_ref(&filter));
        assert!(!seen.concerns(&watch) && seen.concerns(&everything));
        // A rule of a chain it reads, added or deleted.
        for msg in [NFT_MSG_NEWRULE, NFT_MSG_DELRULE] {
            let seen = announced(&[churn.concat(), rule(msg, b"INPUT\0")].concat(), None);
            assert!(seen.concerns(&watch), "{msg}");
        }
        // A chain made, changed or deleted, whichever: it may be renamed to or from one of
        // the watch's, or be a built-in chain's policy.
        let chain = [vec![2, 0, 0, 0], attr(1, b"filter\0"), attr(3, b"KUBE-NEW\0")].concat();
        let chain = message(kind(NFT_MSG_NEWCHAIN), 99, &chain);
        assert!(announced(&chain, None).concerns(&watch));
        // Another family's table of the same name, or a rule without its chain: the first is
        // not the watch's, the second may be.
        let ip6 = [vec![10, 0, 0, 0], attr(1, b"filter\0"), attr(2, b"INPUT\0")].concat();
        assert!(!announced(&message(kind(NFT_MSG_NEWRULE), 99, &ip6), None).concerns(&watch));
        let chainless = [vec![2, 0, 0, 0], attr(1, b"filter\0")].concat();
        let chainless = message(kind(NFT_MSG_NEWRULE), 99, &chainless);
        assert!(announced(&chainless, None).concerns(&watch));
        // Rules of one chain announced one after another, or a chain seen again once as many
        // chains as are kept are counted: each chain counted once, the table not whole.
        let rewrite: Vec<Vec<u8>> = (0..CHAINS_PER_TABLE)
            .flat_map(|i| [NFT_MSG_DELRULE, NFT_MSG_NEWRULE].map(|msg| (i, msg)))
            .map(|(i, msg)| rule(msg, format!("KUBE-SVC-{i}\0").as_bytes()))
            .chain([rule(NFT_MSG_NEWRULE, b"KUBE-SVC-0\0")])
            .collect();
        let seen = announced(&rewrite.concat(), None);
        assert_eq!((seen.rules.len(), seen.whole.len()), (CHAINS_PER_TABLE, 0), "{seen:?}");
        assert!(!seen.concerns(&watch), "{seen:?}");
        // A rewrite of more chains than are kept: the table counts as changed whole.
        let many: Vec<Vec<u8>> = (0..=CHAINS_PER_TABLE)
            .map(|i| rule(NFT_MSG_NEWRULE, format!("KUBE-SEP-{i}\0").as_bytes()))
            .collect();
        let seen = announced(&many.concat(), None);
        assert!(seen.rules.is_empty() && seen.concerns(&watch), "{seen:?}");
        // Lost announcements concern every watch.
        let lost = Announced { unknown: true, ..Announced::default() };
        assert!(lost.concerns(&watch));
    }
}
