"""The ``code_feedback`` environment: after a failing program, the first failing test becomes the next user turn.

The multi-turn code loop as an environment: each turn's program runs on the problem's tests in the sandbox
(:mod:`trainer.rewards.feedback`), in the reward runner's Ray tasks, so it is bounded by
``env.reward_timeout_s`` and, on a cluster with a sandbox group, runs only on its nodes. A passing program
(or a feedback function with nothing to say) ends the episode; the final attempt is what the run's rewards
judge. A run with ``grpo.max_rollout_turns > 1`` and no ``env.environment`` gets this environment with
``env.feedback``; naming it (``env.environment: code_feedback``) takes its kwargs instead:
``feedback`` (the feedback function, ``code_unit_tests``), ``timeout_s``, and the function's own kwargs.
"""

from __future__ import annotations

import threading
from typing import Any

from trainer.config import EnvConfig, RewardSpec
from trainer.envs import register
from trainer.envs.base import Step
from trainer.rewards.runner import RewardRunner


class CodeFeedbackEpisode:
    def __init__(self, env: CodeFeedback, example: dict[str, Any]):
        self.env, self.ground_truth = env, example["ground_truth"]

    def step(self, text: str) -> Step:
        result = self.env.feedback(self.ground_truth, text)
        if result.feedback is None:  # passed, or the environment had nothing to say: done
            return Step([], done=True)
        return Step([{"role": "user", "content": result.feedback}], done=False)

    def close(self) -> None:
        pass


@register("code_feedback")
class CodeFeedback:
    """Execution feedback between attempts (module docstring)."""

    name = "code_feedback"

    def __init__(
        self,
        feedback: str = "code_unit_tests",
        timeout_s: float = 30.0,
        max_concurrent: int = 32,
        runner: RewardRunner | None = None,
        **feedback_kwargs: Any,
    ):
        if runner is None:
            env = EnvConfig(
                [RewardSpec(feedback)],
                reward_timeout_s=timeout_s,
                max_concurrent_rewards=max_concurrent,
                feedback=feedback,
                feedback_kwargs=feedback_kwargs,
            )
            env.validate()
            runner = RewardRunner(env, feedback=True)  # checks the name: ConfigError listing the valid ones
        self.runner = runner
        self.lock = threading.Lock()  # the runner is not thread-safe; episodes step from the loop's threads

    @classmethod
    def from_runner(cls, runner: RewardRunner) -> CodeFeedback:
        """Over a run's feedback runner (``RewardRunner(env, feedback=True)``, built from ``env.feedback``)."""
        return cls(runner=runner)

    def feedback(self, ground_truth: Any, text: str):
        """The feedback on one attempt: submitted at once, waited for while other episodes' run too."""
        with self.lock:
            ids = self.runner.submit([(ground_truth, text)])
        while True:
            with self.lock:
                if self.runner.done(ids):
                    return self.runner.results(ids)[0]
                self.runner.poll(timeout=0.02)

    def tools(self) -> list[dict[str, Any]] | None:
        return None

    def episode(self, example: dict[str, Any]) -> CodeFeedbackEpisode:
        return CodeFeedbackEpisode(self, example)
