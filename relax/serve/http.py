"""Relax's HTTP servers (relax-serve, the training gateway): the server class, how they read a request's body (at most
`MAX_BODY_BYTES`), how they write an answer (JSON, plain text, or a stream of server-sent events, always with its
length: keep-alive connections), and how they notice a client that left before its answer (`Departures`)."""

from __future__ import annotations

import ipaddress
import json
import logging
import select
import socket
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

logger = logging.getLogger(__name__)


def _addresses(host: str) -> list[str]:
    """The addresses `host` (a literal or a name) stands for ([] when it does not resolve)."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except (socket.gaierror, UnicodeError):
        return []


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only: every address it stands for is a
    loopback one (127.0.0.0/8, ::1; names such as `localhost` or `ip6-localhost` as this machine resolves them)."""
    found = _addresses(host)
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def url_host(host: str) -> str:
    """`host` as it goes in a URL: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Server(ThreadingHTTPServer):
    """A thread per connection, a deep accept queue (a rollout batch arrives at once), and no traceback when a client
    goes away mid-request (an agent killed at its time limit, a client that timed out): that is the client's end.
    Binds IPv6 addresses too (`::1`, `::`, a name that resolves to IPv6 only)."""

    daemon_threads = True
    request_queue_size = 1024
    app: Any

    def __init__(self, address: tuple[str, int], handler: Any):
        found = _addresses(address[0])
        if found and all(":" in a for a in found):  # IPv6 only: an AF_INET socket cannot bind it
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


# The largest request body a server reads (Content-Length, or the sum of its chunks): a rollout batch of long prompts
# is tens of MiB; weights never travel in a body (shared-memory handles, a process group, or a directory).
MAX_BODY_BYTES = 256 * 2**20


class Handler(BaseHTTPRequestHandler):
    """A request handler that hands every method to `_dispatch(method)` (a method no route takes is the app's to
    answer, 405 on a known path, rather than http.server's 501) and sends `extra_headers` (405's Allow) with the
    next answer only."""

    protocol_version = "HTTP/1.1"  # keep-alive: every answer carries Content-Length (a stream: chunked)
    server: Server

    def _dispatch(self, method: str) -> None:
        raise NotImplementedError

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def end_headers(self) -> None:
        for name, value in getattr(self, "extra_headers", ()):
            self.send_header(name, value)
        self.extra_headers = []
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's signature)
        logger.debug("%s %s", self.address_string(), format % args)


class BodyTooLarge(ValueError):
    """A request body over the server's limit; answered 413 without reading the rest."""

    def __init__(self, size: int | None, limit: int):
        said = "" if size is None else f" ({size} bytes)"
        super().__init__(f"the request body{said} is larger than this server's limit of {limit} bytes")


def read_body(handler: BaseHTTPRequestHandler, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body of `handler`'s request (Content-Length or chunked), refused with `BodyTooLarge` as soon as it is known
    to exceed `limit` bytes: a Content-Length over it is refused before anything is read. Raises ValueError for a
    malformed length, OSError when the client goes away."""
    if "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower():
        chunks, total = [], 0
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            total += size
            if total > limit:
                raise BodyTooLarge(None, limit)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    if length > limit:
        raise BodyTooLarge(length, limit)
    return handler.rfile.read(length) if length > 0 else b""


def refuse(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """Answer without reading the request's body (a refused key, a body too large), and close the connection: the
    unread body would otherwise be taken for the next request."""
    handler.close_connection = True
    write_answer(handler, status, payload, close=True)


class EventStream(bytes):
    """A body of server-sent events (answered as text/event-stream)."""


class EventSource:
    """A body of server-sent events written as they come (text/event-stream, chunked transfer encoding, so the
    connection stays open for the next request): `blocks` yields each event's bytes. Closed once written, or when
    the client leaves: `blocks`' `close` runs then (a generator's cleanup), and `also`'s (what a generator closed
    before it started would not clean up)."""

    def __init__(self, blocks: Iterator[bytes], also: Any = None):
        self.blocks, self.also = blocks, also

    def close(self) -> None:
        try:
            if hasattr(self.blocks, "close"):
                self.blocks.close()
        finally:
            if hasattr(self.also, "close"):
                self.also.close()


def _write_source(handler: BaseHTTPRequestHandler, status: int, source: EventSource) -> None:
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for block in source.blocks:
            if block:
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):  # the client left
        handler.close_connection = True
    finally:
        source.close()


def write_answer(handler: BaseHTTPRequestHandler, status: int, payload: Any, *, close: bool = False) -> None:
    """`payload` (JSON-able, bytes or an `EventStream`) as the answer to `handler`'s request (`close`: saying that
    the connection ends with it); an `EventSource` is written event by event."""
    if isinstance(payload, EventSource):
        _write_source(handler, status, payload)
        return
    if isinstance(payload, EventStream):
        data, kind = bytes(payload), "text/event-stream"
    elif isinstance(payload, bytes):
        data, kind = payload, "text/plain; charset=utf-8"
    else:
        data, kind = json.dumps(payload).encode(), "application/json"
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        if close:
            handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):  # the client left
        handler.close_connection = True


# How often the connections of requests in generation are looked at: a client that left is noticed within this, and
# its generation ends after the engine's current token.
DISCONNECT_POLL_S = 0.2


def client_left(sock: socket.socket) -> bool:
    """Whether the client of `sock` closed the connection (or reset it): the socket reads end-of-file. A request's
    body has been read by then, so anything else readable (a pipelined next request) is not a departure; neither is a
    socket with nothing to read. Looked at without blocking and without consuming (MSG_PEEK), beside the handler
    thread that owns the socket."""
    try:
        poller = select.poll()  # not select.select: descriptors past 1024 (a server with many clients)
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset by the peer, or closed here (no descriptor)
        return True


class Departures:
    """Work in progress for HTTP requests, and the connections they came over. One thread looks at those connections
    every `DISCONNECT_POLL_S` and calls the `abort` of work whose client left (as SGLang and vLLM abort a request
    whose client disconnected): otherwise it would generate to the end for nobody, delaying everything behind it. A
    request answered at its end (/generate without stream, every OpenAI endpoint) writes nothing until then, so no
    failed write would tell."""

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        # key -> (its connection, its abort, whether it has ended by itself)
        self._watched: dict[Hashable, tuple[socket.socket, Callable[[], None], Callable[[], bool]]] = {}
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def watch(self, sock: socket.socket, key: Hashable, abort: Callable[[], None],
              done: Callable[[], bool] = lambda: False) -> None:
        """Call `abort` if the client of `sock` leaves before `key` is forgotten (or `done`)."""
        with self._cv:
            if self._closed:
                return
            self._watched[key] = (sock, abort, done)
            if self._thread is None:  # started at the first request: a server that never generates has none
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def forget(self, keys: list) -> None:
        """Stop watching `keys` (answered: their connection may go on to the next request, or close)."""
        with self._cv:
            for key in keys:
                self._watched.pop(key, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._watched.clear()
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._watched and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                watched = list(self._watched.items())
            ended = [key for key, (_, _, done) in watched if done()]
            left = [(key, abort) for key, (sock, _, done) in watched if key not in ended and client_left(sock)
                    for abort in (self._abort_of(key),) if abort is not None]
            self.forget(ended + [key for key, _ in left])
            for _, abort in left:
                logger.info("a client left before its answer: its generation is aborted")
                try:
                    abort()
                except Exception:  # the engine's trouble, which its own request will report
                    logger.warning("aborting the generation of a client that left failed", exc_info=True)
            with self._cv:
                self._cv.wait(DISCONNECT_POLL_S)  # close() wakes it at once

    def _abort_of(self, key: Hashable) -> Optional[Callable[[], None]]:
        with self._cv:
            entry = self._watched.get(key)
        return None if entry is None else entry[1]
