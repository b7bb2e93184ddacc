{{/*
Shared storage: the paths under storage.mountPath, the gcsfuse and Lustre volumes and their mounts,
and the Lustre PV/PVC names.
*/}}

{{/*
Directories on shared storage: `<mountPath>/<paths.KEY>`, and for logs and checkpoints then
`/<namespace>/<release>` (storage.perRelease), so each release has a checkpoint lineage of its own: a
second release of the same experiment never resumes from, prunes or cleans up the first one's
checkpoints (the trainer appends `/<experiment>`). The HF and model caches stay shared: they are caches.
Args: dict root, key (a key of storage.paths).
*/}}
{{- define "kuberl.path" -}}
{{- $s := .root.Values.storage }}
{{- $path := printf "%s/%s" ($s.mountPath | trimSuffix "/") (get $s.paths .key | trimSuffix "/") }}
{{- if and $s.perRelease (has .key (list "logs" "checkpoints")) }}
{{- $path = printf "%s/%s/%s" $path .root.Release.Namespace .root.Release.Name }}
{{- end }}
{{- $path }}
{{- end }}

{{/* Who owns the release's lineage (KUBERL_RELEASE): `<namespace>/<release>`, the same for every attempt
of a RayJob, so a retry recognises the checkpoint lease its earlier attempt held. */}}
{{- define "kuberl.release" -}}
{{- printf "%s/%s" .Release.Namespace .Release.Name }}
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

{{/* Volumes of a Ray pod. Args: dict root, gpu (bool), head (bool). */}}
{{- define "kuberl.volumes" -}}
{{- $v := .root.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSize }}
{{ include "kuberl.storageVolumes" . }}
{{- if and .gpu $v.rdma.enabled }}
- name: nvidia-libs
  hostPath:
    path: /home/kubernetes/bin/nvidia
- name: gib
  hostPath:
    path: /home/kubernetes/bin/gib
{{- end }}
{{- end }}

{{/*
The shared storage's volumes: `shared` (the read-write mount) and, with storage.models.enabled on gcsfuse,
`models` (the read-only view). Args: dict root, head (bool: the head's file cache, else a worker's),
noFileCache (bool: none at all, whatever fileCache says: the reward server reads its weights once).
*/}}
{{- define "kuberl.storageVolumes" -}}
{{- $v := .root.Values -}}
{{- $none := dict "head" "0" "worker" "0" -}}
- name: shared
{{- if eq $v.storage.type "gcsfuse" }}
  csi:
    driver: gcsfuse.csi.storage.gke.io
    volumeAttributes:
      bucketName: {{ required "storage.gcsfuse.bucketName is required when storage.type=gcsfuse" $v.storage.gcsfuse.bucketName | quote }}
      mountOptions: {{ $v.storage.gcsfuse.mountOptions | quote }}
      {{- include "kuberl.gcsfuseAttributes" (dict "attrs" $v.storage.gcsfuse.volumeAttributes "fileCache" (ternary $none $v.storage.gcsfuse.fileCache (eq .noFileCache true)) "head" .head "key" "storage.gcsfuse") | nindent 6 }}
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
      {{- include "kuberl.gcsfuseAttributes" (dict "attrs" $m.gcsfuse.volumeAttributes "fileCache" (ternary $none $m.gcsfuse.fileCache (eq .noFileCache true)) "head" .head "key" "storage.models.gcsfuse") | nindent 6 }}
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
