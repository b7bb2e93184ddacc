"""What every dataset loader shares: reading a table, picking rows, and building the prompt.

A loader names where its rows come from (a hub id and config, or ``cfg.path`` when set) and how to turn
one row into a question and a ground truth; :func:`load_table_examples` does the rest:

1. read the table with ``datasets.load_dataset``: a local ``.jsonl``/``.json``/``.parquet`` file (the
   file is the split), a local directory laid out like a hub repository (``test.jsonl``,
   ``main/train-00000-of-00001.parquet``, ...), or the hub;
2. optionally shuffle with ``cfg.seed`` and keep the first ``cfg.max_examples`` rows;
3. build chat messages: ``cfg.system_prompt`` as a system message, ``cfg.few_shot``'s worked examples as
   earlier user and assistant turns, then ``cfg.prompt_template.format(question=...)`` as the user message.

Large hub tables (OpenMathInstruct-2 has 14M rows) can be streamed so that only the rows used are
downloaded; a streamed shuffle draws from a buffer of ``options.shuffle_buffer`` rows, not the whole table.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from trainer.data.registry import Example

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def build_messages(cfg: Any, question: str) -> list[dict[str, str]]:
    """The prompt's chat messages: an optional system message, the worked examples of ``cfg.few_shot`` as
    earlier turns (each question templated as the real one is, then its answer from the assistant: few-shot
    prompting in the model's own turn format, which a base model given the examples inside one user turn
    does not follow), then the templated question."""
    template = cfg.prompt_template or "{question}"
    if "{question}" not in template:
        raise ValueError(f"data.prompt_template {template!r} must contain '{{question}}'")

    def user(text: str) -> dict[str, str]:
        try:
            return {"role": "user", "content": template.format(question=text)}
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"data.prompt_template {template!r} cannot be formatted ({e!r}); "
                "the only field is {question}, write literal braces as {{ and }}"
            ) from None

    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    for shot in getattr(cfg, "few_shot", None) or ():
        messages += [user(shot["question"]), {"role": "assistant", "content": shot["answer"]}]
    return messages + [user(question)]


def make_example(cfg: Any, dataset: str, id: str, question: str, ground_truth: Any) -> Example:
    return {
        "id": id,
        "messages": build_messages(cfg, question),
        "ground_truth": ground_truth,
        "dataset": dataset,
    }


def in_holdout(text: str, fraction: float) -> bool:
    """Whether a problem (its text) belongs to the evaluation splits: a share ``fraction`` of any problem space.

    sha256, the same in every process and run, and uniform over texts that differ in a digit. A linear checksum
    is not: crc32 over ``a+b`` with operands 0-15 held out 0-7 +3, 0-7 +7 and 10-15 +8 (every sum of a teen and
    8), so a model trained on the rest never saw a teen plus 8 and was scored on them all.
    """
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64 < fraction


def shuffled_order(cfg: Any, n_rows: int) -> list[int]:
    """Row indices ``0..n_rows-1``, in a ``cfg.seed`` shuffle when ``cfg.shuffle`` is set."""
    order = list(range(n_rows))
    if getattr(cfg, "shuffle", False):
        random.Random(cfg.seed).shuffle(order)  # stdlib Random: the same order on every platform
    return order


def load_table(
    cfg: Any, split: str, *, hf_id: str | None = None, hf_config: str | None = None, streaming: bool = False
):
    """A ``datasets.Dataset`` (or ``IterableDataset`` when streaming) for ``split``.

    ``cfg.path`` wins over the hub; ``cfg.hf_name``/``cfg.hf_config`` override ``hf_id``/``hf_config``.
    """
    import datasets

    source: str | None  # a local directory or a hub id; None when neither the config nor the caller names one
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise ValueError(f"data.path {str(path)!r}: expected one of {', '.join(_FILE_BUILDERS)}")
            # a single file is the whole split, whatever split was asked for
            return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming)
        if not path.is_dir():
            raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
        # a local repository snapshot: datasets infers the splits from the file names; the hub's config
        # name only applies if the user names one, since a plain directory has no configs
        source, name = str(path), cfg.hf_config
    else:
        source, name = cfg.hf_name or hf_id, cfg.hf_config or hf_config
        if source is None:
            raise ValueError("data.path is required for this dataset")
    try:
        return datasets.load_dataset(source, name, split=split, streaming=streaming)
    except ValueError as e:
        if "split" in str(e).lower():
            raise ValueError(f"dataset {source!r}: no split {split!r} ({e})") from None
        raise


def load_table_examples(
    cfg: Any,
    split: str,
    *,
    dataset: str,
    to_example: Callable[[Mapping[str, Any]], tuple[str, Any]],
    hf_id: str | None = None,
    hf_config: str | None = None,
    split_aliases: Mapping[str, str] | None = None,
    streaming: bool = False,
    dedupe: bool = False,
) -> list[Example]:
    """Read a table and turn each kept row into an example with ``to_example(row) -> (question, answer)``.

    ``dedupe`` drops rows whose question was already seen (tables with several solutions per problem).
    """
    options = getattr(cfg, "options", None) or {}
    streaming = bool(options.get("streaming", streaming))
    hub_split = (split_aliases or {}).get(split, split)
    table = load_table(cfg, hub_split, hf_id=hf_id, hf_config=hf_config, streaming=streaming)
    if streaming:
        if getattr(cfg, "shuffle", False):
            table = table.shuffle(seed=cfg.seed, buffer_size=int(options.get("shuffle_buffer", 10_000)))
        rows: Iterable[tuple[int, Mapping[str, Any]]] = enumerate(table)
    else:
        order = shuffled_order(cfg, len(table))
        rows = zip(order, table.select(order), strict=True)  # lazy index mapping: only the rows used are read

    examples: list[Example] = []
    seen: set[str] = set()
    for index, row in rows:
        if cfg.max_examples is not None and len(examples) >= cfg.max_examples:
            break
        question, answer = to_example(row)
        if dedupe:
            if question in seen:
                continue
            seen.add(question)
        examples.append(make_example(cfg, dataset, f"{dataset}-{split}-{index}", question, answer))
    if not examples and cfg.max_examples != 0:
        raise ValueError(f"dataset {dataset!r} split {split!r} has no rows")
    return examples


def column(row: Mapping[str, Any], key: str, dataset: str) -> Any:
    """``row[key]``, or an error that lists the columns there are."""
    if key not in row:
        raise KeyError(f"dataset {dataset!r}: no column {key!r}; columns: {', '.join(sorted(row))}")
    return row[key]
