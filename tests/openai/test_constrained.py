"""Constrained decoding through relax-serve (`relax.rollout.grammar`): forced tool calls (tool_choice "required" and
a named function), response_format (json_object, json_schema via the openai client's `.parse()`) and SGLang's
`sampling_params.json_schema` on /generate, each answered by a random-weight model on a byte-level vocabulary, so
that only the grammar makes the answers parse."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import openai
import pytest
import requests
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import _byte_level_tokenizer  # noqa: E402  (the byte-level vocabulary of the template tests)

from tests.openai.serving import tiny_server  # noqa: E402

# an engine server in this process; its tests share the module-scoped server: one xdist worker runs them in a row
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_constrained")]

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["days", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}]


class Forecast(BaseModel):
    days: Annotated[int, Field(ge=1, le=7)]
    sunny: bool
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """relax-serve's engine server on the tiny model with a byte-level tokenizer (ChatML, Hermes tool calls)."""
    from relax.data.tokenizer import CHATML_TEMPLATE

    tok = _byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    with tiny_server(tmp_path_factory.mktemp("byte-tokenizer"), tok) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def calls_of(choice) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", choice
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_tool_choice_required_answers_with_calls_whose_arguments_follow_the_schema(client):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=6,
                                       seed=1, max_tokens=1000)
    for choice in r.choices:
        calls = calls_of(choice)
        assert calls and not choice.message.content
        for name, args in calls:
            jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])


def test_required_without_parallel_tool_calls_is_exactly_one_call(client):
    """parallel_tool_calls=false: every choice is one call, ended by the stop token (not cut at max_tokens); the same
    request with parallel calls allowed (the negative control) writes several calls in some choice."""
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=6, seed=1, max_tokens=1000)
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    for choice in one.choices:
        [(name, args)] = calls_of(choice)
        jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])
    several = client.chat.completions.create(**kw)
    assert any(c.finish_reason == "length" or len(c.message.tool_calls or ()) > 1 for c in several.choices)


def test_responses_structured_output_parses_into_the_model(client):
    """The Responses API's text.format json_schema (`responses.parse`, what openai-agents' output_type and
    LangChain's with_structured_output on the Responses API send) constrains the answer as response_format does;
    the same request as plain text (the negative control) does not parse."""
    for seed in (1, 2):
        r = client.responses.parse(model="tiny", input="Forecast for Paris?", text_format=Forecast,
                                   max_output_tokens=200, extra_body={"seed": seed})
        assert isinstance(r.output_parsed, Forecast), r.output_text
        assert r.text.format.type == "json_schema"
    free = client.responses.create(model="tiny", input="Forecast for Paris?", max_output_tokens=40,
                                   extra_body={"seed": 3})
    with pytest.raises(ValueError):
        Forecast.model_validate_json(free.output_text)


def test_a_named_function_is_exactly_one_call_of_it(client):
    for seed in (2, 3, 4):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, seed=seed, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
        [(name, args)] = calls_of(r.choices[0])
        assert name == "weather"
        jsonschema.validate(args, WEATHER)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in (1, 2, 3):
        r = parse(model="tiny", messages=USER, response_format=Forecast, seed=seed, max_tokens=200)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Forecast), r.choices[0].message.content
        assert Forecast.model_validate_json(r.choices[0].message.content) == parsed


def test_json_object_answers_parse_as_objects_and_free_ones_do_not(client):
    r = client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"}, n=4,
                                       seed=5, max_tokens=300)
    for choice in r.choices:
        if choice.finish_reason == "stop":  # an object the model keeps growing may reach the limit
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in r.choices)
    free = client.chat.completions.create(model="tiny", messages=USER, n=4, seed=5, max_tokens=40)
    for choice in free.choices:
        with pytest.raises(ValueError):
            json.loads(choice.message.content)


def test_generate_with_a_json_schema_sampling_param(server):
    body = {"text": "Forecast: ", "sampling_params": {"json_schema": json.dumps(WEATHER), "max_new_tokens": 80,
                                                      "n": 5, "sampling_seed": 9}}
    answers = requests.post(server + "/generate", json=body, timeout=300).json()
    for a in answers:
        assert a["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(a["text"]), WEATHER)


@pytest.mark.parametrize("sp, word", [({"json_schema": "{}", "regex": "a+"}, "one of"),
                                      ({"regex": "(unclosed"}, "regex"), ({"json_schema": "{nope"}, "JSON")])
def test_bad_or_conflicting_grammars_are_a_400(server, sp, word):
    r = requests.post(server + "/generate", json={"text": "x", "sampling_params": sp}, timeout=60)
    assert r.status_code == 400 and word in r.text


def test_a_forced_call_with_a_whole_answer_grammar_or_an_unknown_name_is_a_400(client):
    """SGLang's regex constrains the whole answer, as a forced call does (a response_format does not: it governs a
    content answer, and the forced call wins; tests/openai/test_tools_with_format.py)."""
    for kw in (dict(tool_choice="required", extra_body={"regex": "a+"}),
               dict(tool_choice={"type": "function", "function": {"name": "nope"}})):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=5, **kw)
        assert info.value.body["param"] == "tool_choice"


def test_langchain_forced_tools_and_structured_output_get_usable_answers(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def weather(days: Annotated[int, Field(ge=1, le=7)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The forecast for the next days."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(base_url=server + "/v1", api_key="unused", model="tiny", max_tokens=1000,
                                      seed=4, max_retries=0)
    message = llm.bind_tools([weather], tool_choice="any").invoke("Weather in Paris?")
    assert message.tool_calls and all(c["name"] == "weather" for c in message.tool_calls)
    for call in message.tool_calls:
        assert weather.args_schema.model_validate(call["args"])
    assert isinstance(llm.with_structured_output(Forecast).invoke("Forecast for Paris?"), Forecast)


def test_tools_with_a_response_format_answer_a_call_or_the_schemas_json(client):
    """Tools, response_format json_schema and tool_choice auto (openai-agents' output_type with tools) on the engine
    server: every choice is either calls whose arguments follow the tool's schema or content that parses against the
    response schema, and both occur."""
    kw = dict(model="tiny", messages=USER, tools=TOOLS, n=8, seed=2, max_tokens=300,
              response_format={"type": "json_schema", "json_schema": {"name": "Forecast",
                                                                      "schema": Forecast.model_json_schema()}})
    r = client.chat.completions.create(**kw)
    kinds = []
    for choice in r.choices:
        if choice.finish_reason == "length":  # a random model may write a string until the limit
            continue
        if choice.message.tool_calls:
            for name, args in calls_of(choice):
                jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])
            kinds.append("call")
        else:
            Forecast.model_validate_json(choice.message.content)
            kinds.append("json")
    assert {"call", "json"} <= set(kinds), kinds  # (the schema's grammar alone, sent before, never took a call)
