"""FSDP2 policy workers (Ray actors): :mod:`trainer.policy.worker`, driven by :mod:`trainer.policy.group`."""
