"""The driver's handle on the policy ranks.

:class:`PolicyGroup` starts N :class:`PolicyWorker` actors in one placement group, forms their
torch.distributed world and fans batches out to them (equal shards, since FSDP steps are
collectives). Where generation runs is :mod:`trainer.generation.placement`'s business.
"""

from __future__ import annotations

from typing import Any

import ray

from trainer import watchdog
from trainer.algorithms import core_algos
from trainer.algorithms.objective import global_counts
from trainer.cluster import bundles_for, in_bundle, reserve
from trainer.config import Config, ConfigError
from trainer.policy.batch import Sample, shard_for_ranks, with_policy_gradient
from trainer.policy.worker import PolicyWorker


class PolicyGroup:
    def __init__(self, cfg: Config, model_path: str, colocated_engine: bool, wait: bool = True):
        core_algos.check_loss_config(cfg.grpo.loss)  # here, not as a RayActorError from every rank
        self.cfg = cfg
        self.model_path = model_path
        self.world_size = cfg.train_world_size
        # Data-parallel groups: with sequence parallelism every rank of a group gets the same shard.
        self.sp = cfg.policy.sequence_parallel_size
        self.dp = self.world_size // self.sp
        if self.sp > 1:
            _check_sequence_parallel(cfg, model_path)
        if cfg.policy.freeze:
            check_freeze(cfg, model_path)
        gpus = cfg.cluster.use_gpus
        self.pg = reserve(
            bundles_for(cfg.train_nodes, cfg.cluster.gpus_per_node, self.world_size, gpus), "kuberl-policy"
        )
        actor = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0)(PolicyWorker)
        # Any: Ray's stubs type an actor's methods as the plain functions, without their .remote
        self.workers: list[Any] = [
            actor.options(scheduling_strategy=in_bundle(self.pg, r)).remote(
                cfg, model_path, r, self.world_size, colocated_engine
            )
            for r in range(self.world_size)
        ]
        for r, w in enumerate(self.workers):
            watchdog.register(w, f"policy rank {r}")
        # Every rank joins rank 0's address (an ObjectRef: Ray hands over the value once rank 0 has it).
        # The set-up (imports, the process group, the model, FSDP) runs while the caller goes on when
        # ``wait`` is false: the driver reads and encodes its data meanwhile, then calls :meth:`wait_ready`.
        host, port = self.workers[0].address.options(num_returns=2).remote()
        self._setup: list[ray.ObjectRef] | None = [w.setup.remote(host, port) for w in self.workers]
        self.num_params = 0
        self.refit_bytes = 0  # what each refit moves into each engine (the trainable weights)
        self.trained_lengths: list[
            int
        ] = []  # of the last train(): tokens of each sample trained on (trainer.perf)
        self.trained_responses = 0  # of the last train(): their response tokens, which the LM head projects
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for every rank's set-up (a failed one raises its error here); a no-op once done."""
        if self._setup is not None:
            infos = ray.get(self._setup)
            self._setup = None
            self.num_params = infos[0]["num_params"]
            self.refit_bytes = infos[0]["refit_bytes"]

    def run(self, method: str, *args, **kwargs) -> list[Any]:
        """Call ``method`` on every rank (a collective) and wait."""
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def _per_rank(self, shards: list[list[int]]) -> list[list[int]]:
        """One shard per data-parallel group -> one per rank (a group's ranks share theirs)."""
        return [shards[r // self.sp] for r in range(self.world_size)]

    def compute_logprobs_async(self, samples: list[Sample], reference: bool = False):
        # A group's ranks return the same values: the duplicates write the same entries twice.
        shards = self._per_rank(shard_for_ranks(samples, self.dp))
        refs = [
            w.compute_logprobs.remote([samples[i] for i in idx], reference)
            for w, idx in zip(self.workers, shards)
        ]
        return refs, shards

    @staticmethod
    def gather_logprobs(pending, num_samples: int) -> list[list[float]]:
        refs, shards = pending
        out: list[Any] = [None] * num_samples
        for idx, values in zip(shards, ray.get(refs)):
            for i, v in zip(idx, values):
                out[i] = v
        return out

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """Split into ``grpo.num_minibatches`` optimizer steps, each spread over all ranks."""
        n_mb = self.cfg.grpo.num_minibatches
        # Without a KL term only the policy gradient is left, and it is zero for zero-advantage samples.
        skip = self.cfg.policy.skip_zero_advantage and self.cfg.grpo.loss.reference_policy_kl_penalty == 0
        per_rank: list[list[list[Sample]]] = [[] for _ in self.workers]
        counts = []
        self.trained_lengths = []
        self.trained_responses = 0  # response tokens trained on: the positions the LM head projects
        mb_size = len(samples) // n_mb
        for m in range(n_mb):
            mb = samples[m * mb_size : (m + 1) * mb_size]
            counts.append(global_counts(s.response_mask or [1] * len(s.response_ids) for s in mb))
            if skip:
                mb = with_policy_gradient(mb, self.dp)
            self.trained_lengths += [s.length for s in mb]
            self.trained_responses += sum(len(s.response_ids) for s in mb)
            for rank, idx in enumerate(self._per_rank(shard_for_ranks(mb, self.dp))):
                per_rank[rank].append([mb[i] for i in idx])
        results = ray.get([w.train.remote(per_rank[r], counts) for r, w in enumerate(self.workers)])
        return results[0]

    def perf_stats(self) -> list[dict[str, Any]]:
        """Per rank: its peak memory since the last call, and its device's peak FLOP/s (trainer.perf)."""
        return self.run("perf_stats")

    def shutdown(self, graceful: bool = True) -> None:
        """Release the ranks: let each close its engine and process group (``graceful``; bounded), then
        kill them. After a failure a rank may be stuck in a collective with a dead one: kill at once."""
        if graceful:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception:
                pass
        for w in self.workers:
            watchdog.forget(w)
            ray.kill(w)
        ray.util.remove_placement_group(self.pg)


def check_freeze(cfg: Config, model_path: str) -> None:
    """Each ``policy.freeze`` pattern must match a parameter of the model (on the meta device: nothing is
    read but its config), said here in one line rather than as an error from every rank."""
    from fnmatch import fnmatchcase

    from trainer.models import build_empty_model

    names = [
        name
        for name, _ in build_empty_model(
            model_path, cfg.model.dtype, cfg.model.trust_remote_code
        ).named_parameters()
    ]
    for pattern in cfg.policy.freeze:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"policy.freeze: {pattern!r} matches no parameter of {cfg.model.name} (its names look like "
                f"{names[0]!r}, {names[-1]!r}); fix the pattern or remove it"
            )


def _check_sequence_parallel(cfg: Config, model_path: str) -> None:
    """What the model must allow for policy.sequence_parallel_size, said here in one line rather than
    as an error from every rank."""
    from transformers import AutoConfig

    from trainer.config import ConfigError
    from trainer.policy.ulysses import check_model

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    problem = check_model(config, cfg.policy.sequence_parallel_size, cfg.model.attn_implementation)
    if problem:
        raise ConfigError(problem)
