#!/usr/bin/env bash
# Fuzzes every parser that reads outside input (src/fuzzing.rs names them), each target for
# SECONDS (default 10, as in CI; run longer by hand, e.g. `ci/fuzz.sh 600`), starting from the
# seeds in fuzz/seeds/<target> (real kernel dumps, iptables-save output, DNS replies, requests).
# New inputs go to a corpus outside the tree; a crash stops the run with the input saved under
# fuzz/artifacts/<target>/ and a non-zero exit. Stable Rust: no sanitizer (`-s none`), so
# libFuzzer finds panics, aborts and hangs, which is what these parsers must never do.
#   FUZZ_TARGETS="dns_reply sock_diag" ci/fuzz.sh 60    # some targets only
#   FUZZ_PROFILE=dev ci/fuzz.sh 10     # unoptimised: builds in half the time (CI), runs slower
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
cargo fuzz --version 2>/dev/null | grep -qx "cargo-fuzz 0.13.2" || cargo install --debug --locked cargo-fuzz@0.13.2
targets=${FUZZ_TARGETS:-$(cargo fuzz list)}
corpus=${FUZZ_CORPUS:-${TMPDIR:-/tmp}/nodelocaldns-ha-fuzz}

profile=--${FUZZ_PROFILE:-release}
cargo fuzz build -s none "$profile"
for target in $targets; do
  mkdir -p "$corpus/$target"
  echo "ci/fuzz.sh: $target for ${seconds}s"
  # -timeout: one input taking over 5 s is a hang. -rss_limit_mb: growth without bound fails.
  log="$corpus/$target.log"
  status=0
  cargo fuzz run -s none "$profile" "$target" "$corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds" -timeout=5 -rss_limit_mb=1024 -print_final_stats=1 >"$log" 2>&1 ||
    status=$?
  grep -E '^(Done|stat::number_of_executed_units|INFO: seed corpus)' "$log" || true
  if [ "$status" != 0 ]; then
    tail -n 40 "$log"
    echo "ci/fuzz.sh: $target failed (exit $status); the input is under fuzz/artifacts/$target/"
    exit 1
  fi
done
