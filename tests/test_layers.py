"""Layers: the order of trainer's packages is a contract that import-linter checks (``[tool.importlinter]``
in pyproject.toml: entry points > run > loop > policy > engines > rewards and data > math, models and
trackers > plumbing > config; the engines never import the policy), and no module of ``trainer/``
imports, however indirectly, a module that imports it back (within a package too, which layers do not see).

Every import statement counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:``. Moving an import into a function changes when a circle bites, not whether it is
there; a layer imports only what lies below it. The sources are parsed with ``ast``, never imported.

``from trainer.x import y`` depends on ``trainer.x`` (a package's ``__init__`` is a module like any
other) and, when ``y`` is a submodule, on ``trainer.x.y`` too. Dynamic imports (``importlib``) are not
statements and are not counted.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "trainer"

# Circles allowed, by name, until an issue removes them: none today. (The vLLM engine reaches its
# weight-transfer backend through vLLM's plugin entry point, not an import.)
ALLOWED: set[frozenset[str]] = set()


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/package`` (``__init__`` names its package)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules in ``known`` that ``name`` (at ``path``) imports anywhere in its source."""

    def within(dotted: str) -> str | None:  # the longest prefix of ``dotted`` that is one of ours
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if (prefix := ".".join(parts[:n])) in known:
                return prefix
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            deps.update(within(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this package, each further level one package up
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            deps.add(within(target))
            deps.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {d for d in deps if d is not None and d != name}


def graph(root: Path, package: str) -> dict[str, set[str]]:
    found = modules(root, package)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def strongly_connected(g: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module, iteratively (no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def circles(g: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest circle through each member of ``component``, as ``a -> b -> a``, without repeats."""
    seen, paths = set(), []
    for start in sorted(component):
        parent: dict[str, str] = {}
        queue = deque([start])
        while queue and start not in parent:
            node = queue.popleft()
            for child in sorted(g[node] & component):
                if child not in parent:
                    parent[child] = node
                    queue.append(child)
        cycle = [start]
        while (cycle[-1] != start or len(cycle) == 1) and cycle[-1] in parent:
            cycle.append(parent[cycle[-1]])
        cycle.reverse()  # start -> ... -> start
        key = frozenset(zip(cycle, cycle[1:]))
        if key not in seen:
            seen.add(key)
            paths.append(" -> ".join(cycle))
    return paths


def test_should_have_no_import_circle_when_counting_every_import_in_trainer():
    g = graph(REPO, PACKAGE)
    assert len(g) > 40 and "trainer.loop.grpo" in g, "the module walk missed trainer/"
    found = [c for c in strongly_connected(g) if frozenset(c) not in ALLOWED]
    paths = [p for c in found for p in circles(g, c)]
    assert not paths, (
        "import circles in trainer/ (imports inside functions and under TYPE_CHECKING count too); "
        "move what both sides need into a module below them:\n  " + "\n  ".join(paths)
    )


def test_should_drop_an_allowed_circle_when_it_is_gone():
    components = {frozenset(c) for c in strongly_connected(graph(REPO, PACKAGE))}
    for pair in ALLOWED:
        assert pair in components, f"{sorted(pair)} no longer import each other: remove them from ALLOWED"


@pytest.fixture
def toy(tmp_path):
    def write(files: dict[str, str]) -> dict[str, set[str]]:
        for rel, source in files.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(source)
        return graph(tmp_path, "pkg")

    return write


def test_should_count_imports_in_functions_type_checking_and_relative_when_building_the_graph(toy):
    g = toy(
        {
            "pkg/__init__.py": "from pkg.sub.b import thing\n",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "def f():\n    from .. import a\n    from . import c\n",
            "pkg/sub/c.py": "import pkg.sub.b as b\nimport os\nfrom .b import x\n",
        }
    )
    assert g == {
        "pkg": {"pkg.sub.b"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg", "pkg.a", "pkg.sub", "pkg.sub.c"},
        "pkg.sub.c": {"pkg.sub.b"},
    }
    (component,) = strongly_connected(g)
    assert component == {"pkg", "pkg.a", "pkg.sub.b", "pkg.sub.c"}
    assert circles(g, component) == [
        "pkg -> pkg.sub.b -> pkg",
        "pkg.a -> pkg.sub.b -> pkg.a",
        "pkg.sub.c -> pkg.sub.b -> pkg.sub.c",
    ]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the ``trainer`` package under ``root``, with ``root``'s pyproject.toml."""
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), (
        "lint-imports is missing: `make setup` installs import-linter (pyproject's dev extra)"
    )
    return subprocess.run(
        [str(exe), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": ""},
    )


@pytest.mark.integration  # runs lint-imports
def test_should_keep_every_layer_contract_when_import_linter_checks_trainer():
    out = _lint_imports(REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout


@pytest.mark.parametrize("where", ["in a function", "under TYPE_CHECKING"])
@pytest.mark.integration  # runs lint-imports
def test_should_break_the_contract_when_an_engine_imports_the_policy_where_it_runs_late(tmp_path, where):
    shutil.copytree(REPO / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    upward = (
        "def _late():\n    from trainer.policy import worker  # noqa\n"
        if where == "in a function"
        else "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.policy.group import PolicyGroup  # noqa\n"
    )
    with open(tmp_path / PACKAGE / "generation" / "base.py", "a") as f:
        f.write("\n" + upward)
    out = _lint_imports(tmp_path)
    assert out.returncode != 0 and "Contracts: 1 kept, 2 broken." in out.stdout, out.stdout[-3000:]
    assert "trainer.generation.base -> trainer.policy" in out.stdout


@pytest.mark.integration  # runs lint-imports
def test_should_break_the_contract_when_the_run_core_imports_a_command_line_tool(tmp_path):
    # trainer/tools/ sits above the run core as one package: a core module that borrows a tool's helper
    # (here the release resolution of submit) breaks the layers, however late it imports it.
    shutil.copytree(REPO / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / PACKAGE / "rewards" / "registry.py", "a") as f:
        f.write("\ndef _late():\n    from trainer.tools.submit import resolve  # noqa\n")
    out = _lint_imports(tmp_path)
    assert out.returncode != 0 and "Contracts: 2 kept, 1 broken." in out.stdout, out.stdout[-3000:]
    assert "trainer.rewards.registry -> trainer.tools.submit" in out.stdout
