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

The rows of a process take turns (one warm-up step each, which pays for compiling where a row compiles, then
``--repeats`` rounds of one step each), so noise on a shared machine falls on all of them alike; the median
step is reported. tokens/s counts the batch's
real tokens (prompt + response of every sample), whatever a layout pads them to. The losses must agree to
1e-5 relative (the same objective on the same batch, however it is split), else the bench exits 1.

    make bench-train     # or: .venv/bin/python bench/bench_train.py --repeats 3

``--gpu`` runs the rank on one CUDA GPU instead (NCCL world of 1, bf16 compute, sdpa; packed rows take
torch's varlen kernel there), timing each step between ``torch.cuda.synchronize()`` calls.

Beside tokens/s each row gets its model FLOPs utilisation (``trainer.perf``: 6 x N x tokens, the LM head on the
positions it projects, plus causal attention, over the median step and the device's peak: the bf16 table for a
GPU, a matmul measured in the compute dtype on a CPU), and the bench says how far the best row is from issue 64's
goal of 40 % of the bf16 matmul peak. One more step of each row of the last layout then runs under torch's
profiler, split into matmul, attention, copies and casts, elementwise, collectives and idle: on a GPU the kernels
on each stream, idle the step's time with no kernel on any stream (host work, launches, syncs); on a CPU the ops
on each thread, idle the Python between them. The parts add up to the step's wall time (:func:`split_time`).

Rows differ in three settings, each against the others in one run: the layout, the LM head (``--heads``: the
tiled head eager, ``fused``, the same tiles fused by ``policy.fused_head``, or today's whole ``logits``; taking
turns in one process) and the decoder blocks (``--compile off,on``: ``policy.compile``, chosen when the policy is
built, so each setting trains in a process of its own, one after the other). A trainer without one of those keys
prints those rows as not available, with the key; a row whose step raised prints its error; the others still
print. ``--json PATH`` writes every row, its profile split and the ratios (``make bench-gpu`` writes
``results/bench-gpu-<date>.json``). The gradient norm of every row must agree with the first row's to 1e-3
relative (5e-2 in a 16-bit compute dtype), as the losses must to 1e-5: a faster row that computes another
gradient is not a gain, and the bench exits 1.

On a CPU one more untimed step per row runs under torch's ``FSDPMemTracker``, whose peak of live tensors is the
step's memory (``--no-memory`` skips it; on a GPU the peak is CUDA's own, per step).

``--shape qwen2.5-1.5b`` (or ``qwen2.5-7b``, ``smollm2-135m``, ``gemma3-1b``) trains a randomly initialised model of that
shape (bf16 weights written once under the model cache, the repo's tiny tokenizer: the bench feeds token
ids), so a GPU machine without hub access measures a real model size. Neither Ray nor Hydra is needed on a GPU
(``make bench-gpu``: torch and transformers): without Hydra the config is the dataclass defaults with the same
overrides.
"""

from __future__ import annotations

import argparse
import collections
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


def make_samples(args, vocab: int = 49152) -> list:
    """GRPO-shaped: each prompt's group holds the whole spread of lengths, shuffled (seeded); token ids drawn
    from the model's vocabulary (below 40,000, above its first special tokens)."""
    import random

    from trainer.policy.batch import Sample, shard_for_ranks

    rng = random.Random(0)
    low, high = min(100, vocab // 4), min(40000, vocab)
    lengths = skewed_lengths(args.prompts * args.group, args.min_response, args.max_response)
    rng.shuffle(lengths)
    samples = []
    for p in range(args.prompts):
        prompt = [rng.randrange(low, high) for _ in range(args.prompt_tokens)]
        for k in range(args.group):
            n = lengths[p * args.group + k]
            samples.append(
                Sample(prompt, [rng.randrange(low, high) for _ in range(n)], advantage=float(k % 4) - 1.5)
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
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # this process only waits for the bench's own while they run
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


# Where a profiled step's time goes: the first pattern a kernel's (GPU) or an op's (CPU) name matches, else
# "other elementwise". Compiled code's kernels (inductor's triton_poi/red/per on a GPU, its C++ kernels inside
# a compiled region on a CPU) are fused elementwise work, even where a cast is fused into them; its matmul
# templates (triton_tem) are matmuls.
BUCKETS = (
    ("attention", r"flash|fmha|attention|varlen|sdpa|_efficient_attention"),
    ("matmul", r"gemm|cutlass|xmma|cublas|nvjet|triton_tem|aten::(mm|addmm|bmm|matmul|linear)\b|sm\d+_"),
    ("collectives", r"nccl|all_gather|reduce_scatter|all_reduce|c10d"),
    ("fused (compiled)", r"triton_(poi|red|per)|cpp_fused|compiledfunction|compiledfxgraph|torch-compiled"),
    ("optimizer", r"adam|_foreach|multi_tensor|clip_grad|aten::lerp"),
    ("softmax, logprobs", r"softmax|logsumexp|cross_entropy|gather|log_softmax"),
    ("norms", r"rms|norm"),
    (
        "copies, casts",
        r"copy|memcpy|memset|cast|aten::to\b|catarray|chunk_cat|aten::cat\b|contiguous|clone|fill",
    ),
)
OTHER = "other elementwise"
IDLE = "idle"
# The profile split the issue reads: every bucket above lands in one of these; "idle" is the step's time with
# nothing running (on a GPU no kernel on any stream: host work, launches, syncs; on a CPU no op on any thread:
# Python between ops), so the split's parts add up to the step's wall time.
SPLIT = ("matmul", "attention", "copies, casts", "elementwise", "collectives", IDLE)
COARSE = {
    "matmul": "matmul",
    "attention": "attention",
    "copies, casts": "copies, casts",
    "collectives": "collectives",
}
STEP_MARK = "kuberl.bench.step"  # the profiled step's own range: the window the split covers


def bucket_of(name: str) -> str:
    name = name.lower()
    return next((b for b, pattern in BUCKETS if re.search(pattern, name)), OTHER)


def _lane_segments(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """One lane's (start, end, bucket) events, nested (a CPU thread's ops) or disjoint (a CUDA stream's
    kernels), as disjoint segments, each instant owned by the innermost event open then: an op's self time."""
    out: list[tuple[float, float, str]] = []
    stack: list[tuple[float, str]] = []  # (end, bucket) of the open events, innermost last
    cursor = 0.0
    for start, end, bucket in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:  # close what ended before this one starts
            top_end, top = stack.pop()
            if cursor < top_end:
                out.append((cursor, top_end, top))
                cursor = top_end
        if stack and cursor < start:
            out.append((cursor, start, stack[-1][1]))
        cursor = start
        if stack:  # an event that outlives its parent (not well nested) ends with it
            end = min(end, stack[-1][0])
        if end > start:
            stack.append((end, bucket))
    while stack:
        top_end, top = stack.pop()
        if cursor < top_end:
            out.append((cursor, top_end, top))
            cursor = top_end
    return out


def split_time(
    events: list[tuple[object, float, float, str]], window: tuple[float, float]
) -> dict[str, float]:
    """Seconds per bucket of a profiled window, from (lane, start, end, bucket) events in seconds, plus
    :data:`IDLE`: within a lane the innermost event owns each instant (:func:`_lane_segments`); an instant
    two lanes are busy at (two streams, two threads) is shared equally among them; what no lane is busy at
    is idle. So the buckets and idle add up to the window, exactly."""
    w0, w1 = window
    lanes: dict[object, list[tuple[float, float, str]]] = {}
    for lane, start, end, bucket in events:
        start, end = max(start, w0), min(end, w1)
        if end > start:
            lanes.setdefault(lane, []).append((start, end, bucket))
    edges: list[tuple[float, int, str]] = []  # (time, +1 open / -1 close, bucket)
    for lane_events in lanes.values():
        for start, end, bucket in _lane_segments(lane_events):
            edges += [(start, 1, bucket), (end, -1, bucket)]
    edges.sort(key=lambda e: (e[0], e[1]))  # closes before opens at the same instant
    spent: dict[str, float] = {}
    active: dict[str, int] = {}
    busy, last = 0, w0
    for t, delta, bucket in edges:
        if busy and t > last:
            share = (t - last) / busy
            for b, n in active.items():
                if n:
                    spent[b] = spent.get(b, 0.0) + share * n
        last = t
        active[bucket] = active.get(bucket, 0) + delta
        busy += delta
    spent[IDLE] = max((w1 - w0) - sum(spent.values()), 0.0)
    return spent


def coarse_split(spent: dict[str, float]) -> dict[str, float]:
    """:func:`split_time`'s buckets folded into :data:`SPLIT` (norms, softmax, the optimizer, fused and other
    kernels are elementwise work)."""
    out = dict.fromkeys(SPLIT, 0.0)
    for bucket, seconds in spent.items():
        out[bucket if bucket == IDLE else COARSE.get(bucket, "elementwise")] += seconds
    return out


def profile_step(run_step, gpu: bool) -> dict:
    """Run one step under torch's profiler; where its time went (:func:`split_time`): on a GPU the kernels,
    memcpys and memsets on each stream, on a CPU the ops on each thread. The window is the step's own
    ``record_function`` range, which ends after the step's ``cuda.synchronize()``: every kernel is in it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with record_function(STEP_MARK):
            run_step()
        wall = time.perf_counter() - t0
    events = list(prof.events())
    marks = [e for e in events if e.name == STEP_MARK and e.device_type == DeviceType.CPU]
    if marks:  # the profiler's own clock, which the kernels' times are in
        window = (marks[0].time_range.start / 1e6, marks[0].time_range.end / 1e6)
    else:  # never expected; then the first event starts the window
        first = min((e.time_range.start / 1e6 for e in events), default=0.0)
        window = (first, first + wall)
    spent = split_time(timed_events(events, gpu), window)
    return {"wall_s": window[1] - window[0], "split": coarse_split(spent), "detail": spent}


def timed_events(events, gpu: bool) -> list[tuple[object, float, float, str]]:
    """(lane, start s, end s, bucket) of the profiler's events (``FunctionEvent``) that own time. On a GPU the
    device's kernels, memcpys and memsets, a lane per stream; not a CPU op (its device time is its kernels',
    counted as theirs), nor a ``record_function`` range's projection onto the GPU's timeline (a device event
    too, marked ``is_user_annotation``, as torch's own table leaves it out): it spans kernels and the gaps
    between them, which are idle. On a CPU the ops, a lane per thread; not the step's own range, nor a range a
    library marks (FSDP's hooks) but a compiled region's call, whose own time is its generated kernels: the
    rest of such a range is Python between ops, left idle."""
    from torch.autograd import DeviceType

    out: list[tuple[object, float, float, str]] = []
    for e in events:
        lane: object
        if gpu:
            if e.device_type != DeviceType.CUDA or e.is_user_annotation:
                continue
            lane = ("stream", e.device_index, e.device_resource_id)
        else:
            if e.device_type != DeviceType.CPU or e.is_async or e.name == STEP_MARK:
                continue
            if e.is_user_annotation and bucket_of(e.name) != "fused (compiled)":
                continue
            lane = ("thread", e.thread)
        out.append((lane, e.time_range.start / 1e6, e.time_range.end / 1e6, bucket_of(e.name)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Settings a row may differ in beyond its layout: the head (taking turns in one process, set before each step)
# and the compiled decoder blocks (chosen when the policy is built: one process per setting). Each names the
# policy key that selects it; a trainer without the key has no such row to run.
HEADS = ("tiled", "fused", "logits")
OPTIONAL_KEYS = {"compile": "policy.compile", "fused": "policy.fused_head"}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
        "--param-dtype",
        default=None,
        help="policy.param_dtype, the compute dtype over float32 weights (default: bfloat16 with --gpu, "
        "null on a CPU: float32 throughout)",
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
        help="profile one more step of each row of the last layout and split its time (matmul, attention, "
        "copies and casts, elementwise, collectives, idle)",
    )
    ap.add_argument(
        "--heads",
        default="tiled",
        help="one or more of tiled (the LM head a tile at a time, eager: trainer.algorithms.linear_logprobs), "
        "fused (the same tiles fused: policy.fused_head=true) and logits (today's whole logits); each "
        "layout with each head, taking turns",
    )
    ap.add_argument(
        "--attention",
        default="batched",
        help="batched, per-sample or batched,per-sample: a packed row's attention on a CPU in bf16/fp16, its "
        "like-length samples in a few batched eager attentions (the trainer's) or sdpa once per sample (as "
        "before); each layout with each, taking turns (float32 and GPU rows run the same either way)",
    )
    ap.add_argument(
        "--compile",
        default="off",
        help="off, on or off,on: the decoder blocks eager (policy.compile=false) or compiled (true); each "
        "setting trains in a process of its own, its rows beside the others'",
    )
    ap.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one more step per layout under torch's FSDPMemTracker: its peak of live tensors "
        "(the default on a CPU, where the allocator has no per-step peak)",
    )
    ap.add_argument("--json", default=None, help="write every row, its profile split and the ratios here")
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)  # a child's results, for its parent
    return ap, ap.parse_args(argv)


def child_argv(ap: argparse.ArgumentParser, args: argparse.Namespace, **override) -> list[str]:
    """The command line that runs ``args`` (with ``override``) again: a child for one setting of the rows."""
    out: list[str] = []
    for action in ap._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = override.get(action.dest, getattr(args, action.dest))
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true
            if value:
                out.append(flag)
        elif value is not None:
            out += [flag, str(value)]
    return out


def missing_key(key: str) -> str | None:
    """Why rows that need ``key`` (``policy.compile``) cannot run here, or None when the trainer has it. The
    fused head is fixed on the model at set-up (``forward.fix_rows(model, rows, fused)``), which the bench
    calls again before each step: without that parameter a fused row would run the eager tiles unnoticed."""
    import inspect

    from trainer.config import Config

    section, _, leaf = key.partition(".")
    if not hasattr(getattr(Config(), section), leaf):
        return f"{key} is not a key of this trainer (trainer/config.py)"
    if key == OPTIONAL_KEYS["fused"]:
        from trainer.policy import forward

        if "fused" not in inspect.signature(forward.fix_rows).parameters:
            return f"{key}: this trainer's forward.fix_rows takes no fused flag, so a step cannot choose it"
    return None


ATTENTIONS = ("batched", "per-sample")


def attentions_of(args: argparse.Namespace) -> list[str]:
    return [a for a in args.attention.split(",") if a]


def row_name(
    layout: str,
    head: str,
    compiled: bool,
    heads: list[str],
    attention: str = "batched",
    attentions=("batched",),
) -> str:
    return (
        layout
        + (f"/{head}" if len(heads) > 1 else "")
        + (f"/{attention}" if len(attentions) > 1 else "")
        + ("+compile" if compiled else "")
    )


def main(argv: list[str] | None = None) -> int:
    ap, args = parse_args(argv)
    import json

    from trainer import hardware, perf
    from trainer.models import resolve_model
    from trainer.models.shape import model_shape

    layout_names = [n for n in args.layouts.split(",") if n]
    unknown = sorted(set(layout_names) - set(LAYOUTS))
    if unknown or not layout_names:
        print(f"--layouts: one or more of {', '.join(LAYOUTS)}; got {args.layouts}")
        return 2
    heads = [h for h in args.heads.split(",") if h]
    if not heads or set(heads) - set(HEADS):
        print(f"--heads: one or more of {', '.join(HEADS)}; got {args.heads}")
        return 2
    attentions = attentions_of(args)
    if not attentions or set(attentions) - set(ATTENTIONS) or len(set(attentions)) < len(attentions):
        print(f"--attention: batched, per-sample or batched,per-sample; got {args.attention}")
        return 2
    compiles = [c for c in args.compile.split(",") if c]
    if not compiles or set(compiles) - {"off", "on"} or len(set(compiles)) < len(compiles):
        print(f"--compile: off, on or off,on; got {args.compile}")
        return 2
    if args.param_dtype is None:
        args.param_dtype = "bfloat16" if args.gpu else "null"
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "--gpu: no CUDA GPU here (torch.cuda.is_available() is False); drop --gpu to measure the CPU"
            )
            return 2
    if args.shape:
        args.model, args.shape = random_model(args.shape), None  # built once, before any child starts
    path = resolve_model(args.model)
    shape = model_shape(path)
    samples = make_samples(args, shape.vocab)
    longest = max(s.length for s in samples)
    if args.max_tokens is None:
        args.max_tokens = args.micro_batch_size * longest
    if args.rows_out:  # a child: one setting's rows, in this process, for the parent to report
        results = run_rows(args, path, samples, layout_names, heads, compiles[0] == "on")
        with open(args.rows_out, "w") as f:
            json.dump(results, f)
        return 0

    flops_of = perf.ModelFlops.from_shape(shape)
    tokens = sum(s.length for s in samples)
    flops = flops_of.training(  # the model's, whatever a layout pads or recomputes; the head on response positions
        (s.length for s in samples), projected=sum(len(s.response_ids) for s in samples)
    )
    if args.gpu:
        import torch
        import transformers

        where = (
            f"{torch.cuda.get_device_name(0)}, param_dtype {args.param_dtype}; torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), transformers {transformers.__version__}"
        )
    else:
        where = f"{hardware.describe()}, param_dtype {args.param_dtype}"
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

    # Every row, in order; those a trainer cannot run say why, the others run.
    rows: dict[str, dict] = {}
    why_not = {"compile": missing_key(OPTIONAL_KEYS["compile"]), "fused": missing_key(OPTIONAL_KEYS["fused"])}
    for c in compiles:
        for layout in layout_names:
            for head in heads:
                for attention in attentions:
                    row = {"layout": layout, "head": head, "compile": c == "on", "attention": attention}
                    reason = why_not["compile"] if c == "on" else None
                    reason = reason or (why_not["fused"] if head == "fused" else None)
                    if reason:
                        row.update(status="not available", reason=reason)
                    rows[row_name(layout, head, c == "on", heads, attention, attentions)] = row
    peaks: list[tuple[float, str]] = []
    bf16_peak = None
    for c in compiles:
        mine = [n for n, r in rows.items() if r["compile"] == (c == "on") and "status" not in r]
        if not mine:
            continue
        try:
            if len(compiles) == 1:
                got = run_rows(args, path, samples, layout_names, heads, c == "on")
            else:
                got = run_child(ap, args, c)
        except Exception as e:  # noqa: BLE001 - the setting's rows say why; the others still print
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            got = {"error": f"{type(e).__name__}: {first}"}
        if "error" in got:
            for n in mine:
                rows[n].update(status="failed", reason=got["error"])
            continue
        peaks.append((got["peak_flops"], got["peak_source"]))
        bf16_peak = max(bf16_peak or 0.0, got.get("bf16_peak_flops") or 0.0) or None
        for n in mine:
            rows[n].update(got["rows"].get(n, {"status": "failed", "reason": "the run returned no such row"}))
    return report(args, rows, tokens, flops, peaks, where, bf16_peak)


def run_child(ap: argparse.ArgumentParser, args: argparse.Namespace, setting: str) -> dict:
    """One compile setting's rows in a process of its own (the blocks are compiled when the policy is built),
    its output passed through; ``{"error": ...}`` with its last line when it did not finish."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        argv = child_argv(ap, args, compile=setting, rows_out=out, json=None)
        print(f"# compile={setting}: a process of its own", flush=True)
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv], stderr=subprocess.PIPE, text=True
        )
        tail: collections.deque[str] = collections.deque(maxlen=20)
        assert proc.stderr is not None
        for line in proc.stderr:  # passed through as it comes; the last lines kept to say why it failed
            sys.stderr.write(line)
            if line.strip():
                tail.append(line.strip())
        rc = proc.wait()
        if rc != 0 or not os.path.exists(out):
            return {"error": f"its process exited with {rc}: {tail[-1] if tail else 'no output'}"}
        with open(out) as f:
            return json.load(f)


LAYOUTS = ("padded", "prefix", "packed", "auto")


def run_rows(
    args: argparse.Namespace,
    path: str,
    samples: list,
    layout_names: list[str],
    heads: list[str],
    compiled: bool,
) -> dict:
    """Train every (layout, head) row of one compile setting in this process: a warm-up step each (the first
    step, which pays for compiling), then ``--repeats`` rounds taking turns, then the memory pass and one
    profiled step per row of the last layout. A row whose step raised says why; the others go on."""
    import torch

    from trainer import perf
    from trainer.policy import forward, packed_attention
    from trainer.policy.worker import PolicyWorker

    longest = max(s.length for s in samples)
    # On a GPU: one GPU, bf16 compute over float32 master weights (as the GPU experiments run), transformers'
    # default attention (sdpa; cpu-demo's eager is a CPU choice) and FSDP's default resharding.
    device = (
        [
            "cluster.gpus_per_node=1",
            "cluster.cpu_workers_per_node=0",
            "model.attn_implementation=null",
            "policy.reshard_after_forward=true",
        ]
        if args.gpu
        else ["cluster.cpu_workers_per_node=1"]
    )
    optional = []
    if missing_key(OPTIONAL_KEYS["compile"]) is None:
        optional.append(f"{OPTIONAL_KEYS['compile']}={str(compiled).lower()}")
    cfg = make_config(
        [
            "experiment=cpu-demo",
            f"model.name={args.model}",
            "model.dtype=float32",
            f"policy.param_dtype={args.param_dtype}",
            *device,
            *optional,
            "cluster.keep_freed_memory=false",  # a shared machine: give memory back
            "policy.skip_zero_advantage=false",
            "policy.max_grad_norm=null",
            f"policy.max_total_sequence_length={max(longest, args.max_tokens)}",
            f"generation.max_new_tokens={args.max_response}",
        ]
    )
    if args.gpu:
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
        "padded": dict(sequence_packing=False, shared_prefix=False, micro_batch_size=args.micro_batch_size,
                       max_tokens_per_microbatch=None),
        "prefix": dict(sequence_packing=False, shared_prefix=True, micro_batch_size=args.micro_batch_size,
                       max_tokens_per_microbatch=None),
        "packed": dict(sequence_packing=True, shared_prefix=False, max_tokens_per_microbatch=args.max_tokens),
        # the default: per micro-batch whichever of packed and shared-prompt runs fewer positions
        "auto": dict(sequence_packing=True, shared_prefix=True, max_tokens_per_microbatch=args.max_tokens),
    }  # fmt: skip
    fused_key = OPTIONAL_KEYS["fused"].split(".")[1] if missing_key(OPTIONAL_KEYS["fused"]) is None else None
    plan, layout_of = {}, {}
    attentions = attentions_of(args)
    for layout in layout_names:
        for head in heads:
            if head == "fused" and fused_key is None:
                continue  # the parent's row says why
            for attention in attentions:
                name = row_name(layout, head, compiled, heads, attention, attentions)
                plan[name] = dict(layouts[layout], head=head, attention=attention)
                layout_of[name] = layout
    batch_max_len = packed_attention.BATCH_MAX_LEN
    memory = (not args.gpu) if args.memory is None else args.memory
    counts = [{"tokens": float(sum(len(s.response_ids) for s in samples)), "seqs": float(len(samples))}]
    rows: dict[str, dict] = {name: {"seconds": []} for name in plan}
    tiled = forward.forward_logprobs

    worker = PolicyWorker(cfg, path, rank=0, world_size=1, colocated_engine=False)
    try:
        worker.setup("127.0.0.1", free_port())
        setup_rows = forward.run_rows(worker.cfg.policy)  # what setup fixed the head for (forward.fix_rows)
        worker.scheduler.base_lrs = [0.0] * len(worker.scheduler.base_lrs)  # every step from the same weights
        for group in worker.optimizer.param_groups:
            group["lr"] = 0.0

        def step(name: str) -> float:
            for key, value in plan[name].items():
                if key == "head":
                    forward.forward_logprobs = forward.logits_logprobs if value == "logits" else tiled
                    if fused_key is not None:  # the head's tiles fused or not, as setup would fix it
                        setattr(worker.cfg.policy, fused_key, value == "fused")
                        for model in (worker.model, worker.ref_model):
                            if model is not None:
                                forward.fix_rows(model, setup_rows, fused=value == "fused")
                elif key == "attention":  # per-sample: every sample is one the batches leave to sdpa
                    packed_attention.BATCH_MAX_LEN = batch_max_len if value == "batched" else 0
                else:
                    setattr(worker.cfg.policy, key, value)
            sync()
            reset_peak()
            t0 = time.perf_counter()
            out = worker.train([samples], counts)
            sync()
            seconds = time.perf_counter() - t0
            row = rows[name]
            row["loss"], row["grad_norm"] = out["loss"], out.get("grad_norm")
            peak = peak_mib()
            if peak is not None:
                row["peak_mib"] = max(row.get("peak_mib", 0.0), peak)
            print(
                f"  {name}: {seconds:.2f} s, loss {out['loss']:.8f}"
                + (f", peak {peak:.0f} MiB" if peak else ""),
                flush=True,
            )
            return seconds

        def attempt(name: str, what: str, fn, fatal: bool = True) -> None:
            """Run ``fn`` for a row still standing. An exception in a step that times the row ends the row with
            its reason; one in the memory pass or the profile is noted on the row, whose timing stands."""
            if "reason" in rows[name]:
                return
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - one row's failure is that row's line
                first = (str(e).strip().splitlines() or [""])[0][:300]
                why = f"{what}: {type(e).__name__}: {first}"
                if fatal:
                    rows[name].update(status="failed", reason=why)
                else:
                    rows[name].setdefault("notes", []).append(why)
                print(f"  {name}: {what} failed: {type(e).__name__}: {first}", flush=True)

        for name in plan:  # warm-up: allocator, thread pools, first-touch pages, and compiling

            def warm(name: str = name) -> None:
                rows[name]["first_s"] = step(name)

            attempt(name, "warm-up step", warm)
        for _ in range(args.repeats):
            for name in plan:
                attempt(name, "timed step", lambda name=name: rows[name]["seconds"].append(step(name)))
        if memory:  # untimed: the tracker sees every allocation
            for name in plan:

                def tracked(name: str = name) -> None:
                    rows[name]["live_mib"] = live_peak(worker, lambda: step(name))

                attempt(name, "memory pass", tracked, fatal=False)
        # The peak after the timed steps: on a CPU the matmul runs on the rank's own threads.
        peak, source = perf.device_peak_flops(worker.device, cfg.policy.param_dtype or cfg.model.dtype)
        bf16_peak = peak if args.gpu else perf.measured_matmul_peak("bfloat16")
        if args.profile:
            for name in (n for n in plan if layout_of[n] == layout_names[-1]):  # the before/after rows

                def profiled(name: str = name) -> None:
                    rows[name]["profile"] = profile_step(lambda: step(name), args.gpu)

                attempt(name, "profiled step", profiled, fatal=False)
    finally:
        forward.forward_logprobs = tiled
        packed_attention.BATCH_MAX_LEN = batch_max_len
        worker.shutdown()
    for row in rows.values():
        row.setdefault("status", "ok")
    return {"rows": rows, "peak_flops": peak, "peak_source": source, "bf16_peak_flops": bf16_peak}


def live_peak(worker, run_step) -> float:
    """The step's peak of live tensors, MiB, under torch's FSDPMemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats

    from trainer.policy import forward

    tracker = FSDPMemTracker(worker.model, worker.optimizer)
    with tracker:
        # The tracker opens a module's record in its forward pre-hook, but a tiled head never calls the root's
        # forward (the decoder, then the LM head a tile at a time): without a record the root's pre-backward
        # raises KeyError. Open it here, as its pre-hook would have. (A head that calls the root's forward
        # gets its record there, and on a second micro-batch the tracker's "multiple iterative calls" error.)
        tiles = forward.forward_logprobs is not forward.logits_logprobs and forward.takes_tiles(
            worker.model, forward.run_rows(worker.cfg.policy)
        )
        if tiles and worker.model not in tracker.memory_tracking:
            tracker.memory_tracking[worker.model] = _FSDPModMemStats(type(worker.model).__name__)
        run_step()
    snapshot = tracker.get_tracker_snapshot("peak")
    return max(v["Total"] for v in snapshot.values()) / 2**20


# How far a row's gradient norm may sit from the first row's before the bench calls the rows different
# computations: the same step on the same batch, so float rounding alone separates them (summation order in
# float32; a 16-bit compute dtype rounds every activation).
GRAD_GAP = {"float32": 1e-3, "16-bit": 5e-2}
# Issue 64's goals for a training step's MFU: 40 % of the bf16 matmul peak measured on a CPU, 45 % of the data
# sheet's on an H100/H200.
MFU_GOAL = {"cpu": 0.40, "gpu": 0.45}


def report(args, rows: dict[str, dict], tokens: int, flops: float, peaks, where: str, bf16_peak) -> int:
    """Print the table, the profile split of every profiled row and the ratios; write ``--json``. Exit 1 when
    rows that ran disagree on the loss or the gradient (not the same computation), or when no row ran."""
    import datetime
    import json

    # One peak for every row: on a CPU each process measured its own matmul; the best of them is the machine's.
    peak, source = max(peaks) if peaks else (0.0, "no row ran")
    done = {n: r for n, r in rows.items() if r.get("status") == "ok" and r.get("seconds")}
    for row in done.values():
        row["median_s"] = statistics.median(row["seconds"])
        row["min_s"] = min(row["seconds"])
        row["tokens_per_s"] = tokens / row["median_s"]
        row["mfu"] = perf_mfu(flops, row["median_s"], peak)
        if bf16_peak:
            row["mfu_of_bf16_peak"] = perf_mfu(flops, row["median_s"], bf16_peak)
    width = max([len(n) for n in rows] + [8])
    print(f"# peak: {source}")
    print(
        f"{'row':{width}} {'first s':>8} {'median s':>9} {'min s':>7} {'tokens/s':>9} {'MFU':>6} {'loss':>14} "
        f"{'grad gap':>9}" + ("  peak MiB" if any("peak_mib" in r for r in done.values()) else "")
    )
    ok = bool(done)
    first = next(iter(done.values()), None)
    half = args.gpu or args.param_dtype not in ("null", "float32")
    tolerance = GRAD_GAP["16-bit" if half else "float32"]
    for name, row in rows.items():
        if name not in done:
            print(
                f"{name:{width}} {row.get('status', 'failed')}: {row.get('reason', 'no timed step finished')}"
            )
            continue
        gap = None
        if first is not None and row.get("grad_norm") is not None and first.get("grad_norm"):
            gap = abs(row["grad_norm"] - first["grad_norm"]) / max(abs(first["grad_norm"]), 1e-12)
            row["grad_norm_gap"] = gap
        print(
            f"{name:{width}} {row.get('first_s', float('nan')):8.2f} {row['median_s']:9.3f} {row['min_s']:7.3f} "
            f"{row['tokens_per_s']:9.1f} {row['mfu']:6.1%} {row['loss']:14.8f} "
            + (f"{gap:9.1e}" if gap is not None else f"{'-':>9}")
            + (f"  {row['peak_mib']:8.0f}" if "peak_mib" in row else "")
        )
    profiled = {n: r["profile"] for n, r in done.items() if "profile" in r}
    if profiled:
        print("where a step goes (one more step per row under torch.profiler, which slows it a little; idle: "
              + ("no kernel on any stream" if args.gpu else "no op on any thread, Python between ops") + ")")  # fmt: skip
        print(f"{'row':{width}} " + " ".join(f"{k:>13}" for k in SPLIT) + f" {'wall s':>8}")
        for name, prof in profiled.items():
            wall = prof["wall_s"]
            print(
                f"{name:{width}} "
                + " ".join(f"{prof['split'][k] / wall:13.1%}" for k in SPLIT)
                + f" {wall:8.3f}"
            )
    for name, row in done.items():
        rel = abs(row["loss"] - first["loss"]) / max(abs(first["loss"]), 1e-12)
        if rel > 1e-5:
            print(f"loss of {name} differs from {next(iter(done))} by {rel:.2e} relative (> 1e-5)")
            ok = False
        if row.get("grad_norm_gap", 0.0) > tolerance:
            print(f"gradient norm of {name} differs from {next(iter(done))} by {row['grad_norm_gap']:.2e} "
                  f"relative (> {tolerance:g}): not the same step")  # fmt: skip
            ok = False
    ratios: dict[str, float] = {}

    def ratio(label: str, a: str, b: str) -> None:
        if a in done and b in done:
            ratios[label] = done[a]["tokens_per_s"] / done[b]["tokens_per_s"]
            print(f"{label} tokens/s: {ratios[label]:.3f}x")

    # Each row against the row it differs from in one setting: the layout, the compiled blocks, the head, the
    # attention; and "after / before", everything this trainer offers on (fused head, compiled blocks, batched
    # attention) against none of it.
    key_of = {
        (r["layout"], r["head"], r["compile"], r.get("attention", "batched")): n for n, r in rows.items()
    }
    for (layout, head, compiled, attention), name in key_of.items():
        others = (
            [("prefix", head, False), ("padded", head, False)] if layout == "packed" and not compiled else []
        )
        others += [(layout, head, False)] if compiled else []
        others += [(layout, "tiled", compiled)] if head == "fused" else []
        others += [(layout, "logits", compiled)] if head == "tiled" else []
        if (head, compiled) == ("fused", True):
            others.append((layout, "tiled", False))
        others = [(*other, attention) for other in others]
        if attention == "batched":
            others.append((layout, head, compiled, "per-sample"))
            if (head, compiled) == ("fused", True):
                others.append((layout, "tiled", False, "per-sample"))
        for other in others:
            if other in key_of:
                ratio(f"{name} / {key_of[other]}", name, key_of[other])
    for name, row in done.items():
        for note in row.get("notes", []):
            print(f"{name}: {note} (the row's timing stands)")
        if "live_mib" in row:
            print(f"{name}: peak of live tensors in a step {row['live_mib']:.0f} MiB (torch FSDPMemTracker)")
    goal = MFU_GOAL["gpu" if args.gpu else "cpu"]
    if done and bf16_peak:
        best = max(done, key=lambda n: done[n]["mfu_of_bf16_peak"])
        got = done[best]["mfu_of_bf16_peak"]
        of = f"{bf16_peak / 1e12:.0f} TFLOP/s" if bf16_peak >= 1e12 else f"{bf16_peak / 1e9:.1f} GFLOP/s"
        print(
            f"MFU against the bf16 matmul peak ({of}{', measured' if not args.gpu else ''}): best row {best} "
            f"{got:.1%}, goal {goal:.0%} ({'met' if got >= goal else 'not met'})"
        )
    if args.json:
        out = {
            "bench": "bench_train.py",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "where": where,
            "command": [os.path.basename(sys.executable), "bench/bench_train.py", *sys.argv[1:]],
            "model": args.model,
            "batch": {"samples": args.prompts * args.group, "tokens": tokens, "max_tokens_per_microbatch": args.max_tokens},
            "model_flops": flops,
            "peak_flops": peak,
            "peak_source": source,
            "bf16_peak_flops": bf16_peak,
            "mfu_goal_of_bf16_peak": goal,
            "split_categories": list(SPLIT),
            "rows": rows,
            "ratios": ratios,
            "checks_passed": ok,
        }  # fmt: skip
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"# wrote {args.json}")
    return 0 if ok else 1


def perf_mfu(flops: float, seconds: float, peak: float) -> float:
    from trainer import perf

    return perf.mfu(flops, seconds, peak)


if __name__ == "__main__":
    sys.exit(main())
