# shellcheck shell=bash
# realnode images: every image the node runs, made here from local files (no registry is
# reachable, and nothing is pulled): OCI archives (oci-image.py) in a cache outside the
# repository keyed by their content, imported into the node's containerd at `up`.
#   pause       the pod sandbox (pause.c, static)
#   coredns     CoreDNS, as built by ci/k8s/build.sh (static)
#   kube-proxy  kube-proxy and the tools its image has: iptables (nft and legacy, `iptables` the
#               nft one, as on this machine), nft, conntrack, with the libraries they load
#   node-cache  node-cache and the same iptables tools (its -setupiptables runs them)
#   dns-client  the test kit's load client (dnsload: glibc's getaddrinfo, following the
#               resolv.conf the kubelet wrote) and busybox (a shell, sleep, kill: the tests
#               start and stop the load with `kubectl exec`), idle under pause
#   the agent   ci/image/build.sh's image from the repository's Dockerfile (--agent-image),
#               saved from podman's storage

readonly IMAGE_PAUSE=localhost/realnode/pause:1
readonly IMAGE_COREDNS=localhost/realnode/coredns:1
readonly IMAGE_KUBE_PROXY=localhost/realnode/kube-proxy:1
readonly IMAGE_NODE_CACHE=localhost/realnode/node-cache:1
readonly IMAGE_CLIENT=localhost/realnode/dns-client:1
readonly IMAGE_CACHE=${REALNODE_IMAGE_CACHE:-/var/cache/nodelocaldns-ha/realnode-images}

# rootfs_add ROOT FILE...: each FILE at its own path under ROOT, with every shared library it
# loads and the loader (rootfs_libs).
rootfs_add() {
    local root=$1 f
    shift
    for f in "$@"; do copy_at "$root" "$f"; done
    rootfs_libs "$root" "$@"
}

# copy_at ROOT FILE [-L]: FILE at its own path under ROOT (a symbolic link as a link; with -L,
# what it points to).
copy_at() {
    mkdir -p "$1${2%/*}" && cp "${3:--P}" --preserve=mode "$2" "$1$2"
}

# rootfs_libs ROOT FILE...: every shared library the FILEs load (ldd), and the loader, at their
# paths under ROOT.
rootfs_libs() {
    local root=$1 f lib
    shift
    for f in "$@"; do
        [[ -L $f ]] && continue
        ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// && $2 ~ /^\(0x/ { print $1 }'
    done | sort -u | while read -r lib; do copy_at "$root" "$lib" -L; done
}

# rootfs_iptables ROOT: the iptables tools (both backends; `iptables` and `ip6tables` the nft
# backend, as this machine's alternatives have them) and every extension.
rootfs_iptables() {
    local root=$1 multi flavour family tool triplet
    triplet=$(gcc -dumpmachine)
    rootfs_add "$root" /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi \
        "/usr/lib/$triplet/xtables"/*.so
    for multi in xtables-legacy-multi xtables-nft-multi; do
        flavour=${multi#xtables-} flavour=${flavour%-multi}
        for family in iptables ip6tables; do
            for tool in "" -save -restore; do ln -sf "$multi" "$root/usr/sbin/$family-$flavour$tool"; done
        done
    done
    for family in iptables ip6tables; do
        for tool in "" -save -restore; do ln -sf xtables-nft-multi "$root/usr/sbin/$family$tool"; done
    done
}

# image_make NAME ENTRYPOINT-JSON FILL: the image's archive, made by `FILL ROOT` into a fresh
# directory unless the cache has it for the same content; prints the archive's path.
image_make() {
    local name=$1 entry=$2 fill=$3 work root key out
    work=$(mktemp -d "${TMPDIR:-/tmp}/realnode-image.XXXXXX")
    root=$work/root
    mkdir -p "$root"/{etc,tmp,proc,sys,dev,run,var/run}
    "$fill" "$root" || { rm -rf "$work"; die "image $name: assembling its files failed"; }
    # The key: every file's path, mode and content, the name, the entrypoint and the writer.
    key=$( { echo "$name $entry"; cat "$SCRIPT_DIR/realnode/oci-image.py"
        (cd "$root" && find . -printf '%P %m %l\n' | sort && find . -type f -print0 | sort -z | xargs -0 -r sha256sum)
    } | sha256sum | cut -c1-16)
    out=$IMAGE_CACHE/${name//[\/:]/_}-$key.tar
    if [[ ! -f $out ]]; then
        mkdir -p "$IMAGE_CACHE"
        /usr/bin/python3 "$SCRIPT_DIR/realnode/oci-image.py" "$out.tmp" "$name" "$root" "$entry" ||
            { rm -rf "$work" "$out.tmp"; die "image $name: writing its archive failed"; }
        mv "$out.tmp" "$out"
    fi
    rm -rf "$work"
    echo "$out"
}

fill_pause() { musl-gcc -static -Os -s -o "$1/pause" "$SCRIPT_DIR/realnode/pause.c"; }
fill_coredns() { cp "$BIN/coredns" "$1/coredns"; }
fill_kube_proxy() {
    mkdir -p "$1/usr/local/bin" && cp "$BIN/kube-proxy" "$1/usr/local/bin/kube-proxy"
    rootfs_iptables "$1"
    rootfs_add "$1" /usr/sbin/nft /usr/sbin/conntrack
}
fill_node_cache() {
    cp "$BIN/node-cache" "$1/node-cache"
    rootfs_iptables "$1"
}
fill_client() {
    local tool
    mkdir -p "$1/usr/local/bin" "$1/bin"
    musl-gcc -static -Os -s -o "$1/pause" "$SCRIPT_DIR/realnode/pause.c"
    cp /bin/busybox "$1/bin/busybox"
    for tool in sh sleep kill cat; do ln -s busybox "$1/bin/$tool"; done
    cp "$DNSLOAD" "$1/usr/local/bin/dnsload"
    rootfs_libs "$1" "$DNSLOAD"
}

# images_build [AGENT-IMAGE]: every archive made (or found in the cache), their paths in
# $RUN_DIR/images after `up` has made it.
images_build() {
    DNSLOAD=${REALNODE_DNSLOAD:-$REPO/target/debug/dnsload}
    if [[ ! -x $DNSLOAD && -z ${REALNODE_DNSLOAD:-} ]]; then
        (cd "$REPO" && cargo build --quiet --locked -p dnsload --bin dnsload) ||
            die "building the load client (cargo build -p dnsload) failed"
    fi
    [[ -x $DNSLOAD ]] || die "no load client at $DNSLOAD: build it (cargo build -p dnsload) or set REALNODE_DNSLOAD"
    IMAGE_ARCHIVES=(
        "$(image_make "$IMAGE_PAUSE" '["/pause"]' fill_pause)"
        "$(image_make "$IMAGE_COREDNS" '["/coredns"]' fill_coredns)"
        "$(image_make "$IMAGE_KUBE_PROXY" '["/usr/local/bin/kube-proxy"]' fill_kube_proxy)"
        "$(image_make "$IMAGE_NODE_CACHE" '["/node-cache"]' fill_node_cache)"
        "$(image_make "$IMAGE_CLIENT" '["/pause"]' fill_client)"
    )
    if [[ -n ${1:-} ]]; then
        local agent=$IMAGE_CACHE/agent.tar
        mkdir -p "$IMAGE_CACHE"
        CONTAINERS_CONF=$REPO/ci/image/containers.conf CONTAINERS_STORAGE_CONF=$REPO/ci/image/storage.conf \
            podman save --quiet --format oci-archive -o "$agent.tmp" "$1" >/dev/null 2>"$IMAGE_CACHE/agent.err" ||
            die "saving the agent's image $1 from podman's storage failed: $(tail -n 3 "$IMAGE_CACHE/agent.err")"
        mv "$agent.tmp" "$agent"
        IMAGE_ARCHIVES+=("$agent")
    fi
}

# images_import: each archive into the node's containerd (namespace k8s.io, where the kubelet's
# images are); the agent's under the name it was given.
images_import() {
    local a out
    for a in "${IMAGE_ARCHIVES[@]}"; do
        out=$(ctr_node images import --snapshotter overlayfs "$a" 2>&1) ||
            die "ctr images import $a failed: $out"
    done
    local agent
    agent=$(<"$RUN_DIR/agent-image")
    if [[ -n $agent ]]; then
        local names
        names=$(ctr_node images ls -q)
        grep -qxF "$agent" <<<"$names" || die "the agent's image $agent is not in containerd after its import: ${names//$'\n'/ }"
    fi
}
