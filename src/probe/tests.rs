//! Probes against real sockets on loopback: answers, refusals, timeouts, and replies that must not
//! count.

use super::*;

use hickory_proto::rr::rdata::A;
use hickory_proto::rr::RData;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

use super::exchange::MAX_MESSAGE;

fn question() -> Query {
    Query::query(Name::from_ascii("kubernetes.default.svc.cluster.local.").unwrap(), RecordType::A)
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
    message.add_answer(Record::from_rdata(q.name().clone(), 30, RData::A(A::new(10, 96, 0, 1))));
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
    message.add_answer(Record::from_rdata(q.name().clone(), 30, RData::A(A::new(10, 96, 0, 1))));
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
        serde_json::to_string(&Outcome::ServerFailure { rcode: ResponseCode::Refused }).unwrap(),
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
                message.add_answer(Record::from_rdata(name, 30, RData::A(A::new(10, 0, hi, lo))));
            }
            message
        }
        Reply::Notify => {
            let mut message = reply(query.metadata.id, ResponseCode::NoError, question);
            message.metadata.op_code = OpCode::Notify;
            message
        }
        Reply::Rcode(code) => reply(query.metadata.id, code, question),
        Reply::WrongId => reply(query.metadata.id.wrapping_add(1), ResponseCode::NoError, question),
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
    assert!(reason.starts_with("no reply to the query within 200ms from 127.0.0.1:"), "{reason}");
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
