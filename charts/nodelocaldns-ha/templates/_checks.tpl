{{/*
What the install reads of the cluster (helm install, upgrade, --dry-run=server; never helm
template, which has no cluster) and refuses: an agent that would crash-loop or run uselessly
must not be `deployed`. Only reads: node-local-dns's objects are its own.

* The upstream Service: the agent takes its address from the Service's variables, which the
  kubelet sets only for Services that exist when the pod starts. Without it the agent exits 2.
* node-local-dns's DaemonSet, when there: on the host network (deliveryhero's
  config.setupIptables=false turns that off), node-cache listening on the addresses the agent
  watches (its -localip), and binding them, not 0.0.0.0 (the kernel fast path hands queries
  only to a socket bound to the address itself).
*/}}
{{- define "nodelocaldns-ha.checks" -}}
{{- $s := include "nodelocaldns-ha.settings" . | fromJson -}}
{{- if and .Values.nodeLocalDNS.check (lookup "v1" "Namespace" "" $s.namespace) -}}
{{- $off := "(or set nodeLocalDNS.check=false to install regardless)" -}}
{{- $where := printf "%s/%s" $s.namespace $s.upstreamService -}}
{{- if not (lookup "v1" "Service" $s.namespace $s.upstreamService) -}}
{{- fail (printf "\n\nService %s not found: the agent reads CoreDNS's address from it, and node-local-dns creates it (node-cache's -upstreamsvc). Install node-local-dns first (upstream's manifest: kube-dns-upstream; deliveryhero's chart: <release>-upstream; kubespray: coredns), or set nodeLocalDNS.upstreamService to the Service node-cache's -upstreamsvc names %s." $where $off) -}}
{{- end -}}
{{- $ds := lookup "apps/v1" "DaemonSet" $s.namespace $s.daemonSet -}}
{{- if $ds -}}
{{- $name := printf "DaemonSet %s/%s" $s.namespace $s.daemonSet -}}
{{- $pod := $ds.spec.template.spec -}}
{{- if not $pod.hostNetwork -}}
{{- fail (printf "\n\n%s does not run on the host network, where the agent's rules and node-cache's addresses must be (deliveryhero's chart: keep config.setupIptables=true; the args patch gives node-cache -setupiptables=false) %s." $name $off) -}}
{{- end -}}
{{- $cache := index $pod.containers 0 -}}
{{- range $pod.containers }}{{ if eq .name "node-cache" }}{{ $cache = . }}{{ end }}{{ end -}}
{{- $localip := "" -}}
{{- $args := $cache.args | default list -}}
{{- range $i, $arg := $args -}}
{{- if and (eq $arg "-localip" "--localip") (lt (add1 $i) (len $args)) }}{{ $localip = index $args (add1 $i) }}{{ end -}}
{{- if or (hasPrefix "-localip=" $arg) (hasPrefix "--localip=" $arg) }}{{ $localip = regexReplaceAll "^-+localip=" $arg "" }}{{ end -}}
{{- end -}}
{{- $watched := splitList "," $s.localIP -}}
{{- if eq $s.shape "ClusterIP" }}{{ $watched = concat $watched (splitList "," $s.clusterDNSIP) }}{{ end -}}
{{- range $watched -}}
{{- if not (has . (splitList "," $localip)) -}}
{{- fail (printf "\n\n%s: node-cache listens on -localip %q, not on %s, which the agent would probe and route to. Set localIP (and, for the ClusterIP shape, clusterDNSIP) to node-cache's, or pick the flavour that matches (nodeLocalDNS.flavor) %s." $name $localip . $off) -}}
{{- end -}}
{{- end -}}
{{- range $pod.volumes -}}
{{- $corefileVolume := false -}}
{{- if .configMap }}{{ range .configMap.items }}{{ if eq .key "Corefile" }}{{ $corefileVolume = true }}{{ end }}{{ end }}{{ end -}}
{{- if $corefileVolume -}}
{{- $cm := lookup "v1" "ConfigMap" $s.namespace .configMap.name -}}
{{- $corefile := dig "data" "Corefile" "" $cm -}}
{{- if regexMatch "(?m)^\\s*bind(\\s+\\S+)*\\s+(0\\.0\\.0\\.0|::)(\\s|$)" $corefile -}}
{{- fail (printf "\n\nConfigMap %s/%s: node-local-dns's Corefile binds the wildcard address: the agent's kernel fast path passes queries only to a socket bound to the address itself, so pods would never reach this cache. Bind its addresses (deliveryhero's chart: config.bindIp=true) %s." $s.namespace .configMap.name $off) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* For NOTES: what the install found of node-local-dns, in a line (empty under helm template). */}}
{{- define "nodelocaldns-ha.found" -}}
{{- $s := include "nodelocaldns-ha.settings" . | fromJson -}}
{{- if lookup "v1" "Namespace" "" $s.namespace -}}
{{- if lookup "apps/v1" "DaemonSet" $s.namespace $s.daemonSet -}}
Found DaemonSet {{ $s.namespace }}/{{ $s.daemonSet }} and Service {{ $s.namespace }}/{{ $s.upstreamService }}.
{{- else -}}
WARNING: no DaemonSet {{ $s.namespace }}/{{ $s.daemonSet }}: until node-local-dns runs there, the agent has no cache to route to (pods go to CoreDNS). Set nodeLocalDNS.daemonSet if it has another name.
{{- end -}}
{{- end -}}
{{- end -}}
