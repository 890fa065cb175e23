"""gpt-oss (harmony) through relax-serve and the official `openai` client: its answers' analysis channel comes back as
`reasoning_content`, its final channel as `content` and its `commentary to=functions.NAME` messages as `tool_calls`
(finish_reason "tool_calls"), streamed deltas put together are the unstreamed answer, the Responses API gives the
reasoning and function_call items, history renders back as gpt-oss's template renders it (the reasoning as
`thinking`: the analysis before a call kept), and calls are constrained while sampling in harmony's form: a forced
call (tool_choice) drawn by the real tiny model is a well-formed harmony call of the tool, and a strict tool's
structural tag admits the scripted call and refuses arguments outside its schema.

relax-serve (EmbeddedServer: its HTTP routes, data.tool_parser=auto on the gpt-oss fixture's template and vocabulary,
tests/agents/templates.py) runs with its engine scripted where a test queues answers: a random tiny model never
writes harmony unconstrained, so such a request is answered with the next scripted text's tokens and gpt-oss's stop
token (`<|call|>` after a call, `<|return|>` after an answer), token by token when streamed, as the engine's events
come; without queued answers the real engine samples.

Negative control: on the code before the harmony parser, auto refused this template (the server did not start), and
with data.tool_parser=hermes the answers came back as content with the markers stripped, no reasoning_content and
no tool_calls; without harmony among the grammar's formats the forced and strict calls were a 400. Before the markers
were bound to their tokens (`relax.rollout.grammar.bind_markers`), the random model's forced calls spelled
`<|channel|>` as `<`, `|`, `ch`, `ann`, `el`, ... and the grammars admitted a spelled `<|constrain|>`; before
`harmony_final`, a response_format's grammar was the bare JSON schema (no channel header: sent as json_schema).
Before the free text's grammar was harmony's messages (a structural tag triggered on text), a `<|channel|>` spelled
in ordinary tokens opened a constrained call too (`test_the_call_grammars_require_the_markers_as_their_special_tokens`
failed: `('structural_tag', '<|channel|>')`, admitted) and a recipient on the analysis channel escaped the call's
grammar; with tools, tool_choice auto and a response_format, gpt-oss's analysis before a call was refused
(`test_a_call_after_its_analysis_with_tools_and_a_response_format` failed at the call's `comment` token).
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.agents.templates import gpt_oss_tokenizer
from tests.openai.harmony_turns import ANSWERING, CALLING, NEXT, TOOLS, USER

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

PREAMBLE_BAD_CALL = ("<|channel|>commentary<|message|>Checking.<|end|>" + NEXT
                     + "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{bad<|call|>")


class ScriptedEngine:
    """The OpenAI service's /generate, answering each payload with the tokens of `texts` (the next one per request:
    `answer` sets them), as relax-serve's engine answers (`send`) and streams (`stream`) them, or, with none queued,
    by the real engine (`real`: its send); `prompts` and `payloads` record what was asked."""

    def __init__(self, tok):
        self.tok, self.texts, self.prompts, self.payloads, self.real = tok, [], [], [], None
        self.stops = {tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")}

    def answer(self, *texts: str) -> None:
        self.texts = list(texts)

    def _answer(self, payload: dict) -> dict:
        self.prompts.append(list(payload["input_ids"]))
        self.payloads.append(payload)
        ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]
        assert ids[-1] in self.stops
        pairs = [[-0.01 * (k + 1), t, None] for k, t in enumerate(ids)]
        return {"meta_info": {"output_token_logprobs": pairs, "finish_reason": {"type": "stop"},
                              "weight_version": "0", "prompt_tokens": len(payload["input_ids"])}}

    def send(self, payloads: list[dict]) -> list[dict]:
        if not self.texts:
            self.payloads += payloads
            return self.real(payloads)
        return [self._answer(p) for p in payloads]

    def stream(self, payloads: list[dict]):
        answer = self._answer(payloads[0])
        pairs = answer["meta_info"]["output_token_logprobs"]
        for k in range(1, len(pairs)):
            yield {"index": 0, "meta_info": {"output_token_logprobs": pairs[:k], "finish_reason": None}}
        yield {"index": 0, **answer}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the official client of relax-serve on the gpt-oss fixture, its scripted engine, the tokenizer)."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    tok = gpt_oss_tokenizer()
    directory = tmp_path_factory.mktemp("gpt-oss")
    tok.save_pretrained(directory)
    cfg = load_config(["model=tiny", "model.dtype=float32", f"model.tokenizer={directory}",
                       "model.max_position_embeddings=2048", "seed=3"])  # data.tool_parser=auto
    srv = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    engine = ScriptedEngine(tok)
    engine.real = srv._send_openai
    srv._send_openai, srv._stream_openai = engine.send, engine.stream  # what the OpenAI routes send to
    srv.start()
    try:
        srv.wait_ready(120)
        # gpt-oss's stop tokens as its generation_config.json lists them (model.source=hf reads it; this fixture's
        # tokenizer has one end token): a call's <|call|> ends the answer, and the service puts it back to read it
        # (set before the first OpenAI request, which makes the service)
        srv.eos_token_ids = tuple(sorted(engine.stops))
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0), engine, tok
    finally:
        srv.shutdown()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_a_call_comes_back_as_tool_calls_with_its_reasoning(served):
    client, engine, tok = served
    engine.answer(CALLING)
    answer = client.chat.completions.create(model="default", messages=USER, tools=TOOLS)
    choice = answer.choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]
    assert (choice.finish_reason, choice.message.content or "") == ("tool_calls", "")
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    # the reasoning tokens: those of the analysis message, its <|end|> included
    analysis = tok("<|channel|>analysis<|message|>Need the weather.<|end|>", add_special_tokens=False)["input_ids"]
    assert answer.usage.completion_tokens_details.reasoning_tokens == len(analysis)


def test_a_final_answer_comes_back_as_content_and_reasoning(served):
    client, engine, _ = served
    engine.answer(ANSWERING)
    choice = client.chat.completions.create(model="default", messages=USER).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Sunny in Paris.", "stop")
    assert choice.message.model_extra["reasoning_content"] == "It is sunny there."
    assert choice.message.tool_calls is None


def test_a_malformed_call_stays_text_after_the_preamble(served):
    client, engine, _ = served
    engine.answer(PREAMBLE_BAD_CALL)
    choice = client.chat.completions.create(model="default", messages=USER, tools=TOOLS).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == "Checking.\n" + PREAMBLE_BAD_CALL.split("<|end|>", 1)[1]


@pytest.mark.parametrize("text", [CALLING, ANSWERING, PREAMBLE_BAD_CALL], ids=["call", "answer", "bad-call"])
@pytest.mark.parametrize("tools", [True, False])
def test_streamed_deltas_put_together_are_the_whole_answer(served, text, tools):
    client, engine, _ = served
    kw = {"model": "default", "messages": USER, "tools": TOOLS} if tools else {"model": "default", "messages": USER}
    engine.answer(text, text)
    whole = client.chat.completions.create(**kw).choices[0]
    reasoning, content, calls, finish, chunks = "", "", [], None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            chunks += 1
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += [(t.function.name, json.loads(t.function.arguments)) for t in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    assert (reasoning, content, calls, finish) == (whole.message.model_extra.get("reasoning_content") or "",
                                                   whole.message.content or "", _calls(whole.message),
                                                   whole.finish_reason)
    assert chunks > 3  # token by token, not one chunk


def test_history_renders_as_gpt_oss_s_template_renders_it(served):
    """The second call (the assistant's call with its reasoning_content, the tool's result) is rendered as the
    template renders the same conversation in transformers' convention (`thinking`, arguments as a mapping): the
    analysis before the call kept, the result named after the call."""
    client, engine, tok = served
    engine.answer(CALLING, ANSWERING)
    first = client.chat.completions.create(model="default", messages=USER, tools=TOOLS).choices[0].message
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in first.tool_calls],
                       "reasoning_content": first.model_extra["reasoning_content"]},
                      {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 24 C"}]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS).choices[0]
    assert second.message.content == "Sunny in Paris."
    expected = tok.apply_chat_template(
        USER + [{"role": "assistant", "content": "", "thinking": "Need the weather.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny, 24 C"}], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    rendered = tok.decode(engine.prompts[-1])
    assert rendered == expected
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant "
            "to=functions.get_weather<|channel|>commentary json<|message|>") in rendered


def test_the_responses_api_gives_reasoning_and_function_call_items(served):
    client, engine, _ = served
    engine.answer(CALLING)
    out = client.responses.create(model="default", input="Weather in Paris?", tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]).output
    assert [item.type for item in out] == ["reasoning", "function_call"]
    assert out[0].content[0].text == "Need the weather."
    assert (out[1].name, json.loads(out[1].arguments)) == ("get_weather", {"city": "Paris"})


ENUM_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_drawn_by_the_real_model_is_a_harmony_call_of_the_tool(served, choice):
    """The tiny random model, constrained by the forced call's grammar (one call: parallel_tool_calls false), writes
    `<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ...}<|call|>`, which comes
    back as the tool call, each marker its special token (the grammar requires them: `bind_markers`; before, the
    random model spelled some of them in ordinary tokens, `<|` `constrain` ...)."""
    client, engine, tok = served
    answer = client.chat.completions.create(model="default", messages=USER, tools=ENUM_TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=200, logprobs=True, seed=1)
    choice_ = answer.choices[0]
    [(name, args)] = _calls(choice_.message)
    assert name == "get_weather" and args["city"] in ("Paris", "Oslo") and choice_.finish_reason == "tool_calls"
    tokens = [t.token for t in choice_.logprobs.content]
    assert "".join(tokens).startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    markers = [t for t in tokens if "<|" in t or "|>" in t]  # every piece of a marker: the whole special token
    assert markers == ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"], tokens
    assert "ebnf" in engine.payloads[-1]["sampling_params"]
    assert tok.convert_tokens_to_ids("<|call|>") in engine.payloads[-1]["sampling_params"]["stop_token_ids"]


def test_a_strict_tool_s_calls_are_constrained_in_free_text(served):
    """The grammar sent for a strict tool (harmony's messages, an ebnf: `relax.rollout.grammar.calls_in_text`),
    compiled on the vocabulary: free reasoning, then the call of the scripted answer is admitted token by token,
    arguments outside the schema are not."""
    from relax.rollout.grammar import Grammars, GrammarSpec

    client, engine, tok = served
    engine.answer(CALLING)
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
        **TOOLS[0]["function"]["parameters"], "additionalProperties": False}}}]
    choice = client.chat.completions.create(model="default", messages=USER, tools=strict).choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]
    spec = GrammarSpec("ebnf", engine.payloads[-1]["sampling_params"]["ebnf"])
    grammars = Grammars(tok, len(tok))
    stops = (tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>"))

    def admitted(text: str) -> bool:
        matcher = grammars.matcher(spec, stops)
        return all(matcher.accept(t) for t in tok(text, add_special_tokens=False)["input_ids"])

    assert admitted(CALLING) and admitted(ANSWERING)
    assert not admitted(CALLING.replace('{"city": "Paris"}', '{"town": "Paris"}'))
    assert not admitted(CALLING.replace('{"city": "Paris"}', '{"city": 7}'))
    # a call written with the recipient first (history's form), or on another channel, would escape the call's
    # grammar: the free text may not write either
    assert not admitted(NEXT + ' to=functions.get_weather<|channel|>commentary json<|message|>{"town": 1}')
    assert not admitted(CALLING.replace('{"city": "Paris"}', '{"town": 1}').replace("commentary to=", "analysis to="))


def _spelled(tok, text: str) -> list[int]:
    """`text`'s tokens with its markers spelled in ordinary tokens (`<`, `|`, `call`, ...), as a model may draw them."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


@functools.cache
def _grammars(tok):
    from relax.rollout.grammar import Grammars

    return Grammars(tok, len(tok))


def _admits(tok, spec, ids: list[int]) -> bool:
    """Whether `spec`, compiled on `tok`'s vocabulary, takes the tokens `ids` and is then complete."""
    stops = (tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>"))
    matcher = _grammars(tok).matcher(spec, stops)
    return all(matcher.accept(t) for t in ids) and matcher.done


def test_the_call_grammars_require_the_markers_as_their_special_tokens(served):
    """The forced call's grammar and the free text's with a strict tool, with one call at most
    (parallel_tool_calls false) and with allowed_tools, compiled on the gpt-oss vocabulary: a call whose markers are
    the special tokens is admitted; the same text with `<|channel|>`, `<|constrain|>`, `<|message|>` or `<|call|>`
    spelled in ordinary tokens is not (before: admitted, a literal matched the text whatever its tokens). In free
    text the opener too is its tokens: before, a structural tag triggered the call on the text
    `<|channel|>commentary to=functions.`, which ordinary tokens spelling `<|channel|>` wrote as well (admitted, the
    call then constrained after it), and a final answer could spell a marker anywhere (the parser reads it as one)."""
    from relax.rollout.grammar import GrammarSpec, at_most_one_call, calls_in_text, strict_calls, tool_call_ebnf

    _, _, tok = served
    call = CALLING.split(NEXT)[1]
    forced = GrammarSpec("ebnf", tool_call_ebnf(TOOLS, "harmony", name="get_weather", parallel=False))
    strict = strict_calls([{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}], "harmony")
    free = [strict, at_most_one_call(TOOLS, "harmony"), calls_in_text(TOOLS, "harmony", frozenset(), parallel=True)]

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    for spec, text in ((forced, call), *((s, CALLING) for s in free)):
        assert _admits(tok, spec, ids(text))
        for marker in ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"):
            a, _, b = text.rpartition(marker)
            assert not _admits(tok, spec, ids(a) + _spelled(tok, marker) + ids(b)), (spec.kind, marker)
    final = ANSWERING.split(NEXT)[1]
    for spec in free:
        assert _admits(tok, spec, ids(ANSWERING)) and _admits(tok, spec, ids(call))
        assert not _admits(tok, spec, ids(final[:-len("<|return|>")]) + _spelled(tok, "<|return|>"))
        assert not _admits(tok, spec, ids(final.replace("Sunny", "<|channel|>Sunny")))


class City(pydantic.BaseModel):
    city: str


FINAL_JSON = ("<|channel|>analysis<|message|>A city is asked for.<|end|>" + NEXT
              + '<|channel|>final<|message|>{"city": "Paris"}<|return|>')


def test_a_response_format_is_answered_in_the_final_channel(served):
    """response_format on gpt-oss: the grammar sent is harmony's answer (an optional analysis message, then
    `<|channel|>final<|message|>` and the JSON), the official client's `parse` reads the final channel's JSON as the
    content (the analysis as reasoning_content), as `responses.parse` reads it with the Responses API's text.format
    (the same grammar sent); the grammar admits the answer with or without its analysis and
    refuses the bare JSON (what was sent before: the answer had no channel header), JSON off the schema, and the
    header spelled in ordinary tokens."""
    from relax.rollout.grammar import GrammarSpec

    client, engine, tok = served
    engine.answer(FINAL_JSON)
    choice = client.chat.completions.parse(model="default", messages=USER, response_format=City).choices[0]
    assert choice.message.parsed == City(city="Paris") and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == "A city is asked for."
    sent = engine.payloads[-1]["sampling_params"]
    spec = GrammarSpec("ebnf", sent["ebnf"])
    final = FINAL_JSON.split(NEXT)[1]

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    assert _admits(tok, spec, ids(FINAL_JSON)) and _admits(tok, spec, ids(final))
    assert not _admits(tok, spec, ids('{"city": "Paris"}<|return|>'))
    assert not _admits(tok, spec, ids(final.replace('"city"', '"town"')))
    assert not _admits(tok, spec, _spelled(tok, "<|channel|>final<|message|>") + ids('{"city": "Paris"}<|return|>'))
    # the Responses API's text.format takes the chat route's: the same grammar, the JSON as the output text
    engine.answer(FINAL_JSON)
    response = client.responses.parse(model="default", input="Weather in Paris?", text_format=City)
    assert response.output_parsed == City(city="Paris")
    assert engine.payloads[-1]["sampling_params"]["ebnf"] == sent["ebnf"]


def test_a_call_after_its_analysis_with_tools_and_a_response_format(served):
    """tools, tool_choice "auto" and a response_format (openai-agents' `Agent(tools=..., output_type=...)`): gpt-oss
    reasons before it calls, as before a final answer, and the grammar sent lets it (an optional analysis message
    before the calls, as `harmony_final` before the JSON). The scripted answer, analysis then the call, comes back
    as the call with its reasoning_content, and the grammar admits its tokens one by one, the call alone, and the
    final channel's JSON with or without its analysis; not analysis then arguments off the schema, nor analysis
    then text. Before, the calls' alternative had no analysis: the answer, as gpt-oss writes it, was refused."""
    from relax.rollout.grammar import GrammarSpec

    client, engine, tok = served
    engine.answer(CALLING)
    city = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}
    choice = client.chat.completions.create(model="default", messages=USER, tools=TOOLS, tool_choice="auto",
                                            response_format=city).choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})] and choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    spec = GrammarSpec("ebnf", engine.payloads[-1]["sampling_params"]["ebnf"])
    stops = (tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>"))
    matcher = _grammars(tok).matcher(spec, stops)
    for t in tok(CALLING, add_special_tokens=False)["input_ids"]:  # token by token, as the engine draws them
        assert matcher.accept(t), tok.decode([t])
    assert matcher.done

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    analysis, call = CALLING.split(NEXT)
    assert _admits(tok, spec, ids(call)) and _admits(tok, spec, ids(FINAL_JSON))
    assert _admits(tok, spec, ids(FINAL_JSON.split(NEXT)[1]))
    assert not _admits(tok, spec, ids(CALLING.replace('{"city": "Paris"}', '{"town": "Paris"}')))
    assert not _admits(tok, spec, ids(analysis + NEXT + "<|channel|>final<|message|>Sunny.<|return|>"))
