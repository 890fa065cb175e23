"""Ports for tests that must name them before a process binds them (Ray heads, rendezvous stores, nodes), and the two
ends of an endpoint check: a port where nothing listens, one where a socket does (and one where a real gRPC server
answers, as a Ray head's does)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now: the sockets are held together while picking (one at a time, each closed before
    the next, the kernel may give the same port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def closed_port() -> int:
    """A port where nothing listens: bound by this process, then closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def listening_port() -> Iterator[int]:
    """A port where a socket listens while the context lasts (it never accepts: the kernel completes a connection to
    it all the same, which is what an endpoint check asks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@contextlib.contextmanager
def grpc_port() -> Iterator[int]:
    """A port where a real gRPC server (grpcio, which Ray depends on) listens while the context lasts: what the
    check of a Ray address asks for is a gRPC server's answer, as a Ray head's GCS and Ray Client server give."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)
