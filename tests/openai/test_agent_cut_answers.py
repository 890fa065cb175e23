"""`data.openai_agent` runs whose last answer max_tokens cut and which then raise: openai-agents (0.24) raises
ModelBehaviorError on every Responses answer that is `incomplete` and on a chat answer cut with no text (a Qwen3
answer cut inside its <think> block). Such a run is a truncated episode: its trajectory is the sample, ending
"length" (`algorithm.mask_truncated` and overlong shaping see it), with no error, so its group trains instead of being
left out (`relax.serve.openai.agents.AgentRollout.run`). A run that raises for another reason still fails: after
an answer that was whole, or after a cut answer followed by a whole one.

`AgentRollout` as relax-train builds it (its agent worker processes, the gateway), over a scripted engine with
Qwen3's tokenizer; the agents are openai-agents as its README writes them and the official client
(tests/openai/cut_agents.py). Negative control: before, all four runs failed (error set, end "error"), the two
openai-agents runs with "ModelBehaviorError: ... incomplete" / "... finish_reason='length' but produced no assistant
text".
"""

from __future__ import annotations

import pytest
import torch
from scripted import answer

from relax.batch import FinishReason
from tests.agents.templates import family_tokenizer

pytest.importorskip("agents")

LABELS = ["responses", "chat", "whole_then_raise", "cut_then_whole"]


class CutScript:
    """/generate answering every prompt with an answer cut at the token limit (no stop token, finish "length"): a
    <think> block cut mid-way for a prompt asking to think, plain text otherwise; a prompt whose last words ask for a
    whole answer gets one, ended by the stop token."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            prompt = self.tok.decode(p["input_ids"])
            tail = prompt[prompt.rfind("<|im_start|>user"):]
            whole = "whole" in tail
            text = "Done." if whole else "<think>\nLet me" if "think" in tail else "The answer is"
            ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if whole else [])
            out.append(answer(ids, "stop" if whole else "length"))
        return out


def test_a_run_that_raises_on_its_cut_last_answer_trains_as_truncated():
    from relax.config import load_config
    from relax.serve.openai.agents import AgentRollout

    tok = family_tokenizer("qwen3")
    cfg = load_config(["model=tiny", "rollout=sglang", "rollout.sglang.server=embedded",
                       "data.openai_agent=tests.openai.cut_agents:run", "rollout.max_turns=4",
                       "rollout.max_response_len=8", "data.agent_workers=2", "data.agent_timeout_s=120"])
    rollout = AgentRollout(cfg, tok, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                           send=CutScript(tok), abort=lambda rids: None, host="127.0.0.1")
    prompts = {"responses": "What is 6 * 7?", "chat": "think: what is 6 * 7?", "whole_then_raise": "whole",
               "cut_then_whole": "What is 6 * 7?"}
    items = [{"messages": [{"role": "user", "content": prompts[k]}], "label": k, "index": i}
             for i, k in enumerate(LABELS)]
    try:
        samples = rollout.run(items, torch.arange(len(items)), seed=0, temperature=1.0, top_p=1.0, top_k=-1)
    finally:
        rollout.close()
    got = {e["item"]["label"]: (e["end"], e["error"], samples.finish_reason[i], e["calls"])
           for i, e in enumerate(samples.episodes)}
    for label in ("responses", "chat"):  # kept: ends length, no error, its one cut answer trained
        end, error, finish, calls = got[label]
        assert (end, error, finish, calls) == ("length", None, FinishReason.LENGTH, 1), got[label]
    r = LABELS.index("responses")
    assert samples.response_mask[r].sum() > 0
    for label, calls in (("whole_then_raise", 1), ("cut_then_whole", 2)):  # the controls: still failed runs
        end, error, _, n = got[label]
        assert end == "error" and f"the agent broke ({label})" in error and n == calls, got[label]
