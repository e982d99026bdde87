//! Entry points for the fuzz targets in `fuzz/`: every parser that reads bytes from outside the
//! agent — the kernel (netlink, sock_diag, rtnetlink), other programs (iptables-save), the
//! network (DNS replies), root on the node (control requests, the override file, flags). Each
//! must turn any input into a value or an error, never a panic; where a parser promises more, it
//! is asserted.
//!
//! Compiled only with `--cfg fuzzing`, which `cargo fuzz` passes.

use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use hickory_proto::op::Query;
use hickory_proto::rr::{Name, RecordType};

use crate::addresses::ifaddr;
use crate::dataplane::nftables::{changes::announced, objects};
use crate::netlink;
use crate::ruleset::{ListenAddrs, Route, RuleSet};

/// A netlink buffer as the nftables socket receives it: acks, errors, dumped tables, chains and
/// rules, change announcements.
pub fn nftables_netlink(data: &[u8]) {
    for message in netlink::messages(data).take(64) {
        let Ok(message) = message else { break };
        let _ = message.error_code();
        if let Ok((_generation, body)) = objects::nft_body(&message) {
            let _ = match objects::nft_type(&message) {
                Some(objects::NFT_MSG_NEWTABLE) => objects::parse_table(body).map(drop),
                Some(objects::NFT_MSG_NEWCHAIN) => objects::parse_chain(body).map(drop),
                _ => objects::parse_rule(body).map(drop),
            };
            // Another owner's rule, decoded and judged like the node's firewall is.
            if let Ok((chain, rule)) = objects::parse_foreign_rule(body) {
                let table = crate::firewall::Table {
                    family: 1,
                    name: "fuzz".to_owned(),
                    chains: vec![crate::firewall::Chain {
                        name: chain,
                        hook: Some((crate::firewall::HOOK_INPUT, 0)),
                        policy: Some(crate::firewall::NF_ACCEPT),
                        rules: vec![rule.clone(), rule],
                    }],
                };
                let _ = crate::firewall::blocking(
                    &[table],
                    &[IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10))],
                    &[crate::firewall::PodSource {
                        iface: "cni0".to_owned(),
                        net: IpAddr::V4(Ipv4Addr::new(10, 244, 0, 0)),
                        prefix_len: 16,
                    }],
                );
            }
        }
    }
    let _ = announced(data, None);
    let _ = announced(data, Some(1));
}

/// A sock_diag buffer: a destroy announcement (at most one closed socket per 16-byte netlink
/// header), and the same bytes as a part of a dump of listening sockets.
pub fn sock_diag(data: &[u8]) {
    let closed = crate::sockdiag::parse(data);
    assert!(
        closed.len() <= data.len() / 16,
        "{} sockets out of {} bytes",
        closed.len(),
        data.len()
    );
    let addrs = [IpAddr::V4(Ipv4Addr::new(169, 254, 20, 10))];
    for socket in closed {
        let _ = socket.is_listener_on(&addrs, 53);
    }
    // The answer to a request for one socket's queue, for any request number.
    let seq = data.first().copied().map_or(0, u32::from);
    let _ = crate::sockdiag::parse_socket_answer(data, seq);
    for protocol in [libc::IPPROTO_TCP as u8, libc::IPPROTO_UDP as u8] {
        if let Ok((listeners, _done)) = crate::sockdiag::parse_dump(data, protocol) {
            assert!(listeners.len() <= data.len() / 16, "{} listeners", listeners.len());
        }
    }
}

/// An rtnetlink buffer as the address socket receives it: a part of a dump of addresses, an
/// acknowledgement or a refusal (as the answer to the sequence number of its first message, so
/// that the fuzzer reaches past the filter). Every address read can be deleted: the request
/// built for it reads back as the same address.
pub fn rtnetlink_addresses(data: &[u8]) {
    let seq = netlink::ne_u32(data, 8).unwrap_or_default();
    let mut answer = ifaddr::Answer::default();
    let _ = ifaddr::read_answer(data, seq, &mut answer);
    // A message is at least a header, an ifaddrmsg and an address attribute.
    assert!(answer.addresses.len() <= data.len() / 32, "{} addresses", answer.addresses.len());
    let listen = [IpAddr::V4(Ipv4Addr::new(169, 254, 20, 10))];
    for address in &answer.addresses {
        for protos_kept in [false, true] {
            let _ = crate::addresses::is_ours(address, protos_kept, &listen);
        }
        let request = ifaddr::delete_request(address, 1);
        let back = ifaddr::parse_address(&request[netlink::NLMSG_HDRLEN..])
            .expect("a delete request reads back")
            .expect("of a known family");
        assert_eq!(
            (back.index, back.local, back.address, back.prefix_len),
            (address.index, address.local, address.address, address.prefix_len)
        );
    }
}

/// `iptables-save` output, read for both tables and compared with the agent's rules.
pub fn iptables_save(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let addrs = ListenAddrs {
        local: vec![IpAddr::V4(Ipv4Addr::new(169, 254, 20, 10))],
        cluster_dns: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10))],
    };
    for route in [Route::Local, Route::Upstream] {
        let rules = RuleSet::desired(&addrs, route).with_accepts(&addrs);
        crate::dataplane::iptables::fuzz_saved(text, &rules);
    }
}

/// A DNS reply to the probe's query (`who.test. A`, id taken from the reply itself so that the
/// fuzzer reaches past the id check). Anything accepted must really be a reply to that query.
pub fn dns_reply(data: &[u8]) {
    let id = data.get(..2).map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let name = Name::from_str("who.test.").expect("a valid name");
    let question = Query::query(name, RecordType::A);
    if crate::probe::classify_reply(id, &question, data).is_some() {
        assert!(data.len() >= 12, "a reply shorter than a DNS header was accepted");
        assert!(data[2] & 0x80 != 0, "a query (QR=0) was taken for a reply");
    }
    let _ = crate::probe::classify_reply(id.wrapping_add(1), &question, data);
}

/// A DNS message from the network through the link-local forwarder's table of queries in
/// flight: as a client's query, its own bytes under the table's id answer it; as the upstream's
/// answer, taken or not, the table stays consistent (`forwarder::fuzz_message`).
pub fn forwarder_message(data: &[u8]) {
    crate::forwarder::fuzz_message(data);
}

/// One control-socket request line.
pub fn control_request(data: &[u8]) {
    let _ = serde_json::from_slice::<crate::control::Request>(data);
}

/// The override file in the state directory, read as the agent reads it at start.
pub fn override_file(data: &[u8]) {
    let _ = crate::overrides::parse(std::path::Path::new("override.json"), data);
}

/// A duration as flags and environment variables give it (`100ms`, `2s`, `1m30s`).
pub fn duration(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if crate::config::parse_duration(text).is_some() {
        assert!(text.chars().any(|c| c.is_ascii_digit()), "{text:?} has no number");
    }
}
