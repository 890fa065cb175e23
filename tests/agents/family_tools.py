"""A tool-call parser for tests (`data.tool_parser=tests.agents.family_tools:always_calculator`): every model turn reads
as one well-formed call of the calculator on 6 * 7, whatever the model wrote. An untrained model rarely writes a
well-formed call in its family's format, so a run with `data.tools=[calculator]` and this parser exercises the tool
path on every turn: the real tool runs (in its worker processes) and its result, "42", comes back as a `tool`
message rendered with the model's chat template."""

from __future__ import annotations

from relax.agents.parsers import ParsedMessage, ToolCall

EXPRESSION, RESULT = "6 * 7", "42"


def always_calculator(text: str) -> ParsedMessage:
    return ParsedMessage(items=(ToolCall("calculator", {"expression": EXPRESSION}),), content=text)
