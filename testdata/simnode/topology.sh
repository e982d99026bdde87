# shellcheck shell=bash
# simnode topology: the namespaces, the veths between them with their addresses and routes (the
# picture in simnode.sh), the node-local IPs, and netem on the link to "CoreDNS".

# add_namespaces: one namespace per role, lo up.
add_namespaces() {
    local role
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
}

# delete_namespaces: every role's namespace that exists, and with it the veths.
delete_namespaces() {
    local role
    for role in "${ROLES[@]}"; do
        if ns_exists "$role"; then ip netns delete "$(ns_name "$role")"; fi
    done
    # The real parts' control-plane host (real.sh), when its processes are gone.
    if ns_exists cp && [[ -z "$(ip netns pids "$(ns_name cp)" 2>/dev/null)" ]]; then ip netns delete "$(ns_name cp)"; fi
}

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

# Where the node-local IPs live (--listen-dev): lo (the default) works on every kernel; dummy is
# node-cache's own layout (cmd/node-cache/app: netif.EnsureDummyDevice): a dummy interface
# `nodelocaldns`, left down, holding the IPs as /32. IPv4 only here; needs the dummy module (the
# ci/vm guest has it, the build machine's kernel has no CONFIG_DUMMY). veth stands in for that
# dummy where there is none: an interface of node-cache's own, not lo, so that deleting it
# (node-cache's teardown) leaves whatever else holds the IPs (the agent's copies on lo); both
# ends up, in the node, so IPv6 addresses on it are usable.
add_listen_dev() {
    local node
    node=$(ns_name node)
    case $LISTEN_DEV_KIND in
    lo) ;;
    # node-cache's interface: created, never set up (netif.AddDummyDevice).
    dummy) ip -n "$node" link add "$LISTEN_DEV" type dummy ;;
    veth)
        ip -n "$node" link add "$LISTEN_DEV" type veth peer name "$LISTEN_DEV-p"
        ip -n "$node" link set "$LISTEN_DEV-p" up
        ip -n "$node" link set "$LISTEN_DEV" up
        ;;
    esac
}

# listen_ips add|del 4|6: the node-local IP and the cluster-DNS IP of one family on the listen
# device.
listen_ips() {
    local op=$1 ip
    if [[ $2 == 4 ]]; then
        for ip in "$V4_LOCAL_IP" "$V4_CLUSTER_DNS"; do ip -n "$(ns_name node)" addr "$op" "$ip/32" dev "$LISTEN_DEV"; done
    else
        for ip in "$V6_LOCAL_IP" "$V6_CLUSTER_DNS"; do
            # shellcheck disable=SC2046 # nodad only when adding
            ip -n "$(ns_name node)" addr "$op" "$ip/128" dev "$LISTEN_DEV" $([[ $op == add ]] && echo nodad)
        done
    fi
}

# netem ARGS...: `tc qdisc replace dev dns root netem ARGS` on the node's side of the veth to
# "CoreDNS": every packet the node sends there. No ARGS (netem-clear): removes it.
cmd_netem() {
    load_state
    if (($#)); then
        in_ns node tc qdisc replace dev dns root netem "$@" ||
            die "tc netem $* failed: the kernel needs sch_netem (this one: $(uname -r); the ci/vm guest has it)"
    else
        in_ns node tc qdisc del dev dns root 2>/dev/null || true
    fi
}

# exec ROLE CMD...: CMD in ROLE's namespace, in place of this script.
cmd_exec() {
    (($# >= 2)) || usage
    local role=$1
    shift
    [[ " ${ROLES[*]} " == *" $role "* ]] || die "exec: role must be one of ${ROLES[*]}"
    ns_exists "$role" || die "namespace $(ns_name "$role") does not exist"
    exec ip netns exec "$(ns_name "$role")" "$@"
}
