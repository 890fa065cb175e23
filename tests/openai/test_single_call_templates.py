"""A model whose chat template takes one tool call per assistant message (Llama 3.1/3.2's raises "This model only
supports single tool-calls at once!" on two) is never let write two calls in one answer: relax-serve and the training
gateway constrain its answers to one call, as parallel_tool_calls false does, whatever the request says, and the
Responses API echoes parallel_tool_calls false. Otherwise the server's own two-call answer, sent back with its tool
results (every agent SDK's tool loop), is refused by the model's own template: a 400 no client can recover from.

The reference is the family's own template (tests/agents/templates.py): it renders the one-call answer and raises on
the two-call one. The grammar each request sent (the official `openai` client through the training gateway over a
scripted engine) is compiled on the fixture's vocabulary and must admit the one-call answer and refuse the two-call
one; Qwen3's template, which renders several calls, is the control: its grammars still admit two.

Negative control: before this change the Llama grammars admitted the two-call answer (and plain auto sent none), and
the Responses API echoed parallel_tool_calls true.
"""

from __future__ import annotations

import functools

import pytest

from relax.serve.openai.chat import ChatFormat
from tests.agents.templates import family_tokenizer

openai = pytest.importorskip("openai")

FN = {"name": "get_weather", "description": "The weather of a city.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                     "additionalProperties": False}}
TOOLS = [{"type": "function", "function": FN}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "Out", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
MODES = {"required": {"tool_choice": "required"}, "named": {"tool_choice": {"type": "function",
                                                                           "function": {"name": "get_weather"}}},
         "auto": {}, "strict": {"tools": [{"type": "function", "function": {**FN, "strict": True}}]},
         "format": {"response_format": FORMAT}}
FAMILIES = {  # (the end-of-turn token, how one call is written, whether two calls render back)
    "llama3_1": ("<|eot_id|>", lambda city: f'{{"name": "get_weather", "parameters": {{"city": "{city}"}}}}', "; "),
    "qwen3": ("<|im_end|>", lambda city: f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}'
                                         "\n</tool_call>", "\n"),
}


@functools.cache
def _tok(family: str):
    return family_tokenizer(family)


@functools.cache
def _grammars(family: str):
    from relax.rollout.grammar import Grammars

    return Grammars(_tok(family), len(_tok(family)))


def _renders(family: str, cities: list[str]) -> bool:
    """Whether the family's own template renders an assistant message calling get_weather for `cities`."""
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for k, c in enumerate(cities)]
    try:
        _tok(family).apply_chat_template([{"role": "user", "content": "Weather?"},
                                          {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False)
    except Exception:  # noqa: BLE001  (the template's raise_exception)
        return False
    return True


def _admits(family: str, sampling: dict, text: str) -> bool:
    """Whether the grammar of `sampling` (a /generate's sampling_params; none: anything) takes `text` and the stop
    token, and is then complete."""
    from relax.rollout.grammar import GrammarSpec

    kinds = [k for k in ("ebnf", "structural_tag", "json_schema", "regex") if sampling.get(k)]
    if not kinds:
        return True
    tok, end = _tok(family), FAMILIES[family][0]
    stop = tok.convert_tokens_to_ids(end)
    matcher = _grammars(family).matcher(GrammarSpec(kinds[0], sampling[kinds[0]]), (stop,))
    return all(matcher.accept(t) for t in tok(text, add_special_tokens=False)["input_ids"] + [stop]) and matcher.done


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_single_call_template_gets_one_call_per_answer(gateways, family, mode):
    end, call, sep = FAMILIES[family]
    one, two = call("Paris"), call("Paris") + sep + call("Rome")
    single = not _renders(family, ["Paris", "Rome"])  # the reference: the family's own template
    assert _renders(family, ["Paris"]) and single == (family == "llama3_1")
    tok = _tok(family)
    _, script, _, client = gateways.make(ChatFormat(tok, (tok.convert_tokens_to_ids(end),)), [one])
    body = {"model": "policy", "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
            "tools": TOOLS} | MODES[mode]
    if family == "qwen3":
        body["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    message = client.chat.completions.create(**body).choices[0].message
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "Paris"}']
    sampling = script.calls[-1][0]["sampling_params"]
    assert _admits(family, sampling, one)
    if mode != "named":  # a named tool_choice is one call on every template
        assert _admits(family, sampling, two) is not single


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_responses_api_echoes_the_parallel_tool_calls_applied(gateways, family):
    end, call, _ = FAMILIES[family]
    tok = _tok(family)
    _, _, _, client = gateways.make(ChatFormat(tok, (tok.convert_tokens_to_ids(end),)), [call("Paris")])
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if family == "qwen3" else None
    r = client.responses.create(model="policy", input="Weather in Paris?", tools=[{"type": "function", **FN}],
                                extra_body=extra)
    assert [i.type for i in r.output] == ["function_call"]
    assert r.parallel_tool_calls is (family != "llama3_1")
