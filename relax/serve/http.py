"""Relax's HTTP servers (relax-serve, the training gateway): the server class, and how they write an answer (JSON,
plain text, or a stream of server-sent events, always with its length: keep-alive connections)."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Server(ThreadingHTTPServer):
    """A thread per connection, a deep accept queue (a rollout batch arrives at once), and no traceback when a client
    goes away mid-request (an agent killed at its time limit, a client that timed out): that is the client's end."""

    daemon_threads = True
    request_queue_size = 1024
    app: Any

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class EventStream(bytes):
    """A body of server-sent events (answered as text/event-stream)."""


def write_answer(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """`payload` (JSON-able, bytes or an `EventStream`) as the answer to `handler`'s request."""
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
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):  # the client left
        handler.close_connection = True
