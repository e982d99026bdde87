# shellcheck shell=bash
# realnode add-ons: the cluster's DNS as a kubeadm cluster runs it, applied through the API and
# run by the kubelet: kube-proxy (DaemonSet), CoreDNS (Deployment, Service kube-dns), node-local-
# dns (upstream's manifest), and the clients' Deployment. The test bed's changes to what a
# cluster has are marked "test bed:" below.

# kube_proxy_yaml: kubeadm's kube-proxy add-on (its ConfigMap, DaemonSet, ServiceAccount and
# the binding to system:node-proxier), in $KUBE_PROXY mode.
kube_proxy_yaml() {
    cat <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-proxy, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubeadm:node-proxier"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node-proxier"}
subjects: [{kind: ServiceAccount, name: kube-proxy, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-proxy, namespace: kube-system, labels: {app: kube-proxy}}
data:
  config.conf: |
    apiVersion: kubeproxy.config.k8s.io/v1alpha1
    kind: KubeProxyConfiguration
    clientConnection: {kubeconfig: /var/lib/kube-proxy/kubeconfig.conf}
    clusterCIDR: $CLUSTER_CIDR
    mode: $KUBE_PROXY
    # test bed: a network namespace's nf_conntrack_max is read-only; leave it alone.
    conntrack: {maxPerCore: 0}
  kubeconfig.conf: |
    apiVersion: v1
    kind: Config
    clusters:
    - cluster:
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
        server: https://$V4_APISERVER:6443
      name: default
    contexts:
    - context: {cluster: default, namespace: default, user: default}
      name: default
    current-context: default
    users:
    - name: default
      user: {tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-proxy, namespace: kube-system, labels: {k8s-app: kube-proxy}}
spec:
  selector: {matchLabels: {k8s-app: kube-proxy}}
  updateStrategy: {type: RollingUpdate}
  template:
    metadata: {labels: {k8s-app: kube-proxy}}
    spec:
      priorityClassName: system-node-critical
      serviceAccountName: kube-proxy
      hostNetwork: true
      nodeSelector: {kubernetes.io/os: linux}
      tolerations: [{operator: Exists}]
      containers:
      - name: kube-proxy
        image: $IMAGE_KUBE_PROXY
        imagePullPolicy: Never
        command: [/usr/local/bin/kube-proxy, --config=/var/lib/kube-proxy/config.conf, "--hostname-override=\$(NODE_NAME)"]
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        securityContext: {privileged: true}
        volumeMounts:
        - {mountPath: /var/lib/kube-proxy, name: kube-proxy}
        - {mountPath: /run/xtables.lock, name: xtables-lock}
        - {mountPath: /lib/modules, name: lib-modules, readOnly: true}
      volumes:
      - name: kube-proxy
        configMap: {name: kube-proxy}
      - name: xtables-lock
        hostPath: {path: /run/xtables.lock, type: FileOrCreate}
      - name: lib-modules
        hostPath: {path: /lib/modules}
EOF
}

# coredns_yaml: kubeadm's CoreDNS add-on (two replicas, its Corefile, RBAC, Service kube-dns at
# the kubelet's clusterDNS).
coredns_yaml() {
    cat <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
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
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health {
           lameduck 5s
        }
        ready
        # test bed: who.test says who answered (CoreDNS: 2.2.2.2).
        template IN A $PROBE_NAME {
            answer "{{ .Name }} 0 IN A $COREDNS_A"
        }
        kubernetes cluster.local in-addr.arpa ip6.arpa {
           pods insecure
           fallthrough in-addr.arpa ip6.arpa
           ttl 30
        }
        prometheus :9153
        forward . /etc/resolv.conf {
           max_concurrent 1000
        }
        cache 30 {
           disable success cluster.local
           disable denial cluster.local
        }
        loop
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 2
  strategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 1}}
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      priorityClassName: system-cluster-critical
      serviceAccountName: coredns
      # test bed: and the agent's startup taint, which kubeadm's CoreDNS does not tolerate: a
      # cluster runs CoreDNS on its other nodes while a new one waits for its DNS; this one
      # has no other.
      tolerations: [{key: CriticalAddonsOnly, operator: Exists}, {key: node-role.kubernetes.io/control-plane, effect: NoSchedule},
        {key: nodelocaldns-ha.io/dns-not-ready, operator: Exists, effect: NoSchedule}]
      nodeSelector: {kubernetes.io/os: linux}
      containers:
      - name: coredns
        image: $IMAGE_COREDNS
        imagePullPolicy: Never
        args: [-conf, /etc/coredns/Corefile]
        resources:
          limits: {memory: 170Mi}
          requests: {cpu: 100m, memory: 70Mi}
        volumeMounts: [{name: config-volume, mountPath: /etc/coredns, readOnly: true}]
        ports:
        - {containerPort: 53, name: dns, protocol: UDP}
        - {containerPort: 53, name: dns-tcp, protocol: TCP}
        - {containerPort: 9153, name: metrics, protocol: TCP}
        livenessProbe:
          httpGet: {path: /health, port: 8080, scheme: HTTP}
          initialDelaySeconds: 60
          timeoutSeconds: 5
          successThreshold: 1
          failureThreshold: 5
        readinessProbe:
          httpGet: {path: /ready, port: 8181, scheme: HTTP}
          periodSeconds: 2
        securityContext:
          allowPrivilegeEscalation: false
          capabilities: {add: [NET_BIND_SERVICE], drop: [ALL]}
          readOnlyRootFilesystem: true
      dnsPolicy: Default
      volumes:
      - name: config-volume
        configMap:
          name: coredns
          items: [{key: Corefile, path: Corefile}]
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/cluster-service: "true", kubernetes.io/name: CoreDNS}
  annotations: {prometheus.io/port: "9153", prometheus.io/scrape: "true"}
spec:
  selector: {k8s-app: kube-dns}
  clusterIP: $CLUSTER_DNS
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
  - {name: metrics, port: 9153, protocol: TCP}
EOF
}

# node_local_dns_stock: upstream's node-local-dns manifest, as the pinned Kubernetes module has
# it (cluster/addons/dns/nodelocaldns/nodelocaldns.yaml), from the Go module cache.
node_local_dns_stock() {
    local dir
    dir=$(cd "$REPO/ci/k8s/kubernetes" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$(k8s_version)" |
        awk -F'"' '$2 == "Dir" { print $4 }') || die "go mod download k8s.io/kubernetes failed"
    [[ -f $dir/cluster/addons/dns/nodelocaldns/nodelocaldns.yaml ]] ||
        die "no cluster/addons/dns/nodelocaldns/nodelocaldns.yaml in $dir"
    echo "$dir/cluster/addons/dns/nodelocaldns/nodelocaldns.yaml"
}
k8s_version() { (. "$REPO/ci/k8s/versions.env" && echo "$K8S_VERSION"); }

# node_local_dns_yaml: that manifest with its placeholders filled as the addon's documentation
# says (the link-local IP, kube-dns's ClusterIP, the domain), and the test bed's changes: the
# local image, never pulled; -setupinterface=false (this kernel has no dummy interfaces: the
# listen IPs are on the node's lo, namespaces_add); who.test answered 1.1.1.1 by the cache.
node_local_dns_yaml() {
    local stock
    stock=$(node_local_dns_stock)
    sed -e "s/__PILLAR__LOCAL__DNS__/$LOCAL_IP/g" -e "s/__PILLAR__DNS__SERVER__/$CLUSTER_DNS/g" \
        -e "s/__PILLAR__DNS__DOMAIN__/cluster.local/g" \
        -e "s|image: registry.k8s.io/dns/k8s-dns-node-cache:.*|image: $IMAGE_NODE_CACHE\n        imagePullPolicy: Never|" \
        -e 's|"-upstreamsvc", "kube-dns-upstream" \]|"-upstreamsvc", "kube-dns-upstream", "-setupinterface=false" ]|' \
        -e "s|^    \.:53 {$|    .:53 {\n        # test bed: who.test says who answered (node-local-dns: 1.1.1.1).\n        template IN A $PROBE_NAME {\n            answer \"{{ .Name }} 30 IN A $CACHE_A\"\n        }|" \
        "$stock"
}

# client_yaml: the pods whose DNS the tests count: a Deployment of the client image, its
# resolv.conf the kubelet's (dnsPolicy ClusterFirst).
client_yaml() {
    cat <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: dns-client, namespace: default, labels: {app: dns-client}}
spec:
  replicas: 2
  selector: {matchLabels: {app: dns-client}}
  template:
    metadata: {labels: {app: dns-client}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: client
        image: $IMAGE_CLIENT
        imagePullPolicy: Never
        resources: {requests: {cpu: 10m, memory: 16Mi}}
EOF
}

# kube_proxy_rules_ready IP...: kube-proxy's rules send each Service IP's port somewhere.
kube_proxy_rules_ready() {
    local rules ip
    if [[ $KUBE_PROXY == nftables ]]; then
        rules=$(in_node nft list map ip kube-proxy service-ips) || return 1
        for ip; do [[ $rules == *"$ip . "* ]] || return 1; done
    else
        rules=$(in_node iptables-nft-save -t nat) || return 1
        for ip; do [[ $rules == *"-A KUBE-SERVICES -d $ip/32 "* ]] || return 1; done
    fi
}

# rollout_done KIND/NAME NAMESPACE: every replica updated and ready.
rollout_done() { kc -n "$2" rollout status "$1" --timeout=1s; }

# answers SERVER WANT: the node asks SERVER for who.test and gets WANT.
answers() { [[ "$(in_node dig +short +time=1 +tries=1 "@$1" "$PROBE_NAME")" == "$2" ]]; }

# client_answered: a client pod's getaddrinfo() of who.test, through its resolv.conf, answered.
client_answered() {
    kc exec deploy/dns-client -- /usr/local/bin/dnsload --system-resolver --name "$PROBE_NAME" \
        --rate 1 --duration 1s --origin "$CACHE_A=cache" --origin "$COREDNS_A=coredns" 2>&1 |
        grep -q '"ok":1,'
}

addons_apply() {
    local out
    # kube-proxy first, and its rules for the `kubernetes` Service in before any pod asks for it:
    # a pod's first SYN to 10.96.0.1 sent before them would leave a conntrack entry without NAT
    # that its retransmissions follow for half a minute (CoreDNS would wait that long for the API).
    kube_proxy_yaml >"$RUN_DIR/kube-proxy.yaml"
    out=$(kc apply -f "$RUN_DIR/kube-proxy.yaml" 2>&1) || die "kubectl apply of kube-proxy failed: $out"
    echo "$out" >>"$RUN_DIR/log/kubectl.log"
    wait_for 120 "kube-proxy's rules for the kubernetes Service" kube_proxy_rules_ready 10.96.0.1
    step "kube-proxy's rules in"
    # The upstream Service (kube-dns-upstream) comes with node-local-dns's manifest and must be
    # there before node-cache starts (it reads the ClusterIP from its environment once): the
    # manifest's own order. Its ClusterIP is pinned so that the tests know it.
    { coredns_yaml; echo ---; node_local_dns_yaml | upstream_ip_pinned; echo ---; client_yaml; } >"$RUN_DIR/addons.yaml"
    out=$(kc apply -f "$RUN_DIR/addons.yaml" 2>&1) || die "kubectl apply of the add-ons failed: $out"
    echo "$out" >>"$RUN_DIR/log/kubectl.log"
    wait_for 180 "CoreDNS's Deployment" rollout_done deployment/coredns kube-system
    wait_for 60 "kube-proxy's rules for kube-dns and kube-dns-upstream" kube_proxy_rules_ready "$CLUSTER_DNS" "$UPSTREAM_IP"
    wait_for 60 "CoreDNS through kube-dns-upstream" answers "$UPSTREAM_IP" "$COREDNS_A"
    step "CoreDNS answering through kube-dns-upstream"
    wait_for 120 "node-local-dns's DaemonSet" rollout_done daemonset/node-local-dns kube-system
    wait_for 60 "node-cache on $LOCAL_IP" answers "$LOCAL_IP" "$CACHE_A"
    step "node-cache answering on $LOCAL_IP"
    wait_for 120 "the clients' Deployment" rollout_done deployment/dns-client default
    # By CoreDNS at first: node-cache, as upstream's manifest runs it (no -pidfile), puts its
    # NOTRACK rules in only at its first -syncinterval, a minute after it started.
    wait_for 60 "a client pod answered" client_answered
}

# upstream_ip_pinned: kube-dns-upstream's ClusterIP set to $UPSTREAM_IP (the manifest lets the
# API server pick one).
upstream_ip_pinned() {
    awk -v ip="$UPSTREAM_IP" '
        /^kind: Service$/ { svc = 1 }
        /^---/ { svc = 0; upstream = 0 }
        svc && /^  name: kube-dns-upstream$/ { upstream = 1 }
        { print }
        upstream && /^spec:$/ { print "  clusterIP: " ip; upstream = 0 }'
}

# node_local_dns_patch IMAGE: the changes the project asks of node-local-dns
# (manifests/node-local-dns), made to the cluster's own DaemonSet as an operator makes them: its
# strategic-merge patch (the drain client copied from the agent's image IMAGE, the preStop hook,
# the agent's state directory) and its JSON patch (node-cache's -setupiptables=false and
# -skipteardown); waits for the rollout.
node_local_dns_patch() {
    local patches=$REPO/manifests/node-local-dns out
    sed "s|image: nodelocaldns-ha$|image: $1|" "$patches/drain.yaml" >"$RUN_DIR/drain.yaml"
    grep -qF "image: $1" "$RUN_DIR/drain.yaml" || die "drain.yaml names no image nodelocaldns-ha"
    out=$(kc -n kube-system patch daemonset node-local-dns --type=strategic \
        --patch-file "$RUN_DIR/drain.yaml" 2>&1) || die "patching node-local-dns failed: $out"
    out=$(kc -n kube-system patch daemonset node-local-dns --type=json \
        --patch-file "$patches/args.yaml" 2>&1) || die "patching node-cache's args failed: $out"
    wait_for 180 "node-local-dns's rollout" rollout_done daemonset/node-local-dns kube-system
}

# webhook_install IMAGE: the admission webhook as manifests/README.md installs it on a cluster
# without cert-manager: the component's Namespace, Deployment, Service and
# MutatingWebhookConfiguration (kustomize, its placeholders filled, IMAGE for `nodelocaldns-ha`),
# a serving certificate made with openssl for the Service's name, put in the Secret the
# Deployment mounts, its CA in the configuration's caBundle; waits for the Deployment.
webhook_install() {
    local dir=$RUN_DIR/webhook out f i patch=""
    mkdir -p "$dir"
    for f in namespace.yaml deployment.yaml mutatingwebhookconfiguration.yaml; do
        cp "$REPO/manifests/webhook/$f" "$dir/"
    done
    cat >"$dir/kustomization.yaml" <<EOF
resources: [namespace.yaml, deployment.yaml, mutatingwebhookconfiguration.yaml]
images:
- {name: nodelocaldns-ha, newName: ${1%:*}, newTag: "${1##*:}"}
EOF
    kc kustomize "$dir" | sed -e "s/__PILLAR__LOCAL__DNS__/$LOCAL_IP/g" -e "s/__PILLAR__DNS__SERVER__/$CLUSTER_DNS/g" \
        -e "s/__PILLAR__DNS__DOMAIN__/cluster.local/g" >"$dir/webhook.yaml" || die "kubectl kustomize of the webhook failed"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj /CN=nodelocaldns-ha-webhook \
        -addext subjectAltName=DNS:nodelocaldns-ha-webhook.nodelocaldns-ha.svc \
        -keyout "$dir/tls.key" -out "$dir/tls.crt" 2>>"$dir/openssl.log" || die "openssl failed (log: $dir/openssl.log)"
    out=$(kc apply -f "$dir/webhook.yaml" 2>&1) || die "kubectl apply of the webhook failed: $out"
    out=$(kc -n nodelocaldns-ha create secret tls nodelocaldns-ha-webhook-tls --cert "$dir/tls.crt" \
        --key "$dir/tls.key" 2>&1) || die "creating the webhook's Secret failed: $out"
    for i in 0 1 2; do
        patch+="${patch:+,}{\"op\":\"add\",\"path\":\"/webhooks/$i/clientConfig/caBundle\",\"value\":\"$(base64 -w0 "$dir/tls.crt")\"}"
    done
    out=$(kc patch mutatingwebhookconfiguration nodelocaldns-ha-webhook --type json -p "[$patch]" 2>&1) ||
        die "patching the webhook's caBundle failed: $out"
    wait_for 120 "the webhook's Deployment" rollout_done deployment/nodelocaldns-ha-webhook nodelocaldns-ha
}
