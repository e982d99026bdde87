//! The forwarder's lease in iptables (`forwarder::lease`): the `recent` match the fallback's
//! TPROXY rules need, and the heartbeat rule that renews it, as `iptables-save` prints them.

use super::table::Family;
use crate::forwarder::lease;

/// ` -m recent <what> --name nodelocaldns-ha --mask … --rdest`: the forwarder's lease, keyed by
/// the link-local IP (`forwarder::lease`), as `iptables-save` prints it.
pub(super) fn recent(family: Family, what: &str) -> String {
    let mask = match family {
        Family::V4 => "255.255.255.255",
        Family::V6 => "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    };
    format!(" -m recent {what} --name {} --mask {mask} --rdest", lease::NAME)
}

/// The fallback chain's first rule for link-local IP `addr`: the forwarder's heartbeat, from the
/// loopback address to the IP's [`lease::HEARTBEAT_PORT`], renews its lease and goes no further.
/// Only on `lo`: IPv4 drops a loopback source that arrives on another interface at the routing
/// step, after this hook, so without `-i lo` a pod that forges the heartbeat (a raw socket is
/// enough) would hold the lease for an agent that is gone, and xt_TPROXY would then drop every
/// link-local query on the node. `saved_comment` is its comment as `iptables-save` prints it.
pub(super) fn heartbeat(own: &str, addr: std::net::IpAddr, saved_comment: &str) -> String {
    let family = Family::of(addr);
    let loopback = match family {
        Family::V4 => "127.0.0.1/32",
        Family::V6 => "::1/128",
    };
    format!(
        "-A {own} -s {loopback} -d {addr}/{} -i lo -p udp -m udp --dport {}{} -m comment \
         --comment {} -j DROP",
        family.host_bits(),
        lease::HEARTBEAT_PORT,
        recent(family, "--set"),
        saved_comment,
    )
}
