"""No module-level mutable state in trainer/policy/: what a rank holds lives on its objects, passed by argument.

A policy rank's state (its model, its packed rows, its sequence-parallel group, what a kernel refused) is
held by the objects the rank builds and handed to what needs it; state kept in a module instead is shared
by every model of the process, outlives the call that set it and is read by code that never received it.
What this test refuses, in every module under trainer/policy/ (read with ``ast``, never imported):

- a module-level name bound to a mutable value: a list, dict or set (display or comprehension), or a call
  that is not one of :data:`CONSTANT_CALLS` (``x = SomeClass()`` builds state), and any ``x += ...``;
- a class attribute bound to a list, dict or set (shared by every instance);
- a ``global`` statement anywhere;
- a call at import (a statement that runs for its effect when the module is imported);
- a module-level function memoised with ``functools.cache``/``lru_cache`` (its cache is module state).

:data:`ALLOWED` names the exceptions, each with why it is a constant of the process (or, for the one call
at import, why it cannot be anywhere else); an entry that no longer matches anything fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trainer" / "policy"

# Calls whose result is immutable, or is the process's own registry entry (a logger).
CONSTANT_CALLS = {
    "logging.getLogger",
    "frozenset",
    "tuple",
    "re.compile",
    "TypeVar",
    "field",
    "dataclasses.field",
}
MEMOS = {"cache", "lru_cache", "functools.cache", "functools.lru_cache"}
MUTABLE_DISPLAYS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)

# (file relative to trainer/policy, what) -> why it may stay.
ALLOWED: dict[tuple[str, str], str] = {
    ("worker.py", "call heap.pause_for_actor"): (
        "the collector's pause for a rank's imports: Ray imports the module before PolicyWorker.__init__ "
        "runs, so the only place before those imports is the module's head (trainer.heap)"
    ),
    ("packed_attention.py", "memo _varlen_attn"): "which varlen function this torch has: fixed per process",
    ("packed_attention.py", "memo _parameters"): "a function's signature: fixed per process",
    ("packed_attention.py", "memo _flash_device"): "whether a device runs flash attention: fixed per process",
}


def _name(node: ast.expr) -> str:
    """``a.b.c`` for a name or an attribute chain, else its source."""
    return ast.unparse(node)


def _mutable(value: ast.expr | None) -> bool:
    if value is None:
        return False
    if isinstance(value, MUTABLE_DISPLAYS):
        return True
    if isinstance(value, ast.Call):
        return _name(value.func) not in CONSTANT_CALLS
    if isinstance(value, ast.Tuple):
        return any(_mutable(e) for e in value.elts)
    return False


def _targets(node: ast.Assign | ast.AnnAssign | ast.AugAssign) -> str:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return ", ".join(_name(t) for t in targets)


def _module_level(body: list[ast.stmt]):
    """The statements that run at import: the module's, and those inside its top-level if/try/with blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = (
                list(node.body) + list(getattr(node, "orelse", [])) + list(getattr(node, "finalbody", []))
            )
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            yield from _module_level(nested)


def offences(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each piece of module-level mutable state in ``source`` (the module docstring)."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in _module_level(tree.body):
        if isinstance(node, ast.AugAssign):
            found.append((node.lineno, f"assignment {_targets(node)}"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _mutable(node.value):
            found.append((node.lineno, f"assignment {_targets(node)}"))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            found.append((node.lineno, f"call {_name(node.value.func)}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                called = decorator.func if isinstance(decorator, ast.Call) else decorator
                if _name(called) in MEMOS:
                    found.append((node.lineno, f"memo {node.name}"))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.Assign, ast.AnnAssign)) and isinstance(item.value, MUTABLE_DISPLAYS):
                    found.append((item.lineno, f"class attribute {node.name}.{_targets(item)}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append((node.lineno, f"global {', '.join(node.names)}"))
    return found


def test_should_find_each_kind_of_module_state_when_a_module_holds_it():
    source = '''"""A module."""
import functools
import logging

log = logging.getLogger(__name__)
NAMES = ("a", "b")
LIMIT = 256 << 20
_ROW = None
_SEEN = {}
_ORDER: list[int] = []
_BY_NAME = {k: 1 for k in NAMES}
_STATE = Holder()
_COUNT = 0
_COUNT += 1
register(__name__)
try:
    _FALLBACK = set()
except ImportError:
    pass


@functools.lru_cache(maxsize=4)
def lookup(name):
    return name


class Holder:
    shared = []
    label = "x"


def set_row(row):
    global _ROW
    _ROW = row
'''
    assert [what for _, what in offences(source)] == [
        "assignment _SEEN",
        "assignment _ORDER",
        "assignment _BY_NAME",
        "assignment _STATE",
        "assignment _COUNT",
        "call register",
        "assignment _FALLBACK",
        "memo lookup",
        "class attribute Holder.shared",
        "global _ROW",
    ]


def test_should_hold_no_module_level_mutable_state_when_a_module_is_under_trainer_policy():
    seen, unexplained = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for line, what in offences(path.read_text()):
            if (relative, what) in ALLOWED:
                seen.add((relative, what))
            else:
                unexplained.append(f"trainer/policy/{relative}:{line}: {what}")
    assert not unexplained, (
        "module-level state in trainer/policy/ (hold it on the object that owns it and pass it by argument, "
        "or, for a true constant, add it to ALLOWED with why):\n" + "\n".join(unexplained)
    )
    stale = set(ALLOWED) - seen
    assert not stale, f"ALLOWED names what no module holds any more: {sorted(stale)}"
