"""An answer cut by max_tokens after it opened a tool call, under tool_choice auto (strict tools, tools with a
response_format, parallel_tool_calls false, and plain auto with no grammar): its complete calls come back as
`tool_calls` and none of the call markup as content, finish_reason "length", as SGLang's detectors read such a text
(`normal_text = text[:idx]`, the text before the first call marker, and the calls of every complete block) and as a
forced answer cut by the limit already came back. The expected answers are written by hand from that rule.

Through the official `openai` client against the training gateway (chat, streamed and not, and the Responses API),
relax-serve's stream written as the tokens are drawn, and a default openai-agents agent (strict tools, tool_choice
auto: the SDK's defaults), which must run the complete call instead of returning the markup as its final answer.
The engine answers a hand-written cut text (finish length) in the Qwen3 (Hermes) and Llama 3.1 (JSON) fixtures'
vocabularies.

Negative control: before this change every case but the forced one came back with the whole cut markup as content
and no calls (and the agent returned that markup as its final output).
"""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import family_tokenizer
from tests.openai.scripted import CutEngine, limits

openai = pytest.importorskip("openai")

TOOL = {"name": "get_weather", "description": "The weather of a city.", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}
TOOLS = [{"type": "function", "function": TOOL}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "Out", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
MODES = {"strict": {}, "format": {"response_format": FORMAT}, "one-call": {"parallel_tool_calls": False},
         "plain": {"tools": [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "strict"}}]},
         "forced": {"tool_choice": "required"}}


def hermes(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def llama(city: str) -> str:
    return f'{{"name": "get_weather", "parameters": {{"city": "{city}"}}}}'


# (family, the cut answer, the content the client gets, the cities of its calls)
CASES = {
    "qwen3-calls": ("qwen3", hermes("Paris") + "\n" + hermes("Rome")[:-8], None, ["Paris"]),
    "qwen3-text-call": ("qwen3", "Let me check.\n" + hermes("Paris") + "\n" + hermes("Rome")[:-30],
                        "Let me check.", ["Paris"]),
    "qwen3-text-first-call": ("qwen3", "Let me check.\n" + hermes("Paris")[:-20], "Let me check.", []),
    "llama3_1-calls": ("llama3_1", llama("Paris") + "; " + llama("Rome")[:-12], None, ["Paris"]),
}


@functools.cache
def _fmt(family: str) -> ChatFormat:
    tok = family_tokenizer(family)
    end = "<|im_end|>" if family == "qwen3" else "<|eot_id|>"
    return ChatFormat(tok, (tok.convert_tokens_to_ids(end),))


def _cities(calls) -> list[str]:
    return [json.loads(c["function"]["arguments"] if isinstance(c, dict) else c.function.arguments)["city"]
            for c in calls or []]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cut_answer_keeps_its_complete_calls_and_no_markup(case, mode):
    family, text, content, cities = CASES[case]
    if mode == "forced" and content is not None:
        pytest.skip("a forced answer has no text before its calls")
    fmt = _fmt(family)
    ids = fmt.encode(text)
    assert fmt.decode(ids) == text
    engine = CutEngine(ids)
    request = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}], "tools": TOOLS,
               "max_tokens": len(ids)} | MODES[mode]
    if family == "qwen3":
        request["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    gw = Gateway(OpenAIService(fmt, engine.send, model="m", context_length=None, max_tokens=64)).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
        choice = client.chat.completions.create(**request).choices[0]
        assert (choice.message.content, _cities(choice.message.tool_calls), choice.finish_reason) == \
            (content, cities, "length")
        chunks = list(client.chat.completions.create(**request, stream=True))
        streamed = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert (streamed, _cities(calls)) == (content or "", cities)
        if mode in ("strict", "one-call"):  # the Responses API: the calls' items, no message of markup
            tools = [{"type": "function", **TOOL}]
            r = client.responses.create(model="m", input="Weather in Paris and Rome?", tools=tools,
                                        max_output_tokens=len(ids), extra_body=request.get("extra_body"),
                                        parallel_tool_calls=mode != "one-call")
            assert r.status == "incomplete"
            assert [json.loads(i.arguments)["city"] for i in r.output if i.type == "function_call"] == cities
            assert r.output_text == (content or "")
    finally:
        gw.close()
    body = {k: v for k, v in request.items() if k != "extra_body"} | (request.get("extra_body") or {})
    serve = OpenAIService(fmt, engine.send, model="m", context_length=None, stream=engine.stream)
    deltas = [c["delta"] for ch in serve.chat_stream({**body, "stream": True}) for c in ch["choices"]]
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert (streamed, _cities([tc for d in deltas for tc in d.get("tool_calls") or []])) == (content or "", cities)


class _CutThenAnswer:
    """/generate: the cut answer first, then `final` with the stop token."""

    def __init__(self, fmt: ChatFormat, ids: list[int], final: str):
        self.fmt, self.cut, self.final, self.prompts = fmt, CutEngine(ids), final, []

    def __call__(self, payloads: list[dict]) -> list[dict]:
        self.prompts += [p["input_ids"] for p in payloads]
        if len(self.prompts) == 1:
            return self.cut.send(payloads)
        ids = self.fmt.encode(self.final) + [min(self.fmt.eos_token_ids)]
        return [{"meta_info": {"output_token_logprobs": [[-0.01, t, None] for t in ids],
                               "finish_reason": {"type": "stop"}, "weight_version": "0"}}]


def test_a_default_openai_agents_agent_runs_the_complete_call():
    agents = pytest.importorskip("agents")
    fmt = _fmt("qwen3")
    ran = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        ran.append(city)
        return "sunny"

    agents.set_tracing_disabled(True)
    engine = _CutThenAnswer(fmt, fmt.encode(CASES["qwen3-calls"][1]), "Sunny in Paris.")
    gw = Gateway(OpenAIService(fmt, engine, model="m", context_length=None, max_tokens=64)).start()
    try:
        key = gw.open(0, limits()).key

        async def run():
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as client:
                agent = agents.Agent(name="a", tools=[get_weather],
                                     model=agents.OpenAIChatCompletionsModel("m", client))
                return await agents.Runner.run(agent, "Weather in Paris and Rome?", max_turns=3)

        result = asyncio.run(run())
    finally:
        gw.close()
    assert (ran, result.final_output) == (["Paris"], "Sunny in Paris.")


HARMONY_CUT = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa')


@pytest.mark.parametrize("mode", ["strict", "plain", "one-call"])
def test_a_harmony_answer_cut_inside_its_call_has_no_call_markup(mode):
    """gpt-oss: the preamble's text is the content, the cut call's message none of it (it was its whole markup)."""
    from tests.agents.templates import gpt_oss_tokenizer

    tok = gpt_oss_tokenizer()
    fmt = ChatFormat(tok, (tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")))
    ids = fmt.encode(HARMONY_CUT)
    engine = CutEngine(ids)
    request = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
               "max_tokens": len(ids)} | MODES[mode]
    gw = Gateway(OpenAIService(fmt, engine.send, model="m", context_length=None, max_tokens=64)).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
        choice = client.chat.completions.create(**request).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == \
            ("Checking.", None, "length")
        chunks = list(client.chat.completions.create(**request, stream=True))
        assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == "Checking."
    finally:
        gw.close()
