"""tool_choice `allowed_tools` (chat: `{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`, Responses:
`{"type": "allowed_tools", "mode", "tools"}`) through the official `openai` client: the calls are constrained to the
listed tools while every tool stays in the prompt (OpenAI's: the tools list is left whole for prompt caching); mode
"required" forces one or more calls among them. relax-serve's tiny random-weight model on a byte-level vocabulary
(ChatML, Hermes calls) answers, so only the grammar decides which tools are called; the grammar mode "auto" sends is
also checked on its own against a call of a listed and of an unlisted tool.

Negative control: before this change both forms were a 400 naming tool_choice (every test below failed with
BadRequestError).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest

pytest.importorskip("xgrammar")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import _byte_level_tokenizer  # noqa: E402

from tests.openai.serving import tiny_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_allowed_tools")]

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
OBJ = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}
NAMES = ("weather", "clock", "noop")
TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n}", "parameters": OBJ}} for n in NAMES]


def chat_choice(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": n}} for n in names]}}


def byte_tokenizer():
    from relax.data.tokenizer import CHATML_TEMPLATE

    tok = _byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> openai.OpenAI:
    with tiny_server(tmp_path_factory.mktemp("byte-tokenizer"), byte_tokenizer()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def names_of(choice) -> list[str]:
    return [c.function.name for c in choice.message.tool_calls or []]


def test_required_calls_only_the_listed_tools_with_every_tool_in_the_prompt(client):
    """Every choice is one or more calls, each of the listed tool; the same request with tool_choice "required"
    (every tool callable) calls the others too, and its prompt is the same size (the whole tools list rendered)."""
    kw = dict(model="tiny", messages=USER, tools=TOOLS, n=6, seed=1, max_tokens=400)
    allowed = client.chat.completions.create(**kw, tool_choice=chat_choice("required", "clock"))
    for choice in allowed.choices:
        assert choice.finish_reason == "tool_calls" and set(names_of(choice)) == {"clock"}, choice
        for c in choice.message.tool_calls:
            assert isinstance(json.loads(c.function.arguments)["utc"], bool)
    free = client.chat.completions.create(**kw, tool_choice="required")
    assert {n for c in free.choices for n in names_of(c)} - {"clock"}
    assert allowed.usage.prompt_tokens == free.usage.prompt_tokens


def test_the_responses_form_is_the_chat_form(client):
    """Responses `{"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": ...}]}`:
    function_call items of the listed tools only (two listed), the tool_choice echoed."""
    tools = [{"type": "function", "name": n, "parameters": OBJ} for n in NAMES]
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "clock"}, {"type": "function", "name": "noop"}]}
    for seed in (1, 2, 3):
        r = client.responses.create(model="tiny", input=USER[0]["content"], tools=tools, tool_choice=choice,
                                    max_output_tokens=300, extra_body={"seed": seed})
        calls = [item.name for item in r.output if item.type == "function_call"]
        assert calls and set(calls) <= {"clock", "noop"}, r.output
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"


def test_auto_lets_the_model_answer_or_call_a_listed_tool(client):
    """mode auto: each choice is text or calls of the listed tool."""
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, n=8, seed=2, max_tokens=200,
                                       tool_choice=chat_choice("auto", "clock"))
    assert all(set(names_of(c)) <= {"clock"} for c in r.choices)


def test_the_auto_grammar_takes_a_call_of_a_listed_tool_and_not_of_another(scripted_gateway):
    """The grammar mode auto sends (scripted engine): free text, or text and a call of "clock"; a call of "weather",
    which stays in the prompt, is refused by it. Listing every tool is plain auto: no grammar."""
    from relax.rollout.grammar import Grammars, GrammarSpec
    from relax.serve.openai.chat import ChatFormat

    tok = byte_tokenizer()
    _, script, _, gw_client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["fine"])
    gw_client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=chat_choice("auto", "clock"))
    sp = script.calls[-1][0]["sampling_params"]
    kind = next(k for k in ("structural_tag", "ebnf") if k in sp)
    grammars, eos = Grammars(tok, len(tok)), tok.eos_token_id

    def accepts(text: str) -> bool:
        m = grammars.matcher(GrammarSpec(kind, sp[kind]), [eos])
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.accept(eos)

    call = '<tool_call>\n{"name": "%s", "arguments": {"utc": true}}\n</tool_call>'
    assert accepts("It is sunny.") and accepts("Let me see. " + call % "clock")
    assert not accepts("Let me see. " + call % "weather")
    assert "weather" in tok.decode(script.calls[-1][0]["input_ids"])  # every tool in the prompt
    gw_client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                      tool_choice=chat_choice("auto", *reversed(NAMES)))
    assert not {"structural_tag", "ebnf"} & set(script.calls[-1][0]["sampling_params"])


@pytest.mark.parametrize("choice, param", [
    (chat_choice("sometimes", "clock"), "tool_choice.allowed_tools.mode"),
    (chat_choice("auto", "missing"), "tool_choice.allowed_tools.tools[0]"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice.allowed_tools.tools"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "custom", "name": "x"}]}},
     "tool_choice.allowed_tools.tools[0]"),
])
def test_a_bad_allowed_tools_is_a_400_naming_it(scripted_gateway, choice, param):
    from relax.serve.openai.chat import ChatFormat

    tok = byte_tokenizer()
    _, script, _, gw_client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["fine"])
    with pytest.raises(openai.BadRequestError) as info:
        gw_client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice)
    assert info.value.body["param"] == param and script.calls == []


def test_the_responses_error_names_every_supported_choice(scripted_gateway):
    from relax.serve.openai.chat import ChatFormat

    tok = byte_tokenizer()
    _, _, _, gw_client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["fine"])
    with pytest.raises(openai.BadRequestError) as info:
        gw_client.responses.create(model="m", input="hi", tool_choice={"type": "mcp", "server_label": "x"})
    message = info.value.body["message"]
    assert all(w in message for w in ("'auto'", "'none'", "'required'", "allowed_tools"))
    with pytest.raises(openai.BadRequestError) as info:
        gw_client.responses.create(model="m", input="hi", tools=[{"type": "function", "name": "clock"}],
                                   tool_choice={"type": "allowed_tools", "mode": "sometimes",
                                                "tools": [{"type": "function", "name": "clock"}]})
    assert info.value.body["param"] == "tool_choice.mode"
