//! The agent's fallback DNS forwarder: who answers pods' queries for the link-local IP while the
//! node-local cache is dead or hung (docs/design/link-local.md §6.2 says why this shape).
//!
//! The forwarder never takes the link-local IP (169.254.20.10) itself: that address stays the
//! cache's. It listens on an address of its own (`127.53.0.53:53` and `[fd00:169:254::53]:53`
//! by default), and the agent's TPROXY rules hand it the packets for 169.254.20.10:53 that no
//! socket of the cache takes. The kernel's socket lookup is the guard, so while the cache
//! listens the forwarder sees nothing. Each UDP query goes on to the upstream (the
//! kube-dns-upstream ClusterIP, reached through kube-proxy from the node) on one of a few
//! long-lived sockets connected to it, under an id of the forwarder's choosing (`upstream.rs`
//! and `ids.rs` say why and how), and its answer goes back byte for byte but for the id, which
//! is the client's again, TC bit and all (the client then retries over TCP, which is relayed
//! too), **from the address the client sent to**: the pod sees the answer come from the IP it
//! queried, as a connected resolver socket demands. Each TCP connection is relayed to a
//! connection of its own to the upstream. Nothing is cached, and nothing of a message is read
//! but its id and its question (which an answer must repeat).
//!
//! The socket options, and why:
//!
//! * `IP_TRANSPARENT` / `IPV6_TRANSPARENT` on both sockets: TPROXY delivers only to transparent
//!   sockets (`nf_tproxy` drops a socket it finds that is not), and they may bind an address
//!   that is not the node's, as fd00:169:254::53 is not. Setting them needs `CAP_NET_ADMIN`.
//!   socket2 sets them: nix 0.31 lacks `IPV6_TRANSPARENT`, and the crate has no `unsafe` here.
//! * `IP_PKTINFO` / `IPV6_RECVPKTINFO` on the UDP socket, to learn where a query was sent.
//!   TPROXY leaves the packet's header alone, so its destination is still 169.254.20.10, and
//!   pktinfo reports it; the same control message, given to `sendmsg`, sets the answer's
//!   source. `IP_RECVORIGDSTADDR` would add the port, but that is the socket's own by
//!   construction (the rules send port 53 to port 53, and an answer could come from no other),
//!   and it cannot be sent back: pktinfo is needed for the answer anyway. Note that IPv4 reads
//!   an outgoing pktinfo's source from `ipi_spec_dst`, not from `ipi_addr`, where the incoming
//!   destination is (`udp::answer_source_v4`).
//! * `IP_TTL` / `IPV6_UNICAST_HOPS` 255 on both sockets (a TCP connection inherits it): the
//!   agent's rules count the cache's replies for a drain, and tell the forwarder's answers,
//!   which leave from the same address and port, by it (`ruleset::FORWARDER_HOP_LIMIT`).
//! * `SO_REUSEADDR` on the TCP listener only, the usual for a server that restarts while its
//!   old connections linger. Not on UDP: there it would let a second forwarder (an old agent
//!   still running) bind the same address beside this one and take half the queries. A failed
//!   bind is how the agent learns that someone else is there.
//!
//! Bounds: at most [`Options::max_in_flight`] UDP queries wait for the upstream at once and at
//! most [`Options::max_connections`] TCP connections are relayed; beyond them a query is
//! dropped and a connection closed, both counted. Within those, each client address has a
//! share ([`Options::max_in_flight_per_client`], [`Options::max_connections_per_client`],
//! kept by `Shares`): one pod that floods the fallback with queries the upstream answers
//! late or never fills its own share and no more, and every other pod's queries still find
//! room. A UDP query the upstream has not answered
//! within [`Options::upstream_timeout`] (give or take the 100 ms between two sweeps) is dropped
//! without a word (the client retries, as it would after a lost datagram), and so is one the
//! upstream refuses (an ICMP error); a TCP connection with nothing to relay for
//! [`Options::tcp_idle_timeout`] is closed. Dropping [`Forwarder::run`]'s future aborts every
//! query and connection in flight and closes the sockets.

mod ids;
pub mod lease;
mod tcp;
mod udp;
mod upstream;

use std::collections::hash_map::{Entry, HashMap};
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::sys::socket::{setsockopt, sockopt};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpListener, UdpSocket};

use crate::probe::Transport;
pub use crate::upstream::Addr;

/// The pending-connection queue of the TCP listener (the kernel caps it at `somaxconn`).
const LISTEN_BACKLOG: i32 = 1024;

/// Limits and timeouts of a [`Forwarder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// How long a UDP query waits for the upstream's answer, and a TCP connection for the
    /// upstream to accept it, before it is given up.
    pub upstream_timeout: Duration,
    /// UDP queries waiting for the upstream at once; a query beyond it is dropped.
    pub max_in_flight: usize,
    /// TCP connections relayed at once; a connection beyond it is closed.
    pub max_connections: usize,
    /// A TCP connection with nothing to relay either way for this long is closed.
    pub tcp_idle_timeout: Duration,
    /// UDP queries of one client address waiting at once; its query beyond it is dropped.
    pub max_in_flight_per_client: usize,
    /// TCP connections of one client address relayed at once; its connection beyond it is
    /// closed.
    pub max_connections_per_client: usize,
    /// How often each socket to the upstream is replaced by a new one (a new source port:
    /// kube-proxy picks a CoreDNS endpoint for it afresh); the sockets are spread over it. A
    /// socket that has carried no query since it was dialled waits for one first.
    pub upstream_redial: Duration,
}

impl Default for Options {
    /// 2 s for the upstream (a stub resolver waits 5 s before it retries), 4096 queries in
    /// flight, 256 connections, 10 s idle; a sixteenth of each per client address: 256
    /// queries and 16 connections.
    ///
    /// A client needs about its rate times the upstream's latency in flight: 256 carry 50,000
    /// queries/s at CoreDNS's 5 ms, and 128/s of queries that time out; 16 connections carry
    /// 3,200 TCP lookups/s at 5 ms (DNS over TCP is what a truncated answer calls for). It
    /// takes sixteen addresses flooding at once to fill a whole bound.
    ///
    /// The bounds are what the agent's memory limit holds at its worst (tests/e2e_memory.rs):
    /// a relayed connection costs about 28 KiB (its two 8 KiB buffers, its task, two sockets
    /// in the kernel), so 1,024 would take 29 MiB a family, and a dual-stack node (a forwarder
    /// each) at those bounds goes past the DaemonSet's 64 MiB and is OOM-killed.
    fn default() -> Options {
        Options {
            upstream_timeout: Duration::from_secs(2),
            max_in_flight: 4096,
            max_connections: 256,
            tcp_idle_timeout: Duration::from_secs(10),
            max_in_flight_per_client: 256,
            max_connections_per_client: 16,
            upstream_redial: Duration::from_secs(5),
        }
    }
}

/// What the forwarder did, counted since it was bound; shared with whoever exports them.
///
/// Every UDP query counted in `udp_queries` ends, once it is no longer in flight, in exactly
/// one of `udp_answers`, `upstream_failures` and `answer_failures`.
#[derive(Debug, Default)]
pub struct Counters {
    /// UDP queries sent on to the upstream.
    pub udp_queries: AtomicU64,
    /// Upstream answers sent back to UDP clients.
    pub udp_answers: AtomicU64,
    /// TCP connections taken to be relayed to the upstream.
    pub tcp_connections: AtomicU64,
    /// UDP queries the upstream did not answer in time (or refused), and TCP connections it did
    /// not accept in time.
    pub upstream_failures: AtomicU64,
    /// Answers that could not be sent back from the address their query was sent to.
    pub answer_failures: AtomicU64,
    /// Queries dropped and connections closed because the forwarder was at its bound, or
    /// their client at its share.
    pub dropped_busy: AtomicU64,
    /// Of `dropped_busy`, those whose client was at its share (the forwarder had room).
    pub dropped_over_share: AtomicU64,
    /// Datagrams too short to be a DNS message, dropped.
    pub dropped_malformed: AtomicU64,
    /// Sockets to the upstream replaced by new ones (see [`Options::upstream_redial`]).
    pub upstream_redials: AtomicU64,
    /// Datagrams from the upstream that answer no query in flight, dropped: late (their query
    /// had expired), under an id no query has, or for another question than the query's.
    pub stray_answers: AtomicU64,
}

/// The values of [`Counters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// See [`Counters::udp_queries`].
    pub udp_queries: u64,
    /// See [`Counters::udp_answers`].
    pub udp_answers: u64,
    /// See [`Counters::tcp_connections`].
    pub tcp_connections: u64,
    /// See [`Counters::upstream_failures`].
    pub upstream_failures: u64,
    /// See [`Counters::answer_failures`].
    pub answer_failures: u64,
    /// See [`Counters::dropped_busy`].
    pub dropped_busy: u64,
    /// See [`Counters::dropped_over_share`].
    pub dropped_over_share: u64,
    /// See [`Counters::dropped_malformed`].
    pub dropped_malformed: u64,
    /// See [`Counters::upstream_redials`].
    pub upstream_redials: u64,
    /// See [`Counters::stray_answers`].
    pub stray_answers: u64,
}

impl Counters {
    /// The current values (each read on its own: a snapshot, not a transaction).
    pub fn totals(&self) -> Totals {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Totals {
            udp_queries: read(&self.udp_queries),
            udp_answers: read(&self.udp_answers),
            tcp_connections: read(&self.tcp_connections),
            upstream_failures: read(&self.upstream_failures),
            answer_failures: read(&self.answer_failures),
            dropped_busy: read(&self.dropped_busy),
            dropped_over_share: read(&self.dropped_over_share),
            dropped_malformed: read(&self.dropped_malformed),
            upstream_redials: read(&self.upstream_redials),
            stray_answers: read(&self.stray_answers),
        }
    }
}

/// The forwarders' totals added up (one forwarder per family).
impl std::iter::Sum for Totals {
    fn sum<I: Iterator<Item = Totals>>(all: I) -> Totals {
        all.fold(Totals::default(), |a, b| Totals {
            udp_queries: a.udp_queries + b.udp_queries,
            udp_answers: a.udp_answers + b.udp_answers,
            tcp_connections: a.tcp_connections + b.tcp_connections,
            upstream_failures: a.upstream_failures + b.upstream_failures,
            answer_failures: a.answer_failures + b.answer_failures,
            dropped_busy: a.dropped_busy + b.dropped_busy,
            dropped_over_share: a.dropped_over_share + b.dropped_over_share,
            dropped_malformed: a.dropped_malformed + b.dropped_malformed,
            upstream_redials: a.upstream_redials + b.upstream_redials,
            stray_answers: a.stray_answers + b.stray_answers,
        })
    }
}

/// The fuzz target `forwarder_message` (see `crate::fuzzing`): `data` as a client's query and
/// as an upstream's answer to the forwarder's table of queries in flight.
#[cfg(fuzzing)]
pub fn fuzz_message(data: &[u8]) {
    use std::time::Instant;

    use ids::{Answered, Pending, HEADER_LEN};
    let deadline = Instant::now() + Duration::from_secs(60);
    // A query's own bytes, under the id the table gave it, answer it, whatever they are.
    if data.len() >= HEADER_LEN {
        let mut table = Pending::new();
        let id = table.insert(data, (), deadline).expect("an empty table has room");
        let mut answer = data.to_vec();
        answer[..2].copy_from_slice(&id.to_be_bytes());
        assert_eq!(table.answer(&answer), Answered::Query(()), "a query's own answer");
        assert_eq!(table.answer(&answer), Answered::Unknown, "an answer taken twice");
    }
    // As the upstream's answer to a query pending under its id (the fuzzer's bytes reach past
    // the id): taken or not, the table stays consistent.
    let id = data.get(..2).map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let mut table = Pending::with_ids(std::iter::repeat(id));
    let asked = [
        &id.to_be_bytes()[..],
        &b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03who\x04test\x00\x00\x01\x00\x01"[..],
    ]
    .concat();
    assert_eq!(table.insert(&asked, (), deadline), Some(id));
    let taken = table.answer(data) == Answered::Query(());
    assert_eq!(table.len(), usize::from(!taken));
    assert_eq!(table.cancel(id).is_some(), !taken, "the query is pending unless taken");
}

/// What each client address holds of a bound (UDP queries in flight, or TCP connections),
/// each held to a share of it.
///
/// Exact, not sampled: a client is charged for its own queries only. An address is in the
/// map only while it holds something (its entry goes when its count falls to 0), and the
/// forwarder's own bound caps what all of them hold, so the map never has more entries than
/// that bound (4096 for UDP: under 300 KiB at its peak, kept as the map's capacity), however
/// many clients come and go. The key is the whole address: pods on a node share a prefix, and a share per prefix
/// would be one share for all of them. The key is only as good as the source address: a pod
/// that forges sources gets a share per forged address, up to the forwarder's bound.
///
/// The listening task takes the lock once per batch of queries ([`Shares::lock`]), each
/// socket's task once per batch of answers. The one lock taken while this one is held is a
/// socket's table of pending queries (the listening task's inserts); nothing takes this one
/// while holding a table.
#[derive(Debug)]
struct Shares {
    /// The most one address holds.
    share: usize,
    /// What each address holds: never 0.
    held: Mutex<HashMap<IpAddr, usize>>,
}

impl Shares {
    /// Shares of `share` each.
    fn new(share: usize) -> Shares {
        Shares { share, held: Mutex::default() }
    }

    /// The table, to take or give back several at once. Nothing panics while holding it, so a
    /// poisoned lock is still consistent.
    fn lock(&self) -> Held<'_> {
        Held { share: self.share, held: self.held.lock().unwrap_or_else(PoisonError::into_inner) }
    }

    /// Takes one for `client`, given back when the [`Share`] is dropped; None when `client` is
    /// at its share.
    fn take_owned(self: &Arc<Self>, client: IpAddr) -> Option<Share> {
        self.lock().take(client).then(|| Share { shares: self.clone(), client })
    }

    /// How many addresses hold something.
    #[cfg(test)]
    fn clients(&self) -> usize {
        self.lock().held.len()
    }
}

/// [`Shares`], locked.
struct Held<'a> {
    share: usize,
    held: MutexGuard<'a, HashMap<IpAddr, usize>>,
}

impl Held<'_> {
    /// Takes one for `client`; false when it is at its share.
    fn take(&mut self, client: IpAddr) -> bool {
        let held = self.held.entry(client).or_insert(0);
        if *held >= self.share {
            return false;
        }
        *held += 1;
        true
    }

    /// Gives one of `client`'s back.
    fn give_back(&mut self, client: IpAddr) {
        if let Entry::Occupied(mut held) = self.held.entry(client) {
            *held.get_mut() -= 1;
            if *held.get() == 0 {
                held.remove();
            }
        }
    }
}

/// One of a client's share, given back when dropped (a TCP connection's).
#[derive(Debug)]
struct Share {
    shares: Arc<Shares>,
    client: IpAddr,
}

impl Drop for Share {
    fn drop(&mut self) {
        self.shares.lock().give_back(self.client);
    }
}

/// Adds one to `counter`.
fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Logs a query's or a connection's task that panicked (a bug: the forwarder keeps serving).
fn report_task_end(ended: Result<(), tokio::task::JoinError>) {
    if let Err(error) = ended {
        tracing::error!(%error, "a forwarder task failed");
    }
}

/// What the forwarder failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be made transparent: the process lacks `CAP_NET_ADMIN`.
    #[error(
        "setting {option} on the forwarder's {transport} socket for {listen} failed: {source} \
         (the agent needs CAP_NET_ADMIN)"
    )]
    Transparent {
        /// The address the socket was for.
        listen: SocketAddr,
        /// Its transport.
        transport: Transport,
        /// `IP_TRANSPARENT` or `IPV6_TRANSPARENT`.
        option: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// The listen address is taken, or the kernel refused it (port 53 is below 1024: binding
    /// it needs `CAP_NET_BIND_SERVICE`).
    #[error(
        "binding {listen} ({transport}, {option}) failed: {source} (EACCES: port 53 needs \
         CAP_NET_BIND_SERVICE; EADDRINUSE: another process, or another agent, is bound there, \
         and the forwarder's address must be its own)"
    )]
    Bind {
        /// The address.
        listen: SocketAddr,
        /// The transport.
        transport: Transport,
        /// `IP_TRANSPARENT` or `IPV6_TRANSPARENT`, set before the bind.
        option: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// Another step of a socket's set-up failed: creating it, an option, listening, or handing
    /// it to tokio (which needs the call to run inside a tokio runtime).
    #[error(
        "setting up the forwarder's {transport} socket on {listen} failed at {step}: {source}"
    )]
    Setup {
        /// The address.
        listen: SocketAddr,
        /// The transport.
        transport: Transport,
        /// The step, e.g. `"setting IP_PKTINFO"`.
        step: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Receiving queries failed in a way a retry would not mend; the forwarder stopped.
    #[error("receiving UDP queries on {listen} failed: {source} (the forwarder has stopped)")]
    Receive {
        /// The listen address.
        listen: SocketAddr,
        /// The socket's error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Whether the process lacks a privilege the forwarder needs (`EACCES`, `EPERM`).
    pub fn is_permission(&self) -> bool {
        match self {
            Error::Transparent { source, .. } | Error::Bind { source, .. } => {
                source.kind() == io::ErrorKind::PermissionDenied
            }
            _ => false,
        }
    }
}

/// A forwarder bound to its listen address, UDP and TCP; [`Forwarder::run`] serves.
#[derive(Debug)]
pub struct Forwarder {
    listen: SocketAddr,
    upstream: Addr,
    options: Options,
    udp: UdpSocket,
    pool: upstream::Pool,
    tcp: TcpListener,
    counters: Arc<Counters>,
    lease: Option<lease::Holder>,
}

impl Forwarder {
    /// Binds UDP and TCP on `listen` with transparent sockets, to forward to `upstream` (a fixed
    /// address, or one that follows its Service: read at each dial). Must be called inside a
    /// tokio runtime (the sockets are registered with its reactor); nothing is received until
    /// [`Forwarder::run`].
    pub fn bind(
        listen: SocketAddr,
        upstream: impl Into<Addr>,
        options: Options,
    ) -> Result<Forwarder, Error> {
        let upstream = upstream.into();
        let udp = transparent_socket(listen, Transport::Udp)?;
        let udp = UdpSocket::from_std(udp.into()).map_err(setup(
            listen,
            Transport::Udp,
            "registering with the tokio runtime",
        ))?;
        let shares = Arc::new(Shares::new(options.max_in_flight_per_client));
        let pool = upstream::Pool::open(upstream.clone(), shares).map_err(setup(
            listen,
            Transport::Udp,
            "opening the sockets to the upstream",
        ))?;
        let tcp = transparent_socket(listen, Transport::Tcp)?;
        let tcp = TcpListener::from_std(tcp.into()).map_err(setup(
            listen,
            Transport::Tcp,
            "registering with the tokio runtime",
        ))?;
        let counters = Arc::default();
        Ok(Forwarder { listen, upstream, options, udp, pool, tcp, counters, lease: None })
    }

    /// This forwarder, renewing `holder`'s lease (iptables: [`lease`]) from the task that
    /// serves its UDP queries, for as long as [`Forwarder::run`] serves.
    pub fn holding(self, holder: lease::Holder) -> Forwarder {
        Forwarder { lease: Some(holder), ..self }
    }

    /// The address the forwarder listens on.
    pub fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Its counters, live: they keep counting while [`Forwarder::run`] serves.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Serves UDP and TCP until the future is dropped (which aborts what is in flight), or
    /// until receiving UDP queries fails for good.
    pub async fn run(self) -> Result<Infallible, Error> {
        tracing::info!(listen = %self.listen, upstream = %self.upstream.now(), "forwarder serving");
        let udp = udp::serve(
            Arc::new(self.udp),
            self.listen,
            self.pool,
            self.options,
            self.counters.clone(),
            self.lease,
        );
        let tcp = tcp::serve(self.tcp, self.upstream, self.options, self.counters);
        tokio::select! {
            stopped = udp => stopped,
            never = tcp => match never {},
        }
    }
}

/// A [`Error::Setup`] for a step of `listen`'s `transport` socket.
fn setup(
    listen: SocketAddr,
    transport: Transport,
    step: &'static str,
) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Setup { listen, transport, step, source }
}

/// The UDP socket's receive buffer (the kernel doubles it for its bookkeeping). Full, it holds
/// about 7,000 queries (2 MiB at a query's 300-odd bytes of kernel memory), and a memory
/// cgroup v2 charges all of it to the agent: 2 MiB a family, where 4 MiB would be 8 MiB, an
/// eighth of the DaemonSet's 64 MiB for each forwarder on top of the forwarder at its bounds.
const UDP_RECV_BUFFER: usize = 1 << 20;

/// A non-blocking transparent socket bound to `listen` (listening, for TCP).
fn transparent_socket(listen: SocketAddr, transport: Transport) -> Result<Socket, Error> {
    let (kind, protocol) = match transport {
        Transport::Udp => (Type::DGRAM, Protocol::UDP),
        Transport::Tcp => (Type::STREAM, Protocol::TCP),
    };
    let socket = Socket::new(Domain::for_address(listen), kind, Some(protocol)).map_err(setup(
        listen,
        transport,
        "creating the socket",
    ))?;
    let transparent = |option, result: io::Result<()>| {
        result.map_err(|source| Error::Transparent { listen, transport, option, source })
    };
    let hops = u32::from(crate::ruleset::FORWARDER_HOP_LIMIT);
    let option = match listen {
        SocketAddr::V4(_) => {
            transparent("IP_TRANSPARENT", socket.set_ip_transparent_v4(true))?;
            socket.set_ttl_v4(hops).map_err(setup(listen, transport, "setting IP_TTL"))?;
            "IP_TRANSPARENT"
        }
        SocketAddr::V6(_) => {
            // The IPv6 forwarder takes IPv6 only; IPv4 has a forwarder of its own.
            socket.set_only_v6(true).map_err(setup(listen, transport, "setting IPV6_V6ONLY"))?;
            transparent("IPV6_TRANSPARENT", socket.set_ip_transparent_v6(true))?;
            let set_hops = socket.set_unicast_hops_v6(hops);
            set_hops.map_err(setup(listen, transport, "setting IPV6_UNICAST_HOPS"))?;
            "IPV6_TRANSPARENT"
        }
    };
    match (transport, listen) {
        (Transport::Tcp, _) => socket.set_reuse_address(true).map_err(setup(
            listen,
            transport,
            "setting SO_REUSEADDR",
        ))?,
        (Transport::Udp, SocketAddr::V4(_)) => setsockopt(&socket, sockopt::Ipv4PacketInfo, &true)
            .map_err(|errno| setup(listen, transport, "setting IP_PKTINFO")(errno.into()))?,
        (Transport::Udp, SocketAddr::V6(_)) => {
            setsockopt(&socket, sockopt::Ipv6RecvPacketInfo, &true).map_err(|errno| {
                setup(listen, transport, "setting IPV6_RECVPKTINFO")(errno.into())
            })?
        }
    }
    if transport == Transport::Udp {
        // Room for a burst from every client while the task is between two reads: the default
        // (net.core.rmem_default, 208 KiB) holds about 1,500 queries, this five times as many,
        // over the whole in-flight bound. SO_RCVBUFFORCE passes
        // net.core.rmem_max with CAP_NET_ADMIN, which the forwarder has; else what it allows.
        if setsockopt(&socket, sockopt::RcvBufForce, &UDP_RECV_BUFFER).is_err() {
            let _ = socket.set_recv_buffer_size(UDP_RECV_BUFFER);
        }
    }
    socket.bind(&listen.into()).map_err(|source| Error::Bind {
        listen,
        transport,
        option,
        source,
    })?;
    if transport == Transport::Tcp {
        socket.listen(LISTEN_BACKLOG).map_err(setup(listen, transport, "listening"))?;
    }
    socket.set_nonblocking(true).map_err(setup(listen, transport, "setting O_NONBLOCK"))?;
    Ok(socket)
}

#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
mod tests;
