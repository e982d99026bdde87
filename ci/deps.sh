#!/usr/bin/env bash
# Installs what the build, the tests and the demo need on a fresh Debian machine (as root).
# Idempotent: a machine that has everything is left alone.
#   ci/deps.sh          everything ci/test.sh needs
#   ci/deps.sh --demo   only what ci/demo.sh needs (its packages; no test tools)
set -euo pipefail

demo=(
  nftables iptables iproute2 conntrack   # netfilter and namespaces
  unbound dnsmasq-base dnsutils          # the cache, "CoreDNS", dig
  libnftnl-dev libmnl-dev pkg-config     # build nftnl
  util-linux                             # flock (ci/k8s, for ci/demo.sh --real)
  openssl                                # the real control plane's throwaway CA (ci/k8s)
)
tests=(
  libcap2-bin                            # capsh, setpriv (privilege tests)
  prometheus                             # promtool and a real server (tests/alerts.rs)
  python3-minimal                        # /usr/bin/python3: simnode's endpoint churn (real parts)
  musl-tools                             # musl-gcc: the musl resolver client (webhook tests, bench)
  busybox-static curl                    # the real node: its client image, the kubelet's health (testdata/realnode)
  buildah podman runc mmdebstrap         # the image, built and run (ci/image/, tests/e2e_image.rs)
)
case "${1:-}" in
--demo) packages=("${demo[@]}") ;;
"") packages=("${demo[@]}" "${tests[@]}") ;;
*) echo "usage: ci/deps.sh [--demo]" >&2; exit 2 ;;
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "ci/deps.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # unbound's and prometheus's packages start a service where an init system runs; none does here, and
  # policy-rc.d keeps it that way on machines that have one.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  rm -f /usr/sbin/policy-rc.d
fi

command -v cargo >/dev/null || { echo "ci/deps.sh: cargo not found (the Rust toolchain is needed)"; exit 1; }
[ "${1:-}" != --demo ] || exit 0
# The real Kubernetes parts (ci/k8s/build.sh) need Go 1.26 or newer and the Go module proxy.
go_version=$(go env GOVERSION 2>/dev/null || true)
case "$go_version" in
  go1.2[6-9]* | go1.[3-9][0-9]* | go[2-9]*) ;;
  *) echo "ci/deps.sh: Go 1.26 or newer is needed for ci/k8s (found: ${go_version:-none})"; exit 1 ;;
esac
for component in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$component" || rustup component add "$component"
done
# Supply-chain checks (cargo deny) and the fuzz targets (cargo fuzz): pinned, built once,
# unoptimised (a quarter of the build time; each runs for seconds at most).
cargo deny --version 2>/dev/null | grep -qx 'cargo-deny 0.20.2' ||
  cargo install --debug --locked cargo-deny@0.20.2
cargo fuzz --version 2>/dev/null | grep -qx 'cargo-fuzz 0.13.2' ||
  cargo install --debug --locked cargo-fuzz@0.13.2
