#!/usr/bin/env bash
# Smoke test of the real control plane built by ci/k8s/build.sh: etcd and kube-apiserver in a
# network namespace of their own (nothing listens outside it, no traffic leaves it), TLS from a
# throwaway CA made here with openssl, a service-account key pair, the admission plugins a real
# cluster has (MutatingAdmissionWebhook included). Waits for /readyz (a deadline, polling), then
# through kubectl with a kubeconfig written here: the `kubernetes` Service at 10.96.0.1, and a
# kube-dns Service created at 10.96.0.10. Tears down what it started, by pid and by its
# namespace's name, and checks that nothing is left. Run as root.
# Usage: ci/k8s/smoke.sh   (builds the parts it needs first, if they are not in the cache)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
me=ci/k8s/smoke.sh
[ "$(id -u)" = 0 ] || { echo "$me: run as root (it creates a network namespace)" >&2; exit 2; }

"$here/build.sh" etcd kube-apiserver kubectl >/dev/null ||
  { echo "$me: ci/k8s/build.sh failed (run it for the error)" >&2; exit 1; }
bin=$("$here/build.sh" --bin-dir)

ns=nlk8s$$                 # unique per run
ip_addr=10.200.0.1         # the API server's address, on the namespace's own lo
work=$(mktemp -d /tmp/nlk8s-smoke.XXXXXX)
etcd_pid="" apiserver_pid=""
t_start=$(date +%s)

log() { echo "$me: [$(( $(date +%s) - t_start )) s] $*"; }
fail() {
  echo "$me: FAILED: $*" >&2
  for f in openssl etcd kube-apiserver; do
    [ -s "$work/$f.log" ] && { echo "--- last lines of $f's log:" >&2; tail -n 25 "$work/$f.log" >&2; }
  done
  exit 1
}

# A process is alive when it exists and is not a zombie (an orphan's zombie may linger: PID 1
# of a container does not always reap).
alive() { [ -n "$1" ] && [ -r "/proc/$1/stat" ] && ! grep -q ') Z ' "/proc/$1/stat" 2>/dev/null; }
# Stop one process we started: SIGTERM, wait for it to be gone (deadline), then SIGKILL.
stop_pid() {
  local pid=$1 i
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    echo "$me: pid $pid ($(cat "/proc/$pid/comm" 2>/dev/null)) still there 15 s after SIGTERM: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

teardown() {
  local rc=$? left=""
  set +e
  # A signal's trap may run inside a redirected function call (wait_for's >/dev/null): say
  # what happens on the script's own stdout and stderr again.
  exec 1>&7 2>&8
  stop_pid "$apiserver_pid"
  stop_pid "$etcd_pid"
  if ip netns list | grep -qw "^$ns"; then
    # Anything still in our namespace was started by this script.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do stop_pid "$pid"; done
    ip netns del "$ns"
  fi
  rm -rf "$work"
  log "torn down"
  ip netns list | grep -qw "^$ns" && left+=" namespace $ns;"
  for pid in $etcd_pid $apiserver_pid; do alive "$pid" && left+=" pid $pid;"; done
  if [ -n "$left" ]; then
    echo "$me: teardown left behind:$left" >&2
    rc=1
  fi
  exit $rc
}
exec 7>&1 8>&2
trap teardown EXIT
trap 'exit 130' INT TERM

# --- PKI: a throwaway CA, the API server's serving cert, an admin client cert, SA keys. ---
cd "$work"
ossl() { openssl "$@" 2>>"$work/openssl.log" || fail "openssl $1"; }
ossl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=nlk8s-smoke-ca \
  -keyout ca.key -out ca.crt
cat >apiserver.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$ip_addr,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
ossl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout apiserver.key -out apiserver.csr
ossl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
  -extfile apiserver.ext -out apiserver.crt
printf 'extendedKeyUsage=clientAuth\n' >client.ext
ossl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=nlk8s-admin" \
  -keyout admin.key -out admin.csr
ossl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
  -extfile client.ext -out admin.crt
ossl genrsa -out sa.key 2048
ossl rsa -in sa.key -pubout -out sa.pub

cat >kubeconfig <<EOF
apiVersion: v1
kind: Config
clusters:
- name: smoke
  cluster:
    server: https://$ip_addr:6443
    certificate-authority: $work/ca.crt
users:
- name: admin
  user:
    client-certificate: $work/admin.crt
    client-key: $work/admin.key
contexts:
- name: smoke
  context: {cluster: smoke, user: admin}
current-context: smoke
EOF

# --- The namespace: lo only, with the API server's address on it. ---
ip netns add "$ns"
ip -n "$ns" link set lo up
ip -n "$ns" addr add "$ip_addr/32" dev lo
inns() { ip netns exec "$ns" "$@"; }
# The servers are started with `ip netns exec` itself (not through a function, which would fork
# a subshell): it execs the server, so $! is the server's own pid, a child of this script.
kc() { inns "$bin/kubectl" --kubeconfig "$work/kubeconfig" --request-timeout=10s "$@"; }

ip netns exec "$ns" "$bin/etcd" --name smoke --data-dir "$work/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster smoke=http://127.0.0.1:2380 --unsafe-no-fsync >"$work/etcd.log" 2>&1 7>&- 8>&- &
etcd_pid=$!
log "etcd $("$bin/etcd" --version | head -1 | cut -d' ' -f3) started (pid $etcd_pid) in namespace $ns"

ip netns exec "$ns" "$bin/kube-apiserver" \
  --etcd-servers=http://127.0.0.1:2379 \
  --bind-address="$ip_addr" --advertise-address="$ip_addr" --secure-port=6443 \
  --service-cluster-ip-range=10.96.0.0/12 \
  --tls-cert-file="$work/apiserver.crt" --tls-private-key-file="$work/apiserver.key" \
  --client-ca-file="$work/ca.crt" \
  --service-account-key-file="$work/sa.pub" --service-account-signing-key-file="$work/sa.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --authorization-mode=Node,RBAC \
  --enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,ResourceQuota \
  --allow-privileged=true --profiling=false --cert-dir="$work/apiserver-certs" \
  >"$work/kube-apiserver.log" 2>&1 7>&- 8>&- &
apiserver_pid=$!
log "kube-apiserver $("$bin/kube-apiserver" --version | cut -d' ' -f2) started (pid $apiserver_pid)"

# Poll a condition until a deadline; fail if either server has exited meanwhile.
wait_for() { # DEADLINE-SECONDS WHAT COMMAND...
  local secs=$1 what=$2 deadline=$(( $(date +%s) + $1 )); shift 2
  until "$@" >/dev/null 2>&1; do
    alive "$etcd_pid" || fail "etcd exited while waiting for $what"
    alive "$apiserver_pid" || fail "kube-apiserver exited while waiting for $what"
    [ "$(date +%s)" -lt "$deadline" ] || fail "no $what after $secs s"
    sleep 0.2
  done
  log "$what"
}
wait_for 180 "/readyz ok" kc get --raw /readyz

# The API server's own controllers create the default Service at the range's first address.
svc_ip() { [ "$(kc get service "$1" -n "$2" -o 'jsonpath={.spec.clusterIP}')" = "$3" ]; }
wait_for 60 "Service default/kubernetes at 10.96.0.1" svc_ip kubernetes default 10.96.0.1

kc apply -f - >/dev/null <<'EOF' || fail "creating Service kube-system/kube-dns"
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns}
spec:
  clusterIP: 10.96.0.10
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
svc_ip kube-dns kube-system 10.96.0.10 || fail "Service kube-system/kube-dns is not at 10.96.0.10"
log "Service kube-system/kube-dns created at 10.96.0.10"

grep -q 'mutating admission controller(s) successfully in the following order: .*MutatingAdmissionWebhook' \
  "$work/kube-apiserver.log" || fail "kube-apiserver did not log MutatingAdmissionWebhook among its admission plugins"
log "MutatingAdmissionWebhook loaded; $(kc version 2>/dev/null | tr '\n' ' ')"
log "OK (tearing down)"
