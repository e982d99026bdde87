//! The control socket: operators flip the route by hand while the agent runs.
//!
//! `nodelocaldns-ha flip|release|drain` talk to the running agent over `<state-dir>/control.sock`,
//! one JSON line each way ([`Request`], [`Response`]). [`serve`] runs in the agent: it accepts
//! connections from root only (checked with `SO_PEERCRED`, on top of the socket's mode 0600),
//! reads one bounded line with a deadline, and hands the request to the agent's loop as an
//! [`Incoming`], whose answer it writes back. Every connection has its own task and its own
//! deadlines, so a client that connects and stalls holds nothing up; at most [`MAX_WAITING`]
//! wait for their request line at once, and a new one closes the oldest, so a crowd of them
//! costs neither the file descriptors the probes need nor an operator's `flip`. [`call`] is the
//! blocking client side, for the command line.
//!
//! This module only moves requests: what a request does to the route is the loop's business
//! ([`crate::maintenance`]), and the override it records is [`crate::overrides`]'.

use std::convert::Infallible;
use std::fmt;
use std::fs::Permissions;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::ruleset::Route;
use crate::waiting::{Reading, Waiting};

/// The control socket's file name inside the state directory.
pub const SOCKET: &str = "control.sock";

/// The longest request line the agent reads, newline included.
pub const MAX_REQUEST_BYTES: usize = 4096;
/// How long a client has to send its whole request line.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the agent's loop has to answer a request (a drain gets its own timeout on top).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client has to take the answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest answer [`call`] reads.
const MAX_RESPONSE_BYTES: usize = 1 << 20;
/// The pause after a failed `accept` (out of file descriptors, say) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Connections waiting for their request line at once; one more closes the oldest of them.
pub const MAX_WAITING: usize = 16;
/// What a peer that is not root is told.
const ONLY_ROOT: &str = "only root may control the agent";

/// One request, one JSON line each way.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Force `route`, for `for_ms` milliseconds or until released.
    Flip {
        route: Route,
        #[serde(default)]
        for_ms: Option<u64>,
        #[serde(default)]
        reason: String,
    },
    /// Back to the automatic decision.
    Release,
    /// `Upstream` until the cache restarts; answered once the cache went quiet, or after
    /// `timeout_ms`.
    Drain { timeout_ms: u64 },
    /// What the agent is doing.
    Status,
}

/// The agent's answer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// Done; `message` says what happened.
    Ok { message: String },
    /// Not done; `message` says why and what to do.
    Error { message: String },
}

impl Response {
    pub fn ok(message: impl Into<String>) -> Response {
        Response::Ok { message: message.into() }
    }

    pub fn error(message: impl Into<String>) -> Response {
        Response::Error { message: message.into() }
    }
}

/// Who is on the other end of a connection, as the kernel says (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    /// In the agent's pid namespace; `None` when the kernel does not say.
    pub pid: Option<i32>,
}

impl fmt::Display for Peer {
    /// `uid 0 pid 1234`, as recorded in [`crate::overrides::Override::set_by`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "uid {}", self.uid)?;
        match self.pid {
            Some(pid) => write!(f, " pid {pid}"),
            None => Ok(()),
        }
    }
}

/// A peer's request as the agent's loop receives it: the request, who sent it, and where to
/// answer. Dropping `reply` answers with an error.
#[derive(Debug)]
pub struct Incoming {
    pub request: Request,
    pub peer: Peer,
    pub reply: oneshot::Sender<Response>,
}

/// Path of the control socket in `dir`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join(SOCKET)
}

/// What went wrong on the control socket, serving or calling.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Nothing listens on the socket: no socket file, or one left by an agent that is gone.
    #[error("no agent is serving {}: is `nodelocaldns-ha run` running with this --state-dir?", .path.display())]
    NoAgent { path: PathBuf },
    /// A live agent already serves the socket.
    #[error("another agent is serving {}: stop it, or give this one its own --state-dir", .path.display())]
    AlreadyServing { path: PathBuf },
    /// Something other than a socket sits where the socket belongs.
    #[error("{} exists and is not a socket: remove it", .path.display())]
    NotASocket { path: PathBuf },
    /// The path does not fit in a Unix socket address.
    #[error("{} is too long for a Unix socket (at most 107 bytes): use a shorter --state-dir", .path.display())]
    PathTooLong { path: PathBuf },
    /// The socket cannot be created, made private or put in place.
    #[error("cannot listen on {}: {source} (is --state-dir a writable directory?)", .path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The agent listens but takes no more connections (its backlog is full).
    #[error("the agent on {} is not accepting connections: try again, or check its log", .path.display())]
    Busy { path: PathBuf },
    /// Connecting failed for another reason, e.g. permission denied for a user who is not root.
    #[error("cannot connect to {}: {source} (the control socket is for root only)", .path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Sending the request or reading the answer failed.
    #[error("talking to the agent on {} failed: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// No (complete) answer in time.
    #[error("the agent on {} did not answer within {after:?}: check its log (`nodelocaldns-ha status`)", .path.display())]
    Timeout { path: PathBuf, after: Duration },
    /// The answer is not one this client understands.
    #[error("the agent on {} answered something this command does not understand: {detail} (are the agent and this command the same version?)", .path.display())]
    BadResponse { path: PathBuf, detail: String },
}

/// How long [`serve`] waits for the loop's answer to `request`: a drain carries its own timeout.
pub fn reply_timeout(request: &Request) -> Duration {
    match request {
        Request::Drain { timeout_ms } => {
            Duration::from_millis(*timeout_ms).saturating_add(REPLY_TIMEOUT)
        }
        _ => REPLY_TIMEOUT,
    }
}

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
    use std::os::unix::net::UnixListener as StdUnixListener;
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Marks the child side of [`a_peer_that_is_not_root_is_refused`]: the socket to call.
    const CHILD_ENV: &str = "NODELOCALDNS_HA_TEST_CONTROL_CHILD";

    /// A fresh, empty directory under the system's temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("nlha-ctl-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_wire_format_is_one_tagged_json_object() {
        let flip = Request::Flip { route: Route::Local, for_ms: Some(60_000), reason: "x".into() };
        let cases = [
            (flip, r#"{"op":"flip","route":"local","for_ms":60000,"reason":"x"}"#),
            (Request::Release, r#"{"op":"release"}"#),
            (Request::Drain { timeout_ms: 10_000 }, r#"{"op":"drain","timeout_ms":10000}"#),
            (Request::Status, r#"{"op":"status"}"#),
        ];
        for (request, json) in cases {
            assert_eq!(serde_json::to_string(&request).unwrap(), json);
            assert_eq!(serde_json::from_str::<Request>(json).unwrap(), request);
        }
        // Written by hand (socat): duration and reason may be left out.
        let short: Request = serde_json::from_str(r#"{"op":"flip","route":"upstream"}"#).unwrap();
        assert_eq!(
            short,
            Request::Flip { route: Route::Upstream, for_ms: None, reason: "".into() }
        );
        assert_eq!(
            serde_json::to_string(&Response::ok("done")).unwrap(),
            r#"{"result":"ok","message":"done"}"#
        );
        assert_eq!(
            serde_json::to_string(&Response::error("no")).unwrap(),
            r#"{"result":"error","message":"no"}"#
        );
    }

    #[test]
    fn a_drain_waits_for_its_own_timeout_and_more() {
        assert_eq!(reply_timeout(&Request::Status), REPLY_TIMEOUT);
        assert_eq!(reply_timeout(&Request::Release), REPLY_TIMEOUT);
        let drain = Request::Drain { timeout_ms: 10_000 };
        assert_eq!(reply_timeout(&drain), Duration::from_secs(15));
        assert!(reply_timeout(&Request::Drain { timeout_ms: u64::MAX }) > REPLY_TIMEOUT);
    }

    /// A stand-in for the agent's loop: answers every request with `Ok` naming it and the peer,
    /// and hands what it received to the test.
    fn fake_loop(mut rx: mpsc::Receiver<Incoming>) -> mpsc::UnboundedReceiver<(Request, Peer)> {
        let (seen_tx, seen) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(incoming) = rx.recv().await {
                let message = format!("{:?} from {}", incoming.request, incoming.peer);
                let _ = seen_tx.send((incoming.request, incoming.peer));
                let _ = incoming.reply.send(Response::ok(message));
            }
        });
        seen
    }

    /// Serves `dir` with a fake loop, once the socket is in place.
    async fn serve_fake(dir: &Path) -> mpsc::UnboundedReceiver<(Request, Peer)> {
        let (tx, rx) = mpsc::channel(8);
        let (listener, socket_file) = listen(&socket_path(dir)).await.unwrap();
        tokio::spawn(async move {
            let _socket_file = socket_file;
            let mut waiting = Waiting::default();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                admit(&mut waiting, stream, tx.clone());
            }
        });
        fake_loop(rx)
    }

    /// [`call`] on a blocking thread.
    async fn call_async(dir: &Path, request: Request) -> Result<Response, ControlError> {
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || call(&dir, &request, Duration::from_secs(10)))
            .await
            .unwrap()
    }

    /// Sends `bytes` on a raw connection, closes its sending side, and returns the answer line.
    async fn raw_exchange(dir: &Path, bytes: Vec<u8>) -> Response {
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut stream = StdUnixStream::connect(socket_path(&dir)).unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            // The agent may answer and close before reading everything.
            let _ = stream.write_all(&bytes);
            let _ = stream.shutdown(std::net::Shutdown::Write);
            let mut answer = String::new();
            let mut reader = io::BufReader::new(stream);
            io::BufRead::read_line(&mut reader, &mut answer).unwrap();
            serde_json::from_str(&answer).unwrap()
        })
        .await
        .unwrap()
    }

    fn error_message(response: Response) -> String {
        match response {
            Response::Error { message } => message,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn serve_and_call_round_trip_through_the_loop() {
        let dir = TempDir::new();
        let (tx, rx) = mpsc::channel(8);
        let server = tokio::spawn({
            let dir = dir.0.clone();
            async move { serve(&dir, tx).await }
        });
        let mut seen = fake_loop(rx);
        // `serve` is ready once the socket is in place (renamed there after being bound).
        while !socket_path(&dir.0).exists() {
            tokio::task::yield_now().await;
        }
        let flip = Request::Flip {
            route: Route::Upstream,
            for_ms: Some(30 * 60_000),
            reason: "cache upgrade".into(),
        };
        let response = call_async(&dir.0, flip.clone()).await.unwrap();
        let me = std::process::id();
        let Response::Ok { message } = response else { panic!("{response:?}") };
        assert!(message.contains(&format!("uid 0 pid {me}")), "{message}");
        let (request, peer) = seen.recv().await.unwrap();
        assert_eq!(request, flip);
        assert_eq!(peer.uid, 0);
        assert_eq!(peer.pid, Some(me as i32));
        for request in [Request::Release, Request::Drain { timeout_ms: 100 }, Request::Status] {
            assert!(matches!(call_async(&dir.0, request.clone()).await, Ok(Response::Ok { .. })));
            assert_eq!(seen.recv().await.unwrap().0, request);
        }
        // Stopping the server removes its socket: the next call finds no agent.
        server.abort();
        assert!(server.await.unwrap_err().is_cancelled());
        assert!(!socket_path(&dir.0).exists());
        let err = call_async(&dir.0, Request::Status).await.unwrap_err();
        assert!(matches!(err, ControlError::NoAgent { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn the_socket_is_private() {
        let dir = TempDir::new();
        let _seen = serve_fake(&dir.0).await;
        let meta = std::fs::metadata(socket_path(&dir.0)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let names: Vec<_> =
            std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [SOCKET], "only the socket is left in the directory");
    }

    #[tokio::test]
    async fn garbage_is_answered_with_the_problem() {
        let dir = TempDir::new();
        let mut seen = serve_fake(&dir.0).await;
        let message = error_message(raw_exchange(&dir.0, b"hello\n".to_vec()).await);
        assert!(message.contains("cannot parse the request"), "{message}");
        let message = error_message(raw_exchange(&dir.0, b"{\"op\":\"reboot\"}\n".to_vec()).await);
        assert!(message.contains("unknown variant `reboot`"), "{message}");
        let message = error_message(
            raw_exchange(&dir.0, b"{\"op\":\"flip\",\"route\":\"x\"}\n".to_vec()).await,
        );
        assert!(message.contains("unknown variant `x`"), "{message}");
        // None of it reached the loop; a good request after it does, even without a newline
        // when the client closes its side.
        assert!(matches!(
            raw_exchange(&dir.0, b"{\"op\":\"status\"}".to_vec()).await,
            Response::Ok { .. }
        ));
        assert_eq!(seen.recv().await.unwrap().0, Request::Status);
        assert!(seen.try_recv().is_err());
    }

    #[tokio::test]
    async fn an_oversized_line_is_refused() {
        let dir = TempDir::new();
        let mut seen = serve_fake(&dir.0).await;
        let mut huge = br#"{"op":"flip","route":"local","reason":""#.to_vec();
        huge.resize(64 * 1024, b'x');
        huge.extend_from_slice(b"\"}\n");
        let message = error_message(raw_exchange(&dir.0, huge.clone()).await);
        assert!(message.contains("longer than 4096 bytes"), "{message}");
        // Through the client as well: it reads the answer although the agent stopped reading.
        let reason = String::from_utf8(vec![b'x'; 8 * 1024]).unwrap();
        let flip = Request::Flip { route: Route::Local, for_ms: None, reason };
        let message = error_message(call_async(&dir.0, flip).await.unwrap());
        assert!(message.contains("longer than 4096 bytes"), "{message}");
        assert!(seen.try_recv().is_err());
    }

    /// Reads the one answer line on `stream` (waiting at most 10 s) as a [`Response`].
    fn read_answer(stream: StdUnixStream) -> Response {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut answer = String::new();
        io::BufRead::read_line(&mut io::BufReader::new(stream), &mut answer).unwrap();
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"))
    }

    #[tokio::test]
    async fn half_lines_trailing_lines_and_odd_bytes_are_answered_not_obeyed() {
        let dir = TempDir::new();
        let mut seen = serve_fake(&dir.0).await;
        let cases: [(&[u8], &str); 7] = [
            // Half a request, then the client closes its side.
            (br#"{"op":"fl"#, "EOF while parsing"),
            (b"\n", "EOF while parsing"),
            (b"\xff\xfe\x00\n", "cannot parse the request"),
            (br#"{"op":"flip","route":"upstream","for_ms":1e30}"#, "cannot parse the request"),
            (br#"{"op":"drain","timeout_ms":-1}"#, "cannot parse the request"),
            (br#"{"op":"flip","route":"upstream","for_ms":18446744073709551616}"#, "cannot parse"),
            (br#"[{"op":"status"}]"#, "cannot parse the request"),
        ];
        for (bytes, says) in cases {
            let message = error_message(raw_exchange(&dir.0, bytes.to_vec()).await);
            assert!(message.contains(says), "{:?}: {message}", String::from_utf8_lossy(bytes));
        }
        assert!(seen.try_recv().is_err(), "a bad request reached the loop");
        // Two requests on one line's connection: only the first is read.
        let two = b"{\"op\":\"status\"}\n{\"op\":\"release\"}\n".to_vec();
        assert!(matches!(raw_exchange(&dir.0, two).await, Response::Ok { .. }));
        assert_eq!(seen.recv().await.unwrap().0, Request::Status);
        // The largest number the protocol has is taken as it is (the loop must cope).
        let max = br#"{"op":"flip","route":"upstream","for_ms":18446744073709551615}"#;
        assert!(matches!(raw_exchange(&dir.0, max.to_vec()).await, Response::Ok { .. }));
        let (request, _) = seen.recv().await.unwrap();
        assert_eq!(
            request,
            Request::Flip { route: Route::Upstream, for_ms: Some(u64::MAX), reason: String::new() }
        );
        assert!(seen.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_client_that_stalls_or_trickles_is_cut_off_at_the_read_timeout() {
        let dir = TempDir::new();
        let mut seen = serve_fake(&dir.0).await;
        let path = socket_path(&dir.0);
        let started = Instant::now();
        // Half a line, then nothing (the connection stays open).
        let stalled = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                let mut stream = StdUnixStream::connect(path).unwrap();
                stream.write_all(br#"{"op":"release""#).unwrap();
                read_answer(stream)
            })
        };
        // One byte every 50 ms of a line that never ends: each byte is on time, the line is not.
        let trickling = tokio::task::spawn_blocking(move || {
            let mut stream = StdUnixStream::connect(&path).unwrap();
            stream.set_nonblocking(true).unwrap();
            let mut answer = Vec::new();
            for _ in 0..200 {
                if stream.write_all(b" ").is_err() {
                    // Cut off between two bytes: the answer is already there to read.
                    stream.set_nonblocking(false).unwrap();
                    let _ = stream.read_to_end(&mut answer);
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
                let mut buf = [0u8; 512];
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => answer.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => break,
                }
            }
            String::from_utf8(answer).unwrap()
        });
        let message = error_message(stalled.await.unwrap());
        assert!(message.contains("no complete request line within 2s"), "{message}");
        let answer = trickling.await.unwrap();
        assert!(answer.contains("no complete request line within 2s"), "{answer:?}");
        // Both cut off at the deadline, not after the trickle's 10 s.
        assert!(started.elapsed() < READ_TIMEOUT * 3, "{:?}", started.elapsed());
        assert!(seen.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_crowd_of_silent_clients_neither_piles_up_nor_locks_out_a_flip() {
        let dir = TempDir::new();
        let mut seen = serve_fake(&dir.0).await;
        let path = socket_path(&dir.0);
        // Three times as many silent clients as may wait; the first ones are closed to make
        // room, each with an answer saying why.
        let mut silent = Vec::new();
        for _ in 0..3 * MAX_WAITING {
            silent.push(StdUnixStream::connect(&path).unwrap());
        }
        let started = Instant::now();
        let flip = Request::Flip { route: Route::Upstream, for_ms: None, reason: "crowd".into() };
        let response = call_async(&dir.0, flip.clone()).await.unwrap();
        assert!(matches!(response, Response::Ok { .. }), "{response:?}");
        assert!(started.elapsed() < READ_TIMEOUT, "the flip waited for the crowd");
        assert_eq!(seen.recv().await.unwrap().0, flip);
        let answers = tokio::task::spawn_blocking(move || {
            silent.into_iter().map(read_answer).map(error_message).collect::<Vec<_>>()
        })
        .await
        .unwrap();
        let evicted = answers.iter().filter(|m| m.contains("newer control connections")).count();
        let timed_out = answers.iter().filter(|m| m.contains("no complete request line")).count();
        // The flip took one place among the last MAX_WAITING: all but those were closed early.
        assert_eq!(evicted, 2 * MAX_WAITING + 1, "{answers:?}");
        assert_eq!(timed_out, MAX_WAITING - 1, "{answers:?}");
    }

    #[tokio::test]
    async fn a_silent_client_holds_up_nobody_and_is_told_off() {
        let dir = TempDir::new();
        let _seen = serve_fake(&dir.0).await;
        let silent = StdUnixStream::connect(socket_path(&dir.0)).unwrap();
        let started = Instant::now();
        let response = call_async(&dir.0, Request::Status).await.unwrap();
        assert!(matches!(response, Response::Ok { .. }), "{response:?}");
        assert!(started.elapsed() < READ_TIMEOUT, "the second client waited for the first");
        // The silent one is answered (and closed) after the read timeout.
        let answer = tokio::task::spawn_blocking(move || {
            silent.set_read_timeout(Some(READ_TIMEOUT * 5)).unwrap();
            let mut answer = String::new();
            io::BufRead::read_line(&mut io::BufReader::new(silent), &mut answer).unwrap();
            answer
        })
        .await
        .unwrap();
        let message = error_message(serde_json::from_str(&answer).unwrap());
        assert!(message.contains("no complete request line within 2s"), "{message}");
    }

    #[tokio::test]
    async fn a_loop_that_drops_or_stops_is_an_error_not_a_hang() {
        let dir = TempDir::new();
        let (tx, mut rx) = mpsc::channel::<Incoming>(1);
        let server = tokio::spawn({
            let dir = dir.0.clone();
            async move { serve(&dir, tx).await }
        });
        while !socket_path(&dir.0).exists() {
            tokio::task::yield_now().await;
        }
        // The loop drops the reply without answering.
        let dropper = tokio::spawn(async move {
            drop(rx.recv().await);
            rx
        });
        let message = error_message(call_async(&dir.0, Request::Status).await.unwrap());
        assert!(message.contains("dropped the request"), "{message}");
        // The loop is gone.
        drop(dropper.await.unwrap());
        let message = error_message(call_async(&dir.0, Request::Release).await.unwrap());
        assert!(message.contains("shutting down"), "{message}");
        server.abort();
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_is_not() {
        let dir = TempDir::new();
        let path = socket_path(&dir.0);
        // An agent that died: its socket file stays, nothing listens.
        drop(StdUnixListener::bind(&path).unwrap());
        let err = call_async(&dir.0, Request::Status).await.unwrap_err();
        assert!(matches!(err, ControlError::NoAgent { .. }), "{err:?}");
        let _seen = serve_fake(&dir.0).await;
        assert!(matches!(call_async(&dir.0, Request::Status).await, Ok(Response::Ok { .. })));

        // A second agent on the same directory is refused and leaves the first one alone.
        let (tx, _rx) = mpsc::channel(1);
        let err = serve(&dir.0, tx).await.unwrap_err();
        assert!(matches!(err, ControlError::AlreadyServing { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("another agent is serving") && text.contains(SOCKET), "{text}");
        assert!(matches!(call_async(&dir.0, Request::Status).await, Ok(Response::Ok { .. })));
    }

    #[tokio::test]
    async fn something_else_in_the_sockets_place_is_left_alone() {
        let dir = TempDir::new();
        let path = socket_path(&dir.0);
        std::fs::write(&path, b"precious").unwrap();
        let (tx, _rx) = mpsc::channel(1);
        let err = serve(&dir.0, tx).await.unwrap_err();
        assert!(matches!(err, ControlError::NotASocket { .. }), "{err:?}");
        assert!(err.to_string().contains("remove it"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    }

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

    /// The client side of [`a_peer_that_is_not_root_is_refused`], run by the test binary as
    /// another user: calls the socket and prints the outcome.
    fn child_client(dir: &str) {
        let outcome = call(Path::new(dir), &Request::Status, Duration::from_secs(10));
        let text = match outcome {
            Ok(response) => format!("{response:?}"),
            Err(err) => format!("{err}"),
        };
        println!("CHILD-OUTCOME: {text}");
    }

    /// Runs the test at `test_path` (this test binary's [`a_peer_that_is_not_root_is_refused`])
    /// as uid/gid 65534 against `dir`; returns the child's outcome line.
    fn call_as_nobody(test_path: &str, dir: &Path) -> String {
        let output = Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(std::env::current_exe().unwrap())
            .args([test_path, "--exact", "--nocapture"])
            .env(CHILD_ENV, dir)
            .output()
            .expect("setpriv (util-linux) runs");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "child failed: {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let line = stdout.lines().find(|l| l.starts_with("CHILD-OUTCOME: "));
        line.unwrap_or_else(|| panic!("the child printed no outcome: {stdout}")).to_owned()
    }

    #[test]
    fn a_peer_that_is_not_root_is_refused() {
        let test_path = crate::testutil::test_path!();
        if let Ok(dir) = std::env::var(CHILD_ENV) {
            return child_client(&dir);
        }
        assert!(nix::unistd::geteuid().is_root(), "this test needs root, to run a child as nobody");
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let dir = TempDir::new();
        // The child, as uid 65534, must be able to reach the directory.
        std::fs::set_permissions(&dir.0, Permissions::from_mode(0o755)).unwrap();
        let mut seen = runtime.block_on(serve_fake(&dir.0));

        // First line of defence: the socket's mode.
        let outcome = call_as_nobody(test_path, &dir.0);
        assert!(
            outcome.contains("cannot connect") && outcome.contains("ermission denied"),
            "{outcome}"
        );

        // Second: the peer's credentials, should the mode ever be looser.
        std::fs::set_permissions(socket_path(&dir.0), Permissions::from_mode(0o666)).unwrap();
        let outcome = call_as_nobody(test_path, &dir.0);
        assert!(outcome.contains(ONLY_ROOT), "{outcome}");
        assert!(seen.try_recv().is_err(), "a refused request reached the loop");
    }
}
