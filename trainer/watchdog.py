"""The driver's watch over its Ray cluster and actors: a run that loses either ends in one line, in bounded time.

A single controller waits on its workers, so whatever it is doing (generating, training, saving after
SIGTERM) it must notice when they are gone instead of waiting forever:

- **An actor dies** (OOM, a crashed kernel, a reclaimed node): Ray raises in the driver's ``ray.get``.
  The first error is not always the dead actor's own: its FSDP peers, or a policy rank sending it a
  refit, may fail first with a broken collective ("Connection reset by peer"). :func:`diagnose` asks
  every actor the run registered (:func:`register`) whether it is alive, for a few seconds, and names
  the dead one ("policy rank 1"). An answer counts as alive only once ``SETTLE_S`` has passed: a death
  already under way (``ray.kill`` returns before the GCS has acted on it; a process going down) can
  still answer a first ping, and reporting the echo instead of the loss is the wrong line and exit code.
- **The cluster goes away** (the head pod, ``ray stop``): the driver may be blocked inside Ray, where
  no Python code runs and signals wait. :class:`Watch`, a thread of its own, probes the GCS port and
  ends the process when it has not answered for ``LOST_AFTER_S``.
- **Teardown hangs**: :meth:`Watch.deadline` ends the process when a step that must finish (closing
  after a failure, stopping after SIGTERM) has not finished in time.

Each ends with ``kuberl: error: lost ...`` and exit status :data:`LOST_EXIT`. Nothing is written on
the way out, so a committed checkpoint is untouched and a save cut off leaves no commit marker (it is
ignored on resume, :mod:`trainer.checkpoint`): a resubmission resumes from the last committed one.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trainer.processes import kill_descendants

LOST_EXIT = 4  # the run lost its cluster or a worker: resubmit (a RayJob may retry on it)
LOST_AFTER_S = 15.0  # the GCS unanswered this long: the cluster is gone (Ray's own reconnect gives 60 s)
PROBE_EVERY_S = 1.0
PING_S = 10.0  # how long diagnose waits for the actors' answers
SETTLE_S = 3.0  # an answer before this is asked again then: a death under way lands well within it

_ROLES: dict[str, tuple[str, Any]] = {}  # actor id (hex) -> (role, handle), for the run's actors


def register(handle: Any, role: str) -> None:
    """Name an actor of the run ("policy rank 0"), so that its death is reported by that name."""
    _ROLES[handle._actor_id.hex()] = (role, handle)


def forget(handle: Any) -> None:
    _ROLES.pop(handle._actor_id.hex(), None)


class Lost(RuntimeError):
    """The run lost a worker or its cluster; the message is one line, for people."""


def exit_now(line: str, code: int = LOST_EXIT) -> None:
    """Print ``line`` and end the process at once, from any thread: the main thread may be blocked in Ray.

    What this process started goes with it (a private local Ray's GCS, raylet and agents, which
    ``ray.shutdown`` would have stopped): nothing a run started outlives it.
    """
    print(f"kuberl: error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    kill_descendants()
    os._exit(code)


def gcs_reachable(address: str | None, timeout_s: float = 2.0) -> bool:
    """Whether the GCS at ``host:port`` accepts a connection (None: no address known, assume yes)."""
    if not address:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def gcs_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def _first_line(error: BaseException) -> str:
    """The reason in Ray's actor error, without its boilerplate."""
    text = str(error)
    for marker in ("Worker exit detail: ", "Worker exit type: "):
        if marker in text:
            return text.split(marker, 1)[1].split(". ")[0].strip().rstrip(".")
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def diagnose(
    error: BaseException, address: str | None = None, ping_s: float = PING_S, settle_s: float = SETTLE_S
) -> str | None:
    """What the run lost behind ``error``, a Ray error or an engine's or refit's failure raised in the
    driver, as a phrase ("policy rank 1 (its process is gone: ...)"), or None when nothing was lost (a worker
    raised: that is a bug, not a loss).

    Every registered actor is asked, for up to ``ping_s``; one that answers before ``settle_s`` is asked
    once more then, so that a death already under way when the error was raised is read, not missed: the
    error is often its echo (a peer's broken collective) and can reach the driver before the death does."""
    import ray
    from ray.exceptions import RayActorError

    if not gcs_reachable(address or gcs_address()):
        return f"the Ray cluster (its GCS at {address or gcs_address()} does not answer)"
    dead: dict[str, str] = {}
    if isinstance(error, RayActorError) and getattr(error, "actor_id", None) in _ROLES:
        dead[error.actor_id] = _first_line(error)
    # A dead actor answers with an error, a busy one not at all (it is stuck in a collective with the dead
    # one), so only dead ones are learnt within ping_s; an idle one answers at once, and is asked once more
    # at settle_s (ask: actor id -> when to send its next ping).
    handles = {actor_id: handle for actor_id, (_, handle) in _ROLES.items() if actor_id not in dead}
    start = time.monotonic()
    deadline, settled = start + ping_s, start + min(settle_s, ping_s)
    ask = dict.fromkeys(handles, start)
    pings: dict[Any, str] = {}  # object ref -> actor id
    while (pings or ask) and (now := time.monotonic()) < deadline:
        for actor_id in [a for a, at in ask.items() if at <= now]:
            del ask[actor_id]
            pings[handles[actor_id].__ray_ready__.remote()] = actor_id
        wake = min([deadline, *ask.values()])
        if not pings:
            time.sleep(max(0.0, wake - now))
            continue
        ready, _ = ray.wait(list(pings), num_returns=1, timeout=max(0.0, wake - now))
        for ref in ready:
            actor_id = pings.pop(ref)
            try:
                ray.get(ref)
            except RayActorError as e:
                dead[actor_id] = _first_line(e)
                continue
            except Exception:
                continue
            if time.monotonic() < settled:  # not yet proof of life: a kill in flight may land after it
                ask[actor_id] = settled
    if not dead:
        return None
    return ", ".join(
        f"{_ROLES[a][0]} (its process is gone: {why})"
        for a, why in sorted(dead.items(), key=lambda kv: _ROLES[kv[0]][0])
    )


class Watch:
    """A daemon thread: ends the process when the GCS stops answering, or when an armed deadline passes.

    ``describe()`` says where the run stands (which checkpoint a resubmission resumes from); it is
    called from this thread, so it must only read.
    """

    def __init__(self, address: str | None, describe: Callable[[], str], lost_after_s: float = LOST_AFTER_S):
        self.address, self.describe, self.lost_after_s = address, describe, lost_after_s
        self._deadlines: dict[int, tuple[float, str, int]] = {}  # id -> (monotonic time, line, exit code)
        self._next_id = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kuberl-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        unanswered_since: float | None = None
        while not self._stop.wait(PROBE_EVERY_S):
            now = time.monotonic()
            if gcs_reachable(self.address):
                unanswered_since = None
            else:
                unanswered_since = unanswered_since or now
                if now - unanswered_since >= self.lost_after_s:
                    exit_now(
                        f"lost the Ray cluster: its GCS at {self.address} has not answered for "
                        f"{now - unanswered_since:.0f}s; {self.describe()}"
                    )
            with self._lock:
                due = [v for v in self._deadlines.values() if v[0] <= now]
            if due:
                _, line, code = due[0]
                exit_now(f"{line}; {self.describe()}", code)

    @contextmanager
    def deadline(self, seconds: float, line: str, code: int = LOST_EXIT) -> Iterator[None]:
        """End the process with ``line`` if the block has not finished within ``seconds``."""
        key = self.arm(seconds, line, code)
        try:
            yield
        finally:
            with self._lock:
                self._deadlines.pop(key, None)

    def arm(self, seconds: float, line: str, code: int = LOST_EXIT) -> int:
        """A deadline with no block: from here on, the process has ``seconds`` left (e.g. after SIGTERM)."""
        with self._lock:
            key, self._next_id = self._next_id, self._next_id + 1
            self._deadlines[key] = (time.monotonic() + seconds, line, code)
        return key

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
