"""``reasoning_gym``: reasoning-gym's procedural generators (PyPI ``reasoning-gym``) as a dataset, no download.

Options (``cfg.options``):

- ``tasks``: the reasoning-gym tasks to mix, as a mapping ``{name: {weight: 1.0, config: {...}}}`` (``config``
  is the task's own config dataclass, e.g. ``{min_terms: 2, max_terms: 3}`` for ``chain_sum``; a ``null``
  entry takes weight 1 and the task's defaults), or a list of names;
- ``size`` (1000): training problems; an evaluation split has ``cfg.max_examples`` (``data.max_val_examples``
  in a run), else ``size`` too;
- ``holdout_fraction`` (0.1): the share of each task's problem space that belongs to evaluation.

Each problem is drawn as reasoning-gym's composite dataset draws: a task by weight, then that task's next item
from its generator, seeded from ``cfg.seed``, the task and the split. Train and evaluation splits must never
share a problem, and two seeds of a small task (``chain_sum`` over one-digit numbers) would, so the problem
space itself is split as ``arithmetic`` splits it: a problem belongs to the evaluation splits when a stable
hash of its task and question falls below ``holdout_fraction``, and each split keeps only its own side.

The prompt is the task's question (with ``cfg.system_prompt`` and ``cfg.prompt_template``); the ground truth is
what the task's scorer reads, ``{"task", "answer", "metadata"}``, made JSON-plain once here (tuples become
lists), so that it is the same after the trip through Ray and the rollouts' jsonl as when it was generated.
:func:`check_options` is the config-time check: an unknown task is one line listing the valid ones, before
anything starts.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.data.common import in_holdout, make_example
from trainer.data.registry import Example, register

DEFAULTS: dict[str, Any] = {"tasks": {"chain_sum": None}, "size": 1000, "holdout_fraction": 0.1}
TRAIN_SPLITS, EVAL_SPLITS = {"train"}, {"validation", "test", "val", "eval"}
KEY = "data.options"
# reasoning-gym's own mixtures and dataset wrappers are not tasks with a scorer of their own
NOT_TASKS = {"composite"}


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(set(DATASETS) - NOT_TASKS)


def _tasks(options: Mapping[str, Any]) -> dict[str, tuple[float, dict[str, Any]]]:
    """``options.tasks`` as ``{name: (weight, config)}``, each checked against reasoning-gym's registry and
    the task's config dataclass; a bad one is a ValueError of one line naming its key."""
    from reasoning_gym.factory import DATASETS

    given = options.get("tasks")
    if isinstance(given, str):
        given = [given]
    if isinstance(given, Sequence) and not isinstance(given, str):  # a list, or Hydra's ListConfig
        given = {name: None for name in given}
    if not isinstance(given, Mapping) or not given:
        raise ValueError(
            f"{KEY}.tasks must name at least one reasoning-gym task, e.g. {{chain_sum: {{weight: 1}}}}"
        )
    valid = task_names()
    tasks: dict[str, tuple[float, dict[str, Any]]] = {}
    for name, spec in given.items():
        key = f"{KEY}.tasks.{name}"
        if name not in valid:
            raise ValueError(f"{KEY}.tasks: unknown reasoning-gym task {name!r}; valid: {', '.join(valid)}")
        spec = dict(spec or {})
        unknown = set(spec) - {"weight", "config"}
        if unknown:
            raise ValueError(f"{key}: unknown keys {sorted(unknown)}; a task takes weight and config")
        weight, config = spec.get("weight", 1.0), dict(spec.get("config") or {})
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
            raise ValueError(f"{key}.weight={weight!r} must be a positive number")
        for fixed in ("seed", "size"):
            if fixed in config:
                raise ValueError(f"{key}.config.{fixed}: set by kuberl (data.seed, {KEY}.size); remove it")
        _, config_cls = DATASETS[name]
        try:
            task_config = config_cls(**config)
            if hasattr(task_config, "validate"):
                task_config.validate()
        except TypeError as e:  # an argument the dataclass does not take
            raise ValueError(f"{key}.config: {e}") from None
        except (AssertionError, ValueError) as e:
            raise ValueError(f"{key}.config: {e or 'rejected by the task'}") from None
        tasks[name] = (float(weight), config)
    return tasks


def _options(cfg: Any) -> dict[str, Any]:
    given = dict(getattr(cfg, "options", None) or {})
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ValueError(
            f"reasoning_gym: unknown {KEY} {sorted(unknown)}; allowed: {', '.join(sorted(DEFAULTS))}"
        )
    o = {**DEFAULTS, **given}
    if not isinstance(o["size"], int) or o["size"] < 1:
        raise ValueError(f"{KEY}.size={o['size']!r} must be a positive integer")
    if not 0 < o["holdout_fraction"] < 1:
        raise ValueError(f"{KEY}.holdout_fraction={o['holdout_fraction']} must be in (0, 1)")
    o["tasks"] = _tasks(o)
    return o


def check_options(options: Mapping[str, Any] | None) -> None:
    """The options name known tasks with configs their dataclasses take; else a one-line ValueError."""
    _options(type("Cfg", (), {"options": options})())


def plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists); what JSON cannot hold is an error naming it."""
    return json.loads(json.dumps(value))


@register("reasoning_gym", options=check_options)
def reasoning_gym(cfg: Any, split: str) -> list[Example]:
    import reasoning_gym as rg

    if split not in TRAIN_SPLITS | EVAL_SPLITS:
        raise ValueError(
            f"reasoning_gym: unknown split {split!r}; use one of {sorted(TRAIN_SPLITS | EVAL_SPLITS)}"
        )
    o = _options(cfg)
    held_out = split in EVAL_SPLITS
    side = "eval" if held_out else "train"
    n = (
        o["size"]
        if cfg.max_examples is None
        else (cfg.max_examples if held_out else min(o["size"], cfg.max_examples))
    )
    names = list(o["tasks"])
    weights = [o["tasks"][t][0] for t in names]
    # Each task's generator is indexed lazily: item i is a pure function of (seed, i) in reasoning-gym.
    budget = 1000 * n + 10_000
    generators = {
        t: rg.create_dataset(
            t, **o["tasks"][t][1], seed=zlib.crc32(f"{cfg.seed}:{t}:{side}".encode()), size=budget
        )
        for t in names
    }
    position = dict.fromkeys(names, 0)
    rng = random.Random(f"reasoning_gym:{cfg.seed}:{side}")  # a str seed: the same stream in every process
    examples: list[Example] = []
    while len(examples) < n:
        task = rng.choices(names, weights=weights)[0]
        while True:
            if position[task] >= budget:
                raise ValueError(
                    f"reasoning_gym: task {task!r} leaves almost no problems for split {split!r}; widen its "
                    f"{KEY}.tasks.{task}.config or change {KEY}.holdout_fraction"
                )
            item = generators[task][position[task]]
            position[task] += 1
            if in_holdout(f"{task}\n{item['question']}", o["holdout_fraction"]) == held_out:
                break
        try:
            truth = {
                "task": task,
                "answer": plain(item["answer"]),
                "metadata": plain(item.get("metadata") or {}),
            }
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"reasoning_gym: task {task!r} gives a ground truth JSON cannot hold ({e})"
            ) from None
        examples.append(
            make_example(cfg, "reasoning_gym", f"{task}-{split}-{len(examples)}", item["question"], truth)
        )
    return examples
