#!/bin/bash
# Entry point of the job image for `docker run IMAGE CMD...` (a trainer run or `ray start` on a GPU
# VM). Under KubeRay the pod's command replaces it: the chart runs its own start-up and sets the
# same environment explicitly (charts/kuberl/templates/_helpers.tpl).
set -euo pipefail

# The node's GPU driver, and gIB's NCCL plugin on A3 Ultra / A4 nodes, when mounted.
for lib in /usr/local/gib/lib64 /usr/local/nvidia/lib64; do
  if [ -d "$lib" ] && [[ ":${LD_LIBRARY_PATH:-}:" != *":$lib:"* ]]; then
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done
# gIB's own NCCL settings for this machine type, unless the caller chose them.
if [ -z "${NCCL_NET:-}" ] && [ -f /usr/local/gib/scripts/set_nccl_env.sh ]; then
  # shellcheck disable=SC1091
  source /usr/local/gib/scripts/set_nccl_env.sh
fi
ulimit -n 65536 2>/dev/null || true
# Code rewards run the model's programs under bubblewrap or not at all, as on the chart's pods: a
# container that denies it (docker run needs --security-opt seccomp=unconfined --security-opt
# apparmor=unconfined) refuses such a run in one line. KUBERL_SANDBOX=auto allows the fallback.
export KUBERL_SANDBOX="${KUBERL_SANDBOX:-bwrap}"

if [ "$#" -eq 0 ]; then
  set -- python -m trainer --help
fi
exec "$@"
