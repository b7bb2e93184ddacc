{{/*
What a Ray pod may do: the restricted security contexts (the sandbox group's loosened one), and the
privileges a pod keeps, each with its reason, as checkov's skip annotations.
*/}}

{{/*
securityContext of a Ray container, then containerSecurityContext over it. Every container drops every
capability (NET_RAW included) and cannot gain privileges; seccomp is the pod's RuntimeDefault
(kuberl.podSecurityContext). The sandbox group alone (sandbox.enabled) is loosened as bubblewrap needs
it: it makes user, mount, PID and network namespaces and mounts tmpfs in them, which containerd's
default seccomp profile (unshare/clone of namespaces without CAP_SYS_ADMIN) and the
cri-containerd.apparmor.d profile of GKE's Container-Optimized OS (mount) deny, so seccomp and AppArmor
are `Unconfined` there. Its container drops every capability too but adds back three that Pod Security
baseline allows: bwrap runs as root, and the kernel lets it map root into the user namespace it makes
only with SETFCAP in its bounding set; the sandbox then drops to a private uid (SETUID, SETGID).
Nothing is privileged. Under GKE Sandbox (sandbox.runtimeClassName: gvisor) gVisor implements those
namespaces itself, and the profiles stay at their defaults. Args: dict root, sandbox (bool).
*/}}
{{- define "kuberl.containerSecurityContext" -}}
{{- $sc := dict "allowPrivilegeEscalation" false "capabilities" (dict "drop" (list "ALL")) }}
{{- if .sandbox }}
{{- $_ := set $sc "capabilities" (dict "drop" (list "ALL") "add" (list "SETFCAP" "SETGID" "SETUID")) }}
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
{{- $skips = append $skips "CKV_K8S_25=bubblewrap, run as root, maps root into its user namespace (SETFCAP) and drops to a private uid (SETUID, SETGID): added back after ALL is dropped, each allowed by Pod Security baseline" }}
{{- else if contains "secretKeyRef" (include "kuberl.env" .ctx) }}
{{- $skips = append $skips "CKV_K8S_35=HF_TOKEN, WANDB_API_KEY and KubeRay's RAY_AUTH_TOKEN are read from the environment by their libraries; the sandbox group gets none" }}
{{- end }}
{{- range $i, $s := $skips }}
checkov.io/skip{{ add1 $i }}: {{ $s | quote }}
{{- end }}
{{- end }}
