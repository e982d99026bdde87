# shellcheck shell=bash
# simnode kube-proxy, iptables modes (--kube-proxy iptables-nft|iptables-legacy): in that binary,
# the nat table's KUBE-SERVICES / KUBE-SVC-* / KUBE-SEP-*, jumped to from PREROUTING and OUTPUT,
# and its filter chains with their jumps from INPUT, FORWARD and OUTPUT; besides them kubelet's
# KUBE-KUBELET-CANARY (mangle, nat, filter) and KUBE-IPTABLES-HINT (mangle) chains, in the same
# binary. The resync loop (noise.sh) rewrites them as kube-proxy's periodic sync does.
#
# Chain names are computed like kube-proxy's: "KUBE-SVC-" + the first 16 base32 chars of
# sha256(servicePortName + protocol), e.g. KUBE-SVC-TCOU7JCQXEZGVUNU for kube-system/kube-dns:dns
# udp; "KUBE-SEP-" likewise with the endpoint appended.

kube_hash() {
    local hex escaped="" i b32
    hex=$(printf '%s' "$1" | sha256sum)
    for ((i = 0; i < 64; i += 2)); do escaped+="\\x${hex:i:2}"; done
    b32=$(printf '%b' "$escaped" | base32)
    echo "${b32:0:16}"
}

# kube_service_restore CLUSTER_IP SVC_NAME EP1 EP2: append to KP_CHAINS / KP_RULES the chains and
# iptables-restore rules for udp/53 ("dns") and tcp/53 ("dns-tcp").
kube_service_restore() {
    local ip=$1 svc=$2 ep1=$3 ep2=$4 plen=32 proto port_name spn svc_chain ep sep dest
    [[ "$ip" == *:* ]] && plen=128
    for proto in udp tcp; do
        port_name=dns
        [[ $proto == tcp ]] && port_name=dns-tcp
        spn="kube-system/$svc:$port_name"
        svc_chain="KUBE-SVC-$(kube_hash "$spn$proto")"
        KP_CHAINS+=("$svc_chain")
        KP_RULES+=("-A KUBE-SERVICES -d $ip/$plen -p $proto -m comment --comment \"$spn cluster IP\" -m $proto --dport 53 -j $svc_chain")
        for ep in "$ep1" "$ep2"; do
            dest="$ep:53"
            [[ "$ep" == *:* ]] && dest="[$ep]:53"
            sep="KUBE-SEP-$(kube_hash "$spn$proto$dest")"
            KP_CHAINS+=("$sep")
            KP_RULES+=("-A $sep -p $proto -m comment --comment \"$spn\" -m $proto -j DNAT --to-destination $dest")
            if [[ "$ep" == "$ep1" ]]; then
                KP_RULES+=("-A $svc_chain -m comment --comment \"$spn -> $dest\" -m statistic --mode random --probability 0.50000000000 -j $sep")
            else
                KP_RULES+=("-A $svc_chain -m comment --comment \"$spn -> $dest\" -j $sep")
            fi
        done
    done
}

# kube_nat_restore CLUSTER_DNS UPSTREAM EP1 EP2: kube-proxy's nat table as its syncProxyRules
# writes it for `iptables-restore --noflush`: every KUBE-* chain declared (so flushed), then its
# rules.
kube_nat_restore() {
    KP_CHAINS=(KUBE-SERVICES) KP_RULES=()
    kube_service_restore "$1" kube-dns "$3" "$4"
    kube_service_restore "$2" kube-dns-upstream "$3" "$4"
    echo "*nat"
    printf ':%s - [0:0]\n' "${KP_CHAINS[@]}"
    printf '%s\n' "${KP_RULES[@]}"
    echo COMMIT
}

# The jumps kube-proxy keeps in the built-in chains (with EnsureRule(Prepend) on every sync).
readonly KUBE_PORTALS=(-m comment --comment "kubernetes service portals" -j KUBE-SERVICES)
# Its filter jumps (pkg/proxy/iptables/proxier.go iptablesJumpChains), as "BUILTIN CHAIN COMMENT".
readonly KUBE_FILTER_JUMPS=(
    "INPUT KUBE-PROXY-FIREWALL kubernetes load balancer firewall"
    "INPUT KUBE-NODEPORTS kubernetes health check service ports"
    "INPUT KUBE-EXTERNAL-SERVICES kubernetes externally-visible service portals"
    "FORWARD KUBE-FORWARD kubernetes forwarding rules"
    "FORWARD KUBE-SERVICES kubernetes service portals"
    "OUTPUT KUBE-SERVICES kubernetes service portals"
)

# kube_filter_restore IPT ROUND: kube-proxy's filter table as its syncProxyRules writes it on
# every sync (every chain declared, so flushed and rewritten). Endpoint churn: in odd rounds a
# Service has no endpoints and gets its REJECT rule, in even rounds it has one again.
kube_filter_restore() {
    local ipt=$1 round=$2 svc=10.100.255.1/32
    [[ "$ipt" == ip6* ]] && svc=fd00:100::1/128
    echo "*filter"
    printf ':%s - [0:0]\n' KUBE-SERVICES KUBE-EXTERNAL-SERVICES KUBE-FORWARD KUBE-NODEPORTS KUBE-PROXY-FIREWALL
    if ((round % 2)); then
        echo "-A KUBE-SERVICES -d $svc -p tcp -m comment --comment \"simnode/churn:http has no endpoints\" -m tcp --dport 80 -j REJECT"
    fi
    echo "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"
    echo "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT"
    echo "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    echo COMMIT
}

# kube_filter_jumps IPT [RUNNER...]: EnsureRule(Prepend) of kube-proxy's filter jumps (-C, else
# -I), each command run through RUNNER (e.g. `in_ns node`).
kube_filter_jumps() {
    local ipt=$1 jump builtin chain comment
    shift
    for jump in "${KUBE_FILTER_JUMPS[@]}"; do
        read -r builtin chain comment <<<"$jump"
        local spec=(-m comment --comment "$comment" -j "$chain")
        if [[ $chain != KUBE-NODEPORTS && $chain != KUBE-FORWARD ]]; then
            spec=(-m conntrack --ctstate NEW "${spec[@]}")
        fi
        "$@" "$ipt" -w 5 -t filter -C "$builtin" "${spec[@]}" 2>/dev/null ||
            "$@" "$ipt" -w 5 -t filter -I "$builtin" "${spec[@]}" || return 1
    done
}

# kube_filter_jumps_restore: kube_filter_jumps's result on chains that had none, as a filter
# section (`-I` in the same order, so the same order in the built-in chains).
kube_filter_jumps_restore() {
    local jump builtin chain comment ctstate
    echo "*filter"
    for jump in "${KUBE_FILTER_JUMPS[@]}"; do
        read -r builtin chain comment <<<"$jump"
        ctstate="-m conntrack --ctstate NEW "
        [[ $chain == KUBE-NODEPORTS || $chain == KUBE-FORWARD ]] && ctstate=
        echo "-I $builtin $ctstate-m comment --comment \"$comment\" -j $chain"
    done
    echo COMMIT
}

# kube_iptables_rules IPT CLUSTER_DNS UPSTREAM EP1 EP2: kube-proxy in IPT's iptables mode for one
# family, with kubelet's chains in the same binary. What kubelet's and kube-proxy's first sync
# leave (kubelet's canaries and hint chain, kube-proxy's portals jumps, its nat and filter
# tables, its filter jumps) is written by one iptables-restore: each of their separate commands
# would be a process, and a process costs ~0.2 s in the test bed's TCG guest.
kube_iptables_rules() {
    local ipt=$1 v=4 portals='-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    [[ "$ipt" == ip6* ]] && v=6
    # The noise loop's resync restores this file again.
    kube_nat_restore "$2" "$3" "$4" "$5" >"$RUN_DIR/kube-proxy-nat-v$v.rules"
    {
        # kubelet's canaries (and its hint chain) tell iptables-wrappers which backend is in use.
        printf '*mangle\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n'
        printf '*nat\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-SERVICES - [0:0]\n'
        printf -- '-A %s %s\n' PREROUTING "$portals" OUTPUT "$portals"
        echo COMMIT
        cat "$RUN_DIR/kube-proxy-nat-v$v.rules"
        printf '*filter\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n'
        kube_filter_restore "$ipt" 0
        kube_filter_jumps_restore
    } >"$RUN_DIR/kube-iptables-v$v.rules"
    in_ns node "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-iptables-v$v.rules"
}
