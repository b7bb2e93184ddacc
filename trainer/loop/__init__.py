"""The GRPO loop, above the policy and the engines: a step's rollouts in (generation, rewards,
advantages), a policy step out, weights back to the engines; the run's state and its rollout stream
(synchronous or bounded-staleness asynchronous). The math it calls is :mod:`trainer.algorithms`'."""
