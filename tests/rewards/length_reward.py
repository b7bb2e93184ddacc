"""A reward of a test's own, named as module:function: what a response's length is modulo 7, so a tiny random
model's scores spread from step to step (tests/test_reward_norm_resume.py)."""

from __future__ import annotations


def length(ground_truth, response: str, **kwargs) -> float:
    return float(len(response) % 7)
