"""Constrained decoding in the embedded engine (`relax.rollout.grammar`): a random-weight model on a byte-level
vocabulary, many rows with their own random streams; every output a grammar constrains parses (json_schema) or
matches (regex), while the same rows without it do not; rows without a grammar are unchanged."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from relax.agents.parsers import (
    BUILTIN_PARSERS,
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    parse_hermes,
)
from relax.rollout.grammar import (
    TOOL_CALL_FORMATS,
    GrammarError,
    Grammars,
    GrammarSpec,
    ToolSchemaError,
    at_most_one_call,
    json_schema_spec,
    strict_calls,
    tool_call_ebnf,
)

pytest.importorskip("xgrammar")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import byte_level_engine  # noqa: E402  (the template tests' byte-level vocabulary)

SCHEMA = {"type": "object", "properties": {
    "count": {"type": "integer"}, "ok": {"type": "boolean"}, "unit": {"enum": ["celsius", "kelvin"]},
    "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}}, "required": ["count", "ok", "unit", "tag"],
    "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3}!"
ROWS = 50


@pytest.fixture(scope="module")
def setup():
    tok, engine = byte_level_engine()
    return tok, engine, Grammars(tok, len(tok)), tok.eos_token_id


def run(setup, spec, max_new=160, rows=ROWS, cut_ok=False, **kw):
    """`rows` samples of one prompt, each with its own stream, under `spec` (None: unconstrained)."""
    tok, engine, grammars, eos = setup
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    matchers = None if spec is None else [grammars.matcher(spec, [eos]) for _ in range(rows)]
    out = engine.generate([prompt], n_samples_per_prompt=rows, max_new_tokens=max_new, seed=7,
                          sample_ids=torch.arange(100, 100 + rows), grammars=matchers, **kw)
    texts = []
    for ids, mask, reason in zip(out.response_ids, out.response_mask, out.finish_reason, strict=True):
        ids = ids[mask.bool()].tolist()
        assert spec is None or cut_ok or (reason == "stop" and ids[-1] == eos), (reason, tok.decode(ids))
        texts.append(tok.decode([t for t in ids if t != eos]))
    return texts, out


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # the schema checked by hand
        return (set(obj) == set(SCHEMA["properties"]) and type(obj["count"]) is int and type(obj["ok"]) is bool
                and obj["unit"] in ("celsius", "kelvin") and re.fullmatch("[a-z]{1,4}", obj["tag"]) is not None)
    try:
        jsonschema.validate(obj, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def test_every_row_under_a_json_schema_validates_and_without_it_none_parses(setup):
    texts, out = run(setup, json_schema_spec(SCHEMA))
    assert all(valid(t) for t in texts), [t for t in texts if not valid(t)]
    assert len(set(texts)) > ROWS // 2  # the rows drew from their own streams
    assert torch.isfinite(out.rollout_logp).all() and (out.rollout_logp <= 0).all()
    free, _ = run(setup, None, max_new=40)  # negative control: the same streams, no grammar
    assert not any(valid(t) for t in free)


def test_every_row_under_a_regex_matches_and_without_it_none_does(setup):
    texts, _ = run(setup, GrammarSpec("regex", REGEX), max_new=40)
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    free, _ = run(setup, None, max_new=12)
    assert not any(re.fullmatch(REGEX, t) for t in free)


def test_a_grammar_after_reasoning_starts_at_the_token_after_think_end(setup):
    """`think_end` (a request's `require_reasoning`): each row samples freely until it draws the think-end tokens
    (here one byte, `#`, so that random rows reach it), then its grammar applies from the next token. The rows that
    drew `#` end in an answer the regex matches exactly after it; those that never did stay unconstrained. The same
    rows without `think_end` (the negative control) match the regex from their first token."""
    tok, engine, grammars, eos = setup
    think_end = tuple(tok.encode("#", add_special_tokens=False))
    assert len(think_end) == 1
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    spec = GrammarSpec("regex", REGEX)
    matchers = [grammars.matcher(spec, [eos], think_end) for _ in range(ROWS)]
    out = engine.generate([prompt], n_samples_per_prompt=ROWS, max_new_tokens=400, seed=7,
                          sample_ids=torch.arange(100, 100 + ROWS), grammars=matchers)
    thought = 0
    for ids, mask, m in zip(out.response_ids, out.response_mask, matchers, strict=True):
        ids = ids[mask.bool()].tolist()
        if think_end[0] not in ids:  # still reasoning at its end (a stop token or the limit): unconstrained
            assert m.reasoning
            continue
        thought += 1
        after = ids[ids.index(think_end[0]) + 1:]
        assert not m.reasoning and after and after[-1] == eos, tok.decode(ids)
        assert re.fullmatch(REGEX, tok.decode(after[:-1])), tok.decode(ids)
        assert not re.fullmatch(REGEX, tok.decode(ids[:-1]))  # the reasoning before it is free text
    assert thought >= ROWS // 4, thought
    texts, _ = run(setup, spec, max_new=40)  # no think_end: constrained from the first token
    assert all(re.fullmatch(REGEX, t) for t in texts)


def test_a_deferred_matcher_allows_every_token_until_the_whole_think_end_sequence(setup):
    """A think-end of several tokens: a partial match (`</thi` then text) keeps the row reasoning, the whole sequence
    starts the grammar, and from there the matcher masks as a fresh one does (`fill` bit for bit); `done` only once
    the answer after it is complete."""
    tok, _, grammars, eos = setup
    think_end = tuple(tok.encode("</think>", add_special_tokens=False))
    spec = GrammarSpec("regex", REGEX)
    m = grammars.matcher(spec, [eos], think_end)
    V = len(tok)
    words = (V + 31) // 32
    mask, fresh_mask = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
    for t in tok.encode("<think>{not json</thi and more", add_special_tokens=False):
        m.fill(mask, 0)
        assert (mask == -1).all() and m.accept(t) and not m.done
    assert m.accept(eos) and m.reasoning  # a stop token while reasoning is any other token (the engine ends the row)
    for t in think_end:
        assert m.reasoning and m.accept(t)
    assert not m.reasoning
    m.fill(mask, 0)
    grammars.matcher(spec, [eos]).fill(fresh_mask, 0)
    assert torch.equal(mask, fresh_mask) and not (mask == -1).all()
    assert not m.accept(tok.encode("#", add_special_tokens=False)[0])  # the grammar now refuses what it refuses
    for t in tok.encode("yes, 12!", add_special_tokens=False):
        assert m.accept(t)
    assert not m.done and m.accept(eos) and m.done


def test_after_reasoning_admits_a_think_block_then_what_the_spec_admits(setup):
    """`after_reasoning` on every kind of spec: with `opened` (the prompt opened `<think>`) the answer is reasoning up
    to `</think>`, at most two blanks, then the spec's answer; without it the block is optional. The reasoning is any
    text but a second block; after `</think>` only the spec's answer (the controls: the spec's own refusals)."""
    from relax.rollout.grammar import after_reasoning

    tok, _, grammars, eos = setup
    obj = '{"count": 3, "ok": true, "unit": "kelvin", "tag": "ab"}'
    call = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    cases = [(json_schema_spec(SCHEMA), obj, '{"count": "x"}'), (GrammarSpec("json_object"), '{"a": [1]}', "[1]"),
             (GrammarSpec("regex", REGEX), "no, 7!", "maybe"),
             (GrammarSpec("ebnf", tool_call_ebnf(TOOLS, "hermes", name="noop")), call, "text"),
             (at_most_one_call(TOOLS, "hermes"), "Sure. " + call, call + "\n" + call)]
    for spec, good, bad in cases:
        opened, optional = after_reasoning(spec, opened=True), after_reasoning(spec, opened=False)
        assert opened.kind == optional.kind == "structural_tag"
        assert accepts(grammars, spec, good, eos) and not accepts(grammars, spec, bad, eos, then_eos=False)
        think = "Let me think: {not json} <b>\n</think>"
        assert accepts(grammars, opened, think + "\n\n" + good, eos), spec
        assert accepts(grammars, optional, "<think>" + think + "\n" + good, eos), spec
        assert accepts(grammars, optional, good, eos), spec  # no block: constrained from the first token
        assert accepts(grammars, optional, "\n<think>" + think + "\n" + good, eos), spec  # GLM-4.5's newline first
        assert not accepts(grammars, optional, "\n" + good, eos, then_eos=False) or spec.kind == "structural_tag"
        for s in (opened, optional):
            assert not accepts(grammars, s, ("" if s is opened else "<think>") + think + bad, eos, then_eos=False)
        assert not accepts(grammars, opened, "a <think> b</think>" + good, eos)  # no second block
        if spec.kind != "structural_tag":  # (a structural tag's free text may start with blanks or close a block)
            assert not accepts(grammars, opened, good, eos)  # opened: reasoning first
            assert not accepts(grammars, opened, think + "\n\n\n" + good, eos, then_eos=False)  # two blanks at most


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 14},
                                     "unit": {"enum": ["c", "f"]}, "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["days", "unit"]}}}, {"type": "function", "function": {"name": "noop"}}]
CALL_ROWS = 24


def check_weather(call, text: str) -> None:
    """A call of `weather` whose arguments follow its schema."""
    assert call.name == "weather" and {"days", "unit"} <= set(call.arguments) <= {"days", "unit", "code"}, text
    days, unit = call.arguments["days"], call.arguments["unit"]
    assert type(days) is int and 1 <= days <= 14 and unit in ("c", "f"), text
    assert "code" not in call.arguments or re.fullmatch("[A-Z]{3}", call.arguments["code"]), text


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_a_forced_call_parses_against_the_tools_parameters_in_every_format(setup, fmt):
    """A named call (tool_choice naming a function) in each built-in parser's format: every row (its own stream)
    is exactly one call of it, read by the format's own parser with no error and no prose, its arguments following
    the schema (an enum and a pattern string as the XML formats' templates write them). The same rows without a
    grammar write no JSON at all (test_every_row_under_a_json_schema_..., the negative control)."""
    parse = BUILTIN_PARSERS[fmt]
    texts, _ = run(setup, GrammarSpec("ebnf", tool_call_ebnf(TOOLS, fmt, name="weather")), max_new=200,
                   rows=CALL_ROWS)
    for text in texts:
        parsed = parse(text)
        assert not parsed.errors and not parsed.content and len(parsed.calls) == 1, text
        check_weather(parsed.calls[0], text)
    assert len(set(texts)) > CALL_ROWS // 2  # the rows drew from their own streams


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45"])
def test_an_xml_call_reads_back_constrained_strings_as_the_strings(setup, fmt):
    """XML formats write a plain string as its text and a string whose schema constrains it (a pattern, a length
    limit; nullable too) as JSON; read with the tools' schemas (`apply_tool_schemas`, what the OpenAI routes and
    the tool loop read), every argument is the string itself and the call satisfies the schema. A default only
    annotates: such a string is text, as the templates write it, and stays the text written. Negative control: read
    as text, the JSON's quotes stayed in the string and broke its limit (the strict check then refused the call)."""
    import jsonschema

    from relax.agents.parsers import apply_tool_schemas

    params = {"type": "object", "properties": {
        # (limits as patterns: a random byte-level model draws bytes that are no UTF-8, which maxLength counts apart)
        "short": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "code": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        "maybe": {"type": ["string", "null"], "pattern": "^[0-9]{1,3}$"}}, "required": ["short", "code", "maybe"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params, "strict": True}}]
    texts, _ = run(setup, GrammarSpec("ebnf", tool_call_ebnf(tools, fmt, name="f")), max_new=300, rows=CALL_ROWS)
    for text in texts:
        parsed = apply_tool_schemas(BUILTIN_PARSERS[fmt](text), tools)
        assert not parsed.errors and len(parsed.calls) == 1, (text, parsed)
        args = parsed.calls[0].arguments
        jsonschema.validate(args, params)
        short = json.dumps(args["short"], ensure_ascii=False)
        assert short in text and args["short"] not in ("", None) or short == '""', text  # written as JSON
    plain = [{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
        "note": {"type": "string", "default": "x", "title": "Note"}}}}}]
    assert f"::= {'[^<]*'}" in tool_call_ebnf(plain, fmt, name="g")  # a default: written as text
    for written in ("hello", '"hello"'):
        call = BUILTIN_PARSERS[fmt](_xml_call(fmt, "g", "note", written))
        assert apply_tool_schemas(call, plain).calls[0].arguments == {"note": written}


def _xml_call(fmt: str, name: str, key: str, value: str) -> str:
    if fmt == "qwen3_coder":
        return f"<tool_call>\n<function={name}>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
    return f"<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"


def test_required_is_one_or_more_calls_of_the_listed_tools(setup):
    """tool_choice "required": calls of any listed tool, one or more; a random model may go on calling until its
    token limit (the calls before the cut are whole)."""
    texts, out = run(setup, GrammarSpec("ebnf", tool_call_ebnf(TOOLS, "hermes")), max_new=200, rows=CALL_ROWS,
                     cut_ok=True)
    names = []
    for text, reason in zip(texts, out.finish_reason, strict=True):
        parsed = parse_hermes(text)
        assert parsed.calls and (reason == "length" or not parsed.errors and not parsed.content), text
        for call in parsed.calls:
            names.append(call.name)
            if call.name == "weather":
                check_weather(call, text)
            else:
                assert call.name == "noop" and call.arguments == {}, text
    assert {"weather", "noop"} <= set(names) and len(names) > len(texts)  # both tools, and rows of several calls


def test_a_free_string_argument_of_an_xml_format_is_its_text():
    """qwen3_coder and glm45 write a plain string argument as its text (no quotes), as their templates do."""
    tools = [{"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    for fmt, written in (("qwen3_coder", "<parameter=text>\n"), ("glm45", "<arg_value>")):
        ebnf = tool_call_ebnf(tools, fmt)
        rule = next(line for line in ebnf.splitlines() if line.startswith("relax_call0_p0 ::="))
        assert rule == "relax_call0_p0 ::= [^<]*" and written in ebnf.replace("\\n", "\n")


def test_rows_without_a_grammar_are_unchanged_beside_constrained_rows(setup):
    """Half the rows constrained, half not: the unconstrained ones draw the tokens and log-probs of a call without
    any grammar, bit for bit (finished rows kept in the batch, so that both calls multiply batches of one shape)."""
    tok, engine, grammars, eos = setup
    prompt = tok.encode("Answer: ", add_special_tokens=False)
    kw = dict(n_samples_per_prompt=8, max_new_tokens=24, seed=3, sample_ids=torch.arange(8), temperature=0.8)
    engine.drop_finished = False
    try:
        plain = engine.generate([prompt], **kw)
        mixed = engine.generate([prompt], **kw, grammars=[grammars.matcher(GrammarSpec("regex", REGEX), [eos])
                                                          if i % 2 else None for i in range(8)])
    finally:
        engine.drop_finished = True
    for i in range(0, 8, 2):
        n = int(plain.response_mask[i].sum())
        assert int(mixed.response_mask[i].sum()) == n
        assert torch.equal(mixed.response_ids[i, :n], plain.response_ids[i, :n])
        assert torch.equal(mixed.rollout_logp[i, :n], plain.rollout_logp[i, :n])


def test_one_compile_per_distinct_spec_and_errors_name_the_grammar(setup):
    tok = setup[0]
    grammars = Grammars(tok, len(tok))
    for _ in range(3):
        grammars.matcher(json_schema_spec(SCHEMA), [1])
        grammars.matcher(json_schema_spec(json.dumps(SCHEMA)), [2])  # the same schema as text
    assert grammars.compiles == 1
    with pytest.raises(GrammarError, match="regex"):
        grammars.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        json_schema_spec("{nope")
    with pytest.raises(GrammarError, match="'my_parser' tool-call format"):
        tool_call_ebnf([{"type": "function", "function": {"name": "f"}}], "my_parser")
    with pytest.raises(GrammarError, match="the parameter 'n' of tool 'f'"):
        tool_call_ebnf([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": "x"}}}}}], "qwen3_coder")


ONE_CALL = {  # (one call of `noop`, the separator before a second) in each format, as its parser reads them
    "hermes": ('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "\n"),
    "qwen3_coder": ("<tool_call>\n<function=noop>\n</function>\n</tool_call>", "\n"),
    "glm45": ("<tool_call>noop\n</tool_call>", "\n"),
    "deepseek_v3": (f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}noop\n```json\n{{}}\n```{DS_CALL_END}"
                    f"{DS_CALLS_END}", "\n"),
    "llama3_json": ('{"name": "noop", "parameters": {}}', "; "),
    "mistral": ('[TOOL_CALLS] [{"name": "noop", "arguments": {}}]', ", "),  # two calls: one list
}


def accepts(grammars, spec, text: str, eos: int, *, then_eos: bool = True) -> bool:
    """Whether `spec` takes `text` token by token (and then the stop token)."""
    tok = grammars.tokenizer
    m = grammars.matcher(spec, [eos])
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and (not then_eos or m.accept(eos))


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_without_parallel_tool_calls_an_answer_holds_at_most_one_call(setup, fmt):
    """parallel_tool_calls=false (`at_most_one_call` for tool_choice auto; `tool_call_ebnf(parallel=False)` for a
    forced call): one call, then only the stop token; two calls are refused, while the parallel grammar (the negative
    control) takes them. Auto also takes free text, and (where calls have a marker) text before the call."""
    tok, _, grammars, eos = setup
    call, sep = ONE_CALL[fmt]
    two = call + sep + call if fmt not in ("deepseek_v3", "mistral") else call.replace(DS_CALLS_END, sep + call.split(
        DS_CALLS_BEGIN)[1]) if fmt == "deepseek_v3" else call[:-1] + sep + call[len("[TOOL_CALLS] ["):]
    assert len(BUILTIN_PARSERS[fmt](two).calls) == 2 and len(BUILTIN_PARSERS[fmt](call).calls) == 1
    auto = at_most_one_call(TOOLS, fmt)
    forced = GrammarSpec("ebnf", tool_call_ebnf(TOOLS, fmt, parallel=False))
    parallel = GrammarSpec("ebnf", tool_call_ebnf(TOOLS, fmt))
    for spec in (auto, forced):
        assert accepts(grammars, spec, call, eos)
        assert not accepts(grammars, spec, two, eos, then_eos=False)
    assert accepts(grammars, parallel, two, eos)
    assert accepts(grammars, auto, "The weather is fine.", eos)
    if fmt != "llama3_json":
        assert accepts(grammars, auto, "Let me look. " + call, eos)
    else:  # a message that starts like a call is one: no free text may
        assert not accepts(grammars, auto, '{"name": "weather"}', eos)


# ------------------------------------------------------------------------------------------------ strict tools
STRICT_TOOLS = [  # a strict tool beside one that is not
    {"type": "function", "function": {"name": "weather", "strict": True, "parameters": {
        "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["days", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


def written(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """`calls` ((name, arguments)) in `fmt`'s format as its template writes them (the XML formats: a string as its
    text, anything else as JSON; DeepSeek: one section, Mistral: one list), as one message."""
    def value(x):
        return x if isinstance(x, str) else json.dumps(x)

    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS] [" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"
    if fmt == "deepseek_v3":
        return DS_CALLS_BEGIN + "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{json.dumps(a)}\n```"
                                          f"{DS_CALL_END}" for n, a in calls) + DS_CALLS_END
    if fmt == "qwen3_coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{value(x)}\n</parameter>\n" for k, x in a.items()) + "</function>\n</tool_call>"
            for n, a in calls)
    return "\n".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{value(x)}</arg_value>\n"
                                                  for k, x in a.items()) + "</tool_call>" for n, a in calls)


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_strict_tools_constrain_every_call_the_text_opens(setup, fmt):
    """tool_choice auto with a strict tool (`strict_calls`, what openai-agents' and LangChain's strict tools get):
    free text, and every call a tool of the request's, a strict one's arguments following its schema; the calls
    that break it (an argument past its maximum, a required one missing, one not listed under additionalProperties
    false, a tool not offered) are refused, though each is a call to the format's own parser (the negative control:
    without the grammar they would be sampled, then refused by the strict check or answered as unknown). The tool
    that is not strict takes any arguments (any JSON object; XML formats: any text up to the call's end)."""
    tok, _, grammars, eos = setup
    parse = BUILTIN_PARSERS[fmt]
    spec = strict_calls(STRICT_TOOLS, fmt)
    good = [("weather", {"days": 3, "unit": "c"})]
    loose = [("note", {"text": 5, "extra": [True]})]  # not its schema: a call of a tool that is not strict
    bad = [[("weather", {"days": 30, "unit": "c"})], [("weather", {"days": 3})],
           [("weather", {"days": 3, "unit": "c", "city": "Oslo"})], [("forecast", {"days": 3, "unit": "c"})]]
    for calls in (good, loose, good + loose, *bad):
        assert [(c.name, c.arguments) for c in parse(written(fmt, calls)).calls] == calls  # the parser reads each
    for calls in (good, loose, good + loose, loose + good + good):
        assert accepts(grammars, spec, written(fmt, calls), eos), calls
    for calls in bad:
        assert not accepts(grammars, spec, written(fmt, calls), eos, then_eos=False), calls
    assert accepts(grammars, spec, "The weather is fine.", eos) and accepts(grammars, spec, "", eos)
    if fmt != "llama3_json":  # text before, between and after calls
        text = "Let me look. " + written(fmt, good) + " And a note: " + written(fmt, loose) + " Done."
        assert accepts(grammars, spec, text, eos)
        assert not accepts(grammars, spec, "Let me look. " + written(fmt, bad[0]), eos, then_eos=False)
    else:  # no marker: a message that starts like a call is calls, and text may not start like one
        assert not accepts(grammars, spec, '{"note": 1}', eos, then_eos=False)
    assert strict_calls([STRICT_TOOLS[1]], fmt) is None  # no strict tool: the answer is free


@pytest.mark.parametrize("spec", ["strict", "one"])
def test_free_text_cannot_write_a_call_the_grammar_does_not_see(setup, spec):
    """The parsers also read a Llama call after `<|python_tag|>` anywhere in the text, and a DeepSeek call outside a
    calls' section: the free text of the grammars that leave text free (`strict_calls`, `at_most_one_call`) may not
    write those markers, so no call escapes the grammar; without them (the control) the same text parses as a call."""
    tok, _, grammars, eos = setup
    make = strict_calls if spec == "strict" else at_most_one_call
    llama = "Sure. <|python_tag|>" + json.dumps({"name": "weather", "parameters": {"days": 99}})
    bare = "Sure. " + written("deepseek_v3", [("weather", {"days": 99})])[len(DS_CALLS_BEGIN):-len(DS_CALLS_END)]
    for fmt, text in (("llama3_json", llama), ("deepseek_v3", bare)):
        assert BUILTIN_PARSERS[fmt](text).calls
        assert not accepts(grammars, make(STRICT_TOOLS, fmt), text, eos, then_eos=False)
        assert accepts(grammars, make(STRICT_TOOLS, fmt), text.replace("<|", "< |").replace(DS_CALL_BEGIN, "("), eos)


def test_text_without_a_word_matches_exactly_the_texts_that_lack_it():
    """`_text_without` (the free text of the grammars: a call's end tag, `<|python_tag|>`) against a brute-force
    `word not in text` over random texts of the word's own characters and pieces of it."""
    import random

    import xgrammar as xgr

    from relax.rollout.grammar import _text_without

    rnd = random.Random(0)
    for word in ("</function>", "</tool_call>", "<|python_tag|>", "<a]b^-\\"):
        grammar = xgr.Grammar.from_ebnf(f"root ::= {_text_without(word)}")
        alphabet = sorted(set(word)) + ["x", "\n"]
        for _ in range(600):
            text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
            at = rnd.randint(0, len(text))
            text = text[:at] + word[:rnd.randint(len(word) - 2, len(word))] + text[at:]
            assert xgr.testing._is_grammar_accept_string(grammar, text) == (word not in text), (word, text)


def test_a_strict_schema_xgrammar_cannot_compile_names_its_tool(setup):
    """A strict tool whose schema xgrammar refuses (a look-behind pattern, which Python's re and jsonschema take) is
    a `ToolSchemaError` naming it (the chat routes' 400); the same schema on a tool that is not strict is free
    arguments, nothing to compile."""
    params = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}}}
    tools = [STRICT_TOOLS[0], {"type": "function", "function": {"name": "lookup", "parameters": params}}]
    for fmt in TOOL_CALL_FORMATS:
        assert strict_calls(tools, fmt) is not None
        tools[1]["function"]["strict"] = True
        with pytest.raises(ToolSchemaError, match="tool 'lookup'.*Lookbehind") as caught:
            strict_calls(tools, fmt)
        assert caught.value.tool == "lookup"
        del tools[1]["function"]["strict"]


def test_strict_calls_after_reasoning(setup):
    """A reasoning model's strict calls: free reasoning, then free text whose calls are constrained."""
    from relax.rollout.grammar import after_reasoning

    tok, _, grammars, eos = setup
    spec = after_reasoning(strict_calls(STRICT_TOOLS, "hermes"), opened=True)
    think = "a call: <tool_call>{not one}\n</think>\n\n"
    assert accepts(grammars, spec, think + "Sure. " + written("hermes", [("weather", {"days": 3, "unit": "f"})]), eos)
    assert not accepts(grammars, spec, think + written("hermes", [("weather", {"days": 0, "unit": "f"})]), eos,
                       then_eos=False)
