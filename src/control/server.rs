//! The control socket's server, in the agent: [`serve`] accepts connections from root only
//! (checked with `SO_PEERCRED`, on top of the socket's mode 0600), reads one bounded line with a
//! deadline, and hands the request to the agent's loop as an [`Incoming`], whose answer it writes
//! back. Every connection has its own task and its own deadlines, so a client that connects and
//! stalls holds nothing up; at most [`MAX_WAITING`] wait for their request line at once, and a new
//! one closes the oldest, so a crowd of them costs neither the file descriptors the probes need
//! nor an operator's `flip`.

use std::convert::Infallible;
use std::fs::Permissions;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::UnixAddr;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::protocol::{
    reply_timeout, socket_path, Incoming, Peer, Request, Response, MAX_REQUEST_BYTES, READ_TIMEOUT,
    SOCKET, WRITE_TIMEOUT,
};
use super::ControlError;
use crate::waiting::{Reading, Waiting};

/// The pause after a failed `accept` (out of file descriptors, say) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Connections waiting for their request line at once; one more closes the oldest of them.
pub const MAX_WAITING: usize = 16;
/// What a peer that is not root is told.
const ONLY_ROOT: &str = "only root may control the agent";

/// Serves the control socket in `dir` for as long as the future runs, forwarding every request
/// from root on `tx`. Fails only at the start: when another agent serves there, or the socket
/// cannot be created. Dropping the future removes the socket file.
///
/// A socket file left by an agent that is gone (nothing answers on it) is replaced; the new
/// socket is bound under a temporary name, made mode 0600 and renamed into place, so it is never
/// reachable with looser permissions.
pub async fn serve(dir: &Path, tx: mpsc::Sender<Incoming>) -> Result<Infallible, ControlError> {
    let path = socket_path(dir);
    let (listener, _socket_file) = listen(&path).await?;
    info!(socket = %path.display(), "control socket ready");
    let mut waiting = Waiting::default();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => admit(&mut waiting, stream, tx.clone()),
            Err(e) => {
                warn!(socket = %path.display(), error = %e, "accepting a control connection failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// The bound socket file: removed on drop, if it is still this one.
struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the socket at `path`, replacing a stale one, mode 0600.
async fn listen(path: &Path) -> Result<(UnixListener, SocketFile), ControlError> {
    check_not_served(path).await?;
    let listen_err = |source| ControlError::Listen { path: path.to_owned(), source };
    let name = format!(".{SOCKET}.{}", std::process::id());
    let tmp = path.with_file_name(name);
    if UnixAddr::new(&tmp).is_err() || UnixAddr::new(path).is_err() {
        return Err(ControlError::PathTooLong { path: path.to_owned() });
    }
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(listen_err(e)),
        _ => {}
    }
    let listener = UnixListener::bind(&tmp).map_err(listen_err)?;
    let placed = std::fs::set_permissions(&tmp, Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path))
        .and_then(|()| std::fs::symlink_metadata(path));
    match placed {
        Ok(meta) => {
            Ok((listener, SocketFile { path: path.to_owned(), id: (meta.dev(), meta.ino()) }))
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(listen_err(e))
        }
    }
}

/// `Ok` when no agent answers at `path`: no file, or a socket nobody listens on.
async fn check_not_served(path: &Path) -> Result<(), ControlError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(ControlError::Listen { path: path.to_owned(), source }),
    };
    if !meta.file_type().is_socket() {
        return Err(ControlError::NotASocket { path: path.to_owned() });
    }
    match UnixStream::connect(path).await {
        Ok(_) => Err(ControlError::AlreadyServing { path: path.to_owned() }),
        // A full backlog: someone listens.
        Err(e) if e.raw_os_error() == Some(Errno::EAGAIN as i32) => {
            Err(ControlError::AlreadyServing { path: path.to_owned() })
        }
        Err(e) if e.raw_os_error() == Some(Errno::ECONNREFUSED as i32) => {
            info!(socket = %path.display(), "replacing the control socket of an agent that is gone");
            Ok(())
        }
        Err(source) => Err(ControlError::Listen { path: path.to_owned(), source }),
    }
}

/// Serves `stream` in a task of its own. At most [`MAX_WAITING`] connections wait for their
/// request line: a new one past that closes the oldest (with an answer saying why), so clients
/// that connect and stall can neither use up the file descriptors the probes need nor lock an
/// operator's `flip` out; and a stalled one is closed after [`READ_TIMEOUT`] anyway.
fn admit(waiting: &mut Waiting, stream: UnixStream, tx: mpsc::Sender<Incoming>) {
    if waiting.len() >= MAX_WAITING && waiting.evict_oldest() {
        debug!(limit = MAX_WAITING, "too many control connections waiting; closing the oldest");
    }
    tokio::spawn(handle(stream, tx, waiting.join()));
}

/// One connection: check the peer, read its request, pass it on, answer.
async fn handle(mut stream: UnixStream, tx: mpsc::Sender<Incoming>, reading: Reading) {
    let peer = match stream.peer_cred() {
        Ok(cred) => Peer { uid: cred.uid(), gid: cred.gid(), pid: cred.pid() },
        Err(e) => {
            warn!(error = %e, "cannot tell who is on a control connection, closing it");
            return;
        }
    };
    let Some(response) = answer(&mut stream, peer, &tx, reading).await else {
        return;
    };
    let mut line = serde_json::to_vec(&response).unwrap_or_default();
    line.push(b'\n');
    match tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(&line)).await {
        Ok(Ok(())) => {
            let _ = stream.shutdown().await;
        }
        Ok(Err(e)) => {
            debug!(peer = %peer, error = %e, "control client went away before the answer")
        }
        Err(_) => debug!(peer = %peer, "control client did not take the answer"),
    }
}

/// The answer for one connection; `None` when the client closed it without a request.
async fn answer(
    stream: &mut UnixStream,
    peer: Peer,
    tx: &mpsc::Sender<Incoming>,
    reading: Reading,
) -> Option<Response> {
    if peer.uid != 0 {
        warn!(peer = %peer, "refused a control connection: not root");
        return Some(Response::error(ONLY_ROOT));
    }
    let read = tokio::select! {
        read = tokio::time::timeout(READ_TIMEOUT, read_line(stream)) => read,
        () = reading.evicted() => {
            debug!(peer = %peer, "control connection closed to make room");
            return Some(Response::error(format!(
                "closed without a request: {MAX_WAITING} newer control connections were waiting \
                 for theirs; send the request line at once"
            )));
        }
    };
    drop(reading);
    let line = match read {
        Ok(Ok(Line::Complete(line))) => line,
        Ok(Ok(Line::Empty)) => return None,
        Ok(Ok(Line::TooLong)) => {
            warn!(peer = %peer, "control request too long, closing");
            return Some(Response::error(format!(
                "request longer than {MAX_REQUEST_BYTES} bytes: send one JSON object on one line"
            )));
        }
        Ok(Err(e)) => {
            debug!(peer = %peer, error = %e, "reading a control request failed");
            return None;
        }
        Err(_) => {
            debug!(peer = %peer, "control client sent no complete line in time, closing");
            return Some(Response::error(format!(
                "no complete request line within {READ_TIMEOUT:?}: send one JSON object and a newline"
            )));
        }
    };
    let request: Request = match serde_json::from_slice(&line) {
        Ok(request) => request,
        Err(e) => {
            debug!(peer = %peer, error = %e, "unparsable control request");
            return Some(Response::error(format!(
                "cannot parse the request: {e} (expected one JSON object on one line, such as \
                 {{\"op\":\"status\"}})"
            )));
        }
    };
    debug!(peer = %peer, request = ?request, "control request");
    let wait = reply_timeout(&request);
    let (reply, answered) = oneshot::channel();
    let exchange = async {
        if tx.send(Incoming { request, peer, reply }).await.is_err() {
            return Response::error("the agent is shutting down");
        }
        answered.await.unwrap_or_else(|_| Response::error("the agent dropped the request"))
    };
    let response = tokio::time::timeout(wait, exchange).await.unwrap_or_else(|_| {
        warn!(peer = %peer, after = ?wait, "the agent's loop did not answer a control request");
        Response::error(format!("the agent did not answer within {wait:?}: check its log"))
    });
    Some(response)
}

/// What a client sent.
enum Line {
    /// One line (its newline, if any, still on), at most [`MAX_REQUEST_BYTES`].
    Complete(Vec<u8>),
    /// Nothing: the client closed the connection.
    Empty,
    /// [`MAX_REQUEST_BYTES`] and no newline yet.
    TooLong,
}

/// Reads up to the first newline, at most [`MAX_REQUEST_BYTES`]; a last line without a newline
/// counts when the client closes its side after it.
async fn read_line(stream: &mut UnixStream) -> io::Result<Line> {
    let mut reader = BufReader::new(stream.take(MAX_REQUEST_BYTES as u64));
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line).await?;
    Ok(match line.last() {
        None => Line::Empty,
        Some(b'\n') => Line::Complete(line),
        Some(_) if line.len() >= MAX_REQUEST_BYTES => Line::TooLong,
        Some(_) => Line::Complete(line),
    })
}

#[cfg(test)]
mod tests;
