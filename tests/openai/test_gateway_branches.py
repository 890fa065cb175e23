"""No trained token lost in the gateway: a call is matched against every branch of its session, with what does not
change the tokens ignored (an assistant message's `name`, tool_choice "none", a think-stripped answer), and the
sample is the branch holding the most sampled tokens, every other sampled token counted in
`rollout/gateway_untrained_tokens`.

Each test drives the gateway with the official `openai` client (the parallel one with AsyncOpenAI and
asyncio.gather) against a scripted engine, and counts tokens from the engine's side: each call's output is either
in the trained row (the row's context holds the call's input, then its output, trained) or off it; the trained ones
must be every sampled token but those the documented rule leaves out, which the metric counts exactly. Negative
control: the old rule (a call extends only the latest call's choices, messages compared as sent, the sample is the
latest call's segment) fails the same count."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import openai
import pytest
import torch

from relax.data.tokenizer import build_tiny_tokenizer
from relax.metrics import GATEWAY_SAMPLED_TOKENS, GATEWAY_SEGMENTS, GATEWAY_TRAINED_TOKENS, GATEWAY_UNTRAINED_TOKENS
from relax.runner.step_metrics import episode_metrics
from relax.serve.openai.agents import _samples
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.protocol import same_message
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import FORMS, Limits, Session, _Call

USER = [{"role": "user", "content": "What is 3 + 4?"}]
FOLLOW_UP = {"role": "user", "content": "what is the final answer?"}
SIDE = [{"role": "user", "content": "repeat the answer"}]  # a side call: another conversation through the client
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
# a template that uses <think> (answers opening with a block get it split off into reasoning_content)
QWEN3_LIKE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
              "{% endif %}{% endif %}")
THOUGHT = "<think>\nwhat is 3 + 4\n</think>\n\n7"


class Engine:
    """A scripted engine: `answer(prompt text) -> text` (then the stop token), after `delay(prompt text)` seconds;
    every call's (input ids, output ids) kept in the order answered."""

    def __init__(self, fmt: ChatFormat, answer: Callable[[str], str], delay: Callable[[str], float]):
        self.fmt, self.answer, self.delay = fmt, answer, delay
        self.calls: list[tuple[list[int], list[int]]] = []
        self.lock = threading.Lock()

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            text = self.fmt.tokenizer.decode(p["input_ids"])
            time.sleep(self.delay(text))
            ids = self.fmt.encode(self.answer(text)) + [min(self.fmt.eos_token_ids)]
            with self.lock:
                self.calls.append((list(p["input_ids"]), ids))
            out.append({"meta_info": {"output_token_logprobs": [[-0.25, t, None] for t in ids],
                                      "finish_reason": {"type": "stop", "matched": ids[-1]}, "weight_version": "1"}})
        return out


def by_turn(text: str) -> str:
    """The main conversation's answers grow with its turns (the trained branch is the longest); a side call's is
    short."""
    if "repeat" in text:
        return "7"
    turn = text.count("assistant") - 1  # earlier answers (the generation prompt is the last)
    return ["the answer is 7", "the final answer is 3 + 4 = 7", "the final answer is boxed 7"][min(turn, 2)]


class LastSegmentOnly(Session):
    """The old rule, for the negative control: a call extends only the latest call's choices, its messages compared
    as sent (a name, a think block, tool_choice count), and the sample is the latest call's branch (choice 0)."""

    def chat_prompt(self, messages, tools, fmt, template_kwargs=None, offered=None):
        key = repr(tools) + json.dumps(template_kwargs or {}, sort_keys=True)
        with self._lock:
            for node in [n for n in self.nodes if n.call == self.latest]:
                old = [{k: v for k, v in m.items() if k != FORMS} for m in node.messages]
                if node.tools_key == key and len(messages) > len(old) and all(
                        same_message(a, b) for a, b in zip(messages, old, strict=False)):
                    delta = fmt.continuation(messages[len(old):], node.stop_token, template_kwargs)
                    return node.context + delta, _Call(node, delta, node.messages + messages[len(old):], key)
            return fmt.prompt(messages, tools, template_kwargs), _Call(None, [], list(messages), key)

    def _row(self):
        latest = [n for n in self.nodes if n.call == self.latest]
        return min(latest, key=lambda n: n.choice) if latest else None


@pytest.fixture
def make():
    """make(answer, delay, template, old) -> (gateway, engine, session, client, async client)."""
    made = []

    def build(answer=by_turn, delay=lambda text: 0.0, template=None, old=False):
        tok = build_tiny_tokenizer()
        tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
        if template is not None:
            tok.chat_template = template
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        engine = Engine(fmt, answer, delay)
        gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
        made.append(gw)
        limits = Limits(max_calls=8, max_tokens=400, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
        session = (LastSegmentOnly("relax-old", 0, limits) if old else gw.open(0, limits))
        if old:
            gw._sessions[session.key] = session
        return (gw, engine, session, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0),
                openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0))

    yield build
    for gw in made:
        gw.close()


def count(session: Session, engine: Engine) -> tuple[int, int, int]:
    """(sampled, trained, off) counted from the engine's side: a call is on the trained row when the row's context
    holds its input, then its output, trained; each trained token must be one such output's (exactly once)."""
    t = session.trajectory()
    context, mask = t.prompt + t.tokens, [0] * len(t.prompt) + t.sampled
    on = off = 0
    for ids, out in engine.calls:
        end = len(ids) + len(out)
        if context[:len(ids)] == ids and context[len(ids):end] == out and all(mask[len(ids):end]):
            on += len(out)
        else:
            off += len(out)
    assert on == sum(t.sampled)  # nothing trained that the engine did not sample at that place
    return on + off, on, off


def metrics(session: Session) -> dict[str, float]:
    """The step metrics of the sample the rollout makes of this session (`relax.serve.openai.agents`)."""
    return episode_metrics(_samples([(session, {}, session.trajectory(), None)], torch.tensor([0]), 0))


def check(session: Session, engine: Engine, untrained: int) -> None:
    """Every sampled token trained but the `untrained` ones the rule leaves out, and the metrics say so."""
    sampled, trained, off = count(session, engine)
    assert (trained, off) == (sampled - untrained, untrained)
    m = metrics(session)
    assert (m[GATEWAY_SAMPLED_TOKENS], m[GATEWAY_TRAINED_TOKENS], m[GATEWAY_UNTRAINED_TOKENS]) == \
        (sampled, sampled - untrained, untrained)
    assert session.token_counts() == (sampled, sampled - untrained)


def message(r) -> dict:
    return r.choices[0].message.model_dump(exclude_none=True)


# ------------------------------------------------------------------------------------------------- the cases
def side_call_between_turns(client, aclient) -> None:
    first = client.chat.completions.create(model="m", messages=USER)
    client.chat.completions.create(model="m", messages=SIDE)  # a title, a judge: another conversation
    client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP])


def parallel_calls(client, aclient) -> None:
    """Two calls at once continuing the same answer (two follow-ups), then the conversation goes on from the
    first; the engine answers the second later (it is recorded last)."""
    first = client.chat.completions.create(model="m", messages=USER)
    base = USER + [message(first)]
    followups = [FOLLOW_UP, {"role": "user", "content": "repeat the answer"}]

    async def both():
        return await asyncio.gather(*[aclient.chat.completions.create(model="m", messages=base + [f])
                                      for f in followups])

    a, _ = asyncio.run(both())
    client.chat.completions.create(model="m", messages=base + [FOLLOW_UP, message(a), FOLLOW_UP])


def named_assistant(client, aclient) -> None:
    first = client.chat.completions.create(model="m", messages=USER)
    named = {**message(first), "name": "solver"}  # as LangChain and LangGraph send it
    second = client.chat.completions.create(model="m", messages=USER + [named, FOLLOW_UP])
    client.chat.completions.create(model="m", messages=USER + [named, FOLLOW_UP, {**message(second), "name": "solver"},
                                                               FOLLOW_UP])


def tool_choice_none_last(client, aclient) -> None:
    first = client.chat.completions.create(model="m", messages=USER, tools=[TOOL])
    second = client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP], tools=[TOOL],
                                            tool_choice="auto")
    client.chat.completions.create(model="m", tools=[TOOL], tool_choice="none",  # "answer now"
                                   messages=USER + [message(first), FOLLOW_UP, message(second), FOLLOW_UP])


def think_stripped(client, aclient) -> None:
    """The answers come back without their <think> block (as Qwen3's template renders history), the block kept in
    content (separate_reasoning=false) or split off by the gateway and the agent dropping reasoning_content."""
    whole = {"separate_reasoning": False}
    first = client.chat.completions.create(model="m", messages=USER, extra_body=whole).choices[0].message
    assert first.content == THOUGHT
    stripped = {"role": "assistant", "content": "7"}
    second = client.chat.completions.create(model="m", messages=USER + [stripped, FOLLOW_UP])
    assert second.choices[0].message.content == "7"  # reasoning_content split off; the agent drops it
    client.chat.completions.create(model="m", messages=USER + [stripped, FOLLOW_UP, {"role": "assistant",
                                                                                    "content": "7"}, FOLLOW_UP])


def think_inline(client, aclient) -> None:
    """The split-off block put back in front of the content (an agent that keeps the raw text)."""
    first = client.chat.completions.create(model="m", messages=USER).choices[0].message
    assert (first.reasoning_content, first.content) == ("what is 3 + 4", "7")
    client.chat.completions.create(model="m", messages=USER + [{"role": "assistant", "content": THOUGHT}, FOLLOW_UP])


THINKING = {"answer": lambda text: THOUGHT, "template": QWEN3_LIKE}
CASES = {  # name: (the agent, the engine's script, segments, branches)
    "side_call_between_turns": (side_call_between_turns, {}, 2, 2),
    "parallel_calls": (parallel_calls, {"delay": lambda text: 0.5 if "repeat" in text else 0.0}, 1, 2),
    "named_assistant": (named_assistant, {}, 1, 1),
    "tool_choice_none_last": (tool_choice_none_last, {}, 1, 1),
    "think_stripped": (think_stripped, THINKING, 1, 1),
    "think_inline": (think_inline, THINKING, 1, 1),
}


def untrained_by_rule(engine: Engine) -> int:
    """The tokens the documented rule leaves out in these cases: the side calls' ('repeat the answer', answered
    '7'), which are not on the longest branch."""
    decode = engine.fmt.tokenizer.decode
    return sum(len(out) for ids, out in engine.calls if decode(ids).rstrip().endswith("repeat the answer<|im_end|>\n"
                                                                                      "<|im_start|>assistant"))


@pytest.mark.parametrize("name", list(CASES))
def test_every_sampled_token_is_trained_or_counted(make, name):
    agent, script, segments, branches = CASES[name]
    gw, engine, session, client, aclient = make(**script)
    agent(client, aclient)
    assert (session.segments, session.branches) == (segments, branches)
    untrained = untrained_by_rule(engine)
    assert untrained == (0 if name not in ("side_call_between_turns", "parallel_calls") else 2)
    check(session, engine, untrained)
    assert len(session.trajectory().answers) == (2 if name in ("side_call_between_turns", "think_inline") else 3)
    assert metrics(session)[GATEWAY_SEGMENTS] == segments


@pytest.mark.parametrize("name", list(CASES))
def test_negative_control_the_last_segment_rule_loses_tokens(make, name):
    """The same agents under the old rule: turns that the new rule trains are neither trained nor counted as left
    out by the rule (the count fails)."""
    agent, script, _, _ = CASES[name]
    gw, engine, session, client, aclient = make(**script, old=True)
    agent(client, aclient)
    sampled, trained, _ = count(session, engine)
    assert trained < sampled - untrained_by_rule(engine)


def test_rewards_follow_their_calls_and_none_is_lost(make):
    """Per-call rewards stay with their calls on the trained branch; those of calls off it (and of the run before
    its first call) go to its first call: the run's total is kept."""
    import requests

    gw, engine, session, client, aclient = make()
    headers = {"Authorization": f"Bearer {session.key}"}

    def reward(value):
        assert requests.post(gw.base_url + "/relax/reward", json={"reward": value}, headers=headers,
                             timeout=10).status_code == 200

    reward(0.25)  # before any call
    first = client.chat.completions.create(model="m", messages=USER)
    reward(1)
    client.chat.completions.create(model="m", messages=SIDE)
    reward(10)
    client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP])
    reward(100)
    assert session.trajectory().rewards == [11.25, 100.0]


def test_n_choices_are_branches_and_the_unused_one_is_counted(make):
    """n=2: the choice the agent continues is trained with its continuation, the other counted as untrained."""
    answers = iter(["the answer is 7", "7", "the final answer is 7"])
    gw, engine, session, client, aclient = make(answer=lambda text: next(answers))
    r = client.chat.completions.create(model="m", messages=USER, n=2)
    short = r.choices[1].message.model_dump(exclude_none=True)
    assert short["content"] == "7"
    client.chat.completions.create(model="m", messages=USER + [short, FOLLOW_UP])
    t = session.trajectory()
    assert t.answers == ["7", "the final answer is 7"] and (session.segments, session.branches) == (1, 2)
    check(session, engine, len(engine.calls[0][1]))
