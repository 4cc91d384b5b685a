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
