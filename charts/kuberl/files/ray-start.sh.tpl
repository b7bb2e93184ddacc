{{- /*
The Ray container's start-up script, a template rendered by `kuberl.startScript` (_pods.tpl) with
dict root, head, gpu; `make check-chart` runs shellcheck on it as rendered for every values file.
Comments are template comments: the script is part of the pod template, which KubeRay hashes, so a
reworded shell comment would recreate every pod of a running RayCluster.
*/ -}}
{{- $v := .root.Values -}}
ulimit -n 65536 2>/dev/null || true
mkdir -p "$KUBERL_LOG_DIR" "$KUBERL_CHECKPOINT_DIR" "$HF_HOME" "$KUBERL_CACHE"
{{- if .gpu }}
{{- $min := index .root.Chart.Annotations "kuberl.dev/min-nvidia-driver" }}
{{- /* The image's CUDA 13 wheels need an R<min>+ driver (Chart.yaml); GKE mounts the node's nvidia-smi under
/usr/local/nvidia/bin. */}}
driver=$(/usr/local/nvidia/bin/nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
if [ -n "$driver" ] && [ "${driver%%.*}" -lt {{ $min }} ] 2>/dev/null; then
  echo "kuberl: this node's NVIDIA driver $driver is older than R{{ $min }}, which the image's CUDA 13 wheels need: recreate the GPU node pool with gpu-driver-version=latest (docs/cluster.md)" >&2
  exit 1
fi
{{- end }}
{{- if and .gpu $v.rdma.enabled }}
{{- $preset := include "kuberl.gpuPreset" .root | fromYaml }}
{{- /* gIB's NCCL settings come from GKE's RDMA installer, which keeps them current for the machine type;
rdma.ncclEnv is exported after it, so an explicit value wins. */}}
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
