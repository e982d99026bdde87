#!/usr/bin/env bash
# realnode.sh: a real Kubernetes node in network namespaces: the kubelet runs node-local-dns, the
# agent and the pods, as on a cluster. Every part is real and built from pinned sources
# (ci/k8s/build.sh): etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
# containerd with its runc shim (runc from Debian), the CNI plugins, kube-proxy, CoreDNS and
# node-cache; the images are built here from local files (realnode/images.sh: no registry).
#
#   $P-cp (eth0 10.240.0.2)                     $P-node
#     etcd (its lo), kube-apiserver :6443   <-veth cp->  10.240.0.1 (the node's InternalIP)
#     kube-controller-manager, kube-scheduler            kubelet, containerd (cgroupfs, cgroup v1)
#                                                        cni0 10.244.0.1/24: the pods (CNI bridge)
#                                                        lo: 169.254.20.10 and 10.96.0.10
#
# The cluster's DNS as a kubeadm cluster has it: CoreDNS a Deployment behind Service kube-dns
# (10.96.0.10), kube-proxy a DaemonSet (iptables or nftables mode), node-local-dns upstream's
# DaemonSet manifest (Kubernetes' cluster/addons/dns/nodelocaldns, from the pinned Kubernetes
# module), with kube-dns-upstream (10.96.0.11); the kubelet's clusterDNS 10.96.0.10 and a
# resolvConf of the node's, as kubeadm writes them. The test bed's own changes, each said where
# it is made (realnode/addons.sh): images by local names, pulled never; node-cache with
# `-setupinterface=false` and its listen IPs on the node's lo (this kernel has no dummy
# interfaces); who.test answered 1.1.1.1 by node-local-dns and 2.2.2.2 by CoreDNS (the template
# plugin), so that a test sees who answered.
#
# The node's mount namespace is owned by one holder process (`ip netns exec` would remount /sys
# and hide the cgroups): a tmpfs over /run and bind mounts over the host paths kubelet, libcni
# and containerd hard-code, and over three /proc/sys files kubelet would rewrite host-wide. Every
# process of the node (holder, containerd and its shims, kubelet, the containers) lives under
# the cgroup nlha-$P of each v1 hierarchy (kubelet's cgroupRoot), and `down` stops them by that
# cgroup's pid lists, then removes the cgroups, the namespaces and the mount points it made.
#
# Usage: realnode.sh CMD PREFIX [args]   (PREFIX: 1-8 chars [a-z0-9]; namespaces are $PREFIX-*)
#   up PREFIX [--kube-proxy iptables|nftables] [--agent-image NAME]
#     The node Ready, the cluster's DNS running (kube-proxy, CoreDNS, node-local-dns, the
#     clients' Deployment `dns-client` in `default`), answering who.test from a client pod.
#     --agent-image: the agent's image (ci/image/build.sh's) imported, for the tests that
#     install the chart.
#   down PREFIX
#   kubectl PREFIX ARGS...        kubectl as the cluster's admin
#   helm PREFIX ARGS...           helm as the cluster's admin
#   in-node PREFIX CMD...         CMD in the node's network and mount namespaces
#   ctr PREFIX ARGS...            containerd's ctr, namespace k8s.io
#   container-pid PREFIX NAMESPACE POD CONTAINER
#     the pid (as the machine sees it) of CONTAINER's main process in POD
#   image-tag PREFIX SOURCE TARGET
#     a second name for an image containerd has (an upgrade with the same bits)
#   node-local-dns-patch PREFIX AGENT-IMAGE
#     the project's changes to node-local-dns (manifests/node-local-dns) patched into
#     the cluster's DaemonSet, the drain client from AGENT-IMAGE; returns once it has rolled
#   webhook-install PREFIX AGENT-IMAGE
#     the admission webhook as manifests/README.md installs it without cert-manager (a serving
#     certificate made with openssl, its CA patched in); returns once its Deployment is Ready
#   kubelet-restart PREFIX | containerd-restart PREFIX
#     the daemon stopped (SIGTERM) and started again; the pods keep running
#   node-stop PREFIX | node-start PREFIX [--register-with-taints KEY:EFFECT[,...]]
#     a reboot: every container, containerd and the kubelet killed, the pods' network, /run and
#     the node's netfilter gone; then containerd and the kubelet started again, which restart
#     the pods (a Node registered anew gets the taints, as kubelet's --register-with-taints)
# State (configs, pidfiles, logs) lives in ${REALNODE_DIR:-/tmp/realnode}/PREFIX. Nothing here
# touches the root network namespace or its netfilter. REALNODE_TRACE=1 traces.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
if [[ -n "${REALNODE_TRACE:-}" ]]; then set -x; fi

SELF="$(readlink -f "${BASH_SOURCE[0]}")"
readonly SELF SCRIPT_DIR="${SELF%/*}"
readonly REPO="${SCRIPT_DIR%/*}"
# shellcheck source=realnode/common.sh
source "$SCRIPT_DIR/realnode/common.sh"
# shellcheck source=realnode/control-plane.sh
source "$SCRIPT_DIR/realnode/control-plane.sh"
# shellcheck source=realnode/node.sh
source "$SCRIPT_DIR/realnode/node.sh"
# shellcheck source=realnode/images.sh
source "$SCRIPT_DIR/realnode/images.sh"
# shellcheck source=realnode/addons.sh
source "$SCRIPT_DIR/realnode/addons.sh"

usage() { sed -n '/^# Usage:/,/^# State/p' "$SELF" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

cmd_up() {
    local agent_image=""
    KUBE_PROXY=iptables
    while (($#)); do
        case $1 in
        --kube-proxy) KUBE_PROXY=${2:-}; shift 2 || usage ;;
        --agent-image) agent_image=${2:-}; shift 2 || usage ;;
        *) usage ;;
        esac
    done
    [[ $KUBE_PROXY =~ ^(iptables|nftables)$ ]] || die "--kube-proxy must be iptables or nftables"
    local role
    for role in node cp; do
        ! ns_exists "$role" || die "namespace $(ns_name "$role") already exists (run: $0 down $PREFIX)"
    done
    [[ ! -d /sys/fs/cgroup/pids/$CGROUP ]] || die "cgroup $CGROUP already exists (run: $0 down $PREFIX)"
    # Every part built (0.1 s when cached), every image made, before anything is set up.
    parts_bin
    images_build "$agent_image"

    trap 'up_failed $?' EXIT
    rm -rf "$RUN_DIR"
    mkdir -p "$RUN_DIR/log"
    echo "$KUBE_PROXY" >"$RUN_DIR/kube-proxy"
    echo "$agent_image" >"$RUN_DIR/agent-image"
    step "parts in $BIN; images ready"
    pki_make
    namespaces_add
    cgroups_add
    step "namespaces, cgroups"
    control_plane_start
    step "etcd, kube-apiserver, kube-controller-manager, kube-scheduler"
    node_start
    images_import
    step "containerd up, images imported"
    kubelet_start
    wait_for 120 "the node to be Ready" node_ready
    step "kubelet: node $(ns_name node) Ready"
    addons_apply
    step "kube-proxy, CoreDNS, node-local-dns and the clients answering"
    trap - EXIT
    echo "realnode $PREFIX up: kube-proxy $KUBE_PROXY; kubectl: $0 kubectl $PREFIX ...; log: $RUN_DIR/log"
}

up_failed() {
    trap - EXIT
    if (($1 != 0)); then
        echo "realnode: up $PREFIX failed, cleaning up (logs kept in $RUN_DIR/log)" >&2
        KEEP_LOGS=1 cmd_down
    fi
}

# down: the workloads stopped by the kubelet while it runs (so that CNI frees their addresses),
# then every process of the node and the control plane by pid, the cgroups, the namespaces, the
# mount points.
cmd_down() {
    if [[ -d "$RUN_DIR" ]]; then
        node_stop_workloads || true
        node_stop
        control_plane_stop
    fi
    node_cleanup
    local role
    for role in node cp; do
        if ns_exists "$role"; then ip netns delete "$(ns_name "$role")"; fi
    done
    if [[ -z "${KEEP_LOGS:-}" ]]; then rm -rf "$RUN_DIR"; fi
}

main() {
    (($# >= 2)) || usage
    local cmd=$1
    PREFIX=$2
    shift 2
    [[ "$PREFIX" =~ ^[a-z0-9]{1,8}$ ]] || die "PREFIX must be 1-8 chars of [a-z0-9], got '$PREFIX'"
    RUN_DIR="${REALNODE_DIR:-/tmp/realnode}/$PREFIX"
    CGROUP=nlha-$PREFIX
    [[ $(id -u) == 0 ]] || die "must run as root"
    case $cmd in
    up) cmd_up "$@" ;;
    down) (($# == 0)) || usage; cmd_down ;;
    kubectl) parts_bin_quick; kc "$@" ;;
    helm) parts_bin_quick; helm_admin "$@" ;;
    in-node) in_node "$@" ;;
    ctr) parts_bin_quick; ctr_node "$@" ;;
    container-pid) (($# == 3)) || usage; parts_bin_quick; container_pid "$@" ;;
    image-tag) (($# == 2)) || usage; parts_bin_quick; ctr_node images tag --force "$1" "$2" >/dev/null ;;
    node-local-dns-patch) (($# == 1)) || usage; parts_bin_quick; node_local_dns_patch "$1" ;;
    webhook-install) (($# == 1)) || usage; parts_bin_quick; webhook_install "$1" ;;
    kubelet-restart) (($# == 0)) || usage; parts_bin_quick; load_state; daemon_restart kubelet ;;
    containerd-restart) (($# == 0)) || usage; parts_bin_quick; load_state; daemon_restart containerd ;;
    node-stop) (($# == 0)) || usage; parts_bin_quick; load_state; node_reboot_stop ;;
    node-start) parts_bin_quick; load_state; node_reboot_start "$@" ;;
    *) usage ;;
    esac
}

main "$@"
