"""Preemption: the run's SIGTERM handler and the save budget it decides by.

Preemption (SIGTERM: spot reclaim, ``ray job stop``, pod eviction) is honest about the time it has.
GKE gives a spot VM 15-30 s, so the run does not finish the step in flight: it stops at the next safe
point (a step boundary, or inside a step before the optimizer changes the weights, when the step in
flight is dropped and redone on resume; :meth:`trainer.run.TrainState.preemption_point`), and saves the
last finished step only if a save, timed by the last one, fits in what is left of
``checkpointing.preemption_grace_s`` (:meth:`Preemption.at_safe_point`). Otherwise it saves nothing and
says in one line which checkpoint the next run resumes from. A save cut off by the final SIGKILL leaves
no commit marker and is ignored (:mod:`trainer.checkpoint`). What it saves is a whole checkpoint
(weights, optimizer, loader position, RNG), never a partial one that could not be resumed exactly.
How long each part takes on the tiny test model is in bench/README.md ("Figures behind choices in the
math, the cluster and the heap").
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import CheckpointConfig
    from trainer.watchdog import Watch


class Preempted(Exception):
    """SIGTERM arrived; the run stopped at a safe point, saving what fitted in the grace budget."""

    def __init__(self, step: int, saved_step: int | None):
        last = f"step_{saved_step}" if saved_step is not None else "none"
        super().__init__(f"preempted after step {step} (last complete checkpoint: {last})")
        self.step, self.saved_step = step, saved_step


class Preemption:
    """The run's SIGTERM handler: notes when the signal came; the loop acts on it at its next safe
    point (:meth:`trainer.run.TrainState.preemption_point`). Installed by one run and removed when it
    closes, so a run started in-process (tests) leaves the caller's handler as it was."""

    # Past the grace budget by this much with no safe point reached (the main thread blocked in Ray on
    # a worker that will never answer), the watch ends the process.
    HARD_STOP_AFTER_S = 15.0

    def __init__(self, grace_s: float, watch: Watch | None = None):
        self.grace_s, self.watch = grace_s, watch
        self.received_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._previous = None

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def left_s(self) -> float:
        """Seconds left of the grace budget (negative when it is spent)."""
        return self.grace_s - (time.monotonic() - self.received_at) if self.requested else self.grace_s

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handler)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            print(
                f"kuberl: SIGTERM received: stopping at the next safe point; saving only if it fits in "
                f"checkpointing.preemption_grace_s={self.grace_s:g}",
                flush=True,
            )
            if self.watch is not None:
                self.watch.arm(
                    self.grace_s + self.HARD_STOP_AFTER_S,
                    f"SIGTERM: no safe point within checkpointing.preemption_grace_s={self.grace_s:g} "
                    f"+ {self.HARD_STOP_AFTER_S:g}s (a worker does not answer); stopping now",
                    143,
                )

    def at_safe_point(
        self, progress: Any, ck: CheckpointConfig, save: Callable[[], None], resumes_from: Callable[[], str]
    ) -> None:
        """A safe point: the weights are those of ``progress.step`` (a :class:`trainer.run.Progress`).
        After SIGTERM, ``save`` that step if it is not saved yet and the save fits in what is left of the
        grace budget, then raise :class:`Preempted`; ``resumes_from`` says where the next run starts."""
        if not self.requested:
            return
        p, grace = progress, ck.preemption_grace_s
        left = self.left_s()
        if p.saved_step == p.step or not ck.enabled or p.step == 0:
            why = (
                "checkpointing.enabled=false"
                if not ck.enabled
                else ("no step finished" if p.step == 0 else f"step {p.step} is saved")
            )
            print(f"kuberl: SIGTERM: {why}; exiting, {resumes_from()}", flush=True)
        elif p.save_s is None or p.save_s <= left:
            timing = (
                "no save timed yet in this run, it may not fit"
                if p.save_s is None
                else f"the last save took {p.save_s:.1f}s"
            )
            print(
                f"kuberl: SIGTERM: saving step {p.step} ({left:.1f}s of checkpointing.preemption_grace_s={grace:g} "
                f"left; {timing})",
                flush=True,
            )
            try:
                save()
            except (
                Exception
            ) as e:  # workers on the reclaimed node may be gone already: say so, keep the old one
                print(
                    f"kuberl: SIGTERM: saving step {p.step} failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                    f"{resumes_from()}",
                    flush=True,
                )
        else:
            print(
                f"kuberl: SIGTERM: not saving step {p.step}: a save takes about {p.save_s:.1f}s and "
                f"{max(left, 0):.1f}s of checkpointing.preemption_grace_s={grace:g} are left; "
                f"{resumes_from()}",
                flush=True,
            )
        raise Preempted(p.step, p.saved_step)
