"""Policy rank 0's end of a weight transfer: vLLM's own sender for its ``nccl`` backend on GPUs, the
packed protocol over a :class:`~trainer.generation.refit.group.WeightSyncGroup` otherwise (both in
:mod:`trainer.generation.refit.transport`'s contract). Above both, so neither imports the other."""

from __future__ import annotations

import torch

from trainer.generation.refit.transport import GroupSender, Sender, vllm_transfer_backend


def open_sender(engine_backend: str, info: dict, device: torch.device) -> Sender:
    """Policy rank 0's end of the transfer to engines of ``engine_backend`` ("vllm" | "hf")."""
    if engine_backend == "vllm" and vllm_transfer_backend(device.type == "cuda") == "nccl":
        from trainer.generation.refit.vllm_nccl import NcclSender

        return NcclSender(info)
    return GroupSender(info, device)
