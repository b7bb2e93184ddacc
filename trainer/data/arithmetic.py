"""``arithmetic``: integer expressions such as ``12+7`` or ``3*4-5``, generated from ``cfg.seed``, no download.

Options (``cfg.options``): ``num_examples`` (1000), ``min_operand`` (0), ``max_operand`` (20), ``ops``
(``"+-"``, any of ``+-*``), ``num_operands`` (2), ``holdout_fraction`` (0.1). The ground truth is the
value with the usual precedence, as a string (``"-3"``).

Train and evaluation splits must not share problems, and with small operand ranges two seeds would
collide, so the problem space itself is split: an expression belongs to the evaluation splits
(``validation``/``test``) when a stable hash of its text falls below ``holdout_fraction``
(:func:`~trainer.data.common.in_holdout`: sha256, so the held-out sums are scattered over the operands, not
whole columns of them). Each split then samples (with replacement) from its own part with a generator seeded
from ``cfg.seed`` and the split.
"""

from __future__ import annotations

import random
from typing import Any

from trainer.data.common import in_holdout, make_example
from trainer.data.registry import Example, register

DEFAULTS: dict[str, Any] = {
    "num_examples": 1000,
    "min_operand": 0,
    "max_operand": 20,
    "ops": "+-",
    "num_operands": 2,
    "holdout_fraction": 0.1,
}
TRAIN_SPLITS, EVAL_SPLITS = {"train"}, {"validation", "test", "val", "eval"}


def evaluate(operands: list[int], ops: str) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter than ``+``/``-``."""
    total, sign, term = 0, 1, operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= x
        else:
            total, sign, term = total + sign * term, (1 if op == "+" else -1), x
    return total + sign * term


def render(operands: list[int], ops: str) -> str:
    parts = [str(x) if x >= 0 else f"({x})" for x in operands]  # "3-(-2)", never "3--2"
    return parts[0] + "".join(op + p for op, p in zip(ops, parts[1:], strict=True))


def _options(cfg: Any) -> dict[str, Any]:
    given = dict(getattr(cfg, "options", None) or {})
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ValueError(
            f"arithmetic: unknown data.options {sorted(unknown)}; allowed: {', '.join(sorted(DEFAULTS))}"
        )
    o = {**DEFAULTS, **given}
    if not o["ops"] or set(o["ops"]) - set("+-*"):
        raise ValueError(f"arithmetic: data.options.ops={o['ops']!r}; use characters from '+-*'")
    if o["min_operand"] > o["max_operand"]:
        raise ValueError(f"arithmetic: min_operand={o['min_operand']} > max_operand={o['max_operand']}")
    if o["num_operands"] < 1:
        raise ValueError(f"arithmetic: num_operands={o['num_operands']} must be at least 1")
    if not 0 < o["holdout_fraction"] < 1:
        raise ValueError(f"arithmetic: holdout_fraction={o['holdout_fraction']} must be in (0, 1)")
    return o


@register("arithmetic")
def arithmetic(cfg: Any, split: str) -> list[Example]:
    if split not in TRAIN_SPLITS | EVAL_SPLITS:
        raise ValueError(
            f"arithmetic: unknown split {split!r}; use one of {sorted(TRAIN_SPLITS | EVAL_SPLITS)}"
        )
    o = _options(cfg)
    held_out = split in EVAL_SPLITS
    # a str seed is hashed with sha512 by random.Random: the same stream in every process
    rng = random.Random(f"arithmetic:{cfg.seed}:{'eval' if held_out else 'train'}")
    n = int(o["num_examples"] if cfg.max_examples is None else min(o["num_examples"], cfg.max_examples))
    examples: list[Example] = []
    attempts = 0
    while len(examples) < n:
        attempts += 1
        if attempts > 1000 * n + 10_000:
            raise ValueError(
                f"arithmetic: options {o} leave almost no problems for split {split!r}; "
                "widen the operand range or change holdout_fraction"
            )
        operands = [rng.randint(o["min_operand"], o["max_operand"]) for _ in range(o["num_operands"])]
        ops = "".join(rng.choice(o["ops"]) for _ in range(o["num_operands"] - 1))
        question = render(operands, ops)
        if in_holdout(question, o["holdout_fraction"]) != held_out:
            continue
        gt = str(evaluate(operands, ops))
        examples.append(make_example(cfg, "arithmetic", f"arithmetic-{split}-{len(examples)}", question, gt))
    return examples
