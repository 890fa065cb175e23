"""A `/generate` request of the embedded server (`relax.serve.sglang.server`): its body read and checked into
rows, one per sample, and each row's answer written back; the errors the HTTP layer answers 400 and 503.

The body (SGLang's `GenerateReqInput`; JSON, unknown fields ignored): `input_ids` (a list, or a list of lists) or
`text`; `sampling_params` (one dict, or one per input) with max_new_tokens, temperature (0: greedy), top_p, top_k
(-1: off), n, stop (a string or a list of them), stop_token_ids, ignore_eos, no_stop_trim, skip_special_tokens,
sampling_seed (unknown ones ignored); `return_logprob` with `top_logprobs_num` (the likeliest tokens at each
position), `token_ids_logprob` (the given tokens at each position: one list, or one per input) and
`logprob_start_len` (the prompt's log-probs from that position on, -1: its last token only), each per input or
one for all; `return_text_in_logprobs`; `rid` (one, or one per input; sample k of an input with n>1 has the id
`<rid>_<k>`, and /abort_request matches either; one rid for two inputs of a batch is a 400, as is a batch whose
inputs ask for different `n`, as SGLang answers them); `stream`; `lora_path` naming the loaded adapter (see
`relax.serve.sglang.weights`); constrained decoding with at most one of `json_schema` (a JSON schema as a string),
`regex`, `ebnf` (xgrammar's EBNF, root rule `root`) and `structural_tag` (xgrammar's structural tag, as JSON), as
SGLang's xgrammar backend reads them (JSON written without free whitespace, `relax.rollout.grammar`; a grammar that
does not compile is a 400), and `require_reasoning` (true: each sample's grammar applies after its reasoning, from
the token after its `</think>`, as SGLang's reasoning grammar backend defers it; the server of a model whose chat
template reasons (`<think>` blocks) acts as SGLang started with a reasoning parser whose reasoning ends at `</think>`;
on another model `require_reasoning=true` is a 400); `image_data` for a
vision-language model (`relax.serve.sglang.images`: each input's images placed into its image placeholders as
SGLang's Qwen-VL processor places them; with images, only the sampled tokens' log-probs are reported, the others a
400); `return_routed_experts` (one, or one per input) on a server of a mixture-of-experts model started with SGLang's
`--enable-return-routed-experts` (a run's `rollout.routing_replay` / `record_routes`; else a 400): the answer's
`meta_info.routed_experts`, as SGLang writes it (`relax.rollout.sglang.routes`: base64 int32 [prompt + output - 1,
layers, k], the experts of every token the engine fed, prompt included). Unlike SGLang, a server with the flag also
answers them to a request that does not mention the field (only `false` opts out): sglang-router 0.3.2 re-serialises
each /generate body from its own request type, which has no `return_routed_experts`, so behind it no request carries
the field. Not supported (400 naming the field):
penalties, min_p, min_new_tokens, stop_regex,
logit_bias, hidden states, input embeddings, images for a text-only model, video, audio, sessions.

The answer: a dict for one input with n=1, else a list, an input's n samples consecutive. `output_ids` include the
stop token, and the token that completed a stop string; `text` leaves out the stop token and cuts the stop string
(unless `no_stop_trim`). A stop string is found, as SGLang finds it, in the decoded tail of the output after each
token; `finish_reason` then is {"type": "stop", "matched": "<the string>"} (a token at the `max_new_tokens` limit
ends with "length" first, as in SGLang). Log-probs (`meta_info`, with `return_logprob`): `output_token_logprobs`
are those the engine drew with (full-vocabulary log-softmax at the temperature; greedy: temperature 1),
`output_top_logprobs` and `output_token_ids_logprobs` are of that same distribution (the alternatives as the engine
drew each token, so a constrained row's are of its grammar's masked distribution, as SGLang's, a token the grammar
disallows never among them; the given tokens' from a forward pass once the row ended, no grammar's mask applied);
the prompt's
(`input_token_logprobs`, `input_top_logprobs`, `input_token_ids_logprobs`, from `logprob_start_len` on, its first
entry None as in SGLang) are at temperature 1, as SGLang computes them. Each entry is [log-prob, token id, text or
None].

Streaming (`stream`: server-sent events, see `relax.serve.sglang.server`): each event is an answer as above for
one sample so far (text, output ids cumulative, `finish_reason` null until its last event), with `index` (its place
in the list answer) unless the answer is a dict. With `return_logprob` each event carries the log-probs so far, with
`top_logprobs_num` their alternatives too (`output_top_logprobs`), as SGLang's events do.

Sampling: the engine runs with seed 0, and row k of a request with `sampling_seed` s draws from the random stream
of sample id `row_stream(s, k)` (`row_stream(s, 0) == s`), so a request gets the same tokens in any batch and
whatever else runs (stop strings only cut them); without `sampling_seed` every row gets a random stream.
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

import torch

from relax.agents.parsers import END_THINK, uses_reasoning
from relax.rollout.grammar import GrammarError, Grammars, GrammarSpec, json_schema_spec
from relax.rollout.sglang.routes import encode as encode_routes
from relax.serve.sglang.images import ImageInputs

GREEDY_EPS = 1e-6  # a temperature below this is greedy (SGLang's rule)
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_TOP_LOGPROBS = 20
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
# sampling parameters the engine does not implement: accepted only at these (neutral) values
_NEUTRAL_SAMPLING = {"min_new_tokens": (0,), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
                     "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "stop_regex": ("", ()),
                     "logit_bias": ()}
# sampling params of constrained decoding: at most one (structural_tag: xgrammar's JSON form, as SGLang takes it)
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# request fields the server does not implement: accepted only at these values
_NEUTRAL_REQUEST = {"return_hidden_states": (False,), "input_embeds": (), "image_data": (), "video_data": (),
                    "audio_data": (), "lora_path": (), "session_params": ()}

Alts = list[tuple[float, int]]  # (log-prob, token id) of some tokens at one position


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
    top_logprobs: int = 0  # top_logprobs_num: the likeliest tokens' log-probs at each position
    token_ids: Optional[tuple[int, ...]] = None  # token_ids_logprob: these tokens' log-probs at each position
    logprob_start: int = -1  # logprob_start_len: the first prompt position reported (-1: the last one)
    stop: tuple[str, ...] = ()  # stop strings
    routed_experts: bool = False  # return_routed_experts: the experts of every token fed, in meta_info


@dataclass
class Extras:
    """A row's log-probs beyond its sampled tokens' (`relax.serve.sglang.positions`): at each reported prompt
    position after the first (`input_*`) and at each output position (`output_*`)."""

    input_tokens: list[float] = field(default_factory=list)
    input_top: list[Alts] = field(default_factory=list)
    input_ids: list[Alts] = field(default_factory=list)
    output_top: list[Alts] = field(default_factory=list)
    output_ids: list[Alts] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One /generate request: its rows, `done` once every row ended, `progress` set at each change of its rows
    (a token, an end) for a stream to look."""

    rows: list[Row]
    single: bool  # one input, n=1: the answer is a dict
    t0: float
    stream: bool = False
    probe: bool = False  # a health check's generation: a memory release aborts it rather than wait for it
    done: threading.Event = field(default_factory=threading.Event)
    progress: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None
    error_status: int = 500  # the HTTP status of `error`: 400 where the request is at fault (a grammar's dead end)
    error_code: Optional[str] = None  # the answer's error code (a grammar's dead end: DEAD_END_CODE)


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
    live: list[int] = field(default_factory=list)  # tokens drawn by the engine call running now (not in `tokens`)
    live_logps: list[float] = field(default_factory=list)  # their log-probs (a streamed row with return_logprob)
    # with top_logprobs_num: each output token's likeliest alternatives as the engine drew it (`top`; `live_top`:
    # those of `live`), the distribution its log-prob is of (`relax.rollout.embedded._Turns.note_top`)
    top: list[Alts] = field(default_factory=list)
    live_top: list[Alts] = field(default_factory=list)
    finish: Optional[dict] = None
    matched: Optional[str] = None  # the stop string its output completed
    abort: Optional[str] = None  # set once an abort was asked: the message of its finish_reason
    extra: Optional[Extras] = None  # computed once it ended, when its options ask for them (`needs_extras`)
    version: Optional[str] = None  # the weight version that generated its tokens
    matcher: Any = None  # its grammar's state (relax.rollout.grammar.Matcher; None: unconstrained)
    vision: Optional[dict] = None  # its input's images as the engine takes them (`relax.serve.sglang.images`)
    # the experts its prompt and output tokens were routed to, [prompt + output, layers, k] (return_routed_experts;
    # the engine call that generated it last fed them all; its last token's entry is missing: never fed)
    routes: Any = None

    @property
    def watched(self) -> bool:
        """Whether the engine must show its tokens as they come (stop strings, a stream of its tokens, the likeliest
        alternatives of each: top_logprobs_num)."""
        return bool(self.options.stop) or self.request.stream or self.wants_top > 0

    @property
    def wants_top(self) -> int:
        """How many alternatives the engine reports with each token it draws (top_logprobs_num; 0: none)."""
        return self.options.top_logprobs if self.options.return_logprob else 0

    def engine_top(self) -> bool:
        """Whether the engine reported the alternatives of every output token (`top`)."""
        return self.wants_top > 0 and len(self.top) == len(self.tokens)

    def tail(self, n: int) -> list[int]:
        """The last `n` tokens of its output so far (`tokens`, then `live`)."""
        live = self.live[-n:]
        rest = n - len(live)
        return (self.tokens[-rest:] if rest else []) + live

    def needs_extras(self) -> bool:
        """Whether its answer needs log-probs the engine does not give (`Extras`)."""
        o = self.options
        return o.return_logprob and bool((o.top_logprobs and not self.engine_top()) or o.token_ids is not None
                                         or 0 <= o.logprob_start < len(self.prompt) - 1)


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


def _per_input(name: str, value: Any, default: Any, n_in: int) -> list:
    """`value` for each of `n_in` inputs: a list holds one per input, anything else is for all (None: `default`)."""
    if isinstance(value, list):
        if len(value) != n_in:
            raise RequestError(f"{name} has {len(value)} entries for {n_in} inputs")
        return [default if v is None else v for v in value]
    return [default if value is None else value] * n_in


def _rids(rid: Any, n_in: int) -> list[Optional[str]]:
    if isinstance(rid, str) and n_in > 1:
        return [f"{rid}_{i}" for i in range(n_in)]
    return [None if r is None else str(r) for r in _per_input("rid", rid, None, n_in)]


def _check_batch(rids: list[Optional[str]], sps: list) -> None:
    """What SGLang refuses of a batch (its `GenerateReqInput` checks, HTTP 400): one rid given to two inputs, and
    inputs asking for different numbers of samples (`n`: SGLang samples a batch's inputs n times each)."""
    given = [r for r in rids if r is not None]
    if len(set(given)) != len(given):
        twice = sorted({r for r in given if given.count(r) > 1})
        raise RequestError(f"rid: duplicate request ids in one batch: {twice}")
    ns = {sp.get("n", 1) if isinstance(sp, dict) and sp.get("n") is not None else 1 for sp in sps}
    if len(ns) > 1:
        raise RequestError(f"sampling_params: n differs between the inputs of one batch ({sorted(ns, key=str)}); "
                           "SGLang samples every input of a batch the same number of times")


def _stops(sp: dict) -> tuple[str, ...]:
    """sampling_params.stop: a string or a list of strings (empty ones stop nothing)."""
    stop = sp.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"sampling_params.stop={stop!r}: expected a string or a list of strings")
    return tuple(s for s in stops if s)


class RequestCodec:
    """Reads /generate bodies into rows and writes rows' answers, for one model: its tokenizer (used under a lock),
    vocabulary size, context length (None: unknown) and stop tokens; `processor`: a vision-language model's
    (`relax.data.images.load_processor`), which `image_data` needs."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_length: Optional[int],
                 eos_token_ids: tuple[int, ...], processor: Any = None, routed_experts: bool = False):
        """`routed_experts`: the server records the experts each token is routed to (SGLang's
        `--enable-return-routed-experts`), and answers them unless `return_routed_experts` is false (see the module
        docstring)."""
        self.tokenizer = tokenizer
        # where a sample's reasoning ends (require_reasoning): the tokens of </think> when the template reasons
        self.think_end: tuple[int, ...] = tuple(tokenizer.encode(END_THINK, add_special_tokens=False)) \
            if uses_reasoning(tokenizer) else ()
        self.routed_experts = routed_experts
        self.images = None if processor is None else ImageInputs(processor, RequestError)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_token_ids = eos_token_ids
        self._tokenizer_lock = threading.Lock()
        self.grammars = Grammars(tokenizer, vocab_size)  # the vocabulary read at the first grammar

    # ------------------------------------------------------------------------------------------------ reading

    def parse(self, body: dict) -> Request:
        """The rows of a /generate body (RequestError naming what is wrong or unsupported)."""
        for name, neutral in _NEUTRAL_REQUEST.items():
            v = body.get(name)
            if name == "image_data" and self.images is not None:
                continue
            if not _neutral(v, neutral):
                shown = v if len(repr(v)) < 80 else f"{repr(v)[:60]}..."
                why = "the model is text-only" if name == "image_data" else "it is not supported by the embedded server"
                raise RequestError(f"{name}={shown}: {why}")
        inputs, single = self._inputs(body)
        n_in = len(inputs)
        visions: list[Optional[dict]] = [None] * n_in
        if self.images is not None:  # each input's images placed into its placeholders (relax.serve.sglang.images)
            images = self.images.per_input(body.get("image_data"), n_in, single)
            for i in range(n_in):
                inputs[i], visions[i] = self.images.place(inputs[i], images[i], f"input {i}")
        sps = _per_input("sampling_params", body.get("sampling_params"), {}, n_in)
        logprobs = _per_input("return_logprob", body.get("return_logprob"), False, n_in)
        starts = _per_input("logprob_start_len", body.get("logprob_start_len"), -1, n_in)
        tops = _per_input("top_logprobs_num", body.get("top_logprobs_num"), 0, n_in)
        id_lists = self._token_id_lists(body.get("token_ids_logprob"), n_in)
        text_in_logprobs = bool(body.get("return_text_in_logprobs"))
        routed = _per_input("return_routed_experts", body.get("return_routed_experts"), self.routed_experts, n_in)
        if any(not isinstance(r, bool) for r in routed):
            raise RequestError(f"return_routed_experts={body.get('return_routed_experts')!r}: expected true or false "
                               "(or one per input)")
        if any(routed) and not self.routed_experts:
            raise RequestError("return_routed_experts=true needs a server of a mixture-of-experts model started with "
                               "--enable-return-routed-experts (a run's rollout.routing_replay or "
                               "rollout.record_routes)")
        rids = _rids(body.get("rid"), n_in)
        _check_batch(rids, sps)
        think_end = self._think_end(body.get("require_reasoning"))
        request = Request(rows=[], single=False, t0=time.perf_counter(), stream=bool(body.get("stream")))
        for i, (prompt, sp, item_rid) in enumerate(zip(inputs, sps, rids, strict=True)):
            if not isinstance(sp, dict):
                raise RequestError("sampling_params must be an object (or one per input)")
            key, max_new, n, seed, options = self._sampling(sp, len(prompt), bool(logprobs[i]), text_in_logprobs)
            options = self._logprob_options(options, len(prompt), starts[i], tops[i], id_lists[i])
            if routed[i]:
                options = dataclasses.replace(options, routed_experts=True)
            if visions[i] is not None and options.return_logprob and (
                    options.top_logprobs or options.token_ids is not None or options.logprob_start >= 0):
                raise RequestError("top_logprobs_num, token_ids_logprob and logprob_start_len >= 0 are not supported "
                                   "with image_data by the embedded server (the sampled tokens' log-probs are)")
            grammar = self._grammar(sp)
            item_rid = item_rid or uuid.uuid4().hex
            for k in range(n):
                stream = row_stream(seed, k) if seed is not None else secrets.randbits(63)
                row = Row(request=request, rid=item_rid, id=item_rid if n == 1 else f"{item_rid}_{k}",
                          prompt=prompt, stream=stream, max_new=max_new, key=key, options=options,
                          vision=visions[i])
                if grammar is not None:  # each row its own state; the compiled grammar shared
                    with self._tokenizer_lock:
                        row.matcher = self.grammars.matcher(grammar, key[3], think_end)
                if max_new == 0:
                    row.finish = {"type": "length", "length": 0}
                request.rows.append(row)
        request.single = single and len(request.rows) == 1
        return request

    def _think_end(self, require_reasoning: Any) -> tuple[int, ...]:
        """The tokens after which a sample's grammar starts: those of `</think>` with `require_reasoning`, none
        without it (the grammar from the first token)."""
        if require_reasoning in (None, False):
            return ()
        if require_reasoning is not True:
            raise RequestError(f"require_reasoning={require_reasoning!r}: expected true or false")
        if not self.think_end:
            raise RequestError("require_reasoning=true: the model's chat template has no reasoning (<think> blocks), "
                               "so no answer's reasoning ends for a grammar to start after")
        return self.think_end

    def _grammar(self, sp: dict) -> Optional[GrammarSpec]:
        """The grammar of one input's sampling_params (json_schema, regex, ebnf or structural_tag; SGLang allows
        one), compiled now so that a bad one is a 400; None without one."""
        given = [name for name in GRAMMAR_FIELDS if sp.get(name) not in (None, "")]
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"sampling_params: {' and '.join(given)} given; constrained decoding takes one of "
                               f"{', '.join(GRAMMAR_FIELDS)}")
        name, value = given[0], sp[given[0]]
        try:
            if name == "json_schema":
                spec = json_schema_spec(value)
            elif isinstance(value, str):
                spec = GrammarSpec(name, value)
            else:
                raise GrammarError(f"expected a string, not {type(value).__name__}")
            with self._tokenizer_lock:
                self.grammars.compile(spec)
        except GrammarError as exc:
            raise RequestError(f"sampling_params.{name}: {exc}") from None
        return spec

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
            self._check_ids("input_ids", p)
        return [list(map(int, p)) for p in inputs], single

    def _check_ids(self, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{name}: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")

    def _token_id_lists(self, value: Any, n_in: int) -> list[Optional[tuple[int, ...]]]:
        """token_ids_logprob: one list of token ids for every input, or one per input (None: none asked)."""
        if value is None:
            return [None] * n_in
        per_input = isinstance(value, list) and bool(value) and isinstance(value[0], list)
        lists = _per_input("token_ids_logprob", value, None, n_in) if per_input else [value] * n_in
        for ids in lists:
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                raise RequestError(f"token_ids_logprob={value!r}: expected a list of token ids, or one per input")
            self._check_ids("token_ids_logprob", ids)
        return [tuple(map(int, ids)) for ids in lists]

    @staticmethod
    def _logprob_options(options: Options, prompt_len: int, start: Any, top: Any,
                         token_ids: Optional[tuple[int, ...]]) -> Options:
        """`options` with one input's logprob_start_len, top_logprobs_num and token_ids_logprob."""
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num={top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not _is_int(start) or start < -1:
            raise RequestError(f"logprob_start_len={start!r} must be an integer >= -1 (-1: the output only)")
        for name, asked in (("top_logprobs_num", top), ("token_ids_logprob", token_ids is not None)):
            if asked and not options.return_logprob:
                raise RequestError(f"{name} needs return_logprob=true")
        if not options.return_logprob:
            return options
        if start >= prompt_len:
            raise RequestError(f"logprob_start_len={start} is higher than the number of input tokens "
                               f"({prompt_len}); use a smaller logprob_start_len")
        return dataclasses.replace(options, top_logprobs=int(top), token_ids=token_ids, logprob_start=int(start))

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
                          no_stop_trim=bool(sp.get("no_stop_trim")), text_in_logprobs=text_in_logprobs,
                          stop=_stops(sp))
        return key, max_new, n, seed, options

    # ------------------------------------------------------------------------------------------ stop strings

    def stop_match(self, row: Row) -> Optional[str]:
        """The first of `row`'s stop strings in the decoded tail of its output so far (SGLang's check: a tail of
        more characters than the longest stop string), or None."""
        longest = max(len(s) for s in row.options.stop)
        n, drawn = longest + 1, len(row.tokens) + len(row.live)
        with self._tokenizer_lock:
            tail = self.tokenizer.decode(row.tail(n))
            while len(tail) <= longest and n < drawn:  # tokens of no text (special ones, partial characters)
                n *= 2
                tail = self.tokenizer.decode(row.tail(n))
        return next((s for s in row.options.stop if s in tail), None)

    # ------------------------------------------------------------------------------------------------ writing

    def answer(self, row: Row, request: Request, weight_version: str) -> dict:
        """The answer of one ended row; `weight_version` stands in for a row that generated nothing."""
        finish = row.finish or {"type": "abort", "message": "unfinished"}
        meta = self._meta(row, request, finish, len(row.tokens), weight_version)
        with self._tokenizer_lock:
            text = self._text(row, finish)
            if row.options.return_logprob:
                meta.update(self._logprobs(row))
        if row.options.routed_experts:  # every token fed: the prompt, the output but its last token
            fed = len(row.prompt) + max(len(row.tokens) - 1, 0)
            routes = row.routes[:fed] if row.routes is not None else None
            if routes is None or routes.shape[0] < fed:  # a row that generated nothing was never fed
                meta["routed_experts"] = encode_routes(torch.zeros(0, 0, 0, dtype=torch.int32))
            else:
                meta["routed_experts"] = encode_routes(routes)
        return {"text": text, "output_ids": list(row.tokens), "meta_info": meta}

    def progress(self, row: Row, request: Request, tokens: list[int], logps: list[float],
                 top: Optional[list[Alts]], weight_version: str) -> dict:
        """A stream's answer of a row that has drawn `tokens` (with log-probs `logps`, and with top_logprobs_num
        their alternatives `top`) so far and goes on (a character still incomplete at the end of the text left out).
        With return_logprob it carries the log-probs of every token so far, as SGLang's events do:
        `output_token_logprobs`, `output_top_logprobs` (the engine draws them with the tokens), and
        `input_token_logprobs` where they need no forward pass (logprob_start_len -1); the prompt's earlier
        positions and token_ids_logprob come with the final answer."""
        meta = self._meta(row, request, None, len(tokens), weight_version)
        o = row.options
        with self._tokenizer_lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=o.skip_special_tokens)
            if o.return_logprob:
                meta["output_token_logprobs"] = self._entries(zip(logps, tokens, strict=True), o)
                if top is not None:
                    meta["output_top_logprobs"] = [self._entries(a, o) for a in top]
                if o.logprob_start < 0:
                    meta["input_token_logprobs"] = self._entries([(None, row.prompt[-1])], o)
        return {"text": text.rstrip("\ufffd"), "output_ids": list(tokens), "meta_info": meta}

    @staticmethod
    def _meta(row: Row, request: Request, finish: Optional[dict], n_tokens: int, weight_version: str) -> dict:
        return {"id": row.id, "finish_reason": finish, "prompt_tokens": len(row.prompt),
                "completion_tokens": n_tokens, "cached_tokens": 0,
                "weight_version": row.version if row.version is not None else weight_version,
                "e2e_latency": time.perf_counter() - request.t0}

    def _text(self, row: Row, finish: dict) -> str:
        """The decoded output (caller holds the tokenizer lock): without the stop token, cut before the stop string
        (unless no_stop_trim), as SGLang's detokenizer writes it."""
        matched = finish.get("matched") if finish["type"] == "stop" and not row.options.no_stop_trim else None
        ids = row.tokens[:-1] if _is_int(matched) else row.tokens
        text = self.tokenizer.decode(ids, skip_special_tokens=row.options.skip_special_tokens)
        at = text.find(matched) if isinstance(matched, str) else -1
        return text[:at] if at >= 0 else text

    def _logprobs(self, row: Row) -> dict[str, Any]:
        """meta_info's log-probs of an ended row (caller holds the tokenizer lock); the prompt's first reported
        position has none (None), as in SGLang."""
        o, extra = row.options, row.extra or Extras()
        start = o.logprob_start if o.logprob_start >= 0 else len(row.prompt) - 1
        meta: dict[str, Any] = {
            "input_token_logprobs": self._entries(zip([None, *extra.input_tokens], row.prompt[start:], strict=True),
                                                  o),
            "output_token_logprobs": self._entries(zip(row.logps, row.tokens, strict=True), o)}
        if o.top_logprobs:
            meta["input_top_logprobs"] = [None, *(self._entries(a, o) for a in extra.input_top)]
            # as the engine drew each token (as the stream sent them), else computed once it ended
            output_top = row.top if row.engine_top() else extra.output_top
            meta["output_top_logprobs"] = [self._entries(a, o) for a in output_top]
        if o.token_ids is not None:
            meta["input_token_ids_logprobs"] = [None, *(self._entries(a, o) for a in extra.input_ids)]
            meta["output_token_ids_logprobs"] = [self._entries(a, o) for a in extra.output_ids]
        return meta

    def _entries(self, pairs: Any, options: Options) -> list[list]:
        """[log-prob, token id, its text (return_text_in_logprobs) or None] of each (log-prob, token id)."""
        return [[lp, t, self.tokenizer.decode([t]) if options.text_in_logprobs else None] for lp, t in pairs]
