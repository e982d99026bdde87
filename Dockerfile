# nodelocaldns-ha: the agent's image (manifests/base), the admission webhook's (manifests/webhook:
# `nodelocaldns-ha-webhook`), and the source of the `drain` client that node-cache's preStop hook
# runs (manifests/overlays/node-local-dns).
#
#   docker build -t REGISTRY/nodelocaldns-ha:TAG .
#
# The image has no shell, no package manager and no distribution: only the two binaries, the
# iptables tools the agent's iptables backends run, `cp` for the node-local-dns overlay's init
# container, and the shared libraries these load (ci/image/rootfs.sh lists them and why). Its
# contents and size: README, "The image".
#
# RUST_IMAGE: the builder, Debian bookworm with Rust (>= the crates' rust-version) and apt. The
# test bed, which cannot pull it, builds a local equivalent from Debian's packages and passes it
# here (ci/image/build.sh).
ARG RUST_IMAGE=docker.io/library/rust:1.89-bookworm

FROM ${RUST_IMAGE} AS build
# A failing command inside a pipe fails the build.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Packages are not pinned: the Debian release pins their ABI; its updates are security fixes.
# iptables and coreutils: their files go into the image (ci/image/rootfs.sh).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnftnl-dev libmnl-dev pkg-config iptables \
        coreutils binutils \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# The workspace's other members (the load client, the test kit), and the test and benchmarks
# Cargo.toml names ([[test]] e2e_vm, [[bench]]): cargo reads them even to build the agent alone,
# which does not depend on them.
COPY crates ./crates
COPY tests ./tests
COPY benches ./benches
# Each binary on its own: together, cargo would unify their dependencies' features, and the
# agent would carry the webhook's HTTP/2 server (about 1 MiB more resident with its API client
# on). The registry and the target directory are build caches (a rebuild compiles only what
# changed), so the binaries are taken out of the target directory in the same step.
RUN --mount=type=cache,id=nodelocaldns-ha-cargo-registry,target=/usr/local/cargo/registry \
    --mount=type=cache,id=nodelocaldns-ha-target,target=/src/target \
    cargo build --release --locked -p nodelocaldns-ha --bin nodelocaldns-ha \
    && cargo build --release --locked -p nodelocaldns-ha-webhook --bin nodelocaldns-ha-webhook \
    && mkdir -p /out \
    && strip -o /out/nodelocaldns-ha target/release/nodelocaldns-ha \
    && strip -o /out/nodelocaldns-ha-webhook target/release/nodelocaldns-ha-webhook
# The image's root file system, and the client bundle for other containers' images (node-cache's
# has no libc to rely on) in it: /opt/nodelocaldns-ha holds the binary, every shared library it
# loads, and the dynamic loader as `ld.so`, run as `DIR/ld.so --library-path DIR
# DIR/nodelocaldns-ha drain`. The script checks that the bundle and each tool run with nothing but
# the root file system.
COPY ci/image/rootfs.sh /usr/local/bin/
RUN rootfs.sh /out /rootfs

FROM scratch
COPY --from=build /rootfs /
# The agent runs the iptables tools by name; the overlay's init container runs `cp`.
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
ENTRYPOINT ["/usr/local/bin/nodelocaldns-ha"]
CMD ["run"]
