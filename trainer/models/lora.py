"""LoRA policies (``policy.lora``): low-rank adapters from ``peft`` on the policy and its engines.

The adapters are injected in place (``peft.inject_adapter_in_model``), so the model keeps its class and
its module tree: an adapted linear ``q_proj`` becomes a ``peft`` LoRA layer holding the frozen original
as ``q_proj.base_layer`` and the adapter as ``q_proj.lora_A.default`` / ``q_proj.lora_B.default``.
FSDP2 then shards the block as before, frozen base weights and trainable adapters alike; only the
adapters have gradients, so only theirs are reduced, and only they are in the optimizer.

- The KL reference is the same model with its adapters switched off (:func:`adapters_disabled`): no
  second model is loaded.
- A refit moves the adapters alone, under the policy's own names (:func:`is_adapter`); an engine that
  applies them as an adapter (the hf engine: the same injection on its copy; vLLM: a LoRA request)
  maps them itself.
- On disk an adapter is a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``,
  tensors named ``base_model.model.<module>.lora_A.weight``), which plain ``peft`` and vLLM load
  (:func:`save_adapter`); :func:`merged_state_dict` folds the adapters into Hugging Face weights.

Choices, measured with ``bench/bench_lora_refit.py`` (the figures, with their machine, are in
bench/README.md, ``make bench-lora-refit``):

- The base stays FSDP-sharded like full weights (not replicated): one code path with the GPU layout,
  1/N of the base per rank, and a refit gathers the adapters tensor by tensor (``full_tensor``), never
  a whole unit, so sharding costs the refit nothing. Replication was not measured.
- hf engine: the adapters are applied, not merged: a refit copies them, a small share of a full
  refit, where merging each step (``W + s B @ A`` for every adapted weight, then loading them) cost
  several full refits; merging also drifts in a bf16 engine.
- vLLM, colocated: a PEFT directory on /dev/shm loaded in place (``add_lora`` with ``load_inplace``),
  a small share of ``update_weights`` of the full state. Disaggregated: the same weight-transfer group
  as full weights, in buckets of their own, received into a collector and loaded the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator

import torch

from trainer.config import ConfigError, LoRAConfig

ADAPTER = "default"  # peft's adapter name; the policy has one
PEFT_PREFIX = "base_model.model."  # what a PEFT adapter directory prefixes every tensor name with
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
LORA_FILE = (
    "lora.json"  # in a checkpoint's policy/: the LoRA settings and the base model (the weights are adapters)
)


def peft_config(lora: LoRAConfig, base_model: str | None = None, modules: list[str] | None = None):
    """peft's config; ``modules``: the full names of the layers to adapt (else any named as a target)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.scaling_alpha,
        lora_dropout=lora.dropout,
        target_modules=list(modules if modules is not None else lora.target_modules),
        bias="none",
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM",
    )


def language_linears(model: torch.nn.Module) -> list[str]:
    """Full names of the linear layers of ``model``'s language model, the only ones adapters go on.

    A multimodal model (Gemma 3) also has a vision tower whose attention names its layers ``q_proj``,
    ``k_proj``, ``v_proj``: peft would adapt those too, and vLLM serves adapters on the language model
    alone. ``get_decoder()`` is the text decoder (``model.language_model`` in Gemma 3, ``model`` in a
    plain causal LM); ``lm_head`` and the multimodal projector are outside it, as in peft's defaults."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    inside = {id(m) for m in decoder.modules()} if isinstance(decoder, torch.nn.Module) else None
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and (inside is None or id(m) in inside)
    ]


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every linear layer of the language model (what target_modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name in language_linears(model)})


def target_names(model: torch.nn.Module, lora: LoRAConfig) -> list[str]:
    """Full names of the layers ``policy.lora.target_modules`` adapts: in the language model only."""
    return [name for name in language_linears(model) if name.rsplit(".", 1)[-1] in lora.target_modules]


def check_targets(model: torch.nn.Module, lora: LoRAConfig, what: str = "the model") -> None:
    """Every ``policy.lora.target_modules`` entry names a linear layer of ``model``: one line otherwise."""
    have = linear_names(model)
    for target in lora.target_modules:
        if target not in have:
            raise ConfigError(
                f"policy.lora.target_modules: {what} has no linear layer named {target!r}; "
                f"its linear layers: {', '.join(have)}"
            )


def check_model(model_path: str, lora: LoRAConfig, trust_remote_code: bool = False) -> None:
    """:func:`check_targets` on the model at ``model_path``, built on the meta device (no weights read):
    for the driver, before any worker starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    check_targets(model, lora, f"model {model_path}")


def apply(model: torch.nn.Module, lora: LoRAConfig) -> torch.nn.Module:
    """Inject adapters into ``model`` in place and freeze everything else; the adapters in float32. The adapters start as peft
    starts them (A random, B zero: the adapted model equals the base), from torch's global generator, so
    ranks seeded alike get equal adapters."""
    from peft import inject_adapter_in_model

    check_targets(model, lora)
    # By full name: a short name would also match the vision tower's layers of a multimodal model.
    inject_adapter_in_model(peft_config(lora, modules=target_names(model, lora)), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
        if is_adapter(name) and param.dtype in (torch.bfloat16, torch.float16):
            # Frozen base weights may be bf16 (half the memory; they never take an update), but the
            # adapters are master weights: bf16 would round away small updates (peft computes in their dtype).
            param.data = param.data.float()
    return model


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to an adapter (peft's ``lora_A``/``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def _tuner_layers(model: torch.nn.Module):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter off while the block runs (the KL reference). Only the flag each
    peft layer's forward reads is set, so nothing else (``requires_grad``, FSDP's state) changes."""
    layers = _tuner_layers(model)
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


# ----- names ----------------------------------------------------------------------------------------


def peft_name(name: str) -> str:
    """Policy name -> the name in a PEFT adapter file: ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
    -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return PEFT_PREFIX + name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER}.", ".lora_B."
    )


def base_name(name: str) -> str:
    """Policy name of a frozen base weight -> its Hugging Face name (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


# ----- files ----------------------------------------------------------------------------------------


def save_adapter(
    directory: str,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    lora: LoRAConfig,
    base_model: str | None = None,
) -> str:
    """Write a PEFT adapter directory from the adapter tensors (policy names); returns ``directory``.
    The tensors file is written to a temporary name and renamed, so a reader never sees half of it."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {peft_name(n): t.detach().to("cpu").contiguous() for n, t in named_tensors}
    tmp = os.path.join(directory, ADAPTER_FILE + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(directory, ADAPTER_FILE))
    cfg = peft_config(lora, base_model).to_dict()
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(cfg, f, indent=2, default=str)
    return directory


def read_adapter_config(directory: str) -> LoRAConfig:
    """The ``policy.lora`` settings of a PEFT adapter directory."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        cfg = json.load(f)
    targets = cfg.get("target_modules") or []
    return LoRAConfig(
        rank=int(cfg["r"]),
        alpha=float(cfg.get("lora_alpha", cfg["r"])),
        dropout=float(cfg.get("lora_dropout", 0.0)),
        target_modules=sorted(targets) if not isinstance(targets, str) else [targets],
    )


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def has_tokenizer(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "tokenizer_config.json"))


def read_adapter_base(directory: str) -> str | None:
    """The base model an adapter directory names (``base_model_name_or_path``), if any."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        return json.load(f).get("base_model_name_or_path") or None


def policy_name(peft: str) -> str:
    """The inverse of :func:`peft_name`."""
    name = peft.removeprefix(PEFT_PREFIX)
    return name.replace(".lora_A.weight", f".lora_A.{ADAPTER}.weight").replace(
        ".lora_B.weight", f".lora_B.{ADAPTER}.weight"
    )


def load_adapter(directory: str) -> list[tuple[str, torch.Tensor]]:
    """The adapter tensors of a PEFT adapter directory, under the policy's names."""
    from safetensors.torch import load_file

    return [(policy_name(n), t) for n, t in load_file(os.path.join(directory, ADAPTER_FILE)).items()]


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """Policy state (base and adapters, policy names) -> plain Hugging Face weights with each adapter
    folded in: ``W + (alpha / r) * B @ A``, computed in float32 and stored in ``W``'s dtype."""
    scale = lora.scaling_alpha / lora.rank
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if ".base_layer." in name and name.endswith(".weight"):
            module = name[: -len(".base_layer.weight")]
            a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()  # (r, in)
            b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()  # (out, r)
            tensor = (tensor.float() + scale * (b @ a)).to(tensor.dtype)
        out[base_name(name)] = tensor
    return out
