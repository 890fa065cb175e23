"""A response_format (Responses: text.format) whose JSON schema xgrammar cannot compile is a 400 naming the request's
field, `param` "response_format" / "text.format", on relax-serve and on the training gateway, with the official
`openai` client; before, relax-serve's answer named its engine's /generate field (`sampling_params.json_schema`, param
null) and the gateway's scripted engine, which compiles nothing, answered 200."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("xgrammar")

from relax.data.tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer  # noqa: E402
from relax.serve.openai.chat import ChatFormat  # noqa: E402
from tests.openai.serving import tiny_server  # noqa: E402

USER = [{"role": "user", "content": "hi"}]
BAD = {"type": "nope"}  # a type JSON schema does not have: xgrammar refuses it


def _chat(client: openai.OpenAI, schema: dict) -> None:
    client.chat.completions.create(model="m", messages=USER, max_tokens=2, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def _responses(client: openai.OpenAI, schema: dict) -> None:
    client.responses.create(model="m", input="hi", max_output_tokens=16, text={
        "format": {"type": "json_schema", "name": "x", "schema": schema}})


def _refused(call, client: openai.OpenAI, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call(client, BAD)
    err = caught.value
    assert err.param == param and err.body["param"] == param, err.body
    message = err.body["message"]
    assert message.startswith(f"{param}: the json_schema does not compile: "), message
    assert "nope" in message and "sampling_params" not in message and ".cc:" not in message, message


@pytest.fixture(scope="module")
def serve_client(tmp_path_factory):
    tok = build_tiny_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    with tiny_server(tmp_path_factory.mktemp("tok"), tok) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("call,param", [(_chat, "response_format"), (_responses, "text.format")])
def test_relax_serve_names_the_format(serve_client, call, param):
    _refused(call, serve_client, param)
    call(serve_client, {"type": "object"})  # a schema that compiles is answered


@pytest.mark.parametrize("call,param", [(_chat, "response_format"), (_responses, "text.format")])
def test_the_gateway_names_the_format(scripted_gateway, call, param):
    tok = build_tiny_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    gw, script, session, client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["{}"])
    _refused(call, client, param)
    assert script.calls == []  # refused before the engine ran
