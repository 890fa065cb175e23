"""The OpenAI endpoints over any engine that speaks SGLang's `/generate` (token ids in, token ids and log-probs out):
`relax-serve` calls its own engine, the training gateway (`relax.serve.openai.gateway`) the rollout's servers
through the router.

A request becomes one `/generate` payload per choice (`n` of them, each with its own random stream: `seed` gives
choice k the stream `row_stream(seed, k)`, the same as SGLang's n>1), with the prompt as token ids: the chat
template is applied here, so the engine's tokens are exactly the ones the answer (and a training session) records.
Within a session (`relax.serve.openai.sessions`), the session decides the prompt tokens (reusing what was sampled
before), the sampling and the limits, and records every call.

A streamed answer (`stream`) is written as its tokens are drawn where the engine streams (`StreamSend`: relax-serve),
outside a session (with top_logprobs: each token once the engine has sent its alternatives too); otherwise once the
whole answer is generated. Either way by the same
writer (`_chat_chunks`, `_completion_chunks`): `relax.serve.openai.deltas` decides what of each choice may be sent (a
finished answer's tokens fed at once), and its end (the choice, its tool calls, finish reason and usage) is computed
by the same code as the unstreamed answer's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional, Protocol

from relax.agents.parsers import HARMONY_TOKENS, harmony_content, harmony_reasoning, parser_format
from relax.batch import FinishReason
from relax.rollout.grammar import (
    GrammarError,
    Grammars,
    GrammarSpec,
    ToolSchemaError,
    _xgrammar_of,
    after_reasoning,
    at_most_one_call,
    calls_in_text,
    harmony_final,
    strict_calls,
    tool_call_ebnf,
    tool_calls_or,
)
from relax.serve.http import EventSource, EventStream
from relax.serve.openai.chat import END_THINK, ChatFormat, split_reasoning
from relax.serve.openai.deltas import Delta, TextDeltas
from relax.serve.openai.images import naming_parts, take_images
from relax.serve.openai.protocol import (
    APIError,
    Choice,
    ContextLengthError,
    ImagePartError,
    Params,
    StreamError,
    chat_answer,
    check_image_parts,
    completion_answer,
    indexed_calls,
    new_id,
    normalize_message,
    parse_chat,
    parse_completion,
    sse,
    token_logprob,
)
from relax.serve.sglang.request import row_stream

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128  # without max_tokens, a known context length or a cap (SGLang's /generate default)
# SGLang's finish_reason.type (its wire strings, left) -> Sampled.finish; any other type reads as ABORT
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass
class Sampled:
    """One choice as the engine generated it."""

    tokens: list[int]
    logprobs: list[float]
    finish: FinishReason  # STOP | LENGTH | ABORT
    version: int
    top: Optional[list[list[tuple[float, int]]]] = None  # per token: (log-prob, token id) of the likeliest
    stop_string: Optional[str] = None  # the stop string that ended it (finish STOP without a stop token)
    prompt_tokens: Optional[int] = None  # the engine's count of the prompt (with images: their image tokens)
    # per token, 1 where the request's grammar constrained it (`relax.rollout.grammar.Grammars.constrained`); set for
    # a training session's calls sampled under a grammar, None otherwise (no token constrained)
    constrained: Optional[list[int]] = None


class Session(Protocol):
    """What a training session decides for the calls made in it (`relax.serve.openai.sessions.Session`)."""

    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]], fmt: ChatFormat,
                    template_kwargs: Optional[dict] = None,
                    offered: Optional[list[dict]] = None) -> tuple[list[int], Any]:
        """The prompt tokens of a chat call (rendered with the request's chat_template_kwargs) and what `record`
        needs to file it; `offered`: the tools the request lists (with tool_choice "none" they are not `tools`)."""

    def completion_prompt(self, prompt: Any, fmt: ChatFormat) -> tuple[list[int], Any]: ...

    def admit(self, p: Params, prompt_len: int, limit: int, context: Any) -> tuple[Params, int, list[int]]:
        """The call's sampling (the run's), its token limit (at most `limit`) and one seed per choice; APIError
        past a limit. `context`: what the prompt method returned with the prompt."""

    def record(self, context: Any, prompt: list[int], choices: list[tuple[Sampled, Choice, Optional[dict]]]) -> None:
        """A finished call: each choice as sampled, as answered, and (chat) its normalized assistant message."""


# `OpenAIService`'s `stream`: the /generate payloads submitted at once (APIError for a refused one), and an iterator of
# their stream's events: each the answer so far of payload `event["index"]` (finish_reason null while it goes on: its
# tokens and their log-probs so far, cumulative), then its final answer (as `send` returns it); an error on the way
# raises the APIError `send` raises for it (an event {"error": {"message"}} is a 500); closing it early aborts what
# still runs.
StreamSend = Callable[[list[dict]], Iterator[dict]]
# What a stream's writer reads of a choice (`OpenAIService._progress`, `_answered`): (its index, its tokens and their
# log-probs so far, with top_logprobs their alternatives (token text, log-prob) so far (None: none asked), and None
# while it goes on; at its end, its `Sampled` and `Choice` (whose tokens are the answer's)).
Drawn = tuple[int, list[int], list[float], Optional[list[list[tuple[str, float]]]], Optional[tuple[Sampled, Choice]]]


class OpenAIService:
    """`send(payloads)` answers SGLang `/generate` payloads in order (raising APIError for a refused one);
    `context_length` (None: unknown) bounds prompt + max_tokens; `max_tokens` caps every call (None: no cap).
    `images`: a vision-language model's engine, which takes OpenAI image content parts outside a training session
    (`relax.serve.openai.images`). `stream` (`StreamSend`; relax-serve's engine has one): with it, a streamed answer
    outside a training session is written as its tokens are drawn (`relax.serve.openai.deltas`); without it (the
    training gateway), once the whole answer is generated."""

    def __init__(self, fmt: ChatFormat, send: Callable[[list[dict]], list[dict]], *, model: str,
                 context_length: Optional[int], max_tokens: Optional[int] = None, default_version: int = 0,
                 images: bool = False, stream: Optional[StreamSend] = None):
        self.fmt, self.send, self.model, self.images, self.stream = fmt, send, model, images, stream
        self.context_length, self.max_tokens, self.default_version = context_length, max_tokens, default_version
        self.created = int(time.time())  # the model object's `created`: when this service began serving it
        self._grammar_replay: Optional[Grammars] = None  # `_grammars`

    def card(self) -> dict:
        """The served model as OpenAI's model object (and SGLang's max_model_len)."""
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "relax",
                "max_model_len": self.context_length}

    def models(self) -> dict:
        return {"object": "list", "data": [self.card()]}

    def model_card(self, model: str) -> dict:
        """GET /v1/models/{model}: the served model's object; OpenAI's 404 (model_not_found) for another id."""
        if model != self.model:
            raise APIError(f"The model '{model}' does not exist", status=404, param="model", code="model_not_found")
        return self.card()

    # --------------------------------------------------------------------------------------------- endpoints
    def chat(self, body: Any, session: Optional[Session] = None) -> tuple[int, Any]:
        p, answer = self._chat(body, session)
        return 200, _streamed(answer) if p.stream else answer

    def chat_stream(self, body: dict, session: Optional[Session] = None) -> Iterator[dict]:
        """The `chat.completion.chunk` objects of a chat request (`body` with stream true), as they come."""
        return iter(self._chat(body, session)[1])

    def _chat(self, body: Any, session: Optional[Session]) -> tuple[Params, Any]:
        """(the request's parameters, its answer: a chat.completion, or with stream its chunks: a list once the
        answer is generated, or an iterator that makes them as the tokens are drawn)."""
        image_data: list[str] = []
        places: list[str] = []  # the message part each image came from
        if self.images and session is None:  # image parts: placeholders in the text, the images to the engine
            check_image_parts(body)
            body, image_data, places = take_images(body)
        try:
            messages, p = parse_chat(body)
        except ImagePartError as exc:  # an image part left in the messages: say why (a session; a text-only model)
            if session is not None:
                raise exc.in_session() from None
            raise (exc if self.images else exc.text_only(self.model)) from None
        if image_data and p.top_logprobs:  # the engine's limit (relax.serve.sglang.request), in this route's terms
            raise APIError(f"top_logprobs={p.top_logprobs}: not supported with image parts (relax-serve's engine "
                           "gives an image prompt's sampled tokens' log-probs, logprobs=true, not their likeliest "
                           "alternatives)", param="top_logprobs")
        # the request's own keys (not those reasoning_effort "none" adds): each a variable the template reads
        self.fmt.check_template_kwargs(body.get("chat_template_kwargs"))
        if p.reasoning_effort is not None:  # the template variable where the template reads it, else a 400 but "none"
            p.template_kwargs = self.fmt.effort_variables(p.reasoning_effort, p.template_kwargs or {}) or None
        if p.verbosity is not None:  # likewise: the template variable where the template reads it, else "medium" only
            p.template_kwargs = self.fmt.verbosity_variables(p.verbosity, p.template_kwargs or {}) or None
        if p.thinking_off:
            self._check_thinking_off(p.template_kwargs or {})
        if self.fmt.single_call:  # its chat template refuses two calls in a message (Llama 3.x): one call at most
            p.parallel_tool_calls = False
        # tool_choice allowed_tools: the calls' grammar is written over the listed tools only, while every tool
        # stays in the prompt (OpenAI's: the tools list is left whole for prompt caching)
        callable_ = p if p.allowed is None else replace(p, tools=[t for t in p.tools or []
                                                                  if t["function"]["name"] in p.allowed])
        if p.grammar is not None:  # the request's own format compiles, or a 400 naming it
            self._check_format(p.grammar, body)
            if self.fmt.harmony:  # gpt-oss answers a format in its final channel (reasoning first, or not)
                final = harmony_final(GrammarSpec(*p.grammar))
                p.grammar = (final.kind, final.source)
        if p.tool_choice is not None:  # a forced call: the grammar of calls in the tool parser's format
            p.grammar = ("ebnf", self._tool_call_grammar(callable_))
        elif p.tools and p.grammar is not None:  # tool_choice auto and a format: the calls or the format's content
            p.grammar = self._calls_or_format_grammar(callable_)
        elif p.tools and not p.parallel_tool_calls:  # at most one call, then the answer ends
            p.grammar = self._one_call_grammar(callable_)
        elif p.allowed is not None:  # free text whose calls are calls of the listed tools
            p.grammar = self._allowed_calls_grammar(callable_)
        elif p.tools and any(t["function"].get("strict") is True for t in p.tools):  # strict tools: calls constrained
            p.grammar = self._strict_calls_grammar(p)
        if session is not None:
            prompt, context = session.chat_prompt(messages, p.tools, self.fmt, p.template_kwargs,
                                                   offered=body.get("tools") or None)
        else:
            prompt, context = self.fmt.prompt(messages, p.tools, p.template_kwargs), None
        if p.grammar is not None and self.fmt.reasoning:  # a reasoning model reasons before its constrained answer
            p.grammar = self._after_reasoning(p.grammar, prompt)
        try:  # an image the engine refuses: a 400 naming its message part
            if self._incremental(p, session):
                payloads, p = self._payloads(prompt, p, session, context, image_data)
                events = self.stream(payloads)  # submitted now: a refused request is an error answer, not a stream
                drawn = self._progress(events, lambda s: self._chat_choice(s, prompt, p), p.top_logprobs)
                # an error on the way is the one the same request unstreamed raises (`_refused`)
                named = partial(_refused, body=body, p=p, places=places)
                return p, _Closing(self._chat_chunks(drawn, prompt, p, bool(image_data), named), events)
            sampled, p = self._generate(prompt, p, session, context, image_data)
        except APIError as exc:
            raise _refused(exc, body, p, places) from None
        if session is not None:
            self._mark_constrained(sampled, p)
        choices = [self._chat_choice(s, prompt, p) for s in sampled]
        if session is not None:
            session.record(context, prompt, [
                (s, c, normalize_message({"role": "assistant", "content": c.text or None,
                                          "tool_calls": c.tool_calls}))
                for s, c in zip(sampled, choices, strict=True)])
        if p.stream:
            return p, list(self._chat_chunks(_answered(sampled, choices), prompt, p, bool(image_data)))
        prompt_len = sampled[0].prompt_tokens if image_data and sampled[0].prompt_tokens else len(prompt)
        return p, chat_answer(choices, p, prompt_len, model=p.model)

    def _check_thinking_off(self, kwargs: dict) -> None:
        """A 400 naming reasoning_effort where "none" cannot be honoured: the chat template uses <think> blocks and,
        rendered with these chat_template_kwargs (THINKING_OFF under the request's own), its generation prompt does not
        close one (a template without the thinking switch, or the request's own kwargs turning thinking back on). A
        template without <think> blocks never reasons: "none" holds. Checked on a one-message probe, before anything
        is rendered for the request or recorded in a session."""
        if not self.fmt.reasoning:
            return
        if not self.fmt.closes_reasoning(self.fmt.prompt([{"role": "user", "content": "hi"}], None, kwargs)):
            raise APIError("reasoning_effort: 'none' cannot be honoured: rendered with chat_template_kwargs "
                           f"{json.dumps(kwargs, sort_keys=True)}, this model's chat template still lets it reason "
                           "(its generation prompt does not close a <think> block)", param="reasoning_effort")

    def _chat_choice(self, s: Sampled, prompt: list[int], p: Params) -> Choice:
        """A chat answer's choice of what the engine sampled: its content, reasoning and tool calls."""
        tokens, text, _, _ = self.fmt.answer_text(s.tokens, p.stop, trim=not p.no_stop_trim)
        finish = self._finish(s, tokens)
        if self.fmt.harmony:
            return self._harmony_choice(s, tokens, text, finish, p)
        split = split_reasoning(text, self._opened(prompt, p)) if self._splits(p) else None
        think, text = (text[:split[1]], text[split[1]:]) if split else ("", text)
        # a forced answer cut by the token limit keeps its complete calls and says it was cut (finish "length"); so
        # does any other answer the limit cut inside a call, its content the text before that call's marker
        cut = finish == "length" and p.tool_choice is not None
        limited = finish == "length"  # a cut answer's trailing piece of a call marker is no content
        content, calls, rescued = self.fmt.read_calls(text, tools=p.tools, cut=cut, limited=limited) if p.tools \
            else (text, None, False)
        if calls and not rescued:
            finish = "tool_calls"
        choice = self._choice(s, tokens, content, finish, calls, p)
        if split:
            choice.reasoning, choice.think_text = think[split[0][0]:split[0][1]], think
            # the reasoning tokens: the sampled ones up to the block's </think> (all of them, unclosed)
            end = think.find(END_THINK, split[0][0])
            block = think[:end + len(END_THINK)] if end >= 0 else think
            choice.reasoning_tokens = self.fmt.covering(tokens, block)
        return choice

    def _harmony_choice(self, s: Sampled, tokens: list[int], text: str, finish: str, p: Params) -> Choice:
        """`_chat_choice` of a harmony answer (gpt-oss): its analysis channel is the reasoning (the content too with
        separate_reasoning false), its final channel and preambles the content, its messages to functions the calls
        (`relax.agents.parsers.harmony_parts`; a malformed call leaves them all as written in the content)."""
        inline = not p.separate_reasoning
        if p.tools:
            # the stop token that ended the answer is its last message's end marker (a call's <|call|>): a call
            # without it is one the token limit cut
            end = self.fmt.pieces(tokens[-1:])[0] if tokens and tokens[-1] in self.fmt.eos_token_ids else ""
            content, calls, rescued = self.fmt.read_calls(text + (end if end in HARMONY_TOKENS else ""),
                                                          tools=p.tools, limited=finish == "length",
                                                          reasoning_in_content=inline)
        else:
            content, calls, rescued = harmony_content(text, reasoning_in_content=inline), None, False
        choice = self._choice(s, tokens, content, "tool_calls" if calls and not rescued else finish, calls, p)
        found = None if inline else harmony_reasoning(text)
        if found is not None:
            # the reasoning tokens: the sampled ones up to the end of its last analysis message
            choice.reasoning, choice.reasoning_tokens = found[0], self.fmt.covering(tokens, text[:found[1]])
        return choice

    def _splits(self, p: Params) -> bool:
        """Whether a <think> block opening the answer (or opened by the prompt) goes to reasoning_content, as SGLang's
        reasoning parser puts it."""
        return self.fmt.reasoning and p.separate_reasoning

    def _opened(self, prompt: list[int], p: Params) -> bool:
        """Whether the answer starts inside a <think> block the prompt opened: a grammar from the first token
        (json_schema, regex, ebnf) leaves no room for one, and the answer is content; a structural tag's free text
        may close it."""
        return self.fmt.opens_reasoning(prompt) and (p.grammar is None or p.grammar[0] == "structural_tag")

    def completion(self, body: Any, session: Optional[Session] = None) -> tuple[int, Any]:
        """Choice i*n + k is the k-th choice of prompt i (OpenAI's order for a list of prompts), each prompt's n
        choices sampled as a request of that prompt alone would be (the same seeds); all of them one batch."""
        raws, p = parse_completion(body)
        if session is not None:
            if len(raws) > 1:  # a session records each call as one continuation of its agent's context
                raise APIError("prompt: a training session takes one prompt per call", param="prompt")
            prompt, context = session.completion_prompt(raws[0], self.fmt)
            prompts = [prompt]
        else:
            prompts, context = [list(r) if isinstance(r, list) else self.fmt.encode(r) for r in raws], None
        payloads = []
        for prompt in prompts:
            more, p = self._payloads(prompt, p, session, context, prompt_field="prompt")
            payloads += more
        prompt_tokens = sum(len(q) for q in prompts)
        if self._incremental(p, session):
            events = self.stream(payloads)
            drawn = self._progress(events, lambda s: self._completion_choice(s, p), p.top_logprobs)
            return 200, _streamed(_Closing(self._completion_chunks(drawn, prompt_tokens, p), events))
        sampled = [self._parse(a) for a in self.send(payloads)]
        choices = [self._completion_choice(s, p) for s in sampled]
        if session is not None:
            self._mark_constrained(sampled, p)
            session.record(context, prompts[0], [(s, c, None) for s, c in zip(sampled, choices, strict=True)])
        if p.stream:
            return 200, _streamed(list(self._completion_chunks(_answered(sampled, choices), prompt_tokens, p)))
        return 200, completion_answer(choices, p, prompt_tokens, model=p.model)

    def _completion_choice(self, s: Sampled, p: Params) -> Choice:
        """A completion's choice of what the engine sampled: its text up to a stop string."""
        tokens, text, _, _ = self.fmt.answer_text(s.tokens, p.stop, trim=not p.no_stop_trim)
        return self._choice(s, tokens, text, self._finish(s, tokens), None, p)

    # --------------------------------------------------------------------------------------------- incremental
    def _incremental(self, p: Params, session: Optional[Session]) -> bool:
        """Whether a request's stream is written as its tokens are drawn: a streamed request outside a training
        session (which records whole answers) on an engine that streams. With top_logprobs, a token is written once
        its alternatives have come too (`_progress`)."""
        return p.stream and self.stream is not None and session is None

    def _deltas(self, p: Params, prompt: list[int], chat: bool) -> TextDeltas:
        fmt = self.fmt
        return TextDeltas(fmt.decode, lambda t: fmt.pieces([t])[0], fmt.eos_token_ids, stop=p.stop,
                          trim=not p.no_stop_trim,
                          reasoning=self._opened(prompt, p) if chat and self._splits(p) else None,
                          stream_reasoning=p.stream_reasoning, tools=chat and bool(p.tools),
                          parser_name=parser_format(fmt.tool_parser), logprobs=p.logprobs,
                          harmony=chat and fmt.harmony, separate=p.separate_reasoning,
                          cleanup=bool(getattr(fmt.tokenizer, "clean_up_tokenization_spaces", False)))

    def _progress(self, events: Iterator[dict], answer: Callable[[Sampled], Choice], top: int = 0) -> Iterator[Drawn]:
        """Each event of a `stream` as its writer reads it (`Drawn`), a finished choice answered by `answer`; an error
        event raises APIError (a 500). Closing it closes `events`. With `top` (top_logprobs), the tokens so far are
        those whose alternatives the event carries too (SGLang's streamed `output_top_logprobs`, one list per token
        so far; relax-serve's own engine draws them with each token), so each chunk is written with its tokens'
        alternatives as OpenAI and SGLang stream them; an engine whose events carry none before the end has every
        chunk written with its final answer."""
        pieces: dict[int, list[list[tuple[str, float]]]] = {}  # per choice: its tokens' alternatives, as text
        try:
            for event in events:
                if "error" in event:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else str(error)
                    raise APIError(str(message), status=500, kind="server_error")
                meta = event.get("meta_info") or {}
                i = int(event.get("index", 0))
                if meta.get("finish_reason") is not None:
                    s = self._parse(event)
                    yield i, [], [], None, (s, answer(s))
                    continue
                pairs = meta.get("output_token_logprobs") or []
                alts = None
                if top:
                    alts = pieces.setdefault(i, [])
                    for found in (meta.get("output_top_logprobs") or [])[len(alts):len(pairs)]:
                        alts.append([(self.fmt.pieces([int(a[1])])[0], float(a[0])) for a in found or []])
                    pairs = pairs[:len(alts)]
                yield i, [int(q[1]) for q in pairs], [float(q[0]) for q in pairs], alts, None
        finally:
            _close(events)

    def _chat_chunks(self, drawn: Iterator[Drawn], prompt: list[int], p: Params, images: bool,
                     named: Callable[[APIError], APIError] = lambda exc: exc) -> Iterator[dict]:
        """The chunks of a chat stream, as its tokens are drawn or of its finished answer (`relax.serve.openai.deltas`,
        `Drawn`): per choice its role,
        its decided reasoning and content, then with its end the rest, its tool calls and finish_reason; then the
        usage (stream_options.include_usage). An error on the way ends it with its `StreamError`, `named` by the
        request's fields."""
        head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()),
                "model": p.model}
        splitters = [self._deltas(p, prompt, chat=True) for _ in range(p.n)]
        begun, choices = [False] * p.n, [None] * p.n
        prompt_len = len(prompt)

        def chunk(i: int, delta: dict, logprobs: Optional[list] = None, finish: Optional[str] = None) -> dict:
            return {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs":
                                         {"content": logprobs} if logprobs is not None and p.logprobs else None}]}

        def written(i: int, deltas: list[Delta], end: bool = False, content: Optional[str] = "") -> Iterator[dict]:
            if not begun[i] and (deltas or end):  # OpenAI's first delta: content null for an answer of calls only
                begun[i] = True
                yield chunk(i, {"role": "assistant", "content": content})
            for d in deltas:
                lps = None
                if d.logprobs is not None:
                    lps = [token_logprob(piece, lp, alts[:p.top_logprobs]) for piece, lp, alts in d.logprobs]
                yield chunk(i, {d.field: d.text} if d.text else {}, lps)

        try:
            for i, tokens, logps, alts, done in drawn:
                if done is None:
                    yield from written(i, splitters[i].feed(tokens, logps, alts))
                    continue
                s, c = done
                choices[i] = c
                if images and s.prompt_tokens:
                    prompt_len = s.prompt_tokens
                content = "" if c.text or not c.tool_calls else None  # OpenAI: null for calls only
                splitter = splitters[i]  # the tokens not yet fed, then what only the finished answer decides
                deltas = splitter.feed(c.tokens, c.logprobs, c.top) + splitter.finish(c, c.reasoning, c.text)
                yield from written(i, deltas, True, content)
                if c.tool_calls:
                    yield chunk(i, {"tool_calls": indexed_calls(c.tool_calls)})
                yield chunk(i, {}, finish=c.finish_reason)
            if p.include_usage:
                yield {**head, "choices": [], "usage": chat_answer(choices, p, prompt_len, model=p.model)["usage"]}
        except APIError as exc:
            yield StreamError(named(exc))
        finally:
            _close(drawn)

    def _completion_chunks(self, drawn: Iterator[Drawn], prompt_tokens: int, p: Params) -> Iterator[dict]:
        """The chunks of a completion stream, as its tokens are drawn or of its finished answer: each choice's decided
        text (and its tokens' log-probs), then with its end the rest and its finish_reason; then the usage
        (stream_options.include_usage)."""
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": p.model}
        texts: dict[int, TextDeltas] = {}
        offsets: dict[int, int] = {}
        choices: dict[int, Choice] = {}

        def chunk(i: int, d: Delta) -> dict:
            logprobs = None
            if d.logprobs is not None:
                at, tokens, lps, starts = offsets.get(i, 0), [], [], []
                for piece, lp, _ in d.logprobs:
                    tokens.append(piece)
                    lps.append(lp)
                    starts.append(at)
                    at += len(piece)
                offsets[i] = at
                top = [dict(alts[:p.top_logprobs]) for _, _, alts in d.logprobs] if p.top_logprobs else None
                logprobs = {"tokens": tokens, "token_logprobs": lps, "text_offset": starts, "top_logprobs": top}
            return {**head, "choices": [{"index": i, "text": d.text, "finish_reason": None, "logprobs": logprobs}]}

        try:
            for i, tokens, logps, alts, done in drawn:
                splitter = texts.setdefault(i, self._deltas(p, [], chat=False))
                if done is None:
                    for d in splitter.feed(tokens, logps, alts):
                        yield chunk(i, d)
                    continue
                c = choices[i] = done[1]
                for d in splitter.feed(c.tokens, c.logprobs, c.top) + splitter.finish(c, None, c.text):
                    yield chunk(i, d)
                yield {**head, "choices": [{"index": i, "text": "", "finish_reason": c.finish_reason,
                                            "logprobs": None}]}
            if p.include_usage:
                ordered = [choices[i] for i in sorted(choices)]
                yield {**head, "choices": [], "usage": completion_answer(ordered, p, prompt_tokens,
                                                                         model=p.model)["usage"]}
        except APIError as exc:
            yield StreamError(exc)
        finally:
            _close(drawn)

    # --------------------------------------------------------------------------------------------- generation
    def _limit(self, p: Params, prompt_len: int, prompt_field: str) -> int:
        """The answer's token limit; a context-length 400 naming `prompt_field` (the route's: messages, prompt) where
        the prompt, or the prompt and max_tokens, do not fit the context (naming the field the request sent the
        limit in: `Params.max_tokens_field`)."""
        room = None if self.context_length is None else self.context_length - prompt_len
        if room is not None and room < 1:
            raise ContextLengthError(self.context_length, prompt_len, prompt=prompt_field)
        # without max_tokens: the room left under the context, then the cap (a training session's limits come
        # on top in `Session.admit`); SGLang's 128 only where neither is known
        limit = p.max_tokens or room or self.max_tokens or DEFAULT_MAX_TOKENS
        if room is not None and limit > room:
            raise ContextLengthError(self.context_length, prompt_len, limit, room, prompt=prompt_field,
                                     limit=p.max_tokens_field if p.max_tokens else "max_tokens")
        return min(limit, self.max_tokens) if self.max_tokens else limit

    def _generate(self, prompt: list[int], p: Params, session: Optional[Session],
                  context: Any = None, image_data: Optional[list[str]] = None) -> tuple[list[Sampled], Params]:
        payloads, p = self._payloads(prompt, p, session, context, image_data)
        return [self._parse(a) for a in self.send(payloads)], p

    def _payloads(self, prompt: list[int], p: Params, session: Optional[Session], context: Any = None,
                  image_data: Optional[list[str]] = None, prompt_field: str = "messages") -> tuple[list[dict], Params]:
        """The /generate payloads of `prompt`'s n choices, and the parameters they were made with (a session's);
        `prompt_field`: the request field the prompt comes from, which a context-length 400 names."""
        limit = self._limit(p, len(prompt), prompt_field)
        if session is not None:
            p, limit, seeds = session.admit(p, len(prompt), limit, context)
        else:
            seeds = [None if p.seed is None else row_stream(p.seed, k) for k in range(p.n)]
        payloads = []
        for seed in seeds:
            sp = {"max_new_tokens": limit, "temperature": 1.0 if p.temperature is None else p.temperature,
                  "top_p": 1.0 if p.top_p is None else p.top_p, "top_k": p.top_k, "n": 1,
                  "stop_token_ids": [] if p.ignore_eos else sorted(self.fmt.eos_token_ids), "no_stop_trim": True,
                  "skip_special_tokens": False}
            if p.stop:  # the engine stops at them (its tokens end with the one that completed the string)
                sp["stop"] = list(p.stop)
            if p.ignore_eos:
                sp["ignore_eos"] = True
            if p.grammar is not None:  # constrained decoding, as SGLang's /generate takes it
                sp[p.grammar[0]] = p.grammar[1]
            if seed is not None:
                sp["sampling_seed"] = int(seed)
            payload = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "logprob_start_len": -1}
            if image_data:  # SGLang's image_data: this input's images, in the order of their placeholders
                payload["image_data"] = list(image_data)
            if p.top_logprobs:
                payload["top_logprobs_num"] = p.top_logprobs
            payloads.append(payload)
        return payloads, p

    def _mark_constrained(self, sampled: list[Sampled], p: Params) -> None:
        """For a training session (its trainer's `rollout/train_rollout_logp_abs_diff` reads it): which tokens of each
        choice the request's grammar constrained, found by replaying the choice through the grammar, as the engine
        (relax's or SGLang's, which says nothing of it) masked them. Where the replay cannot run, every token counts
        as constrained: a grammar was applied, and a free token is only one known to be free."""
        if p.grammar is None:
            return
        stops = () if p.ignore_eos else tuple(sorted(self.fmt.eos_token_ids))
        for s in sampled:
            try:
                s.constrained = self._grammars().constrained(GrammarSpec(*p.grammar), stops, s.tokens)
            except GrammarError:
                s.constrained = [1] * len(s.tokens)

    def _grammars(self) -> Grammars:
        """The grammars of this service's tokenizer (made at the first use: a service without grammars never
        reads the vocabulary)."""
        if self._grammar_replay is None:
            self._grammar_replay = Grammars(self.fmt.tokenizer, len(self.fmt.tokenizer))
        return self._grammar_replay

    def _tool_parser_format(self, param: str) -> str:
        """The built-in tool parser this service reads calls with: the format a grammar of calls is written in (a
        parser of its own, whose format no grammar covers: a 400 naming `param`); Mistral's v11+ form where the
        model's template writes calls so (`ChatFormat.grammar_format`)."""
        fmt = self.fmt.grammar_format
        if fmt is None:
            raise APIError(f"{param}: constraining tool calls needs a built-in tool parser (data.tool_parser)",
                           param=param)
        return fmt

    def _tool_call_grammar(self, p: Params) -> str:
        """The EBNF of the calls `p.tool_choice` forces ("required": one or more, or exactly one without
        parallel_tool_calls; a name: exactly that call), in the format of this service's tool parser."""
        fmt = self._tool_parser_format("tool_choice")
        try:
            return tool_call_ebnf(p.tools or [], fmt, name=None if p.tool_choice == "required" else p.tool_choice,
                                  parallel=p.parallel_tool_calls)
        except GrammarError as exc:
            raise APIError(f"tool_choice: {exc}", param="tool_choice") from None

    @staticmethod
    def _check_format(grammar: tuple[str, str], body: dict) -> None:
        """A 400 naming the request's field (response_format, or SGLang's regex, json_schema, ebnf) when its grammar
        does not compile, here, before the engine would refuse it naming its own /generate sampling parameter."""
        fmt = body.get("response_format")
        param = "response_format" if isinstance(fmt, dict) and fmt.get("type") != "text" else grammar[0]
        try:
            _xgrammar_of(GrammarSpec(*grammar))
        except GrammarError as exc:
            raise APIError(f"{param}: {exc}", param=param) from None

    def _calls_or_format_grammar(self, p: Params) -> tuple[str, str]:
        """tool_choice "auto" with response_format (or SGLang's regex, json_schema, ebnf): the answer is tool calls
        (one or more, exactly one without parallel_tool_calls) or the format's content, as OpenAI answers it; an
        ebnf /generate sampling parameter (the grammar of the format alone would make a call impossible)."""
        fmt = self._tool_parser_format("response_format")
        try:
            spec = tool_calls_or(p.tools or [], fmt, GrammarSpec(*p.grammar), parallel=p.parallel_tool_calls)
        except GrammarError as exc:
            raise APIError(f"response_format: {exc}", param="response_format") from None
        return spec.kind, spec.source

    def _one_call_grammar(self, p: Params) -> tuple[str, str]:
        """tool_choice "auto" and parallel_tool_calls false: text, or text then one call, as a /generate sampling
        parameter (SGLang's `structural_tag`, or `ebnf`)."""
        fmt = self._tool_parser_format("parallel_tool_calls")
        try:
            spec = at_most_one_call(p.tools or [], fmt)
        except GrammarError as exc:
            raise APIError(f"parallel_tool_calls: {exc}", param="parallel_tool_calls") from None
        return spec.kind, spec.source

    def _strict_calls_grammar(self, p: Params) -> Optional[tuple[str, str]]:
        """tool_choice "auto" with a `strict` tool: free text whose calls are calls of the tools offered, a strict
        tool's arguments following its schema (`strict_calls`; SGLang's structural tag for strict tools), as a
        /generate sampling parameter. A strict tool whose schema xgrammar cannot compile: a 400 naming it. A parser of
        its own (no built-in format to write the grammar in): None, the answer free and a strict tool's calls checked
        after sampling only (`relax.agents.parsers.apply_tool_schemas`: a call that breaks the schema is malformed)."""
        fmt = self.fmt.grammar_format
        if fmt is None:
            return None
        try:
            spec = strict_calls(p.tools or [], fmt)
        except ToolSchemaError as exc:
            i = next(i for i, t in enumerate(p.tools or []) if t["function"]["name"] == exc.tool)
            param = f"tools[{i}].function.parameters"
            raise APIError(f"{param}: tool {exc.tool!r} is strict, so its arguments are constrained to its schema, "
                           f"which cannot be compiled ({exc})", param=param) from None
        return None if spec is None else (spec.kind, spec.source)

    def _allowed_calls_grammar(self, p: Params) -> tuple[str, str]:
        """tool_choice allowed_tools with mode "auto" (parallel calls allowed): free text in which every call is a
        call of `p.tools` (the listed ones), a strict tool's arguments following its schema, as `strict_calls`
        writes it (`relax.rollout.grammar.calls_in_text`); a 400 naming tool_choice where no built-in tool parser
        can write it."""
        fmt = self._tool_parser_format("tool_choice")
        free = frozenset(t["function"]["name"] for t in p.tools or [] if t["function"].get("strict") is not True)
        try:
            spec = calls_in_text(p.tools or [], fmt, free, parallel=True)
        except ToolSchemaError as exc:
            raise APIError(f"tool_choice: tool {exc.tool!r} is strict, so its arguments are constrained to its "
                           f"schema, which cannot be compiled ({exc})", param="tool_choice") from None
        except GrammarError as exc:
            raise APIError(f"tool_choice: {exc}", param="tool_choice") from None
        return spec.kind, spec.source

    def _after_reasoning(self, grammar: tuple[str, str], prompt: list[int]) -> tuple[str, str]:
        """The constrained answer of a model whose template reasons, as SGLang's chat route constrains it (a grammar
        deferred past the reasoning): the grammar after a <think> block, required when the prompt opened it (Qwen3.5),
        optional when the model opens it itself (Qwen3), none when the prompt closed it (`enable_thinking: false`);
        one structural tag (`relax.rollout.grammar.after_reasoning`), so SGLang servers constrain it the same way."""
        if self.fmt.closes_reasoning(prompt):
            return grammar
        try:
            spec = after_reasoning(GrammarSpec(*grammar), opened=self.fmt.opens_reasoning(prompt))
        except GrammarError as exc:  # the request's own format or grammar does not compile
            raise APIError(f"response_format: {exc}", param="response_format") from None
        return spec.kind, spec.source

    def _parse(self, answer: dict) -> Sampled:
        meta = answer.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        try:
            version = int(meta.get("weight_version"))
        except (TypeError, ValueError):
            version = self.default_version
        top = meta.get("output_top_logprobs")
        matched = (meta.get("finish_reason") or {}).get("matched")
        return Sampled([int(q[1]) for q in pairs], [float(q[0]) for q in pairs], FINISH.get(reason, FinishReason.ABORT),
                       version, [[(float(a[0]), int(a[1])) for a in (alts or [])] for alts in top] if top else None,
                       matched if isinstance(matched, str) and reason == "stop" else None,
                       meta.get("prompt_tokens") if isinstance(meta.get("prompt_tokens"), int) else None)

    @staticmethod
    def _finish(s: Sampled, tokens: list[int]) -> str:
        """OpenAI's finish_reason (its wire strings) of choice `s` answered with `tokens`."""
        if s.finish == FinishReason.ABORT:
            raise APIError("the engine aborted the generation (it is shutting down or was paused); retry",
                           status=503, kind="server_error")
        return "stop" if len(tokens) < len(s.tokens) or s.finish == FinishReason.STOP else "length"

    def _choice(self, s: Sampled, tokens: list[int], text: str, finish: str, calls: Optional[list[dict]],
                p: Params) -> Choice:
        """One answer; each token's text for the log-probs when asked."""
        pieces = self.fmt.pieces(tokens) if p.logprobs else []
        top = None
        if s.top:
            top = [[(self.fmt.pieces([t])[0], lp) for lp, t in alts] for alts in s.top[:len(tokens)]]
        return Choice(text=text, tokens=tokens, logprobs=s.logprobs[:len(tokens)], pieces=pieces,
                      finish_reason=finish, top=top, tool_calls=calls)


def _answered(sampled: list[Sampled], choices: list[Choice]) -> Iterator[Drawn]:
    """Finished choices as a stream's writer reads them: each at its end, every token still to be fed."""
    return ((i, [], [], None, (s, c)) for i, (s, c) in enumerate(zip(sampled, choices, strict=True)))


def _close(it: Any) -> None:
    if hasattr(it, "close"):
        it.close()


class _Closing:
    """An iterator that closes `also` (the engine's stream: what still runs is aborted) when it is closed: a
    generator closed before it started runs no cleanup of its own."""

    def __init__(self, it: Iterator[dict], also: Any):
        self.it, self.also = it, also

    def __iter__(self) -> _Closing:
        return self

    def __next__(self) -> dict:
        return next(self.it)

    def close(self) -> None:
        try:
            _close(self.it)
        finally:
            _close(self.also)


def _refused(exc: APIError, body: dict, p: Params, places: list[str]) -> APIError:
    """The engine's error for a chat request in the request's terms, streamed or not: a grammar's dead end (the
    engine's 400) names the field that asked for the grammar; an image the engine refuses, its message part."""
    if exc.code == "grammar_dead_end":
        param = _grammar_param(body, p)
        return APIError(f"{param}: {exc}", param=param, code=exc.code)
    return naming_parts(exc, places)


def _grammar_param(body: dict, p: Params) -> str:
    """The request field whose grammar constrained a chat answer: a forced call's tool_choice, the response_format,
    SGLang's regex, json_schema or ebnf, else the tools (strict ones, parallel_tool_calls false, allowed tools)."""
    fmt = body.get("response_format")
    if p.tool_choice is not None:
        return "tool_choice"
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    given = [k for k in ("regex", "json_schema", "ebnf") if body.get(k) not in (None, "")]
    return given[0] if given else "tools"


def _streamed(chunks: Any) -> Any:
    """A stream's chunks as its answer's body: a list (the answer generated) as one `EventStream`, an iterator
    (chunks made as the tokens are drawn) as an `EventSource`, written as they come."""
    if isinstance(chunks, list):
        return EventStream(b"".join(sse(chunks)))

    def blocks() -> Iterator[bytes]:
        try:
            yield from sse(chunks)
        finally:
            _close(chunks)

    return EventSource(blocks(), also=chunks)
