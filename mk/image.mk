# The job image: its pinned Python dependencies, build and push. One tag story: the image tag is the
# chart's appVersion (charts/kuberl/Chart.yaml), which is also what the chart runs when image.tag is empty.
.PHONY: lock image push cloud-image

IMAGE_REPO     ?=
IMAGE_TAG      ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' $(CHART)/Chart.yaml)
DOCKER         ?= docker
UV             := $(VENV)/bin/uv
LOCK           := docker/requirements.lock
MODEL_LOCK     := docker/model.lock
# The GPU image's interpreter and platform: python:3.11-slim-bookworm (glibc 2.36) on x86_64.
LOCK_PLATFORM  := --python-version 3.11 --python-platform x86_64-manylinux_2_36
LOCK_FLAGS     := $(LOCK_PLATFORM) --generate-hashes --custom-compile-command "make lock"
NEED_REPO       = @test -n "$(IMAGE_REPO)" || { echo "IMAGE_REPO is not set: make $@ IMAGE_REPO=us-docker.pkg.dev/PROJECT/kuberl/kuberl (the chart's image.repository)"; exit 2; }

lock: setup ## Re-pin the GPU image's dependencies (docker/requirements.lock, with hashes) and the chart's rayVersion
	$(UV) pip compile pyproject.toml --extra vllm --extra tracking --extra envs $(LOCK_FLAGS) --quiet -o $(LOCK)
	$(UV) pip compile docker/model.in --no-deps $(LOCK_FLAGS) --quiet -o $(MODEL_LOCK)
	@ray=$$(sed -n 's/^ray==\([^ ]*\).*/\1/p' $(LOCK)) && test -n "$$ray" && \
	  sed -i "s/^rayVersion: .*/rayVersion: \"$$ray\"/" $(CHART)/values.yaml && \
	  echo "==> $(LOCK): ray $$ray (charts/kuberl rayVersion), $$(grep -c '^[a-z0-9]' $(LOCK)) packages"

image: ## Build the job image as IMAGE_REPO:IMAGE_TAG (IMAGE_TAG defaults to the chart's appVersion)
	$(NEED_REPO)
	$(DOCKER) build -f docker/Dockerfile -t "$(IMAGE_REPO):$(IMAGE_TAG)" .

# Without a local Docker engine: Cloud Build builds docker/Dockerfile from this directory (what
# .gitignore leaves out is not uploaded) and pushes the same tag.
cloud-image: ## Build and push IMAGE_REPO:IMAGE_TAG with Cloud Build instead of a local docker (REGION=...)
	$(NEED_REPO)
	@command -v gcloud >/dev/null || { echo "make cloud-image needs the gcloud CLI (docs/cluster.md, prerequisites)"; exit 2; }
	gcloud builds submit . --config docker/cloudbuild.yaml $(if $(REGION),--region $(REGION)) \
	  --substitutions _IMAGE="$(IMAGE_REPO):$(IMAGE_TAG)"

push: ## Push IMAGE_REPO:IMAGE_TAG and print its digest (for image.tag: "@sha256:...")
	$(NEED_REPO)
	$(DOCKER) push "$(IMAGE_REPO):$(IMAGE_TAG)"
	@$(DOCKER) inspect --format '{{index .RepoDigests 0}}' "$(IMAGE_REPO):$(IMAGE_TAG)" 2>/dev/null \
	  | sed 's/^.*@/digest: image.tag=@/' || true
