//! Netlink sockets: opened in the current network namespace, bound to multicast groups, and for
//! the watches that wait on the kernel's announcements, driven by tokio's reactor.
//!
//! This module may use `unsafe`, in two places:
//! * [`AsyncSocket::register`] is the one place in the crate that hands a descriptor to tokio:
//!   tokio deprecated its safe `AsyncFd` constructors as unsound (an arbitrary `AsRawFd` may
//!   return another descriptor, or a closed one, while it is registered) and left
//!   `AsyncFd::register`, which is `unsafe`. Here the `AsyncFd` owns an `OwnedFd`, which cannot
//!   do either, so the promise `register` asks for holds.
//! * [`keep_only_u16`] attaches a socket filter (`SO_ATTACH_FILTER`), which neither nix nor std
//!   wraps: `setsockopt` with a pointer to a program the kernel copies during the call.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::socket::{self, AddressFamily, NetlinkAddr, SockFlag, SockProtocol, SockType};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Opens a blocking netlink socket of `protocol` in the calling thread's network namespace,
/// closed on exec.
pub fn open(protocol: SockProtocol) -> nix::Result<OwnedFd> {
    socket::socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, protocol)
}

/// Binds `fd` to a port id of its own and joins the multicast `groups`, numbered from 1 as the
/// uapi headers number them (the `nl_groups` bit mask reaches group 32).
pub fn bind(fd: &OwnedFd, groups: &[u32]) -> nix::Result<()> {
    let mask = groups.iter().fold(0u32, |mask, group| mask | 1 << (group - 1));
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, mask))
}

/// Has the kernel drop, before they reach `fd` (and wake its reader), the datagrams whose 16-bit
/// field at byte `offset` is not `value` (both in network order), with a classic BPF program. A
/// datagram too short to hold the field is dropped too.
pub fn keep_only_u16(fd: BorrowedFd<'_>, offset: u32, value: u16) -> io::Result<()> {
    use libc::{sock_filter, sock_fprog};
    let op = |code: u32, jt: u8, jf: u8, k: u32| sock_filter { code: code as u16, jt, jf, k };
    let program = [
        // A = the field (loads are in network order).
        op(libc::BPF_LD | libc::BPF_H | libc::BPF_ABS, 0, 0, offset),
        // A == value: keep the whole datagram, else none of it.
        op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, 0, 1, u32::from(value)),
        op(libc::BPF_RET | libc::BPF_K, 0, 0, u32::MAX),
        op(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
    ];
    let fprog = sock_fprog { len: program.len() as u16, filter: program.as_ptr().cast_mut() };
    // SAFETY: `fprog` and the `program` it points to are alive and unchanged for the whole call,
    // its length is the program's, and the kernel only reads them (it copies the program); the
    // option's size is `sock_fprog`'s. A descriptor that is not a socket is refused (ENOTSOCK).
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            std::ptr::from_ref(&fprog).cast(),
            std::mem::size_of::<sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether a receive error means the kernel dropped messages for this socket because its
/// receive buffer was full (`ENOBUFS`). The socket stays usable, but what was dropped is lost.
pub fn lost_messages(err: &io::Error) -> bool {
    err.raw_os_error() == Some(Errno::ENOBUFS as i32)
}

/// A netlink socket that waits for datagrams on tokio's reactor instead of blocking a thread.
/// (Also the duplicate of a timerfd that `crate::beat` waits on: [`Self::try_read`].)
pub struct AsyncSocket {
    fd: AsyncFd<OwnedFd>,
}

impl fmt::Debug for AsyncSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AsyncSocket").field(self.fd.get_ref()).finish()
    }
}

impl AsFd for AsyncSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

impl AsyncSocket {
    /// Makes `fd` non-blocking and registers it for reading with the current tokio runtime's
    /// reactor (which must have I/O enabled). Panics outside a tokio runtime.
    pub fn register(fd: OwnedFd) -> io::Result<Self> {
        let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        // SAFETY: `register` needs a descriptor that stays open, and the same, for as long as the
        // `AsyncFd` holds it. An `OwnedFd` is an open descriptor only its owner closes (on drop),
        // it always returns that same descriptor, and the `AsyncFd` owns it.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        Ok(AsyncSocket { fd: registered? })
    }

    /// Waits for the next datagram and receives it into `buf`: its length (at most `buf.len()`;
    /// the rest of a longer one is lost) and the sender's port id, 0 for the kernel.
    /// Cancel-safe: dropping the future loses no datagram.
    pub async fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, Option<u32>)> {
        self.fd.async_io(Interest::READABLE, |fd| recv_from(fd, buf)).await
    }

    /// Waits until a datagram is pending; [`Self::try_recv`] then receives it.
    pub async fn readable(&self) -> io::Result<()> {
        // Dropped without clearing: the readiness stays until `try_recv` finds nothing.
        self.fd.readable().await.map(drop)
    }

    /// Receives a pending datagram into `buf` without waiting: its length (as
    /// [`Self::recv_from`]), or an error of kind `WouldBlock` when none is pending.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.fd.try_io(Interest::READABLE, |fd| recv_from(fd, buf)).map(|(len, _)| len)
    }

    /// Reads what is pending into `buf` without waiting (`read(2)`: what a descriptor that is
    /// not a socket gives, such as a timerfd's count of expirations), or an error of kind
    /// `WouldBlock` when nothing is.
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.fd.try_io(Interest::READABLE, |fd| nix::unistd::read(fd, buf).map_err(Into::into))
    }
}

/// One `recvfrom` on a non-blocking socket; `EAGAIN` comes back as `WouldBlock`.
fn recv_from(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<(usize, Option<u32>)> {
    loop {
        match socket::recvfrom::<NetlinkAddr>(fd.as_raw_fd(), buf) {
            Err(Errno::EINTR) => {}
            received => {
                return received.map(|(len, from)| (len, from.map(|a| a.pid()))).map_err(Into::into)
            }
        }
    }
}
