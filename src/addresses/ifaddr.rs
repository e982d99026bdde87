//! The rtnetlink address messages the agent reads and writes (`linux/if_addr.h`,
//! `linux/rtnetlink.h`): the request that adds one of its copies to `lo`, the one that deletes an
//! address, the `RTM_GETADDR` dump request, and the kernel's answers: `RTM_NEWADDR` messages, an
//! `NLMSG_DONE`, an acknowledgement or a refusal.
//!
//! Each message is an `ifaddrmsg` (family, prefix length, flags, scope, interface index; 8 bytes)
//! and attributes. The requests are those iproute2 sends for the same `ip addr add`/`del`, byte
//! for byte, plus `IFA_PROTO` (the tests compare them with what `ip` sent).
//!
//! Pure: it works on receive buffers that [`crate::netlink`] cuts into messages, and turns any
//! input into a value or a [`ParseError`], never a panic. Addresses are in network byte order,
//! everything else host-endian.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{LABEL, LOOPBACK_INDEX, PROTO};
use crate::netlink::{
    attribute_table, messages, ne_u32, put_attr, string, Message, ParseError, NLMSG_DONE,
    NLMSG_ERROR, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_EXCL, NLM_F_REQUEST,
};

/// `RTM_NEWADDR`: add an address; also each address of a dump.
pub(crate) const RTM_NEWADDR: u16 = 20;
/// `RTM_DELADDR`: delete an address.
pub(crate) const RTM_DELADDR: u16 = 21;
/// `RTM_GETADDR`: list addresses.
pub(crate) const RTM_GETADDR: u16 = 22;
/// `sizeof(struct ifaddrmsg)`.
const IFADDRMSG_LEN: usize = 8;

/// `IFA_ADDRESS`: the prefix address; the peer's on a point-to-point address.
pub(super) const IFA_ADDRESS: u16 = 1;
/// `IFA_LOCAL`: the address itself (IPv4 always; IPv6 only with a peer).
pub(super) const IFA_LOCAL: u16 = 2;
/// `IFA_LABEL`: an IPv4 address's label, `lo` or `lo:<something>`.
pub(super) const IFA_LABEL: u16 = 3;
/// `IFA_CACHEINFO`: `ifa_cacheinfo`, the preferred and valid lifetimes first.
pub(super) const IFA_CACHEINFO: u16 = 6;
/// `IFA_FLAGS`: all the `IFA_F_*` flags as a `u32` (`ifa_flags` holds only the low 8).
pub(super) const IFA_FLAGS: u16 = 8;
/// `IFA_PROTO` (kernel ≥ 5.18): a `u8` saying who added the address.
pub(super) const IFA_PROTO: u16 = 11;
/// Attribute types read: up to `IFA_PROTO`.
const IFA_TABLE: usize = IFA_PROTO as usize + 1;

/// `AF_INET`.
pub(crate) const AF_INET: u8 = 2;
/// `AF_INET6`.
pub(crate) const AF_INET6: u8 = 10;
/// `IFA_F_NODAD`: no duplicate address detection (the address is usable at once).
pub(crate) const IFA_F_NODAD: u32 = 0x02;
/// `IFA_F_DEPRECATED`: the preferred lifetime is over: never chosen as a source address.
#[cfg(test)]
pub(crate) const IFA_F_DEPRECATED: u32 = 0x20;
/// `IFA_F_NOPREFIXROUTE`: no route for the prefix in the main table.
pub(crate) const IFA_F_NOPREFIXROUTE: u32 = 0x200;
/// `RT_SCOPE_HOST`: valid only inside this host.
pub(crate) const RT_SCOPE_HOST: u8 = 254;
/// `IFNAMSIZ`: an interface name's or a label's room, NUL included.
const IFNAMSIZ: usize = 16;
/// `INFINITY_LIFE_TIME`: the valid lifetime `forever`.
const FOREVER: u32 = u32::MAX;

/// One address as the kernel lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    /// The index of the interface that holds it.
    pub index: u32,
    /// The address itself: `IFA_LOCAL`, or `IFA_ADDRESS` without it.
    pub local: IpAddr,
    /// `IFA_ADDRESS`, or `local` without it: the same but for a point-to-point address.
    pub address: IpAddr,
    pub prefix_len: u8,
    /// `RT_SCOPE_*`.
    pub scope: u8,
    /// `IFA_F_*`: `IFA_FLAGS`, or `ifa_flags` without it.
    pub flags: u32,
    /// `IFA_LABEL` (IPv4 only).
    pub label: Option<String>,
    /// `IFA_PROTO`; `None` when absent, which a kernel that keeps protocols says of 0 as well.
    pub proto: Option<u8>,
}

/// The request that adds the agent's copy of `ip` to `lo`, as `seq`: IPv4 as
/// `ip addr add IP/32 dev lo label lo:nlha scope host`, IPv6 as
/// `ip addr add IP/128 dev lo nodad noprefixroute preferred_lft 0 valid_lft forever`, both with
/// `proto 0x6e`. `NLM_F_EXCL`: an address already there is refused with `EEXIST`, never taken
/// over (without it, `NLM_F_REPLACE` would rewrite its protocol).
pub(crate) fn copy_request(ip: IpAddr, seq: u32) -> Vec<u8> {
    let (family, prefix_len, scope) = match ip {
        IpAddr::V4(_) => (AF_INET, 32, RT_SCOPE_HOST),
        // The kernel derives an IPv6 address's scope from the address.
        IpAddr::V6(_) => (AF_INET6, 128, 0),
    };
    let mut payload = ifaddrmsg(family, prefix_len, scope, LOOPBACK_INDEX);
    let octets = octets(ip);
    put_attr(&mut payload, IFA_LOCAL, &octets);
    match ip {
        IpAddr::V4(_) => put_attr(&mut payload, IFA_LABEL, &nul_terminated(LABEL)),
        IpAddr::V6(_) => {
            let flags = IFA_F_NODAD | IFA_F_NOPREFIXROUTE;
            put_attr(&mut payload, IFA_FLAGS, &flags.to_ne_bytes());
        }
    }
    put_attr(&mut payload, IFA_ADDRESS, &octets);
    if ip.is_ipv6() {
        // ifa_cacheinfo: preferred 0 (deprecated from the start), valid forever, timestamps.
        let cacheinfo: Vec<u8> = [0, FOREVER, 0, 0].iter().flat_map(|v| v.to_ne_bytes()).collect();
        put_attr(&mut payload, IFA_CACHEINFO, &cacheinfo);
    }
    put_attr(&mut payload, IFA_PROTO, &[PROTO]);
    let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE;
    Message { kind: RTM_NEWADDR, flags, seq, portid: 0, payload: &payload }.encode()
}

/// The request that deletes `address` from its interface, as `seq`: what
/// `ip addr del LOCAL/LEN dev DEV label LABEL` sends (peer included), which the kernel matches
/// against the address, its prefix length and, for IPv4, its label.
pub(crate) fn delete_request(address: &Address, seq: u32) -> Vec<u8> {
    let family = if address.local.is_ipv4() { AF_INET } else { AF_INET6 };
    let mut payload = ifaddrmsg(family, address.prefix_len, 0, address.index);
    put_attr(&mut payload, IFA_LOCAL, &octets(address.local));
    // A label the kernel could not hold (it keeps IFNAMSIZ bytes, NUL included) is left out:
    // it only narrows the match.
    let label = address.label.as_deref().filter(|l| address.local.is_ipv4() && l.len() < IFNAMSIZ);
    if let Some(label) = label {
        put_attr(&mut payload, IFA_LABEL, &nul_terminated(label));
    }
    put_attr(&mut payload, IFA_ADDRESS, &octets(address.address));
    let flags = NLM_F_REQUEST | NLM_F_ACK;
    Message { kind: RTM_DELADDR, flags, seq, portid: 0, payload: &payload }.encode()
}

/// The request that lists every address of the namespace, both families, as `seq`. The kernel
/// filters a dump by interface only with strict checking on; the caller filters.
pub(crate) fn dump_request(seq: u32) -> Vec<u8> {
    let payload = [0u8; IFADDRMSG_LEN];
    let flags = NLM_F_REQUEST | NLM_F_DUMP;
    Message { kind: RTM_GETADDR, flags, seq, portid: 0, payload: &payload }.encode()
}

/// An `ifaddrmsg` for interface `index`, without flags (they go in `IFA_FLAGS`, as iproute2
/// sends them).
fn ifaddrmsg(family: u8, prefix_len: u8, scope: u8, index: u32) -> Vec<u8> {
    let mut msg = vec![family, prefix_len, 0, scope];
    msg.extend_from_slice(&index.to_ne_bytes());
    msg
}

fn octets(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn nul_terminated(text: &str) -> Vec<u8> {
    [text.as_bytes(), &[0]].concat()
}

/// Reads the payload of one `RTM_NEWADDR` message: `Ok(None)` for a family other than IPv4 and
/// IPv6 (none today, but not an error).
pub fn parse_address(payload: &[u8]) -> Result<Option<Address>, ParseError> {
    let header = payload.get(..IFADDRMSG_LEN).ok_or(ParseError::Truncated {
        what: "ifaddrmsg",
        have: payload.len(),
        need: IFADDRMSG_LEN,
    })?;
    let width = match header[0] {
        AF_INET => 4,
        AF_INET6 => 16,
        _ => return Ok(None),
    };
    let attrs = attribute_table::<IFA_TABLE>(&payload[IFADDRMSG_LEN..])?;
    let ip = |value: &[u8], what| -> Result<IpAddr, ParseError> {
        let size = ParseError::Size { what, have: value.len(), want: width };
        Ok(match width {
            4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(value).map_err(|_| size)?)),
            _ => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(value).map_err(|_| size)?)),
        })
    };
    let address = attrs[usize::from(IFA_ADDRESS)].map(|v| ip(v, "IFA_ADDRESS")).transpose()?;
    let local = attrs[usize::from(IFA_LOCAL)].map(|v| ip(v, "IFA_LOCAL")).transpose()?;
    let (local, address) = match (local, address) {
        (Some(local), address) => (local, address.unwrap_or(local)),
        (None, Some(address)) => (address, address),
        (None, None) => return Err(ParseError::Missing("IFA_ADDRESS")),
    };
    let flags =
        match attrs[usize::from(IFA_FLAGS)] {
            Some(value) => ne_u32(value, 0)
                .filter(|_| value.len() == 4)
                .ok_or(ParseError::Size { what: "IFA_FLAGS", have: value.len(), want: 4 })?,
            None => u32::from(header[2]),
        };
    let proto = match attrs[usize::from(IFA_PROTO)] {
        Some(&[proto]) => Some(proto),
        Some(value) => {
            return Err(ParseError::Size { what: "IFA_PROTO", have: value.len(), want: 1 })
        }
        None => None,
    };
    Ok(Some(Address {
        index: ne_u32(header, 4).unwrap_or_default(),
        local,
        address,
        prefix_len: header[1],
        scope: header[3],
        flags,
        label: attrs[usize::from(IFA_LABEL)].map(string),
        proto,
    }))
}

/// What the kernel has answered so far to one request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// The addresses listed (a dump's answer).
    pub addresses: Vec<Address>,
    /// The kernel flagged the dump as interrupted: its addresses changed meanwhile, so what it
    /// listed may be inconsistent.
    pub interrupted: bool,
    /// Set once the answer is complete: `Ok` for an acknowledgement or the end of a dump, the
    /// kernel's errno (positive) for a refusal.
    pub outcome: Option<Result<(), i32>>,
}

/// Reads one received datagram of the answer to request `seq` into `answer`. Messages of other
/// sequence numbers and of other types are skipped, so is everything after the answer is
/// complete; a message that cannot be read is an error.
pub fn read_answer(buf: &[u8], seq: u32, answer: &mut Answer) -> Result<(), ParseError> {
    for message in messages(buf) {
        let message = message?;
        if message.seq != seq || answer.outcome.is_some() {
            continue;
        }
        answer.interrupted |= message.flags & NLM_F_DUMP_INTR != 0;
        match message.kind {
            NLMSG_ERROR => answer.outcome = Some(errno_of(message.error_code()?)),
            // A dump's end carries the dump's error, if any; older kernels may send no payload.
            NLMSG_DONE => answer.outcome = Some(errno_of(message.error_code().unwrap_or(0))),
            RTM_NEWADDR => answer.addresses.extend(parse_address(message.payload)?),
            _ => {}
        }
    }
    Ok(())
}

fn errno_of(code: i32) -> Result<(), i32> {
    match code {
        0 => Ok(()),
        errno => Err(errno),
    }
}
