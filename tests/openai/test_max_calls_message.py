"""An agent on the default rollout.max_turns=1 that makes a second call (a tool loop) is answered 400 `max_calls`,
whose message names rollout.max_turns and its value, through the official `openai` client; the session ends
`max_turns` and keeps its first answer (what a run trains on)."""

from __future__ import annotations

import openai
import pytest

from relax.data.tokenizer import build_tiny_tokenizer
from relax.serve.openai.chat import ChatFormat
from tests.openai.scripted import limits


def test_the_second_call_of_a_one_call_session_names_rollout_max_turns(scripted_gateway):
    tok = build_tiny_tokenizer()
    gw, script, _, _ = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["a b"])
    session = gw.open(1, limits(max_calls=1))  # rollout.max_turns=1, the default
    client = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[*messages, {"role": "assistant", "content": first},
                                                            {"role": "user", "content": "more"}])
    body = caught.value.body
    assert body["code"] == "max_calls" and "rollout.max_turns=1" in body["message"], body
    assert session.ended == "max_turns" and session.trajectory().answers == [first]
    assert len(script.calls) == 1  # the engine ran the first call only
