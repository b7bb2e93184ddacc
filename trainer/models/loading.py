"""Loading a resolved model directory (or hub id) into transformers objects.

Everything that builds a model or a tokenizer goes through here: the policy ranks, the hf engine,
evaluation and the benchmarks, so dtype names, the pad-token default and remote-code handling are
decided once. :func:`build_empty_model` is the same model without its weights (on the meta device),
which a policy rank shards before it holds any of them (:mod:`trainer.policy.sharded_init`).
"""

from __future__ import annotations

import torch

# The config's dtype names (model.dtype, policy.param_dtype, generation.dtype once ``auto`` is resolved).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    path: str, dtype: str, trust_remote_code: bool = False, attn_implementation: str | None = None
) -> torch.nn.Module:
    """A causal LM in ``dtype`` (a name of :data:`DTYPES`), on the CPU."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **kwargs
    )


def build_empty_model(
    path: str, dtype: str, trust_remote_code: bool = False, attn_implementation: str | None = None
) -> torch.nn.Module:
    """The model :func:`load_model` returns, built on the meta device: every parameter and buffer has its
    shape and dtype but no storage, and nothing is read but the config. In eval mode, as
    ``from_pretrained`` returns a model, so both give the same module flags."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **kwargs
        )
    return model.eval()


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The model's tokenizer; one without a pad token pads with EOS (batched generation needs one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
