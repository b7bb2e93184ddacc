"""Prompts as one left-padded tensor, each distinct prompt once: what a batched forward over shared
prompts needs, in the policy's shared-prompt layout and in the hf engine's prefill."""

from __future__ import annotations

import torch


def distinct_prompts(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each distinct prompt once, left-padded so all end at the same column: ids (U, W), mask (U, W),
    and for every input prompt the row of its distinct copy (B,)."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    width = max(len(p) for p in index)
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.long)
    for row, p in enumerate(index):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask, rows
