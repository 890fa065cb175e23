"""The model's chat format for the OpenAI API: messages and tools rendered into prompt tokens with the model's chat
template, later messages of a conversation rendered as tokens to append after what the model sampled, and the
model's text read back into content and tool calls.

Tools: a template that takes `tools` (Qwen3's, for one) renders them itself; for one that does not (plain ChatML,
DeepSeek-V3), a system message lists them and teaches the format of the tool parser in use, with an example call
(`tools_prompt`: Hermes' `<tool_call>` for hermes, DeepSeek's markers for deepseek_v3, ...; Hermes for a parser of
one's own), unless the conversation's system messages already describe every tool (`_described`: a prompt that
teaches its own format). Earlier assistant messages with tool calls are rendered by the template where it renders
`tool_calls`, else written in that same format, and the model's calls are read by that tool parser
(`relax.agents.parsers`: data.tool_parser, by default the one of the chat template), so the prompt, the parser, a
forced call's grammar and the history agree.

A template that refuses a conversation (its own `raise_exception`) is a 400 quoting it (`template_refusal`); one that
refuses a system message gets the tools prompt in the first user message instead.

Reasoning: an answer's <think> block is split off by `relax.agents.parsers.split_reasoning`, also when the prompt
ended inside a block its generation prompt opened (Qwen3.5's `<think>\n`: `ChatFormat.opens_reasoning`). A harmony
template's (gpt-oss's, `ChatFormat.harmony`) answers are messages on channels instead: the analysis channel is the
reasoning, the final channel the content (`relax.agents.parsers.harmony_parts`), and a message's
`reasoning_content` goes to the template as `thinking`, the field it reads.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import secrets
import string
import threading
import uuid
from typing import Any, Optional

from relax.agents.parsers import (
    END_THINK,
    THINK,
    ParsedMessage,
    ToolCall,
    ToolParser,
    apply_tool_schemas,
    get_parser,
    harmony_content,
    message_decoder,
    opened_reasoning,
    parse_hermes,
    parser_format,
    split_reasoning,
    uses_harmony,
    uses_reasoning,
    write_calls,
)
from relax.agents.render import ObservationRenderer
from relax.data.tokenizer import template_call_text, template_single_call
from relax.rollout.grammar import MISTRAL_ARGS, MISTRAL_V11
from relax.serve.openai.deltas import CALL_STARTS, held_prefix_tail
from relax.serve.openai.protocol import (
    EFFORT_VARIABLE,
    EFFORTS,
    TEMPLATE_RESERVED,
    VERBOSITY_VARIABLE,
    APIError,
)

__all__ = ["END_THINK", "THINK", "ChatFormat", "split_reasoning", "tools_prompt"]

TOOLS_PROMPT = ("You may call one or more functions to assist with the user query. The functions are listed in "
                "<tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call a function, write the call in this format "
                "(this example calls {name}):\n{example}\n{several}")
SEVERAL = {"llama3_json": 'Several calls are written one after another, separated by "; ".',
           "deepseek_v3": "Several calls are written one after another inside one such section of calls."}
SEVERAL_DEFAULT = "Several calls are written one after another, separated by a newline."


def _described(messages: list[dict], tools: list[dict], markers: tuple[str, ...]) -> bool:
    """Whether the conversation's system messages already describe every tool (a prompt that teaches its own
    format, such as a dataset's system prompt with its own tool listing): each tool listed as JSON (`"name":
    "<tool>"`, as a JSON listing of a function writes it), or each named as a word in a prompt that shows the call
    format (holds one of `markers`, the tool parser's call markers: `<tool_call>` for hermes). A tool's name in prose
    alone ("Always search carefully") does not count: that prompt teaches the model neither the schema nor the
    format."""
    system = " ".join(m.get("content") or "" for m in messages if m["role"] in ("system", "developer"))
    names = [t["function"]["name"] for t in tools]
    if all(re.search(r'"name"\s*:\s*' + re.escape(json.dumps(n)), system) for n in names):
        return True
    return any(m in system for m in markers) and all(
        re.search(r"(?<![\w-])" + re.escape(n) + r"(?![\w-])", system) for n in names)


def _example_value(schema: Any) -> Any:
    """A placeholder value of a JSON schema for an example call: an enum's or const's first value, else by type."""
    if not isinstance(schema, dict):
        return "..."
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _example_value(schema[key][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return {"integer": 0, "number": 0, "boolean": True, "null": None, "array": [], "object": {}}.get(kind, "...")


def example_call(tool: dict) -> tuple[str, dict]:
    """(name, arguments) of an example call of an OpenAI function tool: every listed parameter, in the schema's
    order, with a placeholder value of its schema."""
    fn = tool.get("function", tool)
    props = (fn.get("parameters") or {}).get("properties") or {}
    return fn["name"], {k: _example_value(v) for k, v in props.items()}


def tools_prompt(tools: list[dict], fmt: str) -> str:
    """The system prompt that lists `tools` (OpenAI function tools) for a template without a place for them and
    teaches the call format `fmt` (a built-in tool parser's name) with an example call of the first tool."""
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    name, args = example_call(tools[0])
    return TOOLS_PROMPT.format(tools=listing, name=name, example=write_calls(fmt, [(name, args)]),
                               several=SEVERAL.get(fmt, SEVERAL_DEFAULT))


def call_id(parser: ToolParser) -> str:
    """A new tool call id: `call_` and 24 hex digits (SGLang's), or for the mistral format 9 letters and digits, as
    vLLM's mistral parser writes them (Mistral v0.3's template refuses any other id when the results come back)."""
    if parser_format(parser) == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def template_refusal(exc: Exception) -> APIError:
    """The 400 of a conversation the model's chat template refuses (its own `raise_exception` message: Llama 3.1's
    "single tool-calls at once", roles that must alternate, an unsupported system role): the client's messages, not
    a server failure."""
    return APIError(f"messages: the model's chat template refuses this conversation: {exc}", param="messages")


# names the chat template environment of transformers defines (its globals) and message fields that templates assign
# in loops yet jinja2 reports as read: not variables a request sets
TEMPLATE_GLOBALS = frozenset({"raise_exception", "strftime_now", "namespace", "dict", "range", "cycler", "joiner",
                              "lipsum"})
TEMPLATE_LOCALS = frozenset({"content", "reasoning_content", "message", "tool", "tool_call"})


def template_variables(template: Any) -> Optional[frozenset[str]]:
    """The variables a chat template reads: jinja2's `meta.find_undeclared_variables` of the template as
    transformers parses it (its environment: loop controls, the generation tag); several named templates: those of
    any. None where it does not parse here (nothing can be said of what it reads)."""
    from jinja2 import TemplateError, meta

    sources = list(template.values()) if isinstance(template, dict) else [template]
    found: set[str] = set()
    for source in sources:
        if not isinstance(source, str):
            return None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            environment = _compile_jinja_template(source).environment
            found |= meta.find_undeclared_variables(environment.parse(source))
        except (ImportError, TemplateError):
            return None
    return frozenset(found)


class _TemplateKwargs:
    """A tokenizer whose chat template renders with extra variables (a request's chat_template_kwargs), for an
    `ObservationRenderer`: everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, kwargs: dict):
        self._tokenizer, self._kwargs = tokenizer, dict(kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(*args, **{**self._kwargs, **kwargs})


class ChatFormat:
    """Rendering and parsing for one tokenizer (used under a lock: tokenizers are not thread-safe). `tool_parser`
    reads the model's tool calls (`relax.agents.parsers.get_parser` of data.tool_parser; None: the one of the
    tokenizer's chat template, as data.tool_parser=auto)."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], tool_parser: Optional[ToolParser] = None):
        self.tokenizer = tokenizer
        self._text = message_decoder(tokenizer)  # keeps the tool-call markers a tokenizer makes special
        self.tool_parser = tool_parser if tool_parser is not None else get_parser("auto", tokenizer)
        # the format the tools prompt teaches and earlier calls are written in: the parser's (Hermes for one's own)
        self.call_format = parser_format(self.tool_parser) or "hermes"
        # an instance reads calls with its own parser; ChatFormat.tool_calls(text) on the class reads Hermes
        self.tool_calls = functools.partial(ChatFormat.tool_calls, parser=self.tool_parser)
        self.read_calls = functools.partial(ChatFormat.read_calls, parser=self.tool_parser)
        self.eos_token_ids = frozenset(eos_token_ids)
        template = getattr(tokenizer, "chat_template", None) or ""
        self.native_tools = "tools" in template
        self.native_calls = "tool_calls" in template
        self.reasoning = uses_reasoning(template)  # answers may hold a <think> block (split_reasoning)
        self.harmony = uses_harmony(template)  # answers are harmony messages (gpt-oss's channels)
        # the template refuses an assistant message with two calls (Llama 3.x): answers make one call at most
        self.single_call = self.native_calls and template_single_call(tokenizer)
        # the form a grammar of calls writes: the parser's, but Mistral's v11+ form where the template writes calls so
        # (`[TOOL_CALLS]NAME[ARGS]{...}`; the mistral parser reads both forms)
        self.grammar_format = parser_format(self.tool_parser)
        if self.grammar_format == "mistral" and MISTRAL_ARGS in (template_call_text(tokenizer) or ""):
            self.grammar_format = MISTRAL_V11
        # the template reads the reasoning_effort variable (gpt-oss's: "Reasoning: medium" unless given), which SGLang
        # renders a request's reasoning_effort as; a template that never mentions it cannot honour an effort
        # the variables the template reads (None: it does not parse here; then every key is taken, as before)
        self.variables = template_variables(getattr(tokenizer, "chat_template", None))
        self.reads_effort = EFFORT_VARIABLE in (template if self.variables is None else self.variables)
        # likewise a request's verbosity
        self.reads_verbosity = VERBOSITY_VARIABLE in (template if self.variables is None else self.variables)
        self._given = {k for k in getattr(tokenizer, "special_tokens_map", None) or {}}  # what transformers passes
        self._renderers: dict[str, ObservationRenderer] = {}  # by chat_template_kwargs (JSON); none: renderer
        self.renderer = ObservationRenderer(tokenizer)
        self.lock = threading.RLock()

    # ---------------------------------------------------------------------------------------------- rendering
    def _template_messages(self, messages: list[dict], tools: Optional[list[dict]], text_arguments: bool = False,
                           tools_in_user: bool = False) -> list[dict]:
        """The messages as the chat template takes them; `text_arguments`: calls' arguments as JSON text (as OpenAI's
        messages hold them) rather than mappings (transformers' convention); `tools_in_user`: the tools prompt (a
        template without a place for tools) opens the first user message instead of being a system message."""
        out: list[dict] = []
        for m in messages:
            d: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                                 "content": m.get("content") or ""}
            calls = m.get("tool_calls")
            if calls and self.native_calls:
                d["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["name"],
                    "arguments": json.dumps(c["arguments"], ensure_ascii=False) if text_arguments else c["arguments"]}}
                    for c in calls]
            elif calls:  # written as the model writes them: in the tool parser's format
                written = write_calls(self.call_format, [(c["name"], c["arguments"]) for c in calls])
                d["content"] = f"{d['content']}\n{written}" if d["content"] else written
            for key in ("tool_call_id", "name", "reasoning_content"):  # reasoning: templates keep it in tool loops
                if m.get(key) is not None:
                    d[key] = m[key]
            if self.harmony and m.get("reasoning_content") is not None:  # gpt-oss's template reads `thinking`
                d["thinking"] = m["reasoning_content"]
            out.append(d)
        if self._lists_tools(messages, tools):
            prompt = tools_prompt(tools, self.call_format)
            user = next((i for i, d in enumerate(out) if d["role"] == "user"), None)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            elif tools_in_user and user is not None:
                out[user] = {**out[user], "content": f"{prompt}\n\n{out[user]['content']}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def _lists_tools(self, messages: list[dict], tools: Optional[list[dict]]) -> bool:
        """Whether the prompt lists `tools` itself (`tools_prompt`): a template without a place for them, and a
        conversation whose system messages do not describe them already (`_described`)."""
        return bool(tools) and not self.native_tools and not _described(
            messages, tools or [], CALL_STARTS.get(self.call_format, ()))

    def render(self, messages: list[dict], tools: Optional[list[dict]], template_kwargs: Optional[dict] = None) -> str:
        """The text of a whole conversation (normalized messages) and the assistant's generation prompt;
        `template_kwargs` (a request's chat_template_kwargs) are extra variables of the template. A template that
        refuses a system message (Gemma's "System role not supported", Mistral's alternating roles) gets the tools
        prompt at the start of the first user message (as Gemma's own template places a system prompt); a template
        that refuses the conversation (its `raise_exception`) is a 400 naming the template's message."""
        from jinja2 import TemplateError

        def apply(text_arguments: bool, tools_in_user: bool = False) -> str:
            return self.tokenizer.apply_chat_template(
                self._template_messages(messages, tools, text_arguments, tools_in_user),
                tools=tools if self.native_tools else None, tokenize=False, add_generation_prompt=True,
                **(template_kwargs or {}))

        with self.lock:
            try:
                return self._with_arguments(apply, messages)
            except TemplateError as exc:
                refused = exc
            own_system = any(m["role"] in ("system", "developer") for m in messages)
            if self._lists_tools(messages, tools) and not own_system:  # the system message was Relax's own
                try:
                    return self._with_arguments(lambda text_arguments: apply(text_arguments, True), messages)
                except TemplateError:
                    pass
            raise template_refusal(refused) from None

    def _with_arguments(self, render: Any, messages: list[dict]) -> Any:
        """`render(text_arguments)` with calls' arguments as mappings (Qwen3's, Llama's, GLM's templates write them
        with `tojson` or walk their items), or, for a template that joins them to text (DeepSeek-V3's
        `'...' + arguments`, which fails on a mapping), as JSON text."""
        try:
            return render(False)
        except TypeError:
            if not any(m.get("tool_calls") for m in messages) or not self.native_calls:
                raise
            return render(True)

    def prompt(self, messages: list[dict], tools: Optional[list[dict]],
               template_kwargs: Optional[dict] = None) -> list[int]:
        """The prompt tokens of `render`."""
        return self.encode(self.render(messages, tools, template_kwargs))

    def continuation(self, messages: list[dict], stop_token: Optional[int],
                     template_kwargs: Optional[dict] = None, calls: tuple[str, ...] = ()) -> list[int]:
        """The tokens of `messages` appended after a model answer that ended with `stop_token` (None: it did not
        end with one), up to the next generation prompt (`relax.agents.render.ObservationRenderer`), rendered with
        the same `template_kwargs` as the conversation's first prompt (Qwen3's enable_thinking=false writes an
        empty think block after every generation prompt); `calls`: the names of the calls the answer made (gpt-oss's
        template names a tool result after its call)."""
        with self.lock:
            renderer = self.renderer
            if template_kwargs:
                key = json.dumps(template_kwargs, sort_keys=True)
                renderer = self._renderers.get(key) or self._renderers.setdefault(
                    key, ObservationRenderer(_TemplateKwargs(self.tokenizer, template_kwargs)))
            try:
                return self._with_arguments(lambda text_arguments: renderer.tokens(
                    self._template_messages(messages, None, text_arguments), stop_token, calls), messages)
            except ValueError as exc:  # the template refuses them (`ObservationRenderer.after_turn`)
                raise template_refusal(exc) from None

    def check_template_kwargs(self, kwargs: Any) -> None:
        """A 400 naming chat_template_kwargs for a key of a request's own chat_template_kwargs that the chat template
        never reads (a misspelt `enable_thinkng` would change nothing): it names the key and the variables the
        template does read. The template's variables are its undeclared names (`template_variables`), so a key it
        reads only in some branch is taken; keys naming apply_chat_template's own arguments are refused before
        (`relax.serve.openai.protocol.TEMPLATE_RESERVED`). A template that does not parse here is not checked."""
        if not isinstance(kwargs, dict) or not kwargs or self.variables is None:
            return
        unknown = sorted(k for k in kwargs if k not in self.variables or k in TEMPLATE_GLOBALS)
        if not unknown:
            return
        readable = sorted(self.variables - TEMPLATE_RESERVED - TEMPLATE_GLOBALS - TEMPLATE_LOCALS - self._given)
        keys = ", ".join(repr(k) for k in unknown)
        raise APIError(f"chat_template_kwargs: {keys}: this model's chat template does not read "
                       f"{'it' if len(unknown) == 1 else 'them'}, so {'it' if len(unknown) == 1 else 'they'} would "
                       f"change nothing; the variables it reads: "
                       f"{', '.join(readable) if readable else 'none besides the messages and tools'}",
                       param="chat_template_kwargs")

    def effort_variables(self, effort: str, kwargs: dict) -> dict:
        """The chat template's variables for a request's reasoning_effort, under its own chat_template_kwargs (whose
        own reasoning_effort wins, as SGLang takes it from there first): the variable `reasoning_effort` where the
        template reads it, as SGLang passes it to apply_chat_template ("none" too: THINKING_OFF is in `kwargs` then,
        and the service checks that the template closes its <think> block); an effort other than "none" is a 400
        naming reasoning_effort where the template never mentions it, since nothing would render it."""
        if self.reads_effort:
            return {EFFORT_VARIABLE: effort, **kwargs}
        if effort != "none":
            raise APIError(f"reasoning_effort: {effort!r} cannot be honoured: this model's chat template does not "
                           "read reasoning_effort (no effort control here; \"none\" turns thinking off, null leaves "
                           "the model to reason as it does)", param="reasoning_effort")
        return kwargs

    def applied_effort(self, effort: Optional[str], kwargs: Optional[dict]) -> Optional[str]:
        """The reasoning effort a chat request is answered with (the Responses API echoes it, as OpenAI echoes the
        effective value), given its reasoning_effort (None: not asked; already checked, `effort_variables`) and its
        chat_template_kwargs (those reasoning_effort "none" adds included):
        - a template that reads `reasoning_effort` renders the request's (one inside chat_template_kwargs first),
          else its own default: the effort whose render is the template's without one (gpt-oss's "medium"; None
          where no effort renders alike);
        - elsewhere "none" where the model does not reason: reasoning_effort "none" (checked to hold), or a <think>
          template whose generation prompt, rendered with these kwargs, closes the block (Qwen3's `enable_thinking:
          false`);
        - else None: the template has no effort control (a model that reasons does as it does; one without
          reasoning never does, and OpenAI echoes null for such models too).
        Read from a one-message render, as `relax.serve.openai.service.OpenAIService._check_thinking_off` reads
        the switch (a template that refuses that probe: None, nothing read)."""
        kwargs = dict(kwargs or {})
        probe = [{"role": "user", "content": "hi"}]
        if self.reads_effort:
            given = kwargs.get(EFFORT_VARIABLE, effort)
            if given is not None:
                return given
            try:
                unset = self.prompt(probe, None, kwargs or None)
                return next((e for e in EFFORTS if self.prompt(probe, None, {**kwargs, EFFORT_VARIABLE: e}) == unset),
                            None)
            except APIError:
                return None
        if effort is not None:
            return effort  # "none" (any other is a 400 here): the service checked that the template closes the block
        try:
            if self.reasoning and kwargs and self.closes_reasoning(self.prompt(probe, None, kwargs)):
                return "none"
        except APIError:
            pass
        return None

    def verbosity_variables(self, verbosity: str, kwargs: dict) -> dict:
        """The chat template's variables for a request's verbosity (OpenAI's answer length hint), under its own
        chat_template_kwargs (whose own verbosity wins): the variable `verbosity` where the template reads it, as
        reasoning_effort (`effort_variables`); elsewhere "medium", OpenAI's default, changes nothing (the answer is the
        model's own length) and "low" or "high" is a 400 naming verbosity, since nothing would render it."""
        if self.reads_verbosity:
            return {VERBOSITY_VARIABLE: verbosity, **kwargs}
        if verbosity != "medium":
            raise APIError(f"verbosity: {verbosity!r} cannot be honoured: this model's chat template does not read "
                           "verbosity (no answer length control here; \"medium\", the default, and null are "
                           "accepted)", param="verbosity")
        return kwargs

    def opening(self, prompt: list[int]) -> str:
        """The <think> block prompt tokens end inside, opened by their generation prompt (Qwen3.5's `<think>\n`), as
        text; "" when they do not (`relax.agents.parsers.opened_reasoning`)."""
        if not self.reasoning or not prompt:
            return ""
        with self.lock:
            return opened_reasoning(self._text(prompt[-16:]))

    def opens_reasoning(self, prompt: list[int]) -> bool:
        """Whether prompt tokens end inside a <think> block (`opening`): the answer's text up to its `</think>` is
        then reasoning (`split_reasoning(text, opened=True)`)."""
        return bool(self.opening(prompt))

    def closes_reasoning(self, prompt: list[int]) -> bool:
        """Whether prompt tokens end with a <think> block their generation prompt closed (Qwen3's `enable_thinking:
        false` writes `<think>\n\n</think>\n\n`): the answer then holds no reasoning."""
        if not self.reasoning or not prompt:
            return False
        with self.lock:
            return self._text(prompt[-16:]).rstrip().endswith(END_THINK)

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        with self.lock:
            return self._text(tokens)

    def covering(self, tokens: list[int], prefix: str) -> int:
        """How many of `tokens`, from the first, it takes for their text (`decode`) to hold `prefix`: the fewest
        whose text starts with it (len(tokens) when none does). Read from the token ids, by bisection."""
        if not prefix or not tokens:
            return 0
        lo, hi = 1, len(tokens)
        with self.lock:
            while lo < hi:
                mid = (lo + hi) // 2
                if self._text(tokens[:mid]).startswith(prefix):
                    hi = mid
                else:
                    lo = mid + 1
        return lo

    def pieces(self, tokens: list[int]) -> list[str]:
        """Each token's own text (special tokens written out): the `token` of its log-prob."""
        with self.lock:
            return [self.tokenizer.decode([t]) for t in tokens]

    # ---------------------------------------------------------------------------------------------- answers
    def answer_text(self, tokens: list[int], stop: list[str],
                    trim: bool = True) -> tuple[list[int], str, Optional[int], bool]:
        """(tokens kept, text, the stop token that ended them or None, whether a stop sequence ended them): the
        text leaves out the stop token and stops before the first stop sequence (with `trim`; else it is the text
        of the tokens kept: SGLang's no_stop_trim); the tokens stop after the token that completed it (what the
        model sampled up to there: the engine stops there too, given the stop sequences). An answer the token limit
        cut (no stop token, no stop sequence) may end inside a multi-byte character, which decodes as U+FFFD: its
        text leaves those trailing U+FFFD out, as the streamed deltas hold them back (`TextDeltas`, as vLLM's
        incremental detokenizer does), so a cut answer's content is the same streamed or not and never ends in half
        a character; its tokens stay all the sampled ones."""
        end = tokens[-1] if tokens and tokens[-1] in self.eos_token_ids else None
        body = tokens[:-1] if end is not None else tokens
        text = self.decode(body)
        hits = [(text.find(s), s) for s in stop if s in text]
        if not hits:
            return tokens, text if end is not None else text.rstrip("\ufffd"), end, False
        at, s = min(hits)
        for k in range(1, len(body) + 1):  # the first token after which the stop sequence is in the text
            if len(self.decode(body[:k])) >= at + len(s) and s in self.decode(body[:k]):
                return body[:k], text[:at] if trim else self.decode(body[:k]), None, True
        return body, text[:at] if trim else text, None, True

    @staticmethod
    def tool_calls(text: str, parser: ToolParser = parse_hermes, tools: Optional[list[dict]] = None,
                   cut: bool = False, limited: bool = False,
                   reasoning_in_content: bool = False) -> tuple[str, Optional[list[dict]]]:
        """(content, OpenAI tool calls) of a model message: `read_calls` without its third value."""
        content, calls, _ = ChatFormat.read_calls(text, parser, tools, cut=cut, limited=limited,
                                                  reasoning_in_content=reasoning_in_content)
        return content, calls

    @staticmethod
    def read_calls(text: str, parser: ToolParser = parse_hermes, tools: Optional[list[dict]] = None,
                   cut: bool = False, limited: bool = False,
                   reasoning_in_content: bool = False) -> tuple[str, Optional[list[dict]], bool]:
        """(content, OpenAI tool calls) of a model message, read by `parser` with the schemas of the `tools` offered
        (`apply_tool_schemas`: string arguments of the XML formats as text, a strict tool's arguments checked): the
        calls taken out of the content when every call is well-formed; a message with a malformed call stays text,
        never half-parsed. Calls of functions that are not in `tools` are dropped, as SGLang's parsers drop them
        (the content is the text outside the calls; no calls left: none).

        `limited`: the token limit cut the message. Its text may end inside a call's opening marker (`<tool_ca`, a
        piece of DeepSeek's markers: a marker of several tokens): that trailing piece of a marker (`CALL_STARTS`)
        is left out, as the stream holds it back (`TextDeltas`), so it is neither content nor the start of an
        unfinished call; the text before it is the content as usual. `cut` (implies `limited`): a forced answer
        (tool_choice required, named or allowed_tools required) that the token limit cut, whose grammar allows
        calls only: its complete calls before the unfinished one are kept, with no content. Any other message the
        limit cut inside a call (a malformed call in a `limited` message of a built-in format: under a grammar of
        calls, strict tools, parallel_tool_calls false or tools with a format, only the cut call can be malformed)
        is read as SGLang's detectors read it: the text before its first call's marker is the content, and its
        well-formed calls are kept (harmony: its messages' text, no call written out). `reasoning_in_content` (the
        harmony parser, separate_reasoning false): the analysis channel's text is content too.

        The third value: whether the limit cut the message inside a call whose complete calls were kept this way
        (`cut`, or a `limited` message read as SGLang reads it): its finish reason stays "length"."""
        fmt = parser_format(parser) or ""
        if cut or limited:
            text = text[:held_prefix_tail(text, CALL_STARTS.get(fmt, ()))]
        parsed = apply_tool_schemas(parser(text), tools)
        rescued = False
        if cut:
            complete = tuple(itertools.takewhile(lambda item: isinstance(item, ToolCall), parsed.items))
            if not complete:  # cut inside its first call: none of it is content (the grammar allowed calls only)
                return "", None, False
            parsed, rescued = ParsedMessage(complete, ""), True
        elif limited and parsed.errors and fmt in CALL_STARTS:
            # the call the limit cut is no content: SGLang's `normal_text = text[:idx]` and its complete calls
            found = [at for at in (text.find(m) for m in CALL_STARTS[fmt]) if at >= 0]
            before = text[:min(found)] if found else ""  # (Llama's call without its tag: the whole message)
            calls = tuple(item for item in parsed.items if isinstance(item, ToolCall))
            if not calls:
                return before.strip(), None, False
            parsed, rescued = ParsedMessage(calls, before.strip()), True
        elif limited and parsed.errors and fmt == "harmony":  # its messages' text, no call written out
            content = harmony_content(text, reasoning_in_content=reasoning_in_content, calls_as_written=False)
            calls = tuple(item for item in parsed.items if isinstance(item, ToolCall))
            if not calls:
                return content, None, False
            parsed, rescued = ParsedMessage(calls, content), True
        harmony = fmt == "harmony"
        if not parsed.calls or parsed.errors:  # (harmony: the message's text for the user, its calls as written)
            return (harmony_content(text, reasoning_in_content=reasoning_in_content) if harmony else text), None, False
        if harmony and reasoning_in_content:
            parsed = ParsedMessage(parsed.items, harmony_content(text, reasoning_in_content=True,
                                                                 calls_as_written=False))
        offered = None if tools is None else {t["function"]["name"] for t in tools}
        kept = [c for c in parsed.calls if offered is None or c.name in offered]
        return parsed.content, [{"id": call_id(parser), "type": "function",
                                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                                for c in kept] or None, rescued
