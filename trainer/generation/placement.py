"""Where generation runs, behind one interface the GRPO loop samples from.

- :class:`ColocatedGenerator`: each policy rank generates with its own engine, on the rank's own
  device; after each optimizer step the rank loads the gathered weights into it in place.
- :class:`DisaggregatedGenerator`: generation actors (:class:`~trainer.generation.worker.GenerationWorker`)
  in their own placement group; after each step policy rank 0 sends them the new weights.

Which engine runs (``generation.backend``) is the factory's business (:mod:`trainer.generation.factory`),
not the placement's.

The disaggregated order, on both devices (vLLM's NCCL rendezvous on GPUs, its gloo twin on CPU):

1. the generation actors build their engines, and the driver waits until every one answers ``ready``
   (``generation.engine_start_timeout_s``): vLLM's trainer-side rendezvous gives the engines' workers
   300 s to join (``StatelessProcessGroup.create``'s store timeout, which we cannot set), and a 27B
   tensor-parallel engine can take longer than that to load, compile and capture its graphs;
2. only then do policy rank 0 and every engine open the weight-transfer group together, within
   ``generation.weight_group_timeout_s`` (a side that fails or does not join ends the start in one line
   naming it; the actors are then killed, not waited for);
3. each refit waits on the receivers first: one that fails ends the run at once, in one line naming
   it, instead of leaving rank 0 blocked in a broadcast that NCCL never times out; the whole refit has
   ``generation.refit_timeout_s``. The driver then kills the actors (rank 0 included) without waiting.
"""

from __future__ import annotations

import re
import time
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError

from trainer import watchdog
from trainer.cluster import in_bundle, reserve, split
from trainer.config import Config, ConfigError
from trainer.generation.base import SamplingParams
from trainer.generation.endpoint import EndpointError, read_token
from trainer.generation.refit.transport import init_info


class PolicyRanks(Protocol):
    """What placement needs of the policy (:class:`trainer.policy.group.PolicyGroup`, a layer above):
    its ranks, Ray actor handles with ``address``, ``weight_metadata``, ``init_weight_sync``,
    ``broadcast_weights``, ``close_weight_sync``, ``generate`` and ``refresh_engine``."""

    workers: list[Any]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...


class GenerationError(RuntimeError):
    """An engine did not start, or a refit did not complete; the message is one line, for people."""


def reason(error: BaseException) -> str:
    """The one line that says why a remote call failed: the remote exception's own last line, not Ray's
    wrapping and traceback."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and cause is not error:
        return reason(cause)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [
        line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?", line)
    ]
    if raised:
        return raised[-1]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def wait_all(calls: dict[Any, str], timeout_s: float, key: str, failed: str, late: str) -> None:
    """Wait for every object ref in ``calls`` (ref -> who runs it), failing at the first that raises
    ("WHO {failed}: why"), and at ``timeout_s`` (the value of config ``key``) if some have not returned
    ("WHO: {late} within KEY=Ns"): each a :class:`GenerationError`. An actor whose process is gone is
    left to the run's watch (:mod:`trainer.watchdog`), which names the loss and where to resume."""
    pending = dict(calls)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GenerationError(
                f"{', '.join(sorted(pending.values()))}: {late} within {key}={timeout_s:g}s"
            )
        done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        for ref in done:
            who = pending.pop(ref)
            try:
                ray.get(ref)
            except RayActorError as e:
                if not e.actor_init_failed:
                    raise  # its process is gone: the run's watch names the loss (trainer.watchdog)
                raise GenerationError(f"{who} {failed}: {reason(e)}") from None
            except Exception as e:  # the call raised: a bug or bad input, not a loss
                raise GenerationError(f"{who} {failed}: {reason(e)}") from None


class Generator(Protocol):
    def submit(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[tuple[Any, list[int]]]:
        """Start generating; returns (object ref, prompt indices) per worker so results can be
        consumed as each worker finishes. Each ref resolves to list[list[Completion]]. Seeds per prompt
        (``params.seeds``) go with their prompts to whichever worker samples them."""
        ...

    def update_weights(self) -> None:
        """Bring the engines up to date with the policy after an optimizer step."""
        ...

    def shutdown(self, graceful: bool = True) -> None:
        """Release the engines; ``graceful=False`` after a failure: no waiting on workers that may be stuck."""
        ...


class ColocatedGenerator:
    def __init__(self, policy: PolicyRanks):
        self.policy = policy

    def submit(self, prompts, n, params):
        parts = split(prompts, len(self.policy.workers))
        return [
            (w.generate.remote([prompts[i] for i in idx], n, params.for_prompts(idx)), idx)
            for w, idx in zip(self.policy.workers, parts)
            if idx
        ]

    def update_weights(self) -> None:
        self.policy.run("refresh_engine")

    def shutdown(self, graceful: bool = True) -> None:
        pass  # the engines belong to the policy ranks, which shut them down with themselves


class DisaggregatedGenerator:
    def __init__(self, cfg: Config, model_path: str, policy: PolicyRanks):
        from trainer.generation.worker import GenerationWorker

        self.policy = policy
        # generation.endpoint's own token (never Ray's), made here when $token_env holds none, so that the
        # driver's callers (env.verifiers) hold the one the actors check: handed to them with their arguments.
        token = None
        if cfg.generation.endpoint.enabled:
            try:
                token = read_token(cfg.generation.endpoint.token_env)
            except EndpointError as e:  # one line at start, before any actor
                raise ConfigError(str(e)) from None
        n = cfg.num_generation_workers
        gpus = cfg.cluster.use_gpus
        tp = cfg.generation.tensor_parallel_size
        # One bundle per engine: a tensor-parallel engine needs its tp GPUs on one node.
        self.pg = reserve(
            [{"GPU": tp, "CPU": 1} if gpus else {"CPU": 1} for _ in range(n)], "kuberl-generation"
        )
        actor = ray.remote(num_cpus=1, num_gpus=tp if gpus else 0)(GenerationWorker)
        # Any, as PolicyGroup's: Ray's stubs type a handle as ActorHandle[T] | type[T], whose methods are T's
        # plain functions, without .remote.
        self.workers: list[Any] = [
            actor.options(scheduling_strategy=in_bundle(self.pg, r)).remote(
                cfg, model_path, r, **({"endpoint_token": token} if token is not None else {})
            )
            for r in range(n)
        ]
        for r, w in enumerate(self.workers):
            watchdog.register(w, f"generation worker {r}")
        self.refit_timeout_s = cfg.generation.refit_timeout_s
        try:
            self._start(cfg, policy, n, tp)
        except BaseException:
            self.shutdown(graceful=False)  # the actors may be stuck in a rendezvous: not waited for
            raise
        # generation.endpoint: where each actor serves, (host, port) per engine
        self.endpoints: list[tuple[str, int]] = []
        if cfg.generation.endpoint.enabled:
            self.endpoints = ray.get([w.endpoint_address.remote() for w in self.workers])
            for r, (host, port) in enumerate(self.endpoints):
                print(
                    f"kuberl: generation engine {r} serves http://{host}:{port}/v1 (generation.endpoint)",
                    flush=True,
                )

    def _start(self, cfg: Config, policy: PolicyRanks, n: int, tp: int) -> None:
        # Every engine built before anyone opens the transfer group (module docstring, step 1).
        wait_all(
            {w.ready.remote(): f"generation engine {r}" for r, w in enumerate(self.workers)},
            cfg.generation.engine_start_timeout_s,
            "generation.engine_start_timeout_s",
            failed="failed to start",
            late="not ready",
        )
        # vLLM's weight-transfer contract (trainer.generation.refit.transport): policy rank 0 is rank 0,
        # engine r's tensor-parallel workers take the ranks from 1 + r * tp on.
        host, port = ray.get(policy.workers[0].address.remote())
        per_engine = tp if cfg.generation.backend == "vllm" else 1
        world = 1 + n * per_engine
        buffer = int(cfg.generation.refit_bucket_mb * 2**20)
        self.update_info = ray.get(policy.workers[0].weight_metadata.remote())
        # Step 2, bounded: NCCL's communicator init, its warm-up all-reduce and the synchronize after it
        # have no time limit of their own (vLLM bounds only its TCP store step), and this is the first
        # traffic between the node pools, where a broken RDMA path would hang here for good.
        joins = {
            w.init_weight_sync.remote(init_info(host, port, 0, world, buffer)): f"policy rank {r}"
            for r, w in enumerate(policy.workers)
        }
        joins.update(
            (
                w.init_weight_sync.remote(init_info(host, port, 1 + r * per_engine, world, buffer)),
                f"generation engine {r}",
            )
            for r, w in enumerate(self.workers)
        )
        wait_all(
            joins,
            cfg.generation.weight_group_timeout_s,
            "generation.weight_group_timeout_s",
            failed="failed to join the weight-transfer group",
            late="did not join the weight-transfer group",
        )

    def submit(self, prompts, n, params):
        parts = split(prompts, len(self.workers))
        return [
            (w.generate.remote([prompts[i] for i in idx], n, params.for_prompts(idx)), idx)
            for w, idx in zip(self.workers, parts)
            if idx
        ]

    def drain_requests(self) -> list[dict]:
        """What the endpoints served since the last drain (:meth:`GenerationWorker.drain_requests`), each
        record with the ``engine`` that sampled it; empty where generation.endpoint is off."""
        if not self.endpoints:
            return []
        drained = ray.get([w.drain_requests.remote() for w in self.workers])
        return [{**record, "engine": r} for r, records in enumerate(drained) for record in records]

    def update_weights(self) -> None:
        """One refit (module docstring, step 3): the receivers are listed first, so that when several calls
        have ended, a receiver's error is the one reported (the sender then only waits)."""
        calls = {
            w.receive_weights.remote(self.update_info): f"generation engine {r}"
            for r, w in enumerate(self.workers)
        }
        calls.update(
            (w.broadcast_weights.remote(self.update_info), f"policy rank {r}")
            for r, w in enumerate(self.policy.workers)
        )
        wait_all(
            calls,
            self.refit_timeout_s,
            "generation.refit_timeout_s",
            failed="failed in the weight refit",
            late="the weight refit did not finish",
        )

    def shutdown(self, graceful: bool = True) -> None:
        if graceful:
            # Both ends of the weight group leave it together, the policy's rank 0 (the store's host)
            # last; then the engines (vLLM's may hold processes of its own); then the actors.
            for call, timeout in (
                (lambda: [w.close_weight_sync.remote() for w in self.policy.workers + self.workers], 60),
                (lambda: [w.shutdown.remote() for w in self.workers], 60),
            ):
                try:
                    ray.get(call(), timeout=timeout)
                except Exception:
                    pass
        for w in self.workers:
            watchdog.forget(w)
            ray.kill(w)
        ray.util.remove_placement_group(self.pg)


def make_generator(cfg: Config, model_path: str, policy: PolicyRanks) -> Generator:
    if cfg.disaggregated:
        return DisaggregatedGenerator(cfg, model_path, policy)
    return ColocatedGenerator(policy)
