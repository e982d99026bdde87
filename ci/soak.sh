#!/usr/bin/env bash
# The soak (issue 6, item 7): the agent (release build) on a simulated node for 30 minutes at
# 2000 pod lookups/s while the cache is stopped every 2 minutes (SIGKILL and SIGTERM in turn) and
# started again. Prints and writes docs/soak.md and docs/soak.json: lookups sent and lost (none
# may be), first attempts lost, route transitions, per-restart switch and return times, the
# agent's RSS and file descriptors after warm-up (flat or not) and its CPU time. Exits non-zero
# when a lookup was lost, a restart did not complete, or RSS or descriptors grew.
#
# Run as root. Settings (see benches/soak.rs): SOAK_MINUTES (30), SOAK_RATE (2000),
# SOAK_RESTART_SECS (120), SOAK_DOWN_SECS (0), SOAK_SIGNALS (kill,term), SOAK_DATAPLANE
# (nftables), SOAK_SAMPLE_SECS (10), SOAK_OUT (docs). A short check:
#   SOAK_MINUTES=3 SOAK_RESTART_SECS=30 SOAK_OUT=/tmp/soak ci/soak.sh
# Everything happens in network namespaces named $prefix-*; they and every process in them are
# removed when it ends, also when this script is interrupted or terminated.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "ci/soak.sh: run as root (the soak creates network namespaces)"; exit 2; }
ci/deps.sh

prefix="s$(($$ % 100000))"
bench_pid=""
# shellcheck disable=SC2317 # invoked by the traps
cleanup() {
    trap - EXIT INT TERM HUP
    if [[ -n "$bench_pid" ]] && kill -0 "$bench_pid" 2>/dev/null; then
        # cargo and the benchmark run in their own process group (setsid below): stop it all.
        kill -TERM -- "-$bench_pid" 2>/dev/null || true
        wait "$bench_pid" 2>/dev/null || true
    fi
    local ns pids
    for ns in "$prefix-node" "$prefix-pod1" "$prefix-pod2" "$prefix-dns"; do
        # What still runs in the namespaces (the agent, dnsload, unbound, dnsmasq), by name.
        mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)
        if ((${#pids[@]})); then kill -KILL "${pids[@]}" 2>/dev/null || true; fi
    done
    # The benchmark removes its namespaces itself; this is for when it is killed.
    SIMNODE_DIR="${TMPDIR:-/tmp}/nlha-bench" testdata/simnode.sh down "$prefix" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

started=$(date +%s)
# The agent and the load client (crates/dnsload) the benchmark runs, next to it in target/release.
cargo build --release --locked --workspace --bins
# In the background, so that a signal reaches the trap at once rather than after the run; in a
# process group of its own (setsid does not fork here: a background job is no group leader), so
# that the cleanup can stop cargo, the benchmark and what it started, and nothing else.
SOAK_PREFIX=$prefix setsid cargo bench --locked --bench soak &
bench_pid=$!
# setsid() runs in the child a moment after the fork: wait for it (at most 2 s).
for _ in $(seq 200); do
  [[ "$(ps -o pgid= -p "$bench_pid" | tr -d ' ')" == "$bench_pid" ]] && break
  sleep 0.01
done
[[ "$(ps -o pgid= -p "$bench_pid" | tr -d ' ')" == "$bench_pid" ]] || {
    echo "ci/soak.sh: the benchmark is not in its own process group"; exit 1; }
rc=0
wait "$bench_pid" || rc=$?
bench_pid=""
echo "ci/soak.sh: done in $(($(date +%s) - started)) s (build included), exit $rc"
exit "$rc"
