#!/usr/bin/env bash
# The benchmark (issue 5): failover under load with node-cache's static rules, with the agent,
# with probe-driven switching only and with two nameservers in the pod's resolv.conf (glibc and
# musl clients); the same in the link-local shape (issue 12: pods ask 169.254.20.10 itself)
# with node-cache alone, kubespray's second DaemonSet (two caches sharing the IP with
# SO_REUSEPORT, one killed or hung) and the agent; then the agent's drift repair, switch
# latency (with 0 and 50,000 kube-proxy-shaped nat rules, beside the least nftables commit),
# dnsperf through node-cache's rules and the agent's, dnsperf through the link-local fallback
# (the forwarder) against real CoreDNS's forward plugin as node-cache runs it and straight to
# CoreDNS, the agent's footprint, and a busy iptables-nft node (0 and 50,000 nat rules,
# kube-proxy syncing every second; and real kube-proxy with 5,000 Services under EndpointSlice
# churn): the agent's CPU and a host-network client across a cache SIGKILL. On a second node
# with the real parts: the agent beside kube-dns with PreferSameNode. Writes docs/bench.md (the tables), docs/bench.json and docs/failover.svg. Run as
# root; about 17 minutes on a 2-core machine (1031 s on 2026-11-27), plus the build. Everything
# happens in network namespaces named $prefix-*, removed when it ends, also on failure.
#
# One part alone (as root, after the build below): NLHA_BENCH_PARTS=link-local,fallback-dnsperf
# cargo bench --bench failover (see benches/failover.rs for the parts and settings).
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "ci/bench.sh: run as root (the benchmark creates network namespaces)"; exit 2; }
ci/deps.sh
# What the benchmark needs beyond ci/deps.sh's list: dnsperf.
bench_packages=(dnsperf)
missing=()
for p in "${bench_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "ci/bench.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

prefix="b$(($$ % 100000))"
cleanup() {
    # The benchmark removes its namespaces itself; this is for when it is killed.
    SIMNODE_DIR="${TMPDIR:-/tmp}/nlha-bench" testdata/simnode.sh down "$prefix" >/dev/null 2>&1 || true
    # The busy node of issue 17; the footprint's nftables, iptables-legacy, mixed and real-parts
    # (r) nodes.
    # w: the webhook benchmark's node (its real control plane); p: the real parts' failover node
    # (the agent and PreferSameNode); q: the busy node with real kube-proxy.
    for node in k n l m p q r w; do
        SIMNODE_DIR="${TMPDIR:-/tmp}/nlha-bench" testdata/simnode.sh down "${prefix}$node" >/dev/null 2>&1 || true
    done
    rm -rf "/etc/netns/$prefix-pod1" "/etc/netns/$prefix-pod2"
    # The real node (k: the kubelet's node, the real-node part).
    REALNODE_DIR="${TMPDIR:-/tmp}/nlha-realnode" testdata/realnode.sh down "${prefix}k" >/dev/null 2>&1 || true
}
trap cleanup EXIT

started=$(date +%s)
# The agent and the load client (crates/dnsload) the benchmark runs, next to it in target/release.
cargo build --release --locked --workspace --bins
# The agent measured is the one that ships: built on its own, as the Dockerfile builds it,
# without the features cargo unifies over the workspace (the webhook's HTTP/2 server in hyper:
# about 1 MiB more resident with the API client on).
cargo build --release --locked -p nodelocaldns-ha --bin nodelocaldns-ha
mkdir -p target/release/shipped
cp target/release/nodelocaldns-ha target/release/shipped/nodelocaldns-ha
musl-gcc -static -O2 -pthread -Wall -o target/release/resolver-load testdata/resolver-load.c
# The real node's parts and the agent's image (the real-node part: the kubelet runs it).
ci/k8s/build.sh
image=$(ci/image/build.sh)
NLHA_BENCH_PREFIX=$prefix NLHA_BENCH_MUSL_CLIENT="$PWD/target/release/resolver-load" \
    NLHA_AGENT_EXE="$PWD/target/release/shipped/nodelocaldns-ha" NLHA_AGENT_IMAGE=$image \
    cargo bench --locked --bench failover
# What the admission webhook costs a pod creation, on the real API server (docs/webhook-bench.md).
NLHA_BENCH_PREFIX=$prefix cargo bench --locked -p nodelocaldns-ha-webhook --bench admission
echo "ci/bench.sh: done in $(($(date +%s) - started)) s (build included)"
