{{/*
Ray's token auth: where the token's Secret is (KubeRay's own, or auth.existingSecret), KubeRay's
authOptions, and the variables a container that is not a Ray container needs to talk to the cluster.
*/}}

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
The release's own bearer tokens, never Ray's: the sandbox service's (sandbox.enabled), the generation
endpoint's (generationEndpoint.enabled) and the reward server's API key (rewardServer.enabled), each in a
Secret of the release (secret.yaml) under key `token`, or in the existing Secret the values name (GitOps).
A harness or a sandbox escape that holds one of them can call that service and nothing else: no Ray job,
no Ray dashboard.
*/}}
{{- define "kuberl.sandboxSecret" -}}
{{- .Values.sandbox.existingSecret | default (printf "%s-sandbox" (include "kuberl.fullname" .)) }}
{{- end }}

{{- define "kuberl.endpointSecret" -}}
{{- .Values.generationEndpoint.existingSecret | default (printf "%s-endpoint" (include "kuberl.fullname" .)) }}
{{- end }}

{{- define "kuberl.rewardServerSecret" -}}
{{- .Values.rewardServer.existingSecret | default (printf "%s-reward-server" (include "kuberl.fullname" .)) }}
{{- end }}

{{/*
A generated token's value, base64 as a Secret's data holds it: the live Secret's, when `helm upgrade` or
`helm install` finds one (read back from the cluster), so that the token stays what the running pods read; else 48 random
characters, once. `helm template` and `--dry-run=client` see no cluster and render a new one each time: a
GitOps tool names an existing Secret instead (sandbox.existingSecret, generationEndpoint.existingSecret).
Args: dict root, name (the Secret's).
*/}}
{{- define "kuberl.generatedToken" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- $token := "" }}
{{- if $live }}{{ $token = index (default dict $live.data) "token" | default "" }}{{ end }}
{{- $token | default (randAlphaNum 48 | b64enc) }}
{{- end }}

{{/* Where the Ray containers read the sandbox service's token: its Secret's file, mounted read-only. */}}
{{- define "kuberl.sandboxTokenDir" -}}
/var/run/secrets/kuberl/sandbox
{{- end }}

{{- define "kuberl.sandboxTokenPath" -}}
{{ include "kuberl.sandboxTokenDir" . }}/token
{{- end }}

{{/*
The sandbox token's volume, in the sandbox pods and in the Ray pods (its callers) alone: key `token`
only, readable by root and the pod's fsGroup only.
*/}}
{{- define "kuberl.sandboxTokenVolume" -}}
- name: sandbox-token
  secret:
    secretName: {{ include "kuberl.sandboxSecret" . }}
    defaultMode: 0440
    items:
      - {key: token, path: token}
{{- end }}

{{/* The sandbox service's address as the Ray pods call it (trainer/sandbox/remote.py). */}}
{{- define "kuberl.sandboxUrl" -}}
http://{{ include "kuberl.fullname" . }}-sandbox.{{ .Release.Namespace }}.svc:8090
{{- end }}
