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
from tests.openai.scripted import CutEngine


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


# ----------------------------------------------------------------------------------------------- cut answers
# A forced answer (tool_choice "required") that max_tokens cut: ChatFormat.tool_calls(cut=True) keeps the complete
# calls before the first malformed item, so each parser must give the complete calls of a cut answer, then an error.
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITIES = ("Rome", "Paris", "Berlin")
M_ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
M_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def kept_cities(text: str, parser) -> list[str]:
    """The cities of the calls a forced answer cut at the limit returns (what the OpenAI routes answer)."""
    from relax.serve.openai.chat import ChatFormat

    _, calls = ChatFormat.tool_calls(text, parser, WEATHER, cut=True)
    assert all(c["function"]["name"] == "get_weather" for c in calls or [])
    return [json.loads(c["function"]["arguments"])["city"] for c in calls or []]


# hand-written answers cut after two complete calls (inside the third), per format
CUT_AFTER_TWO = {
    # Review 3's answer (relax-serve, Mistral v0.3 template, max_tokens=80): it kept no call before
    "mistral v3, inside the third object": ("mistral", f'[TOOL_CALLS] [{M_ROME}, {M_PARIS}, {{"name": "get_weather", '
                                                       '"argument'),
    "mistral v3, after the second comma": ("mistral", f"[TOOL_CALLS] [{M_ROME}, {M_PARIS}, "),
    "mistral v3, before the closing bracket": ("mistral", f"[TOOL_CALLS] [{M_ROME}, {M_PARIS}"),
    "mistral v11": ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_weather[ARGS]'
                               '{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Be'),
    "mistral v11, inside the name": ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}'
                                                '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_we'),
    "llama3_json, a list": ("llama3_json", '<|python_tag|>[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
                                           '{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get'),
    "llama3_json, separated": ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                              '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name'),
    "deepseek_v3": ("deepseek_v3", DS_CALLS_BEGIN + deepseek_call("get_weather", '{"city": "Rome"}') + "\n"
                    + deepseek_call("get_weather", '{"city": "Paris"}') + "\n" + DS_CALL_BEGIN + "function" + DS_SEP
                    + 'get_weather\n```json\n{"ci'),
    "glm45": ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>\n"
                       "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
                       "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Ber"),
    "hermes": ("hermes", f"<tool_call>\n{M_ROME}\n</tool_call>\n<tool_call>\n{M_PARIS}\n</tool_call>\n<tool_call>\n"
                         '{"name": "get_weather", "arguments": {"city": "Be'),
    "qwen3_coder": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                                   "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                   "Paris\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_wea"),
}


@pytest.mark.parametrize("case", sorted(CUT_AFTER_TWO))
def test_a_forced_answer_cut_after_two_calls_keeps_both(case):
    """Each format, its answer cut inside the third call: the two complete calls, in order, then one error for the
    cut part (before, Mistral's v0.3 list and Llama's list were one error for the whole list: no call kept)."""
    fmt, text = CUT_AFTER_TWO[case]
    parsed = BUILTIN_PARSERS[fmt](text)
    assert kinds(parsed) == ["get_weather", "get_weather", "error"], (case, shape(parsed))
    assert [args for _, _, args in shape(parsed)[:2]] == [{"city": "Rome"}, {"city": "Paris"}]
    assert kept_cities(text, BUILTIN_PARSERS[fmt]) == ["Rome", "Paris"]


def test_a_cut_mistral_list_keeps_its_complete_objects_and_names_the_cut():
    from relax.agents.parsers import parse_mistral
    from relax.serve.openai.chat import ChatFormat

    cut = parse_mistral(f"[TOOL_CALLS] [{M_ROME}, {M_PARIS}")
    assert cut.errors == ["invalid JSON in [TOOL_CALLS]: the list of calls is not closed by ']' at character "
                          f"{len(M_ROME) + len(M_PARIS) + 3}"] and cut.content == ""
    inside = parse_mistral(f'Checking. [TOOL_CALLS] [{M_ROME}, {{"name": "get_weather", "arguments": {{"ci')
    assert kinds(inside) == ["get_weather", "error"] and inside.content == "Checking."
    assert inside.errors[0].startswith("invalid JSON in [TOOL_CALLS]: ")
    first = parse_mistral('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci')
    assert kinds(first) == ["error"] and kept_cities('[TOOL_CALLS] [{"name": "get_weather", "arg', parse_mistral) == []
    # a list that is malformed, not cut: its calls before the fault, then the error; an unforced (not cut) answer
    # with a malformed call is still all text
    missing_comma = f"[TOOL_CALLS] [{M_ROME}, {M_PARIS} {M_ROME}]"
    assert kinds(parse_mistral(missing_comma)) == ["get_weather", "get_weather", "error"]
    assert "expected ',' or ']'" in parse_mistral(missing_comma).errors[0]
    assert ChatFormat.tool_calls(missing_comma, parse_mistral, WEATHER) == (missing_comma, None)
    # a whole list, and text after it: as before
    whole = parse_mistral(f"[TOOL_CALLS] [{M_ROME}, {M_PARIS}] done")
    assert kinds(whole) == ["get_weather", "get_weather"] and whole.content == "done"


@pytest.mark.parametrize("fmt", sorted(BUILTIN_PARSERS))
def test_every_cut_of_a_forced_answer_keeps_the_calls_written_whole(fmt):
    """Three calls as the forced call's grammar writes them (`write_calls`), cut at every character: the calls kept
    are those whose text ends before the cut (where each call ends is the length of the answer of the calls up to
    it, less the closing of Mistral's list or DeepSeek's section), never more, never fewer."""
    from relax.agents.parsers import write_calls

    calls = [("get_weather", {"city": city}) for city in CITIES]
    full = write_calls(fmt, calls)
    closing = {"mistral": "]", "deepseek_v3": DS_CALLS_END}.get(fmt, "")
    ends = []
    for k in range(1, len(calls) + 1):
        upto = write_calls(fmt, calls[:k])
        assert upto.endswith(closing) and full.startswith(upto[:len(upto) - len(closing)])
        ends.append(len(upto) - len(closing))
    for cut in range(len(full) + 1):
        expected = [city for city, end in zip(CITIES, ends, strict=True) if end <= cut]
        assert kept_cities(full[:cut], BUILTIN_PARSERS[fmt]) == expected, (fmt, full[:cut])


MISTRAL_CUT = f'[TOOL_CALLS] [{M_ROME}, {M_PARIS}, {{"name": "get_weather", "argument'


class _CutEngine(CutEngine):
    """A cut answer (`tests.openai.scripted.CutEngine`) of `text`, asked for under the forced call's grammar."""

    def __init__(self, fmt, text: str):
        super().__init__(fmt.encode(text))

    def send(self, payloads: list[dict]) -> list[dict]:
        assert all("[TOOL_CALLS]" in p["sampling_params"]["ebnf"] for p in payloads)  # the forced call's grammar
        return super().send(payloads)


def test_a_cut_forced_mistral_answer_reaches_the_openai_client_with_its_complete_calls():
    """Review 3's case end to end: a Mistral v0.3 model (its template, `auto` -> mistral) forced to call
    (tool_choice "required") and cut by max_tokens inside its third call. The official client gets the two complete
    calls with finish_reason "length" and no content (before: no call, the raw `[TOOL_CALLS] [...` text as content),
    streamed too, and the Responses route its two function_call items, status incomplete. relax-serve's stream
    written as the tokens are drawn (no session) ends with the same two calls."""
    openai = pytest.importorskip("openai")
    from relax.agents.parsers import parse_mistral
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService
    from tests.agents.test_tool_templates_beyond_fixtures import MISTRAL_SPECIAL, MISTRAL_V3, tokenizer_with
    from tests.openai.scripted import limits

    tok = tokenizer_with(MISTRAL_V3, MISTRAL_SPECIAL)
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    assert fmt.tool_parser is parse_mistral
    engine = _CutEngine(fmt, MISTRAL_CUT)
    user = [{"role": "user", "content": "Weather in Rome and Paris?"}]
    forced = dict(model="policy", messages=user, tools=WEATHER, tool_choice="required", max_tokens=64)

    def cities(calls) -> list[str]:
        return [json.loads(c.function.arguments)["city"] for c in calls or []]

    gw = Gateway(OpenAIService(fmt, engine.send, model="policy", context_length=None, max_tokens=64)).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
        choice = client.chat.completions.create(**forced).choices[0]
        assert cities(choice.message.tool_calls) == ["Rome", "Paris"], choice.message
        assert (choice.message.content, choice.finish_reason) == (None, "length")
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)  # ids Mistral's template takes
        chunks = list(client.chat.completions.create(**forced, stream=True))
        streamed = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert cities(streamed) == ["Rome", "Paris"] and chunks[-1].choices[0].finish_reason == "length"
        assert not "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        resp = client.responses.create(model="policy", input="Weather in Rome and Paris?", tool_choice="required",
                                       tools=[{"type": "function", **WEATHER[0]["function"]}], max_output_tokens=64)
        assert resp.status == "incomplete"
        assert [(o.type, json.loads(o.arguments)["city"]) for o in resp.output] == [
            ("function_call", "Rome"), ("function_call", "Paris")]
    finally:
        gw.close()
    serve = OpenAIService(fmt, engine.send, model="policy", context_length=None, stream=engine.stream)
    chunks = list(serve.chat_stream({**forced, "stream": True}))
    deltas = [c["delta"] for ch in chunks for c in ch["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [json.loads(tc["function"]["arguments"])["city"] for tc in calls] == ["Rome", "Paris"]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")] == ["length"]


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


def parser_wanting_a_tokenizer(text: str, tokenizer) -> ParsedMessage:
    return ParsedMessage((), text)


@pytest.mark.parametrize("overrides, checks", [
    (["data=calculator", "rollout.max_turns=2"], ("model", "tokenizer", "agent")),  # the built-in tool loop
    (["rollout=sglang", "rollout.sglang.server=embedded", "rollout.max_turns=2",
      "data.openai_agent=relax.agents.openai_examples:plan_then_answer"], ("model", "tokenizer", "openai_agent")),
])
def test_a_parser_of_ones_own_that_cannot_take_the_text_is_refused_before_start(overrides, checks):
    """A parser whose signature does not fit `parser(text)` is refused by the pre-start checks (a dry run shows it,
    a start stops before Ray), naming data.tool_parser and the signature, instead of a TypeError from the rollout
    at the first turn it reads. A signature that fits (a keyword with a default too) passes."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    spec = f"{__name__}:parser_wanting_a_tokenizer"
    pre = preflight(load_config([*overrides, f"data.tool_parser={spec}"]), only=checks)
    assert pre.problems[checks[-1]] == (
        f"data.tool_parser={spec!r}: {spec}(text: 'str', tokenizer) -> 'ParsedMessage' cannot be called with the "
        "message's text alone (missing a required argument: 'tokenizer'); a tool-call parser is a function text -> "
        "relax.agents.parsers.ParsedMessage")
    pre = preflight(load_config([*overrides, f"data.tool_parser={__name__}:upper_parser"]), only=checks)
    assert pre.ok, pre.problems


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
