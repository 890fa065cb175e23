"""What the embedded server (`relax.serve.sglang.server`) loads weights from: only the job's own files.

- Directories (`/update_weights_from_disk`, `/load_lora_adapter`): a path is the job's when it lies, once symbolic
  links are resolved, under the model's own directory or one of the directories the server was started with
  (`EmbeddedServer(weight_dirs=...)`, `relax-serve --weight-dir DIR`; a run's servers get the run's private
  directory, where the adapters it sends are written). Anything else is refused (400) before it is read.
- Shared memory (`/update_weights_from_tensor`): a payload names torch segments (`/torch_<pid>_...`); a segment is
  the job's when the process that made it (`<pid>`) is the one that sent the request: it holds the other end of the
  request's TCP connection (read from `/proc/net/tcp` and `/proc/<pid>/fd`, so a client cannot claim another
  process's segments). A request made in this process (`EmbeddedServer.handle` without a connection) may name this
  process's segments only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from relax.serve.sglang.request import RequestError

_peer = threading.local()  # the connection of the request this thread serves: (client address, server address)


class WeightDirs:
    """The directories whose files the server may load (resolved); `check` a requested path against them."""

    def __init__(self, roots: Iterable[str | os.PathLike] = ()):
        self.roots: list[str] = []
        for root in roots:
            self.add(root)

    def add(self, root: str | os.PathLike) -> None:
        real = os.path.realpath(os.path.expanduser(str(root)))
        if real not in self.roots:
            self.roots.append(real)

    def check(self, path: str, what: str) -> Path:
        """`path` resolved, when it lies under one of the roots; else a `RequestError` naming them."""
        real = os.path.realpath(os.path.expanduser(path))
        for root in self.roots:
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return Path(real)
        allowed = ", ".join(self.roots) or "none"
        raise RequestError(f"{what}: {path!r} is not one of this job's directories (allowed: {allowed}); "
                           "relax-serve loads weights only from the model's directory and those given with "
                           "--weight-dir")


@contextlib.contextmanager
def peer(client: tuple | None, server: tuple | None) -> Iterator[None]:
    """Within: the request this thread serves came over the TCP connection `client` -> `server` (None: made in this
    process)."""
    previous = getattr(_peer, "value", None)
    _peer.value = None if client is None or server is None else (client, server)
    try:
        yield
    finally:
        _peer.value = previous


def segment_owner() -> SegmentOwner:
    """Whose shared-memory segments the request this thread serves may name."""
    return SegmentOwner(getattr(_peer, "value", None))


class SegmentOwner:
    """`owner(pid)`: whether process `pid` (the maker of a segment) sent the request."""

    def __init__(self, connection: tuple | None):
        self.connection = connection
        self._inode: int | None | bool = False  # not looked up yet
        self._answers: dict[int, bool] = {}

    def __call__(self, pid: int) -> bool:
        if self.connection is None:
            return pid == os.getpid()
        if pid not in self._answers:
            self._answers[pid] = self._holds(pid)
        return self._answers[pid]

    def describe(self) -> str:
        return "this process" if self.connection is None else "the process that sent the request"

    def _holds(self, pid: int) -> bool:
        if self._inode is False:
            self._inode = connection_inode(*self.connection)
        if self._inode is None:  # not a connection from this host: its segments cannot be mapped here either
            return False
        target = f"socket:[{self._inode}]"
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return True
            except OSError:
                continue
        return False


def _hex_address(host: str, port: int) -> tuple[str, str]:
    """`host:port` as /proc/net/tcp (IPv4) and /proc/net/tcp6 write a socket's address: each 32-bit word of the
    address in this machine's byte order, in hex; the port in hex."""
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
        v6 = b"\0" * 10 + b"\xff\xff" + packed  # how tcp6 writes an IPv4 peer of a dual-stack socket
    except OSError:
        packed = v6 = socket.inet_pton(socket.AF_INET6, host.split("%")[0])

    def words(raw: bytes) -> str:
        return "".join(f"{w:08X}" for w in struct.unpack(f"={len(raw) // 4}I", raw))

    suffix = f":{port:04X}"
    return (words(packed) + suffix if len(packed) == 4 else ""), words(v6) + suffix


def connection_inode(client: tuple, server: tuple) -> int | None:
    """The inode of the client's end of the TCP connection `client` -> `server` when the client is on this host
    (None otherwise): the row of /proc/net/tcp{,6} whose local address is `client` and remote address `server`."""
    local4, local6 = _hex_address(client[0], int(client[1]))
    remote4, remote6 = _hex_address(server[0], int(server[1]))
    for table, local, remote in (("/proc/net/tcp", local4, remote4), ("/proc/net/tcp6", local6, remote6)):
        if not local:
            continue
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[1] == local and fields[2] == remote:
                return int(fields[9])
    return None
