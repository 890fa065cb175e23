"""The OpenAI API's request and answer shapes: bodies of `/v1/chat/completions` and `/v1/completions` read into
`Params` (every problem an `APIError` with a 4xx status and OpenAI's error shape, naming the field), and choices
written back as OpenAI writes them, whole or as server-sent events.

Every field either endpoint takes is in `FIELDS`, with what becomes of it: honoured, accepted without effect (and why
it cannot change the answer), or refused unless at a neutral value. Honoured: `model` (any name: the served model
answers), `messages` (system, developer, user, assistant with `tool_calls`, tool answering one of those calls by its
`tool_call_id`; text content, as a string or text parts), `prompt` (completions: text or ids, or a list), `tools`
(function tools) with `tool_choice` "auto", "none", "required" or a named function (a call forced by constrained
decoding, in the tool parser's format), `response_format` (text, json_object, json_schema; SGLang's `regex`,
`json_schema`, `ebnf` beside it: constrained decoding), `n`, `max_tokens` / `max_completion_tokens` (default: the room
left under the context), `temperature`, `top_p`, `stop` (a string or up to 4; the engine stops there), `seed`,
`logprobs` (chat: a bool, completions: 0-5 as the number of top log-probs) and `top_logprobs`, `stream` with
`stream_options.include_usage`, and SGLang's `top_k`, `ignore_eos`, `no_stop_trim`, `chat_template_kwargs`,
`separate_reasoning` and `stream_reasoning` (chat: a <think> block opening the answer goes to `reasoning_content` when
the chat template uses <think>), and `reasoning_effort` (chat: "none" is SGLang's thinking switch, `THINKING_OFF` under
the request's own chat_template_kwargs; each of OpenAI's `EFFORTS` is the template variable `reasoning_effort` where the
chat template reads it, as SGLang renders it, and one other than "none" is refused where it does not), and `verbosity`
(chat: the template variable `verbosity` where the template reads it; "medium", OpenAI's default, on every template,
"low" and "high" refused where it does not read it). Log-probs are
the model's log-softmax at the request's temperature over the whole vocabulary (a grammar's mask applied), the ones
Relax trains with; with top_p < 1 or top_k the token is drawn from the truncated, renormalised distribution, whose
log-probs are not the ones reported (`relax.rollout.sampling`). Image parts
(`image_url`) are taken by relax-serve with a vision-language model, outside training sessions
(`relax.serve.openai.images`, before these rules read the messages). Anything else that would change the output
(penalties, min_p, `logit_bias`, images elsewhere, adapters, SGLang sessions) is refused with a 400 naming it, never
ignored. Inside the request's objects (messages, content parts, tool calls, tools, response_format, stream_options)
`check_keys` does the same: a key the OpenAI API does not define there is a 400 naming its path
(`messages[0].cache_control`), every key it defines is taken, and one Relax cannot honour is a 400 unless null or empty
(an echoed assistant refusal, audio, function_call, annotations).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from relax.agents.parsers import strict_schema_error

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 128
MAX_TOP_LOGPROBS = 20
CHAT, COMPLETION, BOTH = ("chat",), ("completion",), ("chat", "completion")
HONOURED, NO_EFFECT, NEUTRAL_ONLY = "honoured", "accepted without effect", "refused unless neutral"


@dataclass(frozen=True)
class Rule:
    """What becomes of one request field: `verdict` HONOURED (read into `Params` and acted on), NO_EFFECT (accepted
    with any value: `why` says why it cannot change the answer here) or NEUTRAL_ONLY (it would change the output
    and Relax cannot honour it: accepted only at `neutral`, the values that change nothing, or null; anything else
    is a 400 naming the field); `on`: the endpoints that take it (any other field is a 400 naming it)."""

    verdict: str
    why: str
    on: tuple[str, ...] = BOTH
    neutral: tuple = ()


_SGL = "SGLang extension"
_NO_CACHE = f"{_SGL}: a cache key; this engine keeps no cache between batches, the tokens do not depend on it"
_ROUTING = f"{_SGL}: routing among data-parallel workers; the answer is the same on any of them"
_ENGINE_LACKS = f"{_SGL}: the embedded engine samples with temperature, top_p and top_k only (relax.rollout.sampling)"
_ABSENT = f"{_SGL}: Relax returns no such data"
# Every field of /v1/chat/completions and /v1/completions, OpenAI's and SGLang's own (SGLang's ChatCompletionRequest
# and CompletionRequest, what sglang-router forwards), with what Relax does with it.
FIELDS: dict[str, Rule] = {
    # ------------------------------------------------------------------ honoured
    "model": Rule(HONOURED, "any name: the served model answers"),
    "messages": Rule(HONOURED, "the conversation, rendered with the chat template", CHAT),
    "prompt": Rule(HONOURED, "a string or token ids, or a list of them: n choices per prompt, prompt-major",
                   COMPLETION),
    "tools": Rule(HONOURED, "function tools, rendered by the template or as a Hermes system message; their schemas "
                            "read the calls (a strict tool's arguments constrained to its schema while sampled, "
                            "and checked against it)", CHAT),
    "tool_choice": Rule(HONOURED, '"auto", "none", "required", a named function (forced by constrained decoding '
                                  "in the tool parser's format: any built-in one) or allowed_tools (the calls "
                                  "constrained to the listed tools, every tool still in the prompt)", CHAT),
    "parallel_tool_calls": Rule(HONOURED, "false: at most one call (forced calls: exactly one), by constrained "
                                          "decoding in the tool parser's format", CHAT),
    "n": Rule(HONOURED, "choices, each with its own random stream"),
    "max_tokens": Rule(HONOURED, "default: the room left under the context (and a session's limits)"),
    "max_completion_tokens": Rule(HONOURED, "as max_tokens (the smaller of the two)", CHAT),
    "temperature": Rule(HONOURED, "a training session samples at the run's (counted as an override)"),
    "top_p": Rule(HONOURED, "a training session samples at the run's"),
    "top_k": Rule(HONOURED, f"{_SGL}: the engine implements top-k (-1: off); a training session uses the run's"),
    "stop": Rule(HONOURED, "the engine stops when one appears in the decoded tail; the text ends before it"),
    "seed": Rule(HONOURED, "choice k draws from row_stream(seed, k)"),
    "logprobs": Rule(HONOURED, "chat: a bool; completions: 0-5 top log-probs"),
    "top_logprobs": Rule(HONOURED, "the likeliest tokens' log-probs at each position", CHAT),
    "stream": Rule(HONOURED, "server-sent events ending with data: [DONE]"),
    "stream_options": Rule(HONOURED, "include_usage (include_obfuscation: no obfuscation field is added)"),
    "ignore_eos": Rule(HONOURED, f"{_SGL}: the stop tokens do not end the answer"),
    "no_stop_trim": Rule(HONOURED, f"{_SGL}: a stop string stays in the text (nothing changes without one)"),
    "chat_template_kwargs": Rule(HONOURED, f"{_SGL}: extra variables of the chat template (enable_thinking); a key "
                                           "the template does not read is a 400 naming it", CHAT),
    "reasoning_effort": Rule(HONOURED, 'chat: "none" turns thinking off (chat_template_kwargs thinking and '
                                       "enable_thinking false, as SGLang's), refused where the template would still "
                                       "reason; every effort is the template variable reasoning_effort where the "
                                       "chat template reads it (gpt-oss's), as SGLang passes it; other efforts are "
                                       "refused where it does not; completions: null only (no template)"),
    "verbosity": Rule(HONOURED, 'the template variable verbosity where the chat template reads it, as '
                                "reasoning_effort; \"medium\" (OpenAI's default) is accepted on every template, "
                                '"low" and "high" are refused where the template does not read it', CHAT),
    "separate_reasoning": Rule(HONOURED, f"{_SGL}: false keeps a <think> block in content", CHAT),
    "stream_reasoning": Rule(HONOURED, f"{_SGL}: false streams the reasoning as one delta", CHAT),
    # ------------------------------------------------------------------ accepted without effect
    "user": Rule(NO_EFFECT, "an end-user id for the provider's records"),
    "metadata": Rule(NO_EFFECT, "stored-completion tags; nothing is stored (OpenAI's limits checked: at most 16 "
                                "string values, keys of 64 characters, values of 512)"),
    "store": Rule(NO_EFFECT, "nothing is stored"),
    "service_tier": Rule(NO_EFFECT, "one tier"),
    "prompt_cache_key": Rule(NO_EFFECT, "a cache hint; the tokens do not depend on it"),
    # as the Responses route takes them (openai-agents sends prompt_cache_retention on chat when ModelSettings sets it)
    "prompt_cache_retention": Rule(NO_EFFECT, "a cache hint; the tokens do not depend on it", CHAT),
    "prompt_cache_options": Rule(NO_EFFECT, "cache hints (an object: mode, ttl; OpenAI's keys and values checked); "
                                            "the tokens do not depend on them", CHAT),
    "safety_identifier": Rule(NO_EFFECT, "an end-user id for the provider's records"),
    "rid": Rule(NO_EFFECT, f"{_SGL}: names the request for /abort_request; the answer is the same without it"),
    "extra_key": Rule(NO_EFFECT, _NO_CACHE),
    "cache_salt": Rule(NO_EFFECT, _NO_CACHE),
    "priority": Rule(NO_EFFECT, f"{_SGL}: scheduling order; a row's tokens do not depend on its batch"),
    "custom_labels": Rule(NO_EFFECT, f"{_SGL}: metric labels"),
    "routed_dp_rank": Rule(NO_EFFECT, _ROUTING),
    "data_parallel_rank": Rule(NO_EFFECT, _ROUTING),
    "disagg_prefill_dp_rank": Rule(NO_EFFECT, _ROUTING),
    "spaces_between_special_tokens": Rule(NO_EFFECT, f"{_SGL}: the text leaves special tokens out, so none are "
                                                     "spaced"),
    # ------------------------------------------------------------------ refused unless neutral
    "frequency_penalty": Rule(NEUTRAL_ONLY, "penalties: " + _ENGINE_LACKS, neutral=(0, 0.0)),
    "presence_penalty": Rule(NEUTRAL_ONLY, "penalties: " + _ENGINE_LACKS, neutral=(0, 0.0)),
    "repetition_penalty": Rule(NEUTRAL_ONLY, _ENGINE_LACKS, neutral=(1, 1.0)),
    "min_p": Rule(NEUTRAL_ONLY, _ENGINE_LACKS, neutral=(0, 0.0)),
    "min_tokens": Rule(NEUTRAL_ONLY, _ENGINE_LACKS, neutral=(0,)),
    "logit_bias": Rule(NEUTRAL_ONLY, _ENGINE_LACKS, neutral=({},)),
    "custom_logit_processor": Rule(NEUTRAL_ONLY, _ENGINE_LACKS),
    "custom_params": Rule(NEUTRAL_ONLY, _ENGINE_LACKS, neutral=({},)),
    "response_format": Rule(HONOURED, "text, json_object or json_schema (constrained decoding; the schema followed "
                                      "whether strict or not; with tools and tool_choice auto: tool calls or the "
                                      "format's content; with a forced call: the call, the format unused)"),
    "regex": Rule(HONOURED, f"{_SGL}: constrained decoding (one of regex, json_schema, ebnf, response_format)"),
    "json_schema": Rule(HONOURED, f"{_SGL}: constrained decoding, the schema as a JSON string"),
    "ebnf": Rule(HONOURED, f"{_SGL}: constrained decoding, xgrammar's EBNF (root rule root)"),
    "stop_regex": Rule(NEUTRAL_ONLY, f"{_SGL}: the engine matches stop strings only", neutral=("", [])),
    "stop_token_ids": Rule(NEUTRAL_ONLY, f"{_SGL}: the model's own stop tokens only (a training session's "
                                         "continuations know no others)", neutral=([],)),
    "skip_special_tokens": Rule(NEUTRAL_ONLY, f"{_SGL}: the text always leaves special tokens out", neutral=(True,)),
    "lora_path": Rule(NEUTRAL_ONLY, f"{_SGL}: the served weights answer (no adapter per request)"),
    "session_id": Rule(NEUTRAL_ONLY, f"{_SGL}: SGLang sessions keep a context Relax does not"),
    "session_params": Rule(NEUTRAL_ONLY, f"{_SGL}: SGLang sessions keep a context Relax does not", neutral=({},)),
    "return_hidden_states": Rule(NEUTRAL_ONLY, _ABSENT, neutral=(False,)),
    "return_routed_experts": Rule(NEUTRAL_ONLY, _ABSENT, neutral=(False,)),
    "return_cached_tokens_details": Rule(NEUTRAL_ONLY, _ABSENT, neutral=(False,)),
    "return_token_ids": Rule(NEUTRAL_ONLY, _ABSENT, neutral=(False,)),
    "return_prompt_token_ids": Rule(NEUTRAL_ONLY, _ABSENT, CHAT, neutral=(False,)),
    "return_meta_info": Rule(NEUTRAL_ONLY, _ABSENT, CHAT, neutral=(False,)),
    "continue_final_message": Rule(NEUTRAL_ONLY, f"{_SGL}: every prompt ends with the generation prompt", CHAT,
                                   neutral=(False,)),
    "input_ids": Rule(NEUTRAL_ONLY, f"{_SGL}: the prompt is the rendered messages", CHAT),
    "suffix": Rule(NEUTRAL_ONLY, "insertion is not supported", neutral=("",)),
    "echo": Rule(NEUTRAL_ONLY, "the prompt is not echoed", neutral=(False,)),
    "best_of": Rule(NEUTRAL_ONLY, "no server-side ranking", neutral=(1,)),
    "functions": Rule(NEUTRAL_ONLY, "deprecated: use tools"),
    "function_call": Rule(NEUTRAL_ONLY, "deprecated: use tool_choice"),
    "modalities": Rule(NEUTRAL_ONLY, "text only", neutral=(["text"],)),
    "audio": Rule(NEUTRAL_ONLY, "text only"),
    "prediction": Rule(NEUTRAL_ONLY, "no predicted outputs"),
    "web_search_options": Rule(NEUTRAL_ONLY, "no web search"),
    "moderation": Rule(NEUTRAL_ONLY, "no moderation", CHAT),
}
# reasoning_effort "none" switches thinking off as SGLang's ChatCompletionRequest does: both template variables
# (Qwen3 and GLM read enable_thinking, DeepSeek and Kimi thinking), under the request's own chat_template_kwargs
THINKING_OFF = {"thinking": False, "enable_thinking": False}
# OpenAI's reasoning efforts (the openai package's ReasoningEffort); any other value is a 400 naming reasoning_effort
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
EFFORT_VARIABLE = "reasoning_effort"  # the chat template variable SGLang renders it as (gpt-oss's template reads it)
# OpenAI's verbosities (chat `verbosity`, Responses `text.verbosity`); "medium" is OpenAI's default, accepted on every
# template; the others are the template variable `verbosity` where the template reads it, else a 400 naming it
VERBOSITIES = ("low", "medium", "high")
VERBOSITY_VARIABLE = "verbosity"
# chat_template_kwargs keys that name apply_chat_template's own arguments: they would replace what Relax renders
TEMPLATE_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the API refuses: `status` (4xx, or 5xx for the server's own failures) and OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class ContextLengthError(APIError):
    """The 400 of a prompt, or a prompt and its answer's token limit, past the model's context, built with the route's
    field names: `prompt` the field the prompt comes from (chat: messages; completions: prompt; Responses: input),
    `limit` the answer's token limit (max_tokens; Responses: max_output_tokens). OpenAI's (and vLLM's) wording
    first, which clients tell a context overflow by (litellm's ContextWindowExceededError matches "this model's
    maximum context length is", langchain-openai's context overflow "prompt is too long"), then what Relax adds.
    `completion` None: the prompt alone fills the context (`param` the prompt's field), else the answer's token
    limit, with `room` the tokens left under the context (`param` the limit's field)."""

    def __init__(self, context_length: int, prompt_tokens: int, completion: Optional[int] = None,
                 room: Optional[int] = None, *, prompt: str = "messages", limit: str = "max_tokens"):
        if completion is None:
            message = (f"This model's maximum context length is {context_length} tokens. However, your {prompt} "
                       f"resulted in {prompt_tokens} tokens. Please reduce the length of the {prompt}. (The prompt "
                       "is too long: it fills the model's context, leaving no room for an answer.)")
        else:
            message = (f"This model's maximum context length is {context_length} tokens. However, you requested "
                       f"{prompt_tokens + completion} tokens ({prompt_tokens} in the {prompt}, {completion} in the "
                       f"completion). Please reduce the length of the {prompt} or completion. (The completion's "
                       f"tokens are {limit}={completion}; without {limit} the answer may take the {room} tokens "
                       "left.)")
        super().__init__(message, param=prompt if completion is None else limit, code="context_length_exceeded")
        self.numbers, self.prompt, self.limit = (context_length, prompt_tokens, completion, room), prompt, limit

    def named(self, *, prompt: str, limit: str) -> ContextLengthError:
        """The same error on a route whose fields are `prompt` and `limit` (the Responses API's)."""
        return ContextLengthError(*self.numbers, prompt=prompt, limit=limit)


class StreamError(dict):
    """The chunk that ends a stream with `error`: OpenAI's stream error, `error`'s body (the `type`, `code`, `param`
    and message the same request unstreamed is refused with), keeping `error` for a stream made of these chunks
    (the Responses API's `error` event names it by its own fields)."""

    def __init__(self, error: APIError):
        super().__init__(error.body())
        self.error = error


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits on `metadata`


def check_metadata(metadata: Any) -> None:
    """OpenAI's `metadata` (both APIs): null or an object of at most 16 string values, keys of at most 64 characters,
    values of at most 512; anything else is a 400 naming the field (OpenAI refuses it so; nothing here reads it)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise _bad("metadata", f"{metadata!r}: expected an object of string values")
    if len(metadata) > METADATA_KEYS:
        raise _bad("metadata", f"{len(metadata)} keys: at most {METADATA_KEYS}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise _bad("metadata", f"the key {key[:METADATA_KEY_CHARS]!r}... is longer than {METADATA_KEY_CHARS} "
                                   "characters")
        if not isinstance(value, str):
            raise _bad(f"metadata.{key}", f"{value!r}: expected a string")
        if len(value) > METADATA_VALUE_CHARS:
            raise _bad(f"metadata.{key}", f"a string of {len(value)} characters: at most {METADATA_VALUE_CHARS}")


def required_string(obj: dict, key: str, param: str, what: str) -> str:
    """`obj[key]`, a string OpenAI requires (`what` says what it is, for the message), or OpenAI's 400 naming `param`:
    absent or null "Missing required parameter" (`missing_required_parameter`), another type `invalid_type`, the empty
    string `empty_string`."""
    value = obj.get(key)
    if value is None:
        raise APIError(f"Missing required parameter: '{param}' ({what}).", param=param,
                       code="missing_required_parameter")
    if not isinstance(value, str):
        raise APIError(f"Invalid type for '{param}': expected a string ({what}), but got {_kind(value)} instead.",
                       param=param, code="invalid_type")
    if not value:
        raise APIError(f"Invalid '{param}': empty string. Expected a string with minimum length 1, but got an empty "
                       "string instead.", param=param, code="empty_string")
    return value


# OpenAI's PromptCacheOptions (openai.types.chat / responses completion_create_params): the keys each API defines
PROMPT_CACHE_KEYS = {"chat": {"mode", "ttl"}, "responses": {"mode", "ttl", "prewarm", "comparison_response_id"}}
PROMPT_CACHE_MODES = ("implicit", "explicit")


def check_prompt_cache_options(options: Any, api: str) -> None:
    """`prompt_cache_options` (`api`: "chat" or "responses") as OpenAI's reference has it: null or an object (an
    `invalid_type` 400 naming the field otherwise) of the keys OpenAI defines there (`check_keys`); `mode` one of
    "implicit", "explicit" and `ttl` a string (cache hints: a local model keeps no prompt cache, so the tokens do not
    depend on them; the lifetimes OpenAI takes vary by API and model, so any string); Responses' `prewarm` true
    (prepare the cache and generate nothing) is refused, as it would change the answer."""
    where = "prompt_cache_options"
    if options is None:
        return
    if not isinstance(options, dict):
        raise APIError(f"Invalid type for '{where}': expected an object (e.g. {{\"mode\": \"implicit\", \"ttl\": "
                       f"\"30m\"}}), but got {_kind(options)} instead.", param=where, code="invalid_type")
    check_keys(options, where, PROMPT_CACHE_KEYS[api],
               {"prewarm": (lambda v: v is False, "every request generates its answer: no cache to prepare")})
    mode = options.get("mode")
    if mode is not None and mode not in PROMPT_CACHE_MODES:
        raise APIError(f"Invalid value: {mode!r}. Supported values are: 'implicit' and 'explicit'.",
                       param=f"{where}.mode", code="invalid_value")
    for key in ("ttl", "comparison_response_id"):
        if options.get(key) is not None and not isinstance(options[key], str):
            raise APIError(f"Invalid type for '{where}.{key}': expected a string, but got {_kind(options[key])} "
                           "instead.", param=f"{where}.{key}", code="invalid_type")


SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]+")  # OpenAI's pattern for a json_schema format's name (at most 64 long)
MAX_SCHEMA_NAME = 64


def check_schema_name(spec: dict, param: str) -> None:
    """OpenAI's 400 for a json_schema format whose required `name` (at `param`) is absent, not a string, empty, or not
    of OpenAI's pattern: a-z, A-Z, 0-9, underscores and dashes, at most 64 characters (its words and codes:
    `invalid_value`, `string_above_max_length`). What the SDKs send by default matches it: the openai package's
    `parse` sends the Pydantic class's name (a Python identifier; a generic model's "Answer[int]" does not, and
    OpenAI refuses it too), openai-agents "final_output", LangChain the Pydantic class's name or the dict schema's
    `title` (a title with a space is the user's, and refused as OpenAI refuses it)."""
    name = required_string(spec, "name", param, 'the json_schema format\'s name, e.g. "answer"')
    if not SCHEMA_NAME.fullmatch(name):
        raise APIError(f"Invalid '{param}': string does not match pattern. Expected a string that matches the "
                       f"pattern '^[a-zA-Z0-9_-]+$' (letters, digits, underscores and dashes), but got {name!r}.",
                       param=param, code="invalid_value")
    if len(name) > MAX_SCHEMA_NAME:
        raise APIError(f"Invalid '{param}': string too long. Expected a string with maximum length "
                       f"{MAX_SCHEMA_NAME}, but got a string with length {len(name)} instead.", param=param,
                       code="string_above_max_length")


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's pattern for a function's name


def _kind(value: Any) -> str:
    """The JSON type of a value, as OpenAI's type errors name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def check_function(fn: dict, where: str) -> None:
    """A function tool's name and parameters as OpenAI requires them, a 400 naming `where.name` or `where.parameters`
    otherwise (`where`: the chat route's `tools[i].function`, the Responses route's `tools[i]`): the name matches
    `^[a-zA-Z0-9_-]{1,64}$` (it is written into the prompt, the call format and its grammar, which expect a plain
    word), and the parameters, when given, are a JSON Schema (its metaschema's check, as OpenAI's) of an object, for
    every tool, strict or not: the templates, the tools prompt and a forced call's grammar read its properties."""
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise APIError(f"Invalid '{where}.name': {name!r} must match the pattern '^[a-zA-Z0-9_-]{{1,64}}$' (letters, "
                       "digits, underscores and dashes, at most 64).", param=f"{where}.name", code="invalid_value")
    params = fn.get("parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise APIError(f"Invalid type for '{where}.parameters': expected an object (a JSON Schema), but got "
                       f"{_kind(params)} instead.", param=f"{where}.parameters", code="invalid_type")
    import jsonschema  # Ray's dependency, so there wherever Relax runs

    why = None
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        why = f"{exc.message} (at {'/'.join(map(str, exc.path)) or 'the top'})"
    if why is None and params.get("type", "object") != "object":
        why = f"schema must be of type \"object\", got {json.dumps(params['type'])}"
    if why is not None:  # OpenAI's words and code; the templates and grammars read the properties of an object
        raise APIError(f"Invalid schema for function '{name}' ('{where}.parameters'): {why}.",
                       param=f"{where}.parameters", code="invalid_function_parameters")


def check_tool_names(names: list[str], where: str = "tools") -> None:
    """A 400 naming `where` for two tools of the same name: which schema a call, a forced call's grammar or
    apply_tool_schemas follows would be a guess."""
    seen = set()
    for i, name in enumerate(names):
        if name in seen:
            raise APIError(f"Invalid '{where}': duplicate function name {name!r} ({where}[{i}]); each tool needs "
                           "its own name.", param=where)
        seen.add(name)


def call_arguments(args: Any, where: str, *, given: bool = True) -> dict:
    """A history tool call's `arguments` as the object they encode: a JSON string of an object (the empty string:
    none, {}). `given` False (the key absent) is a 400 naming `where` (OpenAI's "Missing required parameter", `code`
    `missing_required_parameter`), and null or a JSON object given as such rather than as a string a 400 naming
    `where` too (OpenAI's "Invalid type ...: expected a string", `code` `invalid_type`), as OpenAI's schema has it:
    `arguments` is a required string (the SDKs send one: langchain-openai json.dumps its calls' args, openai-agents
    passes the string its items hold, "{}" for none). The empty string is a string, which OpenAI's schema takes (its
    own answers carry "" for a strict function without parameters): kept as {}, the one spelling of no arguments
    that is not JSON. Anything else (text that is not JSON, whitespace only included, JSON that is not an object:
    "[1, 2]", "5") is a 400 naming `where` too: every call format Relax renders history in (Hermes' and Llama's JSON
    objects, the XML key/value formats, DeepSeek's and harmony's JSON) writes an object, the model's tool parser reads
    nothing else back as a call, and several templates fail on anything else; refused on every model alike. (OpenAI
    takes `arguments` as an opaque string and a chat template that reads it as one writes it into the prompt as it
    is: whitespace would be a call with a blank where its JSON goes, which no call format holds and no model wrote;
    reading it as {} would render a call the client did not send. JSON's own whitespace around an object, ' {} ',
    is JSON and taken.)"""
    if not given:
        raise APIError(f"Missing required parameter: '{where}' (the call's arguments as JSON text, '{{}}' for "
                       "none).", param=where, code="missing_required_parameter")
    if not isinstance(args, str):
        raise APIError(f"Invalid type for '{where}': expected a string (the arguments as JSON text, e.g. "
                       f"'{{\"city\": \"Paris\"}}'), but got {_kind(args)} instead.", param=where, code="invalid_type")
    if args == "":
        return {}
    if not args.strip():
        raise APIError(f"Invalid '{where}': {args!r} is whitespace only, not a JSON object string; send '{{}}' (or "
                       "'') for a call without arguments.", param=where)
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError as exc:
        raise APIError(f"Invalid '{where}': {args[:80]!r} is not JSON ({exc.msg}); a call's arguments must be "
                       "a JSON object string (Relax writes history calls in the model's call format, which "
                       "holds an object).", param=where) from None
    if not isinstance(parsed, dict):
        raise APIError(f"Invalid '{where}': expected a JSON object string, but got {_kind(parsed)} ({args}); Relax "
                       "writes history calls in the model's call format, which holds an object.", param=where)
    return parsed


IMAGE_PART_TYPES = ("image_url", "input_image", "image")  # OpenAI's chat and Responses image parts, HF's


class ImagePartError(APIError):
    """A 400 for an image content part where the route takes text only (`where` names the part). The service,
    which knows the served model, says why (`text_only`: the model is text-only; `ImagePartError` itself: this
    route)."""

    def __init__(self, where: str, text_parts: str):
        super().__init__(f"{where}: only text parts ({text_parts}) are supported here, not an image part", param=where)
        self.where, self.text_parts = where, text_parts

    def text_only(self, model: str) -> APIError:
        """The refusal on a server of a text-only model (`model`, its name)."""
        return APIError(f"{self.where}: an image part, and the served model ({model}) is text-only: only text parts "
                        f"({self.text_parts}) are supported; image parts need a vision-language model (relax-serve "
                        "model=tiny_vl, or a Qwen2.5-VL / Qwen3-VL checkpoint)", param=self.where)

    def in_session(self) -> APIError:
        """The refusal inside a training session (the gateway of `data.openai_agent`), whatever the model: its
        episodes record text turns only (image parts in agent episodes are not built)."""
        return APIError(f"{self.where}: an image part: a training session's calls take text parts only "
                        f"({self.text_parts}): image parts in agent episodes are not built (a vision-language model "
                        "trains on images of the data's prompts, data.image_key)", param=self.where)


def _empty(v: Any) -> bool:
    return v in ("", [], {}, False)


def check_keys(obj: dict, where: str, known: Any, neutral: Optional[dict[str, tuple[Any, str]]] = None) -> None:
    """A 400 naming `where.key` for a key of `obj` that the OpenAI API does not define there (`known`: every key it
    defines, the ones clients echo back from earlier answers included), or one whose value Relax cannot honour:
    `neutral[key]` = (which values it can: a predicate, why the others cannot be); null always can."""
    for key, value in obj.items():
        if key not in known:
            raise APIError(f"{where}.{key}: unrecognized argument (expected only {', '.join(sorted(known))})",
                           param=f"{where}.{key}")
        ok, why = (neutral or {}).get(key, (None, ""))
        if ok is not None and value is not None and not ok(value):
            raise _bad(f"{where}.{key}", f"{value!r} is not supported by this server ({why})")


# the keys OpenAI's chat API defines in a request's nested objects (openai's ChatCompletion*Param types; an assistant
# message also as the ChatCompletionMessage a client echoes back, and SGLang's reasoning_content)
MESSAGE_KEYS = {"system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
                "user": {"role", "content", "name"}, "tool": {"role", "content", "tool_call_id"},
                "assistant": {"role", "content", "name", "tool_calls", "refusal", "audio", "function_call",
                              "annotations", "reasoning_content"}}
ASSISTANT_NEUTRAL = {"refusal": (_empty, "a refusal is not rendered: send its text as content"),
                     "audio": (_empty, "text only"),
                     "function_call": (_empty, "deprecated: send the call in tool_calls"),
                     "annotations": (_empty, "annotations (citations) are not rendered")}
TEXT_PART_KEYS = {"type", "text", "prompt_cache_breakpoint"}  # a cache hint: the tokens do not depend on it
TOOL_CALL_KEYS, CALLED_FUNCTION_KEYS = {"id", "type", "function"}, {"name", "arguments"}
TOOL_KEYS, FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
STREAM_OPTIONS_KEYS = {"include_usage", "include_obfuscation"}  # no obfuscation field is added either way


@dataclass
class Params:
    """What a request asks of generation and of the answer's shape."""

    n: int = 1
    max_tokens: Optional[int] = None  # None: the server's limit
    # the request's field that gave max_tokens, which a context-length 400 names (chat: max_completion_tokens where
    # that one sent the limit, the smaller of the two when both came)
    max_tokens_field: str = "max_tokens"
    temperature: Optional[float] = None  # None: not given (1.0, unless a training session sets the run's)
    top_p: Optional[float] = None  # None: not given (1.0)
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    tools: Optional[list[dict]] = None  # function tools offered to the model (None: none)
    top_k: int = -1  # SGLang's extension (-1: off); a training session sets the run's (rollout.top_k)
    model: str = ""
    ignore_eos: bool = False  # SGLang's: the stop tokens do not end the answer
    no_stop_trim: bool = False  # SGLang's: a stop string stays in the text
    template_kwargs: Optional[dict] = None  # chat_template_kwargs: extra variables of the chat template
    separate_reasoning: bool = True  # SGLang's: a <think> block goes to reasoning_content (templates that use it)
    stream_reasoning: bool = True  # SGLang's: the reasoning streams token by token (false: as one delta)
    thinking_off: bool = False  # reasoning_effort "none": the template must close the <think> block (THINKING_OFF)
    reasoning_effort: Optional[str] = None  # the template variable (where the template reads it, else a 400 but "none")
    verbosity: Optional[str] = None  # the template variable (where the template reads it, else a 400 but "medium")
    grammar: Optional[tuple[str, str]] = None  # constrained decoding: (json_schema | regex | ebnf, its text)
    tool_choice: Optional[str] = None  # a forced call: "required" (one or more calls) or the name of the function
    allowed: Optional[list[str]] = None  # tool_choice allowed_tools: the tools a call may be of (None: any in tools)
    parallel_tool_calls: bool = True  # false: at most one call (a forced one: exactly one)


def _number(body: dict, name: str, default: Optional[float], lo: float, hi: float) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(name, f"{v!r} must be a number in [{lo:g}, {hi:g}]")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(name, f"{v!r} must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
    return v


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"{v!r} must be a boolean")
    return v


def _common(body: dict, endpoint: str) -> Params:
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    for name in body:  # FIELDS: what becomes of each
        rule = FIELDS.get(name)
        if rule is None or endpoint not in rule.on:
            raise APIError(f"Unrecognized request argument supplied: {name}", param=name)
        if rule.verdict == NEUTRAL_ONLY and body[name] not in (None, *rule.neutral):
            raise _bad(name, f"{body[name]!r} is not supported by this server ({rule.why})")
    check_metadata(body.get("metadata"))
    if endpoint == "chat":
        check_prompt_cache_options(body.get("prompt_cache_options"), "chat")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required: a model name (any name; the served model answers)")
    p = Params(model=model)
    p.n = _integer(body, "n", 1, MAX_N) or 1
    limits = [(v, name) for name in ("max_tokens", "max_completion_tokens") if (v := _integer(body, name, 1))]
    if limits:  # the smaller of the two, named by its field
        p.max_tokens, p.max_tokens_field = min(limits, key=lambda limit: limit[0])
    p.temperature = _number(body, "temperature", None, 0.0, 2.0)
    p.top_p = _number(body, "top_p", None, 0.0, 1.0)
    if p.top_p == 0.0:
        raise _bad("top_p", "0 keeps no token; use a value in (0, 1]")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise _bad("stop", f"{stop!r} must be a non-empty string or a list of up to {MAX_STOP} of them")
    p.stop = list(stops)
    p.seed = _integer(body, "seed", -(2**63))
    top_k = _integer(body, "top_k", -1)
    if top_k == 0:
        raise _bad("top_k", "0 keeps no token; use -1 (off) or a value >= 1")
    p.top_k = -1 if top_k is None else top_k
    p.ignore_eos, p.no_stop_trim = _flag(body, "ignore_eos", False), _flag(body, "no_stop_trim", False)
    p.grammar = _grammar(body)
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise _bad("stream", f"{stream!r} must be a boolean")
    p.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not p.stream:
            raise _bad("stream_options", "an object, allowed only with stream=true")
        check_keys(options, "stream_options", STREAM_OPTIONS_KEYS)
        p.include_usage = bool(options.get("include_usage"))
    return p


def _grammar(body: dict) -> Optional[tuple[str, str]]:
    """The constrained decoding a request asks for, as the /generate sampling parameter that carries it:
    response_format json_object (any JSON object) or json_schema (its `schema`; `strict` or not, the answer follows
    it), or SGLang's regex, json_schema, ebnf fields; at most one. None: free text."""
    asked = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("text", "json_object", "json_schema"):
            check_keys(fmt, "response_format", {"type", "json_schema"} if kind == "json_schema" else {"type"})
        if kind == "json_object":
            asked.append(("json_schema", '{"type": "object"}'))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if isinstance(spec, dict):
                check_keys(spec, "response_format.json_schema", JSON_SCHEMA_KEYS)
            schema = spec.get("schema", {}) if isinstance(spec, dict) else None
            if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), (bool, type(None))):
                raise _bad("response_format", '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, '
                                              '"strict": true}}: the schema must be an object, strict a boolean')
            check_schema_name(spec, "response_format.json_schema.name")  # OpenAI requires it
            asked.append(("json_schema", json.dumps(schema)))
        elif kind != "text":
            raise _bad("response_format", f"{fmt!r}: expected type text, json_object or json_schema")
    for name in ("regex", "json_schema", "ebnf"):
        value = body.get(name)
        if value in (None, ""):
            continue
        if not isinstance(value, str):
            raise _bad(name, f"{value!r} must be a string")
        asked.append((name, value))
    if len(asked) > 1:
        raise _bad("response_format", "constrained decoding takes one of response_format, regex, json_schema, ebnf")
    return asked[0] if asked else None


def parse_chat(body: dict) -> tuple[list[dict], Params]:
    """The messages (normalized: `normalize_message`) and parameters of a chat completion request."""
    p = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "required: a non-empty list of messages")
    for i, m in enumerate(messages):
        _check_message_keys(m, f"messages[{i}]")
    normalized = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    _check_tool_answers(normalized)
    logprobs = body.get("logprobs")
    if logprobs not in (None, True, False):
        raise _bad("logprobs", f"{logprobs!r} must be a boolean")
    p.logprobs = bool(logprobs)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not p.logprobs:
        raise _bad("top_logprobs", "needs logprobs=true")
    p.top_logprobs = top or 0
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of function tools")
        if not tools:  # OpenAI's Chat Completions: at least one tool, or no `tools` (the Responses API takes [])
            raise APIError("[] is too short - 'tools': give at least one function tool, or leave tools out",
                           param="tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise _bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
            check_keys(t, f"tools[{i}]", TOOL_KEYS)
            check_keys(fn, f"tools[{i}].function", FUNCTION_KEYS)
            check_function(fn, f"tools[{i}].function")
            if fn.get("strict") not in (None, True, False):
                raise _bad(f"tools[{i}].function.strict", f"{fn['strict']!r}: expected true or false")
            if (why := strict_schema_error(fn)) is not None:  # checked against it: it must be a schema
                raise _bad(f"tools[{i}].function.parameters", f"of a strict function {why}")
        check_tool_names([t["function"]["name"] for t in tools])
    if not tools:  # OpenAI's: the tool options need tools
        for name in ("tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise APIError(f"Invalid value for '{name}': '{name}' is only allowed when 'tools' are specified.",
                               param=name)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        mode, p.allowed = _allowed_tools(choice, tools)
        if mode == "required":
            p.tool_choice = mode
    elif isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}: exactly that call
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", f'{choice!r} must be {{"type": "function", "function": {{"name": ...}}}}')
        check_keys(choice, "tool_choice", {"type", "function"})
        check_keys(fn, "tool_choice.function", {"name"})
        if name not in [t["function"]["name"] for t in tools or []]:
            raise _bad("tool_choice", f"names the function {name!r}, which is not in tools")
        p.tool_choice = name
    elif choice == "required":
        if not tools:
            raise _bad("tool_choice", '"required" needs tools')
        p.tool_choice = choice
    elif choice not in (None, "auto", "none"):
        raise _bad("tool_choice", f'{choice!r}: expected "auto", "none", "required", {{"type": "function", '
                                  '"function": {"name": ...}} or {"type": "allowed_tools", ...}')
    formatted = isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text"
    if p.tool_choice is not None and p.grammar is not None and not formatted:
        # SGLang's regex, json_schema, ebnf constrain the whole answer, which a forced call constrains too. A
        # response_format governs a content answer, which a forced call's answer cannot be: the call is the answer
        # (OpenAI's reading; openai-agents sends both: an output_type with tool_choice "required")
        raise _bad("tool_choice", "a forced call and SGLang's regex, json_schema or ebnf both constrain the whole "
                                  "answer: give one")
    p.tools = tools if tools and choice != "none" else None
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise _bad("parallel_tool_calls", f"{parallel!r} must be a boolean")
    p.parallel_tool_calls = parallel is not False
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs", f"{kwargs!r} must be a JSON object, e.g. "
                                               '{"enable_thinking": false}')
        reserved = sorted(TEMPLATE_RESERVED & set(kwargs))
        if reserved:
            raise _bad("chat_template_kwargs", f"{', '.join(reserved)}: set by the server, not a template variable")
        p.template_kwargs = dict(kwargs) or None
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad("reasoning_effort", f"{effort!r}: expected one of {', '.join(EFFORTS)} (OpenAI's efforts), or null")
    p.reasoning_effort = effort  # the service renders it where the template reads it (it knows the template)
    verbosity = body.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise _bad("verbosity", f"{verbosity!r}: expected one of {', '.join(VERBOSITIES)} (OpenAI's), or null")
    p.verbosity = verbosity  # the service renders it where the template reads it
    if effort == "none":  # the request's own keys win, as SGLang's
        p.template_kwargs, p.thinking_off = {**THINKING_OFF, **(p.template_kwargs or {})}, True
    p.separate_reasoning = _flag(body, "separate_reasoning", True)
    p.stream_reasoning = _flag(body, "stream_reasoning", True)
    return normalized, p


def _allowed_tools(choice: dict, tools: Optional[list[dict]]) -> tuple[str, Optional[list[str]]]:
    """(mode, the names of the tools a call may be of; None: every tool) of a tool_choice `{"type": "allowed_tools",
    "allowed_tools": {"mode": "auto" | "required", "tools": [{"type": "function", "function": {"name": ...}}]}}`
    (OpenAI's: the listed tools restrict the calls while `tools` stays whole in the prompt, for prompt caching); a
    400 naming what is wrong."""
    where = "tool_choice.allowed_tools"
    check_keys(choice, "tool_choice", {"type", "allowed_tools"})
    spec = choice.get("allowed_tools")
    if not isinstance(spec, dict):
        raise _bad(where, 'required: {"mode": "auto" | "required", "tools": [{"type": "function", "function": '
                          '{"name": ...}}, ...]}')
    check_keys(spec, where, {"mode", "tools"})
    mode, listed = spec.get("mode"), spec.get("tools")
    if mode not in ("auto", "required"):
        raise _bad(f"{where}.mode", f'{mode!r}: expected "auto" or "required"')
    if not isinstance(listed, list) or not listed:
        raise _bad(f"{where}.tools", "must be a non-empty list of function tools")
    offered = [t["function"]["name"] for t in tools or []]
    names = []
    for j, t in enumerate(listed):
        fn = t.get("function") if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(name, str):
            raise _bad(f"{where}.tools[{j}]", f'{t!r}: only function tools ({{"type": "function", "function": '
                                              '{"name": ...}}) are supported')
        check_keys(t, f"{where}.tools[{j}]", TOOL_KEYS)
        check_keys(fn, f"{where}.tools[{j}].function", FUNCTION_KEYS)  # (the name says which of `tools` it is)
        if name not in offered:
            raise _bad(f"{where}.tools[{j}]", f"names the function {name!r}, which is not in tools")
        names.append(name)
    return mode, None if set(names) == set(offered) else [n for n in offered if n in names]


def _check_message_keys(m: Any, where: str) -> None:
    """A 400 naming `where.key` for a key OpenAI does not define on a message of its role (`MESSAGE_KEYS`), in its
    text parts or its tool calls, or for an echoed-back assistant field that is set (a refusal, audio, a legacy
    function_call, annotations): Relax renders none of them."""
    if not isinstance(m, dict) or m.get("role") not in MESSAGE_KEYS:
        return  # normalize_message names what is wrong with it
    check_keys(m, where, MESSAGE_KEYS[m["role"]], ASSISTANT_NEUTRAL if m["role"] == "assistant" else None)
    if isinstance(m.get("content"), list):
        for j, part in enumerate(m["content"]):
            if isinstance(part, dict) and part.get("type") == "text":
                check_keys(part, f"{where}.content[{j}]", TEXT_PART_KEYS)
        check_text_only_roles(m, where)
    if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
        for j, call in enumerate(m["tool_calls"]):
            if isinstance(call, dict):
                # OpenAI's ChatCompletionMessageFunctionToolCallParam: `type` is required ("function"); the SDKs
                # send it (openai-agents' converter, langchain-openai's _lc_tool_call_to_openai_tool_call)
                if call.get("type") is None:
                    param = f"{where}.tool_calls[{j}].type"
                    raise APIError(f"Missing required parameter: '{param}' (\"function\").", param=param,
                                   code="missing_required_parameter")
                check_keys(call, f"{where}.tool_calls[{j}]", TOOL_CALL_KEYS,
                           {"type": (lambda v: v == "function", "only function tool calls")})
                # `id` is required too, a string (a tool message names it in tool_call_id); OpenAI's schema sets it
                # no minimum length, so "" is left to the tool messages' check (`_check_tool_answers`)
                if not isinstance(call.get("id"), str):
                    required_string(call, "id", f"{where}.tool_calls[{j}].id", "the id of the call, which the tool "
                                    "message answering it names in tool_call_id")
                if isinstance(call.get("function"), dict):
                    check_keys(call["function"], f"{where}.tool_calls[{j}].function", CALLED_FUNCTION_KEYS)


IMAGE_PART_KEYS = {"type", "image_url", "prompt_cache_breakpoint"}
# the content parts a message of these roles takes: text (OpenAI's ChatCompletionContentPartText; an assistant's
# refusal parts, which OpenAI's schema takes too, Relax renders not: `_text` refuses them); a user message's alone
# may hold images
TEXT_ONLY_ROLES = ("system", "developer", "tool", "assistant")


def check_text_only_roles(m: Any, where: str) -> None:
    """OpenAI's 400 (`invalid_value`, naming `where.content[j].type`) for a part other than text in a system,
    developer, tool or assistant message (`TEXT_ONLY_ROLES`): on a vision-language model too, where relax-serve would
    otherwise take an image part (`check_image_parts`, before `relax.serve.openai.images.take_images`) and render it;
    an image part is told to go in a user message. openai-agents sends such messages' text only (its converter's
    extract_text_content; a tool output's text parts unless preserve_tool_output_all_content)."""
    if not isinstance(m, dict) or m.get("role") not in TEXT_ONLY_ROLES or not isinstance(m.get("content"), list):
        return
    for j, part in enumerate(m["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":  # no type at all: `_text` names the part
            param, article = f"{where}.content[{j}].type", "an" if m["role"] == "assistant" else "a"
            advice = "; send images in a user message" if kind in IMAGE_PART_TYPES else ""
            raise APIError(f"Invalid value: {kind!r}. Supported values are: 'text' ({param}: {article} {m['role']} "
                           f"message takes text parts only{advice}).", param=param, code="invalid_value")


def check_image_parts(body: Any) -> None:
    """The keys of a request's image parts (`{"type": "image_url", "image_url": {"url", "detail"}}`), checked before
    `relax.serve.openai.images.take_images` replaces the parts: a key OpenAI does not define there is a 400 naming its
    path, and so is a `detail` other than "auto" (the image is read at the processor's own resolution), and an image
    part in a message of another role than user (`check_text_only_roles`)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        check_text_only_roles(m, f"messages[{i}]")
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}]"
                check_keys(part, where, IMAGE_PART_KEYS)
                if isinstance(part.get("image_url"), dict):
                    check_keys(part["image_url"], f"{where}.image_url", {"url", "detail"}, {"detail": (
                        lambda v: v == "auto", "the image is read at the processor's own resolution")})


def _check_tool_answers(messages: list[dict]) -> None:
    """Each tool message answers a call of the assistant message before it (tool messages between them aside), by
    its `tool_call_id`, as OpenAI requires: a 400 naming messages[i].tool_call_id otherwise."""
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            continue
        param, call_id = f"messages[{i}].tool_call_id", m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise APIError(f"Missing required parameter: '{param}' (the id of the tool call it answers).",
                           param=param, code="missing_required_parameter")
        j = i - 1
        while j >= 0 and messages[j]["role"] == "tool":
            j -= 1
        calls = (messages[j].get("tool_calls") or []) if j >= 0 and messages[j]["role"] == "assistant" else []
        if call_id not in [c.get("id") for c in calls]:
            raise _bad(param, f"{call_id!r} answers no tool call of the preceding assistant message (a tool message "
                              "must follow the assistant message with tool_calls whose id it names)")


def _one_prompt(prompt: Any) -> bool:
    """Whether `prompt` is one prompt: a non-empty string or list of token ids."""
    return bool(prompt) and (isinstance(prompt, str) or isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def parse_completion(body: dict) -> tuple[list[Any], Params]:
    """The prompts (each a string or a list of token ids: OpenAI's `prompt` is one of them or a list of them) and
    parameters of a completion request."""
    p = _common(body, "completion")
    if body.get("reasoning_effort") is not None:
        raise _bad("reasoning_effort", f"{body['reasoning_effort']!r} is not supported on completions (a raw prompt: "
                                       "no chat template to switch thinking off in)")
    prompt = body.get("prompt")
    prompts = [prompt] if _one_prompt(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(_one_prompt(q) for q in prompts):
        raise _bad("prompt", "required: a non-empty string or list of token ids, or a list of them")
    top = _integer(body, "logprobs", 0, 5)
    p.logprobs, p.top_logprobs = top is not None, top or 0
    return prompts, p


def _text(content: Any, where: str) -> Optional[str]:
    """A message's content as text: a string, None, or text parts joined by newlines (as vLLM joins them for a chat
    template that reads content as a string: parts stay apart, "sunny" and "warm" not "sunnywarm")."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise ImagePartError(f"{where}.content[{j}]", "{'type': 'text', 'text': ...}")
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]", "only text parts ({'type': 'text', 'text': ...}) are supported")
            out.append(part["text"])
        return "\n".join(out)
    raise _bad(f"{where}.content", "must be a string or a list of text parts")


def normalize_message(m: Any, where: str = "message") -> dict:
    """A message as plain values that compare equal when they mean the same: role, content (text or None),
    tool calls as (name, arguments parsed from JSON), tool_call_id, name; and an assistant message's
    reasoning_content (text), which chat templates render for the turns after the last user message (Qwen3's,
    GLM-4.5's; as SGLang and vLLM pass it on) and `same_message` does not compare."""
    if not isinstance(m, dict):
        raise _bad(where, "must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{role!r}; expected one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for j, c in enumerate(m["tool_calls"]):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"{where}.tool_calls[{j}]",
                           "must be {'type': 'function', 'function': {'name', 'arguments'}}")
            parsed = call_arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments",
                                    given="arguments" in fn)
            calls.append({"id": c.get("id"), "name": fn["name"], "arguments": parsed})
        out["tool_calls"] = calls
    elif role != "assistant" and out["content"] is None:
        raise _bad(f"{where}.content", f"required for a {role} message")
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "assistant" and m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise _bad(f"{where}.reasoning_content", f"{m['reasoning_content']!r} must be a string")
        if m["reasoning_content"]:
            out["reasoning_content"] = m["reasoning_content"]
    return out


def same_message(a: dict, b: dict) -> bool:
    """Whether two normalized messages mean the same (tool call ids and empty-vs-missing content aside)."""
    def key(m: dict) -> tuple:
        calls = tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls") or ())
        return m["role"], (m.get("content") or "").strip(), calls, m.get("tool_call_id"), m.get("name")
    return key(a) == key(b)


# --------------------------------------------------------------------------------------------------- answers
@dataclass
class Choice:
    """One generated answer: its text (stop sequence cut), tokens and their log-probs."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    pieces: list[str]  # each token's text (with logprobs; [] without)
    finish_reason: str  # stop | length | tool_calls
    top: Optional[list[list[tuple[str, float]]]] = None  # per token: (text, log-prob) of the most likely tokens
    tool_calls: Optional[list[dict]] = None  # OpenAI tool_calls of a chat answer
    reasoning: Optional[str] = None  # reasoning_content: the text of a <think> block split off (None: none was)
    think_text: str = ""  # with `reasoning`: the answer's text before its content (the block as the model wrote it)
    reasoning_tokens: int = 0  # with `reasoning`: the sampled tokens of the <think> block (counted in `tokens`)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    """OpenAI's usage, summed over the choices; with reasoning (a choice whose <think> block was split off),
    completion_tokens_details.reasoning_tokens: the tokens of the blocks, counted within completion_tokens."""
    done = sum(len(c.tokens) for c in choices)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                             "total_tokens": prompt_tokens + done}
    if any(c.reasoning is not None for c in choices):
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in choices),
                                              "accepted_prediction_tokens": 0, "audio_tokens": 0,
                                              "rejected_prediction_tokens": 0}
    return usage


def _token_logprobs(c: Choice, top: int) -> list[dict]:
    return [token_logprob(piece, lp, (c.top[i] if c.top else [])[:top])
            for i, (piece, lp) in enumerate(zip(c.pieces, c.logprobs, strict=True))]


def chat_answer(choices: list[Choice], p: Params, prompt_tokens: int, *, model: str, extra: dict | None = None) -> dict:
    """A `chat.completion` object."""
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
        if c.reasoning is not None:
            message["reasoning_content"] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        out.append({"index": i, "message": message, "finish_reason": c.finish_reason,
                    "logprobs": {"content": _token_logprobs(c, p.top_logprobs)} if p.logprobs else None})
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": _usage(prompt_tokens, choices), **(extra or {})}


def completion_answer(choices: list[Choice], p: Params, prompt_tokens: int, *, model: str) -> dict:
    """A `text_completion` object."""
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if p.logprobs:
            offsets, at = [], 0
            for piece in c.pieces:
                offsets.append(at)
                at += len(piece)
            logprobs = {"tokens": c.pieces, "token_logprobs": c.logprobs, "text_offset": offsets,
                        "top_logprobs": [dict(alts[:p.top_logprobs]) for alts in c.top] if c.top else None}
        out.append({"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs})
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": _usage(prompt_tokens, choices)}


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def sse(chunks: Any) -> Iterator[bytes]:
    """Chunks (JSON objects) as server-sent events, then `data: [DONE]`."""
    for chunk in chunks:
        yield _event(chunk).encode()
    yield b"data: [DONE]\n\n"


def indexed_calls(calls: list[dict]) -> list[dict]:
    """A message's tool calls as a stream's delta writes them (each with its `index`)."""
    return [{"index": k, **tc} for k, tc in enumerate(calls)]


def token_logprob(piece: str, logprob: float, alts: Optional[list[tuple[str, float]]] = None) -> dict:
    """One token's entry of a chat answer's logprobs.content."""
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts or []]}
