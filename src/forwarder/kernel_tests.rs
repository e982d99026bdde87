//! Real-kernel tests, each in a fresh network namespace ([`in_netns`]): a stand-in upstream on
//! the namespace's loopback, the forwarder behind the TPROXY rules of the design, and clients
//! on the namespace's own addresses querying the link-local IP. Their packets to a local
//! address come back in through prerouting on `lo`, where TPROXY applies, as a pod's do on its
//! veth.

use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::process::{Command, Stdio};

use super::ids::HEADER_LEN;
use super::*;
use crate::testutil::{in_netns, run, test_path};

/// How long a client waits for what it expects.
const DEADLINE: Duration = Duration::from_secs(5);

/// The fallback rules of docs/design/link-local.md §6.2 without the guard (there is no
/// cache here): every query for the link-local IP goes to the forwarder.
const TPROXY: &str = "table inet t {
    chain p {
        type filter hook prerouting priority mangle; policy accept;
        ip daddr 169.254.20.10 udp dport 53 tproxy ip to 127.53.0.53:53
        ip daddr 169.254.20.10 tcp dport 53 tproxy ip to 127.53.0.53:53
        ip6 daddr fd00:169:254::10 udp dport 53 tproxy ip6 to [fd00:169:254::53]:53
        ip6 daddr fd00:169:254::10 tcp dport 53 tproxy ip6 to [fd00:169:254::53]:53
    }
}";

/// One family's addresses.
#[derive(Clone, Copy)]
struct Family {
    /// What clients query: the link-local IP (on `lo`), port 53.
    link_local: SocketAddr,
    /// The forwarder's own address, where TPROXY sends them (on no interface).
    forwarder: SocketAddr,
    /// The stand-in upstream (on `lo`).
    upstream: SocketAddr,
    /// Where a client binds: a pod's address (on `lo`), not the link-local IP, so an answer
    /// whose source the kernel picked by routing would not pass for the right one.
    client: SocketAddr,
}

fn family(addresses: [&str; 4]) -> Family {
    let [link_local, forwarder, upstream, client] = addresses.map(|a| a.parse().unwrap());
    Family { link_local, forwarder, upstream, client }
}

fn v4() -> Family {
    family(["169.254.20.10:53", "127.53.0.53:53", "10.96.0.11:53", "10.244.0.5:0"])
}

fn v6() -> Family {
    family([
        "[fd00:169:254::10]:53",
        "[fd00:169:254::53]:53",
        "[fd00:96::11]:53",
        "[fd00:244::5]:0",
    ])
}

/// Puts the link-local, upstream and client addresses on the namespace's `lo`, loads
/// [`TPROXY`].
fn set_up(ns: &str) {
    run("ip", &["-n", ns, "link", "set", "lo", "up"]);
    for address in ["169.254.20.10/32", "10.96.0.11/32", "10.244.0.5/32", "10.244.0.6/32"] {
        run("ip", &["-n", ns, "addr", "add", address, "dev", "lo"]);
    }
    for address in ["fd00:169:254::10/128", "fd00:96::11/128", "fd00:244::5/128"] {
        run("ip", &["-n", ns, "-6", "addr", "add", address, "dev", "lo", "nodad"]);
    }
    let mut nft = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    nft.stdin.take().unwrap().write_all(TPROXY.as_bytes()).unwrap();
    let output = nft.wait_with_output().unwrap();
    assert!(output.status.success(), "nft -f: {}", String::from_utf8_lossy(&output.stderr));
}

/// The marker after a query's header that has the stand-in answer it.
const ANSWER: &[u8] = b"answer";
/// … that has it say nothing.
const SILENT: &[u8] = b"silent";
/// … that has it close the TCP connection instead of answering.
const CLOSE: &[u8] = b"close";
/// … that has it send, before its answer over UDP, a datagram with another id.
const DECOY: &[u8] = b"decoy";

/// A query: a header with `id` and RD set, then `marker`.
fn query(id: u16, marker: &[u8]) -> Vec<u8> {
    let mut query = id.to_be_bytes().to_vec();
    query.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    query.extend_from_slice(marker);
    query
}

/// A query for `name`, type A, class IN, with `id` and RD set: one whose question the
/// forwarder reads, and an answer must repeat.
fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut query = query(id, b"");
    for label in name.split('.') {
        query.push(u8::try_from(label.len()).unwrap());
        query.extend_from_slice(label.as_bytes());
    }
    query.extend_from_slice(&[0, 0, 1, 0, 1]);
    query
}

/// The stand-in's answer to `query`: the query with QR, TC, RD and RA set (the TC bit must
/// pass through), and a tail of its own. An answer that arrives byte-identical proves the
/// query passed whole both ways.
fn answer_to(query: &[u8]) -> Vec<u8> {
    let mut answer = query.to_vec();
    answer[2..4].copy_from_slice(&[0x83, 0x80]);
    answer.extend_from_slice(b", from the upstream");
    answer
}

/// Starts the stand-in upstream on `at`, UDP and TCP, on threads that end with the test's
/// process.
fn start_upstream(at: SocketAddr) {
    let udp = UdpSocket::bind(at).unwrap();
    let tcp = TcpListener::bind(at).unwrap();
    std::thread::spawn(move || {
        let mut buf = [0; 512];
        while let Ok((len, from)) = udp.recv_from(&mut buf) {
            let query = &buf[..len];
            if query.ends_with(DECOY) {
                let mut decoy = answer_to(query);
                decoy[1] ^= 0xff;
                decoy.extend_from_slice(b" (decoy)");
                let _ = udp.send_to(&decoy, from);
            }
            if !query.ends_with(SILENT) {
                let _ = udp.send_to(&answer_to(query), from);
            }
        }
    });
    std::thread::spawn(move || {
        for mut stream in tcp.incoming().flatten() {
            std::thread::spawn(move || {
                while let Ok(query) = read_framed(&mut stream) {
                    if query.ends_with(CLOSE)
                        || write_framed(&mut stream, &answer_to(&query)).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
}

/// Reads one message with RFC 1035's 2-byte length framing.
fn read_framed(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0; 2];
    stream.read_exact(&mut len)?;
    let mut message = vec![0; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut message)?;
    Ok(message)
}

fn write_framed(stream: &mut TcpStream, message: &[u8]) -> io::Result<()> {
    let len = u16::try_from(message.len()).expect("a DNS message");
    stream.write_all(&[&len.to_be_bytes()[..], message].concat())
}

/// A forwarder serving on a runtime of its own (dropped with it).
struct Serving {
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<Result<Infallible, Error>>,
    _runtime: tokio::runtime::Runtime,
}

fn serve(family: Family, options: Options) -> Serving {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let forwarder = {
        let _inside = runtime.enter();
        Forwarder::bind(family.forwarder, family.upstream, options).unwrap()
    };
    assert_eq!(forwarder.listen(), family.forwarder);
    let counters = forwarder.counters();
    let task = runtime.spawn(forwarder.run());
    Serving { counters, task, _runtime: runtime }
}

impl Serving {
    /// Waits until the counters read `want` (all but the re-dials, which come with time), and
    /// checks the forwarder still serves.
    fn wait_for(&self, want: Totals) {
        let now = || Totals { upstream_redials: 0, ..self.counters.totals() };
        let reached = testkit::poll(DEADLINE, || (now() == want).then_some(()));
        let totals = self.counters.totals();
        assert!(reached.is_some(), "counters {totals:?}, want {want:?}");
        assert!(!self.task.is_finished(), "the forwarder stopped");
    }
}

/// A UDP client, its reads bounded by [`DEADLINE`].
fn udp_client(family: Family) -> UdpSocket {
    let client = UdpSocket::bind(family.client).unwrap();
    client.set_read_timeout(Some(DEADLINE)).unwrap();
    client
}

/// Whether nothing has arrived for `client`.
fn got_nothing(client: &UdpSocket) -> bool {
    client.set_nonblocking(true).unwrap();
    let mut buf = [0; 512];
    client.recv(&mut buf).is_err_and(|e| e.kind() == ErrorKind::WouldBlock)
}

/// A TCP connection from the client's address to the link-local IP, its reads bounded by
/// [`DEADLINE`].
fn tcp_client(family: Family) -> TcpStream {
    tcp_client_from(family.client, family)
}

/// A TCP connection from `from` to the link-local IP, its reads bounded by [`DEADLINE`].
fn tcp_client_from(from: SocketAddr, family: Family) -> TcpStream {
    let socket = Socket::new(Domain::for_address(from), Type::STREAM, None).unwrap();
    socket.bind(&from.into()).unwrap();
    socket.connect_timeout(&family.link_local.into(), DEADLINE).unwrap();
    let stream = TcpStream::from(socket);
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    assert_eq!(stream.local_addr().unwrap().ip(), from.ip());
    stream
}

fn answered_from_the_link_local_ip(ns: &str, family: Family) {
    set_up(ns);
    start_upstream(family.upstream);
    let forwarder = serve(family, Options::default());
    let mut buf = [0; 512];

    // An unconnected client sees where the answer comes from.
    let client = udp_client(family);
    let sent = query(1, ANSWER);
    client.send_to(&sent, family.link_local).unwrap();
    let (len, from) = client.recv_from(&mut buf).expect("an answer");
    assert_eq!((&buf[..len], from), (&answer_to(&sent)[..], family.link_local));

    // A connected client, as glibc's resolver uses, takes datagrams from the address it
    // queried only.
    let client = udp_client(family);
    client.connect(family.link_local).unwrap();
    let sent = query(2, ANSWER);
    client.send(&sent).unwrap();
    let len = client.recv(&mut buf).expect("an answer from the link-local IP");
    assert_eq!(&buf[..len], answer_to(&sent));

    // A datagram from the upstream is the answer only if it has the query's id.
    let client = udp_client(family);
    let sent = query(3, DECOY);
    client.send_to(&sent, family.link_local).unwrap();
    let len = client.recv(&mut buf).expect("an answer");
    assert_eq!(&buf[..len], answer_to(&sent), "the answer, not the decoy");

    let mut stream = tcp_client(family);
    let sent = query(4, ANSWER);
    write_framed(&mut stream, &sent).unwrap();
    assert_eq!(read_framed(&mut stream).expect("an answer over TCP"), answer_to(&sent));

    let want = Totals {
        udp_queries: 3,
        udp_answers: 3,
        tcp_connections: 1,
        stray_answers: 1, // the decoy
        ..Totals::default()
    };
    forwarder.wait_for(want);
}

#[test]
fn ipv4_queries_are_answered_from_the_link_local_ip() {
    in_netns("fwd", test_path!(), |ns| answered_from_the_link_local_ip(ns, v4()));
}

#[test]
fn ipv6_queries_are_answered_from_the_link_local_ip() {
    in_netns("fwd", test_path!(), |ns| answered_from_the_link_local_ip(ns, v6()));
}

#[test]
fn a_silent_upstream_costs_only_the_queries_it_leaves_unanswered() {
    in_netns("fwd", test_path!(), |ns| {
        let family = v4();
        set_up(ns);
        start_upstream(family.upstream);
        let forwarder = serve(family, Options { max_in_flight: 1, ..Options::default() });

        let silent = udp_client(family);
        silent.send_to(&query(1, SILENT), family.link_local).unwrap();
        forwarder.wait_for(Totals { udp_queries: 1, ..Totals::default() });
        // The one place in flight is taken until the upstream timeout (2 s).
        let crowded = udp_client(family);
        crowded.send_to(&query(2, ANSWER), family.link_local).unwrap();
        let mut want = Totals { udp_queries: 1, dropped_busy: 1, ..Totals::default() };
        forwarder.wait_for(want);
        want.upstream_failures = 1;
        forwarder.wait_for(want);

        // The place is free again.
        let later = udp_client(family);
        let sent = query(3, ANSWER);
        later.send_to(&sent, family.link_local).unwrap();
        let mut buf = [0; 512];
        let len = later.recv(&mut buf).expect("an answer once the silent query gave up");
        assert_eq!(&buf[..len], answer_to(&sent));
        forwarder.wait_for(Totals { udp_queries: 2, udp_answers: 1, ..want });
        assert!(got_nothing(&silent), "an answer to the silent query");
        assert!(got_nothing(&crowded), "an answer to the dropped query");
    });
}

#[test]
fn a_tcp_connection_the_upstream_closes_is_closed() {
    in_netns("fwd", test_path!(), |ns| {
        let family = v4();
        set_up(ns);
        start_upstream(family.upstream);
        let forwarder = serve(family, Options::default());

        let mut stream = tcp_client(family);
        let sent = query(1, ANSWER);
        write_framed(&mut stream, &sent).unwrap();
        assert_eq!(read_framed(&mut stream).unwrap(), answer_to(&sent));
        write_framed(&mut stream, &query(2, CLOSE)).unwrap();
        let mut buf = [0; 16];
        assert_eq!(stream.read(&mut buf).expect("the end of the connection"), 0);
        forwarder.wait_for(Totals { tcp_connections: 1, ..Totals::default() });
    });
}

#[test]
fn a_connection_beyond_the_bound_is_closed_and_its_place_comes_back() {
    in_netns("fwd", test_path!(), |ns| {
        let family = v4();
        set_up(ns);
        start_upstream(family.upstream);
        let forwarder = serve(family, Options { max_connections: 1, ..Options::default() });
        let ask = |stream: &mut TcpStream, id| {
            let sent = query(id, ANSWER);
            write_framed(stream, &sent).ok()?;
            read_framed(stream).ok().filter(|answer| *answer == answer_to(&sent))
        };

        let mut first = tcp_client(family);
        assert!(ask(&mut first, 1).is_some(), "the first connection is relayed");
        let mut second = tcp_client(family);
        let mut buf = [0; 16];
        assert_eq!(second.read(&mut buf).expect("the end of the connection"), 0);
        forwarder.wait_for(Totals { tcp_connections: 1, dropped_busy: 1, ..Totals::default() });

        // Once the first connection has ended, its place serves another.
        write_framed(&mut first, &query(2, CLOSE)).unwrap();
        assert_eq!(first.read(&mut buf).expect("the end of the connection"), 0);
        let served = testkit::poll(DEADLINE, || ask(&mut tcp_client(family), 3));
        assert!(served.is_some(), "no connection served after the first ended");
    });
}

fn with_no_upstream_queries_fail_fast(ns: &str, family: Family) {
    // Nothing listens on the upstream address: its ICMP port unreachable and TCP reset end the
    // exchanges at once. The UDP queries share the pool's sockets: the ICMP errors quote them,
    // and each names its own query (one whose question is read, one whose is not). The
    // timeout is far beyond the test's deadline: only the errors can end the queries in time.
    set_up(ns);
    let forwarder =
        serve(family, Options { upstream_timeout: Duration::from_secs(600), ..Options::default() });

    let client = udp_client(family);
    client.send_to(&query(1, ANSWER), family.link_local).unwrap();
    client.send_to(&dns_query(2, "refused.test"), family.link_local).unwrap();
    let mut stream = tcp_client(family);
    write_framed(&mut stream, &query(3, ANSWER)).unwrap();
    let mut buf = [0; 16];
    match stream.read(&mut buf) {
        Ok(0) => {}
        Err(error) if error.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("the connection is still open: {other:?}"),
    }
    let want =
        Totals { udp_queries: 2, tcp_connections: 1, upstream_failures: 3, ..Totals::default() };
    forwarder.wait_for(want);
    assert!(got_nothing(&client));
}

#[test]
fn with_no_upstream_ipv4_queries_fail_fast_and_are_counted() {
    in_netns("fwd", test_path!(), |ns| with_no_upstream_queries_fail_fast(ns, v4()));
}

#[test]
fn with_no_upstream_ipv6_queries_fail_fast_and_are_counted() {
    in_netns("fwd", test_path!(), |ns| with_no_upstream_queries_fail_fast(ns, v6()));
}

#[test]
fn binding_a_taken_address_says_which() {
    in_netns("fwd", test_path!(), |_| {
        let family = v4();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _inside = runtime.enter();
        let bind = || Forwarder::bind(family.forwarder, family.upstream, Options::default());
        let first = bind().unwrap();
        let error = bind().unwrap_err();
        assert!(matches!(error, Error::Bind { transport: Transport::Udp, .. }), "{error}");
        assert!(
            error.to_string().starts_with("binding 127.53.0.53:53 (udp, IP_TRANSPARENT) failed"),
            "{error}"
        );
        // Nothing lingers once a forwarder is dropped.
        drop(first);
        bind().unwrap();
    });
}

/// How many queries the out-of-order stand-in holds before it answers them, last first; also
/// how many each client keeps in flight, so that the stand-in always gets its batch. With 20
/// clients, 100 queries in flight: the listening socket's buffer (the kernel's default, some
/// 200 KiB) holds them all even while the forwarder is slow to read, so none is lost.
const HELD: usize = 5;

/// What the out-of-order stand-in saw.
#[derive(Default)]
struct Reversed {
    /// Queries answered.
    answered: usize,
    /// The addresses they came from.
    sources: HashSet<SocketAddr>,
    /// Ids that were pending twice on the same socket at once.
    clashes: Vec<(SocketAddr, u16)>,
}

/// Starts a stand-in upstream on `at` (UDP) that holds [`HELD`] queries, then answers them in
/// the reverse of their order, on a thread that ends with the test's process.
fn start_reversing_upstream(at: SocketAddr) -> Arc<std::sync::Mutex<Reversed>> {
    let udp = UdpSocket::bind(at).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Reversed::default()));
    let record = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0; 512];
        loop {
            let mut held = Vec::new();
            while held.len() < HELD {
                let Ok((len, from)) = udp.recv_from(&mut buf) else { return };
                held.push((buf[..len].to_vec(), from));
            }
            let mut seen = record.lock().unwrap();
            let mut pending = HashSet::new();
            for (query, from) in &held {
                let id = u16::from_be_bytes([query[0], query[1]]);
                if !pending.insert((*from, id)) {
                    seen.clashes.push((*from, id));
                }
                seen.sources.insert(*from);
            }
            for (query, from) in held.iter().rev() {
                udp.send_to(&answer_to(query), from).unwrap();
                seen.answered += 1;
            }
        }
    });
    seen
}

/// Sends `total` queries from a socket of its own, [`HELD`] in flight at a time, with the ids
/// 0, 1, … that every other client uses too; checks that each answer is its query's, byte for
/// byte, under its id and from the link-local IP. Says what went wrong if an answer did not
/// come.
fn ask_many(family: Family, client: usize, total: u16) -> Result<(), String> {
    let socket = udp_client(family);
    let mut outstanding = HashMap::new();
    let (mut next, mut answered) = (0, 0);
    let mut buf = [0; 512];
    while answered < total {
        while outstanding.len() < HELD && next < total {
            let sent = dns_query(next, &format!("q{next}.client{client}.test"));
            socket.send_to(&sent, family.link_local).unwrap();
            outstanding.insert(next, sent);
            next += 1;
        }
        let (len, from) = socket.recv_from(&mut buf).map_err(|error| {
            let ids: Vec<&u16> = outstanding.keys().collect();
            format!("client {client}: {error} after {answered} answers, waiting for ids {ids:?}")
        })?;
        assert_eq!(from, family.link_local, "client {client}: the answer's source");
        let id = u16::from_be_bytes([buf[0], buf[1]]);
        let sent = outstanding.remove(&id).unwrap_or_else(|| {
            panic!("client {client}: an answer under id {id}, which no query of its waits for")
        });
        assert_eq!(&buf[..len], answer_to(&sent), "client {client}: the answer to query {id}");
        answered += 1;
    }
    Ok(())
}

#[test]
fn many_clients_sharing_ids_get_their_own_answers_whatever_the_upstream_s_order() {
    in_netns("fwd", test_path!(), |ns| {
        const CLIENTS: usize = 20;
        const EACH: u16 = 100;
        let family = v4();
        set_up(ns);
        let upstream = start_reversing_upstream(family.upstream);
        // No re-dial: the sources the upstream sees are the pool's sockets.
        let options = Options { upstream_redial: Duration::from_secs(3600), ..Options::default() };
        let forwarder = serve(family, options);

        let failed: Vec<String> = std::thread::scope(|scope| {
            let clients: Vec<_> = (0..CLIENTS)
                .map(|client| scope.spawn(move || ask_many(family, client, EACH)))
                .collect();
            clients.into_iter().filter_map(|client| client.join().unwrap().err()).collect()
        });
        let answered = upstream.lock().unwrap().answered;
        let totals = forwarder.counters.totals();
        // The namespace's UDP counters say whether a socket's buffer overflowed (RcvbufErrors).
        assert!(
            failed.is_empty(),
            "{}\nthe upstream answered {answered}; the forwarder's counters: {totals:?}\n{}",
            failed.join("\n"),
            std::fs::read_to_string("/proc/net/snmp").unwrap()
        );
        let total = CLIENTS as u64 * u64::from(EACH);
        forwarder.wait_for(Totals { udp_queries: total, udp_answers: total, ..Totals::default() });
        let seen = upstream.lock().unwrap();
        assert_eq!(seen.answered as u64, total);
        // Up to 100 queries with 20 clients' copies of each id at once: the pool's sockets
        // carried them all, each under an id none of its other pending queries had.
        assert!(seen.sources.len() <= super::upstream::SOCKETS, "sources {:?}", seen.sources);
        assert!(seen.clashes.is_empty(), "ids pending twice on a socket: {:?}", seen.clashes);
    });
}

#[test]
fn an_answer_after_its_query_expired_is_dropped_and_counted() {
    in_netns("fwd", test_path!(), |ns| {
        // The test is the upstream: it answers when it likes.
        let family = v4();
        set_up(ns);
        let upstream = UdpSocket::bind(family.upstream).unwrap();
        upstream.set_read_timeout(Some(DEADLINE)).unwrap();
        let options =
            Options { upstream_timeout: Duration::from_millis(200), ..Options::default() };
        let forwarder = serve(family, options);
        let mut buf = [0; 512];

        let client = udp_client(family);
        client.send_to(&dns_query(1, "late.test"), family.link_local).unwrap();
        let (len, pool_socket) = upstream.recv_from(&mut buf).expect("the query");
        let late = answer_to(&buf[..len]);
        let mut want = Totals { udp_queries: 1, upstream_failures: 1, ..Totals::default() };
        forwarder.wait_for(want);
        upstream.send_to(&late, pool_socket).unwrap();
        want.stray_answers = 1;
        forwarder.wait_for(want);
        assert!(got_nothing(&client), "the late answer reached the client");

        // The socket serves on: the next query, answered in time, is.
        client.set_nonblocking(false).unwrap();
        let sent = dns_query(2, "next.test");
        client.send_to(&sent, family.link_local).unwrap();
        let (len, pool_socket) = upstream.recv_from(&mut buf).expect("the query");
        upstream.send_to(&answer_to(&buf[..len]), pool_socket).unwrap();
        let len = client.recv(&mut buf).expect("an answer");
        assert_eq!(&buf[..len], answer_to(&sent));
        forwarder.wait_for(Totals { udp_queries: 2, udp_answers: 1, ..want });
    });
}

/// A second pod's address (on `lo`, IPv4): a client other than [`Family::client`].
const OTHER_CLIENT: &str = "10.244.0.6:0";

mod moved;
mod shares;
