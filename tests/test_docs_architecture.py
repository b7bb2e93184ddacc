"""docs/architecture.md cites only what exists, so the map fails a test instead of drifting from the code.

What the map may cite, and how each is checked (the sources are parsed with ``ast``, never imported):

- a path of the repository (``trainer/loop/grpo.py``, ``trainer/policy/``), in backticks, in a diagram or
  in running text: it exists;
- a name, always as ``path::Name`` or ``path::Class.attribute`` in backticks
  (``trainer/policy/group.py::PolicyGroup.train``): the file defines it, at module level (a function, a class,
  an assignment) or, for ``Class.attribute``, in the class body or as ``self.attribute`` in one of its methods;
- a later mention of a cited class, ``Class.attribute`` (``PolicyGroup.train``), in backticks or in a mermaid
  diagram: the class is cited somewhere as ``path::Class`` and has the attribute; a ``Class.attribute`` in a
  diagram whose class is cited nowhere fails too (cite it once in the text);
- a config key in backticks (``grpo.num_minibatches``, ``generation.placement=disaggregated``): the config
  that ``python -m trainer --cfg experiment=tiny`` prints has it;
- the layers diagram: one node per layer of the import-linter ``layers`` contract in pyproject.toml, in its
  order, naming exactly its modules.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import tomllib
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC_PATH = REPO / "docs" / "architecture.md"
DOC = DOC_PATH.read_text()

# Top-level entries of the repository a path may start with.
ROOTS = ("trainer", "tests", "docs", "charts", "bench", "docker", "mk", "values")
FILES = ("pyproject.toml", "Makefile", "README.md")
PATH = rf"(?:(?:{'|'.join(ROOTS)})/[\w./-]*|{'|'.join(re.escape(f) for f in FILES)})"
CITATION = re.compile(rf"`({PATH})::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")
# A path anywhere: not inside a longer word or path (``ray/trainer/x`` is not ours), nor a Python module
# path (``trainer.loop``), which has no slash.
ANY_PATH = re.compile(rf"(?<![\w/.-])({PATH})")
BACKTICKED = re.compile(r"`([^`\n]+)`")
MERMAID = re.compile(r"```mermaid\n(.*?)```", re.S)
CLASS_ATTR = re.compile(r"(?<![\w./])([A-Z][A-Za-z0-9]*)\.([A-Za-z_]\w*)(?![\w/])")


def cited_paths() -> set[str]:
    return {m.rstrip(".") for m in ANY_PATH.findall(DOC)}


def citations() -> list[tuple[str, str]]:
    return CITATION.findall(DOC)


@functools.cache
def tree(path: str) -> ast.Module:
    file = REPO / path
    return ast.parse(file.read_text(), filename=str(file))


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement assigns to (nothing for other nodes)."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _binds(node: ast.stmt) -> list[str]:
    """The names a statement of a module or class body defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    return [n.id for target in _targets(node) for n in ast.walk(target) if isinstance(n, ast.Name)]


def _find(body: list[ast.stmt], name: str) -> ast.stmt | None:
    for node in body:
        if name in _binds(node):
            return node
    return None


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """What the class's methods assign as ``self.x`` (``self.a, self.b = ...`` included)."""
    found = set()
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args:
            continue
        me = method.args.args[0].arg
        for node in ast.walk(method):
            for target in _targets(node):
                for n in ast.walk(target):
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me:
                        found.add(n.attr)
    return found


def defines(path: str, dotted: str) -> bool:
    """Whether the Python file ``path`` defines ``Name`` or ``Class.attribute``."""
    name, _, attr = dotted.partition(".")
    node = _find(tree(path).body, name)
    if node is None:
        return False
    if not attr:
        return True
    if not isinstance(node, ast.ClassDef):
        return False
    return _find(node.body, attr) is not None or attr in _self_attributes(node)


def cited_classes() -> dict[str, str]:
    """Class -> the file the map cites it from (``path::Class`` or ``path::Class.attribute``)."""
    classes = {}
    for path, dotted in citations():
        name = dotted.partition(".")[0]
        if (
            path.endswith(".py")
            and (REPO / path).is_file()
            and isinstance(_find(tree(path).body, name), ast.ClassDef)
        ):
            classes[name] = path
    return classes


def test_should_cite_only_paths_that_exist_when_the_map_names_a_file() -> None:
    paths = cited_paths()
    assert len(paths) > 20, f"the map cites {len(paths)} paths: has the path pattern stopped matching?"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md cites paths that do not exist: {missing}"


def test_should_cite_only_names_their_file_defines_when_the_map_names_code() -> None:
    cited = citations()
    assert len(cited) > 20, f"the map cites {len(cited)} names: has the citation pattern stopped matching?"
    wrong = []
    for path, dotted in cited:
        if not path.endswith(".py") or not (REPO / path).is_file():
            wrong.append(f"{path}::{dotted} (not a Python file)")
        elif not defines(path, dotted):
            wrong.append(f"{path}::{dotted}")
    assert not wrong, f"docs/architecture.md cites names their files do not define: {wrong}"


def test_should_name_only_what_a_cited_class_has_when_the_map_says_class_dot_name() -> None:
    classes = cited_classes()
    mentions = [m for text in BACKTICKED.findall(DOC) if "::" not in text for m in CLASS_ATTR.findall(text)]
    in_diagrams = [m for block in MERMAID.findall(DOC) for m in CLASS_ATTR.findall(block)]
    assert len(in_diagrams) > 5, "the diagrams name no Class.attribute: has the pattern stopped matching?"
    wrong = []
    for cls, attr in mentions + in_diagrams:
        if cls not in classes:
            if (cls, attr) in in_diagrams:
                wrong.append(f"{cls}.{attr} (cite the class once as path::{cls})")
            continue  # backticked text that is not ours (a library's class)
        if not defines(classes[cls], f"{cls}.{attr}"):
            wrong.append(f"{cls}.{attr} (not in {classes[cls]})")
    assert not wrong, f"docs/architecture.md names what the code does not have: {sorted(set(wrong))}"


def _composed_config(capsys: pytest.CaptureFixture[str]) -> dict:
    from trainer.__main__ import main

    with mock.patch.dict(os.environ):  # main sets its quiet environment defaults: not for the other tests
        assert main(["--cfg", "experiment=tiny"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def _has(config: dict, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_should_name_only_config_keys_that_exist_when_the_map_cites_a_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _composed_config(capsys)
    sections = "|".join(k for k, v in config.items() if isinstance(v, dict))
    key = re.compile(rf"((?:{sections})(?:\.\w+)+)(?:=\S*)?")
    keys = {m.group(1) for text in BACKTICKED.findall(DOC) if (m := key.fullmatch(text))}
    assert len(keys) > 5, f"the map cites {len(keys)} config keys: has the key pattern stopped matching?"
    missing = sorted(k for k in keys if not _has(config, k))
    assert not missing, (
        f"docs/architecture.md cites config keys that `--cfg experiment=tiny` does not print: {missing}"
    )


def test_should_draw_the_import_linter_layers_in_order_when_the_map_shows_the_layers() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    # the package's contract; the tools' own order (containers = trainer.tools) is told in the text
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers" and "containers" not in c]
    want = [sorted(m.strip().removeprefix("trainer.") for m in layer.split("|")) for layer in layers]
    (block,) = [b for b in MERMAID.findall(DOC) if "%% layers" in b]
    nodes = re.findall(r'^\s*L(\d+)\["([^"]*)"\]', block, flags=re.M)
    assert [int(n) for n, _ in nodes] == list(range(1, len(nodes) + 1)), "number the layer nodes L1, L2, ..."
    drawn = [sorted(m.strip() for m in label.split("<br/>")[0].split("·")) for _, label in nodes]
    assert drawn == want, "docs/architecture.md's layers diagram is not pyproject.toml's layers contract"


def test_should_link_the_map_when_a_reader_opens_the_readme() -> None:
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()
