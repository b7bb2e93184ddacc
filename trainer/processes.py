"""What this process started, ended with it: the one way the driver takes its process tree down."""

from __future__ import annotations

import contextlib


def kill_descendants() -> None:
    """SIGKILL every process below this one (a private local Ray's GCS, raylet and the raylet's agents).

    Walked while they are still below it: once the raylet is gone its agents belong to PID 1 and are found by
    nothing. Without psutil (it comes with ray[default]) the children are Ray's to reap.
    """
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
