#!/usr/bin/env bash
# simnode.sh: a simulated Kubernetes node in network namespaces, for integration tests and demos.
#
#   $P-pod1 (eth0 10.244.0.2)   $P-pod2 (eth0 10.244.0.3)     $P-dns ("CoreDNS": dnsmasq)
#            |                          |                      eth0 10.244.1.2, 10.244.1.3
#          veth                       veth                            |
#            |                          |                           veth
#   +--------+------ pod1 ---- pod2 ----+-------------------- dns ----+------------------+
#   | $P-node   10.244.0.1/32 on pod1/pod2, /32 routes     10.244.1.1/24 on dns          |
#   |   nodelocaldns: 169.254.20.10 (node-local IP), 10.96.0.10 (kube-dns ClusterIP)     |
#   |   "node-local-dns": unbound on those two IPs, forwarding to 10.96.0.11             |
#   |   kube-proxy-shaped DNAT (iptables-nft, iptables-legacy or nftables mode):         |
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
# The parts, one concern each, are sourced from simnode/ in this script's real directory
# (symlinks resolved); each says what it models and from which upstream code:
#   common.sh                the address plan, namespaces, the options `up` saved, the flavour
#   processes.sh             daemons started in a namespace and signalled only while still ours
#   topology.sh              namespaces, veths, addresses, routes, the node-local IPs, netem
#   dns-servers.sh           the node-local cache (unbound) and "CoreDNS" (dnsmasq)
#   kubelet.sh               kubelet's iptables chains
#   kube-proxy-iptables.sh   --kube-proxy iptables-nft|iptables-legacy
#   kube-proxy-nftables.sh   --kube-proxy nftables, and kube-proxy-migrate to it
#   kube-proxy-ipvs.sh       --kube-proxy ipvs
#   firewall.sh              --filter-drop, --filter-accept-lo, --filter-reject, --nft-firewall
#   node-cache.sh            node-cache's own iptables rules and its interface teardown
#   noise.sh                 the CNI and kube-proxy loops, the xtables lock holder
#   real.sh                  --kube-proxy real-iptables|real-nftables|real-ipvs: the real parts
#                            (control plane in $P-cp, kube-proxy, CoreDNS) in place of the
#                            stand-ins (real-ipvs in the ci/vm guest, which has ip_vs)
#
# Usage: simnode.sh CMD PREFIX [args]   (PREFIX: 1-8 chars [a-z0-9]; namespaces are $PREFIX-*)
#   up PREFIX [--kube-proxy iptables-nft|iptables-legacy|nftables|ipvs|real-iptables|real-nftables|real-ipvs]
#             [--family 4|6|dual]
#             [--filter-drop [--filter-accept-lo] | --filter-reject] [--nft-firewall]
#             [--listen-dev veth|lo|dummy]   (default veth: node-cache's own interface)
#   down PREFIX                                   (also stops the noise loops and the lock holder)
#   cache-start PREFIX [--mode normal|servfail] [--no-wait] [--bind own|wildcard]
#                                                 cache-kill|cache-term|cache-stop|cache-cont|cache-pid PREFIX
#     (kill, stop and cont print when the signal went out, in ms since the epoch; kill then
#     prints when the process was seen gone, at most one 50 ms poll after its sockets closed;
#     term is a SIGTERM, returning once the process is gone, SIGKILLed after 5 s)
#     --no-wait: return once unbound has been exec'd, without waiting for it to answer (a
#     crash-looping cache, restarted as fast as it dies); prints when it was started.
#     --bind wildcard (the real parts only): node-cache's Corefile binds 0.0.0.0 (and ::), as
#     deliveryhero's node-local-dns chart has it by default (config.bindIp=false).
#   cache2-start PREFIX [--mode normal|servfail] [--no-wait]
#                                                 cache2-kill|cache2-stop|cache2-cont|cache2-pid PREFIX
#     kubespray's second DaemonSet (`nodelocaldns-second`): a second unbound with the same config
#     (its own copy, pidfile and log: cache2.log) on the same IPs and port, answering who.test
#     with the same 1.1.1.1. Both set SO_REUSEPORT, so their sockets form one reuseport group
#     and the kernel hashes each query (source address and port) to one of the two; a killed
#     member leaves the group with its socket, a stopped one keeps its share. Without --no-wait,
#     returns once it has bound every listen IP and a cache answers. `down` stops it too.
#   coredns-start PREFIX                          coredns-kill|coredns-stop|coredns-cont|coredns-pid PREFIX
#   node-cache-rules PREFIX [--remove]
#     node-cache's own iptables rules (cmd/node-cache/app/cache_app.go), in the flavour's
#     iptables (ip6tables for the v6 IPs), for 169.254.20.10 and 10.96.0.10 (and the v6 pair):
#     raw PREROUTING/OUTPUT NOTRACK and filter INPUT/OUTPUT ACCEPT for tcp+udp 53, raw OUTPUT
#     NOTRACK for the health port 8080, with comments "NodeLocal DNS Cache: skip conntrack" /
#     "NodeLocal DNS Cache: allow DNS traffic"; each checked with -C and inserted at the top
#     with `-w 5 -I`, like its EnsureRule(Prepend) (but without its `-W 100000`, which iptables
#     1.8.9 ignores with a warning). --remove deletes every copy (like its teardown). With the
#     xtables lock held over 5 s, it fails on iptables-legacy.
#   listen-addrs-del|listen-addrs-add PREFIX
#     node-cache's teardown of its interface (it deletes its dummy interface `nodelocaldns` on
#     SIGTERM unless -skipteardown): deletes the node-local IP and the cluster-DNS IP (and the v6
#     pair) from node-cache's interface (`nodelocaldns`, or lo), leaving the cache running; -add puts
#     them back. Both print when the change was complete, in ms since the epoch.
#   netem PREFIX ARGS... | netem-clear PREFIX
#     `tc qdisc replace dev dns root netem ARGS` on the node's side of the veth to "CoreDNS"
#     (e.g. `loss 30%`, `delay 200ms`): every packet the node sends towards CoreDNS, the cache's
#     forwarded queries and the agent's upstream probes included. Needs sch_netem (the ci/vm
#     guest). -clear removes it.
#   cni-noise-start|cni-noise-stop PREFIX
#     A loop (log: cni-noise.log) that every second makes sure raw PREROUTING's first rule is
#     `-m comment --comment cali:fake -j ACCEPT`, in the flavour's iptables (and ip6tables for
#     6/dual), and that it is there once: if not, it deletes every copy and inserts one at 1, in
#     one `iptables-restore --noflush`, the way a CNI plugin keeps its rule in front.
#   kube-proxy-resync-start|kube-proxy-resync-stop PREFIX
#     A loop (log: kube-proxy-resync.log) that every second redoes kube-proxy's sync: iptables
#     modes: EnsureRule(Prepend) of the PREROUTING/OUTPUT jumps (-C, else -I) and
#     `iptables-restore -w 5 --noflush` of the nat table declaring KUBE-SERVICES, KUBE-SVC-*,
#     KUBE-SEP-* (which flushes and rewrites only those chains), then EnsureRule of its filter
#     jumps (INPUT, FORWARD, OUTPUT; made at `up`) and a restore of its filter chains
#     (KUBE-SERVICES, KUBE-EXTERNAL-SERVICES, KUBE-FORWARD, KUBE-NODEPORTS, KUBE-PROXY-FIREWALL)
#     with endpoint churn: a "has no endpoints" REJECT comes and goes every round, so the
#     filter table changes every second; nftables mode: `nft -f` of the
#     transaction that adds and flushes every chain, set and map of `table ip kube-proxy` and
#     refills them. Both loops return from -start after their first round, and -start fails
#     (the loop stopped, its log's tail shown) when that round failed; they stop at once (each
#     change is one atomic transaction, so stopping leaves no half-written table).
#   cni-noise-rounds|kube-proxy-resync-rounds PREFIX
#     What the loop's rounds did since its -start (also once it has stopped): `ok=N failed=M
#     in_front=K`. A round is ok when every command of it succeeded (cni-noise: and its rule is
#     first in raw PREROUTING of every family when it ends); in_front (cni-noise) counts the
#     rounds that found the rule already first in every family, i.e. nobody had moved it since
#     the round before.
#   xtables-lock-hold PREFIX SECONDS              xtables-lock-release PREFIX
#     Holds the node's xtables lock for SECONDS in the background and prints its path,
#     <state dir>/xtables.lock. The lock is a file, not per namespace: the host's is
#     /run/xtables.lock, so each simulated node has its own, named by XTABLES_LOCKFILE, which
#     iptables-legacy (1.8.9) honours: with it held, `iptables-legacy -w N` fails after N s
#     (exit 4, "Another app is currently holding the xtables lock"), and without -w it waits
#     until released. Run the program under test with XTABLES_LOCKFILE=<that path>: every
#     iptables command of this script uses it. iptables-nft takes no lock at all.
#   kube-proxy-migrate PREFIX
#     kube-proxy restarted in nftables mode on a node where it ran in an iptables mode (KEP-5343
#     makes nftables the default): like its CleanupLeftovers, its iptables rules go (the
#     KUBE-SERVICES jumps and every KUBE-* nat chain), then `table ip kube-proxy` (ip6 too) is
#     written as in nftables mode. kubelet's canary chains stay where they are. With the real
#     parts (real-iptables): real kube-proxy restarted in nftables mode, cleaning up itself.
#   busy-services PREFIX N                        (real parts only)
#     N Services with two endpoints each created through the API (namespace busy); returns once
#     kube-proxy's rules hold them all.
#   endpoint-churn-start PREFIX RATE | endpoint-churn-stop | endpoint-churn-changes PREFIX
#     RATE EndpointSlice changes a second over the busy Services, through the API (the endpoint
#     controller of a busy cluster); -changes prints how many were accepted so far.
#   prefer-same-node PREFIX on|off                (real parts, real-iptables, --family 4)
#     on: kube-dns as KEP-3015's `trafficDistribution: PreferSameNode` shapes it: the cache an
#     endpoint of kube-dns at the node's address (10.240.0.1, as node-local-dns's host-network
#     pods would be; cache-start binds it while this is on), every endpoint hinted for its own
#     node as the EndpointSlice controller hints them; returns once real kube-proxy sends
#     10.96.0.10 to the cache alone. off: kube-dns as `up` made it. Restart the cache around it.
#   cache-endpoint PREFIX ready|not-ready         (with prefer-same-node on)
#     The cache's endpoint condition, as the kubelet and the EndpointSlice controller would set
#     it (there are neither here); prints when the API server took it, in ms since the epoch.
#   kube-apiserver-stop PREFIX | kube-apiserver-cont PREFIX
#     SIGSTOP / SIGCONT to the real kube-apiserver: an API server that takes connections and
#     answers nothing (prints when the signal went out).
#   exec PREFIX node|pod1|pod2|dns CMD...
# State (configs, pidfiles, logs, the xtables lock) lives in ${SIMNODE_DIR:-/tmp/simnode}/PREFIX.
# Nothing here touches the root network namespace. Set SIMNODE_TRACE=1 to trace.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
if [[ -n "${SIMNODE_TRACE:-}" ]]; then set -x; fi

# This script, run again as the noise loops (`bash SELF __loop PREFIX SVC`); its directory holds
# the parts and unbound.conf.in.
SELF="$(readlink -f "${BASH_SOURCE[0]}")"
readonly SELF SCRIPT_DIR="${SELF%/*}"
# shellcheck source=simnode/common.sh
source "$SCRIPT_DIR/simnode/common.sh"
# shellcheck source=simnode/processes.sh
source "$SCRIPT_DIR/simnode/processes.sh"
# shellcheck source=simnode/topology.sh
source "$SCRIPT_DIR/simnode/topology.sh"
# shellcheck source=simnode/dns-servers.sh
source "$SCRIPT_DIR/simnode/dns-servers.sh"
# shellcheck source=simnode/kubelet.sh
source "$SCRIPT_DIR/simnode/kubelet.sh"
# shellcheck source=simnode/kube-proxy-iptables.sh
source "$SCRIPT_DIR/simnode/kube-proxy-iptables.sh"
# shellcheck source=simnode/kube-proxy-nftables.sh
source "$SCRIPT_DIR/simnode/kube-proxy-nftables.sh"
# shellcheck source=simnode/kube-proxy-ipvs.sh
source "$SCRIPT_DIR/simnode/kube-proxy-ipvs.sh"
# shellcheck source=simnode/firewall.sh
source "$SCRIPT_DIR/simnode/firewall.sh"
# shellcheck source=simnode/node-cache.sh
source "$SCRIPT_DIR/simnode/node-cache.sh"
# shellcheck source=simnode/noise.sh
source "$SCRIPT_DIR/simnode/noise.sh"
# shellcheck source=simnode/real.sh
source "$SCRIPT_DIR/simnode/real.sh"

usage() { sed -n '/^# Usage:/,/^# Nothing here/p' "$SELF" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# up: the node assembled from the parts, in this order; a failure on the way takes it down again.
cmd_up() {
    local kube_proxy=iptables-nft filter_drop=0 filter_lo=loopback filter_reject=0 nft_firewall=0 role
    FAMILY=4 LISTEN_DEV=veth
    while (($#)); do
        case $1 in
        --kube-proxy) kube_proxy=${2:-}; shift 2 || usage ;;
        --family) FAMILY=${2:-}; shift 2 || usage ;;
        --filter-drop) filter_drop=1; shift ;;
        --filter-accept-lo) filter_lo=accept-lo; shift ;;
        --filter-reject) filter_reject=1; shift ;;
        --nft-firewall) nft_firewall=1; shift ;;
        --listen-dev) LISTEN_DEV=${2:-}; shift 2 || usage ;;
        *) usage ;;
        esac
    done
    [[ "$kube_proxy" =~ ^(iptables-(nft|legacy)|nftables|ipvs|real-(iptables|nftables|ipvs))$ ]] ||
        die "--kube-proxy must be iptables-nft, iptables-legacy, nftables, ipvs, real-iptables, real-nftables or real-ipvs"
    [[ "$FAMILY" =~ ^(4|6|dual)$ ]] || die "--family must be 4, 6 or dual"
    [[ "$LISTEN_DEV" =~ ^(lo|dummy|veth)$ ]] || die "--listen-dev must be lo, dummy or veth"
    if [[ $FAMILY != 4 ]]; then
        [[ $LISTEN_DEV != dummy ]] || die "--listen-dev dummy is modelled for --family 4 only"
        [[ $kube_proxy != *ipvs ]] || die "--kube-proxy $kube_proxy is modelled for --family 4 only"
    fi
    LISTEN_DEV_KIND=$LISTEN_DEV
    [[ $LISTEN_DEV == lo ]] || LISTEN_DEV=nodelocaldns
    [[ $filter_lo == loopback ]] || ((filter_drop)) || die "--filter-accept-lo needs --filter-drop"
    ! ((filter_drop && filter_reject)) || die "--filter-drop and --filter-reject are two firewalls: pick one"
    for role in "${ROLES[@]}" cp; do
        ! ns_exists "$role" || die "namespace $(ns_name "$role") already exists (run: $0 down $PREFIX)"
    done
    KUBE_PROXY=$kube_proxy FILTER_LO=""
    if ((filter_drop)); then FILTER_LO=$filter_lo; fi
    set_flavour

    # From here on, a failure tears down whatever was set up.
    trap 'up_failed $?' EXIT
    rm -rf "$RUN_DIR"
    mkdir -p "$RUN_DIR"
    save_state

    add_namespaces
    add_pod pod1 "$V4_POD1" "$V6_POD1"
    add_pod pod2 "$V4_POD2" "$V6_POD2"
    add_dns
    if [[ $kube_proxy == nftables || $kube_proxy == ipvs || $kube_proxy == real-* ]]; then kubelet_iptables; fi
    add_listen_dev
    if is_real; then
        # The real parts: a control plane, kube-proxy's own rules instead of the stand-ins'.
        listen_ips add 4
        real_up
    elif has_v4; then
        listen_ips add 4
        if [[ $kube_proxy == nftables ]]; then
            kube_nft_rules ip "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
        elif [[ $kube_proxy == ipvs ]]; then
            kube_ipvs "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
        else
            kube_iptables_rules "$kube_proxy" "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
        fi
    elif [[ $kube_proxy != nftables ]]; then
        # kubelet creates its canaries in both families even on a single-stack node.
        kubelet_canaries "$kube_proxy"
    fi
    if has_v6; then
        listen_ips add 6
        if is_real; then
            : # real kube-proxy wrote its own IPv6 rules (real_up)
        elif [[ $kube_proxy == nftables ]]; then
            kube_nft_rules ip6 "$V6_CLUSTER_DNS" "$V6_UPSTREAM" "${V6_DNS_EPS[@]}"
        else
            kube_iptables_rules "ip6${kube_proxy#ip}" "$V6_CLUSTER_DNS" "$V6_UPSTREAM" "${V6_DNS_EPS[@]}"
        fi
    fi
    if ((filter_drop)); then host_firewall "$filter_lo"; fi
    if ((filter_reject)); then host_firewall_reject; fi
    if ((nft_firewall)); then nft_firewall; fi
    trap - EXIT
    echo "simnode $PREFIX up: family $FAMILY, kube-proxy $kube_proxy, listen IPs on $LISTEN_DEV$( ((filter_drop)) && echo ", filter INPUT policy DROP ($filter_lo)")$( ((filter_reject)) && echo ", filter INPUT ends in REJECT")$( ((nft_firewall)) && echo ", nftables firewall rejecting")," \
        "namespaces ${ROLES[*]/#/$PREFIX-}$(! is_real || echo " $PREFIX-cp (the control plane)")"
}

# up_failed STATUS: the EXIT trap of up.
up_failed() {
    trap - EXIT
    if (($1 != 0)); then
        echo "simnode: up $PREFIX failed, cleaning up" >&2
        cmd_down
    fi
}

# down: the daemons stopped (by their recorded pids), the namespaces and the state gone.
cmd_down() {
    if [[ -d "$RUN_DIR" ]]; then
        svc_term cni-noise
        svc_term kube-proxy-resync
        svc_term xtables-lock
        svc_kill cache
        svc_kill cache2
        svc_kill coredns
        real_down
    fi
    delete_namespaces
    rm -rf "$RUN_DIR"
}

main() {
    (($# >= 2)) || usage
    local cmd=$1
    PREFIX=$2
    shift 2
    [[ "$PREFIX" =~ ^[a-z0-9]{1,8}$ ]] || die "PREFIX must be 1-8 chars of [a-z0-9], got '$PREFIX'"
    RUN_DIR="${SIMNODE_DIR:-/tmp/simnode}/$PREFIX"
    # Each simulated node has its own xtables lock (see xtables-lock-hold).
    export XTABLES_LOCKFILE="$RUN_DIR/xtables.lock"
    [[ $(id -u) == 0 ]] || die "must run as root"
    case $cmd in
    up) cmd_up "$@" ;;
    down) (($# == 0)) || usage; cmd_down ;;
    cache-start | cache2-start) cmd_cache_start "${cmd%-start}" "$@" ;;
    coredns-start) cmd_coredns_start "$@" ;;
    cache-kill | cache2-kill | coredns-kill) (($# == 0)) || usage; svc_kill "${cmd%-kill}" ;;
    cache-term | cache2-term | coredns-term) (($# == 0)) || usage; svc_term "${cmd%-term}" ;;
    cache-stop | cache2-stop | coredns-stop) (($# == 0)) || usage; svc_signal "${cmd%-stop}" STOP ;;
    cache-cont | cache2-cont | coredns-cont) (($# == 0)) || usage; svc_signal "${cmd%-cont}" CONT ;;
    cache-pid | cache2-pid | coredns-pid) (($# == 0)) || usage; svc_pid "${cmd%-pid}" || die "${cmd%-pid} is not running" ;;
    node-cache-rules) cmd_node_cache_rules "$@" ;;
    listen-addrs-del | listen-addrs-add) (($# == 0)) || usage; cmd_listen_addrs "${cmd#listen-addrs-}" ;;
    cni-noise-start | kube-proxy-resync-start) (($# == 0)) || usage; loop_start "${cmd%-start}" ;;
    cni-noise-stop | kube-proxy-resync-stop) (($# == 0)) || usage; svc_term "${cmd%-stop}" ;;
    cni-noise-rounds | kube-proxy-resync-rounds) (($# == 0)) || usage; loop_rounds "${cmd%-rounds}" ;;
    __loop) (($# == 1)) || usage; run_loop "$1" ;; # internal: the noise loops
    xtables-lock-hold) cmd_xtables_lock_hold "$@" ;;
    xtables-lock-release) (($# == 0)) || usage; svc_term xtables-lock ;;
    kube-proxy-migrate) (($# == 0)) || usage; cmd_kube_proxy_migrate ;;
    busy-services) (($# == 1)) || usage; load_state; is_real || die "busy-services needs the real parts"; real_busy_services "$1" ;;
    endpoint-churn-start) (($# == 1)) || usage; load_state; is_real || die "endpoint-churn needs the real parts"; real_churn_start "$1" ;;
    endpoint-churn-stop) (($# == 0)) || usage; svc_term endpoint-churn ;;
    prefer-same-node) (($# == 1)) || usage; load_state; is_real || die "$cmd needs the real parts"; real_prefer_same_node "$1" ;;
    cache-endpoint) (($# == 1)) || usage; load_state; is_real || die "$cmd needs the real parts"; real_cache_endpoint "$1" ;;
    kube-apiserver-stop) (($# == 0)) || usage; load_state; is_real || die "$cmd needs the real parts"; svc_signal kube-apiserver STOP ;;
    kube-apiserver-cont) (($# == 0)) || usage; load_state; is_real || die "$cmd needs the real parts"; svc_signal kube-apiserver CONT ;;
    endpoint-churn-changes) (($# == 0)) || usage; cat "$RUN_DIR/endpoint-churn.changes" ;;
    netem) (($# > 0)) || usage; cmd_netem "$@" ;;
    netem-clear) (($# == 0)) || usage; cmd_netem ;;
    exec) cmd_exec "$@" ;;
    *) usage ;;
    esac
}

main "$@"
