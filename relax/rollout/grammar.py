"""Constrained decoding: grammars compiled against the tokenizer's vocabulary into per-row matchers that give the
allowed tokens at each decoding step (the embedded engine masks the others, `relax.rollout.embedded`).

A `GrammarSpec` names what an answer must be: a JSON schema, any JSON object (`json_object`), a regex or an EBNF
grammar (xgrammar's dialect, SGLang's `ebnf`); `tool_call_ebnf` writes the EBNF of one or more tool calls in a tool
parser's format (`relax.agents.parsers`), the arguments following each tool's parameter schema, and
`tool_calls_or` the EBNF of an answer that is either such calls or what another spec admits (tools with a response
format and tool_choice auto), `at_most_one_call` and `strict_calls` free text in which every call is constrained
(tool_choice auto with parallel_tool_calls false; with a `strict` tool), and `after_reasoning` any spec after a
reasoning model's `<think>` block. `Grammars` (one per tokenizer: the vocabulary is read once) compiles specs, each
distinct spec once (`compiles` counts them), and makes a `Matcher` per row: `fill` writes the row's allowed tokens
into a bitmask, `accept` advances it with the token drawn, `done` says the answer is complete (a stop token accepted,
or, without stop tokens, nothing can follow).
JSON is written as `json.dumps` writes it (", " and ": " between items, no other whitespace): free whitespace, which
JSON allows anywhere, is where small and untrained models loop until their token limit.

The backend is xgrammar (SGLang's default grammar backend; CPU wheels on PyPI), imported when a grammar is first
compiled, so that runs without grammars do not need it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from relax.agents.parsers import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    END_THINK,
    H_CALL,
    H_CHANNEL,
    H_CONSTRAIN,
    H_END,
    H_MESSAGE,
    H_START,
    HARMONY_TOKENS,
    MISTRAL_CALLS,
    PYTHON_TAG,
    THINK,
    resolved_schema,
    xml_plain,
)

NL = "\n"
KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept (a request's schema is usually one of a few an application sends)
# tool parsers (relax.agents.parsers) whose calls tool_call_ebnf can write: every built-in one (the text formats, and
# HARMONY, whose calls are messages rather than text: tests/openai/test_harmony_serve.py covers it)
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "qwen3_coder", "glm45", "deepseek_v3", "mistral")
# Mistral's tokenizer v11+ form (Mistral-Small-3.1/3.2, Magistral, Devstral): `[TOOL_CALLS]NAME[ARGS]{...}`, each call
# with its own marker; the `mistral` parser reads it too, so it is a grammar form of that parser, chosen where the
# model's template writes calls so (`relax.data.tokenizer.template_call_text`)
MISTRAL_V11 = "mistral_v11"
MISTRAL_ARGS = "[ARGS]"
HARMONY = "harmony"
# harmony (gpt-oss): a call is a commentary message to `functions.NAME`, its JSON arguments closed by `<|call|>` (a
# stop token of gpt-oss, which ends the row where it is one)
H_OPENER = f"{H_CHANNEL}commentary to=functions."


class GrammarError(ValueError):
    """A grammar that cannot be compiled (a malformed schema, regex or EBNF), or a tool-call format not covered."""


class ToolSchemaError(GrammarError):
    """The parameters of tool `tool` cannot constrain its calls (xgrammar does not compile the schema, or an XML
    format's call needs an object schema); the message names the tool and says why."""

    def __init__(self, message: str, tool: str):
        super().__init__(message)
        self.tool = tool


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's error message without its time stamp and source location ("[01:05:44] /project/cpp/x.cc:94: ")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", lines[0]) if lines else type(exc).__name__


def _xgrammar_detail(exc: Exception) -> str:
    """The last line of xgrammar's error message, without its time stamp and C++ source location (a user reads it)."""
    text = str(exc).strip()
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text.splitlines()[-1]) if text else type(exc).__name__


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must be: `kind` one of KINDS, `source` the schema (JSON text), regex or EBNF (json_object:
    empty). Equal specs share one compiled grammar."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r}: expected one of {', '.join(KINDS)}")


def json_schema_spec(schema: Any) -> GrammarSpec:
    """The spec of a JSON schema (a dict, or its JSON text), written out again (property order kept: it is the order
    of generation): the same schema, one compile."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    return GrammarSpec("json_schema", json.dumps(schema))


# ------------------------------------------------------------------------------------------------ tool calls
def _literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)


_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.DOTALL)


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are JSON data, not schemas


def _moved_refs(schema: Any, to: str) -> Any:
    """`schema` with every local `$ref` ("#", "#/$defs/X", "#/properties/p", ...) pointing to the same place after the
    schema is moved to the JSON pointer `to` of a larger one: a tool's `parameters` with `$defs` (a pydantic model's
    nested models, openai-agents' strict tools) keep resolving once nested in a call's object; refs to other documents
    are left as they are."""
    if isinstance(schema, dict):
        return {k: (to + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _moved_refs(v, to)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_moved_refs(v, to) for v in schema]
    return schema


def _call_schema(name: str, parameters: Any, arguments_key: str) -> dict:
    # the parameters' refs point into their new place (vLLM hoists the $defs to the root instead; every tool's
    # call is compiled as a schema of its own here, so no two tools' definitions can clash either way)
    return {"type": "object", "properties": {"name": {"const": name},
                                             arguments_key: _moved_refs(parameters, f"#/properties/{arguments_key}")},
            "required": ["name", arguments_key], "additionalProperties": False}


def _json_rules(schema: Any, rule: str, what: str, *, strict: bool = True) -> str:
    """The EBNF of JSON values following `schema`, its root rule renamed `rule` and its other rules prefixed with it
    (the grammars of several values live in one EBNF). `strict` false: an object schema that does not say otherwise
    admits properties it does not list (free JSON: `{"type": "object"}`)."""
    import xgrammar as xgr

    try:
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict))
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError for schemas it cannot read
        raise GrammarError(f"{what}: {_xgrammar_message(exc)}") from None
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*::=", ebnf, flags=re.MULTILINE))
    renamed = {n: rule if n == "root" else f"{rule}_{n}" for n in names}
    return "".join(renamed.get(tok, tok) for tok in _EBNF_TOKEN.findall(ebnf))


# text of an XML-format argument that is a string: anything up to the closing tag (no "<", so the tag cannot start
# inside it), as the template writes a string argument: its text, not JSON
_XML_TEXT = '[^<]*'
# where an XML-format argument's schema, compiled alone, finds the tool's whole parameters (its refs point there)
_XML_PARAMETERS = "#/$defs/relax_parameters"


def _xml_arguments(f: dict, rule: str, key: tuple[str, str], value: tuple[str, str]) -> tuple[str, list[str]]:
    """(the sequence of `f`'s arguments in an XML format, the rules it uses): its required parameters, then each
    optional one or not, in the schema's order, each `key[0] NAME key[1] value[0] VALUE value[1]`; a string value
    is text (`_XML_TEXT`; one of its enum's words, a `$ref`'d enum's too), any other JSON following the parameter's
    schema (what the formats' templates write; a string whose schema constrains its text, a pattern, a length limit, a
    format, is written as JSON, which the parser reads back to the string: `relax.agents.parsers.xml_plain`, one rule
    for both)."""
    parameters = f.get("parameters") or {"type": "object", "properties": {}}
    props, required = parameters.get("properties") or {}, set(parameters.get("required") or ())
    if parameters.get("type", "object") != "object" or not isinstance(props, dict):
        raise GrammarError(f"the parameters of tool {f['name']!r}: an XML tool-call format needs an object schema "
                           "with properties")
    parts, rules = [], []
    moved = _moved_refs(parameters, _XML_PARAMETERS)
    for i, (name, schema) in enumerate(props.items()):
        v = f"{rule}_p{i}"
        # what the argument is once its refs are followed (a pydantic model's enum is a "$ref" to its $defs): how it
        # is written depends on that, as how the parser reads it back does (the same rules: relax.agents.parsers)
        target = resolved_schema(schema, parameters)
        plain = xml_plain(target)
        words = target.get("enum") if plain else None
        if plain and words is not None and words and all(isinstance(w, str) and "<" not in w for w in words):
            rules.append(f"{v} ::= " + " | ".join(_literal(w) for w in words))  # as the template writes them
        elif plain and words is None and target.get("type") == "string":
            rules.append(f"{v} ::= {_XML_TEXT}")
        else:  # compiled alone, with the whole parameters beside it: its refs ("#/$defs/X") resolve in them
            rules.append(_json_rules({**_moved_refs(schema, _XML_PARAMETERS),
                                      "$defs": {_XML_PARAMETERS.rsplit("/", 1)[1]: moved}},
                                     v, f"the parameter {name!r} of tool {f['name']!r}"))
        one = f"{_literal(key[0] + name + key[1] + value[0])} {v} {_literal(value[1])}"
        parts.append(one if name in required else f"({one})?")
    return " ".join(parts) or '""', rules


def _class_without(*chars: str) -> str:
    """The EBNF character class of any character but `chars`."""
    return "[^" + "".join("\\" + c if c in "]\\^-" else json.dumps(c)[1:-1] for c in chars) + "]"


def _piece_without(word: str, banned: str = "") -> str:
    """An EBNF expression of what may follow `word`'s first character, up to the next one, where `word` may not
    occur: a proper prefix of the rest of `word`, then nothing or a character that breaks it, then anything but
    that first character. `word`'s first character occurs nowhere else in it (a closing tag, `<|python_tag|>`), so
    a text without `word` is pieces each opened by that character (`_text_without`). The characters of `banned`
    occur nowhere (none of them in `word`)."""
    first, rest = word[0], word[1:]
    if not rest or first in rest:
        raise ValueError(f"{word!r}: its first character must not occur again in it")
    free = f"{_class_without(first, *banned)}*"
    piece = f'("" | {_class_without(first, rest[-1], *banned)} {free})'  # (the whole rest: `word`, not allowed)
    for ch in reversed(rest[:-1]):
        piece = f'("" | {_class_without(first, ch, *banned)} {free} | {_literal(ch)} {piece})'
    return piece


def _text_without(word: str, banned: str = "") -> str:
    """An EBNF expression of any text in which `word` does not occur (`_piece_without`), nor any character of
    `banned`."""
    return f"({_class_without(word[0], *banned)}* ({_literal(word[0])} {_piece_without(word, banned)})*)"


# a harmony message's text (a body, an answer without markers): no `<|` at all, so that no marker is spelled in it in
# ordinary tokens (which the parser would read as the marker) nor written as its special token: every marker of an
# answer is one the grammar places, as its token (`Grammars`); a header's text (before `<|message|>`) holds no `<`
# and no `to=` either (the parser reads `to=X` anywhere in a header as a recipient: a call)
_H_TEXT = _text_without("<|")
_H_HEAD = _text_without("to=", "<")
# an optional analysis message before what follows (gpt-oss reasons first): `<|channel|>analysis<|message|>`, its
# text, `<|end|><|start|>assistant`
_H_ANALYSIS = (f"({_literal(H_CHANNEL + 'analysis' + H_MESSAGE)} {_H_TEXT} "
               f"{_literal(H_END + H_START + 'assistant')})?")


def _call_rules(tools: list[dict], fmt: str, name: Optional[str],
                free: frozenset[str] = frozenset()) -> tuple[str, str, str, str]:
    """(the EBNF rules of one call of `tools` in tool parser `fmt`'s format, its root rule `relax_calls`; what opens a
    call's text; the rest of one call after it, as an EBNF expression; the separator between calls, as a literal).
    The opener is "" where a call has no marker of its own (llama3_json: the call is a JSON object). The tools named
    in `free` (not strict, tool_choice auto) take any arguments: any JSON object in the JSON formats, any text up to
    the call's closing tag in the XML ones (what the parser then reads of it, as without a grammar); the others'
    arguments follow their `parameters` (a schema xgrammar cannot compile: `ToolSchemaError` naming the tool)."""
    if fmt not in (*TOOL_CALL_FORMATS, HARMONY, MISTRAL_V11):
        raise GrammarError(f"constraining tool calls in the {fmt!r} tool-call format is not supported (covered: "
                           f"{', '.join((*TOOL_CALL_FORMATS, HARMONY, MISTRAL_V11))})")
    functions = [t["function"] for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise GrammarError(f"no tool named {name!r}")
    calls, rules = [], []
    for i, f in enumerate(functions):
        try:
            call, used = _one_call(f, fmt, f"relax_call{i}", f["name"] in free)
        except GrammarError as exc:
            raise ToolSchemaError(str(exc), f["name"]) from None
        calls.append(call)
        rules += used
    root = "relax_calls"
    body = "\n".join([f"{root} ::= " + " | ".join(f"({c})" for c in calls)] + rules)
    if fmt in ("hermes", "qwen3_coder"):
        return body, "<tool_call>", f"{_literal(NL)} {root} {_literal(NL + '</tool_call>')}", _literal("\n")
    if fmt == "glm45":
        return body, "<tool_call>", f"{root} {_literal('</tool_call>')}", _literal("\n")
    if fmt == "deepseek_v3":  # one call: the calls' section around it
        return body, DS_CALLS_BEGIN, f"{root} {_literal(DS_CALLS_END)}", _literal("\n")
    if fmt == "mistral":  # one call: a list of it
        return body, MISTRAL_CALLS, f"{_literal(' [')} {root} {_literal(']')}", _literal(", ")
    if fmt == MISTRAL_V11:  # each call after its own marker, the next one right after it
        return body, MISTRAL_CALLS, root, '""'
    if fmt == "harmony":  # one call per message, the next one after the next message's start
        return body, H_OPENER, f"{root} {_literal(H_CALL)}", _literal(H_START + "assistant")
    return body, "", root, _literal("; ")


FREE_OBJECT = {"type": "object"}  # a free tool's arguments in the JSON formats (compiled without strict mode)


def _one_call(f: dict, fmt: str, rule: str, free: bool) -> tuple[str, list[str]]:
    """(one call of function `f` in `fmt`'s format as an EBNF expression, the rules it uses, named from `rule`)."""
    if fmt in ("hermes", "llama3_json", "deepseek_v3", "mistral", "harmony", MISTRAL_V11):
        parameters = FREE_OBJECT if free else f.get("parameters") or {"type": "object", "properties": {}}
        what = f"the parameters of tool {f['name']!r}"
        if fmt == MISTRAL_V11:
            return (f"{_literal(f['name'] + MISTRAL_ARGS)} {rule}_args",
                    [_json_rules(parameters, f"{rule}_args", what, strict=not free)])
        if fmt == "harmony":
            return (f"{_literal(f['name'] + ' ' + H_CONSTRAIN + 'json' + H_MESSAGE)} {rule}_args",
                    [_json_rules(parameters, f"{rule}_args", what, strict=not free)])
        if fmt == "deepseek_v3":
            head = f"{DS_CALL_BEGIN}function{DS_SEP}{f['name']}\n```json\n"
            return (f"{_literal(head)} {rule}_args {_literal(NL + '```' + DS_CALL_END)}",
                    [_json_rules(parameters, f"{rule}_args", what, strict=not free)])
        key = "parameters" if fmt == "llama3_json" else "arguments"
        return rule, [_json_rules(_call_schema(f["name"], parameters, key), rule, what, strict=not free)]
    if fmt == "qwen3_coder":
        head = _literal("<function=" + f["name"] + ">" + NL)
        if free:
            return f"{head} {_text_without('</function>')} {_literal('</function>')}", []
        args, used = _xml_arguments(f, rule, ("<parameter=", ">\n"), ("", "\n</parameter>\n"))
        return f"{head} {args} {_literal('</function>')}", used
    head = _literal(f["name"] + NL)  # glm45
    if free:
        return f"{head} {_text_without('</tool_call>')}", []
    args, used = _xml_arguments(f, rule, ("<arg_key>", "</arg_key>\n"), ("<arg_value>", "</arg_value>\n"))
    return f"{head} {args}", used


def tool_call_ebnf(tools: list[dict], fmt: str, *, name: Optional[str] = None, parallel: bool = True) -> str:
    """The EBNF (root rule `root`) of an answer that is tool calls only, in the format of tool parser `fmt` (one of
    TOOL_CALL_FORMATS), each call one of `tools` (OpenAI function tools) with arguments following its `parameters`
    schema: one or more calls (`parallel`, OpenAI's parallel_tool_calls), else exactly one, of the tool `name` when
    given (always exactly one call: a named function is called once).

    hermes: `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, calls separated by a newline (Qwen's
    and Hermes' templates); llama3_json: `{"name": N, "parameters": {...}}`, calls separated by "; ";
    deepseek_v3: the calls' section markers around `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}
    \\n```<｜tool▁call▁end｜>`, separated by a newline; mistral: `[TOOL_CALLS] [{"name": N, "arguments": {...}}]`,
    the calls in that one list separated by ", " (tokenizer v3's form, which SGLang's grammar writes); mistral_v11:
    `[TOOL_CALLS]N[ARGS]{...}` per call, one right after the other (tokenizer v11+'s form); qwen3_coder
    and glm45 (XML): each argument in the template's tags, a string as its text (no "<" in it), any other value as
    JSON of its schema; the required arguments always, the optional ones each or not, in the schema's order."""
    body, opener, rest, sep = _call_rules(tools, fmt, name)
    if fmt in ("deepseek_v3", "mistral"):  # the section markers (Mistral's: the marker and a list) around every call
        one = "relax_calls"
        more = "" if name is not None or not parallel else f" ({sep} {one})*"
        begin, end = (DS_CALLS_BEGIN, DS_CALLS_END) if fmt == "deepseek_v3" else (MISTRAL_CALLS + " [", "]")
        return "\n".join([f"root ::= {_literal(begin)} {one}{more} {_literal(end)}", body])
    one = f"{_literal(opener)} {rest}" if opener else rest
    more = "" if name is not None or not parallel else f" ({sep} {one})*"
    return "\n".join([f"root ::= {one}{more}", body])


def at_most_one_call(tools: list[dict], fmt: str) -> GrammarSpec:
    """tool_choice "auto" with parallel_tool_calls false: the answer is free text, or text and then one call of
    `tools` in tool parser `fmt`'s format (its arguments following the tool's schema, strict or not), after which it
    ends (the row's stop token next): `calls_in_text` with at most one call."""
    return calls_in_text(tools, fmt, frozenset(), parallel=False)


def strict_calls(tools: list[dict], fmt: str) -> Optional[GrammarSpec]:
    """tool_choice "auto" (parallel calls allowed) with at least one `strict` tool among `tools` (None: none is
    strict, the answer is free): the text is free, and every call it opens is a call of one of `tools` whose
    arguments, for a strict tool, follow its `parameters` schema (OpenAI's strict function calling; SGLang's
    structural tag for strict tools), for another are any JSON object (XML formats: any text up to the call's
    closing tag, read by the parser as without a grammar); several calls as the format writes them. A strict tool
    whose schema xgrammar cannot compile: `ToolSchemaError` naming it. `calls_in_text`."""
    free = frozenset(t["function"]["name"] for t in tools if t["function"].get("strict") is not True)
    if len(free) == len(tools):
        return None
    return calls_in_text(tools, fmt, free, parallel=True)


def calls_in_text(tools: list[dict], fmt: str, free: frozenset[str], *, parallel: bool) -> GrammarSpec:
    """Free text in which every call of tool parser `fmt` is constrained (`_call_rules`: a call of one of `tools`,
    the arguments of those not in `free` following their schema); one call at most, then the answer ends, without
    `parallel`. Where calls have a marker (every format but llama3_json), an xgrammar structural tag (SGLang's
    `structural_tag`): the text is free until the marker, which opens one call (DeepSeek: the calls' section, one
    or more calls and its end marker; Mistral: the marker and a list of calls), and after it the text is free again
    (without `parallel`: nothing follows). DeepSeek's parser also reads a call outside a section: the free text may
    not write a call's own begin marker. llama3_json has no marker: its parser reads calls from a message that
    starts with one, or after `<|python_tag|>` (a special token, which a grammar never lets be drawn, and which the
    free text may not spell either): the answer is calls, or text that does not start with "{" or "[" and holds no
    `<|python_tag|>`."""
    body, opener, rest, sep = _call_rules(tools, fmt, None, free)
    if fmt == HARMONY:
        return _harmony_in_text(body, parallel)
    if not opener:
        calls = f"relax_calls ({sep} relax_calls)*" if parallel else "relax_calls"
        return GrammarSpec("ebnf", "\n".join([
            f"root ::= {calls} | relax_text",
            r'relax_text ::= [ \t\r\n]* ([^{\[ \t\r\n<] [^<]* ("<" relax_piece)* | ("<" relax_piece)+)?',
            f"relax_piece ::= {_piece_without(PYTHON_TAG)}", body]))
    if parallel and fmt == "deepseek_v3":  # one section, its calls separated as in a forced answer
        rest = f"relax_calls ({sep} relax_calls)* {_literal(DS_CALLS_END)}"
    elif parallel and fmt == "mistral":  # one list of calls
        rest = f"{_literal(' [')} relax_calls ({sep} relax_calls)* {_literal(']')}"
    tag = {"type": "tag", "begin": opener, "end": "",
           "content": {"type": "grammar", "grammar": "\n".join([f"root ::= {rest}", body])}}
    triggered: dict = {"type": "triggered_tags", "triggers": [opener], "tags": [tag],
                       "stop_after_first": not parallel}
    if fmt == "deepseek_v3":
        triggered["excludes"] = [DS_CALL_BEGIN]
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": triggered},
                                                    ensure_ascii=False))


def _harmony_in_text(body: str, parallel: bool) -> GrammarSpec:
    """`calls_in_text` for harmony (gpt-oss), whose answer is messages rather than text around calls: an EBNF of
    messages `<|channel|>HEADER<|message|>TEXT`, separated by `<|end|><|start|>assistant`, of which a call
    (`<|channel|>commentary to=functions.` and one of `body`'s `relax_calls`, then `<|call|>`) is one, after which
    the answer ends (without `parallel`) or goes on after `<|start|>assistant`; or text without markers. A message's
    header may not name a recipient otherwise (`_H_HEAD`), and no text holds `<|` (`_H_TEXT`), so every marker is
    one the grammar places: compiled for a harmony vocabulary each is its special token (`Grammars`), so a call is
    recognised by its tokens, never by text that spells them (xgrammar's triggered tags trigger on text only). The
    final message ends at the row's stop token (`<|return|>`), a call at its `<|call|>`."""
    call = f"{_literal(H_OPENER)} relax_calls {_literal(H_CALL)}"
    after_call = f" ({_literal(H_START + 'assistant')} relax_msgs)?" if parallel else ""
    return GrammarSpec("ebnf", "\n".join([
        "root ::= relax_msgs | relax_plain",
        f"relax_msgs ::= relax_msg ({_literal(H_END + H_START + 'assistant')} relax_msgs)? | relax_call{after_call}",
        f"relax_msg ::= {_literal(H_CHANNEL)} relax_head {_literal(H_MESSAGE)} relax_plain",
        f"relax_head ::= {_H_HEAD} ({_literal(H_CONSTRAIN)} {_H_HEAD})?",
        f"relax_call ::= {call}",
        f"relax_plain ::= {_H_TEXT}",
        body]))


def _xgrammar_of(spec: GrammarSpec) -> Any:
    """`spec` as an xgrammar Grammar, compiled as `Grammars.compile` compiles it (JSON as json.dumps writes it)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.source)
    except Exception as exc:  # xgrammar's parse errors are RuntimeError/ValueError with its message
        detail = _xgrammar_detail(exc)
        raise GrammarError(f"the {spec.kind} does not compile: {detail}") from None
    raise GrammarError(f"a {spec.kind} cannot be combined with tool calls")


def tool_calls_or(tools: list[dict], fmt: str, other: GrammarSpec, *, parallel: bool = True) -> GrammarSpec:
    """tool_choice "auto" with a response format (OpenAI's semantics: the answer is either tool calls or the
    format's content): the EBNF (an `ebnf` spec, xgrammar's dialect, root rule `root`) of an answer that is tool
    calls of `tools` in tool parser `fmt`'s format, as `tool_call_ebnf` writes them (one or more, or exactly one
    without `parallel`), or else what `other` admits (a json_schema, json_object, regex or ebnf spec), nothing
    else: no text before a call, no text around the JSON. Harmony (gpt-oss, which reasons first): the calls after
    an optional analysis message, as `harmony_final` lets `other` follow one (`other` is then harmony_final's)."""
    import xgrammar as xgr

    calls = xgr.Grammar.from_ebnf(tool_call_ebnf(tools, fmt, parallel=parallel))
    if fmt == HARMONY:
        calls = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f'root ::= {_H_ANALYSIS} ""'), calls)
    return GrammarSpec("ebnf", str(xgr.Grammar.union(calls, _xgrammar_of(other))))


def after_reasoning(spec: GrammarSpec, *, opened: bool) -> GrammarSpec:
    """`spec` after the answer's reasoning block, for a model whose chat template reasons (`<think>` blocks): a
    structural tag (SGLang's `structural_tag`, so a real SGLang server constrains it the same way) of free reasoning up
    to `</think>`, at most two blanks, then what `spec` admits. `opened`: the prompt opened the block (Qwen3.5's
    generation prompt writes `<think>\n`), so the answer must reason first; otherwise (Qwen3, whose model writes
    `<think>` itself; GLM-4.5, a newline before it) the block, after at most two blanks, is optional and an answer
    without one is constrained from its first token. The reasoning may not open a second block; `</think>` ends it."""
    if spec.kind == "structural_tag":
        answer = json.loads(spec.source)["format"]
    else:
        answer = {"type": "grammar", "grammar": str(_xgrammar_of(spec))}
    return GrammarSpec("structural_tag", json.dumps(
        {"type": "structural_tag", "format": {"type": "sequence", "elements": [_reasoning_block(opened), answer]}},
        ensure_ascii=False))


def _reasoning_block(opened: bool) -> dict:
    """The reasoning block `after_reasoning` puts before the answer (a structural tag's element)."""
    blanks = {"type": "regex", "pattern": "[ \\n]{0,2}"}
    block: dict = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "" if opened else THINK,
         "content": {"type": "any_text", "excludes": [THINK, END_THINK]}, "end": END_THINK}, blanks]}
    if not opened:  # (GLM-4.5's model writes a newline before its <think>)
        block = {"type": "optional", "content": {"type": "sequence", "elements": [blanks, block]}}
    return block


def reasoning_opened(spec: GrammarSpec) -> Optional[bool]:
    """For a spec `after_reasoning` wrote: its `opened`; None for any other spec."""
    if spec.kind != "structural_tag":
        return None
    try:
        first = json.loads(spec.source)["format"]["elements"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    for opened in (True, False):
        if first == _reasoning_block(opened):
            return opened
    return None


def reasoning_span(pieces: list[bytes], opened: bool) -> int:
    """How many of an answer's leading tokens (`pieces`: the bytes each writes) are its reasoning block under a spec
    `after_reasoning` wrote: up to and including the `</think>` that closes it and the (at most two) blanks the grammar
    allows after it; every token of an answer still reasoning at its end (unclosed); 0 where the answer opens no block
    (`opened` False and no `<think>` after at most two blanks). A token that reaches past the blanks into the answer
    is the answer's."""
    text = b"".join(pieces)
    start = 0
    if not opened:
        head = re.match(rb"[ \n]{0,2}" + re.escape(THINK.encode()), text)
        if head is None:
            return 0
        start = head.end()
    close = text.find(END_THINK.encode(), start)
    if close < 0:
        return len(pieces)
    end = close + len(END_THINK)
    end += len(re.match(rb"[ \n]{0,2}", text[end:]).group())
    at, n = 0, 0
    for piece in pieces:
        at += len(piece)
        if at > end:
            break
        n += 1
    return n


def harmony_final(spec: GrammarSpec) -> GrammarSpec:
    """`spec` (a json_schema, json_object, regex or ebnf spec: a response format) as gpt-oss (harmony) answers it: an
    optional analysis message (its reasoning: any text without `<|`, `_H_TEXT`, then `<|end|><|start|>assistant`),
    then the final channel's header `<|channel|>final<|message|>` and what `spec` admits, which the harmony parser
    reads as the answer's content; the row's stop token (`<|return|>`) ends it. An `ebnf` spec (xgrammar's dialect);
    compiled for a harmony vocabulary, each marker is its special token (`Grammars`)."""
    import xgrammar as xgr

    head = xgr.Grammar.from_ebnf(f"root ::= {_H_ANALYSIS} {_literal(H_CHANNEL + 'final' + H_MESSAGE)}")
    return GrammarSpec("ebnf", str(xgr.Grammar.concat(head, _xgrammar_of(spec))))


def harmony_marker_ids(tokenizer: Any) -> dict[str, int]:
    """{harmony marker: its token id} for a harmony vocabulary (gpt-oss's: `<|channel|>` a special token), the markers
    that are special tokens of it; {} for any other vocabulary."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, t in added.items() if getattr(t, "special", False)} | set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    if vocab.get(H_CHANNEL) not in special:
        return {}
    return {m: vocab[m] for m in HARMONY_TOKENS if vocab.get(m) in special}


def bind_markers(ebnf: str, ids: dict[str, int]) -> str:
    """`ebnf` with each marker of `ids` inside a string literal required as its token (xgrammar's `Token(id)`), the
    rest of the literal as text around it: a literal matches text whatever the tokens that spell it, so without this
    `"<|call|>"` also admits `<|`, `call`, `|>`, which a harmony parser reads as the marker but the model never
    learnt (the next turn's prompt would hold them)."""
    if not ids:
        return ebnf
    marker = re.compile("|".join(re.escape(m) for m in sorted(ids, key=len, reverse=True)))

    def bound(token: str) -> str:
        if not (len(token) >= 2 and token[0] == '"' and marker.search(token)):
            return token
        body, pieces, at = token[1:-1], [], 0  # (a marker holds no character a literal escapes)
        for m in marker.finditer(body):
            pieces += ([f'"{body[at:m.start()]}"'] if m.start() > at else []) + [f"Token({ids[m.group()]})"]
            at = m.end()
        pieces += [f'"{body[at:]}"'] if at < len(body) else []
        return "(" + " ".join(pieces) + ")"

    return "".join(bound(tok) for tok in _EBNF_TOKEN.findall(ebnf))


def _bind_tag(node: Any, ids: dict[str, int]) -> Any:
    """A structural tag (its JSON) with `bind_markers` applied to each grammar in it and each tag's end that is a
    marker required as its token (a tag's begin stays text: xgrammar triggers a tag on text)."""
    if isinstance(node, list):
        return [_bind_tag(v, ids) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bind_tag(v, ids) for k, v in node.items()}
    if node.get("type") == "grammar" and isinstance(node.get("grammar"), str):
        out["grammar"] = bind_markers(node["grammar"], ids)
    if node.get("type") == "tag" and isinstance(node.get("end"), str) and node["end"] in ids:
        out["end"] = {"type": "token", "token": ids[node["end"]]}
    return out


# ------------------------------------------------------------------------------------------------ matching
class Matcher:
    """One row's grammar state: `fill` its allowed tokens, `accept` the token drawn, `done` once complete.

    With `think_end` (the token ids of the chat template's `</think>`), the grammar applies only after the answer's
    reasoning: until those tokens have been drawn in a row every token is allowed (a stop token ends the row there,
    unconstrained), and the grammar starts at the token after them, as SGLang's reasoning grammar backend
    (`--reasoning-parser`, a request's `require_reasoning`) defers it."""

    def __init__(self, compiled: Any, stop_token_ids: tuple[int, ...], think_end: tuple[int, ...] = (),
                 has_quote: Optional[Callable[[], bool]] = None):
        import xgrammar as xgr

        if stop_token_ids:  # the row's own stop tokens end the answer once the grammar is complete
            self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        else:  # no stop token (ignore_eos): the answer ends where the grammar is complete and nothing can follow
            self._m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        self._think_end = tuple(think_end)
        self._tail: tuple[int, ...] = ()  # the last tokens drawn while reasoning (as many as think_end has)
        # the grammar allowed no token of the vocabulary at a step (`mask_logits`): the tokenizer cannot write what it
        # requires next, so the row cannot go on (`advance` ends it; its caller answers it as an error, DEAD_END)
        self.dead = False
        # whether the vocabulary has a token holding '"' (`Grammars.has_quote`), asked only at a dead end that needs it
        self._has_quote = has_quote

    def dead_end_error(self, n: int) -> str:
        """What a row of this matcher that dead-ended after `n` tokens of its answer is told: DEAD_END_NO_QUOTE where
        the grammar's state at the dead end accepts a '"' next and the vocabulary has no token holding '"' (then
        the cause: no JSON string or key can be written), DEAD_END otherwise. Decided by the matcher's state, not the
        grammar's source: a regex `[^"]:` that dead-ends at ':' gets DEAD_END."""
        if self._has_quote is not None and not self.reasoning and self._m.fork().accept_string('"') \
                and not self._has_quote():  # (a fork: the row's own state stays as it is)
            return DEAD_END_NO_QUOTE.format(n=n)
        return DEAD_END.format(n=n)

    @property
    def reasoning(self) -> bool:
        """Whether the row is still in its reasoning (its grammar not started)."""
        return bool(self._think_end) and self._tail != self._think_end

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (int32 [B, ceil(V / 32)], bit i of word w:
        token 32 w + i)."""
        if self.reasoning:
            bitmask[row] = -1  # every bit set: any token
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance with `token`; False when the grammar does not allow it (the matcher is then unchanged)."""
        if self.reasoning:
            self._tail = (self._tail + (int(token),))[-len(self._think_end):]
            return True
        return bool(self._m.accept_token(int(token)))

    @property
    def done(self) -> bool:
        return not self.reasoning and bool(self._m.is_terminated())


class Grammars:
    """The grammars of one tokenizer: its vocabulary read once (`vocab_size`: the model's logits width, which may
    exceed the tokenizer's), each distinct spec compiled once (up to CACHE_SIZE kept). On a harmony vocabulary
    (gpt-oss's) a marker in an ebnf literal, a structural tag's grammar or a tag's end is required as its special
    token, not as text ordinary tokens could spell (`bind_markers`). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._compiler: Any = None
        self._markers: dict[str, int] = {}  # a harmony vocabulary's markers: required as their tokens (bind_markers)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # specs compiled (not found in the cache)
        self._info: Any = None  # xgrammar's TokenizerInfo, kept for `has_quote`
        self._quote: Optional[bool] = None  # whether a token of the vocabulary holds '"' (`has_quote`), read once
        self._pieces: Optional[list[bytes]] = None  # the bytes each token writes (`_piece`), read once

    def _backend(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as exc:
                raise GrammarError("constrained decoding needs the xgrammar package (pip install xgrammar)") from exc
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._info = info
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._markers = harmony_marker_ids(self.tokenizer)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (GrammarError when it does not compile)."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            compiler = self._backend()
            try:
                if spec.kind == "json_schema":
                    compiled = compiler.compile_json_schema(spec.source, any_whitespace=False)
                elif spec.kind == "json_object":
                    compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                            any_whitespace=False)
                elif spec.kind == "regex":
                    compiled = compiler.compile_regex(spec.source)
                elif spec.kind == "structural_tag":
                    source = spec.source
                    if self._markers:  # (a harmony vocabulary: its markers as their tokens)
                        source = json.dumps(_bind_tag(json.loads(source), self._markers), ensure_ascii=False)
                    compiled = compiler.compile_structural_tag(source)
                else:
                    compiled = compiler.compile_grammar(bind_markers(spec.source, self._markers))
            except Exception as exc:  # xgrammar's parse errors are RuntimeError/ValueError with its message
                detail = _xgrammar_detail(exc)
                raise GrammarError(f"the {spec.kind} does not compile: {detail}") from None
            self.compiles += 1
            self._cache[spec] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, spec: GrammarSpec, stop_token_ids: tuple[int, ...] | list[int],
                think_end: tuple[int, ...] = ()) -> Matcher:
        """A fresh matcher of `spec` for one row whose stop tokens are `stop_token_ids`; with `think_end`, applied
        after the row's reasoning (`Matcher`)."""
        return Matcher(self.compile(spec), tuple(int(t) for t in stop_token_ids), tuple(int(t) for t in think_end),
                       has_quote=lambda: self.has_quote)

    @property
    def has_quote(self) -> bool:
        """Whether a token of the vocabulary (special tokens aside) holds '"', which JSON cannot be written without.
        Read the first time it is asked (a dead end that needs a '"': a rare event, so a server's first grammar does
        not pay the scan of a large vocabulary) and kept. Without the compile lock once a grammar has compiled: a dead
        end, on the engine's loop, does not wait on another request's compile; two threads may read it at once, both
        getting the same answer."""
        if self._quote is None:
            info = self._info
            if info is None:  # no grammar compiled yet (so no Matcher asks): the tokenizer's info made now
                with self._lock:
                    self._backend()
                info = self._info
            # the tokens as the bytes they write (what xgrammar matches grammars on), special tokens left out: a
            # grammar's text never uses them
            special = set(info.special_token_ids)
            self._quote = any(b'"' in b for i, b in enumerate(info.decoded_vocab) if i not in special)
        return self._quote

    def _piece(self, token: int) -> bytes:
        """The bytes token `token` writes, as xgrammar matches grammars on them (b"" for an id past the tokenizer's);
        the vocabulary's read once, the first time it is asked."""
        if self._pieces is None:
            with self._lock:
                self._backend()
            self._pieces = list(self._info.decoded_vocab)
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def constrained(self, spec: GrammarSpec, stop_token_ids: tuple[int, ...] | list[int],
                    tokens: list[int]) -> list[int]:
        """Which tokens of an answer sampled under `spec` (with stop tokens `stop_token_ids`) the grammar constrained:
        1 where its mask allowed only part of the tokenizer's vocabulary when the token was drawn (the engine's
        log-prob of it is then of the masked distribution, not the model's), 0 where it allowed every token of it
        (the log-prob is the model's own). The answer is replayed through a fresh matcher, so an engine that reports
        no such thing (SGLang) is read the same way. Ids past the tokenizer's (the padding of a model's logits,
        which a grammar always masks and no tokenizer writes) do not count. A token the grammar refuses (an engine
        that did not apply it): that token and the rest count as constrained. Under a spec `after_reasoning` wrote,
        the answer's leading reasoning block (`reasoning_span`: up to its `</think>` and the blanks after it) counts
        as free: the grammar forbids there only a second `<think>` and the stop tokens, which leaves the reasoning
        the model's own (its log-probs differ from the model's by the little probability those tokens had), and what
        it constrains is the answer after it."""
        matcher = self.matcher(spec, stop_token_ids)
        opened = reasoning_opened(spec)
        free = 0 if opened is None else reasoning_span([self._piece(t) for t in tokens], opened)
        size = min(len(self.tokenizer), self.vocab_size)
        full, rest = divmod(size, 32)
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        out = []
        for k, token in enumerate(tokens):
            matcher.fill(bitmask, 0)
            words = bitmask[0]
            every = bool((words[:full] == -1).all()) and (
                rest == 0 or (int(words[full]) & ((1 << rest) - 1)) == (1 << rest) - 1)
            if not matcher.accept(int(token)):
                return out + [1] * (len(tokens) - k)
            out.append(0 if every or k < free else 1)
        return out


# what a request whose grammar dead-ended is told (the engine's /generate: HTTP 400; relax-serve's OpenAI routes too)
DEAD_END = ("constrained decoding: after {n} token(s) of the answer its grammar allows no token of this model's "
            "vocabulary: the tokenizer cannot write what the grammar requires next (e.g. a character of the JSON, "
            "such as '\"', that no token holds), so the format, tool schema or grammar asked for cannot be followed "
            "with this tokenizer")
# the same where the grammar accepts a '"' next and the vocabulary has no token holding one (`Matcher.dead_end_error`):
# no JSON string or key can be written with such a tokenizer, whatever the request, so the message says that and what
# to do
DEAD_END_NO_QUOTE = ("constrained decoding: after {n} token(s) of the answer its grammar allows no token of this "
                     "model's vocabulary: it allows a '\"' there, and this model's vocabulary has no token "
                     "holding '\"', so no JSON strings or keys (response_format json_schema, forced tool calls) can "
                     "be written: serve a model whose tokenizer has one (e.g. model=smollm2_135m; the tiny model's "
                     "built-in vocabulary has none)")
DEAD_END_CODE = "grammar_dead_end"  # that error's `code`: the engine's /generate 400 body, relax-serve's OpenAI routes


def mask_logits(logits: torch.Tensor, matchers: list[Optional[Matcher]]) -> torch.Tensor:
    """`logits` [B, V] as float32 with the tokens each row's matcher disallows at -inf (rows without one as they
    are). The bitmask is filled on the host and unpacked on the logits' device. A row whose grammar allows no token
    at all is marked dead (`Matcher.dead`) and left unmasked, so the other rows sample on (an all -inf row would stop
    the whole batch as non-finite logits); `advance` then ends it, and the token drawn for it is no answer."""
    logits = logits.float()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    B, V = logits.shape
    words = (V + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    for k, i in enumerate(rows):
        matchers[i].fill(bitmask, k)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool().reshape(len(rows), words * 32)[:, :V]
    none = ~allowed.any(-1)
    if bool(none.any()):
        for k in none.nonzero().flatten().tolist():
            matchers[rows[k]].dead = True
        allowed[none] = True
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def advance(matchers: list[Optional[Matcher]], tokens: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """Advance each row's matcher with its token where `drawn` ([B] bool: a token the row sampled); [B] bool: the
    rows whose answer the grammar now ends, a dead one's (`Matcher.dead`) included. A token the grammar refuses
    otherwise means it was drawn unmasked: an error."""
    done = torch.zeros(len(matchers), dtype=torch.bool)
    for k, (m, token) in enumerate(zip(matchers, tokens.tolist(), strict=True)):
        if m is None or not bool(drawn[k]):
            continue
        if m.dead:
            done[k] = True
            continue
        if not m.accept(token):
            raise RuntimeError(f"constrained decoding: row {k} drew token {token}, which its grammar does not allow")
        done[k] = m.done
    return done
