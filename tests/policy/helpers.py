"""What several policy tests share: a real PolicyWorker as the one rank of a gloo world in this process
(``one_rank_worker``), the length-skewed batch the packing, sequence-parallel, sharded-init and logprob
equality tests train on, and the small batch of the refit and LoRA tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest
import torch

from trainer.config import load
from trainer.policy.batch import Sample
from trainer.ports import free_port

if TYPE_CHECKING:
    from trainer.policy.worker import PolicyWorker


@contextmanager
def one_rank_worker(
    model_path: str, overrides: Sequence[str] = (), colocated_engine: bool = False, frozen_lr: bool = False
) -> Iterator[PolicyWorker]:
    """A PolicyWorker set up as rank 0 of a world of 1 (gloo, in this process) on ``experiment=tiny`` with
    ``model.name=model_path``, one CPU worker per node and then ``overrides``; ``setup()``'s result is
    ``w.info``. The test is skipped where this process already has a torch.distributed world. On the way out
    the worker shuts down and torch's thread count is put back (the worker sets it, as a rank does its own).

    ``frozen_lr``: the learning rate is 0, through the scheduler's ``base_lrs`` (which it scales each step)
    and every param group, so every call sees the same weights and leaves its gradient in ``param.grad``.
    """
    import torch.distributed as dist

    from trainer.policy.worker import PolicyWorker

    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed world")
    cfg = load(["experiment=tiny", f"model.name={model_path}", "cluster.cpu_workers_per_node=1", *overrides])
    threads = torch.get_num_threads()
    w = PolicyWorker(cfg, model_path, rank=0, world_size=1, colocated_engine=colocated_engine)
    try:
        w.info = w.setup("127.0.0.1", free_port("127.0.0.1"))
        if frozen_lr:
            w.scheduler.base_lrs = [0.0] * len(w.scheduler.base_lrs)
            for group in w.optimizer.param_groups:
                group["lr"] = 0.0
        yield w
    finally:
        w.shutdown()
        torch.set_num_threads(threads)


def refit_samples() -> list[Sample]:
    """4 samples of a 4-token prompt and 3 response tokens, advantages +-0.5: one small training step."""
    g = torch.Generator().manual_seed(0)
    return [
        Sample(
            torch.randint(4, 30, (4,), generator=g).tolist(),
            [5, 6, 7],
            advantage=float(i % 2) - 0.5,
            gen_logprobs=[-1.0, -1.0, -1.0],
        )
        for i in range(4)
    ]


def skewed_samples() -> list[Sample]:
    """3 prompts (of 4..9 tokens) x 4 responses of 1..23 tokens, with every per-token input set."""
    g = torch.Generator().manual_seed(0)
    out = []
    for p in range(3):
        prompt = torch.randint(4, 40, (4 + 5 * p // 2,), generator=g).tolist()
        for k in range(4):
            n = [1, 23, 6, 14][(k + p) % 4]
            response = torch.randint(4, 40, (n,), generator=g).tolist()
            mask = [0 if 2 <= t < 5 else 1 for t in range(n)]  # tokens 2..4: an environment turn
            old, ref, gen = ((torch.randn(n, generator=g) * 0.3 - 3.0).tolist() for _ in range(3))
            out.append(
                Sample(
                    prompt,
                    response,
                    advantage=float(k) - 1.5,
                    response_mask=mask,
                    old_logprobs=old,
                    ref_logprobs=ref,
                    gen_logprobs=gen,
                )
            )
    return out
