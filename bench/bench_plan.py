"""The memory plan against a measured peak: one optimizer step of a policy rank, on this CPU.

Each case runs in a fresh process: one FSDP2 rank (gloo, world size 1) loads the model, builds AdamW,
and trains two optimizer steps on ``--micro-batch-size`` sequences of ``--seq`` tokens (a one-token prompt, so the
logits cover every position: the plan's worst case). The measured figure is the peak of live
tensor memory during the second step, as torch's ``FSDPMemTracker`` counts it (parameters, optimizer
state, gradients, activations and temporaries, by the storages that are alive); the planned one is
:func:`trainer.tools.plan.training_peak` for the same config (no runtime reserve: that is a GPU's). The
process's resident memory is not the measure: glibc's heap keeps freed blocks (1.4 GiB beyond the live
tensors after three SmolLM2 steps). The ratio planned / measured is printed per case;
``make plan-check`` fails beyond 25%.

    make plan-check          # or: .venv/bin/python bench/bench_plan.py [--model NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.25
# (activation checkpointing, micro-batch size, sequence length): activations dominate without
# checkpointing, the parameter terms and logits with it.
CASES = ((False, 4, 512), (True, 4, 512))


def overrides(model: str, checkpointing: bool, mbs: int, seq: int, dtype: str) -> list[str]:
    return [
        "experiment=tiny",
        f"model.name='{model}'",
        f"model.dtype={dtype}",
        "policy.param_dtype=null",
        "cluster.cpu_workers_per_node=1",
        f"policy.micro_batch_size={mbs}",
        f"policy.max_total_sequence_length={seq}",
        f"generation.max_new_tokens={seq - 1}",
        "policy.shared_prefix=false",
        f"policy.activation_checkpointing={str(checkpointing).lower()}",
        "grpo.loss.reference_policy_kl_penalty=0",
        "policy.skip_zero_advantage=false",
    ]


def child(args: argparse.Namespace) -> None:
    """One case, in this process: print {"measured": bytes, "planned": bytes, ...} as JSON."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # torch's own, for FSDP2

    from trainer import config
    from trainer.cluster import free_port
    from trainer.models import resolve_model
    from trainer.policy.batch import Sample
    from trainer.policy.worker import PolicyWorker
    from trainer.tools import plan

    cfg = config.load(overrides(args.model, args.checkpointing, args.micro_batch_size, args.seq, args.dtype))
    path = resolve_model(cfg.model.name)  # built and cached before the baseline
    worker = PolicyWorker(cfg, path, rank=0, world_size=1, colocated_engine=False)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    worker.setup("127.0.0.1", free_port())
    vocab = worker.model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=[1],
            response_ids=torch.randint(2, vocab, (args.seq - 1,), generator=gen).tolist(),
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(args.micro_batch_size)
    ]
    counts = {"tokens": float(len(samples) * (args.seq - 1)), "seqs": float(len(samples))}
    worker.train([samples], [counts])  # the first step allocates AdamW's moments at its end
    tracker = FSDPMemTracker(worker.model, worker.optimizer)
    # torch's tracker follows an FSDP unit only through the module's own call hooks, and the tiled head runs
    # the root's forward through a method FSDP registers (trainer/policy/forward.py), which it cannot follow:
    # measure with the head's plain logits instead. The models measured here have small vocabularies, so the
    # logits are a sliver of the peak either way and the activation formula is what the ratio checks.
    from trainer.policy import forward

    forward.forward_logprobs = forward.logits_logprobs
    with tracker:
        worker.train([samples], [counts])  # the steady state: a step with the moments there throughout
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    shape = plan.model_shape(cfg.model.name)
    terms = plan.training_terms(cfg, shape, world=1)
    worker.shutdown()
    print(json.dumps({"measured": peak["Total"], "planned": plan.training_peak(cfg, shape, world=1),
                      "measured_terms": {str(k.value if hasattr(k, "value") else k): v for k, v in peak.items() if v},
                      "terms": {k: round(v) for k, v in terms.items()}}))  # fmt: skip


def run_case(model: str, checkpointing: bool, mbs: int, seq: int, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--micro-batch-size", str(mbs), "--seq", str(seq),
           "--dtype", dtype] + (["--checkpointing"] if checkpointing else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(
            f"bench_plan: the case failed ({out.returncode}): {out.stderr.strip().splitlines()[-1:]}"
        )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(model=model, checkpointing=checkpointing, micro_batch_size=mbs, seq=seq, dtype=dtype)
    result["ratio"] = result["planned"] / result["measured"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", action="store_true", help="one JSON line per case")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch-size", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=512, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    from trainer import hardware

    if not args.json:
        print(
            f"memory plan vs measured peak tensor memory (torch FSDPMemTracker), one policy rank on {hardware.describe()}, {args.model} {args.dtype}"
        )
    worst = 0.0
    for checkpointing, mbs, seq in CASES:
        r = run_case(args.model, checkpointing, mbs, seq, args.dtype)
        worst = max(worst, abs(r["ratio"] - 1))
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"  activation_checkpointing={str(checkpointing).lower():5} {mbs} x {seq} tokens: "
                  f"planned {r['planned'] / 2**20:7.0f} MiB, measured {r['measured'] / 2**20:7.0f} MiB, "
                  f"planned / measured {r['ratio']:.2f}", flush=True)  # fmt: skip
    if not args.json:
        print(f"worst deviation: {100 * worst:.0f}% (allowed {100 * TOLERANCE:.0f}%)")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
