//! UDP, the listening side: each query received with the address it was sent to and sent on
//! to the upstream on a socket of the pool (`upstream.rs`), whose task sends its answer back
//! from that address.
//!
//! Queries come in and go out in batches: one `recvmmsg` takes every query waiting, up to
//! [`BATCH`], and one `sendmmsg` sends them all on one socket of the pool; their answers go back
//! a batch per `sendmmsg` too ([`send_answers`]). Under load a wake-up and two system calls
//! serve a batch where they served one query; idle, a batch is one query.
//! (The kernel's work per packet stays: it is most of the forwarder's CPU; see docs/benchmark.md,
//! *The link-local shape in the benchmark*.)

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use nix::sys::socket::{
    recvmmsg, sendmmsg, ControlMessage, ControlMessageOwned, MsgFlags, MultiHeaders,
    SockaddrStorage,
};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::task::JoinSet;

use super::ids::HEADER_LEN;
use super::lease;
use super::upstream::{Origin, Outgoing, Pool};
use super::{count, report_task_end, Counters, Error, Options};

/// The largest DNS message UDP carries: a datagram is received whole.
pub(super) const MAX_MESSAGE: usize = u16::MAX as usize;

/// The most datagrams one system call receives or sends.
pub(super) const BATCH: usize = 32;

/// Room for [`BATCH`] datagrams of up to [`MAX_MESSAGE`] bytes each: 2 MiB of address space,
/// allocated zeroed (mapped on demand), of which a page or two per slot is ever written.
pub(super) struct Buffers(Vec<u8>);

impl Buffers {
    pub(super) fn new() -> Buffers {
        Buffers(vec![0; BATCH * MAX_MESSAGE])
    }

    /// Slot `at`.
    pub(super) fn slot(&self, at: usize) -> &[u8] {
        &self.0[at * MAX_MESSAGE..(at + 1) * MAX_MESSAGE]
    }

    /// Slot `at`, to write in.
    pub(super) fn slot_mut(&mut self, at: usize) -> &mut [u8] {
        &mut self.0[at * MAX_MESSAGE..(at + 1) * MAX_MESSAGE]
    }

    /// Every slot, as the vectors of a `recvmmsg`: one each.
    pub(super) fn receiving(&mut self) -> Vec<[IoSliceMut<'_>; 1]> {
        self.0.chunks_mut(MAX_MESSAGE).map(|slot| [IoSliceMut::new(slot)]).collect()
    }
}

/// Receives queries on `socket` (bound to `listen`) until receiving fails for good, each sent on
/// to the upstream on a socket of `pool`, at most `options.max_in_flight` at once and
/// `options.max_in_flight_per_client` of one client address (the pool's shares); the pool's
/// tasks send the answers back. Renews `lease` (if any) between batches, as it falls due: only
/// while this task is polled.
pub(super) async fn serve(
    socket: Arc<UdpSocket>,
    listen: SocketAddr,
    mut pool: Pool,
    options: Options,
    counters: Arc<Counters>,
    lease: Option<lease::Holder>,
) -> Result<Infallible, Error> {
    let mut renewals = lease.map(lease::Holder::start);
    pool.connect().await;
    // Dropped with this future: the sockets' tasks end, every query in flight with them.
    let mut answering = JoinSet::new();
    let mut answers_of = HashMap::new();
    for upstream in pool.sockets() {
        let task =
            answering.spawn(upstream.clone().answer(socket.clone(), counters.clone(), options));
        answers_of.insert(task.id(), upstream.clone());
    }
    let shares = pool.shares();
    let mut buffers = Buffers::new();
    let mut received = Vec::with_capacity(BATCH);
    let mut outgoing = Vec::with_capacity(BATCH);
    loop {
        let got = tokio::select! {
            Some(ended) = answering.join_next_with_id() => {
                // Only a panic (a bug) ends a socket's task: the socket gets another.
                let Err(panicked) = ended;
                let id = panicked.id();
                report_task_end(Err(panicked));
                if let Some(upstream) = answers_of.remove(&id) {
                    let task =
                        answering.spawn(upstream.clone().answer(socket.clone(), counters.clone(), options));
                    answers_of.insert(task.id(), upstream);
                }
                continue;
            }
            () = lease::due(&mut renewals) => {
                if let Some(renewals) = &mut renewals {
                    renewals.renew();
                }
                continue;
            }
            got = socket.async_io(Interest::READABLE, || {
                receive(socket.as_raw_fd(), &mut buffers, &mut received)
            }) => got,
        };
        match got {
            Ok(()) => {}
            Err(error) if passing(&error) => {
                tracing::debug!(%listen, %error, "receiving UDP queries failed");
                continue;
            }
            Err(source) => return Err(Error::Receive { listen, source }),
        }
        // The whole batch goes on one socket of the pool, each batch on the next.
        let upstream = pool.next();
        {
            // One lock of the shares for the batch, let go before the batch is sent.
            let mut held = shares.lock();
            let deadline = Instant::now() + options.upstream_timeout;
            outgoing.clear();
            for (slot, received) in received.iter().enumerate() {
                if received.len < HEADER_LEN || received.truncated {
                    count(&counters.dropped_malformed);
                    continue;
                }
                let (Some(client), Some(destination)) = (received.client, received.destination)
                else {
                    // Cannot happen with pktinfo on; without a destination, no right source to
                    // answer from.
                    count(&counters.answer_failures);
                    continue;
                };
                if upstream.pool_in_flight() >= options.max_in_flight {
                    count(&counters.dropped_busy);
                    continue;
                }
                if !held.take(client.ip()) {
                    count(&counters.dropped_busy);
                    count(&counters.dropped_over_share);
                    continue;
                }
                let query = &mut buffers.slot_mut(slot)[..received.len];
                let origin =
                    Origin { client, id: u16::from_be_bytes([query[0], query[1]]), destination };
                let Some(id) = upstream.insert(query, origin, deadline) else {
                    held.give_back(client.ip());
                    count(&counters.dropped_busy);
                    continue;
                };
                count(&counters.udp_queries);
                query[..2].copy_from_slice(&id.to_be_bytes());
                outgoing.push(Outgoing { slot, len: received.len, id });
            }
        }
        upstream.send(&buffers, &outgoing, &counters).await;
    }
}

/// A datagram as [`receive`] got it.
#[derive(Debug)]
pub(super) struct Received {
    /// Its length.
    pub(super) len: usize,
    /// It did not fit its slot.
    pub(super) truncated: bool,
    /// Its source.
    pub(super) client: Option<SocketAddr>,
    /// Its destination, from the pktinfo control message.
    pub(super) destination: Option<IpAddr>,
}

/// Receives the datagrams waiting on `fd`, up to [`BATCH`], each into its slot of `buffers`
/// (the first into the first), with its source and (from pktinfo) its destination, into
/// `received`. WouldBlock when none waits.
pub(super) fn receive(
    fd: RawFd,
    buffers: &mut Buffers,
    received: &mut Vec<Received>,
) -> io::Result<()> {
    // Made for each call: nix's headers hold pointers, and the task that owns them must be
    // Send. Three small allocations per batch.
    let control = nix::cmsg_space!(libc::in6_pktinfo);
    let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(BATCH, Some(control));
    let mut slots = buffers.receiving();
    let messages = recvmmsg(fd, &mut headers, slots.iter_mut(), MsgFlags::MSG_DONTWAIT, None)?;
    received.clear();
    received.extend(messages.map(|message| Received {
        len: message.bytes,
        truncated: message.flags.contains(MsgFlags::MSG_TRUNC),
        client: message.address.as_ref().and_then(socket_addr),
        // A truncated control message (ENOBUFS) leaves the destination unknown.
        destination: message.cmsgs().ok().and_then(|mut cmsgs| cmsgs.find_map(|c| destination(&c))),
    }));
    Ok(())
}

/// The destination address a pktinfo control message reports: the packet header's (`ipi_addr`),
/// which TPROXY leaves as the client wrote it. (`ipi_spec_dst` is the local address routing
/// would answer from, which for an address that is not local is another one.)
pub(super) fn destination(message: &ControlMessageOwned) -> Option<IpAddr> {
    match message {
        ControlMessageOwned::Ipv4PacketInfo(info) => {
            Some(IpAddr::V4(Ipv4Addr::from(info.ipi_addr.s_addr.to_ne_bytes())))
        }
        ControlMessageOwned::Ipv6PacketInfo(info) => {
            Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// The pktinfo that makes `sendmsg` send from `source`: IPv4 takes an outgoing packet's source
/// from `ipi_spec_dst` (and ignores `ipi_addr`); interface 0 leaves the choice to routing.
pub(super) fn answer_source_v4(source: Ipv4Addr) -> libc::in_pktinfo {
    libc::in_pktinfo {
        ipi_ifindex: 0,
        ipi_spec_dst: libc::in_addr { s_addr: u32::from_ne_bytes(source.octets()) },
        ipi_addr: libc::in_addr { s_addr: 0 },
    }
}

/// The pktinfo that makes `sendmsg` send from `source` (IPv6: `ipi6_addr`).
pub(super) fn answer_source_v6(source: Ipv6Addr) -> libc::in6_pktinfo {
    libc::in6_pktinfo { ipi6_addr: libc::in6_addr { s6_addr: source.octets() }, ipi6_ifindex: 0 }
}

/// An answer of a batch, to go back to its client.
#[derive(Clone, Copy, Debug)]
pub(super) struct Reply {
    /// Its slot in the batch's buffers (under the client's id already).
    pub(super) slot: usize,
    /// Its length.
    pub(super) len: usize,
    /// Who asked.
    pub(super) client: SocketAddr,
    /// The address the client asked: the answer's source.
    pub(super) source: IpAddr,
}

/// Sends `replies` (their bytes in `buffers`), which share one source, on `fd` in one system
/// call; returns how many the kernel took (the first, at least). The source is the socket's
/// port and the pktinfo given once for all of them, so a batch has one source address (a
/// forwarder's clients all ask the link-local IP of its family).
pub(super) fn send_answers(fd: RawFd, buffers: &Buffers, replies: &[Reply]) -> io::Result<usize> {
    let replies = &replies[..replies.len().min(BATCH)];
    let Some(first) = replies.first() else { return Ok(0) };
    let slices: Vec<[IoSlice<'_>; 1]> =
        replies.iter().map(|r| [IoSlice::new(&buffers.slot(r.slot)[..r.len])]).collect();
    let clients: Vec<Option<SockaddrStorage>> =
        replies.iter().map(|r| Some(SockaddrStorage::from(r.client))).collect();
    let flags = MsgFlags::empty();
    // Each header's control buffer is exactly one pktinfo long: the kernel reads no further.
    let sent = match first.source {
        IpAddr::V4(source) => {
            let info = answer_source_v4(source);
            let control = [ControlMessage::Ipv4PacketInfo(&info)];
            let space = nix::cmsg_space!(libc::in_pktinfo);
            let mut headers = MultiHeaders::preallocate(slices.len(), Some(space));
            sendmmsg(fd, &mut headers, &slices, &clients, control, flags).map(|s| s.count())
        }
        IpAddr::V6(source) => {
            let info = answer_source_v6(source);
            let control = [ControlMessage::Ipv6PacketInfo(&info)];
            let space = nix::cmsg_space!(libc::in6_pktinfo);
            let mut headers = MultiHeaders::preallocate(slices.len(), Some(space));
            sendmmsg(fd, &mut headers, &slices, &clients, control, flags).map(|s| s.count())
        }
    };
    sent.map_err(io::Error::from)
}

/// A datagram's source as a [`SocketAddr`].
fn socket_addr(address: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = address.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    address.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}

/// Whether a failed receive is worth retrying: a signal, or the kernel short of memory for a
/// moment. Anything else means the socket is broken.
fn passing(error: &io::Error) -> bool {
    matches!(error.kind(), io::ErrorKind::Interrupted | io::ErrorKind::OutOfMemory)
        || error.raw_os_error() == Some(libc::ENOBUFS)
}
