"""The Responses API (`POST /v1/responses`), driven by the official `openai` client and by the openai-agents SDK with
its defaults (which use the Responses API), over real HTTP: a translation onto the chat pipeline, so each call is
the chat template's render of the messages it translates to, and a training session records it as a chat call.

Fast tests: a scripted engine (fixed tokens on SmolLM2's tokenizer) behind the training gateway, so they check the
protocol and the recording, not the model. Slow ones start a server: relax-serve (the CLI) with the tiny model,
relax-serve in this process with a scripted engine for the agents SDK, and the gateway over an embedded server for
an agent program written against the Responses API."""

from __future__ import annotations

import json

import openai
import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.protocol import normalize_message
from relax.serve.openai.responses import chat_tools
from relax.serve.openai.service import OpenAIService
from tests.openai.scripted import Script, limits

CALL = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 48"}}</tool_call>'
FINAL = "The answer is 1776."
QUESTION = "What is 37 * 48?"
TOOL = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}


@pytest.fixture
def scripted(smol, scripted_gateway):
    """make(texts) -> (gateway, script, session, client) over SmolLM2's chat format (conftest.scripted_gateway)."""
    return lambda texts: scripted_gateway(smol, texts)


def trains_what_was_sampled(t, calls: list[tuple[dict, dict]]) -> bool:
    """Whether trajectory `t` is exactly what the engine saw and sampled, call after call (tests/openai/test_gateway.py
    checks chat calls the same way): each call's input is the trajectory so far, its answer's tokens follow, trained
    with the engine's log-probs, and nothing else is trained."""
    context, sampled = t.prompt + t.tokens, [0] * len(t.prompt) + t.sampled
    logprobs = [0.0] * len(t.prompt) + t.logprobs
    trained = 0
    for payload, answer in calls:
        ids, pairs = payload["input_ids"], answer["meta_info"]["output_token_logprobs"]
        out, end = [q[1] for q in pairs], len(payload["input_ids"]) + len(pairs)
        if context[:len(ids)] != ids or context[len(ids):end] != out or sampled[len(ids):end] != [1] * len(out):
            return False
        if logprobs[len(ids):end] != pytest.approx([q[0] for q in pairs], abs=1e-9):
            return False
        trained += len(out)
    return trained == sum(sampled)


def test_a_tool_call_and_its_output_then_the_answer_are_one_trajectory(scripted, smol):
    """A function_call item with a fresh call id, its function_call_output sent back with the output items, the final
    answer; the first prompt is the chat template's render of the instructions, the input and the tools (what a chat
    call sends), the tool output is appended after the sampled tokens, and the session trains what was sampled."""
    gw, script, session, client = scripted([CALL, FINAL])
    r = client.responses.create(model="m", instructions="Be brief.", input=QUESTION, tools=[TOOL])
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[0].content[0].text == "Let me compute."
    call = r.output[1]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "37 * 48"}
    assert call.call_id.startswith("call_") and r.usage.output_tokens == len(script.calls[0][1]["meta_info"][
        "output_token_logprobs"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert script.calls[0][0]["input_ids"] == smol.prompt([normalize_message(m) for m in messages], chat_tools([TOOL]))
    follow = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "1776"}]
    r2 = client.responses.create(model="m", instructions="Be brief.", input=follow, tools=[TOOL])
    assert r2.output_text == FINAL and [o.type for o in r2.output] == ["message"]
    t = session.trajectory()
    assert session.segments == 1 and len(t.answers) == 2 and trains_what_was_sampled(t, script.calls)
    first = script.calls[0][0]["input_ids"] + [q[1] for q in script.calls[0][1]["meta_info"]["output_token_logprobs"]]
    delta = script.calls[1][0]["input_ids"][len(first):]
    assert smol.tokenizer.decode(delta) == "\n<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n"
    assert set(t.versions[len(first) - len(t.prompt) - 1:len(first) - len(t.prompt)]) == {2}


def test_streaming_events_parse_into_the_same_response(scripted):
    gw, script, session, client = scripted([CALL])
    whole = client.responses.create(model="m", input=QUESTION, tools=[TOOL])
    with client.responses.stream(model="m", input=QUESTION, tools=[TOOL]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in kinds, kind
    assert kinds.count("response.output_text.delta") > 1  # at the answer's token boundaries
    assert final.output_text == whole.output_text == "Let me compute."
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == \
        [(o.type, getattr(o, "arguments", None)) for o in whole.output]
    raw = list(client.responses.create(model="m", input=QUESTION, stream=True))
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == CALL  # no tools: all text
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    scored = client.responses.create(model="m", input=QUESTION, include=["message.output_text.logprobs"])
    lps = scored.output[0].content[0].logprobs  # every sampled token's, as the engine gave them
    assert [lp.logprob for lp in lps] == pytest.approx([-0.01 * (k + 1) for k in range(scored.usage.output_tokens)])


def test_previous_response_id_continues_the_conversation(scripted):
    gw, script, session, client = scripted([CALL, FINAL])
    r = client.responses.create(model="m", input=QUESTION, tools=[TOOL])
    out = {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "1776"}
    r2 = client.responses.create(model="m", previous_response_id=r.id, input=[out], tools=[TOOL])
    assert r2.output_text == FINAL and r2.previous_response_id == r.id
    assert session.segments == 1 and trains_what_was_sampled(session.trajectory(), script.calls)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", previous_response_id="resp_unknown", input="hi")
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"


def test_a_response_created_with_store_false_cannot_be_continued(scripted):
    """OpenAI keeps nothing of a `store: false` response: its id as previous_response_id is the 400
    previous_response_not_found, as an unknown id's; the same conversation stored (store true or left out) continues."""
    gw, script, session, client = scripted([CALL, FINAL])
    unstored = client.responses.create(model="m", input=QUESTION, tools=[TOOL], store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", previous_response_id=unstored.id, input="go on", tools=[TOOL])
    assert info.value.status_code == 400 and info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found" and "store: false" in info.value.body["message"]
    for store in (True, None):  # control: stored, the same id continues
        kw = {} if store is None else {"store": store}
        r = client.responses.create(model="m", input=QUESTION, tools=[TOOL], **kw)
        assert client.responses.create(model="m", previous_response_id=r.id, input="go on", tools=[TOOL]).id


@pytest.mark.parametrize("kw, param", [
    (dict(text={"verbosity": "low"}), "text.verbosity"), (dict(text={"format": {"type": "grammar"}}), "text.format"),
    (dict(reasoning={"effort": "high"}), "reasoning.effort"),
    (dict(tools=[{"type": "web_search"}]), "tools[0]"), (dict(tool_choice="required"), "tool_choice"),
    (dict(max_output_tokens=0), "max_output_tokens"), (dict(temperature=3), "temperature"),
    (dict(truncation="none"), "truncation"), (dict(background=True), "background"),
    (dict(include=["file_search_call.results"]), "include"), (dict(extra_body={"seed": "one"}), "seed"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]"),
])
def test_fields_that_cannot_be_honoured_get_a_400_naming_them(scripted, kw, param):
    _, script, _, client = scripted([FINAL])
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": "m", "input": QUESTION, **kw})
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    assert script.calls == []


def calculator_agent(client: openai.AsyncOpenAI, seen: list[str]):
    """An openai-agents Agent with one function tool, and the run config that points it at `client` with the SDK's
    defaults otherwise (its OpenAI provider: the Responses API)."""
    from agents import Agent, RunConfig, function_tool
    from agents.models.openai_provider import OpenAIProvider

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        seen.append(expression)
        return "1776"

    agent = Agent(name="calc", instructions="Use the calculator.", tools=[calculator], model="policy")
    return agent, RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)


def test_an_agents_sdk_run_through_the_gateway_is_one_trajectory(scripted):
    """Runner.run_sync with the SDK's defaults: it calls the tool the (scripted) model asked for, sends its output
    back, gets the final answer; the session recorded both calls as one trajectory of the sampled tokens."""
    from agents import Runner

    gw, script, session, _ = scripted([CALL, FINAL])
    seen: list[str] = []
    agent, config = calculator_agent(openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0),
                                     seen)
    result = Runner.run_sync(agent, QUESTION, run_config=config)
    assert result.final_output == FINAL and seen == ["37 * 48"]
    assert session.segments == 1 and trains_what_was_sampled(session.trajectory(), script.calls)


# --------------------------------------------------------------------------------------------- servers (slow)
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """relax-serve (the CLI, in its own process) with the tiny model, and its tokenizer."""
    from sglang.test_conformance import relax_serve

    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer

    overrides = ["model=tiny", "model.dtype=float32", "seed=3"]
    tok = load_tokenizer(load_config(overrides).model)
    with relax_serve(tmp_path_factory.mktemp("serve"), overrides) as url:
        yield url, tok


@pytest.mark.slow
def test_relax_serve_answers_as_its_chat_route_whole_streamed_and_chained(served):
    url, tok = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    user = [{"role": "user", "content": "What is 3 + 4?"}]
    chat = client.chat.completions.create(model="tiny", messages=user, temperature=0, max_tokens=6)
    r = client.responses.create(model="tiny", input="What is 3 + 4?", temperature=0, max_output_tokens=6)
    assert r.output[0].content[0].text == chat.choices[0].message.content  # greedy: the same tokens
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model="tiny", input="What is 3 + 4?", temperature=0, max_output_tokens=6,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output[0].content[0].text
    assert events[-1].type in ("response.completed", "response.incomplete")
    chained = client.responses.create(model="tiny", previous_response_id=r.id, input="what is the final answer",
                                      temperature=0, max_output_tokens=2)
    conversation = user + [{"role": "assistant", "content": r.output[0].content[0].text},
                           {"role": "user", "content": "what is the final answer"}]
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chained.usage.input_tokens == len(rendered)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", text={"verbosity": "low"})
    assert info.value.body["param"] == "text.verbosity"


@pytest.mark.slow
def test_relax_serve_samples_a_responses_call_with_its_seed_top_k_and_stop(served):
    """On a real sampler (temperature 1): the same seed gives the same answer twice (its tokens' log-probs too),
    another seed another answer, and the chat route with that seed the same answer (one code path); top_k=1 is the
    greedy answer; a stop string cuts the answer before it, as the chat route's does."""
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="tiny", input=QUESTION, temperature=1.0, max_output_tokens=16,
              include=["message.output_text.logprobs"])

    def answer(**extra) -> tuple[str, list[float]]:
        r = client.responses.create(**kw, extra_body=extra)
        return r.output_text, [lp.logprob for lp in r.output[0].content[0].logprobs]

    five = answer(seed=5)
    assert answer(seed=5) == five and answer(seed=6)[0] != five[0]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=1.0, max_tokens=16, seed=5)
    assert chat.choices[0].message.content == five[0]
    greedy = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=16).output_text
    assert answer(top_k=1, seed=7)[0] == greedy and len(greedy) > 8
    assert answer(seed=7)[0] != greedy  # the control: without top_k the draw is not the greedy one
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 2]
    cut = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=16,
                                  extra_body={"stop": [stop]})
    assert cut.output_text == greedy[:greedy.find(stop)] and cut.status == "completed"


@pytest.mark.slow
def test_an_agents_sdk_run_against_relax_serve(smol):
    """relax-serve's /v1/responses route (in this process, its engine scripted with SmolLM2's tokens), driven by the
    SDK with its defaults: the tool is called and the run ends with the final answer."""
    from agents import Runner

    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(load_config(["model=tiny", "model.dtype=float32"]), port=0, threads=1)
    server.start()
    try:
        server.wait_ready(120)
        script = Script(smol, [CALL, FINAL])
        server._openai_service = OpenAIService(smol, script, model="policy", context_length=None)
        seen: list[str] = []
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        agent, config = calculator_agent(client, seen)
        result = Runner.run_sync(agent, QUESTION, run_config=config)
        assert result.final_output == FINAL and seen == ["37 * 48"] and len(script.calls) == 2
    finally:
        server.shutdown()


@pytest.mark.slow
def test_a_responses_agent_program_trains_exactly_the_sampled_tokens():
    """`gateway_agents.responses_three_turns` (the Responses API only: output items sent back, then
    previous_response_id) through the gateway in front of an embedded server: one trajectory of three answers,
    each call's input the trajectory so far, the sampled tokens trained and nothing else."""
    from gateway_agents import responses_three_turns  # tests/openai on sys.path
    from test_gateway import Recorder

    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(load_config(["model=tiny", "model.dtype=float32"]), port=0, threads=1)
    server.start()
    try:
        server.wait_ready(120)
        recorder = Recorder(server.url)
        fmt = ChatFormat(server.tokenizer, server.eos_token_ids)
        gw = Gateway(OpenAIService(fmt, recorder, model="policy", context_length=None, max_tokens=8)).start()
        try:
            session = gw.open(0, limits())
            item = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "index": 0}
            responses_three_turns(item, gw.base_url, session.key)
            t = session.trajectory()
            assert session.segments == 1 and len(t.answers) == 3 and len(recorder.calls) == 3
            assert trains_what_was_sampled(t, recorder.calls)
        finally:
            gw.close()
    finally:
        server.shutdown()
