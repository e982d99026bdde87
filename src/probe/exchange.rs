//! One DNS query on the wire and the wait for its reply, over UDP or TCP: the transport of the
//! agent's probes and of the `dnsload` test client, which must travel the way a resolver's
//! queries do.
//!
//! * **UDP**: a fresh socket `connect()`ed to the server, as glibc's resolver uses. A connected
//!   socket receives the kernel's ICMP port-unreachable as `ECONNREFUSED`, so a dead listener
//!   fails the exchange within about a millisecond instead of costing the whole timeout (why
//!   this owns its socket: hickory's UDP client hides that error), and datagrams from any other
//!   address never reach it.
//! * **TCP**: a new connection, bounded by the same deadline, with the 2-byte length framing of
//!   RFC 1035 §4.2.2.
//!
//! Which received message is the reply is the caller's decision (see [`super::match_reply`]):
//! [`exchange`] hands it each one and keeps waiting until one is accepted or the time is up.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Message, Query};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, UdpSocket};
use tokio::time::Instant;

use super::Transport;

/// The largest DNS message either transport can carry; a UDP reply is received whole up to it.
pub(super) const MAX_MESSAGE: usize = u16::MAX as usize;

/// A new query message for `question`: a random id (hickory draws it from `rand`'s thread
/// RNG) and RD set, as a stub resolver sends it.
pub fn new_query(question: Query) -> Message {
    let mut message = Message::query();
    message.metadata.recursion_desired = true;
    message.add_query(question);
    message
}

/// How an [`exchange`] ended.
#[derive(Debug)]
pub struct Exchanged<T> {
    /// What the caller's check accepted, or why nothing was.
    pub result: Result<T, ExchangeError>,
    /// From sending the query (UDP) or starting to connect (TCP) to the end; about the timeout
    /// when it ran out.
    pub latency: Duration,
}

/// Why an [`exchange`] ended without a reply.
#[derive(Debug)]
pub enum ExchangeError {
    /// Nothing accepted within the timeout.
    Timeout,
    /// A socket operation failed. Nobody listening shows as `ConnectionRefused` (UDP: ICMP port
    /// unreachable) or `ConnectionReset`; a TCP connection closed before a reply as
    /// `UnexpectedEof`.
    Io {
        /// What was being done, for messages: "connecting", "receiving the reply", …
        doing: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// Sends the encoded query `wire` to `server` over `transport` and hands every message that
/// comes back to `reply`, until it returns `Some` (the result) or `timeout` passes. The timeout
/// bounds it all, socket set-up and connect included. `from_loopback`: sent from 127.0.0.1 or
/// ::1 instead of the address the route picks.
pub async fn exchange<T>(
    server: SocketAddr,
    transport: Transport,
    wire: &[u8],
    timeout: Duration,
    from_loopback: bool,
    mut reply: impl FnMut(&[u8]) -> Option<T>,
) -> Exchanged<T> {
    let unspecified = |ip: IpAddr| match (ip, from_loopback) {
        (IpAddr::V4(_), false) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        (IpAddr::V6(_), false) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        (IpAddr::V4(_), true) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        (IpAddr::V6(_), true) => IpAddr::V6(Ipv6Addr::LOCALHOST),
    };
    let local = SocketAddr::new(unspecified(server.ip()), 0);
    let begin = Instant::now();
    let mut started = None;
    let unbounded = async {
        match transport {
            Transport::Udp => udp(local, server, wire, &mut started, &mut reply).await,
            Transport::Tcp => tcp(local, server, wire, &mut started, &mut reply).await,
        }
    };
    let result =
        tokio::time::timeout(timeout, unbounded).await.unwrap_or(Err(ExchangeError::Timeout));
    Exchanged { result, latency: started.unwrap_or(begin).elapsed() }
}

/// Turns the error of a socket operation into [`ExchangeError::Io`], saying what was `doing`.
fn failed(doing: &'static str) -> impl FnOnce(io::Error) -> ExchangeError {
    move |source| ExchangeError::Io { doing, source }
}

/// One query over a fresh connected UDP socket; `started` is set when it is sent.
async fn udp<T>(
    local: SocketAddr,
    server: SocketAddr,
    wire: &[u8],
    started: &mut Option<Instant>,
    reply: &mut impl FnMut(&[u8]) -> Option<T>,
) -> Result<T, ExchangeError> {
    let socket = UdpSocket::bind(local).await.map_err(failed("binding a UDP socket"))?;
    socket.connect(server).await.map_err(failed("connecting a UDP socket"))?;
    *started = Some(Instant::now());
    socket.send(wire).await.map_err(failed("sending the query"))?;
    // Room for the largest datagram, left uninitialised: the load client keeps thousands of
    // exchanges in flight when a server hangs, and only the bytes received are touched.
    let mut buf = Vec::with_capacity(MAX_MESSAGE);
    loop {
        buf.clear();
        socket.recv_buf(&mut buf).await.map_err(failed("receiving the reply"))?;
        if let Some(result) = reply(&buf) {
            return Ok(result);
        }
    }
}

/// One query over a new TCP connection; reads framed messages until one is accepted. `started`
/// is set when the connect begins.
async fn tcp<T>(
    local: SocketAddr,
    server: SocketAddr,
    wire: &[u8],
    started: &mut Option<Instant>,
    reply: &mut impl FnMut(&[u8]) -> Option<T>,
) -> Result<T, ExchangeError> {
    *started = Some(Instant::now());
    let socket = match local {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }
    .map_err(failed("opening a TCP socket"))?;
    // Bound only to a source of its own: bind-before-connect picks the port without regard to
    // the destination, which uses up ephemeral ports faster under load.
    if !local.ip().is_unspecified() {
        socket.bind(local).map_err(failed("binding a TCP socket"))?;
    }
    let mut stream = socket.connect(server).await.map_err(failed("connecting"))?;
    // Latency matters more than batching; a failure here only costs a little speed.
    let _ = stream.set_nodelay(true);
    let len = u16::try_from(wire.len()).map_err(|_| {
        let message = format!("a query of {} bytes does not fit TCP framing", wire.len());
        failed("framing the query")(io::Error::new(io::ErrorKind::InvalidInput, message))
    })?;
    let mut framed = Vec::with_capacity(wire.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(wire);
    stream.write_all(&framed).await.map_err(failed("sending the query"))?;
    let mut buf = Vec::new();
    loop {
        let len = stream.read_u16().await.map_err(failed("reading the reply length"))?;
        buf.resize(usize::from(len), 0);
        stream.read_exact(&mut buf).await.map_err(failed("reading the reply"))?;
        if let Some(result) = reply(&buf) {
            return Ok(result);
        }
    }
}
