"""Tool-call parsers (`data.tool_parser`, relax/agents/parsers.py): each family's format read into calls and
malformed calls in the order of the text, the content outside them kept; `auto` picks the parser from the chat
template; a custom parser loads from `package.module:function`; a bad name is rejected before anything starts; the
built-in loop answers the calls in their order and the gateway reads them with the configured parser."""

from __future__ import annotations

import json

import pytest

from relax.agents.loops import AgentFactory
from relax.agents.parsers import (
    BUILTIN_PARSERS,
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    ParsedMessage,
    ToolCall,
    ToolParserSpecError,
    get_parser,
    parse_deepseek_v3,
    parse_glm45,
    parse_hermes,
    parse_llama3_json,
    parse_qwen3_coder,
)
from relax.agents.protocol import Reply
from relax.agents.tools import parse_tool_calls
from relax.config.schema import TOOL_PARSERS


def shape(parsed: ParsedMessage) -> list:
    """The items as comparable values: ("call", name, arguments) or ("error", message)."""
    return [("call", i.name, i.arguments) if isinstance(i, ToolCall) else ("error", i.message) for i in parsed.items]


def kinds(parsed: ParsedMessage) -> list[str]:
    return [entry[0] if entry[0] == "error" else entry[1] for entry in shape(parsed)]


# ----------------------------------------------------------------------------------------------- each format
def test_hermes_reads_todays_format_in_order():
    text = ('Let me see. <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call> then '
            '<tool_call>{"name": "calc", "arguments": {</tool_call>'
            '<tool_call>[{"name": "list_a", "arguments": "{\\"y\\": 2}"}, 7, {"name": "list_b"}]</tool_call>'
            '<tool_call>\n{"name": "last", "arguments": {"z": [3]}}\n</tool_call> done')
    parsed = parse_hermes(text)
    assert kinds(parsed) == ["calc", "error", "list_a", "error", "list_b", "last"]
    assert shape(parsed)[0] == ("call", "calc", {"x": 1}) and shape(parsed)[2] == ("call", "list_a", {"y": 2})
    assert parsed.errors[0].startswith("invalid JSON in <tool_call>") and "must be an object" in parsed.errors[1]
    assert parsed.content == "Let me see.  then  done"
    assert parse_tool_calls(text) == (parsed.calls, parsed.errors)  # the old API: the same, calls and errors apart
    unclosed = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"')
    assert kinds(unclosed) == ["a", "error"] and "not closed" in unclosed.errors[0]
    assert parse_hermes("  just an answer: 42 ") == ParsedMessage((), "just an answer: 42")


def test_hermes_reads_a_tag_inside_an_argument_string_as_text_of_it():
    """A call whose JSON string holds `</tool_call>` or `<tool_call>` (code or docs about tool calls, which a forced
    call's grammar allows inside a string) is one call with that argument; it was cut at the first closing tag before
    (the call then malformed, the whole message text). Malformed JSON still ends at the next closing tag."""
    arg = 'a</tool_call>b <tool_call>c'
    text = ("Sure. <tool_call>\n" + json.dumps({"name": "calc", "arguments": {"expression": arg}}) +
            "\n</tool_call> <tool_call>{bad</tool_call> done")
    parsed = parse_hermes(text)
    assert shape(parsed)[0] == ("call", "calc", {"expression": arg}) and kinds(parsed) == ["calc", "error"]
    assert parsed.content == "Sure.   done" and "invalid JSON" in parsed.errors[0]
    inside = parse_hermes('<tool_call>{"name": "w", "arguments": {"s": "<tool_call>"}}</tool_call>')
    assert shape(inside) == [("call", "w", {"s": "<tool_call>"})] and not inside.errors  # no unclosed tag counted


def test_qwen3_coder_reads_xml_calls_and_decodes_json_values():
    text = ("I will run two commands.\n<tool_call>\n<function=run>\n<parameter=command>\nls -la\n</parameter>\n"
            "<parameter=options>\n{\"cwd\": \"/tmp\", \"timeout\": 5}\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=run>\n<parameter=command>\nunclosed\n</function>\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"run\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>\n<function=echo>\n<parameter=text>\ntwo\nlines\n</parameter>\n<parameter=n>\n3\n</parameter>"
            "\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>")
    parsed = parse_qwen3_coder(text)
    assert kinds(parsed) == ["run", "error", "error", "echo", "ping"]
    assert shape(parsed)[0] == ("call", "run", {"command": "ls -la", "options": {"cwd": "/tmp", "timeout": 5}})
    assert shape(parsed)[3] == ("call", "echo", {"text": "two\nlines", "n": 3})  # text kept, JSON decoded
    assert shape(parsed)[4] == ("call", "ping", {})
    assert "other than <parameter=NAME>" in parsed.errors[0] and "<function=NAME>" in parsed.errors[1]
    assert parsed.content == "I will run two commands."
    unclosed = parse_qwen3_coder("<tool_call>\n<function=run>\n<parameter=command>\nls")
    assert kinds(unclosed) == ["error"] and "not closed" in unclosed.errors[0]
    assert parse_qwen3_coder("The answer is 4.") == ParsedMessage((), "The answer is 4.")


def test_llama3_json_reads_the_python_tag_and_whole_json_messages():
    tagged = ('Checking both. <|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; '
              '{"name": "weather", "parameters": "{\\"city\\": \\"Rome\\"}"}; {"name": "weather", "parameters": [1]}; '
              '{"name": "time", "arguments": {"tz": "UTC"}}')
    parsed = parse_llama3_json(tagged)
    assert shape(parsed)[:2] == [("call", "weather", {"city": "Paris"}), ("call", "weather", {"city": "Rome"})]
    assert kinds(parsed) == ["weather", "weather", "error", "time"] and "not a JSON object" in parsed.errors[0]
    assert parsed.content == "Checking both."
    # the tag is a special token: decoded with special tokens skipped, the message is the JSON itself
    whole = parse_llama3_json('{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {"k": "v"}} waiting')
    assert shape(whole) == [("call", "a", {}), ("call", "b", {"k": "v"})] and whole.content == "waiting"
    listed = parse_llama3_json('[{"name": "a", "parameters": {}}, {"parameters": {}}]')
    assert kinds(listed) == ["a", "error"]
    broken = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "param')
    assert kinds(broken) == ["a", "error"] and "invalid JSON" in broken.errors[0]
    assert parse_llama3_json('{"answer": 42}') == ParsedMessage((), '{"answer": 42}')  # JSON, but not a call
    assert parse_llama3_json("It is 42.") == ParsedMessage((), "It is 42.")


def test_glm45_reads_name_then_key_value_pairs():
    text = ("Looking it up.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
            "<tool_call>{\"name\": \"weather\"}</tool_call>\n"
            "<tool_call>weather\n<arg_key>city</arg_key>\n</tool_call>\n"
            "<tool_call>search\n<arg_key>filters</arg_key>\n<arg_value>{\"lang\": \"en\"}</arg_value>\n</tool_call>"
            "\n<tool_call>now</tool_call> Done.")
    parsed = parse_glm45(text)
    assert kinds(parsed) == ["weather", "error", "error", "search", "now"]
    assert shape(parsed)[0] == ("call", "weather", {"city": "北京", "days": 3})
    assert shape(parsed)[3] == ("call", "search", {"filters": {"lang": "en"}}) and shape(parsed)[4] == ("call", "now",
                                                                                                         {})
    assert "start with the tool's name" in parsed.errors[0] and "pairs" in parsed.errors[1]
    assert parsed.content == "Looking it up.\n\n\n\n\n Done."
    assert parse_glm45("No tools needed.") == ParsedMessage((), "No tools needed.")


def deepseek_call(name: str, args: str) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def test_deepseek_v3_reads_the_tool_call_tokens():
    text = ("Let me check." + DS_CALLS_BEGIN + deepseek_call("weather", '{"city": "Tokyo"}') + "\n"
            + deepseek_call("weather", '{"city": ') + "\n"
            + deepseek_call("weather", json.dumps('{"city": "Paris"}'))
            + f"{DS_CALL_BEGIN}weather{DS_SEP}{{}}{DS_CALL_END}"
            + deepseek_call("weather", "[1, 2]") + DS_CALLS_END)
    parsed = parse_deepseek_v3(text)
    assert kinds(parsed) == ["weather", "error", "weather", "error", "error"]
    assert shape(parsed)[0] == ("call", "weather", {"city": "Tokyo"})
    assert shape(parsed)[2] == ("call", "weather", {"city": "Paris"})  # arguments as a JSON string, decoded
    assert "invalid JSON" in parsed.errors[0] and "```json" in parsed.errors[1] and "not a JSON" in parsed.errors[2]
    assert parsed.content == "Let me check."
    unclosed = parse_deepseek_v3(DS_CALLS_BEGIN + deepseek_call("a", "{}") + DS_CALL_BEGIN + "function" + DS_SEP)
    assert kinds(unclosed) == ["a", "error"] and "not closed" in unclosed.errors[0]
    assert parse_deepseek_v3("Plain text.") == ParsedMessage((), "Plain text.")


# ----------------------------------------------------------------------------------------------- the registry
class FakeTokenizer:
    def __init__(self, chat_template):
        self.chat_template = chat_template


# a line of each family's chat template that writes (or reads) a tool call
TEMPLATES = {
    "qwen3_coder": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}",  # writes <tool_call> too
    "llama3_json": '{%- if message.role == "ipython" %}{{- "<|python_tag|>" + tool_call.name }}',
    "glm45": "{{ '\\n<tool_call>' + tc.name }}{% for k, v in _args.items() %}\\n<arg_key>{{ k }}</arg_key>",
    "deepseek_v3": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
    "hermes": '{{- "<tool_call>\\n{\\"name\\": \\"" }}{{- tool_call.name }}',  # Qwen3's
    "mistral": '{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}',  # Mistral-7B-Instruct-v0.3's
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_auto_picks_the_parser_of_the_chat_template(family):
    assert get_parser("auto", FakeTokenizer(TEMPLATES[family])) is BUILTIN_PARSERS[family]


def test_auto_without_a_template_is_hermes_and_names_match_the_schema():
    from relax.data.tokenizer import build_tiny_tokenizer

    assert get_parser("auto", build_tiny_tokenizer()) is parse_hermes  # ChatML without tools
    assert get_parser("auto", FakeTokenizer(None)) is parse_hermes and get_parser("auto") is parse_hermes
    assert get_parser("glm45") is parse_glm45
    assert set(TOOL_PARSERS) == set(BUILTIN_PARSERS) | {"auto"}  # validation's list is the registry's


def upper_parser(text: str) -> ParsedMessage:
    """A custom format: each line `CALL name` is a call without arguments."""
    calls = tuple(ToolCall(line.split()[1], {}) for line in text.splitlines() if line.startswith("CALL "))
    return ParsedMessage(calls, "\n".join(line for line in text.splitlines() if not line.startswith("CALL ")))


def wrong_parser(text: str) -> list:
    return []


def test_a_custom_parser_loads_from_its_import_path():
    parser = get_parser("tests.agents.test_tool_parsers:upper_parser")
    assert shape(parser("hello\nCALL ping")) == [("call", "ping", {})] and parser("hello\nCALL ping").content == "hello"
    with pytest.raises(TypeError, match="data.tool_parser='tests.agents.test_tool_parsers:wrong_parser' returned"):
        get_parser("tests.agents.test_tool_parsers:wrong_parser")("text")
    with pytest.raises(ToolParserSpecError, match="data.tool_parser='granite': unknown"):
        get_parser("granite")
    with pytest.raises(ToolParserSpecError, match="data.tool_parser: cannot load"):
        get_parser("tests.agents.test_tool_parsers:nothing_here")
    with pytest.raises(ToolParserSpecError, match="not a function"):
        get_parser("tests.agents.test_tool_parsers:TEMPLATES")


def test_validation_rejects_a_name_that_is_not_a_parser():
    from relax.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(["data.tool_parser=qwen4"])
    assert [v.fields for v in info.value.violations] == [("data.tool_parser",)]
    assert "data.tool_parser='qwen4': unknown" in str(info.value)
    assert load_config(["data.tool_parser=glm45"]).data.tool_parser == "glm45"
    assert load_config(["data.tool_parser=my_parsers:read"]).data.tool_parser == "my_parsers:read"  # loaded at start
    assert load_config([]).data.tool_parser == "auto"


# ----------------------------------------------------------------------------------------------- loop and gateway
CALL = '<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'
VALID_MALFORMED_VALID = (CALL.format(args='{"expression": "6 * 7"}') + " "
                         + CALL.format(args='{"expression": ') + " "
                         + CALL.format(args='"{\\"expression\\": \\"1 + 1\\"}"'))


def assert_in_call_order(reply: Reply) -> None:
    """The observation of VALID_MALFORMED_VALID: the first call's result, the malformed call's error, the third
    call's result, in that order (the model matches results to calls by position)."""
    contents = [m["content"] for m in reply.messages]
    assert [m["role"] for m in reply.messages] == ["tool", "tool", "tool"]
    assert contents[0] == "42" and contents[1].startswith("Error: invalid JSON") and contents[2] == "2", contents
    assert (reply.tool_calls, reply.tool_errors) == (3, 1)


def test_the_loop_answers_the_calls_in_their_order():
    factory = AgentFactory(None, ["calculator"], None, None)
    loop = factory()
    loop.reset({})
    assert_in_call_order(loop.turn(VALID_MALFORMED_VALID))


def test_negative_control_results_first_and_errors_last_fail_the_order_check():
    """Before: the well-formed calls' results, then the errors of the malformed ones."""
    factory = AgentFactory(None, ["calculator"], None, None)
    calls, malformed = parse_tool_calls(VALID_MALFORMED_VALID)
    results = factory.runner(calls)
    messages = [{"role": "tool", "content": r.content} for r in results]
    messages += [{"role": "tool", "content": f"Error: {m}"} for m in malformed]
    old = Reply(messages=messages, tool_calls=len(calls) + len(malformed),
                tool_errors=sum(r.error for r in results) + len(malformed))
    with pytest.raises(AssertionError):
        assert_in_call_order(old)


def test_the_run_config_reaches_the_loop():
    """data.tool_parser picks the parser the episodes' loop reads calls with (relax.agents.episode.EpisodeMaker)."""
    from relax.agents.episode import EpisodeMaker
    from relax.config import load_config

    qwen_call = ("<tool_call>\n<function=calculator>\n<parameter=expression>\n6 * 7\n</parameter>\n</function>\n"
                 "</tool_call>")
    answers = {}
    for name in ("auto", "qwen3_coder"):
        cfg = load_config(["data.tools=[calculator]", "rollout.max_turns=2", "data.tool_timeout_s=null",
                           f"data.tool_parser={name}"])
        maker = EpisodeMaker.for_config(cfg)
        loop = maker.loops()
        loop.reset({})
        answers[name] = loop.turn(qwen_call).messages
        maker.close()
    assert answers["qwen3_coder"] == [{"role": "tool", "content": "42"}]
    assert answers["auto"][0]["content"].startswith("Error: invalid JSON")  # the tiny model's ChatML: Hermes


def test_the_gateway_reads_calls_with_its_parser():
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.serve.openai.chat import ChatFormat

    tok = build_tiny_tokenizer()
    text = "Sure.<tool_call>\n<function=calculator>\n<parameter=expression>\n37 * 48\n</parameter>\n</function>\n" \
           "</tool_call>"
    content, calls = ChatFormat(tok, (tok.eos_token_id,), parse_qwen3_coder).tool_calls(text)
    assert content == "Sure." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("calculator", {"expression": "37 * 48"})]
    assert ChatFormat(tok, (tok.eos_token_id,)).tool_calls(text) == (text, None)  # auto: Hermes, a malformed call
    assert ChatFormat.tool_calls(text) == (text, None)  # on the class: Hermes, as before


@pytest.mark.parametrize("family", ["deepseek_v3", "llama3_1", "qwen3_coder", "glm4_5"])
def test_a_call_written_in_special_tokens_reaches_the_parser(family):
    """DeepSeek's call markers and Llama's <|python_tag|> are special tokens of their tokenizers: the text the episode
    loop and the gateway parse keeps them (`message_decoder`), so the model's call is read as a call; decoding with
    every special token skipped (the negative control, for DeepSeek) loses the markers and the call with them."""
    import sys
    from pathlib import Path

    from relax.agents.episode import EpisodeMaker
    from relax.agents.parsers import message_decoder, parser_for_template
    from relax.serve.openai.chat import ChatFormat

    sys.path.insert(0, str(Path(__file__).parent))
    from templates import FAMILIES, family_tokenizer

    tok = family_tokenizer(family)
    fam = FAMILIES[family]
    tokens = tok.encode(fam.tool_call, add_special_tokens=False) + [tok.convert_tokens_to_ids(fam.eos)]
    parse = BUILTIN_PARSERS[parser_for_template(tok.chat_template)]
    maker = EpisodeMaker(lambda: None, tok, max_turns=2, max_tool_errors=1)
    gateway = ChatFormat(tok, (tok.eos_token_id,))
    for text in (message_decoder(tok)(tokens), maker.decode(tokens), gateway.decode(tokens[:-1])):
        assert [(c.name, c.arguments) for c in parse(text).calls] == [("calculator", {"expression": "6 * 7"})], text
        assert fam.eos not in text  # the other special tokens are still left out
    if family == "deepseek_v3":
        assert not parse(tok.decode(tokens, skip_special_tokens=True)).calls
