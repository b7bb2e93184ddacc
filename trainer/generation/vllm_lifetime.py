"""vLLM's processes die with the process that owns the engine, even a killed one.

A tensor-parallel engine runs its workers in processes of its own (vLLM's multiproc executor spawns them
from the thread that builds ``vllm.LLM``). vLLM's own parent-death handling is a pipe per worker
(``MultiprocExecutor``'s death pipe): when the owner exits, a thread in the worker shuts the worker's
message queues, which ends a worker waiting for its next call. A worker inside a call does not get back
to its queues: one blocked in a weight broadcast whose sender is gone (a gloo wait, a CUDA stream
synchronize after an NCCL collective) stays, holding its share of the GPU until the pod goes, and
``__del__`` or ``atexit`` in the owner never run when Ray SIGKILLs the actor.

So every process vLLM spawns from the owner is tied to it by the kernel: before the engine is built the
owner notes its pid in the environment (:func:`mark_owner`), which vLLM's spawned processes inherit, and
kuberl's vLLM plugin (the ``vllm.general_plugins`` entry point, which vLLM runs at the start of each of its
processes, :func:`trainer.generation.refit.vllm_nccl.register`) calls :func:`follow_owner` there: in a
process whose parent is the noted owner it asks Linux for SIGKILL when the parent goes
(``PR_SET_PDEATHSIG``), then checks the parent is still there (it may have gone before the request). A
process vLLM forks instead of spawning (its default outside Ray actors and without CUDA) does not load
plugins again: the owner's fork hook (``os.register_at_fork``) makes the same call in it.
Linux sends that signal when the *thread* that spawned the process ends, so the owner notes whether it
builds the engine on its main thread (whose end is the process's); built on another thread, the child
polls its parent instead, once a second, from a thread of its own. Processes further down (compile
workers of a worker) have parents of their own and are left to them.

The engine's files go with it too. vLLM puts its message queues' ZeroMQ sockets (two per queue: a
tensor-parallel engine has several) and its ``torch.distributed`` file store in the temporary directory,
and removes neither when its processes are killed, nor the sockets when the engine shuts down; a Ray
node that hosts run after run kept them all. Each engine gets a directory of its own instead
(:func:`private_dir`: only its user may enter it, so no other user reaches its sockets either), which it
removes at shutdown; one whose owner was killed is removed by the next engine that starts on the host
(:func:`sweep`). With each goes the shared memory its tensor-parallel workers left (:func:`remove`). A LoRA
engine's adapter directory, in the host's shared memory, is made and swept the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

# "PID:signal" or "PID:poll": the process that owns the engine, and how its children follow it.
OWNER_ENV = "KUBERL_VLLM_OWNER"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# An engine's own directories: <prefix><pid namespace>-<owner pid>-<random>, in the temporary directory
# (PRIVATE_PREFIX) and, for a LoRA engine's adapter, in the host's shared memory (ADAPTER_PREFIX).
PRIVATE_PREFIX = "kuberl-vllm-"
ADAPTER_PREFIX = "kuberl-adapter-"
SHARED_MEMORY = "/dev/shm"
STORES_NOTE = "kuberl-stores"  # in an engine's directory: its file stores' names (note_stores)
POLL_S = 1.0
_hooked = False  # this process has registered its fork hooks
_forking_how = "poll"  # set in the parent just before a fork, read in the child (a copy of its memory)
_following: str | None = None  # how this process follows its owner, once it does


def mark_owner() -> None:
    """In the process that builds a vLLM engine, before it does: the processes vLLM spawns from here die
    with this process (module docstring)."""
    global _hooked
    how = "signal" if threading.current_thread() is threading.main_thread() else "poll"
    os.environ[OWNER_ENV] = f"{os.getpid()}:{how}"
    if not _hooked:
        os.register_at_fork(before=_before_fork, after_in_child=lambda: follow_owner(_forking_how))
        _hooked = True


def _before_fork() -> None:
    """In the owner, on the thread about to fork (in the child every thread but that one is gone, and
    ``threading`` calls it the main thread): whether the child may follow by signal."""
    global _forking_how
    _forking_how = "signal" if threading.current_thread() is threading.main_thread() else "poll"


def follow_owner(how: str | None = None) -> str | None:
    """In a process vLLM starts: if its parent is the engine's owner, die with it. Returns how ("signal"
    or "poll"), or None when this process is not one the owner spawned (the owner itself, a grandchild).
    ``how``: forced (a forked child); else as the owner noted. Idempotent."""
    global _following
    pid, _, noted = os.environ.get(OWNER_ENV, "").partition(":")
    how = how or noted
    parent = os.getppid()
    if _following or not pid.isdigit() or int(pid) != parent:
        return _following
    if how == "signal" and sys.platform.startswith("linux") and _death_signal(signal.SIGKILL):
        _following = "signal"
        if os.getppid() != parent:  # the owner went before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)
        return _following
    threading.Thread(target=_watch, args=(parent,), name="kuberl-owner-watch", daemon=True).start()
    _following = "poll"
    return _following


def _death_signal(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    """Orphaned, a process is re-parented (to init or a subreaper): its parent's pid changes."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``): pids mean something only inside it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def sweep(root: str | None = None, prefix: str = PRIVATE_PREFIX) -> list[str]:
    """Remove the engine directories ``prefix*`` in ``root`` (the temporary directory) whose owner is gone:
    made by this user, in this pid namespace (a pid from another one could name a live process here), by a
    pid no process has now. A reused pid keeps a directory, never the other way round. Returns the paths
    removed."""
    root = root or tempfile.gettempdir()
    name = re.compile(re.escape(prefix) + r"(\d+)-(\d+)-")
    ns, uid, removed = _pid_namespace(), os.getuid(), []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            m = name.match(entry.name)
            if m is None or int(m.group(1)) != ns or _alive(int(m.group(2))):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == uid:
                    remove(entry.path)
                    removed.append(entry.path)
    return removed


def note_stores(private: str) -> None:
    """Once the engine is built: note, in its directory, the names of the ``torch.distributed`` file stores
    its workers joined (``vllm_dist_*``). A worker that destroys its group removes the store's file, and
    one that then ends without its exit handlers (killed by its executor at shutdown, seen on a loaded
    machine) leaves its shared memory, which is named after the store (:func:`remove`)."""
    stores = sorted(name for name in os.listdir(private) if name.startswith("vllm_dist_"))
    if stores:
        with open(os.path.join(private, STORES_NOTE), "w") as f:
            f.write("\n".join(stores) + "\n")


def remove(private: str) -> None:
    """Remove an engine's directory (at its shutdown, or its owner gone) and the shared memory its
    tensor-parallel workers left: a CPU engine's workers share memory through
    ``/dev/shm/<store>-...-cpushm_<rank>`` (vLLM's CPU communicator, named by the engine's file store
    ``<store>``), megabytes of the host's memory each, which vLLM's workers unlink only in their exit
    handlers: a killed engine's, or a killed worker's, stay."""
    with contextlib.suppress(OSError):
        _remove_shared_memory(private, os.getuid())
    shutil.rmtree(private, ignore_errors=True)


def _remove_shared_memory(private: str, uid: int) -> None:
    stores = {name for name in os.listdir(private) if name.startswith("vllm_dist_")}
    with contextlib.suppress(OSError), open(os.path.join(private, STORES_NOTE)) as f:
        stores.update(line.strip() for line in f if line.strip().startswith("vllm_dist_"))
    if not stores or not os.path.isdir(SHARED_MEMORY):
        return
    with os.scandir(SHARED_MEMORY) as entries:
        for entry in entries:
            if (
                any(entry.name.startswith(f"{store}-") for store in stores)
                and "-cpushm" in entry.name
                and entry.stat(follow_symlinks=False).st_uid == uid
            ):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def private_dir(root: str | None = None, prefix: str = PRIVATE_PREFIX) -> str:
    """A fresh directory in ``root`` (the temporary directory) for one engine's files (module docstring),
    after :func:`sweep` there; the engine removes it at shutdown."""
    sweep(root, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{_pid_namespace()}-{os.getpid()}-", dir=root)


@contextlib.contextmanager
def temporary_files_in(path: str) -> Iterator[None]:
    """This process's temporary directory is ``path`` inside (``tempfile.tempdir``): for the engine's build,
    where vLLM names its ``torch.distributed`` file store there (``get_file_store_init_method``)."""
    before = tempfile.tempdir
    tempfile.tempdir = path
    try:
        yield
    finally:
        tempfile.tempdir = before


# The process environment variables an engine points at its own directory (VLLM_RPC_BASE_PATH: its
# sockets; VLLM_CACHE_ROOT: a CPU engine's compile caches).
DIR_VARIABLES = ("VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT")
# The engines of this process that pointed variables at their directories and have not shut down, oldest
# first (each directory with the names it set), and the variables' values from before the first of them.
_live: list[tuple[str, tuple[str, ...]]] = []
_outside: dict[str, str | None] = {}


def enter_environment(private: str, names: tuple[str, ...] = DIR_VARIABLES) -> None:
    """Point ``names`` (of :data:`DIR_VARIABLES`) at the engine directory ``private``, remembering, when no
    other engine of this process holds them, the values they had: :func:`leave_environment` gives them back."""
    if not _live:
        _outside.clear()
        _outside.update({name: os.environ.get(name) for name in DIR_VARIABLES})
    _live.append((private, tuple(names)))
    for name in names:
        os.environ[name] = private


def leave_environment(private: str) -> None:
    """At the engine's shutdown, once its directory is gone: each of :data:`DIR_VARIABLES` that still names it
    points at the newest engine still running that set it, or, with none left, gets the value it had before
    the first engine back (unset if it had none). Left behind, the variables sent what this process starts
    next (a later engine, a ``vllm serve`` it launches, which inherits its environment) into a directory that
    no longer exists: vLLM's first socket bind failed with ``No such file or directory for ipc path``. Engines
    need not stop in the order they started: restoring each one's own "before" would hand the second engine's
    shutdown the first one's removed directory. A variable something else set since is left alone."""
    _live[:] = [entry for entry in _live if entry[0] != private]
    for name in DIR_VARIABLES:
        if os.environ.get(name) != private:
            continue
        holders = [path for path, names in _live if name in names]
        value = holders[-1] if holders else _outside.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
