//! The control socket's client: [`call`], blocking, for the command line.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

use super::protocol::{socket_path, Request, Response, MAX_RESPONSE_BYTES};
use super::ControlError;

/// Sends `request` to the agent serving `dir` and returns its answer, all within `timeout`.
/// Blocking, for the command line. [`ControlError::NoAgent`] when no agent serves there.
pub fn call(dir: &Path, request: &Request, timeout: Duration) -> Result<Response, ControlError> {
    let path = socket_path(dir);
    let deadline = Instant::now() + timeout;
    let timed_out = || ControlError::Timeout { path: path.clone(), after: timeout };
    let io_err = |source| ControlError::Io { path: path.clone(), source };
    // Each blocking step gets what is left of the deadline; a zero timeout would mean "forever".
    let remaining = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(timed_out)
    };
    let is_timeout =
        |e: &io::Error| matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);

    let mut stream = connect(&path)?;
    let mut line = serde_json::to_vec(request).map_err(|e| io_err(io::Error::other(e)))?;
    line.push(b'\n');
    stream.set_write_timeout(Some(remaining()?)).map_err(io_err)?;
    match stream.write_all(&line) {
        Ok(()) => {}
        Err(e) if is_timeout(&e) => return Err(timed_out()),
        // The agent answered without reading all of it (refused peer, request too long): read
        // the answer anyway.
        Err(e)
            if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {}
        Err(e) => return Err(io_err(e)),
    }

    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !answer.contains(&b'\n') {
        if answer.len() > MAX_RESPONSE_BYTES {
            let detail = format!("an answer longer than {MAX_RESPONSE_BYTES} bytes");
            return Err(ControlError::BadResponse { path, detail });
        }
        stream.set_read_timeout(Some(remaining()?)).map_err(io_err)?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(timed_out()),
            Err(e) => return Err(io_err(e)),
        }
    }
    let end = answer.iter().position(|&b| b == b'\n').unwrap_or(answer.len());
    if end == 0 {
        let detail = "the connection closed without an answer".to_owned();
        return Err(ControlError::BadResponse { path, detail });
    }
    serde_json::from_slice(&answer[..end])
        .map_err(|e| ControlError::BadResponse { path, detail: e.to_string() })
}

/// Connects without ever waiting: a Unix socket's `connect` blocks while the listener's backlog
/// is full, which no timeout would bound.
fn connect(path: &Path) -> Result<StdUnixStream, ControlError> {
    let addr =
        UnixAddr::new(path).map_err(|_| ControlError::PathTooLong { path: path.to_owned() })?;
    let connect_err = |source| ControlError::Connect { path: path.to_owned(), source };
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(|e| connect_err(e.into()))?;
    match socket::connect(fd.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(Errno::ENOENT | Errno::ECONNREFUSED) => {
            return Err(ControlError::NoAgent { path: path.to_owned() })
        }
        Err(Errno::EAGAIN) => return Err(ControlError::Busy { path: path.to_owned() }),
        Err(e) => return Err(connect_err(e.into())),
    }
    let stream = StdUnixStream::from(fd);
    stream.set_nonblocking(false).map_err(connect_err)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;
    use std::os::unix::net::UnixListener as StdUnixListener;

    #[test]
    fn calling_nowhere_finds_no_agent() {
        let dir = TempDir::new();
        let err = call(&dir.0, &Request::Status, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, ControlError::NoAgent { .. }), "{err:?}");
        assert!(err.to_string().contains("nodelocaldns-ha run"), "{err}");
        let gone = dir.0.join("no-such-dir");
        let err = call(&gone, &Request::Status, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, ControlError::NoAgent { .. }), "{err:?}");
    }

    #[test]
    fn a_call_is_bounded_by_its_timeout() {
        let dir = TempDir::new();
        // Listens, accepts (the backlog does), never answers.
        let _mute = StdUnixListener::bind(socket_path(&dir.0)).unwrap();
        let started = Instant::now();
        let err = call(&dir.0, &Request::Status, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, ControlError::Timeout { .. }), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }
}
