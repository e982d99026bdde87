//! The one socket option iptables-legacy's change detector needs that neither nix nor std wraps:
//! x_tables' `getsockopt` (`IPT_SO_GET_INFO`, `IPT_SO_GET_ENTRIES` and their IPv6 twins), whose
//! buffer is input as well as output (the table's name, the size wanted), so nix's typed
//! `getsockopt`, which hands the kernel an uninitialised buffer, cannot carry it.
//!
//! This module may use `unsafe`, in one place: [`get`], `getsockopt` into a byte buffer the
//! caller owns. What the bytes mean is the caller's business (`iptables/snapshot.rs`, safe code).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `getsockopt(fd, level, name)` with `buf` as the option's value, in and out: the kernel reads
/// what the caller put there and writes its answer over it. Returns the length it wrote.
pub(crate) fn get(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    buf: &mut [u8],
) -> io::Result<usize> {
    let mut len = libc::socklen_t::try_from(buf.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "option buffer too large"))?;
    // SAFETY: `buf` is an initialised, writable buffer of `len` bytes that lives and is borrowed
    // exclusively for the whole call; the kernel writes at most `len` bytes to it and the length
    // it wrote to `len`, a live local. A descriptor that is not a socket is refused (ENOTSOCK).
    let rc =
        unsafe { libc::getsockopt(fd.as_raw_fd(), level, name, buf.as_mut_ptr().cast(), &mut len) };
    if rc == 0 {
        Ok(usize::try_from(len).unwrap_or(buf.len()).min(buf.len()))
    } else {
        Err(io::Error::last_os_error())
    }
}
