{{/* Name of the chart, overridable with nameOverride. */}}
{{- define "flatnet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Prefix of every object name: the release name, unless it already contains
the chart name (`helm install flatnet ...` gives `flatnet-operator`, not
`flatnet-flatnet-operator`).
*/}}
{{- define "flatnet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "flatnet.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "flatnet.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "flatnet.operator.name" -}}{{ include "flatnet.fullname" . }}-operator{{- end -}}
{{- define "flatnet.agent.name" -}}{{ include "flatnet.fullname" . }}-agent{{- end -}}
{{- define "flatnet.multus.name" -}}{{ include "flatnet.fullname" . }}-multus{{- end -}}
{{- define "flatnet.webhook.service" -}}{{ include "flatnet.fullname" . }}-webhook{{- end -}}
{{- define "flatnet.webhook.secret" -}}{{ include "flatnet.fullname" . }}-webhook-tls{{- end -}}
{{/* Cluster-scoped, so the namespace is part of the name. */}}
{{- define "flatnet.webhook.configuration" -}}{{ include "flatnet.fullname" . }}-{{ .Release.Namespace }}-validating{{- end -}}

{{/* Labels on every object. */}}
{{- define "flatnet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "flatnet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flatnet
{{- end -}}

{{/* Selector labels of one component; call with (dict "ctx" . "component" "operator"). */}}
{{- define "flatnet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flatnet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of one component's objects; call like flatnet.selectorLabels. */}}
{{- define "flatnet.componentLabels" -}}
{{ include "flatnet.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
Image reference; call with (dict "ctx" . "image" .Values.operator.image).
The tag defaults to the chart's appVersion; global.imageRegistry is prepended.
*/}}
{{- define "flatnet.image" -}}
{{- $tag := .image.tag | default .ctx.Chart.AppVersion -}}
{{- $registry := .ctx.Values.global.imageRegistry -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $registry) .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "flatnet.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Settings shared by every webhook of the ValidatingWebhookConfiguration. */}}
{{- define "flatnet.webhook.common" -}}
failurePolicy: {{ .Values.operator.webhook.failurePolicy }}
sideEffects: None
timeoutSeconds: {{ .Values.operator.webhook.timeoutSeconds }}
admissionReviewVersions: [v1]
matchPolicy: Equivalent
clientConfig:
  service:
    name: {{ include "flatnet.webhook.service" . }}
    namespace: {{ .Release.Namespace }}
    path: /validate
    port: 443
{{- end -}}
