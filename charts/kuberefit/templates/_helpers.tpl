{{/* Chart name (nameOverride wins). */}}
{{- define "kuberefit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix: fullnameOverride, else <release>, else <release>-<chart>; at most
49 characters, so the longest suffix ("-metrics-token", 14) keeps names within 63. */}}
{{- define "kuberefit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 49 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 49 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 49 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kuberefit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object the chart renders. */}}
{{- define "kuberefit.labels" -}}
helm.sh/chart: {{ include "kuberefit.chart" . }}
{{ include "kuberefit.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kuberefit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuberefit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector of the operator pods (Deployment, Service). */}}
{{- define "kuberefit.operatorSelectorLabels" -}}
{{ include "kuberefit.selectorLabels" . }}
kuberefit.io/component: operator
{{- end -}}

{{- define "kuberefit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "kuberefit.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false (the operator's RBAC is bound to it)" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kuberefit.webhookServiceName" -}}
{{- printf "%s-webhook" (include "kuberefit.fullname" .) -}}
{{- end -}}

{{- define "kuberefit.webhookTLSSecretName" -}}
{{- printf "%s-webhook-tls" (include "kuberefit.fullname" .) -}}
{{- end -}}

{{- define "kuberefit.metricsTokenSecretName" -}}
{{- default (printf "%s-metrics-token" (include "kuberefit.fullname" .)) .Values.operator.metricsTokenSecret.name -}}
{{- end -}}

{{/* DNS names of the webhook Service: the serving certificate's SANs. */}}
{{- define "kuberefit.webhookDNSNames" -}}
{{- $svc := include "kuberefit.webhookServiceName" . -}}
{{- $ns := .Release.Namespace -}}
{{- list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) | toJson -}}
{{- end -}}

{{/*
The webhook's self-signed serving certificate, computed once per render and cached in the
shared values map (templates render separately; the TLS Secret, the caBundle and the
Deployment's checksum must agree). An existing Secret is reused when its SANs still match, so
upgrades keep the same CA (and caBundle); otherwise a new CA and certificate are generated.
Returns nothing; read the result with `get .Values "kuberefitWebhookTLSCache"`:
{data: {tls.crt, tls.key, ca.crt} (base64), sans: <sha256 of the SANs>}.
*/}}
{{- define "kuberefit.webhookTLS" -}}
{{- if not (hasKey .Values "kuberefitWebhookTLSCache") -}}
{{- $svc := include "kuberefit.webhookServiceName" . -}}
{{- $dns := include "kuberefit.webhookDNSNames" . | fromJsonArray -}}
{{- $ips := .Values.webhook.certIPs -}}
{{- $sans := toJson (dict "dns" $dns "ips" $ips) | sha256sum -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kuberefit.webhookTLSSecretName" .) -}}
{{- $old := dict -}}
{{- if $existing -}}
{{- $old = dict "tls.crt" (dig "data" "tls.crt" "" $existing) "tls.key" (dig "data" "tls.key" "" $existing) "ca.crt" (dig "data" "ca.crt" "" $existing) -}}
{{- $sameSans := eq (dig "metadata" "annotations" "kuberefit.io/cert-sans" "" $existing) $sans -}}
{{- if not (and $sameSans (get $old "tls.crt") (get $old "tls.key") (get $old "ca.crt")) -}}
{{- $old = dict -}}
{{- end -}}
{{- end -}}
{{- $data := $old -}}
{{- if not $data -}}
{{- $ca := genCA (printf "%s-webhook-ca" (include "kuberefit.fullname" .)) 3650 -}}
{{- $cert := genSignedCert $svc $ips $dns 3650 $ca -}}
{{- $data = dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" ($ca.Cert | b64enc) -}}
{{- end -}}
{{- $_ := set .Values "kuberefitWebhookTLSCache" (dict "data" $data "sans" $sans) -}}
{{- end -}}
{{- end -}}

{{/* An image reference from {repository, tag, digest}: repository@digest when a digest is
set, else repository:tag (tag defaults to the chart's appVersion). Call with (list $image $). */}}
{{- define "kuberefit.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The sidecar injection settings the webhook reads (ConfigMap key injection.json). */}}
{{- define "kuberefit.injectionJson" -}}
{{- $s := .Values.sidecar -}}
{{- $pull := list -}}
{{- range $s.imagePullSecrets }}{{ $pull = append $pull .name }}{{ end -}}
{{- dict "image" (include "kuberefit.image" (list .Values.image.sidecar .)) "imagePullPolicy" .Values.image.pullPolicy "imagePullSecrets" $pull "resources" $s.resources "ports" $s.ports "workDir" $s.workDir "shmDir" $s.shmDir "shmSizeLimit" $s.shmSizeLimit "vllmBundleDir" $s.vllmBundleDir "defaultTokenSecret" $s.defaultTokenSecret "env" $s.env "vllmContainer" $s.vllmContainer "nativeSidecars" $s.nativeSidecars "logFormat" .Values.logFormat "logLevel" .Values.logLevel | toJson -}}
{{- end -}}

{{/* Namespaces the NetworkPolicies go to. */}}
{{- define "kuberefit.networkPolicyNamespaces" -}}
{{- default (list .Release.Namespace) .Values.networkPolicies.namespaces | uniq | toJson -}}
{{- end -}}
