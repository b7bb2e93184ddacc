"""The engines' logprob gap as a start-up gate (trainer.loop.grpo.EngineParity): checked at the first step and
at the first step sampled by refitted weights, on on-policy batches only; a gap over the bound stops the run in
one line naming the model, where it was seen and the key that overrides; null reports without a gate."""

from __future__ import annotations

import pytest

from trainer.generation.placement import GenerationError
from trainer.loop.grpo import EngineParity
from trainer.loop.rollout_stream import RolloutBatch


def _batch(step: int, versions: list[int]) -> RolloutBatch:
    return RolloutBatch(step=step, pending=None, versions=versions, loader_state={})  # type: ignore[arg-type]


def test_should_check_the_load_and_the_first_refit_then_nothing(capsys):
    gate = EngineParity(0.1, "tiny")
    gate.check(1, _batch(1, [0, 0]), 0.004)
    gate.check(2, _batch(2, [1, 1]), 0.006)
    gate.check(3, _batch(3, [2, 2]), 5.0)  # later steps are the metric's, not the gate's
    out = capsys.readouterr().out
    assert (
        "self-check: engine logprobs match the policy's as the engines loaded the model (step 1): 0.0040"
        in out
    )
    assert (
        "self-check: engine logprobs match the policy's after the engines' first refit (step 2): 0.0060"
        in out
    )


@pytest.mark.parametrize(
    ("step", "versions", "where"),
    [(1, [0], "as the engines loaded"), (2, [1], "after the engines' first refit")],
)
def test_should_stop_the_run_in_one_line_when_the_gap_exceeds_the_bound(step, versions, where):
    gate = EngineParity(0.1, "granite-tiny")
    if step == 2:
        gate.check(1, _batch(1, [0]), 0.001)
    with pytest.raises(GenerationError) as e:
        gate.check(step, _batch(step, versions), 0.25)
    message = str(e.value)
    assert "\n" not in message and message.startswith("model=granite-tiny: at step")
    assert where in message and "0.250 nats/token" in message and "generation.max_logprob_gap=null" in message


def test_should_wait_for_an_on_policy_batch_when_generation_runs_ahead():
    gate = EngineParity(0.1, "tiny")
    gate.check(1, _batch(1, [0]), 0.001)
    gate.check(2, _batch(2, [0]), 9.0)  # one step stale: the gap holds the policy's update too
    with pytest.raises(GenerationError):
        gate.check(3, _batch(3, [2]), 9.0)


def test_should_only_report_when_the_gate_is_off():
    gate = EngineParity(None, "tiny")
    gate.check(1, _batch(1, [0]), 9.0)


def test_should_wait_for_a_step_that_measured_the_gap_when_a_step_trained_on_no_token(capsys):
    gate = EngineParity(0.1, "tiny")
    gate.check(1, _batch(1, [0]), 0.0, tokens=0.0)  # every group skipped: 0 is no measurement
    assert "self-check" not in capsys.readouterr().out
    with pytest.raises(GenerationError, match="as the engines loaded"):
        gate.check(1, _batch(1, [0]), 0.5, tokens=40.0)


def test_should_stop_the_run_in_one_line_when_an_moe_engines_routes_differ_from_the_policys_on_most_decisions(
    capsys,
):
    gate = EngineParity(0.1, "qwen3-moe-tiny")
    gate.check(1, _batch(1, [0]), 0.001, routing=0.03)  # near-ties in another kernel: a few percent
    assert (
        "self-check: engine routes match the policy's routing as the engines loaded the model (step 1): 3.0%"
        in (capsys.readouterr().out)
    )
    with pytest.raises(GenerationError) as e:
        gate.check(2, _batch(2, [1]), 0.001, routing=0.8)  # read in another layout: most decisions differ
    message = str(e.value)
    assert "\n" not in message and "differ from the policy's own routing on 80%" in message
    assert "after the engines' first refit" in message and "policy.moe.router_replay=false" in message
    dense = EngineParity(0.1, "tiny")
    dense.check(1, _batch(1, [0]), 0.001)  # a dense model: no routes, nothing said of them
    assert "routes" not in capsys.readouterr().out
