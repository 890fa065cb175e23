"""The Responses API's sampling and template options, through the official `openai` client over real HTTP (`extra_body`
for the fields the openai package does not type): SGLang's Responses fields that are chat-route fields
(`chat_template_kwargs`, `top_k`, `stop`, penalties, ...) and `seed` go into the chat request as they are, so a
Responses call sends the engine exactly the /generate payload of the chat call with the same options, and is refused
with the chat route's 400 naming the same field; `reasoning.effort: "none"` is SGLang's thinking switch, the chat
route's `reasoning_effort: "none"` (one implementation, tested here on both routes); `request_id` names the response. A
scripted engine behind the training gateway (fast): a "model" on Qwen3's real chat template (tests/agents/templates.py)
that reasons unless its prompt closed the <think> block, as Qwen3 does. That the same seed gives the same answer and
another seed another one on a real sampler: tests/openai/test_responses.py (slow)."""

from __future__ import annotations

import typing

import openai
import pytest
from openai.types.shared_params import Reasoning

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import _byte_level_tokenizer, family_tokenizer
from tests.openai.scripted import limits

QUESTION = "What is 3 + 4?"
USER = [{"role": "user", "content": QUESTION}]
REASONED = "<think>\nadd them\n</think>\n\n7"
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# a reasoning model without the switch (DeepSeek-R1's kind): its generation prompt always opens the block
ALWAYS_THINKS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")


class ThinkingModel:
    """An engine that reasons before answering 7, unless the prompt closed the <think> block (Qwen3's
    enable_thinking=false: `<think>\\n\\n</think>\\n\\n`), then answers 7 at once; records every payload."""

    def __init__(self, fmt: ChatFormat):
        self.fmt, self.payloads = fmt, []

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            self.payloads.append(p)
            closed = self.fmt.decode(p["input_ids"]).endswith("</think>\n\n")
            ids = self.fmt.encode("7" if closed else REASONED) + [min(self.fmt.eos_token_ids)]
            out.append({"meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                      "finish_reason": {"type": "stop"}, "weight_version": "1"}})
        return out


@pytest.fixture
def make():
    """make(tokenizer) -> (engine, client, fmt): a gateway over a ThinkingModel with `tokenizer`, a session opened on it
    and the official client with its key; every gateway closed after the test."""
    made = []

    def build(tok=None):
        tok = tok if tok is not None else family_tokenizer("qwen3")
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        engine = ThinkingModel(fmt)
        gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
        made.append(gw)
        session = gw.open(0, limits(max_calls=64))
        return engine, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0), fmt

    yield build
    for gw in made:
        gw.close()


def rendered(tok, **kwargs) -> str:
    """The Qwen3 template's own render of the question (transformers', not Relax's)."""
    return tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)


def test_thinking_off_renders_the_closed_block_and_answers_without_a_reasoning_item(make):
    """chat_template_kwargs enable_thinking=false and reasoning.effort "none" each render the prompt as Qwen3's
    template renders it with enable_thinking=false, and the answer has no reasoning item (whole and streamed); the
    control, without either, renders the open prompt and answers with the reasoning item."""
    engine, client, fmt = make()
    tok = fmt.tokenizer
    assert rendered(tok) != rendered(tok, enable_thinking=False)  # the switch changes the render
    plain = client.responses.create(model="m", input=QUESTION)
    assert tok.decode(engine.payloads[-1]["input_ids"]) == rendered(tok)
    assert [o.type for o in plain.output] == ["reasoning", "message"]
    assert plain.output[0].content[0].text == "add them" and plain.output_text == "7"
    assert plain.usage.output_tokens_details.reasoning_tokens > 0
    assert plain.reasoning.effort is None  # thinking on, and the template has no effort control: nothing to echo
    for kw in (dict(extra_body=OFF), dict(reasoning={"effort": "none"}),
               dict(reasoning={"effort": "none"}, extra_body={"chat_template_kwargs": {"enable_thinking": False}})):
        r = client.responses.create(model="m", input=QUESTION, **kw)
        assert tok.decode(engine.payloads[-1]["input_ids"]) == rendered(tok, enable_thinking=False), kw
        assert [o.type for o in r.output] == ["message"] and r.output_text == "7", kw
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        assert r.reasoning.effort == "none", kw  # what was applied: thinking off, by the switch or by the effort
        events = list(client.responses.create(model="m", input=QUESTION, stream=True, **kw))
        assert events[0].response.reasoning.effort == events[-1].response.reasoning.effort == "none", kw
        assert not any(e.type.startswith("response.reasoning") for e in events), kw
        assert [o.type for o in events[-1].response.output] == ["message"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "7"


def test_a_responses_call_sends_the_engine_the_payload_of_the_same_chat_call(make):
    """Per option set, the /generate payload of the Responses call is the chat call's with the same options (the
    same code reads them): the seed's random stream, top_k (the run's in a session: counted as an override there),
    stop strings, the template's variables, and the neutral values and no-effect fields changing nothing. The same
    seed gives the same stream twice, another seed another one."""
    engine, client, fmt = make()
    options = [{"seed": 5}, {"seed": 5}, {"seed": 6}, {"top_k": 3}, {"stop": ["7", "eight"]}, OFF,
               {"chat_template_kwargs": {"enable_thinking": True}}, {"frequency_penalty": 0, "presence_penalty": 0.0,
               "min_p": 0, "repetition_penalty": 1, "logit_bias": {}, "skip_special_tokens": True, "session_id": None},
               {"priority": 3, "extra_key": "k", "cache_salt": "salt", "seed": 9}]
    seeds = []
    for extra in options:
        extra = {"seed": 1, **extra}  # (without one, a session draws each call from its own stream)
        client.chat.completions.create(model="m", messages=USER, extra_body=extra)
        chat = engine.payloads[-1]
        client.responses.create(model="m", input=QUESTION, extra_body=extra)
        assert engine.payloads[-1] == chat, extra
        seeds.append(chat["sampling_params"].get("sampling_seed"))
    assert seeds[0] == seeds[1] != seeds[2] and None not in seeds
    assert engine.payloads[-1]["sampling_params"]["sampling_seed"] != seeds[0]
    stop = [p["sampling_params"].get("stop") for p in engine.payloads[8:10]]
    assert stop == [["7", "eight"]] * 2


@pytest.mark.parametrize("kw, param", [
    ({"seed": "five"}, "seed"), ({"seed": 1.5}, "seed"), ({"top_k": 0}, "top_k"), ({"stop": ["a"] * 5}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": 1}, "presence_penalty"),
    ({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 3}}, "logit_bias"), ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"session_id": "s1"}, "session_id"), ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"reasoning": {"effort": "none"}, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"), ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"reasoning": {"context": "all_turns"}}, "reasoning.context"), ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
    ({"reasoning": {"budget": 10}}, "reasoning.budget"), ({"reasoning": "none"}, "reasoning"),
    # the request's own kwargs turn thinking back on: "none" cannot hold
    ({"reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}}, "reasoning.effort"),
    ({"request_id": 7}, "request_id"), ({"request_id": ""}, "request_id"),
    ({"ignore_eos": True}, "ignore_eos"),  # a chat-route field SGLang's Responses route does not take
])
def test_options_that_cannot_be_honoured_get_a_400_naming_them(make, kw, param):
    engine, client, _ = make()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=QUESTION, extra_body=kw)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    assert param in info.value.body["message"]
    assert engine.payloads == []


def test_reasoning_effort_none_is_refused_where_the_template_would_still_reason(make):
    """A reasoning template without the thinking switch (its generation prompt always opens <think>): "none" is a
    400 naming reasoning.effort, nothing sampled; on a template without <think> blocks "none" holds (no reasoning
    item) and is accepted."""
    tok = _byte_level_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = ALWAYS_THINKS
    engine, client, _ = make(tok)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=QUESTION, reasoning={"effort": "none"})
    assert info.value.body["param"] == "reasoning.effort" and engine.payloads == []
    assert [o.type for o in client.responses.create(model="m", input=QUESTION).output] == ["reasoning", "message"]
    plain = _byte_level_tokenizer()
    plain.chat_template = ALWAYS_THINKS.replace("<think>\n", "")
    engine, client, _ = make(plain)
    r = client.responses.create(model="m", input=QUESTION, reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.reasoning.effort == "none"


def test_every_reasoning_key_openai_defines_is_taken_null():
    """The keys of openai's Reasoning param (read from the installed package), each null, are accepted."""
    from relax.serve.openai.responses import parse_request

    every = {k: None for k in typing.get_type_hints(Reasoning)}
    req = parse_request({"model": "m", "input": "hi", "reasoning": every}, lambda rid: [])
    assert "chat_template_kwargs" not in req.chat and req.echo["reasoning"] == {"effort": None, "summary": None}
    req = parse_request({"model": "m", "input": "hi", "reasoning": {**every, "effort": "none"}}, lambda rid: [])
    assert req.chat["reasoning_effort"] == "none" and "chat_template_kwargs" not in req.chat  # the chat route's


def test_request_id_names_the_response_and_continues_it(make):
    """SGLang's and vLLM's request_id: the response's id, whole and streamed, and previous_response_id takes it;
    ngram_corpus_id (SGLang's speculative-decoding corpus) is accepted and changes nothing."""
    engine, client, _ = make()
    r = client.responses.create(model="m", input=QUESTION, extra_body={"request_id": "resp_mine"})
    assert r.id == "resp_mine"
    events = list(client.responses.create(model="m", input=QUESTION, stream=True,
                                          extra_body={"request_id": "resp_streamed", "ngram_corpus_id": "c"}))
    assert events[0].response.id == events[-1].response.id == "resp_streamed"
    chained = client.responses.create(model="m", previous_response_id="resp_mine", input="and 5 + 6?")
    assert chained.previous_response_id == "resp_mine"
    assert QUESTION in engine.fmt.decode(engine.payloads[-1]["input_ids"])


# ------------------------------------------------------------------ the chat route's reasoning_effort (SGLang's)
def _reasoning(message) -> typing.Any:
    return getattr(message, "reasoning_content", None)


def test_chat_reasoning_effort_none_renders_the_closed_block_and_answers_without_reasoning(make):
    """reasoning_effort="none" on the chat route (the official client's own argument) renders the prompt as Qwen3's
    template renders it with enable_thinking=false, and no reasoning_content comes back (whole and streamed), with
    other chat_template_kwargs beside it too; the control, without it, renders the open prompt and reasons. A
    Responses call with reasoning.effort "none" sends the engine the same payload (one implementation)."""
    engine, client, fmt = make()
    tok = fmt.tokenizer
    plain = client.chat.completions.create(model="m", messages=USER)
    assert tok.decode(engine.payloads[-1]["input_ids"]) == rendered(tok)
    assert (_reasoning(plain.choices[0].message), plain.choices[0].message.content) == ("add them", "7")
    for extra in (None, {"chat_template_kwargs": {"enable_thinking": False}}, {"seed": 3}):
        r = client.chat.completions.create(model="m", messages=USER, reasoning_effort="none", extra_body=extra)
        assert tok.decode(engine.payloads[-1]["input_ids"]) == rendered(tok, enable_thinking=False), extra
        assert _reasoning(r.choices[0].message) is None and r.choices[0].message.content == "7", extra
        chunks = list(client.chat.completions.create(model="m", messages=USER, reasoning_effort="none", stream=True,
                                                     extra_body=extra))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not any(_reasoning(d) for d in deltas) and "".join(d.content or "" for d in deltas) == "7", extra
    client.chat.completions.create(model="m", messages=USER, reasoning_effort="none", seed=5)
    chat = engine.payloads[-1]
    client.responses.create(model="m", input=QUESTION, reasoning={"effort": "none"}, extra_body={"seed": 5})
    assert engine.payloads[-1] == chat


@pytest.mark.parametrize("effort", ["low", "medium", "high", "minimal", 0.5])
def test_chat_reasoning_efforts_other_than_none_get_a_400_naming_reasoning_effort(make, effort):
    engine, client, _ = make()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, reasoning_effort=effort)
    assert info.value.body["param"] == "reasoning_effort" and "reasoning_effort" in info.value.body["message"]
    assert engine.payloads == []


def test_chat_reasoning_effort_none_is_refused_where_the_template_would_still_reason(make):
    """An R1-style template (no thinking switch: its generation prompt always opens <think>): "none" is a 400 naming
    reasoning_effort, nothing sampled, whole or streamed; so is "none" beside the request's own enable_thinking=true
    on Qwen3's template. On a template without <think> blocks "none" holds and is accepted."""
    tok = _byte_level_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = ALWAYS_THINKS
    engine, client, _ = make(tok)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=USER, reasoning_effort="none", stream=stream)
        assert info.value.body["param"] == "reasoning_effort" and "reasoning_effort" in info.value.body["message"]
    assert engine.payloads == []
    engine, client, _ = make()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, reasoning_effort="none",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert info.value.body["param"] == "reasoning_effort" and engine.payloads == []
    plain = _byte_level_tokenizer()
    plain.chat_template = ALWAYS_THINKS.replace("<think>\n", "")
    engine, client, _ = make(plain)
    r = client.chat.completions.create(model="m", messages=USER, reasoning_effort="none")
    assert _reasoning(r.choices[0].message) is None and len(engine.payloads) == 1


def test_completions_take_reasoning_effort_null_only():
    """A completion renders no chat template: reasoning_effort other than null is a 400 naming it."""
    from relax.serve.openai.protocol import APIError, parse_completion

    parse_completion({"model": "m", "prompt": "hi", "reasoning_effort": None})
    with pytest.raises(APIError) as info:
        parse_completion({"model": "m", "prompt": "hi", "reasoning_effort": "none"})
    assert info.value.param == "reasoning_effort"
