"""The de-quantized GGUF cache (`relax.models.gguf_cache`): converted once, reloaded bit for bit, never in the way.

The mechanics run on a tiny Qwen3 standing in for the de-quantized model (`_dequantize` replaced, counting its
calls); the real SmolLM2 file is in tests/backends/test_models.py (cached load equal to the fresh conversion).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from relax.config.schema import ModelConfig
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
