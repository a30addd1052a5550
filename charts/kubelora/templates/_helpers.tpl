{{/* Naming helpers only: no business logic in templates (STYLE.md). */}}

{{- define "kubelora.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubelora.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kubelora.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubelora.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The selector labels as `k=v,k=v`: the operator's KUBELORA_OPERATOR_POD_LABELS (its pods, as the engine
NetworkPolicies name them). */}}
{{- define "kubelora.selectorLabelList" -}}
{{- include "kubelora.selectorLabels" . | replace ": " "=" | replace "\n" "," -}}
{{- end -}}

{{- define "kubelora.labels" -}}
{{ include "kubelora.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kubelora.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubelora.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference from {repository, tag}: `[imageRegistry/]repository:tag`, tag defaulting to appVersion.
Call with (dict "root" $ "image" .Values.engineImage). */}}
{{- define "kubelora.imageRef" -}}
{{- $ref := printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- with .root.Values.imageRegistry -}}
{{- printf "%s/%s" (trimSuffix "/" .) $ref -}}
{{- else -}}
{{- $ref -}}
{{- end -}}
{{- end -}}

{{- define "kubelora.image" -}}
{{- include "kubelora.imageRef" (dict "root" . "image" .Values.image) -}}
{{- end -}}
