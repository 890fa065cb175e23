"""The Responses API's `include: ["reasoning.encrypted_content"]` with `store: false`, what Codex CLI (and an
openai-agents Responses model with `response_include`) sends to keep its reasoning across stateless turns: the
reasoning item of the answer carries an `encrypted_content`, and that item sent back in a later input (with its
content, or with the encrypted_content alone, as Codex keeps it) is rendered exactly as the reasoning text sent in
the item's content: the same prompt tokens. Through the official `openai` client against relax-serve with the tiny
model on Qwen3.5's template (tests/agents/templates.py), whose generation prompt opens a <think> block, so the tiny
model's answer is reasoning; its reasoning is rendered back in the assistant turn of a tool loop. The check is
independent of Relax's rendering: the follow-up's answer (prompt size, each sampled token's log-prob) is the
completion, at the same seed, of transformers' own render of the conversation with that reasoning.

An encrypted_content Relax did not write (OpenAI's, an altered one, another server's) is a 400 naming
input[i].encrypted_content; every other `include` value the Responses API defines is a 400 naming include and the
value. In a training session (the gateway) the round trip keeps the episode one trajectory.

Negative control: before this change `include: ["reasoning.encrypted_content"]` was a 400 naming include, and any
encrypted_content in an input a 400 naming it (`test_reasoning_comes_back_through_its_encrypted_content` failed
with BadRequestError on its first call).
"""

from __future__ import annotations

import base64
import json
import typing

import pytest

from tests.agents.templates import FAMILIES, family_tokenizer
from tests.openai.serving import tiny_server

openai = pytest.importorskip("openai")
from openai.types.responses import ResponseIncludable  # noqa: E402

ENCRYPTED_INCLUDE, LOGPROBS_INCLUDE = "reasoning.encrypted_content", "message.output_text.logprobs"
SEAL_PREFIX = "relax-reasoning-v1."  # the documented envelope (docs/agents.md)
# every include value the openai package defines that names what Relax does not have (built-in tools' outputs,
# input images)
OTHER_INCLUDES = [v for v in typing.get_args(ResponseIncludable) if v not in (ENCRYPTED_INCLUDE, LOGPROBS_INCLUDE)]

QUESTION = "What is 1 + 1?"
TOOL = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": '{"expression": "1 + 1"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "2"}
SEED, TOKENS = 7, 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the official client of relax-serve on Qwen3.5's template, the tokenizer)."""
    tok = family_tokenizer("qwen3_5")
    with tiny_server(tmp_path_factory.mktemp("qwen3_5"), tok) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), tok


def reasoned(client) -> tuple[str, str, dict]:
    """(the reasoning text, its encrypted_content, the reasoning item as the client dumps it) of a first, stateless
    call that asks for the encrypted reasoning."""
    r = client.responses.create(model="m", input=QUESTION, tools=[TOOL], store=False, include=[ENCRYPTED_INCLUDE],
                                max_output_tokens=TOKENS, extra_body={"seed": 1})
    item = r.output[0]
    assert item.type == "reasoning" and item.content[0].text
    return item.content[0].text, item.encrypted_content, item.model_dump(exclude_none=True)


def follow_up(client, reasoning_item: dict) -> tuple[int, list[float]]:
    """(input tokens, the sampled tokens' log-probs) of the tool loop's next call with `reasoning_item` before the
    call it reasoned towards."""
    r = client.responses.create(model="m", input=[{"role": "user", "content": QUESTION}, reasoning_item, CALL, OUTPUT],
                                tools=[TOOL], store=False, max_output_tokens=TOKENS,
                                include=[ENCRYPTED_INCLUDE, LOGPROBS_INCLUDE], extra_body={"seed": SEED})
    return r.usage.input_tokens, [t.logprob for t in r.output[-1].content[0].logprobs]


def reference(client, tok, reasoning: str) -> tuple[list[int], tuple[int, list[float]]]:
    """Transformers' render of the tool loop with `reasoning` as the assistant turn's reasoning_content, and its
    completion at SEED (prompt tokens, log-probs)."""
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
                    {"type": "function", "id": "call_1",
                     "function": {"name": "calculator", "arguments": {"expression": "1 + 1"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    tools = [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    r = client.completions.create(model="m", prompt=prompt, max_tokens=TOKENS, seed=SEED, logprobs=0)
    return prompt, (r.usage.prompt_tokens, list(r.choices[0].logprobs.token_logprobs))


def test_reasoning_comes_back_through_its_encrypted_content(served):
    """The encrypted_content is the documented envelope of the reasoning text; sent back alone (Codex) or with the
    item's content, the follow-up answers as the completion of the template's render with that reasoning, and as the
    same item with the text in content and no encrypted_content; without the reasoning the prompt is another."""
    client, tok = served
    text, sealed, item = reasoned(client)
    assert sealed.startswith(SEAL_PREFIX)
    body = sealed[len(SEAL_PREFIX):].rsplit(".", 1)[0]
    assert json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))) == {"text": text}
    prompt, expected = reference(client, tok, text)
    assert text in tok.decode(prompt)
    codex = {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": sealed}
    assert follow_up(client, codex) == pytest.approx(expected, abs=1e-5)
    assert follow_up(client, item) == pytest.approx(expected, abs=1e-5)
    in_content = {k: v for k, v in item.items() if k != "encrypted_content"}
    assert follow_up(client, in_content) == pytest.approx(expected, abs=1e-5)
    without = client.responses.create(model="m", input=[{"role": "user", "content": QUESTION}, CALL, OUTPUT],
                                      tools=[TOOL], max_output_tokens=1)
    assert without.usage.input_tokens != expected[0]


def test_a_streamed_response_carries_the_same_encrypted_content(served):
    """Streamed, the reasoning item's output_item.done and the completed response carry its encrypted_content, which
    reads back as the item's text."""
    client, _ = served
    events = list(client.responses.create(model="m", input=QUESTION, store=False, include=[ENCRYPTED_INCLUDE],
                                          max_output_tokens=TOKENS, stream=True, extra_body={"seed": 1}))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    final = events[-1].response.output[0]
    assert len(done) == 1 and done[0].encrypted_content == final.encrypted_content
    assert final.encrypted_content.startswith(SEAL_PREFIX) and final.content[0].text
    plain = client.responses.create(model="m", input=QUESTION, max_output_tokens=TOKENS, extra_body={"seed": 1})
    assert plain.output[0].encrypted_content is None  # only when asked for


def _refused(client, item: dict) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=[{"role": "user", "content": QUESTION}, item, CALL, OUTPUT],
                                tools=[TOOL], max_output_tokens=1)
    return info.value.body


def test_encrypted_content_relax_did_not_write_is_a_400_naming_it(served, tmp_path):
    """OpenAI's (a Fernet token), one with its text altered (its signature kept), one whose text disagrees with the
    item's content, and one written by another relax-serve (its own key): each a 400 naming
    input[1].encrypted_content."""
    client, tok = served
    text, sealed, item = reasoned(client)
    openai_s = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAABpF2xk" + "A" * 40}
    body = _refused(client, openai_s)
    assert body["param"] == "input[1].encrypted_content" and "OpenAI" in body["message"]
    head, mac = sealed.rsplit(".", 1)
    forged = SEAL_PREFIX + base64.urlsafe_b64encode(json.dumps({"text": "other"}).encode()).decode().rstrip("=")
    for blob in (f"{forged}.{mac}", head, sealed[:-2]):
        body = _refused(client, {**item, "content": [], "encrypted_content": blob})
        assert body["param"] == "input[1].encrypted_content" and "restart" in body["message"]
    mixed = {**item, "content": [{"type": "reasoning_text", "text": text + " more"}]}
    assert _refused(client, mixed)["param"] == "input[1].encrypted_content"
    with tiny_server(tmp_path, tok) as url:  # another server: another key
        other = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert _refused(other, {**item, "content": []})["param"] == "input[1].encrypted_content"


@pytest.mark.parametrize("value", [*OTHER_INCLUDES, "reasoning.summary", 3])
def test_include_values_relax_cannot_honour_are_a_400_naming_the_value(served, value):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="hi", max_output_tokens=1, include=[LOGPROBS_INCLUDE, value])
    message = info.value.body["message"]
    assert info.value.body["param"] == "include" and repr(value) in message
    assert ("not supported by this server" if value in OTHER_INCLUDES else "not an include value") in message


def test_top_logprobs_needs_the_logprobs_include_not_any(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="hi", max_output_tokens=1, top_logprobs=2,
                                include=[ENCRYPTED_INCLUDE])
    assert info.value.body["param"] == "top_logprobs"
    r = client.responses.create(model="m", input="hi", max_output_tokens=1, include=[ENCRYPTED_INCLUDE])
    assert all(getattr(p, "logprobs", None) is None for o in r.output if o.type == "message" for p in o.content)


def test_the_gateway_keeps_one_trajectory_through_encrypted_reasoning(scripted_gateway):
    """In a training session (the gateway, a scripted engine on Qwen3's template): the first answer's reasoning item
    sent back by its encrypted_content alone, with the answer and a new question: one segment, every sampled token
    trained, as with the reasoning in content."""
    from relax.serve.openai.chat import ChatFormat
    from tests.openai.test_responses import trains_what_was_sampled

    tok = family_tokenizer("qwen3")
    sampled = FAMILIES["qwen3"].sampled("add them", "2")
    _, script, session, client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), [sampled, "4"])
    r = client.responses.create(model="m", input=QUESTION, store=False, include=[ENCRYPTED_INCLUDE])
    reasoning, message = r.output
    assert reasoning.content[0].text.strip() == "add them" and message.content[0].text == "2"
    codex = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    r2 = client.responses.create(model="m", store=False, include=[ENCRYPTED_INCLUDE], input=[
        {"role": "user", "content": QUESTION}, codex, message.model_dump(exclude_none=True),
        {"role": "user", "content": "And 2 + 2?"}])
    assert r2.output_text == "4"
    assert session.segments == 1 and trains_what_was_sampled(session.trajectory(), script.calls)


def test_an_agents_sdk_run_with_store_false_sends_the_encrypted_reasoning_back(scripted_gateway):
    """openai-agents' Responses model with store=False and response_include=["reasoning.encrypted_content"] (the SDK's
    own Runner, a scripted model on Qwen3's template that reasons, calls the calculator, then answers): its second
    request sends the reasoning item back with the encrypted_content Relax wrote, is answered, and the session keeps
    one trajectory."""
    import httpx
    from agents import ModelSettings, Runner

    from relax.serve.openai.chat import ChatFormat
    from tests.openai.test_responses import calculator_agent, trains_what_was_sampled

    tok = family_tokenizer("qwen3")
    call = FAMILIES["qwen3"].sampled("I need the calculator", FAMILIES["qwen3"].tool_call.replace("6 * 7", "37 * 48"))
    gw, script, session, _ = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), [call, "The answer is 1776."])
    bodies: list[dict] = []

    async def record(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    seen: list[str] = []
    agent, config = calculator_agent(client, seen)
    agent.model_settings = ModelSettings(store=False, response_include=[ENCRYPTED_INCLUDE])
    result = Runner.run_sync(agent, QUESTION, run_config=config)
    assert result.final_output == "The answer is 1776." and seen == ["37 * 48"]
    assert [b["include"] for b in bodies] == [[ENCRYPTED_INCLUDE]] * 2 and bodies[0]["store"] is False
    sent = [item for item in bodies[1]["input"] if item.get("type") == "reasoning"]
    assert len(sent) == 1 and sent[0]["encrypted_content"].startswith(SEAL_PREFIX)
    assert session.segments == 1 and trains_what_was_sampled(session.trajectory(), script.calls)
