{{/*
The manifest at `path` under manifests/ (files/manifests), node-local-dns's placeholders filled
as manifests/README.md fills them. Called with (list $ "path").
*/}}
{{- define "nodelocaldns-ha.manifest" -}}
{{- $ := index . 0 -}}
{{- $text := $.Files.Get (printf "files/manifests/%s" (index . 1)) -}}
{{- if not $text }}{{ fail (printf "files/manifests/%s is missing from the chart" (index . 1)) }}{{ end -}}
{{- $text | replace "__PILLAR__LOCAL__DNS__" $.Values.localIP | replace "__PILLAR__DNS__SERVER__" $.Values.clusterDNSIP | replace "__PILLAR__DNS__DOMAIN__" $.Values.dnsDomain -}}
{{- end -}}

{{/* The image as the manifests' `nodelocaldns-ha` becomes it. */}}
{{- define "nodelocaldns-ha.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
