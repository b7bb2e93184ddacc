"""docker/requirements.lock against the package index: every pin exists with the hashes we hold,
and the pins with pyproject's [vllm] requirements resolve to exactly the same set. uv resolves from
the index's metadata, so no GPU wheel is downloaded. Skipped (with the reason) without the index."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from chartlib import REPO, lock_pins

from tests import tiers

DOCKER = REPO / "docker"
INDEX = "https://pypi.org/simple/"
PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_36"]


@pytest.fixture(scope="module")
@tiers.starts("runs uv against the package index")
def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv is missing: `make setup` installs it (pyproject's dev extra)"
    try:
        urllib.request.urlopen(f"{INDEX}vllm/", timeout=15).close()
    except OSError as e:
        pytest.skip(f"the package index {INDEX} is unreachable ({e}); the lock cannot be checked offline")
    return found


def _pins_only(lock: Path, out: Path) -> Path:
    out.write_text("".join(f"{name}=={version}\n" for name, (version, _) in lock_pins(lock).items()))
    return out


def _compile(uv: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``uv pip compile ARGS``, its temporary files in ``tmp`` (the locks of the build environments it makes
    for pyproject.toml would otherwise stay in the machine's temporary directory)."""
    return subprocess.run(
        [uv, "pip", "compile", *args, *PLATFORM, "--generate-hashes", "--no-header", "--quiet"],
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip


def _assert_same(lock: Path, resolved: Path) -> None:
    want, got = lock_pins(lock), lock_pins(resolved)
    assert set(got) == set(want), (
        f"the lock misses {sorted(set(got) - set(want))}, has extra {sorted(set(want) - set(got))}"
    )
    for name, (version, hashes) in want.items():
        assert got[name][0] == version, f"{name}: locked {version}, resolves to {got[name][0]}"
        assert hashes <= got[name][1], f"{name}=={version}: hashes in the lock that the index does not serve"


def test_should_resolve_to_exactly_the_locked_set_with_its_hashes_when_checked_against_the_index(
    uv, tmp_path
) -> None:
    lock = DOCKER / "requirements.lock"
    pins = _pins_only(lock, tmp_path / "pins.txt")
    out = _compile(
        uv,
        tmp_path,
        "pyproject.toml",
        "--extra",
        "vllm",
        "--extra",
        "tracking",
        "--extra",
        "envs",
        str(pins),
        "-o",
        str(tmp_path / "resolved.txt"),
    )
    assert out.returncode == 0, (
        f"the locked pins do not resolve (run `make lock`): {out.stderr.strip()[-2000:]}"
    )
    _assert_same(lock, tmp_path / "resolved.txt")


def test_should_find_the_model_package_and_its_hashes_on_the_index_when_checked(uv, tmp_path) -> None:
    lock = DOCKER / "model.lock"
    out = _compile(
        uv,
        tmp_path,
        "--no-deps",
        str(_pins_only(lock, tmp_path / "pins.txt")),
        "-o",
        str(tmp_path / "resolved.txt"),
    )
    assert out.returncode == 0, out.stderr.strip()[-2000:]
    _assert_same(lock, tmp_path / "resolved.txt")
