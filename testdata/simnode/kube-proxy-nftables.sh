# shellcheck shell=bash
# simnode kube-proxy, nftables mode (--kube-proxy nftables; pkg/proxy/nftables/proxier.go,
# setupNFTables + syncProxyRules): `table ip kube-proxy` (and `ip6` for 6/dual) with base chains
# nat-prerouting / nat-output (-100), nat-postrouting (100), filter-* (-110,
# filter-output-post-dnat -90); chain `services` with `ip daddr . meta l4proto . th dport vmap
# @service-ips`; per Service port `service-<HASH>-kube-system/kube-dns/udp/dns` (numgen random mod
# 2 vmap to goto) and per endpoint `endpoint-<HASH>-kube-system/kube-dns/udp/dns__10.244.1.2/53`
# (dnat to), HASH being base32(sha256(name))[:8] like kube-proxy's; one `nft -f` transaction per
# family. kube-proxy itself writes nothing to iptables in this mode (at most it cleans up an
# iptables mode's leftovers when it starts: kube-proxy-migrate); kubelet still does (kubelet.sh).

# kube_nft FAMILY FIRST CLUSTER_DNS UPSTREAM EP1 EP2: the transaction kube-proxy sends for FAMILY
# (ip|ip6). Every chain it owns is added and flushed, every set and map added and flushed, then
# refilled; FIRST=1 adds its first-sync "add + delete" of the base chains.
kube_nft() {
    local fam=$1 first=$2 cluster_dns=$3 upstream=$4 ep1=$5 ep2=$6
    local t="$fam kube-proxy" addr_type=ipv4_addr no_localhost="ip daddr != 127.0.0.0/8"
    local svc_cidr=$V4_SERVICE_CIDR cluster_cidr=$V4_CLUSTER_CIDR
    if [[ $fam == ip6 ]]; then
        addr_type=ipv6_addr no_localhost="ip6 daddr != ::1"
        svc_cidr=$V6_SERVICE_CIDR cluster_cidr=$V6_CLUSTER_CIDR
    fi
    local base_chains=(
        "filter-prerouting filter prerouting -110" "filter-input filter input -110"
        "filter-forward filter forward -110" "filter-output filter output -110"
        "filter-output-post-dnat filter output -90" "nat-prerouting nat prerouting -100"
        "nat-output nat output -100" "nat-postrouting nat postrouting 100")
    local jumps=(
        "nodeport-endpoints-check filter-input ct state new"
        "service-endpoints-check filter-input ct state new"
        "service-endpoints-check filter-forward ct state new"
        "service-endpoints-check filter-output ct state new"
        "firewall-check filter-prerouting ct state new"
        "firewall-check filter-output ct state new"
        "services nat-output" "services nat-prerouting" "masquerading nat-postrouting"
        "cluster-ips-check filter-forward ct state new"
        "cluster-ips-check filter-output-post-dnat ct state new")
    local -A created=()
    local spec name type hook prio dst src extra chain
    ensure_chain() {
        [[ -z "${created[$1]:-}" ]] || return 0
        created[$1]=1
        echo "add chain $t $1"
        echo "flush chain $t $1"
    }

    echo "add table $t { comment \"rules for kube-proxy\" ; }"
    if ((first)); then
        for spec in "${base_chains[@]}"; do
            read -r name _ <<<"$spec"
            echo "add chain $t $name"
            echo "delete chain $t $name"
        done
    fi
    for spec in "${base_chains[@]}"; do
        read -r name type hook prio <<<"$spec"
        echo "add chain $t $name { type $type hook $hook priority $prio ; }"
        echo "flush chain $t $name"
    done
    for spec in "${jumps[@]}"; do
        read -r dst src extra <<<"$spec"
        ensure_chain "$dst"
        echo "add rule $t $src ${extra:+$extra }jump $dst"
    done
    for chain in services cluster-ips-check masquerading mark-for-masquerade; do ensure_chain "$chain"; done
    echo "add rule $t mark-for-masquerade mark set mark or 0x4000"
    echo "add rule $t masquerading mark and 0x4000 == 0 return"
    echo "add rule $t masquerading mark set mark xor 0x4000"
    echo "add rule $t masquerading masquerade fully-random"
    echo "add set $t cluster-ips { type $addr_type ; comment \"Active ClusterIPs\" ; }"
    echo "add rule $t cluster-ips-check $fam daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
    echo "add rule $t cluster-ips-check $fam daddr { $svc_cidr } drop comment \"Drop traffic to unallocated ClusterIPs\""
    # --nodeport-addresses unset: NodePorts on every local address (no nodeport-ips set).
    echo "add set $t nodeport-ips { type $addr_type ; comment \"IPs that accept NodePort traffic\" ; }"
    echo "delete set $t nodeport-ips"
    echo "add map $t no-endpoint-services { type $addr_type . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }"
    echo "add map $t no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\" ; }"
    echo "add chain $t reject-chain { comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }"
    echo "flush chain $t reject-chain"
    echo "add rule $t reject-chain reject"
    echo "add rule $t service-endpoints-check $fam daddr . meta l4proto . th dport vmap @no-endpoint-services"
    echo "add rule $t nodeport-endpoints-check $no_localhost meta l4proto . th dport vmap @no-endpoint-nodeports"
    echo "add map $t firewall-ips { type $addr_type . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\" ; }"
    echo "add rule $t firewall-check $fam daddr . meta l4proto . th dport vmap @firewall-ips"
    echo "add map $t service-ips { type $addr_type . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }"
    echo "add map $t service-nodeports { type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }"
    echo "add rule $t services $fam daddr . meta l4proto . th dport vmap @service-ips"
    echo "add rule $t services fib daddr type local $no_localhost meta l4proto . th dport vmap @service-nodeports"
    echo "flush set $t cluster-ips"
    for name in service-ips firewall-ips no-endpoint-services no-endpoint-nodeports service-nodeports; do
        echo "flush map $t $name"
    done

    local ip svc proto port base hash schain ep epname ebase echains dest i
    for spec in "$cluster_dns kube-dns" "$upstream kube-dns-upstream"; do
        read -r ip svc <<<"$spec"
        echo "add element $t cluster-ips { $ip }"
        for proto in udp tcp; do
            port=dns
            [[ $proto == tcp ]] && port=dns-tcp
            base="kube-system/$svc/$proto/$port"
            hash=$(kube_hash "$base")
            schain="service-${hash:0:8}-$base"
            echains=()
            for ep in "$ep1" "$ep2"; do
                epname=${ep//:/.}
                ebase="${base}__$epname/53"
                hash=$(kube_hash "$ebase")
                echains+=("endpoint-${hash:0:8}-$ebase")
            done
            # kube-proxy creates (adds and flushes) all its chains before writing their rules.
            for chain in "$schain" "${echains[@]}"; do
                echo "add chain $t $chain"
                echo "flush chain $t $chain"
            done
            echo "add rule $t $schain $fam daddr $ip $fam saddr != $cluster_cidr jump mark-for-masquerade"
            echo "add rule $t $schain numgen random mod 2 vmap { 0 : goto ${echains[0]} , 1 : goto ${echains[1]} }"
            for i in 0 1; do
                ep=$ep1
                ((i == 0)) || ep=$ep2
                dest="$ep:53"
                [[ "$ep" == *:* ]] && dest="[$ep]:53"
                echo "add rule $t ${echains[i]} $fam saddr $ep jump mark-for-masquerade"
                echo "add rule $t ${echains[i]} meta l4proto $proto dnat to $dest"
            done
            echo "add element $t service-ips { $ip . $proto . 53 : goto $schain }"
        done
    done
}

# kube_nft_rules FAMILY CLUSTER_DNS UPSTREAM EP1 EP2: kube-proxy's first sync for FAMILY (ip|ip6),
# and the transaction of every later sync saved for the resync loop.
kube_nft_rules() {
    local fam=$1
    shift
    kube_nft "$fam" 1 "$@" >"$RUN_DIR/kube-proxy-$fam.nft"
    kube_nft "$fam" 0 "$@" >"$RUN_DIR/kube-proxy-$fam.resync.nft"
    in_ns node nft -f "$RUN_DIR/kube-proxy-$fam.nft"
}

# kube-proxy-migrate: kube-proxy restarted in nftables mode on a node where it ran in an iptables
# mode. Like its CleanupLeftovers, its iptables rules go (the KUBE-SERVICES jumps and every
# KUBE-* nat chain); kubelet's canaries stay.
cmd_kube_proxy_migrate() {
    load_state
    if is_real; then
        real_kube_proxy_migrate
        return
    fi
    [[ $KUBE_PROXY == iptables-* ]] || die "kube-proxy already runs in $KUBE_PROXY mode"
    local ipt chain
    for ipt in $(ipt_families); do
        in_ns node "$ipt" -t nat -D PREROUTING "${KUBE_PORTALS[@]}"
        in_ns node "$ipt" -t nat -D OUTPUT "${KUBE_PORTALS[@]}"
        local chains=()
        mapfile -t chains < <(in_ns node "$ipt-save" -t nat | sed -n 's/^:\(KUBE-[A-Z0-9-]*\) .*/\1/p' | grep -v CANARY)
        for chain in "${chains[@]}"; do in_ns node "$ipt" -t nat -F "$chain"; done
        for chain in "${chains[@]}"; do in_ns node "$ipt" -t nat -X "$chain"; done
    done
    if has_v4; then kube_nft_rules ip "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"; fi
    if has_v6; then kube_nft_rules ip6 "$V6_CLUSTER_DNS" "$V6_UPSTREAM" "${V6_DNS_EPS[@]}"; fi
    KUBE_PROXY=nftables
    save_state
}

