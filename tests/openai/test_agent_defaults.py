"""What agent frameworks send by default, through the official `openai` client over real HTTP: chat_template_kwargs
reaching the chat template (and a session's later calls), a <think> block split into reasoning_content, SGLang's
extension fields accepted or refused as `relax.serve.openai.protocol.FIELDS` says, the default answer limit (the
room left, not 128), and stop strings that stop the engine (a negative control with the old cut-after behaviour).

The template and reasoning tests use a scripted engine (fast); the others an embedded server (slow)."""

from __future__ import annotations

import threading

import openai
import pytest

from relax.data.tokenizer import build_tiny_tokenizer
from relax.rollout.sglang.client import GenerateClient
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import DEFAULT_MAX_TOKENS, OpenAIService
from relax.serve.openai.sessions import Limits

USER = [{"role": "user", "content": "What is 3 + 4?"}]
FOLLOW_UP = {"role": "user", "content": "what is 5 + 6?"}
# Qwen3's switch: enable_thinking=false writes an empty think block after the generation prompt
QWEN3_LIKE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
              "{% endif %}{% endif %}")
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def limits(**kw) -> Limits:
    return Limits(**{"max_calls": 8, "max_tokens": 400, "max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0,
                     "top_k": -1, "seed": 0, **kw})


class Scripted:
    """An engine that answers every /generate payload with `answer` (text, then the stop token), recording them."""

    def __init__(self, fmt: ChatFormat, answer: str):
        self.fmt, self.answer, self.payloads = fmt, answer, []

    def __call__(self, payloads: list[dict]) -> list[dict]:
        self.payloads += payloads
        ids = self.fmt.encode(self.answer) + [min(self.fmt.eos_token_ids)]
        return [{"meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                               "finish_reason": {"type": "stop", "matched": ids[-1]}, "weight_version": "1"}}
                for _ in payloads]


@pytest.fixture
def scripted():
    """(make(answer, template) -> (gateway, engine, session, client)); every gateway closed after the test."""
    made = []

    def make(answer: str, template: str = QWEN3_LIKE):
        tok = build_tiny_tokenizer()
        tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
        tok.chat_template = template
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        engine = Scripted(fmt, answer)
        gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
        made.append(gw)
        session = gw.open(0, limits())
        return gw, engine, session, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)

    yield make
    for gw in made:
        gw.close()


def test_chat_template_kwargs_reach_the_template_and_every_call_of_the_session(scripted):
    gw, engine, session, client = scripted("7")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="m", messages=USER, extra_body=off)
    decode = gw.service.fmt.tokenizer.decode
    assert decode(engine.payloads[-1]["input_ids"]).endswith(EMPTY_THINK)
    messages = USER + [r.choices[0].message.model_dump(exclude_none=True), FOLLOW_UP]
    client.chat.completions.create(model="m", messages=messages, extra_body=off)  # extends: rendered the same way
    assert session.segments == 1 and decode(engine.payloads[-1]["input_ids"]).endswith(EMPTY_THINK)
    client.chat.completions.create(model="m", messages=messages)  # no kwargs: a prompt rendered otherwise
    assert session.segments == 2 and not decode(engine.payloads[-1]["input_ids"]).endswith(EMPTY_THINK)
    for bad in ("enable_thinking=false", ["enable_thinking"], {"tokenize": True}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=USER, extra_body={"chat_template_kwargs": bad})
        assert info.value.body["param"] == "chat_template_kwargs"


def test_a_think_block_is_reasoning_content_whole_and_streamed(scripted):
    answer = "<think>\nwhat is 3 + 4\n</think>\n\n7"
    gw, engine, session, client = scripted(answer)
    r = client.chat.completions.create(model="m", messages=USER, logprobs=True)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("what is 3 + 4", "7")
    # the trained tokens are the sampled ones, the think block included; the answer as the client got it (content
    # without the block) continues the conversation
    t = session.trajectory()
    assert gw.service.fmt.tokenizer.decode(t.tokens, skip_special_tokens=True) == answer and all(t.sampled)
    client.chat.completions.create(model="m", messages=USER + [message.model_dump(exclude_none=True), FOLLOW_UP])
    assert session.segments == 1
    chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "what is 3 + 4"
    assert "".join(d.content or "" for d in deltas) == "7"
    assert sum(bool(getattr(d, "reasoning_content", None)) for d in deltas) > 1  # token by token
    whole = client.chat.completions.create(model="m", messages=USER, extra_body={"separate_reasoning": False})
    assert whole.choices[0].message.content == answer
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None
    # a template without <think>: the answer is left as it is
    _, _, _, plain = scripted(answer, template=build_tiny_tokenizer().chat_template)
    assert plain.chat.completions.create(model="m", messages=USER).choices[0].message.content == answer


# ------------------------------------------------------------------------------------- an embedded server

class Recorder:
    """The engine side of a gateway: every /generate payload and answer; `drop_stop` sends the payloads without
    their stop strings (the old behaviour: the text was cut after the engine ran to its limit)."""

    def __init__(self, url: str, drop_stop: bool = False):
        self.client, self.drop_stop = GenerateClient(url, request_timeout_s=120), drop_stop
        self.calls: list[tuple[dict, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, payloads: list[dict]) -> list[dict]:
        if self.drop_stop:
            payloads = [{**p, "sampling_params": {k: v for k, v in p["sampling_params"].items() if k != "stop"}}
                        for p in payloads]
        answers = self.client.generate(payloads)
        with self.lock:
            self.calls += list(zip(payloads, answers, strict=True))
        return answers


def gateway(engine, **kw) -> tuple[Gateway, Recorder]:
    recorder = Recorder(engine.url, **kw)
    fmt = ChatFormat(engine.tokenizer, engine.eos_token_ids)
    return Gateway(OpenAIService(fmt, recorder, model="policy", context_length=None, max_tokens=300)).start(), recorder


ACCEPTED = {"rid": "r1", "no_stop_trim": False, "return_hidden_states": False, "stream_reasoning": True,
            "separate_reasoning": True, "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "regex": None,
            "lora_path": None, "session_params": None, "chat_template_kwargs": {}, "priority": 3, "top_k": -1}
REFUSED = [("min_p", 0.1), ("repetition_penalty", 1.1), ("min_tokens", 2), ("return_hidden_states", True),
           ("regex", 5), ("json_schema", {"type": "object"}), ("ebnf", ["a"]), ("lora_path", "a"),
           ("skip_special_tokens", False), ("session_params", {"id": "s"}), ("stop_token_ids", [1]),
           ("custom_logit_processor", "x"), ("top_k", 0)]


@pytest.mark.slow
def test_sglang_extension_fields_are_accepted_or_refused_per_the_table(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny", messages=USER, max_tokens=4, seed=3)
    plain = client.chat.completions.create(**kw)
    assert client.chat.completions.create(**kw, extra_body=ACCEPTED).choices[0].message == plain.choices[0].message
    for name, value in REFUSED:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**kw, extra_body={name: value})
        assert info.value.body["param"] == name
    # top_k is honoured: top_k=1 is the greedy answer
    greedy = client.chat.completions.create(**kw, temperature=0)
    assert client.chat.completions.create(**kw, extra_body={"top_k": 1}).choices[0].message.content == \
        greedy.choices[0].message.content


@pytest.mark.slow
def test_the_default_answer_limit_is_the_room_left(engine):
    """relax-serve: the context minus the prompt (ignore_eos: the answer reaches it); the gateway: the smaller of
    rollout.max_response_len and what the episode has left. The old default, 128, is neither."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="tiny", prompt="What is", seed=1, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == engine.context_length - r.usage.prompt_tokens != DEFAULT_MAX_TOKENS
    gw, recorder = gateway(engine)
    try:
        session = gw.open(0, limits(max_new_tokens=300, max_tokens=310))
        agent = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0, timeout=120)
        first = agent.chat.completions.create(model="m", messages=USER)
        assert recorder.calls[-1][0]["sampling_params"]["max_new_tokens"] == 300 != DEFAULT_MAX_TOKENS
        messages = USER + [first.choices[0].message.model_dump(exclude_none=True), FOLLOW_UP]
        agent.chat.completions.create(model="m", messages=messages)
        used = len(recorder.calls[-1][0]["input_ids"]) - len(recorder.calls[0][0]["input_ids"])
        assert recorder.calls[-1][0]["sampling_params"]["max_new_tokens"] == 310 - used
    finally:
        gw.close()


@pytest.mark.slow
def test_a_stop_string_stops_the_engine(engine):
    """The engine generates the tokens up to the one that completes the stop string, and the session trains exactly
    those; negative control: without the stop strings at the engine (the old behaviour) it runs to the limit."""
    limit, counts = 24, {}
    for drop in (False, True):
        gw, recorder = gateway(engine, drop_stop=drop)
        try:
            session = gw.open(0, limits())
            agent = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0, timeout=120)
            kw = dict(model="m", messages=USER, max_tokens=limit, extra_body={"ignore_eos": True})
            free = agent.chat.completions.create(**kw, seed=5)
            text = free.choices[0].message.content
            stop = text[len(text) // 2]
            # the same sample's stream (the same text) in a session of its own: its sample is this call alone
            session = gw.open(0, limits())
            agent = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0, timeout=120)
            cut = agent.chat.completions.create(**kw, seed=5, stop=[stop])
            generated = len(recorder.calls[-1][1]["meta_info"]["output_token_logprobs"])
            assert cut.choices[0].message.content == text[:text.index(stop)]
            assert cut.choices[0].finish_reason == "stop"
            counts[drop] = (generated, cut.usage.completion_tokens)
            t = session.trajectory()  # exactly what the engine generated, all trained
            out = [q[1] for q in recorder.calls[-1][1]["meta_info"]["output_token_logprobs"]]
            if not drop:
                assert t.tokens == out and all(t.sampled)
        finally:
            gw.close()
    (stopped, answered), (old, old_answered) = counts[False], counts[True]
    assert stopped == answered == old_answered < limit == old
