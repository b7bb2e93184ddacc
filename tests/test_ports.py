"""Rendezvous ports (trainer.ports): outside the ephemeral range, where outgoing connections cannot take them."""

from __future__ import annotations

import socket

from trainer import ports


def test_should_pick_a_bindable_port_below_the_ephemeral_range_when_there_is_room() -> None:
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port("127.0.0.1")
        assert ports.FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_should_fall_back_to_the_kernels_choice_when_the_ephemeral_range_starts_low(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.FLOOR + 10)
    port = ports.free_port("127.0.0.1")
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first, last = map(int, f.read().split())
    assert first <= port <= last
