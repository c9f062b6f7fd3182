{{/* The labels of every object, and the selector's subset of them. */}}
{{- define "hutch.selector" -}}
app.kubernetes.io/name: hutch
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
{{- define "hutch.labels" -}}
{{ include "hutch.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
