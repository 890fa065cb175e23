"""gpt-oss (harmony) from a GGUF file: a GGUF file carries one EOS and no generation_config.json, so the stop tokens of
a tokenizer read from one include the end tokens its chat template writes: harmony's `<|return|>` (an answer) and
`<|call|>` (a call), as gpt-oss's generation_config.json lists them for model.source=hf, and any template's end of turn
where the file's EOS is another token (a ChatML template on a file whose EOS is `<|endoftext|>`).

The GGUF files are written here (the `gguf` package, tokenizer metadata only) from the test vocabularies of
tests/agents/templates.py: the gpt-oss fixture (its template and special tokens) and SmolLM2's ChatML one; relax-serve
runs the tiny model built from config with the harmony file as model.tokenizer, and a forced call drawn by the real
model ends at its `<|call|>`.

Negative control: with stop_token_ids as before (the tokenizer's EOS alone for a GGUF tokenizer), the stop tokens were
[<|return|>] and [<|endoftext|>], and the forced call's request to the engine had no `<|call|>` among its stop tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.templates import SMOLLM2, base_tokenizer, gpt_oss_tokenizer

gguf = pytest.importorskip("gguf")
openai = pytest.importorskip("openai")


def write_gguf(tok, path: Path, eos: str, template: str) -> Path:
    """A GGUF file holding `tok`'s vocabulary (BPE: its tokens, merges, special tokens as control tokens), the EOS
    `eos` and the chat template `template`: what llama.cpp's converter writes of a tokenizer, without tensors."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab[eos])
    writer.add_chat_template(template)
    for add in (writer.add_context_length, writer.add_embedding_length, writer.add_block_count,
                writer.add_head_count, writer.add_feed_forward_length):
        add(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: a .gguf file}: gpt-oss's vocabulary and template with its EOS `<|return|>` (as gpt-oss's files hold),
    and SmolLM2's vocabulary with the ChatML template and the EOS `<|endoftext|>`; their converted tokenizers cached
    in this module's own directory."""
    directory = tmp_path_factory.mktemp("gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("RELAX_TOKENIZER_CACHE_DIR", str(directory / "cache"))
    harmony = gpt_oss_tokenizer()
    yield {"harmony": write_gguf(harmony, directory / "gpt-oss.gguf", "<|return|>", harmony.chat_template),
           "chatml": write_gguf(base_tokenizer(), directory / "chatml.gguf", "<|endoftext|>", SMOLLM2)}
    mp.undo()


def _stops(cfg, tok) -> list[str]:
    from relax.data.tokenizer import stop_token_ids

    return tok.convert_ids_to_tokens(list(stop_token_ids(cfg, tok)))


def test_a_harmony_gguf_stops_on_return_and_call(files):
    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import load_tokenizer

    for cfg in (ModelConfig(source="gguf", path=str(files["harmony"])),  # the model's own file
                ModelConfig(tokenizer=str(files["harmony"]))):  # a model built from config with its tokenizer
        tok = load_tokenizer(cfg)
        assert tok.eos_token == "<|return|>"
        assert sorted(_stops(cfg, tok)) == ["<|call|>", "<|return|>"]


def test_a_gguf_whose_eos_is_not_its_template_s_end_of_turn_stops_on_both(files):
    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import load_tokenizer

    cfg = ModelConfig(tokenizer=str(files["chatml"]))
    tok = load_tokenizer(cfg)
    assert tok.eos_token == "<|endoftext|>"
    assert sorted(_stops(cfg, tok)) == ["<|endoftext|>", "<|im_end|>"]


def test_a_forced_call_served_from_a_harmony_gguf_ends_at_its_call_token(files):
    """relax-serve on the tiny model with the harmony GGUF's tokenizer (its stop tokens as the server reads them, no
    override): a forced call drawn by the real model is one harmony call, its last token `<|call|>`, sent to the
    engine among the stop tokens."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    cfg = load_config(["model=tiny", "model.dtype=float32", f"model.tokenizer={files['harmony']}",
                       "model.max_position_embeddings=2048", "seed=3"])
    srv = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    payloads: list[dict] = []
    send = srv._send_openai

    def recording(batch: list[dict]) -> list[dict]:
        payloads.extend(batch)
        return send(batch)

    srv._send_openai = recording
    srv.start()
    try:
        srv.wait_ready(120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]
        answer = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, logprobs=True, seed=1)
    finally:
        srv.shutdown()
    tok = srv.tokenizer
    call = tok.convert_tokens_to_ids("<|call|>")
    assert call in payloads[-1]["sampling_params"]["stop_token_ids"]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    drawn = [t.token for t in choice.logprobs.content]
    assert drawn[-1] == "<|call|>" and "<|return|>" not in drawn
