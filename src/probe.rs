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

pub use exchange::{exchange, new_query, ExchangeError, Exchanged};
pub(crate) use stream::probe_stream;
pub use stream::Prober;

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
}

impl Outcome {
    /// Whether the server answered (the only outcome that counts as healthy).
    pub fn is_good(&self) -> bool {
        matches!(self, Outcome::Answered { .. })
    }

    /// A short, fixed name for metric labels and logs: `answered`, `servfail`, `timeout`,
    /// `refused` or `error`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Answered { .. } => "answered",
            Outcome::ServerFailure { .. } => "servfail",
            Outcome::Timeout => "timeout",
            Outcome::Refused => "refused",
            Outcome::Error { .. } => "error",
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
        let probe = Probe { name: parsed, timeout };
        // Encode once so that a name hickory accepts but cannot put on the wire fails here,
        // at configuration time, instead of in every probe.
        probe
            .query()
            .to_vec()
            .map_err(|source| ProbeError::Encode { name: name.to_owned(), source })?;
        Ok(probe)
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
        let exchanged = exchange(server, transport, &wire, self.timeout, check).await;
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
mod tests {
    use super::*;

    use hickory_proto::rr::rdata::A;
    use hickory_proto::rr::RData;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, UdpSocket};

    use super::exchange::MAX_MESSAGE;

    fn question() -> Query {
        Query::query(
            Name::from_ascii("kubernetes.default.svc.cluster.local.").unwrap(),
            RecordType::A,
        )
    }

    fn reply(id: u16, rcode: ResponseCode, question: Option<Query>) -> Message {
        let mut message = Message::error_msg(id, OpCode::Query, rcode);
        message.metadata.recursion_desired = true;
        message.metadata.recursion_available = true;
        if let Some(question) = question {
            message.add_query(question);
        }
        message
    }

    fn bytes(message: &Message) -> Vec<u8> {
        message.to_vec().unwrap()
    }

    #[test]
    fn rcodes_map_to_outcomes() {
        let q = question();
        let cases = [
            (ResponseCode::NoError, Outcome::Answered { rcode: ResponseCode::NoError }),
            (ResponseCode::NXDomain, Outcome::Answered { rcode: ResponseCode::NXDomain }),
            (ResponseCode::ServFail, Outcome::ServerFailure { rcode: ResponseCode::ServFail }),
            (ResponseCode::Refused, Outcome::ServerFailure { rcode: ResponseCode::Refused }),
            (ResponseCode::FormErr, Outcome::ServerFailure { rcode: ResponseCode::FormErr }),
            (ResponseCode::NotImp, Outcome::ServerFailure { rcode: ResponseCode::NotImp }),
        ];
        for (code, want) in cases {
            let got = classify_reply(7, &q, &bytes(&reply(7, code, Some(q.clone()))));
            assert_eq!(got, Some(want), "rcode {code:?}");
        }
    }

    #[test]
    fn answer_with_records_is_answered() {
        let q = question();
        let mut message = reply(9, ResponseCode::NoError, Some(q.clone()));
        message.add_answer(Record::from_rdata(
            q.name().clone(),
            30,
            RData::A(A::new(10, 96, 0, 1)),
        ));
        assert_eq!(
            classify_reply(9, &q, &bytes(&message)),
            Some(Outcome::Answered { rcode: ResponseCode::NoError })
        );
        // The matched reply carries the records, for a client that needs the address.
        let matched = match_reply(9, &q, &bytes(&message)).unwrap();
        assert_eq!(matched.answers, message.answers);
    }

    #[test]
    fn other_ids_are_ignored() {
        let q = question();
        let wire = bytes(&reply(8, ResponseCode::NoError, Some(q.clone())));
        assert_eq!(classify_reply(7, &q, &wire), None);
    }

    #[test]
    fn other_questions_are_ignored() {
        let q = question();
        let other_name = Query::query(Name::from_ascii("example.org.").unwrap(), RecordType::A);
        let other_type = Query::query(q.name().clone(), RecordType::AAAA);
        for other in [other_name, other_type] {
            let wire = bytes(&reply(7, ResponseCode::NoError, Some(other)));
            assert_eq!(classify_reply(7, &q, &wire), None);
        }
        // Two questions, one of them ours: not a reply to our query either.
        let mut two = reply(7, ResponseCode::NoError, Some(q.clone()));
        two.add_query(q.clone());
        assert_eq!(classify_reply(7, &q, &bytes(&two)), None);
    }

    #[test]
    fn question_matches_case_insensitively() {
        let q = question();
        let upper = Query::query(
            Name::from_ascii("KUBERNETES.default.SVC.cluster.local.").unwrap(),
            RecordType::A,
        );
        let wire = bytes(&reply(7, ResponseCode::NoError, Some(upper)));
        assert!(classify_reply(7, &q, &wire).is_some_and(|o| o.is_good()));
    }

    #[test]
    fn missing_question_counts_only_for_errors() {
        let q = question();
        let formerr = bytes(&reply(7, ResponseCode::FormErr, None));
        assert_eq!(
            classify_reply(7, &q, &formerr),
            Some(Outcome::ServerFailure { rcode: ResponseCode::FormErr })
        );
        let noerror = bytes(&reply(7, ResponseCode::NoError, None));
        assert_eq!(classify_reply(7, &q, &noerror), None);
    }

    #[test]
    fn queries_are_not_replies() {
        let q = question();
        let mut message = Message::new(7, MessageType::Query, OpCode::Query);
        message.add_query(q.clone());
        assert_eq!(classify_reply(7, &q, &bytes(&message)), None);
    }

    #[test]
    fn truncated_replies_count() {
        let q = question();
        let mut message = reply(7, ResponseCode::NoError, Some(q.clone()));
        message.metadata.truncation = true;
        assert_eq!(
            classify_reply(7, &q, &bytes(&message)),
            Some(Outcome::Answered { rcode: ResponseCode::NoError })
        );
        // Truncated in the middle of a record: the header and question still decide.
        message.add_answer(Record::from_rdata(
            q.name().clone(),
            30,
            RData::A(A::new(10, 96, 0, 1)),
        ));
        let mut wire = bytes(&message);
        wire.truncate(wire.len() - 3);
        assert_eq!(
            classify_reply(7, &q, &wire),
            Some(Outcome::Answered { rcode: ResponseCode::NoError })
        );
        // The same cut without TC is malformed.
        message.metadata.truncation = false;
        let mut wire = bytes(&message);
        wire.truncate(wire.len() - 3);
        assert_eq!(classify_reply(7, &q, &wire), None);
    }

    #[test]
    fn garbage_is_ignored() {
        let q = question();
        for wire in [&b""[..], &[0u8; 5][..], &[0xff; 40][..]] {
            assert_eq!(classify_reply(7, &q, wire), None);
        }
    }

    #[test]
    fn labels_and_serialisation() {
        assert_eq!(Outcome::Timeout.label(), "timeout");
        assert_eq!(Outcome::ServerFailure { rcode: ResponseCode::ServFail }.label(), "servfail");
        assert!(!Outcome::Refused.is_good());
        // Codes without a mnemonic (11 is unassigned) show their number.
        let names: [(u16, &str); 15] = [
            (0, "NOERROR"),
            (1, "FORMERR"),
            (2, "SERVFAIL"),
            (3, "NXDOMAIN"),
            (4, "NOTIMP"),
            (5, "REFUSED"),
            (6, "YXDOMAIN"),
            (7, "YXRRSET"),
            (8, "NXRRSET"),
            (9, "NOTAUTH"),
            (10, "NOTZONE"),
            (11, "RCODE11"),
            (16, "BADVERS"),
            (23, "BADCOOKIE"),
            (3000, "RCODE3000"),
        ];
        for (code, name) in names {
            assert_eq!(rcode_name(code.into()), name, "rcode {code}");
        }
        assert_eq!(serde_json::to_string(&Transport::Tcp).unwrap(), "\"tcp\"");
        assert_eq!(
            serde_json::to_string(&Outcome::ServerFailure { rcode: ResponseCode::Refused })
                .unwrap(),
            r#"{"outcome":"servfail","rcode":"REFUSED"}"#
        );
        assert_eq!(serde_json::to_string(&Outcome::Timeout).unwrap(), r#"{"outcome":"timeout"}"#);
    }

    #[test]
    fn probe_rejects_bad_configuration() {
        let err = Probe::new("bad..name", Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("bad..name"), "{err}");
        assert!(matches!(Probe::new("ok.example", Duration::ZERO), Err(ProbeError::ZeroTimeout)));
        let probe = Probe::new("cluster.local", Duration::from_secs(1)).unwrap();
        assert!(probe.name().is_fqdn());
    }

    /// How a test server answers each query it receives, in order; after the list it stays
    /// silent.
    #[derive(Clone, Copy)]
    enum Reply {
        Rcode(ResponseCode),
        WrongId,
        WrongQuestion,
        Garbage,
        /// A datagram (or TCP frame) of no bytes.
        Empty,
        /// A NOERROR answer with this many A records (16 bytes each).
        Big(u16),
        /// The right id and question, opcode NOTIFY.
        Notify,
    }

    fn render(query: &Message, how: Reply) -> Vec<u8> {
        let question = query.queries.first().cloned();
        let message = match how {
            Reply::Empty => return Vec::new(),
            Reply::Big(records) => {
                let mut message = reply(query.metadata.id, ResponseCode::NoError, question);
                for i in 0..records {
                    let [hi, lo] = i.to_be_bytes();
                    let name = message.queries[0].name().clone();
                    message.add_answer(Record::from_rdata(
                        name,
                        30,
                        RData::A(A::new(10, 0, hi, lo)),
                    ));
                }
                message
            }
            Reply::Notify => {
                let mut message = reply(query.metadata.id, ResponseCode::NoError, question);
                message.metadata.op_code = OpCode::Notify;
                message
            }
            Reply::Rcode(code) => reply(query.metadata.id, code, question),
            Reply::WrongId => {
                reply(query.metadata.id.wrapping_add(1), ResponseCode::NoError, question)
            }
            Reply::WrongQuestion => reply(
                query.metadata.id,
                ResponseCode::NoError,
                Some(Query::query(Name::from_ascii("other.example.").unwrap(), RecordType::A)),
            ),
            Reply::Garbage => return vec![0xde, 0xad, 0xbe, 0xef],
        };
        bytes(&message)
    }

    /// A UDP server on 127.0.0.1 that sends `replies` (all of them) to the first query.
    async fn udp_server(replies: Vec<Reply>) -> SocketAddr {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_MESSAGE];
            let (len, peer) = socket.recv_from(&mut buf).await.unwrap();
            let query = Message::from_vec(&buf[..len]).unwrap();
            assert!(query.metadata.recursion_desired);
            for how in replies {
                socket.send_to(&render(&query, how), peer).await.unwrap();
            }
            // Stay bound (silent) until the probe is done.
            let _ = socket.recv_from(&mut buf).await;
        });
        addr
    }

    /// The query a probe sent over TCP (length-prefixed), read whole.
    async fn read_tcp_query(stream: &mut tokio::net::TcpStream) -> Message {
        let len = usize::from(stream.read_u16().await.unwrap());
        let mut buf = vec![0u8; len];
        stream.read_exact(&mut buf).await.unwrap();
        Message::from_vec(&buf).unwrap()
    }

    /// A TCP server on 127.0.0.1 that sends `replies` (all of them) on the first connection.
    async fn tcp_server(replies: Vec<Reply>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let query = read_tcp_query(&mut stream).await;
            for how in replies {
                let wire = render(&query, how);
                let len = u16::try_from(wire.len()).unwrap();
                stream.write_all(&len.to_be_bytes()).await.unwrap();
                stream.write_all(&wire).await.unwrap();
            }
            let _ = stream.read_u8().await;
        });
        addr
    }

    fn probe(timeout: Duration) -> Probe {
        Probe::new("kubernetes.default.svc.cluster.local", timeout).unwrap()
    }

    /// A loopback port with nobody behind it (bound, then released).
    fn closed_port() -> SocketAddr {
        std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
    }

    #[tokio::test]
    async fn udp_outcomes() {
        let cases = [
            (vec![Reply::Rcode(ResponseCode::NoError)], "answered"),
            (vec![Reply::Rcode(ResponseCode::NXDomain)], "answered"),
            (vec![Reply::Rcode(ResponseCode::ServFail)], "servfail"),
            (vec![Reply::Rcode(ResponseCode::Refused)], "servfail"),
            (
                vec![
                    Reply::Garbage,
                    Reply::WrongId,
                    Reply::WrongQuestion,
                    Reply::Rcode(ResponseCode::NoError),
                ],
                "answered",
            ),
            (vec![Reply::WrongId, Reply::Garbage], "error"),
            (vec![Reply::Empty, Reply::Notify, Reply::Rcode(ResponseCode::NoError)], "answered"),
            (vec![Reply::Empty], "error"),
            // Larger than the 512 bytes of plain DNS over UDP: read whole, not cut.
            (vec![Reply::Big(200)], "answered"),
            (vec![], "timeout"),
        ];
        let probe = probe(Duration::from_millis(200));
        for (replies, want) in cases {
            let server = udp_server(replies).await;
            let result = probe.run(server, Transport::Udp).await;
            assert_eq!(result.outcome.label(), want, "{result:?}");
            if want == "timeout" {
                assert!(result.latency >= Duration::from_millis(190), "{result:?}");
            }
        }
    }

    #[tokio::test]
    async fn udp_closed_port_is_refused_at_once() {
        let probe = probe(Duration::from_secs(2));
        let result = probe.run(closed_port(), Transport::Udp).await;
        assert_eq!(result.outcome, Outcome::Refused, "{result:?}");
        println!("udp refused after {:?}", result.latency);
        assert!(result.latency < Duration::from_secs(1), "{result:?}");
    }

    #[tokio::test]
    async fn tcp_outcomes() {
        let cases = [
            (vec![Reply::Rcode(ResponseCode::NoError)], "answered"),
            (vec![Reply::Rcode(ResponseCode::ServFail)], "servfail"),
            (vec![Reply::WrongId, Reply::Rcode(ResponseCode::NXDomain)], "answered"),
            (vec![Reply::Empty, Reply::Rcode(ResponseCode::NoError)], "answered"),
            (vec![Reply::WrongQuestion, Reply::Garbage], "error"),
            // Nearly the 64 KiB TCP framing allows.
            (vec![Reply::Big(4000)], "answered"),
            (vec![], "timeout"),
        ];
        let probe = probe(Duration::from_millis(500));
        for (replies, want) in cases {
            let server = tcp_server(replies).await;
            let result = probe.run(server, Transport::Tcp).await;
            assert_eq!(result.outcome.label(), want, "{result:?}");
        }
    }

    #[test]
    fn what_is_wrong_with_a_message_is_named() {
        let q = question();
        let name = |m: Result<Outcome, Mismatch>| m.unwrap_err().to_string();
        let wrong_id = bytes(&reply(8, ResponseCode::NoError, Some(q.clone())));
        assert_eq!(name(check_reply(7, &q, &wrong_id)), "a response with id 8, the query's is 7");
        let other = Query::query(Name::from_ascii("other.example.").unwrap(), RecordType::A);
        let wrong_question = bytes(&reply(7, ResponseCode::NoError, Some(other)));
        let text = name(check_reply(7, &q, &wrong_question));
        assert!(text.starts_with("a response for another question: other.example."), "{text}");
        let none = bytes(&reply(7, ResponseCode::NoError, None));
        assert_eq!(name(check_reply(7, &q, &none)), "a response for another question: none");
        let mut query = Message::new(7, MessageType::Query, OpCode::Query);
        query.add_query(q.clone());
        assert_eq!(name(check_reply(7, &q, &bytes(&query))), "a query, not a response");
        let mut notify = reply(7, ResponseCode::NoError, Some(q.clone()));
        notify.metadata.op_code = OpCode::Notify;
        assert_eq!(name(check_reply(7, &q, &bytes(&notify))), "a response of opcode Notify");
        assert_eq!(name(check_reply(7, &q, &[1, 2, 3])), "3 bytes that are not a DNS message");
        assert_eq!(name(check_reply(7, &q, &[])), "0 bytes that are not a DNS message");
        // A header alone (12 bytes) that promises a question it does not hold.
        let mut header_only = bytes(&reply(7, ResponseCode::NoError, Some(q.clone())));
        header_only.truncate(12);
        assert!(name(check_reply(7, &q, &header_only)).contains("not a DNS message"));
        // Bytes after the last record are not looked at: the reply still answers the query.
        let mut trailing = bytes(&reply(7, ResponseCode::NoError, Some(q.clone())));
        trailing.extend([0xab; 100]);
        assert_eq!(
            check_reply(7, &q, &trailing),
            Ok(Outcome::Answered { rcode: ResponseCode::NoError })
        );
    }

    #[tokio::test]
    async fn a_probe_that_got_only_wrong_replies_says_what_they_were() {
        let probe = probe(Duration::from_millis(200));
        let server = udp_server(vec![Reply::Garbage, Reply::WrongId]).await;
        let result = probe.run(server, Transport::Udp).await;
        let Outcome::Error { reason } = &result.outcome else { panic!("{result:?}") };
        assert!(
            reason.starts_with("no reply to the query within 200ms from 127.0.0.1:"),
            "{reason}"
        );
        assert!(reason.contains("only 2 messages that did not answer it"), "{reason}");
        assert!(reason.contains("(last: a response with id"), "{reason}");
        // A wrong reply does not cut the wait short: the probe still waits for the right one.
        assert!(result.latency >= Duration::from_millis(190), "{result:?}");
    }

    #[tokio::test]
    async fn a_reply_from_another_port_is_never_seen() {
        // The server answers from a second socket: right id, right question, wrong source. The
        // probe's connected socket does not even receive it.
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let server = socket.local_addr().unwrap();
        let elsewhere = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_MESSAGE];
            for round in 0.. {
                let Ok((len, peer)) = socket.recv_from(&mut buf).await else { return };
                let query = Message::from_vec(&buf[..len]).unwrap();
                let wire = render(&query, Reply::Rcode(ResponseCode::NoError));
                elsewhere.send_to(&wire, peer).await.unwrap();
                // The second time, the right answer follows from the right place.
                if round == 1 {
                    socket.send_to(&wire, peer).await.unwrap();
                }
            }
        });
        let probe = probe(Duration::from_millis(200));
        let result = probe.run(server, Transport::Udp).await;
        assert_eq!(result.outcome, Outcome::Timeout, "{result:?}");
        let result = probe.run(server, Transport::Udp).await;
        assert_eq!(result.outcome.label(), "answered", "{result:?}");
    }

    /// A TCP server on 127.0.0.1 that reads the first query and writes `bytes(query)` as they
    /// are, then closes the connection (`close`) or holds it open until the probe is done.
    async fn tcp_raw_server(
        bytes: impl FnOnce(&Message) -> Vec<u8> + Send + 'static,
        close: bool,
    ) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let query = read_tcp_query(&mut stream).await;
            let _ = stream.write_all(&bytes(&query)).await;
            if !close {
                let _ = stream.read_u8().await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn tcp_length_prefixes_that_lie_fail_the_probe_in_time() {
        let probe = probe(Duration::from_millis(300));
        let short = |_: &Message| [&1000u16.to_be_bytes()[..], &[0xab; 10]].concat();
        // A prefix promising more than comes, then the end of the connection.
        let result = probe.run(tcp_raw_server(short, true).await, Transport::Tcp).await;
        let Outcome::Error { reason } = &result.outcome else { panic!("{result:?}") };
        assert!(reason.contains("connection closed before a reply"), "{reason}");
        // The same, the connection held open: the deadline ends it.
        let result = probe.run(tcp_raw_server(short, false).await, Transport::Tcp).await;
        assert_eq!(result.outcome, Outcome::Timeout, "{result:?}");
        // More than 64 KiB: the framing cannot say it; the first 65535 bytes are no message
        // and the rest is read as another frame that never completes.
        let huge = |_: &Message| {
            let mut wire = u16::MAX.to_be_bytes().to_vec();
            wire.resize(2 + 70_000, 0xab);
            wire
        };
        let result = probe.run(tcp_raw_server(huge, false).await, Transport::Tcp).await;
        let Outcome::Error { reason } = &result.outcome else { panic!("{result:?}") };
        assert!(reason.contains("1 message that did not answer it"), "{reason}");
        assert!(result.latency < Duration::from_secs(2), "{result:?}");
        // A zero-length frame, then one that is a whole reply but cut short of its own length.
        let cut = |query: &Message| {
            let reply = render(query, Reply::Big(10));
            let mut wire = 0u16.to_be_bytes().to_vec();
            wire.extend(((reply.len() - 20) as u16).to_be_bytes());
            wire.extend(&reply[..reply.len() - 20]);
            wire
        };
        let result = probe.run(tcp_raw_server(cut, false).await, Transport::Tcp).await;
        let Outcome::Error { reason } = &result.outcome else { panic!("{result:?}") };
        assert!(reason.contains("only 2 messages"), "{reason}");
    }

    #[tokio::test]
    async fn tcp_closed_port_is_refused_at_once() {
        let probe = probe(Duration::from_secs(2));
        let result = probe.run(closed_port(), Transport::Tcp).await;
        assert_eq!(result.outcome, Outcome::Refused, "{result:?}");
        println!("tcp refused after {:?}", result.latency);
        assert!(result.latency < Duration::from_secs(1), "{result:?}");
    }

    #[tokio::test]
    async fn tcp_close_without_reply_is_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            // Read the whole query (unread data would make the close a reset), then drop the
            // stream: a FIN without a reply.
            read_tcp_query(&mut stream).await;
        });
        let result = probe(Duration::from_secs(2)).run(server, Transport::Tcp).await;
        assert_eq!(result.outcome.label(), "error", "{result:?}");
    }
}
