"""Mistral's tokenizer v11+ templates (Mistral-Small-3.1/3.2, Magistral, Devstral) write a call as
`[TOOL_CALLS]NAME[ARGS]{...}`; the grammars of forced calls, strict tools, parallel_tool_calls false and tools with
a format are written in that form for such a template (the form found by rendering one call with it,
`relax.data.tokenizer.template_call_text`), and in v0.3's `[TOOL_CALLS] [{...}]` for a v3 template, so a model
constrained by relax-serve or the training gateway writes (and RL trains) the calls its own template writes.

The reference is the template's own rendering of the answer (tests/agents/test_tool_templates_beyond_fixtures.py's
fixtures): the grammar each request sent (the official `openai` client through the training gateway over a scripted
engine), compiled on the fixture's vocabulary, must admit the template's own answer and refuse the other version's.

Negative control: before this change every Mistral grammar was v0.3's: the v11 template's own answer was refused and
the v3 form admitted.
"""

from __future__ import annotations

import functools

import pytest

from relax.serve.openai.chat import ChatFormat
from tests.agents.test_tool_templates_beyond_fixtures import MISTRAL_SPECIAL, MISTRAL_V3, MISTRAL_V11, tokenizer_with

openai = pytest.importorskip("openai")

FN = {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}
TOOLS = [{"type": "function", "function": FN}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "Out", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
MODES = {"required": {"tool_choice": "required"},
         "named": {"tool_choice": {"type": "function", "function": {"name": "add"}}},
         "strict": {"tools": [{"type": "function", "function": {**FN, "strict": True}}]},
         "one-call": {"parallel_tool_calls": False}, "format": {"response_format": FORMAT}}
TEMPLATES = {"v3": MISTRAL_V3, "v11": MISTRAL_V11}


@functools.cache
def _tok(version: str):
    return tokenizer_with(TEMPLATES[version], MISTRAL_SPECIAL)


@functools.cache
def _grammars(version: str):
    from relax.rollout.grammar import Grammars

    return Grammars(_tok(version), len(_tok(version)))


def _written(version: str, n: int) -> str:
    """The assistant turn calling add(1, 2) `n` times as the version's own template writes it (between the last
    [/INST] and </s>), without the call ids the v3 template adds (the model writes none: the grammar has none)."""
    calls = [{"type": "function", "id": f"call{k}abcd", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
             for k in range(n)]
    text = _tok(version).apply_chat_template([{"role": "user", "content": "1 + 2?"},
                                              {"role": "assistant", "content": "", "tool_calls": calls}],
                                             tools=TOOLS, tokenize=False)
    answer = text[text.rindex("[/INST]") + len("[/INST]"):]
    answer = answer[:answer.index("</s>")]
    for k in range(n):
        answer = answer.replace(f', "id": "call{k}abcd"', "")
    return answer


def _admits(version: str, sampling: dict, text: str) -> bool:
    from relax.rollout.grammar import GrammarSpec

    kind = next(k for k in ("ebnf", "structural_tag") if sampling.get(k))
    tok = _tok(version)
    matcher = _grammars(version).matcher(GrammarSpec(kind, sampling[kind]), (tok.eos_token_id,))
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return all(matcher.accept(t) for t in ids) and matcher.done


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("version", sorted(TEMPLATES))
def test_the_call_grammar_writes_the_template_s_own_form(gateways, version, mode):
    own, other = _written(version, 1), _written("v3" if version == "v11" else "v11", 1)
    assert own.startswith("[TOOL_CALLS]") and ("[ARGS]" in own) == (version == "v11")  # (the two forms differ)
    tok = _tok(version)
    _, script, _, client = gateways.make(ChatFormat(tok, (tok.eos_token_id,)), [own])
    body = {"model": "policy", "messages": [{"role": "user", "content": "1 + 2?"}], "tools": TOOLS} | MODES[mode]
    message = client.chat.completions.create(**body).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    sampling = script.calls[-1][0]["sampling_params"]
    assert _admits(version, sampling, own)
    assert not _admits(version, sampling, other)
    if mode in ("required", "strict", "format"):  # several calls, as the template writes them
        assert _admits(version, sampling, _written(version, 2))
