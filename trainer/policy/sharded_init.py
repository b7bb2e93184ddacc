"""A policy rank's model, sharded before it holds any weights: the peak is a shard, not the model.

Each rank builds the model on the meta device (:func:`trainer.models.build_empty_model`: shapes,
no storage), applies FSDP2 to it (``fully_shard`` on meta parameters makes meta shards), and only then
allocates: ``to_empty`` gives each rank storage for its own shards (and the buffers, which FSDP2 does
not shard). Rank 0 alone reads the checkpoint (``from_pretrained`` on the host, so transformers'
own key mapping, tied weights and dtype handling apply as they always did) and
:func:`~torch.distributed.checkpoint.state_dict.set_model_state_dict` with ``full_state_dict`` and
``broadcast_from_rank0`` broadcasts its tensors one at a time; each rank keeps its slice of each. The
device then never holds more than the rank's shards plus one full tensor (the largest: the
embeddings; ``trainer.tools.plan`` counts it), where moving the loaded model to the device before sharding
held the whole model there (gemma3-27b: 51 GiB on every GPU beside a colocated engine's share).

Buffers are not sharded, and the non-persistent ones (rotary ``inv_freq``, Gemma's ``embed_scale``)
are in no state dict: after ``to_empty`` they hold garbage, so each is broadcast from rank 0's loaded
model. Rank 0's random state is broadcast last: every rank then continues from the state it would have
had after loading the whole model itself (the LoRA adapters' initialisation draws from it).

The CPU ranks run the same calls over gloo; the shards, buffers and logprobs equal those of loading the
whole model and sharding it, bit for bit (``tests/policy/test_sharded_init.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def load_shards(model: torch.nn.Module, host: torch.nn.Module | None, device: torch.device) -> None:
    """Materialise ``model`` (FSDP2-sharded on the meta device) on ``device`` and fill every rank's shards,
    buffers and random state from ``host``: rank 0's fully loaded model, ``None`` on the other ranks,
    which must have the same module tree (parameter names, shapes, dtypes). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if (dist.get_rank() == 0) != (host is not None):
        raise ValueError("load_shards: rank 0, and only rank 0, passes the loaded model")
    model.to_empty(device=device)
    full = host.state_dict() if host is not None else {}
    # One tensor at a time (torch's _broadcast_state_dict): a full tensor on the device, its slice kept.
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full
    host_buffers = dict(host.named_buffers()) if host is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if host is not None:
                buf.copy_(host_buffers[name])
            dist.broadcast(buf, src=0)
    left = [
        f"{m}.{k}"
        for m, mod in model.named_modules()
        for k, v in vars(mod).items()
        if isinstance(v, torch.Tensor) and v.is_meta
    ]
    if left:  # a tensor attribute that is neither parameter nor buffer: nothing above could fill it
        raise RuntimeError(f"load_shards: {', '.join(left)} still on the meta device; load this model whole")
    state = [torch.get_rng_state() if host is not None else None]
    dist.broadcast_object_list(state, src=0)
    rng = state[0]
    assert rng is not None  # rank 0 holds the host model, and every rank now holds its state
    torch.set_rng_state(rng)
