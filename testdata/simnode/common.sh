# shellcheck shell=bash disable=SC2034 # the constants are for the other parts
# simnode common: the node's address plan, its namespaces, clocks and waits, and the options `up`
# saved for later commands (the family, kube-proxy's mode and with it the iptables flavour).

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

# save_state: what `up` was told, in $RUN_DIR, for every later command's load_state.
save_state() {
    echo "$FAMILY" >"$RUN_DIR/family"
    echo "$KUBE_PROXY" >"$RUN_DIR/kube-proxy"
    if [[ -n "$FILTER_LO" ]]; then echo "$FILTER_LO" >"$RUN_DIR/filter-drop"; fi
    echo "$LISTEN_DEV" >"$RUN_DIR/listen-dev"
    echo "$LISTEN_DEV_KIND" >"$RUN_DIR/listen-dev-kind"
}
load_state() {
    [[ -f "$RUN_DIR/family" ]] || die "$PREFIX is not up (no $RUN_DIR/family)"
    FAMILY=$(<"$RUN_DIR/family")
    KUBE_PROXY=iptables-nft
    if [[ -f "$RUN_DIR/kube-proxy" ]]; then KUBE_PROXY=$(<"$RUN_DIR/kube-proxy"); fi
    FILTER_LO="" # --filter-drop: loopback | accept-lo
    if [[ -f "$RUN_DIR/filter-drop" ]]; then FILTER_LO=$(<"$RUN_DIR/filter-drop"); fi
    LISTEN_DEV=lo LISTEN_DEV_KIND=lo
    if [[ -f "$RUN_DIR/listen-dev" ]]; then LISTEN_DEV=$(<"$RUN_DIR/listen-dev"); fi
    if [[ -f "$RUN_DIR/listen-dev-kind" ]]; then LISTEN_DEV_KIND=$(<"$RUN_DIR/listen-dev-kind"); fi
    set_flavour
}

# --kube-proxy names the backend kube-proxy uses; "the flavour" (IPT4, IPT6) is the iptables
# binary of the node's Kubernetes components: kube-proxy's own in its iptables modes, and for
# nftables and IPVS modes the host's iptables (iptables-nft), which kubelet uses.
set_flavour() {
    IPT4=$KUBE_PROXY
    # Real kube-proxy in iptables mode runs the host's `iptables`: iptables-nft here.
    [[ "$KUBE_PROXY" != nftables && "$KUBE_PROXY" != ipvs && "$KUBE_PROXY" != real-* ]] || IPT4=iptables-nft
    IPT6="ip6${IPT4#ip}"
}
# The iptables binaries for the node's families, v4 first.
ipt_families() {
    if has_v4; then echo "$IPT4"; fi
    if has_v6; then echo "$IPT6"; fi
}
