#!/usr/bin/env bash
# Smoke test of the real parts built by ci/k8s/build.sh, before the long test suite, through
# the one place that starts them (testdata/simnode/real.sh): the simulated node with real parts
# comes up (etcd and kube-apiserver in a control-plane namespace of their own, TLS from a
# throwaway CA, the admission plugins a real cluster has; real kube-proxy, its rules for
# kube-dns and kube-dns-upstream in; real CoreDNS answering through kube-proxy's DNAT and from
# the API), then this checks what the tests of the webhook and the reports count on: /readyz,
# the `kubernetes` Service at 10.96.0.1, kube-dns at 10.96.0.10, MutatingAdmissionWebhook
# loaded. Tears the node down (`down`: every part by its pid, the namespaces by name) and checks
# that none of its namespaces is left. Run as root.
# Usage: ci/k8s/smoke.sh   (builds the parts it needs first, if they are not in the cache)
set -euo pipefail
cd "$(dirname "$0")/../.."
me=ci/k8s/smoke.sh
[ "$(id -u)" = 0 ] || { echo "$me: run as root (it creates network namespaces)" >&2; exit 2; }

prefix="k$(printf '%05x' $((RANDOM * 32 + RANDOM % 32)))" # unique per run
export SIMNODE_DIR="${TMPDIR:-/tmp}/nlha-smoke"
run_dir="$SIMNODE_DIR/$prefix"
t_start=$(date +%s)
log() { echo "$me: [$(($(date +%s) - t_start)) s] $*"; }
fail() {
  echo "$me: FAILED: $*" >&2
  for f in etcd kube-apiserver kube-proxy coredns; do
    [ -s "$run_dir/$f.log" ] && { echo "--- last lines of $f's log:" >&2; tail -n 25 "$run_dir/$f.log" >&2; }
  done
  exit 1
}
sim() { testdata/simnode.sh "$1" "$prefix" "${@:2}"; }

teardown() {
  local rc=$?
  set +e
  sim down >/dev/null 2>&1
  local left
  left=$(ip netns list | grep -o "^$prefix-[a-z0-9]*" | tr '\n' ' ')
  if [ -n "$left" ]; then
    echo "$me: teardown left behind namespaces: $left" >&2
    rc=1
  fi
  [ "$rc" = 0 ] && rm -rf "$run_dir"
  log "torn down"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

sim up --kube-proxy real-iptables >/dev/null || fail "simnode.sh up --kube-proxy real-iptables"
log "control plane, kube-proxy (iptables mode) up in $prefix-cp and $prefix-node"
sim coredns-start >/dev/null || fail "simnode.sh coredns-start"
log "CoreDNS answers through kube-proxy and from the API"

bin=$(ci/k8s/build.sh --bin-dir)
kc() { ip netns exec "$prefix-node" "$bin/kubectl" --kubeconfig "$run_dir/admin.kubeconfig" --request-timeout=10s "$@"; }
[ "$(kc get --raw /readyz)" = ok ] || fail "/readyz is not ok"
svc_ip() { [ "$(kc get service "$1" -n "$2" -o 'jsonpath={.spec.clusterIP}')" = "$3" ]; }
svc_ip kubernetes default 10.96.0.1 || fail "Service default/kubernetes is not at 10.96.0.1"
svc_ip kube-dns kube-system 10.96.0.10 || fail "Service kube-system/kube-dns is not at 10.96.0.10"
log "Services default/kubernetes at 10.96.0.1, kube-system/kube-dns at 10.96.0.10"
grep -q 'mutating admission controller(s) successfully in the following order: .*MutatingAdmissionWebhook' \
  "$run_dir/kube-apiserver.log" || fail "kube-apiserver did not log MutatingAdmissionWebhook among its admission plugins"
log "MutatingAdmissionWebhook loaded; $(kc version 2>/dev/null | tr '\n' ' ')"
log "OK (tearing down)"
