"""Reasoning read the same way everywhere, whoever opens the <think> block: the model (Qwen3) or the generation prompt
(Qwen3.5's `<|im_start|>assistant\\n<think>\\n`). Checked on the real chat templates of the fixtures
(tests/agents/templates.py, rendered by transformers' jinja):

- the OpenAI gateway splits a Qwen3.5 answer into `reasoning_content` and `content` as it splits Qwen3's (chat,
  stream, Responses), counts its reasoning tokens, and the template renders the split message back to exactly the
  tokens the model sampled;
- the text `data.reward` scores (an episode's last action, in a built-in episode and through the gateway) is for Qwen3.5
  what it is for Qwen3 with the same reasoning and answer;
- the built-in tool loop takes the reasoning off before reading calls with the function the gateway uses: a call
  written inside a <think> block is not run, and the loop and the gateway decide alike on the same texts.

Negative controls: each test fails on the code before this change (`split_reasoning` read only answers opening with
<think>, the loop parsed the whole turn, the episode's text was the sampled text alone)."""

from __future__ import annotations

import pytest

from relax.agents.episode import EpisodeMaker
from relax.agents.loops import AgentFactory
from relax.agents.parsers import get_parser, opened_reasoning, split_reasoning, uses_reasoning, without_reasoning
from relax.serve.openai.chat import ChatFormat
from tests.agents.templates import FAMILIES, family_tokenizer
from tests.openai.scripted import ScriptedGateways

REASONING, ANSWER = "Let me think: 6 * 7 = 42.", "The answer is \\boxed{42}."
USER = [{"role": "user", "content": "6*7?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture
def gateways():
    g = ScriptedGateways()
    yield g
    g.close()


def _fmt(name: str) -> ChatFormat:
    tok = family_tokenizer(name)
    return ChatFormat(tok, (tok.eos_token_id,))


def test_the_qwen3_5_generation_prompt_opens_a_block_and_qwen3s_does_not():
    """What decides the reading: the real templates' generation prompts (the premise of every test below)."""
    q35 = family_tokenizer("qwen3_5").apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    q3 = family_tokenizer("qwen3").apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert q35.endswith("<|im_start|>assistant\n<think>\n") and opened_reasoning(q35) == "<think>\n"
    assert opened_reasoning(q3) == "" and uses_reasoning(family_tokenizer("qwen3"))
    # thinking switched off: Qwen3.5 writes a closed empty block, which opens nothing
    off = family_tokenizer("qwen3_5").apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                                          enable_thinking=False)
    assert off.endswith("</think>\n\n") and opened_reasoning(off) == ""
    assert not uses_reasoning(family_tokenizer("smollm2_chatml"))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_gateway_splits_the_reasoning_whoever_opened_the_block(gateways, family):
    fam, fmt = FAMILIES[family], _fmt(family)
    sampled = fam.sampled(REASONING, ANSWER)  # Qwen3.5: 'Let me think ...\n</think>\n\nThe answer ...' (no <think>)
    gw, script, session, client = gateways.make(fmt, [sampled])
    r = client.chat.completions.create(model="policy", messages=USER)
    m = r.choices[0].message
    assert (m.content, m.reasoning_content) == (ANSWER, REASONING)
    # the reasoning tokens: the sampled ones through </think> (counted by the tokenizer, on their own)
    block = sampled[:sampled.index("</think>") + len("</think>")]
    assert r.usage.completion_tokens_details.reasoning_tokens == len(fmt.encode(block))
    # the template renders the split message back to exactly the prompt and the tokens the model sampled
    tok = family_tokenizer(family)
    prompt = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    again = tok.apply_chat_template(USER + [{"role": "assistant", "content": m.content,
                                             "reasoning_content": m.reasoning_content}], tokenize=False)
    assert again.startswith(prompt + sampled + "<|im_end|>")
    # streamed: the reasoning as reasoning_content deltas, the content as content deltas
    gw, script, session, client = gateways.make(fmt, [sampled])
    chunks = list(client.chat.completions.create(model="policy", messages=USER, stream=True))
    said = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (content, said) == (ANSWER, REASONING)
    # the Responses API: a reasoning item, then the message without the reasoning
    gw, script, session, client = gateways.make(fmt, [sampled])
    resp = client.responses.create(model="policy", input="6*7?")
    kinds = [o.type for o in resp.output]
    assert kinds == ["reasoning", "message"] and resp.output_text == ANSWER
    assert resp.output[0].content[0].text == REASONING
    assert resp.usage.output_tokens_details.reasoning_tokens == len(fmt.encode(block))


def test_a_cut_answer_inside_an_opened_block_is_all_reasoning(gateways):
    fmt = _fmt("qwen3_5")
    gw, script, session, client = gateways.make(fmt, ["Let me think about"])  # no </think>: cut at its limit
    m = client.chat.completions.create(model="policy", messages=USER).choices[0].message
    assert (m.content, m.reasoning_content) == ("", "Let me think about")
    # with thinking off the block is closed by the prompt: the answer is all content
    gw, script, session, client = gateways.make(fmt, [ANSWER])
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    m = client.chat.completions.create(model="policy", messages=USER, extra_body=off).choices[0].message
    assert (m.content, getattr(m, "reasoning_content", None)) == (ANSWER, None)


def _episode_text(family: str, sampled: str) -> str:
    """The text `data.reward` scores for a one-turn episode whose model sampled `sampled` (the scorer reads the last
    action, relax.runner.rollout_driver.scoring.score)."""
    tok = family_tokenizer(family)
    maker = EpisodeMaker(AgentFactory(None, [], None, None), tok, max_turns=2, max_tool_errors=1)
    prompt_text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    ep = maker.new({"prompt_text": prompt_text, "label": "42"})
    tokens = list(tok(sampled, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    assert ep.turn_end(tokens, tok.eos_token_id, 10) is None and ep.end == "stop"
    return ep.record()["actions"][-1]


def test_the_reward_reads_a_qwen3_5_turn_as_a_qwen3_turn():
    q3 = _episode_text("qwen3", FAMILIES["qwen3"].sampled(REASONING, ANSWER))
    q35 = _episode_text("qwen3_5", FAMILIES["qwen3_5"].sampled(REASONING, ANSWER))
    assert q35 == q3 == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert without_reasoning(q35) == ANSWER  # what a reward that leaves out the reasoning reads


def test_every_turn_of_a_qwen3_5_episode_reads_as_a_qwen3_turn_also_after_a_resume():
    """Turn 2 follows a tool result, whose observation ends with the generation prompt's `<think>\n` again (the
    template's own render); a restored episode (partial rollout, checkpoint) keeps reading its next turn so."""
    texts = {}
    for family in ("qwen3", "qwen3_5"):
        fam, tok = FAMILIES[family], family_tokenizer(family)
        factory = AgentFactory(None, ["calculator"], None, None, get_parser("auto", tok), uses_reasoning(tok))
        maker = EpisodeMaker(factory, tok, max_turns=3, max_tool_errors=3)
        prompt_text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
        ep = maker.new({"prompt_text": prompt_text, "label": "42"})

        def turn(episode, sampled, tok=tok):
            return episode.turn_end(list(tok(sampled, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id],
                                    tok.eos_token_id, 10)

        obs = turn(ep, fam.sampled("I should compute it.", fam.tool_call))
        assert obs is not None and ep.tool_calls == 1
        assert tok.decode(obs).endswith(fam.prompt_part or "<|im_start|>assistant\n")  # the template's own render
        again = maker.restore(ep.record())
        for episode in (ep, again):
            assert turn(episode, fam.sampled(REASONING, ANSWER)) is None and episode.end == "stop"
        assert ep.record()["actions"] == again.record()["actions"]
        texts[family] = ep.record()["actions"]
        factory.close()
    assert texts["qwen3_5"][1] == texts["qwen3"][1] == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert texts["qwen3_5"][0].startswith("<think>\nI should compute it.\n</think>")


def test_the_gateway_records_a_qwen3_5_answer_for_the_reward_as_a_qwen3_answer(gateways):
    texts = {}
    for family in ("qwen3", "qwen3_5"):
        gw, script, session, client = gateways.make(_fmt(family), [FAMILIES[family].sampled(REASONING, ANSWER)])
        client.chat.completions.create(model="policy", messages=USER)
        texts[family] = session.trajectory().answers[-1]  # the episode's last action: what data.reward scores
    assert texts["qwen3_5"] == texts["qwen3"] == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
XML_CALL = FAMILIES["qwen3_5"].tool_call
TURNS = {  # (family, the text the model samples, whether it calls the tool)
    "call_in_think": ("qwen3", f"<think>\nThe format would be {CALL}, but I know it: 42.\n</think>\n\n{ANSWER}",
                      False),
    "call_after_think": ("qwen3", f"<think>\nI should compute it.\n</think>\n\n{CALL}", True),
    "plain_call": ("qwen3", CALL, True),
    "unclosed_think": ("qwen3", f"<think>\nmaybe {CALL}", False),
    "q35_call_in_think": ("qwen3_5", f"The format would be {XML_CALL}, but I know it.\n</think>\n\n{ANSWER}", False),
    "q35_call_after_think": ("qwen3_5", f"I should compute it.\n</think>\n\n{XML_CALL}", True),
    "chatml_no_think": ("smollm2_chatml", CALL, True),
}


@pytest.mark.parametrize("case", list(TURNS))
def test_the_tool_loop_and_the_gateway_decide_alike(gateways, case):
    family, sampled, calls = TURNS[case]
    tok = family_tokenizer(family)
    # the built-in tool loop (data.tools=[calculator]) as a run builds it: EpisodeMaker.for_config's factory
    factory = AgentFactory(None, ["calculator"], None, None, get_parser("auto", tok), uses_reasoning(tok))
    try:
        maker = EpisodeMaker(factory, tok, max_turns=3, max_tool_errors=3)
        prompt_text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
        ep = maker.new({"prompt_text": prompt_text, "label": "42"})
        obs = ep.turn_end(list(tok(sampled, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id],
                          tok.eos_token_id, 10)
    finally:
        factory.close()
    # the gateway, the same text
    gw, script, session, client = gateways.make(_fmt(family), [sampled])
    m = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS).choices[0].message
    assert (m.tool_calls is not None) == calls
    assert (ep.tool_calls > 0) == calls and (obs is not None) == calls
    assert ep.end == (None if calls else "stop")


def test_split_reasoning_reads_an_opened_block_up_to_its_end():
    text = "  R1\n</think>\n\nA <think>x</think>"
    (r0, r1), c = split_reasoning(text, opened=True)
    assert (text[r0:r1], text[c:]) == ("R1", "A <think>x</think>")
    assert split_reasoning(text) is None  # not opened, and it does not open with <think>
    assert split_reasoning("<think>R</think>A") == ((7, 8), 16)
