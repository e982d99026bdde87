#!/usr/bin/env bash
# The project's test command: installs what it needs, then format, lint, unit and end-to-end
# tests (real binary, real netfilter, real unbound and dnsmasq, in network namespaces).
# Run as root on a Linux machine. Nothing outside the namespaces the tests create is touched.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "ci/test.sh: run as root (the tests create network namespaces)"; exit 2; }
ci/deps.sh

cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
cargo clippy --all-targets --locked -- -D warnings
# Licences, duplicate versions, sources (deny.toml); `unsafe` only in one module is checked by
# tests/unsafe_confined.rs and the compiler.
cargo deny --locked check bans licenses sources
cargo build --locked --bins
# Unit and end-to-end tests (the crate has no doc tests; benches run only in ci/bench.sh).
cargo test --locked --lib --bins --tests
# Every parser of outside input, fuzzed briefly (ci/fuzz.sh 600 by hand for longer).
FUZZ_PROFILE=dev ci/fuzz.sh 10
