#!/usr/bin/env bash
# simnode.sh: a simulated Kubernetes node in network namespaces, for integration tests and demos.
#
#   $P-pod1 (eth0 10.244.0.2)   $P-pod2 (eth0 10.244.0.3)     $P-dns ("CoreDNS": dnsmasq)
#            |                          |                      eth0 10.244.1.2, 10.244.1.3
#          veth                       veth                            |
#            |                          |                           veth
#   +--------+------ pod1 ---- pod2 ----+-------------------- dns ----+------------------+
#   | $P-node   10.244.0.1/32 on pod1/pod2, /32 routes     10.244.1.1/24 on dns          |
#   |   lo: 169.254.20.10 (node-local IP), 10.96.0.10 (kube-dns ClusterIP)               |
#   |   "node-local-dns": unbound on those two IPs, forwarding to 10.96.0.11             |
#   |   kube-proxy-shaped iptables nat rules (iptables-nft or iptables-legacy):          |
#   |     10.96.0.10:53 (kube-dns)          -> DNAT 10.244.1.2:53 | 10.244.1.3:53        |
#   |     10.96.0.11:53 (kube-dns-upstream) -> DNAT 10.244.1.2:53 | 10.244.1.3:53        |
#   +------------------------------------------------------------------------------------+
#
# A pod's query to 10.96.0.10 is DNATed to "CoreDNS" (answers who.test = 2.2.2.2) unless a raw
# NOTRACK rule skips conntrack, then the node-local cache answers it (who.test = 1.1.1.1).
# IPv6 (--family 6|dual): pods fd00:244::2/::3, node fd00:244::1, dns fd00:244:1::2/::3,
# node lo fd00:169:254::10 (local IP) and fd00:96::10 (cluster DNS), upstream fd00:96::11;
# who.test AAAA is fd00::1:1:1:1 from the cache, fd00::2:2:2:2 from CoreDNS.
#
# Usage: simnode.sh CMD PREFIX [args]   (PREFIX: 1-8 chars [a-z0-9]; namespaces are $PREFIX-*)
#   up PREFIX [--kube-proxy iptables-nft|iptables-legacy] [--family 4|6|dual]
#   down PREFIX
#   cache-start PREFIX [--mode normal|servfail]   cache-kill|cache-stop|cache-cont|cache-pid PREFIX
#     (kill, stop and cont print when the signal went out, in ms since the epoch)
#   coredns-start PREFIX                          coredns-kill|coredns-stop|coredns-cont|coredns-pid PREFIX
#   exec PREFIX node|pod1|pod2|dns CMD...
# State (configs, pidfiles, logs) lives in ${SIMNODE_DIR:-/tmp/simnode}/PREFIX.
# Nothing here touches the root network namespace. Set SIMNODE_TRACE=1 to trace.
set -euo pipefail
if [[ -n "${SIMNODE_TRACE:-}" ]]; then set -x; fi

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
readonly ROLES=(node pod1 pod2 dns)

# IPv4 plan.
readonly V4_NODE_POD=10.244.0.1 V4_POD1=10.244.0.2 V4_POD2=10.244.0.3
readonly V4_NODE_DNS=10.244.1.1 V4_DNS_EPS=(10.244.1.2 10.244.1.3)
readonly V4_LOCAL_IP=169.254.20.10 V4_CLUSTER_DNS=10.96.0.10 V4_UPSTREAM=10.96.0.11
readonly V4_SERVICE_CIDR=10.96.0.0/12
# IPv6 plan.
readonly V6_NODE_POD=fd00:244::1 V6_POD1=fd00:244::2 V6_POD2=fd00:244::3
readonly V6_NODE_DNS=fd00:244:1::1 V6_DNS_EPS=(fd00:244:1::2 fd00:244:1::3)
readonly V6_LOCAL_IP=fd00:169:254::10 V6_CLUSTER_DNS=fd00:96::10 V6_UPSTREAM=fd00:96::11
readonly V6_SERVICE_CIDR=fd00:96::/108
# Answers that tell who answered.
readonly CACHE_A=1.1.1.1 CACHE_AAAA=fd00::1:1:1:1 COREDNS_A=2.2.2.2 COREDNS_AAAA=fd00::2:2:2:2
readonly PROBE_NAME=who.test

die() { echo "simnode: $*" >&2; exit 1; }
usage() { sed -n '/^# Usage:/,/^# Nothing here/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

ns_name() { echo "$PREFIX-$1"; }
in_ns() { local role=$1; shift; ip netns exec "$(ns_name "$role")" "$@"; }
ns_exists() { [[ -e "/run/netns/$(ns_name "$1")" ]]; }

now_ms() { local t=${EPOCHREALTIME/./}; echo $((10#$t / 1000)); }

# wait_for SECONDS WHAT CMD...: poll CMD until it succeeds, or fail after SECONDS.
wait_for() {
    local secs=$1 what=$2 deadline
    deadline=$(($(now_ms) + secs * 1000))
    shift 2
    until "$@" >/dev/null 2>&1; do
        (($(now_ms) < deadline)) || die "timed out after ${secs}s waiting for $what"
        sleep 0.05
    done
}

has_v4() { [[ "$FAMILY" != 6 ]]; }
has_v6() { [[ "$FAMILY" != 4 ]]; }
load_state() {
    [[ -f "$RUN_DIR/family" ]] || die "$PREFIX is not up (no $RUN_DIR/family)"
    FAMILY=$(<"$RUN_DIR/family")
}

# ---------------------------------------------------------------------------------------------
# Processes: each daemon is started in the foreground by `ip netns exec` (which execs it, so $!
# is the daemon's pid), recorded in $RUN_DIR/<svc>.pid. Signals go only to that recorded pid,
# and only while /proc/<pid>/comm still names the program we started.

svc_comm() { case $1 in cache) echo unbound ;; coredns) echo dnsmasq ;; *) die "bad service $1" ;; esac; }

pid_running() { # pid_running PID: exists and is not a zombie
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) } # the fields after "pid (comm) "
    [[ "${stat%% *}" != [ZX] ]]
}

# svc_pid SVC: print the recorded pid if that process is still running the program we started.
svc_pid() {
    local pidfile="$RUN_DIR/$1.pid" pid comm
    [[ -f "$pidfile" ]] || return 1
    pid=$(<"$pidfile")
    [[ "$pid" =~ ^[0-9]+$ ]] && pid_running "$pid" || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ "$comm" == "$(svc_comm "$1")" ]] || return 1
    echo "$pid"
}

svc_start() { # svc_start SVC ROLE CMD...
    local svc=$1 role=$2
    shift 2
    if svc_pid "$svc" >/dev/null; then die "$svc already running (pid $(svc_pid "$svc"))"; fi
    # A simple command (not the in_ns function), so that the background job execs ip, which
    # execs the daemon: $! is then the daemon's pid.
    ip netns exec "$(ns_name "$role")" "$@" </dev/null >>"$RUN_DIR/$svc.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$RUN_DIR/$svc.pid"
    # Until the daemon has been exec'd, /proc/<pid>/comm names bash or ip.
    local deadline=$(($(now_ms) + 5000))
    until svc_pid "$svc" >/dev/null; do
        if ! pid_running "$pid" || (($(now_ms) > deadline)); then
            tail -n 5 "$RUN_DIR/$svc.log" >&2
            die "$svc failed to start (log: $RUN_DIR/$svc.log)"
        fi
        sleep 0.01
    done
}

svc_gone() { ! svc_pid "$1" >/dev/null; }

svc_kill() {
    local pid
    if pid=$(svc_pid "$1"); then
        kill -CONT "$pid" 2>/dev/null || true
        local at
        at=$(now_ms)
        kill -KILL "$pid" 2>/dev/null || true
        echo "$at" # when the signal went out (ms since the epoch), for tests to line events up
        wait_for 5 "$1 (pid $pid) to exit" svc_gone "$1"
    fi
    rm -f "$RUN_DIR/$1.pid"
}

svc_signal() { # svc_signal SVC SIG
    local pid
    pid=$(svc_pid "$1") || die "$1 is not running"
    local at
    at=$(now_ms)
    kill "-$2" "$pid"
    echo "$at" # when the signal went out (ms since the epoch)
}

# ---------------------------------------------------------------------------------------------
# kube-proxy-shaped rules. Chain names are computed like kube-proxy's: "KUBE-SVC-" + the first
# 16 base32 chars of sha256(servicePortName + protocol), e.g. KUBE-SVC-TCOU7JCQXEZGVUNU for
# kube-system/kube-dns:dns udp; "KUBE-SEP-" likewise with the endpoint appended.

kube_hash() {
    local hex escaped="" i
    hex=$(printf '%s' "$1" | sha256sum | cut -c1-64)
    for ((i = 0; i < 64; i += 2)); do escaped+="\\x${hex:i:2}"; done
    printf '%b' "$escaped" | base32 | cut -c1-16
}

# kube_service IPT CLUSTER_IP SVC_NAME EP1 EP2: rules for udp/53 ("dns") and tcp/53 ("dns-tcp").
kube_service() {
    local ipt=$1 ip=$2 svc=$3 ep1=$4 ep2=$5 plen=32 proto port_name spn svc_chain ep sep dest
    [[ "$ip" == *:* ]] && plen=128
    for proto in udp tcp; do
        port_name=dns
        [[ $proto == tcp ]] && port_name=dns-tcp
        spn="kube-system/$svc:$port_name"
        svc_chain="KUBE-SVC-$(kube_hash "$spn$proto")"
        in_ns node "$ipt" -t nat -N "$svc_chain"
        in_ns node "$ipt" -t nat -A KUBE-SERVICES -d "$ip/$plen" -p "$proto" \
            -m comment --comment "$spn cluster IP" -m "$proto" --dport 53 -j "$svc_chain"
        for ep in "$ep1" "$ep2"; do
            dest="$ep:53"
            [[ "$ep" == *:* ]] && dest="[$ep]:53"
            sep="KUBE-SEP-$(kube_hash "$spn$proto$dest")"
            in_ns node "$ipt" -t nat -N "$sep"
            in_ns node "$ipt" -t nat -A "$sep" -p "$proto" -m comment --comment "$spn" \
                -m "$proto" -j DNAT --to-destination "$dest"
            if [[ "$ep" == "$ep1" ]]; then
                in_ns node "$ipt" -t nat -A "$svc_chain" -m comment --comment "$spn -> $dest" \
                    -m statistic --mode random --probability 0.50000000000 -j "$sep"
            else
                in_ns node "$ipt" -t nat -A "$svc_chain" -m comment --comment "$spn -> $dest" -j "$sep"
            fi
        done
    done
}

kube_rules() { # kube_rules IPT CLUSTER_DNS UPSTREAM EP1 EP2
    local ipt=$1 table
    # kubelet's canaries (and its hint chain) tell iptables-wrappers which backend is in use.
    for table in mangle nat filter; do in_ns node "$ipt" -t "$table" -N KUBE-KUBELET-CANARY; done
    in_ns node "$ipt" -t mangle -N KUBE-IPTABLES-HINT
    in_ns node "$ipt" -t nat -N KUBE-SERVICES
    in_ns node "$ipt" -t nat -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
    in_ns node "$ipt" -t nat -A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
    kube_service "$ipt" "$2" kube-dns "$4" "$5"
    kube_service "$ipt" "$3" kube-dns-upstream "$4" "$5"
}

# ---------------------------------------------------------------------------------------------

# add_pod ROLE V4 V6: a pod namespace behind a veth named ROLE on the node, Calico-style /32s.
add_pod() {
    local role=$1 v4=$2 v6=$3
    ip -n "$(ns_name node)" link add "$role" type veth peer name eth0 netns "$(ns_name "$role")"
    ip -n "$(ns_name node)" link set "$role" up
    ip -n "$(ns_name "$role")" link set eth0 up
    if has_v4; then
        ip -n "$(ns_name node)" addr add "$V4_NODE_POD/32" dev "$role"
        ip -n "$(ns_name node)" route add "$v4/32" dev "$role"
        ip -n "$(ns_name "$role")" addr add "$v4/32" dev eth0
        ip -n "$(ns_name "$role")" route add "$V4_NODE_POD/32" dev eth0
        ip -n "$(ns_name "$role")" route add default via "$V4_NODE_POD" dev eth0
    fi
    if has_v6; then
        ip -n "$(ns_name node)" addr add "$V6_NODE_POD/128" dev "$role" nodad
        ip -n "$(ns_name node)" -6 route add "$v6/128" dev "$role"
        ip -n "$(ns_name "$role")" addr add "$v6/128" dev eth0 nodad
        ip -n "$(ns_name "$role")" -6 route add "$V6_NODE_POD/128" dev eth0
        ip -n "$(ns_name "$role")" -6 route add default via "$V6_NODE_POD" dev eth0
    fi
}

add_dns() {
    local ep
    ip -n "$(ns_name node)" link add dns type veth peer name eth0 netns "$(ns_name dns)"
    ip -n "$(ns_name node)" link set dns up
    ip -n "$(ns_name dns)" link set eth0 up
    if has_v4; then
        ip -n "$(ns_name node)" addr add "$V4_NODE_DNS/24" dev dns
        for ep in "${V4_DNS_EPS[@]}"; do ip -n "$(ns_name dns)" addr add "$ep/24" dev eth0; done
        ip -n "$(ns_name dns)" route add default via "$V4_NODE_DNS" dev eth0
        # The node's own packets to a ClusterIP need a route before OUTPUT's DNAT rewrites
        # them (a real node uses its default route).
        ip -n "$(ns_name node)" route add "$V4_SERVICE_CIDR" dev dns
    fi
    if has_v6; then
        ip -n "$(ns_name node)" addr add "$V6_NODE_DNS/64" dev dns nodad
        for ep in "${V6_DNS_EPS[@]}"; do ip -n "$(ns_name dns)" addr add "$ep/64" dev eth0 nodad; done
        ip -n "$(ns_name dns)" -6 route add default via "$V6_NODE_DNS" dev eth0
        ip -n "$(ns_name node)" -6 route add "$V6_SERVICE_CIDR" dev dns
    fi
}

cmd_up() {
    local kube_proxy=iptables-nft role
    FAMILY=4
    while (($#)); do
        case $1 in
        --kube-proxy) kube_proxy=${2:-}; shift 2 || usage ;;
        --family) FAMILY=${2:-}; shift 2 || usage ;;
        *) usage ;;
        esac
    done
    [[ "$kube_proxy" =~ ^iptables-(nft|legacy)$ ]] || die "--kube-proxy must be iptables-nft or iptables-legacy"
    [[ "$FAMILY" =~ ^(4|6|dual)$ ]] || die "--family must be 4, 6 or dual"
    for role in "${ROLES[@]}"; do
        ! ns_exists "$role" || die "namespace $(ns_name "$role") already exists (run: $0 down $PREFIX)"
    done

    # From here on, a failure tears down whatever was set up.
    trap 'up_failed $?' EXIT
    rm -rf "$RUN_DIR"
    mkdir -p "$RUN_DIR"
    echo "$FAMILY" >"$RUN_DIR/family"
    echo "$kube_proxy" >"$RUN_DIR/kube-proxy"

    for role in "${ROLES[@]}"; do
        ip netns add "$(ns_name "$role")"
        ip -n "$(ns_name "$role")" link set lo up
        # Set before any veth exists, so new interfaces inherit it: v6 addresses usable at once.
        in_ns "$role" sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0
    done
    in_ns node sysctl -qw net.ipv4.ip_forward=1
    if has_v6; then in_ns node sysctl -qw net.ipv6.conf.all.forwarding=1; fi

    add_pod pod1 "$V4_POD1" "$V6_POD1"
    add_pod pod2 "$V4_POD2" "$V6_POD2"
    add_dns
    if has_v4; then
        ip -n "$(ns_name node)" addr add "$V4_LOCAL_IP/32" dev lo
        ip -n "$(ns_name node)" addr add "$V4_CLUSTER_DNS/32" dev lo
        kube_rules "$kube_proxy" "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
    else
        # kubelet creates its canaries in both families even on a single-stack node.
        local table
        for table in mangle nat filter; do in_ns node "$kube_proxy" -t "$table" -N KUBE-KUBELET-CANARY; done
    fi
    if has_v6; then
        ip -n "$(ns_name node)" addr add "$V6_LOCAL_IP/128" dev lo nodad
        ip -n "$(ns_name node)" addr add "$V6_CLUSTER_DNS/128" dev lo nodad
        kube_rules "ip6${kube_proxy#ip}" "$V6_CLUSTER_DNS" "$V6_UPSTREAM" "${V6_DNS_EPS[@]}"
    fi
    trap - EXIT
    echo "simnode $PREFIX up: family $FAMILY, kube-proxy $kube_proxy, namespaces ${ROLES[*]/#/$PREFIX-}"
}

up_failed() {
    trap - EXIT
    if (($1 != 0)); then
        echo "simnode: up $PREFIX failed, cleaning up" >&2
        cmd_down
    fi
}

cmd_down() {
    local role
    if [[ -d "$RUN_DIR" ]]; then
        svc_kill cache
        svc_kill coredns
    fi
    for role in "${ROLES[@]}"; do
        if ns_exists "$role"; then ip netns delete "$(ns_name "$role")"; fi
    done
    rm -rf "$RUN_DIR"
}

# ---------------------------------------------------------------------------------------------

dig_answers() { # dig_answers ROLE SERVER NAME WANT: the first answer is WANT
    [[ "$(in_ns "$1" dig +time=1 +tries=1 +short "@$2" "$3" | head -n1)" == "$4" ]]
}
dig_servfail() { # dig_servfail ROLE SERVER NAME
    in_ns "$1" dig +time=1 +tries=1 "@$2" "$3" | grep -q 'status: SERVFAIL'
}

cmd_cache_start() {
    local mode=normal interfaces="" local_data="" forward="" mode_options="" conf ip
    while (($#)); do
        case $1 in
        --mode) mode=${2:-}; shift 2 || usage ;;
        *) usage ;;
        esac
    done
    [[ "$mode" =~ ^(normal|servfail)$ ]] || die "--mode must be normal or servfail"
    load_state
    if has_v4; then
        for ip in "$V4_LOCAL_IP" "$V4_CLUSTER_DNS"; do interfaces+="    interface: $ip"$'\n'; done
    fi
    if has_v6; then
        for ip in "$V6_LOCAL_IP" "$V6_CLUSTER_DNS"; do interfaces+="    interface: $ip"$'\n'; done
    fi
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
    printf '%s\n' "$conf" >"$RUN_DIR/unbound.conf"
    unbound-checkconf "$RUN_DIR/unbound.conf" >/dev/null || die "bad unbound config $RUN_DIR/unbound.conf"

    echo "--- cache-start --mode $mode" >>"$RUN_DIR/cache.log"
    svc_start cache node unbound -d -p -c "$RUN_DIR/unbound.conf"
    local server=$V4_LOCAL_IP
    has_v4 || server=$V6_LOCAL_IP
    if [[ $mode == normal ]]; then
        wait_for 10 "the cache to answer $PROBE_NAME" dig_answers node "$server" "$PROBE_NAME" "$CACHE_A"
    else
        wait_for 10 "the cache to answer SERVFAIL" dig_servfail node "$server" "$PROBE_NAME"
    fi
    svc_pid cache || die "the cache exited (log: $RUN_DIR/cache.log)"
}

cmd_coredns_start() {
    local args=() ip
    load_state
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

cmd_exec() {
    (($# >= 2)) || usage
    local role=$1
    shift
    [[ " ${ROLES[*]} " == *" $role "* ]] || die "exec: role must be one of ${ROLES[*]}"
    ns_exists "$role" || die "namespace $(ns_name "$role") does not exist"
    exec ip netns exec "$(ns_name "$role")" "$@"
}

main() {
    (($# >= 2)) || usage
    local cmd=$1
    PREFIX=$2
    shift 2
    [[ "$PREFIX" =~ ^[a-z0-9]{1,8}$ ]] || die "PREFIX must be 1-8 chars of [a-z0-9], got '$PREFIX'"
    RUN_DIR="${SIMNODE_DIR:-/tmp/simnode}/$PREFIX"
    [[ $(id -u) == 0 ]] || die "must run as root"
    case $cmd in
    up) cmd_up "$@" ;;
    down) (($# == 0)) || usage; cmd_down ;;
    cache-start) cmd_cache_start "$@" ;;
    coredns-start) cmd_coredns_start "$@" ;;
    cache-kill | coredns-kill) (($# == 0)) || usage; svc_kill "${cmd%-kill}" ;;
    cache-stop | coredns-stop) (($# == 0)) || usage; svc_signal "${cmd%-stop}" STOP ;;
    cache-cont | coredns-cont) (($# == 0)) || usage; svc_signal "${cmd%-cont}" CONT ;;
    cache-pid | coredns-pid) (($# == 0)) || usage; svc_pid "${cmd%-pid}" || die "${cmd%-pid} is not running" ;;
    exec) cmd_exec "$@" ;;
    *) usage ;;
    esac
}

main "$@"
