"""A grammar after the reasoning (`require_reasoning`, SGLang's reasoning grammar backend): relax-serve's engine
server on a model whose chat template reasons (Qwen3's, `<think>` and `</think>` added tokens of a byte-level
vocabulary, so that a random-weight model draws `</think>` now and then) lets each sample reason freely and
constrains it from the token after its `</think>`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import requests

pytest.importorskip("xgrammar")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import QWEN3, _byte_level_tokenizer  # noqa: E402  (the template tests' vocabulary and templates)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_reasoning_grammar")]

REGEX = r"(yes|no), [0-9]{1,3}!"
ROWS = 24


def reasoning_tokenizer():
    tok = _byte_level_tokenizer()
    tok.add_tokens(["<think>", "</think>"])  # as in Qwen3's tokenizer: added tokens the model writes
    tok.chat_template = QWEN3
    return tok


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    directory = tmp_path_factory.mktemp("reasoning-tokenizer")
    reasoning_tokenizer().save_pretrained(directory)
    cfg = load_config(["model=tiny", "model.dtype=float32", f"model.tokenizer={directory}",
                       "model.max_position_embeddings=2048", "seed=3"])
    srv = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    srv.start()
    try:
        srv.wait_ready(120)
        yield f"http://127.0.0.1:{srv.port}"
    finally:
        srv.shutdown()


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
