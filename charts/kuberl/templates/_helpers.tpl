{{/*
Names, labels and the pieces shared by the head and worker pod templates.
*/}}

{{- define "kuberl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The RayCluster (or RayJob) name. KubeRay names the head service `<name>-head-svc` and pods
`<name>-<group>-worker-<suffix>`, so dots (helm allows them in release names) become dashes, and the
name is cut to the one limit in Chart.yaml (`kuberl.dev/max-name-length`: KubeRay's 47 for RayJobs),
which trainer/submit.py reads too, so `make submit` finds the head service of any release name.
*/}}
{{- define "kuberl.fullname" -}}
{{- $max := int (index .Chart.Annotations "kuberl.dev/max-name-length") }}
{{- $name := default .Release.Name .Values.fullnameOverride | replace "." "-" | trunc $max }}
{{- regexReplaceAll "-+$" $name "" }}
{{- end }}

{{- define "kuberl.headService" -}}
{{- include "kuberl.fullname" . }}-head-svc
{{- end }}

{{- define "kuberl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuberl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kuberl.labels" -}}
helm.sh/chart: {{ include "kuberl.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "kuberl.podTemplateLabels" . }}
{{- end }}

{{/*
The labels of a pod template: no chart version or appVersion. KubeRay hashes the whole pod template,
metadata included, to decide whether an upgrade recreates the pods, so a template may carry only what
changes the pod (the image tag that appVersion picks changes the container, not a label).
*/}}
{{- define "kuberl.podTemplateLabels" -}}
{{ include "kuberl.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.experiment }}
kuberl.dev/experiment: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
The Secret with the Ray token (key `auth_token`): auth.existingSecret, else the one KubeRay (1.6 and
later) makes for the cluster when authOptions names none. KubeRay names it `utils.CheckName(<cluster>)`:
the cluster's name, whose first character becomes `r` when it is a digit (our names are at most 47
characters, under CheckName's cut at 50). Nothing random is rendered, so two renders of the same values
are identical (helm template, Argo CD, Flux), and the token lives as long as the RayCluster object.
*/}}
{{- define "kuberl.authSecret" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- $name := include "kuberl.fullname" . }}
{{- if regexMatch "^[0-9]" $name }}{{ $name = printf "r%s" (substr 1 (len $name) $name) }}{{ end }}
{{- $name }}
{{- end }}
{{- end }}

{{/* KubeRay's authOptions: a token from auth.existingSecret or KubeRay's own Secret, or none. */}}
{{- define "kuberl.authOptions" -}}
{{- if eq .Values.auth.mode "token" -}}
authOptions:
  mode: token
  {{- with .Values.auth.existingSecret }}
  secretName: {{ . }}
  {{- end }}
{{- else -}}
authOptions:
  mode: disabled
{{- end }}
{{- end }}

{{/*
RAY_AUTH_MODE and RAY_AUTH_TOKEN for a container that talks to the cluster but is not one of its Ray
containers (the `helm test` pod, the RayJob submitter): KubeRay injects them into its own only.
*/}}
{{- define "kuberl.authEnv" -}}
{{- if eq .Values.auth.mode "token" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kuberl.authSecret" . }}
      key: auth_token
{{- end }}
{{- end }}

{{/*
Metadata of the RayCluster or RayJob object: the chart's labels, the Kueue queue, `labels`; KubeRay's
annotation, then `annotations`.
*/}}
{{- define "kuberl.rayObjectMetadata" -}}
name: {{ include "kuberl.fullname" . }}
labels:
  {{- include "kuberl.labels" . | nindent 2 }}
  {{- with .Values.queue }}
  kueue.x-k8s.io/queue-name: {{ . | quote }}
  {{- end }}
  {{- with .Values.labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  # Our start-up script runs KubeRay's generated `ray start` itself (see kuberl.startScript); on a
  # RayJob KubeRay copies it to the RayCluster it creates.
  ray.io/overwrite-container-cmd: "true"
  {{- with .Values.annotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/*
The sandbox group's service account: one of its own, with no Workload Identity annotation, so the
pods that run model-written code hold no Google identity (the metadata server maps a pod's service
account to its Google one); `default` when the chart creates no service account.
*/}}
{{- define "kuberl.sandboxServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-sandbox" (include "kuberl.serviceAccountName" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
default
{{- end }}
{{- end }}

{{- define "kuberl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kuberl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The job image. image.tag empty: the chart's appVersion (what `make image`/`make push` build). A tag,
a digest (`@sha256:...`) or both (`0.2.0@sha256:...`); a digest pins the image whatever the tag.
*/}}
{{- define "kuberl.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString }}
{{- if hasPrefix "sha256:" $tag }}{{ $tag = printf "@%s" $tag }}{{ end }}
{{- if hasPrefix "@" $tag }}
{{- printf "%s%s" .Values.image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
GPU presets: machine type, GKE accelerator and the gIB NCCL tuner file. One value picks them all.
*/}}
{{- define "kuberl.gpuPreset" -}}
{{- $presets := dict
  "b200" (dict "machineType" "a4-highgpu-8g" "accelerator" "nvidia-b200" "tuner" "/usr/local/gib/configs/tuner_config_a4.txtpb")
  "h200" (dict "machineType" "a3-ultragpu-8g" "accelerator" "nvidia-h200-141gb" "tuner" "/usr/local/gib/configs/tuner_config_a3u.txtpb")
  "none" (dict)
-}}
{{- get $presets .Values.gpu.type | toYaml }}
{{- end }}

{{/* Total GPUs the worker groups ask for: what `helm test` expects `ray status` to report. */}}
{{- define "kuberl.totalGpus" -}}
{{- $total := 0 }}
{{- range $name, $g := .Values.workerGroups }}
{{- $total = add $total (mul (int $g.replicas) (int (default 0 $g.gpus))) }}
{{- end }}
{{- $total }}
{{- end }}

{{/* Directories on shared storage. */}}
{{- define "kuberl.path" -}}
{{- printf "%s/%s" (.root.Values.storage.mountPath | trimSuffix "/") (get .root.Values.storage.paths .key) }}
{{- end }}

{{/*
Start-up, run by bash under tini (the container's PID 1, which reaps the orphans that sandboxes and
Ray leave behind; see kuberl.command). The RayCluster carries `ray.io/overwrite-container-cmd: "true"`,
so KubeRay leaves the command alone and hands over the `ray start` it generated in
KUBERAY_GEN_RAY_START_CMD; we `exec` it, so Ray is tini's child and gets its signals.
Args: dict root, head (bool), gpu (bool), sandbox (bool: the sandbox group, which mounts no storage).
*/}}
{{- define "kuberl.startScript" -}}
{{- $v := .root.Values -}}
ulimit -n 65536 2>/dev/null || true
{{- if not .sandbox }}
mkdir -p "$KUBERL_LOG_DIR" "$KUBERL_CHECKPOINT_DIR" "$HF_HOME" "$KUBERL_CACHE"
{{- end }}
{{- if .gpu }}
{{- $min := index .root.Chart.Annotations "kuberl.dev/min-nvidia-driver" }}
# The image's CUDA 13 wheels need an R{{ $min }}+ driver (Chart.yaml); GKE mounts the node's nvidia-smi here.
driver=$(/usr/local/nvidia/bin/nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
if [ -n "$driver" ] && [ "${driver%%.*}" -lt {{ $min }} ] 2>/dev/null; then
  echo "kuberl: this node's NVIDIA driver $driver is older than R{{ $min }}, which the image's CUDA 13 wheels need: recreate the GPU node pool with gpu-driver-version=latest (docs/cluster.md)" >&2
  exit 1
fi
{{- end }}
{{- if and .gpu $v.rdma.enabled }}
{{- $preset := include "kuberl.gpuPreset" .root | fromYaml }}
# gIB's NCCL settings come from GKE's RDMA installer, which keeps them current for the machine type;
# rdma.ncclEnv is exported after it, so an explicit value wins.
if [ ! -f /usr/local/gib/scripts/set_nccl_env.sh ]; then
  echo "kuberl: /usr/local/gib/scripts/set_nccl_env.sh is missing: GKE's nccl-rdma-installer has not run on this node (make preflight; docs/cluster.md step 5)" >&2
  exit 1
fi
source /usr/local/gib/scripts/set_nccl_env.sh
export NCCL_TUNER_CONFIG_PATH="${NCCL_TUNER_CONFIG_PATH:-{{ $preset.tuner }}}"
{{- range $k, $val := $v.rdma.ncclEnv }}
export {{ $k }}={{ $val | toString | squote }}
{{- end }}
{{- end }}
{{- if and .head $v.tensorboard.enabled }}
{{- /* On the pod's loopback only: TensorBoard has no authentication, and `make tensorboard` reaches it
through kubectl port-forward, which Kubernetes RBAC guards (pods/portforward). */}}
tensorboard --logdir "$KUBERL_LOG_DIR" --host 127.0.0.1 --port {{ $v.tensorboard.port }} >/tmp/tensorboard.log 2>&1 &
{{- end }}
exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"
{{- end }}

{{/*
The Ray container's command: tini as PID 1 (the image installs it at /usr/bin/tini, and its own
ENTRYPOINT, which this command replaces, uses it too), then bash with kuberl.startScript as its args.
Without tini `ray start` would be PID 1, and the orphans of bubblewrap sandboxes would stay zombies.
*/}}
{{- define "kuberl.command" -}}
["/usr/bin/tini", "--", "/bin/bash", "-c", "--"]
{{- end }}

{{/*
securityContext of a Ray container, then containerSecurityContext over it. Every container drops every
capability (NET_RAW included) and cannot gain privileges; seccomp is the pod's RuntimeDefault
(kuberl.podSecurityContext). The sandbox group alone (sandbox.enabled) is loosened as bubblewrap needs
it: it makes user, mount, PID and network namespaces and mounts tmpfs in them, which containerd's
default seccomp profile (unshare/clone of namespaces without CAP_SYS_ADMIN) and the
cri-containerd.apparmor.d profile of GKE's Container-Optimized OS (mount) deny, so seccomp and AppArmor
are `Unconfined` there. Its container keeps the runtime's default capabilities but NET_RAW: bwrap runs as
root and takes SYS_ADMIN and NET_ADMIN inside the namespaces it makes, which the bounding set must still
hold. Nothing is privileged. Under GKE Sandbox (sandbox.runtimeClassName: gvisor) gVisor implements those
namespaces itself, and the profiles stay at their defaults. Args: dict root, sandbox (bool).
*/}}
{{- define "kuberl.containerSecurityContext" -}}
{{- $sc := dict "allowPrivilegeEscalation" false "capabilities" (dict "drop" (list "ALL")) }}
{{- if .sandbox }}
{{- $_ := set $sc "capabilities" (dict "drop" (list "NET_RAW")) }}
{{- if ne .root.Values.sandbox.runtimeClassName "gvisor" }}
{{- $_ := set $sc "seccompProfile" (dict "type" "Unconfined") }}
{{- $_ := set $sc "appArmorProfile" (dict "type" "Unconfined") }}
{{- end }}
{{- end }}
{{- $sc = mergeOverwrite $sc (deepCopy .root.Values.containerSecurityContext) }}
{{- toYaml $sc }}
{{- end }}

{{/*
securityContext of a Ray pod: seccomp RuntimeDefault (containerd's default profile; GKE Standard applies
none unless asked), then podSecurityContext over it. Args: the chart root.
*/}}
{{- define "kuberl.podSecurityContext" -}}
{{- $sc := dict "seccompProfile" (dict "type" "RuntimeDefault") }}
{{- $sc = mergeOverwrite $sc (deepCopy .Values.podSecurityContext) }}
{{- toYaml $sc }}
{{- end }}

{{/*
Environment of every Ray container. Args: dict root, gpu (bool: a GPU worker), sandbox (bool: the
sandbox group, which gets no Secret, no storage path and none of `env`, where a platform may put
secretKeyRefs).
*/}}
{{- define "kuberl.env" -}}
{{- $v := .root.Values -}}
- name: KUBERL_EXPERIMENT
  value: {{ $v.experiment | quote }}
{{- /* Code rewards run only under this isolation: with bwrap, a pod where bubblewrap cannot start
refuses the run in one line rather than falling back (trainer/sandbox/backends.py). */}}
- name: KUBERL_SANDBOX
  value: {{ $v.sandbox.backend | quote }}
{{- if $v.sandbox.enabled }}
{{- /* The driver sends code reward tasks to the nodes that hold this Ray resource: the sandbox group. */}}
- name: KUBERL_SANDBOX_RESOURCE
  value: {{ $v.sandbox.resource | quote }}
{{- end }}
{{- if not .sandbox }}
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
{{- with $v.storage.models }}{{ if .enabled }}
- name: KUBERL_MODELS_DIR
  value: {{ .mountPath | quote }}
{{- end }}{{ end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
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

{{/*
The privileges a Ray pod keeps, each with its reason, as checkov's skip annotations
(`checkov.io/skipN: CHECK=reason`): every other check of checkov's Kubernetes policies passes on the
pod templates (bench/lift_pods.py lifts them out of the RayCluster for it; bench/README.md). Only what
applies to this pod is listed: a digest, `Always`, a CPU limit or a non-root user set in the values
drops its line. Args: dict root, ctx (the pod template's ctx), group (values of the group).
*/}}
{{- define "kuberl.checkovSkips" -}}
{{- $v := .root.Values }}
{{- $skips := list "CKV_K8S_8=KubeRay adds its own liveness probe to the Ray container (Ray's health endpoints)" "CKV_K8S_9=KubeRay adds its own readiness probe to the Ray container (Ray's health endpoints)" "CKV_K8S_22=Ray writes /tmp/ray and torch, Triton and vLLM write compile caches under $HOME at run time" }}
{{- if not (contains "@sha256:" (include "kuberl.image" .root)) }}
{{- $skips = append $skips "CKV_K8S_43=image.tag takes a digest (@sha256:..., as make push prints it); the default is the chart's appVersion tag" }}
{{- end }}
{{- if ne $v.image.pullPolicy "Always" }}
{{- $skips = append $skips "CKV_K8S_15=a multi-GB image on every node: IfNotPresent, and each build gets a new tag or a digest (image.tag)" }}
{{- end }}
{{- if not (or $v.podSecurityContext.runAsNonRoot $v.containerSecurityContext.runAsNonRoot) }}
{{- $skips = concat $skips (list "CKV_K8S_23=the job image runs as root: every pod writes shared storage (gcsfuse, Lustre) as uid 0; no capability is kept" "CKV_K8S_40=the job image runs as root (CKV_K8S_23); no capability is kept") }}
{{- end }}
{{- $res := default dict .group.resources }}
{{- if not (dig "limits" "cpu" "" $res) }}
{{- $skips = append $skips "CKV_K8S_11=no CPU limit: CFS quota would throttle the trainer, NCCL's proxy threads and the engines' schedulers; the request reserves the cores" }}
{{- end }}
{{- if .ctx.sandbox }}
{{- $skips = append $skips "CKV_K8S_37=bubblewrap runs as root and needs SYS_ADMIN and NET_ADMIN in the bounding set inside the namespaces it makes: the runtime's default capabilities but NET_RAW (docs/cluster.md)" }}
{{- else if contains "secretKeyRef" (include "kuberl.env" .ctx) }}
{{- $skips = append $skips "CKV_K8S_35=HF_TOKEN, WANDB_API_KEY and KubeRay's RAY_AUTH_TOKEN are read from the environment by their libraries; the sandbox group gets none" }}
{{- end }}
{{- range $i, $s := $skips }}
checkov.io/skip{{ add1 $i }}: {{ $s | quote }}
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

{{/* Node selector. Args: dict root, gpu (bool), head (bool), extra (map). */}}
{{- define "kuberl.nodeSelector" -}}
{{- $v := .root.Values -}}
{{- $s := dict -}}
{{- if and (not .head) (include "kuberl.workerFileCache" .root) }}
{{- /* The gcsfuse sidecar's file cache lives in its cache volume, on the node's ephemeral storage:
local SSD only on pools created with --ephemeral-storage-local-ssd, which GKE labels so. */}}
{{- $_ := set $s "cloud.google.com/gke-ephemeral-storage-local-ssd" "true" }}
{{- end }}
{{- if .gpu }}
{{- $preset := include "kuberl.gpuPreset" .root | fromYaml }}
{{- $_ := set $s "cloud.google.com/gke-accelerator" $preset.accelerator }}
{{- $_ := set $s "node.kubernetes.io/instance-type" $preset.machineType }}
{{- if eq $v.capacity.type "spot" }}
{{- $_ := set $s "cloud.google.com/gke-spot" "true" }}
{{- else if eq $v.capacity.type "reservation" }}
{{- $_ := set $s "cloud.google.com/reservation-name" (required "capacity.reservationName is required when capacity.type=reservation" $v.capacity.reservationName) }}
{{- $_ := set $s "cloud.google.com/reservation-affinity" "specific" }}
{{- with $v.capacity.reservationProject }}
{{- $_ := set $s "cloud.google.com/reservation-project" . }}
{{- end }}
{{- with $v.capacity.reservationBlock }}
{{- $_ := set $s "cloud.google.com/reservation-blocks" . }}
{{- end }}
{{- else if eq $v.capacity.type "flexStart" }}
{{- $_ := set $s "cloud.google.com/gke-flex-start" "true" }}
{{- end }}
{{- end }}
{{- $s = merge (deepCopy (default dict .extra)) $s }}
{{- if $s }}
{{- toYaml $s }}
{{- end }}
{{- end }}

{{/*
Affinity: the group's, and for GPU pods with capacity.type=onDemand a required node affinity that
keeps them off spot and flex-start nodes (a node selector cannot say "not"; GKE labels those nodes
and need not taint them), added to every node selector term the group gives.
Args: dict root, gpu (bool), extra (map).
*/}}
{{- define "kuberl.affinity" -}}
{{- $a := deepCopy (default dict .extra) }}
{{- if and .gpu (eq .root.Values.capacity.type "onDemand") }}
{{- $not := list (dict "key" "cloud.google.com/gke-spot" "operator" "NotIn" "values" (list "true")) (dict "key" "cloud.google.com/gke-flex-start" "operator" "NotIn" "values" (list "true")) }}
{{- $na := default dict $a.nodeAffinity }}
{{- $req := default dict (get $na "requiredDuringSchedulingIgnoredDuringExecution") }}
{{- $terms := list }}
{{- range (default (list dict) $req.nodeSelectorTerms) }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (concat (default list $term.matchExpressions) $not) }}
{{- $terms = append $terms $term }}
{{- end }}
{{- $_ := set $req "nodeSelectorTerms" $terms }}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" $req }}
{{- $_ := set $a "nodeAffinity" $na }}
{{- end }}
{{- if $a }}
{{- toYaml $a }}
{{- end }}
{{- end }}

{{/* Tolerations. Args: dict root, gpu (bool), extra (list). */}}
{{- define "kuberl.tolerations" -}}
{{- $t := list -}}
{{- if .gpu }}
{{- $t = append $t (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- if eq .root.Values.capacity.type "spot" }}
{{- $t = append $t (dict "key" "cloud.google.com/gke-spot" "operator" "Equal" "value" "true" "effect" "NoSchedule") }}
{{- else if eq .root.Values.capacity.type "flexStart" }}
{{- /* GKE may taint flex-start nodes with their label. */}}
{{- $t = append $t (dict "key" "cloud.google.com/gke-flex-start" "operator" "Equal" "value" "true" "effect" "NoSchedule") }}
{{- end }}
{{- end }}
{{- $t = concat $t (default list .extra) }}
{{- if $t }}
{{- toYaml $t }}
{{- end }}
{{- end }}

{{/*
"true" when worker pods keep a gcsfuse file cache (read-write or models mount) that must sit on local
SSD (storage.gcsfuse.fileCache.worker, storage.models.gcsfuse.fileCache.worker, cacheOnLocalSsd).
*/}}
{{- define "kuberl.workerFileCache" -}}
{{- $v := .Values -}}
{{- if and (eq $v.storage.type "gcsfuse") $v.storage.gcsfuse.cacheOnLocalSsd }}
{{- $rw := ne ($v.storage.gcsfuse.fileCache.worker | toString) "0" }}
{{- $ro := and $v.storage.models.enabled (ne ($v.storage.models.gcsfuse.fileCache.worker | toString) "0") }}
{{- if or $rw $ro }}true{{ end }}
{{- end }}
{{- end }}

{{/*
volumeAttributes of a gcsfuse volume: the mount's own, then fileCacheCapacity for this pod's role
(head or worker). Args: dict attrs (map), fileCache ({head, worker}), head (bool), key (values path).
*/}}
{{- define "kuberl.gcsfuseAttributes" -}}
{{- if hasKey .attrs "fileCacheCapacity" }}
{{- fail (printf "%s.volumeAttributes.fileCacheCapacity is not read: set %s.fileCache.head and %s.fileCache.worker (the head has no local SSD)" .key .key .key) }}
{{- end }}
{{- range $k, $val := .attrs }}
{{ $k }}: {{ $val | toString | quote }}
{{- end }}
fileCacheCapacity: {{ ternary .fileCache.head .fileCache.worker .head | toString | quote }}
{{- end }}

{{/* Volumes. Args: dict root, gpu (bool), head (bool). */}}
{{- define "kuberl.volumes" -}}
{{- $v := .root.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSize }}
- name: shared
{{- if eq $v.storage.type "gcsfuse" }}
  csi:
    driver: gcsfuse.csi.storage.gke.io
    volumeAttributes:
      bucketName: {{ required "storage.gcsfuse.bucketName is required when storage.type=gcsfuse" $v.storage.gcsfuse.bucketName | quote }}
      mountOptions: {{ $v.storage.gcsfuse.mountOptions | quote }}
      {{- include "kuberl.gcsfuseAttributes" (dict "attrs" $v.storage.gcsfuse.volumeAttributes "fileCache" $v.storage.gcsfuse.fileCache "head" .head "key" "storage.gcsfuse") | nindent 6 }}
{{- else if eq $v.storage.type "lustre" }}
  persistentVolumeClaim:
    claimName: {{ include "kuberl.lustreClaim" .root }}
{{- else if eq $v.storage.type "hostPath" }}
  hostPath:
    path: {{ $v.storage.hostPath.path }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
    sizeLimit: {{ $v.storage.emptyDirSizeLimit }}
{{- end }}
{{- $m := $v.storage.models }}
{{- if and $m.enabled (eq $v.storage.type "gcsfuse") }}
{{- /* Its own mount: read-only, so its metadata can be cached for good (ttl -1). */}}
- name: models
  csi:
    driver: gcsfuse.csi.storage.gke.io
    readOnly: true
    volumeAttributes:
      bucketName: {{ $v.storage.gcsfuse.bucketName | quote }}
      mountOptions: {{ printf "only-dir=%s,%s" $m.subPath $m.gcsfuse.mountOptions | quote }}
      {{- include "kuberl.gcsfuseAttributes" (dict "attrs" $m.gcsfuse.volumeAttributes "fileCache" $m.gcsfuse.fileCache "head" .head "key" "storage.models.gcsfuse") | nindent 6 }}
{{- end }}
{{- if and .gpu $v.rdma.enabled }}
- name: nvidia-libs
  hostPath:
    path: /home/kubernetes/bin/nvidia
- name: gib
  hostPath:
    path: /home/kubernetes/bin/gib
{{- end }}
{{- end }}

{{/* Volume mounts. Args: dict root, gpu (bool). */}}
{{- define "kuberl.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: shared
  mountPath: {{ .root.Values.storage.mountPath }}
{{- $m := .root.Values.storage.models }}
{{- if $m.enabled }}
{{- if eq .root.Values.storage.type "gcsfuse" }}
- name: models
  mountPath: {{ $m.mountPath }}
  readOnly: true
{{- else }}
- name: shared
  mountPath: {{ $m.mountPath }}
  subPath: {{ $m.subPath }}
  readOnly: true
{{- end }}
{{- end }}
{{- if and .gpu .root.Values.rdma.enabled }}
- name: nvidia-libs
  mountPath: /usr/local/nvidia
- name: gib
  mountPath: /usr/local/gib
{{- end }}
{{- end }}

{{- define "kuberl.lustreClaim" -}}
{{- default (printf "%s-lustre" (include "kuberl.fullname" .)) .Values.storage.lustre.existingClaim }}
{{- end }}

{{/*
Cluster-scoped PV name, one per namespace and release: `<namespace>-<name>-lustre-<hash>`, the hash
(8 hex digits of sha256 over `<namespace>/<release>`) told apart where the dashes are ambiguous
(namespace `a-b` + release `c` and namespace `a` + release `b-c`). At most 63 + 47 + 16 characters, well
under a PV name's 253, so nothing is cut. storage.lustre.volumeName keeps the name of a PV made before.
*/}}
{{- define "kuberl.lustreVolume" -}}
{{- $hash := printf "%s/%s" .Release.Namespace .Release.Name | sha256sum | trunc 8 }}
{{- default (printf "%s-%s-lustre-%s" .Release.Namespace (include "kuberl.fullname" .) $hash) .Values.storage.lustre.volumeName }}
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
One Ray pod template. Args: dict root, name (group), head (bool), group (values of the group), sandbox
(bool: the sandbox group, sandbox.enabled). No Ray pod calls the Kubernetes API, so none mounts a
service-account token (gcsfuse's CSI driver asks for its own token; Workload Identity goes through the
metadata server). The sandbox group runs model-written code: it gets no Secret, no shared storage, no
Google identity (a service account of its own), none of the platform's extra volumes, envFrom, init
containers or sidecars, and its own NetworkPolicy (networkpolicy.yaml).
*/}}
{{- define "kuberl.podTemplate" -}}
{{- $v := .root.Values -}}
{{- $gpus := 0 }}
{{- if not .head }}{{ $gpus = int (default 0 .group.gpus) }}{{ end }}
{{- $gpu := gt $gpus 0 }}
{{- $sandbox := default false .sandbox }}
{{- $ctx := dict "root" .root "gpu" $gpu "head" .head "sandbox" $sandbox -}}
metadata:
  annotations:
    {{- if not $sandbox }}
    {{- with include "kuberl.podAnnotations" (dict "root" .root "gpu" $gpu "extra" .group.annotations) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- end }}
    {{- include "kuberl.checkovSkips" (dict "root" .root "ctx" $ctx "group" .group) | nindent 4 }}
  labels:
    {{- include "kuberl.podLabels" (dict "root" .root "extra" .group.labels) | nindent 4 }}
    {{- if $sandbox }}
    kuberl.dev/role: sandbox
    {{- end }}
spec:
  serviceAccountName: {{ ternary (include "kuberl.sandboxServiceAccountName" .root) (include "kuberl.serviceAccountName" .root) $sandbox }}
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with ternary $v.sandbox.runtimeClassName $v.runtimeClassName $sandbox }}
  runtimeClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- include "kuberl.podSecurityContext" .root | nindent 4 }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "kuberl.nodeSelector" (dict "root" .root "gpu" $gpu "head" (or .head $sandbox) "extra" .group.nodeSelector) }}
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
  {{- if not $sandbox }}
  {{- with $v.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  containers:
    {{- /* KubeRay finds the Ray container at index 0: sidecars come after it. */}}
    - name: {{ ternary "ray-head" "ray-worker" .head }}
      image: {{ include "kuberl.image" .root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- include "kuberl.containerSecurityContext" (dict "root" .root "sandbox" $sandbox) | nindent 8 }}
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
      {{- else }}
      ports:
        - {name: metrics, containerPort: 8080}
      {{- end }}
      env:
        {{- include "kuberl.env" $ctx | nindent 8 }}
      {{- if not $sandbox }}
      {{- with $v.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- end }}
      resources:
        {{- if .head }}
        {{- toYaml (default dict .group.resources) | nindent 8 }}
        {{- else }}
        {{- include "kuberl.workerResources" (dict "group" .group "gpus" $gpus) | nindent 8 }}
        {{- end }}
      volumeMounts:
        {{- if $sandbox }}
        - name: dshm
          mountPath: /dev/shm
        {{- else }}
        {{- include "kuberl.volumeMounts" $ctx | nindent 8 }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- end }}
    {{- if not $sandbox }}
    {{- with $v.sidecars }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- end }}
  volumes:
    {{- if $sandbox }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .group.shmSize }}
    {{- else }}
    {{- include "kuberl.volumes" $ctx | nindent 4 }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- end }}
{{- end }}

{{/*
The `helm test` check, configured by env: RAY_HEAD (host:port of the GCS), WANT_GPUS, TIMEOUT_S,
POLL_S. `ray status` prints a line such as ` 0.0/16.0 GPU` once any GPU has joined.
*/}}
{{- define "kuberl.testScript" -}}
deadline=$((SECONDS + TIMEOUT_S))
while :; do
  if out=$(ray status --address "$RAY_HEAD" 2>&1); then
    have=$(printf '%s\n' "$out" | awk '$2 == "GPU" { split($1, a, "/"); printf "%d\n", a[2] }' | head -n 1)
    have=${have:-0}
    if [ "$have" -eq "$WANT_GPUS" ]; then
      echo "ok: ray status reports $have GPUs, as the values ask"
      exit 0
    fi
    msg="ray status reports $have GPUs; the values ask for $WANT_GPUS"
  else
    msg="ray status cannot reach the head at $RAY_HEAD"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "FAIL: $msg (waited ${TIMEOUT_S}s)"
    printf '%s\n' "$out"
    exit 1
  fi
  sleep "${POLL_S:-10}"
done
{{- end }}

{{/*
The RayCluster spec: a head with no GPUs and one worker group per entry of .Values.workerGroups.
The RayCluster and the RayJob (job.enabled) both render it. KubeRay keeps only the container ports
listed here, so every head port is listed.
*/}}
{{- define "kuberl.rayClusterSpec" -}}
rayVersion: {{ .Values.rayVersion | quote }}
{{ include "kuberl.authOptions" . }}
headGroupSpec:
  serviceType: {{ .Values.head.serviceType }}
  rayStartParams:
    {{- $head := dict "num-gpus" "0" "dashboard-host" "0.0.0.0" "port" "6379" "ray-client-server-port" "10001" "metrics-export-port" "8080" "block" "true" }}
    {{- range $k, $val := merge (deepCopy .Values.head.rayStartParams) $head }}
    {{ $k }}: {{ $val | toString | quote }}
    {{- end }}
  template:
    {{- include "kuberl.podTemplate" (dict "root" . "name" "head" "head" true "group" .Values.head) | nindent 4 }}
workerGroupSpecs:
{{- range $name, $g := .Values.workerGroups }}
  {{- /* 0 is a valid minimum, so test for null rather than use `default` */}}
  {{- $min := ternary $g.replicas $g.minReplicas (kindIs "invalid" $g.minReplicas) }}
  {{- $max := ternary $g.replicas $g.maxReplicas (kindIs "invalid" $g.maxReplicas) }}
  {{- /* KubeRay would silently clamp replicas into [min, max]: say so instead. */}}
  {{- if gt (int $g.replicas) (int $max) }}
  {{- fail (printf "workerGroups.%s.replicas (%d) is above workerGroups.%s.maxReplicas (%d): raise maxReplicas or lower replicas" $name (int $g.replicas) $name (int $max)) }}
  {{- end }}
  {{- if lt (int $g.replicas) (int $min) }}
  {{- fail (printf "workerGroups.%s.replicas (%d) is below workerGroups.%s.minReplicas (%d): lower minReplicas or raise replicas" $name (int $g.replicas) $name (int $min)) }}
  {{- end }}
  - groupName: {{ $name }}
    replicas: {{ $g.replicas }}
    minReplicas: {{ $min }}
    maxReplicas: {{ $max }}
    rayStartParams:
      {{- $worker := dict "metrics-export-port" "8080" "block" "true" }}
      {{- if not $g.gpus }}{{ $_ := set $worker "num-gpus" "0" }}{{ end }}
      {{- range $k, $val := merge (deepCopy (default dict $g.rayStartParams)) $worker }}
      {{ $k }}: {{ $val | toString | quote }}
      {{- end }}
    template:
      {{- include "kuberl.podTemplate" (dict "root" $ "name" $name "head" false "group" $g) | nindent 6 }}
{{- end }}
{{- with .Values.sandbox }}{{ if .enabled }}
{{- if hasKey $.Values.workerGroups "sandbox" }}
{{- fail "workerGroups.sandbox: the name is the sandbox group's (sandbox.enabled): rename the group" }}
{{- end }}
  {{- /* Code rewards ask for one unit of the custom resource per task (trainer/rewards/runner.py), so
  parallel compilation and test runs scale with this group's CPUs and never land on a GPU node. */}}
  - groupName: sandbox
    replicas: {{ .replicas }}
    minReplicas: {{ .replicas }}
    maxReplicas: {{ .replicas }}
    rayStartParams:
      block: "true"
      metrics-export-port: "8080"
      num-cpus: {{ .cpus | quote }}
      num-gpus: "0"
      {{- /* As KubeRay writes it itself: JSON in single quotes, for the shell that runs `ray start`. */}}
      resources: {{ printf "'{\"%s\": %d}'" .resource (int .cpus) | quote }}
    template:
      {{- $group := dict "resources" (dict "requests" (dict "cpu" (.cpus | toString) "memory" .memory) "limits" (dict "cpu" (.cpus | toString) "memory" .memory)) "nodeSelector" .nodeSelector "tolerations" .tolerations "affinity" .affinity "shmSize" .shmSize }}
      {{- include "kuberl.podTemplate" (dict "root" $ "name" "sandbox" "head" false "group" $group "sandbox" true) | nindent 6 }}
{{- end }}{{ end }}
{{- end }}

{{/*
The RayJob's entrypoint, run by a shell on the head. `exec`: the driver is then the process Ray
signals on a stop; a forked one could outlive a stop that came before the fork.
*/}}
{{- define "kuberl.jobEntrypoint" -}}
exec {{ include "kuberl.jobCommand" . }}
{{- end }}

{{/*
The RayJob's command: the experiment, resume from the latest complete checkpoint, the chart's
shared directories, then job.overrides (each single-quoted).
*/}}
{{- define "kuberl.jobCommand" -}}
{{- $v := .Values -}}
{{- $parts := list "python" "-m" "trainer" (printf "experiment=%s" (required "experiment is required when job.enabled: the Hydra experiment the RayJob runs" $v.experiment)) "checkpointing.resume=auto" }}
{{- $parts = append $parts (printf "logger.log_dir=%s" (include "kuberl.path" (dict "root" . "key" "logs"))) }}
{{- $parts = append $parts (printf "checkpointing.checkpoint_dir=%s" (include "kuberl.path" (dict "root" . "key" "checkpoints"))) }}
{{- range $v.job.overrides }}
{{- $parts = append $parts (squote .) }}
{{- end }}
{{- join " " $parts }}
{{- end }}
