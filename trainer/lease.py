"""One run per checkpoint lineage: a lease on the run's checkpoint directory.

Two runs on one ``checkpoint_dir/<experiment>`` delete each other's work: at start a run removes every
``step_N`` without a commit marker (another run's save in flight), ``resume=auto`` continues the other
run's checkpoints, and ``keep_top_k`` prunes them. So a run holds a lease on the directory while it
lives, and a second run refuses in one line naming the holder.

The lease is one small file, ``OWNER.json``: who holds it (the lineage: ``$KUBERL_RELEASE``, the chart's
``<namespace>/<release>``, or ``user@host`` for a run outside a release), this run's id, host and pid, and
a heartbeat rewritten every :data:`HEARTBEAT_S` by a thread. Every storage the chart offers can create
and replace a file atomically (written beside it, then renamed: a file rename, which a flat Cloud Storage
bucket through GCS FUSE supports), but a bucket has no lock and no exclusive create. So a run takes the
lease by writing it and reading it back :data:`SETTLE_S` later: of two runs that both found the
directory free, the later write wins and the earlier writer sees it and refuses. That holds when a
run's read and its write are less than SETTLE_S apart, which one small file on any of those storages
is. A run also reads the lease before every write to the directory (a save, a commit, a pruning), so a
run whose lease was taken over stops without writing rather than racing the new holder.

A lease is free to take when:

- nobody holds it, or the holder released it (every way out of a run releases it, a failure included);
- its holder is an earlier run of this process (tests, notebooks), or a process on this host that is
  gone (a run killed with SIGKILL);
- its holder is an earlier attempt of this release on another host (a RayJob retried after its head pod
  was lost builds a new cluster);
- its heartbeat is older than ``checkpointing.lease_stale_after_s`` (a run whose host vanished);
- ``checkpointing.take_over=true``.

Each takeover is a line naming whom it took over from and why.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.checkpoint import CheckpointError, write_atomic

NAME = "OWNER.json"
HEARTBEAT_S = 30.0  # how often the holder rewrites its heartbeat
SETTLE_S = 1.5  # how long a run waits after writing the lease before reading it back


class LeaseError(CheckpointError):
    """The directory is another live run's; the message names it and how to take over."""


def lineage_owner() -> str:
    """Whose lineage this run continues: the chart's release (``namespace/release``), else user@host."""
    release = os.environ.get("KUBERL_RELEASE", "").strip()
    if release:
        return f"release {release}"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (some containers)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class Lease:
    """The lease of one run on ``root``: :meth:`acquire` at start, :meth:`check` before each write,
    :meth:`release` on the way out."""

    def __init__(self, root: Path, experiment: str, stale_after_s: float, take_over: bool = False):
        self.root, self.path = root, root / NAME
        self.stale_after_s, self.take_over = stale_after_s, take_over
        self.me: dict[str, Any] = {
            "owner": lineage_owner(),
            "run_id": uuid.uuid4().hex,
            "experiment": experiment,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
        }
        self.held = False
        self.lost_to: dict[str, Any] | None = None  # the lease as another run rewrote it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- reading -----------------------------------------------------------------------------------
    def read(self) -> dict[str, Any] | None:
        """The lease as written, or None when there is none (or only a damaged one, which holds nothing)."""
        try:
            lease = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None
        return lease if isinstance(lease, dict) and "run_id" in lease else None

    def describe(self, lease: dict[str, Any]) -> str:
        beat = time.time() - float(lease.get("heartbeat_at", lease.get("started_at", 0)))
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(lease.get("started_at", 0))))
        return (
            f"a run of {lease.get('experiment', '?')} by {lease.get('owner', '?')} (pid {lease.get('pid', '?')} on "
            f"{lease.get('host', '?')}, started {started}, last heartbeat {_ago(max(beat, 0.0))} ago)"
        )

    def free_because(self, lease: dict[str, Any]) -> str | None:
        """Why another run's lease may be taken, or None when its holder may still be running."""
        host, pid = lease.get("host"), lease.get("pid")
        beat = time.time() - float(lease.get("heartbeat_at", lease.get("started_at", 0)))
        if host == self.me["host"] and pid == self.me["pid"]:
            return "an earlier run of this process, which has ended"
        if host == self.me["host"] and isinstance(pid, int) and not _alive(pid):
            return f"its process (pid {pid} on {host}) is gone"
        if (
            lease.get("owner") == self.me["owner"]
            and self.me["owner"].startswith("release ")
            and host != self.me["host"]
        ):
            return f"an earlier attempt of {self.me['owner']} on {host}, which this attempt replaces"
        if beat > self.stale_after_s:
            return f"no heartbeat for {_ago(beat)} (checkpointing.lease_stale_after_s={self.stale_after_s:g})"
        if self.take_over:
            return "checkpointing.take_over=true"
        return None

    # ----- holding -----------------------------------------------------------------------------------
    def _write(self) -> None:
        write_atomic(self.path, json.dumps({**self.me, "heartbeat_at": time.time()}, indent=1))

    def acquire(self) -> str | None:
        """Take the lease, or raise :class:`LeaseError`. Returns a line when it took over another's."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = None
        held = self.read()
        if held is not None and held["run_id"] != self.me["run_id"]:
            why = self.free_because(held)
            if why is None:
                raise self._refusal(held)
            if why != "an earlier run of this process, which has ended":
                line = f"kuberl: took over {self.path} from {self.describe(held)}: {why}"
        self._write()
        time.sleep(SETTLE_S)
        now = self.read()
        if now is None or now["run_id"] != self.me["run_id"]:
            raise (
                self._refusal(now)
                if now is not None
                else LeaseError(
                    f"checkpointing: {self.path} vanished right after this run wrote it; is another run "
                    "removing the directory? Give this run its own checkpointing.checkpoint_dir"
                )
            )
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="kuberl-lease", daemon=True)
        self._thread.start()
        return line

    def _refusal(self, held: dict[str, Any]) -> LeaseError:
        return LeaseError(
            f"checkpointing: {self.root} is held by {self.describe(held)}; two runs on one checkpoint "
            "directory delete each other's checkpoints. Give this run its own checkpointing.checkpoint_dir "
            "(or experiment_name), or stop that run; if it is known to be dead, set checkpointing.take_over=true"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.check()
                self._write()
            except LeaseError:
                return  # check() recorded who took it; the next write to the directory stops the run
            except OSError as e:  # storage hiccup: the next beat tries again
                print(f"kuberl: warning: lease heartbeat to {self.path} failed ({e}); retrying", flush=True)

    def check(self) -> None:
        """Raise :class:`LeaseError` if this run no longer holds the lease (another run took it over)."""
        if not self.held:
            return
        now = self.read()
        if now is not None and now["run_id"] == self.me["run_id"]:
            return
        self.lost_to = now
        holder = self.describe(now) if now is not None else "nobody (the lease file was removed)"
        raise LeaseError(
            f"checkpointing: this run no longer holds {self.path}: it is now held by {holder}; this run "
            "stops without writing to the directory, which is that run's now"
        )

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still this run's. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.held:
            return
        self.held = False
        now = self.read()
        if now is not None and now["run_id"] == self.me["run_id"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
