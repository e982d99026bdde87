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
# --kube-proxy (the backend kube-proxy uses; "the flavour" below is the iptables binary of the
# node's Kubernetes components: the same as kube-proxy's, iptables-nft for nftables mode):
#   iptables-nft, iptables-legacy: KUBE-SERVICES / KUBE-SVC-* / KUBE-SEP-* in the nat table,
#     jumped to from PREROUTING and OUTPUT; kubelet's KUBE-KUBELET-CANARY (mangle, nat,
#     filter) and KUBE-IPTABLES-HINT (mangle) chains, in the same binary.
#   nftables: kube-proxy's nftables mode. `table ip kube-proxy` (and `ip6` for 6/dual) shaped like
#     pkg/proxy/nftables/proxier.go: base chains nat-prerouting / nat-output (-100),
#     nat-postrouting (100), filter-* (-110, filter-output-post-dnat -90); chain `services` with
#     `ip daddr . meta l4proto . th dport vmap @service-ips`; per Service port
#     `service-<HASH>-kube-system/kube-dns/udp/dns` (numgen random mod 2 vmap to goto) and per
#     endpoint `endpoint-<HASH>-kube-system/kube-dns/udp/dns__10.244.1.2/53` (dnat to), HASH being
#     base32(sha256(name))[:8] like kube-proxy's; one `nft -f` transaction per family.
#     kube-proxy itself writes nothing to iptables in this mode (at most it cleans up an iptables
#     mode's leftovers when it starts). kubelet (>= 1.28, whatever the
#     proxy mode: kubelet_network_linux.go) still uses the host's `iptables`, iptables-nft on
#     current distros, in both families: KUBE-IPTABLES-HINT (mangle), KUBE-KUBELET-CANARY
#     (mangle, nat, filter) and, IPv4 only, filter KUBE-FIREWALL with its "block incoming
#     localnet connections" DROP rule and `-I INPUT/OUTPUT -j KUBE-FIREWALL`. Those are all made
#     here, with iptables-nft, so iptables is not empty in nftables mode (as on a real node), but
#     it has no nat rules at all. (The iptables modes model only the canary and hint chains.)
#   ipvs (IPv4 only; needs the ip_vs and dummy modules, which the build machine's kernel lacks:
#     it runs in the ci/vm guest): kube-proxy's IPVS mode as pkg/proxy/ipvs/proxier.go
#     (kubernetes/kubernetes, 1.30-era: NewProxier, createAndLinkKubeChain, writeIptablesRules,
#     syncService/syncEndpoint; set names and comments from pkg/proxy/ipvs/ipset.go) leaves a
#     node with these two Services: the sysctls net.ipv4.vs.conntrack=1, expire_nodest_conn=1,
#     expire_quiescent_template=1; the dummy interface `kube-ipvs0` (left down) holding every
#     ClusterIP as /32; IPVS virtual services 10.96.0.10:53 and 10.96.0.11:53, udp and tcp,
#     scheduler rr, each with the CoreDNS endpoints as masquerading real servers (weight 1); its
#     ipsets (all 17 created; KUBE-CLUSTER-IP holds ip,proto:port of each Service port,
#     KUBE-LOOP-BACK the endpoints on this node as ip,proto:port,ip, KUBE-IPVS-IPS the addresses on
#     kube-ipvs0) and its iptables chains in nat (KUBE-SERVICES, KUBE-POSTROUTING with the
#     0x4000 masquerade mark, KUBE-MARK-MASQ, KUBE-NODE-PORT, KUBE-LOAD-BALANCER) and filter
#     (KUBE-FORWARD, KUBE-NODE-PORT, KUBE-PROXY-FIREWALL, KUBE-SOURCE-RANGES-FIREWALL,
#     KUBE-IPVS-FILTER, KUBE-IPVS-OUT-FILTER), with the jumps from the built-in chains that its
#     EnsureRule(Prepend) puts first, all in iptables-nft (with kubelet's canary and hint chains).
#     Local traffic detection by cluster CIDR (10.244.0.0/16). Written with `ipset restore` and
#     one `iptables-restore --noflush` instead of kube-proxy's one command per set and entry;
#     the rules' text is the same. ClusterIP traffic never meets a DNAT rule: IPVS takes it in
#     its LOCAL_IN hook (pods) or LOCAL_OUT hook (the node) and forwards it to a real server.
# --listen-dev lo|dummy: where the node-local IPs live. lo (the default) works on every kernel;
#   dummy is node-cache's own layout (cmd/node-cache/app: netif.EnsureDummyDevice): a dummy
#   interface `nodelocaldns`, left down, holding the IPs as /32. IPv4 only here; needs the
#   dummy module (the ci/vm guest has it, the build machine's kernel has no CONFIG_DUMMY).
# --filter-drop: a host firewall in the flavour's filter table (and ip6tables for 6/dual):
#   INPUT policy DROP, accepting only `-i lo -d 127.0.0.0/8` (::1), ctstate RELATED,ESTABLISHED
#   and ICMP (ICMPv6); FORWARD and OUTPUT stay ACCEPT. So DNATed pod traffic (FORWARD) and the
#   cache's upstream queries (OUTPUT, replies ESTABLISHED) work, but NOTRACKed queries to the
#   cache (INPUT, ctstate UNTRACKED), from pods and host-network clients alike, are DROPPED unless
#   someone ACCEPTs them in that same iptables (node-cache's filter INPUT rules do). Real host
#   firewalls usually accept all of `-i lo`; this one does not, so host-network clients need
#   ACCEPTs too: for their queries (dport 53 to the IP) and, as NOTRACK leaves the replies
#   UNTRACKED, for the cache's replies (sport 53 from the IP): node-cache's rules accept only the
#   first, so with them host-network clients still time out. Because of it, unbound then also
#   listens on 127.0.0.1:53 (::1 on a v6-only node), which node-cache does not, and cache-start's
#   readiness check queries that address.
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
#
# Usage: simnode.sh CMD PREFIX [args]   (PREFIX: 1-8 chars [a-z0-9]; namespaces are $PREFIX-*)
#   up PREFIX [--kube-proxy iptables-nft|iptables-legacy|nftables|ipvs] [--family 4|6|dual]
#             [--filter-drop [--filter-accept-lo] | --filter-reject] [--nft-firewall]
#             [--listen-dev lo|dummy]
#   down PREFIX                                   (also stops the noise loops and the lock holder)
#   cache-start PREFIX [--mode normal|servfail] [--no-wait]
#                                                 cache-kill|cache-stop|cache-cont|cache-pid PREFIX
#     (kill, stop and cont print when the signal went out, in ms since the epoch; kill then
#     prints when the process was seen gone, at most one 50 ms poll after its sockets closed)
#     --no-wait: return once unbound has been exec'd, without waiting for it to answer (a
#     crash-looping cache, restarted as fast as it dies); prints when it was started.
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
#     pair) from the node's lo (or the `nodelocaldns` dummy), leaving the cache running; -add puts
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
#     written as in nftables mode. kubelet's canary chains stay where they are.
#   exec PREFIX node|pod1|pod2|dns CMD...
# State (configs, pidfiles, logs, the xtables lock) lives in ${SIMNODE_DIR:-/tmp/simnode}/PREFIX.
# Nothing here touches the root network namespace. Set SIMNODE_TRACE=1 to trace.
set -euo pipefail
if [[ -n "${SIMNODE_TRACE:-}" ]]; then set -x; fi

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
# This script, run again as the noise loops (`bash SELF __loop PREFIX SVC`).
readonly SELF="$SCRIPT_DIR/${BASH_SOURCE[0]##*/}"
readonly ROLES=(node pod1 pod2 dns)

# IPv4 plan.
readonly V4_NODE_POD=10.244.0.1 V4_POD1=10.244.0.2 V4_POD2=10.244.0.3
readonly V4_NODE_DNS=10.244.1.1 V4_DNS_EPS=(10.244.1.2 10.244.1.3)
readonly V4_LOCAL_IP=169.254.20.10 V4_CLUSTER_DNS=10.96.0.10 V4_UPSTREAM=10.96.0.11
readonly V4_SERVICE_CIDR=10.96.0.0/12 V4_CLUSTER_CIDR=10.244.0.0/16
# IPv6 plan.
readonly V6_NODE_POD=fd00:244::1 V6_POD1=fd00:244::2 V6_POD2=fd00:244::3
readonly V6_NODE_DNS=fd00:244:1::1 V6_DNS_EPS=(fd00:244:1::2 fd00:244:1::3)
readonly V6_LOCAL_IP=fd00:169:254::10 V6_CLUSTER_DNS=fd00:96::10 V6_UPSTREAM=fd00:96::11
readonly V6_SERVICE_CIDR=fd00:96::/108 V6_CLUSTER_CIDR=fd00:244::/32
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
    KUBE_PROXY=iptables-nft
    if [[ -f "$RUN_DIR/kube-proxy" ]]; then KUBE_PROXY=$(<"$RUN_DIR/kube-proxy"); fi
    FILTER_LO="" # --filter-drop: loopback | accept-lo
    if [[ -f "$RUN_DIR/filter-drop" ]]; then FILTER_LO=$(<"$RUN_DIR/filter-drop"); fi
    LISTEN_DEV=lo
    if [[ -f "$RUN_DIR/listen-dev" ]]; then LISTEN_DEV=$(<"$RUN_DIR/listen-dev"); fi
    set_flavour
}
# The iptables binaries of the node's Kubernetes components: kube-proxy's, or for nftables
# mode the host's iptables (iptables-nft).
set_flavour() {
    IPT4=$KUBE_PROXY
    [[ "$KUBE_PROXY" != nftables && "$KUBE_PROXY" != ipvs ]] || IPT4=iptables-nft
    IPT6="ip6${IPT4#ip}"
}
# The iptables binaries for the node's families, v4 first.
ipt_families() {
    if has_v4; then echo "$IPT4"; fi
    if has_v6; then echo "$IPT6"; fi
}

# ---------------------------------------------------------------------------------------------
# Processes: each daemon is started in the foreground by `ip netns exec` (which execs it, so $!
# is the daemon's pid), recorded in $RUN_DIR/<svc>.pid. Signals go only to that recorded pid,
# and only while /proc/<pid>/comm still names the program we started.

svc_comm() {
    case $1 in
    cache) echo unbound ;;
    coredns) echo dnsmasq ;;
    cni-noise | kube-proxy-resync) echo bash ;; # and its command line names the loop
    xtables-lock) echo sleep ;;
    *) die "bad service $1" ;;
    esac
}

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
    case $1 in
    cni-noise | kube-proxy-resync)
        local cmdline
        cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
        [[ "$cmdline" == *" $SELF __loop $PREFIX $1 " ]] || return 1
        ;;
    esac
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
        now_ms # when it was seen gone (its sockets closed): at most one poll late
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

# svc_term SVC: SIGTERM (a noise loop then stops its running command and exits), SIGKILL if it
# is still there after 5 s.
svc_term() {
    local pid deadline
    if pid=$(svc_pid "$1"); then
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$(($(now_ms) + 5000))
        while ! svc_gone "$1" && (($(now_ms) < deadline)); do sleep 0.01; done
        if ! svc_gone "$1"; then kill -KILL "$pid" 2>/dev/null || true; fi
        wait_for 5 "$1 (pid $pid) to exit" svc_gone "$1"
    fi
    rm -f "$RUN_DIR/$1.pid" "$RUN_DIR/$1.ready"
}

# ---------------------------------------------------------------------------------------------
# kube-proxy-shaped iptables rules. Chain names are computed like kube-proxy's: "KUBE-SVC-" + the
# first 16 base32 chars of sha256(servicePortName + protocol), e.g. KUBE-SVC-TCOU7JCQXEZGVUNU for
# kube-system/kube-dns:dns udp; "KUBE-SEP-" likewise with the endpoint appended.

kube_hash() {
    local hex escaped="" i
    hex=$(printf '%s' "$1" | sha256sum | cut -c1-64)
    for ((i = 0; i < 64; i += 2)); do escaped+="\\x${hex:i:2}"; done
    printf '%b' "$escaped" | base32 | cut -c1-16
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

kube_rules() { # kube_rules IPT CLUSTER_DNS UPSTREAM EP1 EP2
    local ipt=$1 table v=4
    [[ "$ipt" == ip6* ]] && v=6
    # kubelet's canaries (and its hint chain) tell iptables-wrappers which backend is in use.
    for table in mangle nat filter; do in_ns node "$ipt" -t "$table" -N KUBE-KUBELET-CANARY; done
    in_ns node "$ipt" -t mangle -N KUBE-IPTABLES-HINT
    in_ns node "$ipt" -t nat -N KUBE-SERVICES
    in_ns node "$ipt" -t nat -A PREROUTING "${KUBE_PORTALS[@]}"
    in_ns node "$ipt" -t nat -A OUTPUT "${KUBE_PORTALS[@]}"
    kube_nat_restore "$2" "$3" "$4" "$5" >"$RUN_DIR/kube-proxy-nat-v$v.rules"
    in_ns node "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-proxy-nat-v$v.rules"
    kube_filter_restore "$ipt" 0 >"$RUN_DIR/kube-proxy-filter-v$v.rules"
    in_ns node "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-proxy-filter-v$v.rules"
    kube_filter_jumps "$ipt" in_ns node
}

# ---------------------------------------------------------------------------------------------
# kube-proxy's nftables mode (pkg/proxy/nftables/proxier.go, setupNFTables + syncProxyRules).

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

    local ip svc proto port base schain ep epname ebase echains dest i
    for spec in "$cluster_dns kube-dns" "$upstream kube-dns-upstream"; do
        read -r ip svc <<<"$spec"
        echo "add element $t cluster-ips { $ip }"
        for proto in udp tcp; do
            port=dns
            [[ $proto == tcp ]] && port=dns-tcp
            base="kube-system/$svc/$proto/$port"
            schain="service-$(kube_hash "$base" | cut -c1-8)-$base"
            echains=()
            for ep in "$ep1" "$ep2"; do
                epname=${ep//:/.}
                ebase="${base}__$epname/53"
                echains+=("endpoint-$(kube_hash "$ebase" | cut -c1-8)-$ebase")
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

# ---------------------------------------------------------------------------------------------
# kube-proxy's IPVS mode (see the header for where each part comes from).

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
    local cluster_dns=$1 upstream=$2 ep1=$3 ep2=$4 ip proto flag ep spec table from to comment
    modprobe ip_vs && modprobe ip_vs_rr ||
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
            in_ns node ipvsadm -A "$flag" "$ip:53" -s rr
            for ep in "$ep1" "$ep2"; do in_ns node ipvsadm -a "$flag" "$ip:53" -r "$ep:53" -m -w 1; done
        done
    done
    kube_ipvs_sets "$@" >"$RUN_DIR/kube-proxy-ipsets"
    in_ns node ipset restore <"$RUN_DIR/kube-proxy-ipsets"
    kube_ipvs_restore >"$RUN_DIR/kube-proxy-ipvs.rules"
    in_ns node iptables-nft-restore -w 5 --noflush "$RUN_DIR/kube-proxy-ipvs.rules"
    # iptablesJumpChain, each EnsureRule(Prepend): the last one ends up first in its chain.
    for spec in "nat OUTPUT KUBE-SERVICES kubernetes service portals" \
        "nat PREROUTING KUBE-SERVICES kubernetes service portals" \
        "nat POSTROUTING KUBE-POSTROUTING kubernetes postrouting rules" \
        "filter FORWARD KUBE-FORWARD kubernetes forwarding rules" \
        "filter INPUT KUBE-NODE-PORT kubernetes health check rules" \
        "filter INPUT KUBE-PROXY-FIREWALL kube-proxy firewall rules" \
        "filter FORWARD KUBE-PROXY-FIREWALL kube-proxy firewall rules" \
        "filter INPUT KUBE-IPVS-FILTER kubernetes ipvs access filter" \
        "filter OUTPUT KUBE-IPVS-OUT-FILTER kubernetes ipvs access filter"; do
        read -r table from to comment <<<"$spec"
        in_ns node iptables-nft -w 5 -t "$table" -I "$from" -m comment --comment "$comment" -j "$to"
    done
}

# kubelet's iptables (the host's iptables: iptables-nft) on a node whose kube-proxy uses nftables
# or IPVS.
kubelet_iptables() {
    local ipt table
    for ipt in iptables-nft ip6tables-nft; do
        in_ns node "$ipt" -t mangle -N KUBE-IPTABLES-HINT
        for table in mangle nat filter; do in_ns node "$ipt" -t "$table" -N KUBE-KUBELET-CANARY; done
    done
    in_ns node iptables-nft -t filter -N KUBE-FIREWALL
    in_ns node iptables-nft -t filter -I OUTPUT -j KUBE-FIREWALL
    in_ns node iptables-nft -t filter -I INPUT -j KUBE-FIREWALL
    in_ns node iptables-nft -t filter -A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" \
        --dst 127.0.0.0/8 ! --src 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
}

kube_nft_rules() { # kube_nft_rules FAMILY CLUSTER_DNS UPSTREAM EP1 EP2
    local fam=$1
    shift
    kube_nft "$fam" 1 "$@" >"$RUN_DIR/kube-proxy-$fam.nft"
    kube_nft "$fam" 0 "$@" >"$RUN_DIR/kube-proxy-$fam.resync.nft"
    in_ns node nft -f "$RUN_DIR/kube-proxy-$fam.nft"
}

cmd_kube_proxy_migrate() {
    load_state
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
    echo nftables >"$RUN_DIR/kube-proxy"
}

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
    local kube_proxy=iptables-nft filter_drop=0 filter_lo=loopback filter_reject=0 nft_firewall=0 role
    FAMILY=4 LISTEN_DEV=lo
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
    [[ "$kube_proxy" =~ ^(iptables-(nft|legacy)|nftables|ipvs)$ ]] ||
        die "--kube-proxy must be iptables-nft, iptables-legacy, nftables or ipvs"
    [[ "$FAMILY" =~ ^(4|6|dual)$ ]] || die "--family must be 4, 6 or dual"
    [[ "$LISTEN_DEV" =~ ^(lo|dummy)$ ]] || die "--listen-dev must be lo or dummy"
    if [[ $LISTEN_DEV == dummy || $kube_proxy == ipvs ]] && [[ $FAMILY != 4 ]]; then
        die "--listen-dev dummy and --kube-proxy ipvs are modelled for --family 4 only"
    fi
    [[ $LISTEN_DEV == lo ]] || LISTEN_DEV=nodelocaldns
    [[ $filter_lo == loopback ]] || ((filter_drop)) || die "--filter-accept-lo needs --filter-drop"
    ! ((filter_drop && filter_reject)) || die "--filter-drop and --filter-reject are two firewalls: pick one"
    for role in "${ROLES[@]}"; do
        ! ns_exists "$role" || die "namespace $(ns_name "$role") already exists (run: $0 down $PREFIX)"
    done
    KUBE_PROXY=$kube_proxy
    set_flavour

    # From here on, a failure tears down whatever was set up.
    trap 'up_failed $?' EXIT
    rm -rf "$RUN_DIR"
    mkdir -p "$RUN_DIR"
    echo "$FAMILY" >"$RUN_DIR/family"
    echo "$kube_proxy" >"$RUN_DIR/kube-proxy"
    if ((filter_drop)); then echo "$filter_lo" >"$RUN_DIR/filter-drop"; fi
    echo "$LISTEN_DEV" >"$RUN_DIR/listen-dev"

    for role in "${ROLES[@]}"; do
        ip netns add "$(ns_name "$role")"
        ip -n "$(ns_name "$role")" link set lo up
        # Set before any veth exists, so new interfaces inherit it: v6 addresses usable at once.
        # (Not on a kernel booted with ipv6.disable=1: it has no IPv6 at all.)
        if [[ -d /proc/sys/net/ipv6 ]]; then
            in_ns "$role" sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0
        fi
    done
    in_ns node sysctl -qw net.ipv4.ip_forward=1
    if has_v6; then in_ns node sysctl -qw net.ipv6.conf.all.forwarding=1; fi

    add_pod pod1 "$V4_POD1" "$V6_POD1"
    add_pod pod2 "$V4_POD2" "$V6_POD2"
    add_dns
    if [[ $kube_proxy == nftables || $kube_proxy == ipvs ]]; then kubelet_iptables; fi
    if [[ $LISTEN_DEV != lo ]]; then
        # node-cache's interface: created, never set up (netif.AddDummyDevice).
        ip -n "$(ns_name node)" link add "$LISTEN_DEV" type dummy
    fi
    if has_v4; then
        ip -n "$(ns_name node)" addr add "$V4_LOCAL_IP/32" dev "$LISTEN_DEV"
        ip -n "$(ns_name node)" addr add "$V4_CLUSTER_DNS/32" dev "$LISTEN_DEV"
        if [[ $kube_proxy == nftables ]]; then
            kube_nft_rules ip "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
        elif [[ $kube_proxy == ipvs ]]; then
            kube_ipvs "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
        else
            kube_rules "$kube_proxy" "$V4_CLUSTER_DNS" "$V4_UPSTREAM" "${V4_DNS_EPS[@]}"
        fi
    elif [[ $kube_proxy != nftables ]]; then
        # kubelet creates its canaries in both families even on a single-stack node.
        local table
        for table in mangle nat filter; do in_ns node "$kube_proxy" -t "$table" -N KUBE-KUBELET-CANARY; done
    fi
    if has_v6; then
        ip -n "$(ns_name node)" addr add "$V6_LOCAL_IP/128" dev lo nodad
        ip -n "$(ns_name node)" addr add "$V6_CLUSTER_DNS/128" dev lo nodad
        if [[ $kube_proxy == nftables ]]; then
            kube_nft_rules ip6 "$V6_CLUSTER_DNS" "$V6_UPSTREAM" "${V6_DNS_EPS[@]}"
        else
            kube_rules "ip6${kube_proxy#ip}" "$V6_CLUSTER_DNS" "$V6_UPSTREAM" "${V6_DNS_EPS[@]}"
        fi
    fi
    if ((filter_drop)); then host_firewall "$filter_lo"; fi
    if ((filter_reject)); then host_firewall_reject; fi
    if ((nft_firewall)); then nft_firewall; fi
    trap - EXIT
    echo "simnode $PREFIX up: family $FAMILY, kube-proxy $kube_proxy, listen IPs on $LISTEN_DEV$( ((filter_drop)) && echo ", filter INPUT policy DROP ($filter_lo)")$( ((filter_reject)) && echo ", filter INPUT ends in REJECT")$( ((nft_firewall)) && echo ", nftables firewall rejecting")," \
        "namespaces ${ROLES[*]/#/$PREFIX-}"
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
        svc_term cni-noise
        svc_term kube-proxy-resync
        svc_term xtables-lock
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
    local mode=normal interfaces="" local_data="" forward="" mode_options="" conf ip wait=1
    while (($#)); do
        case $1 in
        --mode) mode=${2:-}; shift 2 || usage ;;
        --no-wait) wait=0; shift ;;
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
    local server=$V4_LOCAL_IP
    has_v4 || server=$V6_LOCAL_IP
    if [[ $FILTER_LO == loopback ]]; then
        # The host firewall drops what reaches the node-local IPs from the node itself: check
        # readiness on loopback (see the header).
        server=127.0.0.1
        has_v4 || server=::1
        interfaces+="    interface: $server"$'\n'
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
    local at
    at=$(now_ms)
    svc_start cache node unbound -d -p -c "$RUN_DIR/unbound.conf"
    if ((!wait)); then
        echo "$at"
        return
    fi
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

# listen_addrs del|add: the node-local IPs on the node's lo (node-cache's interface).
listen_addrs() {
    local op=$1 ip
    load_state
    if has_v4; then
        for ip in "$V4_LOCAL_IP" "$V4_CLUSTER_DNS"; do ip -n "$(ns_name node)" addr "$op" "$ip/32" dev "$LISTEN_DEV"; done
    fi
    if has_v6; then
        for ip in "$V6_LOCAL_IP" "$V6_CLUSTER_DNS"; do
            # shellcheck disable=SC2046 # nodad only when adding
            ip -n "$(ns_name node)" addr "$op" "$ip/128" dev "$LISTEN_DEV" $([[ $op == add ]] && echo nodad)
        done
    fi
    now_ms
}

# ---------------------------------------------------------------------------------------------
# node-cache's rules (kubernetes-sigs/node-local-dns cmd/node-cache/app/cache_app.go,
# initIptables): per -localip, in this order, each put in with EnsureRule(Prepend).

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

# ---------------------------------------------------------------------------------------------
# Noise loops: this script run again (`bash SELF __loop PREFIX SVC`) in the node namespace.
# Each command runs as a background child so that SIGTERM stops the loop at once (the trap kills
# the child); the loop writes its pid to $RUN_DIR/<svc>.ready after its first round, if that
# round succeeded (else it exits 1), and its counts to $RUN_DIR/<svc>.rounds after every round.

LOOP_CHILD=""
loop_exit() {
    if [[ -n "$LOOP_CHILD" ]]; then
        kill -TERM "$LOOP_CHILD" 2>/dev/null || true
        wait "$LOOP_CHILD" 2>/dev/null || true
    fi
    echo "$(now_ms) stopped"
    exit 0
}
loop_run() { # loop_run CMD...: run CMD as a child the TERM trap can stop; its exit status
    "$@" &
    LOOP_CHILD=$!
    local rc=0
    wait "$LOOP_CHILD" || rc=$?
    LOOP_CHILD=""
    return "$rc"
}
loop_log() { echo "$(now_ms) $*"; }

# One round of the CNI plugin: its rule first in raw PREROUTING, and there once. Fails when a
# command failed; sets ROUND_IN_FRONT=0 unless the rule was already first in every family.
cni_noise_round() {
    local ipt out="$RUN_DIR/cni-noise.out" restore="$RUN_DIR/cni-noise.restore" want line rc=0
    local -a rules
    want="-A PREROUTING -m comment --comment cali:fake -j ACCEPT"
    ROUND_IN_FRONT=1
    for ipt in $(ipt_families); do
        if ! loop_run "$ipt" -w 5 -t raw -S PREROUTING >"$out"; then
            loop_log "$ipt -S failed"
            rc=1
            ROUND_IN_FRONT=0
            continue
        fi
        rules=()
        while IFS= read -r line; do
            line=${line//\"/} # iptables -S quotes comments (1.8.9 always, older ones if needed)
            [[ "$line" == "-A PREROUTING "* ]] && rules+=("$line")
        done <"$out"
        local n=0 r
        for r in "${rules[@]}"; do [[ "$r" != "$want" ]] || n=$((n + 1)); done
        if ((n == 1)) && [[ "${rules[0]}" == "$want" ]]; then continue; fi
        ROUND_IN_FRONT=0
        {
            echo "*raw"
            for ((r = 0; r < n; r++)); do echo "-D PREROUTING -m comment --comment cali:fake -j ACCEPT"; done
            echo "-I PREROUTING 1 -m comment --comment cali:fake -j ACCEPT"
            echo COMMIT
        } >"$restore"
        if loop_run "$ipt-restore" -w 5 --noflush "$restore"; then
            loop_log "$ipt: cali:fake put first (had $n, first rule was: ${rules[0]:-none})"
        else
            loop_log "$ipt-restore failed"
            rc=1
        fi
    done
    return "$rc"
}

# One round of kube-proxy's periodic sync.
KUBE_PROXY_ROUND=1
kube_proxy_resync_round() {
    local ipt v fam chain ok=1
    if [[ "$KUBE_PROXY" == nftables ]]; then
        for fam in ip ip6; do
            [[ -f "$RUN_DIR/kube-proxy-$fam.resync.nft" ]] || continue
            loop_run nft -f "$RUN_DIR/kube-proxy-$fam.resync.nft" || { ok=0; loop_log "nft -f ($fam) failed"; }
        done
    else
        for ipt in $(ipt_families); do
            v=4
            [[ "$ipt" == ip6* ]] && v=6
            for chain in PREROUTING OUTPUT; do
                loop_run "$ipt" -w 5 -C "$chain" -t nat "${KUBE_PORTALS[@]}" 2>/dev/null ||
                    loop_run "$ipt" -w 5 -I "$chain" -t nat "${KUBE_PORTALS[@]}" ||
                    { ok=0; loop_log "$ipt: jump from $chain failed"; }
            done
            loop_run "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-proxy-nat-v$v.rules" ||
                { ok=0; loop_log "$ipt-restore failed"; }
            kube_filter_jumps "$ipt" loop_run || { ok=0; loop_log "$ipt: filter jumps failed"; }
            kube_filter_restore "$ipt" "$KUBE_PROXY_ROUND" >"$RUN_DIR/kube-proxy-filter-v$v.rules"
            loop_run "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-proxy-filter-v$v.rules" ||
                { ok=0; loop_log "$ipt-restore (filter) failed"; }
        done
        KUBE_PROXY_ROUND=$((KUBE_PROXY_ROUND + 1))
    fi
    if ((ok)); then loop_log "synced"; else return 1; fi
}

run_loop() { # run_loop SVC
    local svc=$1 round tick="$RUN_DIR/$1.tick" first=1 ok=0 failed=0 in_front=0
    case $svc in
    cni-noise) round=cni_noise_round ;;
    kube-proxy-resync) round=kube_proxy_resync_round ;;
    *) die "bad loop $svc" ;;
    esac
    load_state
    trap loop_exit TERM INT
    loop_log "started (pid $$)"
    # A FIFO nobody writes to: `read -t 1` on it is a sleep the TERM trap interrupts.
    rm -f "$tick"
    mkfifo "$tick"
    exec 9<>"$tick"
    rm -f "$tick"
    while :; do
        ROUND_IN_FRONT=0
        if "$round"; then
            ok=$((ok + 1))
            in_front=$((in_front + ROUND_IN_FRONT))
        else
            failed=$((failed + 1))
            loop_log "round failed"
        fi
        echo "ok=$ok failed=$failed in_front=$in_front" >"$RUN_DIR/$svc.rounds.tmp"
        mv -f "$RUN_DIR/$svc.rounds.tmp" "$RUN_DIR/$svc.rounds"
        if ((first)); then
            if ((failed)); then
                loop_log "the first round failed: stopping"
                exit 1
            fi
            echo "$$" >"$RUN_DIR/$svc.ready"
            first=0
        fi
        read -r -t 1 -u 9 _ || true
    done
}

loop_start() { # loop_start SVC
    local svc=$1 pid deadline
    load_state
    if [[ $svc == kube-proxy-resync && $KUBE_PROXY == ipvs ]]; then
        die "kube-proxy-resync is not modelled for --kube-proxy ipvs"
    fi
    ns_exists node || die "namespace $(ns_name node) does not exist"
    rm -f "$RUN_DIR/$svc.ready" "$RUN_DIR/$svc.rounds"
    svc_start "$svc" node bash "$SELF" __loop "$PREFIX" "$svc"
    pid=$(<"$RUN_DIR/$svc.pid")
    deadline=$(($(now_ms) + 15000))
    until [[ -f "$RUN_DIR/$svc.ready" && "$(<"$RUN_DIR/$svc.ready")" == "$pid" ]]; do
        if ! svc_pid "$svc" >/dev/null || (($(now_ms) > deadline)); then
            tail -n 5 "$RUN_DIR/$svc.log" >&2
            svc_term "$svc"
            die "$svc failed to start (log: $RUN_DIR/$svc.log)"
        fi
        sleep 0.01
    done
}

loop_rounds() { # loop_rounds SVC: the counts of the loop's rounds since its -start
    [[ -f "$RUN_DIR/$1.rounds" ]] || die "$1 has not finished a round since its -start"
    cat "$RUN_DIR/$1.rounds"
}

# ---------------------------------------------------------------------------------------------

cmd_xtables_lock_hold() {
    if (($# != 1)) || [[ ! "$1" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then usage; fi
    load_state
    # The background shell takes the lock on its fd 9, then becomes `sleep`, keeping the fd: the
    # lock is held exactly as long as that process lives.
    # shellcheck disable=SC2016 # expanded by the inner shell
    svc_start xtables-lock node bash -c 'exec 9>>"$1" && flock -x 9 && exec sleep "$2"' _ "$XTABLES_LOCKFILE" "$1"
    echo "$XTABLES_LOCKFILE"
}

cmd_netem() {
    load_state
    if (($#)); then
        in_ns node tc qdisc replace dev dns root netem "$@" ||
            die "tc netem $* failed: the kernel needs sch_netem (this one: $(uname -r); the ci/vm guest has it)"
    else
        in_ns node tc qdisc del dev dns root 2>/dev/null || true
    fi
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
    # Each simulated node has its own xtables lock (see xtables-lock-hold).
    export XTABLES_LOCKFILE="$RUN_DIR/xtables.lock"
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
    node-cache-rules) cmd_node_cache_rules "$@" ;;
    listen-addrs-del | listen-addrs-add) (($# == 0)) || usage; listen_addrs "${cmd#listen-addrs-}" ;;
    cni-noise-start | kube-proxy-resync-start) (($# == 0)) || usage; loop_start "${cmd%-start}" ;;
    cni-noise-stop | kube-proxy-resync-stop) (($# == 0)) || usage; svc_term "${cmd%-stop}" ;;
    cni-noise-rounds | kube-proxy-resync-rounds) (($# == 0)) || usage; loop_rounds "${cmd%-rounds}" ;;
    __loop) (($# == 1)) || usage; run_loop "$1" ;; # internal: the noise loops
    xtables-lock-hold) cmd_xtables_lock_hold "$@" ;;
    xtables-lock-release) (($# == 0)) || usage; svc_term xtables-lock ;;
    kube-proxy-migrate) (($# == 0)) || usage; cmd_kube_proxy_migrate ;;
    netem) (($# > 0)) || usage; cmd_netem "$@" ;;
    netem-clear) (($# == 0)) || usage; cmd_netem ;;
    exec) cmd_exec "$@" ;;
    *) usage ;;
    esac
}

main "$@"
