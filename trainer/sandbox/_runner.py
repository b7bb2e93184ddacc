"""The in-sandbox runner: compiles once, then runs a program once per test, each in a fresh child.

The host starts this file as ``python -I -S -c <this source>`` inside the sandbox (bubblewrap, or
the rlimit fallback) and writes one marshalled spec to its stdin; it answers on stdout with one
record per step (``compile``, then one per test, then ``done``), each a marshalled header followed by
the captured stdout and stderr bytes. It is standard library only, and imports as little as it can
(no json, no signal module: each costs milliseconds on every sample).

One runner per sample amortises the sandbox's start-up over the sample's tests. Python solutions run
in a fork of this already started interpreter (no new interpreter per test: about 1 ms instead of 10),
which behaves like ``python -I -S solution.py`` for a stdin/stdout program; ``exec`` mode runs an
argv per test instead (C++ binaries, or Python when fidelity matters more than speed).

Every test child: its own process group and fresh working directory, stdin and stdout on memfds
(reachable by no path; stdout capped by the file-size limit), stderr on a pipe the runner drains
(debug output is not capped, only the first bytes kept), resource limits (CPU seconds, address space, file size = the output cap,
processes, open files, no core), default SIGPIPE/SIGXFSZ, and in the rlimit fallback the seccomp filter
(``seccomp.py``; bubblewrap loads it for the whole sandbox). After each test every other process the
runner can signal is killed (``kill(-1)``: the whole sandbox under bubblewrap's PID namespace, or
the sandbox's own uid in the fallback), so nothing a test leaves behind reaches the next one. The
runner is non-dumpable, so a test cannot open its result pipe through ``/proc/<ppid>/fd`` or trace it.
"""

import _signal
import marshal
import os
import resource
import select
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_libc = None  # ctypes' libc, loaded by main()
_fprog = (
    None  # the fallback's seccomp filter (a struct sock_fprog, built by main()); bubblewrap loads its own
)
ERR_BYTES = 4096  # stderr bytes kept per step: enough for a traceback or a compiler's first errors


def _write(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _send(fd, header, out=b"", err=b""):
    header = dict(header, out_len=len(out), err_len=len(err))
    blob = marshal.dumps(header, 4)
    _write(fd, len(blob).to_bytes(4, "little") + blob + out + err)


def _read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _memfd(name, data=b""):
    fd = os.memfd_create(name, 0)
    if data:
        _write(fd, data)
        os.lseek(fd, 0, 0)
    return fd


def _read_cap(fd, cap):
    os.lseek(fd, 0, 0)
    chunks, left = [], cap
    while left > 0:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _rmtree(path):
    """Best effort: a test may leave directories it made unreadable; the tmpfs goes away anyway."""
    for root, dirs, _ in os.walk(path):  # top-down: open up each directory before descending into it
        for name in dirs:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                try:
                    os.chmod(p, 0o700)
                except OSError:
                    pass
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + dirs:
            p = os.path.join(root, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    os.rmdir(p)
                else:
                    os.unlink(p)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _count_tasks(uid):
    """Threads of ``uid`` on this machine (what RLIMIT_NPROC counts)."""
    n = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                n += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            pass
    return n


def _set_limits(lim, fsize):
    mb = 1 << 20
    cpu = max(1, int(lim["cpu_s"] + 0.999))
    # The kernel sends SIGXCPU at the soft limit and SIGKILL at the hard one.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    nproc = lim["nproc"] + lim.get("nproc_base", 0)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if lim.get("stack_mb"):
        s = lim["stack_mb"] * mb
        resource.setrlimit(resource.RLIMIT_STACK, (s, s))


class _Quitter:
    """``exit``/``quit`` as ``site`` would define them (-S leaves them out)."""

    def __repr__(self):
        return "Use exit() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code=None):
        raise SystemExit(code)


def _format_exc(e, source, filename, max_frames=20):
    """A traceback like Python's, without importing ``traceback`` (~10 ms in every crashing child)."""
    src = source.splitlines()
    out = []
    if isinstance(e, SyntaxError):
        out.append(f'  File "{e.filename}", line {e.lineno}\n')
        if e.text:
            out.append(f"    {e.text.strip()}\n")
    frames = []
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # skip this runner's frame
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    lines = []
    for code, lineno in frames[-max_frames:]:
        lines.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
        if code.co_filename == filename and 0 < lineno <= len(src):
            lines.append(f"    {src[lineno - 1].strip()}\n")
    if lines:
        out = ["Traceback (most recent call last):\n"] + lines + out
    try:
        msg = str(e.msg if isinstance(e, SyntaxError) else e)
    except BaseException:
        msg = "<unprintable>"
    out.append(f"{type(e).__name__}: {msg}\n" if msg else f"{type(e).__name__}\n")
    return "".join(out)


def _run_python(source, filename):
    """In the forked child: run ``source`` as ``__main__`` like ``python -I -S filename`` would."""
    import builtins
    import io

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.argv = [filename]
    builtins.exit = builtins.quit = _Quitter()
    main = type(sys)("__main__")
    main.__file__ = filename
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    rc = 0
    try:
        exec(compile(source, filename, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException as e:
        try:
            sys.stderr.write(_format_exc(e, source, filename))
        except BaseException:
            pass
        rc = 1
    try:
        t = sys.modules.get("threading")
        if t is not None:
            t._shutdown()  # wait for non-daemon threads, as interpreter shutdown does
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        rc = rc or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            rc = 120  # what CPython exits with when flushing stdout fails
    os._exit(rc & 0xFF)


def _child(spec, argv, fds, cwd, fsize, lim):
    """In the forked child: never returns."""
    try:
        os.setpgid(0, 0)
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)  # the runner's handler is not the program's
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # dies with the runner, whatever kills the runner
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(3, 1 << 16)
        os.chdir(cwd)
        # Python ignores SIGPIPE and SIGXFSZ; an ignored signal stays ignored across exec.
        _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
        _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
        _set_limits(lim, fsize)
        if _fprog is not None:
            import ctypes

            if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or _libc.prctl(
                PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_fprog), 0, 0
            ):
                raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")
        if argv is None:
            _run_python(spec["source"], spec["filename"])
        os.execve(argv[0], argv, spec["env"])
    except BaseException as e:
        try:
            os.write(2, f"sandbox runner: cannot start the program: {e!r}\n".encode())
        except BaseException:
            pass
    os._exit(127)


class _ErrTail:
    """Drains a test's stderr pipe as it runs: keeps the first bytes, throws the rest away.

    A pipe rather than a file, so that chatty debug output on stderr is never capped like stdout is.
    """

    def __init__(self, fd):
        self.fd, self.data, self.open = fd, bytearray(), True
        os.set_blocking(fd, False)

    def drain(self):
        while self.open:
            try:
                b = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not b:
                self.open = False
            elif len(self.data) < ERR_BYTES:
                self.data += b[: ERR_BYTES - len(self.data)]


def _wait(pid, wall_s, err):
    """Wait up to ``wall_s`` for ``pid`` while draining its stderr; return (status, rusage, timed_out)."""
    deadline = time.monotonic() + wall_s
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None  # Python < 3.9 or kernel < 5.3: poll the pid every few ms
    poller = select.poll()
    poller.register(err.fd, select.POLLIN)
    if pfd is not None:
        poller.register(pfd, select.POLLIN)
    timed_out, reaped = False, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        events = poller.poll(left * 1000 if pfd is not None else min(left * 1000, 2))
        if any(fd == err.fd for fd, _ in events):
            err.drain()
            if not err.open:
                poller.unregister(err.fd)
        if pfd is not None:
            if any(fd == pfd for fd, _ in events):
                break
        else:
            wpid, status, ru = os.wait4(pid, os.WNOHANG)
            if wpid:
                reaped = status, ru
                break
    if pfd is not None:
        os.close(pfd)
    if timed_out:
        for target in (-pid, pid):
            try:
                os.kill(target, 9)
            except OSError:
                pass
    if reaped is None:
        _, status, ru = os.wait4(pid, 0)
    else:
        status, ru = reaped
    return status, ru, timed_out


def _cleanup(kill_all, pid):
    """Kill what the step left running (double-forked daemons, fork bombs) and reap it."""
    for _ in range(200):
        try:
            if kill_all:
                os.kill(-1, 9)  # every process this uid can signal here, except us and the PID-1 reaper
            else:
                os.killpg(pid, 9)
        except OSError:
            pass
        try:
            while True:
                wpid, _ = os.waitpid(-1, os.WNOHANG)
                if wpid == 0:
                    break
        except ChildProcessError:
            return
        time.sleep(0.001)


_current = 0  # pid of the test child running now


def _die(kill_all):
    """Our parent is gone: kill every process of this sandbox and leave."""
    try:
        if kill_all:
            os.kill(-1, 9)
        elif _current:
            os.killpg(_current, 9)
    finally:
        os._exit(1)


def _step(spec, argv, stdin, cap, lim, cwd):
    err_r, err_w = os.pipe()
    fds = (_memfd("stdin", stdin), _memfd("stdout"), err_w)
    os.mkdir(cwd, 0o700)
    t0 = time.monotonic()
    global _current
    pid = os.fork()
    if pid == 0:
        _child(spec, argv, fds, cwd, cap, lim)
    _current = pid
    os.close(err_w)
    err = _ErrTail(err_r)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    status, ru, timed_out = _wait(pid, lim["wall_s"], err)
    wall = time.monotonic() - t0
    _cleanup(spec["kill_all"], pid)
    err.drain()  # what is left in the pipe; whoever still held it open is dead now
    os.close(err_r)
    cpu = ru.ru_utime + ru.ru_stime
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -sig
    size = os.fstat(fds[1]).st_size
    if timed_out or sig == 24 or cpu > lim["cpu_s"]:  # 24: SIGXCPU
        verdict = "timeout"
    elif sig == 25 or size > cap:  # 25: SIGXFSZ, the output cap
        verdict = "output_limit"
    elif rc == 127 and not sig and argv is not None and err.data.startswith(b"sandbox runner: cannot start"):
        verdict = "error"
    elif rc != 0:
        verdict = "runtime_error"
    else:
        verdict = "ok"
    out = _read_cap(fds[1], cap) if verdict == "ok" else b""
    os.close(fds[0])
    os.close(fds[1])
    _rmtree(cwd)
    header = {"status": verdict, "rc": rc, "cpu_s": cpu, "wall_s": wall, "max_rss_kb": ru.ru_maxrss}
    return header, out, bytes(err.data)


def _unshare_or_exit(libc, flags):
    if libc.unshare(flags) != 0:
        os.write(2, b"sandbox: cannot unshare a network namespace, so nothing runs\n")
        os._exit(71)


def main():
    res_fd = os.dup(1)
    spec = marshal.loads(_read_all(0))
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)

    import ctypes

    global _libc, _fprog
    _libc = libc = ctypes.CDLL(None, use_errno=True)
    if spec.get(
        "seccomp"
    ):  # the rlimit fallback: each test child loads it (the filter's docstring: seccomp.py)

        class _SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        program = ctypes.create_string_buffer(spec["seccomp"], len(spec["seccomp"]))
        _fprog = _SockFprog(len(spec["seccomp"]) // 8, ctypes.addressof(program))
        _fprog._program = program  # keep the instructions alive as long as the struct
    # The fallback never keeps the network: a namespace of its own (while still root, before the uid
    # drop, or as any uid inside a new user namespace), or the runner exits before running anything.
    netns = spec.get("netns")
    if netns == "net":
        _unshare_or_exit(libc, CLONE_NEWNET)
    if spec.get("drop_to"):
        uid, gid = spec["drop_to"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if netns == "user":
        _unshare_or_exit(libc, CLONE_NEWUSER | CLONE_NEWNET)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # If the trainer's worker is killed (a reward timeout cancels its task), take everything down
    # with us: SIGTERM, not SIGKILL, so that the handler can kill what a test left behind. Set after
    # the uid change, which clears it; then make sure the parent did not die before it was set.
    _signal.signal(_signal.SIGTERM, lambda *_: _die(spec["kill_all"]))
    libc.prctl(PR_SET_PDEATHSIG, 15, 0, 0, 0)
    if spec.get("parent_pid") and os.getppid() != spec["parent_pid"]:
        _die(spec["kill_all"])
    os.umask(0o077)
    if not spec["kill_all"]:
        # Sharing the trainer's uid: RLIMIT_NPROC counts all of its threads, so allow that many more.
        base = _count_tasks(os.getuid())
        for lim in (spec["limits"], (spec.get("compile") or {}).get("limits") or {}):
            lim["nproc_base"] = base

    box = spec["box"]
    for sub in ("src", "bin", "tmp"):
        os.makedirs(os.path.join(box, sub), 0o700, exist_ok=True)
    src = os.path.join(box, "src", spec["filename"])
    with open(src, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(spec["source"])

    compile_spec = spec.get("compile")
    if compile_spec:
        header, _, err = _step(
            spec,
            compile_spec["argv"],
            b"",
            compile_spec["fsize"],
            compile_spec["limits"],
            os.path.join(box, "c"),
        )
        _send(res_fd, dict(header, kind="compile"), b"", err)
        if header["status"] != "ok":
            _send(res_fd, {"kind": "done"})
            return
    os.chmod(os.path.join(box, "src"), 0o500)
    os.chmod(os.path.join(box, "bin"), 0o500)

    argv = spec.get("run_argv")  # None: Python in a fork of this interpreter
    stop_on = set(spec.get("stop_on") or ())
    for i, (stdin, cap) in enumerate(zip(spec["inputs"], spec["caps"])):  # noqa: B905 (runs on Python 3.8 too)
        header, out, err = _step(spec, argv, stdin, cap, spec["limits"], os.path.join(box, f"t{i}"))
        _send(res_fd, dict(header, kind="test", index=i), out, err)
        if header["status"] in stop_on:
            break
    _send(res_fd, {"kind": "done"})


if __name__ == "__main__":
    main()
