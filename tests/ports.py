"""Ports for tests that must name them before a process binds them (Ray heads, rendezvous stores, nodes)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now: the sockets are held together while picking (one at a time, each closed before
    the next, the kernel may give the same port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
