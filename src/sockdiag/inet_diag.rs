//! The sock_diag wire format the agent reads and writes: the kernel's `SOCK_DIAG_BY_FAMILY`
//! messages (an `inet_diag_msg` and attributes; `linux/inet_diag.h`), as destroy announcements
//! and as the answers to a dump, and the dump request itself.
//!
//! Pure: it works on receive buffers that [`crate::netlink`] cuts into messages, and never panics
//! on malformed input. Ports and addresses are big-endian, everything else host-endian.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::{ClosedSocket, Listener};
use crate::netlink::{
    align, attributes, messages, ne_u32, Message, NLMSG_DONE, NLMSG_ERROR, NLM_F_DUMP,
    NLM_F_REQUEST,
};
use crate::probe::Transport;

/// `SOCK_DIAG_BY_FAMILY`: the netlink message type of every destroy announcement, dump request
/// and dumped socket.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `sizeof(struct inet_diag_msg)`: 4 bytes of family/state/timer/retrans, a 48-byte
/// `inet_diag_sockid`, then expires, rqueue, wqueue, uid, inode (4 bytes each).
const INET_DIAG_MSG_LEN: usize = 72;
/// `sizeof(struct inet_diag_req_v2)`.
const INET_DIAG_REQ_V2_LEN: usize = 56;
/// `INET_DIAG_PROTOCOL`: a `u8` attribute with the socket's IP protocol.
const INET_DIAG_PROTOCOL: u16 = 10;

/// `IPPROTO_TCP`.
pub(super) const IPPROTO_TCP: u8 = 6;
/// `IPPROTO_UDP`.
pub(super) const IPPROTO_UDP: u8 = 17;
/// `AF_INET` as carried in `idiag_family`.
pub(super) const FAMILY_INET: u8 = 2;
/// `AF_INET6` as carried in `idiag_family`.
pub(super) const FAMILY_INET6: u8 = 10;
/// `TCP_CLOSE`: the state of an unconnected UDP socket.
pub(super) const STATE_CLOSE: u32 = 7;
/// `TCP_LISTEN`.
pub(super) const STATE_LISTEN: u32 = 10;

/// The fields of one `inet_diag_msg` the agent reads.
struct InetDiagMsg {
    state: u8,
    local: SocketAddr,
    remote: SocketAddr,
    cookie: u64,
}

/// Reads the `inet_diag_msg` at the start of a `SOCK_DIAG_BY_FAMILY` payload; `None` when it is
/// short or of another family than IPv4 and IPv6.
fn inet_diag_msg(payload: &[u8]) -> Option<InetDiagMsg> {
    let msg = payload.get(..INET_DIAG_MSG_LEN)?;
    let (local, remote) = match msg[0] {
        FAMILY_INET => (ipv4(&msg[8..24])?, ipv4(&msg[24..40])?),
        FAMILY_INET6 => (ipv6(&msg[8..24])?, ipv6(&msg[24..40])?),
        _ => return None,
    };
    let sport = u16::from_be_bytes([msg[4], msg[5]]);
    let dport = u16::from_be_bytes([msg[6], msg[7]]);
    // `idiag_cookie[2]`: the low half first.
    let cookie = u64::from(ne_u32(msg, 44)?) | u64::from(ne_u32(msg, 48)?) << 32;
    Some(InetDiagMsg {
        state: msg[1],
        local: SocketAddr::new(local, sport),
        remote: SocketAddr::new(remote, dport),
        cookie,
    })
}

fn ipv4(bytes: &[u8]) -> Option<IpAddr> {
    let octets: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    Some(IpAddr::V4(Ipv4Addr::from(octets)))
}

fn ipv6(bytes: &[u8]) -> Option<IpAddr> {
    let octets: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
    Some(IpAddr::V6(Ipv6Addr::from(octets)))
}

/// Parses one receive buffer: every well-formed TCP or UDP destroy announcement in it, in order.
/// The kernel sends one per datagram; several are accepted anyway. Other message types, other
/// protocols and malformed messages are skipped; a netlink header whose length runs past the
/// buffer ends the parse. Never panics.
pub fn parse(buf: &[u8]) -> Vec<ClosedSocket> {
    messages(buf)
        .map_while(Result::ok)
        .filter(|message| message.kind == SOCK_DIAG_BY_FAMILY)
        .filter_map(|message| closed_socket(message.payload))
        .collect()
}

/// Parses the payload of one destroy announcement: `inet_diag_msg` plus attributes.
fn closed_socket(payload: &[u8]) -> Option<ClosedSocket> {
    let msg = inet_diag_msg(payload)?;
    let transport = match protocol_attribute(payload.get(align(INET_DIAG_MSG_LEN)..)?)? {
        IPPROTO_TCP => Transport::Tcp,
        IPPROTO_UDP => Transport::Udp,
        _ => return None,
    };
    Some(ClosedSocket { transport, local: msg.local, remote: msg.remote, state: msg.state })
}

/// The value of the `INET_DIAG_PROTOCOL` attribute, if present and well-formed.
fn protocol_attribute(attrs: &[u8]) -> Option<u8> {
    attributes(attrs)
        .map_while(Result::ok)
        .find(|attr| attr.kind == INET_DIAG_PROTOCOL)
        .and_then(|attr| attr.value.first().copied())
}

/// One dump request: `nlmsghdr` and `inet_diag_req_v2` for `family`, `protocol` and the state
/// mask `states`, every socket id field zero (no filter: the kernel's port filter is not the same
/// on every version; the caller filters).
pub(super) fn dump_request(family: u8, protocol: u8, states: u32) -> Vec<u8> {
    let mut request = vec![0; INET_DIAG_REQ_V2_LEN];
    request[..4].copy_from_slice(&[family, protocol, 0, 0]);
    request[4..8].copy_from_slice(&states.to_ne_bytes());
    let flags = NLM_F_REQUEST | NLM_F_DUMP;
    Message { kind: SOCK_DIAG_BY_FAMILY, flags, seq: 1, portid: 0, payload: &request }.encode()
}

/// Where a message's `idiag_sport` (the socket's local port, network order) is, counted from
/// its `nlmsghdr` (16 bytes): after family, state, timer and retrans (4 bytes).
pub(super) const SPORT_IN_MESSAGE: u32 = 20;

/// `idiag_rqueue`'s offset in an `inet_diag_msg`: after family, state, timer and retrans (4
/// bytes), the socket id (48) and `idiag_expires` (4).
const RQUEUE_AT: usize = 56;

/// An exact request (no dump) for one UDP socket: the one bound to `local` and connected to
/// nobody, and only if its cookie is `cookie`. The kernel answers with that socket's
/// `inet_diag_msg`, `ESTALE` when another socket holds the address now, `ENOENT` when none does.
/// UDP's lookup reads the local address from the id's *destination* fields (`udp_dump_one`:
/// "src and dst are swapped for historical reasons"); the source stays 0.0.0.0:0.
pub(super) fn udp_socket_request(local: SocketAddr, cookie: u64, seq: u32) -> Vec<u8> {
    let mut request = vec![0; INET_DIAG_REQ_V2_LEN];
    let family = if local.is_ipv4() { FAMILY_INET } else { FAMILY_INET6 };
    request[..4].copy_from_slice(&[family, IPPROTO_UDP, 0, 0]);
    request[4..8].copy_from_slice(&(1u32 << STATE_CLOSE).to_ne_bytes());
    // The socket id at 8: sport, dport (big-endian), src[16], dst[16], if, cookie[2].
    request[10..12].copy_from_slice(&local.port().to_be_bytes());
    match local.ip() {
        IpAddr::V4(v4) => request[28..32].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => request[28..44].copy_from_slice(&v6.octets()),
    }
    // `idiag_cookie[2]`: the low half first.
    request[48..52].copy_from_slice(&(cookie as u32).to_ne_bytes());
    request[52..56].copy_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    Message { kind: SOCK_DIAG_BY_FAMILY, flags: NLM_F_REQUEST, seq, portid: 0, payload: &request }
        .encode()
}

/// What the kernel said to a request for one socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketAnswer {
    /// The socket's receive queue, in bytes (`idiag_rqueue`: for UDP, `sk_rmem_alloc`).
    Queued(u32),
    /// The kernel's error, positive (`ENOENT`, `ESTALE`, …).
    Errno(i32),
    /// Nothing in the buffer answers request `seq` (a late answer to an earlier one, garbage).
    Other,
}

/// Reads the answer to the socket request numbered `seq` in one receive buffer. Never panics.
pub fn parse_socket_answer(buf: &[u8], seq: u32) -> SocketAnswer {
    for message in messages(buf).map_while(Result::ok) {
        if message.seq != seq {
            continue;
        }
        match message.kind {
            NLMSG_ERROR => match message.error_code() {
                Ok(errno) if errno != 0 => return SocketAnswer::Errno(errno),
                _ => {}
            },
            SOCK_DIAG_BY_FAMILY => {
                if let Some(queued) = ne_u32(message.payload, RQUEUE_AT) {
                    return SocketAnswer::Queued(queued);
                }
            }
            _ => {}
        }
    }
    SocketAnswer::Other
}

/// Parses one datagram of a dump of `protocol` sockets: the sockets in it, and whether the dump
/// is complete (`NLMSG_DONE`). An `NLMSG_ERROR` is the kernel's error. Never panics.
pub fn parse_dump(buf: &[u8], protocol: u8) -> std::io::Result<(Vec<Listener>, bool)> {
    let transport = if protocol == IPPROTO_TCP { Transport::Tcp } else { Transport::Udp };
    let mut sockets = Vec::new();
    for message in messages(buf).map_while(Result::ok) {
        match message.kind {
            NLMSG_DONE => return Ok((sockets, true)),
            NLMSG_ERROR => {
                let errno = message.error_code().unwrap_or(0);
                return Err(std::io::Error::from_raw_os_error(errno));
            }
            SOCK_DIAG_BY_FAMILY => {
                if let Some(msg) = inet_diag_msg(message.payload) {
                    sockets.push(Listener { transport, local: msg.local, cookie: msg.cookie });
                }
            }
            _ => {}
        }
    }
    Ok((sockets, false))
}

/// Builds one destroy announcement as the kernel does: nlmsghdr, inet_diag_msg, attributes.
#[cfg(test)]
pub(super) fn announcement(
    family: u8,
    state: u8,
    protocol: Option<u8>,
    local: SocketAddr,
    remote: SocketAddr,
) -> Vec<u8> {
    let mut msg = vec![family, state, 0, 0];
    msg.extend_from_slice(&local.port().to_be_bytes());
    msg.extend_from_slice(&remote.port().to_be_bytes());
    for ip in [local.ip(), remote.ip()] {
        let mut field = [0u8; 16];
        match ip {
            IpAddr::V4(v4) => field[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => field.copy_from_slice(&v6.octets()),
        }
        msg.extend_from_slice(&field);
    }
    msg.extend_from_slice(&[0u8; 4]); // idiag_if
    msg.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]); // cookie
    msg.extend_from_slice(&[0u8; 20]); // expires .. inode
    assert_eq!(msg.len(), INET_DIAG_MSG_LEN);
    if let Some(protocol) = protocol {
        crate::netlink::put_attr(&mut msg, INET_DIAG_PROTOCOL, &[protocol]);
    }
    if protocol == Some(IPPROTO_TCP) {
        // INET_DIAG_INFO (tcp_info), as the kernel appends for TCP.
        crate::netlink::put_attr(&mut msg, 2, &[0u8; 8]);
    }
    Message { kind: SOCK_DIAG_BY_FAMILY, flags: 0, seq: 0, portid: 0, payload: &msg }.encode()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{ne_u16, NLMSG_HDRLEN};

    /// A netlink control message of `kind` with a 4-byte payload.
    fn control_message(kind: u16, payload: i32) -> Vec<u8> {
        Message { kind, flags: 0, seq: 0, portid: 0, payload: &payload.to_ne_bytes() }.encode()
    }

    #[test]
    fn a_dump_lists_sockets_with_their_cookies_until_done() {
        let local: SocketAddr = "169.254.20.10:53".parse().unwrap();
        let nobody: SocketAddr = "0.0.0.0:0".parse().unwrap();
        let mut buf = announcement(FAMILY_INET, 7, None, local, nobody);
        let (found, done) = parse_dump(&buf, IPPROTO_UDP).unwrap();
        assert_eq!(found, [Listener { transport: Transport::Udp, local, cookie: 3 }]);
        assert!(!done, "no NLMSG_DONE yet");
        buf.extend(control_message(NLMSG_DONE, 0));
        assert!(parse_dump(&buf, IPPROTO_UDP).unwrap().1);
        let err = parse_dump(&control_message(NLMSG_ERROR, -13), IPPROTO_TCP).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(13));
        // Truncated or garbage input: no panic, nothing found.
        for cut in 0..buf.len() {
            let _ = parse_dump(&buf[..cut], IPPROTO_TCP);
        }
    }

    #[test]
    fn the_dump_request_is_what_the_kernel_expects() {
        let request = dump_request(FAMILY_INET6, IPPROTO_TCP, 1 << STATE_LISTEN);
        assert_eq!(request.len(), NLMSG_HDRLEN + INET_DIAG_REQ_V2_LEN);
        assert_eq!(ne_u32(&request, 0), Some(request.len() as u32));
        assert_eq!(ne_u16(&request, 4), Some(SOCK_DIAG_BY_FAMILY));
        assert_eq!(ne_u16(&request, 6), Some(NLM_F_REQUEST | NLM_F_DUMP));
        assert_eq!(&request[16..20], &[FAMILY_INET6, IPPROTO_TCP, 0, 0]);
        assert_eq!(ne_u32(&request, 20), Some(1 << STATE_LISTEN));
    }

    #[test]
    fn a_socket_request_names_the_local_address_as_the_destination_and_the_cookie() {
        let request = udp_socket_request(addr("169.254.20.10:53"), 0x1122_3344_5566_7788, 9);
        assert_eq!(request.len(), NLMSG_HDRLEN + INET_DIAG_REQ_V2_LEN);
        assert_eq!(ne_u16(&request, 6), Some(NLM_F_REQUEST), "exact, not a dump");
        assert_eq!(ne_u32(&request, 8), Some(9));
        let req = &request[NLMSG_HDRLEN..];
        assert_eq!(&req[..4], &[FAMILY_INET, IPPROTO_UDP, 0, 0]);
        assert_eq!(&req[8..12], &[0, 0, 0, 53], "sport 0, dport 53");
        assert_eq!(&req[12..28], &[0; 16], "no source");
        assert_eq!(&req[28..32], &[169, 254, 20, 10]);
        assert_eq!((ne_u32(req, 48), ne_u32(req, 52)), (Some(0x5566_7788), Some(0x1122_3344)));
        let v6 = udp_socket_request(addr("[fd00:169:254::10]:53"), 1, 1);
        assert_eq!(&v6[NLMSG_HDRLEN..NLMSG_HDRLEN + 2], &[FAMILY_INET6, IPPROTO_UDP]);
        assert_eq!(v6[NLMSG_HDRLEN + 28..NLMSG_HDRLEN + 30], [0xfd, 0x00]);
    }

    #[test]
    fn a_socket_answer_is_its_queue_or_the_kernels_error() {
        let local = addr("169.254.20.10:53");
        let mut msg = announcement(FAMILY_INET, 7, None, local, addr("0.0.0.0:0"));
        // The announcement's header has seq 0; its idiag_rqueue is at RQUEUE_AT of the payload.
        msg[NLMSG_HDRLEN + RQUEUE_AT..NLMSG_HDRLEN + RQUEUE_AT + 4]
            .copy_from_slice(&1664u32.to_ne_bytes());
        assert_eq!(parse_socket_answer(&msg, 0), SocketAnswer::Queued(1664));
        assert_eq!(parse_socket_answer(&msg, 5), SocketAnswer::Other, "another request's");
        let stale = control_message(NLMSG_ERROR, -116);
        assert_eq!(parse_socket_answer(&stale, 0), SocketAnswer::Errno(116));
        assert_eq!(parse_socket_answer(&control_message(NLMSG_ERROR, 0), 0), SocketAnswer::Other);
        for cut in 0..msg.len() {
            let _ = parse_socket_answer(&msg[..cut], 0);
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A real announcement captured on 6.18: unconnected UDP socket on 127.0.0.1:46342.
    const CAPTURED_UDP4: &str = "6000000014000000000000000000000002070000b50600007f00000100\
        0000000000000000000000000000000000000000000000000000000000000001000000000000000000000000\
        000000ffffffff000000000000000005000a0011000000";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn captured_udp4_announcement() {
        let closed = parse(&unhex(CAPTURED_UDP4));
        assert_eq!(
            closed,
            vec![ClosedSocket {
                transport: Transport::Udp,
                local: addr("127.0.0.1:46342"),
                remote: addr("0.0.0.0:0"),
                state: 7,
            }]
        );
        assert!(closed[0].is_listener_on(&["127.0.0.1".parse().unwrap()], 46342));
    }

    #[test]
    fn udp4_server_socket() {
        let buf = announcement(
            FAMILY_INET,
            7,
            Some(IPPROTO_UDP),
            addr("169.254.20.10:53"),
            addr("0.0.0.0:0"),
        );
        let closed = parse(&buf);
        assert_eq!(closed.len(), 1);
        let socket = closed[0];
        assert_eq!(socket.transport, Transport::Udp);
        assert_eq!(socket.local, addr("169.254.20.10:53"));
        let cache: [IpAddr; 2] = ["169.254.20.10".parse().unwrap(), "10.96.0.10".parse().unwrap()];
        assert!(socket.is_listener_on(&cache, 53));
        assert!(!socket.is_listener_on(&cache, 5353));
        assert!(!socket.is_listener_on(&["10.96.0.10".parse().unwrap()], 53));
    }

    #[test]
    fn tcp6_listener_and_connections() {
        let cache: [IpAddr; 1] = ["fd00::10".parse().unwrap()];
        let listener =
            announcement(FAMILY_INET6, 7, Some(IPPROTO_TCP), addr("[fd00::10]:53"), addr("[::]:0"));
        let closed = parse(&listener);
        assert_eq!(closed.len(), 1);
        assert_eq!(closed[0].transport, Transport::Tcp);
        assert_eq!(closed[0].local, addr("[fd00::10]:53"));
        assert!(closed[0].is_listener_on(&cache, 53));

        // An accepted connection closing normally, and one aborted (peer port zeroed).
        for remote in ["[fd00::99]:40000", "[fd00::99]:0"] {
            let buf = announcement(
                FAMILY_INET6,
                7,
                Some(IPPROTO_TCP),
                addr("[fd00::10]:53"),
                addr(remote),
            );
            let closed = parse(&buf);
            assert_eq!(closed.len(), 1);
            assert!(!closed[0].is_listener_on(&cache, 53), "{remote}");
        }
    }

    #[test]
    fn connected_udp_is_not_a_listener() {
        let buf = announcement(
            FAMILY_INET,
            1,
            Some(IPPROTO_UDP),
            addr("169.254.20.10:53"),
            addr("10.0.0.7:33000"),
        );
        let closed = parse(&buf);
        assert_eq!(closed.len(), 1);
        assert!(!closed[0].is_listener_on(&["169.254.20.10".parse().unwrap()], 53));
    }

    #[test]
    fn two_messages_in_one_buffer() {
        let mut buf = announcement(
            FAMILY_INET,
            7,
            Some(IPPROTO_UDP),
            addr("10.96.0.10:53"),
            addr("0.0.0.0:0"),
        );
        buf.extend(announcement(
            FAMILY_INET6,
            7,
            Some(IPPROTO_TCP),
            addr("[::1]:8053"),
            addr("[::]:0"),
        ));
        let closed = parse(&buf);
        assert_eq!(closed.len(), 2);
        assert_eq!(closed[0].local, addr("10.96.0.10:53"));
        assert_eq!(closed[1].local, addr("[::1]:8053"));
        assert_eq!(closed[1].transport, Transport::Tcp);
    }

    #[test]
    fn skips_what_it_cannot_use() {
        let good = announcement(
            FAMILY_INET,
            7,
            Some(IPPROTO_UDP),
            addr("10.96.0.10:53"),
            addr("0.0.0.0:0"),
        );
        // No protocol attribute, an unknown protocol, an unknown family: skipped, the next
        // message is still read.
        for bad in [
            announcement(FAMILY_INET, 7, None, addr("1.2.3.4:53"), addr("0.0.0.0:0")),
            announcement(FAMILY_INET, 7, Some(132), addr("1.2.3.4:53"), addr("0.0.0.0:0")),
            {
                let mut b = good.clone();
                b[NLMSG_HDRLEN] = 1; // AF_UNIX
                b
            },
            {
                let mut b = good.clone();
                b[4] = 3; // NLMSG_DONE
                b
            },
        ] {
            let mut buf = bad;
            buf.extend_from_slice(&good);
            assert_eq!(parse(&buf).len(), 1);
        }
    }

    #[test]
    fn truncated_and_garbage_never_panic() {
        let good =
            announcement(FAMILY_INET6, 7, Some(IPPROTO_TCP), addr("[fd00::10]:53"), addr("[::]:0"));
        // Every prefix: nothing complete, nothing reported.
        for cut in 0..good.len() {
            assert!(parse(&good[..cut]).is_empty(), "cut at {cut}");
        }
        // A header claiming more than the inet_diag_msg holds.
        let mut short = good[..NLMSG_HDRLEN + 20].to_vec();
        short[..4].copy_from_slice(&36u32.to_ne_bytes());
        assert!(parse(&short).is_empty());
        // An attribute whose length runs past the message.
        let mut bad_attr = good.clone();
        let at = NLMSG_HDRLEN + INET_DIAG_MSG_LEN;
        bad_attr[at..at + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert!(parse(&bad_attr).is_empty());
        // Pseudo-random garbage, including lengths of 0 and u32::MAX.
        let mut state = 0x9e37_79b9_u32;
        for size in [0usize, 1, 15, 16, 17, 88, 200, 4096] {
            let buf: Vec<u8> = (0..size)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state.to_le_bytes()[0]
                })
                .collect();
            let _ = parse(&buf);
        }
        for len in [0u32, 1, 15, u32::MAX] {
            let mut buf = good.clone();
            buf[..4].copy_from_slice(&len.to_ne_bytes());
            assert!(parse(&buf).is_empty());
        }
    }
}
