//! The nftables expressions of a rule, as plain data.
//!
//! [`rule_expressions`] is the one place that decides which expressions a [`Rule`] becomes: the
//! batch is built from its output and the read-back is compared with it, so the two cannot drift.
//! They are the expressions `nft` itself generates for the rule's text (`nft --debug=netlink`);
//! a real-kernel test lets `nft` add each kind of rule and checks that it reads back the same.
//!
//! Every value is what the kernel stores and dumps; registers are always `NFT_REG_1`, as `nft`
//! uses them, and counter values are not part of an expression.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use crate::ruleset::{Action, Guard, Proto, Rule, Side};

/// The register every expression loads into or compares from (`NFT_REG_1`).
pub const NFT_REG_1: u32 = 1;
/// The second register, for TPROXY's port (`NFT_REG_2`).
pub const NFT_REG_2: u32 = 2;
/// The verdict register (`NFT_REG_VERDICT`).
pub const NFT_REG_VERDICT: u32 = 0;
/// `accept` (`NF_ACCEPT`).
pub const NF_ACCEPT: u32 = 1;
/// `meta nfproto`: the packet's family, in an `inet` table (`enum nft_meta_keys`).
pub const NFT_META_NFPROTO: u32 = 15;
/// `meta l4proto`: the transport protocol.
pub const NFT_META_L4PROTO: u32 = 16;
/// `NFT_META_IIF`: the input interface's index.
pub const NFT_META_IIF: u32 = 4;
/// `payload` from the network header (`enum nft_payload_bases`).
pub const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
/// `payload` from the transport header.
pub const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
/// `cmp` operator `==` (`enum nft_cmp_ops`).
pub const NFT_CMP_EQ: u32 = 0;
/// `cmp` operator `!=`.
pub const NFT_CMP_NEQ: u32 = 1;
/// `ct state` (`enum nft_ct_keys`).
pub const NFT_CT_STATE: u32 = 0;
/// `ct zone`.
pub const NFT_CT_ZONE: u32 = 17;
/// `ct state`'s bit for a packet NOTRACK has marked (`NF_CT_STATE_UNTRACKED_BIT`).
const NF_CT_STATE_UNTRACKED_BIT: u32 = 1 << 6;
/// `fib daddr`: look the destination address up (`enum nft_fib_flags`).
pub const NFTA_FIB_F_DADDR: u32 = 1 << 1;
/// `fib … type`: the route type of the address (`enum nft_fib_result`).
pub const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
/// `socket transparent` (`enum nft_socket_keys`).
pub const NFT_SOCKET_TRANSPARENT: u32 = 0;
/// `socket wildcard`: the socket is bound to 0.0.0.0 or `::` (`enum nft_socket_keys`).
pub const NFT_SOCKET_WILDCARD: u32 = 2;
/// The route type of an address of this host (`RTN_LOCAL`).
const RTN_LOCAL: u32 = 2;
/// `meta nfproto` of IPv4 packets.
const NFPROTO_IPV4: u8 = 2;
/// `meta nfproto` of IPv6 packets.
const NFPROTO_IPV6: u8 = 10;

/// One expression of a rule this backend writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// `meta load <key> => reg 1`.
    Meta {
        /// `NFT_META_*`.
        key: u32,
    },
    /// `payload load <len>b @ <base> header + <offset> => reg 1`.
    Payload {
        /// `NFT_PAYLOAD_*_HEADER`.
        base: u32,
        /// Bytes into the header.
        offset: u32,
        /// Bytes loaded.
        len: u32,
    },
    /// `cmp <op> reg 1 <data>`.
    Cmp {
        /// `NFT_CMP_*`.
        op: u32,
        /// The value compared with, as many bytes as were loaded.
        data: Vec<u8>,
    },
    /// `fib <flags> <result> => reg 1`.
    Fib {
        /// `NFTA_FIB_F_*`: which address to look up.
        flags: u32,
        /// `NFT_FIB_RESULT_*`: what to load.
        result: u32,
    },
    /// `socket load <key> => reg 1`.
    Socket {
        /// `NFT_SOCKET_*`.
        key: u32,
    },
    /// `ct load <key> => reg 1`.
    Ct {
        /// `NFT_CT_*`.
        key: u32,
    },
    /// `ct set <key> with reg 1`.
    CtSet {
        /// `NFT_CT_*`.
        key: u32,
    },
    /// `counter` (its values are not compared).
    Counter,
    /// `notrack`.
    Notrack,
    /// `immediate reg <dreg> <data>`: a value into a data register.
    Immediate {
        /// `NFT_REG_*`, not the verdict register.
        dreg: u32,
        data: Vec<u8>,
    },
    /// `immediate reg 0 accept`.
    Accept,
    /// `tproxy <family> addr reg 1 port reg 2`.
    Tproxy {
        /// `NFPROTO_IPV4` or `NFPROTO_IPV6`.
        family: u32,
    },
}

impl Expr {
    /// The expression's kernel name, as in `NFTA_EXPR_NAME`.
    pub fn name(&self) -> &'static str {
        match self {
            Expr::Meta { .. } => "meta",
            Expr::Payload { .. } => "payload",
            Expr::Cmp { .. } => "cmp",
            Expr::Fib { .. } => "fib",
            Expr::Socket { .. } => "socket",
            Expr::Ct { .. } | Expr::CtSet { .. } => "ct",
            Expr::Counter => "counter",
            Expr::Notrack => "notrack",
            Expr::Immediate { .. } | Expr::Accept => "immediate",
            Expr::Tproxy { .. } => "tproxy",
        }
    }

    fn cmp_eq(data: impl Into<Vec<u8>>) -> Expr {
        Expr::Cmp { op: NFT_CMP_EQ, data: data.into() }
    }
}

impl fmt::Display for Expr {
    /// Like `nft --debug=netlink`, less the register and with data as plain hex bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Meta { key: NFT_META_NFPROTO } => f.write_str("meta load nfproto"),
            Expr::Meta { key: NFT_META_L4PROTO } => f.write_str("meta load l4proto"),
            Expr::Meta { key } => write!(f, "meta load key {key}"),
            Expr::Payload { base, offset, len } => {
                let base = match *base {
                    NFT_PAYLOAD_NETWORK_HEADER => "network".to_owned(),
                    NFT_PAYLOAD_TRANSPORT_HEADER => "transport".to_owned(),
                    other => format!("base {other}"),
                };
                write!(f, "payload load {len}b @ {base} header + {offset}")
            }
            Expr::Cmp { op, data } => {
                match *op {
                    NFT_CMP_EQ => f.write_str("cmp eq ")?,
                    NFT_CMP_NEQ => f.write_str("cmp neq ")?,
                    other => write!(f, "cmp op {other} ")?,
                }
                data.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
            }
            Expr::Fib { flags: NFTA_FIB_F_DADDR, result: NFT_FIB_RESULT_ADDRTYPE } => {
                f.write_str("fib daddr type")
            }
            Expr::Fib { flags, result } => write!(f, "fib flags {flags:#x} result {result}"),
            Expr::Socket { key: NFT_SOCKET_TRANSPARENT } => f.write_str("socket load transparent"),
            Expr::Socket { key: NFT_SOCKET_WILDCARD } => f.write_str("socket load wildcard"),
            Expr::Socket { key } => write!(f, "socket load key {key}"),
            Expr::Ct { key: NFT_CT_STATE } => f.write_str("ct load state"),
            Expr::Ct { key } => write!(f, "ct load key {key}"),
            Expr::CtSet { key: NFT_CT_ZONE } => f.write_str("ct set zone"),
            Expr::CtSet { key } => write!(f, "ct set key {key}"),
            Expr::Counter => f.write_str("counter"),
            Expr::Notrack => f.write_str("notrack"),
            Expr::Immediate { dreg, data } => {
                write!(f, "immediate reg {dreg} ")?;
                data.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
            }
            Expr::Accept => f.write_str("immediate accept"),
            Expr::Tproxy { family } => {
                let family = if *family == u32::from(NFPROTO_IPV6) { "ip6" } else { "ip" };
                write!(f, "tproxy {family} addr reg 1 port reg 2")
            }
        }
    }
}

/// An expression as read back from the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// One this backend writes.
    Known(Expr),
    /// Anything else (another expression, or a known one used differently), by name.
    Other(String),
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Known(expr) => expr.fmt(f),
            Found::Other(name) => write!(f, "{name} (not one this agent writes)"),
        }
    }
}

/// The expressions `nft` generates for `rule`'s text, in order.
///
/// `ip daddr A udp dport 53 [fib daddr type local [socket transparent 0 socket wildcard 0]]
/// counter notrack`:
/// in an `inet` table the address match needs `meta nfproto` first, the port match
/// `meta l4proto` first.
pub fn rule_expressions(rule: &Rule) -> Vec<Expr> {
    let (nfproto, (saddr, daddr), addr, loopback) = match rule.addr {
        IpAddr::V4(ip) => (NFPROTO_IPV4, (12, 16), ip.octets().to_vec(), vec![127, 0, 0, 1]),
        IpAddr::V6(ip) => (
            NFPROTO_IPV6,
            (8, 24),
            ip.octets().to_vec(),
            std::net::Ipv6Addr::LOCALHOST.octets().to_vec(),
        ),
    };
    let (addr_offset, port_offset) = match rule.side {
        Side::Destination => (daddr, 2),
        Side::Source => (saddr, 0),
    };
    let mut exprs = vec![
        Expr::Meta { key: NFT_META_NFPROTO },
        Expr::cmp_eq([nfproto]),
        Expr::Payload {
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset: addr_offset,
            len: addr.len() as u32,
        },
        Expr::cmp_eq(addr),
        Expr::Meta { key: NFT_META_L4PROTO },
        Expr::cmp_eq([rule.proto.number()]),
        Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset: port_offset, len: 2 },
        Expr::cmp_eq(rule.port.to_be_bytes()),
    ];
    let fib_daddr_type_local = [
        Expr::Fib { flags: NFTA_FIB_F_DADDR, result: NFT_FIB_RESULT_ADDRTYPE },
        // The route type is a host-endian u32.
        Expr::cmp_eq(RTN_LOCAL.to_ne_bytes()),
    ];
    // A socket bound to the address itself: not a transparent one (a TPROXY target), and, for
    // UDP, not one bound to 0.0.0.0 or `::` (another DNS server of the node's, which must not
    // take pods' queries for the cache's address when the cache is gone). Not for TCP: the
    // kernel has no `wildcard` for a socket that is not a full one (a connection's request
    // socket during the handshake, TIME_WAIT) and the rule would stop matching there: the
    // handshake's last ACK would be tracked and DNATed to CoreDNS, which resets it.
    let mut socket_of_the_cache = vec![
        Expr::Socket { key: NFT_SOCKET_TRANSPARENT },
        // Each key is one bit, stored in one byte.
        Expr::cmp_eq([0]),
    ];
    if rule.proto == Proto::Udp {
        socket_of_the_cache.extend([Expr::Socket { key: NFT_SOCKET_WILDCARD }, Expr::cmp_eq([0])]);
    }
    match rule.guard {
        Guard::None => {}
        Guard::LocalAddress => exprs.extend(fib_daddr_type_local),
        Guard::LocalSocket => {
            exprs.extend(fib_daddr_type_local);
            exprs.extend(socket_of_the_cache);
        }
        Guard::FromLoopback | Guard::ToLoopback => {
            let offset = if rule.guard == Guard::FromLoopback { saddr } else { daddr };
            let len = loopback.len() as u32;
            exprs.extend([
                Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset, len },
                Expr::cmp_eq(loopback),
            ])
        }
        // lo is interface 1 in every network namespace.
        Guard::OnLoopback => {
            exprs.extend([Expr::Meta { key: NFT_META_IIF }, Expr::cmp_eq(1u32.to_ne_bytes())])
        }
        // The IPv4 header's TTL, the IPv6 header's hop limit.
        Guard::FromForwarder => {
            let offset = if rule.addr.is_ipv4() { 8 } else { 7 };
            exprs.extend([
                Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset, len: 1 },
                Expr::cmp_eq([crate::ruleset::FORWARDER_HOP_LIMIT]),
            ])
        }
        // `ct state` is a host-endian u32 of one bit per state; `!= untracked` is one compare.
        Guard::NotUntracked => exprs.extend([
            Expr::Ct { key: NFT_CT_STATE },
            Expr::Cmp { op: NFT_CMP_NEQ, data: NF_CT_STATE_UNTRACKED_BIT.to_ne_bytes().to_vec() },
        ]),
    }
    exprs.push(Expr::Counter);
    match rule.action {
        Action::Notrack => exprs.push(Expr::Notrack),
        Action::Accept => exprs.push(Expr::Accept),
        Action::Tproxy(to) => {
            let (family, addr) = match to {
                SocketAddr::V4(to) => (NFPROTO_IPV4, to.ip().octets().to_vec()),
                SocketAddr::V6(to) => (NFPROTO_IPV6, to.ip().octets().to_vec()),
            };
            exprs.extend([
                Expr::Immediate { dreg: NFT_REG_1, data: addr },
                Expr::Immediate { dreg: NFT_REG_2, data: to.port().to_be_bytes().to_vec() },
                Expr::Tproxy { family: u32::from(family) },
            ]);
        }
        // The zone is a u16, in host order; nft loads it whole.
        Action::Track => exprs.extend([
            Expr::Immediate { dreg: NFT_REG_1, data: 0u16.to_ne_bytes().to_vec() },
            Expr::CtSet { key: NFT_CT_ZONE },
        ]),
    }
    exprs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ruleset::Proto;

    fn rule(addr: &str, side: Side, guard: Guard) -> Rule {
        Rule {
            addr: addr.parse().unwrap(),
            side,
            proto: Proto::Udp,
            port: 53,
            guard,
            action: crate::ruleset::Action::Notrack,
            comment: "c".to_owned(),
        }
    }

    fn names(rule: &Rule) -> Vec<&'static str> {
        rule_expressions(rule).iter().map(Expr::name).collect()
    }

    const MATCH: [&str; 8] = ["meta", "cmp", "payload", "cmp", "meta", "cmp", "payload", "cmp"];

    #[test]
    fn names_per_guard() {
        let plain = rule("169.254.20.10", Side::Destination, Guard::None);
        assert_eq!(names(&plain), [&MATCH[..], &["counter", "notrack"]].concat());

        let address = rule("10.96.0.10", Side::Destination, Guard::LocalAddress);
        let want = [&MATCH[..], &["fib", "cmp", "counter", "notrack"]].concat();
        assert_eq!(names(&address), want);

        let socket = rule("fd00:96::10", Side::Destination, Guard::LocalSocket);
        let guard = ["fib", "cmp", "socket", "cmp", "socket", "cmp"];
        let want = [&MATCH[..], &guard, &["counter", "notrack"]].concat();
        assert_eq!(names(&socket), want);
    }

    #[test]
    fn values_match_nft_debug_output() {
        // nft --debug=netlink add rule inet t p ip daddr 10.96.0.10 udp dport 53 \
        //     fib daddr type local socket transparent 0 socket wildcard 0 counter notrack
        let text: Vec<String> =
            rule_expressions(&rule("10.96.0.10", Side::Destination, Guard::LocalSocket))
                .iter()
                .map(Expr::to_string)
                .collect();
        assert_eq!(
            text,
            [
                "meta load nfproto",
                "cmp eq 02",
                "payload load 4b @ network header + 16",
                "cmp eq 0a60000a",
                "meta load l4proto",
                "cmp eq 11",
                "payload load 2b @ transport header + 2",
                "cmp eq 0035",
                "fib daddr type",
                &format!(
                    "cmp eq {}",
                    if cfg!(target_endian = "little") { "02000000" } else { "00000002" }
                ),
                "socket load transparent",
                "cmp eq 00",
                "socket load wildcard",
                "cmp eq 00",
                "counter",
                "notrack",
            ]
        );
    }

    #[test]
    fn ipv6_source_rule_loads_saddr_and_sport() {
        let exprs = rule_expressions(&rule("fd00:96::10", Side::Source, Guard::None));
        assert_eq!(exprs[1], Expr::cmp_eq([10]));
        assert_eq!(
            exprs[2],
            Expr::Payload { base: NFT_PAYLOAD_NETWORK_HEADER, offset: 8, len: 16 }
        );
        assert_eq!(
            exprs[6],
            Expr::Payload { base: NFT_PAYLOAD_TRANSPORT_HEADER, offset: 0, len: 2 }
        );
    }
}
