"""Agent programs for tests/openai/test_agent_cut_answer_crash.py
(`data.openai_agent=tests.openai.cut_crash_agents:run`), each item's `label` naming what the run does; the scripted
engine there cuts every answer at its token limit unless the prompt asks for a whole one (labels ending "_whole").
Each run makes one call and raises: its own RuntimeError, or what the openai SDK's parse helper and langchain-openai's
`with_structured_output` raise on the answer."""

from __future__ import annotations

import openai
from pydantic import BaseModel


class Answer(BaseModel):
    value: int


def _structured(kind: str, messages: list, base_url: str, api_key: str) -> None:
    if kind == "sdk_parse":
        c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        c.chat.completions.parse(model="policy", messages=messages, response_format=Answer)
    else:  # lc_json_schema, lc_json_mode
        from langchain_openai import ChatOpenAI

        model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0)
        model.with_structured_output(Answer, method=kind[3:]).invoke(messages)


def run(item: dict, base_url: str, api_key: str) -> float | None:
    label, messages = item["label"], item["messages"]
    kind = label.removesuffix("_whole")
    if kind == "crash":  # one call, then the agent's own bug
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="policy", messages=messages)
        raise RuntimeError(f"the agent's own bug ({label})")
    if label != kind:  # a whole answer: whatever the framework raises (its JSON is not valid)
        _structured(kind, messages, base_url, api_key)
        return 1.0
    try:  # a cut answer: the framework raises LengthFinishReasonError, and only that
        _structured(kind, messages, base_url, api_key)
    except openai.LengthFinishReasonError:
        raise
    except Exception as exc:  # (a failed run: the test sees it)
        raise AssertionError(f"{label}: expected LengthFinishReasonError on the cut answer, got {exc!r}") from exc
    raise AssertionError(f"{label}: expected LengthFinishReasonError on the cut answer, nothing raised")
