"""The training gateway's sessions, driven by the official `openai` client over real HTTP, the engine an embedded
server answering `/generate` over HTTP (as in training): every call of a session is seen at the engine, so a
trajectory can be checked against what the engine was actually asked and actually sampled."""

from __future__ import annotations

import json
import threading

import openai
import pytest
import requests

from relax.rollout.sglang.client import GenerateClient
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.protocol import normalize_message
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import Limits

# an engine server, real HTTP; its tests share the module-scoped server: one xdist worker runs them in a row
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gateway")]

FOLLOW_UP = {"role": "user", "content": "what is the final answer"}
USER = [{"role": "user", "content": "What is 3 + 4?"}]


class Recorder:
    """The engine side of the gateway: every /generate payload and answer, in order."""

    def __init__(self, url: str):
        self.client = GenerateClient(url, request_timeout_s=60)
        self.calls: list[tuple[dict, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, payloads: list[dict]) -> list[dict]:
        answers = self.client.generate(payloads)
        with self.lock:
            self.calls += list(zip(payloads, answers, strict=True))
        return answers


@pytest.fixture
def gateway(engine):
    recorder = Recorder(engine.url)
    fmt = ChatFormat(engine.tokenizer, engine.eos_token_ids)
    gw = Gateway(OpenAIService(fmt, recorder, model="policy", context_length=None, max_tokens=8)).start()
    gw.recorder, gw.fmt = recorder, fmt
    yield gw
    gw.close()


def limits(**kw) -> Limits:
    return Limits(**{"max_calls": 8, "max_tokens": 400, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                     "top_k": -1, "seed": 0, **kw})


def converse(gw: Gateway, session, turns: int = 3, first=USER) -> list[dict]:
    """A conversation as an agent has it: each answer appended as the client returned it, then a follow-up."""
    client = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
    messages = list(first)
    for _ in range(turns):
        answer = client.chat.completions.create(model="any", messages=messages, max_tokens=6).choices[0].message
        messages += [answer.model_dump(exclude_none=True), FOLLOW_UP]
    return messages


def trains_what_was_sampled(trajectory, calls: list[tuple[dict, dict]]) -> bool:
    """Whether the trajectory is exactly what the engine saw and sampled: each call's input is the trajectory up to
    that call, its answer's tokens follow, trained (mask 1) with the engine's log-probs, and nothing else is."""
    context, sampled = trajectory.prompt + trajectory.tokens, [0] * len(trajectory.prompt) + trajectory.sampled
    logprobs = [0.0] * len(trajectory.prompt) + trajectory.logprobs
    trained = 0
    for payload, answer in calls:
        ids = payload["input_ids"]
        out = [p[1] for p in answer["meta_info"]["output_token_logprobs"]]
        lps = [p[0] for p in answer["meta_info"]["output_token_logprobs"]]
        end = len(ids) + len(out)
        if context[:len(ids)] != ids or context[len(ids):end] != out or sampled[len(ids):end] != [1] * len(out):
            return False
        if logprobs[len(ids):end] != pytest.approx(lps, abs=1e-6):
            return False
        trained += len(out)
    return trained == sum(sampled)


def test_a_three_turn_conversation_trains_exactly_the_sampled_tokens(gateway):
    """Over several seeds: the trajectory is what the engine saw and sampled, call after call; in at least one of
    them the chat template applied to the final conversation tokenizes differently (the tiny tokenizer fuses
    consecutive sampled words), and the check fails on that re-rendered version (the negative control)."""
    differs = 0
    for seed in range(6):
        gateway.recorder.calls.clear()
        session = gateway.open(seed, limits(seed=seed))
        messages = converse(gateway, session)
        t = session.trajectory()
        assert session.segments == 1 and len(t.answers) == 3 and len(gateway.recorder.calls) == 3
        assert trains_what_was_sampled(t, gateway.recorder.calls)
        # what a gateway that renders every call's conversation again would have sent for the last call
        last_input, last_answer = gateway.recorder.calls[-1]
        rerendered = gateway.fmt.prompt([normalize_message(m) for m in messages[:-2]], None)
        if rerendered != last_input["input_ids"]:
            differs += 1
            out = [p[1] for p in last_answer["meta_info"]["output_token_logprobs"]]
            naive = rerendered + out  # its trajectory: the answers of earlier calls as re-tokenized
            t.tokens, t.sampled = naive[len(t.prompt):], (t.sampled + [0] * len(naive))[:len(naive) - len(t.prompt)]
            t.logprobs = (t.logprobs + [0.0] * len(naive))[:len(t.tokens)]
            assert not trains_what_was_sampled(t, gateway.recorder.calls)
    assert differs >= 1


def test_an_edited_history_starts_a_new_segment(gateway):
    """The edited call's prompt is rendered whole; the sample is the segment holding more sampled tokens (the later
    one on a tie), the other trains in a row of its own (each row's context its own segment's)."""
    gateway.recorder.calls.clear()
    session = gateway.open(1, limits())
    client = openai.OpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
    first = client.chat.completions.create(model="m", messages=USER, max_tokens=4).choices[0].message
    edited = USER + [{"role": "assistant", "content": (first.content or "") + " is"}, FOLLOW_UP]
    client.chat.completions.create(model="m", messages=edited, max_tokens=4)
    t = session.trajectory()
    assert (session.segments, session.branches) == (2, 2)
    rendered = gateway.fmt.prompt([normalize_message(m) for m in edited], None)
    assert gateway.recorder.calls[1][0]["input_ids"] == rendered  # rendered whole
    sizes = [len(a["meta_info"]["output_token_logprobs"]) for _, a in gateway.recorder.calls]
    assert t.prompt == (rendered if sizes[1] >= sizes[0] else gateway.fmt.prompt(USER, None))
    assert len(t.answers) == 1 and sum(t.sampled) == len(t.tokens) == max(sizes)
    assert session.token_counts() == (sum(sizes), sum(sizes))
    main, other = session.rows()
    assert other.prompt == (gateway.fmt.prompt(USER, None) if sizes[1] >= sizes[0] else rendered)
    assert (sum(main.sampled), sum(other.sampled)) == (max(sizes), sum(sizes) - max(sizes))


def test_the_continued_choice_is_the_trajectory(gateway):
    session = gateway.open(2, limits())
    client = openai.OpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=6, n=2)
    assert r.choices[0].message.content != r.choices[1].message.content
    client.chat.completions.create(model="m", messages=USER + [r.choices[1].message.model_dump(exclude_none=True),
                                                               FOLLOW_UP], max_tokens=4)
    t = session.trajectory()
    assert session.segments == 1 and t.answers[0] == r.choices[1].message.content


def test_limits_keys_and_ended_sessions(gateway):
    session = gateway.open(3, limits(max_calls=2))
    with pytest.raises(openai.BadRequestError) as info:
        converse(gateway, session, turns=3)
    assert info.value.body["code"] == "max_calls" and session.ended == "max_turns"
    assert len(session.trajectory().answers) == 2  # what it did before the limit stays
    with pytest.raises(openai.PermissionDeniedError):  # the session has ended
        converse(gateway, session, turns=1)
    with pytest.raises(openai.AuthenticationError):
        converse(gateway, type("S", (), {"key": "relax-not-a-session"})(), turns=1)
    short = gateway.open(4, limits(max_tokens=10))
    with pytest.raises(openai.BadRequestError) as info:
        converse(gateway, short, turns=5)
    assert info.value.body["code"] == "max_tokens" and short.ended == "length"
    gateway.forget([session])
    with pytest.raises(openai.AuthenticationError):
        converse(gateway, session, turns=1)


def test_the_run_samples_with_its_own_parameters_and_seeds(gateway):
    """A session's calls sample at the run's temperature and top_p whatever the agent asks (counted), with the
    stream of (run seed, sample id, call): the same run gives the same answers."""
    answers = []
    for _ in range(2):
        gateway.recorder.calls.clear()
        session = gateway.open(7, limits(temperature=0.7, top_p=0.9, seed=5))
        client = openai.OpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
        answers.append(client.chat.completions.create(model="m", messages=USER, max_tokens=6,
                                                      temperature=0.1).choices[0].message.content)
        client.chat.completions.create(model="m", messages=USER, max_tokens=2)  # asks nothing: not an override
        sp = gateway.recorder.calls[0][0]["sampling_params"]
        assert (sp["temperature"], sp["top_p"], session.overrides) == (0.7, 0.9, 1)
    assert answers[0] == answers[1]


def test_rewards_per_call(gateway):
    """POST /v1/relax/reward adds to the latest call's reward; the calls outside the trained branch hand their
    rewards to its first call."""
    session = gateway.open(8, limits())
    client = openai.OpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
    headers = {"Authorization": f"Bearer {session.key}"}

    def reward(value) -> requests.Response:
        return requests.post(gateway.base_url + "/relax/reward", json={"reward": value}, headers=headers, timeout=10)

    messages = list(USER)
    for value in (0.5, 2):
        answer = client.chat.completions.create(model="m", messages=messages, max_tokens=4).choices[0].message
        messages += [answer.model_dump(exclude_none=True), FOLLOW_UP]
        assert reward(value).status_code == 200
    assert session.trajectory().rewards == [0.5, 2.0]
    bad = reward("high")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
    client.chat.completions.create(model="m", messages=USER + [FOLLOW_UP], max_tokens=4)  # an edit: a new segment
    reward(1)
    # the sample is one segment (the one with more sampled tokens); the other's rewards go to its first call
    assert session.segments == 2 and session.trajectory().rewards in ([1.5, 2.0], [3.5])


@pytest.fixture(scope="module")
def smol_format():
    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer, stop_token_ids

    cfg = load_config(["model=smollm2_135m"])
    tok = load_tokenizer(cfg.model)
    return ChatFormat(tok, tuple(stop_token_ids(cfg.model, tok)))


def test_tool_calls_round_trip_through_the_client(smol_format):
    """A scripted engine answers with a Hermes tool call (SmolLM2's tokenizer): the client gets it as tool_calls,
    sends the tool result back, and the continuation appends the tool message after the sampled tokens."""
    fmt = smol_format
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 48"}}</tool_call>'
    script = [fmt.encode(text) + [2], fmt.encode("The answer is 1776.") + [2]]
    seen = []

    def send(payloads):
        seen.append(payloads[0]["input_ids"])
        ids = script[len(seen) - 1]
        return [{"meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                               "finish_reason": {"type": "stop"}, "weight_version": "3"}}]

    gw = Gateway(OpenAIService(fmt, send, model="policy", context_length=None, max_tokens=64)).start()
    try:
        session = gw.open(0, limits(max_new_tokens=64))
        client = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
        tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
        messages = [{"role": "user", "content": "What is 37 * 48?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=[tool])
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Let me compute."
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "37 * 48"}
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "1776"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=[tool])
        assert r.choices[0].message.content == "The answer is 1776." and r.choices[0].finish_reason == "stop"
        t = session.trajectory()
        assert session.segments == 1 and seen[1] == t.prompt + t.tokens[:len(seen[1]) - len(t.prompt)]
        delta = seen[1][len(seen[0]) + len(script[0]):]
        assert fmt.tokenizer.decode(delta) == "\n<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n"
        assert t.versions[:len(script[0])] == [3] * len(script[0])
    finally:
        gw.close()
