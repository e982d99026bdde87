{{/*
What each node-local-dns flavour is called, and where it listens, when nothing says otherwise:
  upstream      kubernetes' cluster/addons/dns/nodelocaldns/nodelocaldns.yaml
  deliveryhero  deliveryhero's node-local-dns chart, released as node-local-dns
  kubespray     kubespray's own (enable_nodelocaldns), link-local by default
*/}}
{{- define "nodelocaldns-ha.flavors" -}}
upstream:
  daemonSet: node-local-dns
  upstreamService: kube-dns-upstream
  localIP: 169.254.20.10
  shape: ClusterIP
deliveryhero:
  daemonSet: node-local-dns
  upstreamService: node-local-dns-upstream
  localIP: 169.254.20.25
  shape: ClusterIP
kubespray:
  daemonSet: nodelocaldns
  upstreamService: coredns
  localIP: 169.254.25.10
  shape: LinkLocal
{{- end -}}

{{/*
The settings, the flavour's defaults under what the values say, as JSON: include it and
fromJson. Fails on a combination that would give an agent that cannot run.
*/}}
{{- define "nodelocaldns-ha.settings" -}}
{{- $v := .Values -}}
{{- $flavors := include "nodelocaldns-ha.flavors" . | fromYaml -}}
{{- $flavor := index $flavors $v.nodeLocalDNS.flavor -}}
{{- if not $flavor }}
{{- fail (printf "nodeLocalDNS.flavor: %q is none of upstream, deliveryhero, kubespray" $v.nodeLocalDNS.flavor) }}
{{- end -}}
{{- $s := dict
  "namespace" "kube-system"
  "daemonSet" ($v.nodeLocalDNS.daemonSet | default $flavor.daemonSet)
  "upstreamService" ($v.nodeLocalDNS.upstreamService | default $flavor.upstreamService)
  "localIP" ($v.localIP | default $flavor.localIP)
  "shape" ($v.shape | default $flavor.shape)
  "clusterDNSIP" $v.clusterDNSIP
  "dnsDomain" $v.dnsDomain
-}}
{{- if not (has $s.shape (list "ClusterIP" "LinkLocal")) }}
{{- fail (printf "shape: %q is neither ClusterIP nor LinkLocal" $s.shape) }}
{{- end -}}
{{- if and (eq $s.shape "ClusterIP") (not $s.clusterDNSIP) }}
{{- fail "clusterDNSIP: the ClusterIP shape needs the kube-dns ClusterIP (kubectl -n kube-system get svc kube-dns -o jsonpath='{.spec.clusterIP}'), or set shape: LinkLocal" }}
{{- end -}}
{{- if and $v.clusterReports.startupTaint (not $v.clusterReports.enabled) }}
{{- fail "clusterReports.startupTaint needs clusterReports.enabled" }}
{{- end -}}
{{- if and $v.clusterReports.enabled $v.clusterReports.ownNodeOnly (semverCompare "<1.30.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "clusterReports.ownNodeOnly needs Kubernetes 1.30 or later (its admission policy is a ValidatingAdmissionPolicy, admissionregistration.k8s.io/v1); this cluster is %s: set clusterReports.ownNodeOnly=false (the RBAC alone then lets each agent patch every node)" .Capabilities.KubeVersion.Version) }}
{{- end -}}
{{- toJson $s -}}
{{- end -}}

{{/*
The manifest at `path` under manifests/ (files/manifests), node-local-dns's placeholders filled
as manifests/README.md fills them. Called with (list $ "path").
*/}}
{{- define "nodelocaldns-ha.manifest" -}}
{{- $ := index . 0 -}}
{{- $s := include "nodelocaldns-ha.settings" $ | fromJson -}}
{{- $text := $.Files.Get (printf "files/manifests/%s" (index . 1)) -}}
{{- if not $text }}{{ fail (printf "files/manifests/%s is missing from the chart" (index . 1)) }}{{ end -}}
{{- $text | replace "__PILLAR__LOCAL__DNS__" $s.localIP | replace "__PILLAR__DNS__SERVER__" $s.clusterDNSIP | replace "__PILLAR__DNS__DOMAIN__" $s.dnsDomain -}}
{{- end -}}

{{/*
The objects of a manifest's text (its YAML documents), each parsed, as a list. Called with the
text.
*/}}
{{- define "nodelocaldns-ha.parse" -}}
{{- $objects := list -}}
{{- range regexSplit "(?m)^---[ \t]*$" . -1 -}}
{{- $object := fromYaml . -}}
{{- if $object.kind -}}
{{- $objects = append $objects $object -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "objects" $objects) -}}
{{- end -}}

{{/* The labels Helm's own tools expect, beside each object's. */}}
{{- define "nodelocaldns-ha.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Objects out: each with the chart's labels added to its own, as YAML documents. Called with
(list $ objects).
*/}}
{{- define "nodelocaldns-ha.emit" -}}
{{- $ := index . 0 -}}
{{- $labels := include "nodelocaldns-ha.labels" $ | fromYaml -}}
{{- range index . 1 }}
---
{{- $meta := .metadata }}
{{- $_ := set $meta "labels" (merge (dict) ($meta.labels | default dict) $labels) }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The image as the manifests' `nodelocaldns-ha` becomes it: by digest when one is given. */}}
{{- define "nodelocaldns-ha.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* A container of ours as the values set it: the image, how it is pulled. */}}
{{- define "nodelocaldns-ha.pod" -}}
{{- $ := index . 0 -}}
{{- $pod := index . 1 -}}
{{- range concat ($pod.initContainers | default list) $pod.containers -}}
{{- if eq .image "nodelocaldns-ha" -}}
{{- $_ := set . "image" (include "nodelocaldns-ha.image" $) -}}
{{- $_ := set . "imagePullPolicy" $.Values.image.pullPolicy -}}
{{- end -}}
{{- end -}}
{{- with $.Values.imagePullSecrets -}}
{{- $_ := set $pod "imagePullSecrets" . -}}
{{- end -}}
{{- end -}}
