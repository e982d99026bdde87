# nodelocaldns-ha: the agent's image (manifests/base), the admission webhook's (manifests/webhook:
# `nodelocaldns-ha-webhook`), and the source of the `drain` client that node-cache's preStop hook
# runs (manifests/overlays/node-local-dns).
#
#   docker build -t REGISTRY/nodelocaldns-ha:TAG .
#
# Both stages are Debian bookworm: the binary links against the build stage's glibc, libnftnl and
# libmnl, and runs on the same release's.

FROM rust:1.89-bookworm AS build
# A failing command inside a pipe fails the build.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Packages are not pinned: the Debian release pins their ABI; its updates are security fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnftnl-dev libmnl-dev pkg-config \
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
# on).
RUN cargo build --release --locked -p nodelocaldns-ha --bin nodelocaldns-ha \
    && cargo build --release --locked -p nodelocaldns-ha-webhook --bin nodelocaldns-ha-webhook
# The client bundle for other containers' images (node-cache's has no libc to rely on): the
# binary (stripped: 4 MB instead of 30), every shared library it loads, and the dynamic loader
# as `ld.so`, run as `DIR/ld.so --library-path DIR DIR/nodelocaldns-ha drain`. The last line
# checks that the bundle runs with nothing but itself.
RUN set -eu; \
    bin=target/release/nodelocaldns-ha; \
    mkdir -p /bundle/opt/nodelocaldns-ha; \
    strip -o /bundle/opt/nodelocaldns-ha/nodelocaldns-ha "$bin"; \
    ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' \
        | xargs -r cp -L -t /bundle/opt/nodelocaldns-ha/; \
    cp -L "$(ldd "$bin" | awk '$1 ~ /^\// { print $1 }')" /bundle/opt/nodelocaldns-ha/ld.so; \
    chroot /bundle /opt/nodelocaldns-ha/ld.so --library-path /opt/nodelocaldns-ha \
        /opt/nodelocaldns-ha/nodelocaldns-ha --version

FROM debian:bookworm-slim
# iptables: the iptables-legacy and iptables-nft backends run its -save and -restore binaries.
# No nftables package: the agent speaks netlink to nf_tables itself.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnftnl11 libmnl0 iptables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/nodelocaldns-ha /usr/local/bin/nodelocaldns-ha
COPY --from=build /src/target/release/nodelocaldns-ha-webhook /usr/local/bin/nodelocaldns-ha-webhook
COPY --from=build /bundle/opt/nodelocaldns-ha /opt/nodelocaldns-ha
ENTRYPOINT ["nodelocaldns-ha"]
CMD ["run"]
