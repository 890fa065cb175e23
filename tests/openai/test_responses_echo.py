"""The Responses object echoes the request's settings as OpenAI does: what was applied, OpenAI's documented default
where the request left a field out or sent null (`text.verbosity` "medium", `temperature` 1, `top_p` 1, `tool_choice`
"auto", `parallel_tool_calls` true, `store` true, `top_logprobs` 0, `truncation` "disabled", `background` false,
`service_tier` "default"), whole and streamed (`response.created` and `response.completed`), read by the official
`openai` client. The sampling echoed is checked against what the engine was sent (its /generate sampling_params):
outside a session the request's, or 1 and 1 where it gave none; in a training session the run's, whatever the
request asked.

Negative control: on the old code `text.verbosity`, `temperature`, `top_p` and `top_logprobs` were echoed null and
`background`, `service_tier` not at all (`test_defaults_are_echoed_as_openai_echoes_them` failed: {'temperature':
None} != {'temperature': 1.0}, top_p, background, service_tier likewise; the session test: temperature None, not the
run's 0.7).
"""

from __future__ import annotations

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import family_tokenizer
from tests.openai.plain_http import plain_server
from tests.openai.scripted import Script, limits

openai = pytest.importorskip("openai")

DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "parallel_tool_calls": True, "store": True,
            "top_logprobs": 0, "truncation": "disabled", "background": False, "service_tier": "default"}


def echoed(r) -> dict:
    return {**{k: getattr(r, k) for k in DEFAULTS}, "verbosity": r.text.verbosity, "format": r.text.format.type}


@pytest.fixture(scope="module")
def fmt():
    tok = family_tokenizer("smollm2_chatml")
    return ChatFormat(tok, (tok.eos_token_id,))


@pytest.fixture
def served(fmt):
    script = Script(fmt, ["7"])
    with plain_server(OpenAIService(fmt, script, model="m", context_length=None, max_tokens=16)) as url:
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0), script


def test_defaults_are_echoed_as_openai_echoes_them(served):
    client, script = served
    expected = {**DEFAULTS, "verbosity": "medium", "format": "text"}
    assert echoed(client.responses.create(model="m", input="hi")) == expected
    sp = script.calls[-1][0]["sampling_params"]
    assert (sp["temperature"], sp["top_p"]) == (1.0, 1.0)  # what the engine sampled at
    nulls = {k: None for k in ("temperature", "top_p", "parallel_tool_calls", "store", "top_logprobs", "truncation")}
    assert echoed(client.responses.create(model="m", input="hi", extra_body=nulls)) == expected
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert echoed(events[0].response) == echoed(events[-1].response) == expected


def test_given_values_are_echoed(served):
    client, script = served
    r = client.responses.create(model="m", input="hi", temperature=0.5, top_p=0.75, store=False,
                                parallel_tool_calls=False, text={"verbosity": "medium"}, truncation="auto",
                                max_output_tokens=4, service_tier="auto")
    sp = script.calls[-1][0]["sampling_params"]
    assert (r.temperature, r.top_p) == (sp["temperature"], sp["top_p"]) == (0.5, 0.75)
    assert (r.store, r.parallel_tool_calls, r.text.verbosity, r.truncation, r.max_output_tokens) == (
        False, False, "medium", "auto", 4)
    assert r.service_tier == "default"  # the tier that served it (one tier here), as OpenAI echoes "auto"


def test_a_training_session_echoes_the_run_s_sampling(fmt):
    script = Script(fmt, ["7"])
    gw = Gateway(OpenAIService(fmt, script, model="policy", context_length=None, max_tokens=16)).start()
    try:
        session = gw.open(0, limits(temperature=0.7, top_p=0.9))
        client = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
        r = client.responses.create(model="m", input="hi", temperature=0.2)
        sp = script.calls[-1][0]["sampling_params"]
        assert (r.temperature, r.top_p) == (sp["temperature"], sp["top_p"]) == (0.7, 0.9)
        events = list(client.responses.create(model="m", input="hi", stream=True))
        assert (events[0].response.temperature, events[-1].response.top_p) == (0.7, 0.9)
    finally:
        gw.close()
