"""A reasoning model's reasoning before a constrained answer stays free (docs/agents.md, "Constrained tokens in
training"): through the training gateway, an answer to a `response_format` or a forced call of a model whose chat
template reasons is sampled under `after_reasoning`'s grammar, whose reasoning part forbids only a second `<think>`
and the stop token. The trajectory marks the tokens of the answer's leading `<think>` block (its `</think>` and the
blanks after it included) free and those of the JSON or the call constrained, found here from the decoded text, for
the family fixtures that reason: Qwen3 (the model opens the block), Qwen3.5 (the prompt opens it) and GLM-4.5 (a
newline before the block)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import FAMILIES, family_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
# the sampled answer of each family (the prompt of Qwen3.5 opens the block: its answer starts inside it)
REASONING = {"qwen3": "<think>\nLet me think about it.\n</think>\n\n",
             "qwen3_5": "Let me think about it.\n</think>\n\n",
             "glm4_5": "\n<think>Let me think about it.</think>\n"}


def marks(name: str, answer: str, **request) -> tuple[list[int], list[int], object]:
    """The constrained marks the gateway records for `answer` (the scripted engine's answer to one call with
    `request`'s fields), its sampled token ids and the tokenizer."""
    from relax.serve.openai.chat import ChatFormat
    from tests.openai.scripted import ScriptedGateways

    tok = family_tokenizer(name)
    stops = tuple(sorted({tok.convert_tokens_to_ids(t) for t in FAMILIES[name].stop.values()}))
    fmt = ChatFormat(tok, stops)
    assert fmt.reasoning
    gateways = ScriptedGateways()
    try:
        _, script, session, client = gateways.make(fmt, [answer])
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x?"}], max_tokens=60,
                                       **request)
        assert "structural_tag" in script.calls[0][0]["sampling_params"]  # after_reasoning's grammar
        seg = session.trajectory()
    finally:
        gateways.close()
    return [c for c, s in zip(seg.constrained, seg.sampled, strict=True) if s], script.ids(0), tok


def expected(tok, ids: list[int], think: str) -> list[int]:
    """0 for a token that lies within the reasoning text `think` (the answer's start), 1 for the rest (the stop token
    included: the only token the complete answer allows)."""
    return [int(len(tok.decode(ids[:k + 1])) > len(think)) for k in range(len(ids))]


@pytest.mark.parametrize("name", sorted(REASONING))
def test_the_reasoning_before_a_response_format_answer_is_free(name):
    pytest.importorskip("xgrammar")
    think = REASONING[name]
    got, ids, tok = marks(name, think + '{"x": 1}', response_format=FORMAT)
    assert tok.decode(ids).startswith(think + '{"x": 1}')
    want = expected(tok, ids, think)
    assert want.count(0) > 5 and want.count(1) > 3
    assert got == want


def test_the_reasoning_before_a_forced_call_is_free():
    pytest.importorskip("xgrammar")
    think = REASONING["qwen3"]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    got, ids, tok = marks("qwen3", think + call, tools=[TOOL], tool_choice="required")
    want = expected(tok, ids, think)
    assert want.count(0) > 5 and want.count(1) > 5
    assert got == want


def test_strict_tools_reasoning_is_free_whether_the_prompt_or_the_model_opens_the_block():
    """Strict tools (free text whose calls are constrained) after the reasoning: free as a format's reasoning is, for
    Qwen3.5 (the block required: its reasoning forbids the markers and the stop token) as for Qwen3 (the block
    optional: the free text after it also admits every token, so nothing was masked)."""
    pytest.importorskip("xgrammar")
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    strict["function"]["parameters"] = {**TOOL["function"]["parameters"], "additionalProperties": False}
    for name in ("qwen3_5", "qwen3"):
        got, ids, _ = marks(name, REASONING[name] + "It is 42.", tools=[strict])
        assert got == [0] * len(ids), name


def test_an_answer_without_reasoning_is_constrained_from_its_first_token():
    """Qwen3 with no block (optional there): nothing of the JSON counts free."""
    pytest.importorskip("xgrammar")
    got, ids, _ = marks("qwen3", '{"x": 1}', response_format=FORMAT)
    assert got == [1] * len(ids)


@pytest.mark.slow
def test_a_run_whose_forced_calls_reason_first_shows_no_drift_on_the_reasoning(ray_local, small_run, tmp_path,
                                                                                trained_batches):
    """relax-train through the gateway with the Qwen3.5 fixture (its prompt opens the `<think>` block): each forced
    call's answer reasons first, under the grammar, and the untrained model's reasoning runs to its token limit. Those
    tokens are free: the constrained share stays under the forced answers' (half the tokens, every one of them counted
    constrained before), and the no-drift metric, which now reads them, stays at its fp32 level (the grammar masks
    only a second `<think>` and the stop token there)."""
    pytest.importorskip("xgrammar")
    from relax.config import load_config
    from relax.metrics import CONSTRAINED_TOKEN_FRAC, TRAIN_ROLLOUT_LOGP_ABS_DIFF
    from relax.runner.train import run

    family_tokenizer("qwen3_5").save_pretrained(tmp_path / "tok")
    cfg = load_config(small_run(
        "rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=1", "model.dtype=float32",
        f"model.tokenizer={tmp_path / 'tok'}", "model.max_position_embeddings=1024", "rollout.max_prompt_len=400",
        "rollout.max_turns=2", "rollout.max_response_len=16", "rollout.max_episode_tokens=300",
        "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.micro_batch_size=4",
        "data.reward=none", "data.agent_workers=2", "data.openai_agent=reasoning_agents:forced_call_after_reasoning",
        "rollout.sglang.startup_timeout_s=120", steps=1))
    result = run(cfg, output_dir=tmp_path / "out")
    [(step, m)] = result.history
    assert all(e["error"] is None for e in trained_batches[step].episodes)
    assert m.get(CONSTRAINED_TOKEN_FRAC, 0.0) < 0.25, m
    assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4, m[TRAIN_ROLLOUT_LOGP_ABS_DIFF]
