"""``python -m trainer.tools.eval model=PATH_OR_HF_ID data=math500 [key=value ...]``: pass@k of a model.

For each prompt of the dataset it samples ``num_tests_per_prompt`` (n) completions with the
configured generation backend, scores each with the dataset's reward (``math`` for math datasets,
``gsm8k`` for GSM8K, ``arithmetic`` for arithmetic, the unit tests for code), and reports the mean
over prompts of the unbiased pass@k estimator from the n samples (Chen et al. 2021;
:mod:`trainer.tools.passk`). The
default is greedy pass@1. Prompts are built exactly as in training: the dataset's loader, its
``prompt_template``/``system_prompt`` from ``trainer/conf/data/<name>.yaml``, and the tokenizer's
chat template (:func:`trainer.data.prompts.encode_prompt`).

It prints one block that runs are compared by (the NeMo-RL eval block), and writes every generation
with its score to ``OUTPUT/eval_<dataset>.jsonl`` and the result to ``OUTPUT/eval_<dataset>_result.json``.

:func:`evaluate` is the engine-agnostic core, for the trainer's periodic validation too: any object
with the :class:`~trainer.generation.base.GenerationEngine` ``generate`` method will do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import CONF_DIR, ConfigError, DataConfig, RewardSpec, preset
from trainer.generation.base import SamplingParams

RULE = "=" * 60
# Rewards by dataset (a conf/rewards/*.yaml name or a registered reward); anything else: math.
DEFAULT_REWARD = {
    "arithmetic": "arithmetic",
    "gsm8k": "gsm8k",
    "nemotron_code": "code_unit_tests",
    "code_contests": "code_unit_tests",
    "reasoning_gym": "reasoning_gym",
}
# Evaluation splits by dataset; anything else: test. A local file is its own split whatever is asked.
DEFAULT_SPLIT = {"openmathinstruct2": "train", "local": "train"}

USAGE = """usage: python -m trainer.tools.eval model=PATH_OR_HF_ID data=DATASET [key=value ...]

  model=                  a model directory (e.g. from `make convert`), a hub id, or builtin:/embedded: name;
                          or a PEFT adapter directory (`make convert` of a LoRA run), served over base=
  base=                   with an adapter directory: the model it adapts (default: the one its config names)
  data=                   {datasets}
  data_path=              a local .jsonl/.parquet file or directory instead of the hub (required for local)
  split=                  dataset split (default: test; train for openmathinstruct2)
  reward=                 reward name or module:function (default: the dataset's)
  k=1 num_tests_per_prompt=1 temperature=0.0 top_p=1.0 top_k=-1 seed=42 max_new_tokens=8192 stop_strings=[]
  max_examples=           evaluate the first N prompts only
  output=                 directory for eval_<data>.jsonl and eval_<data>_result.json (default results/eval/<model>)
  backend=hf|vllm batch_size=64 dtype=auto|float32|bfloat16 tokenizer= log_every=
  prompt_template= system_prompt= few_shot= prompt_key= answer_key= options.KEY=VALUE   dataset settings"""


class EvalError(Exception):
    """Bad input; the message is one line that names the key and the fix."""


# ----- the core, shared with validation -------------------------------------------------------------


def evaluate(
    engine,
    tokenizer,
    examples: list[dict],
    reward_specs: list[RewardSpec],
    num_tests_per_prompt: int,
    params: SamplingParams,
    *,
    k: int = 1,
    chat_template_kwargs: dict[str, Any] | None = None,
    log_every: int = 0,
    log: Callable[[str], None] = print,
    scorer: Callable[[list[tuple[Any, str, str | None]]], list[Any]] | None = None,
) -> dict[str, Any]:
    """Mean pass@k over ``examples`` with ``num_tests_per_prompt`` (n) samples each.

    An example needs ``messages`` (or already encoded ``prompt_ids``) and ``ground_truth``. A sample
    counts as correct when :func:`~trainer.rewards.runner.score_one` says so. Prompts go to
    ``engine.generate`` ``log_every`` at a time (all at once when 0) with a progress line after each
    group; a seeded ``params`` is offset by the group's first prompt index, so a run is reproducible
    for the same ``log_every``. ``scorer`` maps (ground_truth, response, question) items to RewardResults;
    the default scores in this process with ``reward_specs`` (validation can pass its RewardRunner:
    ``lambda items: runner.results(runner.submit(items))``).

    Returns ``score`` (= numerator / denominator), ``numerator`` (sum of per-prompt pass@k),
    ``denominator`` (number of prompts) and ``rows`` (one dict per generation).
    """
    from trainer.data.prompts import encode_prompt
    from trainer.rewards.runner import question_of, score_one
    from trainer.tools.passk import pass_at_k

    if scorer is None:

        def scorer(items):
            return [score_one(reward_specs, *item) for item in items]

    n = num_tests_per_prompt
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= num_tests_per_prompt, got num_tests_per_prompt={n}")
    if not examples:
        raise ValueError("evaluate: no examples")
    prompts = [
        ex["prompt_ids"]
        if "prompt_ids" in ex
        else encode_prompt(tokenizer, ex["messages"], chat_template_kwargs or {})
        for ex in examples
    ]
    step = log_every if log_every > 0 else len(examples)
    rows: list[dict[str, Any]] = []
    numerator, t0 = 0.0, time.monotonic()
    for start in range(0, len(examples), step):
        group = params if params.seed is None else dataclasses.replace(params, seed=params.seed + start)
        outputs = engine.generate(prompts[start : start + step], n, group)
        results = iter(
            scorer(
                [
                    (examples[i]["ground_truth"], c.text, question_of(examples[i]))
                    for i, cs in enumerate(outputs, start)
                    for c in cs
                ]
            )
        )
        for i, completions in enumerate(outputs, start):
            ex, correct = examples[i], 0
            for j, c in enumerate(completions):
                r = next(results)
                correct += bool(r.correct)
                rows.append(
                    {
                        "id": ex.get("id", str(i)),
                        "sample": j,
                        "prompt": ex["messages"][-1]["content"] if ex.get("messages") else None,
                        "ground_truth": ex["ground_truth"],
                        "response": c.text,
                        "finish_reason": c.finish_reason,
                        "num_tokens": len(c.token_ids),
                        "reward": r.total,
                        "extracted_answer": r.answer,
                        "answer_note": r.answer_note,
                        "correct": bool(r.correct),
                        "scores": r.scores,
                        "warnings": r.warnings,
                    }
                )
            numerator += pass_at_k(len(completions), correct, k)
        done = min(start + step, len(examples))
        if log_every > 0:
            log(
                f"eval: {done}/{len(examples)} prompts, pass@{k}={numerator / done:.4f}, "
                f"{time.monotonic() - t0:.0f}s"
            )
    return {
        "score": numerator / len(examples),
        "numerator": numerator,
        "denominator": len(examples),
        "rows": rows,
    }


def format_block(
    model_name: str, dataset_name: str, params: SamplingParams, k: int, n: int, result: dict[str, Any]
) -> str:
    """The result block users compare across runs."""
    return "\n".join(
        [
            RULE,
            f"model_name={model_name!r} dataset_name={dataset_name!r}",
            f"max_new_tokens={params.max_new_tokens} temperature={float(params.temperature)} "
            f"top_p={float(params.top_p)} top_k={params.top_k} seed={params.seed}",
            f"metric=pass@{k} num_tests_per_prompt={n}",
            f"score={result['score']:.4f} ({result['numerator']:.1f}/{result['denominator']})",
            RULE,
        ]
    )


# ----- command line ---------------------------------------------------------------------------------


@dataclass
class EvalArgs:
    model: str
    data: str
    base: str | None = None  # model= is a PEFT adapter directory: the model it adapts (default: its config's)
    data_path: str | None = None
    split: str | None = None
    reward: str | None = None
    k: int = 1
    num_tests_per_prompt: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 42
    max_new_tokens: int = 8192
    stop_strings: list[str] = dataclasses.field(default_factory=list)  # a YAML list: 'stop_strings=["\n"]'
    max_examples: int | None = None
    output: str | None = None
    backend: str = "hf"
    batch_size: int = 64
    dtype: str = "auto"
    tokenizer: str | None = None
    trust_remote_code: bool = False
    log_every: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.8
    prompt_template: str | None = None
    system_prompt: str | None = None
    few_shot: list[dict[str, str]] | None = None  # a YAML list: 'few_shot=[{question: 2 + 3, answer: "5"}]'
    prompt_key: str | None = None
    answer_key: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return os.path.basename(self.model.rstrip("/")) or self.model


_EXAMPLES = {int: "an integer, e.g. {key}=4", float: "a number, e.g. {key}=0.6", bool: "true or false"}


def parse_args(argv: list[str]) -> EvalArgs:
    """``key=value`` words -> :class:`EvalArgs`; every mistake is an :class:`EvalError` naming the key."""
    import yaml

    hints = typing.get_type_hints(EvalArgs)
    given: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for word in argv:
        key, sep, text = word.partition("=")
        if not sep or not key:
            raise EvalError(f"{word!r} is not key=value; e.g. model=Qwen/Qwen2.5-1.5B-Instruct data=math500")
        if key.startswith("options."):
            options[key.removeprefix("options.")] = yaml.safe_load(text) if text else None
            continue
        if key not in hints or key == "options":
            raise EvalError(
                f"unknown key {key!r}; valid keys: {', '.join(k for k in hints if k != 'options')}"
            )
        given[key] = _coerce(key, text, hints[key])
    for key in ("model", "data"):
        if not given.get(key):
            raise EvalError(f"{key}= is required; e.g. model=Qwen/Qwen2.5-1.5B-Instruct data=math500")
    args = EvalArgs(**given, options=options)
    checks = [
        (args.num_tests_per_prompt >= 1, "num_tests_per_prompt", "must be >= 1"),
        (args.k >= 1, "k", "must be >= 1"),
        (args.temperature >= 0, "temperature", "must be >= 0 (0 is greedy)"),
        (0 < args.top_p <= 1, "top_p", "must be in (0, 1]"),
        (args.top_k == -1 or args.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
        (args.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
        (args.max_examples is None or args.max_examples >= 1, "max_examples", "must be >= 1"),
        (args.batch_size >= 1, "batch_size", "must be >= 1"),
        (args.log_every is None or args.log_every >= 0, "log_every", "must be >= 0 (0: one line at the end)"),
        (args.backend in ("hf", "vllm"), "backend", "must be hf or vllm"),
        (
            args.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            "must be auto, float32, bfloat16 or float16",
        ),
    ]
    for ok, key, rule in checks:
        if not ok:
            raise EvalError(f"{key}={getattr(args, key)!r} {rule}")
    if args.k > args.num_tests_per_prompt:
        raise EvalError(
            f"k={args.k} exceeds num_tests_per_prompt={args.num_tests_per_prompt}; pass@k needs at least k "
            f"samples per prompt: set num_tests_per_prompt={args.k} or more"
        )
    return args


def _coerce(key: str, text: str, hint: Any) -> Any:
    if typing.get_origin(hint) is list:
        import yaml

        try:
            value = yaml.safe_load(text) if text else []
        except yaml.YAMLError:
            value = None
        (item,) = typing.get_args(hint)
        if item is str:
            ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
            example = '["\\n"]'
        else:  # few_shot: mappings (DataConfig.validate checks their keys)
            ok = isinstance(value, list) and all(isinstance(v, dict) for v in value)
            example = '[{question: 2 + 3, answer: "5"}]'
        if not ok:
            raise EvalError(f"{key}={text!r} must be a YAML list, e.g. {key}='{example}'")
        if item is not str:
            value = [{k: str(v) for k, v in shot.items()} for shot in value]
        return value
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is list:  # list | None
        return None if text.lower() in ("null", "none") else _coerce(key, text, args[0])
    if args:  # X | None
        if text.lower() in ("", "null", "none"):
            return None
        hint = args[0]
    try:
        if hint is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        raise EvalError(f"{key}={text!r} must be {_EXAMPLES[hint].format(key=key)}") from None
    return text


def data_config(args: EvalArgs) -> tuple[DataConfig, str]:
    """The dataset's training settings (conf/data/<name>.yaml) for evaluation: no shuffle, the eval split."""
    import yaml

    from trainer import data

    data.check(args.data, "data")
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    yaml_path = CONF_DIR / "data" / f"{args.data}.yaml"
    base = yaml.safe_load(yaml_path.read_text()) if yaml_path.is_file() else {}
    # The training templates, so eval prompts match training prompts; ${seed} interpolations are ours.
    values = {k: v for k, v in (base or {}).items() if k in fields and not (isinstance(v, str) and "${" in v)}
    values.update(name=args.data, seed=args.seed, shuffle=False, max_examples=args.max_examples)
    for key in ("prompt_template", "system_prompt", "few_shot", "prompt_key", "answer_key"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if args.options:
        values["options"] = {**(values.get("options") or {}), **args.options}
    if args.data_path is not None:
        if not Path(args.data_path).expanduser().exists():
            raise EvalError(
                f"data_path={args.data_path!r} does not exist; pass a .jsonl/.parquet file or a directory"
            )
        values["path"] = args.data_path
    elif args.data == "local":
        raise EvalError("data=local needs data_path=FILE (.jsonl/.parquet with question and answer columns)")
    split = args.split or DEFAULT_SPLIT.get(args.data, "test")
    cfg = DataConfig(**values)
    try:
        cfg.validate()
    except ConfigError as e:
        raise EvalError(str(e)) from None
    return cfg, split


def reward_specs(args: EvalArgs) -> list[RewardSpec]:
    """``reward=`` (a conf/rewards preset or a reward name), else the dataset's default."""
    from trainer import rewards

    name = args.reward or DEFAULT_REWARD.get(args.data, "math")
    if (
        CONF_DIR / "rewards" / f"{name}.yaml"
    ).is_file():  # the preset's kwargs too (e.g. the code tests' time limits)
        return preset("rewards", name).reward_functions
    rewards.check(name, "reward")
    return [RewardSpec(name)]


def resolve_model_path(name: str) -> str:
    """A local directory for ``name``, or the hub id unchanged; one-line errors for the usual mistakes."""
    from trainer.models import ModelNotFoundError, resolve_model

    local = Path(name).expanduser()
    from trainer.models.lora import is_adapter_dir

    if local.is_dir() and is_adapter_dir(str(local)):
        return str(local)  # an adapter: build_engine serves it over its base model
    if local.is_dir() and not (local / "config.json").is_file():
        if (local / "policy" / "weights").is_dir() or any(local.glob("step_*/policy")):
            raise EvalError(
                f"model={name!r} is a training checkpoint; convert it first: make convert CKPT={name} OUT=DIR, "
                "then model=DIR"
            )
    try:
        return resolve_model(name, key="model")
    except ModelNotFoundError as e:
        raise EvalError(str(e)) from None


def build_engine(args: EvalArgs, model_path: str):
    """The generation engine for ``args.backend``, from the same factory training uses."""
    import torch

    from trainer import hardware
    from trainer.config import GenerationConfig
    from trainer.generation.factory import EngineSpec, build_engine

    cuda = torch.cuda.is_available()
    # auto: bfloat16 where it is computed natively (GPUs, AVX512-BF16/AMX CPUs), else float32.
    dtype = (
        args.dtype if args.dtype != "auto" else ("bfloat16" if cuda or hardware.native_bf16() else "float32")
    )
    if args.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise EvalError(
                "backend=vllm needs vllm: make setup installs its CPU build (or pip install '.[vllm]' "
                "on a GPU machine); or use backend=hf"
            )
    gen = GenerationConfig(
        backend=args.backend,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        batch_size=args.batch_size,
    )
    from trainer.models import lora

    adapter, lora_cfg = None, None
    if lora.is_adapter_dir(model_path):
        adapter, lora_cfg = model_path, lora.read_adapter_config(model_path)
        base = args.base or lora.read_adapter_base(model_path)
        if not base:
            raise EvalError(f"model={args.model!r} is an adapter that names no base model; pass base=MODEL")
        model_path = resolve_model_path(base)
    spec = EngineSpec(
        model_path=model_path,
        dtype=dtype,
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
        tokenizer_path=args.tokenizer or (adapter if adapter and lora.has_tokenizer(adapter) else None),
        device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
        lora=lora_cfg,
    )
    try:
        engine = build_engine(gen, spec)
    except ImportError as e:
        raise EvalError(f"backend={args.backend} is not available here ({e}); use backend=hf") from None
    if adapter:
        engine.update_adapter(lora.load_adapter(adapter))
    return engine


def run(args: EvalArgs, *, engine=None, tokenizer=None) -> dict[str, Any]:
    """Evaluate, print the block, write the jsonl and the result json. ``engine``/``tokenizer``
    replace the ones built from ``args.model`` (tests script an engine this way)."""
    from trainer import data

    t0 = time.monotonic()
    cfg, split = data_config(args)
    specs = reward_specs(args)
    model_path = resolve_model_path(args.model) if engine is None or tokenizer is None else args.model
    try:
        examples = data.get(args.data)(cfg, split)
    except Exception as e:  # a bad file, a missing column, no hub access: one line, and the way out
        text = str(e.args[0] if len(e.args) == 1 else e).strip().splitlines()
        hint = "" if args.data_path else "; without hub access pass data_path= (a local copy)"
        raise EvalError(f"data={args.data}: {text[0] if text else type(e).__name__}{hint}") from None
    if tokenizer is None:
        from trainer.models import load_tokenizer
        from trainer.models.lora import has_tokenizer, is_adapter_dir, read_adapter_base

        tok_path = args.tokenizer or model_path
        if not args.tokenizer and is_adapter_dir(model_path) and not has_tokenizer(model_path):
            tok_path = resolve_model_path(args.base or read_adapter_base(model_path) or model_path)
        tokenizer = _load(
            lambda: load_tokenizer(tok_path, args.trust_remote_code),
            "tokenizer",
            args.tokenizer or args.model,
        )
    owned = engine is None  # an engine we build, we shut down (vLLM's holds a process of its own)
    if owned:
        engine = _load(lambda: build_engine(args, model_path), "model", args.model)
    try:
        return _evaluate_and_write(args, engine, tokenizer, examples, specs, split, t0)
    finally:
        if owned:
            engine.shutdown()


def _evaluate_and_write(
    args: EvalArgs, engine, tokenizer, examples, specs, split: str, t0: float
) -> dict[str, Any]:
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop_strings=list(args.stop_strings),
        seed=args.seed,
    )
    log_every = args.log_every if args.log_every is not None else (1024 if args.backend == "vllm" else 64)
    n, k = args.num_tests_per_prompt, args.k
    print(
        f"eval: {args.model_name} on {args.data} ({split}): {len(examples)} prompts x {n} samples, "
        f"{args.backend} backend, reward {'+'.join(s.name for s in specs)}",
        flush=True,
    )
    if args.temperature == 0 and n > 1:
        print(
            f"eval: note: temperature=0.0 is greedy, so the {n} samples of a prompt are the same", flush=True
        )
    result = evaluate(
        engine,
        tokenizer,
        examples,
        specs,
        n,
        params,
        k=k,
        log_every=log_every,
        log=lambda s: print(s, flush=True),
    )
    out = Path(args.output or Path("results") / "eval" / args.model_name).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    rows_path, result_path = out / f"eval_{args.data}.jsonl", out / f"eval_{args.data}_result.json"
    with open(rows_path, "w") as f:
        for row in result["rows"]:
            f.write(json.dumps(row, default=str) + "\n")
    rows = result["rows"]
    summary = {
        "model": args.model,
        "model_name": args.model_name,
        "dataset_name": args.data,
        "split": split,
        "metric": f"pass@{k}",
        "score": result["score"],
        "numerator": result["numerator"],
        "denominator": result["denominator"],
        "num_tests_per_prompt": n,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "backend": args.backend,
        "rewards": [dataclasses.asdict(s) for s in specs],
        "mean_response_tokens": sum(r["num_tokens"] for r in rows) / len(rows),
        "truncated_fraction": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
        "generations": str(rows_path),
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    result_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(format_block(args.model_name, args.data, params, k, n, result), flush=True)
    print(f"eval: generations -> {rows_path}, result -> {result_path}", flush=True)
    return {**summary, "rows": rows}


def _load(fn: Callable[[], Any], what: str, name: str) -> Any:
    try:
        return fn()
    except EvalError:
        raise
    except (OSError, ValueError) as e:  # hub unreachable, not a model directory, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EvalError(f"model={name!r}: cannot load the {what} ({first})") from None


def main(argv: list[str] | None = None) -> int:
    from trainer.cluster import quiet

    quiet()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or {"-h", "--help"} & set(argv):
        from trainer import data

        print(USAGE.format(datasets="|".join(data.names())))
        return 0 if argv else 2
    try:
        run(parse_args(argv))
    except (EvalError, ConfigError) as e:  # ConfigError: a registry's check of data= or reward=
        print(f"kuberl: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("kuberl: error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
