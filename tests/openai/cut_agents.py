"""Agent programs for tests/openai/test_agent_cut_answers.py (`data.openai_agent=tests.openai.cut_agents:run`), each
item's `label` naming what the run does; the scripted engine there cuts every answer at its token limit unless the
prompt asks for a whole one ("whole")."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI, OpenAI


def _agent(base_url: str, api_key: str, model_class: str):
    import agents

    agents.set_tracing_disabled(True)  # the SDK would post every run's trace to api.openai.com with this key
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return agents.Agent(name="a", model=getattr(agents, model_class)("policy", client))


def run(item: dict, base_url: str, api_key: str) -> float | None:
    import agents

    label = item["label"]
    if label in ("responses", "chat"):  # openai-agents as documented: it raises on the cut answer
        model = "OpenAIResponsesModel" if label == "responses" else "OpenAIChatCompletionsModel"
        result = asyncio.run(agents.Runner.run(_agent(base_url, api_key, model), item["messages"][-1]["content"]))
        return 1.0 if result.final_output else 0.0
    c = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(item["messages"])
    answer = c.chat.completions.create(model="policy", messages=messages).choices[0].message
    if label == "cut_then_whole":  # a later call answered whole: the run's failure is its own
        messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": "whole"}]
        c.chat.completions.create(model="policy", messages=messages)
    raise RuntimeError(f"the agent broke ({label})")
