"""Agent programs for the gateway tests (`data.openai_agent=gateway_agents:<name>`), written only against the
official `openai` client."""

from __future__ import annotations

import time

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


def edits_history(item: dict, base_url: str, api_key: str) -> None:
    """Two calls, the second with the first answer rewritten (as context compaction would): a new segment."""
    c = client(base_url, api_key)
    messages = list(item["messages"])
    answer = c.chat.completions.create(model="policy", messages=messages, max_tokens=4).choices[0].message
    messages += [{"role": "assistant", "content": (answer.content or "") + " is"}, {"role": "user", "content": "what"}]
    c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return None




def mixed(item: dict, base_url: str, api_key: str) -> float | None:
    """By prompt: one that raises, one that hangs, one that edits its history, one that converses three turns."""
    kind = item["index"] % 4
    if kind == 0:
        raise RuntimeError("the agent broke")
    if kind == 1:
        time.sleep(3600)
    if kind == 2:
        return edits_history(item, base_url, api_key)
    return three_turns(item, base_url, api_key)


def three_turns_slowly(item: dict, base_url: str, api_key: str) -> float:
    """`three_turns` with a pause between calls: a batch outlasts a training step, so weights arrive mid-batch."""
    c = client(base_url, api_key)
    messages = list(item["messages"])
    for turn in range(3):
        time.sleep(1.5 if turn else 0.0)
        answer = c.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message
        messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": FOLLOW_UP}]
    return float(any(ch.isdigit() for ch in answer.content or ""))
