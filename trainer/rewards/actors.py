"""What the rewards scored by a model of their own share: the reward model (:mod:`trainer.rewards.reward_model`)
and the generative judge (:mod:`trainer.rewards.judge`) each run on Ray actors of their own, started once
per run, checked at start and watched while they run.

- :func:`model_path` and :func:`model_config`: the section's model exists and its config reads, or one
  line naming the key (:class:`~trainer.config.ConfigError`) before anything starts.
- :class:`ModelPool`: the replicas, ``cfg.replicas`` actors of ``cfg.num_cpus`` CPUs, ``cfg.num_gpus``
  GPUs and one unit of ``cfg.resource`` when set, registered with :mod:`trainer.watchdog` (a replica that
  dies ends the run in one line naming it) and waited for within ``cfg.start_timeout_s``
  (:class:`RewardModelError` otherwise). A batch goes to the next replica as a streaming call that yields
  None once the replica starts it (the reward runner's time limit counts from there), then
  ``(scores, notes, seconds)``.

A pool is named by its ``env.reward_functions`` entry (``NAME``) and its config section (``SECTION``);
the reward runner (:mod:`trainer.rewards.runner`) sends it each chunk of samples and joins its scores to
the other rewards' by weight.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any, ClassVar

from trainer.config import ConfigError, RewardSpec


class RewardModelError(RuntimeError):
    """A model-scored reward's replicas cannot score (they did not start in time); one line for people
    (python -m trainer prints it as it does a ClusterError; importing the rewards never imports Ray)."""


def used(name: str, specs: list[RewardSpec]) -> bool:
    """An entry of ``env.reward_functions`` names ``name``."""
    return any(spec.name == name for spec in specs)


def model_path(name: str | None, key: str, entry: str, fix: str) -> str:
    """``key``'s value (a model's hub id or directory); a ConfigError when it is null, for the
    ``entry`` of env.reward_functions needs one: "set it to ``fix``"."""
    if not name:
        raise ConfigError(f"env.reward_functions names {entry}, but {key} is null; set it to {fix}")
    return name


def model_config(name: str, key: str, trust_remote_code: bool) -> Any:
    """The transformers config of the model ``key`` names, read alone; else one line naming the key."""
    from transformers import AutoConfig

    from trainer.models import ModelNotFoundError, hub_id_or_directory

    try:
        path = hub_id_or_directory(name, key)
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        from trainer.models.shape import known_config

        # No hub here (an offline check, a cluster without egress): a model of the shape table is checked
        # against the table's copy of its config.
        if (known := known_config(name)) is not None:
            return known
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}={name}: cannot read its config: {first}") from None


def _safetensors_problem(path: str) -> str | None:
    """Why ``path`` is not a readable safetensors file (its 8-byte length and JSON header), or None."""
    import json
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return "is shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                return "has no safetensors header (its length field is not one)"
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if os.path.getsize(path) < 8 + n + end:
            return f"is cut short ({os.path.getsize(path)} bytes; its header describes {8 + n + end})"
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"has no readable safetensors header ({type(e).__name__})"
    return None


def check_weights(name: str, key: str) -> None:
    """A model directory holds its weights, whole: ``model.safetensors`` (its header read, its size checked)
    or every shard its index names, else ``pytorch_model.bin`` (or its shards); else a ConfigError naming the
    key. A directory with a config.json and no weights otherwise passes every check at start and fails on the
    actors, as an error a RayJob would retry for ever. A hub id is not checked here (the replicas download it)."""
    import json

    from trainer.models import ModelNotFoundError, hub_id_or_directory

    try:
        path = hub_id_or_directory(name, key)
    except ModelNotFoundError:
        return  # model_config said so already
    if not os.path.isdir(path):
        return
    problems = []
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):  # fmt: skip
        index_path = os.path.join(path, index)
        if os.path.isfile(index_path):
            try:
                shards = sorted(set(json.loads(open(index_path).read())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise ConfigError(f"{key}={name}: {index} cannot be read ({type(e).__name__})") from None
        elif os.path.isfile(os.path.join(path, single)):
            shards = [single]
        else:
            continue
        for shard in shards:
            full = os.path.join(path, shard)
            why = _safetensors_problem(full) if shard.endswith(".safetensors") else (
                None if os.path.isfile(full) else "is missing")  # fmt: skip
            if why:
                problems.append(f"{shard} {why}")
        if not problems:
            return
        break
    detail = "; ".join(problems[:3]) if problems else (
        "no weights (model.safetensors, its index, or pytorch_model.bin)")  # fmt: skip
    raise ConfigError(
        f"{key}={name}: the directory holds {detail}; copy the model's weights in whole, or point {key} at a "
        "directory that has them"
    )


def device_and_dtype(num_gpus: float, dtype: str) -> tuple[str, str]:
    """A replica's device (a GPU when it asked for one and sees one) and its dtype, ``auto`` resolved."""
    import torch

    from trainer import hardware

    device = "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" or hardware.native_bf16() else "float32"
    return device, dtype


class ModelPool:
    """The replicas of one model-scored reward, started once per run; :meth:`call` sends a batch to the next
    one (round robin). Shared by the run's reward runners; each tracks its own batches in flight."""

    NAME: ClassVar[str]  # its env.reward_functions entry
    SECTION: ClassVar[str]  # its config section
    WHAT: ClassVar[str]  # what people call it, in messages ("reward model")
    worker: ClassVar[type]  # the replica's class (a Ray actor; takes the section's config)

    def __init__(self, cfg: Any):
        import ray

        from trainer import watchdog

        self.cfg = cfg
        options: dict[str, Any] = {
            "num_cpus": cfg.num_cpus,
            "num_gpus": cfg.num_gpus,
            "max_restarts": 0,
            "max_concurrency": 1,
        }
        if cfg.resource:
            options["resources"] = {cfg.resource: 1}
        actor: Any = ray.remote(self.worker)
        # Any: Ray's stubs type an actor's methods as the plain functions, without their .remote
        self._new = lambda: actor.options(**options).remote(cfg)
        self.workers: list[Any] = [self._new() for _ in range(cfg.replicas)]
        for r, w in enumerate(self.workers):
            watchdog.register(w, f"{self.WHAT} replica {r}")
        self._next = itertools.count()
        self.info: list[dict] = []
        self.restarts = 0

    def model_name(self) -> str:
        """The key and value of the model it serves, for messages (``reward_model.name=...``)."""
        raise NotImplementedError

    def item(self, ground_truth: Any, response: str, messages: list[dict]) -> Any:
        """What a replica reads of one sample (the prompt's ``messages``, its last user turn the question)."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Every replica has loaded its model, within ``start_timeout_s``; else one line."""
        import ray

        refs = [w.ready.remote() for w in self.workers]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.start_timeout_s)
        if waiting:
            raise RewardModelError(
                f"{len(waiting)} of {len(refs)} {self.WHAT} replicas did not load {self.model_name()} within "
                f"{self.SECTION}.start_timeout_s={self.cfg.start_timeout_s:g}s: the cluster has no room for "
                f"them ({self.asks()} each) or the model is slow to load; raise the timeout or free those resources"
            )
        self.info = ray.get(refs)

    def asks(self) -> str:
        """What each replica asks Ray for, in words."""
        parts = [f"{self.cfg.num_cpus:g} CPU"] + ([f"{self.cfg.num_gpus:g} GPU"] if self.cfg.num_gpus else [])
        return " + ".join(parts + ([f"1 {self.cfg.resource}"] if self.cfg.resource else []))

    def describe(self) -> str:
        raise NotImplementedError

    def pick(self) -> int:
        """The replica the next batch goes to (round robin)."""
        return next(self._next) % len(self.workers)

    def call(self, items: list, replica: int | None = None) -> Any:
        """Score ``items`` on ``replica`` (by default the next one): a streaming generator (None once started,
        then the result)."""
        return self.workers[self.pick() if replica is None else replica].score.remote(items)

    def restart(self, replica: int) -> None:
        """Replace ``replica``, stuck on a batch past its time limit: Ray cannot stop an actor's running call
        (``ray.cancel`` leaves it running), so the replica is killed and another loads the model in its place.
        The batches queued on it fail with it: the caller sends them again (:meth:`call`)."""
        import ray

        from trainer import watchdog

        old = self.workers[replica]
        watchdog.forget(old)  # killed on purpose: not a loss to report
        try:
            ray.kill(old)
        except Exception:  # noqa: S110  (already gone)
            pass
        self.workers[replica] = self._new()
        watchdog.register(self.workers[replica], f"{self.WHAT} replica {replica}")
        self.restarts += 1

    def shares(self, n: int) -> list[slice]:
        """``n`` samples split into one batch per replica (fewer when there are fewer samples)."""
        k = max(1, min(len(self.workers), n))
        size = -(-n // k)
        return [slice(i, min(n, i + size)) for i in range(0, n, size)]

    def finish(self, raw: float | None, note: str) -> tuple[float, float | None, str]:
        """A replica's score for one sample as the reward's: ``(score, raw, note)``."""
        raise NotImplementedError

    def shutdown(self, graceful: bool = True) -> None:
        import ray

        from trainer import watchdog

        for w in self.workers:
            watchdog.forget(w)
            try:
                ray.kill(w)
            except Exception:  # noqa: S110  (already gone)
                pass
        self.workers = []


class PoolComponent:
    """A model-scored reward as a run component (:mod:`trainer.components`): ``check`` reads its model's config
    and weights before anything starts; ``start`` launches its replicas (``scorer``, the pool the reward runner
    sends each chunk to); ``wait_ready``, ``describe`` and ``shutdown`` are the pool's."""

    def __init__(self, what: str, check: Callable[[], None], make: Callable[[], ModelPool]) -> None:
        self.name = what
        self._check, self._make = check, make
        self.scorer: ModelPool | None = None

    def check(self) -> None:
        self._check()

    def start(self) -> None:
        self.scorer = self._make()

    def wait_ready(self) -> None:
        if self.scorer is not None:
            self.scorer.wait_ready()

    def describe(self) -> str | None:
        return self.scorer.describe() if self.scorer is not None else None

    def shutdown(self, graceful: bool = True) -> None:
        if self.scorer is not None:
            self.scorer.shutdown(graceful)
