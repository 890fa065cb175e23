"""Fields the installed `openai` package's `chat.completions.create` defines, sent by the official client over real
HTTP: `prompt_cache_retention` and `prompt_cache_options` (cache hints, which openai-agents sends on Chat Completions
when ModelSettings sets them) are accepted without effect, as on the Responses route, and `moderation` is accepted
null and refused otherwise with a 400 naming it, as on the Responses route; on the training gateway (a scripted
engine, fast) and on relax-serve (the embedded engine with the tiny model, slow). Every field of the SDK's
`chat.completions.create` is in `relax.serve.openai.protocol.FIELDS`."""

from __future__ import annotations

import inspect

import openai
import pytest

from relax.serve.openai.protocol import FIELDS

USER = [{"role": "user", "content": "What is 3 + 4?"}]
HINTS = {"prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
         "moderation": None}
MODERATION = {"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}}


def test_every_field_of_the_sdks_chat_create_is_in_the_table():
    sdk = set(inspect.signature(openai.resources.chat.Completions.create).parameters)
    sdk -= {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    assert sorted(n for n in sdk if n not in FIELDS or "chat" not in FIELDS[n].on) == []


def check(client: openai.OpenAI, **kw) -> None:
    """The cache hints change nothing (the same answer as without them, same seed); moderation set is a 400 naming it,
    on chat as on the Responses route."""
    plain = client.chat.completions.create(messages=USER, seed=3, **kw)
    hinted = client.chat.completions.create(messages=USER, seed=3, **HINTS, **kw)
    assert hinted.choices[0].message == plain.choices[0].message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=USER, moderation=MODERATION, **kw)
    assert info.value.body["param"] == "moderation" and "no moderation" in info.value.body["message"]


def test_the_training_gateway_takes_the_sdks_cache_fields_on_chat(smol, scripted_gateway):
    gw, script, session, client = scripted_gateway(smol, ["7"])
    check(client, model="policy")
    assert len(script.calls) == 2  # the refused request reached no engine
    r = client.responses.create(model="policy", input="What is 3 + 4?", prompt_cache_retention="24h")
    assert r.output_text == "7"  # the Responses route takes them already: the same verdicts
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="policy", input="hi", extra_body={"moderation": MODERATION})
    assert info.value.body["param"] == "moderation"


@pytest.mark.slow
def test_relax_serve_takes_the_sdks_cache_fields_on_chat(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    check(client, model="tiny", max_tokens=4)
