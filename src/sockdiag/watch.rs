//! The socket-destroy watch: a subscription to the kernel's announcements of freed TCP and UDP
//! sockets, read on tokio's reactor.

use std::os::fd::AsFd;

use nix::sys::socket::{setsockopt, sockopt, SockProtocol};

use super::inet_diag::{parse, SPORT_IN_MESSAGE};
use super::{ClosedSocket, SockDiagError, DATAGRAM_BYTES};
use crate::netlink::socket::{self as netlink_socket, AsyncSocket};

/// `SKNLGRP_INET_TCP_DESTROY` (include/uapi/linux/sock_diag.h).
const GROUP_INET_TCP_DESTROY: u32 = 1;
/// `SKNLGRP_INET_UDP_DESTROY`.
const GROUP_INET_UDP_DESTROY: u32 = 2;
/// `SKNLGRP_INET6_TCP_DESTROY`.
const GROUP_INET6_TCP_DESTROY: u32 = 3;
/// `SKNLGRP_INET6_UDP_DESTROY`.
const GROUP_INET6_UDP_DESTROY: u32 = 4;

/// The receive buffer asked for: destroy announcements for every TCP connection of the node share
/// it with the few we care about, so leave room for bursts.
const RECV_BUFFER_BYTES: usize = 4 << 20;

/// A subscription to the kernel's TCP and UDP (IPv4 and IPv6) socket-destroy announcements in the
/// current network namespace.
#[derive(Debug)]
pub struct SocketWatch {
    socket: AsyncSocket,
    buf: Vec<u8>,
}

impl SocketWatch {
    /// Opens the netlink socket and joins the four destroy groups. Needs a running tokio runtime
    /// with I/O enabled, no privilege (`CAP_NET_ADMIN` only buys a larger receive buffer). The
    /// namespace is the calling thread's at the time of the call.
    pub fn open() -> Result<Self, SockDiagError> {
        let fd =
            netlink_socket::open(SockProtocol::NetlinkSockDiag).map_err(SockDiagError::Open)?;
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
        ];
        netlink_socket::bind(&fd, &groups).map_err(SockDiagError::Subscribe)?;
        let socket = AsyncSocket::register(fd).map_err(SockDiagError::Register)?;
        Ok(SocketWatch { socket, buf: vec![0u8; DATAGRAM_BYTES] })
    }

    /// From now on, hears only of sockets whose local port is `port`: the kernel drops the
    /// others' announcements before they wake the watch (every short-lived socket of the node
    /// would, the agent's own probes' among them). Failing that, all are heard, and sorted
    /// here, as before.
    pub fn keep_only_port(&self, port: u16) -> std::io::Result<()> {
        netlink_socket::keep_only_u16(self.socket.as_fd(), SPORT_IN_MESSAGE, port)
    }

    /// Waits for the next announcement datagram and returns the sockets it reports (usually
    /// one; possibly none if it held only messages [`parse`] skips).
    ///
    /// [`SockDiagError::Overrun`] means announcements were lost; the watch stays usable and the
    /// caller should treat it as "a watched socket may have closed". Cancel-safe: dropping the
    /// future loses nothing.
    pub async fn next(&mut self) -> Result<Vec<ClosedSocket>, SockDiagError> {
        loop {
            match self.socket.recv_from(&mut self.buf).await {
                // Only the kernel (port id 0) speaks for the kernel.
                Ok((len, Some(0))) => return Ok(parse(self.buf.get(..len).unwrap_or_default())),
                Ok(_) => continue,
                Err(err) if netlink_socket::lost_messages(&err) => {
                    return Err(SockDiagError::Overrun)
                }
                Err(err) => return Err(SockDiagError::Recv(err)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::net::{IpAddr, SocketAddr};
    use std::os::fd::{AsFd, AsRawFd};

    use nix::sys::socket::NetlinkAddr;

    use crate::netlink;
    use crate::probe::Transport;
    use crate::sockdiag::inet_diag::{announcement, FAMILY_INET, IPPROTO_UDP};
    use crate::testutil;

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
                    getsockname(watch.socket.as_fd().as_raw_fd()).expect("getsockname");
                let forger =
                    netlink::socket::open(SockProtocol::NetlinkSockDiag).expect("forger socket");
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

                // Filtered to port 53, a watch hears nothing of another port: of an ephemeral
                // socket closed first and a port-53 one closed after it, the port-53 one is the
                // first it hears.
                let mut dns_only = SocketWatch::open().expect("a second watch");
                dns_only.keep_only_port(53).expect("SO_ATTACH_FILTER");
                let other = UdpSocket::bind((TEST_ADDR, 0)).expect("bind UDP");
                let other_port = other.local_addr().unwrap().port();
                let dns = UdpSocket::bind((TEST_ADDR, 53)).expect("bind UDP :53");
                drop(other);
                let closed_at = Instant::now();
                drop(dns);
                let (socket, _) = wait_for(&mut dns_only, closed_at, |s| {
                    assert_ne!(s.local.port(), other_port, "the filter let port {other_port} by");
                    s.local.port() == 53
                })
                .await;
                assert_eq!(socket.local, SocketAddr::new(cache[0], 53));
            });
        }
    }
}
