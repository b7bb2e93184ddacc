"""A permanent error, remembered so that a RayJob's retries of it end at once; and error lines without colour.

A permanent error (the exit codes: :mod:`trainer.__main__`) is one a retry of the same command cannot fix:
a model without weights, a chat template the run cannot use, a checkpoint of another config. A KubeRay
RayJob cannot be told so. KubeRay reads the Ray job's status, not the driver's exit code, and retries a
FAILED Ray job on a fresh cluster up to ``backoffLimit`` times whatever the cause
(``checkBackoffLimitAndUpdateStatusIfNeeded`` in its rayjob controller, v1.7: only a failure it gave the
reason DeadlineExceeded or JobStatusCheckTimeoutExceeded itself is not retried). The one status it does
not retry from inside is a STOPPED Ray job, which it reports as Complete: a run that stopped itself to
end the retries would read as a success in ``kubectl get rayjob``, and a failure must read as one.

So the retries happen, and are made cheap instead. Under a RayJob (its Ray job metadata carries
``kuberl.dev/retried-by: RayJob``, which the chart's RayJob sets), a permanent error is written to
``PERMANENT_ERROR.json`` in the run's checkpoint directory (``checkpoint_dir/<experiment>/``), which every
attempt of a release shares, with the error's line and a fingerprint of the config and the image
(``KUBERL_IMAGE``). The next attempt reads it first, after composing its config and before it checks a
name, starts Ray or loads anything, and ends in seconds with the same line and how to clear it; the RayJob
still spends its ``backoffLimit`` retries, each a cluster's start-up and no training, and ends Failed
with the line in its status message. A changed config or image (a ``helm upgrade`` that fixes the cause:
each retry takes the RayJob's current spec) has another fingerprint, so its attempt runs, and removes the
marker with a line. A cause fixed outside the config (the weights copied in) needs the marker removed by
hand; the line names it. A run not started by a RayJob (``make train``, ``make submit``) neither writes
nor reads it: nothing retries it, and a person reruns what they choose.

An error whose text says the network failed (a hub or a tracker that did not answer) is not permanent
whatever its class (:func:`unreachable`): remembering it would end every retry of a run that the next
attempt may well start.

Ray colours the error of an actor whose constructor raised (colorama's codes, in a file or a pod's log as
well as on a terminal); :func:`plain` takes them out of an error line, and :func:`actor_init_failure` makes
such an error one line.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from trainer.config import Config, to_dict

MARKER = "PERMANENT_ERROR.json"
# The Ray job metadata the chart's RayJob sets (charts/kuberl/templates/rayjob.yaml): a RayJob retries this run.
RETRIED_BY = ("kuberl.dev/retried-by", "RayJob")
JOB_CONFIG_ENV = (
    "RAY_JOB_CONFIG_JSON_ENV_VAR"  # what Ray's job supervisor gives its entrypoint: metadata, runtime env
)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# What the hub, HTTP clients and the trackers say when the network, not the request, failed.
_UNREACHABLE = re.compile(
    r"couldn't connect|could not connect|couldn't reach|cannot reach|connection (?:refused|reset|aborted|error)"
    r"|connectionerror|connecttimeout|readtimeout|max retries exceeded|timed out"
    r"|temporary failure in name resolution|is unreachable|does not answer|too many requests"
    r"|service unavailable|\b(?:429|500|502|503|504) (?:client|server) error",
    re.IGNORECASE,
)


def plain(text: str) -> str:
    """``text`` without ANSI escape sequences."""
    return _ANSI.sub("", text)


def unreachable(text: str) -> bool:
    """The error ``text`` says a server did not answer (a retry later may pass), not that the request is wrong."""
    return bool(_UNREACHABLE.search(text))


def actor_init_failure(error: BaseException) -> str | None:
    """One line for a Ray actor whose constructor raised ("RewardModelWorker could not start: RuntimeError:
    ..."), from Ray's error, which holds the constructor's whole traceback in colour; None for any other error."""
    if not getattr(error, "actor_init_failed", False):
        return None
    text = plain(str(error))
    named = re.search(r"ray::(\w+)\.__init__\(\)", text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    cause = lines[-1] if lines else type(error).__name__  # a traceback ends with "Type: message"
    return f"{named.group(1) if named else 'an actor'} could not start: {cause}"


def retried_by_rayjob(environ: dict[str, str] | None = None) -> bool:
    """This process is the entrypoint of a Ray job that a RayJob retries (its metadata says so)."""
    raw = (os.environ if environ is None else environ).get(JOB_CONFIG_ENV)
    if not raw:
        return False
    try:
        metadata = json.loads(raw).get("metadata") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(metadata, dict) and metadata.get(RETRIED_BY[0]) == RETRIED_BY[1]


def marker_path(cfg: Config) -> Path:
    return Path(cfg.checkpointing.checkpoint_dir) / cfg.experiment_name / MARKER


def fingerprint(cfg: Config) -> str:
    """What a permanent error was found under: the whole composed config and the image."""
    text = json.dumps(to_dict(cfg), sort_keys=True, default=str) + "\0" + os.environ.get("KUBERL_IMAGE", "")
    return hashlib.sha256(text.encode()).hexdigest()


def _applies(cfg: Config) -> bool:
    return cfg.checkpointing.enabled and retried_by_rayjob()


def remember(cfg: Config, line: str) -> str:
    """Write the marker for the permanent error ``line`` when a RayJob retries this run; the line to print
    (``line``, and what the next attempts do, when the marker was written)."""
    if not _applies(cfg):
        return line
    path = marker_path(cfg)
    record: dict[str, Any] = {
        "line": line,
        "fingerprint": fingerprint(cfg),
        "at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{MARKER}.{os.getpid()}")
        staged.write_text(json.dumps(record) + "\n")
        staged.replace(path)  # a file rename: whole or absent on every filesystem the checkpoints use
    except OSError as e:  # the directory is the problem (it may be the error itself): the line still says why
        return f"{line} [permanent; not recorded for the RayJob's retries ({e.strerror or e}): each will fail the same way]"
    return (
        f"{line} [permanent: a retry fails the same way; the RayJob's further attempts stop at start with this "
        f"line until its config or image changes or {path} is removed]"
    )


def recall(cfg: Config) -> str | None:
    """The line an attempt ends with at once, when an earlier attempt of a RayJob hit a permanent error under
    the same config and image; None to run (no marker, not a RayJob, or a marker of another config or image,
    which is removed with a line)."""
    if not _applies(cfg):
        return None
    path = marker_path(cfg)
    try:
        record = json.loads(path.read_text())
        line, at, then = str(record["line"]), str(record["at"]), record["fingerprint"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # cut off or edited: it proves nothing
        print(f"kuberl: warning: ignoring {path}: it cannot be read ({type(e).__name__})", flush=True)
        return None
    if then != fingerprint(cfg):
        try:
            path.unlink()
            print(
                f"kuberl: removed {path}: a permanent error under another config or image ({line})",
                flush=True,
            )
        except (
            OSError
        ):  # another attempt removed it first, or the directory is read-only: it is ignored anyway
            pass
        return None
    return (
        f"{line} [permanent, found by an earlier attempt at {at}; not retried: fix the cause and resubmit (a "
        f"changed config or image runs again), or remove {path} to run this config again]"
    )
