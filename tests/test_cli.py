"""tests/cli.py's in-process runs give a command what its own process gave it, and leave this one as it was."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from tests.cli import REPO, run_main


def test_should_give_the_command_its_environment_and_the_repository_and_restore_both_when_it_returns(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBERL_CLI_TEST_KEPT", "1")
    seen = {}

    def main(argv: list[str]) -> int:
        seen.update(argv=argv, cwd=Path.cwd(), env=dict(os.environ))
        os.environ["KUBERL_CLI_TEST_SET"] = "by the command"
        print("out")
        print("err", file=sys.stderr)
        return 3

    out = run_main(main, ("a", "b"), {"ONLY": "this"})
    assert (out.returncode, out.stdout, out.stderr) == (3, "out\n", "err\n")
    assert seen == {"argv": ["a", "b"], "cwd": REPO, "env": {"ONLY": "this"}}
    assert Path.cwd() == tmp_path and os.environ["KUBERL_CLI_TEST_KEPT"] == "1"
    assert "KUBERL_CLI_TEST_SET" not in os.environ


def test_should_exit_as_a_process_does_when_the_command_raises_system_exit() -> None:
    def exits(code):
        def main(argv: list[str]) -> int:
            raise SystemExit(code)

        return main

    assert run_main(exits(2), []).returncode == 2
    assert run_main(exits(None), []).returncode == 0
    message = run_main(exits("kuberl: bad"), [])
    assert (message.returncode, message.stderr) == (1, "kuberl: bad\n")


def test_should_print_warnings_and_log_records_on_stderr_and_leave_the_root_logger_when_a_command_ran() -> (
    None
):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def main(argv: list[str]) -> int:
        warnings.warn("a user warning", UserWarning, stacklevel=1)
        warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)  # a fresh interpreter hides it
        logging.getLogger("kuberl.cli-test").warning("a log record")
        logging.basicConfig(level=logging.DEBUG)  # what trainer's main does on its way to a run
        return 0

    out = run_main(main, [])
    assert "a user warning" in out.stderr and "a log record" in out.stderr
    assert "a deprecation" not in out.stderr
    assert root.handlers == handlers and root.level == level
