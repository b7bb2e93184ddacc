"""Python's cyclic garbage collector in a process that imports torch, transformers and Ray.

Importing them makes millions of objects that live as long as the process. The collector walks all of
them in each full collection: the imports alone trigger several (they grow the heap), and the exit
walks them once more: seconds of every driver's start and exit on a small CPU (bench/README.md, "Figures
behind choices in the math, the cluster and the heap"). So a process turns the collector off before its
imports (:func:`pause`) and, once they are done, freezes what they made (``gc.freeze``: left out of every
later collection) and turns it back on (:func:`settle`). What the run makes afterwards is collected as before; only the
objects there at :func:`settle`, the imported modules, are never collected, and they would live to
the end anyway. The pattern ``gc.freeze`` was added for (CPython's documentation of ``gc.freeze``).

A Ray actor imports its class's module when it is created, before its ``__init__`` runs: the module's
package calls :func:`pause_for_actor` with the class's name, and ``__init__`` settles.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
from collections.abc import Iterator

_settled = False


def pause() -> None:
    """No collections until :func:`settle`: call first thing, before the heavy imports."""
    if not _settled:
        gc.disable()


def pause_for_actor(cls: str) -> None:
    """:func:`pause` in a Ray actor of class ``cls`` (``module.Class``) being created, whose module is being
    imported for it; nothing in any other process (a driver, a test, another actor or task)."""
    ray = sys.modules.get("ray")  # a Ray worker has imported it; a process without it is none
    if (
        ray is not None
        and ray.is_initialized()
        and ray.get_runtime_context().get_task_function_name() == f"{cls}.__init__"
    ):
        pause()


def settle(*modules: str) -> None:
    """Import ``modules`` (the ones the process is about to need), freeze every object alive now and
    turn the collector on. Call right after the imports, before the process builds its own state:
    that state must stay collectable."""
    global _settled
    for name in modules:
        importlib.import_module(name)
    gc.freeze()
    gc.enable()
    _settled = True


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No collections inside, for a heavy import a process makes later (vLLM's, in a generation actor
    that has settled: a good part of that import's CPU time is collections; bench/README.md); the
    collector is as before after it. Nothing is frozen: what the import made is walked by the next full collection,
    and the engine that follows freezes its own heap."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
