"""Rendezvous stores of torch.distributed that listen on one address only.

`torch.distributed.TCPStore(host, port, is_master=True)` listens on every interface of the machine, whatever `host`
says (it is only the address the clients dial), and answers anyone who connects, without authentication. A
store made here listens on `host` alone: rank 0 binds the socket itself and hands it to the store
(`master_listen_fd`), so the trainer's process group (Megatron) and the weight-update group are reachable only at the
address their ranks were given (loopback when they share a node).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str) -> int:
    """A TCP port free on `host` now (a later bind of it may still lose it to another process)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening_store(host: str, port: int = 0, *, world_size: int | None = None, timeout_s: float = 600.0) -> Any:
    """Rank 0's TCPStore, listening on `host:port` only (`port` 0: one the kernel picks as it binds; the store's
    `port` says which). Raises OSError when the port is taken."""
    from torch.distributed import TCPStore

    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(1024)
        bound = int(sock.getsockname()[1])
        store = TCPStore(host, bound, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now (and closes it when it goes)
    return store


def client_store(host: str, port: int, *, world_size: int | None = None, timeout_s: float = 600.0) -> Any:
    """A TCPStore client of the store at `host:port` (another rank's)."""
    from torch.distributed import TCPStore

    return TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=timeout_s))
