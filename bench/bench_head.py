"""The tiled LM head's tile, eager against fused, side by side in one run on this CPU.

:func:`trainer.algorithms.linear_logprobs.linear_logprobs` runs each (positions x vocabulary block) tile either
as its ops one by one (eager: about ten kernels a tile, each reading and writing the whole tile) or compiled
by inductor into the matmul and one fused pass (``policy.fused_head``). Both run here on the same inputs, at a
SmolLM2-135M head by default (576 wide, 49152 entries, ``make train``'s model), with entropy and a sampling
temperature as a training step has them, taking turns so the machine's load falls on both alike: the fastest
of the repeats of each (the one a shared machine's load disturbed least), forward and backward, their ratio, the compile time the fused one paid once, the largest gap
between the two's logprobs and gradients, and each one's peak of allocated memory (the profiler's record of
the CPU allocator, which sees inductor's buffers too) beside what ``make plan`` counts for it. The figures decide
:func:`trainer.algorithms.linear_logprobs.fused_default` on a CPU; a GPU's are ``make bench-gpu``'s.

    .venv/bin/python bench/bench_head.py [--rows 1024] [--dtype bfloat16 float32] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

from trainer import hardware
from trainer.algorithms import linear_logprobs as ll
from trainer.policy import forward as policy_forward
from trainer.tools import plan


def peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once while ``fn()`` ran, beyond what it held before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def run(rows: int, hidden: int, vocab: int, dtype: torch.dtype, repeats: int, temperature: float) -> dict:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    upstream = torch.randn(rows, generator=g)
    step, block = ll.tiles(rows, vocab, ll.tile_elements(h.device))

    def forward(fused: bool):
        return ll.linear_logprobs(h, w, None, labels, temperature=temperature, with_entropy=True, fused=fused)

    def backward(lp):
        return torch.autograd.grad((lp * upstream).sum(), [h, w])

    start = time.perf_counter()
    backward(forward(True)[0])
    compile_s = time.perf_counter() - start
    results = {}
    times: dict[bool, dict[str, list[float]]] = {f: {"forward": [], "backward": []} for f in (False, True)}
    for _ in range(repeats):
        for fused in (False, True):  # taking turns: a load spike falls on both
            t0 = time.perf_counter()
            lp, ent = forward(fused)
            t1 = time.perf_counter()
            grads = backward(lp)
            t2 = time.perf_counter()
            times[fused]["forward"].append(t1 - t0)
            times[fused]["backward"].append(t2 - t1)
            results[fused] = (lp.detach(), ent, grads)
    gaps = {
        "logprobs": float((results[True][0] - results[False][0]).abs().max()),
        "entropy": float((results[True][1] - results[False][1]).abs().max()),
        "grad_hidden": float((results[True][2][0] - results[False][2][0]).abs().float().max()),
        "grad_weight": float((results[True][2][1] - results[False][2][1]).abs().float().max()),
    }
    peaks = {}
    for fused in (False, True):
        held: dict[str, torch.Tensor] = {}
        fwd = peak_bytes(lambda: held.__setitem__("lp", forward(fused)[0]))  # noqa: B023
        bwd = peak_bytes(lambda: backward(held["lp"]))  # noqa: B023
        # the weight's gradient is the plan's "gradients" term, not the head's
        peaks[fused] = max(fwd, bwd - vocab * hidden * h.element_size()) / 2**20
    shape = types.SimpleNamespace(vocab=vocab, hidden=hidden)
    policy_forward.TILE_ABOVE_BYTES = (
        0  # the plan of a head this size projects it whole; the tiles are measured
    )
    planned = {
        fused: plan.logit_bytes(
            shape,
            rows,
            h.element_size(),
            gpu=False,
            scaled=temperature != 1.0,  # type: ignore[arg-type]
            with_entropy=True,
            fused=fused,
        )
        / 2**20  # fmt: skip
        for fused in (False, True)
    }
    fastest = {f: {k: min(v) for k, v in times[f].items()} for f in (False, True)}
    return {
        "cpu": hardware.describe(),
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "hidden": hidden,
        "vocab": vocab,
        "tile": [step, block],
        "eager_s": fastest[False],
        "fused_s": fastest[True],
        "speedup": {k: fastest[False][k] / fastest[True][k] for k in ("forward", "backward")},
        "step_speedup": sum(fastest[False].values()) / sum(fastest[True].values()),
        "compile_s": compile_s,
        "max_gap": gaps,
        "peak_mib": {"eager": peaks[False], "fused": peaks[True]},
        "planned_mib": {"eager": planned[False], "fused": planned[True]},
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="positions projected per call")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--json", action="store_true", help="one JSON object per dtype instead of the table")
    args = parser.parse_args()
    rows = []
    for name in args.dtype:
        rows.append(
            run(args.rows, args.hidden, args.vocab, getattr(torch, name), args.repeats, args.temperature)
        )
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        return
    print(f"LM head tile, eager vs fused: {args.rows} positions x ({args.vocab} x {args.hidden}), entropy on, "
          f"T={args.temperature}, on {rows[0]['cpu']}, {rows[0]['threads']} threads, fastest of {args.repeats}")  # fmt: skip
    print(f"{'dtype':9} {'tile':>11} {'eager fwd/bwd s':>16} {'fused fwd/bwd s':>16} {'speedup':>8} "
          f"{'compile s':>9} {'peak MiB eager':>15} {'fused':>7} {'plan eager':>11} {'fused':>7} {'max gap':>8}")  # fmt: skip
    for r in rows:
        e, f = r["eager_s"], r["fused_s"]
        peak, planned = r["peak_mib"], r["planned_mib"]
        print(f"{r['dtype']:9} {r['tile'][0]:>5}x{r['tile'][1]:<5} {e['forward']:>7.3f}/{e['backward']:<8.3f} "
              f"{f['forward']:>7.3f}/{f['backward']:<8.3f} {r['step_speedup']:>7.2f}x {r['compile_s']:>9.1f} "
              f"{peak['eager']:>15.1f} {peak['fused']:>7.1f} {planned['eager']:>11.1f} {planned['fused']:>7.1f} "
              f"{max(r['max_gap'].values()):>8.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
