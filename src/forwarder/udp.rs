//! UDP: each query received with the address it was sent to, sent on to the upstream on a
//! socket of its own, and its answer sent back from that address.

use std::convert::Infallible;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{
    recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags, SockaddrIn, SockaddrIn6,
    SockaddrStorage,
};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::{count, report_task_end, Counters, Error, Options};

/// The largest DNS message UDP carries: a datagram is received whole.
const MAX_MESSAGE: usize = u16::MAX as usize;

/// The length of a DNS header: a shorter datagram is no query.
const HEADER_LEN: usize = 12;

/// Receives queries on `socket` (bound to `listen`) until receiving fails for good, each sent on
/// to `upstream` by a task of its own, at most `options.max_in_flight` at once.
pub(super) async fn serve(
    socket: Arc<UdpSocket>,
    listen: SocketAddr,
    upstream: SocketAddr,
    options: Options,
    counters: Arc<Counters>,
) -> Result<Infallible, Error> {
    let in_flight = Arc::new(Semaphore::new(options.max_in_flight));
    // Dropped with this future: every query in flight is aborted.
    let mut queries = JoinSet::new();
    let mut buffer = vec![0; MAX_MESSAGE];
    let mut control = nix::cmsg_space!(libc::in6_pktinfo);
    loop {
        let received = tokio::select! {
            Some(ended) = queries.join_next() => {
                report_task_end(ended);
                continue;
            }
            received = socket.async_io(Interest::READABLE, || {
                receive(socket.as_raw_fd(), &mut buffer, &mut control)
            }) => received,
        };
        let received = match received {
            Ok(received) => received,
            Err(error) if passing(&error) => {
                tracing::debug!(%listen, %error, "receiving a UDP query failed");
                continue;
            }
            Err(source) => return Err(Error::Receive { listen, source }),
        };
        if received.len < HEADER_LEN || received.truncated {
            count(&counters.dropped_malformed);
            continue;
        }
        let (Some(client), Some(destination)) = (received.client, received.destination) else {
            // Cannot happen with pktinfo on; without a destination, no right source to answer from.
            count(&counters.answer_failures);
            continue;
        };
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            count(&counters.dropped_busy);
            continue;
        };
        count(&counters.udp_queries);
        let query = Query { wire: buffer[..received.len].to_vec(), client, destination };
        queries.spawn(forward(socket.clone(), query, upstream, options, counters.clone(), permit));
    }
}

/// A query as received.
struct Query {
    /// The message, as the client sent it.
    wire: Vec<u8>,
    /// Who sent it.
    client: SocketAddr,
    /// The address it was sent to (the link-local IP): the answer's source.
    destination: IpAddr,
}

/// Sends `query` on to `upstream` and its answer back to the client, counting how it went.
/// Holds its place among the queries in flight until then.
async fn forward(
    socket: Arc<UdpSocket>,
    query: Query,
    upstream: SocketAddr,
    options: Options,
    counters: Arc<Counters>,
    _in_flight: OwnedSemaphorePermit,
) {
    let client = query.client;
    let answer = match ask_upstream(upstream, &query.wire, options.upstream_timeout).await {
        Ok(answer) => answer,
        Err(error) => {
            count(&counters.upstream_failures);
            tracing::debug!(%client, %upstream, %error, "no answer from the upstream");
            return;
        }
    };
    let sent = socket
        .async_io(Interest::WRITABLE, || {
            send_answer(socket.as_raw_fd(), &answer, client, query.destination)
        })
        .await;
    match sent {
        Ok(()) => count(&counters.udp_answers),
        Err(error) => {
            count(&counters.answer_failures);
            tracing::debug!(%client, from = %query.destination, %error, "sending an answer failed");
        }
    }
}

/// The upstream's answer to `query`: sent on a fresh socket connected to `upstream`, which
/// takes datagrams from the upstream only (and sees its ICMP port unreachable as an error); the
/// first whose id is the query's is the answer. Bounded by `timeout`, set-up included.
async fn ask_upstream(
    upstream: SocketAddr,
    query: &[u8],
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    let exchange = async {
        let unspecified = match upstream {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let socket = UdpSocket::bind((unspecified, 0)).await?;
        socket.connect(upstream).await?;
        socket.send(query).await?;
        // The buffer is made once the answer is there, not while the query waits: thousands
        // of queries in flight would otherwise hold 64 KiB each.
        let mut answer = Vec::new();
        loop {
            socket.readable().await?;
            answer.resize(MAX_MESSAGE, 0);
            match socket.try_recv(&mut answer) {
                Ok(len) if answers(query, &answer[..len]) => {
                    answer.truncate(len);
                    return Ok(answer);
                }
                Ok(_) => {}
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Err(error),
            }
        }
    };
    tokio::time::timeout(timeout, exchange).await.unwrap_or_else(|_| {
        Err(io::Error::new(io::ErrorKind::TimedOut, format!("no answer within {timeout:?}")))
    })
}

/// Whether `answer` answers `query`: its id (the first two bytes) is the query's.
pub(super) fn answers(query: &[u8], answer: &[u8]) -> bool {
    query.get(..2).is_some_and(|id| answer.get(..2) == Some(id))
}

/// A datagram as [`receive`] got it.
#[derive(Debug)]
struct Received {
    /// Its length.
    len: usize,
    /// It did not fit the buffer.
    truncated: bool,
    /// Its source.
    client: Option<SocketAddr>,
    /// Its destination, from the pktinfo control message.
    destination: Option<IpAddr>,
}

/// Receives one datagram into `buffer`, with its source and (from pktinfo) its destination.
fn receive(fd: RawFd, buffer: &mut [u8], control: &mut [u8]) -> io::Result<Received> {
    let mut iov = [IoSliceMut::new(buffer)];
    let message = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(control), MsgFlags::empty())?;
    // A truncated control message (ENOBUFS) leaves the destination unknown.
    let destination =
        message.cmsgs().ok().and_then(|mut cmsgs| cmsgs.find_map(|c| destination(&c)));
    Ok(Received {
        len: message.bytes,
        truncated: message.flags.contains(MsgFlags::MSG_TRUNC),
        client: message.address.as_ref().and_then(socket_addr),
        destination,
    })
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

/// Sends `answer` to `client` from `source` (and the socket's own port, 53).
fn send_answer(fd: RawFd, answer: &[u8], client: SocketAddr, source: IpAddr) -> io::Result<()> {
    let iov = [IoSlice::new(answer)];
    let flags = MsgFlags::empty();
    let sent = match (client, source) {
        (SocketAddr::V4(client), IpAddr::V4(source)) => {
            let info = answer_source_v4(source);
            let control = [ControlMessage::Ipv4PacketInfo(&info)];
            sendmsg(fd, &iov, &control, flags, Some(&SockaddrIn::from(client)))
        }
        (SocketAddr::V6(client), IpAddr::V6(source)) => {
            let info = answer_source_v6(source);
            let control = [ControlMessage::Ipv6PacketInfo(&info)];
            sendmsg(fd, &iov, &control, flags, Some(&SockaddrIn6::from(client)))
        }
        _ => {
            let why = format!("client {client} and destination {source} differ in family");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        }
    };
    sent.map(drop).map_err(io::Error::from)
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
