//! The accept loop and its limits: a task per connection, at most [`Limits::max_connections`]
//! of them, and when they are all taken the oldest one still silent gives way (the queue of
//! silent connections is [`Waiting`], shared with the control socket). Accept errors are sorted
//! into those of one connection, passing shortages, and a broken listener, which alone ends the
//! server.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::{JoinError, JoinSet};
use tracing::{debug, warn};

use super::{conn, Limits, State};
use crate::waiting::Waiting;

/// How long to wait before accepting again after the process ran out of file descriptors or
/// memory: the condition lasts, and retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Accepts connections on `listener` and serves each in a task of its own, within `limits`.
/// Returns the error that broke the listener.
pub(super) async fn run(listener: TcpListener, state: State, limits: Limits) -> io::Error {
    let state = Arc::new(state);
    let mut connections = JoinSet::new();
    // The connections still reading their request head.
    let mut waiting = Waiting::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(done) = connections.join_next() => {
                report(done);
                continue;
            }
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => match accept_error(&e) {
                AcceptError::OneConnection => continue,
                AcceptError::Shortage => {
                    warn!(error = %e, "accepting HTTP connections failed; retrying");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
                AcceptError::Fatal => return e,
            },
        };
        // Count only connections still being served.
        while let Some(done) = connections.try_join_next() {
            report(done);
        }
        if connections.len() >= limits.max_connections {
            if !waiting.evict_oldest() {
                debug!(%peer, limit = limits.max_connections, "too many HTTP connections; closing");
                continue;
            }
            debug!(
                limit = limits.max_connections,
                "too many HTTP connections; closing the oldest idle one"
            );
        }
        let reading = waiting.join();
        let state = state.clone();
        connections.spawn(async move {
            if let Err(e) = conn::handle(stream, &state, limits, reading).await {
                debug!(%peer, error = %e, "HTTP connection failed");
            }
        });
    }
}

/// Logs a connection task that panicked; one that ended is simply gone.
fn report(done: Result<(), JoinError>) {
    if let Err(e) = done {
        warn!(error = %e, "an HTTP connection task failed");
    }
}

/// How bad an accept error is.
#[derive(Debug, PartialEq, Eq)]
enum AcceptError {
    /// Only the connection being accepted failed.
    OneConnection,
    /// Out of file descriptors or memory: try again a little later.
    Shortage,
    /// The listener itself is broken.
    Fatal,
}

fn accept_error(e: &io::Error) -> AcceptError {
    use io::ErrorKind::*;
    match (e.kind(), e.raw_os_error()) {
        (ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock, _) => {
            AcceptError::OneConnection
        }
        // accept(2): Linux passes the new connection's pending network errors on; and EPERM
        // is a firewall rule refusing it.
        (
            _,
            Some(
                libc::ENETDOWN
                | libc::EPROTO
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
                | libc::ETIMEDOUT
                | libc::EPERM,
            ),
        ) => AcceptError::OneConnection,
        (_, Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
            AcceptError::Shortage
        }
        _ => AcceptError::Fatal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_stop_the_server_only_when_the_listener_is_broken() {
        let os = io::Error::from_raw_os_error;
        assert_eq!(accept_error(&os(libc::ECONNABORTED)), AcceptError::OneConnection);
        assert_eq!(accept_error(&os(libc::EHOSTUNREACH)), AcceptError::OneConnection);
        assert_eq!(accept_error(&os(libc::EMFILE)), AcceptError::Shortage);
        assert_eq!(accept_error(&os(libc::ENOBUFS)), AcceptError::Shortage);
        assert_eq!(accept_error(&os(libc::EBADF)), AcceptError::Fatal);
        assert_eq!(accept_error(&os(libc::EINVAL)), AcceptError::Fatal);
    }
}
