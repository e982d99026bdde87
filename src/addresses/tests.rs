//! The copies' messages against what iproute2 sends and the kernel lists, the ownership rule as a
//! table, and the copies on a real kernel in fresh network namespaces.

use std::net::IpAddr;

use super::ifaddr::{
    copy_request, delete_request, parse_address, read_answer, Address, Answer, AF_INET, AF_INET6,
    IFA_ADDRESS, IFA_CACHEINFO, IFA_FLAGS, IFA_F_DEPRECATED, IFA_F_NODAD, IFA_F_NOPREFIXROUTE,
    IFA_LABEL, IFA_LOCAL, IFA_PROTO, RTM_DELADDR, RTM_NEWADDR, RT_SCOPE_HOST,
};
use super::*;
use crate::netlink::{attr, Message, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NLM_F_DUMP_INTR};

const V4: &str = "169.254.20.10";
const V6: &str = "fd00:169:254::10";

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// An address as the kernel lists it (attributes in the kernel's order, checked on 6.18).
fn listed(
    index: u32,
    local: &str,
    prefix_len: u8,
    label: Option<&str>,
    proto: Option<u8>,
) -> Vec<u8> {
    let local = ip(local);
    let (family, octets) = match local {
        IpAddr::V4(v4) => (AF_INET, v4.octets().to_vec()),
        IpAddr::V6(v6) => (AF_INET6, v6.octets().to_vec()),
    };
    let mut payload = vec![family, prefix_len, 0x80, 0];
    payload.extend_from_slice(&index.to_ne_bytes());
    payload.extend(attr(IFA_ADDRESS, &octets));
    if family == AF_INET {
        payload.extend(attr(IFA_LOCAL, &octets));
    }
    if let Some(label) = label {
        payload.extend(attr(IFA_LABEL, &[label.as_bytes(), &[0]].concat()));
    }
    payload.extend(attr(IFA_FLAGS, &0x80u32.to_ne_bytes()));
    payload.extend(attr(IFA_CACHEINFO, &[0xff; 16]));
    if let Some(proto) = proto {
        payload.extend(attr(IFA_PROTO, &[proto]));
    }
    payload
}

fn message(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    Message { kind, flags, seq, portid: 0, payload }.encode()
}

fn address(index: u32, local: &str, label: Option<&str>, proto: Option<u8>) -> Address {
    let local = ip(local);
    Address {
        index,
        local,
        address: local,
        prefix_len: if local.is_ipv4() { 32 } else { 128 },
        scope: 0,
        flags: 0,
        label: label.map(str::to_owned),
        proto,
    }
}

/// `ip addr add 169.254.20.10/32 dev lo label lo:nlha scope host` and
/// `ip addr add fd00:169:254::10/128 dev lo nodad noprefixroute preferred_lft 0 valid_lft forever`
/// as iproute2 6.1 sent them (strace, x86-64), headers aside: ours add `IFA_PROTO` only.
#[cfg(target_endian = "little")]
#[test]
fn copy_requests_are_what_ip_sends_plus_the_protocol() {
    let ip_v4: &[u8] = b"\x02\x20\x00\xfe\x01\x00\x00\x00\x08\x00\x02\x00\xa9\xfe\x14\x0a\
        \x0c\x00\x03\x00\x6c\x6f\x3a\x6e\x6c\x68\x61\x00\x08\x00\x01\x00\xa9\xfe\x14\x0a";
    let ip_v6: &[u8] = b"\x0a\x80\x00\x00\x01\x00\x00\x00\x14\x00\x02\x00\xfd\x00\x01\x69\
        \x02\x54\x00\x00\x00\x00\x00\x00\x00\x00\x00\x10\x08\x00\x08\x00\x02\x02\x00\x00\
        \x14\x00\x01\x00\xfd\x00\x01\x69\x02\x54\x00\x00\x00\x00\x00\x00\x00\x00\x00\x10\
        \x14\x00\x06\x00\x00\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00\x00\x00\x00\x00";
    let proto = attr(IFA_PROTO, &[0x6e]);
    for (copy, sent) in [(V4, ip_v4), (V6, ip_v6)] {
        let request = copy_request(ip(copy), 7);
        let message = crate::netlink::messages(&request).next().unwrap().unwrap();
        assert_eq!(message.kind, RTM_NEWADDR);
        // NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE, as `ip addr add`.
        assert_eq!((message.flags, message.seq), (0x605, 7), "{copy}");
        assert_eq!(message.payload, [sent, &proto].concat(), "{copy}");
    }
}

/// `ip addr del 169.254.20.10/32 dev lo label lo:nlha` and `ip addr del fd00:169:254::10/128
/// dev lo`, as iproute2 6.1 sent them.
#[cfg(target_endian = "little")]
#[test]
fn delete_requests_are_what_ip_sends() {
    let ip_v4: &[u8] = b"\x02\x20\x00\x00\x01\x00\x00\x00\x08\x00\x02\x00\xa9\xfe\x14\x0a\
        \x0c\x00\x03\x00\x6c\x6f\x3a\x6e\x6c\x68\x61\x00\x08\x00\x01\x00\xa9\xfe\x14\x0a";
    let ip_v6: &[u8] = b"\x0a\x80\x00\x00\x01\x00\x00\x00\x14\x00\x02\x00\xfd\x00\x01\x69\
        \x02\x54\x00\x00\x00\x00\x00\x00\x00\x00\x00\x10\x14\x00\x01\x00\xfd\x00\x01\x69\
        \x02\x54\x00\x00\x00\x00\x00\x00\x00\x00\x00\x10";
    // The label goes with an IPv4 address only (the kernel keeps none for IPv6).
    for (copy, sent) in
        [(address(1, V4, Some(LABEL), None), ip_v4), (address(1, V6, Some("x"), None), ip_v6)]
    {
        let request = delete_request(&copy, 3);
        let message = crate::netlink::messages(&request).next().unwrap().unwrap();
        assert_eq!((message.kind, message.flags), (RTM_DELADDR, 0x5), "{copy:?}");
        assert_eq!(message.payload, sent, "{copy:?}");
    }
    // A label longer than the kernel keeps is left out of the match, not cut.
    let long = Address { label: Some("x".repeat(16)), ..address(1, V4, None, None) };
    let request = delete_request(&long, 3);
    assert_eq!(parse_address(&request[NLMSG_HDRLEN..]).unwrap().unwrap().label, None);
}

#[test]
fn a_copy_request_reads_back_as_the_copy() {
    let v4 = parse_address(&copy_request(ip(V4), 1)[NLMSG_HDRLEN..]).unwrap().unwrap();
    let want = Address {
        scope: RT_SCOPE_HOST,
        label: Some(LABEL.to_owned()),
        proto: Some(PROTO),
        ..address(1, V4, None, None)
    };
    assert_eq!(v4, want);
    let v6 = parse_address(&copy_request(ip(V6), 1)[NLMSG_HDRLEN..]).unwrap().unwrap();
    let flags = IFA_F_NODAD | IFA_F_NOPREFIXROUTE;
    assert_eq!(v6, Address { flags, proto: Some(PROTO), ..address(1, V6, None, None) });
    // What the kernel does with an address it deletes, read back the same way.
    let deleted = parse_address(&delete_request(&v4, 1)[NLMSG_HDRLEN..]).unwrap().unwrap();
    assert_eq!(
        (deleted.local, deleted.label.as_deref(), deleted.prefix_len),
        (ip(V4), Some(LABEL), 32)
    );
}

#[test]
fn a_dump_is_read_across_datagrams_until_done() {
    let first = [
        message(RTM_NEWADDR, 2, 9, &listed(1, "127.0.0.1", 8, Some("lo"), None)),
        // A message of another exchange, and an interface message: skipped.
        message(RTM_NEWADDR, 2, 8, &listed(1, "10.9.9.9", 32, Some("lo"), None)),
        message(16, 2, 9, &[0; 16]),
        // A family the agent does not know (AF_PACKET): skipped.
        message(RTM_NEWADDR, 2, 9, &[17, 0, 0, 0, 1, 0, 0, 0]),
    ]
    .concat();
    let second = [
        message(RTM_NEWADDR, 2, 9, &listed(1, "::1", 128, None, Some(1))),
        message(RTM_NEWADDR, 2, 9, &listed(1, V4, 32, Some(LABEL), Some(PROTO))),
        message(NLMSG_DONE, 2, 9, &0i32.to_ne_bytes()),
        // After the end: ignored.
        message(RTM_NEWADDR, 2, 9, &listed(1, "10.9.9.9", 32, Some("lo"), None)),
    ]
    .concat();
    let mut answer = Answer::default();
    read_answer(&first, 9, &mut answer).unwrap();
    assert_eq!(answer.outcome, None, "no NLMSG_DONE yet");
    read_answer(&second, 9, &mut answer).unwrap();
    assert_eq!(answer.outcome, Some(Ok(())));
    assert!(!answer.interrupted);
    let read: Vec<_> = answer
        .addresses
        .iter()
        .map(|a| (a.local, a.prefix_len, a.label.as_deref(), a.proto))
        .collect();
    assert_eq!(
        read,
        [
            (ip("127.0.0.1"), 8, Some("lo"), None),
            (ip("::1"), 128, None, Some(1)),
            (ip(V4), 32, Some(LABEL), Some(PROTO)),
        ]
    );
    assert_eq!(answer.addresses[0].flags, 0x80, "IFA_FLAGS");
}

/// A dump 6.18 sent (fuzz/seeds): 127.0.0.1, the agent's IPv4 copy, 10.0.0.1 added by `ip`,
/// the IPv6 copy, `::1`; then an `EEXIST` for a copy added twice.
#[cfg(target_endian = "little")]
#[test]
fn a_real_dump_and_refusal_read_as_the_kernel_meant_them() {
    let dump = include_bytes!("../../fuzz/seeds/rtnetlink_addresses/dump-lo-copies.bin");
    let mut answer = Answer::default();
    read_answer(dump, 4, &mut answer).unwrap();
    assert_eq!(answer.outcome, Some(Ok(())));
    let read: Vec<_> =
        answer.addresses.iter().map(|a| (a.local, a.scope, a.label.as_deref(), a.proto)).collect();
    assert_eq!(
        read,
        [
            (ip("127.0.0.1"), RT_SCOPE_HOST, Some("lo"), None),
            (ip(V4), RT_SCOPE_HOST, Some(LABEL), Some(PROTO)),
            (ip("10.0.0.1"), 0, Some("lo"), None),
            (ip(V6), 0, None, Some(PROTO)),
            (ip("::1"), RT_SCOPE_HOST, None, Some(1)),
        ]
    );
    // IFA_F_PERMANENT | IFA_F_DEPRECATED | IFA_F_NODAD | IFA_F_NOPREFIXROUTE.
    assert_eq!(
        answer.addresses[3].flags,
        0x80 | IFA_F_DEPRECATED | IFA_F_NODAD | IFA_F_NOPREFIXROUTE
    );
    let mine: Vec<IpAddr> = ours(&answer.addresses, &[]).iter().map(|a| a.local).collect();
    assert_eq!(mine, [ip(V4), ip(V6)]);

    let eexist = include_bytes!("../../fuzz/seeds/rtnetlink_addresses/eexist.bin");
    let mut answer = Answer::default();
    read_answer(eexist, 3, &mut answer).unwrap();
    assert_eq!(answer.outcome, Some(Err(17)));
}

#[test]
fn refusals_interruptions_and_bad_messages() {
    let answer_to = |buf: &[u8]| {
        let mut answer = Answer::default();
        read_answer(buf, 4, &mut answer).map(|()| answer)
    };
    let refused =
        answer_to(&message(NLMSG_ERROR, 0, 4, &[(-17i32).to_ne_bytes(), [0; 4]].concat()));
    assert_eq!(refused.unwrap().outcome, Some(Err(17)));
    assert_eq!(answer_to(&message(NLMSG_ERROR, 0, 4, &[0; 20])).unwrap().outcome, Some(Ok(())));
    // A dump that failed half-way, and one the kernel flags as interrupted.
    assert_eq!(
        answer_to(&message(NLMSG_DONE, 2, 4, &(-4i32).to_ne_bytes())).unwrap().outcome,
        Some(Err(4))
    );
    let interrupted = [
        message(RTM_NEWADDR, 2 | NLM_F_DUMP_INTR, 4, &listed(1, V4, 32, None, None)),
        message(NLMSG_DONE, 2, 4, &[]),
    ]
    .concat();
    let interrupted = answer_to(&interrupted).unwrap();
    assert!(interrupted.interrupted);
    assert_eq!(interrupted.outcome, Some(Ok(())), "an empty NLMSG_DONE ends the dump");

    let mut wide_proto = listed(1, V4, 32, None, None);
    wide_proto.extend(attr(IFA_PROTO, &[1, 2]));
    let mut short_address = vec![AF_INET, 32, 0, 0, 1, 0, 0, 0];
    short_address.extend(attr(IFA_LOCAL, &[169, 254, 20]));
    let mut v6_in_v4 = vec![AF_INET, 32, 0, 0, 1, 0, 0, 0];
    v6_in_v4.extend(attr(IFA_ADDRESS, &[0; 16]));
    let mut cut_attribute = listed(1, V4, 32, None, None);
    cut_attribute.extend([40, 0, 3, 0, b'l', b'o']);
    for (what, payload) in [
        ("a two-byte IFA_PROTO", wide_proto),
        ("a three-byte address", short_address),
        ("an IPv6 address in an IPv4 message", v6_in_v4),
        ("no address at all", vec![AF_INET6, 128, 0, 0, 1, 0, 0, 0]),
        ("a cut ifaddrmsg", vec![AF_INET, 32, 0]),
        ("an attribute running past the message", cut_attribute),
    ] {
        let err = answer_to(&message(RTM_NEWADDR, 2, 4, &payload));
        assert!(err.is_err(), "{what}: {err:?}");
    }
    assert!(answer_to(&message(NLMSG_ERROR, 0, 4, &[1, 2])).is_err(), "a cut error message");
    assert!(answer_to(&message(NLMSG_ERROR, 0, 4, &[])[..10]).is_err(), "a cut header");
}

#[test]
fn ownership_is_the_protocol_where_the_kernel_keeps_it() {
    let listen = [ip(V4), ip(V6)];
    let plain = address(LOOPBACK_INDEX, V4, Some("lo"), None);
    let cases = [
        // (address, protocols kept, ours)
        (address(1, V4, Some(LABEL), Some(PROTO)), true, true),
        (address(1, V6, None, Some(PROTO)), true, true),
        (address(1, "10.0.0.1", Some("lo"), Some(PROTO)), true, true),
        (address(2, V4, Some(LABEL), Some(PROTO)), true, false),
        (address(1, V4, Some(LABEL), Some(3)), true, false),
        (plain.clone(), true, false),
        (address(1, V4, Some(LABEL), None), true, false),
        (address(1, V6, None, None), true, false),
        // A kernel before 5.18: a listen IP on lo, or the agent's label.
        (plain.clone(), false, true),
        (address(1, V6, None, None), false, true),
        (address(1, "169.254.20.11", Some(LABEL), None), false, true),
        (address(1, "169.254.20.11", Some("lo"), None), false, false),
        (address(1, "fd00::11", None, None), false, false),
        (address(2, V4, Some(LABEL), None), false, false),
    ];
    for (address, kept, want) in cases {
        assert_eq!(is_ours(&address, kept, &listen), want, "{address:?}, kept {kept}");
    }
    // A listen IP given as IPv4-mapped IPv6 is the IPv4 address.
    assert!(is_ours(&plain, false, &[ip("::ffff:169.254.20.10")]));
    // Whether protocols are kept is read from the whole dump: `::1` has one from 5.18 on.
    let loopback6 = address(1, "::1", None, Some(1));
    assert_eq!(ours(&[plain.clone(), loopback6.clone()], &listen), Vec::<&Address>::new());
    assert_eq!(ours(&[plain.clone(), address(1, "::1", None, None)], &listen), [&plain]);
}

#[test]
fn missing_ips_are_those_no_address_on_lo_carries() {
    let listed = [
        address(1, "127.0.0.1", Some("lo"), None),
        // Anyone's address counts, whatever its prefix length.
        Address { prefix_len: 24, ..address(1, V4, Some("lo"), None) },
        // On another interface: does not count.
        address(2, V6, None, None),
    ];
    let ips = [ip(V4), ip(V6), ip("::ffff:169.254.20.11"), ip("169.254.20.11"), ip(V6)];
    assert_eq!(missing_on_lo(&listed, &ips), [ip(V6), ip("169.254.20.11")]);
    assert_eq!(missing_on_lo(&listed, &[]), Vec::<IpAddr>::new());
}

/// Real-kernel tests. Each runs in a fresh network namespace: the test binary runs the one test
/// again under `ip netns exec`, so no thread of the calling process ever changes namespace and
/// nothing here can touch the host's addresses.
mod kernel {
    use std::process::Command;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testutil::{in_netns, run, test_path};

    /// The namespace's prefix.
    const NS: &str = "nlha-addr";

    /// Brings the fresh namespace's `lo` up, as it is on every node, and checks its index.
    fn node_lo() {
        run("ip", &["link", "set", "lo", "up"]);
        let link = run("ip", &["-o", "link", "show", "lo"]);
        assert!(link.starts_with(&format!("{LOOPBACK_INDEX}: lo:")), "{link}");
    }

    /// The addresses on `lo` as the agent's own dump lists them, and whether the kernel kept
    /// protocols.
    fn on_lo() -> (Vec<Address>, bool) {
        let listed = Rtnl::open().unwrap().addresses().unwrap();
        let kept = listed.iter().any(|a| a.proto.is_some());
        (listed.into_iter().filter(|a| a.index == LOOPBACK_INDEX).collect(), kept)
    }

    fn find(ip_text: &str) -> Option<Address> {
        on_lo().0.into_iter().find(|a| a.local == ip(ip_text))
    }

    /// Whether this kernel should keep address protocols (`IFA_PROTO` came with 5.18, commit
    /// 47f0bd503210).
    fn kernel_keeps_protocols() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>());
        let version = (numbers.next().unwrap().unwrap(), numbers.next().unwrap().unwrap());
        version >= (5, 18)
    }

    /// `ip route get IP`: what the kernel would do with a packet to it, or why it cannot.
    fn route_get(ip: &str) -> String {
        let output = Command::new("ip").args(["route", "get", ip]).output().unwrap();
        let text = [output.stdout, output.stderr].concat();
        String::from_utf8(text).unwrap()
    }

    /// Whether `route`, what `ip route get IP` says, is the local route of `ip` on `lo`.
    fn local_on_lo(ip: &str, route: &str) -> bool {
        route.starts_with(&format!("local {ip} ")) && route.contains(" dev lo ")
    }

    /// `ip route get IP` once it says that IP is local, or after 5 s whatever it says then: the
    /// kernel acknowledges a new IPv6 address before a workqueue job inserts its local route.
    fn once_local(ip: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let route = route_get(ip);
            if local_on_lo(ip, &route) || Instant::now() > deadline {
                return route;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn ensure_adds_marked_copies_to_lo() {
        in_netns(NS, test_path!(), |_| {
            node_lo();
            assert_eq!(ensure(&[ip(V4), ip(V6)]).unwrap(), [ip(V4), ip(V6)]);
            let shown = run("ip", &["-d", "addr", "show", "dev", "lo"]);
            for want in [
                "inet 169.254.20.10/32 scope host lo:nlha",
                "inet6 fd00:169:254::10/128 scope global nodad deprecated noprefixroute",
            ] {
                assert!(shown.contains(want), "{want} not in\n{shown}");
            }
            let (listed, kept) = on_lo();
            assert_eq!(kept, kernel_keeps_protocols(), "{listed:?}");
            let copies: Vec<_> = listed.iter().filter(|a| a.proto == Some(PROTO)).collect();
            if kept {
                assert_eq!(copies.len(), 2, "{listed:?}");
            }
            let v6 = find(V6).unwrap();
            assert_eq!(v6.flags & (IFA_F_NODAD | IFA_F_DEPRECATED), IFA_F_NODAD | IFA_F_DEPRECATED);
            for copy in [V4, V6] {
                let route = once_local(copy);
                assert!(local_on_lo(copy, &route), "{route}");
            }
        });
    }

    /// The scope and the preferred lifetime: a copy never becomes the source of the node's
    /// traffic, where a plain `ip addr add` on lo does (the second half shows the test would
    /// see it).
    #[test]
    fn copies_are_never_chosen_as_a_source() {
        in_netns(NS, test_path!(), |_| {
            node_lo();
            // An interface without an IPv4 address (as Calico's veths) and the node's own IPv6
            // address on another one.
            run("ip", &["link", "add", "vx0", "type", "veth", "peer", "name", "vx1"]);
            for link in ["vx0", "vx1"] {
                run("ip", &["link", "set", link, "up"]);
            }
            run("ip", &["addr", "add", "2001:db8::1/128", "dev", "vx1", "nodad"]);
            run("ip", &["route", "add", "192.0.2.0/24", "dev", "vx0"]);
            run("ip", &["route", "add", "fd00:1::/64", "dev", "vx0"]);
            ensure(&[ip(V4), ip(V6)]).unwrap();
            let v4 = route_get("192.0.2.1");
            assert!(v4.starts_with("192.0.2.1 dev vx0") && !v4.contains(" src "), "{v4}");
            let v6 = route_get("fd00:1::1");
            assert!(v6.contains("src 2001:db8::1 "), "{v6}");

            run("ip", &["addr", "add", "169.254.20.11/32", "dev", "lo"]);
            run("ip", &["addr", "add", "fd00:169:254::11/128", "dev", "lo", "nodad"]);
            assert!(route_get("192.0.2.1").contains("src 169.254.20.11 "));
            assert!(route_get("fd00:1::1").contains("src fd00:169:254::11 "));
        });
    }

    #[test]
    fn ensure_is_idempotent_and_takes_over_nothing() {
        in_netns(NS, test_path!(), |_| {
            node_lo();
            let ips = [ip(V4), ip(V6)];
            assert_eq!(ensure(&ips).unwrap().len(), 2);
            let before = run("ip", &["addr", "show", "dev", "lo"]);
            assert_eq!(ensure(&ips).unwrap(), Vec::<IpAddr>::new());
            assert_eq!(run("ip", &["addr", "show", "dev", "lo"]), before);

            // Someone's own addresses, one with another prefix length: present, and not made
            // the agent's, not even when the kernel is asked to add a copy over them (EEXIST).
            run("ip", &["addr", "add", "169.254.20.11/32", "dev", "lo"]);
            run("ip", &["addr", "add", "169.254.20.12/24", "dev", "lo"]);
            run("ip", &["addr", "add", "fd00:169:254::11/128", "dev", "lo", "nodad"]);
            let theirs = ["169.254.20.11", "169.254.20.12", "fd00:169:254::11"];
            assert_eq!(ensure(&theirs.map(ip)).unwrap(), Vec::<IpAddr>::new());
            let mut rtnl = Rtnl::open().unwrap();
            assert!(!rtnl.add_copy(ip("169.254.20.11")).unwrap(), "EEXIST is not an error");
            assert!(!rtnl.add_copy(ip("fd00:169:254::11")).unwrap(), "EEXIST is not an error");
            for address in theirs {
                let found = find(address).unwrap();
                assert_eq!(
                    (found.proto, found.label.filter(|l| l != "lo")),
                    (None, None),
                    "{address}"
                );
            }
        });
    }

    /// node-cache's teardown deletes its interface: with the agent's copies the IPs stay local,
    /// without them they do not (checked first), whether that interface was down or up.
    #[test]
    fn copies_keep_the_ips_local_when_node_cache_deletes_its_interface() {
        in_netns(NS, test_path!(), |_| {
            node_lo();
            let node_cache_up = |up: bool| {
                run(
                    "ip",
                    &["link", "add", "nodelocaldns", "type", "veth", "peer", "name", "nlpeer"],
                );
                run("ip", &["addr", "add", "169.254.20.10/32", "dev", "nodelocaldns"]);
                run("ip", &["addr", "add", "fd00:169:254::10/128", "dev", "nodelocaldns", "nodad"]);
                if up {
                    run("ip", &["link", "set", "nlpeer", "up"]);
                    run("ip", &["link", "set", "nodelocaldns", "up"]);
                }
            };
            for up in [false, true] {
                node_cache_up(up);
                for listen in [V4, V6] {
                    let route = once_local(listen);
                    assert!(local_on_lo(listen, &route), "{listen}, up {up}: {route}");
                }
                run("ip", &["link", "del", "nodelocaldns"]);
                for listen in [V4, V6] {
                    let gone = route_get(listen);
                    assert!(!gone.starts_with("local "), "{listen}, up {up}, no copy: {gone}");
                }

                node_cache_up(up);
                assert_eq!(ensure(&[ip(V4), ip(V6)]).unwrap(), [ip(V4), ip(V6)]);
                run("ip", &["link", "del", "nodelocaldns"]);
                for listen in [V4, V6] {
                    let kept = once_local(listen);
                    assert!(local_on_lo(listen, &kept), "up {up}: {kept}");
                }
                assert_eq!(remove_ours(&[ip(V4), ip(V6)]).unwrap().len(), 2);
            }
        });
    }

    #[test]
    fn remove_ours_removes_exactly_the_agents_copies() {
        in_netns(NS, test_path!(), |_| {
            node_lo();
            let listen = [ip(V4), ip(V6), ip("169.254.20.11")];
            ensure(&[ip(V4), ip(V6)]).unwrap();
            // Someone's: an address on lo, a listen IP put on lo by hand, the same IP on
            // another interface.
            run("ip", &["addr", "add", "10.0.0.1/32", "dev", "lo"]);
            run("ip", &["addr", "add", "169.254.20.11/32", "dev", "lo"]);
            run("ip", &["link", "add", "other", "type", "veth", "peer", "name", "otherpeer"]);
            run("ip", &["addr", "add", "169.254.20.10/32", "dev", "other"]);

            let mut removed = remove_ours(&listen).unwrap();
            removed.sort();
            let kept = kernel_keeps_protocols();
            // Before 5.18 a listen IP on lo is the agent's, whoever put it there.
            let want: Vec<IpAddr> = if kept { vec![ip(V4), ip(V6)] } else { listen.to_vec() };
            assert_eq!(removed, want);
            let left: Vec<IpAddr> = on_lo().0.iter().map(|a| a.local).collect();
            let mut want_left = vec![ip("127.0.0.1"), ip("10.0.0.1"), ip("::1")];
            if kept {
                want_left.insert(2, ip("169.254.20.11"));
            }
            assert_eq!(left, want_left);
            let other = run("ip", &["addr", "show", "dev", "other"]);
            assert!(other.contains("inet 169.254.20.10/32"), "{other}");
            assert_eq!(remove_ours(&listen).unwrap(), Vec::<IpAddr>::new(), "none left: Ok");
        });
    }

    #[test]
    fn missing_reports_a_copy_deleted_behind_its_back() {
        in_netns(NS, test_path!(), |_| {
            node_lo();
            let ips = [ip(V4), ip(V6)];
            assert_eq!(missing(&ips).unwrap(), ips);
            ensure(&ips).unwrap();
            assert_eq!(missing(&ips).unwrap(), Vec::<IpAddr>::new());
            run("ip", &["addr", "del", "169.254.20.10/32", "dev", "lo"]);
            assert_eq!(missing(&ips).unwrap(), [ip(V4)]);
            run("ip", &["addr", "del", "fd00:169:254::10/128", "dev", "lo"]);
            assert_eq!(missing(&ips).unwrap(), ips);
            assert_eq!(ensure(&ips).unwrap(), ips);
            assert_eq!(missing(&ips).unwrap(), Vec::<IpAddr>::new());
        });
    }
}
