"""Tools: the `<tool_call>` parser, the calculator, and calls in worker processes that fail without stopping the run
(unknown tool, exception, time-out), each counted."""

from __future__ import annotations

import time

import pytest

from relax.agents.tools import (
    CALCULATOR,
    Tool,
    ToolCall,
    ToolRunner,
    ToolSpecError,
    calculator,
    get_tools,
    parse_tool_calls,
)


def test_parse_tool_calls_reads_the_hermes_format_and_names_each_malformed_call():
    text = ('let me compute <tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call> and '
            '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "3*4"}), ToolCall("calculator", {"expression": "1+1"})]
    assert errors == []
    assert parse_tool_calls("no call here") == ([], [])
    # SmolLM2's form: a JSON list of calls in one tag (a bad element is reported, the good ones kept)
    calls, errors = parse_tool_calls('<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}, 7]'
                                     '</tool_call>')
    assert calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})] and len(errors) == 1
    calls, errors = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {</tool_call>')
    assert calls == [] and len(errors) == 1 and "invalid JSON" in errors[0]
    calls, errors = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x"')
    assert calls == [] and len(errors) == 2 and "not closed" in errors[1]
    calls, errors = parse_tool_calls('<tool_call>{"name": "x", "arguments": [1]}</tool_call>')
    assert calls == [] and "not a JSON object" in errors[0]


def test_calculator_is_exact_on_integers_and_refuses_anything_but_arithmetic():
    assert calculator("37 * 48") == "1776"  # 37 * 48 by hand: 1480 + 296
    assert calculator("(3 + 4) * 12 - 2 ** 3") == "76"
    assert calculator("7 / 2") == "3.5" and calculator("8 / 2") == "4"
    for bad in ("__import__('os')", "a + 1", "2 ** 1000", "1 / 0"):
        with pytest.raises((ValueError, SyntaxError, ZeroDivisionError)):
            calculator(bad)


def boom(**_) -> str:
    raise RuntimeError("the tool broke")


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


BOOM = Tool({"type": "function", "function": {"name": "boom", "parameters": {}}}, boom)
SLEEPY = Tool({"type": "function", "function": {"name": "sleepy", "parameters": {}}}, sleepy)


@pytest.mark.parametrize("timeout_s", [None, 2.0])
def test_tool_failures_come_back_as_errors_and_the_runner_goes_on(timeout_s):
    runner = ToolRunner({"calculator": CALCULATOR, "boom": BOOM, "sleepy": SLEEPY}, timeout_s)
    try:
        results = runner([ToolCall("calculator", {"expression": "6*7"}), ToolCall("nope", {}),
                          ToolCall("boom", {}), ToolCall("calculator", {"expr": "1"}),
                          ToolCall("sleepy", {"seconds": 0.01})])
        assert [r.error for r in results] == [False, True, True, True, False]
        assert results[0].content == "42" and results[4].content == "woke"
        assert "unknown tool 'nope'" in results[1].content and "the tool broke" in results[2].content
        assert "TypeError" in results[3].content  # a wrong argument name
    finally:
        runner.close()


def test_a_tool_past_its_time_limit_is_killed_and_reported():
    runner = ToolRunner({"sleepy": SLEEPY, "calculator": CALCULATOR}, 0.5)
    try:
        t0 = time.perf_counter()
        slow, fast = runner([ToolCall("sleepy", {"seconds": 30}), ToolCall("calculator", {"expression": "1+1"})])
        assert time.perf_counter() - t0 < 20
        assert slow.error and "data.tool_timeout_s=0.5" in slow.content
        assert not fast.error and fast.content == "2"
        # the killed worker was replaced: the next call runs
        (again,) = runner([ToolCall("calculator", {"expression": "2+2"})])
        assert again.content == "4"
    finally:
        runner.close()


def test_tools_are_named_by_builtin_name_or_import_path():
    assert list(get_tools(["calculator"])) == ["calculator"]
    assert list(get_tools(["tests.agents.test_tools:BOOM"])) == ["boom"]
    with pytest.raises(ToolSpecError, match="unknown tool 'abacus'"):
        get_tools(["abacus"])
    with pytest.raises(ToolSpecError, match="not a relax.agents.tools.Tool"):
        get_tools(["tests.agents.test_tools:boom"])
    with pytest.raises(ToolSpecError, match="two tools are named 'calculator'"):
        get_tools(["calculator", "calculator"])
