# shellcheck shell=bash
# simnode real parts (--kube-proxy real-iptables|real-nftables|real-ipvs): the node with real
# Kubernetes parts, built by ci/k8s/build.sh from pinned Go modules, in place of the stand-ins:
#   * a control-plane host, namespace $P-cp (eth0 10.240.0.2), behind a veth `cp` on the node
#     (10.240.0.1): etcd (on its lo) and kube-apiserver (on 10.240.0.2:6443), TLS from a
#     throwaway CA made here with openssl, a service-account key pair, client certificates and
#     kubeconfigs for the tests (admin), kube-proxy and CoreDNS. The dns namespace reaches the API
#     server through the node (its default route), as CoreDNS pods do through theirs.
#   * no kubelet and no controller-manager: `up` creates, through the API (kubectl, admin), the
#     node's Node object (as kubelet registers it), the Services kube-system/kube-dns
#     (10.96.0.10) and kube-dns-upstream (10.96.0.11), udp and tcp 53, same selector, and
#     playing the endpoint controller, an EndpointSlice for each (and each family) with the
#     CoreDNS endpoints 10.244.1.2 and 10.244.1.3 (fd00:244:1::2 and ::3), ready.
#   * real kube-proxy in the node namespace, in iptables mode (the host's `iptables`, i.e.
#     iptables-nft here; kubelet's chains beside it), nftables mode (`table ip kube-proxy`) or
#     IPVS mode (its `kube-ipvs0`, IPVS services, ipsets and iptables chains; needs the ip_vs
#     modules: the ci/vm guest), with the flags kubeadm's config gives it; its metrics and
#     healthz servers listen inside the node namespace only. `up` waits until its rules send
#     both Services to both endpoints.
#   * real CoreDNS (coredns-start) in the dns namespace on the endpoint addresses, with the
#     kubernetes plugin reading the API server, and the template plugin answering who.test with
#     2.2.2.2 (and fd00::2:2:2:2), as the dnsmasq stand-in does, so tests still see who answered.
#   * the node-local cache: node-cache itself, built from kubernetes/dns's source, with node-local-
#     dns's Corefile and flags (real_cache_conf).
# --family 4, or dual: a dual-stack cluster (IPv4 primary, as kubeadm's dual-stack guide sets it
# up): both service CIDRs, kube-dns and kube-dns-upstream RequireDualStack with both ClusterIPs,
# an EndpointSlice per family, the Node with both pod CIDRs and an address of each family,
# kube-proxy with both cluster CIDRs (its IPv6 rules in ip6tables-nft, or `table ip6
# kube-proxy`), CoreDNS on both endpoints' addresses; the API server itself on IPv4. IPVS: IPv4
# only. `down` stops every part by its recorded pid and deletes $P-cp.

readonly V4_CP_NODE=10.240.0.1 V4_APISERVER=10.240.0.2 REAL_CP_NET=10.240.0.0/30

is_real() { [[ $KUBE_PROXY == real-* ]]; }

# The parts a node with the real parts runs.
readonly REAL_PARTS=(etcd kube-apiserver kube-proxy kubectl coredns node-cache)

# The parts' directory: build.sh builds what is missing (0.1 s when cached) and fails naming the
# part that would not build. NLHA_K8S_BIN names a directory the host built instead (the ci/vm
# guest has no Go: its tests pass the host's `build.sh --bin-dir`).
real_bin() {
    local build="$SCRIPT_DIR/../ci/k8s/build.sh" out part
    if [[ -n "${NLHA_K8S_BIN:-}" ]]; then
        for part in "${REAL_PARTS[@]}"; do
            [[ -x "$NLHA_K8S_BIN/$part" ]] ||
                die "real parts: NLHA_K8S_BIN=$NLHA_K8S_BIN has no $part (build it with ci/k8s/build.sh)"
        done
        REAL_BIN=$NLHA_K8S_BIN
        return
    fi
    out=$("$build" "${REAL_PARTS[@]}" 2>&1) ||
        die "real parts: ci/k8s/build.sh failed: $(tail -n 5 <<<"$out")"
    REAL_BIN=$("$build" --bin-dir) || die "real parts: ci/k8s/build.sh --bin-dir failed"
}

# real_pki: the CA, the API server's serving certificate, the clients' certificates, the
# service-account keys and a kubeconfig per client, in $RUN_DIR/pki.
real_pki() {
    local pki="$RUN_DIR/pki" who subj
    mkdir -p "$pki"
    ossl() { openssl "$@" 2>>"$pki/openssl.log" || die "real parts: openssl $1 failed (log: $pki/openssl.log)"; }
    ossl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=simnode-$PREFIX-ca" \
        -keyout "$pki/ca.key" -out "$pki/ca.crt"
    printf '%s\n' basicConstraints=CA:FALSE keyUsage=digitalSignature,keyEncipherment \
        extendedKeyUsage=serverAuth \
        "subjectAltName=IP:$V4_APISERVER,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
        >"$pki/server.ext"
    printf 'extendedKeyUsage=clientAuth\n' >"$pki/client.ext"
    ossl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr"
    ossl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 2 -extfile "$pki/server.ext" -out "$pki/apiserver.crt"
    # admin: the tests' kubectl; kube-proxy: the user kubeadm's RBAC binds system:node-proxier
    # to; coredns: bound below to kubeadm's system:coredns role; agent: the agent's reports, a
    # user with no rights until a test grants it the manifests' (tests/e2e_cluster.rs).
    local namespace
    for who in admin kube-proxy coredns agent; do
        # The agent's client works in the namespace its pod would run in (it follows the
        # upstream Service there).
        namespace=default
        [[ $who != agent ]] || namespace=kube-system
        case $who in
        admin) subj="/O=system:masters/CN=simnode-admin" ;;
        agent) subj="/CN=nodelocaldns-ha-agent" ;;
        kube-proxy) subj="/CN=system:kube-proxy" ;;
        coredns) subj="/CN=system:coredns" ;;
        esac
        ossl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$pki/$who.key" -out "$pki/$who.csr"
        ossl x509 -req -in "$pki/$who.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
            -days 2 -extfile "$pki/client.ext" -out "$pki/$who.crt"
        cat >"$RUN_DIR/$who.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: simnode
  cluster: {server: "https://$V4_APISERVER:6443", certificate-authority: "$pki/ca.crt"}
users:
- name: $who
  user: {client-certificate: "$pki/$who.crt", client-key: "$pki/$who.key"}
contexts:
- name: simnode
  context: {cluster: simnode, user: $who, namespace: $namespace}
current-context: simnode
EOF
    done
    ossl genrsa -out "$pki/sa.key" 2048
    ossl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
}

# add_cp: the control-plane host's namespace behind the veth `cp` on the node.
add_cp() {
    local cp
    cp=$(ns_name cp)
    ip netns add "$cp"
    ip -n "$cp" link set lo up
    ip -n "$(ns_name node)" link add cp type veth peer name eth0 netns "$cp"
    ip -n "$(ns_name node)" link set cp up
    ip -n "$(ns_name node)" addr add "$V4_CP_NODE/30" dev cp
    ip -n "$cp" link set eth0 up
    ip -n "$cp" addr add "$V4_APISERVER/30" dev eth0
    ip -n "$cp" route add default via "$V4_CP_NODE" dev eth0
}

# kc ARGS...: kubectl as admin, from the node namespace.
kc() { in_ns node "$REAL_BIN/kubectl" --kubeconfig "$RUN_DIR/admin.kubeconfig" --request-timeout=10s "$@"; }

# real_wait SECONDS WHAT CMD...: wait_for, failing at once (with the log's tail) when one of the
# real parts started so far has exited.
real_wait() {
    local secs=$1 what=$2 deadline svc
    deadline=$(($(now_ms) + secs * 1000))
    shift 2
    until "$@" >/dev/null 2>&1; do
        for svc in etcd kube-apiserver kube-proxy coredns; do
            if [[ -f "$RUN_DIR/$svc.pid" ]] && ! svc_pid "$svc" >/dev/null; then
                tail -n 20 "$RUN_DIR/$svc.log" >&2
                die "real parts: $svc exited while waiting for $what (log: $RUN_DIR/$svc.log)"
            fi
        done
        (($(now_ms) < deadline)) || die "real parts: timed out after ${secs}s waiting for $what"
        sleep 0.2
    done
}

# real_dns_slice SVC 4|6: the EndpointSlice the EndpointSlice controller would write for SVC's
# CoreDNS pods in one family (there is no controller-manager here: this plays it).
real_dns_slice() {
    local svc=$1 eps=("${V4_DNS_EPS[@]}") name=$1-simnode type=IPv4
    if [[ $2 == 6 ]]; then eps=("${V6_DNS_EPS[@]}") name=$1-simnode-v6 type=IPv6; fi
    cat <<EOF
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: $name
  namespace: kube-system
  labels: {kubernetes.io/service-name: $svc, endpointslice.kubernetes.io/managed-by: simnode}
addressType: $type
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
endpoints:
- {addresses: ["${eps[0]}"], conditions: {ready: true, serving: true, terminating: false}}
- {addresses: ["${eps[1]}"], conditions: {ready: true, serving: true, terminating: false}}
EOF
}

# real_control_plane: etcd and kube-apiserver in $P-cp, ready, and the cluster's DNS objects.
real_control_plane() {
    local pki="$RUN_DIR/pki"
    svc_start etcd cp "$REAL_BIN/etcd" --name simnode --data-dir "$RUN_DIR/etcd" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster simnode=http://127.0.0.1:2380 --unsafe-no-fsync
    svc_start kube-apiserver cp "$REAL_BIN/kube-apiserver" \
        --etcd-servers=http://127.0.0.1:2379 \
        --bind-address="$V4_APISERVER" --advertise-address="$V4_APISERVER" --secure-port=6443 \
        --service-cluster-ip-range="$V4_SERVICE_CIDR$(! has_v6 || echo ",$V6_SERVICE_CIDR")" \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --client-ca-file="$pki/ca.crt" \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --authorization-mode=Node,RBAC \
        --enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,ResourceQuota \
        --allow-privileged=true --profiling=false --cert-dir="$RUN_DIR/apiserver-certs"
    real_wait 180 "kube-apiserver's /readyz" kc get --raw /readyz
    # The default Service and kube-system come from the API server's own controllers.
    real_wait 60 "namespace kube-system" kc get namespace kube-system
    local svc ip ip6 family
    {
        for svc in kube-dns kube-dns-upstream; do
            ip=$V4_CLUSTER_DNS ip6=$V6_CLUSTER_DNS
            [[ $svc == kube-dns ]] || ip=$V4_UPSTREAM ip6=$V6_UPSTREAM
            cat <<EOF
---
apiVersion: v1
kind: Service
metadata: {name: $svc, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
EOF
            if has_v6; then
                printf '  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n'
                printf '  clusterIP: %s\n  clusterIPs: [%s, "%s"]\n' "$ip" "$ip" "$ip6"
            else
                printf '  clusterIP: %s\n' "$ip"
            fi
            cat <<EOF
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
            for family in 4 6; do
                [[ $family == 4 ]] || has_v6 || continue
                real_dns_slice "$svc" "$family"
            done
        done
        # The node (kubelet would register it, and report its address: below): kube-proxy waits
        # up to 30 s for its Node object and its address before it syncs.
        cat <<EOF
---
apiVersion: v1
kind: Node
metadata: {name: $(ns_name node), labels: {kubernetes.io/hostname: $(ns_name node), kubernetes.io/os: linux}}
spec: {podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24$(! has_v6 || echo ', "fd00:244::/64"')]}
EOF
        # kubeadm's CoreDNS role and binding, for the coredns client certificate's user.
        cat <<'EOF'
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}
EOF
    } >"$RUN_DIR/cluster-dns.yaml"
    kc apply -f "$RUN_DIR/cluster-dns.yaml" >>"$RUN_DIR/kubectl.log" 2>&1 ||
        die "real parts: kubectl apply of the DNS Services failed: $(tail -n 5 "$RUN_DIR/kubectl.log")"
    # The address kubelet would report: kube-proxy waits up to 30 s for the Node to have one.
    # On a dual-stack node, an IPv6 one too (its address towards the pods: the node has no
    # other).
    local addresses="{\"type\":\"InternalIP\",\"address\":\"$V4_CP_NODE\"}"
    ! has_v6 || addresses+=",{\"type\":\"InternalIP\",\"address\":\"$V6_NODE_POD\"}"
    kc patch node "$(ns_name node)" --subresource=status --type=merge \
        -p "{\"status\":{\"addresses\":[$addresses]}}" \
        >>"$RUN_DIR/kubectl.log" 2>&1 ||
        die "real parts: kubectl patch of the Node's addresses failed: $(tail -n 5 "$RUN_DIR/kubectl.log")"
}

# kube_proxy_rules_ready: kube-proxy's rules send both Services to both endpoints: its nat table
# (iptables mode), its `table ip kube-proxy` (nftables mode), its IPVS services (IPVS mode); on a
# dual-stack node its ip6tables nat table or `table ip6 kube-proxy` too.
kube_proxy_rules_ready() {
    local rules want wants
    if [[ $KUBE_PROXY == real-ipvs ]]; then
        rules=$(in_ns node ipvsadm-save -n) || return 1
        wants=("-A -u $V4_CLUSTER_DNS:53" "-A -u $V4_UPSTREAM:53"
            "-a -u $V4_CLUSTER_DNS:53 -r ${V4_DNS_EPS[0]}:53" "-a -u $V4_CLUSTER_DNS:53 -r ${V4_DNS_EPS[1]}:53")
    elif [[ $KUBE_PROXY == real-nftables ]]; then
        rules=$(in_ns node nft list table ip kube-proxy) || return 1
        wants=("$V4_CLUSTER_DNS . udp . 53" "$V4_UPSTREAM . udp . 53"
            "${V4_DNS_EPS[0]} . 53" "${V4_DNS_EPS[1]} . 53") # numgen maps to the endpoints
        if has_v6; then
            rules+=$(in_ns node nft list table ip6 kube-proxy) || return 1
            wants+=("$V6_CLUSTER_DNS . udp . 53" "$V6_UPSTREAM . udp . 53"
                "${V6_DNS_EPS[0]} . 53" "${V6_DNS_EPS[1]} . 53")
        fi
    else
        rules=$(in_ns node "$IPT4-save" -t nat) || return 1
        wants=("-d $V4_CLUSTER_DNS/32 -p udp" "-d $V4_UPSTREAM/32 -p udp"
            "--to-destination ${V4_DNS_EPS[0]}:53" "--to-destination ${V4_DNS_EPS[1]}:53")
        if has_v6; then
            rules+=$(in_ns node "$IPT6-save" -t nat) || return 1
            wants+=("-d $V6_CLUSTER_DNS/128 -p udp" "-d $V6_UPSTREAM/128 -p udp"
                "--to-destination [${V6_DNS_EPS[0]}]:53" "--to-destination [${V6_DNS_EPS[1]}]:53")
        fi
    fi
    for want in "${wants[@]}"; do
        [[ $rules == *"$want"* ]] || return 1
    done
}

# real_kube_proxy: kube-proxy in the node namespace. Flags as kubeadm's KubeProxyConfiguration
# sets them (clusterCIDR, mode, the kubeconfig, hostname override); conntrack sysctls left alone
# (a namespace's nf_conntrack_max is read-only); metrics and healthz on the node namespace's
# loopback.
real_kube_proxy() {
    local mode=${KUBE_PROXY#real-}
    if [[ $mode == ipvs ]]; then
        # kube-proxy would only log it and fall short of rules: say it here.
        { modprobe ip_vs && modprobe ip_vs_rr; } ||
            die "--kube-proxy real-ipvs needs the ip_vs modules (this kernel: $(uname -r)); run it in the ci/vm guest"
    fi
    svc_start kube-proxy node "$REAL_BIN/kube-proxy" --proxy-mode "$mode" \
        --kubeconfig "$RUN_DIR/kube-proxy.kubeconfig" --hostname-override "$(ns_name node)" \
        --cluster-cidr "$V4_CLUSTER_CIDR$(! has_v6 || echo ",$V6_CLUSTER_CIDR")" --conntrack-max-per-core 0 \
        --metrics-bind-address 127.0.0.1:10249 --healthz-bind-address 127.0.0.1:10256 -v 2
    real_wait 60 "kube-proxy's rules for $V4_CLUSTER_DNS and $V4_UPSTREAM$(! has_v6 || echo " (and $V6_CLUSTER_DNS, $V6_UPSTREAM)")" kube_proxy_rules_ready
}

# real_busy_services N: a busy cluster, as kube-proxy sees it: N Services (namespace `busy`, TCP
# 80, ClusterIPs the API server picks) with an EndpointSlice of two ready endpoints each
# (10.245.x.y: nothing answers there; only the rules matter), created through the API by four
# kubectl at once; returns once kube-proxy's rules hold the last one.
real_busy_services() {
    local n=$1 i part
    [[ $n =~ ^[0-9]+$ ]] && ((n > 0)) || die "busy-services: N must be a positive number"
    real_bin
    mkdir -p "$RUN_DIR/busy"
    kc create namespace busy >>"$RUN_DIR/kubectl.log" 2>&1 ||
        die "real parts: kubectl create namespace busy failed: $(tail -n 5 "$RUN_DIR/kubectl.log")"
    for part in 0 1 2 3; do
        for ((i = part; i < n; i += 4)); do
            cat <<EOF
---
apiVersion: v1
kind: Service
metadata: {name: busy-$i, namespace: busy}
spec: {selector: {app: busy-$i}, ports: [{name: http, port: 80, protocol: TCP}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: busy-$i
  namespace: busy
  labels: {kubernetes.io/service-name: busy-$i, endpointslice.kubernetes.io/managed-by: simnode}
addressType: IPv4
ports: [{name: http, port: 80, protocol: TCP}]
endpoints:
- {addresses: ["10.245.$((i / 250)).$((i % 250 + 1))"], conditions: {ready: true}}
- {addresses: ["10.245.$((64 + i / 250)).$((i % 250 + 1))"], conditions: {ready: true}}
EOF
        done >"$RUN_DIR/busy/part-$part.yaml"
    done
    local pids=() failed=0
    for part in 0 1 2 3; do
        kc create -f "$RUN_DIR/busy/part-$part.yaml" >"$RUN_DIR/busy/part-$part.log" 2>&1 &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || failed=1; done
    ((!failed)) || die "real parts: creating the busy Services failed: $(grep -hv created "$RUN_DIR"/busy/part-*.log | tail -n 5)"
    local last
    last=$(kc -n busy get service "busy-$((n - 1))" -o 'jsonpath={.spec.clusterIP}') ||
        die "real parts: busy-$((n - 1)) has no ClusterIP"
    real_wait 300 "kube-proxy's rules for $n busy Services" kube_proxy_has "$last"
}

# real_prefer_same_node on|off: kube-dns as KEP-3015's PreferSameNode shapes it (GA in 1.35), or
# as real_control_plane made it. On: the Service with `trafficDistribution: PreferSameNode`; its
# EndpointSlice with the cache as a third endpoint, at the node's address (node-local-dns's pods
# are on the host network) on this node; and, playing the EndpointSlice controller, each
# endpoint hinted for its own node, as that controller hints them for PreferSameNode (CoreDNS's
# nodes are named only). Real kube-proxy then sends this node's queries for 10.96.0.10 to the
# cache while its endpoint is ready (every ready endpoint has a node hint, one is this node's)
# and to CoreDNS when it is not. cache-start binds the node's address while the state file is
# there. Returns once kube-proxy's rules say so.
real_prefer_same_node() {
    local node ready_rules file="$RUN_DIR/prefer-same-node.yaml"
    node=$(ns_name node)
    [[ $KUBE_PROXY == real-iptables && $FAMILY == 4 ]] || die "prefer-same-node is modelled for real-iptables, --family 4"
    real_bin
    case $1 in
    on)
        cat >"$file" <<EOF
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $V4_CLUSTER_DNS
  selector: {k8s-app: kube-dns}
  trafficDistribution: PreferSameNode
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-simnode
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: simnode}
addressType: IPv4
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
endpoints:
- addresses: ["${V4_DNS_EPS[0]}"]
  nodeName: dns-a
  conditions: {ready: true, serving: true, terminating: false}
  hints: {forNodes: [{name: dns-a}]}
- addresses: ["${V4_DNS_EPS[1]}"]
  nodeName: dns-b
  conditions: {ready: true, serving: true, terminating: false}
  hints: {forNodes: [{name: dns-b}]}
- addresses: ["$V4_CP_NODE"]
  nodeName: $node
  conditions: {ready: true, serving: true, terminating: false}
  hints: {forNodes: [{name: $node}]}
EOF
        kc apply -f "$file" >>"$RUN_DIR/kubectl.log" 2>&1 ||
            die "real parts: kubectl apply of PreferSameNode failed: $(tail -n 5 "$RUN_DIR/kubectl.log")"
        real_wait 60 "kube-proxy's rules to send kube-dns to the cache alone" kube_dns_endpoints 1
        touch "$RUN_DIR/prefer-same-node"
        ;;
    off)
        kc apply -f "$RUN_DIR/cluster-dns.yaml" >>"$RUN_DIR/kubectl.log" 2>&1 ||
            die "real parts: kubectl apply of the DNS Services failed: $(tail -n 5 "$RUN_DIR/kubectl.log")"
        real_wait 60 "kube-proxy's rules to send kube-dns to CoreDNS" kube_dns_endpoints 2
        rm -f "$RUN_DIR/prefer-same-node"
        ;;
    *) die "prefer-same-node: on or off" ;;
    esac
}

# kube_dns_endpoints N: kube-proxy's rules send 10.96.0.10's UDP to N endpoints: 1, the cache's
# alone (the node's address a DNAT target); 2, CoreDNS's (and the cache's not).
kube_dns_endpoints() {
    local rules svc
    rules=$(in_ns node "$IPT4-save" -t nat) || return 1
    if (($1 == 1)); then
        [[ $rules == *"--to-destination $V4_CP_NODE:53"* ]] || return 1
    else
        [[ $rules != *"--to-destination $V4_CP_NODE:53"* ]] || return 1
    fi
    svc=$(grep -oE -- "-A KUBE-SERVICES -d ${V4_CLUSTER_DNS//./\\.}/32 -p udp .* -j KUBE-SVC-[A-Z0-9]+" <<<"$rules" |
        grep -oE 'KUBE-SVC-[A-Z0-9]+$') || return 1
    (($(grep -c -- "^-A $svc .*-j KUBE-SEP-" <<<"$rules") == $1))
}

# real_cache_endpoint ready|not-ready: the cache's endpoint condition in kube-dns's EndpointSlice
# (the third endpoint: real_prefer_same_node); prints when the API server took it.
real_cache_endpoint() {
    local ready
    case $1 in
    ready) ready=true ;;
    not-ready) ready=false ;;
    *) die "cache-endpoint: ready or not-ready" ;;
    esac
    [[ -f $RUN_DIR/prefer-same-node ]] || die "cache-endpoint needs prefer-same-node on"
    # The parts are built (prefer-same-node was): their directory only, no build check, so that
    # the change goes out when it is asked for.
    REAL_BIN=${NLHA_K8S_BIN:-$("$SCRIPT_DIR/../ci/k8s/build.sh" --bin-dir)} ||
        die "real parts: ci/k8s/build.sh --bin-dir failed"
    local patch="[{\"op\":\"replace\",\"path\":\"/endpoints/2/conditions\",\"value\":{\"ready\":$ready,\"serving\":$ready,\"terminating\":false}}]"
    kc -n kube-system patch endpointslice kube-dns-simnode --type=json -p "$patch" \
        >>"$RUN_DIR/kubectl.log" 2>&1 ||
        die "real parts: patching the cache's endpoint failed: $(tail -n 5 "$RUN_DIR/kubectl.log")"
    now_ms
}

# kube_proxy_has IP: kube-proxy's rules name the Service IP (read whole: a reader cut short by
# `grep -q` would fail the pipeline).
kube_proxy_has() {
    local rules
    if [[ $KUBE_PROXY == real-ipvs ]]; then
        rules=$(in_ns node ipvsadm-save -n) || return 1
        [[ $rules == *"-A -t $1:80 "* ]]
    elif [[ $KUBE_PROXY == real-nftables ]]; then
        rules=$(in_ns node nft list map ip kube-proxy service-ips) || return 1
        [[ $rules == *"$1 . tcp . 80 "* ]]
    else
        rules=$(in_ns node "$IPT4-save" -t nat) || return 1
        [[ $rules == *"-d $1/32 -p tcp"* ]]
    fi
}

# real_churn_start RATE: the endpoint controller's churn (endpoint-churn.py), RATE EndpointSlice
# changes a second over the busy Services; returns once the first change is accepted (well under
# a second; the deadline is far past it).
real_churn_start() {
    local rate=$1 n pid deadline
    n=$(grep -c '^kind: Service$' "$RUN_DIR"/busy/part-*.yaml 2>/dev/null | awk -F: '{s += $2} END {print s + 0}')
    ((n > 0)) || die "endpoint-churn-start: no busy Services (busy-services first)"
    rm -f "$RUN_DIR/endpoint-churn.ready"
    # Debian's interpreter by its path: a version manager's `python3` on PATH (pyenv's shim)
    # execs through bash and others before Python, and the process's name changes under the
    # watch below (CI saw it: "failed to start" with nothing in the log).
    svc_start endpoint-churn node /usr/bin/python3 "$SCRIPT_DIR/simnode/endpoint-churn.py" \
        "$V4_APISERVER:6443" "$RUN_DIR/pki/ca.crt" "$RUN_DIR/pki/admin.crt" "$RUN_DIR/pki/admin.key" \
        "$n" "$rate" "$RUN_DIR/endpoint-churn.ready" "$RUN_DIR/endpoint-churn.changes"
    pid=$(<"$RUN_DIR/endpoint-churn.pid")
    deadline=$(($(now_ms) + 60000))
    until [[ -f "$RUN_DIR/endpoint-churn.ready" && "$(<"$RUN_DIR/endpoint-churn.ready")" == "$pid" ]]; do
        if ! svc_pid endpoint-churn >/dev/null; then
            local status=0
            # Our own child (a zombie until waited for, so the pid is still its): stopped,
            # whatever it runs now, and its exit status taken.
            kill -TERM "$pid" 2>/dev/null || true
            wait "$pid" || status=$?
            tail -n 5 "$RUN_DIR/endpoint-churn.log" >&2
            die "endpoint-churn exited (status $status) or changed program before its first change (log: $RUN_DIR/endpoint-churn.log)"
        fi
        if (($(now_ms) > deadline)); then
            tail -n 5 "$RUN_DIR/endpoint-churn.log" >&2
            svc_term endpoint-churn
            die "endpoint-churn: no change accepted in 60 s (log: $RUN_DIR/endpoint-churn.log)"
        fi
        sleep 0.05
    done
}

# real_kube_proxy_migrate: kube-proxy-migrate with the real parts: real kube-proxy stopped in
# iptables mode and started in nftables mode, which cleans up the iptables mode's rules itself.
real_kube_proxy_migrate() {
    [[ $KUBE_PROXY == real-iptables ]] ||
        die "kube-proxy-migrate is modelled from real-iptables only (kube-proxy runs in ${KUBE_PROXY#real-} mode)"
    real_bin
    svc_term kube-proxy
    KUBE_PROXY=real-nftables
    save_state
    echo "--- kube-proxy-migrate: nftables mode" >>"$RUN_DIR/kube-proxy.log"
    real_kube_proxy
}

# real_up: everything above, in order (from cmd_up, after the node's namespaces and veths).
real_up() {
    [[ $FAMILY == 4 || ($FAMILY == dual && $KUBE_PROXY != real-ipvs) ]] ||
        die "--kube-proxy $KUBE_PROXY is modelled for --family 4$([[ $KUBE_PROXY == real-ipvs ]] || echo " and dual") only"
    real_bin
    real_pki
    add_cp
    real_control_plane
    real_kube_proxy
}

# real_coredns_start: CoreDNS on both endpoint IPs (coredns-start in the real modes).
real_coredns_start() {
    real_bin
    local eps=("${V4_DNS_EPS[@]}")
    ! has_v6 || eps+=("${V6_DNS_EPS[@]}")
    cat >"$RUN_DIR/Corefile" <<EOF
.:53 {
    bind ${eps[*]}
    errors
    template IN A $PROBE_NAME {
        answer "{{ .Name }} 0 IN A $COREDNS_A"
    }
    template IN AAAA $PROBE_NAME {
        answer "{{ .Name }} 0 IN AAAA $COREDNS_AAAA"
    }
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $RUN_DIR/coredns.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }
}
EOF
    echo "--- coredns-start" >>"$RUN_DIR/coredns.log"
    svc_start coredns dns "$REAL_BIN/coredns" -conf "$RUN_DIR/Corefile"
    local ip
    for ip in "${eps[@]}"; do
        real_wait 30 "CoreDNS endpoint $ip" dig_answers node "$ip" "$PROBE_NAME" "$COREDNS_A"
    done
    real_wait 30 "CoreDNS through kube-proxy and the upstream Service" dig_answers node "$V4_UPSTREAM" "$PROBE_NAME" "$COREDNS_A"
    ! has_v6 || real_wait 30 "CoreDNS through kube-proxy and the upstream Service's IPv6 ClusterIP" \
        dig_answers node "$V6_UPSTREAM" "$PROBE_NAME" "$COREDNS_A"
    real_wait 30 "CoreDNS answering kubernetes.default from the API" dig_answers node "${V4_DNS_EPS[0]}" kubernetes.default.svc.cluster.local 10.96.0.1
    svc_pid coredns || die "CoreDNS exited (log: $RUN_DIR/coredns.log)"
}

# real_cache_conf SVC MODE IP...: the node-local cache, node-cache itself (kubernetes/dns, built
# by ci/k8s/build.sh from its source), for cache SVC listening on the IPs; prints the command that
# runs it. Flags as node-local-dns's DaemonSet passes them (-localip: its link-local IP and the
# ClusterIP, of the first family; -upstreamsvc kube-dns-upstream, whose ClusterIP it reads from
# KUBE_DNS_UPSTREAM_SERVICE_HOST as the kubelet sets it), with the project's changes to it
# (-setupiptables=false -skipteardown: the agent owns the rules) and the test bed's:
# -setupinterface=false where the listen IPs are on lo or on the veth that stands in for its
# dummy interface (--listen-dev: this machine's kernel has no dummy interfaces). Its base Corefile is node-local-dns's ConfigMap
# (cluster/addons/dns/nodelocaldns in kubernetes/kubernetes) filled in as the addon's
# instructions say; node-cache fills __PILLAR__CLUSTER__DNS__ with the upstream ClusterIP. The
# test bed's changes to it: who.test answered by the template plugin with 1.1.1.1 and
# fd00::1:1:1:1 (so tests see who answered, as with unbound); `.` forwarded to the upstream
# ClusterIP too (node-cache would fill __PILLAR__UPSTREAM__SERVERS__ with /etc/resolv.conf: a real
# node's resolver, here the build machine's); `bind` lists every listen IP (a dual-stack node's
# both families: node-cache's -localip takes one). cache2 (kubespray's second instance) takes
# :9255 and :8081 for its metrics and health, as kubespray's does, and :9354 for node-cache's own
# setup metrics. servfail: every question answered SERVFAIL. CACHE_BIND=wildcard (cache-start
# --bind wildcard): `bind 0.0.0.0` (and `::` on a node with IPv6) in place of the listen IPs.
real_cache_conf() {
    local svc=$1 mode=$2 base="$RUN_DIR/Corefile-base-$1" metrics=9253 health=8080 setup=9353 zone
    shift 2
    local binds="$*"
    if [[ ${CACHE_BIND:-own} == wildcard ]]; then
        binds=0.0.0.0
        ! has_v6 || binds+=" ::"
    fi
    real_bin
    if [[ $svc == cache2 ]]; then metrics=9255 health=8081 setup=9354; fi
    {
        if [[ $mode == servfail ]]; then
            printf '.:53 {\n    bind %s\n    errors\n' "$binds"
            printf '    template ANY ANY {\n        rcode SERVFAIL\n    }\n}\n'
        else
            for zone in cluster.local in-addr.arpa ip6.arpa .; do
                echo "$zone:53 {"
                echo "    errors"
                if [[ $zone == cluster.local ]]; then
                    printf '    cache {\n        success 9984 30\n        denial 9984 5\n    }\n'
                else
                    echo "    cache 30"
                fi
                printf '    reload\n    loop\n    bind %s\n' "$binds"
                if [[ $zone == . ]]; then
                    printf '    template IN A %s {\n' "$PROBE_NAME"
                    printf '        answer "{{ .Name }} 30 IN A %s"\n    }\n' "$CACHE_A"
                    printf '    template IN AAAA %s {\n' "$PROBE_NAME"
                    printf '        answer "{{ .Name }} 30 IN AAAA %s"\n    }\n' "$CACHE_AAAA"
                    echo "    forward . __PILLAR__CLUSTER__DNS__"
                else
                    printf '    forward . __PILLAR__CLUSTER__DNS__ {\n        force_tcp\n    }\n'
                fi
                echo "    prometheus :$metrics"
                if [[ $zone == cluster.local ]]; then echo "    health $V4_LOCAL_IP:$health"; fi
                echo "}"
            done
        fi
    } >"$base"
    local localip=$V4_LOCAL_IP,$V4_CLUSTER_DNS upstream=$V4_UPSTREAM interface=-setupinterface=false
    has_v4 || localip=$V6_LOCAL_IP,$V6_CLUSTER_DNS upstream=$V6_UPSTREAM
    # On node-cache's own dummy interface (--listen-dev dummy: the ci/vm guest), it sets the
    # interface up itself, as on a node (the test bed made it already: node-cache keeps it).
    [[ $LISTEN_DEV_KIND != dummy ]] || interface=-setupinterface=true
    echo "env KUBE_DNS_UPSTREAM_SERVICE_HOST=$upstream $REAL_BIN/node-cache -localip $localip" \
        "-basecorefile $base -conf $RUN_DIR/Corefile-$svc -upstreamsvc kube-dns-upstream" \
        "-health-port $health -metrics-listen-address 127.0.0.1:$setup" \
        "-setupiptables=false -skipteardown $interface"
}

# real_down: every real part by its recorded pid, CoreDNS first, etcd last; then $P-cp.
real_down() {
    local svc
    for svc in endpoint-churn coredns kube-proxy kube-apiserver etcd; do svc_term "$svc"; done
    if ns_exists cp; then
        # Anything else still in our control-plane namespace was started by us (a part whose
        # pidfile was never written): SIGKILL, by the namespace's pid list.
        local pid
        for pid in $(ip netns pids "$(ns_name cp)" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns delete "$(ns_name cp)"
    fi
}
