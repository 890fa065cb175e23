"""`data.openai_agent` runs that stop themselves at their own turn limit, equal to rollout.max_turns, and raise
(openai-agents' `Runner.run(max_turns=8)` beside `rollout.max_turns=8`, docs/agents.md's example, raises
MaxTurnsExceeded rather than make a 9th call): the gateway never sees a call past its limit, yet the run reached it.
Such a run ends "max_turns" and keeps its trajectory, with no error, as one the gateway's 400 `max_calls` stopped
(`relax.serve.openai.agents._end_of_run`), when its exception is a framework's turn-limit one (by class name:
`relax.serve.openai.agent_call.TURN_LIMIT_EXCEPTIONS`). A run that raises another exception after all its calls (an
agent that crashed after its last answer), one that raises after fewer calls, or after all of them with the last one
not answered (the engine failed it), still fails.

`AgentRollout` as relax-train builds it (its agent worker processes, the gateway), over a scripted engine with
Qwen3's tokenizer; the agents are plain functions with the official client and openai-agents as docs/agents.md writes
it (tests/openai/turn_limit_agents.py). Negative control: before, the runs that made all their calls and then raised
failed too (error set, end "error", nothing trained).
"""

from __future__ import annotations

import importlib.util
import json

import torch
from scripted import answer

from relax.batch import FinishReason
from tests.agents.templates import family_tokenizer
from tests.openai.turn_limit_agents import CALLS, MAX_TURNS

SDK = importlib.util.find_spec("agents") is not None  # openai-agents (an optional dependency)
LABELS = ["all_then_limit", "all_then_crash", "fewer_then_raise", "last_unanswered"] + (
    ["sdk_equal_limits"] if SDK else [])


class Script:
    """/generate answering every prompt whole (ended by the stop token): a call of the tool `step` where the prompt
    offers tools, a few words otherwise; a prompt whose last user message is "explode" fails (the gateway's 500)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            prompt = self.tok.decode(p["input_ids"])
            if prompt[prompt.rfind("<|im_start|>user"):].startswith("<|im_start|>user\nexplode"):
                raise RuntimeError("the engine failed this call")
            text = ("<tool_call>\n" + json.dumps({"name": "step", "arguments": {}}) + "\n</tool_call>"
                    if "<tools>" in prompt else "Fine.")
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(answer(ids, "stop"))
        return out


def test_a_run_that_raises_after_its_last_allowed_call_ends_max_turns():
    from relax.config import load_config
    from relax.serve.openai.agents import AgentRollout

    tok = family_tokenizer("qwen3")
    cfg = load_config(["model=tiny", "rollout=sglang", "rollout.sglang.server=embedded",
                       "data.openai_agent=tests.openai.turn_limit_agents:run", f"rollout.max_turns={MAX_TURNS}",
                       "rollout.max_response_len=32", "rollout.max_episode_tokens=1000", "data.agent_workers=2",
                       "data.agent_timeout_s=120"])
    rollout = AgentRollout(cfg, tok, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                           send=Script(tok), abort=lambda rids: None, host="127.0.0.1")
    items = [{"messages": [{"role": "user", "content": f"Start ({k})."}], "label": k, "index": i}
             for i, k in enumerate(LABELS)]
    try:
        samples = rollout.run(items, torch.arange(len(items)), seed=0, temperature=1.0, top_p=1.0, top_k=-1)
    finally:
        rollout.close()
    got = {e["item"]["label"]: (e["end"], e["error"], samples.finish_reason[i], e["calls"], e["turns"])
           for i, e in enumerate(samples.episodes)}
    for label in ("all_then_limit", "sdk_equal_limits")[:1 + SDK]:  # kept: every call's answer trained, no error
        end, error, finish, calls, turns = got[label]
        assert (end, error, finish, calls, turns) == ("max_turns", None, FinishReason.MAX_TURNS, MAX_TURNS,
                                                      MAX_TURNS), got[label]
        r = LABELS.index(label)
        e = samples.episodes[r]
        # the trained tokens are all the answers the engine gave (each one ended by the stop token)
        assert int(samples.response_mask[r].sum()) == e["sampled_tokens"] == e["trained_tokens"] > 0, e
    if SDK:  # the SDK made its tool calls: each answer a call of `step`
        assert samples.episodes[LABELS.index("sdk_equal_limits")]["tool_calls"] == MAX_TURNS
    # the controls: still failed runs, with nothing wrong but the agent's own error
    end, error, _, calls, _ = got["fewer_then_raise"]
    assert (end, calls) == ("error", CALLS["fewer_then_raise"]) and "own turn limit (fewer_then_raise)" in error
    end, error, _, calls, _ = got["all_then_crash"]  # all calls answered, then an exception that is no turn limit
    assert (end, calls) == ("error", MAX_TURNS) and "ValueError: the agent's own bug" in error, got["all_then_crash"]
    end, error, _, calls, _ = got["last_unanswered"]  # all calls admitted, the last one failed by the engine
    assert (end, calls) == ("error", MAX_TURNS) and "InternalServerError" in error, got["last_unanswered"]
