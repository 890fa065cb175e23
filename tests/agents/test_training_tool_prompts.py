"""With data.tools, training prompts list the tools as serving does: the chat template is given the tools' schemas
(a template with a `tools` variable renders them; for one without, Relax's tools prompt joins the system message),
so a model trained with data.tools sees the prompt relax-serve and the gateway render for the same messages and
tools (`relax.serve.openai.chat.ChatFormat.render`). Runs without data.tools keep their prompts byte for byte."""

from __future__ import annotations

import json

import pytest

from relax.agents.parsers import get_parser
from relax.agents.tools import CALCULATOR
from relax.config import load_config
from relax.data.tokenizer import load_tokenizer
from relax.runner.preflight import preflight
from relax.serve.openai.chat import ChatFormat, tools_prompt

# a ChatML template with a place for tools (as Qwen3's: the system turn lists them as JSON, then the call format)
NATIVE = ("{%- if tools %}{{ '<|im_start|>system\n' }}{% if messages[0].role == 'system' %}"
          "{{ messages[0].content + '\n\n' }}{% endif %}{{ '# Tools\n<tools>' }}{% for tool in tools %}"
          "{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n</tools>\nCall one as <tool_call>{\"name\": ..., "
          "\"arguments\": ...}</tool_call><|im_end|>\n' }}"
          "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
          "{%- endif %}{% for m in messages %}{% if m.role != 'system' %}"
          "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SCHEMAS = [CALCULATOR.schema]
QUESTION = "What is 3 + 4?"


def prompts(tmp_path, *extra: str) -> tuple[list, object]:
    """The training prompts of a run on a one-record JSONL file, and the run's config."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION, "label": "7"}) + "\n")
    cfg = load_config(["data=jsonl", f"data.path={data}", "rollout.max_prompt_len=2048",
                       "model.max_position_embeddings=4096", *extra])
    pre = preflight(cfg, only=("model", "tokenizer", "data"))
    assert pre.ok, pre.problems
    return list(pre.train_set), cfg


def gateway(cfg) -> ChatFormat:
    """The chat format relax-serve and the gateway render requests with, for this run's model and tool parser."""
    tok = load_tokenizer(cfg.model)
    return ChatFormat(tok, (tok.eos_token_id,), get_parser(cfg.data.tool_parser, tok))


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_template_with_a_tools_variable_renders_the_tools_schemas(tmp_path, system):
    template = tmp_path / "native.jinja"
    template.write_text(NATIVE)
    extra = [f"model.chat_template={template}", "data.tools=[calculator]", "rollout.max_turns=2"]
    items, cfg = prompts(tmp_path, *extra, *([f"data.system_prompt='{system}'"] if system else []))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": QUESTION}]
    text = items[0].prompt_text
    # the independent value: transformers' own rendering with tools=, and what the gateway renders
    tok = load_tokenizer(cfg.model)
    assert text == tok.apply_chat_template(messages, tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
    assert text == gateway(cfg).render(messages, SCHEMAS)
    assert json.dumps(CALCULATOR.schema) in text and text.startswith(f"<|im_start|>system\n{system or ''}")
    assert items[0].messages == messages  # what a reward or judge reads: the messages, without the tools listing


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_template_without_one_gets_relax_s_tools_prompt_as_the_gateway_adds_it(tmp_path, system):
    items, cfg = prompts(tmp_path, "data.tools=[calculator]", "rollout.max_turns=2",
                         *([f"data.system_prompt='{system}'"] if system else []))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": QUESTION}]
    listed = (f"{system}\n\n" if system else "") + tools_prompt(SCHEMAS, "hermes")
    # ChatML by hand: the system turn holds the system prompt, then the tools prompt
    assert items[0].prompt_text == (f"<|im_start|>system\n{listed}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    assert items[0].prompt_text == gateway(cfg).render(messages, SCHEMAS)


def test_prompts_without_data_tools_are_unchanged(tmp_path):
    items, cfg = prompts(tmp_path, "data.system_prompt='Be brief.'")
    tok = load_tokenizer(cfg.model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert items[0].prompt_text == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert items[0].prompt_ids == list(tok(items[0].prompt_text, add_special_tokens=False)["input_ids"])


def test_a_system_message_that_already_teaches_the_tools_is_kept_as_it_is():
    # data=calculator: its prompts' system message shows the call format and names the tool, so the template without
    # a tools variable (the tiny model's ChatML) gets no second listing, as the gateway would not add one
    cfg = load_config(["data=calculator", "data.num_prompts=2"])
    pre = preflight(cfg, only=("model", "tokenizer", "data"))
    assert pre.ok, pre.problems
    tok = load_tokenizer(cfg.model)
    for item in pre.train_set:
        assert item.prompt_text == tok.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=False)
