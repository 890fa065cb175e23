"""A grammar the tokenizer cannot write (review 5): the tiny model's own vocabulary has no token holding `"`, so a
`response_format` json_schema with a required property reaches a point, after `{`, where the grammar allows no token
at all. That request is a 400 saying so (relax-serve's OpenAI route naming `response_format`, the engine's
/generate likewise; a streamed answer ends with that error, no token drawn at the dead end in it), not a 500 blaming
the weights for the all -inf logits the mask left; other rows of the batch sample on, and the server goes on
serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DEAD = "allows no token of this model's vocabulary"


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_json_schema_the_vocabulary_cannot_write_is_a_400_naming_response_format(engine, client):
    assert '"' not in "".join(engine.tokenizer.convert_ids_to_tokens(range(len(engine.tokenizer))))
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt, max_tokens=20, seed=1)
    body = caught.value.body
    assert body["param"] == "response_format" and body["code"] == "grammar_dead_end", body
    assert body["message"].startswith("response_format: constrained decoding: after 1 token(s)") and DEAD in \
        body["message"], body["message"]
    # streamed: the answer's tokens up to the dead end (the token drawn there is no answer's), then the error
    for seed in range(4):
        seen = []
        with pytest.raises(openai.APIError, match=DEAD):
            for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        response_format=fmt, max_tokens=20, seed=seed, stream=True):
                seen.append(chunk.choices[0].delta.content or "")
        assert "".join(seen) == "{", (seed, seen)
    # the server goes on: a format this vocabulary can write ({} needs no quote) is answered
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"}, max_tokens=20, seed=1)
    assert json.loads(r.choices[0].message.content) == {}


def test_a_stream_read_after_the_dead_end_still_sends_the_answer_first(engine, client, monkeypatch):
    """The stream's reader may first look at the row after the scheduler ended it at its dead end (a loaded machine:
    seen in CI): it still sends the answer's tokens (`{`), then the error, and never the token drawn at the dead
    end. The reader is held here until the request is done, so it reads only then."""
    from relax.serve.sglang.scheduler import Scheduler

    progress = Scheduler.progress

    def late(self, request):
        assert request.done.wait(60), "the request did not end"
        return progress(self, request)

    monkeypatch.setattr(Scheduler, "progress", late)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    seen = []
    with pytest.raises(openai.APIError, match=DEAD):
        for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    response_format=fmt, max_tokens=20, seed=2, stream=True):
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "{", seen


def test_generate_answers_a_dead_end_grammar_with_a_400(engine):
    body = {"text": "hi", "sampling_params": {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 10}}
    request = urllib.request.Request(f"http://127.0.0.1:{engine.port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=120)
    assert caught.value.code == 400
    assert DEAD in json.loads(caught.value.read())["error"]["message"]


def test_a_dead_row_is_left_unmasked_and_ended_while_the_others_are_masked(engine):
    """`mask_logits` and `advance` on two rows of one batch: the row whose grammar allows nothing (after `{`, a
    quote) is marked dead, its logits left finite and the row ended; the other (json_object: `}` may follow `{`)
    keeps its mask and goes on."""
    from relax.rollout.grammar import Grammars, GrammarSpec, advance, json_schema_spec, mask_logits

    tok = engine.tokenizer
    grammars = Grammars(tok, len(tok))
    brace = tok.convert_tokens_to_ids("{")
    dead, live = (grammars.matcher(spec, [tok.eos_token_id])
                  for spec in (json_schema_spec(SCHEMA), GrammarSpec("json_object", "")))
    for m in (dead, live):
        assert m.accept(brace)
    logits = mask_logits(torch.zeros(2, len(tok)), [dead, live])
    assert dead.dead and not live.dead
    assert torch.isfinite(logits[0]).all()  # unmasked: the batch samples on
    assert 0 < int(torch.isfinite(logits[1]).sum()) < len(tok)  # masked as before
    closing = tok.convert_tokens_to_ids("}")
    assert advance([dead, live], torch.tensor([closing, closing]), torch.tensor([True, True])).tolist() == [True, False]
