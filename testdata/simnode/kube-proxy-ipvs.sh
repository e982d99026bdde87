# shellcheck shell=bash
# simnode kube-proxy, IPVS mode (--kube-proxy ipvs; IPv4 only; needs the ip_vs and dummy modules,
# which the build machine's kernel lacks: it runs in the ci/vm guest): what kube-proxy's
# pkg/proxy/ipvs/proxier.go (kubernetes/kubernetes, 1.30-era: NewProxier,
# createAndLinkKubeChain, writeIptablesRules, syncService/syncEndpoint; set names and comments
# from pkg/proxy/ipvs/ipset.go) leaves on a node with these two Services:
#   * the sysctls net.ipv4.vs.conntrack=1, expire_nodest_conn=1, expire_quiescent_template=1;
#   * the dummy interface `kube-ipvs0` (left down) holding every ClusterIP as /32;
#   * IPVS virtual services 10.96.0.10:53 and 10.96.0.11:53, udp and tcp, scheduler rr, each with
#     the CoreDNS endpoints as masquerading real servers (weight 1);
#   * its ipsets (all 17 created; KUBE-CLUSTER-IP holds ip,proto:port of each Service port,
#     KUBE-LOOP-BACK the endpoints on this node as ip,proto:port,ip, KUBE-IPVS-IPS the addresses
#     on kube-ipvs0);
#   * its iptables chains in nat (KUBE-SERVICES, KUBE-POSTROUTING with the 0x4000 masquerade
#     mark, KUBE-MARK-MASQ, KUBE-NODE-PORT, KUBE-LOAD-BALANCER) and filter (KUBE-FORWARD,
#     KUBE-NODE-PORT, KUBE-PROXY-FIREWALL, KUBE-SOURCE-RANGES-FIREWALL, KUBE-IPVS-FILTER,
#     KUBE-IPVS-OUT-FILTER), with the jumps from the built-in chains that its
#     EnsureRule(Prepend) puts first, all in iptables-nft (with kubelet's chains, kubelet.sh).
# Local traffic detection by cluster CIDR (10.244.0.0/16). Written with `ipvsadm -R`, `ipset
# restore` and one `iptables-restore --noflush` instead of kube-proxy's one netlink call or command
# per service, set, entry and jump (a process costs ~0.2 s in the TCG guest); the result is the
# same. ClusterIP traffic never meets a DNAT rule: IPVS takes it in its LOCAL_IN hook
# (pods) or LOCAL_OUT hook (the node) and forwards it to a real server.

readonly KUBE_MASQ_MARK=0x4000 # 1 << --iptables-masquerade-bit (14)
# Every set of ipsetInfo, with its type.
readonly KUBE_IPVS_SETS=(
    "KUBE-LOOP-BACK hash:ip,port,ip" "KUBE-CLUSTER-IP hash:ip,port" "KUBE-EXTERNAL-IP hash:ip,port"
    "KUBE-EXTERNAL-IP-LOCAL hash:ip,port" "KUBE-LOAD-BALANCER hash:ip,port"
    "KUBE-LOAD-BALANCER-FW hash:ip,port" "KUBE-LOAD-BALANCER-LOCAL hash:ip,port"
    "KUBE-LOAD-BALANCER-SOURCE-IP hash:ip,port,ip" "KUBE-LOAD-BALANCER-SOURCE-CIDR hash:ip,port,net"
    "KUBE-NODE-PORT-TCP bitmap:port" "KUBE-NODE-PORT-LOCAL-TCP bitmap:port"
    "KUBE-NODE-PORT-UDP bitmap:port" "KUBE-NODE-PORT-LOCAL-UDP bitmap:port"
    "KUBE-NODE-PORT-SCTP-HASH hash:ip,port" "KUBE-NODE-PORT-LOCAL-SCTP-HASH hash:ip,port"
    "KUBE-HEALTH-CHECK-NODE-PORT bitmap:port" "KUBE-IPVS-IPS hash:ip")

# kube_ipvs_sets CLUSTER_DNS UPSTREAM EP1 EP2: `ipset restore` input for the sets and entries.
kube_ipvs_sets() {
    local spec name type ip proto ep
    for spec in "${KUBE_IPVS_SETS[@]}"; do
        read -r name type <<<"$spec"
        if [[ $type == bitmap:port ]]; then
            echo "create $name $type range 0-65535"
        else
            echo "create $name $type family inet hashsize 1024 maxelem 65536"
        fi
    done
    for ip in "$1" "$2"; do
        echo "add KUBE-IPVS-IPS $ip"
        for proto in udp tcp; do echo "add KUBE-CLUSTER-IP $ip,$proto:53"; done
    done
    # Endpoints on this node (CoreDNS runs here, in the dns namespace), for hairpin traffic.
    for ep in "$3" "$4"; do
        for proto in udp tcp; do echo "add KUBE-LOOP-BACK $ep,$proto:53,$ep"; done
    done
}

# kube_ipvs_restore: kube-proxy's `iptables-restore --noflush` input (nat, then filter), its
# chains declared (so flushed) and filled in writeIptablesRules' order.
kube_ipvs_restore() {
    local hairpin="Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"
    local cluster="Kubernetes service cluster ip + port for masquerade purpose"
    local mark="$KUBE_MASQ_MARK/$KUBE_MASQ_MARK" chain
    echo "*nat"
    for chain in KUBE-SERVICES KUBE-POSTROUTING KUBE-NODE-PORT KUBE-LOAD-BALANCER KUBE-MARK-MASQ; do
        echo ":$chain - [0:0]"
    done
    echo "-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN"
    echo "-A KUBE-POSTROUTING -m comment --comment \"$hairpin\" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE"
    echo "-A KUBE-SERVICES -m comment --comment \"$cluster\" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s $V4_CLUSTER_CIDR -j KUBE-MARK-MASQ"
    echo "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT"
    echo "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ"
    echo "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT"
    echo "-A KUBE-POSTROUTING -m mark ! --mark $mark -j RETURN"
    echo "-A KUBE-POSTROUTING -j MARK --xor-mark $KUBE_MASQ_MARK"
    echo "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    echo "-A KUBE-MARK-MASQ -j MARK --or-mark $KUBE_MASQ_MARK"
    echo COMMIT
    echo "*filter"
    for chain in KUBE-FORWARD KUBE-NODE-PORT KUBE-PROXY-FIREWALL KUBE-SOURCE-RANGES-FIREWALL \
        KUBE-IPVS-FILTER KUBE-IPVS-OUT-FILTER; do
        echo ":$chain - [0:0]"
    done
    echo "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP"
    echo "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark $mark -j ACCEPT"
    echo "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    echo "-A KUBE-NODE-PORT -m comment --comment \"Kubernetes health check node port\" -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT"
    for chain in KUBE-LOAD-BALANCER KUBE-CLUSTER-IP KUBE-EXTERNAL-IP KUBE-EXTERNAL-IP-LOCAL; do
        echo "-A KUBE-IPVS-FILTER -m set --match-set $chain dst,dst -j RETURN"
    done
    echo "-A KUBE-IPVS-FILTER -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j RETURN"
    echo "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT"
    echo COMMIT
}

# kube_ipvs CLUSTER_DNS UPSTREAM EP1 EP2: kube-proxy's IPVS mode on the node, IPv4.
kube_ipvs() {
    local cluster_dns=$1 upstream=$2 ep1=$3 ep2=$4 ip proto flag ep spec table from_table from to comment
    { modprobe ip_vs && modprobe ip_vs_rr; } ||
        die "--kube-proxy ipvs needs the ip_vs modules (this kernel: $(uname -r)); run it in the ci/vm guest"
    in_ns node sysctl -qw net.ipv4.vs.conntrack=1 net.ipv4.vs.expire_nodest_conn=1 \
        net.ipv4.vs.expire_quiescent_template=1
    ip -n "$(ns_name node)" link add kube-ipvs0 type dummy ||
        die "--kube-proxy ipvs needs the dummy module (this kernel: $(uname -r)); run it in the ci/vm guest"
    for ip in "$cluster_dns" "$upstream"; do
        ip -n "$(ns_name node)" addr add "$ip/32" dev kube-ipvs0
        for proto in udp tcp; do
            flag=-u
            [[ $proto == tcp ]] && flag=-t
            echo "-A $flag $ip:53 -s rr"
            for ep in "$ep1" "$ep2"; do echo "-a $flag $ip:53 -r $ep:53 -m -w 1"; done
        done
    done >"$RUN_DIR/kube-proxy-ipvsadm"
    in_ns node ipvsadm -R <"$RUN_DIR/kube-proxy-ipvsadm"
    kube_ipvs_sets "$@" >"$RUN_DIR/kube-proxy-ipsets"
    in_ns node ipset restore <"$RUN_DIR/kube-proxy-ipsets"
    {
        kube_ipvs_restore
        # iptablesJumpChain, each EnsureRule(Prepend): the last one ends up first in its chain.
        for table in nat filter; do
            echo "*$table"
            for spec in "nat OUTPUT KUBE-SERVICES kubernetes service portals" \
                "nat PREROUTING KUBE-SERVICES kubernetes service portals" \
                "nat POSTROUTING KUBE-POSTROUTING kubernetes postrouting rules" \
                "filter FORWARD KUBE-FORWARD kubernetes forwarding rules" \
                "filter INPUT KUBE-NODE-PORT kubernetes health check rules" \
                "filter INPUT KUBE-PROXY-FIREWALL kube-proxy firewall rules" \
                "filter FORWARD KUBE-PROXY-FIREWALL kube-proxy firewall rules" \
                "filter INPUT KUBE-IPVS-FILTER kubernetes ipvs access filter" \
                "filter OUTPUT KUBE-IPVS-OUT-FILTER kubernetes ipvs access filter"; do
                read -r from_table from to comment <<<"$spec"
                [[ $from_table == "$table" ]] || continue
                echo "-I $from -m comment --comment \"$comment\" -j $to"
            done
            echo COMMIT
        done
    } >"$RUN_DIR/kube-proxy-ipvs.rules"
    in_ns node iptables-nft-restore -w 5 --noflush "$RUN_DIR/kube-proxy-ipvs.rules"
}
