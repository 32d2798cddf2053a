{{/*
One pool of engine replicas: a StatefulSet of model servers with stable names. Call with
(dict "root" $ "pool" "engine") for the colocated engines, or "prefill" / "decode" for the two sides of
disaggregated serving; all pools take their settings from .Values.engine, and a disaggregated pool its
replicas, resources and extra flags from .Values.disaggregation.<pool>.
*/}}
{{- define "conduit.engine.statefulset" -}}
{{- $root := .root }}
{{- $pool := .pool }}
{{- $e := $root.Values.engine }}
{{- $ranks := int $e.tensorParallelSize }}
{{- $p := include "conduit.pool.settings" . | fromYaml }}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ include "conduit.pool.fullname" . }}
  labels:
    {{- include "conduit.componentLabels" (dict "root" $root "component" $pool) | nindent 4 }}
spec:
  serviceName: {{ include "conduit.pool.headlessName" . }}
  replicas: {{ $p.replicas }}
  # Replicas load their model independently: start them together rather than one after another.
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  selector:
    matchLabels:
      {{- include "conduit.selectorLabels" (dict "root" $root "component" $pool) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "conduit.selectorLabels" (dict "root" $root "component" $pool) | nindent 8 }}
        {{- with $e.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $e.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "conduit.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $e.terminationGracePeriodSeconds }}
      securityContext:
        {{- include "conduit.podSecurityContext" 10001 | nindent 8 }}
      containers:
        - name: engine
          image: {{ include "conduit.image" (dict "root" $root "image" $e.image) | quote }}
          imagePullPolicy: {{ $e.image.pullPolicy }}
          args:
            - --model
            - {{ $e.model.mountPath | quote }}
            - --host
            - "0.0.0.0"
            - --port
            - {{ $e.port | quote }}
            - --device
            - {{ ternary "cuda" "cpu" $e.gpu.enabled | quote }}
            - --dtype
            - {{ $e.dtype | quote }}
            - --drain-seconds
            - {{ $e.drainSeconds | quote }}
            - --tensor-parallel-size
            - {{ $ranks | quote }}
            # Prometheus metrics on their own port: they answer while the model loads and while draining.
            - --metrics-port
            - {{ $e.metrics.port | quote }}
            {{- if $e.metrics.vllmCompat }}
            - --metrics-vllm-compat
            {{- end }}
            {{- include "conduit.observabilityArgs" $root | nindent 12 }}
            {{- with $e.servedModelName }}
            - --served-model-name
            - {{ . | quote }}
            {{- end }}
            {{- with $e.maxNumSeqs }}
            - --max-num-seqs
            - {{ . | quote }}
            {{- end }}
            {{- with $e.maxModelLen }}
            - --max-model-len
            - {{ . | quote }}
            {{- end }}
            {{- with $e.kvCacheBlocks }}
            - --kv-cache-blocks
            - {{ . | quote }}
            {{- end }}
            {{- with $e.blockSize }}
            - --block-size
            - {{ . | quote }}
            {{- end }}
            {{- with $e.maxNumBatchedTokens }}
            - --max-num-batched-tokens
            - {{ . | quote }}
            {{- end }}
            {{- with $e.maxQueuedRequests }}
            - --max-queued-requests
            - {{ . | quote }}
            {{- end }}
            {{- with $e.tokenizerThreads }}
            - --tokenizer-threads
            - {{ . | quote }}
            {{- end }}
            {{- if $e.lora.enabled }}
            - --enable-lora
            - --max-loras
            - {{ $e.lora.maxLoras | quote }}
            - --max-lora-rank
            - {{ $e.lora.maxLoraRank | quote }}
            {{- with $e.lora.maxCpuLoras }}
            - --max-cpu-loras
            - {{ . | quote }}
            {{- end }}
            {{- with $e.lora.adapters }}
            - --lora-modules
            {{- range . }}
            - {{ printf "%s=%s" .name .path | quote }}
            {{- end }}
            {{- end }}
            {{- end }}
            {{- if $root.Values.tls.engine.enabled }}
            - --tls-cert
            - /etc/conduit/tls/tls.crt
            - --tls-key
            - /etc/conduit/tls/tls.key
            # Towards other engines (disaggregation's PullKv): the same CA, and under mTLS this certificate.
            - --engine-tls-ca
            - /etc/conduit/tls/ca.crt
            - --engine-tls-server-name
            - {{ include "conduit.engineServerName" $root | quote }}
            {{- if $root.Values.tls.engine.mtls }}
            - --tls-client-ca
            - /etc/conduit/tls/ca.crt
            - --engine-tls-cert
            - /etc/conduit/tls/tls.crt
            - --engine-tls-key
            - /etc/conduit/tls/tls.key
            {{- end }}
            {{- end }}
            {{- if $root.Values.auth.engineToken.existingSecret }}
            - --auth-token-file
            - /etc/conduit/token/token
            - --engine-auth-token-file
            - /etc/conduit/token/token
            {{- end }}
            {{- if ne $pool "engine" }}
            # One side of disaggregated requests; other engines pull KV from this pod's own address.
            - --role
            - {{ $pool | quote }}
            - --advertise-address
            - {{ printf "$(POD_IP):%d" (int $e.port) | quote }}
            - --kv-transfer-lease-seconds
            - {{ $root.Values.disaggregation.leaseSeconds | quote }}
            - --kv-transport
            - {{ $root.Values.disaggregation.kvTransport | quote }}
            {{- end }}
            {{- range $p.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          {{- if or (ne $pool "engine") $e.extraEnv }}
          env:
            {{- if ne $pool "engine" }}
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- end }}
            {{- with $e.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $e.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $e.metrics.port }}
              protocol: TCP
          # grpc.health.v1 answers SERVING only once the model is loaded and warmed up.
          startupProbe:
            {{- include "conduit.engine.probe" (dict "root" $root "probe" $e.startupProbe) | nindent 12 }}
          readinessProbe:
            {{- include "conduit.engine.probe" (dict "root" $root "probe" $e.readinessProbe) | nindent 12 }}
          livenessProbe:
            {{- include "conduit.engine.probe" (dict "root" $root "probe" $e.livenessProbe) | nindent 12 }}
          lifecycle:
            # Health NOT_SERVING first (SIGUSR1), then the pause: routers stop sending before SIGTERM.
            preStop:
              exec:
                command:
                  - python
                  - -m
                  - conduit_engine.entrypoints.pre_stop
                  - --sleep
                  - {{ $e.preStopSleepSeconds | quote }}
          resources:
            {{- $resources := deepCopy $p.resources }}
            {{- if $e.gpu.enabled }}
            {{- $limits := default (dict) $resources.limits }}
            {{- $_ := set $limits $e.gpu.resourceName (ternary $ranks (int $e.gpu.count) (gt $ranks 1)) }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- include "conduit.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            - name: model
              mountPath: {{ $e.model.mountPath | quote }}
              readOnly: true
              {{- with $e.model.subPath }}
              subPath: {{ . | quote }}
              {{- end }}
            {{- if and $e.lora.enabled $e.lora.volume }}
            - name: lora
              mountPath: {{ $e.lora.mountPath | quote }}
              readOnly: true
            {{- end }}
            - name: tmp
              mountPath: /tmp
            - name: dshm
              mountPath: /dev/shm
            {{- if $root.Values.tls.engine.enabled }}
            - name: tls
              mountPath: /etc/conduit/tls
              readOnly: true
            {{- end }}
            {{- if $root.Values.auth.engineToken.existingSecret }}
            - name: token
              mountPath: /etc/conduit/token
              readOnly: true
            {{- end }}
      volumes:
        - name: model
          {{- toYaml $e.model.volume | nindent 10 }}
        {{- if and $e.lora.enabled $e.lora.volume }}
        - name: lora
          {{- toYaml $e.lora.volume | nindent 10 }}
        {{- end }}
        - name: tmp
          emptyDir: {}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $e.shmSizeLimit | default (printf "%dGi" $ranks) }}
        {{- if $root.Values.tls.engine.enabled }}
        - name: tls
          secret:
            secretName: {{ include "conduit.tlsSecret" (dict "root" $root "part" "engine") | quote }}
        {{- end }}
        {{- with $root.Values.auth.engineToken.existingSecret }}
        - name: token
          secret:
            secretName: {{ . | quote }}
            items:
              - key: {{ $root.Values.auth.engineToken.secretKey | quote }}
                path: token
        {{- end }}
      {{- with $e.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $e.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $e.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/* The replicas, resources and extra flags of one pool (call with dict "root" $ "pool" P). */}}
{{- define "conduit.pool.settings" -}}
{{- $e := .root.Values.engine }}
{{- if eq .pool "engine" }}
{{- dict "replicas" $e.replicas "resources" $e.resources "extraArgs" $e.extraArgs | toYaml }}
{{- else }}
{{- $d := index .root.Values.disaggregation .pool }}
{{- $resources := default $e.resources $d.resources }}
{{- dict "replicas" $d.replicas "resources" $resources "extraArgs" (concat $e.extraArgs $d.extraArgs) | toYaml }}
{{- end }}
{{- end }}
