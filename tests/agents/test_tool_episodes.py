"""Tool calls inside episodes: the built-in agent loop answers each call with a `tool` message rendered by the chat
template, counts failed calls (malformed, unknown tool, exception, time-out) without stopping, and ends the episode
at `rollout.max_tool_errors`; a turn without a call is the final answer. The model's messages are scripted (the tiny
tokenizer cannot spell `<tool_call>`): each turn's tokens decode to the next scripted message."""

from __future__ import annotations

import json
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


def count(path: str) -> str:
    """A tool with a side effect (a line appended to `path`): how many times it ran, across worker processes."""
    with open(path, "a") as f:
        f.write("ran\n")
    return "counted"


COUNT = Tool({"type": "function", "function": {"name": "count", "parameters": {}}}, count)


def episode(messages: list[str], *, max_tool_errors: int, env: str | None = None, max_turns: int = 10,
            resume_at: int | None = None) -> tuple[Episode, list]:
    """An episode whose model turns decode to `messages` in order (turn k is the token list [k]); returns it and,
    per turn, the observation's messages (None: the episode ended), each checked against its appended tokens.
    `resume_at`: before that turn, the episode is rebuilt from its record (a resume: its loop reset, turns replayed)."""
    tok = build_tiny_tokenizer()
    renderer = ObservationRenderer(tok)
    factory = AgentFactory(env, ["calculator", "tests.agents.test_tool_episodes:NAP",
                                 "tests.agents.test_tool_episodes:COUNT"], None, 0.5)
    replies: list = []

    def loop():  # (the episode starts each turn's reply with start_turn, and waits for it later)
        made = factory()
        start = made.start_turn
        made.start_turn = lambda text, **kw: Bounded([("reply", start(text, **kw).result)], None,
                                                     then=lambda reply: replies.append(reply) or reply)
        return made

    decode = lambda tokens: messages[tokens[0]]  # noqa: E731
    limits = dict(max_turns=max_turns, max_tool_errors=max_tool_errors)
    ep = Episode({"label": "7"}, loop(), renderer, decode, **limits)
    observations = []
    for k in range(len(messages)):
        if k == resume_at:
            ep = Episode.restore(ep.record(), loop(), renderer, decode, **limits)
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


@pytest.mark.parametrize("resume_at", [None, 1])
def test_a_tool_call_on_the_last_turn_is_not_run(tmp_path, resume_at):
    """rollout.max_turns=2 and a counting call on both turns: the first runs (its result is the observation), the
    last turn's does not (no one would read its result); the episode ends max_turns with the same record as if it
    had run. A resumed episode (rebuilt from its record before its last turn, its first turn replayed) runs it no
    more (tool turns are not replayed)."""
    ran = tmp_path / "ran"
    call = CALL.format(name="count", args=json.dumps({"path": str(ran)}))
    ep, observations = episode([call, call], max_tool_errors=3, max_turns=2, resume_at=resume_at)
    assert ran.read_text().splitlines() == ["ran"]  # once, not twice
    assert observations == [[{"role": "tool", "content": "counted"}], None]
    assert ep.end == "max_turns" and ep.turn_rewards == [0.0, 0.0] and ep.reward == 0.0
    assert (ep.turns, ep.tool_calls, ep.tool_errors) == (2, 2, 0) and ep.record()["actions"] == [call, call]


def test_a_last_turn_call_that_could_end_the_episode_tool_errors_still_runs(tmp_path):
    """Where the last turn's calls could bring the failed calls to rollout.max_tool_errors, their result decides the
    ending ("tool_errors" or "max_turns"): they run, as before. A malformed call (unreadable: no tool runs for it)
    fails without running, and when those alone reach the limit the others are not run."""
    ran = tmp_path / "ran"
    bad = CALL.format(name="calculator", args='{"expression": "1 /"}')
    call = CALL.format(name="count", args=json.dumps({"path": str(ran)}))
    ep, _ = episode([bad, call], max_tool_errors=2, max_turns=2)  # one error so far: this call could be the second
    assert ran.read_text().splitlines() == ["ran"] and ep.end == "max_turns" and ep.tool_errors == 1
    malformed = '<tool_call>{"name": "count", "arguments": {not json}</tool_call>'
    ep, _ = episode([call, malformed + call], max_tool_errors=1, max_turns=2)  # the malformed call alone ends it
    assert ran.read_text().splitlines() == ["ran", "ran"]  # the first turn's only
    assert ep.end == "tool_errors" and (ep.tool_calls, ep.tool_errors) == (3, 1)
