"""The train/rollout log-prob mismatch with constrained decoding (review 5, A9). A token sampled under a grammar
(the OpenAI gateway's strict tools, forced calls, response_format) has as rollout log-prob that of the grammar's
masked distribution, which the trainer's recomputation (the whole vocabulary) is not, so such tokens differ by the
log of the probability the grammar left them. `rollout/train_rollout_logp_abs_diff` (the no-drift check) reads the
tokens no grammar constrained; `rollout/train_rollout_logp_abs_diff_constrained` the others,
`rollout/constrained_token_frac` their share.

Checked: both computations of the metrics (the trainer's first step and the runner's from old log-probs) against
values written by hand; which tokens the gateway marks as constrained (a strict tool's call: the tokens after the
call's opening tag up to its closing tag; the free text around it and a free answer: none); and a real training run
through the gateway whose agent makes a forced call then a free answer: the free tokens' difference is fp32 noise,
the constrained tokens' far from it."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relax.algorithms.base import AlgorithmConfig
from relax.algorithms.rollout_correction import constrained_split
from relax.metrics import (
    CONSTRAINED_TOKEN_FRAC,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED,
    TRAIN_ROLLOUT_RATIO_MAX,
)
from relax.runner.step_metrics import rollout_mismatch
from relax.train.trainer import StepSums

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import FAMILIES, family_tokenizer  # noqa: E402

# two rows: the trainer's log-probs, the engine's, the valid tokens, those a grammar constrained
OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.3, -2.0, -1.0]])
ROLLOUT = torch.tensor([[-1.1, -1.0, -0.5, 0.0], [-1.5, -0.1, -2.2, -3.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
CONSTRAINED = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 1]])
# by hand: free tokens (0,0) 0.1, (0,2) 0, (1,0) 0, (1,1) -0.2, (1,2) 0.2 -> mean |d| 0.5 / 5, max ratio e^0.2;
# constrained (0,1) -1.0, (1,3) 2.0 -> mean |d| 1.5; 2 of 7 valid tokens constrained
HAND = {TRAIN_ROLLOUT_LOGP_ABS_DIFF: 0.1, TRAIN_ROLLOUT_RATIO_MAX: math.exp(0.2),
        TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED: 1.5, CONSTRAINED_TOKEN_FRAC: 2 / 7}


def test_the_runners_mismatch_reads_free_and_constrained_tokens_apart():
    out = rollout_mismatch(AlgorithmConfig(), OLD, ROLLOUT, MASK, CONSTRAINED)
    for name, value in HAND.items():
        assert out[name] == pytest.approx(value, abs=1e-6), name
    plain = rollout_mismatch(AlgorithmConfig(), OLD, ROLLOUT, MASK)  # nothing constrained: every valid token
    assert plain[TRAIN_ROLLOUT_LOGP_ABS_DIFF] == pytest.approx((0.5 + 3.0) / 7, abs=1e-6)
    assert TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED not in plain and CONSTRAINED_TOKEN_FRAC not in plain


def test_the_trainers_first_step_mismatch_reads_free_and_constrained_tokens_apart():
    """The trainer's sums over two micro-batches (a row each), as its first optimizer step adds them."""
    sums = StepSums(rollout_mismatch=True)
    for r in range(2):
        lb = SimpleNamespace(rollout_logp=ROLLOUT[r:r + 1], mask=MASK[r:r + 1].float())
        sums.add_mismatch(OLD[r:r + 1], lb, CONSTRAINED[r:r + 1])
    out = sums.metrics("none")
    for name, value in HAND.items():
        assert out[name] == pytest.approx(value, abs=1e-6), name


def test_the_gateway_marks_the_tokens_a_strict_calls_grammar_constrained():
    """A session's answer with free text and a strict tool's call (tool_choice auto: the structural tag), then a free
    answer (tool_choice none: no grammar): the trajectory marks exactly the call's tokens after its opening tag, up
    to its closing tag, found here from the decoded text. (Where a vocabulary spells a tag in several tokens, the
    grammar also masks some of the tag's own: xgrammar's trigger.)"""
    pytest.importorskip("xgrammar")
    from relax.serve.openai.chat import ChatFormat
    from tests.openai.scripted import ScriptedGateways

    tok = family_tokenizer("smollm2_chatml")
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # the tags as tokens, as Qwen's vocabulary has them
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    first = "Let me look.\n" + FAMILIES["smollm2_chatml"].tool_call + "\nThere."
    tool = {"type": "function", "function": {"name": "calculator", "strict": True, "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
        "additionalProperties": False}}}
    gateways = ScriptedGateways()
    try:
        gw, script, session, client = gateways.make(fmt, [first, "It is 42."])
        messages = [{"role": "user", "content": "What is 6 * 7?"}]
        r = client.chat.completions.create(model="policy", messages=messages, tools=[tool], max_tokens=60)
        call = r.choices[0].message.tool_calls[0]
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        client.chat.completions.create(model="policy", messages=messages, tools=[tool], tool_choice="none",
                                       max_tokens=60)
        assert "structural_tag" in script.calls[0][0]["sampling_params"]
        assert not any(k in script.calls[1][0]["sampling_params"] for k in ("structural_tag", "ebnf", "json_schema"))
        seg = session.trajectory()
        assert session.segments == 1
    finally:
        gateways.close()
    ids = script.ids(0)
    text = tok.decode(ids)
    opened = text.index("<tool_call>") + len("<tool_call>")
    closed = text.index("</tool_call>") + len("</tool_call>")
    expected = []
    for k in range(len(ids)):  # a token is the call's when it lies within (opening tag, closing tag]
        start, end = len(tok.decode(ids[:k])), len(tok.decode(ids[:k + 1]))
        expected.append(int(start >= opened and end <= closed))
    assert sum(expected) > 5
    sampled = [c for c, s in zip(seg.constrained, seg.sampled, strict=True) if s]
    assert sampled == expected + [0] * len(script.ids(1))


@pytest.mark.slow
def test_a_run_whose_agent_makes_forced_calls_shows_no_drift_on_its_free_tokens(ray_local, small_run, tmp_path,
                                                                                 trained_batches):
    """relax-train through the gateway (SGLang protocol, an embedded server behind the real router, the tiny model
    with a ChatML vocabulary holding the Hermes tags): each run is a forced call of a strict tool (its tokens under the
    call's grammar), its result, and a free answer. The free tokens' trainer log-probs equal the engine's (fp32), so
    `rollout/train_rollout_logp_abs_diff` is at its no-drift level, while the call's tokens differ by what the
    grammar masked (the untrained model spreads its probability over the whole vocabulary), as their own metric
    shows. Before the split the first metric averaged both kinds of token."""
    pytest.importorskip("xgrammar")
    from relax.config import load_config
    from relax.runner.train import run

    tok = family_tokenizer("smollm2_chatml")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.save_pretrained(tmp_path / "tok")
    cfg = load_config(small_run(
        "rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=1", "model.dtype=float32",
        f"model.tokenizer={tmp_path / 'tok'}", "model.max_position_embeddings=1024", "rollout.max_prompt_len=400",
        "rollout.max_turns=2", "rollout.max_response_len=100", "rollout.max_episode_tokens=300",
        "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.micro_batch_size=4",
        "data.reward=none", "data.agent_workers=2", "data.openai_agent=constrained_agents:forced_call_then_answer",
        "rollout.sglang.startup_timeout_s=120", steps=1))
    result = run(cfg, output_dir=tmp_path / "out")
    [(step, m)] = result.history
    assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4, m[TRAIN_ROLLOUT_LOGP_ABS_DIFF]
    assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED] > 1e-2, m[TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED]
    samples = trained_batches[step]
    assert all(e["error"] is None and e["turns"] == 2 for e in samples.episodes), samples.episodes
    free, held = constrained_split(samples.response_mask, samples.constrained)
    assert held.any() and free.any() and not (held & ~samples.response_mask.bool()).any()
    assert m[CONSTRAINED_TOKEN_FRAC] == pytest.approx(float(held.sum()) / float(samples.response_mask.sum()))
