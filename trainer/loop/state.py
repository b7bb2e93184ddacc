"""What the GRPO loop and its rollout stream use of a run: :class:`LoopState`.

The run (``trainer.run``) builds the workers, data and logger, saves checkpoints and handles SIGTERM,
and it calls the loop; so the loop cannot name the run's own class without importing the layer above
it. It names this protocol instead, which lists only what :mod:`trainer.loop.grpo` and
:mod:`trainer.loop.rollout_stream` read or call; ``TrainState`` satisfies it (mypy checks that where
``trainer.run`` hands it to the loop), and the rollout stream's tests pass a plain namespace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the run has loaded these (Ray, the workers) before the loop starts
    from trainer.data.loader import PromptLoader
    from trainer.data.prompts import TurnEncoder
    from trainer.envs.base import Environment, RolloutEnvironment
    from trainer.generation.placement import Generator
    from trainer.logger import RunLogger
    from trainer.policy.group import PolicyGroup
    from trainer.rewards.runner import RewardRunner


class Position(Protocol):
    step: int  # the last finished optimizer step (0 before the first): where the loop starts


class LoopState(Protocol):
    """The workers, data and logger of a run, and its two hooks: a safe point and a finished step."""

    policy: PolicyGroup
    generator: Generator
    rewards: RewardRunner  # the training rewards (the async stream's producer thread owns it)
    environment: Environment | None  # multi-turn: what answers the model between its turns
    turns: TurnEncoder
    loader: PromptLoader
    logger: RunLogger
    val_examples: list[dict]

    @property  # read-only, so the run's own environment class satisfies it
    def rollout_env(self) -> RolloutEnvironment | None:
        """An environment that runs its own rollouts through the endpoint (env.verifiers), or None."""

    @property  # read-only, so the run's own richer progress record satisfies it
    def progress(self) -> Position: ...

    def preemption_point(self) -> None:
        """A safe point: after SIGTERM, save if that fits in the grace budget, and raise to stop."""

    def after_step(
        self,
        step: int,
        metrics: dict[str, float],
        loader_state: dict[str, Any],
        reward_state: dict[str, Any] | None = None,
    ) -> None:
        """Record a finished step (``loader_state``: the loader's position after its batch; ``reward_state``:
        the reward runner's after its rewards) and checkpoint when it is due."""
