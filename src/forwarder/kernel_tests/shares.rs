//! Real-kernel tests of the forwarder's fair shares per client and of its upstream sockets'
//! re-dials, on [`super`]'s namespace, upstream and clients.

use super::*;

/// Sends [`SILENT`] queries (the upstream never answers them) from one socket bound to
/// `from`, `rate` a second for `lasting`, paced in steps of 2 ms; returns how many it sent.
fn flood_silent(from: SocketAddr, to: SocketAddr, rate: u32, lasting: Duration) -> u32 {
    const STEP: Duration = Duration::from_millis(2);
    let socket = UdpSocket::bind(from).unwrap();
    let per_step = rate / 500;
    let start = std::time::Instant::now();
    let mut sent = 0;
    for step in 1.. {
        let at = start + STEP * step;
        if at > start + lasting {
            break;
        }
        for _ in 0..per_step {
            let _ = socket.send_to(&query(sent as u16, SILENT), to);
            sent += 1;
        }
        // Pacing a load generator, not synchronisation.
        std::thread::sleep(at.saturating_duration_since(std::time::Instant::now()));
    }
    sent
}

/// Asks `total` answered questions from a socket bound to `from`, `rate` a second, each
/// under an id of its own, and waits up to [`DEADLINE`] past the last for their answers;
/// returns the ids left unanswered.
fn ask_paced(from: SocketAddr, to: SocketAddr, rate: u32, total: u16) -> Vec<u16> {
    let socket = UdpSocket::bind(from).unwrap();
    socket.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let receiver = socket.try_clone().unwrap();
    let asking = std::sync::atomic::AtomicBool::new(true);
    let answered = std::thread::scope(|scope| {
        let collect = scope.spawn(|| {
            let mut answered = HashSet::new();
            let mut buf = [0; 512];
            let mut last = None::<std::time::Instant>;
            loop {
                if let Ok(len) = receiver.recv(&mut buf) {
                    answered.insert(u16::from_be_bytes([buf[0], buf[1]]));
                    assert!(len > HEADER_LEN);
                }
                if answered.len() == usize::from(total) {
                    return answered;
                }
                if !asking.load(Ordering::Relaxed) {
                    let since = *last.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() > DEADLINE {
                        return answered;
                    }
                }
            }
        });
        let start = std::time::Instant::now();
        let period = Duration::from_secs(1) / rate;
        for id in 0..total {
            let at = start + period * u32::from(id);
            std::thread::sleep(at.saturating_duration_since(std::time::Instant::now()));
            socket.send_to(&dns_query(id, &format!("q{id}.other.test")), to).unwrap();
        }
        asking.store(false, Ordering::Relaxed);
        collect.join().unwrap()
    });
    (0..total).filter(|id| !answered.contains(id)).collect()
}

#[test]
fn one_client_flooding_with_slow_queries_does_not_starve_another() {
    // One pod sends 5,000 queries a second that the upstream never
    // answers (each holds its place for the 2 s upstream timeout: 10,000 would be in flight,
    // beyond the 4,096 of the whole forwarder); another pod asks at 100/s and loses none.
    in_netns("fwd", test_path!(), |ns| {
        const FLOOD: Duration = Duration::from_secs(4);
        let family = v4();
        set_up(ns);
        start_upstream(family.upstream);
        let forwarder = serve(family, Options::default());
        let other: SocketAddr = OTHER_CLIENT.parse().unwrap();

        let (flooded, lost) = std::thread::scope(|scope| {
            let flood =
                scope.spawn(move || flood_silent(family.client, family.link_local, 5000, FLOOD));
            // The other pod asks once the flood has had a second to fill what it can.
            std::thread::sleep(Duration::from_secs(1));
            let lost = ask_paced(other, family.link_local, 100, 300);
            (flood.join().unwrap(), lost)
        });
        let totals = forwarder.counters.totals();
        eprintln!("flooder sent {flooded}; the other client lost {}; {totals:?}", lost.len());
        // The namespace's UDP counters say whether a socket's buffer overflowed (RcvbufErrors).
        let snmp = std::fs::read_to_string("/proc/net/snmp").unwrap();
        let udp: Vec<&str> = snmp.lines().filter(|line| line.starts_with("Udp:")).collect();
        assert!(lost.is_empty(), "{} of 300 lost (ids {lost:?}); {totals:?}; {udp:?}", lost.len());
        assert!(totals.udp_answers >= 300, "{totals:?}");
    });
}

#[test]
fn a_client_at_its_share_of_connections_is_closed_and_another_client_is_relayed() {
    in_netns("fwd", test_path!(), |ns| {
        let family = v4();
        set_up(ns);
        start_upstream(family.upstream);
        let options = Options { max_connections_per_client: 2, ..Options::default() };
        let forwarder = serve(family, options);
        let ask = |stream: &mut TcpStream, id| {
            let sent = query(id, ANSWER);
            write_framed(stream, &sent).ok()?;
            read_framed(stream).ok().filter(|answer| *answer == answer_to(&sent))
        };

        let mut first = tcp_client(family);
        let mut second = tcp_client(family);
        assert!(ask(&mut first, 1).is_some() && ask(&mut second, 2).is_some());
        let mut third = tcp_client(family);
        let mut buf = [0; 16];
        assert_eq!(third.read(&mut buf).expect("the end of the connection"), 0);
        let want = Totals {
            tcp_connections: 2,
            dropped_busy: 1,
            dropped_over_share: 1,
            ..Totals::default()
        };
        forwarder.wait_for(want);

        // Another client has a share of its own.
        let mut other = tcp_client_from(OTHER_CLIENT.parse().unwrap(), family);
        assert!(ask(&mut other, 3).is_some(), "another client's connection is relayed");

        // Once one of the first client's connections has ended, its share serves another.
        write_framed(&mut first, &query(4, CLOSE)).unwrap();
        assert_eq!(first.read(&mut buf).expect("the end of the connection"), 0);
        let served = testkit::poll(DEADLINE, || ask(&mut tcp_client(family), 5));
        assert!(served.is_some(), "no connection served after the first ended");
    });
}

#[test]
fn a_client_s_share_of_udp_queries_comes_back_when_they_end() {
    // Two silent queries take a client's share of 2; its third is dropped while another
    // client is served. Once the two expire, the share serves the first client again.
    in_netns("fwd", test_path!(), |ns| {
        let family = v4();
        set_up(ns);
        start_upstream(family.upstream);
        let options = Options {
            max_in_flight_per_client: 2,
            upstream_timeout: Duration::from_millis(500),
            ..Options::default()
        };
        let forwarder = serve(family, options);
        let mut buf = [0; 512];

        let client = udp_client(family);
        client.send_to(&query(1, SILENT), family.link_local).unwrap();
        client.send_to(&query(2, SILENT), family.link_local).unwrap();
        forwarder.wait_for(Totals { udp_queries: 2, ..Totals::default() });
        client.send_to(&query(3, ANSWER), family.link_local).unwrap();
        let mut want =
            Totals { udp_queries: 2, dropped_busy: 1, dropped_over_share: 1, ..Totals::default() };
        forwarder.wait_for(want);

        let other = UdpSocket::bind(OTHER_CLIENT).unwrap();
        other.set_read_timeout(Some(DEADLINE)).unwrap();
        let sent = query(4, ANSWER);
        other.send_to(&sent, family.link_local).unwrap();
        let len = other.recv(&mut buf).expect("another client's answer");
        assert_eq!(&buf[..len], answer_to(&sent));

        (want.udp_queries, want.udp_answers, want.upstream_failures) = (3, 1, 2);
        forwarder.wait_for(want);
        let sent = query(5, ANSWER);
        client.send_to(&sent, family.link_local).unwrap();
        let len = client.recv(&mut buf).expect("an answer once the share came back");
        assert_eq!(&buf[..len], answer_to(&sent));
        forwarder.wait_for(Totals { udp_queries: 4, udp_answers: 2, ..want });
    });
}

#[test]
fn sockets_to_the_upstream_are_redialled_and_answers_on_the_old_ones_still_arrive() {
    // A socket connected once keeps one conntrack entry, and kube-proxy's
    // choice of an endpoint with it, for the agent's life. The test is the upstream: it sees
    // the source ports, and answers a query only after its socket has been replaced.
    in_netns("fwd", test_path!(), |ns| {
        const REDIAL: Duration = Duration::from_millis(200);
        let family = v4();
        set_up(ns);
        let upstream = UdpSocket::bind(family.upstream).unwrap();
        upstream.set_read_timeout(Some(DEADLINE)).unwrap();
        let options = Options {
            upstream_redial: REDIAL,
            upstream_timeout: Duration::from_secs(4),
            ..Options::default()
        };
        let forwarder = serve(family, options);
        let mut buf = [0; 512];

        let held = udp_client(family);
        let first = dns_query(1, "held.test");
        held.send_to(&first, family.link_local).unwrap();
        let (len, old_socket) = upstream.recv_from(&mut buf).expect("the held query");
        let late = answer_to(&buf[..len]);

        // Other queries, answered at once, for two periods: every socket has been replaced
        // by then (the first re-dials come within one period of the start).
        let client = udp_client(family);
        let mut sources = HashSet::from([old_socket]);
        let start = std::time::Instant::now();
        let mut id = 2;
        while start.elapsed() < REDIAL * 2 {
            let sent = dns_query(id, &format!("q{id}.test"));
            client.send_to(&sent, family.link_local).unwrap();
            let (len, from) = upstream.recv_from(&mut buf).expect("a query");
            sources.insert(from);
            upstream.send_to(&answer_to(&buf[..len]), from).unwrap();
            let len = client.recv(&mut buf).expect("an answer");
            assert_eq!(&buf[..len], answer_to(&sent));
            id += 1;
        }
        let redials = forwarder.counters.totals().upstream_redials;
        assert!(redials >= super::upstream::SOCKETS as u64, "{redials} re-dials");
        assert!(sources.len() > super::upstream::SOCKETS, "sources {sources:?}");

        // The held query's socket is draining: its answer still reaches the client.
        upstream.send_to(&late, old_socket).unwrap();
        let len = held.recv(&mut buf).expect("the answer on the replaced socket");
        assert_eq!(&buf[..len], answer_to(&first));
        let answered = u64::from(id - 1);
        forwarder.wait_for(Totals {
            udp_queries: answered,
            udp_answers: answered,
            ..Totals::default()
        });
        eprintln!("{redials} re-dials, {} sources, {answered} answered", sources.len());
    });
}

#[test]
fn an_idle_forwarder_keeps_only_the_pools_sockets_and_redials_only_what_it_used() {
    // A replaced socket with nothing pending on it goes at once, not after the upstream's
    // timeout: an idle forwarder held a second socket per slot for good (the flapping-cache
    // chaos test saw the agent's descriptors grow by two). And a socket that carried no query
    // is not replaced (it has no conntrack entry to renew): the re-dials of an idle forwarder
    // were two wake-ups a second of an idle agent.
    in_netns("fwd", test_path!(), |ns| {
        const REDIAL: Duration = Duration::from_millis(50);
        let family = v4();
        set_up(ns);
        let upstream = UdpSocket::bind(family.upstream).unwrap();
        upstream.set_read_timeout(Some(DEADLINE)).unwrap();
        let options = Options {
            upstream_redial: REDIAL,
            upstream_timeout: Duration::from_secs(60),
            ..Options::default()
        };
        let forwarder = serve(family, options);
        let redials = || forwarder.counters.totals().upstream_redials;
        // Ten periods untouched: nothing to renew.
        std::thread::sleep(REDIAL * 10);
        assert_eq!(redials(), 0, "an unused socket was re-dialled");

        // One query, answered: its socket, and it alone, is replaced once.
        let client = udp_client(family);
        let mut buf = [0; 512];
        client.send_to(&dns_query(1, "one.test"), family.link_local).unwrap();
        let (len, from) = upstream.recv_from(&mut buf).expect("the query");
        upstream.send_to(&answer_to(&buf[..len]), from).unwrap();
        client.recv(&mut buf).expect("its answer");
        let redialled = testkit::poll(DEADLINE, || (redials() >= 1).then_some(()));
        assert!(redialled.is_some(), "the used socket is re-dialled");
        std::thread::sleep(REDIAL * 10);
        assert_eq!(redials(), 1, "only the used socket is re-dialled, once");
        // A look may fall between the new socket's connect and the old one's close.
        let pool = testkit::poll(DEADLINE, || {
            (sockets_connected_to(family.upstream) == super::upstream::SOCKETS).then_some(())
        });
        let held = sockets_connected_to(family.upstream);
        assert!(pool.is_some(), "{held} sockets to the upstream after {} re-dials", redials());
    });
}

/// How many UDP sockets of this thread's network namespace are connected to `peer` (IPv4).
fn sockets_connected_to(peer: SocketAddr) -> usize {
    let SocketAddr::V4(peer) = peer else { unreachable!("an IPv4 upstream") };
    let remote = format!("{:08X}:{:04X}", u32::from_ne_bytes(peer.ip().octets()), peer.port());
    let table = std::fs::read_to_string("/proc/thread-self/net/udp").unwrap();
    table.lines().skip(1).filter(|line| line.split_whitespace().nth(2) == Some(&*remote)).count()
}
