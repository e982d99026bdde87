//! The agent's own copy of each link-local listen IP, on `lo`, over rtnetlink.
//!
//! In the link-local shape pods send their queries to the cache's IP itself (169.254.20.10,
//! fd00:169:254::10). node-cache puts those IPs on its own interface, `nodelocaldns`, and deletes
//! that interface when it stops, at every rolling update. Once the last copy of an IP is gone it
//! is no longer local: pods' queries cannot be delivered on the node at all, and the agent's
//! fallback, a TPROXY to its forwarder, needs the IP local. So the agent keeps a copy of each IP
//! on `lo` (docs/design/link-local.md §1, §3): the same IPv4 /32 or IPv6 /128 on two interfaces
//! stays local when one of them is deleted, as long as the one left is up, and `lo` always is.
//! Why `lo` and not an interface of the agent's: `dummy` is a module some kernels lack (the one
//! this was built on does), and `lo` is one code path on every node.
//!
//! A copy changes nothing but that the IP stays local (each checked on 6.18, `tests.rs`):
//!
//! * **IPv4**: `IP/32 scope host label lo:nlha`. Not `scope global`, which `ip addr add` gives:
//!   the kernel picks the source of a packet leaving by an interface without an IPv4 address of
//!   its own (Calico's host-side veths) among every device's global addresses, `lo`'s first, so
//!   a global copy would become the source of the node's traffic to its pods. Delivery to the IP
//!   and the local route do not depend on the scope.
//! * **IPv6**: `IP/128 nodad noprefixroute preferred_lft 0`. IPv6 has no scope to set, and a
//!   preferred ULA on `lo` won the source selection for another ULA destination over the node's
//!   own address; a deprecated address is never chosen as a source but for itself (RFC 6724
//!   rules 1 and 3), and it stays local, bindable and able to answer. `nodad`: usable at once.
//!
//! **Ownership**, so that teardown removes only the agent's copies: each is added with the
//! address protocol (`IFA_PROTO`, kernel ≥ 5.18) [`PROTO`]. A kernel older than 5.18 ignores
//! the attribute and lists no address with one; there (see [`is_ours`]) a listen IP on `lo`, or an
//! IPv4 address labelled [`LABEL`], counts as the agent's: node-cache never puts an address on
//! `lo`. An address already on `lo`, ours or not, counts as present and is never taken over.
//!
//! Every function is blocking (a dump and a request per address on a `NETLINK_ROUTE` socket, each
//! answer awaited at most [`REPLY_TIMEOUT_SECS`]) and acts on the network namespace of the calling
//! thread. Listing needs no privilege; adding and deleting need `CAP_NET_ADMIN`.
//!
//! `ifaddr` reads and writes the messages; this file holds the decisions and the exchange.

pub(crate) mod ifaddr;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::socket::{self, sockopt, MsgFlags, NetlinkAddr, SockProtocol};
use nix::sys::time::TimeVal;

use crate::netlink::{self, ParseError};
use ifaddr::{Address, Answer};

/// The address protocol (`IFA_PROTO`) of the agent's copies: `n`, for nodelocaldns-ha. The
/// kernel uses 0 to 3 (`IFAPROT_UNSPEC`, `_KERNEL_LO`, `_KERNEL_RA`, `_KERNEL_LL`; iproute2's
/// `rt_addrprotos` names only those). The rest is free for userspace, without a registry; the
/// users known here take other values: keepalived 18 (its `RTPROT_KEEPALIVED`), OVN-Kubernetes
/// 85. A tool that also chose 0x6e would have its addresses on `lo` taken for the agent's by
/// [`remove_ours`].
pub const PROTO: u8 = 0x6e;
/// The label of the agent's IPv4 copies, so that `ip addr` says whose they are (IPv6 addresses
/// have no label).
pub const LABEL: &str = "lo:nlha";
/// `lo`'s interface index, the same in every network namespace (`LOOPBACK_IFINDEX`,
/// include/net/flow.h, which the loopback driver gives it).
pub const LOOPBACK_INDEX: u32 = 1;
/// How long to wait for each of the kernel's answers.
pub const REPLY_TIMEOUT_SECS: i64 = 5;
/// The receive buffer: the kernel's dump datagrams are at most 32 KiB.
const RECV_BUFFER: usize = 64 << 10;
/// Dumps taken while the addresses keep changing underneath.
const DUMP_ATTEMPTS: usize = 3;

/// What handling the agent's copies on `lo` failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The `NETLINK_ROUTE` socket could not be opened or set up.
    #[error("opening a NETLINK_ROUTE socket failed: {0}")]
    Open(#[source] Errno),
    /// A request could not be sent.
    #[error("sending {what} to the kernel failed: {source}")]
    Send {
        /// What was being sent.
        what: &'static str,
        /// The socket's error.
        #[source]
        source: Errno,
    },
    /// The kernel's answer did not arrive, or did not fit the buffer.
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
    /// The kernel's answer could not be parsed.
    #[error(
        "the kernel's answer to {what} could not be parsed: {source} \
         (please report it with the kernel version)"
    )]
    Malformed {
        /// What the answer was to.
        what: &'static str,
        /// What is wrong with it.
        #[source]
        source: ParseError,
    },
    /// The kernel refused to list the addresses.
    #[error("listing the network namespace's addresses failed: {0}")]
    List(#[source] Errno),
    /// Every dump was interrupted by a change of the addresses.
    #[error(
        "the addresses kept changing while they were listed ({DUMP_ATTEMPTS} attempts); \
         is another process adding and deleting addresses in a loop?"
    )]
    Unsettled,
    /// The kernel refused to add a copy.
    #[error(
        "adding the agent's copy of {ip} to lo failed: {source} (EPERM: needs CAP_NET_ADMIN \
         in the node's network namespace; for IPv6, EACCES: IPv6 is disabled on lo, \
         EAFNOSUPPORT: in the kernel)"
    )]
    Add {
        /// The IP.
        ip: IpAddr,
        /// The kernel's error.
        #[source]
        source: Errno,
    },
    /// The kernel refused to delete a copy.
    #[error(
        "removing the agent's copy of {ip} from lo failed: {source} \
         (EPERM: needs CAP_NET_ADMIN in the node's network namespace)"
    )]
    Remove {
        /// The IP.
        ip: IpAddr,
        /// The kernel's error.
        #[source]
        source: Errno,
    },
}

/// Adds the agent's copy of each of `ips` that `lo` lacks; an IP already on `lo`, the agent's
/// copy or anyone's address, counts as present and is left as it is. Idempotent. Returns the IPs
/// it added (none when all were there), in the order given.
///
/// An IPv6 copy becomes local a moment after: the kernel acknowledges an IPv6 address before a
/// workqueue job inserts its local route (2 of 200 additions on an idle 6.18 were not yet
/// routable at the acknowledgement). An IPv4 copy is local when this returns.
pub fn ensure(ips: &[IpAddr]) -> Result<Vec<IpAddr>, Error> {
    let mut rtnl = Rtnl::open()?;
    let mut added = Vec::new();
    for ip in missing_on_lo(&rtnl.addresses()?, ips) {
        if rtnl.add_copy(ip)? {
            added.push(ip);
        }
    }
    Ok(added)
}

/// Which of `ips` are not on `lo` now (for a level-triggered repair): one dump.
pub fn missing(ips: &[IpAddr]) -> Result<Vec<IpAddr>, Error> {
    Ok(missing_on_lo(&Rtnl::open()?.addresses()?, ips))
}

/// Deletes every address on `lo` that is the agent's (see [`is_ours`]; `listen_ips` matter only
/// on a kernel older than 5.18). Returns the IPs it removed; `Ok` and none when there was none.
pub fn remove_ours(listen_ips: &[IpAddr]) -> Result<Vec<IpAddr>, Error> {
    let mut rtnl = Rtnl::open()?;
    let listed = rtnl.addresses()?;
    let mut removed = Vec::new();
    for address in ours(&listed, listen_ips) {
        if rtnl.delete(address)? {
            removed.push(address.local);
        }
    }
    Ok(removed)
}

/// `ips` (each once, IPv4-mapped IPv6 as IPv4) that no address on `lo` in `listed` carries,
/// whatever its prefix length, owner or flags.
fn missing_on_lo(listed: &[Address], ips: &[IpAddr]) -> Vec<IpAddr> {
    let on_lo: BTreeSet<IpAddr> =
        listed.iter().filter(|a| a.index == LOOPBACK_INDEX).map(|a| a.local).collect();
    let mut seen = BTreeSet::new();
    ips.iter()
        .map(|ip| ip.to_canonical())
        .filter(|ip| !on_lo.contains(ip) && seen.insert(*ip))
        .collect()
}

/// The agent's addresses on `lo` in `listed`, a dump of the whole namespace.
fn ours<'a>(listed: &'a [Address], listen_ips: &[IpAddr]) -> Vec<&'a Address> {
    let protos_kept = listed.iter().any(|a| a.proto.is_some());
    listed.iter().filter(|a| is_ours(a, protos_kept, listen_ips)).collect()
}

/// Whether `address` is one of the agent's copies: on `lo`, and
///
/// * where the kernel keeps address protocols (`protos_kept`: some address of the dump carries
///   one; from 5.18 on, `::1` and every IPv6 link-local address do), with protocol [`PROTO`];
/// * where it does not (before 5.18), one of `listen_ips`, or an IPv4 address labelled
///   [`LABEL`]. node-cache never puts its IPs on `lo`, so such an address is the agent's unless
///   someone else put a listen IP on `lo` by hand: that one would be removed too.
///
/// A kernel ≥ 5.18 with IPv6 off and none of the agent's copies lists no protocol either, and is
/// judged by the second rule, with the same limit.
pub(crate) fn is_ours(address: &Address, protos_kept: bool, listen_ips: &[IpAddr]) -> bool {
    let mine = match address.proto {
        Some(proto) => proto == PROTO,
        None if protos_kept => false,
        None => {
            listen_ips.iter().any(|ip| ip.to_canonical() == address.local)
                || (address.local.is_ipv4() && address.label.as_deref() == Some(LABEL))
        }
    };
    address.index == LOOPBACK_INDEX && mine
}

/// A `NETLINK_ROUTE` socket and its conversation with the kernel: one request at a time, each
/// answer read to its end.
struct Rtnl {
    socket: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl Rtnl {
    /// Opens a socket in the calling thread's network namespace.
    fn open() -> Result<Rtnl, Error> {
        let socket = netlink::socket::open(SockProtocol::NetlinkRoute).map_err(Error::Open)?;
        netlink::socket::bind(&socket, &[]).map_err(Error::Open)?;
        let timeout = TimeVal::new(REPLY_TIMEOUT_SECS, 0);
        socket::setsockopt(&socket, sockopt::ReceiveTimeout, &timeout).map_err(Error::Open)?;
        Ok(Rtnl { socket, seq: 0, buf: vec![0; RECV_BUFFER] })
    }

    /// Every address of the namespace, from one dump the kernel did not flag as interrupted.
    fn addresses(&mut self) -> Result<Vec<Address>, Error> {
        for _ in 0..DUMP_ATTEMPTS {
            let answer = self.exchange("the address dump", ifaddr::dump_request)?;
            if let Some(Err(errno)) = answer.outcome {
                return Err(Error::List(Errno::from_raw(errno)));
            }
            if !answer.interrupted {
                return Ok(answer.addresses);
            }
        }
        Err(Error::Unsettled)
    }

    /// Adds the agent's copy of `ip` to `lo`: `false` when the kernel says it is there already
    /// (`EEXIST`: the same address and prefix length on `lo`, left untouched).
    fn add_copy(&mut self, ip: IpAddr) -> Result<bool, Error> {
        let answer = self.exchange("an address to add", |seq| ifaddr::copy_request(ip, seq))?;
        match answer.outcome {
            Some(Err(errno)) if errno == Errno::EEXIST as i32 => Ok(false),
            Some(Err(errno)) => Err(Error::Add { ip, source: Errno::from_raw(errno) }),
            _ => Ok(true),
        }
    }

    /// Deletes `address`: `false` when it was gone already (`EADDRNOTAVAIL`).
    fn delete(&mut self, address: &Address) -> Result<bool, Error> {
        let request = |seq| ifaddr::delete_request(address, seq);
        let answer = self.exchange("an address to delete", request)?;
        match answer.outcome {
            Some(Err(errno)) if errno == Errno::EADDRNOTAVAIL as i32 => Ok(false),
            Some(Err(errno)) => {
                Err(Error::Remove { ip: address.local, source: Errno::from_raw(errno) })
            }
            _ => Ok(true),
        }
    }

    /// Sends the request `build` makes for the next sequence number and reads its whole answer.
    fn exchange(
        &mut self,
        what: &'static str,
        build: impl FnOnce(u32) -> Vec<u8>,
    ) -> Result<Answer, Error> {
        self.seq = self.seq.wrapping_add(1);
        let request = build(self.seq);
        socket::sendto(
            self.socket.as_raw_fd(),
            &request,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .map_err(|source| Error::Send { what, source })?;
        let mut answer = Answer::default();
        while answer.outcome.is_none() {
            let len = self.receive(what)?;
            ifaddr::read_answer(&self.buf[..len], self.seq, &mut answer)
                .map_err(|source| Error::Malformed { what, source })?;
        }
        Ok(answer)
    }

    /// Receives the kernel's next datagram into the buffer; its length. Datagrams from anyone
    /// else (any local process may send to this socket's port) are dropped.
    fn receive(&mut self, what: &'static str) -> Result<usize, Error> {
        loop {
            match socket::recvfrom::<NetlinkAddr>(self.socket.as_raw_fd(), &mut self.buf) {
                Err(Errno::EINTR) => {}
                Err(source) => return Err(Error::Receive { what, source }),
                Ok((_, Some(from))) if from.pid() != 0 => {}
                // A full buffer may hold a cut datagram; the kernel's are at most half of it.
                Ok((len, _)) if len >= self.buf.len() => {
                    return Err(Error::Receive { what, source: Errno::EMSGSIZE })
                }
                Ok((len, _)) => return Ok(len),
            }
        }
    }
}

#[cfg(test)]
mod tests;
