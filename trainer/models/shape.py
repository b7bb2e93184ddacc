"""A model's shape without its weights: instantiated on the ``meta`` device from its config (exact
parameter counts for any architecture), for the memory plan (:mod:`trainer.tools.plan`) and the training
FLOPs (:mod:`trainer.perf`). The experiments' hub models have their config here too, so neither needs
a download.

A mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) also has its routing read from the config
(:class:`MoE`): each token multiplies by its router and its top-k experts only, what MFU counts
(:mod:`trainer.perf`), while every expert is stored, trained and refitted, what the plan counts. The
config's reading is checked against the model it instantiates (the experts' parameters it holds); a
family whose routing is not read here is named on the shape (``moe_error``), never counted as dense."""

from __future__ import annotations

from dataclasses import dataclass, field


class ShapeError(ValueError):
    """A model whose config cannot be read: one line naming it and the fix."""


# The hub models the experiments name, as their config.json on the hub says (the fields a meta
# instantiation needs): the plan works offline, before anything is downloaded.
KNOWN_CONFIGS: dict[str, dict] = {
    "google/gemma-3-27b-it": {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208,
            "sliding_window": 1024,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
            "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
        },
        "mm_tokens_per_image": 256,
    },
    "google/gemma-3-1b-it": {
        "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
        "sliding_window": 512,
    },
    "Qwen/Qwen2.5-Coder-7B-Instruct": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    # A reward model: Qwen3-0.6B with a one-label score head in place of the LM head.
    "Skywork/Skywork-Reward-V2-Qwen3-0.6B": {
        "model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
    # 128 experts, 8 routed per token, in all 48 layers: 30.5B parameters, 3.3B of them active per token.
    "Qwen/Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    },
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    },
}  # fmt: skip


# Mixture-of-experts families whose routing is read from the config: model_type -> (the expert count's
# field, one expert's MLP width's field). Their decoder layers route by transformers' rule for the family
# (:func:`moe_of`); Qwen2-MoE adds a shared expert every token goes through.
MOE_FAMILIES = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
}
# How other families' configs name their expert count: a config with one of these > 0 is a mixture of experts.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts decoder's routing, as its config says. Each MoE layer holds ``experts`` gated
    MLPs of width ``intermediate`` and a router (hidden x experts); a token goes through the router, its
    ``top_k`` experts and the shared expert, if any. The other layers have a dense MLP of the config's
    ``intermediate_size``."""

    family: str  # the config's model_type
    experts: int  # routed experts per MoE layer (num_experts; Mixtral's num_local_experts)
    top_k: int  # experts a token is routed to (num_experts_per_tok)
    intermediate: int  # one expert's MLP width (moe_intermediate_size; Mixtral's intermediate_size)
    layers: int  # decoder layers with routed experts
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (with its one-output sigmoid gate); 0: none


def moe_of(text) -> MoE | None:
    """The routing of a text config of a family in :data:`MOE_FAMILIES`; None for a dense model. Raises
    ShapeError for a mixture of experts of another family (what it routes is not read here)."""
    family = getattr(text, "model_type", "")
    if family not in MOE_FAMILIES:
        if any((getattr(text, f, 0) or 0) > 0 for f in EXPERT_COUNT_FIELDS):
            raise ShapeError(
                f"model_type {family} is a mixture of experts whose routing kuberl does not read "
                f"(read: {', '.join(sorted(MOE_FAMILIES))}): its active parameters are not counted"
            )
        return None
    count_field, width_field = MOE_FAMILIES[family]
    experts = getattr(text, count_field, 0) or 0
    if experts <= 0:
        return None  # Qwen-MoE configs with num_experts 0: every layer dense
    n = text.num_hidden_layers
    if family in ("mixtral", "olmoe"):  # every layer routes
        layers = n
    else:  # transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer
        dense = set(getattr(text, "mlp_only_layers", None) or [])
        step = getattr(text, "decoder_sparse_step", 1) or 1
        layers = sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)
    return MoE(
        family=family,
        experts=experts,
        top_k=text.num_experts_per_tok,
        intermediate=getattr(text, width_field),
        layers=layers,
        shared_intermediate=getattr(text, "shared_expert_intermediate_size", 0) or 0,
    )


def _check_moe(moe: MoE, model, hidden: int) -> None:
    """The config's reading against the instantiated model: the routed experts' parameters it holds (and the
    shared experts'), so that a family whose layout moved in transformers is refused, not miscounted."""
    held = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
    expected = moe.layers * moe.experts * 3 * hidden * moe.intermediate
    shared = sum(p.numel() for n, p in model.named_parameters() if ".shared_expert." in f".{n}")
    expected_shared = moe.layers * 3 * hidden * moe.shared_intermediate
    if held != expected or shared != expected_shared:
        raise ShapeError(
            f"model_type {moe.family}: the model holds {held + shared} expert parameters where its config reads "
            f"{expected + expected_shared} ({moe.layers} MoE layers x {moe.experts} experts of width "
            f"{moe.intermediate}): its active parameters are not counted (a layout kuberl does not read)"
        )


@dataclass(frozen=True)
class Shape:
    """What the memory terms need of a model: parameter counts and the text decoder's dimensions."""

    params: int  # every parameter the policy loads (tied embeddings once)
    block_params: int  # the largest FSDP unit: one decoder block
    root_params: int  # what the root unit holds (embeddings, final norm, lm_head, any vision tower)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    source: str  # where the config came from
    context: int | None = None  # max_position_embeddings of the text config: the longest input it reads
    # (in, out) features of every nn.Linear of the language model, by the module's own name (q_proj,
    # ...): LoRA's targets (trainer.models.lora adapts the language model alone, not a vision tower)
    linears: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    largest: tuple[str, int] = ("", 0)  # the parameter with the most elements: (name, elements)
    moe: MoE | None = None  # a mixture of experts' routing (None: dense, or moe_error)
    moe_error: str = ""  # a mixture of experts whose routing is not read: why (active parameters unknown)

    def adapter_params(self, rank: int, targets: list[str]) -> int:
        """Parameters of rank-``rank`` LoRA adapters (A: in x r, B: r x out) on every linear named in ``targets``."""
        return sum(rank * (i + o) for t in targets for i, o in self.linears.get(t, ()))


def known_config(name: str):
    """The ``PretrainedConfig`` of a hub model in :data:`KNOWN_CONFIGS`, built from the table; None for
    any other name. What needs a model's config before anything is downloaded can fall back on it."""
    from transformers import AutoConfig

    if name not in KNOWN_CONFIGS:
        return None
    known = dict(KNOWN_CONFIGS[name])
    return AutoConfig.for_model(known.pop("model_type"), **known)


def _hf_config(name: str, trust_remote_code: bool, key: str = "model.name"):
    from transformers import AutoConfig

    from trainer.models import resolve_model

    if name in KNOWN_CONFIGS:
        try:  # the real file when it is here (cached or local), the table otherwise
            return AutoConfig.from_pretrained(name, local_files_only=True), "hub cache"
        except OSError:
            return known_config(name), "config table (trainer/models/shape.py)"
    path = resolve_model(name)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), path
    except OSError as e:
        raise ShapeError(
            f"cannot read the config of {key}={name} ({str(e).splitlines()[0]}); "
            "download it first (huggingface-cli download NAME config.json) or give a local directory"
        ) from None


def attention_geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dimension) of ``config``'s text decoder (a multimodal config's text config), as
    transformers builds its attention: the KV heads default to the heads, the head dimension to the width over
    them. An AttributeError where the config has no attention heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return text.num_hidden_layers, kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads


def model_shape(
    name: str, trust_remote_code: bool = False, classifier: bool = False, key: str = "model.name"
) -> Shape:
    """Instantiate ``name`` on the meta device, as the policy loads it, and count; ``classifier``: as a
    reward model loads (a sequence classifier with one label: a score head, no LM head); ``key``: the
    setting that names it, for the error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config, source = _hf_config(name, trust_remote_code, key)
    with torch.device("meta"):
        if classifier:
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(
                config, trust_remote_code=trust_remote_code
            )
        else:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    total = sum(p.numel() for p in model.parameters())
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    decoder = [b for b in blocks if hasattr(b, "mlp")] or blocks  # the text decoder's blocks
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    from trainer.models.lora import language_linears

    linears: dict[str, list[tuple[int, int]]] = {}
    modules = dict(model.named_modules())
    for module_name in language_linears(model):
        module = modules[module_name]
        linears.setdefault(module_name.rsplit(".", 1)[-1], []).append(
            (module.in_features, module.out_features)
        )
    largest = max(((n, p.numel()) for n, p in model.named_parameters()), key=lambda kv: kv[1])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    moe, moe_error = None, ""
    try:
        moe = moe_of(text)
        if moe is not None:
            _check_moe(moe, model, text.hidden_size)
    except ShapeError as e:  # the shape still holds: only what a token multiplies by is unknown
        moe, moe_error = None, str(e)
    layers, kv_heads, head_dim = attention_geometry(config)
    return Shape(
        params=total,
        block_params=max((sum(p.numel() for p in b.parameters()) for b in decoder), default=0),
        root_params=total - in_blocks,
        layers=layers,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        source=str(source),
        context=getattr(text, "max_position_embeddings", None),
        linears={k: tuple(v) for k, v in linears.items()},
        largest=largest,
        moe=moe,
        moe_error=moe_error,
    )
