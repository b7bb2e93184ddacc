{{/*
Experiment trackers (values `logger`): the environment every Ray container gets, from which the
trainer's driver on the head composes `logger.backends` (KUBERL_LOGGER_BACKENDS) and the trackers read
their own settings (WANDB_PROJECT, WANDB_ENTITY, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME). The W&B
key is read from its Secret only where `wandb` is a backend: no pod holds a token it does not use.
Args: the chart root.
*/}}
{{- define "kuberl.loggerEnv" -}}
{{- $l := .Values.logger -}}
- name: KUBERL_LOGGER_BACKENDS
  value: {{ printf "[%s]" (join "," $l.backends) | quote }}
{{- if has "wandb" $l.backends }}
- name: WANDB_PROJECT
  value: {{ $l.wandb.project | quote }}
{{- with $l.wandb.entity }}
- name: WANDB_ENTITY
  value: {{ . | quote }}
{{- end }}
{{- with .Values.secrets.wandbApiKey.secretName }}
- name: WANDB_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.secrets.wandbApiKey.key }}
{{- end }}
{{- end }}
{{- if has "mlflow" $l.backends }}
- name: MLFLOW_TRACKING_URI
  value: {{ required "logger.mlflow.trackingUri is required when logger.backends has mlflow (e.g. http://mlflow.mlflow.svc:5000)" $l.mlflow.trackingUri | quote }}
{{- with $l.mlflow.experiment }}
- name: MLFLOW_EXPERIMENT_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Whether a tracker beyond TensorBoard (a server to reach) is configured: "true" or "".
*/}}
{{- define "kuberl.remoteTracker" -}}
{{- if or (has "wandb" .Values.logger.backends) (has "mlflow" .Values.logger.backends) }}true{{ end }}
{{- end }}
