{{/*
Names, labels, the image, the RayCluster spec and the RayJob's command. The rest by concern: _pods.tpl
(the Ray pod template), _security.tpl, _scheduling.tpl, _storage.tpl, _auth.tpl, _logger.tpl; the
bash scripts in files/.
*/}}

{{- define "kuberl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The RayCluster (or RayJob) name. KubeRay names the head service `<name>-head-svc` and pods
`<name>-<group>-worker-<suffix>`, so dots (helm allows them in release names) become dashes, and the
name is cut to the one limit in Chart.yaml (`kuberl.dev/max-name-length`: KubeRay's 47 for RayJobs),
which trainer/tools/submit.py reads too, so `make submit` finds the head service of any release name.
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
The sandbox service's service account: one of its own, with no Workload Identity annotation, so the
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

{{/* Total GPUs the worker groups ask for: what `helm test` expects `ray status` to report. */}}
{{- define "kuberl.totalGpus" -}}
{{- $total := 0 }}
{{- range $name, $g := .Values.workerGroups }}
{{- $total = add $total (mul (int $g.replicas) (int (default 0 $g.gpus))) }}
{{- end }}
{{- $total }}
{{- end }}

{{/*
Custom Ray resources a worker group offers (`ray start --resources`), from a map {NAME: units}: as
KubeRay writes it itself, JSON in single quotes for the shell that runs `ray start`, keys in order so
that two renders agree. Tasks and actors that ask for a unit of NAME run only on that group's pods: a
reward-model group's `reward_model.resource`.
*/}}
{{- define "kuberl.rayResources" -}}
{{- $parts := list }}
{{- range $k := keys . | sortAlpha }}
{{- $parts = append $parts (printf "\"%s\": %d" $k (int (get $ $k))) }}
{{- end }}
{{- printf "'{%s}'" (join ", " $parts) }}
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
      {{- with $g.rayResources }}
      {{- if hasKey (default dict $g.rayStartParams) "resources" }}
      {{- fail (printf "workerGroups.%s: rayStartParams.resources and rayResources both set: keep rayResources" $name) }}
      {{- end }}
      {{- $_ := set $worker "resources" (include "kuberl.rayResources" .) }}
      {{- end }}
      {{- range $k, $val := merge (deepCopy (default dict $g.rayStartParams)) $worker }}
      {{ $k }}: {{ $val | toString | quote }}
      {{- end }}
    template:
      {{- include "kuberl.podTemplate" (dict "root" $ "name" $name "head" false "group" $g) | nindent 6 }}
{{- end }}
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
shared directories, the reward server's address and name (rewardServer.enabled), then job.overrides (each
single-quoted).
*/}}
{{- define "kuberl.jobCommand" -}}
{{- $v := .Values -}}
{{- $parts := list "python" "-m" "trainer" (printf "experiment=%s" (required "experiment is required when job.enabled: the Hydra experiment the RayJob runs" $v.experiment)) "checkpointing.resume=auto" }}
{{- $parts = append $parts (printf "logger.log_dir=%s" (include "kuberl.path" (dict "root" . "key" "logs"))) }}
{{- $parts = append $parts (printf "checkpointing.checkpoint_dir=%s" (include "kuberl.path" (dict "root" . "key" "checkpoints"))) }}
{{- if $v.rewardServer.enabled }}
{{- with include "kuberl.rewardServerOverrides" . }}{{ $parts = append $parts . }}{{ end }}
{{- end }}
{{- range $v.job.overrides }}
{{- $parts = append $parts (squote .) }}
{{- end }}
{{- join " " $parts }}
{{- end }}

{{/* The labels that select the sandbox service's pods (its Deployment, Service and NetworkPolicy). */}}
{{- define "kuberl.sandboxSelectorLabels" -}}
{{ include "kuberl.selectorLabels" . }}
kuberl.dev/role: sandbox
{{- end }}

{{/*
The reward model server (rewardServer.enabled): the labels that select its pods (its Deployment, Service
and NetworkPolicy), its address as the Ray pods call it, and the name it answers to.
*/}}
{{- define "kuberl.rewardServerSelectorLabels" -}}
{{ include "kuberl.selectorLabels" . }}
kuberl.dev/role: reward-server
{{- end }}

{{- define "kuberl.rewardServerUrl" -}}
http://{{ include "kuberl.fullname" . }}-reward-server.{{ .Release.Namespace }}.svc:{{ .Values.rewardServer.port }}
{{- end }}

{{- define "kuberl.rewardServerModel" -}}
{{- .Values.rewardServer.servedModelName | default .Values.rewardServer.model }}
{{- end }}

{{/*
"true" when rewardServer.model is a path on the release's shared storage (an absolute path, which vLLM
reads as a directory), empty when it is a Hugging Face Hub id. A path must lie under storage.mountPath, or
under storage.models.mountPath with storage.models.enabled: the server mounts nothing else, and vLLM would
otherwise take the path for a Hub id it cannot fetch, or crash-loop on a directory that is not there.
*/}}
{{- define "kuberl.rewardServerModelOnStorage" -}}
{{- $v := .Values }}
{{- $model := required "rewardServer.model is required when rewardServer.enabled: a directory on the release's shared storage (/data/...) or a Hugging Face Hub id" $v.rewardServer.model }}
{{- if hasPrefix "/" $model }}
{{- $roots := list ($v.storage.mountPath | trimSuffix "/") }}
{{- if $v.storage.models.enabled }}{{ $roots = append $roots ($v.storage.models.mountPath | trimSuffix "/") }}{{ end }}
{{- $under := false }}
{{- range $roots }}{{ if hasPrefix (printf "%s/" .) $model }}{{ $under = true }}{{ end }}{{ end }}
{{- if not $under }}
{{- fail (printf "rewardServer.model %s is not on the release's shared storage: give a directory under %s, or a Hugging Face Hub id" $model (join " or " $roots)) }}
{{- end }}
{{- print "true" }}
{{- end }}
{{- end }}

{{/*
The Hydra overrides the RayJob's entrypoint gets for the reward server (rewardServer.enabled):
reward_server.url (its Service) and reward_server.model (the name it answers to), each unless
job.overrides already sets that key (Hydra refuses a key given twice).
*/}}
{{- define "kuberl.rewardServerOverrides" -}}
{{- $given := list }}
{{- range .Values.job.overrides }}
{{- $given = append $given (regexReplaceAll "^[+~]+" (first (splitList "=" .)) "") }}
{{- end }}
{{- $parts := list }}
{{- if not (has "reward_server.url" $given) }}
{{- $parts = append $parts (printf "reward_server.url=%s" (include "kuberl.rewardServerUrl" .)) }}
{{- end }}
{{- if not (has "reward_server.model" $given) }}
{{- $parts = append $parts (squote (printf "reward_server.model=%s" (include "kuberl.rewardServerModel" .))) }}
{{- end }}
{{- join " " $parts }}
{{- end }}
