"""Which calls an answer returns (`ChatFormat.tool_calls`, `OpenAIService._chat_choice`), through the training gateway
over a scripted engine and the official `openai` client:

- calls of functions the request did not offer are dropped, as SGLang's parsers drop them (a call of an undeclared
  name is not a `tool_calls` entry; openai-agents raises ModelBehaviorError on one and the whole group was lost); the
  content is the text outside the calls;
- a forced answer (`tool_choice` "required") cut by max_tokens keeps its complete calls, with finish_reason "length"
  (Responses: the function_call items, status "incomplete"); before, the whole answer came back as content text.

Negative control: on the code before this change, the undeclared call came back as a `tool_calls` entry and the cut
answer as content with no calls.
"""

from __future__ import annotations

import json

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import family_tokenizer
from tests.openai.scripted import Script, limits

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    tok = family_tokenizer("qwen3")
    return ChatFormat(tok, (tok.eos_token_id,))


def test_calls_of_functions_not_offered_are_dropped(fmt, gateways):
    mixed = f"Checking.\n{call('delete_everything', path='/')}\n{call('get_weather', city='Paris')}"
    _, _, _, client = gateways.make(fmt, [mixed, f"Let me see.\n{call('delete_everything', path='/')}"])
    choice = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert (choice.message.content, choice.finish_reason) == ("Checking.", "tool_calls")
    choice = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("Let me see.", None, "stop")


class _Cut(Script):
    """A script whose answers end at the token limit: no stop token, finish_reason length."""

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = super().__call__(payloads)
        for answer in out:
            meta = answer["meta_info"]
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
            meta["finish_reason"] = {"type": "length"}
        return out


def test_a_forced_answer_cut_by_max_tokens_keeps_its_complete_calls(fmt):
    written = f"{call('get_weather', city='Paris')}\n{call('get_weather', city='Rome')}"
    cut_text = written[:-25]  # inside the second call
    gw = Gateway(OpenAIService(fmt, _Cut(fmt, [cut_text]), model="policy", context_length=None,
                               max_tokens=64)).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
        choice = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, tool_choice="required",
                                                max_tokens=64).choices[0]
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris"}]
        assert (choice.message.content, choice.finish_reason) == (None, "length")
        chunks = list(client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, stream=True,
                                                     tool_choice="required", max_tokens=64))
        streamed = [tc.function.name for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert streamed == ["get_weather"] and chunks[-1].choices[0].finish_reason == "length"
        resp = client.responses.create(model="policy", input="Weather in Paris?", tool_choice="required",
                                       tools=[{"type": "function", **TOOLS[0]["function"]}], max_output_tokens=64)
        assert resp.status == "incomplete" and [(o.type, o.name) for o in resp.output] == [
            ("function_call", "get_weather")]
    finally:
        gw.close()
