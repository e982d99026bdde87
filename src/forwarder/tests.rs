use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use nix::sys::socket::ControlMessageOwned;
use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::tcp::{relay, Ended};
use super::udp::{answer_source_v4, answer_source_v6, destination};
use super::*;

#[test]
fn the_destination_is_the_packet_header_s_not_the_routing_one() {
    // What IP_PKTINFO reports for a TPROXYed packet: the header's destination in `ipi_addr`,
    // and in `ipi_spec_dst` the local address routing would pick.
    let received = libc::in_pktinfo {
        ipi_ifindex: 1,
        ipi_spec_dst: libc::in_addr { s_addr: u32::from_ne_bytes([127, 53, 0, 53]) },
        ipi_addr: libc::in_addr { s_addr: u32::from_ne_bytes([169, 254, 20, 10]) },
    };
    let link_local = Ipv4Addr::new(169, 254, 20, 10);
    assert_eq!(
        destination(&ControlMessageOwned::Ipv4PacketInfo(received)),
        Some(IpAddr::V4(link_local))
    );
    let v6: Ipv6Addr = "fd00:169:254::10".parse().unwrap();
    let received =
        libc::in6_pktinfo { ipi6_addr: libc::in6_addr { s6_addr: v6.octets() }, ipi6_ifindex: 1 };
    assert_eq!(destination(&ControlMessageOwned::Ipv6PacketInfo(received)), Some(IpAddr::V6(v6)));
    assert_eq!(destination(&ControlMessageOwned::Ipv4Ttl(64)), None);
}

#[test]
fn the_answer_s_source_goes_where_the_kernel_reads_it() {
    // IPv4 takes an outgoing source from `ipi_spec_dst`; `ipi_addr` is ignored on the way out.
    let info = answer_source_v4(Ipv4Addr::new(169, 254, 20, 10));
    assert_eq!(info.ipi_spec_dst.s_addr.to_ne_bytes(), [169, 254, 20, 10]);
    assert_eq!((info.ipi_ifindex, info.ipi_addr.s_addr), (0, 0));
    let v6: Ipv6Addr = "fd00:169:254::10".parse().unwrap();
    let info = answer_source_v6(v6);
    assert_eq!((info.ipi6_addr.s6_addr, info.ipi6_ifindex), (v6.octets(), 0));
}

#[test]
fn errors_say_what_failed_on_what_and_what_to_do() {
    // The kernel's words come from the C library (glibc and musl differ).
    let listen: SocketAddr = "127.53.0.53:53".parse().unwrap();
    let refused = io::Error::from_raw_os_error(libc::EPERM);
    let why = refused.to_string();
    let error = Error::Transparent {
        listen,
        transport: Transport::Udp,
        option: "IP_TRANSPARENT",
        source: refused,
    };
    assert_eq!(
        error.to_string(),
        format!(
            "setting IP_TRANSPARENT on the forwarder's udp socket for 127.53.0.53:53 failed: \
             {why} (the agent needs CAP_NET_ADMIN)"
        )
    );
    let taken = io::Error::from_raw_os_error(libc::EADDRINUSE);
    let why = taken.to_string();
    let error =
        Error::Bind { listen, transport: Transport::Tcp, option: "IP_TRANSPARENT", source: taken };
    assert_eq!(
        error.to_string(),
        format!(
            "binding 127.53.0.53:53 (tcp, IP_TRANSPARENT) failed: {why} (EACCES: port 53 \
             needs CAP_NET_BIND_SERVICE; EADDRINUSE: another process, or another agent, is \
             bound there, and the forwarder's address must be its own)"
        )
    );
    assert!(std::error::Error::source(&error).is_some(), "the kernel's error is kept");
    // Only a missing privilege lets the agent run on without the link-local forwarder.
    assert!(!error.is_permission());
    let denied = io::Error::from_raw_os_error(libc::EACCES);
    let error =
        Error::Bind { listen, transport: Transport::Udp, option: "IP_TRANSPARENT", source: denied };
    assert!(error.is_permission());
}

/// The relay's idle timeout in its tests (on a paused clock).
const IDLE: Duration = Duration::from_secs(10);

#[tokio::test(start_paused = true)]
async fn a_relay_passes_bytes_both_ways_and_closes_the_client_when_the_upstream_closes() {
    let (mut client, client_far) = duplex(1024);
    let (upstream_near, mut upstream) = duplex(1024);
    let relayed = tokio::spawn(relay(client_far, upstream_near, IDLE));
    let mut buf = [0; 16];

    client.write_all(b"\x00\x05query").await.unwrap();
    upstream.read_exact(&mut buf[..7]).await.unwrap();
    assert_eq!(&buf[..7], b"\x00\x05query");
    upstream.write_all(b"\x00\x06answer").await.unwrap();
    client.read_exact(&mut buf[..8]).await.unwrap();
    assert_eq!(&buf[..8], b"\x00\x06answer");

    drop(upstream);
    assert!(matches!(relayed.await.unwrap(), Ended::UpstreamClosed));
    assert_eq!(client.read(&mut buf).await.unwrap(), 0, "the client sees the end");
}

#[tokio::test(start_paused = true)]
async fn a_client_that_closes_its_side_still_gets_the_answer() {
    let (mut client, client_far) = duplex(1024);
    let (upstream_near, mut upstream) = duplex(1024);
    let relayed = tokio::spawn(relay(client_far, upstream_near, IDLE));

    client.write_all(b"query").await.unwrap();
    client.shutdown().await.unwrap();
    let mut query = Vec::new();
    upstream.read_to_end(&mut query).await.unwrap();
    assert_eq!(query, b"query", "the query, then the client's end passed on");
    upstream.write_all(b"answer").await.unwrap();
    drop(upstream);
    let mut answer = Vec::new();
    client.read_to_end(&mut answer).await.unwrap();
    assert_eq!(answer, b"answer");
    assert!(matches!(relayed.await.unwrap(), Ended::UpstreamClosed));
}

#[tokio::test(start_paused = true)]
async fn a_relay_ends_after_the_idle_timeout_counted_from_the_last_bytes() {
    let (mut client, client_far) = duplex(1024);
    let (upstream_near, mut upstream) = duplex(1024);
    let start = Instant::now();
    let relayed = tokio::spawn(relay(client_far, upstream_near, IDLE));
    tokio::time::sleep(IDLE / 2).await;
    client.write_all(b"query").await.unwrap();
    let mut buf = [0; 5];
    upstream.read_exact(&mut buf).await.unwrap();
    assert!(matches!(relayed.await.unwrap(), Ended::Idle));
    assert_eq!(start.elapsed(), IDLE / 2 + IDLE);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_reads_nothing_is_closed_after_the_idle_timeout() {
    // The client's direction holds 16 bytes; the upstream sends more, which the relay cannot
    // write while the client does not read.
    let (_client, client_far) = duplex(16);
    let (upstream_near, mut upstream) = duplex(1024);
    let start = Instant::now();
    let relayed = tokio::spawn(relay(client_far, upstream_near, IDLE));
    upstream.write_all(&[7; 64]).await.unwrap();
    assert!(matches!(relayed.await.unwrap(), Ended::Idle));
    assert_eq!(start.elapsed(), IDLE);
}

/// A datagram of its own length and bytes for each `at`: the first 12 bytes long, every next
/// one 13 bytes longer, each byte its index. (Small: a burst of 40 must fit a socket's default
/// receive buffer.)
fn burst_datagram(at: usize) -> Vec<u8> {
    vec![u8::try_from(at).unwrap(); 12 + at * 13]
}

#[test]
fn a_burst_larger_than_a_batch_is_received_and_sent_whole_each_datagram_in_its_own_slot() {
    use std::io::ErrorKind;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    use super::udp::{receive, Buffers, BATCH};
    use super::upstream::{receive_batch, send_batch, Outgoing};
    crate::testutil::in_netns("fwd", crate::testutil::test_path!(), |ns| {
        crate::testutil::run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        let total = BATCH + 8;
        let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
        setsockopt(&listener, sockopt::Ipv4PacketInfo, &true).unwrap();
        listener.set_nonblocking(true).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        for at in 0..total {
            client.send_to(&burst_datagram(at), listener.local_addr().unwrap()).unwrap();
        }

        // The listener's receive: a batch, then the rest, then nothing.
        let mut buffers = Buffers::new();
        let mut received = Vec::new();
        let mut got = Vec::new();
        for want in [BATCH, total - BATCH] {
            receive(listener.as_raw_fd(), &mut buffers, &mut received).unwrap();
            assert_eq!(received.len(), want, "datagrams in one call");
            for (slot, datagram) in received.iter().enumerate() {
                assert!(!datagram.truncated);
                assert_eq!(datagram.client, Some(client.local_addr().unwrap()));
                assert_eq!(datagram.destination, Some("127.0.0.1".parse().unwrap()));
                got.push(buffers.slot(slot)[..datagram.len].to_vec());
            }
        }
        let empty = receive(listener.as_raw_fd(), &mut buffers, &mut received);
        assert_eq!(empty.unwrap_err().kind(), ErrorKind::WouldBlock);
        assert_eq!(got, (0..total).map(burst_datagram).collect::<Vec<_>>());

        // The upstream side: a batch sent from slots in another order (the last first) on a
        // connected socket, and read back with the upstream socket's receive.
        let upstream = UdpSocket::bind("127.0.0.1:0").unwrap();
        upstream.set_nonblocking(true).unwrap();
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        sender.connect(upstream.local_addr().unwrap()).unwrap();
        let mut outgoing = Vec::new();
        for (at, slot) in (0..BATCH).rev().enumerate() {
            let datagram = burst_datagram(at);
            buffers.slot_mut(slot)[..datagram.len()].copy_from_slice(&datagram);
            outgoing.push(Outgoing { slot, len: datagram.len(), id: 0 });
        }
        let extra = Outgoing { slot: 0, len: 12, id: 0 };
        outgoing.push(extra);
        let sent = send_batch(sender.as_raw_fd(), &buffers, &outgoing).unwrap();
        assert_eq!(sent, BATCH, "one call sends a batch at most");
        let mut lengths = Vec::new();
        receive_batch(upstream.as_raw_fd(), &mut buffers, &mut lengths).unwrap();
        let got: Vec<Vec<u8>> = lengths
            .iter()
            .enumerate()
            .map(|(slot, &len)| buffers.slot(slot)[..len].to_vec())
            .collect();
        assert_eq!(got, (0..BATCH).map(burst_datagram).collect::<Vec<_>>());
    });
}

#[test]
fn a_client_holds_its_share_and_no_more_and_its_entry_goes_when_it_holds_nothing() {
    let (a, b): (IpAddr, IpAddr) = ("10.244.0.5".parse().unwrap(), "10.244.0.6".parse().unwrap());
    let shares = Shares::new(2);
    let mut held = shares.lock();
    assert_eq!([held.take(a), held.take(a), held.take(a)], [true, true, false]);
    assert!(held.take(b), "another client has a share of its own");
    held.give_back(a);
    assert!(held.take(a), "a share given back is taken again");
    // Giving back what a client does not hold changes nothing (never below 0).
    held.give_back("10.244.0.7".parse().unwrap());
    drop(held);
    assert_eq!(shares.clients(), 2);
    let mut held = shares.lock();
    for _ in 0..2 {
        held.give_back(a);
    }
    held.give_back(b);
    drop(held);
    assert_eq!(shares.clients(), 0, "a client that holds nothing has no entry");
}

#[test]
fn the_shares_never_hold_more_entries_than_clients_holding_something() {
    // Many clients come and go, one query each: the map stays at what is held at once.
    let shares = Shares::new(256);
    let mut held = shares.lock();
    for n in 0..100_000u32 {
        let client = IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + n));
        assert!(held.take(client));
        if n >= 16 {
            held.give_back(IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + n - 16)));
        }
        assert!(held.held.len() <= 17);
    }
}

#[test]
fn a_tcp_share_is_given_back_when_its_connection_ends() {
    let client: IpAddr = "fd00:244::5".parse().unwrap();
    let shares = Arc::new(Shares::new(1));
    let first = shares.take_owned(client).expect("a share");
    assert!(shares.take_owned(client).is_none(), "at its share");
    drop(first);
    assert!(shares.take_owned(client).is_some(), "given back on drop");
    assert_eq!(shares.clients(), 0);
}
