"""The policy's part of a checkpoint, with torch DCP: every rank writes its own shards in parallel
(``policy/weights`` and ``policy/optimizer`` with the LR scheduler), and rank 0 the files conversion
needs beside them (tokenizer, the base model's config, with LoRA what the adapters adapt). DCP reshards
on load, so a run may resume on another rank count. With LoRA the weights are the adapters alone: the
frozen base is the model's own files. The run's directory, commit marker and driver files are
:mod:`trainer.checkpoint`'s.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from trainer.policy.gather import reshard


def _state_options(lora: bool):
    """With LoRA the checkpoint holds the adapters alone: the frozen base is the model's own files."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _state(model: torch.nn.Module, optimizer, scheduler, lora: bool) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    reshard(model)  # the state dict is of the sharded parameters
    weights = get_model_state_dict(model, options=_state_options(lora))
    if lora:  # a tied lm_head comes along under its second name despite being frozen
        from trainer.models.lora import is_adapter

        weights = {k: v for k, v in weights.items() if is_adapter(k)}
    optim = {"optimizer": get_optimizer_state_dict(model, optimizer), "scheduler": scheduler.state_dict()}
    return weights, optim


def save(path: str, model: torch.nn.Module, optimizer, scheduler, lora: bool) -> None:
    """Every rank writes its shards of the weights and the optimizer state under ``path/policy`` (collective)."""
    import torch.distributed.checkpoint as dcp

    weights, optim = _state(model, optimizer, scheduler, lora)
    dcp.save(weights, checkpoint_id=os.path.join(path, "policy", "weights"))
    dcp.save(optim, checkpoint_id=os.path.join(path, "policy", "optimizer"))


def load(path: str, model: torch.nn.Module, optimizer, scheduler, lora: bool) -> None:
    """Load weights and optimizer state; DCP reshards, so the rank count may differ from the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    weights, optim = _state(model, optimizer, scheduler, lora)
    dcp.load(weights, checkpoint_id=os.path.join(path, "policy", "weights"))
    set_model_state_dict(model, weights, options=_state_options(lora))
    dcp.load(optim, checkpoint_id=os.path.join(path, "policy", "optimizer"))
    set_optimizer_state_dict(model, optimizer, optim["optimizer"])
    scheduler.load_state_dict(optim["scheduler"])


def save_hf_files(
    policy_dir: str, tokenizer, model_path: str, config, lora_info: dict[str, Any] | None
) -> None:
    """Tokenizer and base config beside the weights, so conversion needs nothing else; ``config`` is the
    model's, written when ``model_path`` has no config.json; ``lora_info``: what the adapters adapt."""
    import shutil

    tokenizer.save_pretrained(os.path.join(policy_dir, "tokenizer"))
    hf_dir = os.path.join(policy_dir, "hf_config")
    os.makedirs(hf_dir, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        src = os.path.join(model_path, name)
        if os.path.isfile(src):
            shutil.copy(src, hf_dir)
        elif name == "config.json":
            config.save_pretrained(hf_dir)
    if lora_info is not None:  # the weights are adapters: what they adapt, for conversion and evaluation
        from trainer.models.lora import LORA_FILE

        with open(os.path.join(policy_dir, LORA_FILE), "w") as f:
            json.dump(lora_info, f, indent=2)
