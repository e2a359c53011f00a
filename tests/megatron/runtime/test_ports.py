"""free_port: a port a local rendezvous can listen on, never one a client could be handed as
its own source port."""

from __future__ import annotations

import random
import socket

from megatron_omnibal.megatron.runtime import ports


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    assert 0 < low <= high
    for seed in range(20):
        port = ports.free_port(rng=random.Random(seed))
        assert ports.LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_taken_port_is_passed_over() -> None:
    low, _ = ports.ephemeral_range()
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        candidates = iter([taken, taken, taken + 1 if taken + 1 < low else taken - 1])

        class Scripted(random.Random):
            def randrange(self, *_args: int) -> int:
                return next(candidates)

        assert ports.free_port(rng=Scripted()) != taken


def test_without_room_below_the_range_the_kernel_picks(monkeypatch) -> None:
    low, high = ports.ephemeral_range()
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, high))
    port = ports.free_port()
    assert low <= port <= high  # the kernel's pick, from its range: none was tried below it
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
