"""Which isolation this machine allows, decided once per process, and how to start a sandbox with it.

``bwrap``: bubblewrap gives the runner new user, mount, PID, network, IPC and UTS namespaces, a
read-only view of ``/usr`` (plus the interpreter's prefix) and nothing else of the host: no ``/etc``,
no home directories, no ``/proc`` of the host, no network. Its writable places are two size-capped
tmpfs (``/box`` and ``/tmp``) that vanish with it. Killing the outer bwrap tears the PID namespace
down, and with it everything the program started. Inside, a seccomp filter (``seccomp``) makes the
syscalls a program has no business making (ptrace, mount, unshare, keyctl, bpf, ...) fail with EPERM.
Where libseccomp is missing bubblewrap is refused too, unless ``KUBERL_SANDBOX_WITHOUT_SECCOMP=1`` accepts
running without the filter.

``rlimit``: no namespaces but the network's. The runner runs on the host with the same per-test rlimits and
seccomp filter, in a fresh 0700 directory, with a scrubbed environment, and (when we are root) as its own
unprivileged uid, so that it cannot read root's files, signal the trainer or read its ``/proc/<pid>/environ``,
and so that ``kill(-1)`` from that uid reaches exactly the sandbox's processes. It never keeps the network:
the runner enters a network namespace of its own (``unshare(CLONE_NEWNET)`` while it is still root, else a
user namespace with it) before it runs anything, and a machine where neither works gets no fallback at all.
It still sees the host's files: it can read world-readable ones and write world-writable directories (a
hostile program did, in 1 of 16 tries). So model code never runs under it unless the user says so by name:
``KUBERL_SANDBOX=rlimit-without-isolation`` (or ``backend="rlimit-without-isolation"``); ``rlimit`` alone, and
``auto`` where bubblewrap cannot start, are refused with one line (:class:`SandboxUnavailable`) naming that key.

Both give every sandbox its own unprivileged uid when the trainer runs as root, because the kernel
counts RLIMIT_NPROC per uid and does not enforce it for root at all: a shared uid would let one fork
bomb starve every other sample's sandbox. ``KUBERL_SANDBOX`` picks the backend: ``auto`` (the default) and
``bwrap`` both mean bubblewrap or nothing, and differ only in the refusal's wording; the chart sets ``bwrap``
on every Ray pod. ``KUBERL_SANDBOX_PYTHON`` names the interpreter.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import trainer.sandbox.seccomp as seccomp
from trainer.config import ConfigError

log = logging.getLogger(__name__)

BWRAP = "bwrap"
RLIMIT = "rlimit"  # the Backend.kind of the fallback; asking for it takes UNISOLATED, by name
BACKENDS = (BWRAP, RLIMIT)
# The opt-in that runs model code under the fallback: its name says what is given up.
UNISOLATED = "rlimit-without-isolation"
REQUESTS = (BWRAP, "auto", UNISOLATED)
# The opt-out of the seccomp filter where libseccomp is missing ("1"); its name says what is given up.
WITHOUT_SECCOMP_ENV = "KUBERL_SANDBOX_WITHOUT_SECCOMP"

# How the fallback's runner gets its network namespace (_runner.py): unshare it while still root
# (then drop to the sandbox uid), or as any uid inside a new user namespace.
NETNS_ROOT = "net"
NETNS_USER = "user"

BOX = "/box"  # the sandbox's working directory under bwrap
SCRATCH_BYTES = 128 << 20  # size of each tmpfs under bwrap (where supported)


@dataclass(frozen=True)
class Backend:
    kind: str  # BWRAP or RLIMIT
    python: str  # interpreter for the runner and for Python solutions
    bwrap: str | None = None
    bwrap_flags: tuple[str, ...] = ()  # optional flags this bwrap supports (--size, --disable-userns)
    binds: tuple[str, ...] = ()  # host directories mounted read-only under bwrap
    switch_uid: bool = False  # we are root: each sandbox runs as its own unprivileged uid
    netns: str = ""  # the fallback: NETNS_ROOT or NETNS_USER, never "" (bubblewrap unshares its own)
    proc: bool = True  # bwrap mounts a /proc of the sandbox's PID namespace (not where /proc is masked)
    reason: str = ""  # why this backend (a fallback says what failed)
    seccomp: bytes | None = field(default=None, repr=False)  # the filter's BPF (None: opted out of it)
    notes: list[str] = field(default_factory=list, compare=False)


def _world_usable(path: str) -> bool:
    """True when any uid can execute ``path`` (every directory above it searchable)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        d = os.path.dirname(path)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def _find_python(need_world: bool) -> str:
    override = os.environ.get("KUBERL_SANDBOX_PYTHON")
    if override:
        return override
    candidates = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    which = shutil.which("python3")
    if which:
        candidates.append(os.path.realpath(which))
    for c in candidates:
        if os.path.exists(c) and (not need_world or _world_usable(c)):
            return os.path.realpath(c)
    raise RuntimeError(
        "sandbox: no Python interpreter that an unprivileged uid can execute "
        f"(tried {', '.join(candidates)}); set KUBERL_SANDBOX_PYTHON to one"
    )


def _prefix(exe: str) -> str:
    """The installation directory to mount for an executable outside /usr (``<prefix>/bin/exe``)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(exe)))


# --- uids ----------------------------------------------------------------------------------------

_uid_lock = threading.Lock()
_uid_counter = itertools.count()


def _uid_span() -> tuple[int, int]:
    """A block of uids that exist in our user namespace, away from real accounts."""
    want_lo, want_span = 1 << 20, 1 << 30
    try:
        with open("/proc/self/uid_map") as f:
            rows = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        rows = [(0, 0, 1 << 32)]
    for inside, _, count in rows:
        if inside <= want_lo and inside + count >= want_lo + want_span:
            return want_lo, want_span
    # A user-namespaced pod (typically 65536 ids): take the top of what is mapped.
    inside, _, count = max(rows, key=lambda r: r[2])
    lo = max(inside + 10000, inside + count // 2)
    return lo, max(1, inside + count - 2 - lo)


def allocate_uid() -> int:
    """A uid no other live sandbox on this node uses: pid-derived, so Ray workers never collide."""
    lo, span = _uid_span()
    with _uid_lock:
        n = next(_uid_counter)
    return lo + (os.getpid() * 256 + n % 256) % span


def allocated_by(uid: int) -> int | None:
    """The pid of the process whose :func:`allocate_uid` gave ``uid``; None when the span is too small to
    tell (a user-namespaced pod) or ``uid`` is not in it."""
    lo, span = _uid_span()
    if span < (1 << 22) * 256 or not lo <= uid < lo + span:  # pids reach 2^22 (pid_max): no wrap below that
        return None
    return (uid - lo) // 256


def as_uid(argv: list[str], uid: int) -> tuple[list[str], dict]:
    """Start ``argv`` as ``uid`` (and gid ``uid``, no supplementary groups): ``(argv, Popen kwargs)``.

    Through ``setpriv`` when it exists, because Popen's own ``user=`` makes it fork() rather than
    vfork(), which costs milliseconds per sandbox when the caller is a big process (a Ray worker).
    """
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv], {}
    return argv, {"user": uid, "group": uid, "extra_groups": []}


# --- bwrap ---------------------------------------------------------------------------------------


def bwrap_argv(
    b: Backend,
    python_argv: list[str],
    extra_ro: list[str] | tuple[str, ...] = (),
    seccomp_fd: int | None = None,
) -> list[str]:
    """bubblewrap's command line; ``seccomp_fd`` (from :func:`seccomp_fd`) must be passed to it (``pass_fds``)."""
    argv = [
        b.bwrap,
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]
    if "--disable-userns" in b.bwrap_flags:
        argv += ["--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    argv += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
    for d in b.binds:
        argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev"] if b.proc else ["--dev", "/dev"]
    for mount in (BOX, "/tmp"):
        if "--size" in b.bwrap_flags:
            argv += ["--size", str(SCRATCH_BYTES)]
        argv += ["--perms", "0700", "--tmpfs", mount] if "--perms" in b.bwrap_flags else ["--tmpfs", mount]
    for d in extra_ro:  # after the tmpfs mounts, which would hide them
        argv += ["--ro-bind", d, d]
    if seccomp_fd is not None:  # loaded after bubblewrap's own set-up: it binds the runner, not bubblewrap
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--chdir", BOX, "--"]
    return argv + python_argv


def seccomp_fd(b: Backend) -> int | None:
    """A fresh descriptor of ``b``'s filter for one bubblewrap (it reads it whole); None without a filter."""
    return None if b.seccomp is None else seccomp.memfd(b.seccomp)


def _bwrap_backend(need_world: bool) -> Backend:
    exe = shutil.which("bwrap")
    if not exe:
        raise RuntimeError("bubblewrap is not installed (apt-get install bubblewrap)")
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10).stdout
    flags = tuple(f for f in ("--size", "--disable-userns", "--perms") if f in help_text)
    python = _find_python(need_world)
    binds = []
    for tool in (python, shutil.which("g++")):
        if tool and not os.path.realpath(tool).startswith("/usr/"):
            binds.append(_prefix(tool))
    return Backend(BWRAP, python, exe, flags, tuple(dict.fromkeys(binds)), switch_uid=need_world)


def _probe(b: Backend) -> str | None:
    """Run ``print(42)`` the way real runs will; None when it works, else why not."""
    fd = seccomp_fd(b)
    argv = bwrap_argv(b, [b.python, "-I", "-S", "-c", "print(6 * 7)"], seccomp_fd=fd)
    kw: dict = {"pass_fds": (fd,)} if fd is not None else {}
    if b.switch_uid:
        argv, more = as_uid(argv, allocate_uid())
        kw.update(more)
    try:
        p = subprocess.run(argv, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"}, **kw)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if fd is not None:
            os.close(fd)
    if p.returncode == 0 and p.stdout.strip() == b"42":
        return None
    err = p.stderr.decode(errors="replace").strip().splitlines()
    return err[-1] if err else f"exit status {p.returncode}"


class SandboxUnavailable(ConfigError, RuntimeError):
    """No isolation that code from the model may run under: the run refuses to start with this one
    line (the entry point prints a ConfigError so; callers that knew only RuntimeError still catch it)."""


def _can_unshare(*flags: str) -> bool:
    unshare = shutil.which("unshare")
    try:
        return (
            bool(unshare)
            and subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def netns_mode(root: bool) -> str | None:
    """How the fallback's runner will get a network namespace of its own (it makes the same calls);
    None where it cannot, and then there is no fallback."""
    if root and _can_unshare("--net"):
        return NETNS_ROOT
    if _can_unshare("--user", "--net"):
        return NETNS_USER
    return None


_lock = threading.Lock()
_cache: dict[str, Backend] = {}


def _filter(required: bool) -> bytes | None:
    """The seccomp filter's BPF; without libseccomp, SandboxUnavailable when ``required`` unless opted out."""
    try:
        return seccomp.bpf()
    except seccomp.SeccompUnavailable as e:
        if required and os.environ.get(WITHOUT_SECCOMP_ENV, "") != "1":
            raise SandboxUnavailable(
                f"sandbox: {e}; bubblewrap without it leaves the kernel's whole syscall surface to model code: "
                f"install it, or set {WITHOUT_SECCOMP_ENV}=1 to run without the filter"
            ) from None
        log.warning("sandbox: %s; sandboxed programs run without a seccomp filter", e)
        return None


def resolve(requested: str | None = None) -> Backend:
    """The backend for ``requested`` (``bwrap``, ``auto`` or ``rlimit-without-isolation``), probed once per process.

    Raises :class:`SandboxUnavailable` (one line) when bubblewrap is asked for (``bwrap``, ``auto``) and does not
    work here or has no seccomp filter, when the fallback is asked for as plain ``rlimit`` (not by its opt-in
    name), and when the fallback could not take the network away either.
    """
    requested = (requested or os.environ.get("KUBERL_SANDBOX") or "auto").lower()
    if requested == RLIMIT:
        raise SandboxUnavailable(
            f"sandbox backend {RLIMIT!r} runs model code without bubblewrap's isolation (it can read world-readable "
            f"files and write world-writable directories); to accept that, name it: KUBERL_SANDBOX={UNISOLATED}"
        )
    if requested not in REQUESTS:
        raise ValueError(f"sandbox backend {requested!r}: expected one of {', '.join(REQUESTS)}")
    with _lock:
        if requested in _cache:
            return _cache[requested]
        root = os.geteuid() == 0
        if requested != UNISOLATED:
            program = _filter(required=True)
            try:
                b = dataclasses.replace(_bwrap_backend(need_world=root), seccomp=program)
                why = _probe(b)
                if why and "proc" in why:
                    # A container runtime masks parts of /proc (procMount: Default), and the kernel then
                    # refuses a new procfs in a user namespace. The runner needs none: go without.
                    b = dataclasses.replace(b, proc=False)
                    why = _probe(b)
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                why = str(e)
            if why is None:
                log.info(
                    "sandbox: bubblewrap (%s), seccomp filter: %s, uid per sandbox: %s",
                    b.bwrap,
                    b.seccomp is not None,
                    b.switch_uid,
                )
                _cache[requested] = b
                return b
            if requested == BWRAP:
                raise SandboxUnavailable(
                    f"KUBERL_SANDBOX=bwrap, but bubblewrap cannot start here ({why}); code rewards run only "
                    "isolated: on GKE give the pods sandbox.enabled=true in the chart's values (docs/cluster.md), "
                    "elsewhere allow unprivileged user namespaces"
                )
            raise SandboxUnavailable(
                f"sandbox: bubblewrap cannot start here ({why}), and model code runs isolated or not at all: install "
                "bubblewrap and allow unprivileged user namespaces, or set "
                f"KUBERL_SANDBOX={UNISOLATED} to run it with rlimits only (it can read world-readable files and "
                "write world-writable directories)"
            )
        reason = f"KUBERL_SANDBOX={UNISOLATED}"
        netns = netns_mode(root)
        if netns is None:
            raise SandboxUnavailable(
                f"sandbox: {reason}, but the rlimit fallback cannot unshare a network namespace here, so "
                "code from the model would keep this machine's network: install bubblewrap and allow "
                "user namespaces (KUBERL_SANDBOX=bwrap), or run the trainer as root with CAP_SYS_ADMIN"
            )
        b = Backend(
            RLIMIT,
            _find_python(need_world=root),
            switch_uid=root,
            netns=netns,
            reason=reason,
            seccomp=_filter(required=False),
        )
        if root:
            isolation = (
                "each sandbox as its own unprivileged uid, no network; it can read world-readable files"
            )
        else:
            isolation = (
                "as the trainer's own uid, no network: sandboxed code can read the trainer's files "
                "and signal its processes"
            )
        log.warning("sandbox: %s; running code with resource limits only, %s", reason, isolation)
        _cache[requested] = b
        return b
