"""Tool schemas with `$defs` / `$ref` (a pydantic model's nested models: the official openai package's
`pydantic_function_tool`, openai-agents' `@function_tool` taking a model, strict by default) when their calls are
constrained: strict tools under tool_choice auto, and every forced call (required, named). A call's grammar nests the
tool's `parameters` inside the call's object (hermes, mistral, llama3_json) or compiles each argument alone (the XML
formats, qwen3_coder and glm45), so the schema's `"#/$defs/..."` refs must still resolve there
(`relax.rollout.grammar._moved_refs`); vLLM hoists the definitions to the root for the same reason.

Checked in every built-in call format against the real schemas those libraries write: the grammar compiles, takes a
call that satisfies the schema and refuses one that breaks a nested model (the negative control inside each test),
the random byte-level model's forced calls validate against the schema with `jsonschema`, two tools whose `$defs`
share a name keep their own definitions; and openai-agents' Runner with such a tool through the training gateway
(chat and Responses models) runs its tool with the model's arguments, each answer checked against the grammar the
gateway sent. Negative control: before, every one of these was a GrammarError / HTTP 400 ("Cannot find field
'$defs' in #/$defs/Addr") in 5 of the 6 formats (deepseek_v3 compiles `parameters` as the root and worked).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from relax.agents.parsers import BUILTIN_PARSERS, apply_tool_schemas
from relax.rollout.grammar import Grammars, GrammarSpec, strict_calls, tool_call_ebnf

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from tests.agents.templates import byte_level_engine, family_tokenizer  # noqa: E402
from tests.openai.test_tools_with_format import GuardedScript, spec_of  # noqa: E402

# the call formats `written` writes (relax.rollout.grammar.TOOL_CALL_FORMATS' JSON and XML ones)
FORMATS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "qwen3_coder", "glm45")


class Addr(pydantic.BaseModel):
    street: str
    number: int


class Person(pydantic.BaseModel):
    """A person and where they live."""

    name: str
    home: Addr
    past: list[Addr]


class Node(pydantic.BaseModel):
    """A tree (a recursive $ref)."""

    v: int
    kids: list[Node]


class Spot(pydantic.BaseModel):  # (short strings: a random model's free string rarely ends within the limit)
    street: str = pydantic.Field(pattern="^[a-z]{1,6}$")
    number: int = pydantic.Field(ge=0, le=999)


PERSON = openai.pydantic_function_tool(Person)
NODE = openai.pydantic_function_tool(Node)
# a second tool whose own `Addr` definition is another schema: each tool's refs must reach its own
OTHER = {"type": "function", "function": {"name": "mail", "strict": True, "parameters": {
    "$defs": {"Addr": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"],
                       "additionalProperties": False}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}}, "required": ["to"],
    "additionalProperties": False}}}
GOOD = {"name": "Ann", "home": {"street": "Main", "number": 3}, "past": [{"street": "Elm", "number": 1}]}
BAD = [{"name": "Ann", "home": {"street": "Main"}, "past": []},  # a nested required field missing
       {"name": "Ann", "home": {"street": 5, "number": 3}, "past": []},  # a nested field of another type
       {"name": "Ann", "home": {"street": "Main", "number": 3}, "past": [{"zip": 1}]}]  # the other tool's Addr


def written(fmt: str, name: str, args: dict) -> str:
    """One call as the format's template writes it (the XML formats: a string as its text, anything else as JSON)."""
    from relax.agents.parsers import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP

    def value(x):
        return x if isinstance(x, str) else json.dumps(x)

    if fmt == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": args})
    if fmt == "mistral":
        return f"[TOOL_CALLS] [{json.dumps({'name': name, 'arguments': args})}]"
    if fmt == "deepseek_v3":
        return f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{json.dumps(args)}\n```" \
               f"{DS_CALL_END}{DS_CALLS_END}"
    if fmt == "qwen3_coder":
        return f"<tool_call>\n<function={name}>\n" + "".join(
            f"<parameter={k}>\n{value(x)}\n</parameter>\n" for k, x in args.items()) + "</function>\n</tool_call>"
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{value(x)}</arg_value>\n"
                                           for k, x in args.items()) + "</tool_call>"


@pytest.fixture(scope="module")
def setup():
    tok, engine = byte_level_engine()
    return tok, engine, Grammars(tok, len(tok)), tok.eos_token_id


def accepts(grammars: Grammars, spec: GrammarSpec, text: str, eos: int, *, then_eos: bool = True) -> bool:
    m = grammars.matcher(spec, [eos])
    return all(m.accept(t) for t in grammars.tokenizer.encode(text, add_special_tokens=False)) and (
        not then_eos or m.accept(eos))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_schema_with_defs_constrains_its_calls_in_every_format(setup, fmt):
    """Forced (named, required) and strict-auto grammars of `pydantic_function_tool` schemas with `$defs`, a
    recursive one included, beside a tool whose own `Addr` is another schema: each compiles, takes a call that
    satisfies its tool's schema and refuses the calls that break a nested model (or use the other tool's Addr)."""
    _, _, grammars, eos = setup
    tools = [PERSON, OTHER, NODE]
    for t in tools:
        assert "$defs" in t["function"]["parameters"] and t["function"]["strict"] is True
    tree = {"v": 1, "kids": [{"v": 2, "kids": []}]}
    specs = [GrammarSpec("ebnf", tool_call_ebnf(tools, fmt, name="Person")),
             GrammarSpec("ebnf", tool_call_ebnf(tools, fmt)), strict_calls(tools, fmt)]
    for spec in specs:
        assert accepts(grammars, spec, written(fmt, "Person", GOOD), eos)
        for bad in BAD:
            jsonschema.validate(GOOD, PERSON["function"]["parameters"])
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, PERSON["function"]["parameters"])
            assert not accepts(grammars, spec, written(fmt, "Person", bad), eos, then_eos=False), bad
    for spec in specs[1:]:  # the other tools' own definitions
        assert accepts(grammars, spec, written(fmt, "mail", {"to": {"zip": 7}}), eos)
        assert not accepts(grammars, spec, written(fmt, "mail", {"to": {"street": "Main", "number": 3}}), eos,
                           then_eos=False)
        assert accepts(grammars, spec, written(fmt, "Node", tree), eos)
        assert not accepts(grammars, spec, written(fmt, "Node", {"v": 1, "kids": [{"v": "x", "kids": []}]}), eos,
                           then_eos=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_calls_of_a_pydantic_tool_validate_against_its_schema(setup, fmt):
    """The random model's forced calls of the openai-agents tool `ship(to: Spot, qty: int)` (its strict schema as the
    SDK sends it), each row its own stream: every row is one call, read back by the format's parser with the schema,
    whose arguments validate against the tool's `parameters` with jsonschema."""
    agents = pytest.importorskip("agents")
    tok, engine, grammars, eos = setup

    @agents.function_tool
    def ship(to: Spot, qty: int) -> str:
        """Ship to an address."""
        return "shipped"

    params = ship.params_json_schema
    assert "$defs" in params and ship.strict_json_schema
    tools = [{"type": "function", "function": {"name": "ship", "parameters": params, "strict": True}}]
    spec = GrammarSpec("ebnf", tool_call_ebnf(tools, fmt, name="ship"))
    rows = 12
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    out = engine.generate([prompt], n_samples_per_prompt=rows, max_new_tokens=300, seed=3,
                          sample_ids=torch.arange(rows), grammars=[grammars.matcher(spec, [eos]) for _ in range(rows)])
    done = 0
    for ids, mask, reason in zip(out.response_ids, out.response_mask, out.finish_reason, strict=True):
        if reason != "stop":  # a row the token limit cut (a long random string): no whole call to read
            continue
        text = tok.decode([t for t in ids[mask.bool()].tolist() if t != eos])
        parsed = apply_tool_schemas(BUILTIN_PARSERS[fmt](text), tools)
        assert not parsed.errors and len(parsed.calls) == 1, text
        jsonschema.validate(parsed.calls[0].arguments, params)
        done += 1
    assert done >= rows // 2


def test_openai_agents_runs_a_tool_taking_a_model_through_the_gateway():
    """openai-agents' Runner with `@function_tool def ship(to: Addr, qty: int)` (strict: its calls constrained) on the
    chat and the Responses models through the training gateway (qwen3's tokenizer, a scripted engine that checks each
    answer against the grammar of the payload it answers): no 400, the tool runs with the model's arguments, the
    final answer comes back."""
    agents = pytest.importorskip("agents")
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService
    from tests.openai.scripted import limits

    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def ship(to: Addr, qty: int) -> str:
        """Ship to an address."""
        ran.append((to, qty))
        return "shipped"

    tok = family_tokenizer("qwen3")
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    grammars = Grammars(tok, len(tok))
    args = {"to": {"street": "Main", "number": 3}, "qty": 2}
    call = f"<tool_call>\n{json.dumps({'name': 'ship', 'arguments': args})}\n</tool_call>"
    for model_class in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        script = GuardedScript(fmt, [call, "Shipped."], grammars)
        gw = Gateway(OpenAIService(fmt, script, model="policy", context_length=None, max_tokens=64)).start()
        try:
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
            agent = agents.Agent(name="a", tools=[ship], model=model_class("policy", client))
            result = asyncio.run(agents.Runner.run(agent, "Ship two to Main 3."))
        finally:
            gw.close()
        assert result.final_output == "Shipped."
        assert spec_of(script.calls[0][0]["sampling_params"]) is not None  # the strict tool's calls constrained
        assert script.refused == [None, None]
    assert ran == [(Addr(street="Main", number=3), 2)] * 2
