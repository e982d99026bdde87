//! iptables-legacy's change detector: a table's rules as the kernel holds them, fetched in-process
//! the way `iptables-legacy-save` fetches them, with no child process.
//!
//! `IPT_SO_GET_INFO` (`IP6T_SO_GET_INFO`) on a raw socket gives a table's hooks, entry count and
//! size; `IPT_SO_GET_ENTRIES` then gives its entries, the blob `iptables-legacy-save` prints. A
//! [`Snapshot`] is both with each entry's packet and byte counters zeroed (they move with
//! traffic; nothing else in the blob does: the kernel hands out only the user-visible part of
//! each match and target). `iptables-legacy-save` is a function of that blob, so a table whose
//! snapshot equals the one taken around a read-back would print the same again: that read-back's
//! outcome still holds. Microseconds for a few hundred rules, where a save is a fork and an exec.
//!
//! Naming a table to the kernel creates it (see [`super::legacy_tables`]): callers take
//! snapshots only of tables the kernel lists. Needs CAP_NET_ADMIN (and CAP_NET_RAW for the
//! socket), as `iptables-legacy-save` does.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, PoisonError};

use nix::sys::socket::{socket, AddressFamily, SockFlag, SockProtocol, SockType};

use super::table::{Family, Table};
use crate::dataplane::iptables_sockopt;

/// `IPT_SO_GET_INFO` and `IP6T_SO_GET_INFO` (`IPT_BASE_CTL`).
const SO_GET_INFO: libc::c_int = 64;
/// `IPT_SO_GET_ENTRIES` and `IP6T_SO_GET_ENTRIES`.
const SO_GET_ENTRIES: libc::c_int = 65;
/// `XT_TABLE_MAXNAMELEN`: the name field of both requests.
const NAME_LEN: usize = 32;
/// `sizeof(struct ipt_getinfo)` (= `ip6t_getinfo`): the name, `valid_hooks`, `hook_entry[5]`,
/// `underflow[5]`, `num_entries`, `size`.
const INFO_LEN: usize = 84;
/// Where `size` is in `struct ipt_getinfo`.
const INFO_SIZE_AT: usize = 80;
/// `offsetof(struct ipt_get_entries, entrytable)`: the name, `size`, padding to 8.
const ENTRIES_AT: usize = 40;
/// Where `size` is in `struct ipt_get_entries`.
const ENTRIES_SIZE_AT: usize = 32;
/// Retries when the table changed between the two requests (the kernel says EAGAIN).
const ATTEMPTS: usize = 3;

/// A table's layout as the kernel reports it and its entries, counters zeroed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Snapshot(Vec<u8>);

/// Where `next_offset` and the counters are in one family's entries (`struct ipt_entry`,
/// `struct ip6t_entry`), and the entry's own size.
struct EntryLayout {
    size: usize,
    next_offset_at: usize,
    counters_at: usize,
}

/// `struct xt_counters`: packets and bytes, two `u64`.
const COUNTERS_LEN: usize = 16;

impl Family {
    /// The `getsockopt` level and entry layout of its x_tables.
    fn x_tables(self) -> (libc::c_int, EntryLayout) {
        match self {
            Family::V4 => {
                (libc::IPPROTO_IP, EntryLayout { size: 112, next_offset_at: 90, counters_at: 96 })
            }
            Family::V6 => (
                libc::IPPROTO_IPV6,
                EntryLayout { size: 168, next_offset_at: 142, counters_at: 152 },
            ),
        }
    }
}

/// Some iptables-legacy tables of both families as the kernel holds them now: a change detector
/// for what reads them with a save (the search for others' NOTRACK rules).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegacyTables(Vec<Option<Snapshot>>);

/// `tables` of both families ([`LegacyTables`]), each only if the kernel lists it (naming one
/// creates it); `None` when a list or a table cannot be read.
pub fn legacy_tables(tables: &[Table]) -> Option<LegacyTables> {
    let mut all = Vec::new();
    for family in Family::ALL {
        let listed = super::legacy_tables(family == Family::V6)?;
        for &table in tables {
            let snapshot = if listed.iter().any(|name| name == table.as_str()) {
                Some(take(family, table).ok()?)
            } else {
                None
            };
            all.push(snapshot);
        }
    }
    Some(LegacyTables(all))
}

/// The descriptors a check that runs every tick reads iptables-legacy through, opened at their
/// first use and kept (copies of the backend share them): each family's list of tables and a
/// raw socket for copies of its tables. A look is then a `pread` a family and two `getsockopt`s
/// a table, where opening the list and a socket each time was most of what an idle legacy node
/// cost the agent. Opened in the network namespace of the thread that first reads,
/// the agent's for its whole life.
#[derive(Clone, Debug, Default)]
pub(super) struct Kernel(Arc<Mutex<[Opened; 2]>>);

/// One family's kept descriptors, each `None` until opened (again after a failed read).
#[derive(Debug, Default)]
struct Opened {
    names: Option<File>,
    socket: Option<OwnedFd>,
}

impl Kernel {
    /// `family`'s iptables-legacy tables, as [`super::legacy_tables`] reads them: none while the
    /// list is missing (the module not loaded); `None` when it cannot be read.
    pub(super) fn listed(&self, family: Family) -> Option<Vec<String>> {
        let mut opened = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let names = &mut opened[family.index()].names;
        if names.is_none() {
            match File::open(super::table::names_path(family == Family::V6)) {
                Ok(file) => *names = Some(file),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Some(Vec::new()),
                Err(_) => return None,
            }
        }
        let read = names.as_ref().map(read_from_start)?;
        match read {
            Ok(text) => Some(text.lines().map(str::to_owned).collect()),
            Err(_) => {
                *names = None;
                None
            }
        }
    }

    /// `family`'s `table` as the kernel holds it now ([`take`]), through the kept socket.
    pub(super) fn take(&self, family: Family, table: Table) -> io::Result<Snapshot> {
        let mut opened = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let socket = &mut opened[family.index()].socket;
        if socket.is_none() {
            *socket = Some(raw_socket(family)?);
        }
        take_on(socket.as_ref().expect("just opened").as_fd(), family, table)
    }
}

/// A procfs file's whole text, read from its start (a seq_file starts over at offset 0).
fn read_from_start(file: &File) -> io::Result<String> {
    let mut text = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        match file.read_at(&mut chunk, text.len() as u64)? {
            0 => break,
            n => text.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8(text).map_err(io::Error::other)
}

/// A raw socket of `family`, in the calling thread's network namespace, as
/// iptables-legacy-save's would be.
fn raw_socket(family: Family) -> io::Result<OwnedFd> {
    let address_family = match family {
        Family::V4 => AddressFamily::Inet,
        Family::V6 => AddressFamily::Inet6,
    };
    Ok(socket(address_family, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::Raw)?)
}

/// `family`'s `table` as the kernel holds it now. The table must be one the kernel lists.
pub(super) fn take(family: Family, table: Table) -> io::Result<Snapshot> {
    take_on(raw_socket(family)?.as_fd(), family, table)
}

/// [`take`], through `socket` (a raw socket of `family`).
fn take_on(socket: BorrowedFd<'_>, family: Family, table: Table) -> io::Result<Snapshot> {
    let (level, layout) = family.x_tables();
    let mut name = [0u8; NAME_LEN];
    name[..table.as_str().len()].copy_from_slice(table.as_str().as_bytes());
    let mut last = io::Error::from(io::ErrorKind::Interrupted);
    for _ in 0..ATTEMPTS {
        let mut info = [0u8; INFO_LEN];
        info[..NAME_LEN].copy_from_slice(&name);
        iptables_sockopt::get(socket, level, SO_GET_INFO, &mut info)?;
        let size = u32::from_ne_bytes(info[INFO_SIZE_AT..INFO_SIZE_AT + 4].try_into().unwrap());
        let mut entries = vec![0u8; ENTRIES_AT + size as usize];
        entries[..NAME_LEN].copy_from_slice(&name);
        entries[ENTRIES_SIZE_AT..ENTRIES_SIZE_AT + 4].copy_from_slice(&size.to_ne_bytes());
        match iptables_sockopt::get(socket, level, SO_GET_ENTRIES, &mut entries) {
            // The table was replaced by one of another size in between: again.
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => last = e,
            Err(e) => return Err(e),
            Ok(_) => {
                let mut blob = info[NAME_LEN..].to_vec();
                blob.extend_from_slice(&entries[ENTRIES_AT..]);
                zero_counters(&mut blob[INFO_LEN - NAME_LEN..], &layout)?;
                return Ok(Snapshot(blob));
            }
        }
    }
    Err(last)
}

/// Zeroes each entry's counters in `entries`, walking them by `next_offset`.
fn zero_counters(entries: &mut [u8], layout: &EntryLayout) -> io::Result<()> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed x_tables entry");
    let mut at = 0;
    while at < entries.len() {
        let next = entries
            .get(at + layout.next_offset_at..at + layout.next_offset_at + 2)
            .map(|b| usize::from(u16::from_ne_bytes([b[0], b[1]])))
            .ok_or_else(malformed)?;
        if next < layout.size || at + next > entries.len() {
            return Err(malformed());
        }
        let counters = at + layout.counters_at;
        entries[counters..counters + COUNTERS_LEN].fill(0);
        at += next;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_zeroed_entry_by_entry_and_a_bad_walk_is_refused() {
        let (_, layout) = Family::V4.x_tables();
        // Two entries: one of 112 bytes, one of 152 (a match's worth more).
        let mut entries = vec![0xaau8; 112 + 152];
        entries[90..92].copy_from_slice(&112u16.to_ne_bytes());
        entries[112 + 90..112 + 92].copy_from_slice(&152u16.to_ne_bytes());
        let mut want = entries.clone();
        want[96..112].fill(0);
        want[112 + 96..112 + 112].fill(0);
        zero_counters(&mut entries, &layout).unwrap();
        assert_eq!(entries, want, "the counters zeroed, nothing else");

        // An offset shorter than an entry, or past the end, is not walked.
        entries[90..92].copy_from_slice(&8u16.to_ne_bytes());
        assert!(zero_counters(&mut entries, &layout).is_err());
        entries[90..92].copy_from_slice(&400u16.to_ne_bytes());
        assert!(zero_counters(&mut entries, &layout).is_err());
    }
}
