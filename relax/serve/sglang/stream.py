"""A streamed `/generate` answer (`stream: true`), as SGLang's http_server writes it: server-sent events
(`text/event-stream`), each `data: <json>\\n\\n`, then `data: [DONE]\\n\\n`; an error on the way is one more event,
before [DONE]: the body the same request unstreamed is answered with, in OpenAI's shape (`{"error": {"message", "type",
"param", "code"}}`, a superset of SGLang's `{"error": {"message"}}`), with that answer's HTTP status in it (`status`:
the stream's own said 200 before the error; `error_event`). Written with chunked transfer encoding, so the
connection stays open for the next request.

The events (`answer_events`): each time a sample has drawn new tokens, its answer so far (text and output ids
cumulative, SGLang's default without --stream-output; `finish_reason` null), and once it has ended its final answer,
the one the request without `stream` would give. With `return_logprob`, each event carries the log-probs of the
tokens so far, as SGLang's do (`RequestCodec.progress`), with `top_logprobs_num` their alternatives too. With
several samples (inputs, n > 1) each event carries `index`, the sample's place in the list answer. An abort or a
pause acts on a streamed request as on any other: its samples end with the abort's finish_reason (their last event),
or wait while paused. A client that leaves aborts its samples.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, Optional

from relax.serve.openai.protocol import APIError
from relax.serve.sglang.request import NotReady, Request, RequestError, Row
from relax.serve.sglang.scheduler import Scheduler


def failure(exc: BaseException) -> APIError:
    """The error of a /generate the engine could not serve, in OpenAI's shape, the one its answer and its stream give:
    a request it cannot take a 400 (RequestError), a server not ready a 503 (NotReady), anything else the server's
    own failure, a 500."""
    if isinstance(exc, NotReady):
        return APIError(str(exc), status=503, kind="server_error")
    if isinstance(exc, RequestError):
        return APIError(str(exc))
    return APIError(f"{type(exc).__name__}: {exc}", status=500, kind="server_error")


def request_error(request: Request) -> APIError:
    """A failed request's error in OpenAI's shape, the one every path gives (`/generate`'s answer and its stream, the
    OpenAI service's call and its stream): its HTTP status and the code saying what it is (a grammar's dead end: 400,
    grammar_dead_end, which the OpenAI routes answer naming the field that asked for the grammar), the server's own
    failures server_error."""
    return APIError(request.error, status=request.error_status, code=request.error_code,
                    kind="invalid_request_error" if request.error_status < 500 else "server_error")


def error_event(error: APIError) -> dict:
    """A stream's error event: `error`'s body, the one an unstreamed answer of the same failure carries, with its
    HTTP status (`status`), which the stream's own status line (200, sent before the error) cannot say."""
    body = error.body()
    body["error"]["status"] = error.status
    return body


def event_error(event: dict) -> APIError:
    """The APIError of a stream's error event (`error_event`'s), built from the event's own fields, so that the
    error raised for it is the one the stream's client reads."""
    error = event["error"]
    return APIError(error["message"], status=int(error.get("status", 500)), param=error.get("param"),
                    kind=error.get("type", "server_error"), code=error.get("code"))


class Events:
    """An answer sent as server-sent events, one per dict `events` yields."""

    def __init__(self, events: Iterator[dict]):
        self.events = events


def write_events(handler: BaseHTTPRequestHandler, answer: Events) -> None:
    """`answer`'s events to `handler`'s client as they come, then [DONE]."""
    events = answer.events
    try:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for event in events:
            _chunk(handler, b"data: " + json.dumps(event).encode() + b"\n\n")
        _chunk(handler, b"data: [DONE]\n\n")
        handler.wfile.write(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):  # the client left
        handler.close_connection = True
    finally:
        if hasattr(events, "close"):
            events.close()  # a generator left early: its cleanup runs now


def _chunk(handler: BaseHTTPRequestHandler, data: bytes) -> None:
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    handler.wfile.flush()


# a stream's event of a row that goes on: (row, its tokens so far, their log-probs, their alternatives or None)
Progress = Callable[[Row, list[int], list[float], Optional[list]], dict]


def answer_events(request: Request, scheduler: Scheduler, final: Callable[[Row], dict],
                  progress: Progress) -> Iterator[dict]:
    """The events of a submitted request: `progress(row, tokens, logps, top)` as a row draws tokens, `final(row)`
    once it ended. Closed early (the client left), it aborts the rows still running."""
    seen = _Seen(request, final, progress)
    try:
        while True:
            request.progress.clear()  # a change from now on sets it again: none is missed
            if scheduler.stopping:
                scheduler.abort_where(lambda r: r.request is request, "the server is shutting down")
            for i, (tokens, logps, top, finish) in enumerate(scheduler.progress(request)):
                failed = request.error is not None
                # the tokens a row drew before an error are sent first, whenever the stream reads them (a grammar's
                # dead end: the answer so far, then the error); the row's end is the error's
                event = seen.event(i, tokens, logps, top, None if failed else finish)
                if event is not None:
                    yield event
                if failed:
                    yield error_event(request_error(request))
                    return
            if all(seen.ended):
                return
            request.progress.wait(1.0)
    except Exception as exc:  # e.g. the log-probs of an ended row: the stream ends with the error
        yield error_event(failure(exc))
    finally:
        abort_rest(request, scheduler)


def abort_rest(request: Request, scheduler: Scheduler, message: str = "the client disconnected") -> None:
    """Abort the rows of `request` still running that no abort has reached yet (the client's departure may have
    been noticed already: `relax.serve.http.Departures`)."""
    with scheduler.cv:  # one look and abort at a time (the scheduler's lock is reentrant)
        if any(r.finish is None and r.abort is None for r in request.rows):
            scheduler.abort_where(lambda r: r.request is request, message)


class _Seen:
    """What a stream has sent of each row of its request: tokens, and whether its final answer."""

    def __init__(self, request: Request, final: Callable[[Row], dict], progress: Progress):
        self.request, self.final, self.progress = request, final, progress
        self.sent = [0] * len(request.rows)
        self.ended = [False] * len(request.rows)

    def event(self, i: int, tokens: list[int], logps: list[float], top: Optional[list],
              finish: Optional[dict]) -> Optional[dict]:
        """Row i's next event, given its tokens so far, their log-probs, their alternatives (None: not asked) and
        finish_reason (None: nothing new)."""
        row = self.request.rows[i]
        if self.ended[i]:
            return None
        if finish is not None:
            self.ended[i] = True
            return self._indexed(self.final(row), i)
        if len(tokens) > self.sent[i]:
            self.sent[i] = len(tokens)
            return self._indexed(self.progress(row, tokens, logps, top), i)
        return None

    def _indexed(self, answer: dict[str, Any], i: int) -> dict[str, Any]:
        if not self.request.single:
            answer["index"] = i
        return answer
