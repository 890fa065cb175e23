"""`chat_template_kwargs` keys the chat template never reads are a 400 naming the key and the variables the template
does read (a misspelt `enable_thinkng` used to be accepted and change nothing), on the chat route and the Responses
route (which passes chat_template_kwargs on), through the official `openai` client against a training gateway over a
scripted engine. What the template reads is decided from the template itself (jinja2's undeclared variables), so the
check is independent: the Qwen3 fixture's template text holds `enable_thinking`, and the key it reads changes the
render transformers makes, while a template without the variable (ChatML) takes no key at all. Keys that name
apply_chat_template's own arguments keep their own 400; the keys reasoning_effort "none" adds (both thinking switches)
are the server's, never refused.

Negative control: with `ChatFormat.check_template_kwargs` returning at once (the old behaviour), the misspelt key
was answered 200 (`test_a_misspelt_key_is_a_400_naming_it_and_the_template_s_variables` failed: DID NOT RAISE).
"""

from __future__ import annotations

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import family_tokenizer
from tests.openai.scripted import Script, limits

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture
def make():
    """make(family) -> (client, script, fmt): a gateway over a scripted engine answering "7" with the family's
    tokenizer, a session on it and the official client with its key."""
    made = []

    def build(family: str = "qwen3"):
        tok = family_tokenizer(family)
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        script = Script(fmt, ["7"])
        gw = Gateway(OpenAIService(fmt, script, model="policy", context_length=None, max_tokens=16)).start()
        made.append(gw)
        session = gw.open(0, limits(max_calls=64))
        return openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0), script, fmt

    yield build
    for gw in made:
        gw.close()


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


def test_a_misspelt_key_is_a_400_naming_it_and_the_template_s_variables(make):
    client, script, fmt = make("qwen3")
    tok = fmt.tokenizer
    assert "enable_thinking" in tok.chat_template  # independent of jinja2: the variable is in the template's text
    # the key the template reads changes transformers' own render; the misspelt one would not
    assert tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=False) != \
        tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinkng=False) == \
        tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    body = refused(lambda: client.chat.completions.create(
        model="m", messages=USER, extra_body={"chat_template_kwargs": {"enable_thinkng": False}}))
    assert body["param"] == "chat_template_kwargs"
    assert "'enable_thinkng'" in body["message"] and "enable_thinking" in body["message"]
    assert "messages" not in body["message"].split("reads:")[1]  # apply_chat_template's own arguments not offered
    calls = len(script.calls)
    # the Responses route passes chat_template_kwargs on: the same 400, nothing sampled for either
    body = refused(lambda: client.responses.create(
        model="m", input="hi", extra_body={"chat_template_kwargs": {"enable_thinking": False, "enable_thinkng": 1}}))
    assert body["param"] == "chat_template_kwargs" and "'enable_thinkng'" in body["message"]
    assert "'enable_thinking'" not in body["message"].split("reads:")[0]  # the good key is not called unknown
    assert len(script.calls) == calls == 0
    # the key it reads is taken, alone or beside reasoning_effort "none" (which adds `thinking` too)
    r = client.chat.completions.create(model="m", messages=USER,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "7"
    closed = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert script.calls[-1][0]["input_ids"] == fmt.encode(closed)
    client.chat.completions.create(model="m", messages=USER, reasoning_effort="none")
    assert script.calls[-1][0]["input_ids"] == fmt.encode(closed)


def test_a_template_without_variables_takes_no_key(make):
    """ChatML (SmolLM2's family fixture) reads no variable of its own: any key is a 400 saying so."""
    client, _, fmt = make("smollm2_chatml")
    assert "enable_thinking" not in fmt.tokenizer.chat_template
    body = refused(lambda: client.chat.completions.create(
        model="m", messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert body["param"] == "chat_template_kwargs" and "'enable_thinking'" in body["message"]
    assert "none besides the messages and tools" in body["message"]


def test_apply_chat_template_s_own_arguments_keep_their_400(make):
    client, _, _ = make("qwen3")
    body = refused(lambda: client.chat.completions.create(
        model="m", messages=USER, extra_body={"chat_template_kwargs": {"tokenize": True}}))
    assert body["param"] == "chat_template_kwargs" and "set by the server" in body["message"]
