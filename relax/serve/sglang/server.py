"""`EmbeddedServer`: Relax's embedded rollout engine behind SGLang's HTTP protocol.

The same client code (Relax's SGLang client, weight sync, the real `sglang-router`) then runs in CI on CPUs against
real HTTP, and the numbers it gets are the engine's: tokens and log-probs exactly as `EmbeddedEngine.generate` makes
them (full-vocabulary log-softmax at the temperature, see `relax.rollout.sampling`).

This module holds the HTTP layer, the route table, the lifecycle (start, model loading, health, shutdown) and the
info, load, generate, pause and abort endpoints. Its parts: `relax.serve.sglang.request` (the /generate body read
into rows, the answers written, `RequestError`, `NotReady`, `row_stream`), `relax.serve.sglang.scheduler`
(batching, aborts, pauses, engine calls, stop strings), `relax.serve.sglang.positions` (log-probs beyond the
sampled tokens'), `relax.serve.sglang.stream` (streamed answers), `relax.serve.sglang.loads` (/get_load,
/v1/loads) and `relax.serve.sglang.weights` (the weight and memory endpoints).

Protocol (SGLang's `entrypoints/http_server.py` and `managers/io_struct.py`; JSON in and out, unknown fields ignored,
a GET's query parameters read as the fields of its body; errors in OpenAI's shape, {"error": {"message", "type",
"param", "code"}}, which SGLang's clients read as its {"error": {"message"}}; the OpenAI API's routes answer 405, with
Allow, to another method than theirs, SGLang's take GET, POST and PUT):
- `GET /health` and `/health_generate`, as on current SGLang (where both run a 1-token generation): 503 while the
  model loads; then 200 once the scheduler produces output after the check began (the check's own token, or any
  decoding step of a running batch), 503 when none comes within `HEALTH_TIMEOUT_S`, and 503 at once while
  generation is paused or the memory released (no output can come). A check waits while weights load. A liveness
  check that does not generate: `/get_model_info`. `GET /server_info`, `/get_server_info` (with the server
  arguments slime compares with its own for an external engine: `relax.serve.sglang.server_args`), `/model_info`,
  `/get_model_info`, `/get_weight_version`, `/v1/models`, `/v1/models/{model}` (OpenAI's 404 for another name).
- A batch (a list of inputs) that gives one rid to two inputs, or different `n` to its inputs, is a 400 (SGLang's
  request validation).
- `GET /get_load`, `/v1/loads`: what runs and waits (`relax.serve.sglang.loads`).
- The OpenAI API: `POST /v1/chat/completions`, `/v1/completions` (`relax.serve.openai.service`), `/v1/responses`
  (`relax.serve.openai.responses`), with the server's key (`api_key`, `relax-serve --api-key`) as
  `Authorization: Bearer`, or without one on loopback only. Their streams are written as the tokens are drawn: the
  service's payloads go to the scheduler as one streamed request (`_stream_openai`), whose events
  `relax.serve.openai.deltas` turns into deltas.
- `POST /generate`: `input_ids` or `text`, `sampling_params` (stop strings included), `return_logprob`,
  `top_logprobs_num`, `token_ids_logprob`, `logprob_start_len`, `rid`, `stream`; what is supported, and how samples
  are seeded: see `relax.serve.sglang.request`; a streamed answer: `relax.serve.sglang.stream`.
- A request whose client leaves (closes or resets its connection) before its answer is aborted, as SGLang and vLLM
  abort it: its rows end after the engine's current token, and the requests behind it run (`Departures`).
- `POST /pause_generation` {"mode": "abort" | "retract" | "in_place"}, `/continue_generation`, `/abort_request`
  {"rid"} or {"abort_all": true}, `/flush_cache`; how they act on running requests: see
  `relax.serve.sglang.scheduler`.
- Weights and memory: `/update_weights_from_tensor`, `/init_weights_update_group`, `/update_weights_from_distributed`,
  `/destroy_weights_update_group`, `/update_weights_from_disk`, `/update_weight_version`,
  `/release_memory_occupation`, `/resume_memory_occupation`: see `relax.serve.sglang.weights`.

The server listens on loopback by default. With a key (`api_key`, `relax-serve --api-key`, as SGLang's `--api-key`),
every endpoint but `/health*` and `/metrics` (`is_open`, as SGLang exempts them) needs it as `Authorization: Bearer`;
without one, a server bound beyond loopback refuses them (403): nobody else can read its information, load weights,
join a weight-update group, pause or abort generation. The key is checked from the request's headers before its body
is read, and a body over `max_body_bytes` is refused (413) before it is read. Weights load only from the job's own
files: `/update_weights_from_disk` and `/load_lora_adapter` from under `weight_dirs`, and `/update_weights_from_tensor`
maps only the shared-memory segments of the process that sent the request (`relax.serve.sglang.guards`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from typing import Any, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

import torch

from relax import progress
from relax.agents.parsers import ToolParserSpecError, get_parser
from relax.config.schema import RelaxConfig
from relax.data.tokenizer import load_tokenizer, resolve_model_path, stop_token_ids
from relax.models.hf import build_model, pick_device, pick_dtype
from relax.models.lora import inject_adapters
from relax.models.moe import is_moe
from relax.models.vision import is_vision_model
from relax.rollout.embedded import EmbeddedEngine
from relax.serve.http import (
    MAX_BODY_BYTES,
    BodyTooLarge,
    Departures,
    Handler,
    Server,
    is_loopback,
    read_body,
    refuse,
    url_host,
    write_answer,
)
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import APIError
from relax.serve.openai.responses import Responses
from relax.serve.openai.service import OpenAIService
from relax.serve.sglang import guards, loads
from relax.serve.sglang.positions import row_extras
from relax.serve.sglang.request import (
    DEFAULT_MAX_NEW_TOKENS,
    NotReady,
    Request,
    RequestCodec,
    RequestError,
    Row,
    row_stream,
)
from relax.serve.sglang.scheduler import PAUSE_MODES, Scheduler
from relax.serve.sglang.server_args import return_routed_experts, server_args
from relax.serve.sglang.stream import (
    Events,
    abort_rest,
    answer_events,
    error_event,
    event_error,
    failure,
    request_error,
    write_events,
)
from relax.serve.sglang.weights import WeightEndpoints

__all__ = ["EmbeddedServer", "NotReady", "RequestError", "row_stream"]

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
# guarded by `EmbeddedServer.api_key`, OpenAI's errors
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# open to anyone who reaches the server, as SGLang's key middleware exempts them: `/health*` and `/metrics`. Every other
# endpoint, information included, needs the key (or a loopback address without one); sglang-router probes
# /server_info and /model_info without its key when a server joins, and takes a refusal there as SGLang's.
OPEN_PREFIXES = ("/health", "/metrics")


def is_open(path: str) -> bool:
    """Whether `path` answers without the server's key."""
    return path.startswith(OPEN_PREFIXES)

# The OpenAI API's methods (its routes answer 405 to any other). SGLang's own endpoints take GET, POST and PUT (read as
# a POST, as SGLang's /generate takes it): its clients use either (sglang-router probes with GET, Relax's clients POST
# some information endpoints).
OPENAI_METHODS = {"/v1/chat/completions": ("POST",), "/v1/completions": ("POST",), "/v1/responses": ("POST",),
                  "/v1/models": ("GET",), "/v1/loads": ("GET",)}
SGLANG_METHODS = ("GET", "POST", "PUT")
MODEL_DIR_PREFIX = "relax-serve-model-"  # the directory of a model not read from an HF directory (model=tiny, .gguf)
MODEL_DIR_LOCK = ".relax-serve.lock"  # held (flock) by the directory's server for its whole life


def make_model_dir(parent: Optional[str] = None) -> tuple[str, int]:
    """A new private (0700) `MODEL_DIR_PREFIX` directory under `parent` (the temp dir by default) and the descriptor
    of its lock file, locked (`fcntl.flock`, exclusive) until it is closed or this process dies, SIGKILL included:
    the kernel drops the lock, so a directory whose lock can be taken has no server left.

    First removes the sibling directories whose servers died without `shutdown()` (the OOM killer, Ray killing an
    engine): those whose lock file exists and can be locked. Directories without one (older versions, or one being
    made: the lock file appears only once locked), others' (another user's) and those that cannot be removed are left.
    """
    parent = parent or tempfile.gettempdir()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        entries = []
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(MODEL_DIR_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            fd = os.open(os.path.join(entry.path, MODEL_DIR_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # no lock file (an older version's, or being made), or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its server lives
            shutil.rmtree(entry.path, ignore_errors=True)  # removed while locked: no other sweep races it
        except OSError:
            pass
        finally:
            os.close(fd)
    path = tempfile.mkdtemp(prefix=MODEL_DIR_PREFIX, dir=parent)
    # locked under another name, then renamed: a sweep never finds the lock file unlocked while its server lives
    pending = os.path.join(path, MODEL_DIR_LOCK + ".new")
    fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, os.path.join(path, MODEL_DIR_LOCK))
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


class _Handler(Handler):
    server_version = "relax-embedded-sglang"

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        refused = app.admit(self.path, self.headers)  # the key before the body: a refused client sends nothing more
        if refused is not None:
            refuse(self, *refused)
            return
        try:
            raw = read_body(self, app.max_body_bytes)
        except BodyTooLarge as exc:
            refuse(self, 413, APIError(f"{exc} (relax-serve --max-body-mb)", status=413).body())
            return
        except (OSError, ValueError):
            self.close_connection = True
            return
        with app.client_of(self):  # generation started for this request ends if its client leaves before the answer
            with app.peer_of(self):
                status, payload = app.handle(method, self.path, raw, self.headers)
            if status == 405:
                self.extra_headers = [("Allow", ", ".join(app.methods(self.path)))]
            if isinstance(payload, Events):
                write_events(self, payload)
            else:
                write_answer(self, status, payload)


class _Aborting:
    """A request's stream events (`relax.serve.sglang.stream.answer_events`) that abort what still runs of the request
    when closed, started or not (a generator closed before it started runs no cleanup); an error event is raised as
    the APIError `_send_openai` raises for it (`relax.serve.sglang.stream.event_error`)."""

    def __init__(self, events: Iterator[dict], request: Request, scheduler: Scheduler):
        self.events, self.request, self.scheduler = events, request, scheduler

    def __iter__(self) -> _Aborting:
        return self

    def __next__(self) -> dict:
        event = next(self.events)
        if "error" in event:  # the error `send` raises for the same request (a dead end's 400, not a 500)
            raise event_error(event)
        return event

    def close(self) -> None:
        try:
            self.events.close()
        finally:
            abort_rest(self.request, self.scheduler)


class EmbeddedServer(WeightEndpoints):
    """An HTTP server speaking SGLang's protocol over one `EmbeddedEngine` built from `cfg` (as the rollout
    worker builds it: same model, seed, device, dtype, tokenizer and stop tokens).

    `start()` binds the port at once and loads the model in the background (`/health` answers 503 meanwhile);
    `wait_ready()` waits for it; `shutdown()` aborts what runs and stops. `port=0` picks a free port (see `url`).
    """

    def __init__(self, cfg: RelaxConfig, host: str = "127.0.0.1", port: int = 30000, threads: Optional[int] = None,
                 *, weight_version: str = "default", group_timeout_s: float = 600.0, api_key: Optional[str] = None,
                 max_body_bytes: int = MAX_BODY_BYTES, weight_dirs: tuple[str, ...] = ()):
        """`weight_dirs`: directories besides the model's own whose files `/update_weights_from_disk` and
        `/load_lora_adapter` may load (the run's; `relax.serve.sglang.guards.WeightDirs`)."""
        self.cfg = cfg
        self.api_key = api_key  # what every endpoint but /health* and /metrics requires (None: loopback only)
        self.max_body_bytes = int(max_body_bytes)
        self.weight_dirs = guards.WeightDirs(weight_dirs)
        self.host, self.port, self.threads = host, int(port), threads
        self.loopback = is_loopback(host)  # decided once: it resolves a name, and every keyless request asks
        self.weight_version = str(weight_version)
        self.created = int(time.time())  # the model object's `created` (/v1/models): when this server was made
        self.group_timeout_s = group_timeout_s
        self.engine: Any = None
        self.tokenizer: Any = None
        self._ready = threading.Event()
        self._load_error: Optional[str] = None
        self._httpd: Optional[Server] = None
        self._threads: list[threading.Thread] = []
        self.scheduler = Scheduler(lambda: self.weight_version)
        self.departures = Departures("relax-serve-departures")  # requests whose client left are aborted
        self._client = threading.local()  # the connection of the request this handler thread serves
        self._codec: Optional[RequestCodec] = None  # once the model is loaded
        self._openai_service: Any = None  # the OpenAI endpoints, made at their first call
        self._tool_parser: Any = None  # data.tool_parser's parser, resolved when the model loads
        self._responses: Any = None  # /v1/responses over them (it keeps responses for previous_response_id)
        self._init_weights()
        self._model_dir: Optional[str] = None
        self._model_dir_lock: Optional[int] = None  # its lock's descriptor (`make_model_dir`)
        self._routes: dict[str, Callable[[dict], tuple[int, Any]]] = self._route_table()

    # ---------------------------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """http://host:port of the server (the bound port once started)."""
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self) -> None:
        """Bind and serve now; load the model in a background thread."""
        if self._httpd is not None:
            raise RuntimeError("EmbeddedServer.start: already started")
        httpd = Server((self.host, self.port), _Handler)
        httpd.app = self
        self._httpd = httpd
        self.port = int(httpd.server_address[1])
        for target, name in ((httpd.serve_forever, "http"), (self._load, "load")):
            thread = threading.Thread(target=target, name=f"relax-serve-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the model is loaded; raises TimeoutError, or RuntimeError with the loading failure."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the model was not loaded within {timeout:g} s")
        if self._load_error is not None:
            raise RuntimeError(self._load_error)

    def shutdown(self) -> None:
        """Abort every request (their answers say so), stop serving, leave the weight-update groups."""
        self.scheduler.stop()
        self.departures.close()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        self._destroy_groups()
        if self._model_dir is not None:
            shutil.rmtree(self._model_dir, ignore_errors=True)
        if self._model_dir_lock is not None:  # after the removal: until then no other server's sweep may take it
            os.close(self._model_dir_lock)
            self._model_dir_lock = None

    def _load(self) -> None:
        try:
            self._build()
        except ToolParserSpecError as exc:  # a setting to change (data.tool_parser), not a failure: no traceback
            self._load_error = str(exc)
            self._ready.set()
            return
        except Exception as exc:  # reported by /health (503), wait_ready and the CLI
            logger.exception("loading the model failed")
            self._load_error = f"loading the model failed: {type(exc).__name__}: {exc}"
            self._ready.set()
            return
        self._threads.append(self.scheduler.start(self.engine, self._codec.stop_match))
        self._ready.set()

    def _build(self) -> None:
        """Tokenizer, model and engine as the rollout worker builds them."""

        if self.threads:
            torch.set_num_threads(self.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        cfg = self.cfg.model
        tokenizer = load_tokenizer(cfg)
        # data.tool_parser before the model is built: `auto` refuses a chat template with tools in a format it does
        # not know, and a parser of one's own must load; either stops relax-serve at start (wait_ready, the CLI)
        self._tool_parser = get_parser(self.cfg.data.tool_parser, tokenizer)
        path = resolve_model_path(cfg)
        self.served_model_name = cfg.name
        self.eos_token_ids = tuple(stop_token_ids(cfg, tokenizer))
        self.pad_token_id = int(tokenizer.pad_token_id)
        device = pick_device()
        dtype = pick_dtype(cfg, device)
        model = build_model(cfg, len(tokenizer), self.pad_token_id, seed=self.cfg.seed, dtype=dtype, device=device)
        model.eval()
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.dtype = str(dtype).removeprefix("torch.")
        self.tokenizer = tokenizer
        if cfg.source == "hf":
            self.model_path = self.tokenizer_path = str(path)
            self.weight_dirs.add(path)  # the model's own weights may be loaded again (/update_weights_from_disk)
        else:  # built from the config or read from a .gguf file: its config and tokenizer saved for clients (the
            # router loads the tokenizer from model_path); a killed server's is removed by the next one's
            self._model_dir, self._model_dir_lock = make_model_dir()
            model.config.save_pretrained(self._model_dir)
            tokenizer.save_pretrained(self._model_dir)
            self.model_path = self.tokenizer_path = self._model_dir
        adapters: list[str] = []
        if cfg.lora_rank > 0 and self.cfg.rollout.lora_sync == "adapter":  # SGLang's --enable-lora

            adapters = inject_adapters(model, cfg)
        self.engine = EmbeddedEngine(model, eos_token_ids=list(self.eos_token_ids), pad_token_id=self.pad_token_id,
                                     device=device)
        self.engine.adapter_keys = frozenset(adapters)
        routed = return_routed_experts(self.cfg)  # SGLang's --enable-return-routed-experts
        if routed and not is_moe(model):
            raise ValueError("--enable-return-routed-experts (rollout.routing_replay / record_routes) needs a "
                             f"mixture-of-experts model; {type(model).__name__} has no MoE router")
        self.engine.record_routes = routed
        processor = None
        if is_vision_model(model):  # image_data on /generate (relax.serve.sglang.images)
            from relax.data.images import load_processor

            processor = load_processor(cfg, tokenizer)
        self._codec = RequestCodec(tokenizer, self.vocab_size, self.context_length, self.eos_token_ids, processor,
                                   routed_experts=routed)

    # ------------------------------------------------------------------------------------------------- HTTP

    def _route_table(self) -> dict[str, Callable[[dict], tuple[int, Any]]]:
        return {
            "/health": self._health,
            "/health_generate": self._health,
            "/model_info": self._model_info,
            "/get_model_info": self._model_info,
            "/server_info": self._server_info,
            "/get_server_info": self._server_info,
            "/get_weight_version": lambda body: (200, {"weight_version": self.weight_version}),
            "/get_load": lambda body: (200, loads.get_load(self.scheduler.load())),
            "/v1/loads": self._loads,
            "/v1/models": self._models,
            "/v1/chat/completions": lambda body: self._openai("chat", body),
            "/v1/completions": lambda body: self._openai("completion", body),
            "/v1/responses": lambda body: self._openai("responses", body),
            "/generate": self._generate,
            "/pause_generation": self._pause,
            "/continue_generation": self._continue,
            "/abort_request": self._abort_request,
            "/flush_cache": self._flush_cache,
            "/update_weights_from_tensor": self._weights_from_tensor,
            "/update_weights_from_distributed": self._weights_from_distributed,
            "/init_weights_update_group": self._init_group,
            "/destroy_weights_update_group": self._destroy_group_request,
            "/update_weights_from_disk": self._weights_from_disk,
            "/update_weight_version": self._update_weight_version,
            "/load_lora_adapter": self._load_lora_adapter,
            "/unload_lora_adapter": self._unload_lora_adapter,
            "/release_memory_occupation": self._release,
            "/resume_memory_occupation": self._resume,
        }

    def handle(self, method: str, target: str, raw: bytes, headers: Any = None) -> tuple[int, Any]:
        """(status, JSON-able answer, bytes or `Events`) of one HTTP request for `target` (a path, and for a GET a
        query whose parameters the route reads as the fields of a body)."""
        parts = urlsplit(target)
        path = parts.path
        route = self._routes.get(path.rstrip("/") or "/")
        if route is None and path.startswith("/v1/models/"):  # GET /v1/models/{model}: one model's card
            route = lambda body: self._model_card(path[len("/v1/models/"):])  # noqa: E731
        # errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}, `APIError`): the OpenAI API's
        # own, and a superset of SGLang's {"error": {"message"}} for its endpoints' clients
        if route is None:
            return 404, APIError(f"no endpoint {method} {path}", status=404, code="not_found").body()
        if method not in self.methods(path):  # e.g. GET /v1/chat/completions: not read as a POST without a body
            return 405, APIError(f"{method} is not allowed on {path}: use {' or '.join(self.methods(path))}",
                                 status=405, code="method_not_allowed").body()
        if (refused := self.admit(target, headers)) is not None:
            return refused
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError) as exc:
            return 400, APIError(f"the body is not JSON: {exc}").body()
        if not isinstance(body, dict):
            return 400, APIError("the body must be a JSON object").body()
        try:
            return route({**dict(parse_qsl(parts.query)), **body} if method == "GET" else body)
        except Exception as exc:  # NotReady a 503, RequestError a 400, anything else a 500 (`failure`)
            if not isinstance(exc, (NotReady, RequestError)):
                logger.exception("%s %s failed", method, path)
            error = failure(exc)
            return error.status, error.body()

    @staticmethod
    def methods(target: str) -> tuple[str, ...]:
        """The HTTP methods the route of `target` takes."""
        path = urlsplit(target).path.rstrip("/") or "/"
        if path.startswith("/v1/models/"):
            return ("GET",)
        return OPENAI_METHODS.get(path, SGLANG_METHODS)

    def admit(self, target: str, headers: Any) -> Optional[tuple[int, Any]]:
        """The refusal (status, answer) of a request for `target` by its headers alone, or None when it may go on:
        checked before its body is read."""
        path = urlsplit(target).path.rstrip("/") or "/"
        if is_open(path):
            return None
        if path in OPENAI_PATHS or path.startswith("/v1/"):
            return self._openai_refusal(headers)
        return self._refusal(headers)

    @contextmanager
    def client_of(self, handler: BaseHTTPRequestHandler) -> Iterator[None]:
        """Within: the requests this thread submits (`_submit`) came over `handler`'s connection; they are aborted
        if its client leaves before they end (`Departures`), and no longer watched after."""
        previous = getattr(self._client, "value", None)
        self._client.value = (handler.connection, [])
        try:
            yield
        finally:
            self.departures.forget(self._client.value[1])
            self._client.value = previous

    @staticmethod
    def peer_of(handler: BaseHTTPRequestHandler) -> Any:
        """Within: the request being served came over `handler`'s connection (whose shared-memory segments it may
        name: `relax.serve.sglang.guards`)."""
        try:
            local = handler.connection.getsockname()
        except OSError:
            local = None
        return guards.peer(handler.client_address, local)

    def _require_ready(self) -> None:
        if self.scheduler.stopping:
            raise NotReady("the server is shutting down")
        if not self._ready.is_set():
            raise NotReady("the model is loading")
        if self._load_error is not None:
            raise NotReady(self._load_error)

    def _health(self, body: dict) -> tuple[int, Any]:
        """SGLang's health check (see the module docstring): healthy once the scheduler makes output."""
        self._require_ready()
        if self.scheduler.held():
            return 503, b""  # paused or released: SGLang's check gets no output either
        start = progress.count()  # decoding steps of this process's engine
        request = self._codec.parse({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        request.probe = True
        self.scheduler.submit(request)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not request.done.wait(0.02):
            if progress.count() != start or time.monotonic() > deadline:
                self.scheduler.abort_where(lambda r: r.request is request, "health check answered")
                return (200 if progress.count() != start else 503), b""
        aborted = any(row.finish and row.finish.get("type") == "abort" for row in request.rows)
        return (200 if request.error is None and not aborted else 503), b""

    def _model_info(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        return 200, {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                     "preferred_sampling_params": None, "weight_version": self.weight_version}

    def _server_info(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        state = self.scheduler.state()
        return 200, {
            "model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True, "weight_version": self.weight_version, "version": loads.VERSION,
            "host": self.host, "port": self.port, **self._parallel_args(),
            "context_length": self.context_length,
            "max_req_input_len": None if self.context_length is None else self.context_length - 1,
            "max_total_num_tokens": None,  # no KV pool: each batch allocates the cache it needs
            "vocab_size": self.vocab_size, "eos_token_ids": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id, "device": str(self.engine.device), "dtype": self.dtype,
            "default_sampling_params": {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "temperature": 1.0, "top_p": 1.0,
                                        "top_k": -1, "n": 1},
            "preferred_sampling_params": None, "seed": self.cfg.seed,
            "internal_states": [state],
        }

    def _parallel_args(self) -> dict[str, Any]:
        """The server arguments slime compares with its own (`relax.serve.sglang.server_args`)."""
        return server_args(self.cfg, self.engine.device)

    def _loads(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        device = self.engine.device
        accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return 200, loads.v1_loads(self.scheduler.load(), body, accelerator)

    def _card(self) -> dict[str, Any]:
        # `root` is the served name, as SGLang's ModelCard gives it (root=served_model_name), not the model's
        # directory: a client has no use for a path on this host (model=tiny's is a temporary directory)
        return {"id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "relax",
                "root": self.served_model_name, "max_model_len": self.context_length}

    def _models(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        return 200, {"object": "list", "data": [self._card()]}

    def _model_card(self, model: str) -> tuple[int, Any]:
        """GET /v1/models/{model}: the served model's card, or OpenAI's 404 for another name (as SGLang answers)."""
        self._require_ready()
        model = unquote(model)
        if model != self.served_model_name:
            return 404, APIError(f"The model '{model}' does not exist", status=404, kind="invalid_request_error",
                                 param="model", code="model_not_found").body()
        return 200, self._card()

    # ------------------------------------------------------------------------------------------- generation

    def _openai(self, endpoint: str, body: dict) -> tuple[int, Any]:
        """`/v1/chat/completions` and `/v1/completions` (`relax.serve.openai.service`) on this engine; errors
        in OpenAI's shape."""

        try:
            self._require_ready()
            if self._openai_service is None:
                fmt = ChatFormat(self.tokenizer, self.eos_token_ids, self._tool_parser)  # data.tool_parser
                self._openai_service = OpenAIService(fmt, self._send_openai, model=self.served_model_name,
                                                     context_length=self.context_length,
                                                     images=self._codec.images is not None,
                                                     stream=self._stream_openai)
            if endpoint == "responses":
                if self._responses is None or self._responses.service is not self._openai_service:
                    self._responses = Responses(self._openai_service)
                return self._responses.create(body)
            return getattr(self._openai_service, endpoint)(body)
        except NotReady as exc:
            return 503, APIError(str(exc), status=503, kind="server_error").body()
        except APIError as exc:
            return exc.status, exc.body()

    def _authorized(self, headers: Any) -> Optional[str]:
        """Why a request may not use a guarded endpoint (None: it may): the server's key (`api_key`) as
        `Authorization: Bearer`, or, without a key, a loopback address: anything reachable beyond it needs one."""
        if self.api_key is None:
            if self.loopback:
                return None
            return f"a server bound to {self.host} needs a key: start it with --api-key"
        auth = (headers.get("Authorization") if headers is not None else None) or ""
        if auth.lower().startswith("bearer ") and secrets.compare_digest(auth[7:].strip(), self.api_key):
            return None
        return "a missing or wrong API key (Authorization: Bearer <the server's --api-key>)"

    def _refusal(self, headers: Any) -> Optional[tuple[int, Any]]:
        """SGLang's answer to a request without the server's key: 401 {"error": ...} (403 without a key beyond
        loopback)."""
        why = self._authorized(headers)
        if why is None:
            return None
        return (403 if self.api_key is None else 401), {"error": why}

    def _openai_refusal(self, headers: Any) -> Optional[tuple[int, Any]]:
        """The OpenAI endpoints answer a request with the server's key (`api_key`), or, without a key, only on a
        loopback address: anything reachable beyond it needs one."""

        why = self._authorized(headers)
        if why is None:
            return None
        if self.api_key is None:
            error = APIError(f"the OpenAI endpoints of {why}", status=403, kind="permission_error")
        else:
            error = APIError(why, status=401, kind="authentication_error", code="invalid_api_key")
        return error.status, error.body()

    @staticmethod
    def _openai_body(payloads: list[dict]) -> dict:
        """The OpenAI service's `/generate` payloads as one batched request."""
        body = {"input_ids": [p["input_ids"] for p in payloads],
                "sampling_params": [p["sampling_params"] for p in payloads], "return_logprob": True}
        if payloads[0].get("top_logprobs_num"):
            body["top_logprobs_num"] = payloads[0]["top_logprobs_num"]
        if any(p.get("image_data") for p in payloads):  # OpenAI image parts (relax.serve.openai.images)
            body["image_data"] = [p.get("image_data") for p in payloads]
        return body

    def _stream_openai(self, payloads: list[dict]) -> Iterator[dict]:
        """The OpenAI service's `/generate` payloads submitted now as one streamed request to this engine, and its
        events as they come (`relax.serve.openai.service.StreamSend`): each row's tokens and log-probs so far, then
        its final answer. The request is this handler's (a client that leaves aborts it, `Departures`); closing the
        events aborts what still runs."""
        self._require_ready()
        try:
            request = self._submit({**self._openai_body(payloads), "stream": True})
        except RequestError as exc:
            raise APIError(str(exc)) from None
        events = answer_events(request, self.scheduler, self._final,
                               lambda row, tokens, logps, top: self._codec.progress(row, request, tokens, logps,
                                                                                    top, self.weight_version))
        return _Aborting(events, request, self.scheduler)

    def _send_openai(self, payloads: list[dict]) -> list[dict]:
        """The OpenAI service's `/generate` payloads as one batched request to this engine."""

        self._require_ready()
        try:
            request = self._finished(self._openai_body(payloads))
        except RequestError as exc:
            raise APIError(str(exc)) from None
        if request.error is not None:
            raise request_error(request)
        answer = self._answers(request)
        return answer if isinstance(answer, list) else [answer]

    def _generate(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        if body.get("stream"):
            return 200, Events(self._stream(body))
        request = self._finished(body)
        if request.error is not None:
            error = request_error(request)
            return error.status, error.body()
        return 200, self._answers(request)

    def _finished(self, body: dict) -> Request:
        """The request of a (not streamed) /generate body, submitted and waited for (aborted if the server stops)."""
        request = self._submit(body)
        while not request.done.wait(1.0):
            if self.scheduler.stopping:
                self.scheduler.abort_where(lambda r: r.request is request, "the server is shutting down")
        return request

    def _answers(self, request: Request) -> Any:
        """A finished request's answer: one object for a single prompt, else a list."""
        self._extras([r for r in request.rows if r.needs_extras()])
        answers = [self._codec.answer(r, request, self.weight_version) for r in request.rows]
        return answers[0] if request.single else answers

    def _submit(self, body: dict) -> Request:
        """The request of a /generate body, queued."""
        released = self.scheduler.released
        if released:
            raise RequestError(f"memory released ({', '.join(sorted(released))}); "
                               "call /resume_memory_occupation first")
        request = self._codec.parse(self._lora_request(body))
        self.scheduler.submit(request)
        client = getattr(self._client, "value", None)  # None: submitted in this process, not over HTTP
        if client is not None:
            client[1].append(request)
            # one abort, whether the watch or the stream's writer notices the departure first
            self.departures.watch(client[0], request, done=request.done.is_set,
                                  abort=lambda: abort_rest(request, self.scheduler))
        return request

    def _stream(self, body: dict) -> Iterator[dict]:
        """The events of a streamed /generate (`relax.serve.sglang.stream`); a request that cannot be served is
        an error event, as in SGLang."""
        try:
            request = self._submit(body)
        except Exception as exc:  # the error event of the answer the same body unstreamed gets (`failure`)
            if not isinstance(exc, (RequestError, NotReady)):
                logger.exception("a streamed /generate failed")
            yield error_event(failure(exc))
            return
        yield from answer_events(request, self.scheduler, self._final,
                                 lambda row, tokens, logps, top: self._codec.progress(row, request, tokens,
                                                                                      logps, top,
                                                                                      self.weight_version))

    def _final(self, row: Row) -> dict:
        """The answer of an ended row of a stream."""
        if row.needs_extras():
            self._extras([row])
        return self._codec.answer(row, row.request, self.weight_version)

    def _extras(self, rows: list[Row]) -> None:
        """The log-probs of ended rows beyond their sampled tokens' (`relax.serve.sglang.positions`), with the
        model held: one forward pass each."""
        if not rows:
            return
        with self.scheduler.exclusive("logprobs"), torch.no_grad():
            for row in rows:
                row.extra = row_extras(self.engine.model, self.engine.device, row)

    # ------------------------------------------------------------------------------------ pause, abort, flush

    def _pause(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode={mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        self.scheduler.pause(mode)  # returns once no engine call runs
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        self.scheduler.unpause()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort_request(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        if body.get("abort_all"):
            self.scheduler.abort_where(lambda r: True, "aborted by /abort_request (abort_all)")
            return 200, b""
        rid = body.get("rid")
        rids = {str(r) for r in rid} if isinstance(rid, list) else ({str(rid)} if rid not in (None, "") else set())
        if rids:  # no rid and no abort_all (verl's defaults: rid "", abort_all false): nothing, as SGLang does
            self.scheduler.abort_where(lambda r: r.rid in rids or r.id in rids, "aborted by /abort_request")
        return 200, b""

    def _flush_cache(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        if self.scheduler.idle():
            return 200, b"Cache flushed.\n"
        return 400, b"Cache not flushed: requests are running or waiting.\n"

