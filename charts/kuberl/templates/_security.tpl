{{/*
What a pod may do: the chart's security contexts (the sandbox service's loosened one). The privileges a
pod keeps are listed, each with its reason, in checkov's config files beside the templates
(charts/kuberl/checkov/), not in the pods: KubeRay hashes the pod templates, so text there would
recreate a running cluster whenever it changed.
*/}}

{{/*
securityContext of a Ray container (and of the sandbox service's, `sandbox`), then containerSecurityContext
over it. Every container drops every capability (NET_RAW included) and cannot gain privileges; seccomp is
the pod's RuntimeDefault (kuberl.podSecurityContext). The sandbox service's container alone
(sandbox.enabled) is loosened as bubblewrap needs it: it makes user, mount, PID and network namespaces and
mounts tmpfs in them, which containerd's default seccomp profile (unshare/clone of namespaces without
CAP_SYS_ADMIN) and the cri-containerd.apparmor.d profile of GKE's Container-Optimized OS (mount) deny, so
seccomp and AppArmor are `Unconfined` there; bubblewrap puts its own seccomp filter on every program
(trainer/sandbox/seccomp.py), and the server refuses to start without it. Its container drops every
capability too but adds back three that Pod Security baseline allows: bwrap runs as root, and the kernel
lets it map root into the user namespace it makes only with SETFCAP in its bounding set; the sandbox then
drops to a private uid (SETUID, SETGID). Its root file system is read-only (scratch is an emptyDir at
/tmp). Nothing is privileged. Under GKE Sandbox (sandbox.runtimeClassName: gvisor) gVisor implements those
namespaces itself, and the profiles stay at their defaults. Args: dict root, sandbox (bool).
*/}}
{{- define "kuberl.containerSecurityContext" -}}
{{- $sc := dict "allowPrivilegeEscalation" false "capabilities" (dict "drop" (list "ALL")) }}
{{- if .sandbox }}
{{- $_ := set $sc "capabilities" (dict "drop" (list "ALL") "add" (list "SETFCAP" "SETGID" "SETUID")) }}
{{- $_ := set $sc "readOnlyRootFilesystem" true }}
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
