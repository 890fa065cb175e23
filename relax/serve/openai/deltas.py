"""One choice's stream deltas as its tokens are drawn (`TextDeltas`), for relax-serve's incremental chat and
completion streams (`relax.serve.openai.service`): the one place that decides which part of an unfinished answer may
be sent.

What is sent is always a prefix of what the finished answer will be, so the deltas put together are the answer the
same request without `stream` gives (same seed), character for character; anything that may still change is held
back until it is decided:
- a stop string: text from where one may begin (the tail that is the start of one; from a whole one on, all);
- reasoning (a chat template with <think> blocks, `split_reasoning`): whether the answer opens a block while its
  start may still become `<think>`, the blank around the reasoning and a tail that may become `</think>`; the
  reasoning goes out as `reasoning_content` (as one delta once closed with stream_reasoning false), the content after
  the block as `content`;
- tool calls (tools offered): the content from the first place a call may start (the tool parser's start marker,
  `CALL_STARTS`; Llama 3's call without its tag: a message opening with `{` or `[`; a parser of one's own: all of it)
  and trailing blank (a message with calls is stripped); a message that opens with blank is held whole (it is
  stripped only if it holds calls). Calls come with the finished answer, whole, in one `tool_calls` delta: a malformed
  call anywhere makes the whole message text, but in an answer the token limit cut (its content: the text before
  its first call's marker, already sent or held) (`ChatFormat.read_calls`);
- the end of the text while a character is incomplete (U+FFFD), and, for a tokenizer that cleans up spaces when
  decoding (" ." -> "."), trailing blank;
- a harmony answer (gpt-oss, `harmony`): its messages as `relax.agents.parsers.harmony_parts` reads them, each
  analysis message's body going to reasoning and each final or preamble's to content (one per line, stripped: its
  trailing blank held) once its header is whole; from the first message with a recipient (a call) on, everything
  is held until the end (its calls, or, malformed or without tools, the messages as written).

A delta falls on token boundaries: each token's text is what it adds to the decoded text, joined with the held text
of earlier tokens once that is decided. Each delta carries the log-probs of the tokens whose text it completes (with
their alternatives: top_logprobs), a token with no text of its own with the next delta; the rest come with the
finished answer. With top_logprobs a token is fed once its alternatives have come too: as it is drawn on an engine
that streams them with the tokens (SGLang's `output_top_logprobs`, relax-serve's own engine's), with the finished
answer on one whose events carry none before the end. A stream written once its answer is finished (a training
session's, or such an engine's with top_logprobs) feeds the whole answer at once, so it is written by the same rules
as one whose tokens come as they are drawn.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from relax.agents.parsers import (
    DS_CALL_BEGIN,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    END_THINK,
    MISTRAL_CALLS,
    OPEN_TAG,
    PYTHON_TAG,
    THINK,
    HarmonyPart,
    harmony_parts,
)
from relax.serve.openai.protocol import Choice

# Where a call of each built-in format may start (text before it is the content whatever the parser decides). Llama
# 3's call without its tag (a whole message that is a call) is `_LLAMA_OPENING`.
CALL_STARTS: dict[str, tuple[str, ...]] = {
    "hermes": (OPEN_TAG,), "qwen3_coder": (OPEN_TAG,), "glm45": (OPEN_TAG,), "llama3_json": (PYTHON_TAG,),
    # DeepSeek's section markers are taken out of a message with calls: held as well
    "deepseek_v3": (DS_CALLS_BEGIN, DS_CALL_BEGIN, DS_CALLS_END),
    "mistral": (MISTRAL_CALLS,),
}
_LLAMA_OPENING = re.compile(r"[\[{]")
logger = logging.getLogger(__name__)


def _body_end(part: HarmonyPart) -> int:
    """Where an unfinished harmony message's body ends in the answer's text, its trailing blank left out."""
    assert part.body is not None
    return part.end - (len(part.body) - len(part.body.rstrip()))


# one token's log-prob entry: its text, its log-prob and the (text, log-prob) of the likeliest tokens there
Entry = tuple[str, float, list[tuple[str, float]]]


@dataclass
class Delta:
    """A piece of a choice's stream: `field` ("content" or "reasoning_content") and its text, and the log-prob
    entries of the tokens it completes (None: log-probs not asked for)."""

    field: str
    text: str
    logprobs: Optional[list[Entry]]


def held_prefix_tail(text: str, marks: tuple[str, ...]) -> int:
    """Where the longest tail of `text` that is a proper start of one of `marks` begins (len(text): none)."""
    for at in range(max(0, len(text) - max((len(m) for m in marks), default=0) + 1), len(text)):
        tail = text[at:]
        if any(m.startswith(tail) and m != tail for m in marks):
            return at
    return len(text)


class TextDeltas:
    """The deltas of one choice. `feed(tokens, logps, top)` with the tokens drawn so far (cumulative) returns the new
    deltas; `finish(choice)` with the finished answer (`Choice`, as the unstreamed answer has it) returns the rest.

    `decode`: the text of tokens (`ChatFormat.decode`); `piece`: a token's own text (its log-prob's `token`); `eos`:
    the stop tokens (a trailing one is no text); `stop`, `trim`: the request's stop strings and whether the text
    stops before them (no_stop_trim: after); `reasoning`: None (no <think> split), else whether the prompt opened the
    block (`split_reasoning`'s `opened`); `stream_reasoning`: false sends the reasoning as one delta; `tools`: tools
    were offered (calls are read), `parser_name`: the built-in tool parser's name (None: one's own); `logprobs`:
    whether deltas carry log-probs; `cleanup`: the tokenizer cleans up spaces when decoding; `harmony`: the answer is
    harmony messages (`_harmony`), whose analysis goes to reasoning where `separate` (separate_reasoning)."""

    def __init__(self, decode: Callable[[list[int]], str], piece: Callable[[int], str], eos: frozenset[int], *,
                 stop: list[str], trim: bool, reasoning: Optional[bool], stream_reasoning: bool, tools: bool,
                 parser_name: Optional[str], logprobs: bool, cleanup: bool, harmony: bool = False,
                 separate: bool = True):
        self.decode, self.piece, self.eos = decode, piece, eos
        self.harmony, self.separate = harmony, separate
        self.stop, self.trim = list(stop), trim
        self.reasoning, self.stream_reasoning = reasoning, stream_reasoning
        self.tools, self.starts = tools, CALL_STARTS.get(parser_name) if parser_name else None
        self.llama = parser_name == "llama3_json"
        self.logprobs, self.cleanup = logprobs, cleanup
        self.sent = {"reasoning_content": "", "content": ""}
        self.fed = 0  # tokens looked at
        self.ends: list[int] = []  # per token: the length of the text up to its end
        self.entries: list[Entry] = []  # per token looked at
        self.given = 0  # tokens whose log-probs were sent

    # ------------------------------------------------------------------------------------------------ progress
    def feed(self, tokens: list[int], logps: list[float],
             top: Optional[list[list[tuple[str, float]]]] = None) -> list[Delta]:
        """The deltas of the tokens drawn since the last call (`tokens`: all drawn so far; `top`: per token its
        alternatives, None: none asked for)."""
        if tokens and tokens[-1] in self.eos:  # the stop token that ends the answer: no text
            tokens = tokens[:-1]
        out: list[Delta] = []
        for k in range(self.fed + 1, len(tokens) + 1):
            text = self.decode(tokens[:k]).rstrip("\ufffd")  # a character still incomplete: not yet
            self.ends.append(len(text))
            if self.logprobs:
                self.entries.append((self.piece(tokens[k - 1]), float(logps[k - 1]), top[k - 1] if top else []))
            out += self._step(text)
        self.fed = max(self.fed, len(tokens))
        return out

    def _step(self, text: str) -> list[Delta]:
        reasoning, content, decided = self._view(text)
        out = []
        for field, now in (("reasoning_content", reasoning), ("content", content)):
            before = self.sent[field]
            if now is not None and len(now) > len(before) and now.startswith(before):
                self.sent[field] = now
                out.append(Delta(field, now[len(before):], None))
        if out and self.logprobs:  # the tokens whose text is decided, with the last delta of this step
            done = sum(1 for end in self.ends if end <= decided)
            out[-1].logprobs = self.entries[self.given:max(done, self.given)]
            self.given = max(done, self.given)
        return out

    def _view(self, text: str) -> tuple[Optional[str], Optional[str], int]:
        """(reasoning, content) that may be sent of the answer's text so far (None: none decided), and how much of
        the text is decided."""
        text = text[:self._stop_limit(text)]
        if self.harmony:
            return self._harmony(text)
        reasoning, start = None, 0
        if self.reasoning is not None:
            content_start, reasoning, decided = self._reasoning(text)
            if content_start is None:
                return reasoning, None, decided
            start = content_start
        content, end = self._content(text[start:])
        return reasoning, content, start + end

    def _harmony(self, text: str) -> tuple[Optional[str], Optional[str], int]:
        """`_view` of a harmony answer: the bodies of its messages up to the first that is undecided (a header not
        yet whole, plain text that may still become a header) or that has a recipient, as `ChatFormat.tool_calls` and
        `relax.agents.parsers.harmony_content` will join them; the last message's trailing blank held, and with
        stream_reasoning false its analysis until it ends."""
        reasoning: list[str] = []
        content: list[str] = []
        decided, thinking = 0, False  # (thinking: the last message looked at is analysis, so reasoning may go on)
        parts = harmony_parts(text)
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            if part.recipient or (last and (part.body is None or part.plain)):
                break
            if part.body is None:  # a marker fragment before other messages: never content
                decided = part.end
                continue
            thinking = self.separate and part.channel == "analysis" and not part.plain
            if part.body.strip():
                (reasoning if thinking else content).append(part.body.strip())
            decided = part.end if not last or part.closed else _body_end(part)
        if thinking and not self.stream_reasoning:  # sent as one delta once the analysis is over
            return None, "\n".join(content), decided
        return "\n".join(reasoning), "\n".join(content), decided

    def _stop_limit(self, text: str) -> int:
        """How much of `text` no stop string can cut: up to the first whole one (after it with no_stop_trim), else
        up to a tail that may begin one."""
        if not self.stop:
            return len(text)
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            at, s = min(hits)
            return at if self.trim else at + len(s)
        return held_prefix_tail(text, tuple(self.stop))

    def _reasoning(self, text: str) -> tuple[Optional[int], Optional[str], int]:
        """(where the content starts, None while the reasoning goes on or while it is undecided whether there is any;
        the reasoning that may be sent; how much of the text is decided), as `split_reasoning` will read it."""
        if self.reasoning:
            start = 0
        else:
            body = text.lstrip()
            if len(body) < len(THINK) and THINK.startswith(body):
                return None, None, 0  # may still open a block
            if not body.startswith(THINK):
                return 0, None, 0  # no reasoning: all of it is content
            start = len(text) - len(body) + len(THINK)
        lead = start + len(text[start:]) - len(text[start:].lstrip())
        end = text.find(END_THINK, start)
        if end < 0:  # open: a tail that may become </think> and the blank before it held
            upto = max(start, held_prefix_tail(text, (END_THINK,)))
            upto = max(lead, start + len(text[start:upto].rstrip()))
            return None, text[lead:upto] if self.stream_reasoning else None, upto
        content = end + len(END_THINK)
        content += len(text[content:]) - len(text[content:].lstrip())
        return content, text[start:end].strip(), content  # closed: all of it may go

    def _content(self, text: str) -> tuple[Optional[str], int]:
        """The content that may be sent of the message text `text` (after any reasoning), and how much of it is
        decided."""
        if self.tools:
            if self.starts is None or (text and text[0].isspace()):
                return None, 0  # a parser of one's own, or a message that opens with blank: decided at the end
            if self.llama and _LLAMA_OPENING.match(text):
                return None, 0  # Llama 3's call without its tag
            hits = [text.find(m) for m in self.starts if m in text]
            upto = min(hits) if hits else held_prefix_tail(text, self.starts)
            upto = len(text[:upto].rstrip())  # a message with calls is stripped
        else:
            upto = len(text.rstrip()) if self.cleanup else len(text)
        return text[:upto], upto

    # ------------------------------------------------------------------------------------------------ the end
    def finish(self, choice: Choice, reasoning: Optional[str], content: str) -> list[Delta]:
        """The rest of the answer once it ended: `reasoning` and `content` as the unstreamed answer has them
        (its reasoning_content, None: none; its content), and the log-probs of `choice`'s tokens not yet sent."""
        out = []
        for field, final in (("reasoning_content", reasoning), ("content", content)):
            before = self.sent[field]
            if final and len(final) > len(before):
                if not final.startswith(before):  # a tokenizer whose text changes back: nothing can mend it now
                    logger.error("the streamed %s %r is not the start of the answer's %r", field, before, final)
                    continue
                out.append(Delta(field, final[len(before):], None))
                self.sent[field] = final
        if self.logprobs:
            top = choice.top or [[] for _ in choice.pieces]
            rest = list(zip(choice.pieces, choice.logprobs, top, strict=True))[self.given:]
            self.given = len(choice.tokens)
            if out:
                out[-1].logprobs = rest
            elif rest:
                out.append(Delta("content", "", rest))
        return out
