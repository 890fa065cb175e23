"""Agent programs for the gateway tests (`data.openai_agent=gateway_agents:<name>`), written only against the
official `openai` client."""

from __future__ import annotations

import os
import time
from pathlib import Path

from openai import OpenAI

FOLLOW_UP = "what is the final answer"  # words of the tiny tokenizer's vocabulary


def client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def three_turns(item: dict, base_url: str, api_key: str) -> float:
    """Three chat calls, each continuing the conversation with the answer it got and a user follow-up; reward 1 when
    the last answer holds a digit."""
    c = client(base_url, api_key)
    messages = list(item["messages"])
    for _ in range(3):
        answer = c.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message
        messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": FOLLOW_UP}]
    return float(any(ch.isdigit() for ch in answer.content or ""))


def responses_three_turns(item: dict, base_url: str, api_key: str) -> float:
    """`three_turns` with the Responses API: the second call sends the first call's output items back with a user
    follow-up, the third names the second by previous_response_id and sends only the follow-up."""
    c = client(base_url, api_key)
    first = c.responses.create(model="policy", input=item["messages"], max_output_tokens=6)
    follow_up = {"role": "user", "content": FOLLOW_UP}
    second = c.responses.create(model="policy", max_output_tokens=6, input=[
        *item["messages"], *[o.model_dump(exclude_none=True) for o in first.output], follow_up])
    last = c.responses.create(model="policy", previous_response_id=second.id, input=[follow_up],
                              max_output_tokens=6)
    return float(any(ch.isdigit() for ch in last.output_text))


def edits_history(item: dict, base_url: str, api_key: str) -> None:
    """Two calls, the second with the first answer rewritten (as context compaction would): a new segment."""
    c = client(base_url, api_key)
    messages = list(item["messages"])
    answer = c.chat.completions.create(model="policy", messages=messages, max_tokens=4).choices[0].message
    messages += [{"role": "assistant", "content": (answer.content or "") + " is"}, {"role": "user", "content": "what"}]
    c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return None




TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
TOUR_SEGMENTS = 5  # the tour's calls that do not extend the one before (each starts a segment)


def api_tour(item: dict, base_url: str, api_key: str) -> float:
    """The API during a training run, checked by the agent itself (an AssertionError fails its sample): a plain and
    a streamed call with one seed give the same text and the stream ends with its finish reason; log-probs cover
    every token; n=2 gives two choices; tools are offered in the prompt; a bad request is a 400 in OpenAI's shape."""
    import openai

    c = client(base_url, api_key)
    messages = list(item["messages"])
    plain = c.chat.completions.create(model="policy", messages=messages, max_tokens=5, seed=5, logprobs=True)
    assert len(plain.choices[0].logprobs.content) == plain.usage.completion_tokens > 0
    chunks = list(c.chat.completions.create(model="policy", messages=messages, max_tokens=5, seed=5, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    two = c.chat.completions.create(model="policy", messages=messages, max_tokens=5, n=2)
    assert len(two.choices) == 2
    tools = c.chat.completions.create(model="policy", messages=messages, max_tokens=2, tools=[TOOL])
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens
    try:
        c.chat.completions.create(model="policy", messages=messages, presence_penalty=1.0)
        raise AssertionError("a bad request was accepted")
    except openai.BadRequestError as exc:
        assert exc.status_code == 400 and exc.body["param"] == "presence_penalty"
    last = c.chat.completions.create(model="policy", messages=[messages[-1]], max_tokens=4)  # a new segment
    return float(any(ch.isdigit() for ch in last.choices[0].message.content or ""))


def mixed(item: dict, base_url: str, api_key: str) -> float | None:
    """By prompt: one that raises, one that hangs, one that edits its history, one that converses three turns, one
    that tours the API. Where the driver says which job runs (`BARRIER_ENV`'s `job`), the one that hangs does so in
    job 0 only and raises in the jobs after it: a hang costs its job the whole time limit, once is enough to see it
    counted, and the jobs after it run on the workers that replaced the ones killed at the limit."""
    kind = item["index"] % 5
    if kind == 0:
        raise RuntimeError("the agent broke")
    if kind == 1:
        if BARRIER_ENV in os.environ and int((Path(os.environ[BARRIER_ENV]) / "job").read_text()) > 0:
            raise RuntimeError("the agent broke after it hung in job 0")
        time.sleep(3600)
    if kind == 2:
        return edits_history(item, base_url, api_key)
    if kind == 4:
        return api_tour(item, base_url, api_key)
    return three_turns(item, base_url, api_key)


BARRIER_ENV = "RELAX_TEST_AGENT_BARRIER"  # a directory shared with the test's hooks in the driver
BARRIER_WAIT_S = 120.0  # a barrier never reached ends the wait (the test then fails on what it checks)


def wait_for(path: Path, timeout_s: float = BARRIER_WAIT_S) -> bool:
    """Until `path` exists (True), or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def three_turns_across_an_update(item: dict, base_url: str, api_key: str) -> float:
    """`three_turns`, where in every job j >= 1 the first call comes before the update of version j and the second
    after it: the agent marks `first-j` after its first answer, which the driver's publish of version j waits for,
    and waits for `published-j` (written once the publish returned) before its next call. The driver writes the
    number of the job under way to `job` before it starts that job's agents (tests/openai/test_agent_training.py)."""
    barrier = Path(os.environ[BARRIER_ENV])
    job = int((barrier / "job").read_text())
    c = client(base_url, api_key)
    messages = list(item["messages"])
    for turn in range(3):
        answer = c.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message
        messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": FOLLOW_UP}]
        if turn == 0 and job >= 1:
            (barrier / f"first-{job}").touch()
            wait_for(barrier / f"published-{job}")
    return float(any(ch.isdigit() for ch in answer.content or ""))
