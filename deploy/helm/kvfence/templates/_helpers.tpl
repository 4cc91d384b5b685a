{{- define "kvfence.name" -}}kvfence{{- end -}}

{{- define "kvfence.fullname" -}}
{{- if contains "kvfence" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvfence" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfence.labels" -}}
app.kubernetes.io/name: kvfence
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
app.kubernetes.io/name: kvfence
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
