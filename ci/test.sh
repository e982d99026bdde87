#!/usr/bin/env bash
# The project's test command: installs what it needs, then format, lint, unit and end-to-end
# tests (real binary, real netfilter, real unbound and dnsmasq, in network namespaces), on this
# machine's kernel and then on Debian's 6.1 LTS kernel in VMs (ci/vm/run).
# Run as root on a Linux machine. Nothing outside the namespaces the tests create is touched.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "ci/test.sh: run as root (the tests create network namespaces)"; exit 2; }

# Each stage's seconds, printed at the end whatever the outcome, so that a slow stage is seen.
stages=() started=$SECONDS
stage() { # stage NAME CMD...
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  stages+=("$(printf '%-14s %5d s%s' "$name" $((SECONDS - t0)) "$( ((rc == 0)) || echo "  (failed: exit $rc)")")")
  return "$rc"
}
timings() {
  local rc=$? line
  # A build still running in the background when the run ends early: its whole group stopped.
  local group
  for group in ${node_parts:-} ${image_build:-} ${fuzz_build:-}; do
    kill -- -"$group" 2>/dev/null || true
  done
  echo "ci/test.sh: stage timings (exit $rc):"
  for line in "${stages[@]}"; do echo "  $line"; done
  echo "  total          $((SECONDS - started)) s"
}
trap timings EXIT

stage deps ci/deps.sh
# The real-kernel test bed (qemu, Debian's 6.1 kernel, busybox initramfs under target/vm/):
# installs its packages and fetches the kernel on first use; fails here, loudly, if it cannot.
stage vm-prepare ci/vm/run --prepare
# The real Kubernetes parts (ci/k8s/: etcd, kube-apiserver, kube-proxy, kubectl, CoreDNS, helm
# from pinned Go modules, node-cache from its pinned source) into a cache outside the repository:
# about 18 min on a fresh machine, 0.1 s once built. Then the simulated node with the real parts,
# brought up and torn down (ci/k8s/smoke.sh).
stage k8s-build ci/k8s/build.sh etcd kube-apiserver kube-proxy kubectl coredns helm node-cache
stage k8s-smoke ci/k8s/smoke.sh
# The tests take the parts from there, never building them themselves (ci/k8s/build.sh holds
# its cache's lock while it builds).
NLHA_K8S_BIN=$(ci/k8s/build.sh --bin-dir)
export NLHA_K8S_BIN
# The real node's own parts (kubelet, kube-controller-manager, kube-scheduler, containerd, the CNI
# plugins: about 8 min on a fresh machine) are needed only by its suite, after the image: built
# meanwhile in the background, on the CPU the Rust stages leave idle (SCHED_IDLE), so they cost
# the run little of its time; waited for before that suite, their log shown if they failed.
mkdir -p target
setsid chrt --idle 0 ci/k8s/build.sh kubelet kube-controller-manager kube-scheduler containerd cni-plugins \
  >target/ci-node-parts.log 2>&1 &
node_parts=$!
node_parts_built() {
  wait "$node_parts" || { cat target/ci-node-parts.log >&2; return 1; }
}

stage fmt cargo fmt --all -- --check
stage fmt-fuzz cargo fmt --manifest-path fuzz/Cargo.toml -- --check
stage clippy cargo clippy --workspace --all-targets --locked -- -D warnings
# The kernel column and the real node are not among `--all-targets` (test = false in
# Cargo.toml): linted by name.
stage clippy-named cargo clippy --locked --test e2e_vm --test e2e_kubelet -- -D warnings
# Licences, duplicate versions, sources (deny.toml); `unsafe` only in the reviewed modules is
# checked by tests/unsafe_confined.rs and the compiler.
stage deny cargo deny --workspace --locked check bans licenses sources
# The agent and the load client (crates/dnsload) the end-to-end tests run.
stage build cargo build --locked --workspace --bins
# The image (rootful buildah, vfs, runc; the builder made from Debian's packages:
# ci/image/build.sh) and the fuzzers, built in the background while the host tests run, on the
# CPU those leave idle (SCHED_IDLE: more than half of it, their clients mostly wait on the
# network), as the real node's parts are. The image: about 9 min on a fresh machine (the agent
# and the webhook compiled in the builder), about 1.5 min once its caches are warm (the two
# crates themselves compiled again: a clean clone's sources are newer than the cache). Each
# waited for where it is needed, its log shown if it failed.
setsid chrt --idle 0 ci/image/build.sh >target/ci-image 2>target/ci-image.log &
image_build=$!
setsid chrt --idle 0 env FUZZ_PROFILE=dev ci/fuzz.sh --build >target/ci-fuzz-build.log 2>&1 &
fuzz_build=$!
built() { # built PID LOG: waits for a background build, its log shown if it failed
  wait "$1" || { cat "$2" >&2; return 1; }
}
# Unit and end-to-end tests of every crate of the workspace (no doc tests; benches run only in
# ci/bench.sh); every test binary runs even after one fails, so that a run shows every failure.
# How end-to-end tests share the machine: two at a time (cargo's default on 2 cores), each on a
# simulated node of its own. So no test judges a time window by a clock that a busy machine
# delays. What is judged: the agent's own counts (probes sent between a fault and the switch,
# checks until a repair), the clients' own attempt timeout, and what was seen on the way (when
# a query was sent, when a killed process was seen gone, the first CoreDNS answer). Deadlines
# are only how long to wait for a condition, far past what it takes; the other test's load
# makes a test slower, not red. (Not any load: on a machine several times oversubscribed, the
# clients' own 1 s attempt timeout expires. Run the suite on an otherwise idle machine, as CI
# does.) Timings are the benchmark's (ci/bench.sh), measured side by side.
stage host-tests cargo test --locked --no-fail-fast --workspace --lib --bins --tests -- \
  --skip a_hostile_pod_exhausts_neither_the_webhooks_memory_nor_its_answers
# The webhook's hostile clients (crates/webhook/tests/e2e_hostile.rs) keep both cores busy for a
# minute, reconnecting as fast as they are cut: alone, so that no other test shares the machine
# with them.
stage hostile-webhook cargo test --locked -p nodelocaldns-ha-webhook --test e2e_hostile
# The agent run from the image as the DaemonSet runs it: a cache SIGKILL in both shapes, and
# what the image holds.
stage image built "$image_build" target/ci-image.log
image=$(<target/ci-image)
export NLHA_AGENT_IMAGE=$image
stage image-tests cargo test --locked --test e2e_image -- --ignored
# The real node (tests/e2e_kubelet.rs, testdata/realnode.sh): a real kubelet and containerd run
# node-local-dns (upstream's manifest, the real node-cache), kube-proxy, CoreDNS and client pods;
# the agent installed from the chart with helm, from that image; every fault under load.
stage node-parts node_parts_built
stage real-node cargo test --locked --test e2e_kubelet
# The same agent on Debian 12's 6.1 LTS kernel (tests/e2e_vm.rs): each test boots its own VM
# (qemu TCG, 1 vCPU) and runs there; two at a time. IPVS, node-cache's dummy interface, netem.
stage vm-column cargo test --locked --test e2e_vm -- --test-threads 2
# Every parser of outside input, fuzzed briefly (ci/fuzz.sh 600 by hand for longer).
stage fuzz-build built "$fuzz_build" target/ci-fuzz-build.log
stage fuzz env FUZZ_PROFILE=dev ci/fuzz.sh 5
# A run changes nothing of the repository: every lockfile current, nothing generated left.
clean_tree() {
  local left
  left=$(git status --porcelain)
  [ -z "$left" ] || { echo "ci/test.sh: the run left the repository changed:" >&2; echo "$left" >&2; return 1; }
}
stage clean-tree clean_tree
