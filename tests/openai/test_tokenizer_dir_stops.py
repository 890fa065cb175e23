"""A model built from config with `model.tokenizer=<a tokenizer directory>` stops on the end tokens its chat template
writes, as one given a .gguf tokenizer or a `model.chat_template` does (`relax.data.tokenizer.stop_token_ids`): a
directory saved with a tokenizer's save_pretrained has no generation_config.json, and gpt-oss's `<|call|>` (the end
of a call) is no EOS. Without it a forced call went on into a second call or ended in `<|return|>`, which came back as
the content.

The reference is the fixture's own template (tests/agents/templates.py, gpt-oss's): the token it writes right after a
call's arguments, and the one after a final answer. End to end: relax-serve (EmbeddedServer, its real tiny engine,
in this process) with that directory, through the official `openai` client: a forced call ends at that token, one
call, no content.

Negative control: on the old code the directory's stop tokens were the EOS (`<|return|>`) only, and the forced call
(seed 2) sampled a second call after `<|call|>`.
"""

from __future__ import annotations

import pytest

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from tests.agents.templates import gpt_oss_tokenizer

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
ARGS = '{"a": 1, "b": 2}'


def _after(tok, messages: list[dict], text: str) -> int:
    """The token the template writes right after `text` at the end of `messages`' last assistant message."""
    rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    rest = rendered[rendered.rindex(text) + len(text):]
    return tok(rest, add_special_tokens=False)["input_ids"][0]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss")
    gpt_oss_tokenizer().save_pretrained(path)
    assert not (path / "generation_config.json").exists()
    return path


def test_a_tokenizer_directory_stops_on_its_template_s_end_tokens(directory, tmp_path):
    tok = gpt_oss_tokenizer()
    user = {"role": "user", "content": "1 + 2?"}
    call = _after(tok, [user, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}], ARGS)
    answer = _after(tok, [user, {"role": "assistant", "content": "It is 3."}], "It is 3.")
    assert tok.convert_ids_to_tokens([call, answer]) == ["<|call|>", "<|return|>"]  # (what the template writes)
    cfg = load_config(["model=tiny", f"model.tokenizer={directory}"])
    stops = stop_token_ids(cfg.model, load_tokenizer(cfg.model))
    assert {call, answer} <= set(stops)
    # the same stop tokens as the template given as model.chat_template (the documented path)
    (tmp_path / "t.jinja").write_text(tok.chat_template)
    own = load_config(["model=tiny", f"model.tokenizer={directory}", f"model.chat_template={tmp_path / 't.jinja'}"])
    assert stops == stop_token_ids(own.model, load_tokenizer(own.model))


def test_relax_serve_ends_a_forced_call_at_its_end_token(directory):
    from relax.serve.sglang.server import EmbeddedServer

    cfg = load_config(["model=tiny", "model.dtype=float32", f"model.tokenizer={directory}",
                       "model.max_position_embeddings=2048", "seed=3"])
    srv = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    srv.start()
    try:
        srv.wait_ready(120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0)
        choice = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "1 + 2?"}], tools=TOOLS, tool_choice="required",
            max_tokens=150, seed=2, logprobs=True).choices[0]
    finally:
        srv.shutdown()
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[-1] == "<|call|>" and tokens.count("<|call|>") == 1, "".join(tokens)
    assert (len(choice.message.tool_calls), choice.message.content, choice.finish_reason) == (1, None, "tool_calls")
