{{/*
Where a Ray pod runs: the GPU preset, node selectors, the on-demand node affinity and tolerations.
*/}}

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

{{/*
Node selector. Args: dict root, gpu (bool), head (bool), extra (map), noFileCache (bool: a pod that keeps no
gcsfuse file cache whatever storage.gcsfuse.fileCache says, the reward server, needs no local SSD).
*/}}
{{- define "kuberl.nodeSelector" -}}
{{- $v := .root.Values -}}
{{- $s := dict -}}
{{- if and (not .head) (not .noFileCache) (include "kuberl.workerFileCache" .root) }}
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
and need not taint them), added to every node selector term the group gives; then the sandbox
service's pod anti-affinity (kuberl.apartFromSandboxes). Args: dict root, gpu (bool), extra (map).
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
{{- include "kuberl.apartFromSandboxes" (dict "root" .root "affinity" $a) }}
{{- end }}

{{/*
An affinity (`affinity`, a map) with the term that keeps model code's nodes apart from every pod that
holds a token, added to its required pod anti-affinity, when sandbox.enabled; YAML, or nothing when
empty. `sandbox` true: the sandbox service's pods keep off every node that runs a kuberl pod other than a
sandbox (Ray pods, RayJob submitters, `helm test` pods); false (every other pod of the release): off every
node that runs a kuberl sandbox pod. Per node (kubernetes.io/hostname), in every namespace (an empty
namespaceSelector), so another release's token keeps off them too. The scheduler applies a required anti-
affinity both ways (an existing pod's term keeps a new pod out), so either term alone would do; both are
rendered so that each pod says what it keeps off. Args: dict root, affinity (map), sandbox (bool).
*/}}
{{- define "kuberl.apartFromSandboxes" -}}
{{- $a := deepCopy (default dict .affinity) }}
{{- if .root.Values.sandbox.enabled }}
{{- $selector := dict "matchLabels" (dict "app.kubernetes.io/name" (include "kuberl.name" .root) "kuberl.dev/role" "sandbox") }}
{{- if .sandbox }}
{{- $selector = dict "matchLabels" (dict "app.kubernetes.io/name" (include "kuberl.name" .root)) "matchExpressions" (list (dict "key" "kuberl.dev/role" "operator" "NotIn" "values" (list "sandbox"))) }}
{{- end }}
{{- $term := dict "labelSelector" $selector "namespaceSelector" (dict) "topologyKey" "kubernetes.io/hostname" }}
{{- $paa := default dict $a.podAntiAffinity }}
{{- $req := default list (get $paa "requiredDuringSchedulingIgnoredDuringExecution") }}
{{- $_ := set $paa "requiredDuringSchedulingIgnoredDuringExecution" (append $req $term) }}
{{- $_ := set $a "podAntiAffinity" $paa }}
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
