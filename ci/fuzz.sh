#!/usr/bin/env bash
# Fuzzes every parser that reads outside input (src/fuzzing.rs names them), each target for
# SECONDS (default 10; CI runs 5; run longer by hand, e.g. `ci/fuzz.sh 600`), starting from the
# seeds in fuzz/seeds/<target> (real kernel dumps, iptables-save output, DNS replies, requests).
# New inputs go to a corpus outside the tree; a crash stops the run with the input saved under
# fuzz/artifacts/<target>/ and a non-zero exit. Stable Rust: no sanitizer (`-s none`), so
# libFuzzer finds panics, aborts and hangs, which is what these parsers must never do.
#   FUZZ_TARGETS="dns_reply sock_diag" ci/fuzz.sh 60    # some targets only
#   FUZZ_PROFILE=dev ci/fuzz.sh 5      # unoptimised: builds in half the time (CI), runs slower
#   FUZZ_PROFILE=dev ci/fuzz.sh --build  # builds the targets only (ci/test.sh, ahead of the run)
set -euo pipefail
cd "$(dirname "$0")/.."

build_only=false
if [ "${1:-}" = --build ]; then build_only=true; shift; fi
seconds=${1:-10}
cargo fuzz --version 2>/dev/null | grep -qx "cargo-fuzz 0.13.2" || cargo install --debug --locked cargo-fuzz@0.13.2
targets=${FUZZ_TARGETS:-$(cargo fuzz list)}
corpus=${FUZZ_CORPUS:-${TMPDIR:-/tmp}/nodelocaldns-ha-fuzz}

profile=--${FUZZ_PROFILE:-release}
# cargo fuzz has no --locked: the fuzz workspace's lockfile is checked current first, so that its
# build resolves nothing anew (a stale one fails here, naming the fix).
cargo metadata --locked --offline --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null 2>&1 ||
  cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null || {
  echo "ci/fuzz.sh: fuzz/Cargo.lock is not current: run \`cargo metadata --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null\` and commit it" >&2
  exit 1
}
cargo fuzz build -s none "$profile"
! $build_only || exit 0
# fuzz TARGET: runs one target (libFuzzer uses one core); its report goes to $corpus/TARGET.report,
# printed once every target is done, so that reports of targets run together do not interleave.
fuzz() {
  local target=$1 log="$corpus/$1.log" report="$corpus/$1.report" status=0
  mkdir -p "$corpus/$target"
  # -timeout: one input taking over 5 s is a hang. -rss_limit_mb: growth without bound fails.
  cargo fuzz run -s none "$profile" "$target" "$corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds" -timeout=5 -rss_limit_mb=1024 -print_final_stats=1 >"$log" 2>&1 ||
    status=$?
  {
    echo "ci/fuzz.sh: $target for ${seconds}s"
    grep -E '^(Done|stat::number_of_executed_units|INFO: seed corpus)' "$log" || true
    if [ "$status" != 0 ]; then
      tail -n 40 "$log"
      echo "ci/fuzz.sh: $target failed (exit $status); the input is under fuzz/artifacts/$target/"
    fi
  } >"$report"
  return "$status"
}
# As many targets at once as there are cores; any failure fails the run once all are done.
jobs=$(nproc)
failed=0
running=0
for target in $targets; do
  if ((running >= jobs)); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz "$target" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || failed=1
  running=$((running - 1))
done
for target in $targets; do cat "$corpus/$target.report"; done
exit "$failed"
