"""The trackers for real, offline: TensorBoard, W&B in offline mode and MLflow on a SQLite store, each read
back with its own reader; a resumed logger continues the same runs; bad tracker config is one line before
anything starts, and a tracker that fails later is a warning while the others keep logging."""

from __future__ import annotations

import socket

import pytest

from tests.tracking import readback
from trainer import tracking
from trainer.config import ConfigError, load
from trainer.logger import RunLogger

ALL = "logger.backends=[tensorboard,wandb,mlflow]"


@pytest.fixture(scope="module", autouse=True)
def _wandb_service():
    """W&B starts one service process per Python process; it ends with this module, not with the session."""
    yield
    import wandb

    wandb.teardown()


def config(tmp_path, *overrides: str):
    return load(
        [
            "experiment=tiny",
            f"logger.log_dir={tmp_path / 'logs'}",
            "logger.wandb.mode=offline",
            f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            *overrides,
        ]
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def rows(step: int, n: int = 3) -> list[dict]:
    return [
        {
            "step": step,
            "prompt": f"What is {i}+{step}?",
            "response": f"{i} + {step} = \\boxed{{{i + step}}}",
            "reward": 1.0 if i else 0.0,
            "extracted_answer": str(i + step) if i else None,
            "answer_note": "\\boxed{}" if i else "no answer: nothing boxed | or after =",
            "advantage": 0.5 - i,
            "ground_truth": str(i + step),
        }
        for i in range(n)
    ]


def test_should_flatten_the_config_to_dotted_keys_when_a_tracker_receives_it() -> None:
    flat = tracking.flatten(
        {"policy": {"lr": 1e-6, "lora": {"rank": None, "targets": ["q", "v"]}}, "env": {}, "seed": 1}
    )
    assert flat == {
        "policy.lr": 1e-6,
        "policy.lora.rank": None,
        "policy.lora.targets": "['q', 'v']",
        "env": "{}",
        "seed": 1,
    }


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "logger.backends=[tensorboard,neptune]",
            "logger.backends='neptune' is not allowed; choose one of: tensorboard, wandb, mlflow",
        ),
        ("logger.backends=[wandb,wandb]", "names a backend twice"),
        ("logger.wandb.mode=cloud", "logger.wandb.mode='cloud' is not allowed"),
    ],
)
def test_should_name_the_key_in_one_line_when_logger_backends_is_bad(tmp_path, override, message) -> None:
    with pytest.raises(ConfigError) as e:
        config(tmp_path, override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_should_ask_for_the_api_key_when_wandb_runs_online_without_one(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    cfg = config(tmp_path, ALL, "logger.wandb.mode=online")
    with pytest.raises(
        tracking.TrackerError, match=r"WANDB_API_KEY is not set .*logger\.wandb\.mode=offline"
    ):
        tracking.check(cfg.logger)


def test_should_say_the_server_is_unreachable_when_wandb_base_url_does_not_answer(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(
        tracking.TrackerError, match=r"the W&B server \(WANDB_BASE_URL\) http://127.0.0.1:\d+ is unreachable"
    ):
        tracking.check(config(tmp_path, ALL, "logger.wandb.mode=online").logger)


def test_should_ask_for_a_tracking_uri_when_mlflow_has_none(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config(tmp_path, "logger.backends=[mlflow]", "logger.mlflow.tracking_uri=null")
    with pytest.raises(tracking.TrackerError, match="no tracking URI: set logger.mlflow.tracking_uri"):
        tracking.check(cfg.logger)


def test_should_say_the_tracking_server_is_unreachable_when_the_mlflow_uri_does_not_answer(tmp_path) -> None:
    uri = f"http://127.0.0.1:{closed_port()}"
    cfg = config(tmp_path, "logger.backends=[mlflow]", f"logger.mlflow.tracking_uri={uri}")
    with pytest.raises(tracking.TrackerError) as e:
        tracking.check(cfg.logger)
    assert str(e.value).startswith(
        f"the MLflow tracking server (logger.mlflow.tracking_uri or MLFLOW_TRACKING_URI) {uri} is unreachable"
    )


def test_should_name_the_extra_when_a_tracker_library_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # as if not installed
    with pytest.raises(
        tracking.TrackerError,
        match=r"the mlflow package is not installed: pip install 'kuberl-trainer\[tracking\]'",
    ):
        tracking.check(config(tmp_path, "logger.backends=[mlflow]").logger)


def test_should_pass_the_check_when_every_backend_is_offline_or_local(tmp_path) -> None:
    tracking.check(config(tmp_path, ALL).logger)


@pytest.mark.integration  # starts W&B's service
def test_should_give_every_backend_the_same_scalars_config_and_tables_and_continue_the_runs_when_resumed(
    tmp_path,
) -> None:
    cfg = config(tmp_path, ALL)
    log = RunLogger(cfg, run_name="r1")
    ids = log.run_ids()
    assert set(ids) == {"wandb", "mlflow"}
    for step in (1, 2, 3):
        log.scalars(step, {"train/reward_mean": step / 10, "perf/mfu": 0.25})
        log.rollouts(step, rows(step))
    log.close()

    # Resumed from a checkpoint of step 2: step 3 is redone, step 4 is new.
    again = RunLogger(cfg, run_name="r1", resume_step=2, run_ids=ids)
    assert again.run_ids() == ids
    for step in (3, 4):
        again.scalars(step, {"train/reward_mean": step / 10 + 0.01, "perf/mfu": 0.5})
        again.rollouts(step, rows(step))
    again.close()

    run_dir = tmp_path / "logs" / "tiny" / "r1"
    tb = readback.tensorboard(run_dir)
    assert tb["train/reward_mean"] == pytest.approx(
        {1: 0.1, 2: 0.2, 3: 0.31, 4: 0.41}
    )  # step 3 purged, redone

    wb = readback.wandb_run(run_dir)
    assert wb["ids"] == {ids["wandb"]}  # the resumed run is the same W&B run
    # Offline, the resumed run's own directory holds the redone step 3 (read last, so it wins here, as in
    # TensorBoard); online, W&B would keep the first value (it takes no step below the run's last).
    assert wb["history"]["train/reward_mean"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.31, 4: 0.41})
    assert wb["config"]["policy.learning_rate"] == cfg.policy.learning_rate
    assert wb["config"]["logger.backends"] == "['tensorboard', 'wandb', 'mlflow']"
    assert wb["tables"][4][1] == {k: rows(4)[1][k] for k in tracking.TABLE_COLUMNS}

    ml = readback.mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", ids["mlflow"])
    assert ml["run"].info.status == "FINISHED" and ml["run"].info.run_name == "r1"
    assert ml["history"]["train/reward_mean"] == pytest.approx(
        {1: 0.1, 2: 0.2, 3: 0.31, 4: 0.41}
    )  # the last value of step 3
    assert ml["params"]["policy.learning_rate"] == str(cfg.policy.learning_rate)
    assert sorted(ml["tables"]) == [1, 2, 3, 4]
    assert ml["tables"][2][0]["answer_note"] == "no answer: nothing boxed | or after ="

    text = readback.tensorboard_text(run_dir, "rollouts")
    assert sorted(text) == [1, 2, 3, 4] and "\\| or after =" in text[2]  # a markdown table, pipes escaped
    assert "policy.learning_rate" in readback.tensorboard_text(run_dir, "config")[0]


def test_should_warn_and_keep_logging_to_the_others_when_a_tracker_fails_mid_run(tmp_path, capsys) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = RunLogger(config(tmp_path, "logger.backends=[mlflow,tensorboard]"), run_name="r2")
    log.scalars(1, {"train/reward_mean": 0.5})
    MlflowClient(uri).delete_run(log.run_ids()["mlflow"])  # the run is gone from under the logger
    log.scalars(2, {"train/reward_mean": 0.75})
    log.rollouts(2, rows(2))
    log.close()
    out = capsys.readouterr().out
    assert "kuberl: warning: mlflow: logging the scalars of step 2 failed" in out
    assert "the other backends keep logging" in out
    assert readback.tensorboard(tmp_path / "logs" / "tiny" / "r2")["train/reward_mean"] == {1: 0.5, 2: 0.75}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a-dir", "is a directory; name the database file"),
        ("missing/mlflow.db", "cannot create the database in"),
    ],
)
def test_should_be_one_line_when_the_sqlite_store_cannot_be_created(tmp_path, name, message) -> None:
    (tmp_path / "a-dir").mkdir()
    cfg = config(
        tmp_path, "logger.backends=[mlflow]", f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / name}"
    )
    with pytest.raises(tracking.TrackerError, match=message):
        tracking.check(cfg.logger)


def test_should_be_one_line_when_the_mlflow_store_cannot_start_a_run(tmp_path) -> None:
    (tmp_path / "store").write_text("not a file store")  # a file where MLflow's file store wants a directory
    cfg = config(
        tmp_path, "logger.backends=[mlflow]", f"logger.mlflow.tracking_uri=file://{tmp_path / 'store'}"
    )
    with pytest.raises(tracking.TrackerError) as e:
        RunLogger(cfg, run_name="r3")
    assert str(e.value).startswith(
        "logger.backends has mlflow, but the MLflow run did not start"
    ) and "\n" not in str(e.value)


def test_should_take_the_backends_from_the_environment_when_the_chart_sets_kuberl_logger_backends(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("KUBERL_LOGGER_BACKENDS", "[tensorboard,mlflow]")
    assert config(tmp_path).logger.backends == ["tensorboard", "mlflow"]
    assert config(tmp_path, "logger.backends=[wandb]").logger.backends == ["wandb"]  # an override still wins


def test_should_check_what_a_run_here_would_log_to_when_run_as_the_charts_helm_test(tmp_path) -> None:
    """``python -m trainer.tracking``, as the chart's tracker test runs it: the environment a Ray container has.
    Its ``main`` in this process (tests.cli): the exit status and the line are the point, not the process."""
    import os

    from tests.cli import run_main
    from trainer.tracking.__main__ import main

    env = {
        **os.environ,
        "KUBERL_LOGGER_BACKENDS": "[tensorboard,mlflow]",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    ok = run_main(main, [], env)
    assert (
        ok.returncode == 0
        and ok.stdout.strip() == f"kuberl: trackers ok: tensorboard, mlflow ({env['MLFLOW_TRACKING_URI']})"
    )
    env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{closed_port()}"
    bad = run_main(main, [], env)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "is unreachable" in bad.stderr


@pytest.mark.integration  # a Python interpreter of its own
def test_should_import_neither_wandb_nor_mlflow_when_only_tensorboard_logs(tmp_path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys\n"
        "from trainer.config import load\n"
        "from trainer.logger import RunLogger\n"
        f"log = RunLogger(load(['experiment=tiny', 'logger.log_dir={tmp_path}']), run_name='r')\n"
        "log.scalars(1, {'train/reward_mean': 0.5})\n"
        "log.close()\n"
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
