"""The executor on well-behaved and plainly wrong programs, under both backends."""

from __future__ import annotations

import pytest

from trainer.sandbox import OK, OUTPUT_LIMIT, RUNTIME_ERROR, TIMEOUT, Limits, run_tests

from .conftest import kind_of

pytestmark = pytest.mark.timeout(120)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP_ADD = "#include <bits/stdc++.h>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a+b<<'\\n';}\n"


def test_should_run_python_once_per_input_when_given_inputs(backend, no_leftovers):
    r = run_tests("python", ADD, ["1 2\n", "3 4\n", "oops\n"], backend=backend)
    assert r.error is None and r.backend == kind_of(backend)
    assert [x.status for x in r.runs] == [OK, OK, RUNTIME_ERROR]
    assert [x.stdout for x in r.runs[:2]] == [b"3\n", b"7\n"]
    assert b"ValueError" in r.runs[2].stderr and b"solution.py" in r.runs[2].stderr


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_should_behave_like_python_when_run_either_way(backend, mode):
    src = (
        "import sys, threading\n"
        "sys.setrecursionlimit(10000)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def main():\n"
        "    data = sys.stdin.read().split()\n"
        "    print(sum(map(int, data)), depth(3000), __name__, sys.argv[0].endswith('solution.py'))\n"
        "t = threading.Thread(target=main); t.start()\n"  # the main thread ends first; output must still come
    )
    r = run_tests("python", src, ["1 2\n3\n"], backend=backend, python_mode=mode)
    assert r.runs[0].status == OK, r.runs[0].stderr
    assert r.runs[0].stdout == b"6 3000 __main__ True\n"


@pytest.mark.parametrize(
    "src,rc", [("exit(3)", 3), ("import sys\nsys.exit('bye')", 1), ("quit()", 0), ("x = (", 1)]
)
def test_should_report_exit_codes_when_the_program_exits(backend, src, rc):
    r = run_tests("python", src, [""], backend=backend)
    assert r.runs[0].returncode == rc
    assert r.runs[0].status == (OK if rc == 0 else RUNTIME_ERROR)


def test_should_start_each_test_in_a_fresh_directory_when_a_test_leaves_files(backend):
    src = "import os\nprint(sorted(os.listdir('.')))\nopen('left-behind', 'w').write('x')\n"
    r = run_tests("python", src, ["", ""], backend=backend)
    assert [x.stdout for x in r.runs] == [b"[]\n", b"[]\n"]


def test_should_pass_a_scrubbed_environment_when_the_host_has_secrets(backend, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kuberl-canary")
    r = run_tests("python", "import os\nprint(' '.join(os.environ))", [""], backend=backend)
    assert set(r.runs[0].stdout.split()) <= {b"HOME", b"LANG", b"PATH", b"TMPDIR", b"PWD"}  # bwrap sets PWD


def test_should_time_out_on_cpu_time_when_the_program_spins(backend):
    limits = Limits(time_s=0.5)
    r = run_tests("python", "while True: pass", ["", ""], limits, backend=backend, stop_on=(TIMEOUT,))
    first = r.runs[0]
    assert first.status == TIMEOUT and first.cpu_s < 2.0
    # On an idle core the CPU limit ends it; on a crowded machine the wall-clock backstop may come first.
    assert first.cpu_s > 0.4 or first.wall_s >= limits.wall
    assert r.runs[1].status == "lost"  # stop_on skipped it
    assert r.wall_s < 10


def test_should_time_out_on_wall_time_when_the_program_sleeps(backend):
    r = run_tests(
        "python", "import time\ntime.sleep(30)", [""], Limits(time_s=0.5, wall_s=1.0), backend=backend
    )
    assert r.runs[0].status == TIMEOUT and r.runs[0].wall_s < 3


def test_should_stop_output_at_the_cap_when_the_program_prints_too_much(backend):
    r = run_tests("python", "print('x' * 5000)", ["", ""], backend=backend, output_caps=[100, 10_000])
    assert [x.status for x in r.runs] == [OUTPUT_LIMIT, OK]


def test_should_compile_and_run_cpp_when_the_source_is_valid(backend, no_leftovers):
    r = run_tests("cpp", CPP_ADD, ["1 2\n", "4000000000 1\n"], backend=backend)
    assert r.compile.status == OK
    assert [x.stdout for x in r.runs] == [b"3\n", b"4000000001\n"]


def test_should_report_a_compile_error_when_the_source_is_invalid(backend):
    r = run_tests("cpp", "int main() { return undefined_thing; }", ["1\n"], backend=backend)
    assert r.compile.status == RUNTIME_ERROR and b"undefined_thing" in r.compile.stderr
    assert not r.compiled and r.runs[0].status == "lost"


@pytest.mark.integration  # starts bubblewrap to resolve the backend
def test_should_reject_unknown_languages_when_called():
    with pytest.raises(ValueError, match="language 'rust'"):
        run_tests("rust", "", [""])
    with pytest.raises(ValueError, match="python_mode"):
        run_tests("python", "", [""], python_mode="thread")


def test_should_raise_for_bad_limits_when_they_make_no_sense():
    with pytest.raises(ValueError, match="time_s"):
        Limits(time_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=1)


def _fresh_pch(monkeypatch, setting):
    from trainer.sandbox import pch

    monkeypatch.setenv("KUBERL_SANDBOX_PCH", setting)
    monkeypatch.setattr(pch, "_ready", {})
    monkeypatch.setattr(pch, "_started", set())
    return pch


@pytest.mark.timeout(300)
def test_should_compile_faster_when_the_precompiled_header_is_ready(backend, monkeypatch):
    import shutil
    import time

    from trainer.sandbox.executor import CPP_STD

    pch = _fresh_pch(monkeypatch, "/tmp/kuberl-pch")  # the default: shared with every other test run
    gxx = shutil.which("g++")
    deadline = time.monotonic() + 240
    while pch.include_dir(gxx, CPP_STD) is None:  # the first call starts a background build
        assert time.monotonic() < deadline, "the precompiled header was never built"
        time.sleep(0.5)
    fast = run_tests("cpp", CPP_ADD, ["1 2\n"], backend=backend)
    _fresh_pch(monkeypatch, "0")
    slow = run_tests("cpp", CPP_ADD, ["1 2\n"], backend=backend)
    assert fast.runs[0].stdout == slow.runs[0].stdout == b"3\n"
    assert fast.compile.cpu_s < 0.6 * slow.compile.cpu_s


@pytest.mark.integration  # runs g++
def test_should_skip_the_precompiled_header_when_its_directory_is_shared(monkeypatch, tmp_path, caplog):
    import shutil

    from trainer.sandbox.executor import CPP_STD

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # another local user could plant a header here
    pch = _fresh_pch(monkeypatch, str(shared))
    assert pch.include_dir(shutil.which("g++"), CPP_STD) is None
    assert "not ours alone" in caplog.text


def test_should_not_cap_stderr_when_a_correct_program_debugs_a_lot(backend):
    src = "import sys\nfor i in range(20000):\n    print('debug line', i, file=sys.stderr)\nprint(42)"
    r = run_tests("python", src, [""], backend=backend, output_caps=[100])
    assert r.runs[0].status == OK and r.runs[0].stdout == b"42\n"
    assert r.runs[0].stderr.startswith(b"debug line 0\n") and len(r.runs[0].stderr) == 4096
