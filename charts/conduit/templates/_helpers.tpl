{{/* Names, labels and the addresses the components use to find each other. */}}

{{- define "conduit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release; components append -engine, -gateway, -envoy (so it stays under 45 chars). */}}
{{- define "conduit.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "conduit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "conduit.labels" -}}
helm.sh/chart: {{ include "conduit.chart" . }}
app.kubernetes.io/name: {{ include "conduit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: conduit
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "component" "engine"). */}}
{{- define "conduit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "conduit.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "conduit.componentLabels" -}}
{{ include "conduit.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "conduit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "conduit.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference: call with (dict "root" $ "image" .Values.engine.image). */}}
{{- define "conduit.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "conduit.engine.fullname" -}}
{{- printf "%s-engine" (include "conduit.fullname" .) }}
{{- end }}

{{- define "conduit.engine.headlessName" -}}
{{- printf "%s-engine-headless" (include "conduit.fullname" .) }}
{{- end }}

{{- define "conduit.gateway.fullname" -}}
{{- printf "%s-gateway" (include "conduit.fullname" .) }}
{{- end }}

{{- define "conduit.envoy.fullname" -}}
{{- printf "%s-envoy" (include "conduit.fullname" .) }}
{{- end }}

{{/* The engine pools, space-separated: "engine", or with disaggregation.enabled "prefill decode". */}}
{{- define "conduit.engine.pools" -}}
{{- ternary "prefill decode" "engine" .Values.disaggregation.enabled }}
{{- end }}

{{/* The pool internal gRPC clients and Envoy reach (decode engines also serve whole requests). */}}
{{- define "conduit.engine.clientPool" -}}
{{- ternary "decode" "engine" .Values.disaggregation.enabled }}
{{- end }}

{{/* Names of one pool's StatefulSet and headless Service: call with (dict "root" $ "pool" "prefill"). */}}
{{- define "conduit.pool.fullname" -}}
{{- printf "%s-%s" (include "conduit.fullname" .root) .pool }}
{{- end }}

{{- define "conduit.pool.headlessName" -}}
{{- printf "%s-%s-headless" (include "conduit.fullname" .root) .pool }}
{{- end }}

{{/* FQDN of a pool's headless Service: it resolves to every pod of the pool (the gateway's DNS discovery). */}}
{{- define "conduit.pool.headlessHost" -}}
{{- printf "%s.%s.svc.%s" (include "conduit.pool.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* FQDN of the headless Service of the pool clients reach (Envoy's engine cluster). */}}
{{- define "conduit.engine.headlessHost" -}}
{{- include "conduit.pool.headlessHost" (dict "root" . "pool" (include "conduit.engine.clientPool" .)) }}
{{- end }}

{{- define "conduit.gateway.host" -}}
{{- printf "%s.%s.svc.%s" (include "conduit.gateway.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* Hardening shared by every container: the images run as an unprivileged user. */}}
{{- define "conduit.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "conduit.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ . }}
runAsGroup: {{ . }}
fsGroup: {{ . }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Log and trace flags both services take, from .Values.logging and .Values.tracing. */}}
{{- define "conduit.observabilityArgs" -}}
- --log-format
- {{ .Values.logging.format | quote }}
{{- if .Values.tracing.otlpEndpoint }}
- --otlp-endpoint
- {{ .Values.tracing.otlpEndpoint | quote }}
{{- end }}
{{- end }}

{{/* Secure boundaries: the Secrets each part reads (an existing one, or the one cert-manager writes). */}}
{{- define "conduit.tlsSecret" -}}
{{- $part := index .root.Values.tls .part }}
{{- if $part.existingSecret }}
{{- $part.existingSecret }}
{{- else if .root.Values.certManager.enabled }}
{{- printf "%s-%s-tls" (include "conduit.fullname" .root) .part }}
{{- else }}
{{- fail (printf "tls.%s.existingSecret: name a Secret with tls.crt, tls.key and ca.crt (or enable certManager)" .part) }}
{{- end }}
{{- end }}

{{/* The client certificate the gateway and Envoy present to mTLS engines. */}}
{{- define "conduit.engineClientSecret" -}}
{{- if .Values.tls.engine.clientSecret }}
{{- .Values.tls.engine.clientSecret }}
{{- else if .Values.certManager.enabled }}
{{- printf "%s-engine-client-tls" (include "conduit.fullname" .) }}
{{- else }}
{{- fail "tls.engine.clientSecret: name a Secret with the client tls.crt and tls.key (or enable certManager)" }}
{{- end }}
{{- end }}

{{/* The name the engines' certificate carries, checked by every client (they dial pod addresses). */}}
{{- define "conduit.engineServerName" -}}
{{- default (include "conduit.engine.headlessHost" .) .Values.tls.engine.serverName }}
{{- end }}

{{/* Engine probes: the kubelet's gRPC probe is plaintext, so a TLS engine is probed by an exec of
conduit_engine.entrypoints.health_probe with the engine's own CA and certificate. */}}
{{- define "conduit.engine.probe" -}}
{{- $e := .root.Values.engine }}
{{- $t := .root.Values.tls.engine }}
{{- if $t.enabled }}
exec:
  command:
    - python
    - -m
    - conduit_engine.entrypoints.health_probe
    - --address
    - {{ printf "127.0.0.1:%d" (int $e.port) | quote }}
    - --ca
    - /etc/conduit/tls/ca.crt
    - --server-name
    - {{ include "conduit.engineServerName" .root | quote }}
    {{- if $t.mtls }}
    - --cert
    - /etc/conduit/tls/tls.crt
    - --key
    - /etc/conduit/tls/tls.key
    {{- end }}
{{- else }}
grpc:
  port: {{ $e.port }}
{{- end }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
{{- end }}

{{- define "conduit.redis.fullname" -}}
{{- printf "%s-redis" (include "conduit.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The gateway's --response-store: memory, none, the external Redis URL, or the chart's Redis. */}}
{{- define "conduit.responses.storeTarget" -}}
{{- $r := .Values.responses }}
{{- if ne $r.store "redis" }}
{{- $r.store }}
{{- else if $r.redisUrl }}
{{- $r.redisUrl }}
{{- else if $r.redis.enabled }}
{{- printf "redis://%s.%s.svc.%s:%d/0" (include "conduit.redis.fullname" .) .Release.Namespace .Values.clusterDomain (int $r.redis.port) }}
{{- else }}
{{- fail "responses.store redis needs responses.redisUrl or responses.redis.enabled" }}
{{- end }}
{{- end }}

{{/* The gateway's --workers: gateway.workers, or one per whole CPU the pod requests (at least 1). */}}
{{- define "conduit.gateway.workers" -}}
{{- $g := .Values.gateway -}}
{{- if $g.workers -}}
{{- int $g.workers -}}
{{- else -}}
{{- $cpu := toString (dig "requests" "cpu" "" ($g.resources | default dict)) -}}
{{- $millis := 0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $millis = trimSuffix "m" $cpu | int -}}
{{- else if $cpu -}}
{{- $millis = mulf (float64 $cpu) 1000 | int -}}
{{- end -}}
{{- max 1 (div $millis 1000) -}}
{{- end -}}
{{- end }}
