{{/* The chart's name: "kvfence", or nameOverride (also the app.kubernetes.io/name label). */}}
{{- define "kvfence.name" -}}
{{- .Values.nameOverride | default "kvfence" | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' name prefix (40 characters leave room for "-control-headless"
and the StatefulSet's pod and claim names): fullnameOverride, else the release
name when it contains the chart's name, else <release>-<name>. */}}
{{- define "kvfence.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "kvfence.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvfence.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfence.labels" -}}
app.kubernetes.io/name: {{ include "kvfence.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfence
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- if include "kvfence.insecure" . }}
kvfence.io/insecure: "true"
{{- end }}
{{- end -}}

{{- define "kvfence.selector" -}}
app.kubernetes.io/name: {{ include "kvfence.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvfence.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "kvfence.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "kvfence.fullname" .) }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}

{{/* The control plane's client Service, as nodes and clients dial it. */}}
{{- define "kvfence.controlAddress" -}}
{{ include "kvfence.fullname" . }}-control.{{ .Release.Namespace }}.svc:{{ .Values.controlPlane.grpcPort }}
{{- end -}}

{{/* "true" when the gRPC port does not verify its callers (no TLS, or TLS without client certificates). */}}
{{- define "kvfence.insecure" -}}
{{- if not (and .Values.tls.enabled .Values.tls.mutual) -}}true{{- end -}}
{{- end -}}

{{/* Refuses plaintext unless insecure: true says it is meant; checks the node identity against the TLS setup. */}}
{{- define "kvfence.checkValues" -}}
{{- if and (include "kvfence.insecure" .) (not .Values.tls.insecure) -}}
{{- fail "tls.enabled=false or tls.mutual=false leaves kvfence-control's gRPC port open to anyone who reaches it (any node's reports, Admin): set tls.insecure=true to run it that way anyway, for a test cluster only (deploy/README.md, \"TLS\")" -}}
{{- end -}}
{{- if ne .Values.store.type "embedded" -}}
{{- fail (printf "store.type=%s: only the embedded store exists (the etcd store is not implemented yet)" .Values.store.type) -}}
{{- end -}}
{{- if and .Values.tls.enabled .Values.tls.mutual (eq .Values.node.identity "podName") (not .Values.tls.certManager.enabled) -}}
{{- fail "node.identity=podName takes each node pod's certificate from cert-manager's csi-driver: it needs tls.certManager.enabled=true (or node.identity=nodeName with certificates in node.tlsHostPath)" -}}
{{- end -}}
{{- end -}}

{{/* The Issuer or ClusterIssuer that signs the kvfence certificates. */}}
{{- define "kvfence.issuerRef" -}}
{{- $i := .Values.tls.certManager.issuer -}}
{{- if $i.create -}}
name: {{ include "kvfence.fullname" . }}-ca
kind: Issuer
{{- else -}}
name: {{ required "tls.certManager.issuer.name: the Issuer or ClusterIssuer that signs kvfence's certificates (or issuer.create=true)" $i.name }}
kind: {{ $i.kind }}
{{- end }}
group: cert-manager.io
{{- end -}}

{{/* A pod's labels: the chart's, its component, then podLabels (which cannot
replace the chart's own: the selectors use them). Call with (list $ component). */}}
{{- define "kvfence.podLabels" -}}
{{- $ctx := index . 0 -}}
{{- $own := include "kvfence.labels" $ctx | fromYaml -}}
{{- $_ := set $own "app.kubernetes.io/component" (index . 1) -}}
{{- toYaml (merge $own (deepCopy $ctx.Values.podLabels)) -}}
{{- end -}}

{{/* A pod's annotations: the chart's own (a dict; they win) and podAnnotations.
Call with (list $ dict); empty when there are none. */}}
{{- define "kvfence.podAnnotations" -}}
{{- $all := merge (index . 1) (deepCopy (index . 0).Values.podAnnotations) -}}
{{- if $all }}{{ toYaml $all }}{{ end -}}
{{- end -}}
