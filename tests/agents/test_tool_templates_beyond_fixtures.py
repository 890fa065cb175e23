"""`data.tool_parser=auto` on chat templates beyond the families of tests/agents/templates.py (relax/agents/parsers.py):

- Mistral's calls, in both forms its templates write (tokenizer v3's `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`,
  v11's `[TOOL_CALLS]NAME[ARGS]{...}`), rendered by the template itself, encoded with `[TOOL_CALLS]` a special token
  and decoded as the episode loop and the gateway decode a model's tokens, read by `auto`'s parser into the calls that
  were rendered; the gateway returns them to the official client as `tool_calls`;
- a template with a place for tools whose call format `auto` does not know is refused, naming data.tool_parser and
  its choices, by `get_parser`, by relax-serve at start and by relax-train's pre-start check (it was read as Hermes,
  and every call came back as plain text);
- Llama 3.2's `{"type": "function", "name": N, "parameters": {...}}` is a call (vLLM's and SGLang's llama3 parsers
  read it; Relax's read it as content).
"""

# ruff: noqa: E501  (the templates keep the lines they ship with)
from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from relax.agents.parsers import (
    ToolParserSpecError,
    get_parser,
    message_decoder,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)

# Mistral-7B-Instruct-v0.3's chat template (tokenizer v3; vLLM's examples/tool_chat_template_mistral_official.jinja):
# the tools in [AVAILABLE_TOOLS] before the last user message, an assistant's calls as `[TOOL_CALLS] [` then each
# call's function as JSON with its 9-character id, `]` and the end token.
MISTRAL_V3 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
    {%- if not tools is defined %}
        {%- set tools = none %}
    {%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{%- for message in loop_messages | rejectattr("role", "equalto", "tool") | rejectattr("role", "equalto", "tool_results") | selectattr("tool_calls", "undefined") %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "tool_calls" or message.tool_calls is defined %}
        {%- if message.tool_calls is defined %}
            {%- set tool_calls = message.tool_calls %}
        {%- else %}
            {%- set tool_calls = message.content %}
        {%- endif %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Mistral-Small-3.2-24B-Instruct-2506's chat template (tokenizer v11 on; also Magistral's and Devstral's), its
# default system message and image blocks left out: each call as `[TOOL_CALLS]NAME[ARGS]` and its arguments as JSON.
MISTRAL_V11 = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are Mistral Small 3." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools is defined and tools is not none and tools|length > 0 and message == (loop_messages | selectattr('role', 'equalto', 'user') | list)[-1] %}
            {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- endif %}
        {%- if message['tool_calls'] is defined and message['tool_calls'] is not none and message['tool_calls']|length > 0 %}
            {%- for tool in message['tool_calls'] %}
                {%- set arguments = tool['function']['arguments'] %}
                {%- if arguments is not string %}
                    {%- set arguments = arguments|tojson|safe %}
                {%- elif arguments == '' %}
                    {%- set arguments = '{}' %}
                {%- endif %}
                {{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + arguments }}
            {%- endfor %}
        {%- endif %}
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message['content']|string + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, assistant and tool roles are supported, got ' + message['role'] + '.') }}
    {%- endif %}
{%- endfor %}
"""

# Phi-4-mini-instruct's tool chat template (vLLM's examples/tool_chat_template_phi4_mini.jinja): it lists the tools and
# teaches `functools[{"name": ..., "arguments": ...}]`, a format no built-in parser reads; every role renders.
PHI4_MINI = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}

{%- if messages %}
<|system|>
{{ system_message }}
{%- if tools %}
In addition to plain text responses, you can choose to call one or more of the provided functions.

Use the following rule to decide when to call a function:
  * if the response can be generated from your internal knowledge (e.g., as in the case of queries like "What is the capital of Poland?"), do so
  * if you need external information that can be obtained by calling one or more of the provided functions, generate a function calls

If you decide to call functions:
  * prefix function calls with functools marker (no closing marker required)
  * all function calls should be generated in a single JSON list formatted as functools[{"name": [function name], "arguments": [function arguments as JSON]}, ...]
  * follow the provided JSON schema. Do not hallucinate arguments or values. Do to blindly copy values from the provided samples
  * respect the argument type formatting. E.g., if the type is number and format is float, write value 7 as 7.0
  * make sure you pick the right functions that match the user intent


        {%- for t in tools %}
            {{- t | tojson(indent=4) }}
            {{- "\n\n" }}
        {%- endfor %}
{%- endif %}<|end|>

    {%- for message in messages %}
        {%- if message.role != "system" %}
<|{{ message.role }}|>
            {%- if message.content and message.role == "tools" %}
{"result": {{ message.content }}}
            {%- elif message.content %}
{{ message.content }}
            {%- elif message.tool_calls %}
                {%- for call in message.tool_calls %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
                    {%- if not loop.last %},{% endif %}
                {%- endfor %}
            {%- endif %}<|end|>
        {%- endif %}
    {%- endfor %}<|assistant|>

{%- else %}
    {%- if system_message %}
<|system|>

{{ system_message }}<|end|>
    {%- endif %}
    {%- if prompt %}
<|user|>

{{ prompt }}<|end|>
    {%- endif %}<|assistant|>

{%- endif %}
{{ response }}
{%- if response %}<|user|>{% endif %}"""
PHI4_SPECIAL = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>")

MISTRAL_SPECIAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "<s>", "</s>")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}},
         {"type": "function", "function": {"name": "clock", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {}}}}]
CALLS = [("calculator", {"expression": "6 * 7"}), ("clock", {})]


def tokenizer_with(template: str, special: tuple[str, ...]) -> Any:
    """The tests' base vocabulary (tests/agents/templates.py) with `special` added as special tokens, as the
    family's own tokenizer has them, <s> and </s> its begin and end tokens where given, and `template`."""
    from tests.agents.templates import base_tokenizer

    tok = copy.deepcopy(base_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    if "</s>" in special:
        tok.bos_token, tok.eos_token = "<s>", "</s>"
    tok.chat_template = template
    return tok


def _rendered_answer(tok: Any) -> str:
    """The assistant turn that calls CALLS, as the template writes it (what the model was trained to write):
    between the last [/INST] and the end token."""
    calls = [{"type": "function", "id": f"call{k}abcd", "function": {"name": name, "arguments": args}}
             for k, (name, args) in enumerate(CALLS)]
    text = tok.apply_chat_template([{"role": "user", "content": "6*7, and the time?"},
                                    {"role": "assistant", "content": "", "tool_calls": calls}],
                                   tools=TOOLS, tokenize=False)
    answer = text[text.rindex("[/INST]") + len("[/INST]"):]
    return answer[:answer.index("</s>")]


@pytest.mark.parametrize("template, written", [
    (MISTRAL_V3, '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6 * 7"}, "id": "call0abcd"}, '
                 '{"name": "clock", "arguments": {}, "id": "call1abcd"}]'),
    (MISTRAL_V11, '[TOOL_CALLS]calculator[ARGS]{"expression": "6 * 7"}[TOOL_CALLS]clock[ARGS]{}'),
], ids=["tokenizer_v3", "tokenizer_v11"])
def test_auto_reads_the_calls_a_mistral_template_writes(template, written):
    from relax.agents.episode import EpisodeMaker

    tok = tokenizer_with(template, MISTRAL_SPECIAL)
    assert get_parser("auto", tok) is parse_mistral
    answer = _rendered_answer(tok)
    assert answer == written  # the template's own form (the expected text written out: an independent check)
    tokens = tok.encode(answer, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in tokens  # one special token, as the model writes it
    maker = EpisodeMaker(lambda: None, tok, max_turns=2, max_tool_errors=1)
    for text in (message_decoder(tok)(tokens), maker.decode(tokens)):  # what the gateway and the episode loop read
        parsed = get_parser("auto", tok)(text)
        assert [(c.name, c.arguments) for c in parsed.calls] == CALLS and not parsed.errors and parsed.content == ""
    # the control: decoded with every special token skipped, the marker and the calls with it are gone
    assert not parse_mistral(tok.decode(tokens, skip_special_tokens=True)).calls


def test_the_gateway_returns_a_mistral_models_call_to_the_openai_client():
    from relax.serve.openai.chat import ChatFormat
    from tests.openai.scripted import ScriptedGateways

    tok = tokenizer_with(MISTRAL_V3, MISTRAL_SPECIAL)
    gateways = ScriptedGateways()
    try:
        gw, script, session, client = gateways.make(ChatFormat(tok, (tok.eos_token_id,)), ["Sure. " + _rendered_answer(tok)])
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "6*7?"}],
                                               tools=TOOLS)
    finally:
        gateways.close()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS


def test_the_mistral_parser_reads_what_vllm_and_sglang_read():
    """The forms vLLM's and SGLang's mistral parsers take: text before the marker is the content, an "id" key is
    ignored, [CALL_ID] may precede [ARGS], a name without [ARGS] runs to the arguments' brace (vLLM); malformed JSON
    (a call cut at the length limit) is a malformed call, and text without the marker has no calls."""
    def shape(text: str) -> list:
        parsed = parse_mistral(text)
        return [(i.name, i.arguments) if hasattr(i, "name") else i.message.split(":")[0] for i in parsed.items] + \
            [parsed.content]

    assert shape('I will check.[TOOL_CALLS] [{"name": "clock", "arguments": {}, "id": "a1b2c3d4e"}]') == \
        [("clock", {}), "I will check."]
    assert shape('[TOOL_CALLS]calculator[CALL_ID]a1b2c3d4e[ARGS]{"expression": "1"}') == \
        [("calculator", {"expression": "1"}), ""]
    assert shape('[TOOL_CALLS]calculator{"expression": "1"}') == [("calculator", {"expression": "1"}), ""]
    assert shape('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expr') == ["invalid JSON in [TOOL_CALLS]", ""]
    assert shape('[TOOL_CALLS]calculator[ARGS]{"expr') == ["invalid JSON in the arguments of 'calculator'", ""]
    assert shape("The answer is [42].") == ["The answer is [42]."]


def test_auto_refuses_a_template_with_tools_in_a_format_it_does_not_know():
    from relax.agents.parsers import BUILTIN_PARSERS

    tok = tokenizer_with(PHI4_MINI, PHI4_SPECIAL)
    with pytest.raises(ToolParserSpecError) as info:
        get_parser("auto", tok)
    message = str(info.value)
    assert message.startswith("data.tool_parser=auto: the model's chat template has a place for tools")
    assert all(name in message for name in BUILTIN_PARSERS) and "package.module:function" in message
    assert get_parser("hermes", tok) is parse_hermes  # naming the parser is the way out
    # a template without a place for tools still gets Hermes, whose format Relax's tools prompt teaches
    from tests.agents.templates import SMOLLM2

    assert get_parser("auto", tokenizer_with(SMOLLM2, ())) is parse_hermes


@pytest.fixture(scope="module")
def phi4_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("phi4_mini_tokenizer")
    tokenizer_with(PHI4_MINI, PHI4_SPECIAL).save_pretrained(path)
    return str(path)


def test_relax_serve_refuses_it_at_start(phi4_dir):
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(load_config(["model=tiny", f"model.tokenizer={phi4_dir}"]), port=0)
    server.start()
    try:
        with pytest.raises(RuntimeError) as info:
            server.wait_ready(120)
    finally:
        server.shutdown()
    assert str(info.value).startswith("data.tool_parser=auto: the model's chat template has a place for tools")


def test_relax_train_refuses_it_before_anything_starts(phi4_dir, capfd):
    from tests.relax_train_inprocess import relax_train

    code, out, err = relax_train(["dry_run=true", "model=tiny", f"model.tokenizer={phi4_dir}", "data=calculator"],
                                 capfd)
    assert code != 0 and "data.tool_parser=auto: the model's chat template has a place for tools" in out + err
    # (the prompts list the calculator's schema in Phi-4-mini's tools section: 474 tokens)
    code, out, err = relax_train(["dry_run=true", "model=tiny", f"model.tokenizer={phi4_dir}", "data=calculator",
                                  "data.tool_parser=hermes", "rollout.max_prompt_len=480",
                                  "model.max_position_embeddings=1024"], capfd)
    assert code == 0, out + err  # named, the parser is the user's choice
    # an environment without tools never reads a call: nothing to refuse (it was, through EpisodeMaker.for_config)
    code, out, err = relax_train(["dry_run=true", "model=tiny", f"model.tokenizer={phi4_dir}", "data=guess_number"],
                                 capfd)
    assert code == 0, out + err


@pytest.mark.parametrize("written", [
    '{"type": "function", "name": "calculator", "parameters": {"expression": "6 * 7"}}',
    '<|python_tag|>{"type": "function", "name": "calculator", "parameters": {"expression": "6 * 7"}}',
])
def test_llama32s_type_function_object_is_a_call(written):
    """Llama 3.2's small models open the call object with "type": "function"; the tokens are decoded as the gateway
    decodes them (<|python_tag|> is a special token) and read by `auto`'s parser for the Llama 3.1 template."""
    from relax.serve.openai.chat import ChatFormat
    from tests.agents.templates import family_tokenizer

    tok = family_tokenizer("llama3_1")
    assert get_parser("auto", tok) is parse_llama3_json
    tokens = tok.encode(written, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|eot_id|>")]
    text = message_decoder(tok)(tokens)
    assert [(c.name, c.arguments) for c in parse_llama3_json(text).calls] == [CALLS[0]]
    content, calls = ChatFormat(tok, (tok.eos_token_id,)).tool_calls(text)
    assert not content and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [CALLS[0]]
    # an answer that is JSON with a "name" but no call's opening stays the answer
    assert not parse_llama3_json('{"type": "person", "name": "Ada"}').calls
