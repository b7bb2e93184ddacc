"""Each config key's doc is data beside its field (``doc(default, "...")``, ``section(Cls)``), so
``python -m trainer --help SECTION`` prints every key of a section with its type, default and doc, and a
field without a doc fails here."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from trainer.__main__ import main
from trainer.config import DOC, Config, _type_hints, config_key, doc


def _sections(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every dataclass reachable from ``cls`` (sections, and the items of a list of them), by dotted path."""
    found = {}
    for f in dataclasses.fields(cls):
        hint = _type_hints(cls)[f.name]
        for inner in (hint, *typing.get_args(hint)):
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                path = f"{prefix}{config_key(f)}"
                found[path] = inner
                found.update(_sections(inner, f"{path}."))
    return found


def _undocumented(cls: type = Config, prefix: str = "") -> list[str]:
    """The keys under ``cls`` whose field carries no doc."""
    return [
        f"{path}.{config_key(f)}" if path else config_key(f)
        for path, section in {prefix: cls, **_sections(cls)}.items()
        for f in dataclasses.fields(section)
        if not str(f.metadata.get(DOC, "")).strip()
    ]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _heads(out: str) -> list[str]:
    """The key lines of ``--help SECTION`` (indented two spaces; their docs six)."""
    return [line.strip() for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]


def test_should_document_every_key_when_a_dataclass_is_reachable_from_the_root():
    assert len(_sections()) >= 20  # every section and nested section, env.reward_functions' items too
    assert _undocumented() == [], "write doc(default, '...') or section(Cls) with a docstring"


@dataclasses.dataclass
class _Inner:
    """An inner section."""

    documented: int = doc(1, "Has a doc.")
    bare: int = 2


@dataclasses.dataclass
class _Outer:
    """A root whose section fields carry no doc."""

    items: list[_Inner] = dataclasses.field(default_factory=list)
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_should_find_the_key_when_a_field_has_no_doc():
    assert _undocumented(_Outer) == ["items", "inner", "items.bare", "inner.bare"]


def test_should_print_every_key_with_its_default_and_doc_when_help_names_grpo_loss(capsys):
    from trainer.config import LossConfig

    assert main(["--help", "grpo.loss"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("grpo.loss: The GRPO objective")
    for line in (
        "  policy_loss: str = clipped",
        "  ratio_clip_min: float = 0.2",
        "  ratio_clip_c: float | None = null",
        "  reference_policy_kl_penalty: float = 0.0",
        "  aggregation: str = token-mean",
        "  importance_sampling: str | None = null",
        "  kl_clamp: float | None = 10.0",
        "  ratio_level: str = token",
    ):
        assert line in out.splitlines(), line
    assert [h.split(":")[0] for h in _heads(out)] == [config_key(f) for f in dataclasses.fields(LossConfig)]
    for f in dataclasses.fields(LossConfig):
        assert _flat(f.metadata[DOC]) in _flat(out), f.name


@pytest.mark.parametrize("path", sorted(_sections()))
def test_should_print_every_key_and_its_doc_when_help_names_any_section(path, capsys):
    assert main(["--help", path]) == 0
    out = capsys.readouterr().out
    section = _sections()[path]
    heads = _heads(out)
    assert [h.split(":")[0] for h in heads] == [config_key(f) for f in dataclasses.fields(section)]
    for head, f in zip(heads, dataclasses.fields(section)):
        hint, key = _type_hints(section)[f.name], config_key(f)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            assert head == f"{key}: section (python -m trainer --help {path}.{key})"
        else:  # its type, then its default (or that it has none)
            assert head.startswith((f"{key}: {f.type} = ", f"{key}: {f.type} (required)")), head
        assert _flat(f.metadata[DOC]) in _flat(out), (path, key)


def test_should_show_nested_sections_and_list_items_when_a_section_holds_them(capsys):
    assert main(["--help", "policy"]) == 0
    out = capsys.readouterr().out
    assert "  moe: section (python -m trainer --help policy.moe)" in out.splitlines()
    assert "  adam_betas: tuple[float, float] = [0.9, 0.999]" in out.splitlines()
    assert main(["--help", "env"]) == 0
    out = _flat(capsys.readouterr().out)
    assert (
        "reward_functions: list[RewardSpec] = [{name: math, weight: 1.0, kwargs: {}, normalize: none, window: 20}]"
        in out
    )
    assert "Each item's keys: python -m trainer --help env.reward_functions." in out
    assert main(["--help", "env.reward_functions"]) == 0
    assert "  name: str (required)" in capsys.readouterr().out.splitlines()


def test_should_print_the_one_key_when_help_names_a_key(capsys):
    assert main(["--help=grpo.loss.tis_cap"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "grpo.loss.tis_cap: float = 2.0",
        "  importance_sampling=tis: ratios above it are truncated; >= 1.",
    ]
    assert main(["--help", "data.seed"]) == 0  # composed from the root seed: both are shown
    assert capsys.readouterr().out.startswith("data.seed: int = 42 (composed: ${seed})\n")
    assert main(["--help", "grpo.async.max_staleness"]) == 0  # the key as written, not the field async_
    assert capsys.readouterr().out.startswith("grpo.async.max_staleness: int = 0\n")


@pytest.mark.parametrize(
    "path, close",
    [
        ("grpo.los", " (did you mean grpo.loss?)"),
        ("polcy.moe", " (did you mean policy.moe?)"),
        ("grpo.async_", " (did you mean grpo.async?)"),
        ("grpo.loss.tis_cap.x", " (did you mean grpo.loss.tis_cap?)"),  # a key has no keys under it
        ("zzz", ""),
    ],
)
def test_should_name_the_close_match_and_the_sections_when_help_names_an_unknown_section(path, close, capsys):
    assert main(["--help", path]) == 2
    out = capsys.readouterr()
    assert not out.out
    assert out.err == (
        f"kuberl: error: unknown config section {path}{close}; sections: model, data, grpo, policy, "
        "generation, env, reward_model, judge, reward_server, cluster, logger, checkpointing\n"
    )


def test_should_say_that_help_takes_a_section_when_help_names_none(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m trainer [--cfg] experiment=NAME [key=value ...]\n")
    assert "  --help SECTION  print every key of a section" in out
    assert (
        "\nsections: model, data, grpo, policy, generation, env, reward_model, judge, reward_server, cluster, logger, checkpointing\n"
        in out
    )
    assert "experiments: " in out and "tiny" in out
    assert main(["experiment=tiny", "--help"]) == 0  # an override after it is no section
    assert capsys.readouterr().out == out
    assert main(["--help", "experiment=tiny"]) == 0
    assert capsys.readouterr().out == out
