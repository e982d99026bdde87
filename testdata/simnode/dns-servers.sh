# shellcheck shell=bash
# simnode DNS servers: the node-local cache (unbound, in the node namespace, on the node-local
# IPs) answering who.test with 1.1.1.1, and "CoreDNS" (dnsmasq, in the dns namespace, on the
# endpoints behind the kube-dns Services) answering 2.2.2.2, so every answer says who gave it.

dig_answers() { # dig_answers ROLE SERVER NAME WANT [DIG_ARGS...]: the first answer is WANT
    [[ "$(in_ns "$1" dig +time=1 +tries=1 +short "${@:5}" "@$2" "$3" | head -n1)" == "$4" ]]
}
dig_servfail() { # dig_servfail ROLE SERVER NAME [DIG_ARGS...]
    in_ns "$1" dig +time=1 +tries=1 "${@:4}" "@$2" "$3" | grep -q 'status: SERVFAIL'
}
# The cache's own address is asked from the loopback address, as the agent probes it: a query to
# the link-local IP from any other source may be the agent's forwarder's to answer (when the
# route is Upstream), and the check must see the cache itself.
from_loopback() { # from_loopback SERVER: dig's source option
    if [[ $1 == *:* ]]; then echo "-b ::1"; else echo "-b 127.0.0.1"; fi
}

# udp_listener PID IP: process PID has a UDP socket bound to IP:53 in the node namespace.
udp_listener() {
    local addr=$2
    if [[ $addr == *:* ]]; then addr="[$addr]"; fi
    in_ns node ss -Hulnp "src $addr and sport = :53" | grep -q "pid=$1,"
}

# cache-start [--mode normal|servfail] [--no-wait] [--bind own|wildcard]: unbound from
# unbound.conf.in (with the real parts, node-cache with node-local-dns's Corefile: real_cache_conf
# in real.sh), answering who.test itself and forwarding the rest to the kube-dns-upstream Service
# (normal), or answering SERVFAIL to everything (servfail: no upstream it can reach). --bind
# wildcard (the real parts): node-cache's Corefile binds 0.0.0.0 (and ::) instead of its listen
# IPs, as deliveryhero's chart's default config.bindIp=false has it.
# cache2-start (the same options): a second cache, same config (its own file, pidfile and
# log), on the same IPs and port: kubespray's `nodelocaldns-second`. Both set SO_REUSEPORT
# (unbound.conf.in; node-cache's CoreDNS always does), so the kernel puts their sockets in one reuseport
# group and hashes each query's source address and port to one of them.
cmd_cache_start() { # cmd_cache_start SVC [options]: SVC is cache or cache2
    local svc=$1 mode=normal ips=() ip wait=1
    CACHE_BIND=own
    shift
    while (($#)); do
        case $1 in
        --mode) mode=${2:-}; shift 2 || usage ;;
        --no-wait) wait=0; shift ;;
        --bind) CACHE_BIND=${2:-}; shift 2 || usage ;;
        *) usage ;;
        esac
    done
    [[ "$mode" =~ ^(normal|servfail)$ ]] || die "--mode must be normal or servfail"
    [[ "$CACHE_BIND" =~ ^(own|wildcard)$ ]] || die "--bind must be own or wildcard"
    load_state
    [[ $CACHE_BIND == own ]] || is_real || die "--bind wildcard: the real parts' node-cache only (--kube-proxy real-*)"
    if has_v4; then ips+=("$V4_LOCAL_IP" "$V4_CLUSTER_DNS"); fi
    if has_v6; then ips+=("$V6_LOCAL_IP" "$V6_CLUSTER_DNS"); fi
    # An endpoint of kube-dns at the node's address (prefer-same-node, real parts).
    if [[ -f $RUN_DIR/prefer-same-node ]]; then ips+=("$V4_CP_NODE"); fi
    local server=$V4_LOCAL_IP
    has_v4 || server=$V6_LOCAL_IP
    if [[ $FILTER_LO == loopback ]]; then
        # The host firewall drops what reaches the node-local IPs from the node itself: check
        # readiness on loopback (see --filter-drop in firewall.sh).
        server=127.0.0.1
        has_v4 || server=::1
        ips+=("$server")
    fi
    local cmd
    if is_real; then
        cmd=$(real_cache_conf "$svc" "$mode" "${ips[@]}")
    else
        cmd=$(unbound_conf "$svc" "$mode" "${ips[@]}")
    fi

    echo "--- $svc-start --mode $mode" >>"$RUN_DIR/$svc.log"
    local at
    at=$(now_ms)
    # shellcheck disable=SC2086 # the command's words: no spaces in our paths
    svc_start "$svc" node $cmd
    if ((!wait)); then
        echo "$at"
        return
    fi
    # How long the cache may take to answer: unbound starts in well under a second; the real
    # parts' cache (node-cache, CoreDNS inside) took over 10 s in the ci/vm guest, two guests
    # sharing the machine's cores beside the real control plane.
    local ready=10
    ! is_real || ready=60
    # With the other cache running, it may answer the check below: see that this one has bound
    # every listen IP too.
    local pid other=cache2
    [[ $svc == cache ]] || other=cache
    if svc_pid "$other" >/dev/null; then
        pid=$(svc_pid "$svc") || die "$svc exited (log: $RUN_DIR/$svc.log)"
        for ip in "${ips[@]}"; do
            wait_for "$ready" "$svc to listen on $ip:53" udp_listener "$pid" "$ip"
        done
    fi
    if [[ $mode == normal ]]; then
        # shellcheck disable=SC2046 # two words: -b ADDR
        wait_for "$ready" "the cache to answer $PROBE_NAME" dig_answers node "$server" "$PROBE_NAME" "$CACHE_A" $(from_loopback "$server")
    else
        # shellcheck disable=SC2046
        wait_for "$ready" "the cache to answer SERVFAIL" dig_servfail node "$server" "$PROBE_NAME" $(from_loopback "$server")
    fi
    svc_pid "$svc" || die "$svc exited (log: $RUN_DIR/$svc.log)"
}

# unbound_conf SVC MODE IP...: writes unbound's configuration for cache SVC listening on the IPs
# and prints the command that runs it.
unbound_conf() {
    local svc=$1 mode=$2 interfaces="" local_data="" forward="" mode_options="" conf ip
    shift 2
    for ip; do interfaces+="    interface: $ip"$'\n'; done
    if [[ $mode == normal ]]; then
        local_data="    local-zone: \"$PROBE_NAME.\" static"$'\n'
        local_data+="    local-data: \"$PROBE_NAME. 30 IN A $CACHE_A\""$'\n'
        local_data+="    local-data: \"$PROBE_NAME. 30 IN AAAA $CACHE_AAAA\""$'\n'
        if has_v4; then forward+="    forward-addr: $V4_UPSTREAM"$'\n'; fi
        if has_v6; then forward+="    forward-addr: $V6_UPSTREAM"$'\n'; fi
    else
        # Nothing listens on port 1. unbound treats the ECONNREFUSED like a timeout and retries
        # with a growing timeout: with the default 120 s cap the first queries hang for over
        # 15 s. Capped at 10 ms, the first query gets SERVFAIL after ~25 ms; the upstream is
        # then marked down (for infra-host-ttl, 900 s) and every query gets SERVFAIL at once.
        forward="    forward-addr: 127.0.0.1@1"$'\n'
        mode_options="    infra-cache-max-rtt: 10"$'\n'
    fi
    conf=$(<"$SCRIPT_DIR/unbound.conf.in")
    conf=${conf//@RUN_DIR@/$RUN_DIR}
    conf=${conf//@INTERFACES@/${interfaces%$'\n'}}
    conf=${conf//@MODE_OPTIONS@/${mode_options%$'\n'}}
    conf=${conf//@LOCAL_DATA@/${local_data%$'\n'}}
    conf=${conf//@FORWARD_ADDRS@/${forward%$'\n'}}
    local file="$RUN_DIR/unbound.conf"
    [[ $svc == cache ]] || file="$RUN_DIR/unbound-$svc.conf"
    printf '%s\n' "$conf" >"$file"
    unbound-checkconf "$file" >/dev/null || die "bad unbound config $file"
    echo "unbound -d -p -c $file"
}

# coredns-start: dnsmasq on both endpoint IPs, ready once each answers and the upstream Service
# reaches it.
cmd_coredns_start() {
    local args=() ip
    load_state
    if is_real; then
        real_coredns_start
        return
    fi
    args=(dnsmasq --keep-in-foreground --conf-file=/dev/null --no-resolv --no-hosts
        --bind-interfaces --port=53 --user=root --pid-file --log-facility=-
        "--address=/$PROBE_NAME/$COREDNS_A" "--address=/$PROBE_NAME/$COREDNS_AAAA"
        --address=/kubernetes.default.svc.cluster.local/10.96.0.1
        --address=/kubernetes.default.svc.cluster.local/fd00:96::1)
    if has_v4; then for ip in "${V4_DNS_EPS[@]}"; do args+=("--listen-address=$ip"); done; fi
    if has_v6; then for ip in "${V6_DNS_EPS[@]}"; do args+=("--listen-address=$ip"); done; fi

    echo "--- coredns-start" >>"$RUN_DIR/coredns.log"
    svc_start coredns dns "${args[@]}"
    local eps=() upstream
    if has_v4; then eps=("${V4_DNS_EPS[@]}") upstream=$V4_UPSTREAM; else eps=("${V6_DNS_EPS[@]}") upstream=$V6_UPSTREAM; fi
    for ip in "${eps[@]}"; do
        wait_for 10 "CoreDNS endpoint $ip" dig_answers node "$ip" "$PROBE_NAME" "$COREDNS_A"
    done
    wait_for 10 "CoreDNS through the upstream Service" dig_answers node "$upstream" "$PROBE_NAME" "$COREDNS_A"
    svc_pid coredns || die "CoreDNS exited (log: $RUN_DIR/coredns.log)"
}

