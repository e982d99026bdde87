#!/usr/bin/env bash
# The main job, live: a simulated node (network namespaces), pods querying the kube-dns
# ClusterIP at 200 lookups/s, and the agent failing over while the cache is killed, restarted,
# hung and resumed. Prints a timeline (time, route, who answered, failures) and a summary.
# Run as root. Everything happens in namespaces this script creates and removes.
#   ci/demo.sh          the light stand-in node (hand-written DNAT, dnsmasq, unbound): seconds
#   ci/demo.sh --real   the real Kubernetes parts (kube-apiserver and etcd, real kube-proxy in
#                       iptables mode, real CoreDNS, the real node-cache; built by
#                       ci/k8s/build.sh: 25 min the first time, then cached)
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "ci/demo.sh: run as root (it creates network namespaces)"; exit 2; }
up_args=() node_desc="CoreDNS (dnsmasq) behind kube-proxy DNAT, node-local-dns (unbound)"
case "${1:-}" in
"") ;;
--real)
  up_args=(--kube-proxy real-iptables)
  node_desc="real kube-apiserver, kube-proxy (iptables mode) and CoreDNS; the cache the real node-cache"
  ;;
*) echo "usage: ci/demo.sh [--real]" >&2; exit 2 ;;
esac
ci/deps.sh --demo >/dev/null
echo "== building"
cargo build --quiet --locked --workspace --bins

prefix="d$(printf '%04x' $((RANDOM % 65536)))"
export SIMNODE_DIR="${TMPDIR:-/tmp}/nlha-demo"
run_dir="$SIMNODE_DIR/$prefix"
sim() { testdata/simnode.sh "$1" "$prefix" "${@:2}"; }
agent_pid="" load_pid=""
cleanup() {
  [ -n "$load_pid" ] && kill "$load_pid" 2>/dev/null && wait "$load_pid" 2>/dev/null
  [ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null
  sim down >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "== simulated node $prefix: pods, node, $node_desc"
if [ ${#up_args[@]} -gt 0 ]; then ci/k8s/build.sh etcd kube-apiserver kube-proxy kubectl coredns node-cache; fi
sim up "${up_args[@]}" >/dev/null
sim coredns-start >/dev/null
sim cache-start >/dev/null

state_dir="$run_dir/agent"
echo "== agent: probes every 100 ms (timeout 80 ms), fall 3, rise 5, min-hold 2 s; log in $run_dir/agent.log"
ip netns exec "$prefix-node" target/debug/nodelocaldns-ha run \
  --local-ip 169.254.20.10 --cluster-dns-ip 10.96.0.10 --upstream-ip 10.96.0.11 \
  --probe-name who.test --state-dir "$state_dir" 2>"$run_dir/agent.log" &
agent_pid=$!

route() { sed -n 's/.*"route": "\([a-z]*\)".*/\1/p' "$state_dir/state.json" 2>/dev/null; }
wait_route() { # wait_route ROUTE SECONDS: a condition with a deadline
  local deadline=$((SECONDS + $2))
  until [ "$(route)" = "$1" ]; do
    [ $SECONDS -lt $deadline ] || { echo "route never became $1"; exit 1; }
    sleep 0.02
  done
}
wait_route local 10

echo "== load: pod1 -> 10.96.0.10:53 'who.test', 200/s, glibc-like (1 s timeout, 2 attempts)"
echo "   cache answers 1.1.1.1, CoreDNS answers 2.2.2.2; counts per 500 ms"
ip netns exec "$prefix-pod1" target/debug/dnsload --server 10.96.0.10 --name who.test \
  --rate 200 --duration 22s --report-interval 500ms --timeout 1s --attempts 2 \
  --origin 1.1.1.1=cache --origin 2.2.2.2=coredns --route-file "$state_dir/state.json" \
  >"$run_dir/load.out" &
load_pid=$!
tail -n +1 -f "$run_dir/load.out" --pid "$load_pid" | grep --line-buffered -v '^SUMMARY' &

event() { echo "---------- $* ----------"; }
# The pauses below only pace the show; every check waits on a condition.
sleep 3;  event "SIGKILL the cache";      sim cache-kill >/dev/null; wait_route upstream 5
sleep 4;  event "restart the cache";      sim cache-start >/dev/null; wait_route local 10
sleep 2;  event "SIGSTOP the cache (hang)"; sim cache-stop >/dev/null; wait_route upstream 5
sleep 3;  event "SIGCONT the cache";      sim cache-cont >/dev/null; wait_route local 10

wait "$load_pid" || true
load_pid=""
sleep 0.2
echo
echo "== route changes (agent log)"
grep -o 'route changed.*' "$run_dir/agent.log" | sed 's/^/   /'
echo
echo "== summary"
target/debug/nodelocaldns-ha status --state-dir "$state_dir" | sed 's/^/   /'
python3 - "$run_dir/load.out" <<'EOF'
import json, sys
line = next(l for l in open(sys.argv[1]) if l.startswith("SUMMARY "))
s = json.loads(line[len("SUMMARY "):])
o = s["by_origin"]
print(f"   lookups: {s['sent']} sent, {s['failed']} failed, "
      f"{s['first_attempt_lost']} needed a retry")
print(f"   answered by: cache {o.get('cache', 0)}, CoreDNS {o.get('coredns', 0)}")
lat = s["latency_ms"]
print(f"   latency: p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, max {lat['max']:.1f} ms")
EOF
