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

{{/*
rancher-flat-network's value names, read so an upgrade with its values file
keeps its settings. Each set legacy key is copied onto flatnet's key in
.Values (idempotent, so every template includes this first and the order
templates render in does not matter); a legacy key wins over flatnet's key,
since a values file only holds it when the user wrote it. Empty legacy
values (the original's defaults) leave flatnet's defaults alone. Images and
deploy.* are not mapped: the original's images cannot run flatnet's command
lines, and the operator manages its certificate itself. NOTES.txt names
every legacy key used (flatnet.legacyNotes).
*/}}
{{- define "flatnet.legacyValues" -}}
{{- $v := .Values -}}
{{- with $v.flatNetworkOperator -}}
{{- if hasKey . "replicas" -}}{{- $_ := set $v.operator "replicas" .replicas -}}{{- end -}}
{{- with .cattleResyncDefault -}}{{- $_ := set $v.operator "cattleResyncDefault" (int .) -}}{{- end -}}
{{- with .cattleDevMode -}}{{- $_ := set $v.operator "cattleDevMode" (toString .) -}}{{- end -}}
{{- with .limits -}}{{- $_ := set $v.operator.resources "limits" . -}}{{- end -}}
{{- end -}}
{{- if eq (toString $v.clusterType) "K3s" -}}
{{- $_ := set $v.agent.hostPaths "cniBin" "/var/lib/rancher/k3s/data/cni" -}}
{{- $_ := set $v.agent.hostPaths "cniConf" "/var/lib/rancher/k3s/agent/etc/cni/net.d" -}}
{{- end -}}
{{- with (($v.global).cattle).systemDefaultRegistry -}}
{{- $_ := set $v.global "imageRegistry" . -}}
{{- end -}}
{{- end -}}

{{/* NOTES.txt lines for the legacy value names in use (see flatnet.legacyValues). */}}
{{- define "flatnet.legacyNotes" -}}
{{- $v := .Values -}}
{{- $used := list -}}
{{- with $v.flatNetworkOperator -}}
{{- range $key := list "replicas" "cattleResyncDefault" "cattleDevMode" "limits" -}}
{{- if hasKey $.Values.flatNetworkOperator $key -}}
{{- $used = append $used (printf "flatNetworkOperator.%s -> operator.%s" $key (ternary "resources.limits" $key (eq $key "limits"))) -}}
{{- end -}}
{{- end -}}
{{- if hasKey . "image" -}}{{- $used = append $used "flatNetworkOperator.image: ignored, flatnet's operator image (operator.image) is used" -}}{{- end -}}
{{- end -}}
{{- if (($v.flatNetworkCNI).image) -}}{{- $used = append $used "flatNetworkCNI.image: ignored, flatnet's agent image (agent.image) installs the plugin" -}}{{- end -}}
{{- if hasKey $v "clusterType" -}}{{- $used = append $used (printf "clusterType: %s -> agent.hostPaths.cniBin/cniConf%s" (toString $v.clusterType) (ternary " (the k3s paths)" " (unchanged)" (eq (toString $v.clusterType) "K3s"))) -}}{{- end -}}
{{- if (($v.global).cattle) -}}{{- if hasKey $v.global.cattle "systemDefaultRegistry" -}}{{- $used = append $used "global.cattle.systemDefaultRegistry -> global.imageRegistry" -}}{{- end -}}{{- end -}}
{{- if hasKey $v "deploy" -}}{{- $used = append $used "deploy.*: ignored, the operator creates and rotates its webhook certificate" -}}{{- end -}}
{{- if $used }}
DEPRECATED value names of rancher-flat-network are set; they still work
this release and will be refused in a later one. Rename them (docs/upgrade.md):
{{- range $used }}
  - {{ . }}
{{- end }}
{{- end -}}
{{- end -}}
