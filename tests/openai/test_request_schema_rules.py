"""OpenAI's request rules that Relax enforces as OpenAI does, through the official `openai` client over real HTTP to
the training gateway (a scripted engine, fast; relax-serve parses requests with the same functions): a json_schema
format needs its `name` (chat `response_format.json_schema.name`, Responses `text.format.name`: the 400
missing_required_parameter naming it), and `metadata` is at most 16 string values with keys of at most 64 characters
and values of at most 512 (a 400 naming the field). What the SDKs send by default still passes: the openai package's
`parse` with a Pydantic model and LangChain's `with_structured_output(method="json_schema")` name their schema."""

from __future__ import annotations

import pytest

from tests.openai import request_rules
from tests.openai.request_rules import ANSWER, Answer, refused

client = request_rules.client  # the shared fixture, which pytest finds under this module's name

USER = [{"role": "user", "content": "Give x."}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def test_a_json_schema_format_needs_its_name(client):
    body = refused(lambda: client.chat.completions.create(
        model="m", messages=USER, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
        "response_format.json_schema.name")
    assert body["code"] == "missing_required_parameter"
    body = refused(lambda: client.responses.create(
        model="m", input="Give x.", text={"format": {"type": "json_schema", "schema": SCHEMA}}), "text.format.name")
    assert body["code"] == "missing_required_parameter"
    for name, code in ((5, "invalid_type"), ("", "empty_string")):  # given, but not a name: said so, not "missing"
        body = refused(lambda n=name: client.chat.completions.create(model="m", messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": n, "schema": SCHEMA}}), "response_format.json_schema.name")
        assert body["code"] == code and "Missing" not in body["message"], body
        body = refused(lambda n=name: client.responses.create(model="m", input="Give x.", text={
            "format": {"type": "json_schema", "name": n, "schema": SCHEMA}}), "text.format.name")
        assert body["code"] == code and "Missing" not in body["message"], body
    # controls: named, as every SDK sends it
    named = client.chat.completions.create(model="m", messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    assert named.choices[0].message.content == ANSWER
    r = client.responses.create(model="m", input="Give x.",
                                text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    assert r.output_text == ANSWER
    assert client.chat.completions.parse(model="m", messages=USER, response_format=Answer) \
        .choices[0].message.parsed == Answer(x=1)
    assert client.responses.parse(model="m", input="Give x.", text_format=Answer).output_parsed == Answer(x=1)


def test_langchains_structured_output_names_its_schema(client):
    from langchain_openai import ChatOpenAI

    titled = {"title": "Answer", **SCHEMA}
    for responses in (False, True):
        llm = ChatOpenAI(model="m", base_url=client.gateway.base_url, api_key=client.api_key, max_retries=0,
                         use_responses_api=responses)
        assert llm.with_structured_output(Answer, method="json_schema").invoke("Give x.") == Answer(x=1)
        assert llm.with_structured_output(titled, method="json_schema").invoke("Give x.") == {"x": 1}


@pytest.mark.parametrize("metadata, param", [
    ({"a": 1}, "metadata.a"), ({"a": None}, "metadata.a"), ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"), ({"a": "v" * 513}, "metadata.a"), (["a"], "metadata")])
def test_metadata_is_refused_beyond_openais_limits(client, metadata, param):
    refused(lambda: client.chat.completions.create(model="m", messages=USER, metadata=metadata), param)
    refused(lambda: client.responses.create(model="m", input="hi", metadata=metadata), param)


def test_metadata_within_openais_limits_is_taken(client):
    at_limits = {**{f"k{i}": "v" for i in range(14)}, "k" * 64: "v", "a": "v" * 512}
    assert client.chat.completions.create(model="m", messages=USER, metadata=at_limits, store=True).choices
    assert client.responses.create(model="m", input="hi", metadata=at_limits).metadata == at_limits
