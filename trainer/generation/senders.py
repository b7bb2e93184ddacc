"""Policy rank 0's end of a weight transfer: vLLM's own sender for its ``nccl`` backend on GPUs, the
packed protocol over a :class:`~trainer.weight_sync.WeightSyncGroup` otherwise (both in
:mod:`trainer.generation.weight_transport`'s contract). Above both, so neither imports the other."""

from __future__ import annotations

import torch

from trainer.generation.weight_transport import GroupSender, Sender, vllm_transfer_backend


def open_sender(engine_backend: str, info: dict, device: torch.device) -> Sender:
    """Policy rank 0's end of the transfer to engines of ``engine_backend`` ("vllm" | "hf")."""
    if engine_backend == "vllm" and vllm_transfer_backend(device.type == "cuda") == "nccl":
        from trainer.generation.vllm_weight_transfer import NcclSender

        return NcclSender(info)
    return GroupSender(info, device)
