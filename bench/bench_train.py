"""Training throughput of one optimizer step: padded fixed-count micro-batches against packed token-budget ones.

One policy rank (FSDP2 over a world of 1, gloo, in this process; no engine) of the embedded
SmolLM2-135M-Instruct in float32 trains one GRPO step on a length-skewed batch: ``--prompts`` prompts of
``--prompt-tokens`` tokens, ``--group`` samples each, response lengths spread geometrically from
``--min-response`` to ``--max-response`` tokens (16..512 by default: most answers short, a few long, as
reasoning rollouts come), in the order the driver would hand them to the rank (``shard_for_ranks``).
Each layout trains the same batch from the same weights (learning rate 0, so no step changes them):

    padded   policy.sequence_packing=false, shared_prefix=false, micro_batch_size=--micro-batch-size
    prefix   the same with shared_prefix=true (each prompt once per micro-batch: today's padded default)
    packed   policy.sequence_packing=true, shared_prefix=false, max_tokens_per_microbatch=--max-tokens
    auto     both on (the defaults): per micro-batch, packed or shared-prompt (not in the default --layouts)

The packed budget defaults to the padded layout's largest micro-batch in positions (``--micro-batch-size``
x the longest sample: 4 x 544 = 2176 by default), so both layouts may hold the same activations at
once: a token budget that replaces a sequence count at the same memory.

The layouts take turns (one warm-up step each, then ``--repeats`` rounds of one step each), so noise on
a shared machine falls on all of them alike; the median step is reported. tokens/s counts the batch's
real tokens (prompt + response of every sample), whatever a layout pads them to. The losses must agree to
1e-5 relative (the same objective on the same batch, however it is split), else the bench exits 1.

    make bench-train     # or: .venv/bin/python bench/bench_train.py --repeats 3

``--gpu`` runs the rank on one CUDA GPU instead (NCCL world of 1, bf16 compute, sdpa; packed rows take
torch's varlen kernel there), timing each step between ``torch.cuda.synchronize()`` calls.

Beside tokens/s each layout gets its model FLOPs utilisation (``trainer.perf``: 6 x N x tokens plus causal
attention, over the median step and the device's peak: the bf16 table for a GPU, a measured matmul on a
CPU). One more step of the last layout then runs under torch's profiler, and the step is split into where
its time went (matmuls, attention, optimizer, copies and casts, ..., and on a GPU the time no kernel ran).

``--heads tiled,logits`` runs every layout twice, taking turns: with the LM head projected a tile at a time
(:mod:`trainer.algorithms.linear_logprobs`, what the trainer runs) and with today's whole logits
(:func:`trainer.policy.forward.logits_logprobs`). On a CPU one more untimed step per layout runs under torch's
``FSDPMemTracker``, whose peak of live tensors is the step's memory (``--no-memory`` skips it).

``--shape qwen2.5-1.5b`` (or ``qwen2.5-7b``, ``smollm2-135m``, ``gemma3-1b``) trains a randomly initialised model of that
shape (bf16 weights written once under the model cache, the repo's tiny tokenizer: the bench feeds token
ids), so a GPU machine without hub access measures a real model size. Neither Ray nor Hydra is needed:
without Hydra the config is the dataclass defaults with the same overrides.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import time

MODEL = "embedded:smollm2-135m-instruct"
# --shape: random models of these shapes (trainer/tools/plan.py's table of the hub configs; SmolLM2-135M's own).
SHAPES = {
    "qwen2.5-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",  # Qwen2.5-1.5B's shape: 1536 x 28 layers, 12/2 heads
    "qwen2.5-7b": "Qwen/Qwen2.5-Coder-7B-Instruct",
    "gemma3-1b": "google/gemma-3-1b-it",  # 1152 x 26 layers, a 262k vocabulary: the LM head's share is large
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
    },
}  # fmt: skip


def skewed_lengths(n: int, low: int, high: int) -> list[int]:
    """``n`` lengths from ``low`` to ``high``, geometrically spaced (as many below the geometric mean as above)."""
    if n == 1:
        return [high]
    return [round(low * (high / low) ** (i / (n - 1))) for i in range(n)]


def make_samples(args) -> list:
    """GRPO-shaped: each prompt's group holds the whole spread of lengths, shuffled (seeded)."""
    import random

    from trainer.policy.batch import Sample, shard_for_ranks

    rng = random.Random(0)
    lengths = skewed_lengths(args.prompts * args.group, args.min_response, args.max_response)
    rng.shuffle(lengths)
    samples = []
    for p in range(args.prompts):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        for k in range(args.group):
            n = lengths[p * args.group + k]
            samples.append(
                Sample(prompt, [rng.randrange(100, 40000) for _ in range(n)], advantage=float(k % 4) - 1.5)
            )
    return [samples[i] for i in shard_for_ranks(samples, 1)[0]]  # the rank's order


def random_model(shape: str) -> str:
    """A directory holding a randomly initialised model of ``shape`` (bf16 safetensors, seed 0) and the tiny
    tokenizer; built once under the model cache (on the GPU when there is one: seconds, not minutes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.resolve import cache_root
    from trainer.models.shape import KNOWN_CONFIGS
    from trainer.models.tiny import build_tiny_tokenizer

    out = cache_root() / f"random-{shape}-bf16-v1"
    if (out / "config.json").is_file():
        return str(out)
    known = SHAPES[shape]
    fields = dict(KNOWN_CONFIGS[known] if isinstance(known, str) else known)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    print(f"# building a random {shape} model in {out} (once)", flush=True)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    build_tiny_tokenizer().save_pretrained(tmp)
    del model
    os.replace(tmp, out)  # whole or absent under its final name
    return str(out)


def make_config(overrides: list[str]):
    """The composed config (Hydra, as a run composes it), or without Hydra (a GPU machine that has only
    torch and transformers) the dataclass defaults with the overrides set on them."""
    try:
        import hydra  # noqa: F401
    except ImportError:
        import yaml

        from trainer.config import Config, finish

        cfg = Config()
        for item in overrides:
            key, _, value = item.partition("=")
            if key == "experiment":
                continue  # its settings that matter here are all overridden below
            *path, leaf = key.split(".")
            node = cfg
            for part in path:
                node = getattr(node, part)
            setattr(node, leaf, yaml.safe_load(value))
        return finish(cfg)
    from trainer.config import load

    return load(overrides)


# Where a profiled step's time goes: the first pattern a kernel's (GPU) or an op's (CPU) name matches.
BUCKETS = (
    ("attention", r"flash|fmha|attention|varlen|sdpa|_efficient_attention"),
    ("matmul", r"gemm|cutlass|xmma|cublas|aten::(mm|addmm|bmm|matmul|linear)\b|sm\d+_|nvjet"),
    ("collectives", r"nccl|all_gather|reduce_scatter|all_reduce|c10d"),
    ("optimizer", r"adam|_foreach|multi_tensor|clip_grad|aten::lerp"),
    ("softmax, logprobs", r"softmax|logsumexp|cross_entropy|gather|log_softmax"),
    ("norms", r"rms|norm"),
    ("copies, casts", r"copy|memcpy|memset|cast|aten::to\b|catarray|aten::cat\b|contiguous|clone|fill"),
)


def profile_step(run_step, gpu: bool) -> list[tuple[str, float]]:
    """Run one step under torch's profiler: (bucket, seconds) by :data:`BUCKETS`, then the rest; on a GPU the
    kernels' own time plus the step's time with no kernel running (host work, launches, syncs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run_step()
        wall = time.perf_counter() - t0
    spent: dict[str, float] = {}
    for event in prof.key_averages():
        if gpu:  # kernels and copies only: a CPU op's device time is its kernels', counted there
            if event.device_type != DeviceType.CUDA:
                continue
            us = event.self_device_time_total
        else:
            us = event.self_cpu_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        bucket = next(
            (b for b, pattern in BUCKETS if re.search(pattern, name)),
            "other elementwise" if gpu else "other ops",
        )
        spent[bucket] = spent.get(bucket, 0.0) + us / 1e6
    rows = sorted(spent.items(), key=lambda kv: -kv[1])
    if gpu:
        rows.append(("GPU idle (host, launches, syncs)", max(wall - sum(spent.values()), 0.0)))
    rows.append(("step (wall, profiled)", wall))
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--min-response", type=int, default=16)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="padded: sequences per micro-batch")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="packed: tokens per micro-batch (default: --micro-batch-size x the longest sample, the "
        "padded layout's largest micro-batch)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="padded,prefix,packed")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="one CUDA GPU (NCCL world of 1, policy.param_dtype=--param-dtype, sdpa attention: packed rows "
        "then take torch's varlen kernel) instead of the CPU rank",
    )
    ap.add_argument(
        "--param-dtype", default="bfloat16", help="with --gpu: policy.param_dtype (bfloat16 | null)"
    )
    ap.add_argument(
        "--model", default=MODEL, help="a model directory or hub id (default: the embedded SmolLM2-135M)"
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="a randomly initialised model of this shape instead of --model (no download)",
    )
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile one more step of the last layout and say where its time went",
    )
    ap.add_argument(
        "--heads",
        default="tiled",
        help="tiled,logits: each layout with the LM head a tile at a time (trainer.algorithms."
        "linear_logprobs, the default) and with today's whole logits, taking turns",
    )
    ap.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one more step per layout under torch's FSDPMemTracker: its peak of live tensors "
        "(the default on a CPU, where the allocator has no per-step peak)",
    )
    args = ap.parse_args()

    from trainer import hardware, perf
    from trainer.models import resolve_model
    from trainer.models.shape import model_shape
    from trainer.policy.worker import PolicyWorker

    if args.shape:
        args.model = random_model(args.shape)
    path = resolve_model(args.model)
    flops_of = perf.ModelFlops.from_shape(model_shape(path))
    samples = make_samples(args)
    longest = max(s.length for s in samples)
    if args.max_tokens is None:
        args.max_tokens = args.micro_batch_size * longest
    # On a GPU: one GPU, bf16 compute over float32 master weights (as the GPU experiments run), transformers'
    # default attention (sdpa; cpu-demo's eager is a CPU choice) and FSDP's default resharding.
    device = (
        [
            "cluster.gpus_per_node=1",
            "cluster.cpu_workers_per_node=0",
            f"policy.param_dtype={args.param_dtype}",
            "model.attn_implementation=null",
            "policy.reshard_after_forward=true",
        ]
        if args.gpu
        else ["cluster.cpu_workers_per_node=1", "policy.param_dtype=null"]
    )
    cfg = make_config(
        [
            "experiment=cpu-demo",
            f"model.name={args.model}",
            "model.dtype=float32",
            *device,
            "cluster.keep_freed_memory=false",  # a shared machine: give memory back
            "policy.skip_zero_advantage=false",
            "policy.max_grad_norm=null",
            f"policy.max_total_sequence_length={max(longest, args.max_tokens)}",
            f"generation.max_new_tokens={args.max_response}",
        ]
    )
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "--gpu: no CUDA GPU here (torch.cuda.is_available() is False); drop --gpu to measure the CPU"
            )
            return 2
        sync = torch.cuda.synchronize

        def peak_mib() -> float | None:  # since the last reset: the step's own peak
            return torch.cuda.max_memory_allocated() / 2**20

        reset_peak = torch.cuda.reset_peak_memory_stats
    else:

        def sync() -> None:
            pass

        def peak_mib() -> float | None:  # a process's RSS peak never goes down: not per step
            return None

        def reset_peak() -> None:
            pass

    layouts = {
        "padded": dict(
            sequence_packing=False,
            shared_prefix=False,
            micro_batch_size=args.micro_batch_size,
            max_tokens_per_microbatch=None,
        ),
        "prefix": dict(
            sequence_packing=False,
            shared_prefix=True,
            micro_batch_size=args.micro_batch_size,
            max_tokens_per_microbatch=None,
        ),
        "packed": dict(sequence_packing=True, shared_prefix=False, max_tokens_per_microbatch=args.max_tokens),
        # the default: per micro-batch whichever of packed and shared-prompt runs fewer positions
        "auto": dict(sequence_packing=True, shared_prefix=True, max_tokens_per_microbatch=args.max_tokens),
    }
    names = [n for n in args.layouts.split(",") if n]
    unknown = sorted(set(names) - set(layouts))
    if unknown or not names:
        print(f"--layouts: one or more of {', '.join(layouts)}; got {args.layouts}")
        return 2
    from trainer.policy import forward

    heads = {"tiled": forward.forward_logprobs, "logits": forward.logits_logprobs}
    wanted = [h for h in args.heads.split(",") if h]
    if not wanted or set(wanted) - set(heads):
        print(f"--heads: one or more of {', '.join(heads)}; got {args.heads}")
        return 2
    if len(wanted) > 1:  # every layout with each head: "packed/tiled", "packed/logits", ...
        layouts = {f"{n}/{h}": dict(layouts[n], head=h) for n in names for h in wanted}
        names = list(layouts)
    else:
        layouts = {n: dict(layouts[n], head=wanted[0]) for n in names}
    memory = (not args.gpu) if args.memory is None else args.memory

    tokens = sum(s.length for s in samples)
    flops = flops_of.training(  # the model's, whatever a layout pads or recomputes; the head on response positions
        (s.length for s in samples), projected=sum(len(s.response_ids) for s in samples)
    )
    counts = [{"tokens": float(sum(len(s.response_ids) for s in samples)), "seqs": float(len(samples))}]
    where = (
        f"{torch.cuda.get_device_name(0)}, param_dtype {args.param_dtype}"
        if args.gpu
        else hardware.describe()
    )
    print(f"# {where}")
    print(
        f"# model FLOPs of the batch: {flops:.4g} (N = {flops_of.matmul_params / 1e6:.1f}M matmul parameters, "
        f"{flops_of.layers} layers x {flops_of.heads} heads x {flops_of.head_dim})",
        flush=True,
    )
    print(
        f"# {args.model}, {len(samples)} samples ({args.prompts} prompts x {args.group}), "
        f"prompt {args.prompt_tokens} + response {args.min_response}..{args.max_response} tokens, "
        f"{tokens} tokens in all; padded micro_batch_size={args.micro_batch_size}, "
        f"packed max_tokens_per_microbatch={args.max_tokens}",
        flush=True,
    )

    worker = PolicyWorker(cfg, path, rank=0, world_size=1, colocated_engine=False)
    try:
        worker.setup("127.0.0.1", free_port())
        worker.scheduler.base_lrs = [0.0] * len(worker.scheduler.base_lrs)  # every step from the same weights
        for group in worker.optimizer.param_groups:
            group["lr"] = 0.0

        peaks: dict[str, float] = {}

        def step(name: str) -> tuple[float, float]:
            for key, value in layouts[name].items():
                if key == "head":
                    forward.forward_logprobs = heads[value]
                else:
                    setattr(worker.cfg.policy, key, value)
            sync()
            reset_peak()
            t0 = time.perf_counter()
            loss = worker.train([samples], counts)["loss"]
            sync()
            seconds = time.perf_counter() - t0
            peak = peak_mib()
            if peak is not None:
                peaks[name] = max(peaks.get(name, 0.0), peak)
            print(
                f"  {name}: {seconds:.2f} s, loss {loss:.8f}" + (f", peak {peak:.0f} MiB" if peak else ""),
                flush=True,
            )
            return seconds, loss

        seconds: dict[str, list[float]] = {n: [] for n in names}
        losses: dict[str, float] = {}
        for name in names:  # warm-up: allocator, thread pools, first-touch pages
            _, losses[name] = step(name)
        for _ in range(args.repeats):
            for name in names:
                s, _ = step(name)
                seconds[name].append(s)
        live: dict[str, float] = {}
        if memory:  # untimed: the tracker sees every allocation
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats

            for name in names:
                tracker = FSDPMemTracker(worker.model, worker.optimizer)
                with tracker:
                    # The tracker opens a module's record in its forward pre-hook, but the policy never calls
                    # the root's forward (the decoder, then the LM head a tile at a time): without a record
                    # the root's pre-backward raises KeyError. Open it here, as its pre-hook would have.
                    if worker.model not in tracker.memory_tracking:
                        tracker.memory_tracking[worker.model] = _FSDPModMemStats(type(worker.model).__name__)
                    step(name)
                snapshot = tracker.get_tracker_snapshot("peak")
                live[name] = max(v["Total"] for v in snapshot.values()) / 2**20
        # The peak after the timed steps: on a CPU the matmul runs on the rank's own threads.
        peak, source = perf.device_peak_flops(worker.device, cfg.policy.param_dtype or cfg.model.dtype)
        breakdown = profile_step(lambda: step(names[-1]), args.gpu) if args.profile else []
    finally:
        forward.forward_logprobs = heads["tiled"]
        worker.shutdown()

    print(f"# peak: {source}")
    print(
        f"{'layout':8} {'median s':>9} {'min s':>7} {'tokens/s':>9} {'MFU':>6} {'loss':>14}"
        + ("  peak MiB" if peaks else "")
    )
    rate = {}
    for name in names:
        med = statistics.median(seconds[name])
        rate[name] = tokens / med
        print(
            f"{name:8} {med:9.3f} {min(seconds[name]):7.3f} {rate[name]:9.1f} {perf.mfu(flops, med, peak):6.1%} "
            f"{losses[name]:14.8f}" + (f"  {peaks[name]:8.0f}" if name in peaks else "")
        )
    if breakdown:
        wall = breakdown[-1][1]
        print(f"where a {names[-1]} step goes (one step under torch.profiler; profiling slows it a little):")
        for bucket, sec in breakdown[:-1]:
            print(f"  {bucket:34} {sec:8.3f} s {sec / wall:6.1%}")
        print(f"  {breakdown[-1][0]:34} {wall:8.3f} s")
    ok = True
    for name in names:
        rel = abs(losses[name] - losses[names[0]]) / max(abs(losses[names[0]]), 1e-12)
        if rel > 1e-5:
            print(f"loss of {name} differs from {names[0]} by {rel:.2e} relative (> 1e-5)")
            ok = False
    if "prefix" in names and "packed" in names:
        print(f"packed / prefix tokens/s: {rate['packed'] / rate['prefix']:.2f}x")
    if "padded" in names and "packed" in names:
        print(f"packed / padded tokens/s: {rate['packed'] / rate['padded']:.2f}x")
    for name in live:
        print(f"{name}: peak of live tensors in a step {live[name]:.0f} MiB (torch FSDPMemTracker)")
    for name in names:
        if name.endswith("/tiled") and name[:-6] + "/logits" in names:
            other = name[:-6] + "/logits"
            line = f"{name[:-6]}: tiled / logits tokens/s {rate[name] / rate[other]:.3f}x"
            if name in live:
                line += f"; peak {live[name]:.0f} against {live[other]:.0f} MiB ({live[other] - live[name]:.0f} MiB less)"
            print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
