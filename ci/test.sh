#!/usr/bin/env bash
# The project's test command: installs what it needs, then format, lint, unit and end-to-end
# tests (real binary, real netfilter, real unbound and dnsmasq, in network namespaces), on this
# machine's kernel and then on Debian's 6.1 LTS kernel in VMs (ci/vm/run).
# Run as root on a Linux machine. Nothing outside the namespaces the tests create is touched.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "ci/test.sh: run as root (the tests create network namespaces)"; exit 2; }
ci/deps.sh
# The real-kernel test bed (qemu, Debian's 6.1 kernel, busybox initramfs under target/vm/):
# installs its packages and fetches the kernel on first use; fails here, loudly, if it cannot.
ci/vm/run --prepare

cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
cargo clippy --all-targets --locked -- -D warnings
# Licences, duplicate versions, sources (deny.toml); `unsafe` only in one module is checked by
# tests/unsafe_confined.rs and the compiler.
cargo deny --locked check bans licenses sources
cargo build --locked --bins
# Unit and end-to-end tests (the crate has no doc tests; benches run only in ci/bench.sh).
cargo test --locked --lib --bins --tests
# The same agent on Debian 12's 6.1 LTS kernel (tests/e2e_vm.rs): each test boots its own VM
# (qemu TCG, 1 vCPU) and runs there; two at a time. IPVS, node-cache's dummy interface, netem.
cargo test --locked --test e2e_vm -- --test-threads 2
# Every parser of outside input, fuzzed briefly (ci/fuzz.sh 600 by hand for longer).
FUZZ_PROFILE=dev ci/fuzz.sh 10
