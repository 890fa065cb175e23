"""OpenAI's Responses API (`POST /v1/responses`, the default of the openai-agents SDK) as a translation layer over the
chat pipeline: a request becomes a chat completion request (input items -> messages, `instructions` -> a system
message, Responses function tools -> chat tools) answered by `OpenAIService.chat`, and its answer becomes a
`response` object, or, streamed, the Responses stream events made from the chat stream's chunks as they come (on
relax-serve, as the tokens are drawn: `response.output_text.delta` at the chat deltas' token boundaries). Nothing is
rendered or sampled here: the prompt is the chat template's render of those messages (in a training session: the
session's tokens, reusing what was sampled, exactly as for a chat call), so a Responses call and the chat call it
translates to give and record the same tokens.

Input items: a string (one user message), or a list of message items (`{"role", "content"}`, content a string or
`input_text` / `output_text` parts), `function_call` items (an assistant message's tool calls: consecutive ones,
and the assistant message just before them, are one assistant message, as the chat answer they came from),
`function_call_output` items (tool messages), and `reasoning` items (the next assistant message's
reasoning_content: the text sealed in their `encrypted_content`, which must agree with their content when both are
sent; else the text of their content, else of their summary). Output items: a `reasoning` item when the answer has
reasoning_content, a `message` with one `output_text` when the answer has text (or no tool call), then one
`function_call` item per call, each with a fresh call id.

`previous_response_id`: the conversation of each answered response (its input after instructions, its output) is
kept in memory, bounded (`KEEP_SERVED` responses on relax-serve, `KEEP_PER_SESSION` per training session, oldest
dropped first), and prepended to the input of a response that names it; an unknown id is a 400
(`previous_response_not_found`), as OpenAI answers, and so is the id of a response created with `store: false` (OpenAI
keeps nothing of it). Stored or not, nothing outlives the process (or the session), and responses cannot be retrieved
by id. `include`: `message.output_text.logprobs` (the sampled tokens'
log-probs) and `reasoning.encrypted_content` (stateless clients, Codex with `store: false`: the reasoning item also
carries its text sealed by `ReasoningSeal`, signed with this server's key, which a later input's reasoning item may
carry alone; servers given the same secret share the key: `ReasoningSeal.from_environment`); the other values the
API defines are a 400 naming include and the value.

Every request field is listed in `FIELDS`: honoured, accepted without effect, or refused with a 400 naming it unless
it has a value that changes nothing, like the chat route's strict check (`relax.serve.openai.protocol.FIELDS`); so
is every key inside input items, content parts, tools, tool_choice, text.format and stream_options (the keys the
Responses API defines there, `check_keys`). The chat route's fields that SGLang's Responses route takes too
(`chat_template_kwargs`, `top_k`, `stop`, penalties, `min_p`, ...; `SHARED`), and `seed`, go into the chat request
as they are: honoured or refused by the chat route's own code, exactly as there. `reasoning.effort` is the chat
route's `reasoning_effort` ("none": SGLang's thinking switch, refused where the chat template would still let the model
reason; every effort: the template variable reasoning_effort where the template reads it, refused where it does not but
"none"), its errors named reasoning.effort; reasoning summaries are refused. `text.verbosity` is the chat route's
`verbosity` likewise. `truncation: "auto"`: where the prompt and max_output_tokens do not fit the context, the
earliest input items are dropped until they do (`Responses._answered`).
`request_id` (SGLang's, vLLM's) names the response. The response echoes the request's settings as OpenAI does: what
was applied, OpenAI's default where the request gave none (`echoed`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from relax.serve.http import EventSource
from relax.serve.openai.protocol import FIELDS as CHAT_FIELDS
from relax.serve.openai.protocol import (
    IMAGE_PART_TYPES,
    APIError,
    ContextLengthError,
    ImagePartError,
    StreamError,
    call_arguments,
    check_function,
    check_keys,
    check_metadata,
    check_prompt_cache_options,
    check_schema_name,
    check_tool_names,
    required_string,
)

KEEP_SERVED = 256  # responses relax-serve keeps for previous_response_id (oldest dropped first)
KEEP_PER_SESSION = 16  # per training session
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
# Every `include` value the Responses API defines (openai's ResponseIncludable), with why Relax cannot honour those it
# refuses; the two above it honours
INCLUDE_REFUSED = {
    "file_search_call.results": "no built-in file search",
    "web_search_call.results": "no built-in web search",
    "web_search_call.action.sources": "no built-in web search",
    "code_interpreter_call.outputs": "no built-in code interpreter",
    "computer_call_output.output.image_url": "no built-in computer use",
    "message.input_image.image_url": "text input only (no images on this route)",
}
HONOURED, NO_EFFECT, NEUTRAL_ONLY = "honoured", "accepted without effect", "refused unless neutral"


@dataclass(frozen=True)
class Rule:
    """What becomes of one request field (as `relax.serve.openai.protocol.Rule`): `neutral` says which values of a
    NEUTRAL_ONLY field change nothing (None always does); `chat`: the field is the chat route's, passed on to the chat
    request as it is, whose rule (`relax.serve.openai.protocol.FIELDS`, the same verdict) decides and names it."""

    verdict: str
    why: str
    neutral: Callable[[Any], bool] = lambda v: False
    chat: bool = False


FIELDS: dict[str, Rule] = {
    # ------------------------------------------------------------------ honoured
    "model": Rule(HONOURED, "any name: the served model answers"),
    "input": Rule(HONOURED, "a string or message, function_call, function_call_output and reasoning items"),
    "instructions": Rule(HONOURED, "a system message before the input (not carried over by previous_response_id)"),
    "tools": Rule(HONOURED, "function tools, as the chat route renders them"),
    "tool_choice": Rule(HONOURED, "as the chat route's tool_choice (allowed_tools too: the calls constrained to the "
                                  "listed tools, every tool still in the prompt)"),
    "parallel_tool_calls": Rule(HONOURED, "as the chat route's (false: at most one call)"),
    "text": Rule(HONOURED, "format: text, json_object or json_schema (the chat route's response_format: constrained "
                           "decoding); verbosity: the chat route's verbosity (the template variable where the "
                           "template reads it; \"medium\" everywhere)"),
    "max_output_tokens": Rule(HONOURED, "the chat route's max_tokens"),
    "temperature": Rule(HONOURED, "a training session samples at the run's"),
    "top_p": Rule(HONOURED, "a training session samples at the run's"),
    "stream": Rule(HONOURED, "the Responses stream events"),
    "previous_response_id": Rule(HONOURED, "its conversation, kept in memory, goes before the input"),
    "include": Rule(HONOURED, f"{LOGPROBS_INCLUDE} (the sampled tokens' log-probs) and {ENCRYPTED_INCLUDE} (the "
                              "reasoning as a sealed string to send back in a later input); the others name "
                              "built-in tool outputs or input images, which Relax does not have"),
    "top_logprobs": Rule(HONOURED, f"the likeliest tokens' log-probs (with include {LOGPROBS_INCLUDE})"),
    # ------------------------------------------------------------------ accepted without effect
    "store": Rule(HONOURED, "true (the default): kept in memory for previous_response_id only, never beyond the "
                            "process; false: not kept (its id as previous_response_id is a 400, as on OpenAI)"),
    "metadata": Rule(NO_EFFECT, "echoed in the response (OpenAI's limits checked, as on the chat route)"),
    "user": Rule(NO_EFFECT, "an end-user id for the provider's records"),
    "safety_identifier": Rule(NO_EFFECT, "an end-user id for the provider's records"),
    "prompt_cache_key": Rule(NO_EFFECT, "a cache hint; the tokens do not depend on it"),
    "prompt_cache_retention": Rule(NO_EFFECT, "a cache hint; the tokens do not depend on it"),
    "prompt_cache_options": Rule(NO_EFFECT, "cache hints (an object: mode, ttl, comparison_response_id; OpenAI's "
                                            "keys and values checked); the tokens do not depend on them; prewarm "
                                            "true (generate nothing) is refused"),
    "service_tier": Rule(NO_EFFECT, "one tier"),
    "max_tool_calls": Rule(NO_EFFECT, "bounds built-in tool calls; there are none"),
    "stream_options": Rule(NO_EFFECT, "include_obfuscation: no obfuscation field is added (only with stream=true, "
                                      "as on the chat route)"),
    # ------------------------------------------------------------------ refused unless neutral
    "background": Rule(NEUTRAL_ONLY, "every response runs in the foreground", lambda v: v is False),
    "background_options": Rule(NEUTRAL_ONLY, "every response runs in the foreground"),
    "truncation": Rule(HONOURED, '"auto": input items are dropped from the beginning of the conversation (never the '
                                 "instructions or the last user message) until the prompt and max_output_tokens fit "
                                 'the context; "disabled" (the default): too long is a 400'),
    "reasoning": Rule(HONOURED, "effort: the chat route's reasoning_effort (\"none\": thinking off as SGLang's; "
                                "each effort the template variable reasoning_effort where the template reads it, "
                                "refused where it does not); summaries are refused"),
    "request_id": Rule(HONOURED, "SGLang's and vLLM's: the response's id (for previous_response_id too)"),
    "ngram_corpus_id": Rule(NO_EFFECT, "SGLang's: a corpus for n-gram speculative decoding; there is none here, and "
                                       "speculative decoding would not change the answer's distribution"),
    "conversation": Rule(NEUTRAL_ONLY, "no stored conversations (use previous_response_id or send the input)"),
    "prompt": Rule(NEUTRAL_ONLY, "no stored prompt templates"),
    "context_management": Rule(NEUTRAL_ONLY, "no server-side compaction", lambda v: v == []),
    "moderation": Rule(NEUTRAL_ONLY, "no moderation"),
    "image": Rule(NEUTRAL_ONLY, "text only"),
    "access_programs": Rule(NEUTRAL_ONLY, "no access programs"),
}
# The chat route's fields that SGLang's ResponsesRequest (or vLLM's) takes too, with the same meaning: passed on to
# the chat request as they are, so each is honoured, accepted or refused exactly as on the chat route, and its errors
# name it. `seed` is Relax's (neither server takes it on /v1/responses): the chat route's, for reproducible answers.
SHARED = ("seed", "chat_template_kwargs", "top_k", "stop", "frequency_penalty", "presence_penalty", "min_p",
          "repetition_penalty", "logit_bias", "skip_special_tokens", "priority", "extra_key", "cache_salt",
          "session_id")
FIELDS.update({name: Rule(CHAT_FIELDS[name].verdict, f"as on the chat route: {CHAT_FIELDS[name].why}", chat=True)
               for name in SHARED})
REASONING_PARAM_KEYS = {"effort", "summary", "generate_summary", "context", "mode"}  # openai's Reasoning param
# chat errors name the chat field; the Responses field they come from
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "reasoning_effort": "reasoning.effort",
           "verbosity": "text.verbosity", "response_format": "text.format"}


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


def _empty(v: Any) -> bool:
    return v in ("", [], {}, False)


# the keys the Responses API defines in a request's nested objects (openai's responses *Param types), and the values
# of those Relax cannot honour (null always can)
_STATUS = "status"
MESSAGE_KEYS = {"type", "role", "content", "id", _STATUS, "phase"}
PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},  # a cache hint: the tokens do not depend on it
             "output_text": {"type", "text", "annotations", "logprobs"},  # logprobs: of an earlier answer, not read
             "refusal": {"type", "refusal"}, "text": {"type", "text"}}
PART_NEUTRAL = {"annotations": (_empty, "annotations (citations) are not rendered")}
_DIRECT = (lambda v: isinstance(v, dict) and v.get("type") == "direct", "only direct calls (no programs)")
_NO_NAMESPACE = (_empty, "function tools have no namespaces here")
# "async_": the openai package's field name for "async", which model_dump() of an answer's function_call writes
FUNCTION_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", _STATUS, "caller", "namespace", "async", "async_"}
FUNCTION_CALL_NEUTRAL = {"caller": _DIRECT, "namespace": _NO_NAMESPACE, "async": (_empty, "calls run in order"),
                         "async_": (_empty, "calls run in order")}
OUTPUT_KEYS = {"type", "call_id", "output", "id", _STATUS, "caller", "name", "namespace"}
OUTPUT_NEUTRAL = {"caller": _DIRECT, "namespace": _NO_NAMESPACE}
REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", _STATUS}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict", "allowed_callers", "defer_loading",
             "output_schema", "async"}
TOOL_NEUTRAL = {"allowed_callers": (lambda v: v == ["direct"], "only direct calls (no programs)"),
                "defer_loading": (_empty, "no tool search: every tool is in the prompt"),
                "output_schema": (_empty, "no programmatic calls read a tool's output"),
                "async": (_empty, "calls run in order")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


SEAL_PREFIX = "relax-reasoning-v1."  # the version: a later format gets another prefix, and this one stays readable


def _misconfigured(message: str) -> APIError:
    return APIError(f"the reasoning items' key: {message}", status=500, kind="server_error")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# The secret the reasoning seal's key is derived from, for servers that must read each other's reasoning items (several
# relax-serve processes behind a router, or one restarted): the secret itself, or a file holding it. Environment
# variables only (never a command-line argument: the process list shows those), never logged.
REASONING_SECRET_ENV = "RELAX_SERVE_REASONING_SECRET"
REASONING_SECRET_FILE_ENV = "RELAX_SERVE_REASONING_SECRET_FILE"
_KEY_CONTEXT = b"relax reasoning seal v1"  # the derived key is for this use only, whatever else the secret keys


class ReasoningSeal:
    """The `encrypted_content` of the reasoning items this server writes (`include: ["reasoning.encrypted_content"]`,
    what Codex and other stateless clients ask for with `store: false`) and reads back from a later request's input.
    It is not encrypted: the reasoning is the model's own text, which the item's content holds too. It is a signed,
    versioned envelope, `SEAL_PREFIX` + base64url of the JSON `{"text": ...}` + "." + base64url of its HMAC-SHA256
    under this server's key, so a string this server did not write (another provider's, such as OpenAI's, an altered
    one, or one signed with another key) is a 400 naming where it was, never read as something else.

    The key (`from_environment`): by default drawn when this object is made (once per relax-serve process and per
    training gateway) and never written anywhere, so reasoning from another process or from before a restart cannot
    be read back; derived from a configured secret (`REASONING_SECRET_ENV`, or the file `REASONING_SECRET_FILE_ENV`
    names), the same on every server given the same secret (`shared`), so any of them reads the others' items."""

    def __init__(self, key: Optional[bytes] = None, *, shared: bool = False):
        self._key = key if key is not None else secrets.token_bytes(32)
        self.shared = shared  # the key comes from a configured secret (for the 400's wording)

    @classmethod
    def from_secret(cls, secret: bytes) -> ReasoningSeal:
        """The seal whose key is derived from `secret` (HMAC-SHA256 of a fixed context under it)."""
        return cls(hmac.new(secret, _KEY_CONTEXT, hashlib.sha256).digest(), shared=True)

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> ReasoningSeal:
        """The seal of this server: derived from `$RELAX_SERVE_REASONING_SECRET`, or from the contents of the file
        `$RELAX_SERVE_REASONING_SECRET_FILE` names (its trailing newline left out), else a random key of its own. A
        secret that is empty, a file that cannot be read, or both variables set: a server error naming the variable
        (never the secret), raised where the server is made (a training gateway) or at its first Responses call
        (relax-serve)."""
        env = os.environ if environ is None else environ
        value, path = env.get(REASONING_SECRET_ENV), env.get(REASONING_SECRET_FILE_ENV)
        if value is not None and path is not None:
            raise _misconfigured(f"both ${REASONING_SECRET_ENV} and ${REASONING_SECRET_FILE_ENV} are set: give one")
        if path is not None:
            try:
                with open(path, "rb") as f:
                    secret = f.read().rstrip(b"\r\n")
            except OSError as exc:
                raise _misconfigured(f"${REASONING_SECRET_FILE_ENV}={path}: cannot be read "
                                     f"({exc.strerror or type(exc).__name__})") from None
            where = f"the file ${REASONING_SECRET_FILE_ENV} names ({path})"
        elif value is not None:
            secret, where = value.encode(), f"${REASONING_SECRET_ENV}"
        else:
            return cls()
        if not secret.strip():
            raise _misconfigured(f"{where} is empty: the reasoning items' key needs a secret")
        return cls.from_secret(secret)

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return "ReasoningSeal(key=<hidden>)"

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode("ascii"), hashlib.sha256).digest())

    def seal(self, text: str) -> str:
        """The encrypted_content of reasoning `text`."""
        body = SEAL_PREFIX + _b64(json.dumps({"text": text}, ensure_ascii=False).encode())
        return f"{body}.{self._mac(body)}"

    def open(self, blob: Any, where: str) -> str:
        """The reasoning text of an encrypted_content this server wrote; a 400 naming `where` for any other."""
        send_text = "send the reasoning text in the item's content instead, or leave the item out"
        if not isinstance(blob, str) or not blob.startswith(SEAL_PREFIX) or not blob.isascii():
            raise _bad(where, "not reasoning this server wrote: only the encrypted_content of this server's own "
                              "reasoning items can be read back (another provider's, such as OpenAI's, cannot); "
                              + send_text)
        body, _, mac = blob.rpartition(".")
        if not hmac.compare_digest(mac, self._mac(body)):
            if self.shared:
                raise _bad(where, "signed with another key than this server's, or altered since: written by a "
                                  f"server with another {REASONING_SECRET_ENV} (or "
                                  f"{REASONING_SECRET_FILE_ENV}), or with none; " + send_text)
            raise _bad(where, "not reasoning this server process wrote, or altered since (it is signed with a key "
                              "drawn when the server started: reasoning from before a restart, or from another "
                              f"server, cannot be read back unless the servers share a secret, "
                              f"{REASONING_SECRET_ENV}); " + send_text)
        try:
            payload = json.loads(_unb64(body[len(SEAL_PREFIX):]))
        except (ValueError, binascii.Error):
            payload = None
        text = payload.get("text") if isinstance(payload, dict) else None
        if not isinstance(text, str):  # signed by this key, so only a key shared with another format gets here
            raise _bad(where, "its signed content is not reasoning text; " + send_text)
        return text


# ------------------------------------------------------------------------------------------------------- input
def _part_text(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") in PART_KEYS:
        check_keys(part, where, PART_KEYS[part["type"]], PART_NEUTRAL)
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
            and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
        raise ImagePartError(where, "input_text, output_text")
    raise _bad(where, "only text parts (input_text, output_text) are supported")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # text parts joined by newlines, as chat's (relax.serve.openai.protocol._text) and vLLM's
        return "\n".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))
    raise _bad(where, "must be a string or a list of text parts")


def input_messages(items: Any, where: str = "input", seal: Optional[ReasoningSeal] = None) -> list[dict]:
    """Chat messages (as a chat request sends them) of a Responses `input`; `seal` reads the reasoning items'
    encrypted_content (None: no encrypted_content can be read)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad(where, "must be a string or a list of input items")
    out: list[dict] = []
    reasoning: Optional[str] = None  # a reasoning item's text, for the assistant message after it
    calls_open = False  # whether the last message is an assistant message that function_call items extend

    def assistant(content: Optional[str]) -> dict:
        nonlocal reasoning
        m: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            m["reasoning_content"], reasoning = reasoning, None
        out.append(m)
        return m

    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, "must be an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            check_keys(item, at, MESSAGE_KEYS, {"phase": (_empty, "messages have no phases here")})
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{at}.role", f"{role!r}; expected one of user, assistant, system, developer")
            text = _content(item.get("content"), f"{at}.content")
            if role == "assistant":
                assistant(text)
                calls_open = True
            else:
                out.append({"role": role, "content": text})
                calls_open = False
        elif kind == "function_call":
            check_keys(item, at, FUNCTION_CALL_KEYS, FUNCTION_CALL_NEUTRAL)
            # OpenAI's ResponseFunctionToolCallParam requires both: its 400 naming the field
            call_id = required_string(item, "call_id", f"{at}.call_id", "the id its function_call_output answers")
            name = required_string(item, "name", f"{at}.name", "the name of the function called")
            args = item.get("arguments")
            # a JSON object string, as on the chat route: absent, null or an object is a 400 naming input[i].arguments
            call_arguments(args, f"{at}.arguments", given="arguments" in item)
            m = out[-1] if calls_open and out else assistant(None)
            m.setdefault("tool_calls", []).append({"id": call_id, "type": "function",
                                                   "function": {"name": name, "arguments": args}})
            calls_open = True
        elif kind == "function_call_output":
            check_keys(item, at, OUTPUT_KEYS, OUTPUT_NEUTRAL)
            call_id = required_string(item, "call_id", f"{at}.call_id", "the call_id of the function_call it answers")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _content(output, f"{at}.output")})
            calls_open = False
        elif kind == "reasoning":
            check_keys(item, at, REASONING_KEYS)
            for key in ("summary", "content"):
                for j, part in enumerate(item.get(key) or []):
                    if isinstance(part, dict):
                        check_keys(part, f"{at}.{key}[{j}]", {"type", "text"})
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text") or "" for p in parts if isinstance(p, dict))
            if item.get("encrypted_content") not in (None, ""):  # the reasoning this server wrote: its text
                sealed = (seal or ReasoningSeal()).open(item["encrypted_content"], f"{at}.encrypted_content")
                if item.get("content") and reasoning != sealed:  # two texts: rendering either would be a guess
                    raise _bad(f"{at}.encrypted_content", "holds other reasoning than the item's content (send "
                                                          "the item as this server wrote it)")
                reasoning = sealed
            calls_open = False  # a new model turn: its message and calls come after
        else:
            raise _bad(f"{at}.type", f"{kind!r} is not supported (message, function_call, function_call_output, "
                                     "reasoning; item references need stored items: send the item itself)")
    return out


def chat_tools(tools: Any) -> Optional[list[dict]]:
    """Responses function tools (`{"type": "function", "name", "description", "parameters"}`) in the chat form.
    `strict` is passed on as the chat route takes it: a strict tool's call whose arguments do not satisfy its schema
    is a malformed call (`relax.agents.parsers.apply_tool_schemas`)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str) \
                or not t["name"]:
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]", f"{kind!r}: only function tools "
                                      '({"type": "function", "name": ..., "parameters": ...}) are supported')
        check_keys(t, f"tools[{i}]", TOOL_KEYS, TOOL_NEUTRAL)
        check_function(t, f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in t.items()
                                                      if k in ("name", "description", "parameters", "strict")}})
    check_tool_names([t["name"] for t in tools])
    return out


def chat_tool_choice(choice: Any) -> Any:
    """The chat form of a Responses tool_choice (the chat route decides what it supports)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        check_keys(choice, "tool_choice", {"type", "name"})
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        # {"type": "allowed_tools", "mode": ..., "tools": [{"type": "function", "name": ...}]}: the chat form's
        check_keys(choice, "tool_choice", {"type", "mode", "tools"})
        if choice.get("mode") not in ("auto", "required"):
            raise _bad("tool_choice.mode", f'{choice.get("mode")!r}: expected "auto" or "required"')
        listed = choice.get("tools")
        if not isinstance(listed, list):
            raise _bad("tool_choice.tools", "must be a non-empty list of function tools")
        names = []
        for j, t in enumerate(listed):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                kind = t.get("type") if isinstance(t, dict) else None
                raise _bad(f"tool_choice.tools[{j}]", f'{kind!r}: only function tools ({{"type": "function", '
                                                      '"name": ...}) are supported')
            check_keys(t, f"tool_choice.tools[{j}]", TOOL_KEYS, TOOL_NEUTRAL)
            names.append({"type": "function", "function": {"name": t["name"]}})
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": names}}
    if choice is None or isinstance(choice, str):
        return choice
    raise _bad("tool_choice", f"{choice!r} is not supported: 'auto', 'none', 'required', a function "
                              "({\"type\": \"function\", \"name\": ...}) or allowed_tools")


def chat_response_format(text: Any) -> Optional[dict]:
    """The chat route's response_format of a Responses `text` (its `format`: {"type": "text"}, {"type":
    "json_object"} or {"type": "json_schema", "name", "schema", "strict"}); None: plain text. Its verbosity is the
    chat request's (`parse_request`)."""
    if text is None:
        return None
    if not isinstance(text, dict) or not set(text) <= {"format", "verbosity"}:
        raise _bad("text", f"{text!r}: expected {{\"format\": {{...}}}}")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        check_keys(fmt, "text.format", {"type"})
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        check_keys(fmt, "text.format", {"type", "name", "schema", "strict", "description"})
        check_schema_name(fmt, "text.format.name")  # OpenAI requires it
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format", f"{fmt!r}: expected type text, json_object or json_schema")


# ------------------------------------------------------------------------------------------------------- request
@dataclass
class Request:
    """A Responses request read: the chat request it becomes and what the response echoes."""

    chat: dict  # the chat completion body (stream off: a stream is made from the chat stream's chunks)
    history: list[dict]  # messages before the instructions: the previous response's conversation and the input
    body: dict
    stream: bool = False
    logprobs: bool = False
    encrypted: bool = False  # include reasoning.encrypted_content: reasoning items carry it
    echo: dict = field(default_factory=dict)
    rid: Optional[str] = None  # request_id: the response's id (None: a fresh one)
    truncation: str = "disabled"  # "auto": the earliest input items are dropped where the input does not fit


def reasoning_effort(reasoning: Any) -> Any:
    """The effort a Responses `reasoning` asks for (None: none asked), for the chat request's reasoning_effort, which
    the chat route honours or refuses (its 400 renamed reasoning.effort); a 400 naming reasoning.<key> for the rest
    of the object that cannot be honoured (a summary, reasoning context or mode)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("reasoning", f"{reasoning!r} must be an object, e.g. {{\"effort\": \"none\"}}")
    check_keys(reasoning, "reasoning", REASONING_PARAM_KEYS, {
        "summary": (lambda v: False, "no reasoning summaries: the reasoning item holds the reasoning text"),
        "generate_summary": (lambda v: False, "no reasoning summaries: the reasoning item holds the reasoning text"),
        "context": (lambda v: False, "earlier reasoning is rendered as the chat template renders it"),
        "mode": (lambda v: False, "one reasoning mode")})
    return reasoning.get("effort")


def parse_include(include: Any) -> list[str]:
    """The `include` values of a request, each one Relax honours (`LOGPROBS_INCLUDE`, `ENCRYPTED_INCLUDE`); a 400
    naming include and the value for any other."""
    if include is None:
        return []
    if not isinstance(include, list):
        raise _bad("include", f"{include!r} must be a list")
    for value in include:
        if value in (LOGPROBS_INCLUDE, ENCRYPTED_INCLUDE):
            continue
        if isinstance(value, str) and value in INCLUDE_REFUSED:
            raise _bad("include", f"{value!r} is not supported by this server ({INCLUDE_REFUSED[value]}); "
                                  f"supported: {LOGPROBS_INCLUDE!r}, {ENCRYPTED_INCLUDE!r}")
        raise _bad("include", f"{value!r} is not an include value of the Responses API; supported: "
                              f"{LOGPROBS_INCLUDE!r}, {ENCRYPTED_INCLUDE!r}")
    return include


def parse_request(body: Any, previous: Callable[[str], list[dict]], seal: Optional[ReasoningSeal] = None) -> Request:
    """The chat request of a Responses request; `previous(id)` is the conversation of a kept response, `seal` reads
    the encrypted_content of its reasoning items (None: none can be read)."""
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    for name, value in body.items():
        rule = FIELDS.get(name)
        if rule is None:
            raise APIError(f"Unrecognized request argument supplied: {name}", param=name)
        if rule.verdict == NEUTRAL_ONLY and not rule.chat and value is not None and not rule.neutral(value):
            raise _bad(name, f"{value!r} is not supported by this server ({rule.why})")
    check_metadata(body.get("metadata"))
    check_prompt_cache_options(body.get("prompt_cache_options"), "responses")
    effort = reasoning_effort(body.get("reasoning"))
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise _bad("request_id", f"{rid!r} must be a non-empty string")
    if body.get("input") is None:
        raise _bad("input", "required: a string or a list of input items")
    include = parse_include(body.get("include"))
    logprobs = LOGPROBS_INCLUDE in include
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise _bad("stream", f"{stream!r} must be a boolean")
    options = body.get("stream_options")
    if options is not None:  # as the chat route's: only with stream
        if not isinstance(options, dict) or not stream:
            raise _bad("stream_options", "an object, allowed only with stream=true")
        check_keys(options, "stream_options", {"include_obfuscation"})
    top = body.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > 0 and not logprobs:
        raise _bad("top_logprobs", f'needs include: ["{LOGPROBS_INCLUDE}"] (the log-probs are returned only with it)')
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "must be a string")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise _bad("truncation", f"{truncation!r}: expected \"auto\" or \"disabled\"")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise _bad("previous_response_id", "must be a string")
    history = (previous(prev) if prev else []) + input_messages(body["input"], seal=seal)
    if not history:
        raise _bad("input", "required: at least one input item")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = chat_tools(body.get("tools"))
    if tools:  # [] is no tools: the Responses API takes it (openai-agents sends it without tools); Chat Completions not
        chat["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"))
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise _bad("parallel_tool_calls", f"{parallel!r} must be a boolean")
    if not tools and choice in ("auto", "none"):
        # the Responses API echoes tool_choice "auto" and parallel_tool_calls on every response, tools or not: without
        # tools these two change nothing (the chat route, as Chat Completions, refuses them there); a choice that
        # needs a tool ("required", a function, allowed_tools) goes on and is refused as such
        choice = None
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None and tools:
        chat["parallel_tool_calls"] = parallel
    text_format = chat_response_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_logprobs", "top_logprobs")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if logprobs:
        chat["logprobs"] = True
    for name in SHARED:  # the chat route reads them (and names them in its errors)
        if name in body:
            chat[name] = body[name]
    verbosity = (body.get("text") or {}).get("verbosity")
    if verbosity is not None:  # the chat route's verbosity (its errors renamed text.verbosity)
        chat["verbosity"] = verbosity
    if effort is not None:  # the chat route's reasoning_effort ("none": thinking off, checked against the template)
        chat["reasoning_effort"] = effort
    echo = echoed(body, instructions=instructions, prev=prev, verbosity=verbosity, effort=effort,
                  truncation=truncation)
    return Request(chat=chat, history=history, body=body, stream=bool(stream), logprobs=logprobs,
                   encrypted=ENCRYPTED_INCLUDE in include, echo=echo, rid=rid, truncation=truncation or "disabled")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def echoed(body: dict, *, instructions: Optional[str], prev: Optional[str], verbosity: Optional[str], effort: Any,
           truncation: Optional[str]) -> dict:
    """The request fields a response echoes, as OpenAI echoes them: the value applied, OpenAI's documented default
    where the request left one out or sent null (temperature 1, top_p 1, tool_choice "auto", parallel_tool_calls
    true, store true, top_logprobs 0, text.verbosity "medium", truncation "disabled", background false, service tier
    "default"). A training session's sampling replaces temperature and top_p, and reasoning.effort becomes the effort
    applied (`Responses.create`, `ChatFormat.applied_effort`)."""
    text = body.get("text") or {}
    return {"instructions": instructions, "previous_response_id": prev, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "max_output_tokens": body.get("max_output_tokens"),
            "temperature": _given(body.get("temperature"), 1.0), "top_p": _given(body.get("top_p"), 1.0),
            "metadata": body.get("metadata") or {}, "store": _given(body.get("store"), True),
            "parallel_tool_calls": _given(body.get("parallel_tool_calls"), True),
            "top_logprobs": _given(body.get("top_logprobs"), 0), "user": body.get("user"),
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": verbosity or "medium"},
            "reasoning": {"effort": effort, "summary": None}, "truncation": truncation or "disabled",
            "background": False, "service_tier": "default", "max_tool_calls": body.get("max_tool_calls"),
            "prompt_cache_key": body.get("prompt_cache_key"), "safety_identifier": body.get("safety_identifier"),
            "prompt_cache_retention": body.get("prompt_cache_retention")}


def drop_earliest(history: list[dict]) -> Optional[list[dict]]:
    """`truncation: "auto"`: the conversation without its earliest item (a message, or an assistant message with
    its calls), and without the tool results that answered calls no longer in it (a template cannot render a result
    without its call); None when nothing can be dropped: the last user message and what follows it are kept."""
    last_user = max((i for i, m in enumerate(history) if m.get("role") == "user"), default=0)
    if last_user == 0:
        return None
    rest = history[1:]
    while rest[0].get("role") == "tool":  # (the last user message stops it)
        rest = rest[1:]
    return rest


def renamed(exc: APIError) -> APIError:
    """A chat route's error named by the Responses field it comes from (a context-length 400 built again with the
    Responses fields, its text naming them too)."""
    if isinstance(exc, ContextLengthError):
        return exc.named(prompt=_PARAMS[exc.prompt], limit=_PARAMS[exc.limit])
    param = exc.param
    base = param.split("[")[0].split(".")[0] if param else None
    if base not in _PARAMS:
        return exc
    new = _PARAMS[base] + param[len(base):] if base != "messages" else _PARAMS[base]
    message = str(exc)
    if message.startswith(f"{param}:"):
        message = f"{new}:{message[len(param) + 1:]}"
    return APIError(message, status=exc.status, param=new, kind=exc.kind, code=exc.code)


# ------------------------------------------------------------------------------------------------------- answer
@dataclass
class Answer:
    """What the chat route answered (choice 0), as the response needs it."""

    content: str
    reasoning: Optional[str]
    tool_calls: list[dict]
    finish: str
    usage: dict
    pieces: list[str]  # the content as streamed (token boundaries)
    piece_logprobs: list[list[dict]]  # per piece: its tokens' log-probs (with logprobs)
    logprobs: Optional[list[dict]]  # every token's (with logprobs)


def answer_of(chat: dict) -> Answer:
    """A whole chat.completion's first choice."""
    choice = chat["choices"][0]
    m = choice["message"]
    lps = (choice.get("logprobs") or {}).get("content")
    content = m.get("content") or ""
    return Answer(content, m.get("reasoning_content"), m.get("tool_calls") or [], choice["finish_reason"],
                  chat["usage"], [content] if content else [], [lps or []] if content else [], lps)


class Folded:
    """A chat stream's chunks (usage included) put back together as they come (choice 0), keeping the token
    boundaries of its content deltas."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.piece_lps: list[list[dict]] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []
        self.finish, self.usage = "stop", {}
        self.every: list[dict] = []

    def add(self, chunk: dict) -> list[tuple[str, str, list[dict]]]:
        """Take one chunk; the pieces it brings, in order: ("reasoning", text, []) and ("content", text, its tokens'
        log-probs)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        new = []
        for c in chunk.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            delta = c.get("delta") or {}
            lps = (c.get("logprobs") or {}).get("content") or []
            self.every += lps
            if delta.get("reasoning_content"):
                self.reasoning.append(delta["reasoning_content"])
                new.append(("reasoning", delta["reasoning_content"], []))
            if delta.get("content"):
                self.pieces.append(delta["content"])
                self.piece_lps.append(lps)
                new.append(("content", delta["content"], lps))
            self.calls += delta.get("tool_calls") or []
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]
        return new

    def answer(self) -> Answer:
        calls = [{k: v for k, v in tc.items() if k != "index"} for tc in self.calls]
        return Answer("".join(self.pieces), "".join(self.reasoning) if self.reasoning else None, calls, self.finish,
                      self.usage, self.pieces, self.piece_lps, self.every)


def reasoning_item(rid: str, text: str, status: str, seal: Optional[ReasoningSeal]) -> dict:
    """A reasoning output item; with `seal` (include reasoning.encrypted_content) its encrypted_content too."""
    item = {"type": "reasoning", "id": rid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}
    if seal is not None:
        item["encrypted_content"] = seal.seal(text)
    return item


def output_items(a: Answer, logprobs: bool, ids: Optional[dict] = None,
                 seal: Optional[ReasoningSeal] = None) -> list[dict]:
    """The response's output: reasoning, the message, the function calls (`ids`: the reasoning's and the message's
    item ids, where a stream has named them already; `seal`: the reasoning item's encrypted_content is asked for)."""
    ids = ids or {"reasoning": new_id("rs"), "message": new_id("msg")}
    status = "incomplete" if a.finish == "length" else "completed"
    out: list[dict] = []
    if a.reasoning is not None:
        out.append(reasoning_item(ids["reasoning"], a.reasoning, status, seal))
    # an answer the limit cut before any text has no message: inside its reasoning, the reasoning item alone, as
    # OpenAI's reasoning models answer then; inside a forced answer's first call, no item (a message of no text would
    # be what a client shows as the answer); but where log-probs were asked for (message.output_text.logprobs), the
    # message of no text still carries the sampled tokens' log-probs
    cut_before_text = a.finish == "length" and not a.content and not logprobs
    if (a.content or not a.tool_calls) and not cut_before_text:
        part: dict[str, Any] = {"type": "output_text", "text": a.content, "annotations": []}
        if logprobs:
            part["logprobs"] = a.logprobs or []
        out.append({"type": "message", "id": ids["message"], "role": "assistant", "status": status,
                    "content": [part]})
    for tc in a.tool_calls:
        out.append({"type": "function_call", "id": new_id("fc"), "call_id": tc["id"],
                    "name": tc["function"]["name"], "arguments": tc["function"]["arguments"], "status": "completed"})
    return out


def response_object(req: Request, a: Answer, output: list[dict], *, rid: str, model: str, created: int) -> dict:
    """A `response` object, as OpenAI writes it."""
    u = a.usage
    incomplete = a.finish == "length"
    return {"id": rid, "object": "response", "created_at": created, "status": "incomplete" if incomplete else
            "completed", "completed_at": None if incomplete else int(time.time()), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "model": model,
            "output": output, "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled", **req.echo,
            "usage": {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
                      "total_tokens": u.get("total_tokens", 0),
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      # the reasoning item's tokens (the <think> block), counted within output_tokens
                      "output_tokens_details": {"reasoning_tokens": (u.get("completion_tokens_details") or {})
                                                .get("reasoning_tokens", 0)}}}


def response_events(req: Request, chunks: Iterator[dict], *, rid: str, model: str, created: int,
                    done: Callable[[Answer], None], seal: Optional[ReasoningSeal] = None) -> Iterator[bytes]:
    """The Responses stream of a chat stream's chunks, as they come: created, in_progress, then the reasoning item
    (a reasoning model's: added, its `reasoning_text` as deltas at the chat stream's reasoning deltas, done once the
    content begins or the answer ends), the message item and its part added and its text as deltas at the chat
    deltas' token boundaries; once the chat stream ended, each output item's rest (added where not yet, its text or
    arguments, done), then completed (incomplete: an answer cut at max_output_tokens, as OpenAI ends it). `done`
    takes the finished answer (before the last event); an error chunk ends the stream with an `error` event. With
    include reasoning.encrypted_content (`seal` writes it), the reasoning item's done event and the final response
    carry its encrypted_content."""
    seal = seal if req.encrypted else None
    seq = 0

    def emit(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        event = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()

    placeholder = Answer("", None, [], "stop", {}, [], [], None)
    start = {**response_object(req, placeholder, [], rid=rid, model=model, created=created), "status": "in_progress",
             "usage": None, "completed_at": None, "incomplete_details": None}
    yield emit("response.created", response=start)
    yield emit("response.in_progress", response=start)
    fold, ids = Folded(), {"reasoning": new_id("rs"), "message": new_id("msg")}
    thinking = {"output_index": 0, "item_id": ids["reasoning"], "content_index": 0}
    state = {"reasoning": "none"}  # none | open (its item added, deltas flowing) | done

    def open_reasoning() -> Iterator[bytes]:
        state["reasoning"] = "open"
        yield emit("response.output_item.added", item={"type": "reasoning", "id": ids["reasoning"], "summary": [],
                                                       "status": "in_progress", "content": []}, output_index=0)
        yield emit("response.content_part.added", part={"type": "reasoning_text", "text": ""}, **thinking)

    def close_reasoning(status: str) -> Iterator[bytes]:
        state["reasoning"] = "done"
        text = "".join(fold.reasoning)
        part = {"type": "reasoning_text", "text": text}
        yield emit("response.reasoning_text.done", text=text, **thinking)
        yield emit("response.content_part.done", part=part, **thinking)
        yield emit("response.output_item.done", item=reasoning_item(ids["reasoning"], text, status, seal),
                   output_index=0)

    opened: Optional[dict] = None  # the message's output_index, item_id and content_index, once it has begun
    for chunk in chunks:
        if isinstance(chunk, StreamError):  # the error the same request unstreamed is refused with, as named here
            error = renamed(chunk.error).body()["error"]
            yield emit("error", code=error["code"], message=error["message"], param=error["param"], error=error)
            return
        for kind, piece, lps in fold.add(chunk):
            if kind == "reasoning":
                if state["reasoning"] == "none":
                    yield from open_reasoning()
                yield emit("response.reasoning_text.delta", delta=piece, **thinking)
                continue
            if opened is None:  # the reasoning is over: its item done, then the message's
                at = 0
                if state["reasoning"] == "open":
                    yield from close_reasoning("completed")
                    at = 1
                yield emit("response.output_item.added", item={"type": "message", "id": ids["message"],
                                                               "role": "assistant", "status": "in_progress",
                                                               "content": []}, output_index=at)
                opened = {"output_index": at, "item_id": ids["message"], "content_index": 0}
                empty: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
                if req.logprobs:
                    empty["logprobs"] = []
                yield emit("response.content_part.added", part=empty, **opened)
            yield emit("response.output_text.delta", delta=piece, logprobs=lps, **opened)
    a = fold.answer()
    resp = response_object(req, a, output_items(a, req.logprobs, ids, seal), rid=rid, model=model, created=created)
    done(a)
    for i, item in enumerate(resp["output"]):
        at = {"output_index": i}
        if item["type"] == "reasoning":
            if state["reasoning"] == "none":  # (its text came with the answer's end)
                yield from open_reasoning()
                yield emit("response.reasoning_text.delta", delta=item["content"][0]["text"], **thinking)
            if state["reasoning"] == "open":
                yield from close_reasoning(item["status"])
            continue
        if item["type"] == "message":
            part = item["content"][0]
            ids_at = {**at, "item_id": item["id"], "content_index": 0}
            if opened is None:
                yield emit("response.output_item.added", item={**item, "status": "in_progress", "content": []}, **at)
                empty = {**part, "text": ""}
                if "logprobs" in part:
                    empty["logprobs"] = []
                yield emit("response.content_part.added", part=empty, **ids_at)
            yield emit("response.output_text.done", text=part["text"], logprobs=part.get("logprobs") or [], **ids_at)
            yield emit("response.content_part.done", part=part, **ids_at)
        elif item["type"] == "function_call":
            yield emit("response.output_item.added", item={**item, "arguments": "", "status": "in_progress"}, **at)
            yield emit("response.function_call_arguments.delta", item_id=item["id"], delta=item["arguments"], **at)
            yield emit("response.function_call_arguments.done", item_id=item["id"], name=item["name"],
                       arguments=item["arguments"], **at)
        elif opened is None:
            yield emit("response.output_item.added", item=item, **at)
        yield emit("response.output_item.done", item=item, **at)
    yield emit("response.incomplete" if resp["status"] == "incomplete" else "response.completed", response=resp)


def _assistant_message(a: Answer) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": a.content or None}
    if a.tool_calls:
        m["tool_calls"] = a.tool_calls
    if a.reasoning is not None:
        m["reasoning_content"] = a.reasoning
    return m


# ------------------------------------------------------------------------------------------------------- service
class Kept:
    """The conversations of the last `size` responses (oldest dropped first), for previous_response_id."""

    def __init__(self, size: int):
        self.size, self.items = size, OrderedDict()

    def get(self, rid: str) -> list[dict]:
        if rid not in self.items:
            raise APIError(f"Previous response with id '{rid}' not found (responses are kept in memory, the last "
                           f"{self.size} of this server or session)", param="previous_response_id",
                           code="previous_response_not_found")
        self.items.move_to_end(rid)
        if self.items[rid] is None:  # OpenAI keeps nothing of a `store: false` response: the same 400 as there
            raise APIError(f"Previous response with id '{rid}' not found: it was created with store: false, and a "
                           "response not stored cannot be continued (send its conversation as input, or create it "
                           "with store: true)", param="previous_response_id", code="previous_response_not_found")
        return list(self.items[rid])

    def put(self, rid: str, conversation: Optional[list[dict]]) -> None:
        """Keep `conversation` under `rid`; None: a `store: false` response, named as such when continued."""
        self.items[rid] = conversation
        while len(self.items) > self.size:
            self.items.popitem(last=False)


class Responses:
    """`POST /v1/responses` over `service` (`relax.serve.openai.service.OpenAIService`); calls with a training
    session are recorded by it, as chat calls, and keep their responses with the session."""

    def __init__(self, service: Any, *, keep: int = KEEP_SERVED, keep_per_session: int = KEEP_PER_SESSION):
        self.service, self.keep_per_session = service, keep_per_session
        # this server's key for the reasoning items' encrypted_content (a configured secret's, else its own)
        self.seal = ReasoningSeal.from_environment()
        self._served = Kept(keep)
        self._sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> Kept
        self._lock = threading.Lock()

    def _kept(self, session: Any) -> Kept:
        if session is None:
            return self._served
        with self._lock:
            kept = self._sessions.get(session)
            if kept is None:
                kept = self._sessions[session] = Kept(self.keep_per_session)
            return kept

    @staticmethod
    def _answered(req: Request, chat: dict, session: Any, call: Callable[[dict, Any], Any]) -> Any:
        """`call(chat, session)`, its errors named by the Responses fields; with truncation "auto", while the
        prompt and max_output_tokens do not fit the context (the chat route's context_length_exceeded, raised
        before anything is sampled or recorded), again without the conversation's earliest item (`drop_earliest`);
        what cannot be made to fit is the error "disabled" gives."""
        head = chat["messages"][:len(chat["messages"]) - len(req.history)]  # the instructions
        history = req.history
        while True:
            try:
                return call(chat, session)
            except APIError as exc:
                shorter = drop_earliest(history) if req.truncation == "auto" \
                    and exc.code == "context_length_exceeded" else None
                if shorter is None:
                    raise renamed(exc) from None
                history = shorter
                chat = {**chat, "messages": head + history}

    def _echo_effort(self, req: Request) -> None:
        """The response's reasoning.effort: the effort the answer was rendered with (OpenAI echoes the effective
        value; `ChatFormat.applied_effort`), read once the chat route took the request (so the effort is one it
        honours); likewise parallel_tool_calls false for a model whose template takes one call per message."""
        fmt = getattr(self.service, "fmt", None)
        if getattr(fmt, "single_call", False):  # the chat route made one call at most: the value applied
            req.echo["parallel_tool_calls"] = False
        if fmt is not None:
            req.echo["reasoning"] = {**req.echo["reasoning"], "effort": fmt.applied_effort(
                req.chat.get("reasoning_effort"), req.chat.get("chat_template_kwargs"))}

    def _image_refusal(self, exc: ImagePartError, session: Any) -> APIError:
        """The 400 for an image part in `input`: in a training session, that its calls take text only; on a
        vision-language model's server, where images are taken (chat completions' image_url parts); else that the
        served model is text-only."""
        model = getattr(self.service, "model", None)
        if session is not None:
            return exc.in_session()
        if getattr(self.service, "images", False):
            return APIError(f"{exc.where}: an image part: the Responses API takes text parts only (input_text, "
                            f"output_text); this server's model ({model}) takes images on /v1/chat/completions, as "
                            "image_url parts ({'type': 'image_url', 'image_url': {'url': "
                            "'data:image/png;base64,...'}})", param=exc.where)
        return exc.text_only(model) if model else exc

    def create(self, body: Any, session: Any = None) -> tuple[int, Any]:
        """(status, a `response` object or its event stream); APIError for a refused request."""
        kept = self._kept(session)

        def previous(rid: str) -> list[dict]:
            with self._lock:
                return kept.get(rid)

        try:
            req = parse_request(body, previous, self.seal)
        except ImagePartError as exc:  # why the image is refused: the model, or this route
            raise self._image_refusal(exc, session) from None
        limits = getattr(session, "limits", None)
        if limits is not None:  # a training session samples at the run's temperature and top_p: those are applied
            req.echo.update(temperature=float(limits.temperature), top_p=float(limits.top_p))
        chat = dict(req.chat)
        created = int(time.time())
        rid = req.rid or new_id("resp")

        def keep(a: Answer) -> None:
            with self._lock:
                kept.put(rid, req.history + [_assistant_message(a)] if req.echo["store"] is not False else None)

        if req.stream:  # the chat stream's chunks, as they come: the text deltas at their token boundaries
            chat["stream"], chat["stream_options"] = True, {"include_usage": True}
            chunks = self._answered(req, chat, session, self.service.chat_stream)
            self._echo_effort(req)
            events = response_events(req, chunks, rid=rid, model=str(req.chat["model"]), created=created, done=keep,
                                     seal=self.seal)
            return 200, EventSource(events, also=chunks)
        _, answer = self._answered(req, chat, session, self.service.chat)
        self._echo_effort(req)
        a = answer_of(answer)
        resp = response_object(req, a, output_items(a, req.logprobs, seal=self.seal if req.encrypted else None),
                               rid=rid, model=str(req.chat["model"]), created=created)
        keep(a)
        return 200, resp
