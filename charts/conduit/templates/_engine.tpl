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
            {{- if ne $pool "engine" }}
            # One side of disaggregated requests; other engines pull KV from this pod's own address.
            - --role
            - {{ $pool | quote }}
            - --advertise-address
            - {{ printf "$(POD_IP):%d" (int $e.port) | quote }}
            - --kv-transfer-lease-seconds
            - {{ $root.Values.disaggregation.leaseSeconds | quote }}
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
          # grpc.health.v1 answers SERVING only once the model is loaded and warmed up.
          startupProbe:
            grpc:
              port: {{ $e.port }}
            periodSeconds: {{ $e.startupProbe.periodSeconds }}
            failureThreshold: {{ $e.startupProbe.failureThreshold }}
            timeoutSeconds: {{ $e.startupProbe.timeoutSeconds }}
          readinessProbe:
            grpc:
              port: {{ $e.port }}
            periodSeconds: {{ $e.readinessProbe.periodSeconds }}
            failureThreshold: {{ $e.readinessProbe.failureThreshold }}
            timeoutSeconds: {{ $e.readinessProbe.timeoutSeconds }}
          livenessProbe:
            grpc:
              port: {{ $e.port }}
            periodSeconds: {{ $e.livenessProbe.periodSeconds }}
            failureThreshold: {{ $e.livenessProbe.failureThreshold }}
            timeoutSeconds: {{ $e.livenessProbe.timeoutSeconds }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $e.preStopSleepSeconds }}
          resources:
            {{- $resources := deepCopy $p.resources }}
            {{- if $e.gpu.enabled }}
            {{- $limits := default (dict) $resources.limits }}
            {{- $_ := set $limits $e.gpu.resourceName $e.gpu.count }}
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
            - name: tmp
              mountPath: /tmp
            - name: dshm
              mountPath: /dev/shm
      volumes:
        - name: model
          {{- toYaml $e.model.volume | nindent 10 }}
        - name: tmp
          emptyDir: {}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $e.shmSizeLimit }}
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
