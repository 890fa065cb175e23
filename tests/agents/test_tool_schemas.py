"""Tool calls read with the offered tools' schemas (`relax.agents.parsers.apply_tool_schemas`), as SGLang's parsers
read them: the XML formats (qwen3_coder, glm45) keep a string argument's text, and a `strict` tool's call whose
arguments do not satisfy its schema is a malformed call.

The XML cases are checked against the families' own chat templates (tests/agents/templates.py): a call rendered by
the template and read back with the schema gives the arguments it was rendered from; read without the schema (the
negative control) a string that looks like JSON comes back as that JSON."""

from __future__ import annotations

import pytest
from templates import family_tokenizer

from relax.agents.loops import AgentFactory
from relax.agents.parsers import (
    CallError,
    ParsedMessage,
    ToolCall,
    apply_tool_schemas,
    parse_glm45,
    parse_hermes,
    parse_qwen3_coder,
)
from relax.agents.tools import Tool, run_tool

# a tool whose string arguments hold text that is also JSON
SCHEMA = {"type": "object", "properties": {
    "code": {"type": "string"}, "label": {"type": ["string", "null"]}, "unit": {"enum": ["1", "2"]},
    "count": {"type": "integer"}, "items": {"type": "array", "items": {"type": "integer"}}},
    "required": ["code", "count"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "run", "description": "run it", "parameters": SCHEMA}}]
ARGUMENTS = {"code": "42", "label": "[1, 2]", "unit": "2", "count": 7, "items": [1, 2]}


def rendered_call(family: str, arguments: dict) -> str:
    """The assistant turn calling run(**arguments) as the family's chat template writes it, from its first
    <tool_call> to its last </tool_call>."""
    tok = family_tokenizer(family)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "id": "c1", "function": {"name": "run", "arguments": arguments}}]}],
        tools=TOOLS, tokenize=False)
    start = text.rindex("<tool_call>", 0, text.rindex("</tool_call>"))
    return text[start:text.rindex("</tool_call>") + len("</tool_call>")]


@pytest.mark.parametrize(("family", "parser"), [("qwen3_coder", parse_qwen3_coder), ("qwen3_5", parse_qwen3_coder),
                                                ("glm4_5", parse_glm45)])
def test_an_xml_call_read_with_its_schema_gives_back_what_the_template_rendered(family, parser):
    text = rendered_call(family, ARGUMENTS)
    read = apply_tool_schemas(parser(text), TOOLS)
    assert read.calls == [ToolCall("run", ARGUMENTS)] and not read.errors
    # negative control: without the schema, the strings that are JSON arrive as JSON
    alone = parser(text).calls[0].arguments
    assert (alone["code"], alone["label"], alone["unit"]) == (42, [1, 2], 2)
    assert (alone["count"], alone["items"]) == (7, [1, 2])  # (the other values are the same either way)


def test_a_nullable_string_reads_null_as_none_and_json_formats_are_unchanged():
    text = "<tool_call>\n<function=run>\n<parameter=label>\nnull\n</parameter>\n</function>\n</tool_call>"
    assert apply_tool_schemas(parse_qwen3_coder(text), TOOLS).calls[0].arguments == {"label": None}
    hermes = '<tool_call>{"name": "run", "arguments": {"code": 42, "count": 1}}</tool_call>'
    assert apply_tool_schemas(parse_hermes(hermes), TOOLS).calls == parse_hermes(hermes).calls  # JSON says the type


def strict(parameters: dict = SCHEMA, value=True) -> list[dict]:
    return [{"type": "function", "function": {"name": "run", "parameters": parameters, "strict": value}}]


def hermes(arguments: dict, name: str = "run") -> ParsedMessage:
    import json

    return parse_hermes(f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>')


@pytest.mark.parametrize(("arguments", "where"), [
    ({"code": "x", "count": "seven"}, "count"),  # a wrong type
    ({"code": "x"}, "'count' is a required property"),  # a required argument missing
    ({"code": "x", "count": 1, "extra": 0}, "'extra' was unexpected"),  # additionalProperties false
    ({"code": "x", "count": 1, "items": [1, "a"]}, "items/1"),  # a nested value
])
def test_a_strict_tools_call_that_breaks_its_schema_is_malformed(arguments, where):
    read = apply_tool_schemas(hermes(arguments), strict())
    assert not read.calls and len(read.errors) == 1
    assert "do not satisfy its schema (strict)" in read.errors[0] and where in read.errors[0]
    # not strict (or strict false): the same call is a call, whatever its arguments
    assert apply_tool_schemas(hermes(arguments), TOOLS).calls == [ToolCall("run", arguments)]
    assert apply_tool_schemas(hermes(arguments), strict(value=False)).calls == [ToolCall("run", arguments)]


def test_strict_keeps_valid_calls_the_order_of_items_and_calls_of_tools_not_offered():
    valid = {"code": "x", "count": 1}
    text = (hermes(valid).items + hermes({"code": 1, "count": 1}).items + hermes({"q": 1}, name="other").items)
    read = apply_tool_schemas(ParsedMessage(text, ""), strict())
    assert [type(i) for i in read.items] == [ToolCall, CallError, ToolCall]
    assert read.items[0] == ToolCall("run", valid) and read.items[2] == ToolCall("other", {"q": 1})


def test_the_xml_strings_are_read_before_the_strict_check():
    """"42" written for a string argument satisfies a strict schema (read as a string, not as the number 42)."""
    text = rendered_call("qwen3_coder", {"code": "42", "count": 7})
    assert apply_tool_schemas(parse_qwen3_coder(text), strict()).calls == [ToolCall("run", {"code": "42",
                                                                                             "count": 7})]


# ----------------------------------------------------------------------------------------------- the tool loop
def add(a: int, b: int) -> int:
    return a + b


def kind(code: str) -> str:
    return type(code).__name__


KIND = Tool({"type": "function", "function": {"name": "kind", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}, kind)


STRICT_ADD = Tool({"type": "function", "function": {
    "name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}}, add)


def xml_call(name: str, **arguments: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_the_tool_loop_reads_calls_with_its_tools_schemas():
    """data.tools' schemas (the loop's ToolRunner reads each call with its tool's): a string argument written "42"
    reaches its tool as text (read without the schema it is the number 42: the negative control), and a strict
    tool's call with an argument of the wrong type is answered with its error, in its place, without running the
    tool."""
    factory = AgentFactory(None, ["test_tool_schemas:KIND", "test_tool_schemas:STRICT_ADD"], None, None,
                           tool_parser=parse_qwen3_coder)
    try:
        loop = factory()
        loop.reset({})
        reply = loop.turn(xml_call("kind", code="42") + xml_call("add", a="1", b="x") + xml_call("add", a="1", b="2"))
        contents = [m["content"] for m in reply.messages]
        assert contents[0] == "str" and contents[2] == "3", contents
        assert contents[1].startswith("Error: the arguments of 'add' do not satisfy its schema (strict) at b")
        assert (reply.tool_calls, reply.tool_errors) == (3, 1)
        unread = parse_qwen3_coder(xml_call("kind", code="42")).calls[0]
        assert run_tool({"kind": kind}, unread.name, unread.arguments) == ("int", None)  # without the schema
    finally:
        factory.close()
