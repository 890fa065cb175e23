"""The XML tool-call formats (qwen3_coder, glm45) write a string argument, and an enum's word, as its text, as their
templates write them: so also a parameter whose schema is a `$ref` to a string enum (a pydantic model's `Enum` field:
`{"$ref": "#/$defs/Unit"}`, with or without a description beside it). The grammar follows the ref before choosing how
the argument is written (`relax.rollout.grammar._xml_arguments`), and the parser reads it back by the same rule
(`relax.agents.parsers.apply_tool_schemas`): a word that looks like JSON ("1") stays the string.

Checked against pydantic's own schema and jsonschema: forced calls drawn by a random byte-level model under the grammar
each parse to arguments that validate; the grammar takes the bare word and refuses the quoted one.

Negative control: before, the ref'd enum was written as JSON (`"c"`, quotes included, like a pattern string), the bare
word was refused, and the parser read "1" as the number 1.
"""

from __future__ import annotations

import enum

import pytest
import torch

from relax.agents.parsers import BUILTIN_PARSERS, apply_tool_schemas
from relax.rollout.grammar import Grammars, GrammarSpec, tool_call_ebnf
from tests.agents.templates import byte_level_engine

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

FORMATS = ("qwen3_coder", "glm45")


class Unit(enum.StrEnum):
    C = "c"
    F = "f"


class Level(enum.StrEnum):
    ONE = "1"
    TWO = "2"


class Weather(pydantic.BaseModel):
    unit: Unit
    level: Level = pydantic.Field(description="how detailed")  # a $ref with a description beside it


PARAMS = Weather.model_json_schema()
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}}]


@pytest.fixture(scope="module")
def setup():
    tok, engine = byte_level_engine()
    return tok, engine, Grammars(tok, len(tok))


def _call(fmt: str, args: dict[str, str]) -> str:
    if fmt == "qwen3_coder":
        return ("<tool_call>\n<function=weather>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                              for k, v in args.items()) + "</function>\n</tool_call>")
    return "<tool_call>weather\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                            for k, v in args.items()) + "</tool_call>"


def test_the_schema_is_pydantic_s_refs():
    props = PARAMS["properties"]
    assert set(props["unit"]) == {"$ref"} and set(props["level"]) == {"$ref", "description"}
    assert PARAMS["$defs"]["Unit"]["enum"] == ["c", "f"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_refd_enum_is_written_as_its_bare_word_and_read_back_as_the_string(setup, fmt):
    tok, _, grammars = setup
    eos = tok.eos_token_id
    spec = GrammarSpec("ebnf", tool_call_ebnf(TOOLS, fmt, name="weather"))

    def accepts(text: str) -> bool:
        m = grammars.matcher(spec, [eos])
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.accept(eos)

    assert accepts(_call(fmt, {"unit": "c", "level": "1"}))
    assert not accepts(_call(fmt, {"unit": '"c"', "level": '"1"'}))  # JSON: not as the template writes it
    assert not accepts(_call(fmt, {"unit": "k", "level": "1"}))  # not a word of the enum
    parsed = apply_tool_schemas(BUILTIN_PARSERS[fmt](_call(fmt, {"unit": "f", "level": "2"})), TOOLS)
    assert [c.arguments for c in parsed.calls] == [{"unit": "f", "level": "2"}]  # "2" the string, not 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_calls_drawn_under_the_grammar_validate_against_pydantic_s_schema(setup, fmt):
    tok, engine, grammars = setup
    eos, rows = tok.eos_token_id, 12
    spec = GrammarSpec("ebnf", tool_call_ebnf(TOOLS, fmt, name="weather"))
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    out = engine.generate([prompt], n_samples_per_prompt=rows, max_new_tokens=200, seed=5,
                          sample_ids=torch.arange(rows), grammars=[grammars.matcher(spec, [eos]) for _ in range(rows)])
    for ids, mask, reason in zip(out.response_ids, out.response_mask, out.finish_reason, strict=True):
        ids = ids[mask.bool()].tolist()
        assert reason == "stop" and ids[-1] == eos
        text = tok.decode(ids[:-1])
        parsed = apply_tool_schemas(BUILTIN_PARSERS[fmt](text), TOOLS)
        assert not parsed.errors and len(parsed.calls) == 1, text
        jsonschema.validate(parsed.calls[0].arguments, PARAMS)
        Weather.model_validate(parsed.calls[0].arguments)
        assert '"' not in text, text  # every word bare
