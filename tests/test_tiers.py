"""The tiers (tests/tiers.py): which tests are integration-tier, and the fast tier's guards failing a test in
one line when it starts what only the integration tier may."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import tiers


@tiers.starts("starts Ray")
def _starts_ray(): ...


def _tmp_path(): ...


@pytest.mark.parametrize(
    "fixtures, markers, reason",
    [
        ({"tmp_path": _tmp_path}, [], None),
        ({"tmp_path": _tmp_path, "ray_local": _tmp_path, "session_ray": _starts_ray}, [], "its fixture session_ray starts Ray"),
        ({"tmp_path": _tmp_path}, ["slow"], "marked slow"),
        ({"tmp_path": _tmp_path}, ["gpu"], "marked gpu"),
        ({"tmp_path": _tmp_path}, ["integration"], "marked integration"),
        ({"tmp_path": _tmp_path}, ["vllm", "timeout"], None),  # needing vLLM's parsers is not starting an engine
    ],
)  # fmt: skip
def test_should_put_a_test_in_the_integration_tier_when_its_fixtures_or_marks_start_something(
    fixtures, markers, reason
):
    assert tiers.integration_reason(fixtures, markers) == reason


def test_should_put_the_tests_of_the_fixtures_that_start_ray_or_write_a_model_in_the_integration_tier():
    from tests import conftest
    from tests.rewards import tiny_judge, tiny_rm

    for fixture in (
        conftest.session_ray,
        conftest.tiny_model_path,
        tiny_rm.arithmetic_rm,
        tiny_judge.arithmetic_judge,
    ):
        assert tiers.integration_reason({"it": fixture}, []), fixture


@pytest.mark.parametrize(
    "argv, shell, starts",
    [
        (
            [sys.executable, "-m", "trainer", "experiment=tiny"],
            False,
            "runs the trainer (`python -m trainer`)",
        ),
        (
            ["python3", "-c", "import ray\nray.init(address='local')"],
            False,
            "starts Ray (`python -c` with ray.init)",
        ),
        (["/usr/bin/ray", "start", "--head"], False, "starts Ray (`ray start`)"),
        (
            [sys.executable, "-m", "pytest", "tests"],
            False,
            "runs a test session of its own (`python -m pytest`)",
        ),
        (
            [sys.executable, "-c", "import trainer.config"],
            False,
            "starts a Python interpreter (seconds of imports)",
        ),
        (["make", "preflight"], False, "starts a process (`make`)"),
        ("bwrap --die-with-parent true", True, "starts a process (`bwrap`)"),
        (["/work/bin/helm", "template", "charts/kuberl"], False, None),
        ("helm template charts/kuberl", True, None),
        (["git", "ls-files"], False, None),
    ],
)
def test_should_name_what_a_command_starts_when_the_fast_tier_refuses_it(argv, shell, starts):
    assert tiers.command_starts(argv, shell) == starts


def test_should_fail_in_one_line_when_a_fast_tier_test_starts_ray_or_the_trainer():
    import ray

    with pytest.MonkeyPatch.context() as monkeypatch:
        tiers.install(monkeypatch)
        with pytest.raises(pytest.fail.Exception) as ray_init:
            ray.init(address="local")
        with pytest.raises(pytest.fail.Exception) as trainer:
            subprocess.run([sys.executable, "-m", "trainer", "experiment=tiny"], check=False)
        assert subprocess.run(["git", "--version"], capture_output=True, check=False).returncode == 0
    for failure, what in ((ray_init, "starts Ray (ray.init)"), (trainer, "runs the trainer")):
        message = str(failure.value)
        assert "\n" not in message and what in message and "@pytest.mark.integration" in message


def test_should_fail_a_fast_tier_test_in_one_line_when_it_takes_more_cpu_than_the_budget():
    assert tiers.over_budget(tiers.FAST_CPU_BUDGET_S) is None
    message = tiers.over_budget(tiers.FAST_CPU_BUDGET_S + 2.5)
    assert message and "\n" not in message and "@pytest.mark.integration" in message
    assert f"took {tiers.FAST_CPU_BUDGET_S + 2.5:.1f} s of CPU time" in message
