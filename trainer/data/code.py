"""Competitive-programming datasets whose ground truth is stdin/stdout tests.

- ``nemotron_code``: ``nvidia/Nemotron-RL-coding-competitive_coding``. The problem is
  ``responses_create_params.input[0].content``; the tests are ``verifier_metadata.unit_tests.inputs`` /
  ``.outputs``.
- ``code_contests``: ``deepmind/code_contests``, Codeforces problems only, by rating tier
  (``options.tier``: ``easy`` 800-1000, ``hard`` 1100-2200, ``expert`` 2300-3500, a list of them, or
  ``all``; unrated and < 800 are always dropped). The private tests are the ground truth
  (``options.include_generated: true`` adds the generated ones), with the problem's own time and
  memory limits. Problems without tests, or whose statement we cannot judge on stdin/stdout (file
  I/O, interactive, images, no Input/Output sections), are dropped.

Both read a local ``path`` (a jsonl/json/parquet file, or a directory with one file per split such as
``train.jsonl``) instead of the hub; ``nemotron_code`` accepts rows in either shape. A single local
file serves every split: ``train`` gets all but a hold-out of ``options.holdout_percent`` (default 2)
of the problems and any other split gets only that hold-out, so validation never sees training
problems. The ground truth is ``{"inputs", "outputs", "time_limit_s"?, "memory_limit_mb"?}``, what
``trainer.rewards.code`` reads.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from pathlib import Path
from typing import Any

from trainer.data.registry import Example, register

log = logging.getLogger(__name__)

NEMOTRON_HUB = "nvidia/Nemotron-RL-coding-competitive_coding"
CODE_CONTESTS_HUB = "deepmind/code_contests"
TIERS = {"easy": (800, 1000), "hard": (1100, 2200), "expert": (2300, 3500)}
MIN_RATING = 800
CODEFORCES = 2  # code_contests ``source`` enum
SPLIT_ALIASES = {"validation": ("validation", "valid", "val", "dev"), "valid": ("valid", "validation", "val")}
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


# --- reading rows --------------------------------------------------------------------------------


def _split_names(split: str) -> tuple[str, ...]:
    return SPLIT_ALIASES.get(split, (split,))


def _load_local(path: str, split: str) -> tuple[list[dict], bool]:
    """Rows of ``path`` for ``split``; the flag says whether they are that split's own file."""
    import datasets

    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in _FORMATS)
        own = [f for f in files if f.name.split(".")[0].split("-")[0].lower() in _split_names(split)]
        chosen, is_own = (own, True) if own else (files, False)
    elif p.is_file():
        chosen, is_own = [p], False
    else:
        raise FileNotFoundError(f"data.path {path!r}: no such file or directory")
    if not chosen:
        raise FileNotFoundError(f"data.path {path!r}: no .jsonl, .json or .parquet files in it")
    fmt = _FORMATS.get(chosen[0].suffix)
    if fmt is None:
        raise ValueError(f"data.path {path!r}: expected .jsonl, .json or .parquet")
    ds = datasets.load_dataset(fmt, data_files=[str(f) for f in chosen], split="train")
    return list(ds), is_own


def _load_hub(hub_id: str, config: str | None, split: str) -> list[dict]:
    import datasets

    last: Exception | None = None
    for name in _split_names(split):
        try:
            return list(datasets.load_dataset(hub_id, config, split=name))
        except ValueError as e:  # an unknown split name
            last = e
    raise ValueError(f"dataset {hub_id!r} has no split {split!r} ({last}); set data.split / data.val_split")


def _rows(cfg: Any, split: str, hub_id: str) -> tuple[list[dict], bool]:
    """(rows, carve): carve is True when one source serves every split and needs a hold-out."""
    if getattr(cfg, "path", None):
        rows, own = _load_local(cfg.path, split)
        return rows, not own
    return _load_hub(getattr(cfg, "hf_name", None) or hub_id, getattr(cfg, "hf_config", None), split), False


def _holdout(examples: list[Example], split: str, percent: float) -> list[Example]:
    if not percent:
        return examples

    def held(ex: Example) -> bool:
        h = int.from_bytes(hashlib.sha256(ex["id"].encode()).digest()[:4], "little")
        return h % 10000 < percent * 100

    keep_held = split != "train"
    return [ex for ex in examples if held(ex) == keep_held]


def _finish(
    cfg: Any, name: str, split: str, examples: list[Example], carve: bool, dropped: int
) -> list[Example]:
    options = getattr(cfg, "options", None) or {}
    if carve:
        examples = _holdout(examples, split, float(options.get("holdout_percent", 2)))
    max_examples = getattr(cfg, "max_examples", None)
    if max_examples and len(examples) > max_examples:
        rng = random.Random(getattr(cfg, "seed", 0))
        keep = sorted(rng.sample(range(len(examples)), int(max_examples)))
        examples = [examples[i] for i in keep]
    log.info("%s/%s: %d problems (%d dropped as unusable)", name, split, len(examples), dropped)
    return examples


def _messages(cfg: Any, problem: str) -> list[dict]:
    template = getattr(cfg, "prompt_template", None) or "{question}"
    messages = []
    if getattr(cfg, "system_prompt", None):
        messages.append({"role": "system", "content": cfg.system_prompt})
    messages.append({"role": "user", "content": template.format(question=problem)})
    return messages


def _strings(xs: Any) -> list[str] | None:
    """Test inputs or outputs as strings (numbers are taken as their text); None when malformed."""
    if not isinstance(xs, (list, tuple)) or not all(isinstance(x, (str, int, float)) for x in xs):
        return None
    return [x if isinstance(x, str) else str(x) for x in xs]


# --- nemotron_code -------------------------------------------------------------------------------


def _from_nemotron(row: dict) -> tuple[str, str, dict] | None:
    """(id, problem, ground truth) of a Nemotron-shaped row, or None when it is unusable."""
    try:
        problem = row["responses_create_params"]["input"][0]["content"]
        tests = row["verifier_metadata"]["unit_tests"]
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(tests, str):  # some exports keep the tests as a JSON string
        import json

        try:
            tests = json.loads(tests)
        except ValueError:
            return None
    if not isinstance(tests, dict):
        return None
    inputs, outputs = _strings(tests.get("inputs")), _strings(tests.get("outputs"))
    if not isinstance(problem, str) or not problem.strip() or not inputs:
        return None
    if outputs is None or len(inputs) != len(outputs):
        return None
    pid = row.get("hash_id") or (row.get("verifier_metadata") or {}).get("problem_id")
    pid = str(pid) if pid else hashlib.sha256(problem.encode()).hexdigest()[:16]
    return pid, problem, {"inputs": inputs, "outputs": outputs}


@register("nemotron_code")
def nemotron_code(cfg: Any, split: str) -> list[Example]:
    rows, carve = _rows(cfg, split, NEMOTRON_HUB)
    options = getattr(cfg, "options", None) or {}
    examples, dropped = [], 0
    for row in rows:
        if "responses_create_params" in row:
            got = _from_nemotron(row)
        else:  # a code_contests-shaped row: its limits and tests, no rating filter
            got = _from_code_contests(row, options, tiers=None)
        if got is None:
            dropped += 1
            continue
        pid, problem, gt = got
        examples.append(
            {"id": pid, "messages": _messages(cfg, problem), "ground_truth": gt, "dataset": "nemotron_code"}
        )
    return _finish(cfg, "nemotron_code", split, examples, carve, dropped)


# --- code_contests -------------------------------------------------------------------------------

_IMAGE = re.compile(r"<image>|\[image\]|!\[", re.I)
_SECTION_IN = re.compile(r"^\s*input\s*$|^\s*-*\s*input\b", re.I | re.M)
_SECTION_OUT = re.compile(r"^\s*output\s*$|^\s*-*\s*output\b", re.I | re.M)


def _tiers(option: Any) -> list[tuple[int, int]]:
    if option in (None, "all"):
        return [(MIN_RATING, 10**9)]
    names = [option] if isinstance(option, str) else list(option)
    bad = [n for n in names if n not in TIERS]
    if bad:
        raise ValueError(
            f"code_contests: options.tier {bad[0]!r} unknown; expected one of {', '.join(TIERS)}, all"
        )
    return [TIERS[n] for n in names]


def malformed_statement(text: Any) -> bool:
    """True for statements we cannot judge on stdin/stdout from the text alone."""
    if not isinstance(text, str) or len(text.strip()) < 50:
        return True
    if _IMAGE.search(text) or re.search(r"^\s*interaction\s*$", text, re.I | re.M):
        return True
    return not (_SECTION_IN.search(text) and _SECTION_OUT.search(text))


def _from_code_contests(
    row: dict, options: dict, tiers: list[tuple[int, int]] | None
) -> tuple[str, str, dict] | None:
    if tiers is not None:
        if row.get("source", CODEFORCES) != CODEFORCES:
            return None
        rating = row.get("cf_rating") or 0
        if rating < MIN_RATING or not any(lo <= rating <= hi for lo, hi in tiers):
            return None
    description = row.get("description")
    if not isinstance(description, str) or malformed_statement(description):
        return None
    if row.get("input_file") or row.get("output_file"):
        return None  # reads or writes named files, not stdin/stdout
    inputs, outputs = [], []
    groups = ["private_tests"] + (["generated_tests"] if options.get("include_generated") else [])
    for group in groups:
        tests = row.get(group) or {}
        i, o = _strings(tests.get("input") or []), _strings(tests.get("output") or [])
        if i is None or o is None or len(i) != len(o):
            return None
        inputs += i
        outputs += o
    if not inputs:
        return None
    gt: dict = {"inputs": inputs, "outputs": outputs}
    tl = row.get("time_limit") or {}
    seconds = (tl.get("seconds") or 0) + (tl.get("nanos") or 0) / 1e9 if isinstance(tl, dict) else 0
    gt["time_limit_s"] = float(seconds or options.get("default_time_limit_s", 2.0))
    memory = row.get("memory_limit_bytes") or 0
    gt["memory_limit_mb"] = (
        int(memory // (1 << 20)) if memory else int(options.get("default_memory_limit_mb", 256))
    )
    if row.get("cf_contest_id") and row.get("cf_index"):
        pid = f"cf{row['cf_contest_id']}{row['cf_index']}"
    else:
        pid = str(row.get("name") or hashlib.sha256(description.encode()).hexdigest()[:16])
    return pid, description, gt


@register("code_contests")
def code_contests(cfg: Any, split: str) -> list[Example]:
    rows, carve = _rows(cfg, split, CODE_CONTESTS_HUB)
    options = getattr(cfg, "options", None) or {}
    tiers = _tiers(options.get("tier", "all"))
    examples, dropped = [], 0
    for row in rows:
        if "responses_create_params" in row:
            raise ValueError(
                "code_contests: this row is in the Nemotron shape (responses_create_params); "
                "use data=nemotron_code for it"
            )
        got = _from_code_contests(row, options, tiers)
        if got is None:
            dropped += 1
            continue
        pid, problem, gt = got
        examples.append(
            {"id": pid, "messages": _messages(cfg, problem), "ground_truth": gt, "dataset": "code_contests"}
        )
    return _finish(cfg, "code_contests", split, examples, carve, dropped)
