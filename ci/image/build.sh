#!/usr/bin/env bash
# Builds the image from the repository's Dockerfile on this machine (rootful buildah, vfs storage,
# the runc runtime: ci/image/containers.conf, storage.conf), as ci/test.sh does before the tests
# that run the agent from it (tests/e2e_image.rs). Prints the image's name.
#
# The Dockerfile's builder, docker.io's rust:*-bookworm, cannot be pulled here: the local
# equivalent is Debian bookworm from Debian's packages (mmdebstrap) with this machine's Rust
# toolchain in /usr/local and CARGO_HOME=/usr/local/cargo, as in the official image, passed as
# the RUST_IMAGE build argument. Nothing is pulled from any registry (--pull=never); the build
# reaches Debian's mirror (apt-get) and crates.io (cargo) as the host does, trusting what the
# host's cargo trusts (its CA bundle, CARGO_HTTP_CAINFO: this machine's network has a TLS proxy
# of its own).
#
# Caches, outside the repository: the bases and the layers in the storage's graphroot
# (/var/cache/nodelocaldns-ha/containers), cargo's registry and target directory in buildah's
# cache mounts (/var/tmp/buildah-cache): on a fresh machine the build compiles the agent and
# the webhook from scratch; after that, only what changed.
#
# Usage: ci/image/build.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
me=ci/image/build.sh
die() { echo "$me: $*" >&2; exit 1; }

export CONTAINERS_CONF=$here/containers.conf CONTAINERS_STORAGE_CONF=$here/storage.conf
for tool in buildah podman runc mmdebstrap rustc; do
  command -v "$tool" >/dev/null || die "$tool not found (ci/deps.sh installs buildah, podman, runc, mmdebstrap)"
done
image=localhost/nodelocaldns-ha:ci

rust=$(rustc --version | awk '{ print $2 }')
builder=localhost/nodelocaldns-ha-ci/rust:$rust-bookworm
if ! podman image exists "$builder"; then
  echo "$me: making the builder $builder (Debian bookworm, mmdebstrap; Rust $rust)" >&2
  sysroot=$(rustc --print sysroot)
  # The toolchain's programs and libraries; not its documentation.
  tar=$(mktemp --suffix=.tar)
  trap 'rm -f "$tar"' EXIT
  mmdebstrap --quiet --variant=minbase --include=gcc,libc6-dev,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="tar -C '$sysroot' -c bin lib libexec | tar -C \"\$1/usr/local\" -x" \
    --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/usr/local/share/host-ca.crt"' \
    bookworm "$tar" http://deb.debian.org/debian
  podman import --quiet \
      --change 'ENV CARGO_HOME=/usr/local/cargo' \
      --change 'ENV CARGO_HTTP_CAINFO=/usr/local/share/host-ca.crt' \
      --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      "$tar" "$builder" >/dev/null
fi

echo "$me: building $image from $repo/Dockerfile" >&2
buildah build --quiet --pull=never --network host --isolation oci --runtime runc \
  --build-arg "RUST_IMAGE=$builder" --tag "$image" "$repo" >&2
# The builder's layers of earlier builds are not kept: only the last image, and the bases.
podman image prune --force >/dev/null
echo "$image"
