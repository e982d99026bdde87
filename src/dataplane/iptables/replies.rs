//! The cache's replies as the agent's raw rules count them (`iptables-save -c`), for a drain.

use super::text::save_string;

/// The cache's replies to pods and host clients in `iptables-save -c` output (rule lines start
/// with `[packets:bytes]`): the agent's "cache replies" rules of both listen IPs, less its
/// answers to the agent's own probes and the forwarder's answers
/// ([`crate::ruleset::reply_weight`]).
pub(super) fn reply_packets(saved: &str) -> u64 {
    use crate::ruleset::{
        FORWARDER_REPLY_COMMENT, LINK_LOCAL_REPLY_COMMENT, PROBE_REPLY_COMMENT, REPLY_COMMENT,
    };
    let comments =
        [REPLY_COMMENT, LINK_LOCAL_REPLY_COMMENT, PROBE_REPLY_COMMENT, FORWARDER_REPLY_COMMENT];
    let weighed = saved.lines().filter(|l| l.contains(" -A NODELOCALDNS-HA-")).map(|l| {
        let weight = comments
            .into_iter()
            .find(|c| l.contains(&format!("--comment {} ", save_string(c))))
            .map_or(0, crate::ruleset::reply_weight);
        let packets = l.strip_prefix('[').and_then(|l| l.split_once(':')?.0.parse::<i64>().ok());
        weight * packets.unwrap_or(0)
    });
    weighed.sum::<i64>().max(0) as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn sums_the_reply_rules_counters_only() {
        let saved = "*raw\n\
            :OUTPUT ACCEPT [9:9]\n\
            [7:700] -A NODELOCALDNS-HA-OUTPUT -s 10.96.0.10/32 -p udp -m udp --sport 53 -m comment --comment \"cache replies\" -j NOTRACK\n\
            [5:500] -A NODELOCALDNS-HA-OUTPUT -s 169.254.20.10/32 -p udp -m udp --sport 53 -m comment --comment \"cache replies (link-local)\" -j NOTRACK\n\
            [4:400] -A NODELOCALDNS-HA-OUTPUT -s 169.254.20.10/32 -d 127.0.0.1/32 -p udp -m udp --sport 53 -m comment --comment \"cache replies to the agent\\'s probes\" -j NOTRACK\n\
            [3:300] -A NODELOCALDNS-HA-OUTPUT -s 169.254.20.10/32 -p udp -m udp --sport 53 -m ttl --ttl-eq 255 -m comment --comment \"the forwarder\\'s answers (link-local)\" -j NOTRACK\n\
            [3:300] -A NODELOCALDNS-HA-OUTPUT -d 10.96.0.10/32 -p udp -m udp --dport 53 -m comment --comment \"host to cache\" -j NOTRACK\n\
            [2:200] -A OUTPUT -s 10.96.0.10/32 -m comment --comment \"cache replies\" -j NOTRACK\n\
            COMMIT\n";
        // Both IPs' replies, less the 4 that answered the agent's own probes and the 3 of the
        // forwarder.
        assert_eq!(super::reply_packets(saved), 7 + 5 - 4 - 3);
    }
}
