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
