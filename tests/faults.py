"""Faults for the checkpoint and refit tests, injected from the test side only: the trainer has no test hooks.

Each fault patches the driver process. Unit tests pass pytest's ``monkeypatch.setattr`` as ``patch``;
end-to-end tests start the real entry point through :func:`launch`, a ``python -c`` program that
applies the faults it is given and then runs ``python -m trainer``'s ``main`` with the overrides.
Only the driver is patched: it makes every directory-level change of a checkpoint (creating,
committing, pruning, cleaning), while the ranks in their Ray workers only write files into the
directory it created (DCP's own ``.metadata`` commit is a file rename, which flat buckets allow).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time


def refuse_dir_renames(patch=setattr) -> None:
    """Behave like Cloud Storage FUSE on a flat bucket: renaming a directory fails (EXDEV for
    ``rename``/``replace``, as gcsfuse answers with ``rename-dir-limit`` 0; EPERM for ``shutil.move``,
    which would otherwise fall back to copying). Renaming a file still works."""

    def guard(real, code):
        def patched(src, dst, *args, **kwargs):
            if os.path.isdir(src):
                raise OSError(
                    code, f"{os.strerror(code)} (directory rename refused by the test filesystem)", str(src)
                )
            return real(src, dst, *args, **kwargs)

        return patched

    patch(os, "rename", guard(os.rename, errno.EXDEV))
    patch(os, "replace", guard(os.replace, errno.EXDEV))
    patch(shutil, "move", guard(shutil.move, errno.EPERM))  # Path.rename/replace call os.rename/replace


def hold_before_marker(step: int, patch=setattr) -> None:
    """Stop the save of ``step`` after every shard and driver file is written, just before its commit
    marker, and wait there (to be killed): the worst moment for a crash."""
    from trainer import checkpoint

    real = checkpoint.write_marker

    def held(path, n):
        if n == step:
            print(f"fault: holding step {n} before its commit marker", flush=True)
            time.sleep(3600)
        return real(path, n)

    patch(checkpoint, "write_marker", held)


_LAUNCH = """
import sys
from tests import faults
for spec in sys.argv[1].split(";"):
    if spec:
        name, _, arg = spec.partition("=")
        getattr(faults, name)(*([int(arg)] if arg else []))
from trainer.__main__ import main
sys.argv = sys.argv[:1] + sys.argv[2:]
raise SystemExit(main())
"""


def launch(faults: str, overrides: list[str]) -> list[str]:
    """The command line of ``python -m trainer OVERRIDES`` with ``faults`` applied first,
    e.g. ``launch("refuse_dir_renames;hold_before_marker=4", [...])``."""
    return [sys.executable, "-c", _LAUNCH, faults, *overrides]


def fail_refit_after_first_chunk(patch=setattr) -> None:
    """Every generation actor the driver creates takes the first chunk of a refit, then raises (a load
    error, an out-of-memory): the sender is left with chunks nobody receives. The driver sends Ray the
    class it holds, so patching the driver's class patches the actors (Ray pickles a local class by value)."""
    from trainer.generation import worker
    from trainer.generation.refit.transport import WeightMeta, receive_packed

    class FailingReceiver(worker.GenerationWorker):
        def receive_weights(self, update_info: dict) -> None:
            next(iter(receive_packed(self.sync, WeightMeta.from_update_info(update_info), self.buffer_bytes)))
            raise RuntimeError("fault: the receiver failed after its first chunk")

    patch(worker, "GenerationWorker", FailingReceiver)


def hang_refit(patch=setattr) -> None:
    """Every generation actor hangs in a refit without receiving anything (a receiver stuck in a collective)."""
    from trainer.generation import worker

    class HangingReceiver(worker.GenerationWorker):
        def receive_weights(self, update_info: dict) -> None:
            time.sleep(3600)

    patch(worker, "GenerationWorker", HangingReceiver)
