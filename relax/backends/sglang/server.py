"""`EmbeddedServer`: Relax's embedded rollout engine behind SGLang's HTTP protocol.

The same client code (Relax's SGLang client, weight sync, the real `sglang-router`) then runs in CI on CPUs against
real HTTP, and the numbers it gets are the engine's: tokens and log-probs exactly as `EmbeddedEngine.generate` makes
them (full-vocabulary log-softmax at the temperature, see `relax.backends.sampling`).

Protocol (SGLang's `entrypoints/http_server.py` and `managers/io_struct.py`; JSON in and out, unknown fields ignored):
- `GET /health` 503 while the model loads, then 200; `/health_generate` also runs a 1-token generation (200 without
  one while generation is paused or memory released). `GET /server_info`, `/get_server_info`, `/model_info`,
  `/get_model_info`, `/get_weight_version`, `/v1/models`.
- `POST /generate`: `input_ids` (a list, or a list of lists) or `text`; `sampling_params` (one dict, or one per
  input) with max_new_tokens, temperature (0: greedy), top_p, top_k (-1: off), n, stop_token_ids, ignore_eos,
  no_stop_trim, skip_special_tokens, sampling_seed (unknown ones ignored); `return_logprob`; `rid` (one, or one per
  input; sample k of an input with n>1 has the id `<rid>_<k>`, and /abort_request matches either). A dict for one
  input with n=1, else a list, an input's n samples consecutive. `output_ids` include the stop token. Not supported
  (400 naming the field): stream, logprob_start_len other than -1, top_logprobs_num, token_ids_logprob, stop
  strings, penalties, min_p, min_new_tokens, constrained decoding, images, LoRA.
- `POST /pause_generation` {"mode": "abort" | "retract" | "in_place"}, `/continue_generation`, `/abort_request`
  {"rid"} or {"abort_all": true}, `/flush_cache`.
- Weights: `/update_weights_from_tensor` (load_format null or "flattened_bucket"), `/init_weights_update_group`,
  `/update_weights_from_distributed`, `/destroy_weights_update_group`, `/update_weights_from_disk` (safetensors),
  `/update_weight_version`, `/release_memory_occupation`, `/resume_memory_occupation`.

Sampling: the engine runs with seed 0, and row k of a request with `sampling_seed` s draws from the random stream
of sample id `row_stream(s, k)` (`row_stream(s, 0) == s`), so a request gets the same tokens in any batch and
whatever else runs; without `sampling_seed` every row gets a random stream.

Scheduling: one thread collects every waiting request and generates them together, one `EmbeddedEngine.generate`
call per set of rows whose sampling settings (temperature, top_p, top_k, stop tokens) agree; requests that arrive
meanwhile wait for the next batch. An abort (`/abort_request`, `/pause_generation`) interrupts the engine after the
current token: the aborted rows return their tokens so far with finish_reason abort, the other rows continue from
their prefix with their own random streams (the tokens they would have drawn anyway). "retract" and "in_place"
pauses keep the interrupted rows waiting until `/continue_generation`; they continue from their prefix then, with
the weights loaded at that time (the answer reports that version). Weight updates, memory release and resume wait
for the running batch (and its continuations), so the tokens of one batch come from one weight version, the
`weight_version` its answers report. The engine keeps no cache between batches: `flush_cache` has nothing to flush;
it answers 400 while a request runs or waits (200 while generation is paused and no batch runs).

Weights sent in several buckets are copied in as each bucket arrives (as SGLang does): a batch that runs between
two buckets sees some new and some old weights under the old version. Senders pause generation (or send nothing
to generate) while they update, and put `weight_version` on the last bucket.

`/release_memory_occupation` frees the weights (their storage, not the modules); `/resume_memory_occupation`
allocates them again with undefined contents: the caller must load weights before generating (as with SGLang
without CPU backup). The server listens on loopback by default; it unpickles weight payloads with a restricted
unpickler (`wire.deserialize`), but anyone who can reach it can change its weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import torch

from relax.backends.sglang import wire
from relax.config.schema import RelaxConfig

logger = logging.getLogger(__name__)

GREEDY_EPS = 1e-6  # a temperature below this is greedy (SGLang's rule)
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 20.0
MEMORY_TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "retract", "in_place")
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
# sampling parameters the engine does not implement: accepted only at these (neutral) values
_NEUTRAL_SAMPLING = {"min_new_tokens": (0,), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
                     "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "stop": ("", ()),
                     "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (), "logit_bias": ()}
# request fields the server does not implement: accepted only at these values
_NEUTRAL_REQUEST = {"top_logprobs_num": (0,), "token_ids_logprob": (), "return_hidden_states": (False,),
                    "input_embeds": (), "image_data": (), "video_data": (), "audio_data": (), "lora_path": (),
                    "session_params": ()}


class RequestError(ValueError):
    """A request the server cannot serve (HTTP 400)."""


class NotReady(RuntimeError):
    """The model is not loaded (yet), or the server is shutting down (HTTP 503)."""


def row_stream(sampling_seed: int, k: int) -> int:
    """The engine sample id (random stream, engine seed 0) of sample `k` of a request seeded `sampling_seed`:
    the seed itself for k=0, a SplitMix64 mix of the two otherwise; 63 bits."""
    s = int(sampling_seed) & _MASK63
    if k == 0:
        return s
    x = (s + (int(k) * 0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _MASK63


@dataclass(frozen=True)
class _Options:
    """How one row's answer is written."""

    return_logprob: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    text_in_logprobs: bool


@dataclass(eq=False)
class _Request:
    rows: list[_Row]
    single: bool  # one input, n=1: the answer is a dict
    t0: float
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None


@dataclass(eq=False)
class _Row:
    """One sample of one input of a request."""

    request: _Request
    rid: str  # the input's rid (abort_request matches it, or `id`)
    id: str  # this sample's id (meta_info.id)
    prompt: list[int]
    stream: int  # engine sample id
    max_new: int
    key: tuple  # (temperature, top_p, top_k, stop ids): rows with one key share an engine call
    options: _Options
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: Optional[dict] = None
    abort: Optional[str] = None  # set once an abort was asked: the message of its finish_reason
    version: Optional[str] = None  # the weight version that generated its tokens


def _neutral(value: Any, neutral: tuple) -> bool:
    """True when `value` (or each entry of a list of them) is None, empty or one of `neutral`."""
    if value is None or value == [] or value == {}:
        return True
    if isinstance(value, list):
        return all(_neutral(v, neutral) for v in value)
    return any(type(value) is type(n) and value == n for n in neutral) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value in neutral)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(sp: dict, name: str, default: float) -> float:
    v = sp.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise RequestError(f"sampling_params.{name}={v!r}: expected a number")
    return float(v)


def _integer(sp: dict, name: str, default: Optional[int]) -> Optional[int]:
    v = sp.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise RequestError(f"sampling_params.{name}={v!r}: expected an integer")
    return int(v)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # bursts of concurrent requests (a rollout batch) must not be refused
    app: EmbeddedServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer carries Content-Length
    server_version = "relax-embedded-sglang"
    server: _HTTPServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's signature)
        logger.debug("%s %s", self.address_string(), format % args)

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _dispatch(self, method: str) -> None:
        try:
            raw = self._body()
        except (OSError, ValueError):
            self.close_connection = True
            return
        status, payload = self.server.app.handle(method, urlsplit(self.path).path, raw)
        if isinstance(payload, bytes):
            data, kind = payload, "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client left
            self.close_connection = True


class EmbeddedServer:
    """An HTTP server speaking SGLang's protocol over one `EmbeddedEngine` built from `cfg` (as the rollout
    worker builds it: same model, seed, device, dtype, tokenizer and stop tokens).

    `start()` binds the port at once and loads the model in the background (`/health` answers 503 meanwhile);
    `wait_ready()` waits for it; `shutdown()` aborts what runs and stops. `port=0` picks a free port (see `url`).
    """

    def __init__(self, cfg: RelaxConfig, host: str = "127.0.0.1", port: int = 30000, threads: Optional[int] = None,
                 *, weight_version: str = "default", group_timeout_s: float = 600.0):
        self.cfg = cfg
        self.host, self.port, self.threads = host, int(port), threads
        self.weight_version = str(weight_version)
        self.group_timeout_s = group_timeout_s
        self.engine: Any = None
        self.tokenizer: Any = None
        self._ready = threading.Event()
        self._load_error: Optional[str] = None
        self._httpd: Optional[_HTTPServer] = None
        self._threads: list[threading.Thread] = []
        self._cv = threading.Condition()
        self._queue: list[_Row] = []  # rows waiting for the engine (retracted rows first)
        self._batch: list[_Row] = []  # rows of the batch the scheduler is running
        self._active: set[int] = set()  # ids of the rows inside the current engine call
        self._interrupt = False  # read by the engine after every token
        self._owner: Optional[str] = None  # who uses the engine/model now: "generate" or a weight operation
        self._ops_waiting = 0  # weight operations waiting for the engine: no new batch starts meanwhile
        self._paused: Optional[str] = None
        self._released: set[str] = set()
        self._stopping = False
        self._groups: dict[str, Any] = {}
        self._group_locks: dict[str, threading.Lock] = {}
        self._group_devices: dict[str, torch.device] = {}
        self._tokenizer_lock = threading.Lock()
        self._shapes: dict[str, torch.Size] = {}
        self._model_dir: Optional[str] = None
        self._routes: dict[str, Callable[[dict], tuple[int, Any]]] = self._route_table()

    # ---------------------------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """http://host:port of the server (the bound port once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve now; load the model in a background thread."""
        if self._httpd is not None:
            raise RuntimeError("EmbeddedServer.start: already started")
        httpd = _HTTPServer((self.host, self.port), _Handler)
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
        with self._cv:
            self._stopping = True
            self._abort_where(lambda r: True, "the server is shutting down")
            self._cv.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        for name in list(self._groups):
            self._destroy_group(name)
        if self._model_dir is not None:
            shutil.rmtree(self._model_dir, ignore_errors=True)

    def _load(self) -> None:
        try:
            self._build()
        except Exception as exc:  # reported by /health (503), wait_ready and the CLI
            logger.exception("loading the model failed")
            self._load_error = f"loading the model failed: {type(exc).__name__}: {exc}"
            self._ready.set()
            return
        scheduler = threading.Thread(target=self._schedule, name="relax-serve-scheduler", daemon=True)
        scheduler.start()
        self._threads.append(scheduler)
        self._ready.set()

    def _build(self) -> None:
        """Tokenizer, model and engine as the rollout worker builds them."""
        from relax.backends.models import build_model, pick_device, pick_dtype
        from relax.backends.rollout_embedded import EmbeddedEngine
        from relax.data.tokenizer import load_tokenizer, resolve_model_path, stop_token_ids

        if self.threads:
            torch.set_num_threads(self.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        cfg = self.cfg.model
        tokenizer = load_tokenizer(cfg)
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
        else:  # built from the config or read from a .gguf file: its config and tokenizer saved for clients (the
            # router loads the tokenizer from model_path)
            self._model_dir = tempfile.mkdtemp(prefix="relax-serve-model-")
            model.config.save_pretrained(self._model_dir)
            tokenizer.save_pretrained(self._model_dir)
            self.model_path = self.tokenizer_path = self._model_dir
        self.engine = EmbeddedEngine(model, eos_token_ids=list(self.eos_token_ids), pad_token_id=self.pad_token_id,
                                     device=device)

    # ------------------------------------------------------------------------------------------------- HTTP

    def _route_table(self) -> dict[str, Callable[[dict], tuple[int, Any]]]:
        return {
            "/health": self._health,
            "/health_generate": self._health_generate,
            "/model_info": self._model_info,
            "/get_model_info": self._model_info,
            "/server_info": self._server_info,
            "/get_server_info": self._server_info,
            "/get_weight_version": lambda body: (200, {"weight_version": self.weight_version}),
            "/v1/models": self._models,
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
            "/release_memory_occupation": self._release,
            "/resume_memory_occupation": self._resume,
        }

    def handle(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        """(status, JSON-able answer or bytes) of one HTTP request."""
        route = self._routes.get(path.rstrip("/") or "/")
        if route is None:
            return 404, {"error": {"message": f"no endpoint {path}"}}
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError) as exc:
            return 400, {"error": {"message": f"the body is not JSON: {exc}"}}
        if not isinstance(body, dict):
            return 400, {"error": {"message": "the body must be a JSON object"}}
        try:
            return route(body)
        except NotReady as exc:
            return 503, {"error": {"message": str(exc)}}
        except RequestError as exc:
            return 400, {"error": {"message": str(exc)}}
        except Exception as exc:
            logger.exception("%s %s failed", method, path)
            return 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}

    def _require_ready(self) -> None:
        if self._stopping:
            raise NotReady("the server is shutting down")
        if not self._ready.is_set():
            raise NotReady("the model is loading")
        if self._load_error is not None:
            raise NotReady(self._load_error)

    def _health(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        return 200, b""

    def _health_generate(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        with self._cv:
            if self._paused is not None or self._released:
                return 200, b""  # alive; generation is held on purpose
        request = self._parse({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        self._submit(request)
        if not request.done.wait(HEALTH_TIMEOUT_S):
            self._abort_where(lambda r: r.request is request, "health check timed out")
            return 503, b""
        return (200 if request.error is None else 503), b""

    def _model_info(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        return 200, {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                     "preferred_sampling_params": None, "weight_version": self.weight_version}

    def _server_info(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        with self._cv:
            queued = len({id(r.request) for r in self._queue})
            running = len({id(r.request) for r in self._batch if r.finish is None})
            state = {"#queue-req": queued, "#running-req": running, "#running-rows": len(self._active),
                     "paused": self._paused, "memory_released": sorted(self._released)}
        return 200, {
            "model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True, "weight_version": self.weight_version, "version": "relax-embedded",
            "host": self.host, "port": self.port, "tp_size": 1, "dp_size": 1,
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

    def _models(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        card = {"id": self.served_model_name, "object": "model", "owned_by": "relax", "root": self.model_path,
                "max_model_len": self.context_length}
        return 200, {"object": "list", "data": [card]}

    # ------------------------------------------------------------------------------------------- generation

    def _generate(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        if self._released:
            raise RequestError(f"memory released ({', '.join(sorted(self._released))}); "
                               "call /resume_memory_occupation first")
        request = self._parse(body)
        self._submit(request)
        while not request.done.wait(1.0):
            if self._stopping:
                self._abort_where(lambda r: r.request is request, "the server is shutting down")
        if request.error is not None:
            return 500, {"error": {"message": request.error}}
        answers = [self._answer(r, request) for r in request.rows]
        return 200, answers[0] if request.single else answers

    def _parse(self, body: dict) -> _Request:
        """The rows of a /generate body (RequestError naming what is wrong or unsupported)."""
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded server; send stream=false")
        lsl = body.get("logprob_start_len")
        for v in lsl if isinstance(lsl, list) else [lsl]:
            if v not in (None, -1):
                raise RequestError(f"logprob_start_len={lsl!r} is not supported (input log-probs): only -1")
        for name, neutral in _NEUTRAL_REQUEST.items():
            v = body.get(name)
            if not _neutral(v, neutral):
                raise RequestError(f"{name}={v!r} is not supported by the embedded server")
        inputs, single = self._inputs(body)
        n_in = len(inputs)

        def per_input(name: str, value: Any, default: Any) -> list:
            if isinstance(value, list):
                if len(value) != n_in:
                    raise RequestError(f"{name} has {len(value)} entries for {n_in} inputs")
                return [default if v is None else v for v in value]
            return [default if value is None else value] * n_in

        sps = per_input("sampling_params", body.get("sampling_params"), {})
        logprobs = per_input("return_logprob", body.get("return_logprob"), False)
        rid = body.get("rid")
        if isinstance(rid, str) and n_in > 1:
            rids = [f"{rid}_{i}" for i in range(n_in)]
        else:
            rids = [None if r is None else str(r) for r in per_input("rid", rid, None)]
        text_in_logprobs = bool(body.get("return_text_in_logprobs"))
        request = _Request(rows=[], single=False, t0=time.perf_counter())
        for prompt, sp, logprob, item_rid in zip(inputs, sps, logprobs, rids, strict=True):
            if not isinstance(sp, dict):
                raise RequestError("sampling_params must be an object (or one per input)")
            key, max_new, n, seed, options = self._sampling(sp, len(prompt), bool(logprob), text_in_logprobs)
            item_rid = item_rid or uuid.uuid4().hex
            for k in range(n):
                stream = row_stream(seed, k) if seed is not None else secrets.randbits(63)
                row = _Row(request=request, rid=item_rid, id=item_rid if n == 1 else f"{item_rid}_{k}",
                           prompt=prompt, stream=stream, max_new=max_new, key=key, options=options)
                if max_new == 0:
                    row.finish = {"type": "length", "length": 0}
                request.rows.append(row)
        request.single = single and len(request.rows) == 1
        return request

    def _inputs(self, body: dict) -> tuple[list[list[int]], bool]:
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise RequestError("give exactly one of input_ids and text")
        if text is not None:
            texts = [text] if isinstance(text, str) else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a non-empty list of strings")
            with self._tokenizer_lock:
                inputs = [list(self.tokenizer.encode(t)) for t in texts]
            single = isinstance(text, str)
        else:
            if not isinstance(ids, list) or not ids:
                raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
            single = not isinstance(ids[0], list)
            inputs = [ids] if single else ids
            for p in inputs:
                if not isinstance(p, list) or not all(_is_int(t) for t in p):
                    raise RequestError("input_ids must be a list of integers or a list of lists of integers")
        for p in inputs:
            if not p:
                raise RequestError("every input needs at least one token")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input_ids: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return [list(map(int, p)) for p in inputs], single

    def _sampling(self, sp: dict, prompt_len: int, logprob: bool,
                  text_in_logprobs: bool) -> tuple[tuple, int, int, Optional[int], _Options]:
        """(batching key, max_new_tokens, n, sampling_seed, answer options) of one input's sampling_params."""
        for name, neutral in _NEUTRAL_SAMPLING.items():
            v = sp.get(name)
            if not _neutral(v, neutral):
                raise RequestError(f"sampling_params.{name}={v!r} is not supported by the embedded server")
        max_new = _integer(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        n = _integer(sp, "n", 1)
        top_k = _integer(sp, "top_k", -1)
        seed = _integer(sp, "sampling_seed", None)
        temperature = _number(sp, "temperature", 1.0)
        top_p = _number(sp, "top_p", 1.0)
        if max_new < 0 or n < 1:
            raise RequestError(f"sampling_params: max_new_tokens={max_new} must be >= 0 and n={n} >= 1")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < -1:
            raise RequestError(f"sampling_params: temperature={temperature} must be >= 0, top_p={top_p} in (0, 1], "
                               f"top_k={top_k} -1 (off) or >= 1")
        if self.context_length is not None and prompt_len + max_new > self.context_length:
            raise RequestError(f"the input ({prompt_len} tokens) plus max_new_tokens ({max_new}) exceeds the model's "
                               f"context length of {self.context_length} tokens")
        stop_ids = sp.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of token ids")
        stops = () if sp.get("ignore_eos") else tuple(sorted(set(self.eos_token_ids) | set(stop_ids)))
        if temperature < GREEDY_EPS:
            key = (0.0, 1.0, -1, stops)
        else:
            key = (temperature, top_p, -1 if top_k in (0, -1) or top_k >= self.vocab_size else top_k, stops)
        options = _Options(return_logprob=logprob, skip_special_tokens=sp.get("skip_special_tokens") is not False,
                           no_stop_trim=bool(sp.get("no_stop_trim")), text_in_logprobs=text_in_logprobs)
        return key, max_new, n, seed, options

    def _submit(self, request: _Request) -> None:
        with self._cv:
            if self._stopping:
                raise NotReady("the server is shutting down")
            waiting = [r for r in request.rows if r.finish is None]
            if not waiting:
                request.done.set()
            self._queue.extend(waiting)
            self._cv.notify_all()

    def _answer(self, row: _Row, request: _Request) -> dict:
        finish = row.finish or {"type": "abort", "message": "unfinished"}
        ids = list(row.tokens)
        if finish["type"] == "stop" and not row.options.no_stop_trim:
            ids = ids[:-1]
        meta: dict[str, Any] = {
            "id": row.id, "finish_reason": finish, "prompt_tokens": len(row.prompt),
            "completion_tokens": len(row.tokens), "cached_tokens": 0,
            "weight_version": row.version if row.version is not None else self.weight_version,
            "e2e_latency": time.perf_counter() - request.t0,
        }
        with self._tokenizer_lock:
            text = self.tokenizer.decode(ids, skip_special_tokens=row.options.skip_special_tokens)
            pieces = ([self.tokenizer.decode([t]) for t in row.tokens] if row.options.text_in_logprobs
                      else [None] * len(row.tokens))
        if row.options.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, tok, piece] for lp, tok, piece in
                                             zip(row.logps, row.tokens, pieces, strict=True)]
        return {"text": text, "output_ids": list(row.tokens), "meta_info": meta}

    # --------------------------------------------------------------------------------------------- scheduler

    def _finish(self, row: _Row, finish: dict) -> None:
        """Record a row's end (caller holds the lock); its request answers once every row ended."""
        if row.finish is not None:
            return
        row.finish = finish
        if all(r.finish is not None for r in row.request.rows):
            row.request.done.set()

    def _abort_where(self, match: Callable[[_Row], bool], message: str) -> int:
        """Abort the matching rows: queued ones end now, running ones after the engine's current token."""
        with self._cv:
            hits = 0
            keep = []
            for row in self._queue:
                if match(row):
                    self._finish(row, {"type": "abort", "message": message})
                    hits += 1
                else:
                    keep.append(row)
            self._queue = keep
            for row in self._batch:
                if row.finish is None and match(row):
                    row.abort = row.abort or message
                    hits += 1
                    if id(row) in self._active:
                        self._interrupt = True
            self._cv.notify_all()
            return hits

    def _can_run(self) -> bool:
        return (bool(self._queue) and self._paused is None and not self._released and self._owner is None
                and self._ops_waiting == 0)

    def _schedule(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._can_run():
                    self._cv.wait()
                if self._stopping:
                    return
                batch, self._queue = self._queue, []
                self._batch, self._owner = batch, "generate"
            try:
                self._run_batch(batch)
            except Exception as exc:
                logger.exception("generation failed")
                with self._cv:
                    for row in batch:
                        if row.finish is None:
                            row.request.error = f"generation failed: {type(exc).__name__}: {exc}"
                            self._finish(row, {"type": "abort", "message": row.request.error})
            finally:
                with self._cv:
                    self._batch, self._active, self._owner = [], set(), None
                    self._cv.notify_all()

    def _run_batch(self, batch: list[_Row]) -> None:
        """Generate `batch` to the end: engine calls per sampling key; interrupted rows that were not aborted
        continue from their prefix (or wait, when generation was paused with retract/in_place)."""
        pending, held = batch, []
        while pending:
            groups: dict[tuple, list[_Row]] = {}
            for row in pending:
                groups.setdefault(row.key, []).append(row)
            pending = []
            for key, rows in groups.items():
                with self._cv:
                    live = []
                    for row in rows:
                        if row.finish is not None:
                            continue
                        if row.abort is not None:
                            self._finish(row, {"type": "abort", "message": row.abort})
                        elif self._paused is not None or self._stopping:
                            held.append(row)
                        else:
                            live.append(row)
                    if not live:
                        continue
                    self._interrupt = False
                    self._active = {id(r) for r in live}
                    version = self.weight_version
                out = self._engine_call(key, live)
                with self._cv:
                    self._active = set()
                    for i, row in enumerate(live):
                        n = int(out.response_mask[i].sum())
                        row.tokens.extend(out.response_ids[i, :n].tolist())
                        row.logps.extend(out.rollout_logp[i, :n].tolist())
                        row.version = version
                        reason = out.finish_reason[i]
                        if reason == "stop":
                            self._finish(row, {"type": "stop", "matched": row.tokens[-1]})
                        elif reason == "length":
                            self._finish(row, {"type": "length", "length": row.max_new})
                        elif row.abort is not None:
                            self._finish(row, {"type": "abort", "message": row.abort})
                        elif self._paused is not None or self._stopping:
                            held.append(row)
                        else:
                            pending.append(row)  # interrupted for another row's abort: continue now
        with self._cv:
            for row in held:
                if row.abort is not None:
                    self._finish(row, {"type": "abort", "message": row.abort})
            self._queue[:0] = [r for r in held if r.finish is None]

    def _engine_call(self, key: tuple, rows: list[_Row]) -> Any:
        temperature, top_p, top_k, stops = key
        budgets = [r.max_new - len(r.tokens) for r in rows]
        self.engine.eos_token_ids = list(stops)  # only this thread generates
        return self.engine.generate(
            [r.prompt + r.tokens for r in rows], max_new_tokens=max(budgets), temperature=temperature, top_p=top_p,
            top_k=top_k, seed=0, sample_ids=torch.tensor([r.stream for r in rows], dtype=torch.long),
            positions=torch.tensor([len(r.tokens) for r in rows], dtype=torch.long),
            budgets=torch.tensor(budgets, dtype=torch.long), should_abort=lambda: self._interrupt)

    # ------------------------------------------------------------------------------------ pause, abort, flush

    def _pause(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode={mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        with self._cv:
            self._paused = mode
            if mode == "abort":
                self._abort_where(lambda r: True, "aborted by /pause_generation")
            elif self._active:
                self._interrupt = True
            while self._owner == "generate":  # returns once no engine call runs
                self._cv.wait()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        with self._cv:
            self._paused = None
            self._cv.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort_request(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        if body.get("abort_all"):
            self._abort_where(lambda r: True, "aborted by /abort_request (abort_all)")
            return 200, b""
        rid = body.get("rid")
        rids = {str(r) for r in rid} if isinstance(rid, list) else ({str(rid)} if rid not in (None, "") else set())
        if not rids:
            raise RequestError("abort_request: give rid or abort_all=true")
        self._abort_where(lambda r: r.rid in rids or r.id in rids, "aborted by /abort_request")
        return 200, b""

    def _flush_cache(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        with self._cv:
            idle = self._owner != "generate" and (not self._queue or self._paused is not None)
        if idle:
            return 200, b"Cache flushed.\n"
        return 400, b"Cache not flushed: requests are running or waiting.\n"

    # ------------------------------------------------------------------------------------------------ weights

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Hold the model for `what`: waits for the running batch (and its continuations); no batch starts."""
        with self._cv:
            self._ops_waiting += 1
            try:
                while self._owner is not None and not self._stopping:
                    self._cv.wait()
            finally:
                self._ops_waiting -= 1
            if self._stopping:
                raise NotReady("the server is shutting down")
            self._owner = what
        try:
            yield
        finally:
            with self._cv:
                self._owner = None
                self._cv.notify_all()

    def _targets(self) -> dict[str, torch.Tensor]:
        """Every loadable tensor by name (both names of a tied weight)."""
        model = self.engine.model
        targets = dict(model.state_dict(keep_vars=True))
        targets.update(dict(model.named_parameters(remove_duplicate=False)))
        return targets

    def _check_names(self, shapes: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Problems of loading tensors of these names and shapes (empty when fine)."""
        targets = self._targets()
        problems = []
        for name, shape in shapes:
            if "rotary_emb.inv_freq" in name:
                continue  # computed, not loaded (SGLang skips it too)
            target = targets.get(name)
            expected = self._shapes.get(name, None if target is None else tuple(target.shape))
            if target is None:
                problems.append(f"{name}: no such parameter")
            elif tuple(shape) != tuple(expected):
                problems.append(f"{name}: shape {list(shape)}, expected {list(expected)}")
        return problems

    def _apply(self, named: list[tuple[str, torch.Tensor]], version: Any) -> str:
        """Copy `named` into the model (all or nothing), then set the weight version; caller holds `_exclusive`."""
        if "weights" in self._released:
            raise RequestError("memory released (weights); call /resume_memory_occupation first")
        problems = self._check_names([(name, tuple(t.shape)) for name, t in named])
        if problems:
            raise RequestError("cannot load " + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
        targets = self._targets()
        with torch.no_grad():
            for name, tensor in named:
                if "rotary_emb.inv_freq" not in name:
                    targets[name].copy_(tensor)
        if version is not None:
            self.weight_version = str(version)
        return f"Updated {len(named)} tensors." + (f" Weight version updated to {version}." if version is not None
                                                   else "")

    def _weights_call(self, body: dict, run: Callable[[], str]) -> tuple[int, Any]:
        """A weight operation's answer: {"success", "message"}, 200 or 400."""
        self._require_ready()
        try:
            if body.get("abort_all_requests"):
                self._abort_where(lambda r: True, "aborted for a weight update")
            message = run()
        except NotReady:
            raise
        except Exception as exc:  # SGLang answers a failed weight operation with success=false, HTTP 400
            if not isinstance(exc, RequestError):
                logger.warning("weight operation failed", exc_info=True)
            return 400, {"success": False, "message": f"{type(exc).__name__}: {exc}" if not isinstance(
                exc, RequestError) else str(exc)}
        return 200, {"success": True, "message": message}

    def _weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            payloads = body.get("serialized_named_tensors")
            if not isinstance(payloads, list) or not payloads:
                raise RequestError("serialized_named_tensors must be a list with one payload per TP rank")
            fmt = body.get("load_format")
            if fmt not in (None, "direct", "flattened_bucket"):
                raise RequestError(f"load_format={fmt!r} is not supported: null or flattened_bucket")
            obj = wire.deserialize(payloads[0])  # TP 1: rank 0's payload
            named = wire.unflatten_bucket(obj) if fmt == "flattened_bucket" else obj
            if not isinstance(named, (list, tuple)) or not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                    and isinstance(p[1], torch.Tensor) for p in named):
                raise RequestError("serialized_named_tensors must hold a list of (name, tensor) pairs")
            with self._exclusive("update_weights_from_tensor"):
                return self._apply(list(named), body.get("weight_version"))

        return self._weights_call(body, run)

    def _weights_from_disk(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("update_weights_from_disk: model_path is required")
            fmt = body.get("load_format")
            if fmt not in (None, "auto", "safetensors"):
                raise RequestError(f"load_format={fmt!r} is not supported: safetensors files only")
            directory = Path(path).expanduser()
            files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
            if not files:
                raise RequestError(f"model_path={path!r}: no *.safetensors files in that directory")
            from safetensors.torch import load_file

            named = [item for f in files for item in load_file(str(f), device="cpu").items()]
            with self._exclusive("update_weights_from_disk"):
                message = self._apply(named, body.get("weight_version"))
            return message

        status, answer = self._weights_call(body, run)
        answer["num_paused_requests"] = 0
        return status, answer

    def _init_group(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("group_name") or "weight_update_group"
            try:
                address, port = str(body["master_address"]), int(body["master_port"])
                rank, world = int(body.get("rank_offset") or 0), int(body["world_size"])
            except (KeyError, TypeError, ValueError) as exc:
                raise RequestError(f"init_weights_update_group: bad or missing field ({exc})") from None
            backend = body.get("backend") or "nccl"
            with self._cv:
                if name in self._groups or name in self._group_locks:
                    raise RequestError(f"weight update group {name!r} exists; destroy it first")
                self._group_locks[name] = threading.Lock()
            try:
                group = wire.init_update_group(address, port, rank, world, name, backend, self.group_timeout_s)
            except Exception as exc:
                with self._cv:
                    self._group_locks.pop(name, None)
                raise RequestError(f"joining weight update group {name!r} failed: {type(exc).__name__}: {exc}") \
                    from None
            with self._cv:
                self._groups[name] = group
                self._group_devices[name] = self.engine.device if backend == "nccl" else torch.device("cpu")
            return f"Joined weight update group {name!r} as rank {rank} of {world} ({backend})."

        return self._weights_call(body, run)

    def _destroy_group(self, name: str) -> None:
        with self._cv:
            group = self._groups.pop(name, None)
            self._group_locks.pop(name, None)
            self._group_devices.pop(name, None)
        if group is not None:
            wire.destroy_update_group(group)

    def _destroy_group_request(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("group_name") or "weight_update_group"
            if name not in self._groups:
                raise RequestError(f"no weight update group {name!r}")
            self._destroy_group(name)
            return f"Destroyed weight update group {name!r}."

        return self._weights_call(body, run)

    def _weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("group_name") or "weight_update_group"
            group, lock = self._groups.get(name), self._group_locks.get(name)
            if group is None or lock is None:
                raise RequestError(f"no weight update group {name!r}; call /init_weights_update_group first")
            if body.get("load_format") not in (None, "direct"):
                raise RequestError(f"load_format={body.get('load_format')!r} is not supported here: null")
            names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
            if not (len(names) == len(dtypes) == len(shapes)):
                raise RequestError("names, dtypes and shapes must have the same length")
            specs = []
            for tensor_name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
                dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
                if not isinstance(dtype, torch.dtype):
                    raise RequestError(f"{tensor_name}: unknown dtype {dtype_name!r}")
                specs.append((str(tensor_name), dtype, tuple(int(s) for s in shape)))
            problems = self._check_names([(n, s) for n, _, s in specs])
            device = self._group_devices.get(name, torch.device("cpu"))  # gloo: CPU tensors, nccl: CUDA tensors
            received = []
            with lock:  # receive even after a problem, so that the sender's broadcasts complete
                for tensor_name, dtype, shape in specs:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    torch.distributed.broadcast(tensor, src=0, group=group)
                    received.append((tensor_name, tensor))
            if problems:
                raise RequestError("cannot load " + "; ".join(problems[:8]))
            with self._exclusive("update_weights_from_distributed"):
                return self._apply(received, body.get("weight_version"))

        return self._weights_call(body, run)

    def _update_weight_version(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        version = body.get("new_version")
        if version is None:
            raise RequestError("update_weight_version: new_version is required")
        if body.get("abort_all_requests"):
            self._abort_where(lambda r: True, "aborted for a weight version update")
        self.weight_version = str(version)
        return 200, {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}

    # ------------------------------------------------------------------------------------------------- memory

    def _tags(self, body: dict) -> set[str]:
        tags = body.get("tags")
        if tags is None:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS):
            raise RequestError(f"tags={tags!r}: expected null or a list of {', '.join(MEMORY_TAGS)}")
        return set(tags)

    def _release(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            tags = self._tags(body)
            with self._exclusive("release_memory_occupation"):
                with self._cv:
                    if self._queue and self._paused is None:
                        raise RequestError("requests are waiting; pause generation or abort them first")
                if "weights" in tags and "weights" not in self._released:
                    model = self.engine.model
                    self._shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
                    for param in model.parameters():
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                    if self.engine.device.type == "cuda":
                        torch.cuda.empty_cache()
                with self._cv:
                    self._released |= tags
            return f"Released {', '.join(sorted(tags))}."

        return self._weights_call(body, run)

    def _resume(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            tags = self._tags(body)
            with self._exclusive("resume_memory_occupation"):
                if "weights" in tags and "weights" in self._released:
                    for name, param in self.engine.model.named_parameters():
                        param.data = torch.empty(self._shapes[name], dtype=param.dtype, device=param.device)
                    self._shapes.clear()
                with self._cv:
                    self._released -= tags
                    self._cv.notify_all()
            return f"Resumed {', '.join(sorted(tags))} (weights have undefined contents until loaded)."

        return self._weights_call(body, run)
