"""A `/generate` request of the embedded server (`relax.backends.sglang.server`): its body read and checked into
rows, one per sample, and each row's answer written back; the errors the HTTP layer answers 400 and 503.

The body (SGLang's `GenerateReqInput`; JSON, unknown fields ignored): `input_ids` (a list, or a list of lists) or
`text`; `sampling_params` (one dict, or one per input) with max_new_tokens, temperature (0: greedy), top_p, top_k
(-1: off), n, stop_token_ids, ignore_eos, no_stop_trim, skip_special_tokens, sampling_seed (unknown ones ignored);
`return_logprob` and `top_logprobs_num` (the likeliest tokens' log-probs at each output position, under the
same distribution as the sampled token's: `output_top_logprobs`); `rid` (one, or one per input; sample k of an
input with n>1 has the id `<rid>_<k>`, and /abort_request matches either). The answer: a dict for one input with
n=1, else a list, an input's n samples consecutive. `output_ids` include the stop token. Not supported (400 naming
the field): stream, logprob_start_len other than -1, token_ids_logprob, stop strings, penalties, min_p,
min_new_tokens, constrained decoding, images, LoRA.

Sampling: the engine runs with seed 0, and row k of a request with `sampling_seed` s draws from the random stream
of sample id `row_stream(s, k)` (`row_stream(s, 0) == s`), so a request gets the same tokens in any batch and
whatever else runs; without `sampling_seed` every row gets a random stream.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

GREEDY_EPS = 1e-6  # a temperature below this is greedy (SGLang's rule)
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_TOP_LOGPROBS = 20
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
# sampling parameters the engine does not implement: accepted only at these (neutral) values
_NEUTRAL_SAMPLING = {"min_new_tokens": (0,), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
                     "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "stop": ("", ()),
                     "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (), "logit_bias": ()}
# request fields the server does not implement: accepted only at these values
_NEUTRAL_REQUEST = {"token_ids_logprob": (), "return_hidden_states": (False,),
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
class Options:
    """How one row's answer is written."""

    return_logprob: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    text_in_logprobs: bool
    top_logprobs: int = 0  # top_logprobs_num: the likeliest tokens' log-probs at each output position


@dataclass(eq=False)
class Request:
    """One /generate request: its rows, and `done` once every row ended."""

    rows: list[Row]
    single: bool  # one input, n=1: the answer is a dict
    t0: float
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None


@dataclass(eq=False)
class Row:
    """One sample of one input of a request."""

    request: Request
    rid: str  # the input's rid (abort_request matches it, or `id`)
    id: str  # this sample's id (meta_info.id)
    prompt: list[int]
    stream: int  # engine sample id
    max_new: int
    key: tuple  # (temperature, top_p, top_k, stop ids): rows with one key share an engine call
    options: Options
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: Optional[dict] = None
    abort: Optional[str] = None  # set once an abort was asked: the message of its finish_reason
    top: Optional[list[list[tuple[float, int]]]] = None  # per output token: (log-prob, id) of the likeliest tokens
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


class RequestCodec:
    """Reads /generate bodies into rows and writes rows' answers, for one model: its tokenizer (used under a lock),
    vocabulary size, context length (None: unknown) and stop tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_length: Optional[int],
                 eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_token_ids = eos_token_ids
        self._tokenizer_lock = threading.Lock()

    def parse(self, body: dict) -> Request:
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
        top = body.get("top_logprobs_num") or 0
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num={top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        request = Request(rows=[], single=False, t0=time.perf_counter())
        for prompt, sp, logprob, item_rid in zip(inputs, sps, logprobs, rids, strict=True):
            if not isinstance(sp, dict):
                raise RequestError("sampling_params must be an object (or one per input)")
            key, max_new, n, seed, options = self._sampling(sp, len(prompt), bool(logprob), text_in_logprobs)
            if top:
                if not logprob:
                    raise RequestError("top_logprobs_num needs return_logprob=true")
                options = dataclasses.replace(options, top_logprobs=int(top))
            item_rid = item_rid or uuid.uuid4().hex
            for k in range(n):
                stream = row_stream(seed, k) if seed is not None else secrets.randbits(63)
                row = Row(request=request, rid=item_rid, id=item_rid if n == 1 else f"{item_rid}_{k}",
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
                  text_in_logprobs: bool) -> tuple[tuple, int, int, Optional[int], Options]:
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
        options = Options(return_logprob=logprob, skip_special_tokens=sp.get("skip_special_tokens") is not False,
                          no_stop_trim=bool(sp.get("no_stop_trim")), text_in_logprobs=text_in_logprobs)
        return key, max_new, n, seed, options

    def answer(self, row: Row, request: Request, weight_version: str) -> dict:
        """The answer of one ended row; `weight_version` stands in for a row that generated nothing."""
        finish = row.finish or {"type": "abort", "message": "unfinished"}
        ids = list(row.tokens)
        if finish["type"] == "stop" and not row.options.no_stop_trim:
            ids = ids[:-1]
        meta: dict[str, Any] = {
            "id": row.id, "finish_reason": finish, "prompt_tokens": len(row.prompt),
            "completion_tokens": len(row.tokens), "cached_tokens": 0,
            "weight_version": row.version if row.version is not None else weight_version,
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
            if row.options.top_logprobs:
                with self._tokenizer_lock:
                    meta["output_top_logprobs"] = [
                        [[lp, t, self.tokenizer.decode([t]) if row.options.text_in_logprobs else None]
                         for lp, t in alts] for alts in (row.top or [])]
        return {"text": text, "output_ids": list(row.tokens), "meta_info": meta}
