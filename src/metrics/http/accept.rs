//! The accept loop and its limits: a task per connection, at most [`Limits::max_connections`]
//! of them, and when they are all taken [`Places`] decides which connection gives way (one of
//! the address holding the most), or lets the newcomer in a place kept for health checks
//! ([`Limits::probe_connections`]). Accept errors are sorted into those of one connection, passing
//! shortages, and a broken listener, which alone ends the server.

use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::{JoinError, JoinSet};
use tracing::{debug, warn};

use super::places::{Admitted, Places};
use super::{conn, Limits, State};

/// How long to wait before accepting again after the process ran out of file descriptors or
/// memory: the condition lasts, and retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The places, shared by the accept loop and the connections' tasks.
type Shared = Arc<Mutex<Places<Arc<Notify>>>>;

/// Accepts connections on `listener` and serves each in a task of its own, within `limits`.
/// Returns the error that broke the listener.
pub(super) async fn run(listener: TcpListener, state: State, limits: Limits) -> io::Error {
    let state = Arc::new(state);
    let places = Places::new(limits.max_connections, limits.probe_connections);
    let places: Shared = Arc::new(Mutex::new(places));
    let mut connections = JoinSet::new();
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
        while let Some(done) = connections.try_join_next() {
            report(done);
        }
        let evict = Arc::new(Notify::new());
        let admitted = lock(&places).admit(peer.ip(), evict.clone());
        let Some(Admitted { id, evicted, probes_only }) = admitted else {
            debug!(%peer, limit = limits.max_connections, "too many HTTP connections; closing");
            continue;
        };
        if probes_only {
            debug!(%peer, limit = limits.max_connections, "too many HTTP connections; one kept for health checks");
        }
        if let Some(evicted) = evicted {
            debug!(%peer, limit = limits.max_connections, "too many HTTP connections; one gives way");
            evicted.notify_one();
        }
        let place = Place { places: places.clone(), client: peer.ip(), id, probes_only };
        let state = state.clone();
        connections.spawn(async move {
            tokio::select! {
                served = conn::handle(stream, &state, limits, &place) => {
                    if let Err(e) = served {
                        debug!(%peer, error = %e, "HTTP connection failed");
                    }
                }
                () = evict.notified() => {}
            }
        });
        // Its task reads the request before the next connection is let in: a burst accepted
        // one after the other would otherwise find every newcomer still unread, where nothing
        // tells a request about to be read from a silent client (`places`).
        tokio::task::yield_now().await;
    }
}

/// A connection's place, given back when its task ends however it ends.
pub(super) struct Place {
    places: Shared,
    client: IpAddr,
    id: u64,
    /// One of the places kept for health checks: only `/healthz` and `/readyz` are answered.
    pub(super) probes_only: bool,
}

impl Place {
    /// The task begins to read the request: from now on a newcomer of the same address may
    /// take this place.
    pub(super) fn reading(&self) {
        lock(&self.places).reading(self.client, self.id);
    }

    /// The request is read: from now on only another address's newcomer takes this place.
    pub(super) fn answering(&self) {
        lock(&self.places).answering(self.client, self.id);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        lock(&self.places).leave(self.client, self.id);
    }
}

/// The places; no code holding the lock panics, so a poisoned one is still whole.
fn lock(places: &Shared) -> std::sync::MutexGuard<'_, Places<Arc<Notify>>> {
    places.lock().unwrap_or_else(PoisonError::into_inner)
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
