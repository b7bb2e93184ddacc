"""An endless, seeded, resumable stream of prompt batches.

Each epoch is a fresh permutation from ``seed + epoch``; the position is two integers, so a
checkpoint restores the exact next batch: a resumed run sees the prompts an uninterrupted one would,
none replayed, none skipped. The state also records how many prompts there were, and a digest of
them, so resuming onto a different prompt set says so instead of quietly continuing a different
stream.
"""

from __future__ import annotations

import hashlib
import json
import random


class PromptLoader:
    def __init__(self, examples: list[dict], batch_size: int, seed: int, shuffle: bool = True):
        if not examples:
            raise ValueError("the dataset has no usable examples (all filtered out?)")
        self.examples, self.batch_size, self.seed, self.shuffle = examples, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()
        self._digest: str | None = None  # computed once: a save at preemption must not rehash the dataset

    def _permutation(self) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[dict]:
        batch: list[dict] = []
        while len(batch) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.examples[self._order[self.position]])
            self.position += 1
        return batch

    def digest(self) -> str:
        """What the position refers to: the prompts in order, the seed and shuffling."""
        if self._digest is not None:
            return self._digest
        h = hashlib.sha256(json.dumps([self.seed, self.shuffle]).encode())
        for ex in self.examples:
            h.update(json.dumps(ex.get("messages"), sort_keys=True).encode())
        self._digest = h.hexdigest()[:16]
        return self._digest

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_examples": len(self.examples),
            "digest": self.digest(),
        }

    def load_state_dict(self, state: dict) -> str | None:
        """Restore the position; returns a warning line when the prompts differ from the checkpoint's
        (a checkpoint without a digest, from before it was recorded, is taken as it is)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
        if "digest" not in state or state["digest"] == self.digest():
            return None
        return (
            f"kuberl: warning: the prompts differ from the checkpoint's ({len(self.examples)} now, "
            f"{state.get('num_examples')} then, or another seed or order); the stream continues at epoch "
            f"{self.epoch} position {self.position} of the new set, so it is not the one the run would have seen"
        )
