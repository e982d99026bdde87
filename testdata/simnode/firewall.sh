# shellcheck shell=bash
# simnode firewall: host firewalls in the shapes real nodes run beside Kubernetes' rules; each
# stops NOTRACKed queries to the cache in its own way unless they are accepted.
#
# --filter-drop: a host firewall in the flavour's filter table (and ip6tables for 6/dual): INPUT
#   policy DROP, accepting only `-i lo -d 127.0.0.0/8` (::1), ctstate RELATED,ESTABLISHED and
#   ICMP (ICMPv6); FORWARD and OUTPUT stay ACCEPT. So DNATed pod traffic (FORWARD) and the
#   cache's upstream queries (OUTPUT, replies ESTABLISHED) work, but NOTRACKed queries to the
#   cache (INPUT, ctstate UNTRACKED), from pods and host-network clients alike, are DROPPED unless
#   someone ACCEPTs them in that same iptables (node-cache's filter INPUT rules do). Real host
#   firewalls usually accept all of `-i lo`; this one does not, so host-network clients need
#   ACCEPTs too: for their queries (dport 53 to the IP) and, as NOTRACK leaves the replies
#   UNTRACKED, for the cache's replies (sport 53 from the IP): node-cache's rules accept only the
#   first, so with them host-network clients still time out. Because of it, unbound then also
#   listens on 127.0.0.1:53 (::1 on a v6-only node), which node-cache does not, and cache-start's
#   readiness check queries that address (dns-servers.sh).
# --filter-accept-lo (with --filter-drop): accept all of `-i lo` instead, like common host
#   firewalls (ufw, firewalld, GKE's Container-Optimized OS): there only pods need an ACCEPT,
#   which is what node-cache's filter rules give them. The cache then listens as without it.
# --filter-reject: the other common shape, RHEL's iptables-services (/etc/sysconfig/iptables)
#   and CIS-hardened images, in the flavour's filter table (and ip6tables): INPUT policy ACCEPT,
#   accepting ctstate RELATED,ESTABLISHED, ICMP, all of `-i lo` and ssh, then
#   `-j REJECT --reject-with icmp-host-prohibited` (icmp6-adm-prohibited). FORWARD is left alone
#   (on a real node kube-proxy's KUBE-FORWARD accepts pod traffic before RHEL's FORWARD REJECT).
#   NOTRACKed pod queries (ctstate UNTRACKED, not on lo) meet the REJECT unless accepted first.
# --nft-firewall: a native nftables host firewall shaped like firewalld's nftables backend:
#   `table inet simnode-firewalld`, chain filter_INPUT (hook input, priority filter + 10, policy
#   accept): ct state established,related accept, ct status dnat accept, iifname "lo" accept,
#   ct state invalid drop, jump filter_INPUT_ZONES (which goes to zone public: ICMP and ssh
#   accepted), then `reject with icmpx admin-prohibited`. No ACCEPT in another table can
#   override its reject.

# host_firewall LO: the host firewall of --filter-drop; LO: "loopback" accepts `-i lo -d
# 127.0.0.0/8` (::1) only, "accept-lo" all of `-i lo`.
host_firewall() {
    local ipt lo=127.0.0.0/8 icmp=icmp
    for ipt in $(ipt_families); do
        if [[ "$ipt" == ip6* ]]; then lo=::1/128 icmp=ipv6-icmp; fi
        [[ $1 == loopback ]] || lo=""
        in_ns node "$ipt" -t filter -A INPUT -i lo ${lo:+-d "$lo"} -m comment --comment "simnode host firewall" -j ACCEPT
        in_ns node "$ipt" -t filter -A INPUT -m conntrack --ctstate RELATED,ESTABLISHED \
            -m comment --comment "simnode host firewall" -j ACCEPT
        in_ns node "$ipt" -t filter -A INPUT -p "$icmp" -m comment --comment "simnode host firewall" -j ACCEPT
        in_ns node "$ipt" -t filter -P INPUT DROP
    done
}

# host_firewall_reject: the host firewall of --filter-reject (RHEL's iptables-services).
host_firewall_reject() {
    local ipt icmp=icmp reject=icmp-host-prohibited c=(-m comment --comment "simnode host firewall")
    for ipt in $(ipt_families); do
        if [[ "$ipt" == ip6* ]]; then icmp=ipv6-icmp reject=icmp6-adm-prohibited; fi
        in_ns node "$ipt" -t filter -A INPUT -m conntrack --ctstate RELATED,ESTABLISHED "${c[@]}" -j ACCEPT
        in_ns node "$ipt" -t filter -A INPUT -p "$icmp" "${c[@]}" -j ACCEPT
        in_ns node "$ipt" -t filter -A INPUT -i lo "${c[@]}" -j ACCEPT
        in_ns node "$ipt" -t filter -A INPUT -p tcp -m conntrack --ctstate NEW --dport 22 "${c[@]}" -j ACCEPT
        in_ns node "$ipt" -t filter -A INPUT "${c[@]}" -j REJECT --reject-with "$reject"
    done
}

# nft_firewall: the firewalld-shaped nftables firewall of --nft-firewall.
nft_firewall() {
    in_ns node nft -f - <<'EOF'
table inet simnode-firewalld {
	chain filter_INPUT {
		type filter hook input priority filter + 10; policy accept;
		ct state { established, related } accept
		ct status dnat accept
		iifname "lo" accept
		ct state invalid drop
		jump filter_INPUT_ZONES
		reject with icmpx admin-prohibited
	}
	chain filter_INPUT_ZONES {
		goto filter_IN_public
	}
	chain filter_IN_public {
		meta l4proto { icmp, ipv6-icmp } accept
		tcp dport 22 accept
	}
}
EOF
}
