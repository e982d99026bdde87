//! Tests of the link-local fallback in the iptables backends: mangle `PREROUTING` →
//! `NODELOCALDNS-HA-FALLBACK`, written by the switching backend beside its raw chains. First on
//! plain data (which table holds what, the comparison), then the real kernel with both flavours,
//! each test in a network namespace of its own (the harness and fixtures are `tests.rs`'s):
//! installed exactly as `iptables-save` prints it, tampered with and repaired, switched, left
//! behind by an agent that knew only raw, removed; and packets: a query reaches the cache while
//! its socket is there and the forwarder's transparent socket otherwise, the agent's probes
//! (from 127.0.0.1) never the forwarder.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};

use super::table::Family;
use super::tests::kernel::{
    both_flavours, chain_rules, differs, ipt, ours, save, JUMP_PREROUTING, WAIT,
};
use super::tests::{addrs, dual_stack, ipv4, save_text, saved_of};
use super::text::{combine, compare, parse_save, render_family, unstorable_comment, wanted, State};
use super::*;
use crate::forwarder::lease::{self, Lease};
use crate::ruleset::{Route, RuleSet, FORWARDER_V4};
use crate::testutil::{in_netns, run, test_path};

const JUMP_FALLBACK: &str =
    "-A PREROUTING -m comment --comment nodelocaldns-ha -j NODELOCALDNS-HA-FALLBACK";

/// `args` for iptables, on the mangle table.
fn in_mangle<'a>(args: &[&'a str]) -> Vec<&'a str> {
    [&["-t", "mangle"], args].concat()
}

/// `family`'s rules of the fallback chain, as `iptables-save` prints them.
fn fallback_rules(rules: &RuleSet, family: Family) -> Vec<String> {
    let wanted = wanted(rules, Table::Mangle, family).expect("a fallback chain");
    assert_eq!(wanted.chains.len(), 1);
    wanted.chains[0].rules.clone()
}

#[test]
fn the_fallback_goes_to_mangle_and_the_notrack_chains_to_raw() {
    let local = RuleSet::desired(&dual_stack(), Route::Local);
    let mangle = fallback_rules(&local, Family::V4);
    assert_eq!(
        mangle[..4],
        [
            // The forwarder's heartbeat renews its lease (`forwarder::lease`), and stops here;
            // only from the node itself (lo), whatever source address a pod's packet claims.
            "-A NODELOCALDNS-HA-FALLBACK -s 127.0.0.1/32 -d 169.254.20.10/32 -i lo -p udp -m udp \
             --dport 9 -m recent --set --name nodelocaldns-ha --mask 255.255.255.255 --rdest -m \
             comment --comment \"the forwarder\\'s lease\" -j DROP",
            "-A NODELOCALDNS-HA-FALLBACK -s 127.0.0.1/32 -d 169.254.20.10/32 -p udp -m udp \
             --dport 53 -m comment --comment \"the agent\\'s probes to the cache\" -j ACCEPT",
            "-A NODELOCALDNS-HA-FALLBACK -d 169.254.20.10/32 -p udp -m udp --dport 53 -m addrtype \
             --dst-type LOCAL -m socket -m comment --comment \"to cache while it listens\" -j ACCEPT",
            // Only under the forwarder's lease (xt_TPROXY drops what no socket takes).
            "-A NODELOCALDNS-HA-FALLBACK -d 169.254.20.10/32 -p udp -m udp --dport 53 -m recent \
             --rcheck --seconds 1 --name nodelocaldns-ha --mask 255.255.255.255 --rdest -m \
             comment --comment \"to the agent\\'s forwarder\" -j TPROXY --on-port 53 --on-ip \
             127.53.0.53 --tproxy-mark 0x0/0x0",
        ]
    );
    assert_eq!(mangle.len(), 7, "a heartbeat, then udp and tcp");
    let v6 = fallback_rules(&local, Family::V6);
    assert!(v6[0].starts_with(
        "-A NODELOCALDNS-HA-FALLBACK -s ::1/128 -d fd00:169:254::10/128 -i lo -p udp "
    ));
    assert!(
        v6[3].ends_with("-j TPROXY --on-port 53 --on-ip fd00:169:254::53 --tproxy-mark 0x0/0x0")
    );
    // Upstream: no socket guard; the heartbeat, the probes' ACCEPT and the TPROXY stay.
    let upstream = fallback_rules(&RuleSet::desired(&dual_stack(), Route::Upstream), Family::V4);
    assert_eq!(upstream, [&*mangle[0], &mangle[1], &mangle[3], &mangle[4], &mangle[6]]);
    // Raw holds no ACCEPT and no TPROXY (its NOTRACKs, and the pins to conntrack); the ACCEPT
    // backend no mangle chain.
    let raw = wanted(&local, Table::Raw, Family::V4).unwrap();
    let notrack_or_pin = |r: &&String| r.ends_with("-j NOTRACK") || r.ends_with("-j CT");
    assert!(raw.chains.iter().flat_map(|c| &c.rules).all(|r| notrack_or_pin(&r)));
    assert!(!render(&local.clone().with_accepts(&dual_stack()), Role::Accepts).contains("mangle"));
    // No link-local IP, no fallback chain: the family's mangle must hold nothing of ours.
    let clusterip_only = RuleSet::desired(&addrs(&[], &["10.96.0.10"]), Route::Local);
    assert_eq!(wanted(&clusterip_only, Table::Mangle, Family::V4), None);
    assert!(!render(&clusterip_only, Role::Switch).contains("*mangle"));
    // A comment iptables cannot store is caught in the table it goes to.
    let mut long = local.clone();
    long.chains.iter_mut().find(|c| c.is_fallback()).unwrap().rules[0].comment = "x".repeat(256);
    assert_eq!(unstorable_comment(&long, Table::Mangle).map(str::len), Some(256));
    assert_eq!(unstorable_comment(&long, Table::Raw), None);
}

#[test]
fn the_mangle_chain_is_compared_like_the_raw_ones() {
    let local = RuleSet::desired(&ipv4(), Route::Local);
    let want = wanted(&local, Table::Mangle, Family::V4);
    let state = |saved| compare(Table::Mangle, Family::V4, &saved, want.as_ref());
    assert_eq!(state(saved_of(&local, Table::Mangle, Family::V4, &[])), State::Matches);
    // Calico's mangle jump, inserted in front of the agent's.
    let calico = "-A PREROUTING -m comment --comment \"cali:fake\" -j cali-PREROUTING";
    let mut text = save_text(&local, Table::Mangle, Family::V4, &[]);
    text = text.replacen(JUMP_FALLBACK, &format!("{calico}\n{JUMP_FALLBACK}"), 1);
    text = text.replacen(":NODELOCALDNS", ":cali-PREROUTING - [0:0]\n:NODELOCALDNS", 1);
    assert_eq!(
        state(parse_save(&text, "mangle").unwrap()),
        State::Differs(format!(
            "IPv4 mangle PREROUTING: first rule is `{calico}`, not the agent's jump"
        ))
    );
    // Upstream's chain is two rules short of Local's.
    let upstream = RuleSet::desired(&ipv4(), Route::Upstream);
    assert_eq!(
        state(saved_of(&upstream, Table::Mangle, Family::V4, &[])),
        State::Differs("IPv4 mangle NODELOCALDNS-HA-FALLBACK: 5 rules, want 7".to_owned())
    );
    // An agent that wrote raw only (before the fallback) is told apart from one with nothing.
    let (v4, v6) = (Family::V4, Family::V6);
    let raw_only = vec![
        (v4, Table::Raw, true, State::Matches),
        (v4, Table::Mangle, true, State::Nothing),
        (v6, Table::Raw, false, State::Nothing),
        (v6, Table::Mangle, false, State::Nothing),
    ];
    assert_eq!(
        combine(raw_only),
        Check::Differs("IPv4 mangle: nothing of the agent's is installed".to_owned())
    );
    // Mangle alone is something of the agent's too: a backend no longer in use that holds only
    // its fallback chain is a leftover, not `Missing`.
    let mangle_only =
        vec![(v4, Table::Raw, true, State::Nothing), (v4, Table::Mangle, true, State::Matches)];
    assert_eq!(
        combine(mangle_only),
        Check::Differs("IPv4 raw: nothing of the agent's is installed".to_owned())
    );
}

/// The real kernel, both flavours.
mod kernel {
    use super::*;

    both_flavours!(
        fallback_apply_check_tamper_repair_remove,
        a_refused_mangle_section_leaves_the_raw_switch_in,
        the_fallback_trial_leaves_nothing_and_a_refusal_says_so,
        queries_follow_the_cache_socket_and_probes_never_reach_the_forwarder,
        an_established_forwarder_connection_stays_when_the_cache_returns,
    );
}

fn fallback_apply_check_tamper_repair_remove(ns: &str, flavour: Flavour) {
    let local = RuleSet::desired(&dual_stack(), Route::Local);
    let upstream = RuleSet::desired(&dual_stack(), Route::Upstream);
    let mut switch = Iptables::new(flavour, Role::Switch, WAIT).unwrap();

    // Local: each family's mangle exactly the rendering (what iptables-save prints), jump first
    // and alone; raw beside it.
    switch.apply(&local).unwrap();
    assert_eq!(switch.check(&local).unwrap(), Check::Matches);
    for family in Family::ALL {
        let text = save(ns, flavour, family, Table::Mangle);
        let want = render_family(Table::Mangle, &wanted(&local, Table::Mangle, family).unwrap());
        assert_eq!(ours(&text), want, "{family:?}:\n{text}");
        assert_eq!(chain_rules(&text, "PREROUTING"), [JUMP_FALLBACK]);
        let raw = save(ns, flavour, family, Table::Raw);
        assert_eq!(chain_rules(&raw, "PREROUTING"), [JUMP_PREROUTING]);
    }

    // A rule of the chain deleted by hand: seen, and put back.
    ipt(ns, flavour, Family::V6, &in_mangle(&["-D", "NODELOCALDNS-HA-FALLBACK", "2"]));
    assert_eq!(
        differs(switch.check(&local).unwrap()),
        "IPv6 mangle NODELOCALDNS-HA-FALLBACK: 6 rules, want 7"
    );
    switch.apply(&local).unwrap();
    assert_eq!(switch.check(&local).unwrap(), Check::Matches);

    // A rule inserted in front of the jump (a CNI's): seen, and the jump moved back to the top.
    ipt(ns, flavour, Family::V4, &in_mangle(&["-I", "PREROUTING", "1", "-j", "ACCEPT"]));
    assert_eq!(
        differs(switch.check(&local).unwrap()),
        "IPv4 mangle PREROUTING: first rule is `-A PREROUTING -j ACCEPT`, not the agent's jump"
    );
    if flavour == Flavour::Nft {
        // iptables-nft reads back only the tables announced changed: mangle is one of them.
        let (v4, v6) = (Family::V4.nfproto(), Family::V6.nfproto());
        let named = |family, name: &str| TableRef { family, name: name.to_owned() };
        let watched = switch.announced_tables().unwrap();
        assert!(watched.iter().any(|w| w.table == named(v4, "mangle")));
        let elsewhere = [named(v4, "raw"), named(v6, "mangle"), named(v4, "nat")];
        assert_eq!(switch.check_changed(&local, &elsewhere).unwrap(), Check::Matches);
        assert!(matches!(
            switch.check_changed(&local, &[named(v4, "mangle")]).unwrap(),
            Check::Differs(_)
        ));
    }
    switch.apply(&local).unwrap();
    let text = save(ns, flavour, Family::V4, Table::Mangle);
    assert_eq!(chain_rules(&text, "PREROUTING"), [JUMP_FALLBACK, "-A PREROUTING -j ACCEPT"]);

    // Upstream: the socket guard is gone in both families, the rest stays.
    switch.apply(&upstream).unwrap();
    assert_eq!(switch.check(&upstream).unwrap(), Check::Matches);
    for family in Family::ALL {
        let text = save(ns, flavour, family, Table::Mangle);
        let guards = text.lines().filter(|l| l.contains("-m socket")).count();
        assert_eq!(guards, 0, "{family:?}:\n{text}");
        let want = render_family(Table::Mangle, &wanted(&upstream, Table::Mangle, family).unwrap());
        assert_eq!(ours(&text), want, "{family:?}:\n{text}");
    }

    // An earlier agent's raw chains without the fallback: not taken for a match, and completed.
    ipt(ns, flavour, Family::V4, &in_mangle(&["-D", "PREROUTING", "-j", "ACCEPT"]));
    let jump = ["-m", "comment", "--comment", "nodelocaldns-ha", "-j", "NODELOCALDNS-HA-FALLBACK"];
    for family in Family::ALL {
        ipt(ns, flavour, family, &in_mangle(&[&["-D", "PREROUTING"], &jump[..]].concat()));
        ipt(ns, flavour, family, &in_mangle(&["-F", "NODELOCALDNS-HA-FALLBACK"]));
        ipt(ns, flavour, family, &in_mangle(&["-X", "NODELOCALDNS-HA-FALLBACK"]));
    }
    assert_eq!(
        differs(switch.check(&upstream).unwrap()),
        "IPv4 mangle: nothing of the agent's is installed"
    );
    switch.apply(&upstream).unwrap();
    assert_eq!(switch.check(&upstream).unwrap(), Check::Matches);

    // The fallback alone, raw gone: still the agent's, so a backend no longer in use that holds
    // only this is a leftover to empty, not `Missing`.
    for family in Family::ALL {
        for chain in
            ["PREROUTING", "OUTPUT", "NODELOCALDNS-HA-PREROUTING", "NODELOCALDNS-HA-OUTPUT"]
        {
            ipt(ns, flavour, family, &["-t", "raw", "-F", chain]);
        }
        for chain in ["NODELOCALDNS-HA-PREROUTING", "NODELOCALDNS-HA-OUTPUT"] {
            ipt(ns, flavour, family, &["-t", "raw", "-X", chain]);
        }
    }
    assert_eq!(
        differs(switch.check(&upstream).unwrap()),
        "IPv4 raw: nothing of the agent's is installed"
    );
    assert_ne!(switch.check(&local).unwrap(), Check::Missing);

    // Remove: nothing of ours in mangle (nor raw), a foreign mangle rule stays.
    ipt(ns, flavour, Family::V4, &in_mangle(&["-A", "PREROUTING", "-j", "ACCEPT"]));
    switch.remove().unwrap();
    switch.remove().unwrap();
    for family in Family::ALL {
        let text = save(ns, flavour, family, Table::Mangle);
        assert_eq!(ours(&text), "*mangle\nCOMMIT\n", "{family:?}:\n{text}");
        assert_eq!(ours(&save(ns, flavour, family, Table::Raw)), "*raw\nCOMMIT\n");
    }
    let text = save(ns, flavour, Family::V4, Table::Mangle);
    assert_eq!(chain_rules(&text, "PREROUTING"), ["-A PREROUTING -j ACCEPT"]);
    assert_eq!(switch.check(&local).unwrap(), Check::Missing);
}

/// A mangle section the kernel refuses (here: TPROXY, which works in `PREROUTING` only, made
/// reachable from `OUTPUT` by a foreign jump) does not hold back the raw section before it in
/// the same `iptables-restore`: the cluster-DNS switch is in, the fallback is not, and the next
/// apply, once the obstacle is gone, completes it.
fn a_refused_mangle_section_leaves_the_raw_switch_in(ns: &str, flavour: Flavour) {
    let local = RuleSet::desired(&ipv4(), Route::Local);
    ipt(ns, flavour, Family::V4, &in_mangle(&["-N", "NODELOCALDNS-HA-FALLBACK"]));
    ipt(ns, flavour, Family::V4, &in_mangle(&["-A", "OUTPUT", "-j", "NODELOCALDNS-HA-FALLBACK"]));
    let mut switch = Iptables::new(flavour, Role::Switch, WAIT).unwrap();

    let error = switch.apply(&local).unwrap_err();
    let crate::dataplane::Error::Iptables(Error::RestoreFailed { tables, .. }) = &error else {
        panic!("{error}")
    };
    assert_eq!(*tables, "the raw and mangle tables");
    let raw = save(ns, flavour, Family::V4, Table::Raw);
    let want = render_family(Table::Raw, &wanted(&local, Table::Raw, Family::V4).unwrap());
    assert_eq!(ours(&raw), want, "the raw section did not go in:\n{raw}");
    let text = save(ns, flavour, Family::V4, Table::Mangle);
    assert!(!text.contains("TPROXY") && chain_rules(&text, "PREROUTING").is_empty(), "{text}");

    ipt(ns, flavour, Family::V4, &in_mangle(&["-D", "OUTPUT", "-j", "NODELOCALDNS-HA-FALLBACK"]));
    switch.apply(&local).unwrap();
    assert_eq!(switch.check(&local).unwrap(), Check::Matches);
}

/// The trial of the fallback's rules leaves nothing in either family on a kernel that takes
/// them, a leftover trial chain included. One the kernel refuses (here: a trial chain that a
/// foreign rule in `OUTPUT` jumps to, where TPROXY may not run) is a refusal; the accepting-only
/// role tries nothing.
fn the_fallback_trial_leaves_nothing_and_a_refusal_says_so(ns: &str, flavour: Flavour) {
    let local = RuleSet::desired(&dual_stack(), Route::Local);
    let mut switch = Iptables::new(flavour, Role::Switch, WAIT).unwrap();
    ipt(ns, flavour, Family::V4, &in_mangle(&["-N", "NODELOCALDNS-HA-TRIAL"]));
    switch.trial(&local).unwrap();
    for family in Family::ALL {
        let text = save(ns, flavour, family, Table::Mangle);
        assert!(!text.contains("NODELOCALDNS-HA"), "{family:?}:\n{text}");
    }

    ipt(ns, flavour, Family::V4, &in_mangle(&["-N", "NODELOCALDNS-HA-TRIAL"]));
    ipt(ns, flavour, Family::V4, &in_mangle(&["-A", "OUTPUT", "-j", "NODELOCALDNS-HA-TRIAL"]));
    let error = switch.trial(&local).unwrap_err();
    assert!(error.is_refusal(), "{error}");
    let text = save(ns, flavour, Family::V4, Table::Mangle);
    assert!(!text.contains("TPROXY"), "{text}");

    let mut accepts = Iptables::new(flavour, Role::Accepts, WAIT).unwrap();
    accepts.trial(&local).unwrap();
}

/// A socket of `kind` bound to `at` with `IP_TRANSPARENT`, as the agent's forwarder binds: the
/// kind of socket TPROXY hands packets to.
fn transparent(kind: nix::sys::socket::SockType, at: SocketAddr) -> OwnedFd {
    use nix::sys::socket::{
        bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockaddrIn,
    };
    let SocketAddr::V4(at) = at else { panic!("{at}: IPv4 only") };
    let fd = socket(AddressFamily::Inet, kind, SockFlag::SOCK_CLOEXEC, None).unwrap();
    setsockopt(&fd, sockopt::IpTransparent, &true).unwrap();
    setsockopt(&fd, sockopt::ReuseAddr, &true).unwrap();
    bind(fd.as_raw_fd(), &SockaddrIn::from(at)).unwrap();
    fd
}

/// How long a socket waits for what a test expects.
const PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// A UDP socket bound to `at`, connected to the link-local IP's port 53.
fn client(at: &str) -> UdpSocket {
    let socket = UdpSocket::bind(at).unwrap();
    socket.connect("169.254.20.10:53").unwrap();
    socket.set_read_timeout(Some(PATIENCE)).unwrap();
    socket
}

/// The next datagram `socket` receives, and whom from.
fn received(socket: &UdpSocket) -> (String, SocketAddr) {
    socket.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut buf = [0; 64];
    let (n, from) = socket.recv_from(&mut buf).expect("a datagram");
    (String::from_utf8_lossy(&buf[..n]).into_owned(), from)
}

/// Whether a datagram is queued on `socket` (each query goes to one socket only, so once its
/// receiver has it, this is settled).
fn has_mail(socket: &UdpSocket) -> bool {
    socket.set_nonblocking(true).unwrap();
    let result = socket.recv(&mut [0; 64]);
    socket.set_nonblocking(false).unwrap();
    match result {
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(e) => panic!("{e}"),
    }
}

/// The fallback with real sockets, the link-local IP on `lo`: a pod's query (from the IP itself,
/// as a client in the namespace sends) goes to the cache while its socket is bound, and to the
/// forwarder's transparent socket at 127.53.0.53:53 once it is gone or the route is `Upstream`;
/// the agent's probes (from 127.0.0.1) reach the cache or are refused, never the forwarder.
fn queries_follow_the_cache_socket_and_probes_never_reach_the_forwarder(
    ns: &str,
    flavour: Flavour,
) {
    run("ip", &["-n", ns, "link", "set", "lo", "up"]);
    run("ip", &["-n", ns, "addr", "add", "169.254.20.10/32", "dev", "lo"]);
    let link_local = addrs(&["169.254.20.10"], &[]);
    let mut switch = Iptables::new(flavour, Role::Switch, WAIT).unwrap();
    switch.apply(&RuleSet::desired(&link_local, Route::Local)).unwrap();
    // The forwarder's lease, as its runtime renews it; each step below takes far less than
    // its second.
    let lease = Lease::new(&link_local.local).unwrap();
    lease.renew().unwrap();
    let forwarder =
        UdpSocket::from(transparent(nix::sys::socket::SockType::Datagram, FORWARDER_V4));
    let (pod, probe) = (client("0.0.0.0:0"), client("127.0.0.1:0"));

    // Local, the cache listening: both reach it.
    let cache = UdpSocket::bind("169.254.20.10:53").unwrap();
    pod.send(b"pod").unwrap();
    assert_eq!(received(&cache), ("pod".to_owned(), pod.local_addr().unwrap()));
    probe.send(b"probe").unwrap();
    assert_eq!(received(&cache), ("probe".to_owned(), probe.local_addr().unwrap()));
    assert!(!has_mail(&forwarder));

    // The cache gone: the pod's query is the forwarder's, the probe is refused.
    drop(cache);
    pod.send(b"pod").unwrap();
    assert_eq!(received(&forwarder), ("pod".to_owned(), pod.local_addr().unwrap()));
    probe.send(b"probe").unwrap();
    assert_eq!(probe.recv(&mut [0; 64]).unwrap_err().kind(), ErrorKind::ConnectionRefused);
    assert!(!has_mail(&forwarder), "a probe reached the forwarder");

    // Upstream (a hung cache still has its socket): pods go to the forwarder, probes to the cache.
    let cache = UdpSocket::bind("169.254.20.10:53").unwrap();
    switch.apply(&RuleSet::desired(&link_local, Route::Upstream)).unwrap();
    pod.send(b"pod").unwrap();
    assert_eq!(received(&forwarder).0, "pod");
    probe.send(b"probe").unwrap();
    assert_eq!(received(&cache).0, "probe");
    assert!(!has_mail(&cache) && !has_mail(&forwarder));

    // Back to Local.
    switch.apply(&RuleSet::desired(&link_local, Route::Local)).unwrap();
    pod.send(b"pod").unwrap();
    assert_eq!(received(&cache).0, "pod");
    assert!(!has_mail(&forwarder));

    // Upstream left behind by an agent that is gone (its forwarder's socket open or not): with
    // the lease ended, the pod's query goes on to the cache, as nftables' `tproxy` lets it.
    // Without the lease xt_TPROXY would take it (or drop it, once the forwarder has closed).
    switch.apply(&RuleSet::desired(&link_local, Route::Upstream)).unwrap();
    lease::release(&link_local.local);
    pod.send(b"pod").unwrap();
    assert_eq!(received(&cache).0, "pod");
    assert!(!has_mail(&forwarder), "TPROXY matched without the lease");
    drop(forwarder);
    pod.send(b"pod").unwrap();
    assert_eq!(received(&cache).0, "pod", "the cache cut off once the forwarder was gone");
    // And the kernel ends an unrenewed lease by itself: renewed, then left to lapse.
    let forwarder =
        UdpSocket::from(transparent(nix::sys::socket::SockType::Datagram, FORWARDER_V4));
    lease.renew().unwrap();
    pod.send(b"pod").unwrap();
    assert_eq!(received(&forwarder).0, "pod");
    // Queries until one reaches the cache: each arrives at the forwarder (taken there) or at
    // the cache (done), within the second the lease has left.
    let lapsed_by = std::time::Instant::now() + 5 * PATIENCE;
    loop {
        pod.send(b"pod").unwrap();
        cache.set_read_timeout(Some(std::time::Duration::from_millis(20))).unwrap();
        if cache.recv(&mut [0; 64]).is_ok() {
            break;
        }
        assert_eq!(received(&forwarder).0, "pod", "the query reached neither socket");
        assert!(std::time::Instant::now() < lapsed_by, "the unrenewed lease did not lapse");
    }
}

/// `listener.accept()`, giving up after [`PATIENCE`] (Linux honours `SO_RCVTIMEO` there).
fn accept(listener: &TcpListener) -> TcpStream {
    use nix::sys::socket::{setsockopt, sockopt::ReceiveTimeout};
    use nix::sys::time::TimeVal;
    let secs = i64::try_from(PATIENCE.as_secs()).unwrap();
    setsockopt(listener, ReceiveTimeout, &TimeVal::new(secs, 0)).unwrap();
    let (stream, _) = listener.accept().expect("a connection");
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream
}

fn read_text(stream: &mut TcpStream, len: usize) -> String {
    let mut buf = vec![0; len];
    stream.read_exact(&mut buf).unwrap();
    String::from_utf8(buf).unwrap()
}

/// xt_socket finds the forwarder's transparent connection sockets (local address the
/// link-local IP's port 53), where nftables' `socket transparent 0` leaves them out: the guard
/// ACCEPTs their segments, and the ordinary lookup delivers them to that same connection. So a
/// TCP connection that began while the cache was gone stays with the forwarder when the cache
/// comes back, and new ones go to the cache.
fn an_established_forwarder_connection_stays_when_the_cache_returns(ns: &str, flavour: Flavour) {
    use nix::sys::socket::{listen, Backlog, SockType};
    run("ip", &["-n", ns, "link", "set", "lo", "up"]);
    run("ip", &["-n", ns, "addr", "add", "169.254.20.10/32", "dev", "lo"]);
    let link_local = addrs(&["169.254.20.10"], &[]);
    let mut switch = Iptables::new(flavour, Role::Switch, WAIT).unwrap();
    switch.apply(&RuleSet::desired(&link_local, Route::Local)).unwrap();
    Lease::new(&link_local.local).unwrap().renew().unwrap();
    let forwarder = transparent(SockType::Stream, FORWARDER_V4);
    listen(&forwarder, Backlog::new(8).unwrap()).unwrap();
    let forwarder = TcpListener::from(forwarder);
    let link_local_53: SocketAddr = "169.254.20.10:53".parse().unwrap();

    // No cache: the pod's connection is the forwarder's, on a transparent socket of A:53.
    let mut pod = TcpStream::connect_timeout(&link_local_53, PATIENCE).unwrap();
    pod.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut at_forwarder = accept(&forwarder);
    assert_eq!(at_forwarder.local_addr().unwrap(), link_local_53);

    // The cache returns: the connection stays where it is, both ways; a new one is the cache's.
    let cache = TcpListener::bind(link_local_53).unwrap();
    pod.write_all(b"query").unwrap();
    assert_eq!(read_text(&mut at_forwarder, 5), "query");
    at_forwarder.write_all(b"answer").unwrap();
    assert_eq!(read_text(&mut pod, 6), "answer");
    let mut second = TcpStream::connect_timeout(&link_local_53, PATIENCE).unwrap();
    let mut at_cache = accept(&cache);
    second.write_all(b"again").unwrap();
    assert_eq!(read_text(&mut at_cache, 5), "again");
    pod.write_all(b"more").unwrap();
    assert_eq!(read_text(&mut at_forwarder, 4), "more");
}
