"""A grammar after the reasoning: relax-serve's engine server on a model whose chat template reasons (Qwen3's and
Qwen3.5's, `<think>` and `</think>` added tokens of a byte-level vocabulary, so that a random-weight model draws
`</think>` now and then) lets each sample reason freely and constrains it from after its `</think>`: on /generate
with SGLang's `require_reasoning`, on the chat route (response_format, forced tool calls) as SGLang's chat route
does, with the block optional where the model opens it itself (Qwen3), required where the prompt opened it (Qwen3.5),
absent where the prompt closed it (`enable_thinking: false`)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import openai
import pytest
import requests

pytest.importorskip("xgrammar")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import QWEN3, QWEN3_5, _byte_level_tokenizer  # noqa: E402  (the template tests' vocabulary, templates)

from tests.openai.serving import tiny_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_reasoning_grammar")]

REGEX = r"(yes|no), [0-9]{1,3}!"
ROWS = 24


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
USER = [{"role": "user", "content": "Is 7 prime?"}]
TOOLS = [{"type": "function", "function": {"name": "check", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]


def reasoning_tokenizer(template: str = QWEN3):
    tok = _byte_level_tokenizer()
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])  # as in Qwen's tokenizers: added tokens
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Qwen3's template: the model opens its <think> block itself (or answers without one)."""
    with tiny_server(tmp_path_factory.mktemp("qwen3-tokenizer"), reasoning_tokenizer(QWEN3)) as url:
        yield url


@pytest.fixture(scope="module")
def opened_server(tmp_path_factory):
    """Qwen3.5's template: its generation prompt opens `<think>\\n`, the model reasons first."""
    with tiny_server(tmp_path_factory.mktemp("qwen35-tokenizer"), reasoning_tokenizer(QWEN3_5)) as url:
        yield url


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def reasoning_of(choice) -> str | None:
    return (choice.message.model_extra or {}).get("reasoning_content")


def generate(server: str, **body) -> list[dict]:
    r = requests.post(server + "/generate", json={"text": "Answer: ", **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_require_reasoning_constrains_each_sample_after_its_think_end(server):
    """The samples that wrote `</think>` answer exactly the regex after it; the others never started their grammar
    (free text, cut at the limit or stopped). Without require_reasoning (the control) every sample matches the regex
    from its first token."""
    tok = reasoning_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    sp = {"regex": REGEX, "max_new_tokens": 600, "n": ROWS, "sampling_seed": 5}
    thought = 0
    for a in generate(server, sampling_params=sp, require_reasoning=True):
        ids = a["output_ids"]
        if end not in ids:
            continue
        thought += 1
        after = tok.decode(ids[ids.index(end) + 1:], skip_special_tokens=True)
        assert a["meta_info"]["finish_reason"]["type"] == "stop" and re.fullmatch(REGEX, after), a["text"]
    assert thought >= 3, thought
    for a in generate(server, sampling_params={**sp, "max_new_tokens": 40}):
        assert re.fullmatch(REGEX, a["text"]), a["text"]


def test_require_reasoning_must_be_a_boolean_and_needs_a_reasoning_template(server):
    r = requests.post(server + "/generate", json={"text": "x", "require_reasoning": "yes",
                                                  "sampling_params": {"regex": "a", "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and "require_reasoning" in r.text
    from relax.serve.sglang.request import RequestCodec, RequestError

    plain = _byte_level_tokenizer()  # no chat template: no reasoning
    codec = RequestCodec(plain, len(plain), 512, (plain.eos_token_id,))
    with pytest.raises(RequestError, match="require_reasoning=true: the model's chat template has no reasoning"):
        codec.parse({"input_ids": [1, 2], "require_reasoning": True, "sampling_params": {"regex": "a"}})
    assert codec.parse({"input_ids": [1, 2], "require_reasoning": False, "sampling_params": {"regex": "a"}}).rows


def test_qwen3_answers_under_a_response_format_may_reason_first(server):
    """Qwen3 (the block optional): some answers reason (reasoning_content) and then give the schema's JSON, others
    give the JSON at once; every finished answer's content validates. Before this, the grammar bound from the first
    token and no answer could reason (the control: `reasoned` would be 0)."""
    r = client_of(server).chat.completions.create(model="tiny", messages=USER, response_format=FORMAT, n=16, seed=2,
                                                  max_tokens=800)
    reasoned = 0
    for choice in r.choices:
        if choice.finish_reason != "stop":
            continue
        answer = json.loads(choice.message.content)
        assert set(answer) == {"ok", "n"} and type(answer["ok"]) is bool and type(answer["n"]) is int, answer
        reasoned += reasoning_of(choice) is not None
    assert reasoned >= 2 and sum(c.finish_reason == "stop" for c in r.choices) >= 8, r.choices


def test_enable_thinking_false_answers_from_the_first_token(server):
    """The prompt closed the block (`enable_thinking: false`): the JSON from the first token, no reasoning."""
    r = client_of(server).chat.completions.create(
        model="tiny", messages=USER, response_format=FORMAT, n=8, seed=2, max_tokens=200,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and reasoning_of(choice) is None
        json.loads(choice.message.content)


def test_qwen35_reasons_first_then_answers_the_format_or_the_forced_call(opened_server):
    """Qwen3.5 (the prompt opened `<think>`): every finished answer is reasoning_content then the constrained part:
    the schema's JSON, or the forced call (tool_calls). Before this, the opened block was left empty and the
    constrained answer became the content at once (the control: no reasoning_content)."""
    client = client_of(opened_server)
    r = client.chat.completions.create(model="tiny", messages=USER, response_format=FORMAT, n=8, seed=4,
                                       max_tokens=800)
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert len(done) >= 4, r.choices
    for choice in done:
        assert reasoning_of(choice) is not None, choice
        json.loads(choice.message.content)
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=8, seed=4,
                                       max_tokens=800)
    done = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert len(done) >= 4, r.choices
    for choice in done:
        assert reasoning_of(choice) is not None and choice.message.tool_calls[0].function.name == "check", choice
        assert type(json.loads(choice.message.tool_calls[0].function.arguments)["n"]) is int
