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

{{/* Render-time checks: a value that would only make kvdepotd exit at start
(a crash loop) fails `helm install` instead, with the reason. */}}
{{- define "kvdepot.checks" -}}
{{- if hasKey .Values.config "listen" }}{{ include "kvdepot.chartOwned" "listen (set ports.grpc and listenHost)" }}{{ end -}}
{{- if hasKey .Values.config "metrics_listen" }}{{ include "kvdepot.chartOwned" "metrics_listen (set ports.metrics and listenHost)" }}{{ end -}}
{{- if hasKey .Values.config "data_dir" }}{{ include "kvdepot.chartOwned" "data_dir (the volume is mounted at /var/lib/kvdepot)" }}{{ end -}}
{{- if hasKey .Values.config "hugepages" }}{{ include "kvdepot.chartOwned" "hugepages (set hugepages.enabled)" }}{{ end -}}
{{- include "kvdepot.checkMemory" . -}}
{{- include "kvdepot.checkVolume" . -}}
{{- end }}

{{- define "kvdepot.chartOwned" -}}
{{- fail (printf "kvdepot: config.%s is set by the chart; remove it from config" .) -}}
{{- end }}

{{/* The pod's memory must hold what kvdepotd takes (values.yaml,
resources): without hugepages the DRAM tier (prefaulted, resident from the
start) + grpc_memory_limit + 1 GiB for RocksDB and the index; with them,
hugepages.size must cover the DRAM tier and the memory limit the rest.
kvdepotd itself refuses a DRAM tier its cgroup cannot hold, but only once
the pod has started. No memory limit: only the hugepages are checked. */}}
{{- define "kvdepot.checkMemory" -}}
{{- if .Values.hugepages.enabled -}}
{{- if lt (include "kvdepot.k8sBytes" (include "kvdepot.str" .Values.hugepages.size) | int64) (include "kvdepot.configBytes" (include "kvdepot.dram" .) | int64) -}}
{{- fail (printf "kvdepot: hugepages.size %s is less than config.dram_capacity %s" (include "kvdepot.str" .Values.hugepages.size) (include "kvdepot.dram" .)) -}}
{{- end -}}
{{- end -}}
{{- if include "kvdepot.memoryLimit" . -}}
{{- if .Values.hugepages.enabled -}}
{{- if lt (include "kvdepot.k8sBytes" (include "kvdepot.memoryLimit" .) | int64) (add (include "kvdepot.configBytes" (include "kvdepot.grpcLimit" .)) 1073741824) -}}
{{- fail (printf "kvdepot: resources.limits.memory %s is less than config.grpc_memory_limit %s + 1Gi (RocksDB and the index)" (include "kvdepot.memoryLimit" .) (include "kvdepot.grpcLimit" .)) -}}
{{- end -}}
{{- else if lt (include "kvdepot.k8sBytes" (include "kvdepot.memoryLimit" .) | int64) (add (include "kvdepot.configBytes" (include "kvdepot.dram" .)) (include "kvdepot.configBytes" (include "kvdepot.grpcLimit" .)) 1073741824) -}}
{{- fail (printf "kvdepot: resources.limits.memory %s is less than config.dram_capacity %s + config.grpc_memory_limit %s + 1Gi (RocksDB and the index): kvdepotd would refuse to start or be OOM-killed" (include "kvdepot.memoryLimit" .) (include "kvdepot.dram" .) (include "kvdepot.grpcLimit" .)) -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The NVMe tier's volume must hold its files: up to about 1.25x
config.nvme_capacity (replaced and evicted blocks wait in blob files for
garbage collection) plus the 256 MiB the tier leaves free on its
filesystem (README.md, nvme_capacity). Smaller, the tier fills the volume
and stops taking writes. values.yaml's 1.5x leaves room above that.
Without persistence (an emptyDir) or without the tier (0) there is no size
to check. */}}
{{- define "kvdepot.checkVolume" -}}
{{- if .Values.persistence.enabled -}}
{{- if ne (include "kvdepot.configBytes" (include "kvdepot.nvme" .) | int64) 0 -}}
{{- if lt (include "kvdepot.k8sBytes" (include "kvdepot.str" .Values.persistence.size) | int64) (add (div (mul (include "kvdepot.configBytes" (include "kvdepot.nvme" .)) 5) 4) 268435456) -}}
{{- fail (printf "kvdepot: persistence.size %s is less than config.nvme_capacity %s x 1.25 + 256Mi (the NVMe tier's files before garbage collection, and the room it leaves free): the tier would fill the volume; make it about 1.5x nvme_capacity" (include "kvdepot.str" .Values.persistence.size) (include "kvdepot.nvme" .)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* A value as text: YAML numbers are float64 in Helm, which toString would
print as 1.073741824e+09; whole digits instead. */}}
{{- define "kvdepot.str" -}}
{{- if kindIs "float64" . }}{{ int64 . }}{{ else }}{{ toString . }}{{ end -}}
{{- end }}

{{/* resources.limits.memory as text; empty when there is none (limits
absent or null too). */}}
{{- define "kvdepot.memoryLimit" -}}
{{- with .Values.resources.limits }}{{ with .memory }}{{ include "kvdepot.str" . }}{{ end }}{{ end -}}
{{- end }}

{{/* config.dram_capacity, config.nvme_capacity and config.grpc_memory_limit
as text, kvdepotd's defaults when not set. */}}
{{- define "kvdepot.dram" -}}
{{- if hasKey .Values.config "dram_capacity" }}{{ include "kvdepot.str" .Values.config.dram_capacity }}{{ else }}1GiB{{ end -}}
{{- end }}
{{- define "kvdepot.nvme" -}}
{{- if hasKey .Values.config "nvme_capacity" }}{{ include "kvdepot.str" .Values.config.nvme_capacity }}{{ else }}8GiB{{ end -}}
{{- end }}
{{- define "kvdepot.grpcLimit" -}}
{{- if hasKey .Values.config "grpc_memory_limit" }}{{ include "kvdepot.str" .Values.config.grpc_memory_limit }}{{ else }}1GiB{{ end -}}
{{- end }}

{{/* Bytes of a kvdepot.yaml size as the chart reads it: a number (to three
decimals) and one of kvdepotd's units, any case (B; KiB, MiB, GiB, TiB and
K, M, G, T: powers of 1024; KB, MB, GB, TB: of 1000), e.g. 64GiB, 1.5GiB. */}}
{{- define "kvdepot.configBytes" -}}
{{- if not (regexMatch "^(0|[1-9][0-9]*)([.][0-9]+)? *[A-Za-z]*$" .) -}}
{{- fail (printf "kvdepot: cannot read the size %q: the chart takes a number and a unit, e.g. 64GiB" .) -}}
{{- end -}}
{{- include "kvdepot.scaled" (printf "%s %s" (regexFind "^[0-9.]+" .) (include "kvdepot.configUnit" (lower (trimPrefix (regexFind "^[0-9.]+ *" .) .)))) -}}
{{- end }}

{{/* "N[.F] U": N x U + 0.F x U to three decimals, in whole bytes. Numbers are
read by Sprig's toInt64, which takes a leading 0 as octal: hence the 1 in
front of the decimals (1FFF - 1000). */}}
{{- define "kvdepot.scaled" -}}
{{- add (mul (regexFind "^[0-9]+" .) (regexFind "[0-9]+$" .)) (div (mul (sub (printf "1%s" (trunc 3 (printf "%s000" (trimPrefix "." (regexFind "[.][0-9]+" .))))) 1000) (regexFind "[0-9]+$" .)) 1000) -}}
{{- end }}

{{- define "kvdepot.configUnit" -}}
{{- if or (eq . "") (eq . "b") }}1
{{- else if or (eq . "k") (eq . "kib") }}1024
{{- else if or (eq . "m") (eq . "mib") }}1048576
{{- else if or (eq . "g") (eq . "gib") }}1073741824
{{- else if or (eq . "t") (eq . "tib") }}1099511627776
{{- else if eq . "kb" }}1000
{{- else if eq . "mb" }}1000000
{{- else if eq . "gb" }}1000000000
{{- else if eq . "tb" }}1000000000000
{{- else }}{{ fail (printf "kvdepot: unknown size unit %q (use B, KiB, MiB, GiB, TiB)" .) }}
{{- end }}
{{- end }}

{{/* Bytes of a Kubernetes quantity as the chart reads it: a number (to three
decimals) and a suffix (Ki, Mi, Gi, Ti, Pi: powers of 1024; k, M, G, T, P:
of 1000), e.g. 72Gi or 1.5Gi. */}}
{{- define "kvdepot.k8sBytes" -}}
{{- if not (regexMatch "^(0|[1-9][0-9]*)([.][0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$" .) -}}
{{- fail (printf "kvdepot: cannot read the quantity %q: the chart takes a number and a suffix, e.g. 72Gi" .) -}}
{{- end -}}
{{- include "kvdepot.scaled" (printf "%s %s" (regexFind "^[0-9.]+" .) (include "kvdepot.k8sUnit" (trimPrefix (regexFind "^[0-9.]+" .) .))) -}}
{{- end }}

{{- define "kvdepot.k8sUnit" -}}
{{- if eq . "" }}1
{{- else if eq . "Ki" }}1024
{{- else if eq . "Mi" }}1048576
{{- else if eq . "Gi" }}1073741824
{{- else if eq . "Ti" }}1099511627776
{{- else if eq . "Pi" }}1125899906842624
{{- else if eq . "k" }}1000
{{- else if eq . "M" }}1000000
{{- else if eq . "G" }}1000000000
{{- else if eq . "T" }}1000000000000
{{- else }}1000000000000000
{{- end }}
{{- end }}
