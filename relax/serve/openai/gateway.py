"""The training gateway: an OpenAI-compatible HTTP server in front of the rollout engines, one session per agent run.

An agent run gets the gateway's `base_url` (`http://host:port/v1`) and its session's key as its API key; every call
it makes with that key (`Authorization: Bearer <key>`, as the `openai` client sends it) is recorded in its session
(`relax.serve.openai.sessions`), and a request without a known key is refused (401). Routes: `GET /v1/models`, `GET
/v1/models/{model}` (OpenAI's 404 model_not_found for another id), `POST /v1/chat/completions`, `POST
/v1/completions` (see `relax.serve.openai.protocol` for what they accept), `POST /v1/responses`
(`relax.serve.openai.responses`: recorded as the chat call it translates to), and `POST /v1/relax/reward` {"reward":
x}, which adds x to the reward of the session's latest call. Errors have OpenAI's shape; another method on a route's
path is a 405 with Allow, as relax-serve answers it. The gateway binds to loopback unless configured otherwise
(`rollout.sglang.host`); each session's key is a fresh random secret, so a reachable gateway still serves only the
runs it started. A call whose agent leaves before its answer (killed at `data.agent_timeout_s`, a client that timed
out) has its generation aborted on the engines (`WatchedSend`), as relax-serve aborts its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from relax.serve.http import (
    BodyTooLarge,
    Departures,
    Handler,
    Server,
    read_body,
    refuse,
    url_host,
    write_answer,
)
from relax.serve.openai.protocol import APIError
from relax.serve.openai.responses import Responses
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import Limits, Session

logger = logging.getLogger(__name__)


class JSONHandler(Handler):
    """Reads a request (with its headers) and writes the app's (status, JSON / bytes / event stream) answer."""

    server_version = "relax-openai"

    def _dispatch(self, method: str) -> None:
        try:
            raw = read_body(self)  # at most MAX_BODY_BYTES: a larger body is refused before it is read
        except BodyTooLarge as exc:
            refuse(self, 413, APIError(str(exc), status=413).body())
            return
        except (OSError, ValueError):
            self.close_connection = True
            return
        path = urlsplit(self.path).path
        with self.server.app.client_of(self.connection):  # its generation is aborted if the client leaves
            status, payload = self.server.app.handle(method, path, raw, self.headers)
        if status == 405:
            self.extra_headers = [("Allow", ", ".join(self.server.app.methods(path)))]
        write_answer(self, status, payload)


def read_json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"the body is not JSON: {exc}") from None


class WatchedSend:
    """The `send` of a gateway's service (`OpenAIService`): `send` with a fresh `rid` on each /generate payload, and
    while they are in flight, the connection of the HTTP request they serve watched (`Departures`): if its client
    leaves, `abort(rids)` asks the engines to stop them (SGLang's /abort_request), so they do not generate to the end
    for nobody, holding up the batch's other agents and the next weight update. Their answers come back aborted,
    which fails the call (a 503 that nobody reads): it is not recorded in the session, as the agent never saw it."""

    def __init__(self, send: Callable[[list[dict]], list[dict]], abort: Callable[[list[str]], None]):
        self._send, self.abort = send, abort
        self.departures = Departures("relax-gateway-departures")
        self._client = threading.local()  # the connection of the request this handler thread serves

    @contextlib.contextmanager
    def client(self, sock: socket.socket) -> Iterator[None]:
        """Within: what this thread sends serves a request that came over `sock`."""
        previous = getattr(self._client, "sock", None)
        self._client.sock = sock
        try:
            yield
        finally:
            self._client.sock = previous

    def __call__(self, payloads: list[dict]) -> list[dict]:
        sock = getattr(self._client, "sock", None)
        if sock is None:  # sent from this process, not for an HTTP request
            return self._send(payloads)
        rids = [f"relax-gateway-{secrets.token_hex(8)}" for _ in payloads]
        key = object()
        self.departures.watch(sock, key, abort=lambda: self.abort(rids))
        try:
            return self._send([{**p, "rid": rid} for p, rid in zip(payloads, rids, strict=True)])
        finally:
            self.departures.forget([key])

    def close(self) -> None:
        self.departures.close()


class Gateway:
    """Sessions behind one HTTP server; `service` generates (`relax.serve.openai.service.OpenAIService`), through
    `watched` when given (the service's `send`: a call whose client leaves is aborted)."""

    def __init__(self, service: OpenAIService, *, host: str = "127.0.0.1", port: int = 0,
                 watched: Optional[WatchedSend] = None):
        self.service, self.host, self.port, self.watched = service, host, int(port), watched
        self.responses = Responses(service)  # /v1/responses: chat calls of the session, kept per session
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._httpd: Optional[Server] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> Gateway:
        httpd = Server((self.host, self.port), JSONHandler)
        httpd.app = self
        self._httpd, self.port = httpd, int(httpd.server_address[1])
        self._thread = threading.Thread(target=httpd.serve_forever, name="relax-gateway", daemon=True)
        self._thread.start()
        return self

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as `base_url`."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{url_host(host)}:{self.port}/v1"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self.watched is not None:
            self.watched.close()

    def client_of(self, sock: socket.socket) -> contextlib.AbstractContextManager:
        """Within: the request being handled came over `sock` (its generation is aborted if the client leaves)."""
        return contextlib.nullcontext() if self.watched is None else self.watched.client(sock)

    def open(self, sample_id: int, limits: Limits) -> Session:
        session = Session("relax-" + secrets.token_urlsafe(24), sample_id, limits)
        with self._lock:
            self._sessions[session.key] = session
        return session

    def close_session(self, session: Session, reason: str) -> None:
        """End `session`: later calls with its key are refused as calls of an ended session (403)."""
        session.end(reason)

    def forget(self, sessions: list[Session]) -> None:
        """Drop ended sessions (their keys become unknown: 401)."""
        with self._lock:
            for s in sessions:
                self._sessions.pop(s.key, None)

    # ------------------------------------------------------------------------------------------------- HTTP
    def handle(self, method: str, path: str, raw: bytes, headers: Any) -> tuple[int, Any]:
        try:
            route = self._route(path)
            if route is None:
                raise APIError(f"no endpoint {method} {path}", status=404, code="not_found")
            if method not in self.methods(path):  # before the key, as relax-serve answers it
                raise APIError(f"{method} is not allowed on {path}: use {' or '.join(self.methods(path))}",
                               status=405, code="method_not_allowed")
            session = self._session(headers)
            return route(read_json(raw), session)
        except APIError as exc:
            return exc.status, exc.body()
        except Exception as exc:  # the engines failed: the agent sees a server error, the log says why
            logger.exception("%s %s failed", method, path)
            return 500, APIError(f"{type(exc).__name__}: {exc}", status=500, kind="server_error").body()

    def _route(self, path: str) -> Optional[Any]:
        path = path.rstrip("/")
        if path.startswith("/v1/models/"):  # GET /v1/models/{model}: the served model's object
            model = unquote(path[len("/v1/models/"):])
            return lambda body, session: (200, self.service.model_card(model))
        return {"/v1/models": self._models, "/v1/chat/completions": self._chat, "/v1/completions": self._completion,
                "/v1/responses": self.responses.create, "/v1/relax/reward": self._reward}.get(path)

    @staticmethod
    def methods(path: str) -> tuple[str, ...]:
        """The HTTP methods the route of `path` takes (any other: 405 with Allow)."""
        path = path.rstrip("/")
        return ("GET",) if path == "/v1/models" or path.startswith("/v1/models/") else ("POST",)

    def _session(self, headers: Any) -> Session:
        auth = headers.get("Authorization") or ""
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise APIError("unknown API key: each agent run has its own session key (the api_key it was given)",
                           status=401, kind="authentication_error", code="invalid_api_key")
        return session

    def _models(self, body: Any, session: Session) -> tuple[int, Any]:
        return 200, self.service.models()

    def _chat(self, body: Any, session: Session) -> tuple[int, Any]:
        return self.service.chat(body, session)

    def _completion(self, body: Any, session: Session) -> tuple[int, Any]:
        return self.service.completion(body, session)

    def _reward(self, body: Any, session: Session) -> tuple[int, Any]:
        value = body.get("reward") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise APIError(f"reward: {value!r} must be a finite number", param="reward")
        session.add_reward(float(value))
        return 200, {"object": "relax.reward", "reward": float(value)}
