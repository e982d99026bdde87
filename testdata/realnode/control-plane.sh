# shellcheck shell=bash
# realnode control plane: a throwaway CA and the certificates a kubeadm control plane has
# (openssl), etcd and kube-apiserver on a host of their own ($P-cp), kube-controller-manager and
# kube-scheduler beside them, so that DaemonSets, Deployments, rolling updates, EndpointSlices
# and the scheduling of pods are the real controllers' work.

# pki_make: the CA, the API server's serving certificate, a client certificate and kubeconfig for
# each client (admin; the kubelet as system:node:$P-node; the controller manager; the scheduler;
# the API server's own client to the kubelets), the service-account keys.
pki_make() {
    local pki="$RUN_DIR/pki" who subj node
    node=$(ns_name node)
    mkdir -p "$pki"
    ossl() { openssl "$@" 2>>"$pki/openssl.log" || die "openssl $1 failed (log: $pki/openssl.log)"; }
    ossl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=realnode-$PREFIX-ca" \
        -keyout "$pki/ca.key" -out "$pki/ca.crt"
    printf '%s\n' basicConstraints=CA:FALSE keyUsage=digitalSignature,keyEncipherment \
        extendedKeyUsage=serverAuth \
        "subjectAltName=IP:$V4_APISERVER,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
        >"$pki/server.ext"
    printf 'extendedKeyUsage=clientAuth\n' >"$pki/client.ext"
    ossl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr"
    ossl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 2 -extfile "$pki/server.ext" -out "$pki/apiserver.crt"
    for who in admin kubelet kube-controller-manager kube-scheduler apiserver-kubelet-client; do
        case $who in
        admin) subj="/O=system:masters/CN=realnode-admin" ;;
        kubelet) subj="/O=system:nodes/CN=system:node:$node" ;;
        kube-controller-manager) subj="/CN=system:kube-controller-manager" ;;
        kube-scheduler) subj="/CN=system:kube-scheduler" ;;
        apiserver-kubelet-client) subj="/O=kubeadm:cluster-admins/CN=kube-apiserver-kubelet-client" ;;
        esac
        ossl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$pki/$who.key" -out "$pki/$who.csr"
        ossl x509 -req -in "$pki/$who.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
            -days 2 -extfile "$pki/client.ext" -out "$pki/$who.crt"
        cat >"$RUN_DIR/$who.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: realnode
  cluster: {server: "https://$V4_APISERVER:6443", certificate-authority: "$pki/ca.crt"}
users:
- name: $who
  user: {client-certificate: "$pki/$who.crt", client-key: "$pki/$who.key"}
contexts:
- name: realnode
  context: {cluster: realnode, user: $who}
current-context: realnode
EOF
    done
    ossl genrsa -out "$pki/sa.key" 2048
    ossl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
}

# namespaces_add: the node and the control-plane host, with the veth between them; the node's
# default route points at the control plane's host (a real node has one: a ClusterIP needs a
# route before kube-proxy's OUTPUT DNAT rewrites it).
namespaces_add() {
    local node cp
    node=$(ns_name node) cp=$(ns_name cp)
    ip netns add "$node"
    ip netns add "$cp"
    ip -n "$node" link set lo up
    ip -n "$cp" link set lo up
    ip -n "$node" link add cp type veth peer name eth0 netns "$cp"
    ip -n "$node" addr add "$V4_CP_NODE/30" dev cp
    ip -n "$node" link set cp up
    ip -n "$cp" addr add "$V4_APISERVER/30" dev eth0
    ip -n "$cp" link set eth0 up
    ip -n "$cp" route add default via "$V4_CP_NODE" dev eth0
    ip -n "$node" route add default via "$V4_APISERVER" dev cp
    ip netns exec "$node" sysctl -qw net.ipv4.ip_forward=1
    # node-cache's listen IPs: on its dummy interface `nodelocaldns` where the kernel has dummy
    # interfaces; this kernel has none, so the test bed puts them on lo and runs node-cache with
    # -setupinterface=false (addons.sh).
    ip -n "$node" addr add "$LOCAL_IP/32" dev lo
    ip -n "$node" addr add "$CLUSTER_DNS/32" dev lo
}

control_plane_start() {
    local pki="$RUN_DIR/pki"
    svc_start etcd cp "$BIN/etcd" --name realnode --data-dir "$RUN_DIR/etcd" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster realnode=http://127.0.0.1:2380 --unsafe-no-fsync --log-level warn
    svc_start kube-apiserver cp "$BIN/kube-apiserver" \
        --etcd-servers=http://127.0.0.1:2379 \
        --bind-address="$V4_APISERVER" --advertise-address="$V4_APISERVER" --secure-port=6443 \
        --service-cluster-ip-range="$SERVICE_CIDR" \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --client-ca-file="$pki/ca.crt" \
        --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types=InternalIP \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --authorization-mode=Node,RBAC \
        --enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,ResourceQuota,Priority \
        --allow-privileged=true --profiling=false --cert-dir="$RUN_DIR/apiserver-certs"
    wait_for 180 "kube-apiserver's /readyz" kc_cp get --raw /readyz
    # kubeadm's binding of the API server's client to the kubelets (exec, logs).
    kc_cp create clusterrolebinding kubeadm:cluster-admins --clusterrole=cluster-admin \
        --group=kubeadm:cluster-admins >>"$RUN_DIR/log/kubectl.log" 2>&1 ||
        die "kubectl create clusterrolebinding failed: $(tail -n 5 "$RUN_DIR/log/kubectl.log")"
    # As kubeadm's static pods run them; no leader election (one of each), node IPAM off (the
    # node's podCIDR is the kubelet's CNI range, set when the Node registers: node_ready).
    svc_start kube-controller-manager cp "$BIN/kube-controller-manager" \
        --kubeconfig="$RUN_DIR/kube-controller-manager.kubeconfig" \
        --authentication-kubeconfig="$RUN_DIR/kube-controller-manager.kubeconfig" \
        --authorization-kubeconfig="$RUN_DIR/kube-controller-manager.kubeconfig" \
        --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
        --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
        --use-service-account-credentials=true --controllers='*,bootstrapsigner,tokencleaner,-nodeipam' \
        --leader-elect=false --bind-address=127.0.0.1 --flex-volume-plugin-dir="$RUN_DIR/kcm-flex"
    svc_start kube-scheduler cp "$BIN/kube-scheduler" \
        --kubeconfig="$RUN_DIR/kube-scheduler.kubeconfig" \
        --authentication-kubeconfig="$RUN_DIR/kube-scheduler.kubeconfig" \
        --authorization-kubeconfig="$RUN_DIR/kube-scheduler.kubeconfig" \
        --leader-elect=false --bind-address=127.0.0.1
}

# kubectl from the control plane's host (before the node's holder exists).
kc_cp() { in_cp "$BIN/kubectl" --kubeconfig "$RUN_DIR/admin.kubeconfig" --request-timeout=20s "$@"; }

control_plane_stop() {
    local svc
    for svc in kube-scheduler kube-controller-manager kube-apiserver etcd; do svc_stop "$svc" 10; done
}
