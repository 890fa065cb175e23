"""Tool calls inside episodes: the built-in agent loop answers each call with a `tool` message rendered by the chat
template, counts failed calls (malformed, unknown tool, exception, time-out) without stopping, and ends the episode
at `rollout.max_tool_errors`; a turn without a call is the final answer. The model's messages are scripted (the tiny
tokenizer cannot spell `<tool_call>`): each turn's tokens decode to the next scripted message."""

from __future__ import annotations

import time

import pytest

from relax.agents.bounded import Bounded
from relax.agents.episode import Episode
from relax.agents.loops import AgentFactory
from relax.agents.render import ObservationRenderer
from relax.agents.tools import Tool
from relax.data.tokenizer import build_tiny_tokenizer

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "rested"


NAP = Tool({"type": "function", "function": {"name": "nap", "parameters": {}}}, nap)


def episode(messages: list[str], *, max_tool_errors: int, env: str | None = None) -> tuple[Episode, list]:
    """An episode whose model turns decode to `messages` in order (turn k is the token list [k]); returns it and,
    per turn, the observation's messages (None: the episode ended), each checked against its appended tokens."""
    tok = build_tiny_tokenizer()
    renderer = ObservationRenderer(tok)
    factory = AgentFactory(env, ["calculator", "tests.agents.test_tool_episodes:NAP"], None, 0.5)
    loop, replies = factory(), []
    start = loop.start_turn  # (the episode starts each turn's reply with it, and waits for it later)
    loop.start_turn = lambda text: Bounded([("reply", start(text).result)], None,
                                           then=lambda reply: replies.append(reply) or reply)
    ep = Episode({"label": "7"}, loop, renderer, lambda tokens: messages[tokens[0]], max_turns=10,
                 max_tool_errors=max_tool_errors)
    observations = []
    for k in range(len(messages)):
        obs = ep.turn_end([k], tok.eos_token_id, context=10)
        if obs is None:
            observations.append(None)
            break
        assert obs == renderer.tokens(replies[-1].messages, tok.eos_token_id)  # rendered by the template
        observations.append(replies[-1].messages)
    factory.close()
    return ep, observations


def test_tool_results_and_errors_come_back_as_tool_messages_and_are_counted():
    messages = [CALL.format(name="calculator", args='{"expression": "6 * 7"}'),
                CALL.format(name="calculator", args='{"expression": "6 *"}') + " and "
                + CALL.format(name="abacus", args="{}"),
                CALL.format(name="nap", args='{"seconds": 30}'),  # past data.tool_timeout_s=0.5
                "the answer is 42"]
    t0 = time.perf_counter()
    ep, observations = episode(messages, max_tool_errors=10)
    assert time.perf_counter() - t0 < 20  # the hung call was killed at its limit
    assert observations[0] == [{"role": "tool", "content": "42"}]
    assert [m["role"] for m in observations[1]] == ["tool", "tool"]  # a SyntaxError and an unknown tool
    assert observations[1][0]["content"].startswith("Error: SyntaxError")
    assert "unknown tool 'abacus'" in observations[1][1]["content"]
    assert "data.tool_timeout_s=0.5" in observations[2][0]["content"]
    assert observations[3] is None and ep.end == "stop"  # no call: the final answer
    assert (ep.turns, ep.tool_calls, ep.tool_errors) == (4, 4, 3)
    assert ep.record()["actions"] == messages


def test_max_tool_errors_ends_the_episode():
    bad = CALL.format(name="calculator", args='{"expression": "1 /"}')
    ep, observations = episode([bad, bad, bad, "42"], max_tool_errors=2)
    assert observations[1] is None and ep.end == "tool_errors" and (ep.turns, ep.tool_errors) == (2, 2)


def test_with_an_environment_turns_without_a_call_go_to_it():
    ep, observations = episode([CALL.format(name="calculator", args='{"expression": "3 + 4"}'), "3", "7"],
                               max_tool_errors=3, env="guess_number")
    assert observations[0] == [{"role": "tool", "content": "7"}]  # the tool's answer
    assert observations[1] == [{"role": "user", "content": "+"}]  # the environment's: the secret 7 is higher than 3
    # found at the environment's second step (tool turns are not its steps): 1 - 0.2
    assert observations[2] is None and ep.end == "env_done" and ep.turn_rewards == [0.0, 0.0, pytest.approx(0.8)]
