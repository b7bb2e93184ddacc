"""``skyrl_gym``: a dataset in SkyRL's format, the prompts of a ``skyrl_gym`` environment (trainer.envs.skyrl_gym).

A SkyRL dataset is a table (``.parquet``/``.jsonl`` at ``cfg.path``, or a hub dataset at ``cfg.hf_name``) whose
rows carry ``prompt``, the chat messages as they are, ``env_class``, and whatever the environment reads:
``reward_spec: {method, ground_truth}`` for the math environments, ``extra_info``, ``db_id``... Each row
becomes an example with:

- ``messages``: the row's ``prompt``, the prompt SkyRL would render (so ``data.system_prompt`` and
  ``data.prompt_template`` must be left unset);
- ``ground_truth``: ``reward_spec.ground_truth``, so that our rewards can score the same answers beside the
  environment's;
- ``env_extras``: every column but ``prompt`` and ``env_class``, what skyrl-train passes to the environment as
  its ``extras``.

The row's ``env_class`` is not used: ``env.environment_kwargs.env_class`` names the run's one environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.data.common import load_table, shuffled_order
from trainer.data.registry import Example, register

PROMPT, ENV_CLASS = "prompt", "env_class"


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: '{PROMPT}' must be a non-empty list of chat messages, got {str(prompt)[:80]!r}"
        )
    out = []
    for m in prompt:
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"{where}: each '{PROMPT}' message needs a string role and content, got {str(m)[:80]!r}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


@register("skyrl_gym")
def skyrl_gym(cfg: Any, split: str) -> list[Example]:
    if not cfg.path and not cfg.hf_name:
        raise ValueError("dataset 'skyrl_gym' needs data.path (a SkyRL .parquet/.jsonl) or data.hf_name")
    if (
        cfg.system_prompt
        or (cfg.prompt_template or "{question}") != "{question}"
        or getattr(cfg, "few_shot", None)
    ):
        raise ValueError(
            "dataset 'skyrl_gym' takes each row's prompt messages as they are: unset data.system_prompt, "
            "data.prompt_template and data.few_shot (null, '{question}' and [])"
        )
    table = load_table(cfg, split)
    if PROMPT not in table.column_names:
        raise ValueError(
            f"dataset 'skyrl_gym': no column {PROMPT!r} (SkyRL's format); columns: {', '.join(table.column_names)}"
        )
    order = shuffled_order(cfg, len(table))
    if cfg.max_examples is not None:
        order = order[: cfg.max_examples]
    examples: list[Example] = []
    for index, row in zip(order, table.select(order), strict=True):
        id = f"skyrl_gym-{split}-{index}"
        extras = {k: v for k, v in row.items() if k not in (PROMPT, ENV_CLASS)}
        spec = extras.get("reward_spec")
        examples.append(
            {
                "id": id,
                "messages": _messages(row[PROMPT], id),
                "ground_truth": spec.get("ground_truth") if isinstance(spec, Mapping) else None,
                "env_extras": extras,
                "dataset": "skyrl_gym",
            }
        )
    if not examples and cfg.max_examples != 0:
        raise ValueError(f"dataset 'skyrl_gym' split {split!r} has no rows")
    return examples
