"""An `OpenAIService` over HTTP outside any training session, as relax-serve answers it (its chat, completion and
Responses routes, no key), for tests that drive a scripted engine with the official `openai` client."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from relax.serve.http import Server
from relax.serve.openai.gateway import JSONHandler, read_json
from relax.serve.openai.protocol import APIError
from relax.serve.openai.responses import Responses
from relax.serve.openai.service import OpenAIService


class App:
    """The routes of `service` (and a `Responses` over it) for `relax.serve.http`'s JSON handler."""

    def __init__(self, service: OpenAIService):
        self.service, self.responses = service, Responses(service)

    def client_of(self, sock: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def methods(path: str) -> tuple[str, ...]:
        return ("POST",)

    def handle(self, method: str, path: str, raw: bytes, headers: Any) -> tuple[int, Any]:
        route = {"/v1/chat/completions": self.service.chat, "/v1/completions": self.service.completion,
                 "/v1/responses": self.responses.create}.get(urlsplit(path).path.rstrip("/"))
        try:
            if route is None:
                raise APIError(f"no endpoint {method} {path}", status=404)
            return route(read_json(raw))
        except APIError as exc:
            return exc.status, exc.body()


@contextlib.contextmanager
def plain_server(service: OpenAIService) -> Iterator[str]:
    """`service` served on a loopback port: its base URL (…/v1); shut down after."""
    httpd = Server(("127.0.0.1", 0), JSONHandler)
    httpd.app = App(service)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
