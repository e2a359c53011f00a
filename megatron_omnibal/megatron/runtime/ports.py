"""A free TCP port for a local rendezvous, chosen below the kernel's ephemeral port range.

Why not `bind(("127.0.0.1", 0))`: that hands out a port from the ephemeral range, the same
range a client's `connect()` takes its own source port from. A client that retries connecting
to a store which is not listening yet can then be given the store's port as its source port,
and Linux completes that as a TCP self-connect: the client talks to itself and the rendezvous
hangs until its timeout. A port below the range is never anyone's source port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below this, well-known and registered services are more likely
TRIES = 200


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on `host` free at the time of the call, outside the ephemeral range where one
    is free there; else one the kernel picks."""
    rng = rng or random.SystemRandom()
    low, _ = ephemeral_range()
    if low - LOWEST >= TRIES:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, low)
            if _bindable(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
