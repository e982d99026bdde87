#!/usr/bin/env bash
# Builds the real Kubernetes parts from Go modules at the versions pinned in ci/k8s/versions.env
# (the wrapper modules ci/k8s/{kubernetes,etcd,coredns,helm,containerd,cni}, their go.sum
# committed: -mod=readonly), and node-cache from its source archive (below), into a cache outside
# the repository that survives between runs:
#   ${NLHA_K8S_CACHE:-/var/cache/nodelocaldns-ha/k8s}/<key>/bin/
# <key> is a hash of everything a binary depends on (versions.env, the wrappers' go.mod, go.sum
# and Go files, the Go version, the build flags), so a part already built for these pins is
# skipped, and a changed pin builds into a new directory. Needs nothing but Go (>= GO_MIN) and
# the Go module proxy; Go's own module and build caches (GOMODCACHE, GOCACHE) make a rebuild
# after a pin change cheaper.
#
# Usage: ci/k8s/build.sh [--bin-dir] [PART...]
#   PART: kube-apiserver kube-proxy kubectl kubelet kube-controller-manager kube-scheduler etcd
#         coredns helm containerd cni-plugins node-cache (default: all of them)
#     containerd: containerd, containerd-shim-runc-v2 and ctr; cni-plugins: bin/cni/{bridge,
#     loopback,host-local,portmap}
#   --bin-dir  print the binary directory for these pins and exit (builds nothing)
# The Kubernetes binaries asked for are compiled by one `go build` (they share most packages).
# Each part is built, then run (its version must name the pinned version) before it is put in
# bin/. A part that cannot be built fails loudly, naming the part and the error; the other parts
# are still built, and the script exits 1.
#
# node-cache: the module proxy refuses its module (k8s.io/dns), so it is built offline from the
# kubernetes/dns source archive with its vendor directory, pinned by SHA256 in versions.env.
# NODE_CACHE_SRC names the archive (.tar.gz) or an unpacked tree; without it, the archive is
# looked for beside the repository (../shared/third_party/kubernetes-dns/). A missing archive,
# or one whose SHA256 is not the pinned one, fails naming NODE_CACHE_SRC; a tree is built as
# given (its file list is part of the cache key) and said so.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=ci/k8s/versions.env
. "$here/versions.env"

me=ci/k8s/build.sh
die() { echo "$me: $*" >&2; exit 1; }

all_parts=(kube-apiserver kube-proxy kubectl kubelet kube-controller-manager kube-scheduler etcd
  coredns helm containerd cni-plugins node-cache)
k8s_parts=" kube-apiserver kube-proxy kubectl kubelet kube-controller-manager kube-scheduler "
bin_dir_only=0
parts=()
for a in "$@"; do
  case $a in
    --bin-dir) bin_dir_only=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) [[ " ${all_parts[*]} " == *" $a "* ]] || die "unknown part or option '$a' (parts: ${all_parts[*]})"
       parts+=("$a") ;;
  esac
done
[ ${#parts[@]} -gt 0 ] || parts=("${all_parts[@]}")

# node-cache's source: the pinned archive, or what NODE_CACHE_SRC names.
node_cache_src=${NODE_CACHE_SRC:-$(cd "$here/../.." && pwd)/../shared/third_party/kubernetes-dns/dns-$NODE_CACHE_VERSION.tar.gz}
node_cache_id="archive sha256:$NODE_CACHE_SHA256"
if [ -n "${NODE_CACHE_SRC:-}" ] && [ -d "$NODE_CACHE_SRC" ]; then
  node_cache_id="tree $(cd "$NODE_CACHE_SRC" && find . -type f -printf '%P %s %T@\n' | sort | sha256sum | cut -c1-16)"
elif [ -n "${NODE_CACHE_SRC:-}" ] && [ -f "$NODE_CACHE_SRC" ]; then
  node_cache_id="archive sha256:$(sha256sum <"$NODE_CACHE_SRC" | cut -d' ' -f1)"
fi

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
check_pin containerd github.com/containerd/containerd/v2 "$CONTAINERD_VERSION"
check_pin cni github.com/containernetworking/plugins "$CNI_PLUGINS_VERSION"
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
# containerd: its Makefile's tags for a static build without btrfs headers, and its version
# variables; the CNI plugins: their build_linux.sh's version variable; node-cache: its
# build/build.sh's version variable.
containerd_tags=no_btrfs
containerd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
cni_ldflags="-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION"
node_cache_ldflags="-s -w -X k8s.io/dns/pkg/version.VERSION=$NODE_CACHE_VERSION"

# The cache key: every input of every binary.
key=$( {
  cat "$here/versions.env"
  for w in kubernetes etcd coredns helm containerd cni; do
    for f in "$here/$w"/go.mod "$here/$w"/go.sum "$here/$w"/*.go; do
      [ -e "$f" ] && { echo "== $w/${f##*/}"; cat "$f"; }
    done
  done
  echo "$gover $(go env GOOS GOARCH) CGO_ENABLED=$CGO_ENABLED GOFLAGS=$GOFLAGS -trimpath"
  echo "$k8s_tags $k8s_ldflags | $coredns_tags $coredns_ldflags | $etcd_tags $etcd_ldflags"
  echo "$helm_tags $helm_ldflags | $containerd_tags $containerd_ldflags | $cni_ldflags"
  echo "node-cache: $node_cache_id $node_cache_ldflags"
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

# go_build WRAPPER TAGS LDFLAGS OUT PACKAGE...: one `go build` of PACKAGEs in ci/k8s/WRAPPER
# into the directory OUT (each main package's binary under its own name); its log in log/.
go_build() {
  local wrapper=$1 tags=$2 ldflags=$3 out=$4 t0
  shift 4
  t0=$(now)
  echo "$me: building $* (ci/k8s/$wrapper) ..."
  rm -rf "$out" && mkdir -p "$out"
  if ! (cd "$here/$wrapper" && go build -trimpath ${tags:+-tags="$tags"} -ldflags="$ldflags" \
        -o "$out/" "$@") >"$dir/log/$wrapper.log" 2>&1; then
    echo "$me: BUILD FAILED ($* from ci/k8s/$wrapper, after $(secs "$t0" "$(now)") s):" >&2
    sed 's/^/    /' "$dir/log/$wrapper.log" >&2
    return 1
  fi
  echo "$me: built in $(secs "$t0" "$(now)") s: $*"
}

# install PART FILE DEST VERSION-COMMAND EXPECTED: FILE, once `FILE VERSION-COMMAND` says
# EXPECTED, moved to DEST; else the part failed.
install_checked() {
  local part=$1 file=$2 dest=$3 vercmd=$4 want=$5 out
  if ! out=$("$file" $vercmd 2>&1) || ! grep -qF -- "$want" <<<"$out"; then
    echo "$me: $part: built, but \`${file##*/} $vercmd\` does not say '$want':" >&2
    sed 's/^/    /' <<<"$out" >&2
    failed+=("$part")
    return 1
  fi
  mkdir -p "${dest%/*}"
  mv -f "$file" "$dest"
  echo "$me: $part: ${dest#"$bin"/}: $(grep -F -m1 -- "$want" <<<"$out")"
}

built() { # PART: already in bin/ for these pins
  local f=$bin/$1
  case $1 in
    containerd) f=$bin/ctr ;;
    cni-plugins) f=$bin/cni/portmap ;;
  esac
  if [ -x "$f" ]; then echo "$me: $1: already built for these pins ($bin)"; return 0; fi
  return 1
}

# The Kubernetes binaries asked for and missing: one `go build` for all of them.
build_kubernetes() {
  local part pkgs=() want=() tmp=$dir/tmp/kubernetes vercmd expect
  for part in "$@"; do built "$part" || { want+=("$part"); pkgs+=("k8s.io/kubernetes/cmd/$part"); }; done
  [ ${#want[@]} -gt 0 ] || return 0
  go_build kubernetes "$k8s_tags" "$k8s_ldflags" "$tmp" "${pkgs[@]}" || { failed+=("${want[@]}"); return 0; }
  for part in "${want[@]}"; do
    vercmd=--version expect="Kubernetes $K8S_VERSION"
    [ "$part" = kubectl ] && vercmd="version --client" expect="Client Version: $K8S_VERSION"
    install_checked "$part" "$tmp/$part" "$bin/$part" "$vercmd" "$expect" || true
  done
}

single() { # PART WRAPPER PACKAGE TAGS LDFLAGS VERSION-COMMAND EXPECTED
  local part=$1 tmp=$dir/tmp/$1
  built "$part" && return 0
  go_build "$2" "$4" "$5" "$tmp" "$3" || { failed+=("$part"); return 0; }
  local file=$tmp/${3##*/}
  [ "$3" = . ] && file=$tmp/$2
  if [ "$part" = coredns ]; then
    local p plugins missing=()
    plugins=$("$file" -plugins 2>&1)
    for p in $coredns_plugins; do grep -qx "$p" <<<"$plugins" || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
      echo "$me: coredns: built, but without the plugins ${missing[*]} (coredns -plugins)" >&2
      failed+=("$part")
      return 0
    fi
  fi
  install_checked "$part" "$file" "$bin/$part" "$6" "$7" || true
}

build_containerd() {
  local tmp=$dir/tmp/containerd c=github.com/containerd/containerd/v2/cmd
  built containerd && return 0
  go_build containerd "$containerd_tags" "$containerd_ldflags" "$tmp" \
    "$c/containerd" "$c/containerd-shim-runc-v2" "$c/ctr" || { failed+=(containerd); return 0; }
  install_checked containerd "$tmp/containerd" "$bin/containerd" --version "$CONTAINERD_VERSION" &&
    install_checked containerd "$tmp/containerd-shim-runc-v2" "$bin/containerd-shim-runc-v2" -v "$CONTAINERD_VERSION" &&
    install_checked containerd "$tmp/ctr" "$bin/ctr" --version "$CONTAINERD_VERSION" || true
}

cni_plugins() {
  local tmp=$dir/tmp/cni p=github.com/containernetworking/plugins/plugins plugin
  built cni-plugins && return 0
  go_build cni "" "$cni_ldflags" "$tmp" "$p/main/bridge" "$p/main/loopback" "$p/ipam/host-local" \
    "$p/meta/portmap" || { failed+=(cni-plugins); return 0; }
  # A plugin run without CNI_COMMAND prints its name and version. portmap last: built() looks
  # for it.
  for plugin in bridge loopback host-local portmap; do
    install_checked cni-plugins "$tmp/$plugin" "$bin/cni/$plugin" "" "$CNI_PLUGINS_VERSION" || return 0
  done
}

# node-cache, from kubernetes/dns's source with its vendor directory (the module proxy refuses
# the module): the archive checked against the pinned SHA256, unpacked under the cache, built
# offline (-mod=vendor).
node_cache() {
  built node-cache && return 0
  local src=$node_cache_src tree t0 tmp=$dir/tmp/node-cache sum
  t0=$(now)
  if [ -d "$src" ]; then
    tree=$src
    echo "$me: node-cache: building the tree NODE_CACHE_SRC=$src as it is (no SHA256 to check)"
  elif [ -f "$src" ]; then
    sum=$(sha256sum <"$src" | cut -d' ' -f1)
    if [ -z "${NODE_CACHE_SRC:-}" ] && [ "$sum" != "$NODE_CACHE_SHA256" ]; then
      echo "$me: node-cache: $src has SHA256 $sum, versions.env pins $NODE_CACHE_SHA256:" \
        "a damaged or different archive (set NODE_CACHE_SRC to the right one)" >&2
      failed+=(node-cache)
      return 0
    fi
    rm -rf "$dir/src" && mkdir -p "$dir/src"
    tar -xzf "$src" -C "$dir/src" || { echo "$me: node-cache: cannot unpack $src" >&2; failed+=(node-cache); return 0; }
    tree=$(find "$dir/src" -mindepth 1 -maxdepth 1 -type d | head -1)
  else
    echo "$me: node-cache: CANNOT BE BUILT: no source at $src. The module proxy refuses" \
      "$NODE_CACHE_MODULE; set NODE_CACHE_SRC to kubernetes/dns $NODE_CACHE_VERSION's source archive" \
      "(dns-$NODE_CACHE_VERSION.tar.gz, SHA256 $NODE_CACHE_SHA256, with its vendor directory) or an" \
      "unpacked tree of it" >&2
    failed+=(node-cache)
    return 0
  fi
  [ -f "$tree/cmd/node-cache/main.go" ] && [ -d "$tree/vendor" ] || {
    echo "$me: node-cache: $tree has no cmd/node-cache/main.go or no vendor/ directory:" \
      "NODE_CACHE_SRC must name kubernetes/dns's source with its vendor directory" >&2
    failed+=(node-cache)
    return 0
  }
  echo "$me: node-cache: building $tree/cmd/node-cache (offline, -mod=vendor) ..."
  rm -rf "$tmp" && mkdir -p "$tmp"
  if ! (cd "$tree" && GOFLAGS="-mod=vendor -buildvcs=false" GOPROXY=off go build -trimpath \
        -ldflags="$node_cache_ldflags" -o "$tmp/node-cache" ./cmd/node-cache) >"$dir/log/node-cache.log" 2>&1; then
    echo "$me: node-cache: BUILD FAILED (after $(secs "$t0" "$(now)") s):" >&2
    sed 's/^/    /' "$dir/log/node-cache.log" >&2
    failed+=(node-cache)
    return 0
  fi
  echo "$me: node-cache: built in $(secs "$t0" "$(now)") s"
  # It logs its version first thing, even for `-help` (which then prints its flags and exits,
  # touching nothing).
  install_checked node-cache "$tmp/node-cache" "$bin/node-cache" -help \
    "Starting node-cache image: $NODE_CACHE_VERSION" || true
  [ -d "$dir/src" ] && rm -rf "$dir/src"
}

k8s_want=()
for part in "${parts[@]}"; do
  [[ $k8s_parts == *" $part "* ]] && k8s_want+=("$part")
done
[ ${#k8s_want[@]} -eq 0 ] || build_kubernetes "${k8s_want[@]}"
for part in "${parts[@]}"; do
  case $part in
    etcd)
      single etcd etcd . "$etcd_tags" "$etcd_ldflags" --version "etcd Version: ${ETCD_VERSION#v}" ;;
    coredns)
      single coredns coredns github.com/coredns/coredns "$coredns_tags" "$coredns_ldflags" \
        -version "CoreDNS-${COREDNS_VERSION#v}" ;;
    helm)
      single helm helm helm.sh/helm/v4/cmd/helm "$helm_tags" "$helm_ldflags" version \
        "Version:\"$HELM_VERSION\"" ;;
    containerd) build_containerd ;;
    cni-plugins) cni_plugins ;;
    node-cache) node_cache ;;
  esac
done
rm -rf "$dir/tmp"

echo "$me: binaries in $bin ($(du -sh "$dir" | cut -f1) in all):"
(cd "$bin" && find . -type f | sort | while read -r f; do printf '    %-28s %s\n' "${f#./}" "$(stat -c %s "$f")"; done) || true
if [ ${#failed[@]} -gt 0 ]; then
  echo "$me: FAILED: ${failed[*]} (see above)" >&2
  exit 1
fi
