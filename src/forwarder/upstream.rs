//! UDP to the upstream: a few long-lived sockets connected to it, shared by every client's
//! queries, each with its table of the queries in flight ([`Pending`]).
//!
//! A socket per query (the forwarder's first shape) costs a socket, a connect (a route lookup)
//! and, on the node, a conntrack entry and kube-proxy's DNAT for every query, and a task to wait
//! for its answer: it carried about 40,000 queries/s on two cores, a third of what the same
//! client got straight from CoreDNS, and left some 28,000 conntrack entries behind each
//! benchmark run. A connected socket looks its route up once, and all its
//! queries share one conntrack entry, NATed once; the kernel hands it datagrams from the
//! upstream's address and port only. Queries leave under ids of the table's choosing
//! (`ids.rs` says what an answer must show to be taken for one).
//!
//! The listening socket's task sends each batch of queries on the next socket of the pool, in
//! turn, in one `sendmmsg`; one task per socket reads its answers, a batch per `recvmmsg`, sends
//! the batch back to its clients through the listening socket in one `sendmmsg`, and every
//! [`SWEEP_PERIOD`] takes out the queries past [`Options::upstream_timeout`] (so a query expires
//! up to that much later than its timeout). No task per query, no timer per
//! query.
//!
//! Each socket is replaced by a new one every [`Options::upstream_redial`] (5 s; the pool's
//! sockets a quarter of that apart), connected afresh from a new source port. A socket connected once would keep one conntrack entry, and with it kube-proxy's DNAT
//! to one CoreDNS endpoint, for the agent's life: a dead endpoint would cost a quarter of the
//! queries until it was withdrawn, and new replicas would get none. The old socket is still read
//! until its queries have had their timeout, so no answer in flight is lost, and closed as soon
//! as nothing is pending (an idle forwarder holds the pool's sockets only); a re-dial waits for
//! the drain before it.
//!
//! `IP_RECVERR` / `IPV6_RECVERR`: an ICMP error (the upstream's port unreachable, or kube-proxy
//! rejecting a Service with no endpoints) quotes the query it is about, and with the option the
//! kernel queues the quote for the socket to read: the query it names fails at once, as it did
//! when each query had its socket, instead of waiting for its timeout. The kernel also reports
//! such an error once on the socket's next call, whichever query that is for; a send it fails
//! is tried once more (the datagram was not sent), and a receive goes on to the next datagrams.
//!
//! [`Options::upstream_timeout`]: super::Options::upstream_timeout
//! [`Options::upstream_redial`]: super::Options::upstream_redial

use std::convert::Infallible;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    recvmmsg, recvmsg, sendmmsg, setsockopt, sockopt, ControlMessage, MsgFlags, MultiHeaders,
};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tokio::time::{Instant as TokioInstant, MissedTickBehavior};

use super::ids::{Answered, Pending, HEADER_LEN};
use super::udp::{send_answers, Buffers, Reply, BATCH};
use super::{count, Addr, Counters, Options, Shares};

/// How many sockets the pool has, each with a task to read its answers and a conntrack entry on
/// the node. Of 1, 2 and 4, four served the benchmark's dnsperf best, on two cores, with the
/// least of the agent's CPU per query (the commit that set it has the figures).
pub(super) const SOCKETS: usize = 4;

/// How often each socket's table is swept for queries past their timeout.
pub(super) const SWEEP_PERIOD: Duration = Duration::from_millis(100);

/// How many batches of answers a task reads before it lets the others run.
const ROUNDS: usize = 4;

/// How long connecting waits after a failure at first, and at most (it doubles each time).
const CONNECT_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// What a query's answer needs to reach its client.
#[derive(Debug)]
pub(super) struct Origin {
    /// Who asked.
    pub(super) client: SocketAddr,
    /// The id the client gave the query: the answer goes back with it.
    pub(super) id: u16,
    /// The address the client sent the query to (the link-local IP): the answer's source.
    pub(super) destination: IpAddr,
}

/// A query of a batch, to go to the upstream.
#[derive(Clone, Copy, Debug)]
pub(super) struct Outgoing {
    /// Its slot in the batch's buffers.
    pub(super) slot: usize,
    /// Its length.
    pub(super) len: usize,
    /// The id it goes out with (in its first two bytes already).
    pub(super) id: u16,
}

/// The sockets to the upstream.
pub(super) struct Pool {
    upstream: Addr,
    sockets: Vec<Arc<Upstream>>,
    /// The socket the next query goes on.
    next: usize,
    /// The queries in flight on all of them.
    in_flight: Arc<AtomicUsize>,
    /// What each client has in flight on all of them.
    shares: Arc<Shares>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let in_flight = self.in_flight();
        let sockets = self.sockets.len();
        let upstream = self.upstream.now();
        f.debug_struct("Pool")
            .field("upstream", &upstream)
            .field("sockets", &sockets)
            .field("in_flight", &in_flight)
            .finish()
    }
}

impl Pool {
    /// [`SOCKETS`] sockets for `upstream`, bound to a port each and not yet connected, their
    /// queries counted against their clients' `shares`. Must be called inside a tokio runtime.
    pub(super) fn open(upstream: Addr, shares: Arc<Shares>) -> io::Result<Pool> {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let sockets = (0..SOCKETS)
            .map(|index| {
                Ok(Arc::new(Upstream {
                    socket: Mutex::new(Arc::new(open_socket(upstream.now())?)),
                    upstream: upstream.clone(),
                    index,
                    pending: Mutex::new(Pending::new()),
                    in_flight: in_flight.clone(),
                    shares: shares.clone(),
                    armed: Notify::new(),
                }))
            })
            .collect::<io::Result<_>>()?;
        Ok(Pool { upstream, sockets, next: 0, in_flight, shares })
    }

    /// Connects every socket to the upstream, retrying until it can: without a route to the
    /// upstream the node cannot reach it at all, and the route may come later.
    pub(super) async fn connect(&self) {
        let mut wait = CONNECT_RETRY.0;
        for upstream in &self.sockets {
            while let Err(error) = upstream.socket().connect(self.upstream.now()).await {
                tracing::warn!(
                    upstream = %self.upstream.now(), %error, retry_in = ?wait,
                    "the forwarder cannot connect to the upstream; no UDP query is taken until it can"
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(CONNECT_RETRY.1);
            }
        }
    }

    /// The sockets.
    pub(super) fn sockets(&self) -> &[Arc<Upstream>] {
        &self.sockets
    }

    /// The socket the next query goes on: each in turn.
    pub(super) fn next(&mut self) -> &Upstream {
        self.next = (self.next + 1) % self.sockets.len();
        &self.sockets[self.next]
    }

    /// What each client has in flight: a query takes one of its client's before it is
    /// [`Upstream::insert`]ed, and the socket gives it back when the query ends.
    pub(super) fn shares(&self) -> Arc<Shares> {
        self.shares.clone()
    }

    /// How many queries wait for the upstream's answer on all the sockets.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// One socket of the pool.
pub(super) struct Upstream {
    /// Connected to the upstream (by [`Pool::connect`]); replaced by a new one every
    /// [`Options::upstream_redial`](super::Options::upstream_redial).
    socket: Mutex<Arc<UdpSocket>>,
    /// The upstream, read at each dial.
    upstream: Addr,
    /// Its place in the pool: when it is re-dialled.
    index: usize,
    /// Its queries in flight.
    pending: Mutex<Pending<Origin>>,
    /// The pool's count of queries in flight.
    in_flight: Arc<AtomicUsize>,
    /// The pool's shares: each query ended here gives its client's back.
    shares: Arc<Shares>,
    /// Told when the table stops being empty: the answering task then sweeps again.
    armed: Notify,
}

impl Upstream {
    /// How many queries wait for the upstream's answer on all the pool's sockets.
    pub(super) fn pool_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Takes `query` pending until `deadline`; returns the id it is to go out with, or None
    /// when the table has no room. The query's client has taken a share for it (see
    /// [`Pool::shares`]); the socket gives it back when the query ends (but not on None).
    pub(super) fn insert(&self, query: &[u8], origin: Origin, deadline: Instant) -> Option<u16> {
        let mut pending = self.pending();
        let was_empty = pending.is_empty();
        let id = pending.insert(query, origin, deadline)?;
        drop(pending);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        if was_empty {
            // Kept as a permit if the task is not waiting yet: no wake-up is lost.
            self.armed.notify_one();
        }
        Some(id)
    }

    /// Sends `queries` (their bytes in `buffers`) to the upstream, as many as the kernel takes
    /// per call, waiting while the socket's buffer is full. A query the kernel refuses is tried
    /// once more (the error may be an earlier query's ICMP error, which the kernel reports on
    /// this call and so sends nothing), then taken out and counted.
    pub(super) async fn send(&self, buffers: &Buffers, queries: &[Outgoing], counters: &Counters) {
        let socket = self.socket();
        let fd = socket.as_raw_fd();
        let (mut next, mut tried) = (0, false);
        while let Some(rest) = queries.get(next..).filter(|rest| !rest.is_empty()) {
            let sent = socket.async_io(Interest::WRITABLE, || send_batch(fd, buffers, rest)).await;
            match sent {
                Ok(sent) => (next, tried) = (next + sent, false),
                Err(_) if !tried => tried = true,
                Err(error) => {
                    if self.cancel(rest[0].id) {
                        count(&counters.upstream_failures);
                    }
                    tracing::debug!(%error, "sending a query to the upstream failed");
                    (next, tried) = (next + 1, false);
                }
            }
        }
    }

    /// Takes the query pending under `id` out (it could not be sent); whether it was there
    /// (not expired meanwhile).
    pub(super) fn cancel(&self, id: u16) -> bool {
        let Some(origin) = self.pending().cancel(id) else { return false };
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.shares.lock().give_back(origin.client.ip());
        true
    }

    /// The socket queries go out on now.
    fn socket(&self) -> Arc<UdpSocket> {
        self.socket.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Reads this socket's answers forever, each sent back to its client through `listener`,
    /// and every [`SWEEP_PERIOD`] while any query is pending expires those past their deadline.
    ///
    /// Every `options.upstream_redial` (the sockets a quarter of it apart) a socket that carried
    /// a query is replaced by one connected afresh: a new source port, so a new conntrack entry
    /// and kube-proxy's choice of a CoreDNS endpoint made again. The old socket's answers are
    /// still read until its queries have had `options.upstream_timeout` (and a sweep), or until
    /// nothing is pending; a re-dial waits for that drain to end, unless the upstream moved.
    pub(super) async fn answer(
        self: Arc<Self>,
        listener: Arc<UdpSocket>,
        counters: Arc<Counters>,
        options: Options,
    ) -> Infallible {
        // Buffers for the life of the task: each slot holds any datagram whole.
        let mut buffers = Buffers::new();
        let mut sweep = tokio::time::interval(SWEEP_PERIOD);
        sweep.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let every = options.upstream_redial;
        let first = every.mul_f64((self.index + 1) as f64 / SOCKETS as f64);
        let turns = TokioInstant::now() + first;
        let mut redial = tokio::time::interval_at(turns, every);
        redial.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut socket = self.socket();
        let mut draining: Option<(Arc<UdpSocket>, Instant)> = None;
        let (mut upstream, mut moved) = (self.upstream.clone(), false);
        // Whether the socket has carried a query since it was dialled. One that has not has no
        // conntrack entry, and so no endpoint a new one would choose again: it waits for its
        // first query before its next turn, and an idle forwarder has no timer to wake it.
        let mut used = false;
        loop {
            let idle = self.pending().is_empty();
            if !idle && !used {
                used = true;
                // Its turn; a moved upstream's re-dial stays due at once.
                if !moved {
                    redial.reset_at(next_turn(turns, every, TokioInstant::now()));
                }
            }
            // The old socket goes once its queries have had their time, or sooner when nothing
            // can still come back on it: no query pending (each is taken before it is sent) and
            // no sender holding it.
            if draining.as_ref().is_some_and(|(old, until)| {
                Instant::now() >= *until || (idle && Arc::strong_count(old) == 1)
            }) {
                draining = None;
            }
            let drained =
                draining.as_ref().map(|(_, until)| tokio::time::Instant::from_std(*until));
            let (from, ready) = tokio::select! {
                ready = socket.ready(Interest::READABLE | Interest::ERROR) => (&socket, ready),
                ready = ready_or_never(draining.as_ref().map(|(old, _)| &**old)) => {
                    (&draining.as_ref().expect("only a draining socket is ready").0, ready)
                }
                // The upstream moved (its Service re-created): dial the new address now, not at
                // this socket's turn, even while an old socket drains (its address is gone).
                () = upstream.changed() => {
                    moved = true;
                    redial.reset_immediately();
                    continue;
                }
                _ = redial.tick(), if used || moved => {
                    let moved = std::mem::take(&mut moved);
                    if !moved && draining.as_ref().is_some_and(|(_, until)| Instant::now() < *until) {
                        continue;
                    }
                    if let Some(new) = self.redial().await {
                        used = false;
                        let old = std::mem::replace(&mut socket, new);
                        let until = Instant::now() + options.upstream_timeout + SWEEP_PERIOD;
                        // Drained whether or not anything was pending when the loop last
                        // looked: a query may have gone out on it since (or be going out, its
                        // sender holding the old socket), and its answer must still be read.
                        draining = Some((old, until));
                        counters.upstream_redials.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                _ = sweep.tick(), if !idle => {
                    self.expire(&counters);
                    continue;
                }
                () = sleep_or_never(drained) => continue,
                () = self.armed.notified(), if idle => {
                    // The first sweep a period from now, not at once.
                    sweep.reset();
                    continue;
                }
            };
            let from = from.clone();
            match ready {
                Ok(ready) => {
                    if ready.is_error() {
                        self.take_errors(&from, buffers.slot_mut(0), &counters);
                    }
                    if ready.is_readable() {
                        self.take_answers(&from, &mut buffers, &listener, &counters).await;
                    }
                }
                // Only when the runtime is going away; the next tick will tell.
                Err(error) => {
                    tracing::debug!(%error, "waiting for the upstream's answers failed");
                    sweep.tick().await;
                }
            }
        }
    }

    /// A new socket connected to the upstream, put in the old one's place for the queries to
    /// come; None (and the old one kept) when that fails.
    async fn redial(&self) -> Option<Arc<UdpSocket>> {
        let upstream = self.upstream.now();
        let socket = match open_socket(upstream) {
            Ok(socket) => socket,
            Err(error) => {
                tracing::debug!(%error, "opening a socket to the upstream failed");
                return None;
            }
        };
        if let Err(error) = socket.connect(upstream).await {
            tracing::debug!(%upstream, %error, "re-dialling the upstream failed");
            return None;
        }
        let socket = Arc::new(socket);
        *self.socket.lock().unwrap_or_else(PoisonError::into_inner) = socket.clone();
        Some(socket)
    }

    /// Reads and delivers `socket`'s answers, a batch per call, until none is left or
    /// [`ROUNDS`] batches.
    async fn take_answers(
        &self,
        socket: &UdpSocket,
        buffers: &mut Buffers,
        listener: &UdpSocket,
        counters: &Counters,
    ) {
        let fd = socket.as_raw_fd();
        let mut lengths = Vec::with_capacity(BATCH);
        let mut replies = Vec::with_capacity(BATCH);
        for _ in 0..ROUNDS {
            match socket.try_io(Interest::READABLE, || receive_batch(fd, buffers, &mut lengths)) {
                Ok(()) => {
                    replies.clear();
                    for (slot, &len) in lengths.iter().enumerate() {
                        let answer = &mut buffers.slot_mut(slot)[..len];
                        replies.extend(
                            self.reply(answer, counters).map(|(client, source)| Reply {
                                slot,
                                len,
                                client,
                                source,
                            }),
                        );
                    }
                    if !replies.is_empty() {
                        let mut shares = self.shares.lock();
                        replies.iter().for_each(|reply| shares.give_back(reply.client.ip()));
                    }
                    send_replies(listener, buffers, &replies, counters).await;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                // An ICMP error, reported once; its query is in the error queue.
                Err(error) => tracing::debug!(%error, "the upstream's socket reported an error"),
            }
        }
    }

    /// Makes `answer` its query's client's again (the client's id) and says who that is and
    /// which address it asked; an answer to no pending query is counted and dropped. The
    /// caller gives the client's share back.
    fn reply(&self, answer: &mut [u8], counters: &Counters) -> Option<(SocketAddr, IpAddr)> {
        let taken = if answer.len() < HEADER_LEN { Answered::Unknown } else { self.take(answer) };
        let Answered::Query(origin) = taken else {
            count(&counters.stray_answers);
            tracing::debug!(answer = ?taken, "dropped a datagram that answers no pending query");
            return None;
        };
        answer[..2].copy_from_slice(&origin.id.to_be_bytes());
        Some((origin.client, origin.destination))
    }

    /// Fails the queries the kernel's error queue names (their ICMP errors quote them).
    fn take_errors(&self, socket: &UdpSocket, buffer: &mut [u8], counters: &Counters) {
        let fd = socket.as_raw_fd();
        loop {
            match socket.try_io(Interest::ERROR, || receive_error(fd, buffer)) {
                Ok(len) => {
                    // The quote may be cut short: then the query is not named, and expires.
                    if let Answered::Query(origin) = self.take(&buffer[..len]) {
                        self.shares.lock().give_back(origin.client.ip());
                        count(&counters.upstream_failures);
                        tracing::debug!(client = %origin.client, "the upstream refused a query");
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) => {
                    tracing::debug!(%error, "reading the upstream's socket's errors failed");
                    return;
                }
            }
        }
    }

    /// The query `message` answers (or quotes), taken out of the table (its client's share is
    /// the caller's to give back).
    fn take(&self, message: &[u8]) -> Answered<Origin> {
        let taken = self.pending().answer(message);
        if let Answered::Query(_) = taken {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        taken
    }

    /// Takes the queries past their deadline out, counted as the upstream's failures.
    fn expire(&self, counters: &Counters) {
        let mut clients = Vec::new();
        let expired = self.pending().expire(Instant::now(), |o| clients.push(o.client.ip()));
        if expired > 0 {
            let mut shares = self.shares.lock();
            clients.into_iter().for_each(|client| shares.give_back(client));
            drop(shares);
            self.in_flight.fetch_sub(expired, Ordering::Relaxed);
            counters.upstream_failures.fetch_add(expired as u64, Ordering::Relaxed);
            tracing::debug!(expired, "queries the upstream left unanswered");
        }
    }

    /// The table. Nothing panics while holding it, so a poisoned lock is still consistent.
    fn pending(&self) -> MutexGuard<'_, Pending<Origin>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A socket for `upstream`, bound to a port of its own and not yet connected. Must be called
/// inside a tokio runtime.
fn open_socket(upstream: SocketAddr) -> io::Result<UdpSocket> {
    let unspecified = match upstream {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = std::net::UdpSocket::bind((unspecified, 0))?;
    match upstream {
        SocketAddr::V4(_) => setsockopt(&socket, sockopt::Ipv4RecvErr, &true),
        SocketAddr::V6(_) => setsockopt(&socket, sockopt::Ipv6RecvErr, &true),
    }?;
    socket.set_nonblocking(true)?;
    UdpSocket::from_std(socket)
}

/// Until `deadline`, or forever when there is none.
async fn sleep_or_never(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// `socket`'s readiness, or, without a socket, a wait that never ends.
async fn ready_or_never(socket: Option<&UdpSocket>) -> io::Result<tokio::io::Ready> {
    match socket {
        Some(socket) => socket.ready(Interest::READABLE | Interest::ERROR).await,
        None => std::future::pending().await,
    }
}

/// Sends `replies` back through `listener`, a `sendmmsg` per run of replies from one address
/// (in practice one run: a forwarder's clients ask the link-local IP of its family), waiting
/// while the socket's buffer is full. A reply the kernel refuses is counted and left out.
async fn send_replies(
    listener: &UdpSocket,
    buffers: &Buffers,
    replies: &[Reply],
    counters: &Counters,
) {
    let fd = listener.as_raw_fd();
    let mut next = 0;
    while let Some(rest) = replies.get(next..).filter(|rest| !rest.is_empty()) {
        let run = rest.iter().take_while(|r| r.source == rest[0].source).count();
        let rest = &rest[..run];
        match listener.async_io(Interest::WRITABLE, || send_answers(fd, buffers, rest)).await {
            Ok(sent) => {
                counters.udp_answers.fetch_add(sent as u64, Ordering::Relaxed);
                next += sent;
            }
            Err(error) => {
                count(&counters.answer_failures);
                let (client, source) = (rest[0].client, rest[0].source);
                tracing::debug!(%client, from = %source, %error, "sending an answer failed");
                next += 1;
            }
        }
    }
}

/// Sends `queries` (their bytes in `buffers`) on `fd`, connected to the upstream, in one
/// system call; returns how many the kernel took (the first, at least).
pub(super) fn send_batch(fd: RawFd, buffers: &Buffers, queries: &[Outgoing]) -> io::Result<usize> {
    let queries = &queries[..queries.len().min(BATCH)];
    let slices: Vec<[IoSlice<'_>; 1]> =
        queries.iter().map(|q| [IoSlice::new(&buffers.slot(q.slot)[..q.len])]).collect();
    // Connected: no address (`()`), and no control message.
    let addresses = vec![None::<()>; slices.len()];
    let mut headers = MultiHeaders::<()>::preallocate(slices.len(), None);
    let none: [ControlMessage<'_>; 0] = [];
    let sent = sendmmsg(fd, &mut headers, &slices, &addresses, none, MsgFlags::empty())?;
    Ok(sent.count())
}

/// Receives the datagrams waiting on `fd`, up to [`BATCH`], each into its slot of `buffers`,
/// their lengths into `lengths`; a datagram cut short is left out (none is: a slot holds the
/// largest). WouldBlock when none waits.
pub(super) fn receive_batch(
    fd: RawFd,
    buffers: &mut Buffers,
    lengths: &mut Vec<usize>,
) -> io::Result<()> {
    let mut headers = MultiHeaders::<()>::preallocate(BATCH, None);
    let mut slots = buffers.receiving();
    let messages = recvmmsg(fd, &mut headers, slots.iter_mut(), MsgFlags::MSG_DONTWAIT, None)?;
    lengths.clear();
    lengths
        .extend(messages.map(|m| if m.flags.contains(MsgFlags::MSG_TRUNC) { 0 } else { m.bytes }));
    Ok(())
}

/// Reads one entry of `fd`'s error queue into `buffer`: the payload of the datagram the error is
/// about, as far as the error quoted it.
fn receive_error(fd: RawFd, buffer: &mut [u8]) -> io::Result<usize> {
    let mut iov = [IoSliceMut::new(buffer)];
    let message = recvmsg::<()>(fd, &mut iov, None, MsgFlags::MSG_ERRQUEUE)?;
    Ok(message.bytes)
}

/// The first of the turns `first`, `first` + `every`, … after `now` (`first` if it is ahead).
fn next_turn(first: TokioInstant, every: Duration, now: TokioInstant) -> TokioInstant {
    let turns = match now.checked_duration_since(first) {
        Some(since) => since.as_nanos() / every.as_nanos().max(1) + 1,
        None => 0,
    };
    first + every.saturating_mul(u32::try_from(turns).unwrap_or(u32::MAX))
}
