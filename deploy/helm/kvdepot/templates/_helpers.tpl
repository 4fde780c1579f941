{{/* Chart name, or nameOverride. */}}
{{- define "kvdepot.name" -}}
{{ .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object names: fullnameOverride, else the release name when it already
contains the chart name, else <release>-<chart>. */}}
{{- define "kvdepot.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{ .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains .Chart.Name .Release.Name -}}
{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}
{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kvdepot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvdepot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* part-of is "kvdepot" whatever nameOverride says: the ServiceMonitor
takes Prometheus's job label from it, and the alerts match job="kvdepot". */}}
{{- define "kvdepot.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "kvdepot.selectorLabels" . }}
app.kubernetes.io/part-of: kvdepot
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* kvdepot.yaml: the chart owns the addresses, the data dir (the volume)
and hugepages (they must match the pod's resources); the rest is
.Values.config. */}}
{{- define "kvdepot.config" -}}
listen: {{ printf "%s:%v" .Values.listenHost .Values.ports.grpc | quote }}
metrics_listen: {{ printf "%s:%v" .Values.listenHost .Values.ports.metrics | quote }}
data_dir: /var/lib/kvdepot
{{- if .Values.hugepages.enabled }}
hugepages: "on"
{{- else }}
hugepages: "off"
{{- end }}
{{ toYaml .Values.config }}
{{- end }}
