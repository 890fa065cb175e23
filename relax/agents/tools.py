"""Tools: an OpenAI function schema plus a callable, called by the model in its family's format.

A model calls a tool by writing, in the Hermes/Qwen format, `<tool_call>{"name": "calculator", "arguments":
{"expression": "3*4"}}</tool_call>` (or a JSON list of such calls inside one tag, SmolLM2's format), or in the
format of its family that `data.tool_parser` names (`relax.agents.parsers`); several calls in one turn are allowed.
Each call's result goes back as a `tool` message rendered with the chat template, in the order of the calls. A
malformed call (no closing tag, invalid JSON, no name), an unknown tool, a call that raises, and one that runs past
`data.tool_timeout_s` all come back to the model as an error message in its place and count as tool errors; none
of them stops the run.

Calls run in worker processes (`relax.rewards.worker_pool.RewardWorkers` with `run_tool` as the caller), so a hung
call is killed at its time limit; `data.tool_timeout_s=null` calls them in the rollout process without a limit.

A tool is named in `data.tools` by a built-in name (`calculator`, `python`: code in the sandbox) or by
`package.module:attr`, an attribute that is a `Tool`. Tools are stateless: the same call gives the same result
whatever the episode (so resuming an episode never calls them again).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from relax.agents.parsers import CallError, ParsedMessage, ToolCall, apply_tool_schemas, parse_hermes
from relax.agents.python_tool import PythonTool, python
from relax.imports import resolve_component


@dataclass(frozen=True)
class Tool:
    """`schema`: the OpenAI function schema ({"type": "function", "function": {"name", "description",
    "parameters"}}); `fn(**arguments) -> str` (another JSON-serialisable value is sent as JSON)."""

    schema: dict
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: bool
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------------- the calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # a ** b with |b| beyond this is refused (no runaway big integers)


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses over numbers); integers stay exact."""
    value = _evaluate(ast.parse(str(expression), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer():
            return str(int(value))
        return f"{value:.6g}"
    return str(value)


CALCULATOR = Tool(
    schema={"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "the expression, e.g. (3 + 4) * 12"}},
            "required": ["expression"]}}},
    fn=calculator,
)

PYTHON = Tool(
    schema={"type": "function", "function": {
        "name": "python",
        "description": "Run a Python program (standard library only, no files outside its directory, no network) "
                       "and get what it prints.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the program, e.g. print(sum(range(10)))"}},
            "required": ["code"]}}},
    fn=python,  # relax.agents.python_tool: the code runs in relax.rewards.sandbox
)

BUILTIN_TOOLS: dict[str, Tool] = {"calculator": CALCULATOR, "python": PYTHON}


class ToolSpecError(ValueError):
    """`data.tools` names no usable tool; raised at start."""


def get_tool(spec: str, sandbox: Any = None) -> Tool:
    """The tool named by `spec`: a built-in name or `package.module:attr` (a `Tool`); `sandbox` (`data.sandbox`):
    the python tool's limits (None: the defaults)."""
    if sandbox is not None and spec.strip() == PYTHON.name:
        return Tool(schema=PYTHON.schema, fn=PythonTool.for_config(sandbox))
    value = resolve_component(BUILTIN_TOOLS, "data.tools", spec, error=ToolSpecError,
                              unknown="{option}: unknown tool {spec!r}; expected one of {builtins} or "
                                      "'package.module:attr' naming a relax.agents.tools.Tool",
                              unloadable="{option}: cannot load {spec!r}: {exc}")
    if not isinstance(value, Tool):
        raise ToolSpecError(f"data.tools: {spec!r} is a {type(value).__name__}, not a relax.agents.tools.Tool")
    return value


def get_tools(specs: list[str] | tuple[str, ...], sandbox: Any = None) -> dict[str, Tool]:
    """Tools by name (two tools of one name are an error); `sandbox`: as `get_tool`'s."""
    out: dict[str, Tool] = {}
    for spec in specs:
        tool = get_tool(spec, sandbox)
        if tool.name in out:
            raise ToolSpecError(f"data.tools: two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


# ----------------------------------------------------------------------------------------------- parsing
def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The Hermes-format tool calls of a model message, in order, and the errors of the malformed ones (each a
    message for the model), apart. The loop and the gateway read messages with the configured parser
    (`relax.agents.parsers`, `data.tool_parser`), which keeps calls and errors in the order of the text."""
    parsed = parse_hermes(text)
    return parsed.calls, parsed.errors


# ----------------------------------------------------------------------------------------------- calling
def run_tool(box: dict[str, Callable[..., Any]], name: str, arguments: dict) -> tuple[Optional[str], Optional[str]]:
    """One tool call: (result text, None) or (None, the error). The worker processes' caller."""
    try:
        value = box[name](**arguments)
        return (value if isinstance(value, str) else json.dumps(value)), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}" if str(exc) else traceback.format_exc().strip().splitlines()[-1]


class ToolRunner:
    """Calls tools (`tools` by name) with a time limit of `timeout_s` each (None: in this process, no limit)."""

    def __init__(self, tools: dict[str, Tool], timeout_s: Optional[float]):
        self.tools, self.timeout_s = tools, timeout_s
        self._workers = None

    def __call__(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order. Each call is read with its tool's schema first (`apply_tool_schemas`: a
        string argument of the XML formats as its text; a strict tool's call that breaks its schema is answered with
        the error, and the tool does not run)."""
        read = apply_tool_schemas(ParsedMessage(tuple(calls), ""), [t.schema for t in self.tools.values()]).items
        refused = {i: item.message for i, item in enumerate(read) if isinstance(item, CallError)}
        calls = [c if i in refused else read[i] for i, c in enumerate(calls)]
        known = [c for i, c in enumerate(calls) if c.name in self.tools and i not in refused]
        t0 = time.perf_counter()
        box = {name: tool.fn for name, tool in self.tools.items()}
        if self.timeout_s is None:
            outcomes = [run_tool(box, c.name, c.arguments) for c in known]
        else:
            if self._workers is None:
                from relax.rewards.worker_pool import RewardWorkers

                self._workers = RewardWorkers(box, caller=run_tool, limit_name="data.tool_timeout_s", what="tool")
            outcomes, _ = self._workers.run([(c.name, c.arguments) for c in known], self.timeout_s)
        seconds = (time.perf_counter() - t0) / max(1, len(known))
        results, done = [], iter(outcomes)
        for i, c in enumerate(calls):
            if i in refused:
                results.append(ToolResult(f"Error: {refused[i]}", True))
                continue
            if c.name not in self.tools:
                results.append(ToolResult(f"Error: unknown tool {c.name!r}; the tools are {sorted(self.tools)}", True))
                continue
            value, error = next(done)
            results.append(ToolResult(value, False, seconds) if error is None
                           else ToolResult(f"Error: {error}", True, seconds))
        return results

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None
