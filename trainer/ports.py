"""A TCP port for a rendezvous (a process group's store), chosen where nothing else takes it first.

A port from ``bind(("", 0))`` comes from the kernel's ephemeral range, the same range every outgoing
connection on the host draws its local port from: between choosing the port and binding it (a
moment, or the seconds a peer takes to start), any connection of any process (Ray's gRPC clients,
gloo's pairs) may take it, and the store fails with EADDRINUSE. That happened in a suite run on a
busy 2-core machine. So the port is drawn at random between Ray's worker ports (10002-19999 by
default) and the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where only another
explicit ``bind`` could collide; ``bind(0)`` is the fallback where that gap is missing.
"""

from __future__ import annotations

import random
import socket

FLOOR = 20000  # above Ray's default worker ports (--min-worker-port 10002, --max-worker-port 19999)
_RANDOM = random.SystemRandom()  # not the seeded `random` of a run: two seeded processes would collide


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "") -> int:
    """A port free on ``host`` right now, outside the ephemeral range where possible."""
    low = ephemeral_low()
    if low - FLOOR >= 1000:
        for _ in range(64):
            port = _RANDOM.randrange(FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
