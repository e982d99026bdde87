# shellcheck shell=bash
# realnode node: the node's cgroups and mount namespace, containerd and the kubelet, and their
# stop, restart and cleanup.
#
# What running them inside a network namespace of a shared machine takes, each found by a
# failure:
#   * cgroup v1 (these machines are hybrid hosts): the kubelet refuses it since 1.35 unless told
#     (`failCgroupV1: false`, cgroupfs driver); containerd 2.2 only warns.
#   * one process (the holder) owns the node's mount namespace: `ip netns exec` remounts /sys
#     and hides the cgroups, and containerd and the kubelet must see the same mounts.
#   * paths hard-coded to the host: the kubelet's device-plugin socket under /var/lib/kubelet and
#     /var/log/containers, libcni's /var/lib/cni, containerd's shim sockets under /run/containerd,
#     pods' network namespaces under /var/run/netns: a tmpfs over /run and bind mounts over the
#     others, in the node's mount namespace only.
#   * the kubelet rewrites host sysctls (vm.overcommit_memory, kernel.panic,
#     kernel.panic_on_oops): files holding the values it wants are bind-mounted over those three.
#   * no CAP_SYS_RESOURCE in this machine's bounding set: runc cannot lower oom_score_adj, so
#     containerd restricts it (`restrict_oom_score_adj`; system-node-critical pods get 0).

# cgroups_add: nlha-$P in every v1 hierarchy (kubelet's cgroupRoot; cpuset's needs its cpus and
# mems before a process can join).
cgroups_add() {
    local c
    for c in "${CGROUP_HIERARCHIES[@]}"; do
        mkdir -p "/sys/fs/cgroup/$c/$CGROUP"
    done
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$CGROUP/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$CGROUP/cpuset.mems"
}

# The host paths the node's mount namespace covers, and where each one's content lives.
readonly NODE_SHADOWS=(/var/lib/cni /var/log/containers /var/log/pods /var/lib/kubelet /opt/containerd)

node_start() {
    local d shadow
    mkdir -p "$RUN_DIR/shadow" "$RUN_DIR/sysctl" "$RUN_DIR/cni/conf" "$RUN_DIR/cni/ipam" \
        "$RUN_DIR/manifests" "$RUN_DIR/pod-logs" "$RUN_DIR/kubelet"
    # Mount points on the host for the paths the node covers: empty directories, made only where
    # missing, and removed again by `down`.
    for d in "${NODE_SHADOWS[@]}"; do
        if [[ ! -e $d ]]; then mkdir -p "$d" && echo "$d" >>"$RUN_DIR/made-dirs"; fi
        mkdir -p "$RUN_DIR/shadow/${d//\//_}"
    done
    echo 1 >"$RUN_DIR/sysctl/overcommit_memory"
    echo 10 >"$RUN_DIR/sysctl/panic"
    echo 1 >"$RUN_DIR/sysctl/panic_on_oops"
    # The holder: in the node's cgroups (every process of the node is) and network namespace,
    # with a mount namespace of its own whose mounts do not propagate back to the host.
    # shellcheck disable=SC2016 # expanded by the child shell
    bash -c 'for c in '"${CGROUP_HIERARCHIES[*]}"'; do
            echo $$ >"/sys/fs/cgroup/$c/'"$CGROUP"'/cgroup.procs" || exit 125; done
        exec nsenter --net=/run/netns/'"$(ns_name node)"' unshare --mount --propagation slave -- bash -c "$1"' \
        _ "
        set -e
        mount -n --bind $RUN_DIR/sysctl/overcommit_memory /proc/sys/vm/overcommit_memory
        mount -n --bind $RUN_DIR/sysctl/panic /proc/sys/kernel/panic
        mount -n --bind $RUN_DIR/sysctl/panic_on_oops /proc/sys/kernel/panic_on_oops
        mount -n -t tmpfs -o mode=755,size=256m realnode-$PREFIX-run /run
        $(for d in "${NODE_SHADOWS[@]}"; do echo "mount -n --bind $RUN_DIR/shadow/${d//\//_} $d"; done)
        exec sleep infinity" </dev/null >>"$RUN_DIR/log/holder.log" 2>&1 &
    echo $! >"$RUN_DIR/holder.pid"
    disown
    wait_for 10 "the node's holder process" holder_ready
    containerd_config
    svc_start containerd node env PATH="$BIN:/usr/sbin:/usr/bin:/sbin:/bin" "$BIN/containerd" \
        --config "$RUN_DIR/containerd.toml"
    wait_for 30 "containerd's socket" ctr_node version
}

# holder_ready: the holder runs `sleep` with the node's /run mounted.
holder_ready() {
    local pid
    pid=$(holder_pid) || return 1
    grep -q "^realnode-$PREFIX-run /run tmpfs " "/proc/$pid/mounts"
}

containerd_config() {
    cat >"$RUN_DIR/containerd.toml" <<EOF
version = 3
root = "$RUN_DIR/containerd/root"
state = "$RUN_DIR/containerd/state"
# Plugins that need what this machine has not (btrfs, zfs, devmapper, erofs) or that would
# listen on host paths (the NRI socket, /opt/containerd).
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.erofs", "io.containerd.differ.v1.erofs"]
[grpc]
  address = "$RUN_DIR/containerd.sock"
[ttrpc]
  address = "$RUN_DIR/containerd.sock.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$IMAGE_PAUSE"
[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$BIN/cni"]
    conf_dir = "$RUN_DIR/cni/conf"
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF
    # The pods' network: a bridge in the node, addresses from the node's pod CIDR.
    cat >"$RUN_DIR/cni/conf/10-realnode.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "realnode",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$RUN_DIR/cni/ipam",
              "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

kubelet_config() {
    # The node's own resolv.conf (the kubelet's resolvConf: what dnsPolicy Default pods get,
    # node-local-dns and CoreDNS among them, for names outside the cluster): a resolver of the
    # node's network that is not there (the control plane's host answers port unreachable), so
    # that an outside name fails at once and never loops back into the cluster's DNS.
    printf 'nameserver %s\n' "$V4_APISERVER" >"$RUN_DIR/resolv.conf"
    cat >"$RUN_DIR/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 hosts: refused since 1.35 unless told; the override stays through 1.37.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP
containerRuntimeEndpoint: unix://$RUN_DIR/containerd.sock
# As kubeadm writes them: the kube-dns ClusterIP and the node's resolv.conf.
clusterDNS: [$CLUSTER_DNS]
clusterDomain: cluster.local
resolvConf: $RUN_DIR/resolv.conf
staticPodPath: $RUN_DIR/manifests
podLogsDir: $RUN_DIR/pod-logs
address: $V4_CP_NODE
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $RUN_DIR/pki/ca.crt}
authorization: {mode: Webhook}
protectKernelDefaults: false
failSwapOn: false
serializeImagePulls: false
# The machine's disk is shared: never evict or collect images for it.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 5s
volumePluginDir: $RUN_DIR/kubelet/volume-plugins
registerWithTaints: [$REGISTER_WITH_TAINTS]
EOF
}

# kubelet_start: the kubelet, with the taints it registers a new Node with in
# $RUN_DIR/register-with-taints (KEY:EFFECT, comma-separated; node-start writes it).
kubelet_start() {
    local taint
    REGISTER_WITH_TAINTS=""
    for taint in $(tr ',' ' ' <"$RUN_DIR/register-with-taints" 2>/dev/null); do
        REGISTER_WITH_TAINTS+="${REGISTER_WITH_TAINTS:+, }{key: \"${taint%%:*}\", effect: ${taint#*:}}"
    done
    kubelet_config
    svc_start kubelet node env PATH="$BIN:/usr/sbin:/usr/bin:/sbin:/bin" "$BIN/kubelet" \
        --config="$RUN_DIR/kubelet.yaml" --kubeconfig="$RUN_DIR/kubelet.kubeconfig" \
        --root-dir="$RUN_DIR/kubelet" --cert-dir="$RUN_DIR/kubelet/pki" \
        --hostname-override="$(ns_name node)" --node-ip="$V4_CP_NODE" --v=1
}

# kubelet_healthy: its own health check says ok (its runtime and PLEG included).
kubelet_healthy() { [[ "$(in_node curl -sf --max-time 2 http://127.0.0.1:10248/healthz)" == ok ]]; }

# node_ready: the Node is Ready, and has the pod CIDR the CNI range is (kube-proxy reads it).
node_ready() {
    local node
    node=$(ns_name node)
    [[ "$(kc get node "$node" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" == True ]] || return 1
    if [[ -z "$(kc get node "$node" -o 'jsonpath={.spec.podCIDR}')" ]]; then
        kc patch node "$node" --type=merge -p "{\"spec\":{\"podCIDR\":\"$POD_CIDR\",\"podCIDRs\":[\"$POD_CIDR\"]}}" >/dev/null
    fi
}

# node_stop_workloads: every pod deleted through the API while the kubelet runs, so that it
# stops their containers and CNI frees their addresses; waits for the containers to be gone.
node_stop_workloads() {
    svc_pid kubelet >/dev/null && svc_pid kube-apiserver >/dev/null || return 0
    parts_bin_quick
    local ns
    for ns in $(kc get namespaces -o 'jsonpath={.items[*].metadata.name}' 2>/dev/null); do
        kc -n "$ns" delete daemonsets,deployments,replicasets,pods --all --wait=false --grace-period=2 \
            >>"$RUN_DIR/log/kubectl.log" 2>&1 || true
    done
    local deadline=$(($(now_ms) + 60000))
    while [[ -n "$(ctr_node tasks ls -q 2>/dev/null)" ]] && (($(now_ms) < deadline)); do sleep 0.5; done
}

# node_stop: kubelet, then containerd, then whatever is left in the node's cgroups (the shims,
# containers whose shim is gone), by pid.
node_stop() {
    svc_stop kubelet 10
    svc_stop containerd 10
    cgroup_kill
    local pid
    if pid=$(holder_pid); then kill -KILL "$pid" 2>/dev/null || true; fi
    rm -f "$RUN_DIR/holder.pid"
}

# cgroup_kill: SIGKILL to every process in the node's cgroups (pids hierarchy, which holds
# every one of them), until none is left.
cgroup_kill() {
    local root=/sys/fs/cgroup/pids/$CGROUP pids deadline
    [[ -d $root ]] || return 0
    deadline=$(($(now_ms) + 10000))
    while pids=$(find "$root" -name cgroup.procs -exec cat {} + 2>/dev/null) && [[ -n $pids ]]; do
        # shellcheck disable=SC2086 # one pid a word
        kill -KILL $pids 2>/dev/null || true
        (($(now_ms) < deadline)) || die "processes left in cgroup $CGROUP after SIGKILL: $pids"
        sleep 0.05
    done
}

# node_cleanup: the cgroups (deepest first), the mount points made on the host.
node_cleanup() {
    cgroup_kill
    local c
    for c in "${CGROUP_HIERARCHIES[@]}" unified; do
        [[ -d /sys/fs/cgroup/$c/$CGROUP ]] || continue
        find "/sys/fs/cgroup/$c/$CGROUP" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [[ ! -d /sys/fs/cgroup/$c/$CGROUP ]] || echo "realnode: cgroup $c/$CGROUP left behind" >&2
    done
    if [[ -f $RUN_DIR/made-dirs ]]; then
        tac "$RUN_DIR/made-dirs" | while read -r d; do rmdir "$d" 2>/dev/null || true; done
        rm -f "$RUN_DIR/made-dirs"
    fi
}

# daemon_restart kubelet|containerd: stopped by SIGTERM and started again (the pods keep running:
# their shims outlive both).
daemon_restart() {
    svc_stop "$1" 10
    case $1 in
    kubelet)
        kubelet_start
        wait_for 60 "the kubelet's /healthz" kubelet_healthy
        ;;
    containerd)
        svc_start containerd node env PATH="$BIN:/usr/sbin:/usr/bin:/sbin:/bin" "$BIN/containerd" \
            --config "$RUN_DIR/containerd.toml"
        wait_for 30 "containerd's socket" ctr_node version
        ;;
    esac
}

# node_reboot_stop: what a reboot takes away: every process of the node (the kubelet, containerd,
# the shims, the containers) killed, the pods' network namespaces and the bridge gone, /run
# emptied (a tmpfs), the node's netfilter and conntrack empty. The Node object, the kubelet's
# and containerd's disk state, and the listen IPs on lo (the test bed's stand-in for
# node-cache's interface, which it would make again) stay.
node_reboot_stop() {
    svc_stop kubelet 10
    svc_stop containerd 10
    # Only the node's daemons and containers: the control plane's processes stay where they are.
    local root=/sys/fs/cgroup/pids/$CGROUP holder pid pids keep
    holder=$(holder_pid)
    keep=" $holder $(for s in etcd kube-apiserver kube-controller-manager kube-scheduler; do svc_pid "$s" || true; done | tr '\n' ' ') "
    pids=$(find "$root" -name cgroup.procs -exec cat {} + 2>/dev/null || true)
    for pid in $pids; do
        [[ $keep == *" $pid "* ]] || kill -KILL "$pid" 2>/dev/null || true
    done
    in_node ip link del cni0 2>/dev/null || true
    # Every mount the runtime and the kubelet made (the containers' root file systems, the pods'
    # volumes, shm and network namespaces), deepest first: a reboot leaves none.
    local mounts m
    mounts=$(in_node awk -v dir="$RUN_DIR/" 'index($2, dir) == 1 { print $2 }' /proc/self/mounts | sort -r)
    for m in $mounts; do in_node umount -l "$m" 2>/dev/null || true; done
    # What a reboot empties: the node's /run (a tmpfs), the pods' IP allocations, its netfilter.
    in_node sh -c 'rm -rf /run/* '"$RUN_DIR"'/cni/ipam/* '"$RUN_DIR"'/containerd/state'
    in_node nft flush ruleset
    local ipt table
    for ipt in iptables-legacy ip6tables-legacy; do
        for table in raw mangle nat filter; do
            in_node "$ipt" -t "$table" -F 2>/dev/null || true
            in_node "$ipt" -t "$table" -X 2>/dev/null || true
        done
    done
    in_node conntrack -F >/dev/null 2>&1 || true
}

# node_reboot_start [--register-with-taints KEY:EFFECT[,...]]: containerd and the kubelet started
# again; the kubelet registers the Node with those taints if it has to register it anew.
node_reboot_start() {
    case ${1:-} in
    --register-with-taints) echo "${2:?--register-with-taints KEY:EFFECT}" >"$RUN_DIR/register-with-taints" ;;
    "") rm -f "$RUN_DIR/register-with-taints" ;;
    *) usage ;;
    esac
    daemon_restart containerd
    kubelet_start
    wait_for 60 "the kubelet's /healthz" kubelet_healthy
}

# container_pid NAMESPACE POD CONTAINER: the pid of CONTAINER's main process in POD (its task in
# containerd), as the machine sees it.
container_pid() {
    local id pid
    id=$(kc -n "$1" get pod "$2" -o "jsonpath={.status.containerStatuses[?(@.name==\"$3\")].containerID}") ||
        die "no pod $2 in $1"
    [[ $id == containerd://* ]] || die "container $3 of $1/$2 is not running (containerID '$id')"
    pid=$(ctr_node tasks ls | awk -v id="${id#containerd://}" '$1 == id && $3 == "RUNNING" { print $2 }')
    [[ -n $pid ]] || die "container $3 of $1/$2 (${id#containerd://}) has no running task"
    echo "$pid"
}
