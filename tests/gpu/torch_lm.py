"""A language model in plain torch for the GPU suite's FSDP2 tests (torch alone, no transformers)."""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class TorchLM(torch.nn.Module):
    """A language model in plain torch (no transformers): what FSDP2 needs of one is its block types."""

    _no_split_modules = ["Block"]

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
