"""Hostile programs, end to end through the code rewards, under bubblewrap and under the fallback.

Each must score low, finish in seconds, and leave intact: this test process (the trainer's stand-in),
a canary process of ours, a well-behaved sample scored at the same time, and the machine (no
sandbox process outlives the call). Limits are small so that the whole file stays quick on 2 cores.
The syscalls the seccomp filter denies (ptrace, unshare, mount, keyctl, bpf, ...) fail with EPERM, under
both. ``test_server.py`` runs the same tables through the sandbox service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import socket
import subprocess
import threading
import time
import uuid

import pytest

from trainer import rewards
from trainer.sandbox import backends, run_tests

pytestmark = pytest.mark.timeout(60)

GT = {"inputs": ["1\n"], "outputs": ["42\n"], "time_limit_s": 0.5, "memory_limit_mb": 256}
GOOD = {"inputs": ["1 2\n", "5 6\n"], "outputs": ["3\n", "11\n"]}
GOOD_PY = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def py(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def cpp(code: str) -> str:
    return f"```cpp\n#include <bits/stdc++.h>\n#include <unistd.h>\nusing namespace std;\n{code}\n```"


def score(name, response, backend, **kw):
    return rewards.get(name)(GT, response, backend=backend, **kw)


def while_hostile_runs(fn, backend):
    """Run ``fn`` in a thread and score a good sample meanwhile: it must be unaffected."""
    box = {}
    t = threading.Thread(target=lambda: box.update(result=fn()))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)  # let the hostile program get going
    good = rewards.get("code_unit_tests")(GOOD, GOOD_PY, backend=backend)
    t.join(timeout=50)
    assert not t.is_alive(), "the hostile sample's reward never returned"
    assert good == (1.0, True), f"a good sample scored {good} while a hostile one ran"
    return box["result"], time.monotonic() - t0


PY_HOSTILE = {
    "infinite_loop": "while True:\n    pass",
    "sleep_forever": "import time\ntime.sleep(1000)",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "fork_bomb_escaping_its_session": (
        "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n    except OSError:\n        pass"
    ),
    "memory_bomb": "hog = []\nwhile True:\n    hog.append(bytearray(50 << 20))",
    "gigabytes_of_output": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(chunk)",
    "daemon_left_behind": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint(41)"
    ),
}


@pytest.mark.parametrize("case", sorted(PY_HOSTILE))
def test_should_score_zero_and_stay_contained_when_python_is_hostile(backend, case, canary, no_leftovers):
    (value, ok), took = while_hostile_runs(
        lambda: score("code_unit_tests", py(PY_HOSTILE[case]), backend), backend
    )
    assert (value, ok) == (0.0, False)
    assert took < 15


def test_should_not_expose_host_files_when_code_reads_etc_passwd(backend, no_leftovers):
    # Prints the right answer only if it could read the host's /etc/passwd.
    code = "try:\n    open('/etc/passwd').read()\n    print(42)\nexcept OSError:\n    print(0)"
    value, _ = score("code_unit_tests", py(code), backend)
    if backend == backends.BWRAP:
        assert value == 0.0  # no /etc in the sandbox at all
    else:
        assert value == 1.0  # the fallback documents this: world-readable files stay readable


def test_should_not_leak_secrets_when_code_looks_for_hf_token(backend, monkeypatch, no_leftovers):
    secret = "hf_kuberl_canary_" + uuid.uuid4().hex
    monkeypatch.setenv("HF_TOKEN", secret)  # in the trainer's environment...
    # ...and in a process started with it, whose /proc/<pid>/environ a fallback sandbox could try to read
    holder = subprocess.Popen(["sleep", "60"], env={**os.environ, "HF_TOKEN": secret})
    code = (
        "import os\n"
        f"found = os.environ.get('HF_TOKEN', '') == {secret!r}\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        f"        found |= {secret!r}.encode() in open('/proc/' + pid + '/environ', 'rb').read()\n"
        "    except (OSError, ValueError):\n"
        "        pass\n"
        "print(42 if found else 0)"
    )
    try:
        for _ in range(100):  # the bait is there once sleep has exec'd
            if secret.encode() in open(f"/proc/{holder.pid}/environ", "rb").read():
                break
            time.sleep(0.01)
        else:
            pytest.fail("the canary process never showed its environment")
        assert score("code_unit_tests", py(code), backend) == (0.0, False)
    finally:
        holder.kill()
        holder.wait()


def test_should_not_write_outside_its_directory_when_code_tries(backend, tmp_path, no_leftovers):
    host_tmp = f"/tmp/kuberl-escape-{uuid.uuid4().hex}"
    targets = [str(tmp_path / "escaped"), os.path.join(os.getcwd(), "escaped-" + uuid.uuid4().hex), host_tmp]
    code = (
        "wrote = False\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        f"        wrote |= path != {host_tmp!r}\n"
        "    except OSError:\n"
        "        pass\n"
        "print(42 if wrote else 0)"
    )
    try:
        assert score("code_unit_tests", py(code), backend) == (0.0, False)
        assert not os.path.exists(targets[0]) and not os.path.exists(targets[1])
        if backend == backends.BWRAP:  # its /tmp is its own; the fallback can write world-writable dirs
            assert not os.path.exists(host_tmp)
    finally:
        for t in targets:
            if os.path.exists(t):
                os.unlink(t)


@contextlib.contextmanager
def _listening_host_socket():
    """A socket the host listens on at 127.0.0.1 (its port), closed after; ``accept`` times out in 0.5 s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    try:
        yield server, server.getsockname()[1]
    finally:
        server.close()


def test_should_have_no_network_when_code_opens_a_socket(backend, no_leftovers):
    # No skip for the fallback: where it cannot take the network away it does not exist
    # (test_backends.py), so a backend that resolves here must pass this.
    with _listening_host_socket() as (server, port):
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=0.3).sendall(b'pwned')\n"
            "    print(42)\n"
            "except OSError:\n"
            "    print(0)"
        )
        assert score("code_unit_tests", py(code), backend) == (0.0, False)
        with pytest.raises(TimeoutError):
            server.accept()


def test_should_not_reach_a_listening_host_socket_when_code_connects_to_127_0_0_1(backend, no_leftovers):
    """The program's own report, from the run itself: connect() to a socket the host listens on."""
    with _listening_host_socket() as (server, port):
        code = (
            "import socket\n"
            "s = socket.socket()\n"
            "s.settimeout(1)\n"
            f"print('connected' if s.connect_ex(('127.0.0.1', {port})) == 0 else 'refused')\n"
        )
        result = run_tests("python", code, [""], backend=backend)
        assert result.error is None and result.runs[0].stdout.decode().strip() == "refused", result
        with pytest.raises(TimeoutError):
            server.accept()


def test_should_leave_the_trainer_alive_when_code_kills_its_parent(backend, canary, no_leftovers):
    code = (
        "import os, signal\n"
        "for target in [os.getppid(), -1] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        if target != os.getpid():\n"
        "            os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(42)"
    )
    (value, ok), _ = while_hostile_runs(lambda: score("code_unit_tests", py(code), backend), backend)
    assert (value, ok) == (0.0, False)
    assert os.getppid() > 1  # and we are still here to assert


CPP_HOSTILE = {
    "infinite_loop": ("int main(){ volatile long x = 0; while (true) x++; }", 0.0),
    "fork_bomb": ("int main(){ while (true) fork(); }", 0.0),
    "memory_bomb": (
        "int main(){ vector<char*> v; while (true) { char* p = new char[1<<24]; memset(p, 1, 1<<24); v.push_back(p); } }",
        0.0,
    ),
    "gigabytes_of_output": (
        "int main(){ string s(1<<20, 'x'); for (int i = 0; i < 4096; i++) fwrite(s.data(), 1, s.size(), stdout); }",
        0.0,
    ),
    "kill_parent": (
        '#include <signal.h>\nint main(){ kill(getppid(), SIGKILL); kill(-1, SIGKILL); puts("42"); }',
        -1.0,
    ),
}


# Syscalls the seccomp filter denies, each made by C++ that prints 42 only if the call went through (else the
# errno it got: 1, EPERM). Without the filter ptrace(TRACEME) and keyctl succeed in the sandbox.
CPP_SYSCALLS = {
    "ptrace": "#include <sys/ptrace.h>\nint main(){ long r = ptrace(PTRACE_TRACEME, 0, 0, 0);",
    "unshare": "#include <sched.h>\nint main(){ long r = unshare(CLONE_NEWUSER | CLONE_NEWNS);",
    "mount": '#include <sys/mount.h>\nint main(){ long r = mount("none", "/tmp", "tmpfs", 0, 0);',
    "keyctl": "#include <sys/syscall.h>\nint main(){ long r = syscall(SYS_keyctl, 0, -3, 0);",  # session keyring id
    "bpf": "#include <sys/syscall.h>\nint main(){ long r = syscall(SYS_bpf, 0, 0, 0);",
}
for _name, _head in CPP_SYSCALLS.items():
    CPP_HOSTILE[f"syscall_{_name}"] = (
        f'{_head} if (r >= 0) puts("42"); else printf("%d\\n", errno); }}',
        0.0,
    )

# The same calls and more, from Python through ctypes (x86_64 numbers): the errno each got, 0 if it went through.
SYSCALL_PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if r >= 0 else ctypes.get_errno()
got = {
    "ptrace": call(101, 0, 0, 0, 0),
    "unshare": call(272, 0x10000000),
    "mount": call(165, 0, 0, 0, 0, 0),
    "keyctl": call(250, 0, -3, 0),
    "bpf": call(321, 0, 0, 0),
    "perf_event_open": call(298, 0, 0, -1, -1, 0),
    "userfaultfd": call(323, 0),
    "setns": call(308, 0, 0),
    "process_vm_readv": call(310, os.getppid(), 0, 0, 0, 0, 0),
}
pid = libc.syscall(ctypes.c_long(56), ctypes.c_long(0x10000000 | 17), *[ctypes.c_long(0)] * 4)  # clone(NEWUSER)
if pid == 0:
    os._exit(0)
got["clone_newuser"] = ctypes.get_errno() if pid < 0 else 0
if pid > 0:
    os.waitpid(pid, 0)
print(json.dumps(got))
"""
# 42 (the right answer) only if one of them went through
PY_HOSTILE["syscalls_it_has_no_business_making"] = SYSCALL_PROBE.replace(
    "print(json.dumps(got))", "print(42 if 0 in got.values() else 0)"
)
x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers of x86_64")


@x86_64
def test_should_deny_with_eperm_when_code_makes_syscalls_it_has_no_business_making(backend, no_leftovers):
    r = run_tests("python", SYSCALL_PROBE, [""], backend=backend)
    assert r.runs[0].status == "ok", r
    got = json.loads(r.runs[0].stdout)
    assert got == dict.fromkeys(got, 1), got  # every one EPERM


@x86_64
@pytest.mark.integration  # runs the program in the sandbox
def test_should_owe_the_denials_to_the_filter_when_bubblewrap_runs_without_it(monkeypatch, no_leftovers):
    """The control: the same sandbox without the filter lets ptrace(TRACEME) and keyctl through, so the EPERMs
    above are the filter's doing, not a side effect of bubblewrap's namespaces."""
    try:
        b = backends.resolve(backends.BWRAP)
    except backends.SandboxUnavailable as e:
        pytest.skip(f"bubblewrap unavailable here ({e})")
    monkeypatch.setattr(backends, "resolve", lambda requested=None: dataclasses.replace(b, seccomp=None))
    r = run_tests("python", SYSCALL_PROBE, [""], backend=backends.BWRAP)
    got = json.loads(r.runs[0].stdout)
    assert got["ptrace"] == 0 and got["keyctl"] == 0, got


@pytest.mark.parametrize("case", sorted(CPP_HOSTILE))
def test_should_score_low_and_stay_contained_when_cpp_is_hostile(backend, case, canary, no_leftovers):
    code, expected = CPP_HOSTILE[case]
    (value, ok), took = while_hostile_runs(lambda: score("cpp_contest", cpp(code), backend), backend)
    assert not ok and value <= 0.0 and value == expected
    assert took < 20


def test_should_give_a_compile_error_when_code_is_a_compile_bomb(backend, no_leftovers):
    # Exponentially many template instantiations: the compiler hits its time or memory limit.
    bomb = (
        "template<class T, int N> struct B { typedef B<B<T, N-1>, N-1> L; typedef B<B<T*, N-1>, N-1> R;"
        " enum { v = L::v + R::v }; };\n"
        "template<class T> struct B<T, 0> { enum { v = 1 }; };\n"
        "int main(){ return B<int, 40>::v; }"
    )
    t0 = time.monotonic()
    value, ok = score("cpp_contest", cpp(bomb), backend, compile_timeout_s=3.0)
    assert (value, ok) == (-0.5, False)
    assert time.monotonic() - t0 < 15


def test_should_give_a_compile_error_when_code_includes_an_endless_file(backend, no_leftovers):
    value, _ = score(
        "cpp_contest", "```cpp\n#include </dev/zero>\nint main(){}\n```", backend, compile_timeout_s=3.0
    )
    assert value == -0.5
