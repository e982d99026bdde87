//! The kernel's socket-destroy announcements: know at once when the cache's listening sockets die.
//!
//! Linux sends a `SOCK_DIAG_BY_FAMILY` message to every `NETLINK_SOCK_DIAG` socket subscribed to
//! the multicast groups `SKNLGRP_INET{,6}_{TCP,UDP}_DESTROY` whenever it frees a TCP or UDP socket
//! of the subscriber's network namespace (and only of that one: checked). Each message is an
//! `inet_diag_msg` (addresses, ports, state) followed by attributes, among them
//! `INET_DIAG_PROTOCOL`, which says whether it was TCP or UDP. It arrives some 10 to 150 µs after
//! the `close()`.
//!
//! What the kernel (checked on 6.18) reports for a socket at the moment it is freed:
//!
//! * every socket is in state `TCP_CLOSE` (7), **listeners included**: `tcp_close()` has already
//!   moved a listener out of `LISTEN`, so the state cannot tell a listener from a connection;
//! * an unconnected socket (a UDP server socket, a TCP listener) has a zero remote address and
//!   port; a closed connection keeps its peer's address (an aborted one, SO_LINGER 0 or dropped
//!   from a listener's backlog, loses only the peer's port).
//!
//! Hence [`ClosedSocket::is_listener_on`] asks "bound to the address and port, and connected to
//! nobody", for both transports. A socket freed by a crash and by an orderly exit look the same.
//!
//! Subscribing needs no privilege: the kernel creates the `NETLINK_SOCK_DIAG` socket with
//! `NL_CFG_F_NONROOT_RECV` (net/core/sock_diag.c; checked as uid 65534 without capabilities on
//! 6.18). Any local process may also *unicast* to our netlink port id, so messages are accepted
//! only from the kernel (port id 0); sending to the multicast groups needs `CAP_NET_ADMIN`.
//!
//! The kernel delivers one message per datagram; [`parse`] accepts several anyway.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::socket::{
    bind, recvfrom, setsockopt, socket, sockopt, AddressFamily, NetlinkAddr, SockFlag,
    SockProtocol, SockType,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::probe::Transport;

/// `SKNLGRP_INET_TCP_DESTROY` (include/uapi/linux/sock_diag.h).
const GROUP_INET_TCP_DESTROY: u32 = 1;
/// `SKNLGRP_INET_UDP_DESTROY`.
const GROUP_INET_UDP_DESTROY: u32 = 2;
/// `SKNLGRP_INET6_TCP_DESTROY`.
const GROUP_INET6_TCP_DESTROY: u32 = 3;
/// `SKNLGRP_INET6_UDP_DESTROY`.
const GROUP_INET6_UDP_DESTROY: u32 = 4;

/// `SOCK_DIAG_BY_FAMILY`: the netlink message type of every destroy announcement.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `sizeof(struct nlmsghdr)`.
const NLMSG_HDRLEN: usize = 16;
/// `sizeof(struct inet_diag_msg)`: 4 bytes of family/state/timer/retrans, a 48-byte
/// `inet_diag_sockid`, then expires, rqueue, wqueue, uid, inode (4 bytes each).
const INET_DIAG_MSG_LEN: usize = 72;
/// `sizeof(struct nlattr)`.
const NLA_HDRLEN: usize = 4;
/// `NLA_TYPE_MASK`: attribute type without the nested / byte-order flags.
const NLA_TYPE_MASK: u16 = 0x3fff;
/// `INET_DIAG_PROTOCOL`: a `u8` attribute with the socket's IP protocol.
const INET_DIAG_PROTOCOL: u16 = 10;

/// `IPPROTO_TCP`.
const IPPROTO_TCP: u8 = 6;
/// `IPPROTO_UDP`.
const IPPROTO_UDP: u8 = 17;
/// `AF_INET` as carried in `idiag_family`.
const FAMILY_INET: u8 = 2;
/// `AF_INET6` as carried in `idiag_family`.
const FAMILY_INET6: u8 = 10;

/// The receive buffer asked for: destroy announcements for every TCP connection of the node share
/// it with the few we care about, so leave room for bursts.
const RECV_BUFFER_BYTES: usize = 4 << 20;
/// One datagram holds one announcement of a few hundred bytes; this leaves ample margin.
const DATAGRAM_BYTES: usize = 32 << 10;

/// Errors of the socket-destroy watch.
#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    /// The netlink socket could not be created.
    #[error("cannot open a NETLINK_SOCK_DIAG socket")]
    Open(#[source] Errno),
    /// Joining the destroy multicast groups failed (the kernel lacks `CONFIG_INET_DIAG`, or a
    /// security module forbids netlink sockets).
    #[error(
        "cannot subscribe to the kernel's socket-destroy announcements \
         (is the kernel built with CONFIG_INET_DIAG?)"
    )]
    Subscribe(#[source] Errno),
    /// The socket could not be registered with the tokio reactor.
    #[error("cannot register the NETLINK_SOCK_DIAG socket with the async runtime")]
    Register(#[source] std::io::Error),
    /// Receiving failed for another reason than an overrun.
    #[error("receiving socket-destroy announcements failed")]
    Recv(#[source] std::io::Error),
    /// The kernel dropped announcements because the receive buffer was full (`ENOBUFS`). Not
    /// fatal: the watch keeps working, but any socket, a watched listener included, may have
    /// closed unseen, so the caller should check by other means (probe at once).
    #[error("socket-destroy announcements were lost (receive buffer overrun)")]
    Overrun,
}

impl SockDiagError {
    /// Whether this error only means "announcements were lost" and the watch is still usable.
    pub fn is_overrun(&self) -> bool {
        matches!(self, SockDiagError::Overrun)
    }
}

/// A TCP or UDP socket the kernel just freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClosedSocket {
    /// Its protocol.
    pub transport: Transport,
    /// The address and port it was bound to.
    pub local: SocketAddr,
    /// Its peer; the unspecified address with port 0 if it was not connected.
    pub remote: SocketAddr,
    /// The kernel's `sk_state` at the time it was freed (`TCP_CLOSE` = 7 in practice, for TCP
    /// listeners too; `TCP_ESTABLISHED` = 1 for a connected UDP socket).
    pub state: u8,
}

impl ClosedSocket {
    /// Whether this was a socket serving `port` on one of `addrs`: bound to that port on one of
    /// the addresses (or on the wildcard address of a matching family, which serves them all)
    /// and connected to nobody, i.e. a TCP listener or an unconnected UDP server socket. Closed
    /// TCP connections of the server (they keep their peer's address) never count.
    pub fn is_listener_on(&self, addrs: &[IpAddr], port: u16) -> bool {
        let unconnected = self.remote.ip().is_unspecified() && self.remote.port() == 0;
        unconnected
            && self.local.port() == port
            && addrs.iter().any(|&addr| serves(self.local.ip(), addr))
    }
}

/// Whether a socket bound to `local` receives traffic for `addr`. An IPv6 wildcard socket also
/// serves IPv4 unless it is IPV6_V6ONLY, which the announcement does not say: assume it does.
fn serves(local: IpAddr, addr: IpAddr) -> bool {
    let local = local.to_canonical();
    let addr = addr.to_canonical();
    match local {
        IpAddr::V4(v4) if v4.is_unspecified() => addr.is_ipv4(),
        IpAddr::V6(v6) if v6.is_unspecified() => true,
        _ => local == addr,
    }
}

/// Parses one receive buffer: every well-formed TCP or UDP destroy announcement in it, in order.
/// Other message types, other protocols and malformed messages are skipped; a netlink header
/// whose length runs past the buffer ends the parse. Never panics.
pub fn parse(buf: &[u8]) -> Vec<ClosedSocket> {
    let mut closed = Vec::new();
    for (kind, payload) in messages(buf) {
        if kind == SOCK_DIAG_BY_FAMILY {
            closed.extend(parse_inet_diag(payload));
        }
    }
    closed
}

/// The netlink messages in one receive buffer, as (type, payload); a header whose length runs
/// past the buffer (or is shorter than a header) ends them.
fn messages(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        let len = read_u32_ne(rest, 0).and_then(|len| usize::try_from(len).ok())?;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return None;
        }
        let kind = read_u16_ne(rest, 4)?;
        let payload = &rest[NLMSG_HDRLEN..len];
        rest = rest.get(align4(len)..).unwrap_or_default();
        Some((kind, payload))
    })
}

/// Parses the payload of one `SOCK_DIAG_BY_FAMILY` message: `inet_diag_msg` plus attributes.
fn parse_inet_diag(payload: &[u8]) -> Option<ClosedSocket> {
    let msg = payload.get(..INET_DIAG_MSG_LEN)?;
    let family = msg[0];
    let state = msg[1];
    let sport = u16::from_be_bytes([msg[4], msg[5]]);
    let dport = u16::from_be_bytes([msg[6], msg[7]]);
    let src = &msg[8..24];
    let dst = &msg[24..40];
    let (local, remote) = match family {
        FAMILY_INET => (ipv4(src)?, ipv4(dst)?),
        FAMILY_INET6 => (ipv6(src)?, ipv6(dst)?),
        _ => return None,
    };
    let transport = match protocol_attribute(payload.get(align4(INET_DIAG_MSG_LEN)..)?)? {
        IPPROTO_TCP => Transport::Tcp,
        IPPROTO_UDP => Transport::Udp,
        _ => return None,
    };
    Some(ClosedSocket {
        transport,
        local: SocketAddr::new(local, sport),
        remote: SocketAddr::new(remote, dport),
        state,
    })
}

/// The value of the `INET_DIAG_PROTOCOL` attribute, if present and well-formed.
fn protocol_attribute(mut attrs: &[u8]) -> Option<u8> {
    while attrs.len() >= NLA_HDRLEN {
        let len = usize::from(read_u16_ne(attrs, 0)?);
        let kind = read_u16_ne(attrs, 2)? & NLA_TYPE_MASK;
        if len < NLA_HDRLEN || len > attrs.len() {
            return None;
        }
        if kind == INET_DIAG_PROTOCOL {
            return attrs.get(NLA_HDRLEN..len)?.first().copied();
        }
        attrs = attrs.get(align4(len)..).unwrap_or_default();
    }
    None
}

fn ipv4(bytes: &[u8]) -> Option<IpAddr> {
    let octets: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    Some(IpAddr::V4(Ipv4Addr::from(octets)))
}

fn ipv6(bytes: &[u8]) -> Option<IpAddr> {
    let octets: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
    Some(IpAddr::V6(Ipv6Addr::from(octets)))
}

fn read_u16_ne(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(buf.get(at..at + 2)?.try_into().ok()?))
}

fn read_u32_ne(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

/// `NLMSG_ALIGN` / `NLA_ALIGN`.
fn align4(len: usize) -> usize {
    len.saturating_add(3) & !3
}

/// `NLM_F_REQUEST`.
const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`).
const NLM_F_DUMP: u16 = 0x300;
/// `NLMSG_ERROR`.
const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`.
const NLMSG_DONE: u16 = 3;
/// `TCP_CLOSE`: the state of an unconnected UDP socket.
const STATE_CLOSE: u32 = 7;
/// `TCP_LISTEN`.
const STATE_LISTEN: u32 = 10;
/// `sizeof(struct inet_diag_req_v2)`.
const INET_DIAG_REQ_V2_LEN: usize = 56;
/// How long a dump may take before it is given up.
const DUMP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// A socket serving a port, as the kernel lists it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    pub transport: Transport,
    /// The address and port it is bound to.
    pub local: SocketAddr,
    /// The kernel's socket cookie: unique among the sockets of this boot, never reused.
    pub cookie: u64,
}

/// The TCP listeners and unconnected UDP sockets of the current network namespace that serve
/// `port` on one of `addrs` (bound to it, or to a matching wildcard), with their cookies: a
/// `SOCK_DIAG_BY_FAMILY` dump for each family and transport. Blocking, bounded by one second
/// per dump; needs no privilege.
pub fn listeners(addrs: &[IpAddr], port: u16) -> Result<Vec<Listener>, SockDiagError> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )
    .map_err(SockDiagError::Open)?;
    let timeout = nix::sys::time::TimeVal::new(DUMP_TIMEOUT.as_secs() as _, 0);
    setsockopt(&fd, sockopt::ReceiveTimeout, &timeout).map_err(SockDiagError::Open)?;
    let mut found = Vec::new();
    let mut buf = vec![0u8; DATAGRAM_BYTES];
    for family in [FAMILY_INET, FAMILY_INET6] {
        for (protocol, states) in [(IPPROTO_UDP, STATE_CLOSE), (IPPROTO_TCP, STATE_LISTEN)] {
            let request = dump_request(family, protocol, 1 << states);
            nix::sys::socket::sendto(
                fd.as_raw_fd(),
                &request,
                &NetlinkAddr::new(0, 0),
                nix::sys::socket::MsgFlags::empty(),
            )
            .map_err(|e| SockDiagError::Recv(e.into()))?;
            loop {
                let (len, from) = recvfrom::<NetlinkAddr>(fd.as_raw_fd(), &mut buf)
                    .map_err(|e| SockDiagError::Recv(e.into()))?;
                if from.is_some_and(|f| f.pid() != 0) {
                    continue;
                }
                let (sockets, done) = parse_dump(buf.get(..len).unwrap_or_default(), protocol)
                    .map_err(SockDiagError::Recv)?;
                found.extend(sockets.into_iter().filter(|l| {
                    let socket = ClosedSocket {
                        transport: l.transport,
                        local: l.local,
                        remote: SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
                        state: 0,
                    };
                    socket.is_listener_on(addrs, port)
                }));
                if done {
                    break;
                }
            }
        }
    }
    Ok(found)
}

/// One dump request: `nlmsghdr` and `inet_diag_req_v2` for `family`, `protocol` and the state
/// mask `states`, every socket id field zero (no filter: the kernel's port filter is not the same
/// on every version; the caller filters).
fn dump_request(family: u8, protocol: u8, states: u32) -> Vec<u8> {
    let len = (NLMSG_HDRLEN + INET_DIAG_REQ_V2_LEN) as u32;
    let mut msg = Vec::with_capacity(len as usize);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&[family, protocol, 0, 0]);
    msg.extend_from_slice(&states.to_ne_bytes());
    msg.resize(len as usize, 0);
    msg
}

/// Parses one datagram of a dump of `protocol` sockets: the sockets in it, and whether the dump
/// is complete (`NLMSG_DONE`). An `NLMSG_ERROR` is the kernel's error. Never panics.
pub fn parse_dump(buf: &[u8], protocol: u8) -> std::io::Result<(Vec<Listener>, bool)> {
    let transport = if protocol == IPPROTO_TCP { Transport::Tcp } else { Transport::Udp };
    let mut sockets = Vec::new();
    for (kind, msg) in messages(buf) {
        match kind {
            NLMSG_DONE => return Ok((sockets, true)),
            NLMSG_ERROR => {
                let errno = msg
                    .get(..4)
                    .map_or(0, |b| i32::from_ne_bytes(b.try_into().unwrap_or_default()));
                return Err(std::io::Error::from_raw_os_error(errno.saturating_neg()));
            }
            SOCK_DIAG_BY_FAMILY => {
                let local = match (msg.first(), msg.get(8..24)) {
                    (Some(&FAMILY_INET), Some(src)) => ipv4(src),
                    (Some(&FAMILY_INET6), Some(src)) => ipv6(src),
                    _ => None,
                };
                let sport = msg.get(4..6).map(|p| u16::from_be_bytes([p[0], p[1]]));
                let cookie = (read_u32_ne(msg, 44), read_u32_ne(msg, 48));
                if let (Some(ip), Some(sport), (Some(low), Some(high))) = (local, sport, cookie) {
                    let cookie = u64::from(low) | u64::from(high) << 32;
                    sockets.push(Listener { transport, local: SocketAddr::new(ip, sport), cookie });
                }
            }
            _ => {}
        }
    }
    Ok((sockets, false))
}

/// A subscription to the kernel's TCP and UDP (IPv4 and IPv6) socket-destroy announcements in the
/// current network namespace.
#[derive(Debug)]
pub struct SocketWatch {
    fd: AsyncFd<OwnedFd>,
    buf: Vec<u8>,
}

impl SocketWatch {
    /// Opens the netlink socket and joins the four destroy groups. Needs a running tokio runtime
    /// with I/O enabled, no privilege (`CAP_NET_ADMIN` only buys a larger receive buffer). The namespace is the calling thread's at the time
    /// of the call.
    pub fn open() -> Result<Self, SockDiagError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .map_err(SockDiagError::Open)?;
        // Ask for room for bursts; RcvBufForce passes net.core.rmem_max with CAP_NET_ADMIN.
        // Failing to enlarge it is not fatal: overruns are reported by `next`.
        if setsockopt(&fd, sockopt::RcvBufForce, &RECV_BUFFER_BYTES).is_err() {
            let _ = setsockopt(&fd, sockopt::RcvBuf, &RECV_BUFFER_BYTES);
        }
        let groups = [
            GROUP_INET_TCP_DESTROY,
            GROUP_INET_UDP_DESTROY,
            GROUP_INET6_TCP_DESTROY,
            GROUP_INET6_UDP_DESTROY,
        ]
        .iter()
        .fold(0u32, |mask, group| mask | 1 << (group - 1));
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, groups)).map_err(SockDiagError::Subscribe)?;
        // tokio deprecated its safe constructors because an arbitrary `AsRawFd` may hand out a
        // different or closed descriptor later; an `OwnedFd` moved into the `AsyncFd` cannot,
        // so this use is sound, and it keeps this module free of `unsafe`.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(fd, Interest::READABLE).map_err(SockDiagError::Register)?;
        Ok(SocketWatch { fd, buf: vec![0u8; DATAGRAM_BYTES] })
    }

    /// Waits for the next announcement datagram and returns the sockets it reports (usually
    /// one; possibly none if it held only messages [`parse`] skips).
    ///
    /// [`SockDiagError::Overrun`] means announcements were lost; the watch stays usable and the
    /// caller should treat it as "a watched socket may have closed". Cancel-safe: dropping the
    /// future loses nothing.
    pub async fn next(&mut self) -> Result<Vec<ClosedSocket>, SockDiagError> {
        let SocketWatch { fd, buf } = self;
        loop {
            let mut ready = fd.readable().await.map_err(SockDiagError::Recv)?;
            let received = ready.try_io(|inner| {
                recvfrom::<NetlinkAddr>(inner.as_raw_fd(), buf).map_err(std::io::Error::from)
            });
            match received {
                // Only the kernel (port id 0) speaks for the kernel.
                Ok(Ok((len, Some(from)))) if from.pid() == 0 => {
                    return Ok(parse(buf.get(..len).unwrap_or_default()));
                }
                Ok(Ok(_)) => continue,
                Ok(Err(err)) if err.raw_os_error() == Some(Errno::ENOBUFS as i32) => {
                    return Err(SockDiagError::Overrun);
                }
                Ok(Err(err)) => return Err(SockDiagError::Recv(err)),
                Err(_would_block) => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil;

    /// Builds one netlink message as the kernel does: nlmsghdr, inet_diag_msg, attributes.
    fn announcement(
        family: u8,
        state: u8,
        protocol: Option<u8>,
        local: SocketAddr,
        remote: SocketAddr,
    ) -> Vec<u8> {
        let mut msg = vec![family, state, 0, 0];
        msg.extend_from_slice(&local.port().to_be_bytes());
        msg.extend_from_slice(&remote.port().to_be_bytes());
        for ip in [local.ip(), remote.ip()] {
            let mut field = [0u8; 16];
            match ip {
                IpAddr::V4(v4) => field[..4].copy_from_slice(&v4.octets()),
                IpAddr::V6(v6) => field.copy_from_slice(&v6.octets()),
            }
            msg.extend_from_slice(&field);
        }
        msg.extend_from_slice(&[0u8; 4]); // idiag_if
        msg.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]); // cookie
        msg.extend_from_slice(&[0u8; 20]); // expires .. inode
        assert_eq!(msg.len(), INET_DIAG_MSG_LEN);
        if let Some(protocol) = protocol {
            msg.extend_from_slice(&5u16.to_ne_bytes());
            msg.extend_from_slice(&INET_DIAG_PROTOCOL.to_ne_bytes());
            msg.extend_from_slice(&[protocol, 0, 0, 0]);
        }
        if protocol == Some(IPPROTO_TCP) {
            // INET_DIAG_INFO (tcp_info), as the kernel appends for TCP.
            msg.extend_from_slice(&(4u16 + 8).to_ne_bytes());
            msg.extend_from_slice(&2u16.to_ne_bytes());
            msg.extend_from_slice(&[0u8; 8]);
        }
        let mut out = Vec::new();
        let len = u32::try_from(NLMSG_HDRLEN + msg.len()).unwrap();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        out.extend_from_slice(&[0u8; 10]); // flags, seq, pid
        out.extend_from_slice(&msg);
        out
    }

    /// A netlink control message of `kind` with a 4-byte payload.
    fn control_message(kind: u16, payload: i32) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&20u32.to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&[0u8; 10]);
        out.extend_from_slice(&payload.to_ne_bytes());
        out
    }

    #[test]
    fn a_dump_lists_sockets_with_their_cookies_until_done() {
        let local: SocketAddr = "169.254.20.10:53".parse().unwrap();
        let nobody: SocketAddr = "0.0.0.0:0".parse().unwrap();
        let mut buf = announcement(FAMILY_INET, 7, None, local, nobody);
        let (found, done) = parse_dump(&buf, IPPROTO_UDP).unwrap();
        assert_eq!(found, [Listener { transport: Transport::Udp, local, cookie: 3 }]);
        assert!(!done, "no NLMSG_DONE yet");
        buf.extend(control_message(NLMSG_DONE, 0));
        assert!(parse_dump(&buf, IPPROTO_UDP).unwrap().1);
        let err = parse_dump(&control_message(NLMSG_ERROR, -13), IPPROTO_TCP).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(13));
        // Truncated or garbage input: no panic, nothing found.
        for cut in 0..buf.len() {
            let _ = parse_dump(&buf[..cut], IPPROTO_TCP);
        }
    }

    #[test]
    fn the_dump_request_is_what_the_kernel_expects() {
        let request = dump_request(FAMILY_INET6, IPPROTO_TCP, 1 << STATE_LISTEN);
        assert_eq!(request.len(), NLMSG_HDRLEN + INET_DIAG_REQ_V2_LEN);
        assert_eq!(read_u32_ne(&request, 0), Some(request.len() as u32));
        assert_eq!(read_u16_ne(&request, 4), Some(SOCK_DIAG_BY_FAMILY));
        assert_eq!(read_u16_ne(&request, 6), Some(NLM_F_REQUEST | NLM_F_DUMP));
        assert_eq!(&request[16..20], &[FAMILY_INET6, IPPROTO_TCP, 0, 0]);
        assert_eq!(read_u32_ne(&request, 20), Some(1 << STATE_LISTEN));
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A real announcement captured on 6.18: unconnected UDP socket on 127.0.0.1:46342.
    const CAPTURED_UDP4: &str = "6000000014000000000000000000000002070000b50600007f00000100\
        0000000000000000000000000000000000000000000000000000000000000001000000000000000000000000\
        000000ffffffff000000000000000005000a0011000000";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn captured_udp4_announcement() {
        let closed = parse(&unhex(CAPTURED_UDP4));
        assert_eq!(
            closed,
            vec![ClosedSocket {
                transport: Transport::Udp,
                local: addr("127.0.0.1:46342"),
                remote: addr("0.0.0.0:0"),
                state: 7,
            }]
        );
        assert!(closed[0].is_listener_on(&["127.0.0.1".parse().unwrap()], 46342));
    }

    #[test]
    fn udp4_server_socket() {
        let buf = announcement(
            FAMILY_INET,
            7,
            Some(IPPROTO_UDP),
            addr("169.254.20.10:53"),
            addr("0.0.0.0:0"),
        );
        let closed = parse(&buf);
        assert_eq!(closed.len(), 1);
        let socket = closed[0];
        assert_eq!(socket.transport, Transport::Udp);
        assert_eq!(socket.local, addr("169.254.20.10:53"));
        let cache: [IpAddr; 2] = ["169.254.20.10".parse().unwrap(), "10.96.0.10".parse().unwrap()];
        assert!(socket.is_listener_on(&cache, 53));
        assert!(!socket.is_listener_on(&cache, 5353));
        assert!(!socket.is_listener_on(&["10.96.0.10".parse().unwrap()], 53));
    }

    #[test]
    fn tcp6_listener_and_connections() {
        let cache: [IpAddr; 1] = ["fd00::10".parse().unwrap()];
        let listener =
            announcement(FAMILY_INET6, 7, Some(IPPROTO_TCP), addr("[fd00::10]:53"), addr("[::]:0"));
        let closed = parse(&listener);
        assert_eq!(closed.len(), 1);
        assert_eq!(closed[0].transport, Transport::Tcp);
        assert_eq!(closed[0].local, addr("[fd00::10]:53"));
        assert!(closed[0].is_listener_on(&cache, 53));

        // An accepted connection closing normally, and one aborted (peer port zeroed).
        for remote in ["[fd00::99]:40000", "[fd00::99]:0"] {
            let buf = announcement(
                FAMILY_INET6,
                7,
                Some(IPPROTO_TCP),
                addr("[fd00::10]:53"),
                addr(remote),
            );
            let closed = parse(&buf);
            assert_eq!(closed.len(), 1);
            assert!(!closed[0].is_listener_on(&cache, 53), "{remote}");
        }
    }

    #[test]
    fn wildcard_sockets_serve_their_family() {
        let v4: IpAddr = "10.96.0.10".parse().unwrap();
        let any4 = ClosedSocket {
            transport: Transport::Udp,
            local: addr("0.0.0.0:53"),
            remote: addr("0.0.0.0:0"),
            state: 7,
        };
        let any6 = ClosedSocket { local: addr("[::]:53"), remote: addr("[::]:0"), ..any4 };
        let mapped =
            ClosedSocket { local: addr("[::ffff:10.96.0.10]:53"), remote: addr("[::]:0"), ..any4 };
        assert!(any4.is_listener_on(&[v4], 53));
        assert!(!any4.is_listener_on(&["fd00::10".parse().unwrap()], 53));
        assert!(any6.is_listener_on(&[v4], 53));
        assert!(mapped.is_listener_on(&[v4], 53));
    }

    #[test]
    fn connected_udp_is_not_a_listener() {
        let buf = announcement(
            FAMILY_INET,
            1,
            Some(IPPROTO_UDP),
            addr("169.254.20.10:53"),
            addr("10.0.0.7:33000"),
        );
        let closed = parse(&buf);
        assert_eq!(closed.len(), 1);
        assert!(!closed[0].is_listener_on(&["169.254.20.10".parse().unwrap()], 53));
    }

    #[test]
    fn two_messages_in_one_buffer() {
        let mut buf = announcement(
            FAMILY_INET,
            7,
            Some(IPPROTO_UDP),
            addr("10.96.0.10:53"),
            addr("0.0.0.0:0"),
        );
        buf.extend(announcement(
            FAMILY_INET6,
            7,
            Some(IPPROTO_TCP),
            addr("[::1]:8053"),
            addr("[::]:0"),
        ));
        let closed = parse(&buf);
        assert_eq!(closed.len(), 2);
        assert_eq!(closed[0].local, addr("10.96.0.10:53"));
        assert_eq!(closed[1].local, addr("[::1]:8053"));
        assert_eq!(closed[1].transport, Transport::Tcp);
    }

    #[test]
    fn skips_what_it_cannot_use() {
        let good = announcement(
            FAMILY_INET,
            7,
            Some(IPPROTO_UDP),
            addr("10.96.0.10:53"),
            addr("0.0.0.0:0"),
        );
        // No protocol attribute, an unknown protocol, an unknown family: skipped, the next
        // message is still read.
        for bad in [
            announcement(FAMILY_INET, 7, None, addr("1.2.3.4:53"), addr("0.0.0.0:0")),
            announcement(FAMILY_INET, 7, Some(132), addr("1.2.3.4:53"), addr("0.0.0.0:0")),
            {
                let mut b = good.clone();
                b[NLMSG_HDRLEN] = 1; // AF_UNIX
                b
            },
            {
                let mut b = good.clone();
                b[4] = 3; // NLMSG_DONE
                b
            },
        ] {
            let mut buf = bad;
            buf.extend_from_slice(&good);
            assert_eq!(parse(&buf).len(), 1);
        }
    }

    #[test]
    fn truncated_and_garbage_never_panic() {
        let good =
            announcement(FAMILY_INET6, 7, Some(IPPROTO_TCP), addr("[fd00::10]:53"), addr("[::]:0"));
        // Every prefix: nothing complete, nothing reported.
        for cut in 0..good.len() {
            assert!(parse(&good[..cut]).is_empty(), "cut at {cut}");
        }
        // A header claiming more than the inet_diag_msg holds.
        let mut short = good[..NLMSG_HDRLEN + 20].to_vec();
        short[..4].copy_from_slice(&36u32.to_ne_bytes());
        assert!(parse(&short).is_empty());
        // An attribute whose length runs past the message.
        let mut bad_attr = good.clone();
        let at = NLMSG_HDRLEN + INET_DIAG_MSG_LEN;
        bad_attr[at..at + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert!(parse(&bad_attr).is_empty());
        // Pseudo-random garbage, including lengths of 0 and u32::MAX.
        let mut state = 0x9e37_79b9_u32;
        for size in [0usize, 1, 15, 16, 17, 88, 200, 4096] {
            let buf: Vec<u8> = (0..size)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state.to_le_bytes()[0]
                })
                .collect();
            let _ = parse(&buf);
        }
        for len in [0u32, 1, 15, u32::MAX] {
            let mut buf = good.clone();
            buf[..4].copy_from_slice(&len.to_ne_bytes());
            assert!(parse(&buf).is_empty());
        }
    }

    /// Real kernel, in a network namespace of its own: see `netns` below.
    #[test]
    fn kernel_announces_closes_in_own_namespace_only() {
        if testutil::inside_netns().is_some() {
            netns::inner();
        } else {
            netns::outer(testutil::test_path!());
        }
    }

    /// The real-kernel test: the test binary re-runs itself inside a fresh network namespace
    /// (`ip netns exec`, so no `setns` and no unsafe here), closes sockets there and checks the
    /// announcements; meanwhile a watch in the test's own namespace must hear none of them.
    /// Needs root (`ip netns add`); fails loudly without.
    mod netns {
        use super::*;

        use std::net::{TcpListener, TcpStream, UdpSocket};
        use std::time::{Duration, Instant};

        use nix::sys::socket::{getsockname, sendto, MsgFlags};

        use crate::testutil::{run, Netns};

        /// A documentation address (RFC 5737) put on the namespace's loopback: no socket of the
        /// host can carry it by chance.
        const TEST_ADDR: &str = "192.0.2.53";
        const DEADLINE: Duration = Duration::from_secs(5);
        /// The port of the forged announcement.
        const FORGED_PORT: u16 = 9;

        fn runtime() -> tokio::runtime::Runtime {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime")
        }

        /// Waits (bounded) for an announcement satisfying `wanted`; returns it and how long after
        /// `since` it arrived.
        async fn wait_for(
            watch: &mut SocketWatch,
            since: Instant,
            wanted: impl Fn(&ClosedSocket) -> bool,
        ) -> (ClosedSocket, Duration) {
            let found = tokio::time::timeout(DEADLINE, async {
                loop {
                    let batch = watch.next().await.expect("receiving announcements");
                    if let Some(socket) = batch.into_iter().find(|s| wanted(s)) {
                        return (socket, since.elapsed());
                    }
                }
            })
            .await;
            found.expect("no announcement within the deadline")
        }

        /// `path` is the test's path ([`testutil::test_path!`]).
        pub fn outer(path: &str) {
            let namespace = Netns::create("sdt");
            run("ip", &["-n", namespace.name(), "link", "set", "lo", "up"]);
            let test_addr = format!("{TEST_ADDR}/32");
            run("ip", &["-n", namespace.name(), "addr", "add", &test_addr, "dev", "lo"]);

            let rt = runtime();
            let mut host_watch = rt.block_on(async {
                SocketWatch::open().expect("SocketWatch::open in the test's namespace")
            });
            eprintln!("{}", namespace.run_test(path));

            // The inner watch heard its sockets, so the kernel has already broadcast them. Close
            // a control socket here afterwards: once the host watch hears it, anything leaked
            // from the namespace would have arrived before it (and the control proves the host
            // watch works, so silence means something).
            let control = UdpSocket::bind(("127.0.0.1", 0)).expect("bind control socket");
            let control_addr = control.local_addr().unwrap();
            drop(control);
            let test_ip: IpAddr = TEST_ADDR.parse().unwrap();
            let leaked = rt.block_on(async {
                let mut leaked = Vec::new();
                let deadline = tokio::time::Instant::now() + DEADLINE;
                loop {
                    let batch = tokio::time::timeout_at(deadline, host_watch.next())
                        .await
                        .expect("the host watch did not hear the control socket close");
                    match batch {
                        Ok(batch) => {
                            let control_seen = batch
                                .iter()
                                .any(|s| s.transport == Transport::Udp && s.local == control_addr);
                            leaked.extend(batch.into_iter().filter(|s| s.local.ip() == test_ip));
                            if control_seen {
                                return leaked;
                            }
                        }
                        // The host namespace is busy; what was lost cannot be checked.
                        Err(SockDiagError::Overrun) => eprintln!("host watch overrun"),
                        Err(err) => panic!("host watch: {err}"),
                    }
                }
            });
            assert!(leaked.is_empty(), "announcements leaked: {leaked:?}");
            drop(namespace);
        }

        pub fn inner() {
            let cache: [IpAddr; 1] = [TEST_ADDR.parse().unwrap()];
            runtime().block_on(async {
                let mut watch = SocketWatch::open().expect("SocketWatch::open in the namespace");

                // A forged announcement unicast by a local process to the watch's port id must
                // be dropped: it would report a close of TEST_ADDR:FORGED_PORT.
                let watch_addr: NetlinkAddr =
                    getsockname(watch.fd.get_ref().as_raw_fd()).expect("getsockname");
                let forger = socket(
                    AddressFamily::Netlink,
                    SockType::Raw,
                    SockFlag::SOCK_CLOEXEC,
                    SockProtocol::NetlinkSockDiag,
                )
                .expect("forger socket");
                let forged = announcement(
                    FAMILY_INET,
                    7,
                    Some(IPPROTO_UDP),
                    SocketAddr::new(cache[0], FORGED_PORT),
                    "0.0.0.0:0".parse().unwrap(),
                );
                assert_eq!(parse(&forged).len(), 1);
                sendto(
                    forger.as_raw_fd(),
                    &forged,
                    &NetlinkAddr::new(watch_addr.pid(), 0),
                    MsgFlags::empty(),
                )
                .expect("unicast to the watch");

                // An unconnected UDP server socket.
                let udp = UdpSocket::bind((TEST_ADDR, 0)).expect("bind UDP");
                let port = udp.local_addr().unwrap().port();
                let closed_at = Instant::now();
                drop(udp);
                let (socket, latency) = wait_for(&mut watch, closed_at, |s| {
                    assert_ne!(s.local.port(), FORGED_PORT, "forged announcement accepted");
                    s.local.port() == port
                })
                .await;
                println!("udp close announced after {latency:?}: {socket:?}");
                assert_eq!(socket.transport, Transport::Udp);
                assert_eq!(socket.local, SocketAddr::new(cache[0], port));
                assert!(socket.is_listener_on(&cache, port));

                // A TCP listener with one accepted connection, aborted (SO_LINGER 0) so that
                // it is freed at once, before the listener.
                let listener = TcpListener::bind((TEST_ADDR, 0)).expect("bind TCP");
                let port = listener.local_addr().unwrap().port();
                let client = TcpStream::connect((TEST_ADDR, port)).expect("connect");
                let (accepted, _) = listener.accept().expect("accept");
                setsockopt(
                    &accepted,
                    sockopt::Linger,
                    &nix::libc::linger { l_onoff: 1, l_linger: 0 },
                )
                .expect("SO_LINGER");
                let closed_at = Instant::now();
                drop(accepted);
                let (socket, latency) =
                    wait_for(&mut watch, closed_at, |s| s.local.port() == port).await;
                println!("aborted connection announced after {latency:?}: {socket:?}");
                assert_eq!(socket.transport, Transport::Tcp);
                assert!(!socket.is_listener_on(&cache, port));
                drop(client);

                let closed_at = Instant::now();
                drop(listener);
                let (socket, latency) = wait_for(&mut watch, closed_at, |s| {
                    s.local.port() == port && s.remote.port() == 0 && s.remote.ip().is_unspecified()
                })
                .await;
                println!("tcp listener close announced after {latency:?}: {socket:?}");
                assert_eq!(socket.transport, Transport::Tcp);
                assert!(socket.is_listener_on(&cache, port));

                // IPv6 UDP on ::1.
                let udp6 = UdpSocket::bind(("::1", 0)).expect("bind UDP [::1]");
                let port = udp6.local_addr().unwrap().port();
                let closed_at = Instant::now();
                drop(udp6);
                let (socket, latency) =
                    wait_for(&mut watch, closed_at, |s| s.local.port() == port).await;
                println!("udp6 close announced after {latency:?}: {socket:?}");
                assert!(socket.is_listener_on(&["::1".parse().unwrap()], port));
            });
        }
    }
}
