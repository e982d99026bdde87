//! One real DNS probe against one server, classified into an [`Outcome`].
//!
//! A probe sends a single query (type A, RD set, a fresh random id) for a configured name and
//! waits, bounded by the probe timeout, for a reply that really answers it. The query travels
//! as a resolver's does ([`exchange`]): over UDP on a fresh connected socket, so a dead listener
//! is [`Outcome::Refused`] within about a millisecond (the kernel's ICMP port unreachable), or
//! over TCP with RFC 1035 framing, where a refused or reset connection is [`Outcome::Refused`].
//!
//! Only a reply that is a response to *this* query counts: the id, the opcode and the question
//! must match. Anything else, including malformed datagrams, is ignored and the probe keeps
//! waiting until its deadline, so a stray or spoofed datagram can never pass a probe, nor fail
//! one that a real reply would pass. A probe that got only such messages by its deadline is an
//! [`Outcome::Error`] naming what was wrong with them (a server answering garbage is not a
//! hung one). The decision itself is the pure function [`check_reply`].
//!
//! The `dnsload` test client (`crates/dnsload`) sends its lookups through the same
//! [`exchange`] and accepts replies by the same [`match_reply`].

mod calm;
mod exchange;
mod stream;

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use hickory_proto::op::{Header, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, Record, RecordType};
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder};
use hickory_proto::ProtoError;
use serde::Serialize;

pub use calm::CacheProbes;
pub use exchange::{exchange, new_query, ExchangeError, Exchanged};
pub(crate) use stream::probe_stream;
pub use stream::{Prober, Report};

/// Errors building a [`Probe`].
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The configured query name is not a valid DNS name.
    #[error(
        "invalid probe query name {name:?}: use a DNS name such as \
         kubernetes.default.svc.cluster.local"
    )]
    InvalidName {
        /// The name as configured.
        name: String,
        /// Why hickory rejected it.
        #[source]
        source: ProtoError,
    },
    /// The query for the configured name could not be encoded (for example: too long).
    #[error("cannot encode a DNS query for probe name {name:?}")]
    Encode {
        /// The name as configured.
        name: String,
        /// Why encoding failed.
        #[source]
        source: ProtoError,
    },
    /// A zero timeout would fail every probe before it is sent.
    #[error("the probe timeout must be greater than zero")]
    ZeroTimeout,
}

/// The transport a probe uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// DNS over UDP on a connected socket.
    Udp,
    /// DNS over TCP with 2-byte length framing.
    Tcp,
}

impl Transport {
    /// The lower-case name, for metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A response code as the `probe` command prints it and an [`Outcome`] is serialised: its
/// mnemonic as `dig` prints it (`NOERROR`, `SERVFAIL`, `NXDOMAIN`, …), or `RCODE<n>` for a code
/// without one.
///
/// hickory's variant names are the IANA mnemonics in mixed case (`ServFail`, `NXDomain`), so the
/// name is its `Debug` in capitals; its `Display` is prose ("Server Failure"). Code 16 decodes as
/// TSIG's `BADSIG`, but a probe sends no TSIG: for it, 16 is EDNS's `BADVERS`.
pub fn rcode_name(code: ResponseCode) -> String {
    match code {
        ResponseCode::Unknown(other) => format!("RCODE{other}"),
        ResponseCode::BADSIG => "BADVERS".to_owned(),
        named => format!("{named:?}").to_ascii_uppercase(),
    }
}

/// Whether `code` means the server resolved the query: NOERROR, or NXDOMAIN (a valid,
/// authoritative "no").
fn resolved(code: ResponseCode) -> bool {
    matches!(code, ResponseCode::NoError | ResponseCode::NXDomain)
}

fn serialize_rcode<S: serde::Serializer>(
    code: &ResponseCode,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&rcode_name(*code))
}

/// What one probe found out about a server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub enum Outcome {
    /// A matching reply with NOERROR or NXDOMAIN (truncated or not): the server works.
    Answered {
        /// The reply's response code.
        #[serde(serialize_with = "serialize_rcode")]
        rcode: ResponseCode,
    },
    /// A matching reply with any other response code (SERVFAIL, REFUSED, …): the server is up
    /// but cannot resolve.
    #[serde(rename = "servfail")]
    ServerFailure {
        /// The reply's response code.
        #[serde(serialize_with = "serialize_rcode")]
        rcode: ResponseCode,
    },
    /// No matching reply before the timeout.
    Timeout,
    /// Nobody listens: ICMP port unreachable (UDP) or a refused or reset connection (TCP).
    Refused,
    /// Anything else that prevented a verdict: a local I/O error, an unroutable address, a TCP
    /// connection closed before a reply, or only messages that were not the reply (another id,
    /// another question, garbage) until the timeout.
    Error {
        /// What went wrong, for logs.
        reason: String,
    },
    /// Not a probe's own outcome: the stall watch (`crate::stall`) saw queries wait unread in
    /// the cache's socket past its bound while a probe got no answer.
    Stalled {
        /// Bytes of queries waiting in the socket at the last look.
        queued_bytes: u32,
        /// How long the queue had not gone down.
        for_ms: u64,
    },
}

impl Outcome {
    /// Whether the server answered (the only outcome that counts as healthy).
    pub fn is_good(&self) -> bool {
        matches!(self, Outcome::Answered { .. })
    }

    /// A short, fixed name for metric labels and logs: `answered`, `servfail`, `timeout`,
    /// `refused`, `error` or `stalled`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Answered { .. } => "answered",
            Outcome::ServerFailure { .. } => "servfail",
            Outcome::Timeout => "timeout",
            Outcome::Refused => "refused",
            Outcome::Error { .. } => "error",
            Outcome::Stalled { .. } => "stalled",
        }
    }
}

/// The outcome of one probe and how long it took to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeResult {
    /// What happened.
    pub outcome: Outcome,
    /// From sending the query (UDP) or starting to connect (TCP) to the outcome; about the
    /// timeout for [`Outcome::Timeout`].
    pub latency: Duration,
}

/// A reusable probe: the query name and the timeout. Each [`Probe::run`] is independent (fresh
/// socket, fresh id), so one `Probe` can be shared by concurrent probes.
#[derive(Clone, Debug)]
pub struct Probe {
    name: Name,
    timeout: Duration,
    from_loopback: bool,
}

impl Probe {
    /// A probe that asks for `name` (made fully qualified: `cluster.local` means
    /// `cluster.local.`) and gives up after `timeout`.
    pub fn new(name: &str, timeout: Duration) -> Result<Self, ProbeError> {
        if timeout.is_zero() {
            return Err(ProbeError::ZeroTimeout);
        }
        let mut parsed = Name::from_ascii(name)
            .map_err(|source| ProbeError::InvalidName { name: name.to_owned(), source })?;
        parsed.set_fqdn(true);
        let probe = Probe { name: parsed, timeout, from_loopback: false };
        // Encode once so that a name hickory accepts but cannot put on the wire fails here,
        // at configuration time, instead of in every probe.
        probe
            .query()
            .to_vec()
            .map_err(|source| ProbeError::Encode { name: name.to_owned(), source })?;
        Ok(probe)
    }

    /// This probe, sending from the loopback address (127.0.0.1 or ::1) rather than the one the
    /// route picks: the link-local fallback chain lets such queries through to the cache itself
    /// ([`crate::ruleset::Guard::FromLoopback`]), so a probe of the cache never measures the
    /// agent's own forwarder instead.
    pub fn from_loopback(self) -> Probe {
        Probe { from_loopback: true, ..self }
    }

    /// The name this probe asks for (fully qualified).
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// The bound on one probe, connect and reply included.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends one query to `server` over `transport` and classifies what comes back. Never takes
    /// (much) longer than the timeout; never fails: every problem is an [`Outcome`].
    pub async fn run(&self, server: SocketAddr, transport: Transport) -> ProbeResult {
        let query = self.query();
        let failed =
            |reason| ProbeResult { outcome: Outcome::Error { reason }, latency: Duration::ZERO };
        let wire = match query.to_vec() {
            Ok(wire) => wire,
            Err(err) => return failed(format!("encoding the query: {err}")),
        };
        let Some(question) = query.queries.first() else {
            return failed("the query has no question".to_owned());
        };
        let id = query.metadata.id;
        let mut ignored = Ignored::default();
        let check = |reply: &[u8]| ignored.check(id, question, reply);
        let exchanged =
            exchange(server, transport, &wire, self.timeout, self.from_loopback, check).await;
        let outcome = match exchanged.result {
            Ok(outcome) => outcome,
            Err(ExchangeError::Io { doing, source }) => io_error(doing, server, &source),
            Err(ExchangeError::Timeout) => match ignored.last {
                None => Outcome::Timeout,
                Some(last) => Outcome::Error {
                    reason: format!(
                        "no reply to the query within {:?} from {server}, only {} {} that did \
                         not answer it (last: {last})",
                        self.timeout,
                        ignored.count,
                        if ignored.count == 1 { "message" } else { "messages" },
                    ),
                },
            },
        };
        ProbeResult { outcome, latency: exchanged.latency }
    }

    /// A new query message: random id, RD set, one question `<name> IN A`.
    fn query(&self) -> Message {
        new_query(Query::query(self.name.clone(), RecordType::A))
    }
}

/// The messages a probe received that were not its reply.
#[derive(Debug, Default)]
struct Ignored {
    count: u32,
    last: Option<Mismatch>,
}

impl Ignored {
    /// Classifies `reply`: the outcome if it is the reply, else `None` (and it is counted).
    fn check(&mut self, id: u16, question: &Query, reply: &[u8]) -> Option<Outcome> {
        match check_reply(id, question, reply) {
            Ok(outcome) => Some(outcome),
            Err(mismatch) => {
                self.count = self.count.saturating_add(1);
                self.last = Some(mismatch);
                None
            }
        }
    }
}

/// Maps an I/O error to an outcome: "nobody listens" errors are [`Outcome::Refused`], a TCP
/// connection closed without a reply and everything else are [`Outcome::Error`].
fn io_error(doing: &str, server: SocketAddr, err: &io::Error) -> Outcome {
    match err.kind() {
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset => Outcome::Refused,
        io::ErrorKind::UnexpectedEof => Outcome::Error {
            reason: format!("{doing} from {server}: connection closed before a reply"),
        },
        _ => Outcome::Error { reason: format!("{doing} ({server}): {err}") },
    }
}

/// Why a received message is not the reply to a probe's query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// Not a DNS message: too short, or cut short without the TC bit, or undecodable.
    Malformed { len: usize },
    /// A query (QR clear), not a response.
    NotAResponse,
    /// A response with another id.
    Id { got: u16, expected: u16 },
    /// A response to another kind of request (`NOTIFY`, `UPDATE`, …).
    OpCode(OpCode),
    /// A response for other questions, or an answer without the question.
    Question { got: String },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Malformed { len } => write!(f, "{len} bytes that are not a DNS message"),
            Mismatch::NotAResponse => f.write_str("a query, not a response"),
            Mismatch::Id { got, expected } => {
                write!(f, "a response with id {got}, the query's is {expected}")
            }
            Mismatch::OpCode(op) => write!(f, "a response of opcode {op:?}"),
            Mismatch::Question { got } => write!(f, "a response for another question: {got}"),
        }
    }
}

/// A message that is the reply to a query (see [`match_reply`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MatchedReply {
    /// Its response code.
    pub rcode: ResponseCode,
    /// Its answer records; none when it was truncated in the middle of a record.
    pub answers: Vec<Record>,
}

/// Matches one received message against the query with `id` and `question`.
///
/// `Err` says why the bytes are not the reply to that query (malformed, not a response, another
/// id or opcode, another question): the caller keeps waiting. A reply is accepted without a
/// question section only when it reports an error (some servers omit the question in FORMERR or
/// NOTIMP replies); an answer must echo the question. A truncated reply (TC) counts like any
/// other: the server is alive and resolved the name, even if the records did not fit.
pub fn match_reply(id: u16, question: &Query, reply: &[u8]) -> Result<MatchedReply, Mismatch> {
    let decoded = decode_reply(reply).ok_or(Mismatch::Malformed { len: reply.len() })?;
    let header = decoded.metadata;
    if header.message_type != MessageType::Response {
        return Err(Mismatch::NotAResponse);
    }
    if header.id != id {
        return Err(Mismatch::Id { got: header.id, expected: id });
    }
    if header.op_code != OpCode::Query {
        return Err(Mismatch::OpCode(header.op_code));
    }
    let rcode = header.response_code;
    match decoded.queries.as_slice() {
        [echoed] if echoed == question => {}
        [] if !resolved(rcode) => {}
        [] => return Err(Mismatch::Question { got: "none".to_owned() }),
        [first, rest @ ..] => {
            // The first only: a 64 KiB TCP message can carry thousands, and this gets logged.
            let got = match rest.len() {
                0 => first.to_string(),
                more => format!("{first} (+{more} more)"),
            };
            return Err(Mismatch::Question { got });
        }
    }
    Ok(MatchedReply { rcode, answers: decoded.answers })
}

/// Classifies one received message as the probe's reply to the query with `id` and `question`
/// ([`match_reply`]): NOERROR and NXDOMAIN are [`Outcome::Answered`], any other code
/// [`Outcome::ServerFailure`].
pub fn check_reply(id: u16, question: &Query, reply: &[u8]) -> Result<Outcome, Mismatch> {
    let rcode = match_reply(id, question, reply)?.rcode;
    Ok(if resolved(rcode) { Outcome::Answered { rcode } } else { Outcome::ServerFailure { rcode } })
}

/// [`check_reply`] without the reason: `None` when the bytes are not the reply.
pub fn classify_reply(id: u16, question: &Query, reply: &[u8]) -> Option<Outcome> {
    check_reply(id, question, reply).ok()
}

/// The parts of a message a reply is judged by.
struct Decoded {
    metadata: hickory_proto::op::Metadata,
    queries: Vec<Query>,
    answers: Vec<Record>,
}

/// Decodes the header, the question section and the answers. A message that does not decode as
/// a whole is accepted only when its TC bit is set (a server may cut a record in half when
/// truncating); then only its header and question must be well-formed, and it has no answers.
fn decode_reply(reply: &[u8]) -> Option<Decoded> {
    if let Ok(message) = Message::from_vec(reply) {
        let Message { metadata, queries, answers, .. } = message;
        return Some(Decoded { metadata, queries, answers });
    }
    let mut decoder = BinDecoder::new(reply);
    let header = Header::read(&mut decoder).ok()?;
    if !header.metadata.truncation {
        return None;
    }
    let mut queries = Vec::new();
    for _ in 0..header.counts.queries {
        queries.push(Query::read(&mut decoder).ok()?);
    }
    Some(Decoded { metadata: header.metadata, queries, answers: Vec::new() })
}

#[cfg(test)]
mod tests;
