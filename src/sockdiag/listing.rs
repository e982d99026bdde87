//! Listing the sockets that serve a port now: one `SOCK_DIAG_BY_FAMILY` dump per family and
//! transport, on a blocking socket.

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::time::Duration;

use nix::sys::socket::{
    recvfrom, sendto, setsockopt, sockopt, MsgFlags, NetlinkAddr, SockProtocol,
};

use super::inet_diag::{
    dump_request, parse_dump, FAMILY_INET, FAMILY_INET6, IPPROTO_TCP, IPPROTO_UDP, STATE_CLOSE,
    STATE_LISTEN,
};
use super::{serves_port, Listener, SockDiagError, DATAGRAM_BYTES};
use crate::netlink;

/// How long a dump may take before it is given up.
const DUMP_TIMEOUT: Duration = Duration::from_secs(1);

/// The TCP listeners and unconnected UDP sockets of the current network namespace that serve
/// `port` on one of `addrs` (bound to it, or to a matching wildcard), with their cookies: a
/// `SOCK_DIAG_BY_FAMILY` dump for each family and transport. Blocking, bounded by one second
/// per dump; needs no privilege.
pub fn listeners(addrs: &[IpAddr], port: u16) -> Result<Vec<Listener>, SockDiagError> {
    let fd = netlink::socket::open(SockProtocol::NetlinkSockDiag).map_err(SockDiagError::Open)?;
    let timeout = nix::sys::time::TimeVal::new(DUMP_TIMEOUT.as_secs() as _, 0);
    setsockopt(&fd, sockopt::ReceiveTimeout, &timeout).map_err(SockDiagError::Open)?;
    let mut found = Vec::new();
    let mut buf = vec![0u8; DATAGRAM_BYTES];
    for family in [FAMILY_INET, FAMILY_INET6] {
        for (protocol, states) in [(IPPROTO_UDP, STATE_CLOSE), (IPPROTO_TCP, STATE_LISTEN)] {
            let request = dump_request(family, protocol, 1 << states);
            sendto(fd.as_raw_fd(), &request, &NetlinkAddr::new(0, 0), MsgFlags::empty())
                .map_err(|e| SockDiagError::Recv(e.into()))?;
            loop {
                let (len, from) = recvfrom::<NetlinkAddr>(fd.as_raw_fd(), &mut buf)
                    .map_err(|e| SockDiagError::Recv(e.into()))?;
                // Only the kernel (port id 0) speaks for the kernel.
                if from.is_some_and(|f| f.pid() != 0) {
                    continue;
                }
                let (sockets, done) = parse_dump(buf.get(..len).unwrap_or_default(), protocol)
                    .map_err(SockDiagError::Recv)?;
                found.extend(sockets.into_iter().filter(|l| serves_port(l.local, addrs, port)));
                if done {
                    break;
                }
            }
        }
    }
    Ok(found)
}
