{{/*
The Ray pod template and its parts: the command and start-up script (files/ray-start.sh), the
environment, annotations (gcsfuse, multi-network), labels and resources.
*/}}

{{/*
The Ray container's command: tini as PID 1 (the image installs it at /usr/bin/tini, and its own
ENTRYPOINT, which this command replaces, uses it too), then bash with kuberl.startScript as its args.
Without tini `ray start` would be PID 1, and the orphans of bubblewrap sandboxes would stay zombies.
*/}}
{{- define "kuberl.command" -}}
["/usr/bin/tini", "--", "/bin/bash", "-c", "--"]
{{- end }}

{{/*
Start-up, run by bash under tini (the container's PID 1, which reaps the orphans that sandboxes and
Ray leave behind; see kuberl.command). The RayCluster carries `ray.io/overwrite-container-cmd: "true"`,
so KubeRay leaves the command alone and hands over the `ray start` it generated in
KUBERAY_GEN_RAY_START_CMD; we `exec` it, so Ray is tini's child and gets its signals.
Args: dict root, head (bool), gpu (bool).
*/}}
{{- define "kuberl.startScript" -}}
{{- tpl (.root.Files.Get "files/ray-start.sh.tpl") . | trimSuffix "\n" }}
{{- end }}

{{/*
Environment of every Ray container. Args: dict root, gpu (bool: a GPU worker).
*/}}
{{- define "kuberl.env" -}}
{{- $v := .root.Values -}}
- name: KUBERL_EXPERIMENT
  value: {{ $v.experiment | quote }}
{{- /* The owner of the release's checkpoint lineage: the trainer's lease on its run directory names it. */}}
- name: KUBERL_RELEASE
  value: {{ include "kuberl.release" .root | quote }}
{{- /* The image the run's checkpoints record (trainer/checkpoint.py): a resume under another one says so. */}}
- name: KUBERL_IMAGE
  value: {{ include "kuberl.image" .root | quote }}
{{- /* Model code runs only under this isolation: with bwrap, a pod where bubblewrap cannot start refuses
the run in one line rather than falling back (trainer/sandbox/backends.py). With the sandbox service no model
code runs here, and what would (a tool's code) never runs unisolated beside the Ray token: sandbox.backend's
opt-out applies to the service's pod alone. */}}
- name: KUBERL_SANDBOX
  value: {{ ternary "bwrap" $v.sandbox.backend $v.sandbox.enabled | quote }}
{{- if $v.sandbox.enabled }}
{{- /* The callers of the sandbox service (trainer/sandbox/remote.py): the reward tasks and the driver run
here. Its token is a file of the Secret's volume (kuberl.sandboxTokenVolume), never Ray's. */}}
- name: KUBERL_SANDBOX_URL
  value: {{ include "kuberl.sandboxUrl" .root | quote }}
- name: KUBERL_SANDBOX_TOKEN_FILE
  value: {{ include "kuberl.sandboxTokenPath" .root | quote }}
{{- end }}
{{- if $v.generationEndpoint.enabled }}
{{- /* The generation endpoint's own bearer token (trainer/generation/endpoint.py), never Ray's. */}}
- name: KUBERL_ENDPOINT_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kuberl.endpointSecret" .root }}
      key: token
{{- end }}
{{- if $v.rewardServer.enabled }}
{{- /* The reward server's API key, which the trainer's reward_server reward sends as its bearer token (its
reward_server.api_key_env), and where the server is: the RayJob's entrypoint gets both as overrides
(kuberl.jobCommand); a job submitted to the RayCluster reads them here. */}}
- name: REWARD_SERVER_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kuberl.rewardServerSecret" .root }}
      key: token
- name: KUBERL_REWARD_SERVER_URL
  value: {{ include "kuberl.rewardServerUrl" .root | quote }}
- name: KUBERL_REWARD_SERVER_MODEL
  value: {{ include "kuberl.rewardServerModel" .root | quote }}
{{- end }}
- name: KUBERL_LOG_DIR
  value: {{ include "kuberl.path" (dict "root" .root "key" "logs") | quote }}
- name: KUBERL_CHECKPOINT_DIR
  value: {{ include "kuberl.path" (dict "root" .root "key" "checkpoints") | quote }}
- name: HF_HOME
  value: {{ include "kuberl.path" (dict "root" .root "key" "hfCache") | quote }}
- name: KUBERL_CACHE
  value: {{ include "kuberl.path" (dict "root" .root "key" "cache") | quote }}
{{- /* Ray's job supervisor sends SIGKILL this long after the SIGTERM of a stop (its default is
3 s): the same grace as the pods get, for the trainer to finish its step and save. */}}
- name: RAY_JOB_STOP_WAIT_TIME_S
  value: {{ $v.terminationGracePeriodSeconds | quote }}
{{- with $v.secrets.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $v.secrets.hfToken.key }}
{{- end }}
{{ include "kuberl.loggerEnv" .root }}
{{- if .gpu }}
{{- /* GKE mounts the node's driver at /usr/local/nvidia, and our command bypasses the image's
entrypoint, which would add it: without this no GPU container loads libcuda. */}}
- name: LD_LIBRARY_PATH
  value: {{ ternary "/usr/local/gib/lib64:/usr/local/nvidia/lib64" "/usr/local/nvidia/lib64" $v.rdma.enabled }}
{{- end }}
{{- if $v.generationEndpoint.enabled }}
{{- /* Where the generation actors' endpoint listens: the pod's own address, not every interface. */}}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end }}
{{- with $v.storage.models }}{{ if .enabled }}
- name: KUBERL_MODELS_DIR
  value: {{ .mountPath | quote }}
{{- end }}{{ end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Pod annotations. Args: dict root, gpu (bool), extra (map). The gcsfuse and multi-network
annotations must sit on the pod template's metadata: the CSI webhook and GKE's network plumbing
read them from the pod, and a chart that drops them yields pods without storage or RDMA.
*/}}
{{- define "kuberl.podAnnotations" -}}
{{- $v := .root.Values -}}
{{- $a := dict -}}
{{- if eq $v.storage.type "gcsfuse" }}
{{- $_ := set $a "gke-gcsfuse/volumes" "true" }}
{{- range $k, $val := $v.storage.gcsfuse.sidecarResources }}
{{- $_ := set $a (printf "gke-gcsfuse/%s" (kebabcase $k)) ($val | toString) }}
{{- end }}
{{- end }}
{{- if and .gpu $v.rdma.enabled }}
{{- $ifaces := list (dict "interfaceName" "eth0" "network" "default") (dict "interfaceName" "eth1" "network" "gvnic-1") }}
{{- range $i := until (int $v.rdma.nics) }}
{{- $ifaces = append $ifaces (dict "interfaceName" (printf "eth%d" (add $i 2)) "network" (printf "rdma-%d" $i)) }}
{{- end }}
{{- $_ := set $a "networking.gke.io/default-interface" "eth0" }}
{{- $_ := set $a "networking.gke.io/interfaces" (toJson $ifaces) }}
{{- end }}
{{- $a = merge (deepCopy (default dict .extra)) (deepCopy (default dict $v.podAnnotations)) $a }}
{{- if $a }}
{{- toYaml $a }}
{{- end }}
{{- end }}

{{/* Pod labels. Args: dict root, extra (map). */}}
{{- define "kuberl.podLabels" -}}
{{ include "kuberl.podTemplateLabels" .root }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Resources of a worker container: the group's cpu/memory plus its GPUs as request and limit. A memory
request without a limit gets itself as the limit: a worker's memory-backed /dev/shm is charged to the
container, and without a limit a full one (shmSize) would take the node's memory from everything else on
it. Args: dict group, gpus.
*/}}
{{- define "kuberl.workerResources" -}}
{{- $r := deepCopy (default dict .group.resources) }}
{{- $req := default dict $r.requests }}
{{- $lim := default dict $r.limits }}
{{- if and (hasKey $req "memory") (not (hasKey $lim "memory")) }}
{{- $_ := set $lim "memory" (get $req "memory") }}
{{- $_ := set $r "limits" $lim }}
{{- end }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $req "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $lim "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $r "requests" $req }}
{{- $_ := set $r "limits" $lim }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{/*
The generation endpoint's container ports (generationEndpoint): `port` and the ones after it, one per
engine of a pod. Fails closed: the endpoint is reachable only from the release's own pods
(networkPolicy.enabled; it authenticates with a token of its own, kuberl.endpointSecret), and takes no
port a pod uses. Args: the chart root.
*/}}
{{- define "kuberl.endpointPorts" -}}
{{- $e := .Values.generationEndpoint }}
{{- if not .Values.networkPolicy.enabled }}
{{- fail "generationEndpoint.enabled needs networkPolicy.enabled=true: only the release's own pods may reach the endpoint" }}
{{- end }}
{{- $taken := list 6379 8265 10001 8080 }}
{{- if .Values.tensorboard.enabled }}{{ $taken = append $taken .Values.tensorboard.port }}{{ end }}
{{- $last := add $e.port $e.ports -1 }}
{{- range $taken }}
{{- if and (ge (int .) (int $e.port)) (le (int .) (int $last)) }}
{{- fail (printf "generationEndpoint ports %d-%d take port %d, which the Ray pods use: choose another generationEndpoint.port" (int $e.port) (int $last) (int .)) }}
{{- end }}
{{- end }}
{{- range $i := until (int $e.ports) }}
- {name: {{ printf "openai-%d" $i }}, containerPort: {{ add $e.port $i }}}
{{- end }}
{{- end }}

{{/*
One Ray pod template. Args: dict root, name (group), head (bool), group (values of the group). No Ray pod
calls the Kubernetes API, so none mounts a service-account token (gcsfuse's CSI driver asks for its own
token; Workload Identity goes through the metadata server). Model-written code runs in none of them with
sandbox.enabled, but in the sandbox service (sandbox-deployment.yaml), whose nodes they keep off.
*/}}
{{- define "kuberl.podTemplate" -}}
{{- $v := .root.Values -}}
{{- $gpus := 0 }}
{{- if not .head }}{{ $gpus = int (default 0 .group.gpus) }}{{ end }}
{{- $gpu := gt $gpus 0 }}
{{- $ctx := dict "root" .root "gpu" $gpu "head" .head -}}
metadata:
  {{- /* Only what the pod needs: KubeRay hashes the whole RayCluster spec, pod metadata included, and
  recreates every pod when it changes, so chart text (checkov's skips: charts/kuberl/checkov/) stays out. */}}
  {{- with include "kuberl.podAnnotations" (dict "root" .root "gpu" $gpu "extra" .group.annotations) }}
  annotations:
    {{- . | nindent 4 }}
  {{- end }}
  labels:
    {{- include "kuberl.podLabels" (dict "root" .root "extra" .group.labels) | nindent 4 }}
spec:
  serviceAccountName: {{ include "kuberl.serviceAccountName" .root }}
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- include "kuberl.podSecurityContext" .root | nindent 4 }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "kuberl.nodeSelector" (dict "root" .root "gpu" $gpu "head" .head "extra" .group.nodeSelector) }}
  nodeSelector:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with include "kuberl.tolerations" (dict "root" .root "gpu" $gpu "extra" .group.tolerations) }}
  tolerations:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with include "kuberl.affinity" (dict "root" .root "gpu" $gpu "extra" .group.affinity) }}
  affinity:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with $v.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    {{- /* KubeRay finds the Ray container at index 0: sidecars come after it. */}}
    - name: {{ ternary "ray-head" "ray-worker" .head }}
      image: {{ include "kuberl.image" .root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- include "kuberl.containerSecurityContext" (dict "root" .root "sandbox" false) | nindent 8 }}
      command: {{ include "kuberl.command" . }}
      args:
        - |
          {{- include "kuberl.startScript" $ctx | nindent 10 }}
      {{- if .head }}
      ports:
        - {name: gcs, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: metrics, containerPort: 8080}
        {{- if $v.tensorboard.enabled }}
        - {name: tensorboard, containerPort: {{ $v.tensorboard.port }}}
        {{- end }}
        {{- if $v.generationEndpoint.enabled }}
        {{- include "kuberl.endpointPorts" .root | nindent 8 }}
        {{- end }}
      {{- else }}
      ports:
        - {name: metrics, containerPort: 8080}
        {{- if $v.generationEndpoint.enabled }}
        {{- include "kuberl.endpointPorts" .root | nindent 8 }}
        {{- end }}
      {{- end }}
      env:
        {{- include "kuberl.env" $ctx | nindent 8 }}
      {{- with $v.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      resources:
        {{- if .head }}
        {{- toYaml (default dict .group.resources) | nindent 8 }}
        {{- else }}
        {{- include "kuberl.workerResources" (dict "group" .group "gpus" $gpus) | nindent 8 }}
        {{- end }}
      volumeMounts:
        {{- include "kuberl.volumeMounts" $ctx | nindent 8 }}
        {{- if $v.sandbox.enabled }}
        - {name: sandbox-token, mountPath: {{ include "kuberl.sandboxTokenDir" .root }}, readOnly: true}
        {{- end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- with $v.sidecars }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  volumes:
    {{- include "kuberl.volumes" $ctx | nindent 4 }}
    {{- if $v.sandbox.enabled }}
    {{- include "kuberl.sandboxTokenVolume" .root | nindent 4 }}
    {{- end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
