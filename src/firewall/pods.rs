//! Where pods live on the node, as its routes say: each interface a route sends a prefix to
//! directly (no gateway), with that prefix. `cni0 10.244.1.0/24` on a bridge CNI, one
//! `cali… 10.244.1.5/32` per pod on Calico, one `lxc…` per pod on Cilium. Left out: `lo`, routes
//! through a gateway (other nodes' pods), rejects and blackholes (Calico's block), link-local
//! and multicast prefixes, and every route of an uplink: an interface with a default route, or
//! the one the node reaches the cluster's Services through (the kube-dns and upstream IPs). So
//! a firewall that trusts the pod CIDR or the CNI's interfaces (firewalld's trusted zone) is
//! judged for the pods it trusts, and one that trusts only some of the node's pods still counts
//! as stopping the others.
//!
//! Read from `/proc/net/route` (the main table) and `/proc/net/ipv6_route`: text, no netlink
//! dump to page through, and what `route -n` has read for decades.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::Value;

/// At most this many places are judged (a node runs ~110 pods; Calico and Cilium route each);
/// a node with more is judged as before, its pods coming from anywhere but `lo`.
pub const MAX_PLACES: usize = 512;

/// Pods behind an interface, at the addresses a route sends there.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodSource {
    pub iface: String,
    /// The prefix's address (its host bits zero) and length.
    pub net: IpAddr,
    pub prefix_len: u8,
}

impl PodSource {
    /// The pod's address as far as the prefix tells it.
    pub(super) fn bits(&self) -> Value {
        let value = match self.net {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        };
        let known = (0..value.len())
            .map(|i| {
                let bits = usize::from(self.prefix_len).saturating_sub(i * 8).min(8);
                (0xff00u16 >> bits) as u8
            })
            .collect();
        Value::Bits { value, known }
    }

    fn contains(&self, addr: IpAddr) -> bool {
        let bits = |a: IpAddr| match a {
            IpAddr::V4(a) => (u128::from(a.to_bits()) << 96, true),
            IpAddr::V6(a) => (a.to_bits(), false),
        };
        let ((a, a_v4), (n, n_v4)) = (bits(addr), bits(self.net));
        let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix_len)).unwrap_or(0);
        a_v4 == n_v4 && a & mask == n & mask
    }
}

impl fmt::Display for PodSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.iface, self.net, self.prefix_len)
    }
}

/// `RTF_GATEWAY`, `RTF_REJECT`; IPv6's `RTF_LOCAL`, `RTF_ANYCAST`, `RTF_CACHE`.
const RTF_GATEWAY: u32 = 0x2;
const RTF_REJECT: u32 = 0x200;
const RTF6_NOT_A_PREFIX: u32 = 0x8000_0000 | 0x0010_0000 | 0x0100_0000;

/// One route: the interface, the prefix, whether it goes straight there.
struct Route {
    iface: String,
    net: IpAddr,
    prefix_len: u8,
    direct: bool,
    reject: bool,
}

/// The node's pods' places, from the text of `/proc/net/route` and `/proc/net/ipv6_route`;
/// `services` are the kube-dns and upstream IPs, whose interface is an uplink.
pub fn pod_sources(route: &str, ipv6_route: &str, services: &[IpAddr]) -> Vec<PodSource> {
    let routes: Vec<Route> = route
        .lines()
        .skip(1)
        .filter_map(parse_v4)
        .chain(ipv6_route.lines().filter_map(parse_v6))
        .collect();
    let source =
        |r: &Route| PodSource { iface: r.iface.clone(), net: r.net, prefix_len: r.prefix_len };
    let mut uplinks: Vec<&str> = routes
        .iter()
        .filter(|r| r.prefix_len == 0 && !r.reject)
        .map(|r| r.iface.as_str())
        .collect();
    for &service in services {
        let best = routes
            .iter()
            .filter(|r| !r.reject && source(r).contains(service))
            .max_by_key(|r| r.prefix_len);
        uplinks.extend(best.map(|r| r.iface.as_str()));
    }
    let mut places: Vec<PodSource> = routes
        .iter()
        .filter(|r| r.direct && r.iface != "lo" && !uplinks.contains(&r.iface.as_str()))
        .filter(|r| !special(r.net))
        .map(source)
        .collect();
    places.sort_by(|a, b| (&a.iface, a.net, a.prefix_len).cmp(&(&b.iface, b.net, b.prefix_len)));
    places.dedup();
    if places.len() > MAX_PLACES {
        places.clear();
    }
    places
}

/// Link-local and multicast prefixes: no pod's address.
fn special(net: IpAddr) -> bool {
    match net {
        IpAddr::V4(a) => a.is_link_local() || a.is_multicast(),
        IpAddr::V6(a) => (a.segments()[0] & 0xffc0) == 0xfe80 || a.is_multicast(),
    }
}

/// `eth0 0000F40A 00000000 0001 0 0 0 00FFFFFF 0 0 0`: addresses in the kernel's byte order.
fn parse_v4(line: &str) -> Option<Route> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let (iface, dest, flags, mask) =
        (f.first()?, hex(f.get(1)?)?, hex(f.get(3)?)?, hex(f.get(7)?)?);
    let mask = Ipv4Addr::from(mask.to_ne_bytes());
    let prefix_len = u8::try_from(mask.to_bits().leading_ones()).ok()?;
    Some(Route {
        iface: (*iface).to_owned(),
        net: IpAddr::V4(Ipv4Addr::from(dest.to_ne_bytes())),
        prefix_len,
        direct: flags & (RTF_GATEWAY | RTF_REJECT) == 0,
        reject: flags & RTF_REJECT != 0,
    })
}

/// `fd00…0 40 0…0 00 0…0 00000100 00000001 00000000 00000001 eth0`: destination, its length,
/// source and its length, next hop, metric, references, use, flags, interface.
fn parse_v6(line: &str) -> Option<Route> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let (dest, len, hop, flags, iface) = (f.first()?, f.get(1)?, f.get(4)?, f.get(8)?, f.get(9)?);
    let flags = u32::from_str_radix(flags, 16).ok()?;
    let gateway = u128::from_str_radix(hop, 16).ok()? != 0 || flags & RTF_GATEWAY != 0;
    Some(Route {
        iface: (*iface).to_owned(),
        net: IpAddr::V6(Ipv6Addr::from_bits(u128::from_str_radix(dest, 16).ok()?)),
        prefix_len: u8::from_str_radix(len, 16).ok()?,
        direct: !gateway && flags & (RTF_REJECT | RTF6_NOT_A_PREFIX) == 0,
        reject: flags & RTF_REJECT != 0,
    })
}

/// The node's pods' places, read from this thread's network namespace; none when the files
/// cannot be read (the evaluation then knows less, and says "may").
pub fn read_pod_sources(services: &[IpAddr]) -> Vec<PodSource> {
    let read = |name| std::fs::read_to_string(format!("/proc/thread-self/net/{name}"));
    let v4 = read("route").unwrap_or_default();
    let v6 = read("ipv6_route").unwrap_or_default();
    pod_sources(&v4, &v6, services)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Calico-like node: a default route, the node's subnet, Calico's blackhole block, two
    /// pods, another node's block through a tunnel, docker's bridge; and IPv6.
    const ROUTE: &str = "\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
*\t0001F40A\t00000000\t0201\t0\t0\t0\tC0FFFFFF\t0\t0\t0
cali1\t0501F40A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0
cali2\t0601F40A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0
tunl0\t4001F40A\t0201A8C0\t0003\t0\t0\t0\tC0FFFFFF\t0\t0\t0
cni0\t0000F40A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
";
    const IPV6_ROUTE: &str = "\
fd000244000000000000000000000005 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000001    cali1
fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000001 00000000 00000003     eth0
fd000244000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo
";

    fn place(iface: &str, net: &str, prefix_len: u8) -> PodSource {
        PodSource { iface: iface.into(), net: net.parse().unwrap(), prefix_len }
    }

    #[test]
    fn pods_are_the_direct_routes_off_the_uplinks() {
        let found = pod_sources(ROUTE, IPV6_ROUTE, &[]);
        assert_eq!(
            found,
            vec![
                place("cali1", "10.244.1.5", 32),
                place("cali1", "fd00:244::5", 128),
                place("cali2", "10.244.1.6", 32),
                place("cni0", "10.244.0.0", 24),
            ]
        );
    }

    #[test]
    fn the_interface_the_services_are_reached_through_is_an_uplink() {
        // The simulated node: no default route, the Service CIDR routed to "CoreDNS"'s veth.
        let route = "\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
pod1\t0200F40A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0
dns\t0001F40A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
dns\t0000600A\t00000000\t0001\t0\t0\t0\t0000F0FF\t0\t0\t0
";
        let kube_dns: IpAddr = "10.96.0.10".parse().unwrap();
        assert_eq!(pod_sources(route, "", &[kube_dns]), vec![place("pod1", "10.244.0.2", 32)]);
        assert_eq!(pod_sources(route, "", &[]).len(), 3);
    }

    #[test]
    fn a_prefix_tells_its_bits() {
        let Value::Bits { value, known } = place("cni0", "10.244.0.0", 20).bits() else {
            panic!("bits")
        };
        assert_eq!((value, known), (vec![10, 244, 0, 0], vec![0xff, 0xff, 0xf0, 0]));
        assert!(place("cni0", "10.244.0.0", 16).contains("10.244.3.4".parse().unwrap()));
        assert!(!place("cni0", "10.244.0.0", 16).contains("10.245.3.4".parse().unwrap()));
        assert!(place("x", "0.0.0.0", 0).contains("1.2.3.4".parse().unwrap()));
        assert!(!place("x", "0.0.0.0", 0).contains("::1".parse().unwrap()));
    }
}
