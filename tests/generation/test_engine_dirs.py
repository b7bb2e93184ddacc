"""An engine's own directories (trainer/generation/vllm_lifetime.py): which ones a sweep removes, how they are
made, and the temporary directory during an engine's build. The engine's use of them is tested with real
engines: a clean shutdown and a failed start in test_engine_contract.py, a killed owner in
test_vllm_lifetime.py."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from trainer.generation import vllm_lifetime
from trainer.generation.vllm_lifetime import ADAPTER_PREFIX, PRIVATE_PREFIX, private_dir, sweep


def _no_such_pid() -> int:
    """A pid no process can have: above the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _made(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "a-socket-or-a-store").write_text("")
    return path


def test_should_remove_only_the_directories_of_owners_gone_from_this_pid_namespace(tmp_path) -> None:
    ns, gone = vllm_lifetime._pid_namespace(), _no_such_pid()
    dead = _made(tmp_path, f"{PRIVATE_PREFIX}{ns}-{gone}-abc")
    live = _made(tmp_path, f"{PRIVATE_PREFIX}{ns}-{os.getpid()}-abc")
    elsewhere = _made(tmp_path, f"{PRIVATE_PREFIX}{ns + 1}-{gone}-abc")  # its pid may be alive over there
    unnamed = _made(tmp_path, f"{PRIVATE_PREFIX}x1y2z3")  # no owner in the name: nobody's to judge
    adapter = _made(tmp_path, f"{ADAPTER_PREFIX}{ns}-{gone}-abc")  # another kind: its own sweep
    plain_file = tmp_path / f"{PRIVATE_PREFIX}{ns}-{gone}-file"
    plain_file.write_text("")

    assert sweep(str(tmp_path)) == [str(dead)]
    assert not dead.exists()
    assert (
        live.exists() and elsewhere.exists() and unnamed.exists() and adapter.exists() and plain_file.exists()
    )
    assert sweep(str(tmp_path), ADAPTER_PREFIX) == [str(adapter)] and not adapter.exists()


def test_should_remove_the_shared_memory_of_an_engines_workers_with_its_directory_and_no_other(
    tmp_path, monkeypatch
) -> None:
    """At its shutdown (workers its executor had to kill leave theirs) and by the sweep (a killed owner's)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(vllm_lifetime, "SHARED_MEMORY", str(shm))
    ns, gone = vllm_lifetime._pid_namespace(), _no_such_pid()
    dead = _made(tmp_path, f"{PRIVATE_PREFIX}{ns}-{gone}-abc")
    (dead / "vllm_dist_0a1b").write_text(
        ""
    )  # the engine's file store: its workers' shared memory is named by it
    own = _made(tmp_path, f"{PRIVATE_PREFIX}{ns}-{os.getpid()}-abc")
    (own / "vllm_dist_2c3d").write_text("")
    vllm_lifetime.note_stores(str(own))
    (own / "vllm_dist_2c3d").unlink()  # as its workers' destroyed groups do: the note still names it
    other = [
        "vllm_dist_4e5f-tp:0-[0-1]-cpushm_0",
        "vllm_dist_0a1b2-tp:0-[0-1]-cpushm_0",
        "vllm_dist_0a1b-other",
    ]
    for name in [*(f"vllm_dist_{s}-tp:0-[0-1]-cpushm_{r}" for s in ("0a1b", "2c3d") for r in (0, 1)), *other]:
        (shm / name).write_bytes(b"\0" * 64)

    assert sweep(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        other + ["vllm_dist_2c3d-tp:0-[0-1]-cpushm_0", "vllm_dist_2c3d-tp:0-[0-1]-cpushm_1"]
    )
    vllm_lifetime.remove(str(own))
    assert not own.exists() and sorted(p.name for p in shm.iterdir()) == sorted(other)


def test_should_make_a_directory_only_its_user_enters_named_by_its_owner_after_sweeping(tmp_path) -> None:
    ns = vllm_lifetime._pid_namespace()
    dead = _made(tmp_path, f"{PRIVATE_PREFIX}{ns}-{_no_such_pid()}-abc")
    made = Path(private_dir(str(tmp_path)))
    assert made.parent == tmp_path and made.name.startswith(f"{PRIVATE_PREFIX}{ns}-{os.getpid()}-")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert not dead.exists()
    assert sweep(str(tmp_path)) == [] and made.exists()  # its owner, this process, is alive


def test_should_give_the_temporary_directory_back_when_the_build_inside_fails(tmp_path) -> None:
    before = tempfile.tempdir
    with (
        pytest.raises(RuntimeError, match="the build failed"),
        vllm_lifetime.temporary_files_in(str(tmp_path)),
    ):
        assert tempfile.gettempdir() == str(tmp_path)
        raise RuntimeError("the build failed")
    assert tempfile.tempdir == before


def test_should_give_the_environment_back_when_the_engine_directory_goes(tmp_path, monkeypatch) -> None:
    """An engine points vLLM's socket and cache variables at its directory; at shutdown each that still names
    it gets its earlier value back (unset if it had none), so a `vllm serve` started later does not bind a
    socket in a directory that is gone. One set since by someone else stays."""
    monkeypatch.setattr(vllm_lifetime, "_live", [])  # as if no engine of this process were running
    monkeypatch.setattr(vllm_lifetime, "_outside", {})
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/an/operators/cache")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    private = private_dir(str(tmp_path))
    vllm_lifetime.enter_environment(private)
    assert os.environ["VLLM_RPC_BASE_PATH"] == os.environ["VLLM_CACHE_ROOT"] == private
    vllm_lifetime.remove(private)
    vllm_lifetime.leave_environment(private)
    assert "VLLM_RPC_BASE_PATH" not in os.environ and os.environ["VLLM_CACHE_ROOT"] == "/an/operators/cache"

    vllm_lifetime.enter_environment(private)
    os.environ["VLLM_RPC_BASE_PATH"] = "/set/by/someone/else"
    vllm_lifetime.leave_environment(private)
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/set/by/someone/else"
    assert os.environ["VLLM_CACHE_ROOT"] == "/an/operators/cache"
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1)])
def test_should_never_point_at_a_removed_directory_whatever_order_engines_stop_in(
    tmp_path, monkeypatch, order
) -> None:
    """Three engines of one process, started in turn and shut down in any order (a module's engine outliving
    a test's, a GPU engine that sets no cache root beside them): after each shutdown every variable names a
    running engine that set it or the operator's value, never a removed directory; after the last, the
    operator's values are back."""
    monkeypatch.setattr(vllm_lifetime, "_live", [])  # as if no engine of this process were running
    monkeypatch.setattr(vllm_lifetime, "_outside", {})
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/an/operators/cache")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    names = [vllm_lifetime.DIR_VARIABLES, ("VLLM_RPC_BASE_PATH",), vllm_lifetime.DIR_VARIABLES]
    dirs = [private_dir(str(tmp_path)) for _ in names]
    for path, set_names in zip(dirs, names):
        vllm_lifetime.enter_environment(path, set_names)
    running = set(range(3))
    for i in order:
        vllm_lifetime.remove(dirs[i])
        vllm_lifetime.leave_environment(dirs[i])
        running.discard(i)
        for name in vllm_lifetime.DIR_VARIABLES:
            holders = [dirs[j] for j in sorted(running) if name in names[j]]
            expected = holders[-1] if holders else {"VLLM_CACHE_ROOT": "/an/operators/cache"}.get(name)
            assert os.environ.get(name) == expected, (order, i, name)
            assert expected is None or not expected.startswith(str(tmp_path)) or os.path.isdir(expected)
    assert "VLLM_RPC_BASE_PATH" not in os.environ and os.environ["VLLM_CACHE_ROOT"] == "/an/operators/cache"
