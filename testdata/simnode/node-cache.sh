# shellcheck shell=bash
# simnode node-cache: what kubernetes-sigs/node-local-dns's node-cache does to the node besides
# serving DNS: its iptables rules (cmd/node-cache/app/cache_app.go, initIptables: per -localip, in
# this order, each put in with EnsureRule(Prepend)) and the teardown of its interface.

readonly NODE_CACHE_SKIP="NodeLocal DNS Cache: skip conntrack"
readonly NODE_CACHE_ALLOW="NodeLocal DNS Cache: allow DNS traffic"

# node_cache_each IP FN: FN TABLE CHAIN ARGS... for each of node-cache's rules for IP, in its order.
node_cache_each() {
    local ip=$1 fn=$2 proto
    local skip=(-m comment --comment "$NODE_CACHE_SKIP") allow=(-m comment --comment "$NODE_CACHE_ALLOW")
    for proto in tcp udp; do "$fn" raw PREROUTING -p "$proto" -d "$ip" --dport 53 -j NOTRACK "${skip[@]}"; done
    for proto in tcp udp; do "$fn" filter INPUT -p "$proto" -d "$ip" --dport 53 -j ACCEPT "${allow[@]}"; done
    for proto in tcp udp; do "$fn" raw OUTPUT -p "$proto" -s "$ip" --sport 53 -j NOTRACK "${skip[@]}"; done
    for proto in tcp udp; do "$fn" filter OUTPUT -p "$proto" -s "$ip" --sport 53 -j ACCEPT "${allow[@]}"; done
    # Host-network clients' queries.
    for proto in tcp udp; do "$fn" raw OUTPUT -p "$proto" -d "$ip" --dport 53 -j NOTRACK "${skip[@]}"; done
    # The health port, for the liveness probe's connections.
    "$fn" raw OUTPUT -p tcp -d "$ip" --dport 8080 -j NOTRACK "${skip[@]}"
    "$fn" raw OUTPUT -p tcp -s "$ip" --sport 8080 -j NOTRACK "${skip[@]}"
}

# k8s.io/kubernetes/pkg/util/iptables runs `iptables -w 5 [-W 100000] -C|-I|-D CHAIN -t TABLE
# ARGS...`; -W only earns "Ignoring deprecated --wait-interval option" from iptables 1.8.9.
node_cache_ensure() { # EnsureRule(Prepend)
    local table=$1 chain=$2
    shift 2
    in_ns node "$NC_IPT" -w 5 -C "$chain" -t "$table" "$@" 2>/dev/null ||
        in_ns node "$NC_IPT" -w 5 -I "$chain" -t "$table" "$@"
}
node_cache_delete() { # every copy, like TeardownNetworking
    local table=$1 chain=$2
    shift 2
    while in_ns node "$NC_IPT" -w 5 -C "$chain" -t "$table" "$@" 2>/dev/null; do
        in_ns node "$NC_IPT" -w 5 -D "$chain" -t "$table" "$@"
    done
}

cmd_node_cache_rules() {
    local fn=node_cache_ensure ip
    while (($#)); do
        case $1 in
        --remove) fn=node_cache_delete; shift ;;
        *) usage ;;
        esac
    done
    load_state
    for NC_IPT in $(ipt_families); do
        if [[ "$NC_IPT" == ip6* ]]; then
            for ip in "$V6_LOCAL_IP" "$V6_CLUSTER_DNS"; do node_cache_each "$ip" "$fn"; done
        else
            for ip in "$V4_LOCAL_IP" "$V4_CLUSTER_DNS"; do node_cache_each "$ip" "$fn"; done
        fi
    done
}

# listen-addrs-del|listen-addrs-add: node-cache's teardown of its interface (it deletes its dummy
# interface `nodelocaldns` on SIGTERM unless -skipteardown): the node-local IPs off the listen
# device (lo or that dummy), the cache left running; and back. Prints when it was done.
cmd_listen_addrs() {
    load_state
    if has_v4; then listen_ips "$1" 4; fi
    if has_v6; then listen_ips "$1" 6; fi
    now_ms
}
