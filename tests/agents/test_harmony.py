"""gpt-oss (harmony) as a family: its answers read by the `harmony` parser (`relax.agents.parsers.parse_harmony`:
analysis -> reasoning, final -> content, `commentary to=functions.NAME` -> calls), picked by `data.tool_parser=auto`
from its template; its markers kept by the message decoder on its vocabulary only; tool results rendered as its
template names them (after the call they answer: `relax.agents.render`), and a multi-turn episode with a tool whose
context is exactly the tokens sampled plus the observations the template writes.

The strings are hand-written from the harmony format (OpenAI's "harmony response format" guide), independent of the
parser; the template is the fixture's rendition of gpt-oss's chat_template.jinja (tests/agents/templates.py).
"""

from __future__ import annotations

import copy
import json

import pytest

from relax.agents.episode import Episode
from relax.agents.loops import AgentFactory
from relax.agents.parsers import (
    BUILTIN_PARSERS,
    CallError,
    ToolCall,
    get_parser,
    harmony_content,
    harmony_reasoning,
    message_decoder,
    parse_harmony,
    parser_for_template,
    write_calls,
)
from relax.agents.render import ObservationRenderer, check_template
from tests.agents.templates import GPT_OSS, base_tokenizer, family_tokenizer, gpt_oss_tokenizer

ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|start|>assistant"


def call(name: str, args: str) -> str:
    """A call as gpt-oss writes it (harmony guide: recipient after the channel, content type constrained)."""
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


# ------------------------------------------------------------------------------------------------ the parser
def test_analysis_then_a_call():
    text = f"{ANALYSIS}Need the weather.<|end|>{NEXT}" + call("get_weather", '{"city": "Paris"}')
    parsed = parse_harmony(text)
    assert parsed.items == (ToolCall("get_weather", {"city": "Paris"}),) and parsed.content == ""
    assert harmony_reasoning(text) == ("Need the weather.", text.index(NEXT))


def test_analysis_then_a_final_answer():
    text = f"{ANALYSIS}2 + 2 is 4.<|end|>{NEXT}<|channel|>final<|message|>The answer is 4.<|return|>"
    assert parse_harmony(text).items == () and parse_harmony(text).content == "The answer is 4."
    assert harmony_reasoning(text)[0] == "2 + 2 is 4."
    assert harmony_content(text) == "The answer is 4."
    assert harmony_content(text, reasoning_in_content=True) == "2 + 2 is 4.\nThe answer is 4."


def test_the_templates_history_form_and_a_preamble():
    """The recipient before the channel and ` json` without <|constrain|> (how gpt-oss's template writes history);
    a commentary message without a recipient is a preamble: content."""
    text = (f"<|channel|>commentary<|message|>Let me check.<|end|>{NEXT} to=functions.lookup<|channel|>commentary json"
            '<|message|>{"q": "x", "n": [1, 2]}<|call|>')
    parsed = parse_harmony(text)
    assert parsed.items == (ToolCall("lookup", {"q": "x", "n": [1, 2]}),) and parsed.content == "Let me check."
    assert harmony_reasoning(text) is None


def test_malformed_calls_are_errors_in_their_place():
    text = f"{call('a', '{}')}{NEXT}{call('b', '{not json}')}{NEXT}{call('c', '[1]')}"
    items = parse_harmony(text).items
    assert items[0] == ToolCall("a", {})
    assert isinstance(items[1], CallError) and "invalid JSON in the arguments of 'b'" in items[1].message
    assert items[2] == CallError("the arguments of 'c' are not a JSON object")


def test_a_cut_answer_keeps_its_complete_calls_and_drops_a_marker_fragment():
    first = call("a", '{"x": 1}')
    cut_in_body = f'{first}{NEXT}<|channel|>commentary to=functions.b <|constrain|>json<|message|>{{"x": '
    items = parse_harmony(cut_in_body).items
    assert items[0] == ToolCall("a", {"x": 1}) and isinstance(items[1], CallError) and len(items) == 2
    cut_in_header = f"{ANALYSIS}hm<|end|>{NEXT}<|channel|>commentary to=functions.b"
    assert parse_harmony(cut_in_header).items == () and parse_harmony(cut_in_header).content == ""
    assert harmony_content(cut_in_header) == ""  # neither content nor a call
    # cut right before its <|call|>: not closed, an error (the OpenAI routes put back the stop token that ended it)
    assert parse_harmony(call("a", '{"x": 1}')[:-len("<|call|>")]).items == (
        CallError("the call of 'a' is not closed by <|call|>"),)


def test_text_without_markers_is_content():
    assert parse_harmony("  just words ").content == "just words" and parse_harmony("just words").items == ()


def test_written_calls_read_back():
    calls = [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert parse_harmony(write_calls("harmony", calls)).calls == [
        ToolCall("get_weather", {"city": "Oslo"}), ToolCall("add", {"a": 1, "b": 2})]


def test_auto_picks_harmony_for_gpt_oss_only():
    assert parser_for_template(GPT_OSS) == "harmony"
    assert get_parser("auto", gpt_oss_tokenizer()) is BUILTIN_PARSERS["harmony"] is parse_harmony
    assert parser_for_template(family_tokenizer("qwen3").chat_template) == "hermes"


def test_the_decoder_keeps_harmony_markers_on_a_harmony_vocabulary_only():
    tok = gpt_oss_tokenizer()
    text = f"{ANALYSIS}x<|end|>{NEXT}{call('f', '{}')}"
    assert message_decoder(tok)(tok(text, add_special_tokens=False)["input_ids"]) == text
    # Phi-3's <|end|> (its end of turn, a special token) is no marker on a vocabulary without <|channel|>
    other = copy.deepcopy(base_tokenizer())
    other.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    assert message_decoder(other)(other("hi<|end|>", add_special_tokens=False)["input_ids"]) == "hi"


# ------------------------------------------------------------------------------------------------ rendering
TOOL_CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}
USER = [{"role": "user", "content": "What is 6 * 7?"}]


def test_gpt_oss_passes_the_template_check_for_tool_and_user_observations():
    check_template(gpt_oss_tokenizer(), "gpt-oss-fixture", ("tool", "user"))


def test_a_tool_result_renders_after_its_call_as_the_template_writes_it():
    """Brute force: the template's render of the conversation with the call and its result; what follows the call's
    <|call|> is the observation (the model's own call tokens are never re-rendered)."""
    tok = gpt_oss_tokenizer()
    full = tok.apply_chat_template(USER + [{"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                                           {"role": "tool", "content": "42"}], tokenize=False,
                                   add_generation_prompt=True)
    expected = full[full.index("<|call|>") + len("<|call|>"):]
    assert expected == '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"42"<|end|>' + NEXT
    renderer = ObservationRenderer(tok)
    obs = renderer.tokens([{"role": "tool", "content": "42"}], tok.convert_tokens_to_ids("<|call|>"), ["calculator"])
    assert tok.decode(obs) == expected


def test_a_user_message_after_a_final_answer_follows_its_return():
    """<|return|> ends the final message where the template writes <|end|> in history: that <|end|> is not
    appended again."""
    tok = gpt_oss_tokenizer()
    obs = ObservationRenderer(tok).tokens([{"role": "user", "content": "again"}], tok.eos_token_id)
    assert tok.decode(obs) == "<|start|>user<|message|>again<|end|>" + NEXT


# ------------------------------------------------------------------------------------------------ an episode
def test_an_episode_with_a_tool_call_and_a_second_turn_keeps_exactly_the_sampled_tokens():
    """The built-in tool loop with the harmony parser (as data.tool_parser=auto gives it) and the calculator: turn 1
    reasons and calls it, turn 2 answers. The episode's context, built as the engine builds it (prompt, each turn's
    sampled tokens, the observation returned), holds each turn's tokens unchanged at their place, and decodes to the
    harmony conversation written out by hand; the model's tokens (what is trained) are exactly the two turns."""
    tok = gpt_oss_tokenizer()
    call_id, return_id = tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")
    factory = AgentFactory(None, ["calculator"], None, 5.0, get_parser("auto", tok), False)
    ep = Episode({"label": "42"}, factory(), ObservationRenderer(tok), message_decoder(tok), max_turns=4,
                 max_tool_errors=2)
    prompt = tok(tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    turn1 = f"{ANALYSIS}Use the calculator.<|end|>{NEXT}{call('calculator', json.dumps({'expression': '6 * 7'}))}"
    turn2 = f"{ANALYSIS}It returned 42.<|end|>{NEXT}<|channel|>final<|message|>6 * 7 = 42.<|return|>"
    sampled = [tok(t, add_special_tokens=False)["input_ids"] for t in (turn1, turn2)]
    assert sampled[0][-1] == call_id and sampled[1][-1] == return_id
    context, model_tokens = list(prompt), []
    obs = ep.turn_end(sampled[0], call_id, len(context))
    context += sampled[0] + obs
    model_tokens += [False] * len(prompt) + [True] * len(sampled[0]) + [False] * len(obs)
    assert ep.tool_calls == 1 and ep.tool_errors == 0
    assert ep.turn_end(sampled[1], return_id, len(context)) is None and ep.end == "stop"
    context += sampled[1]
    model_tokens += [True] * len(sampled[1])
    factory.close()
    written = (turn1 + '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"42"<|end|>'
               + NEXT + turn2)
    assert tok.decode(context) == tok.decode(prompt) + written
    assert [t for t, m in zip(context, model_tokens, strict=True) if m] == sampled[0] + sampled[1]
    assert context[len(prompt):len(prompt) + len(sampled[0])] == sampled[0]
    assert ep.actions == [turn1, turn2]


@pytest.mark.parametrize("bad", ["{not json}", "[1]"])
def test_a_malformed_call_is_answered_with_an_error_named_after_its_recipient(bad):
    tok = gpt_oss_tokenizer()
    call_id = tok.convert_tokens_to_ids("<|call|>")
    factory = AgentFactory(None, ["calculator"], None, 5.0, parse_harmony, False)
    ep = Episode({"label": "42"}, factory(), ObservationRenderer(tok), message_decoder(tok), max_turns=4,
                 max_tool_errors=3)
    obs = ep.turn_end(tok(call("calculator", bad), add_special_tokens=False)["input_ids"], call_id, 10)
    factory.close()
    assert ep.tool_errors == 1
    assert tok.decode(obs).startswith("<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"
                                      '"Error: ')
