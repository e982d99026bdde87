//! A pod that forges the link-local fallback's lease heartbeat (`forwarder::lease` in the
//! agent): UDP datagrams from 127.0.0.1 to the link-local IP's port 9, written whole (header
//! and all) on a raw IPv4 socket, as any pod with `CAP_NET_RAW` can. IPv4 drops a loopback
//! source that arrives from outside only at the routing step, after the mangle PREROUTING hook
//! where the heartbeat rule records its lease.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{sendto, socket, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};
use nix::sys::socket::{SockaddrIn, SockaddrLike};

use crate::simnode::SimNode;

/// The port the agent's heartbeats go to.
const HEARTBEAT_PORT: u16 = 9;

/// Forged heartbeats going out from a namespace until dropped.
pub struct Forger {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<u64>>,
}

impl SimNode {
    /// Sends a forged heartbeat for `to` from `role`'s namespace every `every` (a thread of
    /// this process entered into the namespace, where its raw socket is made), until the
    /// [`Forger`] is stopped or dropped. Returns once the socket is there: a namespace or a
    /// socket refused panics here, not later.
    pub fn forge_heartbeats(&self, role: &str, to: Ipv4Addr, every: Duration) -> Forger {
        let ns = format!("/run/netns/{}", self.ns(role));
        let (ready_tx, ready) = mpsc::channel();
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let socket = match raw_socket_in(&ns) {
                Ok(socket) => socket,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return 0;
                }
            };
            let _ = ready_tx.send(Ok(()));
            let packet = heartbeat(Ipv4Addr::LOCALHOST, to);
            let dest = SockaddrIn::from(std::net::SocketAddrV4::new(to, 0));
            let mut sent = 0;
            // Pacing only: the forger is a load, nothing waits on it.
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                let fd = socket.as_raw_fd();
                if sendto(fd, &packet, &dest as &dyn SockaddrLike, MsgFlags::empty()).is_ok() {
                    sent += 1;
                }
            }
            sent
        });
        let made = ready.recv().expect("the forger's thread");
        made.unwrap_or_else(|e| panic!("a raw socket in {role}'s namespace: {e}"));
        Forger { stop: Some(stop), thread: Some(thread) }
    }
}

impl Forger {
    /// Stops it; how many forged heartbeats it sent.
    pub fn stop(mut self) -> u64 {
        self.stop.take();
        self.thread.take().map_or(0, |t| t.join().expect("the forger's thread"))
    }
}

impl Drop for Forger {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A raw IPv4 socket (IPPROTO_RAW: the caller writes the IP header) made in the network
/// namespace at `ns`, by this thread, which stays there.
fn raw_socket_in(ns: &str) -> Result<OwnedFd, String> {
    let file = std::fs::File::open(ns).map_err(|e| format!("{ns}: {e}"))?;
    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| format!("setns {ns}: {e}"))?;
    let protocol = SockProtocol::Raw;
    socket(AddressFamily::Inet, SockType::Raw, SockFlag::SOCK_CLOEXEC, protocol)
        .map_err(|e| format!("a raw socket: {e}"))
}

/// The forged heartbeat: an IPv4 header (the kernel fills in its length, id and checksum) and
/// a UDP header (no checksum, as IPv4 allows) with one byte, from `from` to `to`'s port 9.
fn heartbeat(from: Ipv4Addr, to: Ipv4Addr) -> Vec<u8> {
    let udp_len: u16 = 8 + 1;
    let mut packet = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0];
    packet.extend(from.octets());
    packet.extend(to.octets());
    packet.extend(40009u16.to_be_bytes());
    packet.extend(HEARTBEAT_PORT.to_be_bytes());
    packet.extend(udp_len.to_be_bytes());
    packet.extend([0, 0, 0]);
    packet
}
