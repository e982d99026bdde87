#!/usr/bin/env bash
# Builds the real Kubernetes parts from Go modules at the versions pinned in ci/k8s/versions.env
# (the wrapper modules ci/k8s/{kubernetes,etcd,coredns}, their go.sum committed: -mod=readonly),
# into a cache outside the repository that survives between runs:
#   ${NLHA_K8S_CACHE:-/var/cache/nodelocaldns-ha/k8s}/<key>/bin/
# <key> is a hash of everything a binary depends on (versions.env, the wrappers' go.mod, go.sum
# and Go files, the Go version, the build flags), so a part already built for these pins is
# skipped, and a changed pin builds into a new directory. Needs nothing but Go (>= GO_MIN) and
# the Go module proxy; Go's own module and build caches (GOMODCACHE, GOCACHE) make a rebuild
# after a pin change cheaper.
#
# Usage: ci/k8s/build.sh [--bin-dir] [PART...]
#   PART: kube-apiserver kube-proxy kubectl etcd coredns helm node-cache (default: all of them)
#   --bin-dir  print the binary directory for these pins and exit (builds nothing)
# Each part is built, then run (its --version must name the pinned version) before it is put in
# bin/. A part that cannot be built fails loudly, naming the part and the error; the other parts
# are still built, and the script exits 1. node-cache is blocked: the module proxy refuses its
# module (versions.env), so asking for it fails, by design, until that changes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ci/k8s/versions.env
. "$here/versions.env"

me=ci/k8s/build.sh
die() { echo "$me: $*" >&2; exit 1; }

all_parts=(kube-apiserver kube-proxy kubectl etcd coredns helm node-cache)
bin_dir_only=0
parts=()
for a in "$@"; do
  case $a in
    --bin-dir) bin_dir_only=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    kube-apiserver|kube-proxy|kubectl|etcd|coredns|helm|node-cache) parts+=("$a") ;;
    *) die "unknown part or option '$a' (parts: ${all_parts[*]})" ;;
  esac
done
[ ${#parts[@]} -gt 0 ] || parts=("${all_parts[@]}")

command -v go >/dev/null || die "go not found: Go >= $GO_MIN is needed to build the real Kubernetes parts"
# Never let the go command fetch another toolchain: build with this one or fail here.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
gover=$(go env GOVERSION)
[ "$(printf '%s\n' "go$GO_MIN" "$gover" | sort -V | head -1)" = "go$GO_MIN" ] ||
  die "$gover is older than go$GO_MIN, which the wrappers need"

# The pins in versions.env and in the wrappers' go.mod must agree.
gomod_require() { awk -v m="$2" '($1 == m || ($1 == "require" && $2 == m)) && $0 !~ /=>/ {
  print ($1 == "require" ? $3 : $2) }' "$here/$1/go.mod"; }
check_pin() { # wrapper module want
  local got; got=$(gomod_require "$1" "$2")
  [ "$got" = "$3" ] || die "ci/k8s/$1/go.mod requires $2 ${got:-(nothing)}, versions.env pins $3"
}
check_pin kubernetes k8s.io/kubernetes "$K8S_VERSION"
check_pin etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
check_pin coredns github.com/coredns/coredns "$COREDNS_VERSION"
check_pin helm helm.sh/helm/v4 "$HELM_VERSION"
# Every staging replace at the staging version (and there are some: ~30).
bad=$(awk -v v="$K8S_STAGING_VERSION" '$2 == "=>" && $1 ~ /^k8s\.io\// && $4 != v' "$here/kubernetes/go.mod")
[ -z "$bad" ] || die "ci/k8s/kubernetes/go.mod replaces staging modules at another version than $K8S_STAGING_VERSION: $bad"
[ "$(awk '$2 == "=>" && $1 ~ /^k8s\.io\//' "$here/kubernetes/go.mod" | wc -l)" -ge 25 ] ||
  die "ci/k8s/kubernetes/go.mod: the staging replaces are missing"

# What upstream sets (k8s: hack/lib/version.sh and hack/lib/golang.sh, non-debug build; CoreDNS:
# its Makefile; etcd: its ./build, which only adds the git SHA we do not have).
k8s_minor=${K8S_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
k8s_x=""
for key_val in "gitVersion=$K8S_VERSION" gitMajor=1 "gitMinor=$k8s_minor" gitCommit= \
    gitTreeState=archive "buildDate=$K8S_BUILD_DATE"; do
  k8s_x+=" -X 'k8s.io/client-go/pkg/version.$key_val' -X 'k8s.io/component-base/version.$key_val'"
done
k8s_tags=selinux,notest,grpcnotrace
k8s_ldflags="all=$k8s_x -s -w"
coredns_tags=grpcnotrace
coredns_ldflags="-s -w"
# The plugins the test bed's Corefiles use (all in CoreDNS's default plugin.cfg): checked.
coredns_plugins="kubernetes forward cache bind health ready prometheus errors log loop reload"
etcd_tags=""
etcd_ldflags=""
# helm: its Makefile's version variable (the rest of its BuildInfo needs the git tree).
helm_tags=""
helm_ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"

# The cache key: every input of every binary.
key=$( {
  cat "$here/versions.env"
  for w in kubernetes etcd coredns helm; do
    for f in "$here/$w"/go.mod "$here/$w"/go.sum "$here/$w"/*.go; do
      [ -e "$f" ] && { echo "== $w/${f##*/}"; cat "$f"; }
    done
  done
  echo "$gover $(go env GOOS GOARCH) CGO_ENABLED=$CGO_ENABLED GOFLAGS=$GOFLAGS -trimpath"
  echo "$k8s_tags $k8s_ldflags | $coredns_tags $coredns_ldflags | $etcd_tags $etcd_ldflags"
  echo "$helm_tags $helm_ldflags"
} | sha256sum | cut -c1-16)
cache_root=${NLHA_K8S_CACHE:-/var/cache/nodelocaldns-ha/k8s}
dir=$cache_root/$key
bin=$dir/bin
if [ $bin_dir_only = 1 ]; then echo "$bin"; exit 0; fi

mkdir -p "$bin" "$dir/log"
# One build per cache key at a time (another run waits, then finds the parts built).
exec 9>"$dir/.lock"
flock 9
# Pins, for a reader of the cache.
cp "$here/versions.env" "$dir/versions.env"

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
failed=()

# build PART WRAPPER PACKAGE TAGS LDFLAGS VERSION-COMMAND EXPECTED
build() {
  local part=$1 wrapper=$2 pkg=$3 tags=$4 ldflags=$5 vercmd=$6 want=$7
  if [ -x "$bin/$part" ]; then
    echo "$me: $part: already built for these pins ($bin/$part)"
    return 0
  fi
  local t0 log=$dir/log/$part.log tmp=$bin/.$part.tmp
  t0=$(now)
  echo "$me: $part: building $pkg (ci/k8s/$wrapper) ..."
  rm -f "$tmp"
  if ! (cd "$here/$wrapper" && go build -trimpath ${tags:+-tags="$tags"} -ldflags="$ldflags" \
        -o "$tmp" "$pkg") >"$log" 2>&1; then
    echo "$me: $part: BUILD FAILED ($pkg from ci/k8s/$wrapper, after $(secs "$t0" "$(now)") s):" >&2
    sed 's/^/    /' "$log" >&2
    rm -f "$tmp"
    failed+=("$part")
    return 0
  fi
  local out
  if ! out=$("$tmp" $vercmd 2>&1) || ! grep -qF -- "$want" <<<"$out"; then
    echo "$me: $part: built, but \`$part $vercmd\` does not say '$want':" >&2
    sed 's/^/    /' <<<"$out" >&2
    rm -f "$tmp"
    failed+=("$part")
    return 0
  fi
  if [ "$part" = coredns ]; then
    local p plugins missing=()
    plugins=$("$tmp" -plugins 2>&1)
    for p in $coredns_plugins; do grep -qx "$p" <<<"$plugins" || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
      echo "$me: coredns: built, but without the plugins ${missing[*]} (coredns -plugins)" >&2
      rm -f "$tmp"
      failed+=("$part")
      return 0
    fi
  fi
  mv -f "$tmp" "$bin/$part"
  echo "$me: $part: built in $(secs "$t0" "$(now)") s: $(head -1 <<<"$out")"
}

node_cache() {
  local t0 out
  t0=$(now)
  # One request to the proxy for the pinned module; it answers 403 today (versions.env).
  if out=$(cd "$dir" && GOFLAGS= go mod download -json \
      "$NODE_CACHE_MODULE@$NODE_CACHE_VERSION" 2>&1) && ! grep -q '"Error"' <<<"$out"; then
    echo "$me: node-cache: the module proxy now serves $NODE_CACHE_MODULE@$NODE_CACHE_VERSION," \
      "but there is no wrapper for it yet (ci/k8s/node-cache): write one like ci/k8s/coredns" >&2
  else
    echo "$me: node-cache: CANNOT BE BUILT: the module proxy refuses $NODE_CACHE_MODULE@$NODE_CACHE_VERSION" \
      "(after $(secs "$t0" "$(now)") s):" >&2
    sed 's/^/    /' <<<"$out" >&2
  fi
  failed+=(node-cache)
}

for part in "${parts[@]}"; do
  case $part in
    kube-apiserver|kube-proxy|kubectl)
      vercmd=--version want="Kubernetes $K8S_VERSION"
      [ "$part" = kubectl ] && vercmd="version --client" want="Client Version: $K8S_VERSION"
      build "$part" kubernetes "k8s.io/kubernetes/cmd/$part" "$k8s_tags" "$k8s_ldflags" \
        "$vercmd" "$want" ;;
    etcd)
      build etcd etcd . "$etcd_tags" "$etcd_ldflags" --version "etcd Version: ${ETCD_VERSION#v}" ;;
    coredns)
      build coredns coredns github.com/coredns/coredns "$coredns_tags" "$coredns_ldflags" \
        -version "CoreDNS-${COREDNS_VERSION#v}" ;;
    helm)
      build helm helm helm.sh/helm/v4/cmd/helm "$helm_tags" "$helm_ldflags" version \
        "Version:\"$HELM_VERSION\"" ;;
    node-cache) node_cache ;;
  esac
done

echo "$me: binaries in $bin ($(du -sh "$dir" | cut -f1) in all):"
(cd "$bin" && ls -l -- * 2>/dev/null | awk '{ printf "    %-16s %s\n", $NF, $5 }') || true
if [ ${#failed[@]} -gt 0 ]; then
  echo "$me: FAILED: ${failed[*]} (see above)" >&2
  exit 1
fi
