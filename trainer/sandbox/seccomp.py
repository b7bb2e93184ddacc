"""The seccomp filter every sandboxed program runs under: syscalls it has no business making fail with EPERM.

Bubblewrap's namespaces already take most of these away (no capabilities, no host mounts, no host PIDs), but a
kernel bug behind any of them is an escape: the filter closes them before the kernel parses their arguments.
Denied with EPERM, as a program would see on a locked-down judge: tracing and reading other processes
(``ptrace``, ``process_vm_readv/writev``), mounts and namespaces (``mount``, ``umount2``, ``pivot_root``, the new
mount API, ``unshare``, ``setns``, and ``clone`` with any namespace flag), the kernel keyring (``keyctl``,
``add_key``, ``request_key``), ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``, modules and kexec,
``open_by_handle_at``, ``reboot``, swap, ``acct``, clocks and ``syslog``. ``clone3`` gets ENOSYS instead: its
flags sit behind a pointer no filter can read, and ENOSYS makes glibc fall back to ``clone``, which is checked.
Everything else is allowed; a syscall of another ABI (i386 ``int 0x80``, x32) kills the process, as libseccomp
does by default for architectures the filter was not built for.

Built with libseccomp (``libseccomp.so.2``, through ctypes: no Python binding needed) and exported as classic
BPF once per process; bubblewrap loads it with ``--seccomp FD`` after its own namespace set-up, so it binds the
runner and every program, not bubblewrap. The ``rlimit`` fallback's runner loads the same bytes into each test
child itself (``_runner.py``). :func:`bpf` raises :class:`SeccompUnavailable` (one line) where libseccomp is
missing; ``backends`` then refuses bubblewrap unless ``KUBERL_SANDBOX_WITHOUT_SECCOMP=1`` says to go without.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading

ALLOW = 0x7FFF0000  # SCMP_ACT_ALLOW
CMP_MASKED_EQ = 7  # SCMP_CMP_MASKED_EQ: (arg & datum_a) == datum_b

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "iopl",
    "ioperm",
    "vhangup",
    "lookup_dcookie",
)
# clone's flags (its first argument on every architecture but s390) that make a namespace; CLONE_NEWTIME
# (0x80) exists only for unshare and clone3, and in clone's flags those bits are the exit signal.
CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
LIBRARY = "libseccomp.so.2"


class SeccompUnavailable(RuntimeError):
    """No filter can be built here (libseccomp missing or refusing): one line saying so."""


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def _load() -> ctypes.CDLL:
    for name in (LIBRARY, ctypes.util.find_library("seccomp")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        ]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        return lib
    raise SeccompUnavailable(
        f"{LIBRARY} (libseccomp) is not installed, so no seccomp filter can be built (apt-get install libseccomp2)"
    )


def _build() -> bytes:
    lib = _load()
    ctx = lib.seccomp_init(ALLOW)
    if not ctx:
        raise SeccompUnavailable("libseccomp: seccomp_init failed")
    try:
        eperm = _errno_action(errno.EPERM)

        def add(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a syscall of this architecture (iopl on arm64, ...): nothing to deny
                return
            array = (_ArgCmp * max(1, len(cmps)))(*(_ArgCmp(*c) for c in cmps))
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
            if rc < 0:
                raise SeccompUnavailable(f"libseccomp: cannot add the rule for {name} ({os.strerror(-rc)})")

        for name in DENIED:
            add(eperm, name)
        for flag in CLONE_NAMESPACE_FLAGS:
            add(eperm, "clone", (0, CMP_MASKED_EQ, flag, flag))
        add(_errno_action(errno.ENOSYS), "clone3")
        fd = os.memfd_create("kuberl-seccomp")
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise SeccompUnavailable(f"libseccomp: cannot export the filter ({os.strerror(-rc)})")
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    program = b"".join(chunks)
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(program)} bytes, not a BPF program")
    return program


_lock = threading.Lock()
_cached: bytes | None = None


def bpf() -> bytes:
    """The filter as a classic BPF program (8 bytes an instruction), built once per process."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _build()
        return _cached


def memfd(program: bytes) -> int:
    """A fresh file descriptor holding ``program`` at offset 0, for ``bwrap --seccomp FD`` (the caller closes it;
    close-on-exec, so only a child it is passed to explicitly sees it)."""
    fd = os.memfd_create("kuberl-seccomp")
    view = memoryview(program)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
