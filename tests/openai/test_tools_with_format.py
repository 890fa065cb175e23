"""Tools with a response format and tool_choice "auto" (openai-agents' `Agent(tools=[...], output_type=Model)`,
LangChain's bind_tools with structured output): as OpenAI answers, the answer is either tool calls, in the model
family's tool-call format, or the format's JSON, and the grammar sent to the engine (`tool_calls_or`) admits exactly
those two. The gateway runs over a scripted engine that checks each scripted answer token by token against the
grammar of the payload it answers (what an engine's mask would allow), and the grammar's allowed tokens are read
from the matcher directly; the negative control is the format's grammar alone (what the gateway sent before), which
refuses every call."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

from relax.agents.parsers import BUILTIN_PARSERS
from relax.rollout.grammar import TOOL_CALL_FORMATS, Grammars, GrammarSpec, json_schema_spec, tool_calls_or
from relax.serve.openai.chat import ChatFormat
from tests.openai.scripted import Script, ScriptedGateways

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import FAMILIES, _byte_level_tokenizer, byte_level_engine, family_tokenizer  # noqa: E402

CALCULATOR = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression",
                                                "parameters": {"type": "object", "properties": {
                                                    "expression": {"type": "string"}}, "required": ["expression"]}}}]
ANSWER = {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
          "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": ANSWER, "strict": True}}
JSON = '{"value": 42}'
USER = [{"role": "user", "content": "What is 6 * 7?"}]
FAMILY_NAMES = list(FAMILIES)
THOUGHT = "6 times 7.\n</think>\n\n"  # the reasoning an answer writes after a generation prompt that opened <think>


@pytest.fixture(scope="module")
def grammars():
    """One `Grammars` per family tokenizer (its vocabulary read once)."""
    made: dict[str, Grammars] = {}

    def get(name: str) -> Grammars:
        if name not in made:
            tok = family_tokenizer(name)
            made[name] = Grammars(tok, len(tok))
        return made[name]
    return get


def spec_of(sp: dict):
    """The grammar a /generate payload's sampling params ask for (None: free text)."""
    for kind in ("json_schema", "ebnf", "regex", "structural_tag"):
        if sp.get(kind):
            return GrammarSpec(kind, sp[kind])
    return None


class GuardedScript(Script):
    """A `Script` whose answers are checked against each payload's grammar, token by token, then the stop token:
    `refused[k]` is the text of the k-th answer where the grammar refused it (None: it took the whole answer)."""

    def __init__(self, fmt: ChatFormat, texts: list[str], grammars: Grammars):
        super().__init__(fmt, texts)
        self.grammars, self.refused = grammars, []

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = super().__call__(payloads)
        for p, a in zip(payloads, out, strict=True):
            spec = spec_of(p["sampling_params"])
            ids = [q[1] for q in a["meta_info"]["output_token_logprobs"]]
            if spec is None:
                self.refused.append(None)
                continue
            m = self.grammars.matcher(spec, sorted(self.fmt.eos_token_ids))
            taken = 0
            while taken < len(ids) and m.accept(ids[taken]):
                taken += 1
            self.refused.append(None if taken == len(ids) and m.done else self.fmt.tokenizer.decode(ids))
        return out


@pytest.fixture
def guarded(grammars):
    """make(family, texts) -> (script, client): a gateway over a GuardedScript with the family's tokenizer."""
    gateways = ScriptedGateways()

    def make(name: str, texts: list[str]):
        import openai

        from relax.serve.openai.gateway import Gateway
        from relax.serve.openai.service import OpenAIService
        from tests.openai.scripted import limits

        tok = family_tokenizer(name)
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        script = GuardedScript(fmt, texts, grammars(name))
        gw = Gateway(OpenAIService(fmt, script, model="policy", context_length=None, max_tokens=64)).start()
        gateways.made.append(gw)
        session = gw.open(0, limits())
        return script, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
    yield make
    gateways.close()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_with_tools_and_a_response_format_the_answer_is_a_call_or_the_schemas_json(guarded, grammars, family):
    """Chat with tools, response_format json_schema and tool_choice auto: the family's tool call is taken by the
    grammar sent and comes back as tool_calls; the schema's JSON is taken and comes back as content that validates;
    free text is refused by the grammar. Negative control: the schema's grammar alone (sent before) refuses the call.
    A family whose template reasons gets the grammar after its <think> block (a structural tag): Qwen3.5's generation
    prompt opened it, so its answers reason first (`THOUGHT`)."""
    call = FAMILIES[family].tool_call
    thought = THOUGHT if FAMILIES[family].prompt_part else ""
    kw = dict(model="policy", messages=USER, tools=CALCULATOR, response_format=RESPONSE_FORMAT, max_tokens=60)
    script, client = guarded(family, [thought + call, thought + JSON, "The answer is 42."])
    r = client.chat.completions.create(**kw)
    sp = script.calls[0][0]["sampling_params"]
    assert ("structural_tag" if script.fmt.reasoning else "ebnf") in sp and "json_schema" not in sp
    assert script.refused[0] is None
    assert r.choices[0].finish_reason == "tool_calls"
    assert calls_of(r.choices[0].message) == [("calculator", {"expression": "6 * 7"})]
    r = client.chat.completions.create(**kw)
    assert script.refused[1] is None and not r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    assert getattr(r.choices[0].message, "reasoning_content", None) == ("6 times 7." if thought else None)
    client.chat.completions.create(**kw)
    assert script.refused[2].startswith("The answer is 42.")  # free text: masked
    old = grammars(family).matcher(json_schema_spec(ANSWER), [family_tokenizer(family).eos_token_id])
    assert not all(old.accept(t) for t in script.ids(0))


def test_a_constrained_answer_after_a_generation_prompt_that_opened_think_reasons_first(guarded):
    """Qwen3.5's generation prompt opens <think>: a constrained answer (response_format, a forced call) reasons first,
    as SGLang's chat route defers a grammar past the reasoning: the grammar takes the reasoning up to </think>, then
    the JSON or the call, and the reasoning goes to reasoning_content; a free answer has its reasoning split off too.
    Negative control: an answer without the reasoning is refused (the grammar sent before took it from the first
    token)."""
    call = FAMILIES["qwen3_5"].tool_call
    script, client = guarded("qwen3_5", [THOUGHT + JSON, THOUGHT + call, THOUGHT + "42", JSON])
    m = client.chat.completions.create(model="policy", messages=USER, response_format=RESPONSE_FORMAT,
                                       max_tokens=60).choices[0].message
    assert (m.content, m.reasoning_content) == (JSON, "6 times 7.")
    m = client.chat.completions.create(model="policy", messages=USER, tools=CALCULATOR, tool_choice="required",
                                       max_tokens=60).choices[0].message
    assert calls_of(m) == [("calculator", {"expression": "6 * 7"})] and m.reasoning_content == "6 times 7."
    m = client.chat.completions.create(model="policy", messages=USER, max_tokens=60).choices[0].message
    assert (m.content, m.reasoning_content) == ("42", "6 times 7.")
    client.chat.completions.create(model="policy", messages=USER, response_format=RESPONSE_FORMAT, max_tokens=60)
    assert script.refused[:3] == [None, None, None] and script.refused[3].startswith(JSON)


def test_the_responses_api_text_format_with_tools_answers_a_call_or_the_json(guarded):
    """The Responses API's text.format (openai-agents' output_type on its default model) with function tools: the
    call is a function_call item, the JSON the output_text."""
    script, client = guarded("qwen3", [FAMILIES["qwen3"].tool_call, JSON])
    kw = dict(model="policy", input="What is 6 * 7?", max_output_tokens=60,
              tools=[{"type": "function", "name": "calculator", "parameters": CALCULATOR[0]["function"]["parameters"],
                      "strict": False}],
              text={"format": {"type": "json_schema", "name": "Answer", "schema": ANSWER, "strict": True}})
    r = client.responses.create(**kw)
    assert script.refused[0] is None
    [item] = r.output
    assert item.type == "function_call" and item.name == "calculator"
    assert json.loads(item.arguments) == {"expression": "6 * 7"}
    r = client.responses.create(**kw)
    assert script.refused[1] is None and [i.type for i in r.output] == ["message"]
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_without_parallel_tool_calls_the_grammar_takes_one_call_or_the_json(guarded):
    """parallel_tool_calls=false with tools and a format: one call or the JSON; two calls are refused, while the
    same request with parallel calls allowed (the control) takes them."""
    call = FAMILIES["smollm2_chatml"].tool_call
    two = call + "\n" + call
    kw = dict(model="policy", messages=USER, tools=CALCULATOR, response_format=RESPONSE_FORMAT, max_tokens=60)
    script, client = guarded("smollm2_chatml", [two, two, call, JSON])
    client.chat.completions.create(**kw, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    assert script.refused[0] is not None and script.refused[1] is None
    assert len(r.choices[0].message.tool_calls) == 2
    r = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert script.refused[2] is None and calls_of(r.choices[0].message) == [("calculator", {"expression": "6 * 7"})]
    r = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert script.refused[3] is None and json.loads(r.choices[0].message.content) == {"value": 42}


def test_an_openai_agents_agent_with_tools_and_an_output_type_calls_its_tool(guarded):
    """openai-agents' Runner with tools and output_type, on the chat and the Responses models (the reviewer's
    repro): the first call is a tool call the grammar takes, the final output parses into the output type."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    ran = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an expression."""
        ran.append(expression)
        return "42"

    agents.set_tracing_disabled(True)
    for model_class in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        script, client = guarded("qwen3", [FAMILIES["qwen3"].tool_call, JSON])
        async_client = __import__("openai").AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                                                        max_retries=0)
        agent = agents.Agent(name="a", instructions="Use the calculator.", tools=[calculator], output_type=Answer,
                             model=model_class("policy", async_client))
        result = asyncio.run(agents.Runner.run(agent, "What is 6 * 7?"))
        assert result.final_output == Answer(value=42)
        assert script.refused == [None, None]
    assert ran == ["6 * 7", "6 * 7"]


def test_an_agent_with_an_output_type_and_tool_choice_required_gets_the_forced_call(guarded, grammars):
    """openai-agents' `ModelSettings(tool_choice="required")` with an `output_type` sends a forced call and a format
    together (the reviewer's repro; OpenAI accepts it): the forced call is the answer (the grammar sent is the call's,
    which refuses the format's JSON), then the SDK resets tool_choice to auto and the answer is the JSON. Negative
    control: before, the first call was a 400 ("both constrain the answer")."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    ran = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an expression."""
        ran.append(expression)
        return "42"

    agents.set_tracing_disabled(True)
    eos = sorted(family_tokenizer("qwen3").convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    for model_class in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        script, client = guarded("qwen3", [FAMILIES["qwen3"].tool_call, JSON])
        async_client = __import__("openai").AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                                                        max_retries=0)
        agent = agents.Agent(name="a", instructions="Use the calculator.", tools=[calculator], output_type=Answer,
                             model=model_class("policy", async_client),
                             model_settings=agents.ModelSettings(tool_choice="required"))
        result = asyncio.run(agents.Runner.run(agent, "What is 6 * 7?"))
        assert result.final_output == Answer(value=42)
        assert script.refused == [None, None]
        first = spec_of(script.calls[0][0]["sampling_params"])
        m = grammars("qwen3").matcher(first, eos)
        assert not all(m.accept(t) for t in script.fmt.encode(JSON)), "the forced call's grammar takes the JSON"
    assert ran == ["6 * 7", "6 * 7"]


# ------------------------------------------------------------------------------------------------ the grammar
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {  # one call of `weather` in each format, as its parser reads it
    "hermes": '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "deepseek_v3": FAMILIES["deepseek_v3"].tool_call.replace("calculator", "weather").replace(
        '"expression": "6 * 7"', '"city": "Paris"'),
    "llama3_json": '{"name": "weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]',
}


@pytest.fixture(scope="module")
def byte_grammars():
    tok = _byte_level_tokenizer()
    return tok, Grammars(tok, len(tok))


def allowed(grammars: Grammars, spec: GrammarSpec, prefix: str, eos: int) -> set[str]:
    """The texts of the tokens `spec` allows after `prefix` (the byte-level vocabulary: one byte each)."""
    tok = grammars.tokenizer
    m = grammars.matcher(spec, [eos])
    assert all(m.accept(t) for t in tok.encode(prefix, add_special_tokens=False))
    bitmask = torch.zeros(1, (grammars.vocab_size + 31) // 32, dtype=torch.int32)
    m.fill(bitmask, 0)
    bits = ((bitmask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(-1)
    return {tok.convert_ids_to_tokens(i) if i != eos else "EOS" for i in range(grammars.vocab_size) if bits[i]}


def takes(grammars: Grammars, spec: GrammarSpec, text: str, eos: int) -> bool:
    m = grammars.matcher(spec, [eos])
    return all(m.accept(t) for t in grammars.tokenizer.encode(text, add_special_tokens=False)) and m.accept(eos)


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_the_union_grammar_masks_every_token_outside_a_call_and_the_json(byte_grammars, fmt):
    """The tokens allowed first are exactly the first bytes of a call in the format and of the JSON object ("{"),
    after "{" only what the schema's JSON may go on with; a call is parsed by the format's parser, the JSON validates,
    free text, text before a call and JSON outside the schema are refused. Negative control: the schema's grammar
    alone allows only "{" first and refuses the call."""
    tok, grammars = byte_grammars
    eos = tok.eos_token_id
    spec = tool_calls_or(TOOLS, fmt, json_schema_spec(ANSWER))
    call = CALL[fmt]
    parsed = BUILTIN_PARSERS[fmt](call)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("weather", {"city": "Paris"})]
    first = tok.convert_ids_to_tokens(tok.encode(call[0], add_special_tokens=False))[0]
    assert allowed(grammars, spec, "", eos) == {first, "{"}
    assert allowed(grammars, spec, "{", eos) == {'"'}
    assert allowed(grammars, spec, JSON, eos) == {"EOS"}
    assert takes(grammars, spec, call, eos) and takes(grammars, spec, JSON, eos)
    for text in ("The answer is 42.", "Let me look. " + call, '{"value": "42"}', '{"other": 1}', JSON + " done"):
        assert not takes(grammars, spec, text, eos), text
    old = json_schema_spec(ANSWER)
    assert allowed(grammars, old, "", eos) == {"{"} and not takes(grammars, old, call, eos)


def test_json_object_and_other_grammars_combine_with_calls(byte_grammars):
    """json_object (any object) and a regex combine too; a grammar that does not compile is a GrammarError."""
    from relax.rollout.grammar import GrammarError

    tok, grammars = byte_grammars
    eos = tok.eos_token_id
    spec = tool_calls_or(TOOLS, "hermes", GrammarSpec("json_schema", '{"type": "object"}'))
    assert takes(grammars, spec, '{"anything": [1, 2]}', eos) and takes(grammars, spec, CALL["hermes"], eos)
    assert not takes(grammars, spec, "[1]", eos)
    spec = tool_calls_or(TOOLS, "hermes", GrammarSpec("regex", "(yes|no)"))
    assert takes(grammars, spec, "yes", eos) and takes(grammars, spec, CALL["hermes"], eos)
    assert not takes(grammars, spec, "maybe", eos)
    with pytest.raises(GrammarError, match="regex"):
        tool_calls_or(TOOLS, "hermes", GrammarSpec("regex", "(unclosed"))


def test_an_engine_sampling_under_the_union_writes_calls_or_valid_json():
    """The embedded engine (a random-weight model on the byte-level vocabulary) under the grammar: every row is
    either one or more calls the parser reads with the schema's arguments, or JSON that validates; both occur.
    Without the grammar (the control) no row is either."""
    tok, engine = byte_level_engine()
    eos = tok.eos_token_id
    grammars = Grammars(tok, len(tok))
    spec = tool_calls_or(TOOLS, "hermes", json_schema_spec(ANSWER), parallel=False)
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    rows = 24

    def sample(constrained: bool) -> list[str]:
        """The rows' texts (a row cut at the token limit left out: a random model may write a string on and on)."""
        matchers = [grammars.matcher(spec, [eos]) for _ in range(rows)] if constrained else None
        out = engine.generate([prompt], n_samples_per_prompt=rows, max_new_tokens=160, seed=5,
                              sample_ids=torch.arange(rows), grammars=matchers)
        return [tok.decode([t for t in ids[mask.bool()].tolist() if t != eos])
                for ids, mask, reason in zip(out.response_ids, out.response_mask, out.finish_reason, strict=True)
                if reason == "stop" or not constrained]

    def kind(text: str) -> str:
        parsed = BUILTIN_PARSERS["hermes"](text)
        if parsed.calls and not parsed.errors and not parsed.content:
            assert [c.name for c in parsed.calls] == ["weather"] and set(parsed.calls[0].arguments) == {"city"}
            return "call"
        try:
            jsonschema.validate(json.loads(text), ANSWER)
            return "json"
        except (ValueError, jsonschema.ValidationError):
            return "neither"

    kinds = [kind(t) for t in sample(True)]
    assert "neither" not in kinds and {"call", "json"} <= set(kinds) and len(kinds) > rows // 2, kinds
    assert {kind(t) for t in sample(False)} == {"neither"}
