"""A `data.openai_agent` run that raises after an answer its token limit cut ends "length" and keeps its trajectory
only when its exception is one a framework raises on a cut answer (by class name:
`relax.serve.openai.agent_call.CUT_ANSWER_EXCEPTIONS`): the openai SDK's LengthFinishReasonError (its parse helper),
which langchain-openai's `with_structured_output` raises too (by json_schema, its default, and by json_mode);
openai-agents' ModelBehaviorError is tests/openai/test_agent_cut_answers.py's. The agent's own exception there (a
RuntimeError in its code) is a failed run as docs/agents.md says: its episode keeps the error and ends "error", and
the batch's scoring counts it (its group left out, `rollout/reward_errors`) and warns naming it. A framework's
exception after a whole answer (the parse failed: the JSON is not valid) is a failed run too.

`AgentRollout` as relax-train builds it (its agent worker processes, the gateway), over a scripted engine with
Qwen3's tokenizer, then the batch scored as relax-train scores it (`relax.runner.rollout_driver.scoring.score`); the
agents use the official clients (tests/openai/cut_crash_agents.py). Negative control: before, the RuntimeError after
the cut answer was pardoned (end "length", error None, not counted, no warning).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from scripted import answer

from relax.batch import FinishReason
from tests.agents.templates import family_tokenizer

LANGCHAIN = importlib.util.find_spec("langchain_openai") is not None
PARDONED = ["sdk_parse"] + (["lc_json_schema", "lc_json_mode"] if LANGCHAIN else [])
FAILED = ["crash", "crash_whole", "sdk_parse_whole"] + (["lc_json_mode_whole"] if LANGCHAIN else [])
LABELS = PARDONED + FAILED


class CutScript:
    """/generate answering every prompt with a few words cut at the token limit (no stop token, finish "length"); a
    prompt whose last user message is "whole" gets a whole answer, ended by the stop token."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            prompt = self.tok.decode(p["input_ids"])
            whole = prompt[prompt.rfind("<|im_start|>user"):].startswith("<|im_start|>user\nwhole")
            ids = self.tok.encode("Done." if whole else "The answer is", add_special_tokens=False) + (
                [self.tok.eos_token_id] if whole else [])
            out.append(answer(ids, "stop" if whole else "length"))
        return out


def test_only_a_frameworks_cut_answer_exception_is_pardoned(caplog):
    from relax.config import load_config
    from relax.runner.rollout_driver.scoring import score
    from relax.serve.openai.agents import AgentRollout

    tok = family_tokenizer("qwen3")
    cfg = load_config(["model=tiny", "rollout=sglang", "rollout.sglang.server=embedded",
                       "data.openai_agent=tests.openai.cut_crash_agents:run", "data.reward=none",
                       "rollout.max_turns=4", "rollout.max_response_len=8", "data.agent_workers=2",
                       "data.agent_timeout_s=120"])
    rollout = AgentRollout(cfg, tok, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                           send=CutScript(tok), abort=lambda rids: None, host="127.0.0.1")
    items = [{"messages": [{"role": "user", "content": "whole" if k.endswith("_whole") else "What is 6 * 7?"}],
              "label": k, "index": i} for i, k in enumerate(LABELS)]
    try:
        samples = rollout.run(items, torch.arange(len(items)), seed=0, temperature=1.0, top_p=1.0, top_k=-1)
    finally:
        rollout.close()
    got = {e["item"]["label"]: e for e in samples.episodes}
    for label in PARDONED:  # kept: ends length, no error, its one cut answer trained
        e = got[label]
        r = LABELS.index(label)
        assert (e["end"], e["error"], samples.finish_reason[r], e["calls"]) == ("length", None, FinishReason.LENGTH,
                                                                                1), (label, e["error"])
        assert samples.response_mask[r].sum() > 0
    for label in FAILED:  # failed runs, the exception kept in the record
        e = got[label]
        assert e["end"] == "error" and e["calls"] == 1 and e["error"], (label, e["end"], e["error"])
    assert "RuntimeError: the agent's own bug (crash)" in got["crash"]["error"]
    assert "LengthFinishReasonError" not in got["sdk_parse_whole"]["error"]  # (a whole answer: the parse failed)
    assert "json_invalid" in got["sdk_parse_whole"]["error"]
    if LANGCHAIN:
        assert "OutputParserException" in got["lc_json_mode_whole"]["error"]

    # scored as relax-train scores the batch: the failed runs are counted (their groups left out) and warned of,
    # naming the first one's exception (the agent's own RuntimeError after its cut answer)
    with caplog.at_level(logging.WARNING):
        scores = score(cfg, None, None, samples, [None] * len(items), 1)
    assert scores.failed == [label in FAILED for label in LABELS]
    # every run raised: none returned its 1.0 (a pardoned run trains with the reward its calls were given: none)
    assert scores.rewards == [0.0] * len(LABELS)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"data.openai_agent=tests.openai.cut_crash_agents:run failed on {len(FAILED)} of "
                        f"{len(LABELS)} episodes (their groups are left out of the loss); the first failure: "
                        f"RuntimeError: the agent's own bug (crash)"], warnings
