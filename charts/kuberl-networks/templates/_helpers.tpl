{{/*
The multi-network objects, as a list of {name, deviceMode, vpc, subnet}: `gvnic-1` for socket
traffic and `rdma-0`... for GPUDirect RDMA. kuberl's pod annotations (`networking.gke.io/interfaces`)
name them so.
*/}}
{{- define "kuberl-networks.items" -}}
{{- $nets := list (dict "name" "gvnic-1" "deviceMode" "NetDevice" "vpc" (required "gvnic.vpc is required: the VPC of the GPU pool's second gVNIC" .Values.gvnic.vpc) "subnet" (required "gvnic.subnet is required: the subnet of the GPU pool's second gVNIC" .Values.gvnic.subnet)) }}
{{- range $i := until (int .Values.nics) }}
{{- $nets = append $nets (dict "name" (printf "rdma-%d" $i) "deviceMode" "RDMA" "vpc" (required "roce.vpc is required: the VPC of the GPU pool's RDMA NICs" $.Values.roce.vpc) "subnet" (printf "%s-%d" (required "roce.subnetPrefix is required: RDMA subnet i is <subnetPrefix>-<i>" $.Values.roce.subnetPrefix) $i)) }}
{{- end }}
{{- toYaml (dict "items" $nets) }}
{{- end }}

{{- define "kuberl-networks.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Kept by `helm uninstall` (and by an upgrade that would drop one): running RDMA pods use these networks,
and deleting one under them cuts their NICs. A platform that means to remove them deletes them with
kubectl once no pod uses them.
*/}}
{{- define "kuberl-networks.annotations" -}}
helm.sh/resource-policy: keep
{{- end }}
