"""The reward runner on a real local Ray instance: weights combine, and a crashing or hanging reward
costs its sample, never the run."""

from __future__ import annotations

import time

import pytest

from trainer.config import EnvConfig, RewardSpec
from trainer.rewards.runner import MAX_TASK_ITEMS, RewardFailureError, RewardRunner, failure_cause, score_one


def _boom(ground_truth, response, **kwargs):
    raise RuntimeError("reward bug")


# The reward timeout of the tests that hang a task. It counts from the task's start, so neither a worker's
# start nor a wait for a CPU next to the other xdist worker's trainer runs eats into it.
TIMEOUT_S = 10


def _hang(ground_truth, response, **kwargs):
    if response == "hang":
        time.sleep(600)
    return 1.0, True


def _kill(ground_truth, response, **kwargs):
    import os

    os._exit(1)


def _plain(ground_truth, response):  # an old-style user reward: a plain number, no kwargs at all
    return 1.0 if response == ground_truth else 0.0


def _pair(ground_truth, response, **kwargs):  # **kwargs does not ask for the question
    assert "question" not in kwargs
    return 0.5, False


def _asks(ground_truth, response, question=None):
    return 1.0, True, question


class _Unhashable:  # a callable object that cannot key a cache
    __hash__ = None

    def __call__(self, ground_truth, response, question=None):
        return 1.0, True, question


_unhashable = _Unhashable()


def test_should_combine_rewards_by_weight_when_several_are_configured():
    specs = [
        RewardSpec("exact_alnum", 0.8),
        RewardSpec("format", 0.2, {"think_tag": "think", "answer_tag": "answer"}),
    ]
    r = score_one(specs, "42", "<think>hm</think> <answer>42</answer>")
    assert r.scores == {"exact_alnum": 1.0, "format": 1.0}
    assert r.total == pytest.approx(1.0) and r.correct
    r = score_one(specs, "41", "<think>hm</think> <answer>42</answer>")
    assert r.total == pytest.approx(0.2) and not r.correct


def test_should_score_zero_and_warn_when_a_reward_raises():
    r = score_one([RewardSpec("tests.rewards.test_runner:_boom"), RewardSpec("exact_alnum")], "7", "7")
    assert r.scores["tests.rewards.test_runner:_boom"] == 0.0 and r.scores["exact_alnum"] == 1.0
    assert "reward bug" in r.warnings[0]


def test_should_report_the_first_rewards_answer_and_pass_the_question_when_a_reward_declares_it():
    specs = [
        RewardSpec("arithmetic"),
        RewardSpec("format", 0.0),
        RewardSpec("tests.rewards.test_runner:_asks", 0.5),
    ]
    r = score_one(specs, "20", "13 + 7 = \\boxed{20}", "What is 13+7?")
    assert (r.answer, r.answer_note, r.total, r.correct) == ("20", "\\boxed{}", 1.5, True)
    r = score_one(specs, "20", "\\boxed{13+7}", "What is 13+7?")
    assert (r.answer, r.answer_note) == ("13+7", "\\boxed{}: restates the question instead of answering it")
    r = score_one([RewardSpec("tests.rewards.test_runner:_asks")], "20", "x", "the question")
    assert (r.answer, r.correct) == ("the question", True)
    r = score_one([RewardSpec("tests.rewards.test_runner:_unhashable")], "20", "x", "the question")
    assert (r.answer, r.warnings) == ("the question", [])
    r = score_one([RewardSpec("format", 0.0), RewardSpec("arithmetic")], "20", "\\boxed{}")
    assert (r.answer, r.answer_note) == (None, "empty \\boxed{}")  # a zero weight reports nothing


def test_should_score_old_style_user_rewards_when_they_return_a_number_or_a_pair():
    specs = [RewardSpec("tests.rewards.test_runner:_plain"), RewardSpec("tests.rewards.test_runner:_pair")]
    r = score_one(specs, "7", "7", "What is 3+4?")
    assert r.scores == {"tests.rewards.test_runner:_plain": 1.0, "tests.rewards.test_runner:_pair": 0.5}
    assert not r.correct and r.answer is None and not r.warnings


def test_should_note_the_error_when_a_reward_raises():
    r = score_one([RewardSpec("tests.rewards.test_runner:_boom")], "7", "7")
    assert r.answer is None and "reward bug" in r.answer_note


def test_should_check_the_names_on_the_driver_when_a_runner_is_built():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"^env.reward_functions\[1\].name: unknown reward 'nope'"):
        RewardRunner(EnvConfig([RewardSpec("math"), RewardSpec("nope")]))
    with pytest.raises(
        ConfigError, match=r"^env.feedback=None is not allowed; choose one of: code_unit_tests$"
    ):
        RewardRunner(EnvConfig([RewardSpec("math")]), feedback=True)


@pytest.mark.slow
def test_should_time_out_hanging_and_dying_rewards_without_blocking_others(ray_local, caplog):
    runner = RewardRunner(
        EnvConfig(
            [RewardSpec("tests.rewards.test_runner:_hang")],
            reward_timeout_s=TIMEOUT_S,
            max_concurrent_rewards=3,
        )
    )
    start = time.monotonic()
    ids = runner.submit([(None, "hang"), (None, "ok"), (None, "ok"), (None, "ok")])
    results = runner.results(ids)
    assert time.monotonic() - start < 3 * TIMEOUT_S  # the hang (600 s) blocked nothing
    assert [r.total for r in results] == [0.0, 1.0, 1.0, 1.0]
    assert "timed out" in results[0].warnings[0]
    assert results[0].answer_note == f"reward timed out after {TIMEOUT_S}s"
    dying = RewardRunner(
        EnvConfig(
            [RewardSpec("tests.rewards.test_runner:_kill")], reward_timeout_s=30, reward_failure_budget=1.0
        )
    )
    (dead,) = dying.results(dying.submit([(None, "x")]))
    assert dead.total == 0.0 and dead.warnings


@pytest.mark.slow
def test_should_carry_the_answer_back_from_the_task_when_scoring_on_ray(ray_local):
    runner = RewardRunner(EnvConfig([RewardSpec("arithmetic")]))
    q = "What is 13+7? Put the final answer in \\boxed{}."
    ids = runner.submit(
        [("20", "13 + 7 = \\boxed{20}", q), ("20", "\\boxed{13+7}", q), ("20", "\\boxed{13+7}")]
    )
    got = [(r.total, r.answer, r.answer_note) for r in runner.results(ids)]
    assert got == [
        (1.0, "20", "\\boxed{}"),
        (
            0.0,
            "13+7",
            "\\boxed{}: restates the question instead of answering it",
        ),  # the question reached the task
        (0.0, "13+7", "\\boxed{}: an expression to evaluate, not a number"),  # an item without one
    ]


def _cheap(ground_truth, response, **kwargs):
    return 1.0, True


@pytest.mark.slow
def test_should_score_many_samples_per_task_when_they_are_cheap_and_one_per_task_when_they_are_not(ray_local):
    runner = RewardRunner(EnvConfig([RewardSpec("tests.rewards.test_runner:_cheap")]))
    assert runner.task_size() == 1  # nothing measured yet: one sample a task
    ids = runner.submit([(None, str(i)) for i in range(256)])
    assert len(runner._running) == 1  # one probe in flight until a cost is known
    results = runner.results(ids)
    assert [r.total for r in results] == [1.0] * 256
    assert runner.task_size() > 8  # microseconds each: a task carries many
    runner.item_s = 0.5  # a sandboxed program's cost: a task of its own, spread over the CPUs
    assert runner.task_size() == 1
    runner.item_s = 0.0
    assert runner.task_size() == MAX_TASK_ITEMS


@pytest.mark.slow
def test_should_send_cheap_samples_that_arrive_one_by_one_in_one_task_when_another_is_in_flight(
    ray_local, monkeypatch
):
    from trainer.rewards import runner as runner_module

    runner = RewardRunner(EnvConfig([RewardSpec("tests.rewards.test_runner:_cheap")]))
    runner.item_s = 1e-4  # measured as cheap: a task's worth is many samples
    sent = []
    task = runner._task
    runner._task = lambda items: sent.append(len(items)) or task(items)
    monkeypatch.setattr(runner_module, "HOLD_S", 600.0)  # this machine's pauses do not end the wait
    # As a multi-turn rollout's episodes end: one sample at a time. The first goes at once; the rest wait
    # for it to end, then go together, instead of a task (and a worker) each.
    ids = [i for n in range(20) for i in runner.submit([(None, str(n))])]
    assert sent == [1]
    assert [r.total for r in runner.results(ids)] == [1.0] * 20
    assert sent == [1, 19]
    # A part of a task waits no longer than HOLD_S: with none, each sample goes as it comes.
    monkeypatch.setattr(runner_module, "HOLD_S", 0.0)
    ids = [i for n in range(3) for i in runner.submit([(None, str(n))])]
    assert sent[2:] == [1, 1, 1]
    assert [r.total for r in runner.results(ids)] == [1.0] * 3


@pytest.mark.slow
def test_should_cost_only_the_bad_sample_when_it_hangs_or_kills_a_task_it_shares(ray_local, caplog):
    runner = RewardRunner(
        EnvConfig(
            [RewardSpec("tests.rewards.test_runner:_hang")],
            reward_timeout_s=TIMEOUT_S,
            max_concurrent_rewards=3,
        )
    )
    runner.item_s = 1e-4  # as measured on cheap samples: the next tasks carry up to MAX_TASK_ITEMS
    items = [(None, "ok")] * 10 + [(None, "hang")] + [(None, "ok")] * 10
    start = time.monotonic()
    results = runner.results(runner.submit(items))
    assert (
        time.monotonic() - start < 5 * TIMEOUT_S
    )  # the shared task's timeout, then its samples one per task
    assert [r.total for r in results] == [1.0] * 10 + [0.0] + [1.0] * 10
    assert results[10].answer_note == f"reward timed out after {TIMEOUT_S}s"
    mixed = RewardRunner(
        EnvConfig(
            [RewardSpec("tests.rewards.test_runner:_kill_on")],
            reward_timeout_s=30,
            max_concurrent_rewards=3,
            reward_failure_budget=0.5,  # one of three: this test is about who loses, not how many may
        )
    )
    mixed.item_s = 1e-4
    results = mixed.results(mixed.submit([(None, "ok"), (None, "kill"), (None, "ok")]))
    assert [r.total for r in results] == [1.0, 0.0, 1.0]
    assert results[1].answer_note.startswith("reward task failed")


@pytest.mark.slow
def test_should_wait_for_a_cpu_without_timing_out_then_stop_with_one_line_when_none_comes(
    ray_local, monkeypatch
):
    import ray

    from trainer.cluster import ClusterError
    from trainer.rewards import runner as runner_module

    monkeypatch.setattr(runner_module, "START_TIMEOUT_S", 4.0)
    runner = RewardRunner(EnvConfig([RewardSpec("tests.rewards.test_runner:_cheap")], reward_timeout_s=0.5))
    # A resource no node has: the task waits to be scheduled, as it would for a CPU the cluster never frees.
    runner._task = lambda items: runner_module._score_task.options(resources={"no_such_node": 1}).remote(
        runner.specs, items
    )
    ids = runner.submit([(None, "ok")])
    (gen,) = runner._running
    start = time.monotonic()
    with pytest.raises(
        ClusterError, match=r"^a reward task has waited \d+s to start: the Ray cluster has no CPU free"
    ):
        runner.results(ids)
    assert time.monotonic() - start >= 3.0  # not timed out at 0.5 s: the time limit counts from the start
    assert not runner._running
    with pytest.raises(ray.exceptions.TaskCancelledError):  # and nothing of it is left pending in the cluster
        ray.get(next(gen), timeout=30)


def _slow(ground_truth, response, **kwargs):
    time.sleep(1.5)
    return 1.0, True


@pytest.mark.slow
def test_should_let_a_queue_behind_a_busy_cpu_wait_past_the_start_limit_when_it_moves(ray_local, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from trainer.rewards import runner as runner_module

    monkeypatch.setattr(runner_module, "START_TIMEOUT_S", 1.0)
    pg = placement_group([{"CPU": 1}])  # one CPU for the runner's tasks: they run one at a time
    try:
        ray_local.get(pg.ready(), timeout=60)
        runner = RewardRunner(
            EnvConfig([RewardSpec("tests.rewards.test_runner:_slow")], max_concurrent_rewards=3)
        )
        runner.item_s = 1.5  # measured as slow: one sample a task
        on_pg = runner_module._score_task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0))
        runner._task = lambda items: on_pg.remote(runner.specs, items)
        ids = runner.submit([(None, "a"), (None, "b"), (None, "c")])
        assert len(runner._running) == 3
        # the last task waits about 3 s for the CPU, past the 1 s limit, while the others run: no stall
        assert [r.total for r in runner.results(ids)] == [1.0, 1.0, 1.0]
    finally:
        remove_placement_group(pg)


def _kill_on(ground_truth, response, **kwargs):
    if response == "kill":
        import os

        os._exit(1)
    return 1.0, True


def _boom_on_x(ground_truth, response, **kwargs):
    if response == "x":
        raise RuntimeError("reward bug")
    return 1.0, True


def test_should_stop_the_run_in_one_line_when_more_samples_lose_their_reward_than_the_budget(ray_local):
    env = EnvConfig([RewardSpec("tests.rewards.test_runner:_boom_on_x")], reward_failure_budget=0.25)
    runner = RewardRunner(env)
    # One of four failing is within the budget: it scores 0 and the step goes on ...
    assert [
        r.total
        for r in runner.results(runner.submit([(None, "x"), (None, "ok"), (None, "ok"), (None, "ok")]))
    ] == [0.0, 1.0, 1.0, 1.0]
    # ... two of four is not: one line, the count, the cause and the keys to turn.
    with pytest.raises(RewardFailureError) as e:
        runner.results(runner.submit([(None, "x"), (None, "x"), (None, "ok"), (None, "ok")]))
    line = str(e.value)
    assert "\n" not in line and line.startswith("2 of 4 samples lost their reward this step")
    assert "RuntimeError: reward bug" in line and "env.reward_failure_budget" in line


def test_should_count_failures_not_verdicts_or_scored_notes_against_the_budget():
    assert failure_cause("reward 'math' raised ValueError: boom") == "reward 'math' raised ValueError: boom"
    assert failure_cause("reward model timed out after 30s") == "reward model timed out after 30s"
    assert failure_cause("reward task failed: the worker died") == "reward task failed"
    for scored in (
        "too long for the reward model: 9000 tokens > 8192",
        "judge: unparsed (no final line)",
        "",
    ):
        assert failure_cause(scored) is None
