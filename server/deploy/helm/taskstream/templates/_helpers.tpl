{{/* Names shared by the chart's templates. */}}
{{- define "taskstream.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "taskstream.headless" -}}
{{- printf "%s-headless" (include "taskstream.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "taskstream.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "taskstream.labels" -}}
{{ include "taskstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Refuses values that cannot run, with what to change. */}}
{{- define "taskstream.validate" -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.kafka.enabled) -}}
{{- fail "replicas > 1 needs kafka.enabled=true: the embedded log belongs to one instance" -}}
{{- end -}}
{{- if and .Values.kafka.enabled (not .Values.kafka.bootstrapServers) -}}
{{- fail "kafka.enabled=true needs kafka.bootstrapServers (host:port,...)" -}}
{{- end -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int .Values.drainSeconds) -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be longer than drainSeconds (%d), or pods are killed mid-drain" (int .Values.terminationGracePeriodSeconds) (int .Values.drainSeconds)) -}}
{{- end -}}
{{- end -}}
