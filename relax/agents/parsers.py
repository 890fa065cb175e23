"""Tool-call parsers: a model message read into its tool calls, in the format of the model's family.

A parser reads one message into a `ParsedMessage`: its items in the order they appear in the text, each a
`ToolCall` (a name and its arguments as a dict; arguments written as a JSON string are decoded) or a `CallError` (a
malformed call, with a message for the model), and the content outside the calls. The built-in tool loop answers
the items in that order (`relax.agents.loops`), and the OpenAI gateway and `relax-serve` turn the calls into
`tool_calls` (`relax.serve.openai.chat`).

`data.tool_parser` names the parser: a built-in name or `package.module:function` (a function text ->
`ParsedMessage`); `auto` picks the built-in one from the tokenizer's chat template (`parser_for_template`), and
refuses a template with a place for tools whose format it does not know.

- `hermes` (Hermes, Qwen2.5/Qwen3, SmolLM2): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`, or a JSON
  list of calls in one tag;
- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call><function=N><parameter=K>V</parameter>...</function></tool_call>`;
- `llama3_json` (Llama 3.1 / 3.2): `<|python_tag|>{"name": N, "parameters": {...}}`, or a whole message that is
  such an object;
- `glm45` (GLM-4.5 / 4.6): `<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`;
- `deepseek_v3` (DeepSeek-V3): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N`, a newline, the arguments in a
  json code block, `<｜tool▁call▁end｜>`, the calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`.
- `mistral` (Mistral): `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]` (tokenizer v3: Mistral-7B-Instruct-v0.3,
  Mistral-Nemo) or `[TOOL_CALLS]N[ARGS]{...}` per call (tokenizer v11 on: Mistral-Small-3.1+, Magistral, Devstral).
- `harmony` (gpt-oss): `<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}<|call|>`, one call per
  message; the final channel is the content and the analysis channel the reasoning (`harmony_reasoning`).

The XML formats (qwen3_coder, glm45) write a string argument as its text and any other value as JSON (that is how
their chat templates render arguments); a parser alone decodes a value as JSON where it is JSON, else keeps it as
text. Where the tools offered are known (the OpenAI gateway and `relax-serve`: the request's tools; the episode
loop: `data.tools`), `apply_tool_schemas` reads the calls with their schemas, as SGLang does: a string argument keeps
its text ("42" stays "42"), and a `strict` tool's call whose arguments do not satisfy its schema is malformed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from relax.imports import call_mismatch, resolve_component


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    # the XML formats' argument values as written (one newline either side left out), which `apply_tool_schemas`
    # reads where the tool's schema says an argument is a string; None: a JSON format
    texts: Optional[dict] = field(default=None, compare=False)


@dataclass(frozen=True)
class CallError:
    """A malformed call where it stands in the message; `message` tells the model what is wrong."""

    message: str


Item = Union[ToolCall, CallError]


@dataclass(frozen=True)
class ParsedMessage:
    """A model message read by a tool parser: its calls and malformed calls in the order of the text, and the
    content outside them (stripped)."""

    items: tuple[Item, ...]
    content: str

    @property
    def calls(self) -> list[ToolCall]:
        return [i for i in self.items if isinstance(i, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [i.message for i in self.items if isinstance(i, CallError)]


ToolParser = Callable[[str], ParsedMessage]


def _with_arguments(name: str, args: Any) -> Item:
    """The call of `name` with `args` (an object, or a JSON string of one; empty: none), or its error."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        return CallError(f"the arguments of {name!r} are not a JSON object")
    return ToolCall(name, args)


def _json_call(obj: Any, key: str, other_key: Optional[str] = None) -> Item:
    """One call written as a JSON object {"name": ..., key: ...} (`other_key`: accepted in place of `key`)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError(f'a tool call must be an object with a "name" and "{key}"')
    args = obj[key] if key in obj else obj.get(other_key, {}) if other_key else {}
    return _with_arguments(obj["name"], args)


def _xml_text(raw: str) -> str:
    """An argument of an XML format as its template wrote it, one newline either side (as Qwen3-Coder's template
    writes them) left out."""
    value = raw[1:] if raw.startswith("\n") else raw
    return value[:-1] if value.endswith("\n") else value


def _xml_value(raw: str) -> Any:
    """An argument of an XML format without its tool's schema: JSON is decoded, anything else is text."""
    value = _xml_text(raw)
    try:
        return json.loads(value)
    except ValueError:
        return value


def _named_arguments(name: str, pairs: list[tuple[str, str]]) -> Item:
    """The call of `name` with the (key, value text) pairs of an XML format, or its error (a key without a name)."""
    args = {key.strip(): _xml_value(value) for key, value in pairs}
    if "" in args:
        return CallError(f"an argument of {name!r} has no name")
    return ToolCall(name, args, texts={key.strip(): _xml_text(value) for key, value in pairs})


def _json_calls(text: str, start: int, read: Callable[[Any], Item], where: str) -> tuple[list[Item], int]:
    """The items of a JSON list of calls at text[start] ("["), each element made an item by `read`, and where the list
    ends. A list that is not valid JSON is read element by element: its complete calls are kept, and the first
    element that is not JSON, or the end of the text where a ',' or the closing ']' should come (a list the token
    limit cut), is one error after them, which ends the list (at the end of the text). So a forced answer cut inside
    its third call keeps its first two, as the formats that write one call per tag do (`ChatFormat.tool_calls`)."""
    decoder = json.JSONDecoder()
    try:
        value, end = decoder.raw_decode(text, start)
    except json.JSONDecodeError:
        pass
    else:
        return [read(obj) for obj in value], end
    items: list[Item] = []
    pos = _skip_blank(text, start + 1)
    while True:
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            items.append(CallError(f"invalid JSON in {where}: {exc.msg} at character {exc.pos - start}"))
            return items, len(text)
        items.append(read(value))
        pos = _skip_blank(text, pos)
        if text.startswith(",", pos):
            pos = _skip_blank(text, pos + 1)
            continue
        if text.startswith("]", pos):
            return items, pos + 1
        what = "the list of calls is not closed by ']'" if pos == len(text) else "expected ',' or ']'"
        items.append(CallError(f"invalid JSON in {where}: {what} at character {pos - start}"))
        return items, len(text)


def _skip_blank(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


# ----------------------------------------------------------------------------------------------- <tool_call> tags
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
NOT_CLOSED = "a <tool_call> is not closed by </tool_call>"


CLOSE_TAG = "</tool_call>"


def _tagged(text: str, read: Callable[[str], list[Item]], *, json_bodies: bool = False) -> ParsedMessage:
    """The formats whose calls sit in <tool_call> tags: `read` makes each tag's body into items. Text outside the
    tags is the content; an open tag that no closing tag follows is one error, after the calls. A body runs to the
    first closing tag (an open tag followed by a closing one goes into the body before it, so an unclosed tag comes
    after every call); with `json_bodies` (Hermes), a body that is one JSON value runs to its end, so that a tag
    inside one of its strings (an argument holding `</tool_call>`) neither ends nor opens a call."""
    spans = _json_tag_spans(text) if json_bodies else [(m.start(), m.end(), m.group(1))
                                                      for m in TOOL_CALL.finditer(text)]
    items = [item for _, _, body in spans for item in read(body)]
    outside, at = [], 0
    for start, end, _ in spans:
        outside.append(text[at:start])
        at = end
    outside.append(text[at:])
    content = "".join(outside)
    if OPEN_TAG in content:
        items.append(CallError(NOT_CLOSED))
    return ParsedMessage(tuple(items), content.strip())


def _json_tag_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, body) of each <tool_call> tag of `text` whose body is a JSON value (blank around it) read whole,
    else (malformed JSON) of the tag up to the next closing tag, as `TOOL_CALL` reads it."""
    spans, at, decoder = [], 0, json.JSONDecoder()
    while (start := text.find(OPEN_TAG, at)) >= 0:
        body = start + len(OPEN_TAG)
        try:
            _, end = decoder.raw_decode(text, len(text) - len(text[body:].lstrip()))
            close = len(text) - len(text[end:].lstrip())
            if text.startswith(CLOSE_TAG, close):
                spans.append((start, close + len(CLOSE_TAG), text[body:close]))
                at = close + len(CLOSE_TAG)
                continue
        except ValueError:
            pass
        close = text.find(CLOSE_TAG, body)
        if close < 0:
            break
        spans.append((start, close + len(CLOSE_TAG), text[body:close]))
        at = close + len(CLOSE_TAG)
    return spans


def _hermes_body(body: str) -> list[Item]:
    try:
        parsed = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return [CallError(f"invalid JSON in <tool_call>: {exc.msg} at character {exc.pos}")]
    return [_json_call(obj, "arguments") for obj in (parsed if isinstance(parsed, list) else [parsed])]


def parse_hermes(text: str) -> ParsedMessage:
    """Hermes/Qwen: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, one call or a JSON list of them in a
    tag (SmolLM2's form); arguments an object or a JSON string of one. A tag inside a JSON string is text of it."""
    return _tagged(text, _hermes_body, json_bodies=True)


_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def _qwen3_coder_body(body: str) -> list[Item]:
    function = _FUNCTION.fullmatch(body)
    if function is None or not function.group(1).strip():
        return [CallError("a <tool_call> must hold one <function=NAME> ... </function>")]
    name, inner = function.group(1).strip(), function.group(2)
    if _PARAMETER.sub("", inner).strip():
        return [CallError(f"the call of {name!r} holds something other than <parameter=NAME>value</parameter>")]
    return [_named_arguments(name, [(m.group(1), m.group(2)) for m in _PARAMETER.finditer(inner)])]


def parse_qwen3_coder(text: str) -> ParsedMessage:
    """Qwen3-Coder / Qwen3.5: `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n
    </tool_call>`, one function per tag."""
    return _tagged(text, _qwen3_coder_body)


_GLM_NAME = re.compile(r"\s*([^\s<>{}\[\]\"']+)\s*")
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45_body(body: str) -> list[Item]:
    at = body.find("<arg_key>")
    head, rest = (body, "") if at < 0 else (body[:at], body[at:])
    name = _GLM_NAME.fullmatch(head)
    if name is None:
        return [CallError("a <tool_call> must start with the tool's name, then <arg_key>/<arg_value> pairs")]
    if _GLM_ARG.sub("", rest).strip():
        return [CallError(f"the call of {name.group(1)!r} holds something other than <arg_key>K</arg_key>"
                          "<arg_value>V</arg_value> pairs")]
    return [_named_arguments(name.group(1), [(m.group(1), m.group(2)) for m in _GLM_ARG.finditer(rest)])]


def parse_glm45(text: str) -> ParsedMessage:
    """GLM-4.5 / 4.6: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`."""
    return _tagged(text, _glm45_body)


# ----------------------------------------------------------------------------------------------- Llama 3 JSON
PYTHON_TAG = "<|python_tag|>"
# a message that is a call without the tag: a JSON object whose first key is "name", or "type": "function" then
# "name" (Llama 3.2's small models write {"type": "function", "name": N, "parameters": {...}}; vLLM's and SGLang's
# llama3 parsers read it too, the "type" key ignored)
_LLAMA_CALL = re.compile(r'\s*\[?\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:')
_LLAMA_SEPARATORS = " \t\r\n;"


def parse_llama3_json(text: str) -> ParsedMessage:
    """Llama 3.1 / 3.2: `<|python_tag|>{"name": ..., "parameters": {...}}` (the tag is a special token, which
    decoding with special tokens skipped leaves out), or a whole message that is such an object; several calls
    separated by ';' or whitespace, or a JSON list of them. "arguments" is read where "parameters" is missing; other
    keys ("type": "function", which Llama 3.2 writes first) are ignored. Text before the tag and after the calls is
    the content; without the tag, a message that does not start like a call (a JSON object whose first key is
    "name", or "type": "function" then "name") has none. A list of calls cut by the token limit gives its complete
    calls, then one error (`_json_calls`)."""
    if PYTHON_TAG in text:
        before, _, rest = text.partition(PYTHON_TAG)
        rest = rest.replace(PYTHON_TAG, ";")
    elif _LLAMA_CALL.match(text):
        before, rest = "", text
    else:
        return ParsedMessage((), text.strip())
    decoder, items, pos, after = json.JSONDecoder(), [], 0, ""
    while True:
        while pos < len(rest) and rest[pos] in _LLAMA_SEPARATORS:
            pos += 1
        if pos == len(rest):
            break
        if rest[pos] not in "{[":  # prose after the calls
            after = rest[pos:]
            break
        if rest[pos] == "[":
            found, pos = _json_calls(rest, pos, lambda obj: _json_call(obj, "parameters", "arguments"),
                                     "a tool call")
            items += found
            continue
        try:
            value, end = decoder.raw_decode(rest, pos)
        except json.JSONDecodeError as exc:
            items.append(CallError(f"invalid JSON in a tool call: {exc.msg} at character {exc.pos - pos}"))
            break
        items.append(_json_call(value, "parameters", "arguments"))
        pos = end
    content = "\n".join(part.strip() for part in (before, after) if part.strip())
    return ParsedMessage(tuple(items), content)


# ----------------------------------------------------------------------------------------------- DeepSeek-V3
def _deepseek_token(words: str) -> str:
    """DeepSeek's special tokens, spelled with a full-width bar (U+FF5C) and '▁' (U+2581) for spaces."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


DS_CALLS_BEGIN, DS_CALLS_END = _deepseek_token("tool calls begin"), _deepseek_token("tool calls end")
DS_CALL_BEGIN, DS_CALL_END = _deepseek_token("tool call begin"), _deepseek_token("tool call end")
DS_SEP = _deepseek_token("tool sep")
_DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + "(.*?)" + re.escape(DS_CALL_END), re.DOTALL)
_DS_BODY = re.compile(r"\s*function" + re.escape(DS_SEP) + r"([^\n`]+?)\s*```json\s*(.*?)\s*```\s*", re.DOTALL)


def _deepseek_body(body: str) -> Item:
    call = _DS_BODY.fullmatch(body)
    if call is None:
        return CallError(f"a tool call must be function{DS_SEP}NAME, then the arguments in a ```json block")
    name = call.group(1).strip()
    try:
        args = json.loads(call.group(2))
    except json.JSONDecodeError as exc:
        return CallError(f"invalid JSON in the arguments of {name!r}: {exc.msg} at character {exc.pos}")
    return _with_arguments(name, args)


def parse_deepseek_v3(text: str) -> ParsedMessage:
    """DeepSeek-V3: `<｜tool▁calls▁begin｜>` then, per call, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
    ```json\\n{...}\\n```<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`. A call that is not closed is an error
    after the others (as for the tag formats); the text outside the calls and their section markers is the
    content."""
    bodies = _DS_CALL.findall(text)
    items = [_deepseek_body(body) for body in bodies]
    if text.count(DS_CALL_BEGIN) > len(bodies):
        items.append(CallError(f"a {DS_CALL_BEGIN} is not closed by {DS_CALL_END}"))
    content = _DS_CALL.sub("", text).replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "").strip()
    return ParsedMessage(tuple(items), content)


# ----------------------------------------------------------------------------------------------- Mistral
# Mistral's call markers, special tokens of its tokenizers ([ARGS] and [CALL_ID] from tokenizer v11 on)
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"\s*([^\s\[\]{}\"']+)\s*")


def _mistral_arguments(name: str, rest: str) -> tuple[Item, str]:
    """The call of `name` whose arguments (a JSON object) open `rest`, and the text after them."""
    body = rest.lstrip()
    try:
        args, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        return CallError(f"invalid JSON in the arguments of {name!r}: {exc.msg} at character {exc.pos}"), ""
    return _with_arguments(name, args), body[end:]


def _mistral_segment(segment: str) -> tuple[list[Item], str]:
    """The calls of the text after one [TOOL_CALLS] marker and the text after them: a JSON list of calls (tokenizer
    v3), or NAME[ARGS]{...} (v11 on; [CALL_ID]ID before [ARGS] where one is written; NAME{...} where the text lost
    the [ARGS] token, as vLLM reads it)."""
    body = segment.lstrip()
    if body.startswith("["):
        items, end = _json_calls(body, 0, lambda obj: _json_call(obj, "arguments"), MISTRAL_CALLS)
        return items, body[end:]
    if body.startswith("{"):
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as exc:
            return [CallError(f"invalid JSON in {MISTRAL_CALLS}: {exc.msg} at character {exc.pos}")], ""
        return [_json_call(value, "arguments")], body[end:]
    head, marker, rest = segment.partition(MISTRAL_ARGS)
    if not marker:
        head, brace, rest = segment.partition("{")
        rest = brace + rest
    name = _MISTRAL_NAME.fullmatch(head.partition(MISTRAL_CALL_ID)[0])
    if name is None or not rest.lstrip().startswith("{"):
        return [CallError(f"a call after {MISTRAL_CALLS} must be a JSON list of calls or NAME{MISTRAL_ARGS}"
                          "{arguments}")], ""
    item, after = _mistral_arguments(name.group(1), rest)
    return [item], after


def parse_mistral(text: str) -> ParsedMessage:
    """Mistral: the `[TOOL_CALLS]` token (a special token, which `message_decoder` keeps), then the calls in the
    form of the tokenizer's version: `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]` (tokenizer v3:
    Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Mistral-Nemo; an "id" key is ignored), or per call
    `[TOOL_CALLS]N[ARGS]{...}` (v11 on: Mistral-Small-3.1/3.2, Magistral, Devstral), as SGLang's and vLLM's mistral
    parsers read them. The text before the first marker and after the calls is the content; a message without the
    marker has no calls. A v3 list that is not valid JSON (a forced answer cut by the token limit) gives its complete
    calls, then one error for the rest (`_json_calls`), as the v11 form and the tag formats give theirs."""
    if MISTRAL_CALLS not in text:
        return ParsedMessage((), text.strip())
    before, *segments = text.split(MISTRAL_CALLS)
    items: list[Item] = []
    outside = [before]
    for segment in segments:
        found, after = _mistral_segment(segment)
        items += found
        outside.append(after)
    content = "\n".join(part.strip() for part in outside if part.strip())
    return ParsedMessage(tuple(items), content)


# ----------------------------------------------------------------------------------------------- gpt-oss (harmony)
# gpt-oss's harmony format: an answer is one or more messages, each `<|start|>ROLE` (the first one's is the
# generation prompt's), a header `<|channel|>CHANNEL`, an optional recipient ` to=functions.NAME` (before or after
# the channel) and content type (` <|constrain|>json` or ` json`), `<|message|>`, the body, and `<|end|>` (`<|call|>`
# after a call, `<|return|>` after the last answer: both stop tokens, which decoding may have left out).
H_START, H_END, H_MESSAGE, H_CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
H_CONSTRAIN, H_RETURN, H_CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_TOKENS = frozenset({H_START, H_END, H_MESSAGE, H_CHANNEL, H_CONSTRAIN, H_RETURN, H_CALL})
_H_ENDS = re.compile("|".join(re.escape(m) for m in (H_END, H_CALL, H_RETURN)))
_H_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+?)(?=\s|<\||$)")
_H_CHANNEL_NAME = re.compile(re.escape(H_CHANNEL) + r"\s*([^\s<]*)")
_H_FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyPart:
    """One message of a harmony answer: `channel` ("" where the header names none), `recipient` ("" for none: a
    message to the user; `functions.NAME`: a call), `body` (None: the header has no `<|message|>`, a marker fragment,
    such as a header the token limit cut), `raw` the message's text from its `<|start|>` (or the answer's start) to
    after its end marker, `start`/`end` where that is in the answer's text, `closed` whether an end marker closes
    it, and `plain` for text before any harmony marker (an answer a grammar wrote, or a model that ignores the
    format): content as it is."""

    channel: str
    recipient: str
    body: Optional[str]
    raw: str
    start: int
    end: int
    closed: bool
    plain: bool = False


def harmony_parts(text: str) -> list[HarmonyPart]:
    """The messages of a harmony answer in order (`HarmonyPart`); blank between them is left out."""
    parts: list[HarmonyPart] = []
    at = 0
    while at < len(text):
        nxt = text.find(H_START, at + len(H_START) if text.startswith(H_START, at) else at)
        seg_end = len(text) if nxt < 0 else nxt
        seg = text[at:seg_end]
        if not seg.strip():
            at = seg_end
            continue
        head, has_message, rest = seg.partition(H_MESSAGE)
        if not has_message:
            plain = not parts and H_CHANNEL not in seg and not seg.startswith(H_START)
            parts.append(HarmonyPart("", "", _harmony_plain(seg) if plain else None, seg, at, seg_end, False, plain))
            at = seg_end
            continue
        close = _H_ENDS.search(rest)
        body = rest if close is None else rest[:close.start()]
        end = seg_end if close is None else at + len(head) + len(H_MESSAGE) + close.end()
        channel = _H_CHANNEL_NAME.search(head)
        recipient = _H_RECIPIENT.search(head.replace(H_CHANNEL, " ").replace(H_CONSTRAIN, " "))
        parts.append(HarmonyPart(channel.group(1) if channel else "", recipient.group(1) if recipient else "", body,
                                 text[at:end], at, end, close is not None))
        if close is not None and text[end:seg_end].strip():  # text after a message's end: the user's, as is
            parts.append(HarmonyPart("", "", _harmony_plain(text[end:seg_end]), text[end:seg_end], end, seg_end, False,
                                     True))
        at = seg_end
    return parts


def _harmony_plain(text: str) -> str:
    """Text outside any harmony message, as content: without the end markers in it (`<|end|>`, `<|call|>`,
    `<|return|>`: a stop token the route put back after the answer, one after a message already closed), which are
    the format's tokens, never text a user reads (a harmony grammar's text admits no `<|`)."""
    return _H_ENDS.sub("", text)


def _harmony_call(part: HarmonyPart) -> Item:
    name = part.recipient[len(_H_FUNCTIONS):] if part.recipient.startswith(_H_FUNCTIONS) else part.recipient
    if not name:
        return CallError(f"a call to {part.recipient!r} names no function")
    if part.body is None:
        return CallError(f"the call of {name!r} has no {H_MESSAGE}")
    if not part.closed:  # (its end marker, <|call|>, is the stop token: the OpenAI routes put it back)
        return CallError(f"the call of {name!r} is not closed by {H_CALL}")
    if not part.body.strip():  # (gpt-oss writes `{}` for a call without arguments)
        return CallError(f"the call of {name!r} has no arguments (a JSON object)")
    try:
        args = json.loads(part.body)
    except json.JSONDecodeError as exc:
        return CallError(f"invalid JSON in the arguments of {name!r}: {exc.msg} at character {exc.pos}")
    return _with_arguments(name, args)


def _harmony_visible(part: HarmonyPart, reasoning_in_content: bool) -> bool:
    """Whether a part without a recipient is content: the final channel, a commentary preamble, plain text; the
    analysis channel too with `reasoning_in_content`."""
    return part.body is not None and (part.channel != "analysis" or reasoning_in_content)


def parse_harmony(text: str) -> ParsedMessage:
    """gpt-oss (harmony): each message with a recipient (`<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{...}<|call|>`, the recipient also before the channel, as gpt-oss's template writes history) is a call
    of NAME (a recipient outside `functions.`, a built-in tool's such as `python`, is the call of that name), its body
    the arguments as JSON; the bodies of the final channel and of commentary without a recipient (a preamble) are the
    content, one per line; the analysis channel is reasoning (`harmony_reasoning`), neither content nor calls. A
    header without `<|message|>` (a marker fragment, the token limit cut it) is dropped, unless it names a recipient
    and more follows; a call not closed by an end marker (`<|call|>`: the token limit cut it) is an error, the
    complete calls before it kept, so the text read must keep the stop token that ended the answer. Text with no
    harmony marker is all content."""
    items: list[Item] = []
    content = []
    parts = harmony_parts(text)
    for k, part in enumerate(parts):
        if part.recipient:
            if part.body is not None or k < len(parts) - 1:
                items.append(_harmony_call(part))
        elif _harmony_visible(part, False) and part.body.strip():
            content.append(part.body.strip())
    return ParsedMessage(tuple(items), "\n".join(content))


def harmony_call_names(text: str) -> list[str]:
    """The names of the calls of a harmony answer in order (its messages' recipients, `functions.` left out),
    malformed ones included: what gpt-oss's template names their results by (`relax.agents.render`). Text that is
    not harmony has none."""
    return [p.recipient[len(_H_FUNCTIONS):] if p.recipient.startswith(_H_FUNCTIONS) else p.recipient
            for p in harmony_parts(text) if p.recipient]


def harmony_reasoning(text: str) -> Optional[tuple[str, int]]:
    """(the reasoning of a harmony answer: the bodies of its analysis messages without a recipient, one per line;
    where the last of them ends in the text, its end marker included), None when it has none."""
    found = [p for p in harmony_parts(text) if p.channel == "analysis" and not p.recipient and p.body is not None]
    if not found:
        return None
    return "\n".join(p.body.strip() for p in found if p.body.strip()), found[-1].end


def harmony_content(text: str, *, reasoning_in_content: bool = False, calls_as_written: bool = True) -> str:
    """A harmony answer's text for the user where its calls are not read (no tools offered, or a malformed call: the
    message stays text, as for the other formats): the content `parse_harmony` reads, with each message that has a
    recipient as the model wrote it (markers included) where it stands; a trailing marker fragment left out.
    `reasoning_in_content`: the analysis bodies are content too (separate_reasoning false); `calls_as_written`
    false: the calls are left out (they were read)."""
    out = []
    for part in harmony_parts(text):
        if part.recipient:
            if calls_as_written and part.body is not None:
                out.append(part.raw.strip())
        elif _harmony_visible(part, reasoning_in_content) and part.body.strip():
            out.append(part.body.strip())
    return "\n".join(out)


def uses_harmony(template: Any) -> bool:
    """Whether a chat template (a string, a tokenizer's named templates, or a tokenizer) writes harmony messages
    (gpt-oss's: `<|channel|>`): its answers are read by `harmony_parts`, whatever the tool parser."""
    template = getattr(template, "chat_template", template)
    text = template if isinstance(template, str) else json.dumps(template or "")
    return H_CHANNEL in text


# ----------------------------------------------------------------------------------------------- the registry
BUILTIN_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "llama3_json": parse_llama3_json,
    "glm45": parse_glm45,
    "deepseek_v3": parse_deepseek_v3,
    "mistral": parse_mistral,
    "harmony": parse_harmony,
}
AUTO = "auto"

# What `auto` looks for in a chat template, first match wins: Qwen3-Coder's and GLM-4.5's templates also write
# <tool_call>, so their own markers come before Hermes'. A template with none of them gets Hermes where it has no
# place for tools (Relax's tools prompt then teaches Hermes' format: relax.serve.openai.chat.tools_prompt) and is
# refused where it has one (`parser_for_template`): its model writes calls in a format no marker here names.
TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    (H_CHANNEL, "harmony"),
    ("<function=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    ("tool\u2581calls\u2581begin", "deepseek_v3"),
    (PYTHON_TAG, "llama3_json"),
    ("ipython", "llama3_json"),
    (MISTRAL_CALLS, "mistral"),
    (OPEN_TAG, "hermes"),
)
# a template that uses this variable has a place for tools (as relax.serve.openai.chat.ChatFormat reads it)
TEMPLATE_TOOLS = "tools"


# The markers the built-in parsers and the reasoning split read. A tokenizer may make them special tokens (DeepSeek's
# tool-call markers, Llama's <|python_tag|>, Mistral's [TOOL_CALLS]); decoding a message with special tokens skipped
# would then drop them and a call would read as prose, silently. `message_decoder` keeps these and leaves the other
# special tokens out.
MARKERS: frozenset[str] = frozenset({
    "<think>", "</think>", OPEN_TAG, "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    PYTHON_TAG, DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP,
    MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID,
})


# ----------------------------------------------------------------------------------------------- reasoning
THINK, END_THINK = "<think>", "</think>"


def uses_reasoning(template: Any) -> bool:
    """Whether a chat template (a string, a tokenizer's named templates, or a tokenizer) uses <think> blocks: its
    answers may then open with one, which `split_reasoning` takes off."""
    template = getattr(template, "chat_template", template)
    text = template if isinstance(template, str) else json.dumps(template or "")
    return THINK in text


def opened_reasoning(prompt_text: str) -> str:
    """The <think> block a prompt leaves open for the answer: its last `<think>` and the blank after it when nothing
    else follows (the generation prompt of Qwen3.5 or DeepSeek-R1 writes `<think>\n` and the model writes the
    reasoning and `</think>`); "" when the prompt does not end inside one."""
    at = prompt_text.rfind(THINK)
    if at < 0 or prompt_text[at + len(THINK):].strip():
        return ""
    return prompt_text[at:]


def split_reasoning(text: str, opened: bool = False) -> Optional[tuple[tuple[int, int], int]]:
    """Where an answer holds its reasoning and its content: ((start, end) of the reasoning, start of the content),
    both stripped of the blank around them; None when it has no reasoning block. The block is one the answer opens
    with (`<think>` first), or, with `opened` (the prompt ended inside a block its generation prompt opened,
    `opened_reasoning`), the answer's text up to its `</think>`. A block never closed (the answer cut at its limit) is
    all reasoning, as SGLang's reasoning parser reads it. The one reading of reasoning: the OpenAI gateway's
    `reasoning_content` and the tool loop's calls (`without_reasoning`) both take it from here."""
    if opened:
        start = 0
    else:
        body = text.lstrip()
        if not body.startswith(THINK):
            return None
        start = len(text) - len(body) + len(THINK)
    end = text.find(END_THINK, start)
    content = len(text) if end < 0 else end + len(END_THINK)
    end = len(text) if end < 0 else end
    reasoning = text[start:end]
    start += len(reasoning) - len(reasoning.lstrip())
    end = max(start, end - (len(reasoning) - len(reasoning.rstrip())))
    content += len(text[content:]) - len(text[content:].lstrip())
    return (start, end), content


def without_reasoning(text: str, opened: bool = False) -> str:
    """The answer of a model message after its reasoning block (`split_reasoning`): what its tool calls are read
    from, as the gateway reads them (a call written inside the reasoning is thought, not made)."""
    split = split_reasoning(text, opened)
    return text if split is None else text[split[1]:]


# ----------------------------------------------------------------------------------------------- writing calls
def parser_format(parser: Any) -> Optional[str]:
    """The name of a built-in parser (`BUILTIN_PARSERS`), None for a parser of one's own."""
    return next((name for name, fn in BUILTIN_PARSERS.items() if fn is parser), None)


def _xml_written(value: Any) -> str:
    """An argument as the XML formats' templates write it: a string as its text, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def write_call(fmt: str, name: str, arguments: dict) -> str:
    """One call as the built-in format `fmt` writes it (what its parser reads, and what a forced call's grammar,
    `relax.rollout.grammar.tool_call_ebnf`, writes): JSON as json.dumps writes it. `arguments` is the object (a
    history call's JSON text is decoded and checked before: `relax.serve.openai.protocol.call_arguments`)."""
    if fmt == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{_xml_written(v)}\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if fmt == "glm45":
        params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_written(v)}</arg_value>\n"
                         for k, v in arguments.items())
        return f"<tool_call>{name}\n{params}</tool_call>"
    if fmt == "deepseek_v3":
        return (f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{json.dumps(arguments, ensure_ascii=False)}\n```"
                f"{DS_CALL_END}")
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    if fmt == "mistral":
        return write_calls(fmt, [(name, arguments)])
    if fmt == "harmony":  # as gpt-oss writes a call (its template writes history's with the recipient first)
        return (f"{H_CHANNEL}commentary to={_H_FUNCTIONS}{name} {H_CONSTRAIN}json{H_MESSAGE}"
                f"{json.dumps(arguments, ensure_ascii=False)}{H_CALL}")
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def write_calls(fmt: str, calls: Sequence[tuple[str, dict]]) -> str:
    """Calls (name, arguments) as the built-in format `fmt` writes several of them: one after another (a newline
    between them; "; " for llama3_json), DeepSeek's inside one section of calls, Mistral's in one list, harmony's
    one message each."""
    if fmt == "mistral":  # tokenizer v3's form (SGLang's): one list after one marker; parse_mistral reads every version
        objects = [{"name": name, "arguments": args} for name, args in calls]
        return f"{MISTRAL_CALLS} [" + ", ".join(json.dumps(o, ensure_ascii=False) for o in objects) + "]"
    written = [write_call(fmt, name, args) for name, args in calls]
    if fmt == "harmony":  # one message per call, each after the next one's start
        return (H_START + "assistant").join(written)
    if fmt == "deepseek_v3":
        return DS_CALLS_BEGIN + "\n".join(written) + DS_CALLS_END
    return ("; " if fmt == "llama3_json" else "\n").join(written)


# ----------------------------------------------------------------------------------------------- the tools' schemas
# keys of a JSON schema that say nothing of what a value's text may be (annotations)
_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "deprecated", "readOnly",
                          "writeOnly", "$comment"})


def xml_plain(schema: Any) -> bool:
    """Whether an XML format (qwen3_coder, glm45) writes an argument of `schema` as its templates write a string or
    an enum's word, as text: a schema of annotations only (type, description, default, ...) and an enum. A
    constrained call (`relax.rollout.grammar`) writes any other argument as JSON following the schema, a string with
    a length limit, a pattern or a format too (`apply_tool_schemas` reads such a string back from its JSON)."""
    return isinstance(schema, dict) and set(schema) <= _ANNOTATIONS | {"enum"}


def resolved_schema(schema: Any, root: Any) -> Any:
    """`schema` with its local `$ref` ("#/$defs/Color", a pydantic model's enum) followed inside `root` (the tool's
    `parameters`, where its refs point), the annotations beside the ref (a description) kept over the target's: what
    an XML format's argument is, to choose how it is written and read (`xml_plain`). Anything else (a ref to another
    document, one that does not resolve, a ref beside constraints, a cycle) is returned as it is."""
    for _ in range(32):  # (a chain of refs; a cycle stops here)
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        ref, others = schema["$ref"], {k: v for k, v in schema.items() if k != "$ref"}
        if not ref.startswith("#") or not set(others) <= _ANNOTATIONS:
            return schema
        target = root
        for part in ref[1:].split("/")[1:]:  # "#/$defs/Color" -> $defs, Color (JSON pointer escapes undone)
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return schema
        if not isinstance(target, dict):
            return schema
        schema = {**target, **others}
    return schema


def _json_string(text: str) -> Optional[str]:
    """The string `text` is the JSON of, or None when it is not a JSON string."""
    if not (text.startswith('"') and text.endswith('"')):
        return None
    try:
        value = json.loads(text, strict=False)  # control characters as such, as the grammar's JSON admits them
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _string_schema(schema: Any) -> tuple[bool, bool]:
    """(whether an argument of `schema` is a string, whether it may also be null)."""
    if not isinstance(schema, dict):
        return False, False
    kind = schema.get("type")
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        return others == ["string"], "null" in kind
    enum = schema.get("enum")
    if kind is None and isinstance(enum, list) and enum:
        return all(isinstance(v, str) for v in enum), False
    return kind == "string", False


def tool_functions(tools: Optional[Sequence[dict]]) -> dict[str, dict]:
    """The function objects of OpenAI tools (`{"type": "function", "function": {...}}`, or the function objects
    themselves), by name."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


def strict_schema_error(fn: dict) -> Optional[str]:
    """Why a `strict` function's `parameters` is not a JSON schema (None: it is one, or the function is not
    strict)."""
    if fn.get("strict") is not True:
        return None
    import jsonschema

    schema = fn.get("parameters", {})
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"is not a JSON schema: {exc.message}"
    return None


def apply_tool_schemas(parsed: ParsedMessage, tools: Optional[Sequence[dict]]) -> ParsedMessage:
    """`parsed` read with the schemas of the `tools` offered (OpenAI function tools), as SGLang's parsers read them:

    - an argument of an XML format (qwen3_coder, glm45) whose schema is a string keeps the text written (the formats
      write a string as its text, so "42" or "true" there is a string, not the JSON value); `null` where the schema
      also admits null; a string whose schema constrains its text (`xml_plain` false: a length limit, a pattern, a
      format), which a constrained call writes as JSON, is the string that JSON holds, where the text is one;
    - a call of a `strict` function whose arguments do not satisfy its `parameters` is a malformed call (`CallError`,
      naming the first failing part), never executed. (The OpenAI routes also constrain a strict tool's calls while
      they are sampled, as OpenAI and SGLang do: `relax.rollout.grammar.strict_calls`; this check catches the calls
      no grammar constrained: one cut by the token limit, the tool loop's.)

    Calls of functions not offered are left as they are (the loop or the agent answers them)."""
    functions = tool_functions(tools)
    if not functions or not parsed.calls:
        return parsed
    items: list[Item] = []
    for item in parsed.items:
        fn = functions.get(item.name) if isinstance(item, ToolCall) else None
        if fn is None:
            items.append(item)
            continue
        args = dict(item.arguments)
        properties = (fn.get("parameters") or {}).get("properties") or {}
        for key, text in (item.texts or {}).items():
            schema = resolved_schema(properties.get(key), fn.get("parameters"))  # a $ref'd enum: its words
            string, nullable = _string_schema(schema)
            if string:
                decoded = None if xml_plain(schema) else _json_string(text)
                args[key] = None if nullable and text == "null" else text if decoded is None else decoded
        item = ToolCall(item.name, args, texts=item.texts)
        if fn.get("strict") is True:
            import jsonschema

            schema = fn.get("parameters") or {"type": "object"}
            error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema)
                                                     .iter_errors(args))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path)
                item = CallError(f"the arguments of {item.name!r} do not satisfy its schema (strict)"
                                 f"{' at ' + where if where else ''}: {error.message}")
        items.append(item)
    return ParsedMessage(tuple(items), parsed.content)


def message_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """A function: a model message's tokens -> its text for the parsers, special tokens left out except the
    MARKERS (what `decode(..., skip_special_tokens=True)` gives when no marker is a special token), and on a harmony
    vocabulary its markers (HARMONY_TOKENS)."""
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    special |= set(getattr(tokenizer, "all_special_ids", ()))
    names = {i: tokenizer.convert_ids_to_tokens(i) for i in special}
    # a harmony vocabulary (gpt-oss's) keeps its message markers: they are what its answers are read by; another
    # vocabulary's `<|end|>` (Phi-3's end of turn) stays left out
    markers = MARKERS | HARMONY_TOKENS if H_CHANNEL in names.values() else MARKERS
    kept = {i for i, name in names.items() if name in markers}
    if not kept:
        return lambda tokens: tokenizer.decode(list(tokens), skip_special_tokens=True)
    dropped = frozenset(special - kept)
    return lambda tokens: tokenizer.decode([t for t in tokens if t not in dropped], skip_special_tokens=False)


class ToolParserSpecError(ValueError):
    """`data.tool_parser` names no usable parser; raised at start."""


def parser_for_template(template: Any) -> str:
    """The built-in parser for a chat template (a string, or a tokenizer's named templates), as `auto` picks it:
    the one whose marker the template holds (TEMPLATE_MARKERS); Hermes for a template without a place for tools
    (none: Relax's tools prompt teaches Hermes' format). A template with a place for tools and no known marker is a
    ToolParserSpecError naming data.tool_parser and its choices: its model writes calls in a format `auto` cannot
    name, and reading them as Hermes would turn every call into plain text, silently."""
    text = template if isinstance(template, str) else json.dumps(template or "")
    found = next((name for marker, name in TEMPLATE_MARKERS if marker in text), None)
    if found is not None:
        return found
    if TEMPLATE_TOOLS not in text:
        return "hermes"
    markers = ", ".join(dict.fromkeys(marker for marker, _ in TEMPLATE_MARKERS))
    raise ToolParserSpecError(
        f"data.tool_parser=auto: the model's chat template has a place for tools but none of the call markers auto "
        f"knows ({markers}), so the format its model writes calls in is unknown; set data.tool_parser to that "
        f"format's parser: one of {', '.join(BUILTIN_PARSERS)}, or 'package.module:function' (text -> "
        "relax.agents.parsers.ParsedMessage)")


def _check_signature(spec: str, fn: Callable[..., Any]) -> None:
    """ToolParserSpecError where `fn` cannot be called as every reader of calls calls it, `fn(text)`: found here,
    before anything starts, rather than as a TypeError at the first model turn a rollout reads."""
    mismatch = call_mismatch(fn, "text")
    if mismatch is not None:
        signature, why = mismatch
        raise ToolParserSpecError(f"data.tool_parser={spec!r}: {spec}{signature} cannot be called with the message's "
                                  f"text alone ({why}); a tool-call parser is a function text -> "
                                  "relax.agents.parsers.ParsedMessage")


def get_parser(spec: str, tokenizer: Any = None) -> ToolParser:
    """The parser `spec` (the value of data.tool_parser) names: `auto` (the one for `tokenizer`'s chat template,
    `parser_for_template`, which refuses a template with a place for tools in a format it does not know; Hermes
    without a template), a built-in name, or `package.module:function` (a function text -> ParsedMessage, refused
    here when it cannot be called with the text alone; its results are checked). Every program that reads calls
    resolves data.tool_parser here before it starts (relax-train's pre-start checks, the gateway, relax-serve), so a
    refusal stops it there."""
    if spec == AUTO:
        return BUILTIN_PARSERS[parser_for_template(getattr(tokenizer, "chat_template", None))]
    fn = resolve_component(BUILTIN_PARSERS, "data.tool_parser", spec, error=ToolParserSpecError,
                           unknown="{option}={spec!r}: unknown; expected auto, one of {builtins} or "
                                   "'package.module:function' (text -> relax.agents.parsers.ParsedMessage)",
                           unloadable="{option}: cannot load {spec!r}: {exc}")
    if not callable(fn):
        raise ToolParserSpecError(f"data.tool_parser={spec!r} is a {type(fn).__name__}, not a function text -> "
                                  "relax.agents.parsers.ParsedMessage")
    if spec in BUILTIN_PARSERS:
        return fn
    _check_signature(spec, fn)

    def checked(text: str) -> ParsedMessage:
        parsed = fn(text)
        if not isinstance(parsed, ParsedMessage) or not all(isinstance(i, (ToolCall, CallError))
                                                            for i in parsed.items):
            from relax.agents.protocol import UserCodeError  # a TypeError relax-train prints in one line

            raise UserCodeError(f"data.tool_parser={spec!r} returned {type(parsed).__name__}: expected a "
                            "relax.agents.parsers.ParsedMessage of ToolCall and CallError items")
        return parsed

    return checked
