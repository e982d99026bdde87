# shellcheck shell=bash disable=SC2034 # the constants are for the other parts
# realnode common: the address plan, namespaces, waits, the parts' directory, and the daemons:
# started inside the node's cgroup, recorded by pid, signalled only while still ours.

readonly V4_CP_NODE=10.240.0.1 V4_APISERVER=10.240.0.2
readonly POD_CIDR=10.244.0.0/24 CLUSTER_CIDR=10.244.0.0/16 SERVICE_CIDR=10.96.0.0/12
readonly LOCAL_IP=169.254.20.10 CLUSTER_DNS=10.96.0.10 UPSTREAM_IP=10.96.0.11
readonly CACHE_A=1.1.1.1 COREDNS_A=2.2.2.2 PROBE_NAME=who.test
# The cgroup v1 hierarchies the kubelet (cgroupfs driver) and runc use.
readonly CGROUP_HIERARCHIES=(cpu cpuacct cpuset memory devices freezer blkio pids systemd)

die() { echo "realnode: $*" >&2; exit 1; }

ns_name() { echo "$PREFIX-$1"; }
ns_exists() { [[ -e "/run/netns/$(ns_name "$1")" ]]; }
in_cp() { ip netns exec "$(ns_name cp)" "$@"; }

now_ms() { local t=${EPOCHREALTIME/./}; echo $((10#$t / 1000)); }

# step WHAT: a line with the seconds since `up` began, so that a slow part is seen.
step() { echo "realnode: [$(((($(now_ms) - T0)) / 1000)).$((((($(now_ms) - T0)) % 1000) / 100)) s] $*" >&2; }
T0=$(now_ms)

# wait_for SECONDS WHAT CMD...: poll CMD until it succeeds, or fail after SECONDS, naming the
# daemon that exited meanwhile if one did.
wait_for() {
    local secs=$1 what=$2 deadline svc
    deadline=$(($(now_ms) + secs * 1000))
    shift 2
    until "$@" >/dev/null 2>&1; do
        for svc in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet; do
            if [[ -f "$RUN_DIR/$svc.pid" ]] && ! svc_pid "$svc" >/dev/null; then
                tail -n 20 "$RUN_DIR/log/$svc.log" >&2 || true
                die "$svc exited while waiting for $what (log: $RUN_DIR/log/$svc.log)"
            fi
        done
        (($(now_ms) < deadline)) || die "timed out after ${secs}s waiting for $what (logs: $RUN_DIR/log)"
        sleep 0.2
    done
}

load_state() {
    [[ -f "$RUN_DIR/kube-proxy" ]] || die "$PREFIX is not up (no $RUN_DIR/kube-proxy)"
    KUBE_PROXY=$(<"$RUN_DIR/kube-proxy")
}

# The parts every real node runs (ci/k8s/build.sh): built when missing, 0.1 s when cached; or
# taken from NLHA_K8S_BIN, a directory ci/k8s/build.sh filled (ci/test.sh sets it).
readonly PARTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl
    coredns helm containerd cni-plugins node-cache)
parts_bin() {
    local build="$REPO/ci/k8s/build.sh" out part
    if [[ -n ${NLHA_K8S_BIN:-} ]]; then
        for part in "${PARTS[@]/cni-plugins/cni\/portmap}"; do
            [[ -x $NLHA_K8S_BIN/$part ]] || die "NLHA_K8S_BIN=$NLHA_K8S_BIN has no $part (build it with ci/k8s/build.sh)"
        done
    else
        out=$("$build" "${PARTS[@]}" 2>&1) || die "ci/k8s/build.sh failed: $(tail -n 8 <<<"$out")"
    fi
    parts_bin_quick
}
parts_bin_quick() {
    BIN=${NLHA_K8S_BIN:-$("$REPO/ci/k8s/build.sh" --bin-dir)} || die "ci/k8s/build.sh --bin-dir failed"
}

# The node's holder: its pid owns the node's mount namespace (and joins its network namespace).
holder_pid() {
    local pid
    pid=$(cat "$RUN_DIR/holder.pid" 2>/dev/null) || return 1
    [[ -e /proc/$pid && "$(cat "/proc/$pid/comm" 2>/dev/null)" == sleep ]] || return 1
    echo "$pid"
}
in_node() {
    local holder
    holder=$(holder_pid) || die "$PREFIX's node is not up (no holder process)"
    nsenter -t "$holder" -m -n -- "$@"
}

kc() { in_node "$BIN/kubectl" --kubeconfig "$RUN_DIR/admin.kubeconfig" --request-timeout=20s "$@"; }
helm_admin() {
    in_node env HOME="$RUN_DIR/helm" HELM_CACHE_HOME="$RUN_DIR/helm/cache" \
        HELM_CONFIG_HOME="$RUN_DIR/helm/config" HELM_DATA_HOME="$RUN_DIR/helm/data" \
        "$BIN/helm" --kubeconfig "$RUN_DIR/admin.kubeconfig" "$@"
}
# ctr, without the deprecation warning about cgroup v1 it prints on every call.
ctr_node() {
    in_node "$BIN/ctr" --address "$RUN_DIR/containerd.sock" --namespace k8s.io "$@" 2> >(grep -v 'DEPRECATION: The support for cgroup v1' >&2)
}

# svc_pid SVC: the recorded pid while that process still runs the program we started.
svc_pid() {
    local pid comm
    pid=$(cat "$RUN_DIR/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ && -e /proc/$pid ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "${1:0:15}" ]] || return 1
    grep -q '^State:[[:space:]]*[ZX]' "/proc/$pid/status" 2>/dev/null && return 1
    echo "$pid"
}

# svc_start SVC WHERE CMD...: CMD in the background, inside the node's cgroups (so that `down`
# finds it and whatever it starts), in the control plane's namespace (WHERE=cp) or in the node's
# network and mount namespaces (WHERE=node). The wrapper shell moves itself into the cgroups and
# execs (and `ip netns exec` and `nsenter` exec), so the recorded pid is the daemon's.
svc_start() {
    local svc=$1 where=$2 enter
    shift 2
    if svc_pid "$svc" >/dev/null; then die "$svc already running (pid $(svc_pid "$svc"))"; fi
    case $where in
    cp) enter=(ip netns exec "$(ns_name cp)") ;;
    node) enter=(nsenter -t "$(holder_pid)" -m -n --) ;;
    esac
    # shellcheck disable=SC2016 # expanded by the child shell
    bash -c 'for c in '"${CGROUP_HIERARCHIES[*]}"'; do
            echo $$ >"/sys/fs/cgroup/$c/'"$CGROUP"'/cgroup.procs" || exit 125; done; exec "$@"' \
        _ "${enter[@]}" "$@" </dev/null >>"$RUN_DIR/log/$svc.log" 2>&1 &
    echo $! >"$RUN_DIR/$svc.pid"
    # Ours to stop by its pid, not this shell's job to report on.
    disown
    local deadline=$(($(now_ms) + 5000))
    until svc_pid "$svc" >/dev/null; do
        if [[ ! -e /proc/$! ]] || (($(now_ms) > deadline)); then
            tail -n 5 "$RUN_DIR/log/$svc.log" >&2
            die "$svc failed to start (log: $RUN_DIR/log/$svc.log)"
        fi
        sleep 0.01
    done
}

# svc_stop SVC [SECONDS]: SIGTERM, then SIGKILL after SECONDS (default 10).
svc_stop() {
    local pid deadline
    pid=$(svc_pid "$1") || { rm -f "$RUN_DIR/$1.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$(($(now_ms) + ${2:-10} * 1000))
    while svc_pid "$1" >/dev/null && (($(now_ms) < deadline)); do sleep 0.05; done
    if svc_pid "$1" >/dev/null; then
        echo "realnode: $1 (pid $pid) did not stop in ${2:-10} s: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        while svc_pid "$1" >/dev/null; do sleep 0.05; done
    fi
    rm -f "$RUN_DIR/$1.pid"
}
