//! TCP: each connection TPROXY hands the listener (its local address is already the one the
//! client connected to) relayed to a connection of its own to the upstream.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::timeout;

use super::{count, report_task_end, Addr, Counters, Options, Share, Shares};

/// What each direction of a relay reads at a time (a DNS message may take several reads).
const CHUNK: usize = 8 << 10;

/// How long accepting waits after an error other than an aborted connection (such as running
/// out of descriptors), which would otherwise repeat at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Accepts connections on `listener` forever, each relayed to `upstream` by a task of its own,
/// at most `options.max_connections` at once and `options.max_connections_per_client` of one
/// client address.
pub(super) async fn serve(
    listener: TcpListener,
    upstream: Addr,
    options: Options,
    counters: Arc<Counters>,
) -> Infallible {
    let open = Arc::new(Semaphore::new(options.max_connections));
    let shares = Arc::new(Shares::new(options.max_connections_per_client));
    // Dropped with this future: every connection is closed.
    let mut relays = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            Some(ended) = relays.join_next() => {
                report_task_end(ended);
                continue;
            }
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((client, peer)) => {
                let Ok(permit) = open.clone().try_acquire_owned() else {
                    count(&counters.dropped_busy);
                    continue; // `client` is dropped: closed.
                };
                let Some(share) = shares.take_owned(peer.ip()) else {
                    count(&counters.dropped_busy);
                    count(&counters.dropped_over_share);
                    continue; // `client` and `permit` are dropped.
                };
                count(&counters.tcp_connections);
                relays.spawn(relay_to_upstream(
                    client,
                    peer,
                    upstream.now(),
                    options,
                    counters.clone(),
                    (permit, share),
                ));
            }
            Err(error) => {
                tracing::warn!(%error, "accepting a TCP connection failed");
                if error.kind() != io::ErrorKind::ConnectionAborted {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
}

/// Connects to `upstream` and relays `client` to it until either ends; then both are closed.
async fn relay_to_upstream(
    client: TcpStream,
    peer: SocketAddr,
    upstream: SocketAddr,
    options: Options,
    counters: Arc<Counters>,
    _open: (OwnedSemaphorePermit, Share),
) {
    let connected = timeout(options.upstream_timeout, TcpStream::connect(upstream)).await;
    let upstream_stream = match connected {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            count(&counters.upstream_failures);
            tracing::debug!(%peer, %upstream, %error, "connecting to the upstream failed");
            return;
        }
        Err(_) => {
            count(&counters.upstream_failures);
            tracing::debug!(%peer, %upstream, "connecting to the upstream timed out");
            return;
        }
    };
    // Queries and answers are small writes, each to be sent at once.
    let _ = client.set_nodelay(true);
    let _ = upstream_stream.set_nodelay(true);
    match relay(client, upstream_stream, options.tcp_idle_timeout).await {
        Ended::Failed(error) => tracing::debug!(%peer, %error, "relaying a TCP connection failed"),
        ended => tracing::debug!(%peer, ?ended, "TCP connection relayed"),
    }
}

/// How a [`relay`] ended.
#[derive(Debug)]
pub(super) enum Ended {
    /// The upstream closed its side: it has nothing more to say.
    UpstreamClosed,
    /// Nothing was read or written either way for the idle timeout.
    Idle,
    /// A read or a write failed (a reset, say).
    Failed(io::Error),
}

/// Relays `client` to `upstream` byte for byte until the upstream closes, either fails, or
/// nothing moves for `idle`; both are closed when this returns (they are dropped). A client
/// that closes its side (having sent its last query) is passed on as such, and still gets the
/// answers.
pub(super) async fn relay<C, U>(client: C, upstream: U, idle: Duration) -> Ended
where
    C: AsyncRead + AsyncWrite,
    U: AsyncRead + AsyncWrite,
{
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let (mut from_upstream, mut to_upstream) = tokio::io::split(upstream);
    let mut query = vec![0; CHUNK];
    let mut answer = vec![0; CHUNK];
    let mut client_open = true;
    loop {
        // Reads are cancel-safe; each write is bounded by `idle` on its own.
        let moved = tokio::select! {
            read = from_client.read(&mut query), if client_open => match read {
                Ok(0) => {
                    client_open = false;
                    timeout(idle, to_upstream.shutdown()).await
                }
                Ok(n) => timeout(idle, to_upstream.write_all(&query[..n])).await,
                Err(error) => return Ended::Failed(error),
            },
            read = from_upstream.read(&mut answer) => match read {
                Ok(0) => return Ended::UpstreamClosed,
                Ok(n) => timeout(idle, to_client.write_all(&answer[..n])).await,
                Err(error) => return Ended::Failed(error),
            },
            () = tokio::time::sleep(idle) => return Ended::Idle,
        };
        match moved {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Ended::Failed(error),
            Err(_) => return Ended::Idle,
        }
    }
}
