"""What several policy tests share: the length-skewed batch the packing, sequence-parallel, sharded-init and
logprob equality tests train on, the small batch of the refit and LoRA tests, and a port for a one-process gloo world."""

from __future__ import annotations

import socket

import torch

from trainer.policy.batch import Sample


def local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
