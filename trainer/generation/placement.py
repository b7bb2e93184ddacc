"""Where generation runs, behind one interface the GRPO loop samples from.

- :class:`ColocatedGenerator`: each policy rank generates with its own engine, on the rank's own
  device; after each optimizer step the rank loads the gathered weights into it in place.
- :class:`DisaggregatedGenerator`: generation actors (:class:`~trainer.generation.worker.GenerationWorker`)
  in their own placement group; after each step policy rank 0 sends them the new weights.

Which engine runs (``generation.backend``) is the factory's business (:mod:`trainer.generation.factory`),
not the placement's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import ray

from trainer import watchdog
from trainer.cluster import in_bundle, reserve, split
from trainer.config import Config
from trainer.generation.base import SamplingParams
from trainer.generation.weight_transport import init_info

if TYPE_CHECKING:
    from trainer.policy.group import PolicyGroup


class Generator(Protocol):
    def submit(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[tuple[Any, list[int]]]:
        """Start generating; returns (object ref, prompt indices) per worker so results can be
        consumed as each worker finishes. Each ref resolves to list[list[Completion]]."""
        ...

    def update_weights(self) -> None:
        """Bring the engines up to date with the policy after an optimizer step."""
        ...

    def shutdown(self, graceful: bool = True) -> None:
        """Release the engines; ``graceful=False`` after a failure: no waiting on workers that may be stuck."""
        ...


class ColocatedGenerator:
    def __init__(self, policy: PolicyGroup):
        self.policy = policy

    def submit(self, prompts, n, params):
        parts = split(prompts, len(self.policy.workers))
        return [
            (w.generate.remote([prompts[i] for i in idx], n, params), idx)
            for w, idx in zip(self.policy.workers, parts)
            if idx
        ]

    def update_weights(self) -> None:
        self.policy.run("refresh_engine")

    def shutdown(self, graceful: bool = True) -> None:
        pass  # the engines belong to the policy ranks, which shut them down with themselves


class DisaggregatedGenerator:
    def __init__(self, cfg: Config, model_path: str, policy: PolicyGroup):
        from trainer.generation.worker import GenerationWorker

        self.policy = policy
        n = cfg.num_generation_workers
        gpus = cfg.cluster.use_gpus
        tp = cfg.generation.tensor_parallel_size
        # One bundle per engine: a tensor-parallel engine needs its tp GPUs on one node.
        self.pg = reserve([{"GPU": tp, "CPU": 1} if gpus else {"CPU": 1} for _ in range(n)], "kuberl-generation")
        actor = ray.remote(num_cpus=1, num_gpus=tp if gpus else 0)(GenerationWorker)
        self.workers = [
            actor.options(scheduling_strategy=in_bundle(self.pg, r)).remote(cfg, model_path, r) for r in range(n)
        ]
        for r, w in enumerate(self.workers):
            watchdog.register(w, f"generation worker {r}")
        # vLLM's weight-transfer contract (trainer.generation.weight_transport): policy rank 0 is rank 0,
        # engine r's tensor-parallel workers take the ranks from 1 + r * tp on.
        host, port = ray.get(policy.workers[0].address.remote())
        per_engine = tp if cfg.generation.backend == "vllm" else 1
        world = 1 + n * per_engine
        buffer = int(cfg.generation.refit_bucket_mb * 2**20)
        self.update_info = ray.get(policy.workers[0].weight_metadata.remote())
        ray.get(
            [w.init_weight_sync.remote(init_info(host, port, 0, world, buffer)) for w in policy.workers]
            + [
                w.init_weight_sync.remote(init_info(host, port, 1 + r * per_engine, world, buffer))
                for r, w in enumerate(self.workers)
            ]
        )

    def submit(self, prompts, n, params):
        parts = split(prompts, len(self.workers))
        return [
            (w.generate.remote([prompts[i] for i in idx], n, params), idx)
            for w, idx in zip(self.workers, parts)
            if idx
        ]

    def update_weights(self) -> None:
        ray.get(
            [w.broadcast_weights.remote(self.update_info) for w in self.policy.workers]
            + [w.receive_weights.remote(self.update_info) for w in self.workers]
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


def make_generator(cfg: Config, model_path: str, policy: PolicyGroup) -> Generator:
    if cfg.disaggregated:
        return DisaggregatedGenerator(cfg, model_path, policy)
    return ColocatedGenerator(policy)
