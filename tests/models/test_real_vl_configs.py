"""The sized-down Qwen-VL checkpoints of the real-architecture smoke (tests/real_vl.py) against the published
configs: the tokenizer puts each special token at the id the published config.json names, and sizing down changes
sizes only (every structural field is the published one)."""

from __future__ import annotations

import pytest
from real_vl import REAL, qwen_vl_tokenizer, vl_config

# (config field, token) of the published configs
TOKEN_FIELDS = [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]
VISION_STRUCTURE = ["patch_size", "spatial_merge_size", "temporal_patch_size", "hidden_act", "in_channels",
                    "window_size", "num_position_embeddings"]
TEXT_STRUCTURE = ["vocab_size", "hidden_act", "rms_norm_eps"]


def _text(config):
    return config.get_text_config()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_special_tokens_have_the_published_ids(arch):
    tok = qwen_vl_tokenizer(arch)
    real = REAL[arch]
    text = real.get("text_config", real)
    for field, token in TOKEN_FIELDS:
        assert tok.convert_tokens_to_ids(token) == real[field], (field, token)
    assert tok.convert_tokens_to_ids("<|im_end|>") == text["eos_token_id"] == tok.eos_token_id
    assert tok.convert_tokens_to_ids("<|endoftext|>") == text["bos_token_id"]
    assert len(tok) <= text["vocab_size"]
    text_in = "a red square <|im_end|>"
    assert tok.decode(tok(text_in)["input_ids"]) == text_in


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_sizing_down_keeps_the_structure(arch):
    small, real = vl_config(arch), vl_config(arch, real_size=True)
    for name in VISION_STRUCTURE:
        assert getattr(small.vision_config, name, None) == getattr(real.vision_config, name, None), name
    for name in TEXT_STRUCTURE:
        assert getattr(_text(small), name) == getattr(_text(real), name), name
    s, r = _text(small), _text(real)
    head = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    assert head(s) == head(r) == 128
    assert s.rope_parameters == r.rope_parameters  # mrope sections (interleaved for Qwen3-VL) and theta
    assert s.num_attention_heads > s.num_key_value_heads  # GQA as the real one
    assert small.tie_word_embeddings and real.tie_word_embeddings
    assert s.num_hidden_layers < r.num_hidden_layers and s.hidden_size < r.hidden_size
    assert small.vision_config.depth < real.vision_config.depth
    if arch == "qwen2_5_vl":  # window attention with a full-attention block closing each group, as 7, 15, 23, 31
        blocks = small.vision_config.fullatt_block_indexes
        assert len(blocks) > 1 and blocks[-1] == small.vision_config.depth - 1
        vh = lambda c: c.hidden_size // c.num_heads  # noqa: E731
        assert vh(small.vision_config) == vh(real.vision_config) == 80
    else:  # deepstack: three tower layers feed the first three text layers
        layers = small.vision_config.deepstack_visual_indexes
        assert len(layers) == len(real.vision_config.deepstack_visual_indexes) == 3
        assert max(layers) < small.vision_config.depth and s.num_hidden_layers >= len(layers)
        vh = lambda c: c.hidden_size // c.num_heads  # noqa: E731
        assert vh(small.vision_config) == vh(real.vision_config) == 64
