"""A tiny randomly initialised Llama and a character-level ChatML tokenizer, built with no download.

The vocabulary is a few dozen characters (digits, arithmetic signs, lower-case letters) so that an
untrained model already emits digits often enough for a reward on arithmetic to be non-zero: that is
what lets a CPU test check that GRPO actually learns. Input is lower-cased before lookup so prompts with
capitals still encode; characters outside the vocabulary become ``<unk>``.
"""

from __future__ import annotations

import string

PAD, UNK, IM_START, IM_END = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, UNK, IM_START, IM_END]
DEFAULT_VOCAB_CHARS = string.digits + "+-*/=?.,:()" + " \n" + string.ascii_lowercase

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer(vocab_chars: str = DEFAULT_VOCAB_CHARS):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``vocab_chars`` plus the specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(vocab_chars))  # de-duplicated, order kept so ids are stable
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per char
    tok.decoder = decoders.Fuse()  # join the pieces back without separators
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=IM_START,
        eos_token=IM_END,
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(
    out_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,  # head_dim 32: vLLM's CPU attention needs head_dim >= 32
    intermediate_size: int | None = None,
    seed: int = 0,
    vocab_chars: str = DEFAULT_VOCAB_CHARS,
    embed_scale: int = 1,
    experts: int = 0,
) -> str:
    """Write a tiny Llama (safetensors, config, generation config) and its tokenizer to ``out_dir``.

    The weights depend only on the arguments: the same ``seed`` gives the same tensors.

    ``embed_scale`` multiplies the (tied) embeddings after initialisation. At 1 the logits span about
    +-1.3 (an RMS-normed hidden state of norm sqrt(hidden_size) = 8 against embedding rows of norm 0.16),
    so a policy that cannot change the embeddings, the final norm or lm_head (LoRA on the linear layers)
    tops out near p = 0.07 for any token; at 3 it can reach p ~ 0.5 while the start stays near uniform
    (at 12 the random model is confidently wrong on every prompt and never earns a reward).

    ``experts`` > 0 builds a mixture of experts instead (``builtin:tiny?experts=4``): a Qwen3-MoE of the same
    sizes whose every layer routes each token to 2 of ``experts`` experts of ``intermediate_size`` (Qwen3's
    q/k norms too), the class vLLM and the trainer both run.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}")
    tokenizer = build_tiny_tokenizer(vocab_chars)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=2048,  # RoPE: costs no parameters, leaves room for system prompts
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if experts < 0 or experts == 1:
        raise ValueError(f"experts={experts} must be 0 (a dense Llama) or at least 2")
    if experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **common,
            head_dim=hidden_size // num_heads,
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=intermediate_size or 2 * hidden_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        model_class = Qwen3MoeForCausalLM
    else:
        config = LlamaConfig(**common)
        model_class = LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
        if embed_scale != 1:
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(embed_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
