#!/usr/bin/env bash
# Assembles the image's root file system, in the Dockerfile's build stage (Debian):
#   rootfs.sh BIN_DIR ROOT
# BIN_DIR holds the stripped nodelocaldns-ha and nodelocaldns-ha-webhook. Into ROOT goes only
# what something in the image runs, each with the shared libraries it loads (ldd), at the paths
# Debian's loader searches:
#   /usr/local/bin/nodelocaldns-ha, nodelocaldns-ha-webhook   the agent and the webhook
#   /usr/sbin/xtables-{legacy,nft}-multi and the names the agent runs ({ip,ip6}tables-
#     {legacy,nft}[-save|-restore], src/dataplane/iptables/flavour.rs)   the iptables backends
#   /usr/lib/<triplet>/xtables/   every iptables extension: iptables-save prints the rules of
#     every owner (kube-proxy's, a CNI's), and loads an extension for each match it meets
#   /usr/bin/cp   the node-local-dns overlay's init container copies the bundle with it
#   /opt/nodelocaldns-ha/   the drain client bundle: the agent's binary, its libraries, and the
#     loader as ld.so (node-cache's image has no libc to lend it)
# No shell, no package manager. Then each program is run in ROOT (chroot) with nothing else.
set -euo pipefail
bin=$1 root=$2
triplet=$(gcc -dumpmachine)

mkdir -p "$root"/{usr/local/bin,usr/sbin,usr/bin,run,tmp,proc,sys,dev,etc}
# The agent's binary is the bundle's (below), not a second copy of it.
install -m 755 "$bin/nodelocaldns-ha-webhook" "$root/usr/local/bin/"
ln -s /opt/nodelocaldns-ha/nodelocaldns-ha "$root/usr/local/bin/nodelocaldns-ha"
for multi in xtables-legacy-multi xtables-nft-multi; do
  install -m 755 "/usr/sbin/$multi" "$root/usr/sbin/"
  flavour=${multi#xtables-}; flavour=${flavour%-multi}
  for family in iptables ip6tables; do
    for tool in "" -save -restore; do ln -s "$multi" "$root/usr/sbin/$family-$flavour$tool"; done
  done
done
mkdir -p "$root/usr/lib/$triplet"
cp -a "/usr/lib/$triplet/xtables" "$root/usr/lib/$triplet/"
install -m 755 /usr/bin/cp "$root/usr/bin/"

# Every shared library the programs and extensions load, and the loader, at the path ldd names.
libraries() {
  ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// && $2 ~ /^\(0x/ { print $1 }'
}
elves=("$bin/nodelocaldns-ha" "$root/usr/local/bin/nodelocaldns-ha-webhook" "$root"/usr/sbin/xtables-*-multi "$root"/usr/bin/cp
       "$root/usr/lib/$triplet"/xtables/*.so)
libraries "${elves[@]}" | sort -u | while read -r lib; do cp -L --parents "$lib" "$root"; done

# The drain client bundle.
bundle=$root/opt/nodelocaldns-ha
mkdir -p "$bundle"
install -m 755 "$bin/nodelocaldns-ha" "$bundle/"
libraries "$bin/nodelocaldns-ha" | while read -r lib; do
  case $lib in
    */ld-linux*) cp -L "$lib" "$bundle/ld.so" ;;
    *) cp -L "$lib" "$bundle/" ;;
  esac
done

# Each runs with the root file system alone; the bundle with nothing but itself.
chroot "$root" /usr/local/bin/nodelocaldns-ha --version
chroot "$root" /usr/local/bin/nodelocaldns-ha-webhook --version
for tool in iptables-legacy-save iptables-nft-save ip6tables-legacy-restore ip6tables-nft-restore; do
  chroot "$root" "/usr/sbin/$tool" --version
done
chroot "$root" /usr/bin/cp --version >/dev/null
alone=$(mktemp -d)
mkdir "$alone/opt" && cp -a "$bundle" "$alone/opt/"
chroot "$alone" /opt/nodelocaldns-ha/ld.so --library-path /opt/nodelocaldns-ha \
  /opt/nodelocaldns-ha/nodelocaldns-ha --version
rm -rf "$alone"
