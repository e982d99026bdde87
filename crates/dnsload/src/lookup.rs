//! One lookup: up to `--attempts` attempts as glibc's `res_send` makes them, each one the
//! agent's probe exchange (a fresh connected UDP socket or a new TCP connection, replies matched
//! to the query as the probe matches them); or one `getaddrinfo()` of the C library.

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use nodelocaldns_ha::probe::{self, ExchangeError, Transport};
use tokio::time::Instant;

/// Why an attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttemptError {
    /// No matching reply within the attempt's timeout.
    Timeout,
    /// ECONNREFUSED: ICMP port unreachable (UDP) or a reset (TCP).
    Refused,
    /// The server answered SERVFAIL.
    ServFail,
    /// Any other rcode, or NOERROR without an address for the question.
    BadReply,
    /// Any other socket error (e.g. no route).
    Io,
}

impl From<std::io::Error> for AttemptError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset => AttemptError::Refused,
            _ => AttemptError::Io,
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct LookupSpec {
    /// None: the C library's resolver.
    pub(crate) server: Option<SocketAddr>,
    pub(crate) qtype: RecordType,
    pub(crate) timeout: Duration,
    pub(crate) attempts: u32,
    pub(crate) tcp: bool,
    /// The C library's resolver asked for both families (AF_UNSPEC).
    pub(crate) both_families: bool,
}

/// How long a `--system-resolver` lookup may take at most, for the in-flight bound and the
/// drain: glibc's worst case with 3 nameservers, `timeout:5` and `attempts:2` is 30 s.
pub const SYSTEM_LOOKUP_BUDGET: Duration = Duration::from_secs(31);

/// What one lookup did.
pub(crate) struct LookupResult {
    /// When the lookup started, since the start of the run.
    pub(crate) started: Duration,
    /// The address answered, if an attempt succeeded.
    pub(crate) answer: Option<IpAddr>,
    /// Failed attempts, in order.
    pub(crate) errors: Vec<AttemptError>,
    /// From start to the final answer or failure.
    pub(crate) latency: Duration,
}

impl LookupResult {
    /// A lookup that never reported back (it did not finish in time, or its task failed).
    pub(crate) fn lost(started: Duration) -> Self {
        LookupResult { started, answer: None, errors: Vec::new(), latency: Duration::ZERO }
    }

    pub(crate) fn first_attempt_lost(&self) -> bool {
        self.answer.is_none() || !self.errors.is_empty()
    }
}

pub(crate) async fn lookup(spec: LookupSpec, name: Name, started: Duration) -> LookupResult {
    let t0 = Instant::now();
    let Some(server) = spec.server else {
        let family = match spec.qtype {
            _ if spec.both_families => libc::AF_UNSPEC,
            RecordType::AAAA => libc::AF_INET6,
            _ => libc::AF_INET,
        };
        let result = tokio::task::spawn_blocking(move || system_lookup(&name, family))
            .await
            .unwrap_or(Err(AttemptError::Io));
        let (answer, errors) = match result {
            Ok(addr) => (Some(addr), Vec::new()),
            Err(e) => (None, vec![e]),
        };
        return LookupResult { started, answer, errors, latency: t0.elapsed() };
    };
    let query = Query::query(name, spec.qtype);
    let transport = if spec.tcp { Transport::Tcp } else { Transport::Udp };
    let mut errors = Vec::new();
    let mut answer = None;
    for _ in 0..spec.attempts {
        match attempt(server, transport, &query, spec.timeout).await {
            Ok(addr) => {
                answer = Some(addr);
                break;
            }
            Err(e) => errors.push(e),
        }
    }
    LookupResult { started, answer, errors, latency: t0.elapsed() }
}

/// One `getaddrinfo()` of `name` for `family` (AF_INET, AF_INET6 or AF_UNSPEC); the first
/// address returned.
pub(crate) fn system_lookup(name: &Name, family: i32) -> Result<IpAddr, AttemptError> {
    use dns_lookup::{AddrInfoHints, LookupErrorKind};
    let hints = AddrInfoHints { address: family, socktype: libc::SOCK_DGRAM, ..Default::default() };
    let list = dns_lookup::getaddrinfo(Some(&name.to_ascii()), None, Some(hints)).map_err(|e| {
        match e.kind() {
            // Timeouts, SERVFAIL, refused servers: glibc says "try again".
            LookupErrorKind::Again => AttemptError::Timeout,
            LookupErrorKind::NoName | LookupErrorKind::NoData => AttemptError::BadReply,
            _ => AttemptError::Io,
        }
    })?;
    list.filter_map(Result::ok).map(|ai| ai.sockaddr.ip()).next().ok_or(AttemptError::BadReply)
}

/// A new query with a random id and RD set, as (id, wire bytes).
/// One attempt: a new query to `server`, its reply as the agent's probe would accept it.
async fn attempt(
    server: SocketAddr,
    transport: Transport,
    query: &Query,
    timeout: Duration,
) -> Result<IpAddr, AttemptError> {
    let message = probe::new_query(query.clone());
    let wire = message.to_vec().map_err(|_| AttemptError::Io)?;
    let id = message.metadata.id;
    let answer = |reply: &[u8]| answer_of(reply, id, query);
    match probe::exchange(server, transport, &wire, timeout, false, answer).await.result {
        Ok(result) => result,
        Err(ExchangeError::Timeout) => Err(AttemptError::Timeout),
        Err(ExchangeError::Io { source, .. }) => Err(source.into()),
    }
}

/// None if the message is not the reply to this query (keep waiting), else the attempt's result:
/// the first address of the question's type in a NOERROR answer.
pub(crate) fn answer_of(
    reply: &[u8],
    id: u16,
    query: &Query,
) -> Option<Result<IpAddr, AttemptError>> {
    let reply = probe::match_reply(id, query, reply).ok()?;
    Some(match reply.rcode {
        ResponseCode::NoError => reply
            .answers
            .iter()
            .filter(|r| r.record_type() == query.query_type)
            .find_map(|r| r.data.ip_addr())
            .ok_or(AttemptError::BadReply),
        ResponseCode::ServFail => Err(AttemptError::ServFail),
        _ => Err(AttemptError::BadReply),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_name;
    use hickory_proto::op::Message;

    #[test]
    fn replies_are_matched_and_classified() {
        use hickory_proto::rr::{rdata::A, RData, Record};
        let query = Query::query(parse_name("who.test").unwrap(), RecordType::A);
        let mut reply = Message::response(7, hickory_proto::op::OpCode::Query);
        reply.add_query(query.clone());
        reply.add_answer(Record::from_rdata(query.name.clone(), 30, RData::A(A::new(1, 1, 1, 1))));
        let bytes = reply.to_vec().unwrap();
        assert_eq!(answer_of(&bytes, 8, &query), None);
        assert_eq!(answer_of(&bytes, 7, &query), Some(Ok([1, 1, 1, 1].into())));
        reply.metadata.response_code = ResponseCode::ServFail;
        let bytes = reply.to_vec().unwrap();
        assert_eq!(answer_of(&bytes, 7, &query), Some(Err(AttemptError::ServFail)));
    }
}
