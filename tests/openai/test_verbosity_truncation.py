"""Chat `verbosity` and Responses `text.verbosity`, and Responses `truncation: "auto"`, through the official `openai`
client against the training gateway over a scripted engine (fixed answers on SmolLM2's tokenizer): the prompt the
engine is sent is compared with transformers' own render of the template (an independent check of what Relax
rendered).

verbosity follows reasoning_effort (tests/openai/test_reasoning_effort_variable.py): "medium", OpenAI's default, is
accepted on every template; every value is the chat template variable `verbosity` where the template reads it; "low"
or "high" is a 400 naming verbosity (text.verbosity) where it does not.

truncation "auto": with a small context, the earliest input items are dropped (never the instructions or the last
user message) until the prompt plus max_output_tokens fits; what cannot fit is the 400 "disabled" gives.

Negative control: before this change `verbosity="medium"` was a 400 "Unrecognized request argument supplied:
verbosity" on chat and "text.verbosity: 'medium' is not supported" on Responses, and truncation "auto" a 400 naming
truncation (the tests below failed with BadRequestError).
"""

from __future__ import annotations

import copy

import pytest

from tests.agents.templates import base_tokenizer
from tests.openai.scripted import Script, limits

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "What is 3 + 4?"}]
# a template that reads verbosity (as gpt-5-style templates might): a system line before SmolLM2's own render
READS = "{% if verbosity is defined %}<|im_start|>system\nVerbosity: {{ verbosity }}<|im_end|>\n{% endif %}"


def _format(tok):
    from relax.serve.openai.chat import ChatFormat

    return ChatFormat(tok, (tok.eos_token_id,))


def reading_tokenizer():
    tok = copy.deepcopy(base_tokenizer())
    tok.chat_template = READS + tok.chat_template
    return tok


def rendered(tok, messages, **variables) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def sent(script: Script, k: int = -1) -> list[int]:
    """The prompt of the engine's k-th call."""
    return list(script.calls[k][0]["input_ids"])


def test_medium_is_accepted_on_a_template_that_does_not_read_verbosity(scripted_gateway):
    tok = base_tokenizer()
    assert "verbosity" not in tok.chat_template
    _, script, _, client = scripted_gateway(_format(tok), ["7"])
    r = client.chat.completions.create(model="m", messages=USER, verbosity="medium", max_tokens=4)
    assert r.choices[0].message.content == "7" and sent(script) == rendered(tok, USER)
    r = client.responses.create(model="m", input=USER[0]["content"], text={"verbosity": "medium"})
    assert r.output_text == "7" and sent(script) == rendered(tok, USER)
    for value in ("low", "high"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=USER, verbosity=value)
        assert info.value.body["param"] == "verbosity" and "does not read verbosity" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input="hi", text={"verbosity": value})
        assert info.value.body["param"] == "text.verbosity"
    assert len(script.calls) == 2


def test_each_verbosity_is_the_template_variable_where_the_template_reads_it(scripted_gateway):
    tok = reading_tokenizer()
    _, script, _, client = scripted_gateway(_format(tok), ["7"])
    for value in ("low", "medium", "high"):
        client.chat.completions.create(model="m", messages=USER, verbosity=value, max_tokens=4)
        assert sent(script) == rendered(tok, USER, verbosity=value)
        assert f"Verbosity: {value}<|im_end|>" in tok.decode(sent(script))
        r = client.responses.create(model="m", input=USER[0]["content"], text={"verbosity": value})
        assert sent(script) == rendered(tok, USER, verbosity=value) and r.text.verbosity == value
    client.chat.completions.create(model="m", messages=USER, max_tokens=4)
    assert sent(script) == rendered(tok, USER) and "Verbosity" not in tok.decode(sent(script))
    client.chat.completions.create(model="m", messages=USER, verbosity="low", max_tokens=4,
                                   extra_body={"chat_template_kwargs": {"verbosity": "high"}})
    assert sent(script) == rendered(tok, USER, verbosity="high")  # the request's own kwargs win


@pytest.mark.parametrize("value", ["verbose", "", 3])
def test_a_value_openai_does_not_define_is_a_400_naming_verbosity(scripted_gateway, value):
    _, script, _, client = scripted_gateway(_format(reading_tokenizer()), ["7"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, verbosity=value)
    assert info.value.body["param"] == "verbosity" and "low, medium, high" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="hi", text={"verbosity": value})
    assert info.value.body["param"] == "text.verbosity" and script.calls == []


# --------------------------------------------------------------------------------------------------- truncation
INSTRUCTIONS = "Answer briefly."
TURNS = [{"role": "user", "content": f"Question number {k}: what is {k} plus {k}? Think of it carefully."}
         if k % 2 == 0 else {"role": "assistant", "content": f"It is {k - 1 + k - 1}, as far as I can tell here."}
         for k in range(6)]  # user, assistant, user, assistant, user, assistant
LAST = {"role": "user", "content": "And the last one?"}


@pytest.fixture
def small_context():
    """make(context_length) -> (script, client): the gateway over a scripted engine with that context."""
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService

    made = []

    def make(context_length: int):
        tok = base_tokenizer()
        script = Script(_format(tok), ["7"])
        gw = Gateway(OpenAIService(_format(tok), script, model="m", context_length=context_length,
                                   max_tokens=64)).start()
        made.append(gw)
        session = gw.open(0, limits())
        return tok, script, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)

    yield make
    for gw in made:
        gw.close()


def test_truncation_auto_drops_the_earliest_items_until_the_prompt_fits(small_context):
    """The context holds the instructions, the last two turns and the question with 8 tokens to spare: "auto" sends
    exactly the render of [instructions] + the conversation's longest suffix that fits (found by a brute-force loop
    over transformers' renders); "disabled" (and the default) is the 400 naming input."""
    tok = base_tokenizer()
    system = [{"role": "system", "content": INSTRUCTIONS}]
    conversation = TURNS + [LAST]
    keep = 3  # the last assistant turn, ... : the size the context is made for
    budget = len(rendered(tok, system + conversation[-keep:])) + 8
    _, script, client = small_context(budget)
    items = [{"role": m["role"], "content": m["content"]} for m in conversation]
    r = client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, truncation="auto",
                                max_output_tokens=8)
    fits = next(conversation[k:] for k in range(len(conversation))
                if len(rendered(tok, system + conversation[k:])) + 8 <= budget)
    assert sent(script) == rendered(tok, system + fits) and r.truncation == "auto" and r.output_text == "7"
    assert r.usage.input_tokens == len(sent(script)) and len(fits) < len(conversation)
    events = list(client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, truncation="auto",
                                          max_output_tokens=8, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "7"
    assert sent(script) == rendered(tok, system + fits) and events[-1].response.usage.input_tokens == len(sent(script))
    for kw in ({"truncation": "disabled"}, {}):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, max_output_tokens=8, **kw)
        assert info.value.body["code"] == "context_length_exceeded"
    assert len(script.calls) == 2


def test_truncation_auto_keeps_the_instructions_and_the_last_user_message(small_context):
    """A last user message that does not fit with the instructions even alone: the error "disabled" gives, nothing
    sampled; a call's result is dropped with the call it answers."""
    tok = base_tokenizer()
    system = [{"role": "system", "content": INSTRUCTIONS}]
    budget = len(rendered(tok, system + [LAST])) + 4
    _, script, client = small_context(budget)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", instructions=INSTRUCTIONS, input=[*TURNS, LAST], truncation="auto",
                                max_output_tokens=8)
    assert info.value.body["code"] == "context_length_exceeded" and script.calls == []
    calls = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a long result " * 20}]
    r = client.responses.create(model="m", instructions=INSTRUCTIONS, input=[*TURNS[:1], *calls, LAST],
                                truncation="auto", max_output_tokens=4)
    assert sent(script) == rendered(tok, system + [LAST]) and r.status == "completed"


def test_openai_agents_model_settings_verbosity_and_truncation_run(scripted_gateway):
    """openai-agents' ModelSettings(verbosity="medium", truncation="auto") on its Responses model and on its chat
    model (the SDK drops truncation there): both runs answer, and the Responses call's prompt is the template's
    render of the instructions and the question (nothing to drop)."""
    from agents import Agent, ModelSettings, RunConfig, Runner
    from agents.models.openai_provider import OpenAIProvider

    tok = base_tokenizer()
    gw, script, session, _ = scripted_gateway(_format(tok), ["7"])
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
    agent = Agent(name="a", instructions=INSTRUCTIONS, model="policy",
                  model_settings=ModelSettings(verbosity="medium", truncation="auto"))
    for use_responses in (True, False):
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=use_responses),
                           tracing_disabled=True)
        assert Runner.run_sync(agent, USER[0]["content"], run_config=config).final_output == "7"
        assert sent(script) == rendered(tok, [{"role": "system", "content": INSTRUCTIONS}, *USER])
