"""`reasoning_effort` (chat route) and `reasoning.effort` (Responses) as the chat template variable `reasoning_effort`,
as SGLang's chat route passes it to `apply_chat_template` (gpt-oss's template writes `Reasoning: <effort>` into its
system message, "medium" unless given): through the official `openai` client against relax-serve with the tiny model
on a gpt-oss vocabulary and template (tests/agents/templates.py). The check is independent of Relax's rendering: the
answer to a chat call with an effort, its prompt size and every sampled token's log-prob, is the completion (same
seed) of transformers' own render of the template with that variable, sent as token ids, and differs from the one of
another effort. A template that does not mention reasoning_effort cannot honour an effort other than "none": a 400
naming reasoning_effort (reasoning.effort on the Responses route), as before.

Negative control: before this change every effort but "none" was a 400 naming reasoning_effort on every template
(`test_each_effort_renders_as_the_template_variable` failed with BadRequestError).
"""

from __future__ import annotations

import pytest

from tests.agents.templates import base_tokenizer, family_tokenizer, gpt_oss_tokenizer
from tests.openai.serving import tiny_server

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "What is 3 + 4?"}]
SEED, TOKENS = 5, 6


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(the official client of relax-serve on gpt-oss's template, the tokenizer)."""
    tok = gpt_oss_tokenizer()
    # gpt-oss's template has a place for tools in a format data.tool_parser=auto does not know
    with tiny_server(tmp_path_factory.mktemp("gpt-oss"), tok, "data.tool_parser=hermes") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), tok


def rendered(tok, **variables) -> list[int]:
    """Transformers' own render of the question with the template's `variables`, as token ids."""
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **variables)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def completion(client, prompt: list[int]) -> tuple[int, list[float]]:
    """(prompt tokens, the sampled tokens' log-probs) of a completion of `prompt` at SEED."""
    r = client.completions.create(model="m", prompt=prompt, max_tokens=TOKENS, seed=SEED, logprobs=0)
    return r.usage.prompt_tokens, list(r.choices[0].logprobs.token_logprobs)


def chat(client, **kw) -> tuple[int, list[float]]:
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=TOKENS, seed=SEED, logprobs=True, **kw)
    return r.usage.prompt_tokens, [t.logprob for t in r.choices[0].logprobs.content]


def test_each_effort_renders_as_the_template_variable(gpt_oss):
    """low, medium, high and minimal each answer as the completion of the template rendered with that
    reasoning_effort; no effort: the template's own default (medium); the renders differ, and so do the answers of
    low and high."""
    client, tok = gpt_oss
    answers = {}
    for effort in ("low", "medium", "high", "minimal"):
        prompt = rendered(tok, reasoning_effort=effort)
        assert f"Reasoning: {effort}\n" in tok.decode(prompt)
        answers[effort] = chat(client, reasoning_effort=effort)
        assert answers[effort][0] == len(prompt)
        assert answers[effort][1] == pytest.approx(completion(client, prompt)[1], abs=1e-5)
    assert chat(client) == pytest.approx(answers["medium"])
    assert rendered(tok) == rendered(tok, reasoning_effort="medium")
    assert len({tuple(rendered(tok, reasoning_effort=e)) for e in answers}) == 4
    assert answers["low"][1] != pytest.approx(answers["high"][1], abs=1e-5)


def test_the_responses_route_renders_reasoning_effort_as_the_chat_route(gpt_oss):
    """reasoning={"effort": "high"} is the chat call's reasoning_effort: the same prompt and the same sampled tokens
    (their log-probs) as the chat call with the same seed and the completion of the template's render with
    reasoning_effort "high"; the response echoes the effort."""
    client, tok = gpt_oss
    r = client.responses.create(model="m", input=USER[0]["content"], reasoning={"effort": "high"},
                                max_output_tokens=TOKENS, include=["message.output_text.logprobs"],
                                extra_body={"seed": SEED})
    size, lps = completion(client, rendered(tok, reasoning_effort="high"))
    assert r.usage.input_tokens == size and chat(client, reasoning_effort="high") == pytest.approx((size, lps))
    assert [t.logprob for t in r.output[-1].content[0].logprobs] == pytest.approx(lps, abs=1e-5)
    assert r.reasoning.effort == "high"


def test_the_request_s_own_chat_template_kwargs_reasoning_effort_wins(gpt_oss):
    """chat_template_kwargs.reasoning_effort beside reasoning_effort: the kwargs' value is rendered (SGLang takes it
    from there first); "none" is rendered too (gpt-oss's template writes whatever it is given), beside
    thinking/enable_thinking false."""
    client, tok = gpt_oss
    both = chat(client, reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert both == pytest.approx(completion(client, rendered(tok, reasoning_effort="high")))
    none = chat(client, reasoning_effort="none")
    off = rendered(tok, reasoning_effort="none", thinking=False, enable_thinking=False)
    assert none == pytest.approx(completion(client, off)) and "Reasoning: none\n" in tok.decode(off)


@pytest.mark.parametrize("effort", ["extreme", "", 3, ["high"]])
def test_a_value_openai_does_not_define_is_a_400_naming_reasoning_effort(gpt_oss, effort):
    client, _ = gpt_oss
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, reasoning_effort=effort)
    assert info.value.body["param"] == "reasoning_effort" and "minimal, low, medium, high" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="hi", max_output_tokens=2, reasoning={"effort": effort})
    assert info.value.body["param"] == "reasoning.effort"


def test_a_template_that_does_not_read_reasoning_effort_refuses_an_effort(scripted_gateway):
    """SmolLM2's ChatML and Qwen3's template never mention reasoning_effort: "high" is a 400 naming reasoning_effort
    that says so (reasoning.effort on the Responses route), nothing sampled."""
    from relax.serve.openai.chat import ChatFormat

    for tok in (base_tokenizer(), family_tokenizer("qwen3")):
        assert "reasoning_effort" not in tok.chat_template
        _, script, _, client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["7"])
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=USER, reasoning_effort="high")
        assert info.value.body["param"] == "reasoning_effort"
        assert "does not read reasoning_effort" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input="hi", reasoning={"effort": "low"})
        assert info.value.body["param"] == "reasoning.effort" and script.calls == []


def test_the_responses_route_echoes_the_effort_the_template_rendered(gpt_oss):
    """reasoning.effort echoes the effort applied, as OpenAI echoes the effective value: without one, the template's
    own default, "medium" (transformers' render without the variable is its render with "medium", and the answer is
    the one of reasoning.effort "medium", same seed); a given effort, or one inside chat_template_kwargs (which wins,
    as SGLang takes it from there first), is echoed as rendered; streamed, the first and last events say the same.
    Before, a request without an effort echoed null."""
    client, tok = gpt_oss
    assert rendered(tok) == rendered(tok, reasoning_effort="medium") != rendered(tok, reasoning_effort="high")
    kw = dict(model="m", input=USER[0]["content"], max_output_tokens=TOKENS, include=["message.output_text.logprobs"])
    unset = client.responses.create(**kw, extra_body={"seed": SEED})
    medium = client.responses.create(**kw, reasoning={"effort": "medium"}, extra_body={"seed": SEED})
    assert unset.reasoning.effort == medium.reasoning.effort == "medium"
    assert unset.usage.input_tokens == medium.usage.input_tokens == len(rendered(tok))
    assert [t.logprob for t in unset.output[-1].content[0].logprobs] == pytest.approx(
        [t.logprob for t in medium.output[-1].content[0].logprobs], abs=1e-6)
    assert client.responses.create(**kw, reasoning={"effort": "low"}).reasoning.effort == "low"
    inner = client.responses.create(**kw, reasoning={"effort": "low"},
                                    extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert inner.reasoning.effort == "high" and inner.usage.input_tokens == len(rendered(tok, reasoning_effort="high"))
    events = list(client.responses.create(**kw, stream=True))
    assert events[0].response.reasoning.effort == events[-1].response.reasoning.effort == "medium"


def test_a_template_without_reasoning_echoes_no_effort(tmp_path):
    """A template with neither an effort variable nor <think> blocks (the base ChatML): the model does not reason
    and no effort is applied, so reasoning.effort echoes null (as OpenAI does for a model without reasoning), and
    "none", which holds there, echoes "none"."""
    with tiny_server(tmp_path, base_tokenizer()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        kw = dict(model="m", input="hi", max_output_tokens=2)
        assert client.responses.create(**kw).reasoning.effort is None
        assert client.responses.create(**kw, reasoning={"effort": "none"}).reasoning.effort == "none"
