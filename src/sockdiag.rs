//! The kernel's view of the cache's sockets, over `NETLINK_SOCK_DIAG`: know at once when its
//! listening sockets die ([`SocketWatch`]), list the sockets serving a port now
//! ([`listeners`]), and see how much waits in one of them ([`QueueReader`]).
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
//! `inet_diag` reads and writes the messages; `watch`, `listing` and `queue` talk to the kernel;
//! `cache_sockets` wakes the agent's cache probes when the cache's listeners close.

mod cache_sockets;
mod inet_diag;
mod listing;
mod queue;
mod watch;

use std::net::{IpAddr, SocketAddr};

use nix::errno::Errno;

use crate::probe::Transport;

pub(crate) use cache_sockets::watch_cache_sockets;
pub use inet_diag::{parse, parse_dump, parse_socket_answer, SocketAnswer};
pub use listing::listeners;
pub use queue::{QueueReader, Queued};
pub use watch::SocketWatch;

/// The receive buffer for one datagram: it holds one announcement of a few hundred bytes, or a
/// part of a dump; this leaves ample margin.
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
        unconnected && serves_port(self.local, addrs, port)
    }
}

/// A socket serving a port, as the kernel lists it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    pub transport: Transport,
    /// The address and port it is bound to.
    pub local: SocketAddr,
    /// The kernel's socket cookie: unique among the sockets of this boot, never reused.
    pub cookie: u64,
}

/// Whether a socket bound to `local` serves `port` on one of `addrs`.
pub(crate) fn serves_port(local: SocketAddr, addrs: &[IpAddr], port: u16) -> bool {
    local.port() == port && addrs.iter().any(|&addr| serves(local.ip(), addr))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
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
}
