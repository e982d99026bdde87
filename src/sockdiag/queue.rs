//! How much waits in one of the cache's UDP sockets, now: one exact `SOCK_DIAG_BY_FAMILY`
//! request per look, about 1.2 µs whatever the number of sockets on the node
//! (docs/design/hang-detection.md §1). The kernel answers within the `sendto`, so a look never
//! waits for anything.

use std::os::fd::{AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::socket::{recvfrom, sendto, MsgFlags, NetlinkAddr, SockProtocol};

use super::inet_diag::{parse_socket_answer, udp_socket_request, SocketAnswer};
use super::{Listener, SockDiagError};
use crate::netlink;

/// A look at one socket's receive queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queued {
    /// Bytes waiting to be read (each datagram counts its buffer's truesize: some 800 bytes for
    /// a DNS query).
    Bytes(u32),
    /// The socket is gone, or another holds its address now: list the listeners again.
    Gone,
}

/// Looks at UDP sockets' receive queues through a `NETLINK_SOCK_DIAG` socket of its own.
#[derive(Debug)]
pub struct QueueReader {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl QueueReader {
    /// A reader for the current network namespace's sockets. Needs no privilege.
    pub fn open() -> Result<Self, SockDiagError> {
        let fd =
            netlink::socket::open(SockProtocol::NetlinkSockDiag).map_err(SockDiagError::Open)?;
        // Non-blocking: an answer that is not there at once is an error, never a wait.
        let flags =
            OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL).map_err(SockDiagError::Open)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(SockDiagError::Open)?;
        // One inet_diag_msg or an error message at most; a dump never comes here.
        Ok(QueueReader { fd, seq: 0, buf: vec![0; 4096] })
    }

    /// The receive queue of the UDP socket `socket` (its address and cookie, from
    /// [`listeners`](super::listeners)).
    pub fn queued(&mut self, socket: &Listener) -> Result<Queued, SockDiagError> {
        self.seq = self.seq.wrapping_add(1);
        let request = udp_socket_request(socket.local, socket.cookie, self.seq);
        let recv_err = |e: Errno| SockDiagError::Recv(e.into());
        sendto(self.fd.as_raw_fd(), &request, &NetlinkAddr::new(0, 0), MsgFlags::empty())
            .map_err(recv_err)?;
        loop {
            // The kernel queued its answer before `sendto` returned: never wait.
            let (len, from) =
                recvfrom::<NetlinkAddr>(self.fd.as_raw_fd(), &mut self.buf).map_err(recv_err)?;
            // Only the kernel (port id 0) speaks for the kernel.
            if from.is_some_and(|f| f.pid() != 0) {
                continue;
            }
            match parse_socket_answer(self.buf.get(..len).unwrap_or_default(), self.seq) {
                SocketAnswer::Queued(bytes) => return Ok(Queued::Bytes(bytes)),
                SocketAnswer::Errno(errno)
                    if errno == Errno::ENOENT as i32 || errno == Errno::ESTALE as i32 =>
                {
                    return Ok(Queued::Gone)
                }
                SocketAnswer::Errno(errno) => return Err(recv_err(Errno::from_raw(errno))),
                SocketAnswer::Other => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, UdpSocket};

    use super::*;
    use crate::probe::Transport;
    use crate::sockdiag::listeners;
    use crate::testutil::{in_netns, run, test_path};

    /// The UDP socket `socket` as [`listeners`] lists it (with its cookie).
    fn listed(socket: &UdpSocket) -> Listener {
        let local = socket.local_addr().unwrap();
        let found = listeners(&[local.ip()], local.port()).expect("listing the sockets");
        let udp: Vec<_> = found.into_iter().filter(|l| l.transport == Transport::Udp).collect();
        match udp.as_slice() {
            [one] => *one,
            other => panic!("expected one UDP socket on {local}, found {other:?}"),
        }
    }

    /// On the kernel, in a namespace of its own: the queue grows with each datagram unread and
    /// empties when they are read; a closed socket, and one whose address another socket holds
    /// now, are gone.
    #[test]
    fn the_kernel_tells_one_sockets_queue_and_when_it_is_gone() {
        in_netns("sdq", test_path!(), |ns| {
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
            let ip: IpAddr = "127.0.0.1".parse().unwrap();
            let server = UdpSocket::bind((ip, 0)).unwrap();
            let socket = listed(&server);
            let mut reader = QueueReader::open().expect("a sock_diag socket");
            assert_eq!(reader.queued(&socket).unwrap(), Queued::Bytes(0));
            let client = UdpSocket::bind((ip, 0)).unwrap();
            let mut sizes = Vec::new();
            for _ in 0..3 {
                client.send_to(&[0; 40], socket.local).unwrap();
                let Queued::Bytes(bytes) = reader.queued(&socket).unwrap() else {
                    panic!("the socket is there");
                };
                sizes.push(bytes);
            }
            assert!(sizes[0] > 0 && sizes[0] < sizes[1] && sizes[1] < sizes[2], "{sizes:?}");
            let mut buf = [0; 64];
            for _ in 0..3 {
                server.recv(&mut buf).unwrap();
            }
            assert_eq!(reader.queued(&socket).unwrap(), Queued::Bytes(0));
            let port = socket.local.port();
            drop(server);
            assert_eq!(reader.queued(&socket).unwrap(), Queued::Gone, "closed");
            // Another socket on the same address: the cookie tells them apart.
            let other = UdpSocket::bind((ip, port)).unwrap();
            assert_eq!(reader.queued(&socket).unwrap(), Queued::Gone, "replaced");
            assert_eq!(reader.queued(&listed(&other)).unwrap(), Queued::Bytes(0));
        });
    }
}
