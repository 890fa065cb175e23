"""The tools prompt Relax injects for a chat template without a place for tools agrees with the tool parser in use, and
so do the calls of earlier turns and a forced call's grammar (`relax.serve.openai.chat.tools_prompt`): for every
built-in tool-call format, through the gateway (scripted engine, the official client):

- the call the prompt the engine receives shows is read by that format's parser (independent of the prompt's wording:
  the parser finds it in the rendered prompt) as a call of the tool whose arguments satisfy its schema (jsonschema),
  and the grammar the engine receives for `tool_choice="required"` accepts it, token by token;
- an earlier assistant call is written back in the format the parser reads, to the same call (by the template itself
  where it renders `tool_calls`, DeepSeek-V3's; else in the parser's format).

The templates are the fixtures' (tests/agents/templates.py): DeepSeek-V3's (no `tools` variable; its own parser,
`auto`), and SmolLM2's ChatML (no `tools`, no `tool_calls`) with each built-in parser named as data.tool_parser names
it. Negative control: before this change the prompt taught Hermes whatever the parser (DeepSeek's prompt asked for
`<tool_call>`, which its parser reads as prose) and earlier calls were written as Hermes.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from relax.agents.parsers import BUILTIN_PARSERS, DS_CALLS_BEGIN, DS_CALLS_END, ToolCall
from relax.rollout.grammar import Grammars, GrammarSpec
from relax.serve.openai.chat import ChatFormat
from tests.agents.templates import _byte_level_tokenizer, family_tokenizer

pytest.importorskip("xgrammar")

PARAMETERS = {"type": "object", "properties": {
    "expression": {"type": "string", "description": "what to compute"},
    "digits": {"type": "integer"}, "mode": {"type": "string", "enum": ["exact", "float"]},
    "verbose": {"type": "boolean"}}, "required": ["expression", "digits"]}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": PARAMETERS}},
         {"type": "function", "function": {"name": "clock", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "6*7?"}]
CASES = {fmt: ("smollm2_chatml", fmt) for fmt in BUILTIN_PARSERS} | {"deepseek_v3": ("deepseek_v3", None)}
OPEN_CLOSE = {"hermes": ("<tool_call>", "</tool_call>"), "qwen3_coder": ("<tool_call>", "</tool_call>"),
              "glm45": ("<tool_call>", "</tool_call>"), "deepseek_v3": (DS_CALLS_BEGIN, DS_CALLS_END),
              "harmony": ("<|channel|>commentary to=", "<|call|>")}


def _fmt(family: str, parser: str | None) -> ChatFormat:
    tok = family_tokenizer(family)
    return ChatFormat(tok, (tok.eos_token_id,), BUILTIN_PARSERS[parser] if parser else None)


def _shown_call(fmt: str, prompt: str) -> str:
    """The call the prompt shows, found by the format's own markers (llama3_json has none: the line that is a call;
    mistral's list ends with its JSON)."""
    if fmt == "llama3_json":
        after = prompt[prompt.rindex("</tools>"):]  # (the listing's lines are function objects, which read as calls)
        lines = [line for line in after.splitlines() if BUILTIN_PARSERS[fmt](line).calls]
        assert len(lines) == 1, lines
        return lines[0]
    if fmt == "mistral":  # the marker, then one JSON list of calls
        assert prompt.count("[TOOL_CALLS]") == 1, prompt
        at = prompt.index("[TOOL_CALLS]")
        return prompt[at:json.JSONDecoder().raw_decode(prompt, at + len("[TOOL_CALLS] "))[1]]
    begin, end = OPEN_CLOSE[fmt]
    assert prompt.count(begin) == 1, prompt
    return prompt[prompt.index(begin):prompt.index(end) + len(end)]


@pytest.mark.parametrize("fmt", list(CASES))
def test_the_injected_prompt_teaches_the_parsers_format_and_the_forced_grammar_takes_its_call(scripted_gateway, fmt):
    family, parser = CASES[fmt]
    chat = _fmt(family, parser)
    assert not chat.native_tools  # the template has no place for tools: Relax writes the prompt
    assert chat.tool_parser is BUILTIN_PARSERS[fmt]
    gw, script, session, client = scripted_gateway(chat, ["x"])
    client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, tool_choice="required")
    payload = script.calls[0][0]
    prompt = chat.tokenizer.decode(payload["input_ids"], skip_special_tokens=False)
    # the parser reads the prompt's call: one call, of a tool offered, its arguments satisfying the tool's schema
    parsed = BUILTIN_PARSERS[fmt](prompt if fmt != "llama3_json" else _shown_call(fmt, prompt))
    assert not parsed.errors and len(parsed.calls) == 1, parsed
    call = parsed.calls[0]
    assert call.name == "calculator"
    jsonschema.validate(call.arguments, PARAMETERS)
    # the forced call's grammar (the one sent to the engine) takes exactly that text, then the stop token
    shown = _shown_call(fmt, prompt)
    assert BUILTIN_PARSERS[fmt](shown).calls == [call]
    tok = _byte_level_tokenizer()
    matcher = Grammars(tok, len(tok)).matcher(GrammarSpec("ebnf", payload["sampling_params"]["ebnf"]),
                                              [tok.eos_token_id])
    assert all(matcher.accept(t) for t in tok.encode(shown, add_special_tokens=False)), shown
    assert matcher.accept(tok.eos_token_id)


@pytest.mark.parametrize("fmt", list(CASES))
def test_an_earlier_call_is_written_back_as_the_parser_reads_it(scripted_gateway, fmt):
    family, parser = CASES[fmt]
    chat = _fmt(family, parser)
    gw, script, session, client = scripted_gateway(chat, ["x"])
    args = {"expression": "6 * 7", "digits": 2}
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": json.dumps(args)}},
            {"id": "call_2", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    prompt = chat.tokenizer.decode(script.calls[0][0]["input_ids"], skip_special_tokens=False)
    # the earlier turn: after the user's message, before the first tool result
    turn = prompt[prompt.index("6*7?") + 4:prompt.index("42")]
    if fmt == "llama3_json":
        turn = next(line for line in turn.splitlines() if line.startswith("{"))
    assert BUILTIN_PARSERS[fmt](turn).calls == [ToolCall("calculator", args), ToolCall("clock", {})]
