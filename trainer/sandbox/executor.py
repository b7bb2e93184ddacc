"""Run untrusted code against a list of stdin inputs, here: one sandbox per call, one fresh child per test.

:func:`run_tests` starts the in-sandbox runner (``_runner.py``) under the backend chosen by
``backends.resolve``, hands it the source, the inputs and the limits, and reads back one record per
step. The host side owns the overall deadline: whatever happens inside, the call returns within
``startup + compile wall + sum of per-test walls`` seconds, kills everything the sandbox started, and
never raises on what the program did (only on our own misuse, such as an unknown language).

Expected outputs never enter the sandbox; comparing is the caller's job (``trainer.rewards.code``).
Callers use ``trainer.sandbox.run_tests`` (:mod:`trainer.sandbox.remote`), which runs this one in process or,
with ``KUBERL_SANDBOX_URL`` set, sends the program to the sandbox service that runs this one there.
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# The modules themselves, not the package: its __init__ imports this one to re-export run_tests.
import trainer.sandbox.backends as backends
import trainer.sandbox.pch as pch
from trainer.sandbox.limits import COMPILE_LIMITS, ERROR, LOST, OK, Limits

log = logging.getLogger(__name__)

RUNNER_SOURCE = (Path(__file__).parent / "_runner.py").read_text()
STARTUP_S = 15.0  # slack for starting the sandbox and the interpreter on a loaded node
CPP_STD = ("-O2", "-std=c++17")  # what the precompiled header must be built with too
CPP_FLAGS = (*CPP_STD, "-pipe", "-w", "-fdiagnostics-color=never")
LANGUAGES = ("python", "cpp")


@dataclass
class RunResult:
    status: str  # limits.OK, RUNTIME_ERROR, TIMEOUT, OUTPUT_LIMIT, ERROR or LOST
    returncode: int | None = None
    stdout: bytes = b""  # only kept for status ok
    stderr: bytes = b""  # the first few KiB
    cpu_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class BatchResult:
    runs: list[RunResult]  # one per input, in order; LOST for those never run
    compile: RunResult | None = None  # for compiled languages
    error: str | None = None  # the sandbox itself failed (not the program's fault)
    backend: str = ""
    wall_s: float = 0.0

    @property
    def compiled(self) -> bool:
        return self.compile is None or self.compile.status == OK


def _python_mode(mode: str) -> str:
    if mode not in ("fork", "exec"):
        raise ValueError(f"python_mode {mode!r}: expected 'fork' (a forked interpreter per test) or 'exec'")
    return mode


def run_tests(
    language: str,
    source: str,
    inputs: list[str | bytes],
    limits: Limits | None = None,
    *,
    output_caps: list[int] | None = None,
    compile_limits: Limits = COMPILE_LIMITS,
    stop_on: tuple[str, ...] = (),
    python_mode: str = "fork",
    backend: str | None = None,
) -> BatchResult:
    """Run ``source`` once per input; stop early after a test whose status is in ``stop_on``.

    ``output_caps[i]`` (bytes) lowers the stdout cap of test ``i`` below ``limits.output_bytes``: the
    caller knows an output far longer than the expected one cannot be right.
    """
    if language not in LANGUAGES:
        raise ValueError(f"sandbox language {language!r}: expected one of {', '.join(LANGUAGES)}")
    limits = limits or Limits()
    b = backends.resolve(backend)
    t0 = time.monotonic()
    data = [x.encode("utf-8", "surrogateescape") if isinstance(x, str) else bytes(x) for x in inputs]
    caps = [limits.output_bytes] * len(data)
    if output_caps is not None:
        caps = [max(1, min(limits.output_bytes, int(c))) for c in output_caps]

    box = backends.BOX if b.kind == backends.BWRAP else None
    extra_ro: list[str] = []
    host_dir = None
    uid = backends.allocate_uid() if b.switch_uid else None
    try:
        if box is None:  # the fallback works in a fresh host directory only its uid can enter
            # named by the pid that made it, as its uid is (backends.allocated_by): whose it is, if left
            tmp = os.environ.get("KUBERL_SANDBOX_TMP")
            host_dir = tempfile.mkdtemp(prefix=f"kuberl-sandbox-{os.getpid()}-", dir=tmp)
            os.chmod(host_dir, 0o711)  # searchable, not listable: the sandbox uid owns only box/
            box = os.path.join(host_dir, "box")
            os.mkdir(box, 0o700)
            if uid is not None:
                os.chown(box, uid, uid)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": box, "TMPDIR": f"{box}/tmp"}
        spec: dict = {
            "box": box,
            "env": env,
            "inputs": data,
            "caps": caps,
            "limits": limits.to_runner(),
            "stop_on": list(stop_on),
            "kill_all": b.kind == backends.BWRAP or uid is not None,
        }
        if language == "python":
            spec["filename"] = "solution.py"
            if _python_mode(python_mode) == "exec":
                spec["run_argv"] = [b.python, "-I", f"{box}/src/solution.py"]
        else:
            gxx = shutil.which("g++")
            if gxx is None:
                return BatchResult(
                    [RunResult(ERROR) for _ in data], error="g++ is not installed", backend=b.kind
                )
            spec["filename"] = "solution.cpp"
            pch_dir = pch.include_dir(gxx, CPP_STD)
            include = ["-I", pch_dir] if pch_dir else []
            extra_ro = [pch_dir] if pch_dir else []
            spec["compile"] = {
                "argv": [gxx, *CPP_FLAGS, *include, "-o", f"{box}/bin/solution", f"{box}/src/solution.cpp"],
                "limits": compile_limits.to_runner(),
                "fsize": compile_limits.output_bytes,
            }
            spec["run_argv"] = [f"{box}/bin/solution"]
        spec["source"] = source

        runner = [b.python, "-I", "-S", "-c", RUNNER_SOURCE]
        kw: dict = {}
        if b.kind == backends.BWRAP:
            filter_fd = backends.seccomp_fd(b)
            argv = backends.bwrap_argv(b, runner, extra_ro, filter_fd)
            if filter_fd is not None:
                kw["pass_fds"] = (filter_fd,)
            if uid is not None:
                argv, more = backends.as_uid(argv, uid)
                kw.update(more)
        else:
            argv = runner
            spec["parent_pid"] = os.getpid()  # the runner's parent: it exits if that is gone already
            spec["netns"] = b.netns  # the runner takes the network away before anything runs, or exits
            if uid is not None:  # the runner drops to ``uid`` itself
                spec["drop_to"] = [uid, uid]
            if b.seccomp is not None:  # the runner loads it into each test child (bubblewrap loads its own)
                spec["seccomp"] = b.seccomp
        budget = STARTUP_S + len(data) * (limits.wall + 0.5)
        if "compile" in spec:
            budget += compile_limits.wall
        try:
            result = _drive(argv, env, kw, marshal.dumps(spec, 4), len(data), budget, caps, uid)
        finally:
            for fd in kw.get("pass_fds", ()):
                os.close(fd)
        result.backend = b.kind
        result.wall_s = time.monotonic() - t0
        return result
    finally:
        if host_dir is not None:
            _remove_tree(host_dir)


def _remove_tree(path: str) -> None:
    """rmtree that also works without root: the runner leaves ``src/`` and ``bin/`` read-only."""
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            p = os.path.join(root, d)
            if not os.path.islink(p):
                try:
                    os.chmod(p, 0o700)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)


def _drive(argv, env, kw, spec_bytes, n, budget, caps, uid) -> BatchResult:
    """Start the runner, feed it the spec, parse its records until ``done``, EOF or the deadline."""
    deadline = time.monotonic() + budget
    max_bytes = sum(caps) + (n + 2) * (8192 + 1024)  # the runner cannot send more than this
    err_file = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err_file,
            env=env,
            start_new_session=True,
            close_fds=True,
            **kw,
        )
    except OSError as e:
        err_file.close()
        return BatchResult([RunResult(ERROR) for _ in range(n)], error=f"cannot start the sandbox: {e}")
    runs: list[RunResult] = []
    compile_result = None
    error = None
    try:
        # Feed the spec and read the records in one select loop, so that even writing the spec to a
        # runner that never reads it cannot block past the deadline.
        pending = memoryview(spec_bytes)
        wfd, rfd = proc.stdin.fileno(), proc.stdout.fileno()
        os.set_blocking(wfd, False)
        buf, received, done = bytearray(), 0, False
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"the sandbox ran past its overall deadline ({budget:.0f}s)"
                break
            readable, writable, _ = select.select([rfd], [wfd] if pending else [], [], left)
            if writable:
                try:
                    pending = pending[os.write(wfd, pending[: 1 << 16]) :]
                except BlockingIOError:
                    pass
                except OSError:  # the runner is gone; its EOF on stdout will tell
                    pending = pending[:0]
                if not pending:
                    proc.stdin.close()
            if not readable:
                continue
            chunk = os.read(rfd, 1 << 20)
            if not chunk:
                break
            buf += chunk
            received += len(chunk)
            if received > max_bytes:
                error = "the sandbox sent more than its output caps allow"
                break
            while True:  # parse every complete record in buf
                try:
                    rec = _parse(buf)
                except (ValueError, EOFError, TypeError, KeyError):
                    error, done = "the sandbox sent a garbled record", True
                    break
                if rec is None:
                    break
                header, out, err = rec
                if header["kind"] == "done":
                    done = True
                    break
                r = RunResult(header["status"], header["rc"], out, err, header["cpu_s"], header["wall_s"])
                if header["kind"] == "compile":
                    compile_result = r
                else:
                    runs.append(r)
        if not done and error is None:
            error = "the sandbox exited before reporting every test"
    finally:
        _kill(proc, uid, force=error is not None)
        if error is not None:
            err_file.seek(0)
            tail = err_file.read(4096).decode(errors="replace").strip()
            if tail:
                error += f": {tail.splitlines()[-1]}"
        err_file.close()
    runs += [RunResult(LOST) for _ in range(n - len(runs))]
    return BatchResult(runs, compile_result, error)


def _parse(buf: bytearray):
    """Pop one record off the front of ``buf``; None until a whole one has arrived."""
    if len(buf) < 4:
        return None
    hlen = int.from_bytes(buf[:4], "little")
    if len(buf) < 4 + hlen:
        return None
    header = marshal.loads(bytes(buf[4 : 4 + hlen]))
    end = 4 + hlen + header["out_len"] + header["err_len"]
    if len(buf) < end:
        return None
    out = bytes(buf[4 + hlen : 4 + hlen + header["out_len"]])
    err = bytes(buf[4 + hlen + header["out_len"] : end])
    del buf[:end]
    return header, out, err


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Reap ``proc`` if it exits within ``timeout``: a pidfd wakes us at once, with no polling sleeps."""
    if proc.returncode is not None:
        return True  # already reaped: its pid may belong to someone else by now
    try:
        fd = os.pidfd_open(proc.pid)  # valid until reaped, which only we do
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [], timeout)
        finally:
            os.close(fd)
    try:
        proc.wait(timeout=0 if fd is not None else timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _kill(proc: subprocess.Popen, uid: int | None, force: bool) -> None:
    """Make sure nothing of this sandbox outlives the call."""
    if not _exited(proc, 0.05 if force else 2.0):
        force = True
        for target in (lambda: os.killpg(proc.pid, 9), proc.kill):  # not reaped yet: the pid is still ours
            try:
                target()
            except OSError:
                pass
    if uid is not None and force:
        # Every process of the sandbox's own uid, whatever session or namespace it went to.
        try:
            argv, kw = backends.as_uid(["kill", "-9", "-1"], uid)
            subprocess.run(argv, timeout=5, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        except (OSError, subprocess.SubprocessError):
            pass
    if not _exited(proc, 5.0):
        log.warning("sandbox: pid %d did not exit after SIGKILL", proc.pid)
    for f in (proc.stdout, proc.stdin):
        try:
            if f:
                f.close()
        except OSError:
            pass
