"""Agent programs for tests/openai/test_agent_turn_limit.py (`data.openai_agent=tests.openai.turn_limit_agents:run`),
each item's `label` naming what the run does; the test's rollout.max_turns is `MAX_TURNS`. The scripted engine there
answers every call whole (a tool call where the prompt offers tools) and fails a call whose last message is
"explode" (the gateway's 500: a call admitted, never answered)."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI, OpenAI

MAX_TURNS = 3

CALLS = {"all_then_limit": MAX_TURNS, "all_then_crash": MAX_TURNS, "fewer_then_raise": MAX_TURNS - 1,
         "last_unanswered": MAX_TURNS}


class GraphRecursionError(RecursionError):
    """Named as LangGraph's turn-limit exception (its recursion_limit), which Relax recognises by its class name."""


def _sdk_loop(item: dict, base_url: str, api_key: str) -> None:
    """openai-agents as docs/agents.md writes it, its own max_turns equal to rollout.max_turns: a tool loop that
    uses every turn, so the SDK raises MaxTurnsExceeded before a call past its limit."""
    import agents

    agents.set_tracing_disabled(True)  # the SDK would post every run's trace to api.openai.com with this key

    @agents.function_tool
    def step() -> str:
        """Take one step."""
        return "stepped"

    async def main() -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            agent = agents.Agent(name="a", tools=[step], model=agents.OpenAIChatCompletionsModel("policy", client))
            await agents.Runner.run(agent, item["messages"][-1]["content"], max_turns=MAX_TURNS)

    asyncio.run(main())


def run(item: dict, base_url: str, api_key: str) -> float | None:
    label = item["label"]
    if label == "sdk_equal_limits":
        _sdk_loop(item, base_url, api_key)
        return 1.0
    c = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(item["messages"])
    for k in range(CALLS[label]):
        if k:  # the next user turn; the last one of "last_unanswered" makes the engine fail the call
            last = label == "last_unanswered" and k == CALLS[label] - 1
            messages.append({"role": "user", "content": "explode" if last else f"go on ({k})"})
        answer = c.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages.append({"role": "assistant", "content": answer.content})
    if label == "all_then_crash":  # an agent that fails after its last answer: not a turn limit
        raise ValueError(f"the agent's own bug ({label})")
    raise GraphRecursionError(f"the agent's own turn limit ({label})")
